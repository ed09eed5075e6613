// Dense elementwise and row ops: embedding, RMSNorm, gated RMSNorm, L2 norm, SiLU-mul, SiTU-mul,
// and the causal short convolution (prefill and batched decode). One block per row for the
// norms (sum of squares in fp32, block tree reduction); grid-stride loops for elementwise ops.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"


static int row_threads(int dim) {
    int t = 32;
    while (t < dim && t < 1024) t <<= 1;
    return t;
}

// mode 0: rmsnorm (w may be NULL); 1: gated rmsnorm; 2: l2norm
template <typename Y, int MODE>
__global__ void norm_kernel(Y *y, const float *x, const float *gate, const uint16_t *w, int dim,
                            float eps) {
    __shared__ float red[32];
    pdl_enter();
    const size_t row = blockIdx.x;
    const float *xr = x + row * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum_f32(ss, red);
    const float inv = MODE == 2 ? 1.0f / sqrtf(ss + eps) : 1.0f / sqrtf(ss / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] * inv;
        if (MODE != 2 && w) v *= bf16_bits_to_f32(w[i]);
        if (MODE == 1) v *= 1.0f / (1.0f + expf(-gate[row * dim + i]));
        y[row * dim + i] = from_f32<Y>(v);
    }
}

// The vector row norm (issue 9), the default RMSNorm and add + RMSNorm where dim % 4 == 0, dim <= 8192
// and the rows are 16-byte aligned (LUNAR_NORM=block: the kernels above, the default until session 7).
// At batch 1 a norm is one block on the decode step's serial path, and the block kernels' cost was
// latency, not bytes: 1024 threads of 2-3 floats, two barriers in block_sum_f32, and the weight
// loaded only after the reduction (one more DRAM round trip). Here: at most 256 threads of V float4
// each (2304 -> 192 x 3), the weight loaded into registers before the PDL wait (nothing in the step
// writes it), x and r loaded together, one barrier (warp sums -> red -> every thread adds the <= 8
// warp sums in warp order itself). Summation order: a thread's 4V squares in order (chunk
// tid + v * blockDim), the warp butterfly, the warps in order: not block_sum_f32's, so the bits differ
// from the block kernels (the CPU comparison's tolerance holds); rmsnorm and add_rmsnorm take the
// same path for the same dim, so the fused pair still equals add + rmsnorm bit for bit.
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
// the norm of row `row` held as a[] (x after the add), shared by norm_vec_kernel and
// combine_norm_kernel so that both give the same bits: a thread's 4V squares in chunk order, the warp
// butterfly, the warp sums in warp order, then y (and yb) = a * inv * w
template <typename Y, int V>
__device__ __forceinline__ void norm_vec_tail(Y *y, __nv_bfloat16 *yb, const float4 (&a)[V], const uint2 (&wq)[V],
                                              bool hw, float *red, size_t row, int dim, float eps) {
    const int nv = dim >> 2, tid = threadIdx.x, T = blockDim.x;
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
        if (i >= nv) continue;
        float o0 = a[v].x * inv, o1 = a[v].y * inv, o2 = a[v].z * inv, o3 = a[v].w * inv;
        if (hw) {
            o0 *= bf16_bits_to_f32((uint16_t)wq[v].x), o1 *= bf16_bits_to_f32((uint16_t)(wq[v].x >> 16));
            o2 *= bf16_bits_to_f32((uint16_t)wq[v].y), o3 *= bf16_bits_to_f32((uint16_t)(wq[v].y >> 16));
        }
        if (y) store4<Y>(y + row * dim, i, o0, o1, o2, o3);  // NULL: the bf16 copy alone (add_rmsnorm_b)
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
template <typename Y, int V, bool ADD>
__global__ void __launch_bounds__(NORM_VEC_THREADS) norm_vec_kernel(Y *y, __nv_bfloat16 *yb, float *x, const float *r,
                                                                   const uint16_t *w, int dim, float eps) {
    __shared__ float red[NORM_VEC_THREADS / 32];
    const int nv = dim >> 2, tid = threadIdx.x, T = blockDim.x;
    uint2 wq[V];  // 4 bf16 weights per chunk
    norm_vec_weights<V>(wq, w, nv, tid, T);
    pdl_enter();
    const size_t row = blockIdx.x;
    float4 *xr = reinterpret_cast<float4 *>(x + row * dim);
    const float4 *rr = reinterpret_cast<const float4 *>(r + row * dim);
    float4 a[V], b[V];
#pragma unroll
    for (int v = 0; v < V; v++) {
        const int i = tid + v * T;
        a[v] = i < nv ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (ADD) b[v] = i < nv ? rr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int v = 0; v < V; v++)
        if (ADD) {
            a[v].x += b[v].x, a[v].y += b[v].y, a[v].z += b[v].z, a[v].w += b[v].w;
            if (tid + v * T < nv) xr[tid + v * T] = a[v];
        }
    norm_vec_tail<Y, V>(y, yb, a, wq, w != NULL, red, row, dim, eps);
}
// LUNAR_NORM=block: the block kernels everywhere (the A/B of session 7)
static int norm_block(void) {
    static int v = -1;
    if (v < 0) v = getenv("LUNAR_NORM") && strcmp(getenv("LUNAR_NORM"), "block") == 0;
    return v;
}
// float4 chunks per thread of the vector norm (at most NORM_VEC_THREADS threads), 0: the block kernel
static int norm_vec_v(int dim, const void *y, const void *yb, const void *x, const void *r, const void *w) {
    if (norm_block() || dim % 4 || dim > 8 * 4 * NORM_VEC_THREADS) return 0;
    if (((uintptr_t)y | (uintptr_t)x | (uintptr_t)r) % 16 || ((uintptr_t)yb | (uintptr_t)w) % 8) return 0;
    const int nv = dim / 4;
    static const int vs[] = {1, 2, 3, 4, 8};
    for (int i = 0;; i++)
        if (vs[i] * NORM_VEC_THREADS >= nv) return vs[i];
}
template <typename Y, bool ADD>
static void norm_vec_launch(int V, Y *y, __nv_bfloat16 *yb, float *x, const float *r, const uint16_t *w, int n,
                            int dim, float eps, cudaStream_t st) {
    const int nv = dim / 4, th = ((nv + V - 1) / V + 31) / 32 * 32;
    switch (V) {
    case 1: launch_pdl(norm_vec_kernel<Y, 1, ADD>, dim3(n), dim3(th), 0, st, y, yb, x, r, w, dim, eps); break;
    case 2: launch_pdl(norm_vec_kernel<Y, 2, ADD>, dim3(n), dim3(th), 0, st, y, yb, x, r, w, dim, eps); break;
    case 3: launch_pdl(norm_vec_kernel<Y, 3, ADD>, dim3(n), dim3(th), 0, st, y, yb, x, r, w, dim, eps); break;
    case 4: launch_pdl(norm_vec_kernel<Y, 4, ADD>, dim3(n), dim3(th), 0, st, y, yb, x, r, w, dim, eps); break;
    default: launch_pdl(norm_vec_kernel<Y, 8, ADD>, dim3(n), dim3(th), 0, st, y, yb, x, r, w, dim, eps); break;
    }
    CUDA_CHECK_LAUNCH();
}

// The MoE combine folded into the residual add + RMSNorm after it (issue 9, LUNAR_COMBINE_NORM=1):
// x[t] += sum_j ybuf[pair_row[t, j]] (+ add[t]); y[t] = rmsnorm(x[t]) w (and yb). The combine's
// output was written ([n, D] fp32) only to be read back by the norm: 75 MB each way a layer at an
// 8K prefill, and one launch of a decode step's serial chain. The bits are those of
// lunar_cuda_moe_combine_add[_b] then lunar_cuda_add_rmsnorm[_b]: each element's sum starts at 0
// and adds the rows j = 0..k-1, then add, as moe_combine_kernel does (the G-row load groups do
// not change the order), then x + that sum and norm_vec_tail, as norm_vec_kernel<float, V, true>.
// pair_row is read by every thread (the same k words: one broadcast load each, no barrier).
// x = NULL (K3's latent path, session 20): no residual, the sum itself is normed, y = rmsnorm(sum) w:
// the bits of lunar_cuda_moe_combine_add then lunar_cuda_rmsnorm (the same V, threads and tail).
template <typename R>
__device__ __forceinline__ float4 load_row4(const R *p, size_t i);
template <>
__device__ __forceinline__ float4 load_row4<float>(const float *p, size_t i) {
    return reinterpret_cast<const float4 *>(p)[i];
}
template <>
__device__ __forceinline__ float4 load_row4<uint16_t>(const uint16_t *p, size_t i) {
    return bf16x4_to_f32(reinterpret_cast<const uint2 *>(p)[i]);
}
template <typename R, int V, int G>
__global__ void __launch_bounds__(NORM_VEC_THREADS)
    combine_norm_kernel(float *y, __nv_bfloat16 *yb, float *x, const R *ybuf, const int32_t *pair_row, int k,
                        const float *add, const uint16_t *w, int dim, float eps) {
    __shared__ float red[NORM_VEC_THREADS / 32];
    const int nv = dim >> 2, tid = threadIdx.x, T = blockDim.x;
    uint2 wq[V];
    norm_vec_weights<V>(wq, w, nv, tid, T);
    pdl_enter();
    const size_t row = blockIdx.x;
    float4 *xr = reinterpret_cast<float4 *>(x + row * dim);
    float4 a[V], b[V], c[V];  // x, the rows' sum, add (loaded with x: off the rows' load chain)
#pragma unroll
    for (int v = 0; v < V; v++) {
        const int i = tid + v * T;
        a[v] = x && i < nv ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        b[v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        c[v] = add && i < nv ? reinterpret_cast<const float4 *>(add + row * dim)[i] : make_float4(0, 0, 0, 0);
    }
    // G rows' loads in flight for each of the V chunks (combine_norm_launch picks G)
    const int32_t *pr = pair_row + row * k;
    for (int j0 = 0; j0 < k; j0 += G) {
        int32_t p[G];
#pragma unroll
        for (int j = 0; j < G; j++) p[j] = j0 + j < k ? pr[j0 + j] : 0;
        float4 u[V][G];
#pragma unroll
        for (int v = 0; v < V; v++)
#pragma unroll
            for (int j = 0; j < G; j++)
                if (j0 + j < k && tid + v * T < nv) u[v][j] = load_row4<R>(ybuf + (size_t)p[j] * dim, tid + v * T);
#pragma unroll
        for (int v = 0; v < V; v++)
#pragma unroll
            for (int j = 0; j < G; j++)
                if (j0 + j < k && tid + v * T < nv)
                    b[v].x += u[v][j].x, b[v].y += u[v][j].y, b[v].z += u[v][j].z, b[v].w += u[v][j].w;
    }
#pragma unroll
    for (int v = 0; v < V; v++) {
        const int i = tid + v * T;
        if (i >= nv) continue;
        if (add) b[v].x += c[v].x, b[v].y += c[v].y, b[v].z += c[v].z, b[v].w += c[v].w;
        if (!x) {
            a[v] = b[v];
            continue;
        }
        a[v].x += b[v].x, a[v].y += b[v].y, a[v].z += b[v].z, a[v].w += b[v].w;
        xr[i] = a[v];
    }
    norm_vec_tail<float, V>(y, yb, a, wq, w != NULL, red, row, dim, eps);
}
template <typename R>
static void combine_norm_launch(int V, float *y, __nv_bfloat16 *yb, float *x, const R *ybuf, const int32_t *pair_row,
                                int n, int k, const float *add, const uint16_t *w, int dim, float eps,
                                cudaStream_t st) {
    const int nv = dim / 4, th = ((nv + V - 1) / V + 31) / 32 * 32;
    // rows in flight per chunk: a decode step's few rows (n <= 64) take 9 where V <= 3 (Kimi-Linear:
    // k = 8, or 9 at batch 1 with the shared expert as a routed row: one round of loads, the chain
    // pair_row -> rows being the kernel's whole cost); at V = 3 (D = 2304) that is ~190 registers,
    // one block an SM, so the prefill rows (where occupancy hides the latency) take 4 (128
    // registers, two blocks); V = 8 with G = 8 spilled
#define CN_CASE(VV, GG)                                                                                               \
    launch_pdl(combine_norm_kernel<R, VV, GG>, dim3(n), dim3(th), 0, st, y, yb, x, ybuf, pair_row, k, add, w, dim, \
               eps);                                                                                                  \
    break
    switch (V) {
    case 1: CN_CASE(1, 9);
    case 2: CN_CASE(2, 9);
    case 3:
        if (n <= 64) {
            CN_CASE(3, 9);
        }
        CN_CASE(3, 4);
    case 4: /* K3's latent rows (3584: V = 4) at decode, k = 16: 2 rounds of loads instead of 4 (ncu, session 20: 11.5
             * us a launch at G = 4, the separate combine + norm 7.4) */
        if (n <= 64) {
            CN_CASE(4, 8);
        }
        CN_CASE(4, 4);
    default: CN_CASE(8, 2);
    }
#undef CN_CASE
    CUDA_CHECK_LAUNCH();
}
extern "C" int lunar_cuda_moe_combine_add_rmsnorm(float *y, uint16_t *yb, float *x, const float *ybuf,
                                                  const uint16_t *ybuf_b, const lunar_cuda_moe_route *r,
                                                  const float *add, const uint16_t *w, int dim, float eps,
                                                  lunar_cuda_stream s) {
    if ((ybuf == NULL) == (ybuf_b == NULL) || r->n <= 0 || (!y && !yb)) return -1;
    /* the combine's own conditions (4-column rows) and the vector norm's: elsewhere the pair would
     * take the block norm, whose sums differ */
    const int V = norm_vec_v(dim, y, yb, x, add, w);
    if (!V || ((uintptr_t)ybuf | (uintptr_t)ybuf_b) % 16 != 0) return -1;
    if (ybuf)
        combine_norm_launch<float>(V, y, (__nv_bfloat16 *)yb, x, ybuf, r->pair_row, r->n, r->k, add, w, dim, eps,
                                   to_stream(s));
    else
        combine_norm_launch<uint16_t>(V, y, (__nv_bfloat16 *)yb, x, ybuf_b, r->pair_row, r->n, r->k, add, w, dim, eps,
                                      to_stream(s));
    return 0;
}

// The per-head norms (issue 9): the gated RMSNorm of KDA's output and the L2 norm run on rows of one head
// (dim 128: n x H rows, 262,144 at an 8K prefill), where a block per row (norm_kernel: 128 threads, two
// barriers) ran at ~0.85 TB/s (the 8K prefill's norm_kernel<bf16, 1>: 317 us a layer, ncu, session 7).
// Here one warp per row, 8 rows per block, no barrier; the weight in registers before the PDL wait. The
// sums are norm_kernel's bit for bit (the fused KDA decode kernel and the tests rely on it): lane l holds
// elements l + 32 j (j < NW = dim / 32) as thread l + 32 j of the block kernel would, each j's warp
// butterfly is that warp's, and the NW warp sums are combined as block_sum_f32's second butterfly adds
// them (lane j holding sum j, the rest zeros: emulated here in registers).
#define NORM_WARP_ROWS 8
template <typename Y, int MODE, int NW>
__global__ void __launch_bounds__(32 * NORM_WARP_ROWS) norm_warp_kernel(Y *y, const float *x, const float *gate,
                                                                       const uint16_t *w, int n, int dim, float eps) {
    const int lane = threadIdx.x & 31;
    float wv[NW];
#pragma unroll
    for (int j = 0; j < NW; j++) wv[j] = MODE == 1 && w ? bf16_bits_to_f32(__ldg(w + lane + 32 * j)) : 1.0f;
    pdl_enter();
    const size_t row = (size_t)blockIdx.x * NORM_WARP_ROWS + (threadIdx.x >> 5);
    if (row >= (size_t)n) return;  // no barrier below
    const float *xr = x + row * dim;
    // the gate's row is loaded with x's, before the reduction: loaded in the store loop below, each
    // load sat behind the previous element's store to y (which the compiler must assume may alias
    // it), NW dependent round trips (session 9's decode step: 4.93 us a launch against the block
    // kernel's 3.22, where each thread has one element and so one round trip)
    const float *gr = gate + (MODE == 1 ? row * dim : 0);
    float a[NW], t[NW], gv[NW];
#pragma unroll
    for (int j = 0; j < NW; j++) {
        a[j] = xr[lane + 32 * j];
        gv[j] = MODE == 1 ? gr[lane + 32 * j] : 0.0f;
        t[j] = a[j] * a[j];
    }
#pragma unroll
    for (int j = 0; j < NW; j++)
        for (int o = 16; o; o >>= 1) t[j] += __shfl_xor_sync(0xffffffffu, t[j], o);
    // block_sum_f32's second butterfly on lanes 0..NW-1 (lanes past NW hold 0: adding them is exact)
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        if (o >= NW) continue;
        float u[NW];
#pragma unroll
        for (int j = 0; j < NW; j++) u[j] = t[j] + ((j ^ o) < NW ? t[j ^ o] : 0.0f);
#pragma unroll
        for (int j = 0; j < NW; j++) t[j] = u[j];
    }
    const float ss = t[0];
    const float inv = MODE == 2 ? 1.0f / sqrtf(ss + eps) : 1.0f / sqrtf(ss / dim + eps);
#pragma unroll
    for (int j = 0; j < NW; j++) {
        const int i = lane + 32 * j;
        float v = a[j] * inv;
        if (MODE == 1) {
            if (w) v *= wv[j];
            v *= 1.0f / (1.0f + expf(-gv[j]));
        }
        y[row * dim + i] = from_f32<Y>(v);
    }
}
template <typename Y, int MODE>
static bool norm_warp_launch(Y *y, const float *x, const float *gate, const uint16_t *w, int n, int dim, float eps,
                             cudaStream_t st) {
    if (norm_block() || (dim != 128 && dim != 256 && dim != 512)) return false;
    const dim3 grid(ceil_div_u(n, NORM_WARP_ROWS)), block(32 * NORM_WARP_ROWS);
    switch (dim) {
    case 128: launch_pdl(norm_warp_kernel<Y, MODE, 4>, grid, block, 0, st, y, x, gate, w, n, dim, eps); break;
    case 256: launch_pdl(norm_warp_kernel<Y, MODE, 8>, grid, block, 0, st, y, x, gate, w, n, dim, eps); break;
    default: launch_pdl(norm_warp_kernel<Y, MODE, 16>, grid, block, 0, st, y, x, gate, w, n, dim, eps); break;
    }
    CUDA_CHECK_LAUNCH();
    return true;
}

template <int MODE>
static void norm_launch(void *y, lunar_cuda_dtype ydt, const float *x, const float *gate,
                        const uint16_t *w, int n, int dim, float eps, lunar_cuda_stream s) {
    if (n <= 0) return;
    const int V = MODE == 0 ? norm_vec_v(dim, y, NULL, x, x, w) : 0;
    if (V) {
        if (ydt == LUNAR_CUDA_F32)
            norm_vec_launch<float, false>(V, (float *)y, NULL, (float *)x, x, w, n, dim, eps, to_stream(s));
        else
            norm_vec_launch<__nv_bfloat16, false>(V, (__nv_bfloat16 *)y, NULL, (float *)x, x, w, n, dim, eps,
                                                  to_stream(s));
        return;
    }
    if (MODE != 0 && (ydt == LUNAR_CUDA_F32 ? norm_warp_launch<float, MODE>((float *)y, x, gate, w, n, dim, eps,
                                                                             to_stream(s))
                                             : norm_warp_launch<__nv_bfloat16, MODE>((__nv_bfloat16 *)y, x, gate, w,
                                                                                     n, dim, eps, to_stream(s))))
        return;
    int th = row_threads(dim);
    if (ydt == LUNAR_CUDA_F32)
        launch_pdl(norm_kernel<float, MODE>, dim3(n), dim3(th), 0, to_stream(s), (float *)y, x, gate, w, dim, eps);
    else
        launch_pdl(norm_kernel<__nv_bfloat16, MODE>, dim3(n), dim3(th), 0, to_stream(s), (__nv_bfloat16 *)y, x, gate,
                   w, dim, eps);
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_rmsnorm(void *y, lunar_cuda_dtype ydt, const float *x,
                                   const uint16_t *w, int n, int dim, float eps,
                                   lunar_cuda_stream s) {
    norm_launch<0>(y, ydt, x, NULL, w, n, dim, eps, s);
}
extern "C" void lunar_cuda_rmsnorm_gated(void *y, lunar_cuda_dtype ydt, const float *x,
                                         const float *gate, const uint16_t *w, int n, int dim,
                                         float eps, lunar_cuda_stream s) {
    CUDA_REQUIRE(w != NULL && gate != NULL);
    norm_launch<1>(y, ydt, x, gate, w, n, dim, eps, s);
}
extern "C" void lunar_cuda_l2norm(float *y, const float *x, int n, int dim, float eps,
                                  lunar_cuda_stream s) {
    norm_launch<2>(y, LUNAR_CUDA_F32, x, NULL, NULL, n, dim, eps, s);
}

// the residual add fused with the next RMSNorm: x += r (stored), y = rmsnorm(x) w; the sum and its
// square are those of an add kernel followed by norm_kernel<.., 0> (same fp32 ops, same tree
// order), so the pair gives the same bits in one launch; yb (or NULL): y's bf16 copy as well (the
// next GEMMs' operand, one launch fewer)
template <typename Y>
__global__ void add_norm_kernel(Y *y, float *x, const float *r, const uint16_t *w, int dim, float eps,
                                __nv_bfloat16 *yb) {
    __shared__ float red[32];
    pdl_enter();
    const size_t row = blockIdx.x;
    float *xr = x + row * dim;
    const float *rr = r + row * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = xr[i] + rr[i];
        xr[i] = v;
        ss += v * v;
    }
    ss = block_sum_f32(ss, red);
    const float inv = 1.0f / sqrtf(ss / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] * inv;
        if (w) v *= bf16_bits_to_f32(w[i]);
        if (y) y[row * dim + i] = from_f32<Y>(v);
        if (yb) yb[row * dim + i] = __float2bfloat16_rn(from_f32<Y>(v));
    }
}
extern "C" void lunar_cuda_add_rmsnorm_b(float *y, uint16_t *yb, float *x, const float *r, const uint16_t *w, int n,
                                         int dim, float eps, lunar_cuda_stream s) {
    if (n <= 0) return;
    CUDA_REQUIRE(y || yb);
    const int V = norm_vec_v(dim, y, yb, x, r, w);
    if (V) {
        norm_vec_launch<float, true>(V, y, (__nv_bfloat16 *)yb, x, r, w, n, dim, eps, to_stream(s));
        return;
    }
    launch_pdl(add_norm_kernel<float>, dim3(n), dim3(row_threads(dim)), 0, to_stream(s), y, x, r, w, dim, eps,
               (__nv_bfloat16 *)yb);
    CUDA_CHECK_LAUNCH();
}
extern "C" void lunar_cuda_add_rmsnorm(void *y, lunar_cuda_dtype ydt, float *x, const float *r, const uint16_t *w,
                                       int n, int dim, float eps, lunar_cuda_stream s) {
    if (n <= 0) return;
    const int V = norm_vec_v(dim, y, NULL, x, r, w);
    if (V) {
        if (ydt == LUNAR_CUDA_F32)
            norm_vec_launch<float, true>(V, (float *)y, NULL, x, r, w, n, dim, eps, to_stream(s));
        else
            norm_vec_launch<__nv_bfloat16, true>(V, (__nv_bfloat16 *)y, NULL, x, r, w, n, dim, eps, to_stream(s));
        return;
    }
    const int th = row_threads(dim);
    if (ydt == LUNAR_CUDA_F32)
        launch_pdl(add_norm_kernel<float>, dim3(n), dim3(th), 0, to_stream(s), (float *)y, x, r, w, dim, eps,
                   (__nv_bfloat16 *)NULL);
    else
        launch_pdl(add_norm_kernel<__nv_bfloat16>, dim3(n), dim3(th), 0, to_stream(s), (__nv_bfloat16 *)y, x, r, w, dim,
                   eps, (__nv_bfloat16 *)NULL);
    CUDA_CHECK_LAUNCH();
}

