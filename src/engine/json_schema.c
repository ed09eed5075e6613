/* JSON Schema (Draft 2020-12 subset) -> grammar emitting compact JSON (no whitespace anywhere).
 *
 * Supported: type (string or list), enum, const, anyOf, allOf with one subschema, $ref to "#" or a
 * JSON pointer inside the document ("#/$defs/X", "#/$defs/a/properties/b"; recursion is fine),
 * properties / required / additionalProperties (bool or schema), items (schema or bool), minItems,
 * maxItems, uniqueItems: false, minLength / maxLength (code points), pattern (see below),
 * minimum / maximum / exclusiveMinimum / exclusiveMaximum.
 * Ignored (annotations): $schema $id $comment $defs definitions $anchor title description
 * examples default format (an annotation in 2020-12) readOnly writeOnly deprecated
 * contentEncoding contentMediaType. Anything else is an error naming the keyword and its path.
 *
 * Output form (a subset of what the schema allows, never more):
 *   - objects list the declared properties in schema order (required ones always, optional ones
 *     maybe), then additional properties if allowed (their keys never equal a declared name);
 *   - numbers are plain decimals: at most 18 integer digits and 15 fraction digits, no exponent;
 *   - strings are valid UTF-8; escapes \" \\ \/ \b \f \n \r \t and \uXXXX except surrogates and
 *     \u0000;
 *   - enum / const values are emitted in jansson's compact form (shortest round-trip reals).
 * pattern: Python-re/ECMA common subset: ^ $ (only at the ends; missing ones mean "anywhere"),
 * literals, escapes, . [classes] [^negated] \d \w \s \D \W \S (ASCII meanings: stricter than
 * Python's Unicode ones), groups (...) (?:...), alternation, * + ? {n} {n,} {n,m} (lazy ? ignored).
 * Classes hold ASCII only. With minLength/maxLength, the pattern must be one quantified
 * character atom (e.g. ^[a-z]+$), whose bounds are intersected with the lengths. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "engine/grammar_internal.h"
#include "text/chat_k3.h"

typedef struct {
    g_builder *b;
    const json_t *root;
    const json_t **memo_s;
    int *memo_r;
    int n_memo, cap_memo;
    int any_value, any_object, any_str_lex, utf8_rule;
    int64_t hint_min; /* the largest minLength / minItems so far (named if the grammar is refused) */
    lunar_err *err;
} jsc;

static void note_min(jsc *c, const char *kw, int64_t v, const char *path) {
    if (v <= c->hint_min) return;
    c->hint_min = v;
    snprintf(c->b->hint, sizeof c->b->hint, "the largest minimum is %s %lld at %s", kw, (long long)v, path);
}

static int js_schema(jsc *c, const json_t *s, const char *path);

static const char *IGNORED[] = {"$schema", "$id", "$comment", "$defs", "definitions", "$anchor", "title",
                                "description", "examples", "default", "format", "readOnly", "writeOnly",
                                "deprecated", "contentEncoding", "contentMediaType", NULL};
static const char *SUPPORTED[] = {"type", "enum", "const", "anyOf", "allOf", "$ref", "properties", "required",
                                  "additionalProperties", "items", "minItems", "maxItems", "uniqueItems",
                                  "minLength", "maxLength", "pattern", "minimum", "maximum",
                                  "exclusiveMinimum", "exclusiveMaximum", NULL};

static int in_list(const char *k, const char **list) {
    for (int i = 0; list[i]; i++)
        if (!strcmp(k, list[i])) return 1;
    return 0;
}

static void subpath(char *out, size_t n, const char *path, const char *a, const char *b) {
    snprintf(out, n, "%s/%s%s%s", path, a, b ? "/" : "", b ? b : "");
}

/* ---- shared rules ---------------------------------------------------------------------- */

static int str_lex(jsc *c, int64_t min, int64_t max, int excl) {
    g_lex lx = {.kind = LEX_STR, .min_len = min, .max_len = max, .excl = excl};
    return gb_lex(c->b, &lx);
}

static int rule_of_seq(jsc *c, g_seq *s) {
    int r = gb_rule(c->b);
    gb_add_alt(c->b, r, s);
    seq_free(s);
    return r;
}

static int lit_rule_alt(jsc *c, int r, const char *lit) {
    g_seq s = {0};
    seq_lit(c->b, &s, lit, strlen(lit));
    gb_add_alt(c->b, r, &s);
    seq_free(&s);
    return 0;
}

static int any_value(jsc *c);

/* "{" (key ":" value ("," key ":" value)*)? "}" with key a string lexeme and value rule v. */
static int object_of(jsc *c, int key_lex, int v) {
    g_seq s = {0};
    seq_lexeme(&s, key_lex);
    seq_byte(c->b, &s, ':');
    seq_rule(&s, v);
    int kv = rule_of_seq(c, &s);
    seq_byte(c->b, &s, ',');
    seq_rule(&s, kv);
    int kvsep = rule_of_seq(c, &s);
    int r = gb_rule(c->b);
    lit_rule_alt(c, r, "{}");
    seq_byte(c->b, &s, '{');
    seq_rule(&s, kv);
    seq_repeat(&s, kvsep, 0, -1);
    seq_byte(c->b, &s, '}');
    gb_add_alt(c->b, r, &s);
    seq_free(&s);
    return r;
}

static int any_value(jsc *c) {
    if (c->any_value >= 0) return c->any_value;
    int r = c->any_value = gb_rule(c->b);
    if (c->any_str_lex < 0) c->any_str_lex = str_lex(c, 0, -1, -1);
    g_seq s = {0};
    /* object */
    seq_rule(&s, object_of(c, c->any_str_lex, r));
    gb_add_alt(c->b, r, &s);
    seq_free(&s);
    /* array */
    seq_byte(c->b, &s, ',');
    seq_rule(&s, r);
    int vsep = rule_of_seq(c, &s);
    lit_rule_alt(c, r, "[]");
    seq_byte(c->b, &s, '[');
    seq_rule(&s, r);
    seq_repeat(&s, vsep, 0, -1);
    seq_byte(c->b, &s, ']');
    gb_add_alt(c->b, r, &s);
    seq_free(&s);
    seq_lexeme(&s, c->any_str_lex);
    gb_add_alt(c->b, r, &s);
    seq_free(&s);
    g_lex num = {.kind = LEX_NUM};
    seq_lexeme(&s, gb_lex(c->b, &num));
    gb_add_alt(c->b, r, &s);
    seq_free(&s);
    lit_rule_alt(c, r, "true");
    lit_rule_alt(c, r, "false");
    lit_rule_alt(c, r, "null");
    return r;
}

static int any_object(jsc *c) {
    if (c->any_object >= 0) return c->any_object;
    if (c->any_str_lex < 0) c->any_str_lex = str_lex(c, 0, -1, -1);
    return c->any_object = object_of(c, c->any_str_lex, any_value(c));
}

/* ---- literals (enum / const) ----------------------------------------------------------- */

