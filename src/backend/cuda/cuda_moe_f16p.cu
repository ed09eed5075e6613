// Path 16 at ONE token as one persistent kernel fed by bulk copies (LUNAR_MOE_F16_FUSED; issue 8, session 17).
//
// Why: at one token the pair (cuda_moe_f16.cu) streams K3.1's 280.8 MB in 104 us, 1.46x the bytes' floor,
// while its copy ring alone takes 84 us: the consumers hold the ring (each warp refills a stage only after
// consuming it), and the TP8 slice (35 MB, 2.5x) pays two launches' start-up, a gate/up grid of 0.73 waves and
// the route chain in every block. Here one block per SM walks a flat list of items of BOTH GEMMs:
//   phase 1: (slot, 16-row tile) of w1 and w3 (gate/up: h in f16, as the pair's gate/up kernel),
//   phase 2: (slot, group of MT2 16-row tiles) of w2 (down: y = rows x the row weight),
// each block a contiguous run of each phase's list (neighbouring rows of one expert: contiguous bytes).
// Warp C (the producer) copies every item's rows with 1-D bulk copies (cp.async.bulk, one per row into a
// padded pitch, and one for the tile's scale bytes, which are contiguous) into a ring of NS stages with full /
// empty mbarriers, running ahead as far as the ring allows, across the phase boundary (the down weights do not
// depend on h). The C consumer warps do what path 16 does per chunk of 128 columns (ldmatrix, widen_f16,
// two f16 mma per 32-column scale block, the scale FFMA; the activations in shared memory in the mma's pair
// order, as XS) with the k range of each tile split across them interleaved (warp w: chunks w, w + C, ..., as
// V_IL), their partials summed in shared memory in warp order (deterministic; other partials than the pair's,
// so the values differ from it in the last bits).
//
// Bank conflicts: a row of K / 2 bytes is 0 mod 128 bytes for K3.1's K (3584, 3072), so 8 rows read at the
// same column by ldmatrix would hit one 16-byte bank group 8 times; the rows sit at a pitch P whose P / 16 is
// odd (K / 2 or K / 2 + 16), which puts the 8 rows of each 8x8 matrix in 8 distinct bank groups.
//
// Between the phases: the down items of slot s read all of h[s]. Per-slot counters (g_fu_sync, a module
// global: zero at load, put back to zero by the last block of every launch): each block adds its run of slot s's
// gate/up items after their h stores (the storing warp's __syncwarp, then __threadfence and a release add, once
// after the run's last item), the down items of slot s
// wait (one thread, ld.acquire.gpu, then the consumers' named barrier) until the count is the slot's gate/up
// item count, and read h with coherent loads (ld.global.cg). A block's items are all of its phase-1 items before any
// of its phase-2 items, so the waits form no cycle as long as every block is resident at once: the grid is the
// SM count and one block fits an SM (its shared memory is sized to one block an SM, > 114 KB for K3.1). The
// launch is a plain one (launch_pdl, not cooperative), also inside the decode step's CUDA graph: its blocks
// take SMs as the predecessor drains, and no later kernel can take an SM first, since the dependent launch
// (griddepcontrol.launch_dependents, in pdl_wait) fires only when every block of this grid has executed it,
// i.e. is resident. The counters are per device module, so two launches must not run concurrently on one
// device (decode runs one stream).
//
// The route: the expert ids, the count and the row weights are the route kernel's output, written just before
// this launch, so nothing is read (or copied) before pdl_wait (cuda_common.cuh's rule); the route of one token
// gives slot s the row s (offsets[e] = the slot, row_token = 0: path 16's EARLY bit 4, its default at one token).
#include <type_traits>

#include "backend/cuda/cuda_mbarrier.cuh"
#include "backend/cuda/cuda_moe_f16.cuh"

