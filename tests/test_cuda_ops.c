/* Every CUDA op against its CPU op (the reference) on random inputs, several shapes including odd
 * ones. Device outputs are allocated between guard words and poisoned first (the pattern is a NaN
 * both as fp32 and as each bf16 half), so an unwritten element fails the NaN check and a write out
 * of bounds fails the guard check. Skipped, with a clear message, when no CUDA device is present
 * (or lunar was built without CUDA).
 *
 * Tolerances (relative to max |reference|, lunar_max_rel_err):
 *  - fp32-output ops that only reorder fp32 sums or use the device's expf/tanhf (2 ulp): 1e-5.
 *  - bf16-stored outputs: one bf16 rounding on top (8 significant bits: at most 2^-8 = 3.9e-3
 *    relative to the element, so to max |ref|): 5e-3. Observed up to 3.5e-3.
 *  - GEMM with fp32 output: the CPU gets the same bf16-rounded x and W, so the products are exact
 *    in fp32 on both sides and only the summation order (tensor-core fp32 accumulation in
 *    cuBLASLt, 16-way partial sums on the CPU) differs: ~in * 2^-24 relative, 1e-4 allows in <= 8k.
 *    Observed <= 4.4e-6 (H200).
 *  - KDA recurrent: fp32 state on both sides, different reduction trees over 128 rows: 1e-5.
 *  - KDA chunked (3xTF32 split, fp32 Gamma): the split products carry ~2^-21 relative error and
 *    Gamma as an fp32 running sum ~1e-5 (the CPU keeps it in double; transformers' fp32 cumsum
 *    shows 1.3e-5): 1e-4, observed <= 5.1e-6. Plain tf32 (10-bit mantissa, 2^-11 per operand):
 *    5e-3, observed <= 6.4e-4. Recurrent observed <= 5.7e-7; fp32 elementwise/norm ops <= 2e-7. */
#include "test.h"

#ifndef LUNAR_HAVE_CUDA

TEST(cuda_ops_skipped) { fprintf(stderr, "[skipped: no CUDA device: lunar was built without CUDA] "); }

#else

#include <stdint.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_glue.h"
#include "backend/cuda/cuda_ops.h"
#include "ops.h"
#include "cuda_test.h"
#include "kda_inputs.h"
#include "ops_util.h"


static int cuda_on(void) { return lunar_test_cuda_on((size_t)6 << 30); }

static float *down_f32(const void *d, long n) {
    float *h = test_alloc(n);
    lunar_cuda_sync();
    lunar_cuda_download(h, d, (size_t)n * 4);
    return h;
}
static float *down_bf16(const void *d, long n) {
    uint16_t *b = malloc((size_t)(n > 0 ? n : 1) * 2);
    lunar_cuda_sync();
    lunar_cuda_download(b, d, (size_t)n * 2);
    float *h = test_alloc(n);
    for (long i = 0; i < n; i++) h[i] = lunar_bf16_to_f32(b[i]);
    free(b);
    return h;
}
static uint16_t *to_bf16(const float *x, long n) {
    uint16_t *b = malloc((size_t)(n > 0 ? n : 1) * 2);
    for (long i = 0; i < n; i++) b[i] = lunar_f32_to_bf16(x[i]);
    return b;
}
static void round_bf16(float *x, long n) {
    for (long i = 0; i < n; i++) x[i] = lunar_bf16_to_f32(lunar_f32_to_bf16(x[i]));
}
static double verbose_max;
static void report(const char *what, double e, double tol) {
    if (getenv("LUNAR_TEST_VERBOSE")) fprintf(stderr, "\n    %-44s max rel err %.3g (tol %.0e)", what, e, tol);
    if (e > verbose_max) verbose_max = e;
    CHECK_MSG(e <= tol, "%s: max rel err %.3g > %.0e", what, e, tol);
}

/* ---------------------------------------------------------------- GEMM */

/* the GEMM entries at one shape against the CPU op; lo..hi the rows the tensor-core skinny kernel takes */
static void matmul_case(int n, int out, int in, unsigned s, int lo, int hi) {
    size_t mark = lunar_cuda_mark();
    float *x = test_rand((long)n * in, 10 + s, -1, 1), *w = test_rand((long)out * in, 20 + s, -0.1f, 0.1f);
    round_bf16(x, (long)n * in);
    lunar_tensor W = test_tensor2(LUNAR_DTYPE_BF16, out, in, w);
    float *ref = test_poisoned((long)n * out);
    op_matmul(ref, x, &W, n);
    uint16_t *xb = to_bf16(x, (long)n * in);
    const uint16_t *dx = dev_in(xb, (size_t)n * in * 2), *dw = dev_in(W.data, W.nbytes);
    for (int dt = 0; dt < 2; dt++) {
        guarded o;
        void *dy = guarded_new(&o, (size_t)n * out * (dt ? 2 : 4));
        lunar_cuda_matmul(dy, dt ? LUNAR_CUDA_BF16 : LUNAR_CUDA_F32, dx, dw, n, out, in, NULL);
        float *y = dt ? down_bf16(dy, (long)n * out) : down_f32(dy, (long)n * out);
        char what[96];
        snprintf(what, sizeof what, "matmul n=%d out=%d in=%d %s mma %d..%d", n, out, in, dt ? "bf16" : "f32", lo,
                 hi);
        report(what, lunar_max_rel_err(y, ref, (long)n * out), dt ? 5e-3 : 1e-4);
        CHECK(guards_ok(&o));
        /* fp32 x rounded inside the skinny kernel: the same bits as the bf16 copy's product */
        float *xr = test_rand((long)n * in, 10 + s, -1, 1); /* x before its rounding */
        const float *dxf = dev_in(xr, (size_t)n * in * 4);
        guarded o2;
        void *dy2 = guarded_new(&o2, (size_t)n * out * (dt ? 2 : 4));
        const int took = lunar_cuda_matmul_f32x(dy2, dt ? LUNAR_CUDA_BF16 : LUNAR_CUDA_F32, dxf, dw, n, out, in, NULL);
        CHECK(took == ((n <= 4 || (n >= lo && n <= hi)) && in % 8 == 0 ? 0 : -1));
        if (took == 0) {
            float *y2 = dt ? down_bf16(dy2, (long)n * out) : down_f32(dy2, (long)n * out);
            CHECK_MSG(memcmp(y2, y, (size_t)n * out * sizeof *y) == 0, "%s: fp32-x kernel differs from bf16-x", what);
            CHECK(guards_ok(&o2));
            if (!dt) /* the epilogue: P += (x W^T + A), the separate adds' bits (with A and without) */
                for (int with_add = 0; with_add < 2; with_add++) {
                    float *p0 = test_rand((long)n * out, 30 + s, -2, 2), *a = test_rand((long)n * out, 40 + s, -1, 1);
                    guarded o3;
                    float *dp = guarded_new(&o3, (size_t)n * out * 4);
                    lunar_cuda_upload(dp, p0, (size_t)n * out * 4);
                    CHECK(lunar_cuda_matmul_f32x_into(dp, dxf, dw, n, out, in,
                                                      with_add ? dev_in(a, (size_t)n * out * 4) : NULL, NULL) == 0);
                    float *p = down_f32(dp, (long)n * out);
                    long bad = 0;
                    for (long i = 0; i < (long)n * out; i++) {
                        float t = y2[i];
                        if (with_add) t = t + a[i];
                        const float want = p0[i] + t;
                        bad += memcmp(&want, &p[i], sizeof want) != 0;
                    }
                    CHECK_MSG(bad == 0, "%s: into (add %d): %ld of %d outputs differ from the separate adds", what,
                              with_add, bad, n * out);
                    CHECK(guards_ok(&o3));
                    free(p0), free(a), free(p);
                }
            free(y2);
        }
        /* bf16 x through the skinny kernel at any out: the same bits as lunar_cuda_matmul's */
        guarded o4;
        void *dy4 = guarded_new(&o4, (size_t)n * out * (dt ? 2 : 4));
        const int took4 = lunar_cuda_matmul_bf16x(dy4, dt ? LUNAR_CUDA_BF16 : LUNAR_CUDA_F32, dx, dw, n, out, in, NULL);
        CHECK(took4 == took);
        if (took4 == 0) {
            float *y4 = dt ? down_bf16(dy4, (long)n * out) : down_f32(dy4, (long)n * out);
            CHECK_MSG(memcmp(y4, y, (size_t)n * out * sizeof *y) == 0, "%s: bf16x entry differs", what);
            CHECK(guards_ok(&o4));
            free(y4);
        }
        free(xr), free(y);
    }
    test_tensor_free(&W);
    free(x), free(w), free(ref), free(xb);
    lunar_cuda_release(mark);
}

TEST(cuda_matmul_bf16_vs_cpu) {
    if (!cuda_on()) return;
    /* n <= 2 takes the CUDA-core skinny kernel (cuda_gemm.cu): few outputs (split over warps) and many;
     * 3..16 (by default) the tensor-core one: rows past a 16-row group (out % 16), columns past
     * a 64-column step (in % 64), token tiles past n, splits of 1..16 warps (few and many row groups,
     * short and long rows); the rest cuBLASLt. Every shape with the default range, with the tensor-core
     * kernel for every n <= 32 (n = 1, 2 and 17..32 too), and with it off (n <= 4 the CUDA-core kernel) */
    static const int shapes[][3] = {{1, 4096, 2304},  {64, 2304, 4096}, {33, 1000, 64},  {7, 129, 200},
                                    {8, 300, 2304},   {3, 256, 9216},   {2, 9000, 512},  {4, 520, 1024},
                                    {1, 1036, 512},   {2, 12, 4096},    {12, 4876, 7168}, {16, 520, 1024},
                                    {9, 1664, 512},   {24, 200, 136},   {32, 100, 2304}, {13, 7, 72},
                                    {4, 3, 40},       {5, 3, 40}}; /* odd ones last */
    int lo0, hi0;
    lunar_cuda_gemv_mma_range(3, 16, &lo0, &hi0);
    static const int ranges[][2] = {{3, 16}, {1, 32}, {1, 0}};
    for (int r = 0; r < 3; r++) {
        lunar_cuda_gemv_mma_range(ranges[r][0], ranges[r][1], NULL, NULL);
        for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            matmul_case(shapes[s][0], shapes[s][1], shapes[s][2], s, ranges[r][0], ranges[r][1]);
    }
    lunar_cuda_gemv_mma_range(lo0, hi0, NULL, NULL);
}

/* The forward's GEMM use in isolation: multi-token (n > 1) prefill shapes of the tiny goldens
 * (small, multiple-of-8 widths, odd token counts), more shapes than the 128-entry plan cache holds
 * (so plans are recycled), each against the CPU op on bf16-exact operands, through cuBLASLt and
 * through the generic glue GEMM; then the first shapes again, on recycled plans. */
TEST(cuda_matmul_prefill_shapes_vs_cpu) {
    if (!cuda_on()) return;
    static const int widths[] = {8, 16, 40, 48, 56, 64, 96, 128}, toks[] = {2, 7, 67, 83, 97, 129};
    const int nw = (int)(sizeof widths / sizeof widths[0]), nt = (int)(sizeof toks / sizeof toks[0]);
    double worst = 0;
    int runs = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int a = 0; a < nw; a++)
            for (int b = 0; b < nw; b++)
                for (int t = 0; t < nt; t++) {
                    if (pass == 1 && (a > 1 || b > 1)) continue; /* again: the first shapes */
                    const int out = widths[a], in = widths[b], n = toks[t];
                    size_t mark = lunar_cuda_mark();
                    const unsigned seed = 1000u + (unsigned)(((pass * nw + a) * nw + b) * nt + t);
                    float *x = test_rand((long)n * in, seed, -1, 1), *w = test_rand((long)out * in, seed + 7, -0.5f, 0.5f);
                    round_bf16(x, (long)n * in);
                    lunar_tensor W = test_tensor2(LUNAR_DTYPE_BF16, out, in, w);
                    float *ref = test_poisoned((long)n * out);
                    op_matmul(ref, x, &W, n);
                    uint16_t *xb = to_bf16(x, (long)n * in);
                    const uint16_t *dx = dev_in(xb, (size_t)n * in * 2), *dw = dev_in(W.data, W.nbytes);
                    for (int glue = 0; glue < 2; glue++) {
                        guarded o;
                        float *dy = guarded_new(&o, (size_t)n * out * 4);
                        if (glue)
                            lunar_glue_matmul(dy, dx, dw, n, out, in, NULL);
                        else
                            lunar_cuda_matmul(dy, LUNAR_CUDA_F32, dx, dw, n, out, in, NULL);
                        float *y = down_f32(dy, (long)n * out);
                        double e = lunar_max_rel_err(y, ref, (long)n * out);
                        if (e > worst) worst = e;
                        CHECK_MSG(e <= 1e-4, "%s n=%d out=%d in=%d (pass %d): max rel err %.3g",
                                  glue ? "glue matmul" : "cuBLASLt matmul", n, out, in, pass, e);
                        CHECK(guards_ok(&o));
                        free(y);
                        runs++;
                    }
                    test_tensor_free(&W);
                    free(x), free(w), free(ref), free(xb);
                    lunar_cuda_release(mark);
                }
    report("matmul prefill shapes (cuBLASLt + glue)", worst, 1e-4);
    CHECK(runs > 2 * 128);
}

/* ---------------------------------------------------------------- embedding, norms, GLU */

