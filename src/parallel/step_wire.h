/* The messages rank 0 of a CUDA tensor-parallel server sends its follower ranks (issue 10).
 *
 * `lunar serve --backend cuda --tensor-parallel-size N` forks one process per GPU; rank 0 runs the
 * HTTP server and the scheduler (engine/engine.c), the others only replay, on their shards and
 * their own caches of the same geometry, what rank 0's engine does to its device: clear or copy a
 * KDA state slot, run a step's forward. Each such operation goes to every follower as one message
 * on a socketpair made by the launcher's parent before the fork:
 *  - a socket, not an NCCL broadcast: a follower waiting for work blocks in read() without
 *    spinning a GPU kernel, an idle server costs nothing, and a rank 0 that dies (or stops) closes
 *    the socket, so the followers see EOF and exit instead of hanging in a collective;
 *  - the step's description is small (ids, positions, block tables, slots: a few KiB) next to the
 *    step's own all-reduces, so its transport is not on the critical path.
 * A message is a 16-byte header {magic, kind, payload bytes (u64)} and a payload of 32-bit
 * little-endian integers (host order: the ranks share one node). Decoding checks every length
 * against the payload, so a torn or foreign message is an error, never an out-of-bounds read. */
#ifndef LUNAR_PARALLEL_STEP_WIRE_H
#define LUNAR_PARALLEL_STEP_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "model/forward.h"

#define LUNAR_WIRE_MAGIC 0x53524e4cu /* "LNRS" */
#define LUNAR_WIRE_MAX_PAYLOAD ((uint64_t)1 << 30)

typedef enum lunar_wire_kind {
    LUNAR_WIRE_READY = 1, /* follower -> rank 0 after its upload: [budget lo, budget hi] (cache bytes it can hold) */
    LUNAR_WIRE_INIT,      /* [n_blocks, n_slots]: the caches' geometry, chosen by rank 0 */
    LUNAR_WIRE_CLEAR,     /* [slot] */
    LUNAR_WIRE_COPY,      /* [to, from] */
    LUNAR_WIRE_STEP,      /* a forward: see lunar_wire_step_encode */
    LUNAR_WIRE_STOP,      /* clean shutdown */
} lunar_wire_kind;

/* A message as built or received: kind and payload words. */
typedef struct lunar_wire_msg {
    uint32_t kind;
    int32_t *w;   /* payload words */
    size_t n, cap;
} lunar_wire_msg;

void lunar_wire_reset(lunar_wire_msg *m, uint32_t kind);
void lunar_wire_push(lunar_wire_msg *m, int32_t v);
void lunar_wire_free(lunar_wire_msg *m);

/* STEP payload: n_seqs, then per sequence {n, pos0, slot, logits, n_blocks, ids[n], blocks[n_blocks]}
 * with n_blocks = the blocks covering [0, pos0 + n). */
void lunar_wire_step_encode(lunar_wire_msg *m, const lunar_batch_seq *seqs, int n_seqs);
/* The batch of a STEP message: *seqs (freed by the caller; ids and blocks point into m->w, which
 * must outlive them); *rows = the logits rows it asks for. Fails on any inconsistent length. */
int lunar_wire_step_decode(const lunar_wire_msg *m, lunar_batch_seq **seqs, int *n_seqs, int *rows, lunar_err *err);

/* Writes the whole message to the socket fd (retrying short writes and EINTR); a closed peer is
 * an error (EPIPE), not a SIGPIPE. */
int lunar_wire_send(int fd, const lunar_wire_msg *m, lunar_err *err);
/* Reads one message. Returns 1 on a message, 0 on a clean EOF before any byte (the peer closed),
 * -1 on an error (torn message, bad magic, oversized payload). timeout_ms < 0: wait forever. */
int lunar_wire_recv(int fd, lunar_wire_msg *m, int timeout_ms, lunar_err *err);

#endif
