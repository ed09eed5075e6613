/* The device stages of decode context parallelism (cuda_mla_partial.cu) against the CPU ops
 * (backend/cpu/mla_partial.c): the partial attention with its log-sum-exp over listed and over
 * leading cache rows, the merge of partials, and the two composed the way DCP uses them (the cache
 * dealt round-robin to D ranks, each rank's partial, the merge) against one partial over the whole
 * cache; the partial read in place from a rank's paged bf16 / FP8 pool in the DCP layout (the
 * places the CPU's lunar_dcp_token names), with the device's slots and causal counts; the query
 * packing; the DSA top-k reduced to local rows as lunar_dcp_local_rows does. Outputs are poisoned (NaN) first, so an entry a kernel does not write fails. Skipped
 * without a CUDA device (the layout test on index-key slots runs everywhere).
 *
 * Tolerances: both sides are fp32; the device takes the max online and sums in another order, so
 * olat differs by a few fp32 ulps of max |o| (1e-5 relative allowed) and lse by ~1e-6 absolute
 * (|lse| ~ 10 here; 1e-4 allowed). An empty row set must give lse = -inf and o = 0 exactly. */
#include "test.h"

#include "model/shard.h"

/* The device DCP path keeps the device's DSA index-key cache as it is: under DCP each local latent
 * row carries the keys of its D positions (idx_rep = D), at key slot lunar_dcp_token * D + p % D,
 * which is the plain pool's slot block * 128 + p % 128 for every D dividing 128. CPU only. */
TEST(dcp_index_slots_match_the_plain_layout) {
    const int32_t blocks[3] = {5, 0, 3};
    for (int D = 1; D <= 128; D *= 2) {
        lunar_kv_pool kv = {.block_size = 128 / D, .n_blocks = 6, .n_mla = 2, .row = 576};
        int bad = 0;
        for (int layer = 0; layer < 2; layer++)
            for (int p = 0; p < 3 * 128 && !bad; p++) {
                const size_t want = ((size_t)layer * kv.n_blocks + (size_t)blocks[p / 128]) * 128 + (size_t)(p % 128);
                const size_t got = lunar_dcp_token(&kv, layer, blocks, p, D) * (size_t)D + (size_t)(p % D);
                if (got != want) {
                    CHECK_MSG(0, "D %d layer %d p %d: slot %zu, plain %zu", D, layer, p, got, want);
                    bad = 1;
                }
            }
    }
}

#ifndef LUNAR_HAVE_CUDA

TEST(cuda_dcp_skipped) { fprintf(stderr, "[skipped: no CUDA device: lunar was built without CUDA] "); }

#else

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_ops.h"
#include "ops.h"
#include "cuda_test.h"
#include "ops_util.h"

enum { R = 512, P = 64, LD = R + P };

static uint32_t rng_state;
static uint32_t rng(void) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return rng_state >> 8;
}

static int cuda_on(void) { return lunar_test_cuda_on((size_t)6 << 30); }

static float *dev_poisoned(size_t n) {
    float *p = lunar_cuda_alloc((n ? n : 1) * sizeof(float));
    LUNAR_ASSERT(p);
    lunar_cuda_fill_u32(p, 0x7fc00000u, n ? n : 1);
    return p;
}
static float *down(const float *d, size_t n) {
    float *h = test_alloc((long)n);
    lunar_cuda_sync();
    lunar_cuda_download(h, d, n * sizeof(float));
    return h;
}

/* lse: the same -inf entries, finite ones within tol */
static void check_lse(const float *got, const float *want, int n, double tol) {
    for (int i = 0; i < n; i++) {
        if (isinf(want[i])) {
            CHECK_MSG(isinf(got[i]) && got[i] < 0, "lse[%d] = %g, want -inf", i, got[i]);
        } else {
            CHECK_MSG(isfinite(got[i]) && fabs(got[i] - want[i]) <= tol, "lse[%d] = %.9g, want %.9g", i, got[i],
                      want[i]);
        }
    }
}

