// BF16 GEMM through cuBLASLt: y[n, out] = x[n, in] . W[out, in]^T, fp32 accumulation.
// cuBLASLt is column-major: row-major y[n, out] is column-major D[out, n] = op(A) B with
// A = W seen as column-major [in, out] (ld in) transposed, B = x seen as column-major [in, n].
// Plans (layouts + the heuristic's best algorithm) are cached per shape.
#include <cublasLt.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

// a plan slot's cuBLASLt objects, released before the slot is reused
static void lt_release(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                       cublasLtMatrixLayout_t d) {
    cublasLtMatmulDescDestroy(op);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(d);
}

// cuBLASLt's first heuristic choice for D = op(A) op(B) within the shared workspace (C is D, beta 0)
static cublasLtMatmulAlgo_t lt_algo(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                    cublasLtMatrixLayout_t d) {
    cublasLtMatmulPreference_t pref;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws_bytes;
    lunar_cuda_gemm_workspace(&ws_bytes);
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                  sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)lunar_cuda_cublaslt_handle(), op, a, b, d, d, pref, 1,
                                            &res, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    CUDA_REQUIRE(found > 0);
    return res.algo;
}

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
    if (p->used) lt_release(p->op, p->a, p->b, p->d);
    p->n = n, p->out = out, p->in = in, p->ydt = (int)ydt, p->used = 1;
    LT_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cudaDataType_t dt = ydt == LUNAR_CUDA_F32 ? CUDA_R_32F : CUDA_R_16BF;
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, in, out, in));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, in, n, in));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->d, dt, out, n, out));
    p->algo = lt_algo(p->op, p->a, p->b, p->d);
    return p;
}

/* ---------------------------------------------------------------- skinny GEMM (decode)
 * y[n, out] = x[n, in] . W[out, in]^T for n <= kGvRows (4): memory-bound (W read once for all n rows),
 * where cuBLASLt pays a fixed ~5-8 us per call and reaches 25-45 % of the bandwidth on the small
 * matrices of a decode step (docs/benchmarks.md, BF16 GEMM table). A warp streams rows of W in 16-byte
 * loads (8 bf16, lanes contiguous) against the n rows of x (small, L1-resident); `split` warps
 * share one output when there are too few outputs to fill the device, their partial sums added in
 * warp order through shared memory. fp32 accumulation, fixed summation order: deterministic. */
/* Rows: measured on the H200 (Kimi-Linear-48B decode, graphs on, docs/benchmarks.md): at n = 1 this
 * kernel saves 0.9 ms of a 4.5 ms step against cuBLASLt, at n = 8 it loses 0.8 ms of 9.2 (each W
 * load then waits on 8 x loads and 64 FMAs); 2..4 are unmeasured and kept here (x loads per W load
 * at most 4). */
constexpr int kGvRows = 4, kGvWarps = 8;
/* matrices above this many elements stay on cuBLASLt (lm_head: 99 % of the bandwidth at n = 1) */
constexpr long long kGvMaxElems = 64ll << 20;

/* The epilogue of output i (lunar_cuda_matmul_f32x_into): v = the product, plus add[i] where add is
 * given, then added to y[i] where acc is set: the statements of the unfused sequence (the product
 * stored, then glue adds y2 += add, y += y2, each one fp32 addition), so the same bits */
template <typename TY> __device__ __forceinline__ void gv_epilogue(TY *y, size_t i, float v, const float *add, int acc) {
    if (add) v += add[i];
    if (acc) v += (float)y[i];
    gv_store(y + i, v);
}

/* U: the loads of W a warp has in flight (the unroll of its stream). EP: the epilogue's add and accum
 * (gv_epilogue) read: gemv_ep_kernel, a kernel of its own so that the plain instances keep their code
 * (the fp32-x one went from 32 to 36 registers with the epilogue as run-time arguments, past the 8
 * blocks a SM it is sized for; bounded to 8 blocks, the epilogue's instance fits 32 without spills) */
