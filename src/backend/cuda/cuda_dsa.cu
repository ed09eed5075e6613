// DSA lightning indexer (SPEC 1.1) on the paged FP8 index-key cache: key write (Hadamard + pow2
// FP8), scoring, and the exact top-k selection.
//
// Bitwise equality with the CPU op (src/backend/cpu/indexer.c, quant.c):
//  - write: the Hadamard butterflies are the CPU's fp32 a + b / a - b in the same stage order, then
//    one fp32 multiply by the same norm; amax is a max (order-free); amax / 448, the exponent bit
//    trick, x / scale and the e4m3 rounding are ported statement for statement (IEEE division
//    without fast-math, explicit _rn intrinsics).
//  - score: a dot of two e4m3 vectors is exact in double (products are 8-bit-mantissa multiples of
//    2^-18, |dot| <= 128 * 448^2 < 2^25: 43 bits), so any summation order gives the CPU's value;
//    the head sum acc += (w_h * sq_h) * dot is done in double in head order with __dmul_rn /
//    __dadd_rn (no contraction; the CPU is built -std=c11, where GCC does not contract, and plain
//    x86-64 has no FMA), then (float)(acc * ks) with ks a power of two: the same fp32 rounding of
//    the same double. Hence identical fp32 scores, and the selection below is exact on them.
//  - top-k: radix select on the 64-bit key (order-preserving score bits << 32 | ~position): keys are
//    unique, their order is the CPU heap's order (higher score, then lower position; -0 is folded
//    to +0 since the CPU compares them equal), so the k largest keys are the CPU's set.
// Cost: the exact dots run as int8 limb GEMMs on the tensor cores (index_score_i8_kernel, the
// default) or, with LUNAR_DSA_SCORE=fp64, in fp64 on the CUDA cores (index_score_kernel: tile GEMM,
// 4 heads x 4 positions per thread, operands as doubles in shared memory); both compute- or
// latency-bound, not bandwidth-bound (docs/benchmarks.md).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_mla_wgmma.h" // lunar_mla_sm_count

namespace {

// quant.c: scale = 2^ceil(log2(amax / 448)) by the bits of the fp32 quotient
__device__ __forceinline__ float pow2_scale(float amax) {
    const float s = __fdiv_rn(amax, 448.0f);
    const uint32_t bits = __float_as_uint(s);
    const int e = (int)((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffffu) != 0);
    return __uint_as_float((uint32_t)(e + 127) << 23);
}
__device__ __forceinline__ uint8_t quant1(float x, float scale) {
    float v = __fdiv_rn(x, scale);
    if (v > 448.0f) v = 448.0f;
    if (v < -448.0f) v = -448.0f;
    return f32_to_e4m3(v);
}

// ---------------------------------------------------------------- key write
// v[0, d): a key row in shared memory, rotated in place, then its codes and scale written to the slot;
// blockDim.x >= max(d, 32): the lanes past d hold nothing and write nothing (the shuffles name all 32)
__device__ __forceinline__ void index_write_row(uint8_t *codes, float *scales, float *v, float *wmax, size_t slot,
                                                int d, float norm) {
    const int i = threadIdx.x;
    const bool on = i < d;
    __syncthreads();
    for (int h = 1; h < d; h <<= 1) {
        const float x = !on ? 0.0f : (i & h) ? __fsub_rn(v[i - h], v[i]) : __fadd_rn(v[i], v[i + h]);
        __syncthreads();
        if (on) v[i] = x;
        __syncthreads();
    }
    const float x = on ? __fmul_rn(v[i], norm) : 0.0f;
    float m = fabsf(x);
    m = m > 1e-4f ? m : 1e-4f; // NaN never wins, as on the CPU
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((i & 31) == 0) wmax[i >> 5] = m;
    __syncthreads();
    float amax = 1e-4f;
    for (int j = 0; j < (d + 31) / 32; j++) amax = fmaxf(amax, wmax[j]);
    const float scale = pow2_scale(amax);
    if (on) codes[slot * d + i] = quant1(x, scale);
    if (i == 0) scales[slot] = scale;
}

// blockDim.x = max(d, 32)
__global__ void index_write_kernel(uint8_t *codes, float *scales, const float *k, const int32_t *slots,
                                   int d, float norm) {
    extern __shared__ float v[];
    __shared__ float wmax[32];
    pdl_enter();
    const int i = threadIdx.x, tok = blockIdx.x;
    if (i < d) v[i] = k[(size_t)tok * d + i];
    index_write_row(codes, scales, v, wmax, (size_t)slots[tok], d, norm);
}

// The indexer's per-token prep in one launch (lunar_cuda_dsa_index_prep), 128 threads a block (as the
// glue kernels it replaces): block (t, 0) the key: layernorm_block into shared memory, then
// index_write_row; and the head weights' scale (lunar_glue_scale's multiply); block (t, 1 + h) query
// head h's hadamard_block and norm (lunar_glue_hadamard's), in place. The shared statements: their bits.
__global__ void __launch_bounds__(128) index_prep_kernel(uint8_t *codes, float *scales, const float *ik, float *iq,
                                                         float *wt, const int32_t *slots, int ni, int d,
                                                         const float *lw, const float *lb, float eps,
                                                         float wscale, float norm) {
    __shared__ float v[128];
    __shared__ float wmax[32];
    __shared__ double red[32];
    pdl_enter();
    const int tok = blockIdx.x, i = threadIdx.x;
    if (blockIdx.y > 0) {
        float *r = iq + ((size_t)tok * ni + blockIdx.y - 1) * d;
        for (int j = i; j < d; j += blockDim.x) v[j] = r[j];
        hadamard_block(v, d);
        for (int j = i; j < d; j += blockDim.x) r[j] = v[j] * norm;
        return;
    }
    for (int j = i; j < ni; j += blockDim.x) wt[(size_t)tok * ni + j] *= wscale;
    layernorm_block(v, ik + (size_t)tok * d, lw, lb, d, eps, red);
    index_write_row(codes, scales, v, wmax, (size_t)slots[tok], d, norm);
}

// ---------------------------------------------------------------- scores
constexpr int kDP = 128, kThreads = 256, kTilesPerBlock = 4;

template <int NHP> __global__ void __launch_bounds__(kThreads, 1)
index_score_kernel(float *scores, int ld, const float *iq, const float *w, const uint8_t *codes,
                   const float *kscales, const int32_t *block_tables, int max_blocks,
                   const int32_t *row_seq, const int32_t *lens, int nh, int d) {
    pdl_enter();
    constexpr int PT = 64 * 64 / NHP; // positions per tile
    constexpr int TX = PT / 4;        // position groups
    extern __shared__ __align__(16) unsigned char smem[];
    double *Q = reinterpret_cast<double *>(smem);   // [kDP][NHP]
    double *K = Q + kDP * NHP;                      // [kDP][PT], then dots [PT][NHP + 1]
    double *wq = K + kDP * PT;                      // [NHP]
    float *ks = reinterpret_cast<float *>(wq + NHP); // [PT]
    const int row = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n = lens[row];
    const int seq = row_seq ? row_seq[row] : row;
    const int32_t *bt = block_tables + (size_t)seq * max_blocks;
    const int tile0 = blockIdx.x * kTilesPerBlock;
    if (tile0 * PT >= n) return;

    // query heads, quantised like keys: Q[i][h] = e4m3 value, wq[h] = w_h * sq_h (double)
    for (int h = warp; h < NHP; h += kThreads / 32) {
        float x[4], m = 1e-4f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = lane + 32 * j;
            x[j] = (h < nh && i < d) ? iq[((size_t)row * nh + h) * d + i] : 0.0f;
            const float a = fabsf(x[j]);
            m = a > m ? a : m;
        }
        for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const float sq = pow2_scale(m);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = lane + 32 * j;
            Q[i * NHP + h] = (h < nh && i < d) ? (double)e4m3_to_f32(quant1(x[j], sq)) : 0.0;
        }
        if (lane == 0) wq[h] = h < nh ? __dmul_rn((double)w[(size_t)row * nh + h], (double)sq) : 0.0;
    }
    const int tx = tid % TX, ty = tid / TX;
    for (int tile = tile0; tile < tile0 + kTilesPerBlock && tile * PT < n; tile++) {
        const int p0 = tile * PT;
        __syncthreads();
        // key tile: 16-byte chunks, consecutive threads on consecutive positions
        for (int c = tid; c < PT * (kDP / 16); c += kThreads) {
            const int p = c % PT, col = c / PT, pos = p0 + p;
            uint4 v = make_uint4(0, 0, 0, 0);
            float sc = 0.0f;
            if (pos < n && col * 16 < d) {
                const size_t slot = (size_t)bt[pos >> 7] * 128 + (pos & 127);
                v = *reinterpret_cast<const uint4 *>(codes + slot * d + col * 16);
                sc = kscales[slot];
            }
            if (col == 0) ks[p] = sc;
            const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 16; j++)
                K[(col * 16 + j) * PT + p] = (double)e4m3_to_f32((uint8_t)(wv[j >> 2] >> (8 * (j & 3))));
        }
        __syncthreads();
        double acc[4][4];
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) acc[a][b] = 0.0;
        const int dd = (d + 15) & ~15;
