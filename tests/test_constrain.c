/* Constrained decoding of chat requests (server/constrain.h): for every JSON-schema case, as a
 * response_format json_schema and as a strict tool's parameters (tool_choice required), in both chat
 * formats (K2 / Kimi-Linear; K3 with thinking on), a random walk of the matcher over the real vocabulary is
 * fed to the format's output parser, which must give JSON content / one or more calls of the tool whose
 * arguments are JSON objects with the wrapped shape ({"value": ...}); also json_object, named, none and
 * auto. Samples go to /tmp/lunar_constrain_samples.jsonl (schema + content / arguments) for a Draft 2020-12
 * check in Python (tools/grammar/validate.py style). */
#include <string.h>

#include "grammar_util.h"
#include "server/constrain.h"
#include "test.h"
#include "text/parse_k2.h"
#include "text/parse_k3.h"
#include "text/sbuf.h"

typedef struct {
    lunar_tokenizer *tok;
    lunar_vocab *voc;
    uint32_t *closing;
} fmt_env;

static fmt_env g_env[2]; /* 0: K2, 1: K3 */

static int env(int k3, fmt_env **out) {
    fmt_env *e = &g_env[k3];
    *out = e;
    if (e->voc) return 0;
    lunar_err err = {{0}};
    if (lunar_tokenizer_load_files(&e->tok, "data/kimi-tokenizer/tiktoken.model",
                                   k3 ? "data/kimi-tokenizer/tokenizer_config.k3.json"
                                      : "data/kimi-tokenizer/tokenizer_config.k2.json",
                                   &err) ||
        lunar_vocab_build(&e->voc, e->tok, &err)) {
        lunar_test_fail(__FILE__, __LINE__, "setup: %s", err.msg);
        return -1;
    }
    e->closing = gu_closing_mask(e->tok, lunar_vocab_size(e->voc));
    return 0;
}

/* ---- parser events ---- */
typedef struct {
    lunar_sbuf content, reasoning, finish;
    lunar_sbuf raw; /* the bytes of every token (control tokens as nothing) */
    int n_calls;
    char names[16][64];
    lunar_sbuf args[16];
} collect;

static void on_ev(void *ctx, const lunar_chat_event *ev) {
    collect *c = ctx;
    switch (ev->kind) {
    case LUNAR_CHAT_EV_CONTENT: lunar_sbuf_put(&c->content, ev->text, ev->len); break;
    case LUNAR_CHAT_EV_REASONING: lunar_sbuf_put(&c->reasoning, ev->text, ev->len); break;
    case LUNAR_CHAT_EV_TOOL_CALL_START:
        if (c->n_calls < 16) snprintf(c->names[c->n_calls], 64, "%s", ev->name);
        c->n_calls++;
        break;
    case LUNAR_CHAT_EV_TOOL_CALL_ARGS:
        if (ev->index >= 0 && ev->index < 16) lunar_sbuf_put(&c->args[ev->index], ev->text, ev->len);
        break;
    case LUNAR_CHAT_EV_FINISH: lunar_sbuf_put(&c->finish, ev->text, ev->len); break;
    default: break;
    }
}

static void collect_free(collect *c) {
    lunar_sbuf_free(&c->content), lunar_sbuf_free(&c->reasoning), lunar_sbuf_free(&c->finish), lunar_sbuf_free(&c->raw);
    for (int i = 0; i < 16; i++) lunar_sbuf_free(&c->args[i]);
}

static void fixed_rand(void *ctx, unsigned char *buf, size_t n) {
    (void)ctx;
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(i * 29 + 3);
}

/* Random walk: a control token whenever one is allowed (p 0.8), else as gu_sample (closing bias). The
 * tokens go to the format's parser; *done: the matcher finished. */
