// The MoE prefill grouped GEMM, warp-specialised (path 6, sm_90a): the wgmma kernel of
// cuda_moe_wg.cu (path 4) with its copies moved out of the tensor-core warps.
//
// Why: path 4 has every thread copy (and, for MXFP4, widen) its share of the next chunks and meet
// the others at one barrier per 64-column chunk, so each warpgroup's wgmma stream stops at every
// chunk for the slowest copier; round 1 and 2 of issue 8 measured 24-38 % of the dense peak with it,
// insensitive to the copy depth and to the tile shape (docs/benchmarks.md, "MoE prefill, round 2").
// Here one producer warpgroup fills a ring of stages and two consumer warpgroups only wait on
// mbarriers and issue wgmma, so a stage's copy latency is hidden behind the whole ring, not behind
// one chunk, and no consumer ever waits for another's copies.
//
// Work: items = (128-row M tile of one expert, from the permutation's tile list) x (256 weight rows:
// GATEUP 128 rows of w1 + the same 128 of w3, SiTU/SwiGLU in the epilogue; DOWN 256 rows of w2, the
// router weight in the epilogue), walked by a persistent grid of one 384-thread block per SM (block
// b takes items b, b + grid, ...; path 29, BF16's default, takes them from a counter: DYN below); K in
// 64-column chunks (one 128-byte swizzle atom per row).
//
// Warpgroup 0, the producer (setmaxnreg down to 72 registers, the consumers up to 216: 128 x 72 +
// 256 x 216 = the 384 x 168 the block starts with; ptxas still compiles every role within the 168 of
// __launch_bounds__, so this only hands the producer's unused registers over; a 512-thread variant
// with two producer warpgroups cannot be built: m64n256k16 needs >= 154 registers and ptxas caps
// the whole kernel at 128), walks the block's chunks in order; chunk q goes to stage q % ST (A
// 128 x 64 bf16 + B 256 x 64 bf16, both in the 128-byte-swizzled K-major layout wgmma reads). It
// waits for the stage's `empty` barrier (the consumers' release of chunk q - ST), then
//  - BF16 weights: thread 0 arms `full` with the 32 KB of B and issues two bulk tensor copies (TMA,
//    128 weight rows x 64 columns each, the tensor map's 128-byte swizzle); every producer thread
//    copies its 8 16-byte pieces of A with cp.async (gathered through row_token for GATEUP; rows
//    past the expert's end zero-filled, never read) and adds an arrive-on-completion
//    (cp.async.mbarrier.arrive.noinc) to `full`: 128 + 1 arrivals and 32 KB of transactions;
//  - MXFP4 weights: the A pieces and the chunk's raw nibbles + E8M0 scale words (cp.async into a
//    3-deep raw ring), then, P = 2 chunks later (cp.async.wait_group P: this thread's copies of
//    that chunk have landed), the thread widens its raw blocks to bf16 into the stage's B (exactly
//    as paths 2 and 4, pairs_mx), fences the async proxy and arrives: 128 arrivals.
// Consumer warpgroup w (1, 2) multiplies rows 64 (w - 1) .. + 63 of the M tile by the whole B tile:
// waits `full` (parity of the stage's use), 4 x wgmma m64n256k16 (128 fp32 accumulators a thread),
// commits, waits for the previous chunk's group (wait_group 1) and releases the previous chunk's
// stage (one arrival per consumer warp: `empty` counts 8). A warpgroup whose 64 rows all lie past
// the expert's end issues no wgmma but still waits and releases, so every barrier phase counts the
// same arrivals. The epilogue writes from the accumulators (as path 4) while the producer already
// fills the ring with the next item's chunks.
//
// Barrier phases: a stage's n-th use (chunk q = n ST + s) completes `full` phase n (waited with
// parity n & 1) and then `empty` phase n (the producer waits parity (n - 1) & 1 before use n). No
// arrival can land in a wrong phase: the producer arrives on `full` for use n only after `empty`
// phase n - 1 completed, and a consumer releases use n only after waiting `full` phase n.
//
// The cp.async data of A reaches the wgmma (async proxy) through the mbarrier: BF16's consumers
// fence the async proxy after their wait (the writes are another thread's, published by the
// barrier's completion); MXFP4's producer threads fence before their own arrive.
//
// Measured (H200, 8192 tokens, docs/benchmarks.md "MoE prefill, warp-specialised"): Kimi-Linear's
// BF16 shape 2.72-2.84 ms (path 4: 2.95-2.98), 38 % of the measured dense peak, so BF16 prefill runs
// here by default; K3.1's MXFP4 shapes 20 % slower than path 4 (one warpgroup widening alone: the
// copies-only probe takes 46 of the 51 ms), so MXFP4 stayed on path 4 (until path 13 moved the
// widening into the consumers, session 7, and path 14 below widened each chunk once for two M tiles).
// The probes show the BF16 time is not the copies: with no copies at all (probe "mma") the kernel takes as long (2.88 ms), so the
// consumer side (short M tiles, the epilogue outside the MMA stream, per-chunk waits) is the limit.
// (The probes were switches of this kernel that skipped the copies or the products, outputs garbage;
// removed after the measurement so that no setting can make the default kernel compute wrong
// results: they are in commit 098edea of branch s5-moepre.)
// Round 4 (docs/benchmarks.md "MoE prefill, round 4"): the consumer side's cost was the gate/up
// epilogue's IEEE exp / tanh / division (the bench ran Kimi-Linear's shape with K3's SiTU, ~100
// instructions a column, while no wgmma is in flight): with the SFU's approximations (path 12,
// BF16's default now) 2.74 -> 2.16 ms with SiTU, 2.14 -> 2.05 ms (51 % of the measured peak) with
// Kimi-Linear's own SwiGLU. Moving the per-chunk proxy fence out of the consumers (paths 10 / 11)
// gained nothing. Both GEMMs now run at ~91 % of the L2's throughput (Nsight Compute): the next
// limit is the bytes moved through L2 (weights re-read per M tile, the fp32 down output).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "backend/cuda/cuda_moe.cuh"
#include "backend/cuda/cuda_moe_widen.cuh"
#include "backend/cuda/cuda_mbarrier.cuh"
#include "backend/cuda/cuda_wgmma.cuh"
#include "backend/cuda/cuda_wgmma_rs.cuh"

#define WS_BM 128
#define WS_BN 256
#define WS_BK 64
#define WS_T 384
#define WS_ST 4  // ring stages: 4 x (16 + 32) KB = 192 KB
#define WS_P 2   // MXFP4: the producer widens chunk q - P after issuing chunk q's copies
#define WS_RS 3  // MXFP4 raw ring (> WS_P: slot q % RS was last read when widening chunk q - RS)

struct ws_cfg {
    static constexpr uint32_t A_BYTES = WS_BM * 128, B_BYTES = WS_BN * 128;
    static constexpr int UNITS = WS_BN * 2;  // MXFP4: 32-column blocks per chunk (a row: 2)
    static constexpr uint32_t RAW_BYTES = UNITS * 16, SCW_BYTES = UNITS * 4;
    static constexpr size_t smem(bool mx) {
        return 1024 + (size_t)WS_ST * (A_BYTES + B_BYTES) + (mx ? (size_t)WS_RS * (RAW_BYTES + SCW_BYTES) : 0) +
               2 * WS_ST * 8;
    }
};

// an arrival when all of this thread's earlier cp.async have landed (counted in the init count)
__device__ __forceinline__ void ws_arrive_cp(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// the same copy into the same offset of both blocks of a 2-block cluster, completing on each
// block's mbarrier at the same offset
__device__ __forceinline__ void ws_tma_mc(uint32_t dst, const CUtensorMap *tm, int col, int row, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(tm)), "r"(col), "r"(row), "r"(bar), "h"((uint16_t)3)
        : "memory");
}
// an arrival on the mbarrier at the same offset in the other block of the cluster. CTA: release at
// CTA scope (path 18) instead of cluster scope (paths 7, 17). Nsight Compute on path 17's gate/up
// kernel (docs/benchmarks.md "MoE prefill, weight tiles multicast in clusters"): 5.2 of its 16.3
// cycles between a warp's issues stalled on a memory barrier (`membar`, absent from path 12), the
// cluster-scope release of this arrival, made by every consumer warp once per chunk. What the arrival
// publishes is only that this warp's wgmma (complete: wgmma.wait_group) no longer read the stage;
// the refilling TMA is ordered after it by the barrier itself, as in the usual pipelines' remote
// consumer release, which arrive with the default (CTA-scope) semantics.
template <bool CTA = false>
__device__ __forceinline__ void ws_arrive_peer(uint32_t bar, uint32_t peer) {
    if (CTA)
        asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                     "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
                     "r"(peer)
                     : "memory");
    else
        asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                     "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
                     "r"(peer)
                     : "memory");
}
// K-major, 128-byte swizzle, 8-row groups 1024 bytes apart (as cuda_moe_wg.cu's wg_desc)
__device__ __forceinline__ uint64_t ws_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

