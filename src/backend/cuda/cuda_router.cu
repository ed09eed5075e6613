// The sigmoid MoE router on the GPU (op_router_topk: sigmoid, selection bias, group-limited top-k,
// renormalise, scale) and the batch-1 route (the top-k and the expert-contiguous permutation of
// lunar_cuda_moe_permute in one launch). Three kernels, which give the same experts and the same weight
// bits: the sorting router (default up to 256 tokens, session 20), the warp router (LUNAR_ROUTER=warp;
// the default above 256 tokens and where the sort does not apply) and the block router before it
// (LUNAR_ROUTER=block).
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_moe.cuh"

// The block router (LUNAR_ROUTER=block; the default until session 7): one 256-thread block per token, k
// rounds of block-wide argmax with two barriers each and thread 0's serial merge of the warps.
// ROUTE (one token, one block): the top-k is followed by the permutation that
// lunar_cuda_moe_permute's memset, count, scan and scatter would leave in r (see route_one below)
// route-one's last entries, written by one thread: the totals past the E experts' (offsets[E], the
// count slots the permutation kernels leave), the group-done flag past the last group, and the shared
// expert as virtual expert E (the last permuted row, weight 1) where there is one
// one token's permuted row pos: pair `pair`'s expert e (its only row: one tile, one group each), weight w
__device__ __forceinline__ void route_one_row(lunar_cuda_moe_route &r, int pair, int pos, int e, float w) {
    r.active[pos] = e;
    r.tiles[2 * pos] = e, r.tiles[2 * pos + 1] = pos;
    r.groups[2 * pos] = e, r.groups[2 * pos + 1] = pos;
    r.gdone[pos] = 0;
    r.row_token[pos] = 0;
    r.row_weight[pos] = w;
    r.pair_row[pair] = pos;
}
__device__ __forceinline__ void route_one_tail(lunar_cuda_moe_route &r, int E, int k, int shared) {
    const int k1 = k + shared;
    r.offsets[E] = k;
    r.counts[E] = k1, r.counts[E + 1] = k1, r.counts[E + 2] = k1;
    r.gdone[max_groups(1, k1, E)] = 0;
    if (shared) {
        r.offsets[E + 1] = k + 1;
        route_one_row(r, k, k, E, 1.0f);
    }
}

