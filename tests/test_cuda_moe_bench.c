/* The CUDA MoE benchmarks (LUNAR_MOE_BENCH; tools/device/check.sh bench-moe and the MoE device scripts):
 * the decode pair and the prefill grouped GEMMs at the models' shapes against the bytes' floor and the
 * dense peak, both measured in the same run. Not a test: TEST(cuda_moe_bench) returns at once unless
 * LUNAR_MOE_BENCH is set. The MoE op tests are in test_cuda_moe.c. */
#include "test.h"

#ifdef LUNAR_HAVE_CUDA

#include <stdint.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_ops.h"
#include "model/dummy.h"
#include "ops.h"
#include "cuda_test.h"
#include "cuda_moe_test.h"
#include "ops_util.h"

/* ---------------------------------------------------------------- benchmarks (LUNAR_MOE_BENCH=1) */

#define BW 4.3e12 /* device-to-device copy bandwidth measured on these H200s (KINDS.md) */
#define TC 790e12 /* bf16 dense peak measured on them */

static int cmpf(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* L2 flush before each timed repeat. Dirty (the first benchmarks): a 256 MiB fill, which leaves
 * the L2 full of modified lines, so the timed kernels also pay for writing ~50 MB back to HBM (a
 * fixed ~10+ us that no kernel of ours causes). Clean: the same fill, then a GEMV that reads the
 * whole buffer as a [32768, 4096] bf16 matrix (writing 128 KiB), so the L2 ends up holding
 * unrelated clean lines: the state a decode step's MoE meets after the attention and router. */
static int g_flush_clean;
static double g_read_bw, g_dense_peak = TC; /* bytes/s of a cuBLAS GEMV streaming 1 GiB, measured in the same run */
static uint16_t *g_flush_x;
static float *g_flush_y;
static void l2_flush(void *flush, size_t flush_words, uint32_t seed) {
    lunar_cuda_fill_u32(flush, seed, flush_words);
    if (g_flush_clean)
        lunar_cuda_matmul(g_flush_y, LUNAR_CUDA_F32, g_flush_x, flush, 1, (int)(flush_words * 2 / 4096), 4096,
                          NULL);
}

/* Times experts_run (both kernels) with L2 flushed before each repeat; median of reps. */
static int g_bench_one; /* LUNAR_MOE_BENCH=decode1 */
static float time_experts(float *ybuf, uint16_t *hbuf, const uint16_t *z, const lunar_cuda_moe_experts *w,
                          const lunar_cuda_moe_route *r, int path, int reps, void *flush, size_t flush_words) {
    lunar_cuda_event e0 = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    float ts[64];
    for (int i = 0; i < 2; i++) lunar_cuda_moe_experts_run(ybuf, hbuf, z, w, r, path, NULL);
    for (int i = 0; i < reps; i++) {
        if (flush) l2_flush(flush, flush_words, (uint32_t)i);
        lunar_cuda_event_record(e0, NULL);
        lunar_cuda_moe_experts_run(ybuf, hbuf, z, w, r, path, NULL);
        lunar_cuda_event_record(e1, NULL);
        ts[i] = lunar_cuda_event_ms(e0, e1);
    }
    lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(e1);
    qsort(ts, (size_t)reps, sizeof ts[0], cmpf);
    return ts[reps / 2];
}

/* time_experts for paths 14, 22 and 24 with each kernel's median too: *gu the gate/up kernel's ms,
 * *dn the down kernel's (lunar_cuda_moe_split_event between the two launches); yb (or NULL): the
 * bf16 rows form (lunar_cuda_moe_experts_run_b) into yb instead of ybuf */
static float time_experts_split(float *ybuf, uint16_t *yb, uint16_t *hbuf, const uint16_t *z,
                                const lunar_cuda_moe_experts *w, const lunar_cuda_moe_route *r, int path, int reps,
                                float *gu, float *dn) {
    lunar_cuda_event e0 = lunar_cuda_event_create(), em = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    float ts[64], tg[64], td[64];
#define RUN_SPLIT()                                                            \
    do {                                                                       \
        if (yb) CHECK(lunar_cuda_moe_experts_run_b(yb, hbuf, z, w, r, path, NULL) == 0); \
        else lunar_cuda_moe_experts_run(ybuf, hbuf, z, w, r, path, NULL);      \
    } while (0)
    for (int i = 0; i < 2; i++) RUN_SPLIT();
    lunar_cuda_moe_split_event(em);
    for (int i = 0; i < reps; i++) {
        lunar_cuda_event_record(e0, NULL);
        RUN_SPLIT();
        lunar_cuda_event_record(e1, NULL);
        ts[i] = lunar_cuda_event_ms(e0, e1), tg[i] = lunar_cuda_event_ms(e0, em), td[i] = lunar_cuda_event_ms(em, e1);
    }
#undef RUN_SPLIT
    lunar_cuda_moe_split_event(NULL);
    lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(em), lunar_cuda_event_destroy(e1);
    qsort(ts, (size_t)reps, sizeof ts[0], cmpf), qsort(tg, (size_t)reps, sizeof tg[0], cmpf);
    qsort(td, (size_t)reps, sizeof td[0], cmpf);
    *gu = tg[reps / 2], *dn = td[reps / 2];
    return ts[reps / 2];
}

/* random bf16 weights [n] (constant data would flatter the tensor cores), converted in pieces through a
 * 256 MB fp32 buffer given back before the return (the arena is a stack: it lies above the weights) */
static uint16_t *bench_bf16(size_t nw, uint32_t seed) {
    const size_t piece = (size_t)64 << 20;
    uint16_t *b = dalloc(nw * 2);
    const size_t mark = lunar_cuda_mark();
    float *tmp = dalloc(piece * 4);
    for (size_t o = 0; o < nw; o += piece) {
        const size_t cnt = nw - o < piece ? nw - o : piece;
        lunar_cuda_fill_uniform(tmp, cnt, seed + (uint32_t)(o / piece), -0.05f, 0.05f);
        lunar_cuda_f32_to_bf16(b + o, tmp, cnt);
    }
    lunar_cuda_release(mark); /* stream-ordered: later allocations are used after these launches */
    return b;
}

/* MXFP4 expert weights for E I D = nw values per matrix: arbitrary nibbles (seed + m for matrix m), every scale
 * E8M0 122 (2^-5); w's w1q / w1s, w3q / w3s, w2q / w2s */
static void bench_mxfp4(lunar_cuda_moe_experts *w, size_t nw, uint32_t seed) {
    uint8_t *q[3], *s[3];
    for (int m = 0; m < 3; m++) {
        q[m] = dalloc(nw / 2), s[m] = dalloc(nw / 32);
        lunar_cuda_fill_uniform((float *)q[m], nw / 8, seed + (uint32_t)m, -1, 1);
        lunar_cuda_fill_u32(s[m], 0x7a7a7a7au, nw / 128);
    }
    w->w1q = q[0], w->w1s = s[0], w->w3q = q[1], w->w3s = s[1], w->w2q = q[2], w->w2s = s[2];
}

static void bench_shape(int E, int k, int D, int I, int mx, const char *label, void *flush, size_t fw) {
    size_t mark = lunar_cuda_mark();
    lunar_cuda_moe_experts w;
    memset(&w, 0, sizeof w);
    w.E = E, w.D = D, w.I = I, w.mxfp4 = mx, w.act = mx, w.beta = 4.0f, w.beta_l = 25.0f;
    const size_t nw = (size_t)E * I * D;
    if (mx) {
        bench_mxfp4(&w, nw, 900u);
    } else {
        w.w1 = bench_bf16(nw, 900u), w.w3 = bench_bf16(nw, 1900u), w.w2 = bench_bf16(nw, 2900u);
    }
    /* one expert's bytes */
    const double ebytes = mx ? 3.0 * I * D / 2 + 3.0 * I * D / 32 : 3.0 * I * D * 2;
    static const int batches[] = {1, 8, 16, 32, 64};
    for (unsigned b = 0; b < (g_bench_one ? 1 : sizeof batches / sizeof batches[0]); b++) {
        const int n = batches[b];
        size_t m2 = lunar_cuda_mark();
        lunar_cuda_moe_route r;
        lunar_cuda_moe_route_init(&r, dalloc(lunar_cuda_moe_route_bytes(n, k, E)), n, k, E);
        float *lg = dalloc((size_t)n * E * 4);
        lunar_cuda_fill_uniform(lg, (size_t)n * E, 31u + (uint32_t)n, -4, 4);
        lunar_cuda_router_topk(r.experts, r.weights, lg, NULL, n, E, k, 1, 1, 1, 1.0f, NULL);
        lunar_cuda_moe_permute(&r, NULL);
        int32_t *cnt = malloc((size_t)(E + 2) * 4);
        lunar_cuda_sync();
        lunar_cuda_download(cnt, r.counts, (size_t)(E + 2) * 4);
        const int touched = cnt[E];
        free(cnt);
        uint16_t *z = dalloc((size_t)n * D * 2), *hbuf = dalloc((size_t)n * k * I * 2);
        float *zf = dalloc((size_t)n * D * 4), *ybuf = dalloc((size_t)n * k * D * 4);
        lunar_cuda_fill_uniform(zf, (size_t)n * D, 5, -1, 1);
        lunar_cuda_f32_to_bf16(z, zf, (size_t)n * D);
        /* the decode kernel pair (path 1), the warp-team kernels (path 8) and the fused kernel
         * (path 3, MXFP4 only), same data; v2's output against the pair's */
        const float pair = time_experts(ybuf, hbuf, z, &w, &r, 1, 21, flush, fw);
        float *acc = dalloc((size_t)n * D * 4);
        lunar_cuda_moe_combine(acc, ybuf, &r, D, NULL);
        float *yp = dl_f32(acc, (long)n * D);
        lunar_cuda_fill_u32(ybuf, 0x7fc00000u, (size_t)n * k * D);
        const float v2 = time_experts(ybuf, hbuf, z, &w, &r, 8, 21, flush, fw);
        lunar_cuda_moe_combine(acc, ybuf, &r, D, NULL);
        float *yv = dl_f32(acc, (long)n * D);
        const double err = lunar_max_rel_err(yv, yp, (long)n * D);
        free(yv);
        const float fused = mx && !g_bench_one ? time_experts(ybuf, hbuf, z, &w, &r, 3, 21, flush, fw) : 0.0f;
        /* path 16 (MXFP4 only): the pair on f16 tensor cores, its output against the pair's */
        float f16 = 0.0f;
        double f16err = 0.0;
        if (mx) {
            lunar_cuda_fill_u32(ybuf, 0x7fc00000u, (size_t)n * k * D);
            f16 = time_experts(ybuf, hbuf, z, &w, &r, 16, 21, flush, fw);
            lunar_cuda_moe_combine(acc, ybuf, &r, D, NULL);
            float *yf = dl_f32(acc, (long)n * D);
            f16err = lunar_max_rel_err(yf, yp, (long)n * D);
            free(yf);
        }
        const double bytes = touched * ebytes, floor_us = bytes / BW * 1e6, mfloor_us = bytes / g_read_bw * 1e6;
        free(yp);
        printf("| %-26s | %2d | %3d | %7.1f | %6.1f | %6.1f | %7.1f | %5.2f | %7.1f | **%5.2f** | %5.0f | %5.0f | %7.1f | %.1g "
               "| %7.1f | %5.2f | %5.0f | %.1g |\n",
               label, n, touched, bytes / 1e6, floor_us, mfloor_us, pair * 1e3, pair * 1e3 / mfloor_us, v2 * 1e3,
               v2 * 1e3 / mfloor_us, bytes / (pair * 1e-3) / 1e9, bytes / (v2 * 1e-3) / 1e9, fused * 1e3, err,
               f16 * 1e3, f16 * 1e3 / mfloor_us, f16 > 0 ? bytes / (f16 * 1e-3) / 1e9 : 0.0, f16err);
        lunar_cuda_release(m2);
    }
    lunar_cuda_release(mark);
}

/* LUNAR_MOE_BENCH=f16ab: path 16 at one token on one shape under each variant of LUNAR_MOE_BENCH_V
 * ("name:VAR=val,VAR=val name2:..."; every variable any variant names is unset before each variant sets
 * its own), LUNAR_MOE_BENCH_ROUNDS rounds (default 3) in alternating order: per variant the median of 21
 * (clean L2 before each) of both kernels, then of 21 more with an event between the two launches (the
 * gate/up and down kernels' own times: the event ends the PDL overlap of the pair, so their sum exceeds
 * the pair's), and its expert rows against the first variant's (memcmp where the variants change no
 * sum; LUNAR_MOE_F16_IL / _WG within the CPU tolerance, below). */
static void f16ab_apply(const char *spec, const char *all) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", all);
    for (char *t = strtok(buf, " "); t; t = strtok(NULL, " ")) {
        char *c = strchr(t, ':');
        for (char *v = c ? c + 1 : t; v && *v;) {
            char *comma = strchr(v, ','), *eq = strchr(v, '=');
            if (comma) *comma = 0;
            if (eq) *eq = 0, unsetenv(v);
            v = comma ? comma + 1 : NULL;
        }
    }
    snprintf(buf, sizeof buf, "%s", spec);
    char *c = strchr(buf, ':');
    for (char *v = c ? c + 1 : NULL; v && *v;) {
        char *comma = strchr(v, ','), *eq = strchr(v, '=');
        if (comma) *comma = 0;
        if (eq) *eq = 0, setenv(v, eq + 1, 1);
        v = comma ? comma + 1 : NULL;
    }
}
static void bench_f16ab(int E, int k, int D, int I, const char *label, void *flush, size_t fw) {
    const char *vs = getenv("LUNAR_MOE_BENCH_V") ? getenv("LUNAR_MOE_BENCH_V") : "def:LUNAR_NONE=0";
    const int rounds = getenv("LUNAR_MOE_BENCH_ROUNDS") ? atoi(getenv("LUNAR_MOE_BENCH_ROUNDS")) : 3;
    char specs[8][128];
    int nv = 0;
    {
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", vs);
        for (char *t = strtok(buf, " "); t && nv < 8; t = strtok(NULL, " ")) snprintf(specs[nv++], 128, "%s", t);
    }
    size_t mark = lunar_cuda_mark();
    lunar_cuda_moe_experts w;
    memset(&w, 0, sizeof w);
    w.E = E, w.D = D, w.I = I, w.mxfp4 = 1, w.act = 1, w.beta = 4.0f, w.beta_l = 25.0f;
    const size_t nw = (size_t)E * I * D;
    bench_mxfp4(&w, nw, 900u);
    const int n = 1;
    lunar_cuda_moe_route r;
    lunar_cuda_moe_route_init(&r, dalloc(lunar_cuda_moe_route_bytes(n, k, E)), n, k, E);
    float *lg = dalloc((size_t)E * 4);
    lunar_cuda_fill_uniform(lg, (size_t)E, 32u, -4, 4);
    lunar_cuda_router_topk(r.experts, r.weights, lg, NULL, n, E, k, 1, 1, 1, 1.0f, NULL);
    lunar_cuda_moe_permute(&r, NULL);
    r.settled = 1; /* the route is written once, long before the runs below (the model's latent path) */
    uint16_t *z = dalloc((size_t)D * 2), *hbuf = dalloc((size_t)k * I * 2);
    float *zf = dalloc((size_t)D * 4), *ybuf = dalloc((size_t)k * D * 4);
    lunar_cuda_fill_uniform(zf, (size_t)D, 5, -1, 1);
    lunar_cuda_f32_to_bf16(z, zf, (size_t)D);
    const double bytes = (double)k * (3.0 * I * D / 2 + 3.0 * I * D / 32), mfloor = bytes / g_read_bw * 1e6;
    printf("\n%s, one token, %.1f MB, floor(m) %.1f us (path 16; us, median of 21, clean L2)\n", label, bytes / 1e6,
           mfloor);
    printf("| round | variant | pair us | of floor(m) | gate/up us | down us | expert rows |\n|---|---|---|---|---|---|---|\n");
    lunar_cuda_event e0 = lunar_cuda_event_create(), em = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    float *rows0 = NULL;
    double sum[8] = {0};
    for (int rd = 0; rd < rounds; rd++) {
        for (int vi = 0; vi < nv; vi++) {
            const int v = rd % 2 ? nv - 1 - vi : vi;
            f16ab_apply(specs[v], vs);
            float ts[21], tg[21], td[21];
            lunar_cuda_fill_u32(ybuf, 0x7fc00000u, (size_t)k * D);
            for (int i = 0; i < 2; i++) lunar_cuda_moe_experts_run(ybuf, hbuf, z, &w, &r, 16, NULL);
            float *rows = dl_f32(ybuf, (long)k * D);
            for (int i = 0; i < 21; i++) {
                l2_flush(flush, fw, (uint32_t)i);
                lunar_cuda_event_record(e0, NULL);
                lunar_cuda_moe_experts_run(ybuf, hbuf, z, &w, &r, 16, NULL);
                lunar_cuda_event_record(e1, NULL);
                ts[i] = lunar_cuda_event_ms(e0, e1);
            }
            lunar_cuda_moe_split_event(em);
            for (int i = 0; i < 21; i++) {
                l2_flush(flush, fw, (uint32_t)i);
                lunar_cuda_event_record(e0, NULL);
                lunar_cuda_moe_experts_run(ybuf, hbuf, z, &w, &r, 16, NULL);
                lunar_cuda_event_record(e1, NULL);
                tg[i] = lunar_cuda_event_ms(e0, em), td[i] = lunar_cuda_event_ms(em, e1);
            }
            lunar_cuda_moe_split_event(NULL);
            qsort(ts, 21, sizeof ts[0], cmpf), qsort(tg, 21, sizeof tg[0], cmpf), qsort(td, 21, sizeof td[0], cmpf);
            /* a variant that sums other partials (LUNAR_MOE_F16_IL set either way: the first's chunk order
             * may be the other; LUNAR_MOE_F16_WG: e4m3 hi + lo activations on FP8 wgmma) gets the CPU
             * tolerance against the first's rows; LUNAR_MOE_F16_SKIP (1, 2, 3)
             * computes wrong values on purpose (no check) */
            char same[48] = "first";
            if (!rows0) {
                rows0 = rows, rows = NULL;
            } else if (memcmp(rows, rows0, (size_t)k * D * 4) == 0) {
                snprintf(same, sizeof same, "equal");
            } else if (strstr(specs[v], "SKIP=1") || strstr(specs[v], "SKIP=2") || strstr(specs[v], "SKIP=3")) {
                snprintf(same, sizeof same, "skipped (wrong)");
            } else {
                const double e = lunar_max_rel_err(rows, rows0, (long)k * D);
                snprintf(same, sizeof same, "rel %.2g", e);
                if ((!strstr(specs[v], "IL=") && !strstr(specs[v], "WG=")) || e > 1e-2)
                    CHECK_MSG(0, "%s: variant %s's expert rows differ from the first's (%s)", label, specs[v], same);
            }
            free(rows);
            sum[v] += ts[10] * 1e3;
            printf("| %d | %s | %.1f | %.2f | %.1f | %.1f | %s |\n", rd + 1, specs[v], ts[10] * 1e3, ts[10] * 1e3 / mfloor,
                   tg[10] * 1e3, td[10] * 1e3, same);
        }
    }
    for (int v = 0; v < nv; v++)
        printf("%s mean %s: %.2f us (%.3f of floor(m))\n", label, specs[v], sum[v] / rounds, sum[v] / rounds / mfloor);
    f16ab_apply("none:", vs);
    free(rows0);
    lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(em), lunar_cuda_event_destroy(e1);
    lunar_cuda_release(mark);
}

