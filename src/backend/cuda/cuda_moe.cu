// Latent MoE on the GPU: the expert-contiguous permutation (the router and the batch-1 route are
// in cuda_router.cu), the experts (MXFP4 or BF16 weights) as a memory-bound decode kernel (n <= 64 tokens) and a
// grouped GEMM (prefill), the slot-ordered combine and the whole latent routed path.
//
// MXFP4 -> bf16 in registers (both kernels). A 32-bit word holds 8 E2M1 nibbles n0..n7 (n0 in
// bits 0-3 = input column 0). With q the word shifted left by 4p (p = 0..3),
//   (q & 0x80008000) | ((q & 0x70007000) >> 6)
// is a bf16x2 holding nibbles n(3-p) (low half) and n(7-p) (high half) with the sign in bit 15 and
// E1 E0 M in bits 8..6, i.e. the value E2M1 * 2^-126 (E = 0 lands in the bf16 subnormals, still
// exact). One bf16x2 multiply by 2^(s-1) (two when s > 128) gives E2M1 * 2^(s-127) exactly: every
// widened weight equals the CPU's dequantised fp32 weight. The pair order inside each 8-column
// group is therefore P0 = (x3, x7), P1 = (x2, x6), P2 = (x1, x5), P3 = (x0, x4); the activations
// are put in the same order (prmt) so that a thread's logical mma k pairs meet the same columns of
// both operands (a dot product does not care which physical column each logical k holds).
//
// Fragment ownership (mma.m16n8k16, g = lane / 4, c = lane % 4): per chunk of 128 columns (4 scale
// blocks), thread c owns block c of the chunk; mma q (0..7) of the chunk uses word q/2 of that
// block, pairs P(2(q&1)) at logical k (2c, 2c+1) and P(2(q&1)+1) at (2c+8, 2c+9).
#include <stdlib.h>
#include <string.h>

#include <cub/block/block_scan.cuh>

#include "backend/cuda/cuda_moe.cuh"

// ---------------------------------------------------------------- permutation

static int max_tiles(int n, int k, int E) {
    int rows = n * k;
    return (rows + LUNAR_CUDA_MOE_BM - 1) / LUNAR_CUDA_MOE_BM + (E < rows ? E : rows);
}
static size_t al256(size_t b) { return (b + 255) / 256 * 256; }

extern "C" size_t lunar_cuda_moe_route_bytes(int n, int k, int E) {
    size_t p = (size_t)n * k, g = (size_t)max_groups(n, k, E);
    return al256(p * 4) * 2 + al256((E + 2) * 4) + al256(p * 4) * 3 + al256(E * 4) +
           al256((size_t)max_tiles(n, k, E) * 8) + al256(g * 8) + al256(g * 4 + 4) + al256((E + 3) * 4) +
           al256(E * 4);
}

extern "C" void lunar_cuda_moe_route_init(lunar_cuda_moe_route *r, void *ws, int n, int k, int E) {
    char *p = (char *)ws;
    size_t np = (size_t)n * k;
#define TAKE(field, T, bytes) (r->field = (T *)p, p += al256(bytes))
    r->n = n, r->k = k, r->E = E, r->settled = 0;
    TAKE(experts, int32_t, np * 4);
    TAKE(weights, float, np * 4);
    TAKE(offsets, int32_t, (E + 2) * 4);
    TAKE(row_token, int32_t, np * 4);
    TAKE(row_weight, float, np * 4);
    TAKE(pair_row, int32_t, np * 4);
    TAKE(active, int32_t, E * 4);
    TAKE(tiles, int32_t, (size_t)max_tiles(n, k, E) * 8);
    TAKE(groups, int32_t, (size_t)max_groups(n, k, E) * 8);
    TAKE(gdone, int32_t, ((size_t)max_groups(n, k, E) + 1) * 4);  // + the fused kernel's exit count
    TAKE(counts, int32_t, (E + 3) * 4);
    TAKE(cursor, int32_t, E * 4);
#undef TAKE
}

__global__ void moe_count_kernel(int32_t *counts, const int32_t *experts, int np) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < np) atomicAdd(&counts[experts[i]], 1);
}

#define SCAN_T 1024
#define SCAN_IPT 4
// Both scan kernels' first half: thread t's experts SCAN_IPT t .. + SCAN_IPT - 1, their counts,
// whether active, their 128-row tiles and decode groups, and the four exclusive scans over the
// experts with their totals (rows, active experts, tiles, groups).
struct moe_scan_parts {
    int cnt[SCAN_IPT], act[SCAN_IPT], til[SCAN_IPT], grp[SCAN_IPT];
    int off[SCAN_IPT], aoff[SCAN_IPT], toff[SCAN_IPT], goff[SCAN_IPT], tot, atot, ttot, gtot;
};
typedef cub::BlockScan<int, SCAN_T> moe_block_scan;

__device__ __forceinline__ void moe_scan_counts(const lunar_cuda_moe_route &r, moe_block_scan::TempStorage &tmp,
                                                moe_scan_parts &p) {
    const int E = r.E, base = threadIdx.x * SCAN_IPT;
    for (int i = 0; i < SCAN_IPT; i++) {
        int e = base + i;
        p.cnt[i] = e < E ? r.counts[e] : 0;
        p.act[i] = p.cnt[i] > 0;
        p.til[i] = (p.cnt[i] + LUNAR_CUDA_MOE_BM - 1) / LUNAR_CUDA_MOE_BM;
        p.grp[i] = (p.cnt[i] + DEC_G - 1) / DEC_G;
    }
    moe_block_scan(tmp).ExclusiveSum(p.cnt, p.off, p.tot);
    __syncthreads();
    moe_block_scan(tmp).ExclusiveSum(p.act, p.aoff, p.atot);
    __syncthreads();
    moe_block_scan(tmp).ExclusiveSum(p.til, p.toff, p.ttot);
    __syncthreads();
    moe_block_scan(tmp).ExclusiveSum(p.grp, p.goff, p.gtot);
}

// One block: offsets (exclusive scan of counts), cursors, the active list, the tile list and the
// decode group list with its zeroed completion counters (written here, so the fused decode
// kernel needs no memset of its own).
__global__ void __launch_bounds__(SCAN_T) moe_scan_kernel(lunar_cuda_moe_route r) {
    __shared__ moe_block_scan::TempStorage tmp;
    moe_scan_parts p;
    moe_scan_counts(r, tmp, p);
    const int E = r.E, base = threadIdx.x * SCAN_IPT;
    for (int i = 0; i < SCAN_IPT; i++) {
        int e = base + i;
        if (e >= E) break;
        r.offsets[e] = p.off[i];
        r.cursor[e] = p.off[i];
        if (p.act[i]) r.active[p.aoff[i]] = e;
        for (int tt = 0; tt < p.til[i]; tt++) {
            r.tiles[2 * (p.toff[i] + tt)] = e;
            r.tiles[2 * (p.toff[i] + tt) + 1] = p.off[i] + tt * LUNAR_CUDA_MOE_BM;
        }
        for (int gg = 0; gg < p.grp[i]; gg++) {
            r.groups[2 * (p.goff[i] + gg)] = e;
            r.groups[2 * (p.goff[i] + gg) + 1] = p.off[i] + gg * DEC_G;
            r.gdone[p.goff[i] + gg] = 0;
        }
    }
    if (threadIdx.x == 0) {
        r.offsets[E] = p.tot;
        r.counts[E] = p.atot;
        r.counts[E + 1] = p.ttot;
        r.counts[E + 2] = p.gtot;
        r.gdone[max_groups(r.n, r.k, E)] = 0;
    }
}

__global__ void moe_scatter_kernel(lunar_cuda_moe_route r) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= r.n * r.k) return;
    int e = r.experts[i];
    // the weight loaded with the expert id, before the atomic and the stores: loaded after the
    // row_token store (which the compiler must assume may alias r.weights), it was a second dependent
    // round trip after the atomic's (this runs at every n > 1: decode B >= 2 and prefill)
    const float w = r.weights[i];
    int pos = atomicAdd(&r.cursor[e], 1);
    r.row_token[pos] = i / r.k;
    r.row_weight[pos] = w;
    r.pair_row[i] = pos;
}

