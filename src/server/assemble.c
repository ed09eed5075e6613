#include "server/assemble.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "text/chat_parse.h"
#include "text/parse_k3.h"

/* The K2 parser and the streamed tool-call events (START / ARGS / END) arrive together (branch chat2).
 * Until then: kimi_linear output is plain content and the K3 parser reports whole calls (TOOL_CALL). */
#if defined(__has_include)
#if __has_include("text/parse_k2.h")
#include "text/parse_k2.h"
#define LUNAR_SRV_HAVE_K2_PARSER 1
#endif
#endif

enum { P_PLAIN, P_K3, P_K2 };

typedef struct out {
    struct lunar_srv_resp *rs;
    int index;
    int started;  /* role chunk sent */
    int finished;
    int n_tokens;
    lunar_finish_reason engine_finish;
    char error[512];
    const char *finish_reason; /* static string */
    lunar_detok detok;
    int ptype;
    void *parser;
    lunar_sbuf hold; /* text held back: it may be the start of a stop string */
    /* non-stream accumulation */
    lunar_sbuf content, reasoning;
    int saw_reasoning;
    json_t *calls;   /* [{id,type,function{name,arguments}}] */
    int n_calls_stream; /* calls started (stream) */
    json_t *lp;      /* logprob entries not yet sent (stream) / all (non-stream); chat: array; completion: object */
    lunar_sbuf *sink;   /* stream output of the current event */
} out;

struct lunar_srv_resp {
    const lunar_srv_req *req;
    const lunar_tokenizer *tok;
    char id[96];
    long long created;
    int n;
    out *outs;
    int32_t ranks;
    size_t text_offset; /* completions logprobs text_offset (choice 0 only; approximate for n > 1) */
};

/* ---- SSE ---- */

void lunar_sse_data(lunar_sbuf *o, const char *json) {
    lunar_sbuf_puts(o, "data: ");
    lunar_sbuf_puts(o, json);
    lunar_sbuf_puts(o, "\n\n");
}

void lunar_sse_json(lunar_sbuf *o, json_t *v) {
    char *s = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    if (s) lunar_sse_data(o, s);
    free(s);
}

void lunar_sse_done(lunar_sbuf *o) { lunar_sbuf_puts(o, "data: [DONE]\n\n"); }

/* ---- helpers ---- */

static json_t *jstr(const char *s, size_t n) {
    json_t *v = json_stringn(s, n);
    return v ? v : json_string(""); /* cannot happen: parser and detokenizer output is valid UTF-8 */
}

/* A token as a display string: its UTF-8, or "bytes:\xNN..." (vLLM) when it is not valid UTF-8 alone. */
static json_t *token_str(const lunar_tokenizer *tok, int32_t id) {
    size_t n;
    const char *b = lunar_token_bytes(tok, id, &n);
    if (!b) return json_string("");
    json_t *v = json_stringn(b, n);
    if (v) return v;
    lunar_sbuf s = {0};
    lunar_sbuf_puts(&s, "bytes:");
    for (size_t i = 0; i < n; i++) lunar_sbuf_printf(&s, "\\x%02x", (unsigned char)b[i]);
    v = json_stringn(s.p, s.len);
    lunar_sbuf_free(&s);
    return v;
}

static json_t *token_bytes(const lunar_tokenizer *tok, int32_t id) {
    size_t n;
    const char *b = lunar_token_bytes(tok, id, &n);
    json_t *a = json_array();
    for (size_t i = 0; b && i < n; i++) json_array_append_new(a, json_integer((unsigned char)b[i]));
    return a;
}

static json_t *usage_json(const lunar_srv_resp *rs) {
    int c = lunar_srv_resp_completion_tokens(rs);
    return json_pack("{s:I, s:i, s:I, s:{s:i}}", "prompt_tokens", (json_int_t)rs->req->prompt_tokens,
                     "completion_tokens", c, "total_tokens", (json_int_t)rs->req->prompt_tokens + c,
                     "prompt_tokens_details", "cached_tokens", 0);
}

static json_t *chunk_base(const lunar_srv_resp *rs) {
    return json_pack("{s:s, s:s, s:I, s:s}", "id", rs->id, "object",
                     rs->req->kind == LUNAR_SRV_CHAT ? "chat.completion.chunk" : "text_completion", "created",
                     (json_int_t)rs->created, "model", rs->req->model);
}

