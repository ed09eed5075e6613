/* AttnRes mixing, SiTU and LayerNorm against direct double-precision transcriptions of k3_spec
 * 3.2 / 6.1 and torch.nn.LayerNorm. */
#include "ops.h"
#include "ops_util.h"
#include "test.h"

/* k3_spec 3.2 literally: score_i = RMSNorm(v_i; r) . p, alpha = softmax, m = sum alpha_i v_i,
 * out = RMSNorm(m; on) (on may be NULL). Everything in double. */
static void attnres_ref(double *out, float *const *src, int S, const float *p, const float *r,
                        const float *on, int n, int D, double eps) {
    double *sc = malloc(sizeof(double) * S), *m = malloc(sizeof(double) * D);
    for (int t = 0; t < n; t++) {
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i < S; i++) {
            const float *v = src[i] + (size_t)t * D;
            double ss = 0, dot = 0;
            for (int d = 0; d < D; d++) ss += (double)v[d] * v[d];
            double inv = 1 / sqrt(ss / D + eps);
            for (int d = 0; d < D; d++) dot += ((double)v[d] * inv * r[d]) * p[d];
            sc[i] = dot;
            mx = fmax(mx, dot);
        }
        for (int i = 0; i < S; i++) sum += exp(sc[i] - mx);
        for (int d = 0; d < D; d++) m[d] = 0;
        for (int i = 0; i < S; i++)
            for (int d = 0; d < D; d++) m[d] += exp(sc[i] - mx) / sum * src[i][(size_t)t * D + d];
        double inv = 1;
        if (on) {
            double ss = 0;
            for (int d = 0; d < D; d++) ss += m[d] * m[d];
            inv = 1 / sqrt(ss / D + eps);
        }
        for (int d = 0; d < D; d++) out[(size_t)t * D + d] = on ? m[d] * inv * on[d] : m[d];
    }
    free(sc), free(m);
}

/* The op sums in double like the reference; the only fp32 roundings are the folded u = r*p, the
 * inputs' widening (exact) and the final store: ~1e-7 relative. 2e-6 leaves room and still
 * catches a wrong eps (1e-5 on values of size ~1 moves scores by ~1e-5), a missing norm weight or
 * a 1/sqrt(D) factor (order-1 errors). Sources span different scales so the softmax is not flat. */
static void check_attnres(int S, int n, int D, int with_out_norm, lunar_dtype dt, unsigned seed) {
    float *src[9];
    for (int i = 0; i < S; i++) {
        float amp = 0.2f + 0.7f * (float)i;
        src[i] = test_rand((long)n * D, seed + 10 * i, -amp, amp);
    }
    float *p = test_rand(D, seed + 100, -1, 1), *r = test_rand(D, seed + 101, 0.5f, 1.5f);
    float *on = test_rand(D, seed + 102, 0.5f, 1.5f);
    /* round the weights to dt so the reference sees what the op sees */
    lunar_tensor P = test_tensor2(dt, 1, D, p), R = test_tensor1(dt, D, r), O = test_tensor1(dt, D, on);
    lunar_tensor_read_f32(&P, 0, D, p), lunar_tensor_read_f32(&R, 0, D, r), lunar_tensor_read_f32(&O, 0, D, on);
    float *out = test_poisoned((long)n * D), *outf = test_alloc((long)n * D);
    double *ref = malloc(sizeof(double) * n * D);
    op_attnres_mix(out, (const float *const *)src, S, &P, &R, with_out_norm ? &O : NULL, n, D, 1e-5f);
    attnres_ref(ref, src, S, p, r, with_out_norm ? on : NULL, n, D, 1e-5);
    for (long i = 0; i < (long)n * D; i++) outf[i] = (float)ref[i];
    double e = lunar_max_rel_err(out, outf, (long)n * D);
    CHECK_MSG(e <= 2e-6, "attnres S=%d n=%d D=%d on=%d: %.3g", S, n, D, with_out_norm, e);
    for (int i = 0; i < S; i++) free(src[i]);
    test_tensor_free(&P), test_tensor_free(&R), test_tensor_free(&O);
    free(p), free(r), free(on), free(out), free(outf), free(ref);
}