/* One prefill shape: the router and permutation once, then both expert GEMMs by each prefill path
 * (2 mma.sync, 4 wgmma, 6 warp-specialised wgmma, its BF16 variants 10-12 (12: BF16's default) and
 * 7; MXFP4: 2, 4, then 14 and 22 (the default) in alternating order, each with its gate/up and down
 * kernel's own median of 7 too), median of 5, and each wgmma path's combined output against path 2's
 * (max rel err: the same products summed in another order). */
static void bench_prefill(int n, int E, int k, int D, int I, int mx, int act, const char *label) {
    size_t mark = lunar_cuda_mark();
    lunar_cuda_moe_experts w;
    memset(&w, 0, sizeof w);
    w.E = E, w.D = D, w.I = I, w.mxfp4 = mx, w.act = act, w.beta = 4.0f, w.beta_l = 25.0f;
    const size_t nw = (size_t)E * I * D;
    if (mx)
        bench_mxfp4(&w, nw, 700u);
    else /* the same seeds as before: 700 + 1000 m + piece */
        w.w1 = bench_bf16(nw, 700u), w.w3 = bench_bf16(nw, 1700u), w.w2 = bench_bf16(nw, 2700u);
    lunar_cuda_moe_route r;
    lunar_cuda_moe_route_init(&r, dalloc(lunar_cuda_moe_route_bytes(n, k, E)), n, k, E);
    float *lg = dalloc((size_t)n * E * 4);
    lunar_cuda_fill_uniform(lg, (size_t)n * E, 77, -4, 4);
    /* LUNAR_MOE_BENCH_ACTIVE=a (0 < a < E): only experts 0 .. a - 1 routed (the others' logits -30),
     * so each gets ~n k / a rows: large experts, several token tiles each (path 25's 192-token tiles
     * against path 24's 256; the model's dummy routing may be skewed so) */
    const int act_e = getenv("LUNAR_MOE_BENCH_ACTIVE") ? atoi(getenv("LUNAR_MOE_BENCH_ACTIVE")) : 0;
    if (act_e > 0 && act_e < E) {
        float *hl = dl_f32(lg, (long)n * E);
        for (size_t i = 0; i < (size_t)n * E; i++)
            if ((int)(i % (size_t)E) >= act_e) hl[i] = -30.0f;
        lunar_cuda_upload(lg, hl, (size_t)n * E * 4);
        free(hl);
        printf("(LUNAR_MOE_BENCH_ACTIVE=%d: %d of %d experts routed, ~%d rows each)\n", act_e, act_e, E, n * k / act_e);
    }
    lunar_cuda_event e0 = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    lunar_cuda_event_record(e0, NULL);
    lunar_cuda_router_topk(r.experts, r.weights, lg, NULL, n, E, k, 1, 1, 1, 1.0f, NULL);
    lunar_cuda_event_record(e1, NULL);
    float ms_router = lunar_cuda_event_ms(e0, e1);
    lunar_cuda_event_record(e0, NULL);
    lunar_cuda_moe_permute(&r, NULL);
    lunar_cuda_event_record(e1, NULL);
    float ms_perm = lunar_cuda_event_ms(e0, e1);
    uint16_t *z = dalloc((size_t)n * D * 2), *hbuf = dalloc((size_t)n * k * I * 2);
    float *zf = dalloc((size_t)n * D * 4), *ybuf = dalloc((size_t)n * k * D * 4), *acc = dalloc((size_t)n * D * 4);
    lunar_cuda_fill_uniform(zf, (size_t)n * D, 5, -1, 1);
    lunar_cuda_f32_to_bf16(z, zf, (size_t)n * D);
    const double flops = 2.0 * n * k * 3.0 * D * I;
    /* paths 10-12, 7, 17 and 18 differ from 6 for BF16 weights only; 14 exists for MXFP4 only */
    /* MXFP4: path 2 (the reference), then with bf16 rows (LUNAR_MOE_YBUF=bf16's form; -24 ..: the
     * path's run_b) 24, 28 (session 13's default) and 32 (the default) in alternating orders (28 and 32 three times),
     * then 32 with fp32 rows (session 13's list ran 25 and 26 where 32 is) */
    /* BF16: path 12, then 29 (12 taking its items from a counter; the default) with fp32 and bf16 rows
     * (-29), in alternating orders, then 12 again; 29 timed per GEMM */
    static const int bpaths[] = {2, 12, 29, -29, -29, 29, 12},
                     mpaths[] = {2, -24, -28, -32, -32, -28, -24, -28, -32, 32};
    static const char *bpn[] = {"mma.sync (old)", "ws fast epi (12)", "29, fp32 rows", "29, bf16 rows",
                                "29, bf16 again", "29, fp32 again", "12 again"},
                      *mpn[] = {"mma.sync (old)", "24, bf16 rows", "28, bf16 (s13 default)", "32, bf16 (default)",
                                "32, bf16 again", "28, bf16 again", "24, bf16 again", "28, bf16 third",
                                "32, bf16 third", "32, fp32 rows"};
    const int *paths = mx ? mpaths : bpaths;
    const char *const *pn = mx ? mpn : bpn;
    float *ref = NULL;
    uint16_t *yb = dalloc((size_t)n * k * D * 2);
    const int npaths = mx ? (int)(sizeof mpaths / sizeof mpaths[0]) : (int)(sizeof bpaths / sizeof bpaths[0]);
    for (int i = 0; i < npaths; i++) {
        const int path = paths[i] < 0 ? -paths[i] : paths[i], brows = paths[i] < 0;
        lunar_cuda_fill_u32(ybuf, 0x7fc00000u, (size_t)n * k * D);
        if (brows) lunar_cuda_fill_u32(yb, 0x7fc07fc0u, (size_t)n * k * D / 2);
        const int wy = (mx && (path == 14 || path == 22 || path >= 24)) || (!mx && path == 29);
        float gu = 0.0f, dn = 0.0f;
        float ms = wy ? time_experts_split(ybuf, brows ? yb : NULL, hbuf, z, &w, &r, path, 7, &gu, &dn)
                      : time_experts(ybuf, hbuf, z, &w, &r, path, 5, NULL, 0);
        if (brows) {
            lunar_cuda_fill_u32(acc, 0, (size_t)n * D);
            lunar_cuda_moe_combine_add_b(acc, yb, &r, D, NULL, NULL);
        } else {
            lunar_cuda_moe_combine(acc, ybuf, &r, D, NULL);
        }
        float *y = dl_f32(acc, (long)n * D);
        double err = 0.0;
        if (ref) err = lunar_max_rel_err(y, ref, (long)n * D);
        char split[96] = "";
        /* gate/up is 2/3 of the FLOPs, down 1/3 */
        if (wy)
            snprintf(split, sizeof split, "gate/up %.2f ms (%.0f %%), down %.2f ms (%.0f %%)", gu,
                     100.0 * flops * 2 / 3 / (gu * 1e-3) / g_dense_peak, dn,
                     100.0 * flops / 3 / (dn * 1e-3) / g_dense_peak);
        printf("| prefill %-24s %-5s | %-14s | %5d | %8.2f | %6.1f | %5.0f %% | %s%.2g | %s | router %.3f ms, permute %.3f ms |\n",
               label, mx ? "mxfp4" : "bf16", pn[i], n, ms, flops / (ms * 1e-3) / 1e12,
               100.0 * flops / (ms * 1e-3) / g_dense_peak, ref ? "vs old " : "", ref ? err : 0.0, split, ms_router,
               ms_perm);
        if (ref) free(y);
        else ref = y;
    }
    free(ref);
    lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(e1);
    lunar_cuda_release(mark);
}

