// Path 30 (BF16 experts, LUNAR_MOE_PREFILL=wsbfr): path 29's grouped GEMMs (cuda_moe_ws.cu,
// moe_ws_kernel<false, ., 0, ., DYN = true>: a producer warpgroup filling a ring of 4 stages of
// A = 128 token rows x 64 columns by cp.async and B = 256 weight rows x 64 columns by TMA, two
// consumer warpgroups, items = (128-row M tile of one expert) x (256 weight rows) taken from a
// global counter), with an expert's short last tile multiplied the other way round.
//
// Why: at Kimi-Linear-48B's 8K prefill an expert gets ~256 +- 16 rows, so about half the experts
// end on a tile of a few rows (129..~300 rows: 2 full tiles + a rest). Path 29 gives such a tile to
// consumer warpgroup 0 alone (64 token rows x 256 weight rows per chunk: m64n256, 4 products a
// chunk for a few live rows) while warpgroup 1 waits, and the item lasts as long as a full tile's
// half. Here an item whose tile has at most BR_REM = 64 live rows runs with the WEIGHTS as wgmma's
// M and the tokens as N = the live rows rounded up to 16 / 32 / 64 (both operands still from the
// same shared-memory stage: the SS form, no copy changes): warpgroup w takes weight rows 128 w ..
// 128 w + 127 as two m64 blocks (gate/up: w1 rows 64 w .. and the same rows of w3, so a thread's
// gate and up accumulators are the same output column and token; down: w2 rows 128 w + 64 mb ..),
// both warpgroups busy, N / 64 of the products. The stage, the producer, the barriers and the
// counter are path 29's, item for item: only the consumers' products and epilogue differ, so the
// items keep the counter's order (a rest tile follows its expert's full tiles within ~2 us and
// reads the weight tile from L2, which a separate kernel for the rests would not).
// The bytes do not change (a rest item still reads its 256 weight rows): at ~7.3 TB/s from L2 to
// the SMs (docs/benchmarks.md "MoE prefill BF16, items by a counter") this removes only the rest
// items' tensor-core time and warpgroup 1's idling, not their L2 reads.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdio.h>
#include <string.h>

#include <type_traits>

#include "backend/cuda/cuda_mbarrier.cuh"
#include "backend/cuda/cuda_moe.cuh"
#include "backend/cuda/cuda_wgmma.cuh"

#define BR_BM 128  // token rows of an M tile (the permutation's tile list)
#define BR_BN 256  // weight rows of an item (gate/up: 128 of w1 + the same 128 of w3)
#define BR_BK 64   // K columns of a chunk: one 128-byte swizzle atom a row
#define BR_T 384
#define BR_ST 4    // ring stages: 4 x (16 + 32) KB
#define BR_REM 64  // a tile of at most this many live rows runs with the weights as M (N <= 64)

// D[64 x 16] (+)= A[64 x 16] B[16 x 16], both K-major (as cuda_wgmma.cuh's wgmma_m64n32<0>)
__device__ __forceinline__ void bfr_m64n16(float *d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC8(d, 0)
                 : "l"(da), "l"(db), "r"(scale_d));
}
// D[64 x 64] (+)= A[64 x 16] B[16 x 64], both K-major
__device__ __forceinline__ void bfr_m64n64(float *d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24)
                 : "l"(da), "l"(db), "r"(scale_d));
}
template <int N> __device__ __forceinline__ void bfr_mma(float *d, uint64_t da, uint64_t db, int scale_d) {
    static_assert(N == 16 || N == 32 || N == 64, "the rest tiles' N");
    if constexpr (N == 16) bfr_m64n16(d, da, db, scale_d);
    else if constexpr (N == 32) wgmma_m64n32<0>(d, da, db, scale_d);
    else bfr_m64n64(d, da, db, scale_d);
}

// K-major, 128-byte swizzle, 8-row groups 1024 bytes apart (cuda_moe_ws.cu's ws_desc)
__device__ __forceinline__ uint64_t bfr_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

