// MLA attention in the absorbed form over the paged latent cache (dense decode, causal prefill as
// rows with their own lengths, and DSA sparse decode over listed positions).
//
// Design (one kernel, three modes): a block serves one row (query token), a group of up to 48
// heads and one split of its positions. The latent is shared by every head, so the block streams
// each 32-row tile of the cache into shared memory once (cp.async, two stages; FP8 tiles are staged
// raw and widened to bf16 in shared memory, exactly) and all of its heads read it there.
// Heads go 16 to a "group" of 4 warps (the M = 16 of mma.sync m16n8k16, bf16 in, fp32 accumulate):
//  - S = q . c: warp w of a group multiplies over its quarter of the 576 dims (latent 128w..+128 and
//    rope 16w..+16, q fragments held in registers); the 4 partial S tiles are summed through shared
//    memory in a fixed order, so all 4 warps hold bitwise the same S and the same softmax state;
//  - online softmax in the log2 domain (fp32 running max and sum per head row);
//  - O += P c: warp w owns output dims 128w..+128 (64 fp32 accumulators per thread), P is rounded
//    to bf16 straight from the S accumulators (the FA2 register reuse).
// Long contexts are split over blocks (split-K); each split writes O / l and log2-sum-exp, and a
// merge kernel combines them. Accuracy: q and P are rounded to bf16 (8 significant bits), the cache
// is exact (bf16 or e4m3 widened to bf16), sums are fp32.
#include <cuda_fp8.h>
#include <math.h>

#include "backend/cuda/cuda_common.cuh"

namespace {

constexpr int kR = 512, kP = 64, kRow = 576;
constexpr int kTN = 32;          // positions per tile
constexpr int kSRow = kRow + 8;  // bf16 per shared tile row: 1168 B, fragment loads conflict-free
constexpr int kFRow = kRow + 16; // bytes per raw FP8 staging row
constexpr int kGMax = 3;         // head groups (16 heads, 128 threads) per block

struct MlaArgs {
    float *o, *o_part, *lse_part;
    const float *q_lat, *q_pe;
    const void *cache;
    const int32_t *bt;
    int max_blocks;
    const int32_t *row_seq, *lens, *idx;
    int topk, rows, H, chunk, splits;
    float scale2;    // softmax scale * kv scale * log2(e)
    float out_scale; // kv scale
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ uint32_t pack_u16(uint16_t lo, uint16_t hi) {
    return (uint32_t)lo | ((uint32_t)hi << 16);
}
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool ok) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int n = ok ? 16 : 0; // 0: zero-fill, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Position of entry i of this row (-1: none), i < end.
template <bool SPARSE>
__device__ __forceinline__ int entry_pos(const MlaArgs &a, int row, int i, int end) {
    if (i >= end) return -1;
    return SPARSE ? a.idx[(size_t)row * a.topk + i] : i;
}

template <bool FP8, bool SPARSE>
__global__ void __launch_bounds__(128 * kGMax, 1) mla_kernel(MlaArgs a) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int G = blockDim.x >> 7;
    const int split = blockIdx.x, row = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = warp >> 2, w = warp & 3, g = lane >> 2, t = lane & 3;
    const int head0 = (blockIdx.z * G + grp) * 16;
    const int seq = a.row_seq ? a.row_seq[row] : row;
    const int32_t *bt = a.bt + (size_t)seq * a.max_blocks;
    const int n = SPARSE ? a.topk : a.lens[row];
    const int begin = split * a.chunk;
    const int end = min(n, begin + a.chunk);
    const int ntiles = end > begin ? (end - begin + kTN - 1) / kTN : 0;

    // shared layout: bf16 tiles (2 stages, or 1 widened tile for FP8), raw FP8 stages, valid
    // flags [2][kTN], S partials [G][4 warps][16][32 lanes]
    uint16_t *tiles = reinterpret_cast<uint16_t *>(smem);
    const int n_bf = FP8 ? 1 : 2;
    unsigned char *raw = smem + (size_t)n_bf * kTN * kSRow * 2;
    int *valid = reinterpret_cast<int *>(raw + (FP8 ? 2 * kTN * kFRow : 0));
    float *spart = reinterpret_cast<float *>(valid + 2 * kTN);

