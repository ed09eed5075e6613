#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"

#define MAX_TESTS 1024

static struct {
    const char *name, *file;
    lunar_test_fn fn;
} tests[MAX_TESTS];
static int n_tests;
static int current_failures;

void lunar_test_register(const char *name, const char *file, lunar_test_fn fn) {
    if (n_tests == MAX_TESTS) {
        fprintf(stderr, "too many tests; raise MAX_TESTS\n");
        abort();
    }
    tests[n_tests].name = name;
    tests[n_tests].file = file;
    tests[n_tests].fn = fn;
    n_tests++;
}

void lunar_test_fail(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    if (current_failures < 20) {
        fprintf(stderr, "    %s:%d: ", file, line);
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
        fputc('\n', stderr);
    }
    current_failures++;
}

double lunar_max_rel_err(const float *a, const float *b, long n) {
    double scale = 0, worst = 0;
    for (long i = 0; i < n; i++) scale = fmax(scale, fabs((double)b[i]));
    if (scale < 1e-30) scale = 1e-30;
    for (long i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(b[i]) || isinf(a[i]) != isinf(b[i])) return INFINITY;
        worst = fmax(worst, fabs((double)a[i] - (double)b[i]) / scale);
    }
    return worst;
}

void lunar_test_fill(float *x, long n, unsigned seed, float lo, float hi) {
    unsigned long long s = 0x9e3779b97f4a7c15ULL * (seed + 1);
    for (long i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x[i] = lo + (hi - lo) * (float)((s >> 40) * (1.0 / 16777216.0));
    }
}

static int by_file_then_name(const void *a, const void *b) {
    const int *x = a, *y = b;
    int c = strcmp(tests[*x].file, tests[*y].file);
    return c ? c : strcmp(tests[*x].name, tests[*y].name);
}

int main(int argc, char **argv) {
    const char *filter = argc > 1 ? argv[1] : NULL;
    int order[MAX_TESTS], passed = 0, failed = 0;
    for (int i = 0; i < n_tests; i++) order[i] = i;
    qsort(order, (size_t)n_tests, sizeof order[0], by_file_then_name);
    for (int j = 0; j < n_tests; j++) {
        int i = order[j];
        if (filter && !strstr(tests[i].name, filter)) continue;
        current_failures = 0;
        fprintf(stderr, "  %-48s", tests[i].name);
        fflush(stderr);
        tests[i].fn();
        if (current_failures) {
            fprintf(stderr, "  FAILED (%d)\n", current_failures);
            failed++;
        } else {
            fprintf(stderr, "  ok\n");
            passed++;
        }
    }
    fflush(stderr);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
