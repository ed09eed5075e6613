/* Tensor parallelism of the CUDA forward (model/forward_cuda.c): one process per GPU, each holding
 * its rank model (model/shard.h) uploaded to its device, the collectives on device buffers through
 * the rank model's comm (NCCL, parallel/comm.h). The places are forward.c's lunar_tp_* calls:
 * after every row-parallel sub-layer (o_proj, the FFN's down projections), the latent MoE's routed
 * sum before routed_expert_norm, the vocab-parallel embedding (all-reduce) and lm_head
 * (all-gather). A step calls these only when m->tp is set, so world size 1 makes no comm call.
 *
 * The comm's collectives run on its own stream and wait for it; the forward's work is on the
 * runtime's stream, so each collective first waits for the device (lunar_cuda_sync): simple and
 * ordered, at the price of the overlap (a later step may hand the comm the forward's stream).
 * A failed collective marks m->tp->failed; the step then returns its message.
 * DCP is not supported on the device (lunar_cuda_tp_check says so). */
#ifndef LUNAR_MODEL_FORWARD_CUDA_TP_H
#define LUNAR_MODEL_FORWARD_CUDA_TP_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

/* A rank process's device: `device` (its GPU on the node) with an arena of `util` of its memory,
 * leaving what NCCL and the driver need outside it (call after the comm's init). */
int lunar_cuda_rank_init(int device, double util, lunar_err *err);
/* The rank model can run on the device (no DCP). */
int lunar_cuda_tp_check(const lunar_model *m, lunar_err *err);
/* x[n] (device) <- sum over the ranks. */
void lunar_cuda_tp_all_reduce(const lunar_model *m, float *x, size_t n);
/* x[T, D] (device) <- the embeddings of ids (host) from this rank's vocabulary rows (embed: bf16
 * [vocab_n, D] on the device), zeros elsewhere, then the all-reduce: exact (one non-zero term). */
void lunar_cuda_tp_embedding(const lunar_model *m, float *x, const uint16_t *embed, const int32_t *ids, int T);
/* logits[rows, V] (host) <- every rank's lg[rows, vocab_n] (device; lg must have room for
 * rows * vocab_chunk floats): one all-gather of the padded slices, reordered on the host. */
void lunar_cuda_tp_lm_head(const lunar_model *m, float *logits, float *lg, int rows);
/* dst[n, lat_n] (device) <- columns [lat0, lat0 + lat_n) of y[n, Lat] (device), the input of this
 * rank's column slice of routed_expert_up_proj. */
void lunar_cuda_tp_latent_cols(const lunar_model *m, float *dst, const float *y, int n, int Lat);
/* The step's verdict: 0, or -1 with the failed collective's message (and the mark cleared). */
int lunar_cuda_tp_status(const lunar_model *m, lunar_err *err);

#endif
