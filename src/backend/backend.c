#include "backend/backend.h"

#include <stdio.h>
#include <string.h>

#ifndef LUNAR_HAVE_CUDA
int lunar_cuda_device_count(char *desc, int desc_cap) {
    snprintf(desc, (size_t)desc_cap, "lunar was built without CUDA (nvcc not found at build time)");
    return 0;
}
#endif

/* Whether this build has the CUDA model forward (model/forward_cuda.c): with nvcc at build time. */
#ifdef LUNAR_HAVE_CUDA
static const int cuda_forward_available = 1;
#else
static const int cuda_forward_available = 0;
#endif

const char *lunar_backend_name(lunar_backend_kind kind) {
    return kind == LUNAR_BACKEND_CUDA ? "cuda" : "cpu";
}

int lunar_backend_select(const char *name, lunar_backend_kind *out, lunar_err *err) {
    char desc[256];
    if (!name || strcmp(name, "auto") == 0) {
        *out = (cuda_forward_available && lunar_cuda_device_count(desc, sizeof desc) > 0)
                   ? LUNAR_BACKEND_CUDA
                   : LUNAR_BACKEND_CPU;
        return 0;
    }
    if (strcmp(name, "cpu") == 0) {
        *out = LUNAR_BACKEND_CPU;
        return 0;
    }
    if (strcmp(name, "cuda") == 0) {
        int n = lunar_cuda_device_count(desc, sizeof desc);
        if (n <= 0) return lunar_fail(err, "--backend cuda: no usable CUDA device: %s", desc);
        if (!cuda_forward_available)
            return lunar_fail(err, "--backend cuda: %s found, but the CUDA model forward is not "
                                   "implemented yet; use --backend cpu", desc);
        *out = LUNAR_BACKEND_CUDA;
        return 0;
    }
    return lunar_fail(err, "--backend: unknown backend '%s' (expected cpu, cuda or auto)", name);
}
