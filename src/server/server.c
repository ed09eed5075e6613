#include "server/server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>

#include "server/assemble.h"
#include "server/constrain.h"
#include "server/metrics.h"
#include "text/prompt.h"

#if MHD_VERSION < 0x00097002
typedef int MHD_RESULT_T;
#else
typedef enum MHD_Result MHD_RESULT_T;
#endif

struct lunar_server {
    lunar_server_options o;
    struct MHD_Daemon *d;
    lunar_srv_metrics *metrics;
    lunar_constrain *constrain; /* the vocabulary index and the compiled grammars (NULL: no constraints) */
    atomic_int stopping;
    atomic_int pending;
    int port;
};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static void random_hex(char *out, int n) {
    unsigned char b[32];
    if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b)
        for (size_t i = 0; i < sizeof b; i++) b[i] = (unsigned char)rand();
    for (int i = 0; i < n && i < 64; i++) out[i] = "0123456789abcdef"[(b[i / 2] >> (i % 2 ? 0 : 4)) & 15];
    out[n] = '\0';
}

void lunar_server_options_default(lunar_server_options *o) {
    memset(o, 0, sizeof *o);
    o->max_body_bytes = 32u << 20;
    o->idle_timeout_s = 120;
    o->max_connections = 1024;
    o->max_pending = 4096;
    o->policy.max_model_len = 8192;
    o->policy.max_n = 16;
}

/* ---- one HTTP connection's request ---- */

typedef struct conn {
    char method[8];
    char url[256];
    lunar_sbuf body;
    int too_large;
    int fd;
    double t0;
} conn;

static int client_gone(int fd) {
    if (fd < 0) return 0;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

static MHD_RESULT_T send_body(struct MHD_Connection *c, lunar_server *s, int status, const char *ctype, char *body) {
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    MHD_add_response_header(r, "Content-Type", ctype);
    MHD_RESULT_T ok = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    lunar_srv_metrics_http(s->metrics, status);
    return ok;
}

static MHD_RESULT_T send_json(struct MHD_Connection *c, lunar_server *s, int status, json_t *v) {
    char *t = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    return send_body(c, s, status, "application/json", t ? t : strdup("{}"));
}

static MHD_RESULT_T send_error(struct MHD_Connection *c, lunar_server *s, conn *cn, const lunar_api_error *e) {
    if (!s->o.quiet)
        fprintf(stderr, "lunar serve: %s %s %d %s\n", cn ? cn->method : "-", cn ? cn->url : "-", e->status,
                e->message);
    MHD_RESULT_T ok = send_body(c, s, e->status, "application/json", lunar_api_error_json(e));
    return ok;
}

/* ---- generation requests ---- */

typedef struct qev {
    int choice;
    lunar_event ev;
    char msg[256];
} qev;

typedef struct gen gen;
typedef struct cbctx {
    gen *g;
    int choice;
} cbctx;

struct gen {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    lunar_server *srv;
    lunar_srv_req req;
    lunar_srv_resp *rs;
    cbctx *cbs;
    uint64_t *ids;
    int *live; /* engine request still running */
    int n;
    qev *q;
    size_t nq, capq;
    lunar_sbuf out;
    size_t out_off;
    int end_written, gone, logged;
    int fd;
    char id[80];
    char url[256];
    double t0, t_first, t_last;
};

static void gen_unref(gen *g) {
    pthread_mutex_lock(&g->mu);
    int left = --g->refs;
    pthread_mutex_unlock(&g->mu);
    if (left > 0) return;
    lunar_srv_resp_free(g->rs);
    lunar_srv_req_free(&g->req);
    lunar_sbuf_free(&g->out);
    free(g->q);
    free(g->cbs);
    free(g->ids);
    free(g->live);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g);
}

