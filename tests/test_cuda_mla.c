/* The CUDA MLA and DSA kernels (cuda_mla.cu, cuda_dsa.cu) against the CPU ops, on random data over
 * a paged cache whose block tables are shuffled. Output buffers sit between guard words, poisoned
 * first (NaN as fp32); cache rows the kernels must not read (past a sequence's length, unused
 * blocks) hold NaN codes, so reading one poisons the result. Skipped without a CUDA device.
 *
 * Tolerances (relative to max |reference|, lunar_max_rel_err):
 *  - MLA (absorbed decode, causal prefill vs the naive op, sparse, the decompressed flash prefill:
 *    k and v rounded to bf16 too): the cache values are exact on
 *    both sides (the CPU reads the same bf16 / e4m3*scale values in fp32); the GPU rounds q_lat,
 *    q_pe and the probabilities to bf16 (2^-9 relative each) for the tensor cores and sums in fp32.
 *    A logit scale * q.c with |logit| ~ 1.5 and 576 terms of random sign moves by ~scale * 2^-9 *
 *    sqrt(576) * |q_i c_i| ~ 1e-3, the bf16 P adds 2^-9 per weight averaging out over the sum:
 *    ~2e-3 of max |o| expected, 1.5e-2 allowed (the worst-case bound, all 576 errors aligned, is
 *    ~3e-2 at these magnitudes).
 *    The default decode kernel rounds q and P to f16 instead (2^-12) on FP8 pages: inside the same
 *    bound. Dense rows run the new decode kernel or, where it is faster (cuda_mla.cu,
 *    wgmma_default), the wgmma one, unless LUNAR_MLA_DECODE=old / new / cluster / wgmma picks one;
 *    tools/device/bench_mla_decode.sh runs these tests under each. The wgmma decode kernel rounds
 *    q and P to bf16; it widens FP8 pages to bf16 (exact) or scores them with e4m3 q (two terms,
 *    ~2^-8 per element: the bf16 bound; the round-4 kernel, LUNAR_MLA_WGMMA_FP8=rs, the default from 64K
 *    rows x context (at blocks of <= 32 heads as its round-6 form, S^T with heads as N, with round 7's lazy
 *    rescale and early wait, =stlp, and the later rounds' switches, =s10m), which multiplies f16 P by exact
 *    f16 V); its own test forces it (LUNAR_MLA_DECODE=wgmma) whatever the default.
 *  - DSA: index codes and scales, scores and the selected sets are compared bitwise / exactly. */
#include "test.h"

#ifndef LUNAR_HAVE_CUDA

TEST(cuda_mla_skipped) { fprintf(stderr, "[skipped: no CUDA device: lunar was built without CUDA] "); }

#else

#include <stdint.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_glue.h"
#include "backend/cuda/cuda_ops.h"
#include "ops.h"
#include "cuda_test.h"
#include "ops_util.h"

enum { R = 512, P = 64, ROW = 576, N_NOPE = 128, VD = 128, BS = 128 };

static int cuda_on(void) { return lunar_test_cuda_on((size_t)6 << 30); }

static void *down(const void *d, size_t bytes) {
    void *h = malloc(bytes ? bytes : 1);
    lunar_cuda_sync();
    lunar_cuda_download(h, d, bytes);
    return h;
}
static double verbose_max;
static void report(const char *what, double e, double tol) {
    if (getenv("LUNAR_TEST_VERBOSE")) fprintf(stderr, "\n    %-44s max rel err %.3g (tol %.0e)", what, e, tol);
    if (e > verbose_max) verbose_max = e;
    CHECK_MSG(e <= tol, "%s: max rel err %.3g > %.0e", what, e, tol);
}

static uint32_t rng_state;
static uint32_t rng(void) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return rng_state >> 8;
}
static void shuffle_i32(int32_t *v, int n) {
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(rng() % (uint32_t)(i + 1));
        int32_t t = v[i];
        v[i] = v[j], v[j] = t;
    }
}

/* ---------------------------------------------------------------- paged latent pool */

typedef struct pool {
    int n_seq, max_blocks, n_blocks, fp8;
    float kv_scale;
    int32_t *bt;   /* [n_seq][max_blocks] */
    float *lat;    /* [n_blocks * 128][576]: the stored values in fp32 (NaN where never to be read) */
    void *stored;  /* bf16 or e4m3 */
    size_t stored_bytes;
} pool;

static void pool_make(pool *p, const int *lens, int n_seq, int fp8, unsigned seed) {
    memset(p, 0, sizeof *p);
    p->n_seq = n_seq, p->fp8 = fp8, p->kv_scale = fp8 ? 1.0f / 64 : 1.0f;
    int total = 0;
    p->max_blocks = 1;
    for (int b = 0; b < n_seq; b++) {
        int nb = (lens[b] + BS - 1) / BS;
        total += nb;
        if (nb > p->max_blocks) p->max_blocks = nb;
    }
    p->n_blocks = total + 2; /* two blocks nobody owns */
    int32_t *perm = malloc((size_t)p->n_blocks * 4);
    for (int i = 0; i < p->n_blocks; i++) perm[i] = i;
    rng_state = seed;
    shuffle_i32(perm, p->n_blocks);
    p->bt = calloc((size_t)n_seq * p->max_blocks, 4);
    const size_t nrow = (size_t)p->n_blocks * BS;
    char *owned = calloc(nrow, 1);
    int k = 0;
    for (int b = 0; b < n_seq; b++)
        for (int i = 0; i < (lens[b] + BS - 1) / BS; i++) {
            int blk = perm[k++];
            p->bt[(size_t)b * p->max_blocks + i] = blk;
            for (int r = 0; r < BS && i * BS + r < lens[b]; r++) owned[(size_t)blk * BS + r] = 1;
        }
    p->lat = test_rand((long)(nrow * ROW), seed + 1, -1, 1);
    p->stored_bytes = nrow * ROW * (fp8 ? 1 : 2);
    p->stored = malloc(p->stored_bytes);
    for (size_t i = 0; i < nrow * ROW; i++) {
        const int live = owned[i / ROW];
        if (fp8) {
            uint8_t c = live ? lunar_f32_to_e4m3(p->lat[i] / p->kv_scale) : 0x7f;
            ((uint8_t *)p->stored)[i] = c;
            p->lat[i] = live ? lunar_e4m3_to_f32(c) * p->kv_scale : NAN;
        } else {
            uint16_t h = live ? lunar_f32_to_bf16(p->lat[i]) : 0x7fc1;
            ((uint16_t *)p->stored)[i] = h;
            p->lat[i] = live ? lunar_bf16_to_f32(h) : NAN;
        }
    }
    free(owned);
    free(perm);
}
static void pool_free(pool *p) {
    free(p->bt), free(p->lat), free(p->stored);
}
/* Sequence b's rows 0..len-1, contiguous (the CPU ops' cache layout). */
static float *pool_rows(const pool *p, int b, int len) {
    float *c = test_alloc((long)len * ROW);
    for (int j = 0; j < len; j++) {
        int blk = p->bt[(size_t)b * p->max_blocks + j / BS];
        memcpy(c + (size_t)j * ROW, p->lat + ((size_t)blk * BS + j % BS) * ROW, ROW * sizeof(float));
    }
    return c;
}
static lunar_cuda_mla_cache pool_upload(const pool *p) {
    lunar_cuda_mla_cache c;
    c.latent = dev_in(p->stored, p->stored_bytes);
    c.dtype = p->fp8 ? LUNAR_CUDA_KV_FP8 : LUNAR_CUDA_KV_BF16;
    c.scale = p->kv_scale;
    c.block_tables = dev_in(p->bt, (size_t)p->n_seq * p->max_blocks * 4);
    c.max_blocks = p->max_blocks;
    return c;
}

/* q [H, N+P] of one token -> q_lat [H, R] (the CPU op's absorption, same loop order), q_pe [H, P] */
static void absorb(float *q_lat, float *q_pe, const float *q, const float *W, int H) {
    for (int h = 0; h < H; h++) {
        const float *qt = q + (size_t)h * (N_NOPE + P), *Wh = W + (size_t)h * (N_NOPE + VD) * R;
        float *ql = q_lat + (size_t)h * R;
        for (int r = 0; r < R; r++) ql[r] = 0.0f;
        for (int n = 0; n < N_NOPE; n++)
            for (int r = 0; r < R; r++) ql[r] += qt[n] * Wh[(size_t)n * R + r];
        memcpy(q_pe + (size_t)h * P, qt + N_NOPE, P * sizeof(float));
    }
}
/* o [H, VD] = W_v o_lat */
static void unabsorb(float *o, const float *o_lat, const float *W, int H) {
    for (int h = 0; h < H; h++)
        for (int x = 0; x < VD; x++) {
            const float *wv = W + ((size_t)h * (N_NOPE + VD) + N_NOPE + x) * R;
            double s = 0;
            for (int r = 0; r < R; r++) s += (double)wv[r] * o_lat[(size_t)h * R + r];
            o[(size_t)h * VD + x] = (float)s;
        }
}

