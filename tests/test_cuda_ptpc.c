/* PTPC-FP8 on CUDA against the CPU op (op_matmul_ptpc_fp8): quantisation codes and scales must be
 * bit-identical (same rule, IEEE divisions, same e4m3 rounding), the GEMM equal up to fp32
 * summation order. Skipped, with a clear message, without a CUDA device.
 *
 * GEMM tolerance, per element, against m = sum_k |qx_k qw_k| s_x s_w (the magnitude the sum is
 * formed from): every e4m3 x e4m3 product is exact in fp32 on both sides, so the CPU (8 partial
 * sums) and the device differ only in how the sum is rounded. Hopper's FP8 tensor cores keep
 * fewer accumulator bits than fp32 inside one MMA chain (DeepSeek-V3 reports ~14 bits) before
 * cuBLASLt promotes to fp32 (fast accumulation is left off): 2^-12 m covers a 2^-14 error per
 * promoted chunk with margin; the fallback kernel (plain fp32, in <= 1024: in * 2^-24 m) sits well
 * inside. bf16 outputs add their own rounding, 2^-8 |ref|. A wrong scale, a transposed operand or
 * a wrong code is off by O(m). */
#include "test.h"

#ifndef LUNAR_HAVE_CUDA

TEST(cuda_ptpc_skipped) { fprintf(stderr, "[skipped: no CUDA device: lunar was built without CUDA] "); }

#else

#include <stdint.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_glue.h"
#include "backend/cuda/cuda_ops.h"
#include "ops.h"
#include "cuda_test.h"
#include "ops_util.h"

static int ptpc_cuda_on(void) { return lunar_test_cuda_on((size_t)6 << 30); }

/* count outputs from the device as fp32 (widened when the kernel wrote bf16) */
static float *download_f32(const void *d, int bf, long count) {
    float *y = test_alloc(count);
    if (bf) {
        uint16_t *b = malloc((size_t)count * 2);
        lunar_cuda_download(b, d, (size_t)count * 2);
        for (long i = 0; i < count; i++) y[i] = lunar_bf16_to_f32(b[i]);
        free(b);
    } else {
        lunar_cuda_download(y, d, (size_t)count * 4);
    }
    return y;
}
static void *up(const void *h, size_t bytes) {
    void *p = lunar_cuda_alloc(bytes);
    LUNAR_ASSERT(p);
    lunar_cuda_upload(p, h, bytes);
    return p;
}