// ---- the prefill permutation (session 12, issue 9): the same route in three shorter launches.
// Nsight Compute on the Kimi-Linear 8K prefill (65536 pairs over 256 experts; docs/benchmarks.md
// "Prefill 8K, round 5"): count 19 us, scan 28 us, scatter 21 us a MoE layer, ~68 us of the critical
// path between the router and the experts, 1.8 ms of the prefill; these kernels 3.1 / 7.9 / 11.7 us
// (the profiled router family 3.26-3.30 -> 2.00-2.09 ms a prefill, the same call). Count and scatter made 65536
// global atomics on 256 addresses (256 same-address atomics each, serialised at L2); the scan's
// threads each wrote the tile and decode-group lists of their 4 experts in a serial loop (32 groups
// an expert at 256 rows: 128 iterations a thread while 960 of the 1024 threads idle). Here:
//  - count: a block's PERM_IPT x PERM_T pairs counted in a shared-memory histogram, then one global
//    atomic per expert the block saw (16 blocks x 256 at 8K instead of 65536);
//  - scan: the same four block scans, then the lists written by warps, one expert a warp at a time,
//    its tiles and groups one a lane: every field the same value at the same address as
//    moe_scan_kernel (the decode-group list too, which only decode kernels read, so that no path
//    sees a different route);
//  - scatter: each pair's rank among the block's pairs of its expert from a shared-memory atomic,
//    one global atomic per expert the block saw reserving the block's run of the expert's rows, so a
//    pair's row = the run's start + its rank. Within an expert the rows' order is as arbitrary as
//    the single-atomic scatter's (the order in which atomics land); every consumer reads a row
//    through row_token / pair_row, and the products of a row do not depend on its neighbours.
// Used from 65 tokens (prefill rows) and E <= PSCAN_E; decode steps keep the kernels above.
// LUNAR_MOE_PERMUTE=old: the kernels above everywhere (A/B).
#define PERM_T 512
#define PERM_IPT 8  // pairs a thread: a block takes 4096
#define PSCAN_E 1024
__global__ void __launch_bounds__(PERM_T) moe_count_smem_kernel(int32_t *counts, const int32_t *experts, int np,
                                                                 int E) {
    __shared__ int hist[PSCAN_E];
    for (int e = threadIdx.x; e < E; e += PERM_T) hist[e] = 0;
    __syncthreads();
    const int i0 = blockIdx.x * (PERM_T * PERM_IPT) + threadIdx.x;
    int ex[PERM_IPT];
#pragma unroll
    for (int j = 0; j < PERM_IPT; j++) ex[j] = i0 + j * PERM_T < np ? experts[i0 + j * PERM_T] : -1;  // loads in flight together
#pragma unroll
    for (int j = 0; j < PERM_IPT; j++)
        if (ex[j] >= 0) atomicAdd(&hist[ex[j]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += PERM_T)
        if (hist[e]) atomicAdd(&counts[e], hist[e]);
}

__global__ void __launch_bounds__(SCAN_T) moe_scan_warps_kernel(lunar_cuda_moe_route r) {
    __shared__ moe_block_scan::TempStorage tmp;
    __shared__ int s_off[PSCAN_E], s_toff[PSCAN_E], s_goff[PSCAN_E], s_cnt[PSCAN_E];
    moe_scan_parts p;
    moe_scan_counts(r, tmp, p);
    const int E = r.E, base = threadIdx.x * SCAN_IPT;
    for (int i = 0; i < SCAN_IPT; i++) {
        int e = base + i;
        if (e >= E) break;
        r.offsets[e] = p.off[i];
        r.cursor[e] = p.off[i];
        if (p.act[i]) r.active[p.aoff[i]] = e;
        s_off[e] = p.off[i], s_toff[e] = p.toff[i], s_goff[e] = p.goff[i], s_cnt[e] = p.cnt[i];
    }
    if (threadIdx.x == 0) {
        r.offsets[E] = p.tot;
        r.counts[E] = p.atot;
        r.counts[E + 1] = p.ttot;
        r.counts[E + 2] = p.gtot;
        r.gdone[max_groups(r.n, r.k, E)] = 0;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int e = threadIdx.x >> 5; e < E; e += SCAN_T / 32) {
        const int c = s_cnt[e], o = s_off[e], t0 = s_toff[e], g0 = s_goff[e];
        const int nt = (c + LUNAR_CUDA_MOE_BM - 1) / LUNAR_CUDA_MOE_BM, ng = (c + DEC_G - 1) / DEC_G;
        for (int tt = lane; tt < nt; tt += 32)
            *(int2 *)(r.tiles + 2 * (t0 + tt)) = make_int2(e, o + tt * LUNAR_CUDA_MOE_BM);
        for (int gg = lane; gg < ng; gg += 32) {
            *(int2 *)(r.groups + 2 * (g0 + gg)) = make_int2(e, o + gg * DEC_G);
            r.gdone[g0 + gg] = 0;
        }
    }
}

__global__ void __launch_bounds__(PERM_T) moe_scatter_smem_kernel(lunar_cuda_moe_route r) {
    __shared__ int hist[PSCAN_E];
    const int E = r.E, np = r.n * r.k;
    for (int e = threadIdx.x; e < E; e += PERM_T) hist[e] = 0;
    __syncthreads();
    const int i0 = blockIdx.x * (PERM_T * PERM_IPT) + threadIdx.x;
    int ex[PERM_IPT], rk[PERM_IPT];
    float w[PERM_IPT];
#pragma unroll
    for (int j = 0; j < PERM_IPT; j++) {
        const int i = i0 + j * PERM_T;
        ex[j] = i < np ? r.experts[i] : -1;
        w[j] = i < np ? r.weights[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < PERM_IPT; j++) rk[j] = ex[j] >= 0 ? atomicAdd(&hist[ex[j]], 1) : 0;
    __syncthreads();
    // hist[e] becomes the start of this block's run of expert e's rows
    for (int e = threadIdx.x; e < E; e += PERM_T)
        if (hist[e]) hist[e] = atomicAdd(&r.cursor[e], hist[e]);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < PERM_IPT; j++) {
        const int i = i0 + j * PERM_T;
        if (ex[j] < 0) continue;
        const int pos = hist[ex[j]] + rk[j];
        r.row_token[pos] = i / r.k;
        r.row_weight[pos] = w[j];
        r.pair_row[i] = pos;
    }
}

static int permute_old(void) { /* LUNAR_MOE_PERMUTE=old: the single-atomic kernels at every size */
    static int v = -1;
    if (v < 0) v = getenv("LUNAR_MOE_PERMUTE") && !strcmp(getenv("LUNAR_MOE_PERMUTE"), "old");
    return v;
}

extern "C" void lunar_cuda_moe_permute(lunar_cuda_moe_route *r, lunar_cuda_stream s) {
    CUDA_REQUIRE(r->E <= SCAN_T * SCAN_IPT && r->n >= 1 && r->k >= 1);
    const int np = r->n * r->k;
    CUDA_CHECK(cudaMemsetAsync(r->counts, 0, (r->E + 2) * 4, to_stream(s)));
    if (r->n > 64 && r->E <= PSCAN_E && !permute_old()) {
        const unsigned blocks = ceil_div_u(np, PERM_T * PERM_IPT);
        moe_count_smem_kernel<<<blocks, PERM_T, 0, to_stream(s)>>>(r->counts, r->experts, np, r->E);
        CUDA_CHECK_LAUNCH();
        moe_scan_warps_kernel<<<1, SCAN_T, 0, to_stream(s)>>>(*r);
        CUDA_CHECK_LAUNCH();
        moe_scatter_smem_kernel<<<blocks, PERM_T, 0, to_stream(s)>>>(*r);
        CUDA_CHECK_LAUNCH();
        return;
    }
    moe_count_kernel<<<ceil_div_u(np, 256), 256, 0, to_stream(s)>>>(r->counts, r->experts, np);
    CUDA_CHECK_LAUNCH();
    moe_scan_kernel<<<1, SCAN_T, 0, to_stream(s)>>>(*r);
    CUDA_CHECK_LAUNCH();
    moe_scatter_kernel<<<ceil_div_u(np, 256), 256, 0, to_stream(s)>>>(*r);
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------- decode kernel

#define DEC_STAGES 4
// grid (row groups, active-expert slots); block 128 = 4 warps = RT row tiles (of 16 weight rows)
// x S k-splits (RT * S = 4). Each warp streams its rows' bytes once: per chunk of 128 columns a
// lane reads one 16-byte block of each of its 2 rows (per matrix) plus the scale byte, the next
// chunk prefetched while the current one is widened and multiplied (A = weights 16 rows, B = up
// to NT x 8 tokens of this expert, read from L1/L2). Split-K partials meet in shared memory and
// are summed in a fixed order (deterministic).
//
// opt (LUNAR_MOE_DEC_OPT, bits; default 7, 0 = the session-7 kernels): bit 0, BF16 down kernel with at
// most 2 chunks per warp (Kimi-Linear: K = 1024, S = 4): the warp's weights are loaded into registers
// once, right after the expert is known (before the offsets load and the pass loop) and both chunks'
// loads are in flight together; the session-7 loop waited one DRAM round trip per chunk and reloaded
// the weights per pass of 8 tokens. Bit 1, down kernels: each pass's row weights loaded before its
// K loop, not in the epilogue, where each load waited behind the previous store (y might alias them).
// Measured (H200, docs/benchmarks.md "MoE decode at batch 1, round 3 (session 8)"): Kimi-Linear's BF16
// pair at batch 1 41.4 -> 39.3 us (decode bench), the model's B = 1 step 2.69 / 2.71 -> 2.66 ms; the
// gate/up kernel's first chunk loaded early the same way made ptxas interleave each later chunk's
// loads with its mmas (4 round trips a chunk instead of 1; SASS, not run): not done.
//
// OPT = false compiles the bits out (opt is 0): the session-7 kernel's code. The bits cost registers even
// where they are off at run time (ptxas allocates for the opt-bit-0 path's 64 registers of weights): the
// BF16 down kernel <1, false, false, 4> went from 88 registers to 128 with 12 bytes of spills, and the
// Kimi-Linear B = 1 step measured 2.613 ms at d0b593b (before the bits) against 2.655 with bits 7 and
// 2.708 with LUNAR_MOE_DEC_OPT=0 in the same kernel (session 10, three alternating rounds, one call;
// the bisection d0b593b..main put the whole +2.6 % on the merge that added them). Hence the BF16 down
// kernel runs OPT = false unless LUNAR_MOE_DEC_OPT is set (decode_launch_s).
template <int NT, bool MX, bool GATEUP, int S, bool OPT = true>
__global__ void __launch_bounds__(128, 4) moe_decode_kernel(xargs a, uint32_t pf, uint32_t opt_in) {
    constexpr int NM = GATEUP ? 2 : 1, RT = 4 / S, NACC = NM * NT * 4, ST = DEC_STAGES;
    const uint32_t opt = OPT ? opt_in : 0u;
    extern __shared__ __align__(16) float red[];  // [4 warps][NACC][32] when S > 1, then the ring
    float *ring = red + (S > 1 ? 4 * NACC * 32 : 0);
    // under PDL (LUNAR_CUDA_PDL=1) both kernels wait before any load: session 3's variant (the down
    // kernel streaming weights before its wait, the gate/up kernel triggering before reading the
    // route) broke the wait chain. Before the wait only L2 prefetches of the block's weight rows
    // (pf bytes at most, the rule in cuda_common.cuh): gate/up the shared expert's (kernel
    // arguments only; slot 0's blocks); down its slot's expert, chosen by the route that the
    // route kernel two launches back wrote (the gate/up kernel in between waited for it).
    if (pf && threadIdx.x == 0) {
        const int rows = min(RT * 16, a.R - (int)blockIdx.x * RT * 16);
        const size_t r0 = (size_t)blockIdx.x * RT * 16;
        int e = -1;
        if (GATEUP) e = a.sb[0] && blockIdx.y == 0 ? a.E : -1;
        else if ((int)blockIdx.y < a.counts[a.E]) e = a.active[blockIdx.y];
        if (e == a.E && !MX && a.sb[0]) {
            const uint32_t b = (uint32_t)min((size_t)pf / NM, (size_t)rows * a.K * 2) & ~15u;
            for (int i = 0; i < NM; i++) pdl_prefetch_l2(a.sb[i] + r0 * a.K, b);
        } else if (e >= 0 && e < a.E) {
            const size_t estr = (size_t)a.R * a.K;
            for (int i = 0; i < NM; i++) {
                if (MX) {
                    pdl_prefetch_l2(a.wq[i] + e * estr / 2 + r0 * (a.K / 2),
                                    (uint32_t)min((size_t)pf / NM, (size_t)rows * a.K / 2) & ~15u);
                    pdl_prefetch_l2(a.ws[i] + e * estr / 32 + r0 * (a.K / 32),
                                    (uint32_t)((size_t)rows * a.K / 32) & ~15u);
                } else {
                    pdl_prefetch_l2(a.wb[i] + e * estr + r0 * a.K,
                                    (uint32_t)min((size_t)pf / NM, (size_t)rows * a.K * 2) & ~15u);
                }
            }
        }
    }
    pdl_wait();
    const int slot = blockIdx.y;
    if (slot >= a.counts[a.E]) return;
    const int e = a.active[slot];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int rt = warp / S, ks = warp % S;
    const int tile = blockIdx.x * RT + rt;
    const bool tile_ok = tile * 16 < a.R;
    const int J = a.K / 128, j0 = ks * J / S, j1 = (ks + 1) * J / S;
    const int ra = tile * 16 + g, rb = ra + 8;
    const size_t estr = (size_t)a.R * a.K;  // elements per expert matrix
    // opt bit 0: the BF16 down weights of this warp, [chunk][w] of rows ra / rb (top note)
    constexpr bool RES = !MX && !GATEUP;
    const bool res = RES && (opt & 1u) && j1 - j0 <= 2;
    uint4 rwa[2][4], rwb[2][4];
    if (RES && res && tile_ok) {
        const uint16_t *base = e == a.E ? a.sb[0] : a.wb[0] + e * estr;
#pragma unroll
        for (int jj = 0; jj < 2; jj++)
#pragma unroll
            for (int w = 0; w < 4; w++) {
                const int blk = 4 * (j0 + jj) + c;
                const bool in = j0 + jj < j1;
                rwa[jj][w] = in ? __ldg((const uint4 *)(base + (size_t)ra * a.K + blk * 32 + w * 8))
                                : make_uint4(0, 0, 0, 0);
                rwb[jj][w] = in ? __ldg((const uint4 *)(base + (size_t)rb * a.K + blk * 32 + w * 8))
                                : make_uint4(0, 0, 0, 0);
            }
    }
    const int off = a.offsets[e], m = a.offsets[e + 1] - off;
    for (int t0 = 0; t0 < m; t0 += NT * 8) {
        float rwt[NT][2];  // opt bit 1: the row weights of this lane's tokens, loaded before the K loop
        if (!GATEUP && (opt & 2u)) {
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int v = 0; v < 2; v++) {
                    const int tk = t0 + t * 8 + 2 * c + v;
                    rwt[t][v] = tk < m ? a.row_weight[off + tk] : 0.0f;
                }
        }
        float acc[NM][NT][4];
#pragma unroll
        for (int i = 0; i < NM; i++)
#pragma unroll
            for (int t = 0; t < NT; t++) acc[i][t][0] = acc[i][t][1] = acc[i][t][2] = acc[i][t][3] = 0.0f;
        const uint16_t *xr[NT];
        bool tok_ok[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            int tk = t0 + t * 8 + g;
            tok_ok[t] = tk < m;
            int row = tok_ok[t] ? (GATEUP ? a.row_token[off + tk] : off + tk) : 0;
            xr[t] = a.x + (size_t)row * a.K;
        }
        if (tile_ok && j0 < j1) {
            if (MX) {
                // Per-thread cp.async ring of ST stages (this thread's 16-byte blocks of its rows
                // and their scale words): ST - 1 chunks stay in flight without registers. Each
                // thread reads back only what it copied itself, so wait_group is the only sync.
                const mx_ring_src<NM> src(a, e, estr, ra, rb, c);
                uint4 *rw = (uint4 *)ring;                       // [ST][2 NM][128]
                uint32_t *rs = (uint32_t *)(rw + ST * 2 * NM * 128);  // [ST][2 NM][128]
                const int tid = threadIdx.x;
                auto issue = [&](int j) { src.template issue<ST>(rw, rs, j, j0, j1, tid, tid); };
#pragma unroll
                for (int p = 0; p < ST; p++) issue(j0 + p);
                uint4 xv[NT][4];
                auto load_x = [&](int j, uint4 (*dst)[4]) {
#pragma unroll
                    for (int t = 0; t < NT; t++)
#pragma unroll
                        for (int w = 0; w < 4; w++)
                            dst[t][w] = tok_ok[t] ? __ldg((const uint4 *)(xr[t] + (4 * j + c) * 32 + w * 8))
                                                  : make_uint4(0, 0, 0, 0);
                };
                load_x(j0, xv);
                for (int j = j0; j < j1; j++) {
                    const int st = (j - j0) % ST;
                    cp_async_wait<ST - 1>();
                    uint4 wa[NM], wb[NM];
                    mxscale sca[NM], scb[NM];
#pragma unroll
                    for (int i = 0; i < NM; i++) {
                        wa[i] = rw[(st * 2 * NM + 2 * i) * 128 + tid];
                        wb[i] = rw[(st * 2 * NM + 2 * i + 1) * 128 + tid];
                        sca[i] = mx_scale((rs[(st * 2 * NM + 2 * i) * 128 + tid] >> (8 * c)) & 255u);
                        scb[i] = mx_scale((rs[(st * 2 * NM + 2 * i + 1) * 128 + tid] >> (8 * c)) & 255u);
                    }
                    uint4 nx[NT][4];
                    if (j + 1 < j1) load_x(j + 1, nx);
                    bool two = false;
#pragma unroll
                    for (int i = 0; i < NM; i++) two = two || sca[i].two || scb[i].two;
                    two = __any_sync(0xffffffffu, two);  // warp-uniform: one widening path per chunk
#pragma unroll
                    for (int w = 0; w < 4; w++) {
                        uint32_t pa[NM][4], pb[NM][4];
#pragma unroll
                        for (int i = 0; i < NM; i++) {
                            const uint32_t qwa = w == 0 ? wa[i].x : w == 1 ? wa[i].y : w == 2 ? wa[i].z : wa[i].w;
                            const uint32_t qwb = w == 0 ? wb[i].x : w == 1 ? wb[i].y : w == 2 ? wb[i].z : wb[i].w;
                            if (two) {
                                pairs_mx<true>(qwa, sca[i], pa[i]);
                                pairs_mx<true>(qwb, scb[i], pb[i]);
                            } else {
                                pairs_mx<false>(qwa, sca[i], pa[i]);
                                pairs_mx<false>(qwb, scb[i], pb[i]);
                            }
                        }
#pragma unroll
                        for (int t = 0; t < NT; t++) {
                            if (t0 + t * 8 >= m) continue;  // empty token group (warp-uniform)
                            uint32_t px[4];
                            pairs_bf16(xv[t][w], px);
#pragma unroll
                            for (int h = 0; h < 2; h++)
#pragma unroll
                                for (int i = 0; i < NM; i++)
                                    mma_bf16(acc[i][t], pa[i][2 * h], pb[i][2 * h], pa[i][2 * h + 1],
                                             pb[i][2 * h + 1], px[2 * h], px[2 * h + 1]);
                        }
                    }
                    issue(j + ST);  // into the stage just consumed (its values are in registers)
                    if (j + 1 < j1) {
#pragma unroll
                        for (int t = 0; t < NT; t++)
#pragma unroll
                            for (int w = 0; w < 4; w++) xv[t][w] = nx[t][w];
                    }
                }
                cp_async_wait<0>();
            } else if (RES && res) {
                // both chunks' activations issued together too (they come from L2)
                uint4 xv[2][NT][4];
#pragma unroll
                for (int jj = 0; jj < 2; jj++)
#pragma unroll
                    for (int t = 0; t < NT; t++)
#pragma unroll
                        for (int w = 0; w < 4; w++)
                            xv[jj][t][w] = tok_ok[t] && j0 + jj < j1
                                               ? __ldg((const uint4 *)(xr[t] + (4 * (j0 + jj) + c) * 32 + w * 8))
                                               : make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int jj = 0; jj < 2; jj++) {
                    if (j0 + jj >= j1) break;
#pragma unroll
                    for (int w = 0; w < 4; w++) {
                        uint32_t pa[4], pb[4];
                        pairs_bf16(rwa[jj][w], pa);
                        pairs_bf16(rwb[jj][w], pb);
#pragma unroll
                        for (int t = 0; t < NT; t++) {
                            uint32_t px[4];
                            pairs_bf16(xv[jj][t][w], px);
#pragma unroll
                            for (int h = 0; h < 2; h++)
                                mma_bf16(acc[0][t], pa[2 * h], pb[2 * h], pa[2 * h + 1], pb[2 * h + 1], px[2 * h],
                                         px[2 * h + 1]);
                        }
                    }
                }
            } else {
                dec_bf16_chunks<NM, NT>(acc, a, e, estr, ra, rb, c, j0, j1, xr, tok_ok);
            }
        }
        if (S > 1) dec_splitk_sum<NACC, S>(&acc[0][0][0], red, warp, ks, lane);
        if (ks == 0 && tile_ok) {
            // C fragment: (row g, tokens 2c, 2c+1), (row g+8, tokens 2c, 2c+1)
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int v = 0; v < 4; v++) {
                    const int tk = t0 + t * 8 + 2 * c + (v & 1), row = v < 2 ? ra : rb;
                    if (tk >= m) continue;
                    const size_t pr = (size_t)(off + tk);
                    if (GATEUP) {
                        float hv = glu_act(acc[0][t][v], acc[NM - 1][t][v], a.act, a.beta, a.beta_l);
                        __nv_bfloat16 hb = __float2bfloat16_rn(hv);
                        a.h[pr * a.R + row] = *reinterpret_cast<uint16_t *>(&hb);
                    } else {
                        a.y[pr * a.R + row] = acc[0][t][v] * ((opt & 2u) ? rwt[t][v & 1] : a.row_weight[pr]);
                    }
                }
        }
    }
}

