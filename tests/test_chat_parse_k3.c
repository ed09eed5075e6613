/* K3 output parser: the same output fed token by token (controls by id, text in k-byte pieces that may split
 * UTF-8) and all at once must reassemble to the same, expected reasoning / content / tool calls / finish. */
#include <string.h>

#include "test.h"
#include "text/chat_k3.h"
#include "text/parse_k3.h"
#include "text/sbuf.h"
#include "chat_truncate.h"

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
static void run_n(const char *out, size_t len, int in_reasoning, int chunk, int truncated, chat_collect *c) {
    chat_collect_init(c);
    lunar_k3_parser *p = lunar_k3_parser_new(in_reasoning, chat_collect_event, c, fake_rand, NULL);
    if (chunk == 0) {
        lunar_k3_parser_feed_text(p, out, len);
    } else {
        const char *s = out, *e = out + len;
        while (s < e) {
            int hit = -1;
            for (int k = 0; k < 4; k++)
                if ((size_t)(e - s) >= strlen(CTL[k].s) && memcmp(s, CTL[k].s, strlen(CTL[k].s)) == 0) hit = k;
            if (hit >= 0) {
                lunar_k3_parser_feed(p, CTL[hit].id, CTL[hit].s, strlen(CTL[hit].s));
                s += strlen(CTL[hit].s);
                continue;
            }
            size_t n = 0;
            while (s + n < e && (int)n < chunk) {
                int ctl = 0;
                for (int k = 0; k < 4; k++)
                    ctl |= (size_t)(e - s - n) >= strlen(CTL[k].s) && memcmp(s + n, CTL[k].s, strlen(CTL[k].s)) == 0;
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

static void run(const char *out, int in_reasoning, int chunk, int truncated, chat_collect *c) {
    run_n(out, strlen(out), in_reasoning, chunk, truncated, c);
}

/* every call id is call_<32 lowercase hex> */
static int ids_ok(const chat_collect *c) {
    const char *s = c->ids.p ? c->ids.p : "";
    while (*s) {
        if (strncmp(s, "call_", 5) != 0) return 0;
        for (int i = 0; i < 32; i++)
            if (!strchr("0123456789abcdef", s[5 + i]) || !s[5 + i]) return 0;
        s += 37;
        if (*s && *s++ != ' ') return 0;
    }
    return 1;
}


static void expect(const char *name, const char *out, int in_reasoning, int truncated, const char *reasoning,
                   const char *content, const char *calls, const char *finish) {
    static const int chunks[] = {0, 1, 2, 3, 5, 1000};
    for (size_t i = 0; i < sizeof chunks / sizeof *chunks; i++) {
        chat_collect c;
        run(out, in_reasoning, chunks[i], truncated, &c);
        CHECK_MSG(chat_collect_ok(&c), "%s/%d: event order (%d bad)", name, chunks[i], c.bad_order);
        CHECK_MSG(ids_ok(&c), "%s/%d: ids '%s'", name, chunks[i], S(c.ids));
        CHECK_MSG(strcmp(S(c.reasoning), reasoning) == 0, "%s/%d: reasoning '%s' want '%s'", name, chunks[i],
                  S(c.reasoning), reasoning);
        CHECK_MSG(strcmp(S(c.content), content) == 0, "%s/%d: content '%s' want '%s'", name, chunks[i], S(c.content),
                  content);
        CHECK_MSG(strcmp(S(c.calls), calls) == 0, "%s/%d: calls '%s' want '%s'", name, chunks[i], S(c.calls), calls);
        CHECK_MSG(strcmp(S(c.finish), finish) == 0, "%s/%d: finish '%s' want '%s'", name, chunks[i], S(c.finish),
                  finish);
        CHECK_MSG(c.bad_utf8 == 0, "%s/%d: a delta split a UTF-8 character", name, chunks[i]);
        chat_collect_free(&c);
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
    /* cut off inside a call: what was emitted stands (a partial call), finish length */
    expect("truncated_call",
           "<|open|>tools<|sep|>" CALL_B "<|open|>call tool=\"f\" index=\"2\"<|sep|><|open|>argument key=\"a\" "
           "type=\"string\"<|sep|>pa\"r",
           0, 1, "", "", "[0 f2 {}][1 f {\"a\": \"pa\\\"r]", "length");
    expect("truncated_number", "<|open|>tools<|sep|><|open|>call tool=\"f\"<|sep|><|open|>argument key=\"n\" "
           "type=\"number\"<|sep|>12", 0, 1, "", "", "[0 f {\"n\": ]", "length");
    expect("truncated_close_tag", "<|open|>tools<|sep|><|open|>call tool=\"f\"<|sep|><|open|>argument key=\"s\" "
           "type=\"string\"<|sep|>x<|close|>argu", 0, 1, "", "", "[0 f {\"s\": \"x]", "length");
    /* stopped (not truncated) inside a call: the call is completed */
    expect("stopped_in_call", "<|open|>tools<|sep|><|open|>call tool=\"f\"<|sep|><|open|>argument key=\"n\" "
           "type=\"number\"<|sep|>12", 0, 0, "", "", "[0 f {\"n\": 12}]", "tool_calls");
    expect("eom_in_call", "<|open|>tools<|sep|><|open|>call tool=\"f\"<|sep|><|open|>argument key=\"s\" "
           "type=\"string\"<|sep|>v<|end_of_msg|>", 0, 0, "", "", "[0 f {\"s\": \"v\"}]", "tool_calls");
    /* a tag inside a string value that is not its close is part of the value */
    expect("tag_in_value", "<|open|>tools<|sep|><|open|>call tool=\"f\"<|sep|><|open|>argument key=\"s\" "
           "type=\"string\"<|sep|>a<|open|>b<|sep|>c<|close|>argument<|sep|><|close|>call<|sep|>" END, 0, 0, "", "",
           "[0 f {\"s\": \"a<|open|>b<|sep|>c\"}]", "tool_calls");
    /* arguments after a json block are ignored (the block was already emitted) */
    expect("json_then_arg", "<|open|>tools<|sep|><|open|>call tool=\"f\"<|sep|><|open|>json type=\"object\"<|sep|>"
           "{\"a\":1}<|close|>json<|sep|><|open|>argument key=\"b\"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>" END,
           0, 0, "", "", "[0 f {\"a\": 1}]", "tool_calls");
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
    /* an attribute list that fails after a good attribute (leaked its values once: fuzz finding) */
    expect("bad_attrs", "<|open|>tools<|sep|><|open|>call tool=\"g\" x<|sep|>y<|close|>tools<|sep|>" END, 0, 0, "",
           "<|open|>call tool=\"g\" x<|sep|>y", "", "stop");
    /* bare separators carry nothing */
    expect("bare_sep", "a<|sep|>b" END, 0, 0, "", "ab", "", "stop");
}

TEST(chat_parse_k3_fake_tags) {
    /* the control spellings as ORDINARY tokens (text the model wrote, or BPE pieces) stay text */
    chat_collect c;
    chat_collect_init(&c);
    lunar_k3_parser *p = lunar_k3_parser_new(0, chat_collect_event, &c, fake_rand, NULL);
    const char *pieces[] = {"see ", "<|open|>", "tools", "<|sep|>", "<|open|>call tool=\"x\"<|sep|>", " ok"};
    for (int i = 0; i < 6; i++) lunar_k3_parser_feed(p, 500 + i, pieces[i], strlen(pieces[i]));
    lunar_k3_parser_feed(p, LUNAR_K3_ID_END_OF_MSG, "", 0);
    lunar_k3_parser_finish(p, 0);
    lunar_k3_parser_free(p);
    CHECK_MSG(strcmp(S(c.content), "see <|open|>tools<|sep|><|open|>call tool=\"x\"<|sep|> ok") == 0, "content '%s'",
              S(c.content));
    CHECK(strcmp(S(c.calls), "") == 0 && strcmp(S(c.finish), "stop") == 0);
    chat_collect_free(&c);
}

/* the cut at len falls inside a control token's spelling (real output cannot be cut there: its prefix is text) */
static int splits_control(const char *out, size_t len) {
    for (int k = 0; k < 4; k++) {
        size_t l = strlen(CTL[k].s);
        for (size_t i = 1; i < l && i <= len; i++)
            if (strncmp(out + len - i, CTL[k].s, l) == 0) return 1;
    }
    return 0;
}

/* Every prefix of a tool-call answer, cut as by max tokens: no crash or leak, a well-formed event sequence
 * (START < ARGS < END, each name once), finish "length", the same result however the prefix is fed, and the
 * calls seen so far are a prefix of the full answer's calls (unless the cut splits a control spelling). */
TEST(chat_parse_k3_truncate_everywhere) {
    const char *out = "Need 世界.<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|>" CALL_A
                      "\n" CALL_B CALL_J "<|close|>tools<|sep|>" END;
    chat_collect full;
    run(out, 1, 0, 0, &full);
    chat_check_truncations(out, S(full.calls), run_n, splits_control, ids_ok);
    chat_collect_free(&full);
}
