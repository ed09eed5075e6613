// The causal flash part of the decompressed MLA prefill (cuda_mla_flash.cu) on Hopper's
// warpgroup MMA, FA3-style: the same math as cuda_mla_flash.cu's mma.sync kernel k_flash, over one
// key chunk whose per-head keys [k_nope | k_pe] (192) and values (128) the lift GEMM has written.
//
// A block: 128 query rows of one head = two consumer warpgroups of 64 rows (the M of wgmma), 256
// threads, one block per SM (214 KB of shared memory):
//  - Q [128 x 192] bf16 (from q's fp32) in shared memory once, in the 128-byte swizzled layout:
//    3 boxes of 64 dims (128 B a row) x 128 rows, chunk c of row r stored at chunk c ^ (r & 7);
//  - key tiles of 128 positions through 2 stages, each K = 3 boxes (k_nope 0-63, 64-127, k_pe)
//    and V = 2 boxes (dims 0-63, 64-127), 80 KB, written by 5 bulk tensor copies (TMA with the
//    128-byte swizzle, whole lines) issued by thread 0, completing on the stage's mbarrier; tile
//    kt + 1 is issued at the top of iteration kt, after the barrier that frees its stage;
//  - S = Q K^T: m64n128k16 x 12 k-steps, both operands K-major swizzled descriptors (stride 1024
//    per 8 rows, a k-step moves 32 B inside the line, every 4 k-steps the next box);
//  - online softmax in fp32 registers (log2 domain, scale folded in), causal mask only on tiles
//    the diagonal crosses, a warpgroup skips a tile none of its rows sees (the upper half of the
//    diagonal tile for the first warpgroup);
//  - O += P V: P stays in registers, the S accumulators of keys 16j .. 16j + 15 packed to bf16 are
//    exactly the register A fragment of k-step j (m64n128k16, A from registers), V an N-major
//    swizzled descriptor (leading offset = the next 64-dim box, stride 1024 = 8 keys).
// The online-softmax state crosses key chunks through o and ml as in k_flash (first / last).
// Roundings as k_flash: q, k, v, P bf16 operands, fp32 sums (measured: the same errors vs the naive
// op as k_flash, 2.3e-3 .. 4.4e-3). Measured (H200, bench_mla prefill): 547-629 TFLOP/s of attention
// flops from 8K tokens at 12 and 32 heads, 62-71 % of a cuBLAS bf16 GEMM timed in the same run, 4.2-4.6x
// k_flash. The two warpgroups meet at a barrier per tile and each runs S -> softmax -> PV in order,
// so the tensor cores idle while both do softmax: flash_pp_kernel below (a producer warpgroup,
// FA3's ping-pong and intra-warpgroup overlap) removes that and is the default (a third stage does
// not fit here: 48 + 3 x 80 KB).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <math.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_mla_flash_wg.h"
#include "backend/cuda/cuda_mbarrier.cuh"
#include "backend/cuda/cuda_wgmma.cuh"

namespace {

constexpr int kQK = 192, kV = 128, kHS = 256; // q / k width, v width, a head's lifted row (k_nope | v)
constexpr int BM = 128, BN = 128;             // query rows per block, keys per tile
constexpr int kThreads = 256;                 // two consumer warpgroups
constexpr int kBox = BN * 128;                // one box: 64 bf16 dims (128 B) x 128 rows = 16 KB (Q's too: BM == BN)
constexpr int kQOff = 0;                      // Q: 3 boxes
constexpr int kStageOff = 3 * kBox;
constexpr int kStage = 5 * kBox;              // K: 3 boxes, V: 2 boxes = 80 KB
constexpr int kStages = 2;
constexpr int kBarOff = kStageOff + kStages * kStage;
// + 1 KB: the base is rounded up to 1024 bytes (the swizzle repeats every 8 rows x 128 B and both
// the copy engine and wgmma swizzle by address bits)
constexpr size_t kSmem = (size_t)kBarOff + kStages * 8 + 1024;
static_assert(kSmem <= 232448, "227 KB of shared memory per block");
static_assert(BM == BN, "Q's boxes have the tiles' size");

struct FArgs {
    float *o, *ml;  // o [n, H, 128] fp32; ml [n, H, 2] (row max, row sum) between chunks
    const float *q; // [n, H, 192] fp32
    int k0, k1, pos0, n, H, first, last;
    float sl; // scale * log2 e
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
// wgmma shared memory descriptor with the 128-byte swizzle (layout type 1, bits 62-63): start
// address, leading and stride byte offsets in 16-byte units
__device__ __forceinline__ uint64_t desc_sw(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3ffff) >> 4) | ((uint64_t)((lbo >> 4) & 0x3fff) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3fff) << 32) | (1ull << 62);
}
// byte offset of 16-byte chunk j (dims 8j .. 8j + 7, j < 24) of row r in the swizzled boxes
__device__ __forceinline__ int sw_off(int r, int j) { return (j >> 3) * kBox + r * 128 + (((j & 7) ^ (r & 7)) << 4); }

