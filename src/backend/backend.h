/* Backend selection at run time. The CPU backend is always present and is the reference; the CUDA
 * backend is compiled in when nvcc was found at build time and used when a device is present. */
#ifndef LUNAR_BACKEND_BACKEND_H
#define LUNAR_BACKEND_BACKEND_H

#include "base/err.h"

typedef enum lunar_backend_kind { LUNAR_BACKEND_CPU, LUNAR_BACKEND_CUDA } lunar_backend_kind;

/* name: "cpu", "cuda" or "auto"/NULL (the best available). Fails with a clear message when the
 * requested backend cannot run here. */
int lunar_backend_select(const char *name, lunar_backend_kind *out, lunar_err *err);
const char *lunar_backend_name(lunar_backend_kind kind);

/* Number of CUDA devices visible (0 when CUDA is not compiled in or no driver/device), and a
 * one-line description of device 0 or of why there is none. */
int lunar_cuda_device_count(char *desc, int desc_cap);

#endif
