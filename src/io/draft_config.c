#include "io/draft_config.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REQUIRED INT_MIN

static json_t *get(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return json_is_null(v) ? NULL : v;
}

static int fail_key(const char *label, const char *key, const char *want, json_t *found, lunar_err *err) {
    char *s = found ? json_dumps(found, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
    lunar_fail(err, "%s: key '%s': %s%.80s", label, key, want, found ? (s ? s : "?") : "");
    free(s);
    return -1;
}

static int get_int(const char *label, json_t *o, const char *key, int def, int min, int *out, lunar_err *err) {
    json_t *v = get(o, key);
    if (!v) {
        if (def == REQUIRED) return fail_key(label, key, "missing required key", NULL, err);
        *out = def;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < min || json_integer_value(v) > INT_MAX)
        return fail_key(label, key, min > 0 ? "expected a positive integer, found " : "expected a non-negative integer, found ", v, err);
    *out = (int)json_integer_value(v);
    return 0;
}

static json_t *load_json(const char *path, lunar_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        lunar_fail(err, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    json_error_t je;
    json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &je);
    fclose(f);
    if (!root) lunar_fail(err, "%s: not valid JSON: %s (line %d)", path, je.text, je.line);
    return root;
}

int lunar_draft_config_sniff(const char *path, lunar_err *err) {
    json_t *root = load_json(path, err);
    if (!root) return -1;
    int is = json_is_object(root) && json_object_get(root, "target_layer_ids") != NULL;
    json_decref(root);
    return is;
}

static int parse_root(lunar_draft_config *d, json_t *r, const char *label, lunar_err *err) {
    if (!json_is_object(r)) return lunar_fail(err, "%s: top level is not a JSON object", label);
    if (get_int(label, r, "hidden_size", REQUIRED, 1, &d->hidden_size, err) ||
        get_int(label, r, "intermediate_size", REQUIRED, 1, &d->intermediate_size, err) ||
        get_int(label, r, "num_hidden_layers", REQUIRED, 1, &d->num_hidden_layers, err) ||
        get_int(label, r, "vocab_size", REQUIRED, 1, &d->vocab_size, err) ||
        get_int(label, r, "num_attention_heads", REQUIRED, 1, &d->num_attention_heads, err) ||
        get_int(label, r, "q_lora_rank", REQUIRED, 1, &d->q_lora_rank, err) ||
        get_int(label, r, "kv_lora_rank", REQUIRED, 1, &d->kv_lora_rank, err) ||
        get_int(label, r, "qk_nope_head_dim", 128, 1, &d->qk_nope_head_dim, err) ||
        get_int(label, r, "qk_rope_head_dim", 64, 0, &d->qk_rope_head_dim, err) ||
        get_int(label, r, "v_head_dim", 128, 1, &d->v_head_dim, err) ||
        get_int(label, r, "target_hidden_size", d->hidden_size, 1, &d->target_hidden_size, err) ||
        get_int(label, r, "target_num_hidden_layers", 0, 0, &d->target_num_hidden_layers, err) ||
        get_int(label, r, "mask_token_id", REQUIRED, 0, &d->mask_token_id, err) ||
        get_int(label, r, "markov_rank", 0, 0, &d->markov_rank, err) ||
        get_int(label, r, "block_size", 7, 1, &d->block_size, err))
        return -1;
    json_t *eps = get(r, "rms_norm_eps");
    d->rms_norm_eps = 1e-5f;
    if (eps) {
        if (!json_is_number(eps) || !(json_number_value(eps) > 0) || !isfinite(json_number_value(eps)))
            return fail_key(label, "rms_norm_eps", "expected a positive number, found ", eps, err);
        d->rms_norm_eps = (float)json_number_value(eps);
    }
    if (d->mask_token_id >= d->vocab_size)
        return fail_key(label, "mask_token_id", "expected an id below vocab_size, found ", get(r, "mask_token_id"), err);

    json_t *ids = get(r, "target_layer_ids");
    if (!ids) return fail_key(label, "target_layer_ids", "missing required key", NULL, err);
    if (!json_is_array(ids) || json_array_size(ids) == 0 || json_array_size(ids) > LUNAR_DRAFT_MAX_TAPS)
        return fail_key(label, "target_layer_ids", "expected a list of 1..16 layer ids, found ", ids, err);
    d->n_taps = (int)json_array_size(ids);
    for (int i = 0; i < d->n_taps; i++) {
        json_t *v = json_array_get(ids, (size_t)i);
        long long x = json_is_integer(v) ? json_integer_value(v) : LLONG_MIN;
        int bad = x < -1 || x > INT_MAX || (i > 0 && x <= d->target_layer_ids[i - 1]) ||
                  (d->target_num_hidden_layers && x >= d->target_num_hidden_layers);
        if (bad)
            return fail_key(label, "target_layer_ids",
                            "expected strictly increasing ids in [-1, target_num_hidden_layers), found ", ids, err);
        d->target_layer_ids[i] = (int)x;
    }
    int n_target;
    if (get_int(label, r, "num_target_layers", d->n_taps, 1, &n_target, err)) return -1;
    if (n_target != d->n_taps)
        return fail_key(label, "num_target_layers", "expected the length of target_layer_ids, found ",
                        get(r, "num_target_layers"), err);

    json_t *mt = get(r, "markov_head_type");
    snprintf(d->markov_head_type, sizeof d->markov_head_type, "vanilla");
    if (mt) {
        if (!json_is_string(mt) || strcmp(json_string_value(mt), "vanilla") != 0)
            return fail_key(label, "markov_head_type",
                            "expected \"vanilla\" (the only Markov head with a known layout), found ", mt, err);
    }
    return 0;
}

int lunar_draft_config_parse(lunar_draft_config *d, const char *json, size_t len, const char *label,
                             lunar_err *err) {
    memset(d, 0, sizeof *d);
    if (!label) label = "<draft config>";
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return lunar_fail(err, "%s: not valid JSON: %s (line %d)", label, je.text, je.line);
    int rc = parse_root(d, root, label, err);
    json_decref(root);
    return rc;
}

int lunar_draft_config_load(lunar_draft_config *d, const char *path, lunar_err *err) {
    memset(d, 0, sizeof *d);
    json_t *root = load_json(path, err);
    if (!root) return -1;
    int rc = parse_root(d, root, path, err);
    json_decref(root);
    return rc;
}
