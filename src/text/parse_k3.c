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
    /* the open call */
    lunar_sbuf call_raw, args, arg_val, json_block;
    char *call_name, *arg_key, *arg_type;
    int n_args, in_arg, in_json, has_json;
    int n_calls;
};

static void emit_event(lunar_k3_parser *p, lunar_chat_ev_kind kind, const char *s, size_t n) {
    lunar_chat_event ev = {kind, s, n, -1, NULL, NULL};
    p->emit(p->emit_ctx, &ev);
}

/* length of the longest prefix of s[0..n) that does not end inside a UTF-8 sequence */
static size_t utf8_complete(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = n, k = 0;
    while (i > 0 && k < 4 && (u[i - 1] & 0xc0) == 0x80) i--, k++;
    if (i == 0) return n;
    unsigned char lead = u[i - 1];
    size_t need = lead >= 0xf0 ? 4 : lead >= 0xe0 ? 3 : lead >= 0xc0 ? 2 : 1;
    if (need > 1 && k + 1 < need) return i - 1;
    return n;
}

static void flush_hold(lunar_k3_parser *p) {
    if (p->hold.len) emit_event(p, p->hold_kind, p->hold.p, p->hold.len);
    p->hold.len = 0;
}

static void emit_text(lunar_k3_parser *p, lunar_chat_ev_kind kind, const char *s, size_t n) {
    if (n == 0) return;
    if (p->hold.len && p->hold_kind != kind) flush_hold(p);
    p->hold_kind = kind;
    lunar_sbuf_put(&p->hold, s, n);
    size_t ok = utf8_complete(p->hold.p, p->hold.len);
    if (ok == 0) return;
    emit_event(p, kind, p->hold.p, ok);
    memmove(p->hold.p, p->hold.p + ok, p->hold.len - ok);
    p->hold.len -= ok;
}

lunar_k3_parser *lunar_k3_parser_new(int in_reasoning, lunar_chat_event_fn emit, void *emit_ctx,
                                     lunar_chat_rand_fn rand, void *rand_ctx) {
    lunar_k3_parser *p = lunar_xcalloc(1, sizeof *p);
    p->state = in_reasoning ? S_REASONING : S_CONTENT;
    p->emit = emit, p->emit_ctx = emit_ctx, p->rand = rand, p->rand_ctx = rand_ctx;
    return p;
}

static void reset_call(lunar_k3_parser *p) {
    p->call_raw.len = p->args.len = p->arg_val.len = p->json_block.len = 0;
    free(p->call_name), free(p->arg_key), free(p->arg_type);
    p->call_name = p->arg_key = p->arg_type = NULL;
    p->n_args = p->in_arg = p->in_json = p->has_json = 0;
}

void lunar_k3_parser_free(lunar_k3_parser *p) {
    if (!p) return;
    reset_call(p);
    lunar_sbuf_free(&p->hold), lunar_sbuf_free(&p->tag), lunar_sbuf_free(&p->call_raw);
    lunar_sbuf_free(&p->args), lunar_sbuf_free(&p->arg_val), lunar_sbuf_free(&p->json_block);
    free(p);
}

