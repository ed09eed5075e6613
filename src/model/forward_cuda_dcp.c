/* Decode context parallelism of an MLA layer on the device (forward_cuda_tp.h): shard_dcp.c's
 * lunar_dcp_mla with the device stages of backend/cuda/cuda_mla_partial.cu, the same layout and
 * the same arithmetic, so the CPU rank threads stay the oracle. The exchange of the partials is an
 * all-gather of every rank's whole send buffer (NCCL has no all-to-all; D times the bytes of one,
 * read in place by the merge's part stride). Host work per layer: the owned tokens' local slots and
 * the causal counts (from the host block tables), uploaded synchronously: no CUDA graph under DCP. */
#include "model/forward_cuda_tp.h"

#ifdef LUNAR_HAVE_CUDA

#include <math.h>
#include <string.h>

#include "backend/cuda/cuda_glue.h"
#include "backend/cuda/cuda_ops.h"
#include "model/shard.h"
#include "parallel/comm.h"

/* the partial kernel's launch aims at this many blocks (4 per SM of an H200) by slicing the rows;
 * the bound on the slices keeps the scratch below DCP_PARTIAL_BLOCKS x 2 parts (forward_cuda.c's
 * step reserve counts it) */
#define DCP_PARTIAL_BLOCKS 528
#define DCP_PARTIAL_SPLITS_MAX 64

static void *dev(size_t bytes) {
    void *p = lunar_cuda_alloc(bytes ? bytes : 4);
    LUNAR_ASSERT(p); /* the arena is sized for the step's scratch (as forward_cuda.c's dalloc) */
    return p;
}

static void gather_on(lunar_tp *tp, const float *send, float *recv, size_t n) {
    lunar_err e;
    if (tp->failed) return; /* the ranks are out of step: stop talking */
    if (lunar_comm_nccl_all_gather_on(tp->dcp, send, recv, n, lunar_cuda_current_stream(), &e)) {
        tp->failed = 1;
        tp->err = e;
    }
}

size_t lunar_cuda_dcp_step_bytes(const lunar_model *m, size_t T, size_t max_len) {
    const lunar_config *c = &m->cfg;
    const size_t D = (size_t)m->tp->dcp_size, Hm = (size_t)m->tp->mla_heads_max, nh = c->num_attention_heads;
    const size_t R = c->kv_lora_rank, row = R + c->qk_rope_head_dim, topk = c->index_topk > 0 ? c->index_topk : 0;
    /* lunar_cuda_dcp_mla, as it allocates: slots and counts, the absorbed queries, their padded
     * send and gathered copies, the partials' send buffer and its all-gather (D x D parts), olat +
     * lse, the merged rows, this rank's heads, the local top-k rows, one sequence's gathered local
     * cache, the sliced partial's parts (< 2 DCP_PARTIAL_BLOCKS); a fresh prefill's pages, slots
     * and table; 256-byte rounding of each allocation */
    return 4 * (2 * T + T * nh * row + (1 + D) * T * Hm * row + (D + D * D) * T * Hm * (R + 1) + 2 * T * Hm * R +
                T * Hm + T * nh * R + T * topk + (max_len / D + 1) * row + 2 * DCP_PARTIAL_BLOCKS * (R + 2)) +
           (T + 128) * row * 2 + 4 * (T + T / 128 + 1) + 32 * 256;
}

void lunar_cuda_dcp_store(const lunar_model *m, const lunar_cuda_dcp_layer *a) {
    const lunar_tp *tp = m->tp;
    const lunar_config *c = &m->cfg;
    const int D = tp->dcp_size, dr = tp->dcp_rank, R = c->kv_lora_rank, P = c->qk_rope_head_dim, T = a->T;
    const size_t mk = lunar_cuda_mark();
    /* the owned tokens' latent rows at their local slots (-1: another rank's token), placed by the
     * CPU layout's own function over one layer of blocks of 128 / D rows */
    const lunar_kv_pool lay = {.block_size = 128 / D, .n_blocks = a->n_blocks, .n_mla = 1, .row = R + P};
    int32_t *slots = lunar_xmalloc((size_t)T * sizeof *slots);
    for (int j = 0; j < a->n_seqs; j++) {
        const lunar_batch_seq *sq = &a->seqs[j];
        for (int t = 0; t < sq->n; t++) {
            const int p = sq->pos0 + t;
            slots[a->off[j] + t] = p % D == dr ? (int32_t)lunar_dcp_token(&lay, 0, sq->blocks, p, D) : -1;
        }
    }
    int32_t *dslots = dev((size_t)T * sizeof *dslots);
    lunar_cuda_upload(dslots, slots, (size_t)T * sizeof *slots);
    lunar_glue_latent_store(a->latent, a->fp8, a->kvr, a->kva_norm, dslots, T, R, P, a->eps, NULL);
    free(slots);
    lunar_cuda_release(mk); /* the store is ordered before any later use of the space */
}

