/* A rendered chat prompt: a list of segments over one byte buffer, plus the request options the
 * renderer resolved (the server and the decoder need them: thinking, tool_choice, response_format).
 *
 * Segment kinds:
 *   TEXT     bytes to BPE on their own, with special-token recognition OFF (text never becomes special ids);
 *   SPECIAL  exactly one control token, spelled as in the tokenizer table (e.g. "<|open|>");
 *   IMAGE    image number `image` (0-based, in request order; its URL is image_urls[image]). The bytes hold the
 *            K3 placeholder "<|kimi_image_placeholder|>" for display only. The caller replaces it with
 *            <|media_begin|> "image WxH" <|media_content|> <|media_pad|> <|media_end|> (SPEC §1.3; W×H the original
 *            upload size; the pad then expands to the vision token count).
 * Adjacent TEXT segments are NOT merged: each is BPE'd separately, exactly as the Python encoder does. Empty
 * segments are never emitted. Renderer errors are request errors (HTTP 400); the message starts with the
 * JSON path of the offending field ("messages[2].tool_calls[0].function.arguments: ..."). */
#ifndef LUNAR_TEXT_CHAT_H
#define LUNAR_TEXT_CHAT_H

#include <jansson.h>
#include <stddef.h>

#include "base/err.h"
#include "text/sbuf.h"

typedef enum { LUNAR_SEG_TEXT = 0, LUNAR_SEG_SPECIAL = 1, LUNAR_SEG_IMAGE = 2 } lunar_seg_kind;

typedef struct lunar_chat_seg {
    size_t off, len; /* bytes in lunar_chat_prompt.bytes */
    lunar_seg_kind kind;
    int image; /* IMAGE: image number; else -1 */
} lunar_chat_seg;

typedef enum {
    LUNAR_TOOL_CHOICE_AUTO = 0, /* also: absent */
    LUNAR_TOOL_CHOICE_NONE,
    LUNAR_TOOL_CHOICE_REQUIRED,
    LUNAR_TOOL_CHOICE_NAMED, /* accepted; the K3 prompt ignores it (KVV) */
} lunar_tool_choice;

typedef enum {
    LUNAR_RESPONSE_TEXT = 0, /* also: absent */
    LUNAR_RESPONSE_JSON_OBJECT,
    LUNAR_RESPONSE_JSON_SCHEMA,
} lunar_response_kind;

typedef struct lunar_chat_prompt {
    lunar_sbuf bytes;
    lunar_chat_seg *segs;
    size_t n_segs, cap_segs;

    int thinking;       /* the prompt ends inside the think channel (K3) / <think> (K2) */
    const char *effort; /* "low" | "high" | "max" (static string); meaningful when thinking */
    lunar_tool_choice tool_choice;
    char *tool_choice_name; /* NAMED: the function name (malloc'd) */
    lunar_response_kind response_format;
    json_t *response_schema; /* JSON_SCHEMA: the schema (own reference); else NULL */
    int response_strict;     /* json_schema.strict (default 0) */
    json_t *tools;           /* every declared tool, global then dynamic, in order (own reference; [] if none) */
    size_t n_images;
    char **image_urls;  /* n_images malloc'd strings */
    size_t stub_tokens; /* usage.prompt_tokens = prompt ids - stub_tokens (K3: 3, K2: 0) */
} lunar_chat_prompt;

void lunar_chat_prompt_free(lunar_chat_prompt *p);

/* Concatenation of all segment bytes (for display / golden comparison). */
static inline const char *lunar_chat_prompt_text(const lunar_chat_prompt *p) {
    return p->bytes.p ? p->bytes.p : "";
}

/* ---- helpers shared by the renderers (not part of the public surface) ---- */
void lunar_chat_seg_add(lunar_chat_prompt *p, lunar_seg_kind kind, const char *s, size_t n, int image);
static inline void lunar_chat_text(lunar_chat_prompt *p, const char *s, size_t n) {
    lunar_chat_seg_add(p, LUNAR_SEG_TEXT, s, n, -1);
}
void lunar_chat_texts(lunar_chat_prompt *p, const char *s);
void lunar_chat_special(lunar_chat_prompt *p, const char *token);
/* Python str.strip() would leave nothing (Unicode whitespace as Python's str.isspace). */
int lunar_py_is_blank(const char *s, size_t n);
/* Validates request.tools / messages[i].tools (an array of {"type":"function","function":{"name":...}} with
 * names ^[A-Za-z_][A-Za-z0-9_-]{0,255}$, unique across all lists) and appends each tool to p->tools. */
int lunar_chat_collect_tools(lunar_chat_prompt *p, const json_t *tools, const char *path, lunar_err *err);
/* tool_choice and response_format (validated; named tools and required checked against p->tools). */
int lunar_chat_parse_tool_choice(lunar_chat_prompt *p, const json_t *req, lunar_err *err);
int lunar_chat_parse_response_format(lunar_chat_prompt *p, const json_t *req, lunar_err *err);
/* thinking / effort from thinking{type,effort,keep}, reasoning_effort, chat_template_kwargs (SPEC §5). */
int lunar_chat_parse_thinking(lunar_chat_prompt *p, const json_t *req, lunar_err *err);

#endif
