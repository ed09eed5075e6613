/* Binding checkpoint tensors to the model's weight structs. One function walks every tensor the
 * config implies (name, shape, role); it either counts parameters (no checkpoint needed) or looks
 * each tensor up and checks its shape and dtype. Keeping a single walk means the names, the shape
 * checks and the parameter counts can never disagree. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "model/model.h"

typedef enum role {
    ROLE_EMBED,
    ROLE_LM_HEAD,
    ROLE_NORM,
    ROLE_ATTN,
    ROLE_DENSE_MLP,
    ROLE_SHARED,
    ROLE_ROUTED,
    ROLE_ROUTER
} role;

typedef struct binder {
    const lunar_st *st;        /* NULL: count only */
    lunar_param_counts *counts; /* may be NULL when binding */
    lunar_err *err;
    int failed;
    lunar_tensor_visitor visit; /* count mode: called for every tensor */
    void *visit_ctx;
} binder;

static int64_t *count_slot(lunar_param_counts *c, role r) {
    switch (r) {
    case ROLE_EMBED: return &c->embedding;
    case ROLE_LM_HEAD: return &c->lm_head;
    case ROLE_NORM: return &c->norms;
    case ROLE_ATTN: return &c->attention;
    case ROLE_DENSE_MLP: return &c->dense_mlp;
    case ROLE_SHARED: return &c->shared_experts;
    case ROLE_ROUTED: return &c->routed_experts;
    case ROLE_ROUTER: return &c->router;
    }
    return &c->norms;
}

static int is_float_dtype(lunar_dtype dt) {
    return dt == LUNAR_DTYPE_F32 || dt == LUNAR_DTYPE_BF16 || dt == LUNAR_DTYPE_F16;
}

/* Binds `name` (printf format) with the expected shape (ndim dims, then the format arguments).
 * flexible_numel: accept any shape with this many elements (checkpoints disagree on the
 * shape of a few vectors such as A_log [1,1,H,1] vs [H]). */
static const lunar_tensor *bindv(binder *b, role r, int64_t flexible_numel, int ndim,
                                 const int64_t *shape, const char *fmt, va_list ap) {
    char name[256];
    vsnprintf(name, sizeof name, fmt, ap);
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) numel *= shape[i];
    if (b->counts) *count_slot(b->counts, r) += numel;
    if (b->visit) b->visit(b->visit_ctx, name, ndim, shape);
    if (!b->st || b->failed) return NULL;

    const lunar_tensor *t = lunar_st_find(b->st, name);
    char want[96], got[96];
    if (!t) {
        b->failed = 1;
        lunar_fail(b->err, "checkpoint has no tensor '%s' (expected shape %s)", name,
                   lunar_shape_str(want, sizeof want, ndim, shape));
        return NULL;
    }
    int ok = 1;
    if (flexible_numel) {
        ok = lunar_tensor_numel(t) == flexible_numel;
    } else {
        ok = t->ndim == ndim;
        for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    }
    if (!ok) {
        b->failed = 1;
        lunar_fail(b->err, "%s: tensor '%s': expected shape %s, found %s", lunar_st_file_of(b->st, t),
                   name, lunar_shape_str(want, sizeof want, ndim, shape),
                   lunar_shape_str(got, sizeof got, t->ndim, t->shape));
        return NULL;
    }
    if (!is_float_dtype(t->dtype)) {
        b->failed = 1;
        lunar_fail(b->err, "%s: tensor '%s': dtype %s is not supported here (expected F32, BF16 or F16)",
                   lunar_st_file_of(b->st, t), name, lunar_dtype_name(t->dtype));
        return NULL;
    }
    return t;
}

static const lunar_tensor *bind1(binder *b, role r, int64_t d0, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int64_t shape[1] = {d0};
    const lunar_tensor *t = bindv(b, r, 0, 1, shape, fmt, ap);
    va_end(ap);
    return t;
}

static const lunar_tensor *bind2(binder *b, role r, int64_t d0, int64_t d1, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int64_t shape[2] = {d0, d1};
    const lunar_tensor *t = bindv(b, r, 0, 2, shape, fmt, ap);
    va_end(ap);
    return t;
}

/* A vector whose stored shape varies between checkpoints: only its element count is checked. */
static const lunar_tensor *bind_numel(binder *b, role r, int64_t numel, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int64_t shape[1] = {numel};
    const lunar_tensor *t = bindv(b, r, numel, 1, shape, fmt, ap);
    va_end(ap);
    return t;
}

