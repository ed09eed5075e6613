/* Grammar-constrained decoding over the real Kimi vocabulary: every schema case (as given and as a
 * strict tool's parameters) and json_object mode driven by a random sampler to completion; the
 * outputs parse (jansson) and are compact, and are written to /tmp/lunar_grammar_samples.jsonl
 * (LUNAR_GRAMMAR_SAMPLES overrides) for `python3 tools/grammar/validate.py samples`; hand-written
 * valid / invalid instances (and "outside" ones: valid JSON for the schema but not in the emitted
 * form: whitespace, other property order, surrogate escapes); masks against token-by-token checks; EBNF; errors. */
#include <ctype.h>

#include "grammar_util.h"
#include "test.h"

static lunar_tokenizer *g_tok;
static lunar_vocab *g_voc;
static uint32_t *g_closing;

static int setup(void) {
    if (g_voc) return 0;
    lunar_err err = {{0}};
    if (lunar_tokenizer_load_files(&g_tok, "data/kimi-tokenizer/tiktoken.model",
                                   "data/kimi-tokenizer/tokenizer_config.k3.json", &err) ||
        lunar_vocab_build(&g_voc, g_tok, &err)) {
        lunar_test_fail(__FILE__, __LINE__, "setup: %s", err.msg);
        return -1;
    }
    g_closing = gu_closing_mask(g_tok, lunar_vocab_size(g_voc));
    return 0;
}

/* No whitespace outside string literals. */
static int is_compact(const char *s) {
    int in = 0;
    for (; *s; s++) {
        if (in) {
            if (*s == '\\') s++;
            else if (*s == '"') in = 0;
        } else if (*s == '"') {
            in = 1;
        } else if (isspace((unsigned char)*s)) {
            return 0;
        }
    }
    return 1;
}

/* The case whose minLength (999999999999) no output can reach: refused when compiled. */
static int unreachable_case(const char *name) { return !strcmp(name, "RangeConstraints:3"); }

TEST(grammar_schema_cases) {
    if (setup()) return;
    json_t **sc;
    char **names;
    int n = gu_load_cases(&sc, &names);
    CHECK(n == 91);
    const char *out_path = getenv("LUNAR_GRAMMAR_SAMPLES");
    if (!out_path) out_path = "/tmp/lunar_grammar_samples.jsonl";
    FILE *out = fopen(out_path, "w");
    int32_t end = GU_END_ID;
    int runs = 0, finished = 0;
    for (int i = 0; i <= n; i++)
        for (int w = 0; w < (i < n ? 2 : 1); w++) {
            const char *name = i < n ? names[i] : "json_object";
            json_t *s = i == n ? NULL : w ? lunar_json_schema_tool_value(sc[i]) : json_incref(sc[i]);
            lunar_grammar *g;
            lunar_err err = {{0}};
            int rc = lunar_grammar_from_json_schema(&g, g_voc, s, &end, 1, &err);
            if (unreachable_case(name)) {
                CHECK_MSG(rc == -1 && strstr(err.msg, "minLength 999999999999"), "%s wrap %d: rc %d '%s'", name, w, rc,
                          err.msg);
                if (!rc) lunar_grammar_free(g);
                json_decref(s);
                continue;
            }
            if (rc) {
                CHECK_MSG(0, "%s wrap %d: %s", name, w, err.msg);
                json_decref(s);
                continue;
            }
            for (int seed = 0; seed < 2; seed++) {
                gu_run r = gu_sample(g, g_tok, g_closing, lunar_vocab_size(g_voc), (uint64_t)(i * 7 + w + seed * 1000),
                                     2048, 0);
                runs++;
                CHECK_MSG(!r.dead && !r.bad_accept, "%s wrap %d seed %d: dead %d bad accept %d", name, w, seed, r.dead,
                          r.bad_accept);
                {
                    CHECK_MSG(r.done, "%s wrap %d seed %d: not done after %d tokens", name, w, seed, r.n_tokens);
                    json_error_t je;
                    json_t *v = json_loads(r.text, JSON_DECODE_ANY, &je);
                    CHECK_MSG(v != NULL, "%s wrap %d seed %d: not JSON (%s): %.200s", name, w, seed, je.text, r.text);
                    CHECK_MSG(is_compact(r.text), "%s wrap %d: not compact: %.200s", name, w, r.text);
                    if (i == n) CHECK(json_is_object(v));
                    json_decref(v);
                    finished += r.done;
                }
                if (out) {
                    /* (an unfinished text may end inside a UTF-8 sequence: then it is left out) */
                    json_t *txt = json_stringn(r.text, r.len);
                    json_t *rec = json_pack("{s:s, s:i, s:o, s:b, s:o}", "case", name, "wrap", w, "schema",
                                            s ? json_incref(s) : json_pack("{s:s}", "type", "object"), "done", r.done,
                                            "text", txt ? txt : json_string(""));
                    char *line = rec ? json_dumps(rec, JSON_COMPACT) : NULL;
                    if (line) fprintf(out, "%s\n", line);
                    free(line);
                    json_decref(rec);
                }
                free(r.text);
            }
            lunar_grammar_free(g);
            json_decref(s);
        }
    if (out) fclose(out);
    CHECK(runs == 2 * (2 * 91 + 1 - 2)); /* RangeConstraints:3 refused, as given and wrapped */
    CHECK(finished == runs);
    for (int i = 0; i < n; i++) json_decref(sc[i]), free(names[i]);
    free(sc), free(names);
}