template <bool ROUTE>
__global__ void __launch_bounds__(256) router_topk_kernel(int32_t *experts, float *weights,
                                                          const float *logits, const float *bias,
                                                          int E, int k, int n_group,
                                                          int topk_group, int renorm,
                                                          float scale, int shared, lunar_cuda_moe_route r) {
    extern __shared__ float sm[];
    float *sc = sm, *ch = sm + E;  // sigmoid, choice (-inf once taken or not eligible)
    __shared__ float gscore[64];
    __shared__ int gok[64];
    __shared__ float rv[8];
    __shared__ int ri[8];
    pdl_enter();
    const int t = blockIdx.x, tid = threadIdx.x;
    const float *lg = logits + (size_t)t * E;
    for (int e = tid; e < E; e += blockDim.x) {
        float s = 1.0f / (1.0f + expf(-lg[e]));
        sc[e] = s;
        const float v = s + (bias ? bias[e] : 0.0f);
        ch[e] = isnan(v) ? -INFINITY : v;  // NaN marks taken entries below; a NaN logit ranks last (as the CPU op)
    }
    __syncthreads();
    if (n_group > 1) {
        const int gs = E / n_group;
        if (tid < n_group) {
            float m1 = -INFINITY, m2 = -INFINITY;
            for (int e = 0; e < gs; e++) {
                float v = ch[tid * gs + e];
                if (v > m1) m2 = m1, m1 = v;
                else if (v > m2) m2 = v;
            }
            gscore[tid] = gs >= 2 ? m1 + m2 : m1;
            gok[tid] = 0;
        }
        __syncthreads();
        if (tid == 0)
            for (int sel = 0; sel < topk_group; sel++) {
                int best = -1;
                for (int gi = 0; gi < n_group; gi++)
                    if (!gok[gi] && (best < 0 || gscore[gi] > gscore[best])) best = gi;
                gok[best] = 1;
            }
        __syncthreads();
        for (int e = tid; e < E; e += blockDim.x)
            if (!gok[e / gs]) ch[e] = NAN;
    }
    // k rounds of argmax over the eligible entries (not taken, in a kept group); NaN marks the
    // others, so an eligible -inf choice still wins over them (as argmax_eligible).
    float wsum = 0.0f;
    int32_t *ex = experts + (size_t)t * k;
    float *wt = weights + (size_t)t * k;
    for (int sel = 0; sel < k; sel++) {
        float bv = -INFINITY;
        int bi = -1;
        for (int e = tid; e < E; e += blockDim.x) {
            float v = ch[e];
            if (isnan(v)) continue;  // taken / ineligible marker
            if (bi < 0 || v > bv) bv = v, bi = e;  // increasing e: ties keep the lower index
        }
        for (int o = 16; o; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) bv = ov, bi = oi;
        }
        if ((tid & 31) == 0) rv[tid >> 5] = bv, ri[tid >> 5] = bi;
        __syncthreads();
        if (tid == 0) {
            int nw = blockDim.x >> 5;
            bv = rv[0], bi = ri[0];
            for (int w = 1; w < nw; w++)
                if (ri[w] >= 0 && (bi < 0 || rv[w] > bv || (rv[w] == bv && ri[w] < bi)))
                    bv = rv[w], bi = ri[w];
            ex[sel] = bi;
            wt[sel] = sc[bi];
            wsum += sc[bi];
            ch[bi] = NAN;
        }
        __syncthreads();
    }
    if (tid == 0) {
        for (int sel = 0; sel < k; sel++) {
            float w = wt[sel];
            if (renorm) w /= wsum + 1e-20f;
            wt[sel] = w * scale;
        }
    }
    if (!ROUTE) return;
    // One token: its k experts are distinct (a taken entry is never chosen again), so each has one
    // row, and the permuted row of expert e is its rank among the chosen ones (ascending e: the
    // scan's order). srt: the chosen experts sorted (k <= 64, checked by the launcher).
    __shared__ int srt[64];
    if (tid == 0) {
        for (int i = 0; i < k; i++) {
            int e = ex[i], j = i;
            for (; j > 0 && srt[j - 1] > e; j--) srt[j] = srt[j - 1];
            srt[j] = e;
        }
    }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) {
        int rank = 0, chosen = 0;
        for (int i = 0; i < k; i++) rank += srt[i] < e, chosen |= srt[i] == e;
        r.counts[e] = chosen;
        r.offsets[e] = rank;
        r.cursor[e] = rank + chosen;  // after the scatter's increments
    }
    for (int i = tid; i < k; i += blockDim.x) {
        const int e = srt[i];
        r.active[i] = e;
        r.tiles[2 * i] = e, r.tiles[2 * i + 1] = i;  // one row per expert: one tile, one group each
        r.groups[2 * i] = e, r.groups[2 * i + 1] = i;
        r.gdone[i] = 0;
        int pos = 0;  // pair i's row: its expert's rank
        for (int j = 0; j < k; j++) pos += srt[j] < ex[i];
        r.row_token[pos] = 0;
        r.row_weight[pos] = wt[i];
        r.pair_row[i] = pos;
    }
    if (tid == 0) route_one_tail(r, E, k, shared);
}


