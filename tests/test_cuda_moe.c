/* The CUDA latent MoE (src/backend/cuda/cuda_moe.cu) against the CPU ops on random weights and
 * routings: router top-k, the permutation (empty and overloaded experts), the MXFP4 and BF16
 * experts on both paths (decode kernel, grouped GEMM), the whole latent routed path. Skipped when
 * no CUDA device is present. The benchmarks (LUNAR_MOE_BENCH) are in test_cuda_moe_bench.c.
 *
 * Tolerances (relative to max |reference|, lunar_max_rel_err):
 *  - router weights: same sigmoid (expf, 2 ulp), same renormalisation order: 1e-5; experts exact.
 *  - experts: the GPU widens every MXFP4 weight exactly (E2M1 * 2^(s-127) in bf16) and both sides
 *    get the same bf16 input z, so products are exact and the fp32 sums differ in order only; the
 *    one real difference is the intermediate h, stored bf16 on the GPU (the second GEMM's
 *    operand) and fp32 on the CPU: 2^-9 relative per element, random signs over I terms, so the
 *    output sees ~2^-9 of its own size at worst: 1e-2 (the bf16-activation level of the issue).
 *  - the whole path: z and the normed latent are rounded to bf16 on both sides (the CPU rounds
 *    the same values), plus h as above: 2e-2. */
#include "test.h"

#ifndef LUNAR_HAVE_CUDA

TEST(cuda_moe_skipped) { fprintf(stderr, "[skipped: no CUDA device: lunar was built without CUDA] "); }

#else

#include <stdint.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_ops.h"
#include "model/dummy.h"
#include "ops.h"
#include "cuda_test.h"
#include "cuda_moe_test.h"
#include "ops_util.h"

static void rnd_bf16(float *x, long n) {
    for (long i = 0; i < n; i++) x[i] = lunar_bf16_to_f32(lunar_f32_to_bf16(x[i]));
}
static uint16_t *bf16_of(const float *x, long n) {
    uint16_t *b = malloc((size_t)(n > 0 ? n : 1) * 2);
    for (long i = 0; i < n; i++) b[i] = lunar_f32_to_bf16(x[i]);
    return b;
}
static void moe_report(const char *what, double e, double tol) {
    if (getenv("LUNAR_TEST_VERBOSE")) fprintf(stderr, "\n    %-52s max rel err %.3g (tol %.0e)", what, e, tol);
    CHECK_MSG(e <= tol, "%s: max rel err %.3g > %.0e", what, e, tol);
}
static uint32_t lcg(uint32_t *s) {
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

/* ---------------------------------------------------------------- router */

TEST(cuda_moe_router_topk_vs_cpu) {
    if (!moe_cuda_on()) return;
    /* ties: logits rounded to integers and the bias to quarters (27 distinct choices for hundreds of
     * experts: every round breaks ties, to the lower index); k = 64 of 100 fills both slot halves
     * of the warp router's lanes; E = 1000 and 100 leave lanes without candidates; E = 2048 takes
     * the block router (the warp router's lanes hold at most 1024) */
    static const int cases[][7] = {/* n, E, k, n_group, topk_group, renorm, ties */
                                   {1, 896, 16, 1, 1, 1, 0},  {37, 896, 16, 1, 1, 1, 0}, {64, 256, 8, 1, 1, 1, 0},
                                   {19, 256, 8, 8, 4, 1, 0},  {5, 64, 6, 8, 3, 0, 0},    {300, 384, 8, 1, 1, 1, 0},
                                   {9, 256, 8, 1, 1, 1, 1},   {3, 896, 16, 1, 1, 1, 1},  {6, 256, 8, 8, 4, 1, 1},
                                   {4, 100, 64, 1, 1, 1, 0},  {5, 1000, 16, 1, 1, 0, 1}, {2, 2048, 8, 1, 1, 1, 0}};
    for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int n = cases[c][0], E = cases[c][1], k = cases[c][2], ng = cases[c][3], tg = cases[c][4];
        const int renorm = cases[c][5];
        const float scale = renorm ? 1.0f : 2.5f;
        size_t mark = lunar_cuda_mark();
        float *lg = test_rand((long)n * E, 100 + c, -4, 4), *b = test_rand(E, 200 + c, -0.3f, 0.3f);
        if (cases[c][6]) {
            for (long i = 0; i < (long)n * E; i++) lg[i] = roundf(lg[i]);
            for (int e = 0; e < E; e++) b[e] = roundf(b[e] * 4.0f) / 4.0f;
        }
        lunar_tensor B = test_tensor1(LUNAR_DTYPE_F32, E, b);
        int32_t *ex = malloc((size_t)n * k * 4), *gx = malloc((size_t)n * k * 4);
        float *w = test_alloc((long)n * k);
        op_router_topk(ex, w, lg, &B, n, E, k, ng, tg, renorm, scale);
        int32_t *dex = dalloc((size_t)n * k * 4);
        float *dw = dalloc((size_t)n * k * 4);
        lunar_cuda_router_topk(dex, dw, din(lg, (size_t)n * E * 4), din(b, (size_t)E * 4), n, E, k, ng,
                               tg, renorm, scale, NULL);
        float *gw = dl_f32(dw, (long)n * k);
        lunar_cuda_download(gx, dex, (size_t)n * k * 4);
        int same = 1;
        for (long i = 0; i < (long)n * k; i++) same &= gx[i] == ex[i];
        CHECK_MSG(same, "router n=%d E=%d k=%d: experts differ", n, E, k);
        char what[96];
        snprintf(what, sizeof what, "router_topk n=%d E=%d k=%d groups %d/%d", n, E, k, ng, tg);
        moe_report(what, lunar_max_rel_err(gw, w, (long)n * k), 1e-5);
        free(lg), free(b), free(ex), free(gx), free(w), free(gw);
        lunar_cuda_release(mark);
    }
}

/* NaN logits (an overflowed activation): every selected index stays a valid expert, the same as
 * the CPU op's (NaN ranks last); the forward permutes by these indices, so -1 would be an
 * illegal address, not just a wrong answer. Rows: all NaN, half NaN, one NaN, none. */
TEST(cuda_moe_router_nan_logits_stay_in_range) {
    if (!moe_cuda_on()) return;
    const int n = 4, E = 256, k = 8;
    size_t mark = lunar_cuda_mark();
    float *lg = test_rand((long)n * E, 77, -4, 4);
    for (int e = 0; e < E; e++) lg[e] = NAN;
    for (int e = 0; e < E; e += 2) lg[E + e] = NAN;
    lg[2 * E + 5] = NAN;
    int32_t ex[32], gx[32];
    float w[32];
    op_router_topk(ex, w, lg, NULL, n, E, k, 1, 1, 1, 1.0f);
    int32_t *dex = dalloc((size_t)n * k * 4);
    float *dw = dalloc((size_t)n * k * 4);
    lunar_cuda_router_topk(dex, dw, din(lg, (size_t)n * E * 4), NULL, n, E, k, 1, 1, 1, 1.0f, NULL);
    lunar_cuda_download(gx, dex, sizeof gx);
    for (int i = 0; i < n * k; i++) {
        CHECK_MSG(gx[i] >= 0 && gx[i] < E, "slot %d: expert %d out of range", i, gx[i]);
        CHECK_MSG(gx[i] == ex[i], "slot %d: CUDA expert %d, CPU %d", i, gx[i], ex[i]);
    }
    free(lg);
    lunar_cuda_release(mark);
}

/* the batch-1 route (top-k + permutation in one launch) leaves the route workspace byte for byte as
 * lunar_cuda_router_topk + lunar_cuda_moe_permute (both workspaces poisoned alike first, so a
 * field one writes and the other does not differs too); cases: Kimi-Linear's 256/8 (plain and
 * grouped), a wide 896/16, renorm off with a scale, NaN logits (ranked last) */
TEST(cuda_moe_route_one_matches_topk_permute) {
    if (!moe_cuda_on()) return;
    static const int cases[][6] = {/* E, k, n_group, topk_group, renorm, nan (2: ties instead) */
                                   {256, 8, 1, 1, 1, 0}, {256, 8, 8, 4, 1, 0}, {896, 16, 1, 1, 1, 0},
                                   {64, 6, 8, 3, 0, 0},  {256, 8, 1, 1, 1, 1}, {8, 8, 1, 1, 1, 0},
                                   {256, 8, 1, 1, 1, 2}, {896, 16, 1, 1, 1, 2}, {100, 64, 1, 1, 1, 0},
                                   {1000, 40, 1, 1, 0, 1}};
    for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int E = cases[c][0], k = cases[c][1], ng = cases[c][2], tg = cases[c][3], renorm = cases[c][4];
        const float scale = renorm ? 2.0f : 2.5f;
        size_t mark = lunar_cuda_mark();
        float *lg = test_rand(E, 300 + c, -4, 4), *b = test_rand(E, 400 + c, -0.3f, 0.3f);
        if (cases[c][5] == 1)
            for (int e = 0; e < E; e += 3) lg[e] = NAN;
        if (cases[c][5] == 2) /* ties: as in cuda_moe_router_topk_vs_cpu */
            for (int e = 0; e < E; e++) lg[e] = roundf(lg[e]), b[e] = roundf(b[e] * 4.0f) / 4.0f;
        const float *dlg = din(lg, (size_t)E * 4), *db = din(b, (size_t)E * 4);
        const size_t bytes = lunar_cuda_moe_route_bytes(1, k, E);
        void *w1 = dalloc(bytes), *w2 = dalloc(bytes);
        lunar_cuda_fill_u32(w1, 0xdeadbeefu, bytes / 4);
        lunar_cuda_fill_u32(w2, 0xdeadbeefu, bytes / 4);
        lunar_cuda_moe_route r1, r2;
        lunar_cuda_moe_route_init(&r1, w1, 1, k, E);
        lunar_cuda_moe_route_init(&r2, w2, 1, k, E);
        lunar_cuda_router_topk(r1.experts, r1.weights, dlg, db, 1, E, k, ng, tg, renorm, scale, NULL);
        lunar_cuda_moe_permute(&r1, NULL);
        lunar_cuda_moe_route_one(&r2, dlg, db, ng, tg, renorm, scale, 0, NULL);
        unsigned char *h1 = malloc(bytes), *h2 = malloc(bytes);
        lunar_cuda_sync();
        lunar_cuda_download(h1, w1, bytes);
        lunar_cuda_download(h2, w2, bytes);
        size_t first = bytes;
        for (size_t i = 0; i < bytes && first == bytes; i++)
            if (h1[i] != h2[i]) first = i;
        CHECK_MSG(first == bytes, "route_one E=%d k=%d groups %d/%d: workspace differs from byte %zu of %zu", E, k,
                  ng, tg, first, bytes);
        free(lg), free(b), free(h1), free(h2);
        lunar_cuda_release(mark);
    }
}

/* The router's variants (lunar_cuda_router_mode: 0 the warp router, rolled from E > 256; 3 unrolled,
 * session 11's; 2 flat; 4 the sorting router, the default) leave the same
 * bytes: route_one's whole workspace (shared expert on and off) and the batched router's experts and
 * weights, bit for bit, on K3's 896/16 (plain, ties, NaN logits) and 1000/40 (rolled against unrolled;
 * past the sort's k), Kimi-Linear's 256/8 (plain, grouped: the sort falls back) and 100/64, and the
 * sort's edges: one warp (32/5), a partial last warp (33/32: k at its limit, 7 of 8 warps' lists
 * padding), 1024/32 (32 warps), 200/1, and all ties (every logit and bias equal: the order is the
 * index). */
