/* CPU reference: dense ops (matmul, embedding, norms, SwiGLU). fp32 arithmetic throughout; the
 * norms accumulate their sum of squares in double (dim-sized, cheap) so they sit closer to the
 * exact value than any fp32 summation order, torch's included. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "ops.h"

/* sum_i a[i]*b[i] in fp32 with 8 independent partial sums (they break the add-latency chain and
 * map onto vector registers), in exactly the order dot4_f32 uses for each of its tokens: a row's
 * result never depends on how many tokens share the call (batch invariance: a request computes
 * the same logits alone or batched with others). */
static inline float dot_f32(const float *a, const float *b, int n) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 8; j++) s += acc[j];
    return s;
}

/* Four dots sharing one weight row: r[m] = x[m*ld ..] . w, m = 0..3. Each weight element is
 * loaded once for four tokens (prefill); 8 partial sums per token. */
static void dot4_f32(float r[4], const float *x, size_t ld, const float *w, int n) {
    float a0[8] = {0}, a1[8] = {0}, a2[8] = {0}, a3[8] = {0};
    const float *x0 = x, *x1 = x + ld, *x2 = x + 2 * ld, *x3 = x + 3 * ld;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int j = 0; j < 8; j++) {
            float wj = w[i + j];
            a0[j] += x0[i + j] * wj;
            a1[j] += x1[i + j] * wj;
            a2[j] += x2[i + j] * wj;
            a3[j] += x3[i + j] * wj;
        }
    }
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (; i < n; i++) {
        s0 += x0[i] * w[i];
        s1 += x1[i] * w[i];
        s2 += x2[i] * w[i];
        s3 += x3[i] * w[i];
    }
    for (int j = 0; j < 8; j++) s0 += a0[j], s1 += a1[j], s2 += a2[j], s3 += a3[j];
    r[0] = s0, r[1] = s1, r[2] = s2, r[3] = s3;
}

/* BF16 -> fp32 is a 16-bit shift; written as a plain loop so it vectorises (the generic
 * lunar_tensor_read_f32 handles F16 and the rest). */
static void widen_bf16(float *dst, const uint16_t *src, int n) {
    uint32_t *d = (uint32_t *)(void *)dst;
#pragma omp simd
    for (int i = 0; i < n; i++) d[i] = (uint32_t)src[i] << 16;
}

/* y[n, out] = x[n, in] . W[out, in]^T.
 * Parallel over output rows: each thread widens one row of W into a private fp32 buffer (once per
 * row, never the whole matrix) and dots it against all n tokens, four at a time, so BF16/F16
 * decode (n = 1) reads the weight exactly once and prefill amortises the conversion and the weight
 * loads over the tokens. */
static int bf16_operands;
void op_set_bf16_operands(int on) { bf16_operands = on != 0; }
int op_bf16_operands(void) { return bf16_operands; }

static void round_bf16(float *v, size_t n) {
    for (size_t i = 0; i < n; i++) v[i] = lunar_bf16_to_f32(lunar_f32_to_bf16(v[i]));
}

void op_bf16_round_in_place(float *x, size_t n) {
    if (bf16_operands) round_bf16(x, n);
}

float *op_bf16_copy(const float *x, size_t n) {
    if (!bf16_operands) return NULL;
    float *r = lunar_xmalloc((n ? n : 1) * sizeof(float));
    memcpy(r, x, n * sizeof(float));
    round_bf16(r, n);
    return r;
}

