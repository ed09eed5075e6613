// PTPC-FP8 (ops.h op_matmul_ptpc_fp8): per-row e4m3 quantisation (weights once at upload, tokens
// per call) and the scaled e4m3 x e4m3 GEMM through cuBLASLt with outer-vector fp32 scales
// (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F: D[i, j] = s_A[i] s_B[j] sum_k A[i, k] B[k, j]).
// Layout as cuda_gemm.cu: row-major y[n, out] is column-major D[out, n] = op(A) B with A = the
// codes of W seen column-major [in, out] and transposed (the "TN" form FP8 GEMMs require), B = the
// codes of x column-major [in, n]; so s_A = s_w (M = out) and s_B = s_x (N = n).
// Where cuBLASLt has no scaled algorithm for a shape, an unscaled FP8 GEMM plus a scaling kernel
// (fp32 y), else (or where the shape breaks FP8's 16-byte rules) a plain kernel computes the same
// product from the same codes (each form counted: lunar_cuda_ptpc_stats).
#include <cublasLt.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

/* ---------------------------------------------------------------- quantisation */

constexpr int kQThreads = 256;

__device__ __forceinline__ float to_f32(float v) { return v; }
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

extern "C" void lunar_cuda_ptpc_quantize(uint8_t *q, float *s, const void *x, lunar_cuda_dtype xdt, int rows,
                                         int in, lunar_cuda_stream st) {
    CUDA_REQUIRE(rows >= 0 && in > 0);
    if (rows == 0) return;
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

/* ---------------------------------------------------------------- cuBLASLt FP8 GEMM
 * Two forms: scaled (outer-vector scales inside the GEMM, one launch) and, where cuBLASLt has no
 * scaled algorithm (fp32 y only), unscaled (y = qx . qw^T in fp32, then y *= s_x s_w in the
 * CPU's order by scale_kernel). Each plan is per (shape, y type, form). */

__global__ void ptpc_scale_kernel(float *y, const float *sx, const float *sw, int n, int out) {
    const size_t total = (size_t)n * out;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x)
        y[i] = y[i] * sx[i / out] * sw[i % out];
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
    if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return 0;
    size_t ws_bytes;
    lunar_cuda_gemm_workspace(&ws_bytes);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)lunar_cuda_cublaslt_handle(), p->op, p->a, p->b, p->d,
                                            p->d, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
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
            const size_t total = (size_t)n * out;
            const unsigned blocks = (unsigned)(total < ((size_t)1 << 20) ? (total + 255) / 256 : 4096);
            ptpc_scale_kernel<<<blocks, 256, 0, st>>>((float *)y, sx, sw, n, out);
            CUDA_CHECK_LAUNCH();
            n_unscaled++;
            return;
        }
    }
    n_fallback++;
    fallback_launch(y, ydt, qx, sx, qw, sw, n, out, in, st);
}

extern "C" void lunar_cuda_ptpc_stats(long long *scaled, long long *unscaled, long long *fallback) {
    if (scaled) *scaled = n_scaled;
    if (unscaled) *unscaled = n_unscaled;
    if (fallback) *fallback = n_fallback;
}

extern "C" void lunar_cuda_ptpc_force(int level) { forced = level; }
