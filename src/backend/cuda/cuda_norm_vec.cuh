// The vector row norm's shared parts (cuda_dense.cu's norm_vec_kernel and combine_norm_kernel, cuda_gemm.cu's
// o_proj gemv with the residual add + RMSNorm folded in) and the GLU activation (cuda_dense.cu's glu_kernel,
// cuda_gemm.cu's down gemv with the GLU folded in): one copy of the arithmetic, so that the fused kernels
// give the bits of the launches they replace. Kept out of cuda_common.cuh: only these two files need it.
#ifndef LUNAR_CUDA_NORM_VEC_CUH
#define LUNAR_CUDA_NORM_VEC_CUH
#include "backend/cuda/cuda_common.cuh"

// act 0: silu(g) * u; act 1: SiTU  beta*tanh(g/beta)*sigmoid(g) * (beta_l>0 ? beta_l*tanh(u/beta_l) : u)
template <int ACT>
__device__ __forceinline__ float glu_act(float a, float b, float beta, float beta_l) {
    if (ACT == 0) return a / (1.0f + expf(-a)) * b;
    const float ga = beta * tanhf(a / beta) / (1.0f + expf(-a));
    const float ub = beta_l > 0.0f ? beta_l * tanhf(b / beta_l) : b;
    return ga * ub;
}

#define NORM_VEC_THREADS 256
template <typename Y>
__device__ __forceinline__ void store4(Y *y, size_t i, float a, float b, float c, float d);
template <>
__device__ __forceinline__ void store4<float>(float *y, size_t i, float a, float b, float c, float d) {
    reinterpret_cast<float4 *>(y)[i] = make_float4(a, b, c, d);
}
template <>
__device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16 *y, size_t i, float a, float b, float c,
                                                      float d) {
    reinterpret_cast<uint2 *>(y)[i] = make_uint2(gv_pack(a, b), gv_pack(c, d));
}
// the norm of row `row` held as a[] (x after the add), shared by norm_vec_kernel, combine_norm_kernel
// and the o_proj gemv's norm epilogue (cuda_gemm.cu) so that all give the same bits; T: the threads
// holding chunks (blockDim.x, or fewer in a larger block whose other threads hold zeros): a thread's 4V squares in chunk order, the warp
// butterfly, the warp sums in warp order, then y (and yb) = a * inv * w
template <typename Y, int V>
__device__ __forceinline__ void norm_vec_tail(Y *y, __nv_bfloat16 *yb, const float4 (&a)[V], const uint2 (&wq)[V],
                                              bool hw, float *red, size_t row, int dim, float eps, int T) {
    const int nv = dim >> 2, tid = threadIdx.x;
    float ss = 0.0f;
#pragma unroll
    for (int v = 0; v < V; v++) {
        ss += a[v].x * a[v].x;
        ss += a[v].y * a[v].y;
        ss += a[v].z * a[v].z;
        ss += a[v].w * a[v].w;
    }
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((tid & 31) == 0) red[tid >> 5] = ss;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_VEC_THREADS / 32; i++)
        if (i < (T >> 5)) tot += red[i];
    const float inv = 1.0f / sqrtf(tot / dim + eps);
#pragma unroll
    for (int v = 0; v < V; v++) {
        const int i = tid + v * T;
        if (i >= nv || tid >= T) continue;
        float o0 = a[v].x * inv, o1 = a[v].y * inv, o2 = a[v].z * inv, o3 = a[v].w * inv;
        if (hw) {
            o0 *= bf16_bits_to_f32((uint16_t)wq[v].x), o1 *= bf16_bits_to_f32((uint16_t)(wq[v].x >> 16));
            o2 *= bf16_bits_to_f32((uint16_t)wq[v].y), o3 *= bf16_bits_to_f32((uint16_t)(wq[v].y >> 16));
        }
        store4<Y>(y + row * dim, i, o0, o1, o2, o3);
        if (yb)
            store4<__nv_bfloat16>(yb + row * dim, i, (float)from_f32<Y>(o0), (float)from_f32<Y>(o1),
                                  (float)from_f32<Y>(o2), (float)from_f32<Y>(o3));
    }
}
// the vector norms' weights (chunk v of thread tid: 4 bf16 at tid + v T; zero past nv or without w), loaded
// before the PDL wait: no kernel of the step writes them
template <int V>
__device__ __forceinline__ void norm_vec_weights(uint2 (&wq)[V], const uint16_t *w, int nv, int tid, int T) {
#pragma unroll
    for (int v = 0; v < V; v++) {
        const int i = tid + v * T;
        wq[v] = w && i < nv ? __ldg(reinterpret_cast<const uint2 *>(w) + i) : make_uint2(0, 0);
    }
}

#endif