/* Median ms of f over reps (events, default stream). */
static float time_gemm(uint16_t *y, const uint16_t *x, const uint16_t *W, int n, int N, int K, int reps) {
    lunar_cuda_event e0 = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    float ts[16];
    lunar_cuda_matmul(y, LUNAR_CUDA_BF16, x, W, n, N, K, NULL);
    for (int i = 0; i < reps; i++) {
        lunar_cuda_event_record(e0, NULL);
        lunar_cuda_matmul(y, LUNAR_CUDA_BF16, x, W, n, N, K, NULL);
        lunar_cuda_event_record(e1, NULL);
        ts[i] = lunar_cuda_event_ms(e0, e1);
    }
    lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(e1);
    qsort(ts, (size_t)reps, sizeof ts[0], cmpf);
    return ts[reps / 2];
}

TEST(cuda_moe_bench) {
    if (!getenv("LUNAR_MOE_BENCH")) return;
    if (!moe_cuda_on()) return;
    const size_t fw = (size_t)64 << 20; /* 256 MiB L2 flush buffer */
    void *flush = dalloc(fw * 4);
    printf("\n%s\n\n", lunar_cuda_describe());
    /* the machine's own references: streaming read (GEMV over 1 GiB of bf16, n = 1) and the dense
     * bf16 GEMM peak (8192^3), both cuBLAS through lunar_cuda_matmul. The peak is taken on random
     * operands, as lunar bench's (the expert GEMMs run on random weights and activations); constant
     * operands toggle fewer bits, draw less power and run ~10 % faster (865-887 against 790-804 TF,
     * session 12): that figure, the reference of the tables before session 12, is printed beside it. */
    {
        size_t mark = lunar_cuda_mark();
        const int rows = 131072, cols = 4096;
        const size_t sq = (size_t)8192 * 8192; /* W doubles as the GEMM's [8192, 8192] weight */
        uint16_t *W = dalloc((size_t)rows * cols * 2), *x = dalloc(sq * 2), *y = dalloc(sq * 2);
        lunar_cuda_fill_u32(W, 0x3c003c00u, (size_t)rows * cols / 2);
        lunar_cuda_fill_u32(x, 0x3c003c00u, sq / 2);
        float gemv = time_gemm(y, x, W, 1, rows, cols, 11);
        g_read_bw = (double)rows * cols * 2 / (gemv * 1e-3);
        const float mm_const = time_gemm(y, x, W, 8192, 8192, 8192, 7);
        lunar_dummy_gen gen = {.key = 0x6d6f655f7065616bull, .kind = LUNAR_DUMMY_UNIFORM, .a = 1.0f};
        lunar_cuda_dummy_bf16(W, &gen, 0, sq);
        gen.key ^= 0x5555;
        lunar_cuda_dummy_bf16(x, &gen, 0, sq);
        float mm = time_gemm(y, x, W, 8192, 8192, 8192, 7);
        g_dense_peak = 2.0 * 8192.0 * 8192.0 * 8192.0 / (mm * 1e-3);
        printf("Measured here: GEMV 1 GiB %.3f ms = %.2f TB/s read; dense bf16 GEMM 8192^3 %.3f ms = %.0f TFLOP/s on "
               "random operands (the peak below; constant operands %.0f TFLOP/s)\n\n",
               gemv, g_read_bw / 1e12, mm, g_dense_peak / 1e12, 2.0 * 8192.0 * 8192.0 * 8192.0 / (mm_const * 1e-3) / 1e12);
        lunar_cuda_release(mark);
    }
    /* LUNAR_MOE_BENCH=prefill: the references and the prefill shapes only; =prefill-bf16: only the
     * BF16 prefill shape (Kimi-Linear: short Nsight Compute runs); =prefill-mxfp4: only K3.1's */
    const int bf16_only = !strcmp(getenv("LUNAR_MOE_BENCH"), "prefill-bf16");
    const int mx_only = !strcmp(getenv("LUNAR_MOE_BENCH"), "prefill-mxfp4");
    const int f16ab = !strcmp(getenv("LUNAR_MOE_BENCH"), "f16ab");
    const int decode = strcmp(getenv("LUNAR_MOE_BENCH"), "prefill") != 0 && !bf16_only && !mx_only && !f16ab;
    g_bench_one = !strcmp(getenv("LUNAR_MOE_BENCH"), "decode1");
    if (decode) printf("Decode (both expert GEMMs, clean L2 flush before each repeat, median of 21). floor = bytes of\n"
           "the distinct touched experts (packed + scales, or bf16) / %.1f TB/s; ratio = time / floor (target <= 1.3);\n"
           "floor(m) = bytes / the GEMV read rate above. pair = the decode kernel pair (path 1), v2 = the\n"
           "warp-team kernels (path 6), fused = the fused persistent kernel (path 3, MXFP4 only), f16 = the pair on f16 tensor cores\n"
           "(path 16, MXFP4 only; its output against the pair's in the last column).\n\n",
           BW / 1e12);
    g_flush_x = dalloc(4096 * 2), g_flush_y = dalloc((fw * 2 / 4096) * 4);
    lunar_cuda_fill_u32(g_flush_x, 0, 4096 / 2);
    g_flush_clean = 1;
    if (f16ab) { /* K3.1's layer and its TP8 slice (LUNAR_MOE_BENCH_SHAPES=k3 | tp8 for one) */
        const char *sh = getenv("LUNAR_MOE_BENCH_SHAPES") ? getenv("LUNAR_MOE_BENCH_SHAPES") : "k3 tp8";
        if (strstr(sh, "k3")) bench_f16ab(896, 16, 3584, 3072, "K3.1 (3584, 3072)", flush, fw);
        if (strstr(sh, "tp8")) bench_f16ab(896, 16, 3584, 384, "K3.1 TP8 (3584, 384)", flush, fw);
        return;
    }
    if (decode) {
        printf("| shape | n | exp | MB | floor us | floor(m) us | pair us | pair/floor(m) | v2 us | v2/floor(m) | pair GB/s | "
               "v2 GB/s | fused us | v2 vs pair | f16 us | f16/floor(m) | f16 GB/s | f16 vs pair |\n");
        printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        bench_shape(896, 16, 3584, 3072, 1, "K3.1 (3584, 3072)", flush, fw);
        bench_shape(896, 16, 3584, 384, 1, "K3.1 TP8 (3584, 384)", flush, fw);
        /* LUNAR_MOE_BENCH=decode1: the K3.1 shapes and Kimi-Linear's BF16 one at batch 1 only (short
         * Nsight Compute runs: the BF16 kernels come after the MXFP4 ones) */
        bench_shape(256, 8, 2304, 1024, 0, "Kimi-Linear bf16 (2304, 1024)", flush, fw);
        if (g_bench_one) return;
        bench_shape(256, 8, 2304, 1024, 1, "Kimi-Linear mxfp4", flush, fw);
    }
    /* LUNAR_MOE_BENCH=decode: the references and the decode shapes only */
    if (!strcmp(getenv("LUNAR_MOE_BENCH"), "decode")) return;
    printf("\nPrefill (grouped GEMMs, both; MXFP4 widened to bf16), FLOPs = 2 n k 3 D I; "
           "target >= 50 %% of the measured dense peak (%.0f TFLOP/s; nominal %.0f).\n\n", g_dense_peak / 1e12, TC / 1e12);
    printf("| shape | kernel | n | ms | TFLOP/s | of peak | output | routing |\n|---|---|---|---|---|---|---|---|\n");
    /* each model's activation (K3.1: SiTU; Kimi-Linear: SwiGLU, hidden_act silu), and Kimi-Linear
     * with SiTU as sessions 3-5 measured it (the epilogue's share differs: SiTU's tanh) */
    if (!bf16_only) {
        bench_prefill(8192, 896, 16, 3584, 3072, 1, 1, "K3.1 (lat 3584, I 3072)");
        bench_prefill(8192, 896, 16, 3584, 384, 1, 1, "K3.1 TP8 (I 384)");
    }
    if (!mx_only) {
        bench_prefill(8192, 256, 8, 2304, 1024, 0, 0, "Kimi-Linear swiglu");
        bench_prefill(8192, 256, 8, 2304, 1024, 0, 1, "Kimi-Linear (situ, as s5)");
    }
    fflush(stdout);
}


#endif