TEST(cuda_moe_route_variants_same_bits) {
    if (!moe_cuda_on()) return;
    static const int cases[][6] = {/* E, k, n_group, topk_group, renorm, logits (1 NaN, 2 ties) */
                                   {896, 16, 1, 1, 1, 0}, {896, 16, 1, 1, 1, 2}, {896, 16, 1, 1, 0, 1},
                                   {256, 8, 1, 1, 1, 0},  {256, 8, 8, 4, 1, 0},  {1000, 40, 1, 1, 1, 0},
                                   {100, 64, 1, 1, 1, 0}, {64, 6, 8, 3, 0, 0},  {32, 5, 1, 1, 1, 0},
                                   {33, 32, 1, 1, 1, 2},  {1024, 32, 1, 1, 1, 0}, {200, 1, 1, 1, 0, 0},
                                   {896, 16, 1, 1, 1, 3}};
    static const int modes[] = {3, 2, 4};
    const int n_modes = (int)(sizeof modes / sizeof modes[0]);
    const int mode0 = lunar_cuda_router_mode(-1);
    for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int E = cases[c][0], k = cases[c][1], ng = cases[c][2], tg = cases[c][3], renorm = cases[c][4];
        const int n = 37, shared = c & 1;
        const float scale = renorm ? 2.0f : 2.5f;
        size_t mark = lunar_cuda_mark();
        float *lg = test_rand((long)n * E, 500 + c, -4, 4), *b = test_rand(E, 600 + c, -0.3f, 0.3f);
        if (cases[c][5] == 1)
            for (long e = 0; e < (long)n * E; e += 3) lg[e] = NAN;
        if (cases[c][5] == 2) {
            for (long e = 0; e < (long)n * E; e++) lg[e] = roundf(lg[e]);
            for (int e = 0; e < E; e++) b[e] = roundf(b[e] * 4.0f) / 4.0f;
        }
        if (cases[c][5] == 3) {
            for (long e = 0; e < (long)n * E; e++) lg[e] = 0.5f;
            for (int e = 0; e < E; e++) b[e] = 0.0f;
        }
        const float *dlg = din(lg, (size_t)n * E * 4), *db = din(b, (size_t)E * 4);
        const size_t bytes = lunar_cuda_moe_route_bytes(1, k + shared, E), tb = (size_t)n * k * 4;
        unsigned char *h0 = NULL, *g0 = NULL; /* mode 0's */
        for (int m = 0; m <= n_modes; m++) {
            lunar_cuda_router_mode(m == 0 ? 0 : modes[m - 1]);
            void *w = dalloc(bytes);
            lunar_cuda_fill_u32(w, 0xdeadbeefu, bytes / 4);
            lunar_cuda_moe_route r;
            lunar_cuda_moe_route_init(&r, w, 1, k + shared, E);
            lunar_cuda_moe_route_one(&r, dlg, db, ng, tg, renorm, scale, shared, NULL);
            int32_t *dex = dalloc(tb);
            float *dw = dalloc(tb);
            lunar_cuda_router_topk(dex, dw, dlg, db, n, E, k, ng, tg, renorm, scale, NULL);
            unsigned char *hr = malloc(bytes), *gr = malloc(2 * tb);
            lunar_cuda_sync();
            lunar_cuda_download(hr, w, bytes);
            lunar_cuda_download(gr, dex, tb);
            lunar_cuda_download(gr + tb, dw, tb);
            if (m == 0) {
                h0 = hr, g0 = gr;
                continue;
            }
            CHECK_MSG(memcmp(hr, h0, bytes) == 0, "route_one E=%d k=%d shared %d: mode %d differs from mode 0", E, k,
                      shared, modes[m - 1]);
            CHECK_MSG(memcmp(gr, g0, 2 * tb) == 0, "router_topk n=%d E=%d k=%d: mode %d differs from mode 0", n, E, k,
                      modes[m - 1]);
            free(hr), free(gr);
        }
        free(h0), free(g0);
        free(lg), free(b);
        lunar_cuda_release(mark);
    }
    lunar_cuda_router_mode(mode0);
}

/* ---------------------------------------------------------------- permutation + experts */

/* Random distinct experts per token; mode 1: every token takes experts 0..k-1 (overloaded, all
 * others empty); mode 2: experts drawn from the first 2k only (skewed). */
static void make_routing(int32_t *ex, float *w, int n, int k, int E, int mode, uint32_t seed) {
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < k; j++) {
            int e;
            if (mode == 1) e = j;
            else
                for (;;) {
                    e = (int)(lcg(&seed) % (uint32_t)(mode == 2 ? 2 * k : E));
                    int dup = 0;
                    for (int i = 0; i < j; i++) dup |= ex[t * k + i] == e;
                    if (!dup) break;
                }
            ex[t * k + j] = e;
            w[t * k + j] = 0.05f + (float)(lcg(&seed) % 1000) / 1000.0f;
        }
    }
}

static int check_permutation(const lunar_cuda_moe_route *r, const int32_t *ex, const float *w) {
    const int n = r->n, k = r->k, E = r->E, np = n * k;
    int32_t *off = malloc((size_t)(E + 2) * 4), *rt = malloc((size_t)np * 4), *pr = malloc((size_t)np * 4);
    int32_t *act = malloc((size_t)E * 4), *cnt = malloc((size_t)(E + 3) * 4);
    float *rw = malloc((size_t)np * 4);
    lunar_cuda_sync();
    lunar_cuda_download(off, r->offsets, (size_t)(E + 1) * 4);
    lunar_cuda_download(rt, r->row_token, (size_t)np * 4);
    lunar_cuda_download(pr, r->pair_row, (size_t)np * 4);
    lunar_cuda_download(rw, r->row_weight, (size_t)np * 4);
    lunar_cuda_download(act, r->active, (size_t)E * 4);
    lunar_cuda_download(cnt, r->counts, (size_t)(E + 3) * 4);
    int ok = off[0] == 0 && off[E] == np, na = 0;
    /* decode groups: every expert's rows in runs of up to 8, in expert order, counters zeroed */
    int ng = 0;
    for (int e = 0; e < E; e++) ng += (off[e + 1] - off[e] + 7) / 8;
    ok &= cnt[E + 2] == ng;
    if (ok && ng) {
        int32_t *grp = malloc((size_t)ng * 8), *gd = malloc((size_t)ng * 4);
        lunar_cuda_download(grp, r->groups, (size_t)ng * 8);
        lunar_cuda_download(gd, r->gdone, (size_t)ng * 4);
        for (int e = 0, gi = 0; e < E; e++)
            for (int s0 = off[e]; s0 < off[e + 1]; s0 += 8, gi++) ok &= grp[2 * gi] == e && grp[2 * gi + 1] == s0 && !gd[gi];
        free(grp), free(gd);
    }
    for (int e = 0; e < E && ok; e++) {
        int c = 0;
        for (int i = 0; i < np; i++) c += ex[i] == e;
        ok &= off[e + 1] - off[e] == c;
        if (c) ok &= na < cnt[E] && act[na++] == e;
    }
    ok &= na == cnt[E];
    char *seen = calloc((size_t)np, 1);
    for (int i = 0; i < np && ok; i++) {
        int p = pr[i];
        ok &= p >= 0 && p < np && !seen[p];
        if (!ok) break;
        seen[p] = 1;
        ok &= rt[p] == i / k && rw[p] == w[i] && p >= off[ex[i]] && p < off[ex[i] + 1];
    }
    free(off), free(rt), free(pr), free(act), free(cnt), free(rw), free(seen);
    return ok;
}

/* the prefill permutation (n > 64: the shared-memory count / scatter and the warp-written lists,
 * cuda_moe.cu; E > 1024 the single-atomic kernels) against the routing on the host: check_permutation
 * (offsets, active list, decode groups and their zeroed counters, every pair's row, token and weight
 * inside its expert's run) and the prefill tile list, the workspace poisoned first; random, overloaded
 * (every token on experts 0..k-1) and skewed routes, sizes that leave partial blocks of 4096 pairs */
TEST(cuda_moe_permute_prefill) {
    if (!moe_cuda_on()) return;
    static const int cases[][4] = {/* n, k, E, mode */
                                   {8192, 8, 256, 0}, {8192, 8, 256, 1}, {8192, 8, 256, 2}, {65, 8, 256, 0},
                                   {300, 9, 896, 0},  {4097, 16, 896, 2}, {1000, 1, 1024, 0}, {777, 5, 1024, 1},
                                   {513, 8, 1500, 0}, {2000, 3, 7, 0}};
    for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int n = cases[c][0], k = cases[c][1], E = cases[c][2], mode = cases[c][3], np = n * k;
        size_t mark = lunar_cuda_mark();
        int32_t *ex = malloc((size_t)np * 4);
        float *w = test_alloc(np);
        make_routing(ex, w, n, k, E, mode, 9000u + c);
        const size_t bytes = lunar_cuda_moe_route_bytes(n, k, E);
        void *ws = dalloc(bytes);
        lunar_cuda_fill_u32(ws, 0xdeadbeefu, bytes / 4);
        lunar_cuda_moe_route r;
        lunar_cuda_moe_route_init(&r, ws, n, k, E);
        lunar_cuda_upload(r.experts, ex, (size_t)np * 4);
        lunar_cuda_upload(r.weights, w, (size_t)np * 4);
        lunar_cuda_moe_permute(&r, NULL);
        int ok = check_permutation(&r, ex, w);
        /* the tile list: every expert's rows in runs of LUNAR_CUDA_MOE_BM, in expert order */
        int32_t *off = malloc((size_t)(E + 1) * 4), cnt[2];
        lunar_cuda_download(off, r.offsets, (size_t)(E + 1) * 4);
        lunar_cuda_download(cnt, r.counts + E + 1, 4);
        int nt = 0;
        for (int e = 0; e < E; e++) nt += (off[e + 1] - off[e] + LUNAR_CUDA_MOE_BM - 1) / LUNAR_CUDA_MOE_BM;
        ok &= cnt[0] == nt;
        if (ok && nt) {
            int32_t *tl = malloc((size_t)nt * 8);
            lunar_cuda_download(tl, r.tiles, (size_t)nt * 8);
            for (int e = 0, ti = 0; e < E; e++)
                for (int s0 = off[e]; s0 < off[e + 1]; s0 += LUNAR_CUDA_MOE_BM, ti++)
                    ok &= tl[2 * ti] == e && tl[2 * ti + 1] == s0;
            free(tl);
        }
        CHECK_MSG(ok, "prefill permutation n=%d k=%d E=%d mode %d", n, k, E, mode);
        free(ex), free(w), free(off);
        lunar_cuda_release(mark);
    }
}

typedef struct host_experts {
    int E, D, I, mxfp4;
    uint8_t *q[3], *s[3]; /* w1, w3, w2 */
    float *f[3];          /* bf16-valued fp32 (BF16 experts) */
} host_experts;

