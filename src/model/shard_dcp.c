/* Decode context parallelism for MLA (docs/parallel.md): the latent cache of a sequence is sharded
 * round-robin over the D ranks of a DCP group (position p lives on rank p % D, in its local slot
 * p / D); the FP8 index keys stay replicated (D per slot) so every rank selects the same global
 * top-k. Per layer and step:
 *   1. each rank absorbs its own heads' queries into the latent space (q_lat = [W_k^T q_nope | q_pe])
 *      and all-gathers them over the group: every rank now has the queries of all group heads;
 *   2. each rank attends with all group heads over the tokens it holds, producing per (query, head)
 *      the locally normalised latent context and its log-sum-exp;
 *   3. an all-to-all sends each head's partials to the rank owning the head, which merges them
 *      (max-subtracted exp weights of the lse) and applies W_v.
 * Merging is exact: softmax over the union of disjoint sets = lse-weighted mix of the per-set
 * softmaxes. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/forward.h"
#include "model/shard.h"
#include "ops.h"

/* A block keeps its meaning of 128 global positions, so block tables and the prefix cache work as
 * without DCP; each rank stores the block's 128 / D positions p with p % D == its rank, in local
 * rows (p % 128) / D of a block of kv->block_size = 128 / D rows. */
size_t lunar_dcp_token(const lunar_kv_pool *kv, int layer, const int32_t *blocks, int p, int D) {
    int32_t b = blocks[p / LUNAR_BLOCK_SIZE];
    LUNAR_ASSERT(b >= 0 && b < kv->n_blocks && kv->block_size * D == LUNAR_BLOCK_SIZE);
    return ((size_t)layer * kv->n_blocks + (size_t)b) * kv->block_size + (size_t)(p % LUNAR_BLOCK_SIZE / D);
}

static float *dcp_row(const lunar_kv_pool *kv, int layer, const int32_t *blocks, int p, int D) {
    return kv->latent + lunar_dcp_token(kv, layer, blocks, p, D) * kv->row;
}

/* the index keys of all D positions of a local row sit next to each other */
static size_t idx_slot(const lunar_kv_pool *kv, int layer, const int32_t *blocks, int p, int D) {
    return lunar_dcp_token(kv, layer, blocks, p, D) * (size_t)D + (size_t)(p % D);
}

void lunar_dcp_local_rows(int32_t *rows, int32_t *count, int T, int topk, int D, int dr) {
    for (int t = 0; t < T; t++) { /* keep the selected positions this rank holds, as local slots */
        int32_t *rt = rows + (size_t)t * topk;
        int k = 0;
        for (int i = 0; i < topk; i++)
            if (rt[i] >= 0 && rt[i] % D == dr) rt[k++] = rt[i] / D;
        count[t] = k;
    }
}

