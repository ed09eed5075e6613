/* lunar bench-comm: NCCL all-reduce latency and bandwidth per message size over the GPUs of one or
 * several nodes, one process per GPU (parallel/launch.h). It also checks the sums: every rank
 * contributes rank + 1, so every element must come back as world (world + 1) / 2.
 *   lunar bench-comm --tensor-parallel-size 8 [--nnodes 2 --node-rank 0 --master-addr HOST
 *                    --master-port 29500] [--max-bytes 1073741824] [--iters 20]
 * bus bandwidth = algbw * 2 (n - 1) / n (the ring all-reduce's bytes per link, as nccl-tests). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "cli/args.h"
#include "parallel/launch.h"

#if defined(LUNAR_HAVE_CUDA) && defined(LUNAR_HAVE_NCCL)
#include "backend/cuda/cuda_ops.h"

typedef struct bench_opts {
    long tp, nnodes, node_rank, port, iters;
    long max_bytes;
    const char *addr;
} bench_opts;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int bench_rank(const lunar_rank_info *ri, void *arg) {
    const bench_opts *o = arg;
    lunar_err err;
    lunar_comm *c = NULL;
    /* the arena also holds the runtime's two GEMM workspaces (cuda_rt.cu): room for them and slack */
    if (lunar_cuda_init(ri->local_rank, (size_t)o->max_bytes + ((size_t)512 << 20), &err) ||
        lunar_comm_nccl_init(&c, ri->id, ri->rank, ri->world, ri->local_rank, &err)) {
        fprintf(stderr, "rank %d: %s\n", ri->rank, err.msg);
        return 1;
    }
    float *buf = lunar_cuda_alloc((size_t)o->max_bytes);
    if (!buf) {
        fprintf(stderr, "rank %d: cannot allocate %ld bytes\n", ri->rank, o->max_bytes);
        return 1;
    }
    if (ri->rank == 0)
        printf("# all-reduce (sum, fp32), %d ranks, %s\n%12s %12s %12s %12s\n", ri->world, lunar_cuda_describe(),
               "bytes", "time_us", "algbw_GB/s", "busbw_GB/s");
    const float want = (float)ri->world * (float)(ri->world + 1) / 2.0f;
    int rc = 0;
    for (long bytes = 4096; bytes <= o->max_bytes && rc == 0; bytes *= 4) {
        const size_t n = (size_t)bytes / sizeof(float);
        float v = (float)(ri->rank + 1);
        uint32_t bits;
        memcpy(&bits, &v, 4);
        lunar_cuda_fill_u32(buf, bits, n);
        rc |= lunar_all_reduce_sum(c, buf, n, &err);
        float got[2];
        lunar_cuda_download(got, buf, sizeof(float));
        lunar_cuda_download(got + 1, buf + n - 1, sizeof(float));
        if (rc || got[0] != want || got[1] != want) {
            fprintf(stderr, "rank %d: all-reduce of %ld bytes: %s (got %g, %g; want %g)\n", ri->rank, bytes,
                    rc ? err.msg : "wrong sum", got[0], got[1], want);
            rc = 1;
            break;
        }
        for (int i = 0; i < 3; i++) rc |= lunar_all_reduce_sum(c, buf, n, &err); /* warm-up */
        rc |= lunar_barrier(c, &err);
        double t0 = now_s();
        for (long i = 0; i < o->iters && rc == 0; i++) rc |= lunar_all_reduce_sum(c, buf, n, &err);
        double us = (now_s() - t0) / (double)o->iters * 1e6;
        double alg = (double)bytes / (us * 1e-6) / 1e9;
        if (ri->rank == 0)
            printf("%12ld %12.1f %12.2f %12.2f\n", bytes, us, alg, alg * 2.0 * (ri->world - 1) / ri->world);
    }
    fflush(stdout);
    lunar_comm_free(c);
    return rc ? 1 : 0;
}

int lunar_cmd_bench_comm(int argc, char **argv) {
    bench_opts o = {.tp = 1, .nnodes = 1, .node_rank = 0, .port = 29500, .iters = 20, .max_bytes = 1L << 28,
                    .addr = "127.0.0.1"};
    lunar_err err;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = lunar_opt_value(argc, argv, &i, &err);
        int bad = !v;
        if (bad) {
        } else if (strcmp(a, "--tensor-parallel-size") == 0) bad = lunar_parse_int(a, v, 1, 4096, &o.tp, &err);
        else if (strcmp(a, "--nnodes") == 0) bad = lunar_parse_int(a, v, 1, 4096, &o.nnodes, &err);
        else if (strcmp(a, "--node-rank") == 0) bad = lunar_parse_int(a, v, 0, 4095, &o.node_rank, &err);
        else if (strcmp(a, "--master-port") == 0) bad = lunar_parse_int(a, v, 1, 65535, &o.port, &err);
        else if (strcmp(a, "--iters") == 0) bad = lunar_parse_int(a, v, 1, 100000, &o.iters, &err);
        else if (strcmp(a, "--max-bytes") == 0) bad = lunar_parse_int(a, v, 4096, 1L << 34, &o.max_bytes, &err);
        else if (strcmp(a, "--master-addr") == 0) o.addr = v;
        else bad = lunar_fail(&err, "unknown option '%s'", a) != 0;
        if (bad) {
            fprintf(stderr, "lunar bench-comm: %s\n", err.msg);
            return 1;
        }
    }
    if (o.tp % o.nnodes) {
        fprintf(stderr, "lunar bench-comm: --tensor-parallel-size %ld is not a multiple of --nnodes %ld\n", o.tp, o.nnodes);
        return 1;
    }
    lunar_dist_opts d = {(int)o.nnodes, (int)o.node_rank, (int)(o.tp / o.nnodes), o.addr, (int)o.port};
    if (lunar_launch_node(&d, lunar_nccl_get_unique_id, bench_rank, &o, 300000, &err)) {
        fprintf(stderr, "lunar bench-comm: %s\n", err.msg);
        return 1;
    }
    return 0;
}

#else

int lunar_cmd_bench_comm(int argc, char **argv) {
    (void)argc, (void)argv;
    fprintf(stderr, "lunar bench-comm: this lunar was built without CUDA and NCCL\n");
    return 1;
}

#endif