/* where stray text goes in the current state */
static void stray_text(lunar_k3_parser *p, const char *s, size_t n) {
    switch (p->state) {
    case S_REASONING: emit_text(p, LUNAR_CHAT_EV_REASONING, s, n); break;
    case S_CONTENT: emit_text(p, LUNAR_CHAT_EV_CONTENT, s, n); break;
    case S_BETWEEN:
    case S_TOOLS:
        if (!lunar_py_is_blank(s, n)) emit_text(p, LUNAR_CHAT_EV_CONTENT, s, n);
        break;
    case S_CALL:
        if (p->in_arg) lunar_sbuf_put(&p->arg_val, s, n);
        else if (p->in_json) lunar_sbuf_put(&p->json_block, s, n);
        break;
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

/* an open call that cannot complete: its raw text becomes content */
static void degrade_call(lunar_k3_parser *p) {
    p->state = S_TOOLS;
    emit_text(p, LUNAR_CHAT_EV_CONTENT, p->call_raw.p, p->call_raw.len);
    reset_call(p);
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

static void finish_arg(lunar_k3_parser *p) {
    lunar_sbuf_puts(&p->args, p->n_args ? ", " : "{");
    lunar_json_py_string(p->arg_key, strlen(p->arg_key), &p->args);
    lunar_sbuf_puts(&p->args, ": ");
    const char *v = p->arg_val.p ? p->arg_val.p : "";
    size_t n = p->arg_val.len;
    json_t *j = NULL;
    if (strncmp(p->arg_type, "str", 3) != 0) j = json_loadb(v, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    if (j) {
        lunar_json_py_dump(j, 0, &p->args);
        json_decref(j);
    } else if (strncmp(p->arg_type, "str", 3) == 0) {
        lunar_json_py_string(v, n, &p->args);
    } else { /* undecodable: the stripped raw text */
        size_t a = 0, b = n;
        while (a < b && lunar_py_is_blank(v + a, 1)) a++;
        while (b > a && lunar_py_is_blank(v + b - 1, 1)) b--;
        lunar_json_py_string(v + a, b - a, &p->args);
    }
    p->n_args++;
    p->in_arg = 0;
    free(p->arg_key), free(p->arg_type);
    p->arg_key = p->arg_type = NULL;
    p->arg_val.len = 0;
}

static void commit_call(lunar_k3_parser *p) {
    if (p->in_arg) finish_arg(p);
    lunar_sbuf args = {0};
    if (p->n_args) {
        lunar_sbuf_put(&args, p->args.p, p->args.len);
        lunar_sbuf_putc(&args, '}');
    } else if (p->has_json) {
        json_t *j = json_loadb(p->json_block.p, p->json_block.len, JSON_ALLOW_NUL, NULL);
        if (json_is_object(j)) lunar_json_py_dump(j, 0, &args);
        else lunar_sbuf_put(&args, p->json_block.p, p->json_block.len); /* as the model wrote it */
        json_decref(j);
    } else {
        lunar_sbuf_puts(&args, "{}");
    }
    unsigned char rnd[16];
    char id[40] = "call_";
    p->rand(p->rand_ctx, rnd, sizeof rnd);
    for (int i = 0; i < 16; i++) snprintf(id + 5 + 2 * i, 3, "%02x", rnd[i]);
    flush_hold(p);
    lunar_chat_event ev = {LUNAR_CHAT_EV_TOOL_CALL, args.p, args.len, p->n_calls++, id, p->call_name};
    p->emit(p->emit_ctx, &ev);
    lunar_sbuf_free(&args);
    reset_call(p);
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
    if (p->state == S_CALL) {
        /* keep the call's raw text for a possible degrade */
        lunar_sbuf_puts(&p->call_raw, CTL_TEXT[p->tag_ctl]);
        lunar_sbuf_put(&p->call_raw, p->tag.p, p->tag.len);
        lunar_sbuf_puts(&p->call_raw, LUNAR_K3_SEP);
    }
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
        if (IS(1, "call") && tag_attr(&t, "tool") && *tag_attr(&t, "tool")) {
            reset_call(p);
            p->state = S_CALL;
            p->call_name = strdup(tag_attr(&t, "tool"));
            lunar_sbuf_puts(&p->call_raw, LUNAR_K3_OPEN);
            lunar_sbuf_put(&p->call_raw, p->tag.p, p->tag.len);
            lunar_sbuf_puts(&p->call_raw, LUNAR_K3_SEP);
        } else if (IS(0, "tools")) p->state = S_BETWEEN;
        else if (IS(0, "message")) p->state = S_END;
        else handled = 0;
        break;
    case S_CALL:
        if (!p->in_arg && !p->in_json && IS(1, "argument") && tag_attr(&t, "key")) {
            p->in_arg = 1;
            p->arg_key = strdup(tag_attr(&t, "key"));
            p->arg_type = strdup(tag_attr(&t, "type") ? tag_attr(&t, "type") : "string");
            p->arg_val.len = 0;
        } else if (p->in_arg && IS(0, "argument")) {
            finish_arg(p);
        } else if (!p->in_arg && !p->in_json && !p->has_json && !p->n_args && IS(1, "json")) {
            p->in_json = 1;
        } else if (p->in_json && IS(0, "json")) {
            p->in_json = 0, p->has_json = 1;
        } else if (!p->in_json && IS(0, "call")) {
            commit_call(p);
        } else if (!p->in_json && (IS(0, "tools") || IS(0, "message"))) {
            commit_call(p); /* a missing close call: the structure around it is still clear */
            p->state = IS(0, "tools") ? S_BETWEEN : S_END;
        } else {
            handled = 0;
        }
        break;
    default: break;
    }
#undef IS
    if (!bad) free_tag(&t);
    if (handled) {
        p->tag_ctl = C_NONE;
        p->tag.len = 0;
    } else {
        degrade_tag(p, 1);
    }
}

/* inside a call, an unterminated tag's raw text belongs to the call's raw text */
static void record_unterminated(lunar_k3_parser *p) {
    if (p->state != S_CALL) return;
    lunar_sbuf_puts(&p->call_raw, CTL_TEXT[p->tag_ctl]);
    lunar_sbuf_put(&p->call_raw, p->tag.p, p->tag.len);
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
    if (c == C_NONE) {
        if (p->tag_ctl != C_NONE) {
            lunar_sbuf_put(&p->tag, s, n);
            if (p->tag.len > MAX_TAG) {
                record_unterminated(p);
                degrade_tag(p, 0);
            }
            return;
        }
        if (p->state == S_CALL) {
            lunar_sbuf_put(&p->call_raw, s, n);
            if (p->in_arg) lunar_sbuf_put(&p->arg_val, s, n);
            else if (p->in_json) lunar_sbuf_put(&p->json_block, s, n);
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
        record_unterminated(p);
        degrade_tag(p, 0);
    }
    if (c == C_EOM) {
        if (p->state == S_CALL) commit_call(p);
        p->state = S_DONE;
        return;
    }
    if (c == C_SEP) return; /* a bare separator carries nothing */
    p->tag_ctl = c;
    p->tag.len = 0;
}

void lunar_k3_parser_feed_text(lunar_k3_parser *p, const char *s, size_t n) {
    size_t i = 0, start = 0;
    while (i < n) {
        int c = C_NONE;
        if (s[i] == '<')
            for (int k = C_OPEN; k <= C_EOM; k++) {
                size_t l = strlen(CTL_TEXT[k]);
                if (n - i >= l && memcmp(s + i, CTL_TEXT[k], l) == 0) c = k;
            }
        if (c == C_NONE) {
            i++;
            continue;
        }
        if (i > start) lunar_k3_parser_feed(p, -2, s + start, i - start);
        lunar_k3_parser_feed(p, -1, CTL_TEXT[c], strlen(CTL_TEXT[c]));
        i += strlen(CTL_TEXT[c]);
        start = i;
    }
    if (n > start) lunar_k3_parser_feed(p, -2, s + start, n - start);
}

void lunar_k3_parser_finish(lunar_k3_parser *p, int truncated) {
    if (p->tag_ctl != C_NONE) {
        record_unterminated(p);
        degrade_tag(p, 0);
    }
    if (p->state == S_CALL) degrade_call(p);
    flush_hold(p);
    const char *reason = truncated ? "length" : p->n_calls ? "tool_calls" : "stop";
    p->state = S_DONE;
    emit_event(p, LUNAR_CHAT_EV_FINISH, reason, strlen(reason));
}
