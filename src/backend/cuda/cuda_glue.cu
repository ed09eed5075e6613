// Glue and generic-shape kernels of the CUDA model forward (see cuda_glue.h). Simple, correct for
// any shape; the tuned kernels of cuda_ops.h are used by the forward wherever their shapes fit.
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_glue.h"

#define BF(x) bf16_bits_to_f32(x)

__global__ void k_matmul(float *y, const uint16_t *x, const uint16_t *W, int n, int out, int in) {
    // one warp per output element
    long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= (long long)n * out) return;
    int r = (int)(w / out), o = (int)(w % out);
    const uint16_t *xr = x + (size_t)r * in, *wr = W + (size_t)o * in;
    float acc = 0.f;
    for (int i = lane; i < in; i += 32) acc += BF(xr[i]) * BF(wr[i]);
    for (int d = 16; d; d >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, d);
    if (lane == 0) y[(size_t)r * out + o] = acc;
}
extern "C" void lunar_glue_matmul(float *y, const uint16_t *x, const uint16_t *W, int n, int out,
                                  int in, lunar_cuda_stream s) {
    if (n <= 0) return;
    long long th = (long long)n * out * 32;
    k_matmul<<<ceil_div_u(th, 256), 256, 0, to_stream(s)>>>(y, x, W, n, out, in);
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_glue_copy(void *dst, const void *src, size_t bytes, lunar_cuda_stream s) {
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, to_stream(s)));
}

__global__ void k_add(float *x, const float *y, size_t n) {
    pdl_enter();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}
__global__ void k_sigmul(float *o, const float *g, size_t n) {
    pdl_enter();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) o[i] *= 1.0f / (1.0f + expf(-g[i]));
}
__global__ void k_scale(float *x, float a, size_t n) {
    pdl_enter();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
extern "C" void lunar_glue_add(float *x, const float *y, size_t n, lunar_cuda_stream s) {
    if (!n) return;
    launch_pdl(k_add, dim3(ceil_div_u(n, 256)), dim3(256), 0, to_stream(s), x, y, n);
    CUDA_CHECK_LAUNCH();
}
extern "C" void lunar_glue_sigmoid_mul(float *o, const float *g, size_t n, lunar_cuda_stream s) {
    if (!n) return;
    launch_pdl(k_sigmul, dim3(ceil_div_u(n, 256)), dim3(256), 0, to_stream(s), o, g, n);
    CUDA_CHECK_LAUNCH();
}
extern "C" void lunar_glue_scale(float *x, float a, size_t n, lunar_cuda_stream s) {
    if (!n) return;
    launch_pdl(k_scale, dim3(ceil_div_u(n, 256)), dim3(256), 0, to_stream(s), x, a, n);
    CUDA_CHECK_LAUNCH();
}

__global__ void k_gather(float *y, const float *x, const int32_t *idx, int m, int D) {
    pdl_enter();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)m * D) return;
    int r = (int)(i / D), d = (int)(i % D);
    y[i] = x[(size_t)idx[r] * D + d];
}
__global__ void k_scatter(float *acc, const float *y, const int32_t *idx, const float *w, int m, int D) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)m * D) return;
    int r = (int)(i / D), d = (int)(i % D);
    acc[(size_t)idx[r] * D + d] += w[r] * y[i];
}
extern "C" void lunar_glue_gather(float *y, const float *x, const int32_t *idx, int m, int D,
                                  lunar_cuda_stream s) {
    if (m <= 0) return;
    launch_pdl(k_gather, dim3(ceil_div_u((long long)m * D, 256)), dim3(256), 0, to_stream(s), y, x, idx, m, D);
    CUDA_CHECK_LAUNCH();
}
extern "C" void lunar_glue_scatter_add(float *acc, const float *y, const int32_t *idx, const float *w,
                                       int m, int D, lunar_cuda_stream s) {
    if (m <= 0) return;
    k_scatter<<<ceil_div_u((long long)m * D, 256), 256, 0, to_stream(s)>>>(acc, y, idx, w, m, D);
    CUDA_CHECK_LAUNCH();
}

