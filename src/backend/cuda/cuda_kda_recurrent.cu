// KDA fused recurrent decode / verify (op_kda_recurrent) over a batch of sequences with state slots.
//
// Each column c of the state S [dk, dv] evolves independently (decay scales rows, the delta rule
// reads k^T S[:, c], the output reads q^T S[:, c]), so a block owns (sequence b, head h, a tile of
// 32 value columns) and keeps that [128 x 32] slice of the fp32 state in registers for all T
// positions: one read and one write of the state per call (plus one write per position in the
// verify form). 128 threads: thread (rg = tid / 8, cg = tid % 8) holds rows 8rg..8rg+7 and the 4
// columns 4cg..4cg+3 (float4 loads: a warp reads 4 rows x 128 contiguous bytes). The two dot
// products over the 128 rows reduce through warp shuffles then 4 warps' partials in shared memory.
// The pool may hold the state in fp16 (the fp16 state option: half the bytes per slot): loaded and
// widened once, updated in fp32 registers, rounded to nearest once at the store, as the CPU
// reference rounds S after each call (model/forward.c).
#include "backend/cuda/cuda_common.cuh"

#include <cooperative_groups.h>
#include <cuda_fp16.h>

#define RDK 128
#define RTILE 32

// 4 consecutive state elements in the pool's storage type
__device__ __forceinline__ float4 load4(const float *p) { return *reinterpret_cast<const float4 *>(p); }
__device__ __forceinline__ float4 load4(const __half *p) {
    const uint2 u = *reinterpret_cast<const uint2 *>(p);
    const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&u.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void store4(float *p, float4 v) { *reinterpret_cast<float4 *>(p) = v; }
__device__ __forceinline__ void store4(__half *p, float4 v) {
    const __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t *>(&a), u.y = *reinterpret_cast<const uint32_t *>(&b);
    *reinterpret_cast<uint2 *>(p) = u;
}

// columns 4cg..4cg+3 summed over the 4 warps' partials (red_d inside kda_token, red_o after the sync
// that follows it)
__device__ __forceinline__ float4 kda_out4(const float (*red_o)[RTILE], int cg) {
    float4 a0 = *reinterpret_cast<const float4 *>(&red_o[0][cg * 4]);
    float4 a1 = *reinterpret_cast<const float4 *>(&red_o[1][cg * 4]);
    float4 a2 = *reinterpret_cast<const float4 *>(&red_o[2][cg * 4]);
    float4 a3 = *reinterpret_cast<const float4 *>(&red_o[3][cg * 4]);
    float4 r;
    r.x = ((a0.x + a1.x) + a2.x) + a3.x;
    r.y = ((a0.y + a1.y) + a2.y) + a3.y;
    r.z = ((a0.z + a1.z) + a2.z) + a3.z;
    r.w = ((a0.w + a1.w) + a2.w) + a3.w;
    return r;
}

// v summed over the lanes 8 apart in a warp (lanes l, l ^ 8, l ^ 16, l ^ 24: the 4 row groups of a warp)
__device__ __forceinline__ void sum_lanes8(float4 &v) {
#pragma unroll
    for (int off = 8; off < 32; off <<= 1) {
        v.x += __shfl_xor_sync(0xffffffffu, v.x, off);
        v.y += __shfl_xor_sync(0xffffffffu, v.y, off);
        v.z += __shfl_xor_sync(0xffffffffu, v.z, off);
        v.w += __shfl_xor_sync(0xffffffffu, v.w, off);
    }
}
// One token of the recurrence for the block's [128 x 32] state slice st (thread (rg, cg) holding
// rows 8rg..8rg+7, columns 4cg..4cg+3): ks, qs (scaled), es = exp(g) in shared memory and synced,
// bt = beta, vv = v at the thread's 4 columns. Decays and updates st; leaves the 4 warps' partial
// outputs in red_o (the caller syncs, then kda_out4 sums them in thread cg < 8).
__device__ __forceinline__ void kda_token(float4 (&st)[8], const float *ks, const float *qs, const float *es,
                                          float bt, float4 vv, float (*red_d)[RTILE], float (*red_o)[RTILE]) {
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, cg = tid & 7, rg = tid >> 3;
    float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int j = rg * 8 + r;
        const float e = es[j], kj = ks[j];
        st[r].x *= e, st[r].y *= e, st[r].z *= e, st[r].w *= e;
        d.x += st[r].x * kj, d.y += st[r].y * kj, d.z += st[r].z * kj, d.w += st[r].w * kj;
    }
    sum_lanes8(d);
    if (lane < 8) *reinterpret_cast<float4 *>(&red_d[w][cg * 4]) = d;
    __syncthreads();
    const float4 kd = kda_out4(red_d, cg); // k . S over the 4 warps' rows
    const float4 u = make_float4((vv.x - kd.x) * bt, (vv.y - kd.y) * bt, (vv.z - kd.z) * bt, (vv.w - kd.w) * bt);
    float4 oo = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int j = rg * 8 + r;
        const float kj = ks[j], qj = qs[j];
        st[r].x += kj * u.x, st[r].y += kj * u.y, st[r].z += kj * u.z, st[r].w += kj * u.w;
        oo.x += st[r].x * qj, oo.y += st[r].y * qj, oo.z += st[r].z * qj, oo.w += st[r].w * qj;
    }
    sum_lanes8(oo);
    if (lane < 8) *reinterpret_cast<float4 *>(&red_o[w][cg * 4]) = oo;
}
template <typename ST>
__global__ void __launch_bounds__(128) kda_recurrent_kernel(
    float *__restrict__ o, const float *__restrict__ q, const float *__restrict__ k,
    const float *__restrict__ v, const float *__restrict__ g, const float *__restrict__ beta,
    ST *__restrict__ S_pool, const int32_t *__restrict__ slots, ST *__restrict__ S_steps,
    int T, int H, int dv, float scale) {
    __shared__ float ks[RDK], qs[RDK], es[RDK];
    __shared__ float red_d[4][RTILE], red_o[4][RTILE];
    pdl_enter();
    const int tid = threadIdx.x;
    const int cg = tid & 7, rg = tid >> 3;
    const int c0 = blockIdx.x * RTILE + cg * 4;
    const int h = blockIdx.y, b = blockIdx.z;
    const size_t state_elems = (size_t)H * RDK * dv;
    ST *Sb = S_pool + (size_t)slots[b] * state_elems + (size_t)h * RDK * dv;

    float4 st[8];
#pragma unroll
    for (int r = 0; r < 8; r++) st[r] = load4(Sb + (size_t)(rg * 8 + r) * dv + c0);

    for (int t = 0; t < T; t++) {
        const size_t th = ((size_t)b * T + t) * H + h;
        ks[tid] = k[th * RDK + tid];
        qs[tid] = q[th * RDK + tid] * scale;
        es[tid] = expf(g[th * RDK + tid]);
        const float bt = beta[th];
        const float4 vv = *reinterpret_cast<const float4 *>(v + th * dv + c0);
        __syncthreads();
        kda_token(st, ks, qs, es, bt, vv, red_d, red_o);
        if (S_steps) {
            ST *Sx = S_steps + ((size_t)b * T + t) * state_elems + (size_t)h * RDK * dv;
#pragma unroll
            for (int r = 0; r < 8; r++) store4(Sx + (size_t)(rg * 8 + r) * dv + c0, st[r]);
        }
        __syncthreads();
        if (tid < 8) *reinterpret_cast<float4 *>(o + th * dv + c0) = kda_out4(red_o, cg);
    }
    if (!S_steps) {
#pragma unroll
        for (int r = 0; r < 8; r++) store4(Sb + (size_t)(rg * 8 + r) * dv + c0, st[r]);
    }
}