// ---- pieces both kernels share (thread t of a quad, rows ra / rb: the accumulator layout) ----
// chunk j of Q row r (of the block's BM) as bf16 into the swizzled boxes; rows >= n zero (finite
// scores, never stored)
__device__ __forceinline__ void q_row_chunk(unsigned char *smem, const FArgs &a, int h, int i0, int r, int j) {
    uint4 v = make_uint4(0, 0, 0, 0);
    if (i0 + r < a.n) {
        const float4 *src = reinterpret_cast<const float4 *>(a.q + ((size_t)(i0 + r) * a.H + h) * kQK + j * 8);
        const float4 x0 = src[0], x1 = src[1];
        v = make_uint4(pack_bf16(x0.x, x0.y), pack_bf16(x0.z, x0.w), pack_bf16(x1.x, x1.y), pack_bf16(x1.z, x1.w));
    }
    *reinterpret_cast<uint4 *>(smem + kQOff + sw_off(r, j)) = v;
}
// the softmax state the previous key chunk left (l: one thread of the four holds the row's sum), or zero
__device__ __forceinline__ void load_state(const FArgs &a, int h, int ra, int rb, int t, float (&o)[64],
                                           float (&m)[2], float (&l)[2]) {
    if (a.first) {
#pragma unroll
        for (int i = 0; i < 64; i++) o[i] = 0.f;
        return;
    }
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int r = e ? rb : ra;
        if (r < a.n) {
            m[e] = a.ml[((size_t)r * a.H + h) * 2];
            l[e] = t == 0 ? a.ml[((size_t)r * a.H + h) * 2 + 1] : 0.f;
        }
#pragma unroll
        for (int k = 0; k < 16; k++) {
            float2 v = make_float2(0.f, 0.f);
            if (r < a.n) v = *reinterpret_cast<const float2 *>(a.o + ((size_t)r * a.H + h) * kV + 8 * k + 2 * t);
            o[4 * k + 2 * e] = v.x, o[4 * k + 2 * e + 1] = v.y;
        }
    }
}
// keys past a row's position masked (s[4k + 2e + c]: row ra / rb by e, key kb + 8k + 2t + c)
__device__ __forceinline__ void mask_causal(float (&s)[64], int kb, int pos0, int ra, int rb, int t) {
#pragma unroll
    for (int k = 0; k < 16; k++)
#pragma unroll
        for (int e = 0; e < 2; e++)
#pragma unroll
            for (int c = 0; c < 2; c++)
                if (kb + 8 * k + 2 * t + c > pos0 + (e ? rb : ra)) s[4 * k + 2 * e + c] = -INFINITY;
}
// online softmax in the log2 domain (sl = scale * log2 e) over a tile's 128 keys, which lie in the 4
// threads of a quad: s becomes P, m and l move on, alpha is O's rescale
__device__ __forceinline__ void softmax_tile(float (&s)[64], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             float sl) {
#pragma unroll
    for (int e = 0; e < 2; e++) {
        float mx = -INFINITY;
#pragma unroll
        for (int k = 0; k < 16; k++) mx = fmaxf(mx, fmaxf(s[4 * k + 2 * e], s[4 * k + 2 * e + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m[e], mx * sl);
        const float base = mn == -INFINITY ? 0.f : mn; // a row with nothing seen yet: no inf - inf
        alpha[e] = exp2f(m[e] - base);
        m[e] = mn;
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < 16; k++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const float p = exp2f(fmaf(s[4 * k + 2 * e + c], sl, -base));
                s[4 * k + 2 * e + c] = p;
                sum += p;
            }
        l[e] = l[e] * alpha[e] + sum;
    }
}
// P as the register A operand of the PV wgmma: keys 16j .. 16j + 15 are accumulators 8j .. 8j + 7
__device__ __forceinline__ void pack_p(uint32_t (&pa)[8][4], const float (&s)[64]) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        pa[j][0] = pack_bf16(s[8 * j], s[8 * j + 1]);
        pa[j][1] = pack_bf16(s[8 * j + 2], s[8 * j + 3]);
        pa[j][2] = pack_bf16(s[8 * j + 4], s[8 * j + 5]);
        pa[j][3] = pack_bf16(s[8 * j + 6], s[8 * j + 7]);
    }
}
// P's registers written before the wgmma fence (as the accumulators are)
__device__ __forceinline__ void fence_p(uint32_t (&pa)[8][4]) {
#pragma unroll
    for (int j = 0; j < 8; j++)
        asm volatile("" : "+r"(pa[j][0]), "+r"(pa[j][1]), "+r"(pa[j][2]), "+r"(pa[j][3])::"memory");
}
// O (normalised after the last key chunk) and otherwise the state the next chunk starts from
__device__ __forceinline__ void store_state(const FArgs &a, int h, int ra, int rb, int t, const float (&o)[64],
                                            const float (&m)[2], float (&l)[2]) {
#pragma unroll
    for (int e = 0; e < 2; e++) {
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 1);
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 2);
        const int r = e ? rb : ra;
        if (r >= a.n) continue;
        const float inv = a.last ? 1.0f / l[e] : 1.0f;
