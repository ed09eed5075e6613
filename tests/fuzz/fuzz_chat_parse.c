/* libFuzzer target for the streaming chat output parsers (text/parse_k3.h, text/parse_k2.h).
 * Input: byte 0 = flags (bit 0 thinking, bit 1 truncated, bits 2-5 max piece length - 1, 0 = unlimited),
 * byte 1 = a delimiter byte, then the model output. Each parser gets the output twice: all at once
 * (feed_text), and token by token: control spellings as their ids, the text between them cut after every
 * delimiter byte and at the max piece length. Invariants: no crash/leak/UB; both event sequences well-formed
 * (tests/chat_events.h: START < ARGS < END per call, one name per call, FINISH once, last); both feedings
 * reassemble to the same reasoning, content, calls and finish.
 * Run: build/fuzz_chat_parse -max_total_time=60 /tmp/cp tests/corpus/chat_parse */
#include <stdint.h>
#include <string.h>

#include "../chat_events.h"
#include "text/chat_k2.h"
#include "text/chat_k3.h"
#include "text/parse_k2.h"
#include "text/parse_k3.h"

typedef struct {
    const char *s;
    int id;
} ctl;

static const ctl K3_CTL[] = {{LUNAR_K3_OPEN, LUNAR_K3_ID_OPEN},
                             {LUNAR_K3_CLOSE, LUNAR_K3_ID_CLOSE},
                             {LUNAR_K3_SEP, LUNAR_K3_ID_SEP},
                             {LUNAR_K3_END_OF_MSG, LUNAR_K3_ID_END_OF_MSG}};
static const ctl K2_CTL[] = {{"<|tool_calls_section_begin|>", LUNAR_K2_ID_TOOL_CALLS_SECTION_BEGIN},
                             {"<|tool_calls_section_end|>", LUNAR_K2_ID_TOOL_CALLS_SECTION_END},
                             {"<|tool_call_begin|>", LUNAR_K2_ID_TOOL_CALL_BEGIN},
                             {"<|tool_call_argument_begin|>", LUNAR_K2_ID_TOOL_CALL_ARGUMENT_BEGIN},
                             {"<|tool_call_end|>", LUNAR_K2_ID_TOOL_CALL_END},
                             {"<|im_end|>", LUNAR_K2_ID_IM_END},
                             {"<think>", LUNAR_K2_ID_THINK},
                             {"</think>", LUNAR_K2_ID_THINK_END}};

static void rnd(void *ctx, unsigned char *buf, size_t n) { memset(buf, 0xab, n); }

typedef struct {
    int k2;
    void *p;
} parser;

static void feed(parser *q, int id, const char *s, size_t n) {
    if (q->k2) lunar_k2_parser_feed(q->p, id, s, n);
    else lunar_k3_parser_feed(q->p, id, s, n);
}

static int ctl_at(const ctl *t, int nt, const char *s, const char *e) {
    for (int k = 0; k < nt; k++)
        if ((size_t)(e - s) >= strlen(t[k].s) && memcmp(s, t[k].s, strlen(t[k].s)) == 0) return k;
    return -1;
}

static void run(int k2, int pieces, const char *s, size_t n, int flags, int delim, chat_collect *c) {
    chat_collect_init(c);
    parser q = {k2, k2 ? (void *)lunar_k2_parser_new(flags & 1, chat_collect_event, c)
                       : (void *)lunar_k3_parser_new(flags & 1, chat_collect_event, c, rnd, NULL)};
    const ctl *t = k2 ? K2_CTL : K3_CTL;
    int nt = k2 ? 8 : 4;
    size_t max = ((flags >> 2) & 15) ? (size_t)((flags >> 2) & 15) : (size_t)-1;
    if (!pieces) {
        if (k2) lunar_k2_parser_feed_text(q.p, s, n);
        else lunar_k3_parser_feed_text(q.p, s, n);
    } else {
        const char *e = s + n;
        while (s < e) {
            int hit = ctl_at(t, nt, s, e);
            if (hit >= 0) {
                feed(&q, t[hit].id, t[hit].s, strlen(t[hit].s));
                s += strlen(t[hit].s);
                continue;
            }
            size_t k = 0;
            while (s + k < e && k < max && ctl_at(t, nt, s + k, e) < 0) {
                k++;
                if ((unsigned char)s[k - 1] == delim) break;
            }
            feed(&q, 1000, s, k);
            s += k;
        }
    }
    if (k2) lunar_k2_parser_finish(q.p, (flags >> 1) & 1), lunar_k2_parser_free(q.p);
    else lunar_k3_parser_finish(q.p, (flags >> 1) & 1), lunar_k3_parser_free(q.p);
}

static int same(const lunar_sbuf *a, const lunar_sbuf *b) {
    return a->len == b->len && (a->len == 0 || memcmp(a->p, b->p, a->len) == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    int flags = data[0], delim = data[1];
    const char *s = (const char *)data + 2;
    size_t n = size - 2;
    for (int k2 = 0; k2 < 2; k2++) {
        chat_collect a, b;
        run(k2, 0, s, n, flags, delim, &a);
        run(k2, 1, s, n, flags, delim, &b);
        if (!chat_collect_ok(&a) || !chat_collect_ok(&b)) __builtin_trap();
        if (!same(&a.reasoning, &b.reasoning) || !same(&a.content, &b.content) || !same(&a.calls, &b.calls) ||
            !same(&a.finish, &b.finish) || !same(&a.ids, &b.ids))
            __builtin_trap();
        chat_collect_free(&a), chat_collect_free(&b);
    }
    return 0;
}
