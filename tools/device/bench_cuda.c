/* CUDA benchmarks (not a test): KDA chunked prefill, KDA decode (state bandwidth), bf16 GEMMs at
 * Kimi-Linear shapes. Device events around the region, warm-up first, median of the repeats.
 * Floors: bytes / 4.3 TB/s (copy bandwidth measured on these H200s) and FLOPs / 790 TFLOP/s
 * (bf16 8192^3 product measured on them). Prints one table row per case.
 * Usage: bench_cuda [prefill|decode|gemm|all|profile|profile32|kdastate|ptpc]
 *   (profile: one KDA prefill call per bf16 mode, for ncu, H = 96; profile32: H = 32 and the
 *   warp-specialised state pass too; kdastate: mode 2's state pass old / ws, H = 32, two rounds; ptpc: the PTPC-FP8 linears, fp8 peak = 2x bf16;
 *   kdagate: the prefill's f_b GEMM + gate (lunar_cuda_kda_gate_gemm) in its three forms, three rounds alternating;
 *   kdagate1: one call of each form at 8K, for ncu;
 *   kdaintra: mode 2's intra kernel old / fast (LUNAR_KDA_INTRA), T = 8K / 64K, H = 32 / 96, three rounds
 *   alternating, and the two forms' outputs compared at 8K; kdaintra1: one round at 8K, H = 32, for ncu;
 *   kdastate96: mode 2's state pass from 67 heads, LUNAR_KDA_STATE=old / the default (grp), T = 8K / 64K,
 *   H = 96, three rounds alternating, the two passes' o and S compared;
 *   prefill2: the prefill table's mode 2 rows alone (the default path), T = 8K / 64K, H = 96 / 32;
 *   kdadiag: the intra kernel fast (LUNAR_KDA_INTRA=fast) / tc (the default since session 16), T = 8K / 64K,
 *   H = 96 / 32, ROUNDS (3) rounds alternating, compared with fast at 8K; kdadiag1: one round at 8K, H = 96, for ncu) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_ops.h"

#define BW 4.3e12
#define TC 790e12

static int cmp_f(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}
static float median(float *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_f);
    return v[n / 2];
}
static void *dalloc(size_t bytes) {
    void *p = lunar_cuda_alloc(bytes);
    if (!p) {
        fprintf(stderr, "arena exhausted (%zu bytes more)\n", bytes);
        exit(1);
    }
    return p;
}

/* ---------------------------------------------------------------- KDA prefill */
/* One sequence's inputs of the KDA prefill benchmarks (T tokens, H heads, d = 128), the same values
 * wherever they are used: q, k random and L2-normalised per head row, v random, g = the gate of random
 * f, beta = sigmoid of random; o, S and the chunk scratch allocated (S not filled). */
typedef struct {
    float *q, *k, *v, *g, *beta, *o, *S;
    void *ws;
} kda_in;
static kda_in kda_inputs(int T, int H) {
    const int d = 128;
    const size_t nq = (size_t)T * H * d;
    kda_in in;
    float *q = in.q = dalloc(nq * 4), *k = in.k = dalloc(nq * 4), *v = in.v = dalloc(nq * 4), *g = in.g = dalloc(nq * 4);
    float *f = dalloc(nq * 4), *beta = in.beta = dalloc((size_t)T * H * 4);
    in.o = dalloc(nq * 4), in.S = dalloc((size_t)H * d * d * 4);
    float *al = dalloc(H * 4), *db = dalloc((size_t)H * d * 4);
    in.ws = dalloc(lunar_cuda_kda_chunk_ws(T, H));
    lunar_cuda_fill_uniform(q, nq, 1, -1, 1);
    lunar_cuda_fill_uniform(k, nq, 2, -1, 1);
    lunar_cuda_l2norm(q, q, T * H, d, 1e-6f, NULL);
    lunar_cuda_l2norm(k, k, T * H, d, 1e-6f, NULL);
    lunar_cuda_fill_uniform(v, nq, 3, -1, 1);
    lunar_cuda_fill_uniform(f, nq, 4, -4, 2);
    lunar_cuda_fill_uniform(al, H, 5, -2, 1);
    lunar_cuda_fill_uniform(db, (size_t)H * d, 6, -1, 1);
    lunar_cuda_kda_gate(g, f, al, db, T, H, d, 0.0f, NULL);
    lunar_cuda_fill_uniform(beta, (size_t)T * H, 7, -3, 3);
    lunar_cuda_sigmoid_inplace(beta, (size_t)T * H);
    return in;
}

/* Two warm-up calls of lunar_cuda_kda_chunked on in (state S refilled by the caller), then reps more under
 * the chunk profile's events: the medians of the intra kernel, the state pass and their sum (ms). */