/* ---------------------------------------------------------------- MLA */

/* B rows of lengths lens[b % 4] (B <= 64: rows past 4 repeat the four lengths) */
typedef struct decode_case {
    int B, H, lens[4];
} decode_case;
/* Non-NULL: FP8 cases also run under LUNAR_MLA_WGMMA_FP8=<this> and must give the same bits (a
 * kernel that reorders the work of another without changing its sums) */
static const char *fp8_bitwise_ref;
static void decode_vs_cpu(const decode_case *cases, int n_cases, const char *tag, double fp8_tol) {
    const float scale = 0.3f;
    for (int ci = 0; ci < n_cases; ci++)
        for (int fp8 = 0; fp8 < 2; fp8++) {
            const int B = cases[ci].B, H = cases[ci].H;
            int lens[64];
            for (int b = 0; b < B && b < 64; b++) lens[b] = cases[ci].lens[b % 4];
            size_t mark = lunar_cuda_mark();
            pool p;
            pool_make(&p, lens, B, fp8, 100 + ci * 2 + fp8);
            float *W = test_rand((long)H * (N_NOPE + VD) * R, 7 + ci, -0.1f, 0.1f);
            lunar_tensor Wt = test_tensor2(LUNAR_DTYPE_F32, (int64_t)H * (N_NOPE + VD), R, W);
            float *q = test_rand((long)B * H * (N_NOPE + P), 30 + ci, -1, 1);
            float *ql = test_alloc((long)B * H * R), *qp = test_alloc((long)B * H * P);
            float *ref = test_poisoned((long)B * H * VD), *got = test_poisoned((long)B * H * VD);
            int max_len = 0;
            for (int b = 0; b < B; b++) {
                absorb(ql + (size_t)b * H * R, qp + (size_t)b * H * P, q + (size_t)b * H * (N_NOPE + P), W, H);
                float *rows = pool_rows(&p, b, lens[b]);
                op_mla_attention_absorbed(ref + (size_t)b * H * VD, q + (size_t)b * H * (N_NOPE + P), rows, &Wt,
                                          1, lens[b] - 1, H, N_NOPE, P, VD, R, scale);
                free(rows);
                if (lens[b] > max_len) max_len = lens[b];
            }
            lunar_cuda_mla_cache c = pool_upload(&p);
            const float *dql = dev_in(ql, (size_t)B * H * R * 4), *dqp = dev_in(qp, (size_t)B * H * P * 4);
            const int32_t *dlens = dev_in(lens, (size_t)B * 4);
            size_t wsb = lunar_cuda_mla_ws(B, H, max_len);
            void *ws = wsb ? lunar_cuda_alloc(wsb) : NULL;
            guarded od;
            float *dout_lat = guarded_new(&od, (size_t)B * H * R * 4);
            lunar_cuda_mla_absorbed(dout_lat, dql, dqp, &c, NULL, dlens, max_len, B, H, scale, ws, NULL);
            float *olat = down(dout_lat, (size_t)B * H * R * 4);
            if (fp8 && fp8_bitwise_ref) {
                char *keep = getenv("LUNAR_MLA_WGMMA_FP8") ? strdup(getenv("LUNAR_MLA_WGMMA_FP8")) : NULL;
                setenv("LUNAR_MLA_WGMMA_FP8", fp8_bitwise_ref, 1);
                guarded od2;
                float *dout2 = guarded_new(&od2, (size_t)B * H * R * 4);
                lunar_cuda_mla_absorbed(dout2, dql, dqp, &c, NULL, dlens, max_len, B, H, scale, ws, NULL);
                float *olat2 = down(dout2, (size_t)B * H * R * 4);
                if (keep) setenv("LUNAR_MLA_WGMMA_FP8", keep, 1), free(keep);
                else unsetenv("LUNAR_MLA_WGMMA_FP8");
                CHECK_MSG(memcmp(olat, olat2, (size_t)B * H * R * 4) == 0, "mla decode%s B=%d H=%d: not bitwise %s", tag,
                          B, H, fp8_bitwise_ref);
                CHECK(guards_ok(&od2));
                free(olat2);
            }
            for (int b = 0; b < B; b++) unabsorb(got + (size_t)b * H * VD, olat + (size_t)b * H * R, W, H);
            char what[96];
            snprintf(what, sizeof what, "mla decode%s B=%d H=%d max_len=%d %s", tag, B, H, max_len, fp8 ? "fp8" : "bf16");
            report(what, lunar_max_rel_err(got, ref, (long)B * H * VD), fp8 ? fp8_tol : 1.5e-2);
            CHECK(guards_ok(&od));
            free(olat), free(ref), free(got), free(ql), free(qp), free(q), free(W);
            test_tensor_free(&Wt);
            pool_free(&p);
            lunar_cuda_release(mark);
        }
}

TEST(cuda_mla_absorbed_decode_vs_cpu) {
    if (!cuda_on()) return;
    static const decode_case cases[] = {{3, 16, {1, 300, 1000}}, {2, 12, {129, 4100}}, {1, 96, {2500}}, {2, 40, {777, 64}},
                                        /* many splits over whole pages (batch 1, long), lengths on tile and page edges */
                                        {1, 12, {20000}}, {3, 24, {8192, 128, 63}}, {2, 96, {4096, 1}}};
    decode_vs_cpu(cases, (int)(sizeof cases / sizeof cases[0]), "", 1.5e-2);
}

/* The wgmma kernel (cuda_mla_wgmma.cu) whatever the default, both tile layouts (128-byte swizzled, the
 * default; LUNAR_MLA_WGMMA_SW=0 the unswizzled one) and both copy paths of each (bulk tensor copies;
 * LUNAR_MLA_WGMMA_TMA=0 cp.async): head counts one block of 64 takes (12, 32, 64), two blocks of 48 (96)
 * or 64 (128) and an odd split (40 = one block of 40); lengths 1, 63, 65, on and off the 64-position
 * tiles and 128-token pages, and long rows split over many blocks (batch 1) beside short ones (splits
 * that see nothing). */
