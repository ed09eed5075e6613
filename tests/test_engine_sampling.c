/* Sampling through the engine: seeded reproducibility, max_tokens / stop tokens / stop strings,
 * logprobs, logit bias, penalties; and request validation errors. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "lunar.h"
#include "model/model.h"
#include "text/tokenizer.h"
#include "test.h"

typedef struct run {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    int32_t toks[256];
    int n;
    float lp[256];
    int n_top;
    int32_t top[LUNAR_MAX_TOP_LOGPROBS];
    float top_lp[LUNAR_MAX_TOP_LOGPROBS];
    lunar_finish_reason finish;
    char stop[64];
} run;

static void on_ev(void *u, const lunar_event *ev) {
    run *r = u;
    pthread_mutex_lock(&r->mu);
    if (ev->has_token && r->n < 256) {
        r->lp[r->n] = ev->logprob;
        r->toks[r->n++] = ev->token;
        r->n_top = ev->n_top;
        memcpy(r->top, ev->top_ids, sizeof r->top);
        memcpy(r->top_lp, ev->top_logprobs, sizeof r->top_lp);
    }
    if (ev->finish) {
        r->finish = ev->finish;
        if (ev->stop_string) snprintf(r->stop, sizeof r->stop, "%s", ev->stop_string);
        r->done = 1;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
}

/* Runs one request to completion; returns 0 or -1 when submit refused it (err filled). */
static int go(lunar_engine *e, const int32_t *prompt, int n, const lunar_sampling_params *sp, run *r,
              lunar_err *err) {
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    lunar_request q = {.prompt = prompt, .n_prompt = n, .sampling = *sp, .on_event = on_ev, .user = r};
    if (lunar_engine_submit(e, &q, NULL, err)) return -1;
    pthread_mutex_lock(&r->mu);
    while (!r->done) pthread_cond_wait(&r->cv, &r->mu);
    pthread_mutex_unlock(&r->mu);
    return 0;
}

static lunar_engine *open_engine(const char *dir) {
    lunar_engine_options o;
    lunar_engine_options_default(&o);
    o.model_dir = dir;
    o.max_num_seqs = 4;
    o.max_model_len = 512;
    o.cache_memory_bytes = 64 << 20;
    lunar_engine *e = NULL;
    lunar_err err;
    CHECK_MSG(lunar_engine_create(&e, &o, &err) == 0, "%s", err.msg);
    return e;
}

static const int32_t prompt[] = {5, 17, 42, 99, 123, 7, 8, 250, 31, 64, 2, 77};
#define NP ((int)(sizeof prompt / sizeof prompt[0]))

TEST(engine_seeded_sampling_is_reproducible) {
    lunar_engine *e = open_engine("tests/golden/tiny-a");
    if (!e) return;
    lunar_sampling_params sp;
    lunar_sampling_params_default(&sp);
    sp.temperature = 1.0f, sp.top_p = 0.9f, sp.top_k = 50, sp.max_tokens = 40, sp.has_seed = 1, sp.seed = 7;
    sp.ignore_eos = 1;
    run a, b, c;
    lunar_err err;
    CHECK(go(e, prompt, NP, &sp, &a, &err) == 0 && go(e, prompt, NP, &sp, &b, &err) == 0);
    sp.seed = 8;
    CHECK(go(e, prompt, NP, &sp, &c, &err) == 0);
    CHECK(a.n == 40 && b.n == 40 && a.finish == LUNAR_FINISH_LENGTH);
    CHECK(memcmp(a.toks, b.toks, sizeof(int32_t) * 40) == 0);
    CHECK(memcmp(a.toks, c.toks, sizeof(int32_t) * 40) != 0);
    lunar_engine_destroy(e);
}

