/* MXFP4: decoding hand-made bytes, the E8M0 255 rule, quantise -> dequantise bounds, matmul and the
 * expert MLP against the dequantised weight. */
#include "base/err.h"
#include "ops.h"
#include "ops_util.h"
#include "test.h"

typedef struct {
    lunar_tensor p, s;
    lunar_mxfp4 w;
    uint8_t *pb, *sb;
} mx_mat;

static void mx_alloc(mx_mat *m, int out, int in) {
    memset(m, 0, sizeof *m);
    m->pb = calloc((size_t)out * in / 2, 1);
    m->sb = calloc((size_t)out * in / 32, 1);
    m->p.dtype = m->s.dtype = LUNAR_DTYPE_U8;
    m->p.ndim = m->s.ndim = 2;
    m->p.shape[0] = m->s.shape[0] = out;
    m->p.shape[1] = in / 2, m->s.shape[1] = in / 32;
    m->p.data = m->pb, m->s.data = m->sb;
    m->p.nbytes = (size_t)out * in / 2, m->s.nbytes = (size_t)out * in / 32;
    m->p.name = "experts.0.w1.weight_packed";
    m->w.packed = &m->p, m->w.scale = &m->s;
}
static void mx_from(mx_mat *m, const float *W, int out, int in) {
    mx_alloc(m, out, in);
    for (int r = 0; r < out; r++)
        lunar_mxfp4_quantize_row(m->pb + (size_t)r * in / 2, m->sb + (size_t)r * in / 32, W + (size_t)r * in, in);
}
static void mx_free(mx_mat *m) { free(m->pb), free(m->sb); }

TEST(mxfp4_decode_hand_made_bytes) {
    const float lut[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -.5f, -1, -1.5f, -2, -3, -4, -6};
    for (int c = 0; c < 16; c++) CHECK(lunar_e2m1_to_f32((uint8_t)c) == lut[c]);
    CHECK(signbit(lunar_e2m1_to_f32(8)));
    CHECK(lunar_e8m0_to_f32(127) == 1.0f && lunar_e8m0_to_f32(128) == 2.0f);
    CHECK(lunar_e8m0_to_f32(0) == ldexpf(1, -127) && lunar_e8m0_to_f32(254) == ldexpf(1, 127));
    CHECK(isnan(lunar_e8m0_to_f32(255)));
    /* one row of 64 inputs: byte j holds column 2j in its low nibble */
    mx_mat m;
    mx_alloc(&m, 1, 64);
    m.pb[0] = 0x71;  /* col 0 = code 1 (0.5), col 1 = code 7 (6) */
    m.pb[1] = 0xA3;  /* col 2 = 1.5, col 3 = code 0xA (-1) */
    m.pb[16] = 0x9F; /* group 1: col 32 = -6, col 33 = -0.5 */
    m.sb[0] = 126;   /* 2^-1 */
    m.sb[1] = 130;   /* 2^3 */
    float row[64];
    test_poison(row, 64);
    lunar_mxfp4_dequant_row(row, &m.w, 0);
    CHECK(row[0] == 0.25f && row[1] == 3.0f && row[2] == 0.75f && row[3] == -0.5f);
    CHECK(row[32] == -48.0f && row[33] == -4.0f);
    for (int i = 4; i < 32; i++) CHECK(row[i] == 0.0f);
    for (int i = 34; i < 64; i++) CHECK(row[i] == 0.0f);
    mx_free(&m);
}

TEST(mxfp4_scale_255_rule) {
    /* the loader's validation names the tensor and the first bad block; the kernel gives NaN for
     * exactly the 32 weights of that block */
    mx_mat m;
    mx_alloc(&m, 3, 64);
    memset(m.sb, 127, 6);
    memset(m.pb, 0x22, 3 * 32);
    lunar_err err;
    CHECK(lunar_mxfp4_validate(&m.w, "experts.0.w1", &err) == 0);
    m.sb[3] = 255; /* row 1, group 1 */
    CHECK(lunar_mxfp4_validate(&m.w, "experts.0.w1", &err) == -1);
    CHECK_MSG(strstr(err.msg, "experts.0.w1") && strstr(err.msg, "[1, 1]") && strstr(err.msg, "255"), "%s", err.msg);
    float row[64];
    lunar_mxfp4_dequant_row(row, &m.w, 1);
    for (int i = 0; i < 32; i++) CHECK(row[i] == 1.0f);
    for (int i = 32; i < 64; i++) CHECK(isnan(row[i]));
    float x[64], y[3];
    for (int i = 0; i < 64; i++) x[i] = 1;
    op_matmul_mxfp4(y, x, &m.w, 1);
    CHECK(y[0] == 64 && isnan(y[1]) && y[2] == 64);
    /* bad shapes and dtypes are refused too */
    m.s.shape[1] = 3;
    CHECK(lunar_mxfp4_validate(&m.w, "x", &err) == -1);
    m.s.shape[1] = 2, m.s.dtype = LUNAR_DTYPE_I8;
    CHECK(lunar_mxfp4_validate(&m.w, "x", &err) == -1);
    mx_free(&m);
}

