// PTPC-FP8 (ops.h op_matmul_ptpc_fp8): per-row e4m3 quantisation (weights once at upload, tokens
// per call) and the scaled e4m3 x e4m3 GEMM through cuBLASLt with outer-vector fp32 scales
// (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F: D[i, j] = s_A[i] s_B[j] sum_k A[i, k] B[k, j]).
// Layout as cuda_gemm.cu: row-major y[n, out] is column-major D[out, n] = op(A) B with A = the
// codes of W seen column-major [in, out] and transposed (the "TN" form FP8 GEMMs require), B = the
// codes of x column-major [in, n]; so s_A = s_w (M = out) and s_B = s_x (N = n).
// On the H200 (cuBLASLt 13.1, sm_90) the scaled form is taken for every aligned shape once its
// heuristic query sees scale pointers (without them it answered CUBLAS_STATUS_INVALID_VALUE).
// Where cuBLASLt has no scaled algorithm for a shape, an unscaled FP8 GEMM plus a scaling kernel
// (fp32 y), else (or where the shape breaks FP8's 16-byte rules) a plain kernel computes the same
// product from the same codes (each form counted: lunar_cuda_ptpc_stats). Decode rows (n <= 4)
// take lunar_cuda_ptpc_gemv instead: quantiser and GEMV in one launch.
#include <cublasLt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "backend/cuda/cuda_common.cuh"

/* ---------------------------------------------------------------- quantisation */

constexpr int kQThreads = 256;

// The value quantised: a bf16 x as stored, an fp32 x rounded to bf16 first (the GEMM operand the
// forward's f32 -> bf16 copy would have made, so that copy's launch and buffer are saved)
__device__ __forceinline__ float to_f32(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// One block per row: amax by fmaxf (which drops NaN, like the CPU's `a > amax`), s = amax / 448
// and codes f32_to_e4m3(x / s) with IEEE divisions (__fdiv_rn: the CPU's fp32 `/`), so both
// backends produce the same codes and scales bit for bit.
template <typename TX>
__global__ void __launch_bounds__(kQThreads) ptpc_quant_kernel(uint8_t *q, float *s, const TX *x, int in) {
    __shared__ float red[kQThreads / 32];
    __shared__ float scale;
    const size_t row = blockIdx.x;
    const TX *xr = x + row * (size_t)in;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < in; i += kQThreads) amax = fmaxf(amax, fabsf(to_f32(xr[i])));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = amax;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = red[0];
        for (int w = 1; w < kQThreads / 32; w++) m = fmaxf(m, red[w]);
        float sc = __fdiv_rn(m, 448.0f);
        if (!(sc > 0.0f)) sc = 1.0f;
        scale = sc;
        s[row] = sc;
    }
    __syncthreads();
    const float sc = scale;
    uint8_t *qr = q + row * (size_t)in;
    for (int i = threadIdx.x; i < in; i += kQThreads) qr[i] = f32_to_e4m3(__fdiv_rn(to_f32(xr[i]), sc));
}

static int pg_init(void); /* the decode kernel's one-time setup (below) */

extern "C" void lunar_cuda_ptpc_quantize(uint8_t *q, float *s, const void *x, lunar_cuda_dtype xdt, int rows,
                                         int in, lunar_cuda_stream st) {
    CUDA_REQUIRE(rows >= 0 && in > 0);
    if (rows == 0) return;
    pg_init();
    if (xdt == LUNAR_CUDA_F32)
        ptpc_quant_kernel<<<rows, kQThreads, 0, to_stream(st)>>>(q, s, (const float *)x, in);
    else
        ptpc_quant_kernel<<<rows, kQThreads, 0, to_stream(st)>>>(q, s, (const __nv_bfloat16 *)x, in);
    CUDA_CHECK_LAUNCH();
}

/* ---------------------------------------------------------------- fallback GEMM
 * One warp per output: fp32 sum of the decoded products (each exact in fp32), then (dot * s_x) * s_w
 * as the CPU op. Slow (no tensor cores) but only for shapes cuBLASLt refuses. */
constexpr int kFbWarps = 8;