// ---------------------------------------------------------------- the warp router
//
// One warp per token, no block barrier (issue 9: the block router's k rounds of two __syncthreads
// each plus thread 0's merge were most of route-one's 12 us at batch 1, on the decode step's serial
// path). Lane l holds candidates e = l + 32 j (j < C, E <= 32 C) in registers as 32-bit keys:
//   key(v) = bits(v) ^ (v < 0 ? 0xffffffff : 0x80000000)   (v = s + bias, never NaN, -0 made +0)
// is increasing in v, so comparing keys is comparing choices; every eligible key is >= key(-inf)
// = 0x007fffff > 0, and 0 marks a taken or ineligible candidate (as the block router's NaN marker:
// an eligible -inf choice still wins over it). A round: the warp's best key by one redux.sync max,
// the lowest index holding it by one redux.sync min (ties to the lower index, as argmax_eligible:
// the order (key desc, index asc) is total, so any reduction tree gives the CPU's scan result), then
// only the winning lane recomputes its best candidate (a max tree over (key, C-1-j) pairs: of the
// group it took from, from C = 16 a lane; see groups_take).
// The weights: s[e] from shared memory, summed in selection order by every lane (the CPU's sum).
// Groups (n_group > 1; no shipped config uses them) go through shared memory exactly as the block
// router: lane g scores group g (top-2 sum, serial), lane 0 picks topk_group of them serially.
// ROUTE (one token, one warp): then the permutation, from one ballot per candidate column j: the
// rank of a chosen expert e among the chosen = popcounts of the columns before e's plus the lanes
// below e's in its column.
#define ROUTER_WPB 4  // warps (tokens) per block of the batched router