void lunar_dcp_mla(const lunar_model *m, const lunar_mla_weights *w, int layer,
                   const lunar_batch_seq *seqs, int n_seqs, const int *off, int T, lunar_kv_pool *kv,
                   const float *q, const float *kvr, const float *iq, const float *ik, const float *wt,
                   float *o) {
    lunar_tp *tp = m->tp;
    const lunar_config *c = &m->cfg;
    const int D = tp->dcp_size, dr = tp->dcp_rank, nh = c->num_attention_heads, Hm = tp->mla_heads_max;
    const int N = c->qk_nope_head_dim, P = c->qk_rope_head_dim, Vd = c->v_head_dim, R = c->kv_lora_rank;
    const int row = R + P, qk = N + P, topk = c->index_topk, ni = c->index_n_heads, di = c->index_head_dim;
    const float scale = 1.0f / sqrtf((float)qk);
    lunar_err e;

    /* 1. cache writes: own latent rows, every index key */
    for (int j = 0; j < n_seqs; j++) {
        const lunar_batch_seq *sq = &seqs[j];
        for (int t = 0; t < sq->n; t++) {
            const int p = sq->pos0 + t;
            const size_t r = (size_t)(off[j] + t);
            if (p % D == dr)
                memcpy(dcp_row(kv, layer, sq->blocks, p, D), kvr + r * row, (size_t)row * sizeof(float));
            if (topk > 0) {
                size_t s = idx_slot(kv, layer, sq->blocks, p, D);
                kv->idx_scales[s] = lunar_fp8_quantize_pow2(kv->idx_codes + s * di, ik + r * di, di);
            }
        }
    }

    /* 2. absorbed queries of the whole group */
    const size_t qrow = (size_t)Hm * row;
    float *qloc = lunar_xmalloc((size_t)T * (nh ? nh : 1) * row * sizeof(float));
    float *qsend = lunar_xcalloc((size_t)T * qrow, sizeof(float));
    float *qall = lunar_xmalloc((size_t)D * T * qrow * sizeof(float));
    op_mla_absorb_q(qloc, q, w->kv_b_proj, T, nh, N, P, Vd, R);
    for (int t = 0; t < T; t++) memcpy(qsend + t * qrow, qloc + (size_t)t * nh * row, (size_t)nh * row * sizeof(float));
    if (lunar_all_gather(tp->dcp, qsend, qall, (size_t)T * qrow, &e)) {
        if (!tp->failed) tp->err = e;
        tp->failed = 1;
    }

    /* 3. partial attention over the local tokens for every group head: [dest][T][Hm][R + 1] */
    const size_t prow = (size_t)R + 1, part_n = (size_t)T * Hm * prow;
    float *send = lunar_xmalloc((size_t)D * part_n * sizeof(float));
    float *recv = lunar_xmalloc((size_t)D * part_n * sizeof(float));
    float *olat = lunar_xmalloc((size_t)T * Hm * R * sizeof(float)), *lse = lunar_xmalloc((size_t)T * Hm * sizeof(float));
    for (int j = 0; j < n_seqs; j++) {
        const lunar_batch_seq *sq = &seqs[j];
        const int nj = sq->n, L = sq->pos0 + nj, r0 = off[j];
        const int Lloc = L > dr ? (L - dr + D - 1) / D : 0;
        float *cache = lunar_xmalloc((size_t)(Lloc ? Lloc : 1) * row * sizeof(float));
        for (int i = 0; i < Lloc; i++)
            memcpy(cache + (size_t)i * row, dcp_row(kv, layer, sq->blocks, dr + i * D, D), (size_t)row * sizeof(float));
        int32_t *count = lunar_xmalloc((size_t)nj * sizeof *count), *rows = NULL;
        if (topk > 0) {
            /* the replicated indexer over all L index keys: the same selection on every rank */
            uint8_t *codes = lunar_xmalloc((size_t)L * di);
            float *scales = lunar_xmalloc((size_t)L * sizeof(float));
            for (int p = 0; p < L; p++) {
                size_t s = idx_slot(kv, layer, sq->blocks, p, D);
                memcpy(codes + (size_t)p * di, kv->idx_codes + s * di, (size_t)di);
                scales[p] = kv->idx_scales[s];
            }
            lunar_index_cache ic = {.codes = codes, .scales = scales};
            rows = lunar_xmalloc((size_t)nj * topk * sizeof *rows);
            op_dsa_indexer(rows, NULL, iq + (size_t)r0 * ni * di, wt + (size_t)r0 * ni, &ic, nj, sq->pos0, ni, di, topk);
            lunar_dcp_local_rows(rows, count, nj, topk, D, dr);
            free(codes), free(scales);
        } else {
            for (int t = 0; t < nj; t++) { /* causal: local positions dr, dr + D, .. <= pos0 + t */
                const int pt = sq->pos0 + t;
                count[t] = pt >= dr ? (pt - dr) / D + 1 : 0;
            }
        }
        for (int g = 0; g < D; g++) {
            op_mla_attention_partial(olat, lse, qall + ((size_t)g * T + r0) * qrow, cache, rows, count, topk,
                                     nj, Hm, R, P, scale);
            float *dst = send + g * part_n + (size_t)r0 * Hm * prow;
            for (int i = 0; i < nj * Hm; i++) {
                memcpy(dst + i * prow, olat + (size_t)i * R, (size_t)R * sizeof(float));
                dst[i * prow + R] = lse[i];
            }
        }
        free(cache), free(count), free(rows);
    }
    if (lunar_all_to_all(tp->dcp, send, recv, part_n, &e)) {
        if (!tp->failed) tp->err = e;
        tp->failed = 1;
    }

    /* 4. merge this rank's heads (sources in rank order), then the value projection */
    float *merged = lunar_xmalloc((size_t)T * Hm * R * sizeof(float));
    op_mla_merge_partials(merged, recv, D, part_n, T * Hm, R);
    float *mine = lunar_xmalloc((size_t)T * (nh ? nh : 1) * R * sizeof(float));
    for (int t = 0; t < T; t++)
        memcpy(mine + (size_t)t * nh * R, merged + (size_t)t * Hm * R, (size_t)nh * R * sizeof(float));
    op_mla_output_v(o, mine, w->kv_b_proj, T, nh, N, Vd, R);
    free(qloc), free(qsend), free(qall), free(send), free(recv), free(olat), free(lse), free(merged), free(mine);
}
