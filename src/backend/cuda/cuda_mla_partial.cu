// The two device stages of decode context parallelism for MLA that the fast decode kernels
// (cuda_mla.cu) do not expose: attention of absorbed queries over listed fp32 cache rows returning
// the log-sum-exp beside the normalised latent context (op_mla_attention_partial), and the exact
// merge of such partials over disjoint row sets (op_mla_merge_partials). Correctness first: fp32
// throughout, one block per (query, head) walking its rows with an online softmax, so a rank's
// partial is the CPU op's up to fp32 summation order. The CPU-simulated DCP tests stay the oracle;
// a tensor-core variant can replace the first kernel (fp32 CUDA cores: the DCP decode's cost).
#include <math.h>

#include "backend/cuda/cuda_common.cuh"

namespace {

constexpr int kThreads = 128;

// Block (t, h), nw warps: warp w walks rows w, w + nw, .. with its own online softmax (m_w, l_w, and
// acc_w = sum_j exp(s_j - m_w) c_j in shared memory; lane i owns entries i, i + 32, ..: no barrier
// in the loop), then the warps' parts are merged exactly as the DCP merge does: M = max m_w,
// o = sum_w exp(m_w - M) acc_w / sum_w exp(m_w - M) l_w. A row costs one warp's dot product and a
// shuffle reduction (the first version used the whole block per row, two barriers each: ~8x
// slower at 16K rows).
// Split rows (splits > 1, ws non-NULL): block (t, h, k) takes the k-th of `splits` equal slices of
// the row list and writes its unnormalised part [acc (R) | max | sum] to ws[(t H + h) splits + k];
// combine_kernel merges the slices the same way. At decode (a few (token, head) pairs) this is what
// fills the GPU: 16 blocks walking 16K rows each were latency-bound (~17 ms per KL48 layer).
__global__ void partial_kernel(float *olat, float *lse, const float *qlat, const float *cache, const int32_t *rows,
                               const int32_t *count, int stride, int H, int R, int P, float scale, int splits,
                               float *ws) {
    extern __shared__ float sm[]; // [nw][R] accumulators, then [nw] maxima, [nw] sums
    const int nw = (int)(blockDim.x >> 5), w = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31);
    float *acc = sm + (size_t)w * R, *ms = sm + (size_t)nw * R, *ls = ms + nw;
    const size_t th = blockIdx.x / (unsigned)splits;
    const int k_split = (int)(blockIdx.x % (unsigned)splits);
    const int t = (int)(th / H), ld = R + P, nj = count[t];
    const int chunk = (nj + splits - 1) / splits, j0 = k_split * chunk, j1 = min(nj, j0 + chunk);
    const float *ql = qlat + th * ld;
    for (int r = lane; r < R; r += 32) acc[r] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j = j0 + w; j < j1; j += nw) {
        const float *cj = cache + (size_t)(rows ? rows[(size_t)t * stride + j] : j) * ld;
        float d = 0.0f;
        for (int i = lane; i < ld; i += 32) d += ql[i] * cj[i];
        for (int o = 16; o; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        const float s = scale * d, mn = fmaxf(m, s);
        const float a = expf(m - mn), p = expf(s - mn); // a = 0 at the warp's first row (m = -inf)
        l = l * a + p;
        for (int r = lane; r < R; r += 32) acc[r] = acc[r] * a + p * cj[r];
        m = mn;
    }
    if (lane == 0) ms[w] = m, ls[w] = l;
    __syncthreads();
    float M = -INFINITY;
    for (int k = 0; k < nw; k++) M = fmaxf(M, ms[k]);
    // no row at all: o = 0 and lse = -inf, so the part carries no weight in a merge (as the CPU op)
    float L = 0.0f;
    for (int k = 0; k < nw; k++)
        if (ms[k] != -INFINITY) L += expf(ms[k] - M) * ls[k];
    if (ws) { // a slice's part, unnormalised (M = -inf: an empty slice, no weight)
        float *part = ws + blockIdx.x * ((size_t)R + 2);
        for (int r = threadIdx.x; r < R; r += blockDim.x) {
            float o = 0.0f;
            for (int k = 0; k < nw; k++)
                if (ms[k] != -INFINITY) o += expf(ms[k] - M) * sm[(size_t)k * R + r];
            part[r] = o;
        }
        if (threadIdx.x == 0) part[R] = M, part[R + 1] = L;
        return;
    }
    const float inv = nj > 0 ? 1.0f / L : 0.0f;
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        float o = 0.0f;
        for (int k = 0; k < nw; k++)
            if (ms[k] != -INFINITY) o += expf(ms[k] - M) * sm[(size_t)k * R + r];
        olat[th * R + r] = o * inv;
    }
    if (threadIdx.x == 0) lse[th] = nj > 0 ? M + logf(L) : -INFINITY;
}