static void setenv_or_unset(const char *name, const char *v) {
    if (v) setenv(name, v, 1);
    else unsetenv(name);
}
/* is `name` one of the space-separated words of `list`? */
static int name_listed(const char *list, const char *name) {
    const size_t n = strlen(name);
    for (const char *w = list; *w;) {
        while (*w == ' ') w++;
        const size_t len = strcspn(w, " ");
        if (len == n && !strncmp(w, name, n)) return 1;
        w += len;
    }
    return 0;
}
TEST(cuda_mla_wgmma_decode_vs_cpu) {
    if (!cuda_on()) return;
    static const decode_case cases[] = {{3, 32, {1, 65, 1000}},  {2, 64, {129, 4100}}, {1, 96, {2500}},
                                        {2, 40, {777, 64}},      {1, 96, {9000}},      {3, 12, {8192, 128, 63}},
                                        {2, 128, {4096, 1}},     {4, 96, {191, 256, 1, 3000}},
                                        /* round 9's merge in the kernel: 24 splits (not a power of two) over rows
                                         * of unequal lengths; 32 splits (its limit) with fewer heads than splits */
                                        {4, 32, {3000, 64, 129, 2000}}, {2, 12, {2000, 700}}};
    /* the runs of round 10 on (s10m, s10p, s17c) also take 64 rows (one wave of 128 blocks at 2 splits: the batched
     * merge's widest case), a row of one position and second splits that see nothing (only there: with it in every
     * run the whole test did not finish in 45 s on the H200) */
    static const decode_case wide[] = {{64, 32, {200, 130, 1, 64}}};
    /* session 17's merge (=s17c: in a cluster's shared memory at 2 to 16 splits): also 4 splits (32 rows), 3 (44 rows)
     * and 8 (16 rows), with rows whose later splits see nothing or one tile, and rows of one position */
    static const decode_case cl_cases[] = {{32, 32, {1000, 63, 65, 777}}, {44, 32, {700, 1, 129, 500}},
                                           {16, 32, {2000, 1, 500, 129}}};
    static const char *const names[] = {"LUNAR_MLA_DECODE", "LUNAR_MLA_WGMMA_TMA", "LUNAR_MLA_WGMMA_SW",
                                        "LUNAR_MLA_WGMMA_FP8", "LUNAR_MLA_WGMMA_LAZY"};
    char *saved[5];
    for (int i = 0; i < 5; i++) saved[i] = getenv(names[i]) ? strdup(getenv(names[i])) : NULL;
    setenv("LUNAR_MLA_DECODE", "wgmma", 1);
    /* {SW, TMA, FP8, tag, FP8 tolerance, bitwise reference, lazy threshold}: NULL = unset (the default: FP8 pages
     * widened to bf16, exact, below 64K rows x context as in all these cases; the round-4 kernel from there);
     * "widen" forces the widening. "rs": the round-4 kernel, FP8 scores (two e4m3 terms of q, ~2^-8 per element,
     * the bf16 bound), PV from f16 P and V^T converted in registers (f16 V exact, f16 P finer than bf16), at every
     * head count (the default runs it above 32 heads a block). "stlp": round 7, the round-6 kernel (S^T with heads as
     * N; blocks of <= 32 heads, rs above) with the lazy rescale (P against a head's running maximum until a score
     * passes it by 2^8) and the tile's wgmma wait at its top: rs's scores, other P and sums, the rs bound; also with
     * the threshold 0 (LUNAR_MLA_WGMMA_LAZY=0: the redo, exchange and rescale run on every tile whose maximum grows,
     * which random scores past the first tile never do at 8). Every later round keeps stlp's bits: "s10m" (the
     * default's choice at every size: q's rows loaded before the first copies, the V^T fragments by cvt (the bytes of
     * positions past the end zeroed, the pool's unowned rows being e4m3 NaN) and the tile's exp2 flushing below
     * 2^-126, PV(it - 1) in flight past the tile's top wait (the tiles in pairs: odd tile counts run a pad tile of
     * zeros), and where the merge fits the kernel the split-K merge in its tail with the merge kernel's arithmetic
     * and its loads batched: 2, 16, 24 and 32 splits here, 24 by the loop, the 43 of H = 12 at 8192 left to the merge
     * kernel; single-split cases take its instance without the merge), also at threshold 0; round 11 (session 16)
     * "s10p" (s10m as a dependent launch whose set-up, all but q, runs before its wait; the merge in the tail without
     * the cooperative attribute), also at threshold 0. Session 17, s10m's bits: "s17c" (the merge through a cluster's
     * distributed shared memory at 2 to 16 splits: the wide case and cl_cases; s10m's choice elsewhere), also at
     * threshold 0. (Session 19 removed the variants that measured slower than the default that followed them, and
     * their runs: `git show 1ff0730`.) */
    static const struct { const char *sw, *tma, *fp8, *tag; double tol; const char *same, *lazy; } runs[] = {
        {NULL, NULL, NULL, " wgmma", 1.5e-2, NULL, NULL},
        {NULL, NULL, "widen", " wgmma widened", 1.5e-2, NULL, NULL},
        {NULL, NULL, "rs", " wgmma fp8 V^T in registers", 1.5e-2, NULL, NULL},
        {NULL, NULL, "stlp", " wgmma fp8 S^T lazy, wait at top", 1.5e-2, NULL, NULL},
        {NULL, NULL, "stlp", " wgmma fp8 S^T lazy 0, wait at top", 1.5e-2, NULL, "0"},
        {NULL, NULL, "s10m", " wgmma fp8 S^T round 10 merge loads batched", 1.5e-2, "stlp", NULL},
        {NULL, NULL, "s10m", " wgmma fp8 S^T round 10 merge loads batched lazy 0", 1.5e-2, "stlp", "0"},
        {NULL, NULL, "s10p", " wgmma fp8 S^T round 11 set-up before the PDL wait", 1.5e-2, "stlp", NULL},
        {NULL, NULL, "s10p", " wgmma fp8 S^T round 11 set-up before the PDL wait lazy 0", 1.5e-2, "stlp", "0"},
        {NULL, NULL, "s17c", " wgmma fp8 S^T session 17 merge in a cluster", 1.5e-2, "s10m", NULL},
        {NULL, NULL, "s17c", " wgmma fp8 S^T session 17 merge in a cluster lazy 0", 1.5e-2, "s10m", "0"},
        {NULL, "0", NULL, " wgmma cp.async", 1.5e-2, NULL, NULL},
        {"0", NULL, NULL, " wgmma unswizzled", 1.5e-2, NULL, NULL},
        {"0", "0", NULL, " wgmma unswizzled cp.async", 1.5e-2, NULL, NULL}};
    /* LUNAR_TEST_MLA_FP8=<name> [<name> ..]: only the runs of those FP8 variants (a device call that checks new
     * kernels) */
    const char *only = getenv("LUNAR_TEST_MLA_FP8");
    for (int r = 0; r < (int)(sizeof runs / sizeof runs[0]); r++) {
        if (only && *only && (!runs[r].fp8 || !name_listed(only, runs[r].fp8))) continue;
        setenv_or_unset("LUNAR_MLA_WGMMA_SW", runs[r].sw);
        setenv_or_unset("LUNAR_MLA_WGMMA_TMA", runs[r].tma);
        setenv_or_unset("LUNAR_MLA_WGMMA_FP8", runs[r].fp8);
        setenv_or_unset("LUNAR_MLA_WGMMA_LAZY", runs[r].lazy);
        fp8_bitwise_ref = runs[r].same;
        decode_vs_cpu(cases, (int)(sizeof cases / sizeof cases[0]), runs[r].tag, runs[r].tol);
        if (runs[r].fp8 && name_listed("s10m s10p s17c", runs[r].fp8)) decode_vs_cpu(wide, 1, runs[r].tag, runs[r].tol);
        if (runs[r].fp8 && !strcmp(runs[r].fp8, "s17c"))
            decode_vs_cpu(cl_cases, (int)(sizeof cl_cases / sizeof cl_cases[0]), runs[r].tag, runs[r].tol);
        fp8_bitwise_ref = NULL;
    }
    for (int i = 0; i < 5; i++) setenv_or_unset(names[i], saved[i]), free(saved[i]);
}

/* The GEMM absorption / un-absorption (prefill's) and the row kernels (decode's) against the CPU
 * loops above on the same bf16 weights: fp32 on both sides, only the summation order differs (~1e-6 relative); 1e-4 allowed. The
 * row counts cross the GEMM tile edges, the head counts include K-Linear's 32. */
