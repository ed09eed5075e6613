/* lunar: the narrow public C API.
 *
 * An engine owns a loaded model, its paged caches and a scheduler thread. Clients (the HTTP
 * server, the CLI, tests) submit requests of prompt token ids with sampling options and receive
 * the generated tokens through a callback as they are produced. Every call is thread-safe.
 *
 *   lunar_engine *e;  lunar_err err;
 *   lunar_engine_options o;  lunar_engine_options_default(&o);  o.model_dir = "models/x";
 *   if (lunar_engine_create(&e, &o, &err)) { puts(err.msg); ... }
 *   lunar_request r = {.prompt = ids, .n_prompt = n, .on_event = cb, .user = ctx};
 *   lunar_sampling_params_default(&r.sampling);  r.sampling.max_tokens = 64;
 *   uint64_t id;  lunar_engine_submit(e, &r, &id, &err);   ... events arrive on the engine thread ...
 *   lunar_engine_destroy(e);
 */
#ifndef LUNAR_H
#define LUNAR_H

#include <stddef.h>
#include <stdint.h>

#include "base/err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lunar_engine lunar_engine;
typedef struct lunar_grammar lunar_grammar; /* a compiled constraint (see engine/grammar.h) */

typedef struct lunar_engine_options {
    const char *model_dir;
    const char *backend;          /* "cpu" | "cuda" | "auto" (default) */
    int max_num_seqs;             /* running requests at once (default 64) */
    int max_num_batched_tokens;   /* tokens per step, prefill chunks included (default 2048) */
    int max_model_len;            /* prompt + output limit per request (default: 8192) */
    int64_t cache_memory_bytes;   /* bytes for the paged caches and the KDA state pool; 0 (default) =
                                     1 GiB on the CPU, all the CUDA arena leaves on the GPU */
    double gpu_memory_utilization; /* CUDA: share of device memory for weights + caches + steps (0.9) */
    const char *kv_cache_dtype;   /* "auto" (bf16 on GPU, fp32 on CPU) | "bf16" | "fp8" */
    int kda_state_fp16;           /* fp16 KDA recurrent state instead of fp32 */
    int enable_prefix_caching;    /* default 1 */
    int prefix_checkpoint_blocks; /* KDA state checkpoint every N blocks of 128 tokens (default 1) */
    const char *load_format;      /* NULL/"auto": the checkpoint in model_dir; "dummy": random weights of
                                     model_dir's config (a config.json or a directory holding one) */
    int num_layers;               /* > 0: only the first num_layers layers (benchmarks) */
    int tp_slice;                 /* > 1: the shapes one rank of TP tp_slice holds (benchmarks) */
    uint64_t dummy_seed;          /* load_format "dummy": the weights' seed */
    int ptpc_fp8;                 /* --quantization ptpc_fp8: the BF16 linears of SPEC 2 as PTPC-FP8 */
    /* CPU tensor parallelism: rank threads with shards of the model (docs/parallel.md); 0 or 1 = off */
    int tensor_parallel_size, decode_context_parallel_size, enable_expert_parallel;
    /* CUDA tensor parallelism: this process is rank 0 of `lunar serve`'s rank processes, linked to
     * the others (engine/engine_tp.h); NULL otherwise */
    const struct lunar_tp_link *tp_link;
} lunar_engine_options;

void lunar_engine_options_default(lunar_engine_options *o);

typedef struct lunar_sampling_params {
    float temperature;         /* 0 = greedy (default 1) */
    int top_k;                 /* <= 0 off */
    float top_p;               /* 1 off */
    float min_p;               /* 0 off */
    int has_seed;
    uint64_t seed;
    float presence_penalty, frequency_penalty; /* OpenAI semantics, over generated tokens */
    float repetition_penalty;                  /* 1 off; over prompt and generated tokens */
    int max_tokens;            /* generated-token limit (default 16) */
    int min_tokens;            /* stop tokens are masked until this many were generated */
    int ignore_eos;
    const int32_t *stop_token_ids; /* besides the model's end-of-turn tokens */
    int n_stop_token_ids;
    const char *const *stop;   /* stop strings, matched on the detokenized output */
    int n_stop;
    int logprobs;              /* report the chosen token's logprob */
    int top_logprobs;          /* and the N most likely (0..20) */
    const int32_t *logit_bias_ids; /* added to the logits before sampling */
    const float *logit_bias_values;
    int n_logit_bias;
} lunar_sampling_params;

void lunar_sampling_params_default(lunar_sampling_params *p);

typedef enum lunar_finish_reason {
    LUNAR_FINISH_NONE = 0,  /* not finished */
    LUNAR_FINISH_STOP,      /* a stop token or stop string */
    LUNAR_FINISH_LENGTH,    /* max_tokens or max_model_len */
    LUNAR_FINISH_ABORT,     /* cancelled */
    LUNAR_FINISH_ERROR,     /* see message */
} lunar_finish_reason;

#define LUNAR_MAX_TOP_LOGPROBS 20

typedef struct lunar_event {
    uint64_t request_id;
    int has_token;            /* a new token (else: only a finish or an error) */
    int32_t token;
    float logprob;            /* when logprobs was asked */
    int n_top;
    int32_t top_ids[LUNAR_MAX_TOP_LOGPROBS];
    float top_logprobs[LUNAR_MAX_TOP_LOGPROBS];
    lunar_finish_reason finish; /* != NONE on the last event of a request */
    const char *stop_string;    /* the stop string that matched, when finish == STOP by string */
    const char *message;        /* finish == ERROR */
    int prompt_tokens, completion_tokens, cached_tokens;
} lunar_event;

/* Called on the engine thread: copy what you need and return quickly. */
typedef void (*lunar_event_fn)(void *user, const lunar_event *ev);

typedef struct lunar_request {
    const int32_t *prompt; /* copied at submit */
    int n_prompt;
    lunar_sampling_params sampling; /* arrays and strings copied at submit */
    const lunar_grammar *grammar;   /* optional; must outlive the request */
    lunar_event_fn on_event;
    void *user;
} lunar_request;

int lunar_engine_create(lunar_engine **out, const lunar_engine_options *o, lunar_err *err);
/* Validates and queues a request; its events arrive on the engine thread. Errors (empty prompt,
 * prompt + max_tokens beyond max_model_len, bad sampling values) are returned here and no event
 * is sent. */
int lunar_engine_submit(lunar_engine *e, const lunar_request *r, uint64_t *id, lunar_err *err);
/* Ends a request early (client gone): it gets a final ABORT event; everything it held is freed.
 * Unknown or finished ids are ignored. */
void lunar_engine_cancel(lunar_engine *e, uint64_t id);

typedef struct lunar_engine_metrics {
    int running, waiting;
    int64_t requests_finished, prompt_tokens, generation_tokens, preemptions;
    int64_t prefix_cache_queries, prefix_cache_hits; /* in tokens */
    int kv_blocks_total, kv_blocks_used;
    int64_t steps;
} lunar_engine_metrics;

void lunar_engine_metrics_get(lunar_engine *e, lunar_engine_metrics *m);
const struct lunar_model *lunar_engine_model(const lunar_engine *e);
/* Stops the scheduler thread (pending requests get ABORT events) and frees everything. */
void lunar_engine_destroy(lunar_engine *e);

#ifdef __cplusplus
}
#endif

#endif
