/* Tensor and decode-context parallelism on the CPU backend: ranks are threads joined by the CPU
 * collectives (parallel/comm.h), each running the forward on its shards (model/shard.h).
 *  - collectives: all-reduce / all-gather / all-to-all results, equal bits on every rank;
 *  - the TCP rendezvous on localhost: threads and a forked process receive rank 0's blob;
 *  - the staged DCP attention ops: partials over a round-robin split of the cache, merged by
 *    log-sum-exp, equal the absorbed op over the whole cache;
 *  - every tiny golden model (Kimi-Linear with K2 MoE, K3 with latent MoE + AttnRes, K3.1 with the
 *    DSA indexer): prefill + decode steps at TP 2/4/8, TP 2/4 with expert parallelism, and every
 *    DCP size that divides the TP size (TP 2 x DCP 2; TP 4 x DCP 2, 4; TP 8 x DCP 2, 4, 8: DCP
 *    groups of ranks [g D, g D + D), token t on DCP rank t % D) give the logits of the single-rank
 *    forward, and every rank the same bits.
 * The goldens have 1-5 heads: splits are uneven (and at TP 8 some ranks hold no head of a layer),
 * which the sharding supports by design, so no special model is needed.
 * Tolerance 2e-5 relative to the largest |logit|: each all-reduce sums fp32 partial dot products in
 * a different order than one long dot product (~1e-7 relative per add), and DCP reorders the
 * attention softmax sums; measured differences are ~1e-6 (see the failure message). */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "io/safetensors.h"
#include "model/forward.h"
#include "model/shard.h"
#include "model/tp_group.h"
#include "ops.h"
#include "parallel/comm.h"
#include "test.h"

#define TP_TOL 2e-5

/* ---------------------------------------------------------------- collectives */

typedef struct coll_arg {
    lunar_comm *c;
    float out_reduce[7], out_gather[3 * 5], out_a2a[3 * 2];
    int rc;
} coll_arg;

static void *coll_rank(void *p) {
    coll_arg *a = p;
    const int r = a->c->rank;
    lunar_err err;
    float x[7], g[5], s[3 * 2];
    for (int i = 0; i < 7; i++) x[i] = 0.1f * (float)(r + 1) + (float)i;
    for (int i = 0; i < 5; i++) g[i] = (float)(100 * r + i);
    for (int j = 0; j < 3; j++) s[j * 2] = (float)(10 * r + j), s[j * 2 + 1] = -(float)(10 * r + j);
    a->rc = lunar_all_reduce_sum(a->c, x, 7, &err) | lunar_all_gather(a->c, g, a->out_gather, 5, &err) |
            lunar_all_to_all(a->c, s, a->out_a2a, 2, &err) | lunar_barrier(a->c, &err);
    memcpy(a->out_reduce, x, sizeof x);
    return NULL;
}

TEST(tp_comm_cpu_collectives) {
    lunar_comm *comms[3];
    lunar_comm_cpu_world(comms, 3);
    coll_arg a[3];
    pthread_t th[3];
    for (int r = 0; r < 3; r++) {
        memset(&a[r], 0, sizeof a[r]);
        a[r].c = comms[r];
        pthread_create(&th[r], NULL, coll_rank, &a[r]);
    }
    for (int r = 0; r < 3; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < 3; r++) {
        CHECK(a[r].rc == 0);
        for (int i = 0; i < 7; i++) { /* sum in rank order: (0.1+i) + (0.2+i) + (0.3+i) */
            float want = ((0.1f + (float)i) + (0.2f + (float)i)) + (0.3f + (float)i);
            CHECK(a[r].out_reduce[i] == want);
            CHECK(memcmp(&a[r].out_reduce[i], &a[0].out_reduce[i], sizeof(float)) == 0);
        }
        for (int k = 0; k < 3; k++)
            for (int i = 0; i < 5; i++) CHECK(a[r].out_gather[k * 5 + i] == (float)(100 * k + i));
        for (int k = 0; k < 3; k++) { /* chunk r of rank k */
            CHECK(a[r].out_a2a[k * 2] == (float)(10 * k + r));
            CHECK(a[r].out_a2a[k * 2 + 1] == -(float)(10 * k + r));
        }
    }
    for (int r = 0; r < 3; r++) lunar_comm_free(comms[r]);
}

/* DCP groups out of a TP world (lunar_dcp_comm, the function the CUDA ranks call on their NCCL
 * comm): for every DCP size dividing TP, each rank's comm is NULL (DCP 1), the TP comm (DCP = TP)
 * or a comm of the D consecutive ranks [g D, g D + D) with rank r % D; collectives on it see only
 * the group (a gather returns the group's ranks in order, a sum the group's), and the TP comm
 * still spans every rank after the split. Also lunar_comm_split's own ordering: ranks of a color by
 * key (here descending TP rank), ties by TP rank. */
typedef struct split_arg {
    lunar_comm *tp;
    int dcp, rc, dsize, drank, same;
    float gather[8], group_sum, tp_sum, by_key[8], ties[8];
} split_arg;