/* Runs text (+ the end token) through a fresh matcher: 1 = accepted and done. */
static int accepts(const lunar_grammar *g, const char *text) {
    lunar_ids ids = {0};
    lunar_err err = {{0}};
    if (lunar_tokenize(g_tok, text, strlen(text), false, &ids, &err)) return -1;
    lunar_matcher *m = lunar_matcher_new(g);
    int ok = 1;
    for (size_t k = 0; k < ids.n && ok; k++) ok = lunar_matcher_accept(m, ids.ids[k]) == 0;
    if (ok) ok = lunar_matcher_accept(m, GU_END_ID) == 0 && lunar_matcher_is_done(m);
    lunar_matcher_free(m);
    lunar_ids_free(&ids);
    return ok;
}

TEST(grammar_instances) {
    if (setup()) return;
    json_t **sc;
    char **names;
    int n = gu_load_cases(&sc, &names);
    FILE *f = fopen("tests/data/grammar/instances.jsonl", "r");
    CHECK(f != NULL);
    if (!f) return;
    char line[1 << 14];
    int checks = 0;
    int32_t end = GU_END_ID;
    while (fgets(line, sizeof line, f)) {
        json_t *rec = json_loads(line, 0, NULL);
        if (!rec) continue;
        const char *cname = json_string_value(json_object_get(rec, "case"));
        json_t *schema = NULL;
        for (int i = 0; i < n; i++)
            if (!strcmp(names[i], cname)) schema = sc[i];
        int is_obj = !strcmp(cname, "json_object");
        CHECK_MSG(schema || is_obj, "unknown case %s", cname);
        char *dump = schema ? json_dumps(schema, JSON_COMPACT) : NULL;
        int wraps = schema && !strstr(dump, "\"#\"") ? 2 : 1;
        free(dump);
        for (int w = 0; w < wraps; w++) {
            json_t *s = w ? lunar_json_schema_tool_value(schema) : json_incref(schema);
            lunar_grammar *g;
            lunar_err err = {{0}};
            if (lunar_grammar_from_json_schema(&g, g_voc, is_obj ? NULL : s, &end, 1, &err)) {
                CHECK_MSG(0, "%s: %s", cname, err.msg);
                json_decref(s);
                continue;
            }
            static const char *kinds[] = {"valid", "invalid", "outside"};
            for (int k = 0; k < 3; k++) {
                json_t *arr = json_object_get(rec, kinds[k]);
                for (size_t j = 0; j < json_array_size(arr); j++) {
                    const char *t = json_string_value(json_array_get(arr, j));
                    char buf[1 << 13];
                    snprintf(buf, sizeof buf, w ? "{\"value\":%s}" : "%s", t);
                    int got = accepts(g, buf);
                    CHECK_MSG(got == (k == 0), "%s wrap %d: %s expected %s, accept gave %d", cname, w, buf, kinds[k], got);
                    checks++;
                }
            }
            lunar_grammar_free(g);
            json_decref(s);
        }
        json_decref(rec);
    }
    fclose(f);
    CHECK(checks >= 150);
    for (int i = 0; i < n; i++) json_decref(sc[i]), free(names[i]);
    free(sc), free(names);
}