template <typename TY>
__global__ void __launch_bounds__(kFbWarps * 32) ptpc_fallback_kernel(TY *y, const uint8_t *qx, const float *sx,
                                                                       const uint8_t *qw, const float *sw, int n,
                                                                       int out, int in) {
    const long long idx = (long long)blockIdx.x * kFbWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (idx >= (long long)n * out) return;
    const int t = (int)(idx / out), o = (int)(idx % out);
    const uint8_t *xr = qx + (size_t)t * in, *wr = qw + (size_t)o * in;
    float acc = 0.0f;
    for (int i = lane; i < in; i += 32) acc += e4m3_to_f32(xr[i]) * e4m3_to_f32(wr[i]);
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) y[(size_t)t * out + o] = from_f32<TY>(acc * sx[t] * sw[o]);
}

static void fallback_launch(void *y, lunar_cuda_dtype ydt, const uint8_t *qx, const float *sx, const uint8_t *qw,
                            const float *sw, int n, int out, int in, cudaStream_t st) {
    const unsigned blocks = ceil_div_u((long long)n * out, kFbWarps);
    if (ydt == LUNAR_CUDA_F32)
        ptpc_fallback_kernel<<<blocks, kFbWarps * 32, 0, st>>>((float *)y, qx, sx, qw, sw, n, out, in);
    else
        ptpc_fallback_kernel<<<blocks, kFbWarps * 32, 0, st>>>((__nv_bfloat16 *)y, qx, sx, qw, sw, n, out, in);
    CUDA_CHECK_LAUNCH();
}

/* ---------------------------------------------------------------- skinny GEMM (decode)
 * y[n, out] for n <= 4 token rows in ONE launch, from the unquantised x: every block quantises the
 * n rows itself (the rule of ptpc_quant_kernel, so the same codes and scales: an fp32 x rounded to
 * bf16 first; the e4m3 rounding by the hardware's saturating round-to-nearest-even conversion,
 * which is f32_to_e4m3's rule) into shared memory as decoded fp32 values, while its warps' first
 * weight loads are already in flight (issued before, into registers); then each warp streams
 * whole rows of the e4m3 weight codes (1 byte per weight: half the bf16 GEMV's bytes) in 16-byte
 * loads, fp32 sums of exact products, scaled (dot * s_x) * s_w as the CPU op. The quantisation is
 * redundant per block, so the grid is at most two blocks per SM, their warps walking the rows
 * (first H200 runs: one block per 4-16 outputs made it cost more than the weights). It replaces
 * the f32 -> bf16 copy, the quantiser and the scaling launches of the GEMM path (4 launches -> 1
 * per linear in a decode step). Shared x: lane l reads its 16 values as four float4 in a rotated
 * order ((l / 2 + q) % 4) so the 8 lanes of a quarter warp, 64 bytes apart, hit 32 banks. */
constexpr int kPgWarps = 16, kPgRows = 4, kPgPre = 4;
/* shared x at most this many bytes (n * in * 4): 160 KB holds in = 10240 at n = 4, 40960 at n = 1 */
constexpr size_t kPgMaxSmem = 160u << 10;

__device__ __forceinline__ float4 pg_dec4(uint32_t c) { /* 4 e4m3 codes -> fp32, exact (via fp16) */
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(c & 0xffffu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(c >> 16), __NV_E4M3);
    const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&lo));
    const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&hi));
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ uint32_t pg_pick(uint4 v, int k) {
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}
/* acc[r] += the 16 codes of wv . x[r][16 i .. 16 i + 15] */
template <int NR>
__device__ __forceinline__ void pg_dot16(float *acc, uint4 wv, const float4 *xs4, int in, int i, int rot) {
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int k = (rot + q) & 3;
        const float4 wf = pg_dec4(pg_pick(wv, k));
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const float4 xv = xs4[((size_t)r * in) / 4 + (size_t)i * 4 + k];
            acc[r] += wf.x * xv.x + wf.y * xv.y + wf.z * xv.z + wf.w * xv.w;
        }
    }
}
/* the code of v / s, decoded: e4m3 with round to nearest even and saturation at +-448 */
__device__ __forceinline__ float pg_q(float v, float s) {
    const __nv_fp8_storage_t c = __nv_cvt_float_to_fp8(__fdiv_rn(v, s), __NV_SATFINITE, __NV_E4M3);
    return e4m3_to_f32((uint8_t)c);
}

