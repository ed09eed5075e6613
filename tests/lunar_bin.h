/* The multi-process GPU tests (test_cuda_tp.c, test_cuda_tp_serve.c) run the lunar binary that was
 * built beside the test binary. */
#ifndef LUNAR_TESTS_LUNAR_BIN_H
#define LUNAR_TESTS_LUNAR_BIN_H

#include <libgen.h>
#include <stdio.h>
#include <unistd.h>

#include "backend/backend.h"
#include "test.h"

/* The lunar binary beside this test binary, into bin. Returns the number of CUDA devices, or -1
 * (the test is skipped, saying why) when there are fewer than `need` for `what`. */
static inline int lunar_bin_for(int need, const char *what, char *bin, size_t cap) {
    char desc[256];
    const int n = lunar_cuda_device_count(desc, sizeof desc);
    if (n < need) {
        fprintf(stderr, "[skipped: %d CUDA device(s), %s needs %d: %s] ", n < 0 ? 0 : n, what, need, desc);
        return -1;
    }
    char self[1024];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    LUNAR_ASSERT(k > 0);
    self[k] = 0;
    snprintf(bin, cap, "%s/lunar", dirname(self));
    CHECK_MSG(access(bin, X_OK) == 0, "%s: the lunar binary is missing", bin);
    return n;
}

#endif