static void host_experts_make(host_experts *h, int E, int D, int I, int mxfp4, uint32_t seed) {
    memset(h, 0, sizeof *h);
    h->E = E, h->D = D, h->I = I, h->mxfp4 = mxfp4;
    for (int m = 0; m < 3; m++) {
        const size_t n = (size_t)E * I * D;
        if (mxfp4) {
            h->q[m] = malloc(n / 2);
            h->s[m] = malloc(n / 32);
            for (size_t i = 0; i < n / 2; i++) h->q[m][i] = (uint8_t)lcg(&seed);
            /* scales mostly around 2^-6..2^-3, a few above 128 (the two-multiply path) and tiny */
            for (size_t i = 0; i < n / 32; i++) {
                uint32_t v = lcg(&seed) % 64;
                h->s[m][i] = (uint8_t)(v == 0 ? 129 + lcg(&seed) % 3 : v == 1 ? 2 : 118 + v % 6);
            }
        } else {
            h->f[m] = test_rand((long)n, seed + (unsigned)m, -0.1f, 0.1f);
            rnd_bf16(h->f[m], (long)n);
        }
    }
}
static void host_experts_free(host_experts *h) {
    for (int m = 0; m < 3; m++) free(h->q[m]), free(h->s[m]), free(h->f[m]);
}
static void host_experts_upload(lunar_cuda_moe_experts *d, const host_experts *h, int act) {
    memset(d, 0, sizeof *d);
    d->E = h->E, d->D = h->D, d->I = h->I, d->mxfp4 = h->mxfp4, d->act = act;
    d->beta = 4.0f, d->beta_l = 25.0f;
    const size_t n = (size_t)h->E * h->I * h->D;
    if (h->mxfp4) {
        d->w1q = din(h->q[0], n / 2), d->w1s = din(h->s[0], n / 32);
        d->w3q = din(h->q[1], n / 2), d->w3s = din(h->s[1], n / 32);
        d->w2q = din(h->q[2], n / 2), d->w2s = din(h->s[2], n / 32);
    } else {
        const uint16_t **dst[3] = {&d->w1, &d->w3, &d->w2};
        for (int m = 0; m < 3; m++) {
            uint16_t *b = bf16_of(h->f[m], (long)n);
            *dst[m] = din(b, n * 2);
            free(b);
        }
    }
}

/* forward.c's routed sum: acc[t] = sum over (t, j) of w * expert_e(z[t]), the CPU ops. */
static void cpu_experts(float *acc, const float *z, const host_experts *h, const int32_t *ex,
                        const float *w, int n, int k, const lunar_glu *act) {
    const int D = h->D, I = h->I;
    memset(acc, 0, (size_t)n * D * 4);
    float *y = test_alloc(D), *g = test_alloc(I), *u = test_alloc(I);
    for (int i = 0; i < n * k; i++) {
        const int e = ex[i], t = i / k;
        if (h->mxfp4) {
            lunar_tensor P[3], S[3];
            lunar_mxfp4 M[3];
            for (int m = 0; m < 3; m++) {
                const int rows = m == 2 ? D : I, cols = m == 2 ? I : D;
                memset(&P[m], 0, sizeof P[m]), memset(&S[m], 0, sizeof S[m]);
                P[m].dtype = S[m].dtype = LUNAR_DTYPE_U8;
                P[m].ndim = S[m].ndim = 2;
                P[m].shape[0] = S[m].shape[0] = rows;
                P[m].shape[1] = cols / 2, S[m].shape[1] = cols / 32;
                P[m].data = h->q[m] + (size_t)e * rows * cols / 2;
                S[m].data = h->s[m] + (size_t)e * rows * cols / 32;
                P[m].nbytes = (size_t)rows * cols / 2, S[m].nbytes = (size_t)rows * cols / 32;
                M[m].packed = &P[m], M[m].scale = &S[m];
            }
            op_mxfp4_mlp(y, z + (size_t)t * D, &M[0], &M[1], &M[2], 1, act);
        } else {
            lunar_tensor W1 = {0}, W3 = {0}, W2 = {0};
            W1.dtype = W3.dtype = W2.dtype = LUNAR_DTYPE_F32;
            W1.ndim = W3.ndim = W2.ndim = 2;
            W1.shape[0] = W3.shape[0] = I, W1.shape[1] = W3.shape[1] = D;
            W2.shape[0] = D, W2.shape[1] = I;
            W1.data = h->f[0] + (size_t)e * I * D, W3.data = h->f[1] + (size_t)e * I * D;
            W2.data = h->f[2] + (size_t)e * I * D;
            W1.nbytes = W3.nbytes = W2.nbytes = (size_t)I * D * 4;
            op_matmul(g, z + (size_t)t * D, &W1, 1);
            op_matmul(u, z + (size_t)t * D, &W3, 1);
            op_glu(g, g, u, I, act);
            op_matmul(y, g, &W2, 1);
        }
        for (int d = 0; d < D; d++) acc[(size_t)t * D + d] += w[i] * y[d];
    }
    free(y), free(g), free(u);
}

/* LUNAR_MOE_YBUF=bf16's form (lunar_cuda_moe_experts_run_b) after the fp32 form ran `path`: the
 * grouped wgmma GEMMs (paths 4-7, 10-12, 14, 17, 18, 22, 24-26, 28, 29, 32) store each row of ybuf rounded to bf16, bit for bit; their
 * combine (lunar_cuda_moe_combine_add_b) equals the fp32 combine over those rows widened, bit for
 * bit; every other path returns -1 and writes nothing. acc holds the fp32 form's combine (clobbered). */
static void bf16_rows_case(const char *what, int path, const float *ybuf, uint16_t *yb, float *ybw, float *acc,
                           float *acc_b, uint16_t *hbuf, const uint16_t *dz, const lunar_cuda_moe_experts *dw,
                           const lunar_cuda_moe_route *r, int n, int D, size_t nkd) {
    const int grouped = (path >= 4 && path <= 7) || (path >= 10 && path <= 12) || path == 14 || path == 17 ||
                        path == 18 || path == 22 || (path >= 24 && path <= 26) || path == 28 || path == 29 || path == 32;
    lunar_cuda_fill_u32(yb, 0x7fc07fc0u, nkd / 2);
    const int rc = lunar_cuda_moe_experts_run_b(yb, hbuf, dz, dw, r, path, NULL);
    CHECK_MSG(rc == (grouped ? 0 : -1), "%s: experts_run_b returned %d", what, rc);
    uint16_t *hb = malloc(nkd * 2);
    float *hy = dl_f32(ybuf, (long)nkd);
    lunar_cuda_download(hb, yb, nkd * 2);
    long bad = 0;
    for (size_t i = 0; i < nkd; i++) bad += hb[i] != (grouped ? lunar_f32_to_bf16(hy[i]) : 0x7fc0);
    CHECK_MSG(bad == 0, "%s: %ld bf16 rows' elements differ from the fp32 rows rounded (or were written)", what, bad);
    if (grouped) {
        for (size_t i = 0; i < nkd; i++) hy[i] = lunar_bf16_to_f32(hb[i]);
        lunar_cuda_upload(ybw, hy, nkd * 4);
        lunar_cuda_fill_u32(acc, 0x7fc00000u, (size_t)n * D);
        lunar_cuda_fill_u32(acc_b, 0x7fc00000u, (size_t)n * D);
        lunar_cuda_moe_combine_add(acc, ybw, r, D, ybw, NULL); /* add: any [n, D] rows */
        lunar_cuda_moe_combine_add_b(acc_b, yb, r, D, ybw, NULL);
        float *y1 = dl_f32(acc, (long)n * D), *y2 = dl_f32(acc_b, (long)n * D);
        CHECK_MSG(memcmp(y1, y2, (size_t)n * D * 4) == 0, "%s: the bf16 rows' combine differs", what);
        free(y1), free(y2);
    }
    free(hb), free(hy);
}

/* The switch sweeps below set environment switches and put the caller's values back after */
typedef struct {
    const char *name;
    char *val; /* the caller's value (a copy), NULL where it was unset */
} env_kept;
static void env_keep(env_kept *k, int n) {
    for (int i = 0; i < n; i++) k[i].val = getenv(k[i].name) ? strdup(getenv(k[i].name)) : NULL;
}
static void env_set(const char *name, const char *v) { /* v NULL: unset */
    if (v) setenv(name, v, 1);
    else unsetenv(name);
}
static void env_put_back(env_kept *k, int n) {
    for (int i = 0; i < n; i++) env_set(k[i].name, k[i].val), free(k[i].val);
}

/* One run of the experts' path into NaN-poisoned outputs (acc, ybuf, hbuf: rows a path leaves unwritten
 * fail, not the previous run's values), then the combine: *y the combined output [n, D] and, where rows
 * is given, *rows the expert rows [n k, D], host copies */
static void run_poisoned(int path, float *ybuf, uint16_t *hbuf, float *acc, const uint16_t *dz,
                         const lunar_cuda_moe_experts *dw, const lunar_cuda_moe_route *r, int n, int k, int D, int I,
                         float **y, float **rows) {
    const size_t nkd = (size_t)n * k * D;
    lunar_cuda_fill_u32(acc, 0x7fc00000u, (size_t)n * D);
    lunar_cuda_fill_u32(ybuf, 0x7fc00000u, nkd);
    lunar_cuda_fill_u32(hbuf, 0x7fc07fc0u, (size_t)n * k * I / 2);
    lunar_cuda_moe_experts_run(ybuf, hbuf, dz, dw, r, path, NULL);
    lunar_cuda_moe_combine(acc, ybuf, r, D, NULL);
    *y = dl_f32(acc, (long)n * D);
    if (rows) *rows = dl_f32(ybuf, (long)nkd);
}

/* values of a and b (n floats) whose bits differ */
static long bits_differ(const float *a, const float *b, size_t n) {
    long bad = 0;
    for (size_t i = 0; i < n; i++) bad += memcmp(a + i, b + i, 4) != 0;
    return bad;
}

/* LUNAR_MOE_F16_XS (path 16 with each pass's activations converted once into shared memory):
 * the same f16 bits reach the same mma in the same order, so with the switch at 1 (where 4 blocks
 * per SM stay: here every gate/up of D = 256 and the smaller passes of D = 512, 1024) and at 2
 * (wherever it fits: passes of up to 8 rows) the expert rows and the combined output must equal
 * path 16 without it (=0) bit for bit, and the CPU op as every path. LUNAR_MOE_F16_IL=0 throughout (IL,
 * the default at one token, runs with XS only: f16_il_case). The caller's values of both switches (the
 * device script runs the tests under XS=1) are restored after. */
static void f16_xs_case(const char *what, float *ybuf, uint16_t *hbuf, float *acc, const uint16_t *dz,
                        const lunar_cuda_moe_experts *dw, const lunar_cuda_moe_route *r, const float *ref, int n,
                        int k, int D, int I) {
    env_kept keep[2] = {{"LUNAR_MOE_F16_XS", NULL}, {"LUNAR_MOE_F16_IL", NULL}};
    env_keep(keep, 2);
    setenv("LUNAR_MOE_F16_IL", "0", 1);
    const size_t nkd = (size_t)n * k * D;
    float *y0 = NULL, *r0 = NULL;
    for (int xm = 0; xm <= 2; xm++) {
        setenv("LUNAR_MOE_F16_XS", xm == 0 ? "0" : xm == 1 ? "1" : "2", 1);
        float *y, *rows;
        run_poisoned(16, ybuf, hbuf, acc, dz, dw, r, n, k, D, I, &y, &rows);
        if (xm == 0) {
            y0 = y, r0 = rows;
            continue;
        }
        char w2[160];
        snprintf(w2, sizeof w2, "%s XS=%d", what, xm);
        moe_report(w2, lunar_max_rel_err(y, ref, (long)n * D), 1e-2);
        const long bad = bits_differ(rows, r0, nkd);
        CHECK_MSG(bad == 0 && memcmp(y, y0, (size_t)n * D * 4) == 0,
                  "%s: %ld expert-row values (or the combined output) differ from LUNAR_MOE_F16_XS=0", w2, bad);
        free(y), free(rows);
    }
    env_put_back(keep, 2);
    free(y0), free(r0);
}