template <int NR, int U, typename TY, typename TX, bool EP>
__device__ __forceinline__ void gemv_body(TY *y, const TX *x, const uint16_t *W, int out, int in, int split,
                                          uint32_t pf, const float *add, int accum) {
    __shared__ float red[kGvWarps][NR];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, per_block = kGvWarps / split;
    const int o = blockIdx.x * per_block + warp / split, part = warp % split, n8 = in / 8;
    /* before the wait (cuda_common.cuh's rule: weights only): the head of each of the block's rows
     * into L2, pf bytes per block in all, while the predecessor still runs */
    if (pf && part == 0 && lane == 0 && o < out) {
        const uint32_t rb = (uint32_t)in * 2u, lim = (pf / (uint32_t)per_block) & ~15u;
        pdl_prefetch_l2(W + (size_t)o * in, rb < lim ? rb : lim);
    }
    pdl_wait();
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.f;
    if (o < out) {
        const uint4 *w4 = (const uint4 *)(W + (size_t)o * in);
#pragma unroll U
        for (int i = part * 32 + lane; i < n8; i += 32 * split) {
            const uint4 wv = __ldcs(w4 + i); /* streamed once: not kept in L1 */
#pragma unroll
            for (int r = 0; r < NR; r++) acc[r] += gv_dot8(wv, gv_x8(x, (size_t)r, i, in));
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++)
        for (int m = 16; m > 0; m >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], m);
    if (split == 1) {
        if (lane == 0 && o < out)
#pragma unroll
            for (int r = 0; r < NR; r++) {
                if (EP) gv_epilogue(y, (size_t)r * out + o, acc[r], add, accum);
                else gv_store(y + (size_t)r * out + o, acc[r]);
            }
        return;
    }
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < NR; r++) red[warp][r] = acc[r];
    __syncthreads();
    const int t = threadIdx.x, ob = t / NR, r = t % NR; /* thread t: row r of the block's output ob */
    if (t < per_block * NR) {
        const int oo = blockIdx.x * per_block + ob;
        float v = 0.f;
        for (int w = 0; w < split; w++) v += red[ob * split + w][r];
        if (oo < out && EP) gv_epilogue(y, (size_t)r * out + oo, v, add, accum);
        else if (oo < out) gv_store(y + (size_t)r * out + oo, v);
    }
}
template <int NR, int U, typename TY, typename TX>
__global__ void __launch_bounds__(kGvWarps * 32) gemv_kernel(TY *y, const TX *x, const uint16_t *W, int out,
                                                            int in, int split, uint32_t pf) {
    gemv_body<NR, U, TY, TX, false>(y, x, W, out, in, split, pf, NULL, 0);
}
template <int NR, int U, typename TY, typename TX>
__global__ void __launch_bounds__(kGvWarps * 32, 8) gemv_ep_kernel(TY *y, const TX *x, const uint16_t *W, int out,
                                                                  int in, int split, uint32_t pf, const float *add,
                                                                  int accum) {
    gemv_body<NR, U, TY, TX, true>(y, x, W, out, in, split, pf, add, accum);
}

/* Deep (the default; LUNAR_GEMV_DEEP=0 the session-5 kernel): 8 loads of W in flight per warp instead
 * of 4, and the split chosen so the grid fits one wave of resident blocks where some split does. The
 * per-kernel table of a decode step (docs/benchmarks.md, session 6 call 3) had the one-token projections
 * at 2.0-3.2 TB/s, o_proj (2304 x 4096) on split 4 = 1152 blocks, 1.09 waves of 1056 with a 96-block
 * tail. Measured: Kimi-Linear B = 1 2.893 -> 2.853 ms (two rounds each, session 6 final call). */
static int gemv_deep(void) {
    static int v = -1;
    if (v < 0) v = !(getenv("LUNAR_GEMV_DEEP") && strcmp(getenv("LUNAR_GEMV_DEEP"), "0") == 0);
    return v;
}
/* blocks of kernel k resident on the whole device at once (its registers decide: 30 at one row,
 * 8 blocks per SM; 64 at four rows, 4) */
template <typename K> static int gemv_wave_blocks(K k) {
    int dev = 0, sms = 0, per_sm = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kGvWarps * 32, 0));
    return sms * (per_sm > 0 ? per_sm : 1);
}

/* Every skinny GEMM through gemv_ep_kernel, with no epilogue work where none is asked (the same bits as
 * gemv_kernel): its 8-blocks-a-SM bound compiles the fp32-x instance to 32 registers without gemv_kernel's
 * 4-byte spill. Measured (session 20, 2 rounds alternating, B = 1): the K3.1 slice 1.474 / 1.453 ->
 * 1.451 / 1.450 ms, Kimi-Linear-48B 2.515 / 2.521 -> 2.513 / 2.511; small, but every round. LUNAR_GEMV_EP=0:
 * gemv_kernel (A/B) */
