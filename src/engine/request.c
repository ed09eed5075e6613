#include "engine/request.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- validation */

int lunar_request_validate(const lunar_request *r, int vocab, int max_model_len, lunar_err *err) {
    const lunar_sampling_params *s = &r->sampling;
    if (!r->prompt || r->n_prompt <= 0) return lunar_fail(err, "prompt: empty");
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= vocab)
            return lunar_fail(err, "prompt: token %d at position %d is outside the vocabulary [0, %d)",
                              r->prompt[i], i, vocab);
    if (s->max_tokens < 1) return lunar_fail(err, "max_tokens: must be at least 1 (got %d)", s->max_tokens);
    if ((int64_t)r->n_prompt + s->max_tokens > max_model_len)
        return lunar_fail(err, "max_tokens: the prompt (%d tokens) plus max_tokens (%d) exceeds the "
                               "maximum context length of %d tokens", r->n_prompt, s->max_tokens, max_model_len);
    if (!(s->temperature >= 0 && s->temperature <= 100)) return lunar_fail(err, "temperature: must be in [0, 100]");
    if (!(s->top_p > 0 && s->top_p <= 1)) return lunar_fail(err, "top_p: must be in (0, 1]");
    if (!(s->min_p >= 0 && s->min_p <= 1)) return lunar_fail(err, "min_p: must be in [0, 1]");
    if (s->top_k < -1) return lunar_fail(err, "top_k: must be -1, 0 or positive");
    if (!(s->presence_penalty >= -2 && s->presence_penalty <= 2)) return lunar_fail(err, "presence_penalty: must be in [-2, 2]");
    if (!(s->frequency_penalty >= -2 && s->frequency_penalty <= 2)) return lunar_fail(err, "frequency_penalty: must be in [-2, 2]");
    if (!(s->repetition_penalty > 0 && s->repetition_penalty <= 10)) return lunar_fail(err, "repetition_penalty: must be in (0, 10]");
    if (s->min_tokens < 0 || s->min_tokens > s->max_tokens) return lunar_fail(err, "min_tokens: must be in [0, max_tokens]");
    if (s->top_logprobs < 0 || s->top_logprobs > LUNAR_MAX_TOP_LOGPROBS)
        return lunar_fail(err, "top_logprobs: must be in [0, %d]", LUNAR_MAX_TOP_LOGPROBS);
    for (int i = 0; i < s->n_stop_token_ids; i++)
        if (s->stop_token_ids[i] < 0 || s->stop_token_ids[i] >= vocab) return lunar_fail(err, "stop_token_ids[%d]: outside the vocabulary", i);
    for (int i = 0; i < s->n_logit_bias; i++) {
        if (s->logit_bias_ids[i] < 0 || s->logit_bias_ids[i] >= vocab) return lunar_fail(err, "logit_bias: token %d is outside the vocabulary", s->logit_bias_ids[i]);
        if (!(fabsf(s->logit_bias_values[i]) <= 100)) return lunar_fail(err, "logit_bias: values must be in [-100, 100]");
    }
    for (int i = 0; i < s->n_stop; i++)
        if (!s->stop[i] || !s->stop[i][0]) return lunar_fail(err, "stop[%d]: empty stop string", i);
    return 0;
}

/* ---------------------------------------------------------------- lifecycle */

static void *dup_bytes(const void *p, size_t n) {
    if (!n) return NULL;
    void *d = lunar_xmalloc(n);
    memcpy(d, p, n);
    return d;
}