/* At states along sampled outputs, every token's mask bit equals can_accept (the table path for
 * string bodies, the trie walk and the per-state cache against plain byte-by-byte stepping). */
static void check_mask_states(const char *schema_text, const char *prefix, uint64_t seed, int states) {
    json_t *s = schema_text ? json_loads(schema_text, 0, NULL) : NULL;
    int32_t end = GU_END_ID;
    lunar_grammar *g;
    lunar_err err = {{0}};
    if (lunar_grammar_from_json_schema(&g, g_voc, s, &end, 1, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        json_decref(s);
        return;
    }
    int32_t V = lunar_vocab_size(g_voc);
    int words = (V + 31) / 32;
    uint32_t *mask = malloc((size_t)words * 4);
    lunar_matcher *m = lunar_matcher_new(g);
    uint64_t st = seed;
    if (prefix) {
        lunar_ids ids = {0};
        lunar_tokenize(g_tok, prefix, strlen(prefix), false, &ids, &err);
        for (size_t k = 0; k < ids.n; k++) CHECK(lunar_matcher_accept(m, ids.ids[k]) == 0);
        lunar_ids_free(&ids);
    }
    for (int k = 0; k < states && !lunar_matcher_is_done(m); k++) {
        lunar_matcher_fill_mask(m, mask);
        int bad = 0;
        for (int32_t id = 0; id < V; id++) {
            int bit = mask[id >> 5] >> (id & 31) & 1;
            if (bit != lunar_matcher_can_accept(m, id) && bad++ < 3) {
                size_t len;
                const char *b = lunar_token_bytes(g_tok, id, &len);
                CHECK_MSG(0, "%s state %d: token %d (%.*s) mask %d", schema_text ? schema_text : "json_object", k, id,
                          (int)len, b, bit);
            }
        }
        /* step: a closing token half of the time, else any allowed one */
        uint64_t na = 0, nc = 0;
        for (int w = 0; w < words; w++)
            na += (uint64_t)__builtin_popcount(mask[w]), nc += (uint64_t)__builtin_popcount(mask[w] & g_closing[w]);
        if (!na) break;
        int32_t pick = nc && gu_rng(&st) % 3 == 0 ? gu_kth(mask, g_closing, words, gu_rng(&st) % nc)
                                                  : gu_kth(mask, NULL, words, gu_rng(&st) % na);
        CHECK(lunar_matcher_accept(m, pick) == 0);
    }
    lunar_matcher_free(m);
    lunar_grammar_free(g);
    free(mask);
    json_decref(s);
}

TEST(grammar_mask_matches_accept) {
    if (setup()) return;
    static const char *obj = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"minimum\":-5,"
                             "\"maximum\":250},\"name\":{\"type\":\"string\"}},\"additionalProperties\":{\"type\":\"array\","
                             "\"items\":{\"type\":\"number\",\"exclusiveMaximum\":2.5}}}";
    check_mask_states("{\"type\":\"string\",\"minLength\":2,\"maxLength\":6}", NULL, 1, 5);
    /* keys that still equal a prefix of a declared name (the excluded-key trie) */
    check_mask_states(obj, "{\"a\":1,\"nam", 4, 2);
    check_mask_states(obj, "{\"a\":1,\"name", 5, 2);
    check_mask_states(obj, "{\"", 6, 2);
    check_mask_states("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"minimum\":-5,\"maximum\":250},"
                      "\"name\":{\"type\":\"string\"}},\"required\":[\"name\"],\"additionalProperties\":{\"type\":\"array\","
                      "\"items\":{\"type\":\"number\",\"exclusiveMaximum\":2.5}}}",
                      NULL, 2, 8);
    check_mask_states(NULL, NULL, 3, 6);
}

TEST(grammar_errors) {
    if (setup()) return;
    static const struct {
        const char *schema, *msg;
    } cases[] = {
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"minProperties\":1}}}",
         "unsupported keyword 'minProperties' at #/properties/a"},
        {"{\"oneOf\":[{\"type\":\"string\"}]}", "unsupported keyword 'oneOf' at #"},
        {"{\"$ref\":\"#/$defs/missing\"}", "does not resolve"},
        {"{\"$ref\":\"http://x/y.json\"}", "only local $ref"},
        {"{\"type\":\"string\",\"pattern\":\"(?=a)b\"}", "only (?:...) groups"},
        {"{\"type\":\"string\",\"pattern\":\"^(ab)+$\",\"maxLength\":4}", "pattern together with minLength/maxLength"},
        {"{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", "no integer satisfies"},
        {"{\"type\":\"array\",\"uniqueItems\":true}", "uniqueItems"},
        {"{\"type\":\"string\",\"anyOf\":[{\"maxLength\":2}]}", "'anyOf' together with 'type'"},
        {"{\"enum\":[1,2],\"type\":\"string\"}", "no enum/const value"},
        {"{\"type\":\"object\",\"required\":[\"x\"],\"additionalProperties\":false}", "required 'x'"},
        /* no output at all, or none that fits in any context */
        {"{\"type\":\"object\",\"properties\":{\"a\":false},\"required\":[\"a\"]}", "admits no output"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#\"}},\"required\":[\"a\"]}", "admits no output"},
        {"{\"type\":\"string\",\"minLength\":999999999999}", "minLength 999999999999 at #"},
        {"{\"type\":\"array\",\"minItems\":100000000000,\"items\":{\"type\":\"string\",\"minLength\":9}}",
         "more than any context holds"},
    };
    int32_t end = GU_END_ID;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        json_t *s = json_loads(cases[i].schema, 0, NULL);
        lunar_grammar *g = NULL;
        lunar_err err = {{0}};
        int rc = lunar_grammar_from_json_schema(&g, g_voc, s, &end, 1, &err);
        CHECK_MSG(rc == -1 && strstr(err.msg, cases[i].msg), "%s: rc %d, message '%s'", cases[i].schema, rc, err.msg);
        lunar_grammar_free(g);
        json_decref(s);
    }
}


