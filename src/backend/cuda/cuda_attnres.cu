// The AttnRes mix fused with its out-norm in one pass over the candidates (op_attnres_mix):
//   s_i = (v_i . u) / sqrt(mean(v_i^2) + eps)          u = proj * norm, folded by the caller
//   m   = sum_i softmax(s)_i v_i                       online softmax over the candidates
//   out = RMSNorm(m) * on  (on = NULL: out = m)
// The one-block kernel (the default; the cluster kernel below is opt-in): one block of 256 threads
// per token; thread j holds elements j, j + 256, ... (EPT of them) of the current candidate and of the running m in registers, so each candidate row is read from
// memory once and out written once: (S + 1) x D x 4 bytes per token, the bandwidth floor. The
// generic glue kernel (cuda_glue.cu) reads every candidate two or three times.
// Precision: the dot and sum of squares are accumulated in double per thread and across the
// block (the CPU op sums in double); m is rescaled in fp32 (online softmax) where the CPU keeps
// it in double: ~1e-7 relative.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cooperative_groups.h>

#include "backend/cuda/cuda_common.cuh"

namespace cg = cooperative_groups;

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

// ---------------------------------------------------------------- the cluster kernel (few rows)
//
// At batch 1 the kernel above is one block: it read K3's 9-10 candidates x 28 KB (D = 7168) one
// candidate at a time, 28 KB in flight from one SM, and took 7.0 us a mix (ncu, session 11), twice a
// layer, against ~0.1 us of bytes at the device's rate: the bytes in flight per round trip, not the
// block sums (a two-pass kernel with fewer round trips was no faster, session 11). Here a row is a
// cluster of NB blocks (NB = D / (kClThreads x EPT) rounded up, <= 8; K3: 7 blocks of 1024 columns),
// block b holding columns [b C, (b + 1) C) of the row, and each block loads SC = 8 candidates' slices
// at once (all those loads in flight together, on NB SMs) before it reduces them. A candidate's dot
// and sum of squares: per thread, the warp tree, the warps in order, then the NB blocks' partials
// read in rank order from each block's shared memory (DSMEM) after one cluster barrier, so every
// block gets the same sums, the same scores and the same softmax weights; each then mixes its own
// columns exactly as the kernel above (the same online-softmax updates per element), the out-norm's
// sum of squares crossing the cluster the same way. The sums' order differs from the kernel above
// (doubles: the score's float agrees but for a last-bit tie; the CPU tolerance of the op test holds).
constexpr int kClThreads = 128;
constexpr int kClChunk = 8;

// this block's per-candidate (dot, ss) totals into mine[c][0..1] (block order), then the cluster's
// into tot (rank order, every block the same); one cluster barrier. red: [warps][kClChunk][2].
template <int NC>
__device__ __forceinline__ void cluster_sum(double (&a)[NC], double (&b)[NC], double (*red)[kClChunk][2],
                                            double (*mine)[2], double (*tot)[2], int nb) {
    constexpr int NW = kClThreads / 32;
#pragma unroll
    for (int c = 0; c < NC; c++)
        for (int o = 16; o; o >>= 1) {
            a[c] += __shfl_xor_sync(0xffffffffu, a[c], o);
            b[c] += __shfl_xor_sync(0xffffffffu, b[c], o);
        }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0)
#pragma unroll
        for (int c = 0; c < NC; c++) red[w][c][0] = a[c], red[w][c][1] = b[c];
    __syncthreads();
    if (threadIdx.x < 2 * NC) {
        const int c = threadIdx.x >> 1, k = threadIdx.x & 1;
        double v = 0;
#pragma unroll
        for (int i = 0; i < NW; i++) v += red[i][c][k];
        mine[c][k] = v;
    }
    cg::this_cluster().sync(); // every block's partials written (release / acquire at cluster scope)
    if (threadIdx.x < 2 * NC) {
        const int c = threadIdx.x >> 1, k = threadIdx.x & 1;
        double v = 0;
        for (int r = 0; r < nb; r++) v += cg::this_cluster().map_shared_rank(&mine[c][k], r)[0];
        tot[c][k] = v;
    }
    __syncthreads();
}