static bool gemv_ep_all(void) {
    static int v = -1;
    if (v < 0) v = !(getenv("LUNAR_GEMV_EP") && atoi(getenv("LUNAR_GEMV_EP")) <= 0);
    return v;
}

template <typename TY, typename TX>
static void gemv_launch(TY *y, const TX *x, const uint16_t *W, int n, int out, int in, cudaStream_t st,
                        const float *add = NULL, int accum = 0) {
    /* split: warps sharing one output. Deep: as many as keep the grid within one wave of resident
     * blocks, each warp keeping at least two 512-byte stretches of its row. Otherwise (~8K warps fill
     * the H200, 132 SMs x 64): up to 8 while outputs are fewer than 8K, one stretch each. */
    CUDA_REQUIRE(n >= 1 && n <= kGvRows);
    const int deep = gemv_deep();
    int split = 1;
    if (deep) {
        static int waves[kGvRows + 1]; /* per row count n: the kernel instance differs */
        if (!waves[n]) {
            switch (n) {
            case 1: waves[n] = gemv_wave_blocks(gemv_kernel<1, 8, TY, TX>); break;
            case 2: waves[n] = gemv_wave_blocks(gemv_kernel<2, 8, TY, TX>); break;
            case 3: waves[n] = gemv_wave_blocks(gemv_kernel<3, 8, TY, TX>); break;
            default: waves[n] = gemv_wave_blocks(gemv_kernel<4, 8, TY, TX>); break;
            }
        }
        const int wave = waves[n];
        while (split < kGvWarps && in / 8 >= 32 * split * 2 * 2 &&
               (out + kGvWarps / (split * 2) - 1) / (kGvWarps / (split * 2)) <= wave)
            split *= 2;
    } else {
        while (split < kGvWarps && (long long)out * split < 8192 && in / 8 >= 32 * split * 2) split *= 2;
    }
    const int per_block = kGvWarps / split, blocks = (out + per_block - 1) / per_block;
    const uint32_t pf = lunar_cuda_pdl_prefetch_bytes(1);
    const bool ep = add || accum || gemv_ep_all();
    switch (n * 4 + deep * 2 + ep) {
#define GV_CASE(R, U)                                                                                              \
    case 4 * R + (U == 8) * 2:                                                                                     \
        launch_pdl(gemv_kernel<R, U, TY, TX>, dim3(blocks), dim3(kGvWarps * 32), 0, st, y, x, W, out, in, split, pf); \
        break;                                                                                                     \
    case 4 * R + (U == 8) * 2 + 1:                                                                                 \
        launch_pdl(gemv_ep_kernel<R, U, TY, TX>, dim3(blocks), dim3(kGvWarps * 32), 0, st, y, x, W, out, in, split, \
                   pf, add, accum);                                                                                \
        break;
#define GV_CASES(R) GV_CASE(R, 4) GV_CASE(R, 8)
        GV_CASES(1) GV_CASES(2) GV_CASES(3) GV_CASES(4)
#undef GV_CASES
#undef GV_CASE
    }
    CUDA_CHECK_LAUNCH();
}

/* ---------------------------------------------------------------- skinny GEMM on the tensor cores
 * y[n, out] = x[n, in] . W[out, in]^T for a few rows (decode batches of 3-16: LUNAR_GEMV_MMA_MIN / _MAX),
 * where the CUDA-core kernel above waits on n x loads and 8n FMAs per W load and cuBLASLt pays a
 * split-K reduce launch (the K3.1 slice's B = 8 step, session 20: 193 of its 502 launches). Still one
 * stream of W: a warp owns 16 output rows; per 64-column step each lane loads 16 contiguous bf16 of
 * rows g and g + 8 (g = lane / 4, t = lane % 4; 4 lanes cover one 128-byte line of a row) and the same
 * 16 columns of token rows g, g + 8, ... of x, and feeds them to mma.m16n8k16 as they lie: in the k
 * dimension the fragment takes columns {2t, 2t+1, 2t+8, 2t+9}, and lane t's registers hold physical
 * columns 16t + {0, 1, 2, 3} there (then {4..7}, {8..11}, {12..15} in three more mmas), the same
 * permutation for W and x, so the 16-column sums are the dot products' (a permutation of k changes
 * nothing but the tensor core's fp32 order). `split` warps share a row group over interleaved steps,
 * their tiles summed in warp order in shared memory: fp32 accumulation, fixed order, deterministic.
 * x fp32 is rounded to bf16 as it is loaded (gv_x8: the bits of the f32 -> bf16 copy). */
