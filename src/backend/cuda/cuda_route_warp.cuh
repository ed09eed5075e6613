// The warp router's body (cuda_router.cu router_warp_kernel) as a device function, shared with the
// MoE decode kernels that route a batch-1 token themselves (issue 9: route-one inside the gate/up
// kernel, cuda_moe.cu / cuda_moe_f16.cu, LUNAR_MOE_ROUTE_FUSED). One warp, one token; the
// algorithm is explained above router_warp_kernel.
#ifndef LUNAR_BACKEND_CUDA_ROUTE_WARP_CUH
#define LUNAR_BACKEND_CUDA_ROUTE_WARP_CUH

#include "backend/cuda/cuda_moe.cuh"

__device__ __forceinline__ uint32_t choice_key(float v) {
    const uint32_t u = __float_as_uint(v + 0.0f);  // -0 + 0 = +0: equal choices, equal keys
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// (key, C-1-j) of the lane's best candidate: the largest key, the lowest j among equal keys
template <int C>
__device__ __forceinline__ unsigned long long lane_best(const uint32_t *key) {
    unsigned long long p[C];
#pragma unroll
    for (int j = 0; j < C; j++) p[j] = (unsigned long long)key[j] << 32 | (uint32_t)(C - 1 - j);
#pragma unroll
    for (int w = 1; w < C; w <<= 1)
#pragma unroll
        for (int j = 0; j + w < C; j += 2 * w) p[j] = max(p[j], p[j + w]);
    return p[0];
}

// One warp routes token lg (E logits; bv: the lane's selection-bias values, bias != NULL). sw: E
// floats of shared memory (the sigmoids), ch / gscore / gok: n_group > 1 only (E floats, 64, 64).
// write: store the top-k (ex, wt) and, ROUTE, the permutation into r as router_warp_kernel does;
// a warp that does not write still computes the route. ROUTE: *slot_e (shared memory, lane 0 of
// the permutation's writer) receives the expert of permuted row `slot` (E: the shared row).
template <bool ROUTE, int C>
__device__ __forceinline__ void route_warp(const float *lg, const float *bias, const float *bv, int E, int k,
                                           int n_group, int topk_group, int renorm, float scale, int shared,
                                           float *sw, float *ch, float *gscore, int *gok, int32_t *ex, float *wt,
                                           const lunar_cuda_moe_route &r, bool write, int slot, int *slot_e) {
    const unsigned FULL = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    float lv[C];  // every logit load in flight before the first use (one L2 round trip, not C)
#pragma unroll
    for (int j = 0; j < C; j++) {
        const int e = lane + 32 * j;
        lv[j] = e < E ? lg[e] : 0.0f;
    }
    uint32_t key[C];
#pragma unroll
    for (int j = 0; j < C; j++) {
        const int e = lane + 32 * j;
        key[j] = 0;
        if (e < E) {
            const float s = 1.0f / (1.0f + expf(-lv[j]));
            float v = s + (bias ? bv[j] : 0.0f);
            if (isnan(v)) v = -INFINITY;  // a NaN logit ranks last but stays a valid choice (as the CPU op)
            sw[e] = s;
            if (n_group > 1) ch[e] = v;
            key[j] = choice_key(v);
        }
    }
    if (n_group > 1) {
        __syncwarp();
        const int gs = E / n_group;
        for (int g = lane; g < n_group; g += 32) {
            float m1 = -INFINITY, m2 = -INFINITY;
            for (int e = 0; e < gs; e++) {
                const float v = ch[g * gs + e];
                if (v > m1) m2 = m1, m1 = v;
                else if (v > m2) m2 = v;
            }
            gscore[g] = gs >= 2 ? m1 + m2 : m1;
            gok[g] = 0;
        }
        __syncwarp();
        if (lane == 0)
            for (int sel = 0; sel < topk_group; sel++) {
                int best = -1;
                for (int gi = 0; gi < n_group; gi++)
                    if (!gok[gi] && (best < 0 || gscore[gi] > gscore[best])) best = gi;
                gok[best] = 1;
            }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < C; j++) {
            const int e = lane + 32 * j;
            if (e < E && !gok[e / gs]) key[j] = 0;
        }
    }
    __syncwarp();  // sw
    unsigned long long b = lane_best<C>(key);
    uint32_t taken = 0;      // bit j: candidate j of this lane chosen
    int ex0 = 0, ex1 = 0;    // this lane's slots: lane and lane + 32
    float w0 = 0.0f, w1 = 0.0f, wsum = 0.0f;
    for (int sel = 0; sel < k; sel++) {
        const uint32_t bk = (uint32_t)(b >> 32);
        const int bj = C - 1 - (int)(uint32_t)b;
        const uint32_t m = __reduce_max_sync(FULL, bk);
        const int e = (int)__reduce_min_sync(FULL, bk == m ? (uint32_t)(lane + 32 * bj) : FULL);
        if ((e & 31) == lane) {  // the winner: its candidate bj is taken
            taken |= 1u << bj;
#pragma unroll
            for (int j = 0; j < C; j++)
                if (j == bj) key[j] = 0;
            b = lane_best<C>(key);
        }
        const float w = sw[e];
        wsum += w;
        if (sel == lane) ex0 = e, w0 = w;
        if (sel == lane + 32) ex1 = e, w1 = w;
    }
    if (renorm) w0 /= wsum + 1e-20f, w1 /= wsum + 1e-20f;
    w0 *= scale, w1 *= scale;
    if (write) {
        if (lane < k) ex[lane] = ex0, wt[lane] = w0;
        if (lane + 32 < k) ex[lane + 32] = ex1, wt[lane + 32] = w1;
    }
    if (!ROUTE) return;
    // the permutation: column j's ballot of chosen lanes (lane j keeps it and the count before it)
    uint32_t colb = 0;
    int colpre = 0, pre = 0;
#pragma unroll
    for (int j = 0; j < C; j++) {
        const uint32_t bal = __ballot_sync(FULL, (taken >> j) & 1u);
        const int e = lane + 32 * j, chosen = (taken >> j) & 1u;
        const int rank = pre + __popc(bal & ((1u << lane) - 1u));
        if (write && e < E) {
            r.counts[e] = chosen;
            r.offsets[e] = rank;
            r.cursor[e] = rank + chosen;  // after the scatter's increments
        }
        if (lane == j) colb = bal, colpre = pre;
        pre += __popc(bal);
    }
    for (int h = 0; h < k; h += 32) {  // slots lane + h: pair i, its expert's rank = its permuted row
        const int i = lane + h, e = h ? ex1 : ex0;
        const float w = h ? w1 : w0;
        const int pos = __shfl_sync(FULL, colpre, e >> 5) + __popc(__shfl_sync(FULL, colb, e >> 5) & ((1u << (e & 31)) - 1u));
        if (i < k) {
            if (slot_e && pos == slot) *slot_e = e;
            if (write) {
                r.active[pos] = e;
                r.tiles[2 * pos] = e, r.tiles[2 * pos + 1] = pos;  // one row per expert: one tile, one group each
                r.groups[2 * pos] = e, r.groups[2 * pos + 1] = pos;
                r.gdone[pos] = 0;
                r.row_token[pos] = 0;
                r.row_weight[pos] = w;
                r.pair_row[i] = pos;
            }
        }
    }
    if (lane == 0) {
        if (slot_e && shared && slot == k) *slot_e = E;
        if (!write) return;
        const int k1 = k + shared;
        r.offsets[E] = k;
        r.counts[E] = k1, r.counts[E + 1] = k1, r.counts[E + 2] = k1;
        r.gdone[max_groups(1, k1, E)] = 0;
        if (shared) {  // the shared expert: virtual expert E, the last permuted row, weight 1
            r.offsets[E + 1] = k + 1;
            r.active[k] = E;
            r.tiles[2 * k] = E, r.tiles[2 * k + 1] = k;
            r.groups[2 * k] = E, r.groups[2 * k + 1] = k;
            r.gdone[k] = 0;
            r.row_token[k] = 0;
            r.row_weight[k] = 1.0f;
            r.pair_row[k] = k;
        }
    }
}

