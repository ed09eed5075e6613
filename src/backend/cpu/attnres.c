/* CPU reference: Kimi-K3 Attention Residuals depth mixing (k3_spec 3.2). fp32 in and out; the
 * per-token reductions (D-sized, S <= 9 candidates) accumulate in double. */
#include <math.h>
#include <stdlib.h>

#include "base/err.h"
#include "ops.h"

/* Reads a weight vector of D floats ([D] or [1, D]). */
static float *read_vec(const lunar_tensor *t, int D) {
    LUNAR_ASSERT(lunar_tensor_numel(t) == D);
    float *v = lunar_xmalloc((size_t)D * sizeof(float));
    lunar_tensor_read_f32(t, 0, D, v);
    return v;
}

void op_attnres_mix(float *out, const float *const *src, int S, const lunar_tensor *proj,
                    const lunar_tensor *norm, const lunar_tensor *out_norm, int n, int D, float eps) {
    LUNAR_ASSERT(S >= 1 && D >= 1);
    /* u = r * p, folded once in fp32 (ATOM's "score_weight"; fla instead multiplies RMSNorm(v) by
     * r and then dots with p: the same product, associated differently, ~1 ulp apart). */
    float *u = read_vec(proj, D), *r = read_vec(norm, D);
    for (int d = 0; d < D; d++) u[d] *= r[d];
    float *on = out_norm ? read_vec(out_norm, D) : NULL;
    double *score = lunar_xmalloc((size_t)S * sizeof(double));
    double *m = lunar_xmalloc((size_t)D * sizeof(double));
    for (int t = 0; t < n; t++) {
        double mx = -INFINITY;
        for (int i = 0; i < S; i++) {
            const float *v = src[i] + (size_t)t * D;
            double dot = 0, ss = 0;
            for (int d = 0; d < D; d++) {
                dot += (double)v[d] * u[d];
                ss += (double)v[d] * v[d];
            }
            score[i] = dot / sqrt(ss / D + (double)eps);
            if (score[i] > mx) mx = score[i];
        }
        double sum = 0;
        for (int i = 0; i < S; i++) sum += (score[i] = exp(score[i] - mx));
        for (int d = 0; d < D; d++) m[d] = 0;
        for (int i = 0; i < S; i++) {
            const float *v = src[i] + (size_t)t * D;
            double p = score[i] / sum;
            for (int d = 0; d < D; d++) m[d] += p * v[d];
        }
        float *o = out + (size_t)t * D;
        if (on) {
            double ss = 0;
            for (int d = 0; d < D; d++) ss += m[d] * m[d];
            double inv = 1.0 / sqrt(ss / D + (double)eps);
            for (int d = 0; d < D; d++) o[d] = (float)(m[d] * inv) * on[d];
        } else {
            for (int d = 0; d < D; d++) o[d] = (float)m[d];
        }
    }
    free(u), free(r), free(on), free(score), free(m);
}