static int walk(const fmt_env *e, const lunar_grammar *g, int k3, int thinking, uint64_t seed, int max_tokens,
                collect *c, int *n_tok) {
    memset(c, 0, sizeof *c);
    lunar_k2_parser *p2 = k3 ? NULL : lunar_k2_parser_new(thinking, on_ev, c);
    lunar_k3_parser *p3 = k3 ? lunar_k3_parser_new(thinking, on_ev, c, fixed_rand, NULL) : NULL;
    lunar_matcher *m = lunar_matcher_new(g);
    int32_t V = lunar_vocab_size(e->voc), R = lunar_tokenizer_num_ranks(e->tok);
    int words = (V + 31) / 32, dead = 0;
    uint32_t *mask = malloc((size_t)words * 4);
    uint64_t st = seed * 0x9E3779B1ull + 7;
    *n_tok = 0;
    while (*n_tok < max_tokens && !lunar_matcher_is_done(m)) {
        lunar_matcher_fill_mask(m, mask);
        uint64_t na = 0, nc = 0, ns = 0;
        for (int w = 0; w < words; w++) {
            na += (uint64_t)__builtin_popcount(mask[w]);
            nc += (uint64_t)__builtin_popcount(mask[w] & e->closing[w]);
            if (w * 32 + 31 >= R) {
                uint32_t sp = mask[w];
                if (w * 32 < R) sp &= ~0u << (R - w * 32);
                ns += (uint64_t)__builtin_popcount(sp);
            }
        }
        if (!na) {
            dead = 1;
            break;
        }
        int32_t pick = -1;
        if (ns && gu_rng(&st) % 10 < 8) {
            uint64_t k = gu_rng(&st) % ns;
            for (int32_t id = R; id < V && pick < 0; id++)
                if (mask[id >> 5] >> (id & 31) & 1 && k-- == 0) pick = id;
        } else if (nc && gu_rng(&st) % 2) {
            pick = gu_kth(mask, e->closing, words, gu_rng(&st) % nc);
        } else {
            pick = gu_kth(mask, NULL, words, gu_rng(&st) % na);
        }
        if (lunar_matcher_accept(m, pick)) {
            dead = 1;
            break;
        }
        (*n_tok)++;
        size_t len = 0;
        const char *b = lunar_token_bytes(e->tok, pick, &len);
        int id = pick >= R ? pick : -2;
        if (id == -2 && b) lunar_sbuf_put(&c->raw, b, len);
        if (k3) lunar_k3_parser_feed(p3, id, b ? b : "", b ? len : 0);
        else lunar_k2_parser_feed(p2, id, b ? b : "", b ? len : 0);
    }
    int done = lunar_matcher_is_done(m);
    if (k3) lunar_k3_parser_finish(p3, !done), lunar_k3_parser_free(p3);
    else lunar_k2_parser_finish(p2, !done), lunar_k2_parser_free(p2);
    lunar_matcher_free(m);
    free(mask);
    return dead ? -1 : done;
}

static void prompt_init(lunar_chat_prompt *p, int thinking) {
    memset(p, 0, sizeof *p);
    p->thinking = thinking;
    p->tools = json_array();
}

static json_t *strict_tool(const char *name, json_t *params) {
    return json_pack("{s:s, s:{s:s, s:o, s:b}}", "type", "function", "function", "name", name, "parameters", params,
                     "strict", 1);
}

/* The case whose minLength (999999999999) no output can reach: refused when compiled. */
static int unreachable_case(const char *name) { return !strcmp(name, "RangeConstraints:3"); }

