// Internal to the MoE kernels (cuda_moe.cu: router, permutation, decode kernels, the mma.sync
// grouped GEMM; cuda_moe_wg.cu: the wgmma grouped GEMM): the bf16/MXFP4 widening helpers, the
// GLU activation and the expert kernels' argument block. The MXFP4 widening is explained at the
// top of cuda_moe.cu.
#ifndef LUNAR_BACKEND_CUDA_MOE_CUH
#define LUNAR_BACKEND_CUDA_MOE_CUH

#include "backend/cuda/cuda_common.cuh"

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
    __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162 *>(&a),
                               *reinterpret_cast<__nv_bfloat162 *>(&b));
    return *reinterpret_cast<uint32_t *>(&r);
}

// 8 bf16 (one uint4, columns x0..x7) -> the pairs P0..P3.
__device__ __forceinline__ void pairs_bf16(uint4 u, uint32_t *p) {
    p[0] = prmt(u.y, u.w, 0x7632);
    p[1] = prmt(u.y, u.w, 0x5410);
    p[2] = prmt(u.x, u.z, 0x7632);
    p[3] = prmt(u.x, u.z, 0x5410);
}

// E8M0 scale byte -> the bf16x2 multipliers: m1 = 2^(s-1) (s <= 128) or 2^127, m2 = 2^(s-128)
// (used only when s > 128).
struct mxscale {
    uint32_t m1, m2;
    bool two;
};
__device__ __forceinline__ mxscale mx_scale(uint32_t s) {
    mxscale r;
    r.two = s > 128;
    uint32_t e1 = r.two ? 254u : s + 126u;
    r.m1 = (e1 << 7) | (e1 << 23);
    uint32_t e2 = r.two ? s - 1u : 127u;
    r.m2 = (e2 << 7) | (e2 << 23);
    return r;
}
// One word of 8 nibbles -> P0..P3 scaled. TWO: the warp holds some scale above 128, so the
// second multiply is needed (in every lane, as a select: the warp takes one path, not a per-pair
// divergent branch); without it the widening is 5 integer/bf16 operations per pair of weights,
// which at ~4 TB/s is most of the SM's issue rate.
template <bool TWO>
__device__ __forceinline__ void pairs_mx(uint32_t q, const mxscale &sc, uint32_t *p) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint32_t o = (q & 0x80008000u) | ((q & 0x70007000u) >> 6);
        o = bmul2(o, sc.m1);
        if (TWO) o = bmul2(o, sc.m2);  // m2 = 1.0 where this lane's scale is small
        p[i] = o;
        q <<= 4;
    }
}

__device__ __forceinline__ float glu_act(float g, float u, int act, float beta, float beta_l) {
    if (act == 0) return g / (1.0f + expf(-g)) * u;
    float ga = beta * tanhf(g / beta) / (1.0f + expf(-g));
    float ub = beta_l > 0.0f ? beta_l * tanhf(u / beta_l) : u;
    return ga * ub;
}

