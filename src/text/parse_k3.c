#include "text/parse_k3.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "text/chat.h"
#include "text/chat_k3.h"
#include "text/json_py.h"
#include "text/sbuf.h"

enum { C_NONE, C_OPEN, C_CLOSE, C_SEP, C_EOM };
enum { S_REASONING, S_CONTENT, S_BETWEEN, S_TOOLS, S_CALL, S_END, S_DONE };
#define MAX_TAG 4096

static const char *const CTL_TEXT[] = {"", LUNAR_K3_OPEN, LUNAR_K3_CLOSE, LUNAR_K3_SEP, LUNAR_K3_END_OF_MSG};

struct lunar_k3_parser {
    int state;
    lunar_chat_event_fn emit;
    void *emit_ctx;
    lunar_chat_rand_fn rand;
    void *rand_ctx;
    /* held partial UTF-8 of the current text channel */
    lunar_sbuf hold;
    lunar_chat_ev_kind hold_kind;
    /* a tag being read: control + text up to <|sep|> */
    int tag_ctl;
    lunar_sbuf tag;
    /* the open call (state S_CALL): its START has been emitted */
    lunar_sbuf ahold;        /* held partial UTF-8 of the arguments text */
    lunar_sbuf arg_val;      /* a non-string argument's raw value, decoded at its end */
    lunar_sbuf json_block;   /* a <|open|>json block's raw text */
    lunar_sbuf ws;           /* S_BETWEEN/S_TOOLS: held whitespace at the start of a text run */
    int run_live;            /* ... and the run has shown non-whitespace */
    int n_args, in_arg, arg_str, in_json, has_json;
    int n_calls;
};

static void emit_event(lunar_k3_parser *p, lunar_chat_ev_kind kind, const char *s, size_t n) {
    int call = kind == LUNAR_CHAT_EV_TOOL_CALL_ARGS || kind == LUNAR_CHAT_EV_TOOL_CALL_END;
    lunar_chat_event ev = {kind, s, n, call ? p->n_calls - 1 : -1, NULL, NULL};
    p->emit(p->emit_ctx, &ev);
}

static void flush_hold(lunar_k3_parser *p) {
    if (p->hold.len) emit_event(p, p->hold_kind, p->hold.p, p->hold.len);
    p->hold.len = 0;
}

/* appends to a hold buffer and emits its complete-UTF-8 prefix as `kind` */
static void emit_held(lunar_k3_parser *p, lunar_sbuf *hold, lunar_chat_ev_kind kind, const char *s, size_t n) {
    if (n == 0) return;
    lunar_sbuf_put(hold, s, n);
    size_t ok = lunar_utf8_complete(hold->p, hold->len);
    if (ok == 0) return;
    emit_event(p, kind, hold->p, ok);
    memmove(hold->p, hold->p + ok, hold->len - ok);
    hold->len -= ok;
}

static void emit_text(lunar_k3_parser *p, lunar_chat_ev_kind kind, const char *s, size_t n) {
    if (n == 0) return;
    if (p->hold.len && p->hold_kind != kind) flush_hold(p);
    p->hold_kind = kind;
    emit_held(p, &p->hold, kind, s, n);
}

static void emit_args(lunar_k3_parser *p, const char *s, size_t n) {
    emit_held(p, &p->ahold, LUNAR_CHAT_EV_TOOL_CALL_ARGS, s, n);
}

static void emit_args_s(lunar_k3_parser *p, const char *s) { emit_args(p, s, strlen(s)); }

/* a piece of a string argument's value: JSON-escaped, without quotes */
static void emit_args_escaped(lunar_k3_parser *p, const char *s, size_t n) {
    if (n == 0) return;
    lunar_sbuf b = {0};
    lunar_json_py_string(s, n, &b);
    emit_args(p, b.p + 1, b.len - 2);
    lunar_sbuf_free(&b);
}

lunar_k3_parser *lunar_k3_parser_new(int in_reasoning, lunar_chat_event_fn emit, void *emit_ctx,
                                     lunar_chat_rand_fn rand, void *rand_ctx) {
    lunar_k3_parser *p = lunar_xcalloc(1, sizeof *p);
    p->state = in_reasoning ? S_REASONING : S_CONTENT;
    p->emit = emit, p->emit_ctx = emit_ctx, p->rand = rand, p->rand_ctx = rand_ctx;
    return p;
}

