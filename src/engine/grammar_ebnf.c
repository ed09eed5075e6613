/* The EBNF front end of the grammar engine (lunar_grammar_from_ebnf*): text -> builder rules.
 *
 * EBNF dialect (lunar_grammar_from_ebnf), GBNF-like:
 *   rule    ::= NAME "::=" alts             (rules end where the next "NAME ::=" starts)
 *   alts    ::= seq ("|" seq)*
 *   seq     ::= (atom quant?)*
 *   atom    ::= "literal" | [class] | NAME | "(" alts ")" | "<" ID ">" | "."
 *   quant   ::= "*" | "+" | "?" | "{" m "}" | "{" m ",}" | "{" m "," n "}"
 * Literals and classes are bytes (UTF-8 of the text; escapes \n \r \t \\ \" \] \- \xHH \uXXXX);
 * a class may be negated with ^ and has ranges a-z; "." is any byte; <ID> is the token with that id
 * (a control token of the chat format, e.g. <163587>). '#' starts a comment. The start rule is
 * "root". Left recursion and repetitions of rules that match the empty string are not supported. */
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_internal.h"

typedef struct {
    const char *s;
    size_t i;
    g_builder *b;
    char **names;
    int *rules, *defined;
    int n, cap;
    lunar_err *err;
    int failed;
} ebnf_p;

static int ep_fail(ebnf_p *p, const char *what) {
    if (!p->failed) {
        int line = 1;
        for (size_t k = 0; k < p->i && p->s[k]; k++) line += p->s[k] == '\n';
        lunar_fail(p->err, "grammar: %s at line %d", what, line);
    }
    p->failed = 1;
    return -1;
}

static void ep_ws(ebnf_p *p) {
    for (;;) {
        char c = p->s[p->i];
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r') p->i++;
        else if (c == '#')
            while (p->s[p->i] && p->s[p->i] != '\n') p->i++;
        else break;
    }
}

