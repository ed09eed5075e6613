/* One request inside the engine: its tokens (prompt + generated), how far its caches go, what it
 * holds in them, its sampling state; and the small lists the scheduler keeps requests in. */
#ifndef LUNAR_ENGINE_REQUEST_H
#define LUNAR_ENGINE_REQUEST_H

#include <stdint.h>

#include "engine/grammar.h"
#include "engine/prefix_cache.h"
#include "engine/sampler.h"
#include "lunar.h"
#include "text/tokenizer.h"

typedef struct request {
    uint64_t id;
    int32_t *tokens; /* prompt then generated */
    int n_tokens, cap_tokens;
    int n_prompt;
    int n_computed;  /* tokens whose cache entries (latent rows, KDA state) are written */
    int cached_tokens;

    lunar_sampling_params sp; /* arrays and strings below are our own copies */
    int32_t *stop_ids;
    char **stops;
    int max_stop_len;
    int32_t *bias_ids;
    float *bias_values;
    lunar_rng rng;
    lunar_matcher *matcher; /* NULL without a grammar */
    int budget_narrowed;    /* the token budget removed a token the grammar allowed: finishes as length */

    int32_t *blocks; /* block table */
    int n_blocks, cap_blocks;
    lunar_hash128 *hashes; /* chain hashes of its full blocks published so far */
    int n_hashes, cap_hashes;
    int slot;        /* KDA state slot while running, else -1 */

    lunar_detok detok; /* stop strings: the generated text so far */
    int has_detok;
    char *text;
    size_t text_len, text_cap;

    lunar_event_fn on_event;
    void *user;
} request;

/* Checks a submission (ids in the vocabulary, lengths, sampling ranges); errors name the field. */
int lunar_request_validate(const lunar_request *r, int vocab, int max_model_len, lunar_err *err);
/* Copies everything the request needs; tok (may be NULL) detokenizes for stop strings. */
request *lunar_request_new(const lunar_request *r, const lunar_tokenizer *tok);
void lunar_request_free(request *q);
void lunar_request_add_block(request *q, int32_t block);
void lunar_request_add_hash(request *q, lunar_hash128 h);

/* Samples the next token from the request's logits row (modified in place): logit bias,
 * penalties, min_tokens, grammar, then temperature / top-k / top-p / min-p and a draw from the
 * request's own random stream. Appends the token, fills ev (token, logprobs) and returns why the
 * request is finished (NONE to continue). end_ids: the model's end-of-turn tokens. */
lunar_finish_reason lunar_request_sample(request *q, float *logits, int vocab, const int32_t *end_ids,
                                         int n_end, void *scratch, uint32_t *mask, lunar_event *ev);

/* Device sampling (the CUDA backend samples in place, logits stay on the device): whether q's next
 * token depends on nothing but temperature / top-k / top-p and its random stream (no logprobs,
 * logit bias, penalties, pending min_tokens, grammar or min-p). If so, returns 1 with the settings
 * and the draw u of lunar_sample taken from q's stream now (none for greedy, as lunar_sample). */
int lunar_request_device_sampling(request *q, float *temperature, int *top_k, float *top_p, float *u);
/* The part of lunar_request_sample after the draw: appends tok, fills ev, returns why q ends. */
lunar_finish_reason lunar_request_accept(request *q, int32_t tok, const int32_t *end_ids, int n_end,
                                         lunar_event *ev);

/* A small array-backed list (order matters: admission order, FIFO). */
typedef struct req_list {
    request **v;
    int n, cap;
} req_list;

void lunar_req_list_push(req_list *l, request *q);
void lunar_req_list_push_front(req_list *l, request *q);
request *lunar_req_list_pop_front(req_list *l);
void lunar_req_list_remove(req_list *l, request *q);
request *lunar_req_list_find(req_list *l, uint64_t id);

#endif