// glu_act with the SFU's approximations (ex2.approx behind __expf, rcp.approx behind __fdividef,
// tanh.approx: relative errors of ~1e-6 .. 5e-4, below the bf16 rounding of h that follows): the
// prefill epilogue runs in the tensor-core warps while no wgmma is in flight, and glu_act's IEEE
// expf / tanhf / division are most of its instructions (SiTU: ~100 a column). -g past 88 gives
// __expf = inf and g / inf = -0, as the exact form.
__device__ __forceinline__ float tanh_fast(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float glu_act_fast(float g, float u, int act, float beta, float beta_l) {
    const float sg = __fdividef(1.0f, 1.0f + __expf(-g));
    if (act == 0) return g * sg * u;
    const float ub = beta_l > 0.0f ? beta_l * tanh_fast(__fdividef(u, beta_l)) : u;
    return beta * tanh_fast(__fdividef(g, beta)) * sg * ub;
}

// Decode token groups of up to DEC_G rows (one mma n8 tile of tokens).
#define DEC_G 8
// decode token groups of a route of n tokens x k slots over E experts: whole groups of DEC_G rows plus
// at most one partial group per expert (cuda_moe.cu's permutation, cuda_router.cu's route-one)
__host__ __device__ __forceinline__ int max_groups(int n, int k, int E) {
    int rows = n * k;
    return (rows + DEC_G - 1) / DEC_G + (E < rows ? E : rows);
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async4(void *smem, const void *gmem) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(a), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Arguments shared by the expert kernels. GATEUP: weights w[0] = w1, w[1] = w3 ([E, R=I, K=D]),
// x = the token activations gathered by row_token; DOWN: w[0] = w2 ([E, R=D, K=I]), x = hbuf rows.
struct xargs {
    const uint8_t *wq[2], *ws[2];
    const uint16_t *wb[2];
    const uint16_t *sb[2];  // BF16 weights of virtual expert E (the shared expert as a routed row) or NULL
    int R, K;
    const uint16_t *x;
    const int32_t *offsets, *active, *counts, *tiles, *row_token;
    const float *row_weight;
    uint16_t *h;  // GATEUP output [rows, R]
    float *y;     // DOWN output [rows, R]
    uint16_t *yb; // or in bf16 (the wgmma epilogue below only; NULL: y): lunar_cuda_moe_experts_run_b
    int E, act;
    float beta, beta_l;
};

// The BF16 decode pair's pieces (cuda_moe.cu moe_decode_kernel, cuda_moe_bf16e.cu's start-up variant):
// one pass of NT groups of 8 tokens. dec_bf16_chunks: a warp's products of chunks j0 .. j1 - 1 (128
// columns each; lane column group c) of rows ra / rb of expert e's NM matrices (e = E: the shared
// expert's sb), against the tokens' rows xr (tok_ok false: zeros).
template <int NM, int NT>
__device__ __forceinline__ void dec_bf16_chunks(float (&acc)[NM][NT][4], const xargs &a, int e, size_t estr, int ra,
                                                int rb, int c, int j0, int j1, const uint16_t *const (&xr)[NT],
                                                const bool (&tok_ok)[NT]) {
    for (int j = j0; j < j1; j++) {
        const int blk = 4 * j + c;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            uint32_t pa[NM][4], pb[NM][4];
#pragma unroll
            for (int i = 0; i < NM; i++) {
                const uint16_t *base = e == a.E ? a.sb[i] : a.wb[i] + e * estr;
                pairs_bf16(__ldg((const uint4 *)(base + (size_t)ra * a.K + blk * 32 + w * 8)), pa[i]);
                pairs_bf16(__ldg((const uint4 *)(base + (size_t)rb * a.K + blk * 32 + w * 8)), pb[i]);
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                uint32_t px[4];
                uint4 xv = tok_ok[t] ? __ldg((const uint4 *)(xr[t] + blk * 32 + w * 8)) : make_uint4(0, 0, 0, 0);
                pairs_bf16(xv, px);
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int i = 0; i < NM; i++)
                        mma_bf16(acc[i][t], pa[i][2 * h], pb[i][2 * h], pa[i][2 * h + 1], pb[i][2 * h + 1],
                                 px[2 * h], px[2 * h + 1]);
            }
        }
    }
}
// The S k-split warps of a row tile meet in shared memory red ([4 warps][NACC][32]): warp ks = 0 adds
// the others' NACC partials (acc, flattened) in a fixed order (deterministic). Every thread of the
// block calls it.
template <int NACC, int S>
__device__ __forceinline__ void dec_splitk_sum(float *acc, float *red, int warp, int ks, int lane) {
    float *mine = red + (size_t)warp * NACC * 32;
#pragma unroll
    for (int k = 0; k < NACC; k++) mine[k * 32 + lane] = acc[k];
    __syncthreads();
    if (ks == 0) {
        for (int s2 = 1; s2 < S; s2++) {
            const float *o = red + (size_t)(warp + s2) * NACC * 32;
#pragma unroll
            for (int k = 0; k < NACC; k++) acc[k] += o[k * 32 + lane];
        }
    }
    __syncthreads();
}