/* The switches of path 16 that change no sum (TILES, EARLY): path 16 under each value of var, with the
 * activations per chunk and in shared memory (LUNAR_MOE_F16_XS at each of xs; NULL: unset), every run's
 * expert rows and combined output bit for bit the first run's (var = vals[0], XS = xs[0]; f16_xs_case
 * holds XS itself to those bits), LUNAR_MOE_F16_IL=0 throughout (as f16_xs_case). The caller's values of
 * the three switches are restored after. */
static void f16_sweep(const char *what, const char *var, const char *const *vals, int nv, const char *const *xs,
                      int nx, float *ybuf, uint16_t *hbuf, float *acc, const uint16_t *dz,
                      const lunar_cuda_moe_experts *dw, const lunar_cuda_moe_route *r, int n, int k, int D, int I) {
    env_kept keep[3] = {{var, NULL}, {"LUNAR_MOE_F16_XS", NULL}, {"LUNAR_MOE_F16_IL", NULL}};
    env_keep(keep, 3);
    setenv("LUNAR_MOE_F16_IL", "0", 1);
    const size_t nkd = (size_t)n * k * D;
    float *y0 = NULL, *r0 = NULL;
    for (int x = 0; x < nx; x++) {
        env_set("LUNAR_MOE_F16_XS", xs[x]);
        for (int t = 0; t < nv; t++) {
            setenv(var, vals[t], 1);
            float *y, *rows;
            run_poisoned(16, ybuf, hbuf, acc, dz, dw, r, n, k, D, I, &y, &rows);
            if (!y0) {
                y0 = y, r0 = rows;
                continue;
            }
            const long bad = bits_differ(rows, r0, nkd);
            CHECK_MSG(bad == 0 && memcmp(y, y0, (size_t)n * D * 4) == 0,
                      "%s %s=%s XS=%s: %ld expert-row values (or the combined output) differ from %s=%s XS=%s", what,
                      var, vals[t], xs[x] ? xs[x] : "unset", bad, var, vals[0], xs[0] ? xs[0] : "unset");
            free(y), free(rows);
        }
    }
    env_put_back(keep, 3);
    free(y0), free(r0);
}

/* LUNAR_MOE_F16_TILES (path 16 with several row groups per block, each warp's copy ring running on
 * across them; cuda_moe_f16.cu's MT note): every row tile's sums are the same operations in the
 * same order, so at 2 and 3 groups a block (and 1, the rule that is the default at one token: 2
 * where the grid is >= 1.5 waves, which these small grids leave at one group) the expert rows and the combined output must equal the switch off
 * (=0) bit for bit, with the activations per chunk (LUNAR_MOE_F16_XS=0) and in shared memory (=2).
 * The shapes here make the ring cross groups within its first fill (2-3 chunks a warp: D = 256, K =
 * 384), leave a block's last groups past R (D = 1024: 64 tiles in blocks of 3 groups; I = 640 at 2
 * k-splits), and run several passes of 8 tokens per expert (n = 64, 40), each refilling the ring.
 * The caller's values of both switches are restored after. */
static void f16_tiles_case(const char *what, float *ybuf, uint16_t *hbuf, float *acc, const uint16_t *dz,
                           const lunar_cuda_moe_experts *dw, const lunar_cuda_moe_route *r, int n, int k, int D,
                           int I) {
    static const char *tv[4] = {"0", "2", "3", "1"}, *xsv[2] = {"0", "2"};
    f16_sweep(what, "LUNAR_MOE_F16_TILES", tv, 4, xsv, 2, ybuf, hbuf, acc, dz, dw, r, n, k, D, I);
}

/* LUNAR_MOE_F16_EARLY (path 16's block start-up; cuda_moe_f16.cu's EARLY note): bit 1 the down
 * kernel's first ring fill and offsets before griddepcontrol.wait, bit 2 the route's count and
 * expert id loaded together, bit 4 at one token no offsets / row_token loads (the slot is the row).
 * Each changes when or whether route values are loaded, not the sums: the expert rows and the
 * combined output must equal the switch off (=0) bit for bit, with the activations per chunk
 * (LUNAR_MOE_F16_XS=0) and in shared memory (unset: 1 where it fits). Bit 4 needs the one-token
 * route's layout (offsets[e] = the expert's rank = its slot, row_token 0): the n = 1 cases check it
 * (with this test's permutation; the forward tests' route-one builds the same). The caller's values
 * of both switches are restored after. */
static void f16_early_case(const char *what, float *ybuf, uint16_t *hbuf, float *acc, const uint16_t *dz,
                           const lunar_cuda_moe_experts *dw, const lunar_cuda_moe_route *r, int n, int k, int D,
                           int I) {
    static const char *ev[6] = {"0", "1", "2", "4", "3", "7"}, *xsv[2] = {"0", NULL};
    f16_sweep(what, "LUNAR_MOE_F16_EARLY", ev, 6, xsv, 2, ybuf, hbuf, acc, dz, dw, r, n, k, D, I);
}

/* LUNAR_MOE_F16_IL (path 16's interleaved k-splits, session 16, cuda_moe_f16.cu's V note: the default at one
 * token; with the activations in shared memory and the flat ring only, the launch falling back to the
 * default kernel where XS does not fit): each row tile's k-splits take interleaved chunks, so the sums
 * hold other partials than IL=0's: against the CPU op (tol 1e-2, as every path), no row left unwritten
 * (NaN-poisoned outputs), and the same bits at every row-group count (TILES=0, the flat ring at one group
 * a block; 3, the rings across groups and a block's last groups past R; 1, the rule), with XS unset (1
 * where it fits) and 2 (passes of up to 8 rows). The caller's values of the switches are restored after.
 * (The session's other variants, W and S8, are in git show 1d05510 with their bit-equality cases; session
 * 17's CV in git show 1ff0730.) */
static void f16_il_case(const char *what, float *ybuf, uint16_t *hbuf, float *acc, const uint16_t *dz,
                        const lunar_cuda_moe_experts *dw, const lunar_cuda_moe_route *r, const float *ref, int n,
                        int k, int D, int I) {
    static const char *xsv[2] = {NULL, "2"}, *tv[3] = {"0", "3", "1"};
    env_kept keep[3] = {{"LUNAR_MOE_F16_IL", NULL}, {"LUNAR_MOE_F16_TILES", NULL}, {"LUNAR_MOE_F16_XS", NULL}};
    env_keep(keep, 3);
    const size_t nkd = (size_t)n * k * D;
    for (int x = 0; x < 2; x++) {
        env_set("LUNAR_MOE_F16_XS", xsv[x]);
        float *y0 = NULL, *r0 = NULL;
        /* runs 0-2: IL=1 at TILES 0 / 3 / 1; 3: IL=0 (its own first) */
        for (int t = 0; t < 4; t++) {
            const int il = t < 3;
            setenv("LUNAR_MOE_F16_IL", il ? "1" : "0", 1);
            setenv("LUNAR_MOE_F16_TILES", tv[il ? t : 0], 1);
            if (t == 3) free(y0), free(r0), y0 = r0 = NULL;
            float *y, *rows;
            run_poisoned(16, ybuf, hbuf, acc, dz, dw, r, n, k, D, I, &y, &rows);
            char w2[192];
            snprintf(w2, sizeof w2, "%s IL=%d TILES=%s XS=%s", what, il, tv[il ? t : 0], xsv[x] ? xsv[x] : "unset");
            moe_report(w2, lunar_max_rel_err(y, ref, (long)n * D), 1e-2);
            long nan = 0;
            for (size_t i = 0; i < nkd; i++) nan += rows[i] != rows[i];
            CHECK_MSG(nan == 0, "%s: %ld expert-row values NaN (unwritten)", w2, nan);
            if (!y0) {
                y0 = y, r0 = rows;
                continue;
            }
            const long bad = bits_differ(rows, r0, nkd);
            CHECK_MSG(bad == 0 && memcmp(y, y0, (size_t)n * D * 4) == 0,
                      "%s: %ld expert-row values (or the combined output) differ from IL=%d TILES=0", w2, bad, il);
            free(y), free(rows);
        }
        free(y0), free(r0);
    }
    env_put_back(keep, 3);
}

/* LUNAR_MOE_F16_WG (session 17, cuda_moe_f16wg.cu: path 16 at one token with the consumer on FP8 wgmma, the
 * activations as e4m3 hi + lo, ~7 significant bits: bf16-level; unset: 2 where I >= 1024): at 1 (one warpgroup a
 * block), 2 and 4 (two, four splitting k: at K = 256 / 384 some warpgroups have no chunk), against the CPU op
 * (tol 1e-2, the max rel err printed), no row left unwritten (NaN-poisoned outputs), each run twice in a row
 * bit-equal (no race), with the one-token route (LUNAR_MOE_F16_EARLY unset), with the route's offsets / row_token
 * read (EARLY=3) and with the down kernel's ring fill after its PDL wait (EARLY=6, bit 1 off: session 19's
 * early fill changes when the weights are copied, not the sums, so EARLY 3 and 6 must give unset's bits at the
 * same WG); the rows must differ from path 16's (WG=0: the kernel ran, not the fallback). Unset must be WG=2
 * where I >= 1024 and path 16 below (the same bits as those runs). Only at one token (n = 1; the kernel's
 * dispatch ignores the switch above). The caller's values of both switches are restored after. */