__device__ __forceinline__ uint32_t choice_key(float v) {
    const uint32_t u = __float_as_uint(v + 0.0f);  // -0 + 0 = +0: equal choices, equal keys
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// (key, C-1-j) of the lane's candidates J0 <= j < J0 + W: the largest key, the lowest j among
// equal keys (the pairs are unique, so any max tree gives the same pair)
template <int C, int J0, int W>
__device__ __forceinline__ unsigned long long span_best(const uint32_t (&key)[C]) {
    unsigned long long p[W];
#pragma unroll
    for (int j = 0; j < W; j++) p[j] = (unsigned long long)key[J0 + j] << 32 | (uint32_t)(C - 1 - J0 - j);
#pragma unroll
    for (int w = 1; w < W; w <<= 1)
#pragma unroll
        for (int j = 0; j + w < W; j += 2 * w) p[j] = max(p[j], p[j + w]);
    return p[0];
}
// The lane's candidates in G groups of W with each group's best kept: the round's winner rescans
// only the group it took from (W pairs, then G - 1 maxima) instead of all C. One warp runs the k
// rounds back to back with nothing to hide their latency, and the rescan was most of a round:
// K3.1's 896 experts (C = 28), top-16, took 19.8 us a route (ncu, session 11) against 5.8 us for
// Kimi-Linear's 256 (C = 8), top-8; grouped, 17.0 us (the step inside its noise). The same pairs are
// compared, so the same choices. Of the rest, ~4 us a route was run-once code unrolled (ROLL below,
// session 12); the ~13 us left has no hot instruction: its stall samples are spread (wait 35 %, long
// scoreboard 20 %, short scoreboard 16 %; docs/benchmarks.md "Session 12, lead's calls").
template <int C, int W, int G, int I = 0>
__device__ __forceinline__ void groups_init(const uint32_t (&key)[C], unsigned long long (&gb)[G]) {
    if constexpr (I < G) {
        gb[I] = span_best<C, I * W, W>(key);
        groups_init<C, W, G, I + 1>(key, gb);
    }
}
template <int C, int W, int G, int I = 0>
__device__ __forceinline__ void groups_take(uint32_t (&key)[C], unsigned long long (&gb)[G], int bj) {
    if constexpr (I < G) {
        if (I + 1 == G || bj < (I + 1) * W) { // bj >= I * W: the groups before said no
#pragma unroll
            for (int j = I * W; j < (I + 1) * W; j++)
                if (j == bj) key[j] = 0;
            gb[I] = span_best<C, I * W, W>(key);
        } else {
            groups_take<C, W, G, I + 1>(key, gb, bj);
        }
    }
}
template <int G>
__device__ __forceinline__ unsigned long long groups_best(const unsigned long long (&gb)[G]) {
    unsigned long long b = gb[0];
#pragma unroll
    for (int i = 1; i < G; i++) b = max(b, gb[i]);
    return b;
}

template <bool ROUTE, int C, int G, bool ROLL>
__global__ void __launch_bounds__(32 * ROUTER_WPB) router_warp_kernel(int32_t *experts, float *weights,
                                                                      const float *logits, const float *bias,
                                                                      int n, int E, int k, int n_group,
                                                                      int topk_group, int renorm, float scale,
                                                                      int shared, lunar_cuda_moe_route r) {
    // per warp: s [E]; ROLL: the bias, then the keys [E]; groups only: the choices [E]
    extern __shared__ float wsm[];
    __shared__ float gscore[ROUTER_WPB][64];
    __shared__ int gok[ROUTER_WPB][64];
    const unsigned FULL = 0xffffffffu;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int t = blockIdx.x * (blockDim.x >> 5) + wid;
    constexpr int NS = ROLL ? 2 : 1;  // per-warp arrays of E before the choices
    float *sw = wsm + (size_t)wid * (n_group > 1 ? NS + 1 : NS) * E, *aux = sw + E, *ch = sw + NS * E;
    float bv[ROLL ? 1 : C];  // the selection bias: a weight, which no kernel of the step writes (before the wait)
#pragma unroll
    for (int j = 0; j < C; j++) {
        const int e = lane + 32 * j;
        if (ROLL) {
            if (e < E) aux[e] = bias ? bias[e] : 0.0f;
        } else {
            bv[ROLL ? 0 : j] = bias && e < E ? bias[e] : 0.0f;
        }
    }
    pdl_enter();
    if (t >= n) return;
    const float *lg = logits + (size_t)t * E;
    float lv[C];  // every logit load in flight before the first use (one L2 round trip, not C)
#pragma unroll
    for (int j = 0; j < C; j++) {
        const int e = lane + 32 * j;
        lv[j] = e < E ? lg[e] : 0.0f;
    }
    uint32_t key[C];
    if constexpr (ROLL) {
        // The sigmoids and keys in a loop over shared memory (each lane its own e: no sync), not C
        // unrolled copies: fully unrolled (ROLL = false) they were ~2 K of K3's 5.8 K SASS instructions
        // (E = 896, C = 28), straight-line code that one warp runs once, each 128-byte line of it fetched
        // as it is reached (the step streams GBs through L2 between two routes). The same operations on
        // the same values: the same keys and weights, bit for bit.
        uint32_t *ka = reinterpret_cast<uint32_t *>(aux);
#pragma unroll
        for (int j = 0; j < C; j++) {
            const int e = lane + 32 * j;
            if (e < E) sw[e] = lv[j];
        }
#pragma unroll 4
        for (int j = 0; j < C; j++) {
            const int e = lane + 32 * j;
            if (e < E) {
                const float s = 1.0f / (1.0f + expf(-sw[e]));
                float v = s + aux[e];  // + 0.0f without a bias, as below
                if (isnan(v)) v = -INFINITY;
                sw[e] = s;
                if (n_group > 1) ch[e] = v;
                ka[e] = choice_key(v);
            }
        }
#pragma unroll
        for (int j = 0; j < C; j++) {
            const int e = lane + 32 * j;
            key[j] = e < E ? ka[e] : 0u;
        }
    } else {
#pragma unroll
        for (int j = 0; j < C; j++) {
            const int e = lane + 32 * j;
            key[j] = 0;
            if (e < E) {
                const float s = 1.0f / (1.0f + expf(-lv[j]));
                float v = s + (bias ? bv[ROLL ? 0 : j] : 0.0f);
                if (isnan(v)) v = -INFINITY;  // a NaN logit ranks last but stays a valid choice (as the CPU op)
                sw[e] = s;
                if (n_group > 1) ch[e] = v;
                key[j] = choice_key(v);
            }
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
            gscore[wid][g] = gs >= 2 ? m1 + m2 : m1;
            gok[wid][g] = 0;
        }
        __syncwarp();
        if (lane == 0)
            for (int sel = 0; sel < topk_group; sel++) {
                int best = -1;
                for (int gi = 0; gi < n_group; gi++)
                    if (!gok[wid][gi] && (best < 0 || gscore[wid][gi] > gscore[wid][best])) best = gi;
                gok[wid][best] = 1;
            }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < C; j++) {
            const int e = lane + 32 * j;
            if (e < E && !gok[wid][e / gs]) key[j] = 0;
        }
    }
    __syncwarp();  // sw
    static_assert(C % G == 0, "groups of equal width");
    constexpr int W = C / G;
    unsigned long long gb[G];
    groups_init<C, W, G>(key, gb);
    unsigned long long b = groups_best<G>(gb);
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
            groups_take<C, W, G>(key, gb, bj);
            b = groups_best<G>(gb);
        }
        const float w = sw[e];
        wsum += w;
        if (sel == lane) ex0 = e, w0 = w;
        if (sel == lane + 32) ex1 = e, w1 = w;
    }
    if (renorm) w0 /= wsum + 1e-20f, w1 /= wsum + 1e-20f;
    w0 *= scale, w1 *= scale;
    int32_t *ex = experts + (size_t)t * k;
    float *wt = weights + (size_t)t * k;
    if (lane < k) ex[lane] = ex0, wt[lane] = w0;
    if (lane + 32 < k) ex[lane + 32] = ex1, wt[lane + 32] = w1;
    if (!ROUTE) return;
    // the permutation: column j's ballot of chosen lanes (lane j keeps it and the count before it)
    uint32_t colb = 0;
    int colpre = 0, pre = 0;
