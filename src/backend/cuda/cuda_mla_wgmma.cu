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
// This file: that kernel, the split plan and the dispatcher; the FP8-score kernels are in cuda_mla_wgmma_rs.cu and
// _st.cu (cuda_mla_wgmma.cuh says what each holds).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_mla_wgmma.cuh"
#include "backend/cuda/cuda_mla_wgmma.h"

namespace mla_wg {
namespace {

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

// Byte offset of 16-byte chunk j (dims 8j .. 8j + 7) of row r (position or head) in core-matrix
// order. The copy loops hand lane l row 8 rg + (l & 7) and chunk 4 jg + (l >> 3): a warp reads 8
// rows x 64 contiguous bytes and writes 512 contiguous bytes of shared memory (no bank conflict).
__device__ __forceinline__ int core_off(int r, int j) { return (r >> 3) * kGroup + j * 128 + (r & 7) * 16; }
// The session-4 latent tiles (SW = false): the same core matrices, chunk-major (chunk j's 64 rows = 8 core matrices are
// one contiguous KB), so one bulk tensor copy of 16 bytes x 64 rows fills one chunk column:
// K-major (S) leading byte offset 1024 and stride 128, N-major (O) leading 128 and stride 1024.
__device__ __forceinline__ int tile_off(int r, int j) { return j * 1024 + r * 16; }

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
        float ps0, ps1;
        p_tile_bf16(s, smem + L::p_off, wg, t, r0, mn0, mn1, ps0, ps1);
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

} // namespace
} // namespace mla_wg

