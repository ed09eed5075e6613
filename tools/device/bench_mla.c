/* CUDA MLA / DSA benchmarks (not a test): absorbed MLA decode over the paged latent (bandwidth of
 * the latent bytes), DSA indexer scoring and top-k, sparse MLA decode over 2048 positions.
 * Device events around each call, warm-up first, L2 flushed before each timed call, median of the
 * repeats. Floors: bytes / 4.3 TB/s
 * (copy bandwidth measured on these H200s); the indexer also against the int8 tensor-core rate.
 * BENCH_MLA_TIMING=dev: the flush by an asynchronous copy (flush_l2), so the events time the device alone.
 * Usage: bench_mla [decode|wgmma|fp8|fp8ab|fp8one|fp8trace|indexer|sparse|prefill|all] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cuda/cuda_glue.h"
#include "backend/cuda/cuda_ops.h"

/* Bench hook of cuda_mla_wgmma_st.cu (declared here, not in cuda_ops.h: every CUDA object depends on that header): with
 * LUNAR_MLA_WGMMA_TRACE=1 the FP8 S^T decode kernel runs its traced instance where it has one (the default's where
 * the split-K merge goes into the kernel, s17c's where its clusters fit), whose thread 0 of
 * each block (linear index < max_blocks) stamps 32 u64 into buf: (%globaltimer ns, clock64) pairs 0 at the block's
 * start, 1 after its set-up (the PDL wait, q quantised), 2 after tile 0's S, 3 after the tile loop, 4 after the sums'
 * exchange, 5 after the output stores, 6 after the mbarrier init's barrier, 7 after the first copies' issue, 8 after
 * its q rows; word 30 its tile count | SM id << 32. NULL: off. */
void lunar_cuda_mla_wgmma_trace(void *buf, int max_blocks);

#define BW 4.3e12
#define MMA 790e12 /* bf16 matrix flop per second (cuBLAS, measured on these H200s) */

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

enum { MAXB = 64, MAXL = 131072, BS = 128 };
static lunar_cuda_event e0, e1;

/* The latent pool: MAXB sequences of MAXL tokens, sequence b's block i = i * MAXB + b. */
static void *pool_bf16, *pool_fp8;
static int32_t *d_bt;
static const int max_blocks = MAXL / BS;

static void make_pool(void) {
    const size_t rows = (size_t)MAXB * MAXL;
    pool_bf16 = dalloc(rows * 576 * 2);
    pool_fp8 = dalloc(rows * 576);
    lunar_cuda_fill_u32(pool_bf16, 0x3c003c00u, rows * 576 / 2); /* bf16 1/128 */
    lunar_cuda_fill_u32(pool_fp8, 0x30303030u, rows * 576 / 4);  /* e4m3 0.125 */
    int32_t *bt = malloc((size_t)MAXB * max_blocks * 4);
    for (int b = 0; b < MAXB; b++)
        for (int i = 0; i < max_blocks; i++) bt[b * max_blocks + i] = i * MAXB + b;
    d_bt = dalloc((size_t)MAXB * max_blocks * 4);
    lunar_cuda_upload(d_bt, bt, (size_t)MAXB * max_blocks * 4);
    free(bt);
}

/* Session 12 (the lazy rescale's worst case, BENCH_MLA_GROW=1): the FP8 pool's first `seqs` sequences up to
 * position `len` rewritten so that every position of tile t (64 positions) holds the one e4m3 value 0x20 + (t & 63)
 * (0.125 .. 30, rising every tile and falling back every 64 tiles), with q positive (setup_case), so each head's
 * scores rise on every tile of a split of <= 64 tiles (on 63 of 64 past that): at LUNAR_MLA_WGMMA_LAZY=0 the lazy
 * kernels redo every tile (the exchange, the P rewrite, the second barrier, the rescale), which bounds its cost. */
static int grow_pool;
static void make_grow_pool(int seqs, int len) {
    const size_t blk = (size_t)BS * 576; /* one page of e4m3 rows */
    unsigned char *h = malloc(blk * seqs);
    for (int i = 0; i < (len + BS - 1) / BS; i++) {
        for (int r = 0; r < BS; r++) memset(h + (size_t)r * 576, 0x20 + (((i * BS + r) >> 6) & 63), 576);
        for (int b = 1; b < seqs; b++) memcpy(h + b * blk, h, blk);
        /* sequence b's block i is page i * MAXB + b: pages i * MAXB .. + seqs - 1 are contiguous */
        lunar_cuda_upload((unsigned char *)pool_fp8 + (size_t)i * MAXB * blk, h, blk * seqs);
    }
    free(h);
}

/* L2 (60 MB) is flushed before every timed call by writing this 256 MB buffer, so a small case
 * reads its latent from HBM as a decode step does (the other layers evict it in between). */
static void *flush_buf;
enum { FLUSH_WORDS = 64 << 20 };
/* Session 16: the fill synchronises (lunar_cuda_fill_u32), so the device idles while the host runs the call (its
 * getenv, plan and tensor-map encoding, the launch) and the events time that host work too; round 10's trace put
 * 12-15 us between the events outside the blocks' span at every shape. BENCH_MLA_TIMING=dev flushes by an
 * asynchronous device copy of one half of the buffer onto the other (~75 us of device work) instead, so the call is
 * enqueued before the device reaches it and the events time the device alone, as in the step's graph. */
static int timing_dev;
static double host_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}
static void flush_l2(uint32_t seed) {
    if (timing_dev) lunar_glue_copy((char *)flush_buf + (size_t)FLUSH_WORDS * 2, flush_buf, (size_t)FLUSH_WORDS * 2, NULL);
    else lunar_cuda_fill_u32(flush_buf, seed, FLUSH_WORDS);
}

typedef void (*call_fn)(void *);
/* Median over reps (<= 31) of one call between device events, after 3 untimed warm-up calls (first
 * launch, function attributes, clocks) and an L2 flush before each timed call. */
static float time_us(call_fn f, void *arg, int reps) {
    float ts[32];
    if (reps > 31) reps = 31;
    f(arg), f(arg), f(arg);
    for (int i = 0; i < reps; i++) {
        flush_l2((uint32_t)i);
        lunar_cuda_event_record(e0, NULL);
        f(arg);
        lunar_cuda_event_record(e1, NULL);
        ts[i] = lunar_cuda_event_ms(e0, e1) * 1000.0f;
    }
    return median(ts, reps);
}

typedef struct {
    float *o, *ql, *qp;
    lunar_cuda_mla_cache c;
    int32_t *lens, *idx;
    int B, H, L, topk;
    void *ws;
} mla_case;
static void call_decode(void *p) {
    mla_case *m = p;
    lunar_cuda_mla_absorbed(m->o, m->ql, m->qp, &m->c, NULL, m->lens, m->L, m->B, m->H, 0.07f, m->ws, NULL);
}
static void call_sparse(void *p) {
    mla_case *m = p;
    lunar_cuda_mla_sparse(m->o, m->ql, m->qp, &m->c, NULL, m->idx, m->topk, m->B, m->H, 0.07f, m->ws, NULL);
}