// ---------------------------------------------------------------- fused decode kernel
// Both expert GEMMs of the decode path in one persistent kernel, MXFP4 weights. The previous pair
// (above) streamed ~2.3 TB/s with a ~14 us fixed cost at batch 1: every block lived for a handful
// of chunks (each ramping its copy ring from empty), each copy instruction covered 8 rows x 64
// bytes, and the down kernel could only start streaming once gate/up had drained.
//
// Here a grid of exactly the resident blocks walks a list of block items: first every gate/up
// item (token group, 16 RT weight rows of w1 and w3), then every down item (token group, 16 RT
// rows of w2); block b takes items b, b + grid, ... Each warp keeps one cp.async ring running
// across all its items, so a block's copies never drain between items; the ring holds whole
// rows' chunks (CW columns = CW/2 contiguous bytes of a row per copy group: a full 128-byte
// line per row at CW = 256) and is read back in the mma fragment order through a swizzle.
// Split-K: the S warps of an item sum in shared memory in a fixed order (deterministic).
// Down items of a token group wait (gdone, acquire) until all of the group's gate/up row tiles
// are written; the weight copies of the down item are already in flight while it waits.
// Deadlock freedom: items are taken in list order and every gate/up item precedes every down
// item in each block's list, so a waiting warp only waits for gate/up items that are running or
// done in resident blocks (the grid never exceeds the resident capacity, computed at launch;
// blocks of ours that wait for a slot only wait for independent kernels to finish).
// Measured (H200, session 3): correct (op tests, the forward on the MXFP4 goldens) but slower than
// the pair at every shape: K3.1 batch 1 199 us vs 136 us, ~1.4-1.5 TB/s. Time tracked resident
// warps per SM (8: 244 us, 12: 199 us; the pair runs 16+), not bytes in flight nor the copy shape
// (128- and 256-column stages equal): each warp's consumer is latency-bound. Suspects, unprofiled:
// the per-item chain of dependent loads (group, offsets, row_token, activations) with only ~3.5
// chunks per warp and item, the activations prefetched one sub-chunk ahead only, and the
// producer advancing only when the consumer does. Not the default (path 3, LUNAR_MOE_DECODE=fused).
template <int CW, int ST>
struct fz {
    static constexpr int U = CW / 32;              // 16-byte units per row per chunk
    static constexpr int WB = 16 * U * 16;         // weight bytes per matrix per stage (16 rows)
    static constexpr int SWD = 16 * (U / 4);       // scale words per matrix per stage
    static constexpr int MAT = WB + SWD * 4;       // bytes per matrix per stage
    static constexpr int STAGE = 2 * MAT;          // gate/up: two matrices (down uses the first)
    static constexpr int WARP = ST * STAGE;        // one warp's ring
    static constexpr int RED = 2 * 4 * 8 * 32 * 4; // split-K partials, double-buffered by item
    static constexpr int SMEM = 4 * WARP + RED;
};

