/* lunar bench MODEL: offline throughput of the forward (no HTTP, no scheduler): prefill tokens/s
 * at given input lengths and decode TPOT at given batch sizes and contexts, each beside its
 * physical floor (cli/bench_floor.h), plus an optional per-op profile of one decode step (CPU, or CUDA: measured in extra
 * steps, as its regions synchronize the device).
 *
 * Method. Prefill: one sequence of n random token ids from empty caches (chunks of --prefill-chunk
 * tokens when given), timed end to end after --warmup-iters untimed runs of the same length (1 by
 * default, as vLLM's bench latency: the first run of a length pays one-time costs, e.g. cuBLASLt's
 * algorithm search for each new GEMM shape, ~0.18 s per length on the H200). Decode at (B, ctx): B sequences whose caches already
 * hold ctx positions; the latent rows, index keys and KDA states are filled with small values
 * instead of being computed (a decode step's cost does not depend on them, and prefilling
 * 64 x 128K tokens would take longer than the measurement), then --steps steps of one token per
 * sequence after two untimed warm-up steps (on CUDA the second captures the step's CUDA graph, which
 * the timed steps replay; --enforce-eager runs them without). TPOT = mean step time. Logits come back to the host
 * every step, as the engine's do. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend/backend.h"
#include "cli/args.h"
#include "cli/bench_floor.h"
#include "cli/commands.h"
#include "model/forward.h"
#include "model/dummy.h"
#include "model/dummy_gen.h"
#include "model/forward_cuda.h"
#include "model/profile.h"
#include "model/forward_cuda_tp.h"
#include "model/shard.h"
#include "parallel/launch.h"
#include "ops.h"
#ifdef LUNAR_HAVE_CUDA
#include "backend/cuda/cuda_glue.h"
#endif

int lunar_cmd_bench_serve(int argc, char **argv);

static const char *USAGE =
    "usage: lunar bench MODEL [--backend cpu|cuda] " LUNAR_LOAD_OPTIONS_USAGE "\n"
    "         [--input-lens 1024,8192,32768,131072] [--batch-sizes 1,8,32,64] [--contexts 1024,8192,32768,131072]\n"
    "         [--max-len N] [--steps N] [--warmup-iters N] [--prefill-chunk N] [--profile] [--enforce-eager]\n"
    "         [--json FILE] [--bandwidth-gbs GB/s] [--peak-tflops T] [--project-layers N] [--kv-cache-dtype auto|bf16|fp8]\n"
    "         [--kda-state-dtype fp32|fp16]\n"
    "         [--tensor-parallel-size N [--decode-context-parallel-size D] [--enable-expert-parallel]\n"
    "          [--master-port P]]  (--backend cuda: one rank process per GPU, rank 0 reports per-rank figures;\n"
    "         the collectives are real; DCP: groups of D consecutive ranks, D dividing N)\n"
    "       lunar bench serve --help   (drive a running server, as vllm bench serve)\n";

#define MAX_LIST 32

typedef struct bench_opts {
    const char *model, *backend, *json;
    lunar_load_options load;
    int32_t *in_lens, *batches, *contexts;
    int n_in, n_b, n_ctx;
    long max_len, steps, chunk, project, warmup;
    int profile, eager;
    int kv_fp8; /* --kv-cache-dtype fp8: the FP8 latent cache (CUDA: 1 byte per element; CPU: emulated) */
    int state_fp16; /* --kda-state-dtype fp16: fp16 KDA states (CUDA: 2 bytes per element; CPU: emulated) */
    double bw_gbs, peak_tflops;
    long tp, master_port; /* CUDA tensor parallelism: rank processes */
    long dcp;             /* --decode-context-parallel-size: the latent cache sharded over the TP ranks */
    int ep;
} bench_opts;

/* This process is a CUDA rank of `lunar bench --tensor-parallel-size N` (set before bench_body):
 * its place, and its comms (TP; DCP: lunar_dcp_comm's), made at the first load and kept for the
 * second depth. */
static struct {
    int on;
    lunar_rank_info ri;
    lunar_comm *comm, *dcp;
} tp_rank;

static double now_s(void) { return lunar_prof_now(); }