typedef struct {
    char *s;
    size_t n, cap;
} sbuf_t;
static void sb_add(sbuf_t *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->s = realloc(b->s, b->cap);
        LUNAR_ASSERT(b->s);
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

static void fmt_real(double d, char *out, size_t n) {
    for (int p = 1; p <= 17; p++) {
        snprintf(out, n, "%.*g", p, d);
        if (strtod(out, NULL) == d) break;
    }
    if (!strpbrk(out, ".eEn")) { /* keep it a real-looking literal: "3" -> "3.0" */
        size_t l = strlen(out);
        if (l + 3 < n) memcpy(out + l, ".0", 3);
    }
}

static void dump_compact(sbuf_t *b, const json_t *v) {
    char tmp[64];
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        const char *k;
        json_t *x;
        int first = 1;
        sb_add(b, "{", 1);
        json_object_foreach((json_t *)v, k, x) {
            if (!first) sb_add(b, ",", 1);
            first = 0;
            json_t *ks = json_string(k);
            char *d = json_dumps(ks, JSON_ENCODE_ANY | JSON_COMPACT);
            sb_add(b, d, strlen(d));
            free(d);
            json_decref(ks);
            sb_add(b, ":", 1);
            dump_compact(b, x);
        }
        sb_add(b, "}", 1);
        return;
    }
    case JSON_ARRAY:
        sb_add(b, "[", 1);
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i) sb_add(b, ",", 1);
            dump_compact(b, json_array_get(v, i));
        }
        sb_add(b, "]", 1);
        return;
    case JSON_REAL:
        fmt_real(json_real_value(v), tmp, sizeof tmp);
        sb_add(b, tmp, strlen(tmp));
        return;
    default: {
        char *d = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
        sb_add(b, d, strlen(d));
        free(d);
    }
    }
}

