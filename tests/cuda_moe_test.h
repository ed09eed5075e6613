/* Device-memory helpers of the CUDA MoE tests and benchmarks (test_cuda_moe.c, test_cuda_moe_bench.c). */
#ifndef LUNAR_TESTS_CUDA_MOE_TEST_H
#define LUNAR_TESTS_CUDA_MOE_TEST_H

#include <stdlib.h>

#include "backend/cuda/cuda_ops.h"
#include "cuda_test.h"
#include "ops_util.h"
#include "test.h"

/* the MoE benchmark's full-size weights need a larger arena than the op tests' */
static inline int moe_cuda_on(void) {
    return lunar_test_cuda_on(getenv("LUNAR_MOE_BENCH") ? (size_t)48 << 30 : (size_t)6 << 30);
}

static inline void *din(const void *h, size_t bytes) {
    void *p = lunar_cuda_alloc(bytes ? bytes : 4);
    LUNAR_ASSERT(p);
    if (bytes) lunar_cuda_upload(p, h, bytes);
    return p;
}
static inline void *dalloc(size_t bytes) {
    void *p = lunar_cuda_alloc(bytes ? bytes : 4);
    LUNAR_ASSERT(p);
    return p;
}
static inline float *dl_f32(const void *d, long n) {
    float *h = test_alloc(n);
    lunar_cuda_sync();
    lunar_cuda_download(h, d, (size_t)n * 4);
    return h;
}

#endif