    // Cache slot of row `lane` of the tile starting at t0 (-1: none): one block-table load per lane
    // (after an idx load when sparse), issued a tile ahead so its latency hides behind compute.
    auto row_slot = [&](int t0) -> long long {
        const int pos = entry_pos<SPARSE>(a, row, t0 + lane, end);
        return pos >= 0 ? (long long)bt[pos >> 7] * 128 + (pos & 127) : -1LL;
    };
    auto load_tile = [&](int stage, long long myslot) {
        constexpr int per_row = FP8 ? kRow / 16 : kRow * 2 / 16; // 16-byte chunks per row
        constexpr int total = kTN * per_row;
        for (int c0 = 0; c0 < total; c0 += blockDim.x) { // warp-uniform trip count (shuffle below)
            const int c = c0 + threadIdx.x;
            const int r = c / per_row, col = c - r * per_row;
            const long long slot = __shfl_sync(0xffffffffu, myslot, r & 31);
            if (c < total) {
                const bool ok = slot >= 0;
                const size_t sl = ok ? (size_t)slot : 0;
                if (col == 0) valid[stage * kTN + r] = ok;
                if (FP8) {
                    const unsigned char *src = (const unsigned char *)a.cache + sl * kRow + col * 16;
                    cp_async16(raw + (size_t)(stage * kTN + r) * kFRow + col * 16, src, ok);
                } else {
                    const uint16_t *src = (const uint16_t *)a.cache + sl * kRow + col * 8;
                    cp_async16(tiles + (size_t)(stage * kTN + r) * kSRow + col * 8, src, ok);
                }
            }
        }
    };

    // q fragments (A operand, rows = heads head0..+15, this warp's 144 of the 576 dims)
    uint32_t qf[9][4];
#pragma unroll
    for (int ks = 0; ks < 9; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int h = head0 + g + ((j & 1) ? 8 : 0), kk = 2 * t + ((j & 2) ? 8 : 0);
            float x0 = 0.0f, x1 = 0.0f;
            if (h < a.H) {
                const size_t qr = (size_t)row * a.H + h;
                const float *src = ks < 8 ? a.q_lat + qr * kR + 128 * w + 16 * ks + kk
                                          : a.q_pe + qr * kP + 16 * w + kk;
                x0 = src[0], x1 = src[1];
            }
            qf[ks][j] = pack_bf16(x0, x1);
        }

    float oacc[16][4];
#pragma unroll
    for (int i = 0; i < 16; i++) oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    long long slot_next = ntiles > 0 ? row_slot(begin) : -1;
    if (ntiles > 0) load_tile(0, slot_next);
    cp_commit();
    slot_next = ntiles > 1 ? row_slot(begin + kTN) : -1;
    for (int it = 0; it < ntiles; it++) {
        const int st = it & 1;
        cp_wait_all();
        __syncthreads();
        if (it + 1 < ntiles) load_tile(st ^ 1, slot_next);
        cp_commit();
        if (it + 2 < ntiles) slot_next = row_slot(begin + (it + 2) * kTN);
        const uint16_t *T;
        if (FP8) {
            // widen raw stage st to the bf16 tile: e4m3 -> half -> float -> bf16, all exact
            for (int c = threadIdx.x; c < kTN * kRow / 8; c += blockDim.x) {
                const int r = c / (kRow / 8), col = c - r * (kRow / 8);
                const uint2 v = *reinterpret_cast<const uint2 *>(raw + (size_t)(st * kTN + r) * kFRow + col * 8);
                const uint32_t wv[2] = {v.x, v.y};
                uint32_t o4[4];
#pragma unroll
                for (int k = 0; k < 2; k++) {
                    __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(wv[k] & 0xffff), __NV_E4M3);
                    __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(wv[k] >> 16), __NV_E4M3);
                    float2 flo = __half22float2(*reinterpret_cast<__half2 *>(&lo));
                    float2 fhi = __half22float2(*reinterpret_cast<__half2 *>(&hi));
                    o4[2 * k] = pack_bf16(flo.x, flo.y);
                    o4[2 * k + 1] = pack_bf16(fhi.x, fhi.y);
                }
                *reinterpret_cast<uint4 *>(tiles + (size_t)r * kSRow + col * 8) = make_uint4(o4[0], o4[1], o4[2], o4[3]);
            }
            __syncthreads();
            T = tiles;
        } else {
            T = tiles + (size_t)st * kTN * kSRow;
        }

        // partial S over this warp's dims
        float sacc[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.0f;
            const uint16_t *rp = T + (size_t)(nt * 8 + g) * kSRow + 2 * t;
#pragma unroll
            for (int ks = 0; ks < 9; ks++) {
                const int kb = ks < 8 ? 128 * w + 16 * ks : kR + 16 * w;
                const uint32_t b0 = *reinterpret_cast<const uint32_t *>(rp + kb);
                const uint32_t b1 = *reinterpret_cast<const uint32_t *>(rp + kb + 8);
                mma_bf16(sacc[nt], qf[ks], b0, b1);
            }
        }
        float *sp = spart + (size_t)((grp * 4 + w) * 16) * 32;
#pragma unroll
        for (int j = 0; j < 16; j++) sp[j * 32 + lane] = sacc[j >> 2][j & 3];
        __syncthreads();
        float s[4][4];