static void *split_rank(void *p) {
    split_arg *a = p;
    const int r = a->tp->rank, n = a->tp->size;
    lunar_err err;
    lunar_comm *d = NULL, *k = NULL, *t = NULL;
    a->rc = lunar_dcp_comm(a->tp, a->dcp, &d, &err);
    if (a->rc) return NULL;
    a->same = d == a->tp;
    a->dsize = d ? d->size : 0, a->drank = d ? d->rank : -1;
    float x = (float)(r + 1), y = (float)(1 << r);
    if (d) a->rc |= lunar_all_gather(d, &x, a->gather, 1, &err) | lunar_all_reduce_sum(d, &y, 1, &err);
    a->group_sum = y;
    float z = (float)(r + 1);
    a->rc |= lunar_all_reduce_sum(a->tp, &z, 1, &err); /* the TP world after the split */
    a->tp_sum = z;
    a->rc |= lunar_comm_split(a->tp, r % 2, n - r, &k, &err); /* odd / even ranks, descending */
    if (k) a->rc |= lunar_all_gather(k, &x, a->by_key, 1, &err);
    a->rc |= lunar_comm_split(a->tp, 0, 7, &t, &err); /* one color, equal keys: TP order */
    if (t) a->rc |= lunar_all_gather(t, &x, a->ties, 1, &err);
    lunar_comm_free(k), lunar_comm_free(t);
    lunar_dcp_comm_free(a->tp, d);
    return NULL;
}

TEST(tp_dcp_comm_groups) {
    static const int cases[][2] = {{1, 1}, {2, 1}, {2, 2}, {4, 2}, {4, 4}, {8, 2}, {8, 4}, {8, 8}, {6, 3}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int n = cases[ci][0], D = cases[ci][1];
        lunar_comm *comms[8];
        lunar_comm_cpu_world(comms, n);
        split_arg a[8];
        pthread_t th[8];
        for (int r = 0; r < n; r++) {
            memset(&a[r], 0, sizeof a[r]);
            a[r].tp = comms[r], a[r].dcp = D;
            pthread_create(&th[r], NULL, split_rank, &a[r]);
        }
        for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
        for (int r = 0; r < n; r++) {
            const int g = lunar_dcp_group(r, D), gr = lunar_dcp_group_rank(r, D);
            CHECK_MSG(a[r].rc == 0, "tp %d dcp %d rank %d failed", n, D, r);
            CHECK_MSG(g * D + gr == r && gr >= 0 && gr < D, "tp %d dcp %d rank %d: group %d rank %d", n, D, r, g, gr);
            CHECK_MSG(D == 1 ? a[r].dsize == 0 : a[r].dsize == D && a[r].drank == gr,
                      "tp %d dcp %d rank %d: dcp comm size %d rank %d", n, D, r, a[r].dsize, a[r].drank);
            CHECK_MSG(a[r].same == (D > 1 && D == n), "tp %d dcp %d: the TP comm %s reused", n, D,
                      a[r].same ? "is" : "is not");
            float want_sum = 0;
            for (int j = 0; j < D && D > 1; j++) {
                CHECK_MSG(a[r].gather[j] == (float)(g * D + j + 1), "tp %d dcp %d rank %d: gathered [%d] = %g", n, D,
                          r, j, a[r].gather[j]);
                want_sum += (float)(1 << (g * D + j));
            }
            if (D > 1) CHECK_MSG(a[r].group_sum == want_sum, "tp %d dcp %d rank %d: group sum %g, want %g", n, D, r,
                                 a[r].group_sum, want_sum);
            CHECK(a[r].tp_sum == (float)(n * (n + 1) / 2));
            /* color r % 2, key n - r: the members r % 2, r % 2 + 2, .. from the highest down */
            const int m = (n - r % 2 + 1) / 2;
            for (int j = 0; j < m; j++) {
                const int want = r % 2 + 2 * (m - 1 - j);
                CHECK_MSG(a[r].by_key[j] == (float)(want + 1), "tp %d rank %d: split by key [%d] = %g, want rank %d",
                          n, r, j, a[r].by_key[j], want);
            }
            for (int j = 0; j < n; j++) CHECK(a[r].ties[j] == (float)(j + 1));
        }
        for (int r = 0; r < n; r++) lunar_comm_free(comms[r]);
    }
    /* the layout in words (`lunar plan`, serve's log) names the same groups */
    char buf[192];
    lunar_dcp_layout(buf, sizeof buf, 4, 2);
    CHECK_MSG(strcmp(buf, "2 groups of 2 consecutive ranks [0,1] [2,3]; TP rank r is DCP rank r % 2") == 0, "%s", buf);
    lunar_dcp_layout(buf, sizeof buf, 8, 4);
    CHECK_MSG(strcmp(buf, "2 groups of 4 consecutive ranks [0-3] [4-7]; TP rank r is DCP rank r % 4") == 0, "%s", buf);
    lunar_dcp_layout(buf, sizeof buf, 64, 8);
    CHECK_MSG(strcmp(buf, "8 groups of 8 consecutive ranks [0-7] [8-15] [16-23] .. [56-63]; TP rank r is DCP rank r % 8") == 0,
              "%s", buf);
    lunar_dcp_layout(buf, sizeof buf, 8, 8);
    CHECK_MSG(strcmp(buf, "1 group of 8 consecutive ranks [0-7]; TP rank r is DCP rank r % 8") == 0, "%s", buf);
    lunar_dcp_layout(buf, sizeof buf, 8, 1);
    CHECK_MSG(strcmp(buf, "none") == 0, "%s", buf);
    lunar_dcp_layout(buf, 16, 64, 8); /* truncated, terminated */
    CHECK(strlen(buf) == 15);
}

/* ---------------------------------------------------------------- rendezvous */

typedef struct rdv_arg {
    int port, rank;
    unsigned char blob[LUNAR_NCCL_ID_BYTES];
    int rc;
    lunar_err err;
} rdv_arg;