#pragma unroll 4
        for (int i = 0; i < dd; i++) {
            const double2 q01 = *reinterpret_cast<const double2 *>(Q + i * NHP + ty * 4);
            const double2 q23 = *reinterpret_cast<const double2 *>(Q + i * NHP + ty * 4 + 2);
            const double2 k01 = *reinterpret_cast<const double2 *>(K + i * PT + tx * 4);
            const double2 k23 = *reinterpret_cast<const double2 *>(K + i * PT + tx * 4 + 2);
            const double qv[4] = {q01.x, q01.y, q23.x, q23.y}, kv[4] = {k01.x, k01.y, k23.x, k23.y};
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int b = 0; b < 4; b++) acc[a][b] = fma(qv[a], kv[b], acc[a][b]); // exact
        }
        __syncthreads();
        double *D = K; // [PT][NHP + 1]
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) D[(tx * 4 + b) * (NHP + 1) + ty * 4 + a] = acc[a][b];
        __syncthreads();
        for (int p = tid; p < PT; p += kThreads) {
            const int pos = p0 + p;
            if (pos >= n) continue;
            double s = 0.0;
            for (int h = 0; h < nh; h++) {
                const double dot = D[p * (NHP + 1) + h];
                if (dot > 0) s = __dadd_rn(s, __dmul_rn(wq[h], dot));
            }
            scores[(size_t)row * ld + pos] = __double2float_rn(__dmul_rn(s, (double)ks[p]));
        }
    }
}

template <int NHP> size_t score_smem() {
    constexpr int PT = 64 * 64 / NHP;
    return (size_t)kDP * NHP * 8 + (size_t)kDP * PT * 8 + NHP * 8 + PT * 4;
}