TEST(mxfp4_quantize_rounding_and_scale) {
    float x[32] = {0};
    uint8_t p[16], s;
    /* amax 6 -> floor(log2 6) - 2 = 0: scale 2^0, byte 127; the values sit on the E2M1 grid,
     * midpoints round to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
     * 3.5 -> 4, 5 -> 4), saturation only at the top (amax maps into [4, 8)) */
    const float in[16] = {6, -0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, -5.1f, 0.3f, -1.4f, 2.6f, 0.1f, -0.0f, 4.4f, 1.0f};
    const float want[16] = {6, -0.0f, 1, 1, 2, 2, 4, 4, -6, 0.5f, -1.5f, 3, 0, -0.0f, 4, 1};
    memcpy(x, in, sizeof in);
    lunar_mxfp4_quantize_row(p, &s, x, 32);
    CHECK(s == 127);
    for (int i = 0; i < 16; i++) {
        float got = lunar_e2m1_to_f32((i & 1) ? p[i / 2] >> 4 : p[i / 2] & 15);
        CHECK_MSG(got == want[i], "x=%g -> %g, want %g", in[i], got, want[i]);
    }
    /* amax 7.9 still -> exponent 0 (floor(log2 7.9) = 2) and 7.9 saturates to 6 */
    x[0] = 7.9f;
    lunar_mxfp4_quantize_row(p, &s, x, 32);
    CHECK(s == 127 && (p[0] & 15) == 7);
    /* amax 8 -> scale 2: 8 -> 4 exactly */
    x[0] = 8;
    lunar_mxfp4_quantize_row(p, &s, x, 32);
    CHECK(s == 128 && (p[0] & 15) == 6);
    /* all zero -> byte 0, codes 0; NaN -> byte 255 */
    memset(x, 0, sizeof x);
    lunar_mxfp4_quantize_row(p, &s, x, 32);
    CHECK(s == 0 && p[0] == 0);
    x[5] = NAN;
    lunar_mxfp4_quantize_row(p, &s, x, 32);
    CHECK(s == 255);
    /* tiny amax: exponent clamps at -127 */
    memset(x, 0, sizeof x);
    x[0] = ldexpf(1, -130);
    lunar_mxfp4_quantize_row(p, &s, x, 32);
    CHECK(s == 0);
}

TEST(mxfp4_quantize_dequantize_error_bound) {
    /* After scaling each block maps into |v| < 8 with amax in [4, 8): elements in [4, 6] have
     * spacing 2 (error <= 1, i.e. <= 1/4 of 2^(e+2) <= amax), in [2, 4) spacing 1, ..., and the
     * saturation error above 6 is < 2. So |x - dq| <= 2^e * 2 <= amax / 2 per element, and in the
     * grid interior (|v| <= 6) half the local spacing. Check the sharp per-element bound: error
     * <= half the spacing of the E2M1 interval containing |x / 2^e|, or |v| - 6 when saturated. */
    const int out = 5, in = 96;
    float *W = test_rand(out * in, 51, -3, 3);
    for (int i = 0; i < in; i++) W[2 * in + i] *= 1e-20f; /* a row of tiny values */
    W[4 * in + 7] = 1000;                                 /* one outlier block */
    mx_mat m;
    mx_from(&m, W, out, in);
    float *row = test_alloc(in);
    for (int r = 0; r < out; r++) {
        lunar_mxfp4_dequant_row(row, &m.w, r);
        for (int i = 0; i < in; i++) {
            float sc = lunar_e8m0_to_f32(m.sb[r * in / 32 + i / 32]);
            double v = fabs(W[r * in + i]) / sc;
            double half = v < 2 ? 0.25 : v < 4 ? 0.5 : 1.0;
            double bound = (v > 6 ? v - 6 : half) * sc;
            CHECK_MSG(fabs(row[i] - W[r * in + i]) <= bound * (1 + 1e-6), "r=%d i=%d %g vs %g", r, i, row[i], W[r * in + i]);
            CHECK(sc > 0 && fabs(W[r * in + i]) / sc < 8);
        }
    }
    free(W), free(row);
    mx_free(&m);
}

