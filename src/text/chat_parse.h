/* Streaming output parsers (K3 XTML channels; K2 sections) share this event model.
 *
 * The decoder feeds every sampled token as (id, its decoded bytes). Control tokens are recognised by id, or by
 * exact text when id is -1 (text-only callers); ordinary text tokens never act as markers, so text that merely
 * looks like a tag stays text. Events are emitted as soon as they are certain:
 *   REASONING  text delta of reasoning_content
 *   CONTENT    text delta of content
 *   TOOL_CALL  one complete call: index (0-based, emission order), id "call_<32 hex>", name, and the complete
 *              arguments JSON object text. The server sends it as the call's first delta (index, id, type, name)
 *              followed by one arguments delta. A call is emitted when it closes: a call cut off by the token
 *              limit, or malformed, degrades to CONTENT (its raw text), never an error.
 *   FINISH     finish_reason: "length" when truncated, else "tool_calls" if any call was emitted, else "stop".
 * Text deltas always end on a UTF-8 character boundary (a split multi-byte character is held back). */
#ifndef LUNAR_TEXT_CHAT_PARSE_H
#define LUNAR_TEXT_CHAT_PARSE_H

#include <stddef.h>

typedef enum {
    LUNAR_CHAT_EV_REASONING,
    LUNAR_CHAT_EV_CONTENT,
    LUNAR_CHAT_EV_TOOL_CALL,
    LUNAR_CHAT_EV_FINISH,
} lunar_chat_ev_kind;

typedef struct lunar_chat_event {
    lunar_chat_ev_kind kind;
    const char *text; /* REASONING/CONTENT: the delta; TOOL_CALL: arguments JSON; FINISH: finish_reason */
    size_t len;
    int index;        /* TOOL_CALL */
    const char *id;   /* TOOL_CALL: "call_<hex>" */
    const char *name; /* TOOL_CALL */
} lunar_chat_event;

typedef void (*lunar_chat_event_fn)(void *ctx, const lunar_chat_event *ev);
/* Fills buf[n] with random bytes (tool-call ids). */
typedef void (*lunar_chat_rand_fn)(void *ctx, unsigned char *buf, size_t n);

#endif