#pragma unroll(ROLL ? 4 : C)  // ROLL: a loop here too (the same stores)
    for (int j = 0; j < C; j++) {
        const uint32_t bal = __ballot_sync(FULL, (taken >> j) & 1u);
        const int e = lane + 32 * j, chosen = (taken >> j) & 1u;
        const int rank = pre + __popc(bal & ((1u << lane) - 1u));
        if (e < E) {
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
        if (i < k) route_one_row(r, i, pos, e, w);
    }
    if (lane == 0) route_one_tail(r, E, k, shared);
}

// ---------------------------------------------------------------- the sorting router
//
// The warp router's k rounds run back to back in one warp: at K3.1's 896 experts, top-16, about 15 us
// a route on the decode step's serial path (ncu: ~5 K dependent instructions of one warp, stalls
// spread over fixed-latency waits), ~17 us of each of the slice's 93 layers. Here one block per
// token, thread e holding candidate e as the 64-bit pair (key(v) << 32 | ~e): the order (key desc,
// index asc) of the warp router's rounds is the order of these unique pairs, so sorting them gives
// the same choices in the same order. Each warp sorts its 32 pairs descending (a bitonic network in
// registers: 15 compare-exchange steps over shuffles), then the warps' lists are merged pairwise
// through shared memory, log2(warps) levels of one barrier each; a merge keeps the larger 32 of two
// sorted lists (element-wise max of one list and the other reversed is a bitonic sequence holding
// them, sorted by 5 more steps). Warp 0 then holds the top 32 in order: the weights are s[e] summed
// in that order (the warp router's fp32 sum), renormalised and scaled by the same statements, so the
// experts and weight bits are the warp router's (tested: cuda_moe_route_variants_same_bits). Limits:
// E <= 1024 (one thread a candidate), k <= 32 (one list entry a lane), no expert groups (no shipped
// config has them); elsewhere the warp router runs. ROUTE (one token): then the permutation as the
// block router's, each thread its expert's count, rank and cursor from the k chosen indices.
constexpr int kSortMaxE = 1024, kSortMaxK = 32;

