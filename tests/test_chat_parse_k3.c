/* K3 output parser: the same output fed token by token (controls by id, text in k-byte pieces that may split
 * UTF-8) and all at once must reassemble to the same, expected reasoning / content / tool calls / finish. */
#include <string.h>

#include "test.h"
#include "text/chat_k3.h"
#include "text/parse_k3.h"
#include "text/sbuf.h"

typedef struct {
    lunar_sbuf reasoning, content, calls, finish;
    int n_events, bad_utf8;
} collect;

static int utf8_ok(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t need = u[i] < 0x80 ? 1 : u[i] >= 0xf0 ? 4 : u[i] >= 0xe0 ? 3 : 2;
        if (i + need > n) return 0;
        i += need;
    }
    return 1;
}

static void on_event(void *ctx, const lunar_chat_event *ev) {
    collect *c = ctx;
    c->n_events++;
    switch (ev->kind) {
    case LUNAR_CHAT_EV_REASONING:
        c->bad_utf8 += !utf8_ok(ev->text, ev->len);
        lunar_sbuf_put(&c->reasoning, ev->text, ev->len);
        break;
    case LUNAR_CHAT_EV_CONTENT:
        c->bad_utf8 += !utf8_ok(ev->text, ev->len);
        lunar_sbuf_put(&c->content, ev->text, ev->len);
        break;
    case LUNAR_CHAT_EV_TOOL_CALL:
        lunar_sbuf_printf(&c->calls, "[%d %s %.*s]", ev->index, ev->name, (int)ev->len, ev->text);
        CHECK(strncmp(ev->id, "call_", 5) == 0 && strlen(ev->id) == 37);
        break;
    case LUNAR_CHAT_EV_FINISH: lunar_sbuf_put(&c->finish, ev->text, ev->len); break;
    }
}

static void fake_rand(void *ctx, unsigned char *buf, size_t n) {
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(i * 37 + 11);
}

static const struct {
    const char *s;
    int id;
} CTL[] = {{LUNAR_K3_OPEN, LUNAR_K3_ID_OPEN},
           {LUNAR_K3_CLOSE, LUNAR_K3_ID_CLOSE},
           {LUNAR_K3_SEP, LUNAR_K3_ID_SEP},
           {LUNAR_K3_END_OF_MSG, LUNAR_K3_ID_END_OF_MSG}};

/* feeds out with controls as ids and text in `chunk`-byte pieces (chunk 0: all at once via feed_text) */
static void run(const char *out, int in_reasoning, int chunk, int truncated, collect *c) {
    memset(c, 0, sizeof *c);
    lunar_k3_parser *p = lunar_k3_parser_new(in_reasoning, on_event, c, fake_rand, NULL);
    if (chunk == 0) {
        lunar_k3_parser_feed_text(p, out, strlen(out));
    } else {
        const char *s = out;
        while (*s) {
            int hit = -1;
            for (int k = 0; k < 4; k++)
                if (strncmp(s, CTL[k].s, strlen(CTL[k].s)) == 0) hit = k;
            if (hit >= 0) {
                lunar_k3_parser_feed(p, CTL[hit].id, CTL[hit].s, strlen(CTL[hit].s));
                s += strlen(CTL[hit].s);
                continue;
            }
            size_t n = 0;
            while (s[n] && (int)n < chunk) {
                int ctl = 0;
                for (int k = 0; k < 4; k++) ctl |= strncmp(s + n, CTL[k].s, strlen(CTL[k].s)) == 0;
                if (ctl) break;
                n++;
            }
            lunar_k3_parser_feed(p, 1000, s, n); /* an ordinary token id */
            s += n;
        }
    }
    lunar_k3_parser_finish(p, truncated);
    lunar_k3_parser_free(p);
}

static void free_collect(collect *c) {
    lunar_sbuf_free(&c->reasoning), lunar_sbuf_free(&c->content);
    lunar_sbuf_free(&c->calls), lunar_sbuf_free(&c->finish);
}

#define S(b) ((b).p ? (b).p : "")

static void expect(const char *name, const char *out, int in_reasoning, int truncated, const char *reasoning,
                   const char *content, const char *calls, const char *finish) {
    static const int chunks[] = {0, 1, 2, 3, 5, 1000};
    for (size_t i = 0; i < sizeof chunks / sizeof *chunks; i++) {
        collect c;
        run(out, in_reasoning, chunks[i], truncated, &c);
        CHECK_MSG(strcmp(S(c.reasoning), reasoning) == 0, "%s/%d: reasoning '%s' want '%s'", name, chunks[i],
                  S(c.reasoning), reasoning);
        CHECK_MSG(strcmp(S(c.content), content) == 0, "%s/%d: content '%s' want '%s'", name, chunks[i], S(c.content),
                  content);
        CHECK_MSG(strcmp(S(c.calls), calls) == 0, "%s/%d: calls '%s' want '%s'", name, chunks[i], S(c.calls), calls);
        CHECK_MSG(strcmp(S(c.finish), finish) == 0, "%s/%d: finish '%s' want '%s'", name, chunks[i], S(c.finish),
                  finish);
        CHECK_MSG(c.bad_utf8 == 0, "%s/%d: a delta split a UTF-8 character", name, chunks[i]);
        free_collect(&c);
    }
}

#define END "<|close|>message<|sep|><|end_of_msg|>"