static size_t utf8_len(const char *s) {
    size_t n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static int is_type(const json_t *v, const char *t) {
    if (!strcmp(t, "null")) return json_is_null(v);
    if (!strcmp(t, "boolean")) return json_is_boolean(v);
    if (!strcmp(t, "string")) return json_is_string(v);
    if (!strcmp(t, "array")) return json_is_array(v);
    if (!strcmp(t, "object")) return json_is_object(v);
    if (!strcmp(t, "number")) return json_is_number(v);
    if (!strcmp(t, "integer"))
        return json_is_integer(v) || (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
                                      isfinite(json_real_value(v)));
    return 0;
}

/* Whether an enum / const value also satisfies the sibling keywords (type, ranges, lengths,
 * pattern). -1 on error. */
static int value_ok(jsc *c, const json_t *s, const json_t *v, const char *path) {
    json_t *t = json_object_get(s, "type");
    if (t) {
        int ok = 0;
        if (json_is_string(t)) ok = is_type(v, json_string_value(t));
        for (size_t i = 0; json_is_array(t) && i < json_array_size(t); i++)
            ok |= json_is_string(json_array_get(t, i)) && is_type(v, json_string_value(json_array_get(t, i)));
        if (!ok) return 0;
    }
    if (json_is_number(v)) {
        double x = json_number_value(v);
        json_t *k;
        if ((k = json_object_get(s, "minimum")) && x < json_number_value(k)) return 0;
        if ((k = json_object_get(s, "maximum")) && x > json_number_value(k)) return 0;
        if ((k = json_object_get(s, "exclusiveMinimum")) && x <= json_number_value(k)) return 0;
        if ((k = json_object_get(s, "exclusiveMaximum")) && x >= json_number_value(k)) return 0;
    }
    if (json_is_string(v)) {
        size_t n = utf8_len(json_string_value(v));
        json_t *k;
        if ((k = json_object_get(s, "minLength")) && (json_int_t)n < json_integer_value(k)) return 0;
        if ((k = json_object_get(s, "maxLength")) && (json_int_t)n > json_integer_value(k)) return 0;
        if ((k = json_object_get(s, "pattern")) && json_is_string(k)) {
            int e;
            PCRE2_SIZE eo;
            pcre2_code *re = pcre2_compile((PCRE2_SPTR)json_string_value(k), PCRE2_ZERO_TERMINATED, PCRE2_UTF, &e,
                                           &eo, NULL);
            if (!re) return lunar_fail(c->err, "schema: bad pattern at %s/pattern", path);
            pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
            int rc = pcre2_match(re, (PCRE2_SPTR)json_string_value(v), json_string_length(v), 0, 0, md, NULL);
            pcre2_match_data_free(md);
            pcre2_code_free(re);
            if (rc < 0) return 0;
        }
    }
    return 1;
}

static int js_literals(jsc *c, int r, const json_t *s, const char *path) {
    static const char *OBJ_KW[] = {"properties", "required", "additionalProperties", "items", "minItems",
                                   "maxItems", "anyOf", "allOf", "$ref", NULL};
    for (int i = 0; OBJ_KW[i]; i++)
        if (json_object_get(s, OBJ_KW[i]))
            return lunar_fail(c->err, "schema: enum/const together with '%s' is not supported at %s", OBJ_KW[i], path);
    json_t *e = json_object_get(s, "enum"), *k = json_object_get(s, "const");
    if (e && !json_is_array(e)) return lunar_fail(c->err, "schema: enum must be an array at %s/enum", path);
    json_t *vals = json_array();
    if (e) json_array_extend(vals, e);
    if (k) {
        if (e) { /* both: the const, if it is among the enum values */
            int found = 0;
            for (size_t i = 0; i < json_array_size(e); i++) found |= json_equal(json_array_get(e, i), k);
            json_array_clear(vals);
            if (found) json_array_append(vals, k);
        } else {
            json_array_append(vals, k);
        }
    }
    int n = 0;
    for (size_t i = 0; i < json_array_size(vals); i++) {
        json_t *v = json_array_get(vals, i);
        int ok = value_ok(c, s, v, path);
        if (ok < 0) return json_decref(vals), -1;
        if (!ok) continue;
        sbuf_t b = {0};
        dump_compact(&b, v);
        lit_rule_alt(c, r, b.s);
        free(b.s);
        n++;
    }
    json_decref(vals);
    if (!n) return lunar_fail(c->err, "schema: no enum/const value satisfies the schema at %s", path);
    return 0;
}

/* ---- numbers --------------------------------------------------------------------------- */

/* x * NUM_SCALE rounded down (up = 0) or up (up = 1), clamped far outside the number range. */
static __int128 to_units(const json_t *v, int up) {
    const __int128 big = (__int128)1000000000000000000LL * NUM_SCALE * 100;
    if (json_is_integer(v)) return (__int128)json_integer_value(v) * NUM_SCALE;
    double d = json_real_value(v);
    if (d >= 1e20) return big;
    if (d <= -1e20) return -big;
    char s[64];
    fmt_real(d, s, sizeof s);
    /* parse sign, digits, fraction, exponent exactly */
    const char *p = s;
    int neg = 0;
    if (*p == '-') neg = 1, p++;
    __int128 m = 0;
    int exp10 = 0;
    for (; *p >= '0' && *p <= '9'; p++) m = m * 10 + (*p - '0');
    if (*p == '.')
        for (p++; *p >= '0' && *p <= '9'; p++) m = m * 10 + (*p - '0'), exp10--;
    if (*p == 'e' || *p == 'E') exp10 += atoi(p + 1);
    int sh = exp10 + 15; /* units = m * 10^sh */
    int round_up = neg ? !up : up; /* rounding the magnitude */
    if (sh >= 0) {
        while (sh-- > 0 && m < big) m *= 10;
        if (m > big) m = big;
    } else {
        __int128 div = 1;
        int exact = 1;
        while (sh++ < 0) div *= 10;
        if (m % div) exact = 0;
        m /= div;
        if (!exact && round_up) m++;
    }
    return neg ? -m : m;
}

static int js_number(jsc *c, int r, const json_t *s, int integer, const char *path) {
    g_lex lx = {.kind = LEX_NUM, .integer = integer};
    json_t *k;
    static const char *NK[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", NULL};
    for (int i = 0; NK[i]; i++) {
        if (!(k = json_object_get(s, NK[i]))) continue;
        if (!json_is_number(k)) return lunar_fail(c->err, "schema: %s must be a number at %s/%s", NK[i], path, NK[i]);
        __int128 u;
        if (i == 0 || i == 2) {
            u = to_units(k, 1);
            if (i == 2 && to_units(k, 0) == u) u += 1; /* exact bound: strictly above */
            if (!lx.has_lo || u > lx.lo) lx.lo = u, lx.has_lo = 1;
        } else {
            u = to_units(k, 0);
            if (i == 3 && to_units(k, 1) == u) u -= 1;
            if (!lx.has_hi || u < lx.hi) lx.hi = u, lx.has_hi = 1;
        }
    }
    if (!g_lex_satisfiable(&lx))
        return lunar_fail(c->err, "schema: no %s satisfies the bounds at %s", integer ? "integer" : "number", path);
    g_seq q = {0};
    seq_lexeme(&q, gb_lex(c->b, &lx));
    gb_add_alt(c->b, r, &q);
    seq_free(&q);
    return 0;
}

/* ---- pattern --------------------------------------------------------------------------- */

typedef struct {
    uint8_t ascii[16]; /* 128 bits */
    int nonascii;
} cset;

static void cs_add(cset *s, int a, int z) {
    for (int k = a; k <= z && k < 128; k++) s->ascii[k >> 3] |= (uint8_t)(1u << (k & 7));
}

static int utf8_rule(jsc *c) {
    if (c->utf8_rule >= 0) return c->utf8_rule;
    int r = c->utf8_rule = gb_rule(c->b);
    static const uint8_t T[][4][2] = {
        {{0xC2, 0xDF}, {0x80, 0xBF}, {0, 0}, {0, 0}},         {{0xE0, 0xE0}, {0xA0, 0xBF}, {0x80, 0xBF}, {0, 0}},
        {{0xE1, 0xEC}, {0x80, 0xBF}, {0x80, 0xBF}, {0, 0}},   {{0xEE, 0xEF}, {0x80, 0xBF}, {0x80, 0xBF}, {0, 0}},
        {{0xED, 0xED}, {0x80, 0x9F}, {0x80, 0xBF}, {0, 0}},   {{0xF0, 0xF0}, {0x90, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}},
        {{0xF1, 0xF3}, {0x80, 0xBF}, {0x80, 0xBF}, {0x80, 0xBF}}, {{0xF4, 0xF4}, {0x80, 0x8F}, {0x80, 0xBF}, {0x80, 0xBF}},
    };
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++) {
        g_seq s = {0};
        for (int j = 0; j < 4 && T[i][j][0]; j++) {
            uint8_t cls[32] = {0};
            for (int k = T[i][j][0]; k <= T[i][j][1]; k++) cls[k >> 3] |= (uint8_t)(1u << (k & 7));
            seq_bytes(c->b, &s, cls);
        }
        gb_add_alt(c->b, r, &s);
        seq_free(&s);
    }
    return r;
}

/* A rule matching one character of the set in its JSON-encoded form. */
static int cset_rule(jsc *c, const cset *cs) {
    int r = gb_rule(c->b);
    uint8_t cls[32] = {0};
    int any = 0;
    for (int k = 0x20; k < 0x80; k++)
        if ((cs->ascii[k >> 3] >> (k & 7) & 1) && k != '"' && k != '\\') cls[k >> 3] |= (uint8_t)(1u << (k & 7)), any = 1;
    if (any) {
        g_seq s = {0};
        seq_bytes(c->b, &s, cls);
        gb_add_alt(c->b, r, &s);
        seq_free(&s);
    }
    if (cs->ascii['"' >> 3] >> ('"' & 7) & 1) lit_rule_alt(c, r, "\\\"");
    if (cs->ascii['\\' >> 3] >> ('\\' & 7) & 1) lit_rule_alt(c, r, "\\\\");
    for (int k = 1; k < 0x20; k++) {
        if (!(cs->ascii[k >> 3] >> (k & 7) & 1)) continue;
        char e[8];
        const char *sh = k == '\n' ? "\\n" : k == '\t' ? "\\t" : k == '\r' ? "\\r" : k == 8 ? "\\b" : k == 12 ? "\\f" : NULL;
        if (sh) snprintf(e, sizeof e, "%s", sh);
        else snprintf(e, sizeof e, "\\u%04x", k);
        lit_rule_alt(c, r, e);
    }
    if (cs->nonascii) {
        g_seq s = {0};
        seq_rule(&s, utf8_rule(c));
        gb_add_alt(c->b, r, &s);
        seq_free(&s);
    }
    return r;
}

typedef struct {
    const char *s;
    size_t i;
    jsc *c;
    const char *path;
    int n_atoms;        /* at the top level */
    int last_is_char;   /* the last top-level atom is one character */
    int last_rule;      /* its character rule */
    int64_t last_lo, last_hi;
    int depth;
} rx;

static int rx_fail(rx *x, const char *what) {
    return lunar_fail(x->c->err, "schema: pattern: %s at offset %zu of %s/pattern", what, x->i, x->path);
}

static int rx_alts(rx *x, int rule);

static int rx_escape_set(char e, cset *cs) {
    memset(cs, 0, sizeof *cs);
    switch (e) {
    case 'd': cs_add(cs, '0', '9'); return 1;
    case 'w': cs_add(cs, '0', '9'), cs_add(cs, 'a', 'z'), cs_add(cs, 'A', 'Z'), cs_add(cs, '_', '_'); return 1;
    case 's': cs_add(cs, ' ', ' '), cs_add(cs, '\t', '\r'); return 1;
    case 'D': case 'W': case 'S': /* complements within ASCII (non-ASCII left out: stricter) */
        rx_escape_set((char)(e - 'A' + 'a'), cs);
        for (int k = 0; k < 16; k++) cs->ascii[k] = (uint8_t)~cs->ascii[k];
        cs->ascii[0] &= (uint8_t)~1u; /* no NUL */
        return 1;
    }
    return 0;
}

static int rx_escape_char(char e) {
    switch (e) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    }
    if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9')) return -1;
    return (unsigned char)e;
}

