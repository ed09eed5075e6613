// MLA prefill of one sequence in the absorbed form as two GEMMs per query chunk (R = 512, P = 64).
// Since cuda_mla_flash.cu (the decompressed form, 3.4x fewer flops) this is the forward's prefill
// only with LUNAR_MLA_PREFILL=absorbed.
// Why: the absorbed attention kernel (cuda_mla.cu) serves a prefill with one block per query row,
// so each of the n rows streams its whole prefix of the latent cache through shared memory (at 8K
// tokens, ~77 GB of L2/HBM traffic per layer, 71 % of Kimi-Linear's prefill). In the absorbed form
// every head shares the key/value rows (the latent [c | k_pe]), so the scores of all the (token,
// head) rows of a chunk are ONE GEMM against the gathered latent, and the output one more:
//   S[t*H + h, j] = [q_lat | q_pe][t, h] . [c | k_pe][j]       (cuBLASLt, bf16 in, fp32 out)
//   P = causal softmax(scale S) per row (fp32, stored bf16, normalized)
//   o_lat[t*H + h] = P[t*H + h] . c                             (cuBLASLt against c transposed)
// A chunk of query tokens only reads the positions its last token sees (rounded up to 256), so the
// causal half is skipped chunk by chunk. Roundings: q, the latent (already bf16 in the cache) and
// P are bf16 operands, sums are fp32, as the kernel's.
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_glue.h"

namespace {
constexpr int kR = 512, kP = 64, kRow = kR + kP, kAlign = 256;
constexpr size_t kChunkBudget = (size_t)256 << 20; // S (fp32) + P (bf16) of one query chunk

size_t up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// C[j] = latent row of position j (page bt[j / page], slot j % page), zero rows for j >= L; FP8
// pages are widened here (e4m3 -> bf16 is exact), so the GEMMs below read the same values
template <bool FP8>
__global__ void k_gather(uint16_t *C, const void *latent, const int32_t *bt, int L, int page) {
    const int j = blockIdx.x;
    uint16_t *dst = C + (size_t)j * kRow;
    if (j >= L) {
        for (int d = threadIdx.x; d < kRow; d += blockDim.x) dst[d] = 0;
        return;
    }
    const size_t slot = (size_t)bt[j / page] * page + j % page;
    for (int d = threadIdx.x; d < kRow; d += blockDim.x) {
        if (FP8) {
            __nv_bfloat16 b = __float2bfloat16_rn(e4m3_to_f32(((const uint8_t *)latent)[slot * kRow + d]));
            dst[d] = *(uint16_t *)&b;
        } else {
            dst[d] = ((const uint16_t *)latent)[slot * kRow + d];
        }
    }
}

// Ct[d, j] = C[j, d] for d < 512, j < N (32 x 32 tiles through shared memory)
__global__ void k_transpose(uint16_t *Ct, const uint16_t *C, int N) {
    __shared__ uint16_t t[32][33];
    const int j0 = blockIdx.x * 32, d0 = blockIdx.y * 32;
    for (int i = threadIdx.y; i < 32; i += blockDim.y)
        t[i][threadIdx.x] = C[(size_t)(j0 + i) * kRow + d0 + threadIdx.x];
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y)
        Ct[(size_t)(d0 + i) * N + j0 + threadIdx.x] = t[threadIdx.x][i];
}

// Q[r] = bf16([q_lat[r] | q_pe[r]])
__global__ void k_pack_q(uint16_t *Q, const float *q_lat, const float *q_pe) {
    const size_t r = blockIdx.x;
    for (int d = threadIdx.x; d < kRow; d += blockDim.x) {
        const float v = d < kR ? q_lat[r * kR + d] : q_pe[r * kP + d - kR];
        __nv_bfloat16 b = __float2bfloat16_rn(v);
        Q[r * kRow + d] = *(uint16_t *)&b;
    }
}

