/* Per-rank shards of a loaded model (model/shard.h, docs/parallel.md). Row splits of a [out, in]
 * matrix (column-parallel linears: q/k/v/g, gate/up, lm_head, embedding rows) are views into the
 * mapped checkpoint; column splits (row-parallel linears: o_proj, down projections, the latent
 * up-projection) are copied once, in the checkpoint's dtype, so the forward's matmul reads them
 * like any other weight. */
#include "model/shard.h"

#include <stdlib.h>
#include <string.h>

#include "model/cache.h"
#include "model/dummy.h"
#include "ops.h"

void lunar_split(int64_t n, int parts, int part, int64_t gran, int64_t *off, int64_t *len) {
    LUNAR_ASSERT(parts >= 1 && part >= 0 && part < parts && gran >= 1 && n % gran == 0);
    const int64_t u = n / gran, a = part * u / parts, b = (part + 1) * u / parts;
    *off = a * gran;
    *len = (b - a) * gran;
}

int lunar_tp_check(const lunar_config *c, const lunar_tp_opts *o, lunar_err *err) {
    if (o->tp < 1 || o->tp > 1024) return lunar_fail(err, "--tensor-parallel-size %d: must be in [1, 1024]", o->tp);
    if (o->dcp < 1 || o->tp % o->dcp != 0)
        return lunar_fail(err, "--decode-context-parallel-size %d must divide --tensor-parallel-size %d "
                          "(DCP shards the latent cache inside the TP group)", o->dcp, o->tp);
    if (LUNAR_BLOCK_SIZE % o->dcp != 0)
        return lunar_fail(err, "--decode-context-parallel-size %d must divide the KV block size %d", o->dcp,
                          LUNAR_BLOCK_SIZE);
    if (o->dcp > 1 && c->n_mla_layers == 0)
        return lunar_fail(err, "--decode-context-parallel-size %d: the model has no MLA layer", o->dcp);
    if (c->experts_mxfp4 && c->moe_intermediate_size % 32 != 0)
        return lunar_fail(err, "MXFP4 experts: moe_intermediate_size %d is not a multiple of 32",
                          c->moe_intermediate_size);
    return 0;
}

/* ---------------------------------------------------------------- shard construction */

static void *own(lunar_tp *tp, size_t bytes) {
    if (tp->n_owned == tp->cap_owned) {
        tp->cap_owned = tp->cap_owned ? 2 * tp->cap_owned : 64;
        tp->owned = realloc(tp->owned, (size_t)tp->cap_owned * sizeof *tp->owned);
        LUNAR_ASSERT(tp->owned);
    }
    return tp->owned[tp->n_owned++] = lunar_xcalloc(1, bytes ? bytes : 1);
}

static lunar_tensor *new_tensor(lunar_tp *tp, const lunar_tensor *like) {
    if (tp->n_tensors == tp->cap_tensors) {
        tp->cap_tensors = tp->cap_tensors ? 2 * tp->cap_tensors : 64;
        tp->tensors = realloc(tp->tensors, (size_t)tp->cap_tensors * sizeof *tp->tensors);
        LUNAR_ASSERT(tp->tensors);
    }
    lunar_tensor *t = lunar_xmalloc(sizeof *t);
    *t = *like;
    return tp->tensors[tp->n_tensors++] = t;
}

/* A shard of a lazy dummy tensor (no host data; generated on the device at upload): a tensor of
 * shape `shape` with no data, registered as the window of t whose element (r, c) is element
 * base + r * ld + c of t (model/dummy.h). Without any host copy, a rank of a full-size dummy
 * model holds only its shards, and only on its device. */
static const lunar_tensor *lazy_window(lunar_tp *tp, const lunar_tensor *t, int ndim, const int64_t *shape,
                                       int64_t base, int64_t ld, int64_t cols) {
    lunar_tensor v = *t;
    v.ndim = ndim;
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= (v.shape[i] = shape[i]);
    v.data = NULL;
    v.nbytes = (size_t)n * lunar_dtype_size(t->dtype);
    const lunar_tensor *w = new_tensor(tp, &v);
    lunar_dummy_window(w, t, base, ld, cols);
    return w;
}

