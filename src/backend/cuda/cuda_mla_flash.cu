// MLA prefill of one sequence in the DECOMPRESSED form: a causal flash-attention forward over
// k = [W_UK c | k_pe] (192) and v = W_UV c (128), per head.
// Why: the absorbed form (cuda_mla_prefill.cu) costs 2 * (576 + 512) flops per (query, head, key)
// because every head's query is lifted into the 512-wide latent; decompressed it costs
// 2 * (192 + 128), 3.4x fewer, plus one GEMM per layer that lifts the L latent rows to the
// per-head keys and values (2 * 512 * 256 * H flops per position, small next to the attention at
// prefill lengths), and the absorption of q and un-absorption of o disappear.
//
// Steps per key chunk [k0, k1) (the whole sequence unless it is long: the lifted K/V take
// H * 512 bytes per position, so they are built at most kKvBudget at a time):
//   gather:  Clat[j] = c of position k0 + j, Kpe[j] = k_pe (bf16; FP8 pages widened exactly)
//   lift:    KV[j, h*256 + (0..127)] = W_UK,h c_j, KV[j, h*256 + 128 + (0..127)] = W_UV,h c_j
//            (cuBLASLt, bf16 out: the attention's operands are bf16 anyway)
//   flash:   per (query tile, head), online softmax in fp32 over the key tiles of the chunk
//            that the tile's last query sees; the state (unnormalised o, row max, row sum)
//            crosses chunks through o and a small fp32 array. Default: the wgmma kernel of
//            cuda_mla_flash_wg.cu (128 queries x 128 keys, TMA, P in registers); the mma.sync
//            kernel k_flash below (64 queries x 64 keys) by LUNAR_MLA_FLASH=mma, and where no
//            tensor map can be made.
// Roundings: q, k, v and the probabilities P are bf16 operands of mma.sync m16n8k16, sums fp32.
// Measured (H200, bench_mla prefill, docs/benchmarks.md "MLA flash prefill on wgmma"): 8K tokens x 32
// heads 1.34 ms with the wgmma kernel (558 TFLOP/s of attention flops, 63 % of the 888 of a cuBLAS bf16
// GEMM timed in the same run; 16K-32K: 605-629, 68-71 %) against k_flash's 5.58 ms (126 TFLOP/s) and
// the absorbed form's 11.0 ms. k_flash: 8 warps per block measured the same as 4; 3 stages 1.6x
// SLOWER than 2 (not understood): both selectable (LUNAR_MLA_FLASH_WARPS, LUNAR_MLA_FLASH_STAGES).
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_glue.h"
#include "backend/cuda/cuda_mla_flash_wg.h"

#include <string.h>