template <typename Y>
__global__ void embedding_kernel(Y *y, const uint16_t *E, const int32_t *ids, int dim) {
    pdl_enter();
    const size_t row = blockIdx.x;
    const uint16_t *er = E + (size_t)ids[row] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        y[row * dim + i] = from_f32<Y>(bf16_bits_to_f32(er[i]));
}
extern "C" void lunar_cuda_embedding(void *y, lunar_cuda_dtype ydt, const uint16_t *E,
                                     const int32_t *ids, int n, int dim, lunar_cuda_stream s) {
    if (n <= 0) return;
    int th = row_threads(dim);
    if (ydt == LUNAR_CUDA_F32)
        launch_pdl(embedding_kernel<float>, dim3(n), dim3(th), 0, to_stream(s), (float *)y, E, ids, dim);
    else
        launch_pdl(embedding_kernel<__nv_bfloat16>, dim3(n), dim3(th), 0, to_stream(s), (__nv_bfloat16 *)y, E, ids,
                   dim);
    CUDA_CHECK_LAUNCH();
}

__global__ void embedding_range_kernel(float *y, const uint16_t *E, const int32_t *ids, int dim, int64_t v0,
                                       int64_t vn) {
    const size_t row = blockIdx.x;
    const int64_t r = (int64_t)ids[row] - v0;
    float *yr = y + row * dim;
    if (r < 0 || r >= vn) { // another rank's row: this rank's term of the all-reduce is zero
        for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = 0.0f;
        return;
    }
    const uint16_t *er = E + (size_t)r * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = bf16_bits_to_f32(er[i]);
}
extern "C" void lunar_cuda_embedding_range(float *y, const uint16_t *E, const int32_t *ids, int n, int dim,
                                           int64_t v0, int64_t vn, lunar_cuda_stream s) {
    if (n <= 0) return;
    embedding_range_kernel<<<n, row_threads(dim), 0, to_stream(s)>>>(y, E, ids, dim, v0, vn);
    CUDA_CHECK_LAUNCH();
}