/* One atom; *char_rule >= 0 when it is a single character. */
static int rx_atom(rx *x, g_seq *s, int *char_rule) {
    *char_rule = -1;
    char ch = x->s[x->i];
    cset cs;
    memset(&cs, 0, sizeof cs);
    if (ch == '(') {
        x->i++;
        if (x->s[x->i] == '?') {
            if (x->s[x->i + 1] != ':') return rx_fail(x, "only (?:...) groups are supported");
            x->i += 2;
        }
        int r = gb_rule(x->c->b);
        x->depth++;
        if (rx_alts(x, r)) return -1;
        x->depth--;
        if (x->s[x->i] != ')') return rx_fail(x, "expected ')'");
        x->i++;
        seq_rule(s, r);
        return 0;
    }
    if (ch == '[') {
        int neg = 0;
        x->i++;
        if (x->s[x->i] == '^') neg = 1, x->i++;
        int first = 1;
        while (x->s[x->i] && (x->s[x->i] != ']' || first)) {
            first = 0;
            int a;
            if (x->s[x->i] == '\\') {
                char e = x->s[x->i + 1];
                cset sub;
                x->i += 2;
                if (rx_escape_set(e, &sub)) {
                    for (int k = 0; k < 16; k++) cs.ascii[k] |= sub.ascii[k];
                    continue;
                }
                a = rx_escape_char(e);
                if (a < 0) return rx_fail(x, "unsupported escape in class");
            } else {
                a = (unsigned char)x->s[x->i++];
            }
            if (a >= 128) return rx_fail(x, "non-ASCII characters in classes are not supported");
            int z = a;
            if (x->s[x->i] == '-' && x->s[x->i + 1] && x->s[x->i + 1] != ']') {
                x->i++;
                if (x->s[x->i] == '\\') {
                    z = rx_escape_char(x->s[x->i + 1]);
                    x->i += 2;
                } else {
                    z = (unsigned char)x->s[x->i++];
                }
                if (z < 0 || z >= 128 || z < a) return rx_fail(x, "bad class range");
            }
            cs_add(&cs, a, z);
        }
        if (x->s[x->i] != ']') return rx_fail(x, "unterminated class");
        x->i++;
        if (neg) {
            for (int k = 0; k < 16; k++) cs.ascii[k] = (uint8_t)~cs.ascii[k];
            cs.ascii[0] &= (uint8_t)~1u;
            cs.nonascii = 1;
        }
    } else if (ch == '.') {
        x->i++;
        cs_add(&cs, 1, 127);
        cs.ascii['\n' >> 3] &= (uint8_t)~(1u << ('\n' & 7));
        cs.nonascii = 1;
    } else if (ch == '\\') {
        char e = x->s[x->i + 1];
        if (!e) return rx_fail(x, "trailing backslash");
        x->i += 2;
        if (!rx_escape_set(e, &cs)) {
            int a = rx_escape_char(e);
            if (a < 0) return rx_fail(x, "unsupported escape");
            cs_add(&cs, a, a);
        }
    } else if (ch == '^' || ch == '$') {
        return rx_fail(x, "anchors are only supported at the start and end");
    } else if (ch == '*' || ch == '+' || ch == '?' || ch == '{') {
        return rx_fail(x, "quantifier without an atom");
    } else if ((unsigned char)ch >= 0x80) { /* a literal non-ASCII character: its UTF-8 bytes */
        size_t j = x->i + 1;
        while (((unsigned char)x->s[j] & 0xC0) == 0x80) j++;
        seq_lit(x->c->b, s, x->s + x->i, j - x->i);
        x->i = j;
        return 0;
    } else {
        x->i++;
        cs_add(&cs, (unsigned char)ch, (unsigned char)ch);
    }
    *char_rule = cset_rule(x->c, &cs);
    seq_rule(s, *char_rule);
    return 0;
}

static int rx_num(rx *x, int64_t *v) {
    int nd = 0;
    *v = 0;
    while (x->s[x->i] >= '0' && x->s[x->i] <= '9' && nd < 12) *v = *v * 10 + (x->s[x->i++] - '0'), nd++;
    return nd ? 0 : -1;
}

static int rx_seq(rx *x, g_seq *s) {
    for (;;) {
        char ch = x->s[x->i];
        if (!ch || ch == '|' || ch == ')') return 0;
        if (ch == '$' && x->depth == 0 && !x->s[x->i + 1]) return 0;
        g_seq a = {0};
        int cr;
        if (rx_atom(x, &a, &cr)) return seq_free(&a), -1;
        int64_t lo = -2, hi = -1;
        ch = x->s[x->i];
        if (ch == '*') lo = 0, hi = -1, x->i++;
        else if (ch == '+') lo = 1, hi = -1, x->i++;
        else if (ch == '?') lo = 0, hi = 1, x->i++;
        else if (ch == '{') {
            size_t save = x->i++;
            if (rx_num(x, &lo) == 0) {
                hi = lo;
                if (x->s[x->i] == ',') {
                    x->i++;
                    hi = -1;
                    if (x->s[x->i] != '}' && rx_num(x, &hi)) return seq_free(&a), rx_fail(x, "bad {m,n}");
                }
                if (x->s[x->i] != '}' || (hi >= 0 && hi < lo)) return seq_free(&a), rx_fail(x, "bad {m,n}");
                x->i++;
            } else {
                return seq_free(&a), (x->i = save), rx_fail(x, "bad {m,n}");
            }
        }
        if (lo != -2) {
            if (x->s[x->i] == '?') x->i++; /* lazy: same language */
            else if (x->s[x->i] == '+') return seq_free(&a), rx_fail(x, "possessive quantifiers are not supported");
        }
        if (x->depth == 0) {
            x->n_atoms++;
            x->last_is_char = cr >= 0;
            x->last_rule = cr;
            x->last_lo = lo == -2 ? 1 : lo;
            x->last_hi = lo == -2 ? 1 : hi;
        }
        if (lo == -2) {
            for (int k = 0; k < a.n; k++) seq_push(s, a.e[k]);
            seq_free(&a);
        } else {
            seq_repeat(s, rule_of_seq(x->c, &a), lo, hi);
        }
    }
}

static int rx_alts(rx *x, int rule) {
    int n = 0;
    for (;;) {
        g_seq s = {0};
        if (rx_seq(x, &s)) return seq_free(&s), -1;
        gb_add_alt(x->c->b, rule, &s);
        seq_free(&s);
        n++;
        if (x->s[x->i] != '|') break;
        if (x->depth == 0) x->n_atoms += 100; /* top-level alternation: not a single atom */
        x->i++;
    }
    return 0;
}

static int js_pattern(jsc *c, int r, const char *pat, int64_t minl, int64_t maxl, const char *path) {
    rx x = {.s = pat, .c = c, .path = path};
    int anch_start = 0, anch_end = 0;
    if (pat[0] == '^') anch_start = 1, x.i = 1;
    size_t L = strlen(pat);
    if (L > (size_t)anch_start && pat[L - 1] == '$' && (L < 2 || pat[L - 2] != '\\')) anch_end = 1;
    int body = gb_rule(c->b);
    if (rx_alts(&x, body)) return -1;
    if (anch_end && x.s[x.i] == '$') x.i++;
    if (x.s[x.i]) return rx_fail(&x, x.s[x.i] == ')' ? "unbalanced ')'" : "unexpected character");
    g_seq s = {0};
    seq_byte(c->b, &s, '"');
    if (minl > 0 || maxl >= 0) {
        if (!anch_start || !anch_end || x.n_atoms != 1 || !x.last_is_char) {
            seq_free(&s);
            return lunar_fail(c->err, "schema: pattern together with minLength/maxLength is only supported when the "
                                      "pattern is one quantified character (like ^[a-z]+$) at %s", path);
        }
        int64_t lo = x.last_lo > minl ? x.last_lo : minl;
        int64_t hi = x.last_hi;
        if (maxl >= 0 && (hi < 0 || maxl < hi)) hi = maxl;
        if (hi >= 0 && hi < lo) {
            seq_free(&s);
            return lunar_fail(c->err, "schema: pattern and lengths admit no string at %s", path);
        }
        seq_repeat(&s, x.last_rule, lo, hi);
    } else {
        cset all;
        memset(&all, 0, sizeof all);
        cs_add(&all, 1, 127);
        all.nonascii = 1;
        int any = -1;
        if (!anch_start || !anch_end) any = cset_rule(c, &all);
        if (!anch_start) seq_repeat(&s, any, 0, -1);
        seq_rule(&s, body);
        if (!anch_end) seq_repeat(&s, any, 0, -1);
    }
    seq_byte(c->b, &s, '"');
    gb_add_alt(c->b, r, &s);
    seq_free(&s);
    return 0;
}