// one compare-exchange of a descending bitonic step: the lane whose partner is above it keeps the max
__device__ __forceinline__ unsigned long long sort_step(unsigned long long x, int stride, bool keep_max) {
    const unsigned long long y = __shfl_xor_sync(0xffffffffu, x, stride);
    return keep_max ? (x > y ? x : y) : (x < y ? x : y);
}

template <bool ROUTE>
__global__ void __launch_bounds__(kSortMaxE) router_sort_kernel(int32_t *experts, float *weights, const float *logits,
                                                                const float *bias, int E, int k, int renorm,
                                                                float scale, int shared, lunar_cuda_moe_route r) {
    __shared__ unsigned long long lst[kSortMaxE / 32][32]; // each warp's sorted list, then the merges'
    __shared__ float sg[kSortMaxE];                          // s[e], the sigmoid (the weight)
    __shared__ float selw[kSortMaxK];                        // the chosen weights in selection order
    __shared__ int sel[kSortMaxK];                           // the chosen experts in selection order
    const int e = threadIdx.x, lane = e & 31, wid = e >> 5, nw = blockDim.x >> 5;
    const size_t t = blockIdx.x;
    const float b = bias && e < E ? bias[e] : 0.0f; // a weight, which no kernel of the step writes (before the wait)
    pdl_enter();
    unsigned long long x = 0; // padding past E: below every candidate (an eligible key is >= key(-inf) > 0)
    if (e < E) {
        const float s = 1.0f / (1.0f + expf(-logits[t * E + e]));
        float v = s + b; // + 0.0f without a bias, as the warp router
        if (isnan(v)) v = -INFINITY; // a NaN logit ranks last but stays a valid choice (as the CPU op)
        sg[e] = s;
        x = (unsigned long long)choice_key(v) << 32 | (0xffffffffu - (uint32_t)e);
    }
#pragma unroll
    for (int size = 2; size <= 32; size <<= 1) // blocks of `size` alternate direction; the last is descending
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1)
            x = sort_step(x, stride, ((lane & size) == 0) == ((lane & stride) == 0));
    for (int step = 1; step < nw; step <<= 1) { // warp w takes w + step's list at level log2(step)
        lst[wid][lane] = x;
        __syncthreads();
        if (wid % (2 * step) == 0 && wid + step < nw) {
            const unsigned long long o = lst[wid + step][31 - lane];
            x = x > o ? x : o;
#pragma unroll
            for (int stride = 16; stride > 0; stride >>= 1) x = sort_step(x, stride, (lane & stride) == 0);
        }
        __syncthreads(); // the list just read is not overwritten before every reader is done
    }
    int ei = 0;
    float w = 0.0f;
    if (wid == 0) {
        ei = (int)(0xffffffffu - (uint32_t)x);
        if (lane < k) selw[lane] = sg[ei], sel[lane] = ei;
        __syncwarp();
        float wsum = 0.0f;
        for (int i = 0; i < k; i++) wsum += selw[i]; // selection order, as the warp router's rounds
        w = lane < k ? selw[lane] : 0.0f;
        if (renorm) w /= wsum + 1e-20f;
        w *= scale;
        if (lane < k) experts[t * k + lane] = ei, weights[t * k + lane] = w;
    }
    if (!ROUTE) return;
    __syncthreads(); // sel
    if (e < E) {
        int rank = 0, chosen = 0;
        for (int i = 0; i < k; i++) rank += sel[i] < e, chosen |= sel[i] == e;
        r.counts[e] = chosen;
        r.offsets[e] = rank;
        r.cursor[e] = rank + chosen; // after the scatter's increments
    }
    if (wid == 0 && lane < k) { // pair `lane`: its expert's rank among the chosen is its permuted row
        int pos = 0;
        for (int i = 0; i < k; i++) pos += sel[i] < ei;
        route_one_row(r, lane, pos, ei, w);
    }
    if (e == 0) route_one_tail(r, E, k, shared);
}

