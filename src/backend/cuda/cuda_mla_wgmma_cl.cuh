// Internal to the st kernel (cuda_mla_wgmma_st.cu): session 17's split-K merge through distributed shared memory
// (rs::kXCl, LUNAR_MLA_WGMMA_FP8=s17c).
//
// The row's splits run as one thread-block cluster (dims 1 x splits x 1: the grid's y is the split, so a block's rank
// in the cluster is its split). After its tile loop each block writes its partial O (accumulator x 1 / l, the values
// store_ot would store) and its log2-sum-exps into its own shared memory (the e4m3 stages are free then), the cluster
// meets at one barrier, and each block merges the row's heads split, split + splits, .. (merge_tail's assignment)
// reading every split's partial from that split's shared memory (ld.shared::cluster), and stores the merged O. No
// partial O goes through global memory (round 11 traced the partial stores at 2.4-3.2 us and the merge after them at
// 5.4-5.9 us), no ticket counter, no cooperative launch; a second cluster barrier keeps every block's shared memory
// alive until the others have read it. 2 to 16 splits (above 8 a non-portable cluster size; at one block an SM a
// cluster of n needs n SMs of one GPC) where the device places all of the call's clusters at once (the dispatcher
// asks: cl_max_clusters).
// Arithmetic: merge_tail's, head for head (the weights by the merge kernel's 32-lane butterflies over the same
// log2-sum-exps, the sums over the splits in order): memcmp-equal to kXMrg.
#ifndef LUNAR_BACKEND_CUDA_MLA_WGMMA_CL_CUH
#define LUNAR_BACKEND_CUDA_MLA_WGMMA_CL_CUH

#include "backend/cuda/cuda_mla_wgmma_rs.cuh"

namespace mla_wg {
namespace cl {
namespace {

// the 32-bit shared::cluster address of shared address `a` of the cluster's block `rank`
__device__ __forceinline__ uint32_t mapa(uint32_t a, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}
__device__ __forceinline__ float ld_f(uint32_t a) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ float4 ld_f4(uint32_t a) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory");
    return v;
}

// The merge of NS splits. part: this block's [32 heads][512] floats of shared memory (generic pointer) and part_sb its
// shared address; lse_sb: the shared address of its [32] log2-sum-exps; scratch: [32][32] weights + [32] factors
// (not overlapping part). Every thread of the block calls it, and the block's heads' partials must be final.
template <int N, int NS, class B>
__device__ __forceinline__ void merge(const Args &a, const B &b, const float (&o)[4][N / 2], float *part, uint32_t part_sb,
                                      uint32_t lse_sb, float *scratch) {
    const int t = b.t, nh = b.nh, tid = b.tid, lane = b.lane, warp = b.warp, split = b.split;
    // this split's partial O^T (dims D0 .., heads 8i + 2t + e) as store_ot computes it
#pragma unroll
    for (int i = 0; i < N / 8; i++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int h = 8 * i + 2 * t + e;
            if (h >= nh) continue;
            const float f = b.linv[h];
            float4 *d = reinterpret_cast<float4 *>(part + h * kR + b.D0);
            d[0] = make_float4(o[0][4 * i + e] * f, o[0][4 * i + e + 2] * f, o[1][4 * i + e] * f, o[1][4 * i + e + 2] * f);
            d[1] = make_float4(o[2][4 * i + e] * f, o[2][4 * i + e + 2] * f, o[3][4 * i + e] * f, o[3][4 * i + e + 2] * f);
        }
    cluster_sync_all(); // every split's partial and log2-sum-exps in its shared memory
    const int nk = nh > split ? (nh - split + NS - 1) / NS : 0; // this block's heads: split + k NS
    float *wts = scratch, *fac = scratch + 32 * 32;
    for (int k = warp; k < nk; k += kThreads / 32) {
        const int h = split + k * NS;
        const float l = lane < NS ? ld_f(mapa(lse_sb + 4u * (uint32_t)h, (uint32_t)lane)) : -INFINITY;
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
    constexpr int IT = ((32 + NS - 1) / NS * (kR / 4) + kThreads - 1) / kThreads; // (nh <= 32: nk <= ceil(32 / NS))
    // a thread's float4 loads in flight at once: at most 16 (64 registers; more spilled)
    constexpr int JB = 16 / NS > 0 ? 16 / NS : 1;
#pragma unroll
    for (int j0 = 0; j0 < IT; j0 += JB) {
        float4 v[JB][NS];
#pragma unroll
        for (int jj = 0; jj < JB; jj++) {
            const int idx = tid + (j0 + jj) * kThreads;
            if (j0 + jj < IT && idx < nk * (kR / 4)) {
                const int k = idx / (kR / 4), d = (idx % (kR / 4)) * 4, h = split + k * NS;
#pragma unroll
                for (int sp = 0; sp < NS; sp++) v[jj][sp] = ld_f4(mapa(part_sb + 4u * (uint32_t)(h * kR + d), (uint32_t)sp));
            }
        }
#pragma unroll
        for (int jj = 0; jj < JB; jj++) {
            const int idx = tid + (j0 + jj) * kThreads;
            if (j0 + jj < IT && idx < nk * (kR / 4)) {
                const int k = idx / (kR / 4), d = (idx % (kR / 4)) * 4, h = split + k * NS;
                float4 acc = make_float4(0, 0, 0, 0);
#pragma unroll
                for (int sp = 0; sp < NS; sp++) {
                    const float w = wts[k * 32 + sp];
                    acc.x += w * v[jj][sp].x, acc.y += w * v[jj][sp].y, acc.z += w * v[jj][sp].z, acc.w += w * v[jj][sp].w;
                }
                const float f = fac[k];
                *reinterpret_cast<float4 *>(a.o + ((size_t)b.row * a.H + b.h0 + h) * kR + d) =
                    make_float4(acc.x * f, acc.y * f, acc.z * f, acc.w * f);
            }
        }
    }
    cluster_sync_all(); // no block leaves while another may still read its shared memory
}

} // namespace
} // namespace cl
} // namespace mla_wg

#endif