// act 0: silu(g) * u; act 1: SiTU  beta*tanh(g/beta)*sigmoid(g) * (beta_l>0 ? beta_l*tanh(u/beta_l) : u)
template <typename Y, int ACT>
__global__ void glu_kernel(Y *y, const float *g, const float *u, int64_t n, float beta,
                           float beta_l) {
    pdl_enter();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float a = g[i], b = u[i], r;
        if (ACT == 0) {
            r = a / (1.0f + expf(-a)) * b;
        } else {
            float ga = beta * tanhf(a / beta) / (1.0f + expf(-a));
            float ub = beta_l > 0.0f ? beta_l * tanhf(b / beta_l) : b;
            r = ga * ub;
        }
        y[i] = from_f32<Y>(r);
    }
}
template <int ACT>
static void glu_launch(void *y, lunar_cuda_dtype ydt, const float *g, const float *u, int64_t n,
                       float beta, float beta_l, lunar_cuda_stream s) {
    if (n <= 0) return;
    long long b = (n + 255) / 256;
    unsigned blocks = (unsigned)(b > 65536 ? 65536 : b);
    if (ydt == LUNAR_CUDA_F32)
        launch_pdl(glu_kernel<float, ACT>, dim3(blocks), dim3(256), 0, to_stream(s), (float *)y, g, u, n, beta, beta_l);
    else
        launch_pdl(glu_kernel<__nv_bfloat16, ACT>, dim3(blocks), dim3(256), 0, to_stream(s), (__nv_bfloat16 *)y, g, u,
                   n, beta, beta_l);
    CUDA_CHECK_LAUNCH();
}
extern "C" void lunar_cuda_silu_mul(void *y, lunar_cuda_dtype ydt, const float *gate,
                                    const float *up, int64_t n, lunar_cuda_stream s) {
    glu_launch<0>(y, ydt, gate, up, n, 0.0f, 0.0f, s);
}
extern "C" void lunar_cuda_situ_mul(void *y, lunar_cuda_dtype ydt, const float *gate,
                                    const float *up, int64_t n, float beta, float beta_l,
                                    lunar_cuda_stream s) {
    glu_launch<1>(y, ydt, gate, up, n, beta, beta_l, s);
}