/* Budgets: the fewest tokens that finish a value (bytes + control tokens; every byte is a Kimi token). */
static int64_t min_tokens_of(const char *schema_text, const char *prefix) {
    json_t *s = schema_text ? json_loads(schema_text, 0, NULL) : NULL;
    lunar_grammar *g;
    lunar_err err = {{0}};
    int32_t end = GU_END_ID;
    if (lunar_grammar_from_json_schema(&g, g_voc, s, &end, 1, &err)) {
        json_decref(s);
        return -2;
    }
    json_decref(s);
    int64_t d = lunar_grammar_min_tokens(g);
    if (prefix) {
        lunar_ids ids = {0};
        lunar_matcher *m = lunar_matcher_new(g);
        lunar_tokenize(g_tok, prefix, strlen(prefix), false, &ids, &err);
        for (size_t k = 0; k < ids.n; k++)
            if (lunar_matcher_accept(m, ids.ids[k])) d = -3;
        if (d != -3) d = lunar_matcher_tokens_to_finish(m);
        lunar_matcher_free(m);
        lunar_ids_free(&ids);
    }
    lunar_grammar_free(g);
    return d;
}

TEST(grammar_budget_shortest) {
    if (setup()) return;
    static const struct {
        const char *schema, *prefix;
        int64_t want; /* the shortest completion, written out in the comment */
    } cases[] = {
        {"{\"type\":\"string\"}", NULL, 2},                                          /* "" */
        {"{\"type\":\"string\",\"minLength\":3}", NULL, 5},                          /* "aaa" */
        {"{\"type\":\"string\",\"minLength\":3}", "\"ab", 2},                        /* a" */
        {"{\"type\":\"string\"}", "\"\\u00", 3},                                     /* 41" */
        {"{\"type\":\"integer\",\"minimum\":100}", NULL, 3},                         /* 100 */
        {"{\"type\":\"integer\",\"minimum\":-5,\"maximum\":-3}", NULL, 2},           /* -3 */
        {"{\"type\":\"integer\",\"minimum\":1000000}", NULL, 7},                     /* 1000000 */
        {"{\"type\":\"integer\",\"minimum\":1000000}", "12", 5},                     /* 12 + 00000 */
        {"{\"type\":\"number\",\"exclusiveMinimum\":0,\"maximum\":0.5}", NULL, 3},   /* 0.1 */
        {"{\"type\":\"number\",\"minimum\":1000.5,\"maximum\":1000.75}", NULL, 6},   /* 1000.5 */
        {"{\"type\":\"number\",\"minimum\":1000.5,\"maximum\":1000.75}", "1000.", 1},/* 5 */
        {"{\"type\":\"number\",\"minimum\":2.5}", "2.", 1},                          /* 5 */
        {"{\"type\":\"array\",\"minItems\":3,\"items\":{\"type\":\"integer\"}}", NULL, 7}, /* [0,0,0] */
        {"{\"type\":\"array\",\"minItems\":3,\"items\":{\"type\":\"integer\"}}", "[12,", 4}, /* 0,0] */
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"},\"b\":{\"type\":\"boolean\"}},"
         "\"required\":[\"a\",\"b\"],\"additionalProperties\":false}", NULL, 17},    /* {"a":"","b":true} */
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"},\"b\":{\"type\":\"boolean\"}},"
         "\"required\":[\"a\",\"b\"],\"additionalProperties\":false}", "{\"a\":\"x", 11}, /* ","b":true} */
        {"{\"enum\":[\"xyz\",123456]}", NULL, 5},                                    /* "xyz" */
        {"{\"anyOf\":[{\"type\":\"array\",\"minItems\":1000,\"items\":{\"type\":\"null\"}},{\"const\":\"hi\"}]}", NULL, 4},
        {"{\"anyOf\":[{\"type\":\"array\",\"minItems\":1000,\"items\":{\"type\":\"null\"}},{\"const\":\"hi\"}]}", "[", 5000},
        /* keys checked against declared names: "a" is taken, so an additional key needs a byte more */
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"null\"}},\"additionalProperties\":{\"type\":\"null\"}}",
         "{\"a\":null,\"a", 8},                                                      /* b":null} */
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"null\"}},\"additionalProperties\":{\"type\":\"null\"}}",
         "{\"a\":null,\"b", 7},                                                      /* ":null} */
        {NULL, NULL, 2},                                                             /* {} */
        {NULL, "{\"k\":[[{\"", 7},                                                   /* ":0}]]} */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t d = min_tokens_of(cases[i].schema, cases[i].prefix);
        CHECK_MSG(d == cases[i].want, "%s after '%s': %lld, want %lld", cases[i].schema ? cases[i].schema : "json_object",
                  cases[i].prefix ? cases[i].prefix : "", (long long)d, (long long)cases[i].want);
    }
    /* EBNF: control tokens count one each, the end token none */
    lunar_grammar *g;
    lunar_err err = {{0}};
    int32_t end = GU_END_ID;
    CHECK(lunar_grammar_from_ebnf(&g, g_voc, "root ::= [a-z]* <163587> \"bc\" (\"d\" | \"efg\")", &end, 1, &err) == 0);
    CHECK(lunar_grammar_min_tokens(g) == 4);
    lunar_grammar_free(g);
}

