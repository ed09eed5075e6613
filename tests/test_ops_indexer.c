/* DSA indexer (SPEC 1.1) against a brute-force transcription (full sort, ties to the lower
 * position), in fp32 and FP8 modes; sparse MLA against the dense absorbed op. */
#include "ops.h"
#include "ops_util.h"
#include "test.h"

typedef struct {
    float score;
    int pos;
} sc_pos;
static int by_rank(const void *a, const void *b) {
    const sc_pos *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return x->pos - y->pos;
}
static int asc(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

/* Brute force: the dequantised vectors (FP8: q8*sq, k8*sk; exact since the scales are powers of
 * two), I = sum_h w_h relu(q_h . k_s) in double, rounded to fp32, full sort. */
static void indexer_ref(int32_t *idx, const float *iq, const float *w, const float *kdq, int T,
                        int pos0, int nh, int d, int topk, int fp8) {
    sc_pos *all = malloc(sizeof(sc_pos) * (pos0 + T));
    float *q = malloc(sizeof(float) * d);
    uint8_t *q8 = malloc(d);
    for (int t = 0; t < T; t++) {
        int n = pos0 + t + 1;
        for (int s = 0; s < n; s++) {
            double I = 0;
            for (int h = 0; h < nh; h++) {
                const float *qh = iq + ((size_t)t * nh + h) * d;
                if (fp8) {
                    float sq = lunar_fp8_quantize_pow2(q8, qh, d);
                    for (int i = 0; i < d; i++) q[i] = lunar_e4m3_to_f32(q8[i]) * sq;
                } else {
                    memcpy(q, qh, sizeof(float) * d);
                }
                double dot = 0;
                for (int i = 0; i < d; i++) dot += (double)q[i] * kdq[(size_t)s * d + i];
                I += w[t * nh + h] * fmax(dot, 0);
            }
            all[s].score = (float)I, all[s].pos = s;
        }
        qsort(all, n, sizeof *all, by_rank);
        int m = n < topk ? n : topk;
        int *sel = malloc(sizeof(int) * topk);
        for (int i = 0; i < m; i++) sel[i] = all[i].pos;
        qsort(sel, m, sizeof(int), asc);
        for (int i = 0; i < topk; i++) idx[t * topk + i] = i < m ? sel[i] : -1;
        free(sel);
    }
    free(all), free(q), free(q8);
}

static void check_indexer(int T, int pos0, int nh, int d, int topk, int fp8, unsigned seed) {
    const int L = pos0 + T;
    float *iq = test_rand((long)T * nh * d, seed, -1, 1), *w = test_rand((long)T * nh, seed + 1, -0.3f, 1);
    float *k = test_rand((long)L * d, seed + 2, -2, 2), *kdq = test_alloc((long)L * d);
    uint8_t *codes = malloc((size_t)L * d);
    float *scales = malloc(sizeof(float) * L);
    lunar_index_cache c = {0};
    if (fp8) {
        for (int s = 0; s < L; s++) {
            scales[s] = lunar_fp8_quantize_pow2(codes + (size_t)s * d, k + (size_t)s * d, d);
            for (int i = 0; i < d; i++) kdq[(size_t)s * d + i] = lunar_e4m3_to_f32(codes[(size_t)s * d + i]) * scales[s];
        }
        c.codes = codes, c.scales = scales;
    } else {
        memcpy(kdq, k, sizeof(float) * L * d);
        c.keys = k;
    }
    int32_t *idx = malloc(sizeof(int32_t) * T * topk), *ref = malloc(sizeof(int32_t) * T * topk);
    int32_t *cnt = malloc(sizeof(int32_t) * T);
    memset(idx, 0x55, sizeof(int32_t) * T * topk), memset(cnt, 0x55, sizeof(int32_t) * T);
    op_dsa_indexer(idx, cnt, iq, w, &c, T, pos0, nh, d, topk);
    indexer_ref(ref, iq, w, kdq, T, pos0, nh, d, topk, fp8);
    for (int t = 0; t < T; t++) {
        int n = pos0 + t + 1;
        CHECK(cnt[t] == (n < topk ? n : topk));
        for (int i = 0; i < topk; i++)
            CHECK_MSG(idx[t * topk + i] == ref[t * topk + i], "T=%d pos0=%d fp8=%d t=%d i=%d: %d vs %d", T, pos0, fp8, t, i,
                      idx[t * topk + i], ref[t * topk + i]);
    }
    free(iq), free(w), free(k), free(kdq), free(codes), free(scales), free(idx), free(ref), free(cnt);
}

/* The op and the reference form the same double sums (the FP8 dot is exact in double and scaling
 * by the power-of-two scales commutes with rounding), so the fp32 scores and hence the selections
 * agree exactly, ties included. */
TEST(dsa_indexer_matches_brute_force) {
    check_indexer(1, 0, 2, 8, 4, 0, 1);      /* first token: everything, padded with -1 */
    check_indexer(6, 0, 3, 16, 4, 0, 2);     /* prefill crossing n = topk */
    check_indexer(5, 11, 4, 32, 7, 0, 3);    /* continuation, fp32 keys */
    check_indexer(5, 11, 4, 32, 7, 1, 4);    /* the same with FP8 keys and queries */
    check_indexer(1, 300, 8, 128, 64, 1, 5); /* decode, the real head width */
    check_indexer(3, 40, 2, 128, 1, 1, 6);   /* topk = 1 */
}

TEST(dsa_indexer_ties_and_relu) {
    /* all keys equal: every score ties, so the lowest positions win */
    const int nh = 2, d = 4, L = 10, topk = 3;
    float iq[8] = {1, 0, 0, 0, 0, 1, 0, 0}, w[2] = {1, 1}, keys[40];
    for (int s = 0; s < L; s++)
        for (int i = 0; i < d; i++) keys[s * d + i] = 0.5f;
    lunar_index_cache c = {.keys = keys};
    int32_t idx[3], cnt;
    op_dsa_indexer(idx, &cnt, iq, w, &c, 1, L - 1, nh, d, topk);
    CHECK(cnt == 3 && idx[0] == 0 && idx[1] == 1 && idx[2] == 2);
    /* ReLU per head: head 0 likes positive k0, head 1 (weight 3) positive k1. Position 7 has a
     * large negative k1 that must not cancel its head-0 score. */
    for (int i = 0; i < 40; i++) keys[i] = 0;
    keys[7 * d + 0] = 2, keys[7 * d + 1] = -100; /* I = 2 */
    keys[4 * d + 1] = 1;                         /* I = 3 */
    keys[2 * d + 0] = 1;                         /* I = 1 */
    w[1] = 3;
    op_dsa_indexer(idx, &cnt, iq, w, &c, 1, L - 1, nh, d, topk);
    CHECK(idx[0] == 2 && idx[1] == 4 && idx[2] == 7); /* ascending positions */
    /* future positions are never chosen: query at position 3 sees 0..3 only */
    keys[9 * d + 0] = 50;
    op_dsa_indexer(idx, &cnt, iq, w, &c, 1, 3, nh, d, topk);
    CHECK(cnt == 3 && idx[0] >= 0 && idx[2] <= 3);
}

/* Sparse MLA. topk >= context with ascending indices: bitwise the dense absorbed op. Small topk:
 * the dense formula over the selected rows, computed here by building a compacted cache of the
 * selected rows and running the dense absorbed op for that single query over it (the same
 * statements, so again exact). */
TEST(mla_sparse_matches_dense) {
    const int T = 4, pos0 = 5, H = 3, N = 7, P = 3, Vd = 5, R = 11, L = pos0 + T;
    float *cache = test_rand(L * (R + P), 501, -1, 1), *q = test_rand(T * H * (N + P), 502, -1, 1);
    float *wv = test_rand(H * (N + Vd) * R, 503, -0.5f, 0.5f);
    lunar_tensor W = test_tensor2(LUNAR_DTYPE_BF16, H * (N + Vd), R, wv);
    const float sc = 1.0f / sqrtf((float)(N + P));
    float *od = test_poisoned(T * H * Vd), *os = test_poisoned(T * H * Vd);
    const int big = L + 3;
    int32_t *idx = malloc(sizeof(int32_t) * T * big);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < big; i++) idx[t * big + i] = i <= pos0 + t ? i : -1;
    op_mla_attention_absorbed(od, q, cache, &W, T, pos0, H, N, P, Vd, R, sc);
    op_mla_attention_sparse(os, q, cache, &W, idx, big, T, L, H, N, P, Vd, R, sc);
    CHECK(memcmp(od, os, sizeof(float) * T * H * Vd) == 0);

    /* topk = 3 arbitrary rows per query (with a -1 hole) */
    const int k = 4;
    int32_t sel[4][4] = {{0, -1, 2, 5}, {1, 3, -1, 6}, {7, 0, 4, -1}, {-1, 8, 2, 5}};
    op_mla_attention_sparse(os, q, cache, &W, &sel[0][0], k, T, L, H, N, P, Vd, R, sc);
    float *sub = test_alloc(3 * (R + P)), *o1 = test_poisoned(H * Vd);
    for (int t = 0; t < T; t++) {
        int m = 0;
        for (int i = 0; i < k; i++)
            if (sel[t][i] >= 0) memcpy(sub + (m++) * (R + P), cache + sel[t][i] * (R + P), sizeof(float) * (R + P));
        /* one query at position m-1 over the m compacted rows = attention over exactly those rows */
        op_mla_attention_absorbed(o1, q + t * H * (N + P), sub, &W, 1, m - 1, H, N, P, Vd, R, sc);
        CHECK(memcmp(o1, os + t * H * Vd, sizeof(float) * H * Vd) == 0);
    }
    /* no valid index: zeros */
    int32_t none[2] = {-1, -1};
    op_mla_attention_sparse(o1, q, cache, &W, none, 2, 1, L, H, N, P, Vd, R, sc);
    for (int i = 0; i < H * Vd; i++) CHECK(o1[i] == 0.0f);
    test_tensor_free(&W);
    free(cache), free(q), free(wv), free(od), free(os), free(idx), free(sub), free(o1);
}

