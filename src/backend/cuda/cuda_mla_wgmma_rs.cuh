// Internal to the wgmma MLA decode: what the round-4 kernel (cuda_mla_wgmma_rs.cu) shares with the st kernel
// (cuda_mla_wgmma_st.cu): the block's set-up (rs::Block), the V^T fragments from the e4m3 tile, PV transposed, O^T's
// stores, and the bench's phase stamps.
#ifndef LUNAR_BACKEND_CUDA_MLA_WGMMA_RS_CUH
#define LUNAR_BACKEND_CUDA_MLA_WGMMA_RS_CUH

#include "backend/cuda/cuda_mla_wgmma_q8.cuh"

namespace mla_wg {
namespace {

// FP8 pages, round 4 (the FP8 default from 64K rows x context at blocks of > 32 heads; LUNAR_MLA_WGMMA_FP8=rs
// forces it at every head count). Rounds 1-3 (docs/benchmarks.md, "MLA decode, FP8 pages, round 3") found the
// widened bf16 tile itself to be the cost: its generic shared-memory stores (72 KB per tile) compete with the S
// products for shared memory, ~1.1 us of a 3.3 us tile. Here no widened tile exists. S is the two-term FP8-score
// product (q8_issue_s, cuda_mla_wgmma_q8.cuh) on the e4m3 tile as it lands; PV is computed transposed, O^T [512
// dims x N heads] = V^T P^T, with V^T as wgmma's register A operand (m64: 64 dims per instruction, k16: 16
// positions) converted in registers from the raw e4m3 tile and P^T as the B operand from shared memory (N = the
// block's heads padded to 32 or 64, K-major: P's core-matrix layout read as B).
//  - Dims per thread: M rows are free to be any permutation of the dims, so thread (warp w of
//    warpgroup wg, g = lane / 4) takes the 8 consecutive dims D0 = 256 wg + 64 w + 8 g ..: its rows
//    g and g + 8 of instruction j are dims D0 + 2j and D0 + 2j + 1 (j = 0..3). Per position that is
//    one 8-byte shared load; a tile is 16 of them per thread (every V byte read once), conflict-free
//    (8 lanes of a position cover 64 contiguous bytes of its swizzled line, 4 positions 4 lines).
//  - e4m3 -> f16, exactly, by bit operations: a prmt pairs one dim's bytes of two positions with each
//    byte's sign replicated above it, a shift by 7 and a mask keep sign | exponent-mantissa << 7.
//    That is the f16 with the e4m3's exponent field (bias 7 for 15): the value x 2^-8, subnormals
//    included (m/8 2^-6 -> m/8 2^-14); the 2^8 goes into the output scale. 3 ops per pair. Every
//    byte becomes a finite f16 (e4m3 NaN 0x7f -> 1.875), so positions past the end (P = 0) add
//    zeros without zeroing the tile.
//  - f16 P (<= 1, 10 mantissa bits against bf16's 7; below 2^-14 subnormal, against a row sum >= 1)
//    and exact f16 V: PV at least as accurate as the bf16 kernels'; sums fp32.
//  - The rescale of O is per head, and a thread's accumulator columns are other heads than its S
//    rows: the factors go through shared memory, read only when a maximum of the block moved (the
//    barrier that publishes P reports that).
//  - Shared memory: Q hi 32 KB + lo 32 + rope 8 + three e4m3 stages 120 + P 8 = 200 KB.

// The trace buffer of lunar_cuda_mla_wgmma_trace (a device symbol, not an Args field: that would change every
// kernel's PTX; each file that includes this has a copy, cuda_mla_wgmma_st.cu's is the one the bench sets) and the
// stamp: thread 0 of the block writes (%globaltimer, clock64) pair i < 15 of its 32 words, or (i = 15) a word of its
// own
__device__ unsigned long long *g_trace;
__device__ int g_trace_blocks;
__device__ __forceinline__ void trace_stamp(int i, unsigned long long extra = 0ull) {
    if (threadIdx.x != 0 || !g_trace) return;
    const int blk = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    if (blk >= g_trace_blocks) return;
    unsigned long long gt;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(gt)::"memory");
    unsigned long long *d = g_trace + (size_t)blk * 32 + 2 * i;
    if (i < 15) d[0] = gt, d[1] = (unsigned long long)clock64();
    else d[0] = extra, d[1] = 0ull;
}
} // namespace