static int parse(int argc, char **argv, bench_opts *o, lunar_err *err) {
    const char *in = "1024,8192,32768,131072", *bs = "1,8,32,64", *ctx = "1024,8192,32768,131072";
    o->max_len = 131072;
    o->steps = 8;
    o->warmup = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (a[0] != '-') {
            if (o->model) return lunar_fail(err, "unexpected argument '%s'", a);
            o->model = a;
            continue;
        }
        if (strcmp(a, "--profile") == 0) { o->profile = 1; continue; }
        if (strcmp(a, "--enable-expert-parallel") == 0) { o->ep = 1; continue; }
        if (strcmp(a, "--enforce-eager") == 0) { o->eager = 1; continue; }
        if (!(v = lunar_opt_value(argc, argv, &i, err))) return -1;
        if (strcmp(a, "--backend") == 0) o->backend = v;
        else if (strcmp(a, "--json") == 0) o->json = v;
        else if (strcmp(a, "--kv-cache-dtype") == 0) {
            if (strcmp(v, "fp8") && strcmp(v, "fp8_e4m3") && strcmp(v, "bf16") && strcmp(v, "auto"))
                return lunar_fail(err, "--kv-cache-dtype: '%s' is not one of auto, bf16, fp8", v);
            o->kv_fp8 = strncmp(v, "fp8", 3) == 0;
        } else if (strcmp(a, "--kda-state-dtype") == 0) {
            if (strcmp(v, "fp16") && strcmp(v, "fp32")) return lunar_fail(err, "--kda-state-dtype: '%s' is not fp32 or fp16", v);
            o->state_fp16 = strcmp(v, "fp16") == 0;
        }
        else if (strcmp(a, "--input-lens") == 0) in = v;
        else if (strcmp(a, "--batch-sizes") == 0) bs = v;
        else if (strcmp(a, "--contexts") == 0) ctx = v;
        else if (strcmp(a, "--max-len") == 0) { if (lunar_parse_int(a, v, 1, 1 << 24, &o->max_len, err)) return -1; }
        else if (strcmp(a, "--steps") == 0) { if (lunar_parse_int(a, v, 1, 100000, &o->steps, err)) return -1; }
        else if (strcmp(a, "--warmup-iters") == 0) { if (lunar_parse_int(a, v, 0, 100, &o->warmup, err)) return -1; }
        else if (strcmp(a, "--prefill-chunk") == 0) { if (lunar_parse_int(a, v, 0, 1 << 24, &o->chunk, err)) return -1; }
        else if (strcmp(a, "--tensor-parallel-size") == 0 || strcmp(a, "-tp") == 0) { if (lunar_parse_int(a, v, 1, 1024, &o->tp, err)) return -1; }
        else if (strcmp(a, "--decode-context-parallel-size") == 0 || strcmp(a, "-dcp") == 0) { if (lunar_parse_int(a, v, 1, 1024, &o->dcp, err)) return -1; }
        else if (strcmp(a, "--master-port") == 0) { if (lunar_parse_int(a, v, 1, 65535, &o->master_port, err)) return -1; }
        else if (strcmp(a, "--project-layers") == 0) { if (lunar_parse_int(a, v, 1, 4096, &o->project, err)) return -1; }
        else if (strcmp(a, "--bandwidth-gbs") == 0) { if (lunar_parse_float(a, v, 1e-3, 1e6, &o->bw_gbs, err)) return -1; }
        else if (strcmp(a, "--peak-tflops") == 0) { if (lunar_parse_float(a, v, 1e-6, 1e6, &o->peak_tflops, err)) return -1; }
        else {
            int h = lunar_parse_load_option(a, v, &o->load, err);
            if (h < 0) return -1;
            if (!h) return lunar_fail(err, "unknown option '%s'", a);
        }
    }
    if (!o->model) return lunar_fail(err, "missing MODEL (a model directory, or a config with --load-format dummy)");
    if (o->dcp < 1) o->dcp = 1;
    const long tp = o->tp > 1 ? o->tp : 1;
    if (o->dcp > tp || tp % o->dcp != 0) /* the config's checks (an MLA layer) follow at the load */
        return lunar_fail(err, "--decode-context-parallel-size %ld must divide --tensor-parallel-size %ld (DCP "
                               "shards the latent cache over the TP ranks)", o->dcp, tp);
    if (lunar_parse_ids(in, &o->in_lens, &o->n_in, err) || lunar_parse_ids(bs, &o->batches, &o->n_b, err) ||
        lunar_parse_ids(ctx, &o->contexts, &o->n_ctx, err))
        return lunar_fail_prefix(err, "--input-lens/--batch-sizes/--contexts: "), -1;
    for (int i = 0; i < o->n_b; i++)
        if (o->batches[i] < 1 || o->batches[i] > 4096) return lunar_fail(err, "--batch-sizes: %d outside [1, 4096]", o->batches[i]);
    for (int i = 0; i < o->n_in; i++)
        if (o->in_lens[i] < 1) return lunar_fail(err, "--input-lens: lengths must be positive");
    return 0;
}

/* ---- one backend behind one interface: the forward API of the CPU or the CUDA model ---- */

typedef struct runner {
    const lunar_model *m;
    int cuda, kv_fp8, state_fp16;
    lunar_cuda_model *g;
    lunar_kv_pool kv;
    lunar_state_pool st;
    lunar_cuda_caches cc;
    int have_caches;
} runner;

/* CPU caches are calloc'd and then filled: with overcommit a too-large request would succeed and
 * the fill would meet the OOM killer, so the size is checked against the available memory first. */
