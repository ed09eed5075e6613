// The MXFP4 MoE decode pair on f16 tensor cores (path 16, LUNAR_MOE_DECODE=f16; issue 8, session 7).
//
// Why: Nsight Compute on the pair of cuda_moe.cu (path 1) has its MXFP4 consumer issue-bound
// (docs/benchmarks.md "MoE decode, bytes in flight"): 525 SASS instructions per 2176-byte chunk in
// the chunk loop, ~330 of them the widening (per bf16x2 pair: two shifts, a mask, a merge and a
// bf16 multiply by the block scale, which also lifts the E = 0 values out of the bf16 subnormals).
// This kernel keeps the pair's grid, ring, split-K and epilogue and changes the consumer:
//
//  1. f16, not bf16. A nibble S E1 E0 M with S at bit 7 and E1 E0 M at bits 3..1 of a byte is the
//     E5M2 byte of E2M1 x 2^-14 (E = 0: the E5M2 subnormals, exact), and an E5M2 byte is the high
//     byte of the f16 of the same value. So a word of 8 nibbles becomes two words of 4 such bytes
//     with word-wide logic (H: the high nibble of each byte, 3 operations; L: the low ones, 4),
//     and each f16x2 is one prmt putting two of those bytes into the high bytes of the halves:
//     11 instructions per 8 weights, no multiply. f16 mma products of these (subnormal) weights
//     with f16 activations are exact in the fp32 accumulators.
//  2. The E8M0 scale after the mma, in fp32: the mma's k range is one 32-column scale block (the
//     4 lanes of a quad hold its 4 words of a row), each block's two mmas go into fresh
//     accumulators, and acc += 2^(s-126) * block (4 FFMA per matrix and block, the factor built
//     from the scale byte by two integer operations), the remaining 2^13 once in the epilogue. No
//     second-multiply path: 2^(s-126) is an exact fp32 normal for every s <= 253 (s = 254 and the
//     NaN code 255 give inf; the CPU op's weights of s = 254 are 2^126 .. 3 x 2^127).
//  3. The ring is the pair's (each lane copies its own 16-byte block of each row, one per 32
//     columns), written at a swizzled slot and read back with one ldmatrix.x4 per row and matrix:
//     matrix b's row g is lane (g, b)'s copy, so lane (g, c) receives word c of block b for every
//     b, conflict-free (slot = 4 g + (b ^ (g / 2 % 4)): 8 rows of a matrix fill 8 distinct
//     16-byte bank groups).
//  4. The activations (bf16) become f16 per chunk (two integer operations and one cvt per f16x2,
//     the pair order folded into the packing). f16 holds every bf16 of magnitude 2^-14 .. 65504
//     exactly (smaller ones to 2^-25 absolute); larger ones would become inf. The gate/up kernel
//     writes h in f16 for the down kernel (whose activations then need no conversion), so the path
//     runs only where h is bounded: a SiTU with the clamp on u, |h| <= beta * beta_l (K3, K3.1:
//     4 x 25); SwiGLU experts run the pair (cuda_moe.cu f16_ok; the op tests' SwiGLU weights give
//     |h| > 65504). The latent (RMS-normed) is assumed below 65504 in magnitude.
//
// Pair order: L holds e(n0), e(n2), e(n4), e(n6), H e(n1), e(n3), e(n5), e(n7), so the four f16x2
// of a word are (n0, n2), (n4, n6), (n1, n3), (n5, n7): mma 1 of the block takes the first two at
// logical k (2c, 2c + 1) and (2c + 8, 2c + 9), mma 2 the last two; the activations of the lane's
// 8 columns are packed in the same pairs (a dot product does not care which physical column each
// logical k holds, only that both operands agree).
#include <cuda_fp16.h>

#include "backend/cuda/cuda_moe.cuh"

