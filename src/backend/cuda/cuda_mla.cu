// MLA attention in the absorbed form over the paged latent cache (dense decode, causal prefill as
// rows with their own lengths, and DSA sparse decode over listed positions).
//
// Design (one kernel, three modes): a block serves one row (query token), a group of up to 48
// heads and one split of its positions. The latent is shared by every head, so the block streams
// each 32-row tile of the cache into shared memory once (cp.async, two stages; FP8 tiles are staged
// raw and widened to bf16 in shared memory, exactly) and all of its heads read it there.
// Heads go 16 to a "group" of 4 warps (the M = 16 of mma.sync m16n8k16, bf16 in, fp32 accumulate):
//  - S = q . c: warp w of a group multiplies over its quarter of the 576 dims (latent 128w..+128 and
//    rope 16w..+16, q fragments held in registers); the 4 partial S tiles are summed through shared
//    memory in a fixed order, so all 4 warps hold bitwise the same S and the same softmax state;
//  - online softmax in the log2 domain (fp32 running max and sum per head row);
//  - O += P c: warp w owns output dims 128w..+128 (64 fp32 accumulators per thread), P is rounded
//    to bf16 straight from the S accumulators (the FA2 register reuse).
// Long contexts are split over blocks (split-K); each split writes O / l and log2-sum-exp, and a
// merge kernel combines them. Accuracy: q and P are rounded to bf16 (8 significant bits), the cache
// is exact (bf16 or e4m3 widened to bf16), sums are fp32.
#include <cuda_fp8.h>
#include <math.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_mbarrier.cuh"
#include "backend/cuda/cuda_mla_wgmma.h"

namespace {

constexpr int kR = 512, kP = 64, kRow = 576;
constexpr int kTN = 32;          // positions per tile
constexpr int kSRow = kRow + 8;  // bf16 per shared tile row: 1168 B, fragment loads conflict-free
constexpr int kFRow = kRow + 16; // bytes per raw FP8 staging row
constexpr int kGMax = 3;         // head groups (16 heads, 128 threads) per block

struct MlaArgs {
    float *o, *o_part, *lse_part;
    const float *q_lat, *q_pe;
    const void *cache;
    const int32_t *bt;
    int max_blocks;
    const int32_t *row_seq, *lens, *idx;
    int topk, rows, H, chunk, splits;
    float scale2;    // softmax scale * kv scale * log2(e)
    float out_scale; // kv scale
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ uint32_t pack_u16(uint16_t lo, uint16_t hi) {
    return (uint32_t)lo | ((uint32_t)hi << 16);
}
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool ok) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int n = ok ? 16 : 0; // 0: zero-fill, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Position of entry i of this row (-1: none), i < end.
template <bool SPARSE>
__device__ __forceinline__ int entry_pos(const MlaArgs &a, int row, int i, int end) {
    if (i >= end) return -1;
    return SPARSE ? a.idx[(size_t)row * a.topk + i] : i;
}

template <bool FP8, bool SPARSE>
__global__ void __launch_bounds__(128 * kGMax, 1) mla_kernel(MlaArgs a) {
    extern __shared__ __align__(16) unsigned char smem[];
    pdl_enter();
    const int G = blockDim.x >> 7;
    const int split = blockIdx.x, row = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = warp >> 2, w = warp & 3, g = lane >> 2, t = lane & 3;
    const int head0 = (blockIdx.z * G + grp) * 16;
    const int seq = a.row_seq ? a.row_seq[row] : row;
    const int32_t *bt = a.bt + (size_t)seq * a.max_blocks;
    const int n = SPARSE ? a.topk : a.lens[row];
    const int begin = split * a.chunk;
    const int end = min(n, begin + a.chunk);
    const int ntiles = end > begin ? (end - begin + kTN - 1) / kTN : 0;

    // shared layout: bf16 tiles (2 stages, or 1 widened tile for FP8), raw FP8 stages, valid
    // flags [2][kTN], S partials [G][4 warps][16][32 lanes]
    uint16_t *tiles = reinterpret_cast<uint16_t *>(smem);
    const int n_bf = FP8 ? 1 : 2;
    unsigned char *raw = smem + (size_t)n_bf * kTN * kSRow * 2;
    int *valid = reinterpret_cast<int *>(raw + (FP8 ? 2 * kTN * kFRow : 0));
    float *spart = reinterpret_cast<float *>(valid + 2 * kTN);

    // Cache slot of row `lane` of the tile starting at t0 (-1: none): one block-table load per lane
    // (after an idx load when sparse), issued a tile ahead so its latency hides behind compute.
    auto row_slot = [&](int t0) -> long long {
        const int pos = entry_pos<SPARSE>(a, row, t0 + lane, end);
        return pos >= 0 ? (long long)bt[pos >> 7] * 128 + (pos & 127) : -1LL;
    };
    auto load_tile = [&](int stage, long long myslot) {
        constexpr int per_row = FP8 ? kRow / 16 : kRow * 2 / 16; // 16-byte chunks per row
        constexpr int total = kTN * per_row;
        for (int c0 = 0; c0 < total; c0 += blockDim.x) { // warp-uniform trip count (shuffle below)
            const int c = c0 + threadIdx.x;
            const int r = c / per_row, col = c - r * per_row;
            const long long slot = __shfl_sync(0xffffffffu, myslot, r & 31);
            if (c < total) {
                const bool ok = slot >= 0;
                const size_t sl = ok ? (size_t)slot : 0;
                if (col == 0) valid[stage * kTN + r] = ok;
                if (FP8) {
                    const unsigned char *src = (const unsigned char *)a.cache + sl * kRow + col * 16;
                    cp_async16(raw + (size_t)(stage * kTN + r) * kFRow + col * 16, src, ok);
                } else {
                    const uint16_t *src = (const uint16_t *)a.cache + sl * kRow + col * 8;
                    cp_async16(tiles + (size_t)(stage * kTN + r) * kSRow + col * 8, src, ok);
                }
            }
        }
    };

    // q fragments (A operand, rows = heads head0..+15, this warp's 144 of the 576 dims)
    uint32_t qf[9][4];
#pragma unroll
    for (int ks = 0; ks < 9; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int h = head0 + g + ((j & 1) ? 8 : 0), kk = 2 * t + ((j & 2) ? 8 : 0);
            float x0 = 0.0f, x1 = 0.0f;
            if (h < a.H) {
                const size_t qr = (size_t)row * a.H + h;
                const float *src = ks < 8 ? a.q_lat + qr * kR + 128 * w + 16 * ks + kk
                                          : a.q_pe + qr * kP + 16 * w + kk;
                x0 = src[0], x1 = src[1];
            }
            qf[ks][j] = pack_bf16(x0, x1);
        }

    float oacc[16][4];
#pragma unroll
    for (int i = 0; i < 16; i++) oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    long long slot_next = ntiles > 0 ? row_slot(begin) : -1;
    if (ntiles > 0) load_tile(0, slot_next);
    cp_commit();
    slot_next = ntiles > 1 ? row_slot(begin + kTN) : -1;
    for (int it = 0; it < ntiles; it++) {
        const int st = it & 1;
        cp_wait_all();
        __syncthreads();
        if (it + 1 < ntiles) load_tile(st ^ 1, slot_next);
        cp_commit();
        if (it + 2 < ntiles) slot_next = row_slot(begin + (it + 2) * kTN);
        const uint16_t *T;
        if (FP8) {
            // widen raw stage st to the bf16 tile: e4m3 -> half -> float -> bf16, all exact
            for (int c = threadIdx.x; c < kTN * kRow / 8; c += blockDim.x) {
                const int r = c / (kRow / 8), col = c - r * (kRow / 8);
                const uint2 v = *reinterpret_cast<const uint2 *>(raw + (size_t)(st * kTN + r) * kFRow + col * 8);
                const uint32_t wv[2] = {v.x, v.y};
                uint32_t o4[4];
#pragma unroll
                for (int k = 0; k < 2; k++) {
                    __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(wv[k] & 0xffff), __NV_E4M3);
                    __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(wv[k] >> 16), __NV_E4M3);
                    float2 flo = __half22float2(*reinterpret_cast<__half2 *>(&lo));
                    float2 fhi = __half22float2(*reinterpret_cast<__half2 *>(&hi));
                    o4[2 * k] = pack_bf16(flo.x, flo.y);
                    o4[2 * k + 1] = pack_bf16(fhi.x, fhi.y);
                }
                *reinterpret_cast<uint4 *>(tiles + (size_t)r * kSRow + col * 8) = make_uint4(o4[0], o4[1], o4[2], o4[3]);
            }
            __syncthreads();
            T = tiles;
        } else {
            T = tiles + (size_t)st * kTN * kSRow;
        }

