/* lunar bench serve: drives a running OpenAI-compatible server (lunar's, vLLM's, SGLang's) the way
 * `vllm bench serve --dataset-name random --backend openai` does and reports its metrics with its
 * definitions (reference/api.md section 7):
 *   TTFT  send -> first SSE event whose `choices` is non-empty
 *   ITL   gaps between successive such events (one sample per event)
 *   E2EL  send -> last such event (the usage-only event excluded)
 *   TPOT  (E2EL - TTFT) / (output_tokens - 1), requests with more than one token
 *   throughputs over the wall time from the first send to the last completion.
 * output_tokens = usage.completion_tokens (stream_options.include_usage), else the event count.
 *
 * Prompts are token ids (the /v1/completions `prompt` as an array of ints), exactly --input-len of
 * them, uniform in [0, --vocab-size) from --seed: no tokenizer round trip can change the length.
 * Output length is pinned with max_tokens = min_tokens = --output-len and ignore_eos (lunar's
 * server accepts all three, as vLLM's does), greedy sampling. Arrivals: --request-rate R draws
 * exponential gaps (a Poisson process), inf sends at once; --max-concurrency caps the requests in
 * flight (a pool of that many senders). */
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/bench_serve.h"
#include "cli/http_client.h"
#include "model/dummy_gen.h"
#include "model/profile.h"

static const char *USAGE =
    "usage: lunar bench serve [--base-url http://127.0.0.1:8000] [--endpoint /v1/completions] [--model NAME]\n"
    "         [--input-len 1024] [--output-len 128] [--num-prompts 1000] [--max-concurrency N]\n"
    "         [--request-rate R|inf] [--seed 0] [--vocab-size 100000] [--api-key K] [--timeout S]\n"
    "         [--result-file FILE.json]\n";

typedef struct serve_opts {
    const char *base_url, *endpoint, *model, *api_key, *result_file;
    long input_len, output_len, num_prompts, max_conc, seed, vocab, timeout;
    double rate; /* requests/s; 0 = inf */
} serve_opts;

/* One request's outcome. */
typedef struct req {
    int32_t *ids;
    double arrival;    /* planned send time (s after the start) */
    double t_send, ttft, e2el; /* e2el = last choices event - send */
    double t_done;     /* the response fully read (absolute) */
    double last;       /* time of the last choices event (absolute) */
    double *itl;
    int n_itl, cap_itl, cap_ev;
    double *ev_t;      /* absolute times of the choices events (for the peak throughput) */
    int prompt_tokens, completion_tokens, n_events, ok;
    char error[200];
    /* SSE line assembly */
    char *line;
    size_t line_len, line_cap;
} req;

typedef struct bench {
    serve_opts o;
    lunar_url url;
    req *r;
    int next;
    pthread_mutex_t mu;
    double t0;
} bench;

static double now_s(void) { return lunar_prof_now(); }

static void push_d(double **v, int *n, int *cap, double x) {
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 64;
        *v = realloc(*v, (size_t)*cap * sizeof **v);
        LUNAR_ASSERT(*v);
    }
    (*v)[(*n)++] = x;
}

/* One `data:` payload of the stream. */
static void on_event(req *q, const char *data) {
    if (strcmp(data, "[DONE]") == 0) return;
    const double t = now_s();
    json_error_t je;
    json_t *j = json_loads(data, 0, &je);
    if (!j) return;
    json_t *ch = json_object_get(j, "choices"), *u = json_object_get(j, "usage");
    if (json_is_array(ch) && json_array_size(ch) > 0) {
        if (q->n_events == 0) q->ttft = t - q->t_send;
        else push_d(&q->itl, &q->n_itl, &q->cap_itl, t - q->last);
        int n_ev = q->n_events;
        push_d(&q->ev_t, &n_ev, &q->cap_ev, t);
        q->n_events = n_ev;
        q->last = t;
    }
    if (json_is_object(u)) {
        json_t *ct = json_object_get(u, "completion_tokens"), *pt = json_object_get(u, "prompt_tokens");
        if (json_is_integer(ct)) q->completion_tokens = (int)json_integer_value(ct);
        if (json_is_integer(pt)) q->prompt_tokens = (int)json_integer_value(pt);
    }
    json_t *e = json_object_get(j, "error");
    if (e) snprintf(q->error, sizeof q->error, "stream error: %.150s", json_string_value(json_object_get(e, "message")));
    json_decref(j);
}

