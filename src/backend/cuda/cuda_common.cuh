// Internal to the CUDA backend: error checks with file and line, the cuBLASLt handle, bf16 helpers.
#ifndef LUNAR_BACKEND_CUDA_COMMON_CUH
#define LUNAR_BACKEND_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/cuda_ops.h"

// A CUDA error inside the backend is a programming error (or a dead device): report where, abort.
#define CUDA_CHECK(call)                                                                        \
    do {                                                                                        \
        cudaError_t e_ = (call);                                                                \
        if (e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d: CUDA error %s: %s (in %s)\n", __FILE__, __LINE__,          \
                    cudaGetErrorName(e_), cudaGetErrorString(e_), #call);                      \
            abort();                                                                            \
        }                                                                                       \
    } while (0)

// After every launch: launch-configuration errors now, execution errors at the next sync.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#define CUDA_REQUIRE(cond)                                                                      \
    do {                                                                                        \
        if (!(cond)) {                                                                          \
            fprintf(stderr, "%s:%d: CUDA backend: requirement `%s` failed\n", __FILE__,        \
                    __LINE__, #cond);                                                          \
            abort();                                                                            \
        }                                                                                       \
    } while (0)

struct cublasLtContext;
void *lunar_cuda_cublaslt_handle(void);  // cublasLtHandle_t
void *lunar_cuda_gemm_workspace(size_t *bytes);
void *lunar_cuda_gemm_workspace_side(size_t *bytes); // for GEMMs on a stream other than the legacy one

// What the forward's NULL stream means: the legacy stream, except while a decode step is being
// captured into a CUDA graph (lunar_cuda_capture_begin, cuda_rt.cu), when it is the capture stream
// (the legacy stream itself cannot be captured). Every launch of the backend goes through here.
extern cudaStream_t lunar_cuda_cur_stream;
static inline cudaStream_t to_stream(lunar_cuda_stream s) { return s ? (cudaStream_t)s : lunar_cuda_cur_stream; }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) {
    return __uint_as_float((uint32_t)h << 16);
}
// 4 bf16 values loaded as one uint2 (low half first), widened exactly: a bf16's bits are the top half of its fp32's
__device__ __forceinline__ float4 bf16x4_to_f32(uint2 u) {
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
}

// e4m3 (FP8) codes as the CPU's tensor.c lunar_f32_to_e4m3 / lunar_e4m3_to_f32 (round half to even,
// saturation to +-448, NaN -> 0x7f), so that both backends store the same codes: the DSA index keys
// and queries, the FP8 latent cache, PTPC-FP8 activations. f32_to_e4m3_ref is the CPU's function
// statement for statement; f32_to_e4m3 is the hardware conversion (cvt.rn.satfinite.e4m3x2.f32: the
// same rounding and saturation in one instruction), NaN mapped first as the CPU maps it. The two are
// equal on all 2^32 inputs (lunar_cuda_e4m3_mismatches, test cuda_e4m3_hw_equals_cpu_port). Why:
// the software port (frexpf, rintf, branches) was most of the indexer's score kernel at one row, which
// quantises its 32 x 128 queries in every block: 12 of 19 us at 1 x 8K (session 22, phase stamps).
__device__ __forceinline__ uint8_t f32_to_e4m3(float f) {
    if (isnan(f)) return 0x7f;
    return (uint8_t)__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ uint8_t f32_to_e4m3_ref(float f) {
    if (isnan(f)) return 0x7f;
    const uint8_t sign = signbit(f) ? 0x80 : 0;
    const float a = fabsf(f);
    if (a >= 448.0f) return sign | 0x7e;
    if (a < 0.015625f) return sign | (uint8_t)rintf(__fmul_rn(a, 512.0f));
    int e;
    const float m = frexpf(a, &e);
    float mant = rintf(__fmul_rn(__fsub_rn(__fmul_rn(m, 2.0f), 1.0f), 8.0f));
    int ex = e - 1 + 7;
    if (mant >= 8.0f) mant = 0.0f, ex++;
    if (ex > 15 || (ex == 15 && mant > 6.0f)) return sign | 0x7e;
    return sign | (uint8_t)(ex << 3) | (uint8_t)mant;
}
__device__ __forceinline__ float e4m3_to_f32(uint8_t c) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3);
    return __half2float(*reinterpret_cast<__half *>(&h));
}

// d[0..3] += A (16x16, row) . B (16x8, col): mma.m16n8k16, bf16 operands, fp32 accumulation; a0..a3 / b0, b1
// the fragments' registers in the PTX order (the MoE kernels, the MLA flash prefill, the skinny GEMM)
__device__ __forceinline__ void mma_bf16(float *d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The double sum of the glue kernels (layernorm, AttnRes reference, cuda_glue.cu) and of the indexer's
// key prep (cuda_dsa.cu), whose results must be the same bits: warp butterflies, then every warp's sum
// added in warp order by every thread
__device__ __forceinline__ double block_sum_f64(double v, double *red) {
    for (int d = 16; d; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    double t = 0;
    for (int i = 0; i < nw; i++) t += red[i];
    __syncthreads();
    return t;
}
// One row of `dim` values by the block: yr = LayerNorm(xr) (times w, plus b; either may be NULL), the mean
// and variance as double sums in block_sum_f64's tree (red: 32 doubles of shared memory); yr may be
// shared memory (the indexer's key prep, cuda_dsa.cu) or global (lunar_glue_layernorm): the same bits
__device__ __forceinline__ void layernorm_block(float *yr, const float *xr, const float *w, const float *b, int dim,
                                                float eps, double *red) {
    double s = 0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i];
    double mean = block_sum_f64(s, red) / dim;
    double v = 0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) v += (xr[i] - mean) * (xr[i] - mean);
    double var = block_sum_f64(v, red) / dim;
    float inv = (float)(1.0 / sqrt(var + (double)eps));
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float t = (float)(xr[i] - mean) * inv;
        if (w) t *= w[i];
        if (b) t += b[i];
        yr[i] = t;
    }
}
// v[0, len) in shared memory (len a power of two) rotated in place by the unnormalised Hadamard
// butterflies, a + b and a - b stage by stage; the block synchronised before and after (lunar_glue_hadamard
// and the indexer's query prep: the same bits)
__device__ __forceinline__ void hadamard_block(float *v, int len) {
    __syncthreads();
    for (int h = 1; h < len; h <<= 1) {
        for (int p = threadIdx.x; p < len / 2; p += blockDim.x) {
            int i = (p / h) * 2 * h, j = i + (p % h);
            float a = v[j], b = v[j + h];
            v[j] = a + b;
            v[j + h] = a - b;
        }
        __syncthreads();
    }
}
// The sum of v over the block (every thread gets it; blockDim a multiple of 32, at most 1024):
// warp butterflies, then the warps' sums in warp order through red[32]. A fixed tree, shared by
// the norm kernels (cuda_dense.cu) and the fused KDA decode (cuda_kda_recurrent.cu), whose
// results must be the same bits.
__device__ __forceinline__ float block_sum_f32(float v, float *red) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();  // red may still be read by a previous call
    if (l == 0) red[w] = v;
    __syncthreads();
    float t = l < nw ? red[l] : 0.0f;
    for (int o = 16; o; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

// the short convolutions' longest kernel (cuda_dense.cu, cuda_kda_recurrent.cu)
#define CONV_MAX_K 8

static inline unsigned ceil_div_u(long long a, long long b) { return (unsigned)((a + b - 1) / b); }

// op_kda_gate of one element: f the forget projection, a_log = A_log of its head, dtb its dt_bias
// (shared by kda_gate_kernel and the batch-1 gate projection of cuda_gemm.cu: the same bits)
__device__ __forceinline__ float kda_gate_value(float f, float a_log, float dtb, float lb) {
    const float a = expf(a_log);
    const float x = f + dtb;
    if (lb < 0.0f) return lb / (1.0f + expf(-a * x));
    const float sp = x > 20.0f ? x : log1pf(expf(x));
    return -a * sp;
}

// The skinny GEMM's arithmetic (cuda_gemm.cu), shared with the fused KDA decode's gate rows
// (cuda_kda_recurrent.cu), whose results must be the same bits: 8 bf16 pairs per 16-byte load.
__device__ __forceinline__ float gv_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float gv_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float gv_dot8(uint4 a, uint4 b) {
    return gv_lo(a.x) * gv_lo(b.x) + gv_hi(a.x) * gv_hi(b.x) + gv_lo(a.y) * gv_lo(b.y) + gv_hi(a.y) * gv_hi(b.y) +
           gv_lo(a.z) * gv_lo(b.z) + gv_hi(a.z) * gv_hi(b.z) + gv_lo(a.w) * gv_lo(b.w) + gv_hi(a.w) * gv_hi(b.w);
}
__device__ __forceinline__ void gv_store(float *y, float v) { *y = v; }
__device__ __forceinline__ void gv_store(__nv_bfloat16 *y, float v) { *y = __float2bfloat16_rn(v); }

/* 8 consecutive x values as bf16 pairs: bf16 x as stored, or fp32 x rounded to bf16 here (the
 * value the f32 -> bf16 copy before a GEMM would have made) */
__device__ __forceinline__ uint4 gv_x8(const uint16_t *x, size_t row, int i, int in) {
    return __ldg((const uint4 *)(x + row * in) + i);
}
__device__ __forceinline__ uint32_t gv_pack(float a, float b) {
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(a)) |
           (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(b)) << 16;
}
__device__ __forceinline__ uint4 gv_x8(const float *x, size_t row, int i, int in) {
    const float4 a = __ldg((const float4 *)(x + row * in) + 2 * i), b = __ldg((const float4 *)(x + row * in) + 2 * i + 1);
    return make_uint4(gv_pack(a.x, a.y), gv_pack(a.z, a.w), gv_pack(b.x, b.y), gv_pack(b.z, b.w));
}