void lunar_k3_parser_free(lunar_k3_parser *p) {
    if (!p) return;
    lunar_sbuf_free(&p->hold), lunar_sbuf_free(&p->tag), lunar_sbuf_free(&p->ahold);
    lunar_sbuf_free(&p->arg_val), lunar_sbuf_free(&p->json_block), lunar_sbuf_free(&p->ws);
    free(p);
}

static int ascii_blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!memchr(" \t\n\r\v\f", s[i], 6)) return 0;
    return 1;
}

/* where stray text goes in the current state */
static void stray_text(lunar_k3_parser *p, const char *s, size_t n) {
    switch (p->state) {
    case S_REASONING: emit_text(p, LUNAR_CHAT_EV_REASONING, s, n); break;
    case S_CONTENT: emit_text(p, LUNAR_CHAT_EV_CONTENT, s, n); break;
    case S_BETWEEN:
    case S_TOOLS:
        /* text outside the channels is content, unless a whole run of text (between two control tokens) is
         * ASCII whitespace: leading whitespace is held until the run shows more */
        if (!p->run_live && ascii_blank(s, n)) {
            lunar_sbuf_put(&p->ws, s, n);
            break;
        }
        emit_text(p, LUNAR_CHAT_EV_CONTENT, p->ws.p, p->ws.len);
        p->ws.len = 0;
        p->run_live = 1;
        emit_text(p, LUNAR_CHAT_EV_CONTENT, s, n);
        break;
    case S_CALL:
        if (p->in_arg && p->arg_str) emit_args_escaped(p, s, n);
        else if (p->in_arg) lunar_sbuf_put(&p->arg_val, s, n);
        else if (p->in_json) lunar_sbuf_put(&p->json_block, s, n);
        break; /* between arguments: dropped */
    default: break;
    }
}

/* the raw spelling of the pending tag, as stray text */
static void degrade_tag(lunar_k3_parser *p, int with_sep) {
    lunar_sbuf raw = {0};
    lunar_sbuf_puts(&raw, CTL_TEXT[p->tag_ctl]);
    lunar_sbuf_put(&raw, p->tag.p, p->tag.len);
    if (with_sep) lunar_sbuf_puts(&raw, LUNAR_K3_SEP);
    p->tag_ctl = C_NONE;
    p->tag.len = 0;
    stray_text(p, raw.p, raw.len);
    lunar_sbuf_free(&raw);
}

/* Parses `name( key="value")*` into name and up to 4 attributes (values unescaped). 0 on success. */
typedef struct {
    char name[32];
    int n;
    char key[4][32];
    char *val[4];
} tag_info;

static void free_tag(tag_info *t) {
    for (int i = 0; i < t->n; i++) free(t->val[i]);
}

static int parse_tag(const char *s, size_t n, tag_info *t) {
    memset(t, 0, sizeof *t);
    size_t i = 0;
    while (i < n && s[i] != ' ') i++;
    if (i == 0 || i >= sizeof t->name) return -1;
    memcpy(t->name, s, i);
    while (i < n) {
        if (s[i] != ' ' || t->n == 4) return -1;
        while (i < n && s[i] == ' ') i++;
        size_t k = i;
        while (i < n && s[i] != '=') i++;
        if (i == k || i - k >= 32 || i + 1 >= n || s[i + 1] != '"') return -1;
        memcpy(t->key[t->n], s + k, i - k);
        i += 2;
        size_t v = i;
        while (i < n && s[i] != '"') i++;
        if (i >= n) return -1;
        /* unescape &quot; then &amp; */
        lunar_sbuf b = {0};
        for (size_t j = v; j < i;) {
            if (i - j >= 6 && memcmp(s + j, "&quot;", 6) == 0) lunar_sbuf_putc(&b, '"'), j += 6;
            else lunar_sbuf_putc(&b, s[j]), j++;
        }
        lunar_sbuf c = {0};
        for (size_t j = 0; j < b.len;) {
            if (b.len - j >= 5 && memcmp(b.p + j, "&amp;", 5) == 0) lunar_sbuf_putc(&c, '&'), j += 5;
            else lunar_sbuf_putc(&c, b.p[j]), j++;
        }
        lunar_sbuf_free(&b);
        t->val[t->n++] = lunar_sbuf_take(&c);
        i++;
    }
    return 0;
}

static const char *tag_attr(const tag_info *t, const char *key) {
    for (int i = 0; i < t->n; i++)
        if (strcmp(t->key[i], key) == 0) return t->val[i];
    return NULL;
}

