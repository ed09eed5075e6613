/* Shared by the CUDA op tests: the device check every test starts with. */
#ifndef LUNAR_TESTS_CUDA_TEST_H
#define LUNAR_TESTS_CUDA_TEST_H

#include <stdio.h>

#include "backend/backend.h"
#include "base/err.h"

/* 1 when a CUDA device is present (nothing initialised: the model uploads do it), else 0 after
 * printing why the test is skipped */
static inline int lunar_test_cuda_device(void) {
    char desc[256];
    if (lunar_cuda_device_count(desc, sizeof desc) > 0) return 1;
    fprintf(stderr, "[skipped: no CUDA device: %s] ", desc);
    return 0;
}

#ifdef LUNAR_HAVE_CUDA
#include "backend/cuda/cuda_ops.h"

/* 1 when device 0 is initialised (an arena of `arena` bytes; lunar_cuda_init keeps the first
 * arena when a test before this one made it), else 0 after printing why the test is skipped. The
 * answer is kept per test file. */
static inline int lunar_test_cuda_on(size_t arena) {
    static int state = -1;
    static char why[1100];
    if (state < 0) {
        char desc[256];
        lunar_err err;
        if (lunar_cuda_device_count(desc, sizeof desc) <= 0) {
            snprintf(why, sizeof why, "no CUDA device: %s", desc);
            state = 0;
        } else if (lunar_cuda_init(0, arena, &err) != 0) {
            snprintf(why, sizeof why, "no CUDA device: %s", err.msg);
            state = 0;
        } else {
            fprintf(stderr, "[%s] ", lunar_cuda_describe());
            state = 1;
        }
    }
    if (!state) fprintf(stderr, "[skipped: %s] ", why);
    return state;
}
#endif

#endif