void *lunar_cuda_dcp_fresh_pages(const lunar_cuda_dcp_layer *a, int R, int P, int32_t **bt) {
    const int T = a->T, nb = (T + 127) / 128;
    int32_t *h = lunar_xmalloc((size_t)(T > nb ? T : nb) * sizeof *h);
    for (int i = 0; i < (T > nb ? T : nb); i++) h[i] = i; /* identity: slot i = position i, block i */
    int32_t *slots = dev((size_t)T * sizeof *slots);
    *bt = dev((size_t)nb * sizeof **bt);
    lunar_cuda_upload(slots, h, (size_t)T * sizeof *h);
    lunar_cuda_upload(*bt, h, (size_t)nb * sizeof *h);
    free(h);
    void *pages = dev((size_t)nb * 128 * (R + P) * (a->fp8 ? 1 : 2));
    lunar_glue_latent_store(pages, a->fp8, a->kvr, a->kva_norm, slots, T, R, P, a->eps, NULL);
    return pages;
}

void lunar_cuda_dcp_mla(const lunar_model *m, const lunar_cuda_dcp_layer *a, float *o) {
    lunar_tp *tp = m->tp;
    const lunar_config *c = &m->cfg;
    const int D = tp->dcp_size, dr = tp->dcp_rank, nh = c->num_attention_heads, Hm = tp->mla_heads_max;
    const int N = c->qk_nope_head_dim, P = c->qk_rope_head_dim, Vd = c->v_head_dim, R = c->kv_lora_rank;
    const int row = R + P, T = a->T, topk = c->index_topk;
    const float scale = 1.0f / sqrtf((float)(N + P));
    lunar_cuda_dcp_store(m, a); /* 1. this rank's rows */
    const size_t mk = lunar_cuda_mark();

    /* 2. the absorbed queries [T, Hm, R + P] (padding heads zero), all-gathered: [D][T, Hm, R + P] */
    const size_t qrow = (size_t)Hm * row;
    float *q_lat = dev((size_t)T * nh * R * sizeof(float)), *q_pe = dev((size_t)T * nh * P * sizeof(float));
    lunar_glue_mla_absorb(q_lat, q_pe, a->q, a->kvb, T, nh, N, P, Vd, R, NULL);
    float *qsend = dev((size_t)T * qrow * sizeof(float)), *qall = dev((size_t)D * T * qrow * sizeof(float));
    lunar_cuda_fill_u32(qsend, 0, (size_t)T * qrow);
    for (int t = 0; t < T; t++) { /* token t's nh heads: [R] and [P] into rows of R + P */
        float *dst = qsend + (size_t)t * qrow;
        lunar_cuda_copy_2d(dst, (size_t)row * sizeof(float), q_lat + (size_t)t * nh * R, (size_t)R * sizeof(float),
                           (size_t)R * sizeof(float), (size_t)nh);
        lunar_cuda_copy_2d(dst + R, (size_t)row * sizeof(float), q_pe + (size_t)t * nh * P, (size_t)P * sizeof(float),
                           (size_t)P * sizeof(float), (size_t)nh);
    }
    gather_on(tp, qsend, qall, (size_t)T * qrow);

    /* 3. partial attention over the local tokens for every group head: send [dest g][T, Hm, R + 1] */
    const size_t prow = (size_t)R + 1, part_n = (size_t)T * Hm * prow;
    float *send = dev((size_t)D * part_n * sizeof(float)), *all = dev((size_t)D * D * part_n * sizeof(float));
    float *olat = dev((size_t)T * Hm * R * sizeof(float)), *lse = dev((size_t)T * Hm * sizeof(float));
    int32_t *count = dev((size_t)T * sizeof(int32_t)), *lrows = topk > 0 ? dev((size_t)T * topk * sizeof(int32_t)) : NULL;
    int32_t *hcount = lunar_xmalloc((size_t)T * sizeof *hcount);
    lunar_cuda_mla_cache cd = {a->latent, a->fp8 ? LUNAR_CUDA_KV_FP8 : LUNAR_CUDA_KV_BF16, 1.0f, a->bt, a->max_blocks};
    for (int j = 0; j < a->n_seqs; j++) {
        const lunar_batch_seq *sq = &a->seqs[j];
        const int nj = sq->n, L = sq->pos0 + nj, r0 = a->off[j];
        const int Lloc = L > dr ? (L - dr + D - 1) / D : 0;
        const size_t smk = lunar_cuda_mark();
        float *cache = dev((size_t)(Lloc ? Lloc : 1) * row * sizeof(float));
        lunar_cuda_dcp_gather(cache, &cd, j, D, dr, Lloc, row, NULL);
        int32_t *cnt = count + r0, *rows = NULL;
        if (topk > 0) { /* the replicated top-k (global positions) to this rank's local rows */
            rows = lrows + (size_t)r0 * topk;
            lunar_cuda_dcp_local_rows(rows, cnt, a->idx + (size_t)r0 * topk, nj, topk, D, dr, NULL);
        } else { /* causal: local positions dr, dr + D, .. <= pos0 + t */
            for (int t = 0; t < nj; t++) {
                const int pt = sq->pos0 + t;
                hcount[t] = pt >= dr ? (pt - dr) / D + 1 : 0;
            }
            lunar_cuda_upload(cnt, hcount, (size_t)nj * sizeof *hcount);
        }
        /* rows sliced over more blocks while the (token, head) pairs are few (decode): about
         * DCP_PARTIAL_BLOCKS blocks a launch, slices of at least 64 rows */
        const int want = (DCP_PARTIAL_BLOCKS + nj * Hm - 1) / (nj * Hm), most = (Lloc + 63) / 64;
        int splits = want < most ? want : most;
        if (splits > DCP_PARTIAL_SPLITS_MAX) splits = DCP_PARTIAL_SPLITS_MAX;
        if (splits < 1) splits = 1;
        void *pws = splits > 1 ? dev(lunar_cuda_mla_partial_ws(nj, Hm, R, splits)) : NULL;
        for (int g = 0; g < D; g++) {
            lunar_cuda_mla_partial_split(olat, lse, qall + ((size_t)g * T + r0) * qrow, cache, rows, cnt, topk, nj, Hm,
                                         R, P, scale, splits, pws, NULL);
            float *dst = send + g * part_n + (size_t)r0 * Hm * prow;
            lunar_cuda_copy_2d(dst, prow * sizeof(float), olat, (size_t)R * sizeof(float), (size_t)R * sizeof(float),
                               (size_t)nj * Hm);
            lunar_cuda_copy_2d(dst + R, prow * sizeof(float), lse, sizeof(float), sizeof(float), (size_t)nj * Hm);
        }
        lunar_cuda_release(smk); /* the copies above are ordered before any later use of the space */
    }

    /* 4. every rank's send buffer to every rank; source g's part for this rank at (g D + dr) part_n */
    gather_on(tp, send, all, (size_t)D * part_n);
    float *merged = dev((size_t)T * Hm * R * sizeof(float));
    lunar_cuda_mla_merge_partials(merged, all + (size_t)dr * part_n, D, (size_t)D * part_n, T * Hm, R, NULL);

    /* 5. this rank's nh heads of the Hm, then the value projection */
    float *mine = merged;
    if (nh != Hm) {
        mine = dev((size_t)T * nh * R * sizeof(float));
        lunar_cuda_copy_2d(mine, (size_t)nh * R * sizeof(float), merged, (size_t)Hm * R * sizeof(float),
                           (size_t)nh * R * sizeof(float), (size_t)T);
    }
    lunar_glue_mla_unabsorb(o, mine, a->kvb, T, nh, N, Vd, R, NULL);
    free(hcount);
    lunar_cuda_release(mk);
}

#endif
