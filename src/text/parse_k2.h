/* Streaming parser for K2-format output (Kimi-Linear; K2 / K2-Thinking / K2.5), reference/api.md §3, with the
 * event model of chat_parse.h:
 *   [<think>] reasoning </think>  content
 *   [<|tool_calls_section_begin|> (<|tool_call_begin|> ID <|tool_call_argument_begin|> {json} <|tool_call_end|>)*
 *    <|tool_calls_section_end|>] <|im_end|>
 * Reasoning (thinking=1 only, as vLLM's kimi_k2 reasoning parser): output starts in reasoning; a leading <think>
 * is consumed; reasoning ends at </think>, or at a section or call begin. With thinking=0 <think> and </think>
 * are ordinary text (Kimi-Linear has no thinking channel).
 * Calls: ID is functions.NAME:IDX (optional "functions." prefix, as SGLang's ^(?:functions\.)?(name):(\d+)$;
 * NAME of [A-Za-z0-9_.-]); START is emitted at <|tool_call_argument_begin|>, when the ID is complete. The OpenAI
 * id is the model's ID verbatim (whitespace-trimmed), as vLLM's kimi_k2 parser returns it (PR #38579): the id
 * is the only carrier of the function name back to the model in later turns, and the K2 renderer writes history
 * ids verbatim. A call tag with an unparseable ID degrades to content (its raw spelling).
 * Arguments are already JSON: they stream as they arrive, with whitespace around them trimmed (vLLM's \s*);
 * a call with no arguments text gets "{}". They are not validated (vLLM does not either).
 * <|tool_call_begin|> right after content (no section begin) opens a section; a missing <|tool_call_end|> is
 * repaired by the next <|tool_call_begin|>, the section end, <|im_end|> or finish(truncated=0). Other control
 * tokens inside arguments are dropped; elsewhere their spelling is text. Text outside the channels (between
 * calls, after the section) is content unless a whole run of it is ASCII whitespace.
 * Truncation inside a call: START and the fragments emitted stand, then END (chat_parse.h). */
#ifndef LUNAR_TEXT_PARSE_K2_H
#define LUNAR_TEXT_PARSE_K2_H

#include "text/chat_parse.h"

typedef struct lunar_k2_parser lunar_k2_parser;

/* thinking: the model thinks first (K2-Thinking / K2.5 with thinking on); 0 for Kimi-Linear. */
lunar_k2_parser *lunar_k2_parser_new(int thinking, lunar_chat_event_fn emit, void *emit_ctx);
void lunar_k2_parser_free(lunar_k2_parser *p);
/* One sampled token. id -1: recognise control tokens by exact text only. */
void lunar_k2_parser_feed(lunar_k2_parser *p, int id, const char *text, size_t len);
/* A whole decoded string (tests, non-streaming callers): split at control-token spellings, then fed. */
void lunar_k2_parser_feed_text(lunar_k2_parser *p, const char *text, size_t len);
/* End of generation (call once): flushes held text and pending structure, then emits FINISH. */
void lunar_k2_parser_finish(lunar_k2_parser *p, int truncated);

#endif
