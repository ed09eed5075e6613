/* CPU reference: FP8 e4m3 quantisation with a power-of-two scale (DeepSeek-V3.2 act_quant,
 * ue8m0), the per-row fp32-scale quantiser of PTPC-FP8, the orthonormal Walsh-Hadamard rotation, and non-interleaved RoPE (the DSA indexer's
 * pre-processing). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "ops.h"

/* DeepSeek-V3.2 inference/kernel.py act_quant_kernel with round_scale (scale_fmt = "ue8m0"):
 *   amax = max(|x|, 1e-4); s = amax / 448 (an fp32 division, as the kernel);
 *   s = 2^(exponent(s) - 127 + (mantissa(s) != 0))   (fast_log2_ceil / fast_pow2 on the bits)
 *   y = clamp(x / s, -448, 448) -> float8_e4m3fn (round to nearest even).
 * s is normal (>= 1e-4 / 448), so the bit trick is ceil(log2(s)) exactly. x / s is exact (a power
 * of two) unless it falls below fp32's normal range, which e4m3 flushes to 0 anyway. */
float lunar_fp8_quantize_pow2(uint8_t *q, const float *x, int n) {
    float amax = 1e-4f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > amax) amax = a; /* NaN never compares greater: it cannot poison the scale */
    }
    float s = amax / 448.0f;
    uint32_t bits;
    memcpy(&bits, &s, sizeof bits);
    int e = (int)((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffffu) != 0);
    float scale = ldexpf(1.0f, e);
    for (int i = 0; i < n; i++) {
        float v = x[i] / scale;
        if (v > 448.0f) v = 448.0f;
        if (v < -448.0f) v = -448.0f;
        q[i] = lunar_f32_to_e4m3(v);
    }
    return scale;
}

/* PTPC-FP8 (ops.h): s = amax / 448 as one fp32 division; x / s also one fp32 division (not a
 * multiply by 1/s, which rounds twice); an all-zero (or all-NaN, or subnormal-amax) row gets s = 1
 * and codes 0 (NaN entries keep NaN codes). */
float lunar_ptpc_quantize_row(uint8_t *q, const float *x, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > amax) amax = a; /* NaN never compares greater */
    }
    float s = amax / 448.0f;
    if (!(s > 0.0f)) s = 1.0f;
    for (int i = 0; i < n; i++) q[i] = lunar_f32_to_e4m3(x[i] / s);
    return s;
}

void op_hadamard(float *x, int rows, int len) {
    LUNAR_ASSERT(len >= 1 && (len & (len - 1)) == 0);
    const float norm = (float)(1.0 / sqrt((double)len));
    for (int r = 0; r < rows; r++) {
        float *v = x + (size_t)r * len;
        for (int h = 1; h < len; h <<= 1)
            for (int i = 0; i < len; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    float a = v[j], b = v[j + h];
                    v[j] = a + b;
                    v[j + h] = a - b;
                }
        for (int i = 0; i < len; i++) v[i] *= norm;
    }
}

void op_rope_neox(float *x, const float *inv_freq, int T, int pos0, int nh, int hd, int rot) {
    LUNAR_ASSERT(rot % 2 == 0 && rot <= hd);
    const int half = rot / 2;
    double *cs = lunar_xmalloc((size_t)rot * sizeof(double));
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < half; i++) {
            double a = (double)(pos0 + t) * (double)inv_freq[i];
            cs[i] = cos(a), cs[half + i] = sin(a);
        }
        for (int h = 0; h < nh; h++) {
            float *v = x + ((size_t)t * nh + h) * hd;
            for (int i = 0; i < half; i++) {
                double a = v[i], b = v[i + half], c = cs[i], s = cs[half + i];
                v[i] = (float)(a * c - b * s);
                v[i + half] = (float)(b * c + a * s);
            }
        }
    }
    free(cs);
}