/* The whole K3.1 index path on a small case: LayerNorm'd keys, Hadamard, FP8, scoring. With the
 * rotation applied to both sides the fp32-mode selection equals the unrotated one up to rounding,
 * and a key that is a large positive multiple of the (single-head) query always ranks first. */
TEST(dsa_indexer_pipeline_smoke) {
    const int d = 128, L = 50, nh = 1, topk = 5;
    float *k = test_rand(L * d, 601, -1, 1), *iq = test_rand(d, 602, -1, 1), w = 1;
    op_layernorm(k, k, NULL, NULL, L, d, 1e-6f);
    for (int i = 0; i < d; i++) k[17 * d + i] = 3 * iq[i];
    op_hadamard(k, L, d), op_hadamard(iq, 1, d);
    uint8_t *codes = malloc(L * d);
    float *sc = malloc(sizeof(float) * L);
    for (int s = 0; s < L; s++) sc[s] = lunar_fp8_quantize_pow2(codes + s * d, k + s * d, d);
    lunar_index_cache c8 = {.codes = codes, .scales = sc}, cf = {.keys = k};
    int32_t i8[5], i32[5];
    op_dsa_indexer(i8, NULL, iq, &w, &c8, 1, L - 1, nh, d, topk);
    op_dsa_indexer(i32, NULL, iq, &w, &cf, 1, L - 1, nh, d, topk);
    int has8 = 0, has32 = 0;
    for (int i = 0; i < topk; i++) has8 |= i8[i] == 17, has32 |= i32[i] == 17;
    CHECK(has8 && has32);
    free(k), free(iq), free(codes), free(sc);
}
