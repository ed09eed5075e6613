/* The fused AttnRes mix + out-norm (cuda_attnres.cu) against op_attnres_mix on random candidates,
 * several shapes (decode and prefill rows, K3's D = 7168 with 2..13 candidates at the decode batches
 * 1, 2, 8, 64, odd D, one candidate, the 64 of the largest stack, the cluster kernel's SMAX = 16
 * candidates and 17, its fallback), with and without the out-norm, under each kernel choice
 * (lunar_cuda_attnres_mode: the rule, the block kernel, the cluster kernel where it applies). The
 * output sits between guard words and is poisoned first (NaN), so an unwritten element or a write out
 * of bounds fails. Tolerance 1e-5 of max |ref|: the dot and the sum of squares are accumulated in
 * double as the CPU's; only the scores' rounding to fp32, the softmax and the mix m are fp32 (~S ulp).
 *
 * With LUNAR_NORM_BENCH=1, cuda_attnres_bench times the fused kernel, the generic glue kernel it
 * replaces and RMSNorm against the bandwidth floor (bytes / a device copy's rate, measured in the
 * same run), then the block and the cluster kernels at decode rows; a benchmark, not a test, skipped
 * otherwise. */
#include "test.h"

#ifndef LUNAR_HAVE_CUDA

TEST(cuda_attnres_skipped) { fprintf(stderr, "[skipped: no CUDA device: lunar was built without CUDA] "); }

#else

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_glue.h"
#include "backend/cuda/cuda_ops.h"
#include "ops.h"
#include "cuda_test.h"
#include "ops_util.h"

#define GUARD 64
#define SENT 0x7fc17fc1u /* NaN as fp32 */

static int attnres_cuda_on(void) { return lunar_test_cuda_on((size_t)6 << 30); }

static void *up(const void *h, size_t bytes) {
    void *p = lunar_cuda_alloc(bytes);
    LUNAR_ASSERT(p);
    lunar_cuda_upload(p, h, bytes);
    return p;
}

/* S candidate rows [n, D] with per-candidate scales (so the softmax is not uniform), the device
 * pointer table, u = proj * norm as op_attnres_mix folds it */
typedef struct cands {
    float **h;
    const float **d, *const *dtab, *du, *don;
    float *proj, *norm, *on, *u;
} cands;

static void cands_make(cands *c, int S, int n, int D, unsigned seed) {
    c->h = lunar_xmalloc((size_t)S * sizeof *c->h);
    c->d = lunar_xmalloc((size_t)S * sizeof *c->d);
    for (int i = 0; i < S; i++) {
        const float a = 0.25f + (float)(i % 5);
        c->h[i] = test_rand((long)n * D, seed + (unsigned)i, -a, a);
        c->d[i] = up(c->h[i], (size_t)n * D * 4);
    }
    c->dtab = up(c->d, (size_t)S * sizeof *c->d);
    c->proj = test_rand(D, seed + 100, -2.0f / sqrtf((float)D), 2.0f / sqrtf((float)D));
    c->norm = test_rand(D, seed + 101, 0.5f, 1.5f);
    c->on = test_rand(D, seed + 102, 0.5f, 1.5f);
    c->u = test_alloc(D);
    for (int d = 0; d < D; d++) c->u[d] = c->proj[d] * c->norm[d];
    c->du = up(c->u, (size_t)D * 4);
    c->don = up(c->on, (size_t)D * 4);
}

static void cands_free(cands *c, int S) {
    for (int i = 0; i < S; i++) free(c->h[i]);
    free(c->h), free(c->d), free(c->proj), free(c->norm), free(c->on), free(c->u);
}

