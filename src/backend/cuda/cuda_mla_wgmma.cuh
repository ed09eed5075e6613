// Internal to the wgmma MLA decode (cuda_mla_wgmma*.cu): the layout constants, the kernels' arguments and
// split plan, the device helpers every kernel family uses, and each family's launcher. One file per family:
//   cuda_mla_wgmma.cu     the bf16 / FP8-widening kernel (wgmma_decode_kernel), the plan, the dispatcher
//   cuda_mla_wgmma_rs.cu  FP8 scores, V^T from the e4m3 tile in registers (round 4; the FP8 default from 64K rows x
//                         context at blocks of > 32 heads)
//   cuda_mla_wgmma_st.cu  the same with S^T, heads as N (round 6 on; the FP8 default from 64K rows x context at
//                         blocks of <= 32 heads)
// cuda_mla_wgmma_q8.cuh holds what the FP8-score kernels share (Q's two e4m3 terms, S over the e4m3 tile),
// cuda_mla_wgmma_rs.cuh what the rs and st kernels share (the block's set-up, V^T fragments, O^T stores).
#ifndef LUNAR_BACKEND_CUDA_MLA_WGMMA_CUH
#define LUNAR_BACKEND_CUDA_MLA_WGMMA_CUH

#include <cuda.h>
#include <math.h>
#include <stdint.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_mbarrier.cuh"
#include "backend/cuda/cuda_wgmma.cuh"

namespace mla_wg {

constexpr int kR = 512, kP = 64, kRow = 576;
constexpr int kTile = 64;                              // positions per tile
constexpr int kM = 64;                                 // heads per block (padded)
constexpr int kThreads = 256;                          // two warpgroups
constexpr int kChunks = kRow / 8;                      // 16-byte bf16 chunks per row: 72
constexpr int kGroup = kChunks * 128;                  // one 8-row group in core-matrix order: 9216 B
constexpr int kTileBytes = kTile / 8 * kGroup;         // 73728
constexpr int kQBytes = kM / 8 * kGroup;               // 73728
constexpr int kPGroup = kTile / 8 * 128;               // P: one 8-head group, 64 positions: 1024 B
constexpr int kPBytes = kM / 8 * kPGroup;              // 8192
constexpr int kRawBytes = kTile * kRow;                // one raw FP8 tile: 36864

struct Args {
    float *o, *o_part, *lse_part;
    const float *q_lat, *q_pe;
    const unsigned char *cache;
    const int32_t *bt;
    int max_blocks;
    const int32_t *row_seq, *lens;
    int rows, H, hpb, chunk, splits;
    float scale2, out_scale;
};

// The split of a call (plan() in cuda_mla_wgmma.cu): hb head blocks of hpb heads, the context in `splits` chunks of
// `chunk` positions
struct Plan {
    int hb, hpb, splits, chunk;
};

// The st kernel's switches (its template parameter X, picked by LUNAR_MLA_WGMMA_FP8; what each round measured is
// beside the kernel in cuda_mla_wgmma_st.cu): round 8 kXCvt (V^T by cvt.rn.f16x2.e4m3x2); kXTrace the bench's phase
// stamps; round 9 kXQF (q before the copies), kXMrg (the split-K merge in the kernel's tail), kXFtz (the tile's exp2
// ftz); round 10 kXPv (PV(it - 1) in flight past the tile's top wait), kXMt (the in-kernel merge's loads batched);
// round 11 kXPw (a dependent launch whose set-up, all but q, runs before its wait); session 17 kXCl (a row's splits
// as one cluster, the merge through distributed shared memory: cuda_mla_wgmma_cl.cuh). Removed in session 19 (`git
// show 1ff0730` has them): 1 and 2, round 8's q rows loaded at once and dependent launch (superseded by kXQF and
// kXPw), 1024 and 2048, session 17's merge by the row's last-arriving block and kXMt's loads before the weights'
// (0.98-0.99x the default).
namespace rs {
constexpr int kXCvt = 4, kXTrace = 8, kXQF = 16, kXMrg = 32, kXFtz = 64, kXPv = 128, kXMt = 256, kXPw = 512,
              kXCl = 4096;
} // namespace rs
// Round 9's merge in the kernel (rs::kXMrg): a ticket counter per (row, head block) (g_mla_tickets, in
// cuda_mla_wgmma_st.cu); the launcher keeps rows x head blocks within it
constexpr int kTickets = 1024;

// The device helpers (here and in the family headers) are each file's own, as its kernels are
namespace {
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
// wgmma shared memory descriptor, no swizzle: start address, leading and stride byte offsets (all
// in 16-byte units), base offset 0, layout type 0 (bits 62-63)
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3ffff) >> 4) | ((uint64_t)((lbo >> 4) & 0x3fff) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3fff) << 32);
}