#pragma unroll
        for (int k = 0; k < 16; k++)
            *reinterpret_cast<float2 *>(a.o + ((size_t)r * a.H + h) * kV + 8 * k + 2 * t) =
                make_float2(o[4 * k + 2 * e] * inv, o[4 * k + 2 * e + 1] * inv);
        if (!a.last && t == 0) a.ml[((size_t)r * a.H + h) * 2] = m[e], a.ml[((size_t)r * a.H + h) * 2 + 1] = l[e];
    }
}

// grid (H, query tiles): the heads vary fastest, so the first wave holds every head's longest rows
// (the causal imbalance); KV row r / Kpe row r = position k0 + r (tkv: [rows][H * 256] bf16,
// tpe: [rows][64] bf16, boxes 64 x 128 with the 128-byte swizzle)
__global__ void __launch_bounds__(kThreads, 1)
    flash_wg_kernel(FArgs a, const __grid_constant__ CUtensorMap tkv, const __grid_constant__ CUtensorMap tpe) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    const uint32_t sb = smem_u32(smem), bars = sb + kBarOff;
    const int h = blockIdx.x, i0 = ((int)gridDim.y - 1 - (int)blockIdx.y) * BM;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int qlo = a.pos0 + i0;                     // the block's first query position
    const int kend = min(a.k1, qlo + BM);            // keys past the block's last position: none
    const int nkt = kend > a.k0 ? (kend - a.k0 + BN - 1) / BN : 0;
    const int rr = 64 * wg + 16 * warp + g;          // this thread's rows rr, rr + 8 of the block
    const int ra = i0 + rr, rb = ra + 8;              // ... as query rows
    const int wlast = qlo + 64 * wg + 63;            // the warpgroup's last query position

    if (tid == 0) {
        mbar_init(bars, 1), mbar_init(bars + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int kt) { // thread 0: tile kt (rows kt * BN ..) into stage kt & 1
        const uint32_t st = sb + kStageOff + (kt & 1) * kStage, bar = bars + (kt & 1) * 8;
        const int row = kt * BN, c = h * kHS;
        mbar_expect_tx(bar, kStage);
        tma_2d(st, &tkv, c, row, bar);
        tma_2d(st + kBox, &tkv, c + 64, row, bar);
        tma_2d(st + 2 * kBox, &tpe, 0, row, bar);
        tma_2d(st + 3 * kBox, &tkv, c + 128, row, bar);
        tma_2d(st + 4 * kBox, &tkv, c + 192, row, bar);
    };
    if (tid == 0 && nkt > 0) issue(0);

    // Q rows i0 .. i0 + 127 of head h
    for (int c = tid; c < BM * (kQK / 8); c += kThreads) {
        const int r = c / (kQK / 8), j = c - r * (kQK / 8);
        q_row_chunk(smem, a, h, i0, r, j);
    }
    fence_async_smem(); // published to wgmma by the loop's first barrier

    // o[4k + 2e + c]: row rr + 8e, column 8k + 2t + c (the wgmma accumulator layout)
    float o[64];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    load_state(a, h, ra, rb, t, o, m, l);
    // this warpgroup's 64 rows: 8-row groups 1024 B apart inside each box
    const uint64_t dq = desc_sw(sb + kQOff + wg * 64 * 128, 16, 1024);

    for (int kt = 0; kt < nkt; kt++) {
        __syncthreads(); // both warpgroups are done with tile kt - 1: its stage takes tile kt + 1
        if (tid == 0 && kt + 1 < nkt) issue(kt + 1);
        const int kb = a.k0 + kt * BN; // the tile's first key position
        if (kb > wlast) continue;      // warpgroup-uniform: none of these rows sees a key of the tile
        mbar_wait(bars + (kt & 1) * 8, (uint32_t)(kt >> 1) & 1);
        const uint32_t st = sb + kStageOff + (kt & 1) * kStage;

        float s[64]; // s[4k + 2e + c]: row rr + 8e, key kb + 8k + 2t + c
#pragma unroll
        for (int i = 0; i < 64; i++) s[i] = 0.f;
        fence_acc<64>(s);
        wgmma_fence();
        const uint64_t dk = desc_sw(st, 16, 1024);
#pragma unroll
        for (int ks = 0; ks < kQK / 16; ks++) {
            const uint64_t off = (uint64_t)(((ks >> 2) * kBox + (ks & 3) * 32) >> 4);
            wgmma_m64n128<0>(s, dq + off, dk + off, ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc<64>(s);

        if (kb + BN - 1 > qlo + 64 * wg) // the diagonal (or the pad past L) crosses this warpgroup's rows
            mask_causal(s, kb, a.pos0, ra, rb, t);
        float alpha[2];
        softmax_tile(s, m, l, alpha, a.sl);
#pragma unroll
        for (int k = 0; k < 16; k++)
            o[4 * k] *= alpha[0], o[4 * k + 1] *= alpha[0], o[4 * k + 2] *= alpha[1], o[4 * k + 3] *= alpha[1];
        uint32_t pa[8][4];
        pack_p(pa, s);
        fence_p(pa);
        fence_acc<64>(o);
        wgmma_fence();
        const uint64_t dv = desc_sw(st + 3 * kBox, kBox, 1024);
#pragma unroll
        for (int j = 0; j < BN / 16; j++) wgmma_m64n128_rs<1>(o, pa[j], dv + (uint64_t)((j * 2048) >> 4));
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc<64>(o);
    }

    store_state(a, h, ra, rb, t, o, m, l);
}

// ---- The producer / consumer variant (the default; LUNAR_MLA_FLASH=wgmma runs the kernel above) ----
// Measured (H200, session 6, bench_mla prefill): 1.13-1.16x flash_wg_kernel from 8K tokens (641-729
// TFLOP/s of attention flops, 71-83 % of a cuBLAS bf16 GEMM timed in the same run), equal at 1K
// (2 uneven waves either way); errors vs the naive op 2.3e-3 .. 4.4e-3, as flash_wg_kernel's.
// 384 threads: the two consumer warpgroups (240 registers each, setmaxnreg) and a producer warpgroup
// (24 registers) whose first lane issues the copies. K
// and V have rings of their own (2 x 48 KB, 2 x 32 KB: the same 208 KB) with full / empty mbarriers,
// so no barrier joins the warpgroups. Per tile kt a consumer warpgroup issues S_kt = Q K_kt^T and
// O += P_{kt-1} V_{kt-1} together (its P of the previous tile in registers), waits for S only, runs
// the softmax of S_kt while PV_{kt-1} is still on the tensor cores, then waits for PV, rescales O and
// packs P_kt (FA3's intra-warpgroup overlap). The two warpgroups take turns issuing their products
// (named barriers 3 and 4: FA3's ping-pong), so one's softmax overlaps the other's MMAs. K_kt's stage
// is free once both warpgroups' S_kt is done, V_kt's once their PV_kt is. The diagonal tile is not
// skipped by the first warpgroup here (its fully masked rows add zeros): every warpgroup runs nkt
// turns, which the turn barriers need.
constexpr int kThreadsPP = kThreads + 128;
constexpr int kKStage = 3 * kBox, kVStage = 2 * kBox;
constexpr int kKOff = kStageOff, kVOff = kKOff + 2 * kKStage, kBarPP = kVOff + 2 * kVStage;
constexpr size_t kSmemPP = (size_t)kBarPP + 8 * 8 + 1024; // fullK[2] fullV[2] emptyK[2] emptyV[2]
static_assert(kSmemPP <= 232448, "227 KB of shared memory per block");

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

__global__ void __launch_bounds__(kThreadsPP, 1)
    flash_pp_kernel(FArgs a, const __grid_constant__ CUtensorMap tkv, const __grid_constant__ CUtensorMap tpe) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    const uint32_t sb = smem_u32(smem), fK = sb + kBarPP, fV = fK + 16, eK = fK + 32, eV = fK + 48;
    const int h = blockIdx.x, i0 = ((int)gridDim.y - 1 - (int)blockIdx.y) * BM;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int qlo = a.pos0 + i0;
    const int kend = min(a.k1, qlo + BM);
    const int nkt = kend > a.k0 ? (kend - a.k0 + BN - 1) / BN : 0;

    if (tid == 0) {
        for (int i = 0; i < 4; i++) mbar_init(fK + 8 * i, 1); // fK, fV: the producer's arrive + bytes
        for (int i = 4; i < 8; i++) mbar_init(fK + 8 * i, 8);              // eK, eV: lane 0 of each consumer warp
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 2) { // the producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (tid == 256) {
            const int c = h * kHS;
            for (int kt = 0; kt < nkt; kt++) {
                const int s = kt & 1, row = kt * BN;
                const uint32_t k = sb + kKOff + s * kKStage, v = sb + kVOff + s * kVStage;
                if (kt >= 2) mbar_wait(eK + 8 * s, (uint32_t)((kt >> 1) - 1) & 1);
                mbar_expect_tx(fK + 8 * s, kKStage);
                tma_2d(k, &tkv, c, row, fK + 8 * s);
                tma_2d(k + kBox, &tkv, c + 64, row, fK + 8 * s);
                tma_2d(k + 2 * kBox, &tpe, 0, row, fK + 8 * s);
                if (kt >= 2) mbar_wait(eV + 8 * s, (uint32_t)((kt >> 1) - 1) & 1);
                mbar_expect_tx(fV + 8 * s, kVStage);
                tma_2d(v, &tkv, c + 128, row, fV + 8 * s);
                tma_2d(v + kBox, &tkv, c + 192, row, fV + 8 * s);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int rr = 64 * wg + 16 * warp + g, ra = i0 + rr, rb = ra + 8;

    // this warpgroup's 64 rows of Q (only it reads them)
    for (int c = tid & 127; c < 64 * (kQK / 8); c += 128)
        q_row_chunk(smem, a, h, i0, 64 * wg + c / (kQK / 8), c % (kQK / 8));
    fence_async_smem();
    bar_sync(1 + wg, 128);

    float o[64];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    load_state(a, h, ra, rb, t, o, m, l);
    const uint64_t dq = desc_sw(sb + kQOff + wg * 64 * 128, 16, 1024);
    if (wg == 1) bar_arrive(3, 256); // the first warpgroup takes the first turn
    uint32_t pa[8][4];               // P of the previous tile, the A operand of its PV
#pragma unroll
    for (int j = 0; j < 8; j++) pa[j][0] = pa[j][1] = pa[j][2] = pa[j][3] = 0u;

    for (int kt = 0; kt < nkt; kt++) {
        const int s = kt & 1, ps = s ^ 1;
        mbar_wait(fK + 8 * s, (uint32_t)(kt >> 1) & 1);
        if (kt > 0) mbar_wait(fV + 8 * ps, (uint32_t)((kt - 1) >> 1) & 1);
        float sc[64]; // sc[4k + 2e + c]: row rr + 8e, key kb + 8k + 2t + c
#pragma unroll
        for (int i = 0; i < 64; i++) sc[i] = 0.f;
        fence_acc<64>(sc);
        fence_p(pa);
        fence_acc<64>(o);
        bar_sync(3 + wg, 256); // this warpgroup's turn to issue
        wgmma_fence();
        const uint64_t dk = desc_sw(sb + kKOff + s * kKStage, 16, 1024);
#pragma unroll
        for (int ks = 0; ks < kQK / 16; ks++) {
            const uint64_t off = (uint64_t)(((ks >> 2) * kBox + (ks & 3) * 32) >> 4);
            wgmma_m64n128<0>(sc, dq + off, dk + off, ks > 0);
        }
        wgmma_commit();
        // PV_{kt-1}; at kt = 0 P is zero and the product runs over K_kt's k_nope boxes (landed, finite:
        // adds exact zeros), so every turn issues the same two groups (no divergent wgmma)
        const uint64_t dv = desc_sw(kt > 0 ? sb + kVOff + ps * kVStage : sb + kKOff + s * kKStage, kBox, 1024);
#pragma unroll
        for (int j = 0; j < BN / 16; j++) wgmma_m64n128_rs<1>(o, pa[j], dv + (uint64_t)((j * 2048) >> 4));
        wgmma_commit();
        bar_arrive(3 + (wg ^ 1), 256); // the other warpgroup's turn
        wgmma_wait<1>();
        fence_acc<64>(sc);
        if (lane == 0) mbar_arrive(eK + 8 * s); // this warp is done with K_kt

        const int kb = a.k0 + kt * BN;
        if (kb + BN - 1 > qlo + 64 * wg) mask_causal(sc, kb, a.pos0, ra, rb, t);
        float alpha[2];
        softmax_tile(sc, m, l, alpha, a.sl);
        wgmma_wait<0>(); // PV_{kt-1}: O and P's registers are free
        fence_acc<64>(o);
        if (kt > 0 && lane == 0) mbar_arrive(eV + 8 * ps);
#pragma unroll
        for (int k = 0; k < 16; k++)
            o[4 * k] *= alpha[0], o[4 * k + 1] *= alpha[0], o[4 * k + 2] *= alpha[1], o[4 * k + 3] *= alpha[1];
        pack_p(pa, sc);
    }
    if (nkt > 0) { // the last tile's PV
        const int ps = (nkt - 1) & 1;
        mbar_wait(fV + 8 * ps, (uint32_t)((nkt - 1) >> 1) & 1);
        fence_p(pa);
        fence_acc<64>(o);
        wgmma_fence();
        const uint64_t dv = desc_sw(sb + kVOff + ps * kVStage, kBox, 1024);
#pragma unroll
        for (int j = 0; j < BN / 16; j++) wgmma_m64n128_rs<1>(o, pa[j], dv + (uint64_t)((j * 2048) >> 4));
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc<64>(o);
    }
    if (wg == 0) bar_sync(3, 256); // the second warpgroup's last turn hand-over (the barriers end balanced)

    store_state(a, h, ra, rb, t, o, m, l);
}

// a [rows][cols] bf16 matrix (row stride ld elements) in boxes of 64 x 128 with the 128-byte swizzle
bool make_map(CUtensorMap *m, const void *p, int cols, int rows, size_t ld) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = lunar_tmap_encoder();
    if (!fn) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)ld * 2};
    const cuuint32_t box[2] = {64, BN}, es[2] = {1, 1};
    return fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(p), dims, strides, box, es,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

} // namespace

