#include "server/request.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/prompt.h"

int lunar_api_fail(lunar_api_error *e, int status, const char *param, const char *fmt, ...) {
    e->status = status;
    e->type = status == 401   ? "authentication_error"
              : status == 404 ? "invalid_request_error"
              : status >= 500 ? (status == 503 ? "server_overloaded" : "server_error")
                              : "invalid_request_error";
    e->code = status == 400   ? "invalid_request"
              : status == 401 ? "invalid_api_key"
              : status == 404 ? "not_found"
              : status == 405 ? "method_not_allowed"
              : status == 413 ? "request_too_large"
              : status == 503 ? "overloaded"
                              : "internal_error";
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

char *lunar_api_error_json(const lunar_api_error *e) {
    json_t *err = json_pack("{s:s, s:s, s:o, s:o}", "message", e->message, "type", e->type ? e->type : "server_error",
                            "param", e->param[0] ? json_string(e->param) : json_null(), "code",
                            e->code ? json_string(e->code) : json_null());
    if (!err) { /* a message that is not UTF-8 (cannot happen for our messages, but never crash) */
        err = json_pack("{s:s, s:s, s:n, s:n}", "message", "invalid request", "type", "invalid_request_error",
                        "param", "code");
    }
    json_t *root = json_pack("{s:o}", "error", err);
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

void lunar_srv_sampling_defaults(lunar_sampling_params *p) {
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->repetition_penalty = 1.0f;
    p->max_tokens = 16;
}

void lunar_srv_req_free(lunar_srv_req *r) {
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->bias_ids);
    free(r->bias_values);
    free(r->stop_ids);
    if (r->have_chat) lunar_chat_prompt_free(&r->chat);
    lunar_ids_free(&r->ids);
    free(r->prompt_text);
    memset(r, 0, sizeof *r);
}

json_t *lunar_srv_parse_json(const char *body, size_t len, lunar_api_error *e) {
    json_error_t je;
    if (len == 0) {
        lunar_api_fail(e, 400, NULL, "the request body is empty; expected a JSON object");
        return NULL;
    }
    json_t *v = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!v) {
        lunar_api_fail(e, 400, NULL, "the request body is not valid JSON: %s (line %d, column %d)", je.text, je.line,
                       je.column);
        return NULL;
    }
    if (!json_is_object(v)) {
        json_decref(v);
        lunar_api_fail(e, 400, NULL, "the request body must be a JSON object");
        return NULL;
    }
    return v;
}

/* ---- typed field access: absent and null are "not given" (0); a wrong type is a 400 (-1) ---- */

static const json_t *field(const json_t *o, const char *k) {
    const json_t *v = json_object_get(o, k);
    return v && !json_is_null(v) ? v : NULL;
}

static int get_bool(const json_t *o, const char *k, int *out, lunar_api_error *e) {
    const json_t *v = field(o, k);
    if (!v) return 0;
    if (!json_is_boolean(v)) return lunar_api_fail(e, 400, k, "%s: must be a boolean", k);
    *out = json_is_true(v);
    return 1;
}

static int get_num(const json_t *o, const char *k, double lo, double hi, double *out, lunar_api_error *e) {
    const json_t *v = field(o, k);
    if (!v) return 0;
    if (!json_is_number(v)) return lunar_api_fail(e, 400, k, "%s: must be a number", k);
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return lunar_api_fail(e, 400, k, "%s: %g is outside [%g, %g]", k, x, lo, hi);
    *out = x;
    return 1;
}

static int get_int(const json_t *o, const char *k, long long lo, long long hi, long long *out, lunar_api_error *e) {
    const json_t *v = field(o, k);
    if (!v) return 0;
    long long x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9e15) {
        x = (long long)json_real_value(v); /* 2.0 is an integer for Python clients */
    } else {
        return lunar_api_fail(e, 400, k, "%s: must be an integer", k);
    }
    if (x < lo || x > hi) return lunar_api_fail(e, 400, k, "%s: %lld is outside [%lld, %lld]", k, x, lo, hi);
    *out = x;
    return 1;
}

#define TRY(x)                                                                                                  \
    do {                                                                                                        \
        if ((x) < 0) return -1;                                                                                 \
    } while (0)