// (rs::kX*, the st kernel's switches, are in cuda_mla_wgmma.cuh: the dispatcher needs them)
namespace rs {
namespace {
constexpr int kStages = 3;
constexpr int raw_off = 9 * q8::kBox;
constexpr int p_off = raw_off + kStages * q8::kStage; // NP x [64 heads][64 positions] f16, core-matrix order
// The layout of a Block: Q (QB boxes), kStages e4m3 stages, NP P buffers (round 4: one, 200 KB; round 6 on: Q in 5
// boxes, two P buffers, 178 KB)
template <int NP, int QB = 9> struct Lay {
    static constexpr int raw_off = QB * q8::kBox;
    static constexpr int p_off = raw_off + kStages * q8::kStage;
    static constexpr int red_off = p_off + NP * kPBytes; // [2][64] floats
    static constexpr int sq_off = red_off + 2 * 64 * 4;  // [64] the per-head q scale
    static constexpr int al_off = sq_off + 64 * 4;       // [64] the tile's rescale factor per head
    static constexpr int li_off = al_off + 64 * 4;       // [64] the output factor per head
    static constexpr int bar_off = li_off + 64 * 4;
    static constexpr size_t smem = (size_t)bar_off + kStages * 8 + 1024;
    static_assert(smem <= 232448, "227 KB of shared memory per block");
    static_assert(raw_off % 1024 == 0 && q8::kStage % 1024 == 0, "stages on the 128-byte swizzle's 1 KB period");
};

// the f16 pair (byte b of x, byte b of y) x 2^-8; sel = prmt selector b | (8 | b) << 4 | (4 + b) << 8
// | (12 + b) << 12 (nibble msb: the selected byte's sign replicated)
__device__ __forceinline__ uint32_t e4m3_pair_f16(uint32_t x, uint32_t y, uint32_t sel) {
    uint32_t w;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(w) : "r"(x), "r"(y), "r"(sel));
    return (w << 7) & 0xbf80bf80u;
}
__host__ __device__ constexpr uint32_t sel(int b) {
    return (uint32_t)(b | (8 | b) << 4 | (4 + b) << 8 | (12 + b) << 12);
}
static_assert(sel(0) == 0xC480u && sel(3) == 0xF7B3u, "prmt selectors");

// What the round-4 kernel and the st kernel share (round 5's kernel, which kept round 4's bits, shared the steps
// too until session 19). The constructor is their set-up: the block's heads, split and row, this thread's S rows
// (heads r0, r1) and V dims (D0..), the stage barriers with the first kStages tiles' copies issued, Q quantised into
// shared memory. NP: the P buffers of the layout.
// ST: the round-6 kernel's Q rows (q8_quantise_q<true>) in 5 boxes. X: the st kernel's switches (rs::kX*;
// kXQF, kXPw and kXTrace act here).
template <int NP, bool ST = false, int X = 0> struct Block {
    using L = Lay<NP, ST ? 5 : 9>;
    unsigned char *smem;
    uint32_t sb, bars;
    float *red, *sqs, *alpha, *linv;
    const CUtensorMap *tm;
    const int32_t *bt;
    int split, row, tid, wg, lane, warp, g, t, r0, r1, h0, nh, begin, end, ntiles;
    float f0, f1;
    uint64_t dqh, dql, dqe;
    int D0;
    uint32_t vbox, vchunk;

    // warp 0: five boxes of 128 B x 64 positions into stage i % kStages
    __device__ __forceinline__ void issue_tma(int i) const {
        using namespace q8;
        if (i >= ntiles) return;
        const int t0 = begin + i * kTile;
        const int slot0 = bt[t0 >> 7] * 128 + (t0 & 127);
        const uint32_t bar = bars + (i % kStages) * 8, dst = sb + L::raw_off + (i % kStages) * kStage;
        if (lane == 0) mbar_expect_tx(bar, kStage);
        __syncwarp();
        if (lane < 5) tma_2d(dst + lane * kBox, tm, lane * 128, slot0, bar);
    }

    // the stage barriers initialised (thread 0), then warp 0 issues the first kStages tiles' copies
    __device__ __forceinline__ void start_copies() const {
        if (tid == 0) {
            for (int i = 0; i < kStages; i++) mbar_init(bars + 8 * i, 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
        if constexpr ((X & kXTrace) != 0) trace_stamp(6);
        if (tid < 32)
            for (int i = 0; i < kStages; i++) issue_tma(i);
        if constexpr ((X & kXTrace) != 0) trace_stamp(7);
    }

    __device__ __forceinline__ Block(const Args &a, const CUtensorMap &tmap, unsigned char *smem_raw) {
        using namespace q8;
        smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
        sb = smem_u32(smem);
        red = reinterpret_cast<float *>(smem + L::red_off);
        sqs = reinterpret_cast<float *>(smem + L::sq_off);
        alpha = reinterpret_cast<float *>(smem + L::al_off);
        linv = reinterpret_cast<float *>(smem + L::li_off);
        tm = &tmap;
        const int hb = blockIdx.x;
        split = blockIdx.y, row = blockIdx.z;
        tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
        constexpr bool QF = (X & kXQF) != 0, Pw = (X & kXPw) != 0;
        static_assert(!Pw || ST, "kXPw: q's rows as the ST layout's");
        if constexpr (QF || Pw)
            if (tid == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmap)) : "memory");
        r0 = (warp & 3) * 16 + g, r1 = r0 + 8;
        h0 = hb * a.hpb, nh = min(a.hpb, a.H - h0);
        const int seq = a.row_seq ? a.row_seq[row] : row;
        bt = a.bt + (size_t)seq * a.max_blocks;
        begin = split * a.chunk, end = min(a.lens[row], begin + a.chunk);
        ntiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;

        bars = sb + L::bar_off;
        if constexpr (Pw) {
            // round 11 (kXPw, launched by launch_pdl): all but q before the wait, while the predecessor (the
            // absorption, whose output q is) still runs. THE RULE of cuda_common.cuh allows it: row_seq, lens and the
            // block table are the step's inputs, which no kernel writes; the latent pages' newest rows were stored two
            // launches back (lunar_glue_latent_store, then the absorption), complete once this kernel can start (every
            // block of its predecessor has passed its own wait). So the mbarriers' init and the first kStages tiles'
            // copies overlap the predecessor's tail and this kernel's launch; q's rows, 4 a warp, are loaded at once
            // after the wait (round 8's order: the copies were issued long before). Nothing is written before the wait.
            start_copies();
            pdl_enter();
            q8_quantise_q<ST, true>(a, smem, sqs, row, h0, nh, warp, lane);
        } else if constexpr (QF) {
            // this warp's 4 q rows (ST: 32 rows, 4 a warp) requested before anything else, quantised after the
            // copies' issue
            static_assert(ST, "the 32 rows of the ST layout");
            constexpr int NQ = 32 / (kThreads / 32);
            float4 xq[NQ][5];
#pragma unroll
            for (int k = 0; k < NQ; k++) q8_load_row(a, xq[k], row, h0, nh, warp + k * (kThreads / 32), lane);
            start_copies();
#pragma unroll
            for (int k = 0; k < NQ; k++) q8_store_row<ST>(smem, sqs, xq[k], warp + k * (kThreads / 32), lane);
        } else {
            start_copies();
            q8_quantise_q<ST>(a, smem, sqs, row, h0, nh, warp, lane);
        }
        if constexpr ((X & kXTrace) != 0) trace_stamp(8);
        fence_async_smem();
        __syncthreads();
        f0 = sqs[r0] * a.scale2, f1 = sqs[r1] * a.scale2;

        dqh = desc_sw(sb + q_hi, 16, 1024), dql = desc_sw(sb + q_lo, 16, 1024);
        dqe = desc_sw(sb + q_pe, 16, 1024);
        D0 = wg * 256 + (warp & 3) * 64 + g * 8;
        // this thread's 8 bytes of position p in a stage: box D0 / 128, chunk (D0 % 128) / 16 swizzled by p
        vbox = (uint32_t)(D0 >> 7) * kBox + (D0 & 8), vchunk = (D0 & 127) >> 4;
    }

    // the V bytes of the tile in stage `raw`, positions 16 ks + 2t + {0, 1, 8, 9}
    __device__ __forceinline__ void load_v(uint32_t (&vx)[4][4][2], uint32_t raw) const {
#pragma unroll
        for (int ks = 0; ks < 4; ks++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int p = 16 * ks + 2 * t + (q & 1) + 8 * (q >> 1);
                const uint32_t ad = raw + vbox + p * 128 + (((vchunk ^ p) & 7) << 4);
                asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(vx[ks][q][0]), "=r"(vx[ks][q][1]) : "r"(ad) : "memory");
            }
    }