// ---------------------------------------------------------------- scores on the int8 tensor cores
// The same exact dots as index_score_kernel, as integer GEMMs (LUNAR_DSA_SCORE=fp64 keeps the
// kernel above). Why the result is bitwise the fp64 kernel's (and so the CPU's):
//  - an e4m3 value is N * 2^-9 with N an integer: subnormals f * 2^-9, normals (8 + f) * 2^(E-10),
//    E >= 1; |N| <= 448 * 2^9 = 229376 < 2^18.
//  - N in signed base-256 digits: a0 = N mod 256 in [-128, 127], N1 = (N - a0) / 256 (|N1| <= 896),
//    a1 = N1 mod 256 in [-128, 127], a2 = (N1 - a1) / 256 with |a2| <= (896 + 128) / 256 = 4; so
//    N = a0 + 2^8 a1 + 2^16 a2 with three int8 limbs (two cannot hold 18 bits).
//  - q.k = 2^-18 sum_i Nq_i Nk_i = 2^-18 sum_{u,v} 2^(8(u+v)) (Aq_u . Ak_v): nine limb GEMMs
//    (mma.sync m16n8k32 s8, int32 accumulation), those of equal weight u + v into one of five int32
//    accumulators. Per dimension a weight holds at most three limb products (weight 2:
//    |a0 b2 + a1 b1 + a2 b0| <= 128*4 + 128*128 + 4*128 = 17408), so over 128 dimensions
//    |acc| <= 2.3e6 < 2^31: no int32 overflow for any codes.
//  - v = sum_w acc_w 2^(8w) in int64 is sum_i Nq_i Nk_i exactly, |v| <= 128 * 229376^2 < 2^43, so
//    (double)v * 2^-18 is exact: the very double the CPU's (exact) dot holds. From there the head
//    sum, the scale and the fp32 rounding are the fp64 kernel's statements.
//  - NaN codes (0x7f / 0xff, only from NaN inputs: the quantiser clamps to +-448) have no integer
//    value: the limb table maps them to 0 and they are flagged instead. On the CPU a NaN query code
//    makes that head's dots NaN, which "dot > 0" drops: here that head's weight is 0, which adds
//    +0 to a sum that is never -0 (it starts at +0 and round-to-nearest never yields -0 from a sum
//    with a nonzero term) - the same sum. A NaN key code makes all its dots NaN: score +0.
// Layout: a block takes R query rows (M = R * NHP heads, one m16 tile per warp row) and walks
// tiles of PT positions: the tile's codes are read once (32 bytes per thread, coalesced), turned
// into limbs through a 256-entry table and stored in shared memory; each warp then runs its
// n8 tiles with its query limbs held in registers for the whole block. K is permuted so that both
// fragments are 32 contiguous bytes per thread: in k-step j, byte b of register a0/b0 of lane
// (g, t) is dimension 32t + 8j + b and of a2/b1 dimension 32t + 8j + 4 + b (a dot does not care
// about the order of K, only that A and B agree). Dots go to shared memory as doubles, then one
// thread per (row, position) sums the heads in head order as the CPU.
// Rows of one block may belong to different sequences (their keys differ): the block then runs one
// pass per distinct sequence, only that sequence's rows storing (correct, R times the work; the
// host picks R > 1 only for many rows, where a sequence's rows are consecutive).

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// e4m3 code -> its limbs a0, a1, a2 in bytes 0..2 (NaN codes -> 0, flagged by the callers)
__device__ __forceinline__ uint32_t e4m3_limbs(int c) {
    const float f = e4m3_to_f32((uint8_t)c);
    const int n = isnan(f) ? 0 : (int)__fmul_rn(f, 512.0f); // exact: f is a multiple of 2^-9
    const int a0 = ((n + 128) & 255) - 128, n1 = (n - a0) / 256;
    const int a1 = ((n1 + 128) & 255) - 128, a2 = (n1 - a1) / 256;
    return (uint32_t)(a0 & 255) | (uint32_t)(a1 & 255) << 8 | (uint32_t)(a2 & 255) << 16;
}

// four codes (one word) -> the three limb words, byte i of each from code i
__device__ __forceinline__ void limbs4(uint32_t &o0, uint32_t &o1, uint32_t &o2, uint32_t w, const uint32_t *lut) {
    const uint32_t l0 = lut[w & 255u], l1 = lut[(w >> 8) & 255u], l2 = lut[(w >> 16) & 255u], l3 = lut[w >> 24];
    const uint32_t t01 = __byte_perm(l0, l1, 0x5140), t23 = __byte_perm(l2, l3, 0x5140); // a0, a0', a1, a1'
    o0 = __byte_perm(t01, t23, 0x5410);
    o1 = __byte_perm(t01, t23, 0x7632);
    o2 = __byte_perm(__byte_perm(l0, l1, 0x0062), __byte_perm(l2, l3, 0x0062), 0x5410);
}

__device__ __forceinline__ void cp_async16(void *smem, const void *g) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(g));
}
__device__ __forceinline__ void cp_async4(void *smem, const void *g) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(a), "l"(g));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// quant1 with x * (1 / scale) for x / scale: scale is a power of two 2^e with e in [-21, 120] (amax
// >= 1e-4, <= FLT_MAX / 448) or +inf, so 1 / scale is exact (or +0), and both expressions are the
// correct rounding of the same real x * 2^-e (inf and NaN cases: x * 0 and x / inf agree too)
__device__ __forceinline__ uint8_t quant1_inv(float x, float inv) {
    float v = __fmul_rn(x, inv);
    if (v > 448.0f) v = 448.0f;
    if (v < -448.0f) v = -448.0f;
    return f32_to_e4m3(v);
}

template <int NHP, int R> struct I8Tile {
    static constexpr int MT = R * NHP / 16;     // m16 tiles = warps along M
    static constexpr int NG = kThreads / 32 / MT; // warps along the positions
    static constexpr int NT8 = MT == 8 ? 8 : 4; // n8 tiles per warp per tile
    static constexpr int PT = 8 * NT8 * NG;     // positions per tile
    static constexpr int TPB = 512 / PT;        // most tiles per block (the pipelined launch may take fewer)
    static constexpr int KS = 3 * 128 + 16;     // bytes per key's limbs (the pad spreads 8 lanes' 16 B over all banks)
    static constexpr int RS = 128 + 16;         // bytes per key's raw codes (same reason)
    static constexpr int HS = NHP + 1;          // doubles per (row, position) of dots
    static constexpr size_t smem = (size_t)PT * KS + (size_t)R * PT * HS * 8 + (size_t)R * NHP * 8 + PT * 4 + 256 * 4;
    static constexpr size_t smem_pipe = smem + (size_t)PT * RS + PT * 4; // + the next tile's raw codes and scales
    static_assert(MT * NG == kThreads / 32 && PT * 4 % kThreads == 0 && kThreads == 256, "tile shape");
    static_assert(TPB * PT <= 512, "a block's positions span at most 5 pages of 128 (s_bt)");
};

