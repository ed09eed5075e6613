// MLA absorbed decode with wgmma (sm_90a): the FlashMLA layout on Hopper's warpgroup MMA.
//
// A block serves one row (query token), up to 64 heads (the M = 64 of wgmma; H = 96 runs as two
// blocks of 48, each padded to 64 with zero rows: the same MMA work as 64 + 32, but equal blocks)
// and one split of the row's positions, and streams 64-position tiles of the latent (half a
// 128-token page: one contiguous 64 x 576 region) through two shared-memory stages, loading tile
// i + 1 while tile i is computed. Each latent byte enters shared memory once per block and is read
// there by both products:
//  - S = Q C^T: Q [64 heads x 576] bf16 in shared memory (written once, the A operand), the tile
//    the B operand, K-major; warpgroup w takes positions 32w .. 32w + 31 (m64n32k16, 36 k-steps);
//  - online softmax in registers (log2 domain, fp32); the row maxima of the two warpgroups meet in
//    shared memory; P = exp2(S - m) goes to shared memory as bf16 (both warpgroups need all 64
//    positions of it); O is rescaled only when a row maximum of the warp moved;
//  - O += P C: warpgroup w owns output dims 256w .. 256w + 255 (m64n256k16, 128 fp32 accumulators
//    per thread), A = P from shared memory, B = the same tile read N-major (imm-trans-b).
// The tiles (default, SW) are in the 128-byte swizzled layout: 9 boxes of 64 dims (128 B) x 64
// positions, chunk c of row r at chunk c ^ (r & 7), written by 9 bulk tensor copies (TMA, whole
// 128-byte lines, issued by warp 0, completing on an mbarrier per stage) and read by swizzled
// descriptors: K-major for S (stride 1024 per 8 positions; a k-step moves 32 B inside the line),
// N-major for O (leading offset 8192 = the next 64 dims, stride 1024 = the next 8 positions).
// This ran 2x the session-4 layout (LUNAR_MLA_WGMMA_SW=0: unswizzled "core matrix" order, which
// needs 72 copies of 16 B x 64 rows per tile and measured ~1.8 TB/s) and reaches 88-99 % of the
// latent-bytes floor at 32-64 heads from B x context >= 1M (docs/benchmarks.md, "MLA decode,
// producer/consumer"). Q keeps the unswizzled core-matrix order (8 heads x 576 dims = 9216 B per
// group: leading 128, stride 9216). LUNAR_MLA_WGMMA_TMA=0 (or a refused tensor map): cp.async.
// FP8 pages: the raw 64 x 576 bytes by one bulk copy, two tiles ahead (a raw stage is free once
// widened), widened to bf16 in shared memory by bit operations (exact, e4m3x2_bf16x2), so both
// cache types run the same bf16 MMA. Accuracy: q and P are rounded to bf16 as in the mma.sync
// kernels; sums are fp32. Long contexts are split over blocks (split-K); each split writes O / l
// and log2-sum-exp, and the mma.sync kernel's merge combines them.
//
// Shared memory: Q 72 KB + two bf16 tiles 144 KB (FP8: one bf16 tile + two raw stages of 36 KB)
// + P 8 KB + 1 KB of alignment slack = 226 KB of the 227 KB a block may have: one block per SM,
// 256 threads, no producer warp (the copies are issued by warp 0 between barriers it already
// passes; there is no shared memory for a third stage).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp8.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_mla_wgmma.h"
#include "backend/cuda/cuda_mbarrier.cuh"
#include "backend/cuda/cuda_wgmma.cuh"

namespace {

constexpr int kR = 512, kP = 64, kRow = 576;
constexpr int kTile = 64;                              // positions per tile
constexpr int kM = 64;                                 // heads per block (padded)
constexpr int kThreads = 256;                          // two warpgroups
constexpr int kChunks = kRow / 8;                      // 16-byte bf16 chunks per row: 72
constexpr int kGroup = kChunks * 128;                  // one 8-row group in core-matrix order: 9216 B
constexpr int kTileBytes = kTile / 8 * kGroup;         // 73728
constexpr int kQBytes = kM / 8 * kGroup;               // 73728
constexpr int kPGroup = kTile / 8 * 128;               // P: one 8-head group, 64 positions: 1024 B
constexpr int kPBytes = kM / 8 * kPGroup;              // 8192
constexpr int kRawBytes = kTile * kRow;                // one raw FP8 tile: 36864

template <bool FP8> struct Lay {
    static constexpr int q_off = 0;
    static constexpr int tile_off = kQBytes;
    static constexpr int raw_off = tile_off + (FP8 ? 1 : 2) * kTileBytes;
    static constexpr int p_off = raw_off + (FP8 ? 2 * kRawBytes : 0);
    static constexpr int red_off = p_off + kPBytes; // [2 warpgroups][64] floats
    static constexpr int bar_off = red_off + 2 * 64 * 4; // TMA variant: one mbarrier per stage
    // + 1 KB: the kernel rounds the dynamic shared memory base up to 1024 bytes (the 128-byte
    // swizzle repeats every 8 rows x 128 B, and both the copy engine and wgmma swizzle by address bits)
    static constexpr size_t smem = (size_t)bar_off + 2 * 8 + 1024;
};
static_assert(Lay<false>::smem <= 232448 && Lay<true>::smem <= 232448, "227 KB of shared memory per block");

struct Args {
    float *o, *o_part, *lse_part;
    const float *q_lat, *q_pe;
    const unsigned char *cache;
    const int32_t *bt;
    int max_blocks;
    const int32_t *row_seq, *lens;
    int rows, H, hpb, chunk, splits;
    float scale2, out_scale;
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
// wgmma shared memory descriptor, no swizzle: start address, leading and stride byte offsets (all
// in 16-byte units), base offset 0, layout type 0 (bits 62-63)
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3ffff) >> 4) | ((uint64_t)((lbo >> 4) & 0x3fff) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3fff) << 32);
}

// Byte offset of 16-byte chunk j (dims 8j .. 8j + 7) of row r (position or head) in core-matrix
// order. The copy loops hand lane l row 8 rg + (l & 7) and chunk 4 jg + (l >> 3): a warp reads 8
// rows x 64 contiguous bytes and writes 512 contiguous bytes of shared memory (no bank conflict).
__device__ __forceinline__ int core_off(int r, int j) { return (r >> 3) * kGroup + j * 128 + (r & 7) * 16; }
// The session-4 latent tiles (SW = false): the same core matrices, chunk-major (chunk j's 64 rows = 8 core matrices are
// one contiguous KB), so one bulk tensor copy of 16 bytes x 64 rows fills one chunk column:
// K-major (S) leading byte offset 1024 and stride 128, N-major (O) leading 128 and stride 1024.
__device__ __forceinline__ int tile_off(int r, int j) { return j * 1024 + r * 16; }
// The swizzled tiles (SW): 9 boxes of 64 dims (128 B) x 64 positions, 8 KB each, as one bulk tensor
// copy with the 128-byte swizzle writes them: row r of box b at b * 8192 + r * 128, its 16-byte
// chunk c stored at chunk c ^ (r & 7). j: the 16-byte chunk of the row (dims 8j .. 8j + 7).
__device__ __forceinline__ int sw_off(int r, int j) { return (j >> 3) * 8192 + r * 128 + (((j & 7) ^ (r & 7)) << 4); }
// Descriptor with the 128-byte swizzle (layout type 1 in bits 62-63). K-major (S: rows =
// positions): the stride byte offset 1024 steps 8 rows, the leading offset is unused, a k-step of
// 16 dims moves the start 32 bytes inside the 128-byte row (the hardware applies the swizzle to
// the final address). N-major (O: K = positions, N = dims): leading byte offset = the next 64 dims
// (the next box, 8192), stride byte offset = the next 8 positions (1024).
__device__ __forceinline__ uint64_t desc_sw(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return desc(addr, lbo, sbo) | (1ull << 62);
}
// Two e4m3 bytes of w (picked by the byte_perm selector: 0x1404 bytes 0-1, 0x3424 bytes 2-3) as a
// bf16 pair, exactly. Each byte moved to the top of its 16-bit half, then sign kept and the 7 bits
// of exponent + mantissa moved down 4: a bf16 whose exponent field is the e4m3 one (bias 7, not
// 127), i.e. the value x 2^-120, subnormals included (e4m3 subnormal m/8 x 2^-6 -> bf16 subnormal
// m/8 x 2^-126). One bf16 multiply by 2^120 (0x7b80) restores it: a power of two, result normal,
// exact. (Measured as fast as the conversion route, 2 cvt + 2 f16->f32 + 1 pack per pair: the
// widening pass is bound by its shared-memory traffic and barrier.) e4m3 NaN (0x7f) becomes 480,
// but only rows past the end hold such bytes and those are zeroed.
__device__ __forceinline__ uint32_t e4m3x2_bf16x2(uint32_t w, uint32_t sel) {
    const uint32_t u = __byte_perm(w, 0u, sel);
    uint32_t h = (u & 0x80008000u) | ((u >> 4) & 0x07f007f0u);
    const uint32_t k = 0x7b807b80u;
    __nv_bfloat162 x = __hmul2(*reinterpret_cast<const __nv_bfloat162 *>(&h), *reinterpret_cast<const __nv_bfloat162 *>(&k));
    return *reinterpret_cast<uint32_t *>(&x);
}

// The end of both decode kernels: the row sums of the two warpgroups' halves met through red, O
// normalised (and scaled when the split is the whole context) into o, or the split's partial O and
// log2-sum-exp into the workspace for the merge. Thread: heads r0 / r1 (< nh stored), columns 256 wg
// + 8k + 2t of the accumulator o.
__device__ __forceinline__ void write_out(const Args &a, const float (&o)[128], float *red, int row, int split,
                                          int h0, int nh, int wg, int t, int r0, int r1, float m0, float m1,
                                          float l0, float l1) {
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    __syncthreads(); // nobody reads red any more
    if (t == 0) red[wg * 64 + r0] = l0, red[wg * 64 + r1] = l1;
    __syncthreads();
    l0 = red[r0] + red[64 + r0], l1 = red[r1] + red[64 + r1];
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    const bool direct = a.splits == 1;
    const float os = direct ? a.out_scale : 1.0f;
    float *base = direct ? a.o : a.o_part + (size_t)split * a.rows * a.H * kR;
    const size_t ha = (size_t)row * a.H + h0 + r0, hbr = (size_t)row * a.H + h0 + r1;
    const float fa = inv0 * os, fb = inv1 * os;
#pragma unroll
    for (int k = 0; k < 32; k++) {
        const int d = 256 * wg + 8 * k + 2 * t;
        if (r0 < nh) *reinterpret_cast<float2 *>(base + ha * kR + d) = make_float2(o[4 * k] * fa, o[4 * k + 1] * fa);
        if (r1 < nh) *reinterpret_cast<float2 *>(base + hbr * kR + d) = make_float2(o[4 * k + 2] * fb, o[4 * k + 3] * fb);
    }
    if (!direct && wg == 0 && t == 0) {
        float *lse = a.lse_part + (size_t)split * a.rows * a.H;
        if (r0 < nh) lse[ha] = l0 > 0.0f ? m0 + log2f(l0) : -INFINITY;
        if (r1 < nh) lse[hbr] = l1 > 0.0f ? m1 + log2f(l1) : -INFINITY;
    }
}

