/* The value generator of `--load-format dummy`, shared verbatim by the CPU (model/dummy.c) and the
 * device (backend/cuda/cuda_dummy.cu): element i of a tensor is a pure function of the tensor's
 * key (a hash of its name and the seed) and i, so any slice of any tensor can be generated on its
 * own, in parallel, on either side, and the two sides agree bit for bit.
 *
 * Bit-exactness between host and device: every value is produced by at most one rounding step.
 *   UNIFORM: (k - 2^23) * (a / 2^23) with k a 24-bit integer: an exact integer times one float,
 *            one rounding; there is no add a compiler could contract into an FMA.
 *   RANGE:   lo + k * step with step a power of two, lo a multiple of step and |values| < 2^10:
 *            both the product and the sum are exact, so FMA or not gives the same float.
 *   MXFP4:   E2M1 code from the hash, E8M0 scale from the hash; the dequantised value is a table
 *            entry times a power of two (exact).
 * BF16 conversion is integer round-to-nearest-even on the float's bits on both sides. */
#ifndef LUNAR_MODEL_DUMMY_GEN_H
#define LUNAR_MODEL_DUMMY_GEN_H

#include <stdint.h>

#ifdef __CUDACC__
#define LUNAR_DUMMY_FN static __host__ __device__ __forceinline__
#else
#define LUNAR_DUMMY_FN static inline
#endif

typedef enum lunar_dummy_kind {
    LUNAR_DUMMY_UNIFORM = 0, /* U(-a, a) on a 2^24 grid */
    LUNAR_DUMMY_CONST = 1,   /* every element = a */
    LUNAR_DUMMY_RANGE = 2,   /* lo + k * step, k uniform in [0, n_steps) */
    LUNAR_DUMMY_MXFP4 = 3,   /* E2M1 codes with E8M0 block scales 2^(exp0 - {0,1}) */
} lunar_dummy_kind;

typedef struct lunar_dummy_gen {
    uint64_t key;    /* hash of (seed, tensor name); MXFP4: of the name without .weight_packed/_scale */
    int32_t kind;    /* lunar_dummy_kind */
    float a;         /* UNIFORM: a / 2^23 (the step of the grid); CONST: the value */
    float lo, step;  /* RANGE */
    uint32_t n_steps;
    int32_t exp0;    /* MXFP4: E8M0 byte of the larger block scale (127 + log2 scale) */
    int64_t in;      /* MXFP4: logical input width (columns) of the matrix */
} lunar_dummy_gen;

/* splitmix64's finaliser over key + i * golden ratio: a counter-based generator. */
LUNAR_DUMMY_FN uint64_t lunar_dummy_hash(uint64_t key, uint64_t i) {
    uint64_t x = key + (i + 1) * 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* A different stream of the same tensor (MXFP4 block scales). */
#define LUNAR_DUMMY_SCALE_SALT 0x5CA1E5CA1E5CA1E5ull

/* Element i of a float tensor (UNIFORM, CONST, RANGE). */
LUNAR_DUMMY_FN float lunar_dummy_value(const lunar_dummy_gen *g, uint64_t i) {
    if (g->kind == LUNAR_DUMMY_CONST) return g->a;
    uint64_t h = lunar_dummy_hash(g->key, i);
    if (g->kind == LUNAR_DUMMY_RANGE) {
        uint32_t k = (uint32_t)((h >> 32) % g->n_steps);
        return g->lo + (float)k * g->step;
    }
    int32_t k = (int32_t)(h >> 40) - (1 << 23); /* [-2^23, 2^23) */
    return (float)k * g->a;
}

/* E2M1 (OCP MX FP4) magnitudes by the low three bits of the code; bit 3 is the sign. */
LUNAR_DUMMY_FN float lunar_dummy_e2m1(uint32_t code) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float v = mag[code & 7u];
    return (code & 8u) ? -v : v;
}

/* The 4-bit code of logical element (r, c) of an MXFP4 matrix [out, in]. */
LUNAR_DUMMY_FN uint32_t lunar_dummy_mxfp4_code(const lunar_dummy_gen *g, int64_t r, int64_t c) {
    return (uint32_t)(lunar_dummy_hash(g->key, (uint64_t)(r * g->in + c)) >> 60);
}

/* Byte j of the packed tensor [out, in/2]: column 2j' in the low nibble (compressed-tensors). */
LUNAR_DUMMY_FN uint8_t lunar_dummy_mxfp4_packed(const lunar_dummy_gen *g, uint64_t j) {
    const int64_t half = g->in / 2, r = (int64_t)(j / (uint64_t)half), c = 2 * (int64_t)(j % (uint64_t)half);
    return (uint8_t)(lunar_dummy_mxfp4_code(g, r, c) | (lunar_dummy_mxfp4_code(g, r, c + 1) << 4));
}

/* Byte j of the scale tensor [out, in/32]: exp0 or exp0 - 1, so blocks differ as in a checkpoint. */
LUNAR_DUMMY_FN uint8_t lunar_dummy_mxfp4_scale(const lunar_dummy_gen *g, uint64_t j) {
    return (uint8_t)(g->exp0 - (int32_t)(lunar_dummy_hash(g->key ^ LUNAR_DUMMY_SCALE_SALT, j) >> 63));
}

/* 2^e for e in the E8M0 range, by building the float's bits (exact on both sides). */
LUNAR_DUMMY_FN float lunar_dummy_pow2(int32_t e) {
    union { uint32_t u; float f; } b;
    b.u = (uint32_t)(e + 127) << 23;
    return b.f;
}

/* The dequantised value of logical element (r, c): code * 2^(scale - 127). */
LUNAR_DUMMY_FN float lunar_dummy_mxfp4_value(const lunar_dummy_gen *g, int64_t r, int64_t c) {
    const uint8_t s = lunar_dummy_mxfp4_scale(g, (uint64_t)(r * (g->in / 32) + c / 32));
    return lunar_dummy_e2m1(lunar_dummy_mxfp4_code(g, r, c)) * lunar_dummy_pow2((int32_t)s - 127);
}

/* fp32 -> bf16, round to nearest even (values here are finite). */
LUNAR_DUMMY_FN uint16_t lunar_dummy_bf16(float f) {
    union { uint32_t u; float f; } b;
    b.f = f;
    uint32_t u = b.u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
