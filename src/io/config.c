/* config.json -> lunar_config. Defaults for missing optional keys follow transformers'
 * KimiLinearConfig; a few keys without a safe default are required (see REQUIRED below).
 *
 * Layer schedule, in transformers' order of precedence:
 *   1. root `layer_types` ("full_attention" | "linear_attention" per layer);
 *   2. linear_attn_config.kda_layers + full_attn_layers (1-based). Every layer must be in exactly
 *      one list: transformers and Moonshot's remote code disagree about a layer in neither list
 *      (KDA vs MLA), so such a config is rejected instead of guessed;
 *   3. neither: transformers' default, MLA at 0-based i > 0 with i % 4 == 0.
 * FFN: root `mlp_layer_types` ("dense" | "sparse") when present; otherwise Moonshot/vLLM's rule
 * MoE iff num_experts > 0 && l >= first_k_dense_replace && l % moe_layer_freq == 0 (transformers
 * ignores moe_layer_freq; every published config has moe_layer_freq = 1, where they agree). */
#include "io/config.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#define REQUIRED INT_MIN /* default value meaning "the key must be present" */
#define MAX_CONFIG_BYTES (16u * 1024 * 1024)

typedef struct ctx {
    const char *label;
    const char *prefix; /* "text_config." when reading the nested text model, else "" */
    lunar_err *err;
} ctx;

/* JSON null counts as absent: HF writes null for "use the default". */
static json_t *get(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return json_is_null(v) ? NULL : v;
}

static int fail_key(const ctx *c, const char *sub, const char *key, const char *want, json_t *found) {
    char *s = found ? json_dumps(found, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
    lunar_fail(c->err, "%s: key '%s%s%s': %s%s%.80s%s", c->label, c->prefix, sub, key,
               found ? "expected " : "", want, found ? (s ? s : "?") : "",
               s && strlen(s) > 80 ? "..." : "");
    free(s);
    return -1;
}

static int fail_missing(const ctx *c, const char *sub, const char *key) {
    return fail_key(c, sub, key, "missing required key", NULL);
}

/* Integer key in [min, INT_MAX]; `sub` is the path of obj inside the section ("" or "x."). */
static int get_int(const ctx *c, json_t *obj, const char *sub, const char *key, int def, int min, int *out) {
    json_t *v = get(obj, key);
    if (!v) {
        if (def == REQUIRED) return fail_missing(c, sub, key);
        *out = def;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < min || json_integer_value(v) > INT_MAX)
        return fail_key(c, sub, key, min > 0 ? "a positive integer, found " : "a non-negative integer, found ", v);
    *out = (int)json_integer_value(v);
    return 0;
}

/* First present of two spellings (HF attribute aliases), e.g. num_experts / num_local_experts. */
static const char *alias(json_t *obj, const char *a, const char *b) { return get(obj, a) || !get(obj, b) ? a : b; }

static int get_num(const ctx *c, json_t *obj, const char *sub, const char *key, double def, float *out) {
    json_t *v = get(obj, key);
    if (!v) {
        *out = (float)def;
        return 0;
    }
    if (!json_is_number(v) || !isfinite(json_number_value(v)) || fabs(json_number_value(v)) > 1e30)
        return fail_key(c, sub, key, "a finite number, found ", v);
    *out = (float)json_number_value(v);
    return 0;
}

static int get_bool(const ctx *c, json_t *obj, const char *key, int def, int *out) {
    json_t *v = get(obj, key);
    if (!v) {
        *out = def;
        return 0;
    }
    if (!json_is_boolean(v)) return fail_key(c, "", key, "true or false, found ", v);
    *out = json_is_true(v);
    return 0;
}

/* Token id: integer, or a list whose first element is used (eos may be a list); -1 if absent. */
static int get_token(const ctx *c, json_t *sec, json_t *root, const char *key, int *out) {
    json_t *v = get(sec, key);
    if (!v && sec != root) v = get(root, key);
    *out = -1;
    if (!v) return 0;
    json_t *x = json_is_array(v) && json_array_size(v) ? json_array_get(v, 0) : v;
    if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT_MAX)
        return fail_key(c, "", key, "a non-negative integer token id, found ", v);
    *out = (int)json_integer_value(x);
    return 0;
}

