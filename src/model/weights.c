/* Binding checkpoint tensors to the model's weight structs. One function walks every tensor the
 * config implies (name, shape, role); it either counts parameters (no checkpoint needed) or looks
 * each tensor up and checks its shape and dtype. Keeping a single walk means the names, the shape
 * checks and the parameter counts can never disagree.
 *
 * Names are written here without their prefix: the text model's tensors ("layers.3.self_attn...",
 * "embed_tokens.weight") live under "model." in Kimi-Linear checkpoints and under
 * "language_model.model." in K3 ones (vLLM also accepts "language_model."); the head is
 * "lm_head.weight" or "language_model.lm_head.weight". */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "model/dummy.h"
#include "model/model.h"
#include "model/shard.h"

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

/* What a tensor may be stored as. */
typedef enum kind { KIND_FLOAT, KIND_U8 } kind;

typedef struct binder {
    const lunar_st *st;         /* NULL: count only */
    const lunar_config *cfg;
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

/* The spellings a tensor may have in a checkpoint, most common first. */
static int name_candidates(const binder *b, role r, const char *name, char out[2][256]) {
    const int k3 = b->cfg->arch == LUNAR_ARCH_KIMI_K3;
    if (r == ROLE_LM_HEAD) {
        snprintf(out[0], 256, "%s%s", k3 ? "language_model." : "", name);
        return 1;
    }
    snprintf(out[0], 256, "%s%s", k3 ? "language_model.model." : "model.", name);
    if (!k3) return 1;
    snprintf(out[1], 256, "language_model.%s", name);
    return 2;
}

/* Binds the tensor called `base` (without prefix) with the expected shape. flexible: accept any
 * shape whose element count lies in [shape[0], flexible] (1-D vectors stored as [1,1,H,1] or
 * padded, like A_log). count_as: parameters it adds to the counts. */
static const lunar_tensor *bind_named(binder *b, role r, kind k, int64_t flexible, int ndim,
                                      const int64_t *shape, int64_t count_as, const char *base) {
    char names[2][256];
    int n_names = name_candidates(b, r, base, names);
    if (b->counts) *count_slot(b->counts, r) += count_as;
    if (b->visit) b->visit(b->visit_ctx, names[0], ndim, shape);
    if (!b->st || b->failed) return NULL;

    const lunar_tensor *t = NULL;
    for (int i = 0; i < n_names && !t; i++) t = lunar_st_find(b->st, names[i]);
    char want[96], got[96];
    if (!t) {
        b->failed = 1;
        lunar_fail(b->err, "checkpoint has no tensor '%s' (expected shape %s)", names[0],
                   lunar_shape_str(want, sizeof want, ndim, shape));
        return NULL;
    }
    int ok = 1;
    if (flexible) {
        int64_t numel = lunar_tensor_numel(t);
        ok = numel >= shape[0] && numel <= flexible;
    } else {
        ok = t->ndim == ndim;
        for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    }
    if (!ok) {
        b->failed = 1;
        lunar_fail(b->err, "%s: tensor '%s': expected shape %s, found %s", lunar_st_file_of(b->st, t),
                   t->name, lunar_shape_str(want, sizeof want, ndim, shape),
                   lunar_shape_str(got, sizeof got, t->ndim, t->shape));
        return NULL;
    }
    if (k == KIND_FLOAT ? !is_float_dtype(t->dtype) : t->dtype != LUNAR_DTYPE_U8) {
        b->failed = 1;
        lunar_fail(b->err, "%s: tensor '%s': dtype %s is not supported here (expected %s)",
                   lunar_st_file_of(b->st, t), t->name, lunar_dtype_name(t->dtype),
                   k == KIND_FLOAT ? "F32, BF16 or F16" : "U8");
        return NULL;
    }
    return t;
}

#define FORMAT_NAME(base, fmt)                       \
    char base[200];                                  \
    do {                                             \
        va_list ap;                                  \
        va_start(ap, fmt);                           \
        vsnprintf(base, sizeof base, fmt, ap);       \
        va_end(ap);                                  \
    } while (0)

static const lunar_tensor *bind1(binder *b, role r, int64_t d0, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static const lunar_tensor *bind1(binder *b, role r, int64_t d0, const char *fmt, ...) {
    FORMAT_NAME(base, fmt);
    int64_t shape[1] = {d0};
    return bind_named(b, r, KIND_FLOAT, 0, 1, shape, d0, base);
}

static const lunar_tensor *bind2(binder *b, role r, int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static const lunar_tensor *bind2(binder *b, role r, int64_t d0, int64_t d1, const char *fmt, ...) {
    FORMAT_NAME(base, fmt);
    int64_t shape[2] = {d0, d1};
    return bind_named(b, r, KIND_FLOAT, 0, 2, shape, d0 * d1, base);
}

/* A vector whose stored shape varies between checkpoints: only its element count is checked,
 * between numel and max_numel (K3's A_log holds 96 per-head values padded to 128). */
static const lunar_tensor *bind_numel(binder *b, role r, int64_t numel, int64_t max_numel,
                                      const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static const lunar_tensor *bind_numel(binder *b, role r, int64_t numel, int64_t max_numel,
                                      const char *fmt, ...) {
    FORMAT_NAME(base, fmt);
    int64_t shape[1] = {numel};
    return bind_named(b, r, KIND_FLOAT, max_numel, 1, shape, numel, base);
}

/* An MXFP4 matrix of logical shape [out, in] (compressed-tensors): NAME.weight_packed
 * [out, in/2] and NAME.weight_scale [out, in/32], both U8; counted as out*in parameters. */
static lunar_mxfp4 bind_mxfp4(binder *b, role r, int64_t out, int64_t in, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static lunar_mxfp4 bind_mxfp4(binder *b, role r, int64_t out, int64_t in, const char *fmt, ...) {
    FORMAT_NAME(base, fmt);
    char name[240];
    lunar_mxfp4 q;
    int64_t packed[2] = {out, in / 2}, scale[2] = {out, in / 32};
    snprintf(name, sizeof name, "%s.weight_packed", base);
    q.packed = bind_named(b, r, KIND_U8, 0, 2, packed, out * in, name);
    snprintf(name, sizeof name, "%s.weight_scale", base);
    q.scale = bind_named(b, r, KIND_U8, 0, 2, scale, 0, name);
    if (q.packed && q.scale && lunar_mxfp4_validate(&q, base, b->err) != 0) b->failed = 1;
    return q;
}

/* Smallest multiple of 128 holding n: checkpoints pad per-head vectors to it (K3: 96 -> 128). */
static int64_t pad128(int64_t n) { return (n + 127) / 128 * 128; }

static void bind_kda(binder *b, const lunar_config *c, int l, lunar_kda_weights *w) {
    const int64_t D = c->hidden_size, H = c->kda_num_heads, dk = c->kda_head_dim,
                  HD = H * dk, K = c->kda_conv_size;
#define A(suffix) "layers.%d.self_attn." suffix, l
    w->q_proj = bind2(b, ROLE_ATTN, HD, D, A("q_proj.weight"));
    w->k_proj = bind2(b, ROLE_ATTN, HD, D, A("k_proj.weight"));
    w->v_proj = bind2(b, ROLE_ATTN, HD, D, A("v_proj.weight"));
    w->q_conv = bind_numel(b, ROLE_ATTN, HD * K, HD * K, A("q_conv1d.weight"));
    w->k_conv = bind_numel(b, ROLE_ATTN, HD * K, HD * K, A("k_conv1d.weight"));
    w->v_conv = bind_numel(b, ROLE_ATTN, HD * K, HD * K, A("v_conv1d.weight"));
    w->f_a_proj = bind2(b, ROLE_ATTN, dk, D, A("f_a_proj.weight"));
    w->f_b_proj = bind2(b, ROLE_ATTN, HD, dk, A("f_b_proj.weight"));
    w->dt_bias = bind_numel(b, ROLE_ATTN, HD, HD, A("dt_bias"));
    w->A_log = bind_numel(b, ROLE_ATTN, H, pad128(H), A("A_log"));
    w->b_proj = bind2(b, ROLE_ATTN, H, D, A("b_proj.weight"));
    if (c->kda_full_rank_gate) {
        w->g_proj = bind2(b, ROLE_ATTN, HD, D, A("g_proj.weight"));
    } else {
        w->g_a_proj = bind2(b, ROLE_ATTN, dk, D, A("g_a_proj.weight"));
        w->g_b_proj = bind2(b, ROLE_ATTN, HD, dk, A("g_b_proj.weight"));
    }
    w->o_norm = bind1(b, ROLE_NORM, dk, A("o_norm.weight"));
    w->o_proj = bind2(b, ROLE_ATTN, D, HD, A("o_proj.weight"));
}

static void bind_mla(binder *b, const lunar_config *c, int l, lunar_mla_weights *w) {
    const int64_t D = c->hidden_size, nh = c->num_attention_heads,
                  qk = c->qk_nope_head_dim + c->qk_rope_head_dim, R = c->kv_lora_rank,
                  P = c->qk_rope_head_dim, Vd = c->v_head_dim, N = c->qk_nope_head_dim,
                  Q = c->q_lora_rank;
    if (Q) {
        w->q_a_proj = bind2(b, ROLE_ATTN, Q, D, A("q_a_proj.weight"));
        w->q_a_norm = bind1(b, ROLE_NORM, Q, A("q_a_layernorm.weight"));
        w->q_b_proj = bind2(b, ROLE_ATTN, nh * qk, Q, A("q_b_proj.weight"));
    } else {
        w->q_proj = bind2(b, ROLE_ATTN, nh * qk, D, A("q_proj.weight"));
    }
    w->kv_a_proj = bind2(b, ROLE_ATTN, R + P, D, A("kv_a_proj_with_mqa.weight"));
    w->kv_a_norm = bind1(b, ROLE_NORM, R, A("kv_a_layernorm.weight"));
    w->kv_b_proj = bind2(b, ROLE_ATTN, nh * (N + Vd), R, A("kv_b_proj.weight"));
    if (c->mla_use_output_gate) w->g_proj = bind2(b, ROLE_ATTN, nh * Vd, D, A("g_proj.weight"));
    w->o_proj = bind2(b, ROLE_ATTN, D, nh * Vd, A("o_proj.weight"));
    if (c->index_topk > 0) {
        const int64_t ni = c->index_n_heads, di = c->index_head_dim;
        w->idx_wq_b = bind2(b, ROLE_ATTN, ni * di, Q, A("indexer.wq_b.weight"));
        w->idx_wk = bind2(b, ROLE_ATTN, di, D, A("indexer.wk.weight"));
        w->idx_k_norm_w = bind1(b, ROLE_NORM, di, A("indexer.k_norm.weight"));
        w->idx_k_norm_b = bind1(b, ROLE_NORM, di, A("indexer.k_norm.bias"));
        w->idx_weights_proj = bind2(b, ROLE_ATTN, ni, D, A("indexer.weights_proj.weight"));
    }
#undef A
}

static void bind_ffn(binder *b, const lunar_config *c, int l, lunar_ffn_weights *w) {
    const int64_t D = c->hidden_size;
    if (c->ffn_kind[l] == LUNAR_FFN_DENSE) {
        const int64_t I = c->intermediate_size;
        w->gate_proj = bind2(b, ROLE_DENSE_MLP, I, D, "layers.%d.mlp.gate_proj.weight", l);
        w->up_proj = bind2(b, ROLE_DENSE_MLP, I, D, "layers.%d.mlp.up_proj.weight", l);
        w->down_proj = bind2(b, ROLE_DENSE_MLP, D, I, "layers.%d.mlp.down_proj.weight", l);
        return;
    }
    const int64_t E = c->num_experts, I = c->moe_intermediate_size,
                  Lat = c->routed_expert_hidden_size, De = Lat ? Lat : D;
#define M(suffix) "layers.%d.block_sparse_moe." suffix, l
    w->router = bind2(b, ROLE_ROUTER, E, D, M("gate.weight"));
    w->router_bias = bind1(b, ROLE_ROUTER, E, M("gate.e_score_correction_bias"));
    if (Lat) {
        w->latent_down = bind2(b, ROLE_ROUTER, Lat, D, M("routed_expert_down_proj.weight"));
        if (c->latent_moe_use_norm)
            w->latent_norm = bind1(b, ROLE_NORM, Lat, M("routed_expert_norm.weight"));
        w->latent_up = bind2(b, ROLE_ROUTER, D, Lat, M("routed_expert_up_proj.weight"));
    }
    if (b->st && !w->experts) w->experts = lunar_xcalloc((size_t)E, sizeof *w->experts);
    for (int e = 0; e < E; e++) {
        lunar_expert_weights dummy, *x = w->experts ? &w->experts[e] : &dummy;
        if (c->experts_mxfp4) {
            x->q1 = bind_mxfp4(b, ROLE_ROUTED, I, De, M("experts.%d.w1"), e);
            x->q3 = bind_mxfp4(b, ROLE_ROUTED, I, De, M("experts.%d.w3"), e);
            x->q2 = bind_mxfp4(b, ROLE_ROUTED, De, I, M("experts.%d.w2"), e);
        } else {
            x->w1 = bind2(b, ROLE_ROUTED, I, De, M("experts.%d.w1.weight"), e);
            x->w3 = bind2(b, ROLE_ROUTED, I, De, M("experts.%d.w3.weight"), e);
            x->w2 = bind2(b, ROLE_ROUTED, De, I, M("experts.%d.w2.weight"), e);
        }
    }
    if (c->num_shared_experts > 0) {
        const int64_t S = I * c->num_shared_experts;
        w->shared_gate = bind2(b, ROLE_SHARED, S, D, M("shared_experts.gate_proj.weight"));
        w->shared_up = bind2(b, ROLE_SHARED, S, D, M("shared_experts.up_proj.weight"));
        w->shared_down = bind2(b, ROLE_SHARED, D, S, M("shared_experts.down_proj.weight"));
    }
#undef M
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
    const int attn_res = c->attn_res_block_size > 0;
    m->embed = bind2(b, ROLE_EMBED, V, D, "embed_tokens.weight");
    for (int l = 0; l < c->num_hidden_layers; l++) {
        lunar_layer_weights *w = m->layers ? &m->layers[l] : &dummy_layer;
        if (!m->layers) memset(w, 0, sizeof *w);
        w->attn_norm = bind1(b, ROLE_NORM, D, "layers.%d.input_layernorm.weight", l);
        w->ffn_norm = bind1(b, ROLE_NORM, D, "layers.%d.post_attention_layernorm.weight", l);
        if (attn_res) {
            w->attn_res_norm = bind1(b, ROLE_NORM, D, "layers.%d.self_attention_res_norm.weight", l);
            w->attn_res_proj = bind2(b, ROLE_NORM, 1, D, "layers.%d.self_attention_res_proj.weight", l);
            w->mlp_res_norm = bind1(b, ROLE_NORM, D, "layers.%d.mlp_res_norm.weight", l);
            w->mlp_res_proj = bind2(b, ROLE_NORM, 1, D, "layers.%d.mlp_res_proj.weight", l);
        }
        if (c->attn_kind[l] == LUNAR_ATTN_KDA)
            bind_kda(b, c, l, &w->kda);
        else
            bind_mla(b, c, l, &w->mla);
        bind_ffn(b, c, l, &w->ffn);
    }
    m->final_norm = bind1(b, ROLE_NORM, D, "norm.weight");
    if (attn_res) {
        m->out_res_norm = bind1(b, ROLE_NORM, D, "output_attn_res_norm.weight");
        m->out_res_proj = bind2(b, ROLE_NORM, 1, D, "output_attn_res_proj.weight");
    }
    if (c->tie_word_embeddings)
        m->lm_head = m->embed;
    else
        m->lm_head = bind2(b, ROLE_LM_HEAD, V, D, "lm_head.weight");
}

void lunar_config_count_params(const lunar_config *cfg, lunar_param_counts *out) {
    memset(out, 0, sizeof *out);
    binder b = {.st = NULL, .cfg = cfg, .counts = out};
    walk(&b, cfg, NULL);
    out->total = out->embedding + out->lm_head + out->attention + out->dense_mlp +
                 out->shared_experts + out->routed_experts + out->router + out->norms;
    int n_moe = 0;
    for (int l = 0; l < cfg->num_hidden_layers; l++) n_moe += cfg->ffn_kind[l] == LUNAR_FFN_MOE;
    const int64_t De = cfg->routed_expert_hidden_size ? cfg->routed_expert_hidden_size : cfg->hidden_size;
    int64_t per_expert = 3 * De * cfg->moe_intermediate_size;
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
    binder b = {.st = NULL, .cfg = cfg, .counts = &counts, .visit = visit, .visit_ctx = ctx};
    walk(&b, cfg, NULL);
}

int lunar_model_load(lunar_model **out, const char *dir, lunar_err *err) {
    return lunar_model_load_ex(out, dir, NULL, err);
}

int lunar_model_load_ex(lunar_model **out, const char *path, const lunar_load_options *o, lunar_err *err) {
    *out = NULL;
    lunar_load_options none;
    memset(&none, 0, sizeof none);
    if (!o) o = &none;
    const char *fmt = o->load_format ? o->load_format : "auto";
    const int dummy = strcmp(fmt, "dummy") == 0;
    if (!dummy && strcmp(fmt, "auto") != 0 && strcmp(fmt, "safetensors") != 0)
        return lunar_fail(err, "--load-format: '%s' is not one of auto, safetensors, dummy", fmt);
    lunar_model *m = lunar_xcalloc(1, sizeof *m);
    m->load = *o;
    m->load.load_format = dummy ? "dummy" : NULL; /* not the caller's string: it may not outlive m */
    char cfg_path[sizeof m->dir];
    if (dummy) {
        lunar_config_path(path, cfg_path, sizeof cfg_path);
        snprintf(m->dir, sizeof m->dir, "%s", cfg_path);
        char *slash = strrchr(m->dir, '/');
        if (slash) *slash = 0;
        else snprintf(m->dir, sizeof m->dir, ".");
    } else {
        snprintf(m->dir, sizeof m->dir, "%s", path);
        snprintf(cfg_path, sizeof cfg_path, "%s/config.json", path);
    }
    if (lunar_config_load(&m->cfg, cfg_path, err) != 0) goto fail;
    if (o->tp_slice > 1 && lunar_config_tp_slice(&m->cfg, o->tp_slice, err)) goto fail;
    if (o->num_layers > 0 && lunar_config_truncate_layers(&m->cfg, o->num_layers, err)) goto fail;
    m->cfg.ptpc_fp8 = o->ptpc_fp8 != 0; /* both forwards read it from the config they are handed */
    if (dummy ? lunar_dummy_build(&m->st, &m->cfg, o->seed, o->device_lazy, err)
              : lunar_st_open(&m->st, path, err))
        goto fail;
    m->layers = lunar_xcalloc((size_t)m->cfg.num_hidden_layers, sizeof *m->layers);
    int n_kda = 0, n_mla = 0;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++)
        m->kind_index[l] = m->cfg.attn_kind[l] == LUNAR_ATTN_KDA ? n_kda++ : n_mla++;
    binder b = {.st = m->st, .cfg = &m->cfg, .err = err};
    walk(&b, &m->cfg, m);
    if (b.failed) {
        lunar_fail_prefix(err, "%s: ", path);
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
    if (m->tp) { /* a rank's shards of a model that owns the checkpoint */
        lunar_shard_free(m);
        return;
    }
    if (m->layers)
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) free(m->layers[l].ffn.experts);
    free(m->layers);
    if (m->st && m->load.load_format) lunar_dummy_forget(m->st);
    lunar_st_close(m->st);
    free(m);
}