// The swizzled tiles (SW): 9 boxes of 64 dims (128 B) x 64 positions, 8 KB each, as one bulk tensor
// copy with the 128-byte swizzle writes them: row r of box b at b * 8192 + r * 128, its 16-byte
// chunk c stored at chunk c ^ (r & 7). j: the 16-byte chunk of the row (dims 8j .. 8j + 7).
__device__ __forceinline__ int sw_off(int r, int j) { return (j >> 3) * 8192 + r * 128 + (((j & 7) ^ (r & 7)) << 4); }
// Descriptor with the 128-byte swizzle (layout type 1 in bits 62-63). K-major (S: rows =
// positions): the stride byte offset 1024 steps 8 rows, the leading offset is unused, a k-step of
// 16 dims moves the start 32 bytes inside the 128-byte row (the hardware applies the swizzle to
// the final address). N-major (O: K = positions, N = dims): leading byte offset = the next 64 dims
// (the next box, 8192), stride byte offset = the next 8 positions (1024).
__device__ __forceinline__ uint64_t desc_sw(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return desc(addr, lbo, sbo) | (1ull << 62);
}
// Two e4m3 bytes of w (picked by the byte_perm selector: 0x1404 bytes 0-1, 0x3424 bytes 2-3) as a
// bf16 pair, exactly. Each byte moved to the top of its 16-bit half, then sign kept and the 7 bits
// of exponent + mantissa moved down 4: a bf16 whose exponent field is the e4m3 one (bias 7, not
// 127), i.e. the value x 2^-120, subnormals included (e4m3 subnormal m/8 x 2^-6 -> bf16 subnormal
// m/8 x 2^-126). One bf16 multiply by 2^120 (0x7b80) restores it: a power of two, result normal,
// exact. (Measured as fast as the conversion route, 2 cvt + 2 f16->f32 + 1 pack per pair: the
// widening pass is bound by its shared-memory traffic and barrier.) e4m3 NaN (0x7f) becomes 480,
// but only rows past the end hold such bytes and those are zeroed.
__device__ __forceinline__ uint32_t e4m3x2_bf16x2(uint32_t w, uint32_t sel) {
    const uint32_t u = __byte_perm(w, 0u, sel);
    uint32_t h = (u & 0x80008000u) | ((u >> 4) & 0x07f007f0u);
    const uint32_t k = 0x7b807b80u;
    __nv_bfloat162 x = __hmul2(*reinterpret_cast<const __nv_bfloat162 *>(&h), *reinterpret_cast<const __nv_bfloat162 *>(&k));
    return *reinterpret_cast<uint32_t *>(&x);
}

// The end of both decode kernels: the row sums of the two warpgroups' halves met through red, O
// normalised (and scaled when the split is the whole context) into o, or the split's partial O and
// log2-sum-exp into the workspace for the merge. Thread: heads r0 / r1 (< nh stored), columns 256 wg
// + 8k + 2t of the accumulator o.
// The row sums' halves into red: a quad's four lanes hold a row's columns (summed by shuffles), each
// warpgroup's sum in slot wg * 64 + r; both halves are readable by every thread when it returns.
__device__ __forceinline__ void l_halves_to_red(float *red, int wg, int t, int r0, int r1, float l0, float l1) {
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    __syncthreads(); // nobody reads red any more
    if (t == 0) red[wg * 64 + r0] = l0, red[wg * 64 + r1] = l1;
    __syncthreads();
}