// TMA: the tiles come by bulk tensor copies issued by warp 0, completing on an mbarrier per stage,
// instead of cp.async by every thread. bf16 pages: tile i + 1 before waiting for tile i; rows past
// the end are copied too and zeroed in shared memory afterwards. FP8 pages (SW only): one copy of
// the raw 64 x 576 bytes per tile, two raw tiles ahead (a raw stage is free once widened).
// SW: the latent tiles in the 128-byte swizzled layout (sw_off), copied as 9 boxes of 128 B x 64
// rows (whole lines; the unswizzled layout needs 72 boxes of 16 B x 64 rows, which ran the copies
// at ~1.8 TB/s), FP8 widened by bit operations; SW = false keeps the session-4 layout
// (LUNAR_MLA_WGMMA_SW=0) for comparison.
template <bool FP8, bool TMA, bool SW>
__global__ void __launch_bounds__(kThreads, 1) wgmma_decode_kernel(Args a, const __grid_constant__ CUtensorMap tm) {
    using L = Lay<FP8>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    const uint32_t sb = smem_u32(smem);
    float *red = reinterpret_cast<float *>(smem + L::red_off);
    const int hb = blockIdx.x, split = blockIdx.y, row = blockIdx.z;
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int r0 = ((tid >> 5) & 3) * 16 + g, r1 = r0 + 8; // this thread's accumulator rows (heads)
    const int h0 = hb * a.hpb, nh = min(a.hpb, a.H - h0);
    const int seq = a.row_seq ? a.row_seq[row] : row;
    const int32_t *bt = a.bt + (size_t)seq * a.max_blocks;
    const int begin = split * a.chunk, end = min(a.lens[row], begin + a.chunk);
    const int ntiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;

    // Tile i (begin and chunk are multiples of 64, so one page holds it) into stage i & 1; rows at
    // or past `end` are zero-filled without being read.
    auto load_tile = [&](int i) {
        if (i >= ntiles) return;
        const int t0 = begin + i * kTile, nvalid = min(kTile, end - t0);
        const size_t slot0 = (size_t)bt[t0 >> 7] * 128 + (t0 & 127);
        if (FP8) {
            const unsigned char *src = a.cache + slot0 * kRow;
            const uint32_t dst = sb + L::raw_off + (i & 1) * kRawBytes;
#pragma unroll
            for (int c = tid; c < kTile * kRow / 16; c += kThreads) // row-major, 36 chunks per row
                cp_async16(dst + c * 16, src + (size_t)c * 16, c / (kRow / 16) < nvalid);
        } else {
            const unsigned char *src = a.cache + slot0 * (kRow * 2);
            const uint32_t dst = sb + L::tile_off + (i & 1) * kTileBytes;
#pragma unroll
            for (int c = tid; c < kTile * kChunks; c += kThreads) {
                // 8 lanes per 128-byte line: a warp reads 4 whole lines (4 rows). (8 rows x 64 B per
                // warp, conflict-free shared stores but half lines, measured the same.)
                const int blk = c >> 5, l = c & 31, rq = blk / 9, jg = blk - rq * 9;
                const int r = rq * 4 + (l >> 3), j = jg * 8 + (l & 7);
                cp_async16(dst + (SW ? sw_off(r, j) : tile_off(r, j)), src + (size_t)r * (kRow * 2) + j * 16, r < nvalid);
            }
        }
    };
    const uint32_t bars = sb + L::bar_off;
    auto issue_tma = [&](int i) { // warp 0
        if (i >= ntiles) return;
        const int t0 = begin + i * kTile;
        const int slot0 = bt[t0 >> 7] * 128 + (t0 & 127);
        const uint32_t bar = bars + (i & 1) * 8;
        if (FP8) { // the raw tile: one box of 144 words x 64 rows, row-major as load_tile's
            if (lane == 0) {
                mbar_expect_tx(bar, kRawBytes);
                tma_2d(sb + L::raw_off + (i & 1) * kRawBytes, &tm, 0, slot0, bar);
            }
            return;
        }
        const uint32_t dst = sb + L::tile_off + (i & 1) * kTileBytes;
        if (lane == 0) mbar_expect_tx(bar, kTileBytes);
        __syncwarp();
        if (SW) {
            if (lane < kRow / 64) tma_2d(dst + lane * 8192, &tm, lane * 64, slot0, bar);
        } else {
            for (int j = lane; j < kChunks; j += 32) tma_2d(dst + j * 1024, &tm, j * 16, slot0, bar);
        }
    };
    if (TMA) {
        if (tid == 0) {
            mbar_init(bars, 1), mbar_init(bars + 8, 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
        if (tid < 32) {
            issue_tma(0);
            if (FP8) issue_tma(1);
        }
    } else {
        load_tile(0);
        cp_commit();
    }

    // Q: heads h0 .. h0 + nh - 1 as bf16 rows 0 .. nh - 1, rows past nh zero (their scores are
    // finite and never stored)
#pragma unroll 2
    for (int c = tid; c < kM * kChunks; c += kThreads) {
        const int blk = c >> 5, l = c & 31, rg = blk / 18, jg = blk - rg * 18;
        const int r = rg * 8 + (l & 7), j = jg * 4 + (l >> 3);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < nh) {
            const size_t qr = (size_t)row * a.H + h0 + r;
            const float2 *src = reinterpret_cast<const float2 *>(j < kR / 8 ? a.q_lat + qr * kR + j * 8
                                                                           : a.q_pe + qr * kP + (j - kR / 8) * 8);
            const float2 x0 = src[0], x1 = src[1], x2 = src[2], x3 = src[3];
            v = make_uint4(pack_bf16(x0.x, x0.y), pack_bf16(x1.x, x1.y), pack_bf16(x2.x, x2.y), pack_bf16(x3.x, x3.y));
        }
        *reinterpret_cast<uint4 *>(smem + L::q_off + core_off(r, j)) = v;
    }
    fence_async_smem();

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const uint64_t dq = desc(sb + L::q_off, 128, kGroup);
    const uint64_t dp = desc(sb + L::p_off, 128, kPGroup);

    for (int it = 0; it < ntiles; it++) {
        const int nvalid = min(kTile, end - (begin + it * kTile));
        if (TMA) {
            __syncthreads(); // both warpgroups are done with tile it - 1: its stage takes tile it + 1
            if (!FP8 && tid < 32) issue_tma(it + 1);
            mbar_wait(bars + (it & 1) * 8, (uint32_t)(it >> 1) & 1);
            if (!FP8) {
                if (nvalid < kTile) { // rows past the end hold whatever the page has: zero them
                    unsigned char *tp = smem + L::tile_off + (it & 1) * kTileBytes;
                    for (int c = tid; c < (kTile - nvalid) * kChunks; c += kThreads)
                        *reinterpret_cast<uint4 *>(tp + (SW ? sw_off(nvalid + c / kChunks, c % kChunks)
                                                            : tile_off(nvalid + c / kChunks, c % kChunks))) =
                            make_uint4(0, 0, 0, 0);
                    fence_async_smem();
                }
                // tile it is in everywhere (each thread waited on the mbarrier; SW: only the zeroed
                // rows need the barrier)
                if (!SW || nvalid < kTile) __syncthreads();
            }
        } else {
            cp_wait<0>();
            if (!FP8) fence_async_smem();
            __syncthreads(); // tile it is in; both warpgroups are done with tile it - 1 and with P
            load_tile(it + 1);
            cp_commit();
        }
        uint32_t tile;
        if (FP8) {
            const unsigned char *raw = smem + L::raw_off + (it & 1) * kRawBytes;
            if (SW) {
                // raw 16-byte unit c (row r, dims 16u .. 16u + 15) -> chunks 2u, 2u + 1 of the
                // swizzled row; consecutive lanes read consecutive units (whole lines); rows past
                // the end become zeros
#pragma unroll 3
                for (int c = tid; c < kTile * kRow / 16; c += kThreads) {
                    const int r = c / (kRow / 16), u = c - r * (kRow / 16);
                    uint4 v = *reinterpret_cast<const uint4 *>(raw + c * 16);
                    if (r >= nvalid) v = make_uint4(0, 0, 0, 0);
                    unsigned char *d = smem + L::tile_off;
                    *reinterpret_cast<uint4 *>(d + sw_off(r, 2 * u)) =
                        make_uint4(e4m3x2_bf16x2(v.x, 0x1404), e4m3x2_bf16x2(v.x, 0x3424), e4m3x2_bf16x2(v.y, 0x1404),
                                   e4m3x2_bf16x2(v.y, 0x3424));
                    *reinterpret_cast<uint4 *>(d + sw_off(r, 2 * u + 1)) =
                        make_uint4(e4m3x2_bf16x2(v.z, 0x1404), e4m3x2_bf16x2(v.z, 0x3424), e4m3x2_bf16x2(v.w, 0x1404),
                                   e4m3x2_bf16x2(v.w, 0x3424));
                }
                fence_async_smem();
                __syncthreads(); // the bf16 tile is complete; raw stage it & 1 is free
                if (TMA && tid < 32) issue_tma(it + 2);
            } else {
                // widen raw stage it & 1 into the bf16 tile (core-matrix order): 16 raw bytes (chunks 2jj,
                // 2jj + 1 of row r) per step; lane l takes row 8 rg + (l & 7), unit 4 jq + (l >> 3), so
                // the 16-byte loads and both 16-byte stores of a warp each take the minimum 4 wavefronts
#pragma unroll 3
                for (int c = tid; c < kTile * kRow / 16; c += kThreads) {
                    const int blk = c >> 5, l = c & 31, rg = blk / 9, jq = blk - rg * 9;
                    const int r = rg * 8 + (l & 7), jj = jq * 4 + (l >> 3);
                    const uint4 v = *reinterpret_cast<const uint4 *>(raw + r * kRow + jj * 16);
                    const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
                    uint32_t o8[8];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(wv[k] & 0xffff), __NV_E4M3);
                        __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(wv[k] >> 16), __NV_E4M3);
                        const float2 flo = __half22float2(*reinterpret_cast<__half2 *>(&lo));
                        const float2 fhi = __half22float2(*reinterpret_cast<__half2 *>(&hi));
                        o8[2 * k] = pack_bf16(flo.x, flo.y);
                        o8[2 * k + 1] = pack_bf16(fhi.x, fhi.y);
                    }
                    unsigned char *d = smem + L::tile_off + tile_off(r, 2 * jj);
                    *reinterpret_cast<uint4 *>(d) = make_uint4(o8[0], o8[1], o8[2], o8[3]);
                    *reinterpret_cast<uint4 *>(d + 1024) = make_uint4(o8[4], o8[5], o8[6], o8[7]);
                }
                fence_async_smem();
                __syncthreads();
            }
            tile = sb + L::tile_off;
        } else {
            tile = sb + L::tile_off + (it & 1) * kTileBytes;
        }

        // S for positions 32 wg .. + 31 of the tile over all 576 dims; a k-step is 16 dims
        float s[16];
#pragma unroll
        for (int i = 0; i < 16; i++) s[i] = 0.0f;
        fence_acc<16>(s);
        wgmma_fence();
        if (SW) { // rows 32 wg.. = 4 groups of 8 rows in; k-step ks: box ks / 4, 32 B per step inside it
            const uint64_t dc = desc_sw(tile + wg * 4 * 1024, 16, 1024);
#pragma unroll
            for (int ks = 0; ks < kRow / 16; ks++)
                wgmma_m64n32<0>(s, dq + 16 * ks, dc + (uint64_t)(((ks >> 2) * 8192 + (ks & 3) * 32) >> 4), ks > 0);
        } else { // a k-step is 2 chunks (256 B)
            const uint64_t dc = desc(tile + wg * 4 * 128, 1024, 128);
#pragma unroll
            for (int ks = 0; ks < kRow / 16; ks++) wgmma_m64n32<0>(s, dq + 16 * ks, dc + 128 * ks, ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc<16>(s);

        // s[4k + 2e + c]: head row r0 (e = 0) or r1 (e = 1), tile position 32 wg + 8k + 2t + c
        const int pbase = begin + it * kTile + 32 * wg + 2 * t;
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int k = 0; k < 4; k++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const bool ok = pbase + 8 * k + c < end;
                s[4 * k + c] = ok ? s[4 * k + c] * a.scale2 : -INFINITY;
                s[4 * k + 2 + c] = ok ? s[4 * k + 2 + c] * a.scale2 : -INFINITY;
                mx0 = fmaxf(mx0, s[4 * k + c]), mx1 = fmaxf(mx1, s[4 * k + 2 + c]);
            }
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
        }
        if (t == 0) red[wg * 64 + r0] = mx0, red[wg * 64 + r1] = mx1;
        __syncthreads();
        mx0 = fmaxf(red[r0], red[64 + r0]), mx1 = fmaxf(red[r1], red[64 + r1]);
        // the tile has a valid position, so the new maxima are finite (for finite inputs)
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);
        m0 = mn0, m1 = mn1;
        float ps0 = 0.0f, ps1 = 0.0f;
        unsigned char *P = smem + L::p_off + (r0 >> 3) * kPGroup + (r0 & 7) * 16 + 4 * t;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float e0 = exp2f(s[4 * k] - mn0), e1 = exp2f(s[4 * k + 1] - mn0);
            const float e2 = exp2f(s[4 * k + 2] - mn1), e3 = exp2f(s[4 * k + 3] - mn1);
            ps0 += e0 + e1, ps1 += e2 + e3;
            // chunk 4 wg + k of rows r0 and r1 = r0 + 8 (the next 8-row group)
            *reinterpret_cast<uint32_t *>(P + (4 * wg + k) * 128) = pack_bf16(e0, e1);
            *reinterpret_cast<uint32_t *>(P + kPGroup + (4 * wg + k) * 128) = pack_bf16(e2, e3);
        }
        l0 = l0 * al0 + ps0, l1 = l1 * al1 + ps1;
        // SW: no rescale where no row maximum of the warp moved (exp2(0) = 1 exactly): most tiles
        // of a long row
        if (!SW || __any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
            for (int k = 0; k < 32; k++) o[4 * k] *= al0, o[4 * k + 1] *= al0, o[4 * k + 2] *= al1, o[4 * k + 3] *= al1;
        }
        fence_async_smem();
        __syncthreads(); // all of P is written

        // O[:, 256 wg .. + 255] += P C[:, 256 wg .. + 255]; a k-step is 16 positions (2 groups)
        fence_acc<128>(o);
        wgmma_fence();
        if (SW) { // dims 256 wg.. = boxes 4 wg..4 wg + 3; k-step: 16 rows = 2048 B
            const uint64_t dv = desc_sw(tile + wg * 4 * 8192, 8192, 1024);
#pragma unroll
            for (int ks = 0; ks < kTile / 16; ks++) wgmma_m64n256<1>(o, dp + 16 * ks, dv + 128 * ks, 1);
        } else {
            const uint64_t dv = desc(tile + wg * 32 * 1024, 128, 1024);
#pragma unroll
            for (int ks = 0; ks < kTile / 16; ks++) wgmma_m64n256<1>(o, dp + 16 * ks, dv + 16 * ks, 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc<128>(o);
    }
    cp_wait<0>();

    write_out(a, o, red, row, split, h0, nh, wg, t, r0, r1, m0, m1, l0, l1);
}

// FP8 pages with FP8 scores (opt-in: LUNAR_MLA_WGMMA_FP8=q8x2; the default
// is the widening kernel above). The session-5 FP8 path spends ~1.1 us per tile widening all 576
// dims to bf16 between the copies and the MMA (docs/benchmarks.md, "MLA decode,
// producer/consumer"). Here S = Q C^T runs on the e4m3 tile as it lands (wgmma e4m3 x e4m3,
// k32), so only the 512 V dims are widened (for PV, which stays bf16: FP8 wgmma takes B K-major
// only and the tile is N-major for PV), and that widening runs while the S wgmma is in flight.
// Measured (session 6): two terms 0.93-1.06x the widening kernel, one term 1.07-1.14x: not the
// widening but shared-memory reads bound both. S at n32 per warpgroup reads all of Q (A, 64 x
// 576) from shared memory for every 32 positions: 144 KB per tile for bf16 Q or two e4m3 terms,
// 72 KB for one, against 36-72 KB of tile; only a one-term variant read less and gained 7-14 %, at a
// logit error ~32x the bf16 one (2^-4 per q element): it was removed, no tolerance argued for it.
//  - Q per head: one scale sq = amax / 448 over its 576 values; q / sq rounded to e4m3 (hi) and,
//    the remainder x 16 rounded to e4m3 (lo, |remainder| <= half an e4m3 step <= 16
//    at 448): q = sq (hi + lo / 16) to ~2^-8 relative per element (e4m3 keeps 4 significant bits
//    of the remainder), the bf16 q's 2^-9 order, so the bf16 tolerance argument holds; two
//    accumulator sets, s = sq (S_hi + S_lo / 16).
//  - The e4m3 tile: 5 bulk tensor copies of 128 dims (bytes) x 64 positions with the 128-byte
//    swizzle (the bf16 tile's byte layout, so the same descriptors: K-major, stride 1024, a
//    32-byte k-step inside the line); the fifth box holds dims 512..575 in its first 64 bytes and
//    the copy engine's zero fill past the row. Q's fifth box holds the rope hi bytes in 0..63 and
//    the rope lo bytes in 64..127 (its k-steps start 64 B further than the tile's).
//  - Shared memory: Q hi 32 KB + Q lo 32 + Q rope 8 + two e4m3 stages 80 + V bf16 64 + P 8.
namespace q8 {
constexpr int kBox = 8192;                         // 64 rows x 128 B
constexpr int kStage = 5 * kBox;                   // one e4m3 tile: 40960
constexpr int q_hi = 0, q_lo = 4 * kBox, q_pe = 8 * kBox;
constexpr int raw_off = 9 * kBox;                  // two stages
constexpr int v_off = raw_off + 2 * kStage;        // 8 boxes of 64 dims bf16
constexpr int p_off = v_off + 8 * kBox;
constexpr int red_off = p_off + kPBytes;           // [2][64] floats
constexpr int sq_off = red_off + 2 * 64 * 4;       // [64] floats: the per-head q scale
constexpr int bar_off = sq_off + 64 * 4;
constexpr size_t smem = (size_t)bar_off + 2 * 8 + 1024;
static_assert(smem <= 232448, "227 KB of shared memory per block");

// byte b (0..127) of line r of a 128-byte swizzled box
__device__ __forceinline__ int sw_byte(int r, int b) { return r * 128 + ((((b >> 4) ^ r) & 7) << 4) + (b & 15); }
// e4m3 of two floats (round to nearest even, saturating), as the low 16 bits
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ float2 e4m3x2_f2(uint32_t v) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffff), __NV_E4M3);
    return __half22float2(*reinterpret_cast<__half2 *>(&h));
}
} // namespace q8

// S of the FP8-score kernels for positions 32 wg .. + 31 over 576 dims, issued and committed (not
// waited): k-step ks < 16 in box ks / 4 at 32 (ks & 3) bytes; the two rope k-steps in box 4 (Q: hi at
// 0 / 32, lo at 64 / 96). Zero = false: the accumulators keep their old values as inputs, which the
// first k-step (scale-d 0) ignores; the round-5 kernel issues S while another wgmma is in flight,
// and zeroing there became copies of one zero register (an accumulator) that ptxas counts as reads
// of in-flight accumulators and answers by serialising every wgmma (C7514).
template <bool Zero = true>
__device__ __forceinline__ void q8_issue_s(float (&s)[16], float (&sl)[16], uint32_t raw, int wg, uint64_t dqh,
                                           uint64_t dql, uint64_t dqe) {
    using namespace q8;
    if (Zero) {
#pragma unroll
        for (int i = 0; i < 16; i++) s[i] = 0.0f, sl[i] = 0.0f;
    }
    fence_acc<16>(s);
    fence_acc<16>(sl);
    wgmma_fence();
    const uint64_t dc = desc_sw(raw + wg * 4 * 1024, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < 18; ks++) {
        const uint64_t off = (uint64_t)(((ks >> 2) * kBox + (ks & 3) * 32) >> 4);
        const uint64_t qa = ks < 16 ? dqh + off : dqe + (uint64_t)(((ks - 16) * 32) >> 4);
        wgmma_m64n32_e4m3(s, qa, dc + off, ks > 0);
    }
#pragma unroll
    for (int ks = 0; ks < 18; ks++) {
        const uint64_t off = (uint64_t)(((ks >> 2) * kBox + (ks & 3) * 32) >> 4);
        const uint64_t qa = ks < 16 ? dql + off : dqe + (uint64_t)((64 + (ks - 16) * 32) >> 4);
        wgmma_m64n32_e4m3(sl, qa, dc + off, ks > 0);
    }
    wgmma_commit();
}

