/* Kimi-family forward, CPU reference. Pre-norm decoder (transformers KimiLinearDecoderLayer):
 *   x += Attn(RMSNorm(x));  x += FFN(RMSNorm(x));  logits = lm_head(RMSNorm(x))
 * with Attn = KDA or MLA per layer and FFN = dense SwiGLU or MoE per layer. */
#include "model/forward.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

/* Chunk length of the KDA chunked prefill (kda.md section 2; FLA's default). */
#define KDA_CHUNK 64
/* kv_a_layernorm and q_a_layernorm use the RMSNorm default eps of transformers' KimiLinear
 * (1e-6), not rms_norm_eps; every other norm uses rms_norm_eps. */
#define MLA_LATENT_NORM_EPS 1e-6f
/* L2 normalisation of KDA q and k: eps inside the sqrt, as FLA and transformers. */
#define KDA_L2_EPS 1e-6f

int lunar_seq_init(lunar_seq *s, const lunar_model *m, int max_tokens, lunar_err *err) {
    const lunar_config *c = &m->cfg;
    memset(s, 0, sizeof *s);
    if (max_tokens <= 0) return lunar_fail(err, "sequence capacity must be positive (got %d)", max_tokens);
    s->max_tokens = max_tokens;
    s->n_kda = c->n_kda_layers;
    s->n_mla = c->n_mla_layers;
    const size_t HD = (size_t)c->kda_num_heads * c->kda_head_dim;
    s->conv = lunar_xcalloc((size_t)s->n_kda + 1, sizeof *s->conv);
    s->kda = lunar_xcalloc((size_t)s->n_kda + 1, sizeof *s->kda);
    s->mla = lunar_xcalloc((size_t)s->n_mla + 1, sizeof *s->mla);
    for (int i = 0; i < s->n_kda; i++) {
        s->conv[i] = lunar_xcalloc(3 * HD * (size_t)(c->kda_conv_size - 1), sizeof(float));
        s->kda[i] = lunar_xcalloc(HD * (size_t)c->kda_head_dim, sizeof(float));
    }
    const size_t row = (size_t)c->kv_lora_rank + (size_t)c->qk_rope_head_dim;
    for (int i = 0; i < s->n_mla; i++) {
        s->mla[i] = calloc((size_t)max_tokens * row, sizeof(float));
        if (!s->mla[i]) {
            lunar_seq_free(s);
            return lunar_fail(err, "cannot allocate the MLA cache for %d tokens", max_tokens);
        }
    }
    return 0;
}

void lunar_seq_reset(lunar_seq *s, const lunar_model *m) {
    const lunar_config *c = &m->cfg;
    const size_t HD = (size_t)c->kda_num_heads * c->kda_head_dim;
    for (int i = 0; i < s->n_kda; i++) {
        memset(s->conv[i], 0, 3 * HD * (size_t)(c->kda_conv_size - 1) * sizeof(float));
        memset(s->kda[i], 0, HD * (size_t)c->kda_head_dim * sizeof(float));
    }
    s->pos = 0; /* the MLA rows past pos are never read */
}