/* Every schema case under a budget just above its shortest output, with a walk that never closes
 * anything it may leave open: the budget alone must bring every output to a complete value and never
 * exceed what is left. The same walk without the budget (same seed: the same picks while the masks
 * agree) must then either end complete too, or the budget must report that it narrowed a mask; with
 * a budget to spare it must never narrow. */
TEST(grammar_budget_always_closes) {
    if (setup()) return;
    json_t **sc;
    char **names;
    int n = gu_load_cases(&sc, &names);
    int32_t end = GU_END_ID;
    int runs = 0, narrowed = 0, unfinished_alone = 0;
    for (int i = 0; i <= n; i++) {
        if (i < n && unreachable_case(names[i])) continue;
        const char *name = i < n ? names[i] : "json_object";
        int w = i % 2; /* as given or wrapped, alternately */
        json_t *s = i == n ? NULL : w ? lunar_json_schema_tool_value(sc[i]) : json_incref(sc[i]);
        lunar_grammar *g;
        lunar_err err = {{0}};
        CHECK_MSG(lunar_grammar_from_json_schema(&g, g_voc, s, &end, 1, &err) == 0, "%s: %s", name, err.msg);
        json_decref(s);
        int64_t shortest = lunar_grammar_min_tokens(g);
        CHECK_MSG(shortest > 0 && shortest < 400, "%s: shortest %lld", name, (long long)shortest);
        const int slack[] = {0, 1 + i % 13};
        for (int k = 0; k < 2; k++) {
            int budget = (int)shortest + slack[k];
            gu_run r = gu_sample_ex(g, g_tok, g_closing, lunar_vocab_size(g_voc), (uint64_t)(i * 31 + k), budget, 0, 1, 1);
            runs++;
            CHECK_MSG(!r.dead && !r.bad_accept && !r.over_budget, "%s budget %d: dead %d bad %d over %d", name, budget,
                      r.dead, r.bad_accept, r.over_budget);
            CHECK_MSG(r.n_tokens <= budget && r.to_finish == 0, "%s budget %d: %d tokens, %lld more needed: %.200s",
                      name, budget, r.n_tokens, (long long)r.to_finish, r.text);
            json_t *v = json_loads(r.text, JSON_DECODE_ANY, NULL);
            CHECK_MSG(v != NULL, "%s budget %d: not JSON: %.200s", name, budget, r.text);
            json_decref(v);
            gu_run p = gu_sample_ex(g, g_tok, g_closing, lunar_vocab_size(g_voc), (uint64_t)(i * 31 + k), budget, 0, 0, 1);
            CHECK_MSG(p.to_finish == 0 || r.narrowed, "%s budget %d: unfinished without the budget, yet not narrowed",
                      name, budget);
            narrowed += r.narrowed;
            unfinished_alone += p.to_finish != 0;
            if (!r.narrowed) CHECK_MSG(p.len == r.len && !memcmp(p.text, r.text, r.len), "%s: same walk, other text", name);
            free(r.text), free(p.text);
        }
        /* plenty of budget, the usual closing-biased walk: the budget never has to act */
        gu_run r = gu_sample_ex(g, g_tok, g_closing, lunar_vocab_size(g_voc), (uint64_t)i, 100000, 0, 1, 0);
        CHECK_MSG(r.done && !r.narrowed, "%s: done %d narrowed %d", name, r.done, r.narrowed);
        free(r.text);
        lunar_grammar_free(g);
    }
    CHECK(runs == 2 * (n - 1 + 1));
    /* the walk is stubborn enough that the budget has work to do in most runs */
    fprintf(stderr, " [%d of %d runs narrowed; %d would not finish without the budget]", narrowed, runs, unfinished_alone);
    CHECK(unfinished_alone * 2 > runs && narrowed >= unfinished_alone);
    for (int i = 0; i < n; i++) json_decref(sc[i]), free(names[i]);
    free(sc), free(names);
}