static void profile_medians(const kda_in *in, int T, int H, float sc, int reps, float *mi, float *ms, float *mt) {
    float ti[32], tst[32], tt[32];
    for (int j = 0; j < 2; j++)
        lunar_cuda_kda_chunked(in->o, in->q, in->k, in->v, in->g, in->beta, in->S, T, H, sc, in->ws, NULL);
    lunar_cuda_kda_chunk_profile(1);
    for (int j = 0; j < reps; j++) {
        lunar_cuda_kda_chunked(in->o, in->q, in->k, in->v, in->g, in->beta, in->S, T, H, sc, in->ws, NULL);
        lunar_cuda_kda_chunk_profile_ms(&ti[j], &tst[j]);
        tt[j] = ti[j] + tst[j];
    }
    lunar_cuda_kda_chunk_profile(0);
    *mi = median(ti, reps), *ms = median(tst, reps), *mt = median(tt, reps);
}
static void bench_prefill_v(int T, int H, int mode, int sv) {
    const int d = 128;
    const size_t nq = (size_t)T * H * d, mark = lunar_cuda_mark();
    const kda_in in = kda_inputs(T, H);
    float *q = in.q, *k = in.k, *v = in.v, *g = in.g, *beta = in.beta, *o = in.o, *S = in.S;
    void *ws = in.ws;
    lunar_cuda_fill_uniform(S, (size_t)H * d * d, 8, -0.5f, 0.5f);
    const int prev = lunar_cuda_kda_chunk_precision(mode), prev_sv = lunar_cuda_kda_state_variant(sv);
    lunar_cuda_event e0 = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    const int reps = T >= 32768 ? 5 : 15;
    float ts[32];
    for (int i = 0; i < 2; i++)
        lunar_cuda_kda_chunked(o, q, k, v, g, beta, S, T, H, 1.0f / sqrtf(d), ws, NULL);
    for (int i = 0; i < reps; i++) {
        lunar_cuda_event_record(e0, NULL);
        lunar_cuda_kda_chunked(o, q, k, v, g, beta, S, T, H, 1.0f / sqrtf(d), ws, NULL);
        lunar_cuda_event_record(e1, NULL);
        ts[i] = lunar_cuda_event_ms(e0, e1);
    }
    lunar_cuda_sync();
    const float ms = median(ts, reps);
    float t_intra = 0, t_state = 0;
    lunar_cuda_kda_chunk_profile(1);
    lunar_cuda_kda_chunked(o, q, k, v, g, beta, S, T, H, 1.0f / sqrtf(d), ws, NULL);
    lunar_cuda_kda_chunk_profile_ms(&t_intra, &t_state);
    lunar_cuda_kda_chunk_profile(0);
    /* fp32 q, k, v, g in, o out, beta, state in+out; FLOPs per [TR] Eq. 13 (C = 64) */
    const double bytes = 5.0 * nq * 4 + (double)T * H * 4 + 2.0 * H * d * d * 4;
    const double flops = 2.0 * H * (6.0 * T * d * d + 3.0 * T * 64 * d + (double)T * 64 * 64);
    const double fl_ms = fmax(bytes / BW, flops / TC) * 1e3;
    printf("| kda prefill %s%s | T=%d H=%d | %.3f ms (intra %.2f + state %.2f) | %.3f ms (%s) | %.0f%% | %.1f TFLOP/s |\n",
           mode == 1 ? "3xTF32" : mode == 0 ? "tf32" : mode == 3 ? "bf16 old intra" : "bf16",
           sv == 4 ? " state ws" : sv == 0 ? " state old" : "", T, H, ms, t_intra, t_state, fl_ms,
           bytes / BW > flops / TC ? "bytes" : "flops", 100.0 * fl_ms / ms, flops / (ms * 1e-3) / 1e12);
    lunar_cuda_kda_state_variant(prev_sv);
    lunar_cuda_kda_chunk_precision(prev);
    lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(e1);
    lunar_cuda_release(mark);
}

static void bench_prefill(int T, int H, int mode) { bench_prefill_v(T, H, mode, -1); }

/* Same inputs through modes 2 (default), 3 (old intra kernel) and 1 (3xTF32, fp32-accurate): max
 * |difference| of o and of the final state relative to max |3xTF32| at a benchmark size (the
 * tests cover small shapes against the CPU op; this covers long sequences and many heads). */
static double max_rel(const float *a, const float *ref, size_t n) {
    double m = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - ref[i]);
        if (!(d <= m)) m = d; /* NaN propagates */
        if (fabs(ref[i]) > r) r = fabs(ref[i]);
    }
    return m / r;
}
static void crosscheck_prefill(int T, int H) {
    const int d = 128;
    const size_t nq = (size_t)T * H * d, ns = (size_t)H * d * d, mark = lunar_cuda_mark();
    float *q = dalloc(nq * 4), *k = dalloc(nq * 4), *v = dalloc(nq * 4), *g = dalloc(nq * 4);
    float *f = dalloc(nq * 4), *beta = dalloc((size_t)T * H * 4), *o = dalloc(nq * 4);
    float *S0 = dalloc(ns * 4), *S = dalloc(ns * 4), *al = dalloc(H * 4), *db = dalloc((size_t)H * d * 4);
    void *ws = dalloc(lunar_cuda_kda_chunk_ws(T, H));
    lunar_cuda_fill_uniform(q, nq, 31, -1, 1);
    lunar_cuda_fill_uniform(k, nq, 32, -1, 1);
    lunar_cuda_l2norm(q, q, T * H, d, 1e-6f, NULL);
    lunar_cuda_l2norm(k, k, T * H, d, 1e-6f, NULL);
    lunar_cuda_fill_uniform(v, nq, 33, -1, 1);
    lunar_cuda_fill_uniform(f, nq, 34, -4, 2);
    lunar_cuda_fill_uniform(al, H, 35, -2, 1);
    lunar_cuda_fill_uniform(db, (size_t)H * d, 36, -1, 1);
    lunar_cuda_kda_gate(g, f, al, db, T, H, d, 0.0f, NULL);
    lunar_cuda_fill_uniform(beta, (size_t)T * H, 37, -3, 3);
    lunar_cuda_sigmoid_inplace(beta, (size_t)T * H);
    lunar_cuda_fill_uniform(S0, ns, 38, -0.5f, 0.5f);
    float *ho[3], *hs[3];
    static const int modes[3] = {1, 2, 3};
    for (int i = 0; i < 3; i++) {
        ho[i] = malloc(nq * 4), hs[i] = malloc(ns * 4);
        lunar_cuda_fill_u32(o, 0x7fc00000u, nq); /* NaN: every element must be written */
        const int prev = lunar_cuda_kda_chunk_precision(modes[i]);
        /* S = S0 (a copy through the host: this is not timed) */
        lunar_cuda_download(hs[i], S0, ns * 4);
        lunar_cuda_upload(S, hs[i], ns * 4);
        lunar_cuda_kda_chunked(o, q, k, v, g, beta, S, T, H, 1.0f / sqrtf(d), ws, NULL);
        lunar_cuda_kda_chunk_precision(prev);
        lunar_cuda_download(ho[i], o, nq * 4);
        lunar_cuda_download(hs[i], S, ns * 4);
    }
    printf("| kda prefill check | T=%d H=%d | o: bf16 %.2e, bf16 old intra %.2e; S: %.2e, %.2e (vs 3xTF32) | | | |\n",
           T, H, max_rel(ho[1], ho[0], nq), max_rel(ho[2], ho[0], nq), max_rel(hs[1], hs[0], ns),
           max_rel(hs[2], hs[0], ns));
    for (int i = 0; i < 3; i++) free(ho[i]), free(hs[i]);
    lunar_cuda_release(mark);
}