constexpr int kGmMaxWarps = 16;
/* rows ra (a) and rb (b) of W at this lane's 16 columns k .. k + 15 of a step (k = step * 64 + 16t); zeros
 * past `in` or past `out`. (Columns 8t and 32 + 8t instead, whole sectors an instruction, measured 0-10 %
 * slower, session 21's call 3.) */
__device__ __forceinline__ void gm_load_w(uint4 w[4], const uint16_t *W, int in, bool oka, bool okb, size_t ra,
                                          size_t rb, int k) {
    const uint4 z = make_uint4(0, 0, 0, 0);
    const bool k0 = k < in, k1 = k + 8 < in; /* in % 8 == 0: a 16-byte chunk is wholly in or out */
    w[0] = oka && k0 ? __ldcs((const uint4 *)(W + ra * in + k)) : z;
    w[1] = oka && k1 ? __ldcs((const uint4 *)(W + ra * in + k + 8)) : z;
    w[2] = okb && k0 ? __ldcs((const uint4 *)(W + rb * in + k)) : z;
    w[3] = okb && k1 ? __ldcs((const uint4 *)(W + rb * in + k + 8)) : z;
}
template <int NT, typename TY, typename TX, bool EP>
__global__ void __launch_bounds__(kGmMaxWarps * 32, 1) gemv_mma_kernel(TY *y, const TX *x, const uint16_t *W, int n,
                                                                      int out, int in, int split, const float *add,
                                                                      int accum) {
    extern __shared__ float red[]; /* [warps][NT][4][32]: each warp's accumulators, lane-minor */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int groups = (int)(blockDim.x >> 5) / split, rg = blockIdx.x * groups + warp / split, part = warp % split;
    const int ra = rg * 16 + g, rb = ra + 8, steps = (in + 63) / 64;
    const bool oka = ra < out, okb = rb < out;
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    pdl_wait();
    /* two steps in flight a lane: buffers A and B take turns (a register copy between them would wait
     * for the loads it copies), each step's x loaded with its W. (Three, LUNAR_GEMV_MMA_DEPTH=3 in session
     * 21's call 4: 108 registers, the split smaller where the grid then exceeds a wave; the K3.1 latent
     * projections 15-18 % faster alone, the KDA input 10 % slower, the B = 4 / 8 steps level: removed) */
    uint4 wA[4], wB[4], xA[NT][2], xB[NT][2];
    auto load = [&](uint4 w[4], uint4 xs[NT][2], int s) {
        const int k = s * 64 + 16 * t;
        gm_load_w(w, W, in, oka, okb, (size_t)ra, (size_t)rb, k);
        const uint4 z = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int tok = j * 8 + g;
            xs[j][0] = tok < n && k < in ? gv_x8(x, (size_t)tok, k / 8, in) : z;
            xs[j][1] = tok < n && k + 8 < in ? gv_x8(x, (size_t)tok, k / 8 + 1, in) : z;
        }
    };
    auto math = [&](const uint4 w[4], const uint4 xs[NT][2]) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            mma_bf16(acc[j], w[0].x, w[2].x, w[0].y, w[2].y, xs[j][0].x, xs[j][0].y);
            mma_bf16(acc[j], w[0].z, w[2].z, w[0].w, w[2].w, xs[j][0].z, xs[j][0].w);
            mma_bf16(acc[j], w[1].x, w[3].x, w[1].y, w[3].y, xs[j][1].x, xs[j][1].y);
            mma_bf16(acc[j], w[1].z, w[3].z, w[1].w, w[3].w, xs[j][1].z, xs[j][1].w);
        }
    };
    if (part < steps) load(wA, xA, part);
    for (int s = part; s < steps; s += 2 * split) {
        const bool b = s + split < steps;
        if (b) load(wB, xB, s + split);
        math(wA, xA);
        if (s + 2 * split < steps) load(wA, xA, s + 2 * split);
        if (b) math(wB, xB);
    }
    if (split > 1) {
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) red[((warp * NT + j) * 4 + e) * 32 + lane] = acc[j][e];
        __syncthreads();
        if (part) return;
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float v = acc[j][e];
                for (int p = 1; p < split; p++) v += red[(((warp + p) * NT + j) * 4 + e) * 32 + lane];
                acc[j][e] = v;
            }
    }
    /* accumulator e: row g (e < 2) or g + 8, token 2t + (e & 1) of tile j */
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = e < 2 ? ra : rb, tok = j * 8 + 2 * t + (e & 1);
            if (row < out && tok < n) {
                if (EP) gv_epilogue(y, (size_t)tok * out + row, acc[j][e], add, accum);
                else gv_store(y + (size_t)tok * out + row, acc[j][e]);
            }
        }
}