// The ring's barriers, by thread 0 before the block's (or cluster's) first barrier: stage s's `full`
// (the producers' arrivals) and `empty` (the consumer warps' releases), then published
__device__ __forceinline__ void ws_ring_init(uint32_t full, uint32_t empty, int stages, uint32_t n_full,
                                             uint32_t n_empty) {
    for (int s = 0; s < stages; s++) {
        mbar_init(full + 8 * s, n_full);
        mbar_init(empty + 8 * s, n_empty);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    fence_async_smem();
}

// Items as (pair of 128-row M tiles of one expert) x N tile (paths 7 and 14): pfx[e + 1] holds
// expert e's pair count; the first warp (lane = threadIdx.x < 32) turns it into the exclusive scan
// pfx[e] = pairs before expert e, pfx[E] = all: lane l sums a run of experts, then a warp scan of the runs
__device__ __forceinline__ void pairs_scan_warp(int *pfx, int E, int lane) {
    const int per = (E + 31) / 32, e0 = lane * per, e1 = min(E, e0 + per);
    int sum = 0;
    for (int e = e0; e < e1; e++) sum += pfx[e + 1];
    int inc = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += v;
    }
    int run = inc - sum;
    if (lane == 0) pfx[0] = 0;
    for (int e = e0; e < e1; e++) run += pfx[e + 1], pfx[e + 1] = run;
}
// The producer's A pieces of an item (path 6): rows r0 + a_row0 + 16 i, i < 8, of the
// permutation (GATEUP: the row's token, whose latent row is read; DOWN: the row of h), 16-byte chunk
// a_ch; returns the mask of the rows before rend (the others are zero-filled copies of row 0)
template <bool GATEUP>
__device__ __forceinline__ uint32_t ws_a_sources(const xargs &a, int r0, int rend, int a_row0, int a_ch,
                                                 const uint16_t *xsrc[8]) {
    uint32_t ok_mask = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = r0 + a_row0 + 16 * i;
        const bool ok = r < rend;
        ok_mask |= (uint32_t)ok << i;
        const int src = ok ? (GATEUP ? a.row_token[r] : r) : 0;
        xsrc[i] = a.x + (size_t)src * a.K + a_ch * 8;
    }
    return ok_mask;
}
// the expert of pair pr: the last whose pairs start at or before pr (binary search of the scan).
// SH (path 17's packed scan, pairs in bits 0-15 and single tiles in 16-31): 0 searches the pairs,
// 16 the single tiles; -1 the whole word (paths 7 and 14)
template <int SH = -1>
__device__ __forceinline__ int pairs_expert(const int *pfx, int E, int pr) {
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        const int v = SH < 0 ? pfx[mid] : (pfx[mid] >> (SH < 0 ? 0 : SH)) & 0xffff;
        if (v <= pr) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Path 29's item counters, [GATEUP] (see DYN below): the next item past each block's first, and
// the blocks that took their last
__device__ int ws_dyn_next[2], ws_dyn_done[2];
// the last block of a launch to count itself done puts both counters back to 0 for the next launch
// (stream-ordered after this one): every block counts once, after its last take
__device__ __forceinline__ void ws_dyn_leave(int k) {
    __threadfence();  // this thread's takes before its count
    if (atomicAdd(&ws_dyn_done[k], 1) == (int)gridDim.x - 1) {
        atomicExch(&ws_dyn_next[k], 0);
        atomicExch(&ws_dyn_done[k], 0);
    }
}

// CL (path 7, BF16 only): blocks run in clusters of 2 that take the two M tiles 2k, 2k + 1 of one
// expert (an item = pair of tiles x N tile) and share the B tile: block rank r copies half r (w1 /
// w3 rows for GATEUP, rows 128 r .. of the 256 for DOWN) by TMA multicast into both blocks' stage,
// so each weight byte leaves L2 once per pair instead of once per tile (the 128 x 256 tile alone
// needs ~10 TB/s of L2 reads at the dense peak). The pairs are counted per expert (ceil(tiles / 2))
// into a prefix array in shared memory at the start; the second tile of an odd expert has no rows
// (its block copies its half of B and multiplies nothing). Each consumer warp releases a stage in
// both blocks (`empty` counts 16), so neither producer refills a stage the other block still reads;
// the blocks leave together (a cluster barrier), since the other block's copies and arrivals target
// this one's shared memory. Measured correct but slower (Kimi-Linear 3.74 ms vs path 6's 2.84): an
// expert with an odd tile count spends a whole pair (two SMs) on its last tile, the pair's blocks
// run in lock step, and the L2 traffic it saves was not the limit (path 6's probes); opt-in only.
//
// CL = 2, 3 (paths 17, 18, BF16 only, opt-in: LUNAR_MOE_PREFILL=wsmc, wsmc2; 18 releases the peer's
// stage with a CTA-scope arrival, see ws_arrive_peer): path 7's clusters with path 12's
// fast gate/up epilogue (PF = 3), now that the epilogue no longer hides the L2: path 12 runs both
// GEMMs at ~91 % of the L2's throughput (Nsight Compute, session 5), each 128-row M tile re-reading
// its expert's weight tile. Path 7 also spent a whole pair (two SMs) on the last tile of an expert
// with an odd tile count (about half of Kimi-Linear's experts at 8K: ~256 +- 16 rows, 2 or 3 tiles);
// here an expert's tiles 2k, 2k + 1 form the multicast pairs (floor(tiles / 2) per expert) and the
// odd last tiles form a second list, single tiles x N tiles, of which a cluster takes two
// consecutive items (the two blocks: N tiles n, n + 1 of the same M tile, or the next tile's),
// each block copying its own whole B tile by plain TMA (no multicast: different weight rows).
// Every item, shared or not, arms `full` with the same 32 KB and every consumer warp releases the
// stage in both blocks (`empty` counts 16), so the barrier protocol is path 7's for every item:
// whether an item multicasts depends only on the cluster's unit, the same for both blocks. The
// per-expert counts are packed (pairs in bits 0-15, single tiles in 16-31) into one scan; a unit
// count past the single items' end (an odd number of them) leaves block 1 a unit with no rows,
// which copies a valid B tile and multiplies nothing, as path 7's empty tiles.
//
// PF = 1, 2 (paths 11, 10, BF16 only, opt-in: measured 0-6 % slower than path 6): the proxy
// fence moves from the consumers to the producer. Path 6's BF16 consumers fence the async proxy
// after every `full` wait (the A pieces are other threads' cp.async writes), a fence per chunk in
// the tensor-core warps; MXFP4's consumers fence nothing
// (the producer threads fence before their arrival) and its no-copies probe reached 41 % of the
// peak on K3.1 against BF16's 38 % on Kimi-Linear's shape, which has fewer padded rows. Here, as
// for MXFP4, each producer thread arrives for chunk q only P chunks after issuing it (cp.async.
// wait_group P: its own pieces have landed), fences, then arrives: 128 plain arrivals + thread 0's
// expect_tx of the TMA bytes, so `full` counts 129 as in path 6 and the consumers only wait.
// PF = that lag P (2 as MXFP4's, path 10; 1, path 11): a chunk's A pieces get ST - 1 chunks to land
// either way, but with P = 2 the arrival for chunk q waits for the release of q - 2 (the producer
// issues q + 2 first), with P = 1 for that of q - 3, at the cost of fewer copy groups in flight.
// PF = 3 (path 12, BF16's prefill default): path 6 with glu_act_fast in the gate/up epilogue.
//
// DYN (path 29: path 12's two kernels, BF16 only): the items handed out by a global counter instead
// of b, b + grid, ... At Kimi-Linear's 8K prefill an expert has ~256 rows (2-3 M tiles), and the
// items (tile t, N tile n) and (t + 1, n) read the same 1.18 MB weight tile; under the static walk
// they run on blocks whose starts drift apart by up to an item (~32 us: short last tiles finish
// early, and the drift adds up over ~39 items a block), while the L2 turns over its 60 MB in ~20 us
// at the kernel's DRAM rate, so the second tile re-reads most of the weights from DRAM: Nsight
// Compute, 3904 MB read a layer for 2416 MB of weights (docs/benchmarks.md "Prefill 8K, round 5").
// Taken in counter order, item w + NN (the next tile's same N tile) starts ~NN items' worth of
// grabs later (~2 us at 132 blocks), well inside the L2's lifetime; the grid's last items also
// spread over the blocks that finish first. The producer's thread 0 takes the next item two chunks
// before the current one's last (the atomic's latency under those chunks' copies), hands it to the
// other producer threads by shared memory and a named barrier, and to the consumers in the
// stage's item word, written before its arrival on the first chunk's `full` (the barrier's release
// / acquire publishes it). No item left: the producer fills the next stage's `full` with 129 plain
// arrivals and item word -1, and the consumers leave. A launch's counter is back at 0 when it
// ends: every block's thread 0 counts itself done after its last take, and the last one resets both.
// One launch of a kernel (gate/up or down) at a time per device: the counters are per kernel.
// Measured (H200, Kimi-Linear-48B's 8K prefill, docs/benchmarks.md "MoE prefill BF16, items by a
// counter"): gate/up 1307 -> 1170 us a layer, DRAM read 4080 -> 2735 MB; down 737 -> 678 us, read
// 1778 -> 1345 MB (its bytes' floor: the weights and h once); the prefill 4.2-5.5 % faster. BF16's
// prefill default since session 13.
template <bool MX, bool GATEUP, int CL, int PF, bool DYN = false>
__global__ void __launch_bounds__(WS_T, 1)
    moe_ws_kernel(const __grid_constant__ xargs a, const __grid_constant__ CUtensorMap tm0,
                  const __grid_constant__ CUtensorMap tm1) {
    static_assert(!(MX && CL), "the cluster variant copies bf16 weights");
    static_assert(!DYN || (!MX && !CL && (PF == 0 || PF == 3)), "path 29: path 12's kernels");
    static_assert(!(PF && (MX || (CL && PF != 3))), "paths 10-12 are variants of path 6's BF16 kernel");
    static_assert(CL >= 0 && CL <= 3,
                  "0: one block, 1: path 7's pairs, 2: path 17's pairs + paired single tiles, 3: path 18 (17, "
                  "CTA-scope remote releases)");
    constexpr bool CL2 = CL >= 2;  // paths 17, 18: the pairs + paired single tiles
    constexpr bool FE = PF == 3;               // the fast epilogue, path 6's pipeline
    constexpr bool DEFER = MX || (PF && !FE);  // producer threads arrive P chunks late, after their own fence
    constexpr int P = PF && !FE ? PF : WS_P;
    typedef ws_cfg C;
    constexpr int NH = GATEUP ? WS_BN / 2 : WS_BN;  // output columns per N tile
    constexpr int NACC = WS_BN / 2;                 // accumulators per consumer thread
    extern __shared__ uint8_t ws_smem[];
    const uint32_t sA = (smem_u32(ws_smem) + 1023u) & ~1023u;
    const uint32_t sB = sA + WS_ST * C::A_BYTES, sR = sB + WS_ST * C::B_BYTES, sS = sR + WS_RS * C::RAW_BYTES;
    const uint32_t full = (MX ? sS + WS_RS * C::SCW_BYTES : sR), empty = full + WS_ST * 8;
    int *pfx = (int *)(ws_smem + (empty + WS_ST * 8 - smem_u32(ws_smem)));  // CL: [E + 1] pairs (+ singles) before expert e
    // DYN: [s] the item of the chunk in stage s (written for an item's first chunk; -1: none left),
    // [ST + (li & 1)] the producers' next item after their li-th
    volatile int *itm = pfx;

    const int NN = a.R / NH, J = a.K / WS_BK;
    const int tid = threadIdx.x;
    const uint32_t rank = CL ? cluster_rank() : 0;
    if (CL) {
        for (int e = tid; e < a.E; e += WS_T) {
            const int t = (a.offsets[e + 1] - a.offsets[e] + WS_BM - 1) / WS_BM;
            pfx[e + 1] = !CL2 ? (t + 1) / 2 : (t >> 1) | ((t & 1) << 16);
        }
        __syncthreads();
        if (tid < 32) pairs_scan_warp(pfx, a.E, tid);
        __syncthreads();
    }
    // CL: cluster c = b / 2 of G / 2 walks items c, c + G / 2, ...; both blocks the same ones.
    // CL = 2: units [0, PT) the multicast pairs x N tiles, then the single tiles' SG items two a unit
    const int PT = CL2 ? (pfx[a.E] & 0xffff) * NN : 0, SG = CL2 ? (pfx[a.E] >> 16) * NN : 0;
    const int total = CL2 ? PT + (SG + 1) / 2 : (CL ? pfx[a.E] : a.counts[a.E + 1]) * NN;
    const int G = CL ? gridDim.x / 2 : gridDim.x, b = CL ? blockIdx.x / 2 : blockIdx.x;
    if (b >= total) {  // block- (CL: cluster-) uniform, before any barrier
        if (DYN && tid == 0) ws_dyn_leave(GATEUP);
        return;
    }
    const int items = (total - 1 - b) / G + 1, Q = items * J;
    // item li of this block: expert e, rows r0 .. rend - 1 of the permutation, weight rows n0 ..;
    // mc: the cluster shares the item's B tile (CL = 1 always, CL = 2 on the pairs' units)
    auto item_at = [&](int w, int &e, int &r0, int &rend, int &n0, bool &mc) {
        mc = CL == 1 || (CL2 && w < PT);
        if (CL2 && !mc) {
            const int si0 = 2 * (w - PT) + (int)rank, si = min(si0, SG - 1), sp = si / NN;
            e = pairs_expert<16>(pfx, a.E, sp), rend = a.offsets[e + 1];
            // the expert's odd last tile, after its pairs; block 1's unit past the end: no rows
            r0 = si0 < SG ? a.offsets[e] + ((pfx[e + 1] & 0xffff) - (pfx[e] & 0xffff)) * 2 * WS_BM : rend;
            n0 = (si - sp * NN) * NH;
        } else if (CL2) {
            const int pr = w / NN;
            e = pairs_expert<0>(pfx, a.E, pr), rend = a.offsets[e + 1];
            r0 = a.offsets[e] + (pr - (pfx[e] & 0xffff)) * 2 * WS_BM + (int)rank * WS_BM;
            n0 = (w - pr * NN) * NH;
        } else if (CL) {
            const int pr = w / NN;
            e = pairs_expert(pfx, a.E, pr), rend = a.offsets[e + 1];
            r0 = a.offsets[e] + (pr - pfx[e]) * 2 * WS_BM + (int)rank * WS_BM;
            n0 = (w - pr * NN) * NH;
        } else {
            const int ti = w / NN;
            e = a.tiles[2 * ti], r0 = a.tiles[2 * ti + 1], rend = a.offsets[e + 1];
            n0 = (w - ti * NN) * NH;
        }
    };
    auto item = [&](int li, int &e, int &r0, int &rend, int &n0, bool &mc) { item_at(b + li * G, e, r0, rend, n0, mc); };
    if (tid == 0) ws_ring_init(full, empty, WS_ST, MX ? 128 : 129, CL ? 16 : 8);
    if (CL) cluster_sync_all();  // both blocks' barriers exist before either copies or arrives
    else __syncthreads();

    if (tid < 128) {
        // ---------------------------------------------------------------- producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 72;\n" ::: "memory");
        const int a_ch = tid & 7, a_row0 = tid >> 3;  // A piece i: row a_row0 + 16 i, 16-byte chunk a_ch
        const size_t estr = (size_t)a.R * a.K;
        const uint16_t *xsrc[8];
        uint32_t xok = 0;
        int e = 0, n0 = 0;
        bool mc = false;
        int cur_w = 0;
        auto start = [&](int w) {  // item w's expert, weight rows and A sources
            int r0, rend;
            item_at(w, e, r0, rend, n0, mc);
            xok = ws_a_sources<GATEUP>(a, r0, rend, a_row0, a_ch, xsrc);
            cur_w = w;
        };
        // chunk q, column chunk j of its item
        auto issue = [&](int q, int j) {
            const int s = q % WS_ST;
            if (!DYN && j == 0) start(b + (q / J) * G);
            if (q >= WS_ST) mbar_wait(empty + 8 * s, ((q / WS_ST) - 1) & 1);
            if (DYN && j == 0 && tid == 0) itm[s] = cur_w;  // before this thread's arrival on `full`
            if (CL && mc && tid == 0) {  // this block's half of B, into both blocks
                mbar_expect_tx(full + 8 * s, C::B_BYTES);
                const int row = e * a.R + n0 + (GATEUP ? 0 : 128 * (int)rank);
                ws_tma_mc(sB + s * C::B_BYTES + rank * (C::B_BYTES / 2), rank ? &tm1 : &tm0, j * WS_BK, row,
                          full + 8 * s);
            } else if (!MX && tid == 0) {
                mbar_expect_tx(full + 8 * s, C::B_BYTES);
                const int row = e * a.R + n0;
                tma_2d(sB + s * C::B_BYTES, &tm0, j * WS_BK, row, full + 8 * s);
                tma_2d(sB + s * C::B_BYTES + C::B_BYTES / 2, &tm1, j * WS_BK, GATEUP ? row : row + 128,
                       full + 8 * s);
            }
            const uint32_t dA = sA + s * C::A_BYTES;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int row = a_row0 + 16 * i;
                cp_async16(dA + row * 128 + ((a_ch ^ (row & 7)) << 4), xsrc[i] + j * WS_BK, (xok >> i) & 1);
            }
            if (MX) {
                const int slot = q % WS_RS;
                const size_t ebase = (size_t)e * estr;
#pragma unroll
                for (int i = 0; i < C::UNITS / 128; i++) {
                    const int u = tid + 128 * i, nr = u >> 1, half = u & 1;
                    const bool m3 = GATEUP && nr >= NH;
                    const size_t base = ebase + (size_t)(n0 + (m3 ? nr - NH : nr)) * a.K;
                    const uint8_t *q4 = m3 ? a.wq[1] : a.wq[0], *s8 = m3 ? a.ws[1] : a.ws[0];
                    cp_async16(sR + slot * C::RAW_BYTES + u * 16, q4 + base / 2 + j * 32 + half * 16, true);
                    // the aligned word holding this block's scale byte (never past the allocation)
                    const uintptr_t sp = (uintptr_t)(s8 + base / 32 + 2 * j + half);
                    cp_async4(sS + slot * C::SCW_BYTES + u * 4, (const void *)(sp & ~(uintptr_t)3));
                }
                cp_commit();
            } else if (DEFER) {
                cp_commit();  // one group per chunk: arrives after cp_wait<P>, in the loop below
            } else {
                ws_arrive_cp(full + 8 * s);
            }
        };
        // MXFP4: chunk q's raw blocks of this thread -> bf16 rows of stage q % ST's B, then arrive
        auto widen = [&](int q) {
            const int j = q % J, s = q % WS_ST, slot = q % WS_RS;
            const uint32_t dB = sB + s * C::B_BYTES;
#pragma unroll
            for (int i = 0; i < C::UNITS / 128; i++)
                widen_unit<GATEUP, NH>(tid + 128 * i, sR + slot * C::RAW_BYTES, sS + slot * C::SCW_BYTES, dB, a, j);
            fence_async_smem();  // this thread's widened rows and landed A pieces -> the wgmma
            mbar_arrive(full + 8 * s);
        };
        if (DEFER) {
            for (int q = 0; q < Q + P; q++) {
                if (q < Q) issue(q, q % J);
                else cp_commit();  // empty groups keep the wait_group count fixed
                if (q >= P) {
                    cp_wait<P>();
                    if (MX) {
                        widen(q - P);
                    } else {
                        fence_async_smem();  // this thread's landed A pieces of chunk q - P -> the wgmma
                        mbar_arrive(full + 8 * ((q - P) % WS_ST));
                    }
                }
            }
        } else if (DYN) {
            int q = 0;
            for (int w = b, li = 0;; li++) {
                start(w);
                int next = 0;
                for (int j = 0; j < J; j++, q++) {
                    if (tid == 0 && j == (J > 2 ? J - 2 : 0)) next = G + atomicAdd(&ws_dyn_next[GATEUP], 1);
                    issue(q, j);
                }
                if (tid == 0) itm[WS_ST + (li & 1)] = next;
                asm volatile("bar.sync 1, 128;\n" ::: "memory");  // the producer warpgroup
                w = itm[WS_ST + (li & 1)];
                if (w >= total) break;
            }
            // none left: stage q % ST's next `full` phase completes with item word -1 (129 arrivals)
            const int s = q % WS_ST;
            if (q >= WS_ST) mbar_wait(empty + 8 * s, ((q / WS_ST) - 1) & 1);
            if (tid == 0) {
                itm[s] = -1;
                mbar_arrive(full + 8 * s);
                ws_dyn_leave(GATEUP);
            }
            mbar_arrive(full + 8 * s);
        } else {
            for (int q = 0; q < Q; q++) issue(q, q % J);
        }
        cp_commit();
        cp_wait<0>();  // nothing of this thread's is left in flight when it leaves
    } else {
        // ---------------------------------------------------------------- consumers
        asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n" ::: "memory");
        const int ct = tid - 128, wg = ct >> 7, lane = ct & 31, wwarp = (ct >> 5) & 3;
        const int g = lane >> 2, c = lane & 3;
        float acc[NACC];
#pragma unroll
        for (int i = 0; i < NACC; i++) acc[i] = 0.0f;
        int pend = -1;  // the chunk whose stage this warp has not released yet
        for (int li = 0, q = 0; DYN || li < items; li++) {
            int e_, c_r0, c_rend, c_n0;
            bool mc_;
            if (DYN) {  // the item of the next chunk's stage, published by its `full` phase
                const int s0 = q % WS_ST;
                mbar_wait(full + 8 * s0, (q / WS_ST) & 1);
                const int w = itm[s0];
                if (w < 0) break;  // no chunk pending: the last item was drained and released
                item_at(w, e_, c_r0, c_rend, c_n0, mc_);
            } else {
                item(li, e_, c_r0, c_rend, c_n0, mc_);
            }
            c_r0 += wg * 64;
            const bool c_on = c_r0 < c_rend;  // warpgroup-uniform
            for (int j = 0; j < J; j++, q++) {
                const int s = q % WS_ST;
                mbar_wait(full + 8 * s, (q / WS_ST) & 1);
                if (c_on) {
                    if (!DEFER) fence_async_smem();  // the producer's cp.async A pieces, published by the barrier
                    const uint32_t aT = sA + s * C::A_BYTES + wg * 64 * 128, bT = sB + s * C::B_BYTES;
                    wgmma_fence();
                    fence_acc<NACC>(acc);
#pragma unroll
                    for (int kk = 0; kk < WS_BK / 16; kk++)
                        wgmma_m64n256<0>(acc, ws_desc(aT + kk * 32), ws_desc(bT + kk * 32), j > 0 || kk > 0);
                    wgmma_commit();
                    fence_acc<NACC>(acc);
                }
                wgmma_wait<1>();  // chunk q - 1's products are done: its stage may be refilled
                if (pend >= 0) {
                    __syncwarp();
                    if (lane == 0) {
                        mbar_arrive(empty + 8 * (pend % WS_ST));
                        if (CL) ws_arrive_peer<CL == 3>(empty + 8 * (pend % WS_ST), rank ^ 1);
                    }
                }
                pend = q;
            }
            wgmma_wait<0>();
            fence_acc<NACC>(acc);
            __syncwarp();
            if (lane == 0) {
                mbar_arrive(empty + 8 * (pend % WS_ST));
                if (CL) ws_arrive_peer<CL == 3>(empty + 8 * (pend % WS_ST), rank ^ 1);
            }
            pend = -1;
            if (c_on) {
                moe_wg_epilogue<GATEUP, NACC, FE>(a, acc, c_r0, c_rend, c_n0, wwarp, g, c);
            }
        }
    }
    if (CL) cluster_sync_all();  // the other block's last copies / arrivals into this one have landed
}