TEST(chat_parse_k3_channels) {
    expect("plain", "Let me think: 世界.<|close|>think<|sep|><|open|>response<|sep|>Hello 世界 😀!<|close|>response<|sep|>" END,
           1, 0, "Let me think: 世界.", "Hello 世界 😀!", "", "stop");
    expect("thinking_off", "Just the answer.<|close|>response<|sep|>" END, 0, 0, "", "Just the answer.", "", "stop");
    expect("no_close_think", "r<|open|>response<|sep|>c<|close|>response<|sep|>" END, 1, 0, "r", "c", "", "stop");
    expect("truncated_reasoning", "thinking about 世", 1, 1, "thinking about 世", "", "", "length");
    expect("after_eom_ignored", "a<|close|>think<|sep|><|open|>response<|sep|>b" END "junk", 1, 0, "a", "b", "",
           "stop");
}

#define CALL_A                                                                                                   \
    "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"                                                        \
    "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris \"FR\"\n<|close|>argument<|sep|>"                  \
    "<|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>"                               \
    "<|open|>argument key=\"opts\" type=\"object\"<|sep|>{\"z\":1,\"a\":[1.0,true,null]}<|close|>argument<|sep|>" \
    "<|open|>argument key=\"k&quot;&amp;amp;\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|>"               \
    "<|open|>argument key=\"bad\" type=\"number\"<|sep|> twelve <|close|>argument<|sep|>"                         \
    "<|close|>call<|sep|>"
#define CALL_A_ARGS                                                                                    \
    "{\"city\": \"Paris \\\"FR\\\"\\n\", \"days\": 3, \"opts\": {\"z\": 1, \"a\": [1.0, true, null]}, " \
    "\"k\\\"&amp;\": true, \"bad\": \"twelve\"}"
#define CALL_B "<|open|>call tool=\"f2\" index=\"2\"<|sep|><|close|>call<|sep|>"
#define CALL_J "<|open|>call tool=\"f3\" index=\"3\"<|sep|><|open|>json type=\"object\"<|sep|>{\"x\":[1,2]}<|close|>json<|sep|><|close|>call<|sep|>"

TEST(chat_parse_k3_tools) {
    expect("calls",
           "Need weather.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>" CALL_A
           "\n" CALL_B CALL_J "<|close|>tools<|sep|>" END,
           1, 0, "Need weather.", "", "[0 get_weather " CALL_A_ARGS "][1 f2 {}][2 f3 {\"x\": [1, 2]}]", "tool_calls");
    expect("reasoning_to_tools", "r<|open|>tools<|sep|>" CALL_B "<|close|>tools<|sep|>" END, 1, 0, "r", "",
           "[0 f2 {}]", "tool_calls");
    expect("content_then_tools", "Checking.<|open|>tools<|sep|>" CALL_B "<|close|>tools<|sep|>" END, 0, 0, "",
           "Checking.", "[0 f2 {}]", "tool_calls");
    /* cut off inside a call: the call degrades to content, finish length */
    expect("truncated_call",
           "<|open|>tools<|sep|>" CALL_B "<|open|>call tool=\"f\" index=\"2\"<|sep|><|open|>argument key=\"a\" "
           "type=\"string\"<|sep|>par",
           0, 1, "", "<|open|>call tool=\"f\" index=\"2\"<|sep|><|open|>argument key=\"a\" type=\"string\"<|sep|>par",
           "[0 f2 {}]", "length");
    expect("truncated_in_tag", "<|open|>tools<|sep|><|open|>call tool=\"f", 0, 1, "", "<|open|>call tool=\"f", "",
           "length");
    /* a missing close call is repaired by close tools */
    expect("missing_close_call",
           "<|open|>tools<|sep|><|open|>call tool=\"g\" index=\"1\"<|sep|><|open|>argument key=\"a\" "
           "type=\"number\"<|sep|>1<|close|>argument<|sep|><|close|>tools<|sep|>" END,
           0, 0, "", "", "[0 g {\"a\": 1}]", "tool_calls");
}

TEST(chat_parse_k3_malformed) {
    /* unknown tag in content: kept verbatim */
    expect("unknown_tag", "a<|open|>bogus x<|sep|>b<|close|>response<|sep|>" END, 0, 0, "", "a<|open|>bogus x<|sep|>b",
           "", "stop");
    /* unterminated tag followed by another control */
    expect("unterminated_tag", "a<|open|>respo<|close|>response<|sep|>" END, 0, 0, "", "a<|open|>respo", "", "stop");
    /* a call without a tool name is not a call */
    expect("call_without_tool", "<|open|>tools<|sep|><|open|>call index=\"1\"<|sep|>x<|close|>tools<|sep|>" END, 0, 0,
           "", "<|open|>call index=\"1\"<|sep|>x", "", "stop");
    /* bare separators carry nothing */
    expect("bare_sep", "a<|sep|>b" END, 0, 0, "", "ab", "", "stop");
}

TEST(chat_parse_k3_fake_tags) {
    /* the control spellings as ORDINARY tokens (text the model wrote, or BPE pieces) stay text */
    collect c;
    memset(&c, 0, sizeof c);
    lunar_k3_parser *p = lunar_k3_parser_new(0, on_event, &c, fake_rand, NULL);
    const char *pieces[] = {"see ", "<|open|>", "tools", "<|sep|>", "<|open|>call tool=\"x\"<|sep|>", " ok"};
    for (int i = 0; i < 6; i++) lunar_k3_parser_feed(p, 500 + i, pieces[i], strlen(pieces[i]));
    lunar_k3_parser_feed(p, LUNAR_K3_ID_END_OF_MSG, "", 0);
    lunar_k3_parser_finish(p, 0);
    lunar_k3_parser_free(p);
    CHECK_MSG(strcmp(S(c.content), "see <|open|>tools<|sep|><|open|>call tool=\"x\"<|sep|> ok") == 0, "content '%s'",
              S(c.content));
    CHECK(strcmp(S(c.calls), "") == 0 && strcmp(S(c.finish), "stop") == 0);
    free_collect(&c);
}
