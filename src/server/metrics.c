#include "server/metrics.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BUCKETS 24

typedef struct hist {
    const char *name, *help;
    const double *bounds;
    int nb;
    long long counts[MAX_BUCKETS + 1]; /* last: +Inf */
    double sum;
    long long n;
} hist;

static const double TIME_BOUNDS[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                     2.5,   5.0,   7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
static const double ITL_BOUNDS[] = {0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                                    0.075, 0.1,    0.15,  0.2,  0.3,   0.4,  0.5,   0.75, 1.0,  2.5};
static const double TOKEN_BOUNDS[] = {1,     2,     5,     10,    20,     50,     100,    200,   500,
                                      1000,  2000,  5000,  10000, 20000,  50000,  100000, 200000, 500000,
                                      1000000, 2000000};

enum { H_TTFT, H_ITL, H_TPOT, H_E2E, H_PROMPT, H_GEN, N_HIST };
enum { F_STOP, F_LENGTH, F_TOOL_CALLS, F_ABORT, F_ERROR, N_FINISH };
static const char *FINISH_NAMES[N_FINISH] = {"stop", "length", "tool_calls", "abort", "error"};

struct lunar_srv_metrics {
    pthread_mutex_t mu;
    char *model;
    hist h[N_HIST];
    long long finished[N_FINISH];
    long long prompt_tokens, generation_tokens;
    long long http[6]; /* 1xx..5xx by first digit; [0] other */
};

#define NB(a) ((int)(sizeof(a) / sizeof((a)[0])))

lunar_srv_metrics *lunar_srv_metrics_new(const char *model_name) {
    lunar_srv_metrics *m = lunar_xcalloc(1, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    m->model = strdup(model_name ? model_name : "");
    m->h[H_TTFT] = (hist){.name = "time_to_first_token_seconds", .help = "Time to first token.", .bounds = TIME_BOUNDS, .nb = NB(TIME_BOUNDS)};
    m->h[H_ITL] = (hist){.name = "inter_token_latency_seconds", .help = "Time between successive tokens.", .bounds = ITL_BOUNDS, .nb = NB(ITL_BOUNDS)};
    m->h[H_TPOT] = (hist){.name = "time_per_output_token_seconds", .help = "Mean time per output token after the first.", .bounds = ITL_BOUNDS, .nb = NB(ITL_BOUNDS)};
    m->h[H_E2E] = (hist){.name = "e2e_request_latency_seconds", .help = "End-to-end request latency.", .bounds = TIME_BOUNDS, .nb = NB(TIME_BOUNDS)};
    m->h[H_PROMPT] = (hist){.name = "request_prompt_tokens", .help = "Prompt tokens per request.", .bounds = TOKEN_BOUNDS, .nb = NB(TOKEN_BOUNDS)};
    m->h[H_GEN] = (hist){.name = "request_generation_tokens", .help = "Generated tokens per request.", .bounds = TOKEN_BOUNDS, .nb = NB(TOKEN_BOUNDS)};
    return m;
}

void lunar_srv_metrics_free(lunar_srv_metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m->model);
    free(m);
}

static void observe(hist *h, double x) {
    int i = 0;
    while (i < h->nb && x > h->bounds[i]) i++;
    h->counts[i]++;
    h->sum += x;
    h->n++;
}

void lunar_srv_metrics_http(lunar_srv_metrics *m, int status) {
    pthread_mutex_lock(&m->mu);
    int k = status / 100;
    m->http[k >= 1 && k <= 5 ? k : 0]++;
    pthread_mutex_unlock(&m->mu);
}

void lunar_srv_metrics_request(lunar_srv_metrics *m, const char *finish_reason, int prompt_tokens,
                               int generation_tokens, double ttft_s, double e2e_s) {
    pthread_mutex_lock(&m->mu);
    int f = F_ERROR;
    for (int i = 0; i < N_FINISH; i++)
        if (finish_reason && strcmp(finish_reason, FINISH_NAMES[i]) == 0) f = i;
    m->finished[f]++;
    m->prompt_tokens += prompt_tokens;
    m->generation_tokens += generation_tokens;
    observe(&m->h[H_PROMPT], prompt_tokens);
    observe(&m->h[H_GEN], generation_tokens);
    observe(&m->h[H_E2E], e2e_s);
    if (ttft_s >= 0) observe(&m->h[H_TTFT], ttft_s);
    if (ttft_s >= 0 && generation_tokens > 1) observe(&m->h[H_TPOT], (e2e_s - ttft_s) / (generation_tokens - 1));
    pthread_mutex_unlock(&m->mu);
}

void lunar_srv_metrics_itl(lunar_srv_metrics *m, double s) {
    pthread_mutex_lock(&m->mu);
    observe(&m->h[H_ITL], s);
    pthread_mutex_unlock(&m->mu);
}

static void head(lunar_sbuf *o, const char *name, const char *type, const char *help) {
    lunar_sbuf_printf(o, "# HELP lunar:%s %s\n# TYPE lunar:%s %s\n", name, help, name, type);
}

static void gauge(lunar_sbuf *o, const char *model, const char *name, const char *help, double v) {
    head(o, name, "gauge", help);
    lunar_sbuf_printf(o, "lunar:%s{model_name=\"%s\"} %.17g\n", name, model, v);
}

static void counter(lunar_sbuf *o, const char *model, const char *name, const char *help, long long v) {
    head(o, name, "counter", help);
    lunar_sbuf_printf(o, "lunar:%s_total{model_name=\"%s\"} %lld\n", name, model, v);
}

void lunar_srv_metrics_render(lunar_srv_metrics *m, const lunar_engine_metrics *em, lunar_sbuf *o) {
    pthread_mutex_lock(&m->mu);
    /* the label value: escape \ " and newline */
    lunar_sbuf lab = {0};
    for (const char *p = m->model; *p; p++) {
        if (*p == '\\' || *p == '"') lunar_sbuf_putc(&lab, '\\');
        if (*p == '\n') {
            lunar_sbuf_puts(&lab, "\\n");
            continue;
        }
        lunar_sbuf_putc(&lab, *p);
    }
    const char *model = lab.p ? lab.p : "";
    if (em) {
        gauge(o, model, "num_requests_running", "Requests in the running batch.", em->running);
        gauge(o, model, "num_requests_waiting", "Requests waiting to be scheduled.", em->waiting);
        gauge(o, model, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
              em->kv_blocks_total > 0 ? (double)em->kv_blocks_used / em->kv_blocks_total : 0.0);
        gauge(o, model, "kv_cache_blocks_total", "KV-cache blocks.", em->kv_blocks_total);
        gauge(o, model, "kv_cache_blocks_used", "KV-cache blocks in use.", em->kv_blocks_used);
        counter(o, model, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                em->prefix_cache_queries);
        counter(o, model, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", em->prefix_cache_hits);
        counter(o, model, "num_preemptions", "Requests preempted (their caches freed, to be recomputed).",
                em->preemptions);
        counter(o, model, "engine_requests_finished", "Requests the engine finished.", em->requests_finished);
        counter(o, model, "engine_prompt_tokens", "Prompt tokens the engine prefilled.", em->prompt_tokens);
        counter(o, model, "engine_generation_tokens", "Tokens the engine generated.", em->generation_tokens);
        counter(o, model, "engine_steps", "Engine scheduler steps.", em->steps);
    }
    counter(o, model, "prompt_tokens", "Prompt tokens of finished requests.", m->prompt_tokens);
    counter(o, model, "generation_tokens", "Generated tokens of finished requests.", m->generation_tokens);
    head(o, "request_success", "counter", "Finished generation requests by finish reason.");
    for (int i = 0; i < N_FINISH; i++)
        lunar_sbuf_printf(o, "lunar:request_success_total{model_name=\"%s\",finished_reason=\"%s\"} %lld\n", model,
                          FINISH_NAMES[i], m->finished[i]);
    head(o, "http_requests", "counter", "HTTP answers by status class.");
    static const char *cls[6] = {"other", "1xx", "2xx", "3xx", "4xx", "5xx"};
    for (int i = 1; i <= 5; i++)
        lunar_sbuf_printf(o, "lunar:http_requests_total{model_name=\"%s\",status=\"%s\"} %lld\n", model, cls[i],
                          m->http[i]);
    for (int k = 0; k < N_HIST; k++) {
        const hist *h = &m->h[k];
        head(o, h->name, "histogram", h->help);
        long long cum = 0;
        for (int i = 0; i <= h->nb; i++) {
            cum += h->counts[i];
            if (i < h->nb)
                lunar_sbuf_printf(o, "lunar:%s_bucket{model_name=\"%s\",le=\"%g\"} %lld\n", h->name, model,
                                  h->bounds[i], cum);
            else
                lunar_sbuf_printf(o, "lunar:%s_bucket{model_name=\"%s\",le=\"+Inf\"} %lld\n", h->name, model, cum);
        }
        lunar_sbuf_printf(o, "lunar:%s_sum{model_name=\"%s\"} %.9g\n", h->name, model, h->sum);
        lunar_sbuf_printf(o, "lunar:%s_count{model_name=\"%s\"} %lld\n", h->name, model, h->n);
    }
    lunar_sbuf_free(&lab);
    pthread_mutex_unlock(&m->mu);
}