static void start_call(lunar_k3_parser *p, const char *name) {
    unsigned char rnd[16];
    char id[40] = "call_";
    p->rand(p->rand_ctx, rnd, sizeof rnd);
    for (int i = 0; i < 16; i++) snprintf(id + 5 + 2 * i, 3, "%02x", rnd[i]);
    flush_hold(p);
    p->state = S_CALL;
    p->n_args = p->in_arg = p->arg_str = p->in_json = p->has_json = 0;
    p->arg_val.len = p->json_block.len = p->ahold.len = 0;
    lunar_chat_event ev = {LUNAR_CHAT_EV_TOOL_CALL_START, NULL, 0, p->n_calls++, id, name};
    p->emit(p->emit_ctx, &ev);
}

static void start_arg(lunar_k3_parser *p, const char *key, const char *type) {
    emit_args_s(p, p->n_args ? ", " : "{");
    lunar_sbuf b = {0};
    lunar_json_py_string(key, strlen(key), &b);
    lunar_sbuf_puts(&b, ": ");
    emit_args(p, b.p, b.len);
    lunar_sbuf_free(&b);
    p->in_arg = 1;
    p->arg_str = strncmp(type, "str", 3) == 0;
    p->arg_val.len = 0;
    if (p->arg_str) emit_args_s(p, "\"");
}