static int parse_stop(const json_t *body, lunar_srv_req *r, lunar_api_error *e) {
    const json_t *v = field(body, "stop");
    if (!v) return 0;
    if (json_is_string(v)) {
        if (json_string_length(v) == 0) return 0;
        r->stop[r->n_stop++] = strdup(json_string_value(v));
        return 0;
    }
    if (!json_is_array(v)) return lunar_api_fail(e, 400, "stop", "stop: must be a string or an array of strings");
    if (json_array_size(v) > LUNAR_SRV_MAX_STOP)
        return lunar_api_fail(e, 400, "stop", "stop: at most %d sequences", LUNAR_SRV_MAX_STOP);
    for (size_t i = 0; i < json_array_size(v); i++) {
        const json_t *s = json_array_get(v, i);
        if (!json_is_string(s)) return lunar_api_fail(e, 400, "stop", "stop[%zu]: must be a string", i);
        if (json_string_length(s) == 0) continue;
        if (strlen(json_string_value(s)) != json_string_length(s))
            return lunar_api_fail(e, 400, "stop", "stop[%zu]: must not contain NUL", i);
        r->stop[r->n_stop++] = strdup(json_string_value(s));
    }
    return 0;
}

static int parse_int_array(const json_t *v, const char *k, int32_t lo, int32_t hi, int32_t **out, int *n,
                           lunar_api_error *e) {
    if (!json_is_array(v)) return lunar_api_fail(e, 400, k, "%s: must be an array of integers", k);
    size_t m = json_array_size(v);
    int32_t *a = lunar_xmalloc((m ? m : 1) * sizeof *a);
    for (size_t i = 0; i < m; i++) {
        const json_t *x = json_array_get(v, i);
        if (!json_is_integer(x) || json_integer_value(x) < lo || json_integer_value(x) >= hi) {
            free(a);
            return lunar_api_fail(e, 400, k, "%s[%zu]: must be an integer in [%d, %d)", k, i, lo, hi);
        }
        a[i] = (int32_t)json_integer_value(x);
    }
    *out = a;
    *n = (int)m;
    return 0;
}

static int parse_logit_bias(const json_t *body, const lunar_srv_policy *pol, lunar_srv_req *r, lunar_api_error *e) {
    const json_t *v = field(body, "logit_bias");
    if (!v) return 0;
    if (!json_is_object(v)) return lunar_api_fail(e, 400, "logit_bias", "logit_bias: must be an object");
    size_t m = json_object_size(v);
    r->bias_ids = lunar_xmalloc((m ? m : 1) * sizeof *r->bias_ids);
    r->bias_values = lunar_xmalloc((m ? m : 1) * sizeof *r->bias_values);
    const char *key;
    const json_t *val;
    int n = 0;
    json_object_foreach((json_t *)v, key, val) {
        char *end;
        long id = strtol(key, &end, 10);
        if (!*key || *end || id < 0 || id >= pol->vocab_size)
            return lunar_api_fail(e, 400, "logit_bias", "logit_bias: key \"%.64s\" is not a token id in [0, %d)", key,
                                  pol->vocab_size);
        if (!json_is_number(val) || json_number_value(val) < -100 || json_number_value(val) > 100)
            return lunar_api_fail(e, 400, "logit_bias", "logit_bias[\"%s\"]: must be a number in [-100, 100]", key);
        r->bias_ids[n] = (int32_t)id;
        r->bias_values[n] = (float)json_number_value(val);
        n++;
    }
    r->sampling.logit_bias_ids = r->bias_ids;
    r->sampling.logit_bias_values = r->bias_values;
    r->sampling.n_logit_bias = n;
    return 0;
}

/* "messages[2].content: ..." -> param "messages[2].content" */
static void render_error(const lunar_err *err, lunar_api_error *e) {
    const char *colon = strstr(err->msg, ": ");
    char param[128] = "";
    if (colon && (size_t)(colon - err->msg) < sizeof param && !memchr(err->msg, ' ', (size_t)(colon - err->msg))) {
        memcpy(param, err->msg, (size_t)(colon - err->msg));
        param[colon - err->msg] = '\0';
    }
    lunar_api_fail(e, 400, param[0] ? param : NULL, "%s", err->msg);
}