static void setup_case(mla_case *m, int B, int H, int L, int fp8) {
    memset(m, 0, sizeof *m);
    m->B = B, m->H = H, m->L = L;
    m->o = dalloc((size_t)B * H * 512 * 4);
    m->ql = dalloc((size_t)B * H * 512 * 4);
    m->qp = dalloc((size_t)B * H * 64 * 4);
    lunar_cuda_fill_uniform(m->ql, (size_t)B * H * 512, 1, grow_pool ? 0 : -1, 1); /* grow: q > 0, scores rise */
    lunar_cuda_fill_uniform(m->qp, (size_t)B * H * 64, 2, grow_pool ? 0 : -1, 1);
    m->c.latent = fp8 ? pool_fp8 : pool_bf16;
    m->c.dtype = fp8 ? LUNAR_CUDA_KV_FP8 : LUNAR_CUDA_KV_BF16;
    m->c.scale = 1.0f / 64;
    m->c.block_tables = d_bt;
    m->c.max_blocks = max_blocks;
    int32_t lens[MAXB];
    for (int b = 0; b < B; b++) lens[b] = L;
    m->lens = dalloc((size_t)B * 4);
    lunar_cuda_upload(m->lens, lens, (size_t)B * 4);
}

/* Absorbed decode, the new kernel (default), the old one (LUNAR_MLA_DECODE=old) and, for more than
 * 16 heads, the new kernel's cluster variant (LUNAR_MLA_DECODE=cluster) on the same data in the same
 * process. Floors: the latent bytes at 4.3 TB/s, and the matrix work (heads
 * padded to 16 per block, 2 x 576 + 2 x 512 flop per head and position) at 790 TFLOP/s (cuBLAS
 * bf16 on these H200s). */