TEST(cuda_embedding_vs_cpu) {
    if (!cuda_on()) return;
    const int V = 1000, dim = 2304, n = 9;
    size_t mark = lunar_cuda_mark();
    float *e = test_rand((long)V * dim, 3, -1, 1);
    lunar_tensor E = test_tensor2(LUNAR_DTYPE_BF16, V, dim, e);
    int32_t ids[9] = {0, 999, 5, 5, 17, 123, 998, 1, 0};
    float *ref = test_poisoned((long)n * dim);
    op_embedding(ref, &E, ids, n);
    const uint16_t *dE = dev_in(E.data, E.nbytes);
    const int32_t *di = dev_in(ids, sizeof ids);
    for (int dt = 0; dt < 2; dt++) {
        guarded o;
        void *dy = guarded_new(&o, (size_t)n * dim * (dt ? 2 : 4));
        lunar_cuda_embedding(dy, dt ? LUNAR_CUDA_BF16 : LUNAR_CUDA_F32, dE, di, n, dim, NULL);
        float *y = dt ? down_bf16(dy, (long)n * dim) : down_f32(dy, (long)n * dim);
        report(dt ? "embedding bf16 (exact)" : "embedding f32 (exact)", lunar_max_rel_err(y, ref, (long)n * dim), 0.0);
        CHECK(guards_ok(&o));
        free(y);
    }
    test_tensor_free(&E);
    free(e), free(ref);
    lunar_cuda_release(mark);
}

/* Tensor parallelism's vocabulary-parallel embedding: each rank's slice of rows looked up, zeros
 * for the ids of the other ranks (ids below, inside and above the slice, and both ends of it);
 * the reference is op_embedding on the whole table with the other ranks' rows zeroed, and the
 * ranks' outputs summed must give the whole embedding exactly. */
TEST(cuda_embedding_range_vs_cpu) {
    if (!cuda_on()) return;
    const int V = 1000, dim = 640, n = 10, slices[3][2] = {{0, 334}, {334, 334}, {668, 332}};
    size_t mark = lunar_cuda_mark();
    float *e = test_rand((long)V * dim, 5, -1, 1);
    lunar_tensor E = test_tensor2(LUNAR_DTYPE_BF16, V, dim, e);
    int32_t ids[10] = {0, 999, 333, 334, 667, 668, 5, 500, 998, 334};
    float *full = test_poisoned((long)n * dim), *sum = calloc((size_t)n * dim, sizeof *sum);
    op_embedding(full, &E, ids, n);
    const uint16_t *dE = dev_in(E.data, E.nbytes);
    const int32_t *di = dev_in(ids, sizeof ids);
    for (int r = 0; r < 3; r++) {
        const int v0 = slices[r][0], vn = slices[r][1];
        float *ref = test_poisoned((long)n * dim);
        for (int t = 0; t < n; t++) {
            const int mine = ids[t] >= v0 && ids[t] < v0 + vn;
            for (int i = 0; i < dim; i++) ref[(size_t)t * dim + i] = mine ? full[(size_t)t * dim + i] : 0.0f;
        }
        guarded o;
        float *dy = guarded_new(&o, (size_t)n * dim * 4);
        lunar_cuda_embedding_range(dy, dE + (size_t)v0 * dim, di, n, dim, v0, vn, NULL);
        float *y = down_f32(dy, (long)n * dim);
        report("embedding, one rank's vocabulary slice (exact)", lunar_max_rel_err(y, ref, (long)n * dim), 0.0);
        CHECK(guards_ok(&o));
        for (size_t i = 0; i < (size_t)n * dim; i++) sum[i] += y[i];
        free(y), free(ref);
    }
    report("embedding, the ranks' slices summed (exact)", lunar_max_rel_err(sum, full, (long)n * dim), 0.0);
    test_tensor_free(&E);
    free(e), free(full), free(sum);
    lunar_cuda_release(mark);
}

/* The strided device copy (the reorder of the gathered vocabulary slices into [rows, V]): rows of
 * `width` bytes from one pitch to another, against the same copy on the host; the bytes between
 * the destination's rows must stay as they were. */
TEST(cuda_copy_2d_vs_host) {
    if (!cuda_on()) return;
    const size_t rows = 7, spitch = 52 * 4, dpitch = 131 * 4, width = 49 * 4;
    size_t mark = lunar_cuda_mark();
    float *src = test_rand((long)(rows * spitch / 4), 11, -1, 1), *dst = test_rand((long)(rows * dpitch / 4), 12, -1, 1);
    float *ref = malloc(rows * dpitch);
    memcpy(ref, dst, rows * dpitch);
    for (size_t r = 0; r < rows; r++) memcpy((char *)ref + r * dpitch + 40, (char *)src + r * spitch, width);
    const void *ds = dev_in(src, rows * spitch);
    float *dd = lunar_cuda_alloc(rows * dpitch);
    CHECK(dd != NULL);
    lunar_cuda_upload(dd, dst, rows * dpitch);
    lunar_cuda_copy_2d((char *)dd + 40, dpitch, ds, spitch, width, rows);
    float *y = down_f32(dd, (long)(rows * dpitch / 4));
    report("copy_2d (exact)", lunar_max_rel_err(y, ref, (long)(rows * dpitch / 4)), 0.0);
    free(src), free(dst), free(ref), free(y);
    lunar_cuda_release(mark);
}

/* lunar_cuda_f32_to_bf16 bit for bit against the CPU's rounding (round to nearest even), through
 * the vector kernel (16-byte aligned ends, n >= 8: its n % 8 tail included) and the scalar one
 * (an end off by one float, n < 8); the inputs include ties, halfway-plus-one patterns, subnormals,
 * infinities and bf16's overflow to infinity */
TEST(cuda_f32_to_bf16_vs_cpu) {
    if (!cuda_on()) return;
    static const long sizes[] = {1, 7, 8, 9, 31, 4099, 8 * 70001 + 5};
    for (unsigned s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        for (int shift = 0; shift < 2; shift++) {
            const long n = sizes[s];
            size_t mark = lunar_cuda_mark();
            float *x = test_rand(n + 1, 170 + s, -3e3f, 3e3f);
            static const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x00000001u, 0x807fffffu,
                                               0x7f800000u, 0xff800000u, 0x7f7fffffu, 0x80000000u, 0x3f80ffffu};
            for (long i = 0; i < n + 1; i += 3) memcpy(&x[i], &special[(i / 3) % 10], 4);
            const float *dx = (const float *)dev_in(x, (size_t)(n + 1) * 4) + shift;
            guarded o;
            uint16_t *db = guarded_new(&o, (size_t)(n + 1) * 2);
            lunar_cuda_f32_to_bf16(db + shift, dx, (size_t)n);
            uint16_t *hb = malloc((size_t)(n + 1) * 2);
            lunar_cuda_sync();
            lunar_cuda_download(hb, db + shift, (size_t)n * 2);
            long bad = 0, first = -1;
            for (long i = 0; i < n; i++)
                if (hb[i] != lunar_f32_to_bf16(x[i + shift]) && bad++ == 0) first = i;
            CHECK_MSG(bad == 0, "f32_to_bf16 n=%ld shift=%d: %ld elements differ (first %ld)", n, shift, bad, first);
            CHECK(guards_ok(&o));
            free(x), free(hb);
            lunar_cuda_release(mark);
        }
}

/* the fused residual add + RMSNorm against the CPU composition (x + r, then op_rmsnorm), and bit
 * for bit against the device's two launches it replaces (lunar_glue_add, lunar_cuda_rmsnorm) */
TEST(cuda_add_rmsnorm_vs_cpu) {
    if (!cuda_on()) return;
    /* the vector kernel (dim % 4 == 0, <= 8192): 2304 (Kimi-Linear: 192 threads of 3 float4), 7168
     * (K3), 2052 (the last warp partly idle), 8192 (8 float4 a thread); the block kernels: 33, 8196 */
    static const int shapes[][2] = {{1, 2304}, {5, 128}, {3, 7168}, {17, 33}, {2, 2052}, {2, 8192}, {2, 8196}};
    for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int n = shapes[s][0], dim = shapes[s][1];
        const long N = (long)n * dim;
        size_t mark = lunar_cuda_mark();
        float *x = test_rand(N, 140 + s, -3, 3), *r = test_rand(N, 150 + s, -3, 3);
        float *wv = test_rand(dim, 160 + s, 0.5f, 1.5f);
        lunar_tensor w = test_tensor1(LUNAR_DTYPE_BF16, dim, wv);
        float *sum = test_alloc(N), *ref = test_poisoned(N);
        for (long i = 0; i < N; i++) sum[i] = x[i] + r[i];
        op_rmsnorm(ref, sum, &w, n, dim, 1e-5f);
        const float *dr = dev_in(r, N * 4);
        const uint16_t *dw = dev_in(w.data, w.nbytes);
        float *dx = (float *)dev_in(x, N * 4), *dx2 = (float *)dev_in(x, N * 4);
        guarded o1, o2;
        float *y1 = guarded_new(&o1, N * 4), *y2 = guarded_new(&o2, N * 4);
        lunar_cuda_add_rmsnorm(y1, LUNAR_CUDA_F32, dx, dr, dw, n, dim, 1e-5f, NULL);
        lunar_glue_add(dx2, dr, (size_t)N, NULL);
        lunar_cuda_rmsnorm(y2, LUNAR_CUDA_F32, dx2, dw, n, dim, 1e-5f, NULL);
        float *h1 = down_f32(y1, N), *h2 = down_f32(y2, N), *xs = down_f32(dx, N);
        char what[96];
        snprintf(what, sizeof what, "add_rmsnorm n=%d dim=%d", n, dim);
        report(what, lunar_max_rel_err(h1, ref, N), 1e-5);
        CHECK_MSG(memcmp(xs, sum, (size_t)N * 4) == 0, "%s: x + r not stored exactly", what);
        CHECK_MSG(memcmp(h1, h2, (size_t)N * 4) == 0, "%s: differs from add + rmsnorm", what);
        CHECK(guards_ok(&o1) && guards_ok(&o2));
        /* the form with the bf16 copy: y as above, the copy as lunar_cuda_f32_to_bf16 of y */
        float *dx3 = (float *)dev_in(x, N * 4);
        guarded o3, o4, o5;
        float *y3 = guarded_new(&o3, N * 4);
        uint16_t *b3 = guarded_new(&o4, N * 2), *b2 = guarded_new(&o5, N * 2);
        lunar_cuda_add_rmsnorm_b(y3, b3, dx3, dr, dw, n, dim, 1e-5f, NULL);
        lunar_cuda_f32_to_bf16(b2, y2, (size_t)N);
        float *h3 = down_f32(y3, N);
        uint16_t *hb3 = malloc((size_t)N * 2), *hb2 = malloc((size_t)N * 2);
        lunar_cuda_sync();
        lunar_cuda_download(hb3, b3, (size_t)N * 2);
        lunar_cuda_download(hb2, b2, (size_t)N * 2);
        CHECK_MSG(memcmp(h3, h2, (size_t)N * 4) == 0, "%s: add_rmsnorm_b's y differs", what);
        CHECK_MSG(memcmp(hb3, hb2, (size_t)N * 2) == 0, "%s: add_rmsnorm_b's bf16 copy differs", what);
        CHECK(guards_ok(&o3) && guards_ok(&o4) && guards_ok(&o5));
        /* y = NULL: x and the bf16 copy alone, the same bits as with y */
        float *dx4 = (float *)dev_in(x, N * 4);
        guarded o6;
        uint16_t *b4 = guarded_new(&o6, N * 2);
        lunar_cuda_add_rmsnorm_b(NULL, b4, dx4, dr, dw, n, dim, 1e-5f, NULL);
        float *xs4 = down_f32(dx4, N);
        lunar_cuda_sync();
        lunar_cuda_download(hb3, b4, (size_t)N * 2);
        CHECK_MSG(memcmp(hb3, hb2, (size_t)N * 2) == 0, "%s: add_rmsnorm_b(y NULL)'s bf16 copy differs", what);
        CHECK_MSG(memcmp(xs4, sum, (size_t)N * 4) == 0, "%s: add_rmsnorm_b(y NULL): x + r not stored exactly", what);
        CHECK(guards_ok(&o6));
        free(xs4);
        free(h3), free(hb3), free(hb2);
        test_tensor_free(&w);
        free(x), free(r), free(wv), free(sum), free(ref), free(h1), free(h2), free(xs);
        lunar_cuda_release(mark);
    }
}