/* rows [r0, r0 + n) of t (a view) */
static const lunar_tensor *rows(lunar_tp *tp, const lunar_tensor *t, int64_t r0, int64_t n) {
    if (!t) return NULL;
    if (!t->data && lunar_dummy_is_lazy(t)) {
        LUNAR_ASSERT(r0 >= 0 && n >= 0 && r0 + n <= t->shape[0]);
        const int64_t row = t->shape[0] ? lunar_tensor_numel(t) / t->shape[0] : 0;
        int64_t shape[LUNAR_MAX_DIMS];
        memcpy(shape, t->shape, sizeof shape);
        shape[0] = n;
        return lazy_window(tp, t, t->ndim, shape, r0 * row, row, row);
    }
    lunar_tensor v = lunar_tensor_rows(t, r0, n);
    return new_tensor(tp, &v);
}

/* elements [e0, e0 + n) of t as a 1-D view (per-channel vectors stored in varying shapes) */
static const lunar_tensor *elems(lunar_tp *tp, const lunar_tensor *t, int64_t e0, int64_t n) {
    LUNAR_ASSERT(e0 >= 0 && e0 + n <= lunar_tensor_numel(t));
    if (!t->data && lunar_dummy_is_lazy(t)) return lazy_window(tp, t, 1, &n, e0, n, n);
    lunar_tensor v = *t;
    const size_t es = lunar_dtype_size(t->dtype);
    v.ndim = 1;
    v.shape[0] = n;
    v.data = (const uint8_t *)t->data + (size_t)e0 * es;
    v.nbytes = (size_t)n * es;
    return new_tensor(tp, &v);
}

/* columns [c0, c0 + n) of a 2-D t, copied (same dtype) */
static const lunar_tensor *cols(lunar_tp *tp, const lunar_tensor *t, int64_t c0, int64_t n) {
    if (!t) return NULL;
    LUNAR_ASSERT(t->ndim == 2 && c0 >= 0 && c0 + n <= t->shape[1]);
    if (!t->data && lunar_dummy_is_lazy(t)) {
        const int64_t shape[2] = {t->shape[0], n};
        return lazy_window(tp, t, 2, shape, c0, t->shape[1], n);
    }
    const size_t es = lunar_dtype_size(t->dtype), R = (size_t)t->shape[0], C = (size_t)t->shape[1];
    uint8_t *d = own(tp, R * (size_t)n * es);
    for (size_t r = 0; r < R; r++)
        memcpy(d + r * (size_t)n * es, (const uint8_t *)t->data + (r * C + (size_t)c0) * es, (size_t)n * es);
    lunar_tensor v = *t;
    v.shape[1] = n;
    v.data = d;
    v.nbytes = R * (size_t)n * es;
    return new_tensor(tp, &v);
}

/* MXFP4 [out, in]: output rows [r0, r0+n) (views) or input columns [c0, c0+n) (copies; c0 and n
 * multiples of 32, so whole bytes of codes and whole scale groups) */
static lunar_mxfp4 mx_rows(lunar_tp *tp, const lunar_mxfp4 *q, int64_t r0, int64_t n) {
    lunar_mxfp4 v = {rows(tp, q->packed, r0, n), rows(tp, q->scale, r0, n)};
    return v;
}
static lunar_mxfp4 mx_cols(lunar_tp *tp, const lunar_mxfp4 *q, int64_t c0, int64_t n) {
    LUNAR_ASSERT(c0 % 32 == 0 && n % 32 == 0);
    lunar_mxfp4 v = {cols(tp, q->packed, c0 / 2, n / 2), cols(tp, q->scale, c0 / 32, n / 32)};
    return v;
}