/* Wraps choice ch (stolen) in a chunk and sends it; the last chunk of a one-choice response carries
 * the usage in both places clients look for it. */
static void send_choice(out *o, json_t *ch, const char *finish) {
    lunar_srv_resp *rs = o->rs;
    json_t *c = chunk_base(rs);
    if (finish && rs->n == 1) {
        json_object_set_new(ch, "usage", usage_json(rs));
        json_object_set_new(c, "usage", usage_json(rs));
    }
    json_object_set_new(c, "choices", json_pack("[o]", ch));
    lunar_sse_json(o->sink, c);
}

/* Sends one chat chunk for choice o with this delta (stolen) and finish_reason (or NULL). */
static void send_chat(out *o, json_t *delta, const char *finish) {
    lunar_srv_resp *rs = o->rs;
    json_t *ch = json_pack("{s:i, s:o, s:o}", "index", o->index, "delta", delta, "finish_reason",
                           finish ? json_string(finish) : json_null());
    if (rs->req->logprobs && json_array_size(o->lp)) {
        json_object_set_new(ch, "logprobs", json_pack("{s:O}", "content", o->lp));
        json_array_clear(o->lp);
    } else {
        json_object_set_new(ch, "logprobs", json_null());
    }
    send_choice(o, ch, finish);
}

static void send_completion(out *o, const char *text, size_t n, const char *finish) {
    lunar_srv_resp *rs = o->rs;
    json_t *ch = json_pack("{s:i, s:o, s:o}", "index", o->index, "text", jstr(text, n), "finish_reason",
                           finish ? json_string(finish) : json_null());
    if (rs->req->logprobs && json_array_size(json_object_get(o->lp, "tokens"))) {
        json_object_set(ch, "logprobs", o->lp);
        json_decref(o->lp);
        o->lp = json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
    } else {
        json_object_set_new(ch, "logprobs", json_null());
    }
    send_choice(o, ch, finish);
}

static void ensure_started(out *o) {
    if (o->started) return;
    o->started = 1;
    if (!o->rs->req->stream) return;
    if (o->rs->req->kind == LUNAR_SRV_CHAT) {
        json_t *d = json_pack("{s:s, s:s}", "role", "assistant", "content", "");
        /* the role chunk carries no logprobs: keep them for the first real delta */
        json_t *saved = o->lp;
        o->lp = json_array();
        send_chat(o, d, NULL);
        json_decref(o->lp);
        o->lp = saved;
    } else if (o->rs->req->echo && o->rs->req->prompt_text_len) {
        send_completion(o, o->rs->req->prompt_text, o->rs->req->prompt_text_len, NULL);
    }
}

/* ---- parser events (chat) ---- */