/* one shape under one kernel choice, with and without the out-norm */
static void attnres_check(const cands *c, int S, int n, int D, int mode) {
    static const char *mode_name[] = {"rule", "block", "cluster"};
    const long N = (long)n * D;
    lunar_tensor P = test_tensor1(LUNAR_DTYPE_F32, D, c->proj), R = test_tensor1(LUNAR_DTYPE_F32, D, c->norm);
    lunar_tensor O = test_tensor1(LUNAR_DTYPE_F32, D, c->on);
    const int prev = lunar_cuda_attnres_mode(mode);
    for (int with_norm = 0; with_norm < 2; with_norm++) {
        float *ref = test_poisoned(N);
        op_attnres_mix(ref, (const float *const *)c->h, S, &P, &R, with_norm ? &O : NULL, n, D, 1e-6f);
        uint32_t *buf = lunar_cuda_alloc(((size_t)N + 2 * GUARD) * 4);
        LUNAR_ASSERT(buf);
        lunar_cuda_fill_u32(buf, SENT, (size_t)N + 2 * GUARD);
        float *dy = (float *)(buf + GUARD);
        /* the bf16 copy (with the norm only; without, none is asked for): guarded and poisoned too */
        uint16_t *bbuf = lunar_cuda_alloc(((size_t)N + 2 * GUARD) * 2 + 4);
        LUNAR_ASSERT(bbuf);
        lunar_cuda_fill_u32(bbuf, SENT, ((size_t)N + 2 * GUARD) / 2 + 1);
        uint16_t *db = with_norm ? bbuf + GUARD : NULL;
        lunar_cuda_attnres_mix(dy, db, c->dtab, S, c->du, with_norm ? c->don : NULL, n, D, 1e-6f, NULL);
        lunar_cuda_sync();
        float *y = test_alloc(N);
        uint32_t g[2 * GUARD];
        lunar_cuda_download(y, dy, (size_t)N * 4);
        lunar_cuda_download(g, buf, GUARD * 4);
        lunar_cuda_download(g + GUARD, buf + GUARD + N, GUARD * 4);
        int guards = 1;
        for (int i = 0; i < 2 * GUARD; i++) guards &= g[i] == SENT;
        if (db) { /* exactly y's bf16 rounding, and nothing written around it */
            uint16_t *hb = malloc(((size_t)N + 2 * GUARD) * 2);
            lunar_cuda_download(hb, bbuf, ((size_t)N + 2 * GUARD) * 2);
            long bad = 0;
            for (long i = 0; i < N; i++) bad += hb[GUARD + i] != lunar_f32_to_bf16(y[i]);
            for (int i = 0; i < GUARD; i++) bad += hb[i] != 0x7fc1 || hb[GUARD + N + i] != 0x7fc1;
            CHECK_MSG(bad == 0, "attnres %s n=%d S=%d D=%d: %ld bf16 copy elements or guards wrong", mode_name[mode], n,
                      S, D, bad);
            free(hb);
        }
        const double e = lunar_max_rel_err(y, ref, N);
        if (getenv("LUNAR_TEST_VERBOSE"))
            fprintf(stderr, "\n    attnres %s n=%d S=%d D=%d%s max rel err %.3g (tol 1e-05)", mode_name[mode], n, S, D,
                    with_norm ? " +norm" : "", e);
        CHECK_MSG(e <= 1e-5, "attnres %s n=%d S=%d D=%d norm %d: max rel err %.3g", mode_name[mode], n, S, D,
                  with_norm, e);
        CHECK_MSG(guards, "attnres %s n=%d S=%d D=%d: a guard word was overwritten", mode_name[mode], n, S, D);
        free(ref), free(y);
    }
    lunar_cuda_attnres_mode(prev);
    test_tensor_free(&P), test_tensor_free(&R), test_tensor_free(&O);
}

static void attnres_shape(int n, int S, int D, unsigned seed) {
    size_t mark = lunar_cuda_mark();
    cands c;
    cands_make(&c, S, n, D, seed);
    for (int mode = LUNAR_ATTNRES_AUTO; mode <= LUNAR_ATTNRES_CLUSTER; mode++) attnres_check(&c, S, n, D, mode);
    cands_free(&c, S);
    lunar_cuda_release(mark);
}

TEST(cuda_attnres_fused_vs_cpu) {
    if (!attnres_cuda_on()) return;
    /* n, S, D: decode and prefill rows; odd D (the cluster kernel's partial slices and lanes past D:
     * 45 and 257 fewer CTAs than 8, 1000 and 2049 8 CTAs with a short last one, 1 one column);
     * S = 16 the cluster kernel's SMAX at n = 3, 17 its fallback to the block kernel, 64 the largest stack */
    static const int shapes[][3] = {{1, 9, 7168},  {64, 9, 7168},  {37, 3, 2304}, {300, 13, 1000}, {5, 1, 45},
                                    {2, 64, 8192}, {3, 2, 257},    {3, 16, 7168}, {3, 17, 7168},   {4, 7, 2049},
                                    {2, 13, 4097}, {1, 5, 1},      {8, 16, 8192}};
    for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        attnres_shape(shapes[s][0], shapes[s][1], shapes[s][2], 500 + 10 * s);
}

/* K3's decode shapes: D = 7168, 2..13 candidates (the stack grows through the layers), n = 1, 2, 8, 64 */
TEST(cuda_attnres_decode_vs_cpu) {
    if (!attnres_cuda_on()) return;
    static const int rows[] = {1, 2, 8, 64};
    for (unsigned r = 0; r < sizeof rows / sizeof rows[0]; r++)
        for (int S = 2; S <= 13; S++) attnres_shape(rows[r], S, 7168, 700 + 20 * r + (unsigned)S);
}

/* ---------------------------------------------------------------- benchmark (LUNAR_NORM_BENCH=1) */

static float time_ms(lunar_cuda_event e0, lunar_cuda_event e1) { return lunar_cuda_event_ms(e0, e1); }