request *lunar_request_new(const lunar_request *r, const lunar_tokenizer *tok) {
    request *q = lunar_xcalloc(1, sizeof *q);
    const lunar_sampling_params *s = &r->sampling;
    q->cap_tokens = r->n_prompt + s->max_tokens;
    q->tokens = lunar_xmalloc((size_t)q->cap_tokens * sizeof *q->tokens);
    memcpy(q->tokens, r->prompt, (size_t)r->n_prompt * sizeof *q->tokens);
    q->n_tokens = q->n_prompt = r->n_prompt;
    q->sp = *s;
    q->stop_ids = dup_bytes(s->stop_token_ids, (size_t)s->n_stop_token_ids * sizeof(int32_t));
    q->bias_ids = dup_bytes(s->logit_bias_ids, (size_t)s->n_logit_bias * sizeof(int32_t));
    q->bias_values = dup_bytes(s->logit_bias_values, (size_t)s->n_logit_bias * sizeof(float));
    q->stops = s->n_stop ? lunar_xcalloc((size_t)s->n_stop, sizeof *q->stops) : NULL;
    for (int i = 0; i < s->n_stop; i++) {
        q->stops[i] = strdup(s->stop[i]);
        int len = (int)strlen(s->stop[i]);
        if (len > q->max_stop_len) q->max_stop_len = len;
    }
    q->sp.stop_token_ids = q->stop_ids, q->sp.logit_bias_ids = q->bias_ids;
    q->sp.logit_bias_values = q->bias_values, q->sp.stop = (const char *const *)q->stops;
    /* unseeded requests still get distinct streams: the address and a clock-free counter */
    static uint64_t unseeded;
    lunar_rng_seed(&q->rng, s->has_seed ? s->seed : (uint64_t)(uintptr_t)q ^ (0x9e3779b97f4a7c15ULL * ++unseeded));
    if (r->grammar) q->matcher = lunar_matcher_new(r->grammar);
    if (tok && s->n_stop) {
        lunar_detok_init(&q->detok, tok, true);
        q->has_detok = 1;
    }
    q->slot = -1;
    q->on_event = r->on_event;
    q->user = r->user;
    return q;
}

void lunar_request_free(request *q) {
    if (!q) return;
    for (int i = 0; i < q->sp.n_stop; i++) free(q->stops[i]);
    free(q->stops), free(q->stop_ids), free(q->bias_ids), free(q->bias_values);
    free(q->tokens), free(q->blocks), free(q->hashes), free(q->text);
    if (q->matcher) lunar_matcher_free(q->matcher);
    free(q);
}

void lunar_request_add_block(request *q, int32_t block) {
    if (q->n_blocks == q->cap_blocks) {
        q->cap_blocks = q->cap_blocks ? 2 * q->cap_blocks : 8;
        q->blocks = realloc(q->blocks, (size_t)q->cap_blocks * sizeof *q->blocks);
        LUNAR_ASSERT(q->blocks);
    }
    q->blocks[q->n_blocks++] = block;
}

void lunar_request_add_hash(request *q, lunar_hash128 h) {
    if (q->n_hashes == q->cap_hashes) {
        q->cap_hashes = q->cap_hashes ? 2 * q->cap_hashes : 8;
        q->hashes = realloc(q->hashes, (size_t)q->cap_hashes * sizeof *q->hashes);
        LUNAR_ASSERT(q->hashes);
    }
    q->hashes[q->n_hashes++] = h;
}

/* ---------------------------------------------------------------- sampling */

static int is_in(int32_t t, const int32_t *v, int n) {
    for (int i = 0; i < n; i++)
        if (v[i] == t) return 1;
    return 0;
}

/* log-sum-exp of a row, for logprobs of the model's own distribution */
static double logsumexp(const float *x, int n) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double s = 0;
    for (int i = 0; i < n; i++) s += exp((double)x[i] - mx);
    return mx + log(s);
}

/* The n best of x (ties to the lower id), n <= LUNAR_MAX_TOP_LOGPROBS. */
static void top_n(const float *x, int V, int n, int32_t *ids) {
    for (int k = 0; k < n; k++) ids[k] = -1;
    for (int i = 0; i < V; i++) {
        int k = n;
        while (k > 0 && (ids[k - 1] < 0 || x[i] > x[ids[k - 1]])) k--;
        if (k == n) continue;
        memmove(ids + k + 1, ids + k, (size_t)(n - 1 - k) * sizeof *ids);
        ids[k] = i;
    }
}