/* Engine thread: copy and signal. */
static void on_event(void *user, const lunar_event *ev) {
    cbctx *cb = user;
    gen *g = cb->g;
    double t = now_s();
    pthread_mutex_lock(&g->mu);
    if (g->nq == g->capq) {
        g->capq = g->capq ? 2 * g->capq : 16;
        g->q = realloc(g->q, g->capq * sizeof *g->q);
        LUNAR_ASSERT(g->q);
    }
    qev *e = &g->q[g->nq++];
    e->choice = cb->choice;
    e->ev = *ev;
    e->ev.stop_string = NULL;
    e->msg[0] = '\0';
    if (ev->message) snprintf(e->msg, sizeof e->msg, "%s", ev->message);
    e->ev.message = NULL;
    if (ev->has_token) {
        if (g->t_first == 0) g->t_first = t;
        else lunar_srv_metrics_itl(g->srv->metrics, t - g->t_last);
        g->t_last = t;
    }
    int last = ev->finish != LUNAR_FINISH_NONE;
    if (last) g->live[cb->choice] = 0;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    if (last) gen_unref(g);
}

static void cancel_live(gen *g) {
    const lunar_srv_backend *b = &g->srv->o.backend;
    for (int i = 0; i < g->n; i++) {
        pthread_mutex_lock(&g->mu);
        int live = g->live[i];
        uint64_t id = g->ids[i];
        pthread_mutex_unlock(&g->mu);
        if (live) b->cancel(b->ctx, id);
    }
}

/* Connection thread: runs queued events through the assembler. */
static void pump(gen *g) {
    pthread_mutex_lock(&g->mu);
    qev *q = g->q;
    size_t n = g->nq;
    g->q = NULL;
    g->nq = g->capq = 0;
    pthread_mutex_unlock(&g->mu);
    for (size_t i = 0; i < n; i++) {
        if (q[i].msg[0]) q[i].ev.message = q[i].msg;
        int fin = lunar_srv_resp_event(g->rs, q[i].choice, &q[i].ev, g->req.stream ? &g->out : NULL);
        if (fin && q[i].ev.finish == LUNAR_FINISH_NONE) { /* a stop string: end the engine request */
            const lunar_srv_backend *b = &g->srv->o.backend;
            pthread_mutex_lock(&g->mu);
            int live = g->live[q[i].choice];
            uint64_t id = g->ids[q[i].choice];
            pthread_mutex_unlock(&g->mu);
            if (live) b->cancel(b->ctx, id);
        }
    }
    free(q);
}

static void wait_events(gen *g, int ms) {
    pthread_mutex_lock(&g->mu);
    if (g->nq == 0) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += (long)ms * 1000000L;
        t.tv_sec += t.tv_nsec / 1000000000L;
        t.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&g->cv, &g->mu, &t);
    }
    pthread_mutex_unlock(&g->mu);
}

static void log_gen(gen *g, int status) {
    lunar_server *s = g->srv;
    if (g->logged) return;
    g->logged = 1;
    double t = now_s();
    double ttft = g->t_first > 0 ? g->t_first - g->t0 : -1;
    int ct = lunar_srv_resp_completion_tokens(g->rs);
    lunar_api_error e;
    const char *fr = g->gone ? "abort"
                     : lunar_srv_resp_error(g->rs, &e)
                         ? (e.status == 500 ? "error" : "abort")
                         : lunar_srv_resp_finish_reason(g->rs, 0);
    lunar_srv_metrics_request(s->metrics, fr ? fr : "abort", (int)g->req.prompt_tokens, ct, ttft, t - g->t0);
    if (!s->o.quiet)
        fprintf(stderr, "lunar serve: %s %s %d%s prompt_tokens=%zu completion_tokens=%d ttft=%.3fs total=%.3fs finish=%s\n",
                g->id, g->url, status, g->gone ? " (client gone)" : "", g->req.prompt_tokens, ct, ttft < 0 ? 0 : ttft,
                t - g->t0, fr ? fr : "-");
}

