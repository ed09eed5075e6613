/* Grammar-constrained decoding: the grammar IR and its builder, the string and number lexemes, the
 * completion costs of the token budget, and the matcher (a set of pushdown stacks over bytes). The
 * vocabulary index is grammar_vocab.c, the EBNF front end grammar_ebnf.c.
 *
 * Matcher. A state is a set of stacks (nondeterminism from alternatives); a stack is a chain of
 * frames (pos, count/lexeme state, parent) in an arena, persistent: advancing a stack on a byte
 * adds frames on top of shared parents. Every stack in a state has a byte-consuming element
 * (G_BYTES, G_LEX) or a token element (G_TOKENS) on top, or is the accepted marker.
 *
 * Masks. For each stack of the state:
 *   - G_TOKENS on top: the ids are allowed;
 *   - a JSON string lexeme inside its body (the common case: most steps are inside strings): the
 *     per-phase tables precomputed in the vocabulary give every token that stays inside the body
 *     (filtered by the code-point budget left) and every token that closes the string, grouped by
 *     the bytes after the closing quote; each group is checked once by running those bytes on the
 *     stack that follows the string (XGrammar's split into context-independent tokens, decided by
 *     a table, and context-dependent ones, checked at run time);
 *   - otherwise the vocabulary trie (a depth-first array with subtree skips) is walked once for all
 *     remaining stacks together, advancing the stack set byte by byte and pruning a subtree as soon
 *     as the set is empty.
 * Masks are cached per state (the serialised stack set) in a small per-matcher cache; counters of
 * unbounded repetitions saturate at their minimum so that a state inside a long free string or list
 * repeats exactly. */
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_internal.h"

/* ------------------------------------------------------------------------------------------ */
/* Builder                                                                                     */

#define GROW(ptr, n, cap)                                                        \
    do {                                                                         \
        if ((n) >= (cap)) {                                                      \
            (cap) = (cap) ? (cap) * 2 : 16;                                      \
            void *np_ = realloc((ptr), (size_t)(cap) * sizeof *(ptr));           \
            LUNAR_ASSERT(np_);                                                   \
            (ptr) = np_;                                                         \
        }                                                                        \
    } while (0)

int gb_rule(g_builder *b) {
    GROW(b->rule_alts, b->n_rules, b->cap_rules);
    b->rule_nalts = realloc(b->rule_nalts, (size_t)b->cap_rules * sizeof(int));
    b->rule_capalts = realloc(b->rule_capalts, (size_t)b->cap_rules * sizeof(int));
    LUNAR_ASSERT(b->rule_nalts && b->rule_capalts);
    b->rule_alts[b->n_rules] = NULL;
    b->rule_nalts[b->n_rules] = 0;
    b->rule_capalts[b->n_rules] = 0;
    return b->n_rules++;
}

void gb_add_alt(g_builder *b, int rule, const g_seq *s) {
    int start = b->n_elems;
    for (int i = 0; i <= s->n; i++) {
        GROW(b->elems, b->n_elems, b->cap_elems);
        b->elems[b->n_elems++] = i < s->n ? s->e[i] : (g_elem){.kind = G_END};
    }
    GROW(b->rule_alts[rule], b->rule_nalts[rule], b->rule_capalts[rule]);
    b->rule_alts[rule][b->rule_nalts[rule]++] = start;
}

int gb_class(g_builder *b, const uint8_t cls[32]) {
    for (int i = 0; i < b->n_classes; i++)
        if (!memcmp(b->classes[i], cls, 32)) return i;
    GROW(b->classes, b->n_classes, b->cap_classes);
    memcpy(b->classes[b->n_classes], cls, 32);
    return b->n_classes++;
}

int gb_lex(g_builder *b, const g_lex *lx) {
    GROW(b->lexes, b->n_lexes, b->cap_lexes);
    b->lexes[b->n_lexes] = *lx;
    return b->n_lexes++;
}

int gb_tokens(g_builder *b, const int32_t *ids, int n) {
    int off = b->n_ids;
    for (int i = 0; i < n; i++) {
        GROW(b->ids, b->n_ids, b->cap_ids);
        b->ids[b->n_ids++] = ids[i];
    }
    return off;
}

static int xnode_new(g_builder *b) {
    GROW(b->xnodes, b->n_xnodes, b->cap_xnodes);
    b->xnodes[b->n_xnodes] = (g_xnode){0, 0, 0};
    return b->n_xnodes++;
}

/* Nodes keep their edges contiguous: built breadth-unaware, so insert by rebuilding per level is
 * overkill; instead each node's edges are appended as a fresh block whenever it gains an edge. */
static int xnode_child(g_builder *b, int node, uint8_t c, int create) {
    g_xnode *x = &b->xnodes[node];
    for (int i = 0; i < x->n_edges; i++)
        if (b->xedges[x->first_edge + i].byte == c) return b->xedges[x->first_edge + i].to;
    if (!create) return -1;
    int child = xnode_new(b);
    x = &b->xnodes[node];
    int first = b->n_xedges;
    for (int i = 0; i < x->n_edges; i++) {
        GROW(b->xedges, b->n_xedges, b->cap_xedges);
        b->xedges[b->n_xedges++] = b->xedges[x->first_edge + i];
    }
    GROW(b->xedges, b->n_xedges, b->cap_xedges);
    b->xedges[b->n_xedges++] = (g_xedge){c, child};
    x->first_edge = first;
    x->n_edges++;
    return child;
}

int gb_xtrie(g_builder *b, const char *const *keys, const size_t *lens, int n) {
    if (b->n_xnodes == 0) xnode_new(b); /* node 0 means "off the trie" */
    int root = xnode_new(b);
    for (int k = 0; k < n; k++) {
        int node = root;
        for (size_t i = 0; i < lens[k]; i++) node = xnode_child(b, node, (uint8_t)keys[k][i], 1);
        b->xnodes[node].terminal = 1;
    }
    return root;
}

void seq_push(g_seq *s, g_elem e) {
    GROW(s->e, s->n, s->cap);
    s->e[s->n++] = e;
}
void seq_bytes(g_builder *b, g_seq *s, const uint8_t cls[32]) {
    seq_push(s, (g_elem){.kind = G_BYTES, .a = gb_class(b, cls)});
}
void seq_byte(g_builder *b, g_seq *s, uint8_t c) {
    uint8_t cls[32] = {0};
    cls[c >> 3] |= (uint8_t)(1u << (c & 7));
    seq_bytes(b, s, cls);
}
void seq_lit(g_builder *b, g_seq *s, const char *lit, size_t n) {
    for (size_t i = 0; i < n; i++) seq_byte(b, s, (uint8_t)lit[i]);
}
void seq_rule(g_seq *s, int rule) { seq_push(s, (g_elem){.kind = G_RULE, .a = rule}); }
void seq_repeat(g_seq *s, int rule, int64_t min, int64_t max) {
    seq_push(s, (g_elem){.kind = G_REPEAT, .a = rule, .b = (int32_t)min, .c = max});
}
void seq_lexeme(g_seq *s, int lex) { seq_push(s, (g_elem){.kind = G_LEX, .a = lex}); }
void seq_free(g_seq *s) {
    free(s->e);
    s->e = NULL;
    s->n = s->cap = 0;
}

void gb_free(g_builder *b) {
    for (int i = 0; i < b->n_rules; i++) free(b->rule_alts[i]);
    free(b->rule_alts), free(b->rule_nalts), free(b->rule_capalts), free(b->elems);
    free(b->classes), free(b->lexes), free(b->ids), free(b->xnodes), free(b->xedges);
    memset(b, 0, sizeof *b);
}