#pragma unroll
        for (int j = 0; j < 16; j++) {
            float v = 0.0f;
#pragma unroll
            for (int ww = 0; ww < 4; ww++) v += spart[(size_t)((grp * 4 + ww) * 16 + j) * 32 + lane];
            const int col = (j >> 2) * 8 + 2 * t + (j & 1);
            s[j >> 2][j & 3] = valid[st * kTN + col] ? v * a.scale2 : -INFINITY;
        }
        // online softmax: rows g (entries 0, 1) and g + 8 (entries 2, 3)
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
        const float al0 = exp2f(m0 - b0), al1 = exp2f(m1 - b1);
        m0 = mn0, m1 = mn1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            s[nt][0] = exp2f(s[nt][0] - b0), s[nt][1] = exp2f(s[nt][1] - b0);
            s[nt][2] = exp2f(s[nt][2] - b1), s[nt][3] = exp2f(s[nt][3] - b1);
            ps0 += s[nt][0] + s[nt][1], ps1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * al0 + ps0, l1 = l1 * al1 + ps1;
#pragma unroll
        for (int i = 0; i < 16; i++) oacc[i][0] *= al0, oacc[i][1] *= al0, oacc[i][2] *= al1, oacc[i][3] *= al1;
        // O += P . C[:, 128w .. +128]
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const uint32_t pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                                    pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const uint16_t *r0 = T + (size_t)(16 * kk + 2 * t) * kSRow + 128 * w + g;
#pragma unroll
            for (int dt = 0; dt < 16; dt++) {
                const uint16_t *p = r0 + dt * 8;
                const uint32_t bb0 = pack_u16(p[0], p[kSRow]);
                const uint32_t bb1 = pack_u16(p[8 * kSRow], p[9 * kSRow]);
                mma_bf16(oacc[dt], pa, bb0, bb1);
            }
        }
    }
    cp_wait_all();

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    const int ha = head0 + g, hb = head0 + g + 8;
    const bool direct = a.splits == 1;
    const float os = direct ? a.out_scale : 1.0f;
    float *base = direct ? a.o : a.o_part + (size_t)split * a.rows * a.H * kR;
#pragma unroll
    for (int dt = 0; dt < 16; dt++) {
        const int d = 128 * w + dt * 8 + 2 * t;
        if (ha < a.H)
            *reinterpret_cast<float2 *>(base + ((size_t)row * a.H + ha) * kR + d) =
                make_float2(oacc[dt][0] * inv0 * os, oacc[dt][1] * inv0 * os);
        if (hb < a.H)
            *reinterpret_cast<float2 *>(base + ((size_t)row * a.H + hb) * kR + d) =
                make_float2(oacc[dt][2] * inv1 * os, oacc[dt][3] * inv1 * os);
    }
    if (!direct && w == 0 && t == 0) {
        float *lse = a.lse_part + (size_t)split * a.rows * a.H + (size_t)row * a.H;
        if (ha < a.H) lse[ha] = l0 > 0.0f ? m0 + log2f(l0) : -INFINITY;
        if (hb < a.H) lse[hb] = l1 > 0.0f ? m1 + log2f(l1) : -INFINITY;
    }
}

// o[row, h] = sum_s 2^(lse_s - M) O_s / sum_s 2^(lse_s - M); no valid split: 0.
__global__ void mla_merge_kernel(float *o, const float *o_part, const float *lse, int RH, int splits,
                                 float out_scale) {
    const int rh = blockIdx.x, d = threadIdx.x * 4;
    float M = -INFINITY;
    for (int s = 0; s < splits; s++) M = fmaxf(M, lse[(size_t)s * RH + rh]);
    float4 acc = make_float4(0, 0, 0, 0);
    float wsum = 0.0f;
    if (M != -INFINITY)
        for (int s = 0; s < splits; s++) {
            const float l = lse[(size_t)s * RH + rh];
            if (l == -INFINITY) continue;
            const float wt = exp2f(l - M);
            const float4 v = *reinterpret_cast<const float4 *>(o_part + ((size_t)s * RH + rh) * kR + d);
            wsum += wt;
            acc.x += wt * v.x, acc.y += wt * v.y, acc.z += wt * v.z, acc.w += wt * v.w;
        }
    const float f = wsum > 0.0f ? out_scale / wsum : 0.0f;
    *reinterpret_cast<float4 *>(o + (size_t)rh * kR + d) = make_float4(acc.x * f, acc.y * f, acc.z * f, acc.w * f);
}

int sm_count() {
    static int n = 0;
    if (!n) {
        int dev = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    }
    return n;
}