// Q of the block for the FP8-score kernels: warp w quantises head rows w, w + 8, ..; lane l holds
// 4-dim words l + 32k (144 words per row), rows past nh are zero (scale 0): e4m3 hi / lo terms into
// the swizzled boxes q_hi / q_lo (dims 0..511) and q_pe (rope: hi at 0..63, lo at 64..127 of the
// line), the per-head scale into sqs.
// The two-term scores s + sl / 16 of this thread's 16 accumulators (rows r0: i = 4k + c, r1: 4k + 2 + c;
// position pbase + 8 k + c) scaled by the rows' factors f0 / f1, positions at or past `end` -inf, and each
// row's maximum over the quad's four lanes. Two = false: s holds the sums already (the round-5 kernel), sl
// is not read. (The sum stays inside the loop: hoisted out, it reorders the PTX of the other kernels.)
template <bool Two = true>
__device__ __forceinline__ void q8_scores(float (&s)[16], const float (&sl)[16], int pbase, int end, float f0, float f1,
                                          float &mx0, float &mx1) {
    mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const bool ok = pbase + 8 * k + c < end;
            const int i0 = 4 * k + c, i1 = 4 * k + 2 + c;
            const float v0 = Two ? s[i0] + sl[i0] * 0.0625f : s[i0];
            const float v1 = Two ? s[i1] + sl[i1] * 0.0625f : s[i1];
            s[i0] = ok ? v0 * f0 : -INFINITY;
            s[i1] = ok ? v1 * f1 : -INFINITY;
            mx0 = fmaxf(mx0, s[i0]), mx1 = fmaxf(mx1, s[i1]);
        }
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
    }
}
// ST (the round-6 kernel, S^T = K Q^T with heads as N; blocks of <= 32 heads): head r's hi and lo terms are
// two rows of the B operand, warpgroup w's 16 heads 16 w .. as rows 32 w + (r & 15) (hi) and 32 w + 16 + (r & 15)
// (lo), 64 rows x 5 boxes from offset 0: dims 0..511 in boxes 0..3, the rope in box 4's first 64 bytes of
// each row (so a k-step sits at the same offset in Q as in the tile); only heads 0..31 are quantised.
// one head row r of q (576 dims; zeros past nh): lane l's 4-dim words l + 32k
__device__ __forceinline__ void q8_load_row(const Args &a, float4 (&x)[5], int row, int h0, int nh, int r, int lane) {
    const size_t qr = (size_t)row * a.H + h0 + r;
#pragma unroll
    for (int k = 0; k < 5; k++) {
        const int w = lane + 32 * k;
        x[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < nh && w < kRow / 4)
            x[k] = w < kR / 4 ? reinterpret_cast<const float4 *>(a.q_lat + qr * kR)[w]
                              : reinterpret_cast<const float4 *>(a.q_pe + qr * kP)[w - kR / 4];
    }
}
// row r's scale (its maximum over the warp's lanes) into sqs, its e4m3 hi / lo terms into Q's boxes
template <bool ST>
__device__ __forceinline__ void q8_store_row(unsigned char *smem, float *sqs, const float4 (&x)[5], int r, int lane) {
    using namespace q8;
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 5; k++)
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(x[k].x), fabsf(x[k].y)), fmaxf(fabsf(x[k].z), fabsf(x[k].w))));
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    const float inv = amax > 0.0f ? 448.0f / amax : 0.0f;
    if (lane == 0) sqs[r] = amax / 448.0f;
#pragma unroll
    for (int k = 0; k < 5; k++) {
        const int w = lane + 32 * k;
        if (w >= kRow / 4) continue;
        const float4 v = make_float4(x[k].x * inv, x[k].y * inv, x[k].z * inv, x[k].w * inv);
        const uint32_t h01 = e4m3x2(v.x, v.y), h23 = e4m3x2(v.z, v.w);
        const float2 b01 = e4m3x2_f2(h01), b23 = e4m3x2_f2(h23);
        const uint32_t hi = h01 | h23 << 16;
        const uint32_t lo = e4m3x2((v.x - b01.x) * 16.0f, (v.y - b01.y) * 16.0f) |
                            e4m3x2((v.z - b23.x) * 16.0f, (v.w - b23.y) * 16.0f) << 16;
        const int d = 4 * w; // dims d .. d + 3: one 4-byte word of a line (never across a chunk)
        if constexpr (ST) {
            const int rh = 32 * (r >> 4) + (r & 15), rl = rh + 16;
            const int box = d < kR ? (d >> 7) * kBox : 4 * kBox, b = d < kR ? d & 127 : d - kR;
            *reinterpret_cast<uint32_t *>(smem + box + sw_byte(rh, b)) = hi;
            *reinterpret_cast<uint32_t *>(smem + box + sw_byte(rl, b)) = lo;
        } else if (d < kR) {
            *reinterpret_cast<uint32_t *>(smem + q_hi + (d >> 7) * kBox + sw_byte(r, d & 127)) = hi;
            *reinterpret_cast<uint32_t *>(smem + q_lo + (d >> 7) * kBox + sw_byte(r, d & 127)) = lo;
        } else {
            *reinterpret_cast<uint32_t *>(smem + q_pe + sw_byte(r, d - kR)) = hi;
            *reinterpret_cast<uint32_t *>(smem + q_pe + sw_byte(r, d - kR + 64)) = lo;
        }
    }
}
// All (ST only; round 8, LUNAR_MLA_WGMMA_FP8=s8): a warp's 4 rows loaded before any is quantised, so the
// block waits for one round trip of q from memory instead of four in a row (q is cold in every split's block:
// the step's other kernels evict it); the same values in the same places (memcmp-equal)
template <bool ST = false, bool All = false>
__device__ __forceinline__ void q8_quantise_q(const Args &a, unsigned char *smem, float *sqs, int row, int h0, int nh, int warp,
                                              int lane) {
    using namespace q8;
    if constexpr (All) {
        static_assert(ST, "the 32 rows of the ST layout: 4 a warp");
        constexpr int NR = 32 / (kThreads / 32);
        float4 x[NR][5];
#pragma unroll
        for (int k = 0; k < NR; k++) q8_load_row(a, x[k], row, h0, nh, warp + k * (kThreads / 32), lane);
#pragma unroll
        for (int k = 0; k < NR; k++) q8_store_row<ST>(smem, sqs, x[k], warp + k * (kThreads / 32), lane);
    } else {
        for (int r = warp; r < (ST ? 32 : kM); r += kThreads / 32) {
            float4 x[5];
            q8_load_row(a, x, row, h0, nh, r, lane);
            q8_store_row<ST>(smem, sqs, x, r, lane);
        }
    }
}

__global__ void __launch_bounds__(kThreads, 1) wgmma_decode_q8_kernel(Args a, const __grid_constant__ CUtensorMap tm) {
    using namespace q8;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    const uint32_t sb = smem_u32(smem);
    float *red = reinterpret_cast<float *>(smem + red_off);
    float *sqs = reinterpret_cast<float *>(smem + sq_off);
    const int hb = blockIdx.x, split = blockIdx.y, row = blockIdx.z;
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = ((tid >> 5) & 3) * 16 + g, r1 = r0 + 8;
    const int h0 = hb * a.hpb, nh = min(a.hpb, a.H - h0);
    const int seq = a.row_seq ? a.row_seq[row] : row;
    const int32_t *bt = a.bt + (size_t)seq * a.max_blocks;
    const int begin = split * a.chunk, end = min(a.lens[row], begin + a.chunk);
    const int ntiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;

    const uint32_t bars = sb + bar_off;
    auto issue_tma = [&](int i) { // warp 0: five boxes of 128 B x 64 positions
        if (i >= ntiles) return;
        const int t0 = begin + i * kTile;
        const int slot0 = bt[t0 >> 7] * 128 + (t0 & 127);
        const uint32_t bar = bars + (i & 1) * 8, dst = sb + raw_off + (i & 1) * kStage;
        if (lane == 0) mbar_expect_tx(bar, kStage);
        __syncwarp();
        if (lane < 5) tma_2d(dst + lane * kBox, &tm, lane * 128, slot0, bar);
    };
    if (tid == 0) {
        mbar_init(bars, 1), mbar_init(bars + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid < 32) issue_tma(0), issue_tma(1);

    q8_quantise_q(a, smem, sqs, row, h0, nh, warp, lane);
    fence_async_smem();
    __syncthreads();
    const float f0 = sqs[r0] * a.scale2, f1 = sqs[r1] * a.scale2;

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const uint64_t dp = desc(sb + p_off, 128, kPGroup);
    const uint64_t dqh = desc_sw(sb + q_hi, 16, 1024), dql = desc_sw(sb + q_lo, 16, 1024);
    const uint64_t dqe = desc_sw(sb + q_pe, 16, 1024);

    for (int it = 0; it < ntiles; it++) {
        const int nvalid = min(kTile, end - (begin + it * kTile));
        __syncthreads(); // both warpgroups are done with PV of tile it - 1: the V tile and P are free
        mbar_wait(bars + (it & 1) * 8, (uint32_t)(it >> 1) & 1);
        const uint32_t raw = sb + raw_off + (it & 1) * kStage;

        float s[16], sl[16];
        q8_issue_s(s, sl, raw, wg, dqh, dql, dqe);

        // meanwhile: widen V (dims 0..511) of this tile to the bf16 tile (sw_off layout, boxes 0..7);
        // lane l takes row 8 rg + (l & 7), 16-byte unit 4 ug + (l >> 3): conflict-free loads and
        // stores (8 rows of one unit hit 8 different chunks); rows past the end become zeros
#pragma unroll 2
        for (int c = tid; c < kTile * (kR / 16); c += kThreads) {
            const int blk = c >> 5, l = c & 31, rg = blk >> 3, ug = blk & 7;
            const int r = rg * 8 + (l & 7), u = ug * 4 + (l >> 3);
            uint4 v = lds128(raw + (u >> 3) * kBox + r * 128 + ((((u & 7) ^ r) & 7) << 4));
            if (r >= nvalid) v = make_uint4(0, 0, 0, 0);
            const uint32_t d = sb + v_off;
            sts128(d + sw_off(r, 2 * u), e4m3x2_bf16x2(v.x, 0x1404), e4m3x2_bf16x2(v.x, 0x3424),
                   e4m3x2_bf16x2(v.y, 0x1404), e4m3x2_bf16x2(v.y, 0x3424));
            sts128(d + sw_off(r, 2 * u + 1), e4m3x2_bf16x2(v.z, 0x1404), e4m3x2_bf16x2(v.z, 0x3424),
                   e4m3x2_bf16x2(v.w, 0x1404), e4m3x2_bf16x2(v.w, 0x3424));
        }
        fence_async_smem();
        wgmma_wait<0>();
        fence_acc<16>(s);
        fence_acc<16>(sl);

        float mx0, mx1;
        q8_scores(s, sl, begin + it * kTile + 32 * wg + 2 * t, end, f0, f1, mx0, mx1);
        if (t == 0) red[wg * 64 + r0] = mx0, red[wg * 64 + r1] = mx1;
        __syncthreads(); // maxima in; every S read of the e4m3 stage and the widening are done
        if (tid < 32) issue_tma(it + 2);
        mx0 = fmaxf(red[r0], red[64 + r0]), mx1 = fmaxf(red[r1], red[64 + r1]);
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);
        m0 = mn0, m1 = mn1;
        float ps0 = 0.0f, ps1 = 0.0f;
        unsigned char *P = smem + p_off + (r0 >> 3) * kPGroup + (r0 & 7) * 16 + 4 * t;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float e0 = exp2f(s[4 * k] - mn0), e1 = exp2f(s[4 * k + 1] - mn0);
            const float e2 = exp2f(s[4 * k + 2] - mn1), e3 = exp2f(s[4 * k + 3] - mn1);
            ps0 += e0 + e1, ps1 += e2 + e3;
            *reinterpret_cast<uint32_t *>(P + (4 * wg + k) * 128) = pack_bf16(e0, e1);
            *reinterpret_cast<uint32_t *>(P + kPGroup + (4 * wg + k) * 128) = pack_bf16(e2, e3);
        }
        l0 = l0 * al0 + ps0, l1 = l1 * al1 + ps1;
        if (__any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
            for (int k = 0; k < 32; k++) o[4 * k] *= al0, o[4 * k + 1] *= al0, o[4 * k + 2] *= al1, o[4 * k + 3] *= al1;
        }
        fence_async_smem();
        __syncthreads(); // all of P is written (the V tile was complete at the barrier above)

        fence_acc<128>(o);
        wgmma_fence();
        {
            const uint64_t dv = desc_sw(sb + v_off + wg * 4 * kBox, 8192, 1024);
#pragma unroll
            for (int ks = 0; ks < kTile / 16; ks++) wgmma_m64n256<1>(o, dp + 16 * ks, dv + 128 * ks, 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc<128>(o);
    }

    write_out(a, o, red, row, split, h0, nh, wg, t, r0, r1, m0, m1, l0, l1);
}

// FP8 pages, round 4 (opt-in: LUNAR_MLA_WGMMA_FP8=rs). Rounds 1-3 (docs/benchmarks.md, "MLA decode,
// FP8 pages, round 3") found the widened bf16 tile itself to be the cost: its generic shared-memory
// stores (72 KB per tile) compete with the S products for shared memory, ~1.1 us of a 3.3 us tile.
// Here no widened tile exists. S is the two-term FP8-score product of wgmma_decode_q8_kernel on the
// e4m3 tile as it lands; PV is computed transposed, O^T [512 dims x N heads] = V^T P^T, with V^T
// as wgmma's register A operand (m64: 64 dims per instruction, k16: 16 positions) converted in
// registers from the raw e4m3 tile and P^T as the B operand from shared memory (N = the block's
// heads padded to 32 or 64, K-major: P's core-matrix layout read as B).
//  - Dims per thread: M rows are free to be any permutation of the dims, so thread (warp w of
//    warpgroup wg, g = lane / 4) takes the 8 consecutive dims D0 = 256 wg + 64 w + 8 g ..: its rows
//    g and g + 8 of instruction j are dims D0 + 2j and D0 + 2j + 1 (j = 0..3). Per position that is
//    one 8-byte shared load; a tile is 16 of them per thread (every V byte read once), conflict-free
//    (8 lanes of a position cover 64 contiguous bytes of its swizzled line, 4 positions 4 lines).
//  - e4m3 -> f16, exactly, by bit operations: a prmt pairs one dim's bytes of two positions with each
//    byte's sign replicated above it, a shift by 7 and a mask keep sign | exponent-mantissa << 7.
//    That is the f16 with the e4m3's exponent field (bias 7 for 15): the value x 2^-8, subnormals
//    included (m/8 2^-6 -> m/8 2^-14); the 2^8 goes into the output scale. 3 ops per pair. Every
//    byte becomes a finite f16 (e4m3 NaN 0x7f -> 1.875), so positions past the end (P = 0) add
//    zeros without zeroing the tile.
//  - f16 P (<= 1, 10 mantissa bits against bf16's 7; below 2^-14 subnormal, against a row sum >= 1)
//    and exact f16 V: PV at least as accurate as the bf16 kernels'; sums fp32.
//  - The rescale of O is per head, and a thread's accumulator columns are other heads than its S
//    rows: the factors go through shared memory, read only when a maximum of the block moved (the
//    barrier that publishes P reports that).
//  - Shared memory: Q hi 32 KB + lo 32 + rope 8 + three e4m3 stages 120 + P 8 = 200 KB.
// The trace buffer of lunar_cuda_mla_wgmma_trace (a device symbol, not an Args field: that would change every
// kernel's PTX) and the stamp: thread 0 of the block writes (%globaltimer, clock64) pair i < 15 of its 32 words, or
// (i = 15) a word of its own
__device__ unsigned long long *g_trace;
__device__ int g_trace_blocks;
__device__ __forceinline__ void trace_stamp(int i, unsigned long long extra = 0ull) {
    if (threadIdx.x != 0 || !g_trace) return;
    const int blk = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    if (blk >= g_trace_blocks) return;
    unsigned long long gt;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(gt)::"memory");
    unsigned long long *d = g_trace + (size_t)blk * 32 + 2 * i;
    if (i < 15) d[0] = gt, d[1] = (unsigned long long)clock64();
    else d[0] = extra, d[1] = 0ull;
}