/* ------------------------------------------------------------------------------------------ */
/* Grammar                                                                                     */

struct lunar_grammar {
    const lunar_vocab *v;
    g_elem *elems;
    int n_elems;
    int32_t *alts; /* all alternatives' start positions, rule by rule */
    int32_t *rule_first, *rule_n;
    int n_rules;
    uint8_t (*classes)[32];
    g_lex *lexes;
    int32_t *ids;
    g_xnode *xnodes;
    g_xedge *xedges;
    int start_pos; /* the synthetic root alternative: root rule, then end tokens */
    /* completion costs (see "Budget"), in units: a byte, or a control token (end tokens: 0) */
    int64_t *sfx;      /* [n_elems] fewest units from this element to the end of its alternative */
    int64_t *rmin;     /* [n_rules] fewest units of a rule's language (G_INF: none) */
    int64_t *xcost;    /* [n_xnodes] excluded-key trie node: fewest units to close the key from there */
    int64_t xcost_max;
    int n_xnodes;
    int budget;        /* units are tokens (the vocabulary has every byte as a token): budgets apply */
};

void lunar_grammar_free(lunar_grammar *g) {
    if (!g) return;
    free(g->elems), free(g->alts), free(g->rule_first), free(g->rule_n), free(g->classes);
    free(g->lexes), free(g->ids), free(g->xnodes), free(g->xedges);
    free(g->sfx), free(g->rmin), free(g->xcost);
    free(g);
}

/* ------------------------------------------------------------------------------------------ */
/* Lexemes                                                                                     */

static int xchild(const lunar_grammar *g, int node, uint8_t c) {
    const g_xnode *x = &g->xnodes[node];
    for (int i = 0; i < x->n_edges; i++)
        if (g->xedges[x->first_edge + i].byte == c) return g->xedges[x->first_edge + i].to;
    return 0;
}

static __int128 p10(int k) {
    __int128 r = 1;
    while (k-- > 0) r *= 10;
    return r;
}

#define NUM_BIG (p10(NUM_MAX_INT_DIGITS + 18))

/* Narrows magnitudes [*a, *b] (units) to the bounds for this sign; 0 when nothing is left. */
static int num_clamp(const g_lex *lx, int neg, __int128 *a, __int128 *b) {
    __int128 cl = 0, ch = NUM_BIG;
    if (!neg) {
        if (lx->has_lo && lx->lo > cl) cl = lx->lo;
        if (lx->has_hi) ch = lx->hi;
    } else {
        if (lx->has_hi && -lx->hi > cl) cl = -lx->hi;
        if (lx->has_lo) ch = -lx->lo;
    }
    if (*a < cl) *a = cl;
    if (*b > ch) *b = ch;
    return *a <= *b;
}

/* Some magnitude in [a, b] (units) satisfies the bounds for this sign (integers: a whole number). */
static int num_feasible(const g_lex *lx, int neg, __int128 a, __int128 b) {
    if (!num_clamp(lx, neg, &a, &b)) return 0;
    if (lx->integer) {
        __int128 k = (a + NUM_SCALE - 1) / NUM_SCALE;
        return k * NUM_SCALE <= b;
    }
    return 1;
}

enum { N_START, N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC };
#define NUM_PACK(ph, neg, idig, fdig, F) \
    ((int64_t)(ph) | (int64_t)(neg) << 3 | (int64_t)(idig) << 4 | (int64_t)(fdig) << 9 | (int64_t)(F) << 13)

static int num_viable(const g_lex *lx, int64_t I, int64_t n2) {
    int ph = (int)(n2 & 7), neg = (int)(n2 >> 3 & 1), idig = (int)(n2 >> 4 & 31), fdig = (int)(n2 >> 9 & 15);
    int64_t F = n2 >> 13;
    if (!lx->has_lo && !lx->has_hi) return 1;
    __int128 S = NUM_SCALE, maxm = p10(NUM_MAX_INT_DIGITS) * S - 1;
    switch (ph) {
    case N_START: return num_feasible(lx, 0, 0, maxm) || num_feasible(lx, 1, 0, maxm);
    case N_MINUS: return num_feasible(lx, 1, 0, maxm);
    case N_ZERO: return num_feasible(lx, neg, 0, lx->integer ? 0 : S - 1);
    case N_INT:
        for (int j = 0; j + idig <= NUM_MAX_INT_DIGITS; j++) {
            __int128 pj = p10(j);
            if (num_feasible(lx, neg, (__int128)I * pj * S, ((__int128)I + 1) * pj * S - 1)) return 1;
        }
        return 0;
    case N_DOT: return num_feasible(lx, neg, (__int128)I * S, (__int128)I * S + S - 1);
    case N_FRAC: {
        __int128 u = p10(NUM_MAX_FRAC_DIGITS - fdig), base = (__int128)I * S + (__int128)F * u;
        return num_feasible(lx, neg, base, base + u - 1);
    }
    }
    return 0;
}

static int num_step(const g_lex *lx, int64_t I, int64_t n2, uint8_t c, int64_t *oI, int64_t *on2) {
    int ph = (int)(n2 & 7), neg = (int)(n2 >> 3 & 1), idig = (int)(n2 >> 4 & 31), fdig = (int)(n2 >> 9 & 15);
    int64_t F = n2 >> 13;
    int dig = c >= '0' && c <= '9', d = c - '0';
    switch (ph) {
    case N_START:
    case N_MINUS:
        if (c == '-' && ph == N_START) n2 = NUM_PACK(N_MINUS, 1, 0, 0, 0);
        else if (c == '0') n2 = NUM_PACK(N_ZERO, neg, 1, 0, 0), I = 0;
        else if (dig) n2 = NUM_PACK(N_INT, neg, 1, 0, 0), I = d;
        else return 0;
        break;
    case N_ZERO:
    case N_INT:
        if (c == '.' && !lx->integer) n2 = NUM_PACK(N_DOT, neg, idig, 0, 0);
        else if (dig && ph == N_INT && idig < NUM_MAX_INT_DIGITS) n2 = NUM_PACK(N_INT, neg, idig + 1, 0, 0), I = I * 10 + d;
        else return 0;
        break;
    case N_DOT:
        if (!dig) return 0;
        n2 = NUM_PACK(N_FRAC, neg, idig, 1, d);
        break;
    case N_FRAC:
        if (!dig || fdig >= NUM_MAX_FRAC_DIGITS) return 0;
        n2 = NUM_PACK(N_FRAC, neg, idig, fdig + 1, F * 10 + d);
        break;
    default: return 0;
    }
    if (!num_viable(lx, I, n2)) return 0;
    *oI = I;
    *on2 = n2;
    return 1;
}

static int num_can_end(const g_lex *lx, int64_t I, int64_t n2) {
    int ph = (int)(n2 & 7), neg = (int)(n2 >> 3 & 1), fdig = (int)(n2 >> 9 & 15);
    int64_t F = n2 >> 13;
    if (ph != N_ZERO && ph != N_INT && ph != N_FRAC) return 0;
    __int128 val = (__int128)I * NUM_SCALE + (ph == N_FRAC ? (__int128)F * p10(NUM_MAX_FRAC_DIGITS - fdig) : 0);
    return num_feasible(lx, neg, val, val);
}