        // partial S over this warp's dims
        float sacc[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.0f;
            const uint16_t *rp = T + (size_t)(nt * 8 + g) * kSRow + 2 * t;
#pragma unroll
            for (int ks = 0; ks < 9; ks++) {
                const int kb = ks < 8 ? 128 * w + 16 * ks : kR + 16 * w;
                const uint32_t b0 = *reinterpret_cast<const uint32_t *>(rp + kb);
                const uint32_t b1 = *reinterpret_cast<const uint32_t *>(rp + kb + 8);
                mma_bf16(sacc[nt], qf[ks], b0, b1);
            }
        }
        float *sp = spart + (size_t)((grp * 4 + w) * 16) * 32;
#pragma unroll
        for (int j = 0; j < 16; j++) sp[j * 32 + lane] = sacc[j >> 2][j & 3];
        __syncthreads();
        float s[4][4];
#pragma unroll
        for (int j = 0; j < 16; j++) {
            float v = 0.0f;
#pragma unroll
            for (int ww = 0; ww < 4; ww++) v += spart[(size_t)((grp * 4 + ww) * 16 + j) * 32 + lane];
            const int col = (j >> 2) * 8 + 2 * t + (j & 1);
            s[j >> 2][j & 3] = valid[st * kTN + col] ? v * a.scale2 : -INFINITY;
        }
        // online softmax: rows g (entries 0, 1) and g + 8 (entries 2, 3)
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
        const float al0 = exp2f(m0 - b0), al1 = exp2f(m1 - b1);
        m0 = mn0, m1 = mn1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            s[nt][0] = exp2f(s[nt][0] - b0), s[nt][1] = exp2f(s[nt][1] - b0);
            s[nt][2] = exp2f(s[nt][2] - b1), s[nt][3] = exp2f(s[nt][3] - b1);
            ps0 += s[nt][0] + s[nt][1], ps1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * al0 + ps0, l1 = l1 * al1 + ps1;
#pragma unroll
        for (int i = 0; i < 16; i++) oacc[i][0] *= al0, oacc[i][1] *= al0, oacc[i][2] *= al1, oacc[i][3] *= al1;
        // O += P . C[:, 128w .. +128]
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const uint32_t pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                                    pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const uint16_t *r0 = T + (size_t)(16 * kk + 2 * t) * kSRow + 128 * w + g;
#pragma unroll
            for (int dt = 0; dt < 16; dt++) {
                const uint16_t *p = r0 + dt * 8;
                const uint32_t bb0 = pack_u16(p[0], p[kSRow]);
                const uint32_t bb1 = pack_u16(p[8 * kSRow], p[9 * kSRow]);
                mma_bf16(oacc[dt], pa, bb0, bb1);
            }
        }
    }
    cp_wait_all();

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    const int ha = head0 + g, hb = head0 + g + 8;
    const bool direct = a.splits == 1;
    const float os = direct ? a.out_scale : 1.0f;
    float *base = direct ? a.o : a.o_part + (size_t)split * a.rows * a.H * kR;
#pragma unroll
    for (int dt = 0; dt < 16; dt++) {
        const int d = 128 * w + dt * 8 + 2 * t;
        if (ha < a.H)
            *reinterpret_cast<float2 *>(base + ((size_t)row * a.H + ha) * kR + d) =
                make_float2(oacc[dt][0] * inv0 * os, oacc[dt][1] * inv0 * os);
        if (hb < a.H)
            *reinterpret_cast<float2 *>(base + ((size_t)row * a.H + hb) * kR + d) =
                make_float2(oacc[dt][2] * inv1 * os, oacc[dt][3] * inv1 * os);
    }
    if (!direct && w == 0 && t == 0) {
        float *lse = a.lse_part + (size_t)split * a.rows * a.H + (size_t)row * a.H;
        if (ha < a.H) lse[ha] = l0 > 0.0f ? m0 + log2f(l0) : -INFINITY;
        if (hb < a.H) lse[hb] = l1 > 0.0f ? m1 + log2f(l1) : -INFINITY;
    }
}

// o[row, h] = sum_s 2^(lse_s - M) O_s / sum_s 2^(lse_s - M); no valid split: 0.
__global__ void mla_merge_kernel(float *o, const float *o_part, const float *lse, int RH, int splits,
                                 float out_scale) {
    pdl_enter();
    const int rh = blockIdx.x, d = threadIdx.x * 4;
    float M = -INFINITY;
    for (int s = 0; s < splits; s++) M = fmaxf(M, lse[(size_t)s * RH + rh]);
    float4 acc = make_float4(0, 0, 0, 0);
    float wsum = 0.0f;
    if (M != -INFINITY)
        for (int s = 0; s < splits; s++) {
            const float l = lse[(size_t)s * RH + rh];
            if (l == -INFINITY) continue;
            const float wt = exp2f(l - M);
            const float4 v = *reinterpret_cast<const float4 *>(o_part + ((size_t)s * RH + rh) * kR + d);
            wsum += wt;
            acc.x += wt * v.x, acc.y += wt * v.y, acc.z += wt * v.z, acc.w += wt * v.w;
        }
    const float f = wsum > 0.0f ? out_scale / wsum : 0.0f;
    *reinterpret_cast<float4 *>(o + (size_t)rh * kR + d) = make_float4(acc.x * f, acc.y * f, acc.z * f, acc.w * f);
}

