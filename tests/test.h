/* A small test harness: TEST(name) { ... } registers itself at start-up (no central list to
 * edit); CHECK* record failures with file and line and let the test continue.
 * build/lunar_tests [substring] runs every test whose name contains substring, and ends with the
 * line "N passed, N failed". Tests run from the repository root (paths like tests/golden/...). */
#ifndef LUNAR_TESTS_TEST_H
#define LUNAR_TESTS_TEST_H

#include <math.h>
#include <stdio.h>

typedef void (*lunar_test_fn)(void);
void lunar_test_register(const char *name, const char *file, lunar_test_fn fn);
void lunar_test_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define TEST(name)                                                                   \
    static void test_##name(void);                                                   \
    __attribute__((constructor)) static void register_test_##name(void) {            \
        lunar_test_register(#name, __FILE__, test_##name);                           \
    }                                                                                \
    static void test_##name(void)

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) lunar_test_fail(__FILE__, __LINE__, "CHECK(%s)", #cond);        \
    } while (0)

#define CHECK_MSG(cond, ...)                                                         \
    do {                                                                             \
        if (!(cond)) lunar_test_fail(__FILE__, __LINE__, __VA_ARGS__);               \
    } while (0)

/* |a - b| <= tol, with NaN never near anything */
#define CHECK_NEAR(a, b, tol)                                                        \
    do {                                                                             \
        double a_ = (a), b_ = (b);                                                   \
        if (!(fabs(a_ - b_) <= (tol)))                                               \
            lunar_test_fail(__FILE__, __LINE__, "CHECK_NEAR(%s, %s): %.9g vs %.9g (tol %g)", \
                            #a, #b, a_, b_, (double)(tol));                          \
    } while (0)

/* Largest |a-b| / max(|b|max, floor) over n values: a relative error against the scale of the
 * reference, so tiny reference entries do not dominate. NaN anywhere gives +inf. */
double lunar_max_rel_err(const float *a, const float *b, long n);

/* Fills x[n] with uniform values in [lo, hi) from a fixed generator seeded by seed. */
void lunar_test_fill(float *x, long n, unsigned seed, float lo, float hi);

#endif