// ---------------------------------------------------------------- short conv

// y[t, c] = silu(sum_i w[c, i] * s[t + i]), s = [state[c, 0..K-2], x[0..T-1, c]]. Reads the old
// state only; the state update runs afterwards in its own kernel (no read/write race).
__global__ void short_conv_kernel(float *y, const float *x, const float *w, const float *state,
                                  int T, int C, int K) {
    const int64_t n = (int64_t)T * C;
    const int S = K - 1;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int t = (int)(idx / C), c = (int)(idx % C);
        float acc = 0.0f;
        for (int i = 0; i < K; i++) {
            int p = t + i;
            float sv = p < S ? state[(size_t)c * S + p] : x[(size_t)(p - S) * C + c];
            acc += w[(size_t)c * K + i] * sv;
        }
        y[idx] = acc / (1.0f + expf(-acc));
    }
}
// the new conv state of C channels: the last K - 1 inputs (x rows xs floats apart: C for a plain
// [T, C] input, the fused projection's width for the KDA prefill's)
__global__ void short_conv_state_kernel(float *state, const float *x, int64_t xs, int T, int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int S = K - 1;
    float hist[CONV_MAX_K];
    float *st = state + (size_t)c * S;
#pragma unroll
    for (int j = 0; j < CONV_MAX_K - 1; j++) {
        if (j < S) {
            int p = T + j;
            hist[j] = p < S ? st[p] : x[(size_t)(p - S) * xs + c];
        }
    }
#pragma unroll
    for (int j = 0; j < CONV_MAX_K - 1; j++)
        if (j < S) st[j] = hist[j];
}
extern "C" void lunar_cuda_short_conv(float *y, const float *x, const float *w, float *state,
                                      int T, int C, int K, lunar_cuda_stream s) {
    CUDA_REQUIRE(K >= 1 && K <= CONV_MAX_K && y != x);
    if (T > 0) {
        long long b = ((long long)T * C + 255) / 256;
        short_conv_kernel<<<(unsigned)(b > 65536 ? 65536 : b), 256, 0, to_stream(s)>>>(
            y, x, w, state, T, C, K);
        CUDA_CHECK_LAUNCH();
    }
    if (K > 1) {
        short_conv_state_kernel<<<ceil_div_u(C, 256), 256, 0, to_stream(s)>>>(state, x, C, T, C, K);
        CUDA_CHECK_LAUNCH();
    }
}

// One token per sequence: thread (b, c) owns state_pool[slots[b]][c], so read-then-write is local.
__global__ void short_conv_decode_kernel(float *y, const float *x, const float *w,
                                         float *state_pool, const int32_t *slots, int B, int C,
                                         int K) {
    pdl_enter();
    const int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx >= (int64_t)B * C) return;
    const int b = (int)(idx / C), c = (int)(idx % C), S = K - 1;
    float *st = state_pool + ((size_t)slots[b] * C + c) * S;
    float win[CONV_MAX_K];
#pragma unroll
    for (int i = 0; i < CONV_MAX_K - 1; i++)
        if (i < S) win[i] = st[i];
    const float xv = x[idx];
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < CONV_MAX_K; i++)
        if (i < K) acc += w[(size_t)c * K + i] * (i < S ? win[i] : xv);
    y[idx] = acc / (1.0f + expf(-acc));
#pragma unroll
    for (int i = 0; i < CONV_MAX_K - 1; i++)
        if (i < S) st[i] = i + 1 < S ? win[i + 1] : xv;
}
extern "C" void lunar_cuda_short_conv_decode(float *y, const float *x, const float *w,
                                             float *state_pool, const int32_t *slots, int B,
                                             int C, int K, lunar_cuda_stream s) {
    CUDA_REQUIRE(K >= 1 && K <= CONV_MAX_K && y != x);
    if (B <= 0) return;
    launch_pdl(short_conv_decode_kernel, dim3(ceil_div_u((long long)B * C, 256)), dim3(256), 0, to_stream(s), y, x, w,
               state_pool, slots, B, C, K);
    CUDA_CHECK_LAUNCH();
}

