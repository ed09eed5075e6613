/* FP8 e4m3 conversions (all 256 codes, rounding, saturation), the power-of-two-scale quantiser,
 * the Walsh-Hadamard rotation and the non-interleaved RoPE. */
#include "ops.h"
#include "ops_util.h"
#include "test.h"

TEST(e4m3_all_codes_round_trip) {
    int finite = 0;
    for (int c = 0; c < 256; c++) {
        float f = lunar_e4m3_to_f32((uint8_t)c);
        if ((c & 0x7f) == 0x7f) {
            CHECK(isnan(f));
            continue;
        }
        finite++;
        CHECK_MSG(lunar_f32_to_e4m3(f) == c, "code 0x%02x -> %g -> 0x%02x", c, f, lunar_f32_to_e4m3(f));
    }
    CHECK(finite == 254);
    CHECK(lunar_e4m3_to_f32(0x7e) == 448.0f && lunar_e4m3_to_f32(0x01) == ldexpf(1, -9));
    CHECK(lunar_e4m3_to_f32(0x08) == ldexpf(1, -6));
}

TEST(e4m3_rounds_to_nearest_even_and_saturates) {
    /* for every pair of neighbouring positive codes: the midpoint goes to the even code, a hair
     * either side goes to the nearer one */
    for (int c = 0; c < 0x7e; c++) {
        double lo = lunar_e4m3_to_f32((uint8_t)c), hi = lunar_e4m3_to_f32((uint8_t)(c + 1));
        float mid = (float)((lo + hi) / 2); /* exact: 5 significant bits */
        int even = (c & 1) ? c + 1 : c;
        CHECK_MSG(lunar_f32_to_e4m3(mid) == even, "mid %g of 0x%02x", mid, c);
        CHECK_MSG(lunar_f32_to_e4m3(-mid) == (even | 0x80), "-mid %g", -mid);
        CHECK(lunar_f32_to_e4m3(nextafterf(mid, 0)) == c);
        CHECK(lunar_f32_to_e4m3(nextafterf(mid, 1000)) == c + 1);
    }
    /* above 448 (up to and past the would-be 480 midpoint) saturates; Inf too; NaN stays NaN */
    CHECK(lunar_f32_to_e4m3(449) == 0x7e && lunar_f32_to_e4m3(464) == 0x7e && lunar_f32_to_e4m3(1e9f) == 0x7e);
    CHECK(lunar_f32_to_e4m3(-INFINITY) == 0xfe && lunar_f32_to_e4m3(INFINITY) == 0x7e);
    CHECK((lunar_f32_to_e4m3(NAN) & 0x7f) == 0x7f);
    /* below half the smallest subnormal: signed zero */
    CHECK(lunar_f32_to_e4m3(ldexpf(1, -11)) == 0 && lunar_f32_to_e4m3(-ldexpf(1, -11)) == 0x80);
    CHECK(lunar_f32_to_e4m3(ldexpf(1, -10)) == 0);                /* tie 0 | 2^-9: even = 0 */
    CHECK(lunar_f32_to_e4m3(ldexpf(3, -11)) == 1);
}

TEST(fp8_pow2_scale_rule) {
    /* amax 448 -> s = 1; amax 449 -> 2; amax 1 -> 1/448 rounded up = 2^-8; amax 0 -> 1e-4/448 ->
     * 2^-22 (ceil(log2(2.23e-7)) = -22); an exact power-of-two ratio (amax = 448*2^-3) keeps it */
    uint8_t q[4];
    float x[4] = {448, -3, 0.5f, 0};
    CHECK(lunar_fp8_quantize_pow2(q, x, 4) == 1.0f);
    CHECK(q[0] == 0x7e && q[1] == lunar_f32_to_e4m3(-3) && q[2] == lunar_f32_to_e4m3(0.5f) && q[3] == 0);
    x[0] = 449;
    CHECK(lunar_fp8_quantize_pow2(q, x, 4) == 2.0f);
    CHECK(q[0] == lunar_f32_to_e4m3(224.5f));
    float one = 1;
    CHECK(lunar_fp8_quantize_pow2(q, &one, 1) == ldexpf(1, -8) && q[0] == lunar_f32_to_e4m3(256));
    float z[3] = {0, 0, 0};
    CHECK(lunar_fp8_quantize_pow2(q, z, 3) == ldexpf(1, -22) && q[0] == 0);
    float p2 = 56; /* 56 / 448 = 2^-3 exactly */
    CHECK(lunar_fp8_quantize_pow2(q, &p2, 1) == 0.125f && q[0] == 0x7e);
    /* random vectors: s is a power of two, amax/s in (224, 448], and every code is the e4m3 of
     * x/s (exact division), so dequantisation error <= half an e4m3 ulp (relative 2^-4) */
    for (int rep = 0; rep < 20; rep++) {
        float v[128];
        uint8_t c[128];
        float amp = ldexpf(1.0f, rep - 10) * (1.0f + 0.37f * rep);
        lunar_test_fill(v, 128, 100 + rep, -amp, amp);
        float s = lunar_fp8_quantize_pow2(c, v, 128), amax = 0;
        int e;
        CHECK(frexpf(s, &e) == 0.5f);
        for (int i = 0; i < 128; i++) amax = fmaxf(amax, fabsf(v[i]));
        CHECK(amax / s > 224 && amax / s <= 448);
        for (int i = 0; i < 128; i++) {
            CHECK(c[i] == lunar_f32_to_e4m3(v[i] / s));
            CHECK(fabsf(lunar_e4m3_to_f32(c[i]) * s - v[i]) <= fabsf(v[i]) / 16 + ldexpf(1, -10) * s);
        }
    }
}

