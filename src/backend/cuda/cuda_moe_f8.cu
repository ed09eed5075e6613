// The MoE decode experts on FP8 tensor cores (path 10, cuda_moe.cu's lunar_cuda_moe_experts_run;
// LUNAR_MOE_DECODE=f8; MXFP4 weights, n <= 64 tokens).
//
// Why: the decode pair (path 1) widens each pair of E2M1 weights to a bf16x2 in ~5 ALU instructions
// (and, shift, lop3, bf16 multiply by the scale, shift to the next nibble pair), so it streams MXFP4
// at ~2.0-2.4 TB/s against 4.0-4.3 for BF16 weights (docs/benchmarks.md "MoE decode (session 5,
// H200)"): the SM's instruction issue, not HBM, sets the rate. Here the 8 nibbles of a 32-bit word
// become two words of 4 e4m3 bytes in 7 instructions (a byte holds one value, so one shift and mask
// moves 4 of them), and the E8M0 scale leaves the inner loop:
//   - E2M1 -> e4m3 is exact: nibble S E1 E0 M goes to e4m3 bits 7 (S), 4-3 (exponent), 2 (top
//     mantissa bit), i.e. the value E2M1 * 2^-6 (E = 0 lands in the e4m3 subnormals, also exact).
//   - One mma.m16n8k32 covers exactly one 32-column scale block: thread c of a quad holds word c of
//     the block's 16 bytes (columns 8c..8c+7: the low nibbles in a0/a1, the high ones in a2/a3), so
//     every product of the mma shares the row's block scale, applied once per block to the fp32
//     result (4 FFMA per thread per block instead of a bf16 multiply per weight pair).
//   - The activations become two e4m3 terms x * 2^t = x1 + x2 (x1 = e4m3(x 2^t), x2 = e4m3(x 2^t -
//     x1)) with a per-row power of two t putting max |x| 2^t in [128, 256), by a small pre-pass
//     kernel (moe_x8_kernel); two mmas (x1 and x2) per block. A bf16 value has 8 significant bits
//     and each e4m3 term holds 4, so the split is exact for every element with |x 2^t| >= 2^-2 (the
//     residual is a multiple of 2^-9, the smallest e4m3 subnormal); smaller elements (below 2^-9
//     of the row's max) err by at most 2^-10, i.e. 2^-17 of the row's max |x| - far under the 2^-9
//     relative rounding the bf16 activations already carry. The result is rescaled by 2^(6 - t).
//   - Differences from the CPU op's dequantisation: scale byte 0 (2^-127) is taken as 0 (its
//     products are below 6 * 2^-127 |x|, under the fp32 normal range) and 255 (NaN) as +inf.
// Buffers: the gate/up pre-pass writes the latent rows' split into ybuf (n * D * 2 bytes + n
// factors: ybuf is only written by the down kernel, later); the down pre-pass converts hbuf in
// place (each thread rewrites the 32 columns it read) with its np factors after hbuf's [np, I]
// (cuda_ops.h: hbuf has np floats more).
#include <cuda_fp8.h>

#include "backend/cuda/cuda_moe.cuh"