struct fargs {
    xargs g, d;  // gate/up (R = I, K = D) and down (R = D, K = I); the route fields are shared
    const int32_t *groups;
    int32_t *gdone, *exits;  // per group: gate/up row tiles written; blocks finished
};

// One warp's share of block item it: phase, expert, first weight row, chunk range [j0, j1).
struct fpiece {
    int pA, grp, e, row0, j0, j1, S, ks, rt, tile_ok;
};
struct fplan {
    int nchA, SA, ipgA, nchB, SB, ipgB, NA, NT;
};
__device__ __forceinline__ int split_of(int nch) { return nch >= 4 ? 4 : nch >= 2 ? 2 : 1; }
template <int CW>
__device__ __forceinline__ fplan fused_plan(const fargs &f) {
    fplan p;
    const int G = f.g.counts[f.g.E + 2];
    p.nchA = (f.g.K + CW - 1) / CW, p.SA = split_of(p.nchA);
    p.ipgA = (f.g.R / 16 + 4 / p.SA - 1) / (4 / p.SA);
    p.nchB = (f.d.K + CW - 1) / CW, p.SB = split_of(p.nchB);
    p.ipgB = (f.d.R / 16 + 4 / p.SB - 1) / (4 / p.SB);
    p.NA = G * p.ipgA;
    p.NT = p.NA + G * p.ipgB;
    return p;
}
__device__ __forceinline__ fpiece fused_piece(const fargs &f, const fplan &p, int it, int warp) {
    fpiece q;
    q.pA = it < p.NA;
    const int loc = q.pA ? it : it - p.NA, ipg = q.pA ? p.ipgA : p.ipgB;
    const int nch = q.pA ? p.nchA : p.nchB, R = q.pA ? f.g.R : f.d.R;
    q.S = q.pA ? p.SA : p.SB;
    q.grp = loc / ipg;
    q.rt = warp / q.S, q.ks = warp % q.S;
    const int tile = (loc % ipg) * (4 / q.S) + q.rt;
    q.row0 = tile * 16;
    q.tile_ok = q.row0 < R;
    q.j0 = q.ks * nch / q.S, q.j1 = q.tile_ok ? (q.ks + 1) * nch / q.S : q.j0;
    q.e = f.groups[2 * q.grp];
    return q;
}

__device__ __forceinline__ int ld_acquire(const int32_t *p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

template <int CW, int ST, int MINB>
__global__ void __launch_bounds__(128, MINB) moe_fused_kernel(const __grid_constant__ fargs f) {
    using Z = fz<CW, ST>;
    constexpr int U = Z::U, UW = U / 4;
    extern __shared__ __align__(16) unsigned char fsm[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    unsigned char *ring = fsm + warp * Z::WARP;
    float *red = (float *)(fsm + 4 * Z::WARP);
    const fplan P = fused_plan<CW>(f);
    const int nb = gridDim.x;

    // ---- producer: walks this warp's (item, chunk) sequence ST - 1 chunks ahead of the consumer;
    // per piece, the row-0 pointers of its matrices (fields picked by value: no param copies)
    int pit = (int)blockIdx.x - nb, pj = 0, pc = 0, pK = 0, pA = 0, pj1 = 0;
    const uint8_t *pq[2] = {nullptr, nullptr}, *ps[2] = {nullptr, nullptr};
    auto next_piece = [&]() {
        do {
            pit += nb;
            if (pit >= P.NT) return;
            const fpiece pp = fused_piece(f, P, pit, warp);
            pA = pp.pA, pj = pp.j0, pj1 = pp.j1;
            pK = pA ? f.g.K : f.d.K;
            const size_t eo = (size_t)pp.e * (size_t)(pA ? f.g.R : f.d.R) * pK + (size_t)pp.row0 * pK;
            pq[0] = (pA ? f.g.wq[0] : f.d.wq[0]) + eo / 2, ps[0] = (pA ? f.g.ws[0] : f.d.ws[0]) + eo / 32;
            pq[1] = f.g.wq[1] + eo / 2, ps[1] = f.g.ws[1] + eo / 32;  // used by gate/up only
        } while (pj >= pj1);
    };
    next_piece();
    auto issue = [&]() {
        if (pit < P.NT) {
            const bool half = (pj + 1) * CW > pK;  // K % CW == 128: the last chunk has one sub-chunk
            unsigned char *st = ring + (pc % ST) * Z::STAGE;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                if (i == 1 && !pA) break;
                const uint8_t *q = pq[i] + (size_t)pj * (CW / 2), *sc = ps[i] + pj * (CW / 32);
                unsigned char *sm = st + i * Z::MAT;
#pragma unroll
                for (int cp = 0; cp < U / 2; cp++) {
                    const int idx = cp * 32 + lane, row = idx / U, unit = idx % U;
                    const int su = U == 8 ? unit ^ ((row & 1) << 2) : unit;
                    if (!half || unit < 4) cp_async16(sm + (row * U + su) * 16, q + (size_t)row * (pK / 2) + unit * 16);
                }
                if (lane < Z::SWD) {
                    const int row = lane / UW, wd = lane % UW;
                    if (!half || wd == 0) cp_async4(sm + Z::WB + (row * UW + wd) * 4, sc + (size_t)row * (pK / 32) + wd * 4);
                }
            }
            if (++pj >= pj1) next_piece();
        }
        cp_async_commit();
        pc++;
    };
#pragma unroll
    for (int p = 0; p < ST - 1; p++) issue();

    // ---- consumer: every item of this block in order (all 4 warps meet at each item's end)
    int cc = 0, parity = 0, ready_grp = -1;
    for (int it = (int)blockIdx.x; it < P.NT; it += nb, parity ^= 1) {
        const fpiece q = fused_piece(f, P, it, warp);
        const int K = q.pA ? f.g.K : f.d.K;
        const int start = f.groups[2 * q.grp + 1];
        const int m = min(DEC_G, f.g.offsets[q.e + 1] - start);
        float acc[2][4];
#pragma unroll
        for (int i = 0; i < 2; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        if (q.j0 < q.j1) {
            if (!q.pA && ready_grp != q.grp) {
                // h rows of this group come from other blocks' gate/up items
                const int need = f.g.R / 16;
                while (ld_acquire(f.gdone + q.grp) < need) __nanosleep(128);
                ready_grp = q.grp;
            }
            const bool tok = g < m;
            const uint16_t *xr = (q.pA ? f.g.x : f.d.x) + (size_t)(tok ? (q.pA ? f.g.row_token[start + g] : start + g) : 0) * K;
            // activations of sub-chunk s (128 columns), this thread's block c: 4 uint4
            auto load_x = [&](int col, uint4 *dst) {
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    const uint4 *a = (const uint4 *)(xr + col + c * 32 + w * 8);
                    dst[w] = !tok ? make_uint4(0, 0, 0, 0) : q.pA ? __ldg(a) : __ldcg(a);
                }
            };
            uint4 xv[4], nx[4];
            load_x(q.j0 * CW, xv);
            for (int j = q.j0; j < q.j1; j++, cc++) {
                cp_async_wait<ST - 2>();
                __syncwarp();  // the stage was filled by all lanes' copies
                issue();       // into the stage consumed last step (every lane is past it)
                const unsigned char *st = ring + (cc % ST) * Z::STAGE;
#pragma unroll
                for (int sub = 0; sub < U / 4; sub++) {
                    const int col = j * CW + sub * 128;
                    if (col >= K) break;
                    const int ncol = col + 128 < K && (sub + 1 < U / 4 || j + 1 < q.j1) ? col + 128 : -1;
                    if (ncol >= 0) load_x(ncol, nx);
                    const int ua = sub * 4 + c, swa = U == 8 ? ua ^ ((g & 1) << 2) : ua;
                    uint4 wa[2] = {}, wb[2] = {};
                    mxscale sca[2] = {}, scb[2] = {};
#pragma unroll
                    for (int i = 0; i < 2; i++) {
                        if (i == 1 && !q.pA) break;
                        const unsigned char *sm = st + i * Z::MAT;
                        wa[i] = *(const uint4 *)(sm + (g * U + swa) * 16);
                        wb[i] = *(const uint4 *)(sm + ((g + 8) * U + swa) * 16);
                        const uint32_t *sw = (const uint32_t *)(sm + Z::WB);
                        sca[i] = mx_scale((sw[g * UW + sub] >> (8 * c)) & 255u);
                        scb[i] = mx_scale((sw[(g + 8) * UW + sub] >> (8 * c)) & 255u);
                    }
                    bool two = sca[0].two || scb[0].two || (q.pA && (sca[1].two || scb[1].two));
                    two = __any_sync(0xffffffffu, two);
#pragma unroll
                    for (int w = 0; w < 4; w++) {
                        uint32_t px[4];
                        pairs_bf16(xv[w], px);
#pragma unroll
                        for (int i = 0; i < 2; i++) {
                            if (i == 1 && !q.pA) break;
                            const uint32_t qwa = w == 0 ? wa[i].x : w == 1 ? wa[i].y : w == 2 ? wa[i].z : wa[i].w;
                            const uint32_t qwb = w == 0 ? wb[i].x : w == 1 ? wb[i].y : w == 2 ? wb[i].z : wb[i].w;
                            uint32_t pa[4], pb[4];
                            if (two) {
                                pairs_mx<true>(qwa, sca[i], pa);
                                pairs_mx<true>(qwb, scb[i], pb);
                            } else {
                                pairs_mx<false>(qwa, sca[i], pa);
                                pairs_mx<false>(qwb, scb[i], pb);
                            }
                            mma_bf16(acc[i], pa[0], pb[0], pa[1], pb[1], px[0], px[1]);
                            mma_bf16(acc[i], pa[2], pb[2], pa[3], pb[3], px[2], px[3]);
                        }
                    }
                    if (ncol >= 0) {
#pragma unroll
                        for (int w = 0; w < 4; w++) xv[w] = nx[w];
                    }
                }
            }
        }
        if (q.S > 1) {
            float *mine = red + ((size_t)(parity * 4 + warp) * 8) * 32;
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int v = 0; v < 4; v++) mine[(i * 4 + v) * 32 + lane] = acc[i][v];
            __syncthreads();
            if (q.ks == 0)
                for (int s2 = 1; s2 < q.S; s2++) {
                    const float *o = red + ((size_t)(parity * 4 + warp + s2) * 8) * 32;
#pragma unroll
                    for (int i = 0; i < 2; i++)
#pragma unroll
                        for (int v = 0; v < 4; v++) acc[i][v] += o[(i * 4 + v) * 32 + lane];
                }
        }
        if (q.ks == 0 && q.tile_ok) {
            // C fragment: (row g, tokens 2c, 2c+1), (row g+8, tokens 2c, 2c+1)
#pragma unroll
            for (int v = 0; v < 4; v++) {
                const int tk = 2 * c + (v & 1), row = q.row0 + g + (v < 2 ? 0 : 8);
                if (tk >= m) continue;
                const size_t pr = (size_t)(start + tk);
                if (q.pA) {
                    float hv = glu_act(acc[0][v], acc[1][v], f.g.act, f.g.beta, f.g.beta_l);
                    __nv_bfloat16 hb = __float2bfloat16_rn(hv);
                    f.g.h[pr * f.g.R + row] = *reinterpret_cast<uint16_t *>(&hb);
                } else {
                    f.d.y[pr * f.d.R + row] = acc[0][v] * f.d.row_weight[pr];
                }
            }
            if (q.pA) {
                __threadfence();  // each lane's h stores, before the group's counter moves
                __syncwarp();
                if (lane == 0) atomicAdd(f.gdone + q.grp, 1);
            }
        }
    }
    cp_async_wait<0>();
    // The last block out zeroes the counters again, so that a second run on the same routing
    // (benchmarks, the op tests' several paths) waits as the first did.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(f.exits, 1) == nb - 1) {
            __threadfence();
            const int G = f.g.counts[f.g.E + 2];
            for (int i = 0; i < G; i++) f.gdone[i] = 0;
            *f.exits = 0;
        }
    }
}