/* the row range the tensor-core kernel takes (LUNAR_GEMV_MMA_MIN, _MAX; unset 3 and 16; MAX 0: off;
 * lunar_cuda_gemv_mma_range sets both for the bench and the tests). Measured (session 21, H200,
 * bench_cuda gemvmma and lunar bench, docs/benchmarks.md "Session 21"): at 3 and 4 rows it beats the
 * CUDA-core kernel on every model shape (4 rows: 1.6-3.6x; the K3.1 slice's B = 4 step 4.62 -> 2.41 ms,
 * Kimi-Linear's 7.94 -> 5.82), at 5-16 cuBLASLt on most (the slice's B = 8 step -4.5 %); at 1-2 rows
 * the CUDA-core kernel wins on all but the KDA input projections, at 24-32 cuBLASLt on half the shapes */
static int gm_min = -1, gm_max = -1;
static void gm_range_init(void) {
    if (gm_min >= 0) return;
    const char *lo = getenv("LUNAR_GEMV_MMA_MIN"), *hi = getenv("LUNAR_GEMV_MMA_MAX");
    gm_min = lo ? atoi(lo) : 3;
    gm_max = hi ? atoi(hi) : 16;
    if (gm_max > 32) gm_max = 32;
}
extern "C" void lunar_cuda_gemv_mma_range(int lo, int hi, int *prev_lo, int *prev_hi) {
    gm_range_init();
    if (prev_lo) *prev_lo = gm_min;
    if (prev_hi) *prev_hi = gm_max;
    gm_min = lo, gm_max = hi > 32 ? 32 : hi;
}
static bool gm_takes(int n) {
    gm_range_init();
    return n >= gm_min && n <= gm_max && n >= 1 && n <= 32;
}

/* split: the warps sharing a row group. The largest that keeps the grid within one wave of resident
 * blocks (the occupancy of this instance; a partial second wave was the first version's loss, session 21)
 * and each warp at least two steps (its pipeline); 8 or 16 take a block of their own, smaller splits
 * share a 256-thread block among 8 / split row groups */
template <int NT, typename TY, typename TX, bool EP>
static void gm_run(TY *y, const TX *x, const uint16_t *W, int n, int out, int in, cudaStream_t st, const float *add,
                   int accum) {
    static int cap[2]; /* resident blocks on the device: 256 and 512 threads */
    if (!cap[0]) {
        int dev = 0, sms = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        for (int i = 0; i < 2; i++) {
            int per = 0;
            const int th = 256 << i;
            CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, gemv_mma_kernel<NT, TY, TX, EP>, th,
                                                                     (size_t)th / 32 * NT * 4 * 32 * sizeof(float)));
            cap[i] = sms * (per > 0 ? per : 1);
        }
    }
    const int rgroups = (out + 15) / 16, steps = (in + 63) / 64;
    int split = kGmMaxWarps, groups = 1, blocks = rgroups;
    for (; split > 1; split /= 2) {
        groups = split >= 8 ? 1 : 8 / split;
        blocks = (rgroups + groups - 1) / groups;
        if (blocks <= cap[split == 16] && steps >= 2 * split) break;
    }
    if (split == 1) groups = 8, blocks = (rgroups + 7) / 8;
    const int warps = groups * split;
    const size_t smem = split > 1 ? (size_t)warps * NT * 4 * 32 * sizeof(float) : 0;
    launch_pdl(gemv_mma_kernel<NT, TY, TX, EP>, dim3(blocks), dim3(warps * 32), smem, st, y, x, W, n, out, in, split,
               add, accum);
    CUDA_CHECK_LAUNCH();
}
template <typename TY, typename TX>
static void gemv_mma_launch(TY *y, const TX *x, const uint16_t *W, int n, int out, int in, cudaStream_t st,
                            const float *add, int accum) {
    const bool ep = add || accum;
    switch ((n + 7) / 8 * 2 + ep) {
#define GM_CASE(NT)                                                                                                \
    case 2 * NT: gm_run<NT, TY, TX, false>(y, x, W, n, out, in, st, add, accum); break;                            \
    case 2 * NT + 1: gm_run<NT, TY, TX, true>(y, x, W, n, out, in, st, add, accum); break;
        GM_CASE(1) GM_CASE(2) GM_CASE(3) GM_CASE(4)
#undef GM_CASE
    }
}