/* One partial on both backends; rows NULL = leading rows. */
static void run_partial(const float *q, const float *cache, int n_cache, const int32_t *rows,
                        const int32_t *count, int stride, int T, int H, float scale) {
    const size_t mark = lunar_cuda_mark();
    float *o_ref = test_alloc((long)T * H * R), *l_ref = test_alloc((long)T * H);
    op_mla_attention_partial(o_ref, l_ref, q, cache, rows, count, stride, T, H, R, P, scale);
    float *dq = dev_in(q, (size_t)T * H * LD * sizeof(float));
    float *dc = dev_in(cache, (size_t)n_cache * LD * sizeof(float));
    int32_t *dr = rows ? dev_in(rows, (size_t)T * stride * sizeof(int32_t)) : NULL;
    int32_t *dn = dev_in(count, (size_t)T * sizeof(int32_t));
    /* whole row lists, and sliced over 3 and 8 blocks (slices empty when a list is short) */
    static const int splits[] = {1, 3, 8};
    for (int k = 0; k < 3; k++) {
        float *dO = dev_poisoned((size_t)T * H * R), *dl = dev_poisoned((size_t)T * H);
        const size_t wsb = lunar_cuda_mla_partial_ws(T, H, R, splits[k]);
        float *ws = wsb ? dev_poisoned(wsb / sizeof(float)) : NULL;
        lunar_cuda_mla_partial_split(dO, dl, dq, dc, dr, dn, stride, T, H, R, P, scale, splits[k], ws, NULL);
        float *o = down(dO, (size_t)T * H * R), *l = down(dl, (size_t)T * H);
        double e = lunar_max_rel_err(o, o_ref, (long)T * H * R);
        CHECK_MSG(e <= 1e-5, "splits %d: olat max rel err %.3g", splits[k], e);
        check_lse(l, l_ref, T * H, 1e-4);
        for (int t = 0; t < T; t++) /* an empty set: exactly zero */
            for (int i = 0; i < (count[t] == 0 ? H * R : 0); i++) CHECK(o[(size_t)t * H * R + i] == 0.0f);
        free(o), free(l);
    }
    free(o_ref), free(l_ref);
    lunar_cuda_release(mark);
}

TEST(cuda_dcp_partial_leading_rows) {
    if (!cuda_on()) return;
    enum { T = 5, H = 3, N = 300 };
    float *q = test_rand((long)T * H * LD, 11, -1, 1), *cache = test_rand((long)N * LD, 12, -1, 1);
    const int32_t count[T] = {1, 0, 17, 300, 129};
    run_partial(q, cache, N, NULL, count, 0, T, H, 1.0f / sqrtf(192.0f));
    /* a peaked softmax (large logits) exercises the online rescale */
    run_partial(q, cache, N, NULL, count, 0, T, H, 0.5f);
    free(q), free(cache);
}

TEST(cuda_dcp_partial_listed_rows) {
    if (!cuda_on()) return;
    enum { T = 4, H = 2, N = 200, K = 64 };
    float *q = test_rand((long)T * H * LD, 21, -1, 1), *cache = test_rand((long)N * LD, 22, -1, 1);
    int32_t rows[T * K], count[T] = {64, 0, 33, 1};
    for (int t = 0; t < T; t++)
        for (int i = 0; i < K; i++) rows[t * K + i] = (int32_t)((i * 37 + t * 11) % N); /* scattered */
    for (int t = 0; t < T; t++) /* past count: never read (an out-of-range row would fault or poison) */
        for (int i = count[t]; i < K; i++) rows[t * K + i] = 1 << 28;
    run_partial(q, cache, N, rows, count, K, T, H, 1.0f / sqrtf(192.0f));
    free(q), free(cache);
}