static void on_chat_event(void *ctx, const lunar_chat_event *ev) {
    out *o = ctx;
    const int stream = o->rs->req->stream;
    switch (ev->kind) {
    case LUNAR_CHAT_EV_REASONING:
    case LUNAR_CHAT_EV_CONTENT: {
        if (ev->len == 0) return;
        int r = ev->kind == LUNAR_CHAT_EV_REASONING;
        if (r) o->saw_reasoning = 1;
        if (stream) {
            send_chat(o, json_pack("{s:o}", r ? "reasoning_content" : "content", jstr(ev->text, ev->len)), NULL);
        } else {
            lunar_sbuf_put(r ? &o->reasoning : &o->content, ev->text, ev->len);
        }
        return;
    }
#ifdef LUNAR_SRV_HAVE_K2_PARSER
    case LUNAR_CHAT_EV_TOOL_CALL_START: {
        json_t *call = json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", ev->id ? ev->id : "call_0", "type", "function",
                                 "function", "name", ev->name ? ev->name : "", "arguments", "");
        if (stream) {
            json_object_set_new(call, "index", json_integer(ev->index));
            send_chat(o, json_pack("{s:[o]}", "tool_calls", call), NULL);
        } else {
            json_array_append_new(o->calls, call);
        }
        return;
    }
    case LUNAR_CHAT_EV_TOOL_CALL_ARGS: {
        if (ev->len == 0) return;
        if (stream) {
            send_chat(o,
                      json_pack("{s:[{s:i, s:{s:o}}]}", "tool_calls", "index", ev->index, "function", "arguments",
                                jstr(ev->text, ev->len)),
                      NULL);
        } else {
            json_t *call = json_array_get(o->calls, json_array_size(o->calls) - 1);
            json_t *fn = json_object_get(call, "function");
            const char *old = json_string_value(json_object_get(fn, "arguments"));
            lunar_sbuf s = {0};
            lunar_sbuf_puts(&s, old ? old : "");
            lunar_sbuf_put(&s, ev->text, ev->len);
            json_object_set_new(fn, "arguments", jstr(s.p, s.len));
            lunar_sbuf_free(&s);
        }
        return;
    }
    case LUNAR_CHAT_EV_TOOL_CALL_END:
        return;
#else
    case LUNAR_CHAT_EV_TOOL_CALL: {
        /* a whole call: the first delta names it, the second carries the arguments (chat_parse.h) */
        if (stream) {
            send_chat(o,
                      json_pack("{s:[{s:i, s:s, s:s, s:{s:s, s:s}}]}", "tool_calls", "index", ev->index, "id",
                                ev->id ? ev->id : "call_0", "type", "function", "function", "name",
                                ev->name ? ev->name : "", "arguments", ""),
                      NULL);
            send_chat(o,
                      json_pack("{s:[{s:i, s:{s:o}}]}", "tool_calls", "index", ev->index, "function", "arguments",
                                jstr(ev->text, ev->len)),
                      NULL);
        } else {
            json_array_append_new(o->calls,
                                  json_pack("{s:s, s:s, s:{s:s, s:o}}", "id", ev->id ? ev->id : "call_0", "type",
                                            "function", "function", "name", ev->name ? ev->name : "", "arguments",
                                            jstr(ev->text, ev->len)));
        }
        return;
    }
#endif
    case LUNAR_CHAT_EV_FINISH: {
        const char *f = "stop";
        if (ev->len == 6 && memcmp(ev->text, "length", 6) == 0) f = "length";
        else if (ev->len == 10 && memcmp(ev->text, "tool_calls", 10) == 0) f = "tool_calls";
        o->finish_reason = f;
        return;
    }
    }
}

static void rand_bytes(void *ctx, unsigned char *buf, size_t n) {
    (void)ctx;
    size_t got = 0;
    while (got < n) {
        ssize_t k = getrandom(buf + got, n - got, 0);
        if (k <= 0) break;
        got += (size_t)k;
    }
    for (; got < n; got++) buf[got] = (unsigned char)rand();
}

static void parser_feed(out *o, int id, const char *s, size_t n) {
    switch (o->ptype) {
    case P_K3: lunar_k3_parser_feed(o->parser, id, s, n); break;
#ifdef LUNAR_SRV_HAVE_K2_PARSER
    case P_K2: lunar_k2_parser_feed(o->parser, id, s, n); break;
#endif
    default: {
        if (n == 0) return;
        lunar_chat_event ev = {.kind = LUNAR_CHAT_EV_CONTENT, .text = s, .len = n};
        on_chat_event(o, &ev);
    }
    }
}

static void parser_finish(out *o, int truncated) {
    switch (o->ptype) {
    case P_K3: lunar_k3_parser_finish(o->parser, truncated); break;
#ifdef LUNAR_SRV_HAVE_K2_PARSER
    case P_K2: lunar_k2_parser_finish(o->parser, truncated); break;
#endif
    default: o->finish_reason = truncated ? "length" : "stop";
    }
}

/* Text that passed the stop filter. */
static void emit_text(out *o, const char *s, size_t n) {
    if (n == 0) return;
    if (o->rs->req->kind == LUNAR_SRV_CHAT) {
        parser_feed(o, 0, s, n); /* id 0: an ordinary token, never a marker */
    } else if (o->rs->req->stream) {
        send_completion(o, s, n, NULL);
    } else {
        lunar_sbuf_put(&o->content, s, n);
    }
}