static void *rdv_join(void *p) {
    rdv_arg *a = p;
    a->rc = lunar_rdv_join("127.0.0.1", a->port, a->rank, a->blob, sizeof a->blob, 10000, &a->err);
    return NULL;
}

TEST(tp_rendezvous_localhost) {
    enum { WORLD = 5 };
    lunar_rdv_server s;
    lunar_err err;
    if (lunar_rdv_listen(&s, "127.0.0.1", 0, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    CHECK(s.port > 0);
    unsigned char id[LUNAR_NCCL_ID_BYTES];
    for (int i = 0; i < (int)sizeof id; i++) id[i] = (unsigned char)(i * 37 + 11);
    /* rank 4 is another process: it exits 0 iff it received the blob */
    pid_t child = fork();
    if (child == 0) {
        unsigned char got[LUNAR_NCCL_ID_BYTES];
        lunar_err e;
        int rc = lunar_rdv_join("127.0.0.1", s.port, 4, got, sizeof got, 10000, &e);
        _exit(rc == 0 && memcmp(got, id, sizeof id) == 0 ? 0 : 1);
    }
    rdv_arg a[3];
    pthread_t th[3];
    for (int i = 0; i < 3; i++) {
        memset(&a[i], 0, sizeof a[i]);
        a[i].port = s.port, a[i].rank = i + 1;
        pthread_create(&th[i], NULL, rdv_join, &a[i]);
    }
    CHECK_MSG(lunar_rdv_serve(&s, WORLD, id, sizeof id, 10000, &err) == 0, "%s", err.msg);
    for (int i = 0; i < 3; i++) {
        pthread_join(th[i], NULL);
        CHECK_MSG(a[i].rc == 0, "rank %d: %s", a[i].rank, a[i].err.msg);
        CHECK(memcmp(a[i].blob, id, sizeof id) == 0);
    }
    int status = 0;
    CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(tp_rendezvous_errors) {
    lunar_rdv_server s;
    lunar_err err;
    unsigned char id[16] = {1, 2, 3};
    /* nobody joins: the master times out and says how many are missing */
    CHECK(lunar_rdv_listen(&s, "127.0.0.1", 0, &err) == 0);
    CHECK(lunar_rdv_serve(&s, 3, id, sizeof id, 100, &err) == -1);
    CHECK(strstr(err.msg, "2 of 2 ranks") != NULL);
    /* a rank outside the world is refused */
    CHECK(lunar_rdv_listen(&s, "127.0.0.1", 0, &err) == 0);
    rdv_arg a;
    memset(&a, 0, sizeof a);
    a.port = s.port, a.rank = 7;
    pthread_t th;
    pthread_create(&th, NULL, rdv_join, &a);
    CHECK(lunar_rdv_serve(&s, 3, id, sizeof id, 5000, &err) == -1);
    CHECK(strstr(err.msg, "rank 7") != NULL);
    pthread_join(th, NULL);
    CHECK(a.rc == -1);
    /* nobody listens: joining fails after the timeout */
    CHECK(lunar_rdv_join("127.0.0.1", 1, 1, id, sizeof id, 100, &err) == -1);
    CHECK(lunar_rendezvous("127.0.0.1", 0, 3, 2, id, sizeof id, 100, &err) == -1);
}

/* ---------------------------------------------------------------- DCP attention ops */

TEST(tp_dcp_partial_merge_equals_absorbed) {
    const int H = 3, N = 5, P = 3, Vd = 4, R = 7, T = 4, pos0 = 9, L = pos0 + T;
    float *Wd = malloc(sizeof(float) * H * (N + Vd) * R), *q = malloc(sizeof(float) * T * H * (N + P));
    float *cache = malloc(sizeof(float) * L * (R + P)), *want = malloc(sizeof(float) * T * H * Vd);
    lunar_test_fill(Wd, H * (N + Vd) * R, 1, -1, 1);
    lunar_test_fill(q, T * H * (N + P), 2, -1, 1);
    lunar_test_fill(cache, L * (R + P), 3, -1, 1);
    lunar_tensor W = {.dtype = LUNAR_DTYPE_F32, .ndim = 2, .shape = {H * (N + Vd), R}, .data = Wd,
                      .nbytes = sizeof(float) * H * (N + Vd) * R};
    const float scale = 0.37f;
    op_mla_attention_absorbed(want, q, cache, &W, T, pos0, H, N, P, Vd, R, scale);

    for (int D = 1; D <= 4; D++) {
        float *qlat = malloc(sizeof(float) * T * H * (R + P));
        op_mla_absorb_q(qlat, q, &W, T, H, N, P, Vd, R);
        const size_t part = (size_t)T * H * (R + 1);
        float *parts = malloc(sizeof(float) * part * D), *olat = malloc(sizeof(float) * T * H * R);
        float *lse = malloc(sizeof(float) * T * H);
        for (int d = 0; d < D; d++) { /* rank d holds positions d, d + D, ... */
            int Ll = L > d ? (L - d + D - 1) / D : 0, cnt[4];
            float *loc = malloc(sizeof(float) * (Ll + 1) * (R + P));
            for (int i = 0; i < Ll; i++) memcpy(loc + i * (R + P), cache + (size_t)(d + i * D) * (R + P), sizeof(float) * (R + P));
            for (int t = 0; t < T; t++) cnt[t] = pos0 + t >= d ? (pos0 + t - d) / D + 1 : 0;
            op_mla_attention_partial(olat, lse, qlat, loc, NULL, cnt, 0, T, H, R, P, scale);
            for (int i = 0; i < T * H; i++) {
                memcpy(parts + d * part + i * (R + 1), olat + i * R, sizeof(float) * R);
                parts[d * part + i * (R + 1) + R] = lse[i];
            }
            free(loc);
        }
        float *merged = malloc(sizeof(float) * T * H * R), *got = malloc(sizeof(float) * T * H * Vd);
        op_mla_merge_partials(merged, parts, D, part, T * H, R);
        op_mla_output_v(got, merged, &W, T, H, N, Vd, R);
        double e = lunar_max_rel_err(got, want, T * H * Vd);
        CHECK_MSG(e < 1e-5, "DCP %d: max rel err %.3g", D, e); /* fp32 reordering only */
        free(qlat), free(parts), free(olat), free(lse), free(merged), free(got);
    }
    /* an empty part (lse -inf) contributes nothing; all parts empty gives 0 */
    float two[2 * 3] = {1, 2, -INFINITY, 5, 6, 0.5f}, out[2];
    op_mla_merge_partials(out, two, 2, 3, 1, 2);
    CHECK(out[0] == 5 && out[1] == 6);
    float none[3] = {7, 8, -INFINITY};
    op_mla_merge_partials(out, none, 1, 3, 1, 2);
    CHECK(out[0] == 0 && out[1] == 0);
    free(Wd), free(q), free(cache), free(want);
}

/* ---------------------------------------------------------------- the model at TP / DCP */

typedef struct run_case {
    const lunar_model *full;
    lunar_tp_opts o;
    const int32_t *ids;
    int T, nd;         /* prefill T tokens (all logits), then nd decode steps */
    float **logits;    /* [tp] each [(T + nd) * V] */
    lunar_comm **comm; /* the TP world; each rank splits its DCP comm off it (lunar_dcp_comm, as CUDA ranks do) */
    int *rc;
    char (*msg)[1024];
} run_case;

typedef struct rank_arg {
    run_case *rc;
    int rank;
} rank_arg;

/* prefill + decode on one sequence: logits [(T + nd), V] */
static int run_seq(const lunar_model *m, const int32_t *ids, int T, int nd, float *logits, lunar_err *err) {
    lunar_seq s;
    const int V = m->cfg.vocab_size;
    if (lunar_seq_init(&s, m, T + nd, err)) return -1;
    int rc = lunar_forward(m, &s, ids, T, logits, 1, err);
    for (int i = 0; i < nd && rc == 0; i++)
        rc = lunar_forward(m, &s, ids + T + i, 1, logits + (size_t)(T + i) * V, 0, err);
    lunar_seq_free(&s);
    return rc;
}

static void *rank_main(void *p) {
    rank_arg *a = p;
    run_case *c = a->rc;
    lunar_err err;
    lunar_model *m;
    lunar_comm *dcp = NULL;
    int rc = lunar_dcp_comm(c->comm[a->rank], c->o.dcp, &dcp, &err);
    if (rc == 0) rc = lunar_shard_model(&m, c->full, &c->o, a->rank, c->comm[a->rank], dcp, &err);
    if (rc == 0) {
        rc = run_seq(m, c->ids, c->T, c->nd, c->logits[a->rank], &err);
        lunar_model_free(m);
    }
    lunar_dcp_comm_free(c->comm[a->rank], dcp);
    c->rc[a->rank] = rc;
    if (rc) snprintf(c->msg[a->rank], 1024, "%s", err.msg);
    return NULL;
}

/* Runs the model on o.tp rank threads; fills logits[r] for every rank. 0 when all succeeded. */
static int run_parallel(const lunar_model *full, lunar_tp_opts o, const int32_t *ids, int T, int nd,
                        float **logits, char *why) {
    const int n = o.tp;
    lunar_comm **comm = calloc(n, sizeof *comm);
    lunar_comm_cpu_world(comm, n);
    int *rcs = calloc(n, sizeof *rcs);
    char(*msg)[1024] = calloc(n, sizeof *msg);
    run_case c = {full, o, ids, T, nd, logits, comm, rcs, msg};
    rank_arg *args = calloc(n, sizeof *args);
    pthread_t *th = calloc(n, sizeof *th);
    for (int r = 0; r < n; r++) {
        args[r].rc = &c, args[r].rank = r;
        pthread_create(&th[r], NULL, rank_main, &args[r]);
    }
    int bad = 0;
    for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < n; r++)
        if (rcs[r] && !bad) bad = 1, snprintf(why, 1024, "rank %d: %s", r, msg[r]);
    for (int r = 0; r < n; r++) lunar_comm_free(comm[r]);
    free(comm), free(rcs), free(msg), free(args), free(th);
    return bad ? -1 : 0;
}

static void check_model(const char *name) {
    char dir[256], path[300];
    snprintf(dir, sizeof dir, "tests/golden/%s", name);
    lunar_err err;
    lunar_st *g;
    snprintf(path, sizeof path, "%s/golden.safetensors", dir);
    if (lunar_st_open(&g, path, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    const char *md = lunar_st_metadata(g, "model_dir");
    lunar_model *full;
    if (lunar_model_load(&full, md ? md : dir, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        lunar_st_close(g);
        return;
    }
    const lunar_tensor *pid = lunar_st_find(g, "prompt_ids"), *did = lunar_st_find(g, "decode_ids");
    const int T = (int)pid->shape[0], nd = (int)did->shape[0], V = full->cfg.vocab_size;
    int32_t *ids = malloc(sizeof(int32_t) * (T + nd));
    memcpy(ids, pid->data, sizeof(int32_t) * T);
    memcpy(ids + T, did->data, sizeof(int32_t) * nd);
    const size_t n = (size_t)(T + nd) * V;
    float *want = malloc(n * sizeof(float));
    CHECK(run_seq(full, ids, T, nd, want, &err) == 0);

    /* every (TP, DCP) pair of TP 2, 4, 8 with DCP dividing it (DCP 1 = TP alone), and EP at TP 2, 4 */
    const lunar_tp_opts cases[] = {{2, 1, 0}, {4, 1, 0}, {8, 1, 0}, {2, 1, 1}, {4, 1, 1}, {2, 2, 0},
                                   {4, 2, 0}, {4, 4, 0}, {8, 2, 0}, {8, 4, 0}, {8, 8, 0}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        lunar_tp_opts o = cases[k];
        if (o.dcp > 1 && full->cfg.n_mla_layers == 0) continue;
        float **lg = calloc(o.tp, sizeof *lg);
        for (int r = 0; r < o.tp; r++) lg[r] = malloc(n * sizeof(float));
        char why[1024] = "";
        if (run_parallel(full, o, ids, T, nd, lg, why) == 0) {
            double e = lunar_max_rel_err(lg[0], want, (long)n);
            CHECK_MSG(e <= TP_TOL, "%s tp %d dcp %d ep %d: max rel err %.3g vs the single rank", name, o.tp,
                      o.dcp, o.ep, e);
            for (int r = 1; r < o.tp; r++)
                CHECK_MSG(memcmp(lg[r], lg[0], n * sizeof(float)) == 0, "%s tp %d dcp %d: rank %d differs from rank 0",
                          name, o.tp, o.dcp, r);
            if (getenv("LUNAR_TP_VERBOSE"))
                fprintf(stderr, "\n  %s tp %d dcp %d ep %d: max rel err %.3g", name, o.tp, o.dcp, o.ep, e);
        } else {
            CHECK_MSG(0, "%s tp %d dcp %d: %s", name, o.tp, o.dcp, why);
        }
        for (int r = 0; r < o.tp; r++) free(lg[r]);
        free(lg);
    }
    free(ids), free(want);
    lunar_model_free(full);
    lunar_st_close(g);
}

TEST(tp_tiny_kimi_linear) { check_model("tiny-a"), check_model("tiny-b"), check_model("tiny-c"); }
TEST(tp_kimi_linear_tiny_k2_moe) { check_model("kimi-linear-tiny"); }
TEST(tp_k3) { check_model("k3-a"), check_model("k3-b"); }
TEST(tp_k31_indexer) { check_model("k31-a"), check_model("k31-b"); }

TEST(tp_options_checked) {
    lunar_config c;
    memset(&c, 0, sizeof c);
    c.n_mla_layers = 1;
    lunar_err err;
    lunar_tp_opts bad_dcp = {4, 3, 0}, zero = {0, 1, 0}, ok = {4, 2, 0};
    CHECK(lunar_tp_check(&c, &bad_dcp, &err) == -1 && strstr(err.msg, "must divide"));
    CHECK(lunar_tp_check(&c, &zero, &err) == -1);
    CHECK(lunar_tp_check(&c, &ok, &err) == 0);
    lunar_tp_opts three = {6, 3, 0}; /* a rank's share of a 128-token block must be whole */
    CHECK(lunar_tp_check(&c, &three, &err) == -1 && strstr(err.msg, "block size"));
    c.n_mla_layers = 0;
    CHECK(lunar_tp_check(&c, &ok, &err) == -1 && strstr(err.msg, "no MLA layer"));
    /* uneven splits cover every unit exactly once */
    for (int parts = 1; parts <= 8; parts++) {
        int64_t next = 0;
        for (int r = 0; r < parts; r++) {
            int64_t off, len;
            lunar_split(96, parts, r, 32, &off, &len);
            CHECK(off == next && len % 32 == 0);
            next = off + len;
        }
        CHECK(next == 96);
    }
}

/* ---------------------------------------------------------------- the group: batches of sequences */

/* Two sequences share the paged pools: prefilled together in one step (different lengths), then
 * decoded together for 3 steps; the group's logits equal the single-rank batch forward's. */
static void check_group_batch(const char *dir, lunar_tp_opts o) {
    lunar_err err;
    lunar_model *full;
    if (lunar_model_load(&full, dir, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    const int V = full->cfg.vocab_size, nA = 37, nB = 21, steps = 3, n_blocks = 4;
    int32_t ids[64], blkA[2] = {0, 2}, blkB[2] = {3, 1};
    for (int i = 0; i < 64; i++) ids[i] = (int32_t)((i * 7919 + 13) % V);
    const int rows = nA + 1 + steps * 2;
    float *want = malloc(sizeof(float) * rows * V), *got = malloc(sizeof(float) * rows * V);
    lunar_tp_group *g = NULL;
    lunar_kv_pool kv;
    lunar_state_pool st;
    CHECK(lunar_kv_pool_init(&kv, &full->cfg, n_blocks, LUNAR_KV_F32, &err) == 0);
    CHECK(lunar_state_pool_init(&st, &full->cfg, 2, 0, &err) == 0);
    CHECK_MSG(lunar_tp_group_create(&g, full, &o, &err) == 0, "%s", err.msg);
    CHECK(g && lunar_tp_group_pools(g, n_blocks, LUNAR_KV_F32, 2, 0, &err) == 0);
    for (int pass = 0; pass < 2 && g; pass++) {
        float *out = pass ? got : want;
        /* step 1: A (all logits) and B (last) prefill together */
        lunar_batch_seq s[2] = {{ids, nA, 0, 0, blkA, LUNAR_LOGITS_ALL}, {ids + nA, nB, 0, 1, blkB, LUNAR_LOGITS_LAST}};
        int rc = pass ? lunar_tp_group_forward_batch(g, s, 2, out, &err)
                      : lunar_forward_batch(full, &kv, &st, s, 2, out, &err);
        CHECK_MSG(rc == 0, "%s", err.msg);
        for (int k = 0; k < steps; k++) {
            lunar_batch_seq d[2] = {{ids + 60 - k, 1, nA + k, 0, blkA, LUNAR_LOGITS_LAST},
                                    {ids + 50 + k, 1, nB + k, 1, blkB, LUNAR_LOGITS_LAST}};
            float *o2 = out + (size_t)(nA + 1 + 2 * k) * V;
            rc = pass ? lunar_tp_group_forward_batch(g, d, 2, o2, &err) : lunar_forward_batch(full, &kv, &st, d, 2, o2, &err);
            CHECK_MSG(rc == 0, "%s", err.msg);
        }
    }
    double e = lunar_max_rel_err(got, want, (long)rows * V);
    CHECK_MSG(e <= TP_TOL, "%s tp %d dcp %d: batched max rel err %.3g", dir, o.tp, o.dcp, e);
    /* an invalid id fails on every rank alike, and the group stays usable */
    int32_t bad = V;
    lunar_batch_seq sb = {&bad, 1, nA + steps, 0, blkA, LUNAR_LOGITS_LAST};
    CHECK(g && lunar_tp_group_forward_batch(g, &sb, 1, got, &err) == -1 && strstr(err.msg, "outside the vocabulary"));
    /* the KDA state ops reach every rank: clearing a slot changes the next step's logits */
    if (g && full->cfg.n_kda_layers) {
        lunar_batch_seq d = {ids + 5, 1, nA + steps, 0, blkA, LUNAR_LOGITS_LAST};
        lunar_tp_group_state_copy(g, 1, 0); /* slot 1 := slot 0 */
        CHECK(lunar_tp_group_forward_batch(g, &d, 1, want, &err) == 0);
        d.slot = 1;
        CHECK(lunar_tp_group_forward_batch(g, &d, 1, got, &err) == 0);
        CHECK(memcmp(want, got, sizeof(float) * V) == 0);
        lunar_tp_group_state_clear(g, 1);
        CHECK(lunar_tp_group_forward_batch(g, &d, 1, got, &err) == 0);
        CHECK(memcmp(want, got, sizeof(float) * V) != 0);
    }
    lunar_tp_group_free(g);
    lunar_kv_pool_free(&kv);
    lunar_state_pool_free(&st);
    free(want), free(got);
    lunar_model_free(full);
}

TEST(tp_group_batches) {
    const lunar_tp_opts tp2 = {2, 1, 0}, dcp2 = {2, 2, 0}, tp4dcp2 = {4, 2, 0}, dcp4 = {4, 4, 0};
    check_group_batch("tests/golden/tiny-a", tp2);
    check_group_batch("tests/golden/tiny-a", dcp4);
    check_group_batch("tests/golden/k3-a", tp4dcp2);
    check_group_batch("tests/golden/k31-a", dcp2);
    check_group_batch("tests/golden/k31-b", tp4dcp2);
}

/* ---------------------------------------------------------------- CLI */

int lunar_cmd_logits(int argc, char **argv);

/* `lunar logits --tensor-parallel-size 4 --decode-context-parallel-size 2` on the tiny K3.1 model
 * reproduces the oracle's prefill logits (the golden tolerance: fp32 vs fp32), and bad sizes fail. */
TEST(tp_cli_logits_match_golden) {
    lunar_st *g;
    lunar_err err;
    if (lunar_st_open(&g, "tests/golden/k31-b/golden.safetensors", &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    const lunar_tensor *pid = lunar_st_find(g, "prompt_ids"), *pl = lunar_st_find(g, "prefill_logits");
    const int T = (int)pid->shape[0], V = (int)pl->shape[1];
    char ids[8192] = "";
    size_t len = 0;
    for (int i = 0; i < T; i++)
        len += (size_t)snprintf(ids + len, sizeof ids - len, "%s%d", i ? "," : "", ((const int32_t *)pid->data)[i]);
    char out[] = "/tmp/lunar-test-tp-XXXXXX";
    close(mkstemp(out));
    char *argv[] = {"logits", "tests/golden/k31-b", "--ids", ids, "--out", out,
                    "--tensor-parallel-size", "4", "--decode-context-parallel-size", "2", "--enable-expert-parallel"};
    CHECK(lunar_cmd_logits(11, argv) == 0);
    FILE *f = fopen(out, "rb");
    char *buf = malloc((size_t)T * V * 4 + 4096);
    size_t n = f ? fread(buf, 1, (size_t)T * V * 4 + 4096, f) : 0;
    if (f) fclose(f);
    size_t hlen = n > 10 ? ((size_t)(unsigned char)buf[8] | (size_t)(unsigned char)buf[9] << 8) : 0;
    CHECK(n == 10 + hlen + (size_t)T * V * 4);
    if (n == 10 + hlen + (size_t)T * V * 4) {
        float *got = malloc((size_t)T * V * sizeof(float));
        memcpy(got, buf + 10 + hlen, (size_t)T * V * sizeof(float));
        double e = lunar_max_rel_err(got, pl->data, (long)T * V);
        CHECK_MSG(e <= 1e-4, "max rel err %.3g", e);
        free(got);
    }
    free(buf);
    char *bad[] = {"logits", "tests/golden/k31-b", "--ids", "1,2", "--out", out, "-tp", "4", "-dcp", "3"};
    fprintf(stderr, "[expected error:] ");
    CHECK(lunar_cmd_logits(10, bad) == 1);
    unlink(out);
    lunar_st_close(g);
}

/* ---------------------------------------------------------------- the multi-process launcher */

#include "parallel/launch.h"

static int test_id(void *id, lunar_err *err) {
    (void)err;
    for (int i = 0; i < LUNAR_NCCL_ID_BYTES; i++) ((unsigned char *)id)[i] = (unsigned char)(getpid() * 31 + i);
    return 0;
}

/* each rank writes "rank world node local" and its id to DIR/rank-R; rank `fail_rank` fails */
typedef struct launch_arg {
    char dir[64];
    int fail_rank;
} launch_arg;

static int write_rank(const lunar_rank_info *ri, void *p) {
    const launch_arg *a = p;
    if (ri->rank == a->fail_rank) return 3;
    char path[128];
    snprintf(path, sizeof path, "%s/rank-%d", a->dir, ri->rank);
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    fprintf(f, "%d %d %d %d\n", ri->rank, ri->world, ri->node_rank, ri->local_rank);
    fwrite(ri->id, 1, sizeof ri->id, f);
    fclose(f);
    return 0;
}

typedef struct node_arg {
    lunar_dist_opts o;
    launch_arg *la;
    int rc;
    lunar_err err;
} node_arg;

static void *run_node(void *p) {
    node_arg *n = p;
    n->rc = lunar_launch_node(&n->o, test_id, write_rank, n->la, 10000, &n->err);
    return NULL;
}

static int free_port(void) {
    lunar_rdv_server s;
    lunar_err err;
    if (lunar_rdv_listen(&s, "127.0.0.1", 0, &err)) return 0;
    close(s.fd);
    return s.port;
}

/* Two "nodes" of two processes each on localhost: every rank learns its place and rank 0's id. */
TEST(tp_launch_two_nodes_localhost) {
    launch_arg la = {"", -1};
    snprintf(la.dir, sizeof la.dir, "/tmp/lunar-launch-XXXXXX");
    CHECK(mkdtemp(la.dir) != NULL);
    const int port = free_port();
    node_arg nodes[2];
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        lunar_dist_opts o = {2, i, 2, "127.0.0.1", port};
        nodes[i] = (node_arg){.o = o, .la = &la};
        pthread_create(&th[i], NULL, run_node, &nodes[i]);
    }
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        CHECK_MSG(nodes[i].rc == 0, "node %d: %s", i, nodes[i].err.msg);
    }
    unsigned char id0[LUNAR_NCCL_ID_BYTES];
    for (int r = 0; r < 4; r++) {
        char path[128], line[64];
        snprintf(path, sizeof path, "%s/rank-%d", la.dir, r);
        FILE *f = fopen(path, "rb");
        CHECK_MSG(f != NULL, "rank %d wrote nothing", r);
        if (!f) continue;
        int rank, world, node, local;
        unsigned char id[LUNAR_NCCL_ID_BYTES];
        CHECK(fgets(line, sizeof line, f) && sscanf(line, "%d %d %d %d", &rank, &world, &node, &local) == 4);
        CHECK(rank == r && world == 4 && node == r / 2 && local == r % 2);
        CHECK(fread(id, 1, sizeof id, f) == sizeof id);
        fclose(f);
        unlink(path);
        if (r == 0) memcpy(id0, id, sizeof id);
        CHECK(memcmp(id, id0, sizeof id) == 0);
    }
    /* a failing rank is reported by number */
    lunar_err err;
    launch_arg bad = la;
    bad.fail_rank = 1;
    lunar_dist_opts one = {1, 0, 2, "127.0.0.1", free_port()};
    CHECK(lunar_launch_node(&one, test_id, write_rank, &bad, 10000, &err) == -1 && strstr(err.msg, "rank 1"));
    char path[128];
    snprintf(path, sizeof path, "%s/rank-0", la.dir);
    unlink(path);
    rmdir(la.dir);
    lunar_dist_opts bad_node = {2, 2, 1, NULL, 0};
    CHECK(lunar_launch_node(&bad_node, test_id, write_rank, &bad, 100, &err) == -1 && strstr(err.msg, "--node-rank"));
}

/* ---------------------------------------------------------------- the engine */

#include "lunar.h"

typedef struct eng_out {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    int32_t toks[4][16];
    int n[4];
} eng_out;

typedef struct eng_ctx {
    eng_out *o;
    int i;
} eng_ctx;

static void eng_event(void *user, const lunar_event *ev) {
    eng_ctx *x = user;
    pthread_mutex_lock(&x->o->mu);
    if (ev->has_token && x->o->n[x->i] < 16) x->o->toks[x->i][x->o->n[x->i]++] = ev->token;
    if (ev->finish) x->o->done++, pthread_cond_broadcast(&x->o->cv);
    pthread_mutex_unlock(&x->o->mu);
}

/* Greedy outputs of 4 requests sharing a 130-token prefix: the later ones resume from the prefix
 * cache (latent blocks + KDA checkpoints copied on every rank). */
static int run_engine(const char *dir, int tp, int dcp, int ep, int32_t out[4][16], int64_t *hits) {
    lunar_engine_options o;
    lunar_engine_options_default(&o);
    o.model_dir = dir, o.backend = "cpu", o.max_num_seqs = 4, o.max_model_len = 256;
    o.tensor_parallel_size = tp, o.decode_context_parallel_size = dcp, o.enable_expert_parallel = ep;
    o.cache_memory_bytes = 64 << 20;
    lunar_engine *e;
    lunar_err err;
    if (lunar_engine_create(&e, &o, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return -1;
    }
    eng_out r;
    memset(&r, 0, sizeof r);
    pthread_mutex_init(&r.mu, NULL);
    pthread_cond_init(&r.cv, NULL);
    eng_ctx cx[4];
    int32_t prompt[300];
    for (int i = 0; i < 300; i++) prompt[i] = (int32_t)((i * 131 + 7) % 250);
    /* one request at a time, so the schedule (and the prefix hits) never depends on timing */
    for (int i = 0; i < 4; i++) {
        const int k = i % 2;
        cx[i] = (eng_ctx){&r, i};
        prompt[130 + k] = (int32_t)(i * 10 + k); /* distinct tails after a shared prefix */
        lunar_request q = {.prompt = prompt, .n_prompt = 134 + 5 * k, .on_event = eng_event, .user = &cx[i]};
        lunar_sampling_params_default(&q.sampling);
        q.sampling.temperature = 0;
        q.sampling.max_tokens = 8;
        CHECK_MSG(lunar_engine_submit(e, &q, NULL, &err) == 0, "%s", err.msg);
        pthread_mutex_lock(&r.mu);
        while (r.done < i + 1) pthread_cond_wait(&r.cv, &r.mu);
        pthread_mutex_unlock(&r.mu);
    }
    lunar_engine_metrics mt;
    lunar_engine_metrics_get(e, &mt);
    *hits = mt.prefix_cache_hits;
    lunar_engine_destroy(e);
    memcpy(out, r.toks, sizeof r.toks);
    for (int i = 0; i < 4; i++) CHECK(r.n[i] >= 1); /* 8, or fewer when the end token came */
    pthread_mutex_destroy(&r.mu);
    pthread_cond_destroy(&r.cv);
    return 0;
}

TEST(tp_engine_greedy_matches_single_rank) {
    const char *dirs[] = {"tests/golden/k3-a", "tests/golden/k31-b"};
    for (int d = 0; d < 2; d++) {
        int32_t want[4][16], got[4][16];
        int64_t h1 = 0, h2 = 0;
        if (run_engine(dirs[d], 1, 1, 0, want, &h1)) continue;
        if (run_engine(dirs[d], 4, 2, d, got, &h2)) continue;
        CHECK_MSG(h1 > 0 && h2 == h1, "%s: prefix cache hits %lld vs %lld", dirs[d], (long long)h2, (long long)h1);
        CHECK_MSG(memcmp(want, got, sizeof want) == 0, "%s: greedy outputs differ at tp 4 dcp 2", dirs[d]);
        if (getenv("LUNAR_TP_VERBOSE"))
            for (int i = 0; i < 4; i++)
                for (int k = 0; k < 8; k++) fprintf(stderr, "%d:%d/%d%s", i, want[i][k], got[i][k], k == 7 ? "\n" : " ");
    }
}

/* ---------------------------------------------------------------- the CUDA lm_head's gather plan */

#include "model/forward_cuda_tp.h"

/* lunar_tp_vocab_slice places each rank's block of the gathered logits (forward_cuda_tp.c reorders
 * the all-gather on the device by it): in rank order the slices must tile [0, V) without gap or
 * overlap, each at most one chunk wide, full chunks before the last non-empty one, empty past V
 * (V = 5 on 4 ranks: chunks of 2, the last rank has none). */
TEST(tp_vocab_slices_tile_the_vocabulary) {
    const int64_t Vs[] = {5, 7, 8, 1000, 163840, 163841};
    for (size_t a = 0; a < sizeof Vs / sizeof *Vs; a++)
        for (int size = 1; size <= 8; size++) {
            const int64_t V = Vs[a], C = (V + size - 1) / size;
            int64_t next = 0;
            for (int r = 0; r < size; r++) {
                int64_t v0, vn;
                lunar_tp_vocab_slice(V, C, r, &v0, &vn);
                CHECK(v0 == next);
                CHECK(vn >= 0 && vn <= C);
                CHECK(vn == C || v0 + vn == V); /* only the last non-empty slice is short */
                next = v0 + vn;
            }
            CHECK(next == V);
        }
    int64_t v0, vn;
    lunar_tp_vocab_slice(5, 2, 3, &v0, &vn);
    CHECK(v0 == 5 && vn == 0);
}

/* The stream-ordered collectives are NCCL's alone: handed a CPU comm they fail as values (the CUDA
 * forward then marks its step failed), never touching the buffer or the CPU world's barrier. */
TEST(tp_nccl_stream_calls_refuse_cpu_comms) {
    lunar_comm *c[1];
    lunar_comm_cpu_world(c, 1);
    float x[4] = {1, 2, 3, 4}, y[4] = {0};
    lunar_err e = {0};
    CHECK(lunar_comm_nccl_all_reduce_on(c[0], x, 4, NULL, &e) == -1 && strstr(e.msg, "NCCL"));
    e.msg[0] = 0;
    CHECK(lunar_comm_nccl_all_gather_on(c[0], x, y, 4, NULL, &e) == -1 && strstr(e.msg, "NCCL"));
    e.msg[0] = 0;
    CHECK(lunar_comm_nccl_check(c[0], &e) == -1 && strstr(e.msg, "NCCL"));
    CHECK(x[0] == 1 && x[3] == 4 && y[0] == 0);
    lunar_comm_free(c[0]);
}