TEST(grammar_ebnf) {
    if (setup()) return;
    int32_t end = GU_END_ID;
    lunar_grammar *g;
    lunar_err err = {{0}};
    const char *src = "# a list of numbers after a tag\n"
                      "root ::= \"n=\" num (\",\" num)* | \"none\"\n"
                      "num  ::= [1-9] [0-9]{0,3} | \"0\"\n";
    CHECK(lunar_grammar_from_ebnf(&g, g_voc, src, &end, 1, &err) == 0);
    if (g) {
        CHECK(accepts(g, "n=12,0,9999") == 1);
        CHECK(accepts(g, "none") == 1);
        CHECK(accepts(g, "n=012") == 0);
        CHECK(accepts(g, "n=12345") == 0);
        lunar_grammar_free(g);
    }
    /* control tokens as terminals: <|open|> "x" <|close|>, no end token (done when complete) */
    CHECK(lunar_grammar_from_ebnf(&g, g_voc, "root ::= <163587> [a-z]+ <163588>", NULL, 0, &err) == 0);
    if (g) {
        lunar_matcher *m = lunar_matcher_new(g);
        uint32_t *mask = calloc((size_t)(lunar_vocab_size(g_voc) + 31) / 32, 4);
        lunar_matcher_fill_mask(m, mask);
        int n = 0;
        for (int w = 0; w < (lunar_vocab_size(g_voc) + 31) / 32; w++) n += __builtin_popcount(mask[w]);
        CHECK(n == 1 && (mask[163587 >> 5] >> (163587 & 31) & 1));
        CHECK(lunar_matcher_accept(m, 163588) == -1);
        CHECK(lunar_matcher_accept(m, 163587) == 0);
        lunar_ids ids = {0};
        lunar_tokenize(g_tok, "abc", 3, false, &ids, &err);
        for (size_t k = 0; k < ids.n; k++) CHECK(lunar_matcher_accept(m, ids.ids[k]) == 0);
        CHECK(!lunar_matcher_is_done(m));
        CHECK(lunar_matcher_accept(m, 163588) == 0);
        CHECK(lunar_matcher_is_done(m));
        lunar_ids_free(&ids);
        free(mask);
        lunar_matcher_free(m);
        lunar_grammar_free(g);
    }
    CHECK(lunar_grammar_from_ebnf(&g, g_voc, "root ::= missing", &end, 1, &err) == -1);
    CHECK(strstr(err.msg, "'missing'") != NULL);
    CHECK(lunar_grammar_from_ebnf(&g, g_voc, "root ::= root \"a\"", &end, 1, &err) == -1);
}

