/* Token sampling: temperature, top-k, top-p, then one draw from a seeded xoshiro256** stream.
 * Candidates are ordered by decreasing logit with ties to the lower id, so greedy, top-k and the
 * draw are all deterministic functions of (logits, settings, rng state). */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>

#include "base/err.h"

/* ---------------------------------------------------------------- rng */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void lunar_rng_seed(lunar_rng *rng, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) rng->s[i] = splitmix64(&x);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t lunar_rng_next(lunar_rng *rng) {
    uint64_t *s = rng->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

float lunar_rng_uniform(lunar_rng *rng) {
    return (float)(lunar_rng_next(rng) >> 40) * (1.0f / 16777216.0f);
}

/* ---------------------------------------------------------------- candidate ordering */

/* "a ranks before b": higher logit, then lower id. */
static inline int better(const float *lg, int32_t a, int32_t b) {
    return lg[a] > lg[b] || (lg[a] == lg[b] && a < b);
}

static int argmax(const float *lg, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (lg[i] > lg[best]) best = i;
    return best;
}

/* Min-heap on rank (root = the worst kept candidate), for top-k selection in O(V log k). */
static void sift_down(int32_t *h, int n, int i, const float *lg) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && better(lg, h[w], h[l])) w = l;
        if (r < n && better(lg, h[w], h[r])) w = r;
        if (w == i) return;
        int32_t t = h[i];
        h[i] = h[w], h[w] = t;
        i = w;
    }
}

static const float *sort_logits; /* qsort has no context argument; sampling is single-threaded */
static int cmp_rank(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return better(sort_logits, x, y) ? -1 : better(sort_logits, y, x) ? 1 : 0;
}

/* Fills idx with the best k ids (k < vocab: heap selection) or all ids, sorted best first. */
static void rank_candidates(int32_t *idx, int k, const float *lg, int vocab) {
    if (k < vocab) {
        for (int i = 0; i < k; i++) idx[i] = i;
        for (int i = k / 2 - 1; i >= 0; i--) sift_down(idx, k, i, lg);
        for (int i = k; i < vocab; i++) {
            if (better(lg, i, idx[0])) {
                idx[0] = i;
                sift_down(idx, k, 0, lg);
            }
        }
    } else {
        for (int i = 0; i < vocab; i++) idx[i] = i;
    }
    sort_logits = lg;
    qsort(idx, (size_t)k, sizeof *idx, cmp_rank);
}

/* ---------------------------------------------------------------- sampling */

int lunar_sample(const float *logits, int vocab, const lunar_sampling *s, lunar_rng *rng,
                 void *scratch) {
    LUNAR_ASSERT(vocab >= 1);
    if (s->temperature <= 0.0f || s->top_k == 1) return argmax(logits, vocab);

    void *mem = scratch ? scratch : lunar_xmalloc((size_t)vocab * 2 * sizeof(float));
    int32_t *idx = mem;
    float *p = (float *)mem + vocab;
    int n = s->top_k > 0 && s->top_k < vocab ? s->top_k : vocab;
    int want_sorted = n < vocab || s->top_p < 1.0f;

    /* softmax(logits / temperature) over the candidates; the best logit gives exp(0) = 1, so a
     * temperature -> 0 concentrates all the mass on the argmax (its ties share it). */
    if (want_sorted) {
        rank_candidates(idx, n, logits, vocab);
    } else {
        for (int i = 0; i < n; i++) idx[i] = i;
    }
    float mx = logits[want_sorted ? idx[0] : argmax(logits, vocab)];
    double total = 0;
    for (int i = 0; i < n; i++) total += (p[i] = expf((logits[idx[i]] - mx) / s->temperature));

    /* top-p: the smallest best-first prefix whose probability reaches top_p (at least one). */
    if (s->top_p < 1.0f) {
        double cum = 0, target = (double)s->top_p * total;
        int keep = 0;
        while (keep < n) {
            cum += p[keep++];
            if (cum >= target) break;
        }
        n = keep;
        total = cum;
    }

    /* one draw: the first candidate where the running sum exceeds u * total */
    double u = (double)lunar_rng_uniform(rng) * total, cum = 0;
    int chosen = idx[n - 1];
    for (int i = 0; i < n; i++) {
        cum += p[i];
        if (u < cum) {
            chosen = idx[i];
            break;
        }
    }
    if (!scratch) free(mem);
    return chosen;
}
