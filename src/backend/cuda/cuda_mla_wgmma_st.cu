// MLA absorbed decode, FP8 pages: the st kernel (round 6 on; the FP8 default from 64K rows x context at blocks of
// <= 32 heads): FP8 scores as S^T with heads as N, V^T from the e4m3 tile in registers, and its rounds' switches.
#include <type_traits>

#include "backend/cuda/cuda_mla_wgmma_cl.cuh"
#include "backend/cuda/cuda_mla_wgmma_rs.cuh"

namespace mla_wg {
namespace {

// Round 9's merge in the kernel (rs::kXMrg): a ticket counter per (row, head block), zero between launches (the
// last block of a launch to leave rearms its counter); the launcher keeps rows x head blocks within kTickets
__device__ unsigned g_mla_tickets[kTickets];

// FP8 pages, round 6 (from 64K rows x context at blocks of <= 32 heads, in its round-7 form and with the later
// rounds' switches below; larger blocks run the round-4 kernel). Rounds 4-5 compute S with heads as M, padded to 64
// (A = the two e4m3 Q terms, 64 rows; B = 32 positions of the tile per warpgroup): at <= 32 heads half of S's
// rows are zeros, and the operands read from shared memory are 216 KB a tile (each warpgroup reads all of both Q
// terms, 2 x 36 KB, for its 32 positions), ~0.85 us of round 5's 2.39 us a tile at 128 B a clock (docs/benchmarks.md, "MLA decode, FP8
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
//    4 stages (Q's 40 KB left room for a fourth) measured 0.97-1.00x rs::kStages = 3: the copies are not what
//    the tile waits for. (Round 6 as it was, 4 stages, and round 7's halves were opt-in until session 19, which
//    removed their instances (`git show 1ff0730`); session 20 folded the stages, Lazy and Pipe into the kernel.)
namespace st {
// S^T of the tile in stage `raw` for one warpgroup: 18 m64n32k32 steps (k-step ks < 16 in box ks / 4 at
// 32 (ks & 3) bytes, the rope in box 4: the same offset in the tile and in Q), issued and committed, not
// waited; not zeroed (the first step's scale-d 0 ignores the old values; zeros written by C++ became copies of one
// zero register, an accumulator, which ptxas counts as reads of in-flight accumulators: C7514, every wgmma serialised)
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
template <class B, bool Mt = false>
__device__ __forceinline__ void merge_tail(const Args &a, const B &b, float *scratch) {
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

// Round 7 (session 11's Lazy and Pipe, in every instance; the instance without switches, =stlp, is the op test's
// reference for the later rounds' bits):
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
// The switches X (rs::kX*, cuda_mla_wgmma.cuh):
// Round 8 (session 12) measured three switches, each alone 0.96-1.05x round 7 and the three together 1.02-1.03x from
// 512K rows x context with Kimi-Linear's TPOT unmoved (docs/benchmarks.md, "MLA decode, FP8 pages, round 8"); kXCvt
// stays: the V^T fragments by cvt.rn.f16x2.e4m3x2 (the other two, q's rows loaded at once and a dependent launch,
// were superseded by kXQF and kXPw and removed in session 19: `git show 1ff0730`).
// (kXTrace: the bench's phase stamps, trace_stamp; LUNAR_MLA_WGMMA_TRACE=1, never a default)
// Round 9 (session 13; round 8 traced the fixed cost of a small launch: ~9 us of set-up, ~14 us outside the blocks,
// 1.40-1.45 us a tile). Measured (docs/benchmarks.md, "MLA decode, FP8 pages, round 9"): q first 1.10x round 7 at
// H = 32, B = 8, 8K (set-up 8.8 -> 4.1 us) but 0.98x at B = 64, 32K; the merge in the kernel 0.98-0.99x alone (the
// tail's 4-7 us: the partial O's drain, the wait, two L2 round trips); cvt + ftz 1.02-1.03x from 256K rows x context;
// the three 1.12x / 1.06x at B = 8, 8K / 32K. Round 9's default (sessions 13-15): the three below 512K rows x context
// where the merge goes into the kernel, cvt + ftz elsewhere:
// kXQF q's rows loaded into registers before the mbarriers' init and the first tiles' copies (so their requests
// are not queued behind 3 x 40 KB of copies a block), the tensor map prefetched at the top; kXMrg the split-K merge
// in the kernel's tail (the blocks of a row meet at a ticket counter, each merges some of its row's heads: no
// second launch); kXFtz the tile's exp2 as ex2.approx.ftz (the non-ftz form wraps each in a range check; only
// results below 2^-126 differ, which f16 P rounds to 0 anyway and a sum >= 1 absorbs), with kXCvt.
// Round 10 (session 15): kXPv PV(it - 1) left in flight past the tile's top wait.
// Round 7's ncu (B = 64, 32K) found the loop bound by its instruction stream's dependencies (2 warps a scheduler,
// tensor pipe 39 % active), and its one wait a tile retires S(it) and PV(it - 1) together, so PV, issued last, was
// never overlapped with anything. Here the tiles run in pairs (the st kernel's `tile` lambda, Ph 1 / 2): in the
// second, the top wait (wait_group 1) retires S(it) only (S(it) was committed before PV(it - 1)), PV(it - 1) runs on
// under S(it + 1)'s issue, the scores and P, and a second wait_group 1 before the V loads and fragments (PV's
// register operand) retires it, leaving S(it + 1) running; the pair ends with wait_group 0 (ptxas follows the groups
// only through straight-line code: see `tile`). The same products in the same order: the bits of the instance
// without it. Measured (docs/benchmarks.md, "MLA decode, FP8 pages, round 10"): 1.33-1.41 us a tile against
// 1.46-1.48 from 32 tiles a block; 1.03-1.09x round 9's default from 256K rows x context (H = 32, B = 64, 32K:
// 359 us, 78 % of 4.3 TB/s), level at B = 8, 8K. 252-255 registers (PV(it - 1)'s 64 fragment registers stay held
// under the next tile's softmax).
// kXMt (with kXMrg; =s10m, the default since session 16): merge_tail's partial O loads batched (merge_cols);
// measured: the tail 8.1 -> 5.7 us at 2 splits (1.03x the instance without it at B = 64, 8K), unchanged at 16 (one
// column a thread: its 16 loads were in flight already); 255 registers, 4 bytes spilled.
// Round 11 (session 16; LUNAR_MLA_WGMMA_FP8=s10p: s10m's instances plus kXPw; opt-in): in the
// decode step every kernel around this one is a dependent launch (launch_pdl) and this one was not, so its launch
// and set-up (the mbarriers, the block table, the first tiles' copies: ~4 us of round 10's trace) started only once
// the absorption had finished. kXPw launches it by launch_pdl and runs all of that before griddepcontrol.wait (only
// q, the absorption's output, after it; Block's constructor says why that is safe). Nothing moves in the bench's
// isolated calls; the step is the measure.
// (lazy: the lazy rescale's threshold, a parameter of its own: a field of Args changes the other kernels' PTX)
// (X: the switches rs::kX*; 0 = round 7)
template <int X>
__global__ void __launch_bounds__(kThreads, 1) wgmma_decode_st_kernel(Args a, const __grid_constant__ CUtensorMap tm, float lazy) {
    using namespace q8;
    constexpr int N = 32, kS = rs::kStages;
    constexpr bool Cvt = (X & rs::kXCvt) != 0, Trace = (X & rs::kXTrace) != 0, Ftz = (X & rs::kXFtz) != 0;
    constexpr bool Pv = (X & rs::kXPv) != 0; // round 10: PV(it - 1) in flight past the top wait
    static_assert(!Pv || Cvt, "round 10's pad tile relies on mask_v");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    if constexpr (Trace) trace_stamp(0);
    const rs::Block<2, true, X> b(a, tm, smem_raw);
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

    // One tile: Ph = 0 every tile of the instances without Pv (the loop's body as it was); round 10 (Pv) runs
    // the tiles in pairs, Ph = 1 the first (everything retired at its start) and Ph = 2 the second, whose PV(it - 1)
    // stays in flight from its top wait to the wait before its V^T fragments; the pair ends with wait_group 0.
    // ptxas follows the wgmma groups only through straight-line code: PV(it - 1) pending across the loop's back
    // edge, or a branch around the second tile, drew C7514 (every wgmma serialised). So an odd tile count runs a pad
    // tile it = ntiles: every position past the end (scores -inf, P 0, its V bytes zeroed by mask_v), which adds
    // exact zeros to O and l and moves no maximum.
    auto tile = [&](int it, auto ph) {
        constexpr int Ph = decltype(ph)::value;
            const uint32_t raw = b.sb + L::raw_off + (it % kS) * kStage;
            // (round 7's Pipe) the tile's one wait is here (S(it) and PV(it - 1) done), not after the softmax: S(it + 1)
            // then runs on under the softmax, the V^T fragments, the block barrier, the rescale and the PV issue
            if constexpr (Ph == 2) {
                wgmma_wait<1>(); // S(it) done; PV(it - 1) runs on (O and the fragments untouched until the second wait)
            } else if constexpr (Ph == 0) {
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
            bool moved = false; // some maximum of this thread passed its head's m + lazy
            float ps[2][2];     // the tile's sums per head, added to l after the block barrier
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

            if constexpr (Ph != 0) {
                if constexpr (Ph == 2) {
                    wgmma_wait<1>(); // PV(it - 1) done (S(it + 1) runs on): the fragments and O are free
                    b.load_v(vx, raw);
                }
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
                // rare (the first tile; then a score past its head's m + lazy): the maxima over the
                // warpgroup's 64 positions exchanged as in round 6; heads whose maximum passed
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
#pragma unroll
                for (int i = 0; i < N / 8; i++) {
                    const float2 fa = *reinterpret_cast<const float2 *>(alpha + 8 * i + 2 * t);
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        o[j][4 * i] *= fa.x, o[j][4 * i + 1] *= fa.y, o[j][4 * i + 2] *= fa.x, o[j][4 * i + 3] *= fa.y;
                }
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int c = 0; c < 2; c++) l[i][c] += ps[i][c];
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
    __syncthreads(); // nobody reads red any more (nor alpha: kXCl's own log2-sum-exps go there)
    constexpr bool Cl = (X & rs::kXCl) != 0; // (cuda_mla_wgmma_cl.cuh)
    static_assert((X & rs::kXMrg ? 1 : 0) + Cl <= 1, "one merge in the tail");
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
                if (!direct && h < b.nh) {
                    const float lse = ls > 0.0f ? m[i][c] + log2f(ls) : -INFINITY;
                    if constexpr (Cl) b.alpha[h] = lse;
                    else a.lse_part[(size_t)b.split * a.rows * a.H + (size_t)b.row * a.H + b.h0 + h] = lse;
                }
            }
    }
    __syncthreads();
    if constexpr (Trace) trace_stamp(4);
    if constexpr (Cl) {
        if (direct) {
            rs::store_ot<N>(a, b, o);
        } else {
            // the partial in stage memory (free now: 64 KB of the three 40 KB stages), the weights' scratch after it
            float *part = reinterpret_cast<float *>(b.smem + L::raw_off), *scratch = part + 32 * kR;
            const uint32_t part_sb = b.sb + L::raw_off, lse_sb = smem_u32(b.alpha);
            if constexpr (Trace) trace_stamp(9);
            switch (a.splits) { // (the cluster's size: 2 .. 16)
#define CL_MERGE(n) \
    case n: cl::merge<N, n>(a, b, o, part, part_sb, lse_sb, scratch); break
                CL_MERGE(2); CL_MERGE(3); CL_MERGE(4); CL_MERGE(5); CL_MERGE(6); CL_MERGE(7); CL_MERGE(8); CL_MERGE(9);
                CL_MERGE(10); CL_MERGE(11); CL_MERGE(12); CL_MERGE(13); CL_MERGE(14); CL_MERGE(15);
                default: cl::merge<N, 16>(a, b, o, part, part_sb, lse_sb, scratch);
#undef CL_MERGE
            }
        }
    } else {
        rs::store_ot<N>(a, b, o);
    }
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

} // namespace

// Round 6: blocks of <= 32 heads only (the warpgroups take 16 heads each); X: the switches rs::kX*
template <int X>
void launch_st(const Args &a, const CUtensorMap &tm, const Plan &p, cudaStream_t s, float lazy) {
    using L = rs::Lay<2, 5>;
    static bool attr = false;
    if (!attr) {
        CUDA_CHECK(cudaFuncSetAttribute(wgmma_decode_st_kernel<X>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L::smem));
        attr = true;
    }
    if constexpr ((X & rs::kXCl) != 0) {
        // session 17: a row's splits as one cluster (1 x splits x 1), the merge through distributed shared memory;
        // the dispatcher checked that clusters of 16 (non-portable) can be placed
        if (p.splits > 8) {
            static bool np = false;
            if (!np) {
                CUDA_CHECK(cudaFuncSetAttribute(wgmma_decode_st_kernel<X>,
                                                cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
                np = true;
            }
        }
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(p.hb, p.splits, a.rows);
        cfg.blockDim = dim3(kThreads);
        cfg.dynamicSmemBytes = L::smem;
        cfg.stream = s;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = 1, at[0].val.clusterDim.y = (unsigned)p.splits, at[0].val.clusterDim.z = 1;
        cfg.attrs = at, cfg.numAttrs = 1;
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, wgmma_decode_st_kernel<X>, a, tm, lazy));
    } else if constexpr ((X & rs::kXPw) != 0) {
        // round 11: a dependent launch, without the cooperative attribute where the merge is in the tail (kXMrg):
        // its blocks still all reside at once (merge_in_kernel: one wave of one block per SM; the predecessor's
        // blocks leave without waiting for this kernel, and the successor is placed only once every block of this
        // one has passed its wait)
        launch_pdl(wgmma_decode_st_kernel<X>, dim3(p.hb, p.splits, a.rows), dim3(kThreads), L::smem, s, a, tm, lazy);
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
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, wgmma_decode_st_kernel<X>, a, tm, lazy));
    } else {
        wgmma_decode_st_kernel<X><<<dim3(p.hb, p.splits, a.rows), kThreads, L::smem, s>>>(a, tm, lazy);
    }
    CUDA_CHECK_LAUNCH();
}

// The instances cuda_mla_wgmma.cu's dispatcher launches (its kQ / kC / kM / kCl / kPw spelled out): round 7 (=stlp,
// the op test's reference), the default's two (s10m) and its traced one, s10p's two, s17c's and its traced one
#define ST_INSTANCE(X) template void launch_st<X>(const Args &, const CUtensorMap &, const Plan &, cudaStream_t, float)
ST_INSTANCE(0);
ST_INSTANCE(rs::kXCvt | rs::kXFtz | rs::kXPv);
ST_INSTANCE(rs::kXQF | rs::kXMrg | rs::kXCvt | rs::kXFtz | rs::kXPv | rs::kXMt);
ST_INSTANCE(rs::kXQF | rs::kXMrg | rs::kXCvt | rs::kXFtz | rs::kXPv | rs::kXMt | rs::kXTrace);
ST_INSTANCE(rs::kXCvt | rs::kXFtz | rs::kXPv | rs::kXPw);
ST_INSTANCE(rs::kXQF | rs::kXMrg | rs::kXCvt | rs::kXFtz | rs::kXPv | rs::kXMt | rs::kXPw);
ST_INSTANCE(rs::kXQF | rs::kXCvt | rs::kXFtz | rs::kXPv | rs::kXCl);
ST_INSTANCE(rs::kXQF | rs::kXCvt | rs::kXFtz | rs::kXPv | rs::kXCl | rs::kXTrace);
#undef ST_INSTANCE

bool trace_on;

int cl_max_clusters(int splits) {
    // how many clusters of `splits` blocks of the kXCl instance the device places at once (0: none, or the query
    // failed); asked once per size
    constexpr int X = rs::kXQF | rs::kXCvt | rs::kXFtz | rs::kXPv | rs::kXCl;
    using L = rs::Lay<2, 5>;
    static int known[17];
    if (splits < 2 || splits > 16) return 0;
    if (known[splits]) return known[splits] - 1;
    auto k = wgmma_decode_st_kernel<X>;
    int n = 0;
    if (cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L::smem) == cudaSuccess &&
        (splits <= 8 || cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess)) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(1, (unsigned)splits, 132);
        cfg.blockDim = dim3(kThreads);
        cfg.dynamicSmemBytes = L::smem;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = 1, at[0].val.clusterDim.y = (unsigned)splits, at[0].val.clusterDim.z = 1;
        cfg.attrs = at, cfg.numAttrs = 1;
        if (cudaOccupancyMaxActiveClusters(&n, k, &cfg) != cudaSuccess) n = 0;
    }
    (void)cudaGetLastError(); // (a refused query leaves no error behind)
    known[splits] = n + 1;
    return n;
}

// the bench's trace buffer (tools/device/bench_mla.c declares it: fp8trace), into this file's g_trace: the one the
// traced st instances read
extern "C" void lunar_cuda_mla_wgmma_trace(void *buf, int max_blocks);
extern "C" void lunar_cuda_mla_wgmma_trace(void *buf, int max_blocks) {
    unsigned long long *p = (unsigned long long *)buf;
    CUDA_CHECK(cudaMemcpyToSymbol(g_trace, &p, sizeof p));
    CUDA_CHECK(cudaMemcpyToSymbol(g_trace_blocks, &max_blocks, sizeof max_blocks));
    trace_on = buf != NULL;
}

} // namespace mla_wg