/* Appends text of the new token; returns the matched stop string or NULL. */
static const char *check_stop_strings(request *q, int32_t token) {
    if (!q->has_detok) return NULL;
    char piece[LUNAR_DETOK_MAX_OUT];
    size_t n = lunar_detok_push(&q->detok, token, piece);
    if (!n) return NULL;
    if (q->text_len + n + 1 > q->text_cap) {
        q->text_cap = 2 * (q->text_len + n + 1);
        q->text = realloc(q->text, q->text_cap);
        LUNAR_ASSERT(q->text);
    }
    memcpy(q->text + q->text_len, piece, n);
    size_t from = q->text_len > (size_t)q->max_stop_len ? q->text_len - (size_t)q->max_stop_len : 0;
    q->text_len += n;
    q->text[q->text_len] = '\0';
    for (int i = 0; i < q->sp.n_stop; i++)
        if (strstr(q->text + from, q->stops[i])) return q->stops[i];
    return NULL;
}

lunar_finish_reason lunar_request_sample(request *q, float *lg, int V, const int32_t *end_ids, int n_end,
                                         void *scratch, uint32_t *mask, lunar_event *ev) {
    const lunar_sampling_params *s = &q->sp;
    const int n_gen = q->n_tokens - q->n_prompt;
    /* logprobs report the model's distribution before any processing (vLLM's raw_logprobs) */
    double lse = s->logprobs || s->top_logprobs ? logsumexp(lg, V) : 0;
    if (s->top_logprobs) {
        top_n(lg, V, s->top_logprobs, ev->top_ids);
        ev->n_top = s->top_logprobs;
        for (int k = 0; k < ev->n_top; k++) ev->top_logprobs[k] = (float)(lg[ev->top_ids[k]] - lse);
    }
    float *raw = s->logprobs ? dup_bytes(lg, (size_t)V * sizeof *lg) : NULL;

    for (int i = 0; i < s->n_logit_bias; i++) lg[s->logit_bias_ids[i]] += s->logit_bias_values[i];
    if (s->repetition_penalty != 1.0f || s->presence_penalty != 0 || s->frequency_penalty != 0) {
        /* seen[t]: bit 0 in the prompt or output (repetition), bit 1 in the output (presence) */
        uint8_t *seen = lunar_xcalloc((size_t)V, 1);
        for (int i = 0; i < q->n_tokens; i++) {
            int32_t t = q->tokens[i];
            if (s->repetition_penalty != 1.0f && !(seen[t] & 1))
                lg[t] = lg[t] > 0 ? lg[t] / s->repetition_penalty : lg[t] * s->repetition_penalty;
            if (i >= q->n_prompt) { /* OpenAI: frequency per occurrence, presence once */
                lg[t] -= s->frequency_penalty + (seen[t] & 2 ? 0 : s->presence_penalty);
                seen[t] |= 2;
            }
            seen[t] |= 1;
        }
        free(seen);
    }
    if (n_gen < s->min_tokens) { /* no stopping yet */
        for (int i = 0; i < n_end; i++) lg[end_ids[i]] = -INFINITY;
        for (int i = 0; i < s->n_stop_token_ids; i++) lg[s->stop_token_ids[i]] = -INFINITY;
    }
    if (q->matcher) {
        /* the budget: the output must still close into a complete value within max_tokens */
        if (lunar_matcher_fill_mask_budget(q->matcher, mask, (int64_t)s->max_tokens - n_gen)) q->budget_narrowed = 1;
        for (int i = 0; i < V; i++)
            if (!(mask[i >> 5] >> (i & 31) & 1)) lg[i] = -INFINITY;
    }
    if (s->min_p > 0 && s->temperature > 0) { /* drop tokens below min_p x the top probability */
        float mx = -INFINITY;
        for (int i = 0; i < V; i++) mx = lg[i] > mx ? lg[i] : mx;
        const float cut = mx + s->temperature * logf(s->min_p);
        for (int i = 0; i < V; i++)
            if (lg[i] < cut) lg[i] = -INFINITY;
    }
    lunar_sampling sp = {s->temperature, s->top_k > 0 ? s->top_k : 0, s->top_p, 0};
    int32_t tok = lunar_sample(lg, V, &sp, &q->rng, scratch);
    if (raw) ev->logprob = (float)(raw[tok] - lse);
    free(raw);
    return lunar_request_accept(q, tok, end_ids, n_end, ev);
}

