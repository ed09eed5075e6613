// The AttnRes mix fused with its out-norm in one pass over the candidates (op_attnres_mix):
//   s_i = (v_i . u) / sqrt(mean(v_i^2) + eps)          u = proj * norm, folded by the caller
//   m   = sum_i softmax(s)_i v_i
//   out = RMSNorm(m) * on  (on = NULL: out = m)
// Two kernels; lunar_cuda_attnres_mix (bottom) picks one.
//
// The block kernel (prefill rows, and every S > 16): one block of 256 threads per token; thread j
// holds elements j, j + 256, ... (EPT of them) of the current candidate and of the running m in
// registers (online softmax), so each candidate row is read from memory once and out written once:
// (S + 1) x D x 4 bytes per token, the bandwidth floor. The generic glue kernel (cuda_glue.cu) reads
// every candidate two or three times.
// Precision: the dot and sum of squares are accumulated in double per thread and across the
// block (the CPU op sums in double); m is rescaled in fp32 (online softmax) where the CPU keeps
// it in double: ~1e-7 relative.
//
// The cluster kernel (decode rows, S <= 16): described where it begins, below.
#include <math.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

namespace {

constexpr int kThreads = 256;

// the bits lunar_cuda_f32_to_bf16 stores for v (round to nearest even)
__device__ __forceinline__ uint16_t bf16_bits_rn(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }

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
__global__ void __launch_bounds__(kThreads) attnres_kernel(float *out, uint16_t *outb, const float *const *src,
                                                           int S, const float *u, const float *on, int D, float eps) {
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
        const float v = on ? m[j] * scale * ov[j] : m[j];
        if (d < D) o[d] = v;
        if (d < D && outb) outb[t * D + d] = bf16_bits_rn(v);
    }
}

// ---------------------------------------------------------------- the cluster kernel (decode rows)
//
// At one token the block kernel is one block on one SM walking S candidates as S dependent
// (load 28 KB -> block sum) round trips: ~7 us a call in the K3.1 step (ncu), 2 calls a layer. Here
// a token is a cluster of C CTAs of 256 threads (C = min(8, ceil(D / 256)); K3's D = 7168: 8 CTAs of
// 896 columns, 3.5 a thread), CTA r holding columns [r L, (r + 1) L), L = ceil(D / C) rounded up to
// 32 (warp-aligned slices), thread j its columns r L + j + 256 k (k < 4; lanes past L or D hold zeros
// and store nothing). Per token, with every step the same in every CTA of the cluster:
//  1. all S candidates' slices are loaded at once (S x 4 independent loads a thread in flight, kept in
//     registers: S <= SM, SM = 4, 8 or 16 by template, padded with zeros);
//  2. the 2 SM per-thread partials (dot_i, ss_i; double, as the block kernel) are reduced over the
//     block in ONE pass: a transposed warp reduction (each shuffle step halves the values a lane
//     carries: about 2 SM double shuffles a warp instead of 2 SM x 5), the 8 warps in order into the
//     CTA's part[], then after one cluster barrier warp 0 sums the C CTAs' part[] in rank order
//     through distributed shared memory: every CTA the same totals bit for bit;
//  3. warp 0 computes the scores (lane i: candidate i) and an exact two-pass softmax (max, then exp
//     and sum, xor butterflies: every lane and every CTA the same bits) into shared memory;
//  4. each CTA mixes its slice from registers (fp32, candidates in order), reduces the out-norm's sum
//     of squares the same way (the warps' sums read from every CTA in (rank, warp) order after a second
//     cluster barrier) and stores its slice scaled. A third, split barrier (arrive after the last
//     remote read, wait before exit) keeps every CTA's shared memory alive while another may read it.
// The scores are rounded to fp32 before the softmax (as the block kernel's), the softmax and the mix
// are fp32: ~1e-7 relative to the CPU's double, within the op test's 1e-5. The sums' order differs
// from the block kernel's (both deterministic), so the two agree to rounding, not bit for bit.
constexpr int kClMaxCtas = 8; // the portable cluster size
constexpr int kClEpt = 4;     // 8 CTAs x 256 threads x 4 = 8192 = the largest supported D
constexpr int kClSmax = 16;   // SMAX: more candidates go to the block kernel (K3 has at most ~13)

__device__ __forceinline__ uint32_t cl_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// the cluster's barrier, every thread of every CTA: writes before it (shared memory included) are
// visible to reads after it anywhere in the cluster (release / acquire at cluster scope)
__device__ __forceinline__ void cl_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cl_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cl_sync() { cl_arrive(), cl_wait(); }
// the double at this CTA's shared p, read from the cluster's CTA `rank` (DSMEM)
__device__ __forceinline__ double cl_ld(const double *p, uint32_t rank) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p), ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(a), "r"(rank));
    double v;
    asm volatile("ld.shared::cluster.f64 %0, [%1];\n" : "=d"(v) : "r"(ra) : "memory");
    return v;
}