template <int C>
__device__ __forceinline__ void route_block_c(const froute &f, int slot, float *sm, int *se, bool wr) {
    const int lane = threadIdx.x & 31, E = f.r.E;
    float bv[C];
#pragma unroll
    for (int j = 0; j < C; j++) {
        const int e = lane + 32 * j;
        bv[j] = f.bias && e < E ? f.bias[e] : 0.0f;
    }
    route_warp<true, C>(f.logits, f.bias, bv, E, f.k, 1, 1, f.renorm, f.scale, f.shared, sm, NULL, NULL, NULL,
                        f.r.experts, f.r.weights, f.r, wr, slot, se);
}
// The gate/up decode kernels' prologue under a fused route (a.fr.C != 0, one token), called after
// the kernel's wait by every thread (the logits are its predecessor's output): warp 0 of every block
// routes the token (~1 KB of L2-resident logits; no block waits for another), block (0, 0) also
// writing the route's tables, which the down kernel and the combine read after their own waits (the
// gate/up grid has completed by then). Returns the expert of permuted row `slot` (a.E: the shared
// row; -1: no such row) to every thread. sm: E floats of the block's dynamic shared memory, free
// again after the barrier here.
__device__ __forceinline__ int route_in_block(const xargs &a, int slot, float *sm) {
    __shared__ int se;
    if (threadIdx.x < 32) {
        if (threadIdx.x == 0) se = -1;
        __syncwarp();
        const bool wr = blockIdx.x == 0 && blockIdx.y == 0;
        if (a.fr.C == 8) route_block_c<8>(a.fr, slot, sm, &se, wr);
        else route_block_c<28>(a.fr, slot, sm, &se, wr);
    }
    __syncthreads();
    return se;
}

#endif