// ---------------------------------------------------------------- path 14: MXFP4, each weight tile widened once for 256 token rows
// Path 6's MXFP4 kernel widens in its one producer warpgroup (128 threads, ~2.5 integer / bf16x2
// operations a weight on top of the copies) and measured 20 % slower than path 4 on K3.1's shapes.
// Path 13 (session 7, moe_wx_kernel; superseded by this kernel and removed in session 9) had
// the producer only copy (A pieces, the packed nibbles and the E8M0 scale words by cp.async: a
// quarter of the bf16 bytes) and each consumer warpgroup widen, one chunk ahead of its tensor cores,
// the weight rows it multiplied: items of 128 token rows x 256 weight rows, warpgroup w taking
// weight rows 128 w .. against all 128 token rows, 21-25 % faster than path 4. It widened a
// block's 256 weight rows once per 128-row M tile: at K3.1's 8K prefill an expert gets ~146 rows
// (8192 x 16 / 896), tiles of 128 + ~18, so every weight chunk was widened twice and the second
// widening fed a quarter of the products (token half 1 idle); Nsight Compute put the
// consumers' latency chain (wait -> shared loads -> ~270 ALU ops -> stores -> barrier -> wgmma), not
// L2 or DRAM, at the limit (docs/benchmarks.md "MoE prefill, MXFP4 in the consumer warps").
//
// Here the consumer warpgroups split the TOKEN rows instead of the weight rows: an item is (up to
// 256 token rows of one expert: two consecutive 128-row tiles of the permutation's tile list) x
// (128 weight rows: GATEUP 64 rows of w1 + the same 64 of w3, output columns n0 .. n0 + 63; DOWN 128
// rows of w2). Warpgroup w multiplies token rows 128 w .. 128 w + 127 of the item (two m64n128
// accumulator sets, 2 x 64 fp32 a thread as in path 13) by the one shared bf16 B tile, which the
// 256 consumer threads widen together, one 32-weight block a thread per chunk: half of path 13's
// widening per product on full items (8 K weights per 256 x 128 x 64 chunk instead of 16 K per
// 128 x 256 x 64), and ~146-row experts pay one widening for their three live 64-row halves
// instead of two for three.
//
// Items: each block counts the pairs of every expert (ceil(rows / 256)) into a prefix array in
// shared memory at the start (as path 7's clusters) and walks items b, b + grid, ... of the pairs x
// N tiles, finding an item's expert by a binary search. (The first version walked the tile list and
// skipped its second tiles as empty items: where the grid is a multiple of the N tile count, as 132
// = 22 x 6 at the TP8 slice's gate/up, a block's tiles all have the same parity, so with two tiles
// per expert half the blocks got all the work: 2.2 ms slower over 10 layers in the model.)
//
// Per chunk q, consumer thread: wait `full` (128 producer arrivals by cp.async.mbarrier.arrive.noinc),
// fence the async proxy, widen its block into B buffer q % 3, fence, a 256-thread named barrier
// (the whole tile written), its warpgroup's products (none for a 64-row half past the expert's
// end), commit, wgmma_wait<1>, release chunk q - 1's stage (one arrival per consumer warp: 8).
// THREE B buffers, not two: the tile is shared, so a warpgroup writing buffer (q + 1) % 3 after the
// barrier of chunk q must not overwrite what the other warpgroup's products may still read. Both
// passed that barrier after their wgmma_wait<1> of chunk q - 1, so chunk q - 2's products (the
// last reader of buffer (q + 1) % 3) are done; chunk q - 1's may not be.
//
// Measured (H200, 8192 tokens, both expert GEMMs; docs/benchmarks.md "MoE prefill, MXFP4 round 2"):
// K3.1 25.25 ms (39 % of the measured dense peak) against path 13's 31.41, the TP8 slice 4.01 against
// 4.68; the TP8 slice's 8K prefill 0.1311 s against 0.1328. The MXFP4 prefill default until path 22.
//
// Path 22 (EPI = true; session 10, docs/benchmarks.md "MoE prefill, MXFP4 round 3"): the consumers'
// work between two items. At the TP8 slice's down GEMM (K = 384: 6 chunks an item) path 14's down
// kernel took as long as its gate/up (2.16 vs 2.24 ms at 8K) for half the products; per item the
// consumers drain the tensor cores, look the next item up (a binary search over the pair prefix
// array: ~10 dependent shared loads) and run the epilogue, whose row weight load follows every store
// (moe_wg_epilogue's stores through a.y may alias a.row_weight, so the compiler reloads it: 64
// dependent loads a thread and item). Path 22 loads the 4 row weights of a thread once
// (wy_down_epilogue) and looks the next item up before the drain's wgmma_wait<0>; products and
// stores are path 14's. Measured: the TP8 slice's down kernel 2.16 -> 1.50 ms (Nsight Compute: long
// scoreboard 3.52 -> 1.90 cycles a issue, barrier 1.61 -> 0.65), K3.1's 26.3 -> 25.4 ms, the TP8
// slice's 8K prefill 0.1322 -> 0.1264 s; the MXFP4 prefill default until path 24 (LUNAR_MOE_PREFILL=wsmx2:
// path 14).
// Measured slower and removed (commit 9ac592b of branch s10-mx4pre has them): 4 B buffers with
// wgmma_wait<2> (+8 %: the stage is released a chunk later, so the producer runs a chunk less
// ahead), the producer warpgroup widening words 2-3 of every block one chunk behind its copies
// (+11 %: its arrival now waits for its own copies and its widening), both (+30 %), and no copies
// for the A rows past an expert's end (+14 % on K3.1 against path 22; not broken down: the stale
// rows left there, unlike zeros, may cost the tensor cores power, hence clock).
#define WY_ST 4  // ring stages of 37 KB (A 32 + nibbles 4 + scale words 1) + 3 x 16 KB bf16 B buffers
#define WY_MAX_E 1024  // the prefix array's experts
#define WX_REM 192     // MIX (path 28): an expert's last rows % 256 go to path 25 when 1..WX_REM of them

