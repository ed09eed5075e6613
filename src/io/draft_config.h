/* The config.json of a DSpark draft (dspark_vl_api_spec.md section 1.1; SPEC 1.2 for K3.1 Pro):
 * a plain pre-norm stack of MLA + dense SwiGLU layers fed by target taps, with a Markov head.
 * Separate from lunar_config: a draft is not a Kimi model_type and config.c must not learn its
 * keys. Only the keys that size the draft are read; the rest (rope_parameters, confidence head,
 * tie_word_embeddings) are accepted and ignored. */
#ifndef LUNAR_IO_DRAFT_CONFIG_H
#define LUNAR_IO_DRAFT_CONFIG_H

#include "base/err.h"

#define LUNAR_DRAFT_MAX_TAPS 16

typedef struct lunar_draft_config {
    int hidden_size, intermediate_size, num_hidden_layers, vocab_size;
    int num_attention_heads, q_lora_rank, kv_lora_rank;
    int qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    float rms_norm_eps;
    int target_hidden_size, target_num_hidden_layers; /* the latter 0 when absent */
    int n_taps;                                       /* num_target_layers */
    int target_layer_ids[LUNAR_DRAFT_MAX_TAPS];       /* 0-based; -1 = the embedding output */
    int mask_token_id;
    int markov_rank;            /* 0 = no Markov head */
    char markov_head_type[16];  /* "vanilla" (the only one with a known tensor layout) */
    int block_size;             /* drafts per step (the anchor is extra); default 7 */
} lunar_draft_config;

/* 1 when the JSON object in path looks like a DSpark draft config (it has target_layer_ids), 0 when
 * not, -1 when the file cannot be read or parsed (err set). */
int lunar_draft_config_sniff(const char *path, lunar_err *err);
/* Parses a draft config.json; errors name the file and the key. */
int lunar_draft_config_load(lunar_draft_config *d, const char *path, lunar_err *err);
int lunar_draft_config_parse(lunar_draft_config *d, const char *json, size_t len, const char *label,
                             lunar_err *err);

#endif