template <int NR, typename TY, typename TX>
__global__ void __launch_bounds__(kPgWarps * 32) ptpc_gemv_kernel(TY *y, const TX *x, const uint8_t *qw,
                                                                   const float *sw, int out, int in) {
    extern __shared__ float4 xs4[]; /* [NR][in] decoded codes of x */
    float *xs = reinterpret_cast<float *>(xs4);
    __shared__ float red[kPgWarps][NR], scl[NR];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, n16 = in / 16;
    const int o0 = blockIdx.x * kPgWarps + warp, ostep = gridDim.x * kPgWarps;
    uint4 pre[kPgPre]; /* this lane's first loads of its first row, in flight during the quantisation */
#pragma unroll
    for (int j = 0; j < kPgPre; j++) {
        const int i = lane + 32 * j;
        pre[j] = o0 < out && i < n16 ? __ldcs(reinterpret_cast<const uint4 *>(qw + (size_t)o0 * in) + i)
                                     : make_uint4(0, 0, 0, 0);
    }
    float amax[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) {
        amax[r] = 0.0f;
        for (int i = tid; i < in; i += kPgWarps * 32) {
            const float v = to_f32(x[(size_t)r * in + i]);
            xs[(size_t)r * in + i] = v;
            amax[r] = fmaxf(amax[r], fabsf(v));
        }
        for (int m = 16; m > 0; m >>= 1) amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], m));
        if (lane == 0) red[warp][r] = amax[r];
    }
    __syncthreads();
    if (tid < NR) {
        float m = red[0][tid];
        for (int w = 1; w < kPgWarps; w++) m = fmaxf(m, red[w][tid]);
        const float sc = __fdiv_rn(m, 448.0f);
        scl[tid] = sc > 0.0f ? sc : 1.0f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < NR; r++) {
        const float sc = scl[r];
        for (int i = tid; i < in; i += kPgWarps * 32) xs[(size_t)r * in + i] = pg_q(xs[(size_t)r * in + i], sc);
    }
    __syncthreads();
    const int rot = (lane >> 1) & 3;
    for (int o = o0; o < out; o += ostep) {
        const uint4 *w4 = reinterpret_cast<const uint4 *>(qw + (size_t)o * in);
        float acc[NR];
#pragma unroll
        for (int r = 0; r < NR; r++) acc[r] = 0.0f;
        int i = lane;
        if (o == o0) {
#pragma unroll
            for (int j = 0; j < kPgPre; j++, i += 32)
                if (i < n16) pg_dot16<NR>(acc, pre[j], xs4, in, i, rot);
        }
#pragma unroll 4
        for (; i < n16; i += 32) pg_dot16<NR>(acc, __ldcs(w4 + i), xs4, in, i, rot);
#pragma unroll
        for (int r = 0; r < NR; r++)
            for (int m = 16; m > 0; m >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], m);
        if (lane == 0) {
            const float s = sw[o];
#pragma unroll
            for (int r = 0; r < NR; r++) y[(size_t)r * out + o] = from_f32<TY>(acc[r] * scl[r] * s);
        }
    }
}

/* Shared memory above 48 KB is opted into per kernel and per device, once, outside any graph
 * capture: lunar_cuda_ptpc_quantize (the weights' upload, before any decode step) calls this too. */
