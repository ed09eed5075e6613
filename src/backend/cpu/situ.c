/* CPU reference: SiTU-GLU activation and MLP (k3_spec 6.1), the generic GLU switch, LayerNorm. */
#include <math.h>
#include <stdlib.h>

#include "base/err.h"
#include "ops.h"

/* SiTUv2: beta*tanh(g/beta)*sigmoid(g) * beta_l*tanh(u/beta_l), in fp32 as ATOM computes it. */
static inline float situ(float g, float u, float beta, float beta_l) {
    float a = beta * tanhf(g / beta) * (1.0f / (1.0f + expf(-g)));
    float b = beta_l > 0.0f ? beta_l * tanhf(u / beta_l) : u;
    return a * b;
}

void op_situ_mul(float *y, const float *gate, const float *up, int64_t n, float beta,
                 float beta_l) {
    LUNAR_ASSERT(beta > 0.0f);
    for (int64_t i = 0; i < n; i++) y[i] = situ(gate[i], up[i], beta, beta_l);
}

void op_glu(float *y, const float *gate, const float *up, int64_t n, const lunar_glu *act) {
    if (act->kind == LUNAR_GLU_SITU) op_situ_mul(y, gate, up, n, act->beta, act->beta_l);
    else op_silu_mul(y, gate, up, n);
}

void op_situ_mlp(float *y, const float *x, const lunar_tensor *W_gate, const lunar_tensor *W_up,
                 const lunar_tensor *W_down, int n, float beta, float beta_l) {
    const int I = (int)W_gate->shape[0];
    LUNAR_ASSERT(W_up->shape[0] == I && W_up->shape[1] == W_gate->shape[1]);
    LUNAR_ASSERT(W_down->shape[1] == I);
    float *g = lunar_xmalloc((size_t)n * I * sizeof(float));
    float *u = lunar_xmalloc((size_t)n * I * sizeof(float));
    op_matmul(g, x, W_gate, n);
    op_matmul(u, x, W_up, n);
    op_situ_mul(g, g, u, (int64_t)n * I, beta, beta_l);
    op_matmul(y, g, W_down, n);
    free(g);
    free(u);
}

void op_layernorm(float *y, const float *x, const lunar_tensor *w, const lunar_tensor *b, int n,
                  int dim, float eps) {
    float *wv = NULL, *bv = NULL;
    if (w) {
        LUNAR_ASSERT(lunar_tensor_numel(w) == dim);
        wv = lunar_xmalloc((size_t)dim * sizeof(float));
        lunar_tensor_read_f32(w, 0, dim, wv);
    }
    if (b) {
        LUNAR_ASSERT(lunar_tensor_numel(b) == dim);
        bv = lunar_xmalloc((size_t)dim * sizeof(float));
        lunar_tensor_read_f32(b, 0, dim, bv);
    }
    for (int t = 0; t < n; t++) {
        const float *xr = x + (size_t)t * dim;
        float *yr = y + (size_t)t * dim;
        double mean = 0, var = 0;
        for (int i = 0; i < dim; i++) mean += xr[i];
        mean /= dim;
        for (int i = 0; i < dim; i++) var += ((double)xr[i] - mean) * ((double)xr[i] - mean);
        var /= dim; /* biased, as torch */
        double inv = 1.0 / sqrt(var + (double)eps);
        for (int i = 0; i < dim; i++) {
            float v = (float)(((double)xr[i] - mean) * inv);
            if (wv) v *= wv[i];
            if (bv) v += bv[i];
            yr[i] = v;
        }
    }
    free(wv);
    free(bv);
}