// PIPE = false is the round-1 kernel (LUNAR_DSA_SCORE=int8-sync): each tile's codes are loaded
// (block table, then codes) after the previous tile's math, tpb = TPB tiles per block. PIPE = true
// (LUNAR_DSA_SCORE=int8-pipe): the codes go by cp.async into RAW, the first tile's issued before the
// query quantisation and the next tile's under this tile's math, and the host takes fewer tiles per
// block when rows x tiles would leave SMs idle. Small cases are a chain of dependent memory
// latencies (lens, block table, codes, then the head sum): the pipeline overlaps them. The values
// computed are the same statements on the same bytes: the scores are bitwise the same.
template <int NHP, int R, bool PIPE> __global__ void __launch_bounds__(kThreads, 2)
index_score_i8_kernel(float *scores, int ld, const float *iq, const float *w, const uint8_t *codes,
                      const float *kscales, const int32_t *block_tables, int max_blocks,
                      const int32_t *row_seq, const int32_t *lens, int rows, int nh, int d, int tpb) {
    pdl_enter();
    using T = I8Tile<NHP, R>;
    constexpr int PT = T::PT, MT = T::MT, KS = T::KS, HS = T::HS, RS = T::RS;
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char *KL = smem;                                          // [PT][KS]: limb l at l * 128
    double *D = reinterpret_cast<double *>(smem + (size_t)PT * KS);    // [R][PT][HS]
    double *wq = D + (size_t)R * PT * HS;                              // [R][NHP]
    float *ks = reinterpret_cast<float *>(wq + R * NHP);               // [PT], -1: a NaN code
    uint32_t *lut = reinterpret_cast<uint32_t *>(ks + PT);             // [256]
    unsigned char *RAW = reinterpret_cast<unsigned char *>(lut + 256); // PIPE: [PT][RS] a tile's codes
    float *RAWS = reinterpret_cast<float *>(RAW + (size_t)PT * RS);    // PIPE: [PT] and their scales
    __shared__ int s_len[R], s_seq[R], s_bt[8];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.y * R, c0 = blockIdx.x * tpb * PT;
    int nmax = 0;
    for (int r = 0; r < R && r0 + r < rows; r++) nmax = max(nmax, lens[r0 + r]);
    if (c0 >= nmax) return;
    if (tid < R) {
        const int row = r0 + tid;
        s_len[tid] = row < rows ? lens[row] : 0;
        s_seq[tid] = row < rows ? (row_seq ? row_seq[row] : row) : -1;
    }
    const int mt = warp % MT, ng = warp / MT, rq = mt / (NHP / 16), hb = (mt % (NHP / 16)) * 16;
    const int qrow = r0 + rq;

    // PIPE: the codes and scales of tile q0 (of a sequence of n keys) into RAW, RAWS by cp.async,
    // the pages from s_bt (page pg0 first) or, before s_bt is filled, from the block table itself
    auto fetch = [&](int q0, int n, const int32_t *bt, int pg0, bool direct) {
        for (int it = tid; it < PT * 8; it += kThreads) {
            const int p = it >> 3, ch = it & 7, pos = q0 + p;
            if (pos < n && ch * 16 < d) {
                const int page = direct ? bt[pos >> 7] : s_bt[(pos >> 7) - pg0];
                const size_t slot = (size_t)page * 128 + (pos & 127);
                cp_async16(RAW + p * RS + ch * 16, codes + slot * d + ch * 16);
                if (ch == 0) cp_async4(RAWS + p, kscales + slot);
            }
        }
        cp_commit();
    };
    if (PIPE) {
        // this thread's query lines toward L2 first (no wait), then the first pass's first tile: the
        // first pass is row r0's sequence (the pass loop below), its length the longest of its rows
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int h = hb + g + 8 * half;
            if (qrow < rows && h < nh && 32 * t < d)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(iq + ((size_t)qrow * nh + h) * d + 32 * t));
        }
        const int S0 = row_seq ? row_seq[r0] : r0;
        int n0 = 0;
        for (int r = 0; r < R && r0 + r < rows; r++)
            if ((row_seq ? row_seq[r0 + r] : r0 + r) == S0) n0 = max(n0, lens[r0 + r]);
        fetch(c0, min(n0, c0 + tpb * PT), block_tables + (size_t)S0 * max_blocks, 0, true);
    }
    lut[tid] = e4m3_limbs(tid);

    // query limbs of this warp's m16 tile: row rq of the block, heads hb + g (a0, a2) and
    // hb + g + 8 (a1, a3), dimensions 32t .. 32t + 31; quantised as the keys (the fp64 kernel's
    // statements; the amax over a head's 128 dimensions is over its 4 lanes t)
    __syncthreads(); // lut
    uint32_t qa[3][4][4];
#pragma unroll
    for (int l = 0; l < 3; l++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) qa[l][j][k] = 0;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int h = hb + g + 8 * half;
        const bool on = qrow < rows && h < nh;
        float x[32];
#pragma unroll
        for (int q = 0; q < 8; q++) {
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (on && 32 * t + 4 * q < d)
                v = *reinterpret_cast<const float4 *>(iq + ((size_t)qrow * nh + h) * d + 32 * t + 4 * q);
            x[4 * q] = v.x, x[4 * q + 1] = v.y, x[4 * q + 2] = v.z, x[4 * q + 3] = v.w;
        }
        float m = 1e-4f;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(x[i]);
            m = a > m ? a : m; // NaN never wins
        }
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float sq = pow2_scale(m), inv = __frcp_rn(sq);
        unsigned bad = 0;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            const uint8_t c = PIPE ? quant1_inv(x[i], inv) : quant1(x[i], sq);
            bad |= (c & 0x7fu) == 0x7fu;
            const uint32_t lw = lut[c];
            const int j = i >> 3, reg = ((i >> 2) & 1) * 2 + half, sh = 8 * (i & 3);