void op_matmul(float *y, const float *x, const lunar_tensor *W, int n) {
    LUNAR_ASSERT(W->ndim == 2);
    const int out = (int)W->shape[0], in = (int)W->shape[1];
    LUNAR_ASSERT((size_t)out * (size_t)in * lunar_dtype_size(W->dtype) <= W->nbytes);
    if (n <= 0 || out <= 0) return;
    float *xr = op_bf16_copy(x, (size_t)n * in);
    if (xr) x = xr;
    const int round_w = bf16_operands && W->dtype != LUNAR_DTYPE_BF16;
    const int direct = W->dtype == LUNAR_DTYPE_F32 && !round_w;
#pragma omp parallel if ((int64_t)n * out * in > PAR_MIN_WORK)
    {
        float *row = direct ? NULL : lunar_xmalloc((size_t)(in > 0 ? in : 1) * sizeof(float));
#pragma omp for schedule(static)
        for (int o = 0; o < out; o++) {
            const float *w;
            if (direct) {
                w = (const float *)W->data + (size_t)o * (size_t)in;
            } else if (W->dtype == LUNAR_DTYPE_BF16) {
                widen_bf16(row, (const uint16_t *)W->data + (size_t)o * (size_t)in, in);
                w = row;
            } else {
                lunar_tensor_read_f32(W, (int64_t)o * in, in, row);
                if (round_w) round_bf16(row, (size_t)in);
                w = row;
            }
            int t = 0;
            for (; t + 4 <= n; t += 4) {
                float r[4];
                dot4_f32(r, x + (size_t)t * in, (size_t)in, w, in);
                for (int m = 0; m < 4; m++) y[(size_t)(t + m) * out + o] = r[m];
            }
            for (; t < n; t++) y[(size_t)t * out + o] = dot_f32(x + (size_t)t * in, w, in);
        }
        free(row);
    }
    free(xr);
}

/* PTPC-FP8 emulation (ops.h): the codes of both operands are decoded to fp32 (exact) and dotted
 * exactly as op_matmul dots (e4m3 x e4m3 products are exact in fp32: 4 + 4 significant bits), then
 * scaled as (dot * s_x) * s_w, the order the CUDA fallback kernel uses. */
void op_matmul_ptpc_fp8(float *y, const float *x, const lunar_tensor *W, int n) {
    LUNAR_ASSERT(W->ndim == 2);
    const int out = (int)W->shape[0], in = (int)W->shape[1];
    LUNAR_ASSERT((size_t)out * (size_t)in * lunar_dtype_size(W->dtype) <= W->nbytes);
    if (n <= 0 || out <= 0) return;
    const size_t cin = (size_t)(in > 0 ? in : 1);
    float *xr = op_bf16_copy(x, (size_t)n * in);
    if (xr) x = xr;
    float *xq = lunar_xmalloc((size_t)n * cin * sizeof(float)), *sx = lunar_xmalloc((size_t)n * sizeof(float));
    uint8_t *codes = lunar_xmalloc((size_t)n * cin);
    for (int t = 0; t < n; t++) {
        sx[t] = lunar_ptpc_quantize_row(codes + (size_t)t * in, x + (size_t)t * in, in);
        for (int i = 0; i < in; i++) xq[(size_t)t * in + i] = lunar_e4m3_to_f32(codes[(size_t)t * in + i]);
    }
    free(codes);
    const int round_w = bf16_operands && W->dtype != LUNAR_DTYPE_BF16;
#pragma omp parallel if ((int64_t)n * out * in > PAR_MIN_WORK)
    {
        float *row = lunar_xmalloc(cin * sizeof(float));
        uint8_t *q = lunar_xmalloc(cin);
#pragma omp for schedule(static)
        for (int o = 0; o < out; o++) {
            if (W->dtype == LUNAR_DTYPE_BF16) {
                widen_bf16(row, (const uint16_t *)W->data + (size_t)o * (size_t)in, in);
            } else {
                lunar_tensor_read_f32(W, (int64_t)o * in, in, row);
                if (round_w) round_bf16(row, (size_t)in);
            }
            const float sw = lunar_ptpc_quantize_row(q, row, in);
            for (int i = 0; i < in; i++) row[i] = lunar_e4m3_to_f32(q[i]);
            for (int t = 0; t < n; t++) y[(size_t)t * out + o] = dot_f32(xq + (size_t)t * in, row, in) * sx[t] * sw;
        }
        free(row);
        free(q);
    }
    free(xq);
    free(sx);
    free(xr);
}

/* y[i, :] = E[ids[i], :], widened to fp32. */
void op_embedding(float *y, const lunar_tensor *E, const int32_t *ids, int n) {
    LUNAR_ASSERT(E->ndim == 2);
    const int64_t rows = E->shape[0], dim = E->shape[1];
    for (int i = 0; i < n; i++) {
        LUNAR_ASSERT(ids[i] >= 0 && ids[i] < rows);
        lunar_tensor_read_f32(E, (int64_t)ids[i] * dim, dim, y + (size_t)i * (size_t)dim);
        if (bf16_operands) round_bf16(y + (size_t)i * (size_t)dim, (size_t)dim);
    }
}