namespace {

constexpr int FU_SLOTS = 64;  // the most active slots (K3.1: 16)
// [0, FU_SLOTS): per slot, the gate/up items done; [FU_SLOTS]: the blocks done (the last one resets all)
__device__ uint32_t g_fu_sync[FU_SLOTS + 1];

__device__ __forceinline__ uint32_t saddr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
// [src, src + bytes) into shared memory at dst, completing on the mbarrier bar (16-byte aligned / multiple)
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_gpu(uint32_t *p, uint32_t v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// the consumer warps' barrier (named barrier 1; the producer warp never joins)
__device__ __forceinline__ void cons_sync(int threads) { asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory"); }

// The host's layout of the dynamic shared memory and the item lists
struct fu_geom {
    int T1, T2g, MT2;  // gate/up tiles a slot; down items a slot (groups of MT2 tiles)
    uint32_t P1, P2;   // row pitches (bytes) of the gate/up and down stages
    uint32_t sb, ns;   // stage bytes, stages
    uint32_t off_x, off_h, off_red, off_bar;
    uint32_t red_n;  // floats of the partial sums (RD x C x RW), then 2 RD counters
};

// one 32-column scale block of rows g and g + 8 (this lane's words wa, wb: 8 E2M1 nibbles each) against the
// activations' pairs xv: the rows' block sums before the scale (the mma's token column: blk[0], blk[2]). The
// place where another widening (FP8 mma of E5M2 weights, say) would drop in.
__device__ __forceinline__ float2 mx_block_f16(uint32_t wa, uint32_t wb, uint4 xv) {
    uint32_t pa[4], pb[4];
    widen_f16(wa, pa);
    widen_f16(wb, pb);
    float blk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_f16(blk, pa[0], pb[0], pa[1], pb[1], xv.x, xv.y);
    mma_f16(blk, pa[2], pb[2], pa[3], pb[3], xv.z, xv.w);
    return make_float2(blk[0], blk[2]);
}

// C consumer warps + 1 producer warp; LW: an item's partials summed by the last warp to finish it (else warp 0
// after a barrier of the consumers at every item)
template <int C, bool LW>
__global__ void __launch_bounds__(32 * (C + 1), 1) moe_f16_fused_kernel(xargs g, xargs d, int slots, fu_geom q) {
    extern __shared__ __align__(128) uint8_t sm[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint64_t *bars = (uint64_t *)(sm + q.off_bar);  // full [ns], empty [ns]
    int *ex = (int *)(bars + 2 * q.ns);              // slot -> expert id, -1 out of range (never, from the route)
    const uint32_t full0 = saddr(bars), empty0 = saddr(bars + q.ns);
    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < q.ns; s++) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, C);
        // the barriers' initialisation visible to the bulk copies (the async proxy)
        asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;" ::: "memory");
    }
    if (threadIdx.x < 8) ((uint32_t *)(sm + q.off_red))[q.red_n + threadIdx.x] = 0u;  // rcnt, rgen (consumers)
    pdl_wait();  // the route and the activations: the predecessors' output
    const int L = min(g.counts[g.E], slots);
    for (int s = threadIdx.x; s < L; s += blockDim.x) {
        const int e = g.active[s];
        ex[s] = e >= 0 && e < g.E ? e : -1;
    }
    // the latent (token 0) as f16 pairs (x_f16: the mma's pair order), as path 16's XS
    uint4 *xs = (uint4 *)(sm + q.off_x);
    for (int i = threadIdx.x; i < g.K / 8; i += blockDim.x) {
        uint32_t px[4];
        x_f16(__ldg((const uint4 *)g.x + i), px);
        xs[i] = make_uint4(px[0], px[1], px[2], px[3]);
    }
    __syncthreads();
    const int G = gridDim.x, b = blockIdx.x;
    const int N1 = L * q.T1, N2 = L * q.T2g;
    const int a1 = (int)((long long)b * N1 / G), e1 = (int)((long long)(b + 1) * N1 / G);
    const int a2 = (int)((long long)b * N2 / G), e2 = (int)((long long)(b + 1) * N2 / G);
    const int K1 = g.K, K2 = d.K;
    const size_t estr1 = (size_t)g.R * K1, estr2 = (size_t)d.R * K2;

    if (warp == C) {
        // the producer: tile after tile of the same sequence as the consumers (qi), each into stage qi % ns
        uint32_t qi = 0;
        // rows rows from r0 of expert e's matrix (wq, wsc), their scale bytes after srow rows of the stage
        auto put = [&](const uint8_t *wq, const uint8_t *wsc, int K, uint32_t P, int srow, int e, size_t estr,
                       int r0, int rows) {
            const uint32_t st = qi % q.ns, par = ((qi / q.ns) & 1u) ^ 1u;
            mbar_wait(empty0 + 8 * st, par);  // the consumers are done with the stage's last tile
            const uint32_t full = full0 + 8 * st, dst = saddr(sm + (size_t)st * q.sb);
            const uint32_t rb = (uint32_t)K / 2;
            if (lane == 0) mbar_expect_tx(full, e >= 0 ? (uint32_t)rows * (rb + rb / 16) : 0u);
            __syncwarp();
            if (e >= 0) {
                const uint8_t *src = wq + e * estr / 2 + (size_t)r0 * rb;
                for (int r = lane; r < rows; r += 32) bulk_g2s(dst + r * P, src + (size_t)r * rb, rb, full);
                if (lane == 31)  // the rows' scale bytes: contiguous, rows x K / 32
                    bulk_g2s(dst + (uint32_t)srow * P, wsc + e * estr / 32 + (size_t)r0 * (K / 32), (uint32_t)rows * (rb / 16), full);
            }
            qi++;
        };
        for (int i = a1; i < e1; i++) {
            const int s = i / q.T1, r0 = (i - s * q.T1) * 16;
            put(g.wq[0], g.ws[0], K1, q.P1, 16, ex[s], estr1, r0, 16);
            put(g.wq[1], g.ws[1], K1, q.P1, 16, ex[s], estr1, r0, 16);
        }
        for (int i = a2; i < e2; i++) {
            const int s = i / q.T2g, r0 = (i - s * q.T2g) * 16 * q.MT2;
            put(d.wq[0], d.ws[0], K2, q.P2, 16 * q.MT2, ex[s], estr2, r0, min(16 * q.MT2, d.R - r0));
        }
        return;  // the copies complete on the barriers the consumers wait on
    }

    // the consumers
    constexpr int NT = 32 * C, RD = 4;  // RD: the items whose partial sums can be in shared memory at once
    const int gq = lane >> 2, c = lane & 3, lr = lane & 7, lm = lane >> 3;
    const int RW = (q.MT2 > 2 ? q.MT2 : 2) * 16;   // a warp's partials: 2 matrices (gate/up) or MT2 tiles (down)
    float *red = (float *)(sm + q.off_red);          // [RD][C][RW]
    uint32_t *rcnt = (uint32_t *)(red + RD * C * RW);  // [RD] the warps' arrivals (LW), [RD] epilogues done
    volatile uint32_t *rgen = rcnt + RD;
    uint4 *hs = (uint4 *)(sm + q.off_h);  // the down activations (h of one slot) as f16 pairs
    uint32_t qi = 0;                      // the tile sequence (the producer's)
    int n = 0, ub = 0, cur = -1;          // this block's items so far; the chunk turn; the slot whose h is in hs
    // warp `warp`'s partial sums of rows (g, g + 8) of tile t of the NM stages st[] (K columns, pitch P; the scale
    // bytes of rows 0.. after srow rows): the chunks j whose turn (ub + t J + j) % C is the warp's (interleaved
    // k-splits; the turn runs on across tiles and items, so no warp is always the one with a chunk more)
    auto tile_sum = [&](auto nm, const uint32_t *st, int t, int srow, int K, uint32_t P, const uint4 *xsrc,
                        float (&acc)[2][2]) {
        constexpr int NM = decltype(nm)::value;
        const int J = K / 128, KW = K / 128;  // chunks a row; scale words a row
#pragma unroll
        for (int i = 0; i < NM; i++) acc[i][0] = acc[i][1] = 0.0f;
        const int jf = ((warp - ub - t * J) % C + C) % C;
        for (int j = jf; j < J; j += C) {
            uint32_t wa[NM][4], wb[NM][4], swa[NM], swb[NM];
#pragma unroll
            for (int i = 0; i < NM; i++) {
                const uint8_t *base = sm + (size_t)st[i] * q.sb;
                const uint32_t a0 = saddr(base) + (uint32_t)(16 * t + lr) * P + 64u * j + 16u * lm;
                ldsm_x4(wa[i], a0);
                ldsm_x4(wb[i], a0 + 8 * P);
                const uint32_t *sw = (const uint32_t *)(base + (size_t)srow * P);
                swa[i] = sw[(16 * t + gq) * KW + j];
                swb[i] = sw[(16 * t + gq + 8) * KW + j];
            }
#pragma unroll
            for (int bb = 0; bb < 4; bb++) {
                const uint4 xv = xsrc[16 * j + 4 * bb + c];
#pragma unroll
                for (int i = 0; i < NM; i++) {
                    const float2 v = mx_block_f16(wa[i][bb], wb[i][bb], xv);
                    acc[i][0] = fmaf(scale_f(swa[i], bb), v.x, acc[i][0]);
                    acc[i][1] = fmaf(scale_f(swb[i], bb), v.y, acc[i][1]);
                }
            }
        }
    };
    using one_t = std::integral_constant<int, 1>;
    using two_t = std::integral_constant<int, 2>;
    // after the warp's partials of item n are in red[n % RD]: whether this warp sums the item. LW: the last warp
    // to arrive (a shared-memory count; the others go on to their next item), else warp 0 after a barrier
    auto sums_item = [&]() -> bool {
        if constexpr (LW) {
            __syncwarp();
            uint32_t old = 0;
            if (lane == 0) __threadfence_block(), old = atomicAdd(&rcnt[n % RD], 1u);
            old = __shfl_sync(0xffffffffu, old, 0);
            const bool last = old % C == C - 1;  // the count only grows: C arrivals an item
            if (last) __threadfence_block(), __syncwarp();  // lane 0 saw the count: every lane then reads
            return last;
        } else {
            cons_sync(NT);
            return warp == 0;
        }
    };
    // before writing item n's partials: the epilogue of item n - RD (the slot's previous user) has read them
    auto red_free = [&]() {
        if (n >= RD)
            while (rgen[n % RD] < (uint32_t)(n / RD)) {
            }
    };
    auto red_done = [&]() {
        __syncwarp();
        if (lane == 0) __threadfence_block(), rgen[n % RD] = (uint32_t)(n / RD + 1);
    };

    for (int i = a1; i < e1; i++, n++) {
        const int s = i / q.T1, r0 = (i - s * q.T1) * 16;
        const uint32_t st[2] = {qi % q.ns, (qi + 1) % q.ns};
        mbar_wait(full0 + 8 * st[0], (qi / q.ns) & 1u);
        mbar_wait(full0 + 8 * st[1], ((qi + 1) / q.ns) & 1u);
        float acc[2][2];
        tile_sum(two_t{}, st, 0, 16, K1, q.P1, xs, acc);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * st[0]), mbar_arrive(empty0 + 8 * st[1]);
        qi += 2, ub = (ub + K1 / 128) % C;
        red_free();
        float *rb = red + (size_t)(n % RD) * C * RW;
        if (c == 0) {
            float *rp = rb + warp * RW;
            rp[gq] = acc[0][0], rp[gq + 8] = acc[0][1], rp[16 + gq] = acc[1][0], rp[16 + gq + 8] = acc[1][1];
        }
        if (sums_item()) {
            float sg = 0.0f, su = 0.0f;
            if (lane < 16)
                for (int w = 0; w < C; w++) sg += rb[w * RW + lane], su += rb[w * RW + 16 + lane];
            red_done();
            if (lane < 16 && ex[s] >= 0) {
                const float hv = glu_act(sg * 8192.0f, su * 8192.0f, g.act, g.beta, g.beta_l);
                __half hh = __float2half_rn(hv);  // f16: the down phase reads it as is
                g.h[(size_t)s * g.R + r0 + lane] = *reinterpret_cast<uint16_t *>(&hh);
            }
        }
        // the slot's count, once per run of its items in this block (a fence per item would cost ~1 us each):
        // after the run's last item, every consumer warp (the items' h stores, by whichever warp summed each)
        if (i + 1 == e1 || (i + 1) / q.T1 != s) {
            cons_sync(NT);
            if (threadIdx.x == 0) __threadfence(), red_release_gpu(&g_fu_sync[s], (uint32_t)(i + 1 - max(a1, s * q.T1)));
        }
    }
    for (int i = a2; i < e2; i++, n++) {
        const int s = i / q.T2g, r0 = (i - s * q.T2g) * 16 * q.MT2, mt = min(q.MT2, (d.R - r0) / 16);
        if (s != cur) {
            // all of h[s]: every gate/up item of slot s has been counted (and hs's readers are done)
            cons_sync(NT);
            if (threadIdx.x == 0) {
                while (ld_acquire_gpu(&g_fu_sync[s]) < (uint32_t)q.T1) __nanosleep(64);
                __threadfence();
            }
            cons_sync(NT);
            // written in this launch: coherent loads at L2 (ld.global.cg), never the non-coherent path
            const uint4 *hp = (const uint4 *)(d.x + (size_t)s * K2);
            for (int k = threadIdx.x; k < K2 / 8; k += NT) {
                uint32_t px[4];
                x_pairs(__ldcg(hp + k), px);
                hs[k] = make_uint4(px[0], px[1], px[2], px[3]);
            }
            cons_sync(NT);
            cur = s;
        }
        const uint32_t st[1] = {qi % q.ns};
        mbar_wait(full0 + 8 * st[0], (qi / q.ns) & 1u);
        red_free();  // before the tiles: each tile's partials go to red as they are done
        float *rb = red + (size_t)(n % RD) * C * RW;
        for (int t = 0; t < mt; t++) {
            float acc[2][2];
            tile_sum(one_t{}, st, t, 16 * q.MT2, K2, q.P2, hs, acc);
            if (c == 0) rb[warp * RW + 16 * t + gq] = acc[0][0], rb[warp * RW + 16 * t + gq + 8] = acc[0][1];
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * st[0]);
        qi++, ub = (ub + mt * (K2 / 128)) % C;
        if (sums_item()) {
            float sy[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                sy[u] = 0.0f;
                if (lane + 32 * u < 16 * mt)
                    for (int w = 0; w < C; w++) sy[u] += rb[w * RW + lane + 32 * u];
            }
            red_done();
            if (ex[s] >= 0) {
                const float rw = d.row_weight[s] * 8192.0f;
#pragma unroll
                for (int u = 0; u < 4; u++)
                    if (lane + 32 * u < 16 * mt) d.y[(size_t)s * d.R + r0 + lane + 32 * u] = sy[u] * rw;
            }
        }
    }
    // the last block to finish puts the counters back (no block reads them any more in this launch)
    cons_sync(NT);
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&g_fu_sync[FU_SLOTS], 1u) == (uint32_t)G - 1) {
            for (int s = 0; s < FU_SLOTS; s++) g_fu_sync[s] = 0;
            g_fu_sync[FU_SLOTS] = 0;
            __threadfence();
        }
    }
}