// ---------------------------------------------------------------- dense absorbed decode (default)
//
// The FlashMLA layout adapted to mma.sync: a block serves one row, one group of 16 heads (the M of
// m16n8k16) and one split of the positions, and streams 32-position tiles of the latent (a quarter
// of a 128-token page, so one contiguous 32 x 576 region) through shared memory with cp.async, six
// stages for bf16 and eight for FP8 (4 / 6 tiles, ~150 / 113 KB, in flight per SM). Its 8 warps
// have fixed roles:
//  - warps 0-3 ("score warps") hold the 16 x 576 q fragments in registers (144 per thread; that is
//    why a block takes 16 heads and not 64: with mma.sync the A operand lives in registers) and
//    each computes S for 8 of the tile's 32 positions over all 576 dims, in four accumulator
//    chains so that consecutive mma do not wait on each other; the 4 row maxima meet in shared
//    memory behind a 128-thread named barrier; each warp then writes exp2(S - m) (bf16, or f16 for
//    FP8 pages) into a double-buffered P tile and keeps its own partial row sums (every warp
//    rescales by the same factor, so the partials add up at the end);
//  - warps 4-7 ("value warps") own 128 output dims each (64 fp32 accumulators) and compute
//    O = alpha O + P V for the previous tile, P read back with ldmatrix, V with ldmatrix.trans.
// Scores of tile i and values of tile i-1 run at the same time; one 256-thread barrier per tile
// hands the tile over. Each latent byte goes through shared memory once per 16-head group (H = 96:
// the 6 groups of one split are adjacent in the grid, so they run together and share L2).
// FP8 pages stay e4m3 in shared memory and are widened in registers with cvt.f16x2.e4m3x2 (exact);
// the score warps read 4 consecutive bytes per fragment, so their k order inside each 16-dim step
// is permuted (q is loaded in the same order), and the value warps gather 4 rows of 4 bytes and
// regroup them with byte permutes, which permutes the output dims (undone at the store). q goes to
// f16 under a power-of-two scale that puts the block's max |q| in [2^13, 2^14) (f16 range; folded
// back into the score scale). Rows past the end are zero-filled by cp.async (never read) and
// masked to -inf. Splits write O / l and log2-sum-exp to the workspace; mla_merge_kernel combines.
namespace dec {

constexpr int kTile = 32, kHeads = 16, kThreads = 256;
constexpr int kPS = kTile + 8; // 16-bit elements per P row (80 B: ldmatrix and stores conflict-free)

template <bool FP8> struct Cfg {
    // tile row stride: bf16 1168 B (ldmatrix rows 4 banks apart), FP8 592 B (148 words: the
    // 32-bit fragment loads of both warp roles hit 32 distinct banks)
    static constexpr int rs = FP8 ? kRow + 16 : kRow * 2 + 16;
    static constexpr int stages = FP8 ? 8 : 6; // stages - 2 tiles in flight: 113 KB (FP8), 150 KB
    static constexpr int tile_bytes = kTile * rs;
    static constexpr int p_off = stages * tile_bytes;
    static constexpr int red_off = p_off + 2 * kHeads * kPS * 2;
    static constexpr int bar_off = red_off + (64 + 32 + 16) * 4;  // cluster variant: mbarriers
    static constexpr size_t smem = (size_t)bar_off + stages * 8;
};

struct Args {
    float *o, *o_part, *lse_part;
    const float *q_lat, *q_pe;
    const unsigned char *cache;
    const int32_t *bt;
    int max_blocks;
    const int32_t *row_seq, *lens;
    int rows, H, chunk, splits;
    int cs; // cluster size (cluster variant)
    float scale2, out_scale;
};

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
template <bool F16> __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    if (F16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <bool F16> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if (F16) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
    return pack_bf16(lo, hi);
}
// two e4m3 codes (low byte first) -> f16x2, exact
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t v16) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v16 & 0xffffu), __NV_E4M3);
    return (uint32_t)h.x | ((uint32_t)h.y << 16);
}
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void bar_all() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }
__device__ __forceinline__ void bar_scores() { asm volatile("bar.sync 2, 128;\n" ::: "memory"); }

// Cluster variant (LUNAR_MLA_DECODE=cluster, opt-in, for H > 16): the CS head-group blocks of one
// (row, split) form a thread-block cluster and each tile is read from L2/HBM once for all of them:
// block rank r copies rows r, r + CS, ... with cp.async.bulk multicast into the same offset of
// every block's stage, completing on each block's mbarrier (expecting the whole tile's bytes). A
// cluster barrier per tile replaces the block barrier, so no block refills a stage that another
// block still reads. Rows past the end are not copied: the stages are zeroed once at the start and
// later hold only earlier (finite) rows, which the -inf mask and P = 0 ignore.
__device__ __forceinline__ void bulk_multicast(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar,
                                               uint16_t mask) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
                 "[%0], [%1], %2, [%3], %4;\n" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(mask)
                 : "memory");
}

