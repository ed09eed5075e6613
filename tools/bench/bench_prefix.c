/* Prefix-cache benchmark on a multi-turn workload: C conversations of T turns; each turn's prompt
 * is the previous turn's prompt and answer plus U new user tokens. Runs the workload with the
 * prefix cache on and off and prints the hit rate and the mean time to first token per turn.
 *   build/bench_prefix MODEL_DIR [conversations turns user_tokens answer_tokens] */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lunar.h"
#include "model/model.h"

typedef struct wait {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, n;
    double t_first;
    int32_t toks[4096];
} wait_t;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static void on_ev(void *u, const lunar_event *ev) {
    wait_t *w = u;
    pthread_mutex_lock(&w->mu);
    if (ev->has_token) {
        if (!w->n) w->t_first = now();
        w->toks[w->n++] = ev->token;
    }
    if (ev->finish) w->done = 1, pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static double run(const char *dir, int prefix, int C, int T, int U, int A, lunar_engine_metrics *mt) {
    lunar_engine_options o;
    lunar_engine_options_default(&o);
    o.model_dir = dir;
    o.enable_prefix_caching = prefix;
    o.max_num_seqs = 1;
    o.max_model_len = 4096;
    lunar_engine *e;
    lunar_err err;
    if (lunar_engine_create(&e, &o, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        exit(1);
    }
    const int V = lunar_engine_model(e)->cfg.vocab_size;
    double ttft = 0;
    unsigned seed = 1;
    for (int c = 0; c < C; c++) {
        int32_t *conv = malloc(sizeof(int32_t) * 4096);
        int n = 0;
        for (int t = 0; t < T && n + U + A < 4096; t++) {
            for (int i = 0; i < U; i++) seed = seed * 1103515245u + 12345u, conv[n++] = (int32_t)((seed >> 8) % (unsigned)(V < 100000 ? V : 100000));
            wait_t w = {.done = 0};
            pthread_mutex_init(&w.mu, NULL);
            pthread_cond_init(&w.cv, NULL);
            lunar_request r = {.prompt = conv, .n_prompt = n, .on_event = on_ev, .user = &w};
            lunar_sampling_params_default(&r.sampling);
            r.sampling.temperature = 0, r.sampling.max_tokens = A, r.sampling.ignore_eos = 1;
            double t0 = now();
            if (lunar_engine_submit(e, &r, NULL, &err)) {
                fprintf(stderr, "%s\n", err.msg);
                exit(1);
            }
            pthread_mutex_lock(&w.mu);
            while (!w.done) pthread_cond_wait(&w.cv, &w.mu);
            pthread_mutex_unlock(&w.mu);
            ttft += w.t_first - t0;
            memcpy(conv + n, w.toks, sizeof(int32_t) * w.n);
            n += w.n;
        }
        free(conv);
    }
    lunar_engine_metrics_get(e, mt);
    lunar_engine_destroy(e);
    return ttft / (C * T);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL_DIR [conversations turns user_tokens answer_tokens]\n", argv[0]);
        return 2;
    }
    int C = argc > 2 ? atoi(argv[2]) : 4, T = argc > 3 ? atoi(argv[3]) : 6, U = argc > 4 ? atoi(argv[4]) : 300,
        A = argc > 5 ? atoi(argv[5]) : 32;
    lunar_engine_metrics on, off;
    double t_on = run(argv[1], 1, C, T, U, A, &on), t_off = run(argv[1], 0, C, T, U, A, &off);
    printf("workload: %d conversations x %d turns, +%d user tokens and %d answer tokens per turn\n", C, T, U, A);
    printf("prefix cache on : hit rate %.1f %% of prompt tokens, mean TTFT %.2f ms\n",
           100.0 * on.prefix_cache_hits / (on.prefix_cache_queries ? on.prefix_cache_queries : 1), 1e3 * t_on);
    printf("prefix cache off: mean TTFT %.2f ms\n", 1e3 * t_off);
    printf("TTFT saving: %.1f %%\n", 100.0 * (1 - t_on / t_off));
    return 0;
}
