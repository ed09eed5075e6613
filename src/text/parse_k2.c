#include "text/parse_k2.h"

#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "text/chat_k2.h"
#include "text/sbuf.h"

enum { C_NONE, C_SEC_BEGIN, C_SEC_END, C_CALL_BEGIN, C_ARG_BEGIN, C_CALL_END, C_IM_END, C_THINK, C_THINK_END, C_N };
enum { S_REASONING, S_CONTENT, S_SECTION, S_ID, S_ARGS, S_DONE };
#define MAX_ID 512

static const char *const CTL_TEXT[C_N] = {"",
                                          "<|tool_calls_section_begin|>",
                                          "<|tool_calls_section_end|>",
                                          "<|tool_call_begin|>",
                                          "<|tool_call_argument_begin|>",
                                          "<|tool_call_end|>",
                                          "<|im_end|>",
                                          "<think>",
                                          "</think>"};
static const int CTL_ID[C_N] = {-1,
                                LUNAR_K2_ID_TOOL_CALLS_SECTION_BEGIN,
                                LUNAR_K2_ID_TOOL_CALLS_SECTION_END,
                                LUNAR_K2_ID_TOOL_CALL_BEGIN,
                                LUNAR_K2_ID_TOOL_CALL_ARGUMENT_BEGIN,
                                LUNAR_K2_ID_TOOL_CALL_END,
                                LUNAR_K2_ID_IM_END,
                                LUNAR_K2_ID_THINK,
                                LUNAR_K2_ID_THINK_END};

struct lunar_k2_parser {
    int state, thinking, think_started;
    lunar_chat_event_fn emit;
    void *emit_ctx;
    lunar_sbuf hold; /* held partial UTF-8 of the current text channel */
    lunar_chat_ev_kind hold_kind;
    lunar_sbuf ws; /* S_SECTION: held whitespace at the start of a text run */
    int run_live;
    lunar_sbuf id;    /* S_ID: the call id so far */
    lunar_sbuf ahold; /* S_ARGS: held partial UTF-8 */
    lunar_sbuf aws;   /* S_ARGS: held whitespace (trailing, until more arguments text shows) */
    int args_any;     /* S_ARGS: some arguments text was emitted */
    int n_calls;
};

static void emit_event(lunar_k2_parser *p, lunar_chat_ev_kind kind, const char *s, size_t n) {
    int call = kind == LUNAR_CHAT_EV_TOOL_CALL_ARGS || kind == LUNAR_CHAT_EV_TOOL_CALL_END;
    lunar_chat_event ev = {kind, s, n, call ? p->n_calls - 1 : -1, NULL, NULL};
    p->emit(p->emit_ctx, &ev);
}

static void emit_held(lunar_k2_parser *p, lunar_sbuf *hold, lunar_chat_ev_kind kind, const char *s, size_t n) {
    if (n == 0) return;
    lunar_sbuf_put(hold, s, n);
    size_t ok = lunar_utf8_complete(hold->p, hold->len);
    if (ok == 0) return;
    emit_event(p, kind, hold->p, ok);
    memmove(hold->p, hold->p + ok, hold->len - ok);
    hold->len -= ok;
}

static void flush_hold(lunar_k2_parser *p) {
    if (p->hold.len) emit_event(p, p->hold_kind, p->hold.p, p->hold.len);
    p->hold.len = 0;
}

static void emit_text(lunar_k2_parser *p, lunar_chat_ev_kind kind, const char *s, size_t n) {
    if (n == 0) return;
    if (p->hold.len && p->hold_kind != kind) flush_hold(p);
    p->hold_kind = kind;
    emit_held(p, &p->hold, kind, s, n);
}

static int is_ws(char c) { return c && strchr(" \t\n\r\v\f", c) != NULL; }

lunar_k2_parser *lunar_k2_parser_new(int thinking, lunar_chat_event_fn emit, void *emit_ctx) {
    lunar_k2_parser *p = lunar_xcalloc(1, sizeof *p);
    p->thinking = thinking;
    p->state = thinking ? S_REASONING : S_CONTENT;
    p->emit = emit, p->emit_ctx = emit_ctx;
    return p;
}