static int num_can_continue(const g_lex *lx, int64_t I, int64_t n2) {
    int ph = (int)(n2 & 7), idig = (int)(n2 >> 4 & 31), fdig = (int)(n2 >> 9 & 15);
    int64_t t1, t2;
    switch (ph) {
    case N_START: case N_MINUS: case N_DOT: return 1;
    case N_ZERO: return num_step(lx, I, n2, '.', &t1, &t2);
    case N_INT:
        if (num_step(lx, I, n2, '.', &t1, &t2)) return 1;
        if (idig >= NUM_MAX_INT_DIGITS) return 0;
        for (int c = '0'; c <= '9'; c++)
            if (num_step(lx, I, n2, (uint8_t)c, &t1, &t2)) return 1;
        return 0;
    case N_FRAC: return fdig < NUM_MAX_FRAC_DIGITS;
    }
    return 0;
}

/* String state: n = code points started (saturated at min_len when unbounded);
 * n2 = phase | excluded-key trie node << 8 (0: off the trie). */
static int str_step(const lunar_grammar *g, const g_lex *lx, int64_t n, int64_t n2, uint8_t c, int64_t *on,
                    int64_t *on2) {
    int ph = (int)(n2 & 255), t = (int)(n2 >> 8), starts;
    if (lx->raw) { /* no quotes, no excluded keys: lengths only */
        int np = raw_phase_step(ph, c, &starts);
        if (np < 0) return 0;
        if (starts) {
            if (lx->max_len >= 0 && n + 1 > lx->max_len) return 0;
            n = n + 1;
            if (lx->max_len < 0 && n > lx->min_len) n = lx->min_len;
        }
        *on = n;
        *on2 = np;
        return 1;
    }
    int np = str_phase_step(ph, c, &starts);
    if (np < 0) return 0;
    if (ph == S_START) {
        t = lx->excl >= 0 ? lx->excl : 0;
    } else if (np == S_DONE) {
        if (n < lx->min_len) return 0;
        if (t && g->xnodes[t].terminal) return 0;
    } else {
        if (starts) {
            if (lx->max_len >= 0 && n + 1 > lx->max_len) return 0;
            n = n + 1;
            if (lx->max_len < 0 && n > lx->min_len) n = lx->min_len;
        }
        if (t) {
            if (c == '\\') return 0; /* no escapes while the key could still equal an excluded one */
            t = xchild(g, t, c);
            /* a full excluded key with no room left could neither close nor go on */
            if (t && g->xnodes[t].terminal && np == S_BODY && lx->max_len >= 0 && n >= lx->max_len) return 0;
        }
    }
    *on = n;
    *on2 = np | (int64_t)t << 8;
    return 1;
}

static void lex_init(const g_lex *lx, int64_t *n, int64_t *n2) {
    *n = 0;
    *n2 = lx->kind == LEX_STR && lx->raw ? S_BODY : 0;
}

static int lex_step(const lunar_grammar *g, const g_lex *lx, int64_t n, int64_t n2, uint8_t c, int64_t *on,
                    int64_t *on2) {
    if (lx->kind == LEX_STR) return str_step(g, lx, n, n2, c, on, on2);
    return num_step(lx, n, n2, c, on, on2);
}
static int lex_can_end(const g_lex *lx, int64_t n, int64_t n2) {
    if (lx->kind == LEX_STR && lx->raw) return n2 == S_BODY && n >= lx->min_len;
    if (lx->kind == LEX_STR) return (n2 & 255) == S_DONE;
    return num_can_end(lx, n, n2);
}
static int lex_can_continue(const g_lex *lx, int64_t n, int64_t n2) {
    if (lx->kind == LEX_STR && lx->raw) return n2 != S_BODY || lx->max_len < 0 || n < lx->max_len;
    if (lx->kind == LEX_STR) return (n2 & 255) != S_DONE;
    return num_can_continue(lx, n, n2);
}


/* ------------------------------------------------------------------------------------------ */
/* Budget: the fewest units that finish the value                                             */
/*
 * A unit is one byte of output, or one control token (the end tokens count 0: the value is complete
 * before them). D(state) = the fewest units from a matcher state to a complete value, exact over the
 * grammar: the min over its stacks of (the top element's own cost + the frame's precomputed "after"
 * cost, see frame_after). Because every byte is a token of a byte-level BPE vocabulary (checked:
 * vocab->bytes_complete), D is also a number of tokens that surely suffices: emit the shortest
 * completion one byte-token at a time. It is exact in bytes, so its first byte always lowers it by
 * one: a state with D <= R tokens left has a token t with D(state.t) <= R - 1, and keeping only such
 * tokens keeps the output closable to the end (lunar_matcher_fill_mask_budget). */

#define G_INF ((int64_t)1 << 60)
static inline int64_t c_add(int64_t a, int64_t b) { return a >= G_INF || b >= G_INF || a + b >= G_INF ? G_INF : a + b; }
static inline int64_t c_mul(int64_t k, int64_t c) {
    if (k <= 0) return 0;
    if (c >= G_INF || c > G_INF / k) return G_INF;
    return k * c;
}

/* A multiple of u (units) inside magnitudes [a, b] that satisfies the bounds for this sign. */
static int num_grid(const g_lex *lx, int neg, __int128 a, __int128 b, __int128 u) {
    if (!num_clamp(lx, neg, &a, &b)) return 0;
    return (a + u - 1) / u * u <= b;
}

/* Fewest bytes that end a number whose magnitude so far is the integer I (no '.' yet), when up to
 * jmax more integer digits may follow: j digits, then for non-integers maybe '.' and k digits. */
static int64_t num_int_cost(const g_lex *lx, int neg, __int128 I, int jmax) {
    int64_t best = G_INF;
    for (int j = 0; j <= jmax && j < best; j++) {
        __int128 a = I * p10(j) * NUM_SCALE, b = (I + 1) * p10(j) * NUM_SCALE - 1;
        if (num_grid(lx, neg, a, b, NUM_SCALE)) return j < best ? j : best;
        if (lx->integer) continue;
        for (int k = 1; k <= NUM_MAX_FRAC_DIGITS && j + 1 + k < best; k++)
            if (num_grid(lx, neg, a, b, p10(NUM_MAX_FRAC_DIGITS - k))) best = j + 1 + k;
    }
    return best;
}

/* Fewest fraction digits (at least kmin) that end a number whose magnitude lies in [a, b], the
 * digits so far fixing it to a multiple of 10^kmax units. */
static int64_t num_frac_cost(const g_lex *lx, int neg, __int128 a, __int128 b, int kmax, int kmin) {
    for (int k = kmin; k <= kmax; k++)
        if (num_grid(lx, neg, a, b, p10(kmax - k))) return k;
    return G_INF;
}

/* A magnitude from no digit yet: "0" (then maybe a fraction) or D digits led by 1-9. */
static int64_t num_mag_cost(const g_lex *lx, int neg) {
    int64_t best = c_add(1, num_int_cost(lx, neg, 0, 0));
    for (int d = 1; d <= NUM_MAX_INT_DIGITS && d < best; d++) {
        __int128 a = p10(d - 1) * NUM_SCALE, b = p10(d) * NUM_SCALE - 1;
        if (num_grid(lx, neg, a, b, NUM_SCALE)) return d;
        if (lx->integer) continue;
        for (int k = 1; k <= NUM_MAX_FRAC_DIGITS && d + 1 + k < best; k++)
            if (num_grid(lx, neg, a, b, p10(NUM_MAX_FRAC_DIGITS - k))) best = d + 1 + k;
    }
    return best;
}