// LUNAR_MOE_F16_FUSED (read at every launch: the op tests and the bench switch it): 1 or 8: this kernel with
// 8 consumer warps, 4 / 16: with 4 / 16; unset or 0: the pair
int fused_mode() {
    const char *v = getenv("LUNAR_MOE_F16_FUSED");
    const int m = v ? atoi(v) : 0;
    return m == 1 || m == 8 ? 8 : m == 4 || m == 16 ? m : 0;
}

// LUNAR_MOE_F16_FUSED_LW (read at every launch): 0: the items' partials summed by warp 0 after a barrier of
// the consumer warps at every item; unset or 1: by the last warp to finish the item (the kernel's LW)
bool lw_mode() {
    const char *v = getenv("LUNAR_MOE_F16_FUSED_LW");
    return !v || atoi(v) != 0;
}

int dev_attr(cudaDeviceAttr at) {
    static int cache[2][8];
    const int k = at == cudaDevAttrMultiProcessorCount ? 0 : 1;
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    if (dev >= 0 && dev < 8 && cache[k][dev]) return cache[k][dev];
    int n = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&n, at, dev));
    if (dev >= 0 && dev < 8) cache[k][dev] = n;
    return n;
}

// a row pitch whose 16-byte units are odd: the 8 rows of an ldmatrix in 8 distinct bank groups
uint32_t pitch_of(int K) { return (uint32_t)(K / 32 % 2 ? K / 2 : K / 2 + 16); }