void lunar_k2_parser_free(lunar_k2_parser *p) {
    if (!p) return;
    lunar_sbuf_free(&p->hold), lunar_sbuf_free(&p->ws), lunar_sbuf_free(&p->id);
    lunar_sbuf_free(&p->ahold), lunar_sbuf_free(&p->aws);
    free(p);
}

/* text in a text state */
static void stray_text(lunar_k2_parser *p, const char *s, size_t n) {
    if (n == 0) return;
    if (p->state == S_REASONING) {
        p->think_started = 1;
        emit_text(p, LUNAR_CHAT_EV_REASONING, s, n);
    } else if (p->state == S_CONTENT) {
        emit_text(p, LUNAR_CHAT_EV_CONTENT, s, n);
    } else if (p->state == S_SECTION) {
        size_t i = 0;
        while (i < n && is_ws(s[i])) i++;
        if (!p->run_live && i == n) {
            lunar_sbuf_put(&p->ws, s, n);
            return;
        }
        emit_text(p, LUNAR_CHAT_EV_CONTENT, p->ws.p, p->ws.len);
        p->ws.len = 0;
        p->run_live = 1;
        emit_text(p, LUNAR_CHAT_EV_CONTENT, s, n);
    }
}

static void args_text(lunar_k2_parser *p, const char *s, size_t n) {
    size_t a = 0, e = n;
    if (!p->args_any)
        while (a < n && is_ws(s[a])) a++; /* leading whitespace */
    while (e > a && is_ws(s[e - 1])) e--;
    if (e > a) {
        emit_held(p, &p->ahold, LUNAR_CHAT_EV_TOOL_CALL_ARGS, p->aws.p, p->aws.len);
        p->aws.len = 0;
        emit_held(p, &p->ahold, LUNAR_CHAT_EV_TOOL_CALL_ARGS, s + a, e - a);
        p->args_any = 1;
    }
    if (p->args_any) lunar_sbuf_put(&p->aws, s + e, n - e);
}

/* the id is complete: functions.NAME:IDX -> START; else 0 */
static int start_call(lunar_k2_parser *p) {
    const char *s = p->id.p ? p->id.p : "";
    size_t a = 0, e = p->id.len;
    while (a < e && is_ws(s[a])) a++;
    while (e > a && is_ws(s[e - 1])) e--;
    size_t d = e;
    while (d > a && s[d - 1] >= '0' && s[d - 1] <= '9') d--;
    if (d == e || d == a || s[d - 1] != ':') return 0;
    size_t na = a, ne = d - 1;
    if (ne - na > 10 && memcmp(s + na, "functions.", 10) == 0) na += 10;
    if (ne == na) return 0;
    for (size_t i = na; i < ne; i++)
        if (!(s[i] == '_' || s[i] == '-' || s[i] == '.' || (s[i] >= '0' && s[i] <= '9') ||
              ((s[i] | 0x20) >= 'a' && (s[i] | 0x20) <= 'z')))
            return 0;
    char *id = strndup(s + a, e - a), *name = strndup(s + na, ne - na);
    flush_hold(p);
    lunar_chat_event ev = {LUNAR_CHAT_EV_TOOL_CALL_START, NULL, 0, p->n_calls++, id, name};
    p->emit(p->emit_ctx, &ev);
    free(id), free(name);
    p->state = S_ARGS;
    p->args_any = 0;
    p->ahold.len = p->aws.len = 0;
    return 1;
}

/* the call in S_ID is not a call: its raw spelling becomes content */
static void degrade_id(lunar_k2_parser *p, int with_arg_begin) {
    p->state = S_SECTION;
    lunar_sbuf raw = {0};
    lunar_sbuf_puts(&raw, CTL_TEXT[C_CALL_BEGIN]);
    lunar_sbuf_put(&raw, p->id.p, p->id.len);
    if (with_arg_begin) lunar_sbuf_puts(&raw, CTL_TEXT[C_ARG_BEGIN]);
    p->id.len = 0;
    stray_text(p, raw.p, raw.len);
    lunar_sbuf_free(&raw);
}