/* Fewest bytes that end the number lexeme from its state (exact: the bounds decide). */
static int64_t num_cost(const g_lex *lx, int64_t I, int64_t n2) {
    int ph = (int)(n2 & 7), neg = (int)(n2 >> 3 & 1), idig = (int)(n2 >> 4 & 31), fdig = (int)(n2 >> 9 & 15);
    int64_t F = n2 >> 13;
    if (!lx->has_lo && !lx->has_hi) return ph == N_START || ph == N_MINUS || ph == N_DOT;
    __int128 S = NUM_SCALE;
    switch (ph) {
    case N_START: {
        int64_t p = num_mag_cost(lx, 0), q = c_add(1, num_mag_cost(lx, 1));
        return p < q ? p : q;
    }
    case N_MINUS: return num_mag_cost(lx, 1);
    case N_ZERO: return num_int_cost(lx, neg, 0, 0);
    case N_INT: return num_int_cost(lx, neg, I, NUM_MAX_INT_DIGITS - idig);
    case N_DOT: return num_frac_cost(lx, neg, (__int128)I * S, (__int128)I * S + S - 1, NUM_MAX_FRAC_DIGITS, 1);
    case N_FRAC: {
        __int128 w = p10(NUM_MAX_FRAC_DIGITS - fdig), base = (__int128)I * S + (__int128)F * w;
        return num_frac_cost(lx, neg, base, base + w - 1, NUM_MAX_FRAC_DIGITS - fdig, 0);
    }
    }
    return G_INF;
}

/* Fewest bytes that end the string lexeme from its state. n2 = phase | excluded-key node << 8. Keys
 * checked against excluded names have no length bounds (g_finish checks): on the trie, a key can
 * close now unless it equals an excluded name (xcost: fewest bytes to step to one that does not). */
static int64_t str_cost(const lunar_grammar *g, const g_lex *lx, int64_t n, int64_t n2) {
    int ph = (int)(n2 & 255), t = (int)(n2 >> 8);
    if (lx->raw) return c_add(phase_pend(ph), lx->min_len > n ? lx->min_len - n : 0);
    if (ph == S_DONE) return 0;
    if (ph == S_START) {
        if (lx->excl >= 0) return 1 + (g->xnodes[lx->excl].terminal ? g->xcost[lx->excl] : 1);
        return c_add(2, lx->min_len);
    }
    if (t) {
        if (ph == S_BODY) return g->xnodes[t].terminal ? g->xcost[t] : 1;
        /* inside a code point on the trie: an upper bound that still drops by one per byte */
        return phase_pend(ph) + g->xcost_max;
    }
    int64_t rem = lx->min_len > n ? lx->min_len - n : 0;
    return c_add(phase_pend(ph) + 1, rem);
}

static int64_t lex_cost(const lunar_grammar *g, const g_lex *lx, int64_t n, int64_t n2) {
    return lx->kind == LEX_STR ? str_cost(g, lx, n, n2) : num_cost(lx, n, n2);
}

/* The excluded-key trie's costs (children have higher indices than their parents). */
static void x_costs(lunar_grammar *g) {
    g->xcost = lunar_xcalloc((size_t)(g->n_xnodes ? g->n_xnodes : 1), sizeof(int64_t));
    g->xcost_max = 1;
    for (int t = g->n_xnodes - 1; t >= 1; t--) {
        if (!g->xnodes[t].terminal) {
            g->xcost[t] = 1;
            continue;
        }
        int64_t best = G_INF;
        for (int c = 0x20; c < 0x7F; c++) {
            if (c == '"' || c == '\\') continue;
            int ch = xchild(g, t, (uint8_t)c);
            int64_t k = !ch || !g->xnodes[ch].terminal ? 1 : g->xcost[ch];
            if (k < best) best = k;
        }
        g->xcost[t] = c_add(1, best);
        if (g->xcost[t] > g->xcost_max && g->xcost[t] < G_INF) g->xcost_max = g->xcost[t];
    }
}

static int64_t elem_cost(const lunar_grammar *g, const g_elem *e) {
    switch (e->kind) {
    case G_BYTES: return 1;
    case G_TOKENS: return e->is_end ? 0 : 1;
    case G_LEX: return lex_cost(g, &g->lexes[e->a], 0, 0);
    case G_RULE: return g->rmin[e->a];
    case G_REPEAT: return c_mul(e->b, g->rmin[e->a]);
    default: return 0;
    }
}

/* sfx and rmin: a fixed point from "nothing derivable" (shortest derivations use no rule twice on a
 * path, so it settles within n_rules rounds; rules are mostly created parent first, so a backwards
 * sweep settles in a few). */
static void g_costs(lunar_grammar *g) {
    g->rmin = lunar_xmalloc((size_t)(g->n_rules ? g->n_rules : 1) * sizeof(int64_t));
    g->sfx = lunar_xmalloc((size_t)(g->n_elems ? g->n_elems : 1) * sizeof(int64_t));
    for (int r = 0; r < g->n_rules; r++) g->rmin[r] = G_INF;
    for (int round = 0, changed = 1; changed && round <= g->n_rules + 1; round++) {
        changed = 0;
        for (int r = g->n_rules - 1; r >= 0; r--)
            for (int i = 0; i < g->rule_n[r]; i++) {
                int64_t c = 0;
                for (int p = g->alts[g->rule_first[r] + i]; g->elems[p].kind != G_END && c < G_INF; p++)
                    c = c_add(c, elem_cost(g, &g->elems[p]));
                if (c < g->rmin[r]) g->rmin[r] = c, changed = 1;
            }
    }
    for (int p = g->n_elems - 1; p >= 0; p--)
        g->sfx[p] = g->elems[p].kind == G_END ? 0 : c_add(elem_cost(g, &g->elems[p]), g->sfx[p + 1]);
}

/* ------------------------------------------------------------------------------------------ */
/* Matcher                                                                                     */

typedef struct {
    int32_t pos, parent;
    int64_t n, n2;
    int64_t after; /* fewest units once the element at pos is done (frame_after) */
} g_frame;

#define ACCEPTED (-2)
#define MCACHE 32
#define MAX_CLOSURE_DEPTH 4000

typedef struct {
    uint64_t h;
    int64_t *key;
    int nkey, valid;
    uint32_t *mask;
    int64_t xmax;
} mcache_ent;

struct lunar_matcher {
    const lunar_grammar *g;
    g_frame *ar;
    int n_ar, cap_ar;
    int32_t *buf; /* stack sets; the state is buf[0 .. n_state) */
    int n_buf, cap_buf, n_state;
    int overflow;
    int32_t *lvl_s, *lvl_e, *lvl_ar; /* trie walk: per depth */
    int64_t *key;
    int n_key, cap_key;
    int64_t xmax; /* compute_mask: the largest D after any allowed token (an upper bound) */
    mcache_ent cache[MCACHE];
    int cache_next;
    uint32_t *tmp, *tmp2, *plain;
    int32_t *remap;
    int cap_remap;
};

/* The fewest units after the element at pos is done: the rest of its alternative, then what its
 * parent still needs (a repetition: the iterations still owed to its minimum, then its own after). */
static int64_t frame_after(const lunar_matcher *m, int32_t pos, int32_t parent) {
    const lunar_grammar *g = m->g;
    if (g->elems[pos].kind == G_END) return 0; /* a transient frame: never asked */
    int64_t c = g->sfx[pos + 1];
    if (parent < 0) return c;
    const g_frame *p = &m->ar[parent];
    const g_elem *pe = &g->elems[p->pos];
    int64_t up = p->after;
    if (pe->kind == G_REPEAT && pe->b > p->n + 1) up = c_add(up, c_mul(pe->b - (p->n + 1), g->rmin[pe->a]));
    return c_add(c, up);
}