// KDA decode, the three convolutions after the fused input projection in one launch (issue 9: a
// batch-1 step paid a launch per op): block (r, b) of dk threads (a power of two: the sum below is
// then norm_kernel's, same tree, same bits) owns head row r of the 3H rows q|k|v of sequence b,
// convolves it as short_conv_decode_kernel does (state_pool[slots[b]] is [3 H dk, K-1]), and
// L2-normalises the q and k rows as norm_kernel<float, 2>; block 3H of each sequence applies the
// sigmoid to its H beta logits (sigmoid_kernel's expression). Outputs: q, k, v [B, H dk] at qkv,
// qkv + B H dk, qkv + 2 B H dk; beta [B, H]. Inputs of sequence b at x + b xs, beta_in + b xs.
__global__ void kda_conv_qkv_kernel(float *qkv, float *beta, const float *x, const float *beta_in,
                                    int64_t xs, const float *w, float *state_pool,
                                    const int32_t *slots, int H, int dk, int K, float eps) {
    __shared__ float red[32];
    pdl_enter();
    const int r = blockIdx.x, b = blockIdx.y, t = threadIdx.x, HD = H * dk, B = gridDim.y;
    if (r == 3 * H) {
        for (int i = t; i < H; i += blockDim.x) beta[(size_t)b * H + i] = 1.0f / (1.0f + expf(-beta_in[b * xs + i]));
        return;
    }
    const int c = r * dk + t, S = K - 1, part = r / H;
    float acc = 0.0f;
    if (t < dk) {
        float *st = state_pool + ((size_t)slots[b] * 3 * HD + c) * S;
        float win[CONV_MAX_K];
#pragma unroll
        for (int i = 0; i < CONV_MAX_K - 1; i++)
            if (i < S) win[i] = st[i];
        const float xv = x[b * xs + c];
#pragma unroll
        for (int i = 0; i < CONV_MAX_K; i++)
            if (i < K) acc += w[(size_t)c * K + i] * (i < S ? win[i] : xv);
        acc = acc / (1.0f + expf(-acc));
#pragma unroll
        for (int i = 0; i < CONV_MAX_K - 1; i++)
            if (i < S) st[i] = i + 1 < S ? win[i + 1] : xv;
    }
    if (part < 2) { /* block-uniform: every thread reaches the sum */
        const float ss = block_sum_f32(t < dk ? acc * acc : 0.0f, red);
        acc = acc * (1.0f / sqrtf(ss + eps));
    }
    if (t < dk) qkv[((size_t)part * B + b) * HD + (c - part * HD)] = acc;
}
extern "C" void lunar_cuda_kda_conv_qkv_decode(float *qkv, float *beta, const float *x, const float *beta_in,
                                               int64_t x_stride, const float *w, float *state_pool,
                                               const int32_t *slots, int B, int H, int dk, int K, float eps,
                                               lunar_cuda_stream s) {
    CUDA_REQUIRE(K >= 1 && K <= CONV_MAX_K && dk >= 1 && dk <= 1024 && H >= 1 && (dk & (dk - 1)) == 0);
    if (B <= 0) return;
    launch_pdl(kda_conv_qkv_kernel, dim3(3 * H + 1, B), dim3(dk < 32 ? 32 : dk), 0, to_stream(s),
        qkv, beta, x, beta_in, x_stride, w, state_pool, slots, H, dk, K, eps);
    CUDA_CHECK_LAUNCH();
}

// KDA prefill after the fused input projection (kda_layer, LUNAR_KDA_PREFILL=fused): what
// lunar_cuda_short_conv x 3, lunar_cuda_l2norm, the sigmoid and two bf16 conversions did over eight
// launches and ~10 passes of [T, H dk] fp32, in one pass over the projection's output. Block (tile,
// r) of 128 threads owns head row r of q|k|v for 64 tokens: the 64 + K - 1 input rows it needs
// (those before the sequence from the conv state) are staged once in shared memory (the old kernel
// read each input K times and divided 64-bit indices per element), warp w convolves tokens w, w + 4,
// ..., each lane 4 channels (float4), and the q and k rows are L2-normalised by a warp sum (a token's
// 128 channels are one warp's). The conv sums are short_conv_kernel's (same order: its bits); the
// norm's sum is a different tree than norm_kernel's (fp32 reordering only). Block r = 3H of each tile
// writes beta = sigmoid and the bf16 copies of the low-rank inputs (the GEMM operands of f_b and
// g_b, rounded as lunar_cuda_f32_to_bf16). The state update runs afterwards in its own kernel
// (the first tile reads the old state).
constexpr int KP_TT = 64;
// ASYNC (the default; LUNAR_KDA_CONV_ASYNC=0 the plain staging): the plain staging loop
// keeps one load in flight per thread (load, then its shared store, ~17 times in sequence); instead every
// row of the sequence goes by cp.async (16 bytes, no register dependency: all in flight at once). Same
// values in the tile: bit-equal outputs. Measured on the H200 (Kimi-Linear 8K prefill, two rounds,
// docs/benchmarks.md "Session 7, last call"): kda_proj 29.1 / 29.9 -> 28.5 / 28.1 ms, the prefill
// 0.1474 / 0.1486 -> 0.1459 / 0.1477 s. (Loading the conv weights while the rows land is a further step.)
template <bool ASYNC>
__global__ void __launch_bounds__(128) kda_conv_qkv_prefill_kernel(
    float *q, float *k, float *v, float *beta, __nv_bfloat16 *xa, __nv_bfloat16 *xg, const float *x, int64_t xs,
    int a_off, int a_w, int g_off, int g_w, int b_off, const float *w, const float *state, int T, int H, int K,
    float eps) {
    __shared__ float4 tile[(KP_TT + CONV_MAX_K - 1) * 32];
    const int t0 = blockIdx.x * KP_TT, r = blockIdx.y, tid = threadIdx.x, S = K - 1;
    const int nt = min(KP_TT, T - t0);
    if (r == 3 * H) {
        for (int i = tid; i < nt * H; i += blockDim.x) {
            const int t = t0 + i / H, h = i % H;
            beta[(size_t)t * H + h] = 1.0f / (1.0f + expf(-x[(size_t)t * xs + b_off + h]));
        }
        for (int i = tid; i < nt * a_w; i += blockDim.x) {
            const int t = t0 + i / a_w, j = i % a_w;
            xa[(size_t)t * a_w + j] = __float2bfloat16_rn(x[(size_t)t * xs + a_off + j]);
        }
        for (int i = tid; i < nt * g_w; i += blockDim.x) {
            const int t = t0 + i / g_w, j = i % g_w;
            xg[(size_t)t * g_w + j] = __float2bfloat16_rn(x[(size_t)t * xs + g_off + j]);
        }
        return;
    }
    const int c0 = r * 128, part = r / H;
    for (int i = tid; i < (nt + S) * 32; i += blockDim.x) {
        const int row = i >> 5, j = i & 31, p = t0 - S + row;
        float4 val;
        if (ASYNC && p >= 0) {
            const uint32_t d = (uint32_t)__cvta_generic_to_shared(&tile[i]);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d),
                         "l"(x + (size_t)p * xs + c0 + 4 * j) : "memory");
            continue;
        }
        if (p >= 0) {
            val = *reinterpret_cast<const float4 *>(x + (size_t)p * xs + c0 + 4 * j);
        } else { /* before the sequence: the state's column S + p of channels c0 + 4j .. + 3 */
            const float *st = state + (size_t)(c0 + 4 * j) * S + (S + p);
            val = make_float4(st[0], st[S], st[2 * S], st[3 * S]);
        }
        tile[i] = val;
    }
    if (ASYNC) asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
    const int warp = tid >> 5, lane = tid & 31;
    float wr[4][CONV_MAX_K];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < CONV_MAX_K; i++) wr[j][i] = i < K ? w[(size_t)(c0 + 4 * lane + j) * K + i] : 0.0f;
    float *out = (part == 0 ? q : part == 1 ? k : v) + (size_t)(r - part * H) * 128 + 4 * lane;
    const int HD = H * 128;
    for (int tt = warp; tt < nt; tt += 4) {
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma unroll
        for (int i = 0; i < CONV_MAX_K; i++)
            if (i < K) {
                const float4 sv = tile[(tt + i) * 32 + lane];
                a0 += wr[0][i] * sv.x, a1 += wr[1][i] * sv.y, a2 += wr[2][i] * sv.z, a3 += wr[3][i] * sv.w;
            }
        a0 = a0 / (1.0f + expf(-a0)), a1 = a1 / (1.0f + expf(-a1));
        a2 = a2 / (1.0f + expf(-a2)), a3 = a3 / (1.0f + expf(-a3));
        if (part < 2) { /* warp-uniform */
            float ss = a0 * a0 + a1 * a1 + a2 * a2 + a3 * a3;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            const float inv = 1.0f / sqrtf(ss + eps);
            a0 *= inv, a1 *= inv, a2 *= inv, a3 *= inv;
        }
        *reinterpret_cast<float4 *>(out + (size_t)(t0 + tt) * HD) = make_float4(a0, a1, a2, a3);
    }
}
// The conv pass, second form (the default; LUNAR_KDA_CONV=old the tile kernel above). The tile
// kernel (cp.async staging) took 339 us a layer at 8K on the H200, 2.35 TB/s of its 0.80 GB; read
// from its code, not from stall counters: each block stages its 67 rows, waits for all of them, then
// computes (a bubble per block; 36 KB of shared memory a block caps residency at 6 blocks of 4
// warps), and its 3H-th block row (beta and the bf16 copies: scalar loads, an integer division per
// element) is dispatched last, after every q|k|v block, as the kernel's tail. Here nothing is staged:
// warp w of block (tile, r) owns head row r - 1 for TW consecutive tokens, each lane 4
// channels, and slides the conv window in registers (the K - 1 rows before its first token loaded
// once: from L2 or L1, they are the previous warp's rows); the inputs of KP2_U tokens are loaded
// together (KP2_U loads in flight per lane) and then convolved, normalised and stored in order.
// The beta / bf16 block row is row 0 (dispatched first, in the shadow of the rest) and moves 16 bytes
// a lane where widths and offsets allow. Arithmetic: the conv sum, the SiLU and the norm's warp
// tree are the tile kernel's expressions in the same order: bit-equal outputs (the op test checks).
// TW tokens a warp (32 for K = 4; 16 for the generic instantiation): the K - 1 window rows it reads
// twice (from L2 when the neighbouring warp's load brought them) are (K - 1) / TW of its reads. On the
// H200 (8K prefill, ncu, docs/benchmarks.md session 8) TW = 32 took 257 us a layer, TW = 16 270 us
constexpr int KP2_WARPS = 8, KP2_U = 4;