TEST(cuda_dcp_merge_partials) {
    if (!cuda_on()) return;
    enum { NP = 3, ROWS = 7 };
    const size_t stride = (size_t)ROWS * (R + 1) + 5; /* a padded part pitch */
    float *parts = test_rand((long)(NP * stride), 31, -1, 1);
    for (int p = 0; p < NP; p++)
        for (int i = 0; i < ROWS; i++) {
            float *l = parts + p * stride + (size_t)i * (R + 1) + R;
            *l = 8.0f * *l; /* lse spread */
            if ((i == 2 && p == 1) || i == 5 || (i == 6 && p != 0)) *l = -INFINITY; /* empty sets */
        }
    float *ref = test_alloc((long)ROWS * R);
    op_mla_merge_partials(ref, parts, NP, stride, ROWS, R);
    const size_t mark = lunar_cuda_mark();
    float *dp = dev_in(parts, NP * stride * sizeof(float)), *dout = dev_poisoned((size_t)ROWS * R);
    lunar_cuda_mla_merge_partials(dout, dp, NP, stride, ROWS, R, NULL);
    float *got = down(dout, (size_t)ROWS * R);
    double e = lunar_max_rel_err(got, ref, (long)ROWS * R);
    CHECK_MSG(e <= 1e-5, "merge max rel err %.3g", e);
    for (int r = 0; r < R; r++) CHECK(got[5 * R + r] == 0.0f); /* every part empty */
    lunar_cuda_release(mark);
    free(parts), free(ref), free(got);
}

/* DCP's use: the cache dealt round-robin to D ranks (position p on rank p % D, local row p / D),
 * causal counts per rank as shard_dcp.c forms them, each rank's partial, the parts packed
 * [D][T, H, R + 1] and merged on the device == one partial over the whole cache. */
TEST(cuda_dcp_partials_merge_exact) {
    if (!cuda_on()) return;
    enum { D = 2, T = 3, H = 4, L = 97 };
    const int pos0 = L - T; /* a prefill chunk's last T positions */
    float *q = test_rand((long)T * H * LD, 41, -1, 1), *cache = test_rand((long)L * LD, 42, -1, 1);
    const float scale = 1.0f / sqrtf(192.0f);
    int32_t count[T];
    for (int t = 0; t < T; t++) count[t] = pos0 + t + 1;
    float *o_ref = test_alloc((long)T * H * R), *l_ref = test_alloc((long)T * H);
    op_mla_attention_partial(o_ref, l_ref, q, cache, NULL, count, 0, T, H, R, P, scale);

    const size_t mark = lunar_cuda_mark(), prow = R + 1, part_n = (size_t)T * H * prow;
    float *dq = dev_in(q, (size_t)T * H * LD * sizeof(float));
    float *dparts = dev_poisoned(D * part_n);
    float *dO = lunar_cuda_alloc((size_t)T * H * R * sizeof(float)), *dl = lunar_cuda_alloc((size_t)T * H * sizeof(float));
    LUNAR_ASSERT(dO && dl);
    for (int dr = 0; dr < D; dr++) {
        const int nloc = (L - dr + D - 1) / D;
        float *loc = test_alloc((long)nloc * LD);
        for (int i = 0; i < nloc; i++) memcpy(loc + (size_t)i * LD, cache + (size_t)(dr + i * D) * LD, LD * sizeof(float));
        int32_t cnt[T];
        for (int t = 0; t < T; t++) cnt[t] = pos0 + t >= dr ? (pos0 + t - dr) / D + 1 : 0;
        float *dc = dev_in(loc, (size_t)nloc * LD * sizeof(float));
        int32_t *dn = dev_in(cnt, sizeof cnt);
        lunar_cuda_mla_partial(dO, dl, dq, dc, NULL, dn, 0, T, H, R, P, scale, NULL);
        /* pack [T * H][R | lse] as the all-to-all payload */
        lunar_cuda_copy_2d(dparts + dr * part_n, prow * sizeof(float), dO, R * sizeof(float), R * sizeof(float),
                           (size_t)T * H);
        lunar_cuda_copy_2d(dparts + dr * part_n + R, prow * sizeof(float), dl, sizeof(float), sizeof(float),
                           (size_t)T * H);
        free(loc);
    }
    float *dm = dev_poisoned((size_t)T * H * R);
    lunar_cuda_mla_merge_partials(dm, dparts, D, part_n, T * H, R, NULL);
    float *got = down(dm, (size_t)T * H * R);
    double e = lunar_max_rel_err(got, o_ref, (long)T * H * R);
    CHECK_MSG(e <= 1e-5, "DCP-merged vs whole-cache max rel err %.3g", e);
    lunar_cuda_release(mark);
    free(q), free(cache), free(o_ref), free(l_ref), free(got);
}

