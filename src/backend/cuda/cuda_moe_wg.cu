// The MoE prefill grouped GEMM on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a).
//
// Work: items (M tile of 128 permuted rows of one expert, from the permutation's tile list) x
// (N tile of BN weight rows), walked by a persistent grid of one 256-thread block per SM (block b
// takes items b, b + grid, ...). GATEUP: an N tile is BN/2 rows of w1 and the same BN/2 rows of w3,
// so that a thread's accumulators hold gate and up of the same output columns and SiTU/SwiGLU is
// applied before anything leaves the registers; DOWN: BN rows of w2, the router weight of the row
// applied in the epilogue.
//
// Pipeline: K in chunks of 64 columns (one 128-byte row of bf16, the 128-byte swizzle atom). Every
// thread copies (cp.async) its share of the chunk ST-2 chunks ahead: activation rows (gathered
// through row_token for GATEUP; rows past the expert's end zero-filled) and either the bf16 weight
// rows or, for MXFP4, the packed nibbles and the 4-byte word holding their E8M0 scale. The flat
// chunk sequence runs across items, so the next item's first chunks load during the current item's
// last ones and its epilogue. MXFP4 is widened to bf16 by the same thread that copied it (no
// barrier between copy and widening), exactly as in the mma.sync kernels (pairs_mx), then
// reordered from the pair order to natural column order, into a 3-deep ring of bf16 B tiles.
// Warpgroup w (threads 128w..128w+127) multiplies rows 64w..64w+63 of the M tile by the whole B
// tile: wgmma m64nBNk16, A and B both K-major in shared memory with the 128-byte swizzle; a
// warpgroup whose 64 rows are all past the expert's end issues nothing (the last M tile of an
// expert is often short). One barrier per chunk; a warpgroup keeps one chunk of wgmma in flight
// (wait_group 1) while the next chunk is widened and copied.
//
// Why the buffers are safe with one barrier per chunk (iteration q): the copies issued in q go to
// stage (q-2) % ST, last read by chunk q-2's wgmma, which every warpgroup waited for (wait_group 1)
// in q-1, before q's barrier; the widening of q writes B ring slot q % 3, last read by chunk
// q-3's wgmma, waited for in q-2, before q-1's barrier; a thread's raw copies are read back only
// by itself.
//
// Shared-memory layout of a tile (A: 128 rows, B: BN rows): row r at r * 128 bytes, its 16-byte
// chunk c (columns 8c..8c+7) at chunk position c ^ (r % 8), tiles 1024-byte aligned: the layout
// the wgmma descriptor's 128-byte swizzle mode reads (8-row groups 1024 bytes apart).
#include <string.h>

#include "backend/cuda/cuda_moe.cuh"
#include "backend/cuda/cuda_moe_widen.cuh"
#include "backend/cuda/cuda_wgmma.cuh"

#define WG_BM 128
#define WG_BK 64
#define WG_T 256

template <int BN> struct wg_cfg {
    // copy stages (prefetch distance ST - 2 chunks): 4 x (16 + 32) KB for BN 256, 6 x (16 + 16) KB
    // for BN 128 (bf16 weights); MXFP4 keeps 3 bf16 B tiles plus ST raw stages instead.
    static constexpr int ST = BN == 256 ? 4 : 6;
    static constexpr uint32_t A_BYTES = WG_BM * 128, B_BYTES = BN * 128;
    static constexpr int UNITS = BN * 2;                 // MXFP4: 32-column blocks per chunk
    static constexpr uint32_t RAW_BYTES = UNITS * 16, SCW_BYTES = UNITS * 4;
    static constexpr size_t smem(bool mx) {
        return 1024 + (size_t)ST * A_BYTES + (size_t)(mx ? 3 : ST) * B_BYTES +
               (mx ? (size_t)ST * (RAW_BYTES + SCW_BYTES) : 0);
    }
};

// Shared-memory matrix descriptor: K-major, 128-byte swizzle (layout type 1, bits 62-63), 8-row
// groups 1024 bytes apart (stride byte offset, bits 32-45, in 16-byte units); the leading byte
// offset is unused in this mode (1 by convention). Stepping k by 16 columns inside the 64-column
// atom adds 32 bytes to the start address: the hardware applies the swizzle to the final address.
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}



template <int BN> __device__ __forceinline__ void wgmma_bn(float *d, uint64_t da, uint64_t db, int scale_d);
template <> __device__ __forceinline__ void wgmma_bn<128>(float *d, uint64_t da, uint64_t db, int scale_d) {
    wgmma_m64n128<0>(d, da, db, scale_d); // both operands K-major
}
template <> __device__ __forceinline__ void wgmma_bn<256>(float *d, uint64_t da, uint64_t db, int scale_d) {
    wgmma_m64n256<0>(d, da, db, scale_d);
}

