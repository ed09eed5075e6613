/* CPU reference: multi-head latent attention (MLA, NoPE) over a contiguous latent cache, in the
 * naive (decompress K/V) and absorbed (fold W_kvb into q and the output) forms. Parallel over heads.
 * cache row j: [c_j (R) | k_pe_j (P)]; q row (t, h): [q_nope (N) | q_pe (P)];
 * W_kvb rows of head h: h*(N+Vd) .. +N are W_k (k_nope = W_k c), the next Vd are W_v (v = W_v c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "ops.h"

static void check_shapes(const lunar_tensor *W, int H, int N, int Vd, int R) {
    LUNAR_ASSERT(W->ndim == 2 && W->shape[0] == (int64_t)H * (N + Vd) && W->shape[1] == R);
}

/* Softmax in place over s[0..n): max-subtracted exp, fp32 sum. */
static void softmax(float *s, int n) {
    float mx = s[0];
    for (int j = 1; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    float sum = 0.0f;
    for (int j = 0; j < n; j++) sum += (s[j] = expf(s[j] - mx));
    float inv = 1.0f / sum;
    for (int j = 0; j < n; j++) s[j] *= inv;
}

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Naive: K_nope[j] = W_k c_j, V[j] = W_v c_j for every cached position j < L = pos0 + T, then
 *   o_t = sum_{j <= pos0+t} softmax_j(scale * (q_nope . K_nope[j] + q_pe . k_pe_j)) V[j]. */
void op_mla_attention_naive(float *o, const float *q, const float *cache, const lunar_tensor *W_kvb,
                            int T, int pos0, int H, int N, int P, int Vd, int R, float scale) {
    check_shapes(W_kvb, H, N, Vd, R);
    const int L = pos0 + T, ld = R + P, qd = N + P;
#pragma omp parallel if ((int64_t)T * L * H * (R + P) > PAR_MIN_WORK)
    {
        float *Wh = lunar_xmalloc((size_t)(N + Vd) * R * sizeof(float));
        float *Kn = lunar_xmalloc((size_t)L * N * sizeof(float));
        float *Vv = lunar_xmalloc((size_t)L * Vd * sizeof(float));
        float *s = lunar_xmalloc((size_t)L * sizeof(float));
#pragma omp for schedule(static)
        for (int h = 0; h < H; h++) {
            lunar_tensor_read_f32(W_kvb, (int64_t)h * (N + Vd) * R, (int64_t)(N + Vd) * R, Wh);
            op_bf16_round_in_place(Wh, (size_t)(N + Vd) * R);
            for (int j = 0; j < L; j++) {
                const float *cj = cache + (size_t)j * ld;
                for (int n = 0; n < N; n++) Kn[(size_t)j * N + n] = dot(Wh + (size_t)n * R, cj, R);
                for (int x = 0; x < Vd; x++)
                    Vv[(size_t)j * Vd + x] = dot(Wh + (size_t)(N + x) * R, cj, R);
            }
            for (int t = 0; t < T; t++) {
                const float *qt = q + ((size_t)t * H + h) * qd;
                const int nj = pos0 + t + 1;
                for (int j = 0; j < nj; j++)
                    s[j] = scale * (dot(qt, Kn + (size_t)j * N, N) +
                                    dot(qt + N, cache + (size_t)j * ld + R, P));
                softmax(s, nj);
                float *ot = o + ((size_t)t * H + h) * Vd;
                for (int x = 0; x < Vd; x++) ot[x] = 0.0f;
                for (int j = 0; j < nj; j++)
                    for (int x = 0; x < Vd; x++) ot[x] += s[j] * Vv[(size_t)j * Vd + x];
            }
        }
        free(Wh);
        free(Kn);
        free(Vv);
        free(s);
    }
}

/* Absorbed: q . k_j = (W_k^T q_nope) . c_j + q_pe . k_pe_j and o = W_v (sum_j p_j c_j), so only the
 * R-dim latents are touched per position:
 *   q_lat = W_k^T q_nope                                   [R]
 *   p_j   = softmax_j(scale * (q_lat . c_j + q_pe . k_pe_j))
 *   o_t   = W_v (sum_j p_j c_j)                            [Vd] */
void op_mla_attention_absorbed(float *o, const float *q, const float *cache,
                               const lunar_tensor *W_kvb, int T, int pos0, int H, int N, int P,
                               int Vd, int R, float scale) {
    check_shapes(W_kvb, H, N, Vd, R);
    const int L = pos0 + T, ld = R + P, qd = N + P;
#pragma omp parallel if ((int64_t)T * L * H * (R + P) > PAR_MIN_WORK)
    {
        float *Wh = lunar_xmalloc((size_t)(N + Vd) * R * sizeof(float));
        float *ql = lunar_xmalloc((size_t)R * sizeof(float));
        float *ctx = lunar_xmalloc((size_t)R * sizeof(float));
        float *s = lunar_xmalloc((size_t)L * sizeof(float));
#pragma omp for schedule(static)
        for (int h = 0; h < H; h++) {
            lunar_tensor_read_f32(W_kvb, (int64_t)h * (N + Vd) * R, (int64_t)(N + Vd) * R, Wh);
            op_bf16_round_in_place(Wh, (size_t)(N + Vd) * R);
            for (int t = 0; t < T; t++) {
                const float *qt = q + ((size_t)t * H + h) * qd;
                const int nj = pos0 + t + 1;
                for (int r = 0; r < R; r++) ql[r] = 0.0f;
                for (int n = 0; n < N; n++)
                    for (int r = 0; r < R; r++) ql[r] += qt[n] * Wh[(size_t)n * R + r];
                for (int j = 0; j < nj; j++) {
                    const float *cj = cache + (size_t)j * ld;
                    s[j] = scale * (dot(ql, cj, R) + dot(qt + N, cj + R, P));
                }
                softmax(s, nj);
                for (int r = 0; r < R; r++) ctx[r] = 0.0f;
                for (int j = 0; j < nj; j++)
                    for (int r = 0; r < R; r++) ctx[r] += s[j] * cache[(size_t)j * ld + r];
                float *ot = o + ((size_t)t * H + h) * Vd;
                for (int x = 0; x < Vd; x++) ot[x] = dot(Wh + (size_t)(N + x) * R, ctx, R);
            }
        }
        free(Wh);
        free(ql);
        free(ctx);
        free(s);
    }
}

/* Sparse (DSA): the absorbed form over the listed rows only, in list order; the arithmetic is the
 * absorbed op's statement for statement, so idx = 0..pos0+t reproduces it bitwise. */
void op_mla_attention_sparse(float *o, const float *q, const float *cache,
                             const lunar_tensor *W_kvb, const int32_t *idx, int topk, int T, int L,
                             int H, int N, int P, int Vd, int R, float scale) {
    check_shapes(W_kvb, H, N, Vd, R);
    const int ld = R + P, qd = N + P;
#pragma omp parallel if ((int64_t)T * topk * H * (R + P) > PAR_MIN_WORK)
    {
        float *Wh = lunar_xmalloc((size_t)(N + Vd) * R * sizeof(float));
        float *ql = lunar_xmalloc((size_t)R * sizeof(float));
        float *ctx = lunar_xmalloc((size_t)R * sizeof(float));
        float *s = lunar_xmalloc((size_t)(topk > 0 ? topk : 1) * sizeof(float));
        int32_t *rows = lunar_xmalloc((size_t)(topk > 0 ? topk : 1) * sizeof(int32_t));
#pragma omp for schedule(static)
        for (int h = 0; h < H; h++) {
            lunar_tensor_read_f32(W_kvb, (int64_t)h * (N + Vd) * R, (int64_t)(N + Vd) * R, Wh);
            op_bf16_round_in_place(Wh, (size_t)(N + Vd) * R);
            for (int t = 0; t < T; t++) {
                const float *qt = q + ((size_t)t * H + h) * qd;
                float *ot = o + ((size_t)t * H + h) * Vd;
                int nj = 0;
                for (int i = 0; i < topk; i++) {
                    int32_t j = idx[(size_t)t * topk + i];
                    if (j < 0) continue;
                    LUNAR_ASSERT(j < L);
                    rows[nj++] = j;
                }
                if (nj == 0) {
                    for (int x = 0; x < Vd; x++) ot[x] = 0.0f;
                    continue;
                }
                for (int r = 0; r < R; r++) ql[r] = 0.0f;
                for (int n = 0; n < N; n++)
                    for (int r = 0; r < R; r++) ql[r] += qt[n] * Wh[(size_t)n * R + r];
                for (int j = 0; j < nj; j++) {
                    const float *cj = cache + (size_t)rows[j] * ld;
                    s[j] = scale * (dot(ql, cj, R) + dot(qt + N, cj + R, P));
                }
                softmax(s, nj);
                for (int r = 0; r < R; r++) ctx[r] = 0.0f;
                for (int j = 0; j < nj; j++)
                    for (int r = 0; r < R; r++) ctx[r] += s[j] * cache[(size_t)rows[j] * ld + r];
                for (int x = 0; x < Vd; x++) ot[x] = dot(Wh + (size_t)(N + x) * R, ctx, R);
            }
        }
        free(Wh);
        free(ql);
        free(ctx);
        free(s);
        free(rows);
    }
}
