// MLA absorbed decode, FP8 pages: rounds 4 and 5 (opt-in: LUNAR_MLA_WGMMA_FP8=rs / rs2): FP8 scores, PV transposed
// with V^T from the e4m3 tile as wgmma's register operand (round 4's design: cuda_mla_wgmma_rs.cuh).
#include "backend/cuda/cuda_mla_wgmma_rs.cuh"

namespace mla_wg {
namespace {

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

} // namespace

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

} // namespace mla_wg
