/* The end-to-end grammar test: the bundled random-weight model, sampled at temperature 1
 * through the engine, constrained by every schema case (as given, and wrapped as a strict tool's
 * parameters, SPEC 6) and by json_object mode, with max_tokens 2048. Every output that finishes
 * must be a complete value (a fresh matcher replaying its tokens needs nothing more) and parse as
 * JSON; the outputs go to build/model_grammar_samples.jsonl, which tests/server/test_grammar_samples.py
 * validates with Python jsonschema (Draft 2020-12).
 * A random model wanders inside free strings: the token budget (lunar_matcher_fill_mask_budget)
 * closes such outputs before max_tokens, and they finish as "length". Every output must finish; the
 * one case no output can satisfy (minLength 999999999999) must be refused when compiled. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar.h"
#include "grammar_util.h"
#include "lunar.h"
#include "test.h"

#define MODEL "models/kimi-linear-tiny"
#define IM_END 163586 /* <|im_end|>: the K2 end of turn, the model's eos */

typedef struct job {
    pthread_mutex_t *mu;
    pthread_cond_t *cv;
    int *done;
    int32_t *toks;
    int n;
    lunar_finish_reason finish;
} job;

static void on_ev(void *u, const lunar_event *ev) {
    job *j = u;
    pthread_mutex_lock(j->mu);
    if (ev->has_token && j->n < 2048) j->toks[j->n++] = ev->token;
    if (ev->finish) {
        j->finish = ev->finish;
        (*j->done)++;
        pthread_cond_broadcast(j->cv);
    }
    pthread_mutex_unlock(j->mu);
}