#pragma unroll
            for (int l = 0; l < 3; l++) qa[l][j][reg] |= ((lw >> (8 * l)) & 255u) << sh;
        }
        bad |= __shfl_xor_sync(0xffffffffu, bad, 1);
        bad |= __shfl_xor_sync(0xffffffffu, bad, 2);
        if (t == 0)
            wq[rq * NHP + h] = on && !bad ? __dmul_rn((double)w[(size_t)qrow * nh + h], (double)sq) : 0.0;
    }

    for (int pi = 0; pi < R; pi++) { // one pass per distinct sequence of the block's rows
        const int S = s_seq[pi];
        bool seen = S < 0;
        for (int j = 0; j < pi; j++) seen |= s_seq[j] == S;
        if (seen) continue;
        int n = 0;
        for (int j = 0; j < R; j++)
            if (s_seq[j] == S) n = max(n, s_len[j]);
        const int32_t *bt = block_tables + (size_t)S * max_blocks;
        const int cend = min(n, c0 + tpb * PT), pg0 = c0 >> 7;
        if (c0 >= cend) continue; // (pass 0's prologue fetch issued nothing then)
        if (PIPE) {
            __syncthreads(); // the previous pass is done with s_bt and RAW
            if (tid <= ((cend - 1) >> 7) - pg0) s_bt[tid] = bt[pg0 + tid];
            __syncthreads();
            if (pi > 0) fetch(c0, cend, bt, pg0, false);
        }
        for (int p0 = c0; p0 < cend; p0 += PT) {
            if (PIPE) cp_wait_all(); // this thread's pieces of tile p0 are in; the barrier: everyone's
            __syncthreads(); // the previous tile's dots, scales and limbs are consumed
            for (int it = tid; it < PT * 4; it += kThreads) { // 32 bytes of key p0 + p at byte 32c
                const int p = it >> 2, c = it & 3, pos = p0 + p;
                uint4 v0 = make_uint4(0, 0, 0, 0), v1 = v0;
                float sc = 0.0f;
                if (pos < n) {
                    if (PIPE) {
                        const uint4 *src = reinterpret_cast<const uint4 *>(RAW + p * RS + 32 * c);
                        if (32 * c < d) v0 = src[0];
                        if (32 * c + 16 < d) v1 = src[1];
                        sc = RAWS[p];
                    } else {
                        const size_t slot = (size_t)bt[pos >> 7] * 128 + (pos & 127);
                        const uint8_t *src = codes + slot * d + 32 * c;
                        if (32 * c < d) v0 = *reinterpret_cast<const uint4 *>(src);
                        if (32 * c + 16 < d) v1 = *reinterpret_cast<const uint4 *>(src + 16);
                        sc = kscales[slot];
                    }
                }
                const uint32_t wv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
                uint32_t o[3][8], kbad = 0;
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    kbad |= __vcmpeq4(wv[q] | 0x80808080u, 0xffffffffu);
                    limbs4(o[0][q], o[1][q], o[2][q], wv[q], lut);
                }
                uint4 *dst = reinterpret_cast<uint4 *>(KL + (size_t)p * KS) + 2 * c;
#pragma unroll
                for (int l = 0; l < 3; l++) {
                    dst[8 * l] = make_uint4(o[l][0], o[l][1], o[l][2], o[l][3]);
                    dst[8 * l + 1] = make_uint4(o[l][4], o[l][5], o[l][6], o[l][7]);
                }
                kbad |= __shfl_xor_sync(0xffffffffu, kbad, 1); // the key's 4 lanes are adjacent
                kbad |= __shfl_xor_sync(0xffffffffu, kbad, 2);
                if (c == 0) ks[p] = kbad ? -1.0f : sc;
            }
            __syncthreads();
            if (PIPE && p0 + PT < cend) fetch(p0 + PT, cend, bt, pg0, false); // RAW is free: the next tile under this one's math
#pragma unroll 1
            for (int q8 = 0; q8 < T::NT8; q8++) {
                const int pb = (ng * T::NT8 + q8) * 8;
                const uint4 *src = reinterpret_cast<const uint4 *>(KL + (size_t)(pb + g) * KS + 32 * t);
                uint32_t kb[3][8];
#pragma unroll
                for (int l = 0; l < 3; l++) {
                    const uint4 x = src[8 * l], y = src[8 * l + 1];
                    kb[l][0] = x.x, kb[l][1] = x.y, kb[l][2] = x.z, kb[l][3] = x.w;
                    kb[l][4] = y.x, kb[l][5] = y.y, kb[l][6] = y.z, kb[l][7] = y.w;
                }
                int acc[5][4];
#pragma unroll
                for (int u = 0; u < 5; u++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[u][e] = 0;
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int la = 0; la < 3; la++)
#pragma unroll
                        for (int lb = 0; lb < 3; lb++) mma_s8(acc[la + lb], qa[la][j], kb[lb][2 * j], kb[lb][2 * j + 1]);
                // c0, c1: head hb + g, positions pb + 2t, pb + 2t + 1; c2, c3: head hb + g + 8
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const long long v = (long long)acc[0][e] + (long long)acc[1][e] * 256 +
                                        (long long)acc[2][e] * 65536 + (long long)acc[3][e] * 16777216 +
                                        (long long)acc[4][e] * 4294967296LL;
                    const int p = pb + 2 * t + (e & 1), h = hb + g + 8 * (e >> 1);
                    D[((size_t)rq * PT + p) * HS + h] = __dmul_rn(__ll2double_rn(v), 0x1p-18); // exact
                }
            }
            __syncthreads();
            for (int i = tid; i < R * PT; i += kThreads) {
                const int r = i / PT, p = i % PT, pos = p0 + p;
                if (s_seq[r] != S || pos >= s_len[r]) continue;
                const float k = ks[p];
                float out = 0.0f; // a NaN key code: every dot NaN, no head counts (the CPU's +0)
                if (k >= 0.0f) {
                    const double *dp = D + ((size_t)r * PT + p) * HS, *wr = wq + r * NHP;
                    double s = 0.0;
                    for (int h = 0; h < nh; h++) {
                        const double dot = dp[h];
                        if (dot > 0) s = __dadd_rn(s, __dmul_rn(wr[h], dot));
                    }
                    out = __double2float_rn(__dmul_rn(s, (double)k));
                }
                scores[(size_t)(r0 + r) * ld + pos] = out;
            }
        }
    }
}