// the sum over the cluster's C CTAs, in rank order, of the double at p (the same address in every CTA; read
// where on is set, else 0), the C loads in flight together: every CTA that asks gets the same bits
__device__ __forceinline__ double cl_sum_ranks(const double *p, bool on, int C) {
    double pr[kClMaxCtas], a = 0;
#pragma unroll
    for (int c = 0; c < kClMaxCtas; c++) pr[c] = on && c < C ? cl_ld(p, (uint32_t)c) : 0.0;
#pragma unroll
    for (int c = 0; c < kClMaxCtas; c++) a += pr[c];
    return a;
}

// The warp's sums of the 2 SM per-thread partials (dot_i, ss_i of candidates i < SM), transposed: at
// the step of offset o a lane keeps the half of its k values that its lane bit o selects and adds
// the partner's copy of that half, sending the other half (k / 2 shuffles), so the 2 SM values cost
// 2 SM - 1 shuffles (and 5 - log2 (2 SM) plain ones) instead of 2 SM x 5. The first step (o = 16)
// pairs dot_q with ss_q and is made as each candidate's partials are, the second (o = 8) as soon as
// both of its values are (fewer registers live: the 16-candidate kernel spilled at 128 with all 32
// doubles computed first); the rest by tstep. After log2 (2 SM) steps lane l holds value
// l / (16 / SM) (value q: dot_q for q < SM, ss_(q - SM) above) summed over the lanes that agree with
// l in the bits below 16 / SM; plain butterflies over those bits finish it. A fixed order, the same
// in every warp and every CTA (checked against a model of the lanes in Python while writing it).
// tstep: K values a lane left (offset 8 K / SM); recursion, so that every index is a constant and the
// values stay in registers (a loop over the steps left them in local memory)
template <int K, int SM> struct tstep {
    static __device__ __forceinline__ void run(double (&v)[SM], int lane) {
        constexpr int h = K / 2, o = 8 * K / SM;
        const bool up = (lane & o) != 0;
#pragma unroll
        for (int q = 0; q < h; q++) {
            const double send = up ? v[q] : v[q + h], keep = up ? v[q + h] : v[q];
            v[q] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
        tstep<h, SM>::run(v, lane);
    }
};
template <int SM> struct tstep<1, SM> {
    static __device__ __forceinline__ void run(double (&)[SM], int) {}
};
template <int SM>
__device__ __forceinline__ double warp_sum_scores(const float (&x)[SM][kClEpt], const float (&uu)[kClEpt]) {
    static_assert(SM >= 1 && SM <= 16 && (SM & (SM - 1)) == 0, "SM: a power of two <= 16");
    const int lane = threadIdx.x & 31;
    const bool up = (lane & 16) != 0;
    // step 1 (o = 16) for candidates q < SM / 2, then for the others each followed at once by its
    // step 2 (o = 8) with value q - SM / 2: at most SM / 2 + 1 doubles live a lane
    constexpr int H = SM > 1 ? SM / 2 : 1;
    double v[SM];
#pragma unroll
    for (int q = 0; q < SM; q++) {
        double dot = 0, ss = 0;
#pragma unroll
        for (int k = 0; k < kClEpt; k++) {
            const double xd = x[q][k];
            dot += xd * uu[k];
            ss += xd * xd;
        }
        v[q] = (up ? ss : dot) + __shfl_xor_sync(0xffffffffu, up ? dot : ss, 16);
        if (SM > 1 && q >= H) {
            const bool up8 = (lane & 8) != 0;
            const double send = up8 ? v[q - H] : v[q], keep = up8 ? v[q] : v[q - H];
            v[q - H] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
        }
    }
    tstep<H, SM>::run(v, lane);
#pragma unroll
    for (int o = 8 / SM; o; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    return v[0];
}

// grid (C, n), clusters of (C, 1, 1): blockIdx.y the token, the cluster rank the slice; C and L as
// above, inv_d = 1 / D. SM: the candidates the registers hold (S <= SM).
// Registers (ptxas, sm_90a): SM = 16 ~200 a thread, one CTA an SM (at 128, two CTAs, it spilled:
// 64 for the slices, up to 32 for the doubles in flight); SM <= 8 under 128, two CTAs an SM.
template <int SM>
__global__ void __launch_bounds__(kThreads, SM <= 8 ? 2 : 1)
    attnres_cl_kernel(float *out, uint16_t *outb, const float *const *src, int S, const float *u, const float *on,
                      int D, int C, int L, double inv_d, float eps) {
    constexpr int P = 2 * SM, NW = kThreads / 32;
    // wred: each warp's P sums; part: this CTA's P sums (read by the whole cluster); wss: each warp's
    // out-norm sum of squares (read by the whole cluster); wsm: the softmax weights; scl: the norm
    __shared__ double wred[NW][P], part[P], wss[NW];
    __shared__ float wsm[SM], scl;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const size_t t = blockIdx.y;
    const int c0 = (int)cl_rank() * L, d0 = c0 + tid;
    // column d0 + 256 k: held when inside the slice and the row (recomputed where used: registers)
#define CL_OK(k) (tid + (k) * kThreads < L && d0 + (k) * kThreads < D)
    float uu[kClEpt];
#pragma unroll
    for (int k = 0; k < kClEpt; k++) uu[k] = CL_OK(k) ? u[d0 + k * kThreads] : 0.0f; // weights: before the wait
    pdl_enter(); // the candidates and their pointer table are the step's activations
    // 1. every candidate's slice in flight at once
    float x[SM][kClEpt];
#pragma unroll
    for (int i = 0; i < SM; i++) {
        const float *v = i < S ? src[i] + t * D : nullptr;
#pragma unroll
        for (int k = 0; k < kClEpt; k++) x[i][k] = i < S && CL_OK(k) ? v[d0 + k * kThreads] : 0.0f;
    }
    // 2. the partials (dot_i at index i, ss_i at SM + i, zeros past S), one reduction for all
    const double ws = warp_sum_scores<SM>(x, uu);
    if ((lane & (32 / P - 1)) == 0) wred[w][lane / (32 / P)] = ws;
    // the out-norm's weights (no kernel of the step writes them) only now, the partials' registers
    // free: loaded with the others before the wait, the 16-candidate kernel spilled at 128 registers;
    // here their latency hides behind the block and cluster sums
    float ov[kClEpt];
#pragma unroll
    for (int k = 0; k < kClEpt; k++) ov[k] = on && CL_OK(k) ? on[d0 + k * kThreads] : 0.0f;
    __syncthreads();
    if (tid < P) {
        double a = 0;
#pragma unroll
        for (int j = 0; j < NW; j++) a += wred[j][tid];
        part[tid] = a;
    }
    cl_sync(); // every CTA's part[] written
    // 3. the totals in rank order (the C loads in flight together), the scores, the softmax
    if (w == 0) {
        const double tot = cl_sum_ranks(&part[lane], lane < P, C);
        const double ssi = __shfl_sync(0xffffffffu, tot, (lane + SM) & 31);
        const bool live = lane < S;
        const double s = live ? (double)(float)(tot / sqrt(ssi * inv_d + (double)eps)) : -INFINITY;
        double mx = s;
#pragma unroll
        for (int o = 16; o; o >>= 1) mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float e = live ? expf((float)(s - mx)) : 0.0f;
        float sum = e;
#pragma unroll
        for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane < SM) wsm[lane] = e / sum;
    }
    __syncthreads();
    // 4. the mix, from registers
    float m[kClEpt];
#pragma unroll
    for (int k = 0; k < kClEpt; k++) m[k] = 0.0f;
#pragma unroll
    for (int i = 0; i < SM; i++) {
        const float p = wsm[i];
#pragma unroll
        for (int k = 0; k < kClEpt; k++) m[k] += p * x[i][k];
    }
    float scale = 1.0f;
    if (on) {
        double ss = 0;
#pragma unroll
        for (int k = 0; k < kClEpt; k++) ss += (double)m[k] * m[k];
#pragma unroll
        for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) wss[w] = ss;
        cl_sync(); // every CTA's wss[] written
        if (w == 0) {
            // lane j < 8: warp j's sums of the C CTAs in rank order, then the 8 lanes' by butterfly
            double a = cl_sum_ranks(&wss[lane], lane < NW, C);
#pragma unroll
            for (int o = NW / 2; o; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane == 0) scl = (float)(1.0 / sqrt(a * inv_d + (double)eps));
        }
        __syncthreads();
        scale = scl;
    }
    cl_arrive(); // this CTA's remote reads are over (warp 0 used their values before the barrier above)
    float *o = out + t * D;
#pragma unroll
    for (int k = 0; k < kClEpt; k++) {
        const float v = on ? m[k] * scale * ov[k] : m[k];
        if (CL_OK(k)) o[d0 + k * kThreads] = v;
        if (CL_OK(k) && outb) outb[t * D + d0 + k * kThreads] = bf16_bits_rn(v);
    }
    cl_wait(); // no CTA leaves while another may still read its shared memory
#undef CL_OK
}

} // namespace