/* The sampling fields common to both endpoints. */
static int parse_sampling(const json_t *b, const lunar_srv_policy *pol, lunar_srv_req *r, lunar_api_error *e) {
    lunar_sampling_params *sp = &r->sampling;
    double x;
    long long i;
    int t, f;
    int has_temp = 0, has_top_p = 0;
    TRY(f = get_num(b, "temperature", 0, 2, &x, e));
    if (f) sp->temperature = (float)x, has_temp = 1;
    double temp_given = f ? x : -1;
    TRY(f = get_num(b, "top_p", 0, 1, &x, e));
    if (f && x <= 0) return lunar_api_fail(e, 400, "top_p", "top_p: must be in (0, 1]");
    if (f) sp->top_p = (float)x, has_top_p = 1;
    double top_p_given = f ? x : -1;
    TRY(f = get_num(b, "presence_penalty", -2, 2, &x, e));
    if (f) sp->presence_penalty = (float)x;
    TRY(f = get_num(b, "frequency_penalty", -2, 2, &x, e));
    if (f) sp->frequency_penalty = (float)x;
    TRY(f = get_num(b, "repetition_penalty", 1e-6, 10, &x, e));
    if (f) sp->repetition_penalty = (float)x;
    TRY(f = get_int(b, "top_k", -1, 1 << 30, &i, e));
    if (f) sp->top_k = (int)i;
    TRY(f = get_num(b, "min_p", 0, 1, &x, e));
    if (f) sp->min_p = (float)x;
    TRY(f = get_int(b, "n", 1, 1 << 20, &i, e));
    r->n = f ? (int)i : 1;
    TRY(f = get_int(b, "seed", INT64_MIN, INT64_MAX, &i, e));
    if (f) sp->has_seed = 1, sp->seed = (uint64_t)i;
    TRY(f = get_bool(b, "ignore_eos", &t, e));
    if (f) sp->ignore_eos = t;
    TRY(f = get_int(b, "min_tokens", 0, 1 << 30, &i, e));
    if (f) sp->min_tokens = (int)i;
    TRY(get_bool(b, "stream", &r->stream, e));
    const json_t *so = field(b, "stream_options");
    if (so) {
        if (!json_is_object(so)) return lunar_api_fail(e, 400, "stream_options", "stream_options: must be an object");
        TRY(get_bool(so, "include_usage", &r->include_usage, e));
        TRY(get_bool(so, "continuous_usage_stats", &r->continuous_usage, e));
    }
    const json_t *u = field(b, "user");
    if (u && !json_is_string(u)) return lunar_api_fail(e, 400, "user", "user: must be a string");
    TRY(get_bool(b, "parallel_tool_calls", &t, e));
    TRY(parse_stop(b, r, e));
    r->sampling.stop = (const char *const *)r->stop;
    r->sampling.n_stop = r->n_stop;
    const json_t *sti = field(b, "stop_token_ids");
    if (sti) {
        TRY(parse_int_array(sti, "stop_token_ids", 0, pol->vocab_size, &r->stop_ids, &sp->n_stop_token_ids, e));
        sp->stop_token_ids = r->stop_ids;
    }
    TRY(parse_logit_bias(b, pol, r, e));

    if (pol->sampling_guard) { /* reference/kvv.md §3: Moonshot's fixed parameters */
        if (has_temp && !(temp_given >= 0 && temp_given <= 1))
            return lunar_api_fail(e, 400, "temperature", "temperature: this model accepts only values in [0, 1]");
        if (has_top_p && top_p_given != 0.95)
            return lunar_api_fail(e, 400, "top_p", "top_p: this model accepts only 0.95");
        if (sp->presence_penalty != 0)
            return lunar_api_fail(e, 400, "presence_penalty", "presence_penalty: this model accepts only 0");
        if (sp->frequency_penalty != 0)
            return lunar_api_fail(e, 400, "frequency_penalty", "frequency_penalty: this model accepts only 0");
        if (r->n != 1) return lunar_api_fail(e, 400, "n", "n: this model accepts only 1");
        if (!has_top_p) sp->top_p = 0.95f;
    }
    if (r->n > pol->max_n) return lunar_api_fail(e, 400, "n", "n: at most %d", pol->max_n);
    (void)has_temp;
    return 0;
}