static int32_t fr_new(lunar_matcher *m, int32_t pos, int32_t parent, int64_t n, int64_t n2) {
    int64_t after = frame_after(m, pos, parent);
    GROW(m->ar, m->n_ar, m->cap_ar);
    m->ar[m->n_ar] = (g_frame){pos, parent, n, n2, after};
    return m->n_ar++;
}

/* D of one stack: its top element's own cost, then its frame's after. */
static int64_t top_cost(const lunar_matcher *m, int32_t top) {
    if (top == ACCEPTED) return 0;
    const g_frame *f = &m->ar[top];
    const g_elem *e = &m->g->elems[f->pos];
    switch (e->kind) {
    case G_BYTES: return c_add(1, f->after);
    case G_TOKENS: return c_add(e->is_end ? 0 : 1, f->after);
    case G_LEX: return c_add(lex_cost(m->g, &m->g->lexes[e->a], f->n, f->n2), f->after);
    default: return G_INF;
    }
}

/* D of a set of stacks buf[s .. e). */
static int64_t set_cost(const lunar_matcher *m, int s, int e) {
    int64_t d = G_INF;
    for (int k = s; k < e; k++) {
        int64_t c = top_cost(m, m->buf[k]);
        if (c < d) d = c;
    }
    return d;
}

static int32_t fr_enter(lunar_matcher *m, int32_t pos, int32_t parent) {
    int64_t n = 0, n2 = 0;
    const g_elem *e = &m->g->elems[pos];
    if (e->kind == G_LEX) lex_init(&m->g->lexes[e->a], &n, &n2);
    return fr_new(m, pos, parent, n, n2);
}

static void set_add(lunar_matcher *m, int ss, int32_t top) {
    for (int k = ss; k < m->n_buf; k++) {
        int32_t o = m->buf[k];
        if (o == top) return;
        if (o >= 0 && top >= 0) {
            const g_frame *a = &m->ar[o], *b = &m->ar[top];
            if (a->pos == b->pos && a->n == b->n && a->n2 == b->n2 && a->parent == b->parent) return;
        }
    }
    GROW(m->buf, m->n_buf, m->cap_buf);
    m->buf[m->n_buf++] = top;
}

static void closure(lunar_matcher *m, int ss, int32_t top, int depth) {
    if (depth > MAX_CLOSURE_DEPTH) {
        m->overflow = 1;
        return;
    }
    const lunar_grammar *g = m->g;
    g_frame f = m->ar[top];
    const g_elem *e = &g->elems[f.pos];
    switch (e->kind) {
    case G_BYTES:
    case G_TOKENS: set_add(m, ss, top); return;
    case G_LEX: {
        const g_lex *lx = &g->lexes[e->a];
        if (lex_can_continue(lx, f.n, f.n2)) set_add(m, ss, top);
        if (lex_can_end(lx, f.n, f.n2)) closure(m, ss, fr_enter(m, f.pos + 1, f.parent), depth + 1);
        return;
    }
    case G_RULE:
        for (int i = 0; i < g->rule_n[e->a]; i++)
            closure(m, ss, fr_enter(m, g->alts[g->rule_first[e->a] + i], top), depth + 1);
        return;
    case G_REPEAT:
        if (e->c < 0 || f.n < e->c)
            for (int i = 0; i < g->rule_n[e->a]; i++)
                closure(m, ss, fr_enter(m, g->alts[g->rule_first[e->a] + i], top), depth + 1);
        if (f.n >= e->b) closure(m, ss, fr_enter(m, f.pos + 1, f.parent), depth + 1);
        return;
    case G_END: {
        if (f.parent < 0) {
            set_add(m, ss, ACCEPTED);
            return;
        }
        g_frame p = m->ar[f.parent];
        const g_elem *pe = &g->elems[p.pos];
        if (pe->kind == G_RULE) {
            closure(m, ss, fr_enter(m, p.pos + 1, p.parent), depth + 1);
        } else {
            int64_t n = p.n + 1;
            if (pe->c < 0 && n > pe->b) n = pe->b; /* saturate: the state repeats exactly */
            closure(m, ss, fr_new(m, p.pos, p.parent, n, 0), depth + 1);
        }
        return;
    }
    }
}

static inline int cls_has(const uint8_t *cls, uint8_t c) { return cls[c >> 3] >> (c & 7) & 1; }

static void advance_one(lunar_matcher *m, int ss, int32_t top, uint8_t c) {
    if (top < 0) return;
    g_frame f = m->ar[top];
    const g_elem *e = &m->g->elems[f.pos];
    if (e->kind == G_BYTES) {
        if (cls_has(m->g->classes[e->a], c)) closure(m, ss, fr_enter(m, f.pos + 1, f.parent), 0);
    } else if (e->kind == G_LEX) {
        int64_t n, n2;
        if (lex_step(m->g, &m->g->lexes[e->a], f.n, f.n2, c, &n, &n2))
            closure(m, ss, fr_new(m, f.pos, f.parent, n, n2), 0);
    }
}

/* Advances the set buf[s0 .. e0) over bytes; the result is buf[*rs .. n_buf) (empty: dead). */
static void advance_bytes(lunar_matcher *m, int s0, int e0, const uint8_t *s, size_t len, int *rs) {
    for (size_t i = 0; i < len; i++) {
        int ns = m->n_buf;
        for (int k = s0; k < e0; k++) advance_one(m, ns, m->buf[k], s[i]);
        s0 = ns;
        e0 = m->n_buf;
        if (s0 == e0) break;
    }
    *rs = s0;
}

lunar_matcher *lunar_matcher_new(const lunar_grammar *g) {
    lunar_matcher *m = lunar_xcalloc(1, sizeof *m);
    m->g = g;
    int d = g->v->max_depth + 2;
    m->lvl_s = lunar_xmalloc((size_t)d * sizeof(int32_t));
    m->lvl_e = lunar_xmalloc((size_t)d * sizeof(int32_t));
    m->lvl_ar = lunar_xmalloc((size_t)d * sizeof(int32_t));
    m->tmp = lunar_xmalloc((size_t)g->v->words * sizeof(uint32_t));
    m->tmp2 = lunar_xmalloc((size_t)g->v->words * sizeof(uint32_t));
    closure(m, 0, fr_enter(m, g->start_pos, -1), 0);
    m->n_state = m->n_buf;
    return m;
}

void lunar_matcher_free(lunar_matcher *m) {
    if (!m) return;
    for (int i = 0; i < MCACHE; i++) free(m->cache[i].key), free(m->cache[i].mask);
    free(m->ar), free(m->buf), free(m->lvl_s), free(m->lvl_e), free(m->lvl_ar), free(m->key);
    free(m->tmp), free(m->tmp2), free(m->plain), free(m->remap);
    free(m);
}

static inline void bit_set(uint32_t *mask, int32_t id) { mask[id >> 5] |= 1u << (id & 31); }

static void key_push(lunar_matcher *m, int64_t x) {
    GROW(m->key, m->n_key, m->cap_key);
    m->key[m->n_key++] = x;
}

static uint64_t state_key(lunar_matcher *m) {
    m->n_key = 0;
    for (int k = 0; k < m->n_state; k++) {
        for (int32_t t = m->buf[k]; t >= 0; t = m->ar[t].parent) {
            key_push(m, m->ar[t].pos);
            key_push(m, m->ar[t].n);
            key_push(m, m->ar[t].n2);
        }
        key_push(m, m->buf[k] == ACCEPTED ? -2 : -1);
    }
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < m->n_key; i++) {
        h ^= (uint64_t)m->key[i];
        h *= 0x100000001b3ull;
        h ^= h >> 29;
    }
    return h;
}

