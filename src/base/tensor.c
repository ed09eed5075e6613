#include "base/tensor.h"

#include <math.h>
#include <stdio.h>

#include "base/err.h"

static const struct {
    const char *name;
    size_t size;
} dtype_info[LUNAR_DTYPE_COUNT] = {
    [LUNAR_DTYPE_F32] = {"F32", 4},     [LUNAR_DTYPE_F16] = {"F16", 2},
    [LUNAR_DTYPE_BF16] = {"BF16", 2},   [LUNAR_DTYPE_F8_E4M3] = {"F8_E4M3", 1},
    [LUNAR_DTYPE_U8] = {"U8", 1},       [LUNAR_DTYPE_I8] = {"I8", 1},
    [LUNAR_DTYPE_I32] = {"I32", 4},     [LUNAR_DTYPE_I64] = {"I64", 8},
    [LUNAR_DTYPE_F64] = {"F64", 8},
};

size_t lunar_dtype_size(lunar_dtype dt) {
    LUNAR_ASSERT(dt >= 0 && dt < LUNAR_DTYPE_COUNT);
    return dtype_info[dt].size;
}

const char *lunar_dtype_name(lunar_dtype dt) {
    LUNAR_ASSERT(dt >= 0 && dt < LUNAR_DTYPE_COUNT);
    return dtype_info[dt].name;
}

int lunar_dtype_from_name(const char *name, lunar_dtype *out) {
    for (int i = 0; i < LUNAR_DTYPE_COUNT; i++) {
        if (strcmp(name, dtype_info[i].name) == 0) {
            *out = (lunar_dtype)i;
            return 0;
        }
    }
    return -1;
}

int64_t lunar_tensor_numel(const lunar_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

const char *lunar_shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t len = 0;
    len += (size_t)snprintf(buf + len, cap - len, "[");
    for (int i = 0; i < ndim && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (len < cap) snprintf(buf + len, cap - len, "]");
    return buf;
}

lunar_tensor lunar_tensor_rows(const lunar_tensor *t, int64_t row0, int64_t nrows) {
    LUNAR_ASSERT(t->ndim >= 1 && row0 >= 0 && nrows >= 0 && row0 + nrows <= t->shape[0]);
    lunar_tensor v = *t;
    size_t row_bytes = t->shape[0] ? t->nbytes / (size_t)t->shape[0] : 0;
    v.shape[0] = nrows;
    v.data = (const uint8_t *)t->data + (size_t)row0 * row_bytes;
    v.nbytes = (size_t)nrows * row_bytes;
    return v;
}

float lunar_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: value = man * 2^-24 */
            float f = ldexpf((float)man, -24);
            return sign ? -f : f;
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

uint16_t lunar_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    float a = fabsf(f);
    if (isnan(f)) return sign | 0x7e00;
    if (a >= 65520.0f) return sign | 0x7c00; /* rounds to inf */
    if (a < 6.103515625e-05f) {              /* subnormal half: multiples of 2^-24 */
        float m = nearbyintf(a * 16777216.0f);
        return sign | (uint16_t)m;
    }
    int e;
    float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    float mant = nearbyintf((m * 2.0f - 1.0f) * 1024.0f);
    int exp = e - 1 + 15;
    if (mant >= 1024.0f) {
        mant = 0;
        exp++;
    }
    if (exp >= 31) return sign | 0x7c00;
    return sign | (uint16_t)(exp << 10) | (uint16_t)mant;
}

float lunar_e4m3_to_f32(uint8_t v) {
    int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
    float f;
    if (exp == 0xf && man == 7) return NAN;
    if (exp == 0)
        f = ldexpf((float)man, -9); /* subnormal: man/8 * 2^-6 */
    else
        f = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -f : f;
}

uint8_t lunar_f32_to_e4m3(float f) {
    if (isnan(f)) return 0x7f;
    uint8_t sign = signbit(f) ? 0x80 : 0;
    float a = fabsf(f);
    if (a >= 448.0f) return sign | 0x7e; /* saturate to the largest finite value */
    if (a < ldexpf(1.0f, -6)) {          /* subnormal range: multiples of 2^-9 */
        float m = nearbyintf(a * 512.0f);
        return sign | (uint8_t)m; /* m == 8 encodes the smallest normal, which is correct */
    }
    int e;
    float m = frexpf(a, &e); /* a = m*2^e, m in [0.5,1) -> 1.mmm * 2^(e-1) */
    float mant = nearbyintf((m * 2.0f - 1.0f) * 8.0f);
    int exp = e - 1 + 7;
    if (mant >= 8.0f) {
        mant = 0;
        exp++;
    }
    if (exp > 15 || (exp == 15 && mant > 6)) return sign | 0x7e;
    return sign | (uint8_t)(exp << 3) | (uint8_t)mant;
}

float lunar_tensor_get_f32(const lunar_tensor *t, int64_t i) {
    float f;
    lunar_tensor_read_f32(t, i, 1, &f);
    return f;
}

void lunar_tensor_read_f32(const lunar_tensor *t, int64_t i0, int64_t n, float *dst) {
    LUNAR_ASSERT(i0 >= 0 && (size_t)(i0 + n) * lunar_dtype_size(t->dtype) <= t->nbytes);
    switch (t->dtype) {
    case LUNAR_DTYPE_F32:
        memcpy(dst, (const float *)t->data + i0, (size_t)n * sizeof(float));
        break;
    case LUNAR_DTYPE_BF16: {
        const uint16_t *s = (const uint16_t *)t->data + i0;
        for (int64_t i = 0; i < n; i++) dst[i] = lunar_bf16_to_f32(s[i]);
        break;
    }
    case LUNAR_DTYPE_F16: {
        const uint16_t *s = (const uint16_t *)t->data + i0;
        for (int64_t i = 0; i < n; i++) dst[i] = lunar_f16_to_f32(s[i]);
        break;
    }
    case LUNAR_DTYPE_F8_E4M3: {
        const uint8_t *s = (const uint8_t *)t->data + i0;
        for (int64_t i = 0; i < n; i++) dst[i] = lunar_e4m3_to_f32(s[i]);
        break;
    }
    case LUNAR_DTYPE_F64: {
        const double *s = (const double *)t->data + i0;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
        break;
    }
    default:
        fprintf(stderr, "lunar_tensor_read_f32: tensor %s has non-float dtype %s\n",
                t->name ? t->name : "?", lunar_dtype_name(t->dtype));
        abort();
    }
}