    // The softmax of tile it from its scores s and this warpgroup's row maxima: the maxima exchanged
    // through red (the barrier also frees tile it's stage for tile it + kStages's copies), f16 P into
    // P buffer it % NP, the running maxima and sums updated; al0 / al1, the rows' rescale factors, also
    // into alpha for the threads that hold those heads' columns
    __device__ __forceinline__ void softmax_p(const float (&s)[16], float mx0, float mx1, int it, float &m0, float &m1,
                                              float &l0, float &l1, float &al0, float &al1) const {
        if (t == 0) red[wg * 64 + r0] = mx0, red[wg * 64 + r1] = mx1;
        __syncthreads(); // maxima in; every read of this stage (S, the V loads) is done
        if (tid < 32) issue_tma(it + kStages);
        mx0 = fmaxf(red[r0], red[64 + r0]), mx1 = fmaxf(red[r1], red[64 + r1]);
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);
        m0 = mn0, m1 = mn1;
        float ps0 = 0.0f, ps1 = 0.0f;
        // (the buffer as it & (NP - 1), not it % NP: the kernels' PTX, instruction for instruction)
        unsigned char *P = smem + L::p_off + (it & (NP - 1)) * kPBytes + (r0 >> 3) * kPGroup + (r0 & 7) * 16 + 4 * t;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float e0 = exp2f(s[4 * k] - mn0), e1 = exp2f(s[4 * k + 1] - mn0);
            const float e2 = exp2f(s[4 * k + 2] - mn1), e3 = exp2f(s[4 * k + 3] - mn1);
            ps0 += e0 + e1, ps1 += e2 + e3;
            const __half2 h01 = __floats2half2_rn(e0, e1), h23 = __floats2half2_rn(e2, e3);
            *reinterpret_cast<__half2 *>(P + (4 * wg + k) * 128) = h01;
            *reinterpret_cast<__half2 *>(P + kPGroup + (4 * wg + k) * 128) = h23;
        }
        l0 = l0 * al0 + ps0, l1 = l1 * al1 + ps1;
        if (wg == 0 && t == 0) alpha[r0] = al0, alpha[r1] = al1;
    }

    // P and the factors published (the barrier reports whether some maximum of the block moved); O^T's
    // columns rescaled where one did
    // (o: O^T accumulators o[j][4i + c], dims D0 + 2j (c = 0, 1) / D0 + 2j + 1 (c = 2, 3), heads 8i + 2t + (c & 1))
    template <int N> __device__ __forceinline__ void rescale(float (&o)[4][N / 2], float al0, float al1) const {
        fence_async_smem();
        if (__syncthreads_or(al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
            for (int i = 0; i < N / 8; i++) {
                const float2 f = *reinterpret_cast<const float2 *>(alpha + 8 * i + 2 * t);
#pragma unroll
                for (int j = 0; j < 4; j++)
                    o[j][4 * i] *= f.x, o[j][4 * i + 1] *= f.y, o[j][4 * i + 2] *= f.x, o[j][4 * i + 3] *= f.y;
            }
        }
    }
};