// Round 9's merge in the kernel (rs::kXMrg): a ticket counter per (row, head block), zero between launches (the
// last block of a launch to leave rearms its counter); the launcher keeps rows x head blocks within it
constexpr int kTickets = 1024;
__device__ unsigned g_mla_tickets[kTickets];

namespace rs {
// Round 8's switches of the st kernel (template parameter X; LUNAR_MLA_WGMMA_FP8=s8 = the three; each alone measured
// 0.96-1.05x stlp, the three together 1.02-1.03x from 512K rows x context and Kimi-Linear's TPOT unmoved, so opt-in:
// docs/benchmarks.md, "MLA decode, FP8 pages, round 8"; s8q / s8d / s8c alone and kXSect's whole-sector stores
// (slower) are in git show 8507b5e):
// kXQ q's rows loaded all at once (q8_quantise_q's All), kXPdl launched by launch_pdl (the tensor-map prefetch
// before the wait, the merge's blocks placed early), kXCvt the V^T fragments by cvt.rn.f16x2.e4m3x2
// (kXTrace: the bench's phase stamps, trace_stamp; LUNAR_MLA_WGMMA_TRACE=1, never a default)
// Round 9 (session 13; LUNAR_MLA_WGMMA_FP8=s9q / s9m / s9c, s9 = the three; round 8 traced the fixed cost of a small
// launch: ~9 us of set-up, ~14 us outside the blocks, 1.40-1.45 us a tile). Measured (docs/benchmarks.md, "MLA decode,
// FP8 pages, round 9"): s9q 1.10x stlp at H = 32, B = 8, 8K (set-up 8.8 -> 4.1 us) but 0.98x at B = 64, 32K; s9m
// 0.98-0.99x alone (the tail's 4-7 us: the partial O's drain, the wait, two L2 round trips); s9c 1.02-1.03x from
// 256K rows x context; s9 1.12x / 1.06x at B = 8, 8K / 32K. The default: s9 below 512K rows x context where the merge
// goes into the kernel, s9c elsewhere:
// kXQF q's rows loaded into registers before the mbarriers' init and the first tiles' copies (so their requests
// are not queued behind 3 x 40 KB of copies a block), the tensor map prefetched at the top; kXMrg the split-K merge
// in the kernel's tail (the blocks of a row meet at a ticket counter, each merges some of its row's heads: no
// second launch); kXFtz the tile's exp2 as ex2.approx.ftz (the non-ftz form wraps each in a range check; only
// results below 2^-126 differ, which f16 P rounds to 0 anyway and a sum >= 1 absorbs), with kXCvt for s9c.
// Round 10 (session 15; LUNAR_MLA_WGMMA_FP8=s10, opt-in): kXPv PV(it - 1) left in flight past the tile's top wait.
// Round 7's ncu (B = 64, 32K) found the loop bound by its instruction stream's dependencies (2 warps a scheduler,
// tensor pipe 39 % active), and its one wait a tile retires S(it) and PV(it - 1) together, so PV, issued last, was
// never overlapped with anything. Here the tiles run in pairs (the st kernel's `tile` lambda, Ph 1 / 2): in the
// second, the top wait (wait_group 1) retires S(it) only (S(it) was committed before PV(it - 1)), PV(it - 1) runs on
// under S(it + 1)'s issue, the scores and P, and a second wait_group 1 before the V loads and fragments (PV's
// register operand) retires it, leaving S(it + 1) running; the pair ends with wait_group 0 (ptxas follows the groups
// only through straight-line code: see `tile`). The same products in the same order: the bits of the instance
// without it. Measured (docs/benchmarks.md, "MLA decode, FP8 pages, round 10"): 1.33-1.41 us a tile against
// 1.46-1.48 from 32 tiles a block; =s10 1.03-1.07x the default and =s10a 1.07-1.09x from 256K rows x context (H = 32,
// B = 64, 32K: 359 us, 78 % of 4.3 TB/s), level at B = 8, 8K; Kimi-Linear's TPOT with =s10 read +0.9 % / +1.3 %
// (B = 8 / 64, 32K, three rounds): opt-in until the model agrees. 252-255 registers (PV(it - 1)'s 64 fragment
// registers stay held under the next tile's softmax).
// kXMt (=s10m, with kXMrg): merge_tail's partial O loads batched (merge_cols); measured: the tail 8.1 -> 5.7 us at
// 2 splits (s10m 1.03x s10a at B = 64, 8K), unchanged at 16 (one column a thread: its 16 loads were in flight
// already); 255 registers, 4 bytes spilled.
constexpr int kXQ = 1, kXPdl = 2, kXCvt = 4, kXTrace = 8, kXQF = 16, kXMrg = 32, kXFtz = 64, kXPv = 128, kXMt = 256;
constexpr int kStages = 3;
constexpr int raw_off = 9 * q8::kBox;
constexpr int p_off = raw_off + kStages * q8::kStage; // NP x [64 heads][64 positions] f16, core-matrix order
// The layout of a Block: Q (QB boxes), S e4m3 stages, NP P buffers (round 4: one, 200 KB; round 5: two,
// 208 KB; round 6: Q in 5 boxes, 3 or 4 stages, two P buffers, 178 / 218 KB)
template <int NP, int S = kStages, int QB = 9> struct Lay {
    static constexpr int raw_off = QB * q8::kBox;
    static constexpr int p_off = raw_off + S * q8::kStage;
    static constexpr int red_off = p_off + NP * kPBytes; // [2][64] floats
    static constexpr int sq_off = red_off + 2 * 64 * 4;  // [64] the per-head q scale
    static constexpr int al_off = sq_off + 64 * 4;       // [64] the tile's rescale factor per head
    static constexpr int li_off = al_off + 64 * 4;       // [64] the output factor per head
    static constexpr int bar_off = li_off + 64 * 4;
    static constexpr size_t smem = (size_t)bar_off + S * 8 + 1024;
    static_assert(smem <= 232448, "227 KB of shared memory per block");
    static_assert(raw_off % 1024 == 0 && q8::kStage % 1024 == 0, "stages on the 128-byte swizzle's 1 KB period");
};

// the f16 pair (byte b of x, byte b of y) x 2^-8; sel = prmt selector b | (8 | b) << 4 | (4 + b) << 8
// | (12 + b) << 12 (nibble msb: the selected byte's sign replicated)
__device__ __forceinline__ uint32_t e4m3_pair_f16(uint32_t x, uint32_t y, uint32_t sel) {
    uint32_t w;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(w) : "r"(x), "r"(y), "r"(sel));
    return (w << 7) & 0xbf80bf80u;
}
__host__ __device__ constexpr uint32_t sel(int b) {
    return (uint32_t)(b | (8 | b) << 4 | (4 + b) << 8 | (12 + b) << 12);
}
static_assert(sel(0) == 0xC480u && sel(3) == 0xF7B3u, "prmt selectors");

// What the round-4 and round-5 kernels share (one body for each step, so the two cannot drift apart:
// round 5 promises round 4's bits). The constructor is their set-up: the block's heads, split and row,
// this thread's S rows (heads r0, r1) and V dims (D0..), the stage barriers with the first kStages
// tiles' copies issued, Q quantised into shared memory. NP: the P buffers of the layout.
// ST: the round-6 kernel's Q rows (q8_quantise_q<true>) in 5 boxes, S stages. X: round 8's switches (kXQ, kXPdl; the
// st kernel's own kXCvt).
template <int NP, bool ST = false, int S = kStages, int X = 0> struct Block {
    using L = Lay<NP, S, ST ? 5 : 9>;
    static constexpr int kStages = S;
    unsigned char *smem;
    uint32_t sb, bars;
    float *red, *sqs, *alpha, *linv;
    const CUtensorMap *tm;
    const int32_t *bt;
    int split, row, tid, wg, lane, warp, g, t, r0, r1, h0, nh, begin, end, ntiles;
    float f0, f1;
    uint64_t dqh, dql, dqe;
    int D0;
    uint32_t vbox, vchunk;

    // warp 0: five boxes of 128 B x 64 positions into stage i % kStages
    __device__ __forceinline__ void issue_tma(int i) const {
        using namespace q8;
        if (i >= ntiles) return;
        const int t0 = begin + i * kTile;
        const int slot0 = bt[t0 >> 7] * 128 + (t0 & 127);
        const uint32_t bar = bars + (i % kStages) * 8, dst = sb + L::raw_off + (i % kStages) * kStage;
        if (lane == 0) mbar_expect_tx(bar, kStage);
        __syncwarp();
        if (lane < 5) tma_2d(dst + lane * kBox, tm, lane * 128, slot0, bar);
    }

    // the stage barriers initialised (thread 0), then warp 0 issues the first kStages tiles' copies
    __device__ __forceinline__ void start_copies() const {
        if (tid == 0) {
            for (int i = 0; i < kStages; i++) mbar_init(bars + 8 * i, 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
        if constexpr ((X & kXTrace) != 0) trace_stamp(6);
        if (tid < 32)
            for (int i = 0; i < kStages; i++) issue_tma(i);
        if constexpr ((X & kXTrace) != 0) trace_stamp(7);
    }

    __device__ __forceinline__ Block(const Args &a, const CUtensorMap &tmap, unsigned char *smem_raw) {
        using namespace q8;
        smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
        sb = smem_u32(smem);
        red = reinterpret_cast<float *>(smem + L::red_off);
        sqs = reinterpret_cast<float *>(smem + L::sq_off);
        alpha = reinterpret_cast<float *>(smem + L::al_off);
        linv = reinterpret_cast<float *>(smem + L::li_off);
        tm = &tmap;
        const int hb = blockIdx.x;
        split = blockIdx.y, row = blockIdx.z;
        tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
        constexpr bool QF = (X & kXQF) != 0;
        if constexpr (QF)
            if (tid == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmap)) : "memory");
        if constexpr ((X & kXPdl) != 0) {
            // launched by launch_pdl: the tensor map (a kernel argument, no kernel writes it) fetched while the
            // predecessor finishes; then the wait before the first read of anything of the step (lens, the block
            // table's row, q, the cache), and the merge may take its places
            if (tid == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmap)) : "memory");
            pdl_enter();
        }
        r0 = (warp & 3) * 16 + g, r1 = r0 + 8;
        h0 = hb * a.hpb, nh = min(a.hpb, a.H - h0);
        const int seq = a.row_seq ? a.row_seq[row] : row;
        bt = a.bt + (size_t)seq * a.max_blocks;
        begin = split * a.chunk, end = min(a.lens[row], begin + a.chunk);
        ntiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;

        bars = sb + L::bar_off;
        if constexpr (QF) {
            // this warp's 4 q rows (ST: 32 rows, 4 a warp) requested before anything else, quantised after the
            // copies' issue
            static_assert(ST, "the 32 rows of the ST layout");
            constexpr int NQ = 32 / (kThreads / 32);
            float4 xq[NQ][5];
#pragma unroll
            for (int k = 0; k < NQ; k++) q8_load_row(a, xq[k], row, h0, nh, warp + k * (kThreads / 32), lane);
            start_copies();
#pragma unroll
            for (int k = 0; k < NQ; k++) q8_store_row<ST>(smem, sqs, xq[k], warp + k * (kThreads / 32), lane);
        } else {
            start_copies();
            q8_quantise_q<ST, (X & kXQ) != 0>(a, smem, sqs, row, h0, nh, warp, lane);
        }
        if constexpr ((X & kXTrace) != 0) trace_stamp(8);
        fence_async_smem();
        __syncthreads();
        f0 = sqs[r0] * a.scale2, f1 = sqs[r1] * a.scale2;

        dqh = desc_sw(sb + q_hi, 16, 1024), dql = desc_sw(sb + q_lo, 16, 1024);
        dqe = desc_sw(sb + q_pe, 16, 1024);
        D0 = wg * 256 + (warp & 3) * 64 + g * 8;
        // this thread's 8 bytes of position p in a stage: box D0 / 128, chunk (D0 % 128) / 16 swizzled by p
        vbox = (uint32_t)(D0 >> 7) * kBox + (D0 & 8), vchunk = (D0 & 127) >> 4;
    }

    // the V bytes of the tile in stage `raw`, positions 16 ks + 2t + {0, 1, 8, 9}
    __device__ __forceinline__ void load_v(uint32_t (&vx)[4][4][2], uint32_t raw) const {
#pragma unroll
        for (int ks = 0; ks < 4; ks++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int p = 16 * ks + 2 * t + (q & 1) + 8 * (q >> 1);
                const uint32_t ad = raw + vbox + p * 128 + (((vchunk ^ p) & 7) << 4);
                asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(vx[ks][q][0]), "=r"(vx[ks][q][1]) : "r"(ad) : "memory");
            }
    }

    // The softmax of tile it from its scores s and this warpgroup's row maxima: the maxima exchanged
    // through red (the barrier also frees tile it's stage for tile it + kStages's copies), f16 P into
    // P buffer it % NP, the running maxima and sums updated; al0 / al1, the rows' rescale factors, also
    // into alpha for the threads that hold those heads' columns
    __device__ __forceinline__ void softmax_p(const float (&s)[16], float mx0, float mx1, int it, float &m0, float &m1,
                                              float &l0, float &l1, float &al0, float &al1) const {
        if (t == 0) red[wg * 64 + r0] = mx0, red[wg * 64 + r1] = mx1;
        __syncthreads(); // maxima in; every read of this stage (S, the V loads) is done
        if (tid < 32) issue_tma(it + kStages);
        mx0 = fmaxf(red[r0], red[64 + r0]), mx1 = fmaxf(red[r1], red[64 + r1]);
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);
        m0 = mn0, m1 = mn1;
        float ps0 = 0.0f, ps1 = 0.0f;
        // (the buffer as it & (NP - 1), not it % NP: the kernels' PTX, instruction for instruction)
        unsigned char *P = smem + L::p_off + (it & (NP - 1)) * kPBytes + (r0 >> 3) * kPGroup + (r0 & 7) * 16 + 4 * t;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float e0 = exp2f(s[4 * k] - mn0), e1 = exp2f(s[4 * k + 1] - mn0);
            const float e2 = exp2f(s[4 * k + 2] - mn1), e3 = exp2f(s[4 * k + 3] - mn1);
            ps0 += e0 + e1, ps1 += e2 + e3;
            const __half2 h01 = __floats2half2_rn(e0, e1), h23 = __floats2half2_rn(e2, e3);
            *reinterpret_cast<__half2 *>(P + (4 * wg + k) * 128) = h01;
            *reinterpret_cast<__half2 *>(P + kPGroup + (4 * wg + k) * 128) = h23;
        }
        l0 = l0 * al0 + ps0, l1 = l1 * al1 + ps1;
        if (wg == 0 && t == 0) alpha[r0] = al0, alpha[r1] = al1;
    }

    // P and the factors published (the barrier reports whether some maximum of the block moved); O^T's
    // columns rescaled where one did
    // (o: O^T accumulators o[j][4i + c], dims D0 + 2j (c = 0, 1) / D0 + 2j + 1 (c = 2, 3), heads 8i + 2t + (c & 1))
    template <int N> __device__ __forceinline__ void rescale(float (&o)[4][N / 2], float al0, float al1) const {
        fence_async_smem();
        if (__syncthreads_or(al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
            for (int i = 0; i < N / 8; i++) {
                const float2 f = *reinterpret_cast<const float2 *>(alpha + 8 * i + 2 * t);
#pragma unroll
                for (int j = 0; j < 4; j++)
                    o[j][4 * i] *= f.x, o[j][4 * i + 1] *= f.y, o[j][4 * i + 2] *= f.x, o[j][4 * i + 3] *= f.y;
            }
        }
    }
};

// V^T fragments from a tile's V bytes: instruction j takes byte 2j (row g) and 2j + 1 (row g + 8) of
// each position
__device__ __forceinline__ void v_fragments(uint32_t (&av)[4][4][4], const uint32_t (&vx)[4][4][2]) {
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int w = j >> 1, b = 2 * (j & 1);
            av[ks][j][0] = e4m3_pair_f16(vx[ks][0][w], vx[ks][1][w], sel(b));
            av[ks][j][1] = e4m3_pair_f16(vx[ks][0][w], vx[ks][1][w], sel(b + 1));
            av[ks][j][2] = e4m3_pair_f16(vx[ks][2][w], vx[ks][3][w], sel(b));
            av[ks][j][3] = e4m3_pair_f16(vx[ks][2][w], vx[ks][3][w], sel(b + 1));
        }
}

