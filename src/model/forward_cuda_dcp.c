/* Decode context parallelism of an MLA layer on the device (forward_cuda_tp.h): shard_dcp.c's
 * lunar_dcp_mla with the device stages of backend/cuda/cuda_mla_partial.cu, the same layout and
 * the same arithmetic, so the CPU rank threads stay the oracle. The exchange of the partials is an
 * all-gather of every rank's whole send buffer (NCCL has no all-to-all; D times the bytes of one,
 * read in place by the merge's part stride). Everything a layer needs is computed on the device
 * from the step's tables (slots and causal counts from positions and block tables; the partial
 * reads the rank's pages in place, every group and token in one launch), so a DCP decode step is
 * captured in a CUDA graph like any other. */
#include "model/forward_cuda_tp.h"

#ifdef LUNAR_HAVE_CUDA

#include <math.h>

#include "backend/cuda/cuda_glue.h"
#include "backend/cuda/cuda_ops.h"
#include "model/shard.h" /* lunar_tp */
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

size_t lunar_cuda_dcp_step_bytes(const lunar_model *m, size_t T) {
    const lunar_config *c = &m->cfg;
    const size_t D = (size_t)m->tp->dcp_size, Hm = (size_t)m->tp->mla_heads_max, nh = c->num_attention_heads;
    const size_t R = c->kv_lora_rank, row = R + c->qk_rope_head_dim, topk = c->index_topk > 0 ? c->index_topk : 0;
    /* lunar_cuda_dcp_mla, as it allocates: slots and counts, the absorbed queries, their padded
     * send and gathered copies, the partials' send buffer and its all-gather (D x D parts), the
     * merged rows, this rank's heads, the local top-k rows, the sliced partial's parts (< 2
     * DCP_PARTIAL_BLOCKS); a fresh prefill's pages, slots and table; 256-byte rounding of each
     * allocation */
    return 4 * (2 * T + T * nh * row + (1 + D) * T * Hm * row + (D + D * D) * T * Hm * (R + 1) + T * Hm * R +
                T * nh * R + T * topk + 2 * DCP_PARTIAL_BLOCKS * (R + 2)) +
           (T + 128) * row * 2 + 4 * (T + T / 128 + 1) + 32 * 256;
}

/* this rank's slots for the step's tokens (-1: another rank's) and the causal counts */
static int32_t *step_rows(const lunar_model *m, const lunar_cuda_dcp_layer *a, int32_t **count) {
    int32_t *slots = dev((size_t)a->T * sizeof *slots);
    *count = dev((size_t)a->T * sizeof **count);
    lunar_cuda_dcp_step_rows(slots, *count, a->row_seq, a->pos, a->bt, a->max_blocks, a->T, m->tp->dcp_size,
                             m->tp->dcp_rank, NULL);
    return slots;
}

void lunar_cuda_dcp_store(const lunar_model *m, const lunar_cuda_dcp_layer *a) {
    const lunar_config *c = &m->cfg;
    const size_t mk = lunar_cuda_mark();
    int32_t *count, *slots = step_rows(m, a, &count);
    lunar_glue_latent_store(a->latent, a->fp8, a->kvr, a->kva_norm, slots, a->T, c->kv_lora_rank,
                            c->qk_rope_head_dim, a->eps, NULL);
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
    const size_t mk = lunar_cuda_mark();
    /* 1. this rank's rows of the step into its pages; the causal counts */
    int32_t *count, *slots = step_rows(m, a, &count);
    lunar_glue_latent_store(a->latent, a->fp8, a->kvr, a->kva_norm, slots, T, R, P, a->eps, NULL);

    /* 2. the absorbed queries [T, Hm, R + P] (padding heads zero), all-gathered: [D][T, Hm, R + P] */
    const size_t qrow = (size_t)Hm * row;
    float *q_lat = dev((size_t)T * nh * R * sizeof(float)), *q_pe = dev((size_t)T * nh * P * sizeof(float));
    lunar_glue_mla_absorb(q_lat, q_pe, a->q, a->kvb, T, nh, N, P, Vd, R, NULL);
    float *qsend = dev((size_t)T * qrow * sizeof(float)), *qall = dev((size_t)D * T * qrow * sizeof(float));
    lunar_cuda_dcp_pack_q(qsend, q_lat, q_pe, T, nh, Hm, R, P, NULL);
    gather_on(tp, qsend, qall, (size_t)T * qrow);

    /* 3. partial attention of every group's queries over this rank's rows, in place in its pages:
     * send [dest g][T, Hm, R + 1] */
    const size_t part_n = (size_t)T * Hm * (R + 1);
    float *send = dev((size_t)D * part_n * sizeof(float)), *all = dev((size_t)D * D * part_n * sizeof(float));
    int32_t *lrows = NULL;
    if (topk > 0) { /* the replicated top-k (global positions) to this rank's local rows */
        lrows = dev((size_t)T * topk * sizeof(int32_t));
        lunar_cuda_dcp_local_rows(lrows, count, a->idx, T, topk, D, dr, NULL);
    }
    /* rows sliced over more blocks while the (group, token, head) triples are few (decode): about
     * DCP_PARTIAL_BLOCKS blocks, slices of at least 64 rows of the longest local list (from the
     * step's length bound, a graph key: the plan does not change between replays) */
    const int lmax = topk > 0 ? topk : (a->max_len + D - 1) / D, pairs = D * T * Hm;
    const int want = (DCP_PARTIAL_BLOCKS + pairs - 1) / pairs, most = (lmax + 63) / 64;
    int splits = want < most ? want : most;
    if (splits > DCP_PARTIAL_SPLITS_MAX) splits = DCP_PARTIAL_SPLITS_MAX;
    if (splits < 1) splits = 1;
    void *pws = splits > 1 ? dev(lunar_cuda_mla_partial_ws(D * T, Hm, R, splits)) : NULL;
    lunar_cuda_mla_cache cd = {a->latent, a->fp8 ? LUNAR_CUDA_KV_FP8 : LUNAR_CUDA_KV_BF16, 1.0f, a->bt, a->max_blocks};
    lunar_cuda_dcp_partial_paged(send, qall, &cd, a->row_seq, lrows, count, topk, D, T, Hm, R, P, D, scale, splits,
                                 pws, NULL);

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
    lunar_cuda_release(mk);
}

#endif