/* LUNAR_CUDA_GEMV=0 keeps every GEMM on cuBLASLt (A/B runs) */
static bool gemv_wanted(const void *x, const void *W, int n, int out, int in) {
    static int on = -1;
    if (on < 0) on = !(getenv("LUNAR_CUDA_GEMV") && strcmp(getenv("LUNAR_CUDA_GEMV"), "0") == 0);
    return on && (n <= kGvRows || gm_takes(n)) && in % 8 == 0 && (long long)out * in <= kGvMaxElems &&
           ((uintptr_t)x | (uintptr_t)W) % 16 == 0;
}
/* the tensor-core kernel for the rows it takes, else the CUDA-core one */
template <typename TY, typename TX>
static void skinny_launch(TY *y, const TX *x, const uint16_t *W, int n, int out, int in, cudaStream_t st,
                          const float *add = NULL, int accum = 0) {
    if (gm_takes(n)) gemv_mma_launch(y, x, W, n, out, in, st, add, accum);
    else gemv_launch(y, x, W, n, out, in, st, add, accum);
}

/* the skinny kernel where it takes the shape (0), else -1 with nothing launched; x fp32 or bf16 */
template <typename TX>
static int gemv_try(void *y, lunar_cuda_dtype ydt, const TX *x, const uint16_t *W, int n, int out, int in,
                    cudaStream_t st) {
    CUDA_REQUIRE(n >= 0 && out > 0 && in > 0);
    if (n == 0) return 0;
    if (!gemv_wanted(x, W, n, out, in)) return -1;
    if (ydt == LUNAR_CUDA_F32) skinny_launch((float *)y, x, W, n, out, in, st);
    else skinny_launch((__nv_bfloat16 *)y, x, W, n, out, in, st);
    return 0;
}

extern "C" int lunar_cuda_matmul_f32x(void *y, lunar_cuda_dtype ydt, const float *x, const uint16_t *W, int n,
                                      int out, int in, lunar_cuda_stream s) {
    return gemv_try(y, ydt, x, W, n, out, in, to_stream(s));
}

extern "C" int lunar_cuda_matmul_f32x_into(float *y, const float *x, const uint16_t *W, int n, int out, int in,
                                           const float *add, lunar_cuda_stream s) {
    CUDA_REQUIRE(n >= 0 && out > 0 && in > 0);
    if (n == 0) return 0;
    if (!gemv_wanted(x, W, n, out, in)) return -1;
    skinny_launch(y, x, W, n, out, in, to_stream(s), add, 1);
    return 0;
}

extern "C" int lunar_cuda_matmul_bf16x(void *y, lunar_cuda_dtype ydt, const uint16_t *x, const uint16_t *W, int n,
                                       int out, int in, lunar_cuda_stream s) {
    return gemv_try(y, ydt, x, W, n, out, in, to_stream(s));
}