/* Masks take a limit lim on D after the token: G_INF (no limit: every allowed token, and m->xmax
 * gathers the largest D after one, an upper bound) or a number (budget mode: only tokens after which
 * D <= lim). */
static inline void add_tok(lunar_matcher *m, uint32_t *mask, int32_t id, int64_t d, int64_t lim) {
    if (lim >= G_INF) {
        if (d > m->xmax) m->xmax = d;
        bit_set(mask, id);
    } else if (d <= lim) {
        bit_set(mask, id);
    }
}

/* Trie walk for the stacks buf[s0 .. e0) (at the end of buf). */
static void walk_range(lunar_matcher *m, int s0, int e0, uint32_t *mask, int32_t from, int32_t to, int64_t lim) {
    const lunar_vocab *v = m->g->v;
    const int costs = m->g->budget;
    m->lvl_s[0] = s0;
    m->lvl_e[0] = e0;
    m->lvl_ar[0] = m->n_ar;
    for (int32_t i = from; i < to;) {
        int d = v->nd[i];
        m->n_buf = m->lvl_e[d - 1];
        m->n_ar = m->lvl_ar[d - 1];
        int ns = m->n_buf;
        uint8_t c = v->nb[i];
        for (int k = m->lvl_s[d - 1]; k < m->lvl_e[d - 1]; k++) advance_one(m, ns, m->buf[k], c);
        if (m->n_buf == ns) {
            i = v->nskip[i];
            continue;
        }
        m->lvl_s[d] = ns;
        m->lvl_e[d] = m->n_buf;
        m->lvl_ar[d] = m->n_ar;
        if (v->ntok[i] >= 0) {
            int64_t dn = costs ? set_cost(m, ns, m->n_buf) : 0;
            for (int32_t t = v->ntok[i]; t >= 0; t = v->same_next[t]) add_tok(m, mask, t, dn, lim);
        }
        i++;
    }
    m->n_buf = e0;
    m->n_ar = m->lvl_ar[0];
}

static void walk(lunar_matcher *m, int s0, int e0, uint32_t *mask, int64_t lim) {
    walk_range(m, s0, e0, mask, 0, m->g->v->n_nodes, lim);
}

/* A string lexeme inside its body, off the excluded-key trie: the tables decide the tokens that
 * stay inside; tokens that close it are checked per group of equal trailing bytes. D after a token
 * that stays: its pending bytes + the code points still owed + the quote + the frame's after. */
static void str_fast(lunar_matcher *m, int32_t top, uint32_t *mask, int no_close_now, int64_t lim) {
    const lunar_grammar *g = m->g;
    const lunar_vocab *v = g->v;
    g_frame f = m->ar[top];
    f.n2 &= 255; /* the tables know nothing of the excluded-key trie: see str_on_trie */
    const g_lex *lx = &g->lexes[g->elems[f.pos].a];
    const str_table *t = &v->st[f.n2 & 255];
    int64_t room = lx->max_len < 0 ? INT64_MAX : lx->max_len - f.n;
    int64_t rem = lx->min_len > f.n ? lx->min_len - f.n : 0;
    if (lim < G_INF) { /* budget mode: token by token */
        for (int i = 0; i < t->n_stay && t->stay_n[i] <= room; i++) {
            int64_t d = c_add(c_add(t->stay_pend[i] + 1, rem > t->stay_n[i] ? rem - t->stay_n[i] : 0), f.after);
            if (d <= lim) bit_set(mask, t->stay_ids[i]);
        }
    } else {
        if (t->n_stay && room >= t->stay_n[0]) {
            int64_t d = c_add(c_add(t->max_pend + 1, rem), f.after);
            if (d > m->xmax) m->xmax = d;
        }
        if (room >= t->max_n) {
            for (int w = 0; w < v->words; w++) mask[w] |= t->stay_mask[w];
        } else if (room >= 0) {
            int lo = 0, hi = t->n_stay; /* first index with stay_n > room */
            while (lo < hi) {
                int mid = (lo + hi) / 2;
                if (t->stay_n[mid] <= room) lo = mid + 1;
                else hi = mid;
            }
            if (lo < t->n_stay - lo) {
                for (int i = 0; i < lo; i++) bit_set(mask, t->stay_ids[i]);
            } else {
                memcpy(m->tmp, t->stay_mask, (size_t)v->words * sizeof(uint32_t));
                for (int i = lo; i < t->n_stay; i++) m->tmp[t->stay_ids[i] >> 5] &= ~(1u << (t->stay_ids[i] & 31));
                for (int w = 0; w < v->words; w++) mask[w] |= m->tmp[w];
            }
        }
    }
    if (!t->n_close) return;
    /* the stacks after the string: closure of the finished lexeme */
    int ar0 = m->n_ar, cs = m->n_buf;
    closure(m, cs, fr_new(m, f.pos, f.parent, f.n, S_DONE), 0);
    int ce = m->n_buf, ar1 = m->n_ar;
    if (ce > cs) {
        const uint8_t *prev = NULL;
        size_t prev_len = 0;
        int ok = 0;
        int64_t dg = 0;
        for (int i = 0; i < t->n_close; i++) {
            int32_t id = t->close_ids[i];
            const uint8_t *r = v->bytes + v->off[id] + t->close_off[i] + 1;
            size_t rl = v->off[id + 1] - (v->off[id] + (uint32_t)t->close_off[i] + 1);
            if (!prev || rl != prev_len || memcmp(r, prev, rl)) {
                int rs;
                advance_bytes(m, cs, ce, r, rl, &rs);
                ok = m->n_buf > rs || rl == 0;
                dg = !g->budget ? 0 : rl == 0 ? set_cost(m, cs, ce) : set_cost(m, rs, m->n_buf);
                m->n_buf = ce;
                m->n_ar = ar1;
                prev = r;
                prev_len = rl;
            }
            if (!ok || (no_close_now && t->close_off[i] == 0)) continue;
            int64_t cnt = f.n + t->close_n[i];
            if (cnt < lx->min_len || (lx->max_len >= 0 && cnt > lx->max_len)) continue;
            add_tok(m, mask, id, dg, lim);
        }
    }
    m->n_buf = cs;
    m->n_ar = ar0;
}

/* A key string in its body while it still equals a prefix of an excluded key (trie node t): tokens
 * whose first byte leaves the trie behave exactly as off the trie (the tables), except that a
 * backslash is refused and an immediate closing quote is refused at a full excluded key; tokens
 * whose first byte follows the trie are walked. Adds this stack's tokens to mask. */
static void str_on_trie(lunar_matcher *m, int32_t top, uint32_t *mask, int64_t lim) {
    const lunar_grammar *g = m->g;
    const lunar_vocab *v = g->v;
    int t = (int)(m->ar[top].n2 >> 8);
    uint32_t *own = m->tmp2;
    memset(own, 0, (size_t)v->words * sizeof(uint32_t));
    str_fast(m, top, own, g->xnodes[t].terminal, lim);
    const g_xnode *x = &g->xnodes[t];
    for (int e = -1; e < x->n_edges; e++) {
        int32_t node = v->root_child[e < 0 ? '\\' : g->xedges[x->first_edge + e].byte];
        if (node < 0) continue;
        for (int32_t i = node; i < v->nskip[node]; i++)
            for (int32_t id = v->ntok[i]; id >= 0; id = v->same_next[id]) own[id >> 5] &= ~(1u << (id & 31));
        if (e < 0) continue;
        int s0 = m->n_buf;
        GROW(m->buf, m->n_buf, m->cap_buf);
        m->buf[m->n_buf++] = top;
        walk_range(m, s0, m->n_buf, own, node, v->nskip[node], lim);
        m->n_buf = s0;
    }
    for (int w = 0; w < v->words; w++) mask[w] |= own[w];
}

