/* Router: hand-checked selections (ties, bias, groups) and weights. */
#include "ops.h"
#include "ops_util.h"
#include "test.h"

static float sig(float x) { return 1.0f / (1.0f + expf(-x)); }

TEST(router_topk_ties_to_lower_index) {
    /* s = sigmoid(logits) = {.5, .88, .88, .27}: experts 1 and 2 tie -> [1, 2]; renorm halves */
    float logits[8] = {0, 2, 2, -1, /* token 2: all equal -> [0, 1] */ 3, 3, 3, 3};
    int32_t ex[4] = {-1, -1, -1, -1};
    float w[4] = {NAN, NAN, NAN, NAN};
    op_router_topk(ex, w, logits, NULL, 2, 4, 2, 1, 1, 1, 2.0f);
    CHECK(ex[0] == 1 && ex[1] == 2);
    CHECK(ex[2] == 0 && ex[3] == 1);
    for (int i = 0; i < 4; i++) CHECK_NEAR(w[i], 1.0, 1e-6); /* 0.5 each, times scale 2 */
}

TEST(router_bias_changes_selection_not_weights) {
    float logits[4] = {1.0f, 0.0f, 0.5f, -1.0f}, bias_v[4] = {0, 0, 1.0f, 0};
    lunar_tensor bias = test_tensor1(LUNAR_DTYPE_F32, 4, bias_v);
    int32_t ex[2];
    float w[2] = {NAN, NAN};
    /* choice = {.73, .5, 1.62, .27} -> [2, 0]; weights are the unbiased sigmoids */
    op_router_topk(ex, w, logits, &bias, 1, 4, 2, 1, 1, 1, 1.0f);
    CHECK(ex[0] == 2 && ex[1] == 0);
    float s2 = sig(0.5f), s0 = sig(1.0f);
    CHECK_NEAR(w[0], s2 / (s2 + s0), 1e-6);
    CHECK_NEAR(w[1], s0 / (s2 + s0), 1e-6);
    /* no renorm: raw sigmoid times the scale */
    op_router_topk(ex, w, logits, &bias, 1, 4, 2, 1, 1, 0, 2.5f);
    CHECK(ex[0] == 2 && ex[1] == 0);
    CHECK_NEAR(w[0], 2.5 * s2, 1e-6);
    CHECK_NEAR(w[1], 2.5 * s0, 1e-6);
    /* without the bias expert 0 leads */
    op_router_topk(ex, w, logits, NULL, 1, 4, 2, 1, 1, 0, 1.0f);
    CHECK(ex[0] == 0 && ex[1] == 2);
    test_tensor_free(&bias);
}

TEST(router_group_limited) {
    /* logits 0 -> s = .5 everywhere; the bias sets the choice scores
     * choice = {.8 .8 | .7 .7 | 1.4 .1 | .5 .5}; group top-2 sums 1.6, 1.4, 1.5, 1.0.
     * topk_group = 2 keeps groups 0 and 2: experts [4, 0, 1, 5] (5 beats 2 and 3, which are out);
     * without groups: [4, 0, 1, 2]. */
    float logits[8] = {0}, bias_v[8] = {0.3f, 0.3f, 0.2f, 0.2f, 0.9f, -0.4f, 0.0f, 0.0f};
    lunar_tensor bias = test_tensor1(LUNAR_DTYPE_F32, 8, bias_v);
    int32_t ex[4];
    float w[4] = {NAN, NAN, NAN, NAN};
    op_router_topk(ex, w, logits, &bias, 1, 8, 4, 4, 2, 1, 1.0f);
    CHECK(ex[0] == 4 && ex[1] == 0 && ex[2] == 1 && ex[3] == 5);
    for (int i = 0; i < 4; i++) CHECK_NEAR(w[i], 0.25, 1e-7);
    op_router_topk(ex, w, logits, &bias, 1, 8, 4, 1, 1, 1, 1.0f);
    CHECK(ex[0] == 4 && ex[1] == 0 && ex[2] == 1 && ex[3] == 2);
    /* topk_group = 1: group 0 alone */
    op_router_topk(ex, w, logits, &bias, 1, 8, 2, 4, 1, 1, 1.0f);
    CHECK(ex[0] == 0 && ex[1] == 1);
    test_tensor_free(&bias);
}

TEST(router_matches_brute_force) {
    /* random logits/bias, many tokens: selection equals sorting all experts by choice score, and
     * the weights are the renormalised sigmoids times the scale */
    const int n = 50, E = 32, k = 6;
    float *logits = test_rand(n * E, 41, -4, 4), *bv = test_rand(E, 42, -0.5f, 0.5f);
    lunar_tensor bias = test_tensor1(LUNAR_DTYPE_F32, E, bv);
    int32_t *ex = malloc(sizeof(int32_t) * n * k);
    float *w = test_poisoned(n * k);
    op_router_topk(ex, w, logits, &bias, n, E, k, 1, 1, 1, 2.446f);
    for (int t = 0; t < n; t++) {
        const float *lg = logits + t * E;
        double sum = 0;
        for (int i = 0; i < k; i++) {
            int e = ex[t * k + i], rank = 0;
            float ce = sig(lg[e]) + bv[e];
            for (int j = 0; j < E; j++) {
                float cj = sig(lg[j]) + bv[j];
                rank += cj > ce || (cj == ce && j < e);
            }
            CHECK(rank == i);
            sum += sig(lg[e]);
        }
        for (int i = 0; i < k; i++)
            CHECK_NEAR(w[t * k + i], sig(lg[ex[t * k + i]]) / sum * 2.446, 1e-6);
    }
    test_tensor_free(&bias);
    free(logits), free(bv), free(ex), free(w);
}

/* A NaN logit ranks last and never makes the selection fail or return an out-of-range index:
 * an all-NaN row still selects k valid experts (the lowest indices, all tied at -inf). */
TEST(router_nan_logits_rank_last) {
    float logits[8] = {NAN, 1.0f, NAN, 0.5f, /* token 2: all NaN */ NAN, NAN, NAN, NAN};
    int32_t ex[4] = {-1, -1, -1, -1};
    float w[4];
    op_router_topk(ex, w, logits, NULL, 2, 4, 2, 1, 1, 0, 1.0f);
    CHECK(ex[0] == 1 && ex[1] == 3);
    CHECK(ex[2] == 0 && ex[3] == 1);
}