/* ---- strings, arrays, objects ---------------------------------------------------------- */

static int get_count(jsc *c, const json_t *s, const char *kw, int64_t dflt, int64_t *out, const char *path) {
    json_t *k = json_object_get(s, kw);
    *out = dflt;
    if (!k) return 0;
    double d = json_number_value(k);
    if (!json_is_number(k) || d < 0 || d != floor(d) || d > 9e15)
        return lunar_fail(c->err, "schema: %s must be a non-negative integer at %s/%s", kw, path, kw);
    *out = (int64_t)d;
    return 0;
}

static int js_string(jsc *c, int r, const json_t *s, const char *path) {
    int64_t minl, maxl;
    if (get_count(c, s, "minLength", 0, &minl, path) || get_count(c, s, "maxLength", -1, &maxl, path)) return -1;
    if (maxl >= 0 && maxl < minl) return lunar_fail(c->err, "schema: maxLength < minLength at %s", path);
    note_min(c, "minLength", minl, path);
    json_t *p = json_object_get(s, "pattern");
    if (p) {
        if (!json_is_string(p)) return lunar_fail(c->err, "schema: pattern must be a string at %s/pattern", path);
        return js_pattern(c, r, json_string_value(p), minl, maxl, path);
    }
    g_seq q = {0};
    seq_lexeme(&q, str_lex(c, minl, maxl, -1));
    gb_add_alt(c->b, r, &q);
    seq_free(&q);
    return 0;
}

static int js_array(jsc *c, int r, const json_t *s, const char *path) {
    int64_t mn, mx;
    char sub[1024];
    if (get_count(c, s, "minItems", 0, &mn, path) || get_count(c, s, "maxItems", -1, &mx, path)) return -1;
    json_t *u = json_object_get(s, "uniqueItems");
    if (u && !json_is_false(u)) return lunar_fail(c->err, "schema: uniqueItems: true is not supported at %s", path);
    json_t *it = json_object_get(s, "items");
    if (it && json_is_false(it)) mx = 0;
    if (mx >= 0 && mx < mn) return lunar_fail(c->err, "schema: no array satisfies minItems/maxItems/items at %s", path);
    note_min(c, "minItems", mn, path);
    if (mx == 0) return lit_rule_alt(c, r, "[]");
    int item;
    if (!it || json_is_true(it)) {
        item = any_value(c);
    } else {
        subpath(sub, sizeof sub, path, "items", NULL);
        if ((item = js_schema(c, it, sub)) < 0) return -1;
    }
    g_seq q = {0};
    seq_byte(c->b, &q, ',');
    seq_rule(&q, item);
    int sep = rule_of_seq(c, &q);
    if (mn == 0) lit_rule_alt(c, r, "[]");
    seq_byte(c->b, &q, '[');
    seq_rule(&q, item);
    seq_repeat(&q, sep, mn > 0 ? mn - 1 : 0, mx < 0 ? -1 : mx - 1);
    seq_byte(c->b, &q, ']');
    gb_add_alt(c->b, r, &q);
    seq_free(&q);
    return 0;
}

static char *dump_key(const char *k) {
    json_t *ks = json_string(k);
    char *d = json_dumps(ks, JSON_ENCODE_ANY | JSON_COMPACT);
    json_decref(ks);
    return d;
}

static int js_object(jsc *c, int r, const json_t *s, const char *path) {
    char sub[1024];
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) return lunar_fail(c->err, "schema: properties must be an object at %s", path);
    if (req && !json_is_array(req)) return lunar_fail(c->err, "schema: required must be an array at %s", path);
    for (size_t i = 0; req && i < json_array_size(req); i++)
        if (!json_is_string(json_array_get(req, i)))
            return lunar_fail(c->err, "schema: required must list strings at %s/required", path);
    int add_ok = !addl || !json_is_false(addl);
    int add_rule = -1;
    if (add_ok) {
        if (!addl || json_is_true(addl)) {
            add_rule = any_value(c);
        } else {
            subpath(sub, sizeof sub, path, "additionalProperties", NULL);
            if ((add_rule = js_schema(c, addl, sub)) < 0) return -1;
        }
    }
    /* declared names: properties in order, then required names not among them */
    int n = (int)(props ? json_object_size(props) : 0) + (int)(req ? json_array_size(req) : 0), k = 0;
    const char **names = lunar_xcalloc((size_t)n + 1, sizeof *names);
    int *vals = lunar_xcalloc((size_t)n + 1, sizeof *vals), *isreq = lunar_xcalloc((size_t)n + 1, sizeof *isreq);
    int rc = 0;
    const char *key;
    json_t *x;
    if (props) {
        json_object_foreach(props, key, x) {
            subpath(sub, sizeof sub, path, "properties", key);
            names[k] = key;
            if ((vals[k] = js_schema(c, x, sub)) < 0) {
                rc = -1;
                goto out;
            }
            k++;
        }
    }
    for (size_t i = 0; req && i < json_array_size(req); i++) {
        const char *nm = json_string_value(json_array_get(req, i));
        int found = -1;
        for (int j = 0; j < k; j++)
            if (!strcmp(names[j], nm)) found = j;
        if (found >= 0) {
            isreq[found] = 1;
            continue;
        }
        if (!add_ok) {
            rc = lunar_fail(c->err, "schema: required '%s' is not allowed by additionalProperties: false at %s", nm, path);
            goto out;
        }
        names[k] = nm;
        vals[k] = add_rule;
        isreq[k++] = 1;
    }
    n = k;
    {
        int add_kv = -1, add_sep = -1;
        g_seq q = {0};
        if (add_ok) {
            char **raw = lunar_xcalloc((size_t)n + 1, sizeof *raw);
            size_t *lens = lunar_xcalloc((size_t)n + 1, sizeof *lens);
            for (int i = 0; i < n; i++) {
                raw[i] = dump_key(names[i]);
                lens[i] = strlen(raw[i]) - 2;
                memmove(raw[i], raw[i] + 1, lens[i]);
            }
            int excl = n ? gb_xtrie(c->b, (const char *const *)raw, lens, n) : -1;
            for (int i = 0; i < n; i++) free(raw[i]);
            free(raw), free(lens);
            seq_lexeme(&q, str_lex(c, 0, -1, excl));
            seq_byte(c->b, &q, ':');
            seq_rule(&q, add_rule);
            add_kv = rule_of_seq(c, &q);
            seq_byte(c->b, &q, ',');
            seq_rule(&q, add_kv);
            add_sep = rule_of_seq(c, &q);
        }
        /* F[i]: nothing emitted yet; N[i]: something emitted (commas go before) */
        int *F = lunar_xmalloc(((size_t)n + 1) * sizeof(int)), *N = lunar_xmalloc(((size_t)n + 1) * sizeof(int));
        for (int i = 0; i <= n; i++) F[i] = gb_rule(c->b), N[i] = gb_rule(c->b);
        if (add_ok) {
            seq_rule(&q, add_kv);
            seq_repeat(&q, add_sep, 0, -1);
            gb_add_alt(c->b, F[n], &q);
            seq_free(&q);
            seq_repeat(&q, add_sep, 0, -1);
            gb_add_alt(c->b, N[n], &q);
            seq_free(&q);
        } else {
            gb_add_alt(c->b, N[n], &q);
        }
        gb_add_alt(c->b, F[n], &q);
        for (int i = 0; i < n; i++) {
            char *kd = dump_key(names[i]);
            for (int first = 0; first < 2; first++) {
                if (!first) seq_byte(c->b, &q, ',');
                seq_lit(c->b, &q, kd, strlen(kd));
                seq_byte(c->b, &q, ':');
                seq_rule(&q, vals[i]);
                seq_rule(&q, N[i + 1]);
                gb_add_alt(c->b, first ? F[i] : N[i], &q);
                seq_free(&q);
                if (!isreq[i]) {
                    seq_rule(&q, first ? F[i + 1] : N[i + 1]);
                    gb_add_alt(c->b, first ? F[i] : N[i], &q);
                    seq_free(&q);
                }
            }
            free(kd);
        }
        seq_byte(c->b, &q, '{');
        seq_rule(&q, F[0]);
        seq_byte(c->b, &q, '}');
        gb_add_alt(c->b, r, &q);
        seq_free(&q);
        free(F), free(N);
    }
