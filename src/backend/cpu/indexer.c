/* CPU reference: the DSA lightning indexer (SPEC 1.1): scores I(t, s) = sum_h w_h ReLU(iq_h . ik_s)
 * over the visible positions and top-k selection with ties to the lower position. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "ops.h"

typedef struct {
    float score;
    int32_t pos;
} cand;

/* a ranks below b: lower score, or equal score and higher position */
static inline int worse(cand a, cand b) { return a.score < b.score || (a.score == b.score && a.pos > b.pos); }

static void sift_down(cand *h, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && worse(h[l], h[m])) m = l;
        if (r < n && worse(h[r], h[m])) m = r;
        if (m == i) return;
        cand tmp = h[i];
        h[i] = h[m], h[m] = tmp;
        i = m;
    }
}

static void sift_up(cand *h, int i) {
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!worse(h[i], h[p])) return;
        cand tmp = h[i];
        h[i] = h[p], h[p] = tmp;
        i = p;
    }
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

void op_dsa_indexer(int32_t *idx, int32_t *count, const float *iq, const float *w,
                    const lunar_index_cache *cache, int T, int pos0, int nh, int d, int topk) {
    LUNAR_ASSERT(topk >= 1 && nh >= 1 && d >= 1 && pos0 >= 0);
    const int fp8 = cache->codes != NULL;
    LUNAR_ASSERT(fp8 ? cache->scales != NULL : cache->keys != NULL);
    float lut[256];
    for (int c = 0; c < 256; c++) lut[c] = lunar_e4m3_to_f32((uint8_t)c);
#pragma omp parallel if ((int64_t)T * (pos0 + T) * nh * d > PAR_MIN_WORK)
    {
        cand *heap = lunar_xmalloc((size_t)topk * sizeof(cand));
        uint8_t *q8 = lunar_xmalloc((size_t)nh * d);
        float *qf = lunar_xmalloc((size_t)nh * d * sizeof(float));
        double *wq = lunar_xmalloc((size_t)nh * sizeof(double));
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < T; t++) {
            const int n = pos0 + t + 1;
            int32_t *out = idx + (size_t)t * topk;
            if (count) count[t] = n < topk ? n : topk;
            if (n <= topk) {
                for (int s = 0; s < topk; s++) out[s] = s < n ? s : -1;
                continue;
            }
            const float *qt = iq + (size_t)t * nh * d;
            for (int h = 0; h < nh; h++) {
                if (fp8) {
                    float sq = lunar_fp8_quantize_pow2(q8 + (size_t)h * d, qt + (size_t)h * d, d);
                    for (int i = 0; i < d; i++) qf[(size_t)h * d + i] = lut[q8[(size_t)h * d + i]];
                    wq[h] = (double)w[(size_t)t * nh + h] * sq;
                } else {
                    memcpy(qf + (size_t)h * d, qt + (size_t)h * d, (size_t)d * sizeof(float));
                    wq[h] = w[(size_t)t * nh + h];
                }
            }
            int hn = 0;
            float kf[1024], *kbuf = d <= 1024 ? kf : lunar_xmalloc((size_t)d * sizeof(float));
            for (int s = 0; s < n; s++) {
                const float *k;
                double ks = 1.0;
                if (fp8) {
                    const uint8_t *kc = cache->codes + (size_t)s * d;
                    for (int i = 0; i < d; i++) kbuf[i] = lut[kc[i]];
                    k = kbuf;
                    ks = cache->scales[s];
                } else {
                    k = cache->keys + (size_t)s * d;
                }
                double acc = 0;
                for (int h = 0; h < nh; h++) {
                    const float *qh = qf + (size_t)h * d;
                    double dot = 0; /* exact for e4m3 operands (products are multiples of 2^-18) */
                    for (int i = 0; i < d; i++) dot += (double)qh[i] * k[i];
                    if (dot > 0) acc += wq[h] * dot;
                }
                cand c = {(float)(acc * ks), s};
                if (hn < topk) {
                    heap[hn] = c;
                    sift_up(heap, hn++);
                } else if (worse(heap[0], c)) {
                    heap[0] = c;
                    sift_down(heap, hn, 0);
                }
            }
            if (kbuf != kf) free(kbuf);
            for (int i = 0; i < topk; i++) out[i] = heap[i].pos;
            qsort(out, (size_t)topk, sizeof *out, cmp_i32);
        }
        free(heap), free(q8), free(qf), free(wq);
    }
}