// one block per token; S <= 64 candidates
__global__ void k_attnres(float *out, const float *const *src, int S, const float *u, const float *on,
                          int D, float eps) {
    __shared__ double red[32];
    __shared__ double sc[64];
    const int t = blockIdx.x;
    for (int i = 0; i < S; i++) {
        const float *v = src[i] + (size_t)t * D;
        double dot = 0, ss = 0;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            dot += (double)v[d] * u[d];
            ss += (double)v[d] * v[d];
        }
        dot = block_sum_f64(dot, red);
        ss = block_sum_f64(ss, red);
        if (threadIdx.x == 0) sc[i] = dot / sqrt(ss / D + (double)eps);
    }
    __syncthreads();
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < S; i++) mx = fmax(mx, sc[i]);
    for (int i = 0; i < S; i++) sum += exp(sc[i] - mx);
    double ss = 0;
    float *o = out + (size_t)t * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        double m = 0;
        for (int i = 0; i < S; i++) m += exp(sc[i] - mx) / sum * src[i][(size_t)t * D + d];
        o[d] = (float)m;  // kept in fp32 for the norm below (the CPU keeps m in double)
        ss += m * m;
    }
    if (on) {
        ss = block_sum_f64(ss, red);
        double inv = 1.0 / sqrt(ss / D + (double)eps);
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            double m = 0;
            for (int i = 0; i < S; i++) m += exp(sc[i] - mx) / sum * src[i][(size_t)t * D + d];
            o[d] = (float)(m * inv) * on[d];
        }
    }
}
extern "C" void lunar_glue_attnres_mix(float *out, const float *const *src, int S, const float *u,
                                       const float *on, int n, int D, float eps, lunar_cuda_stream s) {
    CUDA_REQUIRE(S >= 1 && S <= 64);
    if (n <= 0) return;
    k_attnres<<<n, 256, 0, to_stream(s)>>>(out, src, S, u, on, D, eps);
    CUDA_CHECK_LAUNCH();
}

__global__ void k_layernorm(float *y, const float *x, const float *w, const float *b, int dim, float eps) {
    __shared__ double red[32];
    pdl_enter();
    layernorm_block(y + (size_t)blockIdx.x * dim, x + (size_t)blockIdx.x * dim, w, b, dim, eps, red);
}
extern "C" void lunar_glue_layernorm(float *y, const float *x, const float *w, const float *b, int n,
                                     int dim, float eps, lunar_cuda_stream s) {
    if (n <= 0) return;
    launch_pdl(k_layernorm, dim3(n), dim3(128), 0, to_stream(s), y, x, w, b, dim, eps);
    CUDA_CHECK_LAUNCH();
}

// one block per row, len <= 1024 threads... rows of len (power of two) in shared memory
__global__ void k_hadamard(float *x, int len) {
    extern __shared__ float v[];
    pdl_enter();
    float *r = x + (size_t)blockIdx.x * len;
    for (int i = threadIdx.x; i < len; i += blockDim.x) v[i] = r[i];
    hadamard_block(v, len);
    const float norm = (float)(1.0 / sqrt((double)len));
    for (int i = threadIdx.x; i < len; i += blockDim.x) r[i] = v[i] * norm;
}
extern "C" void lunar_glue_hadamard(float *x, int rows, int len, lunar_cuda_stream s) {
    CUDA_REQUIRE(len >= 1 && (len & (len - 1)) == 0 && len <= 8192);
    if (rows <= 0) return;
    launch_pdl(k_hadamard, dim3(rows), dim3(128), (size_t)len * sizeof(float), to_stream(s), x, len);
    CUDA_CHECK_LAUNCH();
}

__global__ void k_rope(float *x, const float *inv, const int32_t *pos, int nh, int hd, int half) {
    pdl_enter();
    const int t = blockIdx.x;
    for (int p = threadIdx.x; p < nh * half; p += blockDim.x) {
        int h = p / half, i = p % half;
        double ang = (double)pos[t] * (double)inv[i], c = cos(ang), sn = sin(ang);
        float *v = x + ((size_t)t * nh + h) * hd;
        double a = v[i], b = v[i + half];
        v[i] = (float)(a * c - b * sn);
        v[i + half] = (float)(b * c + a * sn);
    }
}
extern "C" void lunar_glue_rope_neox(float *x, const float *inv_freq, const int32_t *pos, int T, int nh,
                                     int hd, int rot, lunar_cuda_stream s) {
    if (T <= 0) return;
    launch_pdl(k_rope, dim3(T), dim3(128), 0, to_stream(s), x, inv_freq, pos, nh, hd, rot / 2);
    CUDA_CHECK_LAUNCH();
}

