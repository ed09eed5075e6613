/* Internals shared by grammar.c (IR, vocabulary index, matcher, EBNF) and json_schema.c (the
 * JSON Schema compiler). Not a public interface.
 *
 * A grammar is a set of rules; a rule is a list of alternatives; an alternative is a run of
 * elements ending in G_END, stored in one flat array (an element is addressed by its index,
 * "pos"). Elements:
 *   G_BYTES  one byte from a 256-bit class
 *   G_RULE   a sub-rule (the frame stays here until the sub-rule ends, then moves on)
 *   G_REPEAT a sub-rule repeated min..max times (max -1: unbounded); the frame keeps the count
 *   G_LEX    a lexeme with its own state machine: a JSON string (code-point counts, excluded
 *            keys) or a JSON number (bounds); the frame keeps the lexeme state
 *   G_TOKENS one token out of a list of ids (control tokens; the end tokens)
 *   G_END    end of an alternative */
#ifndef LUNAR_ENGINE_GRAMMAR_INTERNAL_H
#define LUNAR_ENGINE_GRAMMAR_INTERNAL_H

#include <stdint.h>

#include "engine/grammar.h"

enum { G_END, G_BYTES, G_RULE, G_REPEAT, G_LEX, G_TOKENS };

typedef struct {
    uint8_t kind;
    uint8_t is_end; /* G_TOKENS: this is the end-token element of the root */
    int32_t a;      /* BYTES: class; RULE/REPEAT: rule; LEX: lexeme; TOKENS: offset into ids */
    int32_t b;      /* REPEAT: min; TOKENS: count */
    int64_t c;      /* REPEAT: max (-1 unbounded) */
} g_elem;

enum { LEX_STR, LEX_NUM };

/* Numbers are fixed point with 15 fraction digits (NUM_SCALE units per 1). */
#define NUM_SCALE 1000000000000000LL
#define NUM_MAX_INT_DIGITS 18
#define NUM_MAX_FRAC_DIGITS 15

typedef struct {
    int kind;
    /* LEX_STR: code points in [min_len, max_len] (max -1: unbounded); excl: root node of a trie of
     * raw key bodies the string must not equal (-1: none) */
    int64_t min_len, max_len;
    int32_t excl;
    int raw; /* LEX_STR: the bare text, no quotes and no escapes (any code point but NUL); never with excl */
    /* LEX_NUM: integer only; value in [lo, hi] (inclusive, in 1/NUM_SCALE units) where has_* */
    int integer, has_lo, has_hi;
    __int128 lo, hi;
} g_lex;

typedef struct { /* excluded-key trie node */
    int32_t first_edge, n_edges;
    int terminal;
} g_xnode;
typedef struct {
    uint8_t byte;
    int32_t to;
} g_xedge;

/* Grammar builder. Rules may be referenced before they get alternatives (recursion). */
typedef struct g_seq {
    g_elem *e;
    int n, cap;
} g_seq;

typedef struct g_builder {
    g_elem *elems;
    int n_elems, cap_elems;
    int32_t **rule_alts; /* per rule: alt start positions */
    int *rule_nalts, *rule_capalts;
    int n_rules, cap_rules;
    uint8_t (*classes)[32];
    int n_classes, cap_classes;
    g_lex *lexes;
    int n_lexes, cap_lexes;
    int32_t *ids;
    int n_ids, cap_ids;
    g_xnode *xnodes;
    int n_xnodes, cap_xnodes;
    g_xedge *xedges;
    int n_xedges, cap_xedges;
    char hint[200]; /* a front end's note for a refused grammar, e.g. the largest minLength and its path */
} g_builder;

int gb_rule(g_builder *b);
void gb_add_alt(g_builder *b, int rule, const g_seq *s);
int gb_class(g_builder *b, const uint8_t cls[32]);
int gb_lex(g_builder *b, const g_lex *lx);
int gb_tokens(g_builder *b, const int32_t *ids, int n);
/* Builds the excluded-key trie from n raw byte strings; returns its root node. */
int gb_xtrie(g_builder *b, const char *const *keys, const size_t *lens, int n);

void seq_push(g_seq *s, g_elem e);
void seq_bytes(g_builder *b, g_seq *s, const uint8_t cls[32]);
void seq_byte(g_builder *b, g_seq *s, uint8_t c);
void seq_lit(g_builder *b, g_seq *s, const char *lit, size_t n);
void seq_rule(g_seq *s, int rule);
void seq_repeat(g_seq *s, int rule, int64_t min, int64_t max);
void seq_lexeme(g_seq *s, int lex);
void seq_free(g_seq *s);

/* Turns a builder into a grammar (root rule, optional end tokens); frees the builder. */
int g_finish(lunar_grammar **out, g_builder *b, const lunar_vocab *v, int root, const int32_t *end_ids,
             int n_end, lunar_err *err);
void gb_free(g_builder *b);

/* Some value satisfies the lexeme (number bounds not empty, lengths in order). */
int g_lex_satisfiable(const g_lex *lx);

/* JSON Schema -> rule (json_schema.c). */
int js_compile(g_builder *b, const json_t *schema, int *root_rule, lunar_err *err);
/* A strict tool's arguments in K3's typed-argument tags (json_schema.c; falls back to a json block). */
int js_compile_k3_args(g_builder *b, const json_t *schema, int *root_rule, lunar_err *err);

#endif
