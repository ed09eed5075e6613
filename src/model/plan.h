/* lunar plan: where the bytes of a Kimi model go on each GPU of a tensor-parallel group.
 *
 * Weights come from the single tensor walk (lunar_config_walk_tensors) with each tensor's storage
 * dtype and its tensor-parallel rule; the K3 vision tower, which the text walk does not see, is sized
 * from vision_config; a DSpark draft from its own config. Caches: the MLA latent pool (with the
 * draft's rows), the DSA index-key pool, and the KDA recurrent + conv state per request. The rest of
 * the GPU (gpu memory x utilisation - weights - activation workspace) is the cache budget.
 * Everything is in bytes; GB below means 1e9 bytes, GiB 2^30. */
#ifndef LUNAR_MODEL_PLAN_H
#define LUNAR_MODEL_PLAN_H

#include <stdint.h>
#include <stdio.h>

#include "base/err.h"
#include "io/config.h"
#include "io/draft_config.h"

typedef enum lunar_cache_dtype {
    LUNAR_CACHE_BF16,
    LUNAR_CACHE_FP8,   /* e4m3 (+ scale where the layout has one) */
    LUNAR_CACHE_MXFP4, /* index keys only: E2M1 + E8M0 per 32 */
    LUNAR_CACHE_FP32,  /* KDA state only */
    LUNAR_CACHE_FP16,  /* KDA state only */
} lunar_cache_dtype;

/* Weight kinds, the rows of the table. */
typedef enum lunar_wkind {
    LUNAR_W_EMBED,
    LUNAR_W_LM_HEAD,
    LUNAR_W_KDA,
    LUNAR_W_MLA,
    LUNAR_W_INDEXER,
    LUNAR_W_DENSE_MLP,
    LUNAR_W_SHARED,
    LUNAR_W_ROUTED,
    LUNAR_W_ROUTER,
    LUNAR_W_LATENT, /* routed_expert_{down,up}_proj + routed_expert_norm */
    LUNAR_W_NORMS,  /* RMSNorms and AttnRes pseudo-queries */
    LUNAR_W_VISION, /* MoonViT3d tower + projector */
    LUNAR_W_DRAFT,  /* DSpark draft */
    LUNAR_W_COUNT
} lunar_wkind;

/* Storage dtypes of the checkpoint. */
typedef enum lunar_sdtype { LUNAR_SD_BF16, LUNAR_SD_F32, LUNAR_SD_U8, LUNAR_SD_COUNT } lunar_sdtype;

typedef struct lunar_plan_row {
    int64_t params;                 /* logical parameters (an MXFP4 matrix counts out x in) */
    int64_t bytes[LUNAR_SD_COUNT];  /* whole model, by storage dtype */
    int64_t total_bytes;            /* whole model */
    int64_t gpu_bytes;              /* on each GPU */
    int64_t gpu_replicated;         /* the part of gpu_bytes every rank holds in full */
} lunar_plan_row;

typedef struct lunar_plan_opts {
    int tp, dcp;
    lunar_cache_dtype kv_dtype;     /* fp8 (default) | bf16 */
    lunar_cache_dtype index_dtype;  /* fp8 (default) | mxfp4 */
    lunar_cache_dtype state_dtype;  /* fp32 (default) | fp16 */
    int latent_moe_mxfp4;           /* 1: routed_expert_{down,up}_proj re-quantised to MXFP4 at load (ATOM) */
    int64_t max_model_len;          /* default 1,048,576 */
    int64_t max_num_seqs;           /* default 256 */
    int64_t max_num_batched_tokens; /* default 8192 */
    double gpu_memory_gb;           /* default 141 (H200) */
    double gpu_util;                /* default 0.9, as vLLM */
} lunar_plan_opts;

void lunar_plan_opts_default(lunar_plan_opts *o);

typedef struct lunar_plan {
    lunar_plan_opts opts;
    int has_draft;
    int num_spec;                    /* drafts per step (0 without a draft) */
    lunar_plan_row w[LUNAR_W_COUNT];
    int64_t checkpoint_bytes;        /* target model incl. vision, excl. the draft */
    int64_t draft_bytes;             /* the draft's loaded tensors (no embedding, no confidence head) */
    int64_t params_total, params_active; /* target text model (lunar_config_count_params) */
    int64_t weights_gpu;             /* target + draft on each GPU: the start-up footprint */

    /* caches, bytes on one GPU */
    int latent_row_bytes;            /* per token per MLA layer: 576 (fp8) | 1152 (bf16) */
    int index_row_bytes;             /* per token per MLA layer: 132 (fp8) | 68 (mxfp4); 0 without indexer */
    int n_latent_rows, n_index_rows; /* MLA layers (+ draft layers) | MLA layers with an indexer */
    int64_t kv_bytes_per_token;      /* all rows of one token, on the rank that holds it (before DCP) */
    int state_slots;                 /* KDA slots per request: 1 + num_spec */
    int64_t kda_ssm_bytes, kda_conv_bytes; /* per request per GPU, all KDA layers */
    int64_t kda_state_bytes;         /* their sum */

    /* activation workspace (see plan.c for the formula) */
    int64_t ws_stream, ws_layer, ws_logits, ws_index;
    int64_t workspace_bytes;

    int64_t budget_bytes;            /* gpu memory x utilisation */
    int64_t cache_bytes;             /* budget - weights - workspace (negative: does not fit) */
    int64_t seq_bytes;               /* one request at max-model-len, on one GPU */
    int64_t tokens_fit;              /* KV tokens that fit beside max-num-seqs resident KDA states */
    int64_t seqs_at_max_len;         /* concurrent requests at max-model-len */
} lunar_plan;

/* Parameters of the vision tower + projector described by the root vision_config of the config
 * file at path (K3: MoonViT3d + patchmergerv2, 447,358,976); 0 when it has none. -1 on error. */
int64_t lunar_vision_params_load(const char *path, lunar_err *err);

/* Computes the plan. draft may be NULL. Errors name the option (--tp, --dcp, ...). */
int lunar_plan_compute(lunar_plan *p, const lunar_config *cfg, int64_t vision_params,
                       const lunar_draft_config *draft, const lunar_plan_opts *o, lunar_err *err);

/* Smallest power-of-two TP (1..64) at which the weights, the workspace and one request at
 * max-model-len fit; dcp_all: decode context parallel across the whole TP group (dcp = tp), else
 * opts->dcp capped at tp. Returns the TP, or 0 when none fits. */
int lunar_plan_min_tp(const lunar_config *cfg, int64_t vision_params, const lunar_draft_config *draft,
                      const lunar_plan_opts *o, int dcp_all);

/* Parameters of a draft's loaded tensors. */
int64_t lunar_draft_count_params(const lunar_draft_config *d);

const char *lunar_wkind_name(lunar_wkind k);
const char *lunar_cache_dtype_name(lunar_cache_dtype d);
void lunar_plan_print(FILE *f, const lunar_plan *p, const lunar_config *cfg, const lunar_draft_config *draft,
                      int64_t vision_params);

#endif