static void f16_wg_case(const char *what, float *ybuf, uint16_t *hbuf, float *acc, const uint16_t *dz,
                        const lunar_cuda_moe_experts *dw, const lunar_cuda_moe_route *r, const float *ref, int n,
                        int k, int D, int I) {
    /* runs 7-10 with the route marked settled (lunar_cuda_moe_route.settled: this route was written long before):
     * the gate/up kernel's early fill (EARLY bit 8) on, except at EARLY=7; at 14 the down kernel's off */
    enum { NV = 11 };
    static const char *wv[NV] = {"1", "2", "4", "1", "2", "2", "4", "2", "1", "4", "2"},
                      *ev[NV] = {NULL, NULL, NULL, "3", "3", "6", "6", NULL, NULL, "7", "14"};
    lunar_cuda_moe_route rset = *r;
    rset.settled = 1;
    env_kept keep[2] = {{"LUNAR_MOE_F16_WG", NULL}, {"LUNAR_MOE_F16_EARLY", NULL}};
    env_keep(keep, 2);
    const size_t nkd = (size_t)n * k * D;
    float *y0, *r0, *yu, *ru, *yw[3] = {NULL, NULL, NULL}, *rw[3] = {NULL, NULL, NULL};
    env_set("LUNAR_MOE_F16_EARLY", NULL);
    env_set("LUNAR_MOE_F16_WG", "0");
    run_poisoned(16, ybuf, hbuf, acc, dz, dw, r, n, k, D, I, &y0, &r0);
    env_set("LUNAR_MOE_F16_WG", NULL);
    run_poisoned(16, ybuf, hbuf, acc, dz, dw, r, n, k, D, I, &yu, &ru);
    for (int t = 0; t < NV; t++) {
        env_set("LUNAR_MOE_F16_WG", wv[t]);
        env_set("LUNAR_MOE_F16_EARLY", ev[t]);
        float *y, *rows, *y2, *rows2;
        const lunar_cuda_moe_route *rr = t >= 7 ? &rset : r;
        run_poisoned(16, ybuf, hbuf, acc, dz, dw, rr, n, k, D, I, &y, &rows);
        run_poisoned(16, ybuf, hbuf, acc, dz, dw, rr, n, k, D, I, &y2, &rows2);
        char w2[192];
        snprintf(w2, sizeof w2, "%s WG=%s EARLY=%s%s", what, wv[t], ev[t] ? ev[t] : "unset",
                 t >= 7 ? " settled" : "");
        const double e = lunar_max_rel_err(y, ref, (long)n * D);
        printf("  %s: max rel err vs the CPU op %.3g\n", w2, e);
        moe_report(w2, e, 1e-2);
        long nan = 0;
        for (size_t i = 0; i < nkd; i++) nan += rows[i] != rows[i];
        CHECK_MSG(nan == 0, "%s: %ld expert-row values NaN (unwritten)", w2, nan);
        const long bad = bits_differ(rows2, rows, nkd);
        CHECK_MSG(bad == 0 && memcmp(y, y2, (size_t)n * D * 4) == 0, "%s: %ld expert-row values differ run to run", w2,
                  bad);
        CHECK_MSG(bits_differ(rows, r0, nkd) > 0, "%s: the rows equal path 16's (WG=0; the kernel did not run)", w2);
        const int m = wv[t][0] == '1' ? 0 : wv[t][0] == '2' ? 1 : 2;
        if (!yw[m]) {
            yw[m] = y, rw[m] = rows;
        } else {
            CHECK_MSG(bits_differ(rows, rw[m], nkd) == 0 && memcmp(y, yw[m], (size_t)n * D * 4) == 0,
                      "%s: the rows differ from WG=%s EARLY=unset's", w2, wv[t]);
            free(y), free(rows);
        }
        free(y2), free(rows2);
    }
    /* unset: WG=2's bits where I >= 1024, path 16's below */
    const float *ye = I >= 1024 ? yw[1] : y0, *re = I >= 1024 ? rw[1] : r0;
    CHECK_MSG(bits_differ(ru, re, nkd) == 0 && memcmp(yu, ye, (size_t)n * D * 4) == 0,
              "%s WG unset (I = %d): the rows differ from %s's", what, I, I >= 1024 ? "WG=2" : "WG=0");
    for (int m = 0; m < 3; m++) free(yw[m]), free(rw[m]);
    free(y0), free(r0), free(yu), free(ru);
    env_put_back(keep, 2);
}

/* LUNAR_MOE_BF16_EARLY (the BF16 pair with the shorter block start-up, cuda_moe_bf16e.cu): bit 2 the
 * route's count and expert id loaded together, bit 4 at one token no offsets / row_token loads (the
 * slot is the row; the host masks it off for n > 1); bit 1 is ignored (session 13's staging, out of the
 * tree). Neither changes a sum: under each value (and unset: 6 at one token, the default) path 1's h
 * rows, expert rows and combined output must equal the switch at 0 (the pair of cuda_moe.cu) bit for
 * bit, and the CPU op as every path. Each run into NaN-poisoned outputs; =6 runs twice. The caller's
 * value of the switch is restored after. */
static void bf16_early_case(const char *what, float *ybuf, uint16_t *hbuf, float *acc, const uint16_t *dz,
                            const lunar_cuda_moe_experts *dw, const lunar_cuda_moe_route *r, const float *ref,
                            int n, int k, int D, int I) {
    static const char *ev[] = {"0", "2", "4", "6", "6", "1", "7", NULL};
    env_kept keep[1] = {{"LUNAR_MOE_BF16_EARLY", NULL}};
    env_keep(keep, 1);
    const size_t nkd = (size_t)n * k * D, nki = (size_t)n * k * I;
    float *y0 = NULL, *r0 = NULL;
    uint16_t *h0 = malloc(nki * 2), *h1 = malloc(nki * 2);
    for (unsigned t = 0; t < sizeof ev / sizeof ev[0]; t++) {
        env_set("LUNAR_MOE_BF16_EARLY", ev[t]);
        float *y, *rows;
        run_poisoned(1, ybuf, hbuf, acc, dz, dw, r, n, k, D, I, &y, &rows);
        lunar_cuda_download(t ? h1 : h0, hbuf, nki * 2);
        char w2[192];
        snprintf(w2, sizeof w2, "%s BF16_EARLY=%s", what, ev[t] ? ev[t] : "unset");
        moe_report(w2, lunar_max_rel_err(y, ref, (long)n * D), 1e-2);
        long nan = 0;
        for (size_t i = 0; i < nkd; i++) nan += rows[i] != rows[i];
        CHECK_MSG(nan == 0, "%s: %ld expert-row values NaN (unwritten)", w2, nan);
        if (!t) {
            y0 = y, r0 = rows;
            continue;
        }
        long badh = 0;
        const long bad = bits_differ(rows, r0, nkd);
        for (size_t i = 0; i < nki; i++) badh += h1[i] != h0[i];
        CHECK_MSG(bad == 0 && badh == 0 && memcmp(y, y0, (size_t)n * D * 4) == 0,
                  "%s: %ld expert-row values, %ld h values (or the combined output) differ from the pair", w2, bad,
                  badh);
        free(y), free(rows);
    }
    env_put_back(keep, 1);
    free(y0), free(r0), free(h0), free(h1);
}

static void experts_case(int n, int k, int E, int D, int I, int mxfp4, int act, int mode, unsigned long long paths) {
    size_t mark = lunar_cuda_mark();
    host_experts h;
    host_experts_make(&h, E, D, I, mxfp4, 1000u + (uint32_t)(n * 7 + E + mode));
    lunar_cuda_moe_experts dw;
    host_experts_upload(&dw, &h, act);
    int32_t *ex = malloc((size_t)n * k * 4);
    float *w = test_alloc((long)n * k);
    make_routing(ex, w, n, k, E, mode, 77u + (uint32_t)n);
    float *z = test_rand((long)n * D, 300 + n, -1, 1);
    rnd_bf16(z, (long)n * D);
    const lunar_glu ga = {act ? LUNAR_GLU_SITU : LUNAR_GLU_SWIGLU, 4.0f, 25.0f};
    float *ref = test_alloc((long)n * D);
    cpu_experts(ref, z, &h, ex, w, n, k, &ga);

    lunar_cuda_moe_route r;
    lunar_cuda_moe_route_init(&r, dalloc(lunar_cuda_moe_route_bytes(n, k, E)), n, k, E);
    lunar_cuda_upload(r.experts, ex, (size_t)n * k * 4);
    lunar_cuda_upload(r.weights, w, (size_t)n * k * 4);
    lunar_cuda_moe_permute(&r, NULL);
    CHECK_MSG(check_permutation(&r, ex, w), "permutation n=%d k=%d E=%d mode %d", n, k, E, mode);
    uint16_t *zb = bf16_of(z, (long)n * D);
    const uint16_t *dz = din(zb, (size_t)n * D * 2);
    uint16_t *hbuf = dalloc((size_t)n * k * I * 2);
    float *ybuf = dalloc((size_t)n * k * D * 4), *acc = dalloc((size_t)n * D * 4);
    const size_t nkd = (size_t)n * k * D;
    uint16_t *yb = dalloc(nkd * 2);
    float *ybw = dalloc(nkd * 4), *acc_b = dalloc((size_t)n * D * 4);
    float *first = NULL;
    int first_path = 0;
    for (int path = 1; path <= 32; path++) {
        if (!(paths & (1ull << (path - 1)))) continue;
        float *y;
        run_poisoned(path, ybuf, hbuf, acc, dz, &dw, &r, n, k, D, I, &y, NULL);
        char what[128];
        static const char *pname[] = {"", "decode", "gemm", "fused", "wgmma", "wgmma128", "ws", "wsc", "v2",
                                      "v2 3 blocks", "wsf", "wsf1", "wsfast", "", "wsmx2", "", "f16", "wsmc", "wsmc2", "",
                                      "",     "",       "wsmxe", "", "wsmxb", "wsmxm", "wsmxg", "", "wsmxhb", "wsdyn", "", "", "wsmxdh"};
        snprintf(what, sizeof what, "experts %s %s %s n=%d k=%d E=%d D=%d I=%d%s", mxfp4 ? "mxfp4" : "bf16",
                 act ? "situ" : "swiglu", pname[path], n, k, E, D, I,
                 mode == 1 ? " overloaded" : mode == 2 ? " skewed" : "");
        moe_report(what, lunar_max_rel_err(y, ref, (long)n * D), 1e-2);
        bf16_rows_case(what, path, ybuf, yb, ybw, acc, acc_b, hbuf, dz, &dw, &r, n, D, nkd);
        if (path == 1 && !mxfp4) bf16_early_case(what, ybuf, hbuf, acc, dz, &dw, &r, ref, n, k, D, I);
        if (path == 16 && mxfp4 && act) {
            /* path 16's own switches, with its FP8 wgmma form off (the default at one token where I >= 1024:
             * f16_wg_case covers it) */
            env_kept wg[1] = {{"LUNAR_MOE_F16_WG", NULL}};
            env_keep(wg, 1);
            env_set("LUNAR_MOE_F16_WG", "0");
            f16_xs_case(what, ybuf, hbuf, acc, dz, &dw, &r, ref, n, k, D, I);
            f16_tiles_case(what, ybuf, hbuf, acc, dz, &dw, &r, n, k, D, I);
            f16_early_case(what, ybuf, hbuf, acc, dz, &dw, &r, n, k, D, I);
            f16_il_case(what, ybuf, hbuf, acc, dz, &dw, &r, ref, n, k, D, I);
            env_put_back(wg, 1);
        }
        if (path == 16 && mxfp4 && act && n == 1) f16_wg_case(what, ybuf, hbuf, acc, dz, &dw, &r, ref, n, k, D, I);
        if (first) {
            snprintf(what, sizeof what, "  %s vs %s n=%d", pname[path], pname[first_path], n);
            moe_report(what, lunar_max_rel_err(y, first, (long)n * D), 1e-2);
            free(y);
        } else {
            first = y, first_path = path;
        }
    }
    free(first);
    host_experts_free(&h);
    free(ex), free(w), free(z), free(ref), free(zb);
    lunar_cuda_release(mark);
}

#define F16 (1 << 15)
/* paths: bit p - 1 runs path p (1 decode pair, 2 grouped GEMM, 3 the fused decode kernel, 4 the
 * wgmma grouped GEMM, 5 the same with 128-row weight tiles, 6 the warp-specialised wgmma kernel, 7
 * the same in clusters of 2 blocks sharing the BF16 weight tiles: BF16 cases only, 8 the warp-team
 * decode kernels, 9 the same on 3 blocks: 24 warps walk every unit, their rings crossing units,
 * 10 path 6 with the BF16 proxy fences in the producer, 11 the same one chunk later, 12 path 6
 * with the fast GLU epilogue (BF16 cases only: MXFP4 runs path 6 for all three), 16 the decode pair on
 * f16 tensor cores (cuda_moe_f16.cu; SiTU cases only: SwiGLU and BF16 experts fall back to the pair,
 * whose h SwiGLU's weights here push past f16's 65504: the first device run, with h in f16 for
 * every activation, failed those cases with inf),
 * split-K teams of 1, 2 and 4 warps as the unit count and K pick them; K = 128 and 384 end on a
 * half MXFP4 stage). The
 * fused kernel's shapes: K = 128 or 384 (a half last 256-column chunk), split-K S = 1, 2, 4 in
 * either phase (1024 / 1152 columns: 4 and 4.5 chunks, uneven splits), groups of 8 rows
 * (overloaded experts: several groups), and enough items that every block walks many (its copy
 * ring crossing items and phases, the down items waiting on other blocks' gate/up). */