/* JSON-Schema rules embedded in an EBNF grammar by name */
TEST(grammar_ebnf_with_schemas) {
    if (setup()) return;
    int32_t end = GU_END_ID;
    lunar_grammar *g;
    lunar_err err = {{0}};
    json_t *sch = json_loads("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"],"
                             "\"additionalProperties\":false}", 0, NULL);
    const char *names[] = {"args", "any"};
    const json_t *schemas[] = {sch, NULL};
    const char *src = "root ::= \"f(\" args \")\" | \"g(\" any \")\"";
    CHECK(lunar_grammar_from_ebnf_with_schemas(&g, g_voc, src, names, schemas, 2, &end, 1, &err) == 0);
    if (g) {
        CHECK(accepts(g, "f({\"a\":12})") == 1);
        CHECK(accepts(g, "f({\"a\":\"x\"})") == 0);
        CHECK(accepts(g, "f({})") == 0);
        CHECK(accepts(g, "g({\"b\":[1,true]})") == 1);
        CHECK(accepts(g, "g([1])") == 0);
        lunar_grammar_free(g);
    }
    /* a name defined twice, a bad name, an unsupported schema */
    CHECK(lunar_grammar_from_ebnf_with_schemas(&g, g_voc, "root ::= args\nargs ::= \"x\"", names, schemas, 1, &end, 1,
                                               &err) == -1);
    const char *bad[] = {"9x"};
    CHECK(lunar_grammar_from_ebnf_with_schemas(&g, g_voc, "root ::= \"x\"", bad, schemas, 1, &end, 1, &err) == -1);
    json_t *unsup = json_loads("{\"type\":\"nosuchtype\"}", 0, NULL);
    const json_t *us[] = {unsup};
    CHECK(lunar_grammar_from_ebnf_with_schemas(&g, g_voc, "root ::= args", names, us, 1, &end, 1, &err) == -1);
    CHECK(strstr(err.msg, "args") != NULL);
    json_decref(unsup);
    json_decref(sch);
}

/* Runs text through a fresh matcher, \1 \2 \3 standing for the K3 control tokens <|open|> <|close|>
 * <|sep|> (the rest tokenized as text), then the end token: 1 = accepted and done. */
static int accepts_k3(const lunar_grammar *g, const char *text) {
    lunar_matcher *m = lunar_matcher_new(g);
    int ok = 1;
    for (const char *p = text; *p && ok;) {
        if (*p >= 1 && *p <= 3) {
            ok = lunar_matcher_accept(m, 163587 + (*p - 1)) == 0;
            p++;
            continue;
        }
        size_t n = strcspn(p, "\1\2\3");
        lunar_ids ids = {0};
        lunar_err err = {{0}};
        if (lunar_tokenize(g_tok, p, n, false, &ids, &err)) ok = 0;
        for (size_t k = 0; k < ids.n && ok; k++) ok = lunar_matcher_accept(m, ids.ids[k]) == 0;
        lunar_ids_free(&ids);
        p += n;
    }
    if (ok) ok = lunar_matcher_accept(m, GU_END_ID) == 0 && lunar_matcher_is_done(m);
    lunar_matcher_free(m);
    return ok;
}

/* A strict tool's arguments as K3 typed argument tags: string values bare (lengths in code points), other
 * values compact JSON with their type; property order, required / optional; the fallback json block. */
