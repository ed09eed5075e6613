/* CPU reference: causal depthwise short convolution + SiLU (the KDA q/k/v conv). */
#include <math.h>

#include "base/err.h"
#include "ops.h"

#define MAX_K 16

/* Per channel c, over the sequence s = [state[c, 0..K-2], x[0..T-1, c]] (left padding = the
 * previous K-1 inputs, zeros at sequence start), as PyTorch Conv1d(groups=C, padding=K-1):
 *   y[t, c] = silu( sum_{i=0..K-1} w[c, i] * s[t + i] )      (tap K-1 = the current token)
 * Then state[c] = the last K-1 entries of s. */
void op_short_conv(float *y, const float *x, const lunar_tensor *w, float *state, int T, int C,
                   int K) {
    LUNAR_ASSERT(K >= 1 && K <= MAX_K && y != x);
    LUNAR_ASSERT(lunar_tensor_numel(w) == (int64_t)C * K);
    const int S = K - 1;
#pragma omp parallel for schedule(static) if ((int64_t)T * C > 16384)
    for (int c = 0; c < C; c++) {
        float wc[MAX_K], hist[MAX_K];
        lunar_tensor_read_f32(w, (int64_t)c * K, K, wc);
        float *st = state + (size_t)c * S;
        /* s[p] for p in [0, S + T): p < S from the state, else x[p - S] */
#define SEQ(p) ((p) < S ? st[(p)] : x[(size_t)((p) - S) * C + c])
        for (int t = 0; t < T; t++) {
            float acc = 0.0f;
            for (int i = 0; i < K; i++) acc += wc[i] * SEQ(t + i);
            y[(size_t)t * C + c] = acc / (1.0f + expf(-acc));
        }
        for (int j = 0; j < S; j++) hist[j] = SEQ(T + j); /* read all before overwriting st */
#undef SEQ
        for (int j = 0; j < S; j++) st[j] = hist[j];
    }
}