static void shard_kda(lunar_tp *tp, const lunar_config *c, lunar_kda_weights *w, int64_t h0, int64_t hn) {
    const int64_t dk = c->kda_head_dim, K = c->kda_conv_size;
    w->q_proj = rows(tp, w->q_proj, h0 * dk, hn * dk);
    w->k_proj = rows(tp, w->k_proj, h0 * dk, hn * dk);
    w->v_proj = rows(tp, w->v_proj, h0 * dk, hn * dk);
    w->q_conv = elems(tp, w->q_conv, h0 * dk * K, hn * dk * K);
    w->k_conv = elems(tp, w->k_conv, h0 * dk * K, hn * dk * K);
    w->v_conv = elems(tp, w->v_conv, h0 * dk * K, hn * dk * K);
    /* f_a_proj (the low-rank gate input) and o_norm (shared by heads) stay replicated */
    w->f_b_proj = rows(tp, w->f_b_proj, h0 * dk, hn * dk);
    w->dt_bias = elems(tp, w->dt_bias, h0 * dk, hn * dk);
    w->A_log = elems(tp, w->A_log, h0, hn);
    w->b_proj = rows(tp, w->b_proj, h0, hn);
    w->g_b_proj = rows(tp, w->g_b_proj, h0 * dk, hn * dk);
    w->g_proj = rows(tp, w->g_proj, h0 * dk, hn * dk);
    w->o_proj = cols(tp, w->o_proj, h0 * dk, hn * dk);
}

static void shard_mla(lunar_tp *tp, const lunar_config *c, lunar_mla_weights *w, int64_t h0, int64_t hn) {
    const int64_t qk = c->qk_nope_head_dim + c->qk_rope_head_dim, N = c->qk_nope_head_dim,
                  Vd = c->v_head_dim;
    /* q_a_proj, kv_a_proj_with_mqa and their norms are replicated: every head reads the same
     * latents, and the latent cache row is the same on every rank. The DSA indexer is replicated
     * too (it is small, and a global top-k on identical inputs selects the same tokens on every
     * rank, bitwise as a single GPU would). */
    w->q_proj = rows(tp, w->q_proj, h0 * qk, hn * qk);
    w->q_b_proj = rows(tp, w->q_b_proj, h0 * qk, hn * qk);
    w->kv_b_proj = rows(tp, w->kv_b_proj, h0 * (N + Vd), hn * (N + Vd));
    w->g_proj = rows(tp, w->g_proj, h0 * Vd, hn * Vd);
    w->o_proj = cols(tp, w->o_proj, h0 * Vd, hn * Vd);
}

static void shard_mlp(lunar_tp *tp, const lunar_tensor **gate, const lunar_tensor **up,
                      const lunar_tensor **down, int rank, int size) {
    if (!*gate) return;
    int64_t i0, in;
    lunar_split((*gate)->shape[0], size, rank, 1, &i0, &in);
    *gate = rows(tp, *gate, i0, in);
    *up = rows(tp, *up, i0, in);
    *down = cols(tp, *down, i0, in);
}

static void shard_ffn(lunar_tp *tp, const lunar_config *c, lunar_ffn_weights *w, int rank, int size) {
    shard_mlp(tp, &w->gate_proj, &w->up_proj, &w->down_proj, rank, size);
    shard_mlp(tp, &w->shared_gate, &w->shared_up, &w->shared_down, rank, size);
    if (!w->experts) return;
    /* router, bias, routed_expert_down_proj and routed_expert_norm are replicated: every rank
     * routes every token and feeds its experts the whole latent; the up-projection reads the
     * normalised latent by column slices (its partial sums join the shared experts' all-reduce) */
    if (w->latent_up) w->latent_up = cols(tp, w->latent_up, tp->lat0, tp->lat_n);
    const int E = c->num_experts;
    const lunar_expert_weights *src = w->experts;
    lunar_expert_weights *ex = own(tp, (size_t)E * sizeof *ex);
    int64_t i0, in;
    lunar_split(c->moe_intermediate_size, size, rank, c->experts_mxfp4 ? 32 : 1, &i0, &in);
    for (int e = 0; e < E; e++) {
        const lunar_expert_weights *s = &src[e];
        lunar_expert_weights *x = &ex[e];
        if (tp->ep) { /* whole experts, round-robin; the others stay NULL and are skipped */
            if (e % size == rank) *x = *s;
            continue;
        }
        if (c->experts_mxfp4) {
            x->q1 = mx_rows(tp, &s->q1, i0, in);
            x->q3 = mx_rows(tp, &s->q3, i0, in);
            x->q2 = mx_cols(tp, &s->q2, i0, in);
        } else {
            x->w1 = rows(tp, s->w1, i0, in);
            x->w3 = rows(tp, s->w3, i0, in);
            x->w2 = cols(tp, s->w2, i0, in);
        }
    }
    w->experts = ex;
}

