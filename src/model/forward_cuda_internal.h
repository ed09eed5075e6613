/* The CUDA forward's internals shared by its two files: forward_cuda_upload.c (weights to the
 * device, the caches, the memory plan) and forward_cuda.c (the step, the decode graphs). */
#ifndef LUNAR_MODEL_FORWARD_CUDA_INTERNAL_H
#define LUNAR_MODEL_FORWARD_CUDA_INTERNAL_H

#include "model/forward_cuda.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_glue.h"
#include "backend/cuda/cuda_ops.h"
#include "model/dummy.h"
#include "model/forward_cuda_tp.h"
#include "model/shard.h"
#include "model/profile.h"
#include "ops.h"

/* One sequence's MLA prefill of at least this many tokens goes through the decompressed flash
 * kernel (cuda_mla_flash.cu: 2x the absorbed GEMM form at 8K tokens, 3.2x at 1K, H200), or with
 * LUNAR_MLA_PREFILL=absorbed the absorbed GEMM form (cuda_mla_prefill.cu: 10x the row kernel at
 * 8K tokens); fewer rows stay on the row kernel. */
#define MLA_PREFILL_GEMM_MIN 64
/* Steps of at least this many rows absorb / un-absorb through GEMMs over heads (the weights widened
 * to fp32 once per layer, 16 MB at K-Linear's shapes, pays off from a few dozen rows). */
#define MLA_ABSORB_GEMM_MIN 64

#define KDA_L2_EPS 1e-6f
#define MLA_LATENT_NORM_EPS 1e-6f
#define INDEX_K_NORM_EPS 1e-6f
/* The share of device memory the arena takes when nothing chose one (--gpu-memory-utilization). */
#define DEFAULT_GPU_UTIL 0.9

/* bf16 [out, in]; PTPC-FP8 (s8 set, --quantization ptpc_fp8): p holds the e4m3 codes [out, in]
 * (bytes, read only by mm_fp8) and s8 [out] their row scales, the bf16 copy gone */
typedef struct dmat { uint16_t *p; int out, in; float *s8; } dmat;

typedef struct dlayer {
    uint16_t *attn_norm, *ffn_norm;  /* bf16 for lunar_cuda_rmsnorm */
    float *attn_norm_f, *ffn_norm_f; /* fp32 for the AttnRes mix */
    float *ares_u, *mres_u;          /* proj * norm */
    /* KDA */
    dmat q, k, v, fa, fb, b, ga, gb, g, o;
    float *qc, *kc, *vc, *dt_bias, *A_log;
    /* the batch-1 decode's fused projection of h (up_cat): q|k|v|fa|(g or ga)|b as one matrix, the
     * six above views into it; qc|kc|vc likewise one [3 H dk, K] array (p NULL: not fused) */
    dmat kin;
    dmat kfg; /* f_b | g_b (f_b alone with the full-rank gate) for lunar_cuda_kda_gate_proj_decode */
    uint16_t *o_norm;
    /* MLA */
    dmat mq, qa, qb, kva, kvb, mo, mg, iwq, iwk, iwp;
    dmat min; /* (mq or qa)|kva|mg|(iwk|iwp) fused as kin (those present, in this order) */
    uint16_t *qa_norm;
    float *kva_norm, *ik_w, *ik_b;
    /* FFN */
    dmat gate, up, down, router, sg, su, sd, ldown, lup;
    dmat sin; /* sg|su|router fused as kin */
    float *rbias;
    uint16_t *lnorm;
    dmat *w1, *w3, *w2; /* [E] */
    /* the fused routed-expert path (cuda_moe.cu) when the widths allow it (multiples of 128):
     * the experts stacked per matrix (BF16: w1[e].p points into the stack; MXFP4: packed codes and
     * scales as stored; their widened copies for the generic path only with LUNAR_CUDA_MOE=generic
     * at upload, else generic_off: w1 / w3 / w2 empty, the generic path unavailable) */
    int fused_ok, generic_off;
    lunar_cuda_moe_experts mx;
} dlayer;

struct lunar_cuda_model {
    const lunar_model *m;
    size_t mark;
    uint16_t *embed;
    dmat lm_head;
    uint16_t *final_norm;
    float *final_norm_f, *out_u;
    float *rope_inv; /* indexer RoPE inverse frequencies */
    dlayer *L;
    int fused_moe;          /* use the fused routed-expert path where fused_ok (lunar_cuda_model_fused_moe) */
    lunar_cuda_stream side; /* the shared experts' stream on that path, with its two events */
    lunar_cuda_event ev_x, ev_shared;
    int fuse_off;           /* LUNAR_CUDA_FUSE=0 at upload: main's launch sequence (A/B runs) */
    int combine_norm;       /* LUNAR_COMBINE_NORM=1 at upload (lunar_cuda_model_combine_norm): run_residual */
    long combine_norm_folds; /* layers enqueued with the fold (graph replays not counted) */
    /* the batch-1 KDA decode (kda_layer): the launches of session 4 (default: conv, recurrence,
     * gated norm apart), the fused core with the gate projections (LUNAR_KDA_DECODE=fused), or the
     * fused core after the gate-projection launch (=nogate). Opt-in: no faster on the H200
     * (docs/benchmarks.md "Decode fusion, round 3") */
    int kda_decode;
    /* KDA prefill (kda_layer, dk = 128, fused projection): 1 (default) = one GEMM for the six
     * projections of h and one pass for the convolutions, norms, beta and the low-rank gate inputs
     * (lunar_cuda_kda_conv_qkv_prefill; session 6, H200: KL48 8K prefill kda_proj 50.0 -> 30.5 ms);
     * 0 = the per-projection GEMMs and ops (LUNAR_KDA_PREFILL=split) */
    int kda_prefill;
    struct lunar_cuda_graphs *graphs; /* the decode steps' CUDA graphs (forward_cuda.c "decode graphs") */
};

enum { KDA_DECODE_FUSED = 0, KDA_DECODE_NOGATE = 1, KDA_DECODE_SPLIT = 2 };

/* decode steps plan for a longest context rounded up to a quarter of its power of two (>= 256):
 * at most 25 % of empty tiles for the MLA decode kernel (it skips them per row), four graphs per
 * doubling of the context */
static inline int decode_len_bucket(int L) {
    int p = 1;
    while (p <= L / 2) p *= 2;
    const int q = p / 4 > 256 ? p / 4 : 256;
    return (L + q - 1) / q * q;
}

struct lunar_cuda_graphs;
/* the decode graphs' table of a model (forward_cuda.c): made at upload, freed with the model */
struct lunar_cuda_graphs *lunar_cuda_fwd_graphs_new(int on);
void lunar_cuda_fwd_graphs_free(struct lunar_cuda_graphs *gs);
/* device memory from the arena; in counting mode (lunar_cuda_model_bytes) only added up */
void *lunar_cuda_fwd_alloc(size_t bytes);

#endif