/* MHD stream reader (connection thread; may block in thread-per-connection mode). */
static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    gen *g = cls;
    for (;;) {
        if (g->out_off < g->out.len) {
            size_t k = g->out.len - g->out_off;
            if (k > max) k = max;
            memcpy(buf, g->out.p + g->out_off, k);
            g->out_off += k;
            if (g->out_off == g->out.len) g->out_off = g->out.len = 0;
            return (ssize_t)k;
        }
        if (g->end_written) {
            log_gen(g, 200);
            return MHD_CONTENT_READER_END_OF_STREAM;
        }
        pump(g);
        if (lunar_srv_resp_done(g->rs)) {
            lunar_srv_resp_stream_end(g->rs, &g->out);
            g->end_written = 1;
            continue;
        }
        if (g->out.len > 0) continue;
        if (atomic_load(&g->srv->stopping) || client_gone(g->fd)) {
            g->gone = 1;
            cancel_live(g);
            log_gen(g, 200);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        wait_events(g, 100);
    }
}

static void stream_free(void *cls) {
    gen *g = cls;
    if (!g->end_written) g->gone = 1;
    cancel_live(g);
    log_gen(g, 200);
    atomic_fetch_sub(&g->srv->pending, 1);
    gen_unref(g);
}

/* Constrained decoding (server/constrain.h): strict tools, tool_choice required / named / none and
 * response_format json_object / json_schema compile to a grammar over the model's own output syntax. The
 * grammar is cached in s->constrain and outlives the request. 0 with *g (NULL: unconstrained), or -1 and a 400. */
static int constraint_for(lunar_server *s, const lunar_srv_req *r, const lunar_grammar **g, lunar_api_error *e) {
    *g = NULL;
    if (!s->constrain || r->kind != LUNAR_SRV_CHAT || !r->have_chat) return 0;
    lunar_err err = {{0}};
    if (lunar_constrain_get(s->constrain, &r->chat, g, &err))
        return lunar_api_fail(e, 400, NULL, "constrained decoding: %s", err.msg);
    return 0;
}