// one block per head, one thread per value column c; shared q, k, exp(g) of the token
__global__ void k_kda_rec(float *o, const float *q, const float *k, const float *v, const float *g,
                          const float *beta, float *S, int T, int H, int dk, int dv, float scale) {
    extern __shared__ float sh[];
    float *sq = sh, *sk = sh + dk, *sa = sh + 2 * dk;
    const int h = blockIdx.x, c = threadIdx.x;
    float *Sh = S + (size_t)h * dk * dv;
    for (int t = 0; t < T; t++) {
        size_t th = (size_t)t * H + h;
        __syncthreads();
        for (int j = threadIdx.x; j < dk; j += blockDim.x) {
            sq[j] = q[th * dk + j] * scale;
            sk[j] = k[th * dk + j];
            sa[j] = expf(g[th * dk + j]);
        }
        __syncthreads();
        if (c < dv) {
            float d = 0.f;
            for (int j = 0; j < dk; j++) {
                float sv = Sh[(size_t)j * dv + c] * sa[j];
                Sh[(size_t)j * dv + c] = sv;
                d += sv * sk[j];
            }
            d = (v[th * dv + c] - d) * beta[th];
            float ot = 0.f;
            for (int j = 0; j < dk; j++) {
                float sv = Sh[(size_t)j * dv + c] + sk[j] * d;
                Sh[(size_t)j * dv + c] = sv;
                ot += sv * sq[j];
            }
            o[th * dv + c] = ot;
        }
    }
}
extern "C" void lunar_glue_kda_recurrent(float *o, const float *q, const float *k, const float *v,
                                         const float *g, const float *beta, float *S, int T, int H,
                                         int dk, int dv, float scale, lunar_cuda_stream s) {
    CUDA_REQUIRE(dv <= 1024 && dk <= 4096);
    if (T <= 0) return;
    int th = ((dv + 31) / 32) * 32;
    k_kda_rec<<<H, th, (size_t)3 * dk * sizeof(float), to_stream(s)>>>(o, q, k, v, g, beta, S, T, H, dk,
                                                                       dv, scale);
    CUDA_CHECK_LAUNCH();
}

template <bool FP8>
__global__ void k_latent_store(void *latent, const float *kvr, const float *w, const int32_t *slots,
                               int R, int P, float eps) {
    __shared__ double red[32];
    pdl_enter();
    const int i = blockIdx.x, row = R + P;
    if (slots[i] < 0) return; /* not stored here (DCP: another rank's token); the whole block leaves */
    const float *x = kvr + (size_t)i * row;
    double ss = 0;
    for (int d = threadIdx.x; d < R; d += blockDim.x) ss += (double)x[d] * x[d];
    ss = block_sum_f64(ss, red);
    float inv = (float)(1.0 / sqrt(ss / R + (double)eps));
    for (int d = threadIdx.x; d < row; d += blockDim.x) {
        float val = d < R ? x[d] * inv * w[d] : x[d];
        if (FP8) { // per-tensor scale 1 (cache.c lunar_kv_round): the RMS-normalised latent fits e4m3
            ((uint8_t *)latent)[(size_t)slots[i] * row + d] = f32_to_e4m3(val);
        } else {
            __nv_bfloat16 b = __float2bfloat16_rn(val);
            ((uint16_t *)latent)[(size_t)slots[i] * row + d] = *(uint16_t *)&b;
        }
    }
}
extern "C" void lunar_glue_latent_store(void *latent, int fp8, const float *kvr, const float *w,
                                        const int32_t *slots, int n, int R, int P, float eps,
                                        lunar_cuda_stream s) {
    if (n <= 0) return;
    if (fp8) launch_pdl(k_latent_store<true>, dim3(n), dim3(128), 0, to_stream(s), latent, kvr, w, slots, R, P, eps);
    else launch_pdl(k_latent_store<false>, dim3(n), dim3(128), 0, to_stream(s), latent, kvr, w, slots, R, P, eps);
    CUDA_CHECK_LAUNCH();
}

// The absorption's row kernels (decode and short prefills; >= MLA_ABSORB_GEMM_MIN rows take the
// GEMMs). Memory-bound: each row reads its head's W_UK / W_UV (128 KB each at K-Linear's shapes),
// so both spread a head's weights over many blocks and read them coalesced; the earlier block per
// (row, head) used 32 blocks at batch 1 and its un-absorption read W_UV column-wise (~0.25 ms per
// layer at batch 1 on the H200). Both sum in a fixed order (no atomics): deterministic.
#define ABS_COLS 64  // q_lat columns per block (two per lane)
#define ABS_WARPS 8  // the N rows of W_UK split over the warps, partial sums added in warp order