TEST(cuda_mla_absorb_gemm_vs_cpu) {
    if (!cuda_on()) return;
    static const int shapes[][2] = {{1, 4}, {70, 32}, {257, 12}}; /* rows, H */
    for (unsigned si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int T = shapes[si][0], H = shapes[si][1];
        const size_t nw = (size_t)H * (N_NOPE + VD) * R;
        size_t mark = lunar_cuda_mark();
        float *W = test_rand((long)nw, 80 + si, -0.1f, 0.1f);
        uint16_t *Wb = malloc(nw * 2);
        for (size_t i = 0; i < nw; i++) W[i] = lunar_bf16_to_f32(Wb[i] = lunar_f32_to_bf16(W[i]));
        float *q = test_rand((long)T * H * (N_NOPE + P), 90 + si, -1, 1);
        float *olat = test_rand((long)T * H * R, 95 + si, -1, 1);
        float *ql = test_alloc((long)T * H * R), *qp = test_alloc((long)T * H * P), *o = test_alloc((long)T * H * VD);
        for (int t = 0; t < T; t++) {
            absorb(ql + (size_t)t * H * R, qp + (size_t)t * H * P, q + (size_t)t * H * (N_NOPE + P), W, H);
            unabsorb(o + (size_t)t * H * VD, olat + (size_t)t * H * R, W, H);
        }
        const uint16_t *dW = dev_in(Wb, nw * 2);
        const float *dq = dev_in(q, (size_t)T * H * (N_NOPE + P) * 4), *dol = dev_in(olat, (size_t)T * H * R * 4);
        float *w32 = lunar_cuda_alloc(nw * 4);
        guarded a, b, c;
        float *dql = guarded_new(&a, (size_t)T * H * R * 4), *dqp = guarded_new(&b, (size_t)T * H * P * 4);
        float *dout_o = guarded_new(&c, (size_t)T * H * VD * 4);
        lunar_cuda_mla_absorb_gemm(dql, dqp, w32, dq, dW, T, H, N_NOPE, P, VD, R, NULL);
        lunar_cuda_mla_unabsorb_gemm(dout_o, dol, w32, T, H, N_NOPE, VD, R, NULL);
        float *gql = down(dql, (size_t)T * H * R * 4), *gqp = down(dqp, (size_t)T * H * P * 4);
        float *go = down(dout_o, (size_t)T * H * VD * 4);
        char what[96];
        snprintf(what, sizeof what, "absorb gemm T=%d H=%d q_lat", T, H);
        report(what, lunar_max_rel_err(gql, ql, (long)T * H * R), 1e-4);
        snprintf(what, sizeof what, "absorb gemm T=%d H=%d o", T, H);
        report(what, lunar_max_rel_err(go, o, (long)T * H * VD), 1e-4);
        CHECK(memcmp(gqp, qp, (size_t)T * H * P * 4) == 0);
        CHECK(guards_ok(&a) && guards_ok(&b) && guards_ok(&c));
        free(gql), free(gqp), free(go);
        /* the row kernels (cuda_glue.cu: decode and short prefills) on the same inputs, fresh poisoned
         * outputs */
        guarded a2, b2, c2;
        dql = guarded_new(&a2, (size_t)T * H * R * 4), dqp = guarded_new(&b2, (size_t)T * H * P * 4);
        dout_o = guarded_new(&c2, (size_t)T * H * VD * 4);
        lunar_glue_mla_absorb(dql, dqp, dq, dW, T, H, N_NOPE, P, VD, R, NULL);
        lunar_glue_mla_unabsorb(dout_o, dol, dW, T, H, N_NOPE, VD, R, NULL);
        gql = down(dql, (size_t)T * H * R * 4), gqp = down(dqp, (size_t)T * H * P * 4);
        go = down(dout_o, (size_t)T * H * VD * 4);
        snprintf(what, sizeof what, "absorb rows T=%d H=%d q_lat", T, H);
        report(what, lunar_max_rel_err(gql, ql, (long)T * H * R), 1e-4);
        snprintf(what, sizeof what, "absorb rows T=%d H=%d o", T, H);
        report(what, lunar_max_rel_err(go, o, (long)T * H * VD), 1e-4);
        CHECK(memcmp(gqp, qp, (size_t)T * H * P * 4) == 0);
        CHECK(guards_ok(&a2) && guards_ok(&b2) && guards_ok(&c2));
        free(W), free(Wb), free(q), free(olat), free(ql), free(qp), free(o), free(gql), free(gqp), free(go);
        lunar_cuda_release(mark);
    }
}

TEST(cuda_mla_prefill_vs_naive) {
    if (!cuda_on()) return;
    static const int shapes[][3] = {{37, 91, 16}, {50, 200, 12}, {1, 0, 16}}; /* T, pos0, H */
    const float scale = 0.3f;
    for (unsigned si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int T = shapes[si][0], pos0 = shapes[si][1], H = shapes[si][2], L = pos0 + T;
        size_t mark = lunar_cuda_mark();
        pool p;
        pool_make(&p, &L, 1, 0, 200 + si);
        float *W = test_rand((long)H * (N_NOPE + VD) * R, 50 + si, -0.1f, 0.1f);
        lunar_tensor Wt = test_tensor2(LUNAR_DTYPE_F32, (int64_t)H * (N_NOPE + VD), R, W);
        float *q = test_rand((long)T * H * (N_NOPE + P), 60 + si, -1, 1);
        float *rows = pool_rows(&p, 0, L);
        float *ref = test_poisoned((long)T * H * VD), *got = test_poisoned((long)T * H * VD);
        op_mla_attention_naive(ref, q, rows, &Wt, T, pos0, H, N_NOPE, P, VD, R, scale);
        float *ql = test_alloc((long)T * H * R), *qp = test_alloc((long)T * H * P);
        int32_t *lens = malloc((size_t)T * 4), *seq = calloc((size_t)T, 4);
        for (int t = 0; t < T; t++) {
            absorb(ql + (size_t)t * H * R, qp + (size_t)t * H * P, q + (size_t)t * H * (N_NOPE + P), W, H);
            lens[t] = pos0 + t + 1;
        }
        lunar_cuda_mla_cache c = pool_upload(&p);
        const float *dql = dev_in(ql, (size_t)T * H * R * 4), *dqp = dev_in(qp, (size_t)T * H * P * 4);
        const int32_t *dlens = dev_in(lens, (size_t)T * 4), *dseq = dev_in(seq, (size_t)T * 4);
        size_t wsb = lunar_cuda_mla_ws(T, H, L);
        void *ws = wsb ? lunar_cuda_alloc(wsb) : NULL;
        guarded od;
        float *d_o = guarded_new(&od, (size_t)T * H * R * 4);
        lunar_cuda_mla_absorbed(d_o, dql, dqp, &c, dseq, dlens, L, T, H, scale, ws, NULL);
        float *olat = down(d_o, (size_t)T * H * R * 4);
        for (int t = 0; t < T; t++) unabsorb(got + (size_t)t * H * VD, olat + (size_t)t * H * R, W, H);
        char what[96];
        snprintf(what, sizeof what, "mla prefill T=%d pos0=%d H=%d (vs naive)", T, pos0, H);
        report(what, lunar_max_rel_err(got, ref, (long)T * H * VD), 1.5e-2);
        CHECK(guards_ok(&od));
        free(olat), free(ref), free(got), free(ql), free(qp), free(q), free(W), free(rows), free(lens), free(seq);
        test_tensor_free(&Wt);
        pool_free(&p);
        lunar_cuda_release(mark);
    }
}

/* The decompressed flash prefill (cuda_mla_flash.cu) against op_mla_attention_naive: lengths 1,
 * 63, 65, 300 (partial and whole query / key tiles), prefix offsets (chunked prefill), K-Linear's
 * 32 heads and K3's 12 per rank, key chunks forced small (kc) so the online-softmax state crosses
 * chunks, and FP8 pages (codes of scale 1, as the forward stores them: the reference reads
 * code values, the logits scaled back by 1/64 to the bf16 cases' range). Tolerance: the absorbed
 * prefill's 1.5e-2 (see the top), here with k and v rounded to bf16 as well (2^-9 relative each,
 * the same order as q's rounding, averaging out over the 192-term dot and the sum over keys);
 * measured on the H200: 2.3e-3 to 4.4e-3 over these cases, the same for every kernel variant
 * (LUNAR_MLA_FLASH_WARPS / _STAGES). Every flash kernel runs whatever the default (LUNAR_MLA_FLASH =
 * mma: k_flash, wgmma: cuda_mla_flash_wg.cu, wgmma_pp: its producer / consumer variant, whose
 * 128-row query blocks and 128-key tiles the 400-token case crosses several times; kc rounds up to
 * 128 keys). */