/* Mode 2's intra kernel forms (LUNAR_KDA_INTRA: old, fast, unset = tc, the default) on one set of inputs,
 * ROUNDS rounds alternating in the order given (vs[0] first in each round): the median over the repeats of
 * the intra kernel and of the state pass (the chunk profile's events around each), and, in round 1, o, S
 * and the scratch of each form from the same initial state compared with vs[0]'s (o and S scale-relative,
 * count of differing bf16 and their largest difference). */
int lunar_cuda_kda_intra_variant(int v); /* cuda_kda_chunk.cu: 2 tc (the default), 1 fast, 0 old */
static void bench_intra(int T, int H, int rounds, int compare, const int *vs, int nv) {
    const int d = 128;
    const size_t nq = (size_t)T * H * d, ns = (size_t)H * d * d, mark = lunar_cuda_mark();
    const kda_in in = kda_inputs(T, H);
    float *q = in.q, *k = in.k, *v = in.v, *g = in.g, *beta = in.beta, *o = in.o, *S = in.S;
    const size_t wsb = lunar_cuda_kda_chunk_ws(T, H);
    void *ws = in.ws;
    const int prev = lunar_cuda_kda_chunk_precision(2), prev_iv = lunar_cuda_kda_intra_variant(0);
    const float sc = 1.0f / sqrtf(d);
    const int reps = T >= 32768 ? 7 : 21;
    /* the intra kernel's floor: q, k, v, g read (fp32), W, U, Qg, Kg (bf16), Aqk (bf16) written */
    const double ibytes = 4.0 * nq * 4 + (double)T * H * 4 + 4.0 * nq * 2 + (double)T * H * 64 * 2;
    float *ho[3] = {0, 0, 0}, *hs[3] = {0, 0, 0};
    uint16_t *hw[3] = {0, 0, 0};
    static const char *const nm[3] = {"old ", "fast", "tc  "};
    if (nv > 3) nv = 3;
    for (int r = 0; r < rounds; r++)
        for (int iv = 0; iv < nv; iv++) {
            lunar_cuda_kda_intra_variant(vs[iv]);
            lunar_cuda_fill_uniform(S, ns, 8, -0.5f, 0.5f);
            if (r == 0 && compare) {
                lunar_cuda_fill_u32(ws, 0x7fc17fc1u, wsb / 4);
                lunar_cuda_fill_u32(o, 0x7fc00000u, nq);
                lunar_cuda_kda_chunked(o, q, k, v, g, beta, S, T, H, sc, ws, NULL);
                lunar_cuda_sync();
                ho[iv] = malloc(nq * 4), hs[iv] = malloc(ns * 4), hw[iv] = malloc(wsb);
                lunar_cuda_download(ho[iv], o, nq * 4);
                lunar_cuda_download(hs[iv], S, ns * 4);
                lunar_cuda_download(hw[iv], ws, wsb);
            }
            float mi, ms, mt;
            profile_medians(&in, T, H, sc, reps, &mi, &ms, &mt);
            printf("| kda intra %s round %d | T=%d H=%d | intra %.1f us (state %.1f; total %.3f ms) | %.1f us (%.0f MB) | "
                   "%.2fx | |\n", nm[vs[iv]], r + 1, T, H, mi * 1e3, ms * 1e3, mt, ibytes / BW * 1e6,
                   ibytes / 1e6, mi * 1e-3 / (ibytes / BW));
            fflush(stdout);
        }
    for (int iv = 1; compare && iv < nv; iv++) {
        if (!ho[0] || !ho[iv]) continue;
        long nd = 0;
        double dmax = 0;
        for (size_t i = 0; i < wsb / 2; i++)
            if (hw[0][i] != hw[iv][i]) {
                union { uint32_t u; float f; } a = {(uint32_t)hw[0][i] << 16}, b = {(uint32_t)hw[iv][i] << 16};
                const double dd = fabs((double)a.f - b.f);
                nd++;
                if (!(dd <= dmax)) dmax = dd;
            }
        printf("| kda intra check | T=%d H=%d | %s vs %s: o %.2e, S %.2e (scale-relative); scratch: %ld of %zu bf16 "
               "differ, max |d| %.2e | | | |\n", T, H, nm[vs[iv]], nm[vs[0]], max_rel(ho[iv], ho[0], nq),
               max_rel(hs[iv], hs[0], ns), nd, wsb / 2, dmax);
    }
    for (int i = 0; i < 3; i++) free(ho[i]), free(hs[i]), free(hw[i]);
    lunar_cuda_kda_intra_variant(prev_iv);
    lunar_cuda_kda_chunk_precision(prev);
    lunar_cuda_release(mark);
}

/* Mode 2's state pass from 67 heads, old (LUNAR_KDA_STATE=old: kda_state_bf16_kernel<64>) and the
 * default (kda_state_grp_kernel), on one set of inputs, ROUNDS rounds alternating, the intra kernel the
 * default (session 14 measured four more tilings here, commit fa81442: slower than grp, removed):
 * median over the repeats of the intra kernel and of the state pass (the chunk profile's events); in
 * round 1 o and S of each variant from the same initial state against variant 0's (memcmp, and the
 * scale-relative difference if any). Floor of the state pass: its reads of the
 * scratch (W, U, Qg, Kg, Aqk bf16, exp(Gamma_C)) once and o written, fp32, at 4.3 TB/s. */