extern "C" void lunar_cuda_matmul(void *y, lunar_cuda_dtype ydt, const uint16_t *x,
                                  const uint16_t *W, int n, int out, int in, lunar_cuda_stream s) {
    if (gemv_try(y, ydt, x, W, n, out, in, to_stream(s)) == 0) return;
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

/* KDA decode: the forget gate's up-projection f_b with op_kda_gate applied to its outputs and, og
 * non-NULL, the output gate's up-projection g_b beside it (W = [f_b; g_b], each [H dk, in], reading
 * x[r, 0 .. in) and x[r, in .. 2 in) of each of the n token rows r (row stride xs): the fused
 * projection's f_a | g_a outputs), one launch instead of GEMM, gate, GEMM. A warp per output row, as
 * gemv_kernel<1> with split 1 (the split it takes at these shapes: same loads, products and shuffle
 * tree), its row of W held in a register across the n tokens where it is one load a lane (in <= 256) */
__global__ void __launch_bounds__(kGvWarps * 32) kda_gate_proj_kernel(float *g, float *og, const float *x, int64_t xs,
                                                                     int n, const uint16_t *W, int HD, int rows,
                                                                     int in, const float *A_log,
                                                                     const float *dt_bias, int dk, float lb,
                                                                     uint32_t pf) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, o = blockIdx.x * kGvWarps + warp, n8 = in / 8;
    if (pf && lane == 0 && o < rows) { /* the row's head into L2 before the wait, as gemv_kernel */
        const uint32_t rb = (uint32_t)in * 2u, lim = (pf / kGvWarps) & ~15u;
        pdl_prefetch_l2(W + (size_t)o * in, rb < lim ? rb : lim);
    }
    pdl_wait();
    if (o >= rows) return; /* warp-uniform */
    const int seg = o < HD ? 0 : 1;
    const uint4 *w4 = (const uint4 *)(W + (size_t)o * in);
    const bool held = n8 <= 32;
    const uint4 wv = held && lane < n8 ? __ldcs(w4 + lane) : make_uint4(0, 0, 0, 0);
    for (int r = 0; r < n; r++) {
        const float *xr = x + r * xs + (size_t)seg * in;
        float acc = 0.f;
        if (held) {
            if (lane < n8) acc += gv_dot8(wv, gv_x8(xr, (size_t)0, lane, in));
        } else {
#pragma unroll 4
            for (int i = lane; i < n8; i += 32) acc += gv_dot8(__ldcs(w4 + i), gv_x8(xr, (size_t)0, i, in));
        }
        for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
        if (lane) continue;
        if (seg == 0)
            g[(size_t)r * HD + o] = kda_gate_value(acc, A_log[o / dk], dt_bias[o], lb);
        else
            og[(size_t)r * HD + o - HD] = acc;
    }
}

extern "C" void lunar_cuda_kda_gate_proj_rows(float *g, float *og, const float *x, int64_t x_stride, int n,
                                              const uint16_t *W, int H, int dk, int in, const float *A_log,
                                              const float *dt_bias, float lb, lunar_cuda_stream s) {
    CUDA_REQUIRE(H > 0 && dk > 0 && in > 0 && in % 8 == 0 && ((uintptr_t)x | (uintptr_t)W) % 16 == 0 &&
                 (!og || in % 4 == 0) && n >= 0 && (n <= 1 || x_stride % 4 == 0));
    if (n == 0) return;
    const int HD = H * dk, rows = og ? 2 * HD : HD;
    launch_pdl(kda_gate_proj_kernel, dim3((rows + kGvWarps - 1) / kGvWarps), dim3(kGvWarps * 32), 0, to_stream(s),
               g, og, x, x_stride, n, W, HD, rows, in, A_log, dt_bias, dk, lb, lunar_cuda_pdl_prefetch_bytes(1));
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_kda_gate_proj_decode(float *g, float *og, const float *x, const uint16_t *W, int H,
                                                int dk, int in, const float *A_log, const float *dt_bias, float lb,
                                                lunar_cuda_stream s) {
    lunar_cuda_kda_gate_proj_rows(g, og, x, 0, 1, W, H, dk, in, A_log, dt_bias, lb, s);
}

/* ---------------------------------------------------------------- MLA absorption GEMMs
 * The per-head absorption (q_nope . W_UK) and un-absorption (W_UV . o_lat) were one block per
 * (token, head) re-reading the head's weights for every token: ~90 ms per layer at 8K tokens. Here
 * they are fp32 strided-batched GEMMs over heads (one cuBLASLt call each), on W widened to fp32
 * once per layer, so activations keep the fp32 precision of the CPU op (no bf16 rounding of q). */
struct sgemm_plan {
    int key[11], used;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
};
#define MAX_SPLANS 32
static sgemm_plan splans[MAX_SPLANS];
static int n_splans, next_splan;

static void set_batch(cublasLtMatrixLayout_t l, int batch, int64_t stride) {
    LT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch));
    LT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                              sizeof stride));
}

