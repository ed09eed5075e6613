/* A loaded Kimi-family model: config, mapped checkpoint and the weights bound by name.
 * Tensor names are the Hugging Face checkpoint's (kda.md sections 1.3, 3, 4); the shapes are
 * derived from the config and checked at load, so a wrong checkpoint fails with the file, the
 * tensor, the expected and the found shape. */
#ifndef LUNAR_MODEL_MODEL_H
#define LUNAR_MODEL_MODEL_H

#include <stdint.h>

#include "base/err.h"
#include "base/tensor.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "ops.h"

typedef struct lunar_kda_weights {
    const lunar_tensor *q_proj, *k_proj, *v_proj;    /* [H*dk, D] */
    const lunar_tensor *q_conv, *k_conv, *v_conv;    /* [H*dk, 1, K] */
    const lunar_tensor *f_a_proj;                     /* [dk, D]     forget gate, low-rank down */
    const lunar_tensor *f_b_proj;                     /* [H*dk, dk]  forget gate, up */
    const lunar_tensor *dt_bias;                      /* [H*dk] */
    const lunar_tensor *A_log;                        /* H values ([1,1,H,1]) */
    const lunar_tensor *b_proj;                       /* [H, D]      beta */
    const lunar_tensor *g_a_proj, *g_b_proj;          /* [dk, D], [H*dk, dk]  output gate */
    const lunar_tensor *g_proj;                       /* [H*dk, D] full-rank output gate (K3) */
    const lunar_tensor *o_norm;                       /* [dk] shared by heads */
    const lunar_tensor *o_proj;                       /* [D, H*dk] */
} lunar_kda_weights;

typedef struct lunar_mla_weights {
    const lunar_tensor *q_proj;                       /* [nh*(nope+rope), D] (q_lora_rank 0) */
    const lunar_tensor *q_a_proj, *q_a_norm, *q_b_proj; /* [q_lora, D], [q_lora], [nh*(nope+rope), q_lora] */
    const lunar_tensor *kv_a_proj;                    /* [kv_lora+rope, D] */
    const lunar_tensor *kv_a_norm;                    /* [kv_lora] */
    const lunar_tensor *kv_b_proj;                    /* [nh*(nope+v), kv_lora] */
    const lunar_tensor *o_proj;                       /* [D, nh*v] */
    const lunar_tensor *g_proj;                       /* [nh*v, D] output gate (K3), or NULL */
    /* K3.1 DSA indexer (SPEC 1.1), NULL without index_topk */
    const lunar_tensor *idx_wq_b;                     /* [n_idx*d_idx, q_lora] */
    const lunar_tensor *idx_wk;                       /* [d_idx, D] */
    const lunar_tensor *idx_k_norm_w, *idx_k_norm_b;  /* [d_idx] LayerNorm */
    const lunar_tensor *idx_weights_proj;             /* [n_idx, D] */
} lunar_mla_weights;

/* A routed expert: BF16/F32 tensors, or MXFP4 (packed + E8M0 scales) when experts_mxfp4.
 * D_e is the expert input width: routed_expert_hidden_size for the latent MoE, else hidden_size. */
typedef struct lunar_expert_weights {
    const lunar_tensor *w1, *w3; /* gate, up: [I, D_e] */
    const lunar_tensor *w2;      /* down: [D_e, I] */
    lunar_mxfp4 q1, q3, q2;      /* the same in MXFP4: packed [out, in/2] u8, scale [out, in/32] u8 */
} lunar_expert_weights;

typedef struct lunar_ffn_weights {
    /* dense layer (and the shared experts of a MoE layer): SwiGLU */
    const lunar_tensor *gate_proj, *up_proj, *down_proj;
    /* MoE */
    const lunar_tensor *router;        /* [E, D] */
    const lunar_tensor *router_bias;   /* [E] e_score_correction_bias */
    lunar_expert_weights *experts;     /* [E] */
    const lunar_tensor *shared_gate, *shared_up, *shared_down; /* NULL without shared experts */
    /* latent MoE (K3): experts run at routed_expert_hidden_size = Lat */
    const lunar_tensor *latent_down; /* [Lat, D] routed_expert_down_proj */
    const lunar_tensor *latent_norm; /* [Lat]    routed_expert_norm, or NULL */
    const lunar_tensor *latent_up;   /* [D, Lat] routed_expert_up_proj */
} lunar_ffn_weights;

