/* CPU tensor-parallel group (model/tp_group.h): the caller's thread posts a job, the rank threads
 * run it between two barriers of a pthread barrier of tp + 1 parties, rank 0 writes the logits
 * into the caller's buffer and the others into scratch. */
#include "model/tp_group.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef enum job_kind { JOB_NONE, JOB_BATCH, JOB_SEQ, JOB_QUIT } job_kind;

typedef struct rank_state {
    lunar_model *m;
    lunar_kv_pool kv;
    lunar_state_pool st;
    int have_pools;
    lunar_seq seq;
    int have_seq;
    float *scratch; /* logits of ranks > 0 */
    size_t scratch_n;
    int rc;
    lunar_err err;
} rank_state;

typedef struct rank_arg {
    struct lunar_tp_group *g;
    int rank;
} rank_arg;

struct lunar_tp_group {
    lunar_tp_opts o;
    int V;
    lunar_comm **comm, **dcp;
    rank_state *rs;
    rank_arg *args;
    pthread_t *th;
    pthread_barrier_t go, done;
    /* the posted job */
    job_kind kind;
    const lunar_batch_seq *seqs;
    int n_seqs, rows;
    const int32_t *ids;
    int n, all_logits;
    float *logits;
};

static float *logits_for(lunar_tp_group *g, rank_state *r, int rank) {
    if (rank == 0) return g->logits;
    size_t need = (size_t)(g->rows ? g->rows : 1) * g->V;
    if (r->scratch_n < need) {
        free(r->scratch);
        r->scratch = lunar_xmalloc(need * sizeof(float));
        r->scratch_n = need;
    }
    return r->scratch;
}

static void *rank_main(void *p) {
    rank_arg *a = p;
    lunar_tp_group *g = a->g;
    rank_state *r = &g->rs[a->rank];
    for (;;) {
        pthread_barrier_wait(&g->go);
        if (g->kind == JOB_QUIT) break;
        float *lg = logits_for(g, r, a->rank);
        if (g->kind == JOB_BATCH)
            r->rc = lunar_forward_batch(r->m, &r->kv, &r->st, g->seqs, g->n_seqs, lg, &r->err);
        else
            r->rc = lunar_forward(r->m, &r->seq, g->ids, g->n, lg, g->all_logits, &r->err);
        pthread_barrier_wait(&g->done);
    }
    return NULL;
}

int lunar_tp_group_create(lunar_tp_group **out, const lunar_model *full, const lunar_tp_opts *o,
                          lunar_err *err) {
    *out = NULL;
    if (lunar_tp_check(&full->cfg, o, err)) return -1;
    const int n = o->tp;
    lunar_tp_group *g = lunar_xcalloc(1, sizeof *g);
    g->o = *o;
    g->V = full->cfg.vocab_size;
    g->comm = lunar_xcalloc((size_t)n, sizeof *g->comm);
    lunar_comm_cpu_world(g->comm, n);
    if (o->dcp > 1) {
        g->dcp = lunar_xcalloc((size_t)n, sizeof *g->dcp);
        for (int k = 0; k < n / o->dcp; k++) lunar_comm_cpu_world(g->dcp + k * o->dcp, o->dcp);
    }
    g->rs = lunar_xcalloc((size_t)n, sizeof *g->rs);
    for (int r = 0; r < n; r++)
        if (lunar_shard_model(&g->rs[r].m, full, o, r, g->comm[r], g->dcp ? g->dcp[r] : NULL, err)) {
            for (int k = 0; k < r; k++) lunar_model_free(g->rs[k].m);
            for (int k = 0; k < n; k++) {
                lunar_comm_free(g->comm[k]);
                if (g->dcp) lunar_comm_free(g->dcp[k]);
            }
            free(g->comm), free(g->dcp), free(g->rs), free(g);
            return -1;
        }
    pthread_barrier_init(&g->go, NULL, (unsigned)n + 1);
    pthread_barrier_init(&g->done, NULL, (unsigned)n + 1);
    g->args = lunar_xcalloc((size_t)n, sizeof *g->args);
    g->th = lunar_xcalloc((size_t)n, sizeof *g->th);
    for (int r = 0; r < n; r++) {
        g->args[r].g = g, g->args[r].rank = r;
        LUNAR_ASSERT(pthread_create(&g->th[r], NULL, rank_main, &g->args[r]) == 0);
    }
    *out = g;
    return 0;
}