template <bool MX, bool GATEUP, int BN>
__global__ void __launch_bounds__(WG_T, 1) moe_wg_kernel(const __grid_constant__ xargs a) {
    typedef wg_cfg<BN> C;
    constexpr int ST = C::ST, NB = MX ? 3 : ST;  // copy stages, bf16 B tiles
    constexpr int NH = GATEUP ? BN / 2 : BN;      // output columns per N tile
    constexpr int NACC = BN / 2;                  // accumulators per thread (m64nBN over 128 threads)
    constexpr int APT = WG_BM * 8 / WG_T;         // 16-byte A pieces per thread and chunk
    constexpr int BPT = BN * 8 / WG_T;            // 16-byte bf16 B pieces per thread and chunk
    constexpr int UPT = C::UNITS / WG_T;          // MXFP4 32-column blocks per thread and chunk
    extern __shared__ uint8_t wg_smem[];
    const uint32_t sA = (smem_u32(wg_smem) + 1023u) & ~1023u;
    const uint32_t sB = sA + ST * C::A_BYTES, sR = sB + NB * C::B_BYTES, sS = sR + ST * C::RAW_BYTES;

    const int NN = a.R / NH, J = a.K / WG_BK;
    const int total = a.counts[a.E + 1] * NN, G = gridDim.x, b = blockIdx.x;
    if (b >= total) return;
    const int Q = ((total - 1 - b) / G + 1) * J;  // this block's chunks, all its items in a row
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, wwarp = (tid >> 5) & 3;
    const size_t estr = (size_t)a.R * a.K;

    // ---- copies (the item whose chunks are being copied: ld_*)
    const int a_ch = tid & 7, a_row0 = tid >> 3;  // A piece i: row a_row0 + 32 i, 16-byte chunk a_ch
    const uint16_t *xsrc[APT];
    bool xok[APT];
    int ld_e = 0, ld_n0 = 0;
    auto load = [&](int q) {
        const int li = q / J, j = q - li * J, stage = q % ST;
        if (j == 0) {
            const int w = b + li * G, ti = w / NN;
            const int e = a.tiles[2 * ti], r0 = a.tiles[2 * ti + 1], rend = a.offsets[e + 1];
            ld_e = e, ld_n0 = (w - ti * NN) * NH;
#pragma unroll
            for (int i = 0; i < APT; i++) {
                const int r = r0 + a_row0 + 32 * i;
                xok[i] = r < rend;
                const int src = xok[i] ? (GATEUP ? a.row_token[r] : r) : 0;
                xsrc[i] = a.x + (size_t)src * a.K + a_ch * 8;
            }
        }
        const uint32_t dA = sA + stage * C::A_BYTES;
#pragma unroll
        for (int i = 0; i < APT; i++) {
            const int row = a_row0 + 32 * i;
            cp_async16(dA + row * 128 + ((a_ch ^ (row & 7)) << 4), xsrc[i] + j * WG_BK, xok[i]);
        }
        const size_t ebase = (size_t)ld_e * estr;
        if (MX) {
#pragma unroll
            for (int i = 0; i < UPT; i++) {
                const int u = tid + WG_T * i, nr = u >> 1, half = u & 1;
                const bool m3 = GATEUP && nr >= NH;
                const size_t base = ebase + (size_t)(ld_n0 + (m3 ? nr - NH : nr)) * a.K;
                const uint8_t *q4 = m3 ? a.wq[1] : a.wq[0], *s8 = m3 ? a.ws[1] : a.ws[0];
                cp_async16(sR + stage * C::RAW_BYTES + u * 16, q4 + base / 2 + j * 32 + half * 16, true);
                // the aligned word holding this block's scale byte (never past the allocation)
                const uintptr_t sp = (uintptr_t)(s8 + base / 32 + 2 * j + half);
                cp_async4(sS + stage * C::SCW_BYTES + u * 4, (const void *)(sp & ~(uintptr_t)3));
            }
        } else {
            const uint32_t dB = sB + stage * C::B_BYTES;
#pragma unroll
            for (int i = 0; i < BPT; i++) {
                const int nr = a_row0 + 32 * i;
                const bool m3 = GATEUP && nr >= NH;
                const uint16_t *wb = m3 ? a.wb[1] : a.wb[0];
                const size_t base = ebase + (size_t)(ld_n0 + (m3 ? nr - NH : nr)) * a.K;
                cp_async16(dB + nr * 128 + ((a_ch ^ (nr & 7)) << 4), wb + base + j * WG_BK + a_ch * 8, true);
            }
        }
    };
    // ---- MXFP4: this thread's copied blocks of chunk q (column chunk j) -> bf16 B tile q % 3
    auto widen = [&](int q, int j) {
        const int stage = q % ST;
        const uint32_t dB = sB + (q % 3) * C::B_BYTES;
#pragma unroll
        for (int i = 0; i < UPT; i++)
            widen_unit<GATEUP, NH>(tid + WG_T * i, sR + stage * C::RAW_BYTES, sS + stage * C::SCW_BYTES, dB, a, j);
    };

    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; i++) acc[i] = 0.0f;