/* The partial as the forward runs it: G query groups x T tokens of two sequences, each token over
 * its sequence's rows that rank dr of D holds, read in place from that rank's pages (blocks of 128
 * / D rows, filled at the places the CPU's lunar_dcp_token names; rows never to be read hold NaN
 * codes, so a wrong place shows), with the slots and causal counts from the device's step_rows;
 * against the CPU op over the rank's rows gathered and decoded on the host, token by token; then
 * the DSA form over listed local rows. Output in the send layout [G][T, H, R + 1]. */
static void paged_case(int D, int fp8) {
    enum { NB = 9, MB = 3, L = 300, T = 5, H = 3, G = 2, K = 40 };
    const int br = 128 / D;
    const size_t nrow = (size_t)NB * br;
    const int32_t bt[2 * MB] = {8, 0, 5, /* seq 1: */ 2, 7, 4};
    const int32_t row_seq[T] = {1, 0, 1, 0, 1}, pos[T] = {299, 17, 0, 250, 128};
    const lunar_kv_pool kv = {.block_size = br, .n_blocks = NB, .n_mla = 1, .row = LD};
    const float kv_scale = 1.0f / 32, scale = 0.07f;
    float *vals = test_rand((long)(nrow * LD), 51 + D, -3, 3);
    float *q = test_rand((long)G * T * H * LD, 71 + D, -1, 1);
    const size_t bytes = nrow * LD * (fp8 ? 1 : 2);
    uint8_t *stored = malloc(bytes);
    float *dec = malloc(nrow * LD * sizeof(float)); /* the stored values as the CPU reads them */
    for (int dr = 0; dr < D; dr++) {
        for (size_t i = 0; i < nrow * LD; i++) { /* NaN codes everywhere first */
            if (fp8) stored[i] = 0x7f;
            else ((uint16_t *)stored)[i] = 0x7fc1;
        }
        for (int sq = 0; sq < 2; sq++) /* this rank's rows of both sequences */
            for (int p = dr; p < L; p += D) {
                const size_t tok = lunar_dcp_token(&kv, 0, bt + sq * MB, p, D);
                for (int r = 0; r < LD; r++) {
                    const size_t k = tok * LD + r;
                    if (fp8) stored[k] = lunar_f32_to_e4m3(vals[k] / kv_scale);
                    else ((uint16_t *)stored)[k] = lunar_f32_to_bf16(vals[k]);
                    dec[k] = fp8 ? lunar_e4m3_to_f32(stored[k]) * kv_scale : lunar_bf16_to_f32(((uint16_t *)stored)[k]);
                }
            }
        const size_t mark = lunar_cuda_mark();
        lunar_cuda_mla_cache c = {dev_in(stored, bytes), fp8 ? LUNAR_CUDA_KV_FP8 : LUNAR_CUDA_KV_BF16,
                                  fp8 ? kv_scale : 1.0f, dev_in(bt, sizeof bt), MB};
        int32_t *drs = dev_in(row_seq, sizeof row_seq), *dpos = dev_in(pos, sizeof pos);
        int32_t *dslots = lunar_cuda_alloc(T * 4), *dcount = lunar_cuda_alloc(T * 4);
        LUNAR_ASSERT(dslots && dcount);
        lunar_cuda_fill_u32(dslots, 0x7fffffffu, T);
        lunar_cuda_dcp_step_rows(dslots, dcount, drs, dpos, c.block_tables, MB, T, D, dr, NULL);
        int32_t slots[T], count[T];
        lunar_cuda_sync();
        lunar_cuda_download(slots, dslots, sizeof slots);
        lunar_cuda_download(count, dcount, sizeof count);
        for (int t = 0; t < T; t++) {
            const int32_t want = pos[t] % D == dr ? (int32_t)lunar_dcp_token(&kv, 0, bt + row_seq[t] * MB, pos[t], D) : -1;
            CHECK_MSG(slots[t] == want, "D %d rank %d token %d: slot %d, want %d", D, dr, t, slots[t], want);
            CHECK_MSG(count[t] == (pos[t] >= dr ? (pos[t] - dr) / D + 1 : 0), "D %d rank %d token %d: count %d", D, dr,
                      t, count[t]);
        }
        /* listed rows (DSA): up to K local rows below each token's count, some tokens none */
        int32_t rows[T * K], lcount[T];
        rng_state = 83 + D * 7 + dr;
        for (int t = 0; t < T; t++) {
            lcount[t] = t == 2 ? 0 : (int)(rng() % K) + 1;
            for (int k = 0; k < K; k++) rows[t * K + k] = k < lcount[t] && count[t] ? (int32_t)(rng() % count[t]) : -7;
            if (!count[t]) lcount[t] = 0;
        }
        float *dq = dev_in(q, (size_t)G * T * H * LD * sizeof(float));
        int32_t *drows = dev_in(rows, sizeof rows), *dlc = dev_in(lcount, sizeof lcount);
        float *cache = malloc((size_t)(L / D + 1) * LD * sizeof(float));
        float *o_ref = malloc((size_t)H * R * sizeof(float)), l_ref[H];
        for (int listed = 0; listed < 2; listed++)
            for (int sp = 1; sp <= 3; sp += 2) { /* whole lists, and sliced over 3 blocks */
                const size_t wsb = lunar_cuda_mla_partial_ws(G * T, H, R, sp);
                float *ws = wsb ? dev_poisoned(wsb / sizeof(float)) : NULL;
                float *dout = dev_poisoned((size_t)G * T * H * (R + 1));
                lunar_cuda_dcp_partial_paged(dout, dq, &c, drs, listed ? drows : NULL, listed ? dlc : dcount, K, G, T,
                                             H, R, P, D, scale, sp, ws, NULL);
                float *got = down(dout, (size_t)G * T * H * (R + 1));
                for (int t = 0; t < T; t++) { /* the CPU op over token t's local rows, gathered */
                    const int n_loc = count[t];
                    for (int i = 0; i < n_loc; i++)
                        memcpy(cache + (size_t)i * LD,
                               dec + lunar_dcp_token(&kv, 0, bt + row_seq[t] * MB, dr + i * D, D) * LD,
                               LD * sizeof(float));
                    for (int g = 0; g < G; g++) {
                        const int32_t *rl = listed ? rows + t * K : NULL, *cn = listed ? lcount + t : count + t;
                        op_mla_attention_partial(o_ref, l_ref, q + ((size_t)g * T + t) * H * LD, cache, rl, cn, K, 1,
                                                 H, R, P, scale);
                        for (int h = 0; h < H; h++) {
                            const float *gr = got + (((size_t)g * T + t) * H + h) * (R + 1);
                            double e = lunar_max_rel_err(gr, o_ref + (size_t)h * R, R);
                            CHECK_MSG(e <= 1e-5, "D %d fp8 %d rank %d listed %d splits %d (g %d, t %d, h %d): olat "
                                      "max rel err %.3g", D, fp8, dr, listed, sp, g, t, h, e);
                            check_lse(gr + R, l_ref + h, 1, 1e-4);
                        }
                    }
                }
                free(got);
            }
        free(cache), free(o_ref);
        lunar_cuda_release(mark);
    }
    free(vals), free(q), free(stored), free(dec);
}