int lunar_shard_model(lunar_model **out, const lunar_model *full, const lunar_tp_opts *o, int rank,
                      lunar_comm *comm, lunar_comm *dcp, lunar_err *err) {
    *out = NULL;
    const lunar_config *fc = &full->cfg;
    if (lunar_tp_check(fc, o, err)) return -1;
    LUNAR_ASSERT(rank >= 0 && rank < o->tp && comm && comm->size == o->tp && comm->rank == rank);
    LUNAR_ASSERT(o->dcp == 1 ? dcp == NULL : dcp && dcp->size == o->dcp && dcp->rank == rank % o->dcp);
    lunar_model *m = lunar_xmalloc(sizeof *m);
    *m = *full;
    lunar_tp *tp = lunar_xcalloc(1, sizeof *tp);
    m->tp = tp;
    m->layers = lunar_xcalloc((size_t)fc->num_hidden_layers, sizeof *m->layers);
    tp->rank = rank, tp->size = o->tp, tp->comm = comm, tp->ep = o->ep;
    tp->dcp_rank = rank % o->dcp, tp->dcp_size = o->dcp, tp->dcp = dcp;

    const int64_t V = fc->vocab_size;
    tp->vocab_chunk = (V + o->tp - 1) / o->tp; /* equal chunks (the last short) for the gather */
    tp->vocab0 = rank * tp->vocab_chunk < V ? rank * tp->vocab_chunk : V;
    tp->vocab_n = (tp->vocab0 + tp->vocab_chunk < V ? tp->vocab0 + tp->vocab_chunk : V) - tp->vocab0;
    m->embed = rows(tp, full->embed, tp->vocab0, tp->vocab_n);
    m->lm_head = rows(tp, full->lm_head, tp->vocab0, tp->vocab_n);
    int64_t a, n;
    if (fc->routed_expert_hidden_size) {
        lunar_split(fc->routed_expert_hidden_size, o->tp, rank, 1, &a, &n);
        tp->lat0 = (int)a, tp->lat_n = (int)n;
    }

    int64_t kh0 = 0, khn = 0, mh0 = 0, mhn = 0;
    if (fc->n_kda_layers) lunar_split(fc->kda_num_heads, o->tp, rank, 1, &kh0, &khn);
    if (fc->n_mla_layers) lunar_split(fc->num_attention_heads, o->tp, rank, 1, &mh0, &mhn);
    tp->dcp_heads = lunar_xcalloc((size_t)o->dcp, sizeof *tp->dcp_heads);
    for (int j = 0; j < o->dcp && fc->n_mla_layers; j++) {
        lunar_split(fc->num_attention_heads, o->tp, rank - tp->dcp_rank + j, 1, &a, &n);
        tp->dcp_heads[j] = (int)n;
        if (n > tp->mla_heads_max) tp->mla_heads_max = (int)n;
    }
    for (int l = 0; l < fc->num_hidden_layers; l++) {
        lunar_layer_weights *w = &m->layers[l];
        *w = full->layers[l]; /* norms and AttnRes vectors: replicated */
        if (fc->attn_kind[l] == LUNAR_ATTN_KDA)
            shard_kda(tp, fc, &w->kda, kh0, khn);
        else
            shard_mla(tp, fc, &w->mla, mh0, mhn);
        shard_ffn(tp, fc, &w->ffn, rank, o->tp);
    }
    m->cfg.kda_num_heads = (int)khn;
    m->cfg.num_attention_heads = (int)mhn;
    *out = m;
    return 0;
}