int lunar_request_device_sampling(request *q, float *temperature, int *top_k, float *top_p, float *u) {
    const lunar_sampling_params *s = &q->sp;
    const int n_gen = q->n_tokens - q->n_prompt;
    if (s->logprobs || s->top_logprobs || s->n_logit_bias || s->repetition_penalty != 1.0f ||
        s->presence_penalty != 0 || s->frequency_penalty != 0 || n_gen < s->min_tokens || q->matcher ||
        (s->min_p > 0 && s->temperature > 0))
        return 0;
    *temperature = s->temperature, *top_k = s->top_k > 0 ? s->top_k : 0, *top_p = s->top_p;
    /* lunar_sample draws once unless it is greedy: the same stream either way */
    *u = s->temperature <= 0.0f || s->top_k == 1 ? 0.0f : lunar_rng_uniform(&q->rng);
    return 1;
}

lunar_finish_reason lunar_request_accept(request *q, int32_t tok, const int32_t *end_ids, int n_end,
                                         lunar_event *ev) {
    const lunar_sampling_params *s = &q->sp;
    const int n_gen = q->n_tokens - q->n_prompt;
    q->tokens[q->n_tokens++] = tok;
    ev->has_token = 1;
    ev->token = tok;
    if (q->matcher) lunar_matcher_accept(q->matcher, tok);

    /* an output the budget shaped ends as "length" even when complete: max_tokens cut it short */
    const lunar_finish_reason stop = q->budget_narrowed ? LUNAR_FINISH_LENGTH : LUNAR_FINISH_STOP;
    if (!s->ignore_eos && is_in(tok, end_ids, n_end) && n_gen + 1 > s->min_tokens) return stop;
    if (is_in(tok, q->stop_ids, s->n_stop_token_ids) && n_gen + 1 > s->min_tokens) return stop;
    const char *hit = check_stop_strings(q, tok);
    if (hit && n_gen + 1 >= s->min_tokens) {
        ev->stop_string = hit;
        return stop;
    }
    if (q->matcher && lunar_matcher_is_done(q->matcher)) return stop;
    if (n_gen + 1 >= s->max_tokens || q->n_tokens >= q->cap_tokens) return LUNAR_FINISH_LENGTH;
    return LUNAR_FINISH_NONE;
}

/* ---------------------------------------------------------------- lists */

static void grow(req_list *l) {
    if (l->n < l->cap) return;
    l->cap = l->cap ? 2 * l->cap : 16;
    l->v = realloc(l->v, (size_t)l->cap * sizeof *l->v);
    LUNAR_ASSERT(l->v);
}

void lunar_req_list_push(req_list *l, request *q) {
    grow(l);
    l->v[l->n++] = q;
}

void lunar_req_list_push_front(req_list *l, request *q) {
    grow(l);
    memmove(l->v + 1, l->v, (size_t)l->n * sizeof *l->v);
    l->v[0] = q;
    l->n++;
}

request *lunar_req_list_pop_front(req_list *l) {
    if (!l->n) return NULL;
    request *q = l->v[0];
    memmove(l->v, l->v + 1, (size_t)(l->n - 1) * sizeof *l->v);
    l->n--;
    return q;
}

void lunar_req_list_remove(req_list *l, request *q) {
    for (int i = 0; i < l->n; i++)
        if (l->v[i] == q) {
            memmove(l->v + i, l->v + i + 1, (size_t)(l->n - i - 1) * sizeof *l->v);
            l->n--;
            return;
        }
}

request *lunar_req_list_find(req_list *l, uint64_t id) {
    for (int i = 0; i < l->n; i++)
        if (l->v[i]->id == id) return l->v[i];
    return NULL;
}
