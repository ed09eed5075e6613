/* Collects and checks the events of a chat output parser (text/chat_parse.h), for the parser tests and the
 * fuzz target: reassembles reasoning, content and calls ("[index name arguments]" per call, at its END) and
 * counts violations of the event model (bad_order: START/ARGS/END out of order, a call's name or index wrong,
 * text inside a call, anything after FINISH, FINISH missing or twice; bad_utf8: a delta ending inside a
 * UTF-8 character). Header-only so that the libFuzzer build (library sources only) can use it. */
#ifndef LUNAR_TESTS_CHAT_EVENTS_H
#define LUNAR_TESTS_CHAT_EVENTS_H

#include <stdlib.h>
#include <string.h>

#include "text/chat_parse.h"
#include "text/sbuf.h"

typedef struct {
    lunar_sbuf reasoning, content, calls, finish, ids;
    lunar_sbuf cur_args, cur_name;
    int n_events, n_started, open_call, finished, bad_order, bad_utf8;
} chat_collect;

static inline void chat_collect_init(chat_collect *c) {
    memset(c, 0, sizeof *c);
    c->open_call = -1;
}

static inline void chat_collect_free(chat_collect *c) {
    lunar_sbuf_free(&c->reasoning), lunar_sbuf_free(&c->content), lunar_sbuf_free(&c->calls);
    lunar_sbuf_free(&c->finish), lunar_sbuf_free(&c->ids), lunar_sbuf_free(&c->cur_args);
    lunar_sbuf_free(&c->cur_name);
}

/* s[0..n) does not end (or start) inside a UTF-8 sequence */
static inline int chat_utf8_whole(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        if ((u[i] & 0xc0) == 0x80) return 0;
        size_t need = u[i] < 0x80 ? 1 : u[i] >= 0xf0 ? 4 : u[i] >= 0xe0 ? 3 : 2;
        if (i + need > n) return 0;
        for (size_t k = 1; k < need; k++)
            if ((u[i + k] & 0xc0) != 0x80) return 0;
        i += need;
    }
    return 1;
}

static inline void chat_collect_event(void *ctx, const lunar_chat_event *ev) {
    chat_collect *c = ctx;
    c->n_events++;
    if (c->finished) c->bad_order++;
    switch (ev->kind) {
    case LUNAR_CHAT_EV_REASONING:
    case LUNAR_CHAT_EV_CONTENT:
        if (c->open_call != -1 || ev->len == 0 || ev->index != -1) c->bad_order++;
        c->bad_utf8 += !chat_utf8_whole(ev->text, ev->len);
        lunar_sbuf_put(ev->kind == LUNAR_CHAT_EV_REASONING ? &c->reasoning : &c->content, ev->text, ev->len);
        break;
    case LUNAR_CHAT_EV_TOOL_CALL_START:
        if (c->open_call != -1 || ev->index != c->n_started || !ev->id || !*ev->id || !ev->name || !*ev->name)
            c->bad_order++;
        c->open_call = ev->index;
        c->n_started++;
        c->cur_args.len = c->cur_name.len = 0;
        lunar_sbuf_puts(&c->cur_name, ev->name ? ev->name : "?");
        lunar_sbuf_printf(&c->ids, "%s%s", c->ids.len ? " " : "", ev->id ? ev->id : "?");
        break;
    case LUNAR_CHAT_EV_TOOL_CALL_ARGS:
        if (c->open_call == -1 || ev->index != c->open_call || ev->len == 0) c->bad_order++;
        c->bad_utf8 += !chat_utf8_whole(ev->text, ev->len);
        lunar_sbuf_put(&c->cur_args, ev->text, ev->len);
        break;
    case LUNAR_CHAT_EV_TOOL_CALL_END:
        if (c->open_call == -1 || ev->index != c->open_call) c->bad_order++;
        lunar_sbuf_printf(&c->calls, "[%d %s ", ev->index, c->cur_name.p ? c->cur_name.p : "");
        lunar_sbuf_put(&c->calls, c->cur_args.p, c->cur_args.len);
        lunar_sbuf_putc(&c->calls, ']');
        c->open_call = -1;
        break;
    case LUNAR_CHAT_EV_FINISH:
        if (c->open_call != -1) c->bad_order++;
        c->finished++;
        lunar_sbuf_put(&c->finish, ev->text, ev->len);
        break;
    default: c->bad_order++;
    }
}

/* after the parser's finish: the sequence was complete and well-ordered */
static inline int chat_collect_ok(const chat_collect *c) {
    return c->bad_order == 0 && c->finished == 1 && c->open_call == -1;
}

#endif
