/* Sampler: rng, greedy, top-k, top-p, temperature, reproducibility, frequencies. */
#include <stdlib.h>

#include "engine/sampler.h"
#include "ops_util.h"
#include "test.h"

static lunar_sampling cfg(float temperature, int top_k, float top_p, uint64_t seed) {
    lunar_sampling s = {temperature, top_k, top_p, seed};
    return s;
}

TEST(rng_seeding_and_range) {
    lunar_rng r;
    lunar_rng_seed(&r, 0);
    CHECK(r.s[0] == 0xe220a8397b1dcdafULL); /* splitmix64's first output from 0 (reference value) */
    double mean = 0;
    for (int i = 0; i < 100000; i++) {
        float u = lunar_rng_uniform(&r);
        CHECK(u >= 0.0f && u < 1.0f);
        mean += u;
    }
    CHECK_NEAR(mean / 100000, 0.5, 0.005);
}

TEST(sample_greedy_and_ties) {
    float lg[6] = {0.1f, 3.0f, -1.0f, 3.0f, 2.9f, 0.0f};
    lunar_rng r;
    lunar_rng_seed(&r, 1);
    lunar_sampling g = cfg(0.0f, 0, 1.0f, 1);
    CHECK(lunar_sample(lg, 6, &g, &r, NULL) == 1); /* tie 1 vs 3: lower id */
    g.temperature = -1.0f;
    CHECK(lunar_sample(lg, 6, &g, &r, NULL) == 1);
    /* top_k = 1 at any temperature is greedy */
    lunar_sampling k1 = cfg(1.5f, 1, 0.9f, 1);
    for (int i = 0; i < 50; i++) CHECK(lunar_sample(lg, 6, &k1, &r, NULL) == 1);
    /* tiny top_p keeps only the best candidate (the tie's lower id) */
    lunar_sampling p0 = cfg(1.0f, 0, 1e-6f, 1);
    for (int i = 0; i < 50; i++) CHECK(lunar_sample(lg, 6, &p0, &r, NULL) == 1);
    /* temperature -> 0 with a unique max: always the argmax */
    float lu[4] = {0.0f, 1.0f, 0.999f, -5.0f};
    lunar_sampling t0 = cfg(1e-4f, 0, 1.0f, 1);
    for (int i = 0; i < 200; i++) CHECK(lunar_sample(lu, 4, &t0, &r, NULL) == 1);
}

static void draw_many(int *out, int n, const float *lg, int vocab, const lunar_sampling *s) {
    lunar_rng r;
    lunar_rng_seed(&r, s->seed);
    void *scratch = malloc(sizeof(float) * 2 * (size_t)vocab);
    for (int i = 0; i < n; i++) out[i] = lunar_sample(lg, vocab, s, &r, i % 2 ? scratch : NULL);
    free(scratch);
}

TEST(sample_seeded_reproducible) {
    const int V = 1000, N = 200;
    float *lg = test_rand(V, 51, -3, 3);
    int a[200], b[200], c[200];
    lunar_sampling s = cfg(0.8f, 40, 0.95f, 1234);
    draw_many(a, N, lg, V, &s);
    draw_many(b, N, lg, V, &s);
    s.seed = 1235;
    draw_many(c, N, lg, V, &s);
    int same = 0, diff = 0;
    for (int i = 0; i < N; i++) same += a[i] == b[i], diff += a[i] != c[i];
    CHECK(same == N);
    CHECK(diff > N / 4);
    free(lg);
}

/* Empirical frequencies over N draws: each within 0.02 of the expected probability (the binomial
 * standard deviation is <= sqrt(.25 / 20000) = 0.0035, so this is > 5 sigma). */
static void check_freqs(const float *lg, int V, const lunar_sampling *s, const double *expect) {
    const int N = 20000;
    int *out = malloc(sizeof(int) * N), cnt[16] = {0};
    draw_many(out, N, lg, V, s);
    for (int i = 0; i < N; i++) cnt[out[i]]++;
    for (int v = 0; v < V; v++)
        CHECK_MSG(fabs((double)cnt[v] / N - expect[v]) <= 0.02, "token %d: freq %.4f expected %.4f",
                  v, (double)cnt[v] / N, expect[v]);
    free(out);
}

TEST(sample_frequencies_temperature_topk_topp) {
    /* probabilities .5 .3 .15 .05 at temperature 1 */
    float lg[4] = {logf(0.5f), logf(0.3f), logf(0.15f), logf(0.05f)};
    double full[4] = {0.5, 0.3, 0.15, 0.05};
    lunar_sampling s = cfg(1.0f, 0, 1.0f, 7);
    check_freqs(lg, 4, &s, full);
    /* top-p 0.75: the smallest prefix reaching .75 is {0, 1}, renormalised */
    double p75[4] = {0.625, 0.375, 0, 0};
    s = cfg(1.0f, 0, 0.75f, 8);
    check_freqs(lg, 4, &s, p75);
    /* top-p 0.85: {0, 1, 2} */
    double p85[4] = {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0};
    s = cfg(1.0f, 0, 0.85f, 9);
    check_freqs(lg, 4, &s, p85);
    /* top-k 3 then top-p .8 over the renormalised survivors (.526 .316 .158): {0, 1} */
    s = cfg(1.0f, 3, 0.8f, 10);
    check_freqs(lg, 4, &s, p75);
    /* temperature 2: p ~ sqrt(p) */
    double z = sqrt(0.5) + sqrt(0.3) + sqrt(0.15) + sqrt(0.05);
    double t2[4] = {sqrt(0.5) / z, sqrt(0.3) / z, sqrt(0.15) / z, sqrt(0.05) / z};
    s = cfg(2.0f, 0, 1.0f, 11);
    check_freqs(lg, 4, &s, t2);
    /* top-k 2 */
    double k2[4] = {0.625, 0.375, 0, 0};
    s = cfg(1.0f, 2, 1.0f, 12);
    check_freqs(lg, 4, &s, k2);
}

TEST(sample_large_vocab_topk_partial_selection) {
    const int V = 163840, K = 50;
    float *lg = test_rand(V, 61, -10, 10);
    lunar_rng r;
    lunar_rng_seed(&r, 3);
    lunar_sampling s = cfg(1.0f, K, 1.0f, 3);
    for (int i = 0; i < 100; i++) {
        int tok = lunar_sample(lg, V, &s, &r, NULL), rank = 0;
        for (int v = 0; v < V; v++) rank += lg[v] > lg[tok] || (lg[v] == lg[tok] && v < tok);
        CHECK(rank < K);
    }
    /* greedy over the full vocabulary */
    int best = 0;
    for (int v = 1; v < V; v++) best = lg[v] > lg[best] ? v : best;
    lunar_sampling g = cfg(0.0f, 0, 1.0f, 0);
    CHECK(lunar_sample(lg, V, &g, &r, NULL) == best);
    free(lg);
}