constexpr int kPgMaxDev = 16;
static int pg_sms[kPgMaxDev];
template <int NR, typename TY> static void pg_attr_one() {
    CUDA_CHECK(cudaFuncSetAttribute(ptpc_gemv_kernel<NR, TY, float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)kPgMaxSmem));
    CUDA_CHECK(cudaFuncSetAttribute(ptpc_gemv_kernel<NR, TY, __nv_bfloat16>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kPgMaxSmem));
}
static int pg_init(void) { /* returns the device's SM count */
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_REQUIRE(dev >= 0 && dev < kPgMaxDev);
    if (!pg_sms[dev]) {
        pg_attr_one<1, float>(), pg_attr_one<2, float>(), pg_attr_one<3, float>(), pg_attr_one<4, float>();
        pg_attr_one<1, __nv_bfloat16>(), pg_attr_one<2, __nv_bfloat16>(), pg_attr_one<3, __nv_bfloat16>();
        pg_attr_one<4, __nv_bfloat16>();
        CUDA_CHECK(cudaDeviceGetAttribute(&pg_sms[dev], cudaDevAttrMultiProcessorCount, dev));
    }
    return pg_sms[dev];
}

template <int NR, typename TY, typename TX>
static void pg_launch(TY *y, const TX *x, const uint8_t *qw, const float *sw, int out, int in, cudaStream_t st) {
    const int blocks = (int)std::min<long long>(ceil_div_u(out, kPgWarps), 2ll * pg_init());
    ptpc_gemv_kernel<NR, TY, TX><<<blocks, kPgWarps * 32, (size_t)NR * in * 4, st>>>(y, x, qw, sw, out, in);
    CUDA_CHECK_LAUNCH();
}

template <typename TY, typename TX>
static void pg_dispatch(TY *y, const TX *x, const uint8_t *qw, const float *sw, int n, int out, int in,
                        cudaStream_t st) {
    switch (n) {
    case 1: pg_launch<1>(y, x, qw, sw, out, in, st); break;
    case 2: pg_launch<2>(y, x, qw, sw, out, in, st); break;
    case 3: pg_launch<3>(y, x, qw, sw, out, in, st); break;
    default: pg_launch<4>(y, x, qw, sw, out, in, st); break;
    }
}

static int gemv_off(void) { /* LUNAR_PTPC_GEMV=0: decode rows take the quantiser + GEMM path (A/B runs) */
    static int off = -1;
    if (off < 0) off = getenv("LUNAR_PTPC_GEMV") && strcmp(getenv("LUNAR_PTPC_GEMV"), "0") == 0;
    return off;
}

static long long n_gemv;

extern "C" int lunar_cuda_ptpc_gemv(void *y, lunar_cuda_dtype ydt, const void *x, lunar_cuda_dtype xdt,
                                    const uint8_t *qw, const float *sw, int n, int out, int in,
                                    lunar_cuda_stream s) {
    CUDA_REQUIRE(n >= 0 && out > 0 && in > 0);
    if (n == 0) return 0;
    if (gemv_off() || n > kPgRows || in % 16 != 0 || (size_t)n * in * 4 > kPgMaxSmem ||
        ((uintptr_t)qw & 15) != 0)
        return -1;
    const cudaStream_t st = to_stream(s);
    if (ydt == LUNAR_CUDA_F32) {
        if (xdt == LUNAR_CUDA_F32) pg_dispatch((float *)y, (const float *)x, qw, sw, n, out, in, st);
        else pg_dispatch((float *)y, (const __nv_bfloat16 *)x, qw, sw, n, out, in, st);
    } else {
        if (xdt == LUNAR_CUDA_F32) pg_dispatch((__nv_bfloat16 *)y, (const float *)x, qw, sw, n, out, in, st);
        else pg_dispatch((__nv_bfloat16 *)y, (const __nv_bfloat16 *)x, qw, sw, n, out, in, st);
    }
    n_gemv++;
    return 0;
}

/* ---------------------------------------------------------------- cuBLASLt FP8 GEMM
 * Two forms: scaled (outer-vector scales inside the GEMM, one launch) and, where cuBLASLt has no
 * scaled algorithm (fp32 y only), unscaled (y = qx . qw^T in fp32, then y *= s_x s_w in the
 * CPU's order by scale_kernel). Each plan is per (shape, y type, form). */

/* y[t, o] *= s_x[t] then s_w[o] (the CPU's order): blockIdx.y walks token rows, the threads a
 * row's columns (float4 where out % 4 == 0: every row then starts 16-byte aligned) */
