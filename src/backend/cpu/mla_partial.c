/* CPU reference of the staged absorbed MLA used by decode context parallelism (ops.h): absorb the
 * query into the latent space, attend over a subset of the cache with its log-sum-exp, merge the
 * subsets, project the merged latent context to the value space. */
#include <math.h>
#include <stdlib.h>

#include "base/err.h"
#include "ops.h"

static inline float dotf(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void check_kvb(const lunar_tensor *W, int H, int N, int Vd, int R) {
    LUNAR_ASSERT(W->ndim == 2 && W->shape[0] == (int64_t)H * (N + Vd) && W->shape[1] == R);
}

void op_mla_absorb_q(float *qlat, const float *q, const lunar_tensor *W_kvb, int T, int H, int N,
                     int P, int Vd, int R) {
    check_kvb(W_kvb, H, N, Vd, R);
    float *Wk = lunar_xmalloc((size_t)(N > 0 ? N : 1) * R * sizeof(float));
    for (int h = 0; h < H; h++) {
        lunar_tensor_read_f32(W_kvb, (int64_t)h * (N + Vd) * R, (int64_t)N * R, Wk);
        for (int t = 0; t < T; t++) {
            const float *qt = q + ((size_t)t * H + h) * (N + P);
            float *ql = qlat + ((size_t)t * H + h) * (R + P);
            for (int r = 0; r < R; r++) ql[r] = 0.0f;
            for (int n = 0; n < N; n++)
                for (int r = 0; r < R; r++) ql[r] += qt[n] * Wk[(size_t)n * R + r];
            for (int p = 0; p < P; p++) ql[R + p] = qt[N + p];
        }
    }
    free(Wk);
}

void op_mla_attention_partial(float *olat, float *lse, const float *qlat, const float *cache,
                              const int32_t *rows, const int32_t *count, int stride, int T, int H,
                              int R, int P, float scale) {
    const int ld = R + P;
    int maxn = 1;
    for (int t = 0; t < T; t++) maxn = count[t] > maxn ? count[t] : maxn;
    float *s = lunar_xmalloc((size_t)maxn * sizeof(float));
    for (int t = 0; t < T; t++) {
        const int nj = count[t];
        const int32_t *rt = rows ? rows + (size_t)t * stride : NULL;
        for (int h = 0; h < H; h++) {
            const float *ql = qlat + ((size_t)t * H + h) * ld;
            float *ot = olat + ((size_t)t * H + h) * R;
            for (int r = 0; r < R; r++) ot[r] = 0.0f;
            if (nj == 0) {
                lse[(size_t)t * H + h] = -INFINITY;
                continue;
            }
            float mx = -INFINITY;
            for (int j = 0; j < nj; j++) {
                const float *cj = cache + (size_t)(rt ? rt[j] : j) * ld;
                s[j] = scale * (dotf(ql, cj, R) + dotf(ql + R, cj + R, P));
                mx = s[j] > mx ? s[j] : mx;
            }
            float sum = 0.0f;
            for (int j = 0; j < nj; j++) sum += (s[j] = expf(s[j] - mx));
            const float inv = 1.0f / sum;
            for (int j = 0; j < nj; j++) {
                const float *cj = cache + (size_t)(rt ? rt[j] : j) * ld;
                const float pj = s[j] * inv;
                for (int r = 0; r < R; r++) ot[r] += pj * cj[r];
            }
            lse[(size_t)t * H + h] = mx + logf(sum);
        }
    }
    free(s);
}

void op_mla_merge_partials(float *out, const float *parts, int n, size_t part_stride, int rows, int R) {
    for (int i = 0; i < rows; i++) {
        float mx = -INFINITY;
        for (int p = 0; p < n; p++) {
            float l = parts[p * part_stride + (size_t)i * (R + 1) + R];
            mx = l > mx ? l : mx;
        }
        float *o = out + (size_t)i * R;
        for (int r = 0; r < R; r++) o[r] = 0.0f;
        if (mx == -INFINITY) continue; /* no part saw a key */
        float wsum = 0.0f;
        for (int p = 0; p < n; p++) {
            const float *pr = parts + p * part_stride + (size_t)i * (R + 1);
            const float w = expf(pr[R] - mx); /* exp(-inf) = 0 for empty parts */
            wsum += w;
            for (int r = 0; r < R; r++) o[r] += w * pr[r];
        }
        const float inv = 1.0f / wsum;
        for (int r = 0; r < R; r++) o[r] *= inv;
    }
}

void op_mla_output_v(float *o, const float *olat, const lunar_tensor *W_kvb, int T, int H, int N,
                     int Vd, int R) {
    check_kvb(W_kvb, H, N, Vd, R);
    float *Wv = lunar_xmalloc((size_t)(Vd > 0 ? Vd : 1) * R * sizeof(float));
    for (int h = 0; h < H; h++) {
        lunar_tensor_read_f32(W_kvb, ((int64_t)h * (N + Vd) + N) * R, (int64_t)Vd * R, Wv);
        for (int t = 0; t < T; t++) {
            const float *ol = olat + ((size_t)t * H + h) * R;
            float *ot = o + ((size_t)t * H + h) * Vd;
            for (int x = 0; x < Vd; x++) ot[x] = dotf(Wv + (size_t)x * R, ol, R);
        }
    }
    free(Wv);
}