TEST(grammar_k3_typed_arguments) {
    if (setup()) return;
    int32_t end = GU_END_ID;
    lunar_err err = {{0}};
    json_t *sch = json_loads("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"maxLength\":3},"
                             "\"b\":{\"type\":[\"integer\",\"null\"],\"minimum\":1},\"c\":{\"enum\":[\"x y\",[1]]}},"
                             "\"required\":[\"a\",\"c\"],\"additionalProperties\":false}", 0, NULL);
    const char *names[] = {"args"};
    const json_t *schemas[] = {sch};
    const int forms[] = {LUNAR_SCHEMA_K3_ARGS};
    lunar_grammar *g = NULL;
    CHECK(lunar_grammar_from_ebnf_with_forms(&g, g_voc, "root ::= args", names, schemas, forms, 1, &end, 1, &err) == 0);
    if (g) {
        CHECK(accepts_k3(g, "\1argument key=\"a\" type=\"string\"\3x\"\\\2argument\3"
                            "\1argument key=\"b\" type=\"number\"\3" "12\2argument\3"
                            "\1argument key=\"c\" type=\"string\"\3x y\2argument\3") == 1);
        CHECK(accepts_k3(g, "\1argument key=\"a\" type=\"string\"\3\2argument\3"
                            "\1argument key=\"b\" type=\"null\"\3null\2argument\3"
                            "\1argument key=\"c\" type=\"array\"\3[1]\2argument\3") == 1);
        CHECK(accepts_k3(g, "\1argument key=\"a\" type=\"string\"\3\2argument\3"
                            "\1argument key=\"c\" type=\"array\"\3[1]\2argument\3") == 1); /* b is optional */
        CHECK(accepts_k3(g, "\1argument key=\"a\" type=\"string\"\3abcd\2argument\3"
                            "\1argument key=\"c\" type=\"array\"\3[1]\2argument\3") == 0); /* maxLength 3 */
        CHECK(accepts_k3(g, "\1argument key=\"a\" type=\"string\"\3\"ab\"\2argument\3"
                            "\1argument key=\"c\" type=\"array\"\3[1]\2argument\3") == 0); /* quoted: 4 code points */
        CHECK(accepts_k3(g, "\1argument key=\"a\" type=\"string\"\3ab\2argument\3"
                            "\1argument key=\"b\" type=\"number\"\3" "0\2argument\3"
                            "\1argument key=\"c\" type=\"array\"\3[1]\2argument\3") == 0); /* minimum 1 */
        CHECK(accepts_k3(g, "\1argument key=\"a\" type=\"string\"\3ab\2argument\3"
                            "\1argument key=\"c\" type=\"string\"\3[1]\2argument\3") == 0); /* wrong type tag */
        CHECK(accepts_k3(g, "\1argument key=\"c\" type=\"array\"\3[1]\2argument\3") == 0);  /* a is required */
        /* the shortest: a empty, c = [1] (its tag is shorter than "string"), 4 control tokens per argument */
        CHECK(lunar_grammar_min_tokens(g) == (int64_t)(strlen("argument key=\"a\" type=\"string\"") + strlen("argument") +
                                                       strlen("argument key=\"c\" type=\"array\"") + strlen("[1]") +
                                                       strlen("argument") + 8));
        lunar_grammar_free(g);
    }
    /* a property whose schema is true: any type, strings bare */
    json_t *anyp = json_loads("{\"type\":\"object\",\"properties\":{\"d\":true},\"required\":[\"d\"],"
                              "\"additionalProperties\":false}", 0, NULL);
    schemas[0] = anyp;
    CHECK(lunar_grammar_from_ebnf_with_forms(&g, g_voc, "root ::= args", names, schemas, forms, 1, &end, 1, &err) == 0);
    if (g) {
        CHECK(accepts_k3(g, "\1argument key=\"d\" type=\"string\"\3a\nb\2argument\3") == 1);
        CHECK(accepts_k3(g, "\1argument key=\"d\" type=\"object\"\3{\"x\":[1,null]}\2argument\3") == 1);
        CHECK(accepts_k3(g, "\1argument key=\"d\" type=\"object\"\3[1]\2argument\3") == 0);
        lunar_grammar_free(g);
    }
    json_decref(anyp);
    /* additional properties allowed: no typed form, one json block */
    json_t *open = json_loads("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}", 0, NULL);
    schemas[0] = open;
    CHECK(lunar_grammar_from_ebnf_with_forms(&g, g_voc, "root ::= args", names, schemas, forms, 1, &end, 1, &err) == 0);
    if (g) {
        CHECK(accepts_k3(g, "\1json type=\"object\"\3{\"a\":1,\"z\":[]}\2json\3") == 1);
        CHECK(accepts_k3(g, "\1argument key=\"a\" type=\"number\"\3" "1\2argument\3") == 0);
        lunar_grammar_free(g);
    }
    json_decref(open);
    json_decref(sch);
}