template <bool FP8, bool CL> __global__ void __launch_bounds__(kThreads, 1) decode_kernel(Args a) {
    pdl_enter();
    using C = Cfg<FP8>;
    extern __shared__ __align__(128) unsigned char smem[];
    uint16_t *pbuf = reinterpret_cast<uint16_t *>(smem + C::p_off); // [2][16][kPS]
    float *red = reinterpret_cast<float *>(smem + C::red_off);      // [4 warps][16]
    float *alpha_s = red + 64;                                      // [2][16]
    float *mfin = alpha_s + 32;                                     // [16]

    const int row = blockIdx.z, split = blockIdx.y, head0 = blockIdx.x * kHeads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int seq = a.row_seq ? a.row_seq[row] : row;
    const int32_t *bt = a.bt + (size_t)seq * a.max_blocks;
    const int begin = split * a.chunk, end = min(a.lens[row], begin + a.chunk);
    const int ntiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;
    const uint32_t crank = CL ? cluster_rank() : 0;

    // Tile i into stage i % stages: 32 rows of one page (begin and chunk are multiples of 32),
    // rows at or past `end` zero-filled without reading them.
    // The page of a tile comes from a block-table entry loaded when the previous page started, so
    // that the copies of a page's first tile do not wait for it (tiles are loaded in order).
    int pg = -1, pg_block = 0, nx_block = ntiles > 0 ? bt[begin >> 7] : 0;
    auto load_tile = [&](int i) {
        if (i >= ntiles) return;
        const int t0 = begin + i * kTile;
        if ((t0 >> 7) != pg) {
            pg = t0 >> 7;
            pg_block = nx_block;
            nx_block = pg + 1 < a.max_blocks ? bt[pg + 1] : 0; // past the row's pages: unused
        }
        constexpr int per_row = kRow * (FP8 ? 1 : 2) / 16, total = kTile * per_row;
        const unsigned char *src = a.cache + ((size_t)pg_block * 128 + (t0 & 127)) * (size_t)(per_row * 16);
        unsigned char *dst = smem + (i % C::stages) * C::tile_bytes;
        const int nvalid = min(kTile, end - t0);
        if constexpr (CL) {
            const uint32_t bar = smem_u32(smem + C::bar_off) + (i % C::stages) * 8;
            if (threadIdx.x == 0) mbar_expect_tx(bar, (uint32_t)(nvalid * per_row * 16));
            const int r = (int)crank + (int)threadIdx.x * a.cs;
            if (r < nvalid)
                bulk_multicast(smem_u32(dst + r * C::rs), src + (size_t)r * per_row * 16, per_row * 16, bar,
                               (uint16_t)((1u << a.cs) - 1));
        } else {
#pragma unroll
            for (int c0 = 0; c0 < total; c0 += kThreads) {
                const int c = c0 + threadIdx.x, r = c / per_row, col = c - r * per_row;
                if (total % kThreads == 0 || c < total)
                    cp_async16(dst + r * C::rs + col * 16, src + (size_t)c * 16, r < nvalid);
            }
        }
    };
    // Top of step i (both roles): tile i has landed and step i-1 is over everywhere (in the
    // cluster variant: in every block of the cluster); then the stage of tile i-2 (values done at
    // step i-1) takes tile i + stages - 2.
    auto step_sync = [&](int i) {
        if (CL) {
            if (i < ntiles) mbar_wait(smem_u32(smem + C::bar_off) + (i % C::stages) * 8, (uint32_t)(i / C::stages) & 1);
            cluster_sync_all();
        } else {
            cp_wait<C::stages - 3>();
            bar_all();
        }
        load_tile(i + C::stages - 2);
        if (!CL) cp_commit();
    };
    if (CL) {
        // zero the stages (rows past the end are never copied), init the tile barriers, and make
        // both visible to the async proxy and to the cluster before any copy is issued
        for (int i = threadIdx.x * 16; i < C::stages * C::tile_bytes; i += kThreads * 16)
            *reinterpret_cast<uint4 *>(smem + i) = make_uint4(0, 0, 0, 0);
        if (threadIdx.x < C::stages) mbar_init(smem_u32(smem + C::bar_off) + threadIdx.x * 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
        cluster_sync_all();
    }
#pragma unroll
    for (int i = 0; i < C::stages - 2; i++) {
        load_tile(i);
        if (!CL) cp_commit();
    }

    if (warp < 4) {
        // ---- score warps
        const int w = warp;
        const int ha = head0 + g, hb = head0 + g + 8;
        const float *qa = ha < a.H ? a.q_lat + ((size_t)row * a.H + ha) * kR : nullptr;
        const float *qb = hb < a.H ? a.q_lat + ((size_t)row * a.H + hb) * kR : nullptr;
        const float *pa = ha < a.H ? a.q_pe + ((size_t)row * a.H + ha) * kP : nullptr;
        const float *pb = hb < a.H ? a.q_pe + ((size_t)row * a.H + hb) * kP : nullptr;
        // dims of fragment entries j (a0..a3) at k-step ks: bf16 natural order, FP8 the byte order
        // of the 32-bit cache loads (a0: dims 4t, 4t+1; a2: 4t+2, 4t+3)
        auto qpair = [&](int ks, int j) -> float2 {
            const float *lat = (j & 1) ? qb : qa, *pe = (j & 1) ? pb : pa;
            if (!lat) return make_float2(0.0f, 0.0f);
            const int d = 16 * ks + (FP8 ? 4 * t + ((j & 2) ? 2 : 0) : 2 * t + ((j & 2) ? 8 : 0));
            return d < kR ? *reinterpret_cast<const float2 *>(lat + d) : *reinterpret_cast<const float2 *>(pe + d - kR);
        };
        float qmul = 1.0f, sscale = a.scale2;
        if (FP8) {
            float mx = 0.0f;
#pragma unroll 4
            for (int ks = 0; ks < 36; ks++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 v = qpair(ks, j);
                    mx = fmaxf(mx, fmaxf(fabsf(v.x), fabsf(v.y)));
                }
#pragma unroll
            for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            int e = 0;
            frexpf(mx, &e); // mx < 2^e
            e = max(-100, min(100, e));
            qmul = ldexpf(1.0f, 14 - e);
            sscale = a.scale2 * ldexpf(1.0f, e - 14);
        }
        uint32_t qf[36][4];
#pragma unroll
        for (int ks = 0; ks < 36; ks++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 v = qpair(ks, j);
                qf[ks][j] = pack2<FP8>(v.x * qmul, v.y * qmul);
            }
        float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
        const uint32_t tiles_u = smem_u32(smem);
        // ldmatrix row addresses (bf16): position 8w + (lane & 7); matrix lane >> 3 = the k halves of
        // two consecutive k-steps
        const uint32_t b_lane = (uint32_t)((8 * w + (lane & 7)) * C::rs + (lane >> 3) * 16);
        for (int it = 0; it <= ntiles; it++) {
            step_sync(it);
            if (it == ntiles) break;
            const int st = it % C::stages;
            float acc[4][4]; // four chains (k-step mod 4): consecutive mma are independent
#pragma unroll
            for (int p = 0; p < 4; p++) acc[p][0] = acc[p][1] = acc[p][2] = acc[p][3] = 0.0f;
            if (FP8) {
                const unsigned char *rp = smem + st * C::tile_bytes + (8 * w + g) * C::rs + 4 * t;
#pragma unroll
                for (int ks = 0; ks < 36; ks++) {
                    const uint32_t v = *reinterpret_cast<const uint32_t *>(rp + 16 * ks);
                    mma<true>(acc[ks & 3], qf[ks], e4m3x2_f16x2(v), e4m3x2_f16x2(v >> 16));
                }
            } else {
                const uint32_t base = tiles_u + st * C::tile_bytes + b_lane;
#pragma unroll
                for (int ks = 0; ks < 36; ks += 2) {
                    uint32_t b[4];
                    ldsm_x4(b, base + 32 * ks);
                    mma<false>(acc[ks & 3], qf[ks], b[0], b[1]);
                    mma<false>(acc[(ks + 1) & 3], qf[ks + 1], b[2], b[3]);
                }
            }
            // scores (log2 domain) of positions 8w + 2t, +1, masked past the end; row g: entries
            // 0, 1; row g + 8: 2, 3
            const int p0 = begin + it * kTile + 8 * w + 2 * t;
            float sc[4], mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const bool ok = p0 + (j & 1) < end;
                sc[j] = ok ? ((acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j])) * sscale : -INFINITY;
            }
            mx0 = fmaxf(sc[0], sc[1]), mx1 = fmaxf(sc[2], sc[3]);
#pragma unroll
            for (int o = 1; o <= 2; o <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
            }
            if (t == 0) red[w * 16 + g] = mx0, red[w * 16 + g + 8] = mx1;
            bar_scores();
#pragma unroll
            for (int ww = 0; ww < 4; ww++) mx0 = fmaxf(mx0, red[ww * 16 + g]), mx1 = fmaxf(mx1, red[ww * 16 + g + 8]);
            // the tile has a valid position, so the new maxima are finite (for finite inputs)
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);
            m0 = mn0, m1 = mn1;
            const float e0 = exp2f(sc[0] - mn0), e1 = exp2f(sc[1] - mn0);
            const float e2 = exp2f(sc[2] - mn1), e3 = exp2f(sc[3] - mn1);
            const float ps0 = e0 + e1, ps1 = e2 + e3;
            uint16_t *P = pbuf + (it & 1) * kHeads * kPS + 8 * w + 2 * t;
            *reinterpret_cast<uint32_t *>(P + g * kPS) = pack2<FP8>(e0, e1);
            *reinterpret_cast<uint32_t *>(P + (g + 8) * kPS) = pack2<FP8>(e2, e3);
            l0 = l0 * al0 + ps0, l1 = l1 * al1 + ps1;
            if (w == 0 && t == 0) alpha_s[(it & 1) * 16 + g] = al0, alpha_s[(it & 1) * 16 + g + 8] = al1;
        }
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
            l0 += __shfl_xor_sync(0xffffffffu, l0, o);
            l1 += __shfl_xor_sync(0xffffffffu, l1, o);
        }
        // every score warp has passed the last step_sync, so nobody still reads red
        if (t == 0) red[w * 16 + g] = l0, red[w * 16 + g + 8] = l1;
        if (w == 0 && t == 0) mfin[g] = m0, mfin[g + 8] = m1;
        bar_all();
    } else {
        // ---- value warps: dims 128v .. 128v + 127
        const int v = warp - 4;
        float o[16][4];
#pragma unroll
        for (int i = 0; i < 16; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
        const uint32_t p_lane = smem_u32(pbuf) + (uint32_t)((((lane >> 3) & 1) * 8 + (lane & 7)) * kPS * 2 + ((lane >> 4) & 1) * 16);
        const uint32_t v_lane = smem_u32(smem) + (uint32_t)((((lane >> 3) & 1) * 8 + (lane & 7)) * C::rs + 256 * v + ((lane >> 4) & 1) * 16);
        for (int it = 0; it <= ntiles; it++) {
            step_sync(it);
            if (it == 0) continue;
            const int st = (it - 1) % C::stages, pb = (it - 1) & 1;
            const float al0 = alpha_s[pb * 16 + g], al1 = alpha_s[pb * 16 + g + 8];
#pragma unroll
            for (int i = 0; i < 16; i++) o[i][0] *= al0, o[i][1] *= al0, o[i][2] *= al1, o[i][3] *= al1;
#pragma unroll
            for (int ks = 0; ks < kTile / 16; ks++) {
                uint32_t pa[4];
                ldsm_x4(pa, p_lane + pb * kHeads * kPS * 2 + 32 * ks);
                if (FP8) {
                    // rows 16ks + 2t, +1, +8, +9; bytes 4g..4g+3 of each 32-dim group: n-tile
                    // 4 grp + j column c is dim 128v + 32 grp + 4c + j
                    const unsigned char *rp = smem + st * C::tile_bytes + (16 * ks + 2 * t) * C::rs + 128 * v + 4 * g;
#pragma unroll
                    for (int grp = 0; grp < 4; grp++) {
                        const unsigned char *p = rp + 32 * grp;
                        const uint32_t wa = *reinterpret_cast<const uint32_t *>(p);
                        const uint32_t wb = *reinterpret_cast<const uint32_t *>(p + C::rs);
                        const uint32_t wc = *reinterpret_cast<const uint32_t *>(p + 8 * C::rs);
                        const uint32_t wd = *reinterpret_cast<const uint32_t *>(p + 9 * C::rs);
                        const uint32_t x01 = __byte_perm(wa, wb, 0x5140), x23 = __byte_perm(wa, wb, 0x7362);
                        const uint32_t y01 = __byte_perm(wc, wd, 0x5140), y23 = __byte_perm(wc, wd, 0x7362);
                        mma<true>(o[4 * grp + 0], pa, e4m3x2_f16x2(x01), e4m3x2_f16x2(y01));
                        mma<true>(o[4 * grp + 1], pa, e4m3x2_f16x2(x01 >> 16), e4m3x2_f16x2(y01 >> 16));
                        mma<true>(o[4 * grp + 2], pa, e4m3x2_f16x2(x23), e4m3x2_f16x2(y23));
                        mma<true>(o[4 * grp + 3], pa, e4m3x2_f16x2(x23 >> 16), e4m3x2_f16x2(y23 >> 16));
                    }
                } else {
                    const uint32_t base = v_lane + st * C::tile_bytes + 16 * ks * C::rs;
#pragma unroll
                    for (int jp = 0; jp < 8; jp++) {
                        uint32_t b[4];
                        ldsm_x4_t(b, base + 32 * jp);
                        mma<false>(o[2 * jp], pa, b[0], b[1]);
                        mma<false>(o[2 * jp + 1], pa, b[2], b[3]);
                    }
                }
            }
        }
        bar_all(); // the score warps' row sums and maxima are in red / mfin
        float l0 = 0.0f, l1 = 0.0f;
#pragma unroll
        for (int ww = 0; ww < 4; ww++) l0 += red[ww * 16 + g], l1 += red[ww * 16 + g + 8];
        const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
        const int ha = head0 + g, hb = head0 + g + 8;
        const bool direct = a.splits == 1;
        const float os = direct ? a.out_scale : 1.0f;
        float *base = direct ? a.o : a.o_part + (size_t)split * a.rows * a.H * kR;
        float *ra = base + ((size_t)row * a.H + ha) * kR + 128 * v, *rb = base + ((size_t)row * a.H + hb) * kR + 128 * v;
        const float fa = inv0 * os, fb = inv1 * os;
        if (FP8) {
#pragma unroll
            for (int grp = 0; grp < 4; grp++) {
                const float *c0 = o[4 * grp], *c1 = o[4 * grp + 1], *c2 = o[4 * grp + 2], *c3 = o[4 * grp + 3];
                const int d = 32 * grp + 8 * t;
                if (ha < a.H) {
                    *reinterpret_cast<float4 *>(ra + d) = make_float4(c0[0] * fa, c1[0] * fa, c2[0] * fa, c3[0] * fa);
                    *reinterpret_cast<float4 *>(ra + d + 4) = make_float4(c0[1] * fa, c1[1] * fa, c2[1] * fa, c3[1] * fa);
                }
                if (hb < a.H) {
                    *reinterpret_cast<float4 *>(rb + d) = make_float4(c0[2] * fb, c1[2] * fb, c2[2] * fb, c3[2] * fb);
                    *reinterpret_cast<float4 *>(rb + d + 4) = make_float4(c0[3] * fb, c1[3] * fb, c2[3] * fb, c3[3] * fb);
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const int d = 8 * j + 2 * t;
                if (ha < a.H) *reinterpret_cast<float2 *>(ra + d) = make_float2(o[j][0] * fa, o[j][1] * fa);
                if (hb < a.H) *reinterpret_cast<float2 *>(rb + d) = make_float2(o[j][2] * fb, o[j][3] * fb);
            }
        }
        if (!direct && v == 0 && t == 0) {
            float *lse = a.lse_part + (size_t)split * a.rows * a.H + (size_t)row * a.H;
            if (ha < a.H) lse[ha] = l0 > 0.0f ? mfin[g] + log2f(l0) : -INFINITY;
            if (hb < a.H) lse[hb] = l1 > 0.0f ? mfin[g + 8] + log2f(l1) : -INFINITY;
        }
    }
    if (CL) cluster_sync_all(); // no block leaves while the cluster may still write to it
}

// o[row, h] = sum_s 2^(lse_s - M) O_s / sum_s 2^(lse_s - M) (0 when no split saw a position), like
// mla_merge_kernel but with the split weights computed once per block into shared memory and the
// partial loads unconditional, so that batch 1 at long context (one block per head, 100+ splits) is
// not a chain of dependent L2 round trips. Every split wrote finite O (0 when it saw nothing), so a
// zero weight needs no branch. kMergeThreads threads, one output dim each: its kMergeBatch splits'
// loads issued together, then summed in split order (the sparse rows' 64 splits at batch 1: 2 rounds
// of L2 latency, not the 8 of 128 threads a float4 each, ~14 us a merge in the K3.1 step, ncu); the
// weights and their sum by the first 128 threads as before. The same fp32 operations in the same
// order for every output: the same bits as the 128-thread form (session 20).
constexpr int kMergeThreads = kR, kMergeBatch = 32;
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(float *o, const float *o_part, const float *lse, int RH,
                                                              int splits, float out_scale) {
    extern __shared__ float wsm[]; // [splits]
    __shared__ float red[4];
    pdl_enter();
    const int rh = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float M = -INFINITY, sum = 0.0f;
    if (warp < 4) {
        for (int s = threadIdx.x; s < splits; s += 128) M = fmaxf(M, lse[(size_t)s * RH + rh]);
#pragma unroll
        for (int k = 16; k; k >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, k));
        if (lane == 0) red[warp] = M;
    }
    __syncthreads();
    M = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    __syncthreads();
    if (warp < 4) {
        for (int s = threadIdx.x; s < splits; s += 128) {
            const float l = lse[(size_t)s * RH + rh];
            const float w = M == -INFINITY || l == -INFINITY ? 0.0f : exp2f(l - M);
            wsm[s] = w;
            sum += w;
        }
#pragma unroll
        for (int k = 16; k; k >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, k);
        if (lane == 0) red[warp] = sum;
    }
    __syncthreads();
    sum = (red[0] + red[1]) + (red[2] + red[3]);
    const int d = threadIdx.x;
    const float *src = o_part + (size_t)rh * kR + d;
    const size_t step = (size_t)RH * kR;
    float acc = 0.0f;
    for (int s0 = 0; s0 < splits; s0 += kMergeBatch) {
        float v[kMergeBatch];
#pragma unroll
        for (int j = 0; j < kMergeBatch; j++) v[j] = s0 + j < splits ? src[(size_t)(s0 + j) * step] : 0.0f;
#pragma unroll
        for (int j = 0; j < kMergeBatch; j++)
            if (s0 + j < splits) acc += wsm[s0 + j] * v[j];
    }
    const float f = sum > 0.0f ? out_scale / sum : 0.0f;
    o[(size_t)rh * kR + d] = acc * f;
}

} // namespace dec

