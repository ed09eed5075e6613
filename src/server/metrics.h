/* Prometheus text exposition (GET /metrics): the server's own timings (TTFT, inter-token latency, TPOT,
 * end-to-end latency, token counts per request) as histograms, request counters by status and finish
 * reason, and the engine's gauges and counters (lunar_engine_metrics). Names follow vLLM's with the
 * "lunar:" prefix, each with the label model_name. Thread-safe. */
#ifndef LUNAR_SERVER_METRICS_H
#define LUNAR_SERVER_METRICS_H

#include "lunar.h"
#include "text/sbuf.h"

typedef struct lunar_srv_metrics lunar_srv_metrics;

lunar_srv_metrics *lunar_srv_metrics_new(const char *model_name);
void lunar_srv_metrics_free(lunar_srv_metrics *m);

/* An HTTP answer (every endpoint). */
void lunar_srv_metrics_http(lunar_srv_metrics *m, int status);
/* A generation request that ran: finish_reason "stop" | "length" | "tool_calls" | "abort" | "error";
 * ttft < 0 when no token came. */
void lunar_srv_metrics_request(lunar_srv_metrics *m, const char *finish_reason, int prompt_tokens,
                               int generation_tokens, double ttft_s, double e2e_s);
/* One inter-token gap. */
void lunar_srv_metrics_itl(lunar_srv_metrics *m, double s);

/* Appends the exposition; em may be NULL (no engine). */
void lunar_srv_metrics_render(lunar_srv_metrics *m, const lunar_engine_metrics *em, lunar_sbuf *out);

#endif