void lunar_shard_free(lunar_model *m) {
    if (!m) return;
    lunar_tp *tp = m->tp;
    for (int i = 0; i < tp->n_owned; i++) free(tp->owned[i]);
    for (int i = 0; i < tp->n_tensors; i++) {
        if (!tp->tensors[i]->data) lunar_dummy_window_forget(tp->tensors[i]); /* a lazy shard */
        free(tp->tensors[i]);
    }
    free(tp->owned), free(tp->tensors), free(tp->dcp_heads), free(tp);
    free(m->layers);
    free(m);
}

/* ---------------------------------------------------------------- forward hooks */

static void collective_failed(lunar_tp *tp, const lunar_err *e) {
    if (!tp->failed) tp->err = *e;
    tp->failed = 1;
}

void lunar_tp_all_reduce(const lunar_model *m, float *x, size_t n) {
    lunar_tp *tp = m->tp;
    lunar_err e;
    if (tp->size > 1 && lunar_all_reduce_sum(tp->comm, x, n, &e)) collective_failed(tp, &e);
}

void lunar_tp_embedding(const lunar_model *m, float *y, const int32_t *ids, int n) {
    const lunar_tp *tp = m->tp;
    const int D = m->cfg.hidden_size;
    for (int i = 0; i < n; i++) {
        float *yi = y + (size_t)i * D;
        const int64_t r = ids[i] - tp->vocab0;
        if (r >= 0 && r < tp->vocab_n) {
            int32_t local = (int32_t)r;
            op_embedding(yi, m->embed, &local, 1);
        } else {
            memset(yi, 0, (size_t)D * sizeof(float));
        }
    }
}

void lunar_tp_lm_head(const lunar_model *m, float *logits, const float *h, int rows_n) {
    lunar_tp *tp = m->tp;
    const int64_t V = m->cfg.vocab_size, C = tp->vocab_chunk;
    float *part = lunar_xcalloc((size_t)rows_n * C, sizeof(float));
    float *loc = lunar_xmalloc((size_t)rows_n * (tp->vocab_n ? tp->vocab_n : 1) * sizeof(float));
    op_matmul(loc, h, m->lm_head, rows_n);
    for (int r = 0; r < rows_n; r++)
        memcpy(part + (size_t)r * C, loc + (size_t)r * tp->vocab_n, (size_t)tp->vocab_n * sizeof(float));
    float *all = lunar_xmalloc((size_t)tp->size * rows_n * C * sizeof(float));
    lunar_err e;
    if (lunar_all_gather(tp->comm, part, all, (size_t)rows_n * C, &e)) collective_failed(tp, &e);
    /* [rank][row][chunk] -> [row][vocab] */
    for (int k = 0; k < tp->size; k++) {
        const int64_t v0 = k * C, vn = v0 + C <= V ? C : (v0 < V ? V - v0 : 0);
        for (int r = 0; r < rows_n; r++)
            memcpy(logits + (size_t)r * V + v0, all + ((size_t)k * rows_n + r) * C, (size_t)vn * sizeof(float));
    }
    free(part), free(loc), free(all);
}

void lunar_tp_latent_up(const lunar_model *m, const lunar_tensor *up, float *out, const float *y_lat,
                        int n, int Lat) {
    const lunar_tp *tp = m->tp;
    float *slice = lunar_xmalloc((size_t)n * (tp->lat_n ? tp->lat_n : 1) * sizeof(float));
    for (int t = 0; t < n; t++)
        memcpy(slice + (size_t)t * tp->lat_n, y_lat + (size_t)t * Lat + tp->lat0, (size_t)tp->lat_n * sizeof(float));
    if (m->cfg.ptpc_fp8) op_matmul_ptpc_fp8(out, slice, up, n); /* forward.c's lin() on the rank's slice */
    else op_matmul(out, slice, up, n);
    free(slice);
}
