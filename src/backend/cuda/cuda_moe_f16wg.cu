// Path 16's one-token MXFP4 decode pair with the consumer on FP8 wgmma (LUNAR_MOE_F16_WG, the default at
// one token where the inter size is >= 1024 since session 19;
// issue 8, session 17, docs/benchmarks.md "MoE decode, MXFP4, at one token: the consumer on FP8 wgmma").
//
// Why: at one token path 16 (cuda_moe_f16.cu) is bound by its consumers' instruction count (the
// consumers alone, SKIP=3, take as long as the copy ring alone: 83 us on K3.1), ~176 of ~330
// instructions a chunk being the widening to f16x2 (11 per 8 weights). FP8 mma.sync is emulated on
// sm_90a (F2FP unpacks + f16 HMMA); the native FP8 path is wgmma, whose A operand may come from
// registers. The widening's two words before the prmt are already E5M2 bytes of the weights:
//   h = (q & 0x80808080) | ((q >> 3) & 0x0e0e0e0e)          the odd nibbles  (3 instructions)
//   l = ((q << 4) & 0x80808080) | ((q << 1) & 0x0e0e0e0e)   the even nibbles (4)
// each byte E2M1 x 2^-14 exactly (cuda_moe_f16.cu's top note), so 7 instructions per 8 weights and
// no prmt. The activations become e4m3 pairs hi + lo (v = x 2^s, hi = e4m3(v), lo = e4m3(v - hi):
// ~7 significant bits, bf16-level; s a power of two per token putting max |v| in [128, 256)).
//
// The wgmma: m64n8k32.f32.e5m2.e4m3, one per 32-column scale block and matrix into fresh
// accumulators, A from registers (8-bit A fragment, as mma.sync m16n8k32's: warp w of the
// warpgroup holds rows 16 w + g (a0: k 4c..4c+3, a2: k 16+4c..) and 16 w + g + 8 (a1, a3); g =
// lane / 4, c = lane % 4), so a0 / a1 = l of rows g / g + 8 (the words ldmatrix gives, as path 16)
// and a2 / a3 = h: logical k 4c + i is physical column 8c + 2i of the block, k 16 + 4c + i column
// 8c + 2i + 1. B (K-major, no swizzle: core matrices of 8 rows (n) x 16 bytes (k)) is read from
// XB in shared memory, built once a block: two arrays (k 0..15 and k 16..31 of every block, LBO
// apart) of 16-byte rows, row 2 b = hi of block b, 2 b + 1 = lo. The descriptor of block b starts
// at row 2 b, so column n = 0 is hi, n = 1 lo, and columns 2..7 are the next blocks' rows (finite
// products, never read; 8 zero rows after the last block). D's m64n8 fragment: lane (g, c) holds
// (row g, columns 2c, 2c + 1) in d0, d1 and (row g + 8, ...) in d2, d3, so the c = 0 lanes get
// hi + lo = d0 + d1 (row g) and d2 + d3 (row g + 8); then path 16's scale FFMA (2^(s - 126) for the
// E8M0 byte), and 2^13 2^-s once in the epilogue.
//
// Structure: one warpgroup = 4 warps = 64 rows (4 tiles of 16, each warp streaming its own rows
// through path 16's per-warp cp.async ring, mx_ring_src) over the k range; KS = LUNAR_MOE_F16_WG
// (1, 2 or 4) warpgroups a block take interleaved chunks of 128 columns and meet in shared memory.
// Every warp of a warpgroup runs the same chunk sequence (wgmma is collective): warps whose rows
// lie past R copy nothing, compute on whatever the ring holds and store nothing. A chunk's 4 x NM
// wgmma are one commit group, waited for before its scale FFMA.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "backend/cuda/cuda_moe.cuh"
#include "backend/cuda/cuda_wgmma.cuh"