/* Marks layers of a 1-based list in seen[] with kind; rejects out-of-range and repeated layers. */
static int mark_layers(const ctx *c, json_t *list, const char *key, int L, int kind, int *seen) {
    if (!json_is_array(list)) return fail_key(c, "linear_attn_config.", key, "an array of layer numbers, found ", list);
    size_t i;
    json_t *v;
    json_array_foreach(list, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > L) {
            char want[96];
            snprintf(want, sizeof want, "layer numbers in 1..%d (num_hidden_layers), found ", L);
            return fail_key(c, "linear_attn_config.", key, want, v);
        }
        int l = (int)json_integer_value(v) - 1;
        if (seen[l] == kind)
            return lunar_fail(c->err, "%s: key '%slinear_attn_config.%s': layer %d is listed twice", c->label,
                              c->prefix, key, l + 1);
        if (seen[l] >= 0)
            return lunar_fail(c->err, "%s: key '%slinear_attn_config.%s': layer %d is in both kda_layers and "
                              "full_attn_layers", c->label, c->prefix, key, l + 1);
        seen[l] = kind;
    }
    return 0;
}

/* Reads a per-layer string list (layer_types / mlp_layer_types): value a -> 0, value b -> 1. */
static int get_types(const ctx *c, json_t *v, const char *key, int L, const char *a, const char *b, int *kind) {
    if (!json_is_array(v) || (int)json_array_size(v) != L) {
        char want[96];
        snprintf(want, sizeof want, "an array of %d strings, found ", L);
        return fail_key(c, "", key, want, v);
    }
    for (int l = 0; l < L; l++) {
        const char *s = json_string_value(json_array_get(v, (size_t)l));
        if (!s || (strcmp(s, a) != 0 && strcmp(s, b) != 0)) {
            char k[64], want[96];
            snprintf(k, sizeof k, "%s[%d]", key, l);
            snprintf(want, sizeof want, "\"%s\" or \"%s\", found ", a, b);
            return fail_key(c, "", k, want, json_array_get(v, (size_t)l));
        }
        kind[l] = strcmp(s, b) == 0;
    }
    return 0;
}

static int parse_schedule(lunar_config *cfg, const ctx *c, json_t *sec, json_t *lac) {
    int L = cfg->num_hidden_layers, seen[LUNAR_MAX_LAYERS];
    json_t *lt = get(sec, "layer_types"), *kda = get(lac, "kda_layers"), *full = get(lac, "full_attn_layers");
    if (lt) {
        if (get_types(c, lt, "layer_types", L, "linear_attention", "full_attention", seen)) return -1;
    } else if (kda || full) {
        if (!kda || !full)
            return fail_missing(c, "linear_attn_config.", kda ? "full_attn_layers" : "kda_layers");
        for (int l = 0; l < L; l++) seen[l] = -1;
        if (mark_layers(c, kda, "kda_layers", L, 0, seen) || mark_layers(c, full, "full_attn_layers", L, 1, seen))
            return -1;
        for (int l = 0; l < L; l++)
            if (seen[l] < 0)
                return lunar_fail(c->err, "%s: key '%slinear_attn_config.kda_layers': layer %d is in neither "
                                  "kda_layers nor full_attn_layers", c->label, c->prefix, l + 1);
    } else {
        for (int l = 0; l < L; l++) seen[l] = l > 0 && l % 4 == 0;
    }
    cfg->n_kda_layers = cfg->n_mla_layers = 0;
    for (int l = 0; l < L; l++) {
        cfg->attn_kind[l] = seen[l] ? LUNAR_ATTN_MLA : LUNAR_ATTN_KDA;
        if (seen[l]) cfg->n_mla_layers++;
        else cfg->n_kda_layers++;
    }

    json_t *mt = get(sec, "mlp_layer_types");
    if (mt) {
        if (get_types(c, mt, "mlp_layer_types", L, "dense", "sparse", seen)) return -1;
        for (int l = 0; l < L; l++) {
            if (seen[l] && cfg->num_experts == 0)
                return fail_key(c, "", "mlp_layer_types", "\"dense\" only when num_experts is 0, found ", mt);
            cfg->ffn_kind[l] = seen[l] ? LUNAR_FFN_MOE : LUNAR_FFN_DENSE;
        }
    } else {
        for (int l = 0; l < L; l++)
            cfg->ffn_kind[l] = cfg->num_experts > 0 && l >= cfg->first_k_dense_replace &&
                                       l % cfg->moe_layer_freq == 0
                                   ? LUNAR_FFN_MOE
                                   : LUNAR_FFN_DENSE;
    }
    return 0;
}

/* True when quantization_config (root or text section) is compressed-tensors MXFP4: its routed
 * experts then come as weight_packed + weight_scale (SPEC section 3). */
