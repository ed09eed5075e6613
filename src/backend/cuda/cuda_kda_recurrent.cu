// KDA fused recurrent decode / verify (op_kda_recurrent) over a batch of sequences with state slots.
//
// Each column c of the state S [dk, dv] evolves independently (decay scales rows, the delta rule
// reads k^T S[:, c], the output reads q^T S[:, c]), so a block owns (sequence b, head h, a tile of
// 32 value columns) and keeps that [128 x 32] slice of the fp32 state in registers for all T
// positions: one read and one write of the state per call (plus one write per position in the
// verify form). 128 threads: thread (rg = tid / 8, cg = tid % 8) holds rows 8rg..8rg+7 and the 4
// columns 4cg..4cg+3 (float4 loads: a warp reads 4 rows x 128 contiguous bytes). The two dot
// products over the 128 rows reduce through warp shuffles then 4 warps' partials in shared memory.
// The pool may hold the state in fp16 (the fp16 state option: half the bytes per slot): loaded and
// widened once, updated in fp32 registers, rounded to nearest once at the store, as the CPU
// reference rounds S after each call (model/forward.c).
#include "backend/cuda/cuda_common.cuh"

#include <cuda_fp16.h>

#define RDK 128
#define RTILE 32

// 4 consecutive state elements in the pool's storage type
__device__ __forceinline__ float4 load4(const float *p) { return *reinterpret_cast<const float4 *>(p); }
__device__ __forceinline__ float4 load4(const __half *p) {
    const uint2 u = *reinterpret_cast<const uint2 *>(p);
    const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&u.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void store4(float *p, float4 v) { *reinterpret_cast<float4 *>(p) = v; }
__device__ __forceinline__ void store4(__half *p, float4 v) {
    const __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t *>(&a), u.y = *reinterpret_cast<const uint32_t *>(&b);
    *reinterpret_cast<uint2 *>(p) = u;
}

template <typename ST>
__global__ void __launch_bounds__(128) kda_recurrent_kernel(
    float *__restrict__ o, const float *__restrict__ q, const float *__restrict__ k,
    const float *__restrict__ v, const float *__restrict__ g, const float *__restrict__ beta,
    ST *__restrict__ S_pool, const int32_t *__restrict__ slots, ST *__restrict__ S_steps,
    int T, int H, int dv, float scale) {
    __shared__ float ks[RDK], qs[RDK], es[RDK];
    __shared__ float red_d[4][RTILE], red_o[4][RTILE];
    pdl_enter();
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int cg = tid & 7, rg = tid >> 3;
    const int c0 = blockIdx.x * RTILE + cg * 4;
    const int h = blockIdx.y, b = blockIdx.z;
    const size_t state_elems = (size_t)H * RDK * dv;
    ST *Sb = S_pool + (size_t)slots[b] * state_elems + (size_t)h * RDK * dv;

    float4 st[8];
#pragma unroll
    for (int r = 0; r < 8; r++) st[r] = load4(Sb + (size_t)(rg * 8 + r) * dv + c0);

    for (int t = 0; t < T; t++) {
        const size_t th = ((size_t)b * T + t) * H + h;
        ks[tid] = k[th * RDK + tid];
        qs[tid] = q[th * RDK + tid] * scale;
        es[tid] = expf(g[th * RDK + tid]);
        const float bt = beta[th];
        const float4 vv = *reinterpret_cast<const float4 *>(v + th * dv + c0);
        __syncthreads();
        float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const int j = rg * 8 + r;
            const float e = es[j], kj = ks[j];
            st[r].x *= e, st[r].y *= e, st[r].z *= e, st[r].w *= e;
            d.x += st[r].x * kj, d.y += st[r].y * kj, d.z += st[r].z * kj, d.w += st[r].w * kj;
        }
#pragma unroll
        for (int off = 8; off < 32; off <<= 1) {
            d.x += __shfl_xor_sync(0xffffffffu, d.x, off);
            d.y += __shfl_xor_sync(0xffffffffu, d.y, off);
            d.z += __shfl_xor_sync(0xffffffffu, d.z, off);
            d.w += __shfl_xor_sync(0xffffffffu, d.w, off);
        }
        if (lane < 8) *reinterpret_cast<float4 *>(&red_d[w][cg * 4]) = d;
        __syncthreads();
        float4 u;
        {
            float4 a0 = *reinterpret_cast<const float4 *>(&red_d[0][cg * 4]);
            float4 a1 = *reinterpret_cast<const float4 *>(&red_d[1][cg * 4]);
            float4 a2 = *reinterpret_cast<const float4 *>(&red_d[2][cg * 4]);
            float4 a3 = *reinterpret_cast<const float4 *>(&red_d[3][cg * 4]);
            u.x = (vv.x - (((a0.x + a1.x) + a2.x) + a3.x)) * bt;
            u.y = (vv.y - (((a0.y + a1.y) + a2.y) + a3.y)) * bt;
            u.z = (vv.z - (((a0.z + a1.z) + a2.z) + a3.z)) * bt;
            u.w = (vv.w - (((a0.w + a1.w) + a2.w) + a3.w)) * bt;
        }
        float4 oo = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const int j = rg * 8 + r;
            const float kj = ks[j], qj = qs[j];
            st[r].x += kj * u.x, st[r].y += kj * u.y, st[r].z += kj * u.z, st[r].w += kj * u.w;
            oo.x += st[r].x * qj, oo.y += st[r].y * qj, oo.z += st[r].z * qj, oo.w += st[r].w * qj;
        }
#pragma unroll
        for (int off = 8; off < 32; off <<= 1) {
            oo.x += __shfl_xor_sync(0xffffffffu, oo.x, off);
            oo.y += __shfl_xor_sync(0xffffffffu, oo.y, off);
            oo.z += __shfl_xor_sync(0xffffffffu, oo.z, off);
            oo.w += __shfl_xor_sync(0xffffffffu, oo.w, off);
        }
        if (lane < 8) *reinterpret_cast<float4 *>(&red_o[w][cg * 4]) = oo;
        if (S_steps) {
            ST *Sx = S_steps + ((size_t)b * T + t) * state_elems + (size_t)h * RDK * dv;
#pragma unroll
            for (int r = 0; r < 8; r++) store4(Sx + (size_t)(rg * 8 + r) * dv + c0, st[r]);
        }
        __syncthreads();
        if (tid < 8) {
            float4 a0 = *reinterpret_cast<const float4 *>(&red_o[0][cg * 4]);
            float4 a1 = *reinterpret_cast<const float4 *>(&red_o[1][cg * 4]);
            float4 a2 = *reinterpret_cast<const float4 *>(&red_o[2][cg * 4]);
            float4 a3 = *reinterpret_cast<const float4 *>(&red_o[3][cg * 4]);
            float4 r;
            r.x = ((a0.x + a1.x) + a2.x) + a3.x;
            r.y = ((a0.y + a1.y) + a2.y) + a3.y;
            r.z = ((a0.z + a1.z) + a2.z) + a3.z;
            r.w = ((a0.w + a1.w) + a2.w) + a3.w;
            *reinterpret_cast<float4 *>(o + th * dv + c0) = r;
        }
    }
    if (!S_steps) {
#pragma unroll
        for (int r = 0; r < 8; r++) store4(Sb + (size_t)(rg * 8 + r) * dv + c0, st[r]);
    }
}