/* The DSA filter on the device == the CPU's (bitwise: kept entries, their order, the counts). */
TEST(cuda_dcp_local_rows) {
    if (!cuda_on()) return;
    enum { T = 37, K = 50 };
    int32_t idx[T * K];
    rng_state = 61;
    for (int i = 0; i < T * K; i++) idx[i] = rng() % 5 == 0 ? -1 : (int32_t)(rng() % 1000);
    for (int i = 0; i < K; i++) idx[3 * K + i] = -1; /* a row with nothing selected */
    for (int D = 1; D <= 8; D *= 2)
        for (int dr = 0; dr < D; dr++) {
            int32_t want[T * K], cnt[T], got_cnt[T], got[T * K];
            memcpy(want, idx, sizeof idx);
            lunar_dcp_local_rows(want, cnt, T, K, D, dr);
            const size_t mark = lunar_cuda_mark();
            int32_t *di = dev_in(idx, sizeof idx), *dout = lunar_cuda_alloc(sizeof idx), *dc = lunar_cuda_alloc(sizeof cnt);
            LUNAR_ASSERT(dout && dc);
            lunar_cuda_fill_u32(dc, 0xffffffffu, T);
            lunar_cuda_dcp_local_rows(dout, dc, di, T, K, D, dr, NULL);
            lunar_cuda_sync();
            lunar_cuda_download(got, dout, sizeof got);
            lunar_cuda_download(got_cnt, dc, sizeof got_cnt);
            for (int t = 0; t < T; t++) {
                CHECK_MSG(got_cnt[t] == cnt[t], "D %d rank %d row %d: count %d, want %d", D, dr, t, got_cnt[t], cnt[t]);
                for (int i = 0; i < cnt[t] && got_cnt[t] == cnt[t]; i++)
                    CHECK_MSG(got[t * K + i] == want[t * K + i], "D %d rank %d row %d [%d]", D, dr, t, i);
            }
            lunar_cuda_release(mark);
        }
}