template <int NHP, int R, bool PIPE>
void launch_i8(float *scores, int ld, const float *iq, const float *w, const uint8_t *codes, const float *scales,
               const int32_t *block_tables, int max_blocks, const int32_t *row_seq, const int32_t *lens, int max_len,
               int rows, int nh, int d, cudaStream_t st) {
    using T = I8Tile<NHP, R>;
    constexpr size_t smem = PIPE ? T::smem_pipe : T::smem;
    static bool attr = false;
    if (!attr) {
        CUDA_CHECK(cudaFuncSetAttribute(index_score_i8_kernel<NHP, R, PIPE>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        attr = true;
    }
    const int sms = lunar_mla_sm_count();
    // PIPE: fewer tiles per block (each block quantises its queries again) only to give every SM a block
    const long long tiles = ceil_div_u(max_len, T::PT), groups = ceil_div_u(rows, R);
    int tpb = T::TPB;
    while (PIPE && tpb > 1 && (tiles + tpb - 1) / tpb * groups < sms) tpb /= 2;
    dim3 grid(ceil_div_u(max_len, tpb * T::PT), (unsigned)groups);
    launch_pdl(index_score_i8_kernel<NHP, R, PIPE>, dim3(grid), dim3(kThreads), smem, st, scores, ld, iq, w, codes,
               scales, block_tables, max_blocks, row_seq, lens, rows, nh, d, tpb);
}

template <bool PIPE>
void launch_i8_any(bool grouped, float *scores, int ld, const float *iq, const float *w, const uint8_t *codes,
                   const float *scales, const int32_t *block_tables, int max_blocks, const int32_t *row_seq,
                   const int32_t *lens, int max_len, int rows, int nh, int d, cudaStream_t st) {
    if (nh <= 32 && grouped)
        launch_i8<32, 4, PIPE>(scores, ld, iq, w, codes, scales, block_tables, max_blocks, row_seq, lens, max_len, rows,
                               nh, d, st);
    else if (nh <= 32)
        launch_i8<32, 1, PIPE>(scores, ld, iq, w, codes, scales, block_tables, max_blocks, row_seq, lens, max_len, rows,
                               nh, d, st);
    else if (grouped)
        launch_i8<64, 2, PIPE>(scores, ld, iq, w, codes, scales, block_tables, max_blocks, row_seq, lens, max_len, rows,
                               nh, d, st);
    else
        launch_i8<64, 1, PIPE>(scores, ld, iq, w, codes, scales, block_tables, max_blocks, row_seq, lens, max_len, rows,
                               nh, d, st);
}

// ---------------------------------------------------------------- top-k
constexpr int kTK = 1024, kBins = 4096, kCap = 3072, kUnroll = 8; // 16 + 24 KB of static shared memory

__device__ __forceinline__ unsigned long long sel_key(float s, int pos) {
    uint32_t u = __float_as_uint(s == 0.0f ? 0.0f : s);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (0xffffffffu - (uint32_t)pos);
}

// inclusive scan of v over the block's threads in index order
__device__ __forceinline__ unsigned block_scan(unsigned v, unsigned *wsum) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned x = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += x;
    }
    if (lane == 31) wsum[warp] = v;
    __syncthreads();
    if (warp == 0) {
        unsigned x = wsum[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        wsum[lane] = x;
    }
    __syncthreads();
    if (warp > 0) v += wsum[warp - 1];
    __syncthreads();
    return v;
}

__global__ void __launch_bounds__(kTK, 1) topk_kernel(int32_t *idx, int32_t *count, const float *scores,
                                                      int ld, const int32_t *lens, int topk) {
    __shared__ unsigned hist[kBins];
    __shared__ unsigned long long cand[kCap];
    __shared__ unsigned wsum[32];
    __shared__ unsigned s_digit, s_above, s_cnt, s_ncand;
    pdl_enter();
    const int row = blockIdx.x, tid = threadIdx.x;
    const int n = lens[row];
    const float *sc = scores + (size_t)row * ld;
    int32_t *out = idx + (size_t)row * topk;
    if (count && tid == 0) count[row] = n < topk ? n : topk;
    if (n <= topk) {
        for (int s = tid; s < topk; s += kTK) out[s] = s < n ? s : -1;
        return;
    }
    unsigned long long prefix = 0, mask = 0;
    unsigned krem = (unsigned)topk, ncand = 0;
    int shift = 52, bits = 12;
    bool insm = false, tie = false;
    for (;;) {
        for (int b = tid; b < kBins; b += kTK) hist[b] = 0;
        __syncthreads();
        const unsigned dm = (1u << bits) - 1;
        if (!insm) {
            for (int p0 = 0; p0 < n; p0 += kTK * kUnroll) { // loads first, then the atomics
                float v[kUnroll];
#pragma unroll
                for (int j = 0; j < kUnroll; j++) {
                    const int p = p0 + j * kTK + tid;
                    v[j] = p < n ? sc[p] : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < kUnroll; j++) {
                    const int p = p0 + j * kTK + tid;
                    const unsigned long long key = sel_key(v[j], p);
                    if (p < n && (key & mask) == prefix) atomicAdd(&hist[(unsigned)(key >> shift) & dm], 1u);
                }
            }
        } else {
            for (unsigned i = tid; i < ncand; i += kTK) {
                const unsigned long long key = cand[i];
                if ((key & mask) == prefix) atomicAdd(&hist[(unsigned)(key >> shift) & dm], 1u);
            }
        }
        __syncthreads();
        // thread tid covers bins hi .. hi - 3 (descending), so the scan counts keys from the top
        const int hi = kBins - 1 - 4 * tid;
        const unsigned c0 = hist[hi], c1 = hist[hi - 1], c2 = hist[hi - 2], c3 = hist[hi - 3];
        const unsigned local = c0 + c1 + c2 + c3;
        const unsigned incl = block_scan(local, wsum), excl = incl - local;
        if (excl < krem && krem <= incl) {
            const unsigned cs[4] = {c0, c1, c2, c3};
            unsigned cum = excl;
            for (int j = 0; j < 4; j++) {
                if (cum + cs[j] >= krem) {
                    s_digit = (unsigned)(hi - j), s_above = cum, s_cnt = cs[j];
                    break;
                }
                cum += cs[j];
            }
        }
        __syncthreads();
        const unsigned digit = s_digit, cnt = s_cnt;
        krem -= s_above;
        prefix |= (unsigned long long)digit << shift;
        mask |= (unsigned long long)dm << shift;
        // the bin holds exactly the keys still wanted: every key >= prefix (its lower bits 0) is
        // selected, the same set as the full search's threshold selects. Random scores get here after
        // two digits (24 bits). Otherwise the search stops once the score's 32 bits are fixed (digits
        // of 12, 12 and 8 bits): the bin's keys then share one score, and the ones wanted are the
        // krem of lowest position, which the position-ordered write below counts out itself. (Walking
        // the position bits down to bit 0 instead took 6 passes, each a histogram, a 4096-bin scan and
        // 3 barriers: 24 us a row at 8K in the K3.1 slice's step, whose dummy scores tie.)
        tie = cnt != krem;
        if (!tie || shift == 32) break;
        if (shift - 12 >= 32) shift -= 12, bits = 12;
        else bits = shift - 32, shift = 32;
        if (!insm && cnt <= kCap) { // the rest of the search runs on the few keys in the bin
            if (tid == 0) s_ncand = 0;
            __syncthreads();
            for (int p0 = 0; p0 < n; p0 += kTK * kUnroll) {
                float v[kUnroll];
#pragma unroll
                for (int j = 0; j < kUnroll; j++) {
                    const int p = p0 + j * kTK + tid;
                    v[j] = p < n ? sc[p] : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < kUnroll; j++) {
                    const int p = p0 + j * kTK + tid;
                    const unsigned long long key = sel_key(v[j], p);
                    if (p < n && (key & mask) == prefix) cand[atomicAdd(&s_ncand, 1u)] = key;
                }
            }
            __syncthreads();
            ncand = s_ncand;
            insm = true;
        }
    }
    // Without a tie every key >= prefix is selected (prefix is the topk-th largest key, or its bin's
    // lower bound when the bin is taken whole). With one (the score bits fixed, prefix's upper half
    // the threshold score th): every key of a higher score, and of the keys scoring th the first krem
    // in position order. Written in position order: a position's slot is the selected keys before it,
    // (above before) + min(ties before, krem), from one block scan of both counts packed (each at most
    // kTK * kUnroll = 8192 a chunk: 16 bits)
    const unsigned long long T = prefix;
    const uint32_t th = (uint32_t)(prefix >> 32);
    unsigned above = 0, ties = 0; // before this chunk
    for (int p0 = 0; p0 < n; p0 += kTK * kUnroll) { // thread tid: kUnroll consecutive positions
        const int pb = p0 + tid * kUnroll;
        float v[kUnroll];
#pragma unroll
        for (int j = 0; j < kUnroll; j++) v[j] = pb + j < n ? sc[pb + j] : 0.0f;
        unsigned fa = 0, fe = 0, cnt = 0;
#pragma unroll
        for (int j = 0; j < kUnroll; j++) {
            if (pb + j >= n) continue;
            const unsigned long long key = sel_key(v[j], pb + j);
            const uint32_t hi32 = (uint32_t)(key >> 32);
            if (tie ? hi32 > th : key >= T) fa |= 1u << j, cnt++;
            else if (tie && hi32 == th) fe |= 1u << j, cnt += 1u << 16;
        }
        const unsigned incl = block_scan(cnt, wsum), excl = incl - cnt;
        unsigned a = above + (excl & 0xffffu), e = ties + (excl >> 16);
#pragma unroll
        for (int j = 0; j < kUnroll; j++) {
            if ((fa >> j) & 1u) {
                const unsigned o = a + (e < krem ? e : krem);
                if (o < (unsigned)topk) out[o] = pb + j;
                a++;
            } else if ((fe >> j) & 1u) {
                if (e < krem && a + e < (unsigned)topk) out[a + e] = pb + j;
                e++;
            }
        }
        if (tid == kTK - 1) s_cnt = incl; // the block totals
        __syncthreads();
        above += s_cnt & 0xffffu, ties += s_cnt >> 16;
        __syncthreads();
    }
    const unsigned base = above + (tie ? (ties < krem ? ties : krem) : 0);
    for (int s = (int)base + tid; s < topk; s += kTK) out[s] = -1; // never when keys are as argued
}

} // namespace

