// BF16 GEMM through cuBLASLt: y[n, out] = x[n, in] . W[out, in]^T, fp32 accumulation.
// cuBLASLt is column-major: row-major y[n, out] is column-major D[out, n] = op(A) B with
// A = W seen as column-major [in, out] (ld in) transposed, B = x seen as column-major [in, n].
// Plans (layouts + the heuristic's best algorithm) are cached per shape.
#include <cublasLt.h>

#include "backend/cuda/cuda_common.cuh"

#define LT_CHECK(call)                                                                         \
    do {                                                                                       \
        cublasStatus_t st_ = (call);                                                           \
        if (st_ != CUBLAS_STATUS_SUCCESS) {                                                    \
            fprintf(stderr, "%s:%d: cuBLASLt error %d (in %s)\n", __FILE__, __LINE__, (int)st_, \
                    #call);                                                                    \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

struct gemm_plan {
    int n, out, in, ydt, used;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
};

#define MAX_PLANS 128
static gemm_plan plans[MAX_PLANS];
static int n_plans;

static gemm_plan *get_plan(int n, int out, int in, lunar_cuda_dtype ydt) {
    for (int i = 0; i < n_plans; i++)
        if (plans[i].n == n && plans[i].out == out && plans[i].in == in && plans[i].ydt == (int)ydt)
            return &plans[i];
    // a full cache recycles the oldest slot (shapes are few in practice: one per linear x batch)
    gemm_plan *p = &plans[n_plans < MAX_PLANS ? n_plans++ : (n % MAX_PLANS)];
    if (p->used) {
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->d);
    }
    p->n = n, p->out = out, p->in = in, p->ydt = (int)ydt, p->used = 1;
    LT_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cudaDataType_t dt = ydt == LUNAR_CUDA_F32 ? CUDA_R_32F : CUDA_R_16BF;
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, in, out, in));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, in, n, in));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->d, dt, out, n, out));
    cublasLtMatmulPreference_t pref;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws_bytes;
    lunar_cuda_gemm_workspace(&ws_bytes);
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &ws_bytes, sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)lunar_cuda_cublaslt_handle(), p->op,
                                            p->a, p->b, p->d, p->d, pref, 1, &res, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    CUDA_REQUIRE(found > 0);
    p->algo = res.algo;
    return p;
}

extern "C" void lunar_cuda_matmul(void *y, lunar_cuda_dtype ydt, const uint16_t *x,
                                  const uint16_t *W, int n, int out, int in, lunar_cuda_stream s) {
    CUDA_REQUIRE(n >= 0 && out > 0 && in > 0);
    if (n == 0) return;
    gemm_plan *p = get_plan(n, out, in, ydt);
    const float alpha = 1.0f, beta = 0.0f;
    size_t ws_bytes;
    /* GEMMs may run at once on the legacy stream and on one side stream (the shared experts): each
     * has its own workspace */
    void *ws = s ? lunar_cuda_gemm_workspace_side(&ws_bytes) : lunar_cuda_gemm_workspace(&ws_bytes);
    LT_CHECK(cublasLtMatmul((cublasLtHandle_t)lunar_cuda_cublaslt_handle(), p->op, &alpha, W, p->a,
                            x, p->b, &beta, y, p->d, y, p->d, &p->algo, ws, ws_bytes,
                            to_stream(s)));
}
