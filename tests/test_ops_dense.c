/* Dense ops against straightforward double-precision formulas. */
#include "ops.h"
#include "ops_util.h"
#include "test.h"

/* fp32 dot products of length `in` against an exact double reference: each product is exact in
 * double and the fp32 sum errs by at most ~in * 2^-24 * sum|x w|; 1e-5 * sum|x w| bounds that for
 * in <= 257 with a wide margin and catches any wrong index. */
static void check_matmul(lunar_dtype dt, int n, int out, int in, unsigned seed) {
    float *x = test_rand((long)n * in, seed, -1, 1), *wv = test_rand((long)out * in, seed + 1, -1, 1);
    lunar_tensor W = test_tensor2(dt, out, in, wv);
    float *wide = test_alloc((long)out * in), *y = test_poisoned((long)n * out);
    lunar_tensor_read_f32(&W, 0, (int64_t)out * in, wide); /* the values the op actually sees */
    op_matmul(y, x, &W, n);
    int bad = 0;
    for (int t = 0; t < n; t++) {
        for (int o = 0; o < out; o++) {
            double ref = 0, mag = 0;
            for (int i = 0; i < in; i++) {
                ref += (double)x[t * in + i] * wide[o * in + i];
                mag += fabs((double)x[t * in + i] * wide[o * in + i]);
            }
            double got = y[t * out + o];
            if (!(fabs(got - ref) <= 1e-5 * mag + 1e-30)) bad++;
        }
    }
    CHECK_MSG(bad == 0, "matmul %s n=%d out=%d in=%d: %d bad entries", lunar_dtype_name(dt), n,
              out, in, bad);
    test_tensor_free(&W);
    free(x), free(wv), free(wide), free(y);
}

TEST(matmul_f32_bf16_f16_odd_sizes) {
    /* n = 5 and 17 exercise the 4-token block plus the tail, n = 1 and 3 the tail alone */
    static const int shapes[][3] = {{1, 1, 1}, {1, 7, 13}, {5, 33, 70}, {3, 129, 257}, {17, 5, 64}};
    lunar_dtype dts[3] = {LUNAR_DTYPE_F32, LUNAR_DTYPE_BF16, LUNAR_DTYPE_F16};
    for (int d = 0; d < 3; d++)
        for (unsigned s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            check_matmul(dts[d], shapes[s][0], shapes[s][1], shapes[s][2], 10 * s + d);
}

TEST(matmul_bf16_widening_is_exact) {
    /* bf16 values that are exactly representable: the result must be exact too (small sums) */
    float wv[6] = {1.0f, -2.0f, 0.5f, 3.0f, 0.25f, -1.5f}, x[3] = {2.0f, 1.0f, -4.0f};
    lunar_tensor W = test_tensor2(LUNAR_DTYPE_BF16, 2, 3, wv);
    float y[2] = {NAN, NAN};
    op_matmul(y, x, &W, 1);
    CHECK(y[0] == 2.0f - 2.0f - 2.0f);
    CHECK(y[1] == 6.0f + 0.25f + 6.0f);
    test_tensor_free(&W);
}

TEST(embedding_rows) {
    float *ev = test_rand(11 * 6, 3, -2, 2);
    lunar_tensor E = test_tensor2(LUNAR_DTYPE_BF16, 11, 6, ev);
    int32_t ids[4] = {10, 0, 3, 3};
    float *y = test_poisoned(4 * 6);
    op_embedding(y, &E, ids, 4);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 6; j++)
            CHECK(y[i * 6 + j] == lunar_bf16_to_f32(lunar_f32_to_bf16(ev[ids[i] * 6 + j])));
    test_tensor_free(&E);
    free(ev), free(y);
}

TEST(rmsnorm_formula_weight_null_and_alias) {
    const int n = 3, dim = 37;
    const float eps = 1e-5f;
    float *x = test_rand(n * dim, 5, -3, 3), *wv = test_rand(dim, 6, 0.5f, 1.5f);
    lunar_tensor w = test_tensor1(LUNAR_DTYPE_BF16, dim, wv);
    float *y = test_poisoned(n * dim), *y0 = test_poisoned(n * dim), *ya = test_alloc(n * dim);
    memcpy(ya, x, sizeof(float) * n * dim);
    op_rmsnorm(y, x, &w, n, dim, eps);
    op_rmsnorm(y0, x, NULL, n, dim, eps);
    op_rmsnorm(ya, ya, &w, n, dim, eps); /* in place */
    for (int t = 0; t < n; t++) {
        double ss = 0;
        for (int i = 0; i < dim; i++) ss += (double)x[t * dim + i] * x[t * dim + i];
        double r = 1.0 / sqrt(ss / dim + eps);
        for (int i = 0; i < dim; i++) {
            double wi = lunar_tensor_get_f32(&w, i), ref0 = x[t * dim + i] * r;
            CHECK_NEAR(y0[t * dim + i], ref0, 1e-6 * fabs(ref0) + 1e-7);
            CHECK_NEAR(y[t * dim + i], ref0 * wi, 1e-6 * fabs(ref0 * wi) + 1e-7);
            CHECK(ya[t * dim + i] == y[t * dim + i]);
        }
    }
    test_tensor_free(&w);
    free(x), free(wv), free(y), free(y0), free(ya);
}