/* SSE framing: lines; `data: X` lines carry the payload (one line per event from these servers). */
static int on_body(void *user, const char *p, size_t n) {
    req *q = user;
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '\n') {
            if (q->line_len && q->line[q->line_len - 1] == '\r') q->line_len--;
            if (q->line_cap == 0) continue;
            q->line[q->line_len] = 0;
            if (strncmp(q->line, "data:", 5) == 0) on_event(q, q->line + 5 + (q->line[5] == ' '));
            else if (q->line[0] == '{') /* a non-streamed error body */
                snprintf(q->error, sizeof q->error, "%.190s", q->line);
            q->line_len = 0;
            continue;
        }
        if (q->line_len + 2 > q->line_cap) {
            q->line_cap = q->line_cap ? 2 * q->line_cap : 4096;
            q->line = realloc(q->line, q->line_cap);
            LUNAR_ASSERT(q->line);
        }
        q->line[q->line_len++] = p[i];
    }
    return 0;
}

static void run_one(bench *b, req *q) {
    const serve_opts *o = &b->o;
    json_t *ids = json_array();
    for (long i = 0; i < o->input_len; i++) json_array_append_new(ids, json_integer(q->ids[i]));
    json_t *body = json_pack("{s:s,s:o,s:i,s:i,s:b,s:b,s:{s:b},s:f}", "model", o->model, "prompt", ids, "max_tokens",
                             (int)o->output_len, "min_tokens", (int)o->output_len, "ignore_eos", 1, "stream", 1,
                             "stream_options", "include_usage", 1, "temperature", 0.0);
    char *s = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    int status = 0;
    lunar_err err;
    q->t_send = now_s();
    int rc = lunar_http_request(&b->url, "POST", o->endpoint, s, o->api_key, (int)o->timeout, &status, on_body, q, &err);
    q->t_done = now_s();
    if (q->line_len && q->line_cap) { /* an error body without a final newline */
        q->line[q->line_len] = 0;
        if (q->line[0] == '{') snprintf(q->error, sizeof q->error, "%.190s", q->line);
    }
    free(s);
    if (rc) snprintf(q->error, sizeof q->error, "%.190s", err.msg);
    else if (status != 200 && !q->error[0]) snprintf(q->error, sizeof q->error, "HTTP %d", status);
    else if (status != 200) {
        char tmp[200];
        snprintf(tmp, sizeof tmp, "HTTP %d: %.150s", status, q->error);
        memcpy(q->error, tmp, sizeof tmp);
    }
    q->ok = !rc && status == 200 && q->n_events > 0 && !q->error[0];
    if (q->ok) {
        q->e2el = q->last - q->t_send;
        if (!q->completion_tokens) q->completion_tokens = q->n_events;
        if (!q->prompt_tokens) q->prompt_tokens = (int)o->input_len;
    } else if (!q->error[0]) {
        snprintf(q->error, sizeof q->error, "no completion events in the response");
    }
}

static void *worker(void *arg) {
    bench *b = arg;
    for (;;) {
        pthread_mutex_lock(&b->mu);
        int i = b->next < b->o.num_prompts ? b->next++ : -1;
        pthread_mutex_unlock(&b->mu);
        if (i < 0) return NULL;
        req *q = &b->r[i];
        double wait = b->t0 + q->arrival - now_s();
        if (wait > 0) {
            struct timespec ts = {(time_t)wait, (long)((wait - (double)(time_t)wait) * 1e9)};
            nanosleep(&ts, NULL);
        }
        run_one(b, q);
    }
}