// the item counters, [GATEUP] (path 29's protocol, its own words: the two paths never share a launch)
__device__ int bfr_next[2], bfr_done[2];
__device__ __forceinline__ void bfr_leave(int k) {
    __threadfence();  // this thread's takes before its count
    if (atomicAdd(&bfr_done[k], 1) == (int)gridDim.x - 1) {
        atomicExch(&bfr_next[k], 0);
        atomicExch(&bfr_done[k], 0);
    }
}

struct bfr_cfg {
    static constexpr uint32_t A_BYTES = BR_BM * 128, B_BYTES = BR_BN * 128;
    // + the stages' item words and the producers' two next-item words
    static constexpr size_t smem() { return 1024 + (size_t)BR_ST * (A_BYTES + B_BYTES) + 2 * BR_ST * 8 + (BR_ST + 2) * 4; }
};

// A rest item's epilogue (weights as M): accumulator 4 j + 2 h + i of m64 block mb (acc0, acc1)
// holds weight row 16 wwarp + g + 8 h of the block, token 8 j + 2 c + i of the item. Each store
// pairs two neighbouring output columns: lanes g and g ^ 1 (lane ^ 4) swap one value, the even lane
// storing token 8 j + 2 c (columns g, g + 1), the odd one token 8 j + 2 c + 1 (columns g - 1, g).
template <bool GATEUP, int N>
__device__ __forceinline__ void bfr_rest_epilogue(const xargs &a, const float *acc0, const float *acc1, int r0,
                                                  int live, int n0, int wg, int wwarp, int g, int c) {
    const bool odd = g & 1;
#pragma unroll
    for (int j = 0; j < N / 8; j++) {
        const int ta = 8 * j + 2 * c, tb = ta + 1, t = odd ? tb : ta;
        if constexpr (GATEUP) {
#pragma unroll
            for (int h = 0; h < 2; h++) {  // gate: block 0 (w1 rows), up: block 1 (w3, the same rows)
                const float *v = acc0 + 4 * j + 2 * h, *u = acc1 + 4 * j + 2 * h;
                const float ha = glu_act_fast(v[0], u[0], a.act, a.beta, a.beta_l);
                const float hb = glu_act_fast(v[1], u[1], a.act, a.beta, a.beta_l);
                const float got = __shfl_xor_sync(0xffffffffu, odd ? ha : hb, 4);
                const int col = n0 + 64 * wg + 16 * wwarp + 8 * h + (g & ~1);
                if (t < live)
                    *(__nv_bfloat162 *)(a.h + (size_t)(r0 + t) * a.R + col) =
                        odd ? __floats2bfloat162_rn(got, hb) : __floats2bfloat162_rn(ha, got);
            }
        } else {
            const float wa = ta < live ? a.row_weight[r0 + ta] : 0.0f;
            const float wb = tb < live ? a.row_weight[r0 + tb] : 0.0f;
#pragma unroll
            for (int mb = 0; mb < 2; mb++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const float *v = (mb ? acc1 : acc0) + 4 * j + 2 * h;
                    const float xa = v[0] * wa, xb = v[1] * wb;
                    const float got = __shfl_xor_sync(0xffffffffu, odd ? xa : xb, 4);
                    const float lo = odd ? got : xa, hi = odd ? xb : got;
                    const int col = n0 + 128 * wg + 64 * mb + 16 * wwarp + 8 * h + (g & ~1);
                    if (t >= live) continue;
                    if (a.yb) *(__nv_bfloat162 *)(a.yb + (size_t)(r0 + t) * a.R + col) = __floats2bfloat162_rn(lo, hi);
                    else *(float2 *)(a.y + (size_t)(r0 + t) * a.R + col) = make_float2(lo, hi);
                }
            }
        }
    }
}

