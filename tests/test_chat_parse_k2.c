/* K2 (Kimi-Linear) output parser: token by token (controls by id, text in k-byte pieces that may split UTF-8)
 * and all at once reassemble to the same expected reasoning / content / calls / finish, with a well-formed
 * event sequence; every prefix of a tool-call answer, cut as by max tokens, stays well-formed. */
#include <string.h>

#include "chat_truncate.h"
#include "test.h"
#include "text/chat_k2.h"
#include "text/parse_k2.h"

static const struct {
    const char *s;
    int id;
} CTL[] = {{"<|tool_calls_section_begin|>", LUNAR_K2_ID_TOOL_CALLS_SECTION_BEGIN},
           {"<|tool_calls_section_end|>", LUNAR_K2_ID_TOOL_CALLS_SECTION_END},
           {"<|tool_call_begin|>", LUNAR_K2_ID_TOOL_CALL_BEGIN},
           {"<|tool_call_argument_begin|>", LUNAR_K2_ID_TOOL_CALL_ARGUMENT_BEGIN},
           {"<|tool_call_end|>", LUNAR_K2_ID_TOOL_CALL_END},
           {"<|im_end|>", LUNAR_K2_ID_IM_END},
           {"<think>", LUNAR_K2_ID_THINK},
           {"</think>", LUNAR_K2_ID_THINK_END}};
#define N_CTL (int)(sizeof CTL / sizeof *CTL)

static int ctl_at(const char *s, const char *e) {
    for (int k = 0; k < N_CTL; k++)
        if ((size_t)(e - s) >= strlen(CTL[k].s) && memcmp(s, CTL[k].s, strlen(CTL[k].s)) == 0) return k;
    return -1;
}

static void run_n(const char *out, size_t len, int thinking, int chunk, int truncated, chat_collect *c) {
    chat_collect_init(c);
    lunar_k2_parser *p = lunar_k2_parser_new(thinking, chat_collect_event, c);
    if (chunk == 0) {
        lunar_k2_parser_feed_text(p, out, len);
    } else {
        const char *s = out, *e = out + len;
        while (s < e) {
            int hit = ctl_at(s, e);
            if (hit >= 0) {
                lunar_k2_parser_feed(p, CTL[hit].id, CTL[hit].s, strlen(CTL[hit].s));
                s += strlen(CTL[hit].s);
                continue;
            }
            size_t n = 0;
            while (s + n < e && (int)n < chunk && ctl_at(s + n, e) < 0) n++;
            lunar_k2_parser_feed(p, 1000, s, n);
            s += n;
        }
    }
    lunar_k2_parser_finish(p, truncated);
    lunar_k2_parser_free(p);
}


static void expect(const char *name, const char *out, int thinking, int truncated, const char *reasoning,
                   const char *content, const char *calls, const char *ids, const char *finish) {
    static const int chunks[] = {0, 1, 2, 3, 5, 1000};
    for (size_t i = 0; i < sizeof chunks / sizeof *chunks; i++) {
        chat_collect c;
        run_n(out, strlen(out), thinking, chunks[i], truncated, &c);
        CHECK_MSG(chat_collect_ok(&c), "%s/%d: event order (%d bad)", name, chunks[i], c.bad_order);
        CHECK_MSG(strcmp(S(c.reasoning), reasoning) == 0, "%s/%d: reasoning '%s' want '%s'", name, chunks[i],
                  S(c.reasoning), reasoning);
        CHECK_MSG(strcmp(S(c.content), content) == 0, "%s/%d: content '%s' want '%s'", name, chunks[i], S(c.content),
                  content);
        CHECK_MSG(strcmp(S(c.calls), calls) == 0, "%s/%d: calls '%s' want '%s'", name, chunks[i], S(c.calls), calls);
        CHECK_MSG(strcmp(S(c.ids), ids) == 0, "%s/%d: ids '%s' want '%s'", name, chunks[i], S(c.ids), ids);
        CHECK_MSG(strcmp(S(c.finish), finish) == 0, "%s/%d: finish '%s' want '%s'", name, chunks[i], S(c.finish),
                  finish);
        CHECK_MSG(c.bad_utf8 == 0, "%s/%d: a delta split a UTF-8 character", name, chunks[i]);
        chat_collect_free(&c);
    }
}

#define SB "<|tool_calls_section_begin|>"
#define SE "<|tool_calls_section_end|>"
#define CB "<|tool_call_begin|>"
#define AB "<|tool_call_argument_begin|>"
#define CE "<|tool_call_end|>"
#define IE "<|im_end|>"
#define CALLS                                                                                          \
    SB CB " functions.get_weather:0 " AB " {\"city\": \"Paris 世界\", \"n\": [1, 2]} \n" CE "\n" CB       \
       "functions.f2:1" AB CE CB "search:2" AB "{\"q\":\"a<b\"}" CE SE
#define CALLS_OUT "[0 get_weather {\"city\": \"Paris 世界\", \"n\": [1, 2]}][1 f2 {}][2 search {\"q\":\"a<b\"}]"
#define CALLS_IDS "functions.get_weather:0 functions.f2:1 search:2"