// V^T fragments from a tile's V bytes: instruction j takes byte 2j (row g) and 2j + 1 (row g + 8) of
// each position
__device__ __forceinline__ void v_fragments(uint32_t (&av)[4][4][4], const uint32_t (&vx)[4][4][2]) {
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int w = j >> 1, b = 2 * (j & 1);
            av[ks][j][0] = e4m3_pair_f16(vx[ks][0][w], vx[ks][1][w], sel(b));
            av[ks][j][1] = e4m3_pair_f16(vx[ks][0][w], vx[ks][1][w], sel(b + 1));
            av[ks][j][2] = e4m3_pair_f16(vx[ks][2][w], vx[ks][3][w], sel(b));
            av[ks][j][3] = e4m3_pair_f16(vx[ks][2][w], vx[ks][3][w], sel(b + 1));
        }
}

// Round 8 (kXCvt): the same fragments by the hardware conversion, exact V (not x 2^-8: the output factor drops its
// 2^8): one prmt pairs byte b and b + 1 of the two positions' words ({x_b, y_b, x_b+1, y_b+1}), and each 16-bit half
// is one cvt.rn.f16x2.e4m3x2 (the upper byte to the upper half): 3 instructions for two registers instead of 6.
// The conversion keeps e4m3 NaN (0x7f / 0xff) a NaN, which P = 0 would not cancel: the caller zeroes the bytes of
// positions past the end (mask_v) where the old route turned them into finite values.
__device__ __forceinline__ void v_fragments_cvt(uint32_t (&av)[4][4][4], const uint32_t (&vx)[4][4][2]) {
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int w = j >> 1, b = 2 * (j & 1);
            const uint32_t sl = (uint32_t)(b | (4 + b) << 4 | (b + 1) << 8 | (5 + b) << 12);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                uint32_t pr;
                asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(pr) : "r"(vx[ks][2 * h][w]), "r"(vx[ks][2 * h + 1][w]), "r"(sl));
                asm("{\n .reg .b16 l, u;\n mov.b32 {l, u}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, u;\n}\n"
                    : "=r"(av[ks][j][2 * h]), "=r"(av[ks][j][2 * h + 1])
                    : "r"(pr));
            }
        }
}
// the V bytes of positions at or past nvalid (of the thread's 16 in load_v's order) zeroed
__device__ __forceinline__ void mask_v(uint32_t (&vx)[4][4][2], int nvalid, int t) {
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int q = 0; q < 4; q++)
            if (16 * ks + 2 * t + (q & 1) + 8 * (q >> 1) >= nvalid) vx[ks][q][0] = 0u, vx[ks][q][1] = 0u;
}