namespace {
constexpr int kR = 512, kP = 64, kN = 128, kV = 128, kQK = kN + kP, kHS = kN + kV; // kHS: a head's KV row
constexpr int BN = 64; // keys per tile
// chunks and their padded rows: whole tiles of both kernels (cuda_mla_flash_wg.cu's are 128 keys)
constexpr int kAlign = 128;
// smem rows padded by 16 bytes: rows 400 / 272 bytes apart put the 8 rows of an ldmatrix phase in
// 8 different 4-bank groups (conflict-free)
constexpr int KST = kQK + 8, VST = kV + 8;
constexpr int STAGE = BN * (KST + VST); // bf16 elements per stage (43008 bytes)
constexpr size_t kKvBudget = (size_t)256 << 20;
constexpr int kWarps = 4, kStages = 2; // the default variant (measured: docs/benchmarks.md)
// cuda_mla_flash_wg.cu by default: 4.2-4.6x k_flash from 8K tokens, 2.4x at 1K, the same errors
// (docs/benchmarks.md); its producer / consumer variant by default too (session 6, H200: 1.13-1.16x
// the plain wgmma kernel from 8K tokens, equal at 1K, the same errors); LUNAR_MLA_FLASH=mma|wgmma|
// wgmma_pp overrides
constexpr bool kWgmmaDefault = true, kPpDefault = true;

size_t up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// key positions per chunk: a multiple of kAlign whose lifted K/V fit kKvBudget (or the caller's kc)
int chunk_keys(int H, int L, int kc) {
    size_t c = kc > 0 ? (size_t)kc : kKvBudget / ((size_t)H * kHS * 2);
    c = c / kAlign * kAlign;
    if (c < (size_t)kAlign) c = kAlign;
    const size_t Lp = up((size_t)L, kAlign);
    return (int)(c < Lp ? c : Lp);
}

struct Layout {
    size_t kc, clat, kpe, kv, ml, bytes;
};
Layout layout(int n, int H, int L, int kc) {
    Layout a;
    a.kc = (size_t)chunk_keys(H, L, kc);
    a.clat = 0;
    a.kpe = up(a.clat + a.kc * kR * 2, 256);
    a.kv = up(a.kpe + a.kc * kP * 2, 256);
    a.ml = up(a.kv + a.kc * (size_t)H * kHS * 2, 256);
    a.bytes = a.ml + (size_t)n * H * 2 * 4; // (row max, row sum) per (query, head) between chunks
    return a;
}

// rows j < cnt of Clat / Kpe = positions k0 + j of the sequence (page bt[pos / page]); rows
// cnt..rows-1 zero (the pad to a whole key tile: zero keys and values, masked anyway, never NaN)
template <bool FP8>
__global__ void k_gather(uint16_t *Clat, uint16_t *Kpe, const void *latent, const int32_t *bt, int k0, int cnt,
                         int page) {
    const int j = blockIdx.x;
    uint16_t *dc = Clat + (size_t)j * kR, *dp = Kpe + (size_t)j * kP;
    if (j >= cnt) {
        for (int d = threadIdx.x; d < kR + kP; d += blockDim.x) (d < kR ? dc[d] : dp[d - kR]) = 0;
        return;
    }
    const int pos = k0 + j;
    const size_t slot = (size_t)bt[pos / page] * page + pos % page;
    if (FP8) {
        const uint8_t *src = (const uint8_t *)latent + slot * (kR + kP);
        for (int d = threadIdx.x; d < kR + kP; d += blockDim.x) {
            __nv_bfloat16 b = __float2bfloat16_rn(e4m3_to_f32(src[d]));
            (d < kR ? dc[d] : dp[d - kR]) = *(uint16_t *)&b;
        }
    } else { // 72 16-byte pieces per row: 64 of c, 8 of k_pe
        const uint4 *src = (const uint4 *)((const uint16_t *)latent + slot * (kR + kP));
        for (int d = threadIdx.x; d < (kR + kP) / 8; d += blockDim.x) {
            const uint4 v = src[d];
            if (d < kR / 8) ((uint4 *)dc)[d] = v;
            else ((uint4 *)dp)[d - kR / 8] = v;
        }
    }
}

__device__ __forceinline__ void cp16(void *dst, const void *src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(unsigned &r0, unsigned &r1, unsigned &r2, unsigned &r3, const void *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned &r0, unsigned &r1, unsigned &r2, unsigned &r3, const void *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); // .x (the lower column) in the low half
    return *(unsigned *)&v;
}

// One block: WARPS * 16 query rows (16 per warp) of head blockIdx.y against the keys [k0, k1) of
// the chunk that its last row sees, through a ring of STAGES key tiles. More warps per block: each
// key tile fetched from L2 serves more rows (the L2 -> SM traffic is the kernel's largest cost). KV / Kpe row r is position k0 + r. Thread (g =
// lane / 4, t = lane % 4) owns rows g and g + 8 of its warp's 16 and, in every 8-wide accumulator
// tile, columns 2t and 2t + 1 (the mma.sync C layout).
template <int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, WARPS == 4 ? 2 : 1)
    k_flash(float *o, float *ml, const float *q, const uint16_t *KV, const uint16_t *Kpe, int k0, int k1, int pos0,
            int n, int H, float sl, int first, int last) {
    constexpr int BM = WARPS * 16, THREADS = WARPS * 32;
    extern __shared__ __align__(16) uint16_t sm[];
    const int tiles = (n + BM - 1) / BM;
    const int i0 = (tiles - 1 - (int)blockIdx.x) * BM; // the longest rows first (causal imbalance)
    const int h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int qlo = pos0 + i0;                            // the tile's first query position
    const int kend = min(k1, qlo + BM);                   // keys past the tile's last position: none
    const int nkt = kend > k0 ? (kend - k0 + BN - 1) / BN : 0;
    const size_t kvld = (size_t)H * kHS;

    // the warp's 16 query rows as A fragments, 12 k-steps of 16 (bf16 from q's fp32; rows >= n zero)
    unsigned qa[kQK / 16][4];
    const int ra = i0 + warp * 16 + g, rb = ra + 8;
#pragma unroll
    for (int kk = 0; kk < kQK / 16; kk++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = (e & 1) ? rb : ra, d = kk * 16 + (e >> 1) * 8 + 2 * t;
            float2 v = make_float2(0.f, 0.f);
            if (r < n) v = *(const float2 *)(q + ((size_t)r * H + h) * kQK + d);
            qa[kk][e] = pack_bf16(v.x, v.y);
        }
    }
    float acc[kV / 8][4];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    if (first) {
#pragma unroll
        for (int nt = 0; nt < kV / 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    } else { // the state left by the previous chunk (l: one thread of the four holds the row's sum)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int r = hr ? rb : ra;
            if (r < n) {
                m[hr] = ml[((size_t)r * H + h) * 2];
                l[hr] = t == 0 ? ml[((size_t)r * H + h) * 2 + 1] : 0.f;
            }
#pragma unroll
            for (int nt = 0; nt < kV / 8; nt++) {
                float2 v = make_float2(0.f, 0.f);
                if (r < n) v = *(const float2 *)(o + ((size_t)r * H + h) * kV + nt * 8 + 2 * t);
                acc[nt][hr * 2] = v.x, acc[nt][hr * 2 + 1] = v.y;
            }
        }
    }

    auto load = [&](int stage, int kt) {
        uint16_t *Ks = sm + stage * STAGE, *Vs = Ks + BN * KST;
        const size_t r0 = (size_t)(kt * BN);
        for (int x = tid; x < BN * 40; x += THREADS) { // per key row: 16 pieces of k_nope, 8 of k_pe, 16 of v
            const int j = x / 40, c = x % 40;
            const size_t row = r0 + j;
            if (c < 16) cp16(Ks + j * KST + c * 8, KV + row * kvld + (size_t)h * kHS + c * 8);
            else if (c < 24) cp16(Ks + j * KST + kN + (c - 16) * 8, Kpe + row * kP + (c - 16) * 8);
            else cp16(Vs + j * VST + (c - 24) * 8, KV + row * kvld + (size_t)h * kHS + kN + (c - 24) * 8);
        }
    };

    // one commit group per tile slot, empty past the last tile, so "tile kt landed" is always
    // "at most STAGES - 2 groups pending"
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
        if (st < nkt) load(st, st);
        cp_commit();
    }
    for (int kt = 0; kt < nkt; kt++) {
        cp_wait<STAGES - 2>();
        __syncthreads(); // tile kt landed for everyone; everyone is done with tile kt - 1's stage
        if (kt + STAGES - 1 < nkt) load((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        cp_commit();
        const uint16_t *Ks = sm + (kt % STAGES) * STAGE, *Vs = Ks + BN * KST;

        float s[BN / 8][4];
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        const int mi = lane >> 3, mr = lane & 7; // ldmatrix: this lane's address is row mr of matrix mi
#pragma unroll
        for (int kk = 0; kk < kQK / 16; kk++) {
#pragma unroll
            for (int np = 0; np < BN / 16; np++) { // matrices: (keys +0, dims +0), (+0, +8), (+8, +0), (+8, +8)
                unsigned b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3, Ks + (np * 16 + (mi >> 1) * 8 + mr) * KST + kk * 16 + (mi & 1) * 8);
                mma_bf16(s[2 * np], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
                mma_bf16(s[2 * np + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b2, b3);
            }
        }
        const int kb = k0 + kt * BN; // the tile's first key position
        if (kb + BN - 1 > qlo) {     // the diagonal (or the pad past L) crosses this tile
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = kb + nt * 8 + 2 * t + (e & 1), pos = pos0 + ((e >> 1) ? rb : ra);
                    if (key > pos) s[nt][e] = -INFINITY;
                }
        }
        // online softmax in the log2 domain (sl = scale * log2 e)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt++) mx = fmaxf(mx, fmaxf(s[nt][hr * 2], s[nt][hr * 2 + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[hr], mx * sl);
            const float base = mn == -INFINITY ? 0.f : mn; // a row with nothing seen yet: no inf - inf
            const float alpha = exp2f(m[hr] - base);
            m[hr] = mn;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt++) {
                const float p0 = exp2f(s[nt][hr * 2] * sl - base), p1 = exp2f(s[nt][hr * 2 + 1] * sl - base);
                s[nt][hr * 2] = p0, s[nt][hr * 2 + 1] = p1;
                sum += p0 + p1;
            }
            l[hr] = l[hr] * alpha + sum;
#pragma unroll
            for (int nt = 0; nt < kV / 8; nt++) acc[nt][hr * 2] *= alpha, acc[nt][hr * 2 + 1] *= alpha;
        }
        // acc += P . V: the S accumulators of key tiles 2j, 2j+1 are the A fragment of keys 16j..16j+15
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            const unsigned a0 = pack_bf16(s[2 * kk][0], s[2 * kk][1]), a1 = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            const unsigned a2 = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const unsigned a3 = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int vp = 0; vp < kV / 16; vp++) { // transposed: (keys +0, cols +0), (+8, +0), (+0, +8), (+8, +8)
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, Vs + (kk * 16 + (mi & 1) * 8 + mr) * VST + vp * 16 + (mi >> 1) * 8);
                mma_bf16(acc[2 * vp], a0, a1, a2, a3, b0, b1);
                mma_bf16(acc[2 * vp + 1], a0, a1, a2, a3, b2, b3);
            }
        }
    }