template <int CW, int ST>
static void fused_launch(const xargs &g, const xargs &d, const lunar_cuda_moe_route *r, cudaStream_t st) {
    using Z = fz<CW, ST>;
    constexpr int MINB = (Z::SMEM + 1024) * 3 <= 233472 ? 3 : 2;  // blocks that fit an SM's 228 KiB
    static int grid = 0;
    if (!grid) {
        // The grid is exactly the resident capacity: the down items' waits rely on it (above).
        int dev = 0, sms = 0, per = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        CUDA_CHECK(cudaFuncSetAttribute(moe_fused_kernel<CW, ST, MINB>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, Z::SMEM));
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, moe_fused_kernel<CW, ST, MINB>, 128, Z::SMEM));
        CUDA_REQUIRE(per >= 1);
        grid = sms * per;
    }
    fargs f;
    f.g = g, f.d = d, f.groups = r->groups, f.gdone = r->gdone;
    f.exits = r->gdone + max_groups(r->n, r->k, r->E);
    moe_fused_kernel<CW, ST, MINB><<<grid, 128, Z::SMEM, st>>>(f);
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------- grouped GEMM (prefill)
// The mma.sync grouped GEMM: path 2, prefill's kernel with LUNAR_MOE_PREFILL=old (the defaults are
// the wgmma kernels of cuda_moe_ws.cu: path 29 for BF16 experts, path 24 for MXFP4).
// CTA tile: 128 permuted rows (one expert's M tile, from the tile list) x 128 weight rows
// (GATEUP: 64 columns of I from w1 and the same 64 from w3; DOWN: 128 rows of w2), K in chunks of
// 128 columns. 8 warps = 2 (M, 64 rows each) x 4 (N, 32 weight rows each). Activations: global ->
// registers (next chunk prefetched) -> shared memory in the pair order -> ldmatrix; weights:
// global -> registers (next chunk prefetched) -> widened to bf16 in registers -> mma B fragments.
#define GM_BM 128
#define GM_BK 128
#define GM_LDS (GM_BK + 8)  // bf16 per smem row: 272 bytes, ldmatrix rows hit distinct banks
#define GM_SMEM (2 * GM_BM * GM_LDS * 2)

__device__ __forceinline__ void ldmatrix_x4(uint32_t *r, const void *p) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

template <bool MX, bool GATEUP>
__global__ void __launch_bounds__(256) moe_gemm_kernel(xargs a) {
    extern __shared__ __align__(16) uint16_t As[];  // [2][GM_BM][GM_LDS]
    const int ti = blockIdx.y;
    if (ti >= a.counts[a.E + 1]) return;
    const int e = a.tiles[2 * ti], r0 = a.tiles[2 * ti + 1];
    const int rend = a.offsets[e + 1];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int wm = warp >> 2, wn = warp & 3;
    const int J = a.K / GM_BK;
    const size_t estr = (size_t)a.R * a.K;
    // weight rows of this thread for its 4 n8 tiles
    int wrow[4], wmat[4];
#pragma unroll
    for (int nt = 0; nt < 4; nt++) {
        if (GATEUP) {
            wmat[nt] = nt >> 1;
            wrow[nt] = blockIdx.x * 64 + wn * 16 + (nt & 1) * 8 + g;
        } else {
            wmat[nt] = 0;
            wrow[nt] = blockIdx.x * 128 + wn * 32 + nt * 8 + g;
        }
    }
    // activation loads: 2048 uint4 per chunk, 8 per thread: row = (tid >> 4) + 16 i, col16 = tid & 15
    const int lcol = tid & 15;
    const uint16_t *xrow[8];
    bool xok[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int r = r0 + (tid >> 4) + 16 * i;
        xok[i] = r < rend;
        int src = xok[i] ? (GATEUP ? a.row_token[r] : r) : 0;
        xrow[i] = a.x + (size_t)src * a.K;
    }
    // smem destination of a uint4 of block b = lcol >> 2, word w = lcol & 3 (pairs P0..P3 to mma
    // q = 2w (P0, P1) and 2w+1 (P2, P3); logical k 2b (lo pair) and 2b+8 (hi pair))
    const int bq = lcol >> 2, wq = lcol & 3;
    const int d0 = (2 * wq) * 16 + 2 * bq, d1 = d0 + 8, d2 = (2 * wq + 1) * 16 + 2 * bq, d3 = d2 + 8;

    uint4 xa[8];
    uint4 wv[4];
    uint32_t wsc[4];
    auto load_x = [&](int j) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            xa[i] = xok[i] ? __ldg((const uint4 *)(xrow[i] + j * GM_BK + lcol * 8)) : make_uint4(0, 0, 0, 0);
    };
    auto store_x = [&](int buf) {
        uint16_t *base = As + buf * GM_BM * GM_LDS;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            uint32_t p[4];
            pairs_bf16(xa[i], p);
            uint32_t *row = (uint32_t *)(base + ((tid >> 4) + 16 * i) * GM_LDS);
            row[d0 / 2] = p[0];
            row[d1 / 2] = p[1];
            row[d2 / 2] = p[2];
            row[d3 / 2] = p[3];
        }
    };
    auto load_w = [&](int j) {
        if (MX) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const size_t ro = e * estr + (size_t)wrow[nt] * a.K;
                wv[nt] = __ldg((const uint4 *)(a.wq[wmat[nt]] + ro / 2 + (4 * j + c) * 16));
                wsc[nt] = __ldg(a.ws[wmat[nt]] + ro / 32 + 4 * j + c);
            }
        }
    };
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int k2 = 0; k2 < 4; k2++) acc[i][k2][0] = acc[i][k2][1] = acc[i][k2][2] = acc[i][k2][3] = 0.0f;

    load_x(0);
    load_w(0);
    store_x(0);
    __syncthreads();
    for (int j = 0; j < J; j++) {
        const int buf = j & 1;
        uint4 cw[4];
        uint32_t cs[4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) cw[nt] = wv[nt], cs[nt] = wsc[nt];
        if (j + 1 < J) {
            load_x(j + 1);
            load_w(j + 1);
        }
        const uint16_t *Ab = As + buf * GM_BM * GM_LDS;
        mxscale sc[4];
        if (MX) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++) sc[nt] = mx_scale(cs[nt]);
        }
        bool two = false;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) two = two || (MX && sc[nt].two);
        two = __any_sync(0xffffffffu, two);  // as in the decode kernel: one path per warp and chunk
#pragma unroll
        for (int w = 0; w < 4; w++) {
            uint32_t bp[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                if (MX) {
                    const uint32_t q = w == 0 ? cw[nt].x : w == 1 ? cw[nt].y : w == 2 ? cw[nt].z : cw[nt].w;
                    if (two) pairs_mx<true>(q, sc[nt], bp[nt]);
                    else pairs_mx<false>(q, sc[nt], bp[nt]);
                } else {
                    const size_t ro = e * estr + (size_t)wrow[nt] * a.K;
                    pairs_bf16(__ldg((const uint4 *)(a.wb[wmat[nt]] + ro + j * GM_BK + c * 32 + w * 8)),
                               bp[nt]);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int q = 2 * w + h;
#pragma unroll
                for (int mt = 0; mt < 4; mt++) {
                    uint32_t af[4];
                    const int arow = wm * 64 + mt * 16 + (lane & 15);
                    ldmatrix_x4(af, Ab + arow * GM_LDS + q * 16 + (lane >> 4) * 8);
#pragma unroll
                    for (int nt = 0; nt < 4; nt++)
                        mma_bf16(acc[mt][nt], af[0], af[1], af[2], af[3], bp[nt][2 * h], bp[nt][2 * h + 1]);
                }
            }
        }
        if (j + 1 < J) {
            store_x(buf ^ 1);
            __syncthreads();
        }
    }
    // epilogue. C fragment of (mt, nt): (row g, cols 2c, 2c+1), (row g+8, cols 2c, 2c+1)
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int r = r0 + wm * 64 + mt * 16 + g + hh * 8;
            if (r >= rend) continue;
            if (GATEUP) {
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    const int col = blockIdx.x * 64 + wn * 16 + nt * 8 + 2 * c;
                    float h0 = glu_act(acc[mt][nt][2 * hh], acc[mt][nt + 2][2 * hh], a.act, a.beta, a.beta_l);
                    float h1 = glu_act(acc[mt][nt][2 * hh + 1], acc[mt][nt + 2][2 * hh + 1], a.act, a.beta, a.beta_l);
                    __nv_bfloat162 hv = __floats2bfloat162_rn(h0, h1);
                    *(__nv_bfloat162 *)(a.h + (size_t)r * a.R + col) = hv;
                }
            } else {
                const float rw = a.row_weight[r];
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    const int col = blockIdx.x * 128 + wn * 32 + nt * 8 + 2 * c;
                    *(float2 *)(a.y + (size_t)r * a.R + col) =
                        make_float2(acc[mt][nt][2 * hh] * rw, acc[mt][nt][2 * hh + 1] * rw);
                }
            }
        }
}