// PV of tile it issued and committed (not waited): O^T += V^T P^T, the 16 products of a tile, P^T from
// P buffer it % NP (dp0: the descriptor of buffer 0)
template <int N, int NP>
__device__ __forceinline__ void issue_pv(float (&o)[4][N / 2], uint32_t (&av)[4][4][4], uint64_t dp0, int it) {
    // the fragments are computed before the fence (else ptxas, finding them written between
    // the products, injects a warpgroup.arrive before each one)
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            asm volatile("" : "+r"(av[ks][j][0]), "+r"(av[ks][j][1]), "+r"(av[ks][j][2]), "+r"(av[ks][j][3])::"memory");
#pragma unroll
    for (int j = 0; j < 4; j++) fence_acc<N / 2>(o[j]);
    wgmma_fence();
    const uint64_t dp = dp0 + (uint64_t)((it & (NP - 1)) * (kPBytes >> 4));
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if constexpr (N == 64) wgmma_m64n64_rs_f16(o[j], av[ks][j], dp + 16 * ks);
            else wgmma_m64n32_rs_f16(o[j], av[ks][j], dp + 16 * ks);
        }
    wgmma_commit();
}

// O^T (dims D0.., heads 8i + 2t + e) times the output factor per head (linv, published) into o or the split's part
template <int N, class B> __device__ __forceinline__ void store_ot(const Args &a, const B &b, const float (&o)[4][N / 2]) {
    const int t = b.t, nh = b.nh, row = b.row;
    const float *linv = b.linv;
    float *base = a.splits == 1 ? a.o : a.o_part + (size_t)b.split * a.rows * a.H * kR;
#pragma unroll
    for (int i = 0; i < N / 8; i++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int h = 8 * i + 2 * t + e;
            if (h >= nh) continue;
            const float f = linv[h];
            float4 *d = reinterpret_cast<float4 *>(base + ((size_t)row * a.H + b.h0 + h) * kR + b.D0);
            d[0] = make_float4(o[0][4 * i + e] * f, o[0][4 * i + e + 2] * f, o[1][4 * i + e] * f, o[1][4 * i + e + 2] * f);
            d[1] = make_float4(o[2][4 * i + e] * f, o[2][4 * i + e + 2] * f, o[3][4 * i + e] * f, o[3][4 * i + e + 2] * f);
        }
}

// The end of the round-4 kernels: the row sums of the two warpgroups' positions; the output factor per head
// (x 2^8: V was x 2^-8) through shared memory to the threads holding that head's columns (o: O^T, dims D0..)
template <int N, int NP>
__device__ __forceinline__ void write_out(const Args &a, const Block<NP> &b, const float (&o)[4][N / 2], float m0, float m1,
                                          float l0, float l1) {
    const int wg = b.wg, t = b.t, r0 = b.r0, r1 = b.r1, nh = b.nh, row = b.row, split = b.split;
    float *red = b.red, *linv = b.linv;
    l_halves_to_red(red, wg, t, r0, r1, l0, l1);
    const bool direct = a.splits == 1;
    if (wg == 0 && t == 0) {
        const float os = (direct ? a.out_scale : 1.0f) * 256.0f;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int r = e ? r1 : r0;
            const float l = red[r] + red[64 + r], m = e ? m1 : m0;
            linv[r] = l > 0.0f ? os / l : 0.0f;
            if (!direct && r < nh)
                a.lse_part[(size_t)split * a.rows * a.H + (size_t)row * a.H + b.h0 + r] = l > 0.0f ? m + log2f(l) : -INFINITY;
        }
    }
    __syncthreads();
    store_ot<N>(a, b, o);
}
} // namespace
} // namespace rs
} // namespace mla_wg

#endif