static int is_id0(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static int is_id(char c) { return is_id0(c) || (c >= '0' && c <= '9') || c == '-'; }

static size_t ep_ident(ebnf_p *p, size_t at) {
    size_t j = at;
    if (!is_id0(p->s[j])) return 0;
    while (is_id(p->s[j])) j++;
    return j - at;
}

static int ep_rule_start(ebnf_p *p) {
    size_t n = ep_ident(p, p->i);
    if (!n) return 0;
    size_t j = p->i + n;
    while (p->s[j] == ' ' || p->s[j] == '\t') j++;
    return !strncmp(p->s + j, "::=", 3);
}

static int ep_rule_id(ebnf_p *p, const char *name, size_t n) {
    for (int k = 0; k < p->n; k++)
        if (strlen(p->names[k]) == n && !memcmp(p->names[k], name, n)) return k;
    if (p->n == p->cap) {
        p->cap = p->cap ? p->cap * 2 : 16;
        p->names = realloc(p->names, (size_t)p->cap * sizeof(char *));
        p->rules = realloc(p->rules, (size_t)p->cap * sizeof(int));
        p->defined = realloc(p->defined, (size_t)p->cap * sizeof(int));
        LUNAR_ASSERT(p->names && p->rules && p->defined);
    }
    p->names[p->n] = strndup(name, n);
    p->rules[p->n] = gb_rule(p->b);
    p->defined[p->n] = 0;
    return p->n++;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* One (possibly escaped) character of a literal or class: its code point (bytes: < 256 with raw). */
static long ep_char(ebnf_p *p, int *raw_byte) {
    *raw_byte = 0;
    unsigned char c = (unsigned char)p->s[p->i];
    if (!c) return ep_fail(p, "unexpected end");
    if (c != '\\') {
        p->i++;
        *raw_byte = 1;
        return c;
    }
    char e = p->s[p->i + 1];
    p->i += 2;
    switch (e) {
    case 'n': return '\n';
    case 'r': return '\r';
    case 't': return '\t';
    case 'x': case 'u': {
        int nd = e == 'x' ? 2 : 4;
        long v = 0;
        for (int k = 0; k < nd; k++) {
            int h = hexval(p->s[p->i]);
            if (h < 0) return ep_fail(p, "bad hex escape");
            v = v * 16 + h;
            p->i++;
        }
        if (e == 'x') *raw_byte = 1;
        return v;
    }
    case 0: return ep_fail(p, "unexpected end");
    default: *raw_byte = 1; return (unsigned char)e;
    }
}

static int ep_alts(ebnf_p *p, int rule);

static int ep_atom(ebnf_p *p, g_seq *s) {
    char c = p->s[p->i];
    if (c == '"') {
        p->i++;
        while (p->s[p->i] != '"') {
            int raw;
            long cp = ep_char(p, &raw);
            if (cp < 0) return -1;
            char u[4];
            int n = 0;
            if (raw || cp < 0x80) u[n++] = (char)cp;
            else if (cp < 0x800) u[n++] = (char)(0xC0 | cp >> 6), u[n++] = (char)(0x80 | (cp & 63));
            else u[n++] = (char)(0xE0 | cp >> 12), u[n++] = (char)(0x80 | (cp >> 6 & 63)), u[n++] = (char)(0x80 | (cp & 63));
            seq_lit(p->b, s, u, (size_t)n);
        }
        p->i++;
        return 0;
    }
    if (c == '[') {
        uint8_t cls[32] = {0};
        int neg = 0;
        p->i++;
        if (p->s[p->i] == '^') neg = 1, p->i++;
        while (p->s[p->i] != ']') {
            int raw;
            long a = ep_char(p, &raw), z = a;
            if (a < 0) return -1;
            if (p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
                p->i++;
                z = ep_char(p, &raw);
                if (z < 0) return -1;
            }
            if (a > 255 || z > 255 || z < a) return ep_fail(p, "class ranges are bytes (0-255) in order");
            for (long k = a; k <= z; k++) cls[k >> 3] |= (uint8_t)(1u << (k & 7));
        }
        p->i++;
        if (neg)
            for (int k = 0; k < 32; k++) cls[k] = (uint8_t)~cls[k];
        seq_bytes(p->b, s, cls);
        return 0;
    }
    if (c == '.') {
        uint8_t cls[32];
        memset(cls, 0xFF, 32);
        p->i++;
        seq_bytes(p->b, s, cls);
        return 0;
    }
    if (c == '(') {
        p->i++;
        int r = gb_rule(p->b);
        if (ep_alts(p, r)) return -1;
        ep_ws(p);
        if (p->s[p->i] != ')') return ep_fail(p, "expected ')'");
        p->i++;
        seq_rule(s, r);
        return 0;
    }
    if (c == '<') {
        p->i++;
        long id = 0;
        int nd = 0;
        while (p->s[p->i] >= '0' && p->s[p->i] <= '9' && nd < 10) id = id * 10 + (p->s[p->i++] - '0'), nd++;
        if (!nd || p->s[p->i] != '>') return ep_fail(p, "expected <token id>");
        p->i++;
        int32_t tid = (int32_t)id;
        seq_push(s, (g_elem){.kind = G_TOKENS, .a = gb_tokens(p->b, &tid, 1), .b = 1});
        return 0;
    }
    size_t n = ep_ident(p, p->i);
    if (n) {
        int k = ep_rule_id(p, p->s + p->i, n);
        p->i += n;
        seq_rule(s, p->rules[k]);
        return 0;
    }
    return ep_fail(p, "expected a literal, class, rule name, group or <token id>");
}

static int ep_num(ebnf_p *p, int64_t *v) {
    int nd = 0;
    *v = 0;
    while (p->s[p->i] >= '0' && p->s[p->i] <= '9' && nd < 12) *v = *v * 10 + (p->s[p->i++] - '0'), nd++;
    return nd ? 0 : ep_fail(p, "expected a number");
}

static int ep_seq(ebnf_p *p, g_seq *s) {
    for (;;) {
        ep_ws(p);
        char c = p->s[p->i];
        if (!c || c == '|' || c == ')' || ep_rule_start(p)) return 0;
        g_seq a = {0};
        if (ep_atom(p, &a)) {
            seq_free(&a);
            return -1;
        }
        c = p->s[p->i];
        int64_t lo = -2, hi = -1;
        if (c == '*') lo = 0, hi = -1, p->i++;
        else if (c == '+') lo = 1, hi = -1, p->i++;
        else if (c == '?') lo = 0, hi = 1, p->i++;
        else if (c == '{') {
            p->i++;
            if (ep_num(p, &lo)) return seq_free(&a), -1;
            hi = lo;
            if (p->s[p->i] == ',') {
                p->i++;
                hi = -1;
                if (p->s[p->i] != '}' && ep_num(p, &hi)) return seq_free(&a), -1;
            }
            if (p->s[p->i] != '}' || (hi >= 0 && hi < lo)) return seq_free(&a), ep_fail(p, "bad {m,n}");
            p->i++;
        }
        if (lo == -2) {
            for (int k = 0; k < a.n; k++) seq_push(s, a.e[k]);
        } else {
            int r = gb_rule(p->b);
            gb_add_alt(p->b, r, &a);
            seq_repeat(s, r, lo, hi);
        }
        seq_free(&a);
    }
}

static int ep_alts(ebnf_p *p, int rule) {
    for (;;) {
        g_seq s = {0};
        if (ep_seq(p, &s)) return seq_free(&s), -1;
        gb_add_alt(p->b, rule, &s);
        seq_free(&s);
        ep_ws(p);
        if (p->s[p->i] != '|') return 0;
        p->i++;
    }
}

int lunar_grammar_from_ebnf(lunar_grammar **out, const lunar_vocab *v, const char *ebnf, const int32_t *end_ids,
                            int n_end, lunar_err *err) {
    return lunar_grammar_from_ebnf_with_schemas(out, v, ebnf, NULL, NULL, 0, end_ids, n_end, err);
}

int lunar_grammar_from_ebnf_with_schemas(lunar_grammar **out, const lunar_vocab *v, const char *ebnf,
                                         const char *const *names, const json_t *const *schemas, int n_schemas,
                                         const int32_t *end_ids, int n_end, lunar_err *err) {
    return lunar_grammar_from_ebnf_with_forms(out, v, ebnf, names, schemas, NULL, n_schemas, end_ids, n_end, err);
}

int lunar_grammar_from_ebnf_with_forms(lunar_grammar **out, const lunar_vocab *v, const char *ebnf,
                                       const char *const *names, const json_t *const *schemas, const int *forms,
                                       int n_schemas, const int32_t *end_ids, int n_end, lunar_err *err) {
    *out = NULL;
    g_builder b = {0};
    ebnf_p p = {.s = ebnf, .b = &b, .err = err};
    int rc = 0;
    /* the schema rules: defined up front under their names (a later "NAME ::=" is a redefinition) */
    for (int k = 0; k < n_schemas; k++) {
        size_t n = strlen(names[k]);
        for (size_t j = 0; j < n; j++)
            if (!is_id(names[k][j])) n = 0;
        if (!n || !is_id0(names[k][0])) {
            rc = lunar_fail(err, "grammar: bad schema rule name \"%s\"", names[k]);
            break;
        }
        int kk = ep_rule_id(&p, names[k], n);
        if (p.defined[kk]) {
            rc = lunar_fail(err, "grammar: schema rule \"%s\" given twice", names[k]);
            break;
        }
        int root;
        lunar_err e2 = {{0}};
        int k3 = forms && forms[k] == LUNAR_SCHEMA_K3_ARGS;
        if (k3 ? js_compile_k3_args(&b, schemas[k], &root, &e2) : js_compile(&b, schemas[k], &root, &e2)) {
            rc = lunar_fail(err, "%s: %s", names[k], e2.msg);
            break;
        }
        /* the name's rule is an alias of the compiled root */
        g_seq s = {0};
        seq_rule(&s, root);
        gb_add_alt(&b, p.rules[kk], &s);
        seq_free(&s);
        p.defined[kk] = 1;
    }
    for (; !rc;) {
        ep_ws(&p);
        if (!p.s[p.i]) break;
        size_t n = ep_ident(&p, p.i);
        if (!n || !ep_rule_start(&p)) {
            rc = ep_fail(&p, "expected 'name ::='");
            break;
        }
        int k = ep_rule_id(&p, p.s + p.i, n);
        if (p.defined[k]) {
            rc = ep_fail(&p, "rule defined twice");
            break;
        }
        p.defined[k] = 1;
        p.i = strstr(p.s + p.i, "::=") - p.s + 3;
        if (ep_alts(&p, p.rules[k])) {
            rc = -1;
            break;
        }
    }
    int root = -1;
    for (int k = 0; k < p.n && !rc; k++) {
        if (!p.defined[k]) rc = lunar_fail(err, "grammar: rule '%s' is used but not defined", p.names[k]);
        if (!strcmp(p.names[k], "root")) root = p.rules[k];
    }
    if (!rc && root < 0) rc = lunar_fail(err, "grammar: no rule 'root'");
    for (int k = 0; k < p.n; k++) free(p.names[k]);
    free(p.names), free(p.rules), free(p.defined);
    if (rc) {
        gb_free(&b);
        return -1;
    }
    return g_finish(out, &b, v, root, end_ids, n_end, err);
}