static void end_call(lunar_k2_parser *p, int complete) {
    if (complete && !p->args_any) emit_held(p, &p->ahold, LUNAR_CHAT_EV_TOOL_CALL_ARGS, "{}", 2);
    if (p->ahold.len) emit_event(p, LUNAR_CHAT_EV_TOOL_CALL_ARGS, p->ahold.p, p->ahold.len);
    p->ahold.len = p->aws.len = 0;
    emit_event(p, LUNAR_CHAT_EV_TOOL_CALL_END, NULL, 0);
    p->state = S_SECTION;
}

static int classify(int id, const char *s, size_t n) {
    for (int c = 1; c < C_N; c++) {
        if (id == CTL_ID[c]) return c;
        if (id == -1 && n == strlen(CTL_TEXT[c]) && memcmp(s, CTL_TEXT[c], n) == 0) return c;
    }
    return C_NONE;
}

static void on_control(lunar_k2_parser *p, int c) {
    switch (p->state) {
    case S_REASONING:
        if (c == C_THINK && !p->think_started) p->think_started = 1;
        else if (c == C_THINK_END) p->state = S_CONTENT;
        else if (c == C_SEC_BEGIN) p->state = S_SECTION;
        else if (c == C_CALL_BEGIN) p->state = S_ID, p->id.len = 0;
        else if (c == C_IM_END) p->state = S_DONE;
        else stray_text(p, CTL_TEXT[c], strlen(CTL_TEXT[c]));
        return;
    case S_CONTENT:
    case S_SECTION:
        if (c == C_SEC_BEGIN) p->state = S_SECTION;
        else if (c == C_CALL_BEGIN) p->state = S_ID, p->id.len = 0;
        else if (c == C_IM_END) p->state = S_DONE;
        else if (c == C_SEC_END && p->state == S_SECTION) { /* the section ends; text after it is content */
        } else stray_text(p, CTL_TEXT[c], strlen(CTL_TEXT[c]));
        return;
    case S_ID:
        if (c == C_ARG_BEGIN) {
            if (!start_call(p)) degrade_id(p, 1);
            return;
        }
        degrade_id(p, 0);
        on_control(p, c);
        return;
    case S_ARGS:
        if (c == C_CALL_END) end_call(p, 1);
        else if (c == C_CALL_BEGIN) end_call(p, 1), p->state = S_ID, p->id.len = 0;
        else if (c == C_SEC_END) end_call(p, 1);
        else if (c == C_IM_END) end_call(p, 1), p->state = S_DONE;
        return; /* anything else inside arguments: dropped */
    default: return;
    }
}

void lunar_k2_parser_feed(lunar_k2_parser *p, int id, const char *s, size_t n) {
    if (p->state == S_DONE) return;
    int c = classify(id, s, n);
    if (c == C_NONE) {
        if (p->state == S_ID) {
            lunar_sbuf_put(&p->id, s, n);
            if (p->id.len > MAX_ID) degrade_id(p, 0);
        } else if (p->state == S_ARGS) {
            args_text(p, s, n);
        } else {
            stray_text(p, s, n);
        }
        return;
    }
    p->ws.len = 0, p->run_live = 0; /* a text run ends */
    on_control(p, c);
}

static void feed_any(void *p, int id, const char *s, size_t n) { lunar_k2_parser_feed(p, id, s, n); }

void lunar_k2_parser_feed_text(lunar_k2_parser *p, const char *s, size_t n) {
    lunar_chat_feed_split(p, feed_any, CTL_TEXT, C_N, s, n);
}

void lunar_k2_parser_finish(lunar_k2_parser *p, int truncated) {
    if (p->state == S_ID) degrade_id(p, 0);
    if (p->state == S_ARGS) end_call(p, !truncated);
    flush_hold(p);
    const char *reason = truncated ? "length" : p->n_calls ? "tool_calls" : "stop";
    p->state = S_DONE;
    emit_event(p, LUNAR_CHAT_EV_FINISH, reason, strlen(reason));
}