#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
        const int r = hr ? rb : ra;
        if (r >= n) continue;
        const float inv = last ? 1.0f / l[hr] : 1.0f;
#pragma unroll
        for (int nt = 0; nt < kV / 8; nt++)
            *(float2 *)(o + ((size_t)r * H + h) * kV + nt * 8 + 2 * t) =
                make_float2(acc[nt][hr * 2] * inv, acc[nt][hr * 2 + 1] * inv);
        if (!last && t == 0) ml[((size_t)r * H + h) * 2] = m[hr], ml[((size_t)r * H + h) * 2 + 1] = l[hr];
    }
}
} // namespace

extern "C" size_t lunar_glue_mla_flash_ws(int n, int H, int L, int kc) { return layout(n, H, L, kc).bytes; }

extern "C" void lunar_glue_mla_flash(float *o, const float *q, const uint16_t *W, const void *latent, int fp8,
                                     const int32_t *bt, int page, int pos0, int n, int H, float scale, int kc, void *ws,
                                     lunar_cuda_stream s) {
    CUDA_REQUIRE(n >= 1 && H >= 1 && pos0 >= 0 && ws != NULL);
    const int L = pos0 + n;
    const Layout a = layout(n, H, L, kc);
    unsigned char *w = (unsigned char *)ws;
    uint16_t *Clat = (uint16_t *)(w + a.clat), *Kpe = (uint16_t *)(w + a.kpe), *KV = (uint16_t *)(w + a.kv);
    float *ml = (float *)(w + a.ml);
    cudaStream_t st = to_stream(s);
    /* LUNAR_MLA_FLASH_WARPS=4|8 (query rows per block / 16), LUNAR_MLA_FLASH_STAGES=2|3: the
     * variants bench_mla compares */
    const char *ew = getenv("LUNAR_MLA_FLASH_WARPS"), *es = getenv("LUNAR_MLA_FLASH_STAGES");
    const int warps = ew && atoi(ew) == 4 ? 4 : kWarps, stages = es && atoi(es) == 3 ? 3 : es ? 2 : kStages;
    void (*kern)(float *, float *, const float *, const uint16_t *, const uint16_t *, int, int, int, int, int, float,
                 int, int) = warps == 4 ? (stages == 3 ? k_flash<4, 3> : k_flash<4, 2>)
                                        : (stages == 3 ? k_flash<8, 3> : k_flash<8, 2>);
    const int smem = stages * STAGE * 2;
    // per call, not once: the attribute is per device and TP ranks share this code on several
    CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const float sl = scale * 1.4426950408889634f;
    const int kc_ = (int)a.kc, bm = warps * 16, tiles = (n + bm - 1) / bm;
    /* LUNAR_MLA_FLASH=mma: the mma.sync kernel k_flash; wgmma: cuda_mla_flash_wg.cu's; wgmma_pp: its
     * producer / consumer variant (the default) */
    const char *ek = getenv("LUNAR_MLA_FLASH");
    const bool pp = ek ? !strcmp(ek, "wgmma_pp") : kPpDefault, wg = ek ? !strcmp(ek, "wgmma") || pp : kWgmmaDefault;
    CUDA_REQUIRE(kAlign % lunar_mla_flash_wg_tile() == 0);
    for (int k0 = 0; k0 < L; k0 += kc_) {
        const int cnt = L - k0 < kc_ ? L - k0 : kc_, rows = (int)up((size_t)cnt, kAlign);
        if (fp8) k_gather<true><<<rows, 128, 0, st>>>(Clat, Kpe, latent, bt, k0, cnt, page);
        else k_gather<false><<<rows, 128, 0, st>>>(Clat, Kpe, latent, bt, k0, cnt, page);
        CUDA_CHECK_LAUNCH();
        lunar_cuda_matmul(KV, LUNAR_CUDA_BF16, Clat, W, rows, H * kHS, kR, s);
        if (wg && lunar_mla_flash_wg(o, ml, q, KV, Kpe, rows, k0, k0 + rows, pos0, n, H, sl, k0 == 0, k0 + kc_ >= L, pp, st))
            continue;
        kern<<<dim3((unsigned)tiles, (unsigned)H), warps * 32, smem, st>>>(o, ml, q, KV, Kpe, k0, k0 + rows, pos0, n, H,
                                                                           sl, k0 == 0, k0 + kc_ >= L);
        CUDA_CHECK_LAUNCH();
    }
}