namespace {

constexpr int ST = 4;  // ring stages, as path 16

__device__ __forceinline__ void wg_ldsm_x4(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
// 2^(s - 126) for scale byte b of w (path 16's scale_f)
__device__ __forceinline__ float wg_scale(uint32_t w, int b) {
    return __uint_as_float(prmt(w, 0u, 0x4440u + (uint32_t)b) * 0x800000u + 0x800000u);
}
// D[64 x 8] = A[64 x 32] B[32 x 8], A e5m2 from registers, B e4m3 K-major by descriptor; scale-d 0
// (fresh accumulators). Outputs only: written asynchronously, read after wgmma_wait + fence_acc.
__device__ __forceinline__ void wg_e5m2_e4m3(float *d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k32.f32.e5m2.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, "
                 "1;\n}\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(0));
}
// no-swizzle descriptor at shared address addr; the leading (k) and stride (n) offsets both lbo
// (n = 8: one 8-row group, so the stride offset is never used; equal, it cannot be misread)
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo) {
    return (uint64_t)((addr & 0x3ffff) >> 4) | ((uint64_t)((lbo >> 4) & 0x3fff) << 16) |
           ((uint64_t)((lbo >> 4) & 0x3fff) << 32);
}
// 4 floats -> their e4m3 bytes in order (low byte first), and the values those bytes hold
__device__ __forceinline__ uint32_t e4m3x4(float v0, float v1, float v2, float v3, float *back) {
    const __nv_fp8x2_storage_t p = __nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(make_float2(v2, v3), __NV_SATFINITE, __NV_E4M3);
    const float2 bp = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(p, __NV_E4M3)));
    const float2 bq = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(q, __NV_E4M3)));
    back[0] = bp.x, back[1] = bp.y, back[2] = bq.x, back[3] = bq.y;
    return (uint32_t)p | ((uint32_t)q << 16);
}
// the 8 activations of uint4 u (bf16 for gate/up, f16 for down: path 16's h) as floats
template <bool GATEUP> __device__ __forceinline__ void x_floats(uint4 u, float *f) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (GATEUP) {
            f[2 * i] = __uint_as_float(w[i] << 16), f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        } else {
            const float2 v = __half22float2(*reinterpret_cast<const __half2 *>(&w[i]));
            f[2 * i] = v.x, f[2 * i + 1] = v.y;
        }
    }
}