TEST(cuda_mla_flash_prefill_vs_naive) {
    if (!cuda_on()) return;
    static const int shapes[][5] = {/* T, pos0, H, kc, fp8 */
                                    {1, 0, 4, 0, 0},    {63, 0, 32, 0, 0},   {65, 0, 12, 0, 0},
                                    {300, 0, 8, 0, 0},  {37, 91, 16, 0, 0},  {65, 130, 16, 128, 0},
                                    {300, 77, 4, 64, 0}, {1, 200, 8, 64, 0}, {150, 40, 12, 0, 1},
                                    {70, 100, 4, 64, 1}, {400, 130, 8, 256, 0}};
    static const char *const kernels[] = {"mma", "wgmma", "wgmma_pp"};
    char *saved = getenv("LUNAR_MLA_FLASH") ? strdup(getenv("LUNAR_MLA_FLASH")) : NULL;
    for (unsigned si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int T = shapes[si][0], pos0 = shapes[si][1], H = shapes[si][2], kc = shapes[si][3];
        const int fp8 = shapes[si][4], L = pos0 + T;
        const float scale = fp8 ? 0.3f / 64 : 0.3f;
        size_t mark = lunar_cuda_mark();
        pool p;
        pool_make(&p, &L, 1, fp8, 300 + si);
        const size_t nw = (size_t)H * (N_NOPE + VD) * R;
        float *W = test_rand((long)nw, 70 + si, -0.1f, 0.1f);
        uint16_t *Wb = malloc(nw * 2);
        for (size_t i = 0; i < nw; i++) W[i] = lunar_bf16_to_f32(Wb[i] = lunar_f32_to_bf16(W[i]));
        lunar_tensor Wt = test_tensor2(LUNAR_DTYPE_F32, (int64_t)H * (N_NOPE + VD), R, W);
        float *q = test_rand((long)T * H * (N_NOPE + P), 80 + si, -1, 1);
        float *rows = pool_rows(&p, 0, L);
        if (fp8) /* the kernel widens the codes at scale 1: the reference reads the same values */
            for (size_t i = 0; i < (size_t)L * ROW; i++) rows[i] /= p.kv_scale;
        float *ref = test_poisoned((long)T * H * VD);
        op_mla_attention_naive(ref, q, rows, &Wt, T, pos0, H, N_NOPE, P, VD, R, scale);
        lunar_cuda_mla_cache c = pool_upload(&p);
        const float *dq = dev_in(q, (size_t)T * H * (N_NOPE + P) * 4);
        const uint16_t *dW = dev_in(Wb, nw * 2);
        void *ws = lunar_cuda_alloc(lunar_glue_mla_flash_ws(T, H, L, kc));
        LUNAR_ASSERT(ws);
        for (int kn = 0; kn < 3; kn++) {
            setenv("LUNAR_MLA_FLASH", kernels[kn], 1);
            lunar_cuda_fill_u32(ws, 0x7fc17fc1u, lunar_glue_mla_flash_ws(T, H, L, kc) / 4); /* NaN workspace */
            guarded od;
            float *d_o = guarded_new(&od, (size_t)T * H * VD * 4);
            lunar_glue_mla_flash(d_o, dq, dW, c.latent, fp8, c.block_tables, BS, pos0, T, H, scale, kc, ws, NULL);
            float *got = down(d_o, (size_t)T * H * VD * 4);
            char what[96];
            snprintf(what, sizeof what, "mla flash %s T=%d pos0=%d H=%d kc=%d%s", kernels[kn], T, pos0, H, kc,
                     fp8 ? " fp8" : "");
            report(what, lunar_max_rel_err(got, ref, (long)T * H * VD), 1.5e-2);
            CHECK(guards_ok(&od));
            free(got);
        }
        free(ref), free(q), free(W), free(Wb), free(rows);
        test_tensor_free(&Wt);
        pool_free(&p);
        lunar_cuda_release(mark);
    }
    setenv_or_unset("LUNAR_MLA_FLASH", saved);
    free(saved);
}

/* One sparse case: B rows over contexts lens[] (at most 5000), topk selected entries each. Row 2 (when
 * B > 2) selects nothing (o = 0), row 1 every position then -1 padding (topk > its context when
 * lens[1] < topk), the others a shuffle with holes. */
/* unset: 32 positions a split at <= 16 heads, 256 above; 256: the old plan (the per-pair merge) */
static const char *const sparse_splits[6] = {NULL, "32", "64", "100", "256", "5000"};
static void sparse_case(int B, int H, int topk, const int *lens, int fp8) {
    const float scale = 0.3f;
    size_t mark = lunar_cuda_mark();
    pool p;
    pool_make(&p, lens, B, fp8, 300 + fp8);
    float *W = test_rand((long)H * (N_NOPE + VD) * R, 70, -0.1f, 0.1f);
    lunar_tensor Wt = test_tensor2(LUNAR_DTYPE_F32, (int64_t)H * (N_NOPE + VD), R, W);
    float *q = test_rand((long)B * H * (N_NOPE + P), 71, -1, 1);
    float *ql = test_alloc((long)B * H * R), *qp = test_alloc((long)B * H * P);
    float *ref = test_poisoned((long)B * H * VD), *got = test_poisoned((long)B * H * VD);
    int32_t *idx = malloc((size_t)B * topk * 4), *perm = malloc(5000 * 4);
    rng_state = 99;
    for (int b = 0; b < B; b++) {
        int32_t *ib = idx + (size_t)b * topk;
        for (int i = 0; i < lens[b]; i++) perm[i] = i;
        shuffle_i32(perm, lens[b]);
        for (int i = 0; i < topk; i++) {
            if (b == 2) ib[i] = -1;                                        /* nothing valid: o = 0 */
            else if (b == 1) ib[i] = i < lens[b] ? i : -1;                 /* short: all positions, padded */
            else ib[i] = (i % 7 == 3 || i >= lens[b]) ? -1 : perm[i];      /* shuffled, with holes */
        }
        if (b == 3) ib[5] = lens[b] - 1;
        absorb(ql + (size_t)b * H * R, qp + (size_t)b * H * P, q + (size_t)b * H * (N_NOPE + P), W, H);
        float *rows = pool_rows(&p, b, lens[b]);
        op_mla_attention_sparse(ref + (size_t)b * H * VD, q + (size_t)b * H * (N_NOPE + P), rows, &Wt, ib, topk, 1,
                                lens[b], H, N_NOPE, P, VD, R, scale);
        free(rows);
    }
    lunar_cuda_mla_cache c = pool_upload(&p);
    const float *dql = dev_in(ql, (size_t)B * H * R * 4), *dqp = dev_in(qp, (size_t)B * H * P * 4);
    const int32_t *didx = dev_in(idx, (size_t)B * topk * 4);
    for (int si = 0; si < 6; si++) { /* the CPU reference once, each plan against it */
        const char *split = sparse_splits[si];
        setenv_or_unset("LUNAR_MLA_SPARSE_SPLIT", split);
        size_t wsb = lunar_cuda_mla_ws(B, H, topk);
        void *ws = wsb ? lunar_cuda_alloc(wsb) : NULL;
        guarded od;
        float *d_o = guarded_new(&od, (size_t)B * H * R * 4);
        lunar_cuda_mla_sparse(d_o, dql, dqp, &c, NULL, didx, topk, B, H, scale, ws, NULL);
        float *olat = down(d_o, (size_t)B * H * R * 4);
        for (int b = 0; b < B; b++) unabsorb(got + (size_t)b * H * VD, olat + (size_t)b * H * R, W, H);
        if (B > 2) {
            int zero = 1;
            for (int i = 0; i < H * R; i++) zero &= olat[(size_t)2 * H * R + i] == 0.0f;
            CHECK_MSG(zero, "sparse row with no valid index must give o = 0");
        }
        char what[128];
        snprintf(what, sizeof what, "mla sparse B=%d H=%d topk=%d %s split=%s", B, H, topk, fp8 ? "fp8" : "bf16",
                 split ? split : "default");
        report(what, lunar_max_rel_err(got, ref, (long)B * H * VD), 1.5e-2);
        CHECK(guards_ok(&od));
        free(olat);
    }
    free(ref), free(got), free(ql), free(qp), free(q), free(W), free(idx), free(perm);
    test_tensor_free(&Wt);
    pool_free(&p);
    lunar_cuda_release(mark);
}

/* The default plan and LUNAR_MLA_SPARSE_SPLIT (shorter splits, the shared-memory merge; 100 rounds up
 * to 128, 256 the plan before session 17, 5000 one split); 4 rows x 16 heads, the K3.1 rank (1 row,
 * 12 heads), odd top-k and top-k past the context, 40 heads (3 head groups, 256 by default). */
TEST(cuda_mla_sparse_vs_cpu) {
    if (!cuda_on()) return;
    const int l4[4] = {5000, 300, 2100, 3000}, l1[1] = {4999}, l2[3] = {1733, 611, 900};
    char *saved = getenv("LUNAR_MLA_SPARSE_SPLIT") ? strdup(getenv("LUNAR_MLA_SPARSE_SPLIT")) : NULL;
    for (int fp8 = 0; fp8 < 2; fp8++) {
        sparse_case(4, 16, 2048, l4, fp8);
        sparse_case(1, 12, 2048, l1, fp8);
        sparse_case(3, 12, 999, l2, fp8); /* row 1: topk > context */
        sparse_case(1, 40, 333, l2, fp8); /* 3 head groups, one block */
    }
    setenv_or_unset("LUNAR_MLA_SPARSE_SPLIT", saved);
    free(saved);
}

/* ---------------------------------------------------------------- DSA */

enum { DI = 128 };

/* The hardware f32 -> e4m3 conversion the kernels use equals the CPU's rounding rule (the device port of
 * lunar_f32_to_e4m3, statement for statement) on every one of the 2^32 float bit patterns: NaN, infinities,
 * the saturation edge at 448 / 464, subnormals and the normal / subnormal boundary included. */
TEST(cuda_e4m3_hw_equals_cpu_port) {
    if (!cuda_on()) return;
    const unsigned long long bad = lunar_cuda_e4m3_mismatches();
    CHECK_MSG(bad == 0, "%llu of 2^32 inputs differ", bad);
}