/* A raw string: the tokens that stay inside it (the raw tables, filtered by the room left); what may
 * follow it has stacks of its own in the state (closure), so nothing here ends it. D after a token:
 * its pending bytes + the code points still owed + the frame's after. */
static void raw_fast(lunar_matcher *m, int32_t top, uint32_t *mask, int64_t lim) {
    const lunar_vocab *v = m->g->v;
    const g_frame *f = &m->ar[top];
    const g_lex *lx = &m->g->lexes[m->g->elems[f->pos].a];
    const str_table *t = &v->rt[f->n2];
    int64_t room = lx->max_len < 0 ? INT64_MAX : lx->max_len - f->n;
    int64_t rem = lx->min_len > f->n ? lx->min_len - f->n : 0;
    if (lim >= G_INF && room >= t->max_n) {
        for (int w = 0; w < v->words; w++) mask[w] |= t->stay_mask[w];
        if (t->n_stay) {
            int64_t d = c_add(c_add(t->max_pend, rem), f->after);
            if (d > m->xmax) m->xmax = d;
        }
        return;
    }
    for (int i = 0; i < t->n_stay && t->stay_n[i] <= room; i++) {
        int64_t d = c_add(c_add(t->stay_pend[i], rem > t->stay_n[i] ? rem - t->stay_n[i] : 0), f->after);
        add_tok(m, mask, t->stay_ids[i], d, lim);
    }
}

static void compute_mask(lunar_matcher *m, uint32_t *mask, int64_t lim) {
    const lunar_grammar *g = m->g;
    const lunar_vocab *v = g->v;
    memset(mask, 0, (size_t)v->words * sizeof(uint32_t));
    m->xmax = 0;
    int ar0 = m->n_ar;
    m->n_buf = m->n_state;
    int gs = m->n_buf;
    for (int k = 0; k < m->n_state; k++) {
        int32_t top = m->buf[k];
        if (top < 0) continue;
        const g_frame *f = &m->ar[top];
        const g_elem *e = &g->elems[f->pos];
        if (e->kind == G_TOKENS) { /* after the token: the frame's after */
            for (int i = 0; i < e->b; i++) {
                int32_t id = g->ids[e->a + i];
                if (id >= 0 && id < v->n) add_tok(m, mask, id, g->budget ? f->after : 0, lim);
            }
        } else {
            GROW(m->buf, m->n_buf, m->cap_buf);
            m->buf[m->n_buf++] = top;
        }
    }
    int ge = m->n_buf, gk = gs;
    /* string bodies off the excluded-key trie take the table path; the rest walk the trie */
    for (int k = gs; k < ge; k++) {
        int32_t top = m->buf[k];
        const g_frame *f = &m->ar[top];
        const g_elem *e = &g->elems[f->pos];
        int ph = (int)(f->n2 & 255);
        if (e->kind == G_LEX && g->lexes[e->a].kind == LEX_STR && g->lexes[e->a].raw)
            raw_fast(m, top, mask, lim);
        else if (e->kind == G_LEX && g->lexes[e->a].kind == LEX_STR && ph > S_START && ph < S_DONE && (f->n2 >> 8) == 0)
            str_fast(m, top, mask, 0, lim);
        else if (e->kind == G_LEX && g->lexes[e->a].kind == LEX_STR && ph == S_BODY)
            str_on_trie(m, top, mask, lim);
        else
            m->buf[gk++] = top;
    }
    m->n_buf = gk;
    if (gk > gs) walk(m, gs, gk, mask, lim);
    m->n_buf = m->n_state;
    m->n_ar = ar0;
}

void lunar_matcher_fill_mask(lunar_matcher *m, uint32_t *mask) {
    const lunar_vocab *v = m->g->v;
    size_t bytes = (size_t)v->words * sizeof(uint32_t);
    uint64_t h = state_key(m);
    for (int i = 0; i < MCACHE; i++) {
        mcache_ent *c = &m->cache[i];
        if (c->valid && c->h == h && c->nkey == m->n_key && !memcmp(c->key, m->key, (size_t)m->n_key * sizeof(int64_t))) {
            memcpy(mask, c->mask, bytes);
            m->xmax = c->xmax;
            return;
        }
    }
    compute_mask(m, mask, G_INF);
    mcache_ent *c = &m->cache[m->cache_next];
    m->cache_next = (m->cache_next + 1) % MCACHE;
    if (!c->mask) c->mask = lunar_xmalloc(bytes);
    free(c->key);
    c->key = lunar_xmalloc((size_t)(m->n_key ? m->n_key : 1) * sizeof(int64_t));
    memcpy(c->key, m->key, (size_t)m->n_key * sizeof(int64_t));
    c->nkey = m->n_key;
    c->h = h;
    c->valid = 1;
    c->xmax = m->xmax;
    memcpy(c->mask, mask, bytes);
}

int lunar_matcher_fill_mask_budget(lunar_matcher *m, uint32_t *mask, int64_t tokens_left) {
    const lunar_vocab *v = m->g->v;
    size_t bytes = (size_t)v->words * sizeof(uint32_t);
    lunar_matcher_fill_mask(m, mask);
    if (!m->g->budget) return 0;
    /* without a budget, still never enter a state from which no value can be finished */
    int64_t left = tokens_left < 0 ? G_INF - 1 : tokens_left - 1;
    if (m->xmax <= left) return 0; /* every allowed token leaves enough */
    int64_t d = set_cost(m, 0, m->n_state), xmax = m->xmax;
    if (d >= G_INF) return 0;
    /* too little left to finish at all: still the fastest way towards the end (output cut at length) */
    int64_t lim = left > d - 1 ? left : d - 1;
    if (!m->plain) m->plain = lunar_xmalloc(bytes);
    memcpy(m->plain, mask, bytes);
    if (xmax >= G_INF && lim < G_INF - 1) compute_mask(m, m->plain, G_INF - 1); /* the reference: no dead ends */
    compute_mask(m, mask, lim);
    m->xmax = xmax;
    return tokens_left >= 0 && memcmp(m->plain, mask, bytes) != 0;
}

int64_t lunar_matcher_tokens_to_finish(const lunar_matcher *m) {
    if (!m->g->budget || m->n_state == 0) return -1;
    int64_t d = set_cost(m, 0, m->n_state);
    return d >= G_INF ? -1 : d;
}

int64_t lunar_grammar_min_tokens(const lunar_grammar *g) { return g->budget ? g->sfx[g->start_pos] : -1; }

/* Keeps only the frames reachable from buf[s .. e), which becomes the state. */
static void commit(lunar_matcher *m, int s, int e) {
    if (m->cap_remap < m->n_ar) {
        m->cap_remap = m->n_ar * 2;
        m->remap = realloc(m->remap, (size_t)m->cap_remap * sizeof(int32_t));
        LUNAR_ASSERT(m->remap);
    }
    for (int i = 0; i < m->n_ar; i++) m->remap[i] = -1;
    for (int k = s; k < e; k++)
        for (int32_t t = m->buf[k]; t >= 0 && m->remap[t] == -1; t = m->ar[t].parent) m->remap[t] = 0;
    int n = 0;
    for (int i = 0; i < m->n_ar; i++) {
        if (m->remap[i] == -1) continue;
        g_frame f = m->ar[i];
        if (f.parent >= 0) f.parent = m->remap[f.parent];
        m->ar[n] = f;
        m->remap[i] = n++;
    }
    m->n_ar = n;
    int ns = 0;
    for (int k = s; k < e; k++) m->buf[ns++] = m->buf[k] >= 0 ? m->remap[m->buf[k]] : m->buf[k];
    m->n_state = m->n_buf = ns;
}