/* Column-major C[m, n] (ldc, strideC) = op(A) B for `batch` matrices: A stored [m, k] (lda) or,
 * transa, [k, m]; B stored [k, n] (ldb). */
static void sgemm_strided(float *C, const float *A, const float *B, int transa, int m, int n, int k,
                          int lda, int sa, int ldb, int sb, int ldc, int sc, int batch, cudaStream_t st) {
    const int key[11] = {transa, m, n, k, lda, sa, ldb, sb, ldc, sc, batch};
    sgemm_plan *p = NULL;
    for (int i = 0; i < n_splans && !p; i++)
        if (memcmp(splans[i].key, key, sizeof key) == 0) p = &splans[i];
    if (!p) {
        p = &splans[n_splans < MAX_SPLANS ? n_splans++ : (next_splan++ % MAX_SPLANS)];
        if (p->used) lt_release(p->op, p->a, p->b, p->d);
        memcpy(p->key, key, sizeof key);
        p->used = 1;
        LT_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
        LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
        LT_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_32F, transa ? k : m, transa ? m : k, lda));
        LT_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_32F, k, n, ldb));
        LT_CHECK(cublasLtMatrixLayoutCreate(&p->d, CUDA_R_32F, m, n, ldc));
        set_batch(p->a, batch, sa);
        set_batch(p->b, batch, sb);
        set_batch(p->d, batch, sc);
        p->algo = lt_algo(p->op, p->a, p->b, p->d);
    }
    const float alpha = 1.0f, beta = 0.0f;
    size_t ws_bytes;
    void *ws = lunar_cuda_gemm_workspace(&ws_bytes);
    LT_CHECK(cublasLtMatmul((cublasLtHandle_t)lunar_cuda_cublaslt_handle(), p->op, &alpha, A, p->a, B,
                            p->b, &beta, C, p->d, C, p->d, &p->algo, ws, ws_bytes, st));
}

__global__ void k_widen_bf16(float *y, const uint16_t *x, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = bf16_bits_to_f32(x[i]);
}

extern "C" void lunar_cuda_mla_absorb_gemm(float *q_lat, float *q_pe, float *w32, const float *q,
                                           const uint16_t *W, int rows, int H, int N, int P, int Vd,
                                           int R, lunar_cuda_stream s) {
    CUDA_REQUIRE(rows >= 0 && H > 0 && N > 0 && P >= 0 && Vd > 0 && R > 0);
    if (rows == 0) return;
    cudaStream_t st = to_stream(s);
    const size_t nw = (size_t)H * (N + Vd) * R;
    k_widen_bf16<<<(int)((nw + 255) / 256 < 4096 ? (nw + 255) / 256 : 4096), 256, 0, st>>>(w32, W, nw);
    CUDA_CHECK_LAUNCH();
    /* per head h: q_lat_h[rows, R] (row-major, ld H*R) = Q_h[rows, N] (ld H*(N+P)) . W_UK_h[N, R];
     * column-major: q_lat_h^T[R, rows] = W_UK_h^T[R, N] (stored [R, N], ld R) . Q_h^T[N, rows] */
    sgemm_strided(q_lat, w32, q, 0, R, rows, N, R, (N + Vd) * R, H * (N + P), N + P, H * R, R, H, st);
    /* q_pe: the rope columns of each (token, head) as one strided copy */
    if (P > 0)
        CUDA_CHECK(cudaMemcpy2DAsync(q_pe, (size_t)P * sizeof(float), q + N, (size_t)(N + P) * sizeof(float),
                                     (size_t)P * sizeof(float), (size_t)rows * H, cudaMemcpyDeviceToDevice, st));
}

extern "C" void lunar_cuda_mla_unabsorb_gemm(float *o, const float *o_lat, const float *w32, int rows, int H,
                                             int N, int Vd, int R, lunar_cuda_stream s) {
    CUDA_REQUIRE(rows >= 0 && H > 0 && N >= 0 && Vd > 0 && R > 0);
    if (rows == 0) return;
    /* per head h: o_h^T[Vd, rows] (ld H*Vd) = W_UV_h[Vd, R] (stored column-major [R, Vd], ld R,
     * transposed) . o_lat_h^T[R, rows] (ld H*R) */
    sgemm_strided(o, w32 + (size_t)N * R, o_lat, 1, Vd, rows, R, R, (N + Vd) * R, H * R, R, H * Vd, Vd, H,
                  to_stream(s));
}