namespace {

constexpr int ST = 4;  // ring stages, as the pair

__device__ __forceinline__ void mma_f16(float *d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// 8 E2M1 nibbles -> f16x2 (n0, n2), (n4, n6), (n1, n3), (n5, n7), each value E2M1 x 2^-14 (top note)
__device__ __forceinline__ void widen_f16(uint32_t q, uint32_t *p) {
    const uint32_t h = (q & 0x80808080u) | ((q >> 3) & 0x0e0e0e0eu);
    const uint32_t l = ((q << 4) & 0x80808080u) | ((q << 1) & 0x0e0e0e0eu);
    p[0] = prmt(l, 0u, 0x1404);
    p[1] = prmt(l, 0u, 0x3424);
    p[2] = prmt(h, 0u, 0x1404);
    p[3] = prmt(h, 0u, 0x3424);
}

__device__ __forceinline__ uint32_t f16x2_of(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
// 8 bf16 activations (columns 0..7) -> f16x2 (x0, x2), (x4, x6), (x1, x3), (x5, x7)
__device__ __forceinline__ void x_f16(uint4 u, uint32_t *p) {
    p[0] = f16x2_of(gv_lo(u.x), gv_lo(u.y));
    p[1] = f16x2_of(gv_lo(u.z), gv_lo(u.w));
    p[2] = f16x2_of(gv_hi(u.x), gv_hi(u.y));
    p[3] = f16x2_of(gv_hi(u.z), gv_hi(u.w));
}

// 2^(s - 126) for scale byte b of w (exact for s <= 253): the byte by prmt, then (s + 1) << 23 in one IMAD
__device__ __forceinline__ float scale_f(uint32_t w, int b) {
    return __uint_as_float(prmt(w, 0u, 0x4440u + (uint32_t)b) * 0x800000u + 0x800000u);
}
// 8 f16 activations (columns 0..7, the down GEMM's h of this path) -> the same pairs as x_f16
__device__ __forceinline__ void x_pairs(uint4 u, uint32_t *p) {
    p[0] = prmt(u.x, u.y, 0x5410);
    p[1] = prmt(u.z, u.w, 0x5410);
    p[2] = prmt(u.x, u.y, 0x7632);
    p[3] = prmt(u.z, u.w, 0x7632);
}

// V, the kernel's variants of issue 8, session 16 (host switches at the launch below; V = 0 is the kernel
// as it was, the same PTX instructions but two comparisons written mirrored: tools/ptx_same.py). Each
// runs with the activations in shared memory (XS) and the flat ring (MT, also at one row group a block)
// only (docs/benchmarks.md "MoE decode, MXFP4, at one token: the copy ring (session 16)").
//  V_IL, interleaved k-splits (the default at one token): warp ks of a row tile takes chunks ks, ks + S,
//    ks + 2 S, ... instead of the contiguous range j0 .. j1 - 1, so the S warps of a tile ask at about the
//    same time for S neighbouring 64-byte pieces of each row (S = 4: 256 bytes, two whole 128-byte lines)
//    instead of 4 pieces 448 bytes apart. Why: the copy ring alone (V_CO) streams K3.1's layer at one
//    token in 94 us of the pair's 111 (V = 0), and in 84 us with V_IL; the widening is hidden (V_NW: no
//    faster). The partial sums hold other chunks, so the stored values differ from V = 0 in the last bits
//    (tested against the CPU op; the same bits at every TILES).
//  V_NW, V_CO (LUNAR_MOE_F16_SKIP; WRONG results, benchmark only): the raw packed words into the mma
//    without the widening; the copy ring alone (each chunk waited for and its stage refilled, nothing
//    read or computed). Session 15's deciding split (git show 167f51f), on the flat ring.
//  V_CS (LUNAR_MOE_F16_SKIP=3; WRONG results, benchmark only): the consumers alone, no weight copies at all:
//    every chunk's ldmatrix, widening and mma on whatever the ring holds. Against V_CO it splits the pair's
//    time: if the consumers alone take about the pair's time, their own chain is the bound and a producer
//    warp cannot help; if well under the ring alone, it is the overlap (session 16's s16-mx4b: the pair 104,
//    the ring alone 84 us on K3.1). Measured (H200, session 17, docs/benchmarks.md "MoE decode, MXFP4, at one
//    token: the consumers alone (session 17)"): K3.1 the consumers alone 83.2 us = the ring alone 82.7, the pair
//    103.7; ncu has them ALU-bound (the down kernel 2.4 math-pipe-throttle stalls an instruction). So copies
//    that do not wait on the consumers cannot by themselves bring K3.1 below ~83 us: fewer consumer
//    instructions first.
// Measured and left out (git show 1d05510): V_W (gate and up in separate warps of 8-warp gate/up blocks at
// 80 registers, 24 warps per SM in both kernels: level on K3.1, +4 % on the TP8 slice) and V_S8 (8
// interleaved k-splits in 8-warp blocks, 512 bytes of each row at a time: +14 % on K3.1).
// Also left out: V_CV (session 17, opt-in LUNAR_MOE_F16_CV=1 until session 19, git show 1ff0730): the
// widening's 4 prmt per word as 4 cvt.rn.f16x2.e5m2x2, the same bits; measured (H200, docs/benchmarks.md "MoE
// decode, MXFP4, at one token: fewer ALU instructions (session 17)") level on K3.1, the TP8 slice's pair
// -1 %: the conversion takes the prmt's issue slot. And (git show ede4ded) V_HI, h's right shift as IMAD.HI
// (mul.hi by 2^29, the FMA pipe): +2.5 % on K3.1, +4 % alone.
constexpr int V_IL = 1, V_NW = 8, V_CO = 16, V_CS = 32;

// grid (row groups, active-expert slots), 128 threads = RT row tiles of 16 x S k-splits, as the pair
// (cuda_moe.cu moe_decode_kernel, MXFP4, one group of 8 tokens per pass).
// opt: LUNAR_MOE_DEC_OPT's bits (cuda_moe.cu; unset: all). Bit 1: the down kernel's row weights
// loaded at the start of each pass, not in the epilogue behind each previous store (y might alias
// them). Bit 2: the ring's first ST chunks are issued as soon as the expert is known, before the
// offsets / row_token / activation loads (the weights depend on the expert only); the session-7
// kernel issued them after that chain, one L2 round trip or two later in every block. Measured (H200,
// decode bench, batch 1): K3.1 118.8 us vs 121.0, the TP8 slice 27.1 vs 28.3 (docs/benchmarks.md
// "MoE decode at batch 1, round 3 (session 8)").
// XS (LUNAR_MOE_F16_XS, launch below): each pass first converts its tokens' activation rows once
// into shared memory (xs: [rows][K / 8 + 4] uint4 after the ring), each 8 columns already as the
// mma's four f16x2 (x_f16 / x_pairs, the same functions on the same bits as the per-chunk path, so
// the products and sums are bit-identical); the chunk loop then reads one uint4 per block and lane
// from shared memory instead of a global load and 12 (gate/up) or 4 (down) conversion instructions.
// The row pitch's 4 extra uint4 (64 bytes) put rows g and g + 1 in opposite halves of the 128-byte
// bank window, so a quarter warp's 128-bit reads (lanes g, g + 1 x c = 0..3) never conflict.
// MT (LUNAR_MOE_F16_TILES, launch below; issue 8, session 9): the block walks tpb row groups of RT
// tiles (rows 16 RT tpb blockIdx.x + 16 (RT u + rt) + 0..15 for u = 0 .. tpb - 1), each warp's ring
// running on across them: chunk after chunk of one flat sequence (u, j), so the next group's first
// ST chunks are in flight while a group's last chunks are widened, reduced (S > 1) and stored. Why:
// K3.1 at batch 1 runs 5.8 (gate/up) and 6.8 (down) waves of short blocks (7 and 6 chunks a warp),
// each paying the route chain, the first ring fill's full latency, the activation rows' conversion
// and the reduction's barriers. Two groups a block halve those (K3.1 -5 %); more lose again (one
// wave of 6-7 groups a block: +0.5 %), and a grid under one wave loses its warps (launch below).
// The sums of each tile are the same operations in the same order (bit-identical to MT = false).
template <bool GATEUP, int S, bool XS, bool MT, int V = 0>
__global__ void __launch_bounds__(128, 4) moe_decode_f16_kernel(xargs a, uint32_t pf, uint32_t opt, int tpb) {
    constexpr int NM = GATEUP ? 2 : 1, RT = 4 / S, NACC = NM * 4;
    // V (note above); JS: a warp's chunk stride
    constexpr bool IL = V & V_IL, NW = V & V_NW, CO = V & V_CO, CS = V & V_CS;
    constexpr int JS = IL ? S : 1;
    static_assert(V == 0 || (XS && MT), "the variants run with XS and the flat ring only");
    const int T = MT ? tpb : 1;  // row groups of this block
    // EARLY (LUNAR_MOE_F16_EARLY, launch below; issue 8, session 10): a block's start-up is a chain
    // of dependent loads (count, expert id, ring fill, offsets, row_token, activations), paid once
    // per block and serially per wave; at the TP8 slice (7 chunks a warp in gate/up, 3 in down) it
    // is most of the kernel. Bit 1 (opt bit 8; down kernel, with opt bit 2): the ring's first fill
    // and the expert's offsets before griddepcontrol.wait. The weights are no kernel's output, and
    // the expert id and offsets come from the route, written two launches back (cuda_common.cuh's
    // rule, as the L2 prefetch below): under PDL the down blocks that become resident beside the
    // gate/up kernel's tail (its grid is < 1 wave at the TP8 slice) have their first ST chunks (at K
    // = 384 all 3 of a warp) in flight while it finishes. Bit 2 (opt bit 16): counts[E] and
    // active[slot] loaded together (active has E entries >= the grid's slots; the value is used
    // only for a live slot), not behind the branch on the count: one dependent round trip less
    // before the first fill in both kernels. Bit 4 (opt bit 32, set by the host only for one
    // token): the route of one token gives each of its experts one row, at offsets[e] = the
    // expert's slot (offsets are the exclusive scan of counts, the active list the experts in
    // order) and row_token = 0, so neither is loaded (two round trips less in gate/up, one in down).
    const bool pre = !GATEUP && (opt & 8u) && (opt & 4u), one = (opt & 32u) != 0;
    extern __shared__ __align__(16) float red[];  // [4 warps][NACC][32] when S > 1, then the ring
    float *ring = red + (S > 1 ? 4 * NACC * 32 : 0);
    // before the wait only L2 prefetches of this block's expert rows (the pair's rule, cuda_moe.cu)
    if (pf && threadIdx.x == 0 && !GATEUP && (int)blockIdx.y < a.counts[a.E]) {
        const int e = a.active[blockIdx.y];
        if (e >= 0 && e < a.E) {
            const int rows = min(RT * T * 16, a.R - (int)blockIdx.x * RT * T * 16);
            const size_t r0 = (size_t)blockIdx.x * RT * T * 16, estr = (size_t)a.R * a.K;
            pdl_prefetch_l2(a.wq[0] + e * estr / 2 + r0 * (a.K / 2),
                            (uint32_t)min((size_t)pf, (size_t)rows * a.K / 2) & ~15u);
            pdl_prefetch_l2(a.ws[0] + e * estr / 32 + r0 * (a.K / 32), (uint32_t)((size_t)rows * a.K / 32) & ~15u);
        }
    }
    const int slot = blockIdx.y;
    bool waited = !pre;
    if (!pre) pdl_wait();
    int e = -1;
    bool slot_live;
    if (pre || (opt & 16u)) {
        const int cnt = a.counts[a.E], ev = a.active[slot];
        slot_live = slot < cnt, e = ev;
    } else {
        slot_live = slot < a.counts[a.E];
        if (slot_live) e = a.active[slot];
    }
    // pre: a block that returns or holds an id out of range (never, from the route) waits here,
    // before anything else (every block waits: the chain stays transitive)
    if (!waited && (!slot_live || e < 0 || e >= a.E)) pdl_wait(), waited = true;
    if (!slot_live) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int rt = warp / S, ks = warp % S;
    const int tile = blockIdx.x * RT * T + rt;
    const bool tile_ok = tile * 16 < a.R;
    const int J = a.K / 128, j0 = ks * J / S, j1 = (ks + 1) * J / S;
    // MT: this warp's live row groups (u < nt: tile + RT u inside R)
    const int nt = MT && tile_ok ? min(T, ((a.R - 1) / 16 - tile) / RT + 1) : (int)tile_ok;
    const int ra = tile * 16 + g, rb = ra + 8;
    const size_t estr = (size_t)a.R * a.K;
    // ring slots: uint4 [ST][2 NM][128]; lane (g, c) writes slot 4 g + (c ^ (g / 2 % 4)) of its warp
    uint4 *rw = (uint4 *)ring;
    uint32_t *rs = (uint32_t *)(rw + ST * 2 * NM * 128);  // scale words [ST][2 NM][128], own slots
    const int tid = threadIdx.x;
    const int wslot = warp * 32 + 4 * g + (c ^ ((g >> 1) & 3));
    // ldmatrix: lane L gives row L % 8 of matrix L / 8 = the slot of lane (L % 8, L / 8)
    const int lr = lane & 7, lm = lane >> 3;
    const uint32_t rbase = (uint32_t)__cvta_generic_to_shared(rw + warp * 32 + 4 * lr + (lm ^ ((lr >> 1) & 3)));
    uint4 *xs = (uint4 *)(rs + ST * 2 * NM * 128);  // XS: the pass's activation rows (top of the kernel)
    const int K8 = a.K / 8, xpitch = K8 + 4;
    const mx_ring_src<NM> src(a, e, estr, ra, rb, c);
    auto issue = [&](int j) {
        if constexpr (!CS) src.template issue<ST>(rw, rs, j, j0, j1, wslot, tid);
    };
    // MT: the issue cursor over the flat sequence: the next chunk's byte offset in the rows (ioff,
    // issue_at), chunks left in its row group (irem) and in all live groups (ileft), its stage (ist:
    // also the stage the consumer reads next, the ring being ST chunks ahead of it)
    // V_IL: chunks jf, jf + S, ... < je (nj of them), else j0 .. j1 - 1
    const int nj = IL ? (J - ks + S - 1) / S : j1 - j0, jf = IL ? ks : j0, je = IL ? J : j1;
    const bool has = jf < je;  // the warp has chunks
    int irem = nj, ileft = nt * nj, ist = 0;
    uint32_t ioff = 64u * jf;
    const uint32_t gjump = (uint32_t)(RT * 16) * (uint32_t)(a.K / 2) - 64u * JS * nj;  // to the next group's jf
    auto issue_next = [&]() {
        if constexpr (!CS) src.template issue_at<ST>(rw, rs, ioff, ist, ileft > 0, wslot, tid);
        ioff += 64u * JS, ileft--;
        if (--irem == 0) irem = nj, ioff += gjump;
        if (++ist == ST) ist = 0;
    };
    auto fill = [&]() {
        if (MT) {
            irem = nj, ileft = nt * nj, ist = 0, ioff = 64u * jf;
#pragma unroll
            for (int p = 0; p < ST; p++) issue_next();
        } else {
#pragma unroll
            for (int p = 0; p < ST; p++) issue(j0 + p);
        }
    };
    // opt bit 2: the first pass's ring fill before the route's offsets are read (every active slot
    // has at least one token, so the first pass always runs)
    const bool early = (opt & 4u) && tile_ok && has;
    if (early) fill();
    const int off = one ? slot : a.offsets[e], m = one ? 1 : a.offsets[e + 1] - off;
    if (!waited) pdl_wait();  // EARLY bit 1: the wait after the first fill and the offsets (pre)
    for (int t0 = 0; t0 < m; t0 += 8) {
        float acc[NM][4];  // zeroed per row group below
        // a lane past the group's last token reads token t0's activations: its mma column is
        // another token's and is never stored (no zero fill, no select per load)
        const int tk = t0 + g < m ? t0 + g : t0;
        const uint16_t *xr = a.x + (size_t)(GATEUP ? (one ? 0 : a.row_token[off + tk]) : off + tk) * a.K + c * 8;
        if (XS) {
            // the pass's rows (the host sized xs for min(8, tokens) >= min(8, m - t0) rows); the
            // previous pass's readers are done first (S = 1 has no other barrier between passes)
            if (t0 > 0) __syncthreads();
            const int nr = min(8, m - t0);
            // one flat loop over the rows' 8-column groups (a loop per row kept more values live
            // across the chunk loop: 16 bytes of spill at S = 4, none this way)
            for (int i = tid; i < nr * K8; i += 128) {
                const int r = i / K8, q = i - r * K8;
                const size_t row = GATEUP ? (one ? 0 : (size_t)a.row_token[off + t0 + r]) : (size_t)(off + t0 + r);
                const uint4 u = __ldg((const uint4 *)(a.x + row * a.K + 8 * q));
                uint32_t px[4];
                if (GATEUP) x_f16(u, px);
                else x_pairs(u, px);
                xs[r * xpitch + q] = make_uint4(px[0], px[1], px[2], px[3]);
            }
            __syncthreads();
        }
        // XS: this lane's row (tk - t0) at its column group c; chunk j block b is q = 16 j + 4 b + c
        const uint4 *xl = xs + (tk - t0) * xpitch + c;
        float rwt[2];  // opt bit 1 (down): this lane's two tokens' row weights
        if (!GATEUP && (opt & 2u)) {
#pragma unroll
            for (int v = 0; v < 2; v++) rwt[v] = t0 + 2 * c + v < m ? a.row_weight[off + t0 + 2 * c + v] : 0.0f;
        }
        if (MT && tile_ok && has && (!early || t0 > 0)) fill();
        for (int u = 0; u < T; u++) {
            const bool live = MT ? u < nt : tile_ok;
            const int rau = ra + u * RT * 16, rbu = rau + 8;
#pragma unroll
            for (int i = 0; i < NM; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
            if (live && has) {
                if (!MT && (!early || t0 > 0)) fill();
                uint4 xv[4];  // block b: this lane's 8 columns 32 b + 8 c .. + 7 of the chunk
                auto load_x = [&](int j, uint4 *dst) {
#pragma unroll
                    for (int b = 0; b < 4; b++)
                        dst[b] = __ldg((const uint4 *)(xr + (size_t)(4 * j + b) * 32));
                };
                if (!XS) load_x(j0, xv);
                for (int j = jf; j < je; j += JS) {
                    const int st = MT ? ist : (j - j0) % ST;
                    cp_async_wait<ST - 1>();
                    __syncwarp();  // the ldmatrix reads the other lanes' copies
                    if constexpr (CO) {  // the copies alone
                        issue_next();
                    } else {
                    uint32_t wa[NM][4], wb[NM][4], swa[NM], swb[NM];
#pragma unroll
                    for (int i = 0; i < NM; i++) {
                        ldsm_x4(wa[i], rbase + (uint32_t)((st * 2 * NM + 2 * i) * 128 * 16));
                        ldsm_x4(wb[i], rbase + (uint32_t)((st * 2 * NM + 2 * i + 1) * 128 * 16));
                        swa[i] = rs[(st * 2 * NM + 2 * i) * 128 + tid];
                        swb[i] = rs[(st * 2 * NM + 2 * i + 1) * 128 + tid];
                    }
                    uint4 nx[4];
                    if (XS) {
#pragma unroll
                        for (int b = 0; b < 4; b++) xv[b] = xl[16 * j + 4 * b];
                    } else {
                        load_x(min(j + 1, j1 - 1), nx);  // the last chunk reloads itself: no select per word
                    }
                    __syncwarp();  // every lane's reads of this stage are done before any lane refills it
                    if (MT) issue_next();  // into stage st (= ist before the call)
                    else issue(j + ST);
#pragma unroll
                    for (int b = 0; b < 4; b++) {
                        uint32_t px[4];
                        if (XS) px[0] = xv[b].x, px[1] = xv[b].y, px[2] = xv[b].z, px[3] = xv[b].w;
                        else if (GATEUP) x_f16(xv[b], px);
                        else x_pairs(xv[b], px);
#pragma unroll
                        for (int i = 0; i < NM; i++) {
                            uint32_t pa[4], pb[4];
                            if constexpr (NW) {  // the raw words (wrong values, the same mma count)
                                pa[0] = pa[1] = pa[2] = pa[3] = wa[i][b];
                                pb[0] = pb[1] = pb[2] = pb[3] = wb[i][b];
                            } else {
                                widen_f16(wa[i][b], pa);
                                widen_f16(wb[i][b], pb);
                            }
                            float blk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                            mma_f16(blk, pa[0], pb[0], pa[1], pb[1], px[0], px[1]);
                            mma_f16(blk, pa[2], pb[2], pa[3], pb[3], px[2], px[3]);
                            const float fa = scale_f(swa[i], b), fb = scale_f(swb[i], b);
                            acc[i][0] = fmaf(fa, blk[0], acc[i][0]);
                            acc[i][1] = fmaf(fa, blk[1], acc[i][1]);
                            acc[i][2] = fmaf(fb, blk[2], acc[i][2]);
                            acc[i][3] = fmaf(fb, blk[3], acc[i][3]);
                        }
                    }
                    if (!XS) {
#pragma unroll
                        for (int b = 0; b < 4; b++) xv[b] = nx[b];
                    }
                    }  // !CO
                }
                if (!MT) cp_async_wait<0>();  // MT: the ring runs on into the next row group
            }
            if (S > 1) dec_splitk_sum<NACC, S>(&acc[0][0], red, warp, ks, lane);
            if (ks == 0 && live) {
                // C fragment: (row g, tokens 2c, 2c+1), (row g+8, tokens 2c, 2c+1); x 2^13 (top note)
#pragma unroll
                for (int v = 0; v < 4; v++) {
                    const int tv = t0 + 2 * c + (v & 1), row = v < 2 ? rau : rbu;
                    if (tv >= m) continue;
                    const size_t pr = (size_t)(off + tv);
                    if (GATEUP) {
                        const float hv =
                            glu_act(acc[0][v] * 8192.0f, acc[NM - 1][v] * 8192.0f, a.act, a.beta, a.beta_l);
                        __half hh = __float2half_rn(hv);  // f16: this path's down kernel reads it as is
                        a.h[pr * a.R + row] = *reinterpret_cast<uint16_t *>(&hh);
                    } else {
                        a.y[pr * a.R + row] = acc[0][v] * 8192.0f * ((opt & 2u) ? rwt[v & 1] : a.row_weight[pr]);
                    }
                }
            }
        }  // row groups
        if (MT) cp_async_wait<0>();
    }
}

// LUNAR_MOE_DEC_OPT (bits, cuda_moe.cu's note; unset: all): this kernel reads bits 1 and 2
uint32_t dec_opt() {
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("LUNAR_MOE_DEC_OPT");
        v = e ? atoi(e) & 7 : 7;
    }
    return (uint32_t)v;
}

// LUNAR_MOE_F16_XS (read at every launch: the op tests switch it between runs; decode replays a
// captured graph, so the host cost is not per step): 1: each pass's activation rows converted once
// into shared memory (the kernel's XS note) where the block's shared memory stays <= 56 KB, i.e.
// the 4 blocks per SM of today (K3.1, K = 3584: batch 1 only); 2: wherever it fits in an SM (up to
// 8 rows; fewer blocks per SM, for measuring and for the tests' multi-row passes); 0: off. Unset: 1,
// the default since the session-8 device call (bit-equal to 0; K3.1 decode bench at batch 1 118.7-119.1
// -> 116.4-116.6 us, TP8 slice 26.9 -> 26.3; the K3.1 slice step B = 8 / 64 -1 %).
static int xs_mode() {
    const char *v = getenv("LUNAR_MOE_F16_XS");
    if (!v) return 1;
    return atoi(v) == 1 || atoi(v) == 2 ? atoi(v) : 0;
}

// LUNAR_MOE_F16_TILES (read at every launch, as LUNAR_MOE_F16_XS: the op tests switch it): path 16
// with several row groups per block (the kernel's MT note). The rule: 2 groups a block where the
// one-group grid is at least 1.5 waves of resident blocks (K3.1 at batch 1: gate/up 5.8 waves,
// down 6.8; its TP8 slice: down 1.7, gate/up 0.73 keeps 1). Unset: the rule at one token (batch-1
// decode), one group a block above; 1: the rule at every token count; 0: off (the session-8
// kernel); N = 2..64: N groups a block everywhere (for measuring; the tests' ring crossings).
// Measured (H200, two calls, docs/benchmarks.md "MoE decode, path 16 row groups per block (session
// 9)"): decode bench at batch 1, K3.1 116.7 / 116.8 / 116.6 / 115.9 us off, 110.2 / 110.9 at 2,
// 110.5 / 109.7 under the rule (Nsight Compute: gate/up 73.6 -> 72.5 us, down 46.5 -> 41.3), 112.1 /
// 112.3 at 3, 117.3 / 117.5 at one wave (6 and 7 groups a block); the TP8 slice 26.3 / 26.2 off, 26.2
// / 26.1 under the rule, 27.6 / 27.7 at 2 (its gate/up then fills 0.36 of a wave). Above one token
// the rule is opt-in: K3.1's shape -2..-4 % at 8..64 tokens but the TP8 slice's +5 % / +3 % at 8 / 16
// (-1 / -2 % at 32 / 64), and the slice's step at B = 8 +1.3 % (B = 64 -2..-4 %).
static int tiles_mode(int n) {
    const char *v = getenv("LUNAR_MOE_F16_TILES");
    if (!v) return n == 1 ? 1 : 0;
    const int t = atoi(v);
    return t >= 1 && t <= 64 ? t : 0;
}

// LUNAR_MOE_F16_EARLY (bits, read at every launch): 1 the down kernel's first ring fill and the
// expert's offsets before griddepcontrol.wait (opt bit 8), 2 the route's count and active id loaded
// together in both kernels (opt bit 16), 4 at one token no offsets / row_token loads (opt bit 32);
// the kernel's EARLY note. Unset: 7 (all three; 0: session 9's kernels). Measured (H200, two calls,
// docs/benchmarks.md "MoE decode, MXFP4, the TP8 slice (session 10, H200)"): decode bench at batch 1,
// the TP8 slice 26.8 / 26.6 us at 0, 23.9 / 23.7 at 3, 23.4 / 23.3 unset (call 1: 26.5 / 26.4 at 0,
// 24.2 / 24.1 at 1); K3.1 115.4 / 115.2 -> 111.0 / 111.0; the K3.1 slice's step (3 rounds alternating)
// B = 1 1.980 -> 1.948 ms, B = 8 -0.4 %, B = 64 +0.2 % (noise). Also tried there: the gate/up K split
// across 2-4 blocks per row group, the last to arrive summing the partials (+21-25 % at the TP8 slice,
// +25 % on K3.1: more waves of this start-up chain), removed.
static uint32_t early_mode(int n) {
    const char *v = getenv("LUNAR_MOE_F16_EARLY");
    const int b = v ? atoi(v) : 7;
    return (b & 1 ? 8u : 0u) | (b & 2 ? 16u : 0u) | (b & 4 && n == 1 ? 32u : 0u);
}

// The kernel's variants V (its V note; read at every launch, as LUNAR_MOE_F16_XS: the op tests switch
// them), each only with the activations in shared memory (the launch falls back to V = 0 where XS does
// not fit). LUNAR_MOE_F16_IL: V_IL; unset: at one token (batch-1 decode), 1: at every token count, 0: off.
// LUNAR_MOE_F16_SKIP=1 | 2 | 3: V_NW | V_CO | V_CS (WRONG results: the benchmark only). Measured (H200, two calls,
// docs/benchmarks.md "MoE decode, MXFP4, at one token: the copy ring (session 16)"): the pair at one
// token, K3.1 110.8 -> 104.2 us (every round of 5 faster), the TP8 slice 23.3 -> 22.3; the K3.1 TP8
// slice's B = 1 step 1.649 -> 1.635 ms (4 rounds alternating; 1.650 -> 1.639 in the first call).
static int v_mode(int n) {
    const char *il = getenv("LUNAR_MOE_F16_IL"), *sk = getenv("LUNAR_MOE_F16_SKIP");
    const int skip = sk ? atoi(sk) : 0;
    const bool ilv = il ? atoi(il) == 1 : n == 1;
    return (ilv ? V_IL : 0) | (skip == 1 ? V_NW : skip == 2 ? V_CO : skip == 3 ? V_CS : 0);
}

// the SM count of the current device (cached per device: a driver query)
static int sm_count() {
    static int sms[8];
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    if (dev >= 0 && dev < 8 && sms[dev]) return sms[dev];
    int n = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    if (dev >= 0 && dev < 8) sms[dev] = n;
    return n;
}

template <bool GATEUP, int S, bool MT, int V = 0>
void launch_k(const xargs &a, dim3 grid, size_t smem, size_t sx, bool xs, int T, uint32_t opt, cudaStream_t st) {
    if (xs) {
        // the opt-in above 48 KB: raised per device whenever a call needs more than that device has
        // (a driver call, so not on every eager launch)
        static size_t opted[8];
        int dev = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        if (sx > 48 * 1024 && (dev < 0 || dev >= 8 || sx > opted[dev])) {
            CUDA_CHECK(cudaFuncSetAttribute(moe_decode_f16_kernel<GATEUP, S, true, MT, V>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sx));
            if (dev >= 0 && dev < 8) opted[dev] = sx;
        }
        launch_pdl(moe_decode_f16_kernel<GATEUP, S, true, MT, V>, grid, dim3(128), sx, st, a,
                   lunar_cuda_pdl_prefetch_bytes(2), opt, T);
    } else if constexpr (V == 0) {  // the variants run with XS only (launch_s)
        launch_pdl(moe_decode_f16_kernel<GATEUP, S, false, MT>, grid, dim3(128), smem, st, a,
                   lunar_cuda_pdl_prefetch_bytes(2), opt, T);
    }
}

// the variants' kernels (always XS and the flat ring, MT, also at T = 1)
template <bool GATEUP, int S>
void launch_v(int v, const xargs &a, dim3 grid, size_t smem, size_t sx, int T, uint32_t opt, cudaStream_t st) {
    switch (v) {
    case V_IL: launch_k<GATEUP, S, true, V_IL>(a, grid, smem, sx, true, T, opt, st); break;
    case V_NW: launch_k<GATEUP, S, true, V_NW>(a, grid, smem, sx, true, T, opt, st); break;
    case V_CO: launch_k<GATEUP, S, true, V_CO>(a, grid, smem, sx, true, T, opt, st); break;
    case V_IL | V_NW: launch_k<GATEUP, S, true, V_IL | V_NW>(a, grid, smem, sx, true, T, opt, st); break;
    case V_CS: launch_k<GATEUP, S, true, V_CS>(a, grid, smem, sx, true, T, opt, st); break;
    case V_IL | V_CS: launch_k<GATEUP, S, true, V_IL | V_CS>(a, grid, smem, sx, true, T, opt, st); break;
    default: launch_k<GATEUP, S, true, V_IL | V_CO>(a, grid, smem, sx, true, T, opt, st); break;
    }
}

template <bool GATEUP, int S>
void launch_s(const xargs &a, int slots, int n, cudaStream_t st) {
    const int RT = 4 / S, nacc = (GATEUP ? 2 : 1) * 4;
    const size_t smem = (S > 1 ? (size_t)4 * nacc * 32 * 4 : 0) + (size_t)ST * 2 * (GATEUP ? 2 : 1) * 128 * 20;
    const int nb = ceil_div_u(a.R / 16, RT);  // row groups of RT tiles per expert
    // xs holds min(8, n) rows: a pass has min(8, m - t0) <= min(8, n) tokens (m <= n)
    const size_t sx = smem + (size_t)(n < 8 ? n : 8) * (a.K / 8 + 4) * 16;
    // 56 KB: 4 blocks x (56 + 1 reserved) KB <= the H200's 228 KB per SM; 227 KB: one block's most
    const int xm = xs_mode();
    const bool xs = xm && n >= 1 && sx <= (xm == 1 ? 56u : 227u) * 1024u;
    const int v = xs ? v_mode(n) : 0;  // the variants run with XS only
    // LUNAR_MOE_F16_TILES: T row groups a block. The rule (1; unset at one token): 2 where nb x
    // slots blocks are >= 1.5 waves; resident blocks = 4 per SM (128 registers, __launch_bounds__) or fewer where shared
    // memory allows fewer (228 KB per SM, 1 KB reserved a block)
    const int tm = tiles_mode(n);
    int T = 1;
    if (tm == 1) {
        const size_t per = (xs ? sx : smem) + 1024;
        const int bps = per * 4 <= (size_t)228 * 1024 ? 4 : (int)((size_t)228 * 1024 / per);
        if (nb >= 2 && 2LL * nb * slots >= 3LL * bps * sm_count()) T = 2;
    } else if (tm > 1) {
        T = min(tm, nb);
    }
    const uint32_t opt = dec_opt() | early_mode(n);
    if (v) launch_v<GATEUP, S>(v, a, dim3(ceil_div_u(nb, T), slots), smem, sx, T, opt, st);
    else if (T > 1) launch_k<GATEUP, S, true>(a, dim3(ceil_div_u(nb, T), slots), smem, sx, xs, T, opt, st);
    else launch_k<GATEUP, S, false>(a, dim3(nb, slots), smem, sx, xs, 1, opt, st);
}

// LUNAR_MOE_F16_SPLIT=1|2: at most that many k-splits (fewer, longer warps: RT = 4 / S row tiles
// per block), for measuring; 0 or unset: the pair's choice. Measured (H200, K3.1 batch 1): 119.9 /
// 126.7 / 142.8 us at S <= 4 / 2 / 1, TP8 slice 28.4 / 29.0 / 34.6: the default stays.
static int split_cap() {
    static int cap = -1;
    if (cap < 0) {
        const char *v = getenv("LUNAR_MOE_F16_SPLIT");
        cap = v && (atoi(v) == 1 || atoi(v) == 2) ? atoi(v) : 4;
    }
    return cap;
}

template <bool GATEUP>
void launch(const xargs &a, int slots, int n, cudaStream_t st) {
    const int J = a.K / 128, S = min(split_cap(), J >= 8 ? 4 : J >= 4 ? 2 : 1);  // the pair's split-K choice
    if (S == 4) launch_s<GATEUP, 4>(a, slots, n, st);
    else if (S == 2) launch_s<GATEUP, 2>(a, slots, n, st);
    else launch_s<GATEUP, 1>(a, slots, n, st);
}

}  // namespace

// its one-token variant on FP8 wgmma (cuda_moe_f16wg.cu, LUNAR_MOE_F16_WG): the mode (1, 2: warpgroups a
// block; 0: off or not this shape) and the pair (declared here, not in cuda_moe.cuh: every .cu depends on it)
int moe_f16wg_mode(int n, int Kg, int Kd);
void moe_f16wg_decode(const xargs &g, const xargs &d, int slots, cudaStream_t st, cudaEvent_t mid, bool settled);

void moe_f16_decode(const xargs &g, const xargs &d, int slots, int n, cudaStream_t st, cudaEvent_t mid, bool settled) {
    // one token (LUNAR_MOE_F16_WG; unset: where the inter size is >= 1024): the consumer on FP8 wgmma
    // (cuda_moe_f16wg.cu)
    if (moe_f16wg_mode(n, g.K, d.K)) return moe_f16wg_decode(g, d, slots, st, mid, settled);
    launch<true>(g, slots, n, st);
    if (mid) CUDA_CHECK(cudaEventRecord(mid, st));
    launch<false>(d, slots, n, st);
}
