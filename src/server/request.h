/* OpenAI request bodies -> a validated request: sampling parameters for the engine, the prompt ids, and
 * what the response needs (stream, n, logprobs, usage accounting). No engine and no HTTP here: every
 * request error is found by lunar_srv_parse before anything is sent (HTTP 4xx, never mid-stream).
 *
 * Validation follows the OpenAI types (reference/api.md §5) and, for models with the sampling guard on
 * (kimi_k3), Moonshot's fixed parameters (reference/kvv.md §3): temperature in [0,1], top_p 0.95,
 * presence/frequency penalties 0, n 1. The chat renderer (text/prompt.h) validates messages, tools,
 * tool_choice, response_format and the thinking controls. */
#ifndef LUNAR_SERVER_REQUEST_H
#define LUNAR_SERVER_REQUEST_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "io/config.h"
#include "lunar.h"
#include "text/chat.h"
#include "text/sbuf.h"
#include "text/tokenizer.h"

/* An HTTP error answer: status, OpenAI error type, code, the offending parameter (or "") and a message. */
typedef struct lunar_api_error {
    int status;
    const char *type; /* "invalid_request_error" | "authentication_error" | "server_error" ... */
    const char *code; /* short machine code, or NULL */
    char param[128];
    char message[1024];
} lunar_api_error;

/* Fills e; returns -1. param may be NULL. */
int lunar_api_fail(lunar_api_error *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* {"error":{"message","type","param","code"}} */
char *lunar_api_error_json(const lunar_api_error *e);

/* What the server applies to every request of one model. */
typedef struct lunar_srv_policy {
    lunar_arch arch;
    const char *const *model_names; /* accepted "model" values; the first is reported. n 0: any */
    int n_model_names;
    int sampling_guard;   /* kvv.md §3 (on for kimi_k3 by default) */
    int max_model_len;    /* prompt + completion */
    int max_n;            /* largest n accepted (guard: 1) */
    int32_t vocab_size;
} lunar_srv_policy;

typedef enum { LUNAR_SRV_CHAT = 0, LUNAR_SRV_COMPLETION = 1 } lunar_srv_kind;

#define LUNAR_SRV_MAX_STOP 16

typedef struct lunar_srv_req {
    lunar_srv_kind kind;
    lunar_arch arch;       /* the model's chat format (output parser) */
    char model[256];       /* echoed in responses */
    int stream;
    int include_usage;     /* stream_options.include_usage (usage is sent at the end of every stream anyway) */
    int continuous_usage;  /* stream_options.continuous_usage_stats: accepted, ignored */
    int n;
    int logprobs;          /* chat: logprobs true; completions: logprobs >= 0 given */
    int top_logprobs;      /* chat: top_logprobs; completions: logprobs N */
    int echo;              /* completions */
    int skip_special_tokens; /* completions text (default 1) */
    lunar_sampling_params sampling; /* its pointers point into the arrays below */
    char *stop[LUNAR_SRV_MAX_STOP];
    int n_stop;
    int32_t *bias_ids;
    float *bias_values;
    int32_t *stop_ids;
    /* the prompt */
    int have_chat;
    lunar_chat_prompt chat; /* chat requests: the rendered prompt and its resolved options */
    lunar_ids ids;
    size_t prompt_tokens;   /* usage.prompt_tokens: ids - the renderer's stub (K3: 3) */
    char *prompt_text;      /* completions: the prompt string (for echo) */
    size_t prompt_text_len;
    int max_tokens_given;
} lunar_srv_req;

/* Fills p with the defaults of the header (without calling the engine). */
void lunar_srv_sampling_defaults(lunar_sampling_params *p);

/* Parses and validates a request body (JSON text, any bytes) of the given kind, renders and tokenizes the
 * prompt. 0 with *out filled (free with lunar_srv_req_free), or -1 with *e filled (out freed). */
int lunar_srv_parse(const lunar_srv_policy *pol, const lunar_tokenizer *tok, lunar_srv_kind kind,
                    const char *body, size_t len, lunar_srv_req *out, lunar_api_error *e);
void lunar_srv_req_free(lunar_srv_req *r);

/* JSON body (any bytes) -> object, or a 400. */
json_t *lunar_srv_parse_json(const char *body, size_t len, lunar_api_error *e);

#endif