/* d = 128 (K3.1) and d = 16 (the tiny goldens: fewer lanes than a warp) */
TEST(cuda_dsa_index_write_bitwise) {
    if (!cuda_on()) return;
    for (int di = 16; di <= DI; di *= 8) {
    const int n = 200, nslots = 3 * BS;
    size_t mark = lunar_cuda_mark();
    float *k = test_rand((long)n * di, 80, -2, 2);
    for (int i = 0; i < di; i++) k[5 * di + i] *= 1e3f, k[6 * di + i] *= 1e-3f, k[7 * di + i] = 0.0f;
    k[8 * di + 3] = 1e6f;
    int32_t *perm = malloc((size_t)nslots * 4);
    for (int i = 0; i < nslots; i++) perm[i] = i;
    rng_state = 5;
    shuffle_i32(perm, nslots);
    const float *dk = dev_in(k, (size_t)n * di * 4);
    const int32_t *dslots = dev_in(perm, (size_t)n * 4);
    guarded oc, os;
    uint8_t *dcodes = guarded_new(&oc, (size_t)nslots * di);
    float *dsc = guarded_new(&os, (size_t)nslots * 4);
    lunar_cuda_dsa_index_write(dcodes, dsc, dk, dslots, n, di, NULL);
    uint8_t *codes = down(dcodes, (size_t)nslots * di);
    float *sc = down(dsc, (size_t)nslots * 4);
    op_hadamard(k, n, di);
    uint8_t q8[DI];
    int bad = 0;
    for (int i = 0; i < n; i++) {
        float s = lunar_fp8_quantize_pow2(q8, k + (size_t)i * di, di);
        bad += memcmp(q8, codes + (size_t)perm[i] * di, di) != 0 || memcmp(&s, sc + perm[i], 4) != 0;
    }
    CHECK_MSG(bad == 0, "index write d=%d: %d of %d tokens differ from the CPU's codes/scale", di, bad, n);
    CHECK(guards_ok(&oc) && guards_ok(&os));
    free(codes), free(sc), free(k), free(perm);
    lunar_cuda_release(mark);
    }
}

/* lunar_cuda_dsa_index_prep (one launch) against the four launches it replaces (layernorm, scale,
 * Hadamard, index write): codes, scales, rotated queries and scaled weights memcmp-equal, with and
 * without the norm's weight and bias, d = 16 / 32 / 128, 1 / 3 / 32 heads, 1 / 7 / 150 tokens */
TEST(cuda_dsa_index_prep_same_bits) {
    if (!cuda_on()) return;
    static const int cfg[][3] = {{128, 32, 1}, {128, 32, 150}, {16, 3, 7}, {32, 1, 150}, {128, 1, 7}};
    int runs = 0;
    for (unsigned c = 0; c < sizeof cfg / sizeof cfg[0]; c++)
        for (int affine = 0; affine < 2; affine++) {
            const int di = cfg[c][0], ni = cfg[c][1], n = cfg[c][2], nslots = 2 * BS;
            size_t mark = lunar_cuda_mark();
            float *ik = test_rand((long)n * di, 90 + c, -3, 5), *iq = test_rand((long)n * ni * di, 91 + c, -2, 2);
            float *wt = test_rand((long)n * ni, 92 + c, -1, 1), *lw = test_rand(di, 93 + c, 0.5f, 1.5f);
            float *lb = test_rand(di, 94 + c, -0.2f, 0.2f);
            int32_t *perm = malloc((size_t)nslots * 4);
            for (int i = 0; i < nslots; i++) perm[i] = i;
            rng_state = 7 + c;
            shuffle_i32(perm, nslots);
            const int32_t *dslots = dev_in(perm, (size_t)n * 4);
            const float *dlw = affine ? dev_in(lw, (size_t)di * 4) : NULL, *dlb = affine ? dev_in(lb, (size_t)di * 4) : NULL;
            const float wscale = 1.0f / sqrtf((float)ni) / sqrtf((float)di);
            uint8_t *codes[2];
            float *sc[2], *q[2], *w[2];
            for (int v = 0; v < 2; v++) {
                float *dik = (float *)dev_in(ik, (size_t)n * di * 4), *diq = (float *)dev_in(iq, (size_t)n * ni * di * 4);
                float *dwt = (float *)dev_in(wt, (size_t)n * ni * 4);
                uint8_t *dcodes = lunar_cuda_alloc((size_t)nslots * di);
                float *dsc = lunar_cuda_alloc((size_t)nslots * 4);
                lunar_cuda_fill_u32(dcodes, 0x5a5a5a5au, (size_t)nslots * di / 4);
                lunar_cuda_fill_u32(dsc, 0x7fc00001u, (size_t)nslots);
                if (v == 0) {
                    lunar_glue_layernorm(dik, dik, dlw, dlb, n, di, 1e-6f, NULL);
                    lunar_glue_scale(dwt, wscale, (size_t)n * ni, NULL);
                    lunar_glue_hadamard(diq, n * ni, di, NULL);
                    lunar_cuda_dsa_index_write(dcodes, dsc, dik, dslots, n, di, NULL);
                } else {
                    CHECK(lunar_cuda_dsa_index_prep(dcodes, dsc, dik, diq, dwt, dslots, n, ni, di, dlw, dlb, 1e-6f,
                                                    wscale, NULL) == 0);
                }
                codes[v] = down(dcodes, (size_t)nslots * di), sc[v] = down(dsc, (size_t)nslots * 4);
                q[v] = down(diq, (size_t)n * ni * di * 4), w[v] = down(dwt, (size_t)n * ni * 4);
            }
            CHECK_MSG(memcmp(codes[0], codes[1], (size_t)nslots * di) == 0 && memcmp(sc[0], sc[1], (size_t)nslots * 4) == 0,
                      "index prep d=%d ni=%d n=%d affine=%d: the key's codes or scales differ", di, ni, n, affine);
            CHECK_MSG(memcmp(q[0], q[1], (size_t)n * ni * di * 4) == 0 && memcmp(w[0], w[1], (size_t)n * ni * 4) == 0,
                      "index prep d=%d ni=%d n=%d affine=%d: the queries or weights differ", di, ni, n, affine);
            for (int v = 0; v < 2; v++) free(codes[v]), free(sc[v]), free(q[v]), free(w[v]);
            free(ik), free(iq), free(wt), free(lw), free(lb), free(perm);
            lunar_cuda_release(mark);
            runs++;
        }
    CHECK(runs == 10);
    CHECK(lunar_cuda_dsa_index_prep(NULL, NULL, NULL, NULL, NULL, NULL, 1, 4, 256, NULL, NULL, 1e-6f, 1.0f, NULL) == -1);
}

/* indexer.c's score for one query row, statement for statement (to check bitwise equality) */
static void cpu_scores(float *out, const float *iq, const float *w, const lunar_index_cache *c, int n, int nh,
                       int d) {
    float lut[256];
    for (int i = 0; i < 256; i++) lut[i] = lunar_e4m3_to_f32((uint8_t)i);
    uint8_t *q8 = malloc((size_t)nh * d);
    float *qf = malloc((size_t)nh * d * 4), kb[DI];
    double *wq = malloc((size_t)nh * 8);
    for (int h = 0; h < nh; h++) {
        float sq = lunar_fp8_quantize_pow2(q8 + (size_t)h * d, iq + (size_t)h * d, d);
        for (int i = 0; i < d; i++) qf[(size_t)h * d + i] = lut[q8[(size_t)h * d + i]];
        wq[h] = (double)w[h] * sq;
    }
    for (int s = 0; s < n; s++) {
        for (int i = 0; i < d; i++) kb[i] = lut[c->codes[(size_t)s * d + i]];
        double ks = c->scales[s], acc = 0;
        for (int h = 0; h < nh; h++) {
            double dot = 0;
            for (int i = 0; i < d; i++) dot += (double)qf[(size_t)h * d + i] * kb[i];
            if (dot > 0) acc += wq[h] * dot;
        }
        out[s] = (float)(acc * ks);
    }
    free(q8), free(qf), free(wq);
}

/* every score kernel (int8 tensor cores, round-1 and pipelined, with one or several rows per block; fp64) */
enum { N_SCORE_MODES = 5 };
static const int score_modes[N_SCORE_MODES] = {LUNAR_DSA_SCORE_INT8_SYNC, LUNAR_DSA_SCORE_INT8_SYNC_GROUPED,
                                               LUNAR_DSA_SCORE_INT8_PIPE, LUNAR_DSA_SCORE_INT8_PIPE_GROUPED,
                                               LUNAR_DSA_SCORE_FP64};