__device__ __forceinline__ uint2 bf16x4(float4 f) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(f.x, f.y), hi = __floats2bfloat162_rn(f.z, f.w);
    return make_uint2(*reinterpret_cast<const uint32_t *>(&lo), *reinterpret_cast<const uint32_t *>(&hi));
}

// block row 0: beta = sigmoid and the bf16 copies of the low-rank inputs of the block's tokens,
// a warp per token (VEC: 4 columns a lane, offsets and widths multiples of 4, outputs 8-byte aligned)
template <bool VEC>
__device__ __forceinline__ void kp2_aux(float *__restrict__ beta, __nv_bfloat16 *__restrict__ xa,
                                        __nv_bfloat16 *__restrict__ xg, const float *__restrict__ x, int64_t xs,
                                        int a_off, int a_w, int g_off, int g_w, int b_off, int t0, int nt, int H) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int tt = warp; tt < nt; tt += KP2_WARPS) {
        const size_t t = (size_t)(t0 + tt);
        const float *row = x + t * xs;
        for (int j = lane; j < H; j += 32) beta[t * H + j] = 1.0f / (1.0f + expf(-row[b_off + j]));
        if (VEC) {
            for (int j = lane; j < a_w / 4; j += 32)
                *reinterpret_cast<uint2 *>(xa + t * a_w + 4 * j) =
                    bf16x4(*reinterpret_cast<const float4 *>(row + a_off + 4 * j));
            for (int j = lane; j < g_w / 4; j += 32)
                *reinterpret_cast<uint2 *>(xg + t * g_w + 4 * j) =
                    bf16x4(*reinterpret_cast<const float4 *>(row + g_off + 4 * j));
        } else {
            for (int j = lane; j < a_w; j += 32) xa[t * a_w + j] = __float2bfloat16_rn(row[a_off + j]);
            for (int j = lane; j < g_w; j += 32) xg[t * g_w + j] = __float2bfloat16_rn(row[g_off + j]);
        }
    }
}

// KT: the conv length fixed at compile time (4, the models'), 0: any K <= CONV_MAX_K at run time
template <int KT, int TW>
__global__ void __launch_bounds__(KP2_WARPS * 32, KT ? 3 : 2) kda_conv_qkv_prefill2_kernel(
    float *__restrict__ q, float *__restrict__ k, float *__restrict__ v, float *__restrict__ beta,
    __nv_bfloat16 *__restrict__ xa, __nv_bfloat16 *__restrict__ xg, const float *__restrict__ x, int64_t xs,
    int a_off, int a_w, int g_off, int g_w, int b_off, const float *__restrict__ w, const float *__restrict__ state,
    int T, int H, int Kr, float eps, int vec) {
    static_assert(TW % KP2_U == 0, "a warp's run is whole groups");
    constexpr int KM = KT ? KT : CONV_MAX_K, TB = TW * KP2_WARPS;
    const int K = KT ? KT : Kr, S = K - 1, tb = blockIdx.x * TB;
    if (blockIdx.y == 0) {
        const int nt = min(TB, T - tb);
        if (vec) kp2_aux<true>(beta, xa, xg, x, xs, a_off, a_w, g_off, g_w, b_off, tb, nt, H);
        else kp2_aux<false>(beta, xa, xg, x, xs, a_off, a_w, g_off, g_w, b_off, tb, nt, H);
        return;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = blockIdx.y - 1, part = r / H;
    const int t0 = tb + warp * TW, c0 = r * 128 + 4 * lane;
    if (t0 >= T) return;
    const int nt = min(TW, T - t0);
    float wr[4][KM];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < KM; i++) wr[j][i] = i < K ? w[(size_t)(c0 + j) * K + i] : 0.0f;
    float4 win[KM > 1 ? KM - 1 : 1]; /* win[i]: the input of token t - S + i */
#pragma unroll
    for (int i = 0; i < KM - 1; i++)
        if (i < S) {
            const int p = t0 - S + i;
            if (p >= 0) {
                win[i] = *reinterpret_cast<const float4 *>(x + (size_t)p * xs + c0);
            } else { /* before the sequence: the state's column S + p of channels c0 .. c0 + 3 */
                const float *st = state + (size_t)c0 * S + (S + p);
                win[i] = make_float4(st[0], st[S], st[2 * S], st[3 * S]);
            }
        }
    float *out = (part == 0 ? q : part == 1 ? k : v) + (size_t)(r - part * H) * 128 + 4 * lane;
    const int HD = H * 128;
    for (int u0 = 0; u0 < nt; u0 += KP2_U) {
        float4 xv[KP2_U];
#pragma unroll
        for (int u = 0; u < KP2_U; u++)
            if (u0 + u < nt) xv[u] = *reinterpret_cast<const float4 *>(x + (size_t)(t0 + u0 + u) * xs + c0);
#pragma unroll
        for (int u = 0; u < KP2_U; u++) {
            if (u0 + u >= nt) break; /* warp-uniform */
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma unroll
            for (int i = 0; i < KM; i++)
                if (i < K) {
                    const float4 sv = i < S ? win[i] : xv[u];
                    a0 += wr[0][i] * sv.x, a1 += wr[1][i] * sv.y, a2 += wr[2][i] * sv.z, a3 += wr[3][i] * sv.w;
                }
#pragma unroll
            for (int i = 0; i < KM - 1; i++)
                if (i < S) win[i] = i + 1 < S ? win[i + 1] : xv[u];
            a0 = a0 / (1.0f + expf(-a0)), a1 = a1 / (1.0f + expf(-a1));
            a2 = a2 / (1.0f + expf(-a2)), a3 = a3 / (1.0f + expf(-a3));
            if (part < 2) { /* warp-uniform */
                float ss = a0 * a0 + a1 * a1 + a2 * a2 + a3 * a3;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
                const float inv = 1.0f / sqrtf(ss + eps);
                a0 *= inv, a1 *= inv, a2 *= inv, a3 *= inv;
            }
            *reinterpret_cast<float4 *>(out + (size_t)(t0 + u0 + u) * HD) = make_float4(a0, a1, a2, a3);
        }
    }
}
extern "C" void lunar_cuda_kda_conv_qkv_prefill(float *q, float *k, float *v, float *beta, uint16_t *xa,
                                                uint16_t *xg, const float *x, int64_t x_stride, int a_off, int a_w,
                                                int g_off, int g_w, int b_off, const float *w, float *state, int T,
                                                int H, int dk, int K, float eps, lunar_cuda_stream s) {
    CUDA_REQUIRE(dk == 128 && H >= 1 && K >= 1 && K <= CONV_MAX_K && x_stride % 4 == 0 &&
                 ((uintptr_t)x & 15) == 0 && a_w >= 0 && g_w >= 0 && (a_w == 0 || xa) && (g_w == 0 || xg));
    if (T <= 0) return;
    /* read per call (a prefill launch, not captured): the op test switches them between calls */
    const char *as = getenv("LUNAR_KDA_CONV_ASYNC"), *form = getenv("LUNAR_KDA_CONV");
    const dim3 grid(ceil_div_u(T, KP_TT), 3 * H + 1);
    if (!(form && strcmp(form, "old") == 0)) {
        const int vec = a_off % 4 == 0 && a_w % 4 == 0 && g_off % 4 == 0 && g_w % 4 == 0 &&
                        ((uintptr_t)xa & 7) == 0 && ((uintptr_t)xg & 7) == 0;
        /* the grid's tokens a block follow the instantiation launched (TW x KP2_WARPS) */
        const dim3 grid2(ceil_div_u(T, (K == 4 ? 32 : 16) * KP2_WARPS), 3 * H + 1);
        if (K == 4)
            kda_conv_qkv_prefill2_kernel<4, 32><<<grid2, KP2_WARPS * 32, 0, to_stream(s)>>>(
                q, k, v, beta, (__nv_bfloat16 *)xa, (__nv_bfloat16 *)xg, x, x_stride, a_off, a_w, g_off, g_w, b_off,
                w, state, T, H, K, eps, vec);
        else
            kda_conv_qkv_prefill2_kernel<0, 16><<<grid2, KP2_WARPS * 32, 0, to_stream(s)>>>(
                q, k, v, beta, (__nv_bfloat16 *)xa, (__nv_bfloat16 *)xg, x, x_stride, a_off, a_w, g_off, g_w, b_off,
                w, state, T, H, K, eps, vec);
    } else if (!(as && atoi(as) == 0))
        kda_conv_qkv_prefill_kernel<true><<<grid, 128, 0, to_stream(s)>>>(
            q, k, v, beta, (__nv_bfloat16 *)xa, (__nv_bfloat16 *)xg, x, x_stride, a_off, a_w, g_off, g_w, b_off, w,
            state, T, H, K, eps);
    else
        kda_conv_qkv_prefill_kernel<false><<<grid, 128, 0, to_stream(s)>>>(
            q, k, v, beta, (__nv_bfloat16 *)xa, (__nv_bfloat16 *)xg, x, x_stride, a_off, a_w, g_off, g_w, b_off, w,
            state, T, H, K, eps);
    CUDA_CHECK_LAUNCH();
    if (K > 1) {
        short_conv_state_kernel<<<ceil_div_u(3 * H * dk, 256), 256, 0, to_stream(s)>>>(state, x, x_stride, T,
                                                                                      3 * H * dk, K);
        CUDA_CHECK_LAUNCH();
    }
}

