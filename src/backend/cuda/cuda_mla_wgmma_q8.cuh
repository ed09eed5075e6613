// Internal to the wgmma MLA decode: what the FP8-score kernels (cuda_mla_wgmma_rs.cu, _st.cu) share: the e4m3
// stage's boxes, Q's two e4m3 terms per head, S over the e4m3 tile, the scores.
#ifndef LUNAR_BACKEND_CUDA_MLA_WGMMA_Q8_CUH
#define LUNAR_BACKEND_CUDA_MLA_WGMMA_Q8_CUH

#include <cuda_fp8.h>

#include "backend/cuda/cuda_mla_wgmma.cuh"

namespace mla_wg {
namespace {

// FP8 scores (session 6): the session-5 FP8 path spends ~1.1 us per tile widening all 576 dims to bf16 between
// the copies and the MMA (docs/benchmarks.md, "MLA decode, producer/consumer"); S = Q C^T runs on the e4m3 tile as
// it lands instead (wgmma e4m3 x e4m3, k32). Session 6's kernel widened the 512 V dims for a bf16 PV: two terms
// 0.93-1.06x the widening kernel, one term 1.07-1.14x (at a logit error ~32x the bf16 one, no tolerance argued for
// it), both bound by shared-memory reads (S at n32 a warpgroup reads all of Q for every 32 positions: 144 KB a tile
// for two e4m3 terms); round 4 (cuda_mla_wgmma_rs.cu) took the V^T from the e4m3 tile in registers instead, and
// session 19 removed session 6's kernel (`git show 1ff0730`).
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
//  - The kernels' shared memory layouts: rs::Lay (cuda_mla_wgmma_rs.cuh).
namespace q8 {
constexpr int kBox = 8192;                         // 64 rows x 128 B
constexpr int kStage = 5 * kBox;                   // one e4m3 tile: 40960
constexpr int q_hi = 0, q_lo = 4 * kBox, q_pe = 8 * kBox;

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

// S of the round-4 kernel for positions 32 wg .. + 31 over 576 dims, zeroed, issued and committed (not
// waited): k-step ks < 16 in box ks / 4 at 32 (ks & 3) bytes; the two rope k-steps in box 4 (Q: hi at
// 0 / 32, lo at 64 / 96)
__device__ __forceinline__ void q8_issue_s(float (&s)[16], float (&sl)[16], uint32_t raw, int wg, uint64_t dqh,
                                           uint64_t dql, uint64_t dqe) {
    using namespace q8;
#pragma unroll
    for (int i = 0; i < 16; i++) s[i] = 0.0f, sl[i] = 0.0f;
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
// row's maximum over the quad's four lanes
__device__ __forceinline__ void q8_scores(float (&s)[16], const float (&sl)[16], int pbase, int end, float f0, float f1,
                                          float &mx0, float &mx1) {
    mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const bool ok = pbase + 8 * k + c < end;
            const int i0 = 4 * k + c, i1 = 4 * k + 2 + c;
            const float v0 = s[i0] + sl[i0] * 0.0625f, v1 = s[i1] + sl[i1] * 0.0625f;
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
// All (ST only; round 8, now kXPw's q after its wait): a warp's 4 rows loaded before any is quantised, so the
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

} // namespace
} // namespace mla_wg

#endif
