/* Grammar-constrained decoding: a constraint compiled once (from a JSON Schema, "any JSON object",
 * or a grammar text) and a per-request matcher that yields, before each sampling step, the set of
 * vocabulary tokens that keep the output inside the language, and advances on the chosen token.
 * Terminals are bytes; control tokens of the chat format may also be terminals (by id), so tool
 * calls in a model's own syntax can be constrained. */
#ifndef LUNAR_ENGINE_GRAMMAR_H
#define LUNAR_ENGINE_GRAMMAR_H

#include <jansson.h>
#include <stdint.h>

#include "base/err.h"
#include "text/tokenizer.h"

/* The byte strings of every token of a vocabulary, indexed for mask computation. */
typedef struct lunar_vocab lunar_vocab;
int lunar_vocab_build(lunar_vocab **out, const lunar_tokenizer *tok, lunar_err *err);
void lunar_vocab_free(lunar_vocab *v);
int32_t lunar_vocab_size(const lunar_vocab *v);

typedef struct lunar_grammar lunar_grammar;

/* Grammars whose shortest output cannot fit in this many tokens are refused when compiled (a JSON
 * Schema like minLength 999999999999 can never be generated). Above every Kimi context length. */
#define LUNAR_GRAMMAR_MAX_TOKENS (1 << 24)

/* JSON Schema (Draft 2020-12 subset of SPEC 5 / the schema cases) -> grammar emitting compact JSON.
 * schema NULL: any JSON object (response_format json_object). end_ids: tokens allowed (only)
 * once the value is complete, e.g. the end-of-turn token. */
int lunar_grammar_from_json_schema(lunar_grammar **out, const lunar_vocab *v, const json_t *schema,
                                   const int32_t *end_ids, int n_end, lunar_err *err);
/* SPEC 6: a schema S as a strict tool's parameters: {"type":"object","required":["value"],
 * "additionalProperties":false,"properties":{"value":S}} with S's $defs / $id hoisted to the top and
 * its "default" removed. New reference; the caller frees it. */
json_t *lunar_json_schema_tool_value(const json_t *schema);
/* A grammar in the EBNF dialect documented in grammar.c (root rule "root"); the dialect can name
 * control tokens by id so chat-format syntax can be written. */
int lunar_grammar_from_ebnf(lunar_grammar **out, const lunar_vocab *v, const char *ebnf,
                            const int32_t *end_ids, int n_end, lunar_err *err);
/* The same, with JSON-Schema rules embedded: names[k] (an EBNF rule name) is defined as the compact-JSON
 * language of schemas[k] (NULL: any JSON object), usable from the EBNF like any rule; the EBNF must not
 * define these names itself. E.g. names {"args"}: root ::= <163595> "f:" args <163596>. */
int lunar_grammar_from_ebnf_with_schemas(lunar_grammar **out, const lunar_vocab *v, const char *ebnf,
                                         const char *const *names, const json_t *const *schemas, int n_schemas,
                                         const int32_t *end_ids, int n_end, lunar_err *err);
/* The same, each schema in a form: LUNAR_SCHEMA_JSON (compact JSON, as above) or LUNAR_SCHEMA_K3_ARGS (a
 * strict tool's arguments as K3 typed-argument tags, <|open|>argument key="K" type="T"<|sep|>VALUE
 * <|close|>argument<|sep|> per property, string values as bare text; a schema with no such form, e.g. one
 * allowing additional properties, gives one <|open|>json type="object"<|sep|>JSON<|close|>json<|sep|>
 * block instead). forms NULL: all JSON. */
enum { LUNAR_SCHEMA_JSON = 0, LUNAR_SCHEMA_K3_ARGS = 1 };
int lunar_grammar_from_ebnf_with_forms(lunar_grammar **out, const lunar_vocab *v, const char *ebnf,
                                       const char *const *names, const json_t *const *schemas, const int *forms,
                                       int n_schemas, const int32_t *end_ids, int n_end, lunar_err *err);
void lunar_grammar_free(lunar_grammar *g);

typedef struct lunar_matcher lunar_matcher;
lunar_matcher *lunar_matcher_new(const lunar_grammar *g);
void lunar_matcher_free(lunar_matcher *m);
/* mask: (vocab_size + 31) / 32 words; bit (id % 32) of word id / 32 set = id allowed. Never empty
 * for a live matcher (a complete value allows end_ids). */
void lunar_matcher_fill_mask(lunar_matcher *m, uint32_t *mask);
/* The same under a token budget (tokens_left: tokens that may still be generated, this one included;
 * negative: none). Keeps only tokens after which the value can still be completed in the tokens left
 * (see lunar_matcher_tokens_to_finish), so an output started with at least
 * lunar_grammar_min_tokens(g) tokens of budget always ends complete; with less it heads the fastest
 * way to the end. Tokens that lead where no value can ever be completed are never allowed. Returns 1
 * when the budget removed a token the grammar alone allows (the output is shaped by the budget). */
int lunar_matcher_fill_mask_budget(lunar_matcher *m, uint32_t *mask, int64_t tokens_left);
/* A number of tokens that surely completes the value from the current state (0: complete; the end
 * token needs none). Counted in bytes plus control tokens: every byte is a token of the byte-level
 * vocabulary. -1 where that does not hold (a vocabulary without every single byte). */
int64_t lunar_matcher_tokens_to_finish(const lunar_matcher *m);
/* lunar_matcher_tokens_to_finish of a new matcher. */
int64_t lunar_grammar_min_tokens(const lunar_grammar *g);
/* Advances on a token; -1 if the token was not allowed (state unchanged). */
int lunar_matcher_accept(lunar_matcher *m, int32_t token);
/* Whether accept(token) would succeed (state unchanged either way): the mask's bit, one token at a time. */
int lunar_matcher_can_accept(lunar_matcher *m, int32_t token);
/* The value is complete and an end token was accepted (or only end tokens remain allowed). */
int lunar_matcher_is_done(const lunar_matcher *m);

#endif