static int check_model(const json_t *b, const lunar_srv_policy *pol, lunar_srv_req *r, lunar_api_error *e) {
    const json_t *m = field(b, "model");
    const char *dflt = pol->n_model_names ? pol->model_names[0] : "lunar";
    if (!m) {
        snprintf(r->model, sizeof r->model, "%s", dflt);
        return 0;
    }
    if (!json_is_string(m)) return lunar_api_fail(e, 400, "model", "model: must be a string");
    const char *s = json_string_value(m);
    if (pol->n_model_names == 0) {
        snprintf(r->model, sizeof r->model, "%s", s);
        return 0;
    }
    for (int i = 0; i < pol->n_model_names; i++)
        if (strcmp(s, pol->model_names[i]) == 0) {
            snprintf(r->model, sizeof r->model, "%s", s);
            return 0;
        }
    lunar_api_fail(e, 404, "model", "The model `%.200s` does not exist.", s);
    e->code = "model_not_found";
    return -1;
}

static int parse_max_tokens(const json_t *b, lunar_srv_req *r, lunar_api_error *e) {
    long long i;
    int f;
    TRY(f = get_int(b, "max_tokens", 1, 1 << 30, &i, e));
    if (f) r->sampling.max_tokens = (int)i, r->max_tokens_given = 1;
    if (r->kind == LUNAR_SRV_CHAT) {
        TRY(f = get_int(b, "max_completion_tokens", 1, 1 << 30, &i, e));
        if (f) r->sampling.max_tokens = (int)i, r->max_tokens_given = 1;
    }
    return 0;
}

