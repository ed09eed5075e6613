/* Tensor parallelism and decode context parallelism of the Kimi family on the CPU reference (and
 * the layout the GPU ranks use): one lunar_model per rank whose tensors are that rank's shards,
 * made from the fully loaded model at start-up. The layout of every tensor per rank, the places of
 * the all-reduces and the DCP merge are in docs/parallel.md.
 *
 * Splits are contiguous and may be uneven (rank r of n gets units [floor(r*u/n), floor((r+1)*u/n))
 * of u units: heads, intermediate channels, vocabulary rows), so any head count works with any
 * TP size; a rank may hold zero heads of a layer. MXFP4 expert channels split in groups of 32.
 * A rank model's config carries its local head counts (kda_num_heads, num_attention_heads), so
 * the forward and the per-rank caches (KDA state per rank) size themselves from it. */
#ifndef LUNAR_MODEL_SHARD_H
#define LUNAR_MODEL_SHARD_H

#include <stdint.h>

#include "model/forward.h"
#include "model/model.h"
#include "parallel/comm.h"

typedef struct lunar_tp_opts {
    int tp;  /* tensor-parallel size = the number of ranks */
    int dcp; /* decode-context-parallel size: divides tp; ranks r and r' share a DCP group when
              * r / dcp == r' / dcp; 1 = off */
    int ep;  /* routed experts whole per rank (expert e on rank e % tp) instead of TP-split */
} lunar_tp_opts;

typedef struct lunar_tp {
    int rank, size;
    lunar_comm *comm;           /* the TP group (all ranks) */
    int dcp_rank, dcp_size;     /* position in the DCP group and its size */
    lunar_comm *dcp;            /* the DCP group; NULL when dcp_size == 1 */
    int ep;
    int64_t vocab0, vocab_n;    /* this rank's rows of embed_tokens and lm_head */
    int64_t vocab_chunk;        /* ceil(V / size): the padded width of an all-gather of logits */
    int lat0, lat_n;            /* latent MoE: this rank's input columns of routed_expert_up_proj */
    int mla_heads_max;          /* max MLA heads of a rank in the DCP group (exchange padding) */
    int *dcp_heads;             /* [dcp_size] MLA heads of each rank of the DCP group */
    int failed;                 /* a collective failed during the step */
    lunar_err err;
    /* storage of the copied shards (column splits); row splits are views of the checkpoint */
    void **owned;
    int n_owned, cap_owned;
    lunar_tensor **tensors;
    int n_tensors, cap_tensors;
} lunar_tp;

/* [*off, *off + *len): part `part` of `parts` of n units (n/gran groups of gran). */
void lunar_split(int64_t n, int parts, int part, int64_t gran, int64_t *off, int64_t *len);

/* Checks the options against the config (dcp divides tp, MXFP4 groups). */
int lunar_tp_check(const lunar_config *c, const lunar_tp_opts *o, lunar_err *err);

/* Rank `rank`'s model: shards of `full` (which must outlive it), driven through comm (the TP
 * group, size o->tp) and dcp (its DCP group, size o->dcp; NULL when o->dcp == 1). */
int lunar_shard_model(lunar_model **out, const lunar_model *full, const lunar_tp_opts *o, int rank,
                      lunar_comm *comm, lunar_comm *dcp, lunar_err *err);
/* Frees a rank model (lunar_model_free calls it for models made here). */
void lunar_shard_free(lunar_model *m);

/* ---------------------------------------------------------------- forward hooks (forward.c)
 * All are collective over the model's TP (or DCP) group. A failed collective marks tp->failed;
 * the step then returns its message. */
void lunar_tp_all_reduce(const lunar_model *m, float *x, size_t n);
/* y[n, D]: vocab-parallel lookup (rows outside this rank's range are zero); the caller all-reduces
 * the whole step's rows at once. */
void lunar_tp_embedding(const lunar_model *m, float *y, const int32_t *ids, int n);
/* logits[rows, V] = lm_head h: this rank's vocabulary slice, then an all-gather. */
void lunar_tp_lm_head(const lunar_model *m, float *logits, const float *h, int rows);
/* Latent MoE after the routed sum: y_lat[n, Lat] is complete on every rank (all-reduced and
 * normalised); out[n, D] = routed_expert_up_proj's partial product over this rank's columns. */
void lunar_tp_latent_up(const lunar_model *m, const lunar_tensor *up, float *out, const float *y_lat,
                        int n, int Lat);

/* Under DCP of size D: the token index (layer, block, local row) in the rank's pool at which
 * position p of a sequence with block table `blocks` is stored, p % D being the rank (block
 * blocks[p / 128], local row (p % 128) / D of kv->block_size = 128 / D). The CUDA DCP partial
 * (lunar_cuda_dcp_partial_paged) reads the same places. */
size_t lunar_dcp_token(const lunar_kv_pool *kv, int layer, const int32_t *blocks, int p, int D);

/* DSA under DCP: rows[T, topk] (global positions, -1 = none) <- in place, per row, the positions
 * p with p % D == dr in their order, as local rows p / D, first; count[t] = how many (the entries
 * past it are left as they are). The CUDA twin: lunar_cuda_dcp_local_rows. */
void lunar_dcp_local_rows(int32_t *rows, int32_t *count, int T, int topk, int D, int dr);

/* One MLA layer's attention under DCP for a step: writes this rank's latent rows and all index
 * keys of the new tokens, attends over this rank's tokens for every head of the DCP group, and
 * merges the partials of its own heads. q: [T, nh, N+P] (local heads), kvr: [T, R+P] new latent
 * rows, ik/iq/wt: indexer (NULL without), o: [T, nh, Vd]. */
void lunar_dcp_mla(const lunar_model *m, const lunar_mla_weights *w, int layer,
                   const lunar_batch_seq *seqs, int n_seqs, const int *off, int T,
                   lunar_kv_pool *kv, const float *q, const float *kvr, const float *iq,
                   const float *ik, const float *wt, float *o);

#endif