// Round 8 (kXCvt): the same fragments by the hardware conversion, exact V (not x 2^-8: the output factor drops its
// 2^8): one prmt pairs byte b and b + 1 of the two positions' words ({x_b, y_b, x_b+1, y_b+1}), and each 16-bit half
// is one cvt.rn.f16x2.e4m3x2 (the upper byte to the upper half): 3 instructions for two registers instead of 6.
// The conversion keeps e4m3 NaN (0x7f / 0xff) a NaN, which P = 0 would not cancel: the caller zeroes the bytes of
// positions past the end (mask_v) where the old route turned them into finite values.
__device__ __forceinline__ void v_fragments_cvt(uint32_t (&av)[4][4][4], const uint32_t (&vx)[4][4][2]) {
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int w = j >> 1, b = 2 * (j & 1);
            const uint32_t sl = (uint32_t)(b | (4 + b) << 4 | (b + 1) << 8 | (5 + b) << 12);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                uint32_t pr;
                asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(pr) : "r"(vx[ks][2 * h][w]), "r"(vx[ks][2 * h + 1][w]), "r"(sl));
                asm("{\n .reg .b16 l, u;\n mov.b32 {l, u}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, u;\n}\n"
                    : "=r"(av[ks][j][2 * h]), "=r"(av[ks][j][2 * h + 1])
                    : "r"(pr));
            }
        }
}
// the V bytes of positions at or past nvalid (of the thread's 16 in load_v's order) zeroed
__device__ __forceinline__ void mask_v(uint32_t (&vx)[4][4][2], int nvalid, int t) {
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int q = 0; q < 4; q++)
            if (16 * ks + 2 * t + (q & 1) + 8 * (q >> 1) >= nvalid) vx[ks][q][0] = 0u, vx[ks][q][1] = 0u;
}

// PV of tile it issued and committed (not waited): O^T += V^T P^T, the 16 products of a tile, P^T from
// P buffer it % NP (dp0: the descriptor of buffer 0)
template <int N, int NP>
__device__ __forceinline__ void issue_pv(float (&o)[4][N / 2], uint32_t (&av)[4][4][4], uint64_t dp0, int it) {
    // the fragments are computed before the fence (else ptxas, finding them written between
    // the products, injects a warpgroup.arrive before each one)
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            asm volatile("" : "+r"(av[ks][j][0]), "+r"(av[ks][j][1]), "+r"(av[ks][j][2]), "+r"(av[ks][j][3])::"memory");
#pragma unroll
    for (int j = 0; j < 4; j++) fence_acc<N / 2>(o[j]);
    wgmma_fence();
    const uint64_t dp = dp0 + (uint64_t)((it & (NP - 1)) * (kPBytes >> 4));
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if constexpr (N == 64) wgmma_m64n64_rs_f16(o[j], av[ks][j], dp + 16 * ks);
            else wgmma_m64n32_rs_f16(o[j], av[ks][j], dp + 16 * ks);
        }
    wgmma_commit();
}

// O^T (dims D0.., heads 8i + 2t + e) times the output factor per head (linv, published) into o or the split's part
template <int N, class B> __device__ __forceinline__ void store_ot(const Args &a, const B &b, const float (&o)[4][N / 2]) {
    const int t = b.t, nh = b.nh, row = b.row;
    const float *linv = b.linv;
    float *base = a.splits == 1 ? a.o : a.o_part + (size_t)b.split * a.rows * a.H * kR;
#pragma unroll
    for (int i = 0; i < N / 8; i++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int h = 8 * i + 2 * t + e;
            if (h >= nh) continue;
            const float f = linv[h];
            float4 *d = reinterpret_cast<float4 *>(base + ((size_t)row * a.H + b.h0 + h) * kR + b.D0);
            d[0] = make_float4(o[0][4 * i + e] * f, o[0][4 * i + e + 2] * f, o[1][4 * i + e] * f, o[1][4 * i + e + 2] * f);
            d[1] = make_float4(o[2][4 * i + e] * f, o[2][4 * i + e + 2] * f, o[3][4 * i + e] * f, o[3][4 * i + e + 2] * f);
        }
}

// The end of the round-4 kernels: the row sums of the two warpgroups' positions; the output factor per head
// (x 2^8: V was x 2^-8) through shared memory to the threads holding that head's columns (o: O^T, dims D0..)
template <int N, int NP>
__device__ __forceinline__ void write_out(const Args &a, const Block<NP> &b, const float (&o)[4][N / 2], float m0, float m1,
                                          float l0, float l1) {
    const int wg = b.wg, t = b.t, r0 = b.r0, r1 = b.r1, nh = b.nh, row = b.row, split = b.split;
    float *red = b.red, *linv = b.linv;
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    __syncthreads(); // nobody reads red any more
    if (t == 0) red[wg * 64 + r0] = l0, red[wg * 64 + r1] = l1;
    __syncthreads();
    const bool direct = a.splits == 1;
    if (wg == 0 && t == 0) {
        const float os = (direct ? a.out_scale : 1.0f) * 256.0f;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int r = e ? r1 : r0;
            const float l = red[r] + red[64 + r], m = e ? m1 : m0;
            linv[r] = l > 0.0f ? os / l : 0.0f;
            if (!direct && r < nh)
                a.lse_part[(size_t)split * a.rows * a.H + (size_t)row * a.H + b.h0 + r] = l > 0.0f ? m + log2f(l) : -INFINITY;
        }
    }
    __syncthreads();
    store_ot<N>(a, b, o);
}
} // namespace rs

template <int N>
__global__ void __launch_bounds__(kThreads, 1) wgmma_decode_rs_kernel(Args a, const __grid_constant__ CUtensorMap tm) {
    using namespace q8;
    constexpr int kS = rs::kStages;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const rs::Block<1> b(a, tm, smem_raw);

    // O^T accumulators: o[j][4i + c], instruction j (dims D0 + 2j: c = 0, 1; D0 + 2j + 1: c = 2, 3),
    // heads 8i + 2t + (c & 1)
    float o[4][N / 2];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < N / 2; i++) o[j][i] = 0.0f;
    // (declared l1, l0, m0, m1: the order of the loop's phi nodes, so of the PTX's registers, which ptxas's
    // schedule follows; this order keeps the PTX and SASS of the kernels before rs::Block, byte for byte)
    float l1 = 0.0f, l0 = 0.0f, m0 = -INFINITY, m1 = -INFINITY;
    const uint64_t dp = desc(b.sb + rs::p_off, 128, kPGroup);

    for (int it = 0; it < b.ntiles; it++) {
        const int stage = it % kS;
        __syncthreads(); // both warpgroups are done with PV of tile it - 1: P is free
        mbar_wait(b.bars + stage * 8, (uint32_t)(it / kS) & 1);
        const uint32_t raw = b.sb + rs::raw_off + stage * kStage;
        float s[16], sl[16];
        q8_issue_s(s, sl, raw, b.wg, b.dqh, b.dql, b.dqe);

        uint32_t vx[4][4][2];
        b.load_v(vx, raw); // meanwhile
        wgmma_wait<0>();
        fence_acc<16>(s);
        fence_acc<16>(sl);

        float mx0, mx1, al0, al1;
        q8_scores(s, sl, b.begin + it * kTile + 32 * b.wg + 2 * b.t, b.end, b.f0, b.f1, mx0, mx1);
        b.softmax_p(s, mx0, mx1, it, m0, m1, l0, l1, al0, al1);
        uint32_t av[4][4][4];
        rs::v_fragments(av, vx);
        b.template rescale<N>(o, al0, al1);
        rs::issue_pv<N, 1>(o, av, dp, it);
        wgmma_wait<0>();
#pragma unroll
        for (int j = 0; j < 4; j++) fence_acc<N / 2>(o[j]);
    }

    rs::write_out<N>(a, b, o, m0, m1, l0, l1);
}

// FP8 pages, round 5 (opt-in: LUNAR_MLA_WGMMA_FP8=rs2; blocks of <= 32 heads, N = 32; larger blocks run
// the round-4 kernel). The round-4 kernel runs one tile as a serial chain: TMA wait -> S (36 e4m3
// products) -> wait -> max exchange -> P -> barrier -> PV -> wait, so the tensor cores idle during the
// softmax and the CUDA cores during S (2.51 us a tile at H = 32, B = 64, 32K against ~1.55 us of latent
// bytes: docs/benchmarks.md, "MLA decode, FP8 pages, round 4"). Here S of tile it + 1 is issued as soon
// as tile it's scores are out of its accumulators, before tile it's softmax, so S runs on the tensor
// cores under the V loads, the scores, the max exchange and the P stores; PV(it) is left in flight
// until the next tile's one wait:
//  - a tile has one wgmma wait (wait_group 0, after the P stores): S(it + 1) and PV(it - 1) done. S(0)
//    is waited before the loop. A wait_group 1 that retires an older S while PV runs would overlap
//    more, but ptxas could not follow it (C7514: every wgmma serialised), whatever the paths.
//  - The two score terms are summed into 16 registers as soon as the tile starts, so the in-flight S
//    needs only its own 32 accumulators (248 registers at N = 32, no spills; N = 64 has no room).
//  - Accumulators are zeroed one register at a time by asm and S is issued without zeroing (the first
//    k-step's scale-d 0 ignores the old values): C++ zeros became copies of one zero register, an
//    accumulator, which ptxas counts as reads of in-flight accumulators (C7514 again).
//  - P double-buffered (PV(it - 1) may still read its P while tile it's is written), which also drops
//    the top-of-tile barrier: P(it)'s buffer was last read by PV(it - 2), done in every warpgroup
//    before the P barrier of tile it - 1. Two barriers a tile (maxima; P written) instead of three.
//  - The same arithmetic in the same order as the round-4 kernel (scores, P, rescale, PV k-steps):
//    its outputs bit for bit (tests/test_cuda_mla.c checks it).
//  - Shared memory: the round-4 layout + a second P buffer (rs::Lay<2>): 208 KB.
__global__ void __launch_bounds__(kThreads, 1) wgmma_decode_rs2_kernel(Args a, const __grid_constant__ CUtensorMap tm) {
    using namespace q8;
    constexpr int N = 32;
    constexpr int kS = rs::kStages;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const rs::Block<2> b(a, tm, smem_raw);

    // accumulators zeroed one register at a time (asm: no shared zero register that later copies read)
    float o[4][N / 2], sn[16], snl[16];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < N / 2; i++) asm volatile("mov.b32 %0, 0;\n" : "=f"(o[j][i]));
#pragma unroll
    for (int i = 0; i < 16; i++) {
        asm volatile("mov.b32 %0, 0;\n" : "=f"(sn[i]));
        asm volatile("mov.b32 %0, 0;\n" : "=f"(snl[i]));
    }
    float l1 = 0.0f, l0 = 0.0f, m0 = -INFINITY, m1 = -INFINITY; // this order: see the round-4 kernel
    const uint64_t dp0 = desc(b.sb + rs::p_off, 128, kPGroup);

    if (b.ntiles > 0) {
        mbar_wait(b.bars, 0);
        q8_issue_s<false>(sn, snl, b.sb + rs::raw_off, b.wg, b.dqh, b.dql, b.dqe);
    }
    wgmma_wait<0>();

    for (int it = 0; it < b.ntiles; it++) {
        const uint32_t raw = b.sb + rs::raw_off + (it % kS) * kStage;
        // S(it) is done (the prologue's wait, or tile it - 1's second wait); PV(it - 1) may still run
        fence_acc<16>(sn);
        fence_acc<16>(snl);
        float s[16];
#pragma unroll
        for (int i = 0; i < 16; i++) s[i] = sn[i] + snl[i] * 0.0625f;
        if (it + 1 < b.ntiles) { // S(it + 1) runs under this tile's softmax
            const int nx = it + 1;
            mbar_wait(b.bars + (nx % kS) * 8, (uint32_t)(nx / kS) & 1);
            q8_issue_s<false>(sn, snl, b.sb + rs::raw_off + (nx % kS) * kStage, b.wg, b.dqh, b.dql, b.dqe);
        }

        uint32_t vx[4][4][2];
        b.load_v(vx, raw);

        // the scores of the summed terms (q8_scores' expressions, so its values)
        float mx0, mx1, al0, al1;
        q8_scores<false>(s, s, b.begin + it * kTile + 32 * b.wg + 2 * b.t, b.end, b.f0, b.f1, mx0, mx1);
        b.softmax_p(s, mx0, mx1, it, m0, m1, l0, l1, al0, al1);

        wgmma_wait<0>(); // S(it + 1) and PV(it - 1) done: the fragments and accumulators are free
#pragma unroll
        for (int j = 0; j < 4; j++) fence_acc<N / 2>(o[j]);
        uint32_t av[4][4][4];
        rs::v_fragments(av, vx);
        b.rescale<N>(o, al0, al1);
        rs::issue_pv<N, 2>(o, av, dp0, it);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < 4; j++) fence_acc<N / 2>(o[j]);

    rs::write_out<N>(a, b, o, m0, m1, l0, l1);
}

