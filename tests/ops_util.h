/* Helpers shared by the op tests: weight tensors stored as F32/BF16/F16 from fp32 values, and NaN
 * poisoning of output buffers (an op that leaves an entry unwritten then fails its comparison). */
#ifndef LUNAR_TESTS_OPS_UTIL_H
#define LUNAR_TESTS_OPS_UTIL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/tensor.h"
#include "test.h"

/* A tensor of dtype dt holding v[0..numel) rounded to dt; its storage is malloc'ed (free .data). */
static inline lunar_tensor test_tensor(lunar_dtype dt, int ndim, const int64_t *shape,
                                       const float *v) {
    lunar_tensor t;
    memset(&t, 0, sizeof t);
    t.dtype = dt;
    t.ndim = ndim;
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= (t.shape[i] = shape[i]);
    t.nbytes = (size_t)n * lunar_dtype_size(dt);
    void *d = malloc(t.nbytes ? t.nbytes : 1);
    for (int64_t i = 0; i < n; i++) {
        if (dt == LUNAR_DTYPE_F32) ((float *)d)[i] = v[i];
        else if (dt == LUNAR_DTYPE_BF16) ((uint16_t *)d)[i] = lunar_f32_to_bf16(v[i]);
        else if (dt == LUNAR_DTYPE_F16) ((uint16_t *)d)[i] = lunar_f32_to_f16(v[i]);
        else abort();
    }
    t.data = d;
    return t;
}

static inline lunar_tensor test_tensor1(lunar_dtype dt, int64_t n, const float *v) {
    return test_tensor(dt, 1, &n, v);
}
static inline lunar_tensor test_tensor2(lunar_dtype dt, int64_t rows, int64_t cols, const float *v) {
    int64_t s[2] = {rows, cols};
    return test_tensor(dt, 2, s, v);
}
static inline void test_tensor_free(lunar_tensor *t) { free((void *)t->data); }

static inline float *test_alloc(long n) { return malloc((size_t)(n > 0 ? n : 1) * sizeof(float)); }
static inline float *test_rand(long n, unsigned seed, float lo, float hi) {
    float *x = test_alloc(n);
    lunar_test_fill(x, n, seed, lo, hi);
    return x;
}
static inline void test_poison(float *x, long n) {
    for (long i = 0; i < n; i++) x[i] = NAN;
}
static inline float *test_poisoned(long n) {
    float *x = test_alloc(n);
    test_poison(x, n);
    return x;
}

#endif