// A tile's P (exp2 of the scores s less the rows' new maxima mn0 / mn1) in bf16 into the shared P tile
// at p_tile: chunk 4 wg + k of rows r0 and r1 = r0 + 8 (the next 8-row group); ps0 / ps1 get this
// thread's sums of the exponentials of rows r0 / r1.
__device__ __forceinline__ void p_tile_bf16(const float (&s)[16], unsigned char *p_tile, int wg, int t, int r0,
                                            float mn0, float mn1, float &ps0, float &ps1) {
    ps0 = 0.0f, ps1 = 0.0f;
    unsigned char *P = p_tile + (r0 >> 3) * kPGroup + (r0 & 7) * 16 + 4 * t;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float e0 = exp2f(s[4 * k] - mn0), e1 = exp2f(s[4 * k + 1] - mn0);
        const float e2 = exp2f(s[4 * k + 2] - mn1), e3 = exp2f(s[4 * k + 3] - mn1);
        ps0 += e0 + e1, ps1 += e2 + e3;
        *reinterpret_cast<uint32_t *>(P + (4 * wg + k) * 128) = pack_bf16(e0, e1);
        *reinterpret_cast<uint32_t *>(P + kPGroup + (4 * wg + k) * 128) = pack_bf16(e2, e3);
    }
}

__device__ __forceinline__ void write_out(const Args &a, const float (&o)[128], float *red, int row, int split,
                                          int h0, int nh, int wg, int t, int r0, int r1, float m0, float m1,
                                          float l0, float l1) {
    l_halves_to_red(red, wg, t, r0, r1, l0, l1);
    l0 = red[r0] + red[64 + r0], l1 = red[r1] + red[64 + r1];
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    const bool direct = a.splits == 1;
    const float os = direct ? a.out_scale : 1.0f;
    float *base = direct ? a.o : a.o_part + (size_t)split * a.rows * a.H * kR;
    const size_t ha = (size_t)row * a.H + h0 + r0, hbr = (size_t)row * a.H + h0 + r1;
    const float fa = inv0 * os, fb = inv1 * os;
#pragma unroll
    for (int k = 0; k < 32; k++) {
        const int d = 256 * wg + 8 * k + 2 * t;
        if (r0 < nh) *reinterpret_cast<float2 *>(base + ha * kR + d) = make_float2(o[4 * k] * fa, o[4 * k + 1] * fa);
        if (r1 < nh) *reinterpret_cast<float2 *>(base + hbr * kR + d) = make_float2(o[4 * k + 2] * fb, o[4 * k + 3] * fb);
    }
    if (!direct && wg == 0 && t == 0) {
        float *lse = a.lse_part + (size_t)split * a.rows * a.H;
        if (r0 < nh) lse[ha] = l0 > 0.0f ? m0 + log2f(l0) : -INFINITY;
        if (r1 < nh) lse[hbr] = l1 > 0.0f ? m1 + log2f(l1) : -INFINITY;
    }
}

} // namespace

// The families' launchers: grid (hb, splits, rows) of kThreads threads
// cuda_mla_wgmma_rs.cu: round 4
void launch_rs(const Args &a, const CUtensorMap &tm, const Plan &p, cudaStream_t s);
// cuda_mla_wgmma_st.cu: the st kernel (round 7's lazy rescale and early wait built in) with the switches X; only
// the instances the dispatcher names are built there (another one fails the link)
template <int X>
void launch_st(const Args &a, const CUtensorMap &tm, const Plan &p, cudaStream_t s, float lazy = 8.0f);
// lunar_cuda_mla_wgmma_trace (cuda_mla_wgmma_st.cu) set a buffer: the dispatcher may launch the traced instances
extern bool trace_on;
// cuda_mla_wgmma_st.cu: how many clusters of `splits` blocks of the st kernel's kXCl instance fit the device at once
int cl_max_clusters(int splits);

} // namespace mla_wg

#endif