// The MXFP4 decode rings (the pair's MX kernels, cuda_moe.cu, and path 16, cuda_moe_f16.cu): a
// thread's 16-byte column group c of packed weight rows ra and rb of expert e's NM matrices, and the
// rows' scale words. issue(j) copies chunk j (128 columns; nothing past j1) into ring stage
// (j - j0) % ST: the weights to slot `wslot` of uint4 [ST][2 NM][128], the scale words to slot `tid`
// of uint32 [ST][2 NM][128]; one commit group a call.
template <int NM> struct mx_ring_src {
    const uint8_t *qa[NM], *qb[NM], *sa[NM], *sb[NM];
    __device__ __forceinline__ mx_ring_src(const xargs &a, int e, size_t estr, int ra, int rb, int c) {
#pragma unroll
        for (int i = 0; i < NM; i++) {
            qa[i] = a.wq[i] + e * estr / 2 + (size_t)ra * (a.K / 2) + c * 16;
            qb[i] = a.wq[i] + e * estr / 2 + (size_t)rb * (a.K / 2) + c * 16;
            sa[i] = a.ws[i] + e * estr / 32 + (size_t)ra * (a.K / 32);
            sb[i] = a.ws[i] + e * estr / 32 + (size_t)rb * (a.K / 32);
        }
    }
    template <int ST>
    __device__ __forceinline__ void issue(uint4 *rw, uint32_t *rs, int j, int j0, int j1, int wslot, int tid) const {
        if (j1 > j) {
            const int st = (j - j0) % ST;
#pragma unroll
            for (int i = 0; i < NM; i++) {
                cp_async16(rw + (st * 2 * NM + 2 * i) * 128 + wslot, qa[i] + (size_t)j * 64);
                cp_async16(rw + (st * 2 * NM + 2 * i + 1) * 128 + wslot, qb[i] + (size_t)j * 64);
                cp_async4(rs + (st * 2 * NM + 2 * i) * 128 + tid, sa[i] + 4 * j);
                cp_async4(rs + (st * 2 * NM + 2 * i + 1) * 128 + tid, sb[i] + 4 * j);
            }
        }
        cp_async_commit();
    }
    // path 16's several row tiles per block (LUNAR_MOE_F16_TILES): the 64 bytes at byte woff of rows
    // ra / rb's packed weights (chunk j of the rows roff rows below: woff = roff K / 2 + 64 j) and the
    // 4 scale bytes at woff / 16 (roff K / 32 + 4 j) into stage st; live = false only commits (an
    // empty group keeps the wait counts). The issue above is left as it is (its users stay bit-identical).
    template <int ST>
    __device__ __forceinline__ void issue_at(uint4 *rw, uint32_t *rs, uint32_t woff, int st, bool live, int wslot,
                                             int tid) const {
        if (live) {
#pragma unroll
            for (int i = 0; i < NM; i++) {
                cp_async16(rw + (st * 2 * NM + 2 * i) * 128 + wslot, qa[i] + woff);
                cp_async16(rw + (st * 2 * NM + 2 * i + 1) * 128 + wslot, qb[i] + woff);
                cp_async4(rs + (st * 2 * NM + 2 * i) * 128 + tid, sa[i] + woff / 16);
                cp_async4(rs + (st * 2 * NM + 2 * i + 1) * 128 + tid, sb[i] + woff / 16);
            }
        }
        cp_async_commit();
    }
};

// The down epilogue's stores (moe_wg_epilogue below, and path 22's, which loads the row weights of both
// its halves first: cuda_moe_ws.cu): y = acc * rw[hh] for rows r0 + 16 wwarp + g + 8 hh (those from rend
// on are another expert's: skipped), columns from n0, fp32 or (a.yb) bf16. rw: the two rows' top-k
// weights, loaded by the caller before any store (loaded at each store, every load followed a store
// through a.y, which the compiler must assume may alias a.row_weight: NACC / 2 dependent round trips
// a tile; session 10)
template <int NACC>
__device__ __forceinline__ void moe_wg_down_store(const xargs &a, const float *acc, const float (&rw)[2], int r0,
                                                  int rend, int n0, int wwarp, int g, int c) {
    const int rlo = r0 + wwarp * 16 + g;
#pragma unroll
    for (int p = 0; p < NACC; p += 4) {
        const int col = n0 + 2 * p + 2 * c;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int r = rlo + 8 * hh;
            if (r >= rend) continue;
            const float *v = acc + p + 2 * hh, w = rw[hh];
            if (a.yb)
                *(__nv_bfloat162 *)(a.yb + (size_t)r * a.R + col) = __floats2bfloat162_rn(v[0] * w, v[1] * w);
            else
                *(float2 *)(a.y + (size_t)r * a.R + col) = make_float2(v[0] * w, v[1] * w);
        }
    }
}

