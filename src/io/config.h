/* The Hugging Face config.json of the Kimi family parsed into one struct.
 * kimi_linear keeps its keys at the root; kimi_k3 nests them under "text_config" (read from there
 * when present). Every value the forward needs is here, resolved to plain numbers: null q_lora_rank
 * becomes 0, 1-based layer lists become a per-layer kind table. */
#ifndef LUNAR_IO_CONFIG_H
#define LUNAR_IO_CONFIG_H

#include <stdint.h>

#include "base/err.h"

#define LUNAR_MAX_LAYERS 256

typedef enum lunar_arch {
    LUNAR_ARCH_KIMI_LINEAR, /* model_type "kimi_linear" */
    LUNAR_ARCH_KIMI_K3,     /* model_type "kimi_k3" (K3 and K3.1 Pro) */
} lunar_arch;

typedef enum lunar_attn_kind { LUNAR_ATTN_KDA, LUNAR_ATTN_MLA } lunar_attn_kind;
typedef enum lunar_ffn_kind { LUNAR_FFN_DENSE, LUNAR_FFN_MOE } lunar_ffn_kind;

typedef struct lunar_config {
    lunar_arch arch;
    char model_type[32];

    int vocab_size;
    int hidden_size;        /* D */
    int num_hidden_layers;  /* L */
    float rms_norm_eps;
    int tie_word_embeddings;
    int bos_token_id, eos_token_id, pad_token_id; /* -1 when absent */

    /* per-layer schedule, 0-based */
    lunar_attn_kind attn_kind[LUNAR_MAX_LAYERS];
    lunar_ffn_kind ffn_kind[LUNAR_MAX_LAYERS];
    int n_kda_layers, n_mla_layers;

    /* KDA (linear_attn_config) */
    int kda_num_heads;       /* H */
    int kda_head_dim;        /* d_k = d_v */
    int kda_conv_size;       /* short_conv_kernel_size, 4 */
    float kda_gate_lower_bound; /* 0 = unbounded gate -exp(A_log)*softplus(.) */

    /* MLA */
    int num_attention_heads;
    int q_lora_rank;        /* 0 = plain q_proj */
    int kv_lora_rank;       /* 512 */
    int qk_nope_head_dim;   /* 128 */
    int qk_rope_head_dim;   /* 64, unrotated under NoPE */
    int v_head_dim;         /* 128 */
    int mla_use_nope;

    /* FFN */
    int intermediate_size;      /* dense layers */
    int first_k_dense_replace;
    int moe_layer_freq;
    int num_experts;
    int num_experts_per_token;
    int moe_intermediate_size;
    int num_shared_experts;
    int moe_renormalize;
    float routed_scaling_factor;
    int num_expert_group, topk_group;

    /* Kimi-K3 feature switches (SPEC section 1): each is off unless its key says otherwise. */
    int attn_res_block_size;       /* Attention Residuals, block size in decoder layers; 0 = off */
    int kda_full_rank_gate;        /* KDA output gate g_proj [H*dk, D] instead of g_a/g_b */
    int mla_use_output_gate;       /* MLA: sigmoid(g_proj x) multiplies the heads before o_proj */
    int routed_expert_hidden_size; /* latent MoE width (3584); 0 = experts on the full width */
    int latent_moe_use_norm;       /* RMSNorm on the latent routed sum */
    int act_situ;                  /* hidden_act "situ": SiTU-GLU instead of SwiGLU */
    float situ_beta, situ_linear_beta; /* activation_situ_beta / _linear_beta; linear 0 = none */
    int experts_mxfp4;             /* routed experts stored MXFP4 (compressed-tensors) */
    int ptpc_fp8;                  /* not from config.json: --quantization ptpc_fp8 (load option) */

    /* Kimi-K3.1 DSA indexer on every MLA layer (SPEC section 1.1); index_topk 0 = dense MLA. */
    int index_n_heads, index_head_dim, index_topk, index_rope;
    float rope_theta; /* the indexer's RoPE base when index_rope (MLA itself is NoPE); 10000 */
} lunar_config;

/* Parses config.json at path. Errors name the file and the key. */
int lunar_config_load(lunar_config *cfg, const char *path, lunar_err *err);
/* Same, from a string (used by the fuzz test); label names the source in errors. */
int lunar_config_parse(lunar_config *cfg, const char *json, size_t len, const char *label,
                       lunar_err *err);

#endif