int sm_count() { return lunar_mla_sm_count(); }

struct Plan {
    int groups, head_blocks, splits, chunk;
};
// min_per: the fewest positions a split takes (a multiple of kTN). 256 for dense rows; the sparse
// rows take sparse_min_per(H).
Plan plan(int rows, int H, int max_n, int min_per = 256) {
    Plan p;
    const int hg = (H + 15) / 16;
    p.head_blocks = (hg + kGMax - 1) / kGMax;
    p.groups = (hg + p.head_blocks - 1) / p.head_blocks;
    const int base = rows * p.head_blocks;
    int want = (2 * sm_count() + base - 1) / base;
    const int most = (max_n + min_per - 1) / min_per;
    int s = want < most ? want : most;
    if (s < 1) s = 1;
    const int per = max_n > 0 ? (max_n + s - 1) / s : 1;
    p.chunk = (per + kTN - 1) / kTN * kTN;
    p.splits = max_n > 0 ? (max_n + p.chunk - 1) / p.chunk : 1;
    return p;
}

// The fewest positions a split of the sparse kernel takes. At batch 1 the 2048 selected positions of
// one 12-head rank made 8 splits of 256 (the dense rows' minimum): 8 blocks on 132 SMs, each walking
// 8 dependent tiles of index load -> block-table load -> latent gather, latency rather than bytes
// (docs/benchmarks.md, session 11: ~35 us in the step). One head group (H <= 16) takes 32 positions
// a split (one tile: 64 blocks at B = 1) and the split-weight merge (dec::merge_kernel): B = 1 / 8
// 40 / 41 -> 19 / 25 us, B = 64 level, the K3.1 slice's B = 1 TPOT -2.2 % ("DSA chain at batch 1",
// session 17). More head groups keep 256: at H = 96, B = 8 shorter splits make a second wave of
// 384-thread blocks (52 -> 60 us). LUNAR_MLA_SPARSE_SPLIT=<positions> sets it for every H (rounded up
// to the 32-position tile; 256 = the old plan). Read at every call (one process can time both);
// lunar_cuda_mla_ws reads it too.
int sparse_min_per(int H) {
    const char *e = getenv("LUNAR_MLA_SPARSE_SPLIT");
    int v = e && *e ? atoi(e) : 0;
    if (v <= 0) return H <= 16 ? kTN : 256;
    v = v > 4096 ? 4096 : v;
    return (v + kTN - 1) / kTN * kTN;
}