TEST(cuda_ptpc_fp8_vs_cpu) {
    if (!ptpc_cuda_on()) return;
    /* aligned shapes (cuBLASLt) first, then ones FP8's 16-byte rules send to the fallback:
     * in % 16 != 0, odd out (bf16 y rows of 66 bytes), odd token counts */
    static const int shapes[][3] = {{1, 64, 128}, {4, 256, 512}, {17, 136, 256}, {64, 512, 1024},
                                    {3, 33, 80},  {2, 48, 100},  {5, 7, 16}};
    long long sc0, un0, fb0;
    lunar_cuda_ptpc_stats(&sc0, &un0, &fb0, NULL);
    int calls = 0;
    double worst = 0;
    for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int n = shapes[s][0], out = shapes[s][1], in = shapes[s][2];
        size_t mark = lunar_cuda_mark();
        float *x = test_rand((long)n * in, 40 + s, -3, 3), *w = test_rand((long)out * in, 50 + s, -0.02f, 0.02f);
        w[(out / 2) * in + in / 3] = 1.5f; /* an outlier: its row's scale is 1.5 / 448 */
        for (int i = 0; i < in; i++) w[(size_t)(out - 1) * in + i] = 0; /* a zero row: s = 1, codes 0 */
        if (n > 1)
            for (int i = 0; i < in; i++) x[(size_t)(n - 1) * in + i] = 0;
        lunar_tensor W = test_tensor2(LUNAR_DTYPE_BF16, out, in, w);
        uint16_t *xb = malloc((size_t)n * in * 2);
        for (long i = 0; i < (long)n * in; i++) {
            xb[i] = lunar_f32_to_bf16(x[i]);
            x[i] = lunar_bf16_to_f32(xb[i]); /* the CPU sees the device's bf16 x */
        }
        /* device quantisation: codes and scales bit-identical to the CPU rule */
        const void *dw = up(W.data, W.nbytes), *dx = up(xb, (size_t)n * in * 2);
        guarded bq, bs, bxq, bxs;
        uint8_t *dqw = guarded_new(&bq, (size_t)out * in), *dqx = guarded_new(&bxq, (size_t)n * in);
        float *dsw = guarded_new(&bs, (size_t)out * 4), *dsx = guarded_new(&bxs, (size_t)n * 4);
        lunar_cuda_ptpc_quantize(dqw, dsw, dw, LUNAR_CUDA_BF16, out, in, NULL);
        lunar_cuda_ptpc_quantize(dqx, dsx, dx, LUNAR_CUDA_BF16, n, in, NULL);
        lunar_cuda_sync();
        uint8_t *qw = malloc((size_t)out * in), *qx = malloc((size_t)n * in), *cq = malloc((size_t)in);
        float *sw = test_alloc(out), *sx = test_alloc(n), *row = test_alloc(in);
        lunar_cuda_download(qw, dqw, (size_t)out * in);
        lunar_cuda_download(qx, dqx, (size_t)n * in);
        lunar_cuda_download(sw, dsw, (size_t)out * 4);
        lunar_cuda_download(sx, dsx, (size_t)n * 4);
        int bad = 0;
        for (int o = 0; o < out; o++) {
            for (int i = 0; i < in; i++) row[i] = lunar_bf16_to_f32(((const uint16_t *)W.data)[(size_t)o * in + i]);
            float cs = lunar_ptpc_quantize_row(cq, row, in);
            bad += cs != sw[o] || memcmp(cq, qw + (size_t)o * in, (size_t)in) != 0;
        }
        for (int t = 0; t < n; t++) {
            float cs = lunar_ptpc_quantize_row(cq, x + (size_t)t * in, in);
            bad += cs != sx[t] || memcmp(cq, qx + (size_t)t * in, (size_t)in) != 0;
        }
        CHECK_MSG(bad == 0, "n=%d out=%d in=%d: %d rows quantised differently from the CPU", n, out, in, bad);
        CHECK(sw[out - 1] == 1.0f && (n == 1 || sx[n - 1] == 1.0f));
        CHECK(guards_ok(&bq) && guards_ok(&bxq));
        CHECK(guards_ok(&bs) && guards_ok(&bxs));
        /* the GEMM, both output types, by each form: all allowed (the scaled cuBLASLt GEMM where it
         * takes the shape), the scaled one skipped (unscaled GEMM + scaling for fp32 y), the plain
         * kernel only */
        float *ref = test_poisoned((long)n * out), *mag = test_alloc((long)n * out);
        op_matmul_ptpc_fp8(ref, x, &W, n);
        for (int t = 0; t < n; t++)
            for (int o = 0; o < out; o++) {
                double m = 0;
                for (int i = 0; i < in; i++)
                    m += fabs((double)lunar_e4m3_to_f32(qx[(size_t)t * in + i]) * lunar_e4m3_to_f32(qw[(size_t)o * in + i]));
                mag[(size_t)t * out + o] = (float)(m * sx[t] * sw[o]);
            }
        for (int v = 0; v < 6; v++) {
            const int bf = v & 1, forced = v >> 1;
            const size_t ybytes = (size_t)n * out * (bf ? 2 : 4);
            guarded by;
            void *dy = guarded_new(&by, ybytes);
            lunar_cuda_ptpc_force(forced);
            lunar_cuda_ptpc_matmul(dy, bf ? LUNAR_CUDA_BF16 : LUNAR_CUDA_F32, dqx, dsx, dqw, dsw, n, out, in, NULL);
            lunar_cuda_ptpc_force(0);
            calls++;
            lunar_cuda_sync();
            float *y = download_f32(dy, bf, (long)n * out);
            int fails = 0;
            double e_max = 0;
            for (long i = 0; i < (long)n * out; i++) {
                double e = fabs((double)y[i] - ref[i]), tol = ldexp(mag[i], -12) + (bf ? ldexp(fabs(ref[i]), -8) : 0);
                if (!(e <= tol + 1e-30)) fails++; /* NaN (unwritten) fails too */
                if (mag[i] > 0 && e / mag[i] > e_max) e_max = e / mag[i];
            }
            if (e_max > worst) worst = e_max;
            CHECK_MSG(fails == 0, "n=%d out=%d in=%d %s force %d: %d elements off (max err/m %.3g)", n, out, in,
                      bf ? "bf16" : "f32", forced, fails, e_max);
            CHECK(guards_ok(&by));
            free(y);
        }
        test_tensor_free(&W);
        free(x), free(w), free(xb), free(qw), free(qx), free(cq), free(sw), free(sx), free(row), free(ref), free(mag);
        lunar_cuda_release(mark);
    }
    long long sc1, un1, fb1;
    lunar_cuda_ptpc_stats(&sc1, &un1, &fb1, NULL);
    CHECK(sc1 - sc0 + un1 - un0 + fb1 - fb0 == calls);
    /* at least: the forced-plain calls, the unaligned shapes (3, both y types) of the other two
     * levels, and the bf16 calls of level 1 (no unscaled form for bf16 y) on the 4 aligned shapes */
    CHECK(fb1 - fb0 >= calls / 3 + 3 * 2 * 2 + 4);
    fprintf(stderr, "[FP8 GEMM calls: cuBLASLt scaled %lld, unscaled + scaling %lld, fallback %lld; max err/m %.3g] ",
            sc1 - sc0, un1 - un0, fb1 - fb0, worst);
    if (lunar_cuda_ptpc_scaled_note()[0]) fprintf(stderr, "\n  [%s] ", lunar_cuda_ptpc_scaled_note());
}