TEST(attnres_mix_matches_formula) {
    check_attnres(1, 3, 7, 1, LUNAR_DTYPE_F32, 1);
    check_attnres(2, 4, 33, 1, LUNAR_DTYPE_BF16, 2);
    check_attnres(5, 3, 101, 1, LUNAR_DTYPE_F32, 3);
    check_attnres(5, 2, 101, 0, LUNAR_DTYPE_BF16, 4); /* without the out-norm: the raw mix m */
    check_attnres(9, 1, 65, 1, LUNAR_DTYPE_F32, 5);   /* K3's output mix has 9 candidates */
}

TEST(attnres_single_source_is_identity_mix) {
    /* S = 1: softmax is exactly 1, so m = v_0 bit for bit (ATOM's shortcut: out = RMSNorm(v_0)) */
    const int n = 2, D = 19;
    float *v = test_rand(n * D, 7, -3, 3), *p = test_rand(D, 8, -1, 1), *r = test_rand(D, 9, 0, 2);
    lunar_tensor P = test_tensor1(LUNAR_DTYPE_F32, D, p), R = test_tensor1(LUNAR_DTYPE_F32, D, r);
    float *out = test_poisoned(n * D);
    const float *src[1] = {v};
    op_attnres_mix(out, src, 1, &P, &R, NULL, n, D, 1e-5f);
    CHECK(memcmp(out, v, sizeof(float) * n * D) == 0);
    test_tensor_free(&P), test_tensor_free(&R);
    free(v), free(p), free(r), free(out);
}

TEST(attnres_scores_use_normed_sources) {
    /* Two sources that are positive multiples of each other have the same RMSNorm, hence equal
     * scores: m is their plain average whatever p is. A missing normalisation breaks this. */
    const int D = 9;
    float a[9], b[9], p[9], r[9], out[9];
    for (int d = 0; d < D; d++) a[d] = (float)(d - 4) + 0.5f, b[d] = 8.0f * a[d], p[d] = 1.0f + d, r[d] = 1;
    lunar_tensor P = test_tensor1(LUNAR_DTYPE_F32, D, p), R = test_tensor1(LUNAR_DTYPE_F32, D, r);
    const float *src[2] = {a, b};
    op_attnres_mix(out, src, 2, &P, &R, NULL, 1, D, 0.0f);
    for (int d = 0; d < D; d++) CHECK_NEAR(out[d], 4.5f * a[d], 1e-5 * fabs(4.5 * a[d]) + 1e-6);
    test_tensor_free(&P), test_tensor_free(&R);
}

static double situ_ref(double g, double u, double beta, double beta_l) {
    return beta * tanh(g / beta) / (1 + exp(-g)) * (beta_l > 0 ? beta_l * tanh(u / beta_l) : u);
}

TEST(situ_matches_formula) {
    /* fp32 tanhf/expf: a few ulp each, ~5e-7 relative on the product; inputs span the tanh
     * saturation of both branches (|g| >> 4, |u| >> 25) */
    const long n = 301;
    float *g = test_rand(n, 21, -30, 30), *u = test_rand(n, 22, -80, 80), *y = test_poisoned(n);
    op_situ_mul(y, g, u, n, 4.0f, 25.0f);
    for (long i = 0; i < n; i++) {
        double want = situ_ref(g[i], u[i], 4, 25);
        CHECK_NEAR(y[i], want, 2e-6 * fabs(want) + 1e-30);
    }
    /* no linear beta: u unchanged */
    op_situ_mul(y, g, u, n, 4.0f, 0.0f);
    for (long i = 0; i < n; i++) {
        double want = situ_ref(g[i], u[i], 4, 0);
        CHECK_NEAR(y[i], want, 2e-6 * fabs(want) + 1e-30);
    }
    /* spot values: SiTU(1, 2) = 4 tanh(.25) sigma(1) * 25 tanh(.08) */
    float g1 = 1, u1 = 2, y1;
    op_situ_mul(&y1, &g1, &u1, 1, 4.0f, 25.0f);
    CHECK_NEAR(y1, 4 * tanh(0.25) / (1 + exp(-1.0)) * 25 * tanh(0.08), 1e-6);
    /* beta -> infinity tends to SwiGLU */
    float ys, yw;
    op_situ_mul(&ys, &g1, &u1, 1, 1e6f, 1e6f);
    op_silu_mul(&yw, &g1, &u1, 1);
    CHECK_NEAR(ys, yw, 1e-5);
    free(g), free(u), free(y);
}