static int g_score_mode = LUNAR_DSA_SCORE_AUTO;
// INT8 (the default) runs the pipelined kernel where the round-1 kernel's grid would leave SMs idle,
// the round-1 kernel elsewhere. Both give the same bits. The pipelined kernel was measured faster
// exactly there ("DSA indexer, round 2", session 4: 1 row x 4K 1.65x, 8 x 4K 1.27x, 1 x 32K 1.13x;
// 8 x 32K 1.03x and 8 x 128K 1.05x at grids of >= 512 blocks, 1 x 128K 0.93x at 256) and in the K3.1
// slice's B = 1 step at 8K context (16 blocks: 1.720 -> 1.680 ms, every round, session 11's last call)
template <int NHP, int R> static long long sync_grid(int max_len, int rows) {
    using T = I8Tile<NHP, R>;
    return (long long)ceil_div_u(max_len, T::TPB * T::PT) * ceil_div_u(rows, R);
}
static bool pipe_fills_sms(bool grouped, int nh, int max_len, int rows) {
    const int sms = lunar_mla_sm_count();
    const long long g = nh <= 32 ? (grouped ? sync_grid<32, 4>(max_len, rows) : sync_grid<32, 1>(max_len, rows))
                                 : (grouped ? sync_grid<64, 2>(max_len, rows) : sync_grid<64, 1>(max_len, rows));
    return g < sms;
}

// every float bit pattern's code by the hardware conversion against the CPU's port (f32_to_e4m3 vs
// f32_to_e4m3_ref), mismatches counted: the proof behind the hardware path (2^32 conversions, ~ms)
static __global__ void e4m3_check_kernel(unsigned long long *bad) {
    unsigned long long n = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32);
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float f = __uint_as_float((uint32_t)i);
        n += f32_to_e4m3(f) != f32_to_e4m3_ref(f);
    }
    for (int o = 16; o; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
    if ((threadIdx.x & 31) == 0 && n) atomicAdd(bad, n);
}
extern "C" unsigned long long lunar_cuda_e4m3_mismatches(void) {
    const size_t mark = lunar_cuda_mark();
    unsigned long long *d = (unsigned long long *)lunar_cuda_alloc(sizeof *d), h = 0;
    CUDA_REQUIRE(d != NULL);
    CUDA_CHECK(cudaMemset(d, 0, sizeof *d));
    e4m3_check_kernel<<<1024, 256>>>(d);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost));
    lunar_cuda_release(mark);
    return h;
}

