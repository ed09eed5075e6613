// KDA chunked prefill: what the bf16 state passes share (cuda_kda_chunk.cu's kda_state_bf16_kernel and
// kda_state_ws_kernel, cuda_kda_state2.cu's kda_state_grp_kernel): the scratch layout, the async
// copies, the mma.sync / ldmatrix fragments and the steps (a)-(c) of one chunk. Moved here unchanged.
#pragma once
#include "backend/cuda/cuda_common.cuh"

#define BT 64
#define DK 128

// 16-byte asynchronous global -> shared copies: a whole tile is in flight at once (one memory
// round trip per load phase instead of one per loop iteration).
__device__ __forceinline__ void cp16(float *sdst, const float *gsrc) {
    const unsigned sa = (unsigned)__cvta_generic_to_shared(sdst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gsrc));
}
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

struct kda_ws {
    float *W, *U, *Qg, *Kg, *Aq, *Dc;
};

__device__ __forceinline__ unsigned pack_bf16(float a, float b) {
    __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<unsigned *>(&p);
}

// ---------------------------------------------------------------- kernel 2b: bf16 state pass

// mma.sync m16n8k16 bf16 with fp32 accumulation; fragments from shared memory with ldmatrix.
// Fragment layouts (PTX ISA), g = lane / 4, t = lane % 4: A regs {(g, 2t..2t+1), (g+8, 2t..),
// (g, 2t+8..), (g+8, 2t+8..)}; B regs {(k 2t..2t+1, n g), (k 2t+8.., n g)}; C {(g, 2t), (g, 2t+1),
// (g+8, 2t), (g+8, 2t+1)}.
__device__ __forceinline__ void ldsm4(unsigned (&r)[4], const __nv_bfloat16 *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm4t(unsigned (&r)[4], const __nv_bfloat16 *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp16b(__nv_bfloat16 *sdst, const __nv_bfloat16 *gsrc) {
    const unsigned sa = (unsigned)__cvta_generic_to_shared(sdst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gsrc));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

// acc[0..N) += a x B for one 16-deep k step: a is the A fragment of 16 rows (ldmatrix), b points at
// this lane's ldmatrix.trans row of the B slice (16 x 8N bf16, row stride in the pointer's tile).
// Every matmul of the state pass below is a loop of this step.
template <int N>
__device__ __forceinline__ void mma_k16(float (&acc)[N][4], const unsigned (&a)[4], const __nv_bfloat16 *b) {
#pragma unroll
    for (int p = 0; p < N / 2; p++) {
        unsigned r[4];
        ldsm4t(r, b + 16 * p);
        mma_bf16(acc[2 * p], a, r[0], r[1]);
        mma_bf16(acc[2 * p + 1], a, r[2], r[3]);
    }
}

#define LDB 136  // bf16 row stride of [.][128] tiles: 272 bytes, conflict-free ldmatrix rows
#define LDB64 72 // bf16 row stride of [.][64] tiles (144 bytes)
template <int BV> struct bstate_smem {
    static const int LDV = BV + 8;  // 16 (mod 128) bytes for BV = 32 / 64 ... (80 / 144 bytes)
    static const int halves = DK * LDV + 3 * BT * LDB + BT * LDB64 + 2 * BT * LDV;
    static const size_t bytes = sizeof(__nv_bfloat16) * halves + sizeof(float) * DK;
};

// The state pass's steps, written once: kda_state_bf16_kernel and kda_state_ws_kernel run the same
// arithmetic (bit-equal outputs) and differ only in who runs which step when, and where the tiles
// sit. Forced inline, and the fragment coordinates come in as arguments computed once by the kernel:
// against the steps written out in the kernels (tools/ptx_same.py, session 9) every floating-point,
// mma, ldmatrix, shared/global memory and barrier instruction is the same; kda_state_bf16_kernel<32>
// has one integer instruction more (an address sum reassociated) and kda_state_ws_kernel<32> a few
// integer address instructions of its Qg load different (the compiler simplifies a helper before
// inlining it, knowing less of its arguments' ranges; deriving the coordinates in the helpers was
// further off). Tiles are bf16, row strides LDB ([.][128]), LDB64 ([.][64]) and LDV = BV + 8 (the
// state copy, U, V_new); cb = h * NC + n indexes a chunk in the workspace. Fragments: warp
// (mt, c0) = (warp & 3, (warp >> 2) BV/2) owns rows r0 = 16 mt + g.. and columns c0..c0 + BV/2 of
// (a) and (b); warp w owns key rows sr0 = 16 w + g, sr1 = sr0 + 8 of the state (c); g = lane / 4,
// t4 = lane % 4; lr, lc: this lane's ldmatrix row / column.

// the workspace's bf16 tiles as the state pass reads them (kda_ws holds them as float pointers)
struct ws_bf16 {
    const __nv_bfloat16 *W, *U, *Qg, *Kg, *Aq;
    __device__ __forceinline__ explicit ws_bf16(const kda_ws &ws)
        : W(reinterpret_cast<const __nv_bfloat16 *>(ws.W)), U(reinterpret_cast<const __nv_bfloat16 *>(ws.U)),
          Qg(reinterpret_cast<const __nv_bfloat16 *>(ws.Qg)), Kg(reinterpret_cast<const __nv_bfloat16 *>(ws.Kg)),
          Aq(reinterpret_cast<const __nv_bfloat16 *>(ws.Aq)) {}
};

// [64][128] tiles of chunk cb, given as (dst, src) pairs (the same offsets in each), one loop over
// the 256 threads
__device__ __forceinline__ void load_row_dk(int, int, size_t) {}
template <typename... R>
__device__ __forceinline__ void load_row_dk(int r, int j, size_t cb, __nv_bfloat16 *dst, const __nv_bfloat16 *src,
                                            R... rest) {
    cp16b(dst + r * LDB + j, src + cb * BT * DK + r * DK + j);
    load_row_dk(r, j, cb, rest...);
}
template <typename... R>
__device__ __forceinline__ void load_tiles_dk(size_t cb, int tid, R... tiles) {
    for (int idx = tid; idx < BT * DK / 8; idx += 256) {
        const int r = idx >> 4, j = (idx & 15) * 8;
        load_row_dk(r, j, cb, tiles...);
    }
}
// U's [64][BV] columns v0.. of chunk cb
template <int BV>
__device__ __forceinline__ void load_u(__nv_bfloat16 *Ub, const __nv_bfloat16 *Ug, size_t cb, int v0, int tid) {
    constexpr int LDV = BV + 8;
    for (int idx = tid; idx < BT * BV / 8; idx += 256) {
        const int r = idx / (BV / 8), j = (idx % (BV / 8)) * 8;
        cp16b(Ub + r * LDV + j, Ug + cb * BT * DK + r * DK + v0 + j);
    }
}
// Aqk [64][64] of chunk cb
__device__ __forceinline__ void load_aqk(__nv_bfloat16 *Ab, const __nv_bfloat16 *Agg, size_t cb, int tid) {
    for (int idx = tid; idx < BT * BT / 8; idx += 256) {
        const int r = idx >> 3, j = (idx & 7) * 8;
        cp16b(Ab + r * LDB64 + j, Agg + cb * BT * BT + r * BT + j);
    }
}
// exp(Gamma_C) [128] fp32 of chunk cb
__device__ __forceinline__ void load_dec(float *dec, const float *Dc, size_t cb, int tid) {
    if (tid < DK / 4) cp16(dec + tid * 4, Dc + cb * DK + tid * 4);
}

// the fp32 state slice (rows sr0, sr1, columns v0..v0 + BV of Sh) into registers (C-fragment
// positions) and its bf16 copy into Sb
template <int BV>
__device__ __forceinline__ void state_in(float (&s)[BV / 8][4], __nv_bfloat16 *Sb, const float *Sh, int sr0, int sr1,
                                         int v0, int t4) {
    constexpr int LDV = BV + 8;
#pragma unroll
    for (int i = 0; i < BV / 8; i++) {
        const int cc = 8 * i + 2 * t4;
        const float2 x0 = *reinterpret_cast<const float2 *>(Sh + (size_t)sr0 * DK + v0 + cc);
        const float2 x1 = *reinterpret_cast<const float2 *>(Sh + (size_t)sr1 * DK + v0 + cc);
        s[i][0] = x0.x, s[i][1] = x0.y, s[i][2] = x1.x, s[i][3] = x1.y;
        *reinterpret_cast<unsigned *>(Sb + sr0 * LDV + cc) = pack_bf16(x0.x, x0.y);
        *reinterpret_cast<unsigned *>(Sb + sr1 * LDV + cc) = pack_bf16(x1.x, x1.y);
    }
}
// ... and back to Sh after the last chunk
template <int BV>
__device__ __forceinline__ void state_out(const float (&s)[BV / 8][4], float *Sh, int sr0, int sr1, int v0, int t4) {
#pragma unroll
    for (int i = 0; i < BV / 8; i++) {
        const int cc = 8 * i + 2 * t4;
        *reinterpret_cast<float2 *>(Sh + (size_t)sr0 * DK + v0 + cc) = make_float2(s[i][0], s[i][1]);
        *reinterpret_cast<float2 *>(Sh + (size_t)sr1 * DK + v0 + cc) = make_float2(s[i][2], s[i][3]);
    }
}

// (a) V_new = U - W S (S: the bf16 copy Sb) -> bf16 Vb (r0 = 16 mt + g)
template <int BV>
__device__ __forceinline__ void step_vnew(const __nv_bfloat16 *Wb, const __nv_bfloat16 *Sb, const __nv_bfloat16 *Ub,
                                          __nv_bfloat16 *Vb, int mt, int c0, int lr, int lc, int r0, int t4) {
    constexpr int LDV = BV + 8, NT = BV / 16;
    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < DK / 16; ks++) {
        unsigned a[4];
        ldsm4(a, Wb + (16 * mt + lr) * LDB + 16 * ks + lc);
        mma_k16(acc, a, Sb + (16 * ks + lr) * LDV + c0 + lc);
    }
    const int r1 = r0 + 8;
#pragma unroll
    for (int i = 0; i < NT; i++) {
        const int cc = c0 + 8 * i + 2 * t4;
        const float2 u0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(Ub + r0 * LDV + cc));
        const float2 u1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(Ub + r1 * LDV + cc));
        *reinterpret_cast<unsigned *>(Vb + r0 * LDV + cc) = pack_bf16(u0.x - acc[i][0], u0.y - acc[i][1]);
        *reinterpret_cast<unsigned *>(Vb + r1 * LDV + cc) = pack_bf16(u1.x - acc[i][2], u1.y - acc[i][3]);
    }
}
// (b) O = Qg S + Aqk V_new into acc (S: the copy before this chunk's update)
template <int BV>
__device__ __forceinline__ void step_out(float (&acc)[BV / 16][4], const __nv_bfloat16 *Qb, const __nv_bfloat16 *Ab,
                                         const __nv_bfloat16 *Sb, const __nv_bfloat16 *Vb, int mt, int c0, int lr,
                                         int lc) {
    constexpr int LDV = BV + 8;
#pragma unroll
    for (int i = 0; i < BV / 16; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < DK / 16; ks++) {
        unsigned a[4];
        ldsm4(a, Qb + (16 * mt + lr) * LDB + 16 * ks + lc);
        mma_k16(acc, a, Sb + (16 * ks + lr) * LDV + c0 + lc);
    }
    for (int ks = 0; ks <= mt; ks++) {  // Aqk lower triangular: tokens up to this row tile
        unsigned a[4];
        ldsm4(a, Ab + (16 * mt + lr) * LDB64 + 16 * ks + lc);
        mma_k16(acc, a, Vb + (16 * ks + lr) * LDV + c0 + lc);
    }
}
// ... its rows r0, r0 + 8 (16 mt + g: the caller's, so that it is computed once) where below c (the
// chunk's tokens from t0) into fp32 o, columns v0 + c0..
template <int BV>
__device__ __forceinline__ void store_out(float *o, const float (&acc)[BV / 16][4], int t0, int c, int H, int h, int v0,
                                          int c0, int r0, int t4) {
    const int r1 = r0 + 8;
#pragma unroll
    for (int i = 0; i < BV / 16; i++) {
        const int cc = v0 + c0 + 8 * i + 2 * t4;
        if (r0 < c) *reinterpret_cast<float2 *>(o + ((size_t)(t0 + r0) * H + h) * DK + cc) = make_float2(acc[i][0], acc[i][1]);
        if (r1 < c) *reinterpret_cast<float2 *>(o + ((size_t)(t0 + r1) * H + h) * DK + cc) = make_float2(acc[i][2], acc[i][3]);
    }
}
// (c) S = exp(Gamma_C) S + Kg^T V_new in registers (warp w: key rows 16w.., all BV columns), its bf16
// copy into Sn
template <int BV>
__device__ __forceinline__ void step_state(float (&s)[BV / 8][4], const float *dec, const __nv_bfloat16 *Kb,
                                           const __nv_bfloat16 *Vb, __nv_bfloat16 *Sn, int warp, int lane, int sr0,
                                           int sr1, int lr, int lc, int t4) {
    constexpr int LDV = BV + 8, NS = BV / 8;
    const float d0 = dec[sr0], d1 = dec[sr1];
#pragma unroll
    for (int i = 0; i < NS; i++) s[i][0] *= d0, s[i][1] *= d0, s[i][2] *= d1, s[i][3] *= d1;
    const int kr = (lane & 7) + 8 * (lane >> 4), kc = 16 * warp + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int ks = 0; ks < BT / 16; ks++) {
        unsigned a[4];
        ldsm4t(a, Kb + (16 * ks + kr) * LDB + kc);
        mma_k16(s, a, Vb + (16 * ks + lr) * LDV + lc);
    }