static MHD_RESULT_T handle_generate(struct MHD_Connection *c, lunar_server *s, conn *cn, lunar_srv_kind kind) {
    lunar_api_error e;
    gen *g = lunar_xcalloc(1, sizeof *g);
    if (lunar_srv_parse(&s->o.policy, s->o.tok, kind, cn->body.p ? cn->body.p : "", cn->body.len, &g->req, &e)) {
        free(g);
        return send_error(c, s, cn, &e);
    }
    const lunar_grammar *grammar;
    if (constraint_for(s, &g->req, &grammar, &e)) {
        lunar_srv_req_free(&g->req);
        free(g);
        return send_error(c, s, cn, &e);
    }
    if (atomic_fetch_add(&s->pending, 1) >= s->o.max_pending) {
        atomic_fetch_sub(&s->pending, 1);
        lunar_srv_req_free(&g->req);
        free(g);
        lunar_api_fail(&e, 503, NULL, "the server is overloaded (%d requests in flight); retry later", s->o.max_pending);
        return send_error(c, s, cn, &e);
    }
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->srv = s;
    g->refs = 1;
    g->fd = cn->fd;
    g->t0 = cn->t0;
    snprintf(g->url, sizeof g->url, "%s", cn->url);
    char hex[40];
    random_hex(hex, 32);
    snprintf(g->id, sizeof g->id, "%s%s", kind == LUNAR_SRV_CHAT ? "chatcmpl-" : "cmpl-", hex);
    g->n = g->req.n;
    g->cbs = lunar_xcalloc((size_t)g->n, sizeof *g->cbs);
    g->ids = lunar_xcalloc((size_t)g->n, sizeof *g->ids);
    g->live = lunar_xcalloc((size_t)g->n, sizeof *g->live);
    g->rs = lunar_srv_resp_new(&g->req, s->o.tok, g->id, (long long)time(NULL));
    for (int i = 0; i < g->n; i++) {
        g->cbs[i] = (cbctx){g, i};
        lunar_request r = {.prompt = g->req.ids.ids, .n_prompt = (int)g->req.ids.n, .sampling = g->req.sampling,
                           .grammar = grammar, .on_event = on_event, .user = &g->cbs[i]};
        if (r.sampling.has_seed) r.sampling.seed += (uint64_t)i; /* n samples, not n copies */
        r.sampling.logprobs = g->req.logprobs;
        r.sampling.top_logprobs = g->req.top_logprobs;
        pthread_mutex_lock(&g->mu);
        g->refs++;
        g->live[i] = 1;
        pthread_mutex_unlock(&g->mu);
        uint64_t id = 0;
        lunar_err err;
        if (s->o.backend.submit(s->o.backend.ctx, &r, &id, &err)) {
            pthread_mutex_lock(&g->mu);
            g->refs--;
            g->live[i] = 0;
            pthread_mutex_unlock(&g->mu);
            for (int k = i; k < g->n; k++) g->live[k] = 0;
            cancel_live(g);
            lunar_api_fail(&e, 400, NULL, "%s", err.msg);
            g->logged = 1;
            atomic_fetch_sub(&s->pending, 1);
            /* earlier choices end with ABORT and drop their references */
            gen_unref(g);
            return send_error(c, s, cn, &e);
        }
        pthread_mutex_lock(&g->mu);
        g->ids[i] = id;
        pthread_mutex_unlock(&g->mu);
    }
    if (g->req.stream) {
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_reader, g,
                                                                   stream_free);
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        MHD_RESULT_T ok = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        lunar_srv_metrics_http(s->metrics, 200);
        return ok;
    }
    for (;;) {
        pump(g);
        if (lunar_srv_resp_done(g->rs)) break;
        if (atomic_load(&s->stopping) || client_gone(g->fd)) {
            g->gone = !atomic_load(&s->stopping);
            cancel_live(g);
            break;
        }
        wait_events(g, 100);
    }
    MHD_RESULT_T ok;
    if (!lunar_srv_resp_done(g->rs)) {
        lunar_api_fail(&e, 503, NULL, "the request was aborted");
        log_gen(g, 503);
        ok = send_error(c, s, NULL, &e);
    } else if (lunar_srv_resp_error(g->rs, &e)) {
        log_gen(g, e.status);
        ok = send_error(c, s, NULL, &e);
    } else {
        log_gen(g, 200);
        ok = send_body(c, s, 200, "application/json", lunar_srv_resp_json(g->rs));
    }
    atomic_fetch_sub(&s->pending, 1);
    gen_unref(g);
    return ok;
}

/* ---- the small endpoints ---- */

