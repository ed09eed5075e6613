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

/* The case whose minLength (999999999999) no 2,048-token output can reach. */
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
            if (lunar_grammar_from_json_schema(&g, g_voc, s, &end, 1, &err)) {
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
                if (unreachable_case(name)) {
                    CHECK_MSG(!r.done && r.n_tokens == 2048, "%s: expected to stay inside the string", name);
                } else {
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
    CHECK(runs == 2 * (2 * 91 + 1));
    CHECK(finished == runs - 4);
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