template <int C, bool LW>
void launch_c(const xargs &g, const xargs &d, int slots, const fu_geom &q, size_t smem, cudaStream_t st) {
    static size_t opted[8];
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    if (smem > 48 * 1024 && (dev < 0 || dev >= 8 || smem > opted[dev])) {
        CUDA_CHECK(cudaFuncSetAttribute(moe_f16_fused_kernel<C, LW>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        if (dev >= 0 && dev < 8) opted[dev] = smem;
    }
    launch_pdl(moe_f16_fused_kernel<C, LW>, dim3(dev_attr(cudaDevAttrMultiProcessorCount)), dim3(32 * (C + 1)), smem, st, g,
               d, slots, q);
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

}  // namespace

// launches of this kernel in the process (host side; the op test checks that its cases ran it, not the pair)
extern "C" {
long lunar_moe_f16_fused_launches = 0;
}

bool moe_f16_fused_decode(const xargs &g, const xargs &d, int slots, cudaStream_t st) {
    const int C = fused_mode();
    if (!C || slots < 1 || slots > FU_SLOTS) return false;
    const int K1 = g.K, K2 = d.K;
    // the pair's shapes (K % 128, R % 128: experts_run requires D % 128, I % 128), gate/up and down chained
    if (K1 % 128 || K2 % 128 || g.R % 16 || d.R % 16 || d.K != g.R || d.R != K1) return false;
    // every bulk copy's source and size 16-byte aligned: the rows (K / 2 bytes), each tile's scale bytes (16
    // rows x K / 32), the tensors' bases
    for (int i = 0; i < 2; i++)
        if (!aligned16(g.wq[i]) || !aligned16(g.ws[i])) return false;
    if (!aligned16(d.wq[0]) || !aligned16(d.ws[0]) || !aligned16(g.x) || !aligned16(d.x)) return false;
    fu_geom q;
    q.T1 = g.R / 16;
    q.P1 = pitch_of(K1), q.P2 = pitch_of(K2);
    const uint32_t tb1 = 16 * q.P1 + (uint32_t)K1 / 2, tb2 = 16 * q.P2 + (uint32_t)K2 / 2;
    q.sb = ((tb1 > tb2 ? tb1 : tb2) + 127) & ~127u;
    // a down stage holds as many 16-row tiles as fit (the TP8 slice's K = 384: 8 tiles, 28 KB a stage; K3.1: 1),
    // at most 8 (the partial sums' slots) and no more than the expert's rows
    int mt2 = (int)(q.sb / tb2);
    mt2 = mt2 < 1 ? 1 : mt2 > 8 ? 8 : mt2;
    mt2 = mt2 > d.R / 16 ? d.R / 16 : mt2;
    while (16u * mt2 * q.P2 + 16u * mt2 * (uint32_t)K2 / 32 > q.sb) mt2--;  // the scales after the rows
    q.MT2 = mt2;
    q.T2g = (d.R / 16 + mt2 - 1) / mt2;
    const int red_w = mt2 > 2 ? mt2 : 2;
    q.red_n = (uint32_t)(4 * C * red_w * 16);     // the kernel's RD = 4 items of partials
    q.off_x = 0;                                   // the latent in f16 pairs: K1 x 2 bytes
    q.off_h = q.off_x + (uint32_t)K1 * 2;           // h of one slot: K2 x 2 bytes
    q.off_red = q.off_h + (uint32_t)K2 * 2;        // [4][C][red_w x 16] floats, 8 counters
    q.off_bar = q.off_red + (q.red_n + 8) * 4;
    const uint32_t fixed = ((q.off_bar + 2 * 8 * 16 + FU_SLOTS * 4) + 127) & ~127u;  // <= 16 stages of barriers
    const int maxsm = dev_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin);
    if ((int)fixed + 2 * (int)q.sb > maxsm) return false;
    uint32_t ns = ((uint32_t)maxsm - fixed) / q.sb;
    ns = ns > 16 ? 16 : ns;
    q.ns = ns;
    // the stages first (128-aligned), then the rest
    const uint32_t ring = ns * q.sb;
    q.off_x += ring, q.off_h += ring, q.off_red += ring, q.off_bar += ring;
    const size_t smem = ring + fixed;
    const bool lw = lw_mode();
    if (C == 4) lw ? launch_c<4, true>(g, d, slots, q, smem, st) : launch_c<4, false>(g, d, slots, q, smem, st);
    else if (C == 16) lw ? launch_c<16, true>(g, d, slots, q, smem, st) : launch_c<16, false>(g, d, slots, q, smem, st);
    else lw ? launch_c<8, true>(g, d, slots, q, smem, st) : launch_c<8, false>(g, d, slots, q, smem, st);
    if (!lunar_moe_f16_fused_launches++)  // once a process: what ran (the device logs show it)
        fprintf(stderr, "lunar: LUNAR_MOE_F16_FUSED: one-token persistent kernel, %d consumer warps, LW %d, %u stages of "
                "%u B, %d down tiles a stage, %zu B of shared memory a block\n", C, (int)lw, q.ns, q.sb, q.MT2, smem);
    return true;
}