static int matcher_step(lunar_matcher *m, int32_t token, int commit_it) {
    const lunar_grammar *g = m->g;
    const lunar_vocab *v = g->v;
    if (token < 0 || token >= v->n) return -1;
    int ar0 = m->n_ar;
    m->n_buf = m->n_state;
    int rs = m->n_buf, re = m->n_buf;
    if (token < v->n_ranks && v->off[token + 1] > v->off[token]) {
        advance_bytes(m, 0, m->n_state, v->bytes + v->off[token], v->off[token + 1] - v->off[token], &rs);
        re = m->n_buf;
    }
    int fs = m->n_buf;
    for (int k = rs; k < re; k++) set_add(m, fs, m->buf[k]);
    for (int k = 0; k < m->n_state; k++) {
        int32_t top = m->buf[k];
        if (top < 0) continue;
        const g_elem *e = &g->elems[m->ar[top].pos];
        if (e->kind != G_TOKENS) continue;
        for (int i = 0; i < e->b; i++)
            if (g->ids[e->a + i] == token) {
                closure(m, fs, fr_enter(m, m->ar[top].pos + 1, m->ar[top].parent), 0);
                break;
            }
    }
    if (m->n_buf == fs) {
        m->n_buf = m->n_state;
        m->n_ar = ar0;
        return -1;
    }
    if (!commit_it) {
        m->n_buf = m->n_state;
        m->n_ar = ar0;
        return 0;
    }
    commit(m, fs, m->n_buf);
    return 0;
}

int lunar_matcher_accept(lunar_matcher *m, int32_t token) { return matcher_step(m, token, 1); }
int lunar_matcher_can_accept(lunar_matcher *m, int32_t token) { return matcher_step(m, token, 0) == 0; }

int lunar_matcher_is_done(const lunar_matcher *m) {
    if (m->n_state == 0) return 0;
    for (int k = 0; k < m->n_state; k++) {
        int32_t top = m->buf[k];
        if (top == ACCEPTED) continue;
        const g_elem *e = &m->g->elems[m->ar[top].pos];
        if (!(e->kind == G_TOKENS && e->is_end)) return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------ */
/* Grammar assembly                                                                            */

int g_finish(lunar_grammar **out, g_builder *b, const lunar_vocab *v, int root, const int32_t *end_ids,
             int n_end, lunar_err *err) {
    *out = NULL;
    for (int i = 0; i < n_end; i++)
        if (end_ids[i] < 0 || end_ids[i] >= v->n) {
            gb_free(b);
            return lunar_fail(err, "grammar: end token id %d out of range", end_ids[i]);
        }
    /* the synthetic start: root rule, then one end token */
    g_seq s = {0};
    seq_rule(&s, root);
    if (n_end > 0) seq_push(&s, (g_elem){.kind = G_TOKENS, .is_end = 1, .a = gb_tokens(b, end_ids, n_end), .b = n_end});
    int start_rule = gb_rule(b);
    gb_add_alt(b, start_rule, &s);
    seq_free(&s);
    for (int i = 0; i < b->n_elems; i++) {
        const g_elem *e = &b->elems[i];
        if ((e->kind == G_RULE || e->kind == G_REPEAT) && (e->a < 0 || e->a >= b->n_rules)) {
            gb_free(b);
            return lunar_fail(err, "grammar: internal error: bad rule reference");
        }
    }
    lunar_grammar *g = lunar_xcalloc(1, sizeof *g);
    g->v = v;
    g->elems = b->elems, g->n_elems = b->n_elems, b->elems = NULL;
    g->classes = b->classes, b->classes = NULL;
    g->lexes = b->lexes, b->lexes = NULL;
    g->ids = b->ids, b->ids = NULL;
    if (!b->xnodes) gb_xtrie(b, NULL, NULL, 0);
    g->n_xnodes = b->n_xnodes;
    g->xnodes = b->xnodes, b->xnodes = NULL;
    g->xedges = b->xedges, b->xedges = NULL;
    g->n_rules = b->n_rules;
    g->rule_first = lunar_xmalloc((size_t)b->n_rules * sizeof(int32_t));
    g->rule_n = lunar_xmalloc((size_t)b->n_rules * sizeof(int32_t));
    int total = 0;
    for (int r = 0; r < b->n_rules; r++) total += b->rule_nalts[r];
    g->alts = lunar_xmalloc((size_t)(total ? total : 1) * sizeof(int32_t));
    total = 0;
    for (int r = 0; r < b->n_rules; r++) {
        g->rule_first[r] = total;
        g->rule_n[r] = b->rule_nalts[r];
        for (int i = 0; i < b->rule_nalts[r]; i++) g->alts[total++] = b->rule_alts[r][i];
    }
    g->start_pos = g->alts[g->rule_first[start_rule]];
    char hint[sizeof b->hint];
    memcpy(hint, b->hint, sizeof hint);
    int n_lexes = b->n_lexes;
    gb_free(b);
    for (int i = 0; i < n_lexes; i++)
        if (g->lexes[i].kind == LEX_STR && g->lexes[i].excl >= 0 && (g->lexes[i].min_len || g->lexes[i].max_len >= 0)) {
            lunar_grammar_free(g);
            return lunar_fail(err, "grammar: internal error: a key with excluded names has length bounds");
        }
    g->budget = v->bytes_complete;
    x_costs(g);
    g_costs(g);
    int64_t shortest = g->sfx[g->start_pos];
    if (shortest >= G_INF) {
        lunar_grammar_free(g);
        return lunar_fail(err, "grammar: admits no output (every alternative needs something that cannot be produced, "
                               "e.g. a required property whose schema is false, or a recursion with no way out)%s%s",
                          hint[0] ? "; " : "", hint);
    }
    /* a byte count over the longest token's bytes: fewer tokens cannot hold the shortest output */
    int64_t tokens_lb = (shortest + v->max_depth - 1) / (v->max_depth > 0 ? v->max_depth : 1);
    if (tokens_lb > LUNAR_GRAMMAR_MAX_TOKENS) {
        lunar_grammar_free(g);
        return lunar_fail(err, "grammar: the shortest output it allows is %lld bytes, at least %lld tokens: more than any "
                               "context holds (limit %d tokens)%s%s",
                          (long long)shortest, (long long)tokens_lb, LUNAR_GRAMMAR_MAX_TOKENS, hint[0] ? "; " : "", hint);
    }
    lunar_matcher *m = lunar_matcher_new(g);
    int empty = m->n_state == 0, overflow = m->overflow;
    lunar_matcher_free(m);
    if (overflow) {
        lunar_grammar_free(g);
        return lunar_fail(err, "grammar: left recursion or a repetition of an empty-matching rule");
    }
    if (empty) {
        lunar_grammar_free(g);
        return lunar_fail(err, "grammar: admits no output");
    }
    *out = g;
    return 0;
}

int g_lex_satisfiable(const g_lex *lx) {
    if (lx->kind == LEX_NUM) return num_viable(lx, 0, 0);
    return lx->max_len < 0 || lx->max_len >= lx->min_len;
}