// candidates per lane: the smallest instantiated C with 32 C >= E (256 experts: 8; 896: 28), 0 above 1024
static int warp_cols(int E) {
    static const int cs[] = {2, 4, 8, 16, 28, 32};
    for (unsigned i = 0; i < sizeof cs / sizeof cs[0]; i++)
        if (32 * cs[i] >= E) return cs[i];
    return 0;
}
// Unset: the sorting router where it applies (router_sort), else the warp router as =warp.
// LUNAR_ROUTER=warp: the warp router (the default until session 20; grouped, rolled as below);
// =block: the block router (the A/B of session 7); =flat: the warp router rescanning all
// of the winner's candidates each round (session 7-10's, for A/B); =unrolled: the grouped warp router
// with its sigmoids and permutation columns unrolled (session 11's); anything else: the warp router
// with groups of candidates from 16 a lane and, from 16 a lane too, those two loops rolled (ROLL),
// where its shared memory fits (the batched router with groups at E > 816 does not: unrolled there)
static int g_router_mode = -1;
static int router_mode(void) { // 0 warp, grouped, rolled; 1 block; 2 warp, flat; 3 warp, grouped, unrolled
    if (g_router_mode < 0) {
        const char *e = getenv("LUNAR_ROUTER");
        g_router_mode = e && strcmp(e, "block") == 0      ? 1
                        : e && strcmp(e, "flat") == 0     ? 2
                        : e && strcmp(e, "unrolled") == 0 ? 3
                        : e && strcmp(e, "warp") == 0     ? 0
                                                          : 4;
    }
    return g_router_mode;
}
extern "C" int lunar_cuda_router_mode(int mode) {
    const int prev = router_mode();
    if (mode >= 0) g_router_mode = mode;
    return prev;
}
static int router_block(void) { return router_mode() == 1; }
// The sorting router where it applies (mode 4, the default): up to kSortMaxRows tokens. Above, the warp
// router's one warp a token does less work in all (a prefill's 8K tokens: ~5 K instructions a token
// against ~8 K for the sort's 28 warps at K3's 896 experts, by count; not measured).
constexpr int kSortMaxRows = 256;
static bool router_sort(int n, int E, int k, int n_group) {
    return router_mode() == 4 && n <= kSortMaxRows && E <= kSortMaxE && k <= kSortMaxK && n_group <= 1;
}
template <bool ROUTE>
static void sort_launch(int n, int32_t *experts, float *weights, const float *logits, const float *bias, int E,
                        int k, int renorm, float scale, int shared, const lunar_cuda_moe_route &r, cudaStream_t st) {
    launch_pdl(router_sort_kernel<ROUTE>, dim3(n), dim3(32 * ((E + 31) / 32)), 0, st, experts, weights, logits, bias,
               E, k, renorm, scale, shared, r);
    CUDA_CHECK_LAUNCH();
}

// groups of a lane's C candidates (groups_take): 4 from 16 candidates, else 1 (the full rescan)
static constexpr int router_groups(int C) { return C >= 16 ? 4 : 1; }