static void bench_state(int T, int H, int rounds) {
    static const int vs[] = {0, 4};
    static const char *names[] = {"old", "grp (default)"};
    const int nv = 2, d = 128;
    const size_t nq = (size_t)T * H * d, ns = (size_t)H * d * d, mark = lunar_cuda_mark();
    const kda_in in = kda_inputs(T, H);
    float *q = in.q, *k = in.k, *v = in.v, *g = in.g, *beta = in.beta, *o = in.o, *S = in.S;
    void *ws = in.ws;
    const int prev = lunar_cuda_kda_chunk_precision(2), prev_sv = lunar_cuda_kda_state_variant(0);
    const float sc = 1.0f / sqrtf(d);
    const int reps = T >= 32768 ? 7 : 21;
    const double sbytes = 4.0 * nq * 2 + (double)T * H * 64 * 2 + (double)T / 64 * H * d * 4 + nq * 4.0;
    float *ho0 = malloc(nq * 4), *hs0 = malloc(ns * 4), *ho = malloc(nq * 4), *hs = malloc(ns * 4);
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < nv; i++) {
            lunar_cuda_kda_state_variant(vs[i]);
            if (r == 0) {
                lunar_cuda_fill_uniform(S, ns, 8, -0.5f, 0.5f);
                lunar_cuda_fill_u32(o, 0x7fc00000u, nq);
                lunar_cuda_kda_chunked(o, q, k, v, g, beta, S, T, H, sc, ws, NULL);
                lunar_cuda_sync();
                lunar_cuda_download(i ? ho : ho0, o, nq * 4);
                lunar_cuda_download(i ? hs : hs0, S, ns * 4);
                if (i)
                    printf("| kda state check %s | T=%d H=%d | o %s (%.2e), S %s (%.2e) vs old | | | |\n", names[i], T, H,
                           memcmp(ho, ho0, nq * 4) ? "DIFFERS" : "equal", max_rel(ho, ho0, nq),
                           memcmp(hs, hs0, ns * 4) ? "DIFFERS" : "equal", max_rel(hs, hs0, ns));
            }
            lunar_cuda_fill_uniform(S, ns, 8, -0.5f, 0.5f);
            float mi, ms, mt;
            profile_medians(&in, T, H, sc, reps, &mi, &ms, &mt);
            printf("| kda state %-13s round %d | T=%d H=%d | state %.1f us (intra %.1f; total %.3f ms) | %.1f us | "
                   "%.2fx | |\n", names[i], r + 1, T, H, ms * 1e3, mi * 1e3, mt, sbytes / BW * 1e6,
                   ms * 1e-3 / (sbytes / BW));
            fflush(stdout);
        }
    free(ho0), free(hs0), free(ho), free(hs);
    lunar_cuda_kda_state_variant(prev_sv);
    lunar_cuda_kda_chunk_precision(prev);
    lunar_cuda_release(mark);
}

/* ---------------------------------------------------------------- KDA decode */
static void bench_decode(int B, int T, int H) {
    const int d = 128, R = 20;
    const size_t ns = (size_t)H * d * d, nq = (size_t)B * T * H * d, mark = lunar_cuda_mark();
    float *q = dalloc(nq * 4), *k = dalloc(nq * 4), *v = dalloc(nq * 4), *g = dalloc(nq * 4);
    float *beta = dalloc((size_t)B * T * H * 4), *o = dalloc(nq * 4);
    /* one pool per launch in the graph (like one per layer), >= 256 MB in all, so repeats do not
     * read the state from the 60 MB L2 */
    const size_t pool_bytes = B * ns * 4;
    int np = (int)((256u << 20) / pool_bytes) + 1;
    if (np > R) np = R;
    float *pools[20];
    for (int i = 0; i < np; i++) pools[i] = dalloc(pool_bytes);
    float *steps = T > 1 ? dalloc((size_t)B * T * ns * 4) : NULL;
    int32_t *slots_h = malloc(sizeof(int32_t) * B);
    for (int b = 0; b < B; b++) slots_h[b] = B - 1 - b;
    int32_t *slots = dalloc(sizeof(int32_t) * B);
    lunar_cuda_upload(slots, slots_h, sizeof(int32_t) * B);
    lunar_cuda_fill_uniform(q, nq, 11, -0.1f, 0.1f);
    lunar_cuda_fill_uniform(k, nq, 12, -0.1f, 0.1f);
    lunar_cuda_fill_uniform(v, nq, 13, -1, 1);
    lunar_cuda_fill_uniform(g, nq, 14, -0.5f, 0);
    lunar_cuda_fill_uniform(beta, (size_t)B * T * H, 15, 0, 1);
    for (int i = 0; i < np; i++) lunar_cuda_fill_uniform(pools[i], B * ns, 16 + i, -1, 1);
    lunar_cuda_stream s = lunar_cuda_stream_create();
    lunar_cuda_graph_begin(s);
    for (int i = 0; i < R; i++)
        lunar_cuda_kda_recurrent(o, q, k, v, g, beta, pools[i % np], slots, steps, B, T, H, d, d, 0.0883883f, s);
    lunar_cuda_graph gr = lunar_cuda_graph_end(s);
    lunar_cuda_event e0 = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    float ts[16];
    lunar_cuda_graph_launch(gr, s);
    for (int i = 0; i < 11; i++) {
        lunar_cuda_event_record(e0, s);
        lunar_cuda_graph_launch(gr, s);
        lunar_cuda_event_record(e1, s);
        ts[i] = lunar_cuda_event_ms(e0, e1) / R;
    }
    const float ms = median(ts, 11);
    /* state read + write (verify: read once, one write per position), q k v g o beta */
    const double bytes = (double)B * ns * 4 * (T > 1 ? 1 + T : 2) + 5.0 * nq * 4;
    printf("| kda decode%s | B=%d H=%d | %.2f us | %.2f us | %.0f%% of 4.3 TB/s (%.0f GB/s) |\n",
           T > 1 ? " verify T=4" : "", B, H, ms * 1e3, bytes / BW * 1e6, 100.0 * bytes / BW / (ms * 1e-3),
           bytes / (ms * 1e-3) / 1e9);
    lunar_cuda_graph_destroy(gr);
    lunar_cuda_stream_destroy(s);
    lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(e1);
    free(slots_h);
    lunar_cuda_release(mark);
}

