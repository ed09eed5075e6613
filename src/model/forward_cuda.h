/* The Kimi-family forward on the CUDA backend: the same steps, in the same order, as the CPU
 * reference of model/forward.c, over device-side paged caches (BF16 latent, FP8 index keys) and a
 * device KDA state pool (fp32). Weights are uploaded once (BF16 matrices for the GEMMs, MXFP4
 * experts widened to BF16 on the generic expert path, fp32 vectors where the kernels take fp32).
 * Activations are fp32 between ops and rounded to bf16 as GEMM operands. Device memory comes from
 * the CUDA arena, one allocation of --gpu-memory-utilization x the device's memory (stack
 * discipline: free in the reverse order of creation): the weights, then the caches sized from what
 * is left (lunar_cuda_*_bytes), then each step's temporaries. Only with LUNAR_HAVE_CUDA; the
 * functions fail cleanly without a device.
 *
 * Precision (tests/test_cuda_forward.c): against the CPU forward with the same roundings modelled
 * (op_set_bf16_operands + a bf16 latent cache). Against the fp32 goldens the bf16 operands move
 * some routing / DSA top-k decisions on the random tiny models, so whole rows differ there; that
 * is the precision of bf16 GEMMs, not an error of an op. */
#ifndef LUNAR_MODEL_FORWARD_CUDA_H
#define LUNAR_MODEL_FORWARD_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "model/forward.h"

typedef struct lunar_cuda_model lunar_cuda_model;

/* Device 0 with an arena of gpu_memory_utilization (0, 1] of its memory (capped to what is free);
 * a no-op when the device is already initialised. */
int lunar_cuda_backend_init(double gpu_memory_utilization, lunar_err *err);

/* Uploads m's weights (initialising device 0 at 0.9 utilisation when nothing did); fails with the
 * sizes when they do not fit in the arena. m must outlive the result. */
int lunar_cuda_model_upload(lunar_cuda_model **out, const lunar_model *m, lunar_err *err);
void lunar_cuda_model_free(lunar_cuda_model *g);

/* Routed experts through the fused path of cuda_moe.cu (router top-k, permutation, decode kernel
 * or grouped GEMM, combine; shared experts on a second stream) where a layer's widths allow it
 * (expert input and intermediate multiples of 128), else the generic per-expert GEMMs. Off by
 * default until tests/test_cuda_forward.c has passed with it on the device (it runs the
 * kernel-shaped model both ways). Returns whether the path asked for exists: on, whether any layer can
 * take the fused path; off, whether every MoE layer holds its per-expert weights (MXFP4 experts keep
 * their widened copies only when LUNAR_CUDA_MOE=generic was set at upload; if not, nothing changes). */
int lunar_cuda_model_fused_moe(lunar_cuda_model *g, int on);
/* A MoE layer's combine folded into the residual add + RMSNorm after it (run_residual: no latent,
 * shared experts joined in the combine, no TP; bit-equal to the unfolded step). Off by default
 * until measured; LUNAR_COMBINE_NORM=1 at upload turns it on. Set it before the first step: decode
 * graphs captured before keep the path they were captured with. Returns the previous setting. */
int lunar_cuda_model_combine_norm(lunar_cuda_model *g, int on);
/* KDA decode of 3-16 rows through the fused input projection (the batch-1 path: projection, one conv /
 * norm / beta launch, the gate projections of all rows in one launch) where the layer's shapes allow;
 * on = 1 / 0, -1 LUNAR_KDA_DECODE_ROWS's choice (unset: on); returns the previous setting. _runs: the
 * KDA layers run that way so far (all models) */
int lunar_cuda_kda_decode_rows(int on);
long lunar_cuda_kda_decode_rows_runs(void);
/* MoE layers enqueued with that fold so far (captured steps once, replays not at all) */
long lunar_cuda_model_combine_norm_folds(const lunar_cuda_model *g);
/* Decode steps (one token per sequence) as CUDA graphs, captured per batch size and context bucket
 * on a key's second step and replayed after (forward_cuda.c, "decode graphs"); on by default,
 * LUNAR_CUDA_GRAPHS=0 turns them off at upload. Returns the previous setting. Steps with a host
 * round trip (generic MoE, decode context parallelism, profiling) always run eagerly; tensor
 * parallelism's steps are captured too (NCCL inside) unless LUNAR_TP_GRAPHS=0. */
int lunar_cuda_model_graphs(lunar_cuda_model *g, int on);
/* graphs captured, steps replayed, the last capture's node count (launches per step), and the
 * host seconds spent capturing and instantiating (each may be NULL) */
void lunar_cuda_model_graph_stats(const lunar_cuda_model *g, long *captures, long *replays, size_t *nodes,
                                  double *capture_s);