static int is_mxfp4(json_t *sec, json_t *root) {
    json_t *q = get(sec, "quantization_config");
    if (!q) q = get(root, "quantization_config");
    const char *fmt = q ? json_string_value(json_object_get(q, "format")) : NULL;
    return fmt && strcmp(fmt, "mxfp4-pack-quantized") == 0;
}

static int parse_k3_fields(lunar_config *cfg, const ctx *c, json_t *sec, json_t *root, json_t *lac) {
    const int k3 = cfg->arch == LUNAR_ARCH_KIMI_K3;
    /* ATOM builds the full-rank KDA gate and the MLA output gate for every K3 regardless of the
     * keys (k3_spec 1.2); kimi_linear has neither unless its config asks. */
    if (get_int(c, sec, "", "attn_res_block_size", 0, 0, &cfg->attn_res_block_size) ||
        get_bool(c, lac, "use_full_rank_gate", k3, &cfg->kda_full_rank_gate) ||
        get_bool(c, sec, "mla_use_output_gate", k3, &cfg->mla_use_output_gate) ||
        get_int(c, sec, "", "routed_expert_hidden_size", 0, 0, &cfg->routed_expert_hidden_size) ||
        get_bool(c, sec, "latent_moe_use_norm", cfg->routed_expert_hidden_size > 0, &cfg->latent_moe_use_norm) ||
        get_num(c, sec, "", "activation_situ_beta", 4.0, &cfg->situ_beta) ||
        get_num(c, sec, "", "activation_situ_linear_beta", 0.0, &cfg->situ_linear_beta) ||
        get_int(c, sec, "", "index_n_heads", 0, 0, &cfg->index_n_heads) ||
        get_int(c, sec, "", "index_head_dim", 0, 0, &cfg->index_head_dim) ||
        get_int(c, sec, "", "index_topk", 0, 0, &cfg->index_topk) ||
        get_bool(c, sec, "index_rope", 0, &cfg->index_rope) ||
        get_num(c, sec, "", "rope_theta", 10000.0, &cfg->rope_theta))
        return -1;
    if (!(cfg->rope_theta > 0)) return fail_key(c, "", "rope_theta", "a positive number, found ", get(sec, "rope_theta"));
    json_t *act = get(sec, "hidden_act");
    const char *a = act ? json_string_value(act) : "silu";
    if (!a || (strcmp(a, "silu") != 0 && strcmp(a, "situ") != 0))
        return fail_key(c, "", "hidden_act", "\"silu\" or \"situ\", found ", act);
    cfg->act_situ = strcmp(a, "situ") == 0;
    if (cfg->act_situ && !(cfg->situ_beta > 0))
        return fail_key(c, "", "activation_situ_beta", "a positive number, found ", get(sec, "activation_situ_beta"));
    if (cfg->situ_linear_beta < 0)
        return fail_key(c, "", "activation_situ_linear_beta", "a number >= 0, found ",
                        get(sec, "activation_situ_linear_beta"));
    cfg->experts_mxfp4 = is_mxfp4(sec, root);
    if (cfg->index_topk > 0) {
        if (cfg->index_n_heads <= 0) return fail_key(c, "", "index_n_heads", "a positive integer with index_topk, found ", get(sec, "index_n_heads"));
        if (cfg->index_head_dim <= 0 || (cfg->index_head_dim & (cfg->index_head_dim - 1)))
            return fail_key(c, "", "index_head_dim", "a positive power of two (Hadamard rotation), found ",
                            get(sec, "index_head_dim"));
        if (cfg->index_rope && (cfg->qk_rope_head_dim <= 0 || cfg->qk_rope_head_dim % 2 ||
                                cfg->qk_rope_head_dim > cfg->index_head_dim))
            return fail_key(c, "", "qk_rope_head_dim", "an even number <= index_head_dim (the indexer's RoPE width), found ",
                            get(sec, "qk_rope_head_dim"));
        if (cfg->q_lora_rank <= 0)
            return fail_key(c, "", "q_lora_rank", "a positive integer (the indexer reads the q latent), found ",
                            get(sec, "q_lora_rank"));
    }
    /* MXFP4 groups 32 inputs per scale and packs two per byte. */
    const int exp_in = cfg->routed_expert_hidden_size ? cfg->routed_expert_hidden_size : cfg->hidden_size;
    if (cfg->experts_mxfp4 && cfg->num_experts > 0 && (exp_in % 32 || cfg->moe_intermediate_size % 32))
        return fail_key(c, "", "moe_intermediate_size", "multiples of 32 for MXFP4 experts (with the expert input width), found ",
                        get(sec, "moe_intermediate_size"));
    return 0;
}