/* Longest suffix of h that is a proper prefix of some stop string. */
static size_t stop_keep(const lunar_srv_req *rq, const char *h, size_t n) {
    size_t keep = 0;
    for (int i = 0; i < rq->n_stop; i++) {
        size_t m = strlen(rq->stop[i]);
        for (size_t k = (m - 1 < n ? m - 1 : n); k > keep; k--)
            if (memcmp(h + n - k, rq->stop[i], k) == 0) {
                keep = k;
                break;
            }
    }
    return keep;
}

/* Returns 1 when a stop string was found (the text up to it was emitted). */
static int filter_text(out *o, const char *s, size_t n) {
    const lunar_srv_req *rq = o->rs->req;
    if (rq->n_stop == 0) {
        emit_text(o, s, n);
        return 0;
    }
    lunar_sbuf_put(&o->hold, s, n);
    const char *h = o->hold.p;
    size_t hl = o->hold.len, best = (size_t)-1;
    for (int i = 0; i < rq->n_stop; i++) {
        const char *f = memmem(h, hl, rq->stop[i], strlen(rq->stop[i]));
        if (f && (size_t)(f - h) < best) best = (size_t)(f - h);
    }
    if (best != (size_t)-1) {
        emit_text(o, h, best);
        o->hold.len = 0;
        return 1;
    }
    size_t cut = hl - stop_keep(rq, h, hl);
    while (cut > 0 && cut < hl && ((unsigned char)h[cut] & 0xC0) == 0x80) cut--; /* whole characters only */
    emit_text(o, h, cut);
    memmove(o->hold.p, h + cut, hl - cut);
    o->hold.len = hl - cut;
    return 0;
}

static void flush_hold(out *o) {
    size_t n = o->hold.len;
    o->hold.len = 0;
    emit_text(o, o->hold.p, n);
}

static void add_logprobs(out *o, const lunar_event *ev) {
    const lunar_srv_req *rq = o->rs->req;
    const lunar_tokenizer *tok = o->rs->tok;
    if (!rq->logprobs) return;
    int ntop = ev->n_top < rq->top_logprobs ? ev->n_top : rq->top_logprobs;
    if (rq->kind == LUNAR_SRV_CHAT) {
        json_t *top = json_array();
        for (int i = 0; i < ntop; i++)
            json_array_append_new(top, json_pack("{s:o, s:f, s:o}", "token", token_str(tok, ev->top_ids[i]),
                                                 "logprob", (double)ev->top_logprobs[i], "bytes",
                                                 token_bytes(tok, ev->top_ids[i])));
        json_array_append_new(o->lp, json_pack("{s:o, s:f, s:o, s:o}", "token", token_str(tok, ev->token), "logprob",
                                               (double)ev->logprob, "bytes", token_bytes(tok, ev->token),
                                               "top_logprobs", top));
    } else {
        json_array_append_new(json_object_get(o->lp, "tokens"), token_str(tok, ev->token));
        json_array_append_new(json_object_get(o->lp, "token_logprobs"), json_real(ev->logprob));
        json_t *top = json_object();
        for (int i = 0; i < ntop; i++) {
            json_t *k = token_str(tok, ev->top_ids[i]);
            json_object_set_new(top, json_string_value(k), json_real(ev->top_logprobs[i]));
            json_decref(k);
        }
        json_array_append_new(json_object_get(o->lp, "top_logprobs"), top);
        json_array_append_new(json_object_get(o->lp, "text_offset"), json_integer((json_int_t)o->rs->text_offset));
        size_t n;
        lunar_token_bytes(tok, ev->token, &n);
        o->rs->text_offset += n;
    }
}

/* ---- lifecycle ---- */

