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
// Cost: the exact dots run in fp64 on the CUDA cores (tile GEMM, 4 heads x 4 positions per thread,
// operands as doubles in shared memory): compute-bound, not bandwidth-bound (see docs).
#include <math.h>

#include "backend/cuda/cuda_common.cuh"

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
// blockDim.x = max(d, 32): a whole warp even for d = 16 (the shuffles name all 32 lanes); the
// lanes past d hold nothing and write nothing
__global__ void index_write_kernel(uint8_t *codes, float *scales, const float *k, const int32_t *slots,
                                   int d, float norm) {
    extern __shared__ float v[];
    __shared__ float wmax[32];
    const int i = threadIdx.x, tok = blockIdx.x;
    const bool on = i < d;
    if (on) v[i] = k[(size_t)tok * d + i];
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
    const size_t slot = (size_t)slots[tok];
    if (on) codes[slot * d + i] = quant1(x, scale);
    if (i == 0) scales[slot] = scale;
}

// ---------------------------------------------------------------- scores
constexpr int kDP = 128, kThreads = 256, kTilesPerBlock = 4;

template <int NHP> __global__ void __launch_bounds__(kThreads, 1)
index_score_kernel(float *scores, int ld, const float *iq, const float *w, const uint8_t *codes,
                   const float *kscales, const int32_t *block_tables, int max_blocks,
                   const int32_t *row_seq, const int32_t *lens, int nh, int d) {
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
    bool insm = false;
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
        if (shift == 0) break;
        if (shift >= 12) shift -= 12, bits = 12;
        else bits = shift, shift = 0;
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
    // prefix is now the topk-th largest key: write every key >= it, in position order
    const unsigned long long T = prefix;
    unsigned base = 0;
    for (int p0 = 0; p0 < n; p0 += kTK * kUnroll) { // thread tid: kUnroll consecutive positions
        const int pb = p0 + tid * kUnroll;
        float v[kUnroll];
#pragma unroll
        for (int j = 0; j < kUnroll; j++) v[j] = pb + j < n ? sc[pb + j] : 0.0f;
        unsigned fl = 0, cnt = 0;
#pragma unroll
        for (int j = 0; j < kUnroll; j++)
            if (pb + j < n && sel_key(v[j], pb + j) >= T) fl |= 1u << j, cnt++;
        const unsigned incl = block_scan(cnt, wsum);
        unsigned o = base + incl - cnt;
#pragma unroll
        for (int j = 0; j < kUnroll; j++)
            if ((fl >> j) & 1u) {
                if (o < (unsigned)topk) out[o] = pb + j;
                o++;
            }
        if (tid == kTK - 1) s_cnt = incl; // the block total
        __syncthreads();
        base += s_cnt;
        __syncthreads();
    }
    for (int s = (int)base + tid; s < topk; s += kTK) out[s] = -1; // never when keys are as argued
}

} // namespace

extern "C" void lunar_cuda_dsa_index_write(uint8_t *codes, float *scales, const float *k,
                                           const int32_t *slots, int n, int d, lunar_cuda_stream s) {
    CUDA_REQUIRE(d >= 1 && d <= 1024 && (d & (d - 1)) == 0);
    if (n <= 0) return;
    const float norm = (float)(1.0 / sqrt((double)d));
    const int th = d < 32 ? 32 : d;
    index_write_kernel<<<n, th, th * sizeof(float), to_stream(s)>>>(codes, scales, k, slots, d, norm);
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_dsa_index_score(float *scores, int ld, const float *iq, const float *w,
                                           const uint8_t *codes, const float *scales,
                                           const int32_t *block_tables, int max_blocks,
                                           const int32_t *row_seq, const int32_t *lens, int max_len,
                                           int rows, int nh, int d, lunar_cuda_stream s) {
    CUDA_REQUIRE(nh >= 1 && nh <= 64 && d >= 16 && d <= kDP && d % 16 == 0 && ld >= max_len);
    if (rows <= 0 || max_len <= 0) return;
    if (nh <= 32) {
        static bool attr = false;
        if (!attr) {
            CUDA_CHECK(cudaFuncSetAttribute(index_score_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)score_smem<32>()));
            attr = true;
        }
        dim3 grid(ceil_div_u(max_len, 128 * kTilesPerBlock), rows);
        index_score_kernel<32><<<grid, kThreads, score_smem<32>(), to_stream(s)>>>(
            scores, ld, iq, w, codes, scales, block_tables, max_blocks, row_seq, lens, nh, d);
    } else {
        static bool attr = false;
        if (!attr) {
            CUDA_CHECK(cudaFuncSetAttribute(index_score_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)score_smem<64>()));
            attr = true;
        }
        dim3 grid(ceil_div_u(max_len, 64 * kTilesPerBlock), rows);
        index_score_kernel<64><<<grid, kThreads, score_smem<64>(), to_stream(s)>>>(
            scores, ld, iq, w, codes, scales, block_tables, max_blocks, row_seq, lens, nh, d);
    }
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_dsa_topk(int32_t *idx, int32_t *count, const float *scores, int ld,
                                    const int32_t *lens, int rows, int topk, lunar_cuda_stream s) {
    CUDA_REQUIRE(topk >= 1);
    if (rows <= 0) return;
    topk_kernel<<<rows, kTK, 0, to_stream(s)>>>(idx, count, scores, ld, lens, topk);
    CUDA_CHECK_LAUNCH();
}