TEST(cuda_norms_vs_cpu) {
    if (!cuda_on()) return;
    /* {5, 128}, {33, 256}, {9, 512}: the warp-per-row kernel of the gated and L2 norms (V = 1, 2, 4; rows
     * not a multiple of its 8 per block) */
    static const int shapes[][2] = {{1, 2304}, {5, 128}, {3, 7168}, {17, 33}, {64, 4096}, {2, 2052}, {33, 256}, {9, 512}};
    for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int n = shapes[s][0], dim = shapes[s][1];
        const long N = (long)n * dim;
        size_t mark = lunar_cuda_mark();
        float *x = test_rand(N, 40 + s, -3, 3), *gate = test_rand(N, 50 + s, -4, 4);
        float *wv = test_rand(dim, 60 + s, 0.5f, 1.5f);
        lunar_tensor w = test_tensor1(LUNAR_DTYPE_BF16, dim, wv);
        float *r1 = test_poisoned(N), *r1n = test_poisoned(N), *r2 = test_poisoned(N), *r3 = test_poisoned(N);
        op_rmsnorm(r1, x, &w, n, dim, 1e-5f);
        op_rmsnorm(r1n, x, NULL, n, dim, 1e-6f);
        op_rmsnorm_gated(r2, x, gate, &w, n, dim, 1e-5f);
        op_l2norm(r3, x, n, dim, 1e-6f);
        const float *dx = dev_in(x, N * 4), *dg = dev_in(gate, N * 4);
        const uint16_t *dw = dev_in(w.data, w.nbytes);
        for (int dt = 0; dt < 2; dt++) {
            const lunar_cuda_dtype ty = dt ? LUNAR_CUDA_BF16 : LUNAR_CUDA_F32;
            const double tol = dt ? 5e-3 : 1e-5;
            const size_t eb = dt ? 2 : 4;
            guarded o1, o2, o3, o4;
            void *y1 = guarded_new(&o1, N * eb), *y2 = guarded_new(&o2, N * eb), *y4 = guarded_new(&o4, N * eb);
            float *y3 = guarded_new(&o3, N * 4);
            lunar_cuda_rmsnorm(y1, ty, dx, dw, n, dim, 1e-5f, NULL);
            lunar_cuda_rmsnorm_gated(y2, ty, dx, dg, dw, n, dim, 1e-5f, NULL);
            lunar_cuda_rmsnorm(y4, ty, dx, NULL, n, dim, 1e-6f, NULL);
            lunar_cuda_l2norm(y3, dx, n, dim, 1e-6f, NULL);
            float *h1 = dt ? down_bf16(y1, N) : down_f32(y1, N);
            float *h2 = dt ? down_bf16(y2, N) : down_f32(y2, N);
            float *h4 = dt ? down_bf16(y4, N) : down_f32(y4, N);
            float *h3 = down_f32(y3, N);
            char what[96];
            snprintf(what, sizeof what, "rmsnorm n=%d dim=%d %s", n, dim, dt ? "bf16" : "f32");
            report(what, lunar_max_rel_err(h1, r1, N), tol);
            snprintf(what, sizeof what, "rmsnorm (no weight) n=%d dim=%d %s", n, dim, dt ? "bf16" : "f32");
            report(what, lunar_max_rel_err(h4, r1n, N), tol);
            snprintf(what, sizeof what, "rmsnorm_gated n=%d dim=%d %s", n, dim, dt ? "bf16" : "f32");
            report(what, lunar_max_rel_err(h2, r2, N), tol);
            snprintf(what, sizeof what, "l2norm n=%d dim=%d", n, dim);
            report(what, lunar_max_rel_err(h3, r3, N), 1e-5);
            CHECK(guards_ok(&o1) && guards_ok(&o2) && guards_ok(&o3) && guards_ok(&o4));
            free(h1), free(h2), free(h3), free(h4);
        }
        test_tensor_free(&w);
        free(x), free(gate), free(wv), free(r1), free(r1n), free(r2), free(r3);
        lunar_cuda_release(mark);
    }
}

TEST(cuda_glu_vs_cpu) {
    if (!cuda_on()) return;
    static const long sizes[] = {1, 1000, 100003};
    for (unsigned s = 0; s < 3; s++) {
        const long n = sizes[s];
        size_t mark = lunar_cuda_mark();
        float *g = test_rand(n, 70 + s, -30, 30), *u = test_rand(n, 80 + s, -40, 40);
        float *r1 = test_poisoned(n), *r2 = test_poisoned(n), *r3 = test_poisoned(n);
        op_silu_mul(r1, g, u, n);
        op_situ_mul(r2, g, u, n, 4.0f, 25.0f);
        op_situ_mul(r3, g, u, n, 4.0f, 0.0f);
        const float *dg = dev_in(g, n * 4), *du = dev_in(u, n * 4);
        for (int dt = 0; dt < 2; dt++) {
            const lunar_cuda_dtype ty = dt ? LUNAR_CUDA_BF16 : LUNAR_CUDA_F32;
            const size_t eb = dt ? 2 : 4;
            guarded o1, o2, o3;
            void *y1 = guarded_new(&o1, n * eb), *y2 = guarded_new(&o2, n * eb), *y3 = guarded_new(&o3, n * eb);
            lunar_cuda_silu_mul(y1, ty, dg, du, n, NULL);
            lunar_cuda_situ_mul(y2, ty, dg, du, n, 4.0f, 25.0f, NULL);
            lunar_cuda_situ_mul(y3, ty, dg, du, n, 4.0f, 0.0f, NULL);
            float *h1 = dt ? down_bf16(y1, n) : down_f32(y1, n);
            float *h2 = dt ? down_bf16(y2, n) : down_f32(y2, n);
            float *h3 = dt ? down_bf16(y3, n) : down_f32(y3, n);
            const double tol = dt ? 5e-3 : 1e-5;
            char what[96];
            snprintf(what, sizeof what, "silu_mul n=%ld %s", n, dt ? "bf16" : "f32");
            report(what, lunar_max_rel_err(h1, r1, n), tol);
            snprintf(what, sizeof what, "situ_mul n=%ld %s", n, dt ? "bf16" : "f32");
            report(what, lunar_max_rel_err(h2, r2, n), tol);
            snprintf(what, sizeof what, "situ_mul (no beta_l) n=%ld %s", n, dt ? "bf16" : "f32");
            report(what, lunar_max_rel_err(h3, r3, n), tol);
            CHECK(guards_ok(&o1) && guards_ok(&o2) && guards_ok(&o3));
            free(h1), free(h2), free(h3);
        }
        free(g), free(u), free(r1), free(r2), free(r3);
        lunar_cuda_release(mark);
    }
}

/* ---------------------------------------------------------------- short conv, gate */

TEST(cuda_short_conv_vs_cpu) {
    if (!cuda_on()) return;
    static const int shapes[][3] = {{1, 12288, 4}, {2, 37, 4}, {5, 64, 4}, {300, 129, 4}, {7, 10, 1}, {3, 33, 3}};
    for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int T = shapes[s][0], C = shapes[s][1], K = shapes[s][2], S = K - 1;
        size_t mark = lunar_cuda_mark();
        float *x = test_rand((long)T * C, 90 + s, -2, 2), *w = test_rand((long)C * K, 91 + s, -1, 1);
        float *st = test_rand((long)C * S, 92 + s, -1, 1);
        lunar_tensor W = test_tensor2(LUNAR_DTYPE_F32, C, K, w);
        float *ref = test_poisoned((long)T * C), *st_ref = test_alloc((long)C * S);
        memcpy(st_ref, st, sizeof(float) * C * S);
        op_short_conv(ref, x, &W, st_ref, T, C, K);
        const float *dx = dev_in(x, (size_t)T * C * 4), *dw = dev_in(w, (size_t)C * K * 4);
        float *dst = dev_in(st, (size_t)C * S * 4);
        guarded o;
        float *dy = guarded_new(&o, (size_t)T * C * 4);
        lunar_cuda_short_conv(dy, dx, dw, dst, T, C, K, NULL);
        float *y = down_f32(dy, (long)T * C), *st2 = down_f32(dst, (long)C * S);
        char what[96];
        snprintf(what, sizeof what, "short_conv T=%d C=%d K=%d", T, C, K);
        report(what, lunar_max_rel_err(y, ref, (long)T * C), 1e-5);
        CHECK_MSG(S == 0 || memcmp(st2, st_ref, sizeof(float) * C * S) == 0, "%s: state differs", what);
        CHECK(guards_ok(&o));
        free(x), free(w), free(st), free(ref), free(st_ref), free(y), free(st2);
        test_tensor_free(&W);
        lunar_cuda_release(mark);
    }
}

TEST(cuda_short_conv_decode_slots_vs_cpu) {
    if (!cuda_on()) return;
    const int B = 5, C = 4096 + 37, K = 4, S = K - 1, NS = 8;
    const int32_t slots[5] = {6, 0, 3, 7, 2};
    size_t mark = lunar_cuda_mark();
    float *x = test_rand((long)B * C, 1, -2, 2), *w = test_rand((long)C * K, 2, -1, 1);
    float *pool = test_rand((long)NS * C * S, 3, -1, 1), *pool_ref = test_alloc((long)NS * C * S);
    memcpy(pool_ref, pool, sizeof(float) * NS * C * S);
    lunar_tensor W = test_tensor2(LUNAR_DTYPE_F32, C, K, w);
    float *ref = test_poisoned((long)B * C);
    for (int b = 0; b < B; b++)
        op_short_conv(ref + (long)b * C, x + (long)b * C, &W, pool_ref + (long)slots[b] * C * S, 1, C, K);
    const float *dx = dev_in(x, (size_t)B * C * 4), *dw = dev_in(w, (size_t)C * K * 4);
    float *dpool = dev_in(pool, (size_t)NS * C * S * 4);
    const int32_t *dsl = dev_in(slots, sizeof slots);
    guarded o;
    float *dy = guarded_new(&o, (size_t)B * C * 4);
    lunar_cuda_short_conv_decode(dy, dx, dw, dpool, dsl, B, C, K, NULL);
    float *y = down_f32(dy, (long)B * C), *p2 = down_f32(dpool, (long)NS * C * S);
    report("short_conv_decode B=5 C=4133 (slots)", lunar_max_rel_err(y, ref, (long)B * C), 1e-5);
    CHECK_MSG(memcmp(p2, pool_ref, sizeof(float) * NS * C * S) == 0, "state pool differs (slots)");
    CHECK(guards_ok(&o));
    free(x), free(w), free(pool), free(pool_ref), free(ref), free(y), free(p2);
    test_tensor_free(&W);
    lunar_cuda_release(mark);
}

/* the fused decode launch of KDA's q|k|v convolutions, L2 norms and beta sigmoid: bit-equal to the
 * three ops it replaces (on a strided input, as the fused projection's output row), and the CPU */
TEST(cuda_kda_conv_qkv_decode_matches_ops) {
    if (!cuda_on()) return;
    const int B = 3, H = 5, dk = 128, HD = H * dk, C = 3 * HD, K = 4, S = K - 1, NS = 6, xs = C + H + 40;
    const int32_t slots[3] = {4, 0, 2};
    size_t mark = lunar_cuda_mark();
    float *x = test_rand((long)B * xs, 11, -2, 2), *w = test_rand((long)C * K, 12, -1, 1);
    float *pool = test_rand((long)NS * C * S, 13, -1, 1), *pool_ref = test_alloc((long)NS * C * S);
    memcpy(pool_ref, pool, sizeof(float) * NS * C * S);
    /* CPU: conv per sequence, then the norms of the q and k head rows, the sigmoid */
    lunar_tensor W = test_tensor2(LUNAR_DTYPE_F32, C, K, w);
    float *ref = test_alloc((long)B * C), *bref = test_alloc((long)B * H);
    for (int b = 0; b < B; b++) {
        op_short_conv(ref + (long)b * C, x + (long)b * xs, &W, pool_ref + (long)slots[b] * C * S, 1, C, K);
        op_l2norm(ref + (long)b * C, ref + (long)b * C, 2 * H, dk, 1e-6f);
        for (int i = 0; i < H; i++) bref[b * H + i] = 1.0f / (1.0f + expf(-x[(long)b * xs + C + i]));
    }
    float *refp = test_alloc((long)B * C); /* [part][b][HD] as the kernel lays it out */
    for (int b = 0; b < B; b++)
        for (int p = 0; p < 3; p++) memcpy(refp + ((long)p * B + b) * HD, ref + (long)b * C + p * HD, sizeof(float) * HD);
    const float *dx = dev_in(x, (size_t)B * xs * 4), *dw = dev_in(w, (size_t)C * K * 4);
    float *dpool = dev_in(pool, (size_t)NS * C * S * 4), *dpool2 = dev_in(pool, (size_t)NS * C * S * 4);
    const int32_t *dsl = dev_in(slots, sizeof slots);
    guarded o, ob;
    float *dy = guarded_new(&o, (size_t)B * C * 4), *dbeta = guarded_new(&ob, (size_t)B * H * 4);
    lunar_cuda_kda_conv_qkv_decode(dy, dbeta, dx, dx + C, xs, dw, dpool, dsl, B, H, dk, K, 1e-6f, NULL);
    float *y = down_f32(dy, (long)B * C), *beta = down_f32(dbeta, (long)B * H), *p2 = down_f32(dpool, (long)NS * C * S);
    report("kda_conv_qkv_decode B=3 H=5 vs CPU", lunar_max_rel_err(y, refp, (long)B * C), 1e-5);
    report("kda_conv_qkv_decode beta vs CPU", lunar_max_rel_err(beta, bref, (long)B * H), 1e-6);
    CHECK_MSG(memcmp(p2, pool_ref, sizeof(float) * NS * C * S) == 0, "state pool differs");
    CHECK(guards_ok(&o) && guards_ok(&ob));
    /* the unfused ops, per part as kda_layer ran them (contiguous x rows, the state per part) */
    float *cx = test_alloc((long)B * C), *bx = test_alloc((long)B * H);
    for (int b = 0; b < B; b++) {
        memcpy(cx + (long)b * C, x + (long)b * xs, sizeof(float) * C);
        memcpy(bx + (long)b * H, x + (long)b * xs + C, sizeof(float) * H);
    }
    int32_t sl3[3];
    for (int b = 0; b < B; b++) sl3[b] = slots[b] * 3;
    const int32_t *dsl3 = dev_in(sl3, sizeof sl3);
    float *y2 = lunar_cuda_alloc((size_t)B * C * 4), *pre = lunar_cuda_alloc((size_t)B * HD * 4);
    float *db2 = dev_in(bx, (size_t)B * H * 4);
    for (int p = 0; p < 3; p++) {
        float *px = test_alloc((long)B * HD);
        for (int b = 0; b < B; b++) memcpy(px + (long)b * HD, cx + (long)b * C + p * HD, sizeof(float) * HD);
        lunar_cuda_upload(pre, px, (size_t)B * HD * 4);
        lunar_cuda_short_conv_decode(y2 + (size_t)p * B * HD, pre, dw + (size_t)p * HD * K, dpool2 + (size_t)p * HD * S,
                                     dsl3, B, HD, K, NULL);
        free(px);
    }
    lunar_cuda_l2norm(y2, y2, 2 * B * H, dk, 1e-6f, NULL);
    lunar_cuda_sigmoid_inplace(db2, (size_t)B * H);
    float *y3 = down_f32(y2, (long)B * C), *b3 = down_f32(db2, (long)B * H);
    CHECK_MSG(memcmp(y, y3, sizeof(float) * B * C) == 0, "fused q|k|v differ from the three ops");
    CHECK_MSG(memcmp(beta, b3, sizeof(float) * B * H) == 0, "fused beta differs from the sigmoid op");
    free(x), free(w), free(pool), free(pool_ref), free(ref), free(bref), free(refp), free(y), free(beta), free(p2);
    free(cx), free(bx), free(y3), free(b3);
    test_tensor_free(&W);
    lunar_cuda_release(mark);
}

