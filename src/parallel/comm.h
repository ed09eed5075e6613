/* Collectives between the ranks of a tensor-parallel (or decode-context-parallel) group.
 * One interface, two transports:
 *  - CPU threads of one process (lunar_comm_cpu_world): ranks publish their buffers in shared
 *    memory and meet at a barrier; every reduction sums the ranks in order 0, 1, .., size-1, so a
 *    result is bitwise reproducible and identical on every rank;
 *  - NCCL (comm_nccl.c, built with CUDA and nccl.h): one process per GPU, buffers in device memory.
 * All calls are collective: every rank of the group makes the same calls in the same order with
 * the same counts. Errors are values (a failed NCCL call), never a crash. */
#ifndef LUNAR_PARALLEL_COMM_H
#define LUNAR_PARALLEL_COMM_H

#include <stddef.h>

#include "base/err.h"

typedef struct lunar_comm lunar_comm;

typedef struct lunar_comm_vt {
    int (*all_reduce_sum)(lunar_comm *c, float *buf, size_t n, lunar_err *err);
    int (*all_gather)(lunar_comm *c, const float *send, float *recv, size_t n, lunar_err *err);
    int (*all_to_all)(lunar_comm *c, const float *send, float *recv, size_t n, lunar_err *err);
    int (*barrier)(lunar_comm *c, lunar_err *err);
    int (*split)(lunar_comm *c, int color, int key, lunar_comm **out, lunar_err *err);
    void (*destroy)(lunar_comm *c);
} lunar_comm_vt;

struct lunar_comm {
    int rank, size;
    const lunar_comm_vt *vt;
    void *impl;
};

/* buf[n] <- sum over ranks of buf[n] (fp32), on every rank. */
static inline int lunar_all_reduce_sum(lunar_comm *c, float *buf, size_t n, lunar_err *err) {
    return c->vt->all_reduce_sum(c, buf, n, err);
}
/* recv[size][n] <- every rank's send[n], in rank order. */
static inline int lunar_all_gather(lunar_comm *c, const float *send, float *recv, size_t n,
                                   lunar_err *err) {
    return c->vt->all_gather(c, send, recv, n, err);
}
/* send[size][n]: chunk j goes to rank j; recv[size][n]: chunk j came from rank j. */
static inline int lunar_all_to_all(lunar_comm *c, const float *send, float *recv, size_t n,
                                   lunar_err *err) {
    return c->vt->all_to_all(c, send, recv, n, err);
}
static inline int lunar_barrier(lunar_comm *c, lunar_err *err) { return c->vt->barrier(c, err); }
/* A sub-communicator (collective over c): the ranks giving the same color form one new comm, ranked
 * by key (ties by their rank in c); *out is the caller's own handle, freed with lunar_comm_free
 * before or after c. The NCCL transport is ncclCommSplit, the CPU one a new thread world. */
static inline int lunar_comm_split(lunar_comm *c, int color, int key, lunar_comm **out, lunar_err *err) {
    return c->vt->split(c, color, key, out, err);
}

/* Decode context parallelism's groups inside a TP group of tp ranks (docs/parallel.md): DCP size
 * dcp divides tp, TP rank r is rank r % dcp of group r / dcp (D consecutive ranks), the layout the
 * CPU rank threads (model/tp_group.c) and lunar_shard_model use. */
static inline int lunar_dcp_group(int rank, int dcp) { return rank / dcp; }
static inline int lunar_dcp_group_rank(int rank, int dcp) { return rank % dcp; }
/* This rank's DCP comm out of its TP comm tp (collective over tp when 1 < dcp < tp->size: every rank
 * calls it): NULL for dcp 1, tp itself for dcp == tp->size (no second comm), else the split of tp
 * into the groups above. Release it with lunar_dcp_comm_free(tp, *out). */
int lunar_dcp_comm(lunar_comm *tp, int dcp, lunar_comm **out, lunar_err *err);
void lunar_dcp_comm_free(lunar_comm *tp, lunar_comm *dcp);
/* The groups in words for logs and `lunar plan`, e.g. tp 8, dcp 4: "2 groups of 4 consecutive
 * ranks [0-3] [4-7]; TP rank r is DCP rank r % 4" (more than 4 groups: the first 3, "..", the
 * last). buf holds at least 160 bytes; dcp 1: "none". */