TEST(cuda_attnres_bench) {
    if (!getenv("LUNAR_NORM_BENCH")) return;
    if (!attnres_cuda_on()) return;
    lunar_cuda_event e0 = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    const int reps = 20;
    /* the floor's rate: a 1 GiB device copy */
    size_t mark = lunar_cuda_mark();
    const size_t cb = (size_t)1 << 30;
    void *a = lunar_cuda_alloc(cb), *b = lunar_cuda_alloc(cb);
    LUNAR_ASSERT(a && b);
    lunar_glue_copy(b, a, cb, NULL);
    lunar_cuda_event_record(e0, NULL);
    for (int r = 0; r < 5; r++) lunar_glue_copy(b, a, cb, NULL);
    lunar_cuda_event_record(e1, NULL);
    const double bw = 2.0 * cb * 5 / (time_ms(e0, e1) * 1e-3); /* bytes read + written per second */
    lunar_cuda_release(mark);
    printf("\n| op (K3 shapes, D = 7168) | rows | time_us | GB/s | floor_us | floor/time |\n|---|---|---|---|---|---|\n");
    static const int rows[] = {1, 64, 8192};
    for (unsigned k = 0; k < sizeof rows / sizeof rows[0]; k++) {
        const int n = rows[k], D = 7168, S = 9;
        mark = lunar_cuda_mark();
        cands c;
        cands_make(&c, S, n, D, 900 + k);
        float *y = lunar_cuda_alloc((size_t)n * D * 4);
        uint16_t *wb = lunar_cuda_alloc((size_t)D * 2), *yb = lunar_cuda_alloc((size_t)n * D * 2);
        lunar_cuda_fill_u32(wb, 0x3f803f80u, (size_t)D / 2); /* bf16 1.0 */
        const double mix_bytes = (double)(S + 1) * n * D * 4, norm_bytes = (double)n * D * (4 + 2);
        for (int which = 0; which < 3; which++) {
            for (int r = 0; r < 2 + reps; r++) {
                if (r == 2) lunar_cuda_event_record(e0, NULL);
                if (which == 0) lunar_cuda_attnres_mix(y, NULL, c.dtab, S, c.du, c.don, n, D, 1e-6f, NULL);
                else if (which == 1) lunar_glue_attnres_mix(y, c.dtab, S, c.du, c.don, n, D, 1e-6f, NULL);
                else lunar_cuda_rmsnorm(yb, LUNAR_CUDA_BF16, c.d[0], wb, n, D, 1e-6f, NULL);
            }
            lunar_cuda_event_record(e1, NULL);
            const double us = time_ms(e0, e1) * 1e3 / reps, by = which < 2 ? mix_bytes : norm_bytes;
            static const char *names[] = {"AttnRes mix + norm, fused, the rule's kernel (S=9)", "AttnRes mix + norm, glue (S=9)",
                                          "RMSNorm fp32 -> bf16"};
            printf("| %s | %d | %.1f | %.0f | %.1f | %.0f%% |\n", names[which], n, us, by / (us * 1e-6) / 1e9,
                   by / bw * 1e6, 100.0 * (by / bw * 1e6) / us);
        }
        cands_free(&c, S);
        lunar_cuda_release(mark);
    }
    /* the two kernels at decode rows (LUNAR_ATTNRES=block / =cluster's choices; the rule's threshold
     * is read from this table) */
    printf("\n| AttnRes mix + norm, D = 7168 | rows | S | block us | cluster us | floor_us |\n|---|---|---|---|---|---|\n");
    static const int drows[] = {1, 8, 16, 32, 64}, dS[] = {9, 13};
    for (unsigned k = 0; k < sizeof drows / sizeof drows[0]; k++)
        for (unsigned q = 0; q < sizeof dS / sizeof dS[0]; q++) {
            const int n = drows[k], D = 7168, S = dS[q];
            mark = lunar_cuda_mark();
            cands c;
            cands_make(&c, S, n, D, 950 + 10 * k + q);
            float *y = lunar_cuda_alloc((size_t)n * D * 4);
            double us[2];
            for (int which = 0; which < 2; which++) {
                const int prev = lunar_cuda_attnres_mode(which ? LUNAR_ATTNRES_CLUSTER : LUNAR_ATTNRES_BLOCK);
                for (int r = 0; r < 2 + reps; r++) {
                    if (r == 2) lunar_cuda_event_record(e0, NULL);
                    lunar_cuda_attnres_mix(y, NULL, c.dtab, S, c.du, c.don, n, D, 1e-6f, NULL);
                }
                lunar_cuda_event_record(e1, NULL);
                us[which] = time_ms(e0, e1) * 1e3 / reps;
                lunar_cuda_attnres_mode(prev);
            }
            const double by = (double)(S + 1) * n * D * 4;
            printf("| | %d | %d | %.1f | %.1f | %.1f |\n", n, S, us[0], us[1], by / bw * 1e6);
            cands_free(&c, S);
            lunar_cuda_release(mark);
        }
    printf("floor: bytes / %.0f GB/s (a 1 GiB device copy in the same run)\n", bw / 1e9);
    lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(e1);
}

#endif
