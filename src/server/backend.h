/* What the server needs from an engine: the calls of include/lunar.h behind a table of functions, so the
 * HTTP layer runs (and is tested) with a scripted fake before and besides the real engine.
 *   backend_engine.c    the real engine (compiled only when src/engine/engine.c exists; see the Makefile)
 *   backend_noengine.c  its stand-in in builds without the engine: creating it fails with a message
 *   backend_fake.c      a scripted generator on its own thread (tests, `lunar serve --fake-engine`)
 * Semantics are lunar.h's: submit copies the request; events arrive on the backend's thread, the last one of
 * a request has finish != NONE (cancel gives ABORT); destroy aborts what is pending. */
#ifndef LUNAR_SERVER_BACKEND_H
#define LUNAR_SERVER_BACKEND_H

#include "lunar.h"

typedef struct lunar_srv_backend {
    void *ctx;
    int (*submit)(void *ctx, const lunar_request *r, uint64_t *id, lunar_err *err);
    void (*cancel)(void *ctx, uint64_t id);
    void (*metrics)(void *ctx, lunar_engine_metrics *m); /* NULL: none */
    void (*destroy)(void *ctx);
} lunar_srv_backend;

/* The real engine (lunar_engine_create with o). */
int lunar_srv_backend_engine(lunar_srv_backend *b, const lunar_engine_options *o, lunar_err *err);
/* Whether this build has the engine (else lunar_srv_backend_engine always fails). */
int lunar_srv_have_engine(void);
/* Fills o with lunar_engine_options_default, or this file's copy of the header's defaults without the engine. */
void lunar_srv_engine_options_default(lunar_engine_options *o);

/* The fake: every request generates script[0..n) (cycled) up to max_tokens, one token each
 * token_delay_us, then finishes STOP (script exhausted and stop_at_end) or LENGTH. Logprobs are made up
 * (-0.5, top ids script-order). A request whose max_tokens is exactly 7777 fails with an ERROR event
 * after its first token (tests). */
typedef struct lunar_srv_fake_options {
    const int32_t *script;
    int n_script;
    int stop_at_end;
    int token_delay_us;
    int max_running; /* reported as running; the rest waiting (metrics only) */
} lunar_srv_fake_options;
int lunar_srv_backend_fake(lunar_srv_backend *b, const lunar_srv_fake_options *o, lunar_err *err);

#endif