/* y = x . W^T against the same matmul on the dequantised weight as an F32 tensor and a double
 * sum: the dequantised weights are exact, so only fp32 summation order differs: ~1e-6 relative. */
TEST(mxfp4_matmul_matches_dequantised) {
    const int out = 7, in = 160;
    for (int n = 1; n <= 5; n += 4) {
        float *W = test_rand(out * in, 61 + n, -2, 2), *x = test_rand(n * in, 62 + n, -1, 1);
        mx_mat m;
        mx_from(&m, W, out, in);
        float *Wd = test_alloc(out * in);
        for (int r = 0; r < out; r++) lunar_mxfp4_dequant_row(Wd + r * in, &m.w, r);
        lunar_tensor T = test_tensor2(LUNAR_DTYPE_F32, out, in, Wd);
        float *y = test_poisoned(n * out), *yd = test_poisoned(n * out), *yr = test_alloc(n * out);
        op_matmul_mxfp4(y, x, &m.w, n);
        op_matmul(yd, x, &T, n);
        for (int t = 0; t < n; t++)
            for (int r = 0; r < out; r++) {
                double s = 0;
                for (int i = 0; i < in; i++) s += (double)x[t * in + i] * Wd[r * in + i];
                yr[t * out + r] = (float)s;
            }
        CHECK(lunar_max_rel_err(y, yr, n * out) <= 2e-6);
        CHECK(lunar_max_rel_err(y, yd, n * out) <= 2e-6);
        test_tensor_free(&T);
        free(W), free(x), free(Wd), free(y), free(yd), free(yr);
        mx_free(&m);
    }
}

TEST(mxfp4_mlp_matches_dequantised_mlp) {
    /* expert D = 64, I = 96, both activations, against op_situ_mlp / op_swiglu_mlp on the
     * dequantised weights (the same function; fp32 summation order only) */
    const int n = 3, D = 64, I = 96;
    float *w1 = test_rand(I * D, 71, -1, 1), *w3 = test_rand(I * D, 72, -1, 1), *w2 = test_rand(D * I, 73, -1, 1);
    float *x = test_rand(n * D, 74, -1, 1);
    mx_mat m1, m3, m2;
    mx_from(&m1, w1, I, D), mx_from(&m3, w3, I, D), mx_from(&m2, w2, D, I);
    for (int r = 0; r < I; r++) lunar_mxfp4_dequant_row(w1 + r * D, &m1.w, r), lunar_mxfp4_dequant_row(w3 + r * D, &m3.w, r);
    for (int r = 0; r < D; r++) lunar_mxfp4_dequant_row(w2 + r * I, &m2.w, r);
    lunar_tensor G = test_tensor2(LUNAR_DTYPE_F32, I, D, w1), U = test_tensor2(LUNAR_DTYPE_F32, I, D, w3);
    lunar_tensor Dn = test_tensor2(LUNAR_DTYPE_F32, D, I, w2);
    float *y = test_poisoned(n * D), *yr = test_poisoned(n * D);
    lunar_glu situ = {LUNAR_GLU_SITU, 4, 25}, swiglu = {LUNAR_GLU_SWIGLU, 0, 0};
    op_mxfp4_mlp(y, x, &m1.w, &m3.w, &m2.w, n, &situ);
    op_situ_mlp(yr, x, &G, &U, &Dn, n, 4, 25);
    CHECK(lunar_max_rel_err(y, yr, n * D) <= 1e-5);
    op_mxfp4_mlp(y, x, &m1.w, &m3.w, &m2.w, n, &swiglu);
    op_swiglu_mlp(yr, x, &G, &U, &Dn, n);
    CHECK(lunar_max_rel_err(y, yr, n * D) <= 1e-5);
    test_tensor_free(&G), test_tensor_free(&U), test_tensor_free(&Dn);
    mx_free(&m1), mx_free(&m3), mx_free(&m2);
    free(w1), free(w3), free(w2), free(x), free(y), free(yr);
}
