/* The engine on CUDA tensor-parallel ranks (issue 10): `lunar serve --backend cuda
 * --tensor-parallel-size N` runs one process per GPU (parallel/launch.h). Rank 0 runs the server
 * and the scheduler of engine.c over its shard; the followers run lunar_engine_follow, which
 * replays on their shards and caches every device operation rank 0's engine makes (state clear /
 * copy, the step's forward), received as parallel/step_wire.h messages on a socketpair. The
 * forwards then meet in the same NCCL collectives in the same order. Sampling stays on rank 0
 * (every rank holds the gathered logits; only rank 0 looks at them).
 *
 * This is the CUDA counterpart of the CPU rank threads (model/tp_group.h): engine.c drives both
 * through the same seam (state_clear, state_copy, one forward per step). */
#ifndef LUNAR_ENGINE_ENGINE_TP_H
#define LUNAR_ENGINE_ENGINE_TP_H

#include <stdint.h>

#include "lunar.h"
#include "model/forward_cuda.h"
#include "model/shard.h"
#include "parallel/comm.h"
#include "parallel/step_wire.h"

/* A rank process's place and its links (made by the launcher's caller before the fork). */
typedef struct lunar_tp_link {
    int rank, world, local_rank; /* local_rank = the GPU */
    unsigned char id[LUNAR_NCCL_ID_BYTES]; /* the NCCL unique id, from the rendezvous */
    int *fds; /* rank 0: fds[j - 1] talks to rank j (1 <= j < world); a follower: fds[0] talks to rank 0 */
} lunar_tp_link;

/* One CUDA rank: its comm (and its DCP group's: lunar_dcp_comm), its shards of the full model,
 * their upload. */
typedef struct lunar_cuda_rank {
    lunar_comm *comm, *dcp;
    lunar_model *rank_m;
    lunar_cuda_model *gpu;
} lunar_cuda_rank;

/* Joins the NCCL group, takes the rank's GPU (an arena of o->gpu_memory_utilization), shards full
 * (which must outlive r; expert parallelism per o->enable_expert_parallel) and uploads the shards. */
int lunar_cuda_rank_open(lunar_cuda_rank *r, const lunar_model *full, const lunar_engine_options *o,
                         const lunar_tp_link *l, lunar_err *err);
/* After the caches made on the rank are freed (the arena is a stack). */
void lunar_cuda_rank_close(lunar_cuda_rank *r);

/* What a rank can give its caches: bytes, and the sizes of a block and a KDA slot on it (they
 * differ between ranks when heads split unevenly). */
typedef struct lunar_rank_room {
    int64_t budget, block_bytes, slot_bytes;
} lunar_rank_room;

/* This process's room: the arena left after the step reserve, capped by o->cache_memory_bytes. */
lunar_rank_room lunar_cuda_rank_room(const lunar_model *rank_m, const lunar_engine_options *o);
/* The CUDA caches' LUNAR_CUDA_CACHE_* flags for o's --kv-cache-dtype and fp16 state option (every
 * rank makes the same caches). */
int lunar_engine_cuda_cache_flags(const lunar_engine_options *o);
/* Rank 0: every follower's room (rooms[j - 1] for rank j), waiting up to timeout_ms each. */
int lunar_tp_link_rooms(const lunar_tp_link *l, lunar_rank_room *rooms, int timeout_ms, lunar_err *err);
/* Rank 0: the message to every follower. */
int lunar_tp_link_send(const lunar_tp_link *l, const lunar_wire_msg *m, lunar_err *err);

/* A follower rank's whole life: load and shard the model, upload, report its room, make the caches
 * rank 0 chose, then replay rank 0's operations until STOP (returns 0) or a failure (-1: a forward
 * failed, or rank 0 went away without a STOP). */
int lunar_engine_follow(const lunar_engine_options *o, const lunar_tp_link *l, lunar_err *err);

#endif