void lunar_seq_free(lunar_seq *s) {
    for (int i = 0; i < s->n_kda; i++) {
        free(s->conv[i]);
        free(s->kda[i]);
    }
    for (int i = 0; i < s->n_mla; i++) free(s->mla[i]);
    free(s->conv);
    free(s->kda);
    free(s->mla);
    memset(s, 0, sizeof *s);
}

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Kimi Delta Attention layer (kda.md section 1.2); h: [n, D] normalised input, out: [n, D]. */
static void kda_layer(const lunar_config *c, const lunar_kda_weights *w, float *conv_state,
                      float *S, const float *h, int n, float *out) {
    const int H = c->kda_num_heads, dk = c->kda_head_dim, HD = H * dk, K = c->kda_conv_size;
    float *pre = lunar_xmalloc((size_t)n * HD * sizeof(float));   /* projection before conv */
    float *q = lunar_xmalloc((size_t)n * HD * sizeof(float));     /* [n, H, dk] */
    float *k = lunar_xmalloc((size_t)n * HD * sizeof(float));
    float *v = lunar_xmalloc((size_t)n * HD * sizeof(float));
    float *g = lunar_xmalloc((size_t)n * HD * sizeof(float));     /* log decay [n, H, dk] */
    float *low = lunar_xmalloc((size_t)n * dk * sizeof(float));   /* low-rank gate inputs */
    float *beta = lunar_xmalloc((size_t)n * H * sizeof(float));
    float *o = lunar_xmalloc((size_t)n * HD * sizeof(float));
    const size_t state_stride = (size_t)HD * (K - 1);

    /* q, k, v: projection, causal short conv + SiLU (each with its own conv state) */
    const lunar_tensor *proj[3] = {w->q_proj, w->k_proj, w->v_proj};
    const lunar_tensor *conv[3] = {w->q_conv, w->k_conv, w->v_conv};
    float *dst[3] = {q, k, v};
    for (int i = 0; i < 3; i++) {
        op_matmul(pre, h, proj[i], n);
        op_short_conv(dst[i], pre, conv[i], conv_state + i * state_stride, n, HD, K);
    }
    op_l2norm(q, q, n * H, dk, KDA_L2_EPS);
    op_l2norm(k, k, n * H, dk, KDA_L2_EPS);

    /* forget gate g (log space) and beta */
    op_matmul(low, h, w->f_a_proj, n);
    op_matmul(pre, low, w->f_b_proj, n);
    op_kda_gate(g, pre, w->A_log, w->dt_bias, n, H, dk, c->kda_gate_lower_bound);
    op_matmul(beta, h, w->b_proj, n);
    for (int i = 0; i < n * H; i++) beta[i] = sigmoidf(beta[i]);

    const float scale = 1.0f / sqrtf((float)dk);
    if (n == 1)
        op_kda_recurrent(o, q, k, v, g, beta, S, n, H, dk, dk, scale);
    else
        op_kda_chunked(o, q, k, v, g, beta, S, n, H, dk, dk, scale, KDA_CHUNK);

    /* output gate, per-head gated RMSNorm, o_proj */
    op_matmul(low, h, w->g_a_proj, n);
    op_matmul(pre, low, w->g_b_proj, n);
    op_rmsnorm_gated(o, o, pre, w->o_norm, n * H, dk, c->rms_norm_eps);
    op_matmul(out, o, w->o_proj, n);

    free(pre), free(q), free(k), free(v), free(g), free(low), free(beta), free(o);
}

/* Multi-head latent attention, NoPE (kda.md section 3); cache rows [0, pos+n) valid after. */
static void mla_layer(const lunar_config *c, const lunar_mla_weights *w, float *cache, int pos,
                      const float *h, int n, float *out) {
    const int nh = c->num_attention_heads, N = c->qk_nope_head_dim, P = c->qk_rope_head_dim,
              Vd = c->v_head_dim, R = c->kv_lora_rank, qk = N + P;
    float *q = lunar_xmalloc((size_t)n * nh * qk * sizeof(float));
    float *kv = lunar_xmalloc((size_t)n * (R + P) * sizeof(float));
    float *o = lunar_xmalloc((size_t)n * nh * Vd * sizeof(float));

    if (w->q_proj) {
        op_matmul(q, h, w->q_proj, n);
    } else {
        float *qa = lunar_xmalloc((size_t)n * c->q_lora_rank * sizeof(float));
        op_matmul(qa, h, w->q_a_proj, n);
        op_rmsnorm(qa, qa, w->q_a_norm, n, c->q_lora_rank, MLA_LATENT_NORM_EPS);
        op_matmul(q, qa, w->q_b_proj, n);
        free(qa);
    }
    /* latent row = [RMSNorm(c) | k_pe], appended to the cache */
    op_matmul(kv, h, w->kv_a_proj, n);
    for (int t = 0; t < n; t++) {
        float *row = cache + (size_t)(pos + t) * (R + P);
        op_rmsnorm(row, kv + (size_t)t * (R + P), w->kv_a_norm, 1, R, MLA_LATENT_NORM_EPS);
        memcpy(row + R, kv + (size_t)t * (R + P) + R, (size_t)P * sizeof(float));
    }
    const float scale = 1.0f / sqrtf((float)qk);
    /* decode: absorbed form (reads the latent once per head); prefill: naive form, cheaper per
     * (query, key) pair when many queries share the decompressed keys */
    if (n == 1)
        op_mla_attention_absorbed(o, q, cache, w->kv_b_proj, n, pos, nh, N, P, Vd, R, scale);
    else
        op_mla_attention_naive(o, q, cache, w->kv_b_proj, n, pos, nh, N, P, Vd, R, scale);
    op_matmul(out, o, w->o_proj, n);
    free(q), free(kv), free(o);
}