void lunar_tp_group_free(lunar_tp_group *g) {
    if (!g) return;
    const int n = g->o.tp;
    g->kind = JOB_QUIT;
    pthread_barrier_wait(&g->go);
    for (int r = 0; r < n; r++) pthread_join(g->th[r], NULL);
    for (int r = 0; r < n; r++) {
        rank_state *s = &g->rs[r];
        if (s->have_pools) lunar_kv_pool_free(&s->kv), lunar_state_pool_free(&s->st);
        if (s->have_seq) lunar_seq_free(&s->seq);
        free(s->scratch);
        lunar_model_free(s->m);
        lunar_comm_free(g->comm[r]);
        if (g->dcp) lunar_comm_free(g->dcp[r]);
    }
    pthread_barrier_destroy(&g->go);
    pthread_barrier_destroy(&g->done);
    free(g->comm), free(g->dcp), free(g->rs), free(g->args), free(g->th), free(g);
}

const lunar_model *lunar_tp_group_rank_model(const lunar_tp_group *g, int rank) { return g->rs[rank].m; }

int lunar_tp_group_pools(lunar_tp_group *g, int n_blocks, lunar_kv_dtype dtype, int n_slots, int fp16,
                         lunar_err *err) {
    for (int r = 0; r < g->o.tp; r++) {
        rank_state *s = &g->rs[r];
        if (lunar_kv_pool_init_dcp(&s->kv, &s->m->cfg, n_blocks, dtype, g->o.dcp, err)) return -1;
        if (lunar_state_pool_init(&s->st, &s->m->cfg, n_slots, fp16, err)) {
            lunar_kv_pool_free(&s->kv);
            return -1;
        }
        s->have_pools = 1;
    }
    return 0;
}

/* Runs the posted job on every rank; the first failing rank's message. */
static int run_job(lunar_tp_group *g, lunar_err *err) {
    pthread_barrier_wait(&g->go);
    pthread_barrier_wait(&g->done);
    for (int r = 0; r < g->o.tp; r++)
        if (g->rs[r].rc) {
            if (err) *err = g->rs[r].err;
            return -1;
        }
    return 0;
}

int lunar_tp_group_forward_batch(lunar_tp_group *g, const lunar_batch_seq *seqs, int n_seqs,
                                 float *logits, lunar_err *err) {
    LUNAR_ASSERT(g->rs[0].have_pools);
    int rows = 0;
    for (int j = 0; j < n_seqs; j++)
        rows += seqs[j].logits == LUNAR_LOGITS_ALL ? seqs[j].n : seqs[j].logits == LUNAR_LOGITS_LAST;
    g->kind = JOB_BATCH, g->seqs = seqs, g->n_seqs = n_seqs, g->rows = rows, g->logits = logits;
    return run_job(g, err);
}

void lunar_tp_group_state_copy(lunar_tp_group *g, int to, int from) {
    for (int r = 0; r < g->o.tp; r++) lunar_state_copy(&g->rs[r].st, to, from);
}

void lunar_tp_group_state_clear(lunar_tp_group *g, int slot) {
    for (int r = 0; r < g->o.tp; r++) lunar_state_clear(&g->rs[r].st, slot);
}

int lunar_tp_group_seq_init(lunar_tp_group *g, int max_tokens, lunar_err *err) {
    for (int r = 0; r < g->o.tp; r++) {
        rank_state *s = &g->rs[r];
        if (s->have_seq) lunar_seq_free(&s->seq), s->have_seq = 0;
        if (lunar_seq_init(&s->seq, s->m, max_tokens, err)) return -1;
        s->have_seq = 1;
    }
    return 0;
}

int lunar_tp_group_forward(lunar_tp_group *g, const int32_t *ids, int n, float *logits, int all_logits,
                           lunar_err *err) {
    LUNAR_ASSERT(g->rs[0].have_seq);
    g->kind = JOB_SEQ, g->ids = ids, g->n = n, g->all_logits = all_logits, g->logits = logits;
    g->rows = all_logits ? n : 1;
    return run_job(g, err);
}
