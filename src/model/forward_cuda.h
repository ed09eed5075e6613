/* The Kimi-family forward on the CUDA backend: the same steps, in the same order, as the CPU
 * reference of model/forward.c, over device-side paged caches (BF16 latent, FP8 index keys) and a
 * device KDA state pool (fp32). Weights are uploaded once (BF16 matrices for the GEMMs, MXFP4
 * experts widened to BF16 on the generic expert path, fp32 vectors where the kernels take fp32).
 * Activations are fp32 between ops and rounded to bf16 as GEMM operands. Device memory comes from
 * the CUDA arena (stack discipline: free in the reverse order of creation). Only with
 * LUNAR_HAVE_CUDA; the functions fail cleanly without a device.
 *
 * STATUS (H200, tests/test_cuda_forward.c): decode matches the goldens within the bf16 tolerance,
 * multi-token prefill does not yet (max rel err up to 4.6e-1 on tiny-a/b, k3-a/b, k31-b; a few
 * rows per prompt go wrong), so backend/backend.c keeps the CUDA forward unselectable. */
#ifndef LUNAR_MODEL_FORWARD_CUDA_H
#define LUNAR_MODEL_FORWARD_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "model/forward.h"

typedef struct lunar_cuda_model lunar_cuda_model;

/* Initialises device 0 when needed and uploads m's weights. m must outlive the result. */
int lunar_cuda_model_upload(lunar_cuda_model **out, const lunar_model *m, lunar_err *err);
void lunar_cuda_model_free(lunar_cuda_model *g);

/* Device caches: the paged MLA latent (bf16) + DSA index keys, and n_slots KDA state slots. */
typedef struct lunar_cuda_caches {
    int n_blocks, n_slots, n_mla, n_kda, row, idx_dim;
    uint16_t *latent;   /* [n_mla][n_blocks][128][row] bf16 */
    uint8_t *idx_codes; /* [n_mla][n_blocks][128][idx_dim] */
    float *idx_scales;  /* [n_mla][n_blocks][128] */
    size_t conv_len, state_len;
    float *conv;  /* [n_slots][n_kda][conv_len] */
    float *state; /* [n_slots][n_kda][state_len] fp32 */
    size_t mark;  /* arena mark before the caches */
} lunar_cuda_caches;

int lunar_cuda_caches_init(lunar_cuda_caches *c, const lunar_model *m, int n_blocks, int n_slots,
                           lunar_err *err);
void lunar_cuda_caches_free(lunar_cuda_caches *c);
void lunar_cuda_state_clear(lunar_cuda_caches *c, int slot);

/* lunar_forward_batch on the device; logits is host memory ([rows, V] as the CPU one). */
int lunar_forward_batch_cuda(const lunar_cuda_model *g, lunar_cuda_caches *c,
                             const lunar_batch_seq *seqs, int n_seqs, float *logits, lunar_err *err);

/* One sequence with device caches of its own (CLI, tests). */
typedef struct lunar_cuda_seq {
    int pos, max_tokens;
    lunar_cuda_caches c;
    int32_t *blocks; /* host identity block table */
} lunar_cuda_seq;

int lunar_cuda_seq_init(lunar_cuda_seq *s, const lunar_model *m, int max_tokens, lunar_err *err);
void lunar_cuda_seq_reset(lunar_cuda_seq *s);
void lunar_cuda_seq_free(lunar_cuda_seq *s);
int lunar_forward_cuda(const lunar_cuda_model *g, lunar_cuda_seq *s, const int32_t *ids, int n,
                       float *logits, int all_logits, lunar_err *err);

#endif
