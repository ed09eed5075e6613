/* CPU reference: MXFP4 (OCP MX E2M1 elements, E8M0 scales per 32) in the compressed-tensors
 * "mxfp4-pack-quantized" layout: dequantisation, validation, quantisation, matmul and an expert MLP.
 * Every dequantised weight E2M1 * 2^(s-127) is exact in fp32 (3 significant bits, exponent within
 * fp32's range incl. subnormals down to 0.5 * 2^-127). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "ops.h"

static const float e2m1_mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

float lunar_e2m1_to_f32(uint8_t code) {
    float m = e2m1_mag[code & 7];
    return (code & 8) ? -m : m;
}

float lunar_e8m0_to_f32(uint8_t s) { return s == 255 ? NAN : ldexpf(1.0f, (int)s - 127); }

static void shape_of(const lunar_mxfp4 *w, int64_t *out, int64_t *in) {
    *out = w->packed->shape[0];
    *in = w->packed->shape[1] * 2;
}

int lunar_mxfp4_validate(const lunar_mxfp4 *w, const char *name, lunar_err *err) {
    const lunar_tensor *p = w->packed, *s = w->scale;
    if (!name) name = "?";
    if (p->dtype != LUNAR_DTYPE_U8 || s->dtype != LUNAR_DTYPE_U8)
        return lunar_fail(err, "MXFP4 tensor %s: weight_packed and weight_scale must be U8", name);
    if (p->ndim != 2 || s->ndim != 2 || p->shape[0] != s->shape[0] || (p->shape[1] * 2) % 32 != 0 ||
        s->shape[1] != p->shape[1] * 2 / 32)
        return lunar_fail(err,
                          "MXFP4 tensor %s: shapes packed [%lld, %lld] / scale [%lld, %lld] do not "
                          "match [out, in/2] / [out, in/32]",
                          name, (long long)p->shape[0], (long long)(p->ndim > 1 ? p->shape[1] : 0),
                          (long long)s->shape[0], (long long)(s->ndim > 1 ? s->shape[1] : 0));
    const uint8_t *sc = s->data;
    int64_t n = s->shape[0] * s->shape[1];
    const uint8_t *hit = memchr(sc, 255, (size_t)n);
    if (hit) {
        int64_t i = hit - sc;
        return lunar_fail(err,
                          "MXFP4 tensor %s: weight_scale[%lld, %lld] is 255 (E8M0 NaN): input "
                          "columns %lld..%lld of row %lld have no value",
                          name, (long long)(i / s->shape[1]), (long long)(i % s->shape[1]),
                          (long long)(i % s->shape[1] * 32), (long long)(i % s->shape[1] * 32 + 31),
                          (long long)(i / s->shape[1]));
    }
    return 0;
}

void lunar_mxfp4_dequant_row(float *dst, const lunar_mxfp4 *w, int64_t r) {
    int64_t out, in;
    shape_of(w, &out, &in);
    LUNAR_ASSERT(r >= 0 && r < out && in % 32 == 0);
    const uint8_t *p = (const uint8_t *)w->packed->data + r * (in / 2);
    const uint8_t *s = (const uint8_t *)w->scale->data + r * (in / 32);
    for (int64_t g = 0; g < in / 32; g++) {
        float sc = lunar_e8m0_to_f32(s[g]);
        for (int j = 0; j < 16; j++) {
            uint8_t b = p[g * 16 + j];
            dst[g * 32 + 2 * j] = lunar_e2m1_to_f32(b & 15) * sc;
            dst[g * 32 + 2 * j + 1] = lunar_e2m1_to_f32(b >> 4) * sc;
        }
    }
}

/* |v| -> E2M1 magnitude code, round to nearest with ties to the even code, saturating at 6.
 * Decision points are the midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5; at a tie the even code
 * (0, 1.0, 2.0, 4.0) wins: exactly compressed-tensors' cast_to_fp4 bucket edges. */
static uint8_t e2m1_code(float a) {
    if (a <= 0.25f) return 0;
    if (a < 0.75f) return 1;
    if (a <= 1.25f) return 2;
    if (a < 1.75f) return 3;
    if (a <= 2.5f) return 4;
    if (a < 3.5f) return 5;
    if (a <= 5.0f) return 6;
    return 7;
}

void lunar_mxfp4_quantize_row(uint8_t *packed, uint8_t *scale, const float *x, int in) {
    LUNAR_ASSERT(in % 32 == 0);
    for (int g = 0; g < in / 32; g++) {
        const float *v = x + g * 32;
        float amax = 0.0f;
        int bad = 0;
        for (int i = 0; i < 32; i++) {
            if (!isfinite(v[i])) bad = 1;
            else if (fabsf(v[i]) > amax) amax = fabsf(v[i]);
        }
        if (bad) {
            scale[g] = 255;
            memset(packed + g * 16, 0, 16);
            continue;
        }
        int e = -127;
        if (amax > 0.0f) {
            int fe;
            frexpf(amax, &fe); /* amax = m * 2^fe, m in [0.5, 1): floor(log2(amax)) = fe - 1 */
            e = fe - 1 - 2;
            if (e < -127) e = -127;
            if (e > 127) e = 127;
        }
        scale[g] = (uint8_t)(e + 127);
        for (int j = 0; j < 16; j++) {
            uint8_t c[2];
            for (int k = 0; k < 2; k++) {
                float q = ldexpf(v[2 * j + k], -e); /* exact unless it underflows (e = -127 only) */
                c[k] = (uint8_t)(e2m1_code(fabsf(q)) | (signbit(q) ? 8 : 0));
            }
            packed[g * 16 + j] = (uint8_t)(c[0] | c[1] << 4);
        }
    }
}

static inline float dot_f32(const float *a, const float *b, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

void op_matmul_mxfp4(float *y, const float *x, const lunar_mxfp4 *W, int n) {
    int64_t out, in;
    shape_of(W, &out, &in);
    LUNAR_ASSERT(in % 32 == 0 && W->scale->shape[0] == out && W->scale->shape[1] == in / 32);
    LUNAR_ASSERT(W->packed->dtype == LUNAR_DTYPE_U8 && W->scale->dtype == LUNAR_DTYPE_U8);
    float *xr = op_bf16_copy(x, (size_t)n * in); /* the weights are exact in bf16 already */
    if (xr) x = xr;
#pragma omp parallel if ((int64_t)n * out * in > PAR_MIN_WORK)
    {
        float *row = lunar_xmalloc((size_t)in * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < out; r++) {
            lunar_mxfp4_dequant_row(row, W, r);
            for (int t = 0; t < n; t++) y[(size_t)t * out + r] = dot_f32(x + (size_t)t * in, row, (int)in);
        }
        free(row);
    }
    free(xr);
}

void op_mxfp4_mlp(float *y, const float *x, const lunar_mxfp4 *w1, const lunar_mxfp4 *w3,
                  const lunar_mxfp4 *w2, int n, const lunar_glu *act) {
    int64_t I, D, I3, D3, D2, I2;
    shape_of(w1, &I, &D);
    shape_of(w3, &I3, &D3);
    shape_of(w2, &D2, &I2);
    LUNAR_ASSERT(I == I3 && D == D3 && D2 == D && I2 == I);
    float *g = lunar_xmalloc((size_t)n * I * sizeof(float));
    float *u = lunar_xmalloc((size_t)n * I * sizeof(float));
    op_matmul_mxfp4(g, x, w1, n);
    op_matmul_mxfp4(u, x, w3, n);
    op_glu(g, g, u, (int64_t)n * I, act);
    op_matmul_mxfp4(y, g, w2, n);
    free(g);
    free(u);
}
