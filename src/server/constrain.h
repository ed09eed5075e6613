/* Grammar-constrained decoding for chat requests: the request's resolved options (text/chat.h:
 * response_format, tools, tool_choice, thinking) -> one grammar over the model's own output syntax
 * (engine/grammar.h), written as EBNF with control-token terminals and embedded JSON-Schema rules.
 *
 * What is constrained (docs/api.md "Structured output"):
 *   response_format json_object / json_schema: the answer is compact JSON (json_schema: valid for the schema,
 *     strict or not; json_object: any object). K2: the whole answer, then <|im_end|>. K3: free reasoning in
 *     the think channel (thinking on), then the response channel holding the JSON, then the message close.
 *   tool_choice required / named: the output is one to 8 tool calls (named: of that tool only); arguments
 *     follow the tool's parameters schema when the tool is strict, else any JSON object. K2: the
 *     <|tool_calls_section_begin|> section; K3: the tools channel, each call's arguments one
 *     <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|> block per property for a strict
 *     tool (string values bare text, others compact JSON), one <|open|>json type="object"<|sep|> block
 *     otherwise (reasoning and an optional free response come first).
 *   tool_choice none (with tools declared): no tool-call syntax can be produced (K2: only text, no control
 *     token but <|im_end|>; K3: the response channel, no tools channel).
 *   tool_choice auto with at least one strict tool: free text, and/or tool calls as above.
 * Otherwise (plain text, auto without strict tools, completions) nothing is constrained.
 *
 * Grammars are compiled once per distinct grammar text + schemas and cached for the server's lifetime
 * (requests only borrow them). */
#ifndef LUNAR_SERVER_CONSTRAIN_H
#define LUNAR_SERVER_CONSTRAIN_H

#include "base/err.h"
#include "engine/grammar.h"
#include "io/config.h"
#include "text/chat.h"
#include "text/tokenizer.h"

/* The grammar text and its embedded schemas for a prompt's options. 0 with *ebnf NULL: nothing to
 * constrain. Else *ebnf (malloc'd), names[k] = "resp" / "args<i>", schemas[k] (borrowed from p; NULL =
 * any JSON object) and forms[k] (LUNAR_SCHEMA_*: K3 strict tools use typed argument tags), *n entries
 * (arrays malloc'd). End token: *end_id. */
int lunar_constrain_spec(lunar_arch arch, const lunar_chat_prompt *p, char **ebnf, char ***names,
                         const json_t ***schemas, int **forms, int *n, int32_t *end_id);

/* Uncached: compiles the grammar of lunar_constrain_spec (*g NULL: nothing to constrain). -1: the schema or
 * grammar was refused (a request error). */
int lunar_constrain_build(const lunar_vocab *v, lunar_arch arch, const lunar_chat_prompt *p, lunar_grammar **g,
                          lunar_err *err);

/* The server's cache: the vocabulary index (built once, ~160 ms) and every grammar compiled so far. */
typedef struct lunar_constrain lunar_constrain;
int lunar_constrain_new(lunar_constrain **out, const lunar_tokenizer *tok, lunar_arch arch, lunar_err *err);
/* Frees every cached grammar: only once no request uses them. */
void lunar_constrain_free(lunar_constrain *c);
/* The grammar for a chat prompt (thread-safe): 0 and *g (NULL: unconstrained; else owned by the cache), or -1
 * and err (answer 400). */
int lunar_constrain_get(lunar_constrain *c, const lunar_chat_prompt *p, const lunar_grammar **g, lunar_err *err);
/* Distinct grammars cached so far. */
int lunar_constrain_cached(lunar_constrain *c);

#endif