/* The decode kernel (lunar_cuda_ptpc_gemv: quantisation of x fused, n <= 4) against the CPU op with
 * bf16 operands (x rounded to bf16 first, as the kernel does with an fp32 x). Both sum exact
 * products in fp32, only in another order, so the bound is the one of any fp32 summation order:
 * |err| <= (in + 2) 2^-24 m (m = sum |products| s_x s_w; 2 for the two scalings); bf16 y adds
 * 2^-8 |ref|. A code off by one step in element i moves the sum by >= m_i / 16, far above that for
 * any element carrying more than in 2^-20 of its row. The x values are not bf16 numbers: the
 * fp32 input must be rounded to bf16 before it is quantised. Shapes with few outputs have 2-8
 * warps share each one (96 x 10240, 40 x 10240, 256 x 4096, 128 x 20480: the last also streams past
 * the loads issued before the quantisation); 4096 x 2304 is Kimi-Linear's q/k/v projection.
 * Refused shapes launch nothing. */
TEST(cuda_ptpc_gemv_vs_cpu) {
    if (!ptpc_cuda_on()) return;
    static const int shapes[][3] = {{1, 64, 128},    {2, 256, 512},   {3, 136, 256},  {4, 512, 1024},
                                    {1, 96, 10240},  {4, 40, 10240},  {2, 4500, 64},  {3, 256, 4096},
                                    {1, 128, 20480}, {1, 4096, 2304}};
    long long g0, g1;
    lunar_cuda_ptpc_stats(NULL, NULL, NULL, &g0);
    int calls = 0;
    double worst = 0;
    for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int n = shapes[s][0], out = shapes[s][1], in = shapes[s][2];
        size_t mark = lunar_cuda_mark();
        float *x = test_rand((long)n * in, 70 + s, -3, 3), *w = test_rand((long)out * in, 80 + s, -0.02f, 0.02f);
        w[(out / 2) * in + in / 3] = 1.5f; /* an outlier row */
        for (int i = 0; i < in; i++) w[(size_t)(out - 1) * in + i] = 0; /* a zero row */
        x[in / 2] = 1e-3f;                                                /* codes far below the row's amax */
        lunar_tensor W = test_tensor2(LUNAR_DTYPE_BF16, out, in, w);
        uint16_t *xb = malloc((size_t)n * in * 2);
        for (long i = 0; i < (long)n * in; i++) xb[i] = lunar_f32_to_bf16(x[i]);
        const void *dw = up(W.data, W.nbytes), *dxf = up(x, (size_t)n * in * 4), *dxb = up(xb, (size_t)n * in * 2);
        uint8_t *dqw = lunar_cuda_alloc((size_t)out * in);
        float *dsw = lunar_cuda_alloc((size_t)out * 4);
        lunar_cuda_ptpc_quantize(dqw, dsw, dw, LUNAR_CUDA_BF16, out, in, NULL);
        float *ref = test_poisoned((long)n * out), *mag = test_alloc((long)n * out);
        op_set_bf16_operands(1);
        op_matmul_ptpc_fp8(ref, x, &W, n);
        op_set_bf16_operands(0);
        { /* m per element from the CPU's codes */
            uint8_t *qx = malloc((size_t)in), *qw = malloc((size_t)in);
            float *row = test_alloc(in);
            for (int t = 0; t < n; t++) {
                for (int i = 0; i < in; i++) row[i] = lunar_bf16_to_f32(xb[(size_t)t * in + i]);
                const float sx = lunar_ptpc_quantize_row(qx, row, in);
                for (int o = 0; o < out; o++) {
                    for (int i = 0; i < in; i++) row[i] = lunar_bf16_to_f32(((const uint16_t *)W.data)[(size_t)o * in + i]);
                    const float sw = lunar_ptpc_quantize_row(qw, row, in);
                    double m = 0;
                    for (int i = 0; i < in; i++) m += fabs((double)lunar_e4m3_to_f32(qx[i]) * lunar_e4m3_to_f32(qw[i]));
                    mag[(size_t)t * out + o] = (float)(m * sx * sw);
                    for (int i = 0; i < in; i++) row[i] = lunar_bf16_to_f32(xb[(size_t)t * in + i]);
                }
            }
            free(qx), free(qw), free(row);
        }
        for (int v = 0; v < 4; v++) {
            const int bf = v & 1, xf = v >> 1;
            const size_t ybytes = (size_t)n * out * (bf ? 2 : 4);
            guarded by;
            void *dy = guarded_new(&by, ybytes);
            const int rc = lunar_cuda_ptpc_gemv(dy, bf ? LUNAR_CUDA_BF16 : LUNAR_CUDA_F32, xf ? dxf : dxb,
                                                xf ? LUNAR_CUDA_F32 : LUNAR_CUDA_BF16, dqw, dsw, n, out, in, NULL);
            CHECK_MSG(rc == 0, "n=%d out=%d in=%d: the decode kernel refused the shape", n, out, in);
            calls += rc == 0;
            lunar_cuda_sync();
            float *y = download_f32(dy, bf, (long)n * out);
            int fails = 0;
            double e_max = 0;
            for (long i = 0; i < (long)n * out; i++) {
                const double e = fabs((double)y[i] - ref[i]);
                const double tol = ldexp(mag[i], -24) * (in + 2) + (bf ? ldexp(fabs(ref[i]), -8) : 0);
                if (!(e <= tol + 1e-30)) fails++;
                if (mag[i] > 0 && e / mag[i] > e_max) e_max = e / mag[i];
            }
            if (e_max > worst) worst = e_max;
            CHECK_MSG(fails == 0, "n=%d out=%d in=%d y %s x %s: %d elements off (max err/m %.3g)", n, out, in,
                      bf ? "bf16" : "f32", xf ? "f32" : "bf16", fails, e_max);
            CHECK(guards_ok(&by));
            free(y);
        }
        test_tensor_free(&W);
        free(x), free(w), free(xb), free(ref), free(mag);
        lunar_cuda_release(mark);
    }
    /* shapes it must refuse (nothing launched, nothing counted): 5 rows, in % 16 != 0, x over 160 KB */
    CHECK(lunar_cuda_ptpc_gemv(NULL, LUNAR_CUDA_F32, NULL, LUNAR_CUDA_F32, NULL, NULL, 5, 64, 128, NULL) == -1);
    CHECK(lunar_cuda_ptpc_gemv(NULL, LUNAR_CUDA_F32, NULL, LUNAR_CUDA_F32, NULL, NULL, 1, 64, 100, NULL) == -1);
    CHECK(lunar_cuda_ptpc_gemv(NULL, LUNAR_CUDA_F32, NULL, LUNAR_CUDA_F32, NULL, NULL, 4, 64, 10256, NULL) == -1);
    lunar_cuda_ptpc_stats(NULL, NULL, NULL, &g1);
    CHECK(g1 - g0 == calls);
    fprintf(stderr, "[%d decode-kernel calls; max err/m %.3g] ", calls, worst);
}

#endif
