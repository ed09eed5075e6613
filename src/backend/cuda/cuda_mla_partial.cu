// The device stages of decode context parallelism for MLA that the fast decode kernels
// (cuda_mla.cu) do not expose: attention of absorbed queries over a rank's latent rows returning
// the log-sum-exp beside the normalised latent context (op_mla_attention_partial), over a
// contiguous fp32 copy (the CPU op's argument) or in place in the rank's pages (what the forward
// runs: no gather, all query groups and tokens in one launch, nothing from the host, so a DCP
// decode step can be captured in a CUDA graph), and the exact merge of such partials over disjoint
// row sets (op_mla_merge_partials). Correctness first: fp32 throughout, one block per (query, head)
// walking its rows with an online softmax, so a rank's partial is the CPU op's up to fp32 summation
// order. The CPU-simulated DCP tests stay the oracle; a tensor-core variant can replace the partial
// kernel (fp32 CUDA cores: the DCP decode's cost).
#include <math.h>

#include "backend/cuda/cuda_common.cuh"

namespace {

constexpr int kThreads = 128;

// Where the rows of a token's list live. FlatRows: a contiguous fp32 copy [n, R + P] (the CPU op's
// cache argument). PagedRows: a DCP rank's rows in place: local row li of token t's sequence is in
// block bt[row_seq[t], li / block_rows] at row li % block_rows (block_rows = 128 / D; shard_dcp.c's
// lunar_dcp_token: local row li is position dr + li D, whose block is (dr + li D) / 128 = li /
// block_rows as dr < D), bf16 or e4m3 x the cache scale, decoded as the CPU reads them.
struct FlatRows {
    const float *cache;
    int ld;
    struct Row {
        const float *p;
        __device__ float operator[](int i) const { return p[i]; }
    };
    __device__ Row row(int, int li) const { return {cache + (size_t)li * ld}; }
};
template <bool FP8> struct PagedRows {
    const void *latent;
    float kv;
    const int32_t *bt, *row_seq;
    int max_blocks, block_rows, ld;
    struct Row {
        const void *p;
        float kv;
        __device__ float operator[](int i) const {
            if (FP8) return e4m3_to_f32(((const uint8_t *)p)[i]) * kv;
            return bf16_bits_to_f32(((const uint16_t *)p)[i]);
        }
    };
    __device__ Row row(int t, int li) const {
        const int32_t page = bt[(size_t)row_seq[t] * max_blocks + li / block_rows];
        const size_t src = ((size_t)page * block_rows + (size_t)(li % block_rows)) * ld;
        return {(const char *)latent + src * (FP8 ? 1 : 2), kv};
    }
};

// Block (g, t, h), nw warps (g: one of G query groups of T tokens, all over token t's rows): warp w
// walks rows w, w + nw, .. with its own online softmax (m_w, l_w, and acc_w = sum_j exp(s_j - m_w)
// c_j in shared memory; lane i owns entries i, i + 32, ..: no barrier in the loop), then the warps'
// parts are merged exactly as the DCP merge does: M = max m_w, o = sum_w exp(m_w - M) acc_w / sum_w
// exp(m_w - M) l_w. A row costs one warp's dot product and a shuffle reduction (the first version
// used the whole block per row, two barriers each: ~8x slower at 16K rows). Block (g, t, h)'s
// olat goes to olat[((g T + t) H + h) o_pitch], its lse to lse[(..) l_pitch] (o_pitch R + 1 and
// lse = olat + R: the DCP send layout).
// Split rows (splits > 1, ws non-NULL): block (g, t, h, k) takes the k-th of `splits` equal slices
// of the row list and writes its unnormalised part [acc (R) | max | sum] to ws[((g T + t) H + h)
// splits + k]; combine_kernel merges the slices the same way. At decode (a few (token, head) pairs)
// this is what fills the GPU: 16 blocks walking 16K rows each were latency-bound (~17 ms per KL48
// layer).
template <class Rows>
__global__ void partial_kernel(float *olat, int o_pitch, float *lse, int l_pitch, const float *qlat, Rows src,
                               const int32_t *rows, const int32_t *count, int stride, int T, int H, int R, int P,
                               float scale, int splits, float *ws) {
    extern __shared__ float sm[]; // [nw][R] accumulators, then [nw] maxima, [nw] sums
    const int nw = (int)(blockDim.x >> 5), w = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31);
    float *acc = sm + (size_t)w * R, *ms = sm + (size_t)nw * R, *ls = ms + nw;
    const size_t th = blockIdx.x / (unsigned)splits;
    const int k_split = (int)(blockIdx.x % (unsigned)splits);
    const int t = (int)((th / H) % T), ld = R + P, nj = count[t];
    const int chunk = (nj + splits - 1) / splits, j0 = k_split * chunk, j1 = min(nj, j0 + chunk);
    const float *ql = qlat + th * ld;
    for (int r = lane; r < R; r += 32) acc[r] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j = j0 + w; j < j1; j += nw) {
        const typename Rows::Row cj = src.row(t, rows ? rows[(size_t)t * stride + j] : j);
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
        olat[th * o_pitch + r] = o * inv;
    }
    if (threadIdx.x == 0) lse[th * l_pitch] = nj > 0 ? M + logf(L) : -INFINITY;
}