// ---------------------------------------------------------------- launchers

// LUNAR_MOE_DEC_OPT: the decode kernels' opt bits (moe_decode_kernel's note; path 16 reads bits 1
// and 2, cuda_moe_f16.cu); unset: all, except in the BF16 down kernel (moe_decode_kernel's OPT note)
// (here: its value, -1 where unset)
static int moe_dec_opt_env() {
    static const int v = getenv("LUNAR_MOE_DEC_OPT") ? atoi(getenv("LUNAR_MOE_DEC_OPT")) & 7 : -1;
    return v;
}

template <int NT, bool MX, bool GATEUP, int S, bool OPT>
static void decode_launch_o(const xargs &a, int slots, uint32_t opt, cudaStream_t st) {
    const int RT = 4 / S, nacc = (GATEUP ? 2 : 1) * NT * 4;
    const size_t smem = (S > 1 ? (size_t)4 * nacc * 32 * 4 : 0) +
                        (MX ? (size_t)DEC_STAGES * 2 * (GATEUP ? 2 : 1) * 128 * 20 : 0);
    static bool attr = false;
    if (!attr && smem > 48 * 1024) {
        CUDA_CHECK(cudaFuncSetAttribute(moe_decode_kernel<NT, MX, GATEUP, S, OPT>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        attr = true;
    }
    launch_pdl(moe_decode_kernel<NT, MX, GATEUP, S, OPT>, dim3(ceil_div_u(a.R / 16, RT), slots), dim3(128), smem, st,
               a, lunar_cuda_pdl_prefetch_bytes(2), opt);
}
template <int NT, bool MX, bool GATEUP, int S>
static void decode_launch_s(const xargs &a, int slots, cudaStream_t st) {
    const int env = moe_dec_opt_env();
    const uint32_t opt = env < 0 ? 7u : (uint32_t)env;
    const bool plain = opt == 0 || (!MX && !GATEUP && env < 0);
    if (plain) decode_launch_o<NT, MX, GATEUP, S, false>(a, slots, 0u, st);
    else decode_launch_o<NT, MX, GATEUP, S, true>(a, slots, opt, st);
}

// LUNAR_MOE_DEC_SPLIT=1|2: at most that many k-splits in the pair's gate/up kernel (for measuring:
// Kimi-Linear's K = 2304 is 18 chunks, 4 / 5 per warp at S = 4, 9 at S = 2); unset: 4. Measured at
// S = 2 (H200, Kimi-Linear batch 1): the BF16 pair 41.3 us vs 39.3, the step 2.68 / 2.71 ms vs 2.66:
// the balanced split loses to half the warps in flight.
static int gu_split_cap() {
    static int cap = -1;
    if (cap < 0) {
        const char *v = getenv("LUNAR_MOE_DEC_SPLIT");
        cap = v && (atoi(v) == 1 || atoi(v) == 2) ? atoi(v) : 4;
    }
    return cap;
}

template <int NT, bool MX, bool GATEUP>
static void decode_launch(const xargs &a, int slots, cudaStream_t st) {
    const int J = a.K / 128, S0 = J >= 8 ? 4 : J >= 4 ? 2 : 1, S = GATEUP && S0 > gu_split_cap() ? gu_split_cap() : S0;
    if (S == 4) decode_launch_s<NT, MX, GATEUP, 4>(a, slots, st);
    else if (S == 2) decode_launch_s<NT, MX, GATEUP, 2>(a, slots, st);
    else decode_launch_s<NT, MX, GATEUP, 1>(a, slots, st);
}

// One group of 8 tokens per pass (NT = 1: 126 registers, 4 blocks per SM, no spills); an expert
// with more rows takes more passes, its weights then coming from L2 again. At batch <= 64 over
// 256-896 experts an expert rarely has more than 8 rows.
template <bool MX, bool GATEUP>
static void decode_nt(const xargs &a, int n, int slots, cudaStream_t st) {
    decode_launch<1, MX, GATEUP>(a, slots, st);
}

template <bool MX, bool GATEUP>
static void gemm_launch(const xargs &a, int tiles, cudaStream_t st) {
    static bool attr = false;
    if (!attr) {
        CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_kernel<MX, GATEUP>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, GM_SMEM));
        attr = true;
    }
    dim3 grid(GATEUP ? a.R / 64 : a.R / 128, tiles);
    moe_gemm_kernel<MX, GATEUP><<<grid, 256, GM_SMEM, st>>>(a);
    CUDA_CHECK_LAUNCH();
}

// lunar_cuda_moe_split_event's event (the prefill and f16ab benchmarks' per-kernel times), or NULL
static cudaEvent_t g_split_event;
extern "C" void lunar_cuda_moe_split_event(lunar_cuda_event e) { g_split_event = (cudaEvent_t)e; }

// The MXFP4-only grouped GEMMs of cuda_moe_ws.cu (paths 14, 22, 24-26, 28, 32: the wy / wm kernels, which
// widen MXFP4 in the kernel); every other prefill path from 10 on is BF16-only.
static bool wy_path(int p) { return p == 14 || p == 22 || (p >= 24 && p <= 26) || p == 28 || p == 32; }

// LUNAR_MOE_ROWSTATS=N (measurement only): the first N grouped-GEMM calls of MXFP4 experts print
// their per-expert row counts (synchronizing the stream; none while it is captured) and the token
// rows each item form issues against the live ones: path 24 (256-row items, products per 64-row
// half), 25 (192-row items, N in multiples of 32) and 28's gate/up (24's full tiles, 25's rest of <= 192); of
// BF16 experts (path 29): its 128-row tiles, products per 64-row half
static int rows_cmp(const void *x, const void *y) { return *(const int *)x - *(const int *)y; }
static void rows_stats(const lunar_cuda_moe_route *r, cudaStream_t st, bool mx) {
    static int left = -1;
    if (left < 0) left = getenv("LUNAR_MOE_ROWSTATS") ? atoi(getenv("LUNAR_MOE_ROWSTATS")) : 0;
    if (left <= 0) return;  // off (the default): no runtime call on the prefill's path
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(st, &cs));
    if (cs != cudaStreamCaptureStatusNone) return;
    left--;
    const int E = r->E;
    int *off = (int *)malloc((size_t)(E + 1) * 4), *rows = (int *)malloc((size_t)E * 4);
    CUDA_REQUIRE(off && rows);
    CUDA_CHECK(cudaMemcpyAsync(off, r->offsets, (size_t)(E + 1) * 4, cudaMemcpyDeviceToHost, st));
    CUDA_CHECK(cudaStreamSynchronize(st));
    long live = 0, i24 = 0, i25 = 0, imix = 0, n24 = 0, n25 = 0, nmix24 = 0, nmix25 = 0;
    long i29 = 0, tl = 0, rest64 = 0;  // BF16: token rows issued by path 29, its tiles, tiles of <= 64 rows
    int active = 0, big = 0;
    const auto halves = [](int x) { return 64L * ((x + 63) / 64); };
    for (int e = 0; e < E; e++) {
        const int x = rows[e] = off[e + 1] - off[e], rest = x % 256;
        live += x, active += x > 0, big += x > 256;
        n24 += (x + 255) / 256, n25 += (x + 191) / 192;
        for (int t = 0; t < x; t += 256) i24 += halves(x - t < 256 ? x - t : 256);
        for (int t = 0; t < x; t += 192) i25 += ((x - t < 192 ? x - t : 192) + 31) & ~31;
        imix += 256L * (x / 256) + (rest > 192 ? 256 : (rest + 31) & ~31);
        nmix24 += x / 256 + (rest > 192), nmix25 += rest > 0 && rest <= 192;
        for (int t = 0; t < x && !mx; t += 128) {
            const int v = x - t < 128 ? x - t : 128;
            i29 += halves(v), tl++, rest64 += v <= 64;
        }
    }
    qsort(rows, (size_t)E, sizeof(int), rows_cmp);
    if (!mx) {
        fprintf(stderr,
                "lunar: moe rows (bf16): %ld over %d experts (%d active, %d over 256), rows min / p10 / median / p90 / "
                "max %d / %d / %d / %d / %d; %ld tiles, %ld of <= 64 rows; issued rows / live: path 29 %.3f\n",
                live, E, active, big, rows[0], rows[E / 10], rows[E / 2], rows[E - 1 - E / 10], rows[E - 1], tl, rest64,
                (double)i29 / (double)(live ? live : 1));
        free(off), free(rows);
        return;
    }
    fprintf(stderr,
            "lunar: moe rows: %ld over %d experts (%d active, %d over 256), rows min / p10 / median / p90 / max "
            "%d / %d / %d / %d / %d; issued rows / live: path 24 %.3f (%ld items), 25 %.3f (%ld), "
            "28 %.3f (%ld + %ld)\n",
            live, E, active, big, rows[0], rows[E / 10], rows[E / 2], rows[E - 1 - E / 10], rows[E - 1],
            (double)i24 / (double)(live ? live : 1), n24, (double)i25 / (double)(live ? live : 1), n25,
            (double)imix / (double)(live ? live : 1), nmix24, nmix25);
    free(off), free(rows);
}

// cuda_moe_bf16e.cu: the BF16 pair with the shorter block start-up where LUNAR_MOE_BF16_EARLY is set (1 if it
// launched both kernels, 0 if the caller runs the pair)
int moe_bf16_early_pair(const xargs &g, const xargs &d, int n, int slots, cudaStream_t st);

