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
#include <string.h>

#include "engine/grammar.h"

/* ------------------------------------------------------------------------------------------ */
/* JSON string lexeme phases (shared by the vocabulary tables and the lexemes)                  */

enum {
    S_START, /* expects the opening quote */
    S_BODY,
    S_ESC,                          /* after a backslash */
    S_U4, S_U3, S_U3D, S_U3Z,       /* \u: hex digits left; D: first was d (no surrogates); Z: zeros */
    S_U2, S_U2Z, S_U1, S_U1Z,
    S_C1, S_C2, S_C3,               /* UTF-8 continuation bytes left */
    S_E0, S_ED, S_F0, S_F4,         /* UTF-8 lead bytes with a restricted second byte */
    S_DONE,
    S_NPHASE
};

static inline int is_hex(uint8_t b) { return (b >= '0' && b <= '9') || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F'); }

/* One byte of a JSON string (ignoring lengths and excluded keys): new phase or -1; *starts: the
 * byte starts a code point; a closing quote gives S_DONE. */
static inline int str_phase_step(int p, uint8_t b, int *starts) {
    *starts = 0;
    switch (p) {
    case S_START: return b == '"' ? S_BODY : -1;
    case S_BODY:
        if (b == '"') return S_DONE;
        *starts = 1;
        if (b == '\\') return S_ESC;
        if (b < 0x20) return -1;
        if (b < 0x80) return S_BODY;
        if (b >= 0xC2 && b <= 0xDF) return S_C1;
        if (b == 0xE0) return S_E0;
        if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) return S_C2;
        if (b == 0xED) return S_ED;
        if (b == 0xF0) return S_F0;
        if (b >= 0xF1 && b <= 0xF3) return S_C3;
        if (b == 0xF4) return S_F4;
        return -1;
    case S_ESC:
        if (b == 'u') return S_U4;
        return strchr("\"\\/bfnrt", b) && b ? S_BODY : -1;
    case S_U4:
        if (b == 'd' || b == 'D') return S_U3D;
        if (b == '0') return S_U3Z;
        return is_hex(b) ? S_U3 : -1;
    case S_U3D: return b >= '0' && b <= '7' ? S_U2 : -1;
    case S_U3Z: return b == '0' ? S_U2Z : is_hex(b) ? S_U2 : -1;
    case S_U3: return is_hex(b) ? S_U2 : -1;
    case S_U2Z: return b == '0' ? S_U1Z : is_hex(b) ? S_U1 : -1;
    case S_U2: return is_hex(b) ? S_U1 : -1;
    case S_U1Z: return b != '0' && is_hex(b) ? S_BODY : -1; /* no \u0000 */
    case S_U1: return is_hex(b) ? S_BODY : -1;
    case S_C1: return b >= 0x80 && b <= 0xBF ? S_BODY : -1;
    case S_C2: return b >= 0x80 && b <= 0xBF ? S_C1 : -1;
    case S_C3: return b >= 0x80 && b <= 0xBF ? S_C2 : -1;
    case S_E0: return b >= 0xA0 && b <= 0xBF ? S_C1 : -1;
    case S_ED: return b >= 0x80 && b <= 0x9F ? S_C1 : -1;
    case S_F0: return b >= 0x90 && b <= 0xBF ? S_C2 : -1;
    case S_F4: return b >= 0x80 && b <= 0x8F ? S_C2 : -1;
    default: return -1;
    }
}

/* One byte of a raw string (no quotes, no escapes: the text itself, e.g. a K3 string argument): any
 * code point but NUL, in UTF-8. Never S_DONE: the grammar element after it ends it. */
static inline int raw_phase_step(int p, uint8_t b, int *starts) {
    if (p == S_BODY && (b == '"' || b == '\\' || (b > 0 && b < 0x20))) {
        *starts = 1;
        return S_BODY;
    }
    if (p == S_BODY && b == 0) return *starts = 0, -1;
    return str_phase_step(p, b, starts);
}

/* Bytes still needed to finish the code point (or escape) a phase is inside: the cheapest way out
 * is ASCII ('n' after a backslash, hex digits, continuation bytes). */
static inline int phase_pend(int p) {
    switch (p) {
    case S_ESC: case S_U1: case S_U1Z: case S_C1: return 1;
    case S_U2: case S_U2Z: case S_C2: case S_E0: case S_ED: return 2;
    case S_U3: case S_U3D: case S_U3Z: case S_C3: case S_F0: case S_F4: return 3;
    case S_U4: return 4;
    default: return 0;
    }
}

/* The vocabulary index (grammar_vocab.c) */

typedef struct {
    uint32_t *stay_mask;    /* tokens that stay inside the string body from this phase */
    int32_t *stay_ids;      /* the same tokens, by code points started ascending */
    int32_t *stay_n;
    uint8_t *stay_pend;     /* the same tokens: phase_pend of the phase they end in */
    int32_t n_stay, max_n, max_pend;
    int32_t *close_ids;     /* tokens that close the string, grouped by the bytes after the quote */
    int32_t *close_n, *close_off;
    int32_t n_close;
} str_table;

struct lunar_vocab {
    int32_t n, n_ranks, words;
    uint32_t *off; /* token bytes: bytes[off[id] .. off[id+1]) for id < n_ranks */
    uint8_t *bytes;
    /* trie in depth-first order: node i has edge byte nb[i], depth nd[i] (root children: 1), the
     * first token ending there ntok[i] (-1: none; more via same_next), its subtree ends before
     * nskip[i] */
    int32_t n_nodes, max_depth;
    uint8_t *nb;
    uint16_t *nd;
    int32_t *ntok, *nskip, *same_next;
    int32_t root_child[256]; /* node of the one-byte prefix c (-1: no token starts with c) */
    int bytes_complete;      /* every byte is a token by itself: a byte count bounds a token count */
    str_table st[S_NPHASE];
    str_table rt[S_NPHASE]; /* raw strings (raw_phase_step): stays only, S_BODY and the UTF-8 phases */
};

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