using namespace mla_wg;

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
    // "... round 7"), round 9's switches (q first and the merge in the kernel, V^T by cvt and exp2 ftz: 1.02-1.12x
    // round 7, "... round 9") and, since session 16, round 10's (PV in flight past the tile's top wait, the merge's
    // loads batched: =s10m, 1.05-1.11x round 9's default at H = 32 from 256K rows x context, Kimi-Linear's FP8 TPOT
    // -0.8 to -1.7 % / -1.2 to -2.9 % at B = 8 / 64, 32K, "... round 11"); below 64K the tile widened to bf16.
    // LUNAR_MLA_WGMMA_FP8 forces one: =widen the widening, =rs the round-4 kernel (at every head count), =stlp round 7
    // as it was (the default until session 13, whose bits every later round keeps: the op test's reference), =s10m the
    // default's choice at every size; =s10p and =s17c are opt-in (below); =default names the unset choice (a name for
    // the bench's A/B); another name runs the widening. Session 19 removed the variants that measured slower than the
    // default that followed them (session 6's two-term kernel with a widened V, round 5, round 6 as it was and round
    // 7's halves, rounds 8 and 9 and round 9's default, round 10 without kXMt: docs/benchmarks.md, "... the variants
    // pruned"; `git show 1ff0730` has them).
    const char *f8 = getenv("LUNAR_MLA_WGMMA_FP8");
    const bool dflt = !f8 || !*f8 || !strcmp(f8, "default"), forced = !dflt;
    // (=s10p: s10m with round 11's kXPw, a dependent launch whose set-up but q runs before its wait: level with s10m
    // in Kimi-Linear's TPOT, 0.91-1.00x alone, "... round 11")
    const bool s10p = forced && !strcmp(f8, "s10p");
    // (=s17c: s10m with session 17's merge through distributed shared memory, a row's splits as one cluster
    // (rs::kXCl, cuda_mla_wgmma_cl.cuh), at 2 to 16 splits where the device places all of the call's clusters at once;
    // s10m's choice elsewhere; measured 1.02x at H = 32, B = 64, 8K, 0.98-0.99x at the other shapes (the tile loop's
    // schedule moves with the tail), Kimi-Linear's B = 64, 8K TPOT -1.7 %: opt-in, "... round 12". Session 17's other
    // variant, the merge by the row's last-arriving block (and s10m's merge with its loads reordered elsewhere),
    // measured 0.98-0.99x the default: removed in session 19; s17c fell back to its choice until then.)
    const bool s17c = forced && !strcmp(f8, "s17c");
    const bool cl = s17c && p.hpb <= 32 && p.splits >= 2 && p.splits <= 16 && (long)p.hb * rows <= cl_max_clusters(p.splits);
    // s10m (the default since session 16, stlp's bits): q first, the merge in the kernel and its loads batched wherever
    // the merge fits (merge_in_kernel), V^T by cvt and exp2 ftz, PV in flight past the tile's top wait everywhere
    const bool s10m = dflt || (forced && (!strcmp(f8, "s10m") || s10p || s17c));
    const bool stlp = forced && !strcmp(f8, "stlp");
    const bool mrg = s10m && merge_in_kernel(p, rows);
    constexpr int k10 = rs::kXCvt | rs::kXFtz | rs::kXPv; // (with q first, the merge and kXMt where it merges)
    int x9 = !s10m ? 0 : mrg ? k10 | rs::kXQF | rs::kXMrg | rs::kXMt : k10;
    if (s10p) x9 |= rs::kXPw;
    if (cl) x9 = rs::kXQF | rs::kXCvt | rs::kXFtz | rs::kXPv | rs::kXCl;
    bool merged = false; // the launched kernel merged the splits itself (kXMrg where merge_in_kernel allows, kXCl)
    const bool st = p.hpb <= 32 && !(forced && !strcmp(f8, "rs"));
    const bool rs_wanted = forced ? !strcmp(f8, "rs") || stlp || s10m : (double)rows * max_n >= 65536.0;
    if (fp8 && sw && rs_wanted && !env_is("LUNAR_MLA_WGMMA_TMA", "0") && make_tmap_q8(&tm, c->latent)) {
        if (env_is("LUNAR_MLA_WGMMA_VERBOSE", "1")) {
            static unsigned char seen[2 + (rs::kXCl * 2 - 1) / rs::kXQF + 1];
            // (x9 always holds kXCvt, so x9 / kXQF tells the choices apart)
            const int v = st ? (x9 ? 2 + x9 / rs::kXQF : 1) : 0;
            if (!seen[v])
                fprintf(stderr, "mla wgmma decode: fp8 pages, fp8 scores, V^T from registers%s%s%s%s%s%s%s%s\n",
                        st ? ", S^T with heads as N, lazy rescale, wait at the tile's top" : "",
                        st && (x9 & rs::kXQF) ? ", q before the copies" : "", st && (x9 & rs::kXMrg) ? ", merge in the kernel" : "",
                        st && (x9 & rs::kXFtz) ? ", V^T by cvt, exp2 ftz" : "",
                        st && (x9 & rs::kXPv) ? ", PV in flight past the top wait" : "",
                        st && (x9 & rs::kXMt) ? ", merge loads batched" : "",
                        st && (x9 & rs::kXPw) ? ", dependent launch, set-up before its wait" : "",
                        st && (x9 & rs::kXCl) ? ", splits as a cluster, merge in shared memory" : ""),
                    seen[v] = 1;
        }
        // the lazy rescale's threshold: 8 (P <= 256) unless LUNAR_MLA_WGMMA_LAZY says otherwise (0: a maximum moves
        // whenever it grows, as in the exact kernel; the op test runs it to exercise the redo)
        const char *lz = getenv("LUNAR_MLA_WGMMA_LAZY");
        // (at most 15: P <= 2^15 stays inside f16's 65504)
        const float lazy = lz && *lz ? fminf(fmaxf((float)atof(lz), 0.0f), 15.0f) : 8.0f;
        // the bench's traced instances (LUNAR_MLA_WGMMA_TRACE=1 and a buffer set): the default's where it merges in the
        // kernel, s17c's where its clusters fit
        const bool trace = env_is("LUNAR_MLA_WGMMA_TRACE", "1") && trace_on;
        if (st && x9) { // round 10 on: PV in flight past the top wait
            constexpr int kQ = rs::kXQF, kC = rs::kXCvt | rs::kXFtz | rs::kXPv, kM = kQ | rs::kXMrg | kC | rs::kXMt;
            constexpr int kCl = kQ | kC | rs::kXCl, kPw = rs::kXPw;
            if (trace && x9 == kCl) launch_st<kCl | rs::kXTrace>(a, tm, p, s, lazy); // =s17c
            else if (x9 == kCl) launch_st<kCl>(a, tm, p, s, lazy);
            else if (x9 == (kM | kPw)) launch_st<kM | kPw>(a, tm, p, s, lazy); // =s10p
            else if (x9 == (kC | kPw)) launch_st<kC | kPw>(a, tm, p, s, lazy);
            else if (trace && x9 == kM) launch_st<kM | rs::kXTrace>(a, tm, p, s, lazy);
            else if (x9 == kM) launch_st<kM>(a, tm, p, s, lazy); // the default where the merge fits
            else launch_st<kC>(a, tm, p, s, lazy);               // the default elsewhere
            merged = (x9 & (rs::kXMrg | rs::kXCl)) != 0;
        } else if (st) {
            launch_st<0>(a, tm, p, s, lazy); // =stlp
        } else {
            launch_rs(a, tm, p, s);
        }
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
    // (the kXMrg and kXCl instances merged in their tails)
    if (p.splits > 1 && !merged) lunar_mla_merge_splits(o, a.o_part, a.lse_part, rows * H, p.splits, a.out_scale, s);
}