template <bool ROUTE>
static void warp_launch(int C, int n, int32_t *experts, float *weights, const float *logits, const float *bias,
                        int E, int k, int n_group, int topk_group, int renorm, float scale, int shared,
                        const lunar_cuda_moe_route &r, cudaStream_t st) {
    const int wpb = ROUTE ? 1 : ROUTER_WPB;
    const dim3 grid((n + wpb - 1) / wpb), block(32 * wpb);
    const size_t smem1 = (size_t)wpb * E * sizeof(float) * (n_group > 1 ? 2 : 1), smem_roll = smem1 + wpb * E * 4;
    // rolled from 16 candidates a lane (E > 256), where it was measured (K3.1's 896: -1.9 / -2.6 % TPOT, session
    // 12); Kimi-Linear's 256 (C = 8, 2.1 K against 2.5 K instructions) keeps the unrolled kernel, not measured
    const bool flat = router_mode() == 2, roll = (router_mode() == 0 || router_mode() == 4) && C >= 16 &&
                                                    smem_roll <= 40 * 1024;
    const size_t smem = roll ? smem_roll : smem1;
#define RW_LAUNCH(CC, GG, RR)                                                                                     \
    launch_pdl(router_warp_kernel<ROUTE, CC, GG, RR>, grid, block, smem, st, experts, weights, logits, bias, n, E, \
               k, n_group, topk_group, renorm, scale, shared, r)
#define RW_CASE(CC)                                                                                             \
    case CC:                                                                                                    \
        if (flat) RW_LAUNCH(CC, 1, false);                                                                      \
        else if (roll) RW_LAUNCH(CC, router_groups(CC), CC >= 16);                                              \
        else RW_LAUNCH(CC, router_groups(CC), false);                                                           \
        break;
    switch (C) {
        RW_CASE(2) RW_CASE(4) RW_CASE(8) RW_CASE(16) RW_CASE(28) RW_CASE(32)
    default: CUDA_REQUIRE(!"warp router: no such column count");
    }
#undef RW_CASE
#undef RW_LAUNCH
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_router_topk(int32_t *experts, float *weights, const float *logits,
                                       const float *bias, int n, int E, int k, int n_group,
                                       int topk_group, int renorm, float scale,
                                       lunar_cuda_stream s) {
    if (n_group < 1) n_group = 1;
    CUDA_REQUIRE(E >= 1 && E <= 4096 && k >= 1 && k <= E && E % n_group == 0 && n_group <= 64);
    if (n_group > 1) CUDA_REQUIRE(topk_group >= 1 && topk_group <= n_group && k <= topk_group * (E / n_group));
    if (n <= 0) return;
    lunar_cuda_moe_route none;
    memset(&none, 0, sizeof none);
    if (router_sort(n, E, k, n_group)) {
        sort_launch<false>(n, experts, weights, logits, bias, E, k, renorm, scale, 0, none, to_stream(s));
        return;
    }
    const int C = warp_cols(E);
    if (C && k <= 64 && !router_block()) {
        warp_launch<false>(C, n, experts, weights, logits, bias, E, k, n_group, topk_group, renorm, scale, 0, none,
                           to_stream(s));
        return;
    }
    router_topk_kernel<false><<<n, 256, 2 * E * sizeof(float), to_stream(s)>>>(
        experts, weights, logits, bias, E, k, n_group, topk_group, renorm, scale, 0, none);
    CUDA_CHECK_LAUNCH();
}

extern "C" void lunar_cuda_moe_route_one(lunar_cuda_moe_route *r, const float *logits, const float *bias,
                                         int n_group, int topk_group, int renorm, float scale,
                                         int shared, lunar_cuda_stream s) {
    const int E = r->E, k = r->k - (shared != 0);
    if (n_group < 1) n_group = 1;
    CUDA_REQUIRE(r->n == 1 && E >= 1 && E <= 4096 && k >= 1 && k <= E && k <= 64 && E % n_group == 0 &&
                 n_group <= 64);
    if (n_group > 1) CUDA_REQUIRE(topk_group >= 1 && topk_group <= n_group && k <= topk_group * (E / n_group));
    if (router_sort(1, E, k, n_group)) {
        sort_launch<true>(1, r->experts, r->weights, logits, bias, E, k, renorm, scale, shared != 0, *r,
                          to_stream(s));
        return;
    }
    const int C = warp_cols(E);
    if (C && !router_block()) {
        warp_launch<true>(C, 1, r->experts, r->weights, logits, bias, E, k, n_group, topk_group, renorm, scale,
                          shared != 0, *r, to_stream(s));
        return;
    }
    launch_pdl(router_topk_kernel<true>, dim3(1), dim3(256), 2 * E * sizeof(float), to_stream(s),
        r->experts, r->weights, logits, bias, E, k, n_group, topk_group, renorm, scale, shared != 0, *r);
    CUDA_CHECK_LAUNCH();
}