static int cpu_caches_fit(const lunar_config *c, int n_blocks, int n_slots, lunar_err *err) {
    const double toks = (double)n_blocks * LUNAR_BLOCK_SIZE;
    const double kv = toks * c->n_mla_layers * ((c->kv_lora_rank + c->qk_rope_head_dim) * 4.0 +
                                                (c->index_topk > 0 ? c->index_head_dim + 4.0 : 0));
    const double hd = (double)c->kda_num_heads * c->kda_head_dim;
    const double st = (double)n_slots * c->n_kda_layers * 4.0 * (hd * c->kda_head_dim + 3 * hd * (c->kda_conv_size - 1));
    const double avail = (double)sysconf(_SC_AVPHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    if (kv + st > 0.8 * avail)
        return lunar_fail(err, "caches of %.1f GiB exceed 80%% of the %.1f GiB of free memory", (kv + st) / 1073741824.0,
                          avail / 1073741824.0);
    return 0;
}

static int caches_init(runner *r, int n_blocks, int n_slots, lunar_err *err) {
    if (!r->cuda && cpu_caches_fit(&r->m->cfg, n_blocks, n_slots, err)) return -1;
    if (r->cuda) {
        if (lunar_cuda_caches_init(&r->cc, r->m, n_blocks, n_slots,
                                      (r->kv_fp8 ? LUNAR_CUDA_CACHE_FP8_LATENT : 0) |
                                          (r->state_fp16 ? LUNAR_CUDA_CACHE_FP16_STATE : 0),
                                      err))
            return -1;
    } else {
        if (lunar_kv_pool_init(&r->kv, &r->m->cfg, n_blocks, r->kv_fp8 ? LUNAR_KV_FP8 : LUNAR_KV_F32, err)) return -1;
        if (lunar_state_pool_init(&r->st, &r->m->cfg, n_slots, r->state_fp16, err)) {
            lunar_kv_pool_free(&r->kv);
            return -1;
        }
    }
    r->have_caches = 1;
    return 0;
}

static void caches_free(runner *r) {
    if (!r->have_caches) return;
    if (r->cuda) lunar_cuda_caches_free(&r->cc);
    else lunar_kv_pool_free(&r->kv), lunar_state_pool_free(&r->st);
    r->have_caches = 0;
}

/* the index keys' codes (an e4m3 byte each, 0 .. 63: positive, never NaN) and scales, as both backends fill them */
static uint8_t idx_code_fill(size_t i) { return (uint8_t)((i * 40503u) >> 7 & 0x3f); }
#define IDX_SCALE_FILL (1.0f / 64)

/* Small nonzero values in every cache page (CPU): calloc'd pages would all alias the zero page and
 * make long-context reads look free. FP8 codes stay below 0x40 (no NaN code). */
static void caches_fill(runner *r) {
    if (r->cuda) {
#ifdef LUNAR_HAVE_CUDA
        /* Device memory is physical: the latent, state and conv contents do not change the cost. The index
         * keys do: the DSA top-k's passes depend on the scores, and over codes never written every score
         * ties (3 passes and the tie path instead of 2: session 22, docs/benchmarks.md). So they are filled,
         * with the CPU path's values, through a host buffer a chunk at a time. */
        const lunar_cuda_caches *c = &r->cc;
        if (!c->idx_dim) return;
        const size_t toks = (size_t)c->n_mla * c->n_blocks * LUNAR_BLOCK_SIZE, bytes = toks * c->idx_dim;
        const size_t chunk = (size_t)16 << 20;
        uint8_t *h = lunar_xmalloc(chunk);
        for (size_t off = 0; off < bytes; off += chunk) {
            const size_t len = bytes - off < chunk ? bytes - off : chunk;
#pragma omp parallel for schedule(static)
            for (size_t i = 0; i < len; i++) h[i] = idx_code_fill(off + i);
            lunar_cuda_upload(c->idx_codes + off, h, len);
        }
        free(h);
        const float sc = IDX_SCALE_FILL;
        uint32_t bits;
        memcpy(&bits, &sc, 4);
        lunar_cuda_fill_u32(c->idx_scales, bits, toks);
        lunar_cuda_sync();
#endif
        return;
    }
    const lunar_kv_pool *kv = &r->kv;
    const size_t toks = (size_t)kv->n_mla * kv->n_blocks * kv->block_size;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < toks * kv->row; i++) kv->latent[i] = (float)((i * 2654435761u) >> 22 & 255) * 1e-3f - 0.128f;
    if (kv->idx_dim) {
        for (size_t i = 0; i < toks * kv->idx_dim; i++) kv->idx_codes[i] = idx_code_fill(i);
        for (size_t i = 0; i < toks; i++) kv->idx_scales[i] = IDX_SCALE_FILL;
    }
    const lunar_state_pool *st = &r->st;
    for (size_t i = 0; i < (size_t)st->n_slots * st->n_kda * st->state_len; i++) st->state[i] = 1e-3f;
    for (size_t i = 0; i < (size_t)st->n_slots * st->n_kda * st->conv_len; i++) st->conv[i] = 1e-3f;
}

static int step(runner *r, const lunar_batch_seq *s, int n, float *logits, lunar_err *err) {
    return r->cuda ? lunar_forward_batch_cuda(r->g, &r->cc, s, n, logits, err)
                   : lunar_forward_batch(r->m, &r->kv, &r->st, s, n, logits, err);
}

/* ---- measurements ---- */

typedef struct prefill_res { int n; double s; int ok; char why[96]; } prefill_res;
typedef struct decode_res { int B; int ctx; double s; int ok; char why[96]; } decode_res;

static void random_ids(int32_t *ids, int n, int V, uint64_t seed) {
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(lunar_dummy_hash(seed, (uint64_t)i) % (uint64_t)V);
}