static MHD_RESULT_T handle_models(struct MHD_Connection *c, lunar_server *s) {
    json_t *data = json_array();
    const lunar_srv_policy *p = &s->o.policy;
    int n = p->n_model_names ? p->n_model_names : 1;
    for (int i = 0; i < n; i++) {
        const char *name = p->n_model_names ? p->model_names[i] : "lunar";
        json_array_append_new(data, json_pack("{s:s, s:s, s:I, s:s, s:s, s:n, s:i}", "id", name, "object", "model",
                                              "created", (json_int_t)time(NULL), "owned_by", "lunar", "root",
                                              s->o.model_root ? s->o.model_root : name, "parent", "max_model_len",
                                              p->max_model_len));
    }
    return send_json(c, s, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

static MHD_RESULT_T handle_metrics(struct MHD_Connection *c, lunar_server *s) {
    lunar_sbuf b = {0};
    lunar_engine_metrics em;
    int have = s->o.backend.metrics != NULL;
    if (have) s->o.backend.metrics(s->o.backend.ctx, &em);
    lunar_srv_metrics_render(s->metrics, have ? &em : NULL, &b);
    return send_body(c, s, 200, "text/plain; version=0.0.4; charset=utf-8", lunar_sbuf_take(&b));
}

static MHD_RESULT_T handle_tokenize(struct MHD_Connection *c, lunar_server *s, conn *cn) {
    lunar_api_error e;
    json_t *b = lunar_srv_parse_json(cn->body.p, cn->body.len, &e);
    if (!b) return send_error(c, s, cn, &e);
    lunar_ids ids = {0};
    lunar_err err;
    const json_t *prompt = json_object_get(b, "prompt"), *msgs = json_object_get(b, "messages");
    const json_t *ret = json_object_get(b, "return_token_strs");
    const json_t *ast = json_object_get(b, "add_special_tokens");
    int rc = 0;
    if (ret && !json_is_boolean(ret) && !json_is_null(ret))
        rc = lunar_api_fail(&e, 400, "return_token_strs", "return_token_strs: must be a boolean");
    else if (ast && !json_is_boolean(ast) && !json_is_null(ast))
        rc = lunar_api_fail(&e, 400, "add_special_tokens", "add_special_tokens: must be a boolean");
    else if (json_is_string(prompt)) {
        if (lunar_tokenize(s->o.tok, json_string_value(prompt), json_string_length(prompt), true, &ids, &err))
            rc = lunar_api_fail(&e, 400, "prompt", "prompt: %s", err.msg);
    } else if (json_is_array(msgs)) {
        lunar_chat_prompt p;
        if (lunar_chat_render(s->o.policy.arch, b, &p, &err) || lunar_prompt_ids(s->o.tok, &p, &ids, &err))
            rc = lunar_api_fail(&e, 400, NULL, "%s", err.msg);
        lunar_chat_prompt_free(&p);
    } else {
        rc = lunar_api_fail(&e, 400, "prompt", "give \"prompt\" (a string) or \"messages\" (an array)");
    }
    json_decref(b);
    if (rc) {
        lunar_ids_free(&ids);
        return send_error(c, s, cn, &e);
    }
    json_t *toks = json_array(), *strs = json_array();
    for (size_t i = 0; i < ids.n; i++) {
        json_array_append_new(toks, json_integer(ids.ids[i]));
        size_t n;
        const char *t = lunar_token_bytes(s->o.tok, ids.ids[i], &n);
        json_t *v = t ? json_stringn(t, n) : NULL;
        json_array_append_new(strs, v ? v : json_string("\xef\xbf\xbd"));
    }
    json_t *res = json_pack("{s:I, s:i, s:o}", "count", (json_int_t)ids.n, "max_model_len", s->o.policy.max_model_len,
                            "tokens", toks);
    if (json_is_true(ret)) json_object_set_new(res, "token_strs", strs);
    else json_decref(strs);
    lunar_ids_free(&ids);
    return send_json(c, s, 200, res);
}

static MHD_RESULT_T handle_detokenize(struct MHD_Connection *c, lunar_server *s, conn *cn) {
    lunar_api_error e;
    json_t *b = lunar_srv_parse_json(cn->body.p, cn->body.len, &e);
    if (!b) return send_error(c, s, cn, &e);
    const json_t *t = json_object_get(b, "tokens");
    if (!json_is_array(t)) {
        json_decref(b);
        lunar_api_fail(&e, 400, "tokens", "tokens: must be an array of token ids");
        return send_error(c, s, cn, &e);
    }
    size_t n = json_array_size(t);
    int32_t *ids = lunar_xmalloc((n ? n : 1) * sizeof *ids);
    int32_t V = lunar_tokenizer_vocab_size(s->o.tok);
    for (size_t i = 0; i < n; i++) {
        const json_t *x = json_array_get(t, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= V) {
            free(ids);
            json_decref(b);
            lunar_api_fail(&e, 400, "tokens", "tokens[%zu]: must be a token id in [0, %d)", i, V);
            return send_error(c, s, cn, &e);
        }
        ids[i] = (int32_t)json_integer_value(x);
    }
    json_decref(b);
    size_t len;
    char *text = lunar_detokenize(s->o.tok, ids, n, false, &len);
    free(ids);
    json_t *res = json_pack("{s:o}", "prompt", json_stringn(text, len));
    free(text);
    return send_json(c, s, 200, res);
}

/* ---- routing ---- */

static int authorized(struct MHD_Connection *c, lunar_server *s) {
    const char *key = s->o.api_key;
    if (!key || !*key) return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return 0;
    h += 7;
    while (*h == ' ') h++;
    /* constant-time comparison */
    size_t a = strlen(h), b = strlen(key);
    unsigned char d = (unsigned char)(a != b);
    for (size_t i = 0; i < b; i++) d |= (unsigned char)(key[i] ^ (i < a ? h[i] : 0));
    return d == 0;
}

static MHD_RESULT_T route(struct MHD_Connection *c, lunar_server *s, conn *cn) {
    lunar_api_error e;
    const char *u = cn->url;
    int post = strcmp(cn->method, "POST") == 0, get = strcmp(cn->method, "GET") == 0 || strcmp(cn->method, "HEAD") == 0;
    int protected_ = strncmp(u, "/v1/", 4) == 0 || strcmp(u, "/tokenize") == 0 || strcmp(u, "/detokenize") == 0;
    if (protected_ && !authorized(c, s)) {
        lunar_api_fail(&e, 401, NULL, "Incorrect API key provided (send Authorization: Bearer <key>).");
        e.type = "invalid_request_error";
        return send_error(c, s, cn, &e);
    }
    struct {
        const char *path;
        int post;
    } routes[] = {{"/v1/chat/completions", 1}, {"/v1/completions", 1}, {"/tokenize", 1}, {"/detokenize", 1},
                  {"/v1/models", 0},           {"/health", 0},         {"/metrics", 0}};
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        if (strcmp(u, routes[i].path) != 0) continue;
        if (routes[i].post ? !post : !get) {
            lunar_api_fail(&e, 405, NULL, "%s is not allowed on %s", cn->method, u);
            return send_error(c, s, cn, &e);
        }
        if (cn->too_large) {
            lunar_api_fail(&e, 413, NULL, "the request body is larger than %zu bytes", s->o.max_body_bytes);
            return send_error(c, s, cn, &e);
        }
        switch (i) {
        case 0: return handle_generate(c, s, cn, LUNAR_SRV_CHAT);
        case 1: return handle_generate(c, s, cn, LUNAR_SRV_COMPLETION);
        case 2: return handle_tokenize(c, s, cn);
        case 3: return handle_detokenize(c, s, cn);
        case 4: return handle_models(c, s);
        case 5: return send_json(c, s, 200, json_pack("{s:s}", "status", "ok"));
        case 6: return handle_metrics(c, s);
        }
    }
    lunar_api_fail(&e, 404, NULL, "no route %s %.200s", cn->method, u);
    e.code = "not_found";
    return send_error(c, s, cn, &e);
}

static MHD_RESULT_T on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                               const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    lunar_server *s = cls;
    conn *cn = *con_cls;
    if (!cn) {
        cn = lunar_xcalloc(1, sizeof *cn);
        snprintf(cn->method, sizeof cn->method, "%s", method);
        snprintf(cn->url, sizeof cn->url, "%s", url);
        cn->t0 = now_s();
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        cn->fd = ci ? ci->connect_fd : -1;
        *con_cls = cn;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) > s->o.max_body_bytes) {
            cn->too_large = 1;
            lunar_api_error e;
            lunar_api_fail(&e, 413, NULL, "the request body is larger than %zu bytes", s->o.max_body_bytes);
            return send_error(c, s, cn, &e);
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (!cn->too_large && cn->body.len + *upload_size <= s->o.max_body_bytes)
            lunar_sbuf_put(&cn->body, upload, *upload_size);
        else
            cn->too_large = 1;
        *upload_size = 0;
        return MHD_YES;
    }
    return route(c, s, cn);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode t) {
    (void)cls;
    (void)c;
    (void)t;
    conn *cn = *con_cls;
    if (!cn) return;
    lunar_sbuf_free(&cn->body);
    free(cn);
    *con_cls = NULL;
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    lunar_server *s = cls;
    if (s->o.quiet) return;
    fprintf(stderr, "lunar serve: http: ");
    vfprintf(stderr, fmt, ap);
}

