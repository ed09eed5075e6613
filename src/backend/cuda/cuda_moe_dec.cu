// The MoE decode experts by warp teams (path 8, cuda_moe.cu's lunar_cuda_moe_experts_run): both
// expert GEMMs of 1-64 tokens as two kernels (gate/up, then down under PDL), each a grid of exactly
// the resident blocks whose warps walk a static list of units.
//
// Why (docs/benchmarks.md "MoE kernels (session 3, H200)"): the kernel pair of cuda_moe.cu gives
// each 4-warp block one 16-row tile with K split 4 ways, i.e. ~7 chunks per warp; every block
// starts with a chain of dependent loads (counts -> active -> offsets -> row_token -> activations)
// during which it streams nothing, and a batch-1 step is ~6 waves of such blocks. Here:
//   - unit = (decode group of <= 8 rows of one expert, 16-row weight tile) over the whole K, taken
//     by a team of S = 1, 2 or 4 warps (split-K, summed in shared memory in a fixed order); S is
//     chosen on the device from the group count so that the rounds of units even out across the
//     grid (the host does not know the routing: decode steps are captured in graphs);
//   - each warp keeps one cp.async ring running across its units (the copies of the next unit are
//     in flight while the current one finishes), and the next unit's route entries are loaded one
//     unit ahead, so no unit starts with a dependent chain of global loads;
//   - a stage is 16 rows x 128 contiguous bytes per matrix (MXFP4: 256 columns, BF16: 64), copied
//     as whole 128-byte lines (8 lanes per row) into a swizzled ring (row parity flips the unit
//     halves, so the fragment reads of rows g and g + 1 hit different banks).
// Consumer math as the pair (the MXFP4 widening and the fragment order are explained at the top
// of cuda_moe.cu): lane (g, c) holds rows g and g + 8 of the tile, 32-column block c of each 128
// columns (MXFP4) or 8-column units c and c + 4 of each 64 (BF16), token g of the group.
#include "backend/cuda/cuda_moe.cuh"

