/* Decode steps replayed from CUDA graphs (model/forward_cuda.c, "decode graphs") against the same
 * steps run eagerly, on the kernel-shaped random Kimi-Linear model (tests/cuda_wide.h: the fused
 * MoE and the 128-wide KDA decode, the paths a graph captures; the tiny goldens take the generic
 * MoE, whose routing goes through the host, so their decode steps always run eagerly).
 *
 * For each batch size B (1, 3, 6: exact sizes are captured, none is padded) the B sequences are
 * prefilled once (prompts of different lengths, so the rows' contexts differ), the caches are saved,
 * and 16 decode steps run twice from that state: graphs off, then graphs on. The contexts cross
 * 256, the first bucket boundary of decode_len_bucket, so the graphed run meets two context buckets
 * and both the logits and the sampled step (steps 8..15 sample half the rows on the device): three
 * keys, each eager once, then captured, then replayed. The same kernels run with the same
 * arguments in both runs, so the logits and sampled ids must be bit-identical; a replay with a
 * stale input (an id, a length, a block table, a KDA state index not refreshed) or a stale pointer
 * changes them. The capture and replay counts must show the graphs were used, and the generic-MoE
 * model must not capture at all (and still match). The same for the K3-shaped model (AttnRes, DSA,
 * latent MXFP4 MoE) at batch sizes 1 and 3. Skipped without a CUDA device. */
#include "test.h"
#include "cuda_test.h"

#ifndef LUNAR_HAVE_CUDA

TEST(cuda_forward_graphs_skipped) { fprintf(stderr, "[skipped: no CUDA device: lunar was built without CUDA] "); }

#else

#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_ops.h"
#include "cuda_wide.h"
#include "model/forward_cuda.h"

enum { STEPS = 16, SAMPLED_FROM = 8 };

typedef struct saved_caches {
    void *latent, *conv, *state, *codes, *scales; /* the last two: the DSA indexer's keys */
    size_t nl, nc, ns, ni;
} saved_caches;

static void caches_save(saved_caches *s, const lunar_cuda_caches *c) {
    const size_t toks = (size_t)c->n_mla * c->n_blocks * LUNAR_BLOCK_SIZE;
    s->nl = toks * c->row * 2;
    s->nc = (size_t)c->n_slots * c->n_kda * c->conv_len * 4;
    s->ns = (size_t)c->n_slots * c->n_kda * c->state_len * 4;
    s->ni = c->idx_dim ? toks : 0;
    s->latent = lunar_xmalloc(s->nl + 1), s->conv = lunar_xmalloc(s->nc + 1), s->state = lunar_xmalloc(s->ns + 1);
    s->codes = lunar_xmalloc(s->ni * c->idx_dim + 1), s->scales = lunar_xmalloc(s->ni * 4 + 1);
    lunar_cuda_download(s->latent, c->latent, s->nl);
    lunar_cuda_download(s->conv, c->conv, s->nc);
    lunar_cuda_download(s->state, c->state, s->ns);
    lunar_cuda_download(s->codes, c->idx_codes, s->ni * c->idx_dim);
    lunar_cuda_download(s->scales, c->idx_scales, s->ni * 4);
}
static void caches_restore(const saved_caches *s, lunar_cuda_caches *c) {
    lunar_cuda_upload(c->latent, s->latent, s->nl);
    lunar_cuda_upload(c->conv, s->conv, s->nc);
    lunar_cuda_upload(c->state, s->state, s->ns);
    lunar_cuda_upload(c->idx_codes, s->codes, s->ni * c->idx_dim);
    lunar_cuda_upload(c->idx_scales, s->scales, s->ni * 4);
}

/* B sequences of plen[b] prompt tokens prefilled one at a time into c (sequence b on slot b, its pages
 * blocks[b * per ..], reversed so the block table is not the identity), their caches saved into sv;
 * returns 0, or -1 after a failed check */