#define ALL_DECODE (7 | 128 | 256 | F16)
/* The wgmma kernels' shapes: M tiles of 1..128 rows (a warpgroup whose 64 rows are all past the
 * expert's end skips its products), K of 2 chunks (fewer than its copy stages: the prefetch runs
 * into the next items) to 18, 128- and 256-row weight tiles (D = 128 and 384 fall back to 128 in
 * the down GEMM), and more items than blocks (every block walks several, its copies crossing
 * items). Path 6 takes D % 256 == 0 only (D = 128 and 384 run path 4 there): its ring of 4 stages
 * wraps many times per item at K = 1024 / 1152 (16-18 chunks) and runs across items at K = 128
 * (2 chunks), its consumer warpgroup 2 idles on tiles of <= 64 rows (n = 1, 5, 13, 130 on 4
 * experts: 128 + 2), and empty experts (mode 1) leave items to none. */
#define WG (8 | 16 | 32)
#define WSF (512 | 1024 | 2048)
/* Path 17 (path 12 in clusters of 2: multicast pairs of an expert's tiles, its odd last tile paired
 * with the next single item, each block copying its own B) on every BF16 wgmma case: 1 tile per
 * expert (only single items: two N tiles, or the next expert's tile, per cluster), 2 tiles (pairs
 * only), 3 tiles (n = 131 overloaded, n = 300 on 2 experts: a pair + a single each), ~300 rows
 * (n = 600: mixed 2 and 3 tiles), empty experts (mode 1), odd single item counts (odd-tile experts
 * x N tiles: the down GEMMs at D = 256, one N tile, with an odd number of odd-tile experts, where
 * block 1 of the last unit has no rows) and K of 2..16 chunks (the ring wrapping within and across
 * items). */
#define WSMC (1 << 16 | 1 << 17) /* paths 17 and 18 (17 with CTA-scope remote releases) */
/* Path 29 (path 12's kernels taking their items from a global counter) on every BF16 wgmma case:
 * fewer items than blocks (n = 3, 33: blocks without an item leave and count themselves done),
 * many items a block (n = 600: 288 gate/up items), 1-3 tiles an expert, empty experts, K of 2..16
 * chunks (J = 2: the next item taken at the first chunk). Each case launches both kernels twice
 * (fp32 rows, then bf16 rows) and the cases follow each other, so a counter not put back to 0 at
 * the end of a launch skips the next launch's first items: rows left NaN, the case fails. */
#define WSDYN (1 << 28)
/* Path 14 (MXFP4 widened by the consumer warpgroups, items of 2 M tiles x 128 weight rows, each
 * weight chunk widened once for both) on every MXFP4 case: items of 1..256 rows (n = 400: ~200
 * rows, warpgroup 1's half 1 idle; n = 131 overloaded: 3 tiles = a pair + a pair of 3 rows whose
 * warpgroup 1 only widens; n = 1, 5, 13: warpgroup 1 idle on every item), K of 2..18 chunks (its
 * ring of 4 stages and 3 B buffers wrapping within and across items), empty (mode 1) and
 * overloaded experts, odd n, scales above 128 (the two-multiply widening), both matrices of
 * gate/up, D = 128 and 384 in its own down kernel (128-row weight tiles); gate/up needs I % 64
 * only. (Path 13, its one-tile predecessor, was removed in session 9.) Path 22 (path 14 with the
 * down epilogue's row weights loaded once per item, the next item looked up before the drain; with
 * fp32 rows the MXFP4 default) on the same cases: rows past the expert's end in either half, warpgroup 1 idle or
 * half-idle, several items a block, bf16 rows (bf16_rows_case) and fp32. Path 24 (22 with the
 * bf16 down rows staged in shared memory and written by bulk copies; fp32 rows as 22; the MXFP4
 * default, with bf16 rows in the forward) on the same
 * cases: bf16_rows_case holds its rows to the fp32 rows rounded, bit for bit, on a NaN-filled
 * buffer (a row not copied, or copied past an expert's end into the next one's, fails), with 1..4
 * staged row sets a warp (nw = 0..2, rows past the end in either set) and several items a block
 * (the staging in the B buffers reused by the next item's chunks). Paths 25 (the weights as wgmma's
 * M, the tokens as N in multiples of 32 up to 192 a tile, A widened into registers) and 26 (25's
 * gate/up, 24's down) on the same cases: N = 32 (n = 1, 5, 13) to 192 (n = 400, ~200 rows: a full
 * tile + a short one), empty and overloaded experts, w1 / w3 interleaved in gate/up, D = 128 .. 1024
 * (1 to 8 down items of 128 columns), K of 2..18 chunks, fp32 and bf16 rows. Path 28 (the MXFP4 default:
 * the gate/up by 24's kernel on each expert's full 256-row tiles and 25's on the rest of 1..192 rows, the
 * second launch with PDL; 24's down) on the same cases, where every expert's rows are a rest (< 256:
 * path 24's kernel has no items), and on the last three: 600 rows on 2 experts (2 full tiles + a rest of
 * 88 rows: both kernels, items of both on one expert), 450 on 3 (256 + a rest of 194 > 192: path 24's
 * alone, a partial tile), ~350 on each of 8 (skewed: 256 + ~94, rests of several N sizes). (Path 27, 28
 * with the split in the down GEMM too, passed them all before its removal.) Path 32 (the MXFP4 default
 * since session 14: 28 whose down kernel copies no A rows of its dead 64-row halves) on the same cases:
 * items of 1..4 live halves (n = 1, 5, 13: one; ~200 rows: 4 then 1), rows past the end in each, several
 * items a block (a half dead in one item, live in the next: its rows in the ring are stale, never read),
 * fp32 and bf16 rows. */
#define MX14 (8192 | 1 << 21 | 1 << 23 | 1 << 24 | 1 << 25 | 1 << 27 | 1ull << 31)
TEST(cuda_moe_experts_mxfp4_vs_cpu) {
    if (!moe_cuda_on()) return;
    experts_case(1, 4, 16, 256, 384, 1, 1, 0, ALL_DECODE | WG | MX14);
    experts_case(5, 4, 16, 256, 384, 1, 1, 0, ALL_DECODE | WG | MX14);
    experts_case(13, 4, 16, 256, 128, 1, 0, 0, ALL_DECODE | WG | MX14);
    experts_case(64, 4, 16, 256, 384, 1, 1, 2, ALL_DECODE | WG | MX14);
    experts_case(40, 4, 8, 128, 256, 1, 1, 1, ALL_DECODE | WG | MX14); /* 40 rows on each of 4 experts, 4 empty */
    experts_case(3, 4, 16, 1024, 1152, 1, 1, 0, ALL_DECODE | WG | MX14);
    experts_case(64, 8, 32, 1024, 1152, 1, 0, 2, 1 | 4 | 128 | 256 | F16 | WG | MX14);
    experts_case(7, 4, 16, 512, 640, 1, 1, 0, 1 | F16); /* split-K 2 in both GEMMs (J = 4, 5: uneven) */
    experts_case(1, 8, 16, 2048, 384, 1, 1, 0, 1 | F16); /* one token, 8 experts (EARLY bit 4: slot = row) */
    experts_case(6, 6, 16, 2304, 256, 1, 1, 2, 1 | F16); /* skewed: up to 6 rows an expert in one pass */
    experts_case(300, 6, 32, 256, 384, 1, 1, 2, 2 | WG | MX14);
    experts_case(200, 4, 64, 512, 256, 1, 0, 0, 2 | WG | MX14);
    experts_case(130, 4, 16, 384, 256, 1, 1, 1, 2 | WG | MX14); /* 130 rows on 4 experts: tiles of 128 + 2 */
    experts_case(400, 8, 16, 256, 768, 1, 1, 0, 2 | WG | MX14); /* ~200 rows per expert, 192 gate/up items */
    experts_case(131, 4, 16, 512, 256, 1, 0, 1, 2 | WG | MX14); /* overloaded, odd: tiles of 128 + 3 on D = 512 */
    experts_case(600, 2, 8, 256, 384, 1, 1, 1, 2 | MX14);  /* 600 rows on 2 experts: 256 + 256 + 88 */
    experts_case(450, 3, 8, 384, 256, 1, 1, 1, 2 | MX14);  /* 450 rows on 3 experts: 256 + 194 */
    experts_case(700, 4, 8, 256, 128, 1, 0, 2, 2 | MX14);  /* skewed: ~350 rows on each of 8 experts */
}

/* LUNAR_MOE_F16_WG (f16_wg_case, inside experts_case at one token) at K3.1's expert shape (D = 3584, I = 3072,
 * top-16: 48 gate/up and 56 down row groups of 64, K of 28 and 24 chunks) and its TP8 slice (I = 384: 6 gate/up
 * row groups, a down K of 3 chunks, odd for the two warpgroups of WG=2). */
TEST(cuda_moe_experts_mxfp4_wg_k3_shapes) {
    if (!moe_cuda_on()) return;
    experts_case(1, 16, 16, 3584, 384, 1, 1, 0, F16);
    experts_case(1, 16, 16, 3584, 3072, 1, 1, 0, F16);
}

TEST(cuda_moe_experts_bf16_vs_cpu) {
    if (!moe_cuda_on()) return;
    /* paths 10, 11 (WSF) on every wgmma case; path 7's pairs: 1-2 tiles per expert (the second block of a 1-tile expert has no rows), 3
     * tiles (n = 131 overloaded: a full pair + a pair of 3 rows and none), empty experts (mode 1) */
    experts_case(3, 4, 16, 256, 384, 0, 1, 0, ALL_DECODE | WG | 64 | WSF | WSMC | WSDYN); /* 3 falls back to the pair */
    experts_case(33, 4, 16, 128, 256, 0, 0, 2, 3 | WG | 64 | WSF | WSMC | 128 | 256 | WSDYN);
    experts_case(64, 8, 32, 1024, 1152, 0, 1, 2, 1 | 128 | 256); /* BF16 v2: 64 groups x 72 tiles, S = 1..4 */
    experts_case(150, 4, 8, 256, 128, 0, 1, 1, 2 | WG | 64 | WSF | WSMC | WSDYN);
    experts_case(600, 8, 16, 256, 768, 0, 0, 0, 2 | WG | 64 | WSF | WSMC | WSDYN); /* ~300 rows per expert, 288 gate/up items */
    experts_case(131, 4, 16, 512, 256, 0, 1, 1, 2 | WG | 64 | WSF | WSMC | WSDYN); /* overloaded, odd: tiles of 128 + 3 on D = 512 */
    experts_case(77, 4, 8, 1024, 384, 0, 0, 0, 2 | WG | 64 | WSF | WSMC | WSDYN);  /* 16 chunks of K per gate/up item, 3 N tiles */
    experts_case(300, 2, 4, 256, 256, 0, 1, 1, 2 | WG | 64 | WSF | WSMC | WSDYN);  /* 300 rows on 2 experts: 3 tiles each */
    /* path 29 on experts of exactly 1, 31, 129, 255 and 300 rows (mode 1: every routed expert gets n
     * rows): a lone tile of 1 and of 31 rows, 128 + a rest of 1, 128 + 127, 2 x 128 + 44 */
    experts_case(1, 2, 8, 256, 256, 0, 0, 1, 2 | WSDYN);
    experts_case(31, 3, 8, 512, 384, 0, 1, 1, 2 | WSDYN);
    experts_case(129, 2, 8, 256, 256, 0, 0, 1, 2 | WSDYN);
    experts_case(255, 2, 8, 256, 128, 0, 1, 1, 2 | WSDYN);
    experts_case(300, 3, 8, 768, 256, 0, 0, 1, 2 | WSDYN);
}