TEST(hadamard_matches_matrix_and_is_involution) {
    for (int len = 1; len <= 128; len *= 2) {
        const int rows = 3;
        float *x = test_rand(rows * len, 200 + len, -2, 2), *y = test_alloc(rows * len);
        memcpy(y, x, sizeof(float) * rows * len);
        op_hadamard(y, rows, len);
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < len; i++) {
                double s = 0;
                for (int j = 0; j < len; j++)
                    s += (__builtin_popcount(i & j) & 1 ? -1.0 : 1.0) * x[r * len + j];
                s /= sqrt(len);
                /* log2(len) fp32 butterfly levels: a few ulp of the row's scale */
                CHECK_NEAR(y[r * len + i], s, 1e-6 * 2 * sqrt(len));
            }
        op_hadamard(y, rows, len);
        CHECK(lunar_max_rel_err(y, x, rows * len) <= 1e-6);
        free(x), free(y);
    }
    /* orthogonal: dot products preserved (what lets the indexer rotate q and k) */
    float a[128], b[128];
    lunar_test_fill(a, 128, 301, -1, 1), lunar_test_fill(b, 128, 302, -1, 1);
    double d0 = 0, d1 = 0;
    for (int i = 0; i < 128; i++) d0 += (double)a[i] * b[i];
    op_hadamard(a, 1, 128), op_hadamard(b, 1, 128);
    for (int i = 0; i < 128; i++) d1 += (double)a[i] * b[i];
    CHECK_NEAR(d1, d0, 1e-5);
}

TEST(rope_neox_half_split) {
    /* T = 2 tokens at positions 5, 6; 2 heads of 10 dims, rotary on the first 6 (pairs (i, i+3));
     * dims 6..9 untouched. Against the direct formula with theta^(-2i/rot). */
    const int T = 2, nh = 2, hd = 10, rot = 6, pos0 = 5;
    float inv[3];
    for (int i = 0; i < 3; i++) inv[i] = (float)pow(10000.0, -2.0 * i / rot);
    float *x = test_rand(T * nh * hd, 401, -1, 1), *y = test_alloc(T * nh * hd);
    memcpy(y, x, sizeof(float) * T * nh * hd);
    op_rope_neox(y, inv, T, pos0, nh, hd, rot);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < nh; h++) {
            const float *a = x + (t * nh + h) * hd, *b = y + (t * nh + h) * hd;
            for (int i = 0; i < 3; i++) {
                double ang = (pos0 + t) * (double)inv[i];
                CHECK_NEAR(b[i], a[i] * cos(ang) - a[i + 3] * sin(ang), 1e-6);
                CHECK_NEAR(b[i + 3], a[i + 3] * cos(ang) + a[i] * sin(ang), 1e-6);
            }
            for (int i = rot; i < hd; i++) CHECK(b[i] == a[i]);
        }
    /* position 0 is the identity */
    memcpy(y, x, sizeof(float) * T * nh * hd);
    op_rope_neox(y, inv, 1, 0, nh, hd, rot);
    CHECK(memcmp(y, x, sizeof(float) * nh * hd) == 0);
    free(x), free(y);
}