// grid (ceil(R / 64), slots), 128 KS threads. CS: no weight copies (SKIP=3: the consumers alone,
// wrong results, the benchmark only). opt bit 32: one token's route (offsets[e] = slot, row_token 0).
template <bool GATEUP, int KS, bool CS>
__global__ void __launch_bounds__(128 * KS, 4 / KS) moe_f16wg_kernel(xargs a, uint32_t opt) {
    constexpr int NM = GATEUP ? 2 : 1;
    extern __shared__ __align__(16) float red[];  // [KS][2 NM][128] when KS > 1, then the rings, then XB
    uint4 *rings = (uint4 *)(red + (KS > 1 ? KS * 2 * NM * 128 : 0));
    const int slot = blockIdx.y;
    // pre (down: opt bit 8, path 16's EARLY bit 1, cuda_moe_f16.cu's EARLY note; gate/up: opt bit 64, only
    // for a settled route): the route's count and expert id and the ring's first ST chunks before
    // griddepcontrol.wait. The weights are no kernel's output and the route was written at least two
    // launches back (the down kernel's: before the gate/up kernel; the gate/up kernel's: the caller says
    // so, lunar_cuda_moe_route.settled; cuda_common.cuh's rule), so the blocks that become resident beside
    // the predecessor's last wave stream their first chunks while it finishes; the activations (x, h: the
    // direct predecessor's output) are read after the wait.
    const bool pre = (opt & (GATEUP ? 64u : 8u)) != 0;
    if (!pre) pdl_wait();
    const int cnt = a.counts[a.E], e = a.active[slot];
    if (slot >= cnt || e < 0 || e >= a.E) {
        if (pre) pdl_wait();  // every block waits (the chain stays transitive)
        return;
    }
    const bool one = (opt & 32u) != 0;
    // kw: this thread's warpgroup (a constant 0 at KS = 1, so the chunk loop's count and the B descriptors are
    // uniform values the compiler can keep in uniform registers)
    const int kw = KS > 1 ? (int)(threadIdx.x >> 7) : 0, t = threadIdx.x & 127, warp = t >> 5, lane = t & 31;
    const int g = lane >> 2, c = lane & 3;
    const int tile = blockIdx.x * 4 + warp;
    const bool live = tile * 16 < a.R;
    const int ra = tile * 16 + g, rb = ra + 8;
    const size_t estr = (size_t)a.R * a.K;
    // this warpgroup's ring: uint4 [ST][2 NM][128] weights, then uint32 [ST][2 NM][128] scale words
    uint4 *rw = rings + (size_t)kw * ST * 2 * NM * 128 * 5 / 4;
    uint32_t *rs = (uint32_t *)(rw + ST * 2 * NM * 128);
    const int wslot = warp * 32 + 4 * g + (c ^ ((g >> 1) & 3));
    const int lr = lane & 7, lm = lane >> 3;
    const uint32_t rbase = smem_u32(rw + warp * 32 + 4 * lr + (lm ^ ((lr >> 1) & 3)));
    // rows past R read row R - 1 (never stored; live = false copies nothing anyway)
    const mx_ring_src<NM> src(a, e, estr, min(ra, a.R - 1), min(rb, a.R - 1), c);
    const int J = a.K / 128, nj = (J - kw + KS - 1) / KS;  // chunks kw, kw + KS, ...
    int ii = 0, ist = 0;                                    // issue cursor: chunk index ii of nj, stage
    auto issue_next = [&]() {
        if constexpr (!CS) src.template issue_at<ST>(rw, rs, 64u * (uint32_t)(kw + KS * ii), ist, live && ii < nj,
                                                     wslot, t);
        ii++;
        if (++ist == ST) ist = 0;
    };
#pragma unroll
    for (int p = 0; p < ST; p++) issue_next();
    if (pre) pdl_wait();
    // XB: the token's activations as e4m3 hi / lo rows (top note), built by the whole block while the
    // ring fills
    const int NB = a.K / 32;
    const uint32_t lbo = (uint32_t)(2 * NB + 8) * 16u;
    unsigned char *xb = (unsigned char *)(rings + (size_t)KS * ST * 2 * NM * 128 * 5 / 4);
    __shared__ float wmax[16];
    const int off = one ? slot : a.offsets[e];
    const uint16_t *xr = a.x + (size_t)(GATEUP ? (one ? 0 : a.row_token[off]) : off) * a.K;
    const int K8 = a.K / 8, nth = 128 * KS;
    float mx = 0.0f;
    for (int q = threadIdx.x; q < K8; q += nth) {
        float f[8];
        x_floats<GATEUP>(__ldg((const uint4 *)(xr + 8 * q)), f);
#pragma unroll
        for (int i = 0; i < 8; i++) mx = fmaxf(mx, fabsf(f[i]));
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) wmax[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = wmax[0];
    for (int w = 1; w < 4 * KS; w++) mx = fmaxf(mx, wmax[w]);
    int ex = 0;
    frexpf(mx, &ex);                                            // mx in [2^(ex-1), 2^ex)
    const int s = mx > 0.0f ? max(-100, min(100, 8 - ex)) : 0;  // max |x 2^s| in [128, 256)
    const float up = __uint_as_float((uint32_t)(127 + s) << 23);
    const float down = __uint_as_float((uint32_t)(127 + 13 - s) << 23);  // 2^13 (path 16's) x 2^-s
    for (int q = threadIdx.x; q < K8; q += nth) {
        float f[8], hv[4], lv[4];
        x_floats<GATEUP>(__ldg((const uint4 *)(xr + 8 * q)), f);
#pragma unroll
        for (int i = 0; i < 8; i++) f[i] *= up;
        const int b = q >> 2, cq = q & 3;
        // even columns (k 4c + i) into the first array, odd (k 16 + 4c + i) into the second
#pragma unroll
        for (int hl = 0; hl < 2; hl++) {
            unsigned char *p = xb + hl * lbo + (size_t)(2 * b) * 16 + 4 * cq;
            const uint32_t hw = e4m3x4(f[hl], f[hl + 2], f[hl + 4], f[hl + 6], hv);
            const uint32_t lw = e4m3x4(f[hl] - hv[0], f[hl + 2] - hv[1], f[hl + 4] - hv[2], f[hl + 6] - hv[3], lv);
            *(uint32_t *)p = hw;
            *(uint32_t *)(p + 16) = lw;
        }
    }
    for (int i = threadIdx.x; i < 2 * 8 * 4; i += nth) {  // the 8 zero rows after the last block, both arrays
        const int hl = i >> 5, w = i & 31;
        *(uint32_t *)(xb + hl * lbo + (size_t)(2 * NB) * 16 + 4 * w) = 0u;
    }
    fence_async_smem();  // generic-proxy stores read next by wgmma (the async proxy)
    __syncthreads();
    const uint64_t db0 = wg_desc(smem_u32(xb), lbo);

    float acc[NM][2];
#pragma unroll
    for (int i = 0; i < NM; i++) acc[i][0] = acc[i][1] = 0.0f;
    for (int jj = 0; jj < nj; jj++) {
        const int j = kw + KS * jj, st = jj % ST;
        cp_async_wait<ST - 1>();
        __syncwarp();  // the ldmatrix reads the other lanes' copies
        uint32_t wa[NM][4], wb[NM][4], swa[NM], swb[NM];
#pragma unroll
        for (int i = 0; i < NM; i++) {
            wg_ldsm_x4(wa[i], rbase + (uint32_t)((st * 2 * NM + 2 * i) * 128 * 16));
            wg_ldsm_x4(wb[i], rbase + (uint32_t)((st * 2 * NM + 2 * i + 1) * 128 * 16));
            swa[i] = rs[(st * 2 * NM + 2 * i) * 128 + t];
            swb[i] = rs[(st * 2 * NM + 2 * i + 1) * 128 + t];
        }
        __syncwarp();  // every lane's reads of this stage are done before any lane refills it
        issue_next();
        uint32_t fa[4][NM][4];
#pragma unroll
        for (int b = 0; b < 4; b++)
#pragma unroll
            for (int i = 0; i < NM; i++) {
                const uint32_t qa = wa[i][b], qb = wb[i][b];
                fa[b][i][0] = ((qa << 4) & 0x80808080u) | ((qa << 1) & 0x0e0e0e0eu);  // l, row g
                fa[b][i][1] = ((qb << 4) & 0x80808080u) | ((qb << 1) & 0x0e0e0e0eu);  // l, row g + 8
                fa[b][i][2] = (qa & 0x80808080u) | ((qa >> 3) & 0x0e0e0e0eu);         // h, row g
                fa[b][i][3] = (qb & 0x80808080u) | ((qb >> 3) & 0x0e0e0e0eu);         // h, row g + 8
            }
        float d[4][NM][4];
        wgmma_fence();
#pragma unroll
        for (int b = 0; b < 4; b++)
#pragma unroll
            for (int i = 0; i < NM; i++)
                wg_e5m2_e4m3(d[b][i], fa[b][i][0], fa[b][i][1], fa[b][i][2], fa[b][i][3],
                             db0 + (uint64_t)(2 * (4 * j + b)));  // block 4 j + b: row 2 (4 j + b), 32 bytes on
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int b = 0; b < 4; b++)
#pragma unroll
            for (int i = 0; i < NM; i++) {
                fence_acc<4>(d[b][i]);
                acc[i][0] = fmaf(wg_scale(swa[i], b), d[b][i][0] + d[b][i][1], acc[i][0]);
                acc[i][1] = fmaf(wg_scale(swb[i], b), d[b][i][2] + d[b][i][3], acc[i][1]);
            }
    }
    cp_async_wait<0>();
    if (KS > 1) {  // warpgroup 0 adds the others' partials in order (deterministic)
        if (kw > 0) {
#pragma unroll
            for (int i = 0; i < NM; i++)
#pragma unroll
                for (int v = 0; v < 2; v++) red[((kw * NM + i) * 2 + v) * 128 + t] = acc[i][v];
        }
        __syncthreads();
        if (kw > 0) return;
        for (int k2 = 1; k2 < KS; k2++)
#pragma unroll
            for (int i = 0; i < NM; i++)
#pragma unroll
                for (int v = 0; v < 2; v++) acc[i][v] += red[((k2 * NM + i) * 2 + v) * 128 + t];
    }
    if (c != 0 || !live) return;
    // lane (g, 0): rows ra (acc[.][0]) and rb (acc[.][1]) of the one token
    const size_t pr = (size_t)off;
#pragma unroll
    for (int v = 0; v < 2; v++) {
        const int row = v ? rb : ra;
        if (row >= a.R) continue;
        if (GATEUP) {
            const float hv = glu_act(acc[0][v] * down, acc[NM - 1][v] * down, a.act, a.beta, a.beta_l);
            __half hh = __float2half_rn(hv);  // f16: path 16's down kernel (and this one) reads h as is
            a.h[pr * a.R + row] = *reinterpret_cast<uint16_t *>(&hh);
        } else {
            a.y[pr * a.R + row] = acc[0][v] * down * a.row_weight[pr];
        }
    }
}