/* A [dim] weight vector widened to fp32 (caller frees), or NULL for "no weight". */
static float *read_vec(const lunar_tensor *w, int dim) {
    if (!w) return NULL;
    LUNAR_ASSERT(lunar_tensor_numel(w) == dim);
    float *v = lunar_xmalloc((size_t)dim * sizeof(float));
    lunar_tensor_read_f32(w, 0, dim, v);
    if (bf16_operands) round_bf16(v, (size_t)dim);
    return v;
}

/* 1 / sqrt(mean(x^2) + eps) over one row (HF: x * rsqrt(variance + eps)). */
static float rms_inv(const float *x, int dim, float eps) {
    double ss = 0;
    for (int i = 0; i < dim; i++) ss += (double)x[i] * x[i];
    return (float)(1.0 / sqrt(ss / dim + (double)eps));
}

/* y = x / sqrt(mean(x^2) + eps) * w */
void op_rmsnorm(float *y, const float *x, const lunar_tensor *w, int n, int dim, float eps) {
    float *wv = read_vec(w, dim);
    for (int t = 0; t < n; t++) {
        const float *xr = x + (size_t)t * dim;
        float *yr = y + (size_t)t * dim;
        float r = rms_inv(xr, dim, eps);
        for (int i = 0; i < dim; i++) yr[i] = wv ? wv[i] * (xr[i] * r) : xr[i] * r;
    }
    free(wv);
}

static inline float sigmoidf(float a) { return 1.0f / (1.0f + expf(-a)); }

/* y = (x / sqrt(mean(x^2) + eps)) * w * sigmoid(gate)   (norm first, then the gate; HF
 * KimiLinearRMSNormGated) */
void op_rmsnorm_gated(float *y, const float *x, const float *gate, const lunar_tensor *w, int n,
                      int dim, float eps) {
    float *wv = read_vec(w, dim);
    for (int t = 0; t < n; t++) {
        const float *xr = x + (size_t)t * dim, *gr = gate + (size_t)t * dim;
        float *yr = y + (size_t)t * dim;
        float r = rms_inv(xr, dim, eps);
        for (int i = 0; i < dim; i++) {
            float v = xr[i] * r;
            if (wv) v *= wv[i];
            yr[i] = v * sigmoidf(gr[i]);
        }
    }
    free(wv);
}

/* y = x / sqrt(sum(x^2) + eps)   (FLA/HF l2norm: + eps inside the sqrt, not max(norm, eps)) */
void op_l2norm(float *y, const float *x, int n, int dim, float eps) {
    for (int t = 0; t < n; t++) {
        const float *xr = x + (size_t)t * dim;
        float *yr = y + (size_t)t * dim;
        double ss = 0;
        for (int i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
        float r = (float)(1.0 / sqrt(ss + (double)eps));
        for (int i = 0; i < dim; i++) yr[i] = xr[i] * r;
    }
}

/* y = silu(gate) * up, silu(a) = a * sigmoid(a) */
void op_silu_mul(float *y, const float *gate, const float *up, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        float a = gate[i];
        y[i] = a * sigmoidf(a) * up[i];
    }
}

/* y = W_down( silu(W_gate x) * (W_up x) ) */
void op_swiglu_mlp(float *y, const float *x, const lunar_tensor *W_gate, const lunar_tensor *W_up,
                   const lunar_tensor *W_down, int n) {
    const int I = (int)W_gate->shape[0];
    LUNAR_ASSERT(W_up->shape[0] == I && W_up->shape[1] == W_gate->shape[1]);
    LUNAR_ASSERT(W_down->shape[1] == I);
    float *g = lunar_xmalloc((size_t)n * I * sizeof(float));
    float *u = lunar_xmalloc((size_t)n * I * sizeof(float));
    op_matmul(g, x, W_gate, n);
    op_matmul(u, x, W_up, n);
    op_silu_mul(g, g, u, (int64_t)n * I);
    op_matmul(y, g, W_down, n);
    free(g);
    free(u);
}