// ---------------------------------------------------------------- path 28: path 24 or 25 per item (gate/up)
// Path 24's items hold 256 token rows of one expert (two warpgroups x two 64-row halves, products per
// live half), path 25's up to WM_TM = 192 as N in multiples of 32. At the balanced 8K prefill of K3.1
// (~146 rows an expert) path 24 issues 192 rows for 146 and path 25 160, and path 25's gate/up measured
// 5-9 % faster; with large experts (585 or 2340 rows) path 24's 256-row tiles measured 8 % faster (more
// products per widened weight chunk; docs/benchmarks.md "MoE prefill, MXFP4 with the weights as M").
// Path 28 (the MXFP4 prefill default since session 13) splits each expert's rows of the gate/up GEMM
// between the two: its full 256-row tiles to path 24's kernel, the rest (rows % 256) to path 25's as
// one tile when 1..WX_REM rows (N = the rest rounded up to 32), else to path 24 as one more (partial)
// tile (a rest of 193..255 rows: 256 issued, where path 25 would take two items); its down GEMM is
// path 24's. Two launches on one stream: path 24's kernel first (its blocks signal
// griddepcontrol.launch_dependents at entry), then path 25's with the programmatic-serialization
// attribute (launch_pdl's, off with LUNAR_CUDA_PDL=0), so its blocks take the SMs that path 24's
// blocks leave in the first kernel's tail instead of waiting for the last one. The two write
// disjoint rows of h and read only what kernels before the first one wrote,
// so path 25's blocks need no wait before their work; every thread of theirs waits
// (griddepcontrol.wait) before it exits, so the second kernel completes only after the first and
// the kernel after it (normal stream order) sees both (cuda_common.cuh's rule of the chain).
// Measured (H200, 8192 tokens, docs/benchmarks.md "MoE prefill, MXFP4: path 24 or 25 per item"): both
// GEMMs 4-6 % faster than path 24 at the bench's balanced routing and 0.5-1 % with ~585-row experts;
// the K3.1 TP8 slice's 8K prefill 1.1 % faster (every round). Path 27 (the same split in the down
// GEMM too: path 25's down kernel on the rests) measured slower than 28 at the TP8 slice (down 1.48
// against 1.44 ms; the 8K prefill 0.1230 against 0.1214 s) and was removed (commit 9dbda0d has it).
__device__ __forceinline__ void mix_signal_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void mix_wait_primary() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

struct wy_cfg {
    static constexpr uint32_t A_BYTES = 256 * 128, RAW_BYTES = 128 * 32, SCW_BYTES = 128 * 2 * 4;
    static constexpr uint32_t STAGE = A_BYTES + RAW_BYTES + SCW_BYTES;  // 37 x 1024
    static constexpr uint32_t B_BYTES = 128 * 128;                    // the shared bf16 B tile
    static constexpr size_t smem(bool bs = false) {
        return 1024 + (size_t)WY_ST * STAGE + 3 * B_BYTES + 2 * WY_ST * 8 + (WY_MAX_E + 1) * 4 +
               (bs ? 16 + 2 * (size_t)(2 * 8 * 272) : 0);  // BS: warps 6-7's staging (WB_WARP each)
    }
};

// 8 nibbles of one 32-weight block (word w of its 4) widened by the block's scale into the 16
// bytes of row nr, columns 32 half + 8 w .. of a bf16 B tile (128-byte swizzle)
// The producer's token rows of an item (paths 22 / 24 and 25): rows r0 + a_row0 + 16 i, i < NP, of the
// permutation as row indices (GATEUP: the row's token, whose latent row is read; DOWN: the row of h; 0
// past rend), not pointers (16 pointers spilled at 88 registers); returns the mask of the rows before rend
template <bool GATEUP, int NP>
__device__ __forceinline__ uint32_t wy_a_rows(const xargs &a, int r0, int rend, int a_row0, int (&src)[NP]) {
    uint32_t ok_mask = 0;
#pragma unroll
    for (int i = 0; i < NP; i++) {
        const int r = r0 + a_row0 + 16 * i;
        const bool ok = r < rend;
        ok_mask |= (uint32_t)ok << i;
        src[i] = ok ? (GATEUP ? a.row_token[r] : r) : 0;
    }
    return ok_mask;
}
// The producer's packed MXFP4 pieces of chunk j (paths 22 / 24 and 25): each thread copies its 2 blocks (wq: their
// rows' packed bytes, wsw: their E8M0 scale bytes) into the stage's raw tile dR and scale words dS, the scale as
// the aligned 4-byte word holding it (never past the allocation)
__device__ __forceinline__ void wy_copy_raw(uint32_t dR, uint32_t dS, const uint8_t *const (&wq)[2],
                                            const uint8_t *const (&wsw)[2], int j, int tid) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int u = tid + 128 * i;
        cp_async16(dR + u * 16, wq[i] + j * 32, true);
        const uintptr_t sp = (uintptr_t)(wsw[i] + 2 * j);
        cp_async4(dS + u * 4, (const void *)(sp & ~(uintptr_t)3));
    }
}

template <bool TWO>
__device__ __forceinline__ void wy_put(uint32_t row, int nr, int half, int w, uint32_t word, const mxscale &sc) {
    uint32_t p[4];  // (x3, x7), (x2, x6), (x1, x5), (x0, x4) -> natural order below
    pairs_mx<TWO>(word, sc, p);
    sts128(row + (((4 * half + w) ^ (nr & 7)) << 4), prmt(p[3], p[2], 0x5410), prmt(p[1], p[0], 0x5410),
           prmt(p[3], p[2], 0x7632), prmt(p[1], p[0], 0x7632));
}

// the top-k weights of this thread's 4 down rows (half h = i / 2 of the warpgroup's 128, row 16 wwarp
// + g + 8 (i % 2) in it; 0 past the expert's end or a dead half), loaded before any store of the item
__device__ __forceinline__ void wy_row_weights(const xargs &a, int nw, int m0, int rend, int wwarp, int g,
                                               float (&rw)[2][2]) {
    const int rlo = m0 + wwarp * 16 + g;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = rlo + 64 * (i >> 1) + 8 * (i & 1);
        rw[i >> 1][i & 1] = (i >> 1) < nw && r < rend ? a.row_weight[r] : 0.0f;
    }
}

// Path 22's down epilogue (moe_wg_epilogue<false, 64> for both 64-row halves of this warpgroup, the
// same products and stores): the 4 row weights of this thread's rows loaded before either half's stores
__device__ __forceinline__ void wy_down_epilogue(const xargs &a, const float *acc0, const float *acc1, int nw, int m0,
                                                 int rend, int n0, int wwarp, int g, int c) {
    float rw[2][2];
    wy_row_weights(a, nw, m0, rend, wwarp, g, rw);
    if (nw > 0) moe_wg_down_store<64>(a, acc0, rw[0], m0, rend, n0, wwarp, g, c);
    if (nw > 1) moe_wg_down_store<64>(a, acc1, rw[1], m0 + 64, rend, n0, wwarp, g, c);
}