size_t smem_bytes(bool fp8, int groups) {
    return (size_t)(fp8 ? 1 : 2) * kTN * kSRow * 2 + (fp8 ? 2 * kTN * kFRow : 0) + 2 * kTN * 4 +
           (size_t)groups * 4 * 16 * 32 * 4;
}

template <bool FP8, bool SPARSE> void launch(const MlaArgs &a, const Plan &p, cudaStream_t s) {
    static bool attr = false;
    const size_t sm = smem_bytes(FP8, kGMax);
    if (!attr) {
        CUDA_CHECK(cudaFuncSetAttribute(mla_kernel<FP8, SPARSE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
        attr = true;
    }
    dim3 grid(p.splits, a.rows, p.head_blocks);
    launch_pdl(mla_kernel<FP8, SPARSE>, dim3(grid), dim3(128 * p.groups), smem_bytes(FP8, p.groups), s, a);
    CUDA_CHECK_LAUNCH();
}

namespace dec {
struct Plan {
    int hg, splits, chunk;
};
// Splits of the context: minimise (waves of one-block-per-SM blocks) x (tiles per split + ~4 tiles
// of fixed cost per block: q load, pipeline fill, partial write), so that batch 1 at long context
// fills the 132 SMs once and large batches stay unsplit.
Plan plan(int rows, int H, int max_n) {
    Plan p;
    p.hg = (H + kHeads - 1) / kHeads;
    const int tiles = max_n > 0 ? (max_n + kTile - 1) / kTile : 1;
    const double units = (double)rows * p.hg, sms = sm_count();
    int best = 1;
    double best_cost = 1e300;
    const double most = ceil(4.0 * sms / units); // past 4 waves more splits only add cost
    for (int s = 1; s <= tiles && s <= most; s++) {
        const int per = (tiles + s - 1) / s;
        const double cost = ceil(units * s / sms) * (per + 4.0);
        if (cost < best_cost) best = s, best_cost = cost;
    }
    p.chunk = (tiles + best - 1) / best * kTile;
    p.splits = max_n > 0 ? (max_n + p.chunk - 1) / p.chunk : 1;
    return p;
}
size_t ws_bytes(int rows, int H, int max_n) {
    const Plan p = plan(rows, H, max_n);
    return p.splits > 1 ? (size_t)p.splits * rows * H * (kR + 1) * sizeof(float) : 0;
}
template <bool FP8, bool CL> void launch(const Args &a, const Plan &p, cudaStream_t s) {
    static bool attr = false;
    if (!attr) {
        CUDA_CHECK(cudaFuncSetAttribute(decode_kernel<FP8, CL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)Cfg<FP8>::smem));
        attr = true;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(p.hg, p.splits, a.rows);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = Cfg<FP8>::smem;
    cfg.stream = s;
    cudaLaunchAttribute attr_cl[2];
    int na = 0;
    if (CL) {
        attr_cl[na].id = cudaLaunchAttributeClusterDimension;
        attr_cl[na].val.clusterDim.x = a.cs;
        attr_cl[na].val.clusterDim.y = 1;
        attr_cl[na].val.clusterDim.z = 1;
        na++;
    }
    if (lunar_cuda_pdl_on()) { /* programmatic dependent launch: decode_kernel waits first (launch_pdl) */
        attr_cl[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr_cl[na].val.programmaticStreamSerializationAllowed = 1;
        na++;
    }
    cfg.attrs = attr_cl;
    cfg.numAttrs = na;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, decode_kernel<FP8, CL>, a));
}
// Cluster size for the cluster variant: the largest divisor of the head groups up to
// LUNAR_MLA_CLUSTER (default 6, at most 8, the portable limit); 1 = no cluster.
int cluster_size(int hg) {
    const char *e = getenv("LUNAR_MLA_CLUSTER");
    int most = e ? atoi(e) : 6;
    most = most < 1 ? 1 : most > 8 ? 8 : most;
    int cs = 1;
    for (int c = 2; c <= most; c++)
        if (hg % c == 0) cs = c;
    return cs;
}
// LUNAR_MLA_DECODE=old keeps the previous kernel for dense rows, =cluster selects the cluster
// variant, =new this kernel, =wgmma the wgmma kernel (cuda_mla_wgmma.cu) for every head count;
// unset: wgmma_default() decides (read at every call, so one process can time them all).
bool enabled() {
    const char *e = getenv("LUNAR_MLA_DECODE");
    return !(e && !strcmp(e, "old"));
}
// The wgmma kernel pads heads to 64 per block and has a fixed cost per block of a 64-head q load:
// it is the default where the device run showed it faster than this kernel (docs/benchmarks.md,
// "MLA decode, producer/consumer (session 5)": the swizzled-tile kernel, H = 32 / 64 / 96, B = 1-64,
// 1K-128K; 17..32 heads cost both kernels what 32 do, 33..64 what 64 do).
//  - FP8 pages: always (session 10). From 33 heads 1.5-2.9x; at <= 32 heads below 64K rows x context
//    the widening wgmma kernel (1.14-2.2x, H = 12: 1.46-1.67x); from 64K the round-6 kernel (S^T with
//    heads as N: "MLA decode, FP8 pages, round 6"), which also wins where mma.sync stayed before
//    (17-32 heads past 512K, where the older wgmma kernels were 1.10-1.16x in the kernel bench but 1-2 %
//    slower in the Kimi-Linear step at B = 64, 32K; 16 heads or fewer from 64K).
//  - bf16 pages: once rows x context reaches 64K at 17-32 heads (1.03-1.94x; 0.83-0.91x below:
//    B = 1 at 1K-32K, B = 8 at 1K), 32K at 33-64 (1.02-3.9x; 0.69-0.81x at 8K), 16K from 65
//    (1.44-3.0x; 0.76-0.98x at 8K and below).
//  - At 16 heads or fewer, bf16 pages: never (one mma.sync group against a 4x padded wgmma block;
//    this kernel reaches 83-99 % of the bandwidth floor there from B = 8 at 32K).
bool wgmma_default(int H, int rows, int max_n, bool fp8) {
    const double work = (double)rows * max_n;
    if (fp8) return true;
    if (H <= 16) return false;
    return work >= (H <= 32 ? 65536.0 : H <= 64 ? 32768.0 : 16384.0);
}
bool wgmma_wanted(int H, int rows, int max_n, bool fp8) {
    const char *e = getenv("LUNAR_MLA_DECODE");
    if (e && *e) return !strcmp(e, "wgmma");
    return wgmma_default(H, rows, max_n, fp8);
}
bool cluster_wanted() {
    const char *e = getenv("LUNAR_MLA_DECODE");
    return e && !strcmp(e, "cluster");
}
void run(float *o, const float *q_lat, const float *q_pe, const lunar_cuda_mla_cache *c, const int32_t *row_seq,
         const int32_t *lens, int max_n, int rows, int H, float scale, void *ws, cudaStream_t s) {
    CUDA_REQUIRE(rows <= 65535);
    const Plan p = plan(rows, H, max_n);
    Args a;
    a.o = o;
    a.q_lat = q_lat, a.q_pe = q_pe, a.cache = (const unsigned char *)c->latent, a.bt = c->block_tables;
    a.max_blocks = c->max_blocks, a.row_seq = row_seq, a.lens = lens;
    a.rows = rows, a.H = H, a.chunk = p.chunk, a.splits = p.splits;
    const bool fp8 = c->dtype == LUNAR_CUDA_KV_FP8;
    const float kv = fp8 ? c->scale : 1.0f;
    a.scale2 = scale * kv * 1.4426950408889634f;
    a.out_scale = kv;
    a.o_part = (float *)ws;
    a.lse_part = (float *)ws + (size_t)p.splits * rows * H * kR;
    if (p.splits > 1) CUDA_REQUIRE(ws != NULL);
    a.cs = cluster_wanted() ? cluster_size(p.hg) : 1;
    if (a.cs > 1) {
        if (fp8) launch<true, true>(a, p, s);
        else launch<false, true>(a, p, s);
    } else {
        if (fp8) launch<true, false>(a, p, s);
        else launch<false, false>(a, p, s);
    }
    if (p.splits > 1) {
        launch_pdl(merge_kernel, dim3(rows * H), dim3(kMergeThreads), p.splits * sizeof(float), s, o, a.o_part, a.lse_part,
                   rows * H, p.splits, a.out_scale);
        CUDA_CHECK_LAUNCH();
    }
}
} // namespace dec

void run(float *o, const float *q_lat, const float *q_pe, const lunar_cuda_mla_cache *c,
         const int32_t *row_seq, const int32_t *lens, const int32_t *idx, int topk, int max_n,
         int rows, int H, float scale, void *ws, cudaStream_t s) {
    CUDA_REQUIRE(rows >= 1 && H >= 1 && c && c->latent && c->block_tables);
    if (!idx && dec::wgmma_wanted(H, rows, max_n, c->dtype == LUNAR_CUDA_KV_FP8)) {
        lunar_mla_wgmma_decode(o, q_lat, q_pe, c, row_seq, lens, max_n, rows, H, scale, ws, s);
        return;
    }
    if (!idx && dec::enabled()) {
        dec::run(o, q_lat, q_pe, c, row_seq, lens, max_n, rows, H, scale, ws, s);
        return;
    }
    const bool sparse = idx != NULL;
    const int min_per = sparse ? sparse_min_per(H) : 256;
    const Plan p = plan(rows, H, max_n, min_per);
    MlaArgs a;
    a.o = o;
    a.q_lat = q_lat, a.q_pe = q_pe, a.cache = c->latent, a.bt = c->block_tables;
    a.max_blocks = c->max_blocks, a.row_seq = row_seq, a.lens = lens, a.idx = idx, a.topk = topk;
    a.rows = rows, a.H = H, a.chunk = p.chunk, a.splits = p.splits;
    const float kv = c->dtype == LUNAR_CUDA_KV_FP8 ? c->scale : 1.0f;
    a.scale2 = scale * kv * 1.4426950408889634f;
    a.out_scale = kv;
    a.o_part = (float *)ws;
    a.lse_part = (float *)ws + (size_t)p.splits * rows * H * kR;
    if (p.splits > 1) CUDA_REQUIRE(ws != NULL);
    const bool fp8 = c->dtype == LUNAR_CUDA_KV_FP8;
    if (fp8 && sparse) launch<true, true>(a, p, s);
    else if (fp8) launch<true, false>(a, p, s);
    else if (sparse) launch<false, true>(a, p, s);
    else launch<false, false>(a, p, s);
    if (p.splits > 1 && min_per < 256) {
        // many short splits: the merge that computes the split weights once per (row, head) in
        // shared memory, not once per output dim pair and split twice
        launch_pdl(dec::merge_kernel, dim3(rows * H), dim3(dec::kMergeThreads), p.splits * sizeof(float), s, o, a.o_part,
                   a.lse_part, rows * H, p.splits, a.out_scale);
        CUDA_CHECK_LAUNCH();
    } else if (p.splits > 1) {
        launch_pdl(mla_merge_kernel, dim3(rows * H), dim3(kR / 4), 0, s, o, a.o_part, a.lse_part, rows * H, p.splits,
                   a.out_scale);
        CUDA_CHECK_LAUNCH();
    }
}

} // namespace