lunar_srv_resp *lunar_srv_resp_new(const lunar_srv_req *req, const lunar_tokenizer *tok, const char *id,
                                   long long created) {
    lunar_srv_resp *rs = lunar_xcalloc(1, sizeof *rs);
    rs->req = req;
    rs->tok = tok;
    snprintf(rs->id, sizeof rs->id, "%s", id);
    rs->created = created;
    rs->n = req->n > 0 ? req->n : 1;
    rs->ranks = lunar_tokenizer_num_ranks(tok);
    rs->outs = lunar_xcalloc((size_t)rs->n, sizeof *rs->outs);
    for (int i = 0; i < rs->n; i++) {
        out *o = &rs->outs[i];
        o->rs = rs;
        o->index = i;
        o->calls = json_array();
        o->lp = req->kind == LUNAR_SRV_CHAT
                    ? json_array()
                    : json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
        lunar_detok_init(&o->detok, tok, req->kind == LUNAR_SRV_COMPLETION && req->skip_special_tokens);
        o->ptype = P_PLAIN;
        if (req->kind == LUNAR_SRV_CHAT) {
            if (req->arch == LUNAR_ARCH_KIMI_K3) {
                o->ptype = P_K3;
                o->parser = lunar_k3_parser_new(req->chat.thinking, on_chat_event, o, rand_bytes, NULL);
            }
#ifdef LUNAR_SRV_HAVE_K2_PARSER
            else {
                o->ptype = P_K2;
                o->parser = lunar_k2_parser_new(req->chat.thinking, on_chat_event, o);
            }
#endif
        }
    }
    return rs;
}

void lunar_srv_resp_free(lunar_srv_resp *rs) {
    if (!rs) return;
    for (int i = 0; i < rs->n; i++) {
        out *o = &rs->outs[i];
        if (o->ptype == P_K3) lunar_k3_parser_free(o->parser);
#ifdef LUNAR_SRV_HAVE_K2_PARSER
        if (o->ptype == P_K2) lunar_k2_parser_free(o->parser);
#endif
        lunar_sbuf_free(&o->hold);
        lunar_sbuf_free(&o->content);
        lunar_sbuf_free(&o->reasoning);
        json_decref(o->calls);
        json_decref(o->lp);
    }
    free(rs->outs);
    free(rs);
}

static void finish_choice(out *o, lunar_finish_reason why) {
    if (why == LUNAR_FINISH_ERROR || why == LUNAR_FINISH_ABORT) {
        o->finished = 1;
        o->engine_finish = why;
        return;
    }
    char buf[LUNAR_DETOK_MAX_OUT];
    size_t k = lunar_detok_flush(&o->detok, buf);
    if (k && filter_text(o, buf, k)) why = LUNAR_FINISH_STOP;
    flush_hold(o);
    o->engine_finish = why;
    if (o->rs->req->kind == LUNAR_SRV_CHAT) {
        parser_finish(o, why == LUNAR_FINISH_LENGTH);
    } else {
        o->finish_reason = why == LUNAR_FINISH_LENGTH ? "length" : "stop";
    }
    if (!o->finish_reason) o->finish_reason = "stop";
    o->finished = 1;
    if (o->rs->req->stream) {
        ensure_started(o);
        if (o->rs->req->kind == LUNAR_SRV_CHAT) send_chat(o, json_object(), o->finish_reason);
        else send_completion(o, "", 0, o->finish_reason);
    }
}

int lunar_srv_resp_event(lunar_srv_resp *rs, int choice, const lunar_event *ev, lunar_sbuf *sink) {
    if (choice < 0 || choice >= rs->n) return 0;
    out *o = &rs->outs[choice];
    if (o->finished) return 0;
    lunar_sbuf scratch = {0};
    o->sink = sink ? sink : &scratch;
    int stopped = 0;
    if (ev->has_token) {
        ensure_started(o);
        o->n_tokens++;
        add_logprobs(o, ev);
        char buf[LUNAR_DETOK_MAX_OUT];
        int is_control = ev->token >= rs->ranks;
        if (rs->req->kind == LUNAR_SRV_CHAT && is_control) {
            size_t k = lunar_detok_flush(&o->detok, buf);
            if (k) stopped = filter_text(o, buf, k);
            if (!stopped) {
                flush_hold(o);
                size_t n;
                const char *b = lunar_token_bytes(rs->tok, ev->token, &n);
                if (o->ptype != P_PLAIN) parser_feed(o, ev->token, b ? b : "", b ? n : 0);
            }
        } else {
            size_t k = lunar_detok_push(&o->detok, ev->token, buf);
            if (k) stopped = filter_text(o, buf, k);
        }
    }
    int done = 0;
    if (stopped) {
        finish_choice(o, LUNAR_FINISH_STOP);
        done = 1;
    } else if (ev->finish != LUNAR_FINISH_NONE) {
        if (ev->finish == LUNAR_FINISH_ERROR)
            snprintf(o->error, sizeof o->error, "%s", ev->message ? ev->message : "engine error");
        finish_choice(o, ev->finish);
        done = 1;
    }
    o->sink = NULL;
    lunar_sbuf_free(&scratch);
    return done;
}

