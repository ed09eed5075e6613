// The AttnRes mix fused with its out-norm (op_attnres_mix):
//   s_i = (v_i . u) / sqrt(mean(v_i^2) + eps)          u = proj * norm, folded by the caller
//   m   = sum_i softmax(s)_i v_i                       online softmax over the candidates
//   out = RMSNorm(m) * on  (on = NULL: out = m)
// One block of 256 threads per token; thread j holds elements j, j + 256, ... (EPT of them) of
// the current candidate and of the running m in registers. Many rows (prefill): one pass, each
// candidate row read from memory once and out written once: (S + 1) x D x 4 bytes per token, the
// bandwidth floor (the generic glue kernel, cuda_glue.cu, reads every candidate two or three
// times). Few rows (decode): two passes, the scores first with every row's loads in flight, then
// the mix from L2 (K3.1's slice at batch 1: 7 us a mix in one pass, ncu, session 11), the same bits.
// Precision: the dot and sum of squares are accumulated in double per thread and across the
// block (the CPU op sums in double); m is rescaled in fp32 (online softmax) where the CPU keeps
// it in double: ~1e-7 relative.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxS2 = 64;         // most candidates of the two-pass kernel (its shared partials: 8 KB)
constexpr int kTwoPassRows = 128;  // rows up to which the two-pass kernel runs by default (one wave)

// sum over the warp of (a, b) by the xor butterfly: every lane ends with the same bits (each level
// adds the same two partials, in either order)
__device__ __forceinline__ void warp_sum2(double &a, double &b) {
    for (int o = 16; o; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
}

// sum over the block of (a, b); every thread gets the totals. red: 2 x 8 doubles.
__device__ __forceinline__ void block_sum2(double &a, double &b, double *red) {
    warp_sum2(a, b);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads(); // the previous use of red is over
    if (lane == 0) red[w] = a, red[8 + w] = b;
    __syncthreads();
    a = 0, b = 0;
#pragma unroll
    for (int i = 0; i < kThreads / 32; i++) a += red[i], b += red[8 + i];
}

// The pieces both kernels share, so that both compute the same bits: a candidate row's elements of
// this thread, its dot with u and sum of squares (per thread, in double), the score from the block
// totals, one online-softmax step, and the out-norm + store.
template <int EPT>
__device__ __forceinline__ void load_row(float (&x)[EPT], const float *v, int D) {
#pragma unroll
    for (int j = 0; j < EPT; j++) {
        const int d = threadIdx.x + j * kThreads;
        x[j] = d < D ? v[d] : 0.0f;
    }
}
template <int EPT>
__device__ __forceinline__ void row_dot(const float (&x)[EPT], const float (&uu)[EPT], double &dot, double &ss) {
    dot = 0, ss = 0;
#pragma unroll
    for (int j = 0; j < EPT; j++) {
        dot += (double)x[j] * uu[j];
        ss += (double)x[j] * x[j];
    }
}
__device__ __forceinline__ float cand_score(double dot, double ss, int D, float eps) {
    return (float)(dot / sqrt(ss / D + (double)eps));
}
template <int EPT>
__device__ __forceinline__ void mix_step(float (&m)[EPT], const float (&x)[EPT], float s, float &mx, float &sum) {
    const float nm = fmaxf(mx, s);
    const float keep = expf(mx - nm), w = expf(s - nm); // keep = 0 on the first candidate
    sum = sum * keep + w;
#pragma unroll
    for (int j = 0; j < EPT; j++) m[j] = m[j] * keep + w * x[j];
    mx = nm;
}
template <int EPT>
__device__ __forceinline__ void mix_store(float *o, float (&m)[EPT], float sum, const float *on, int D, float eps,
                                          double *red) {
    // the out-norm's weights loaded here, before the norm's block sum and every store: loaded in the
    // store loop below, each load sat behind the previous element's store to out (which the compiler
    // must assume may alias on), EPT - 1 dependent round trips at the end of every block (K3's
    // D = 7168: 27 of them a mix, 2 L + 1 mixes a decode step)
    float ov[EPT];
#pragma unroll
    for (int j = 0; j < EPT; j++) {
        const int d = threadIdx.x + j * kThreads;
        ov[j] = on && d < D ? on[d] : 0.0f;
    }
    const float inv_sum = 1.0f / sum;
    double ss = 0, unused = 0;
#pragma unroll
    for (int j = 0; j < EPT; j++) {
        m[j] *= inv_sum;
        ss += (double)m[j] * m[j];
    }
    float scale = 1.0f;
    if (on) {
        block_sum2(ss, unused, red);
        scale = (float)(1.0 / sqrt(ss / D + (double)eps));
    }
#pragma unroll
    for (int j = 0; j < EPT; j++) {
        const int d = threadIdx.x + j * kThreads;
        if (d < D) o[d] = on ? m[j] * scale * ov[j] : m[j];
    }
}

// One pass: candidate by candidate, each row read once (the bandwidth floor for many rows), but
// each candidate's score waits for its row's loads and a block sum before the next row is asked
// for: S dependent round trips, the whole time of a decode-sized mix.
template <int EPT>
__global__ void __launch_bounds__(kThreads) attnres_kernel(float *out, const float *const *src, int S,
                                                           const float *u, const float *on, int D, float eps) {
    __shared__ double red[16];
    pdl_enter();
    const size_t t = blockIdx.x;
    float uu[EPT], m[EPT];
    load_row(uu, u, D);
#pragma unroll
    for (int j = 0; j < EPT; j++) m[j] = 0.0f;
    float mx = -INFINITY, sum = 0.0f;
    for (int i = 0; i < S; i++) {
        float x[EPT];
        load_row(x, src[i] + t * D, D);
        double dot, ss;
        row_dot(x, uu, dot, ss);
        block_sum2(dot, ss, red);
        mix_step(m, x, cand_score(dot, ss, D, eps), mx, sum);
    }
    mix_store(out + t * D, m, sum, on, D, eps, red);
}

// Two passes, for decode-sized row counts (a grid of one wave, latency-bound): pass 1 asks for
// row i + 1 before row i's warp sums and leaves the block sums to one barrier after the last row;
// pass 2 reads the rows again (now from L2) and runs the same online softmax on the same scores.
// Every statement that makes a value is the one-pass kernel's (the warp butterfly, the warps'
// totals added in warp order from 0, the fp32 softmax recurrence), so the bits are the same.
template <int EPT>
__global__ void __launch_bounds__(kThreads) attnres2_kernel(float *out, const float *const *src, int S,
                                                            const float *u, const float *on, int D, float eps) {
    __shared__ double red[16], part[kMaxS2][16]; // part[i]: the warps' dots, then their sums of squares
    __shared__ const float *rows[kMaxS2];
    __shared__ float score[kMaxS2];
    pdl_enter();
    const size_t t = blockIdx.x;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (threadIdx.x < S) rows[threadIdx.x] = src[threadIdx.x] + t * D; // every pointer in one round trip
    float uu[EPT], x[EPT];
    load_row(uu, u, D);
    __syncthreads();
    load_row(x, rows[0], D);
    for (int i = 0; i < S; i++) {
        double dot, ss;
        row_dot(x, uu, dot, ss);
        if (i + 1 < S) load_row(x, rows[i + 1], D); // in flight under this row's sums
        warp_sum2(dot, ss);
        if (lane == 0) part[i][w] = dot, part[i][8 + w] = ss;
    }
    __syncthreads();
    if (threadIdx.x < S) {
        double a = 0, b = 0;
#pragma unroll
        for (int k = 0; k < kThreads / 32; k++) a += part[threadIdx.x][k], b += part[threadIdx.x][8 + k];
        score[threadIdx.x] = cand_score(a, b, D, eps);
    }
    __syncthreads();
    float m[EPT], mx = -INFINITY, sum = 0.0f;
#pragma unroll
    for (int j = 0; j < EPT; j++) m[j] = 0.0f;
    load_row(x, rows[0], D);
    for (int i = 0; i < S; i++) {
        float xn[EPT];
        if (i + 1 < S) load_row(xn, rows[i + 1], D);
        mix_step(m, x, score[i], mx, sum);
        if (i + 1 < S)
#pragma unroll
            for (int j = 0; j < EPT; j++) x[j] = xn[j];
    }
    mix_store(out + t * D, m, sum, on, D, eps, red);
}

} // namespace