extern "C" size_t lunar_cuda_mla_ws(int rows, int H, int max_n) {
    // the sparse path and LUNAR_MLA_DECODE=old plan with the old kernel, =wgmma with its own: room
    // for any
    // (the sparse plan with LUNAR_MLA_SPARSE_SPLIT takes at least as many splits as the dense one)
    const Plan p = plan(rows, H, max_n, sparse_min_per(H) < 256 ? sparse_min_per(H) : 256);
    const size_t old_b = p.splits > 1 ? (size_t)p.splits * rows * H * (kR + 1) * sizeof(float) : 0;
    const size_t new_b = dec::ws_bytes(rows, H, max_n), wg_b = lunar_mla_wgmma_ws(rows, H, max_n);
    const size_t most = old_b > new_b ? old_b : new_b;
    return most > wg_b ? most : wg_b;
}

extern "C" void lunar_cuda_mla_absorbed(float *o_lat, const float *q_lat, const float *q_pe,
                                        const lunar_cuda_mla_cache *c, const int32_t *row_seq,
                                        const int32_t *lens, int max_len, int rows, int H,
                                        float scale, void *ws, lunar_cuda_stream s) {
    run(o_lat, q_lat, q_pe, c, row_seq, lens, NULL, 0, max_len, rows, H, scale, ws, to_stream(s));
}

extern "C" void lunar_cuda_mla_sparse(float *o_lat, const float *q_lat, const float *q_pe,
                                      const lunar_cuda_mla_cache *c, const int32_t *row_seq,
                                      const int32_t *idx, int topk, int rows, int H, float scale,
                                      void *ws, lunar_cuda_stream s) {
    CUDA_REQUIRE(idx != NULL && topk >= 1);
    run(o_lat, q_lat, q_pe, c, row_seq, NULL, idx, topk, topk, rows, H, scale, ws, to_stream(s));
}

int lunar_mla_sm_count(void) {
    static int n = 0;
    if (!n) {
        int dev = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    }
    return n;
}

void lunar_mla_merge_splits(float *o, const float *o_part, const float *lse, int RH, int splits, float out_scale,
                            cudaStream_t s) {
    launch_pdl(dec::merge_kernel, dim3(RH), dim3(dec::kMergeThreads), splits * sizeof(float), s, o, o_part, lse, RH, splits,
               out_scale);
    CUDA_CHECK_LAUNCH();
}
