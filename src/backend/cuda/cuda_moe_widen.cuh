// Internal to the wgmma grouped GEMMs that widen MXFP4 in their consumer warps (cuda_moe_wg.cu moe_wg_kernel,
// cuda_moe_ws.cu moe_ws_kernel): one widening unit of a stage, written once.
#ifndef LUNAR_BACKEND_CUDA_MOE_WIDEN_CUH
#define LUNAR_BACKEND_CUDA_MOE_WIDEN_CUH

#include "backend/cuda/cuda_moe.cuh"
#include "backend/cuda/cuda_wgmma.cuh"

// Unit u of a stage: half (u & 1) of weight row nr = u >> 1, 16 packed bytes (32 E2M1 values) at
// raw + 16 u and their scale word at scw + 4 u, widened to 32 bf16 into the 128-byte row nr of the
// B tile at dB, its 16-byte pieces swizzled by (nr & 7) as wgmma's 128-byte swizzle reads them. a.ws:
// the scale arrays of w1 / w3 (GATEUP: rows from NH on are w3's), j the K chunk.
template <bool GATEUP, int NH>
__device__ __forceinline__ void widen_unit(int u, uint32_t raw, uint32_t scw, uint32_t dB, const xargs &a, int j) {
    const int nr = u >> 1, half = u & 1;
    const bool m3 = GATEUP && nr >= NH;
    const uint4 nib = lds128(raw + u * 16);
    const uint32_t sw = lds32(scw + u * 4);
    // the byte's place in its word: the scale offsets of a row and an expert are multiples of 4
    const uint32_t sel = ((uint32_t)(uintptr_t)(m3 ? a.ws[1] : a.ws[0]) + 2 * j + half) & 3;
    const mxscale sc = mx_scale((sw >> (8 * sel)) & 0xffu);
    const bool two = __any_sync(0xffffffffu, sc.two);
    const uint32_t row = dB + nr * 128;
    const uint32_t words[4] = {nib.x, nib.y, nib.z, nib.w};
#pragma unroll
    for (int w = 0; w < 4; w++) {
        uint32_t p[4];  // (x3, x7), (x2, x6), (x1, x5), (x0, x4) -> natural order below
        if (two) pairs_mx<true>(words[w], sc, p);
        else pairs_mx<false>(words[w], sc, p);
        sts128(row + (((4 * half + w) ^ (nr & 7)) << 4), prmt(p[3], p[2], 0x5410), prmt(p[1], p[0], 0x5410),
               prmt(p[3], p[2], 0x7632), prmt(p[1], p[0], 0x7632));
    }
}

#endif