static void bind_kda(binder *b, const lunar_config *c, int l, lunar_kda_weights *w) {
    const int64_t D = c->hidden_size, H = c->kda_num_heads, dk = c->kda_head_dim,
                  HD = H * dk, K = c->kda_conv_size;
    const char *p = "model.layers.%d.self_attn.";
    char f[128];
#define NAME(suffix) (snprintf(f, sizeof f, "%s%s", p, suffix), f)
    w->q_proj = bind2(b, ROLE_ATTN, HD, D, NAME("q_proj.weight"), l);
    w->k_proj = bind2(b, ROLE_ATTN, HD, D, NAME("k_proj.weight"), l);
    w->v_proj = bind2(b, ROLE_ATTN, HD, D, NAME("v_proj.weight"), l);
    w->q_conv = bind_numel(b, ROLE_ATTN, HD * K, NAME("q_conv1d.weight"), l);
    w->k_conv = bind_numel(b, ROLE_ATTN, HD * K, NAME("k_conv1d.weight"), l);
    w->v_conv = bind_numel(b, ROLE_ATTN, HD * K, NAME("v_conv1d.weight"), l);
    w->f_a_proj = bind2(b, ROLE_ATTN, dk, D, NAME("f_a_proj.weight"), l);
    w->f_b_proj = bind2(b, ROLE_ATTN, HD, dk, NAME("f_b_proj.weight"), l);
    w->dt_bias = bind_numel(b, ROLE_ATTN, HD, NAME("dt_bias"), l);
    w->A_log = bind_numel(b, ROLE_ATTN, H, NAME("A_log"), l);
    w->b_proj = bind2(b, ROLE_ATTN, H, D, NAME("b_proj.weight"), l);
    w->g_a_proj = bind2(b, ROLE_ATTN, dk, D, NAME("g_a_proj.weight"), l);
    w->g_b_proj = bind2(b, ROLE_ATTN, HD, dk, NAME("g_b_proj.weight"), l);
    w->o_norm = bind1(b, ROLE_NORM, dk, NAME("o_norm.weight"), l);
    w->o_proj = bind2(b, ROLE_ATTN, D, HD, NAME("o_proj.weight"), l);
#undef NAME
}

static void bind_mla(binder *b, const lunar_config *c, int l, lunar_mla_weights *w) {
    const int64_t D = c->hidden_size, nh = c->num_attention_heads,
                  qk = c->qk_nope_head_dim + c->qk_rope_head_dim, R = c->kv_lora_rank,
                  P = c->qk_rope_head_dim, Vd = c->v_head_dim, N = c->qk_nope_head_dim;
    if (c->q_lora_rank) {
        w->q_a_proj = bind2(b, ROLE_ATTN, c->q_lora_rank, D, "model.layers.%d.self_attn.q_a_proj.weight", l);
        w->q_a_norm = bind1(b, ROLE_NORM, c->q_lora_rank, "model.layers.%d.self_attn.q_a_layernorm.weight", l);
        w->q_b_proj = bind2(b, ROLE_ATTN, nh * qk, c->q_lora_rank, "model.layers.%d.self_attn.q_b_proj.weight", l);
    } else {
        w->q_proj = bind2(b, ROLE_ATTN, nh * qk, D, "model.layers.%d.self_attn.q_proj.weight", l);
    }
    w->kv_a_proj = bind2(b, ROLE_ATTN, R + P, D, "model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", l);
    w->kv_a_norm = bind1(b, ROLE_NORM, R, "model.layers.%d.self_attn.kv_a_layernorm.weight", l);
    w->kv_b_proj = bind2(b, ROLE_ATTN, nh * (N + Vd), R, "model.layers.%d.self_attn.kv_b_proj.weight", l);
    w->o_proj = bind2(b, ROLE_ATTN, D, nh * Vd, "model.layers.%d.self_attn.o_proj.weight", l);
}

static void bind_ffn(binder *b, const lunar_config *c, int l, lunar_ffn_weights *w) {
    const int64_t D = c->hidden_size;
    if (c->ffn_kind[l] == LUNAR_FFN_DENSE) {
        const int64_t I = c->intermediate_size;
        w->gate_proj = bind2(b, ROLE_DENSE_MLP, I, D, "model.layers.%d.mlp.gate_proj.weight", l);
        w->up_proj = bind2(b, ROLE_DENSE_MLP, I, D, "model.layers.%d.mlp.up_proj.weight", l);
        w->down_proj = bind2(b, ROLE_DENSE_MLP, D, I, "model.layers.%d.mlp.down_proj.weight", l);
        return;
    }
    const int64_t E = c->num_experts, I = c->moe_intermediate_size;
    const char *p = "model.layers.%d.block_sparse_moe.";
    char f[160];
#define NAME(suffix) (snprintf(f, sizeof f, "%s%s", p, suffix), f)
    w->router = bind2(b, ROLE_ROUTER, E, D, NAME("gate.weight"), l);
    w->router_bias = bind1(b, ROLE_ROUTER, E, NAME("gate.e_score_correction_bias"), l);
    if (b->st && !w->experts) w->experts = lunar_xcalloc((size_t)E, sizeof *w->experts);
    for (int e = 0; e < E; e++) {
        lunar_expert_weights dummy, *x = w->experts ? &w->experts[e] : &dummy;
        x->w1 = bind2(b, ROLE_ROUTED, I, D, NAME("experts.%d.w1.weight"), l, e);
        x->w3 = bind2(b, ROLE_ROUTED, I, D, NAME("experts.%d.w3.weight"), l, e);
        x->w2 = bind2(b, ROLE_ROUTED, D, I, NAME("experts.%d.w2.weight"), l, e);
    }
    if (c->num_shared_experts > 0) {
        const int64_t S = I * c->num_shared_experts;
        w->shared_gate = bind2(b, ROLE_SHARED, S, D, NAME("shared_experts.gate_proj.weight"), l);
        w->shared_up = bind2(b, ROLE_SHARED, S, D, NAME("shared_experts.up_proj.weight"), l);
        w->shared_down = bind2(b, ROLE_SHARED, D, S, NAME("shared_experts.down_proj.weight"), l);
    }
#undef NAME
}