out:
    free(names), free(vals), free(isreq);
    return rc;
}

/* ---- schemas --------------------------------------------------------------------------- */

static int hexv(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

static const json_t *resolve_ref(jsc *c, const char *ref, const char *path) {
    if (ref[0] != '#') {
        lunar_fail(c->err, "schema: only local $ref (\"#...\") is supported, got \"%s\" at %s/$ref", ref, path);
        return NULL;
    }
    const json_t *cur = c->root;
    const char *p = ref + 1;
    if (*p && *p != '/') {
        lunar_fail(c->err, "schema: $ref to an anchor (\"%s\") is not supported at %s/$ref", ref, path);
        return NULL;
    }
    while (*p == '/') {
        p++;
        char tok[512];
        size_t n = 0;
        while (*p && *p != '/' && n + 1 < sizeof tok) {
            if (p[0] == '~' && p[1] == '1') tok[n++] = '/', p += 2;
            else if (p[0] == '~' && p[1] == '0') tok[n++] = '~', p += 2;
            else if (p[0] == '%' && hexv(p[1]) >= 0 && hexv(p[2]) >= 0) tok[n++] = (char)(hexv(p[1]) * 16 + hexv(p[2])), p += 3;
            else tok[n++] = *p++;
        }
        tok[n] = 0;
        if (json_is_object(cur)) cur = json_object_get(cur, tok);
        else if (json_is_array(cur)) cur = json_array_get(cur, (size_t)strtoul(tok, NULL, 10));
        else cur = NULL;
        if (!cur) {
            lunar_fail(c->err, "schema: $ref \"%s\" does not resolve at %s/$ref", ref, path);
            return NULL;
        }
    }
    return cur;
}

static int js_schema(jsc *c, const json_t *s, const char *path) {
    for (int i = 0; i < c->n_memo; i++)
        if (c->memo_s[i] == s) return c->memo_r[i];
    if (json_is_true(s)) return any_value(c);
    int r = gb_rule(c->b);
    if (c->n_memo == c->cap_memo) {
        c->cap_memo = c->cap_memo ? c->cap_memo * 2 : 32;
        c->memo_s = realloc(c->memo_s, (size_t)c->cap_memo * sizeof *c->memo_s);
        c->memo_r = realloc(c->memo_r, (size_t)c->cap_memo * sizeof *c->memo_r);
        LUNAR_ASSERT(c->memo_s && c->memo_r);
    }
    c->memo_s[c->n_memo] = s;
    c->memo_r[c->n_memo++] = r;
    if (json_is_false(s)) return r; /* no alternatives: nothing matches */
    if (!json_is_object(s)) return lunar_fail(c->err, "schema: expected an object or a boolean at %s", path);
    const char *key;
    json_t *x;
    int n_valid = 0;
    const char *first_valid = NULL;
    json_object_foreach((json_t *)s, key, x) {
        if (in_list(key, IGNORED)) continue;
        if (!in_list(key, SUPPORTED))
            return lunar_fail(c->err, "schema: unsupported keyword '%s' at %s", key, path);
        if (strcmp(key, "$ref") && strcmp(key, "anyOf") && strcmp(key, "allOf") && !first_valid) first_valid = key;
        n_valid++;
    }
    char sub[1024];
    g_seq q = {0};
    json_t *ref = json_object_get(s, "$ref"), *any = json_object_get(s, "anyOf"), *all = json_object_get(s, "allOf");
    if (ref || any || all) {
        const char *kw = ref ? "$ref" : any ? "anyOf" : "allOf";
        if (n_valid > 1)
            return lunar_fail(c->err, "schema: '%s' together with '%s' is not supported at %s", kw,
                              first_valid ? first_valid : (ref && any) ? "anyOf" : "allOf", path);
        if (ref) {
            if (!json_is_string(ref)) return lunar_fail(c->err, "schema: $ref must be a string at %s", path);
            const json_t *t = resolve_ref(c, json_string_value(ref), path);
            if (!t) return -1;
            snprintf(sub, sizeof sub, "%s", json_string_value(ref));
            int tr = js_schema(c, t, sub);
            if (tr < 0) return -1;
            seq_rule(&q, tr);
            gb_add_alt(c->b, r, &q);
            seq_free(&q);
            return r;
        }
        json_t *arr = any ? any : all;
        if (!json_is_array(arr) || !json_array_size(arr))
            return lunar_fail(c->err, "schema: %s must be a non-empty array at %s", kw, path);
        if (all && json_array_size(arr) != 1)
            return lunar_fail(c->err, "schema: allOf with more than one subschema is not supported at %s", path);
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char idx[32];
            snprintf(idx, sizeof idx, "%zu", i);
            subpath(sub, sizeof sub, path, kw, idx);
            int sr = js_schema(c, json_array_get(arr, i), sub);
            if (sr < 0) return -1;
            seq_rule(&q, sr);
            gb_add_alt(c->b, r, &q);
            seq_free(&q);
        }
        return r;
    }
    if (json_object_get(s, "enum") || json_object_get(s, "const")) return js_literals(c, r, s, path) ? -1 : r;
    static const char *TYPES[] = {"null", "boolean", "object", "array", "string", "number", "integer", NULL};
    int want[7] = {0};
    json_t *t = json_object_get(s, "type");
    if (!t) {
        for (int i = 0; i < 7; i++) want[i] = 1;
    } else {
        size_t nt = json_is_array(t) ? json_array_size(t) : 1;
        if (!json_is_string(t) && !json_is_array(t)) return lunar_fail(c->err, "schema: bad type at %s/type", path);
        for (size_t i = 0; i < nt; i++) {
            json_t *ti = json_is_array(t) ? json_array_get(t, i) : t;
            int found = 0;
            for (int j = 0; TYPES[j]; j++)
                if (json_is_string(ti) && !strcmp(json_string_value(ti), TYPES[j])) want[j] = found = 1;
            if (!found) return lunar_fail(c->err, "schema: unknown type at %s/type", path);
        }
    }
    if (want[5]) want[6] = 0; /* number covers integer */
    if (want[0]) lit_rule_alt(c, r, "null");
    if (want[1]) lit_rule_alt(c, r, "true"), lit_rule_alt(c, r, "false");
    if (want[2] && js_object(c, r, s, path)) return -1;
    if (want[3] && js_array(c, r, s, path)) return -1;
    if (want[4] && js_string(c, r, s, path)) return -1;
    if (want[5] && js_number(c, r, s, 0, path)) return -1;
    if (want[6] && js_number(c, r, s, 1, path)) return -1;
    return r;
}