/* ---------------------------------------------------------------- KDA gate GEMM
 * lunar_cuda_kda_gate_gemm at Kimi-Linear-48B's shape (H = 32, in = 128), forms 0 exact (libm gate), 1 sfu,
 * 2 loop (cuda_dense.cu). Floor: the bytes (g written fp32, xa and f_b read) at 4.2 TB/s (session 13's
 * reference) beside the products' FLOPs at TC. */
int lunar_cuda_kda_gate_form(int form); /* cuda_dense.cu's hook (not in cuda_ops.h: every CUDA object depends on it) */
typedef struct {
    float *g, *al, *db;
    uint16_t *xa, *W;
    int n;
} gate_case;
static gate_case gate_setup(int n) {
    const int H = 32, HD = H * 128, in = 128;
    gate_case c = {.n = n};
    float *tmp = dalloc((size_t)n * in * 4);
    c.xa = dalloc((size_t)n * in * 2), c.W = dalloc((size_t)HD * in * 2), c.g = dalloc((size_t)n * HD * 4);
    c.al = dalloc(H * 4), c.db = dalloc(HD * 4);
    lunar_cuda_fill_uniform(tmp, (size_t)n * in, 31, -1, 1);
    lunar_cuda_f32_to_bf16(c.xa, tmp, (size_t)n * in);
    lunar_cuda_fill_uniform(tmp, (size_t)HD * in, 32, -0.3f, 0.3f); /* f = xa . f_b^T of about unit spread */
    lunar_cuda_f32_to_bf16(c.W, tmp, (size_t)HD * in);
    lunar_cuda_fill_uniform(c.al, H, 33, -2, 1);
    lunar_cuda_fill_uniform(c.db, HD, 34, -1, 1);
    return c;
}
static void gate_call(const gate_case *c) {
    if (lunar_cuda_kda_gate_gemm(c->g, c->xa, c->W, c->n, 32, 128, 128, c->al, c->db, 0.0f, NULL) != 0) {
        fprintf(stderr, "kda_gate_gemm refused the shape\n");
        exit(1);
    }
}
static void bench_kda_gate(void) {
    static const int ns[] = {8192, 32768};
    printf("\n| kda gate GEMM | n | round | exact | sfu | loop | floor (bytes at 4.2 TB/s; flops at %.0f TF) |\n"
           "|---|---|---|---|---|---|---|\n",
           TC / 1e12);
    for (int ni = 0; ni < 2; ni++) {
        const size_t mark = lunar_cuda_mark();
        gate_case c = gate_setup(ns[ni]);
        const int n = c.n, HD = 32 * 128;
        lunar_cuda_event e0 = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
        const double bytes = (double)n * HD * 4 + (double)n * 128 * 2 + (double)HD * 128 * 2;
        const double flops = 2.0 * n * HD * 128;
        for (int round = 0; round < 3; round++) {
            float us[3];
            for (int form = 0; form < 3; form++) {
                const int prev = lunar_cuda_kda_gate_form(form);
                gate_call(&c); /* warm-up: the attribute, the code */
                const int reps = 15, inner = 5;
                float ts[15];
                for (int i = 0; i < reps; i++) {
                    lunar_cuda_event_record(e0, NULL);
                    for (int j = 0; j < inner; j++) gate_call(&c);
                    lunar_cuda_event_record(e1, NULL);
                    ts[i] = lunar_cuda_event_ms(e0, e1) / inner;
                }
                us[form] = median(ts, reps) * 1e3f;
                lunar_cuda_kda_gate_form(prev);
            }
            printf("| | %d | %d | %.1f us | %.1f us | %.1f us | %.1f us (%.1f MB); %.1f us |\n", n, round + 1, us[0], us[1],
                   us[2], bytes / 4.2e12 * 1e6, bytes / 1e6, flops / TC * 1e6);
            fflush(stdout);
        }
        lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(e1);
        lunar_cuda_release(mark);
    }
}

/* ---------------------------------------------------------------- GEMM */
/* bf16 operands of an [n, in] x [out, in]^T product in the arena: *copies weight matrices (several
 * when one fits in L2 (60 MB), so repeats do not time the cache; the array malloc'ed), x */
static uint16_t **gemm_operands(int n, int out, int in, int *copies, uint16_t **x) {
    const size_t wbytes = (size_t)out * in * 2;
    *copies = wbytes < (256u << 20) ? (int)((256u << 20) / wbytes + 1) : 1;
    uint16_t **W = malloc(sizeof(uint16_t *) * *copies);
    float *tmp = dalloc((size_t)out * in * 4 > (size_t)n * in * 4 ? (size_t)out * in * 4 : (size_t)n * in * 4);
    for (int c = 0; c < *copies; c++) {
        W[c] = dalloc(wbytes);
        lunar_cuda_fill_uniform(tmp, (size_t)out * in, 20 + c, -0.05f, 0.05f);
        lunar_cuda_f32_to_bf16(W[c], tmp, (size_t)out * in);
    }
    *x = dalloc((size_t)n * in * 2);
    lunar_cuda_fill_uniform(tmp, (size_t)n * in, 99, -1, 1);
    lunar_cuda_f32_to_bf16(*x, tmp, (size_t)n * in);
    return W;
}
static void bench_gemm(const char *name, int n, int out, int in, lunar_cuda_dtype ydt) {
    const size_t mark = lunar_cuda_mark();
    const size_t wbytes = (size_t)out * in * 2;
    int copies;
    uint16_t *x;
    uint16_t **W = gemm_operands(n, out, in, &copies, &x);
    void *y = dalloc((size_t)n * out * (ydt == LUNAR_CUDA_F32 ? 4 : 2));
    lunar_cuda_event e0 = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    for (int i = 0; i < 3; i++) lunar_cuda_matmul(y, ydt, x, W[i % copies], n, out, in, NULL);
    const int reps = 20, inner = 10;
    float ts[20];
    for (int i = 0; i < reps; i++) {
        lunar_cuda_event_record(e0, NULL);
        for (int j = 0; j < inner; j++) lunar_cuda_matmul(y, ydt, x, W[(i * inner + j) % copies], n, out, in, NULL);
        lunar_cuda_event_record(e1, NULL);
        ts[i] = lunar_cuda_event_ms(e0, e1) / inner;
    }
    const float ms = median(ts, reps);
    const double flops = 2.0 * n * out * in;
    const double bytes = (double)wbytes + (double)n * in * 2 + (double)n * out * (ydt == LUNAR_CUDA_F32 ? 4 : 2);
    const double fl_ms = fmax(bytes / BW, flops / TC) * 1e3;
    printf("| gemm %s | n=%d out=%d in=%d | %.1f us | %.1f us (%s) | %.0f%% | %.0f TFLOP/s, %.0f GB/s |\n", name,
           n, out, in, ms * 1e3, fl_ms * 1e3, bytes / BW > flops / TC ? "bytes" : "flops", 100.0 * fl_ms / ms,
           flops / (ms * 1e-3) / 1e12, bytes / (ms * 1e-3) / 1e9);
    lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(e1);
    free(W);
    lunar_cuda_release(mark);
}