/* Sizes for planning device memory: the uploaded weights; one cache block of 128 tokens over all
 * MLA layers (bf16 latent + index keys; an FP8 latent when latent_fp8; on a DCP rank of a
 * group of D, 128 / D latent rows and 128 index keys); one KDA state slot; an upper bound of one
 * step's temporaries for max_tokens tokens, max_rows logits rows and contexts up to max_len. */
size_t lunar_cuda_model_bytes(const lunar_model *m);
size_t lunar_cuda_block_bytes(const lunar_model *m, int latent_fp8);
size_t lunar_cuda_slot_bytes(const lunar_model *m, int state_fp16);
/* lunar_cuda_caches_init's flags (an int, so that 0 / 1 keep meaning bf16 / FP8 latent) */
#define LUNAR_CUDA_CACHE_FP8_LATENT 1
#define LUNAR_CUDA_CACHE_FP16_STATE 2
size_t lunar_cuda_step_bytes(const lunar_model *m, int max_tokens, int max_rows, int max_len);
/* Bytes the arena has left; the device's one-line description (for logs). */
size_t lunar_cuda_arena_left(void);
const char *lunar_cuda_device_line(void);

/* Device caches: the paged MLA latent (bf16, or FP8 e4m3 of scale 1 as the CPU's LUNAR_KV_FP8:
 * half the bytes per token) + DSA index keys, and n_slots KDA state slots. */
typedef struct lunar_cuda_caches {
    int n_blocks, n_slots, n_mla, n_kda, row, idx_dim;
    int latent_rows;    /* latent rows per block: 128, or 128 / D on a rank of a DCP group of D
                         * (it holds every D-th position; docs/parallel.md). Index keys keep 128. */
    int latent_fp8;     /* latent holds e4m3 codes (1 byte per element) instead of bf16 */
    int state_fp16;     /* state holds fp16 (the fp16 KDA state option: half the bytes per slot) */
    void *latent;       /* [n_mla][n_blocks][latent_rows][row] bf16 or e4m3 */
    uint8_t *idx_codes; /* [n_mla][n_blocks][128][idx_dim] */
    float *idx_scales;  /* [n_mla][n_blocks][128] */
    size_t conv_len, state_len;
    float *conv;  /* [n_slots][n_kda][conv_len] */
    void *state;  /* [n_slots][n_kda][state_len] fp32, or fp16 when state_fp16 */
    size_t mark;  /* arena mark before the caches */
} lunar_cuda_caches;

/* flags: LUNAR_CUDA_CACHE_* (0: bf16 latent, fp32 states) */
int lunar_cuda_caches_init(lunar_cuda_caches *c, const lunar_model *m, int n_blocks, int n_slots, int flags,
                           lunar_err *err);
void lunar_cuda_caches_free(lunar_cuda_caches *c);
void lunar_cuda_state_clear(lunar_cuda_caches *c, int slot);
void lunar_cuda_state_copy(lunar_cuda_caches *c, int to, int from); /* conv + KDA state of a slot */

/* lunar_forward_batch on the device; logits is host memory ([rows, V] as the CPU one), or NULL
 * when no row is wanted on the host (a tensor-parallel follower: rank 0 has the same rows). */
int lunar_forward_batch_cuda(const lunar_cuda_model *g, lunar_cuda_caches *c,
                             const lunar_batch_seq *seqs, int n_seqs, float *logits, lunar_err *err);

/* Sampling on the device for the logits rows that need nothing else (engine/request.c,
 * lunar_request_device_sampling): lunar_sample's settings and its draw u, per row. */
typedef struct lunar_device_sampling {
    int on; /* 0: the row's logits go to the host as usual */
    float temperature, top_p, u;
    int top_k;
} lunar_device_sampling;

/* As lunar_forward_batch_cuda, and rows r with ds[r].on are sampled on the device (cuda_sample.cu):
 * ids[r] receives the token and logits row r is left unwritten (it never leaves the device). */
int lunar_forward_batch_cuda_sampled(const lunar_cuda_model *g, lunar_cuda_caches *c, const lunar_batch_seq *seqs,
                                     int n_seqs, float *logits, const lunar_device_sampling *ds, int32_t *ids,
                                     lunar_err *err);

/* One sequence with device caches of its own (CLI, tests). */
typedef struct lunar_cuda_seq {
    int pos, max_tokens;
    lunar_cuda_caches c;
    int32_t *blocks; /* host identity block table */
} lunar_cuda_seq;

int lunar_cuda_seq_init(lunar_cuda_seq *s, const lunar_model *m, int max_tokens, int flags, lunar_err *err);
void lunar_cuda_seq_reset(lunar_cuda_seq *s);
void lunar_cuda_seq_free(lunar_cuda_seq *s);
int lunar_forward_cuda(const lunar_cuda_model *g, lunar_cuda_seq *s, const int32_t *ids, int n,
                       float *logits, int all_logits, lunar_err *err);

#endif