/* ---- K3 typed arguments --------------------------------------------------------------- */
/*
 * A strict tool's arguments in the K3 form (reference/dspark_vl_api_spec.md 2.1): one block per
 * property, in schema order (required always, optional maybe),
 *   <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>
 * where a string VALUE is the bare text (no quotes, no escapes; lengths hold) and any other VALUE is
 * compact JSON of the property's schema restricted to T (number for integers too; boolean, null,
 * object, array). Needs an object schema with properties and additionalProperties: false (what OpenAI
 * strict mode requires); otherwise, or for a string property with a pattern, the arguments are one
 * <|open|>json type="object"<|sep|>JSON<|close|>json<|sep|> block, as the K3 encoder writes raw ones. */

static void seq_tok(jsc *c, g_seq *q, int32_t id) {
    seq_push(q, (g_elem){.kind = G_TOKENS, .a = gb_tokens(c->b, &id, 1), .b = 1});
}

/* r gets the alternative type="T"<|sep|>VALUE with VALUE the rule v (or, v < 0, the raw lexeme lex). */
static void k3_alt(jsc *c, int r, const char *type, int v, int lex) {
    g_seq q = {0};
    char t[32];
    snprintf(t, sizeof t, "type=\"%s\"", type);
    seq_lit(c->b, &q, t, strlen(t));
    seq_tok(c, &q, LUNAR_K3_ID_SEP);
    if (v >= 0) seq_rule(&q, v);
    else seq_lexeme(&q, lex);
    gb_add_alt(c->b, r, &q);
    seq_free(&q);
}

static const char *json_type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "object";
    case JSON_ARRAY: return "array";
    case JSON_STRING: return "string";
    case JSON_INTEGER: case JSON_REAL: return "number";
    case JSON_TRUE: case JSON_FALSE: return "boolean";
    default: return "null";
    }
}

/* The typed alternatives of one argument's value (schema s) into rule r. -1: not expressible (c->err). */
static int k3_value(jsc *c, int r, const json_t *s, const char *path, int depth) {
    char sub[1024];
    if (depth > 16) return lunar_fail(c->err, "k3 arguments: $ref / anyOf nesting too deep at %s", path);
    if (json_is_false(s)) return 0;
    if (json_is_true(s)) { /* as {}: a fresh object (only js_schema memoises by address, and it never sees it) */
        json_t *e = json_object();
        int rc = k3_value(c, r, e, path, depth);
        json_decref(e);
        return rc;
    }
    if (!json_is_object(s)) return lunar_fail(c->err, "schema: expected an object or a boolean at %s", path);
    const char *key;
    json_t *x;
    json_object_foreach((json_t *)s, key, x) if (!in_list(key, IGNORED) && !in_list(key, SUPPORTED))
        return lunar_fail(c->err, "schema: unsupported keyword '%s' at %s", key, path);
    json_t *ref = json_object_get(s, "$ref"), *any = json_object_get(s, "anyOf"), *all = json_object_get(s, "allOf");
    if (ref) {
        const json_t *t = json_is_string(ref) ? resolve_ref(c, json_string_value(ref), path) : NULL;
        return t ? k3_value(c, r, t, json_string_value(ref), depth + 1) : -1;
    }
    if (any || all) {
        json_t *arr = any ? any : all;
        for (size_t i = 0; i < json_array_size(arr); i++) {
            char idx[32];
            snprintf(idx, sizeof idx, "%zu", i);
            subpath(sub, sizeof sub, path, any ? "anyOf" : "allOf", idx);
            if (k3_value(c, r, json_array_get(arr, i), sub, depth + 1)) return -1;
        }
        return 0;
    }
    json_t *e = json_object_get(s, "enum"), *k = json_object_get(s, "const");
    if (e || k) {
        json_t *vals = json_array();
        if (json_is_array(e)) json_array_extend(vals, e);
        if (k) { /* with an enum too: the const if it is among them */
            int found = !e;
            for (size_t i = 0; e && i < json_array_size(e); i++) found |= json_equal(json_array_get(e, i), k);
            json_array_clear(vals);
            if (found) json_array_append(vals, k);
        }
        for (size_t i = 0; i < json_array_size(vals); i++) {
            json_t *v = json_array_get(vals, i);
            if (value_ok(c, s, v, path) != 1) continue;
            int lr = gb_rule(c->b);
            if (json_is_string(v)) {
                if (memchr(json_string_value(v), 0, json_string_length(v))) continue;
                g_seq q = {0};
                seq_lit(c->b, &q, json_string_value(v), json_string_length(v));
                gb_add_alt(c->b, lr, &q);
                seq_free(&q);
            } else {
                sbuf_t b = {0};
                dump_compact(&b, v);
                lit_rule_alt(c, lr, b.s);
                free(b.s);
            }
            k3_alt(c, r, json_type_name(v), lr, -1);
        }
        json_decref(vals);
        return 0;
    }
    static const char *TYPES[] = {"null", "boolean", "object", "array", "string", "number", "integer", NULL};
    int want[7] = {0};
    json_t *t = json_object_get(s, "type");
    for (int i = 0; i < 7; i++) want[i] = !t;
    for (size_t i = 0; t && i < (json_is_array(t) ? json_array_size(t) : 1); i++) {
        json_t *ti = json_is_array(t) ? json_array_get(t, i) : t;
        for (int j = 0; TYPES[j]; j++)
            if (json_is_string(ti) && !strcmp(json_string_value(ti), TYPES[j])) want[j] = 1;
    }
    if (want[5]) want[6] = 0;
    for (int j = 0; j < 7; j++) {
        if (!want[j]) continue;
        if (j == 4) {
            int64_t minl, maxl;
            if (json_object_get(s, "pattern"))
                return lunar_fail(c->err, "k3 arguments: a string pattern (raw text has no regex form here) at %s", path);
            if (get_count(c, s, "minLength", 0, &minl, path) || get_count(c, s, "maxLength", -1, &maxl, path)) return -1;
            if (maxl >= 0 && maxl < minl) return lunar_fail(c->err, "schema: maxLength < minLength at %s", path);
            note_min(c, "minLength", minl, path);
            g_lex lx = {.kind = LEX_STR, .min_len = minl, .max_len = maxl, .excl = -1, .raw = 1};
            k3_alt(c, r, "string", -1, gb_lex(c->b, &lx));
            continue;
        }
        int vr = gb_rule(c->b), rc = 0;
        if (j == 0) lit_rule_alt(c, vr, "null");
        else if (j == 1) lit_rule_alt(c, vr, "true"), lit_rule_alt(c, vr, "false");
        else if (j == 2) rc = js_object(c, vr, s, path);
        else if (j == 3) rc = js_array(c, vr, s, path);
        else rc = js_number(c, vr, s, j == 6, path);
        if (rc) return -1;
        k3_alt(c, r, j == 6 ? "number" : TYPES[j], vr, -1);
    }
    return 0;
}