/* the fused prefill pass after the KDA input projection (lunar_cuda_kda_conv_qkv_prefill) vs the
 * CPU ops it replaces, on the projection's strided rows: op_short_conv of q, k, v with the state
 * (read, then advanced: compared bit for bit), op_l2norm of the q and k head rows (1e-5: the conv
 * sums are the same fp32 expressions, the norm's sum another tree), sigmoid (1e-6), the bf16 copies
 * of the two low-rank inputs (bit-equal: both round to nearest even). T odd, below the K - 1 taps
 * taken from the state, across the 64-token tiles of the old kernel and the default one's 256-token
 * blocks of 32-token warp runs (K = 4; 128 / 16 for other K): T = 300 a whole block, a partial one and
 * a partial warp run; H odd; K 1, 3, 4
 * (the default kernel's K = 4 instantiation and its generic one); low-rank widths multiples of 4
 * (its 16-byte copies) and odd (its scalar ones). The default kernel, the old one's cp.async staging
 * and its plain staging (LUNAR_KDA_CONV=old, LUNAR_KDA_CONV_ASYNC=0) are then compared bit for bit. */
TEST(cuda_kda_conv_qkv_prefill_vs_cpu) {
    if (!cuda_on()) return;
    static const int shapes[][5] = {{200, 3, 4, 24, 40}, {37, 2, 4, 21, 37}, {2, 1, 4, 24, 40}, {129, 2, 3, 24, 40},
                                    {64, 1, 1, 8, 4},    {300, 2, 4, 128, 128}}; /* T, H, K, a_w, g_w */
    for (unsigned si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int T = shapes[si][0], H = shapes[si][1], K = shapes[si][2], dk = 128, HD = H * dk, C = 3 * HD;
        const int S = K - 1, aw = shapes[si][3], gw = shapes[si][4], a_off = C, g_off = C + aw, b_off = g_off + gw;
        const int xs = (b_off + H + 3) / 4 * 4 + 4;
        size_t mark = lunar_cuda_mark();
        float *x = test_rand((long)T * xs, 300 + si, -2, 2), *w = test_rand((long)C * K, 310 + si, -1, 1);
        float *st = test_rand((long)C * S + 1, 320 + si, -1, 1), *st_ref = test_alloc((long)C * S + 1);
        memcpy(st_ref, st, sizeof(float) * ((size_t)C * S + 1));
        float *ref = test_alloc((long)3 * T * HD), *bref = test_alloc((long)T * H);
        float *px = test_alloc((long)T * HD);
        for (int p = 0; p < 3; p++) { /* [part][T][HD] */
            for (int t = 0; t < T; t++) memcpy(px + (long)t * HD, x + (long)t * xs + p * HD, sizeof(float) * HD);
            lunar_tensor W = test_tensor2(LUNAR_DTYPE_F32, HD, K, w + (long)p * HD * K);
            op_short_conv(ref + (long)p * T * HD, px, &W, st_ref + (long)p * HD * S, T, HD, K);
            test_tensor_free(&W);
        }
        op_l2norm(ref, ref, 2 * T * H, dk, 1e-6f);
        for (int t = 0; t < T; t++)
            for (int i = 0; i < H; i++) bref[t * H + i] = 1.0f / (1.0f + expf(-x[(long)t * xs + b_off + i]));
        const float *dx = dev_in(x, (size_t)T * xs * 4), *dw = dev_in(w, (size_t)C * K * 4);
        float *dst = dev_in(st, ((size_t)C * S + 1) * 4);
        guarded oq, ok, ov, ob, oa, og;
        float *dq = guarded_new(&oq, (size_t)T * HD * 4), *dk_ = guarded_new(&ok, (size_t)T * HD * 4);
        float *dv = guarded_new(&ov, (size_t)T * HD * 4), *db = guarded_new(&ob, (size_t)T * H * 4);
        uint16_t *da = guarded_new(&oa, (size_t)T * aw * 2), *dg = guarded_new(&og, (size_t)T * gw * 2);
        lunar_cuda_kda_conv_qkv_prefill(dq, dk_, dv, db, da, dg, dx, xs, a_off, aw, g_off, gw, b_off, dw, dst, T, H,
                                        dk, K, 1e-6f, NULL);
        char what[96];
        const char *nm[3] = {"q", "k", "v"};
        float *outs[3] = {dq, dk_, dv};
        for (int p = 0; p < 3; p++) {
            float *y = down_f32(outs[p], (long)T * HD);
            snprintf(what, sizeof what, "kda_conv_qkv_prefill %s T=%d H=%d K=%d", nm[p], T, H, K);
            report(what, lunar_max_rel_err(y, ref + (long)p * T * HD, (long)T * HD), 1e-5);
            free(y);
        }
        float *beta = down_f32(db, (long)T * H), *st2 = down_f32(dst, (long)C * S + 1);
        snprintf(what, sizeof what, "kda_conv_qkv_prefill beta T=%d H=%d", T, H);
        report(what, lunar_max_rel_err(beta, bref, (long)T * H), 1e-6);
        CHECK_MSG(memcmp(st2, st_ref, sizeof(float) * ((size_t)C * S + 1)) == 0, "T=%d K=%d: conv state differs", T,
                  K);
        uint16_t *ha = malloc((size_t)T * aw * 2), *hg = malloc((size_t)T * gw * 2);
        lunar_cuda_sync();
        lunar_cuda_download(ha, da, (size_t)T * aw * 2), lunar_cuda_download(hg, dg, (size_t)T * gw * 2);
        int bad = 0;
        for (int t = 0; t < T; t++) {
            for (int j = 0; j < aw; j++) bad += ha[t * aw + j] != lunar_f32_to_bf16(x[(long)t * xs + a_off + j]);
            for (int j = 0; j < gw; j++) bad += hg[t * gw + j] != lunar_f32_to_bf16(x[(long)t * xs + g_off + j]);
        }
        CHECK_MSG(bad == 0, "T=%d: %d bf16 copies differ", T, bad);
        CHECK(guards_ok(&oq) && guards_ok(&ok) && guards_ok(&ov) && guards_ok(&ob) && guards_ok(&oa) &&
              guards_ok(&og));
        /* the default kernel against the old one's cp.async staging and its plain staging: the same
         * expressions in the same order, so every output and the state bit-equal */
        const size_t nq = (size_t)T * HD, sb = ((size_t)C * S + 1) * 4;
        const size_t nb[6] = {nq * 4, nq * 4, nq * 4, (size_t)T * H * 4, (size_t)T * aw * 2, (size_t)T * gw * 2};
        void *dout[6] = {dq, dk_, dv, db, da, dg};
        const float *dx2 = dev_in(x, (size_t)T * xs * 4);
        unsigned char *res[3][7];
        for (int pass = 0; pass < 3; pass++) {
            float *dst2 = dev_in(st, sb);
            guarded *gs[6] = {&oq, &ok, &ov, &ob, &oa, &og}; /* poisoned again: each pass must write all */
            for (int o = 0; o < 6; o++) lunar_cuda_fill_u32(gs[o]->base, SENT, gs[o]->words + 2 * GUARD);
            if (pass < 2) setenv("LUNAR_KDA_CONV", "old", 1);
            setenv("LUNAR_KDA_CONV_ASYNC", pass ? "1" : "0", 1);
            lunar_cuda_kda_conv_qkv_prefill(dq, dk_, dv, db, da, dg, dx2, xs, a_off, aw, g_off, gw, b_off, dw, dst2, T,
                                            H, dk, K, 1e-6f, NULL);
            lunar_cuda_sync();
            unsetenv("LUNAR_KDA_CONV_ASYNC"), unsetenv("LUNAR_KDA_CONV");
            for (int o = 0; o < 7; o++) {
                const size_t n = o < 6 ? nb[o] : sb;
                res[pass][o] = malloc(n);
                lunar_cuda_download(res[pass][o], o < 6 ? dout[o] : (void *)dst2, n);
            }
        }
        for (int o = 0; o < 7; o++) {
            CHECK_MSG(memcmp(res[0][o], res[1][o], o < 6 ? nb[o] : sb) == 0,
                      "T=%d H=%d K=%d: the cp.async staging's output %d differs", T, H, K, o);
            CHECK_MSG(memcmp(res[0][o], res[2][o], o < 6 ? nb[o] : sb) == 0,
                      "T=%d H=%d K=%d: the default kernel's output %d differs from the old one's", T, H, K, o);
            free(res[0][o]), free(res[1][o]), free(res[2][o]);
        }
        CHECK(guards_ok(&oq) && guards_ok(&ok) && guards_ok(&ov) && guards_ok(&ob) && guards_ok(&oa) &&
              guards_ok(&og));
        free(x), free(w), free(st), free(st_ref), free(ref), free(bref), free(px), free(beta), free(st2), free(ha);
        free(hg);
        lunar_cuda_release(mark);
    }
}

/* The fused batch-1 KDA core (lunar_cuda_kda_decode_fused) against the CPU ops it replaces (short
 * conv T = 1, L2 norms, sigmoid, op_kda_recurrent, op_rmsnorm_gated: 1e-5, fp32 throughout) and
 * against the three launches it replaces (conv_qkv_decode, kda_recurrent, rmsnorm_gated), which
 * its comment says it equals bit for bit: checked at 1e-6 and reported when not bit-equal. B = 2
 * sequences on scattered slots, H = 3 (odd), padded x rows, fp32 and fp16 state pools. gate (B = 1):
 * 1 the forget and output gates from the gate rows [f_b; g_b] (in = 128), 2 the forget gate only
 * (f_b, og given: the full-rank output gate), vs the CPU's GEMV + op_kda_gate and vs
 * lunar_cuda_kda_gate_proj_decode before the three launches. */