template <int EPT>
__global__ void __launch_bounds__(kClThreads) attnres_cl_kernel(float *out, const float *const *src, int S,
                                                                const float *u, const float *on, int D, float eps) {
    constexpr int SC = kClChunk, NW = kClThreads / 32;
    // part: this block's partials, double-buffered by chunk parity: a block may write chunk c + 1's
    // before a slower one has read chunk c's, never chunk c + 2's (it waits at c + 1's barrier,
    // which the slower one reaches only after its reads)
    __shared__ double red[NW][SC][2], part[2][SC][2], tot[SC][2];
    const int nb = (int)cg::this_cluster().num_blocks(), rank = (int)cg::this_cluster().block_rank();
    const size_t t = blockIdx.y;
    const int d0 = rank * kClThreads * EPT + threadIdx.x;
    float uu[EPT], m[EPT], ov[EPT];
#pragma unroll
    for (int j = 0; j < EPT; j++) { // weights (u folds proj and norm; on): before the wait
        const int d = d0 + j * kClThreads;
        uu[j] = d < D ? u[d] : 0.0f;
        ov[j] = on && d < D ? on[d] : 0.0f;
        m[j] = 0.0f;
    }
    pdl_enter();
    float mx = -INFINITY, sum = 0.0f;
    int ch = 0;
    for (int c0 = 0; c0 < S; c0 += SC, ch ^= 1) {
        const int nc = min(SC, S - c0);
        const float *v[SC];
#pragma unroll
        for (int i = 0; i < SC; i++) v[i] = i < nc ? src[c0 + i] + t * D : nullptr;
        float x[SC][EPT];
#pragma unroll
        for (int i = 0; i < SC; i++)
#pragma unroll
            for (int j = 0; j < EPT; j++) {
                const int d = d0 + j * kClThreads;
                x[i][j] = i < nc && d < D ? v[i][d] : 0.0f;
            }
        double dot[SC], ss[SC];
#pragma unroll
        for (int i = 0; i < SC; i++) {
            dot[i] = 0, ss[i] = 0;
#pragma unroll
            for (int j = 0; j < EPT; j++) {
                dot[i] += (double)x[i][j] * uu[j];
                ss[i] += (double)x[i][j] * x[i][j];
            }
        }
        cluster_sum<SC>(dot, ss, red, part[ch], tot, nb);
#pragma unroll
        for (int i = 0; i < SC; i++) {
            if (i >= nc) break;
            const float s = (float)(tot[i][0] / sqrt(tot[i][1] / D + (double)eps));
            const float nm = fmaxf(mx, s);
            const float keep = expf(mx - nm), w = expf(s - nm); // keep = 0 on the first candidate
            sum = sum * keep + w;
#pragma unroll
            for (int j = 0; j < EPT; j++) m[j] = m[j] * keep + w * x[i][j];
            mx = nm;
        }
    }
    const float inv_sum = 1.0f / sum;
    double ss[1] = {0}, unused[1] = {0};
#pragma unroll
    for (int j = 0; j < EPT; j++) {
        m[j] *= inv_sum;
        ss[0] += (double)m[j] * m[j];
    }
    float scale = 1.0f;
    if (on) {
        cluster_sum<1>(ss, unused, red, part[ch], tot, nb);
        scale = (float)(1.0 / sqrt(tot[0][0] / D + (double)eps));
    }
    float *o = out + t * D;
#pragma unroll
    for (int j = 0; j < EPT; j++) {
        const int d = d0 + j * kClThreads;
        if (d < D) o[d] = on ? m[j] * scale * ov[j] : m[j];
    }
    cg::this_cluster().sync(); // no block leaves while another may still read its shared memory
}

} // namespace

extern "C" int lunar_cuda_attnres_supported(int D) { return D >= 1 && D <= 32 * kThreads; }

// LUNAR_ATTNRES=cluster: the cluster kernel at every n (D <= 8192); else (default, =onepass) the
// one-block kernel. The cluster kernel stays opt-in: faster alone at one row (op bench, session 12:
// 9.5 against 12.8 us a mix at n = 1, S = 9, D = 7168) but not in the K3.1 slice's B = 1 step (1.639
// against 1.634 ms, 3 rounds alternating) and slower at 64 rows (23.1 against 13.4 us) and 8192
// (2091 against 999 us). lunar_cuda_attnres_mode (tests) overrides the environment.
static int g_attnres_mode = -1;
extern "C" int lunar_cuda_attnres_mode(int mode) {
    if (g_attnres_mode < 0) {
        const char *e = getenv("LUNAR_ATTNRES");
        g_attnres_mode = e && !strcmp(e, "onepass") ? LUNAR_ATTNRES_ONEPASS
                         : e && !strcmp(e, "cluster") ? LUNAR_ATTNRES_CLUSTER
                                                      : LUNAR_ATTNRES_AUTO;
    }
    const int prev = g_attnres_mode;
    if (mode >= 0) g_attnres_mode = mode;
    return prev;
}

template <int EPT>
static void launch_cl(float *out, const float *const *src, int S, const float *u, const float *on, int n, int D,
                      float eps, cudaStream_t st) {
    const int nb = (D + kClThreads * EPT - 1) / (kClThreads * EPT);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(nb, n);
    cfg.blockDim = dim3(kClThreads);
    cfg.stream = st;
    cudaLaunchAttribute at[2];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = nb, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
    at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at, cfg.numAttrs = lunar_cuda_pdl_on() ? 2 : 1;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, attnres_cl_kernel<EPT>, out, src, S, u, on, D, eps));
}

extern "C" void lunar_cuda_attnres_mix(float *out, const float *const *src, int S, const float *u, const float *on,
                                       int n, int D, float eps, lunar_cuda_stream s) {
    CUDA_REQUIRE(S >= 1 && lunar_cuda_attnres_supported(D));
    if (n <= 0) return;
    const cudaStream_t st = to_stream(s);
    const int mode = lunar_cuda_attnres_mode(-1);
    if (D <= 8 * kClThreads * 8 && n <= 65535 && mode == LUNAR_ATTNRES_CLUSTER) {
        // blocks of 512 columns up to D = 4096 (Kimi-Linear's 2304: 5), of 1024 above (K3's 7168: 7)
        if (D <= 8 * kClThreads * 4) launch_cl<4>(out, src, S, u, on, n, D, eps, st);
        else launch_cl<8>(out, src, S, u, on, n, D, eps, st);
        CUDA_CHECK_LAUNCH();
        return;
    }
    const int ept = (D + kThreads - 1) / kThreads;
    if (ept <= 4) launch_pdl(attnres_kernel<4>, dim3(n), dim3(kThreads), 0, st, out, src, S, u, on, D, eps);
    else if (ept <= 8) launch_pdl(attnres_kernel<8>, dim3(n), dim3(kThreads), 0, st, out, src, S, u, on, D, eps);
    else if (ept <= 16) launch_pdl(attnres_kernel<16>, dim3(n), dim3(kThreads), 0, st, out, src, S, u, on, D, eps);
    else launch_pdl(attnres_kernel<32>, dim3(n), dim3(kThreads), 0, st, out, src, S, u, on, D, eps);
    CUDA_CHECK_LAUNCH();
}