/* The BF16 pair's start-up bits (LUNAR_MOE_BF16_EARLY; bf16_early_case runs inside experts_case for
 * path 1) on more shapes: Kimi-Linear's (D 2304, I 1024: gate/up 18 chunks at S = 4, down 8 at S = 4)
 * at one token over 8 experts (bit 4) and at 3 tokens; down K = 256 and 512 (S = 1 and 2: 4 and 2 row
 * tiles a block); K = 640 (S = 2, 5 chunks: an uneven split); 40 rows on each of 4 experts (5 passes
 * of 8 tokens); skewed routing at K = 1152 (9 chunks). */
TEST(cuda_moe_bf16_early_vs_pair) {
    if (!moe_cuda_on()) return;
    experts_case(1, 8, 9, 2304, 1024, 0, 0, 0, 1);
    experts_case(3, 8, 9, 2304, 1024, 0, 1, 0, 1);
    experts_case(5, 4, 16, 256, 256, 0, 0, 0, 1);
    experts_case(2, 4, 16, 384, 512, 0, 1, 0, 1);
    experts_case(7, 4, 16, 512, 640, 0, 1, 0, 1);
    experts_case(40, 4, 8, 128, 256, 0, 1, 1, 1);
    experts_case(64, 8, 32, 1024, 1152, 0, 0, 2, 1);
}

/* Issue 9: the shared expert as one more routed row (route_one with shared = 1, BF16 experts):
 * the decode kernels (pair, v2, v2 on 3 blocks) against the CPU's routed sum plus the shared
 * expert with weight 1. The experts are uploaded as a stack of E + 1 whose last slice (the shared
 * expert's weights, also uploaded on their own as s1/s3/s2) is then poisoned with NaN: a kernel
 * that read row E from the stack instead of s1/s3/s2 fails. Outputs NaN-poisoned per path. */
TEST(cuda_moe_shared_row_vs_cpu) {
    if (!moe_cuda_on()) return;
    /* E = k (every expert taken, as the forward tests' wide model): k + 1 rows over E + 1 experts */
    static const int cases[][5] = {/* E, k, D, I, act */ {16, 4, 256, 384, 1}, {32, 8, 1024, 1152, 0},
                                   {256, 8, 256, 128, 0}, {4, 4, 256, 128, 0}};
    for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int E = cases[c][0], k = cases[c][1], D = cases[c][2], I = cases[c][3], act = cases[c][4];
        size_t mark = lunar_cuda_mark();
        host_experts h;
        host_experts_make(&h, E + 1, D, I, 0, 5000u + c);
        lunar_cuda_moe_experts dw;
        host_experts_upload(&dw, &h, act);
        const size_t es = (size_t)I * D;
        uint16_t *sh[3];
        for (int m = 0; m < 3; m++) {
            uint16_t *b16 = bf16_of(h.f[m] + (size_t)E * es, (long)es);
            sh[m] = din(b16, es * 2);
            free(b16);
        }
        lunar_cuda_fill_u32((void *)(dw.w1 + (size_t)E * es), 0x7fc07fc0u, es / 2);
        lunar_cuda_fill_u32((void *)(dw.w3 + (size_t)E * es), 0x7fc07fc0u, es / 2);
        lunar_cuda_fill_u32((void *)(dw.w2 + (size_t)E * es), 0x7fc07fc0u, es / 2);
        dw.E = E, dw.s1 = sh[0], dw.s3 = sh[1], dw.s2 = sh[2];
        float *lg = test_rand(E, 600 + c, -4, 4);
        lunar_cuda_moe_route r;
        lunar_cuda_moe_route_init(&r, dalloc(lunar_cuda_moe_route_bytes(1, k + 1, E)), 1, k + 1, E);
        lunar_cuda_moe_route_one(&r, din(lg, (size_t)E * 4), NULL, 1, 1, 1, 1.0f, 1, NULL);
        int32_t ex[64];
        float wt[64];
        lunar_cuda_sync();
        lunar_cuda_download(ex, r.experts, (size_t)k * 4);
        lunar_cuda_download(wt, r.weights, (size_t)k * 4);
        ex[k] = E, wt[k] = 1.0f; /* the shared expert: slice E of the host stack, weight 1 */
        float *z = test_rand(D, 700 + c, -1, 1);
        rnd_bf16(z, D);
        const lunar_glu ga = {act ? LUNAR_GLU_SITU : LUNAR_GLU_SWIGLU, 4.0f, 25.0f};
        float *ref = test_alloc(D);
        cpu_experts(ref, z, &h, ex, wt, 1, k + 1, &ga);
        uint16_t *zb = bf16_of(z, D);
        const uint16_t *dz = din(zb, (size_t)D * 2);
        uint16_t *hbuf = dalloc((size_t)(k + 1) * I * 2);
        float *ybuf = dalloc((size_t)(k + 1) * D * 4), *acc = dalloc((size_t)D * 4);
        static const int paths[] = {1, 8, 9};
        static const char *pn[] = {"decode", "v2", "v2 3 blocks"};
        for (int p = 0; p < 3; p++) {
            lunar_cuda_fill_u32(acc, 0x7fc00000u, (size_t)D);
            lunar_cuda_fill_u32(ybuf, 0x7fc00000u, (size_t)(k + 1) * D);
            lunar_cuda_fill_u32(hbuf, 0x7fc07fc0u, (size_t)(k + 1) * I / 2);
            lunar_cuda_moe_experts_run(ybuf, hbuf, dz, &dw, &r, paths[p], NULL);
            lunar_cuda_moe_combine(acc, ybuf, &r, D, NULL);
            float *y = dl_f32(acc, D);
            char what[128];
            snprintf(what, sizeof what, "shared row %s %s E=%d k=%d+1 D=%d I=%d", pn[p], act ? "situ" : "swiglu", E, k, D, I);
            moe_report(what, lunar_max_rel_err(y, ref, D), 1e-2);
            if (p == 0) bf16_early_case(what, ybuf, hbuf, acc, dz, &dw, &r, ref, 1, k + 1, D, I);
            free(y);
        }
        host_experts_free(&h);
        free(lg), free(z), free(ref), free(zb);
        lunar_cuda_release(mark);
    }
}

/* ---------------------------------------------------------------- the latent routed path */

TEST(cuda_moe_layer_vs_cpu) {
    if (!moe_cuda_on()) return;
    const int H = 384, Lat = 256, I = 256, E = 32, k = 4;
    const int ns[] = {1, 7, 150};
    for (unsigned c = 0; c < 3; c++) {
        const int n = ns[c];
        size_t mark = lunar_cuda_mark();
        host_experts h;
        host_experts_make(&h, E, Lat, I, 1, 4242u + c);
        lunar_cuda_moe_experts dw;
        host_experts_upload(&dw, &h, 1);
        float *x = test_rand((long)n * H, 500 + c, -1, 1), *wr = test_rand((long)E * H, 501, -0.1f, 0.1f);
        float *wd = test_rand((long)Lat * H, 502, -0.1f, 0.1f), *wu = test_rand((long)H * Lat, 503, -0.1f, 0.1f);
        float *nw = test_rand(Lat, 504, 0.5f, 1.5f), *bias = test_rand(E, 505, -0.2f, 0.2f);
        rnd_bf16(x, (long)n * H);
        lunar_tensor Wr = test_tensor2(LUNAR_DTYPE_BF16, E, H, wr), Wd = test_tensor2(LUNAR_DTYPE_BF16, Lat, H, wd);
        lunar_tensor Wu = test_tensor2(LUNAR_DTYPE_BF16, H, Lat, wu), Nw = test_tensor1(LUNAR_DTYPE_BF16, Lat, nw);
        lunar_tensor B = test_tensor1(LUNAR_DTYPE_F32, E, bias);
        /* CPU: moe_layer's routed path, with the GPU's bf16 storage points rounded the same way */
        float *lg = test_alloc((long)n * E), *wt = test_alloc((long)n * k), *z = test_alloc((long)n * Lat);
        int32_t *sel = malloc((size_t)n * k * 4);
        op_matmul(lg, x, &Wr, n);
        op_router_topk(sel, wt, lg, &B, n, E, k, 1, 1, 1, 1.0f);
        op_matmul(z, x, &Wd, n);
        rnd_bf16(z, (long)n * Lat);
        float *acc = test_alloc((long)n * Lat), *ref = test_alloc((long)n * H);
        const lunar_glu ga = {LUNAR_GLU_SITU, 4.0f, 25.0f};
        cpu_experts(acc, z, &h, sel, wt, n, k, &ga);
        op_rmsnorm(acc, acc, &Nw, n, Lat, 1e-5f);
        rnd_bf16(acc, (long)n * Lat);
        op_matmul(ref, acc, &Wu, n);

        uint16_t *xb = bf16_of(x, (long)n * H);
        void *ws = dalloc(lunar_cuda_moe_layer_ws(n, H, k, &dw));
        float *dy = dalloc((size_t)n * H * 4);
        lunar_cuda_moe_layer(dy, LUNAR_CUDA_F32, din(xb, (size_t)n * H * 2), n, H, din(Wr.data, Wr.nbytes),
                             din(bias, (size_t)E * 4), k, 1, 1, 1, 1.0f, din(Wd.data, Wd.nbytes),
                             din(Nw.data, Nw.nbytes), 1e-5f, din(Wu.data, Wu.nbytes), &dw, 0, ws, NULL);
        float *y = dl_f32(dy, (long)n * H);
        lunar_cuda_moe_route r;
        lunar_cuda_moe_route_init(&r, ws, n, k, E);
        int32_t *gsel = malloc((size_t)n * k * 4);
        lunar_cuda_download(gsel, r.experts, (size_t)n * k * 4);
        CHECK_MSG(memcmp(gsel, sel, (size_t)n * k * 4) == 0, "layer n=%d: routing differs", n);
        char what[96];
        snprintf(what, sizeof what, "moe_layer (latent, mxfp4, situ) n=%d H=%d Lat=%d", n, H, Lat);
        moe_report(what, lunar_max_rel_err(y, ref, (long)n * H), 2e-2);
        host_experts_free(&h);
        test_tensor_free(&Wr), test_tensor_free(&Wd), test_tensor_free(&Wu), test_tensor_free(&Nw), test_tensor_free(&B);
        free(x), free(wr), free(wd), free(wu), free(nw), free(bias), free(lg), free(wt), free(z), free(sel);
        free(acc), free(ref), free(xb), free(y), free(gsel);
        lunar_cuda_release(mark);
    }
}