static void measure_prefill(runner *r, const bench_opts *o, prefill_res *res) {
    const int n = res->n, V = r->m->cfg.vocab_size;
    lunar_err err;
    const int nb = (n + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
    if (caches_init(r, nb, 1, &err)) {
        snprintf(res->why, sizeof res->why, "caches: %.80s", err.msg);
        return;
    }
    int32_t *ids = lunar_xmalloc((size_t)n * sizeof *ids), *blocks = lunar_xmalloc((size_t)nb * sizeof *blocks);
    for (int i = 0; i < nb; i++) blocks[i] = i;
    random_ids(ids, n, V, 1000 + (uint64_t)n);
    float *logits = lunar_xmalloc((size_t)V * sizeof *logits);
    const int chunk = o->chunk > 0 ? (int)o->chunk : n;
    double t0 = now_s();
    int rc = 0;
    for (int p = 0; p < n && !rc; p += chunk) {
        lunar_batch_seq s = {ids + p, n - p < chunk ? n - p : chunk, p, 0, blocks, LUNAR_LOGITS_LAST};
        rc = step(r, &s, 1, logits, &err);
    }
    res->s = now_s() - t0;
    if (rc) snprintf(res->why, sizeof res->why, "forward: %.80s", err.msg);
    res->ok = !rc;
    free(ids), free(blocks), free(logits);
    caches_free(r);
}

static void measure_decode(runner *r, const bench_opts *o, decode_res *res, lunar_profile *prof) {
    const int B = res->B, ctx = res->ctx, V = r->m->cfg.vocab_size, steps = (int)o->steps;
    lunar_err err;
    const int per = (ctx + steps + 2 + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
    if (caches_init(r, per * B, B, &err)) {
        snprintf(res->why, sizeof res->why, "caches: %.80s", err.msg);
        return;
    }
    caches_fill(r);
    int32_t *blocks = lunar_xmalloc((size_t)per * B * sizeof *blocks), *ids = lunar_xmalloc((size_t)B * sizeof *ids);
    for (int i = 0; i < per * B; i++) blocks[i] = i;
    lunar_batch_seq *s = lunar_xcalloc((size_t)B, sizeof *s);
    float *logits = malloc((size_t)B * V * sizeof *logits);
    if (!logits) {
        snprintf(res->why, sizeof res->why, "cannot allocate %d x %d logits", B, V);
        goto out;
    }
    random_ids(ids, B, V, 77);
    int rc = 0;
    double t0 = 0;
    for (int k = 0; k <= steps + 1 && !rc; k++) { /* steps 0 and 1 are the warm-up (1: the graph's capture) */
        if (k == 2) {
            t0 = now_s();
            if (prof) lunar_profile_install(prof);
        }
        for (int b = 0; b < B; b++)
            s[b] = (lunar_batch_seq){&ids[b], 1, ctx + k, b, blocks + (size_t)b * per, LUNAR_LOGITS_LAST};
        rc = step(r, s, B, logits, &err);
        for (int b = 0; b < B && !rc; b++) ids[b] = (int32_t)(lunar_dummy_hash(ids[b], (uint64_t)k) % (uint64_t)V);
    }
    if (prof) lunar_profile_install(NULL);
    res->s = (now_s() - t0) / steps;
    if (rc) snprintf(res->why, sizeof res->why, "forward: %.80s", err.msg);
    res->ok = !rc;
out:
    free(blocks), free(ids), free(s), free(logits);
    caches_free(r);
}

/* ---- hardware figures: bandwidth and peak, given or measured on the backend in use ---- */

static double measure_bandwidth_gbs(const runner *r) {
#ifdef LUNAR_HAVE_CUDA
    if (r->cuda) {
        /* 1 GiB buffers, or smaller ones when the model left less of the arena */
        const size_t mark = lunar_cuda_mark();
        size_t bytes = (size_t)1 << 30;
        void *a = NULL, *b = NULL;
        for (; bytes >= ((size_t)64 << 20); bytes /= 2) {
            a = lunar_cuda_alloc(bytes), b = a ? lunar_cuda_alloc(bytes) : NULL;
            if (a && b) break;
            lunar_cuda_release(mark);
        }
        double best = 0;
        if (a && b)
            for (int i = 0; i < 5; i++) {
                lunar_cuda_sync();
                double t0 = now_s();
                lunar_glue_copy(b, a, bytes, NULL);
                lunar_cuda_sync();
                double bw = 2.0 * bytes / (now_s() - t0) / 1e9; /* read + write */
                best = bw > best ? bw : best;
            }
        lunar_cuda_release(mark);
        return best;
    }
#endif
    (void)r;
    const size_t bytes = (size_t)256 << 20;
    char *a = malloc(bytes), *b = malloc(bytes);
    if (!a || !b) return free(a), free(b), 0;
    memset(a, 1, bytes), memset(b, 2, bytes);
    double best = 0;
    for (int i = 0; i < 3; i++) {
        double t0 = now_s();
        memcpy(b, a, bytes);
        double bw = 2.0 * bytes / (now_s() - t0) / 1e9;
        best = bw > best ? bw : best;
    }
    free(a), free(b);
    return best;
}

/* The data sheet's dense BF16 peak of known parts (0: unknown), printed beside the measured one. */
static double data_sheet_tflops(const runner *r) {
    if (!r->cuda) return 0;
    char desc[256];
    lunar_cuda_device_count(desc, sizeof desc);
    return strstr(desc, "H200") || strstr(desc, "H100") ? 989.4 : 0; /* H100/H200 SXM */
}

#ifdef LUNAR_HAVE_CUDA
/* The dense BF16 GEMM rate cuBLASLt reaches on this device, measured in the same call as the figures
 * whose floor it is (issue 9: "FLOPs / peak measured in the same call"): the best of 3 samples of 5
 * back-to-back n^3 products, n = 8192 (or less when the model left less of the arena). The operands
 * are dummy-uniform values, not constants: constant operands toggle fewer bits, draw less power and
 * run at a higher clock than real data (data sheet 989 TF; ~790-890 measured on this H200). */
static double measure_peak_tflops_cuda(int *n_out) {
    const size_t mark = lunar_cuda_mark();
    int n = 8192;
    uint16_t *a = NULL, *b = NULL, *c = NULL;
    for (; n >= 2048; n /= 2) {
        const size_t bytes = (size_t)n * n * 2;
        a = lunar_cuda_alloc(bytes), b = a ? lunar_cuda_alloc(bytes) : NULL, c = b ? lunar_cuda_alloc(bytes) : NULL;
        if (c) break;
        lunar_cuda_release(mark);
    }
    double best = 0;
    if (c) {
        lunar_dummy_gen g = {.key = 0x7065616b5f6d6d31ull, .kind = LUNAR_DUMMY_UNIFORM, .a = 1.0f};
        lunar_cuda_dummy_bf16(a, &g, 0, (uint64_t)n * n);
        g.key ^= 0x5555;
        lunar_cuda_dummy_bf16(b, &g, 0, (uint64_t)n * n);
        lunar_cuda_matmul(c, LUNAR_CUDA_BF16, a, b, n, n, n, NULL); /* warm-up: cuBLASLt's heuristic, clocks */
        for (int i = 0; i < 3; i++) {
            lunar_cuda_sync();
            const double t0 = now_s();
            for (int j = 0; j < 5; j++) lunar_cuda_matmul(c, LUNAR_CUDA_BF16, a, b, n, n, n, NULL);
            lunar_cuda_sync();
            const double f = 5 * 2.0 * n * n * (double)n / (now_s() - t0) / 1e12;
            best = f > best ? f : best;
        }
    }
    lunar_cuda_release(mark);
    *n_out = n;
    return best;
}
#endif

/* CUDA: the measured cuBLASLt rate above (the data sheet's figure when that fails); CPU: the
 * backend's own matmul rate on a 256 x 2048 x 2048 BF16 product (what the CPU reference can reach). */
static double default_peak_tflops(const runner *r, char *src, size_t cap) {
    if (r->cuda) {
#ifdef LUNAR_HAVE_CUDA
        int n = 0;
        const double p = measure_peak_tflops_cuda(&n);
        if (p > 0) {
            snprintf(src, cap, "measured: cuBLASLt bf16 %d^3 on the device", n);
            return p;
        }
#endif
        const double sheet = data_sheet_tflops(r);
        snprintf(src, cap, sheet > 0 ? "dense BF16 data sheet" : "unknown device (give --peak-tflops)");
        return sheet;
    }
    const int n = 256, K = 2048, N = 2048;
    uint16_t *w = lunar_xmalloc((size_t)N * K * 2);
    float *x = lunar_xmalloc((size_t)n * K * 4), *y = lunar_xmalloc((size_t)n * N * 4);
    for (size_t i = 0; i < (size_t)N * K; i++) w[i] = lunar_f32_to_bf16((float)(i % 13) * 0.01f);
    for (size_t i = 0; i < (size_t)n * K; i++) x[i] = (float)(i % 7) * 0.1f;
    lunar_tensor W = {.name = "peak", .dtype = LUNAR_DTYPE_BF16, .ndim = 2, .shape = {N, K}, .data = w, .nbytes = (size_t)N * K * 2};
    double best = 0;
    for (int i = 0; i < 3; i++) {
        double t0 = now_s();
        op_matmul(y, x, &W, n);
        double f = 2.0 * n * K * N / (now_s() - t0) / 1e12;
        best = f > best ? f : best;
    }
    free(w), free(x), free(y);
    snprintf(src, cap, "measured: CPU op_matmul 256x2048x2048 bf16");
    return best;
}

/* The whole device for the bench (the runtime's init is idempotent: the forward's own, smaller
 * arena request then finds it ready), and a clean error instead of an exhausted arena mid-upload:
 * the upload's own byte count (lunar_cuda_model_bytes: the same code in counting mode; BF16 weights,
 * MXFP4 experts packed as stored) and 2 GiB kept for the caches and activations of the smallest
 * measurement. */
static int device_fits(const lunar_model *m, lunar_err *err) {
#ifdef LUNAR_HAVE_CUDA
    if (lunar_cuda_init(0, 0, err)) return -1;
    const double need = (double)lunar_cuda_model_bytes(m) + (double)(2u << 30);
    const double have = (double)(lunar_cuda_arena_size() - lunar_cuda_arena_used());
    if (need > have)
        return lunar_fail(err, "the model needs about %.1f GiB on the device (its weights + 2 GiB of caches), the "
                               "arena has %.1f GiB: lower --num-layers", need / 1073741824.0, have / 1073741824.0);
    return 0;
#else
    (void)m;
    return lunar_fail(err, "lunar was built without CUDA");
#endif
}

/* ---- one full run at one depth ---- */

typedef struct run_res {
    int layers;
    prefill_res *pre;
    decode_res *dec;
    lunar_profile prof;
    int profiled;
    double prof_step_s; /* the profiled steps' mean (CUDA: slower than the timed ones) */
    lunar_profile pprof; /* one more prefill of the longest input, profiled (--profile) */
    prefill_res pprof_run;
    lunar_weight_bytes wb;
    lunar_config cfg;
    double bw, peak, sheet; /* sheet: the data sheet's peak (0: unknown), beside the measured one */
    char bw_src[96], peak_src[96];
    int kv_elem;
} run_res;

static int run_depth(const bench_opts *o, int cuda, int layers, run_res *rr, lunar_err *err) {
    lunar_load_options lo = o->load;
    lo.num_layers = layers;
    lo.device_lazy = cuda && lo.load_format && strcmp(lo.load_format, "dummy") == 0;
    lunar_model *m = NULL, *rank_m = NULL;
    double t0 = now_s();
    if (lunar_model_load_ex(&m, o->model, &lo, err)) return -1;
    runner r = {.m = m, .cuda = cuda, .kv_fp8 = o->kv_fp8, .state_fp16 = o->state_fp16};
    if (tp_rank.on) { /* this rank's shards (lazy dummy tensors stay lazy: model/dummy.h's windows) */
        const lunar_tp_opts t = {tp_rank.ri.world, (int)o->dcp, o->ep};
        if (!tp_rank.comm && (lunar_tp_check(&m->cfg, &t, err) ||
                              lunar_comm_nccl_init(&tp_rank.comm, tp_rank.ri.id, tp_rank.ri.rank, tp_rank.ri.world,
                                                   tp_rank.ri.local_rank, err) ||
                              lunar_dcp_comm(tp_rank.comm, t.dcp, &tp_rank.dcp, err) ||
                              lunar_cuda_rank_init(tp_rank.ri.local_rank, 0.9, err))) {
            lunar_model_free(m);
            return -1;
        }
        /* the DCP group (ranks r / dcp, DCP rank r % dcp): the TP comm itself or its split */
        if (lunar_shard_model(&rank_m, m, &t, tp_rank.ri.rank, tp_rank.comm, tp_rank.dcp, err) ||
            lunar_cuda_tp_check(rank_m, err)) {
            lunar_model_free(rank_m);
            lunar_model_free(m);
            return -1;
        }
        r.m = rank_m;
    } else if (cuda && device_fits(m, err)) {
        lunar_model_free(m);
        return -1;
    }
    if (cuda && lunar_cuda_model_upload(&r.g, r.m, err)) {
        lunar_model_free(rank_m);
        lunar_model_free(m);
        return -1;
    }
    if (cuda && o->eager) lunar_cuda_model_graphs(r.g, 0);
    fprintf(stderr, "lunar bench: loaded %s (%s%s, %d layers) in %.1f s\n", o->model,
            m->load.load_format ? "dummy weights" : "checkpoint", cuda ? ", on the device" : "",
            m->cfg.num_hidden_layers, now_s() - t0);
    rr->layers = m->cfg.num_hidden_layers;
    rr->cfg = m->cfg;
    rr->kv_elem = cuda ? (o->kv_fp8 ? 1 : 2) : 4; /* bytes per latent element read */
    /* under TP the floors are a rank's: the config cut to one rank of the group (heads, FFN widths,
     * vocabulary), the stored bytes per element of the full set at those shapes; when the widths
     * do not divide, the rank model's config (local heads, full widths: an upper bound) */
    lunar_err serr;
    if (tp_rank.on && lunar_config_tp_slice(&rr->cfg, tp_rank.ri.world, &serr)) rr->cfg = r.m->cfg;
    lunar_model view = *m;
    view.cfg = rr->cfg;
    lunar_weight_bytes_of(&view, &rr->wb);
    if (o->bw_gbs > 0) rr->bw = o->bw_gbs, snprintf(rr->bw_src, sizeof rr->bw_src, "--bandwidth-gbs");
    else rr->bw = measure_bandwidth_gbs(&r), snprintf(rr->bw_src, sizeof rr->bw_src, "measured: %s memcpy", cuda ? "device" : "host");
    if (o->peak_tflops > 0) rr->peak = o->peak_tflops, snprintf(rr->peak_src, sizeof rr->peak_src, "--peak-tflops");
    else rr->peak = default_peak_tflops(&r, rr->peak_src, sizeof rr->peak_src);
    rr->sheet = data_sheet_tflops(&r);

    rr->pre = lunar_xcalloc((size_t)o->n_in, sizeof *rr->pre);
    rr->dec = lunar_xcalloc((size_t)o->n_b * o->n_ctx, sizeof *rr->dec);
    { /* warm-up: first-touch of weights and code paths, untimed */
        prefill_res w = {.n = 16};
        measure_prefill(&r, o, &w);
    }
    for (int i = 0; i < o->n_in; i++) {
        prefill_res *p = &rr->pre[i];
        p->n = o->in_lens[i];
        if (p->n > o->max_len) {
            snprintf(p->why, sizeof p->why, "over --max-len %ld", o->max_len);
        } else {
            for (long k = 0; k < o->warmup; k++) {
                prefill_res w = {.n = p->n};
                measure_prefill(&r, o, &w);
            }
            measure_prefill(&r, o, p);
        }
        fprintf(stderr, "  prefill %7d: %s\n", p->n, p->ok ? "done" : p->why);
    }
    if (o->profile && o->n_in > 0 && rr->pre[o->n_in - 1].ok) { /* apart from the timed runs */
        rr->pprof_run.n = rr->pre[o->n_in - 1].n;
        lunar_profile_install(&rr->pprof);
        measure_prefill(&r, o, &rr->pprof_run);
        lunar_profile_install(NULL);
    }
    for (int j = 0; j < o->n_ctx; j++)
        for (int i = 0; i < o->n_b; i++) {
            decode_res *d = &rr->dec[j * o->n_b + i];
            d->B = o->batches[i], d->ctx = o->contexts[j];
            const int prof = o->profile && i == 0 && j == 0;
            decode_res pd = *d;
            if (d->ctx + o->steps + 2 > o->max_len) {
                snprintf(d->why, sizeof d->why, "over --max-len %ld", o->max_len);
            } else if (prof && cuda) { /* the profile's device syncs stay out of the timed steps */
                measure_decode(&r, o, d, NULL);
                if (d->ok) measure_decode(&r, o, &pd, &rr->prof);
            } else {
                measure_decode(&r, o, d, prof ? &rr->prof : NULL);
                pd = *d;
            }
            if (prof && d->ok && pd.ok) {
                rr->profiled = 1;
                rr->prof_step_s = pd.s;
                for (int f = 0; f < LUNAR_PROF_N; f++) rr->prof.seconds[f] /= (double)o->steps;
            }
            fprintf(stderr, "  decode B=%d ctx=%d: %s\n", d->B, d->ctx, d->ok ? "done" : d->why);
        }
    if (cuda) {
        long cap = 0, rep = 0;
        size_t nodes = 0;
        double cs = 0;
        lunar_cuda_model_graph_stats(r.g, &cap, &rep, &nodes, &cs);
        fprintf(stderr, "lunar bench: CUDA graphs %s: %ld captured (%.1f ms each), %ld steps replayed, %zu nodes in the last\n",
                o->eager ? "off (--enforce-eager)" : "on", cap, cap ? cs * 1e3 / cap : 0.0, rep, nodes);
    }
    lunar_cuda_model_free(r.g);
    lunar_model_free(rank_m);
    lunar_model_free(m);
    return 0;
}

/* ---- report ---- */

/* projected value at `target` layers from the runs at two depths (linear in the layer count). A
 * layer cannot take negative time: on a busy machine the half-depth run can come out slower than
 * the full one, so the per-layer slope is clamped at 0 (the projection is then the full run). */
static double project(double full, double half, int L, int Lh, int target) {
    double slope = (full - half) / (L - Lh);
    if (slope < 0) slope = 0;
    const double p = full + slope * (target - L);
    return p > 0 ? p : 0;
}

static int bench_body(bench_opts o) {
    lunar_err err;
    lunar_backend_kind be;
    int rc = 1;
    run_res full, half;
    memset(&full, 0, sizeof full), memset(&half, 0, sizeof half);
    if (lunar_backend_select(o.backend, &be, &err)) goto out;
    const int cuda = be == LUNAR_BACKEND_CUDA;
    if (run_depth(&o, cuda, o.load.num_layers, &full, &err)) goto out;
    int Lh = 0;
    if (o.project) {
        /* the second depth: half the layers, on the MLA period (every 4th layer) when possible */
        Lh = full.layers / 2 >= 4 ? full.layers / 2 / 4 * 4 : full.layers / 2;
        if (Lh < 1 || Lh >= full.layers) {
            lunar_fail(&err, "--project-layers needs a model of at least 2 layers");
            goto out;
        }
        fprintf(stderr, "lunar bench: second run at %d layers for the projection to %ld\n", Lh, o.project);
        if (run_depth(&o, cuda, Lh, &half, &err)) goto out;
    }

    const lunar_config *c = &full.cfg;
    printf("lunar bench: %s  backend %s  %s  layers %d%s", o.model, lunar_backend_name(be),
           o.load.load_format ? o.load.load_format : "checkpoint", full.layers, o.load.tp_slice > 1 ? "" : "\n");
    if (o.load.tp_slice > 1) printf("  (one rank of TP %d%s)\n", o.load.tp_slice,
                                    tp_rank.on ? "" : ": no all-reduce modelled");
    if (tp_rank.on)
        printf("tensor parallel %d%s%s: rank 0's figures (its shards, its floor); the collectives are real\n",
               tp_rank.ri.world, o.ep ? " + expert parallel" : "", o.dcp > 1 ? " + decode context parallel" : "");
    const int sheet_col = full.sheet > 0 && full.sheet != full.peak; /* MFU against the data sheet too */
    printf("bandwidth %.4g GB/s (%s); peak %.4g TFLOPS (%s)", full.bw, full.bw_src, full.peak, full.peak_src);
    if (sheet_col) printf("; data sheet %.4g TFLOPS (sheet%%)", full.sheet);
    printf("\n");
    if (o.project) printf("projected to %ld layers from runs at %d and %d layers (linear in depth)\n", o.project, full.layers, Lh);
    json_t *jpre = json_array(), *jdec = json_array();
    printf("\nprefill   input    time_s      tok/s     TFLOP  floor_s    MFU%s%s\n", sheet_col ? "  sheet%" : "",
           o.project ? "   proj_time_s" : "");
    for (int i = 0; i < o.n_in; i++) {
        const prefill_res *p = &full.pre[i];
        if (!p->ok) {
            printf("          %6d   skipped: %s\n", p->n, p->why);
            json_array_append_new(jpre, json_pack("{s:i,s:s}", "input_len", p->n, "skipped", p->why));
            continue;
        }
        const double fl = lunar_prefill_flops(c, p->n), floor = full.peak > 0 ? fl / (full.peak * 1e12) : 0;
        printf("          %6d  %8.4f  %9.1f  %8.3g  %7.4f  %5.1f%%", p->n, p->s, p->n / p->s, fl / 1e12, floor,
               floor > 0 ? 100 * floor / p->s : 0.0);
        if (sheet_col) printf("  %5.1f%%", 100 * fl / (full.sheet * 1e12) / p->s);
        json_t *e = json_pack("{s:i,s:f,s:f,s:f,s:f,s:f}", "input_len", p->n, "seconds", p->s, "tok_per_s", p->n / p->s,
                              "flops", fl, "floor_s", floor, "mfu", floor > 0 ? floor / p->s : 0.0);
        if (full.sheet > 0) json_object_set_new(e, "mfu_data_sheet", json_real(fl / (full.sheet * 1e12) / p->s));
        if (o.project && half.pre[i].ok) {
            const double pt = project(p->s, half.pre[i].s, full.layers, Lh, (int)o.project);
            printf("   %10.4f", pt);
            json_object_set_new(e, "projected_seconds", json_real(pt));
        }
        printf("\n");
        json_array_append_new(jpre, e);
    }
    printf("\ndecode    batch  context   TPOT_ms      tok/s   MB/step  floor_ms  floor/TPOT%s\n", o.project ? "  proj_TPOT_ms" : "");
    for (int i = 0; i < o.n_b * o.n_ctx; i++) {
        const decode_res *d = &full.dec[i];
        if (!d->ok) {
            printf("          %5d  %7d   skipped: %s\n", d->B, d->ctx, d->why);
            json_array_append_new(jdec, json_pack("{s:i,s:i,s:s}", "batch", d->B, "context", d->ctx, "skipped", d->why));
            continue;
        }
        lunar_model view = {.cfg = *c}; /* the byte count needs the config and the stored sizes only */
        const double by = lunar_decode_bytes_dcp(&view, &full.wb, d->B, d->ctx, full.kv_elem,
                                                 o.state_fp16 && full.kv_elem < 4 ? 2 : 4, (int)o.dcp);
        const double floor = full.bw > 0 ? by / (full.bw * 1e9) : 0;
        printf("          %5d  %7d  %8.3f  %9.1f  %8.1f  %8.3f  %9.1f%%", d->B, d->ctx, 1e3 * d->s, d->B / d->s, by / 1e6,
               1e3 * floor, 100 * floor / d->s);
        json_t *e = json_pack("{s:i,s:i,s:f,s:f,s:f,s:f,s:f}", "batch", d->B, "context", d->ctx, "tpot_ms", 1e3 * d->s,
                              "tok_per_s", d->B / d->s, "bytes_per_step", by, "floor_ms", 1e3 * floor,
                              "floor_over_tpot", floor / d->s);
        if (o.project && half.dec[i].ok) {
            const double pt = project(d->s, half.dec[i].s, full.layers, Lh, (int)o.project);
            printf("  %12.3f", 1e3 * pt);
            json_object_set_new(e, "projected_tpot_ms", json_real(1e3 * pt));
        }
        printf("\n");
        json_array_append_new(jdec, e);
    }
    json_t *jprof = json_object();
    if (o.profile && !full.profiled)
        printf("\nprofile: no decode measurement succeeded\n");
    if (full.profiled) {
        double tot = 0;
        for (int f = 0; f < LUNAR_PROF_N; f++) tot += full.prof.seconds[f];
        printf("\nprofile of one decode step (batch %d, context %d), wall time per op family:\n", full.dec[0].B, full.dec[0].ctx);
        for (int f = 0; f < LUNAR_PROF_N; f++) {
            if (!full.prof.calls[f]) continue;
            printf("  %-18s %9.3f ms  %5.1f%%\n", lunar_prof_names[f], 1e3 * full.prof.seconds[f],
                   tot > 0 ? 100 * full.prof.seconds[f] / tot : 0.0);
            json_object_set_new(jprof, lunar_prof_names[f], json_real(1e3 * full.prof.seconds[f]));
        }
        printf("  %-18s %9.3f ms of a %.3f ms profiled step (%.3f ms timed)\n", "sum", 1e3 * tot,
               1e3 * full.prof_step_s, 1e3 * full.dec[0].s);
    }
    if (full.pprof_run.ok) {
        double tot = 0;
        for (int f = 0; f < LUNAR_PROF_N; f++) tot += full.pprof.seconds[f];
        printf("\nprofile of one prefill of %d tokens, wall time per op family:\n", full.pprof_run.n);
        json_t *jp = json_object();
        for (int f = 0; f < LUNAR_PROF_N; f++) {
            if (!full.pprof.calls[f]) continue;
            printf("  %-18s %9.3f ms  %5.1f%%\n", lunar_prof_names[f], 1e3 * full.pprof.seconds[f],
                   tot > 0 ? 100 * full.pprof.seconds[f] / tot : 0.0);
            json_object_set_new(jp, lunar_prof_names[f], json_real(1e3 * full.pprof.seconds[f]));
        }
        printf("  %-18s %9.3f ms of a %.3f ms profiled prefill\n", "sum", 1e3 * tot, 1e3 * full.pprof_run.s);
        json_object_set_new(jprof, "prefill", jp);
    }
    if (o.json) {
        char host[256] = "";
        gethostname(host, sizeof host - 1);
        json_t *root = json_pack("{s:s,s:s,s:s,s:i,s:i,s:s,s:f,s:s,s:f,s:s,s:f,s:i,s:o,s:o,s:o}", "model", o.model,
                                 "backend", lunar_backend_name(be), "load_format",
                                 o.load.load_format ? o.load.load_format : "checkpoint", "layers", full.layers,
                                 "tp_slice", o.load.tp_slice > 1 ? o.load.tp_slice : 1, "host", host,
                                 "bandwidth_gbs", full.bw, "bandwidth_source", full.bw_src, "peak_tflops", full.peak,
                                 "peak_source", full.peak_src, "peak_tflops_data_sheet", full.sheet,
                                 "decode_steps", (int)o.steps, "prefill", jpre, "decode", jdec, "profile_ms", jprof);
        json_object_set_new(root, "tensor_parallel_size", json_integer(tp_rank.on ? tp_rank.ri.world : 1));
        json_object_set_new(root, "decode_context_parallel_size", json_integer(o.dcp));
        if (o.project) {
            json_object_set_new(root, "projected_layers", json_integer(o.project));
            json_object_set_new(root, "projection_depths", json_pack("[i,i]", full.layers, Lh));
        }
        if (json_dump_file(root, o.json, JSON_INDENT(1)) != 0) {
            json_decref(root);
            lunar_fail(&err, "--json: cannot write %s", o.json);
            goto out;
        }
        json_decref(root);
    } else {
        json_decref(jpre), json_decref(jdec), json_decref(jprof);
    }
    rc = 0;
out:
    if (rc) fprintf(stderr, "lunar bench: %s%s\n", tp_rank.on ? "rank: " : "", err.msg);
    free(full.pre), free(full.dec), free(half.pre), free(half.dec);
    return rc;
}

/* A rank process: every rank runs the same measurements in the same order (their collectives
 * meet); rank 0 alone prints and writes the JSON. */
static int bench_rank(const lunar_rank_info *ri, void *arg) {
    bench_opts o = *(const bench_opts *)arg;
    tp_rank.on = 1, tp_rank.ri = *ri;
    if (ri->rank != 0) {
        o.json = NULL;
        if (!freopen("/dev/null", "w", stdout)) return 1;
    }
    const int rc = bench_body(o);
    lunar_dcp_comm_free(tp_rank.comm, tp_rank.dcp);
    lunar_comm_free(tp_rank.comm);
    return rc;
}

int lunar_cmd_bench(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "serve") == 0) return lunar_cmd_bench_serve(argc - 1, argv + 1);
    bench_opts o;
    memset(&o, 0, sizeof o);
    lunar_err err;
    if (parse(argc, argv, &o, &err)) {
        fprintf(stderr, "lunar bench: %s\n%s", err.msg, USAGE);
        return 2;
    }
    int rc;
    if (o.tp > 1 || o.ep) {
        /* one process per GPU; the parent touches no device before the fork (so no probing) */
        if (!o.backend || strcmp(o.backend, "cuda") != 0) {
            fprintf(stderr, "lunar bench: --tensor-parallel-size needs --backend cuda (one rank process per GPU)\n");
            rc = 2;
        } else {
            lunar_dist_opts d = {1, 0, (int)(o.tp > 1 ? o.tp : 1), "127.0.0.1", (int)o.master_port};
            rc = lunar_launch_node(&d, lunar_nccl_get_unique_id, bench_rank, &o, 300000, &err) ? 1 : 0;
            if (rc) fprintf(stderr, "lunar bench: %s\n", err.msg);
        }
    } else {
        rc = bench_body(o);
    }
    free(o.in_lens), free(o.batches), free(o.contexts);
    return rc;
}
