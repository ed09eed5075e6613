// Path 16's device helpers (cuda_moe_f16.cu: the pair on f16 tensor cores; cuda_moe_f16p.cu: its one-token
// persistent kernel): the f16 mma, ldmatrix, the E2M1 -> f16 widening, the E8M0 scale factor and the
// activations' f16 pairs. The widening, the scale and the pair order are explained at the top of cuda_moe_f16.cu.
#ifndef LUNAR_BACKEND_CUDA_MOE_F16_CUH
#define LUNAR_BACKEND_CUDA_MOE_F16_CUH

#include <cuda_fp16.h>

#include "backend/cuda/cuda_moe.cuh"

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

// the persistent one-token kernel (cuda_moe_f16p.cu, LUNAR_MOE_F16_FUSED): false where it does not run (the
// switch off, a shape or an alignment it does not take); the caller then launches the pair
bool moe_f16_fused_decode(const xargs &g, const xargs &d, int slots, cudaStream_t st);

#endif
