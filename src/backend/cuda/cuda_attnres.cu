// The AttnRes mix fused with its out-norm in one pass over the candidates (op_attnres_mix):
//   s_i = (v_i . u) / sqrt(mean(v_i^2) + eps)          u = proj * norm, folded by the caller
//   m   = sum_i softmax(s)_i v_i                       online softmax over the candidates
//   out = RMSNorm(m) * on  (on = NULL: out = m)
// One block of 256 threads per token; thread j holds elements j, j + 256, ... (EPT of them) of
// the current candidate and of the running m in registers, so each candidate row is read from
// memory once and out written once: (S + 1) x D x 4 bytes per token, the bandwidth floor. The
// generic glue kernel (cuda_glue.cu) reads every candidate two or three times.
// Precision: the dot and sum of squares are accumulated in double per thread and across the
// block (the CPU op sums in double); m is rescaled in fp32 (online softmax) where the CPU keeps
// it in double: ~1e-7 relative.
#include <math.h>

#include "backend/cuda/cuda_common.cuh"

namespace {

constexpr int kThreads = 256;

// sum over the block of (a, b); every thread gets the totals. red: 2 x 8 doubles.
__device__ __forceinline__ void block_sum2(double &a, double &b, double *red) {
    for (int o = 16; o; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads(); // the previous use of red is over
    if (lane == 0) red[w] = a, red[8 + w] = b;
    __syncthreads();
    a = 0, b = 0;
#pragma unroll
    for (int i = 0; i < kThreads / 32; i++) a += red[i], b += red[8 + i];
}

template <int EPT>
__global__ void __launch_bounds__(kThreads) attnres_kernel(float *out, const float *const *src, int S,
                                                           const float *u, const float *on, int D, float eps) {
    __shared__ double red[16];
    pdl_enter();
    const size_t t = blockIdx.x;
    float uu[EPT], m[EPT];
#pragma unroll
    for (int j = 0; j < EPT; j++) {
        const int d = threadIdx.x + j * kThreads;
        uu[j] = d < D ? u[d] : 0.0f;
        m[j] = 0.0f;
    }
    float mx = -INFINITY, sum = 0.0f;
    for (int i = 0; i < S; i++) {
        const float *v = src[i] + t * D;
        float x[EPT];
        double dot = 0, ss = 0;
#pragma unroll
        for (int j = 0; j < EPT; j++) {
            const int d = threadIdx.x + j * kThreads;
            x[j] = d < D ? v[d] : 0.0f;
            dot += (double)x[j] * uu[j];
            ss += (double)x[j] * x[j];
        }
        block_sum2(dot, ss, red);
        const float s = (float)(dot / sqrt(ss / D + (double)eps));
        const float nm = fmaxf(mx, s);
        const float keep = expf(mx - nm), w = expf(s - nm); // keep = 0 on the first candidate
        sum = sum * keep + w;
#pragma unroll
        for (int j = 0; j < EPT; j++) m[j] = m[j] * keep + w * x[j];
        mx = nm;
    }
    // the out-norm's weights loaded here, before the norm's block sum and every store: loaded in the
    // store loop below, each load sat behind the previous element's store to out (which the compiler
    // must assume may alias on), EPT - 1 dependent round trips at the end of every block (K3's
    // D = 7168: 27 of them a mix, 2 L + 1 mixes a decode step); uu and x are dead by now
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
    float *o = out + t * D;
#pragma unroll
    for (int j = 0; j < EPT; j++) {
        const int d = threadIdx.x + j * kThreads;
        if (d < D) o[d] = on ? m[j] * scale * ov[j] : m[j];
    }
}

} // namespace

extern "C" int lunar_cuda_attnres_supported(int D) { return D >= 1 && D <= 32 * kThreads; }

extern "C" void lunar_cuda_attnres_mix(float *out, const float *const *src, int S, const float *u, const float *on,
                                       int n, int D, float eps, lunar_cuda_stream s) {
    CUDA_REQUIRE(S >= 1 && lunar_cuda_attnres_supported(D));
    if (n <= 0) return;
    const cudaStream_t st = to_stream(s);
    const int ept = (D + kThreads - 1) / kThreads;
    if (ept <= 4) launch_pdl(attnres_kernel<4>, dim3(n), dim3(kThreads), 0, st, out, src, S, u, on, D, eps);
    else if (ept <= 8) launch_pdl(attnres_kernel<8>, dim3(n), dim3(kThreads), 0, st, out, src, S, u, on, D, eps);
    else if (ept <= 16) launch_pdl(attnres_kernel<16>, dim3(n), dim3(kThreads), 0, st, out, src, S, u, on, D, eps);
    else launch_pdl(attnres_kernel<32>, dim3(n), dim3(kThreads), 0, st, out, src, S, u, on, D, eps);
    CUDA_CHECK_LAUNCH();
}
