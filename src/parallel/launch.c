/* Multi-process rank launcher (parallel/launch.h). fork() happens before any CUDA or NCCL call in
 * the parent, so every child initialises its own device context. */
#include "parallel/launch.h"

#include <pthread.h>
#include <stdlib.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
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
#ifdef _OPENMP
    /* The node's cores are shared by its ranks. Unless OMP_NUM_THREADS says otherwise, each rank
     * takes its share: OpenMP's spinning threads of oversubscribed processes stall each other
     * (measured: the host part of a dummy K3.1 load ran ~15x slower with two ranks x all cores). */
    if (!getenv("OMP_NUM_THREADS")) {
        const long cores = sysconf(_SC_NPROCESSORS_ONLN) / o->nproc_per_node;
        omp_set_num_threads(cores > 1 ? (int)cores : 1);
    }
#endif
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

/* Seconds the ranks have to exit after a stop signal or a failed rank before they are killed: a
 * rank blocked in a collective with a dead peer never returns on its own. */
#define LAUNCH_GRACE_S 10

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void signal_live(const pid_t *pids, const int *live, int n, int sig) {
    for (int k = 0; k < n; k++)
        if (live[k]) kill(pids[k], sig);
}

int lunar_launch_node_ex(const lunar_dist_opts *o_in, lunar_id_fn make_id, lunar_rank_fn fn, void *arg,
                         void (*after_fork)(void *arg), int timeout_ms, lunar_err *err) {
    lunar_dist_opts o = *o_in;
    if (lunar_dist_check(&o, err)) return -1;
    const int n = o.nproc_per_node;
    pid_t *pids = lunar_xcalloc((size_t)n, sizeof *pids);
    int *live = lunar_xcalloc((size_t)n, sizeof *live);
    /* SIGINT / SIGTERM / SIGCHLD are taken by sigtimedwait below; the ranks get the old mask back */
    sigset_t set, old;
    sigemptyset(&set);
    sigaddset(&set, SIGINT), sigaddset(&set, SIGTERM), sigaddset(&set, SIGCHLD);
    pthread_sigmask(SIG_BLOCK, &set, &old);
    fflush(stdout), fflush(stderr);
    for (int j = 0; j < n; j++) {
        pid_t p = fork();
        if (p < 0) {
            for (int k = 0; k < j; k++) kill(pids[k], SIGKILL), waitpid(pids[k], NULL, 0);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            free(pids), free(live);
            return lunar_fail(err, "cannot start rank process %d", j);
        }
        if (p == 0) {
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            int rc = rank_process(&o, j, make_id, fn, arg, timeout_ms);
            fflush(stdout), fflush(stderr);
            _exit(rc);
        }
        pids[j] = p, live[j] = 1;
    }
    if (after_fork) after_fork(arg);
    /* Wait for every rank in any order. The first failure stops the others (a dead rank leaves them
     * waiting in a collective); a stop signal is passed on to every rank; either way the ranks
     * still alive LAUNCH_GRACE_S later are killed, so the launcher never hangs. */
    int rc = 0, alive = n;
    double deadline = 0;
    while (alive) {
        struct timespec ts = {0, 200 * 1000 * 1000};
        const int sig = sigtimedwait(&set, NULL, &ts);
        if ((sig == SIGINT || sig == SIGTERM) && deadline == 0) {
            signal_live(pids, live, n, SIGTERM);
            deadline = mono_s() + LAUNCH_GRACE_S;
        }
        for (int j = 0; j < n; j++) {
            int st = 0;
            if (!live[j] || waitpid(pids[j], &st, WNOHANG) != pids[j]) continue;
            live[j] = 0, alive--;
            if (rc == 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
                rc = lunar_fail(err, "rank %d (process %d of node %d) %s %d", o.node_rank * n + j, j, o.node_rank,
                                WIFEXITED(st) ? "exited with status" : "was killed by signal",
                                WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
                signal_live(pids, live, n, SIGTERM);
                if (deadline == 0) deadline = mono_s() + LAUNCH_GRACE_S;
            }
        }
        if (alive && deadline > 0 && mono_s() > deadline) signal_live(pids, live, n, SIGKILL);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    free(pids), free(live);
    return rc;
}

int lunar_launch_node(const lunar_dist_opts *o, lunar_id_fn make_id, lunar_rank_fn fn, void *arg, int timeout_ms,
                      lunar_err *err) {
    return lunar_launch_node_ex(o, make_id, fn, arg, NULL, timeout_ms, err);
}