static int parse_chat(const json_t *b, const lunar_srv_policy *pol, const lunar_tokenizer *tok, lunar_srv_req *r,
                      lunar_api_error *e) {
    int lp = 0, f;
    long long i;
    TRY(get_bool(b, "logprobs", &lp, e));
    TRY(f = get_int(b, "top_logprobs", 0, LUNAR_MAX_TOP_LOGPROBS, &i, e));
    if (f && !lp) return lunar_api_fail(e, 400, "top_logprobs", "top_logprobs: needs logprobs: true");
    r->logprobs = lp;
    r->top_logprobs = f ? (int)i : 0;
    const json_t *msgs = json_object_get(b, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return lunar_api_fail(e, 400, "messages", "messages: must be a non-empty array");
    lunar_err err;
    r->have_chat = 1;
    if (lunar_chat_render(pol->arch, b, &r->chat, &err)) {
        render_error(&err, e);
        return -1;
    }
    if (lunar_prompt_ids(tok, &r->chat, &r->ids, &err)) {
        render_error(&err, e);
        return -1;
    }
    r->prompt_tokens = r->ids.n >= r->chat.stub_tokens ? r->ids.n - r->chat.stub_tokens : 0;
    if (pol->sampling_guard && !field(b, "temperature")) r->sampling.temperature = r->chat.thinking ? 1.0f : 0.6f;
    return 0;
}

static int parse_completion(const json_t *b, const lunar_srv_policy *pol, const lunar_tokenizer *tok,
                            lunar_srv_req *r, lunar_api_error *e) {
    long long i;
    int f;
    TRY(f = get_int(b, "logprobs", 0, LUNAR_MAX_TOP_LOGPROBS, &i, e));
    if (f) r->logprobs = 1, r->top_logprobs = (int)i;
    TRY(get_bool(b, "echo", &r->echo, e));
    if (r->echo && r->logprobs)
        return lunar_api_fail(e, 400, "echo", "echo: prompt logprobs are not supported (echo with logprobs)");
    if (field(b, "suffix")) return lunar_api_fail(e, 400, "suffix", "suffix: not supported");
    TRY(f = get_int(b, "best_of", 1, 1 << 20, &i, e));
    if (f && i != r->n) return lunar_api_fail(e, 400, "best_of", "best_of: only best_of == n is supported");
    const json_t *p = json_object_get(b, "prompt");
    if (json_is_array(p) && json_array_size(p) == 1 &&
        (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
        p = json_array_get(p, 0); /* a batch of one */
    lunar_err err;
    if (json_is_string(p)) {
        if (json_string_length(p) == 0) return lunar_api_fail(e, 400, "prompt", "prompt: must not be empty");
        if (lunar_tokenize(tok, json_string_value(p), json_string_length(p), true, &r->ids, &err))
            return lunar_api_fail(e, 400, "prompt", "prompt: %s", err.msg);
        r->prompt_text = lunar_xmalloc(json_string_length(p) + 1);
        memcpy(r->prompt_text, json_string_value(p), json_string_length(p) + 1);
        r->prompt_text_len = json_string_length(p);
    } else if (json_is_array(p) && json_array_size(p) > 0 && json_is_integer(json_array_get(p, 0))) {
        int32_t *ids;
        int n;
        TRY(parse_int_array(p, "prompt", 0, pol->vocab_size, &ids, &n, e));
        for (int k = 0; k < n; k++) lunar_ids_push(&r->ids, ids[k]);
        free(ids);
        if (r->echo) r->prompt_text = lunar_detokenize(tok, r->ids.ids, r->ids.n, false, &r->prompt_text_len);
    } else if (json_is_array(p) && json_array_size(p) > 1) {
        return lunar_api_fail(e, 400, "prompt", "prompt: batched prompts are not supported; send one request each");
    } else {
        return lunar_api_fail(e, 400, "prompt", "prompt: must be a non-empty string or an array of token ids");
    }
    r->prompt_tokens = r->ids.n;
    TRY(get_bool(b, "skip_special_tokens", &r->skip_special_tokens, e));
    return 0;
}

int lunar_srv_parse(const lunar_srv_policy *pol, const lunar_tokenizer *tok, lunar_srv_kind kind, const char *body,
                    size_t len, lunar_srv_req *r, lunar_api_error *e) {
    memset(r, 0, sizeof *r);
    memset(e, 0, sizeof *e);
    r->kind = kind;
    r->arch = pol->arch;
    r->skip_special_tokens = 1;
    lunar_srv_sampling_defaults(&r->sampling);
    json_t *b = lunar_srv_parse_json(body, len, e);
    if (!b) return -1;
    int rc = -1;
    if (check_model(b, pol, r, e) || parse_sampling(b, pol, r, e) || parse_max_tokens(b, r, e)) goto done;
    if (kind == LUNAR_SRV_CHAT ? parse_chat(b, pol, tok, r, e) : parse_completion(b, pol, tok, r, e)) goto done;
    if (r->ids.n == 0) {
        lunar_api_fail(e, 400, kind == LUNAR_SRV_CHAT ? "messages" : "prompt", "the prompt is empty");
        goto done;
    }
    long long room = (long long)pol->max_model_len - (long long)r->ids.n;
    if (room < 1) {
        lunar_api_fail(e, 400, kind == LUNAR_SRV_CHAT ? "messages" : "prompt",
                       "This model's maximum context length is %d tokens. However, your prompt has %zu tokens.",
                       pol->max_model_len, r->ids.n);
        goto done;
    }
    if (!r->max_tokens_given) {
        r->sampling.max_tokens = (int)room;
    } else if (r->sampling.max_tokens > room) {
        lunar_api_fail(e, 400, r->kind == LUNAR_SRV_CHAT && field(b, "max_completion_tokens") ? "max_completion_tokens"
                                                                                             : "max_tokens",
                       "This model's maximum context length is %d tokens. However, you requested %lld tokens (%zu in "
                       "the prompt, %d for the completion).",
                       pol->max_model_len, (long long)r->ids.n + r->sampling.max_tokens, r->ids.n,
                       r->sampling.max_tokens);
        goto done;
    }
    if (r->sampling.min_tokens > r->sampling.max_tokens) {
        lunar_api_fail(e, 400, "min_tokens", "min_tokens: must not exceed max_tokens");
        goto done;
    }
    rc = 0;
done:
    json_decref(b);
    if (rc) lunar_srv_req_free(r);
    return rc;
}
