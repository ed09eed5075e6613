// Token sampling on the device (see cuda_ops.h, lunar_cuda_sample): engine/sampler.c's semantics
// without sorting the vocabulary. The CPU ranks candidates (higher logit, then lower id), keeps the
// best top_k, then the shortest best-first prefix holding top_p of their probability, then walks
// that prefix (or, with neither filter, the ids in order) until the running mass exceeds u * total.
// Each of those cut points is a threshold in the ranking order, so one block per row finds it by
// bisection over the 32-bit order-preserving key of the logit (then over the id among equal keys),
// each step one block-wide count or mass reduction over the row (L2-resident at decode sizes).
// About 150 reductions per row: simple and exact in the ranking; its cost is noted in the docs.
#include <math.h>

#include "backend/cuda/cuda_common.cuh"

namespace {

constexpr int kThreads = 1024;

// order-preserving key: a > b as floats (non-NaN) <=> key(a) > key(b) as unsigned; -0 == +0
__device__ __forceinline__ uint32_t fkey(float f) {
    uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct sums {
    double m; // mass
    int c;    // count
};

__device__ sums block_reduce(sums v, sums *red) {
    for (int o = 16; o; o >>= 1) {
        v.m += __shfl_xor_sync(0xffffffffu, v.m, o);
        v.c += __shfl_xor_sync(0xffffffffu, v.c, o);
    }
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    sums t = {0.0, 0};
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) t.m += red[i].m, t.c += red[i].c;
    return t;
}

// A set in the ranking: members are the candidates ranked at or before (key, id) = (kt, it), i.e.
// key > kt, or key == kt and id <= it. (kt, it) = (0, -1) with all = 1: every candidate.
struct cut {
    uint32_t kt;
    int it;
    int all;
};
__device__ __forceinline__ bool in_cut(const cut &c, uint32_t k, int id) {
    return c.all || k > c.kt || (k == c.kt && id <= c.it);
}

// What a predicate adds up over the row: count and (when mass) exp((v - mx) / T) of the members of
// both cuts a and b that also satisfy (key, id) ranked at or before (kq, iq) (or id <= iq in id
// order when by_id).
__device__ sums measure(const float *lg, int V, const cut &a, const cut &b, bool mass, float mx, float T,
                        uint32_t kq, int iq, bool any_q, bool by_id, sums *red) {
    sums s = {0.0, 0};
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = lg[i];
        const uint32_t k = fkey(v);
        if (!in_cut(a, k, i) || !in_cut(b, k, i)) continue;
        if (!any_q && (by_id ? i > iq : !(k > kq || (k == kq && i <= iq)))) continue;
        s.c++;
        if (mass) s.m += (double)expf((v - mx) / T);
    }
    return block_reduce(s, red);
}

// The smallest cut (kt, it) in ranking order whose members (inside a and b) reach `need`: count >=
// need (by count) or mass > need (strictly, the draw) or mass >= need (top-p). Bisection on the key
// (largest kt whose "key >= kt" set reaches need), then on the id among key == kt.
__device__ cut find_cut(const float *lg, int V, const cut &a, const cut &b, bool by_mass, bool strict,
                        double need, float mx, float T, sums *red) {
    auto reaches = [&](sums s) {
        return by_mass ? (strict ? s.m > need : s.m >= need) : (double)s.c >= need;
    };
    uint64_t lo = 0, hi = 0xffffffffull; // reaches(key >= lo) holds (lo = 0: everything)
    while (lo < hi) {
        const uint64_t mid = lo + (hi - lo + 1) / 2;
        // key >= mid is "ranked at or before (mid, V - 1)"
        sums s = measure(lg, V, a, b, by_mass, mx, T, (uint32_t)mid, V - 1, false, false, red);
        if (reaches(s)) lo = mid; else hi = mid - 1;
    }
    // among key == lo: the smallest id cut that reaches need
    int l = 0, h = V - 1;
    while (l < h) {
        const int m = l + (h - l) / 2;
        sums s = measure(lg, V, a, b, by_mass, mx, T, (uint32_t)lo, m, false, false, red);
        if (reaches(s)) h = m; else l = m + 1;
    }
    cut c = {(uint32_t)lo, l, 0};
    return c;
}