__global__ void ptpc_scale_kernel(float *y, const float *sx, const float *sw, int n, int out) {
    for (int t = blockIdx.y; t < n; t += gridDim.y) {
        float *yr = y + (size_t)t * out;
        const float s = sx[t];
        if (out % 4 == 0) {
            float4 *y4 = reinterpret_cast<float4 *>(yr);
            const float4 *w4 = reinterpret_cast<const float4 *>(sw);
            for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < out / 4; i += gridDim.x * blockDim.x) {
                float4 v = y4[i];
                const float4 w = w4[i];
                v.x = v.x * s * w.x, v.y = v.y * s * w.y, v.z = v.z * s * w.z, v.w = v.w * s * w.w;
                y4[i] = v;
            }
        } else {
            for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < out; i += gridDim.x * blockDim.x)
                yr[i] = yr[i] * s * sw[i];
        }
    }
}

struct fp8_plan {
    int n, out, in, ydt, scaled, used, ok; // ok = 0: no algorithm for this form
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
};

#define MAX_FP8_PLANS 128
static fp8_plan fplans[MAX_FP8_PLANS];
static int n_fplans;
static long long n_scaled, n_unscaled, n_fallback;
static int forced;
static char scaled_note[256];

static void plan_destroy(fp8_plan *p) {
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    if (p->a) cublasLtMatrixLayoutDestroy(p->a);
    if (p->b) cublasLtMatrixLayoutDestroy(p->b);
    if (p->d) cublasLtMatrixLayoutDestroy(p->d);
    memset(p, 0, sizeof *p);
}

// Every cuBLASLt status here is an answer ("not for this shape"), not an abort: another form or
// the fallback kernel computes the same product.
static int plan_build(fp8_plan *p) {
    const int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const cudaDataType_t dt = p->ydt == LUNAR_CUDA_F32 ? CUDA_R_32F : CUDA_R_16BF;
    if (cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return 0;
    if (cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) ||
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb))
        return 0;
    if (p->scaled && (cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &vec, sizeof vec) ||
                      cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec, sizeof vec)))
        return 0;
    if (cublasLtMatrixLayoutCreate(&p->a, CUDA_R_8F_E4M3, p->in, p->out, p->in) ||
        cublasLtMatrixLayoutCreate(&p->b, CUDA_R_8F_E4M3, p->in, p->n, p->in) ||
        cublasLtMatrixLayoutCreate(&p->d, dt, p->out, p->n, p->out))
        return 0;
    cublasLtMatmulPreference_t pref;
    size_t ws_bytes;
    void *ws = lunar_cuda_gemm_workspace(&ws_bytes);
    /* the scaled form's vectors are set per call (lt_run); the heuristic gets a device address
     * already (the workspace: never dereferenced here): with NULL scale pointers cuBLASLt 13.1 on
     * sm_90 answered CUBLAS_STATUS_INVALID_VALUE for every shape (this session's first H200 run),
     * with them it returns scaled algorithms (the second) */
    if (p->scaled && (cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws, sizeof ws) ||
                      cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &ws, sizeof ws)))
        return 0;
    if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return 0;
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)lunar_cuda_cublaslt_handle(), p->op, p->a, p->b, p->d,
                                            p->d, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (p->scaled && (st != CUBLAS_STATUS_SUCCESS || found <= 0))
        snprintf(scaled_note, sizeof scaled_note, "cuBLASLt %zu: no outer-vector scaled algorithm for n=%d out=%d in=%d "
                 "y %s (heuristic status %d, %d found)", cublasLtGetVersion(), p->n, p->out, p->in,
                 p->ydt == LUNAR_CUDA_F32 ? "f32" : "bf16", (int)st, found);
    if (st != CUBLAS_STATUS_SUCCESS || found <= 0) return 0;
    p->algo = res.algo;
    return 1;
}