// Block (t, h): the splits slices of ws merged in slice order, o = sum_k e^(M_k - M) acc_k /
// sum_k e^(M_k - M) L_k, lse = M + log(sum); no row in any slice: o = 0, lse = -inf.
__global__ void __launch_bounds__(kThreads) combine_kernel(float *olat, float *lse, const float *ws, int splits,
                                                           int R) {
    const size_t th = blockIdx.x, pitch = (size_t)R + 2;
    const float *p = ws + th * splits * pitch;
    float M = -INFINITY;
    for (int k = 0; k < splits; k++) M = fmaxf(M, p[k * pitch + R]);
    if (M == -INFINITY) {
        for (int r = threadIdx.x; r < R; r += kThreads) olat[th * R + r] = 0.0f;
        if (threadIdx.x == 0) lse[th] = -INFINITY;
        return;
    }
    float L = 0.0f;
    for (int k = 0; k < splits; k++)
        if (p[k * pitch + R] != -INFINITY) L += expf(p[k * pitch + R] - M) * p[k * pitch + R + 1];
    const float inv = 1.0f / L;
    for (int r = threadIdx.x; r < R; r += kThreads) {
        float o = 0.0f;
        for (int k = 0; k < splits; k++)
            if (p[k * pitch + R] != -INFINITY) o += expf(p[k * pitch + R] - M) * p[k * pitch + r];
        olat[th * R + r] = o * inv;
    }
    if (threadIdx.x == 0) lse[th] = M + logf(L);
}

// Row i: out = sum_p w_p o_p / sum_p w_p, w_p = exp(lse_p - max lse), parts in order p = 0..n-1
// (the CPU op's order); every part -inf: 0.
__global__ void __launch_bounds__(kThreads) merge_kernel(float *out, const float *parts, int n,
                                                         size_t part_stride, int R) {
    const size_t i = blockIdx.x, pitch = (size_t)R + 1;
    float mx = -INFINITY;
    for (int p = 0; p < n; p++) mx = fmaxf(mx, parts[p * part_stride + i * pitch + R]);
    float *o = out + i * R;
    if (mx == -INFINITY) {
        for (int r = threadIdx.x; r < R; r += kThreads) o[r] = 0.0f;
        return;
    }
    float wsum = 0.0f;
    for (int p = 0; p < n; p++) wsum += expf(parts[p * part_stride + i * pitch + R] - mx);
    const float inv = 1.0f / wsum;
    for (int r = threadIdx.x; r < R; r += kThreads) {
        float acc = 0.0f;
        for (int p = 0; p < n; p++) {
            const float *pr = parts + p * part_stride + i * pitch;
            acc += expf(pr[R] - mx) * pr[r];
        }
        o[r] = acc * inv;
    }
}

// Block i: local row i of the rank, position p = dr + i * D, stored in block
// block_tables[seq, p / 128] at local row (p % 128) / D of blocks of 128 / D rows (shard_dcp.c's
// lunar_dcp_token), decoded to fp32 as the CPU reads the stored values.
__global__ void __launch_bounds__(kThreads) gather_kernel(float *dst, const void *latent, int fp8, float kv_scale,
                                                          const int32_t *bt, int D, int dr, int row) {
    const int i = blockIdx.x, p = dr + i * D, block_rows = 128 / D;
    const size_t src = (size_t)bt[p / 128] * block_rows + (size_t)(p % 128 / D);
    float *d = dst + (size_t)i * row;
    if (fp8) {
        const uint8_t *s = (const uint8_t *)latent + src * row;
        for (int r = threadIdx.x; r < row; r += kThreads) d[r] = e4m3_to_f32(s[r]) * kv_scale;
    } else {
        const uint16_t *s = (const uint16_t *)latent + src * row;
        for (int r = threadIdx.x; r < row; r += kThreads) d[r] = bf16_bits_to_f32(s[r]);
    }
}