TEST(constrain_schema_cases_both_formats) {
    fmt_env *envs[2];
    if (env(0, &envs[0]) || env(1, &envs[1])) return;
    json_t **sc;
    char **names;
    int n = gu_load_cases(&sc, &names);
    CHECK(n == 91);
    FILE *out = fopen("/tmp/lunar_constrain_samples.jsonl", "w");
    int runs = 0, finished = 0, k3_tagged = 0;
    for (int k3 = 0; k3 < 2; k3++)
        for (int i = 0; i < n; i++)
            for (int w = 0; w < 2; w++) {
                lunar_chat_prompt p;
                prompt_init(&p, k3);
                json_t *wrapped = NULL;
                if (w == 0) {
                    p.response_format = LUNAR_RESPONSE_JSON_SCHEMA;
                    p.response_schema = json_incref(sc[i]);
                } else {
                    wrapped = lunar_json_schema_tool_value(sc[i]);
                    json_array_append_new(p.tools, strict_tool("kvv_walle_case", json_incref(wrapped)));
                    p.tool_choice = LUNAR_TOOL_CHOICE_REQUIRED;
                }
                lunar_grammar *g = NULL;
                lunar_err err = {{0}};
                int brc = lunar_constrain_build(envs[k3]->voc, k3 ? LUNAR_ARCH_KIMI_K3 : LUNAR_ARCH_KIMI_LINEAR, &p, &g,
                                                &err);
                if (unreachable_case(names[i])) { /* refused: no context holds its shortest output (a 400) */
                    CHECK_MSG(brc == -1 && strstr(err.msg, "minLength 999999999999"), "%s: rc %d '%s'", names[i], brc,
                              err.msg);
                    lunar_grammar_free(g);
                    json_decref(wrapped);
                    lunar_chat_prompt_free(&p);
                    continue;
                }
                if (brc || !g) {
                    CHECK_MSG(0, "%s k3 %d wrap %d: %s", names[i], k3, w, err.msg);
                    json_decref(wrapped);
                    lunar_chat_prompt_free(&p);
                    continue;
                }
                collect c;
                int nt;
                int rc = walk(envs[k3], g, k3, k3, (uint64_t)(i * 4 + w * 2 + k3), 2048, &c, &nt);
                runs++;
                CHECK_MSG(rc >= 0, "%s k3 %d wrap %d: dead end", names[i], k3, w);
                if (rc == 1) {
                    finished++;
                    json_error_t je;
                    if (w == 0) {
                        json_t *v = json_loadb(c.content.p ? c.content.p : "", c.content.len, JSON_DECODE_ANY, &je);
                        CHECK_MSG(v != NULL, "%s k3 %d: content not JSON (%s): %.200s", names[i], k3, je.text,
                                  c.content.p ? c.content.p : "");
                        CHECK_MSG(c.n_calls == 0 && !strcmp(c.finish.p, "stop"), "%s k3 %d: calls %d finish %s", names[i],
                                  k3, c.n_calls, c.finish.p);
                        json_decref(v);
                    } else {
                        CHECK_MSG(c.n_calls >= 1 && !strcmp(c.finish.p, "tool_calls"), "%s k3 %d: calls %d finish %s",
                                  names[i], k3, c.n_calls, c.finish.p);
                        /* K3: typed argument tags (a json block only where the schema has no such form) */
                        if (k3) k3_tagged += c.raw.p && strstr(c.raw.p, "argument key=\"value\" type=\"") != NULL;
                        for (int k = 0; k < c.n_calls && k < 16; k++) {
                            CHECK(!strcmp(c.names[k], "kvv_walle_case"));
                            json_t *v = json_loadb(c.args[k].p ? c.args[k].p : "", c.args[k].len, 0, &je);
                            CHECK_MSG(json_is_object(v) && json_object_size(v) == 1 && json_object_get(v, "value"),
                                      "%s k3 %d: arguments %.200s", names[i], k3, c.args[k].p ? c.args[k].p : "");
                            json_decref(v);
                        }
                    }
                    if (out) {
                        json_t *rec = json_pack("{s:s, s:i, s:i, s:O}", "case", names[i], "k3", k3, "wrap", w, "schema",
                                                w ? wrapped : sc[i]);
                        json_t *txt = w ? json_stringn(c.args[0].p ? c.args[0].p : "", c.args[0].len)
                                        : json_stringn(c.content.p ? c.content.p : "", c.content.len);
                        json_object_set_new(rec, "text", txt ? txt : json_string(""));
                        char *line = json_dumps(rec, JSON_COMPACT);
                        if (line) fprintf(out, "%s\n", line);
                        free(line);
                        json_decref(rec);
                    }
                } else {
                    CHECK_MSG(0, "%s k3 %d wrap %d: not done after %d tokens", names[i], k3, w, nt);
                }
                collect_free(&c);
                lunar_grammar_free(g);
                json_decref(wrapped);
                lunar_chat_prompt_free(&p);
            }
    if (out) fclose(out);
    CHECK(runs == 4 * (n - 1)); /* RangeConstraints:3 refused in both formats and wrappings */
    CHECK(finished == runs);
    fprintf(stderr, " [K3 strict tools: %d of %d as typed argument tags]", k3_tagged, n - 1);
    CHECK(k3_tagged * 10 >= (n - 1) * 8); /* the rest: string patterns, which keep the json block */
    for (int i = 0; i < n; i++) json_decref(sc[i]), free(names[i]);
    free(sc), free(names);
}