TEST(engine_grammar_every_schema_on_the_random_model) {
#if defined(__SANITIZE_ADDRESS__)
    /* ~8 CPU-minutes of sampling in the plain build; the engine and grammar code it runs are
     * covered under the sanitizers by the faster engine and grammar tests */
    fprintf(stderr, " [skipped under sanitizers]");
    return;
#endif
    lunar_err err = {{0}};
    lunar_tokenizer *tok = NULL;
    lunar_vocab *voc = NULL;
    if (lunar_tokenizer_load(&tok, MODEL, &err) || lunar_vocab_build(&voc, tok, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        lunar_tokenizer_free(tok);
        return;
    }
    json_t **sc;
    char **names;
    const int n_cases = gu_load_cases(&sc, &names);
    CHECK(n_cases == 91);
    const int n = 2 * n_cases + 1; /* as given, wrapped; + json_object */
    lunar_grammar **g = lunar_xcalloc((size_t)n, sizeof *g);
    int32_t end = IM_END;
    int n_refused = 0;
    for (int i = 0; i < n; i++) {
        json_t *s = i == n - 1 ? NULL : i % 2 ? lunar_json_schema_tool_value(sc[i / 2]) : json_incref(sc[i / 2]);
        int rc = lunar_grammar_from_json_schema(&g[i], voc, s, &end, 1, &err);
        json_decref(s);
        if (i < n - 1 && !strcmp(names[i / 2], "RangeConstraints:3")) {
            CHECK_MSG(rc == -1 && strstr(err.msg, "minLength 999999999999"), "%s: rc %d '%s'", names[i / 2], rc, err.msg);
            n_refused += rc == -1;
            continue;
        }
        CHECK_MSG(rc == 0, "%s: %s", i == n - 1 ? "json_object" : names[i / 2], err.msg);
    }
    CHECK(n_refused == 2);
    lunar_engine_options o;
    lunar_engine_options_default(&o);
    o.model_dir = MODEL;
    o.max_num_seqs = 64;
    o.max_num_batched_tokens = 4096;
    o.max_model_len = 2100;
    lunar_engine *e;
    if (lunar_engine_create(&e, &o, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    int done = 0;
    job *jobs = lunar_xcalloc((size_t)n, sizeof *jobs);
    lunar_ids prompt = {0};
    const char *text = "Answer with JSON only.";
    CHECK(lunar_tokenize(tok, text, strlen(text), false, &prompt, &err) == 0);
    int n_sub = 0;
    for (int i = 0; i < n; i++) {
        jobs[i] = (job){&mu, &cv, &done, lunar_xmalloc(2048 * sizeof(int32_t)), 0, 0};
        if (!g[i]) continue;
        n_sub++;
        lunar_request r = {.prompt = prompt.ids, .n_prompt = (int)prompt.n, .grammar = g[i], .on_event = on_ev,
                           .user = &jobs[i]};
        lunar_sampling_params_default(&r.sampling);
        r.sampling.temperature = 1.0f, r.sampling.max_tokens = 2048, r.sampling.has_seed = 1, r.sampling.seed = (uint64_t)i;
        CHECK_MSG(lunar_engine_submit(e, &r, NULL, &err) == 0, "%s", err.msg);
    }
    pthread_mutex_lock(&mu);
    while (done < n_sub) pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);

    FILE *out = fopen("build/model_grammar_samples.jsonl", "w");
    int finished = 0, by_budget = 0;
    for (int i = 0; i < n; i++) {
        job *j = &jobs[i];
        const char *name = i == n - 1 ? "json_object" : names[i / 2];
        if (!g[i]) continue;
        /* the engine stops when the value is complete: the end token is sampled, or the grammar
         * allows nothing else (then the request ends without it); the budget closes the rest in time */
        CHECK_MSG((j->finish == LUNAR_FINISH_STOP || j->finish == LUNAR_FINISH_LENGTH) && j->n > 0 && j->n <= 2048,
                  "%s: finish %d after %d tokens", name, j->finish, j->n);
        by_budget += j->finish == LUNAR_FINISH_LENGTH;
        lunar_matcher *m = lunar_matcher_new(g[i]);
        int ok = 1;
        for (int k = 0; k < j->n && ok; k++) ok = lunar_matcher_accept(m, j->toks[k]) == 0;
        CHECK_MSG(ok && lunar_matcher_tokens_to_finish(m) == 0, "%s: not a complete value after %d tokens", name, j->n);
        lunar_matcher_free(m);
        const int body = j->n > 0 && j->toks[j->n - 1] == IM_END ? j->n - 1 : j->n;
        size_t len;
        char *s = lunar_detokenize(tok, j->toks, (size_t)body, false, &len);
        json_error_t je;
        json_t *v = json_loadb(s, len, JSON_DECODE_ANY, &je); /* schema cases may be scalars */
        CHECK_MSG(v != NULL, "%s: not JSON: %.200s", name, s);
        finished++;
        if (out && v) {
            json_t *rec = json_pack("{s:s, s:b, s:O, s:s}", "case", name, "wrapped", i % 2 == 1 && i != n - 1,
                                    "schema", i == n - 1 ? json_null() : sc[i / 2], "output", s);
            char *line = json_dumps(rec, JSON_COMPACT);
            fprintf(out, "%s\n", line);
            free(line);
            json_decref(rec);
        }
        json_decref(v);
        free(s);
    }
    if (out) fclose(out);
    fprintf(stderr, " [%d of %d finished within 2048 tokens, %d closed by the budget; %d refused]", finished, n_sub,
            by_budget, n_refused);
    CHECK_MSG(finished == n_sub && n_sub == n - 2, "%d of %d constrained outputs finished", finished, n_sub);
    lunar_engine_destroy(e);
    for (int i = 0; i < n; i++) lunar_grammar_free(g[i]), free(jobs[i].toks);
    for (int i = 0; i < n_cases; i++) json_decref(sc[i]), free(names[i]);
    free(sc), free(names), free(g), free(jobs);
    lunar_ids_free(&prompt);
    lunar_vocab_free(voc);
    lunar_tokenizer_free(tok);
}

/* The budget through the engine, fast: tiny max_tokens (2..7) under constraints the random model cannot
 * finish by itself so soon (a free string, a list of integers, an object with a required free string).
 * Every output must be a complete value within max_tokens; an output the budget shaped ends as LENGTH
 * (some must: at max_tokens 2 a string only closes in time because the budget forces its quote). */
TEST(engine_budget_closes_constrained_outputs) {
    lunar_err err = {{0}};
    lunar_tokenizer *tok = NULL;
    lunar_vocab *voc = NULL;
    if (lunar_tokenizer_load(&tok, MODEL, &err) || lunar_vocab_build(&voc, tok, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        lunar_tokenizer_free(tok);
        return;
    }
    static const char *schemas[] = {"{\"type\":\"string\"}", "{\"type\":\"array\",\"items\":{\"type\":\"integer\"}}",
                                    "{\"type\":\"object\",\"properties\":{\"k\":{\"type\":\"string\"}},\"required\":[\"k\"],"
                                    "\"additionalProperties\":false}"};
    enum { NS = 3, NM = 4, NJ = NS * NM * 2 };
    lunar_grammar *g[NS] = {0};
    int32_t end = IM_END;
    for (int s = 0; s < NS; s++) {
        json_t *j = json_loads(schemas[s], 0, NULL);
        CHECK(lunar_grammar_from_json_schema(&g[s], voc, j, &end, 1, &err) == 0);
        json_decref(j);
    }
    lunar_engine_options o;
    lunar_engine_options_default(&o);
    o.model_dir = MODEL;
    o.max_num_seqs = 32;
    o.max_model_len = 256;
    lunar_engine *e = NULL;
    if (!g[0] || !g[1] || !g[2] || lunar_engine_create(&e, &o, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        for (int s = 0; s < NS; s++) lunar_grammar_free(g[s]);
        lunar_vocab_free(voc);
        lunar_tokenizer_free(tok);
        return;
    }
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    int done = 0;
    job jobs[NJ];
    int max_tok[NJ], which[NJ];
    lunar_ids prompt = {0};
    CHECK(lunar_tokenize(tok, "JSON:", 5, false, &prompt, &err) == 0);
    for (int i = 0; i < NJ; i++) {
        which[i] = i % NS;
        int64_t shortest = lunar_grammar_min_tokens(g[which[i]]);
        max_tok[i] = (int)shortest + (i / NS) % NM; /* from exactly the shortest output up */
        jobs[i] = (job){&mu, &cv, &done, lunar_xmalloc(2048 * sizeof(int32_t)), 0, 0};
        lunar_request r = {.prompt = prompt.ids, .n_prompt = (int)prompt.n, .grammar = g[which[i]], .on_event = on_ev,
                           .user = &jobs[i]};
        lunar_sampling_params_default(&r.sampling);
        r.sampling.temperature = 1.0f, r.sampling.max_tokens = max_tok[i], r.sampling.has_seed = 1;
        r.sampling.seed = (uint64_t)(1000 + i);
        CHECK_MSG(lunar_engine_submit(e, &r, NULL, &err) == 0, "%s", err.msg);
    }
    pthread_mutex_lock(&mu);
    while (done < NJ) pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    int by_budget = 0;
    for (int i = 0; i < NJ; i++) {
        job *j = &jobs[i];
        CHECK_MSG((j->finish == LUNAR_FINISH_STOP || j->finish == LUNAR_FINISH_LENGTH) && j->n <= max_tok[i],
                  "%s max %d: finish %d after %d tokens", schemas[which[i]], max_tok[i], j->finish, j->n);
        by_budget += j->finish == LUNAR_FINISH_LENGTH;
        lunar_matcher *m = lunar_matcher_new(g[which[i]]);
        int ok = 1;
        for (int k = 0; k < j->n && ok; k++) ok = lunar_matcher_accept(m, j->toks[k]) == 0;
        CHECK_MSG(ok && lunar_matcher_tokens_to_finish(m) == 0, "%s max %d: incomplete after %d tokens",
                  schemas[which[i]], max_tok[i], j->n);
        lunar_matcher_free(m);
        free(j->toks);
    }
    fprintf(stderr, " [%d of %d closed by the budget]", by_budget, NJ);
    CHECK(by_budget > 0);
    lunar_engine_destroy(e);
    for (int s = 0; s < NS; s++) lunar_grammar_free(g[s]);
    lunar_ids_free(&prompt);
    lunar_vocab_free(voc);
    lunar_tokenizer_free(tok);
}