// ---------------------------------------------------------------- path 24: the bf16 down rows by bulk copies
// Path 22's down GEMM at the TP8 slice (K = 384: 6 chunks an item) ran at 27 % of the peak against
// its gate/up's 38 %: per item the consumers drain the tensor cores and then store 128 x 128 outputs
// from the accumulators, each warp store instruction covering 8 rows x 4 threads x 4 bytes (bf16
// rows: 16 bytes, half a sector, of 8 different lines), 64 of them a thread, while no wgmma runs.
// Path 24 (LUNAR_MOE_PREFILL=wsmxb; MXFP4's default since session 11, with the forward's bf16 rows:
// with fp32 rows it is path 22) stages each warp's rows in shared memory with stmatrix (4 instructions per 8 rows x 128
// columns instead of 16 stores) and writes every row as one 256-byte bulk copy
// (cp.async.bulk.global.shared::cta): whole sectors, issued by 8 lanes, completed by the copy engine
// while the warps go on to the next item's chunks.
// Staging: a warp's 16 rows of one 64-row half in two 8-row buffers of 8 x 272 bytes (rows 16 bytes
// apart in the banks: the 8 rows of an 8 x 8 matrix hit disjoint banks), 4352 bytes a warp, 34 KB for
// the 8 consumer warps: more than the 26 KB path 22 leaves free, so warps 0-2 stage in B buffer
// (q + 1) % 3, warps 3-5 in (q + 2) % 3 (q: the next item's first chunk, which widens into q % 3)
// and warps 6-7 in 8.5 KB more at the end. The B buffers are free at the epilogue once both
// warpgroups have drained (one 256-thread barrier: the other's last products read (q + 2) % 3); they
// are refilled only by the widening of chunks q + 1 and q + 2, after chunk q's barrier, before which
// every consumer thread waits for its bulk copies' reads (cp.async.bulk.wait_group.read 0: nothing
// pending for the other lanes and chunks). Rows past the expert's end are staged but not copied.
// Measured (H200, docs/benchmarks.md "MoE prefill, MXFP4 round 4"): the TP8 slice's down kernel with
// bf16 rows 1.44 ms against 22's 1.59 (its own bf16 stores) and 1.50 (fp32 rows); its 8K prefill 2.2 %
// faster than path 22 with fp32 rows (the old default), 1.2 % than 22 with bf16 rows.
#define WB_ROW 272                // staging row: 128 bf16 + 16 bytes
#define WB_WARP (2 * 8 * WB_ROW)  // two 8-row buffers a warp
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}
__device__ __forceinline__ void bulk_store(const void *gdst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gdst), "r"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// this thread's bulk groups but the newest N have been read from shared memory (READ) or completed
template <int N, bool READ> __device__ __forceinline__ void bulk_wait() {
    if (READ) asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
    else asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint32_t bf2_bits(float lo, float hi) {
    __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&b);
}
// the same rows and values as wy_down_epilogue into a.yb (v * w rounded once to bf16); stg: this
// warp's WB_WARP bytes of staging. Row set s = (half s / 2, rows g + 8 (s % 2)) goes to buffer s % 2;
// set s >= 2 first waits until set s - 2's copies have read it
__device__ __forceinline__ void wy_down_bulk(const xargs &a, const float *acc0, const float *acc1, int nw, int m0,
                                             int rend, int n0, int wwarp, int g, int lane, uint32_t stg) {
    float rw[2][2];
    wy_row_weights(a, nw, m0, rend, wwarp, g, rw);
#pragma unroll
    for (int s = 0; s < 4; s++) {
        const int h = s >> 1, hh = s & 1;
        if (h >= nw) break;  // warpgroup-uniform
        const float *acc = h ? acc1 : acc0, w = rw[h][hh];
        const uint32_t buf = stg + (s & 1) * (8 * WB_ROW);
        if (s >= 2) {
            bulk_wait<1, true>();
            __syncwarp();
        }
        // matrix i of stmatrix m: columns 8 (4 m + i) .., accumulators 4 (4 m + i) + 2 hh, + 1 (row g + 8 hh);
        // lane l gives the address of row l % 8 of matrix l / 8
#pragma unroll
        for (int m = 0; m < 4; m++) {
            uint32_t v[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float *x = acc + 4 * (4 * m + i) + 2 * hh;
                v[i] = bf2_bits(x[0] * w, x[1] * w);
            }
            stmatrix_x4(buf + (lane & 7) * WB_ROW + (4 * m + (lane >> 3)) * 16, v[0], v[1], v[2], v[3]);
        }
        fence_async_smem();  // this thread's staged rows -> the bulk copies (async proxy)
        __syncwarp();
        if (lane < 8) {
            const int r = m0 + 64 * h + wwarp * 16 + 8 * hh + lane;
            if (r < rend) bulk_store(a.yb + (size_t)r * a.R + n0, buf + lane * WB_ROW, 256);
            bulk_commit();
        }
    }
}

// ---------------------------------------------------------------- path 32: no copies for dead halves
// Path 24's producer fills all 256 A rows of every chunk, zero-filling those past the expert's end, also
// in the 64-row halves no wgmma reads (r0 + 64 h >= rend: the consumers issue products per live half).
// A ~146-row expert (K3.1's balanced 8K prefill) leaves half 3 dead: 8 KB of the ~125 KB of shared-memory
// traffic a down chunk moves (the products read 72, the copies write 32, the widening 16 + 5), where the
// TP8 slice's down kernel (6 chunks an item) looks bound by that traffic, not by the tensor cores.
// Path 32 (LUNAR_MOE_PREFILL=wsmxdh; HALF) copies no A row of a dead half: the TP8 down kernel 1.43 ->
// 1.41 ms, K3.1's 8.15 -> 7.92 ms (docs/benchmarks.md "MoE prefill, MXFP4 down GEMM: dead halves").
// (Path 22's measured slowdown from uncopied rows, above, was for rows the products read.) Measured
// slower and removed (commit 1b998f6 of branch s14-mx4d): the next item's first chunk widened before the
// drain with the staging moved off its B buffer, and the row weights loaded before the drain (TP8 down
// 1.47 ms, K3.1 8.5 ms).

// EPI: path 22 (false: path 14); BS (down, EPI): path 24, bf16 rows (a.yb) by bulk copies; MIX (gate/up,
// EPI): path 28's share of the items (an expert's full 256-row tiles, and its rest of > WX_REM rows);
// HALF: path 32 (above)
template <bool GATEUP, bool EPI, bool BS = false, bool MIX = false, bool HALF = false>
__global__ void __launch_bounds__(WS_T, 1) moe_wy_kernel(const __grid_constant__ xargs a) {
    static_assert(!BS || (EPI && !GATEUP), "path 24 is path 22's down kernel");
    static_assert(!MIX || (EPI && GATEUP), "path 28 takes path 22 / 24's gate/up kernel");
    if (MIX) mix_signal_dependents();  // path 25's kernel (the rest of the rows) may take SMs as blocks leave
    typedef wy_cfg C;
    static_assert(C::STAGE % 1024 == 0, "stages keep the A tiles 1024-byte aligned");
    constexpr int NH = GATEUP ? 64 : 128;  // output columns per item
    extern __shared__ uint8_t ws_smem[];
    const uint32_t sT = (smem_u32(ws_smem) + 1023u) & ~1023u;  // stage s: A, nibbles, scale words
    const uint32_t sB = sT + WY_ST * C::STAGE;                   // B buffer b
    const uint32_t full = sB + 3 * C::B_BYTES, empty = full + WY_ST * 8;
    int *pfx = (int *)(ws_smem + (empty + WY_ST * 8 - smem_u32(ws_smem)));  // [E + 1] pairs before expert e
    // BS: warps 6-7's staging (wy_down_bulk), after the prefix array
    const uint32_t stgE = (empty + WY_ST * 8 + (WY_MAX_E + 1) * 4 + 15) & ~15u;

    const int NN = a.R / NH, J = a.K / WS_BK;
    const int tid = threadIdx.x;
    for (int e = tid; e < a.E; e += WS_T) {
        const int rows = a.offsets[e + 1] - a.offsets[e];
        pfx[e + 1] = MIX ? rows / 256 + (rows % 256 > WX_REM) : (rows + 255) / 256;
    }
    __syncthreads();
    if (tid < 32) pairs_scan_warp(pfx, a.E, tid);
    __syncthreads();
    const int total = pfx[a.E] * NN, G = gridDim.x, b = blockIdx.x;
    if (b >= total) return;  // block-uniform, before any barrier
    const int items = (total - 1 - b) / G + 1;
    // item li: expert e, rows r0 .. min(r0 + 256, rend) of the permutation, weight rows from n0
    auto item = [&](int li, int &e, int &r0, int &rend, int &n0) {
        const int w = b + li * G, pr = w / NN;
        e = pairs_expert(pfx, a.E, pr), rend = a.offsets[e + 1];
        r0 = a.offsets[e] + (pr - pfx[e]) * 256;
        n0 = (w - pr * NN) * NH;
    };
    if (tid == 0) ws_ring_init(full, empty, WY_ST, 128, 8);
    __syncthreads();

    if (tid < 128) {
        // ---------------------------------------------------------------- producer: copies only
        // 88 registers, the consumers 208 (128 x 88 + 256 x 208 = 384 x 168): at path 13's 72 the 16
        // A-piece sources of a 256-row item spilled (ptxas -v: 32 bytes, reloaded every chunk)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 88;\n" ::: "memory");
        const int a_ch = tid & 7, a_row0 = tid >> 3;  // A piece i: row a_row0 + 16 i, 16-byte chunk a_ch
        const size_t estr = (size_t)a.R * a.K;
        for (int li = 0, q = 0; li < items; li++) {
            int e, r0, rend, n0;
            item(li, e, r0, rend, n0);
            int src[16];
            const uint32_t xok = wy_a_rows<GATEUP>(a, r0, rend, a_row0, src);
            // HALF: the item's live 64-row halves (piece i lies in half i / 4: a_row0 < 16)
            const int live_h = HALF ? (rend - r0 + 63) >> 6 : 4;
            // this thread's 2 blocks: row nr = u / 2 of the tile (GATEUP: < 64 w1, else w3), half u % 2
            const uint8_t *wq[2], *wsw[2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int u = tid + 128 * i, nr = u >> 1, half = u & 1;
                const bool m3 = GATEUP && nr >= 64;
                const size_t base = (size_t)e * estr + (size_t)(n0 + (GATEUP ? (nr & 63) : nr)) * a.K;
                wq[i] = (m3 ? a.wq[1] : a.wq[0]) + base / 2 + half * 16;
                wsw[i] = (m3 ? a.ws[1] : a.ws[0]) + base / 32 + half;
            }
            for (int j = 0; j < J; j++, q++) {
                const int s = q % WY_ST;
                if (q >= WY_ST) mbar_wait(empty + 8 * s, ((q / WY_ST) - 1) & 1);
                const uint32_t dA = sT + s * C::STAGE, dR = dA + C::A_BYTES, dS = dR + C::RAW_BYTES;
                // rows past the expert's end are zero-filled (copying none there, which leaves a
                // previous chunk's rows, measured 14 % slower on K3.1: see above)
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    const int row = a_row0 + 16 * i;
                    if ((i >> 2) < live_h)
                        cp_async16(dA + row * 128 + ((a_ch ^ (row & 7)) << 4),
                                   a.x + (size_t)src[i] * a.K + a_ch * 8 + j * WS_BK, (xok >> i) & 1);
                }
                wy_copy_raw(dR, dS, wq, wsw, j, tid);
                ws_arrive_cp(full + 8 * s);
            }
        }
        cp_commit();
        cp_wait<0>();  // nothing of this thread's is left in flight when it leaves
    } else {
        // ---------------------------------------------------------------- consumers: widen + wgmma
        asm volatile("setmaxnreg.inc.sync.aligned.u32 208;\n" ::: "memory");
        const int ct = tid - 128, wg = ct >> 7, lane = ct & 31, wwarp = (ct >> 5) & 3;
        const int g = lane >> 2, c = lane & 3;
        const int nr = ct >> 1, half = ct & 1;  // this thread's block of every chunk: B row nr, columns 32 half ..
        const bool m3 = GATEUP && nr >= 64;
        // the byte's place in its scale word: the scale offsets of a row and an expert are multiples of
        // 4 (K % 128 == 0, lunar_cuda_moe_experts_run), so only the matrix's base, j and half move it
        const uint32_t sel0 = ((uint32_t)(uintptr_t)(m3 ? a.ws[1] : a.ws[0]) + half) & 3;
        float acc0[64], acc1[64];
#pragma unroll
        for (int i = 0; i < 64; i++) acc0[i] = 0.0f, acc1[i] = 0.0f;
        int rel = 0;  // the first chunk whose stage this warp has not released yet
        auto release = [&]() {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + 8 * (rel % WY_ST));
            rel++;
        };
        int e_, r0, rend, n0;  // EPI: the next item's, looked up before the previous one's drain
        for (int li = 0, q = 0; li < items; li++) {
            if (!EPI || li == 0) item(li, e_, r0, rend, n0);
            const int m0 = r0 + 128 * wg, c_rend = rend, c_n0 = n0;  // this warpgroup's first token row
            // NW: this warpgroup's live 64-row halves (0: it only widens and meets the barriers).
            // Copies of the loop per NW rather than branches around the wgmma: a branch inside the
            // loop makes ptxas insert a warpgroup.arrive at the join (C7519)
            const int nw = m0 >= rend ? 0 : m0 + 64 >= rend ? 1 : 2;
            auto chunks = [&](auto nw_c) {
                constexpr int NW = decltype(nw_c)::value;
                for (int j = 0; j < J; j++, q++) {
                    const int s = q % WY_ST;
                    const uint32_t dA = sT + s * C::STAGE, dR = dA + C::A_BYTES, dS = dR + C::RAW_BYTES;
                    const uint32_t bT = sB + (q % 3) * C::B_BYTES;
                    mbar_wait(full + 8 * s, (q / WY_ST) & 1);
                    fence_async_smem();  // the producer's cp.async A pieces, published by the barrier
                    const uint32_t sw = lds32(dS + ct * 4);
                    const mxscale sc = mx_scale((sw >> (8 * ((sel0 + 2 * j) & 3))) & 0xffu);
                    const uint32_t row = bT + nr * 128;
                    const uint4 nib = lds128(dR + ct * 16);
                    auto put = [&](auto two_c) {
                        constexpr bool TWO = decltype(two_c)::value;
                        wy_put<TWO>(row, nr, half, 0, nib.x, sc);
                        wy_put<TWO>(row, nr, half, 1, nib.y, sc);
                        wy_put<TWO>(row, nr, half, 2, nib.z, sc);
                        wy_put<TWO>(row, nr, half, 3, nib.w, sc);
                    };
                    if (__any_sync(0xffffffffu, sc.two)) put(std::true_type());
                    else put(std::false_type());
                    fence_async_smem();  // this thread's widened row piece -> the wgmma
                    // BS: the previous item's staging in B buffers q + 1, q + 2 read by its bulk copies
                    // before this barrier lets chunk q + 1 widen (returns at once where none is pending)
                    if (BS) bulk_wait<0, true>();
                    asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the whole B tile written
                    if (NW > 0) {
                        wgmma_fence();
                        fence_acc<64>(acc0);
                        if (NW > 1) fence_acc<64>(acc1);
#pragma unroll
                        for (int kk = 0; kk < WS_BK / 16; kk++)
                            wgmma_m64n128<0>(acc0, ws_desc(dA + 128 * wg * 128 + kk * 32), ws_desc(bT + kk * 32),
                                             j > 0 || kk > 0);
                        if (NW > 1) {
#pragma unroll
                            for (int kk = 0; kk < WS_BK / 16; kk++)
                                wgmma_m64n128<0>(acc1, ws_desc(dA + (128 * wg + 64) * 128 + kk * 32),
                                                 ws_desc(bT + kk * 32), j > 0 || kk > 0);
                        }
                        wgmma_commit();
                        fence_acc<64>(acc0);
                        if (NW > 1) fence_acc<64>(acc1);
                        wgmma_wait<1>();  // chunk q - 1's products are done: its stage may be refilled
                    }
                    if (q - 1 >= rel) release();
                }
            };
            if (nw == 2) chunks(std::integral_constant<int, 2>());
            else if (nw == 1) chunks(std::integral_constant<int, 1>());
            else chunks(std::integral_constant<int, 0>());
            if (EPI && li + 1 < items) item(li + 1, e_, r0, rend, n0);  // its shared loads under the drain
            wgmma_wait<0>();
            fence_acc<64>(acc0);
            fence_acc<64>(acc1);
            while (rel < q) release();
            if (BS && a.yb) {
                // both warpgroups drained: no product reads the B buffers staged in below
                asm volatile("bar.sync 1, 256;\n" ::: "memory");
                const int cw = ct >> 5;  // consumer warp 0..7
                const uint32_t stg = cw < 3   ? sB + ((q + 1) % 3) * C::B_BYTES + cw * WB_WARP
                                     : cw < 6 ? sB + ((q + 2) % 3) * C::B_BYTES + (cw - 3) * WB_WARP
                                              : stgE + (cw - 6) * WB_WARP;
                wy_down_bulk(a, acc0, acc1, nw, m0, c_rend, c_n0, wwarp, g, lane, stg);
            } else if (!GATEUP && EPI) {
                wy_down_epilogue(a, acc0, acc1, nw, m0, c_rend, c_n0, wwarp, g, c);
            } else {
                if (nw > 0) moe_wg_epilogue<GATEUP, 64, true>(a, acc0, m0, c_rend, c_n0, wwarp, g, c);
                if (nw > 1) moe_wg_epilogue<GATEUP, 64, true>(a, acc1, m0 + 64, c_rend, c_n0, wwarp, g, c);
            }
        }
        if (BS) bulk_wait<0, false>();  // this thread's bulk copies complete before the block leaves
    }
}