#pragma unroll
    for (int q = 0; q < ST - 2; q++) {
        if (q < Q) load(q);
        cp_commit();  // one group per chunk, empty ones too: wait_group counts stay fixed
    }
    const int g = lane >> 2, c = lane & 3;
    for (int ci = 0, q = 0; q < Q; ci++) {
        int c_r0, c_rend, c_n0;
        {
            const int w = b + ci * G, ti = w / NN;
            const int e = a.tiles[2 * ti];
            c_r0 = a.tiles[2 * ti + 1] + wg * 64, c_rend = a.offsets[e + 1], c_n0 = (w - ti * NN) * NH;
        }
        const bool c_on = c_r0 < c_rend;  // warpgroup-uniform
        for (int j = 0; j < J; j++, q++) {
            cp_wait<ST - 3>();  // this thread's copies of chunk q have landed
            if (MX) widen(q, j);
            fence_async_smem();
            __syncthreads();
            if (q + ST - 2 < Q) load(q + ST - 2);
            cp_commit();
            if (c_on) {
                const uint32_t aT = sA + (q % ST) * C::A_BYTES + wg * 64 * 128, bT = sB + (q % NB) * C::B_BYTES;
                wgmma_fence();
                fence_acc<NACC>(acc);
#pragma unroll
                for (int kk = 0; kk < WG_BK / 16; kk++)
                    wgmma_bn<BN>(acc, wg_desc(aT + kk * 32), wg_desc(bT + kk * 32), j > 0 || kk > 0);
                wgmma_commit();
                fence_acc<NACC>(acc);
            }
            wgmma_wait<1>();  // chunk q - 1 done: its stage is free after the next barrier
        }
        wgmma_wait<0>();
        fence_acc<NACC>(acc);
        if (c_on) {
            moe_wg_epilogue<GATEUP, NACC>(a, acc, c_r0, c_rend, c_n0, wwarp, g, c);
        }
    }
}

// ---------------------------------------------------------------- launchers

#define WG_MAX_DEV 64
template <bool MX, bool GATEUP, int BN> static void wg_launch(const xargs &a, int tiles, cudaStream_t st) {
    const size_t smem = wg_cfg<BN>::smem(MX);
    static bool attr[WG_MAX_DEV];
    static int sms[WG_MAX_DEV];
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_REQUIRE(dev >= 0 && dev < WG_MAX_DEV);
    if (!attr[dev]) {  // per device: the dynamic shared-memory limit is raised on the current one
        CUDA_CHECK(cudaFuncSetAttribute(moe_wg_kernel<MX, GATEUP, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev));
        attr[dev] = true;
    }
    const long items = (long)tiles * (a.R / (GATEUP ? BN / 2 : BN));
    const int grid = items < sms[dev] ? (int)items : sms[dev];
    if (grid <= 0) return;
    moe_wg_kernel<MX, GATEUP, BN><<<grid, WG_T, smem, st>>>(a);
    CUDA_CHECK_LAUNCH();
}

template <bool MX> static void wg_pair(const xargs &g, const xargs &d, int tiles, bool narrow, cudaStream_t st) {
    if (narrow) wg_launch<MX, true, 128>(g, tiles, st);
    else wg_launch<MX, true, 256>(g, tiles, st);  // I % 128 == 0: 128 columns of w1 and of w3
    if (narrow || d.R % 256) wg_launch<MX, false, 128>(d, tiles, st);
    else wg_launch<MX, false, 256>(d, tiles, st);
}

void moe_wg_experts(const xargs &g, const xargs &d, bool mx, int tiles, bool narrow, cudaStream_t st) {
    CUDA_REQUIRE(g.R % 128 == 0 && g.K % WG_BK == 0 && d.R % 128 == 0 && d.K % WG_BK == 0);
    if (mx) wg_pair<true>(g, d, tiles, narrow, st);
    else wg_pair<false>(g, d, tiles, narrow, st);
}