template <bool GATEUP, int KS, bool CS> void launch_wg(const xargs &a, int slots, uint32_t opt, cudaStream_t st) {
    constexpr int NM = GATEUP ? 2 : 1;
    const size_t smem = (KS > 1 ? (size_t)KS * 2 * NM * 128 * 4 : 0) + (size_t)KS * ST * 2 * NM * 128 * 20 +
                        2 * (size_t)(2 * (a.K / 32) + 8) * 16;
    static size_t opted[8];  // the opt-in above 48 KB, raised per device when a call needs more
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    if (smem > 48 * 1024 && (dev < 0 || dev >= 8 || smem > opted[dev])) {
        CUDA_CHECK(cudaFuncSetAttribute(moe_f16wg_kernel<GATEUP, KS, CS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
        if (dev >= 0 && dev < 8) opted[dev] = smem;
    }
    launch_pdl(moe_f16wg_kernel<GATEUP, KS, CS>, dim3(ceil_div_u(a.R, 64), slots), dim3(128 * KS), smem, st, a, opt);
}

template <bool GATEUP, int KS> void launch_c(bool cs, const xargs &a, int slots, uint32_t opt, cudaStream_t st) {
    if (cs) launch_wg<GATEUP, KS, true>(a, slots, opt, st);
    else launch_wg<GATEUP, KS, false>(a, slots, opt, st);
}
template <bool GATEUP> void launch_g(int ks, bool cs, const xargs &a, int slots, uint32_t opt, cudaStream_t st) {
    if (ks == 4) launch_c<GATEUP, 4>(cs, a, slots, opt, st);
    else if (ks == 2) launch_c<GATEUP, 2>(cs, a, slots, opt, st);
    else launch_c<GATEUP, 1>(cs, a, slots, opt, st);
}

}  // namespace

// LUNAR_MOE_F16_WG (read at every launch: the op tests switch it): 1 one warpgroup a block, 2 / 4 two /
// four splitting k (the TP8 slice: 6 gate/up row groups of 64 an expert, 96 blocks at top-16, well under a
// wave at 1); 0: off (path 16). Unset: 2 where the experts' inter size (the down K) is >= 1024 (K3 / K3.1's
// 3072: the pair with the early fill below 104.2 -> 97.1 us, every round of 4 in session 19's call), else off
// (the TP8 slice's 384: 25.0 against path 16's 22.3 us; docs/benchmarks.md "MoE decode, MXFP4, at one token:
// the FP8 wgmma pair the default"). Only at one token, with both K multiples of 128 (path 16's chunks).
int moe_f16wg_mode(int n, int Kg, int Kd) {
    const char *v = getenv("LUNAR_MOE_F16_WG");
    const int m = v ? atoi(v) : Kd >= 1024 ? 2 : 0;
    return n == 1 && Kg % 128 == 0 && Kd % 128 == 0 && (m == 1 || m == 2 || m == 4) ? m : 0;
}

// LUNAR_MOE_F16_EARLY, as path 16's (bits; unset 15): 1 the down kernel's ring fill before its PDL wait
// (opt bit 8, the kernel's pre note), 4 the one-token route (opt bit 32: offsets[e] = the slot, row_token
// 0, neither loaded), 8 the gate/up kernel's ring fill before its wait where the route is settled (opt bit
// 64); bit 2 (the count and id loaded together) is what this kernel always does.
void moe_f16wg_decode(const xargs &g, const xargs &d, int slots, cudaStream_t st, cudaEvent_t mid, bool settled) {
    const char *sk = getenv("LUNAR_MOE_F16_SKIP"), *ev = getenv("LUNAR_MOE_F16_EARLY");
    const bool cs = sk && atoi(sk) == 3;
    const int eb = ev ? atoi(ev) : 15;
    const uint32_t opt = (eb & 4 ? 32u : 0u) | (eb & 1 ? 8u : 0u);
    const uint32_t gopt = opt | (settled && (eb & 8) ? 64u : 0u);
    const int ks = moe_f16wg_mode(1, g.K, d.K);  // the caller checked the shapes
    launch_g<true>(ks, cs, g, slots, gopt, st);
    if (mid) CUDA_CHECK(cudaEventRecord(mid, st));
    launch_g<false>(ks, cs, d, slots, opt, st);
}