// FP8 pages, round 6 (from 64K rows x context at blocks of <= 32 heads, as its round-7 form below by default;
// LUNAR_MLA_WGMMA_FP8=st forces round 6 as it was; larger blocks run the round-4 kernel). Rounds 4-5 compute S with heads as M, padded to 64 (A = the two e4m3 Q terms, 64 rows; B = 32
// positions of the tile per warpgroup): at <= 32 heads half of S's rows are zeros, and the operands read
// from shared memory are 216 KB a tile (each warpgroup reads all of both Q terms, 2 x 36 KB, for its 32
// positions), ~0.85 us of round 5's 2.39 us a tile at 128 B a clock (docs/benchmarks.md, "MLA decode, FP8
// pages, round 5"). Here S^T = K Q^T: M = the tile's 64 positions (A = the e4m3 tile as TMA wrote it,
// K-major, the same swizzled descriptors), N = 32 per warpgroup = its 16 heads' hi term then their lo term
// (B = Q in the ST rows of q8_quantise_q<true>): a warpgroup's 18 m64n32k32 steps read the tile once (36
// KB) and its heads' Q (18 KB), 108 KB a tile for the block, and no padded rows are multiplied.
//  - The warpgroups split the heads, not the positions: a thread's accumulators are positions 16 w + g and
//    + 8 (w: its warp in the warpgroup) of heads 16 wg + 8 i + 2 t + c (i, c = 0, 1; hi in columns i = 0, 1,
//    lo in 2, 3), so the two terms of a score meet in one thread (s = hi + lo / 16, as before) and the
//    softmax over a head's positions stays inside the warpgroup: a maximum over the thread's two positions,
//    over g by shuffles, over the 4 warps through shared memory behind a named barrier of the warpgroup's
//    128 threads (not the block's). The sums stay per thread (rescaled by the head's factor like the
//    maxima) and meet once, at the end.
//  - P goes to the same buffer as rounds 4-5 (f16, [head][position] core-matrix order, read by PV as its
//    K-major B), one 2-byte store per score (a thread's positions of a head are 8 apart); PV, the V^T
//    fragments and O^T are round 5's (each warpgroup its 256 dims over all heads).
//  - Round 5's pipeline: S(it + 1) issued before tile it's softmax (only 16 accumulators in flight now),
//    one wgmma wait a tile (S(it + 1) and PV(it - 1)), accumulators zeroed by asm and S issued without
//    zeroing. Tile it's stage is refilled (tile it + 3) after the block barrier that publishes P (the
//    maxima no longer meet at a block barrier); the rescale factors are double-buffered by tile (a
//    warpgroup may write tile it + 1's before the other has read tile it's: no block barrier between).
//  - Arithmetic: round 5's scores, exponentials, f16 P, PV and rescale per head; the sums over positions
//    run in another order (per thread, then across threads at the end), so not round 5's bits.
//  - Measured (docs/benchmarks.md, "MLA decode, FP8 pages, round 6"): 1.15-1.35x round 5 from 64K rows x
//    context (H = 32, B = 64, 32K: 463 us, 61 % of the latent-bytes floor, 1.79 us a tile against 2.40).
//    kS = 4 (=st4: Q's 40 KB left room for a fourth e4m3 stage) measured 0.97-1.00x kS = 3: the copies
//    are not what the tile waits for; it stays opt-in.
namespace st {
// S^T of the tile in stage `raw` for one warpgroup: 18 m64n32k32 steps (k-step ks < 16 in box ks / 4 at
// 32 (ks & 3) bytes, the rope in box 4: the same offset in the tile and in Q), issued and committed, not
// waited; not zeroed (the first step's scale-d 0 ignores the old values: see the round-5 kernel)
template <bool Commit = true> __device__ __forceinline__ void issue_s(float (&s)[16], uint32_t raw, uint64_t dq) {
    using namespace q8;
    fence_acc<16>(s);
    wgmma_fence();
    const uint64_t dt = desc_sw(raw, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < 18; ks++) {
        const uint64_t off = (uint64_t)(((ks >> 2) * kBox + (ks & 3) * 32) >> 4);
        wgmma_m64n32_e4m3(s, dt + off, dq + off, ks > 0);
    }
    if constexpr (Commit) wgmma_commit();
}
// 2^x of a score against its head's maximum (round 9's kXFtz: one ex2.approx.ftz instead of exp2f's ex2.approx.f32,
// whose range check keeps results below 2^-126: those become 0, as f16 P makes them anyway)
template <bool Ftz> __device__ __forceinline__ float exp2_tile(float x) {
    if constexpr (Ftz) {
        float y;
        asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
        return y;
    } else {
        return exp2f(x);
    }
}
// the 128 threads of warpgroup wg (named barrier 1 + wg; 0 is __syncthreads)
__device__ __forceinline__ void wg_sync(int wg) { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory"); }
// the heads' maxima over the warpgroup's 64 positions: the 8 lanes of a column (g) by shuffles, then the
// warpgroup's 4 warps through red (16 floats a warp: 2 row halves x 8 columns) behind its named barrier;
// every thread ends with its heads' maxima. red is rewritten only after the tile's block barrier.
__device__ __forceinline__ void wg_max(float (&mx)[2][2], float *red, int wg, int w4, int g, int t) {
#pragma unroll
    for (int x = 4; x <= 16; x <<= 1)
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int c = 0; c < 2; c++) mx[i][c] = fmaxf(mx[i][c], __shfl_xor_sync(0xffffffffu, mx[i][c], x));
    if (g == 0)
#pragma unroll
        for (int i = 0; i < 2; i++)
            *reinterpret_cast<float2 *>(red + (wg * 4 + w4) * 16 + 8 * i + 2 * t) = make_float2(mx[i][0], mx[i][1]);
    wg_sync(wg);
#pragma unroll
    for (int w = 0; w < 4; w++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float2 r = *reinterpret_cast<const float2 *>(red + (wg * 4 + w) * 16 + 8 * i + 2 * t);
            mx[i][0] = fmaxf(mx[i][0], r.x), mx[i][1] = fmaxf(mx[i][1], r.y);
        }
}
// Round 9 (kXMrg): the split-K merge in the kernel's tail instead of a second launch (lunar_mla_merge_splits), with
// the merge kernel's arithmetic per head, so its bits (memcmp-equal in the op test). One block merging a whole row
// would read all of its splits' partial O (16 splits x 32 heads x 2 KB = 1 MB at B = 8) through one SM (~100 GB/s:
// ~10 us), so the row's blocks meet at a ticket counter and each merges the row's heads split, split + splits, ..:
// 64 KB a block. The wait needs every block of the row resident: the launcher runs this instance as a cooperative
// launch (the whole grid co-resident, or the launch fails), splits <= 32 (one warp's lanes hold a head's weights,
// as the merge kernel's first warp: its other warps hold zeros then, so the same sum).
// Round 10's kXMt: a thread's partial O loads of merge_tail all issued before the first sum (round 9 measured its tail
// at 4.3 us with 16 splits and 7.2 us with 2, where a thread merged 8 float4 columns one after another, each an L2 round
// trip): NS splits (a power of two dividing 32), so at most 32 / NS heads a block and 16 / NS columns a thread, 16
// loads in flight; the same sums in the same order as the loop below (its bits)
template <int NS>
__device__ __forceinline__ void merge_cols(const Args &a, int tid, size_t rh0, int nk, const float *wts, const float *fac) {
    constexpr int IT = 16 / NS;
    const size_t RH = (size_t)a.rows * a.H;
    float4 v[IT][NS];
#pragma unroll
    for (int j = 0; j < IT; j++) {
        const int idx = tid + j * kThreads;
        if (idx < nk * (kR / 4)) {
            const int k = idx / (kR / 4), d = (idx % (kR / 4)) * 4;
            const size_t rh = rh0 + (size_t)k * NS;
#pragma unroll
            for (int sp = 0; sp < NS; sp++)
                v[j][sp] = __ldcg(reinterpret_cast<const float4 *>(a.o_part + ((size_t)sp * RH + rh) * kR + d));
        }
    }
#pragma unroll
    for (int j = 0; j < IT; j++) {
        const int idx = tid + j * kThreads;
        if (idx < nk * (kR / 4)) {
            const int k = idx / (kR / 4), d = (idx % (kR / 4)) * 4;
            const size_t rh = rh0 + (size_t)k * NS;
            float4 acc = make_float4(0, 0, 0, 0);
#pragma unroll
            for (int sp = 0; sp < NS; sp++) {
                const float w = wts[k * 32 + sp];
                acc.x += w * v[j][sp].x, acc.y += w * v[j][sp].y, acc.z += w * v[j][sp].z, acc.w += w * v[j][sp].w;
            }
            const float f = fac[k];
            *reinterpret_cast<float4 *>(a.o + rh * kR + d) = make_float4(acc.x * f, acc.y * f, acc.z * f, acc.w * f);
        }
    }
}
template <class B, bool Mt = false> __device__ __forceinline__ void merge_tail(const Args &a, const B &b, float *scratch) {
    const int splits = a.splits, tid = b.tid, lane = b.lane, warp = b.warp;
    __threadfence(); // this block's partial O and log2-sum-exp visible device-wide before it arrives
    __syncthreads();
    unsigned *cnt = g_mla_tickets + (size_t)b.row * gridDim.x + blockIdx.x;
    if (tid == 0) {
        atomicAdd(cnt, 1u);
        unsigned seen;
        for (;;) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(cnt) : "memory");
            if (seen >= (unsigned)splits) break;
            __nanosleep(32);
        }
        // every block of the row has passed the wait once the count reaches 2 x splits: that block rearms it
        if (atomicAdd(cnt, 1u) == 2u * (unsigned)splits - 1u) atomicExch(cnt, 0u);
    }
    __syncthreads();
    const size_t RH = (size_t)a.rows * a.H;
    const size_t rh0 = (size_t)b.row * a.H + b.h0 + b.split; // this block's heads: rh0 + k splits
    const int nk = b.nh > b.split ? (b.nh - b.split + splits - 1) / splits : 0;
    float *wts = scratch, *fac = scratch + 32 * 32; // [k][32] the splits' weights, [k] the output factor
    for (int k = warp; k < nk; k += kThreads / 32) {
        const size_t rh = rh0 + (size_t)k * splits;
        const float l = lane < splits ? __ldcg(a.lse_part + (size_t)lane * RH + rh) : -INFINITY;
        float M = l;
#pragma unroll
        for (int x = 16; x; x >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, x));
        const float w = M == -INFINITY || l == -INFINITY ? 0.0f : exp2f(l - M);
        float sum = w;
#pragma unroll
        for (int x = 16; x; x >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, x);
        wts[k * 32 + lane] = w;
        if (lane == 0) fac[k] = sum > 0.0f ? a.out_scale / sum : 0.0f;
    }
    __syncthreads();
    if constexpr (Mt) {
        if (splits == 2) return merge_cols<2>(a, tid, rh0, nk, wts, fac);
        if (splits == 4) return merge_cols<4>(a, tid, rh0, nk, wts, fac);
        if (splits == 8) return merge_cols<8>(a, tid, rh0, nk, wts, fac);
        if (splits == 16) return merge_cols<16>(a, tid, rh0, nk, wts, fac);
    }
    for (int idx = tid; idx < nk * (kR / 4); idx += kThreads) {
        const int k = idx / (kR / 4), d = (idx % (kR / 4)) * 4;
        const size_t rh = rh0 + (size_t)k * splits;
        float4 acc = make_float4(0, 0, 0, 0);
#pragma unroll 8
        for (int sp = 0; sp < splits; sp++) {
            const float w = wts[k * 32 + sp];
            const float4 v = __ldcg(reinterpret_cast<const float4 *>(a.o_part + ((size_t)sp * RH + rh) * kR + d));
            acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
        }
        const float f = fac[k];
        *reinterpret_cast<float4 *>(a.o + rh * kR + d) = make_float4(acc.x * f, acc.y * f, acc.z * f, acc.w * f);
    }
}
} // namespace st

// Round 7 (the default since session 11: Lazy and Pipe; =st / =st4 keep round 6, =stl / =stp one of the two):
//  - Lazy: P is computed against each head's running maximum m as it stands, with no exchange of the tile's
//    maxima and no warpgroup barrier; a thread whose score passes m + lazy (log2 domain, 8 by default: P <=
//    256, f16 keeps its 11 bits) votes at the block barrier that already publishes P, and only then (the first
//    tile always: m = -inf) the maxima are exchanged as in round 6, the heads past m + lazy take the new maximum
//    (P rewritten, l and O's columns rescaled behind a second barrier) and the others keep theirs. Exact: every
//    head's P, l and lse use one m, the one applied (FlashAttention-4's and FlashMLA's conditional rescale).
//  - Pipe: the tile's one wgmma wait (S(it + 1), PV(it - 1)) moved from after the softmax to the tile's top,
//    so S(it + 1) runs on under the softmax, the V^T fragments, the block barrier and the PV issue; PV(it - 1)
//    is then waited for at the top. (A wait_group 1 after the softmax, retiring PV(it - 1) and leaving S(it + 1)
//    in flight, drew ptxas's C7514 (every wgmma serialised), with S issued under a branch or unconditionally.)
//  - Measured (docs/benchmarks.md, "MLA decode, FP8 pages, round 7"): both 1.03-1.15x round 6 from 64K rows x
//    context, 1.12-1.15x from 512K (H = 32, B = 64, 32K: 400 us, 70 % of the latent-bytes floor); Lazy alone
//    1.03-1.14x, Pipe alone 1.00-1.02x; ncu: 15 % fewer instructions; 226 registers, no spills.
// (lazy: the Lazy kernels' threshold, a parameter of its own: a field of Args changes the other kernels' PTX)
// (X: round 8's switches, rs::kXQ / kXPdl / kXCvt; 0 = round 7)
template <int kS, bool Lazy = false, bool Pipe = false, int X = 0>
__global__ void __launch_bounds__(kThreads, 1) wgmma_decode_st_kernel(Args a, const __grid_constant__ CUtensorMap tm, float lazy) {
    using namespace q8;
    constexpr int N = 32;
    constexpr bool Cvt = (X & rs::kXCvt) != 0, Trace = (X & rs::kXTrace) != 0, Ftz = (X & rs::kXFtz) != 0;
    constexpr bool Pv = (X & rs::kXPv) != 0; // round 10: PV(it - 1) in flight past the top wait
    static_assert(!Pv || (Lazy && Pipe && Cvt), "round 10 builds on round 7's pipeline; its pad tile on mask_v");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    if constexpr (Trace) trace_stamp(0);
    const rs::Block<2, true, kS, X> b(a, tm, smem_raw);
    if constexpr (Trace) trace_stamp(1);
    using L = typename decltype(b)::L;
    const int w4 = b.warp & 3, wg = b.wg, t = b.t, g = b.g;
    float *red = b.red; // [2 warpgroups][4 warps][16 heads]: the maxima, at the end the sums
    // this thread's heads 16 wg + 8 i + 2 t + c: their score factors
    float f[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int c = 0; c < 2; c++) f[i][c] = b.sqs[16 * wg + 8 * i + 2 * t + c] * a.scale2;

    float o[4][N / 2], sn[16];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < N / 2; i++) asm volatile("mov.b32 %0, 0;\n" : "=f"(o[j][i]));
#pragma unroll
    for (int i = 0; i < 16; i++) asm volatile("mov.b32 %0, 0;\n" : "=f"(sn[i]));
    float m[2][2], l[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int c = 0; c < 2; c++) m[i][c] = -INFINITY, l[i][c] = 0.0f;
    const uint64_t dp0 = desc(b.sb + L::p_off, 128, kPGroup);
    const uint64_t dq = desc_sw(b.sb + wg * 4096, 16, 1024); // ST rows 32 wg ..

    if (b.ntiles > 0) {
        mbar_wait(b.bars, 0);
        st::issue_s(sn, b.sb + L::raw_off, dq);
    }
    wgmma_wait<0>();
    if constexpr (Trace) trace_stamp(2);

    // One tile: Ph = 0 every tile of the instances before round 10 (the loop's body as it was); round 10 (Pv) runs
    // the tiles in pairs, Ph = 1 the first (everything retired at its start) and Ph = 2 the second, whose PV(it - 1)
    // stays in flight from its top wait to the wait before its V^T fragments; the pair ends with wait_group 0.
    // ptxas follows the wgmma groups only through straight-line code: PV(it - 1) pending across the loop's back
    // edge, or a branch around the second tile, drew C7514 (every wgmma serialised). So an odd tile count runs a pad
    // tile it = ntiles: every position past the end (scores -inf, P 0, its V bytes zeroed by mask_v), which adds
    // exact zeros to O and l and moves no maximum.
    auto tile = [&](int it, auto ph) {
        constexpr int Ph = decltype(ph)::value;
            const uint32_t raw = b.sb + L::raw_off + (it % kS) * kStage;
            // Pipe: the tile's one wait is here (S(it) and PV(it - 1) done), not after the softmax: S(it + 1)
            // then runs on under the softmax, the V^T fragments, the block barrier, the rescale and the PV issue
            if constexpr (Ph == 2) {
                wgmma_wait<1>(); // S(it) done; PV(it - 1) runs on (O and the fragments untouched until the second wait)
            } else if constexpr (Pipe && Ph == 0) {
                wgmma_wait<0>();
#pragma unroll
                for (int j = 0; j < 4; j++) fence_acc<N / 2>(o[j]);
            }
            fence_acc<16>(sn);
            // s[i][e]: head (i, e & 1), position 16 w4 + g + 8 (e >> 1): the two terms summed
            float s[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[i][e] = sn[4 * i + e] + sn[4 * i + 8 + e] * 0.0625f;
            if constexpr (Ph != 0) {
                // S(it + 1) committed after PV(it - 1); on the last tile (and the pad tile) S of the last tile
                // again (its stage is never refilled; the result is never read), so every tile commits the same
                // groups and the second wait of a pair's second tile always retires PV(it - 1)
                const int nx = min(it + 1, b.ntiles - 1);
                if (nx > it) mbar_wait(b.bars + (nx % kS) * 8, (uint32_t)(nx / kS) & 1);
                st::issue_s(sn, b.sb + L::raw_off + (nx % kS) * kStage, dq);
            } else if (it + 1 < b.ntiles) { // S(it + 1) runs under this tile's softmax
                const int nx = it + 1;
                mbar_wait(b.bars + (nx % kS) * 8, (uint32_t)(nx / kS) & 1);
                st::issue_s(sn, b.sb + L::raw_off + (nx % kS) * kStage, dq);
            }

            uint32_t vx[4][4][2];
            // (Ph 2: after the second wait, when PV(it - 1)'s fragments are free: loaded here, the V bytes, O, the
            // fragments in flight and S(it + 1) would need 255 registers and spill)
            if constexpr (Ph != 2) b.load_v(vx, raw);

            // scores (positions at or past the end -inf) and each head's maximum over the thread's positions
            const int pos = b.begin + it * kTile + 16 * w4 + g;
            const bool ok0 = pos < b.end, ok1 = pos + 8 < b.end;
            float mx[2][2];
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    s[i][c] = ok0 ? s[i][c] * f[i][c] : -INFINITY;
                    s[i][2 + c] = ok1 ? s[i][2 + c] * f[i][c] : -INFINITY;
                    mx[i][c] = fmaxf(s[i][c], s[i][2 + c]);
                }
            unsigned char *P = b.smem + L::p_off + (it & 1) * kPBytes + (2 * wg) * kPGroup + (2 * w4) * 128 + 2 * t * 16 + 2 * g;
            float *alpha = b.alpha + (it & 1) * 32;
            bool moved = false; // Lazy: some maximum of this thread passed its head's m + lazy
            [[maybe_unused]] float ps[2][2]; // Lazy: the tile's sums per head, added to l after the block barrier
            if constexpr (Lazy) {
                // P with the running maxima as they are (no exchange, no warpgroup barrier): exact as long as
                // every score of a head stays <= m + lazy (P <= 2^lazy, f16 keeps its 11 bits there); the block
                // barrier below reports whether some score did not, and then the tile is redone with the maxima
                // exchanged (the first tile always: m = -inf)
#pragma unroll
                for (int i = 0; i < 2; i++)
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        moved |= mx[i][c] > m[i][c] + lazy;
                        const float e0 = st::exp2_tile<Ftz>(s[i][c] - m[i][c]), e1 = st::exp2_tile<Ftz>(s[i][2 + c] - m[i][c]);
                        ps[i][c] = e0 + e1;
                        *reinterpret_cast<__half *>(P + i * kPGroup + c * 16) = __float2half_rn(e0);
                        *reinterpret_cast<__half *>(P + i * kPGroup + c * 16 + 128) = __float2half_rn(e1);
                    }
            } else {
                st::wg_max(mx, red, wg, w4, g, t); // the warpgroup's maxima in

                // P (f16) into buffer it & 1 at [head][position] (core-matrix order), the running maxima and sums,
                // the rescale factors into alpha buffer it & 1 (heads 0..31) for the threads holding those heads' columns
                float al[2][2];
#pragma unroll
                for (int i = 0; i < 2; i++)
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        const float mn = fmaxf(m[i][c], mx[i][c]);
                        al[i][c] = exp2f(m[i][c] - mn);
                        m[i][c] = mn;
                        moved |= al[i][c] != 1.0f;
                        const float e0 = exp2f(s[i][c] - mn), e1 = exp2f(s[i][2 + c] - mn);
                        l[i][c] = l[i][c] * al[i][c] + (e0 + e1);
                        *reinterpret_cast<__half *>(P + i * kPGroup + c * 16) = __float2half_rn(e0);
                        *reinterpret_cast<__half *>(P + i * kPGroup + c * 16 + 128) = __float2half_rn(e1);
                    }
                if (w4 == 0 && g == 0)