static void check_decode_fused(int B, int H, int f16, int gate, unsigned seed) {
    const int dk = 128, HD = H * dk, C = 3 * HD, K = 4, S = K - 1, NS = B + 3, xs = C + H + 24;
    const long ns = (long)H * dk * dk, cs = (long)C * S;
    size_t mark = lunar_cuda_mark();
    int32_t slots[4];
    for (int b = 0; b < B; b++) slots[b] = (b * 2 + 1) % NS; /* distinct, not 0..B-1 */
    float *x = test_rand((long)B * xs, seed, -2, 2), *w = test_rand((long)C * K, seed + 1, -1, 1);
    float *conv = test_rand(NS * cs, seed + 2, -1, 1), *pool = test_rand(NS * ns, seed + 3, -0.5f, 0.5f);
    float *g = test_rand((long)B * HD, seed + 4, -1.5f, 0), *og = test_rand((long)B * HD, seed + 5, -4, 4);
    float *nw = test_rand(dk, seed + 6, 0.5f, 1.5f);
    /* gate rows: W [2 HD, 128] (bf16 values), x [2, 128] (rounded to bf16 as the GEMV's operand on
     * the CPU side), A_log [H], dt_bias [HD]; lower bound -5 (the bounded form) */
    const int in = 128, nrow = gate == 1 ? 2 * HD : HD;
    const float lb = -5.0f;
    float *gwf = test_rand((long)2 * HD * in, seed + 7, -0.2f, 0.2f), *gx = test_rand(2 * in, seed + 8, -2, 2);
    float *alog = test_rand(H, seed + 9, -2, 1), *dtb = test_rand(HD, seed + 10, -1, 1);
    round_bf16(gwf, (long)2 * HD * in);
    if (gate) {
        float *gxr = test_alloc(2 * in), *f = test_alloc(HD);
        memcpy(gxr, gx, sizeof(float) * 2 * in);
        round_bf16(gxr, 2 * in);
        for (int r = 0; r < nrow; r++) {
            double acc = 0;
            for (int i = 0; i < in; i++) acc += (double)gwf[(long)r * in + i] * gxr[(r < HD ? 0 : in) + i];
            if (r < HD) f[r] = (float)acc;
            else og[r - HD] = (float)acc;
        }
        lunar_tensor A = test_tensor1(LUNAR_DTYPE_F32, H, alog), DB = test_tensor1(LUNAR_DTYPE_F32, HD, dtb);
        op_kda_gate(g, f, &A, &DB, 1, H, dk, lb);
        test_tensor_free(&A), test_tensor_free(&DB);
        free(gxr), free(f);
    }
    uint16_t *pool16 = malloc((size_t)NS * ns * 2);
    for (long i = 0; f16 && i < NS * ns; i++) pool16[i] = lunar_f32_to_f16(pool[i]), pool[i] = lunar_f16_to_f32(pool16[i]);
    lunar_tensor W = test_tensor2(LUNAR_DTYPE_F32, C, K, w), NW = test_tensor1(LUNAR_DTYPE_BF16, dk, nw);
    const float scale = 1.0f / sqrtf((float)dk), eps = 1e-5f;
    /* CPU: the composition */
    float *conv_ref = test_alloc(NS * cs), *pool_ref = test_alloc(NS * ns), *ref = test_poisoned((long)B * HD);
    memcpy(conv_ref, conv, sizeof(float) * NS * cs);
    memcpy(pool_ref, pool, sizeof(float) * NS * ns);
    float *qkv = test_alloc(C);
    for (int b = 0; b < B; b++) {
        float beta[8];
        op_short_conv(qkv, x + (long)b * xs, &W, conv_ref + (long)slots[b] * cs, 1, C, K);
        op_l2norm(qkv, qkv, 2 * H, dk, 1e-6f);
        for (int i = 0; i < H; i++) beta[i] = 1.0f / (1.0f + expf(-x[(long)b * xs + C + i]));
        float *Sb = pool_ref + (long)slots[b] * ns, *ob = ref + (long)b * HD;
        op_kda_recurrent(ob, qkv, qkv + HD, qkv + 2 * HD, g + (long)b * HD, beta, Sb, 1, H, dk, dk, scale);
        op_rmsnorm_gated(ob, ob, og + (long)b * HD, &NW, H, dk, eps);
        for (long i = 0; f16 && i < ns; i++) Sb[i] = lunar_f16_to_f32(lunar_f32_to_f16(Sb[i]));
    }
    const float *dx = dev_in(x, (size_t)B * xs * 4), *dw = dev_in(w, (size_t)C * K * 4);
    const float *dg = dev_in(g, (size_t)B * HD * 4), *dog = dev_in(og, (size_t)B * HD * 4);
    const uint16_t *dnw = dev_in(NW.data, NW.nbytes);
    const int32_t *dsl = dev_in(slots, sizeof slots);
    const size_t pb = (size_t)NS * ns * (f16 ? 2 : 4);
    float *dconv = dev_in(conv, (size_t)NS * cs * 4), *dconv2 = dev_in(conv, (size_t)NS * cs * 4);
    void *dpool = dev_in(f16 ? (void *)pool16 : (void *)pool, pb), *dpool2 = dev_in(f16 ? (void *)pool16 : (void *)pool, pb);
    guarded o;
    float *dO = guarded_new(&o, (size_t)B * HD * 4);
    uint16_t *gwb = to_bf16(gwf, (long)2 * HD * in);
    const uint16_t *dgw = dev_in(gwb, (size_t)nrow * in * 2);
    const float *dgx = dev_in(gx, 2 * in * 4), *dal = dev_in(alog, (size_t)H * 4), *ddt = dev_in(dtb, (size_t)HD * 4);
    const lunar_cuda_kda_gate_rows gr = {dgw, dgx, dal, ddt, lb, gate == 1};
    lunar_cuda_kda_decode_fused(dO, dx, xs, dx + C, dw, dconv, dsl, gate ? NULL : dg, gate == 1 ? NULL : dog, dnw, dpool,
                                f16, dsl, B, H, dk, K, 1e-6f, eps, scale, gate ? &gr : NULL, NULL);
    float *out = down_f32(dO, (long)B * HD), *c2 = down_f32(dconv, NS * cs), *p2 = test_alloc(NS * ns);
    uint16_t *h16 = malloc(pb);
    lunar_cuda_download(f16 ? (void *)h16 : (void *)p2, dpool, pb);
    for (long i = 0; f16 && i < NS * ns; i++) p2[i] = lunar_f16_to_f32(h16[i]);
    char what[96];
    snprintf(what, sizeof what, "kda_decode_fused B=%d H=%d%s gate %d vs CPU: o", B, H, f16 ? " fp16 state" : "", gate);
    report(what, lunar_max_rel_err(out, ref, (long)B * HD), 1e-5);
    snprintf(what, sizeof what, "kda_decode_fused B=%d H=%d%s vs CPU: state", B, H, f16 ? " fp16" : "");
    report(what, lunar_max_rel_err(p2, pool_ref, NS * ns), f16 ? 1e-3 : 1e-5); /* fp16: one ulp, as above */
    CHECK_MSG(memcmp(c2, conv_ref, sizeof(float) * NS * cs) == 0, "conv state pool differs from the CPU's");
    CHECK(guards_ok(&o));
    /* the three launches it replaces, on copies of the pools */
    float *q3 = lunar_cuda_alloc((size_t)B * C * 4), *b3 = lunar_cuda_alloc((size_t)B * H * 4);
    float *o3 = lunar_cuda_alloc((size_t)B * HD * 4);
    if (gate) { /* the gate launch it replaces too */
        float *g3 = lunar_cuda_alloc((size_t)HD * 4);
        lunar_cuda_kda_gate_proj_decode(g3, gate == 1 ? (float *)dog : NULL, dgx, dgw, H, dk, in, dal, ddt, lb, NULL);
        dg = g3;
    }
    lunar_cuda_kda_conv_qkv_decode(q3, b3, dx, dx + C, xs, dw, dconv2, dsl, B, H, dk, K, 1e-6f, NULL);
    if (f16)
        lunar_cuda_kda_recurrent_f16(o3, q3, q3 + (size_t)B * HD, q3 + (size_t)2 * B * HD, dg, b3, dpool2, dsl, NULL, B,
                                     1, H, dk, dk, scale, NULL);
    else
        lunar_cuda_kda_recurrent(o3, q3, q3 + (size_t)B * HD, q3 + (size_t)2 * B * HD, dg, b3, dpool2, dsl, NULL, B, 1,
                                 H, dk, dk, scale, NULL);
    lunar_cuda_rmsnorm_gated(o3, LUNAR_CUDA_F32, o3, dog, dnw, B * H, dk, eps, NULL);
    float *out3 = down_f32(o3, (long)B * HD), *c3 = down_f32(dconv2, NS * cs);
    uint8_t *pa = malloc(pb), *pb2 = malloc(pb);
    lunar_cuda_download(pa, dpool, pb);
    lunar_cuda_download(pb2, dpool2, pb);
    const int same = memcmp(out, out3, sizeof(float) * B * HD) == 0 && memcmp(pa, pb2, pb) == 0;
    fprintf(stderr, "[kda_decode_fused B=%d H=%d%s gate %d: %s the launches] ", B, H, f16 ? " fp16" : "", gate,
            same ? "bit-equal to" : "NOT bit-equal to");
    snprintf(what, sizeof what, "kda_decode_fused B=%d H=%d vs the 3 launches", B, H);
    report(what, lunar_max_rel_err(out, out3, (long)B * HD), 1e-6);
    CHECK_MSG(memcmp(c2, c3, sizeof(float) * NS * cs) == 0, "conv state pool differs from conv_qkv_decode's");
    free(x), free(w), free(conv), free(pool), free(g), free(og), free(nw), free(pool16), free(conv_ref);
    free(pool_ref), free(ref), free(qkv), free(out), free(c2), free(p2), free(h16), free(out3), free(c3), free(pa);
    free(pb2), free(gwf), free(gx), free(alog), free(dtb), free(gwb);
    test_tensor_free(&W), test_tensor_free(&NW);
    lunar_cuda_release(mark);
}

TEST(cuda_kda_decode_fused_matches_ops) {
    if (!cuda_on()) return;
    check_decode_fused(1, 32, 0, 0, 300);
    check_decode_fused(2, 3, 0, 0, 310);
    check_decode_fused(2, 3, 1, 0, 320);
    check_decode_fused(1, 32, 0, 1, 330); /* Kimi-Linear's shapes, the gates made inside */
    check_decode_fused(1, 5, 1, 1, 340);
    check_decode_fused(1, 3, 0, 2, 350);
}

TEST(cuda_kda_gate_vs_cpu) {
    if (!cuda_on()) return;
    const int T = 37, H = 3, dk = 128;
    const long N = (long)T * H * dk;
    size_t mark = lunar_cuda_mark();
    float *f = test_rand(N, 5, -30, 30), *al = test_rand(H, 6, -2, 1), *db = test_rand(H * dk, 7, -1, 1);
    lunar_tensor A = test_tensor1(LUNAR_DTYPE_F32, H, al), Bt = test_tensor1(LUNAR_DTYPE_F32, H * dk, db);
    const float *df = dev_in(f, N * 4), *dal = dev_in(al, H * 4), *ddb = dev_in(db, H * dk * 4);
    for (int m = 0; m < 2; m++) {
        const float lb = m ? -5.0f : 0.0f;
        float *ref = test_poisoned(N);
        op_kda_gate(ref, f, &A, &Bt, T, H, dk, lb);
        guarded o;
        float *dg = guarded_new(&o, N * 4);
        lunar_cuda_kda_gate(dg, df, dal, ddb, T, H, dk, lb, NULL);
        float *g = down_f32(dg, N);
        report(m ? "kda_gate lower_bound=-5" : "kda_gate softplus", lunar_max_rel_err(g, ref, N), 1e-5);
        CHECK(guards_ok(&o));
        free(ref), free(g);
    }
    test_tensor_free(&A), test_tensor_free(&Bt);
    free(f), free(al), free(db);
    lunar_cuda_release(mark);
}

/* the prefill's f_b GEMM with the gate in its epilogue (lunar_cuda_kda_gate_gemm) against the CPU
 * (bf16 operands, products summed in double, then op_kda_gate: 1e-5) and against the launches it
 * replaces (cuBLAS / the generic GEMM into pre, then lunar_cuda_kda_gate: 1e-5, the sums in another
 * order); n odd and past a 64-token tile (a partial one, rows 8 apart straddling the end), H odd, in
 * 128 (the model's) and 48, both gate forms; the guards catch a write past g (and g is poisoned:
 * a NaN left in it fails). The three forms: the libm gate (exact), the SFU gate (sfu) and the SFU
 * gate in the tile-loop kernel (loop: the same bits as sfu). The wide case (f_b 5x larger: f +
 * dt_bias over about +-40) takes the softplus past both of its ends; it is also the model's H = 32,
 * whose 64 column blocks give the loop kernel 4 x 132 / 64 = 8 blocks a column block on an H200,
 * so n = 1100 (8 full tiles and a partial one) has block 0 of each walk two tiles. The SFU gate is also held against the exact kernel
 * element by element (the same GEMM sums, so only the gate's form differs): softplus: |dg| / (a
 * max(1, |x|)), x = f + dt_bias, a = exp(A_log) (g is a log decay: absolute in log space, relative
 * where the softplus is linear), bounded: |dg| / |lb|; 1e-6 (the scale-relative error above is
 * loose where |g| is small). */