/* json_object, named, none, auto (strict and not), text: in both formats, thinking on and off (K3) */
TEST(constrain_tool_choice_and_modes) {
    fmt_env *envs[2];
    if (env(0, &envs[0]) || env(1, &envs[1])) return;
    json_t *pa = json_loads("{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":8}},"
                            "\"required\":[\"city\"],\"additionalProperties\":false}", 0, NULL);
    for (int k3 = 0; k3 < 2; k3++)
        for (int th = 0; th <= k3; th++)
            for (int mode = 0; mode < 6; mode++) {
                lunar_chat_prompt p;
                prompt_init(&p, th);
                json_array_append_new(p.tools, strict_tool("get_weather", json_incref(pa)));
                json_array_append_new(p.tools, json_pack("{s:s, s:{s:s}}", "type", "function", "function", "name", "other"));
                const char *what = "";
                switch (mode) {
                case 0: what = "json_object"; p.response_format = LUNAR_RESPONSE_JSON_OBJECT; p.tool_choice = LUNAR_TOOL_CHOICE_NONE; break;
                case 1: what = "named"; p.tool_choice = LUNAR_TOOL_CHOICE_NAMED; p.tool_choice_name = strdup("other"); break;
                case 2: what = "none"; p.tool_choice = LUNAR_TOOL_CHOICE_NONE; break;
                case 3: what = "auto strict"; break;
                case 4: what = "auto not strict"; json_array_remove(p.tools, 0); break;
                case 5: what = "text, no tools"; json_array_clear(p.tools); break;
                }
                lunar_grammar *g = NULL;
                lunar_err err = {{0}};
                int rc = lunar_constrain_build(envs[k3]->voc, k3 ? LUNAR_ARCH_KIMI_K3 : LUNAR_ARCH_KIMI_LINEAR, &p, &g, &err);
                CHECK_MSG(rc == 0, "%s: %s", what, err.msg);
                if (mode >= 4) {
                    CHECK_MSG(g == NULL, "%s: unconstrained", what);
                    lunar_chat_prompt_free(&p);
                    continue;
                }
                CHECK_MSG(g != NULL, "%s k3 %d: a grammar", what, k3);
                if (!g) {
                    lunar_chat_prompt_free(&p);
                    continue;
                }
                for (int seed = 0; seed < 6; seed++) {
                    collect c;
                    int nt;
                    int done = walk(envs[k3], g, k3, th, (uint64_t)(seed * 31 + mode * 7 + k3 * 3 + th), 4096, &c, &nt);
                    CHECK_MSG(done == 1, "%s k3 %d th %d seed %d: done %d after %d tokens", what, k3, th, seed, done, nt);
                    if (mode == 0) {
                        json_t *v = json_loadb(c.content.p ? c.content.p : "", c.content.len, 0, NULL);
                        CHECK_MSG(json_is_object(v) && c.n_calls == 0, "%s: %.100s", what, c.content.p ? c.content.p : "");
                        json_decref(v);
                    } else if (mode == 1) {
                        CHECK_MSG(c.n_calls >= 1, "%s k3 %d: no call", what, k3);
                        for (int k = 0; k < c.n_calls && k < 16; k++) {
                            CHECK(!strcmp(c.names[k], "other"));
                            json_t *v = json_loadb(c.args[k].p ? c.args[k].p : "", c.args[k].len, 0, NULL);
                            CHECK(json_is_object(v));
                            json_decref(v);
                        }
                    } else if (mode == 2) {
                        CHECK_MSG(c.n_calls == 0 && !strcmp(c.finish.p, "stop"), "%s k3 %d: %d calls", what, k3, c.n_calls);
                    } else {
                        for (int k = 0; k < c.n_calls && k < 16; k++) {
                            json_t *v = json_loadb(c.args[k].p ? c.args[k].p : "", c.args[k].len, 0, NULL);
                            CHECK(json_is_object(v));
                            if (!strcmp(c.names[k], "get_weather"))
                                CHECK_MSG(json_object_size(v) == 1 && json_is_string(json_object_get(v, "city")),
                                          "%s: %.100s", what, c.args[k].p);
                            else CHECK(!strcmp(c.names[k], "other"));
                            json_decref(v);
                        }
                    }
                    collect_free(&c);
                }
                lunar_grammar_free(g);
                lunar_chat_prompt_free(&p);
            }
    json_decref(pa);
}

TEST(constrain_cache) {
    fmt_env *e;
    if (env(1, &e)) return;
    lunar_constrain *c;
    lunar_err err = {{0}};
    CHECK(lunar_constrain_new(&c, e->tok, LUNAR_ARCH_KIMI_K3, &err) == 0);
    if (!c) return;
    lunar_chat_prompt p;
    prompt_init(&p, 1);
    const lunar_grammar *g1 = NULL, *g2 = NULL, *g3 = NULL;
    CHECK(lunar_constrain_get(c, &p, &g1, &err) == 0 && g1 == NULL); /* plain text: nothing */
    p.response_format = LUNAR_RESPONSE_JSON_OBJECT;
    CHECK(lunar_constrain_get(c, &p, &g1, &err) == 0 && g1);
    CHECK(lunar_constrain_get(c, &p, &g2, &err) == 0 && g2 == g1);
    p.thinking = 0;
    CHECK(lunar_constrain_get(c, &p, &g3, &err) == 0 && g3 && g3 != g1);
    p.response_format = LUNAR_RESPONSE_JSON_SCHEMA;
    p.response_schema = json_loads("{\"type\":\"nosuchtype\"}", 0, NULL);
    CHECK(lunar_constrain_get(c, &p, &g3, &err) == -1);
    CHECK(strstr(err.msg, "resp") != NULL);
    CHECK(lunar_constrain_cached(c) == 2);
    lunar_chat_prompt_free(&p);
    lunar_constrain_free(c);
}