TEST(situ_mlp_matches_composition) {
    const int n = 3, D = 13, I = 21;
    float *x = test_rand(n * D, 31, -1, 1), *wg = test_rand(I * D, 32, -1, 1);
    float *wu = test_rand(I * D, 33, -1, 1), *wd = test_rand(D * I, 34, -1, 1);
    lunar_tensor G = test_tensor2(LUNAR_DTYPE_BF16, I, D, wg), U = test_tensor2(LUNAR_DTYPE_BF16, I, D, wu);
    lunar_tensor Dn = test_tensor2(LUNAR_DTYPE_BF16, D, I, wd);
    float *y = test_poisoned(n * D), *yr = test_alloc(n * D), *g = test_alloc(n * I), *u = test_alloc(n * I);
    op_situ_mlp(y, x, &G, &U, &Dn, n, 4.0f, 25.0f);
    /* composition of tested ops: bitwise the same sequence */
    op_matmul(g, x, &G, n), op_matmul(u, x, &U, n);
    op_situ_mul(g, g, u, (long)n * I, 4.0f, 25.0f);
    op_matmul(yr, g, &Dn, n);
    CHECK(memcmp(y, yr, sizeof(float) * n * D) == 0);
    /* op_glu dispatches to both activations */
    lunar_glu sw = {LUNAR_GLU_SWIGLU, 0, 0}, st = {LUNAR_GLU_SITU, 4, 25};
    float a = 0.7f, b = -1.3f, r1, r2;
    op_glu(&r1, &a, &b, 1, &sw), op_silu_mul(&r2, &a, &b, 1);
    CHECK(r1 == r2);
    op_glu(&r1, &a, &b, 1, &st), op_situ_mul(&r2, &a, &b, 1, 4, 25);
    CHECK(r1 == r2);
    test_tensor_free(&G), test_tensor_free(&U), test_tensor_free(&Dn);
    free(x), free(wg), free(wu), free(wd), free(y), free(yr), free(g), free(u);
}

TEST(layernorm_matches_formula) {
    /* double sums; fp32 store: ~1e-7 relative. Offset inputs (mean 5) test the centring. */
    const int n = 3, D = 37;
    float *x = test_rand(n * D, 41, 4, 6), *w = test_rand(D, 42, 0.5f, 1.5f), *b = test_rand(D, 43, -1, 1);
    lunar_tensor W = test_tensor1(LUNAR_DTYPE_F32, D, w), B = test_tensor1(LUNAR_DTYPE_F32, D, b);
    float *y = test_poisoned(n * D);
    op_layernorm(y, x, &W, &B, n, D, 1e-6f);
    for (int t = 0; t < n; t++) {
        double mean = 0, var = 0;
        for (int d = 0; d < D; d++) mean += x[t * D + d];
        mean /= D;
        for (int d = 0; d < D; d++) var += (x[t * D + d] - mean) * (x[t * D + d] - mean);
        var /= D;
        for (int d = 0; d < D; d++) {
            double want = (x[t * D + d] - mean) / sqrt(var + 1e-6) * w[d] + b[d];
            CHECK_NEAR(y[t * D + d], want, 1e-6 * (fabs(want) + 1));
        }
    }
    /* in place, no weight/bias: zero mean, unit variance */
    op_layernorm(x, x, NULL, NULL, n, D, 0.0f);
    double m = 0, v = 0;
    for (int d = 0; d < D; d++) m += x[d];
    for (int d = 0; d < D; d++) v += x[d] * x[d];
    CHECK_NEAR(m / D, 0, 1e-6);
    CHECK_NEAR(v / D, 1, 1e-5);
    test_tensor_free(&W), test_tensor_free(&B);
    free(x), free(w), free(b), free(y);
}