static void bench_decode(void) {
    printf("\n### MLA absorbed decode (paged latent; old = LUNAR_MLA_DECODE=old, cluster = LUNAR_MLA_DECODE=cluster)\n\n");
    printf("| cache | H | B | context | latent bytes | floor (4.3 TB/s) | mma floor | old | of floor | new | of floor "
           "| new vs old | cluster | of floor |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    static const int Ls[] = {1024, 8192, 32768, 131072}, Bs[] = {1, 8, 64};
    for (int fp8 = 0; fp8 < 2; fp8++)
        for (int hi = 0; hi < 2; hi++) {
            const int H = hi ? 12 : 96;
            for (int li = 0; li < 4; li++)
                for (int bi = 0; bi < 3; bi++) {
                    const int B = Bs[bi], L = Ls[li];
                    size_t mark = lunar_cuda_mark();
                    mla_case m;
                    setup_case(&m, B, H, L, fp8);
                    size_t wsb = lunar_cuda_mla_ws(B, H, L);
                    m.ws = wsb ? dalloc(wsb) : NULL;
                    setenv("LUNAR_MLA_DECODE", "old", 1);
                    const float us_old = time_us(call_decode, &m, 9);
                    float us_cl = 0.0f;
                    if (H > 16 && !getenv("NO_CLUSTER")) {
                        setenv("LUNAR_MLA_DECODE", "cluster", 1);
                        us_cl = time_us(call_decode, &m, 9);
                    }
                    setenv("LUNAR_MLA_DECODE", "new", 1);
                    const float us = time_us(call_decode, &m, 9);
                    unsetenv("LUNAR_MLA_DECODE");
                    const double bytes = (double)B * L * 576 * (fp8 ? 1 : 2);
                    const double floor = bytes / BW * 1e6;
                    const double mma = (double)B * L * ((H + 15) / 16 * 16) * 2.0 * (576 + 512) / MMA * 1e6;
                    printf("| %s | %d | %d | %dK | %.1f MB | %.1f us | %.1f us | %.1f us | %.0f%% | %.1f us | %.0f%% | "
                           "%.2fx |",
                           fp8 ? "fp8" : "bf16", H, B, L / 1024, bytes / 1e6, floor, mma, us_old, 100.0 * floor / us_old,
                           us, 100.0 * floor / us, us_old / us);
                    if (us_cl > 0.0f) printf(" %.1f us | %.0f%% |\n", us_cl, 100.0 * floor / us_cl);
                    else printf(" - | - |\n");
                    fflush(stdout);
                    lunar_cuda_release(mark);
                }
        }
}

/* FP8 pages (session 6): the wgmma kernel's FP8-score path as the round-4 kernel (LUNAR_MLA_WGMMA_FP8=rs: two e4m3
 * terms of q, PV transposed with V^T from the e4m3 tile in registers, session 8; at every head count) beside its
 * session-5 path (=widen: e4m3 widened to bf16 before the bf16 MMA), the mma.sync kernel (LUNAR_MLA_DECODE=new) and
 * the default selection, same data, same process. Floors: the e4m3 latent bytes at 4.3 TB/s; the MMA work of the
 * widen / two-term path (heads padded to 64 per block, 2 x (576 + 512) flop per head and position at 790 TFLOP/s:
 * the two e4m3 S terms cost one bf16 S). (Sessions 6-10 also ran the two-term kernel with a widened V and round 6's
 * S^T kernel as it was here; session 19 removed both: `git show 1ff0730`.) */
static void bench_decode_fp8(void) {
    printf("\n### MLA decode, FP8 pages (new = LUNAR_MLA_DECODE=new; wgmma = LUNAR_MLA_DECODE=wgmma with "
           "LUNAR_MLA_WGMMA_FP8=widen / rs; default = no variable)\n\n");
    printf("| H | B | context | floor (4.3 TB/s) | mma floor | new | wgmma widen | of floor | wgmma rs | of floor | default | "
           "of floor | rs vs widen | default vs widen | default vs new |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    static const int Hs[] = {12, 32, 64, 96};
    static const int BL[][2] = {{1, 32768}, {8, 8192}, {8, 32768}, {8, 131072}, {64, 8192}, {64, 32768}};
    for (int hi = 0; hi < 4; hi++)
        for (int ci = 0; ci < 6; ci++) {
            const int H = Hs[hi], B = BL[ci][0], L = BL[ci][1];
            size_t mark = lunar_cuda_mark();
            mla_case m;
            setup_case(&m, B, H, L, 1);
            size_t wsb = lunar_cuda_mla_ws(B, H, L);
            m.ws = wsb ? dalloc(wsb) : NULL;
            setenv("LUNAR_MLA_DECODE", "new", 1);
            const float us_new = time_us(call_decode, &m, 9);
            setenv("LUNAR_MLA_DECODE", "wgmma", 1);
            setenv("LUNAR_MLA_WGMMA_FP8", "widen", 1);
            const float us_w = time_us(call_decode, &m, 9);
            setenv("LUNAR_MLA_WGMMA_FP8", "rs", 1);
            const float us_1 = time_us(call_decode, &m, 9);
            unsetenv("LUNAR_MLA_WGMMA_FP8");
            unsetenv("LUNAR_MLA_DECODE");
            const float us_d = time_us(call_decode, &m, 9);
            const double floor = (double)B * L * 576 / BW * 1e6;
            const double mma = (double)B * L * ((H + 63) / 64 * 64) * 2.0 * (576 + 512) / MMA * 1e6;
            printf("| %d | %d | %dK | %.1f us | %.1f us | %.1f us | %.1f us | %.0f%% | %.1f us | %.0f%% | %.1f us | %.0f%% | "
                   "%.2fx | %.2fx | %.2fx |\n",
                   H, B, L / 1024, floor, mma, us_new, us_w, 100.0 * floor / us_w, us_1, 100.0 * floor / us_1, us_d,
                   100.0 * floor / us_d, us_w / us_1, us_w / us_d, us_new / us_d);
            fflush(stdout);
            lunar_cuda_release(mark);
        }
}

/* FP8 pages, A/B/C of wgmma FP8 kernels (LUNAR_MLA_DECODE=wgmma, LUNAR_MLA_WGMMA_FP8=<variant>), rotating
 * the order every round (round r starts with variant r mod NV), 4 rounds of a median of 9 each, same data,
 * same process; ratios against the first. Floor: the e4m3 latent bytes at 4.3 TB/s. The variants: the list in
 * BENCH_MLA_AB, else the default against the opt-in s17c (sessions 9-17 ran each round's variants: docs/benchmarks.md,
 * "MLA decode, FP8 pages, round N"; session 19 pruned those that lost). Session 12: a variant "name:N"
 * also sets LUNAR_MLA_WGMMA_LAZY=N (the lazy threshold); BENCH_MLA_CASES="H B L;H B L" replaces the 12 cases;
 * BENCH_MLA_GROW=1 times them on the rising pool (make_grow_pool). */
/* BENCH_MLA_CASES="H B L;H B L;...": up to 16 (heads, batch, context) cases within the pools (MAXB rows,
 * MAXL positions) into cases; returns their count, 0 (cases untouched) when unset or none is valid */
static int env_cases(int cases[16][3]) {
    int got[16][3], n = 0;
    for (const char *c = getenv("BENCH_MLA_CASES"); c && *c && n < 16;) {
        if (sscanf(c, "%d %d %d", &got[n][0], &got[n][1], &got[n][2]) == 3 && got[n][1] <= MAXB && got[n][2] <= MAXL)
            n++;
        c = strchr(c, ';');
        c = c ? c + 1 : NULL;
    }
    memcpy(cases, got, sizeof(int) * 3 * (size_t)n);
    return n;
}

static void bench_decode_fp8_ab(void) {
    enum { MAXV = 6, ROUNDS = 4 };
    /* the variants: BENCH_MLA_AB (space-separated, at most 6), else the default and s17c */
    static char list[256];
    const char *e = getenv("BENCH_MLA_AB");
    snprintf(list, sizeof list, "%s", e && *e ? e : "default s17c");
    const char *ab[MAXV];
    int NV = 0;
    for (char *tok = strtok(list, " "); tok && NV < MAXV; tok = strtok(NULL, " ")) ab[NV++] = tok;
    printf("\n### MLA decode, FP8 pages:");
    for (int v = 0; v < NV; v++) printf("%s %s", v ? " /" : "", ab[v]);
    printf(" (LUNAR_MLA_DECODE=wgmma, LUNAR_MLA_WGMMA_FP8=<variant>), %d rounds, order rotated%s\n\n| H | B | context | floor |",
           ROUNDS, timing_dev ? ", device time alone (BENCH_MLA_TIMING=dev)" : "");
    for (int v = 0; v < NV; v++) printf(" %s rounds (us) |", ab[v]);
    for (int v = 0; v < NV; v++) printf(" %s mean | of floor |", ab[v]);
    for (int v = 1; v < NV; v++) printf(" %s vs %s |", ab[v], ab[0]);
    printf("\n|---|---|---|---|");
    for (int v = 0; v < 4 * NV - 1; v++) printf("---|");
    printf("\n");
    static const int Hs[] = {12, 32};
    static const int BL[][2] = {{1, 32768}, {8, 8192}, {8, 32768}, {8, 131072}, {64, 8192}, {64, 32768}};
    int cases[16][3], NC = env_cases(cases);
    if (!NC)
        for (int hi = 0; hi < 2; hi++)
            for (int ci = 0; ci < 6; ci++) cases[NC][0] = Hs[hi], cases[NC][1] = BL[ci][0], cases[NC][2] = BL[ci][1], NC++;
    grow_pool = getenv("BENCH_MLA_GROW") && !strcmp(getenv("BENCH_MLA_GROW"), "1");
    if (grow_pool) {
        int most_b = 1, most_l = 1;
        for (int c = 0; c < NC; c++) {
            most_b = cases[c][1] > most_b ? cases[c][1] : most_b;
            most_l = cases[c][2] > most_l ? cases[c][2] : most_l;
        }
        make_grow_pool(most_b, most_l);
        printf("(rising pool: tile t's positions all e4m3 0x20 + (t & 63); q uniform in [0, 1))\n");
    }
    for (int ci = 0; ci < NC; ci++) {
        const int H = cases[ci][0], B = cases[ci][1], L = cases[ci][2];
        size_t mark = lunar_cuda_mark();
        mla_case m;
        setup_case(&m, B, H, L, 1);
        size_t wsb = lunar_cuda_mla_ws(B, H, L);
        m.ws = wsb ? dalloc(wsb) : NULL;
        setenv("LUNAR_MLA_DECODE", "wgmma", 1);
        float t[MAXV][ROUNDS];
        double mean[MAXV] = {0};
        for (int r = 0; r < ROUNDS; r++)
            for (int k = 0; k < NV; k++) {
                const int v = (r + k) % NV;
                char name[64];
                snprintf(name, sizeof name, "%s", ab[v]);
                char *lz = strchr(name, ':');
                if (lz) *lz++ = 0, setenv("LUNAR_MLA_WGMMA_LAZY", lz, 1);
                setenv("LUNAR_MLA_WGMMA_FP8", name, 1);
                t[v][r] = time_us(call_decode, &m, 9);
                unsetenv("LUNAR_MLA_WGMMA_LAZY");
                mean[v] += t[v][r] / ROUNDS;
            }
        unsetenv("LUNAR_MLA_WGMMA_FP8");
        unsetenv("LUNAR_MLA_DECODE");
        const double floor = (double)B * L * 576 / BW * 1e6;
        printf("| %d | %d | %dK | %.1f us |", H, B, L / 1024, floor);
        for (int v = 0; v < NV; v++)
            for (int r = 0; r < ROUNDS; r++) printf("%s%.1f%s", r ? ", " : " ", t[v][r], r == ROUNDS - 1 ? " |" : "");
        for (int v = 0; v < NV; v++) printf(" %.1f us | %.0f%% |", mean[v], 100.0 * floor / mean[v]);
        for (int v = 1; v < NV; v++) printf(" %.2fx |", mean[0] / mean[v]);
        printf("\n");
        fflush(stdout);
        lunar_cuda_release(mark);
    }
}

/* The wgmma decode kernel (LUNAR_MLA_DECODE=wgmma) beside the mma.sync one (=new, 16 heads per
 * block) and the wgmma kernel's session-4 unswizzled tiles (LUNAR_MLA_WGMMA_SW=0, "wgmma s4") at the
 * head counts of the family's TP slices (96, 64, 32), same data, same process. Floors:
 * the latent bytes at 4.3 TB/s, and the wgmma kernel's matrix work (heads padded to 64 per block:
 * 96 -> 128) at 790 TFLOP/s. */
static void bench_decode_wgmma(void) {
    printf("\n### MLA decode with wgmma (new = LUNAR_MLA_DECODE=new, wgmma = LUNAR_MLA_DECODE=wgmma, wgmma s4 = that "
           "with LUNAR_MLA_WGMMA_SW=0)\n\n");
    printf("| cache | H | B | context | latent bytes | floor (4.3 TB/s) | wgmma mma floor | new | of floor | wgmma s4 | "
           "of floor | wgmma | of floor | wgmma vs new | wgmma vs s4 |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
           "---|---|\n");
    static const int Ls[] = {1024, 8192, 32768, 131072}, Bs[] = {1, 8, 64}, Hs[] = {96, 64, 32};
    for (int fp8 = 0; fp8 < 2; fp8++)
        for (int hi = 0; hi < 3; hi++) {
            const int H = Hs[hi];
            for (int li = 0; li < 4; li++)
                for (int bi = 0; bi < 3; bi++) {
                    const int B = Bs[bi], L = Ls[li];
                    size_t mark = lunar_cuda_mark();
                    mla_case m;
                    setup_case(&m, B, H, L, fp8);
                    size_t wsb = lunar_cuda_mla_ws(B, H, L);
                    m.ws = wsb ? dalloc(wsb) : NULL;
                    setenv("LUNAR_MLA_DECODE", "new", 1);
                    const float us_new = time_us(call_decode, &m, 9);
                    setenv("LUNAR_MLA_DECODE", "wgmma", 1);
                    setenv("LUNAR_MLA_WGMMA_SW", "0", 1);
                    const float us_s4 = time_us(call_decode, &m, 9);
                    unsetenv("LUNAR_MLA_WGMMA_SW");
                    const float us = time_us(call_decode, &m, 9);
                    unsetenv("LUNAR_MLA_DECODE");
                    const double bytes = (double)B * L * 576 * (fp8 ? 1 : 2);
                    const double floor = bytes / BW * 1e6;
                    const double mma = (double)B * L * ((H + 63) / 64 * 64) * 2.0 * (576 + 512) / MMA * 1e6;
                    printf("| %s | %d | %d | %dK | %.1f MB | %.1f us | %.1f us | %.1f us | %.0f%% | %.1f us | %.0f%% | "
                           "%.1f us | %.0f%% | %.2fx | %.2fx |\n",
                           fp8 ? "fp8" : "bf16", H, B, L / 1024, bytes / 1e6, floor, mma, us_new, 100.0 * floor / us_new,
                           us_s4, 100.0 * floor / us_s4, us, 100.0 * floor / us, us_new / us, us_s4 / us);
                    fflush(stdout);
                    lunar_cuda_release(mark);
                }
        }
}

/* BENCH_MLA_SPARSE_SPLITS="default 64 32": one column per LUNAR_MLA_SPARSE_SPLIT value (positions per
 * split; "default" = unset), alternating per case, so the columns are an A/B on the same pool. */
static void bench_sparse(void) {
    const char *e = getenv("BENCH_MLA_SPARSE_SPLITS");
    char list[256];
    snprintf(list, sizeof list, "%s", e && *e ? e : "default");
    const char *names[8];
    int nv = 0;
    for (char *t = strtok(list, " ,"); t && nv < 8; t = strtok(NULL, " ,")) names[nv++] = t;
    char *saved = getenv("LUNAR_MLA_SPARSE_SPLIT") ? strdup(getenv("LUNAR_MLA_SPARSE_SPLIT")) : NULL;
    printf("\n### Sparse MLA decode (DSA, 2048 selected positions per row; LUNAR_MLA_SPARSE_SPLIT columns)\n\n");
    printf("| H | B | context | kv |");
    for (int v = 0; v < nv; v++) printf(" split %s |", names[v]);
    printf(" latent bytes read | floor |\n|---|---|---|---|");
    for (int v = 0; v < nv; v++) printf("---|");
    printf("---|---|\n");
    static const int Ls[] = {8192, 32768, 131072}, Bs[] = {1, 8, 64}, Hs[] = {12, 96};
    const int topk = 2048;
    int32_t *idx = malloc((size_t)MAXB * topk * 4);
    for (int hi = 0; hi < 2; hi++)
        for (int fp8 = 0; fp8 < 2; fp8++)
            for (int li = 0; li < 3; li++)
                for (int bi = 0; bi < 3; bi++) {
                    const int B = Bs[bi], L = Ls[li], H = Hs[hi];
                    if (fp8 && H != 12) continue; /* the K3.1 rank only */
                    size_t mark = lunar_cuda_mark();
                    mla_case m;
                    setup_case(&m, B, H, L, fp8);
                    m.topk = topk;
                    /* spread over the context, ascending (the indexer's order) */
                    unsigned x = 7;
                    for (int b = 0; b < B; b++)
                        for (int i = 0; i < topk; i++) {
                            x = x * 1664525u + 1013904223u;
                            idx[b * topk + i] = (int)((long long)i * L / topk + (x >> 8) % (unsigned)(L / topk));
                        }
                    m.idx = dalloc((size_t)B * topk * 4);
                    lunar_cuda_upload(m.idx, idx, (size_t)B * topk * 4);
                    /* the workspace for the most splits of any column */
                    size_t wsb = 0;
                    for (int v = 0; v < nv; v++) {
                        setenv("LUNAR_MLA_SPARSE_SPLIT", strcmp(names[v], "default") ? names[v] : "0", 1);
                        const size_t w = lunar_cuda_mla_ws(B, H, topk);
                        wsb = w > wsb ? w : wsb;
                    }
                    m.ws = wsb ? dalloc(wsb) : NULL;
                    printf("| %d | %d | %dK | %s |", H, B, L / 1024, fp8 ? "fp8" : "bf16");
                    for (int v = 0; v < nv; v++) {
                        setenv("LUNAR_MLA_SPARSE_SPLIT", strcmp(names[v], "default") ? names[v] : "0", 1);
                        call_sparse(&m);
                        printf(" %.1f us |", time_us(call_sparse, &m, 9));
                    }
                    const double bytes = (double)B * topk * (fp8 ? 576 : 1152);
                    printf(" %.1f MB | %.1f us |\n", bytes / 1e6, bytes / BW * 1e6);
                    fflush(stdout);
                    lunar_cuda_release(mark);
                }
    free(idx);
    if (saved) setenv("LUNAR_MLA_SPARSE_SPLIT", saved, 1), free(saved);
    else unsetenv("LUNAR_MLA_SPARSE_SPLIT");
}

typedef struct {
    float *scores, *iq, *w;
    uint8_t *codes;
    float *scales;
    int32_t *lens, *idx, *seq;
    int rows, nh, L, topk;
} idx_case;
static void call_score(void *p) {
    idx_case *c = p;
    lunar_cuda_dsa_index_score(c->scores, c->L, c->iq, c->w, c->codes, c->scales, d_bt, max_blocks, c->seq, c->lens,
                               c->L, c->rows, c->nh, 128, NULL);
}
static void call_topk(void *p) {
    idx_case *c = p;
    lunar_cuda_dsa_topk(c->idx, NULL, c->scores, c->L, c->lens, c->rows, c->topk, NULL);
}

/* Scores: the fp64 kernel against the two int8 tensor-core kernels, round 1 (sync: each tile's codes
 * after the previous tile's math) and round 2 (pipe: cp.async ahead, fewer tiles per block at small
 * sizes); same inputs, their scores compared bitwise here too; then top-2048 on them. Floors: key bytes at 4.3 TB/s; the int8 kernel's nine
 * limb GEMMs at the H200's dense int8 rate (1979 TOPS = 989.5e12 MAC/s; mma.sync reaches less). */
#define INT8_MAC 989.5e12
static void bench_indexer(void) {
    printf("\n### DSA indexer (FP8 keys, 132 B/token, d = 128; exact scores: fp64 vs int8 tensor cores)\n\n");
    printf("| nh | rows | keys per row | fp64 | int8 sync | int8 pipe | pipe vs sync | key bytes floor | pipe of floor |"
           " 9-limb int8 floor | equal | top-2048 |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    const size_t slots = (size_t)MAXB * MAXL;
    size_t mark0 = lunar_cuda_mark();
    uint8_t *codes = dalloc(slots * 128);
    float *scales = dalloc(slots * 4);
    lunar_cuda_fill_uniform((float *)codes, slots * 32, 3, 0.01f, 0.02f); /* random-ish e4m3 bytes */
    lunar_cuda_fill_uniform(scales, slots, 4, 1.0f, 1.0f);
    typedef struct {
        int nh, rows, L, one_seq;
    } shape;
    static const shape shapes[] = {{32, 1, 4096, 0},   {32, 8, 4096, 0},   {32, 1, 32768, 0},  {32, 8, 32768, 0},
                                   {32, 1, 131072, 0}, {32, 8, 131072, 0}, {64, 1, 131072, 0}, {64, 8, 131072, 0},
                                   {32, 8192, 8192, 1}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const shape sh = shapes[si];
        const int rows = sh.rows, nh = sh.nh, L = sh.L;
        size_t mark = lunar_cuda_mark();
        idx_case c = {0};
        c.rows = rows, c.nh = nh, c.L = L, c.topk = 2048, c.codes = codes, c.scales = scales;
        c.scores = dalloc((size_t)rows * L * 4);
        c.iq = dalloc((size_t)rows * nh * 128 * 4);
        c.w = dalloc((size_t)rows * nh * 4);
        c.idx = dalloc((size_t)rows * 2048 * 4);
        lunar_cuda_fill_uniform(c.iq, (size_t)rows * nh * 128, 5, -1, 1);
        lunar_cuda_fill_uniform(c.w, (size_t)rows * nh, 6, -0.02f, 0.02f);
        int32_t *hl = malloc((size_t)rows * 4), *hs = malloc((size_t)rows * 4);
        for (int r = 0; r < rows; r++) hl[r] = L, hs[r] = sh.one_seq ? 0 : r;
        c.lens = dalloc((size_t)rows * 4);
        c.seq = dalloc((size_t)rows * 4);
        lunar_cuda_upload(c.lens, hl, (size_t)rows * 4);
        lunar_cuda_upload(c.seq, hs, (size_t)rows * 4);
        const size_t nsc = (size_t)rows * L;
        float *s64 = malloc(nsc * 4), *s8 = malloc(nsc * 4), *sp = malloc(nsc * 4);
        int prev = lunar_cuda_dsa_score_mode(LUNAR_DSA_SCORE_FP64);
        float us64 = time_us(call_score, &c, sh.one_seq ? 5 : 9);
        lunar_cuda_download(s64, c.scores, nsc * 4);
        lunar_cuda_dsa_score_mode(LUNAR_DSA_SCORE_INT8_SYNC);
        lunar_cuda_fill_u32(c.scores, 0x7fc00000u, nsc); /* NaN: every score must be rewritten */
        float us8 = time_us(call_score, &c, 9);
        lunar_cuda_download(s8, c.scores, nsc * 4);
        lunar_cuda_dsa_score_mode(LUNAR_DSA_SCORE_INT8_PIPE);
        lunar_cuda_fill_u32(c.scores, 0x7fc00000u, nsc);
        float usp = time_us(call_score, &c, 9);
        lunar_cuda_download(sp, c.scores, nsc * 4);
        lunar_cuda_dsa_score_mode(prev);
        const int equal = memcmp(s64, s8, nsc * 4) == 0 && memcmp(s64, sp, nsc * 4) == 0;
        /* keys read once per row (the kernels re-read them per row from L2 for many rows) */
        double bytes = (double)rows * L * 132, floor = bytes / BW * 1e6;
        if (sh.one_seq) bytes = (double)L * 132, floor = bytes / BW * 1e6;
        const double tfl = 9.0 * rows * L * nh * 128 / INT8_MAC * 1e6;
        float ut = sh.one_seq ? 0.0f : time_us(call_topk, &c, 9);
        printf("| %d | %d | %dK | %.1f us | %.1f us | %.1f us | %.2fx | %.1f us | %.0f%% | %.1f us | %s |", nh, rows,
               L / 1024, us64, us8, usp, us8 / usp, floor, 100.0 * floor / usp, tfl, equal ? "yes" : "NO");
        if (ut > 0.0f) printf(" %.1f us |\n", ut);
        else printf(" - |\n");
        fflush(stdout);
        free(hl), free(hs), free(s64), free(s8), free(sp);
        lunar_cuda_release(mark);
    }
    /* top-k at 1M */
    {
        size_t mark = lunar_cuda_mark();
        idx_case c = {0};
        const int L = 1 << 20;
        c.rows = 1, c.L = L, c.topk = 2048;
        c.scores = dalloc((size_t)L * 4);
        c.idx = dalloc(2048 * 4);
        lunar_cuda_fill_uniform(c.scores, (size_t)L, 9, -1, 1);
        c.lens = dalloc(4);
        lunar_cuda_upload(c.lens, &L, 4);
        float ut = time_us(call_topk, &c, 9);
        printf("\ntop-2048 of 1 row at 1024K: %.1f us (scores 4.2 MB, floor %.1f us, %.0f%%)\n", ut, L * 4 / BW * 1e6,
               100.0 * (L * 4 / BW * 1e6) / ut);
        lunar_cuda_release(mark);
    }
    lunar_cuda_release(mark0);
}

/* MLA prefill of one sequence, the whole attention op from q [n, H, 192] to o [n, H, 128]:
 * old = the absorbed form (absorption GEMM + cuda_mla_prefill.cu's GEMMs + un-absorption GEMM),
 * new = the decompressed flash form (cuda_mla_flash.cu: gather, lift GEMM, flash kernel: the
 * mma.sync one or the wgmma one, cuda_mla_flash_wg.cu). The lift GEMM alone is timed too (same
 * shape), so the flash kernel's rate is (new - lift). Flop counts: causal attention 2 * (192 + 128)
 * per (query, head, visible key), held against a cuBLAS bf16 8192^3 GEMM timed in the same run. */
typedef struct {
    float *q, *o, *qlat, *qpe, *olat, *w32;
    uint16_t *W, *KV, *C;
    void *ws_old, *ws_new;
    int n, pos0, H;
} pre_case;
static void call_pre_old(void *p) {
    pre_case *c = p;
    lunar_cuda_mla_absorb_gemm(c->qlat, c->qpe, c->w32, c->q, c->W, c->n, c->H, 128, 64, 128, 512, NULL);
    lunar_glue_mla_prefill(c->olat, c->qlat, c->qpe, pool_bf16, 0, d_bt, BS, c->pos0, c->n, c->H, 0.072f, c->ws_old,
                           NULL);
    lunar_cuda_mla_unabsorb_gemm(c->o, c->olat, c->w32, c->n, c->H, 128, 128, 512, NULL);
}
static void call_pre_new(void *p) {
    pre_case *c = p;
    lunar_glue_mla_flash(c->o, c->q, c->W, pool_bf16, 0, d_bt, BS, c->pos0, c->n, c->H, 0.072f, 0, c->ws_new, NULL);
}
static void call_pre_lift(void *p) {
    pre_case *c = p;
    lunar_cuda_matmul(c->KV, LUNAR_CUDA_BF16, c->C, c->W, c->pos0 + c->n, c->H * 256, 512, NULL);
}
static void call_peak(void *p) { /* a square bf16 GEMM: the rate the kernels are held against */
    pre_case *c = p;
    lunar_cuda_matmul(c->KV, LUNAR_CUDA_BF16, c->C, c->W, 8192, 8192, 8192, NULL);
}
static void bench_prefill(void) {
    /* the peak measured here: cuBLAS bf16 8192^3 */
    size_t mark0 = lunar_cuda_mark();
    pre_case pk = {0};
    pk.KV = dalloc((size_t)8192 * 8192 * 2), pk.C = dalloc((size_t)8192 * 8192 * 2), pk.W = dalloc((size_t)8192 * 8192 * 2);
    lunar_cuda_fill_u32(pk.C, 0x3c003c00u, (size_t)8192 * 8192 / 2), lunar_cuda_fill_u32(pk.W, 0x3c003c00u, (size_t)8192 * 8192 / 2);
    const double peak = 2.0 * 8192.0 * 8192.0 * 8192.0 / (time_us(call_peak, &pk, 9) * 1e-6);
    lunar_cuda_release(mark0);
    printf("\n### MLA prefill, one sequence: absorbed GEMMs (old) vs decompressed flash, mma.sync kernel "
           "(LUNAR_MLA_FLASH=mma, 4 warps x 2 stages) vs wgmma kernel (LUNAR_MLA_FLASH=wgmma) and its producer / consumer "
           "variant (=wgmma_pp)\n\n"
           "cuBLAS bf16 8192^3 measured now: %.0f TFLOP/s (the rate below is attention flops / (flash time - lift "
           "time) against it)\n\n",
           peak / 1e12);
    printf("| H | n | pos0 | attn TFLOP | old | lift GEMM | mma | wgmma | wgmma_pp | wgmma vs mma | mma kernel TFLOP/s | "
           "wgmma kernel TFLOP/s | wgmma of peak | wgmma_pp kernel TFLOP/s | wgmma_pp of peak |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    static const int cases[][3] = {{32, 8192, 0},  {12, 8192, 0},  {32, 4096, 4096}, {32, 1024, 0},
                                   {32, 16384, 0}, {12, 32768, 0}, {32, 32768, 0}};
    for (unsigned ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        size_t mark = lunar_cuda_mark();
        pre_case c = {0};
        c.H = cases[ci][0], c.n = cases[ci][1], c.pos0 = cases[ci][2];
        const int n = c.n, H = c.H, L = c.pos0 + n;
        c.q = dalloc((size_t)n * H * 192 * 4), c.o = dalloc((size_t)n * H * 128 * 4);
        c.qlat = dalloc((size_t)n * H * 512 * 4), c.qpe = dalloc((size_t)n * H * 64 * 4);
        c.olat = dalloc((size_t)n * H * 512 * 4), c.w32 = dalloc((size_t)H * 256 * 512 * 4);
        c.W = dalloc((size_t)H * 256 * 512 * 2);
        c.KV = dalloc((size_t)L * H * 256 * 2), c.C = dalloc((size_t)L * 512 * 2);
        lunar_cuda_fill_uniform(c.q, (size_t)n * H * 192, 11, -1, 1);
        lunar_cuda_fill_u32(c.W, 0x3c003c00u, (size_t)H * 256 * 512 / 2);
        lunar_cuda_fill_u32(c.C, 0x3c003c00u, (size_t)L * 512 / 2);
        c.ws_old = dalloc(lunar_glue_mla_prefill_ws(n, H, L));
        c.ws_new = dalloc(lunar_glue_mla_flash_ws(n, H, L, 0));
        const float t_old = time_us(call_pre_old, &c, 5), t_lift = time_us(call_pre_lift, &c, 9);
        setenv("LUNAR_MLA_FLASH", "mma", 1);
        const float t_mma = time_us(call_pre_new, &c, 9);
        setenv("LUNAR_MLA_FLASH", "wgmma", 1);
        const float t_wg = time_us(call_pre_new, &c, 9);
        setenv("LUNAR_MLA_FLASH", "wgmma_pp", 1);
        const float t_pp = time_us(call_pre_new, &c, 9);
        unsetenv("LUNAR_MLA_FLASH");
        const double attn = 2.0 * (192 + 128) * H * ((double)n * c.pos0 + (double)n * (n + 1) / 2);
        const double r_mma = attn / (t_mma - t_lift) / 1e6, r_wg = attn / (t_wg - t_lift) / 1e6;
        const double r_pp = attn / (t_pp - t_lift) / 1e6;
        printf("| %d | %d | %d | %.2f | %.0f us | %.0f us | %.0f us | %.0f us | %.0f us | %.2fx | %.0f | %.0f | %.0f%% | "
               "%.0f | %.0f%% |\n",
               H, n, c.pos0, attn / 1e12, t_old, t_lift, t_mma, t_wg, t_pp, t_mma / t_wg, r_mma, r_wg,
               100.0 * r_wg * 1e12 / peak, r_pp, 100.0 * r_pp * 1e12 / peak);
        fflush(stdout);
        lunar_cuda_release(mark);
    }
}

/* Session 12: where the fixed cost of a launch goes. The FP8 S^T kernel's traced instance (LUNAR_MLA_WGMMA_TRACE=1,
 * lunar_cuda_mla_wgmma_trace) stamps each block's phases; per call (events around it as time_us) the table gives, in
 * us: the call (events: launch, decode kernel, merge), the decode kernel's span (first block start to the last
 * block's stores issued), the spread of the blocks' starts, and each block's phases (medians over blocks, clock64
 * converted by the block's own globaltimer / clock ratio), as thread 0 (warp 0) sees them: set-up = init (the PDL
 * wait, lens, the barrier after the mbarrier init) + copies (warp 0 issues the first 3 tiles' copies: the block
 * table) + q (its 4 rows loaded and quantised) + barrier (the other warps' q); tile 0 (its copy's wait and S), the
 * tile loop (and per tile), the sums' exchange, the stores. Medians over 7 calls. L2 before each call
 * (BENCH_MLA_L2MODES, default "flush data warm"): flush = flushed as time_us (everything cold: code, q, lens, the
 * block table, the latent); data = flushed, then q, lens and the block table copied (so in L2) but the kernel's code
 * and the latent cold; warm = no flush (the previous call's code, data and, where it fits, latent in L2).
 * Session 13: the instances merging in the kernel stamp after the stores too: the merge column is their tail after
 * the stores. Variants: BENCH_MLA_AB (default "default s17c": the traced instances are the default's where the merge
 * goes into the kernel and s17c's where its clusters fit; a call without one stamps nothing, its row zeros); cases as
 * fp8ab's BENCH_MLA_CASES (default H = 32: B = 8 at 8K / 32K, B = 64 at 8K / 32K). */
static void bench_decode_fp8_trace(void) {
    enum { NB = 4096, REPS = 7, NS = 15, W = 32 };
    unsigned long long *dtr = dalloc((size_t)NB * W * 8), *htr = malloc((size_t)NB * W * 8);
    static char list[256], modes[64];
    const char *e = getenv("BENCH_MLA_AB");
    snprintf(list, sizeof list, "%s", e && *e ? e : "default s17c");
    const char *ab[6];
    int NV = 0;
    for (char *tok = strtok(list, " "); tok && NV < 6; tok = strtok(NULL, " ")) ab[NV++] = tok;
    e = getenv("BENCH_MLA_L2MODES");
    snprintf(modes, sizeof modes, "%s", e && *e ? e : "flush data warm");
    int md_list[3], NM = 0;
    for (char *tok = strtok(modes, " "); tok && NM < 3; tok = strtok(NULL, " "))
        md_list[NM++] = !strcmp(tok, "warm") ? 2 : !strcmp(tok, "data") ? 1 : 0;
    static const char *mname[] = {"flush", "data", "warm"};
    int cases[16][3] = {{32, 8, 8192}, {32, 8, 32768}, {32, 64, 8192}, {32, 64, 32768}}, NC = env_cases(cases);
    if (!NC) NC = 4;
    printf("\n### MLA decode, FP8 pages: where a launch's time goes (traced instance; us, medians over blocks, then over %d "
           "calls)\n\n| L2 | variant | H | B | context | blocks | tiles a block | call (events) | decode span | starts spread | "
           "set-up | init | copies | q | barrier | tile 0 | tile loop | per tile | sums | stores | merge | call - span | host |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n", REPS);
    if (timing_dev) printf("(BENCH_MLA_TIMING=dev: the flush by an asynchronous copy, the events time the device alone)\n\n");
    lunar_cuda_mla_wgmma_trace(dtr, NB);
    setenv("LUNAR_MLA_WGMMA_TRACE", "1", 1);
    setenv("LUNAR_MLA_DECODE", "wgmma", 1);
    void *scratch = dalloc((size_t)MAXB * 32 * 576 * 4 + (size_t)MAXB * max_blocks * 4 + 4096);
    for (int ci = 0; ci < NC; ci++)
        for (int mi = 0; mi < NM; mi++)
            for (int v = 0; v < NV; v++) {
                const int H = cases[ci][0], B = cases[ci][1], L = cases[ci][2], mode = md_list[mi];
                size_t mark = lunar_cuda_mark();
                mla_case m;
                setup_case(&m, B, H, L, 1);
                size_t wsb = lunar_cuda_mla_ws(B, H, L);
                m.ws = wsb ? dalloc(wsb) : NULL;
                setenv("LUNAR_MLA_WGMMA_FP8", ab[v], 1);
                call_decode(&m), call_decode(&m), call_decode(&m);
                float st[NS][REPS];
                int nblk = 0, tiles = 0;
                for (int r = 0; r < REPS; r++) {
                    lunar_cuda_fill_u32(dtr, 0, (size_t)NB * W * 2);
                    if (mode < 2) flush_l2((uint32_t)r);
                    if (mode == 1) { /* q, lens, the block table's rows back into L2 (copies read them through it) */
                        unsigned char *sp = scratch;
                        lunar_cuda_copy_2d(sp, (size_t)B * H * 512 * 4, m.ql, (size_t)B * H * 512 * 4, (size_t)B * H * 512 * 4, 1);
                        sp += (size_t)B * H * 512 * 4;
                        lunar_cuda_copy_2d(sp, (size_t)B * H * 64 * 4, m.qp, (size_t)B * H * 64 * 4, (size_t)B * H * 64 * 4, 1);
                        sp += (size_t)B * H * 64 * 4;
                        lunar_cuda_copy_2d(sp, (size_t)B * 4, m.lens, (size_t)B * 4, (size_t)B * 4, 1);
                        sp += 256;
                        lunar_cuda_copy_2d(sp, (size_t)B * max_blocks * 4, d_bt, (size_t)B * max_blocks * 4, (size_t)B * max_blocks * 4, 1);
                    }
                    lunar_cuda_event_record(e0, NULL);
                    const double h0 = host_us();
                    call_decode(&m);
                    st[14][r] = (float)(host_us() - h0); /* the host's side of the call (getenv, encode, launch) */
                    lunar_cuda_event_record(e1, NULL);
                    st[0][r] = lunar_cuda_event_ms(e0, e1) * 1000.0f;
                    lunar_cuda_download(htr, dtr, (size_t)NB * W * 8);
                    /* the blocks that stamped (a block of no tiles stamps too); pairs: 0 start, 6 init done, 7
                     * copies issued, 8 q done, 1 set-up done, 2 tile 0, 3 loop, 4 sums, 5 stores */
                    static const int seq[] = {0, 6, 7, 8, 1, 2, 3, 4, 5};
                    unsigned long long g0 = ~0ull, g5 = 0, s0 = 0;
                    static float ph[10][NB];
                    int n = 0;
                    for (int b = 0; b < NB; b++) {
                        const unsigned long long *t = htr + (size_t)b * W;
                        if (!t[0] || !t[10]) continue;
                        const double rate = (double)(t[10] - t[0]) / (double)(t[11] - t[1]); /* ns per clock */
                        g0 = t[0] < g0 ? t[0] : g0;
                        g5 = t[10] > g5 ? t[10] : g5;
                        s0 = t[0] > s0 ? t[0] : s0; /* the last block's start */
                        ph[0][n] = (float)((double)(t[3] - t[1]) * rate / 1000.0); /* set-up */
                        for (int k = 0; k < 8; k++)
                            ph[1 + k][n] = (float)((double)(t[2 * seq[k + 1] + 1] - t[2 * seq[k] + 1]) * rate / 1000.0);
                        /* round 9's merge in the kernel: pair 9 after the stores, pair 5 after the merge */
                        ph[9][n] = 0.0f;
                        if (t[19]) {
                            ph[8][n] = (float)((double)(t[19] - t[9]) * rate / 1000.0);
                            ph[9][n] = (float)((double)(t[11] - t[19]) * rate / 1000.0);
                        }
                        tiles = (int)(t[30] & 0xffffffffu);
                        n++;
                    }
                    nblk = n;
                    if (!n) {
                        for (int k = 1; k < 14; k++) st[k][r] = 0; /* (14, the host's time, was measured) */
                        continue;
                    }
                    st[1][r] = (float)(g5 - g0) / 1000.0f;
                    st[2][r] = (float)(s0 - g0) / 1000.0f;
                    for (int k = 0; k < 9; k++) st[3 + k][r] = median(ph[k], n);
                    st[12][r] = st[0][r] - st[1][r];
                    st[13][r] = median(ph[9], n);
                }
                float md[NS];
                for (int k = 0; k < NS; k++) md[k] = median(st[k], REPS);
                /* md: 3 set-up, 4 init, 5 copies, 6 q, 7 barrier, 8 tile 0, 9 loop, 10 sums, 11 stores, 13 merge, 14 host */
                printf("| %s | %s | %d | %d | %dK | %d | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | "
                       "%.1f | %.2f | %.1f | %.1f | %.1f | %.1f | %.1f |\n",
                       mname[mode], ab[v], H, B, L / 1024, nblk, tiles, md[0], md[1], md[2], md[3], md[4], md[5], md[6],
                       md[7], md[8], md[9], tiles ? md[9] / tiles : 0.0f, md[10], md[11], md[13], md[12], md[14]);
                fflush(stdout);
                lunar_cuda_release(mark);
            }
    unsetenv("LUNAR_MLA_WGMMA_TRACE");
    unsetenv("LUNAR_MLA_WGMMA_FP8");
    unsetenv("LUNAR_MLA_DECODE");
    lunar_cuda_mla_wgmma_trace(NULL, 0);
    free(htr);
}

/* One FP8 case (BENCH_MLA_CASE="H B L", default "32 64 32768") under the current LUNAR_MLA_* switches: two
 * untimed calls then the median of 9, for a profiler pointed at one launch (ncu --launch-skip 1 -c 1 -k ...) */
static void bench_decode_fp8_one(void) {
    int H = 32, B = 64, L = 32768;
    const char *e = getenv("BENCH_MLA_CASE");
    if (e && sscanf(e, "%d %d %d", &H, &B, &L) != 3) H = 32, B = 64, L = 32768;
    size_t mark = lunar_cuda_mark();
    mla_case m;
    setup_case(&m, B, H, L, 1);
    size_t wsb = lunar_cuda_mla_ws(B, H, L);
    m.ws = wsb ? dalloc(wsb) : NULL;
    call_decode(&m), call_decode(&m);
    const char *v = getenv("LUNAR_MLA_WGMMA_FP8");
    printf("fp8one H=%d B=%d L=%d %s: %.1f us (floor %.1f us)\n", H, B, L, v ? v : "default", time_us(call_decode, &m, 9),
           (double)B * L * 576 / BW * 1e6);
    lunar_cuda_release(mark);
}

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "all";
    lunar_err err;
    if (lunar_cuda_init(0, 0, &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    printf("%s\n", lunar_cuda_describe());
    e0 = lunar_cuda_event_create(), e1 = lunar_cuda_event_create();
    make_pool();
    flush_buf = dalloc((size_t)FLUSH_WORDS * 4);
    timing_dev = getenv("BENCH_MLA_TIMING") && !strcmp(getenv("BENCH_MLA_TIMING"), "dev");
    if (!strcmp(what, "all") || !strcmp(what, "decode")) bench_decode();
    if (!strcmp(what, "all") || !strcmp(what, "wgmma")) bench_decode_wgmma();
    if (!strcmp(what, "all") || !strcmp(what, "fp8")) bench_decode_fp8();
    if (!strcmp(what, "all") || !strcmp(what, "fp8ab")) bench_decode_fp8_ab();
    if (!strcmp(what, "fp8one")) bench_decode_fp8_one();
    if (!strcmp(what, "fp8trace")) bench_decode_fp8_trace();
    if (!strcmp(what, "all") || !strcmp(what, "sparse")) bench_sparse();
    if (!strcmp(what, "all") || !strcmp(what, "indexer")) bench_indexer();
    if (!strcmp(what, "all") || !strcmp(what, "prefill")) bench_prefill();
    lunar_cuda_shutdown();
    return 0;
}