// ---------------------------------------------------------------- KDA gate (elementwise)
__global__ void kda_gate_kernel(float *g, const float *f, const float *A_log, const float *dt_bias,
                                int64_t n, int H, int dk, float lb) {
    pdl_enter();
    const int D = H * dk;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int hj = (int)(i % D);
        g[i] = kda_gate_value(f[i], A_log[hj / dk], dt_bias[hj], lb);
    }
}
extern "C" void lunar_cuda_kda_gate(float *g, const float *f, const float *A_log,
                                    const float *dt_bias, int T, int H, int dk, float lower_bound,
                                    lunar_cuda_stream s) {
    const int64_t n = (int64_t)T * H * dk;
    if (n <= 0) return;
    long long b = (n + 255) / 256;
    launch_pdl(kda_gate_kernel, dim3((unsigned)(b > 65536 ? 65536 : b)), dim3(256), 0, to_stream(s), g, f, A_log,
               dt_bias, n, H, dk, lower_bound);
    CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------- KDA prefill: f_b with the gate
// The forget gate's up-projection of the prefill with op_kda_gate in its epilogue: g [n, H 128] =
// op_kda_gate(xa [n, in] . f_b^T), f_b [H 128, in] bf16. It replaces cuBLAS's GEMM into pre and
// lunar_cuda_kda_gate over it (192 us a layer at 8K: a pass reading and writing [n, H 128] fp32):
// with in = 128 the GEMM is 0.26 GFLOP per 1K tokens and its cost is the fp32 store of its output
// alone, so applying the gate where the accumulators are (a register op) removes the gate's pass and
// pre's write and read outright; g is written once. Where else: the chunk kernel's loads of g
// (kda_intra2 reads each g twice, the second time on a 128-thread critical path; the gate's exp and
// log1p there would run twice per element on it), or the conv pass (it has no f_b product).
// Block (tile, j): 128 tokens x 64 gate columns (half of head j / 2: one A_log, one block of dt_bias),
// A and f_b's rows staged whole by cp.async (rows padded to in + 8 bf16: the 32-bit fragment loads
// of rows g, words t hit 32 distinct banks for any in % 16 == 0), warp w rows 16 w .. + 15, all 64
// columns, mma.sync m16n8k16 bf16 with fp32 accumulation (cuBLAS's operands and precision; the sums
// in another order). Launched plainly (the prefill is not captured). The first form (64 tokens x 128
// columns, 4 warps, 52 KB: 16 warps an SM) took 162 us a layer at 8K, 0.66 TB/s of its 108 MB
// written: each block in turn loads, multiplies, then evaluates 64 gates a thread (exp, log1p), with
// too few warps to overlap them; this one keeps 32 warps an SM (52 KB, 64 registers) and 32 gates
// a thread: 127 us (docs/benchmarks.md session 8), against 193 us of the gate pass alone before; still
// ~4x the write's floor (the gates' exp and log1p, and each block's phases in sequence).
// kSfu (session 13): the gate on the SFU (kda_gate_value_sfu below) instead of kda_gate_value's libm expf and
// log1pf; kSfu = false is the kernel above unchanged (LUNAR_KDA_GATE=exact).
constexpr int GG_M = 128, GG_N = 64, GG_T = GG_M / 16 * 32;

// op_kda_gate of one element on the special-function unit, a = exp(A_log) of the head. The libm form
// (kda_gate_value: expf, log1pf) is ~45 instructions an element, so at 8K (33.5 M gates a layer) the
// epilogue's issue alone, ~50 us, outweighed the 108 MB store (~26 us) of the kernel it sits in.
// softplus(x) = max(x, 0) + log1p(exp(-|x|)): exp(-|x|) in (0, 1] by ex2.approx and log2(1 + it), 1 + it
// in (1, 2], by lg2.approx, each on the range where its error is smallest: 6 ALU instructions, 2 MUFU.
// The error is absolute, <= ~4e-7 in softplus (lg2.approx's 2^-22 on [1, 2], the rounding of 1 + t,
// ex2.approx's 2 ulp of t <= 1), so <= ~4e-7 a in g; g is a log decay (alpha = exp(g)), so that is a
// relative error of alpha, below one rounding step of the chunk kernels' fp32 cumulative sums of g (at
// |g| ~ 1 and 64 tokens an ulp is 7.6e-6). Above x = 20 both forms give -a x exactly (1 + exp(-20)
// rounds to 1). The bounded form (lb < 0, K3's) with __expf and __fdividef: ~1e-6 relative.
__device__ __forceinline__ float kda_gate_value_sfu(float f, float a, float dtb, float lb) {
    const float x = f + dtb;
    if (lb < 0.0f) return __fdividef(lb, 1.0f + __expf(-a * x));
    float t, l2;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(-1.44269504f * fabsf(x)));
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(l2) : "f"(1.0f + t));
    return -a * fmaf(0.693147181f, l2, fmaxf(x, 0.0f));
}

template <bool kSfu>
__global__ void __launch_bounds__(GG_T, 4) kda_gate_gemm_kernel(float *__restrict__ g, const __nv_bfloat16 *__restrict__ xa,
                                                            const __nv_bfloat16 *__restrict__ W, int n, int H, int in,
                                                            const float *__restrict__ A_log,
                                                            const float *__restrict__ dt_bias, float lb) {
    extern __shared__ __align__(16) uint32_t gg_sm[];
    const int ldw = in / 2 + 4; /* words a row */
    uint32_t *As = gg_sm, *Bs = gg_sm + GG_M * ldw;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t4 = lane & 3;
    const int t0 = blockIdx.x * GG_M, n0 = blockIdx.y * GG_N, h = n0 / 128, c16 = in / 8; /* 16-byte pieces */
    for (int i = tid; i < (GG_M + GG_N) * c16; i += GG_T) {
        const int row = i / c16, j = i % c16;
        uint32_t *d = (row < GG_M ? As + row * ldw : Bs + (row - GG_M) * ldw) + 4 * j;
        const __nv_bfloat16 *src = row < GG_M ? xa + (size_t)(t0 + row) * in + 8 * j
                                              : W + ((size_t)n0 + (row - GG_M)) * in + 8 * j;
        if (row < GG_M && t0 + row >= n) {
            *reinterpret_cast<uint4 *>(d) = make_uint4(0, 0, 0, 0);
            continue;
        }
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(d)),
                     "l"(src) : "memory");
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
    float acc[GG_N / 8][4];
#pragma unroll
    for (int j = 0; j < GG_N / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const uint32_t *a_lo = As + (16 * warp + gq) * ldw + t4, *a_hi = a_lo + 8 * ldw, *b_r = Bs + gq * ldw + t4;
    for (int kw = 0; kw < in / 2; kw += 8) { /* 16 k a step, 8 words */
        const uint32_t a0 = a_lo[kw], a1 = a_hi[kw], a2 = a_lo[kw + 4], a3 = a_hi[kw + 4];
#pragma unroll
        for (int j = 0; j < GG_N / 8; j++) {
            const uint32_t *b = b_r + 8 * j * ldw + kw;
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                         "{%8,%9}, {%0,%1,%2,%3};\n"
                         : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b[0]), "r"(b[4]));
        }
    }
    const float al = A_log[h];
    const size_t HD = (size_t)H * 128;
    const int r0 = t0 + 16 * warp + gq;
    /* the SFU form takes exp(A_log) itself (libm expf, once a thread) */
    const float ga = kSfu ? expf(al) : al;
    auto gate = [&](float f, float dtb) {
        if constexpr (kSfu)
            return kda_gate_value_sfu(f, ga, dtb, lb);
        else
            return kda_gate_value(f, ga, dtb, lb);
    };