// Programmatic dependent launch (PDL), on unless LUNAR_CUDA_PDL=0 (lunar_cuda_pdl_on, cuda_rt.cu):
// a kernel launched by launch_pdl may be scheduled while its stream predecessor still runs, which
// hides the launch and the block scheduling of each decode-step node behind the previous one.
// THE RULE. Every kernel launch_pdl launches calls pdl_wait() (= pdl_enter()) before it reads
// anything a kernel of the step may write (activations, routes, caches, recurrent states) and
// before its first global write. griddepcontrol.wait returns once the predecessor grids have
// completed and their writes are visible; launch_dependents, issued only after that wait, lets the
// next kernel's blocks take their places while this one works (they wait in turn). Since every
// block of every such kernel waits, a kernel completes only after its predecessor did, so the chain
// stays transitive (a kernel that skipped the wait could finish before its own predecessor, and its
// successor would then read that predecessor's output unfinished).
// What may come BEFORE the wait (issue 9: at batch 1 nearly every decode kernel streams weights
// that nothing writes, and waiting first left DRAM idle through each predecessor's tail and the
// next kernel's ramp):
//  - reads of data no kernel of the step writes (weights, constant tables, kernel arguments);
//  - pdl_prefetch_l2 of such data, the block's own slice only and bounded by the caller (the
//    prefetched bytes live in the same 50 MB L2 the running predecessor streams through). A
//    prefetch is a hint: it returns no value, and L2 is the device's point of coherence, so it can
//    never make a later read stale; its address must still be valid memory;
//  - reads that only choose such a prefetch's address, of data written by a kernel at least TWO
//    launches back on the stream (e.g. the MoE route read by the down kernel, written by the route
//    kernel before the gate/up kernel): this kernel can start only once every block of its direct
//    predecessor has passed its own wait, which returned after that older kernel had completed.
//    Never anything the direct predecessor writes.
// All instructions are no-ops for a kernel launched without the attribute, so the wait costs
// nothing when PDL is off; the prefetches are gated by the launcher's pf argument
// (lunar_cuda_pdl_prefetch: LUNAR_PDL_PREFETCH, opt-in since the H200 A/B; off with PDL off).
__device__ __forceinline__ void pdl_enter() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void pdl_wait() { pdl_enter(); }
// L2 prefetch of [p, p + bytes) by the calling thread, one bulk request (the TMA unit walks it).
// The instruction needs p 16-byte aligned and bytes a multiple of 16: a request that is not (a
// sub-allocated tensor) or is empty is dropped, a hint being optional
__device__ __forceinline__ void pdl_prefetch_l2(const void *p, uint32_t bytes) {
    if (bytes && ((uintptr_t)p | bytes) % 16 == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
// the one 128-byte line holding p into L2 (slices that are not contiguous: a thread per line)
__device__ __forceinline__ void pdl_prefetch_line_l2(const void *p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p) : "memory");
}
template <typename... KA, typename... A>
static inline void launch_pdl(void (*k)(KA...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    if (lunar_cuda_pdl_on()) cfg.attrs = at, cfg.numAttrs = 1;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, k, ((KA)args)...));
}

#endif
