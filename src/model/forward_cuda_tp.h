/* Tensor parallelism of the CUDA forward (model/forward_cuda.c): one process per GPU, each holding
 * its rank model (model/shard.h) uploaded to its device, the collectives on device buffers through
 * the rank model's comm (NCCL, parallel/comm.h). The places are forward.c's lunar_tp_* calls:
 * after every row-parallel sub-layer (o_proj, the FFN's down projections), the latent MoE's routed
 * sum before routed_expert_norm, the vocab-parallel embedding (all-reduce) and lm_head
 * (all-gather). A step calls these only when m->tp is set, so world size 1 makes no comm call.
 *
 * The collectives are stream-ordered (parallel/comm.h lunar_comm_nccl_*_on): each runs after the
 * forward's work on the current stream and before what follows, and the host waits for none of
 * them; the embedding looks up this rank's vocabulary rows on the device and the lm_head's slices
 * are gathered and reordered on the device, so a TP step has no host round trip but the final
 * download. A failed enqueue marks m->tp->failed (later collectives are skipped: the ranks are out
 * of step); a failure while running is read once per step, after the step's wait
 * (lunar_cuda_tp_status); the step then returns its message.
 * DCP (--decode-context-parallel-size, docs/parallel.md) runs for any DCP size dividing TP: groups
 * of D consecutive ranks, the exchange of partials over the DCP comm (the TP comm when D = TP, else
 * its split: lunar_dcp_comm), every all-reduce over the TP comm. D = TP was measured against one
 * GPU on two H200s (session 4); D < TP needs 4 GPUs (tests/test_cuda_tp.c) and has not run yet. */
#ifndef LUNAR_MODEL_FORWARD_CUDA_TP_H
#define LUNAR_MODEL_FORWARD_CUDA_TP_H

#include <stddef.h>
#include <stdint.h>

#include "model/forward.h"
#include "model/model.h"

/* A rank process's device: `device` (its GPU on the node) with an arena of `util` of its memory,
 * leaving what NCCL and the driver need outside it (call after the comm's init). */
int lunar_cuda_rank_init(int device, double util, lunar_err *err);
/* The rank model can run on the device (DCP: every rank of its DCP group with MLA heads). */
int lunar_cuda_tp_check(const lunar_model *m, lunar_err *err);
/* x[n] (device) <- sum over the ranks. */
void lunar_cuda_tp_all_reduce(const lunar_model *m, float *x, size_t n);
/* x[T, D] (device) <- the embeddings of ids (device) from this rank's vocabulary rows (embed: bf16
 * [vocab_n, D] on the device), zeros elsewhere, then the all-reduce: exact (one non-zero term). */
void lunar_cuda_tp_embedding(const lunar_model *m, float *x, const uint16_t *embed, const int32_t *ids, int T);
/* The logits [rows, V] (device, from the arena: freed with the caller's mark) <- every rank's
 * lg[rows, vocab_n] (device; lg must have room for rows * vocab_chunk floats): one all-gather of
 * the padded slices, each rank's block copied into its columns on the device. */
float *lunar_cuda_tp_lm_head(const lunar_model *m, float *lg, int rows);
/* Rank r's columns [*v0, *v0 + *vn) of a vocabulary of V split into chunks of C (shard.c's split:
 * equal chunks, the last short, empty past V). */
void lunar_tp_vocab_slice(int64_t V, int64_t C, int r, int64_t *v0, int64_t *vn);
/* dst[n, lat_n] (device) <- columns [lat0, lat0 + lat_n) of y[n, Lat] (device), the input of this
 * rank's column slice of routed_expert_up_proj. */
void lunar_cuda_tp_latent_cols(const lunar_model *m, float *dst, const float *y, int n, int Lat);
/* One MLA layer's inputs under DCP (forward_cuda.c mla_layer): the step's T tokens, each one's
 * sequence and position (device row_seq, pos [T]), the device block tables bt [n_seqs, max_blocks]
 * (128-position blocks), the step's length bound, this layer's latent pages (bf16, or FP8), the new
 * rows kvr [T, R + P] before their norm (kva_norm fp32 [R], eps), q [T, nh, N + P], kv_b_proj bf16,
 * and the DSA top-k idx [T, topk] (global positions; NULL without DSA). */
typedef struct lunar_cuda_dcp_layer {
    int T;
    const int32_t *bt;
    int max_blocks;
    const int32_t *row_seq, *pos;
    int max_len; /* a decode step's bucket: the same for every replay of its graph */
    void *latent;
    int fp8;
    const float *kvr, *kva_norm;
    float eps;
    const float *q;
    const uint16_t *kvb;
    const int32_t *idx;
} lunar_cuda_dcp_layer;
/* shard_dcp.c's lunar_dcp_mla on the device (forward_cuda_dcp.c): stores this rank's latent rows
 * (positions p % D == its DCP rank, at local rows of 128 / D-row blocks inside the plain pages),
 * all-gathers the group's absorbed queries, attends over its rows for every group head, exchanges
 * the (o, lse) partials and merges its own heads: o [T, nh, Vd] before the output gate and o_proj.
 * Collectives on the forward's stream; no host data (CUDA graphs capture it). */
void lunar_cuda_dcp_mla(const lunar_model *m, const lunar_cuda_dcp_layer *a, float *o);
/* An upper bound of lunar_cuda_dcp_mla's device scratch for T tokens (any context: the partial reads
 * the pages in place; part of lunar_cuda_step_bytes). */
size_t lunar_cuda_dcp_step_bytes(const lunar_model *m, size_t T);
/* Its first stage alone: this rank's rows of the step into its pages. */
void lunar_cuda_dcp_store(const lunar_model *m, const lunar_cuda_dcp_layer *a);
/* A fresh prefill under DCP (one sequence from position 0): every rank already holds all the
 * chunk's rows (kvr: kv_a_proj is replicated), and causal attention over the chunk needs no other
 * token, so no exchange is needed. Returns scratch pages of 128-row blocks holding the T rows as
 * one GPU stores them, and *bt their identity block table (device, from the arena: released with
 * the caller's mark); the plain prefill kernel then runs over them with this rank's heads. */
void *lunar_cuda_dcp_fresh_pages(const lunar_cuda_dcp_layer *a, int R, int P, int32_t **bt);

/* The step's verdict: 0, or -1 with the failed collective's message (and the mark cleared). */
int lunar_cuda_tp_status(const lunar_model *m, lunar_err *err);

#endif