static fp8_plan *get_fp8_plan(int n, int out, int in, lunar_cuda_dtype ydt, int scaled) {
    for (int i = 0; i < n_fplans; i++) {
        fp8_plan *q = &fplans[i];
        if (q->n == n && q->out == out && q->in == in && q->ydt == (int)ydt && q->scaled == scaled) return q;
    }
    // a full cache recycles a slot, as cuda_gemm.cu's plans
    fp8_plan *p = &fplans[n_fplans < MAX_FP8_PLANS ? n_fplans++ : (n % MAX_FP8_PLANS)];
    if (p->used) plan_destroy(p);
    p->n = n, p->out = out, p->in = in, p->ydt = (int)ydt, p->scaled = scaled, p->used = 1;
    p->ok = plan_build(p);
    return p;
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// One cuBLASLt call of plan p (scale pointers set when the form is scaled: host state read at
// enqueue, so a captured graph keeps the ones of its call); 0 when cuBLASLt took it.
static int lt_run(fp8_plan *p, void *y, const uint8_t *qx, const float *sx, const uint8_t *qw, const float *sw,
                  lunar_cuda_stream s) {
    const float alpha = 1.0f, beta = 0.0f;
    size_t ws_bytes;
    void *ws = s ? lunar_cuda_gemm_workspace_side(&ws_bytes) : lunar_cuda_gemm_workspace(&ws_bytes);
    cublasStatus_t r = CUBLAS_STATUS_SUCCESS;
    if (p->scaled) {
        r = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw, sizeof sw);
        if (r == CUBLAS_STATUS_SUCCESS)
            r = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx, sizeof sx);
    }
    if (r == CUBLAS_STATUS_SUCCESS)
        r = cublasLtMatmul((cublasLtHandle_t)lunar_cuda_cublaslt_handle(), p->op, &alpha, qw, p->a, qx, p->b, &beta,
                           y, p->d, y, p->d, &p->algo, ws, ws_bytes, to_stream(s));
    if (r != CUBLAS_STATUS_SUCCESS) p->ok = 0; // refused at run time: not this form for this shape again
    return r == CUBLAS_STATUS_SUCCESS ? 0 : -1;
}

extern "C" void lunar_cuda_ptpc_matmul(void *y, lunar_cuda_dtype ydt, const uint8_t *qx, const float *sx,
                                       const uint8_t *qw, const float *sw, int n, int out, int in,
                                       lunar_cuda_stream s) {
    CUDA_REQUIRE(n >= 0 && out > 0 && in > 0);
    if (n == 0) return;
    const cudaStream_t st = to_stream(s);
    // FP8 GEMMs want 16-byte aligned operands and leading dimensions (in bytes: in for the codes,
    // out * 2 or 4 for y)
    const size_t ysz = ydt == LUNAR_CUDA_F32 ? 4 : 2;
    const int lt = forced < 2 && in % 16 == 0 && ((size_t)out * ysz) % 16 == 0 && aligned16(qx) && aligned16(qw) &&
                   aligned16(y);
    if (lt && forced < 1) {
        fp8_plan *p = get_fp8_plan(n, out, in, ydt, 1);
        if (p->ok && lt_run(p, y, qx, sx, qw, sw, s) == 0) {
            n_scaled++;
            return;
        }
    }
    if (lt && ydt == LUNAR_CUDA_F32) {
        fp8_plan *p = get_fp8_plan(n, out, in, ydt, 0);
        if (p->ok && lt_run(p, y, qx, sx, qw, sw, s) == 0) {
            const int per_row = out % 4 == 0 ? out / 4 : out;
            const dim3 grid(std::min(ceil_div_u(per_row, 256), 64u), std::min(n, 8192));
            ptpc_scale_kernel<<<grid, 256, 0, st>>>((float *)y, sx, sw, n, out);
            CUDA_CHECK_LAUNCH();
            n_unscaled++;
            return;
        }
    }
    n_fallback++;
    fallback_launch(y, ydt, qx, sx, qw, sw, n, out, in, st);
}

extern "C" void lunar_cuda_ptpc_stats(long long *scaled, long long *unscaled, long long *fallback,
                                      long long *gemv) {
    if (gemv) *gemv = n_gemv;
    if (scaled) *scaled = n_scaled;
    if (unscaled) *unscaled = n_unscaled;
    if (fallback) *fallback = n_fallback;
}

extern "C" void lunar_cuda_ptpc_force(int level) { forced = level; }

extern "C" const char *lunar_cuda_ptpc_scaled_note(void) { return scaled_note; }