/* ---- statistics (numpy's linear-interpolation percentile, as vLLM) ---- */

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

void lunar_stats_of(const double *v, int n, lunar_stats *s) {
    memset(s, 0, sizeof *s);
    s->n = n;
    if (n <= 0) return;
    double *w = lunar_xmalloc((size_t)n * sizeof *w), sum = 0, sq = 0;
    memcpy(w, v, (size_t)n * sizeof *w);
    qsort(w, (size_t)n, sizeof *w, cmp_d);
    for (int i = 0; i < n; i++) sum += w[i];
    s->mean = sum / n;
    for (int i = 0; i < n; i++) sq += (w[i] - s->mean) * (w[i] - s->mean);
    s->std = sqrt(sq / n); /* numpy's std: population */
    s->median = lunar_percentile_sorted(w, n, 50);
    s->p99 = lunar_percentile_sorted(w, n, 99);
    free(w);
}

double lunar_percentile_sorted(const double *w, int n, double p) {
    if (n <= 0) return 0;
    const double rank = p / 100.0 * (n - 1);
    const int lo = (int)floor(rank), hi = lo + 1 < n ? lo + 1 : n - 1;
    return w[lo] + (w[hi] - w[lo]) * (rank - lo);
}

/* ---- main ---- */

static int parse(int argc, char **argv, serve_opts *o, lunar_err *err) {
    memset(o, 0, sizeof *o);
    o->base_url = "http://127.0.0.1:8000";
    o->endpoint = "/v1/completions";
    o->input_len = 1024, o->output_len = 128, o->num_prompts = 1000, o->vocab = 100000, o->timeout = 600;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!(v = lunar_opt_value(argc, argv, &i, err))) return -1;
        if (strcmp(a, "--base-url") == 0) o->base_url = v;
        else if (strcmp(a, "--endpoint") == 0) o->endpoint = v;
        else if (strcmp(a, "--model") == 0) o->model = v;
        else if (strcmp(a, "--api-key") == 0) o->api_key = v;
        else if (strcmp(a, "--result-file") == 0) o->result_file = v;
        else if (strcmp(a, "--input-len") == 0) { if (lunar_parse_int(a, v, 1, 1 << 24, &o->input_len, err)) return -1; }
        else if (strcmp(a, "--output-len") == 0) { if (lunar_parse_int(a, v, 1, 1 << 24, &o->output_len, err)) return -1; }
        else if (strcmp(a, "--num-prompts") == 0) { if (lunar_parse_int(a, v, 1, 1 << 24, &o->num_prompts, err)) return -1; }
        else if (strcmp(a, "--max-concurrency") == 0) { if (lunar_parse_int(a, v, 1, 1 << 16, &o->max_conc, err)) return -1; }
        else if (strcmp(a, "--seed") == 0) { if (lunar_parse_int(a, v, 0, 0x7fffffffffffffffL, &o->seed, err)) return -1; }
        else if (strcmp(a, "--vocab-size") == 0) { if (lunar_parse_int(a, v, 2, 1 << 30, &o->vocab, err)) return -1; }
        else if (strcmp(a, "--timeout") == 0) { if (lunar_parse_int(a, v, 1, 86400, &o->timeout, err)) return -1; }
        else if (strcmp(a, "--request-rate") == 0) {
            if (strcmp(v, "inf") == 0) o->rate = 0;
            else if (lunar_parse_float(a, v, 1e-6, 1e9, &o->rate, err)) return -1;
        } else return lunar_fail(err, "unknown option '%s'", a);
    }
    return 0;
}

typedef struct body_buf { char *p; size_t n; } body_buf;

static int collect_body(void *u, const char *d, size_t n) {
    body_buf *acc = u;
    acc->p = realloc(acc->p, acc->n + n + 1);
    LUNAR_ASSERT(acc->p);
    memcpy(acc->p + acc->n, d, n);
    acc->n += n;
    acc->p[acc->n] = 0;
    return 0;
}