TEST(chat_parse_k2_basic) {
    expect("content", "Hello 世界 😀!" IE "junk", 0, 0, "", "Hello 世界 😀!", "", "", "stop");
    expect("think_is_text_when_off", "<think>a</think>b" IE, 0, 0, "", "<think>a</think>b", "", "", "stop");
    expect("thinking", "<think>Let me 想.</think>Answer." IE, 1, 0, "Let me 想.", "Answer.", "", "", "stop");
    expect("thinking_no_open", "r</think>c" IE, 1, 0, "r", "c", "", "", "stop");
    expect("truncated_reasoning", "<think>thinking 世", 1, 1, "thinking 世", "", "", "", "length");
    expect("calls", "Checking." CALLS IE, 0, 0, "", "Checking.", CALLS_OUT, CALLS_IDS, "tool_calls");
    expect("reasoning_to_calls", "<think>r" CALLS IE, 1, 0, "r", "", CALLS_OUT, CALLS_IDS, "tool_calls");
    expect("call_without_section", "x" CB "functions.f:0" AB "{\"a\":1}" CE IE, 0, 0, "", "x", "[0 f {\"a\":1}]",
           "functions.f:0", "tool_calls");
    expect("text_after_section", CALLS " Done." IE, 0, 0, "", " Done.", CALLS_OUT, CALLS_IDS, "tool_calls");
}

TEST(chat_parse_k2_malformed) {
    /* bad ids degrade to content */
    expect("no_index", SB CB "functions.f" AB "{}" CE SE IE, 0, 0, "", CB "functions.f" AB "{}" CE, "", "", "stop");
    expect("bad_name", SB CB "functions.a b:0" AB "{}" CE SE IE, 0, 0, "", CB "functions.a b:0" AB "{}" CE, "", "",
           "stop");
    expect("id_then_other_ctl", SB CB "functions.f:0" CE SE IE, 0, 0, "", CB "functions.f:0" CE, "", "", "stop");
    /* missing call end: repaired by the next call / the section end / im_end / a clean finish */
    expect("missing_end", SB CB "functions.f:0" AB "{\"a\":1}" CB "functions.g:1" AB "{}" SE IE, 0, 0, "", "",
           "[0 f {\"a\":1}][1 g {}]", "functions.f:0 functions.g:1", "tool_calls");
    expect("stopped_in_args", SB CB "functions.f:0" AB "{\"a\":1} ", 0, 0, "", "", "[0 f {\"a\":1}]", "functions.f:0",
           "tool_calls");
    /* truncated inside the arguments: the partial call stands */
    expect("truncated_args", SB CB "functions.f:0" AB " {\"a\": \"x ", 0, 1, "", "", "[0 f {\"a\": \"x]",
           "functions.f:0", "length");
    expect("truncated_id", "c" SB CB "functions.f:", 0, 1, "", "c" CB "functions.f:", "", "", "length");
    /* stray controls: spelled as text outside calls, dropped inside arguments */
    expect("stray_controls", "a" CE AB SE "b" IE, 0, 0, "", "a" CE AB SE "b", "", "", "stop");
    expect("ctl_in_args", SB CB "functions.f:0" AB "{\"a\"" AB "<think>:1}" CE SE IE, 0, 0, "", "",
           "[0 f {\"a\":1}]", "functions.f:0", "tool_calls");
}

TEST(chat_parse_k2_fake_tags) {
    chat_collect c;
    chat_collect_init(&c);
    lunar_k2_parser *p = lunar_k2_parser_new(0, chat_collect_event, &c);
    const char *pieces[] = {"see ", SB, CB, "functions.f:0", AB, "{}", CE};
    for (int i = 0; i < 7; i++) lunar_k2_parser_feed(p, 500 + i, pieces[i], strlen(pieces[i]));
    lunar_k2_parser_feed(p, LUNAR_K2_ID_IM_END, "", 0);
    lunar_k2_parser_finish(p, 0);
    lunar_k2_parser_free(p);
    CHECK_MSG(strcmp(S(c.content), "see " SB CB "functions.f:0" AB "{}" CE) == 0, "content '%s'", S(c.content));
    CHECK(chat_collect_ok(&c) && strcmp(S(c.calls), "") == 0 && strcmp(S(c.finish), "stop") == 0);
    chat_collect_free(&c);
}

static int splits_control(const char *out, size_t len) {
    for (int k = 0; k < N_CTL; k++) {
        size_t l = strlen(CTL[k].s);
        for (size_t i = 1; i < l && i <= len; i++)
            if (strncmp(out + len - i, CTL[k].s, l) == 0) return 1;
    }
    return 0;
}

TEST(chat_parse_k2_truncate_everywhere) {
    const char *out = "<think>Need 世界.</think>ok" CALLS IE;
    size_t n = strlen(out);
    chat_collect full;
    run_n(out, n, 1, 0, 0, &full);
    CHECK_MSG(strcmp(S(full.calls), CALLS_OUT) == 0, "full calls '%s'", S(full.calls));
    chat_check_truncations(out, S(full.calls), run_n, splits_control, NULL);
    chat_collect_free(&full);
}