int lunar_cuda_kda_gate_form(int form); /* cuda_dense.cu's test hook (not in cuda_ops.h: every CUDA object depends on it) */
TEST(cuda_kda_gate_gemm_vs_cpu) {
    if (!cuda_on()) return;
    static const int shapes[][4] = {{77, 3, 128, 1}, {133, 2, 48, 1}, {5, 1, 128, 1}, {1100, 32, 128, 5}}; /* n, H, in, f_b x */
    for (unsigned si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int n = shapes[si][0], H = shapes[si][1], in = shapes[si][2], dk = 128, HD = H * dk;
        const float wr = 0.3f * (float)shapes[si][3];
        size_t mark = lunar_cuda_mark();
        float *x = test_rand((long)n * in, 600 + si, -2, 2), *wf = test_rand((long)HD * in, 610 + si, -wr, wr);
        float *al = test_rand(H, 620 + si, -2, 1), *db = test_rand(HD, 630 + si, -1, 1);
        uint16_t *xb = malloc((size_t)n * in * 2), *wb = malloc((size_t)HD * in * 2);
        for (long i = 0; i < (long)n * in; i++) xb[i] = lunar_f32_to_bf16(x[i]);
        for (long i = 0; i < (long)HD * in; i++) wb[i] = lunar_f32_to_bf16(wf[i]);
        float *f = test_alloc((long)n * HD);
        for (int t = 0; t < n; t++)
            for (int o = 0; o < HD; o++) {
                double a = 0;
                for (int i = 0; i < in; i++)
                    a += (double)lunar_bf16_to_f32(wb[(long)o * in + i]) * lunar_bf16_to_f32(xb[(long)t * in + i]);
                f[(long)t * HD + o] = (float)a;
            }
        lunar_tensor A = test_tensor1(LUNAR_DTYPE_F32, H, al), Bt = test_tensor1(LUNAR_DTYPE_F32, HD, db);
        const uint16_t *dx = dev_in(xb, (size_t)n * in * 2), *dw = dev_in(wb, (size_t)HD * in * 2);
        const float *dal = dev_in(al, H * 4), *ddb = dev_in(db, HD * 4);
        float *pre = lunar_cuda_alloc((size_t)n * HD * 4), *g2 = lunar_cuda_alloc((size_t)n * HD * 4);
        for (int m = 0; m < 2; m++) {
            const float lb = m ? -5.0f : 0.0f;
            float *ref = test_poisoned((long)n * HD);
            op_kda_gate(ref, f, &A, &Bt, n, H, dk, lb);
            lunar_cuda_matmul(pre, LUNAR_CUDA_F32, dx, dw, n, HD, in, NULL);
            lunar_cuda_kda_gate(g2, pre, dal, ddb, n, H, dk, lb, NULL);
            float *gr = down_f32(g2, (long)n * HD), *gk[3];
            for (int form = 0; form < 3; form++) {
                guarded o;
                float *dg = guarded_new(&o, (size_t)n * HD * 4);
                const int prev = lunar_cuda_kda_gate_form(form);
                CHECK(lunar_cuda_kda_gate_gemm(dg, dx, dw, n, H, dk, in, dal, ddb, lb, NULL) == 0);
                lunar_cuda_kda_gate_form(prev);
                gk[form] = down_f32(dg, (long)n * HD);
                char what[112];
                const char *fn = form == 2 ? "loop" : form ? "sfu" : "exact";
                snprintf(what, sizeof what, "kda_gate_gemm %s n=%d H=%d in=%d lb=%g vs CPU", fn, n, H, in, lb);
                report(what, lunar_max_rel_err(gk[form], ref, (long)n * HD), 1e-5);
                snprintf(what, sizeof what, "kda_gate_gemm %s n=%d H=%d in=%d lb=%g vs GEMM + gate", fn, n, H, in, lb);
                report(what, lunar_max_rel_err(gk[form], gr, (long)n * HD), 1e-5);
                CHECK(guards_ok(&o));
            }
            double worst = 0;
            for (long i = 0; i < (long)n * HD; i++) {
                const int col = (int)(i % HD);
                const double xv = fabs((double)f[i] + db[col]), a = exp((double)al[col / dk]);
                const double e = fabs((double)gk[1][i] - gk[0][i]) / (m ? 5.0 : a * (xv > 1 ? xv : 1));
                if (isnan(gk[0][i]) || isnan(gk[1][i]))
                    worst = INFINITY;
                else if (e > worst)
                    worst = e;
            }
            char what[112];
            snprintf(what, sizeof what, "kda_gate_gemm sfu n=%d H=%d lb=%g vs exact, per element", n, H, lb);
            report(what, worst, 1e-6);
            CHECK(memcmp(gk[1], gk[2], (size_t)n * HD * 4) == 0); /* loop == sfu, bit for bit */
            free(ref), free(gk[0]), free(gk[1]), free(gk[2]), free(gr);
        }
        CHECK(lunar_cuda_kda_gate_gemm(g2, dx, dw, n, H, 64, in, dal, ddb, 0.0f, NULL) == -1); /* dk != 128 */
        CHECK(lunar_cuda_kda_gate_gemm(g2, dx, dw, n, H, dk, 40, dal, ddb, 0.0f, NULL) == -1); /* in % 16 */
        test_tensor_free(&A), test_tensor_free(&Bt);
        free(x), free(wf), free(al), free(db), free(xb), free(wb), free(f);
        lunar_cuda_release(mark);
    }
}

/* batch 1's gate projections in one launch against the launches they replace (skinny GEMM of f_b,
 * the gate, skinny GEMM of g_b), both gate forms, with and without g_b; the replaced GEMM is also
 * checked against the CPU (bf16 operands) so that the comparison is not of two wrong answers */
TEST(cuda_kda_gate_proj_decode_matches_ops) {
    if (!cuda_on()) return;
    const int H = 5, dk = 128, HD = H * dk, in = 128;
    size_t mark = lunar_cuda_mark();
    float *x = test_rand(2 * in, 21, -2, 2), *wf = test_rand((long)2 * HD * in, 22, -0.2f, 0.2f);
    float *al = test_rand(H, 23, -2, 1), *db = test_rand(HD, 24, -1, 1);
    uint16_t *wb = malloc((size_t)2 * HD * in * 2);
    for (long i = 0; i < (long)2 * HD * in; i++) wb[i] = lunar_f32_to_bf16(wf[i]);
    /* CPU: f_b . bf16(x) with the bf16 weights, in double */
    float *ref = test_alloc(HD);
    for (int o = 0; o < HD; o++) {
        double a = 0;
        for (int i = 0; i < in; i++)
            a += (double)lunar_bf16_to_f32(wb[(long)o * in + i]) * lunar_bf16_to_f32(lunar_f32_to_bf16(x[i]));
        ref[o] = (float)a;
    }
    const float *dx = dev_in(x, (size_t)2 * in * 4), *dal = dev_in(al, H * 4), *ddb = dev_in(db, HD * 4);
    const uint16_t *dw = dev_in(wb, (size_t)2 * HD * in * 2);
    float *pre = lunar_cuda_alloc((size_t)HD * 4), *g2 = lunar_cuda_alloc((size_t)HD * 4);
    float *og2 = lunar_cuda_alloc((size_t)HD * 4);
    for (int m = 0; m < 4; m++) {
        const float lb = m & 1 ? -5.0f : 0.0f;
        const int with_og = m >= 2;
        guarded o1, o2;
        float *g1 = guarded_new(&o1, (size_t)HD * 4), *og1 = guarded_new(&o2, (size_t)HD * 4);
        lunar_cuda_kda_gate_proj_decode(g1, with_og ? og1 : NULL, dx, dw, H, dk, in, dal, ddb, lb, NULL);
        CHECK(lunar_cuda_matmul_f32x(pre, LUNAR_CUDA_F32, dx, dw, 1, HD, in, NULL) == 0);
        float *hp = down_f32(pre, HD);
        lunar_cuda_kda_gate(g2, pre, dal, ddb, 1, H, dk, lb, NULL);
        CHECK(lunar_cuda_matmul_f32x(og2, LUNAR_CUDA_F32, dx + in, dw + (size_t)HD * in, 1, HD, in, NULL) == 0);
        float *a1 = down_f32(g1, HD), *a2 = down_f32(g2, HD), *b1 = down_f32(og1, HD), *b2 = down_f32(og2, HD);
        char what[96];
        snprintf(what, sizeof what, "kda_gate_proj_decode lb=%g og=%d: gate vs the ops", lb, with_og);
        report(what, lunar_max_rel_err(a1, a2, HD), 1e-6);
        if (with_og) {
            snprintf(what, sizeof what, "kda_gate_proj_decode lb=%g: g_b outputs vs the GEMM", lb);
            report(what, lunar_max_rel_err(b1, b2, HD), 1e-6);
        } else {
            CHECK_MSG(b1[0] != b1[0], "og written although NULL"); /* still the NaN poison */
        }
        report("skinny GEMM f_b vs CPU (the ops' reference)", lunar_max_rel_err(hp, ref, HD), 1e-5);
        CHECK(guards_ok(&o1) && guards_ok(&o2));
        free(hp), free(a1), free(a2), free(b1), free(b2);
    }
    free(x), free(wf), free(al), free(db), free(wb), free(ref);
    lunar_cuda_release(mark);
}

/* the gate projections of n token rows (strided, as the fused projection's output lies) against the
 * one-row call on each row: memcmp-equal, with and without g_b, n = 1 / 3 / 16 */
TEST(cuda_kda_gate_proj_rows_match_one_row) {
    if (!cuda_on()) return;
    const int H = 3, dk = 128, HD = H * dk, in = 128, xs = 2 * in + 36;
    static const int ns[] = {1, 3, 16};
    size_t mark = lunar_cuda_mark();
    float *x = test_rand((long)16 * xs, 31, -2, 2), *wf = test_rand((long)2 * HD * in, 32, -0.2f, 0.2f);
    float *al = test_rand(H, 33, -2, 1), *db = test_rand(HD, 34, -1, 1);
    uint16_t *wb = malloc((size_t)2 * HD * in * 2);
    for (long i = 0; i < (long)2 * HD * in; i++) wb[i] = lunar_f32_to_bf16(wf[i]);
    const float *dx = dev_in(x, (size_t)16 * xs * 4), *dal = dev_in(al, H * 4), *ddb = dev_in(db, HD * 4);
    const uint16_t *dw = dev_in(wb, (size_t)2 * HD * in * 2);
    float *g1 = lunar_cuda_alloc((size_t)HD * 4), *og1 = lunar_cuda_alloc((size_t)HD * 4);
    for (unsigned t = 0; t < sizeof ns / sizeof ns[0]; t++)
        for (int with_og = 0; with_og < 2; with_og++) {
            const int n = ns[t];
            const float lb = with_og ? -5.0f : 0.0f;
            guarded o1, o2;
            float *g = guarded_new(&o1, (size_t)n * HD * 4), *og = guarded_new(&o2, (size_t)n * HD * 4);
            lunar_cuda_kda_gate_proj_rows(g, with_og ? og : NULL, dx, xs, n, dw, H, dk, in, dal, ddb, lb, NULL);
            float *a = down_f32(g, (long)n * HD), *b = down_f32(og, (long)n * HD);
            long bad = 0;
            for (int r = 0; r < n; r++) {
                lunar_cuda_kda_gate_proj_decode(g1, with_og ? og1 : NULL, dx + (size_t)r * xs, dw, H, dk, in, dal, ddb,
                                                lb, NULL);
                float *a1 = down_f32(g1, HD), *b1 = down_f32(og1, HD);
                bad += memcmp(a1, a + (size_t)r * HD, (size_t)HD * 4) != 0;
                if (with_og) bad += memcmp(b1, b + (size_t)r * HD, (size_t)HD * 4) != 0;
                free(a1), free(b1);
            }
            CHECK_MSG(bad == 0, "kda_gate_proj_rows n=%d og=%d: %ld rows differ from the one-row call", n, with_og,
                      bad);
            if (!with_og) CHECK_MSG(b[0] != b[0], "og written although NULL");
            CHECK(guards_ok(&o1) && guards_ok(&o2));
            free(a), free(b);
        }
    free(x), free(wf), free(al), free(db), free(wb);
    lunar_cuda_release(mark);
}

/* ---------------------------------------------------------------- KDA */

/* mode: 1 3xTF32 (fp32-accurate), 0 plain tf32, 2 bf16 scratch and bf16 state-pass operands
 * (3: the same from the older intra kernel). */
static void check_chunked(int T, int H, float lb, int mode, unsigned seed) {
    const int dk = 128, dv = 128;
    size_t mark = lunar_cuda_mark();
    kda_inputs in = kda_make(T, H, dk, dv, lb, seed);
    const float scale = 1.0f / sqrtf((float)dk);
    const long no = (long)T * H * dv, ns = (long)H * dk * dv, nq = (long)T * H * dk;
    float *ref = test_poisoned(no), *Sref = test_alloc(ns);
    memcpy(Sref, in.S0, sizeof(float) * ns);
    op_kda_recurrent(ref, in.q, in.k, in.v, in.g, in.beta, Sref, T, H, dk, dv, scale);
    const float *dq = dev_in(in.q, nq * 4), *dk_ = dev_in(in.k, nq * 4), *dvv = dev_in(in.v, no * 4);
    const float *dg = dev_in(in.g, nq * 4), *db = dev_in(in.beta, (long)T * H * 4);
    float *dS = dev_in(in.S0, ns * 4);
    void *ws = lunar_cuda_alloc(lunar_cuda_kda_chunk_ws(T, H));
    LUNAR_ASSERT(ws);
    lunar_cuda_fill_u32(ws, SENT, lunar_cuda_kda_chunk_ws(T, H) / 4); /* scratch poisoned too */
    guarded o;
    float *dO = guarded_new(&o, no * 4);
    const int prev = lunar_cuda_kda_chunk_precision(mode);
    lunar_cuda_kda_chunked(dO, dq, dk_, dvv, dg, db, dS, T, H, scale, ws, NULL);
    lunar_cuda_kda_chunk_precision(prev);
    float *out = down_f32(dO, no), *S = down_f32(dS, ns);
    /* 3xTF32: fp32-level. tf32: 10-bit mantissa operands (u = 2^-11 ~ 4.9e-4 per rounding), a few
     * roundings chained. bf16: 8-bit mantissa (u = 2^-9 ~ 2e-3) on W, U, Qg, Kg, Aqk, the state
     * copy and V_new, chained through V_new -> O and V_new -> S; 1e-2 = 5u bounds it (fla's
     * chunk_kda rounds the same operands to bf16). */
    const double tol = mode == 1 ? 1e-4 : mode == 0 ? 5e-3 : 1e-2;
    const char *tag = mode == 1 ? "" : mode == 0 ? " (tf32)" : mode == 3 ? " (bf16 old)" : " (bf16)";
    char what[96];
    snprintf(what, sizeof what, "kda_chunked%s T=%d H=%d lb=%g: o", tag, T, H, lb);
    report(what, lunar_max_rel_err(out, ref, no), tol);
    snprintf(what, sizeof what, "kda_chunked%s T=%d H=%d lb=%g: S", tag, T, H, lb);
    report(what, lunar_max_rel_err(S, Sref, ns), tol);
    CHECK(guards_ok(&o));
    free(ref), free(Sref), free(out), free(S);
    kda_free(&in);
    lunar_cuda_release(mark);
}

