/* Multi-process rank launcher (parallel/launch.h). fork() happens before any CUDA or NCCL call in
 * the parent, so every child initialises its own device context. */
#include "parallel/launch.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int lunar_dist_check(lunar_dist_opts *o, lunar_err *err) {
    if (o->nnodes < 1) return lunar_fail(err, "--nnodes %d: must be at least 1", o->nnodes);
    if (o->node_rank < 0 || o->node_rank >= o->nnodes)
        return lunar_fail(err, "--node-rank %d: must be in [0, %d)", o->node_rank, o->nnodes);
    if (o->nproc_per_node < 1) return lunar_fail(err, "%d ranks per node: must be at least 1", o->nproc_per_node);
    if (!o->master_addr) o->master_addr = "127.0.0.1";
    if (!o->master_port) o->master_port = 29500; /* torch.distributed's default */
    if (o->master_port < 1 || o->master_port > 65535)
        return lunar_fail(err, "--master-port %d: out of range", o->master_port);
    return 0;
}

/* The body of one rank process: its place, the id exchange, then fn. */
static int rank_process(const lunar_dist_opts *o, int local, lunar_id_fn make_id, lunar_rank_fn fn,
                        void *arg, int timeout_ms) {
    lunar_rank_info ri;
    memset(&ri, 0, sizeof ri);
    ri.node_rank = o->node_rank, ri.local_rank = local;
    ri.world = o->nnodes * o->nproc_per_node;
    ri.rank = o->node_rank * o->nproc_per_node + local;
    lunar_err err;
    if (ri.rank == 0 && make_id(ri.id, &err)) {
        fprintf(stderr, "rank 0: %s\n", err.msg);
        return 1;
    }
    if (lunar_rendezvous(o->master_addr, o->master_port, ri.rank, ri.world, ri.id, sizeof ri.id, timeout_ms,
                         &err)) {
        fprintf(stderr, "rank %d: %s\n", ri.rank, err.msg);
        return 1;
    }
    return fn(&ri, arg);
}

int lunar_launch_node(const lunar_dist_opts *o_in, lunar_id_fn make_id, lunar_rank_fn fn, void *arg,
                      int timeout_ms, lunar_err *err) {
    lunar_dist_opts o = *o_in;
    if (lunar_dist_check(&o, err)) return -1;
    const int n = o.nproc_per_node;
    pid_t *pids = lunar_xcalloc((size_t)n, sizeof *pids);
    fflush(stdout), fflush(stderr);
    for (int j = 0; j < n; j++) {
        pid_t p = fork();
        if (p < 0) {
            for (int k = 0; k < j; k++) kill(pids[k], SIGTERM), waitpid(pids[k], NULL, 0);
            free(pids);
            return lunar_fail(err, "cannot start rank process %d", j);
        }
        if (p == 0) {
            int rc = rank_process(&o, j, make_id, fn, arg, timeout_ms);
            fflush(stdout), fflush(stderr);
            _exit(rc);
        }
        pids[j] = p;
    }
    int rc = 0;
    for (int j = 0; j < n; j++) {
        int st = 0;
        waitpid(pids[j], &st, 0);
        if (rc == 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
            rc = lunar_fail(err, "rank %d (process %d of node %d) %s %d", o.node_rank * n + j, j, o.node_rank,
                            WIFEXITED(st) ? "exited with status" : "was killed by signal",
                            WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
            /* a rank that died leaves the others waiting in a collective: stop them */
            for (int k = j + 1; k < n; k++) kill(pids[k], SIGTERM);
        }
    }
    free(pids);
    return rc;
}