__device__ float block_reduce(float v, float *red, bool is_max) {
    for (int o = 16; o; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (!lane) red[warp] = v;
    __syncthreads();
    v = red[0];
    for (int i = 1; i < nw; i++) v = is_max ? fmaxf(v, red[i]) : v + red[i];
    return v;
}

// row r (token t0 + r / H of the chunk) sees positions j < see0 + r / H; P[r, j] = softmax, 0 beyond
__global__ void k_softmax(uint16_t *Pm, const float *S, int N, int H, int see0, float scale) {
    __shared__ float red[32];
    const size_t r = blockIdx.x;
    const int see = see0 + (int)(r / H);
    const float *s = S + r * N;
    uint16_t *p = Pm + r * N;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < see; j += blockDim.x) m = fmaxf(m, s[j]);
    m = block_reduce(m, red, true);
    float sum = 0.f;
    for (int j = threadIdx.x; j < see; j += blockDim.x) sum += expf((s[j] - m) * scale);
    sum = block_reduce(sum, red, false);
    const float inv = 1.0f / sum;
    for (int j = threadIdx.x; j < N; j += blockDim.x) {
        __nv_bfloat16 b = __float2bfloat16_rn(j < see ? expf((s[j] - m) * scale) * inv : 0.0f);
        p[j] = *(uint16_t *)&b;
    }
}

struct Layout {
    size_t Lpad, tc, c_off, ct_off, q_off, s_off, p_off, bytes;
};

Layout layout(int n, int H, int L) {
    Layout a;
    a.Lpad = up((size_t)L, kAlign);
    size_t tc = kChunkBudget / ((size_t)H * a.Lpad * 6);
    /* LUNAR_MLA_PREFILL_CHUNK=t: chunks of t tokens (tests: several chunks on small models) */
    static long forced = -1;
    if (forced < 0) forced = getenv("LUNAR_MLA_PREFILL_CHUNK") ? atol(getenv("LUNAR_MLA_PREFILL_CHUNK")) : 0;
    if (forced > 0 && (size_t)forced < tc) tc = (size_t)forced;
    a.tc = tc < 1 ? 1 : tc > (size_t)n ? (size_t)n : tc;
    const size_t M = a.tc * H;
    a.c_off = 0;
    a.ct_off = up(a.c_off + a.Lpad * kRow * 2, kAlign);
    a.q_off = up(a.ct_off + (size_t)kR * a.Lpad * 2, kAlign);
    a.s_off = up(a.q_off + (size_t)n * H * kRow * 2, kAlign);
    a.p_off = up(a.s_off + M * a.Lpad * 4, kAlign);
    a.bytes = a.p_off + M * a.Lpad * 2;
    return a;
}
} // namespace

extern "C" size_t lunar_glue_mla_prefill_ws(int n, int H, int L) { return layout(n, H, L).bytes; }

extern "C" void lunar_glue_mla_prefill(float *o_lat, const float *q_lat, const float *q_pe, const void *latent,
                                       int fp8, const int32_t *bt, int page, int pos0, int n, int H, float scale, void *ws,
                                       lunar_cuda_stream s) {
    CUDA_REQUIRE(n >= 1 && H >= 1 && pos0 >= 0 && ws != NULL);
    const int L = pos0 + n;
    const Layout a = layout(n, H, L);
    unsigned char *w = (unsigned char *)ws;
    uint16_t *C = (uint16_t *)(w + a.c_off), *Ct = (uint16_t *)(w + a.ct_off), *Q = (uint16_t *)(w + a.q_off);
    float *S = (float *)(w + a.s_off);
    uint16_t *Pm = (uint16_t *)(w + a.p_off);
    cudaStream_t st = to_stream(s);
    if (fp8) k_gather<true><<<(unsigned)a.Lpad, 128, 0, st>>>(C, latent, bt, L, page);
    else k_gather<false><<<(unsigned)a.Lpad, 128, 0, st>>>(C, latent, bt, L, page);
    CUDA_CHECK_LAUNCH();
    k_pack_q<<<(unsigned)((size_t)n * H), 128, 0, st>>>(Q, q_lat, q_pe);
    CUDA_CHECK_LAUNCH();
    for (int t0 = 0; t0 < n; t0 += (int)a.tc) {
        const int tc = n - t0 < (int)a.tc ? n - t0 : (int)a.tc, M = tc * H;
        const int N = (int)up((size_t)(pos0 + t0 + tc), kAlign); // positions this chunk's last token sees, padded
        k_transpose<<<dim3(N / 32, kR / 32), dim3(32, 8), 0, st>>>(Ct, C, N);
        CUDA_CHECK_LAUNCH();
        lunar_cuda_matmul(S, LUNAR_CUDA_F32, Q + (size_t)t0 * H * kRow, C, M, N, kRow, s);
        k_softmax<<<M, 256, 0, st>>>(Pm, S, N, H, pos0 + t0 + 1, scale);
        CUDA_CHECK_LAUNCH();
        lunar_cuda_matmul(o_lat + (size_t)t0 * H * kR, LUNAR_CUDA_F32, Pm, Ct, M, kR, N, s);
    }
}