// ---------------------------------------------------------------- path 25: the weights as wgmma's M
// Paths 14-24 put the tokens in wgmma's M and the widened weights in a shared B tile: at K3.1's 8K
// prefill an expert gets ~146 of 8192 x 16 / 896 rows, products are issued per live 64-row half
// (192 rows for 146), and every chunk the two consumer warpgroups widen their halves of the shared
// tile, fence, and meet at a 256-thread barrier before either may multiply (docs/benchmarks.md
// "MoE prefill, MXFP4 round 4", point (5)). Path 25 (LUNAR_MOE_PREFILL=wsmxm) turns the product
// around: D^T = W X^T, the weights as M (64 weight rows a warpgroup) and the item's tokens as N, a
// multiple of 32 picked per item (160 issued for 146 rows), with A from registers (wgmma's RS form):
// each consumer thread widens its own 2 weight rows x 16 columns of every 16-column step straight
// into the A fragment (mma.sync's m16n8k16 A layout: row g and g + 8 of its warp's 16, columns
// 2t, 2t + 1 and 8 + 2t, 9 + 2t), so no shared B tile, no widened stores, no proxy fence for them and
// no barrier between the warpgroups; the tokens' bf16 rows are the B operand, K-major in the
// 128-byte swizzle, exactly the A tile the producer of path 22 already copies (cp.async, rows
// gathered through row_token for gate/up, rows past the expert's end zero-filled, rows past N not
// copied at all).
// Widening: a thread's A fragment of a 32-column MXFP4 block (16 bytes: 4 words of 8 nibbles, word
// w = columns 8 w .. 8 w + 7) is byte t of each word (columns 8 w + 2t, + 1): the 4 bytes are
// gathered into one word (3 prmt), widened by pairs_mx as paths 2-24 do, and the pairs reordered
// (4 prmt) into words 0-3 = groups 0-3, i.e. a[0] / a[2] of the block's two 16-column steps; the
// four threads of a row read the same 16 bytes (one lds128 each, a broadcast).
// Gate/up: warpgroup w's 64 M rows are w1 and w3 rows interleaved 8 by 8 (rows 16 v + g: w1 row
// n0 + 32 w + 8 v + g, rows 16 v + 8 + g: the same row of w3), so each accumulator pair (row g,
// row g + 8) of a thread is the gate and the up of one output column, and SiTU (glu_act_fast, its
// clamp) runs in registers; an item is 64 output columns x up to WM_TM tokens (two warpgroups).
// Down: warpgroup w multiplies w2 rows n0 + 64 w .., an item 128 output columns x up to WM_TM
// tokens, the top-k row weight of each token applied in the epilogue (fp32 rows, or the bf16 rows
// of lunar_cuda_moe_experts_run_b). Epilogue stores: a thread holds one column for two tokens; a
// shuffle with the lane of the neighbouring column (g ^ 1) pairs two columns of one token, so each
// store writes 2 columns (bf16x2 or float2).
// Pipeline: the producer warpgroup is path 22's (a ring of WM_ST stages: the token tile, the 128
// weight rows' nibbles and scale words; 128 arrivals a chunk); the consumers wait `full`, widen,
// issue 4 RS products, commit, wgmma_wait<0> and release the chunk's stage: the fragments are
// registers the asynchronous products read, rewritten by the next chunk's widening. Double-buffered
// fragments with wgmma_wait<1> (the widening of chunk q + 1 under chunk q's products) were built
// first: ptxas serialized the products for want of registers (C7512, at 128 tokens a tile too), so
// a warpgroup widens while the other one's products run (no barrier couples the two). Items, their
// order and the per-expert token tiles are path 22's (the pair prefix scan, a persistent grid), with
// WM_TM tokens a tile instead of 256: ptxas compiles every role within the 168 registers of 384
// threads, and WM_TM / 2 accumulators + the 16 A registers + the nibbles must fit there (192: 4 bytes
// of spill, one value).
// Path 26 (LUNAR_MOE_PREFILL=wsmxg): path 25's gate/up with path 24's down kernel.
// Measured (H200, 8192 tokens, docs/benchmarks.md "MoE prefill, MXFP4 with the weights as M"): with
// balanced routing (~146 rows an expert) path 25's gate/up is 5 % (K3.1) / 9 % (TP8 slice) faster
// than path 24's, its down kernel 2-4 % slower (direct stores, no staging); with large experts (585
// or 2340 rows) its gate/up is 8 % slower (192-token tiles against 256: a third more widening a
// token, and each warpgroup's widening and products serialized). In the model (the TP8 slice's 8K
// prefill, 4 alternating rounds) path 26 ties with path 24 and path 25 is 1.5 % slower: both opt-in.
#define WM_TM 192  // tokens a tile (N <= 192: 96 accumulators a thread)
#define WM_ST 6    // ring stages of 29 KB (tokens 24 + nibbles 4 + scale words 1)

struct wm_cfg {
    static constexpr uint32_t A_BYTES = WM_TM * 128, RAW_BYTES = 128 * 32, SCW_BYTES = 128 * 2 * 4;
    static constexpr uint32_t STAGE = A_BYTES + RAW_BYTES + SCW_BYTES;
    static constexpr size_t smem() { return 1024 + (size_t)WM_ST * STAGE + 2 * WM_ST * 8 + (WY_MAX_E + 1) * 4; }
};

// this thread's A fragment words of one 32-column block of one weight row: byte t of each of the
// block's 4 words (nibbles: columns 8 w + 2t, 8 w + 2t + 1), widened; o[i] = group i's pair
template <bool TWO>
__device__ __forceinline__ void wm_frag(const uint4 &nib, uint32_t bsel, const mxscale &sc, uint32_t (&o)[4]) {
    const uint32_t word = prmt(prmt(nib.x, nib.y, bsel), prmt(nib.z, nib.w, bsel), 0x5410);
    uint32_t p[4];  // (x3, x7), (x2, x6), (x1, x5), (x0, x4)
    pairs_mx<TWO>(word, sc, p);
    o[0] = prmt(p[3], p[2], 0x5410), o[1] = prmt(p[1], p[0], 0x5410);
    o[2] = prmt(p[3], p[2], 0x7632), o[3] = prmt(p[1], p[0], 0x7632);
}