static void finish_arg(lunar_k3_parser *p) {
    if (p->arg_str) {
        emit_args_s(p, "\"");
    } else {
        const char *v = p->arg_val.p ? p->arg_val.p : "";
        size_t n = p->arg_val.len;
        lunar_sbuf b = {0};
        json_t *j = json_loadb(v, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
        if (j) {
            lunar_json_py_dump(j, 0, &b);
            json_decref(j);
        } else { /* undecodable: the stripped raw text */
            size_t a = 0, e = n;
            while (a < e && lunar_py_is_blank(v + a, 1)) a++;
            while (e > a && lunar_py_is_blank(v + e - 1, 1)) e--;
            lunar_json_py_string(v + a, e - a, &b);
        }
        emit_args(p, b.p, b.len);
        lunar_sbuf_free(&b);
    }
    p->n_args++;
    p->in_arg = 0;
    p->arg_val.len = 0;
}

static void finish_json(lunar_k3_parser *p) {
    json_t *j = json_loadb(p->json_block.p ? p->json_block.p : "", p->json_block.len, JSON_ALLOW_NUL, NULL);
    lunar_sbuf b = {0};
    if (json_is_object(j)) lunar_json_py_dump(j, 0, &b);
    else lunar_sbuf_put(&b, p->json_block.p, p->json_block.len); /* as the model wrote it */
    json_decref(j);
    emit_args(p, b.p, b.len);
    lunar_sbuf_free(&b);
    p->in_json = 0, p->has_json = 1;
}

/* the open call ends. complete: close what is open (the arguments object becomes whole); else (truncated)
 * only what was already emitted stands. */
static void end_call(lunar_k3_parser *p, int complete) {
    if (complete) {
        if (p->in_arg) finish_arg(p);
        if (p->in_json) finish_json(p);
        if (p->n_args) emit_args_s(p, "}");
        else if (!p->has_json) emit_args_s(p, "{}");
    }
    if (p->ahold.len) emit_event(p, LUNAR_CHAT_EV_TOOL_CALL_ARGS, p->ahold.p, p->ahold.len);
    p->ahold.len = 0;
    emit_event(p, LUNAR_CHAT_EV_TOOL_CALL_END, NULL, 0);
    p->in_arg = p->in_json = 0;
    p->state = S_TOOLS;
}

/* a complete tag <ctl>text<|sep|> */
static void on_tag(lunar_k3_parser *p) {
    int open = p->tag_ctl == C_OPEN;
    tag_info t;
    int bad = parse_tag(p->tag.p ? p->tag.p : "", p->tag.len, &t) != 0;
    const char *nm = bad ? "" : t.name;
#define IS(o, name) (open == (o) && strcmp(nm, name) == 0)
    int handled = 1;
    switch (p->state) {
    case S_REASONING:
        if (IS(0, "think")) p->state = S_BETWEEN;
        else if (IS(1, "response")) p->state = S_CONTENT;
        else if (IS(1, "tools")) p->state = S_TOOLS;
        else if (IS(0, "message")) p->state = S_END;
        else handled = 0;
        break;
    case S_BETWEEN:
    case S_CONTENT:
        if (p->state == S_BETWEEN && IS(1, "response")) p->state = S_CONTENT;
        else if (p->state == S_CONTENT && IS(0, "response")) p->state = S_BETWEEN;
        else if (IS(1, "tools")) p->state = S_TOOLS;
        else if (IS(0, "message")) p->state = S_END;
        else handled = 0;
        break;
    case S_TOOLS:
        if (IS(1, "call") && tag_attr(&t, "tool") && *tag_attr(&t, "tool")) start_call(p, tag_attr(&t, "tool"));
        else if (IS(0, "tools")) p->state = S_BETWEEN;
        else if (IS(0, "message")) p->state = S_END;
        else handled = 0;
        break;
    case S_CALL:
        if (!p->in_arg && !p->in_json && !p->has_json && IS(1, "argument") && tag_attr(&t, "key")) {
            start_arg(p, tag_attr(&t, "key"), tag_attr(&t, "type") ? tag_attr(&t, "type") : "string");
        } else if (p->in_arg && IS(0, "argument")) {
            finish_arg(p);
        } else if (!p->in_arg && !p->in_json && !p->has_json && !p->n_args && IS(1, "json")) {
            p->in_json = 1;
            p->json_block.len = 0;
        } else if (p->in_json && IS(0, "json")) {
            finish_json(p);
        } else if (!p->in_json && IS(0, "call")) {
            end_call(p, 1);
        } else if (!p->in_json && (IS(0, "tools") || IS(0, "message"))) {
            end_call(p, 1); /* a missing close call: the structure around it is still clear */
            p->state = IS(0, "tools") ? S_BETWEEN : S_END;
        } else {
            handled = 0;
        }
        break;
    default: break;
    }
#undef IS
    free_tag(&t); /* also after a failed parse: values read before the failure */
    if (handled) {
        p->tag_ctl = C_NONE;
        p->tag.len = 0;
    } else {
        degrade_tag(p, 1);
    }
}

static int classify(int id, const char *s, size_t n) {
    if (id == LUNAR_K3_ID_OPEN) return C_OPEN;
    if (id == LUNAR_K3_ID_CLOSE) return C_CLOSE;
    if (id == LUNAR_K3_ID_SEP) return C_SEP;
    if (id == LUNAR_K3_ID_END_OF_MSG) return C_EOM;
    if (id != -1) return C_NONE;
    for (int c = C_OPEN; c <= C_EOM; c++)
        if (n == strlen(CTL_TEXT[c]) && memcmp(s, CTL_TEXT[c], n) == 0) return c;
    return C_NONE;
}

void lunar_k3_parser_feed(lunar_k3_parser *p, int id, const char *s, size_t n) {
    if (p->state == S_DONE) return;
    int c = classify(id, s, n);
    if (c != C_NONE) p->ws.len = 0, p->run_live = 0; /* a text run ends */
    if (c == C_NONE) {
        if (p->tag_ctl != C_NONE) {
            lunar_sbuf_put(&p->tag, s, n);
            if (p->tag.len > MAX_TAG) degrade_tag(p, 0);
            return;
        }
        stray_text(p, s, n);
        return;
    }
    if (p->tag_ctl != C_NONE) {
        if (c == C_SEP) {
            on_tag(p);
            return;
        }
        degrade_tag(p, 0);
    }
    if (c == C_EOM) {
        if (p->state == S_CALL) end_call(p, 1);
        p->state = S_DONE;
        return;
    }
    if (c == C_SEP) return; /* a bare separator carries nothing */
    p->tag_ctl = c;
    p->tag.len = 0;
}

static void feed_any(void *p, int id, const char *s, size_t n) { lunar_k3_parser_feed(p, id, s, n); }

void lunar_k3_parser_feed_text(lunar_k3_parser *p, const char *s, size_t n) {
    lunar_chat_feed_split(p, feed_any, CTL_TEXT, C_EOM + 1, s, n);
}

void lunar_k3_parser_finish(lunar_k3_parser *p, int truncated) {
    if (p->state != S_DONE) {
        /* an unfinished tag inside a call is most likely its closing tag: dropped; elsewhere it is text */
        if (p->tag_ctl != C_NONE && p->state != S_CALL) degrade_tag(p, 0);
        p->tag_ctl = C_NONE;
        if (p->state == S_CALL) end_call(p, !truncated);
    }
    flush_hold(p);
    const char *reason = truncated ? "length" : p->n_calls ? "tool_calls" : "stop";
    p->state = S_DONE;
    emit_event(p, LUNAR_CHAT_EV_FINISH, reason, strlen(reason));
}
