// MLA absorbed decode, FP8 pages with FP8 scores and a widened V (opt-in: LUNAR_MLA_WGMMA_FP8=q8x2). The design and
// the measurements are in cuda_mla_wgmma_q8.cuh, whose Q quantisation and S the rs and st kernels reuse.
#include "backend/cuda/cuda_mla_wgmma_q8.cuh"

namespace mla_wg {
namespace {

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
        float ps0, ps1;
        p_tile_bf16(s, smem + p_off, wg, t, r0, mn0, mn1, ps0, ps1);
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

} // namespace

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

} // namespace mla_wg
