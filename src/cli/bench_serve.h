/* The statistics of `lunar bench serve` (exposed for tests): mean, population std, and numpy's
 * linear-interpolation percentiles, as vLLM's benchmark computes them. */
#ifndef LUNAR_CLI_BENCH_SERVE_H
#define LUNAR_CLI_BENCH_SERVE_H

typedef struct lunar_stats {
    int n;
    double mean, std, median, p99;
} lunar_stats;

void lunar_stats_of(const double *v, int n, lunar_stats *s);
/* p in [0, 100] of w[0..n) sorted ascending: w[lo] + (w[hi] - w[lo]) * frac at rank p/100 (n-1). */
double lunar_percentile_sorted(const double *w, int n, double p);

int lunar_cmd_bench_serve(int argc, char **argv);

#endif