/* ---------------------------------------------------------------- skinny GEMMs at decode rows
 * The forward's mm_b at n rows (bf16 x, fp32 y): the default path (n <= 4 the CUDA-core skinny kernel,
 * else cuBLASLt) against the tensor-core skinny kernel (cuda_gemm.cu gemv_mma_kernel, forced for every
 * n by lunar_cuda_gemv_mma_range), ROUNDS rounds alternating, medians of 20 x 10 calls over weight copies
 * that do not fit L2. Floor: W + x + y bytes at BW (4.3 TB/s). */
static float time_mm(void *y, const uint16_t *x, uint16_t **W, int copies, int n, int out, int in) {
    lunar_cuda_event e0 = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    const int reps = 20, inner = 10;
    float ts[20];
    for (int i = -1; i < reps; i++) { /* i = -1: warm-up (plans, attributes) */
        lunar_cuda_event_record(e0, NULL);
        for (int j = 0; j < inner; j++) {
            const uint16_t *w = W[((i + 1) * inner + j) % copies];
            if (lunar_cuda_matmul_bf16x(y, LUNAR_CUDA_F32, x, w, n, out, in, NULL) != 0)
                lunar_cuda_matmul(y, LUNAR_CUDA_F32, x, w, n, out, in, NULL);
        }
        lunar_cuda_event_record(e1, NULL);
        if (i >= 0) ts[i] = lunar_cuda_event_ms(e0, e1) / inner;
    }
    lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(e1);
    return median(ts, reps) * 1e3f;
}
static void bench_gemv_mma(const char *name, int n, int out, int in, int rounds) {
    const size_t mark = lunar_cuda_mark();
    const size_t wbytes = (size_t)out * in * 2;
    int copies;
    uint16_t *x;
    uint16_t **W = gemm_operands(n, out, in, &copies, &x);
    float *y = dalloc((size_t)n * out * 4);
    const double floor_us = ((double)wbytes + (double)n * in * 2 + (double)n * out * 4) / BW * 1e6;
    int lo, hi;
    lunar_cuda_gemv_mma_range(1, 0, &lo, &hi);
    printf("| %s | n=%d out=%d in=%d |", name, n, out, in);
    for (int r = 0; r < rounds; r++) {
        lunar_cuda_gemv_mma_range(1, 0, NULL, NULL);
        const float a = time_mm(y, x, W, copies, n, out, in);
        lunar_cuda_gemv_mma_range(1, 32, NULL, NULL);
        const float b = time_mm(y, x, W, copies, n, out, in);
        printf(" %.1f / %.1f |", a, b);
    }
    lunar_cuda_gemv_mma_range(lo, hi, NULL, NULL);
    printf(" %.1f us (%.1f MB) |\n", floor_us, wbytes / 1e6);
    fflush(stdout);
    free(W);
    lunar_cuda_release(mark);
}

/* ---------------------------------------------------------------- PTPC-FP8 linears
 * One model linear from its fp32 input as the forward's mm() runs it: bf16 weights (n <= 4: the
 * skinny kernel rounding x itself; else x -> bf16 + cuBLASLt) against PTPC-FP8 (n <= 4: the fused
 * decode kernel; else the per-token quantiser + the FP8 GEMM + its scaling). Floor: the weight bytes
 * (2 or 1 per weight) plus x and y at the bandwidth, or the flops at the bf16 / fp8 dense peak. */