void lunar_dcp_layout(char *buf, size_t n, int tp, int dcp);
static inline void lunar_comm_free(lunar_comm *c) {
    if (c) c->vt->destroy(c);
}

/* A world of `size` thread ranks sharing memory: comms[r] is rank r's handle, to be used by one
 * thread each. Each handle is freed with lunar_comm_free; the shared part goes with the last. */
void lunar_comm_cpu_world(lunar_comm **comms, int size);

/* ---------------------------------------------------------------- TCP rendezvous
 * Exchanges a small blob (the NCCL unique id) from rank 0 to every other rank of a multi-process,
 * possibly multi-node world, over plain TCP: rank 0 listens on master_addr:port and answers each
 * rank's hello ("LUNR", rank) with the blob; the others connect (retrying until timeout_ms, since
 * the master may start later) and read it. Every rank 1..world-1 must connect exactly once. */
typedef struct lunar_rdv_server {
    int fd;   /* listening socket */
    int port; /* the bound port (useful when asked for port 0) */
} lunar_rdv_server;

int lunar_rdv_listen(lunar_rdv_server *s, const char *addr, int port, lunar_err *err);
/* Serves the blob to ranks 1..world-1, each exactly once; closes the socket. */
int lunar_rdv_serve(lunar_rdv_server *s, int world, const void *blob, size_t len, int timeout_ms,
                    lunar_err *err);
int lunar_rdv_join(const char *addr, int port, int rank, void *blob, size_t len, int timeout_ms,
                   lunar_err *err);
/* The whole exchange for one rank: rank 0 listens and serves, the others join. */
int lunar_rendezvous(const char *addr, int port, int rank, int world, void *blob, size_t len,
                     int timeout_ms, lunar_err *err);

/* ---------------------------------------------------------------- NCCL (comm_nccl.c)
 * Available when built with CUDA and NCCL (LUNAR_HAVE_NCCL). One rank per process and GPU:
 * `device` is the CUDA device this process uses; the unique id comes from rank 0 through the
 * rendezvous. Buffers passed to an NCCL comm's collectives are device pointers; the vtable's calls
 * are synchronous on the stream the comm owns (the contract of the CPU transport), the _on calls
 * below are not. */
#define LUNAR_NCCL_ID_BYTES 128
int lunar_nccl_available(void);
int lunar_nccl_get_unique_id(void *id /* LUNAR_NCCL_ID_BYTES */, lunar_err *err);
int lunar_comm_nccl_init(lunar_comm **out, const void *id, int rank, int size, int device,
                         lunar_err *err);

/* Stream-ordered collectives of an NCCL comm (the GPU forward's, model/forward_cuda_tp.c): the
 * collective runs after the work already enqueued on `stream` (a cudaStream_t; NULL = the legacy
 * default stream) and that stream's later work runs after it, through two events and the comm's
 * own stream; the host waits for nothing, and the pattern can be captured into a CUDA graph (all
 * ranks must then capture the same sequence). A failure to enqueue is returned at once; a failure
 * while running shows at the next lunar_comm_nccl_check. -1 with err for a comm that is not NCCL. */
int lunar_comm_nccl_all_reduce_on(lunar_comm *c, float *buf, size_t n, void *stream, lunar_err *err);
int lunar_comm_nccl_all_gather_on(lunar_comm *c, const float *send, float *recv, size_t n, void *stream,
                                  lunar_err *err);
/* The comm's asynchronous error state (ncclCommGetAsyncError): 0, or -1 with its message. A step
 * calls it once, after it has waited for the device. */
int lunar_comm_nccl_check(lunar_comm *c, lunar_err *err);

/* Launcher arguments of a multi-process run: node `node_rank` of `nnodes`, `nproc_per_node`
 * ranks (GPUs) on each, rendezvous at master_addr:master_port. Global rank = node_rank *
 * nproc_per_node + local rank. */
typedef struct lunar_dist_opts {
    int nnodes, node_rank, nproc_per_node;
    const char *master_addr;
    int master_port;
} lunar_dist_opts;

#endif
