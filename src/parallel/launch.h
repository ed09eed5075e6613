/* Starting the ranks of a multi-process (one process per GPU), possibly multi-node run.
 * On each node `lunar ... --tensor-parallel-size N --nnodes K --node-rank i --master-addr A
 * --master-port P` forks N/K processes; process j of node i is global rank i*(N/K)+j and uses
 * GPU j. Global rank 0 makes the NCCL unique id (in its own process: NCCL's bootstrap root
 * listens there) and hands it to the others through the TCP rendezvous of parallel/comm.h. */
#ifndef LUNAR_PARALLEL_LAUNCH_H
#define LUNAR_PARALLEL_LAUNCH_H

#include "parallel/comm.h"

typedef struct lunar_rank_info {
    int rank, world;            /* global */
    int node_rank, local_rank;  /* local_rank = the GPU index on the node */
    unsigned char id[LUNAR_NCCL_ID_BYTES];
} lunar_rank_info;

/* What a rank runs once it knows its place and the id; its return value is the process's exit
 * status (0 = success). */
typedef int (*lunar_rank_fn)(const lunar_rank_info *ri, void *arg);
/* Rank 0's id maker: lunar_nccl_get_unique_id for NCCL. */
typedef int (*lunar_id_fn)(void *id, lunar_err *err);

/* Checks and completes o (world = nnodes * nproc_per_node; master defaults 127.0.0.1:29500). */
int lunar_dist_check(lunar_dist_opts *o, lunar_err *err);

/* Forks o->nproc_per_node rank processes on this node, waits for all, and returns 0 when every one
 * exited 0; otherwise -1 naming the first failed rank. timeout_ms bounds the rendezvous. The first
 * rank to fail makes the launcher send SIGTERM to the others; SIGINT / SIGTERM to the launcher go
 * to every rank; ranks still alive 10 s after either are killed (no hang on a rank stuck in a
 * collective with a dead peer). */
int lunar_launch_node(const lunar_dist_opts *o, lunar_id_fn make_id, lunar_rank_fn fn, void *arg,
                      int timeout_ms, lunar_err *err);
/* As lunar_launch_node; after_fork(arg) runs in the launcher once every rank is forked (to close
 * the launcher's copies of descriptors only the ranks should hold). */
int lunar_launch_node_ex(const lunar_dist_opts *o, lunar_id_fn make_id, lunar_rank_fn fn, void *arg,
                         void (*after_fork)(void *arg), int timeout_ms, lunar_err *err);

#endif