// D = A B + C, A 16 x 32 e4m3 (row), B 32 x 8 e4m3 (col), fp32 accumulators
__device__ __forceinline__ void mma_e4m3(float *d, const float *c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// 8 E2M1 nibbles (n0 in bits 0-3) -> lo = e4m3 (n0, n2, n4, n6), hi = e4m3 (n1, n3, n5, n7), byte i
// of each from byte i of q; the masks drop what the shifts carry in from the neighbouring byte.
__device__ __forceinline__ void e4m3_of(uint32_t q, uint32_t &lo, uint32_t &hi) {
    lo = ((q << 4) & 0x80808080u) | ((q << 2) & 0x1c1c1c1cu);
    hi = (q & 0x80808080u) | ((q >> 2) & 0x1c1c1c1cu);
}

// Scale byte B of a word of 4 E8M0 bytes -> 2^(s-127) as fp32 bits (s << 23; see the top note for 0, 255)
template <int B> __device__ __forceinline__ float e8m0_f32(uint32_t w) {
    if constexpr (B < 3) return __uint_as_float((w << (23 - 8 * B)) & 0x7f800000u);
    else return __uint_as_float((w >> 1) & 0x7f800000u);
}

// One row of src [rows, K] bf16 per block -> dst: per 32-column block b, 64 bytes, 16 per quad lane
// c: x1 of columns 8c + {0,2,4,6}, x1 of 8c + {1,3,5,7}, then x2 of the same (the B fragments
// b0/b1 of the two mmas: k slots 4c..4c+3 meet the low nibbles of word c, 4c+16.. the high ones);
// fac[row] = 2^(6 - t), or NaN when the row holds a non-finite value. dst may be src: each thread
// reads its 32-column blocks before rewriting them, and no thread touches another's.
__global__ void __launch_bounds__(256) moe_x8_kernel(const uint16_t *src, uint8_t *dst, float *fac, int K) {
    pdl_enter();
    __shared__ float wmax[8];
    __shared__ int wbad[8];
    const int row = blockIdx.x, nb = K / 32, tid = threadIdx.x;
    const uint16_t *xs = src + (size_t)row * K;
    float mx = 0.0f;
    int bad = 0;
    for (int b = tid; b < nb; b += 256) {
        for (int w = 0; w < 4; w++) {
            const uint4 u = *(const uint4 *)(xs + b * 32 + w * 8);
            const uint32_t v[4] = {u.x, u.y, u.z, u.w};
            for (int i = 0; i < 4; i++) {
                const float lo = __uint_as_float(v[i] << 16), hi = __uint_as_float(v[i] & 0xffff0000u);
                bad |= !isfinite(lo) || !isfinite(hi);
                mx = fmaxf(mx, fmaxf(fabsf(lo), fabsf(hi)));
            }
        }
    }
    for (int o = 16; o; o >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    if ((tid & 31) == 0) wmax[tid >> 5] = mx, wbad[tid >> 5] = bad;
    __syncthreads();
    mx = 0.0f, bad = 0;
    for (int w = 0; w < 8; w++) mx = fmaxf(mx, wmax[w]), bad |= wbad[w];
    int t = 0;
    if (mx > 0.0f && !bad) {
        int ex;
        frexpf(mx, &ex);  // mx = f 2^ex, f in [0.5, 1): mx 2^(8 - ex) in [128, 256)
        t = 8 - ex;
    }
    if (tid == 0) fac[row] = bad ? __uint_as_float(0x7fc00000u) : ldexpf(1.0f, 6 - t);
    for (int b = tid; b < nb; b += 256) {
        float v[32];
        for (int w = 0; w < 4; w++) {
            const uint4 u = *(const uint4 *)(xs + b * 32 + w * 8);
            const uint32_t p[4] = {u.x, u.y, u.z, u.w};
            for (int i = 0; i < 4; i++) {
                v[w * 8 + 2 * i] = __uint_as_float(p[i] << 16);
                v[w * 8 + 2 * i + 1] = __uint_as_float(p[i] & 0xffff0000u);
            }
        }
        uint32_t o[16];
        for (int i = 0; i < 16; i++) o[i] = 0;
        for (int col = 0; col < 32; col++) {
            const float f = ldexpf(v[col], t);
            const __nv_fp8_storage_t x1 = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
            const float f1 = __half2float(__half(__nv_cvt_fp8_to_halfraw(x1, __NV_E4M3)));
            const __nv_fp8_storage_t x2 = __nv_cvt_float_to_fp8(f - f1, __NV_SATFINITE, __NV_E4M3);
            const int c = col / 8, odd = col & 1, byte = (col % 8) / 2;
            o[4 * c + odd] |= (uint32_t)x1 << (8 * byte);
            o[4 * c + 2 + odd] |= (uint32_t)x2 << (8 * byte);
        }
        uint4 *out = (uint4 *)(dst + (size_t)row * K * 2 + (size_t)b * 64);
        for (int c = 0; c < 4; c++) out[c] = make_uint4(o[4 * c], o[4 * c + 1], o[4 * c + 2], o[4 * c + 3]);
    }
}

#define F8_STAGES 4
// grid (row tiles, active-expert slots), block 128 = 4 warps = RT row tiles of 16 weight rows x S
// k-splits, as the decode pair's kernel (cuda_moe.cu moe_decode_kernel, whose cp.async ring this
// keeps): per chunk of 128 columns a lane copies the 16 bytes of block c of its rows g and g + 8
// (and their scale words) into a slot swizzled by (g >> 1) & 3, so that the quad's reads of word c
// of each block b (4-byte loads, 16 g + 4 (b ^ swz) + c) hit 32 distinct banks. a.x: the pre-pass's
// split rows (2 K bytes each); fac: their factors. Tokens in groups of 8 (one mma n tile).
template <bool GATEUP, int S>
__global__ void __launch_bounds__(128, 4) moe_f8_kernel(xargs a, const float *fac) {
    constexpr int NM = GATEUP ? 2 : 1, RT = 4 / S, NACC = NM * 4, ST = F8_STAGES;
    extern __shared__ __align__(16) float red[];  // [4 warps][NACC][32] when S > 1, then the ring
    float *ring = red + (S > 1 ? 4 * NACC * 32 : 0);
    pdl_enter();
    const int slot = blockIdx.y;
    if (slot >= a.counts[a.E]) return;
    const int e = a.active[slot], off = a.offsets[e], m = a.offsets[e + 1] - off;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int rt = warp / S, ks = warp % S;
    const int tile = blockIdx.x * RT + rt;
    const bool tile_ok = tile * 16 < a.R;
    const int J = a.K / 128, j0 = ks * J / S, j1 = (ks + 1) * J / S;
    const int ra = tile * 16 + g, rb = ra + 8;
    const size_t estr = (size_t)a.R * a.K;
    const uint8_t *x8 = (const uint8_t *)a.x;
    const int tid = threadIdx.x, wbase = warp * 32, swz = (g >> 1) & 3;
    const int myslot = wbase + 4 * g + (c ^ swz);
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int t0 = 0; t0 < m; t0 += 8) {
        float acc[NM][4];
#pragma unroll
        for (int i = 0; i < NM; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        const int tk = t0 + g;
        const bool tok_ok = tk < m;
        const int xrow = tok_ok ? (GATEUP ? a.row_token[off + tk] : off + tk) : 0;
        const uint8_t *xr = x8 + (size_t)xrow * a.K * 2 + c * 16;
        if (tile_ok && j0 < j1) {
            const uint8_t *qa[NM], *qb[NM], *sa[NM], *sb[NM];
#pragma unroll
            for (int i = 0; i < NM; i++) {
                qa[i] = a.wq[i] + e * estr / 2 + (size_t)ra * (a.K / 2) + c * 16;
                qb[i] = a.wq[i] + e * estr / 2 + (size_t)rb * (a.K / 2) + c * 16;
                sa[i] = a.ws[i] + e * estr / 32 + (size_t)ra * (a.K / 32);
                sb[i] = a.ws[i] + e * estr / 32 + (size_t)rb * (a.K / 32);
            }
            uint4 *rw = (uint4 *)ring;                            // [ST][2 NM][128]
            uint32_t *rs = (uint32_t *)(rw + ST * 2 * NM * 128);  // [ST][2 NM][128]
            auto issue = [&](int j) {
                if (j < j1) {
                    const int st = (j - j0) % ST;
#pragma unroll
                    for (int i = 0; i < NM; i++) {
                        cp_async16(rw + (st * 2 * NM + 2 * i) * 128 + myslot, qa[i] + (size_t)j * 64);
                        cp_async16(rw + (st * 2 * NM + 2 * i + 1) * 128 + myslot, qb[i] + (size_t)j * 64);
                        cp_async4(rs + (st * 2 * NM + 2 * i) * 128 + tid, sa[i] + 4 * j);
                        cp_async4(rs + (st * 2 * NM + 2 * i + 1) * 128 + tid, sb[i] + 4 * j);
                    }
                }
                cp_async_commit();
            };
#pragma unroll
            for (int p = 0; p < ST; p++) issue(j0 + p);
            uint4 xv[4];
            auto load_x = [&](int j, uint4 *dst) {
#pragma unroll
                for (int b = 0; b < 4; b++)
                    dst[b] = tok_ok ? __ldg((const uint4 *)(xr + (size_t)(4 * j + b) * 64)) : make_uint4(0, 0, 0, 0);
            };
            load_x(j0, xv);
            for (int j = j0; j < j1; j++) {
                const int st = (j - j0) % ST;
                cp_async_wait<ST - 1>();
                __syncwarp();  // the quad's other lanes copied the words this lane reads
                uint4 nx[4];
                if (j + 1 < j1) load_x(j + 1, nx);
#pragma unroll
                for (int i = 0; i < NM; i++) {
                    const uint32_t *pa = (const uint32_t *)(rw + (st * 2 * NM + 2 * i) * 128 + wbase + 4 * g);
                    const uint32_t *pb = (const uint32_t *)(rw + (st * 2 * NM + 2 * i + 1) * 128 + wbase + 4 * g);
                    const uint32_t wsa = rs[(st * 2 * NM + 2 * i) * 128 + tid];
                    const uint32_t wsb = rs[(st * 2 * NM + 2 * i + 1) * 128 + tid];
#pragma unroll
                    for (int b = 0; b < 4; b++) {
                        uint32_t la, ha, lb, hb;
                        e4m3_of(pa[4 * (b ^ swz) + c], la, ha);
                        e4m3_of(pb[4 * (b ^ swz) + c], lb, hb);
                        float d[4];
                        mma_e4m3(d, zero, la, lb, ha, hb, xv[b].z, xv[b].w);  // x2 first: the small terms
                        mma_e4m3(d, d, la, lb, ha, hb, xv[b].x, xv[b].y);
                        const float fa = b == 0 ? e8m0_f32<0>(wsa) : b == 1 ? e8m0_f32<1>(wsa)
                                       : b == 2 ? e8m0_f32<2>(wsa) : e8m0_f32<3>(wsa);
                        const float fb = b == 0 ? e8m0_f32<0>(wsb) : b == 1 ? e8m0_f32<1>(wsb)
                                       : b == 2 ? e8m0_f32<2>(wsb) : e8m0_f32<3>(wsb);
                        acc[i][0] = fmaf(d[0], fa, acc[i][0]);
                        acc[i][1] = fmaf(d[1], fa, acc[i][1]);
                        acc[i][2] = fmaf(d[2], fb, acc[i][2]);
                        acc[i][3] = fmaf(d[3], fb, acc[i][3]);
                    }
                }
                __syncwarp();  // every lane has read this stage before the copy into it
                issue(j + ST);
                if (j + 1 < j1) {
#pragma unroll
                    for (int b = 0; b < 4; b++) xv[b] = nx[b];
                }
            }
            cp_async_wait<0>();
        }
        if (S > 1) {
            float *mine = red + (size_t)warp * NACC * 32;
#pragma unroll
            for (int i = 0; i < NM; i++)
#pragma unroll
                for (int v = 0; v < 4; v++) mine[(i * 4 + v) * 32 + lane] = acc[i][v];
            __syncthreads();
            if (ks == 0) {
                for (int s2 = 1; s2 < S; s2++) {
                    const float *o = red + (size_t)(warp + s2) * NACC * 32;
#pragma unroll
                    for (int i = 0; i < NM; i++)
#pragma unroll
                        for (int v = 0; v < 4; v++) acc[i][v] += o[(i * 4 + v) * 32 + lane];
                }
            }
            __syncthreads();
        }
        if (ks == 0 && tile_ok) {
            // C fragment: (row g, tokens 2c, 2c+1), (row g+8, tokens 2c, 2c+1)
#pragma unroll
            for (int v = 0; v < 4; v++) {
                const int tv = t0 + 2 * c + (v & 1), row = v < 2 ? ra : rb;
                if (tv >= m) continue;
                const size_t pr = (size_t)(off + tv);
                if (GATEUP) {
                    const float f = fac[a.row_token[pr]];
                    const float hv = glu_act(acc[0][v] * f, acc[NM - 1][v] * f, a.act, a.beta, a.beta_l);
                    const __nv_bfloat16 hbv = __float2bfloat16_rn(hv);
                    a.h[pr * a.R + row] = *reinterpret_cast<const uint16_t *>(&hbv);
                } else {
                    a.y[pr * a.R + row] = acc[0][v] * fac[pr] * a.row_weight[pr];
                }
            }
        }
    }
}

template <bool GATEUP, int S>
static void f8_launch_s(const xargs &a, const float *fac, int slots, cudaStream_t st) {
    const int RT = 4 / S, nacc = (GATEUP ? 2 : 1) * 4;
    const size_t smem = (S > 1 ? (size_t)4 * nacc * 32 * 4 : 0) + (size_t)F8_STAGES * 2 * (GATEUP ? 2 : 1) * 128 * 20;
    static bool attr = false;
    if (!attr && smem > 48 * 1024) {
        CUDA_CHECK(cudaFuncSetAttribute(moe_f8_kernel<GATEUP, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
        attr = true;
    }
    launch_pdl(moe_f8_kernel<GATEUP, S>, dim3(ceil_div_u(a.R / 16, RT), slots), dim3(128), smem, st, a, fac);
}

template <bool GATEUP>
static void f8_launch(const xargs &a, const float *fac, int slots, cudaStream_t st) {
    const int J = a.K / 128, S = J >= 8 ? 4 : J >= 4 ? 2 : 1;  // as the decode pair
    if (S == 4) f8_launch_s<GATEUP, 4>(a, fac, slots, st);
    else if (S == 2) f8_launch_s<GATEUP, 2>(a, fac, slots, st);
    else f8_launch_s<GATEUP, 1>(a, fac, slots, st);
}

void moe_f8_experts(const xargs &g, const xargs &d, int n, int np, int slots, cudaStream_t st) {
    uint8_t *gx8 = (uint8_t *)d.y;  // ybuf: written by the down kernel only, after
    float *gfac = (float *)(gx8 + (size_t)n * g.K * 2);
    launch_pdl(moe_x8_kernel, dim3(n), dim3(256), 0, st, g.x, gx8, gfac, g.K);
    xargs g8 = g;
    g8.x = (const uint16_t *)gx8;
    f8_launch<true>(g8, gfac, slots, st);
    uint8_t *hx8 = (uint8_t *)g.h;  // in place
    float *hfac = (float *)(hx8 + (size_t)np * d.K * 2);
    launch_pdl(moe_x8_kernel, dim3(np), dim3(256), 0, st, (const uint16_t *)g.h, hx8, hfac, d.K);
    xargs d8 = d;
    d8.x = (const uint16_t *)hx8;
    f8_launch<false>(d8, hfac, slots, st);
}