int lunar_mla_flash_wg_tile(void) { return BN; }

bool lunar_mla_flash_wg(float *o, float *ml, const float *q, const uint16_t *KV, const uint16_t *Kpe, int rows, int k0,
                        int k1, int pos0, int n, int H, float sl, int first, int last, int pp, cudaStream_t s) {
    CUtensorMap tkv, tpe;
    memset(&tkv, 0, sizeof tkv), memset(&tpe, 0, sizeof tpe);
    if (!make_map(&tkv, KV, H * kHS, rows, (size_t)H * kHS) || !make_map(&tpe, Kpe, 64, rows, 64)) return false;
    // per call, not once: the attribute is per device and TP ranks share this code on several
    FArgs a;
    a.o = o, a.ml = ml, a.q = q, a.k0 = k0, a.k1 = k1, a.pos0 = pos0, a.n = n, a.H = H, a.first = first;
    a.last = last, a.sl = sl;
    const dim3 grid((unsigned)H, (unsigned)((n + BM - 1) / BM));
    if (pp) {
        CUDA_CHECK(cudaFuncSetAttribute(flash_pp_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmemPP));
        flash_pp_kernel<<<grid, kThreadsPP, kSmemPP, s>>>(a, tkv, tpe);
    } else {
        CUDA_CHECK(cudaFuncSetAttribute(flash_wg_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem));
        flash_wg_kernel<<<grid, kThreads, kSmem, s>>>(a, tkv, tpe);
    }
    CUDA_CHECK_LAUNCH();
    return true;
}