// block per (row x head, chunk of ABS_COLS columns: grid.y): q_lat[c] = sum_n q[n] W[h*(N+Vd)+n, c]
__global__ void k_absorb(float *q_lat, float *q_pe, const float *q, const uint16_t *W, int H, int N,
                         int P, int Vd, int R, int pf) {
    __shared__ float part[ABS_WARPS][ABS_COLS];
    const int rh = blockIdx.x, h = rh % H, c0 = blockIdx.y * ABS_COLS;
    /* before the wait (weights only, cuda_common.cuh): the first row's blocks bring their N x 128
     * bytes of W_UK into L2, a thread per line (the other rows' blocks read the same lines) */
    if (pf && rh < H)
        for (int n = threadIdx.x; n < N; n += blockDim.x) pdl_prefetch_line_l2(W + ((size_t)h * (N + Vd) + n) * R + c0);
    pdl_wait();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float *qt = q + (size_t)rh * (N + P);
    const uint16_t *Wh = W + (size_t)h * (N + Vd) * R;
    const int ca = c0 + lane, cb = c0 + lane + 32;
    float a = 0.f, b = 0.f;
    for (int n = warp; n < N; n += ABS_WARPS) {
        const float x = qt[n];
        const uint16_t *row = Wh + (size_t)n * R;
        if (ca < R) a += x * BF(row[ca]);
        if (cb < R) b += x * BF(row[cb]);
    }
    part[warp][lane] = a, part[warp][lane + 32] = b;
    __syncthreads();
    if (threadIdx.x < ABS_COLS && c0 + (int)threadIdx.x < R) {
        float t = 0.f;
        for (int w = 0; w < ABS_WARPS; w++) t += part[w][threadIdx.x];
        q_lat[(size_t)rh * R + c0 + threadIdx.x] = t;
    }
    if (blockIdx.y == 0)
        for (int p = threadIdx.x; p < P; p += blockDim.x) q_pe[(size_t)rh * P + p] = qt[N + p];
}
extern "C" void lunar_glue_mla_absorb(float *q_lat, float *q_pe, const float *q, const uint16_t *W,
                                      int rows, int H, int N, int P, int Vd, int R, lunar_cuda_stream s) {
    if (rows <= 0) return;
    dim3 grid(rows * H, ceil_div_u(R, ABS_COLS));
    launch_pdl(k_absorb, dim3(grid), dim3(ABS_WARPS * 32), 0, to_stream(s), q_lat, q_pe, q, W, H, N, P, Vd, R,
               lunar_cuda_pdl_prefetch_bytes(1) > 0);
    CUDA_CHECK_LAUNCH();
}
// warp per output x of (row, head): o[x] = sum_r W[h*(N+Vd)+N+x, r] c[r], lanes along r (a row of
// W_UV read contiguously), shuffle reduction
#define UNABS_WARPS 8
__global__ void k_unabsorb(float *o, const float *o_lat, const uint16_t *W, int H, int N, int Vd, int R,
                           uint32_t pf) {
    const int rh = blockIdx.x, h = rh % H, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int x = blockIdx.y * UNABS_WARPS + warp;
    /* before the wait: the first row's warps bring their W_UV row into L2 (cuda_common.cuh) */
    if (pf && rh < H && lane == 0 && x < Vd) {
        const uint32_t rb = (uint32_t)R * 2u, lim = (pf / UNABS_WARPS) & ~15u;
        pdl_prefetch_l2(W + ((size_t)h * (N + Vd) + N + x) * R, rb < lim ? rb : lim);
    }
    pdl_wait();
    if (x >= Vd) return;
    const float *c = o_lat + (size_t)rh * R;
    const uint16_t *wr = W + ((size_t)h * (N + Vd) + N + x) * R;
    float a = 0.f;
    for (int r = lane; r < R; r += 32) a += BF(wr[r]) * c[r];
    for (int m = 16; m > 0; m >>= 1) a += __shfl_xor_sync(0xffffffffu, a, m);
    if (lane == 0) o[(size_t)rh * Vd + x] = a;
}
extern "C" void lunar_glue_mla_unabsorb(float *o, const float *o_lat, const uint16_t *W, int rows, int H,
                                        int N, int Vd, int R, lunar_cuda_stream s) {
    if (rows <= 0) return;
    dim3 grid(rows * H, ceil_div_u(Vd, UNABS_WARPS));
    launch_pdl(k_unabsorb, dim3(grid), dim3(UNABS_WARPS * 32), 0, to_stream(s), o, o_lat, W, H, N, Vd, R,
               lunar_cuda_pdl_prefetch_bytes(1));
    CUDA_CHECK_LAUNCH();
}