TEST(ptpc_fp8_quantize_row_rule) {
    /* s = amax / 448 in fp32: 3.5 -> 2^-7 (exact) and codes x / s = 448, 128, 64, 0; a zero row
     * gets s = 1 and zero codes; NaN neither sets the scale nor loses its NaN code */
    uint8_t q[4];
    float a[4] = {3.5f, -1, 0.5f, 0};
    CHECK(lunar_ptpc_quantize_row(q, a, 4) == 0.0078125f);
    CHECK(q[0] == 0x7e && q[1] == lunar_f32_to_e4m3(-128) && q[2] == lunar_f32_to_e4m3(64) && q[3] == 0);
    float z[3] = {0, -0.0f, 0};
    CHECK(lunar_ptpc_quantize_row(q, z, 3) == 1.0f && (q[0] | (q[1] & 0x7f) | q[2]) == 0);
    float nn[3] = {NAN, 2.0f, -1.0f};
    CHECK(lunar_ptpc_quantize_row(q, nn, 3) == 2.0f / 448.0f);
    CHECK((q[0] & 0x7f) == 0x7f && q[1] == 0x7e && q[2] == lunar_f32_to_e4m3(-1.0f / (2.0f / 448.0f)));
    /* 0.3 with amax 1: 0.3 / (1/448) = 134.4, between e4m3 128 and 144 -> 128 */
    float r[2] = {1, 0.3f};
    float s = lunar_ptpc_quantize_row(q, r, 2);
    CHECK(s == 1.0f / 448.0f && q[0] == 0x7e && lunar_e4m3_to_f32(q[1]) == 128.0f);
    /* random rows: amax maps to 448 (to within the rounding of two divisions) and every element
     * dequantises to within half an e4m3 ulp (2^-4 relative) or half the smallest subnormal */
    for (int rep = 0; rep < 10; rep++) {
        float v[96];
        uint8_t c[96];
        float amp = ldexpf(1.0f, 3 * rep - 15) * (1.0f + 0.29f * rep);
        lunar_test_fill(v, 96, 300 + rep, -amp, amp);
        float sc = lunar_ptpc_quantize_row(c, v, 96), amax = 0;
        for (int i = 0; i < 96; i++) amax = fmaxf(amax, fabsf(v[i]));
        CHECK(sc == amax / 448.0f);
        for (int i = 0; i < 96; i++) {
            CHECK(c[i] == lunar_f32_to_e4m3(v[i] / sc));
            CHECK(fabsf(lunar_e4m3_to_f32(c[i]) * sc - v[i]) <= fabsf(v[i]) / 16 + ldexpf(1, -10) * sc);
        }
    }
}

TEST(ptpc_fp8_matmul_hand_values) {
    /* W rows: [448, -224, 0, 1] (s_w = 1, exact codes), [3.5, 1, 0.5, 0] (s_w = 2^-7, exact),
     * [0, 0, 0, 0] (s_w = 1, codes 0). Tokens: [7, -7, 3.5, 0] (s_x = 1/64, exact) and
     * [1, 0.3, 0, 0] (s_x = 1/448; 0.3 -> code 128, i.e. 0.2857). */
    const float w[12] = {448, -224, 0, 1, 3.5f, 1, 0.5f, 0, 0, 0, 0, 0};
    const float x[8] = {7, -7, 3.5f, 0, 1, 0.3f, 0, 0};
    for (int dt = 0; dt < 2; dt++) {
        lunar_tensor W = test_tensor2(dt ? LUNAR_DTYPE_BF16 : LUNAR_DTYPE_F32, 3, 4, w);
        float y[6], yd[6];
        op_matmul_ptpc_fp8(y, x, &W, 2);
        op_matmul(yd, x, &W, 2);
        /* token 0: every code exact, so the quantised product equals the plain one */
        CHECK(y[0] == 4704.0f && y[1] == 19.25f && y[2] == 0.0f);
        CHECK(yd[0] == 4704.0f && yd[1] == 19.25f);
        /* token 1: (448*448 + 128*(-224)) / 448 = 384 (plain: 448 - 0.3*224 = 380.8); row 1:
         * (448*448 + 128*128) * 2^-7 / 448 = 3.5 + 0.2857 = 3.7857 (plain 3.8) */
        CHECK_MSG(fabsf(y[3] - 384.0f) < 1e-3f, "y[3] %g", y[3]);
        CHECK_MSG(fabsf(y[4] - (3.5f + 128.0f / 448.0f)) < 1e-6f, "y[4] %g", y[4]);
        CHECK(y[5] == 0.0f && fabsf(yd[3] - 380.8f) < 1e-3f);
        test_tensor_free(&W);
    }
}

TEST(ptpc_fp8_matmul_random_close_to_plain) {
    /* per element, the quantised product is within 2 half-ulps of e4m3 (2^-4 each, plus the
     * subnormal floor) of sum |x||w|: the error bound of two rounded operands */
    const int n = 5, out = 7, in = 37;
    float *x = test_rand(n * in, 11, -2, 2), *w = test_rand(out * in, 12, -0.05f, 0.05f);
    w[3 * in + 5] = 3.0f; /* one large weight: the other weights of row 3 lose precision */
    lunar_tensor W = test_tensor2(LUNAR_DTYPE_BF16, out, in, w);
    float *y = test_poisoned(n * out), *yd = test_poisoned(n * out);
    op_matmul_ptpc_fp8(y, x, &W, n);
    op_matmul(yd, x, &W, n);
    int differs = 0;
    for (int t = 0; t < n; t++)
        for (int o = 0; o < out; o++) {
            double mag = 0;
            for (int i = 0; i < in; i++)
                mag += fabs((double)x[t * in + i] * lunar_bf16_to_f32(lunar_f32_to_bf16(w[o * in + i])));
            float e = fabsf(y[t * out + o] - yd[t * out + o]);
            CHECK_MSG(e <= mag * (2.0 / 16 + 1.0 / 256) + 1e-6, "t %d o %d err %g mag %g", t, o, e, mag);
            differs += e > 0;
        }
    CHECK(differs > n * out / 2); /* it does quantise */
    test_tensor_free(&W);
    free(x), free(w), free(y), free(yd);
}