extern "C" void lunar_cuda_kda_recurrent(float *o, const float *q, const float *k, const float *v,
                                         const float *g, const float *beta, float *S_pool,
                                         const int32_t *slots, float *S_steps, int B, int T,
                                         int H, int dk, int dv, float scale,
                                         lunar_cuda_stream s) {
    CUDA_REQUIRE(dk == RDK && dv % RTILE == 0 && dv > 0);
    if (B <= 0 || T <= 0 || H <= 0) return;
    dim3 grid(dv / RTILE, H, B);
    launch_pdl(kda_recurrent_kernel<float>, grid, dim3(128), 0, to_stream(s), o, q, k, v, g, beta, S_pool, slots,
               S_steps, T, H, dv, scale);
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_kda_recurrent_f16(float *o, const float *q, const float *k, const float *v,
                                             const float *g, const float *beta, uint16_t *S_pool,
                                             const int32_t *slots, uint16_t *S_steps, int B, int T,
                                             int H, int dk, int dv, float scale,
                                             lunar_cuda_stream s) {
    CUDA_REQUIRE(dk == RDK && dv % RTILE == 0 && dv > 0);
    if (B <= 0 || T <= 0 || H <= 0) return;
    dim3 grid(dv / RTILE, H, B);
    launch_pdl(kda_recurrent_kernel<__half>, grid, dim3(128), 0, to_stream(s),
        o, q, k, v, g, beta, reinterpret_cast<__half *>(S_pool), slots, reinterpret_cast<__half *>(S_steps), T,
        H, dv, scale);
    CUDA_CHECK_LAUNCH();
}

/* ---------------------------------------------------------------- the fused batch-1 decode core
 * Issue 9: one launch for what lunar_cuda_kda_conv_qkv_decode, lunar_cuda_kda_recurrent and
 * lunar_cuda_rmsnorm_gated did in three. Opt-in (LUNAR_KDA_DECODE): on the H200 under PDL it ties
 * with the three launches and is slower with the gate rows (docs/benchmarks.md, round 3): the
 * serial chain in one block is as long as the three kernels were. Block (tile, h, b) as kda_recurrent_kernel (128 threads,
 * value columns 32 tile .. 32 tile + 31 of head h); the four tiles of a head form a thread-block
 * cluster. Prologue: thread t convolves q and k channel t of head h (every tile recomputes them:
 * 2 x 128 x K products) and L2-normalises them with block_sum_f32, the tree of the conv kernel's
 * norm; threads t < 32 convolve the tile's v channels; beta's sigmoid per block. Each expression
 * is the one of the kernel it replaces, so the outputs are the same bits. Epilogue: the gated
 * RMSNorm of the head's 128 outputs needs their sum of squares: each tile sums its 32 (lane l =
 * column 32 tile + l, the butterfly norm_kernel's warp `tile` makes) and the four partials meet
 * through distributed shared memory, added as block_sum_f32 adds 4 warps ((p0 + p2) + (p1 + p3)).
 * The conv state of q/k channel c is written by the tile that owns c / 32 after the cluster
 * barrier (all four tiles have read it by then); the v channels' by their own tile.
 * With gate rows (gw, lunar_cuda_kda_gate_proj_decode's work, in = 128 only): the block also makes
 * its head's 128 forget gates and, gw->og, its tile's 32 output-gate pre-activations from
 * [f_b; g_b]: a half-warp per row, lane l the l-th 16-byte load, the butterfly of
 * kda_gate_proj_kernel (whose lanes 16..31 add zeros at in = 128): the same bits. 160 rows of 256
 * bytes per block, f_b's rows read by the 4 tiles of a head (L2 after the first). */
template <typename ST>
__global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(128) kda_decode_fused_kernel(
    float *__restrict__ o, const float *__restrict__ x, int64_t xs, const float *__restrict__ beta_in,
    const float *__restrict__ cw, float *__restrict__ conv_pool, const int32_t *__restrict__ conv_slots,
    const float *__restrict__ g, const float *__restrict__ og, const uint16_t *__restrict__ onw,
    ST *__restrict__ S_pool, const int32_t *__restrict__ slots, int H, int K, float l2eps, float eps,
    float scale, lunar_cuda_kda_gate_rows gw) {
    __shared__ float ks[RDK], qs[RDK], es[RDK], vs[RTILE], os[RTILE], gs[RDK], ogs[RTILE];
    __shared__ float red_d[4][RTILE], red_o[4][RTILE], red[32];
    __shared__ float psum;
    pdl_enter();
    namespace cgr = cooperative_groups;
    cgr::cluster_group cl = cgr::this_cluster();
    const int tid = threadIdx.x, lane = tid & 31, cg = tid & 7, rg = tid >> 3;
    const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z, HD = H * RDK, S = K - 1;
    const int c0 = tile * RTILE + cg * 4;
    const float *xb = x + b * xs;
    float *cst = conv_pool + (size_t)conv_slots[b] * 3 * HD * S;
    ST *Sb = S_pool + (size_t)slots[b] * H * RDK * RDK + (size_t)h * RDK * RDK;
    float4 st[8];
#pragma unroll
    for (int r = 0; r < 8; r++) st[r] = load4(Sb + (size_t)(rg * 8 + r) * RDK + c0);

    if (gw.w) { /* rows r < 128: forget gate r of head h; r >= 128: output gate column 32 tile + r - 128 */
        /* half-warp hw takes rows hw, hw + 8, ...: every load issued before the first product (the
         * first device run looped load -> shuffles row by row: 20 dependent HBM round trips, 13 us
         * per layer; batched: 6.5 us, still slower than the separate 1024-block launch); r < nr is warp-uniform (hw < 8, so it depends on j and nr alone) */
        constexpr int kRows = (RDK + RTILE) / 8;
        const int hw = tid >> 4, hl = tid & 15, nr = gw.og ? RDK + RTILE : RDK;
        uint4 wr[kRows];
#pragma unroll
        for (int j = 0; j < kRows; j++) {
            const int r = hw + 8 * j;
            const int row = r < RDK ? h * RDK + r : HD + h * RDK + tile * RTILE + (r - RDK);
            if (r < nr) wr[j] = __ldcs((const uint4 *)(gw.w + (size_t)row * RDK) + hl);
        }
        const uint4 xf = gv_x8(gw.x, (size_t)0, hl, RDK), xg = gv_x8(gw.x + RDK, (size_t)0, hl, RDK);
#pragma unroll
        for (int j = 0; j < kRows; j++) {
            const int r = hw + 8 * j;
            if (r >= nr) break;
            float acc = 0.f;
            acc += gv_dot8(wr[j], r < RDK ? xf : xg);
            for (int m = 8; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
            if (hl == 0) {
                if (r < RDK) gs[r] = kda_gate_value(acc, gw.A_log[h], gw.dt_bias[h * RDK + r], gw.lb);
                else ogs[r - RDK] = acc;
            }
        }
        __syncthreads();
    }

    /* q, k channel h RDK + tid, v channel h RDK + 32 tile + tid (tid < 32): kda_conv_qkv_kernel's
     * expressions */
    const int cq = h * RDK + tid, cv = h * RDK + tile * RTILE + tid;
    float wq[CONV_MAX_K - 1], wk[CONV_MAX_K - 1], wv[CONV_MAX_K - 1];
    float aq = 0.0f, ak = 0.0f, av = 0.0f;
    {
        const float *sq = cst + (size_t)cq * S, *sk = cst + (size_t)(HD + cq) * S;
        const float xq = xb[cq], xk = xb[HD + cq];
#pragma unroll
        for (int i = 0; i < CONV_MAX_K - 1; i++)
            if (i < S) wq[i] = sq[i], wk[i] = sk[i];
#pragma unroll
        for (int i = 0; i < CONV_MAX_K; i++)
            if (i < K) {
                aq += cw[(size_t)cq * K + i] * (i < S ? wq[i] : xq);
                ak += cw[(size_t)(HD + cq) * K + i] * (i < S ? wk[i] : xk);
            }
        aq = aq / (1.0f + expf(-aq));
        ak = ak / (1.0f + expf(-ak));
    }
    if (tid < RTILE) {
        const float *sv = cst + (size_t)(2 * HD + cv) * S;
        const float xv = xb[2 * HD + cv];
#pragma unroll
        for (int i = 0; i < CONV_MAX_K - 1; i++)
            if (i < S) wv[i] = sv[i];
#pragma unroll
        for (int i = 0; i < CONV_MAX_K; i++)
            if (i < K) av += cw[(size_t)(2 * HD + cv) * K + i] * (i < S ? wv[i] : xv);
        vs[tid] = av / (1.0f + expf(-av));
    }
    const float ssq = block_sum_f32(aq * aq, red);
    aq = aq * (1.0f / sqrtf(ssq + l2eps));
    const float ssk = block_sum_f32(ak * ak, red);
    ak = ak * (1.0f / sqrtf(ssk + l2eps));
    ks[tid] = ak;
    qs[tid] = aq * scale;
    es[tid] = expf(gw.w ? gs[tid] : g[(size_t)b * HD + cq]);
    const float bt = 1.0f / (1.0f + expf(-beta_in[b * xs + h]));
    __syncthreads();
    const float4 vv = *reinterpret_cast<const float4 *>(&vs[cg * 4]);
    kda_token(st, ks, qs, es, bt, vv, red_d, red_o);
    __syncthreads();
    if (tid < 8) *reinterpret_cast<float4 *>(&os[cg * 4]) = kda_out4(red_o, cg);
    __syncthreads();
    /* the tile's share of the head's sum of squares: norm_kernel's warp `tile` */
    float ov = 0.0f;
    if (tid < 32) {
        ov = os[lane];
        float sq = ov * ov;
        for (int m = 16; m; m >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, m);
        if (lane == 0) psum = sq;
    }
    cl.sync(); /* every tile's psum written; every tile has read the conv states */
    if (tid < 32) {
        const float p0 = *cl.map_shared_rank(&psum, 0), p1 = *cl.map_shared_rank(&psum, 1);
        const float p2 = *cl.map_shared_rank(&psum, 2), p3 = *cl.map_shared_rank(&psum, 3);
        const float ss = (p0 + p2) + (p1 + p3);
        const float inv = 1.0f / sqrtf(ss / RDK + eps);
        const int i = tile * RTILE + lane;
        float v = ov * inv;
        v *= bf16_bits_to_f32(onw[i]);
        v *= 1.0f / (1.0f + expf(-(gw.w && gw.og ? ogs[lane] : og[(size_t)b * HD + h * RDK + i])));
        o[(size_t)b * HD + h * RDK + i] = v;
        float *sv = cst + (size_t)(2 * HD + cv) * S;
        const float xv = xb[2 * HD + cv];
#pragma unroll
        for (int i2 = 0; i2 < CONV_MAX_K - 1; i2++)
            if (i2 < S) sv[i2] = i2 + 1 < S ? wv[i2 + 1] : xv;
    }
    if (tid / RTILE == tile) { /* this tile's quarter of the q and k conv states */
        float *sq = cst + (size_t)cq * S, *sk = cst + (size_t)(HD + cq) * S;
        const float xq = xb[cq], xk = xb[HD + cq];
#pragma unroll
        for (int i = 0; i < CONV_MAX_K - 1; i++)
            if (i < S) sq[i] = i + 1 < S ? wq[i + 1] : xq, sk[i] = i + 1 < S ? wk[i + 1] : xk;
    }
#pragma unroll
    for (int r = 0; r < 8; r++) store4(Sb + (size_t)(rg * 8 + r) * RDK + c0, st[r]);
    cl.sync(); /* no block leaves while another may still read its psum */
}

extern "C" void lunar_cuda_kda_decode_fused(float *o, const float *x, int64_t x_stride, const float *beta_in,
                                            const float *conv_w, float *conv_pool, const int32_t *conv_slots,
                                            const float *g, const float *og, const uint16_t *o_norm, void *S_pool,
                                            int state_fp16, const int32_t *slots, int B, int H, int dk, int K,
                                            float l2_eps, float eps, float scale, const lunar_cuda_kda_gate_rows *gr,
                                            lunar_cuda_stream s) {
    CUDA_REQUIRE(dk == RDK && K >= 1 && K <= CONV_MAX_K && H >= 1 && H <= 65535 && B <= 65535);
    lunar_cuda_kda_gate_rows gw = {};
    if (gr) { /* one sequence: the rows read one x */
        CUDA_REQUIRE(B == 1 && gr->w && gr->x && gr->A_log && gr->dt_bias &&
                     ((uintptr_t)gr->x | (uintptr_t)gr->w) % 16 == 0);
        gw = *gr;
    }
    CUDA_REQUIRE(gw.w || g);
    CUDA_REQUIRE((gw.w && gw.og) || og);
    if (B <= 0) return;
    const dim3 grid(RDK / RTILE, H, B);
    if (state_fp16)
        launch_pdl(kda_decode_fused_kernel<__half>, grid, dim3(128), 0, to_stream(s), o, x, x_stride, beta_in, conv_w,
                   conv_pool, conv_slots, g, og, o_norm, reinterpret_cast<__half *>(S_pool), slots, H, K, l2_eps, eps,
                   scale, gw);
    else
        launch_pdl(kda_decode_fused_kernel<float>, grid, dim3(128), 0, to_stream(s), o, x, x_stride, beta_in, conv_w,
                   conv_pool, conv_slots, g, og, o_norm, reinterpret_cast<float *>(S_pool), slots, H, K, l2_eps, eps,
                   scale, gw);
    CUDA_CHECK_LAUNCH();
}