// the smallest id (in id order) whose prefix mass over the members of a and b exceeds need; the
// largest member id when none does (rounding at the very end)
__device__ int find_id(const float *lg, int V, const cut &a, const cut &b, double need, float mx, float T,
                       sums *red) {
    int l = 0, h = V - 1;
    while (l < h) {
        const int m = l + (h - l) / 2;
        sums s = measure(lg, V, a, b, true, mx, T, 0, m, false, true, red);
        if (s.m > need) h = m; else l = m + 1;
    }
    return l;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(int32_t *ids, const float *logits, int V,
                                                          const lunar_cuda_sample_params *params) {
    __shared__ sums red[32];
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    pdl_enter();
    const int r = blockIdx.x;
    const float *lg = logits + (size_t)r * V;
    const lunar_cuda_sample_params p = params[r];

    // argmax, ties to the lower id (sampler.c's argmax keeps the first maximum)
    float bv = -INFINITY;
    int bi = V;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = lg[i];
        if (v > bv || (v == bv && i < bi) || bi == V) bv = v, bi = i;
    }
    for (int o = 16; o; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    if ((threadIdx.x & 31) == 0) s_v[threadIdx.x >> 5] = bv, s_i[threadIdx.x >> 5] = bi;
    __syncthreads();
    bv = s_v[0], bi = s_i[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++)
        if (s_v[w] > bv || (s_v[w] == bv && s_i[w] < bi)) bv = s_v[w], bi = s_i[w];
    if (p.temperature <= 0.0f || p.top_k == 1) {
        if (threadIdx.x == 0) ids[r] = bi;
        return;
    }
    const float mx = bv, T = p.temperature;
    const cut all = {0u, -1, 1};
    cut ck = all, cp = all;
    if (p.top_k > 0 && p.top_k < V) ck = find_cut(lg, V, all, all, false, false, (double)p.top_k, mx, T, red);
    const bool ranked = !ck.all || p.top_p < 1.0f;
    if (p.top_p < 1.0f) {
        const double total = measure(lg, V, ck, all, true, mx, T, 0, 0, true, false, red).m;
        cp = find_cut(lg, V, ck, all, true, false, (double)p.top_p * total, mx, T, red);
    }
    const double total = measure(lg, V, ck, cp, true, mx, T, 0, 0, true, false, red).m;
    const double need = (double)p.u * total;
    int chosen;
    if (ranked) {
        const cut cd = find_cut(lg, V, ck, cp, true, true, need, mx, T, red);
        chosen = cd.it;
        // no crossing (u * total rounds to total): the last member in rank order, as the CPU's c[n-1]
        const sums s = measure(lg, V, ck, cp, true, mx, T, cd.kt, cd.it, false, false, red);
        if (!(s.m > need)) {
            const cut last = find_cut(lg, V, ck, cp, false, false,
                                      (double)measure(lg, V, ck, cp, false, mx, T, 0, 0, true, false, red).c, mx,
                                      T, red);
            chosen = last.it;
        }
    } else {
        chosen = find_id(lg, V, ck, cp, need, mx, T, red);
    }
    if (threadIdx.x == 0) ids[r] = chosen;
}

} // namespace

extern "C" void lunar_cuda_sample(int32_t *ids, const float *logits, int rows, int V,
                                  const lunar_cuda_sample_params *params, lunar_cuda_stream s) {
    CUDA_REQUIRE(V >= 1);
    if (rows <= 0) return;
    launch_pdl(sample_kernel, dim3(rows), dim3(kThreads), 0, to_stream(s), ids, logits, V, params);
    CUDA_CHECK_LAUNCH();
}
