// The BF16 MoE decode pair (path 1, cuda_moe.cu's moe_decode_kernel at NT = 1 with its opt bits
// compiled out) with a shorter block start-up: LUNAR_MOE_BF16_EARLY (issue 9, session 13; at one token the default).
//
// Why (docs/benchmarks.md "Decode B = 1: the BF16 MoE pair (session 12, H200)"): on Kimi-Linear at
// batch 1 both kernels are bound by their warps' load latency, and every block starts with a chain
// of dependent loads before its first weight load: the wait, counts[E], active[slot], offsets[e],
// (gate/up) row_token, then the weights. The gate/up grid is one wave (512 blocks), the down grid
// 1.75 (1152 blocks of 32 KB each), so that chain is paid once or twice per kernel on the step's
// critical path. Path 16 (the MXFP4 pair) cut the same chain ("MoE decode, MXFP4, the TP8 slice
// (session 10, H200)"); two of its bits on the BF16 pair:
//   bit 2: counts[E] and active[slot] loaded together, not behind the branch on the count (active
//     has >= the grid's slots entries in the route's workspace; the value is used only for a live
//     slot): one dependent round trip less in both kernels;
//   bit 4 (set by the host only for one token): the one-token route gives each expert one row at
//     offsets[e] = its slot (route-one, and the permutation of one token) and row_token 0, so
//     neither is loaded: two round trips less in gate/up, one in down.
// Measured (H200, docs/benchmarks.md "Decode B = 1: the BF16 pair's start-up (session 13, H200)"):
// each kernel alone on Kimi-Linear's one-token case, down 14.05-14.34 us (the pair) -> 13.98 (bit 2),
// 13.31 (bit 4); `=6` in the step: B = 1 TPOT -1.6 / -1.8 % in two rounds (lead's call). Path 16's bit 1 (the down kernel's weights fetched
// before griddepcontrol.wait, here staged by 16-byte cp.async into shared memory) made the down
// kernel 23.6-24.5 us alone and the step 8 % slower: left out of the tree (`git show deac98f`).
// The arithmetic is the replaced kernel's (the same fragments, mma order and split-K order): h and the
// expert rows are bit-equal to it (test cuda_moe_bf16_early_vs_pair).
#include <stdlib.h>

#include "backend/cuda/cuda_moe.cuh"

namespace {

template <bool GATEUP, int S>
__global__ void __launch_bounds__(128, 4) moe_bf16_early_kernel(xargs a, uint32_t eb) {
    constexpr int NM = GATEUP ? 2 : 1, RT = 4 / S;
    extern __shared__ __align__(16) float red[];  // [4 warps][NM 4][32] when S > 1 (dec_splitk_sum)
    const bool together = (eb & 2u) != 0, one = (eb & 4u) != 0;
    pdl_wait();
    const int slot = blockIdx.y;
    int e = -1;
    bool live;
    if (together) {
        const int cnt = a.counts[a.E], ev = a.active[slot];
        live = slot < cnt, e = ev;
    } else {
        live = slot < a.counts[a.E];
        if (live) e = a.active[slot];
    }
    if (!live) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int rt = warp / S, ks = warp % S;
    const int tile = blockIdx.x * RT + rt;
    const bool tile_ok = tile * 16 < a.R;
    const int J = a.K / 128, j0 = ks * J / S, j1 = (ks + 1) * J / S;
    const int ra = tile * 16 + g, rb = ra + 8;
    const size_t estr = (size_t)a.R * a.K;  // elements per expert matrix
    const int off = one ? slot : a.offsets[e], m = one ? 1 : a.offsets[e + 1] - off;
    for (int t0 = 0; t0 < m; t0 += 8) {
        float acc[NM][1][4];
#pragma unroll
        for (int i = 0; i < NM; i++) acc[i][0][0] = acc[i][0][1] = acc[i][0][2] = acc[i][0][3] = 0.0f;
        const int tk = t0 + g;
        const bool tok_ok[1] = {tk < m};
        const int row = tok_ok[0] ? (GATEUP ? (one ? 0 : a.row_token[off + tk]) : off + tk) : 0;
        const uint16_t *const xr[1] = {a.x + (size_t)row * a.K};
        if (tile_ok && j0 < j1) dec_bf16_chunks<NM, 1>(acc, a, e, estr, ra, rb, c, j0, j1, xr, tok_ok);
        if (S > 1) dec_splitk_sum<NM * 4, S>(&acc[0][0][0], red, warp, ks, lane);
        if (ks == 0 && tile_ok) {
            // C fragment: (row g, tokens 2c, 2c+1), (row g+8, tokens 2c, 2c+1)
#pragma unroll
            for (int v = 0; v < 4; v++) {
                const int t = t0 + 2 * c + (v & 1), r = v < 2 ? ra : rb;
                if (t >= m) continue;
                const size_t pr = (size_t)(off + t);
                if (GATEUP) {
                    const __nv_bfloat16 hb = __float2bfloat16_rn(glu_act(acc[0][0][v], acc[NM - 1][0][v], a.act, a.beta, a.beta_l));
                    a.h[pr * a.R + r] = *reinterpret_cast<const uint16_t *>(&hb);
                } else {
                    a.y[pr * a.R + r] = acc[0][0][v] * a.row_weight[pr];
                }
            }
        }
    }
}

template <bool GATEUP, int S>
void early_launch(const xargs &a, int slots, uint32_t eb, cudaStream_t st) {
    const size_t smem = S > 1 ? (size_t)4 * (GATEUP ? 2 : 1) * 4 * 32 * 4 : 0;
    launch_pdl(moe_bf16_early_kernel<GATEUP, S>, dim3(ceil_div_u(a.R / 16, 4 / S), slots), dim3(128), smem, st, a,
               eb);
    CUDA_CHECK_LAUNCH();
}

// the pair's split rule (cuda_moe.cu decode_launch, LUNAR_MOE_DEC_SPLIT unset)
template <bool GATEUP>
void early_split(const xargs &a, int slots, uint32_t eb, cudaStream_t st) {
    const int J = a.K / 128;
    if (J >= 8) early_launch<GATEUP, 4>(a, slots, eb, st);
    else if (J >= 4) early_launch<GATEUP, 2>(a, slots, eb, st);
    else early_launch<GATEUP, 1>(a, slots, eb, st);
}

}  // namespace

// LUNAR_MOE_BF16_EARLY (bits, read at every launch so that the op test can sweep them; graphs
// capture the value): 2 the count and expert id together, 4 at one token no offsets / row_token loads
// (masked off here for n > 1); bit 1 (session 13's staging before the wait) is no more and is ignored.
// 0: the pair of cuda_moe.cu (this returns 0 and launches nothing). Unset: 6 at one token (the default
// since session 13: Kimi-Linear-48B B = 1 TPOT 2.609 / 2.578 -> 2.568 / 2.531 ms in two alternating
// rounds, "Session 13, lead's call"), the pair above one token (bit 2 alone not timed in a step).
int moe_bf16_early_pair(const xargs &g, const xargs &d, int n, int slots, cudaStream_t st) {
    const char *v = getenv("LUNAR_MOE_BF16_EARLY");
    uint32_t eb = v ? (uint32_t)atoi(v) & 6u : n == 1 ? 6u : 0u;
    if (n != 1) eb &= ~4u;
    if (!eb) return 0;
    early_split<true>(g, slots, eb, st);
    early_split<false>(d, slots, eb, st);
    return 1;
}