// block per (row, head); scores in shared memory
// element d of the latent row of cache slot `slot` (bf16 or e4m3 codes)
template <bool FP8> __device__ __forceinline__ float lat_at(const void *latent, size_t slot, int row, int d) {
    return FP8 ? e4m3_to_f32(((const uint8_t *)latent)[slot * row + d]) : BF(((const uint16_t *)latent)[slot * row + d]);
}
template <bool FP8>
__global__ void k_mla_attn(float *o_lat, const float *q_lat, const float *q_pe, const void *latent,
                           const int32_t *bt, int max_blocks, const int32_t *row_seq,
                           const int32_t *lens, const int32_t *idx, int topk, int H, int R, int P,
                           float scale) {
    extern __shared__ float sc[];
    const int rh = blockIdx.x, r = rh / H, row = R + P;
    const int seq = row_seq ? row_seq[r] : r;
    const int n = idx ? topk : lens[r];
    const float *ql = q_lat + (size_t)rh * R, *qp = q_pe + (size_t)rh * P;
    // scores (one warp per position)
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = wid; j < n; j += nw) {
        int p = idx ? idx[(size_t)r * topk + j] : j;
        if (p < 0) {
            if (lane == 0) sc[j] = -INFINITY;
            continue;
        }
        const size_t c = (size_t)bt[(size_t)seq * max_blocks + p / 128] * 128 + p % 128;
        float a = 0.f, b = 0.f;
        for (int d = lane; d < R; d += 32) a += ql[d] * lat_at<FP8>(latent, c, row, d);
        for (int d = lane; d < P; d += 32) b += qp[d] * lat_at<FP8>(latent, c, row, R + d);
        for (int d = 16; d; d >>= 1) {
            a += __shfl_xor_sync(0xffffffffu, a, d);
            b += __shfl_xor_sync(0xffffffffu, b, d);
        }
        if (lane == 0) sc[j] = scale * (a + b);
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int j = 0; j < n; j++) mx = fmaxf(mx, sc[j]);
    float sum = 0.f;
    for (int j = 0; j < n; j++) sum += sc[j] == -INFINITY ? 0.f : expf(sc[j] - mx);
    float *out = o_lat + (size_t)rh * R;
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
        float a = 0.f;
        for (int j = 0; j < n; j++) {
            if (sc[j] == -INFINITY) continue;
            int p = idx ? idx[(size_t)r * topk + j] : j;
            const size_t c = (size_t)bt[(size_t)seq * max_blocks + p / 128] * 128 + p % 128;
            a += expf(sc[j] - mx) / sum * lat_at<FP8>(latent, c, row, d);
        }
        out[d] = sum > 0.f ? a : 0.f;
    }
}
extern "C" void lunar_glue_mla_attn(float *o_lat, const float *q_lat, const float *q_pe,
                                    const void *latent, int fp8, const int32_t *block_tables, int max_blocks,
                                    const int32_t *row_seq, const int32_t *lens, const int32_t *idx,
                                    int topk, int max_len, int rows, int H, int R, int P, float scale,
                                    lunar_cuda_stream s) {
    if (rows <= 0) return;
    int n = idx ? topk : max_len;
    CUDA_REQUIRE(n >= 1 && (size_t)n * sizeof(float) <= 48 * 1024);
    if (fp8)
        k_mla_attn<true><<<rows * H, 128, (size_t)n * sizeof(float), to_stream(s)>>>(
            o_lat, q_lat, q_pe, latent, block_tables, max_blocks, row_seq, lens, idx, topk, H, R, P, scale);
    else
        k_mla_attn<false><<<rows * H, 128, (size_t)n * sizeof(float), to_stream(s)>>>(
            o_lat, q_lat, q_pe, latent, block_tables, max_blocks, row_seq, lens, idx, topk, H, R, P, scale);
    CUDA_CHECK_LAUNCH();
}

// fp16 <-> fp32 copies of n elements (the fp16 KDA state around the kernels that take fp32 states)
__global__ void k_f16_to_f32(float *y, const __half *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = __half2float(x[i]);
}
__global__ void k_f32_to_f16(__half *y, const float *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = __float2half_rn(x[i]);
}
extern "C" void lunar_glue_f16_to_f32(float *y, const uint16_t *x, size_t n, lunar_cuda_stream s) {
    if (!n) return;
    const unsigned blocks = (unsigned)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
    k_f16_to_f32<<<blocks, 256, 0, to_stream(s)>>>(y, reinterpret_cast<const __half *>(x), n);
    CUDA_CHECK_LAUNCH();
}
extern "C" void lunar_glue_f32_to_f16(uint16_t *y, const float *x, size_t n, lunar_cuda_stream s) {
    if (!n) return;
    const unsigned blocks = (unsigned)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
    k_f32_to_f16<<<blocks, 256, 0, to_stream(s)>>>(reinterpret_cast<__half *>(y), x, n);
    CUDA_CHECK_LAUNCH();
}