#pragma unroll
                    for (int i = 0; i < 2; i++)
                        *reinterpret_cast<float2 *>(alpha + 16 * wg + 8 * i + 2 * t) = make_float2(al[i][0], al[i][1]);
            }

            if constexpr (Ph != 0) {
                if constexpr (Ph == 2) {
                    wgmma_wait<1>(); // PV(it - 1) done (S(it + 1) runs on): the fragments and O are free
                    b.load_v(vx, raw);
                }
#pragma unroll
                for (int j = 0; j < 4; j++) fence_acc<N / 2>(o[j]);
            } else if constexpr (!Pipe) {
                wgmma_wait<0>(); // S(it + 1) and PV(it - 1) done: the fragments and accumulators are free
#pragma unroll
                for (int j = 0; j < 4; j++) fence_acc<N / 2>(o[j]);
            }
            uint32_t av[4][4][4];
            if constexpr (Cvt) {
                const int nvalid = b.end - (b.begin + it * kTile);
                if (nvalid < kTile) rs::mask_v(vx, nvalid, t); // the last tile of a split only
                rs::v_fragments_cvt(av, vx);
            } else {
                rs::v_fragments(av, vx);
            }
            fence_async_smem();
            // P and the factors published (and every read of tile it's stage done); O^T's columns rescaled
            // where a maximum of the block moved
            if (__syncthreads_or(moved)) {
                if constexpr (Lazy) {
                    // rare (the first tile; then a score past its head's m + lazy): the maxima over the
                    // warpgroup's 64 positions exchanged as in the exact kernel; heads whose maximum passed
                    // m + lazy take it as m (the rest keep theirs and their P), their P rewritten, then O's
                    // columns rescaled after a second barrier
                    st::wg_max(mx, red, wg, w4, g, t);
                    float al[2][2];
#pragma unroll
                    for (int i = 0; i < 2; i++)
#pragma unroll
                        for (int c = 0; c < 2; c++) {
                            al[i][c] = 1.0f;
                            if (mx[i][c] > m[i][c] + lazy) { // the same decision in every thread of the head
                                const float mn = mx[i][c];
                                al[i][c] = exp2f(m[i][c] - mn);
                                m[i][c] = mn;
                                const float e0 = exp2f(s[i][c] - mn), e1 = exp2f(s[i][2 + c] - mn);
                                ps[i][c] = e0 + e1;
                                *reinterpret_cast<__half *>(P + i * kPGroup + c * 16) = __float2half_rn(e0);
                                *reinterpret_cast<__half *>(P + i * kPGroup + c * 16 + 128) = __float2half_rn(e1);
                            }
                            l[i][c] *= al[i][c];
                        }
                    if (w4 == 0 && g == 0)
#pragma unroll
                        for (int i = 0; i < 2; i++)
                            *reinterpret_cast<float2 *>(alpha + 16 * wg + 8 * i + 2 * t) = make_float2(al[i][0], al[i][1]);
                    fence_async_smem();
                    __syncthreads(); // the new P and the factors published
                }
#pragma unroll
                for (int i = 0; i < N / 8; i++) {
                    const float2 fa = *reinterpret_cast<const float2 *>(alpha + 8 * i + 2 * t);
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        o[j][4 * i] *= fa.x, o[j][4 * i + 1] *= fa.y, o[j][4 * i + 2] *= fa.x, o[j][4 * i + 3] *= fa.y;
                }
            }
            if constexpr (Lazy) {
#pragma unroll
                for (int i = 0; i < 2; i++)
#pragma unroll
                    for (int c = 0; c < 2; c++) l[i][c] += ps[i][c];
            }
            if (b.tid < 32) b.issue_tma(it + kS);
            rs::issue_pv<N, 2>(o, av, dp0, it);
    };
    if constexpr (Pv) {
        for (int it = 0; it < b.ntiles; it += 2) {
            tile(it, std::integral_constant<int, 1>());
            tile(it + 1, std::integral_constant<int, 2>());
            wgmma_wait<0>();
        }
    } else {
        for (int it = 0; it < b.ntiles; it++) tile(it, std::integral_constant<int, 0>());
    }
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < 4; j++) fence_acc<N / 2>(o[j]);
    if constexpr (Trace) trace_stamp(3);

    // each head's sum over the threads of its warpgroup (g by shuffles, the 4 warps through red); the output
    // factor (x 2^8: V was x 2^-8) and the split's log2-sum-exp per head
#pragma unroll
    for (int x = 4; x <= 16; x <<= 1)
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int c = 0; c < 2; c++) l[i][c] += __shfl_xor_sync(0xffffffffu, l[i][c], x);
    __syncthreads(); // nobody reads red any more
    if (g == 0)
#pragma unroll
        for (int i = 0; i < 2; i++)
            *reinterpret_cast<float2 *>(red + (wg * 4 + w4) * 16 + 8 * i + 2 * t) = make_float2(l[i][0], l[i][1]);
    __syncthreads();
    const bool direct = a.splits == 1;
    if (w4 == 0 && g == 0) {
        const float os = (direct ? a.out_scale : 1.0f) * (Cvt ? 1.0f : 256.0f); // (Cvt: V exact, not x 2^-8)
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int hl = 8 * i + 2 * t + c, h = 16 * wg + hl;
                const float ls = red[(wg * 4) * 16 + hl] + red[(wg * 4 + 1) * 16 + hl] + red[(wg * 4 + 2) * 16 + hl] +
                                 red[(wg * 4 + 3) * 16 + hl];
                b.linv[h] = ls > 0.0f ? os / ls : 0.0f;
                if (!direct && h < b.nh)
                    a.lse_part[(size_t)b.split * a.rows * a.H + (size_t)b.row * a.H + b.h0 + h] =
                        ls > 0.0f ? m[i][c] + log2f(ls) : -INFINITY;
            }
    }
    __syncthreads();
    if constexpr (Trace) trace_stamp(4);
    rs::store_ot<N>(a, b, o);
    if constexpr ((X & rs::kXMrg) != 0) {
        if (a.splits > 1) {
            if constexpr (Trace) trace_stamp(9);
            // (the stages are free now)
            st::merge_tail<decltype(b), (X & rs::kXMt) != 0>(a, b, reinterpret_cast<float *>(b.smem + L::raw_off));
        }
    }
    if constexpr (Trace) {
        trace_stamp(5);
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;\n" : "=r"(smid));
        trace_stamp(15, (unsigned long long)b.ntiles | (unsigned long long)smid << 32);
    }
}

struct Plan {
    int hb, hpb, splits, chunk;
};
// Heads: ceil(H / 64) blocks of equal size (H = 96: 2 x 48). Splits of the context: as the
// mma.sync kernel's plan, minimise (waves of one-block-per-SM blocks) x (tiles per split + ~3 tiles
// of fixed cost per block: the 64 x 576 q load, pipeline fill, partial write).
Plan plan(int rows, int H, int max_n) {
    Plan p;
    p.hb = (H + kM - 1) / kM;
    p.hpb = (H + p.hb - 1) / p.hb;
    const int tiles = max_n > 0 ? (max_n + kTile - 1) / kTile : 1;
    const double units = (double)rows * p.hb, sms = lunar_mla_sm_count();
    int best = 1;
    double best_cost = 1e300;
    const double most = ceil(4.0 * sms / units);
    for (int s = 1; s <= tiles && s <= most; s++) {
        const int per = (tiles + s - 1) / s;
        const double cost = ceil(units * s / sms) * (per + 3.0);
        if (cost < best_cost) best = s, best_cost = cost;
    }
    p.chunk = (tiles + best - 1) / best * kTile;
    p.splits = max_n > 0 ? (max_n + p.chunk - 1) / p.chunk : 1;
    return p;
}

template <bool FP8, bool TMA, bool SW> void launch(const Args &a, const CUtensorMap &tm, const Plan &p, cudaStream_t s) {
    static bool attr = false;
    if (!attr) {
        CUDA_CHECK(cudaFuncSetAttribute(wgmma_decode_kernel<FP8, TMA, SW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)Lay<FP8>::smem));
        attr = true;
    }
    wgmma_decode_kernel<FP8, TMA, SW><<<dim3(p.hb, p.splits, a.rows), kThreads, Lay<FP8>::smem, s>>>(a, tm);
    CUDA_CHECK_LAUNCH();
}

// The latent as a 2-D tensor [slots][row] for the bulk tensor copies. The pool's slot count is not
// passed down: 2^28 slots (309 GB of bf16 rows) bound every pool, and only the slots of listed
// pages are ever addressed. bf16, SW: elements of 2 bytes, boxes of 64 x 64 slots with the 128-byte
// swizzle; bf16, !SW: bytes, boxes of 16 x 64 slots, no swizzle; FP8 (SW only): 4-byte words, one
// box of the whole 576-byte row x 64 slots, no swizzle (the raw row-major stage). false: no driver
// entry point or the map was refused (the caller keeps cp.async).
bool make_tmap(CUtensorMap *m, const void *latent, bool fp8, bool sw) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = lunar_tmap_encoder();
    if (!fn) return false;
    const cuuint64_t row_bytes = fp8 ? kRow : kRow * 2;
    const cuuint64_t dims[2] = {fp8 ? (cuuint64_t)kRow / 4 : sw ? (cuuint64_t)kRow : row_bytes, 1ull << 28};
    const cuuint64_t strides[1] = {row_bytes};
    const cuuint32_t box[2] = {fp8 ? (cuuint32_t)kRow / 4 : sw ? 64u : 16u, (cuuint32_t)kTile}, es[2] = {1, 1};
    const CUtensorMapDataType dt =
        fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT32 : sw ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8;
    return fn(m, dt, 2, const_cast<void *>(latent), dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
              sw && !fp8 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
              sw ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

void launch_q8(const Args &a, const CUtensorMap &tm, const Plan &p, cudaStream_t s) {
    static bool attr = false;
    if (!attr) {
        CUDA_CHECK(cudaFuncSetAttribute(wgmma_decode_q8_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)q8::smem));
        attr = true;
    }
    wgmma_decode_q8_kernel<<<dim3(p.hb, p.splits, a.rows), kThreads, q8::smem, s>>>(a, tm);
    CUDA_CHECK_LAUNCH();
}
// N: the block's heads padded to 32 (hpb <= 32) or 64
void launch_rs(const Args &a, const CUtensorMap &tm, const Plan &p, cudaStream_t s) {
    static bool attr = false;
    if (!attr) {
        CUDA_CHECK(cudaFuncSetAttribute(wgmma_decode_rs_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)rs::Lay<1>::smem));
        CUDA_CHECK(cudaFuncSetAttribute(wgmma_decode_rs_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)rs::Lay<1>::smem));
        attr = true;
    }
    if (p.hpb <= 32) wgmma_decode_rs_kernel<32><<<dim3(p.hb, p.splits, a.rows), kThreads, rs::Lay<1>::smem, s>>>(a, tm);
    else wgmma_decode_rs_kernel<64><<<dim3(p.hb, p.splits, a.rows), kThreads, rs::Lay<1>::smem, s>>>(a, tm);
    CUDA_CHECK_LAUNCH();
}
// Round 5: blocks of <= 32 heads only (the in-flight S needs registers N = 64 does not have)
void launch_rs2(const Args &a, const CUtensorMap &tm, const Plan &p, cudaStream_t s) {
    static bool attr = false;
    if (!attr) {
        CUDA_CHECK(cudaFuncSetAttribute(wgmma_decode_rs2_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)rs::Lay<2>::smem));
        attr = true;
    }
    wgmma_decode_rs2_kernel<<<dim3(p.hb, p.splits, a.rows), kThreads, rs::Lay<2>::smem, s>>>(a, tm);
    CUDA_CHECK_LAUNCH();
}
// Round 6: blocks of <= 32 heads only (the warpgroups take 16 heads each); S e4m3 stages (3 or 4)
// Round 7: Lazy (=stl: the lazy rescale), Pipe (=stp: the tile's wait at its top), both (=stlp, the default)
// Round 8: X (rs::kXQ / kXPdl / kXCvt); kXPdl launches by launch_pdl (the kernel waits in Block's constructor)
template <int S, bool Lazy = false, bool Pipe = false, int X = 0>
void launch_st(const Args &a, const CUtensorMap &tm, const Plan &p, cudaStream_t s, float lazy = 8.0f) {
    using L = rs::Lay<2, S, 5>;
    static bool attr = false;
    if (!attr) {
        CUDA_CHECK(cudaFuncSetAttribute(wgmma_decode_st_kernel<S, Lazy, Pipe, X>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L::smem));
        attr = true;
    }
    if constexpr ((X & rs::kXPdl) != 0) {
        launch_pdl(wgmma_decode_st_kernel<S, Lazy, Pipe, X>, dim3(p.hb, p.splits, a.rows), dim3(kThreads), L::smem, s, a,
                   tm, lazy);
    } else if constexpr ((X & rs::kXMrg) != 0) {
        // round 9's merge in the tail: the blocks of a row wait for each other, so the grid must be co-resident
        // (merge_in_kernel checked that it fits one wave; the cooperative launch guarantees it or fails)
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(p.hb, p.splits, a.rows);
        cfg.blockDim = dim3(kThreads);
        cfg.dynamicSmemBytes = L::smem;
        cfg.stream = s;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeCooperative;
        at[0].val.cooperative = 1;
        cfg.attrs = at, cfg.numAttrs = 1;
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, wgmma_decode_st_kernel<S, Lazy, Pipe, X>, a, tm, lazy));
    } else {
        wgmma_decode_st_kernel<S, Lazy, Pipe, X><<<dim3(p.hb, p.splits, a.rows), kThreads, L::smem, s>>>(a, tm, lazy);
    }
    CUDA_CHECK_LAUNCH();
}
// The e4m3 latent for the FP8-score kernels: bytes, boxes of 128 x 64 slots with the 128-byte
// swizzle; the box at 512 runs past the 576-byte row and the copy engine fills it with zeros.
bool make_tmap_q8(CUtensorMap *m, const void *latent) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = lunar_tmap_encoder();
    if (!fn) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)kRow, 1ull << 28};
    const cuuint64_t strides[1] = {(cuuint64_t)kRow};
    const cuuint32_t box[2] = {128u, (cuuint32_t)kTile}, es[2] = {1, 1};
    return fn(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void *>(latent), dims, strides, box, es,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Round 9's merge in the kernel (rs::kXMrg) applies: a split context, at most 32 splits (merge_tail's one warp per
// head), every block resident at once (one block per SM: the st kernel's ~180 KB of shared memory), and the
// ticket counters cover the rows x head blocks
bool merge_in_kernel(const Plan &p, int rows) {
    return p.splits > 1 && p.splits <= 32 && (long)p.hb * p.splits * rows <= lunar_mla_sm_count() &&
           (long)p.hb * rows <= kTickets;
}

bool env_is(const char *name, const char *v) {
    const char *e = getenv(name);
    return e && !strcmp(e, v);
}

bool trace_on; // lunar_cuda_mla_wgmma_trace set a buffer

} // namespace