extern "C" int lunar_cuda_attnres_supported(int D) { return D >= 1 && D <= 32 * kThreads; }

static int g_variant = -1; // -1: LUNAR_ATTNRES not read yet; 0 by rows, 1 one pass, 2 two passes

static int variant(void) {
    if (g_variant < 0) {
        const char *e = getenv("LUNAR_ATTNRES");
        g_variant = e && strcmp(e, "onepass") == 0 ? 1 : e && strcmp(e, "twopass") == 0 ? 2 : 0;
    }
    return g_variant;
}

extern "C" int lunar_cuda_attnres_variant(int v) {
    const int prev = variant();
    g_variant = v == 1 || v == 2 ? v : 0;
    return prev;
}

template <int EPT>
static void launch(bool two, int n, cudaStream_t st, float *out, const float *const *src, int S, const float *u,
                   const float *on, int D, float eps) {
    if (two) launch_pdl(attnres2_kernel<EPT>, dim3(n), dim3(kThreads), 0, st, out, src, S, u, on, D, eps);
    else launch_pdl(attnres_kernel<EPT>, dim3(n), dim3(kThreads), 0, st, out, src, S, u, on, D, eps);
}

extern "C" void lunar_cuda_attnres_mix(float *out, const float *const *src, int S, const float *u, const float *on,
                                       int n, int D, float eps, lunar_cuda_stream s) {
    CUDA_REQUIRE(S >= 1 && lunar_cuda_attnres_supported(D));
    if (n <= 0) return;
    const cudaStream_t st = to_stream(s);
    const int ept = (D + kThreads - 1) / kThreads, v = variant();
    const bool two = S <= kMaxS2 && (v == 2 || (v == 0 && n <= kTwoPassRows));
    if (ept <= 4) launch<4>(two, n, st, out, src, S, u, on, D, eps);
    else if (ept <= 8) launch<8>(two, n, st, out, src, S, u, on, D, eps);
    else if (ept <= 16) launch<16>(two, n, st, out, src, S, u, on, D, eps);
    else launch<32>(two, n, st, out, src, S, u, on, D, eps);
    CUDA_CHECK_LAUNCH();
}
