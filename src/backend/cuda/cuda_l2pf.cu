// L2 prefetch of weight ranges on a stream of their own (issue 9, session 15).
//
// Why: at batch 1 the decode step alternates weight streams (the projections, the MoE pair) with
// chains of small kernels that move almost nothing from DRAM (KDA: the convolution, the gate, the
// recurrence, the gated norm; MLA: the latent store, the (un)absorption, the attention, the merge).
// DRAM idles through each chain, ~10-20 us a layer, and the kernel after it (the output projection,
// 19 MB at Kimi-Linear's shape) then streams from DRAM at ~2.1 TB/s (docs/benchmarks.md "Decode
// B = 1: one-wave gemv (session 10)"). The forward forks this kernel from the main stream where a
// chain starts (model/forward_cuda.c, l2pf_fork) with the weights the kernels after the chain will
// read, so they come out of L2 instead. Session 6's prefetch inside the streaming kernels
// (LUNAR_PDL_PREFETCH) differs: it ran while DRAM was busy with the predecessor's stream.
//
// A prefetch is a hint: it returns nothing, L2 is the device's point of coherence, so it can never
// make a read stale; only the addresses must be valid memory. The ranges are cut into chunks of
// `chunk` bytes (16-byte aligned, a multiple of 16: cp.async.bulk.prefetch's rule; the unaligned
// head and tail bytes of a range are dropped), one request (or one per line) per chunk, the chunks of
// all the ranges dealt to the grid's blocks round robin.
#include "backend/cuda/cuda_common.cuh"

namespace {

struct l2pf_args {
    const char *p[LUNAR_CUDA_L2PF_MAX];
    unsigned long long bytes[LUNAR_CUDA_L2PF_MAX];
    int n;
    unsigned chunk;
};
// OP 2's loads stay alive by a store here that depends on their values (never taken in practice)
__device__ unsigned l2pf_sink;

// OP 0: one cp.async.bulk.prefetch.L2 per chunk. OP 1: prefetch.global.L2::evict_last per 128-byte line of
// the chunk. OP 2: the chunk's 16-byte words loaded (L1 not allocated, L2 evict_last) and xor-ed.
template <int OP>
__global__ void __launch_bounds__(128) l2pf_kernel(l2pf_args a) {
    // consecutive chunks go to consecutive blocks (thread i of block b is t = b + i * gridDim.x): an SM
    // issues prefetches at ~0.1-0.2 TB/s (H200, "Session 15, lead's calls"), so a range needs its
    // requests spread over many SMs, not over the threads of a few
    const unsigned long long t = blockIdx.x + (unsigned long long)threadIdx.x * gridDim.x,
                             nt = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long base = 0; // chunks of the ranges before range r
    unsigned acc = 0;
    for (int r = 0; r < a.n; r++) {
        const unsigned long long nc = (a.bytes[r] + a.chunk - 1) / a.chunk;
        // this thread's chunks of range r: c = t - base (mod nt), then every nt-th
        unsigned long long c = t >= base % nt ? t - base % nt : t + nt - base % nt;
        for (; c < nc; c += nt) {
            const unsigned long long off = c * a.chunk;
            const unsigned long long len = a.bytes[r] - off < a.chunk ? a.bytes[r] - off : a.chunk;
            const char *q = a.p[r] + off;
            if (OP == 0) {
                pdl_prefetch_l2(q, (uint32_t)(len & ~15ull));
            } else if (OP == 1) {
                for (unsigned long long i = 0; i < len; i += 128)
                    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(q + i) : "memory");
            } else {
                uint64_t pol;
                asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
                // 8 loads in flight before their values are used (a thread's bytes in flight, not its issue rate,
                // bound a load stream)
                for (unsigned long long i = 0; i < len; i += 128) {
                    unsigned x[8][4];
#pragma unroll
                    for (int u = 0; u < 8; u++)
                        if (i + 16 * u + 16 <= len)
                            asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                                         : "=r"(x[u][0]), "=r"(x[u][1]), "=r"(x[u][2]), "=r"(x[u][3])
                                         : "l"(q + i + 16 * u), "l"(pol));
                        else
                            x[u][0] = x[u][1] = x[u][2] = x[u][3] = 0;
#pragma unroll
                    for (int u = 0; u < 8; u++) acc ^= x[u][0] ^ x[u][1] ^ x[u][2] ^ x[u][3];
                }
            }
        }
        base += nc;
    }
    if (OP == 2 && acc == 0x9e3779b9u) l2pf_sink = acc;
}

}  // namespace

// LUNAR_L2PF_OP: bulk (0), line (1: the default), load (2); read once
static int l2pf_op(void) {
    static int op = -1;
    if (op < 0) {
        const char *e = getenv("LUNAR_L2PF_OP");
        op = e && !strcmp(e, "bulk") ? 0 : e && !strcmp(e, "load") ? 2 : 1;
    }
    return op;
}

extern "C" void lunar_cuda_l2_prefetch_op(const lunar_cuda_range *r, int n, unsigned chunk, int blocks, int op,
                                          lunar_cuda_stream st) {
    CUDA_REQUIRE(n >= 0 && n <= LUNAR_CUDA_L2PF_MAX && chunk >= 16 && chunk % 16 == 0 && blocks > 0);
    CUDA_REQUIRE(op >= 0 && op <= 2);
    l2pf_args a = {};
    a.chunk = chunk;
    for (int i = 0; i < n; i++) {
        // the range's 16-byte aligned interior (chunks then start aligned: chunk % 16 == 0)
        const uintptr_t p0 = ((uintptr_t)r[i].p + 15) & ~(uintptr_t)15;
        const uintptr_t p1 = ((uintptr_t)r[i].p + r[i].bytes) & ~(uintptr_t)15;
        if (!r[i].p || p1 <= p0) continue;
        a.p[a.n] = (const char *)p0, a.bytes[a.n] = p1 - p0, a.n++;
    }
    if (!a.n) return;
    void (*k)(l2pf_args) = op == 0 ? l2pf_kernel<0> : op == 1 ? l2pf_kernel<1> : l2pf_kernel<2>;
    k<<<blocks, 128, 0, to_stream(st)>>>(a);
    CUDA_CHECK_LAUNCH();
}
extern "C" void lunar_cuda_l2_prefetch(const lunar_cuda_range *r, int n, unsigned chunk, int blocks,
                                       lunar_cuda_stream st) {
    lunar_cuda_l2_prefetch_op(r, n, chunk, blocks, l2pf_op(), st);
}
