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

/* A candidate: its logit (later its unnormalised probability) and id. 8 bytes, so `vocab` of them
 * fit in the 2*vocab-float scratch; no global state, so sampling is reentrant. */
typedef struct cand {
    float v;
    int32_t id;
} cand;

/* "a ranks before b": higher logit, then lower id. */
static inline int better(cand a, cand b) { return a.v > b.v || (a.v == b.v && a.id < b.id); }

static int argmax(const float *lg, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (lg[i] > lg[best]) best = i;
    return best;
}

/* Min-heap on rank (root = the worst kept candidate), for top-k selection in O(V log k). */
static void sift_down(cand *h, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && better(h[w], h[l])) w = l;
        if (r < n && better(h[w], h[r])) w = r;
        if (w == i) return;
        cand t = h[i];
        h[i] = h[w], h[w] = t;
        i = w;
    }
}

static int cmp_rank(const void *a, const void *b) {
    cand x = *(const cand *)a, y = *(const cand *)b;
    return better(x, y) ? -1 : better(y, x) ? 1 : 0;
}

/* Fills c with the best k candidates (k < vocab: heap selection, no full sort), best first. */
static void rank_candidates(cand *c, int k, const float *lg, int vocab) {
    for (int i = 0; i < k; i++) c[i] = (cand){lg[i], i};
    if (k < vocab) {
        for (int i = k / 2 - 1; i >= 0; i--) sift_down(c, k, i);
        for (int i = k; i < vocab; i++) {
            cand x = {lg[i], i};
            if (better(x, c[0])) {
                c[0] = x;
                sift_down(c, k, 0);
            }
        }
    }
    qsort(c, (size_t)k, sizeof *c, cmp_rank);
}

/* ---------------------------------------------------------------- sampling */

int lunar_sample(const float *logits, int vocab, const lunar_sampling *s, lunar_rng *rng,
                 void *scratch) {
    LUNAR_ASSERT(vocab >= 1);
    if (s->temperature <= 0.0f || s->top_k == 1) return argmax(logits, vocab);

    cand *c = scratch ? scratch : lunar_xmalloc((size_t)vocab * sizeof(cand));
    int n = s->top_k > 0 && s->top_k < vocab ? s->top_k : vocab;

    /* candidates best first (needed by top-k/top-p; plain sampling keeps id order) */
    if (n < vocab || s->top_p < 1.0f) {
        rank_candidates(c, n, logits, vocab);
    } else {
        for (int i = 0; i < n; i++) c[i] = (cand){logits[i], i};
    }

    /* softmax(logits / temperature), unnormalised; the best logit gives exp(0) = 1, so as the
     * temperature -> 0 all the mass goes to the argmax (its ties share it). */
    float mx = logits[argmax(logits, vocab)];
    double total = 0;
    for (int i = 0; i < n; i++) total += (c[i].v = expf((c[i].v - mx) / s->temperature));

    /* top-p: the smallest best-first prefix whose probability reaches top_p (at least one). */
    if (s->top_p < 1.0f) {
        double cum = 0, target = (double)s->top_p * total;
        int keep = 0;
        while (keep < n) {
            cum += c[keep++].v;
            if (cum >= target) break;
        }
        n = keep;
        total = cum;
    }

    /* one draw: the first candidate where the running sum exceeds u * total */
    double u = (double)lunar_rng_uniform(rng) * total, cum = 0;
    int chosen = c[n - 1].id;
    for (int i = 0; i < n; i++) {
        cum += c[i].v;
        if (u < cum) {
            chosen = c[i].id;
            break;
        }
    }
    if (!scratch) free(c);
    return chosen;
}