/* The arguments rule (see above); -1 when the schema has no typed-argument form (c->err says why). */
static int k3_args(jsc *c, const json_t *s, const char *path, int depth) {
    if (depth > 16 || !json_is_object(s)) return lunar_fail(c->err, "k3 arguments: not an object schema at %s", path);
    json_t *ref = json_object_get(s, "$ref");
    if (ref) {
        const json_t *t = json_is_string(ref) && json_object_size(s) == 1 ? resolve_ref(c, json_string_value(ref), path) : NULL;
        return t ? k3_args(c, t, json_string_value(ref), depth + 1) : lunar_fail(c->err, "k3 arguments: $ref at %s", path);
    }
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *type = json_object_get(s, "type");
    if (!json_is_object(props) || !json_is_false(json_object_get(s, "additionalProperties")) ||
        (type && !(json_is_string(type) && !strcmp(json_string_value(type), "object"))))
        return lunar_fail(c->err, "k3 arguments: needs type object, properties and additionalProperties false at %s", path);
    static const char *OK[] = {"type", "properties", "required", "additionalProperties", NULL};
    const char *key;
    json_t *x;
    json_object_foreach((json_t *)s, key, x) if (!in_list(key, IGNORED) && !in_list(key, OK))
        return lunar_fail(c->err, "k3 arguments: keyword '%s' at %s", key, path);
    for (size_t i = 0; req && i < json_array_size(req); i++)
        if (!json_is_string(json_array_get(req, i)) || !json_object_get(props, json_string_value(json_array_get(req, i))))
            return lunar_fail(c->err, "k3 arguments: a required name is not a property at %s", path);
    int r = gb_rule(c->b);
    g_seq all = {0};
    json_object_foreach(props, key, x) {
        char sub[1024];
        subpath(sub, sizeof sub, path, "properties", key);
        int vr = gb_rule(c->b);
        if (k3_value(c, vr, x, sub, 0)) return seq_free(&all), -1;
        /* the key as an attribute value: & and " escaped (the K3 parser unescapes them) */
        sbuf_t a = {0};
        sb_add(&a, "argument key=\"", 14);
        for (const char *p = key; *p; p++) {
            if (*p == '&') sb_add(&a, "&amp;", 5);
            else if (*p == '"') sb_add(&a, "&quot;", 6);
            else sb_add(&a, p, 1);
        }
        sb_add(&a, "\" ", 2);
        g_seq q = {0};
        seq_tok(c, &q, LUNAR_K3_ID_OPEN);
        seq_lit(c->b, &q, a.s, a.n);
        seq_rule(&q, vr);
        seq_tok(c, &q, LUNAR_K3_ID_CLOSE);
        seq_lit(c->b, &q, "argument", 8);
        seq_tok(c, &q, LUNAR_K3_ID_SEP);
        free(a.s);
        int ar = rule_of_seq(c, &q);
        int required = 0;
        for (size_t i = 0; req && i < json_array_size(req); i++)
            required |= !strcmp(json_string_value(json_array_get(req, i)), key);
        if (required) seq_rule(&all, ar);
        else seq_repeat(&all, ar, 0, 1);
    }
    gb_add_alt(c->b, r, &all);
    seq_free(&all);
    return r;
}

int js_compile_k3_args(g_builder *b, const json_t *schema, int *root_rule, lunar_err *err) {
    jsc c = {.b = b, .root = schema, .any_value = -1, .any_object = -1, .any_str_lex = -1, .utf8_rule = -1, .err = err};
    int r = schema ? k3_args(&c, schema, "#", 0) : -1;
    if (r < 0) { /* the JSON block: rules built by the failed attempt stay unreferenced; nothing memoised is reused */
        lunar_err e2 = {{0}};
        free(c.memo_s), free(c.memo_r);
        c = (jsc){.b = b, .root = schema, .any_value = -1, .any_object = -1, .any_str_lex = -1, .utf8_rule = -1, .err = &e2};
        int v = schema ? js_schema(&c, schema, "#") : any_object(&c);
        if (v < 0) {
            free(c.memo_s), free(c.memo_r);
            return lunar_fail(err, "%s", e2.msg);
        }
        g_seq q = {0};
        seq_tok(&c, &q, LUNAR_K3_ID_OPEN);
        seq_lit(b, &q, "json type=\"object\"", 18);
        seq_tok(&c, &q, LUNAR_K3_ID_SEP);
        seq_rule(&q, v);
        seq_tok(&c, &q, LUNAR_K3_ID_CLOSE);
        seq_lit(b, &q, "json", 4);
        seq_tok(&c, &q, LUNAR_K3_ID_SEP);
        r = rule_of_seq(&c, &q);
    }
    free(c.memo_s), free(c.memo_r);
    *root_rule = r;
    return 0;
}

int js_compile(g_builder *b, const json_t *schema, int *root_rule, lunar_err *err) {
    jsc c = {.b = b, .root = schema, .any_value = -1, .any_object = -1, .any_str_lex = -1, .utf8_rule = -1, .err = err};
    int r = schema ? js_schema(&c, schema, "#") : any_object(&c);
    free(c.memo_s), free(c.memo_r);
    if (r < 0) return -1;
    *root_rule = r;
    return 0;
}

int lunar_grammar_from_json_schema(lunar_grammar **out, const lunar_vocab *v, const json_t *schema,
                                   const int32_t *end_ids, int n_end, lunar_err *err) {
    *out = NULL;
    g_builder b = {0};
    int root;
    if (js_compile(&b, schema, &root, err)) {
        gb_free(&b);
        return -1;
    }
    return g_finish(out, &b, v, root, end_ids, n_end, err);
}

json_t *lunar_json_schema_tool_value(const json_t *schema) {
    json_t *inner = json_deep_copy(schema), *defs = NULL, *id = NULL;
    if (json_is_object(inner)) {
        if ((defs = json_object_get(inner, "$defs"))) json_incref(defs), json_object_del(inner, "$defs");
        if ((id = json_object_get(inner, "$id"))) json_incref(id), json_object_del(inner, "$id");
        json_object_del(inner, "default");
    }
    json_t *w = json_pack("{s:s, s:[s], s:b, s:{s:o}}", "type", "object", "required", "value", "additionalProperties",
                          0, "properties", "value", inner);
    if (defs) json_object_set_new(w, "$defs", defs);
    if (id) json_object_set_new(w, "$id", id);
    return w;
}
