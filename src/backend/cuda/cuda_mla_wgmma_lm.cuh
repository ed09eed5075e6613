// Internal to the st kernel (cuda_mla_wgmma_st.cu): session 17's split-K merge by the last-arriving split of a row
// (rs::kXLm, LUNAR_MLA_WGMMA_FP8=s17l).
//
// Round 9's merge in the tail (kXMrg) has every block of a row store its partial O, meet the others at a ticket
// counter and then merge some of the row's heads from L2: at 2 splits (H = 32, B = 64, 8K) that is the later block's
// partial stores (~3 us), the wait, a dependent round trip for the log2-sum-exps and another for the partials
// (~5.5 us traced in session 16), and every block of the grid must be resident (a cooperative launch). Here each
// block takes a ticket as soon as its tile loop ends: the blocks that are not the row's last store their partial O
// and log2-sum-exp as before and leave; the last one stores nothing of its own, waits only for the others'
// partials to be published (they arrived first, so they are running or done: no co-residency needed), and merges
// every head of the row from its own accumulators (still in registers) and the others' partials (one batched round
// trip to L2, the log2-sum-exps with them). At 2 splits the later block's partial stores and the reload of its own
// half disappear from the critical path.
// Arithmetic: the merge kernel's per head (lunar_mla_merge_splits, merge_tail): M the maximum of the splits'
// log2-sum-exps, w = 2^(l - M) (0 for -inf), their sum in the order of the merge's 32-lane butterfly (for <= 4
// splits: (w0 + w2) + (w1 + w3)), O = (sum over the splits in order of w O_split) x out_scale / sum, with the own
// split's O_split the same product (accumulator x 1 / l) that store_ot would have stored: memcmp-equal to kXMrg.
// The counter of (row, head block): the arrivals in its low 16 bits, the publications above; the last block rearms
// it (every other block's last access to it is its publication, which the last block waited for).
#ifndef LUNAR_BACKEND_CUDA_MLA_WGMMA_LM_CUH
#define LUNAR_BACKEND_CUDA_MLA_WGMMA_LM_CUH

#include "backend/cuda/cuda_mla_wgmma_rs.cuh"

namespace mla_wg {
namespace lm {
namespace {

constexpr int kMaxSplits = 4; // the dispatcher's bound: the last block reads splits - 1 partials (64 KB each at H = 32)

// the arrival of this block (thread 0): true when it is the row's last
__device__ __forceinline__ bool arrive(unsigned *cnt, int splits) {
    return (atomicAdd(cnt, 1u) & 0xffffu) == (unsigned)splits - 1u;
}

// not the last: this block's partial (already stored by the caller) published (every thread calls it)
__device__ __forceinline__ void publish(unsigned *cnt, int tid) {
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(cnt, 1u << 16);
}

// the last: wait for the other splits' publications (thread 0), rearm the counter, then every thread merges the
// heads it holds (O^T: dims D0 .. D0 + 7 of heads 8i + 2t + e, as store_ot) from its accumulators o (this split,
// whose log2-sum-exp per head is lse_own[h]) and the other splits' partials
template <int N, int NS, class B>
__device__ __forceinline__ void merge_last(const Args &a, const B &b, const float (&o)[4][N / 2], unsigned *cnt,
                                           const float *lse_own) {
    const int splits = a.splits, own = b.split, t = b.t, nh = b.nh;
    if (b.tid == 0) {
        unsigned seen;
        for (;;) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(cnt) : "memory");
            if ((seen >> 16) >= (unsigned)splits - 1u) break;
            __nanosleep(20);
        }
        atomicExch(cnt, 0u);
    }
    __syncthreads();
    const size_t RH = (size_t)a.rows * a.H;
    // NS = 2: the 8 heads' loads all in flight at once (16 float4 + 8 floats); NS = 4: a head pair at a time
    constexpr int IB = NS == 2 ? N / 8 : 1;
#pragma unroll
    for (int i0 = 0; i0 < N / 8; i0 += IB) {
        float lsp[IB][2][NS];
        float4 v[IB][2][NS][2];
#pragma unroll
        for (int ii = 0; ii < IB; ii++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int i = i0 + ii, h = 8 * i + 2 * t + e;
                const size_t rh = (size_t)b.row * a.H + b.h0 + h;
#pragma unroll
                for (int sp = 0; sp < NS; sp++) {
                    lsp[ii][e][sp] = -INFINITY;
                    if (h >= nh || sp >= splits) continue;
                    if (sp == own) {
                        lsp[ii][e][sp] = lse_own[h];
                        continue;
                    }
                    lsp[ii][e][sp] = __ldcg(a.lse_part + (size_t)sp * RH + rh);
                    const float4 *src = reinterpret_cast<const float4 *>(a.o_part + ((size_t)sp * RH + rh) * kR + b.D0);
                    v[ii][e][sp][0] = __ldcg(src), v[ii][e][sp][1] = __ldcg(src + 1);
                }
            }
#pragma unroll
        for (int ii = 0; ii < IB; ii++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int i = i0 + ii, h = 8 * i + 2 * t + e;
                if (h >= nh) continue;
                // this split's partial as store_ot computes it
                const float f = b.linv[h];
#pragma unroll
                for (int sp = 0; sp < NS; sp++)
                    if (sp == own) {
                        v[ii][e][sp][0] = make_float4(o[0][4 * i + e] * f, o[0][4 * i + e + 2] * f, o[1][4 * i + e] * f,
                                                      o[1][4 * i + e + 2] * f);
                        v[ii][e][sp][1] = make_float4(o[2][4 * i + e] * f, o[2][4 * i + e + 2] * f, o[3][4 * i + e] * f,
                                                      o[3][4 * i + e + 2] * f);
                    }
                float M = -INFINITY;
#pragma unroll
                for (int sp = 0; sp < NS; sp++) M = fmaxf(M, lsp[ii][e][sp]);
                float w[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int sp = 0; sp < NS; sp++) {
                    const float l = lsp[ii][e][sp];
                    w[sp] = M == -INFINITY || l == -INFINITY ? 0.0f : exp2f(l - M);
                }
                const float sum = (w[0] + w[2]) + (w[1] + w[3]); // the butterfly's order (x = 16 .. 4 add zeros)
                const float fac = sum > 0.0f ? a.out_scale / sum : 0.0f;
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    float4 acc = make_float4(0, 0, 0, 0);
#pragma unroll
                    for (int sp = 0; sp < NS; sp++) {
                        if (sp >= splits) break;
                        const float ws = w[sp];
                        const float4 x = v[ii][e][sp][q];
                        acc.x += ws * x.x, acc.y += ws * x.y, acc.z += ws * x.z, acc.w += ws * x.w;
                    }
                    float4 *d = reinterpret_cast<float4 *>(a.o + ((size_t)b.row * a.H + b.h0 + h) * kR + b.D0) + q;
                    *d = make_float4(acc.x * fac, acc.y * fac, acc.z * fac, acc.w * fac);
                }
            }
    }
}

} // namespace
} // namespace lm
} // namespace mla_wg

#endif