static int parse_fields(lunar_config *cfg, const ctx *c, json_t *sec, json_t *root) {
    int rc = 0;
    /* Sizes with no safe default are required; everything else defaults as in transformers. */
    rc |= get_int(c, sec, "", "vocab_size", REQUIRED, 1, &cfg->vocab_size);
    if (!rc) rc |= get_int(c, sec, "", "hidden_size", REQUIRED, 1, &cfg->hidden_size);
    if (!rc) rc |= get_int(c, sec, "", "num_hidden_layers", REQUIRED, 1, &cfg->num_hidden_layers);
    if (rc) return -1;
    if (cfg->num_hidden_layers > LUNAR_MAX_LAYERS) {
        char want[64];
        snprintf(want, sizeof want, "at most %d layers, found ", LUNAR_MAX_LAYERS);
        return fail_key(c, "", "num_hidden_layers", want, get(sec, "num_hidden_layers"));
    }
    if (get_int(c, sec, "", "intermediate_size", REQUIRED, 1, &cfg->intermediate_size) ||
        get_int(c, sec, "", "num_attention_heads", REQUIRED, 1, &cfg->num_attention_heads) ||
        get_num(c, sec, "", "rms_norm_eps", 1e-5, &cfg->rms_norm_eps) ||
        get_bool(c, sec, "tie_word_embeddings", 0, &cfg->tie_word_embeddings) ||
        get_token(c, sec, root, "bos_token_id", &cfg->bos_token_id) ||
        get_token(c, sec, root, "eos_token_id", &cfg->eos_token_id) ||
        get_token(c, sec, root, "pad_token_id", &cfg->pad_token_id))
        return -1;
    if (!(cfg->rms_norm_eps > 0)) return fail_key(c, "", "rms_norm_eps", "a positive number, found ", get(sec, "rms_norm_eps"));

    /* KDA */
    json_t *lac = get(sec, "linear_attn_config");
    if (lac && !json_is_object(lac)) return fail_key(c, "", "linear_attn_config", "an object, found ", lac);
    if (get_int(c, lac, "linear_attn_config.", "num_heads", 32, 1, &cfg->kda_num_heads) ||
        get_int(c, lac, "linear_attn_config.", "head_dim", 128, 1, &cfg->kda_head_dim) ||
        get_int(c, lac, "linear_attn_config.", "short_conv_kernel_size", 4, 1, &cfg->kda_conv_size) ||
        get_num(c, lac, "linear_attn_config.", "gate_lower_bound", 0, &cfg->kda_gate_lower_bound))
        return -1;
    if (cfg->kda_gate_lower_bound > 0)
        return fail_key(c, "linear_attn_config.", "gate_lower_bound", "a number <= 0, found ",
                        get(lac, "gate_lower_bound"));

    /* MLA. q_lora_rank null/absent = plain q_proj. */
    int kv_heads;
    if (get_int(c, sec, "", "q_lora_rank", 0, 0, &cfg->q_lora_rank) ||
        get_int(c, sec, "", "kv_lora_rank", 512, 1, &cfg->kv_lora_rank) ||
        get_int(c, sec, "", "qk_nope_head_dim", 128, 1, &cfg->qk_nope_head_dim) ||
        get_int(c, sec, "", "qk_rope_head_dim", 64, 0, &cfg->qk_rope_head_dim) ||
        get_int(c, sec, "", "v_head_dim", 128, 1, &cfg->v_head_dim) ||
        get_int(c, sec, "", "num_key_value_heads", cfg->num_attention_heads, 1, &kv_heads) ||
        get_bool(c, sec, "mla_use_nope", 1, &cfg->mla_use_nope)) /* transformers never rotates */
        return -1;
    if (kv_heads != cfg->num_attention_heads) /* MLA shares one latent across all heads: no GQA */
        return fail_key(c, "", "num_key_value_heads", "the same value as num_attention_heads (MLA), found ",
                        get(sec, "num_key_value_heads"));

    /* FFN / MoE */
    const char *k_experts = alias(sec, "num_experts", "num_local_experts");
    const char *k_topk = alias(sec, "num_experts_per_token", "num_experts_per_tok");
    const char *k_shared = alias(sec, "num_shared_experts", "n_shared_experts");
    const char *k_group = alias(sec, "num_expert_group", "n_group");
    const char *k_renorm = alias(sec, "moe_renormalize", "norm_topk_prob");
    if (get_int(c, sec, "", "first_k_dense_replace", 1, 0, &cfg->first_k_dense_replace) ||
        get_int(c, sec, "", "moe_layer_freq", 1, 1, &cfg->moe_layer_freq) ||
        get_int(c, sec, "", k_experts, 256, 0, &cfg->num_experts) ||
        get_int(c, sec, "", k_topk, 8, 1, &cfg->num_experts_per_token) ||
        get_int(c, sec, "", "moe_intermediate_size", 1024, 1, &cfg->moe_intermediate_size) ||
        get_int(c, sec, "", k_shared, 1, 0, &cfg->num_shared_experts) ||
        get_bool(c, sec, k_renorm, 1, &cfg->moe_renormalize) ||
        get_num(c, sec, "", "routed_scaling_factor", 2.446, &cfg->routed_scaling_factor) ||
        get_int(c, sec, "", k_group, 1, 1, &cfg->num_expert_group) ||
        get_int(c, sec, "", "topk_group", 1, 1, &cfg->topk_group))
        return -1;
    if (cfg->num_experts > 0) {
        char want[128];
        if (cfg->num_experts_per_token > cfg->num_experts) {
            snprintf(want, sizeof want, "at most %s = %d, found ", k_experts, cfg->num_experts);
            return fail_key(c, "", k_topk, want, get(sec, k_topk));
        }
        if (cfg->num_experts % cfg->num_expert_group != 0) {
            snprintf(want, sizeof want, "a divisor of %s = %d, found ", k_experts, cfg->num_experts);
            return fail_key(c, "", k_group, want, get(sec, k_group));
        }
        if (cfg->topk_group > cfg->num_expert_group) {
            snprintf(want, sizeof want, "at most %s = %d, found ", k_group, cfg->num_expert_group);
            return fail_key(c, "", "topk_group", want, get(sec, "topk_group"));
        }
        if (!(cfg->routed_scaling_factor > 0))
            return fail_key(c, "", "routed_scaling_factor", "a positive number, found ",
                            get(sec, "routed_scaling_factor"));
    }
    if (parse_k3_fields(cfg, c, sec, root, lac)) return -1;
    return parse_schedule(cfg, c, sec, lac);
}