static double ptpc_floor_us(int n, int out, int in, int wbytes_per) {
    const double bytes = (double)out * in * wbytes_per + (double)n * in * 4 + (double)n * out * 4;
    return fmax(bytes / BW, 2.0 * n * out * in / (wbytes_per == 1 ? 2 * TC : TC)) * 1e6;
}
static void bench_ptpc(const char *name, int n, int out, int in) {
    const size_t mark = lunar_cuda_mark();
    const size_t wbytes = (size_t)out * in * 2;
    const int copies = wbytes < (256u << 20) ? (int)((256u << 20) / wbytes + 1) : 1;
    uint16_t **W = malloc(sizeof(uint16_t *) * copies);
    uint8_t **Q = malloc(sizeof(uint8_t *) * copies);
    float **S = malloc(sizeof(float *) * copies);
    float *tmp = dalloc((size_t)out * in * 4 > (size_t)n * in * 4 ? (size_t)out * in * 4 : (size_t)n * in * 4);
    for (int c = 0; c < copies; c++) {
        W[c] = dalloc(wbytes), Q[c] = dalloc((size_t)out * in), S[c] = dalloc((size_t)out * 4);
        lunar_cuda_fill_uniform(tmp, (size_t)out * in, 20 + c, -0.05f, 0.05f);
        lunar_cuda_f32_to_bf16(W[c], tmp, (size_t)out * in);
        lunar_cuda_ptpc_quantize(Q[c], S[c], W[c], LUNAR_CUDA_BF16, out, in, NULL);
    }
    float *x = dalloc((size_t)n * in * 4), *y = dalloc((size_t)n * out * 4);
    lunar_cuda_fill_uniform(x, (size_t)n * in, 99, -1, 1);
    uint16_t *xb = dalloc((size_t)n * in * 2);
    uint8_t *qx = dalloc((size_t)n * in);
    float *sx = dalloc((size_t)n * 4);
    lunar_cuda_event e0 = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    float ms[2];
    for (int form = 0; form < 2; form++) {
        const int reps = 20, inner = 10;
        float ts[20];
        for (int i = -1; i < reps; i++) { /* i = -1: warm-up (plans, heuristics) */
            lunar_cuda_event_record(e0, NULL);
            for (int j = 0; j < inner; j++) {
                const int c = ((i + 1) * inner + j) % copies;
                if (form == 0) {
                    if (lunar_cuda_matmul_f32x(y, LUNAR_CUDA_F32, x, W[c], n, out, in, NULL) != 0) {
                        lunar_cuda_f32_to_bf16(xb, x, (size_t)n * in);
                        lunar_cuda_matmul(y, LUNAR_CUDA_F32, xb, W[c], n, out, in, NULL);
                    }
                } else if (lunar_cuda_ptpc_gemv(y, LUNAR_CUDA_F32, x, LUNAR_CUDA_F32, Q[c], S[c], n, out, in, NULL)) {
                    lunar_cuda_ptpc_quantize(qx, sx, x, LUNAR_CUDA_F32, n, in, NULL);
                    lunar_cuda_ptpc_matmul(y, LUNAR_CUDA_F32, qx, sx, Q[c], S[c], n, out, in, NULL);
                }
            }
            lunar_cuda_event_record(e1, NULL);
            if (i >= 0) ts[i] = lunar_cuda_event_ms(e0, e1) / inner;
        }
        ms[form] = median(ts, reps);
    }
    const double fb = ptpc_floor_us(n, out, in, 2), f8 = ptpc_floor_us(n, out, in, 1);
    printf("| ptpc %s | n=%d out=%d in=%d | bf16 %.1f us (%.0f%% of %.1f) | ptpc %.1f us (%.0f%% of %.1f) | %.2fx |\n",
           name, n, out, in, ms[0] * 1e3, 100 * fb / (ms[0] * 1e3), fb, ms[1] * 1e3, 100 * f8 / (ms[1] * 1e3), f8,
           ms[0] / ms[1]);
    lunar_cuda_event_destroy(e0), lunar_cuda_event_destroy(e1);
    free(W), free(Q), free(S);
    lunar_cuda_release(mark);
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "all";
    lunar_err err;
    if (lunar_cuda_init(0, (size_t)52 << 30, &err) != 0) {
        fprintf(stderr, "bench_cuda: %s\n", err.msg);
        return 1;
    }
    printf("device: %s\n\n", lunar_cuda_describe());
    printf("| case | shape | lunar | floor | of floor | rate |\n|---|---|---|---|---|---|\n");
    const int all = strcmp(what, "all") == 0;
    if (all || strcmp(what, "prefill") == 0) {
        static const int Ts[] = {8192, 65536}, Hs[] = {32, 96};
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 2; b++)
                for (int mode = 0; mode < 3; mode++) bench_prefill(Ts[a], Hs[b], mode == 0 ? 2 : mode == 1 ? 3 : 1);
        crosscheck_prefill(8192, 96);
        crosscheck_prefill(65536, 32);
    }
    if (strcmp(what, "prefill2") == 0) { /* mode 2 alone (the default path; LUNAR_KDA_INTRA picks the intra form) */
        static const int Ts[] = {8192, 65536}, Hs[] = {96, 32};
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 2; b++) bench_prefill(Ts[a], Hs[b], 2);
    }
    if (strcmp(what, "kdaintra") == 0) { /* mode 2's intra kernel: old / fast, three rounds alternating */
        static const int Ts[] = {8192, 65536}, Hs[] = {32, 96};
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 2; b++) bench_intra(Ts[a], Hs[b], 3, a == 0, (const int[]){0, 1}, 2); /* compared at 8K */
    }
    if (strcmp(what, "kdastate96") == 0) { /* the state pass from 67 heads, old / grp, three rounds alternating */
        bench_state(8192, 96, 3);
        bench_state(65536, 96, 3);
    }
    if (strcmp(what, "kdaintra1") == 0) { /* one call of each form at 8K, H = 32, for ncu */
        bench_intra(8192, 32, 1, 0, (const int[]){0, 1}, 2);
    }
    if (strcmp(what, "kdadiag") == 0) { /* fast / tc (the default), ROUNDS (3) rounds alternating */
        const int rounds = getenv("ROUNDS") ? atoi(getenv("ROUNDS")) : 3;
        static const int Ts[] = {8192, 65536}, Hs[] = {96, 32}, vs[] = {1, 2};
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 2; b++) bench_intra(Ts[a], Hs[b], rounds, a == 0, vs, 2); /* compared at 8K */
    }
    if (strcmp(what, "kdadiag1") == 0) { /* one call of each form at 8K, H = 96, for ncu */
        static const int vs[] = {1, 2};
        bench_intra(8192, 96, 1, 0, vs, 2);
    }
    if (strcmp(what, "kdastate") == 0) /* mode 2's state pass: old / ws, two rounds alternating */
        for (int round = 0; round < 2; round++)
            for (int t = 0; t < 2; t++)
                for (int v = 0; v < 2; v++) bench_prefill_v(t ? 65536 : 8192, 32, 2, v ? 4 : 0);
    if (strcmp(what, "profile") == 0 || strcmp(what, "profile32") == 0) { /* one call per mode, for ncu */
        const int T = 8192, H = what[7] ? 32 : 96, d = 128; /* profile32: H = 32, the model's */
        const size_t nq = (size_t)T * H * d;
        float *q = dalloc(nq * 4), *k = dalloc(nq * 4), *v = dalloc(nq * 4), *g = dalloc(nq * 4);
        float *beta = dalloc((size_t)T * H * 4), *o = dalloc(nq * 4), *S = dalloc((size_t)H * d * d * 4);
        void *ws = dalloc(lunar_cuda_kda_chunk_ws(T, H));
        lunar_cuda_fill_uniform(q, nq, 1, -0.1f, 0.1f);
        lunar_cuda_fill_uniform(k, nq, 2, -0.1f, 0.1f);
        lunar_cuda_fill_uniform(v, nq, 3, -1, 1);
        lunar_cuda_fill_uniform(g, nq, 4, -1, 0);
        lunar_cuda_fill_uniform(beta, (size_t)T * H, 5, 0, 1);
        lunar_cuda_fill_uniform(S, (size_t)H * d * d, 6, -0.5f, 0.5f);
        for (int mode = 2; mode <= 3; mode++) {
            const int prev = lunar_cuda_kda_chunk_precision(mode);
            lunar_cuda_kda_chunked(o, q, k, v, g, beta, S, T, H, 1.0f / sqrtf(d), ws, NULL);
            lunar_cuda_kda_chunk_precision(prev);
        }
        if (what[7]) { /* and the warp-specialised state pass (mode 2) */
            const int pv = lunar_cuda_kda_state_variant(4);
            lunar_cuda_kda_chunked(o, q, k, v, g, beta, S, T, H, 1.0f / sqrtf(d), ws, NULL);
            lunar_cuda_kda_state_variant(pv);
        }
        lunar_cuda_sync();
    }
    if (all || strcmp(what, "decode") == 0) {
        static const int Bs[] = {1, 8, 32, 64, 128, 256};
        for (int i = 0; i < 6; i++) bench_decode(Bs[i], 1, 32);
        bench_decode(8, 4, 32);
        bench_decode(64, 4, 32);
    }
    if (all || strcmp(what, "gemm") == 0) {
        static const struct { const char *name; int out, in; } sh[] = {
            {"qkv", 12288, 2304}, {"o_proj", 2304, 4096}, {"mlp gate_up", 18432, 2304},
            {"mlp down", 2304, 9216}, {"expert gate_up", 2048, 2304}, {"lm_head", 163840, 2304}};
        static const int ns[] = {1, 16, 256, 4096};
        for (int s = 0; s < 6; s++)
            for (int i = 0; i < 4; i++)
                bench_gemm(sh[s].name, ns[i], sh[s].out, sh[s].in, s == 5 ? LUNAR_CUDA_F32 : LUNAR_CUDA_BF16);
        bench_gemm("peak", 8192, 8192, 8192, LUNAR_CUDA_BF16);
    }
    if (strcmp(what, "gemvmma") == 0) { /* the forward's skinny GEMMs: default path / tensor-core kernel */
        static const struct { const char *name; int out, in; } sh[] = {
            {"k31 kda in", 4876, 7168}, {"k31 o_proj", 7168, 1536}, {"k31 latent down", 3584, 7168},
            {"k31 latent up", 7168, 3584}, {"k31 shared+router", 1664, 7168}, {"k31 shared down", 7168, 384},
            {"kl48 kda in", 12576, 2304}, {"kl48 o_proj", 2304, 4096}, {"kl48 shared+router", 2304, 2304},
            {"kl48 shared down", 2304, 1024}};
        const char *ne = getenv("GEMV_NS");
        int ns[16], nn = 0;
        for (const char *p = ne ? ne : "1,2,4,5,8,12,16,24,32"; *p && nn < 16;) {
            ns[nn++] = atoi(p);
            while (*p && *p != ',') p++;
            if (*p == ',') p++;
        }
        const int rounds = getenv("ROUNDS") ? atoi(getenv("ROUNDS")) : 2;
        printf("\n| skinny GEMM (us: default / tensor-core kernel, per round) | shape |");
        for (int r = 0; r < rounds; r++) printf(" round %d |", r + 1);
        printf(" floor |\n|---|---|");
        for (int r = 0; r <= rounds; r++) printf("---|");
        printf("\n");
        for (unsigned s = 0; s < sizeof sh / sizeof sh[0]; s++)
            for (int i = 0; i < nn; i++) bench_gemv_mma(sh[s].name, ns[i], sh[s].out, sh[s].in, rounds);
    }
    if (strcmp(what, "kdagate") == 0) bench_kda_gate();
    if (strcmp(what, "kdagate1") == 0) { /* one 8K call of each form, for ncu */
        gate_case c = gate_setup(8192);
        for (int form = 0; form < 3; form++) {
            const int prev = lunar_cuda_kda_gate_form(form);
            gate_call(&c);
            lunar_cuda_kda_gate_form(prev);
        }
        lunar_cuda_sync();
    }
    if (strcmp(what, "ptpc") == 0) { /* Kimi-Linear-48B's PTPC linears (not in "all") */
        static const struct { const char *name; int out, in; } sh[] = {
            {"kda q/k/v", 4096, 2304}, {"kda o", 2304, 4096}, {"kda f_a/g_a", 128, 2304}, {"kda f_b/g_b", 4096, 128},
            {"mla q", 6144, 2304}, {"mla kv_a", 576, 2304}, {"shared gate/up", 1024, 2304},
            {"shared down", 2304, 1024}, {"dense gate/up", 9216, 2304}, {"dense down", 2304, 9216}};
        static const int ns[] = {1, 4, 64, 8192};
        printf("\n| PTPC linear | shape | bf16 | ptpc | bf16/ptpc |\n|---|---|---|---|---|\n");
        for (unsigned s = 0; s < sizeof sh / sizeof sh[0]; s++)
            for (int i = 0; i < 4; i++) bench_ptpc(sh[s].name, ns[i], sh[s].out, sh[s].in);
        long long sc, un, fb, gv;
        lunar_cuda_ptpc_stats(&sc, &un, &fb, &gv);
        printf("\nPTPC calls: cuBLASLt scaled %lld, unscaled + scaling %lld, fallback %lld, decode kernel %lld\n", sc, un,
               fb, gv);
        if (lunar_cuda_ptpc_scaled_note()[0]) printf("%s\n", lunar_cuda_ptpc_scaled_note());
    }
    lunar_cuda_shutdown();
    return 0;
}