// Block (t, h): the splits slices of ws merged in slice order, o = sum_k e^(M_k - M) acc_k /
// sum_k e^(M_k - M) L_k, lse = M + log(sum); no row in any slice: o = 0, lse = -inf. Pitches as
// partial_kernel's.
__global__ void __launch_bounds__(kThreads) combine_kernel(float *olat, int o_pitch, float *lse, int l_pitch,
                                                           const float *ws, int splits, int R) {
    const size_t th = blockIdx.x, pitch = (size_t)R + 2;
    const float *p = ws + th * splits * pitch;
    float M = -INFINITY;
    for (int k = 0; k < splits; k++) M = fmaxf(M, p[k * pitch + R]);
    if (M == -INFINITY) {
        for (int r = threadIdx.x; r < R; r += kThreads) olat[th * o_pitch + r] = 0.0f;
        if (threadIdx.x == 0) lse[th * l_pitch] = -INFINITY;
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
        olat[th * o_pitch + r] = o * inv;
    }
    if (threadIdx.x == 0) lse[th * l_pitch] = M + logf(L);
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

// Token t of a step (sequence row_seq[t], position pos[t]) on DCP rank dr of D: its local slot
// when the rank holds it (pos % D == dr: block bt[seq, pos / 128] of 128 / D rows, row (pos % 128)
// / D, lunar_dcp_token) else -1, and how many of its sequence's rows up to pos the rank holds
// (positions dr, dr + D, .. <= pos: the causal count).
__global__ void step_rows_kernel(int32_t *slots, int32_t *count, const int32_t *row_seq, const int32_t *pos,
                                 const int32_t *bt, int max_blocks, int T, int D, int dr) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const int p = pos[t], br = 128 / D;
    slots[t] = p % D == dr ? bt[(size_t)row_seq[t] * max_blocks + p / 128] * br + p % 128 / D : -1;
    count[t] = p >= dr ? (p - dr) / D + 1 : 0;
}