extern "C" int lunar_cuda_attnres_supported(int D) { return D >= 1 && D <= 32 * kThreads; }

// LUNAR_ATTNRES=block: the block kernel at every n; =cluster: the cluster kernel wherever it applies
// (S <= kClSmax, n <= 65535); else the rule: the cluster kernel at n <= kClRows rows and S <= kClSmax,
// the block kernel otherwise. kClRows = 16 to be confirmed on the H200 (cuda_attnres_bench times both
// at 1, 8, 16, 32 and 64 rows): a cluster of 8 CTAs takes 8 SMs for 1 / 8 of a row, and about 16
// clusters of 8 (1 CTA an SM, ~2 a GPC) are resident at once, so 16 rows are one wave; past that the
// block kernel, one SM a row, already keeps many rows' loads in flight (session 12's cluster kernel,
// 3f410b6: 9.5 against 12.8 us at one row, 1.7x slower at 64). lunar_cuda_attnres_mode (tests, A/B)
// overrides the environment.
constexpr int kClRows = 16;
static int g_attnres_mode = -1;
static int attnres_mode(void) {
    if (g_attnres_mode < 0) {
        const char *e = getenv("LUNAR_ATTNRES");
        g_attnres_mode = e && strcmp(e, "block") == 0     ? LUNAR_ATTNRES_BLOCK
                         : e && strcmp(e, "cluster") == 0 ? LUNAR_ATTNRES_CLUSTER
                                                          : LUNAR_ATTNRES_AUTO;
    }
    return g_attnres_mode;
}
extern "C" int lunar_cuda_attnres_mode(int mode) {
    const int prev = attnres_mode();
    if (mode >= 0) g_attnres_mode = mode;
    return prev;
}