static const char *score_mode_name(int m) {
    switch (m) {
    case LUNAR_DSA_SCORE_FP64: return "fp64";
    case LUNAR_DSA_SCORE_INT8_SYNC: return "int8 sync";
    case LUNAR_DSA_SCORE_INT8_SYNC_GROUPED: return "int8 sync grouped";
    case LUNAR_DSA_SCORE_INT8_PIPE: return "int8 pipe";
    case LUNAR_DSA_SCORE_INT8_PIPE_GROUPED: return "int8 pipe grouped";
    default: return "int8";
    }
}

TEST(cuda_dsa_indexer_vs_cpu) {
    if (!cuda_on()) return;
    for (int mi = 0; mi < N_SCORE_MODES; mi++) {
        const int mode = score_modes[mi], prev_mode = lunar_cuda_dsa_score_mode(mode);
        /* sequences: plain, shorter than topk, and one whose keys 1000.. are all the same (ties) */
        const int n_seq = 3, lens[3] = {3000, 100, 5000};
        /* rows: one decode row per sequence, then 4 prefill rows of sequence 2 */
        const int rows = 7, row_seq[7] = {0, 1, 2, 2, 2, 2, 2}, row_len[7] = {3000, 100, 5000, 4001, 4002, 4003, 4004};
        static const int nhs[2] = {32, 64}, topks[2] = {2048, 64};
        for (int v = 0; v < 2; v++) {
            const int nh = nhs[v], topk = topks[v];
            size_t mark = lunar_cuda_mark();
            int max_blocks = 0, total = 0;
            for (int b = 0; b < n_seq; b++) {
                int nb = (lens[b] + BS - 1) / BS;
                total += nb;
                max_blocks = nb > max_blocks ? nb : max_blocks;
            }
            int32_t *perm = malloc((size_t)total * 4), *bt = calloc((size_t)n_seq * max_blocks, 4);
            for (int i = 0; i < total; i++) perm[i] = i;
            rng_state = 11 + v;
            shuffle_i32(perm, total);
            int ntok = 0;
            for (int b = 0, k = 0; b < n_seq; b++) {
                for (int i = 0; i < (lens[b] + BS - 1) / BS; i++) bt[b * max_blocks + i] = perm[k++];
                ntok += lens[b];
            }
            float *keys = test_rand((long)ntok * DI, 90 + v, -1, 1);
            int32_t *slots = malloc((size_t)ntok * 4);
            for (int b = 0, t = 0; b < n_seq; b++)
                for (int j = 0; j < lens[b]; j++, t++) {
                    slots[t] = bt[b * max_blocks + j / BS] * BS + j % BS;
                    if (b == 2 && j > 1000) memcpy(keys + (size_t)t * DI, keys + (size_t)(t - 1) * DI, DI * 4);
                }
            const size_t nslot = (size_t)total * BS;
            uint8_t *dcodes = lunar_cuda_alloc(nslot * DI);
            float *dsc = lunar_cuda_alloc(nslot * 4);
            lunar_cuda_fill_u32(dcodes, 0, nslot * DI / 4);
            lunar_cuda_fill_u32(dsc, 0, nslot);
            lunar_cuda_dsa_index_write(dcodes, dsc, dev_in(keys, (size_t)ntok * DI * 4), dev_in(slots, (size_t)ntok * 4),
                                       ntok, DI, NULL);
            uint8_t *codes = down(dcodes, nslot * DI);
            float *sc = down(dsc, nslot * 4);
            float *iq = test_rand((long)rows * nh * DI, 95 + v, -1, 1);
            float *w = test_rand((long)rows * nh, 96 + v, -1, 1);
            for (int i = 0; i < rows * nh; i++) w[i] *= 1.0f / sqrtf((float)nh) / sqrtf((float)DI);
            const int ld = 5000;
            guarded osc, oidx, ocnt;
            float *dscores = guarded_new(&osc, (size_t)rows * ld * 4);
            int32_t *didx = guarded_new(&oidx, (size_t)rows * topk * 4), *dcnt = guarded_new(&ocnt, (size_t)rows * 4);
            const int32_t *dlens = dev_in(row_len, sizeof row_len), *dseq = dev_in(row_seq, sizeof row_seq);
            const int32_t *dbt = dev_in(bt, (size_t)n_seq * max_blocks * 4);
            const float *diq = dev_in(iq, (size_t)rows * nh * DI * 4), *dw = dev_in(w, (size_t)rows * nh * 4);
            lunar_cuda_dsa_index_score(dscores, ld, diq, dw, dcodes, dsc, dbt, max_blocks, dseq, dlens, 5000, rows, nh,
                                       DI, NULL);
            lunar_cuda_dsa_topk(didx, dcnt, dscores, ld, dlens, rows, topk, NULL);
            float *gsc = down(dscores, (size_t)rows * ld * 4);
            int32_t *gidx = down(didx, (size_t)rows * topk * 4), *gcnt = down(dcnt, (size_t)rows * 4);
            /* one row alone (rows 0 and 2: few blocks, so the pipelined kernel takes 1 tile per block; with
             * nh 64 its 64-position blocks start mid-page): the same scores as in the batch */
            int alone_bad = 0;
            for (int r = 0; r <= 2; r += 2) {
                guarded o1;
                float *d1 = guarded_new(&o1, (size_t)ld * 4);
                lunar_cuda_dsa_index_score(d1, ld, diq + (size_t)r * nh * DI, dw + (size_t)r * nh, dcodes, dsc, dbt,
                                           max_blocks, dseq + r, dlens + r, row_len[r], 1, nh, DI, NULL);
                float *g1 = down(d1, (size_t)ld * 4);
                alone_bad += memcmp(g1, gsc + (size_t)r * ld, (size_t)row_len[r] * 4) != 0;
                CHECK(guards_ok(&o1));
                free(g1);
            }
            CHECK_MSG(alone_bad == 0, "indexer %s nh=%d: %d rows scored alone differ from the batch", score_mode_name(mode),
                      nh, alone_bad);
            int score_bad = 0, idx_bad = 0;
            for (int r = 0; r < rows; r++) {
                const int b = row_seq[r], n = row_len[r];
                uint8_t *cc = malloc((size_t)lens[b] * DI);
                float *cs = malloc((size_t)lens[b] * 4);
                for (int j = 0; j < lens[b]; j++) {
                    size_t s = (size_t)bt[b * max_blocks + j / BS] * BS + j % BS;
                    memcpy(cc + (size_t)j * DI, codes + s * DI, DI);
                    cs[j] = sc[s];
                }
                lunar_index_cache cache = {.codes = cc, .scales = cs, .keys = NULL};
                float *ref = malloc((size_t)n * 4);
                cpu_scores(ref, iq + (size_t)r * nh * DI, w + (size_t)r * nh, &cache, n, nh, DI);
                score_bad += memcmp(ref, gsc + (size_t)r * ld, (size_t)n * 4) != 0;
                int32_t *ri = malloc((size_t)topk * 4), rc = 0;
                op_dsa_indexer(ri, &rc, iq + (size_t)r * nh * DI, w + (size_t)r * nh, &cache, 1, n - 1, nh, DI, topk);
                idx_bad += memcmp(ri, gidx + (size_t)r * topk, (size_t)topk * 4) != 0 || rc != gcnt[r];
                free(cc), free(cs), free(ref), free(ri);
            }
            if (getenv("LUNAR_TEST_VERBOSE"))
                fprintf(stderr, "\n    dsa indexer nh=%d topk=%d: %d/%d rows with scores != CPU, %d/%d selections != CPU", nh,
                        topk, score_bad, rows, idx_bad, rows);
            CHECK_MSG(score_bad == 0, "indexer %s nh=%d: %d rows' scores differ bitwise from the CPU's",
                      score_mode_name(mode), nh, score_bad);
            CHECK_MSG(idx_bad == 0, "indexer %s nh=%d topk=%d: %d rows' selections differ from the CPU's",
                      score_mode_name(mode), nh, topk, idx_bad);
            CHECK(guards_ok(&osc) && guards_ok(&oidx) && guards_ok(&ocnt));
            free(perm), free(bt), free(keys), free(slots), free(codes), free(sc), free(iq), free(w), free(gsc), free(gidx),
                free(gcnt);
            lunar_cuda_release(mark);
        }
        lunar_cuda_dsa_score_mode(prev_mode);
    }
}

/* Scores at shapes that are not multiples of the kernels' tiles: nh = 20 (of a 32-head tile), d = 48
 * (K of the int8 kernel is 128), lengths that end mid-tile, 261 rows (row groups of 4 with one row of
 * another sequence in the middle of a group) and 7 rows (one row per block). Codes are random bytes
 * (every e4m3 value: subnormals, +-448, -0), a few keys hold NaN codes and one query head a NaN:
 * the CPU drops NaN dots, the kernels must match that bitwise too. */