/* The served model's name from GET /v1/models (first entry). */
static int first_model(bench *b, char *out, size_t cap, lunar_err *err) {
    body_buf acc = {0};
    int status;
    if (lunar_http_request(&b->url, "GET", "/v1/models", NULL, b->o.api_key, 30, &status, collect_body, &acc, err))
        return -1;
    json_t *j = acc.p ? json_loadb(acc.p, acc.n, 0, NULL) : NULL;
    const char *id = json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id"));
    int rc = 0;
    if (status != 200 || !id) rc = lunar_fail(err, "GET /v1/models: HTTP %d, no model id (give --model)", status);
    else snprintf(out, cap, "%s", id);
    json_decref(j);
    free(acc.p);
    return rc;
}

static json_t *jarr(const double *v, int n, double scale) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_real(v[i] * scale));
    return a;
}

int lunar_cmd_bench_serve(int argc, char **argv) {
    bench b;
    memset(&b, 0, sizeof b);
    lunar_err err;
    if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        fputs(USAGE, stdout);
        return 0;
    }
    if (parse(argc, argv, &b.o, &err) || lunar_url_parse(b.o.base_url, &b.url, &err)) {
        fprintf(stderr, "lunar bench serve: %s\n%s", err.msg, USAGE);
        return 2;
    }
    serve_opts *o = &b.o;
    char model[256];
    if (!o->model) {
        if (first_model(&b, model, sizeof model, &err)) {
            fprintf(stderr, "lunar bench serve: %s\n", err.msg);
            return 1;
        }
        o->model = model;
    }
    const int N = (int)o->num_prompts;
    b.r = lunar_xcalloc((size_t)N, sizeof *b.r);
    double t = 0;
    for (int i = 0; i < N; i++) {
        req *q = &b.r[i];
        q->ids = lunar_xmalloc((size_t)o->input_len * sizeof *q->ids);
        for (long k = 0; k < o->input_len; k++)
            q->ids[k] = (int32_t)(lunar_dummy_hash((uint64_t)o->seed * 1000003u + (uint64_t)i, (uint64_t)k) % (uint64_t)o->vocab);
        if (o->rate > 0 && i > 0) { /* exponential gaps: -ln(U) / rate, U in (0, 1] */
            double u = ((double)(lunar_dummy_hash((uint64_t)o->seed ^ 0xA5A5A5A5ull, (uint64_t)i) >> 11) + 1.0) / 9007199254740992.0;
            t += -log(u) / o->rate;
        }
        q->arrival = t;
    }
    int n_workers = o->max_conc > 0 ? (int)o->max_conc : (o->rate > 0 ? 1024 : N);
    if (n_workers > N) n_workers = N;
    pthread_mutex_init(&b.mu, NULL);
    pthread_t *th = lunar_xcalloc((size_t)n_workers, sizeof *th);
    fprintf(stderr, "lunar bench serve: %d prompts of %ld tokens -> %ld tokens, model %s at %s, rate %s, "
                    "max concurrency %d\n", N, o->input_len, o->output_len, o->model, o->base_url,
            o->rate > 0 ? "poisson" : "inf", n_workers);
    b.t0 = now_s();
    for (int i = 0; i < n_workers; i++) pthread_create(&th[i], NULL, worker, &b);
    for (int i = 0; i < n_workers; i++) pthread_join(th[i], NULL);
    /* the wall time of the whole run, first send to the last response read in full (as vLLM's) */
    double t_end = b.t0;
    for (int i = 0; i < N; i++)
        if (b.r[i].t_done > t_end) t_end = b.r[i].t_done;
    const double dur = t_end > b.t0 ? t_end - b.t0 : 1e-9;

    /* aggregate */
    double *ttft = lunar_xcalloc((size_t)N, sizeof *ttft), *tpot = lunar_xcalloc((size_t)N, sizeof *tpot),
           *e2el = lunar_xcalloc((size_t)N, sizeof *e2el), *itl = NULL;
    int n_ok = 0, n_tpot = 0, n_itl = 0, cap_itl = 0;
    long long tin = 0, tout = 0;
    json_t *jin = json_array(), *jout = json_array(), *jerr = json_array();
    for (int i = 0; i < N; i++) {
        req *q = &b.r[i];
        json_array_append_new(jerr, json_string(q->ok ? "" : q->error));
        json_array_append_new(jin, json_integer(q->ok ? q->prompt_tokens : 0));
        json_array_append_new(jout, json_integer(q->ok ? q->completion_tokens : 0));
        if (!q->ok) continue;
        ttft[n_ok] = q->ttft, e2el[n_ok] = q->e2el, n_ok++;
        tin += q->prompt_tokens, tout += q->completion_tokens;
        if (q->completion_tokens > 1) tpot[n_tpot++] = (q->e2el - q->ttft) / (q->completion_tokens - 1);
        for (int k = 0; k < q->n_itl; k++) push_d(&itl, &n_itl, &cap_itl, q->itl[k]);
    }
    /* peak output tokens/s over 1-s buckets (events of one token each), peak requests in flight */
    const int nbk = (int)ceil(dur) + 1;
    int *bucket = lunar_xcalloc((size_t)nbk, sizeof *bucket), peak_tok = 0, peak_conc = 0;
    for (int i = 0; i < N; i++)
        for (int k = 0; b.r[i].ok && k < b.r[i].n_events; k++) {
            int bi = (int)(b.r[i].ev_t[k] - b.t0);
            if (bi >= 0 && bi < nbk) bucket[bi]++;
        }
    for (int i = 0; i < nbk; i++) peak_tok = bucket[i] > peak_tok ? bucket[i] : peak_tok;
    for (int i = 0; i < N; i++) {
        if (!b.r[i].ok) continue;
        int c = 0;
        for (int k = 0; k < N; k++)
            c += b.r[k].ok && b.r[k].t_send <= b.r[i].t_send && b.r[k].last > b.r[i].t_send;
        peak_conc = c > peak_conc ? c : peak_conc;
    }
    lunar_stats st[4];
    lunar_stats_of(ttft, n_ok, &st[0]);
    lunar_stats_of(tpot, n_tpot, &st[1]);
    lunar_stats_of(itl, n_itl, &st[2]);
    lunar_stats_of(e2el, n_ok, &st[3]);
    const char *names[4] = {"ttft", "tpot", "itl", "e2el"};
    const char *titles[4] = {"Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-token Latency",
                             "End-to-end Latency"};
    const char *abbr[4] = {"TTFT", "TPOT", "ITL", "E2EL"};

    printf("============ Serving Benchmark Result ============\n");
    printf("%-40s %-10d\n", "Successful requests:", n_ok);
    printf("%-40s %-10d\n", "Failed requests:", N - n_ok);
    if (o->max_conc > 0) printf("%-40s %-10ld\n", "Maximum request concurrency:", o->max_conc);
    if (o->rate > 0) printf("%-40s %-10.2f\n", "Request rate configured (RPS):", o->rate);
    printf("%-40s %-10.2f\n", "Benchmark duration (s):", dur);
    printf("%-40s %-10lld\n", "Total input tokens:", tin);
    printf("%-40s %-10lld\n", "Total generated tokens:", tout);
    printf("%-40s %-10.2f\n", "Request throughput (req/s):", n_ok / dur);
    printf("%-40s %-10.2f\n", "Output token throughput (tok/s):", tout / dur);
    printf("%-40s %-10d\n", "Peak output token throughput (tok/s):", peak_tok);
    printf("%-40s %-10d\n", "Peak concurrent requests:", peak_conc);
    printf("%-40s %-10.2f\n", "Total Token throughput (tok/s):", (tin + tout) / dur);
    for (int m = 0; m < 4; m++) {
        char line[64], lab[64];
        snprintf(line, sizeof line, "%s", titles[m]);
        int pad = 50 - (int)strlen(line) - 2;
        printf("%.*s %s %.*s\n", pad / 2, "--------------------------------------------------", line, pad - pad / 2,
               "--------------------------------------------------");
        snprintf(lab, sizeof lab, "Mean %s (ms):", abbr[m]);
        printf("%-40s %-10.2f\n", lab, 1e3 * st[m].mean);
        snprintf(lab, sizeof lab, "Median %s (ms):", abbr[m]);
        printf("%-40s %-10.2f\n", lab, 1e3 * st[m].median);
        snprintf(lab, sizeof lab, "P99 %s (ms):", abbr[m]);
        printf("%-40s %-10.2f\n", lab, 1e3 * st[m].p99);
    }
    printf("==================================================\n");
    fflush(stdout);

    int rc = n_ok == N ? 0 : 1;
    if (N - n_ok) {
        for (int i = 0; i < N; i++)
            if (!b.r[i].ok) {
                fprintf(stderr, "lunar bench serve: %d of %d requests failed; first: %s\n", N - n_ok, N, b.r[i].error);
                break;
            }
    }
    if (o->result_file) {
        time_t now = time(NULL);
        char date[32];
        strftime(date, sizeof date, "%Y%m%d-%H%M%S", gmtime(&now));
        json_t *root = json_pack("{s:s,s:s,s:s,s:s,s:i,s:i,s:i,s:f,s:i,s:i,s:I,s:I,s:f,s:f,s:f,s:i,s:i}", "date", date,
                                 "backend", "openai", "model_id", o->model, "endpoint", o->endpoint, "num_prompts", N,
                                 "input_len", (int)o->input_len, "output_len", (int)o->output_len, "duration", dur,
                                 "completed", n_ok, "failed", N - n_ok, "total_input_tokens", (json_int_t)tin,
                                 "total_output_tokens", (json_int_t)tout, "request_throughput", n_ok / dur,
                                 "output_throughput", tout / dur, "total_token_throughput", (tin + tout) / dur,
                                 "max_output_tokens_per_s", peak_tok, "max_concurrent_requests", peak_conc);
        json_object_set_new(root, "request_rate", o->rate > 0 ? json_real(o->rate) : json_string("inf"));
        json_object_set_new(root, "max_concurrency", o->max_conc > 0 ? json_integer(o->max_conc) : json_null());
        json_object_set_new(root, "seed", json_integer(o->seed));
        for (int m = 0; m < 4; m++) {
            char k[32];
            snprintf(k, sizeof k, "mean_%s_ms", names[m]), json_object_set_new(root, k, json_real(1e3 * st[m].mean));
            snprintf(k, sizeof k, "median_%s_ms", names[m]), json_object_set_new(root, k, json_real(1e3 * st[m].median));
            snprintf(k, sizeof k, "std_%s_ms", names[m]), json_object_set_new(root, k, json_real(1e3 * st[m].std));
            snprintf(k, sizeof k, "p99_%s_ms", names[m]), json_object_set_new(root, k, json_real(1e3 * st[m].p99));
        }
        json_object_set_new(root, "input_lens", jin);
        json_object_set_new(root, "output_lens", jout);
        json_object_set_new(root, "ttfts", jarr(ttft, n_ok, 1.0));
        json_object_set_new(root, "itls", jarr(itl, n_itl, 1.0));
        json_object_set_new(root, "errors", jerr);
        if (json_dump_file(root, o->result_file, JSON_INDENT(1)) != 0) {
            fprintf(stderr, "lunar bench serve: cannot write %s\n", o->result_file);
            rc = 1;
        }
        json_decref(root);
    } else {
        json_decref(jin), json_decref(jout), json_decref(jerr);
    }
    for (int i = 0; i < N; i++) free(b.r[i].ids), free(b.r[i].itl), free(b.r[i].ev_t), free(b.r[i].line);
    free(b.r), free(th), free(ttft), free(tpot), free(e2el), free(itl), free(bucket);
    pthread_mutex_destroy(&b.mu);
    return rc;
}