int lunar_srv_resp_done(const lunar_srv_resp *rs) {
    for (int i = 0; i < rs->n; i++)
        if (!rs->outs[i].finished) return 0;
    return 1;
}

int lunar_srv_resp_error(const lunar_srv_resp *rs, lunar_api_error *e) {
    for (int i = 0; i < rs->n; i++) {
        const out *o = &rs->outs[i];
        if (o->engine_finish == LUNAR_FINISH_ERROR)
            return lunar_api_fail(e, 500, NULL, "generation failed: %s", o->error), 1;
        if (o->engine_finish == LUNAR_FINISH_ABORT)
            return lunar_api_fail(e, 503, NULL, "the request was aborted (server shutting down)"), 1;
    }
    return 0;
}

int lunar_srv_resp_completion_tokens(const lunar_srv_resp *rs) {
    int c = 0;
    for (int i = 0; i < rs->n; i++) c += rs->outs[i].n_tokens;
    return c;
}

const char *lunar_srv_resp_finish_reason(const lunar_srv_resp *rs, int choice) {
    if (choice < 0 || choice >= rs->n) return NULL;
    return rs->outs[choice].finish_reason;
}

void lunar_srv_resp_stream_end(lunar_srv_resp *rs, lunar_sbuf *sink) {
    lunar_api_error e;
    if (lunar_srv_resp_error(rs, &e)) {
        char *s = lunar_api_error_json(&e);
        lunar_sse_data(sink, s);
        free(s);
    } else {
        json_t *c = chunk_base(rs);
        json_object_set_new(c, "choices", json_array());
        json_object_set_new(c, "usage", usage_json(rs));
        lunar_sse_json(sink, c);
    }
    lunar_sse_done(sink);
}

char *lunar_srv_resp_json(const lunar_srv_resp *rs) {
    const lunar_srv_req *rq = rs->req;
    json_t *choices = json_array();
    for (int i = 0; i < rs->n; i++) {
        const out *o = &rs->outs[i];
        json_t *ch;
        if (rq->kind == LUNAR_SRV_CHAT) {
            json_t *msg = json_pack("{s:s}", "role", "assistant");
            int has_calls = json_array_size(o->calls) > 0;
            json_object_set_new(msg, "content",
                                o->content.len || !has_calls ? jstr(o->content.p ? o->content.p : "", o->content.len)
                                                             : json_null());
            if (rq->chat.thinking || o->saw_reasoning)
                json_object_set_new(msg, "reasoning_content",
                                    jstr(o->reasoning.p ? o->reasoning.p : "", o->reasoning.len));
            if (has_calls) json_object_set(msg, "tool_calls", o->calls);
            ch = json_pack("{s:i, s:o, s:s}", "index", i, "message", msg, "finish_reason",
                           o->finish_reason ? o->finish_reason : "stop");
            json_object_set_new(ch, "logprobs", rq->logprobs ? json_pack("{s:O}", "content", o->lp) : json_null());
        } else {
            lunar_sbuf t = {0};
            if (rq->echo && rq->prompt_text) lunar_sbuf_put(&t, rq->prompt_text, rq->prompt_text_len);
            lunar_sbuf_put(&t, o->content.p ? o->content.p : "", o->content.len);
            ch = json_pack("{s:i, s:o, s:s}", "index", i, "text", jstr(t.p ? t.p : "", t.len), "finish_reason",
                           o->finish_reason ? o->finish_reason : "stop");
            lunar_sbuf_free(&t);
            json_object_set(ch, "logprobs", rq->logprobs ? o->lp : json_null());
        }
        json_array_append_new(choices, ch);
    }
    json_t *root = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", rs->id, "object",
                             rq->kind == LUNAR_SRV_CHAT ? "chat.completion" : "text_completion", "created",
                             (json_int_t)rs->created, "model", rq->model, "choices", choices, "usage", usage_json(rs));
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}