// Element (t, h, i) of the DCP query rows [T, Hm, R + P]: q_lat's then q_pe's entries for the rank's
// nh heads, zeros for the group's padding heads (nh < Hm).
__global__ void pack_q_kernel(float *qsend, const float *q_lat, const float *q_pe, int T, int nh, int Hm, int R,
                              int P) {
    const size_t n = (size_t)T * Hm * (R + P);
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const int i = (int)(e % (R + P));
        const size_t th = e / (R + P);
        const int h = (int)(th % Hm), t = (int)(th / Hm);
        float v = 0.0f;
        if (h < nh) v = i < R ? q_lat[((size_t)t * nh + h) * R + i] : q_pe[((size_t)t * nh + h) * P + i - R];
        qsend[e] = v;
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

extern "C" size_t lunar_cuda_mla_partial_ws(int T, int H, int R, int splits) {
    return splits > 1 ? (size_t)T * H * splits * ((size_t)R + 2) * sizeof(float) : 0;
}

namespace {
// 8 warps while their accumulators fit the 48 KiB of static shared memory (R = 512: 16 KiB)
int partial_warps(int R) {
    int nw = 8;
    while (nw > 1 && ((size_t)nw * R + 2 * nw) * sizeof(float) > 48 * 1024) nw--;
    return nw;
}

// G groups x T tokens x H heads (x splits) over `src`, then the slices merged (splits > 1)
template <class Rows>
void partial_launch(float *olat, int o_pitch, float *lse, int l_pitch, const float *qlat, Rows src,
                    const int32_t *rows, const int32_t *count, int stride, int G, int T, int H, int R, int P,
                    float scale, int splits, void *ws, cudaStream_t st) {
    CUDA_REQUIRE(R > 0 && P >= 0 && ((size_t)R + 2) * sizeof(float) <= 48 * 1024 && splits >= 1 &&
                 (splits == 1 || ws));
    const int nw = partial_warps(R);
    const size_t pairs = (size_t)G * T * H;
    partial_kernel<Rows><<<(unsigned)(pairs * splits), (unsigned)(32 * nw), ((size_t)nw * R + 2 * nw) * sizeof(float),
                           st>>>(olat, o_pitch, lse, l_pitch, qlat, src, rows, count, stride, T, H, R, P, scale,
                                 splits, splits > 1 ? (float *)ws : nullptr);
    CUDA_CHECK_LAUNCH();
    if (splits == 1) return;
    combine_kernel<<<(unsigned)pairs, kThreads, 0, st>>>(olat, o_pitch, lse, l_pitch, (const float *)ws, splits, R);
    CUDA_CHECK_LAUNCH();
}
} // namespace

extern "C" void lunar_cuda_mla_partial_split(float *olat, float *lse, const float *qlat, const float *cache,
                                             const int32_t *rows, const int32_t *count, int stride, int T, int H,
                                             int R, int P, float scale, int splits, void *ws, lunar_cuda_stream s) {
    if (T <= 0 || H <= 0) return;
    partial_launch(olat, R, lse, 1, qlat, FlatRows{cache, R + P}, rows, count, stride, 1, T, H, R, P, scale, splits,
                   ws, to_stream(s));
}

extern "C" void lunar_cuda_dcp_partial_paged(float *out, const float *qall, const lunar_cuda_mla_cache *c,
                                             const int32_t *row_seq, const int32_t *rows, const int32_t *count,
                                             int stride, int G, int T, int H, int R, int P, int D, float scale,
                                             int splits, void *ws, lunar_cuda_stream s) {
    if (G <= 0 || T <= 0 || H <= 0) return;
    CUDA_REQUIRE(c && c->latent && c->block_tables && row_seq && D >= 1 && 128 % D == 0);
    const int br = 128 / D, ld = R + P;
    if (c->dtype == LUNAR_CUDA_KV_FP8)
        partial_launch(out, R + 1, out + R, R + 1, qall,
                       PagedRows<true>{c->latent, c->scale, c->block_tables, row_seq, c->max_blocks, br, ld}, rows,
                       count, stride, G, T, H, R, P, scale, splits, ws, to_stream(s));
    else
        partial_launch(out, R + 1, out + R, R + 1, qall,
                       PagedRows<false>{c->latent, 1.0f, c->block_tables, row_seq, c->max_blocks, br, ld}, rows,
                       count, stride, G, T, H, R, P, scale, splits, ws, to_stream(s));
}

extern "C" void lunar_cuda_dcp_step_rows(int32_t *slots, int32_t *count, const int32_t *row_seq, const int32_t *pos,
                                         const int32_t *bt, int max_blocks, int T, int D, int dr,
                                         lunar_cuda_stream s) {
    if (T <= 0) return;
    CUDA_REQUIRE(D >= 1 && 128 % D == 0 && dr >= 0 && dr < D);
    step_rows_kernel<<<ceil_div_u(T, 128), 128, 0, to_stream(s)>>>(slots, count, row_seq, pos, bt, max_blocks, T, D,
                                                                   dr);
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_dcp_pack_q(float *qsend, const float *q_lat, const float *q_pe, int T, int nh, int Hm,
                                      int R, int P, lunar_cuda_stream s) {
    if (T <= 0 || Hm <= 0) return;
    CUDA_REQUIRE(nh >= 1 && nh <= Hm);
    const size_t n = (size_t)T * Hm * (R + P);
    const unsigned blocks = (unsigned)(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096);
    pack_q_kernel<<<blocks, 256, 0, to_stream(s)>>>(qsend, q_lat, q_pe, T, nh, Hm, R, P);
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