extern "C" int lunar_cuda_dsa_score_mode(int mode) {
    const int prev = g_score_mode;
    g_score_mode = mode;
    return prev;
}

extern "C" void lunar_cuda_dsa_index_write(uint8_t *codes, float *scales, const float *k,
                                           const int32_t *slots, int n, int d, lunar_cuda_stream s) {
    CUDA_REQUIRE(d >= 1 && d <= 1024 && (d & (d - 1)) == 0);
    if (n <= 0) return;
    const float norm = (float)(1.0 / sqrt((double)d));
    const int th = d < 32 ? 32 : d;
    launch_pdl(index_write_kernel, dim3(n), dim3(th), th * sizeof(float), to_stream(s), codes, scales, k, slots, d,
               norm);
    CUDA_CHECK_LAUNCH();
}

extern "C" int lunar_cuda_dsa_index_prep(uint8_t *codes, float *scales, const float *ik, float *iq, float *wt,
                                         const int32_t *slots, int n, int ni, int d, const float *ln_w,
                                         const float *ln_b, float eps, float wscale, lunar_cuda_stream s) {
    if (d < 16 || d > 128 || (d & (d - 1)) != 0 || ni < 1 || ni > 65535) return -1;
    if (n <= 0) return 0;
    const float norm = (float)(1.0 / sqrt((double)d));
    launch_pdl(index_prep_kernel, dim3(n, 1 + ni), dim3(128), 0, to_stream(s), codes, scales, ik, iq, wt, slots, ni,
               d, ln_w, ln_b, eps, wscale, norm);
    CUDA_CHECK_LAUNCH();
    return 0;
}

extern "C" void lunar_cuda_dsa_index_score(float *scores, int ld, const float *iq, const float *w,
                                           const uint8_t *codes, const float *scales,
                                           const int32_t *block_tables, int max_blocks,
                                           const int32_t *row_seq, const int32_t *lens, int max_len,
                                           int rows, int nh, int d, lunar_cuda_stream s) {
    CUDA_REQUIRE(nh >= 1 && nh <= 64 && d >= 16 && d <= kDP && d % 16 == 0 && ld >= max_len);
    if (rows <= 0 || max_len <= 0) return;
    int mode = g_score_mode;
    if (mode == LUNAR_DSA_SCORE_AUTO) {
        static int env = -1;
        if (env < 0) {
            const char *e = getenv("LUNAR_DSA_SCORE");
            env = !e                     ? LUNAR_DSA_SCORE_INT8
                  : !strcmp(e, "fp64")      ? LUNAR_DSA_SCORE_FP64
                  : !strcmp(e, "int8-sync") ? LUNAR_DSA_SCORE_INT8_SYNC
                  : !strcmp(e, "int8-pipe") ? LUNAR_DSA_SCORE_INT8_PIPE
                                            : LUNAR_DSA_SCORE_INT8;
        }
        mode = env;
    }
    if (mode != LUNAR_DSA_SCORE_FP64) {
        // rows of a block share their keys only when they are one sequence's: many rows (prefill,
        // verification) come a sequence at a time; a decode batch is one row per sequence
        const bool grouped = mode == LUNAR_DSA_SCORE_INT8_GROUPED || mode == LUNAR_DSA_SCORE_INT8_SYNC_GROUPED ||
                             mode == LUNAR_DSA_SCORE_INT8_PIPE_GROUPED || rows > 256;
        const bool pipe = mode == LUNAR_DSA_SCORE_INT8_PIPE || mode == LUNAR_DSA_SCORE_INT8_PIPE_GROUPED ||
                          ((mode == LUNAR_DSA_SCORE_INT8 || mode == LUNAR_DSA_SCORE_INT8_GROUPED) &&
                           pipe_fills_sms(grouped, nh, max_len, rows));
        if (pipe)
            launch_i8_any<true>(grouped, scores, ld, iq, w, codes, scales, block_tables, max_blocks, row_seq, lens,
                                max_len, rows, nh, d, to_stream(s));
        else
            launch_i8_any<false>(grouped, scores, ld, iq, w, codes, scales, block_tables, max_blocks, row_seq, lens,
                                 max_len, rows, nh, d, to_stream(s));
        CUDA_CHECK_LAUNCH();
        return;
    }
    if (nh <= 32) {
        static bool attr = false;
        if (!attr) {
            CUDA_CHECK(cudaFuncSetAttribute(index_score_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)score_smem<32>()));
            attr = true;
        }
        dim3 grid(ceil_div_u(max_len, 128 * kTilesPerBlock), rows);
        launch_pdl(index_score_kernel<32>, dim3(grid), dim3(kThreads), score_smem<32>(), to_stream(s), scores, ld, iq,
                   w, codes, scales, block_tables, max_blocks, row_seq, lens, nh, d);
    } else {
        static bool attr = false;
        if (!attr) {
            CUDA_CHECK(cudaFuncSetAttribute(index_score_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)score_smem<64>()));
            attr = true;
        }
        dim3 grid(ceil_div_u(max_len, 64 * kTilesPerBlock), rows);
        launch_pdl(index_score_kernel<64>, dim3(grid), dim3(kThreads), score_smem<64>(), to_stream(s), scores, ld, iq,
                   w, codes, scales, block_tables, max_blocks, row_seq, lens, nh, d);
    }
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_dsa_topk(int32_t *idx, int32_t *count, const float *scores, int ld,
                                    const int32_t *lens, int rows, int topk, lunar_cuda_stream s) {
    CUDA_REQUIRE(topk >= 1);
    if (rows <= 0) return;
    launch_pdl(topk_kernel, dim3(rows), dim3(kTK), 0, to_stream(s), idx, count, scores, ld, lens, topk);
    CUDA_CHECK_LAUNCH();
}