// MIX (gate/up): path 28's share (an expert's rest of 1..WX_REM rows after its full 256-row tiles, one
// item list), every thread waiting for the kernel before it (path 24's share) before it leaves
template <bool GATEUP, bool MIX = false>
__global__ void __launch_bounds__(WS_T, 1) moe_wm_kernel(const __grid_constant__ xargs a) {
    static_assert(WX_REM <= WM_TM, "MIX: the rest is one tile");
    static_assert(!MIX || GATEUP, "path 28 takes path 25's gate/up kernel");
    typedef wm_cfg C;
    static_assert(C::STAGE % 1024 == 0, "stages keep the token tiles 1024-byte aligned");
    constexpr int NH = GATEUP ? 64 : 128;  // output columns per item
    constexpr int NP = WM_TM / 16;         // token rows a producer thread copies (16 apart)
    extern __shared__ uint8_t ws_smem[];
    const uint32_t sT = (smem_u32(ws_smem) + 1023u) & ~1023u;  // stage s: tokens, nibbles, scale words
    const uint32_t full = sT + WM_ST * C::STAGE, empty = full + WM_ST * 8;
    int *pfx = (int *)(ws_smem + (empty + WM_ST * 8 - smem_u32(ws_smem)));  // [E + 1] tiles before expert e

    const int NN = a.R / NH, J = a.K / WS_BK;
    const int tid = threadIdx.x;
    for (int e = tid; e < a.E; e += WS_T) {
        const int rows = a.offsets[e + 1] - a.offsets[e], rest = rows % 256;
        pfx[e + 1] = MIX ? (rest > 0 && rest <= WX_REM) : (rows + WM_TM - 1) / WM_TM;
    }
    __syncthreads();
    if (tid < 32) pairs_scan_warp(pfx, a.E, tid);
    __syncthreads();
    const int total = pfx[a.E] * NN, G = gridDim.x, b = blockIdx.x;
    if (b >= total) {  // block-uniform, before any barrier
        if (MIX) mix_wait_primary();
        return;
    }
    const int items = (total - 1 - b) / G + 1;
    // item li: expert e, token rows r0 .. min(r0 + WM_TM, rend) of the permutation, weight rows from n0
    // (MIX: the rows after the expert's full 256-row tiles)
    auto item = [&](int li, int &e, int &r0, int &rend, int &n0) {
        const int w = b + li * G, pr = w / NN;
        e = pairs_expert(pfx, a.E, pr), rend = a.offsets[e + 1];
        r0 = MIX ? rend - (rend - a.offsets[e]) % 256 : a.offsets[e] + (pr - pfx[e]) * WM_TM;
        n0 = (w - pr * NN) * NH;
    };
    // the tokens issued as N: the live rows rounded up to 32
    auto n_of = [](int r0, int rend) { return (min(WM_TM, rend - r0) + 31) & ~31; };
    if (tid == 0) ws_ring_init(full, empty, WM_ST, 128, 8);
    __syncthreads();

    if (tid < 128) {
        // ---------------------------------------------------------------- producer: copies only (path 22's)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 88;\n" ::: "memory");
        const int a_ch = tid & 7, a_row0 = tid >> 3;  // token piece i: row a_row0 + 16 i, 16-byte chunk a_ch
        const size_t estr = (size_t)a.R * a.K;
        for (int li = 0, q = 0; li < items; li++) {
            int e, r0, rend, n0;
            item(li, e, r0, rend, n0);
            const int nt = n_of(r0, rend);
            int src[NP];
            const uint32_t xok = wy_a_rows<GATEUP>(a, r0, rend, a_row0, src);  // live rows
            uint32_t xon = 0;  // rows the products read (< nt)
#pragma unroll
            for (int i = 0; i < NP; i++) xon |= (uint32_t)(a_row0 + 16 * i < nt) << i;
            // this thread's 2 blocks: row nr = u / 2 of the raw tile, half u % 2. GATEUP: row nr of
            // warpgroup nr / 64's 64 interleaves w1 / w3 by 8 rows (the consumers' note above)
            const uint8_t *wq[2], *wsw[2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int u = tid + 128 * i, nr = u >> 1, half = u & 1;
                const bool m3 = GATEUP && ((nr >> 3) & 1);
                const int wr = GATEUP ? 32 * (nr >> 6) + 8 * ((nr >> 4) & 3) + (nr & 7) : nr;
                const size_t base = (size_t)e * estr + (size_t)(n0 + wr) * a.K;
                wq[i] = (m3 ? a.wq[1] : a.wq[0]) + base / 2 + half * 16;
                wsw[i] = (m3 ? a.ws[1] : a.ws[0]) + base / 32 + half;
            }
            for (int j = 0; j < J; j++, q++) {
                const int s = q % WM_ST;
                if (q >= WM_ST) mbar_wait(empty + 8 * s, ((q / WM_ST) - 1) & 1);
                const uint32_t dA = sT + s * C::STAGE, dR = dA + C::A_BYTES, dS = dR + C::RAW_BYTES;
#pragma unroll
                for (int i = 0; i < NP; i++) {
                    const int row = a_row0 + 16 * i;
                    if ((xon >> i) & 1)
                        cp_async16(dA + row * 128 + ((a_ch ^ (row & 7)) << 4),
                                   a.x + (size_t)src[i] * a.K + a_ch * 8 + j * WS_BK, (xok >> i) & 1);
                }
                wy_copy_raw(dR, dS, wq, wsw, j, tid);
                ws_arrive_cp(full + 8 * s);
            }
        }
        cp_commit();
        cp_wait<0>();
    } else {
        // ---------------------------------------------------------------- consumers: widen into A, wgmma RS
        asm volatile("setmaxnreg.inc.sync.aligned.u32 208;\n" ::: "memory");
        const int ct = tid - 128, wg = ct >> 7, lane = ct & 31, wwarp = (ct >> 5) & 3;
        const int g = lane >> 2, c = lane & 3;
        const int rA = 64 * wg + 16 * wwarp + g;  // this thread's raw tile rows rA, rA + 8
        // the scale byte's place in its word: a row's and an expert's scale offsets are multiples of
        // 4 (K % 128 == 0), so only the matrix's base, j and the half move it. GATEUP: row rA is w1's, rA + 8 w3's
        const uint32_t selA = (uint32_t)(uintptr_t)a.ws[0] & 3, selB = (uint32_t)(uintptr_t)a.ws[GATEUP ? 1 : 0] & 3;
        const uint32_t bsel = (uint32_t)c | ((uint32_t)(c + 4) << 4);  // byte c of two words
        float acc[WM_TM / 2];
        uint32_t af[4][4];  // the A fragments of a chunk: [16-column step][register]
#pragma unroll
        for (int i = 0; i < WM_TM / 2; i++) acc[i] = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) af[i / 4][i % 4] = 0u;
        int rel = 0;                    // the first chunk whose stage this warp has not released yet
        auto release = [&]() {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + 8 * (rel % WM_ST));
            rel++;
        };
        // chunk q (column chunk j) into the fragments af, then N's products, waited for before the
        // next chunk rewrites af (wgmma_wait<0>: the other warpgroup's products overlap this one's widening)
        auto chunk = [&](auto n_c, int j, int q) {
            constexpr int N = decltype(n_c)::value;
            const int s = q % WM_ST;
            const uint32_t dA = sT + s * C::STAGE, dR = dA + C::A_BYTES, dS = dR + C::RAW_BYTES;
            mbar_wait(full + 8 * s, (q / WM_ST) & 1);
            fence_async_smem();  // the producer's cp.async token rows, published by the barrier
            uint32_t sw[4];      // scale words: row rA half 0, 1; row rA + 8 half 0, 1
            sw[0] = lds32(dS + (2 * rA) * 4), sw[1] = lds32(dS + (2 * rA + 1) * 4);
            sw[2] = lds32(dS + (2 * rA + 16) * 4), sw[3] = lds32(dS + (2 * rA + 17) * 4);
            mxscale sc[4];
#pragma unroll
            for (int i = 0; i < 4; i++)
                sc[i] = mx_scale((sw[i] >> (8 * (((i < 2 ? selA : selB) + 2 * j + (i & 1)) & 3))) & 0xffu);
            auto widen = [&](auto two_c) {
                constexpr bool TWO = decltype(two_c)::value;
#pragma unroll
                for (int h = 0; h < 2; h++) {  // block h of the chunk: 16-column steps 2h, 2h + 1
#pragma unroll
                    for (int r = 0; r < 2; r++) {  // row rA + 8 r: fragment register r (+ 2)
                        const uint4 nib = lds128(dR + (2 * (rA + 8 * r) + h) * 16);
                        uint32_t o[4];
                        wm_frag<TWO>(nib, bsel, sc[2 * r + h], o);
                        af[2 * h][r] = o[0], af[2 * h][r + 2] = o[1];
                        af[2 * h + 1][r] = o[2], af[2 * h + 1][r + 2] = o[3];
                    }
                }
            };
            if (__any_sync(0xffffffffu, sc[0].two || sc[1].two || sc[2].two || sc[3].two)) widen(std::true_type());
            else widen(std::false_type());
            wgmma_fence();
            fence_acc<N / 2>(acc);
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wgmma_rs_bf16<N>(acc, af[kk], ws_desc(dA + kk * 32), j > 0 || kk > 0);
            wgmma_commit();
            fence_acc<N / 2>(acc);
            wgmma_wait<0>();  // this chunk's products are done: its stage and the fragments are free
            release();
        };
        int e_, r0, rend, n0;  // the next item's, looked up before the previous one's drain
        for (int li = 0, q = 0; li < items; li++) {
            if (li == 0) item(li, e_, r0, rend, n0);
            const int c_r0 = r0, c_rend = rend, c_n0 = n0, nt = n_of(r0, rend);
            auto run = [&](auto n_c) {
                constexpr int N = decltype(n_c)::value;
                for (int j = 0; j < J; j++, q++) chunk(n_c, j, q);
                if (li + 1 < items) item(li + 1, e_, r0, rend, n0);
                const int live = min(WM_TM, c_rend - c_r0);
                // token 8 jj + 2c (+ 1) of the item: accumulators 4 jj (+ 1) row rA, 4 jj + 2 (+ 1) row rA + 8
                const bool odd = g & 1;
#pragma unroll
                for (int jj = 0; jj < N / 8; jj++) {
                    const int ta = 8 * jj + 2 * c, tb = ta + 1;
                    const float *v = acc + 4 * jj;
                    if constexpr (GATEUP) {
                        const float ha = glu_act_fast(v[0], v[2], a.act, a.beta, a.beta_l);
                        const float hb = glu_act_fast(v[1], v[3], a.act, a.beta, a.beta_l);
                        // even g: token ta, columns g, g + 1; odd g: token tb, columns g - 1, g
                        const float got = __shfl_xor_sync(0xffffffffu, odd ? ha : hb, 4);
                        const int t = odd ? tb : ta, col = c_n0 + 32 * wg + 8 * wwarp + (g & ~1);
                        if (t < live)
                            *(__nv_bfloat162 *)(a.h + (size_t)(c_r0 + t) * a.R + col) =
                                odd ? __floats2bfloat162_rn(got, hb) : __floats2bfloat162_rn(ha, got);
                    } else {
                        const float wa = ta < live ? __ldg(a.row_weight + c_r0 + ta) : 0.0f;
                        const float wb = tb < live ? __ldg(a.row_weight + c_r0 + tb) : 0.0f;
#pragma unroll
                        for (int r = 0; r < 2; r++) {  // row rA + 8 r: output column n0 + rA + 8 r
                            const float xa = v[2 * r] * wa, xb = v[2 * r + 1] * wb;
                            const float got = __shfl_xor_sync(0xffffffffu, odd ? xa : xb, 4);
                            const int t = odd ? tb : ta, col = c_n0 + rA + 8 * r - (g & 1);
                            const float lo = odd ? got : xa, hi = odd ? xb : got;
                            if (t >= live) continue;
                            if (a.yb) *(__nv_bfloat162 *)(a.yb + (size_t)(c_r0 + t) * a.R + col) = __floats2bfloat162_rn(lo, hi);
                            else *(float2 *)(a.y + (size_t)(c_r0 + t) * a.R + col) = make_float2(lo, hi);
                        }
                    }
                }
            };
            switch (nt >> 5) {
            case 1: run(std::integral_constant<int, 32>()); break;
            case 2: run(std::integral_constant<int, 64>()); break;
            case 3: run(std::integral_constant<int, 96>()); break;
            case 4: run(std::integral_constant<int, 128>()); break;
            case 5: run(std::integral_constant<int, WM_TM < 160 ? WM_TM : 160>()); break;
            default: run(std::integral_constant<int, WM_TM>()); break;
            }
        }
    }
    if (MIX) mix_wait_primary();  // this kernel completes only after path 24's share (the note at WX_REM)
}