// the bench's trace buffer (tools/device/bench_mla.c declares it: fp8trace)
extern "C" void lunar_cuda_mla_wgmma_trace(void *buf, int max_blocks);
extern "C" void lunar_cuda_mla_wgmma_trace(void *buf, int max_blocks) {
    unsigned long long *p = (unsigned long long *)buf;
    CUDA_CHECK(cudaMemcpyToSymbol(g_trace, &p, sizeof p));
    CUDA_CHECK(cudaMemcpyToSymbol(g_trace_blocks, &max_blocks, sizeof max_blocks));
    trace_on = buf != NULL;
}

size_t lunar_mla_wgmma_ws(int rows, int H, int max_n) {
    const Plan p = plan(rows, H, max_n);
    return p.splits > 1 ? (size_t)p.splits * rows * H * (kR + 1) * sizeof(float) : 0;
}

void lunar_mla_wgmma_decode(float *o, const float *q_lat, const float *q_pe, const lunar_cuda_mla_cache *c,
                            const int32_t *row_seq, const int32_t *lens, int max_n, int rows, int H, float scale,
                            void *ws, cudaStream_t s) {
    CUDA_REQUIRE(rows <= 65535);
    const Plan p = plan(rows, H, max_n);
    Args a;
    a.o = o;
    a.q_lat = q_lat, a.q_pe = q_pe, a.cache = (const unsigned char *)c->latent, a.bt = c->block_tables;
    a.max_blocks = c->max_blocks, a.row_seq = row_seq, a.lens = lens;
    a.rows = rows, a.H = H, a.hpb = p.hpb, a.chunk = p.chunk, a.splits = p.splits;
    const bool fp8 = c->dtype == LUNAR_CUDA_KV_FP8;
    const float kv = fp8 ? c->scale : 1.0f;
    a.scale2 = scale * kv * 1.4426950408889634f;
    a.out_scale = kv;
    a.o_part = (float *)ws;
    a.lse_part = (float *)ws + (size_t)p.splits * rows * H * kR;
    if (p.splits > 1) CUDA_REQUIRE(ws != NULL);
    CUtensorMap tm;
    memset(&tm, 0, sizeof tm);
    // LUNAR_MLA_WGMMA_SW=0: the session-4 unswizzled tiles; LUNAR_MLA_WGMMA_TMA=0: cp.async copies
    const bool sw = !env_is("LUNAR_MLA_WGMMA_SW", "0");
    const bool tma = !env_is("LUNAR_MLA_WGMMA_TMA", "0") && (sw || !fp8) && make_tmap(&tm, c->latent, fp8, sw);
    if (env_is("LUNAR_MLA_WGMMA_VERBOSE", "1")) { // which variant runs (a refused tensor map falls back quietly)
        static int seen = 0;
        const int bit = 1 << ((fp8 ? 4 : 0) + (sw ? 2 : 0) + (tma ? 1 : 0));
        if (!(seen & bit))
            fprintf(stderr, "mla wgmma decode: %s pages, %s tiles, %s\n", fp8 ? "fp8" : "bf16",
                    sw ? "swizzled" : "unswizzled", tma ? "bulk tensor copies" : "cp.async"),
                seen |= bit;
    }
    // FP8 pages on the swizzled tiles with bulk copies: from rows x context = 64K the round-4 kernel
    // (FP8 scores, PV transposed from the e4m3 tile in registers: 1.02-1.34x the widening there,
    // 0.96-0.97x at B = 1, 32K; docs/benchmarks.md, "MLA decode, FP8 pages, round 4"), as its
    // round-6 form where a block has <= 32 heads (S^T with heads as N: 1.16-1.34x the round-5 kernel
    // from 64K rows x context, "... round 6") with round 7's lazy rescale and early wait (1.12-1.15x round 6,
    // "... round 7") and round 9's switches (q first and the merge in the kernel below 512K rows x context, V^T by
    // cvt and exp2 ftz: 1.02-1.12x round 7, "... round 9"); below it the tile widened to bf16.
    // LUNAR_MLA_WGMMA_FP8=rs (round 4 only) / rs2 (round 5: S one tile ahead, rs's bits) / st (round 6)
    // / st4 (round 6 with 4 e4m3 stages) / stl, stp, stlp (round 7's parts; stlp round 7, the default until session 13)
    // / widen force one; =s10 / s10a / s10m round 10 (rs::kXPv, kXMt; opt-in);
    // =q8x2 the FP8 scores with a widened V (as accurate, 0.93-1.06x the widening: "MLA decode, FP8
    // pages (session 6)").
    const char *f8 = getenv("LUNAR_MLA_WGMMA_FP8");
    // (=default: as unset, a name for the bench's A/B; =s10: the default's choice plus round 10's kXPv)
    const bool s10 = f8 && !strcmp(f8, "s10");
    const bool forced = f8 && *f8 && strcmp(f8, "default") && !s10, st4 = forced && !strcmp(f8, "st4");
    // round 7: the st kernel runs with the lazy rescale and the tile's wait at its top (stlp) unless forced
    // otherwise: =stl the lazy rescale alone, =stp the moved wait alone, =st / =st4 round 6 as it was
    // round 8: =s8 (stlp with rs::kXQ, kXPdl and kXCvt; opt-in)
    const bool s8 = forced && !strcmp(f8, "s8");
    constexpr int kS8 = rs::kXQ | rs::kXPdl | rs::kXCvt;
    const int x8 = s8 ? kS8 : 0;
    // round 9: =s9q (q first), =s9m (the merge in the kernel where merge_in_kernel allows, else stlp and the merge
    // kernel), =s9c (kXCvt and kXFtz), =s9 (the three). The default since session 13 (stlp's bits; docs/benchmarks.md,
    // "MLA decode, FP8 pages, round 9"): s9 below 512K rows x context where the merge goes into the kernel (H = 32:
    // 1.12x stlp at B = 8, 8K, 1.06x at 32K), s9c elsewhere (1.02-1.03x from 256K); =stlp keeps round 7
    const bool s9q = forced && !strcmp(f8, "s9q"), s9m = forced && !strcmp(f8, "s9m"), s9c = forced && !strcmp(f8, "s9c");
    // (=s10a: s9 with round 10's kXPv, the bench's traced pair of s9; =s10m: s10a with kXMt where it merges)
    const bool s10m = forced && !strcmp(f8, "s10m"), s10a = forced && (!strcmp(f8, "s10a") || s10m);
    const bool s9 = forced && (!strcmp(f8, "s9") || s10a);
    const bool d9 = !forced && (double)rows * max_n < 524288.0 && merge_in_kernel(p, rows), d9c = !forced && !d9;
    const bool mrg = (s9m || s9 || d9) && merge_in_kernel(p, rows);
    int x9 = (s9q || s9 || d9 ? rs::kXQF : 0) | (mrg ? rs::kXMrg : 0) | (s9c || s9 || d9 || d9c ? rs::kXCvt | rs::kXFtz : 0);
    // round 10's instances: q first, the merge and kXMt only where the merge goes into the kernel
    if (s10 || s10a)
        x9 = mrg ? rs::kXQF | rs::kXMrg | rs::kXCvt | rs::kXFtz | rs::kXPv | (s10m ? rs::kXMt : 0) : rs::kXCvt | rs::kXFtz | rs::kXPv;
    const bool any9 = s9q || s9m || s9c || s9;
    bool merged = false; // the launched kernel merged the splits itself (s9m / s9 where merge_in_kernel allows)
    const bool stl = forced ? !strcmp(f8, "stl") || !strcmp(f8, "stlp") || s8 || any9 : true;
    const bool stp = forced ? !strcmp(f8, "stp") || !strcmp(f8, "stlp") || s8 || any9 : true;
    const bool rs2 = p.hpb <= 32 && forced && !strcmp(f8, "rs2");
    const bool st = p.hpb <= 32 && !(forced && (!strcmp(f8, "rs") || rs2));
    const bool rs_wanted = forced ? !strcmp(f8, "rs") || !strcmp(f8, "rs2") || !strcmp(f8, "st") || st4 || stl || stp || s8 ||
                                        any9
                                  : (double)rows * max_n >= 65536.0;
    if (fp8 && sw && rs_wanted && !env_is("LUNAR_MLA_WGMMA_TMA", "0") && make_tmap_q8(&tm, c->latent)) {
        if (env_is("LUNAR_MLA_WGMMA_VERBOSE", "1")) {
            static unsigned long long seen = 0;
            const int v = st ? (st4 ? 3 : x8 ? 8 : x9 ? 9 + x9 / rs::kXQF : stl || stp ? 4 + stl + 2 * stp : 2) : rs2;
            static_assert(9 + (rs::kXMt * 2 - 1) / rs::kXQF < 64, "the seen bits");
            if (!(seen & (1ull << v)))
                fprintf(stderr, "mla wgmma decode: fp8 pages, fp8 scores, V^T from registers%s%s%s%s%s%s%s%s%s\n",
                        st ? (st4 ? ", S^T with heads as N, 4 stages" : ", S^T with heads as N") : rs2 ? ", S one tile ahead" : "",
                        st && stl ? ", lazy rescale" : "", st && stp ? ", wait at the tile's top" : "",
                        st && x8 ? ", q rows at once, dependent launch, V^T by cvt" : "",
                        st && (x9 & rs::kXQF) ? ", q before the copies" : "", st && (x9 & rs::kXMrg) ? ", merge in the kernel" : "",
                        st && (x9 & rs::kXFtz) ? ", V^T by cvt, exp2 ftz" : "",
                        st && (x9 & rs::kXPv) ? ", PV in flight past the top wait" : "",
                        st && (x9 & rs::kXMt) ? ", merge loads batched" : ""),
                    seen |= 1ull << v;
        }
        // the lazy rescale's threshold (=stl / =stlp): 8 (P <= 256) unless LUNAR_MLA_WGMMA_LAZY says otherwise (0:
        // a maximum moves whenever it grows, as in the exact kernel; the op test runs it to exercise the redo)
        const char *lz = getenv("LUNAR_MLA_WGMMA_LAZY");
        // (at most 15: P <= 2^15 stays inside f16's 65504)
        const float lazy = lz && *lz ? fminf(fmaxf((float)atof(lz), 0.0f), 15.0f) : 8.0f;
        // the bench's traced instances (LUNAR_MLA_WGMMA_TRACE=1 and a buffer set): stlp, s8 and s9 (where it merges)
        const bool trace = env_is("LUNAR_MLA_WGMMA_TRACE", "1") && trace_on;
        constexpr int kQ = rs::kXQF, kM9 = rs::kXMrg, kC = rs::kXCvt | rs::kXFtz, kAll = kQ | kM9 | kC;
        constexpr int kPv = rs::kXPv;
        if (st && (x9 & kPv)) { // round 10 (=s10): the default's two instances with PV in flight past the top wait
            constexpr int kMt = rs::kXMt;
            if (trace && x9 == (kAll | kPv)) launch_st<3, true, true, kAll | kPv | rs::kXTrace>(a, tm, p, s, lazy);
            else if (trace && x9 == (kAll | kPv | kMt)) launch_st<3, true, true, kAll | kPv | kMt | rs::kXTrace>(a, tm, p, s, lazy);
            else if (x9 == (kAll | kPv)) launch_st<3, true, true, kAll | kPv>(a, tm, p, s, lazy);
            else if (x9 == (kAll | kPv | kMt)) launch_st<3, true, true, kAll | kPv | kMt>(a, tm, p, s, lazy);
            else launch_st<3, true, true, kC | kPv>(a, tm, p, s, lazy);
            merged = (x9 & kM9) != 0;
        } else if (st && x9) {
            if (trace && x9 == kAll) launch_st<3, true, true, kAll | rs::kXTrace>(a, tm, p, s, lazy);
            else if (x9 == kAll) launch_st<3, true, true, kAll>(a, tm, p, s, lazy);
            else if (x9 == (kQ | kC)) launch_st<3, true, true, kQ | kC>(a, tm, p, s, lazy); // s9 without the merge
            else if (x9 == kQ) launch_st<3, true, true, kQ>(a, tm, p, s, lazy);
            else if (x9 == kM9) launch_st<3, true, true, kM9>(a, tm, p, s, lazy);
            else launch_st<3, true, true, kC>(a, tm, p, s, lazy);
            merged = (x9 & kM9) != 0;
        } else if (trace && st && stl && stp && x8) launch_st<3, true, true, kS8 | rs::kXTrace>(a, tm, p, s, lazy);
        else if (trace && st && stl && stp) launch_st<3, true, true, rs::kXTrace>(a, tm, p, s, lazy);
        else if (st && stl && stp && x8) launch_st<3, true, true, kS8>(a, tm, p, s, lazy);
        else if (st && stl && stp) launch_st<3, true, true>(a, tm, p, s, lazy);
        else if (st && stl) launch_st<3, true, false>(a, tm, p, s, lazy);
        else if (st && stp) launch_st<3, false, true>(a, tm, p, s);
        else if (st) st4 ? launch_st<4>(a, tm, p, s) : launch_st<3>(a, tm, p, s);
        else if (rs2) launch_rs2(a, tm, p, s);
        else launch_rs(a, tm, p, s);
    } else if (fp8 && sw && env_is("LUNAR_MLA_WGMMA_FP8", "q8x2") && !env_is("LUNAR_MLA_WGMMA_TMA", "0") &&
        make_tmap_q8(&tm, c->latent)) {
        if (env_is("LUNAR_MLA_WGMMA_VERBOSE", "1")) {
            static bool seen = false;
            if (!seen) fprintf(stderr, "mla wgmma decode: fp8 pages, fp8 scores, 2 q terms\n"), seen = true;
        }
        launch_q8(a, tm, p, s);
    } else if (fp8) {
        if (!sw) launch<true, false, false>(a, tm, p, s);
        else if (tma) launch<true, true, true>(a, tm, p, s);
        else launch<true, false, true>(a, tm, p, s);
    } else if (sw) {
        if (tma) launch<false, true, true>(a, tm, p, s);
        else launch<false, false, true>(a, tm, p, s);
    } else {
        if (tma) launch<false, true, false>(a, tm, p, s);
        else launch<false, false, false>(a, tm, p, s);
    }
    // (round 9's kXMrg instance merged in its tail)
    if (p.splits > 1 && !merged) lunar_mla_merge_splits(o, a.o_part, a.lse_part, rows * H, p.splits, a.out_scale, s);
}