#pragma unroll
    for (int j = 0; j < GG_N / 8; j++) {
        const int col = n0 + 8 * j + 2 * t4;
        const float d0 = dt_bias[col], d1 = dt_bias[col + 1];
        float *o = g + (size_t)r0 * HD + col;
        if (r0 < n) *reinterpret_cast<float2 *>(o) = make_float2(gate(acc[j][0], d0), gate(acc[j][1], d1));
        if (r0 + 8 < n)
            *reinterpret_cast<float2 *>(o + 8 * HD) = make_float2(gate(acc[j][2], d0), gate(acc[j][3], d1));
    }
}

// The same product and SFU gate with each block's phases overlapped (LUNAR_KDA_GATE=loop): a block keeps
// one 64-column block of f_b (loaded once) and walks token tiles blockIdx.x, + gridDim.x, ..; the grid is
// one wave (4 blocks an SM, as the kernel above: 52 KB, 64 registers). Once every warp has its
// accumulators of tile i (the barrier after the products), the next tile's cp.async is issued into the
// one A buffer and flies under tile i's gates and stores, which the kernel above ran in sequence with its
// loads (and f_b's 64 rows were loaded again by each of its 64 token tiles). Warp w, rows 16 w .. + 15,
// the same mma.sync sequence and gate: the same bits as kda_gate_gemm_kernel<true>.
__device__ __forceinline__ void gg_load_rows(uint32_t *dst, const __nv_bfloat16 *__restrict__ src, int rows,
                                             int valid, int in, int ldw) {
    const int c16 = in / 8;
    for (int i = threadIdx.x; i < rows * c16; i += GG_T) {
        const int row = i / c16, j = i % c16;
        uint32_t *d = dst + row * ldw + 4 * j;
        if (row >= valid)
            *reinterpret_cast<uint4 *>(d) = make_uint4(0, 0, 0, 0);
        else
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(d)),
                         "l"(src + (size_t)row * in + 8 * j) : "memory");
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__global__ void __launch_bounds__(GG_T, 4) kda_gate_gemm_loop_kernel(float *__restrict__ g,
                                                                 const __nv_bfloat16 *__restrict__ xa,
                                                                 const __nv_bfloat16 *__restrict__ W, int n, int H,
                                                                 int in, const float *__restrict__ A_log,
                                                                 const float *__restrict__ dt_bias, float lb) {
    extern __shared__ __align__(16) uint32_t gg_sm[];
    const int ldw = in / 2 + 4; /* words a row */
    uint32_t *As = gg_sm, *Bs = gg_sm + GG_M * ldw;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, t4 = lane & 3;
    const int n0 = blockIdx.y * GG_N, tiles = (n + GG_M - 1) / GG_M;
    int tile = blockIdx.x;
    if (tile >= tiles) return;
    gg_load_rows(Bs, W + (size_t)n0 * in, GG_N, GG_N, in, ldw);
    gg_load_rows(As, xa + (size_t)tile * GG_M * in, GG_M, n - tile * GG_M, in, ldw);
    const float a = expf(A_log[n0 / 128]);
    const size_t HD = (size_t)H * 128;
    for (; tile < tiles; tile += gridDim.x) {
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncthreads();
        /* (set here, not live across the gates: 64 registers) */
        const uint32_t *a_lo = As + (16 * warp + gq) * ldw + t4, *a_hi = a_lo + 8 * ldw, *b_r = Bs + gq * ldw + t4;
        float acc[GG_N / 8][4];
#pragma unroll
        for (int j = 0; j < GG_N / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
        for (int kw = 0; kw < in / 2; kw += 8) {
            const uint32_t a0 = a_lo[kw], a1 = a_hi[kw], a2 = a_lo[kw + 4], a3 = a_hi[kw + 4];
#pragma unroll
            for (int j = 0; j < GG_N / 8; j++) {
                const uint32_t *b = b_r + 8 * j * ldw + kw;
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                             "{%8,%9}, {%0,%1,%2,%3};\n"
                             : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                             : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b[0]), "r"(b[4]));
            }
        }
        __syncthreads(); /* every warp's A fragments read: the buffer takes the next tile */
        const int next = tile + gridDim.x;
        if (next < tiles) gg_load_rows(As, xa + (size_t)next * GG_M * in, GG_M, n - next * GG_M, in, ldw);
        const int r0 = tile * GG_M + 16 * warp + gq;
#pragma unroll
        for (int j = 0; j < GG_N / 8; j++) {
            const int col = n0 + 8 * j + 2 * t4;
            const float d0 = dt_bias[col], d1 = dt_bias[col + 1]; /* L1 hits after the first tile */
            float *o = g + (size_t)r0 * HD + col;
            if (r0 < n)
                *reinterpret_cast<float2 *>(o) =
                    make_float2(kda_gate_value_sfu(acc[j][0], a, d0, lb), kda_gate_value_sfu(acc[j][1], a, d1, lb));
            if (r0 + 8 < n)
                *reinterpret_cast<float2 *>(o + 8 * HD) =
                    make_float2(kda_gate_value_sfu(acc[j][2], a, d0, lb), kda_gate_value_sfu(acc[j][3], a, d1, lb));
        }
    }
}

/* LUNAR_KDA_GATE=exact: kda_gate_gemm_kernel with kda_gate_value's libm gate (the default before session
 * 13, bit-equal to cuBLAS + lunar_cuda_kda_gate); =sfu: the same kernel with the SFU gate; =loop: the
 * SFU gate in kda_gate_gemm_loop_kernel, the default (session 13, H200, 8K: 125.4 -> 81.1 us, sfu 82.3;
 * 32K: 486 -> 310 us, sfu 332; docs/benchmarks.md "KDA gate GEMM on the SFU"). Read once;
 * lunar_cuda_kda_gate_form (the op test's and bench_cuda's hook, declared where they call it) sets it
 * (0 exact, 1 sfu, 2 loop) and returns the form before. */
constexpr int kGateFormDefault = 2;
static int gate_form = -1;
static int kda_gate_form(void) {
    if (gate_form < 0) {
        const char *e = getenv("LUNAR_KDA_GATE");
        gate_form = !e ? kGateFormDefault
                       : strcmp(e, "exact") == 0 ? 0
                       : strcmp(e, "sfu") == 0   ? 1
                       : strcmp(e, "loop") == 0  ? 2
                                                 : kGateFormDefault;
    }
    return gate_form;
}
extern "C" int lunar_cuda_kda_gate_form(int form) {
    const int prev = kda_gate_form();
    gate_form = form >= 0 && form <= 2 ? form : kGateFormDefault;
    return prev;
}
static int dense_sm_count(void) {
    static int v = 0;
    if (!v) {
        int dev = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    }
    return v;
}
extern "C" int lunar_cuda_kda_gate_gemm(float *g, const uint16_t *xa, const uint16_t *W, int n, int H, int dk, int in,
                                        const float *A_log, const float *dt_bias, float lb, lunar_cuda_stream s) {
    if (dk != 128 || in % 16 || in < 16 || in > 256 || ((uintptr_t)xa & 15) || ((uintptr_t)W & 15) ||
        ((uintptr_t)g & 7))
        return -1;
    if (n <= 0) return 0;
    const size_t smem = (size_t)(GG_M + GG_N) * (in / 2 + 4) * 4;
    /* the opt-in above 48 KB, set at each call (per device: a process may drive several; a host call
     * per KDA layer of a prefill) */
    const int form = kda_gate_form(), tiles = (int)ceil_div_u(n, GG_M), cols = H * (128 / GG_N);
    auto kernel = form == 2 ? kda_gate_gemm_loop_kernel : form == 1 ? kda_gate_gemm_kernel<true> : kda_gate_gemm_kernel<false>;
    if (smem > 48 * 1024)
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    /* the loop kernel: one wave of 4 blocks an SM, token tiles shared out over each column block's blocks */
    int x = tiles;
    if (form == 2) {
        const int per_col = 4 * dense_sm_count() / cols;
        x = per_col < 1 ? 1 : per_col < tiles ? per_col : tiles;
    }
    kernel<<<dim3(x, cols), GG_T, smem, to_stream(s)>>>(g, (const __nv_bfloat16 *)xa, (const __nv_bfloat16 *)W, n, H,
                                                        in, A_log, dt_bias, lb);
    CUDA_CHECK_LAUNCH();
    return 0;
}