// ---------------------------------------------------------------- launchers

// [rows, K] bf16 weights as a 2-D tensor with 64-column x 128-row boxes in the 128-byte swizzle.
// false: no driver entry point or the map was refused.
static bool ws_tmap(CUtensorMap *m, const uint16_t *w, long rows, int K) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = lunar_tmap_encoder();
    if (!fn || !w) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)K * 2};
    const cuuint32_t box[2] = {WS_BK, 128}, es[2] = {1, 1};
    return fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<uint16_t *>(w), dims, strides, box, es,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

#define WS_MAX_DEV 64
template <bool MX, bool GATEUP, int CL, int PF, bool DYN = false>
static bool ws_launch(const xargs &a, int tiles, cudaStream_t st) {
    CUtensorMap t0, t1;
    memset(&t0, 0, sizeof t0), memset(&t1, 0, sizeof t1);
    if (!MX) {
        const long rows = (long)a.E * a.R;
        if (!ws_tmap(&t0, a.wb[0], rows, a.K)) return false;
        if (!GATEUP) t1 = t0;  // DOWN: the second 128 rows of the same matrix
        else if (!ws_tmap(&t1, a.wb[1], rows, a.K)) return false;
    }
    // CL: + the pair prefix array; sized for the largest expert count once (the attribute is set once)
    // CL = 2 packs the pair and single-tile counts into 16 bits each (tiles <= n k / 128 + E)
    CUDA_REQUIRE(!CL || a.E <= 1024);
    CUDA_REQUIRE(CL < 2 || tiles < 65536);
    // DYN: the stages' item words and the producers' two next-item words
    const size_t smem = ws_cfg::smem(MX) + (CL ? 1025 * 4 : 0) + (DYN ? (WS_ST + 2) * 4 : 0);
    static bool attr[WS_MAX_DEV];
    static int sms[WS_MAX_DEV];  // blocks that run at once: SMs, or CL: 2 x the clusters that fit
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_REQUIRE(dev >= 0 && dev < WS_MAX_DEV);
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute cl[1];
    cl[0].id = cudaLaunchAttributeClusterDimension;
    cl[0].val.clusterDim.x = 2, cl[0].val.clusterDim.y = 1, cl[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(WS_T), cfg.dynamicSmemBytes = smem, cfg.stream = st;
    cfg.attrs = cl, cfg.numAttrs = CL ? 1 : 0;
    if (!attr[dev]) {  // per device: the dynamic shared-memory limit is raised on the current one
        CUDA_CHECK(cudaFuncSetAttribute(moe_ws_kernel<MX, GATEUP, CL, PF, DYN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev));
        if (CL) {
            int nc = 0;
            cfg.gridDim = dim3(2 * sms[dev]);
            CUDA_CHECK(cudaOccupancyMaxActiveClusters(&nc, moe_ws_kernel<MX, GATEUP, CL, PF, DYN>, &cfg));
            if (nc <= 0) return false;  // (attr stays unset: asked again, refused again)
            // LUNAR_MOE_WSMC_CLUSTERS=c (path 17, opt-in, measurement only): c clusters instead of the
            // occupancy query's count, to test whether the query leaves SMs idle (path 7 and 17 measured
            // 30-40 % slower than their one-block kernels, even path 7 without copies)
            const char *ov = CL >= 2 ? getenv("LUNAR_MOE_WSMC_CLUSTERS") : NULL;
            if (ov) fprintf(stderr, "path 17: the occupancy query's clusters %d, set %s\n", nc, ov);
            if (ov && atoi(ov) > 0) nc = atoi(ov);
            sms[dev] = 2 * nc;
        }
        attr[dev] = true;
    }
    // an upper bound of the items (CL: of the pairs of tiles x N tiles); blocks without one leave
    const long items = (long)tiles * (a.R / (GATEUP ? WS_BN / 2 : WS_BN)) * (CL ? 2 : 1);
    const int grid = items < sms[dev] ? (int)items : sms[dev];
    if (grid <= 0) return true;
    cfg.gridDim = dim3(grid);
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_ws_kernel<MX, GATEUP, CL, PF, DYN>, a, t0, t1));
    return true;
}

// Path 14: a persistent grid, at most one block an SM walking `items` work items (an upper
// bound: blocks without one leave), the kernel's dynamic shared memory raised once per device
// PDL: launched with the programmatic-serialization attribute (path 28's second kernel; not
// where LUNAR_CUDA_PDL=0), so its blocks may start as the stream predecessor's blocks leave
template <void (*KERNEL)(xargs)>
static bool ws_persistent(const xargs &a, long items, size_t smem, cudaStream_t st, bool pdl = false) {
    static bool attr[WS_MAX_DEV];
    static int sms[WS_MAX_DEV];
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_REQUIRE(dev >= 0 && dev < WS_MAX_DEV);
    if (!attr[dev]) {  // per device: the dynamic shared-memory limit is raised on the current one
        CUDA_CHECK(cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev));
        attr[dev] = true;
    }
    const int grid = items < sms[dev] ? (int)items : sms[dev];
    if (grid <= 0) return true;
    if (pdl) launch_pdl(KERNEL, dim3(grid), dim3(WS_T), smem, st, a);
    else KERNEL<<<grid, WS_T, smem, st>>>(a);
    CUDA_CHECK_LAUNCH();
    return true;
}
template <bool GATEUP, bool EPI, bool BS = false, bool MIX = false, bool HALF = false>
static bool wy_launch(const xargs &a, int tiles, cudaStream_t st) {
    if (a.E > WY_MAX_E) return false;  // the caller runs path 4
    // an upper bound of the items (pairs of M tiles <= tiles)
    return ws_persistent<moe_wy_kernel<GATEUP, EPI, BS, MIX, HALF>>(a, (long)tiles * (a.R / (GATEUP ? 64 : 128)),
                                                                    wy_cfg::smem(BS), st);
}

// path 25: an upper bound of the items (token tiles of WM_TM <= tiles of 128); MIX: the second
// kernel of path 28's gate/up, launched with PDL's attribute
template <bool GATEUP, bool MIX = false> static bool wm_launch(const xargs &a, int tiles, cudaStream_t st) {
    return ws_persistent<moe_wm_kernel<GATEUP, MIX>>(a, (long)tiles * (a.R / (GATEUP ? 64 : 128)), wm_cfg::smem(),
                                                     st, MIX);
}

// (cuda_moe.cuh) mode 6: path 14, MXFP4 only (moe_wy_kernel: items of 256 token rows x 128 weight
// rows, gate/up R % 64, down R % 128); mode 14: path 22 (its variant with the down epilogue's row
// weights loaded once and the next item looked up before the drain); mode 16: path 24 (22 with the
// bf16 down rows staged in shared memory and written by bulk copies); modes 17, 18: paths 25, 26;
// mode 20: path 28 (24 or 25 per item in the gate/up, 24's down); mode 24: path 32 (28 whose down
// kernel copies no A rows of dead halves); false where the shapes do not
// fit it. mid (or NULL): recorded on st between the gate/up and the down launch of these modes (the
// benchmark's per-kernel times). Mode 21: path 29, BF16 only, path 12's two kernels taking their items
// from a global counter (MXFP4: path 6)
bool moe_ws_experts(const xargs &g, const xargs &d, bool mx, int tiles, int mode, cudaStream_t st, cudaEvent_t mid) {
    // paths 14, 22: 64 columns of w1 and of w3 per gate/up item, 128 rows of w2 per down item
    // path 24 (mode 16): path 22's gate/up, its down kernel writing bf16 rows by bulk copies
    // paths 25, 26 (modes 17, 18): the weights as M, 64 output columns a gate/up item, 128 a down item;
    // 26 runs path 24's down kernel (22's with fp32 rows)
    // path 28 (mode 20): the gate/up's full 256-row tiles of each expert by path 24's kernel, its rest
    // of 1..WX_REM rows by path 25's (the note at WX_REM); the down GEMM path 24's
    // path 32 (mode 24): path 28 whose down kernel copies no A rows of dead 64-row halves
    if (mx && (mode == 20 || mode == 24)) {
        if (g.R % 64 || g.K % WS_BK || d.R % 128 || d.K % WS_BK || g.E > WY_MAX_E) return false;
        bool ok = wy_launch<true, true, false, true>(g, tiles, st) && wm_launch<true, true>(g, tiles, st);
        if (mid) CUDA_CHECK(cudaEventRecord(mid, st));
        return ok && (mode == 24 ? wy_launch<false, true, true, false, true>(d, tiles, st)
                                 : wy_launch<false, true, true>(d, tiles, st));
    }
    if (mx && (mode == 17 || mode == 18)) {
        if (g.R % 64 || g.K % WS_BK || d.R % 128 || d.K % WS_BK || g.E > WY_MAX_E) return false;
        bool ok = wm_launch<true>(g, tiles, st);
        if (mid) CUDA_CHECK(cudaEventRecord(mid, st));
        ok = ok && (mode == 17 ? wm_launch<false>(d, tiles, st) : wy_launch<false, true, true>(d, tiles, st));
        return ok;
    }
    if (mx && (mode == 6 || mode == 14 || mode == 16)) {
        if (g.R % 64 || g.K % WS_BK || d.R % 128 || d.K % WS_BK || g.E > WY_MAX_E) return false;
        const bool epi = mode != 6;
        bool ok = epi ? wy_launch<true, true>(g, tiles, st) : wy_launch<true, false>(g, tiles, st);
        if (mid) CUDA_CHECK(cudaEventRecord(mid, st));
        ok = ok && (mode == 16 ? wy_launch<false, true, true>(d, tiles, st)
                    : epi      ? wy_launch<false, true>(d, tiles, st)
                               : wy_launch<false, false>(d, tiles, st));
        return ok;
    }
    // 128 columns of w1 and of w3 per gate/up item, 256 rows of w2 per down item
    if (g.R % 128 || g.K % WS_BK || d.R % 256 || d.K % WS_BK) return false;
    if (mx)
        return ws_launch<true, true, 0, 0>(g, tiles, st) && ws_launch<true, false, 0, 0>(d, tiles, st);
    if (mode == 1)
        return ws_launch<false, true, 1, 0>(g, tiles, st) && ws_launch<false, false, 1, 0>(d, tiles, st);
    if (mode == 9)  // path 17: the down epilogue has no activation (as mode 4)
        return ws_launch<false, true, 2, 3>(g, tiles, st) && ws_launch<false, false, 2, 0>(d, tiles, st);
    if (mode == 10)  // path 18: path 17 with the CTA-scope remote releases
        return ws_launch<false, true, 3, 3>(g, tiles, st) && ws_launch<false, false, 3, 0>(d, tiles, st);
    if (mode == 2)
        return ws_launch<false, true, 0, 2>(g, tiles, st) && ws_launch<false, false, 0, 2>(d, tiles, st);
    if (mode == 3)
        return ws_launch<false, true, 0, 1>(g, tiles, st) && ws_launch<false, false, 0, 1>(d, tiles, st);
    if (mode == 21) {  // path 29: path 12's kernels taking their items from a counter (mid: the bench's split)
        if (!ws_launch<false, true, 0, 3, true>(g, tiles, st)) return false;
        if (mid) CUDA_CHECK(cudaEventRecord(mid, st));
        return ws_launch<false, false, 0, 0, true>(d, tiles, st);
    }
    if (mode == 4)  // the down epilogue has no activation: path 6's down kernel
        return ws_launch<false, true, 0, 3>(g, tiles, st) && ws_launch<false, false, 0, 0>(d, tiles, st);
    // path 6 only: a mode no branch above knows is the caller's mistake (session 13's merge renumbered
    // path 29 without its mode, and BF16's default silently ran path 6 until session 14)
    CUDA_REQUIRE(mode == 0);
    return ws_launch<false, true, 0, 0>(g, tiles, st) && ws_launch<false, false, 0, 0>(d, tiles, st);
}