/* Walks every tensor of the model. m may be NULL in count mode. */
static void walk(binder *b, const lunar_config *c, lunar_model *m) {
    lunar_model dummy_model;
    lunar_layer_weights dummy_layer;
    if (!m) {
        memset(&dummy_model, 0, sizeof dummy_model);
        m = &dummy_model;
    }
    const int64_t V = c->vocab_size, D = c->hidden_size;
    m->embed = bind2(b, ROLE_EMBED, V, D, "model.embed_tokens.weight");
    for (int l = 0; l < c->num_hidden_layers; l++) {
        lunar_layer_weights *w = m->layers ? &m->layers[l] : &dummy_layer;
        if (!m->layers) memset(w, 0, sizeof *w);
        w->attn_norm = bind1(b, ROLE_NORM, D, "model.layers.%d.input_layernorm.weight", l);
        w->ffn_norm = bind1(b, ROLE_NORM, D, "model.layers.%d.post_attention_layernorm.weight", l);
        if (c->attn_kind[l] == LUNAR_ATTN_KDA)
            bind_kda(b, c, l, &w->kda);
        else
            bind_mla(b, c, l, &w->mla);
        bind_ffn(b, c, l, &w->ffn);
    }
    m->final_norm = bind1(b, ROLE_NORM, D, "model.norm.weight");
    if (c->tie_word_embeddings)
        m->lm_head = m->embed;
    else
        m->lm_head = bind2(b, ROLE_LM_HEAD, V, D, "lm_head.weight");
}

void lunar_config_count_params(const lunar_config *cfg, lunar_param_counts *out) {
    memset(out, 0, sizeof *out);
    binder b = {.st = NULL, .counts = out};
    walk(&b, cfg, NULL);
    out->total = out->embedding + out->lm_head + out->attention + out->dense_mlp +
                 out->shared_experts + out->routed_experts + out->router + out->norms;
    int n_moe = 0;
    for (int l = 0; l < cfg->num_hidden_layers; l++) n_moe += cfg->ffn_kind[l] == LUNAR_FFN_MOE;
    int64_t per_expert = 3 * (int64_t)cfg->hidden_size * cfg->moe_intermediate_size;
    out->routed_per_layer_active = per_expert * cfg->num_experts_per_token;
    /* Active = the weights one token's forward multiplies with: every routed expert is replaced
     * by the top-k it uses, and the input embedding, a row lookup, is left out (as model cards
     * count "activated parameters"; Kimi-Linear-48B-A3B comes to 3.1 B this way). */
    out->active = out->total - out->embedding - out->routed_experts +
                  (int64_t)n_moe * out->routed_per_layer_active;
}

void lunar_config_walk_tensors(const lunar_config *cfg, lunar_tensor_visitor visit, void *ctx) {
    lunar_param_counts counts;
    memset(&counts, 0, sizeof counts);
    binder b = {.st = NULL, .counts = &counts, .visit = visit, .visit_ctx = ctx};
    walk(&b, cfg, NULL);
}

int lunar_model_load(lunar_model **out, const char *dir, lunar_err *err) {
    *out = NULL;
    lunar_model *m = lunar_xcalloc(1, sizeof *m);
    snprintf(m->dir, sizeof m->dir, "%s", dir);
    char path[1100];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (lunar_config_load(&m->cfg, path, err) != 0) goto fail;
    if (lunar_st_open(&m->st, dir, err) != 0) goto fail;
    m->layers = lunar_xcalloc((size_t)m->cfg.num_hidden_layers, sizeof *m->layers);
    int n_kda = 0, n_mla = 0;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++)
        m->kind_index[l] = m->cfg.attn_kind[l] == LUNAR_ATTN_KDA ? n_kda++ : n_mla++;
    binder b = {.st = m->st, .err = err};
    walk(&b, &m->cfg, m);
    if (b.failed) {
        lunar_fail_prefix(err, "%s: ", dir);
        goto fail;
    }
    *out = m;
    return 0;
fail:
    lunar_model_free(m);
    return -1;
}

void lunar_model_free(lunar_model *m) {
    if (!m) return;
    if (m->layers)
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) free(m->layers[l].ffn.experts);
    free(m->layers);
    lunar_st_close(m->st);
    free(m);
}