template <bool GATEUP>
__global__ void __launch_bounds__(BR_T, 1)
    moe_bfr_kernel(const __grid_constant__ xargs a, const __grid_constant__ CUtensorMap tm0,
                   const __grid_constant__ CUtensorMap tm1) {
    typedef bfr_cfg C;
    constexpr int NH = GATEUP ? BR_BN / 2 : BR_BN;  // output columns per item
    constexpr int NACC = BR_BN / 2;                 // accumulators per consumer thread (full tiles)
    extern __shared__ uint8_t bfr_smem[];
    const uint32_t sA = (smem_u32(bfr_smem) + 1023u) & ~1023u;
    const uint32_t sB = sA + BR_ST * C::A_BYTES, full = sB + BR_ST * C::B_BYTES, empty = full + BR_ST * 8;
    // [s] the item of the chunk in stage s (written for an item's first chunk; -1: none left),
    // [ST + (li & 1)] the producers' next item after their li-th
    volatile int *itm = (int *)(bfr_smem + (empty + BR_ST * 8 - smem_u32(bfr_smem)));

    const int NN = a.R / NH, J = a.K / BR_BK;
    const int tid = threadIdx.x;
    const int total = a.counts[a.E + 1] * NN, G = gridDim.x, b = blockIdx.x;
    if (b >= total) {  // block-uniform, before any barrier
        if (tid == 0) bfr_leave(GATEUP);
        return;
    }
    // item w: expert e, rows r0 .. rend - 1 of the permutation, weight rows n0 ..
    auto item_at = [&](int w, int &e, int &r0, int &rend, int &n0) {
        const int ti = w / NN;
        e = a.tiles[2 * ti], r0 = a.tiles[2 * ti + 1], rend = a.offsets[e + 1];
        n0 = (w - ti * NN) * NH;
    };
    if (tid == 0) {
        for (int s = 0; s < BR_ST; s++) {
            mbar_init(full + 8 * s, 129);
            mbar_init(empty + 8 * s, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        fence_async_smem();
    }
    __syncthreads();

    if (tid < 128) {
        // ---------------------------------------------------------------- producer (path 29's)
        asm volatile("setmaxnreg.dec.sync.aligned.u32 72;\n" ::: "memory");
        const int a_ch = tid & 7, a_row0 = tid >> 3;  // A piece i: row a_row0 + 16 i, 16-byte chunk a_ch
        const uint16_t *xsrc[8];
        uint32_t xok = 0;
        int e = 0, n0 = 0, cur_w = 0;
        auto start = [&](int w) {
            int r0, rend;
            item_at(w, e, r0, rend, n0);
            xok = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {  // rows past the expert's end: zero-filled, nothing read
                const int r = r0 + a_row0 + 16 * i;
                const bool ok = r < rend;
                xok |= (uint32_t)ok << i;
                xsrc[i] = a.x + (size_t)(ok ? (GATEUP ? a.row_token[r] : r) : 0) * a.K + a_ch * 8;
            }
            cur_w = w;
        };
        auto issue = [&](int q, int j) {
            const int s = q % BR_ST;
            if (q >= BR_ST) mbar_wait(empty + 8 * s, ((q / BR_ST) - 1) & 1);
            if (j == 0 && tid == 0) itm[s] = cur_w;  // before this thread's arrival on `full`
            if (tid == 0) {
                mbar_expect_tx(full + 8 * s, C::B_BYTES);
                const int row = e * a.R + n0;
                tma_2d(sB + s * C::B_BYTES, &tm0, j * BR_BK, row, full + 8 * s);
                tma_2d(sB + s * C::B_BYTES + C::B_BYTES / 2, &tm1, j * BR_BK, GATEUP ? row : row + 128, full + 8 * s);
            }
            const uint32_t dA = sA + s * C::A_BYTES;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int row = a_row0 + 16 * i;
                cp_async16(dA + row * 128 + ((a_ch ^ (row & 7)) << 4), xsrc[i] + j * BR_BK, (xok >> i) & 1);
            }
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full + 8 * s) : "memory");
        };
        int q = 0;
        for (int w = b, li = 0;; li++) {
            start(w);
            int next = 0;
            for (int j = 0; j < J; j++, q++) {
                if (tid == 0 && j == (J > 2 ? J - 2 : 0)) next = G + atomicAdd(&bfr_next[GATEUP], 1);
                issue(q, j);
            }
            if (tid == 0) itm[BR_ST + (li & 1)] = next;
            asm volatile("bar.sync 1, 128;\n" ::: "memory");  // the producer warpgroup
            w = itm[BR_ST + (li & 1)];
            if (w >= total) break;
        }
        // none left: stage q % ST's next `full` phase completes with item word -1 (129 arrivals)
        const int s = q % BR_ST;
        if (q >= BR_ST) mbar_wait(empty + 8 * s, ((q / BR_ST) - 1) & 1);
        if (tid == 0) {
            itm[s] = -1;
            mbar_arrive(full + 8 * s);
            bfr_leave(GATEUP);
        }
        mbar_arrive(full + 8 * s);
        cp_commit();
        cp_wait<0>();  // nothing of this thread's is left in flight when it leaves
    } else {
        // ---------------------------------------------------------------- consumers
        asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n" ::: "memory");
        const int ct = tid - 128, wg = ct >> 7, lane = ct & 31, wwarp = (ct >> 5) & 3;
        const int g = lane >> 2, c = lane & 3;
        int pend = -1;  // the chunk whose stage this warp has not released yet
        auto release = [&](int qq) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + 8 * (qq % BR_ST));
        };
        // the item's J chunks: wait, products (mma(stage, chunk) when on, fenced by fen: the accumulators
        // they write), release the previous chunk's stage
        auto chunks = [&](int &q, bool on, auto mma, auto fen) {
            for (int j = 0; j < J; j++, q++) {
                const int s = q % BR_ST;
                mbar_wait(full + 8 * s, (q / BR_ST) & 1);
                if (on) {
                    fence_async_smem();  // the producer's cp.async A pieces, published by the barrier
                    wgmma_fence();
                    fen();
                    mma(s, j);
                    wgmma_commit();
                    fen();
                }
                wgmma_wait<1>();  // chunk q - 1's products are done: its stage may be refilled
                if (pend >= 0) release(pend);
                pend = q;
            }
            wgmma_wait<0>();
            fen();
            release(pend);
            pend = -1;
        };
        for (int q = 0;;) {
            const int s0 = q % BR_ST;
            mbar_wait(full + 8 * s0, (q / BR_ST) & 1);
            const int w = itm[s0];
            if (w < 0) break;  // no chunk pending: the last item was drained and released
            int e_, r0, rend, n0;
            item_at(w, e_, r0, rend, n0);
            const int live = rend - r0;
            if (live > BR_REM) {  // path 29: tokens as M, warpgroup wg's 64 rows x the 256 weight rows
                const int c_r0 = r0 + wg * 64;
                // the accumulators live for one item (the first product of each item starts the sum);
                // each wgmma form has its own arrays, each from index 0 (products into a sub-range of
                // one shared array were serialized by ptxas, C7511)
                float acc[NACC];
#pragma unroll
                for (int i = 0; i < NACC; i++) acc[i] = 0.0f;
                chunks(q, c_r0 < rend, [&](int s, int j) {
                    const uint32_t aT = sA + s * C::A_BYTES + wg * 64 * 128, bT = sB + s * C::B_BYTES;
#pragma unroll
                    for (int kk = 0; kk < BR_BK / 16; kk++)
                        wgmma_m64n256<0>(acc, bfr_desc(aT + kk * 32), bfr_desc(bT + kk * 32), j > 0 || kk > 0);
                }, [&] { fence_acc<NACC>(acc); });
                if (c_r0 < rend) moe_wg_epilogue<GATEUP, NACC, GATEUP>(a, acc, c_r0, rend, n0, wwarp, g, c);
            } else {  // weights as M: two m64 blocks of weight rows x N tokens a warpgroup
                auto rest = [&](auto n_c) {
                    constexpr int N = decltype(n_c)::value;
                    // block mb's first weight row in the stage's B tile (rows 128 bytes apart)
                    const uint32_t m0 = GATEUP ? 64 * wg : 128 * wg, m1 = GATEUP ? 128 + 64 * wg : 128 * wg + 64;
                    float r0a[N / 2], r1a[N / 2];  // m64 blocks 0 and 1
#pragma unroll
                    for (int i = 0; i < N / 2; i++) r0a[i] = r1a[i] = 0.0f;
                    chunks(q, true, [&](int s, int j) {
                        const uint32_t aT = sA + s * C::A_BYTES, bT = sB + s * C::B_BYTES;
#pragma unroll
                        for (int kk = 0; kk < BR_BK / 16; kk++) {
                            const uint64_t tok = bfr_desc(aT + kk * 32);
                            bfr_mma<N>(r0a, bfr_desc(bT + m0 * 128 + kk * 32), tok, j > 0 || kk > 0);
                            bfr_mma<N>(r1a, bfr_desc(bT + m1 * 128 + kk * 32), tok, j > 0 || kk > 0);
                        }
                    }, [&] { fence_acc<N / 2>(r0a), fence_acc<N / 2>(r1a); });
                    bfr_rest_epilogue<GATEUP, N>(a, r0a, r1a, r0, live, n0, wg, wwarp, g, c);
                };
                if (live <= 16) rest(std::integral_constant<int, 16>());
                else if (live <= 32) rest(std::integral_constant<int, 32>());
                else rest(std::integral_constant<int, 64>());
            }
        }
    }
}

