/* NumPy .npy (format 1.0) writer for fp32 arrays, so logits can be read with numpy.load. */
#ifndef LUNAR_IO_NPY_H
#define LUNAR_IO_NPY_H

#include <stdint.h>

#include "base/err.h"

int lunar_npy_write_f32(const char *path, const float *data, int ndim, const int64_t *shape,
                        lunar_err *err);

#endif