TEST(cuda_kda_chunked_vs_cpu) {
    if (!cuda_on()) return;
    static const int Ts[] = {1, 63, 64, 65, 200, 333};
    unsigned seed = 500;
    for (unsigned a = 0; a < 6; a++)
        for (int H = 1; H <= 3; H += 2) check_chunked(Ts[a], H, a & 1 ? -5.0f : 0.0f, 1, seed += 10);
    check_chunked(1000, 2, 0.0f, 1, 7);
    check_chunked(130, 70, 0.0f, 1, 8);  /* H >= 66: the 64-column state tiles */
    check_chunked(200, 3, 0.0f, 0, 9);   /* plain tf32 */
    check_chunked(130, 70, -5.0f, 0, 10);
    /* bf16: both state tile widths (32 below 66 heads, 64 from 66), partial chunks, lb = -5 */
    for (unsigned a = 0; a < 6; a++) check_chunked(Ts[a], 3, a & 1 ? -5.0f : 0.0f, 2, seed += 10);
    check_chunked(1000, 2, 0.0f, 2, 11);
    check_chunked(1000, 2, -5.0f, 2, 12);
    check_chunked(130, 70, 0.0f, 2, 13);
    check_chunked(333, 70, -5.0f, 2, 14);
    check_chunked(333, 3, -5.0f, 3, 15); /* mode 3: the older intra kernel, same outputs */
    check_chunked(130, 70, 0.0f, 3, 16);
}

/* Mode 2's warp-specialised state pass (lunar_cuda_kda_state_variant 4: chain warps / output warps,
 * named-barrier hand-off) against kda_state_bf16_kernel (variant 0) on the same inputs: the same
 * operations in the same order, so o and S bit-equal; and against the CPU op. H <= 33 (32-column
 * tiles, one block per SM); T past one and two stages, partial last chunks. (Also the other
 * variants from 66 heads, below.) */
static void check_state_variant(int T, int H, float lb, int variant, unsigned seed) {
    const int dk = 128;
    size_t mark = lunar_cuda_mark();
    kda_inputs in = kda_make(T, H, dk, dk, lb, seed);
    const float scale = 1.0f / sqrtf((float)dk);
    const long no = (long)T * H * dk, ns = (long)H * dk * dk;
    const float *dq = dev_in(in.q, no * 4), *dk_ = dev_in(in.k, no * 4), *dvv = dev_in(in.v, no * 4);
    const float *dg = dev_in(in.g, no * 4), *db = dev_in(in.beta, (long)T * H * 4);
    void *ws = lunar_cuda_alloc(lunar_cuda_kda_chunk_ws(T, H));
    LUNAR_ASSERT(ws);
    float *res[2][2];
    for (int pass = 0; pass < 2; pass++) {
        float *dS = dev_in(in.S0, ns * 4);
        guarded o;
        float *dO = guarded_new(&o, no * 4);
        const int pm = lunar_cuda_kda_chunk_precision(2), pv = lunar_cuda_kda_state_variant(pass ? variant : 0);
        lunar_cuda_kda_chunked(dO, dq, dk_, dvv, dg, db, dS, T, H, scale, ws, NULL);
        lunar_cuda_kda_state_variant(pv), lunar_cuda_kda_chunk_precision(pm);
        res[pass][0] = down_f32(dO, no), res[pass][1] = down_f32(dS, ns);
        CHECK(guards_ok(&o));
    }
    CHECK(memcmp(res[0][0], res[1][0], sizeof(float) * no) == 0);
    CHECK(memcmp(res[0][1], res[1][1], sizeof(float) * ns) == 0);
    for (int i = 0; i < 2; i++) free(res[i][0]), free(res[i][1]);
    kda_free(&in);
    lunar_cuda_release(mark);
    const int pv = lunar_cuda_kda_state_variant(variant);
    check_chunked(T, H, lb, 2, seed + 1);
    lunar_cuda_kda_state_variant(pv);
}

TEST(cuda_kda_chunked_state_ws) {
    if (!cuda_on()) return;
    static const int Ts[] = {1, 63, 64, 65, 129, 200, 333};
    unsigned seed = 970;
    for (unsigned a = 0; a < 7; a++) check_state_variant(Ts[a], a & 1 ? 2 : 1, a & 1 ? 0.0f : -5.0f, 4, seed += 10);
    check_state_variant(1000, 33, 0.0f, 4, 24);
    check_state_variant(2000, 32, -5.0f, 4, 25);
}

/* From 67 to 132 heads the default state pass is kda_state_grp_kernel (cuda_kda_state2.cu: a head a
 * block, two 64-column groups sharing the head's tiles): against the 64-column bf16 pass (variant 0,
 * LUNAR_KDA_STATE=old), memcmp-equal (each output column sees the same mma steps in the same order),
 * and against the CPU op: H = 66 (the threshold, still the 64-column pass), odd 67 and 97, 96
 * (Kimi-K3), 132 (the last of one block per SM) and 133 (past it: the 64-column pass); T of one
 * token, a partial chunk, one and several chunks with a partial last one. */
TEST(cuda_kda_chunked_state_grp) {
    if (!cuda_on()) return;
    static const int Ts[] = {1, 65, 200, 333, 130, 64}, Hs[] = {66, 67, 96, 97, 132, 133};
    unsigned seed = 2270;
    for (int rep = 0; rep < 2; rep++)
        for (unsigned a = 0; a < 6; a++)
            check_state_variant(Ts[(a + 3 * rep) % 6], Hs[a], (a + rep) & 1 ? 0.0f : -5.0f, 4, seed += 10);
}

/* Mode 2's intra kernel forms (cuda_kda_chunk.cu; declared here, not in cuda_ops.h, to leave that
 * header's many dependants unbuilt): 2 tc (the default), 1 fast, 0 old, -1 LUNAR_KDA_INTRA. */
int lunar_cuda_kda_intra_variant(int v);

/* The chunked op (mode 2) on the same inputs under intra variants va then vb into scratches poisoned
 * alike: o and S (res[pass][0 / 1], host copies) and the whole scratch (sc[pass]), the guards checked */
static void intra_two_passes(const kda_inputs *in, int T, int H, int va, int vb, float *res[2][2], uint16_t *sc[2]) {
    const int dk = 128;
    const float scale = 1.0f / sqrtf((float)dk);
    const long no = (long)T * H * dk, ns = (long)H * dk * dk;
    const size_t wsb = lunar_cuda_kda_chunk_ws(T, H);
    const float *dq = dev_in(in->q, no * 4), *dk_ = dev_in(in->k, no * 4), *dvv = dev_in(in->v, no * 4);
    const float *dg = dev_in(in->g, no * 4), *db = dev_in(in->beta, (long)T * H * 4);
    void *ws = lunar_cuda_alloc(wsb);
    LUNAR_ASSERT(ws);
    for (int pass = 0; pass < 2; pass++) {
        float *dS = dev_in(in->S0, ns * 4);
        guarded o;
        float *dO = guarded_new(&o, no * 4);
        lunar_cuda_fill_u32(ws, SENT, wsb / 4);
        const int pm = lunar_cuda_kda_chunk_precision(2), pv = lunar_cuda_kda_intra_variant(pass ? vb : va);
        lunar_cuda_kda_chunked(dO, dq, dk_, dvv, dg, db, dS, T, H, scale, ws, NULL);
        lunar_cuda_kda_intra_variant(pv), lunar_cuda_kda_chunk_precision(pm);
        res[pass][0] = down_f32(dO, no), res[pass][1] = down_f32(dS, ns);
        sc[pass] = malloc(wsb);
        lunar_cuda_download(sc[pass], ws, wsb);
        CHECK(guards_ok(&o));
    }
}

/* kda_intra2_kernel<1> (LUNAR_KDA_INTRA=fast) against <0> on the same inputs, both scratches
 * poisoned alike: the scratch (bf16 W, U, Qg, Kg, Aqk; fp32 exp(Gamma_C); the poison between them)
 * bit for bit but where the old form leaves a value below 2^-126 that the fast one flushes (the
 * bound: |difference| <= 1e-30 per element, read as bf16, far below any value that counts); o and S
 * scale-relative <= 1e-6; then the fast form against the CPU op (check_chunked, tolerance 1e-2). */
static void check_intra_fast(int T, int H, float lb, unsigned seed) {
    const int dk = 128;
    size_t mark = lunar_cuda_mark();
    kda_inputs in = kda_make(T, H, dk, dk, lb, seed);
    const long no = (long)T * H * dk, ns = (long)H * dk * dk;
    const size_t wsb = lunar_cuda_kda_chunk_ws(T, H);
    float *res[2][2];
    uint16_t *sc[2];
    intra_two_passes(&in, T, H, 0, 1, res, sc);
    long ndiff = 0;
    double dmax = 0;
    for (size_t i = 0; i < wsb / 2; i++)
        if (sc[0][i] != sc[1][i]) {
            const double d = fabs((double)lunar_bf16_to_f32(sc[0][i]) - lunar_bf16_to_f32(sc[1][i]));
            ndiff++;
            if (!(d <= dmax)) dmax = d; /* NaN (a poison left in one only) propagates */
        }
    char what[160];
    snprintf(what, sizeof what, "kda intra fast vs old T=%d H=%d lb=%g: scratch (%ld of %zu bf16 differ)", T, H,
             lb, ndiff, wsb / 2);
    report(what, dmax, 1e-30);
    snprintf(what, sizeof what, "kda intra fast vs old T=%d H=%d lb=%g: o", T, H, lb);
    report(what, lunar_max_rel_err(res[1][0], res[0][0], no), 1e-6);
    snprintf(what, sizeof what, "kda intra fast vs old T=%d H=%d lb=%g: S", T, H, lb);
    report(what, lunar_max_rel_err(res[1][1], res[0][1], ns), 1e-6);
    for (int i = 0; i < 2; i++) free(res[i][0]), free(res[i][1]), free(sc[i]);
    kda_free(&in);
    lunar_cuda_release(mark);
    const int pv = lunar_cuda_kda_intra_variant(1);
    check_chunked(T, H, lb, 2, seed + 1);
    lunar_cuda_kda_intra_variant(pv);
}

/* kda_intra2_kernel<2> (LUNAR_KDA_INTRA=tc, the default since session 16: the diagonal blocks on tensor cores, anchored
 * mid-block, where every gate of the (chunk, head) tile is >= -8, the session-13 path elsewhere; the
 * block inverse's level products on tf32 mma) against <1> (LUNAR_KDA_INTRA=fast) on the same inputs,
 * both scratches poisoned alike: the bf16 part of the scratch (W, U, Qg, Kg, Aqk) scale-relative (max
 * |d| over max |fast|: the diagonal entries' tf32 operands, the moved anchor and the inverse's tf32
 * products flip bf16 roundings; a poison left in one only is NaN and fails), exp(Gamma_C) (fp32, the
 * same cumsum and expf) bit for bit, o and S scale-relative, all within the bf16 path's 1e-2 (the
 * bound check_chunked explains); then <2> against the CPU op (check_chunked). gmul scales g after
 * kda_make: lb -5 keeps every tile bounded, lb 0 gives g down to ~-8.3 (the bench's inputs: a few
 * tiles fall back), gmul 4 makes most tiles fall back, so one launch mixes both paths. */
static void check_intra_diag(int T, int H, float lb, float gmul, unsigned seed) {
    const int variant = 2; /* tc */
    const int dk = 128;
    size_t mark = lunar_cuda_mark();
    kda_inputs in = kda_make(T, H, dk, dk, lb, seed);
    for (long i = 0; i < (long)T * H * dk; i++) in.g[i] *= gmul;
    const long no = (long)T * H * dk, ns = (long)H * dk * dk;
    float *res[2][2];
    uint16_t *sc[2];
    intra_two_passes(&in, T, H, 1, variant, res, sc);
    /* the layout of lunar_cuda_kda_chunk_ws: W, U, Qg, Kg (fp32-sized slots, bf16 in their first
     * halves, poison after), Aqk, then exp(Gamma_C) in fp32 */
    const size_t NC = (size_t)(T + 63) / 64, nbf = 2 * (size_t)H * NC * (4 * 64 * dk + 64 * 64);
    long ndiff = 0;
    double dmax = 0, amax = 0;
    for (size_t i = 0; i < nbf; i++) {
        const double a = lunar_bf16_to_f32(sc[0][i]);
        if (isfinite(a) && fabs(a) > amax) amax = fabs(a);
        if (sc[0][i] != sc[1][i]) {
            const double d = fabs(a - lunar_bf16_to_f32(sc[1][i]));
            ndiff++;
            if (!(d <= dmax)) dmax = d; /* NaN (a poison left in one only) propagates */
        }
    }
    CHECK(memcmp(sc[0] + nbf, sc[1] + nbf, sizeof(float) * (size_t)H * NC * dk) == 0);
    char what[160];
    snprintf(what, sizeof what, "kda intra %d vs fast T=%d H=%d lb=%g g*%g: bf16 scratch (%ld of %zu differ)",
             variant, T, H, lb, gmul, ndiff, nbf);
    report(what, amax > 0 ? dmax / amax : dmax, 1e-2);
    snprintf(what, sizeof what, "kda intra %d vs fast T=%d H=%d lb=%g g*%g: o", variant, T, H, lb, gmul);
    report(what, lunar_max_rel_err(res[1][0], res[0][0], no), 1e-2);
    snprintf(what, sizeof what, "kda intra %d vs fast T=%d H=%d lb=%g g*%g: S", variant, T, H, lb, gmul);
    report(what, lunar_max_rel_err(res[1][1], res[0][1], ns), 1e-2);
    for (int i = 0; i < 2; i++) free(res[i][0]), free(res[i][1]), free(sc[i]);
    kda_free(&in);
    lunar_cuda_release(mark);
    if (gmul == 1.0f) { /* check_chunked makes its own inputs (unscaled g) */
        const int pv = lunar_cuda_kda_intra_variant(variant);
        check_chunked(T, H, lb, 2, seed + 1);
        lunar_cuda_kda_intra_variant(pv);
    }
}