int lunar_server_start(lunar_server **out, const lunar_server_options *o, lunar_err *err) {
    *out = NULL;
    lunar_server *s = lunar_xcalloc(1, sizeof *s);
    s->o = *o;
    if (!s->o.max_body_bytes) s->o.max_body_bytes = 32u << 20;
    if (!s->o.max_pending) s->o.max_pending = 4096;
    if (!s->o.max_connections) s->o.max_connections = 1024;
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    const char *host = o->host && *o->host ? o->host : "0.0.0.0";
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai = NULL;
    char port[16];
    snprintf(port, sizeof port, "%d", o->port);
    int gai = getaddrinfo(host, port, &hints, &ai);
    if (gai || !ai) {
        o->backend.destroy(o->backend.ctx);
        free(s);
        return lunar_fail(err, "--host %s: %s", host, gai_strerror(gai));
    }
    memcpy(&ss, ai->ai_addr, ai->ai_addrlen);
    int v6 = ai->ai_family == AF_INET6;
    freeaddrinfo(ai);
    /* the vocabulary index for constrained decoding, once (~160 ms); only when the model's logits cover
     * the tokenizer's ids (the mask is indexed by token id) */
    if (o->tok && (o->model_vocab_size <= 0 || o->model_vocab_size >= lunar_tokenizer_vocab_size(o->tok))) {
        lunar_err verr = {{0}};
        if (lunar_constrain_new(&s->constrain, o->tok, o->policy.arch, &verr) && !o->quiet)
            fprintf(stderr, "lunar serve: constrained decoding off: %s\n", verr.msg);
    } else if (o->tok && !o->quiet) {
        fprintf(stderr, "lunar serve: constrained decoding off: the model's vocabulary (%d) is smaller than the "
                        "tokenizer's (%d)\n", o->model_vocab_size, lunar_tokenizer_vocab_size(o->tok));
    }
    s->metrics = lunar_srv_metrics_new(o->policy.n_model_names ? o->policy.model_names[0] : "lunar");
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG |
                     MHD_USE_POLL | (v6 ? MHD_USE_IPv6 : 0);
    s->d = MHD_start_daemon(flags, (uint16_t)o->port, NULL, NULL, on_request, s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log,
                            s, MHD_OPTION_SOCK_ADDR, &ss,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_CONNECTION_TIMEOUT,
                            (unsigned)(o->idle_timeout_s ? o->idle_timeout_s : 120), MHD_OPTION_CONNECTION_LIMIT,
                            s->o.max_connections,
                            MHD_OPTION_LISTENING_ADDRESS_REUSE, 1u, MHD_OPTION_END);
    if (!s->d) {
        int e = errno;
        o->backend.destroy(o->backend.ctx);
        lunar_srv_metrics_free(s->metrics);
        lunar_constrain_free(s->constrain);
        free(s);
        return lunar_fail(err, "cannot listen on %s:%d: %s", host, o->port, strerror(e));
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? di->port : o->port;
    *out = s;
    return 0;
}

int lunar_server_port(const lunar_server *s) { return s->port; }

void lunar_server_stop(lunar_server *s) {
    if (!s) return;
    atomic_store(&s->stopping, 1);
    MHD_stop_daemon(s->d);
    s->o.backend.destroy(s->o.backend.ctx);
    lunar_srv_metrics_free(s->metrics);
    lunar_constrain_free(s->constrain); /* after the backend: no request uses a grammar any more */
    free(s);
}
