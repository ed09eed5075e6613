// MLA absorbed decode, FP8 pages: round 4 (the default from 64K rows x context at blocks of > 32 heads;
// LUNAR_MLA_WGMMA_FP8=rs forces it): FP8 scores, PV transposed with V^T from the e4m3 tile as wgmma's register operand
// (round 4's design: cuda_mla_wgmma_rs.cuh). Round 5's kernel (S one tile ahead, round 4's bits; round 6 ran 1.15-1.35x
// it) was here until session 19: `git show 1ff0730`.
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

} // namespace mla_wg
