/* Physical floors of lunar bench: see bench_floor.h. */
#include "cli/bench_floor.h"

#include <math.h>
#include <string.h>

typedef struct acc {
    const lunar_model *m;
    lunar_weight_bytes *w;
    double experts; /* all routed experts' bytes */
} acc;

/* bytes of the tensor `name` as stored, or as BF16 when the set does not hold it; at the shape the
 * config implies, which is a rank's slice when the config is one rank's (lunar_config_tp_slice)
 * and the set the full model's: then the stored bytes per element times the slice's elements */
static double stored_bytes(const lunar_model *m, const char *name, int ndim, const int64_t *shape) {
    const lunar_tensor *t = m->st ? lunar_st_find(m->st, name) : NULL;
    double n = 1;
    for (int i = 0; i < ndim; i++) n *= (double)shape[i];
    const double tn = t ? (double)lunar_tensor_numel(t) : 0;
    if (t && tn > 0) return (double)t->nbytes * (n / tn);
    return 2 * n;
}

static void visit(void *ctx, const char *name, int ndim, const int64_t *shape) {
    acc *a = ctx;
    const double b = stored_bytes(a->m, name, ndim, shape);
    if (strstr(name, ".experts.")) a->experts += b;
    else if (strstr(name, "embed_tokens")) a->w->embed_row = b / (double)shape[0];
    else a->w->dense += b;
}

void lunar_weight_bytes_of(const lunar_model *m, lunar_weight_bytes *w) {
    memset(w, 0, sizeof *w);
    acc a = {m, w, 0};
    lunar_config_walk_tensors(&m->cfg, visit, &a);
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) w->n_moe += m->cfg.ffn_kind[l] == LUNAR_FFN_MOE;
    if (w->n_moe && m->cfg.num_experts) w->per_expert = a.experts / w->n_moe / m->cfg.num_experts;
    if (m->cfg.tie_word_embeddings) w->dense += w->embed_row * m->cfg.vocab_size; /* the head reads it all */
}

double lunar_experts_touched(int E, int k, int B) {
    if (E <= 0 || k <= 0) return 0;
    return E * (1.0 - pow(1.0 - (double)k / E, B));
}

double lunar_decode_bytes(const lunar_model *m, const lunar_weight_bytes *w, int B, int64_t ctx,
                          int kv_elem) {
    return lunar_decode_bytes_st(m, w, B, ctx, kv_elem, 4);
}

double lunar_decode_bytes_st(const lunar_model *m, const lunar_weight_bytes *w, int B, int64_t ctx, int kv_elem,
                             int state_elem) {
    return lunar_decode_bytes_dcp(m, w, B, ctx, kv_elem, state_elem, 1);
}

double lunar_decode_bytes_dcp(const lunar_model *m, const lunar_weight_bytes *w, int B, int64_t ctx, int kv_elem,
                              int state_elem, int dcp) {
    const lunar_config *c = &m->cfg;
    double bytes = w->dense + B * w->embed_row +
                   w->n_moe * lunar_experts_touched(c->num_experts, c->num_experts_per_token, B) * w->per_expert;
    const double row = (double)(c->kv_lora_rank + c->qk_rope_head_dim) * kv_elem;
    const int64_t len = ctx + 1; /* the new token attends to itself */
    double per_seq = 0;
    if (c->index_topk > 0) {
        const int64_t sel = len < c->index_topk ? len : c->index_topk;
        per_seq += c->n_mla_layers * ((double)((sel + dcp - 1) / dcp) * row + len * (c->index_head_dim + 4.0) +
                                      c->index_head_dim + 4.0);
    } else {
        per_seq += c->n_mla_layers * (double)((len + dcp - 1) / dcp) * row;
    }
    per_seq += c->n_mla_layers * row / dcp; /* the new latent row written (by one rank of dcp) */
    const double HD = (double)c->kda_num_heads * c->kda_head_dim;
    const double state = (double)c->kda_num_heads * c->kda_head_dim * c->kda_head_dim * state_elem;
    const double conv = 3 * HD * (c->kda_conv_size - 1) * 4;
    per_seq += c->n_kda_layers * 2 * (state + conv); /* read and write back */
    return bytes + B * per_seq;
}

double lunar_prefill_flops(const lunar_config *c, int64_t n) {
    lunar_param_counts p;
    lunar_config_count_params(c, &p);
    const double N = (double)n;
    double f = 2 * N * (double)(p.active - p.lm_head) + 2 * (double)p.lm_head;
    /* sum over query t of the keys it attends: all t+1, or min(t+1, topk) with DSA */
    double pairs = N * (N + 1) / 2;
    if (c->index_topk > 0) {
        const double K = c->index_topk;
        pairs = N <= K ? pairs : K * (K + 1) / 2 + (N - K) * K;
        f += c->n_mla_layers * 2.0 * c->index_n_heads * c->index_head_dim * (N * (N + 1) / 2);
    }
    const double qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
    f += c->n_mla_layers * 2.0 * c->num_attention_heads * (qk + c->v_head_dim) * pairs;
    /* KDA chunked, per token and head: q.S, the state update (2 dk dv) and half a chunk of
     * intra-chunk q.k and A.v terms */
    const double dk = c->kda_head_dim, C = 64;
    f += c->n_kda_layers * N * c->kda_num_heads * 2.0 * (3 * dk * dk + C / 2 * 2 * dk);
    return f;
}