// [rows, K] bf16 weights as a 2-D tensor with 64-column x 128-row boxes in the 128-byte swizzle
// (cuda_moe_ws.cu's ws_tmap). false: no driver entry point or the map was refused.
static bool bfr_tmap(CUtensorMap *m, const uint16_t *w, long rows, int K) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = lunar_tmap_encoder();
    if (!fn || !w) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)K * 2};
    const cuuint32_t box[2] = {BR_BK, 128}, es[2] = {1, 1};
    return fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<uint16_t *>(w), dims, strides, box, es,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

#define BR_MAX_DEV 64
template <bool GATEUP> static bool bfr_launch(const xargs &a, int tiles, cudaStream_t st) {
    CUtensorMap t0, t1;
    memset(&t0, 0, sizeof t0), memset(&t1, 0, sizeof t1);
    const long rows = (long)a.E * a.R;
    if (!bfr_tmap(&t0, a.wb[0], rows, a.K)) return false;
    if (!GATEUP) t1 = t0;  // DOWN: the second 128 rows of the same matrix
    else if (!bfr_tmap(&t1, a.wb[1], rows, a.K)) return false;
    static bool attr[BR_MAX_DEV];
    static int sms[BR_MAX_DEV];
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_REQUIRE(dev >= 0 && dev < BR_MAX_DEV);
    if (!attr[dev]) {  // per device: the dynamic shared-memory limit is raised on the current one
        CUDA_CHECK(cudaFuncSetAttribute(moe_bfr_kernel<GATEUP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)bfr_cfg::smem()));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev));
        attr[dev] = true;
    }
    // an upper bound of the items; blocks without one count themselves done and leave
    const long items = (long)tiles * (a.R / (GATEUP ? BR_BN / 2 : BR_BN));
    const int grid = items < sms[dev] ? (int)items : sms[dev];
    if (grid <= 0) return true;
    moe_bfr_kernel<GATEUP><<<grid, BR_T, bfr_cfg::smem(), st>>>(a, t0, t1);
    CUDA_CHECK_LAUNCH();
    return true;
}

// (cuda_moe.cu) path 30: both BF16 expert GEMMs; false where the shapes do not fit it (gate/up R %
// 128, down R % 256, K % 64) or a tensor map is refused, before any launch of that GEMM (the caller
// runs path 29). mid (or NULL): recorded on st between the two launches (the benchmark's split).
bool moe_bfr_experts(const xargs &g, const xargs &d, int tiles, cudaStream_t st, cudaEvent_t mid) {
    if (g.R % 128 || g.K % BR_BK || d.R % 256 || d.K % BR_BK) return false;
    if (!bfr_launch<true>(g, tiles, st)) return false;
    if (mid) CUDA_CHECK(cudaEventRecord(mid, st));
    CUDA_REQUIRE(bfr_launch<false>(d, tiles, st));  // its tensor map as the gate/up's: refused only if those were
    return true;
}