#pragma unroll
    for (int i = 0; i < NS; i++) {
        const int cc = 8 * i + 2 * t4;
        *reinterpret_cast<unsigned *>(Sn + sr0 * LDV + cc) = pack_bf16(s[i][0], s[i][1]);
        *reinterpret_cast<unsigned *>(Sn + sr1 * LDV + cc) = pack_bf16(s[i][2], s[i][3]);
    }
}

// cuda_kda_state2.cu: the state pass with two 64-column groups of 8 warps sharing a head's tiles,
// one block per head (the default from 67 to 132 heads)
void kda_state_grp_launch(float *o, float *S, kda_ws w, int T, int H, int NC, cudaStream_t st);

// The state pass's chunk loop over BV value columns from v0 of head h, shared by kda_state_bf16_kernel
// (a block per (head, BV columns), loader = 1) and kda_state_grp_kernel (groups of 256 threads sharing
// the column-independent tiles: only group 0 loads W, Qg, Kg, Aqk and exp(Gamma_C), loader = 0 in
// the others). tid: the thread within its 256. Loads are cp.async groups issued as soon as their
// buffer is consumed: Kg/decay for chunk n at the top of step n, W/U for n+1 after (a), Qg/Aqk for
// n+1 after (b). Every thread commits the same groups in the same order (a non-loader's may be
// empty) and every wait is followed by a block-wide barrier, so a tile any thread loaded is
// visible to all after the wait + barrier of its phase.
template <int BV>
__device__ __forceinline__ void state_chunks(float *__restrict__ o, float *Sh, const kda_ws &ws, const ws_bf16 &wg,
                                             __nv_bfloat16 *Sb, __nv_bfloat16 *Ub, __nv_bfloat16 *Vb,
                                             __nv_bfloat16 *Wb, __nv_bfloat16 *Qb, __nv_bfloat16 *Kb,
                                             __nv_bfloat16 *Ab, float *dec, int T, int H, int NC, int h, int v0,
                                             int tid, bool loader) {
    constexpr int NT = BV / 16, NS = BV / 8;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    auto load_wu = [&](int n) {
        const size_t cb = (size_t)h * NC + n;
        if (loader) load_tiles_dk(cb, tid, Wb, wg.W);
        load_u<BV>(Ub, wg.U, cb, v0, tid);
    };
    auto load_qa = [&](int n) {
        const size_t cb = (size_t)h * NC + n;
        if (loader) {
            load_tiles_dk(cb, tid, Qb, wg.Qg);
            load_aqk(Ab, wg.Aq, cb, tid);
        }
    };
    auto load_kd = [&](int n) {
        const size_t cb = (size_t)h * NC + n;
        if (loader) {
            load_tiles_dk(cb, tid, Kb, wg.Kg);
            load_dec(dec, ws.Dc, cb, tid);
        }
    };

    load_wu(0);
    cp_commit();
    load_qa(0);
    cp_commit();
    float s[NS][4];
    const int sr0 = 16 * warp + g, sr1 = sr0 + 8;
    state_in<BV>(s, Sb, Sh, sr0, sr1, v0, t4);
    const int mt = warp & 3, c0 = (warp >> 2) * (BV / 2);  // (a), (b): rows 16mt.., columns c0..
    const int lr = lane & 15, lc = 8 * (lane >> 4);           // ldmatrix row / column of this lane
    for (int n = 0; n < NC; n++) {
        const int t0 = n * BT, c = min(BT, T - t0);
        cp_wait1();  // W/U(n) landed (Qg/Aqk(n) may be in flight)
        __syncthreads();
        load_kd(n);
        cp_commit();
        const int r0 = 16 * mt + g;
        step_vnew<BV>(Wb, Sb, Ub, Vb, mt, c0, lr, lc, r0, t4);
        cp_wait1();  // Qg/Aqk(n) landed (Kg(n) may be in flight)
        __syncthreads();
        if (n + 1 < NC) load_wu(n + 1);
        cp_commit();
        float acc[NT][4];
        step_out<BV>(acc, Qb, Ab, Sb, Vb, mt, c0, lr, lc);
        store_out<BV>(o, acc, t0, c, H, h, v0, c0, r0, t4);
        cp_wait1();  // Kg/decay(n) landed (W/U(n+1) may be in flight)
        __syncthreads();  // also: every warp is done reading Sb, Qb, Ab
        if (n + 1 < NC) load_qa(n + 1);
        cp_commit();
        step_state<BV>(s, dec, Kb, Vb, Sb, warp, lane, sr0, sr1, lr, lc, t4);
    }
    state_out<BV>(s, Sh, sr0, sr1, v0, t4);
    cp_wait_all();
}
