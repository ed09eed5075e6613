/* Paged caches and batches: a batch of sequences computes exactly what each sequence computes
 * alone, whatever blocks they were given; FP8 / BF16 latent storage and the fp16 KDA state
 * change the logits only by their rounding. */
#include <stdlib.h>
#include <string.h>

#include "model/forward.h"
#include "test.h"

static lunar_model *load(const char *dir) {
    lunar_model *m;
    lunar_err err;
    if (lunar_model_load(&m, dir, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return NULL;
    }
    return m;
}

/* Two sequences of different lengths on scattered blocks, prefill then three decode steps, in
 * one batch; vs each alone. Bitwise equal: each row's arithmetic does not depend on the batch. */
static void batch_vs_alone(const char *dir) {
    lunar_model *m = load(dir);
    if (!m) return;
    const int V = m->cfg.vocab_size;
    lunar_err err;
    lunar_kv_pool kv;
    lunar_state_pool st;
    CHECK(lunar_kv_pool_init(&kv, &m->cfg, 8, LUNAR_KV_F32, &err) == 0);
    CHECK(lunar_state_pool_init(&st, &m->cfg, 3, 0, &err) == 0);
    int32_t blocks_a[] = {5, 1, 6}, blocks_b[] = {2, 7, 0}; /* scattered, disjoint */
    int32_t ids_a[200], ids_b[140];
    for (int i = 0; i < 200; i++) ids_a[i] = (i * 37 + 11) % V;
    for (int i = 0; i < 140; i++) ids_b[i] = (i * 53 + 5) % V;
    float *lg = lunar_xmalloc((size_t)4 * V * sizeof(float)), *ref = lunar_xmalloc((size_t)V * sizeof(float));
    lunar_seq sa, sb;
    CHECK(lunar_seq_init(&sa, m, 260, &err) == 0 && lunar_seq_init(&sb, m, 260, &err) == 0);
    /* step 0: both prompts (a wants its last logits, b all of them is too big: last) */
    lunar_batch_seq b0[2] = {{ids_a, 197, 0, 1, blocks_a, LUNAR_LOGITS_LAST},
                             {ids_b, 137, 0, 2, blocks_b, LUNAR_LOGITS_LAST}};
    CHECK(lunar_forward_batch(m, &kv, &st, b0, 2, lg, &err) == 0);
    CHECK(lunar_forward(m, &sa, ids_a, 197, ref, 0, &err) == 0);
    CHECK(memcmp(lg, ref, (size_t)V * sizeof(float)) == 0);
    CHECK(lunar_forward(m, &sb, ids_b, 137, ref, 0, &err) == 0);
    CHECK(memcmp(lg + V, ref, (size_t)V * sizeof(float)) == 0);
    for (int k = 0; k < 3; k++) { /* decodes */
        lunar_batch_seq b1[2] = {{ids_a + 197 + k, 1, 197 + k, 1, blocks_a, LUNAR_LOGITS_LAST},
                                 {ids_b + 137 + k, 1, 137 + k, 2, blocks_b, LUNAR_LOGITS_LAST}};
        CHECK(lunar_forward_batch(m, &kv, &st, b1, 2, lg, &err) == 0);
        CHECK(lunar_forward(m, &sa, ids_a + 197 + k, 1, ref, 0, &err) == 0);
        CHECK_MSG(memcmp(lg, ref, (size_t)V * sizeof(float)) == 0, "%s: decode %d seq a", dir, k);
        CHECK(lunar_forward(m, &sb, ids_b + 137 + k, 1, ref, 0, &err) == 0);
        CHECK_MSG(memcmp(lg + V, ref, (size_t)V * sizeof(float)) == 0, "%s: decode %d seq b", dir, k);
    }
    lunar_seq_free(&sa), lunar_seq_free(&sb);
    lunar_kv_pool_free(&kv), lunar_state_pool_free(&st);
    free(lg), free(ref);
    lunar_model_free(m);
}

TEST(cache_batch_equals_alone_kimi_linear) { batch_vs_alone("tests/golden/tiny-a"); }
TEST(cache_batch_equals_alone_k31) { batch_vs_alone("tests/golden/k31-b"); }

/* Low-precision storage: the stored latent rows are exactly representable, and the logits move
 * only by a little (the latent is RMS-normalised: e4m3's 3 mantissa bits give ~6 % per value, and
 * attention averages it out). */
TEST(cache_fp8_bf16_latent_and_fp16_state) {
    lunar_model *m = load("tests/golden/tiny-a");
    if (!m) return;
    const int V = m->cfg.vocab_size;
    lunar_err err;
    int32_t ids[150], blocks[] = {0, 1};
    for (int i = 0; i < 150; i++) ids[i] = (i * 29 + 3) % V;
    float *ref = lunar_xmalloc((size_t)V * sizeof(float)), *lg = lunar_xmalloc((size_t)V * sizeof(float));
    const lunar_kv_dtype dts[3] = {LUNAR_KV_F32, LUNAR_KV_BF16, LUNAR_KV_FP8};
    const double tol[3] = {0, 2e-2, 2e-1};
    for (int d = 0; d < 3; d++)
        for (int fp16 = 0; fp16 < 2; fp16++) {
            lunar_kv_pool kv;
            lunar_state_pool st;
            CHECK(lunar_kv_pool_init(&kv, &m->cfg, 2, dts[d], &err) == 0);
            CHECK(lunar_state_pool_init(&st, &m->cfg, 1, fp16, &err) == 0);
            lunar_batch_seq s = {ids, 149, 0, 0, blocks, LUNAR_LOGITS_NONE};
            CHECK(lunar_forward_batch(m, &kv, &st, &s, 1, lg, &err) == 0);
            lunar_batch_seq s2 = {ids + 149, 1, 149, 0, blocks, LUNAR_LOGITS_LAST};
            CHECK(lunar_forward_batch(m, &kv, &st, &s2, 1, d == 0 && !fp16 ? ref : lg, &err) == 0);
            if (d == 2) { /* every stored latent value is an e4m3 value */
                const float *row = lunar_kv_latent_row(&kv, 0, blocks, 100);
                for (int i = 0; i < kv.row; i++) CHECK(lunar_e4m3_to_f32(lunar_f32_to_e4m3(row[i])) == row[i]);
            }
            if (fp16) {
                const float *S = lunar_state_kda(&st, 0, 0);
                for (int i = 0; i < 64; i++) CHECK(lunar_f16_to_f32(lunar_f32_to_f16(S[i])) == S[i]);
            }
            if (d || fp16) {
                double e = lunar_max_rel_err(lg, ref, V);
                CHECK_MSG(e > 0 && e <= tol[d] + (fp16 ? 1e-2 : 0), "dtype %d fp16 %d: rel err %.3g", d, fp16, e);
            }
            lunar_kv_pool_free(&kv), lunar_state_pool_free(&st);
        }
    free(ref), free(lg);
    lunar_model_free(m);
}