TEST(rmsnorm_gated_formula) {
    const int n = 4, dim = 24;
    const float eps = 1e-5f;
    float *x = test_rand(n * dim, 7, -2, 2), *gt = test_rand(n * dim, 8, -4, 4);
    float *wv = test_rand(dim, 9, 0.5f, 1.5f);
    lunar_tensor w = test_tensor1(LUNAR_DTYPE_F32, dim, wv);
    float *y = test_poisoned(n * dim);
    op_rmsnorm_gated(y, x, gt, &w, n, dim, eps);
    for (int t = 0; t < n; t++) {
        double ss = 0;
        for (int i = 0; i < dim; i++) ss += (double)x[t * dim + i] * x[t * dim + i];
        double r = 1.0 / sqrt(ss / dim + eps);
        for (int i = 0; i < dim; i++) {
            double ref = x[t * dim + i] * r * wv[i] / (1.0 + exp(-(double)gt[t * dim + i]));
            CHECK_NEAR(y[t * dim + i], ref, 1e-6 * fabs(ref) + 1e-7);
        }
    }
    /* alias y == x */
    float *xa = test_alloc(n * dim);
    memcpy(xa, x, sizeof(float) * n * dim);
    op_rmsnorm_gated(xa, xa, gt, &w, n, dim, eps);
    CHECK(memcmp(xa, y, sizeof(float) * n * dim) == 0);
    test_tensor_free(&w);
    free(x), free(gt), free(wv), free(y), free(xa);
}

TEST(l2norm_formula) {
    const int n = 5, dim = 19;
    float *x = test_rand(n * dim, 11, -1, 1), *y = test_poisoned(n * dim);
    x[0 * dim + 0] = 0; /* a zero row stays finite thanks to eps */
    for (int i = 0; i < dim; i++) x[4 * dim + i] = 0.0f;
    op_l2norm(y, x, n, dim, 1e-6f);
    for (int t = 0; t < n; t++) {
        double ss = 0;
        for (int i = 0; i < dim; i++) ss += (double)x[t * dim + i] * x[t * dim + i];
        for (int i = 0; i < dim; i++) {
            double ref = x[t * dim + i] / sqrt(ss + 1e-6);
            CHECK_NEAR(y[t * dim + i], ref, 1e-6 * fabs(ref) + 1e-8);
        }
    }
    op_l2norm(x, x, n, dim, 1e-6f);
    CHECK(memcmp(x, y, sizeof(float) * n * dim) == 0);
    free(x), free(y);
}

TEST(silu_mul_and_swiglu_mlp) {
    const int n = 3, D = 21, I = 34;
    float *x = test_rand(n * D, 12, -1, 1);
    float *gv = test_rand(I * D, 13, -0.5f, 0.5f), *uv = test_rand(I * D, 14, -0.5f, 0.5f);
    float *dv = test_rand(D * I, 15, -0.5f, 0.5f);
    lunar_tensor Wg = test_tensor2(LUNAR_DTYPE_BF16, I, D, gv), Wu = test_tensor2(LUNAR_DTYPE_F16, I, D, uv);
    lunar_tensor Wd = test_tensor2(LUNAR_DTYPE_F32, D, I, dv);
    float *y = test_poisoned(n * D);
    op_swiglu_mlp(y, x, &Wg, &Wu, &Wd, n);
    for (int t = 0; t < n; t++) {
        double h[64];
        for (int i = 0; i < I; i++) {
            double a = 0, b = 0;
            for (int j = 0; j < D; j++) {
                a += (double)x[t * D + j] * lunar_tensor_get_f32(&Wg, i * D + j);
                b += (double)x[t * D + j] * lunar_tensor_get_f32(&Wu, i * D + j);
            }
            h[i] = a / (1.0 + exp(-a)) * b;
        }
        for (int o = 0; o < D; o++) {
            double ref = 0;
            for (int i = 0; i < I; i++) ref += h[i] * dv[o * I + i];
            CHECK_NEAR(y[t * D + o], ref, 1e-5);
        }
    }
    /* silu_mul, aliased to up */
    float g[3] = {-1.0f, 0.0f, 2.0f}, u[3] = {2.0f, 5.0f, -1.0f};
    op_silu_mul(u, g, u, 3);
    CHECK_NEAR(u[0], -1.0 / (1.0 + exp(1.0)) * 2.0, 1e-7);
    CHECK(u[1] == 0.0f);
    CHECK_NEAR(u[2], -2.0 / (1.0 + exp(-2.0)), 1e-7);
    test_tensor_free(&Wg), test_tensor_free(&Wu), test_tensor_free(&Wd);
    free(x), free(gv), free(uv), free(dv), free(y);
}