/* ---------------------------------------------------------------- combine + add + RMSNorm */

/* lunar_cuda_moe_combine_add_rmsnorm (LUNAR_COMBINE_NORM=1) against the pair it replaces
 * (lunar_cuda_moe_combine_add[_b] into a buffer, then lunar_cuda_add_rmsnorm[_b]): x, y and y's
 * bf16 copy bit for bit; and against the CPU: x exactly (the same fp32 adds in the same order: the
 * k rows, the shared rows, then the residual), y within 1e-5 (the GPU's sum of squares is a tree). */
static void combine_norm_case(int n, int k, int D, int shared, int bf16_rows, int with_hb) {
    const size_t mark = lunar_cuda_mark();
    const int E = 32, np = n * k;
    const float eps = 1e-6f;
    const uint32_t seed = (uint32_t)(n * 131 + k * 17 + D + shared * 7 + bf16_rows * 3 + with_hb);
    int32_t *ex = malloc((size_t)np * 4);
    float *rw = test_alloc(np);
    make_routing(ex, rw, n, k, E, 0, seed);
    lunar_cuda_moe_route r;
    lunar_cuda_moe_route_init(&r, dalloc(lunar_cuda_moe_route_bytes(n, k, E)), n, k, E);
    lunar_cuda_upload(r.experts, ex, (size_t)np * 4);
    lunar_cuda_upload(r.weights, rw, (size_t)np * 4);
    lunar_cuda_moe_permute(&r, NULL);
    int32_t *prow = malloc((size_t)np * 4);
    lunar_cuda_sync();
    lunar_cuda_download(prow, r.pair_row, (size_t)np * 4);

    float *rows = test_rand((long)np * D, seed + 1, -2, 2), *x = test_rand((long)n * D, seed + 2, -3, 3);
    float *add = shared ? test_rand((long)n * D, seed + 3, -1, 1) : NULL, *wf = test_rand(D, seed + 4, 0.5f, 1.5f);
    if (bf16_rows) rnd_bf16(rows, (long)np * D); /* the bf16 rows widened: what both sides sum */
    uint16_t *rb = bf16_of(rows, (long)np * D), *wb = bf16_of(wf, D);
    const float *dy = bf16_rows ? NULL : din(rows, (size_t)np * D * 4);
    const uint16_t *dyb = bf16_rows ? din(rb, (size_t)np * D * 2) : NULL;
    const float *dadd = shared ? din(add, (size_t)n * D * 4) : NULL;
    const uint16_t *dw = din(wb, (size_t)D * 2);
    /* the fused kernel's outputs between guard words (a store past a row's end fails) */
    guarded gx, gh, gb = {NULL, 0};
    float *x1 = din(x, (size_t)n * D * 4), *x2 = guarded_new(&gx, (size_t)n * D * 4), *acc = dalloc((size_t)n * D * 4);
    float *h1 = dalloc((size_t)n * D * 4), *h2 = guarded_new(&gh, (size_t)n * D * 4);
    uint16_t *hb1 = with_hb ? dalloc((size_t)n * D * 2) : NULL;
    uint16_t *hb2 = with_hb ? guarded_new(&gb, (size_t)n * D * 2) : NULL;
    lunar_cuda_upload(x2, x, (size_t)n * D * 4);

    if (bf16_rows)
        lunar_cuda_moe_combine_add_b(acc, dyb, &r, D, dadd, NULL);
    else
        lunar_cuda_moe_combine_add(acc, dy, &r, D, dadd, NULL);
    if (with_hb)
        lunar_cuda_add_rmsnorm_b(h1, hb1, x1, acc, dw, n, D, eps, NULL);
    else
        lunar_cuda_add_rmsnorm(h1, LUNAR_CUDA_F32, x1, acc, dw, n, D, eps, NULL);
    const int rc = lunar_cuda_moe_combine_add_rmsnorm(h2, hb2, x2, dy, dyb, &r, dadd, dw, D, eps, NULL);
    /* LUNAR_NORM=block: the pair's norm is the block kernel, whose bits the fold does not reproduce */
    const int want = getenv("LUNAR_NORM") && !strcmp(getenv("LUNAR_NORM"), "block") ? -1 : 0;
    char what[128];
    snprintf(what, sizeof what, "combine+norm n=%d k=%d D=%d%s%s%s", n, k, D, shared ? " shared" : "",
             bf16_rows ? " bf16 rows" : "", with_hb ? " +bf16 copy" : "");
    CHECK_MSG(rc == want, "%s: returned %d", what, rc);
    if (rc == 0) {
        float *gx1 = dl_f32(x1, (long)n * D), *gx2 = dl_f32(x2, (long)n * D);
        float *gh1 = dl_f32(h1, (long)n * D), *gh2 = dl_f32(h2, (long)n * D);
        CHECK_MSG(memcmp(gx1, gx2, (size_t)n * D * 4) == 0, "%s: x differs from the pair's", what);
        CHECK_MSG(memcmp(gh1, gh2, (size_t)n * D * 4) == 0, "%s: y differs from the pair's", what);
        if (with_hb) {
            uint16_t *b1 = malloc((size_t)n * D * 2), *b2 = malloc((size_t)n * D * 2);
            lunar_cuda_download(b1, hb1, (size_t)n * D * 2);
            lunar_cuda_download(b2, hb2, (size_t)n * D * 2);
            CHECK_MSG(memcmp(b1, b2, (size_t)n * D * 2) == 0, "%s: y's bf16 copy differs from the pair's", what);
            /* y = NULL (the prefill whose next layer reads only the copy): x and the copy, the same bits */
            guarded gx3, gb3;
            float *x3 = guarded_new(&gx3, (size_t)n * D * 4);
            uint16_t *hb3 = guarded_new(&gb3, (size_t)n * D * 2);
            lunar_cuda_upload(x3, x, (size_t)n * D * 4);
            const int rc3 = lunar_cuda_moe_combine_add_rmsnorm(NULL, hb3, x3, dy, dyb, &r, dadd, dw, D, eps, NULL);
            CHECK_MSG(rc3 == 0, "%s (y NULL): returned %d", what, rc3);
            float *gx3h = dl_f32(x3, (long)n * D);
            lunar_cuda_download(b2, hb3, (size_t)n * D * 2);
            CHECK_MSG(memcmp(gx1, gx3h, (size_t)n * D * 4) == 0, "%s (y NULL): x differs from the pair's", what);
            CHECK_MSG(memcmp(b1, b2, (size_t)n * D * 2) == 0, "%s (y NULL): the bf16 copy differs", what);
            CHECK_MSG(guards_ok(&gx3) && guards_ok(&gb3), "%s (y NULL): stores out of bounds", what);
            free(gx3h);
            free(b1), free(b2);
        }
        /* x = NULL (K3's latent norm): the combine into a buffer, then lunar_cuda_rmsnorm of it in place */
        {
            float *a4 = dalloc((size_t)n * D * 4);
            guarded g4;
            float *h4 = guarded_new(&g4, (size_t)n * D * 4);
            if (bf16_rows) lunar_cuda_moe_combine_add_b(a4, dyb, &r, D, dadd, NULL);
            else lunar_cuda_moe_combine_add(a4, dy, &r, D, dadd, NULL);
            lunar_cuda_rmsnorm(a4, LUNAR_CUDA_F32, a4, dw, n, D, eps, NULL);
            const int rc4 = lunar_cuda_moe_combine_add_rmsnorm(h4, NULL, NULL, dy, dyb, &r, dadd, dw, D, eps, NULL);
            CHECK_MSG(rc4 == 0, "%s (x NULL): returned %d", what, rc4);
            float *ga4 = dl_f32(a4, (long)n * D), *gh4 = dl_f32(h4, (long)n * D);
            CHECK_MSG(memcmp(ga4, gh4, (size_t)n * D * 4) == 0, "%s (x NULL): differs from combine + rmsnorm", what);
            CHECK_MSG(guards_ok(&g4), "%s (x NULL): stores out of bounds", what);
            free(ga4), free(gh4);
        }
        /* the CPU: the combine's order, then x + sum, then the norm in double */
        float *cx = test_alloc((long)n * D), *ch = test_alloc((long)n * D);
        for (int t = 0; t < n; t++) {
            double ss = 0;
            for (int i = 0; i < D; i++) {
                float s = 0.0f;
                for (int j = 0; j < k; j++) s += rows[(size_t)prow[t * k + j] * D + i];
                if (add) s += add[(size_t)t * D + i];
                const float v = x[(size_t)t * D + i] + s;
                cx[(size_t)t * D + i] = v;
                ss += (double)v * v;
            }
            const double inv = 1.0 / sqrt(ss / D + eps);
            for (int i = 0; i < D; i++)
                ch[(size_t)t * D + i] = (float)(cx[(size_t)t * D + i] * inv * lunar_bf16_to_f32(wb[i]));
        }
        CHECK_MSG(memcmp(cx, gx2, (size_t)n * D * 4) == 0, "%s: x differs from the CPU's", what);
        CHECK_MSG(guards_ok(&gx) && guards_ok(&gh) && (!with_hb || guards_ok(&gb)), "%s: stores out of bounds", what);
        moe_report(what, lunar_max_rel_err(gh2, ch, (long)n * D), 1e-5);
        free(gx1), free(gx2), free(gh1), free(gh2), free(cx), free(ch);
    }
    free(ex), free(rw), free(prow), free(rows), free(x), free(add), free(wf), free(rb), free(wb);
    lunar_cuda_release(mark);
}

TEST(cuda_moe_combine_add_rmsnorm_vs_cpu) {
    if (!moe_cuda_on()) return;
    static const int ns[] = {1, 3, 64, 300}, ks[] = {8, 16}, Ds[] = {2304, 384};
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 2; b++)
            for (int d = 0; d < 2; d++)
                for (int m = 0; m < 4; m++) /* shared rows, bf16 rows: every pairing; the bf16 copy on half */
                    combine_norm_case(ns[a], ks[b], Ds[d], m & 1, m >> 1, (a + m) & 1);
    combine_norm_case(1, 9, 2304, 0, 0, 1); /* batch 1's shared expert as a routed row: k + 1 rows */
    combine_norm_case(5, 3, 8192, 1, 0, 1); /* the widest vector norm (8 chunks a thread) */
    combine_norm_case(1, 16, 3584, 0, 0, 0); /* K3's latent rows at batch 1 (the x = NULL form's use) */
    combine_norm_case(4, 16, 3584, 0, 1, 0);
    /* where the pair's norm is not the vector kernel: -1, nothing launched */
    const size_t mark = lunar_cuda_mark();
    lunar_cuda_moe_route r;
    lunar_cuda_moe_route_init(&r, dalloc(lunar_cuda_moe_route_bytes(2, 2, 4)), 2, 2, 4);
    float *buf = dalloc(2 * 8200 * 4 * 2);
    CHECK(lunar_cuda_moe_combine_add_rmsnorm(buf, NULL, buf, buf, NULL, &r, NULL, NULL, 386, 1e-6f, NULL) == -1);
    CHECK(lunar_cuda_moe_combine_add_rmsnorm(buf, NULL, buf, buf, NULL, &r, NULL, NULL, 8196, 1e-6f, NULL) == -1);
    CHECK(lunar_cuda_moe_combine_add_rmsnorm(buf, NULL, buf, NULL, NULL, &r, NULL, NULL, 384, 1e-6f, NULL) == -1);
    lunar_cuda_release(mark);
}

#endif