struct Plan {
    int groups, head_blocks, splits, chunk;
};
Plan plan(int rows, int H, int max_n) {
    Plan p;
    const int hg = (H + 15) / 16;
    p.head_blocks = (hg + kGMax - 1) / kGMax;
    p.groups = (hg + p.head_blocks - 1) / p.head_blocks;
    const int base = rows * p.head_blocks;
    int want = (2 * sm_count() + base - 1) / base;
    const int most = (max_n + 255) / 256; // at least 256 positions per split
    int s = want < most ? want : most;
    if (s < 1) s = 1;
    const int per = max_n > 0 ? (max_n + s - 1) / s : 1;
    p.chunk = (per + kTN - 1) / kTN * kTN;
    p.splits = max_n > 0 ? (max_n + p.chunk - 1) / p.chunk : 1;
    return p;
}

size_t smem_bytes(bool fp8, int groups) {
    return (size_t)(fp8 ? 1 : 2) * kTN * kSRow * 2 + (fp8 ? 2 * kTN * kFRow : 0) + 2 * kTN * 4 +
           (size_t)groups * 4 * 16 * 32 * 4;
}

template <bool FP8, bool SPARSE> void launch(const MlaArgs &a, const Plan &p, cudaStream_t s) {
    static bool attr = false;
    const size_t sm = smem_bytes(FP8, kGMax);
    if (!attr) {
        CUDA_CHECK(cudaFuncSetAttribute(mla_kernel<FP8, SPARSE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
        attr = true;
    }
    dim3 grid(p.splits, a.rows, p.head_blocks);
    mla_kernel<FP8, SPARSE><<<grid, 128 * p.groups, smem_bytes(FP8, p.groups), s>>>(a);
    CUDA_CHECK_LAUNCH();
}

void run(float *o, const float *q_lat, const float *q_pe, const lunar_cuda_mla_cache *c,
         const int32_t *row_seq, const int32_t *lens, const int32_t *idx, int topk, int max_n,
         int rows, int H, float scale, void *ws, cudaStream_t s) {
    CUDA_REQUIRE(rows >= 1 && H >= 1 && c && c->latent && c->block_tables);
    const Plan p = plan(rows, H, max_n);
    MlaArgs a;
    a.o = o;
    a.q_lat = q_lat, a.q_pe = q_pe, a.cache = c->latent, a.bt = c->block_tables;
    a.max_blocks = c->max_blocks, a.row_seq = row_seq, a.lens = lens, a.idx = idx, a.topk = topk;
    a.rows = rows, a.H = H, a.chunk = p.chunk, a.splits = p.splits;
    const float kv = c->dtype == LUNAR_CUDA_KV_FP8 ? c->scale : 1.0f;
    a.scale2 = scale * kv * 1.4426950408889634f;
    a.out_scale = kv;
    a.o_part = (float *)ws;
    a.lse_part = (float *)ws + (size_t)p.splits * rows * H * kR;
    if (p.splits > 1) CUDA_REQUIRE(ws != NULL);
    const bool fp8 = c->dtype == LUNAR_CUDA_KV_FP8, sparse = idx != NULL;
    if (fp8 && sparse) launch<true, true>(a, p, s);
    else if (fp8) launch<true, false>(a, p, s);
    else if (sparse) launch<false, true>(a, p, s);
    else launch<false, false>(a, p, s);
    if (p.splits > 1) {
        mla_merge_kernel<<<rows * H, kR / 4, 0, s>>>(o, a.o_part, a.lse_part, rows * H, p.splits, a.out_scale);
        CUDA_CHECK_LAUNCH();
    }
}

} // namespace

extern "C" size_t lunar_cuda_mla_ws(int rows, int H, int max_n) {
    const Plan p = plan(rows, H, max_n);
    return p.splits > 1 ? (size_t)p.splits * rows * H * (kR + 1) * sizeof(float) : 0;
}

extern "C" void lunar_cuda_mla_absorbed(float *o_lat, const float *q_lat, const float *q_pe,
                                        const lunar_cuda_mla_cache *c, const int32_t *row_seq,
                                        const int32_t *lens, int max_len, int rows, int H,
                                        float scale, void *ws, lunar_cuda_stream s) {
    run(o_lat, q_lat, q_pe, c, row_seq, lens, NULL, 0, max_len, rows, H, scale, ws, to_stream(s));
}

extern "C" void lunar_cuda_mla_sparse(float *o_lat, const float *q_lat, const float *q_pe,
                                      const lunar_cuda_mla_cache *c, const int32_t *row_seq,
                                      const int32_t *idx, int topk, int rows, int H, float scale,
                                      void *ws, lunar_cuda_stream s) {
    CUDA_REQUIRE(idx != NULL && topk >= 1);
    run(o_lat, q_lat, q_pe, c, row_seq, NULL, idx, topk, topk, rows, H, scale, ws, to_stream(s));
}