TEST(cuda_kda_chunked_intra_diag) {
    if (!cuda_on()) return;
    static const int Ts[] = {1, 63, 64, 65, 129, 200, 333};
    unsigned seed = 3170;
    for (unsigned a = 0; a < 7; a++) check_intra_diag(Ts[a], a % 3 + 1, a & 1 ? 0.0f : -5.0f, 1.0f, seed += 10);
    check_intra_diag(1000, 32, 0.0f, 1.0f, seed += 10);
    check_intra_diag(333, 96, -5.0f, 1.0f, seed += 10);
    check_intra_diag(777, 7, 0.0f, 4.0f, seed += 10); /* most tiles past the bound: the fallback beside it */
    check_intra_diag(200, 3, 0.0f, 2.0f, seed += 10);
    check_intra_diag(2000, 32, -5.0f, 1.0f, 42);
}

TEST(cuda_kda_chunked_intra_fast) {
    if (!cuda_on()) return;
    static const int Ts[] = {1, 63, 64, 65, 129, 200, 333};
    unsigned seed = 1170;
    for (unsigned a = 0; a < 7; a++) check_intra_fast(Ts[a], a % 3 + 1, a & 1 ? 0.0f : -5.0f, seed += 10);
    check_intra_fast(1000, 32, 0.0f, 31);
    check_intra_fast(2000, 32, -5.0f, 32);
    check_intra_fast(333, 70, -5.0f, 33); /* H >= 66: the 64-column state tiles */
}

/* Batch of B sequences of T tokens with permuted state slots, in place and in the verify form
 * (one state per position, slot untouched), against op_kda_recurrent per sequence. */
static void check_recurrent(int B, int T, int H, int dv, unsigned seed) {
    const int dk = 128, NS = B + 2;
    size_t mark = lunar_cuda_mark();
    const long per_q = (long)T * H * dk, per_v = (long)T * H * dv, ns = (long)H * dk * dv;
    kda_inputs in = kda_make(B * T, H, dk, dv, seed & 1 ? -5.0f : 0.0f, seed); /* [B*T, H, .] = [B, T, H, .] */
    float *pool = test_rand(NS * ns, seed + 99, -0.5f, 0.5f);
    int32_t slots[16];
    for (int b = 0; b < B; b++) slots[b] = (b * 3 + 1) % NS; /* NS = B + 2 is prime to 3 for B = 2, 3, 5: distinct */
    const float scale = 1.0f / sqrtf((float)dk);
    float *ref = test_poisoned((long)B * per_v), *pool_ref = test_alloc(NS * ns);
    float *steps_ref = test_alloc((long)B * T * ns);
    memcpy(pool_ref, pool, sizeof(float) * NS * ns);
    for (int b = 0; b < B; b++) {
        float *Sb = pool_ref + (long)slots[b] * ns;
        for (int t = 0; t < T; t++) { /* one token at a time to capture every state */
            long row = (long)b * T + t;
            op_kda_recurrent(ref + row * H * dv, in.q + row * H * dk, in.k + row * H * dk,
                             in.v + row * H * dv, in.g + row * H * dk, in.beta + row * H, Sb, 1, H,
                             dk, dv, scale);
            memcpy(steps_ref + row * ns, Sb, sizeof(float) * ns);
        }
    }
    const float *dq = dev_in(in.q, B * per_q * 4), *dk_ = dev_in(in.k, B * per_q * 4);
    const float *dvv = dev_in(in.v, B * per_v * 4), *dg = dev_in(in.g, B * per_q * 4);
    const float *db = dev_in(in.beta, (long)B * T * H * 4);
    const int32_t *dsl = dev_in(slots, sizeof(int32_t) * B);
    for (int verify = 0; verify < 2; verify++) {
        float *dpool = dev_in(pool, NS * ns * 4);
        guarded o, os;
        float *dO = guarded_new(&o, (size_t)B * per_v * 4);
        float *dsteps = verify ? guarded_new(&os, (size_t)B * T * ns * 4) : NULL;
        lunar_cuda_kda_recurrent(dO, dq, dk_, dvv, dg, db, dpool, dsl, dsteps, B, T, H, dk, dv, scale, NULL);
        float *out = down_f32(dO, (long)B * per_v), *p2 = down_f32(dpool, NS * ns);
        char what[96];
        snprintf(what, sizeof what, "kda_recurrent%s B=%d T=%d H=%d dv=%d: o", verify ? " verify" : "", B, T, H, dv);
        report(what, lunar_max_rel_err(out, ref, (long)B * per_v), 1e-5);
        if (verify) {
            float *st = down_f32(dsteps, (long)B * T * ns);
            snprintf(what, sizeof what, "kda_recurrent verify B=%d T=%d H=%d: states", B, T, H);
            report(what, lunar_max_rel_err(st, steps_ref, (long)B * T * ns), 1e-5);
            CHECK_MSG(memcmp(p2, pool, sizeof(float) * NS * ns) == 0, "verify form changed the pool");
            CHECK(guards_ok(&os));
            free(st);
        } else {
            snprintf(what, sizeof what, "kda_recurrent B=%d T=%d H=%d: pool", B, T, H);
            report(what, lunar_max_rel_err(p2, pool_ref, NS * ns), 1e-5);
        }
        CHECK(guards_ok(&o));
        free(out), free(p2);
    }
    free(pool), free(ref), free(pool_ref), free(steps_ref);
    kda_free(&in);
    lunar_cuda_release(mark);
}

/* The fp16 state option: the pool holds halves; the kernel widens a slot once, runs T tokens in
 * fp32 and rounds once at the store, as the CPU reference (fp32 recurrence over the call, then S
 * rounded to fp16: model/forward.c). Outputs: the same fp32 arithmetic from the same state values,
 * 1e-5. Pool: one rounding to fp16 of values that differ by fp32 summation order, so a rare
 * element lands on the other side of a rounding boundary: one fp16 ulp (2^-11 relative to the
 * element) bounds it, 1e-3 of max |ref|. */
static void check_recurrent_f16(int B, int T, int H, unsigned seed) {
    const int dk = 128, dv = 128, NS = B + 2;
    size_t mark = lunar_cuda_mark();
    const long per_q = (long)T * H * dk, per_v = (long)T * H * dv, ns = (long)H * dk * dv;
    kda_inputs in = kda_make(B * T, H, dk, dv, 0.0f, seed);
    float *pool = test_rand(NS * ns, seed + 99, -0.5f, 0.5f);
    uint16_t *pool16 = malloc((size_t)NS * ns * 2);
    for (long i = 0; i < NS * ns; i++) pool16[i] = lunar_f32_to_f16(pool[i]), pool[i] = lunar_f16_to_f32(pool16[i]);
    int32_t slots[16];
    for (int b = 0; b < B; b++) slots[b] = (b * 3 + 1) % NS;
    const float scale = 1.0f / sqrtf((float)dk);
    float *ref = test_poisoned((long)B * per_v), *pool_ref = test_alloc(NS * ns);
    memcpy(pool_ref, pool, sizeof(float) * NS * ns);
    for (int b = 0; b < B; b++) {
        float *Sb = pool_ref + (long)slots[b] * ns;
        const long row = (long)b * T;
        op_kda_recurrent(ref + row * H * dv, in.q + row * H * dk, in.k + row * H * dk, in.v + row * H * dv,
                         in.g + row * H * dk, in.beta + row * H, Sb, T, H, dk, dv, scale);
        for (long i = 0; i < ns; i++) Sb[i] = lunar_f16_to_f32(lunar_f32_to_f16(Sb[i]));
    }
    const float *dq = dev_in(in.q, B * per_q * 4), *dk_ = dev_in(in.k, B * per_q * 4);
    const float *dvv = dev_in(in.v, B * per_v * 4), *dg = dev_in(in.g, B * per_q * 4);
    const float *db = dev_in(in.beta, (long)B * T * H * 4);
    const int32_t *dsl = dev_in(slots, sizeof(int32_t) * B);
    uint16_t *dpool = dev_in(pool16, (size_t)NS * ns * 2);
    guarded o;
    float *dO = guarded_new(&o, (size_t)B * per_v * 4);
    lunar_cuda_kda_recurrent_f16(dO, dq, dk_, dvv, dg, db, dpool, dsl, NULL, B, T, H, dk, dv, scale, NULL);
    float *out = down_f32(dO, (long)B * per_v), *p2 = test_alloc(NS * ns);
    uint16_t *h16 = malloc((size_t)NS * ns * 2);
    lunar_cuda_download(h16, dpool, (size_t)NS * ns * 2);
    for (long i = 0; i < NS * ns; i++) p2[i] = lunar_f16_to_f32(h16[i]);
    char what[96];
    snprintf(what, sizeof what, "kda_recurrent fp16 state B=%d T=%d H=%d: o", B, T, H);
    report(what, lunar_max_rel_err(out, ref, (long)B * per_v), 1e-5);
    snprintf(what, sizeof what, "kda_recurrent fp16 state B=%d T=%d H=%d: pool", B, T, H);
    report(what, lunar_max_rel_err(p2, pool_ref, NS * ns), 1e-3);
    CHECK(guards_ok(&o));
    free(out), free(p2), free(h16), free(pool16);
    free(pool), free(ref), free(pool_ref);
    kda_free(&in);
    lunar_cuda_release(mark);
}

TEST(cuda_kda_recurrent_f16_state_vs_cpu) {
    if (!cuda_on()) return;
    check_recurrent_f16(1, 1, 2, 11);
    check_recurrent_f16(3, 1, 8, 12);
    check_recurrent_f16(2, 3, 4, 13);
}

TEST(cuda_kda_recurrent_vs_cpu) {
    if (!cuda_on()) return;
    check_recurrent(1, 1, 1, 128, 1);
    check_recurrent(3, 1, 32, 128, 2);
    check_recurrent(5, 4, 3, 64, 3);
    check_recurrent(2, 7, 2, 160, 4);
}

TEST(cuda_graph_replay_decode_step) {
    if (!cuda_on()) return;
    /* capture conv decode + recurrent decode on a stream, replay twice == two eager steps */
    const int B = 2, H = 2, dk = 128, dv = 128, C = 64, K = 4;
    size_t mark = lunar_cuda_mark();
    const long ns = (long)H * dk * dv;
    float *q = test_rand((long)B * H * dk, 1, -0.1f, 0.1f), *k = test_rand((long)B * H * dk, 2, -0.1f, 0.1f);
    float *v = test_rand((long)B * H * dv, 3, -1, 1), *g = test_rand((long)B * H * dk, 4, -1, 0);
    float *be = test_rand((long)B * H, 5, 0, 1), *pool = test_rand(B * ns, 6, -1, 1);
    float *x = test_rand((long)B * C, 7, -1, 1), *w = test_rand((long)C * K, 8, -1, 1);
    float *cst = test_rand((long)B * C * (K - 1), 9, -1, 1);
    int32_t slots[2] = {1, 0};
    const float *dq = dev_in(q, B * H * dk * 4), *dk_ = dev_in(k, B * H * dk * 4), *dv_ = dev_in(v, B * H * dv * 4);
    const float *dg = dev_in(g, B * H * dk * 4), *db = dev_in(be, B * H * 4);
    const float *dx = dev_in(x, B * C * 4), *dw = dev_in(w, C * K * 4);
    const int32_t *dsl = dev_in(slots, sizeof slots);
    float *pools[2], *csts[2], *outs[2], *ys[2];
    for (int r = 0; r < 2; r++) {
        pools[r] = dev_in(pool, ns * B * 4), csts[r] = dev_in(cst, (size_t)B * C * (K - 1) * 4);
        outs[r] = lunar_cuda_alloc((size_t)B * H * dv * 4), ys[r] = lunar_cuda_alloc((size_t)B * C * 4);
    }
    lunar_cuda_stream s = lunar_cuda_stream_create();
    for (int i = 0; i < 2; i++) { /* eager */
        lunar_cuda_short_conv_decode(ys[0], dx, dw, csts[0], dsl, B, C, K, s);
        lunar_cuda_kda_recurrent(outs[0], dq, dk_, dv_, dg, db, pools[0], dsl, NULL, B, 1, H, dk, dv, 0.1f, s);
    }
    lunar_cuda_graph_begin(s);
    lunar_cuda_short_conv_decode(ys[1], dx, dw, csts[1], dsl, B, C, K, s);
    lunar_cuda_kda_recurrent(outs[1], dq, dk_, dv_, dg, db, pools[1], dsl, NULL, B, 1, H, dk, dv, 0.1f, s);
    lunar_cuda_graph gr = lunar_cuda_graph_end(s);
    lunar_cuda_graph_launch(gr, s);
    lunar_cuda_graph_launch(gr, s);
    lunar_cuda_stream_sync(s);
    float *a = down_f32(pools[0], B * ns), *b = down_f32(pools[1], B * ns);
    float *c1 = down_f32(csts[0], (long)B * C * (K - 1)), *c2 = down_f32(csts[1], (long)B * C * (K - 1));
    CHECK(memcmp(a, b, sizeof(float) * B * ns) == 0);
    CHECK(memcmp(c1, c2, sizeof(float) * B * C * (K - 1)) == 0);
    lunar_cuda_graph_destroy(gr);
    lunar_cuda_stream_destroy(s);
    free(q), free(k), free(v), free(g), free(be), free(pool), free(x), free(w), free(cst);
    free(a), free(b), free(c1), free(c2);
    lunar_cuda_release(mark);
}

#endif