int lunar_config_parse(lunar_config *cfg, const char *json, size_t len, const char *label, lunar_err *err) {
    memset(cfg, 0, sizeof *cfg);
    if (!label) label = "<config>";
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return lunar_fail(err, "%s: not valid JSON: %s (line %d)", label, je.text, je.line);
    ctx c = {label, "", err};
    int rc = -1;
    if (!json_is_object(root)) {
        lunar_fail(err, "%s: top level is not a JSON object", label);
        goto done;
    }
    json_t *mt = json_object_get(root, "model_type");
    if (!mt) {
        fail_missing(&c, "", "model_type");
        goto done;
    }
    const char *s = json_string_value(mt);
    if (s && strcmp(s, "kimi_linear") == 0) {
        cfg->arch = LUNAR_ARCH_KIMI_LINEAR;
    } else if (s && strcmp(s, "kimi_k3") == 0) {
        cfg->arch = LUNAR_ARCH_KIMI_K3;
    } else {
        fail_key(&c, "", "model_type", "\"kimi_linear\" or \"kimi_k3\", found ", mt);
        goto done;
    }
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", s);
    json_t *sec = root, *tc = get(root, "text_config");
    if (tc) {
        if (!json_is_object(tc)) {
            fail_key(&c, "", "text_config", "an object, found ", tc);
            goto done;
        }
        sec = tc;
        c.prefix = "text_config.";
    }
    rc = parse_fields(cfg, &c, sec, root);
done:
    json_decref(root);
    return rc;
}

int lunar_config_load(lunar_config *cfg, const char *path, lunar_err *err) {
    memset(cfg, 0, sizeof *cfg);
    FILE *f = fopen(path, "rb");
    if (!f) return lunar_fail(err, "%s: cannot open: %s", path, strerror(errno));
    char *buf = lunar_xmalloc(MAX_CONFIG_BYTES + 1);
    size_t n = fread(buf, 1, MAX_CONFIG_BYTES + 1, f);
    int bad = ferror(f);
    fclose(f);
    int rc;
    if (bad)
        rc = lunar_fail(err, "%s: read error", path);
    else if (n > MAX_CONFIG_BYTES)
        rc = lunar_fail(err, "%s: file larger than %u bytes", path, MAX_CONFIG_BYTES);
    else
        rc = lunar_config_parse(cfg, buf, n, path, err);
    free(buf);
    return rc;
}