// the cluster dimension and, PDL on, the programmatic serialization (launch_pdl sets only the latter)
template <int SM>
static void launch_cl(float *out, uint16_t *outb, const float *const *src, int S, const float *u, const float *on,
                      int n, int D, float eps, cudaStream_t st) {
    const int C = D < kClMaxCtas * kThreads ? (D + kThreads - 1) / kThreads : kClMaxCtas;
    const int L = ((D + C - 1) / C + 31) / 32 * 32; // <= 1024 = kThreads x kClEpt since D <= 8192
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)C, (unsigned)n);
    cfg.blockDim = dim3(kThreads);
    cfg.stream = st;
    cudaLaunchAttribute at[2];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = (unsigned)C, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
    at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at, cfg.numAttrs = lunar_cuda_pdl_on() ? 2 : 1;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, attnres_cl_kernel<SM>, out, outb, src, S, u, on, D, C, L, 1.0 / D, eps));
}

extern "C" void lunar_cuda_attnres_mix(float *out, uint16_t *outb, const float *const *src, int S, const float *u,
                                       const float *on, int n, int D, float eps, lunar_cuda_stream s) {
    CUDA_REQUIRE(S >= 1 && lunar_cuda_attnres_supported(D));
    if (n <= 0) return;
    const cudaStream_t st = to_stream(s);
    const int mode = attnres_mode();
    static_assert(kClMaxCtas * kThreads * kClEpt >= 32 * kThreads, "a cluster covers every supported D");
    if (S <= kClSmax && n <= 65535 &&
        (mode == LUNAR_ATTNRES_CLUSTER || (mode == LUNAR_ATTNRES_AUTO && n <= kClRows))) {
        if (S <= 4) launch_cl<4>(out, outb, src, S, u, on, n, D, eps, st);
        else if (S <= 8) launch_cl<8>(out, outb, src, S, u, on, n, D, eps, st);
        else launch_cl<16>(out, outb, src, S, u, on, n, D, eps, st);
        CUDA_CHECK_LAUNCH();
        return;
    }
    const int ept = (D + kThreads - 1) / kThreads;
    if (ept <= 4) launch_pdl(attnres_kernel<4>, dim3(n), dim3(kThreads), 0, st, out, outb, src, S, u, on, D, eps);
    else if (ept <= 8) launch_pdl(attnres_kernel<8>, dim3(n), dim3(kThreads), 0, st, out, outb, src, S, u, on, D, eps);
    else if (ept <= 16) launch_pdl(attnres_kernel<16>, dim3(n), dim3(kThreads), 0, st, out, outb, src, S, u, on, D, eps);
    else launch_pdl(attnres_kernel<32>, dim3(n), dim3(kThreads), 0, st, out, outb, src, S, u, on, D, eps);
    CUDA_CHECK_LAUNCH();
}
