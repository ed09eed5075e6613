/* The OpenAI-compatible HTTP server (libmicrohttpd, a thread per connection):
 *   POST /v1/chat/completions, /v1/completions (stream or not), GET /v1/models, /health, /metrics,
 *   POST /tokenize, /detokenize (vLLM shapes). docs/api.md describes the surface.
 * Requests are validated (request.h) before anything is sent; generation goes through a backend
 * (backend.h: the engine, or a fake) and the events become response bytes (assemble.h). */
#ifndef LUNAR_SERVER_SERVER_H
#define LUNAR_SERVER_SERVER_H

#include <stddef.h>

#include "server/backend.h"
#include "server/request.h"

typedef struct lunar_server_options {
    const char *host;          /* numeric IPv4/IPv6 address or a name; NULL: 0.0.0.0 */
    int port;                  /* 0: any free port (see lunar_server_port) */
    const char *api_key;       /* NULL or "": no authentication */
    size_t max_body_bytes;     /* 413 beyond (default 32 MiB) */
    unsigned idle_timeout_s;   /* a connection idle this long is closed (default 120) */
    unsigned max_connections;  /* default 1024 */
    int max_pending;           /* generation requests in flight at once; 503 beyond (default 4096) */
    int quiet;                 /* no per-request log line */
    const char *model_root;    /* reported by /v1/models */
    lunar_srv_policy policy;
    const lunar_tokenizer *tok;
    int model_vocab_size;      /* the model's logits (0: unknown = the tokenizer's); constrained decoding is off
                                  when it is smaller than the tokenizer's vocabulary */
    lunar_srv_backend backend; /* owned by the server from start (destroyed by lunar_server_stop) */
} lunar_server_options;

void lunar_server_options_default(lunar_server_options *o);

typedef struct lunar_server lunar_server;

/* Starts listening; on failure the backend is destroyed too. */
int lunar_server_start(lunar_server **out, const lunar_server_options *o, lunar_err *err);
int lunar_server_port(const lunar_server *s);
/* Stops accepting, ends running requests (streams end, waiting answers get 503), destroys the backend. */
void lunar_server_stop(lunar_server *s);

#endif