static int prefill_each(lunar_cuda_model *gm, const lunar_model *m, lunar_cuda_caches *c, int B, const int *plen,
                        int per, int32_t **blocks_out, saved_caches *sv) {
    lunar_err err;
    const int V = m->cfg.vocab_size;
    if (lunar_cuda_caches_init(c, m, per * B, B, 0, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return -1;
    }
    int32_t *blocks = lunar_xmalloc((size_t)per * B * sizeof *blocks);
    for (int i = 0; i < per * B; i++) blocks[i] = per * B - 1 - i; /* not the identity */
    float *pl = lunar_xmalloc((size_t)V * sizeof *pl);
    for (int b = 0; b < B; b++) {
        int32_t *p = lunar_xmalloc((size_t)plen[b] * sizeof *p);
        for (int i = 0; i < plen[b]; i++) p[i] = (int32_t)((i * 37 + b * 11 + 1) % V);
        lunar_batch_seq sq = {p, plen[b], 0, b, blocks + (size_t)b * per, LUNAR_LOGITS_LAST};
        CHECK(lunar_forward_batch_cuda(gm, c, &sq, 1, pl, &err) == 0);
        free(p);
    }
    free(pl);
    caches_save(sv, c);
    *blocks_out = blocks;
    return 0;
}
static void saved_free(saved_caches *sv) {
    free(sv->latent), free(sv->conv), free(sv->state), free(sv->codes), free(sv->scales);
}

/* STEPS decode steps of B sequences from the saved state: logits [STEPS][B][V] (sampled rows left
 * at 0), sampled ids [STEPS][B] */
static int decode_run(lunar_cuda_model *gm, lunar_cuda_caches *c, const saved_caches *sv, int B, const int *plen,
                      int per, int32_t *blocks, int V, float *logits, int32_t *sampled) {
    lunar_err err;
    caches_restore(sv, c);
    lunar_batch_seq *s = lunar_xcalloc((size_t)B, sizeof *s);
    lunar_device_sampling *ds = lunar_xcalloc((size_t)B, sizeof *ds);
    int32_t *ids = lunar_xmalloc((size_t)B * sizeof *ids);
    int rc = 0;
    for (int k = 0; k < STEPS && !rc; k++) {
        for (int b = 0; b < B; b++) {
            ids[b] = (int32_t)((b * 131 + k * 17 + 5) % V);
            s[b] = (lunar_batch_seq){&ids[b], 1, plen[b] + k, b, blocks + (size_t)b * per, LUNAR_LOGITS_LAST};
            /* from SAMPLED_FROM on, the even rows are sampled on the device with draws fixed per
             * (step, row) */
            ds[b] = (lunar_device_sampling){k >= SAMPLED_FROM && b % 2 == 0, 0.8f, 0.9f,
                                            (float)((k * 7 + b * 3) % 10) / 10.0f + 0.05f, 20};
        }
        float *lg = logits + (size_t)k * B * V;
        rc = lunar_forward_batch_cuda_sampled(gm, c, s, B, lg, ds, sampled + (size_t)k * B, &err);
        CHECK_MSG(rc == 0, "decode step %d: %s", k, err.msg);
    }
    free(s), free(ds), free(ids);
    return rc;
}

/* The fixture of the tests that run the same decode steps two ways: B sequences (at most 6) of p0 - dp b
 * prompt tokens prefilled, and the outputs of two runs from that state (logits[i] [STEPS][B][V], ids[i]
 * [STEPS][B]: decode_run's) */
typedef struct {
    lunar_cuda_caches c;
    saved_caches sv;
    int32_t *blocks;
    int B, V, per, plen[6];
    float *logits[2];
    int32_t *ids[2];
} decode_pair;
static int decode_pair_init(decode_pair *d, lunar_cuda_model *gm, const lunar_model *m, int B, int p0, int dp) {
    LUNAR_ASSERT(B >= 1 && B <= 6);
    d->B = B, d->V = m->cfg.vocab_size;
    for (int b = 0; b < B; b++) d->plen[b] = p0 - dp * b;
    d->per = (p0 + STEPS + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
    if (prefill_each(gm, m, &d->c, B, d->plen, d->per, &d->blocks, &d->sv)) return -1;
    for (int i = 0; i < 2; i++) {
        d->logits[i] = lunar_xcalloc((size_t)STEPS * B * d->V, sizeof(float));
        d->ids[i] = lunar_xcalloc((size_t)STEPS * B, sizeof(int32_t));
    }
    return 0;
}
static int decode_pair_run(decode_pair *d, lunar_cuda_model *gm, int i) {
    return decode_run(gm, &d->c, &d->sv, d->B, d->plen, d->per, d->blocks, d->V, d->logits[i], d->ids[i]);
}
static void decode_pair_free(decode_pair *d) {
    for (int i = 0; i < 2; i++) free(d->logits[i]), free(d->ids[i]);
    free(d->blocks);
    saved_free(&d->sv);
    lunar_cuda_caches_free(&d->c);
}

/* one model, batch sizes Bs[0..nB) (each <= 6): graphed == eager; returns the captures and replays
 * seen */
static void graphs_vs_eager_pdl(const char *name, const lunar_model *m, int fused, const int *Bs, int nB,
                                long *captures, long *replays, int pdl) {
    lunar_err err;
    lunar_cuda_model *gm = NULL;
    CHECK_MSG(lunar_test_cuda_upload(&gm, m, fused, &err) == 0, "%s", err.msg);
    if (!gm) return;
    const int V = m->cfg.vocab_size;
    for (int bi = 0; bi < nB; bi++) {
        const int B = Bs[bi];
        decode_pair d;
        if (decode_pair_init(&d, gm, m, B, 250, 40)) break; /* row 0 crosses 256 at step 6 */
        const float *le = d.logits[0], *lgr = d.logits[1];
        const int32_t *ie = d.ids[0], *igr = d.ids[1];
        long c0, r0, c1, r1;
        lunar_cuda_model_graphs(gm, 0);
        if (pdl) lunar_cuda_pdl_set(0); /* the reference: eager, every launch serialised */
        lunar_cuda_model_graph_stats(gm, &c0, &r0, NULL, NULL);
        decode_pair_run(&d, gm, 0);
        lunar_cuda_model_graph_stats(gm, &c1, &r1, NULL, NULL);
        CHECK_MSG(c1 == c0 && r1 == r0, "graphs off, yet %ld captures and %ld replays", c1 - c0, r1 - r0);
        lunar_cuda_model_graphs(gm, 1);
        /* with PDL also the weight prefetch before the wait at its widest level (whatever
         * LUNAR_PDL_PREFETCH says): it may move bytes into L2 early, never change a value */
        if (pdl) lunar_cuda_pdl_set(1), lunar_cuda_pdl_prefetch_set(2);
        decode_pair_run(&d, gm, 1);
        if (pdl) lunar_cuda_pdl_set(-1), lunar_cuda_pdl_prefetch_set(-1);
        lunar_cuda_model_graph_stats(gm, &c1, &r1, NULL, NULL);
        *captures += c1 - c0, *replays += r1 - r0;
        int bad_steps = 0, first_bad = -1;
        for (int k = 0; k < STEPS; k++) {
            const size_t o = (size_t)k * B * V;
            const int same = memcmp(le + o, lgr + o, (size_t)B * V * sizeof *le) == 0 &&
                             memcmp(ie + (size_t)k * B, igr + (size_t)k * B, (size_t)B * 4) == 0;
            if (!same && first_bad < 0) first_bad = k;
            bad_steps += !same;
        }
        size_t nodes = 0;
        lunar_cuda_model_graph_stats(gm, NULL, NULL, &nodes, NULL);
        fprintf(stderr, "\n  %s%s, %s MoE, B=%d: %ld captures, %ld replays (last graph %zu nodes), %d/%d steps differ",
                name, pdl ? " (graphs with PDL)" : "", fused ? "fused" : "generic", B, c1 - c0, r1 - r0, nodes, bad_steps, STEPS);
        CHECK_MSG(bad_steps == 0, "%s, B=%d: %d of %d decode steps differ between graphs and eager (first: step %d)", name, B,
                  bad_steps, STEPS, first_bad);
        decode_pair_free(&d);
    }
    lunar_cuda_model_free(gm);
}
static void graphs_vs_eager(const char *name, const lunar_model *m, int fused, const int *Bs, int nB,
                            long *captures, long *replays) {
    graphs_vs_eager_pdl(name, m, fused, Bs, nB, captures, replays, 0);
}

TEST(cuda_forward_graphs_match_eager) {
    if (!lunar_test_cuda_device()) return;
    char dir[64];
    lunar_model *m = lunar_test_model_load(dir, lunar_test_wide_model_dir, NULL);
    if (m) {
        long cap = 0, rep = 0;
        const int Bs[] = {1, 3, 6};
        graphs_vs_eager("kimi-linear", m, 1, Bs, 3, &cap, &rep);
        /* per batch size: three keys (bucket 256, bucket 512, sampled), each eager once then
         * captured; every later step of a key replays: 16 steps - 3 eager = 13 graph launches */
        CHECK_MSG(cap == 9 && rep == 39, "fused MoE: %ld captures, %ld replays (want 9, 39)", cap, rep);
        cap = rep = 0;
        graphs_vs_eager("kimi-linear", m, 0, Bs, 3, &cap, &rep); /* the generic MoE downloads the routing: never captured */
        CHECK_MSG(cap == 0 && rep == 0, "generic MoE: %ld captures, %ld replays (want none)", cap, rep);
    }
    lunar_test_model_done(m, dir);
}

/* KDA decode of several rows through the fused input projection (lunar_cuda_kda_decode_rows, the
 * default) against the per-projection split path it replaces: the 4-head wide model (low-rank output
 * gate) and the 4-head K3 model (full-rank gate; both fused projections a multiple of 4 wide), batches
 * 3 and 5, 16 eager steps each from the same caches. The two compute the same math through other
 * kernels (one GEMM of the fused matrix and the gate projections' kernel, against a GEMM per matrix,
 * the gate and sigmoid launches): fp32 sums in other orders, which flip some of the bf16 roundings
 * downstream (the GEMM operands, the MLA kernels': steps of 2^-8 relative) and, in the K3 model, may
 * move a DSA selection or a route near a tie: lunar_test_cmp_rows's median row within 1e-2, the worst
 * within 0.25 (a wrong row would be O(1) in most rows; the H200 runs of session 21: median 0, worst
 * 5.4e-3 / 5.7e-3 on the wide model, 0 / 6.6e-2 on the K3 one, relative to each row's own maximum),
 * the argmax agreeing (near ties counted) in >= 90 % of the rows; the multi-row path must have run. */
static void kda_rows_vs_split(const char *name, int (*make)(char *)) {
    char dir[64];
    lunar_model *m = lunar_test_model_load(dir, make, NULL);
    lunar_err err;
    lunar_cuda_model *gm = NULL;
    if (m) CHECK_MSG(lunar_test_cuda_upload(&gm, m, 1, &err) == 0, "%s", err.msg);
    if (gm) {
        lunar_cuda_model_graphs(gm, 0);
        const int V = m->cfg.vocab_size;
        static const int Bs[] = {3, 5};
        for (int bi = 0; bi < 2; bi++) {
            const int B = Bs[bi];
            decode_pair d;
            if (decode_pair_init(&d, gm, m, B, 200, 30)) break;
            const size_t nl = (size_t)STEPS * B * V;
            const float *lr = d.logits[0], *ls = d.logits[1];
            const int prev = lunar_cuda_kda_decode_rows(1);
            const long r0 = lunar_cuda_kda_decode_rows_runs();
            decode_pair_run(&d, gm, 0);
            const long r1 = lunar_cuda_kda_decode_rows_runs();
            lunar_cuda_kda_decode_rows(0);
            decode_pair_run(&d, gm, 1);
            CHECK_MSG(lunar_cuda_kda_decode_rows_runs() == r1, "the split path ran the multi-row path");
            lunar_cuda_kda_decode_rows(prev);
            CHECK_MSG(r1 - r0 == (long)STEPS * m->cfg.n_kda_layers, "%s: multi-row KDA layers run: %ld (want %ld)",
                      name, r1 - r0, (long)STEPS * m->cfg.n_kda_layers);
            /* the rows the device did not sample (sampled rows return no logits), gathered */
            float *ga = lunar_xmalloc(nl * sizeof *ga), *gs = lunar_xmalloc(nl * sizeof *gs);
            int rows = 0, same = 0;
            for (int k = 0; k < STEPS; k++)
                for (int b = 0; b < B; b++) {
                    if (k >= SAMPLED_FROM && b % 2 == 0) continue;
                    memcpy(ga + (size_t)rows * V, lr + ((size_t)k * B + b) * V, (size_t)V * sizeof *ga);
                    memcpy(gs + (size_t)rows * V, ls + ((size_t)k * B + b) * V, (size_t)V * sizeof *gs);
                    rows++;
                }
            double worst = 0;
            const double med = lunar_test_cmp_rows(ga, gs, rows, V, &same, NULL, &worst);
            fprintf(stderr, "\n  %s: kda rows vs split, B=%d: median / worst row %.2e / %.2e, argmax %d/%d", name, B, med,
                    worst, same, rows);
            CHECK_MSG(med <= 1e-2 && worst <= 0.25, "%s, B=%d: logits rows from the split path's: median %.3g, worst %.3g",
                      name, B, med, worst);
            CHECK_MSG(same * 100 >= rows * 90, "%s, B=%d: argmax %d of %d rows", name, B, same, rows);
            free(ga), free(gs);
            decode_pair_free(&d);
        }
        lunar_cuda_model_free(gm);
    }
    lunar_test_model_done(m, dir);
}
TEST(cuda_forward_kda_rows_match_split) {
    if (!lunar_test_cuda_device()) return;
    kda_rows_vs_split("kimi-linear, 4 KDA heads", lunar_test_wide4_model_dir);
    kda_rows_vs_split("k3, 4 KDA heads", lunar_test_k3h4_model_dir);
}

/* --quantization ptpc_fp8 (the wide model's linears as PTPC-FP8): batch 1 and 3 decode steps take the
 * fused decode kernel, batch 6 the per-token quantiser (its codes and scales in arena scratch) and
 * the scaled cuBLASLt FP8 GEMM, whose scale pointers are descriptor state read when the call is
 * enqueued: a graph must replay the ones of its capture, which the bit-identical logits show. */
TEST(cuda_ptpc_graphs_match_eager) {
    if (!lunar_test_cuda_device()) return;
    char dir[64];
    lunar_load_options lo = {.ptpc_fp8 = 1};
    lunar_model *m = lunar_test_model_load(dir, lunar_test_wide_model_dir, &lo);
    if (m) {
        long cap = 0, rep = 0;
        long long g0, g1;
        const int Bs[] = {1, 3, 6};
        lunar_cuda_ptpc_stats(NULL, NULL, NULL, &g0);
        graphs_vs_eager("kimi-linear, ptpc fp8", m, 1, Bs, 3, &cap, &rep);
        lunar_cuda_ptpc_stats(NULL, NULL, NULL, &g1);
        CHECK_MSG(cap == 9 && rep == 39, "ptpc: %ld captures, %ld replays (want 9, 39)", cap, rep);
        CHECK(g1 > g0); /* the decode kernel ran (eager and captured steps) */
    }
    lunar_test_model_done(m, dir);
}

/* The K3 / K3.1-shaped model (tests/cuda_wide.h): AttnRes (its candidates read from the step's
 * input block), the DSA indexer and sparse MLA, the dense first layer, the latent MXFP4 MoE on the
 * fused path. Batch sizes 1 and 3, the same three keys per batch size as above. */
TEST(cuda_forward_graphs_k3_match_eager) {
    if (!lunar_test_cuda_device()) return;
    char dir[64];
    lunar_model *m = lunar_test_model_load(dir, lunar_test_k3_model_dir, NULL);
    if (m) {
        long cap = 0, rep = 0;
        const int Bs[] = {1, 3};
        graphs_vs_eager("k3", m, 1, Bs, 2, &cap, &rep);
        CHECK_MSG(cap == 6 && rep == 26, "k3: %ld captures, %ld replays (want 6, 26)", cap, rep);
    }
    lunar_test_model_done(m, dir);
}

/* Programmatic dependent launch (cuda_common.cuh; the default, LUNAR_CUDA_PDL=0 turns it off): the
 * graphed steps launched with it against the eager steps without it, bit for bit. PDL changes only when a kernel may start, never
 * what it computes, so any difference is a kernel that read its predecessor's output before the
 * wait (or a broken wait chain): the kernel-shaped Kimi-Linear model at B = 1 and 3 (the fused MoE
 * decode pair, the KDA decode kernels, the skinny GEMMs, the norms) and the K3 model at B = 1. */
TEST(cuda_forward_graphs_pdl_match_eager) {
    if (!lunar_test_cuda_device()) return;
    char dir[64];
    long cap = 0, rep = 0;
    lunar_model *m = lunar_test_model_load(dir, lunar_test_wide_model_dir, NULL);
    if (m) {
        const int Bs[] = {1, 3};
        graphs_vs_eager_pdl("kimi-linear", m, 1, Bs, 2, &cap, &rep, 1);
        CHECK_MSG(cap == 6 && rep == 26, "kimi-linear: %ld captures, %ld replays (want 6, 26)", cap, rep);
    }
    lunar_test_model_done(m, dir);
    m = lunar_test_model_load(dir, lunar_test_k3_model_dir, NULL);
    if (m) {
        const int Bs[] = {1};
        cap = rep = 0;
        graphs_vs_eager_pdl("k3", m, 1, Bs, 1, &cap, &rep, 1);
        CHECK_MSG(cap == 3 && rep == 13, "k3: %ld captures, %ld replays (want 3, 13)", cap, rep);
    }
    lunar_test_model_done(m, dir);
}

#endif
