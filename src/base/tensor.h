/* A tensor view: dtype, shape and a pointer to bytes owned by someone else (usually an mmapped
 * safetensors file). Row-major, contiguous. Also the scalar conversions every backend shares. */
#ifndef LUNAR_BASE_TENSOR_H
#define LUNAR_BASE_TENSOR_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define LUNAR_MAX_DIMS 4

typedef enum lunar_dtype {
    LUNAR_DTYPE_F32,
    LUNAR_DTYPE_F16,
    LUNAR_DTYPE_BF16,
    LUNAR_DTYPE_F8_E4M3,
    LUNAR_DTYPE_U8,
    LUNAR_DTYPE_I8,
    LUNAR_DTYPE_I32,
    LUNAR_DTYPE_I64,
    LUNAR_DTYPE_F64,
    LUNAR_DTYPE_COUNT
} lunar_dtype;

typedef struct lunar_tensor {
    const char *name;              /* points into the owner's storage; may be NULL for temporaries */
    lunar_dtype dtype;
    int ndim;
    int64_t shape[LUNAR_MAX_DIMS];
    const void *data;
    size_t nbytes;
} lunar_tensor;

size_t lunar_dtype_size(lunar_dtype dt);
const char *lunar_dtype_name(lunar_dtype dt);      /* safetensors spelling: "BF16", "F8_E4M3", ... */
int lunar_dtype_from_name(const char *name, lunar_dtype *out); /* 0 ok, -1 unknown */

int64_t lunar_tensor_numel(const lunar_tensor *t);
/* "[4096, 2304]" into buf; returns buf. */
const char *lunar_shape_str(char *buf, size_t cap, int ndim, const int64_t *shape);

/* Rows [row0, row0+nrows) of a tensor seen as [shape[0], rest]: a view sharing the data. */
lunar_tensor lunar_tensor_rows(const lunar_tensor *t, int64_t row0, int64_t nrows);

/* Element i of a floating tensor (F32/F16/BF16/F8_E4M3/F64) widened to fp32. */
float lunar_tensor_get_f32(const lunar_tensor *t, int64_t i);
/* Elements [i0, i0+n) of a floating tensor into dst as fp32. */
void lunar_tensor_read_f32(const lunar_tensor *t, int64_t i0, int64_t n, float *dst);

static inline float lunar_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even; NaN stays NaN (quiet). */
static inline uint16_t lunar_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float lunar_f16_to_f32(uint16_t h);
uint16_t lunar_f32_to_f16(float f);
/* OCP FP8 E4M3 (fn variant: no infinities, 0x7f/0xff are NaN, max 448). */
float lunar_e4m3_to_f32(uint8_t v);
uint8_t lunar_f32_to_e4m3(float f); /* round to nearest even, saturating to +-448 */

#endif