namespace {

constexpr int DW = 8;  // warps per block (two blocks per SM: 16 warps, <= 128 registers each)

template <bool MX>
struct dz {
    static constexpr int U = 8;                          // 16-byte units per row per stage
    static constexpr int CW = MX ? 256 : 64;             // columns per stage
    static constexpr int WB = 16 * U * 16;               // weight bytes per matrix per stage
    static constexpr int SB = MX ? 16 * (U / 4) * 4 : 0;  // scale bytes per matrix per stage
    static constexpr int MAT = WB + SB;
};
// Ring depth: gate/up (two matrices) 3 stages = 2 in flight (8.5 KB per warp, ~136 KB per SM);
// down 5 stages = 4 in flight (same bytes). Both fit two blocks in an SM's 228 KB.
template <bool MX, bool GATEUP>
struct dcfg {
    static constexpr int NM = GATEUP ? 2 : 1;
    static constexpr int ST = GATEUP ? 3 : 5;
    static constexpr int STAGE = NM * dz<MX>::MAT;
    static constexpr int WARP = ST * STAGE;
    static constexpr int RED = NM * 4 * 32 * 4;  // one warp's partial sums (split-K)
    static constexpr int SMEM = DW * (WARP + RED);
};

__device__ __forceinline__ void team_bar(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <bool MX, bool GATEUP>
__global__ void __launch_bounds__(DW * 32, 2) moe_dec2_kernel(xargs a, const int32_t *groups) {
    using Z = dz<MX>;
    using C = dcfg<MX, GATEUP>;
    constexpr int NM = C::NM, ST = C::ST, U = Z::U, CW = Z::CW;
    extern __shared__ __align__(16) unsigned char dsm[];
    pdl_enter();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    unsigned char *ring = dsm + warp * C::WARP;
    float *red = (float *)(dsm + DW * C::WARP);
    const int K = a.K, R = a.R, T = R / 16;
    const int units = a.counts[a.E + 2] * T;  // decode groups x row tiles
    const int nch = (K + CW - 1) / CW;         // stages per row (MXFP4: the last may be half)
    const int W = gridDim.x * DW;
    // split-K: fewest rounds x stages per round, plus half a stage per unit for its fixed cost
    // (barriers, epilogue); the same on every warp
    int S = 1;
    long best = -1;
    for (int s = 1; s <= 4 && s <= nch; s *= 2) {
        const long rounds = (units + W / s - 1) / (W / s), cost = rounds * (2 * ((nch + s - 1) / s) + 1);
        if (best < 0 || cost < best) best = cost, S = s;
    }
    const int TT = W / S, team = (blockIdx.x * DW + warp) / S, ks = warp % S;
    const int j0 = ks * nch / S, j1 = (ks + 1) * nch / S;
    // rows of a matrix are contiguous: MXFP4 K/2 bytes (+ K/32 scale bytes), BF16 2K bytes
    const size_t P = MX ? (size_t)K / 2 : (size_t)K * 2;
    auto wbase = [&](int i) -> const uint8_t * {
        return MX ? a.wq[i] : (const uint8_t *)a.wb[i];
    };

    // ---- producer: this warp's (unit, stage) sequence, ST - 1 stages ahead of the consumer
    int pu = team, pj = j0, pc = 0;
    int pe = pu < units ? __ldg(groups + 2 * (pu / T)) : 0;
    int pnext = pu + TT < units ? __ldg(groups + 2 * ((pu + TT) / T)) : 0;  // expert of the next unit
    const uint8_t *pq[NM], *ps[NM];
    auto set_ptrs = [&]() {
        const size_t row = (size_t)pe * R + (size_t)(pu % T) * 16;
#pragma unroll
        for (int i = 0; i < NM; i++) {
            // virtual expert E: the shared expert's own BF16 matrices (route_one with shared = 1)
            pq[i] = !MX && pe == a.E ? (const uint8_t *)a.sb[i] + (size_t)(pu % T) * 16 * P : wbase(i) + row * P;
            ps[i] = MX ? a.ws[i] + row * (size_t)(K / 32) : nullptr;
        }
    };
    set_ptrs();
    auto issue = [&]() {
        if (pu < units) {
            unsigned char *st = ring + (pc % ST) * C::STAGE;
            const int nu = min(U, (K - pj * CW) / (CW / U));  // MXFP4 K % 256 == 128: a half stage
#pragma unroll
            for (int i = 0; i < NM; i++) {
                const uint8_t *src = pq[i] + (size_t)pj * 128;
                unsigned char *sm = st + i * Z::MAT;
#pragma unroll
                for (int cp = 0; cp < U / 2; cp++) {
                    const int idx = cp * 32 + lane, row = idx / U, unit = idx % U;
                    if (unit < nu) cp_async16(sm + (row * U + (unit ^ ((row & 1) << 2))) * 16, src + row * P + unit * 16);
                }
                if (MX) {
                    const int row = lane >> 1, wd = lane & 1;  // 16 rows x 2 scale words
                    if (wd * 4 < nu) cp_async4(sm + Z::WB + lane * 4, ps[i] + row * (size_t)(K / 32) + pj * 8 + wd * 4);
                }
            }
            if (++pj >= j1) {
                pu += TT, pj = j0;
                if (pu < units) {
                    pe = pnext;
                    set_ptrs();
                    pnext = pu + TT < units ? __ldg(groups + 2 * ((pu + TT) / T)) : 0;
                }
            }
        }
        cp_async_commit();
        pc++;
    };
#pragma unroll
    for (int p = 0; p < ST - 1; p++) issue();

    // ---- consumer. The route entries of unit u + TT are loaded while u runs (nx_*).
    int nx_e = 0, nx_start = 0, nx_end = 0, nx_row = 0;
    auto meta = [&](int u) {
        nx_e = __ldg(groups + 2 * (u / T)), nx_start = __ldg(groups + 2 * (u / T) + 1);
    };
    auto meta2 = [&]() {  // the entries that depend on the group's expert and first row
        nx_end = __ldg(a.offsets + nx_e + 1);
        nx_row = GATEUP ? __ldg(a.row_token + min(nx_start + g, nx_end - 1)) : nx_start + g;
    };
    if (team < units) meta(team), meta2();
    int cc = 0;
    for (int u = team; u < units; u += TT) {
        const int row0 = (u % T) * 16, start = nx_start, m = min(DEC_G, nx_end - nx_start);
        const bool tok = g < m;
        const uint16_t *xr = a.x + (size_t)(tok ? nx_row : 0) * K;
        const bool more = u + TT < units;
        if (more) meta(u + TT);
        float acc[NM][4];
#pragma unroll
        for (int i = 0; i < NM; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        for (int j = j0; j < j1; j++, cc++) {
            // this stage's activations first: their latency overlaps the wait for the ring
            constexpr int NX = MX ? 8 : 2;
            uint4 xv[NX];
#pragma unroll
            for (int q = 0; q < NX; q++) {
                const int col = MX ? j * CW + (q >> 2) * 128 + c * 32 + (q & 3) * 8 : j * CW + q * 32 + c * 8;
                xv[q] = tok && col < K ? __ldg((const uint4 *)(xr + col)) : make_uint4(0, 0, 0, 0);
            }
            cp_async_wait<ST - 2>();
            __syncwarp();  // every lane's copies of this stage have landed; all lanes are past the last one
            issue();       // into the stage consumed last step
            if (j == j0 && more) meta2();
            const unsigned char *st = ring + (cc % ST) * C::STAGE;
            if (MX) {
#pragma unroll
                for (int sub = 0; sub < 2; sub++) {
                    if (j * CW + sub * 128 >= K) break;
                    const int sw = (sub * 4 + c) ^ ((g & 1) << 2);
                    uint4 wa[NM], wb[NM];
                    mxscale sa[NM], sb[NM];
                    bool two = false;
#pragma unroll
                    for (int i = 0; i < NM; i++) {
                        const unsigned char *sm = st + i * Z::MAT;
                        wa[i] = *(const uint4 *)(sm + (g * U + sw) * 16);
                        wb[i] = *(const uint4 *)(sm + ((g + 8) * U + sw) * 16);
                        const uint32_t *sc = (const uint32_t *)(sm + Z::WB);
                        sa[i] = mx_scale((sc[g * 2 + sub] >> (8 * c)) & 255u);
                        sb[i] = mx_scale((sc[(g + 8) * 2 + sub] >> (8 * c)) & 255u);
                        two = two || sa[i].two || sb[i].two;
                    }
                    two = __any_sync(0xffffffffu, two);  // warp-uniform: one widening path per step
#pragma unroll
                    for (int w = 0; w < 4; w++) {
                        uint32_t px[4];
                        pairs_bf16(xv[sub * 4 + w], px);
#pragma unroll
                        for (int i = 0; i < NM; i++) {
                            const uint32_t qa = w == 0 ? wa[i].x : w == 1 ? wa[i].y : w == 2 ? wa[i].z : wa[i].w;
                            const uint32_t qb = w == 0 ? wb[i].x : w == 1 ? wb[i].y : w == 2 ? wb[i].z : wb[i].w;
                            uint32_t pa[4], pb[4];
                            if (two) {
                                pairs_mx<true>(qa, sa[i], pa);
                                pairs_mx<true>(qb, sb[i], pb);
                            } else {
                                pairs_mx<false>(qa, sa[i], pa);
                                pairs_mx<false>(qb, sb[i], pb);
                            }
                            mma_bf16(acc[i], pa[0], pb[0], pa[1], pb[1], px[0], px[1]);
                            mma_bf16(acc[i], pa[2], pb[2], pa[3], pb[3], px[2], px[3]);
                        }
                    }
                }
            } else {
#pragma unroll
                for (int h2 = 0; h2 < 2; h2++) {
                    const int sw = (h2 * 4 + c) ^ ((g & 1) << 2);
                    uint32_t px[4];
                    pairs_bf16(xv[h2], px);
#pragma unroll
                    for (int i = 0; i < NM; i++) {
                        const unsigned char *sm = st + i * Z::MAT;
                        uint32_t pa[4], pb[4];
                        pairs_bf16(*(const uint4 *)(sm + (g * U + sw) * 16), pa);
                        pairs_bf16(*(const uint4 *)(sm + ((g + 8) * U + sw) * 16), pb);
                        mma_bf16(acc[i], pa[0], pb[0], pa[1], pb[1], px[0], px[1]);
                        mma_bf16(acc[i], pa[2], pb[2], pa[3], pb[3], px[2], px[3]);
                    }
                }
            }
        }
        if (S > 1) {
            // team members' partials to the leader (ks 0), summed in ks order; the second barrier
            // keeps a member from overwriting its partials before the leader has read them
            const int bar = 1 + warp / S;
            if (ks) {
                float *mine = red + (size_t)warp * NM * 4 * 32;
#pragma unroll
                for (int i = 0; i < NM; i++)
#pragma unroll
                    for (int v = 0; v < 4; v++) mine[(i * 4 + v) * 32 + lane] = acc[i][v];
            }
            team_bar(bar, 32 * S);
            if (!ks)
                for (int s2 = 1; s2 < S; s2++) {
                    const float *o = red + (size_t)(warp + s2) * NM * 4 * 32;
#pragma unroll
                    for (int i = 0; i < NM; i++)
#pragma unroll
                        for (int v = 0; v < 4; v++) acc[i][v] += o[(i * 4 + v) * 32 + lane];
                }
            team_bar(bar, 32 * S);
        }
        if (!ks) {
            // C fragment: (row g, tokens 2c, 2c+1), (row g+8, tokens 2c, 2c+1)
#pragma unroll
            for (int v = 0; v < 4; v++) {
                const int tk = 2 * c + (v & 1), row = row0 + g + (v < 2 ? 0 : 8);
                if (tk >= m) continue;
                const size_t pr = (size_t)(start + tk);
                if (GATEUP) {
                    const __nv_bfloat16 hb = __float2bfloat16_rn(glu_act(acc[0][v], acc[NM - 1][v], a.act, a.beta, a.beta_l));
                    a.h[pr * R + row] = *reinterpret_cast<const uint16_t *>(&hb);
                } else {
                    a.y[pr * R + row] = acc[0][v] * __ldg(a.row_weight + pr);
                }
            }
        }
    }
    cp_async_wait<0>();
}

template <bool MX, bool GATEUP>
void dec2_launch(const xargs &a, const int32_t *groups, int blocks, cudaStream_t st) {
    using C = dcfg<MX, GATEUP>;
    static int grid = 0;
    if (!grid) {
        int dev = 0, sms = 0, per = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        CUDA_CHECK(cudaFuncSetAttribute(moe_dec2_kernel<MX, GATEUP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        C::SMEM));
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, moe_dec2_kernel<MX, GATEUP>, DW * 32, C::SMEM));
        CUDA_REQUIRE(per >= 1);
        grid = sms * per;
    }
    launch_pdl(moe_dec2_kernel<MX, GATEUP>, dim3(blocks > 0 ? blocks : grid), dim3(DW * 32), (size_t)C::SMEM, st, a,
               groups);
    CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_dec2_experts(const xargs &g, const xargs &d, bool mx, const int32_t *groups, int blocks, cudaStream_t st) {
    if (mx) {
        dec2_launch<true, true>(g, groups, blocks, st);
        dec2_launch<true, false>(d, groups, blocks, st);
    } else {
        dec2_launch<false, true>(g, groups, blocks, st);
        dec2_launch<false, false>(d, groups, blocks, st);
    }
}