typedef struct lunar_layer_weights {
    const lunar_tensor *attn_norm; /* input_layernorm [D] */
    const lunar_tensor *ffn_norm;  /* post_attention_layernorm [D] */
    lunar_kda_weights kda;         /* when cfg.attn_kind[l] == KDA */
    lunar_mla_weights mla;         /* when cfg.attn_kind[l] == MLA */
    lunar_ffn_weights ffn;
    /* Attention Residuals (K3): pseudo-query [1, D] and key norm [D] of the two mixing sites */
    const lunar_tensor *attn_res_proj, *attn_res_norm;
    const lunar_tensor *mlp_res_proj, *mlp_res_norm;
} lunar_layer_weights;

/* How to load: from the checkpoint (default) or `--load-format dummy` (model/dummy.c), optionally
 * only the first num_layers layers and/or the shapes one rank of tensor parallelism tp_slice holds. */
typedef struct lunar_load_options {
    const char *load_format; /* NULL, "auto" or "safetensors": the checkpoint; "dummy": random weights */
    int num_layers;          /* > 0: keep layers [0, num_layers) only */
    int tp_slice;            /* > 1: the per-rank shapes of TP tp_slice (lunar_config_tp_slice) */
    int device_lazy;         /* dummy: leave large matrices for the CUDA upload to generate on the device */
    uint64_t seed;           /* dummy: weights are a function of (seed, tensor name, element index) */
    int ptpc_fp8;            /* --quantization ptpc_fp8: the BF16 linears of SPEC 2 run as PTPC-FP8 */
} lunar_load_options;

typedef struct lunar_model {
    lunar_config cfg;
    lunar_load_options load; /* how it was loaded (load_format NULL = checkpoint) */
    char dir[1024];
    lunar_st *st;
    const lunar_tensor *embed;      /* [V, D] */
    const lunar_tensor *final_norm; /* [D] */
    const lunar_tensor *lm_head;    /* [V, D]; the embedding when tied */
    const lunar_tensor *out_res_proj, *out_res_norm; /* AttnRes output mix [1, D], [D] (K3) */
    lunar_layer_weights *layers;    /* [L] */
    /* which layer index among its kind (KDA or MLA) layer l is, for the per-kind caches */
    int kind_index[LUNAR_MAX_LAYERS];
    /* tensor/decode-context parallelism: this rank's place and comms (model/shard.h); NULL for
     * the single-rank model, whose forward makes no collective call */
    struct lunar_tp *tp;
} lunar_model;

/* Loads dir/config.json and the checkpoint in dir, binds and checks every tensor. */
int lunar_model_load(lunar_model **out, const char *dir, lunar_err *err);
/* The same with options (o may be NULL). With load_format "dummy", path is a config.json or a
 * directory holding one, and no checkpoint is read. */
int lunar_model_load_ex(lunar_model **out, const char *path, const lunar_load_options *o, lunar_err *err);
void lunar_model_free(lunar_model *m);

/* Parameter counts by role, from the config alone (no weights needed). */
typedef struct lunar_param_counts {
    int64_t embedding, lm_head, attention, dense_mlp, shared_experts, routed_experts, router,
        norms;
    int64_t total;
    int64_t active;          /* per token: all but the unselected routed experts and the embedding lookup */
    int64_t routed_per_layer_active;
} lunar_param_counts;

void lunar_config_count_params(const lunar_config *cfg, lunar_param_counts *out);

/* Calls visit for every tensor the config implies, in checkpoint order, with its name and the
 * shape the loader expects (vectors whose stored shape varies are given as 1-D). */
typedef void (*lunar_tensor_visitor)(void *ctx, const char *name, int ndim, const int64_t *shape);
void lunar_config_walk_tensors(const lunar_config *cfg, lunar_tensor_visitor visit, void *ctx);

#endif