// yb: the down outputs in bf16 instead of ybuf where path is a wgmma grouped GEMM (their shared
// epilogue, cuda_moe.cuh), else -1 before any launch
static int experts_run(float *ybuf, uint16_t *yb, uint16_t *hbuf, const uint16_t *x, const lunar_cuda_moe_experts *w,
                       const lunar_cuda_moe_route *r, int path, lunar_cuda_stream s) {
    CUDA_REQUIRE(w->D % 128 == 0 && w->I % 128 == 0 && w->E == r->E);
    const int n = r->n, np = n * r->k;
    // path 16 keeps the activations in f16 (finite to 65504): its h between the two GEMMs is the
    // SiTU's output, |h| <= beta * beta_l; SwiGLU's (unbounded) or a SiTU without the clamp on u
    // would overflow, so those (and BF16 experts) run the pair instead
    const bool f16_ok = w->mxfp4 && w->act != 0 && w->beta_l > 0.0f && fabsf(w->beta) * w->beta_l <= 16384.0f;
    if (path == 0) {
        // Decode (docs/benchmarks.md "MoE decode (session 5, H200)"): the kernel pair, except MXFP4
        // experts: path 16 where f16_ok (below), else the warp-team kernels (path 8) for I >= 1024 at
        // 32+ tokens, where they measured 3-17 % faster than the pair (slower at 1-16 tokens, at I =
        // 384 and for BF16). LUNAR_MOE_DECODE=pair | v2 | fused | f16 forces one (the fused kernel
        // is correct but slower everywhere; f16 falls back to the pair where not f16_ok).
        static int dec = -1;
        if (dec < 0) {
            const char *v = getenv("LUNAR_MOE_DECODE");
            dec = v && !strcmp(v, "fused") ? 3 : v && !strcmp(v, "v2") ? 8 : v && !strcmp(v, "pair") ? 1
                  : v && !strcmp(v, "f16") ? 16 : 0;
        }
        // MXFP4 experts with a clamped SiTU (K3, K3.1): path 16, the pair on f16 tensor cores
        // (cuda_moe_f16.cu), measured 5-15 % faster than the pair and v2 at K3.1's shapes at 1-64
        // tokens (docs/benchmarks.md "MoE decode, MXFP4 instruction count (session 7, H200)")
        const int auto_dec = f16_ok ? 16 : w->mxfp4 && w->I >= 1024 && n >= 32 ? 8 : 1;
        // Prefill (n > 64): BF16 experts run the warp-specialised wgmma kernel with the SFU's
        // exp / tanh / division in its gate/up epilogue, its items taken from a global counter
        // (path 29, cuda_moe_ws.cu; path 12 with the static walk b, b + grid, ...), MXFP4 experts
        // the warp-specialised wgmma kernel that widens each weight chunk in its consumer
        // warpgroups once for two M tiles of an expert (path 22, cuda_moe_ws.cu: path 14 with a
        // shorter switch between items): measured on the
        // H200 at 8192 tokens, path 6 is 5-8 % faster than 4 on Kimi-Linear's BF16 shape and 20 %
        // slower on K3.1's MXFP4 ones (its single producer warpgroup widens the nibbles alone;
        // docs/benchmarks.md "MoE prefill, warp-specialised"), path 12 4 % faster than 6 with
        // Kimi-Linear's SwiGLU, 21 % with SiTU (docs/benchmarks.md "MoE prefill, round 4"), path 13
        // (the widening in the consumers, one M tile an item) 21-25 % faster than path 4 (the wgmma
        // kernel, cuda_moe_wg.cu, MXFP4's default before) on K3.1's shapes (docs/benchmarks.md "MoE
        // prefill, MXFP4 in the consumer warps"), and path 14 9-17 % faster than 13 there
        // (docs/benchmarks.md "MoE prefill, MXFP4 round 2"; path 13 removed in session 9), path
        // 22 3-17 % faster than 14 (docs/benchmarks.md "MoE prefill, MXFP4 round 3").
        // LUNAR_MOE_PREFILL=ws / wg / old force path 6 / 4 / 2 (the mma.sync kernel) for both
        // kinds, =wsc path 7 (path 6 in clusters of 2 sharing the BF16 weight tiles; measured 30 %
        // slower than 6, kept opt-in), =wsf path 10 for BF16 experts (path 6 with the consumers'
        // per-chunk proxy fence moved to the producer; measured 0-6 % slower than 6, kept opt-in),
        // =wsfast path 12 for BF16 experts (the default until session 13: path 29 below), =wsmx2
        // path 14 for MXFP4 experts, =wsmc path 17 for BF16 experts (path 12's kernel in clusters of 2 sharing the weight tiles by
        // TMA multicast, the odd tiles paired without; opt-in), =wsmc2 path 18 (17 with CTA-scope
        // remote releases); the other kind keeps its default under wsf / wsfast / wsmx2 / wsmc /
        // wsmc2. Path 22 (path 14 with the down epilogue's row weights loaded once per item and the
        // next item looked up before the drain: the TP8 slice's down kernel 30 % faster, its 8K
        // prefill 4.5 %; docs/benchmarks.md "MoE prefill, MXFP4 round 3") is MXFP4's default since
        // session 10 (24 since session 11: 22 with fp32 rows; 28 since session 13); =wsmx2 forces
        // path 14, =wsmxe path 22 (BF16 experts keep 12 under both). Any other value (wsmx, path
        // 13's, session 10's removed wsmxd / wsmxp / wsmxdp / wsmxes, session 13's wsmxh, path 27,
        // and session 14's wsbfr, path 30, among them) runs the defaults, with a note on stderr once.
        // Path 24 (=wsmxb), MXFP4's default since session 11: path 22 whose down kernel writes the
        // bf16 rows (the forward's default for MXFP4 experts, LUNAR_MOE_YBUF) from shared memory by bulk
        // copies, with fp32 rows path 22 itself: with bf16 rows the K3.1 TP8 slice's down kernel 1.50 ->
        // 1.44 ms against 22's fp32 rows (1.59 with 22's own bf16 stores), its 8K prefill 2.2 % faster
        // (docs/benchmarks.md "MoE prefill, MXFP4 round 4"). =wsmxm: path 25 (session 12: the weights
        // as wgmma's M, cuda_moe_ws.cu moe_wm_kernel), =wsmxg: path 26 (25's gate/up, 24's down); both
        // opt-in: the model's 8K prefill measured +1.5 % / +0.1 % against 24 (docs/benchmarks.md "MoE
        // prefill, MXFP4 with the weights as M"). Path 28 (=wsmxhb), MXFP4's default in session
        // 13: the gate/up GEMM's full 256-row tiles of each expert by path 24's kernel, its rest of
        // <= 192 rows by path 25's (cuda_moe_ws.cu, WX_REM), path 24's down: both GEMMs 4-6 % faster
        // than 24 at the bench's balanced routing, 0.5-1 % with ~585-row experts, the K3.1 TP8 slice's
        // 8K prefill 1.1 % (docs/benchmarks.md "MoE prefill, MXFP4: path 24 or 25 per item"); =wsmxb
        // keeps path 24. Path 27 (=wsmxh then: the split in the down GEMM too) measured slower than
        // 28 and was removed. Path 32 (=wsmxdh), MXFP4's default since session 14: path 28 whose down
        // kernel copies no A rows of the 64-row halves no product reads (cuda_moe_ws.cu, HALF): the
        // down kernel 1.4 % (TP8 slice) / 2.8 % (K3.1) faster (docs/benchmarks.md "MoE prefill, MXFP4
        // down GEMM: dead halves"); =wsmxhb keeps path 28.
        // Path 29 (=wsdyn), BF16's default since session 13:
        // path 12's kernels taking their items from a global counter, so that an expert's M tiles
        // read each weight tile within a few us of each other, from L2: Kimi-Linear-48B's 8K
        // prefill, gate/up 1307 -> 1170 us a layer (DRAM read 4080 -> 2735 MB), down 737 -> 678
        // us, the prefill 4.2-5.5 % faster (docs/benchmarks.md "MoE prefill BF16, items by a counter");
        // =wsfast keeps path 12.
        static int pre = -1;  // 0: by weight kind
        if (pre < 0) {
            const char *e = getenv("LUNAR_MOE_PREFILL");
            pre = !e                   ? 0
                  : !strcmp(e, "old") ? 2
                  : !strcmp(e, "ws")  ? 6
                  : !strcmp(e, "wsc") ? 7
                  : !strcmp(e, "wsf") ? 10
                  : !strcmp(e, "wsfast") ? 12
                  : !strcmp(e, "wsmx2") ? 14
                  : !strcmp(e, "wsmc") ? 17
                  : !strcmp(e, "wsmc2") ? 18
                  : !strcmp(e, "wsmxe") ? 22
                  : !strcmp(e, "wsmxb") ? 24
                  : !strcmp(e, "wsmxm") ? 25
                  : !strcmp(e, "wsmxg") ? 26
                  : !strcmp(e, "wsmxhb") ? 28
                  : !strcmp(e, "wsmxdh") ? 32
                  : !strcmp(e, "wsdyn") ? 29
                  : !strcmp(e, "wg")  ? 4
                                      : 0;
            if (e && !pre)
                fprintf(stderr, "lunar: LUNAR_MOE_PREFILL=%s is not a prefill path (%s): the defaults run\n", e,
                        !strcmp(e, "wsmx")    ? "path 13, removed in session 9; wsmx2 is path 14"
                        : !strcmp(e, "wsbfr") ? "path 30, removed in session 14: git show b3593ac"
                                              : "old | wg | ws | wsc | wsf | wsfast | wsdyn | wsmx2 | wsmxe | wsmxb | wsmxm | wsmxg | wsmxhb | wsmxdh | wsmc | wsmc2");
        }
        const bool mxp = wy_path(pre);  // the MXFP4-only paths; the others BF16-only from 10 on
        const int pre_k = pre >= 10 ? (w->mxfp4 ? (mxp ? pre : 32) : mxp ? 29 : pre) : pre;
        path = n > 64 ? (pre_k ? pre_k : w->mxfp4 ? 32 : 29) : dec ? dec : auto_dec;
    }
    if (path == 3 && !w->mxfp4) path = 1;  // the fused kernel widens MXFP4 only
    if (wy_path(path) && !w->mxfp4) path = 29;  // MXFP4 widened in the kernel: BF16's default
    if (path == 16 && !f16_ok) path = 1;     // MXFP4 with a bounded h only (above)
    // paths 1, 3, 8, 9, 16: decode kernels (n <= 64); 2, 4-7, 10-12, 14 and 22 (path 14 with
    // the faster item switch): the grouped GEMMs (any n); 17, 18: path 12 in clusters of 2 sharing
    // the BF16 weight tiles (MXFP4: path 6, as 7); 24: path 22 with the bf16 down rows by bulk copies;
    // 25, 26: the weights as wgmma's M; 28: 24 and 25 per gate/up item (an expert's full tiles, its
    // rest), 24's down. 27 (28 with the split in the down GEMM too) was removed in session 13. 32: 28
    // with no A copies for the down kernel's dead 64-row halves.
    // 13 (session 7's MXFP4 kernel, superseded by 14), 15, 19-21 and 23 (session 10's slower variants
    // of 14, removed) are no paths. 29: path 12 with its items taken from a counter. 30 (29 with an
    // expert's short tiles multiplied with the weights as wgmma's M; measured level with 29) was
    // removed in session 14 (git show b3593ac).
    const bool mc = path == 17 || path == 18, wy = wy_path(path);
    const bool ws = path == 6 || path == 7 || (path >= 10 && path <= 12) || path == 29 || wy || mc,
               dec2 = path == 8 || path == 9;
    CUDA_REQUIRE(((path >= 1 && path <= 12) || (path >= 16 && path <= 18) || path == 29 || wy_path(path)) &&
                 (path == 2 || (path >= 4 && path <= 7) || ws || n <= 64));
    if (yb && !(ws || path == 4 || path == 5)) return -1;
    // the shared expert as routed row E (BF16, one token): only the decode kernels know row E
    CUDA_REQUIRE(!w->s1 || (!w->mxfp4 && (n > 1 || path == 1 || dec2)));
    cudaStream_t st = to_stream(s);
    if (wy || path == 29) rows_stats(r, st, w->mxfp4 != 0);
    xargs a;
    memset(&a, 0, sizeof a);
    a.offsets = r->offsets, a.active = r->active, a.counts = r->counts, a.tiles = r->tiles;
    a.row_token = r->row_token, a.row_weight = r->row_weight;
    a.E = w->E, a.act = w->act, a.beta = w->beta, a.beta_l = w->beta_l;
    // gate/up
    xargs g = a;
    g.wq[0] = w->w1q, g.ws[0] = w->w1s, g.wq[1] = w->w3q, g.ws[1] = w->w3s;
    g.wb[0] = w->w1, g.wb[1] = w->w3;
    g.sb[0] = w->s1, g.sb[1] = w->s3;
    g.R = w->I, g.K = w->D, g.x = x, g.h = hbuf;
    xargs d = a;
    d.wq[0] = w->w2q, d.ws[0] = w->w2s, d.wb[0] = w->w2, d.sb[0] = w->s2;
    d.R = w->D, d.K = w->I, d.x = hbuf, d.y = ybuf, d.yb = yb;
    if (dec2) {
        moe_dec2_experts(g, d, w->mxfp4 != 0, r->groups, path == 9 ? 3 : 0, st);
    } else if (path == 3) {
        // 256-column stages x 3: 3 blocks (12 warps) per SM. Measured at batch 1, K3.1: 256 x 4
        // (2 blocks per SM) 244 us, 256 x 3 199 us, 128 x 6 200 us; the pair 136 us.
        fused_launch<256, 3>(g, d, r, st);
    } else if (path == 16) {
        const int nE = w->E + (w->s1 != NULL), slots = np < nE ? np : nE;
        moe_f16_decode(g, d, slots, n, st, g_split_event, r->settled != 0);
    } else if (path == 1) {
        // active experts: at most E, plus the shared expert's row E where it exists (a route with
        // k + 1 > E rows: session 5's forward failure when this cap left it out)
        const int nE = w->E + (w->s1 != NULL), slots = np < nE ? np : nE;
        if (w->mxfp4) {
            decode_nt<true, true>(g, n, slots, st);
            decode_nt<true, false>(d, n, slots, st);
        } else if (!moe_bf16_early_pair(g, d, n, slots, st)) {  // LUNAR_MOE_BF16_EARLY (cuda_moe_bf16e.cu)
            decode_nt<false, true>(g, n, slots, st);
            decode_nt<false, false>(d, n, slots, st);
        }
    } else if (ws && moe_ws_experts(g, d, w->mxfp4 != 0, max_tiles(n, r->k, w->E),
                                    path == 7 ? 1 : path >= 10 ? path - 8 : 0, st, g_split_event)) {
        // done (shapes it does not take, or a refused tensor map: path 4 below). Every path from 10 is
        // moe_ws_experts' mode path - 8 (cuda_moe.cuh); session 13's merge renumbered path 27 to 29 but
        // left its mode at 19, so BF16's prefill default ran path 6's kernels until session 14
        // (docs/benchmarks.md "BF16 grouped GEMMs: the short tiles with the weights as M")
    } else if ((path >= 4 && path <= 7) || ws) {
        moe_wg_experts(g, d, w->mxfp4 != 0, max_tiles(n, r->k, w->E), path == 5, st);
    } else {
        const int tiles = max_tiles(n, r->k, w->E);
        if (w->mxfp4) {
            gemm_launch<true, true>(g, tiles, st);
            gemm_launch<true, false>(d, tiles, st);
        } else {
            gemm_launch<false, true>(g, tiles, st);
            gemm_launch<false, false>(d, tiles, st);
        }
    }
    return 0;
}
extern "C" void lunar_cuda_moe_experts_run(float *ybuf, uint16_t *hbuf, const uint16_t *x,
                                           const lunar_cuda_moe_experts *w, const lunar_cuda_moe_route *r, int path,
                                           lunar_cuda_stream s) {
    experts_run(ybuf, NULL, hbuf, x, w, r, path, s);
}
extern "C" int lunar_cuda_moe_experts_run_b(uint16_t *ybuf, uint16_t *hbuf, const uint16_t *x,
                                            const lunar_cuda_moe_experts *w, const lunar_cuda_moe_route *r, int path,
                                            lunar_cuda_stream s) {
    CUDA_REQUIRE(ybuf != NULL);
    return experts_run(NULL, ybuf, hbuf, x, w, r, path, s);
}