// Row t by one thread: the order of the kept entries is the CPU's (a scan), and topk is small.
__global__ void local_rows_kernel(int32_t *out, int32_t *count, const int32_t *idx, int T, int topk, int D, int dr) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const int32_t *it = idx + (size_t)t * topk;
    int32_t *ot = out + (size_t)t * topk;
    int k = 0;
    for (int i = 0; i < topk; i++) {
        const int32_t v = it[i];
        if (v >= 0 && v % D == dr) ot[k++] = v / D;
    }
    count[t] = k;
}

} // namespace

extern "C" void lunar_cuda_dcp_local_rows(int32_t *out, int32_t *count, const int32_t *idx, int T, int topk, int D,
                                          int dr, lunar_cuda_stream s) {
    if (T <= 0) return;
    CUDA_REQUIRE(D >= 1 && dr >= 0 && dr < D && topk >= 0);
    local_rows_kernel<<<ceil_div_u(T, 128), 128, 0, to_stream(s)>>>(out, count, idx, T, topk, D, dr);
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_dcp_gather(float *dst, const lunar_cuda_mla_cache *c, int seq, int D, int dr, int n_loc,
                                      int row, lunar_cuda_stream s) {
    if (n_loc <= 0) return;
    CUDA_REQUIRE(D >= 1 && 128 % D == 0 && dr >= 0 && dr < D && row > 0);
    gather_kernel<<<(unsigned)n_loc, kThreads, 0, to_stream(s)>>>(
        dst, c->latent, c->dtype == LUNAR_CUDA_KV_FP8, c->scale, c->block_tables + (size_t)seq * c->max_blocks, D,
        dr, row);
    CUDA_CHECK_LAUNCH();
}

extern "C" size_t lunar_cuda_mla_partial_ws(int T, int H, int R, int splits) {
    return splits > 1 ? (size_t)T * H * splits * ((size_t)R + 2) * sizeof(float) : 0;
}

extern "C" void lunar_cuda_mla_partial_split(float *olat, float *lse, const float *qlat, const float *cache,
                                             const int32_t *rows, const int32_t *count, int stride, int T, int H,
                                             int R, int P, float scale, int splits, void *ws, lunar_cuda_stream s) {
    if (T <= 0 || H <= 0) return;
    CUDA_REQUIRE(R > 0 && P >= 0 && ((size_t)R + 2) * sizeof(float) <= 48 * 1024 && splits >= 1 &&
                 (splits == 1 || ws));
    // 8 warps while their accumulators fit the 48 KiB of static shared memory (R = 512: 16 KiB)
    int nw = 8;
    while (nw > 1 && ((size_t)nw * R + 2 * nw) * sizeof(float) > 48 * 1024) nw--;
    partial_kernel<<<(unsigned)((size_t)T * H * splits), (unsigned)(32 * nw),
                     ((size_t)nw * R + 2 * nw) * sizeof(float), to_stream(s)>>>(
        olat, lse, qlat, cache, rows, count, stride, H, R, P, scale, splits, splits > 1 ? (float *)ws : nullptr);
    CUDA_CHECK_LAUNCH();
    if (splits == 1) return;
    combine_kernel<<<(unsigned)((size_t)T * H), kThreads, 0, to_stream(s)>>>(olat, lse, (const float *)ws, splits, R);
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_mla_partial(float *olat, float *lse, const float *qlat, const float *cache,
                                       const int32_t *rows, const int32_t *count, int stride, int T, int H,
                                       int R, int P, float scale, lunar_cuda_stream s) {
    lunar_cuda_mla_partial_split(olat, lse, qlat, cache, rows, count, stride, T, H, R, P, scale, 1, nullptr, s);
}

extern "C" void lunar_cuda_mla_merge_partials(float *out, const float *parts, int n, size_t part_stride, int rows,
                                              int R, lunar_cuda_stream s) {
    if (rows <= 0) return;
    CUDA_REQUIRE(n > 0 && R > 0);
    merge_kernel<<<(unsigned)rows, kThreads, 0, to_stream(s)>>>(out, parts, n, part_stride, R);
    CUDA_CHECK_LAUNCH();
}
