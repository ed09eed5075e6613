/* Streaming output parsers (K3 XTML channels: parse_k3.h; K2 tool-call sections: parse_k2.h) share this event model.
 *
 * The decoder feeds every sampled token as (id, its decoded bytes). Control tokens are recognised by id, or by
 * exact text when id is -1 (text-only callers); ordinary text tokens never act as markers, so text that merely
 * looks like a tag stays text. Events are emitted as soon as they are certain (never buffering the answer):
 *   REASONING        text delta of reasoning_content
 *   CONTENT          text delta of content
 *   TOOL_CALL_START  a call begins: index (0-based, in emission order), id, name. Emitted exactly once per call,
 *                    as soon as the name is certain. The server sends it as the call's first delta
 *                    {index, id, type:"function", function:{name, arguments:""}}.
 *   TOOL_CALL_ARGS   index + a fragment of the arguments JSON text. The concatenation of all fragments of a
 *                    completed call is the arguments JSON object string (K3: exactly Python
 *                    json.dumps(args, ensure_ascii=False); K2: the model's JSON as written). The server sends
 *                    each as {index, function:{arguments: fragment}}.
 *   TOOL_CALL_END    index: the call is over (no more fragments). Always follows its START, also when truncated.
 *   FINISH           finish_reason: "length" when truncated, else "tool_calls" if any call started, else "stop".
 *                    Always the last event, exactly once.
 * Ordering: for every call START < ARGS* < END; calls do not interleave (a call ends before the next starts);
 * text events may come between calls but never inside one.
 *
 * Robustness: nothing the model writes is an error. Malformed tags, unexpected control tokens and text that
 * looks like a tag degrade to text (content, or reasoning in the think channel) -- but only BEFORE a call's
 * START: once the name has been emitted the call stands. Truncation (max tokens) inside a call therefore gives
 * START, the fragments already emitted (a prefix of the arguments JSON, possibly not valid JSON) and END, then
 * FINISH "length": OpenAI clients see a partial call with finish_reason "length", as from OpenAI itself.
 * A call cut off before its name is certain (inside its opening tag / id) degrades to content.
 *
 * Text deltas and argument fragments always end on a UTF-8 character boundary (a split multi-byte character is
 * held back until it completes or the call/channel ends). */
#ifndef LUNAR_TEXT_CHAT_PARSE_H
#define LUNAR_TEXT_CHAT_PARSE_H

#include <stddef.h>
#include <string.h>

typedef enum {
    LUNAR_CHAT_EV_REASONING,
    LUNAR_CHAT_EV_CONTENT,
    LUNAR_CHAT_EV_TOOL_CALL_START,
    LUNAR_CHAT_EV_TOOL_CALL_ARGS,
    LUNAR_CHAT_EV_TOOL_CALL_END,
    LUNAR_CHAT_EV_FINISH,
} lunar_chat_ev_kind;

typedef struct lunar_chat_event {
    lunar_chat_ev_kind kind;
    const char *text; /* REASONING/CONTENT: the delta; TOOL_CALL_ARGS: the fragment; FINISH: finish_reason;
                         else NULL. Not NUL-terminated: use len. Valid only during the callback. */
    size_t len;
    int index;        /* TOOL_CALL_*: the call's stream index; else -1 */
    const char *id;   /* TOOL_CALL_START: K3 "call_<32 hex>", K2 the model's "functions.NAME:IDX"; else NULL */
    const char *name; /* TOOL_CALL_START; else NULL */
} lunar_chat_event;

typedef void (*lunar_chat_event_fn)(void *ctx, const lunar_chat_event *ev);
/* Fills buf[n] with random bytes (tool-call ids). */
typedef void (*lunar_chat_rand_fn)(void *ctx, unsigned char *buf, size_t n);

/* Length of the longest prefix of s[0..n) that does not end inside a UTF-8 sequence: both parsers
 * hold back the rest so every delta ends on a character boundary. */
static inline size_t lunar_utf8_complete(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = n, k = 0;
    while (i > 0 && k < 4 && (u[i - 1] & 0xc0) == 0x80) i--, k++;
    if (i == 0) return n;
    unsigned char lead = u[i - 1];
    size_t need = lead >= 0xf0 ? 4 : lead >= 0xe0 ? 3 : lead >= 0xc0 ? 2 : 1;
    if (need > 1 && k + 1 < need) return i - 1;
    return n;
}

/* For text-only callers: splits s[0..n) into plain text (fed as id -2) and the control tokens spelled
 * ctl[1..n_ctl) (fed as id -1 with their exact text); at a '<' the last spelling in ctl that matches
 * wins. feed is the parser's feed function and parser its first argument. */
static inline void lunar_chat_feed_split(void *parser, void (*feed)(void *, int, const char *, size_t),
                                         const char *const *ctl, int n_ctl, const char *s, size_t n) {
    size_t i = 0, start = 0;
    while (i < n) {
        int c = 0;
        if (s[i] == '<')
            for (int k = 1; k < n_ctl; k++) {
                size_t l = strlen(ctl[k]);
                if (n - i >= l && memcmp(s + i, ctl[k], l) == 0) c = k;
            }
        if (c == 0) {
            i++;
            continue;
        }
        if (i > start) feed(parser, -2, s + start, i - start);
        feed(parser, -1, ctl[c], strlen(ctl[c]));
        i += strlen(ctl[c]);
        start = i;
    }
    if (n > start) feed(parser, -2, s + start, n - start);
}

#endif