// add (or NULL): [n, D] added to each sum after it (the shared experts' output: one launch fewer).
// One thread per 4 columns, the block's k pair rows read once into shared memory and the k row
// loads issued 8 at a time: at one token the kernel is a chain of dependent loads (pair_row, then
// rows), which one block walking the row 4 columns x 256 threads at a time made 8.9 us long (3.7 us
// now: Kimi-Linear B = 1, ncu, docs/benchmarks.md session 6). The sum's order (j = 0..k-1, then add)
// is unchanged.
constexpr int kCombineThreads = 64;
// 4 columns of an expert's output row as loaded (raw) and as summed: fp32, or bf16 rows (LUNAR_MOE_YBUF=bf16)
// in 8-byte loads, widened exactly after all of a group's loads are issued
template <typename R> struct combine_row;
template <> struct combine_row<float> {
    using raw = float4;
    static __device__ __forceinline__ float4 widen(float4 v) { return v; }
};
template <> struct combine_row<uint16_t> {
    using raw = uint2;
    static __device__ __forceinline__ float4 widen(uint2 v) { return bf16x4_to_f32(v); }
};
template <typename R>  // R: float or uint16_t (bf16) rows, the same sums in the same order
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(float *acc, const R *ybuf,
                                                                      const int32_t *pair_row, int k, int D,
                                                                      const float *add) {
    extern __shared__ int32_t prow[];
    pdl_enter();
    const int t = blockIdx.x, i = (blockIdx.y * kCombineThreads + threadIdx.x) * 4;
    for (int j = threadIdx.x; j < k; j += kCombineThreads) prow[j] = pair_row[(size_t)t * k + j];
    __syncthreads();
    if (i >= D) return;
    float4 s = make_float4(0, 0, 0, 0);
    for (int j0 = 0; j0 < k; j0 += 8) {
        typename combine_row<R>::raw v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j0 + j < k) v[j] = *(const typename combine_row<R>::raw *)(ybuf + (size_t)prow[j0 + j] * D + i);
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j0 + j < k) {
                const float4 f = combine_row<R>::widen(v[j]);
                s.x += f.x, s.y += f.y, s.z += f.z, s.w += f.w;
            }
    }
    if (add) {
        const float4 a = *(const float4 *)(add + (size_t)t * D + i);
        s.x += a.x, s.y += a.y, s.z += a.z, s.w += a.w;
    }
    *(float4 *)(acc + (size_t)t * D + i) = s;
}
extern "C" void lunar_cuda_moe_combine_add_b(float *acc, const uint16_t *ybuf, const lunar_cuda_moe_route *r, int D,
                                             const float *add, lunar_cuda_stream s) {
    CUDA_REQUIRE(D % 4 == 0 && ((uintptr_t)add & 15) == 0 && ((uintptr_t)ybuf & 7) == 0);
    const unsigned cols = (unsigned)((D / 4 + kCombineThreads - 1) / kCombineThreads);
    launch_pdl(moe_combine_kernel<uint16_t>, dim3(r->n, cols), dim3(kCombineThreads), (size_t)r->k * sizeof(int32_t),
               to_stream(s), acc, ybuf, r->pair_row, r->k, D, add);
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_moe_combine(float *acc, const float *ybuf, const lunar_cuda_moe_route *r,
                                       int D, lunar_cuda_stream s) {
    lunar_cuda_moe_combine_add(acc, ybuf, r, D, NULL, s);
}
extern "C" void lunar_cuda_moe_combine_add(float *acc, const float *ybuf, const lunar_cuda_moe_route *r, int D,
                                           const float *add, lunar_cuda_stream s) {
    CUDA_REQUIRE(D % 4 == 0 && ((uintptr_t)add & 15) == 0);
    const unsigned cols = (unsigned)((D / 4 + kCombineThreads - 1) / kCombineThreads);
    launch_pdl(moe_combine_kernel<float>, dim3(r->n, cols), dim3(kCombineThreads), (size_t)r->k * sizeof(int32_t),
               to_stream(s), acc, ybuf, r->pair_row, r->k, D, add);
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------- the latent routed path

extern "C" size_t lunar_cuda_moe_layer_ws(int n, int H, int k, const lunar_cuda_moe_experts *w) {
    const size_t np = (size_t)n * k;
    return lunar_cuda_moe_route_bytes(n, k, w->E) + al256((size_t)n * w->E * 4) +
           al256((size_t)n * w->D * 2) * 2 + al256(np * w->I * 2) + al256(np * w->D * 4) +
           al256((size_t)n * w->D * 4);
}

extern "C" void lunar_cuda_moe_layer(void *y, lunar_cuda_dtype ydt, const uint16_t *x, int n, int H,
                                     const uint16_t *router, const float *bias, int k, int n_group,
                                     int topk_group, int renorm, float scale,
                                     const uint16_t *down, const uint16_t *norm, float eps,
                                     const uint16_t *up, const lunar_cuda_moe_experts *w, int path,
                                     void *ws, lunar_cuda_stream s) {
    if (n <= 0) return;
    const int E = w->E, Lat = w->D;
    const size_t np = (size_t)n * k;
    char *p = (char *)ws;
    lunar_cuda_moe_route r;
    lunar_cuda_moe_route_init(&r, p, n, k, E);
    p += lunar_cuda_moe_route_bytes(n, k, E);
    float *logits = (float *)p;
    p += al256((size_t)n * E * 4);
    uint16_t *z = (uint16_t *)p;
    p += al256((size_t)n * Lat * 2);
    uint16_t *zn = (uint16_t *)p;
    p += al256((size_t)n * Lat * 2);
    uint16_t *hbuf = (uint16_t *)p;
    p += al256(np * w->I * 2);
    float *ybuf = (float *)p;
    p += al256(np * Lat * 4);
    float *acc = (float *)p;
    lunar_cuda_matmul(logits, LUNAR_CUDA_F32, x, router, n, E, H, s);
    lunar_cuda_router_topk(r.experts, r.weights, logits, bias, n, E, k, n_group, topk_group,
                           renorm, scale, s);
    lunar_cuda_moe_permute(&r, s);
    lunar_cuda_matmul(z, LUNAR_CUDA_BF16, x, down, n, Lat, H, s);
    r.settled = 1;  // the permutation ran a launch before the latent projection above
    lunar_cuda_moe_experts_run(ybuf, hbuf, z, w, &r, path, s);
    lunar_cuda_moe_combine(acc, ybuf, &r, Lat, s);
    if (norm) lunar_cuda_rmsnorm(zn, LUNAR_CUDA_BF16, acc, norm, n, Lat, eps, s);
    else lunar_cuda_f32_to_bf16(zn, acc, (size_t)n * Lat);
    lunar_cuda_matmul(y, ydt, zn, up, n, H, Lat, s);
}
