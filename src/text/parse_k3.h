/* Streaming parser for Kimi-K3 output (reference/kvv.md §8b "Output", dspark_vl_api_spec.md §2):
 *   [reasoning] <|close|>think<|sep|> <|open|>response<|sep|> content <|close|>response<|sep|>
 *   [<|open|>tools<|sep|> (<|open|>call tool="N" index="i"<|sep|>
 *        (<|open|>argument key="K" type="T"<|sep|>V<|close|>argument<|sep|>)* | <|open|>json type="object"<|sep|>RAW<|close|>json<|sep|>
 *    <|close|>call<|sep|>)* <|close|>tools<|sep|>] <|close|>message<|sep|><|end_of_msg|>
 * Reasoning may also end at a response or tools opener. Arguments: type="string" -> the raw text; other
 * types JSON-decoded (falling back to the stripped raw text as a string); attributes unescape &quot; then &amp;.
 * The arguments object is written as Python json.dumps(args, ensure_ascii=False) would (", " ": "), and streamed
 * (chat_parse.h): TOOL_CALL_START at the call's opening tag (the name is then certain; id "call_<32 hex>" from
 * rand), then per argument `{` or `, ` plus `"key": ` at its opening tag; a string value streams as it arrives
 * (JSON-escaped, between quotes); any other value is emitted whole at its closing tag; `}` (or `{}` for no
 * arguments) and TOOL_CALL_END at the call's end. A <|open|>json block is emitted whole at its end (re-dumped
 * when it is a JSON object, else as written). Duplicate keys are written as the model wrote them.
 * A call's end is <|close|>call, or (repairing a missing close) <|close|>tools, <|close|>message, <|end_of_msg|>
 * or finish(truncated=0). finish(truncated=1) inside a call emits only END after what was already emitted.
 * A call tag without a non-empty tool="" attribute is not a call (its text degrades to content). Text between
 * arguments inside a call is dropped; unknown tags inside an argument value are part of the value. */
#ifndef LUNAR_TEXT_PARSE_K3_H
#define LUNAR_TEXT_PARSE_K3_H

#include "text/chat_parse.h"

typedef struct lunar_k3_parser lunar_k3_parser;

/* in_reasoning: the prompt ended with <|open|>think<|sep|> (thinking on); else it ended in the response channel. */
lunar_k3_parser *lunar_k3_parser_new(int in_reasoning, lunar_chat_event_fn emit, void *emit_ctx,
                                     lunar_chat_rand_fn rand, void *rand_ctx);
void lunar_k3_parser_free(lunar_k3_parser *p);
/* One sampled token. id -1: recognise control tokens by exact text only. */
void lunar_k3_parser_feed(lunar_k3_parser *p, int id, const char *text, size_t len);
/* A whole decoded string (tests, non-streaming callers): split at control-token spellings, then fed. */
void lunar_k3_parser_feed_text(lunar_k3_parser *p, const char *text, size_t len);
/* End of generation (call once): flushes held text and pending structure, then emits FINISH.
 * truncated: hit max tokens. */
void lunar_k3_parser_finish(lunar_k3_parser *p, int truncated);

#endif