TEST(cuda_dcp_partial_paged_in_place) {
    if (!cuda_on()) return;
    paged_case(2, 0);
    paged_case(4, 1);
    paged_case(1, 0);
}

/* The DCP query rows: each head's q_lat | q_pe, the padding heads zero (exact copies). */
TEST(cuda_dcp_pack_q) {
    if (!cuda_on()) return;
    enum { T = 3, NH = 5, HM = 8 };
    float *ql = test_rand((long)T * NH * R, 91, -1, 1), *qp = test_rand((long)T * NH * P, 92, -1, 1);
    const size_t mark = lunar_cuda_mark();
    float *d = dev_poisoned((size_t)T * HM * LD);
    lunar_cuda_dcp_pack_q(d, dev_in(ql, (size_t)T * NH * R * 4), dev_in(qp, (size_t)T * NH * P * 4), T, NH, HM, R, P,
                          NULL);
    float *got = down(d, (size_t)T * HM * LD);
    int bad = 0;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < HM; h++)
            for (int i = 0; i < LD; i++) {
                const float want = h >= NH ? 0.0f
                                   : i < R ? ql[((size_t)t * NH + h) * R + i]
                                           : qp[((size_t)t * NH + h) * P + i - R];
                bad += !(got[((size_t)t * HM + h) * LD + i] == want);
            }
    CHECK_MSG(bad == 0, "%d entries differ", bad);
    lunar_cuda_release(mark);
    free(ql), free(qp), free(got);
}

#endif