TEST(engine_logprobs_bias_penalties_stop_tokens) {
    lunar_engine *e = open_engine("tests/golden/tiny-a");
    if (!e) return;
    lunar_err err;
    lunar_sampling_params sp;
    lunar_sampling_params_default(&sp);
    sp.temperature = 0, sp.max_tokens = 12, sp.logprobs = 1, sp.top_logprobs = 5, sp.ignore_eos = 1;
    run g;
    CHECK(go(e, prompt, NP, &sp, &g, &err) == 0);
    /* greedy: the chosen token is the most likely, and top logprobs are sorted and normalised */
    CHECK(g.n_top == 5 && g.top[0] == g.toks[g.n - 1]);
    CHECK_NEAR(g.top_lp[0], g.lp[g.n - 1], 1e-6);
    for (int k = 1; k < 5; k++) CHECK(g.top_lp[k] <= g.top_lp[k - 1]);
    CHECK(g.top_lp[0] <= 0);

    /* a +100 bias forces a token; a stop token ends the request with STOP on that token */
    int32_t forced = 3, stop_id = 3;
    float bias = 100;
    sp.logit_bias_ids = &forced, sp.logit_bias_values = &bias, sp.n_logit_bias = 1;
    run b;
    CHECK(go(e, prompt, NP, &sp, &b, &err) == 0);
    CHECK(b.n == 12);
    for (int i = 0; i < b.n; i++) CHECK(b.toks[i] == forced);
    sp.stop_token_ids = &stop_id, sp.n_stop_token_ids = 1;
    run s;
    CHECK(go(e, prompt, NP, &sp, &s, &err) == 0);
    CHECK(s.n == 1 && s.finish == LUNAR_FINISH_STOP);
    sp.min_tokens = 4; /* ...but not before min_tokens */
    CHECK(go(e, prompt, NP, &sp, &s, &err) == 0);
    CHECK(s.n >= 5 && s.toks[s.n - 1] == stop_id && s.finish == LUNAR_FINISH_STOP);

    /* a strong frequency penalty forbids repeating the greedy path's tokens */
    lunar_sampling_params_default(&sp);
    sp.temperature = 0, sp.max_tokens = 30, sp.frequency_penalty = 2.0f, sp.presence_penalty = 2.0f,
    sp.ignore_eos = 1;
    run p;
    CHECK(go(e, prompt, NP, &sp, &p, &err) == 0);
    int repeats = 0;
    for (int i = 0; i < p.n; i++)
        for (int j = 0; j < i; j++) repeats += p.toks[i] == p.toks[j];
    run q;
    sp.frequency_penalty = 0, sp.presence_penalty = 0;
    CHECK(go(e, prompt, NP, &sp, &q, &err) == 0);
    int repeats0 = 0;
    for (int i = 0; i < q.n; i++)
        for (int j = 0; j < i; j++) repeats0 += q.toks[i] == q.toks[j];
    CHECK_MSG(repeats < repeats0 || repeats0 == 0, "repeats with penalty %d, without %d", repeats, repeats0);
    lunar_engine_destroy(e);
}

TEST(engine_rejects_bad_requests) {
    lunar_engine *e = open_engine("tests/golden/tiny-a");
    if (!e) return;
    lunar_err err;
    lunar_sampling_params sp;
    lunar_sampling_params_default(&sp);
    run r;
    int32_t bad[] = {1, 100000};
    CHECK(go(e, bad, 2, &sp, &r, &err) != 0 && strstr(err.msg, "vocabulary"));
    CHECK(go(e, prompt, 0, &sp, &r, &err) != 0 && strstr(err.msg, "empty"));
    sp.max_tokens = 600;
    CHECK(go(e, prompt, NP, &sp, &r, &err) != 0 && strstr(err.msg, "context length"));
    lunar_sampling_params_default(&sp);
    sp.top_p = 0;
    CHECK(go(e, prompt, NP, &sp, &r, &err) != 0 && strstr(err.msg, "top_p"));
    lunar_sampling_params_default(&sp);
    const char *stops[] = {"x"};
    sp.stop = stops, sp.n_stop = 1; /* tiny-a has no tokenizer */
    CHECK(go(e, prompt, NP, &sp, &r, &err) != 0 && strstr(err.msg, "tokenizer"));
    lunar_engine_destroy(e);
}

TEST(engine_stop_strings_on_the_bundled_model) {
    lunar_engine *e = open_engine("models/kimi-linear-tiny");
    if (!e) return;
    lunar_err err;
    lunar_sampling_params sp;
    lunar_sampling_params_default(&sp);
    sp.temperature = 0, sp.max_tokens = 24, sp.ignore_eos = 1;
    int32_t p[] = {19180, 11, 220, 4314};
    run a;
    CHECK(go(e, p, 4, &sp, &a, &err) == 0);
    CHECK(a.n == 24 && a.finish == LUNAR_FINISH_LENGTH);
    /* stop at the text of a generated token: the request ends there with STOP */
    char text[64];
    lunar_tokenizer *tok;
    CHECK(lunar_tokenizer_load(&tok, "models/kimi-linear-tiny", &err) == 0);
    int k = 2, found = 0;
    for (; k < a.n && !found; k++) { /* an ASCII token of 2+ bytes, so its bytes are whole text */
        size_t len;
        const char *piece = lunar_token_bytes(tok, a.toks[k], &len);
        found = len >= 2 && len < sizeof text;
        for (size_t i = 0; found && i < len; i++) found = (unsigned char)piece[i] > 0x20 && (unsigned char)piece[i] < 0x7f;
        if (found) memcpy(text, piece, len), text[len] = '\0';
    }
    CHECK_MSG(found, "no ASCII token among %d generated", a.n);
    if (found) {
        const char *stops[] = {text};
        sp.stop = stops, sp.n_stop = 1;
        run b;
        CHECK(go(e, p, 4, &sp, &b, &err) == 0);
        CHECK_MSG(b.finish == LUNAR_FINISH_STOP && b.n <= k && strcmp(b.stop, text) == 0,
                  "finish %d after %d tokens (stop at %d), stop '%s'", b.finish, b.n, k, b.stop);
    }
    lunar_tokenizer_free(tok);
    lunar_engine_destroy(e);
}