// The epilogue of the wgmma grouped GEMMs (cuda_moe_wg.cu, cuda_moe_ws.cu): a warpgroup's
// m64nNk16 accumulators (NACC per thread) for rows [r0, r0 + 64) of the permutation (rows from rend
// on are another expert's: skipped) and weight rows from n0. Accumulator i of a thread holds row
// 16 wwarp + g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 c + (i & 1) (g = lane / 4, c = lane % 4).
// GATEUP: the two halves are gate and up of the same columns, h = act(gate) * up in bf16; DOWN:
// y = acc * the row's top-k weight in fp32 (moe_wg_down_store). FAST: glu_act_fast (path 12).
template <bool GATEUP, int NACC, bool FAST = false>
__device__ __forceinline__ void moe_wg_epilogue(const xargs &a, const float *acc, int r0, int rend, int n0, int wwarp,
                                                int g, int c) {
    const int rlo = r0 + wwarp * 16 + g;
    if constexpr (!GATEUP) {
        float rw[2] = {0.0f, 0.0f};
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            if (rlo + 8 * hh < rend) rw[hh] = a.row_weight[rlo + 8 * hh];
        moe_wg_down_store<NACC>(a, acc, rw, r0, rend, n0, wwarp, g, c);
    } else {
#pragma unroll
        for (int p = 0; p < NACC / 2; p += 4) {
            const int col = n0 + 2 * p + 2 * c;
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int r = rlo + 8 * hh;
                if (r >= rend) continue;
                const float *v = acc + p + 2 * hh;
                const float h0 = FAST ? glu_act_fast(v[0], v[NACC / 2], a.act, a.beta, a.beta_l)
                                      : glu_act(v[0], v[NACC / 2], a.act, a.beta, a.beta_l);
                const float h1 = FAST ? glu_act_fast(v[1], v[NACC / 2 + 1], a.act, a.beta, a.beta_l)
                                      : glu_act(v[1], v[NACC / 2 + 1], a.act, a.beta, a.beta_l);
                *(__nv_bfloat162 *)(a.h + (size_t)r * a.R + col) = __floats2bfloat162_rn(h0, h1);
            }
        }
    }
}

// The wgmma grouped GEMM (cuda_moe_wg.cu): both expert GEMMs over the tile list of r's
// permutation (tiles = an upper bound of its length). narrow: 128-row weight tiles everywhere
// (else 256 where R allows it).
void moe_wg_experts(const xargs &g, const xargs &d, bool mx, int tiles, bool narrow, cudaStream_t st);
// The warp-specialised one (cuda_moe_ws.cu): mode 0 path 6; 1 path 7, pairs of blocks sharing the
// BF16 weight tiles; 2 path 10, path 6 with the BF16 proxy fences in the producer, arriving 2 chunks
// late; 3 path 11, the same 1 chunk late; 4 path 12, path 6 with glu_act_fast in the gate/up
// epilogue (MXFP4 runs path 6 for modes 0-4); 6 path 14, MXFP4 only: the widening in the consumer
// warpgroups, each weight chunk once for two M tiles (mode 5 was path 13, removed in session 9);
// 9 path 17, BF16 only: path 12's kernel in clusters of 2 sharing the weight tiles by TMA multicast
// (MXFP4: path 6); 10 path 18, path 17 releasing the peer's stages with CTA-scope arrivals: false
// when the shapes do not fit it (gate/up R % 128, down R % 256, K % 64; path 14: gate/up R % 64,
// down R % 128, K % 64), a weight tensor map was refused or no cluster fits; the caller runs path 4.
// Mode 14: path 22 (path 14 with the down epilogue's row weights loaded once per item and the next
// item looked up before the drain); mode 16: path 24 (22 whose down kernel writes bf16 rows from
// shared memory by bulk copies; MXFP4's default since session 11); modes 17, 18, 20, 24: paths 25, 26,
// 28, 32 (MXFP4); mode 21: path 29 (BF16). From path 10 on the mode is always path - 8 (the caller's
// rule; an unknown BF16 mode aborts). mid (or NULL): an event recorded between the gate/up and the
// down launch of modes 6, 14, 16-18, 20, 21 and 24 (the prefill benchmark's per-kernel times).
bool moe_ws_experts(const xargs &g, const xargs &d, bool mx, int tiles, int mode, cudaStream_t st,
                    cudaEvent_t mid = nullptr);
// The warp-team decode kernels (cuda_moe_dec.cu): both expert GEMMs over r's decode groups
// (groups, counts[E + 2]); blocks: 0 = the resident capacity, else that many (tests).
void moe_dec2_experts(const xargs &g, const xargs &d, bool mx, const int32_t *groups, int blocks, cudaStream_t st);
// The MXFP4 decode pair on f16 tensor cores (cuda_moe_f16.cu, path 16): the pair's grid over
// slots active-expert slots, gate/up then down; n tokens (sizes LUNAR_MOE_F16_XS's shared rows); mid (or
// NULL): an event recorded between the two launches (the benchmark's per-kernel times); settled: the
// route's lunar_cuda_moe_route.settled.
void moe_f16_decode(const xargs &g, const xargs &d, int slots, int n, cudaStream_t st, cudaEvent_t mid = nullptr,
                    bool settled = false);

#endif