/* MoE: routed experts (sigmoid router with correction bias) plus shared experts. */
static void moe_layer(const lunar_config *c, const lunar_ffn_weights *w, const float *h, int n,
                      float *out) {
    const int D = c->hidden_size, E = c->num_experts, k = c->num_experts_per_token;
    float *logits = lunar_xmalloc((size_t)n * E * sizeof(float));
    int32_t *sel = lunar_xmalloc((size_t)n * k * sizeof(int32_t));
    float *wt = lunar_xmalloc((size_t)n * k * sizeof(float));
    op_matmul(logits, h, w->router, n);
    op_router_topk(sel, wt, logits, w->router_bias, n, E, k, c->num_expert_group, c->topk_group,
                   c->moe_renormalize, c->routed_scaling_factor);

    if (w->shared_gate)
        op_swiglu_mlp(out, h, w->shared_gate, w->shared_up, w->shared_down, n);
    else
        memset(out, 0, (size_t)n * D * sizeof(float));

    /* group the (token, slot) pairs by expert so each expert runs once over its tokens */
    float *xin = lunar_xmalloc((size_t)n * D * sizeof(float));
    float *xout = lunar_xmalloc((size_t)n * D * sizeof(float));
    int *tok = lunar_xmalloc((size_t)n * sizeof(int));
    float *tw = lunar_xmalloc((size_t)n * sizeof(float));
    for (int e = 0; e < E; e++) {
        int m = 0;
        for (int t = 0; t < n; t++)
            for (int j = 0; j < k; j++)
                if (sel[t * k + j] == e) {
                    tok[m] = t;
                    tw[m] = wt[t * k + j];
                    memcpy(xin + (size_t)m * D, h + (size_t)t * D, (size_t)D * sizeof(float));
                    m++;
                }
        if (!m) continue;
        const lunar_expert_weights *x = &w->experts[e];
        op_swiglu_mlp(xout, xin, x->w1, x->w3, x->w2, m);
        for (int i = 0; i < m; i++) {
            float *y = out + (size_t)tok[i] * D;
            const float *r = xout + (size_t)i * D;
            for (int d = 0; d < D; d++) y[d] += tw[i] * r[d];
        }
    }
    free(logits), free(sel), free(wt), free(xin), free(xout), free(tok), free(tw);
}

int lunar_forward(const lunar_model *m, lunar_seq *s, const int32_t *ids, int n, float *logits,
                  int all_logits, lunar_err *err) {
    const lunar_config *c = &m->cfg;
    const int D = c->hidden_size, V = c->vocab_size;
    if (n <= 0) return lunar_fail(err, "forward: no tokens");
    if (s->pos + n > s->max_tokens)
        return lunar_fail(err, "forward: %d + %d tokens exceed the sequence capacity of %d", s->pos,
                          n, s->max_tokens);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= V)
            return lunar_fail(err, "token id %d at position %d is outside the vocabulary [0, %d)",
                              ids[i], i, V);

    float *x = lunar_xmalloc((size_t)n * D * sizeof(float));   /* residual stream */
    float *h = lunar_xmalloc((size_t)n * D * sizeof(float));   /* normalised sub-layer input */
    float *y = lunar_xmalloc((size_t)n * D * sizeof(float));   /* sub-layer output */
    op_embedding(x, m->embed, ids, n);

    for (int l = 0; l < c->num_hidden_layers; l++) {
        const lunar_layer_weights *w = &m->layers[l];
        const int ki = m->kind_index[l];
        op_rmsnorm(h, x, w->attn_norm, n, D, c->rms_norm_eps);
        if (c->attn_kind[l] == LUNAR_ATTN_KDA)
            kda_layer(c, &w->kda, s->conv[ki], s->kda[ki], h, n, y);
        else
            mla_layer(c, &w->mla, s->mla[ki], s->pos, h, n, y);
        for (size_t i = 0; i < (size_t)n * D; i++) x[i] += y[i];

        op_rmsnorm(h, x, w->ffn_norm, n, D, c->rms_norm_eps);
        if (c->ffn_kind[l] == LUNAR_FFN_DENSE)
            op_swiglu_mlp(y, h, w->ffn.gate_proj, w->ffn.up_proj, w->ffn.down_proj, n);
        else
            moe_layer(c, &w->ffn, h, n, y);
        for (size_t i = 0; i < (size_t)n * D; i++) x[i] += y[i];
    }

    const int first = all_logits ? 0 : n - 1, rows = n - first;
    op_rmsnorm(h, x + (size_t)first * D, m->final_norm, rows, D, c->rms_norm_eps);
    op_matmul(logits, h, m->lm_head, rows);
    (void)V;
    s->pos += n;
    free(x), free(h), free(y);
    return 0;
}