TEST(cuda_dsa_scores_odd_shapes_vs_cpu) {
    if (!cuda_on()) return;
    enum { NH = 20, D = 48, NSEQ = 2, NR = 261 };
    const int lens[NSEQ] = {1000, 333};
    int row_seq[NR], row_len[NR];
    for (int r = 0; r < NR; r++) {
        row_seq[r] = r == 130 ? 1 : 0;
        row_len[r] = r == 130 ? 333 : 1000 - (NR - 1) + r - (r > 130);
    }
    size_t mark = lunar_cuda_mark();
    const int nb0 = (lens[0] + BS - 1) / BS, nb1 = (lens[1] + BS - 1) / BS, max_blocks = nb0, total = nb0 + nb1;
    int32_t *perm = malloc((size_t)total * 4), *bt = calloc((size_t)NSEQ * max_blocks, 4);
    for (int i = 0; i < total; i++) perm[i] = i;
    rng_state = 77;
    shuffle_i32(perm, total);
    for (int i = 0; i < nb0; i++) bt[i] = perm[i];
    for (int i = 0; i < nb1; i++) bt[max_blocks + i] = perm[nb0 + i];
    const size_t nslot = (size_t)total * BS;
    uint8_t *codes = malloc(nslot * D);
    float *sc = malloc(nslot * 4);
    for (size_t i = 0; i < nslot * D; i++) {
        uint8_t c = (uint8_t)(rng() & 255);
        if ((c & 0x7f) == 0x7f) c ^= 1; /* NaN codes only where placed below */
        codes[i] = c;
    }
    for (size_t i = 0; i < nslot; i++) sc[i] = ldexpf(1.0f, (int)(rng() % 16) - 10);
    for (int j = 5; j < lens[0]; j += 97) codes[((size_t)bt[j / BS] * BS + j % BS) * D + (size_t)(j % D)] = 0x7f;
    float *iq = test_rand((long)NR * NH * D, 55, -1, 1);
    float *w = test_rand((long)NR * NH, 56, -0.05f, 0.05f);
    iq[((size_t)3 * NH + 3) * D + 17] = NAN; /* row 3, head 3 */
    const int ld = 1003;
    uint8_t *dcodes = dev_in(codes, nslot * D);
    float *dsc = dev_in(sc, nslot * 4);
    const int32_t *dlens = dev_in(row_len, sizeof row_len), *dseq = dev_in(row_seq, sizeof row_seq);
    const int32_t *dbt = dev_in(bt, (size_t)NSEQ * max_blocks * 4);
    const float *diq = dev_in(iq, (size_t)NR * NH * D * 4), *dw = dev_in(w, (size_t)NR * NH * 4);
    /* CPU scores per row */
    float *ref = malloc((size_t)NR * ld * 4);
    for (int r = 0; r < NR; r++) {
        const int b = row_seq[r], n = row_len[r];
        uint8_t *cc = malloc((size_t)lens[b] * D);
        float *cs = malloc((size_t)lens[b] * 4);
        for (int j = 0; j < lens[b]; j++) {
            size_t s = (size_t)bt[b * max_blocks + j / BS] * BS + j % BS;
            memcpy(cc + (size_t)j * D, codes + s * D, D);
            cs[j] = sc[s];
        }
        lunar_index_cache cache = {.codes = cc, .scales = cs, .keys = NULL};
        cpu_scores(ref + (size_t)r * ld, iq + (size_t)r * NH * D, w + (size_t)r * NH, &cache, n, NH, D);
        free(cc), free(cs);
    }
    int nonzero = 0;
    for (int j = 0; j < row_len[0]; j++) nonzero += ref[j] != 0.0f;
    CHECK_MSG(nonzero > row_len[0] / 4, "test data: only %d of %d scores of row 0 are nonzero", nonzero, row_len[0]);
    static const int nrows[2] = {NR, 7};
    for (int mi = 0; mi < N_SCORE_MODES; mi++)
        for (int ri = 0; ri < 2; ri++) {
            const int mode = score_modes[mi], rows = nrows[ri], prev_mode = lunar_cuda_dsa_score_mode(mode);
            guarded osc;
            float *dscores = guarded_new(&osc, (size_t)rows * ld * 4);
            lunar_cuda_dsa_index_score(dscores, ld, diq, dw, dcodes, dsc, dbt, max_blocks, dseq, dlens, lens[0], rows,
                                       NH, D, NULL);
            float *got = down(dscores, (size_t)rows * ld * 4);
            int bad = 0, first = -1;
            for (int r = 0; r < rows; r++)
                if (memcmp(ref + (size_t)r * ld, got + (size_t)r * ld, (size_t)row_len[r] * 4) != 0) {
                    bad++;
                    if (first < 0) first = r;
                }
            CHECK_MSG(bad == 0, "scores %s, %d rows: %d rows differ bitwise from the CPU's (first: row %d)",
                      score_mode_name(mode), rows, bad, first);
            CHECK(guards_ok(&osc));
            free(got);
            lunar_cuda_dsa_score_mode(prev_mode);
        }
    free(perm), free(bt), free(codes), free(sc), free(iq), free(w), free(ref);
    lunar_cuda_release(mark);
}

typedef struct {
    float s;
    int32_t p;
} sp_pair;
static int sp_cmp(const void *a, const void *b) { /* better first: higher score, then lower position */
    const sp_pair *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return (x->p > y->p) - (x->p < y->p);
}
static int i32_cmp(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Top-k of rows against a sort. gen 0: the
 * 1M rows (ties, signs, zeros, all equal, a few values); gen 1: the indexer's kind of row, every score in one or
 * two exponents (most keys of the first digit in one bin), 8K .. 128K and odd lengths. */
static void topk_vs_sort(int rows, const int *lens, int ld, int gen) {
    const int topk = 2048;
    size_t mark = lunar_cuda_mark();
    float *sc = malloc((size_t)rows * ld * 4);
    rng_state = 1234 + gen;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ld; j++) {
            float v;
            if (gen == 1) v = r == 2 ? 1.0f + (float)(rng() % 64) / 64.0f : 0.75f + (float)(rng() % 100000) * 1e-5f;
            else if (r == 0) v = (float)((int)(rng() % 20001) - 10000) / 7.0f; /* many ties, signs, zeros */
            else if (r == 1) v = (rng() & 1) ? -0.0f : ((float)(rng() % 1000) * 1e-3f - 0.5f);
            else if (r == 2) v = 1.5f; /* all equal: the lowest positions */
            else v = (float)(rng() % 3);
            sc[(size_t)r * ld + j] = v;
        }
    const float *dsc = dev_in(sc, (size_t)rows * ld * 4);
    const int32_t *dlens = dev_in(lens, (size_t)rows * 4);
    sp_pair *v = malloc((size_t)ld * sizeof *v);
    int32_t *ref = malloc((size_t)rows * topk * 4);
    for (int r = 0; r < rows; r++) {
        for (int j = 0; j < lens[r]; j++) v[j].s = sc[(size_t)r * ld + j], v[j].p = j;
        qsort(v, (size_t)lens[r], sizeof *v, sp_cmp);
        for (int i = 0; i < topk; i++) ref[(size_t)r * topk + i] = v[i].p;
        qsort(ref + (size_t)r * topk, (size_t)topk, 4, i32_cmp);
    }
    guarded oidx;
    int32_t *didx = guarded_new(&oidx, (size_t)rows * topk * 4);
    lunar_cuda_dsa_topk(didx, NULL, dsc, ld, dlens, rows, topk, NULL);
    int32_t *got = down(didx, (size_t)rows * topk * 4);
    for (int r = 0; r < rows; r++)
        CHECK_MSG(memcmp(ref + (size_t)r * topk, got + (size_t)r * topk, (size_t)topk * 4) == 0,
                  "top-k gen %d row %d (n=%d) differs", gen, r, lens[r]);
    CHECK(guards_ok(&oidx));
    free(got), free(sc), free(v), free(ref);
    lunar_cuda_release(mark);
}

TEST(cuda_dsa_topk_1m_vs_sort) {
    if (!cuda_on()) return;
    const int lens[4] = {1 << 20, 777777, 100000, 2048 + 1};
    topk_vs_sort(4, lens, 1 << 20, 0);
    const int lens1[5] = {8192, 131072, 32768, 8191, 12345};
    topk_vs_sort(1, lens1, 131072, 1);
    topk_vs_sort(5, lens1, 131072, 1);
}

#endif
