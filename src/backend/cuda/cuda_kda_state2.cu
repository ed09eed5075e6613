// KDA chunked prefill, mode 2's state pass with column groups sharing their tiles (the default
// from 67 to 132 heads; LUNAR_KDA_STATE=old the 64-column kda_state_bf16_kernel): one block per head of NG x 8 warps; group gi (256
// threads) owns value columns gi BV .. gi BV + BV - 1 and runs kda_state_bf16_kernel's chunk loop
// on them, (a) V_new = U - W S, (b) O = Qg S + Aqk V_new, (c) S = exp(Gamma_C) S + Kg^T V_new, with
// the steps of cuda_kda_state.cuh, while the column-independent tiles (W, Qg, Kg [64][128], Aqk
// [64][64], exp(Gamma_C) [128]) are loaded once per block, by group 0, for all groups.
// Why: at H = 96 the default pass is 192 blocks of 64 columns, two per SM on 60 SMs and one on the
// other 72 (1.45 blocks of work per SM, the busiest SM sets the time), and every head's W, Qg and
// Kg are loaded by both of its blocks. NG = 2, BV = 64: 96 blocks of 16 warps, one per SM, each
// tile loaded once. The columns evolve independently given W, Kg (S[:, j] never mixes with S[:, j']),
// so every output is bit-equal to kda_state_bf16_kernel's (the same mma steps in the same order).
#include <string.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_kda_state.cuh"

// shared memory: per group {S copy [128][LDV], U [64][LDV], V_new [64][LDV]}, then W, Qg, Kg
// [64][LDB], Aqk [64][LDB64], exp(Gamma_C) [128] fp32
template <int BV, int NG> struct gstate_smem {
    static const int LDV = BV + 8;
    static const int group = DK * LDV + 2 * BT * LDV;
    static const int halves = NG * group + 3 * BT * LDB + BT * LDB64;
    static const size_t bytes = sizeof(__nv_bfloat16) * halves + sizeof(float) * DK;
};

template <int BV, int NG>
__global__ void __launch_bounds__(256 * NG, 1)
    kda_state_grp_kernel(float *__restrict__ o, float *__restrict__ S, kda_ws ws, int T, int H, int NC) {
    typedef gstate_smem<BV, NG> L;
    constexpr int LDV = BV + 8;
    extern __shared__ __align__(128) __nv_bfloat16 smb[];
    const int tid = threadIdx.x & 255, grp = threadIdx.x >> 8;
    __nv_bfloat16 *Sb = smb + grp * L::group;  // [128][LDV] bf16 state (this group's columns)
    __nv_bfloat16 *Ub = Sb + DK * LDV;           // [64][LDV]
    __nv_bfloat16 *Vb = Ub + BT * LDV;           // [64][LDV] V_new
    __nv_bfloat16 *Wb = smb + NG * L::group;     // [64][LDB]
    __nv_bfloat16 *Qb = Wb + BT * LDB;           // [64][LDB]
    __nv_bfloat16 *Kb = Qb + BT * LDB;           // [64][LDB]
    __nv_bfloat16 *Ab = Kb + BT * LDB;           // [64][LDB64] Aqk
    float *dec = reinterpret_cast<float *>(Ab + BT * LDB64);  // [128]
    const int h = blockIdx.y, v0 = (blockIdx.x * NG + grp) * BV;
    const ws_bf16 wg(ws);
    // group 0 loads the shared tiles (state_chunks' note on the commits and barriers)
    state_chunks<BV>(o, S + (size_t)h * DK * DK, ws, wg, Sb, Ub, Vb, Wb, Qb, Kb, Ab, dec, T, H, NC, h, v0, tid,
                     grp == 0);
}

// grid (DK / (NG BV), H); NG = 2, BV = 64: a head a block (cuda_kda_chunk.cu's dispatch)
void kda_state_grp_launch(float *o, float *S, kda_ws w, int T, int H, int NC, cudaStream_t st) {
    constexpr int BV = 64, NG = 2;
    const size_t bytes = gstate_smem<BV, NG>::bytes;
    CUDA_CHECK(cudaFuncSetAttribute(kda_state_grp_kernel<BV, NG>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)bytes));
    kda_state_grp_kernel<BV, NG><<<dim3(DK / (BV * NG), H), 256 * NG, bytes, st>>>(o, S, w, T, H, NC);
    CUDA_CHECK_LAUNCH();
}