extern "C" void lunar_cuda_kda_recurrent(float *o, const float *q, const float *k, const float *v,
                                         const float *g, const float *beta, float *S_pool,
                                         const int32_t *slots, float *S_steps, int B, int T,
                                         int H, int dk, int dv, float scale,
                                         lunar_cuda_stream s) {
    CUDA_REQUIRE(dk == RDK && dv % RTILE == 0 && dv > 0);
    if (B <= 0 || T <= 0 || H <= 0) return;
    dim3 grid(dv / RTILE, H, B);
    launch_pdl(kda_recurrent_kernel<float>, grid, dim3(128), 0, to_stream(s), o, q, k, v, g, beta, S_pool, slots,
               S_steps, T, H, dv, scale);
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_kda_recurrent_f16(float *o, const float *q, const float *k, const float *v,
                                             const float *g, const float *beta, uint16_t *S_pool,
                                             const int32_t *slots, uint16_t *S_steps, int B, int T,
                                             int H, int dk, int dv, float scale,
                                             lunar_cuda_stream s) {
    CUDA_REQUIRE(dk == RDK && dv % RTILE == 0 && dv > 0);
    if (B <= 0 || T <= 0 || H <= 0) return;
    dim3 grid(dv / RTILE, H, B);
    launch_pdl(kda_recurrent_kernel<__half>, grid, dim3(128), 0, to_stream(s),
        o, q, k, v, g, beta, reinterpret_cast<__half *>(S_pool), slots, reinterpret_cast<__half *>(S_steps), T,
        H, dv, scale);
    CUDA_CHECK_LAUNCH();
}
