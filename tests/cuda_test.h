/* Shared by the CUDA op tests: the device check every test starts with. */
#ifndef LUNAR_TESTS_CUDA_TEST_H
#define LUNAR_TESTS_CUDA_TEST_H

#include <stdint.h>
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

/* An output buffer between guard words, all poisoned first (SENT is a NaN as fp32): an entry the
 * kernel leaves unwritten, or a write past either end, shows. */
#define GUARD 64
#define SENT 0x7fc17fc1u
typedef struct guarded {
    uint32_t *base;
    size_t words;
} guarded;
static inline void *guarded_new(guarded *d, size_t bytes) {
    d->words = (bytes + 3) / 4;
    d->base = lunar_cuda_alloc((d->words + 2 * GUARD) * 4);
    LUNAR_ASSERT(d->base);
    lunar_cuda_fill_u32(d->base, SENT, d->words + 2 * GUARD);
    return d->base + GUARD;
}
static inline int guards_ok(const guarded *d) {
    uint32_t g[2 * GUARD];
    lunar_cuda_sync();
    lunar_cuda_download(g, d->base, GUARD * 4);
    lunar_cuda_download(g + GUARD, d->base + GUARD + d->words, GUARD * 4);
    for (int i = 0; i < 2 * GUARD; i++)
        if (g[i] != SENT) return 0;
    return 1;
}
/* a device copy of h (bytes may be 0) */
static inline void *dev_in(const void *h, size_t bytes) {
    void *p = lunar_cuda_alloc(bytes ? bytes : 4);
    LUNAR_ASSERT(p);
    if (bytes) lunar_cuda_upload(p, h, bytes);
    return p;
}
#endif

#endif
