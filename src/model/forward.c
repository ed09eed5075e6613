/* Kimi-family forward, CPU reference.
 * Kimi-Linear: pre-norm decoder (transformers KimiLinearDecoderLayer)
 *   x += Attn(RMSNorm(x));  x += FFN(RMSNorm(x));  logits = lm_head(RMSNorm(x))
 * Kimi-K3 (attn_res_block_size > 0): Attention Residuals (k3_spec 3) replace the residual stream:
 * each sub-layer reads a softmax mix over the banked block sums and the running partial sum P.
 * Attn = KDA or MLA (+ the K3.1 DSA indexer) per layer; FFN = dense or (latent) MoE per layer. */
#include "model/forward.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/profile.h"
#include "model/shard.h"
#include "ops.h"

lunar_profile *lunar_prof_active;
void lunar_profile_install(lunar_profile *p) { lunar_prof_active = p; }

const char *const lunar_prof_names[LUNAR_PROF_N] = {
    "embed", "norm", "kda_proj", "kda_core", "kda_out", "mla_proj", "dsa_indexer", "mla_attn",
    "mla_out", "router", "experts", "latent_proj", "shared_dense_mlp", "lm_head", "mla_absorb"};

/* Chunk length of the KDA chunked prefill (kda.md section 2; FLA's default). */
#define KDA_CHUNK 64
/* kv_a_layernorm and q_a_layernorm use the RMSNorm default eps of transformers' KimiLinear and of
 * K3 (1e-6), not rms_norm_eps; every other RMSNorm uses rms_norm_eps. */
#define MLA_LATENT_NORM_EPS 1e-6f
/* L2 normalisation of KDA q and k: eps inside the sqrt, as FLA and transformers. */
#define KDA_L2_EPS 1e-6f
/* The indexer's k_norm is a LayerNorm with eps 1e-6 (SPEC 1.1). */
#define INDEX_K_NORM_EPS 1e-6f

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* A step: the sequences, where each one's rows start in the token-major activations, and the
 * caches they read and write. */
typedef struct step {
    const lunar_batch_seq *seqs;
    int n_seqs;
    int *off;  /* [n_seqs + 1] first row of each sequence; off[n_seqs] = T */
    int T;     /* tokens in the step */
    lunar_kv_pool *kv;
    lunar_state_pool *st;
} step;

static float *fbuf(size_t n) { return lunar_xmalloc(n * sizeof(float)); }

/* The gated activation of the dense MLP, the shared and the routed experts. */
static lunar_glu model_act(const lunar_config *c) {
    lunar_glu a = {c->act_situ ? LUNAR_GLU_SITU : LUNAR_GLU_SWIGLU, c->situ_beta, c->situ_linear_beta};
    return a;
}

/* A BF16 linear that SPEC 2 lets --quantization ptpc_fp8 quantise (attention/MLA/KDA projections
 * but kv_b_proj and the indexer's, dense and shared-expert FFN, latent down/up): PTPC-FP8 when the
 * model was loaded so; embeddings, lm_head, convs, routers and routed experts keep op_matmul. */
static void lin(const lunar_config *c, float *y, const float *x, const lunar_tensor *W, int n) {
    if (c->ptpc_fp8) op_matmul_ptpc_fp8(y, x, W, n);
    else op_matmul(y, x, W, n);
}

/* y[n, D] = down(act(gate x, up x)) with BF16/F32 weights; quantised: the dense and shared-expert
 * MLPs under ptpc_fp8 (the routed experts never are). */
static void glu_mlp(const lunar_config *c, float *y, const float *x, const lunar_tensor *gate,
                    const lunar_tensor *up, const lunar_tensor *down, int n, int quantised) {
    if (quantised && c->ptpc_fp8) { /* op_swiglu_mlp / op_situ_mlp with lin's GEMMs */
        const int I = (int)gate->shape[0];
        float *g = fbuf((size_t)n * I), *u = fbuf((size_t)n * I);
        lin(c, g, x, gate, n);
        lin(c, u, x, up, n);
        if (c->act_situ) op_situ_mul(g, g, u, (int64_t)n * I, c->situ_beta, c->situ_linear_beta);
        else op_silu_mul(g, g, u, (int64_t)n * I);
        lin(c, y, g, down, n);
        free(g), free(u);
        return;
    }
    if (c->act_situ)
        op_situ_mlp(y, x, gate, up, down, n, c->situ_beta, c->situ_linear_beta);
    else
        op_swiglu_mlp(y, x, gate, up, down, n);
}

/* Kimi Delta Attention layer (kda.md section 1.2, k3_spec 4); h: [T, D] normalised input. The
 * projections run over the whole step; the conv and the recurrence per sequence, on its slot. */
static void kda_layer(const lunar_config *c, const lunar_kda_weights *w, const step *b, int ki,
                      const float *h, float *out) {
    const int H = c->kda_num_heads, dk = c->kda_head_dim, HD = H * dk, K = c->kda_conv_size, n = b->T;
    float *pre = fbuf((size_t)n * HD);   /* projection before conv; later the gates */
    float *q = fbuf((size_t)n * HD), *k = fbuf((size_t)n * HD), *v = fbuf((size_t)n * HD);
    float *g = fbuf((size_t)n * HD);     /* log decay [n, H, dk] */
    float *low = fbuf((size_t)n * dk);   /* low-rank gate inputs */
    float *beta = fbuf((size_t)n * H), *o = fbuf((size_t)n * HD);
    const size_t state_stride = (size_t)HD * (K - 1);

    /* q, k, v: projection, causal short conv + SiLU (each with its own conv state) */
    const lunar_tensor *proj[3] = {w->q_proj, w->k_proj, w->v_proj};
    const lunar_tensor *conv[3] = {w->q_conv, w->k_conv, w->v_conv};
    float *dst[3] = {q, k, v};
    double t0 = lunar_prof_begin();
    for (int i = 0; i < 3; i++) {
        lin(c, pre, h, proj[i], n);
        for (int j = 0; j < b->n_seqs; j++) {
            const size_t r = (size_t)b->off[j] * HD;
            op_short_conv(dst[i] + r, pre + r, conv[i],
                          lunar_state_conv(b->st, b->seqs[j].slot, ki) + i * state_stride,
                          b->seqs[j].n, HD, K);
        }
    }
    op_l2norm(q, q, n * H, dk, KDA_L2_EPS);
    op_l2norm(k, k, n * H, dk, KDA_L2_EPS);

    /* forget gate g (log space; bounded when gate_lower_bound < 0) and beta */
    lin(c, low, h, w->f_a_proj, n);
    lin(c, pre, low, w->f_b_proj, n);
    op_kda_gate(g, pre, w->A_log, w->dt_bias, n, H, dk, c->kda_gate_lower_bound);
    lin(c, beta, h, w->b_proj, n);
    for (int i = 0; i < n * H; i++) beta[i] = sigmoidf(beta[i]);
    lunar_prof_end(LUNAR_PROF_KDA_PROJ, t0);

    const float scale = 1.0f / sqrtf((float)dk);
    t0 = lunar_prof_begin();
    for (int j = 0; j < b->n_seqs; j++) {
        const int nj = b->seqs[j].n;
        const size_t r = (size_t)b->off[j] * HD;
        float *S = lunar_state_kda(b->st, b->seqs[j].slot, ki);
        if (nj == 1) /* decode: the recurrence; prefill: the chunked (WY/UT) form */
            op_kda_recurrent(o + r, q + r, k + r, v + r, g + r, beta + (size_t)b->off[j] * H, S, nj, H,
                             dk, dk, scale);
        else
            op_kda_chunked(o + r, q + r, k + r, v + r, g + r, beta + (size_t)b->off[j] * H, S, nj, H,
                           dk, dk, scale, KDA_CHUNK);
        if (b->st->fp16) /* the fp16 state option stores S rounded */
            for (size_t i = 0; i < b->st->state_len; i++) S[i] = lunar_f16_to_f32(lunar_f32_to_f16(S[i]));
    }
    lunar_prof_end(LUNAR_PROF_KDA_CORE, t0);

    /* output gate (full rank in K3, low rank in Kimi-Linear), per-head gated RMSNorm, o_proj */
    t0 = lunar_prof_begin();
    if (w->g_proj) {
        lin(c, pre, h, w->g_proj, n);
    } else {
        lin(c, low, h, w->g_a_proj, n);
        lin(c, pre, low, w->g_b_proj, n);
    }
    op_rmsnorm_gated(o, o, pre, w->o_norm, n * H, dk, c->rms_norm_eps);
    lin(c, out, o, w->o_proj, n);
    lunar_prof_end(LUNAR_PROF_KDA_OUT, t0);

    free(pre), free(q), free(k), free(v), free(g), free(low), free(beta), free(o);
}

/* K3.1 DSA index queries, keys and weights for the whole step (SPEC 1.1): iq [T, ni, di],
 * ik [T, di] (LayerNorm'd), wt [T, ni] scaled. The position-dependent part (RoPE when index_rope,
 * then the Hadamard rotation) is applied per sequence by dsa_rotate. qa: the normalised q latent. */
static void dsa_project(const lunar_config *c, const lunar_mla_weights *w, const float *h,
                        const float *qa, int n, float *iq, float *ik, float *wt) {
    const int ni = c->index_n_heads, di = c->index_head_dim;
    op_matmul(iq, qa, w->idx_wq_b, n);
    op_matmul(ik, h, w->idx_wk, n);
    op_layernorm(ik, ik, w->idx_k_norm_w, w->idx_k_norm_b, n, di, INDEX_K_NORM_EPS);
    op_matmul(wt, h, w->idx_weights_proj, n);
    const float wscale = 1.0f / sqrtf((float)ni) / sqrtf((float)di);
    for (int i = 0; i < n * ni; i++) wt[i] *= wscale;
}

/* RoPE on the first qk_rope_head_dim dims (DeepSeek-V3.2-style indexers, index_rope; plain
 * rope_theta frequencies, no YaRN), then the Hadamard rotation, of n tokens at positions pos0...
 * iq: [n, ni, di], ik: [n, di]. */
static void dsa_rotate(const lunar_config *c, float *iq, float *ik, int n, int pos0) {
    const int ni = c->index_n_heads, di = c->index_head_dim;
    if (c->index_rope) {
        const int rot = c->qk_rope_head_dim;
        float *inv = fbuf((size_t)rot / 2);
        for (int i = 0; i < rot / 2; i++) inv[i] = (float)pow(c->rope_theta, -2.0 * i / rot);
        op_rope_neox(iq, inv, n, pos0, ni, di, rot);
        op_rope_neox(ik, inv, n, pos0, 1, di, rot);
        free(inv);
    }
    op_hadamard(iq, n * ni, di);
    op_hadamard(ik, n, di);
}

/* Multi-head latent attention, NoPE (kda.md 3, k3_spec 5), optionally gated and DSA-sparse.
 * Each sequence's new latent rows (and index keys) are written to its pages; the CPU reference
 * then gathers its rows [0, pos0+n) into a contiguous copy for the attention op. */
static void mla_layer(const lunar_model *m, const lunar_mla_weights *w, const step *b, int ki,
                      const float *h, float *out) {
    const lunar_config *c = &m->cfg;
    const int nh = c->num_attention_heads, N = c->qk_nope_head_dim, P = c->qk_rope_head_dim,
              Vd = c->v_head_dim, R = c->kv_lora_rank, qk = N + P, n = b->T, row = R + P;
    const lunar_kv_pool *kv = b->kv;
    float *q = fbuf((size_t)n * nh * qk), *kvr = fbuf((size_t)n * row), *o = fbuf((size_t)n * nh * Vd);
    float *qa = NULL;

    double t0 = lunar_prof_begin();
    if (w->q_proj) {
        lin(c, q, h, w->q_proj, n);
    } else {
        qa = fbuf((size_t)n * c->q_lora_rank);
        lin(c, qa, h, w->q_a_proj, n);
        op_rmsnorm(qa, qa, w->q_a_norm, n, c->q_lora_rank, MLA_LATENT_NORM_EPS);
        lin(c, q, qa, w->q_b_proj, n);
    }
    /* latent row = [RMSNorm(c) | k_pe] */
    lin(c, kvr, h, w->kv_a_proj, n);
    for (int t = 0; t < n; t++) {
        float *r = kvr + (size_t)t * row;
        op_rmsnorm(r, r, w->kv_a_norm, 1, R, MLA_LATENT_NORM_EPS);
        lunar_kv_round(kv, r);
    }
    lunar_prof_end(LUNAR_PROF_MLA_PROJ, t0);
    const int ni = c->index_n_heads, di = c->index_head_dim, topk = c->index_topk;
    float *iq = NULL, *ik = NULL, *wt = NULL;
    if (topk > 0) {
        iq = fbuf((size_t)n * ni * di), ik = fbuf((size_t)n * di), wt = fbuf((size_t)n * ni);
        PROF(DSA, dsa_project(c, w, h, qa, n, iq, ik, wt));
    }
    const float scale = 1.0f / sqrtf((float)qk);
    if (m->tp && m->tp->dcp) { /* decode context parallelism: the latent cache is sharded */
        for (int j = 0; j < b->n_seqs && topk > 0; j++)
            dsa_rotate(c, iq + (size_t)b->off[j] * ni * di, ik + (size_t)b->off[j] * di, b->seqs[j].n,
                       b->seqs[j].pos0);
        lunar_dcp_mla(m, w, ki, b->seqs, b->n_seqs, b->off, n, b->kv, q, kvr, iq, ik, wt, o);
    }
    for (int j = 0; j < b->n_seqs && !(m->tp && m->tp->dcp); j++) {
        const lunar_batch_seq *sq = &b->seqs[j];
        const int r0 = b->off[j], nj = sq->n, L = sq->pos0 + nj;
        if (topk > 0) PROF(DSA, dsa_rotate(c, iq + (size_t)r0 * ni * di, ik + (size_t)r0 * di, nj, sq->pos0));
        for (int t = 0; t < nj; t++) {
            memcpy(lunar_kv_latent_row(kv, ki, sq->blocks, sq->pos0 + t), kvr + (size_t)(r0 + t) * row,
                   (size_t)row * sizeof(float));
            if (topk > 0) {
                size_t tok = lunar_kv_token(kv, ki, sq->blocks, sq->pos0 + t);
                kv->idx_scales[tok] = lunar_fp8_quantize_pow2(kv->idx_codes + tok * di, ik + (size_t)(r0 + t) * di, di);
            }
        }
        float *cache = fbuf((size_t)L * row);
        /* the reference gathers the pages into one copy: part of its attention's cost */
        PROF(MLA_ATTN, for (int p = 0; p < L; p++)
            memcpy(cache + (size_t)p * row, lunar_kv_latent_row(kv, ki, sq->blocks, p), (size_t)row * sizeof(float)));
        const float *qj = q + (size_t)r0 * nh * qk;
        float *oj = o + (size_t)r0 * nh * Vd;
        if (topk > 0) {
            uint8_t *codes = lunar_xmalloc((size_t)L * di);
            float *scales = fbuf((size_t)L);
            const double tg = lunar_prof_begin();
            for (int p = 0; p < L; p++) {
                size_t tok = lunar_kv_token(kv, ki, sq->blocks, p);
                memcpy(codes + (size_t)p * di, kv->idx_codes + tok * di, (size_t)di);
                scales[p] = kv->idx_scales[tok];
            }
            lunar_prof_end(LUNAR_PROF_DSA, tg);
            lunar_index_cache ic = {.codes = codes, .scales = scales};
            int32_t *idx = lunar_xmalloc((size_t)nj * topk * sizeof *idx);
            PROF(DSA, op_dsa_indexer(idx, NULL, iq + (size_t)r0 * ni * di, wt + (size_t)r0 * ni, &ic, nj,
                                     sq->pos0, ni, di, topk));
            PROF(MLA_ATTN, op_mla_attention_sparse(oj, qj, cache, w->kv_b_proj, idx, topk, nj, L, nh, N, P, Vd, R, scale));
            free(idx), free(codes), free(scales);
        } else if (nj == 1) {
            /* decode: absorbed form (reads the latent once per head) */
            PROF(MLA_ATTN, op_mla_attention_absorbed(oj, qj, cache, w->kv_b_proj, nj, sq->pos0, nh, N, P, Vd, R, scale));
        } else {
            /* prefill: naive form, cheaper per (query, key) pair when many queries share the keys */
            PROF(MLA_ATTN, op_mla_attention_naive(oj, qj, cache, w->kv_b_proj, nj, sq->pos0, nh, N, P, Vd, R, scale));
        }
        free(cache);
    }
    t0 = lunar_prof_begin();
    if (w->g_proj) { /* K3 output gate: sigmoid(W_g x) on the concatenated heads, from the layer input */
        float *gate = fbuf((size_t)n * nh * Vd);
        lin(c, gate, h, w->g_proj, n);
        for (size_t i = 0; i < (size_t)n * nh * Vd; i++) o[i] *= sigmoidf(gate[i]);
        free(gate);
    }
    lin(c, out, o, w->o_proj, n);
    lunar_prof_end(LUNAR_PROF_MLA_OUT, t0);
    free(q), free(kvr), free(o), free(qa), free(iq), free(ik), free(wt);
}

/* MoE: sigmoid router with correction bias on the full width; routed experts on the full width
 * (Kimi-Linear) or in the latent space (K3: down-projection, experts, RMSNorm, up-projection);
 * plus the shared experts. */
static void moe_layer(const lunar_model *model, const lunar_ffn_weights *w, const float *h, int n,
                      float *out) {
    const lunar_config *c = &model->cfg;
    const int D = c->hidden_size, E = c->num_experts, k = c->num_experts_per_token;
    const int Lat = c->routed_expert_hidden_size, De = Lat ? Lat : D;
    float *logits = fbuf((size_t)n * E), *wt = fbuf((size_t)n * k);
    int32_t *sel = lunar_xmalloc((size_t)n * k * sizeof(int32_t));
    PROF(ROUTER, op_matmul(logits, h, w->router, n);
         op_router_topk(sel, wt, logits, w->router_bias, n, E, k, c->num_expert_group, c->topk_group,
                        c->moe_renormalize, c->routed_scaling_factor));

    const float *z = h; /* the experts' input */
    float *zbuf = NULL, *acc = out;
    if (Lat) {
        zbuf = fbuf((size_t)n * Lat);
        PROF(LATENT, lin(c, zbuf, h, w->latent_down, n));
        z = zbuf;
        acc = fbuf((size_t)n * Lat);
    }
    memset(acc, 0, (size_t)n * De * sizeof(float));

    /* group the (token, slot) pairs by expert so each expert runs once over its tokens */
    const lunar_glu act = model_act(c);
    float *xin = fbuf((size_t)n * De), *xout = fbuf((size_t)n * De), *tw = fbuf((size_t)n);
    int *tok = lunar_xmalloc((size_t)n * sizeof(int));
    const double t0 = lunar_prof_begin();
    for (int e = 0; e < E; e++) {
        const lunar_expert_weights *x = &w->experts[e];
        if (!x->w1 && !x->q1.packed) continue; /* expert parallelism: held by another rank */
        int m = 0;
        for (int t = 0; t < n; t++)
            for (int j = 0; j < k; j++)
                if (sel[t * k + j] == e) {
                    tok[m] = t;
                    tw[m] = wt[t * k + j];
                    memcpy(xin + (size_t)m * De, z + (size_t)t * De, (size_t)De * sizeof(float));
                    m++;
                }
        if (!m) continue;
        if (c->experts_mxfp4)
            op_mxfp4_mlp(xout, xin, &x->q1, &x->q3, &x->q2, m, &act);
        else
            glu_mlp(c, xout, xin, x->w1, x->w3, x->w2, m, 0);
        for (int i = 0; i < m; i++) {
            float *y = acc + (size_t)tok[i] * De;
            const float *r = xout + (size_t)i * De;
            for (int d = 0; d < De; d++) y[d] += tw[i] * r[d];
        }
    }
    lunar_prof_end(LUNAR_PROF_EXPERTS, t0);
    if (Lat) {
        /* under TP each rank holds part of every expert (or whole experts): the routed sum is
         * completed before its norm, which is not linear (k3_spec 6.4) */
        if (model->tp) lunar_tp_all_reduce(model, acc, (size_t)n * Lat);
        const double tl = lunar_prof_begin();
        if (w->latent_norm) op_rmsnorm(acc, acc, w->latent_norm, n, Lat, c->rms_norm_eps);
        if (model->tp)
            lunar_tp_latent_up(model, w->latent_up, out, acc, n, Lat);
        else
            lin(c, out, acc, w->latent_up, n);
        lunar_prof_end(LUNAR_PROF_LATENT, tl);
        free(acc);
    }
    if (w->shared_gate) { /* shared experts: one MLP on the full width */
        float *sh = fbuf((size_t)n * D);
        PROF(SHARED, glu_mlp(c, sh, h, w->shared_gate, w->shared_up, w->shared_down, n, 1));
        for (size_t i = 0; i < (size_t)n * D; i++) out[i] += sh[i];
        free(sh);
    }
    free(logits), free(sel), free(wt), free(zbuf), free(xin), free(xout), free(tok), free(tw);
}

/* Under TP (m->tp) each rank computes its heads' share of o_proj's product (a rank may hold no
 * head of a small model: it adds zeros), then one all-reduce completes the sub-layer. */
static void attention(const lunar_model *m, const step *b, int l, const float *h, float *y) {
    const lunar_config *c = &m->cfg;
    const size_t nD = (size_t)b->T * c->hidden_size;
    if (c->attn_kind[l] == LUNAR_ATTN_KDA) {
        if (c->kda_num_heads > 0)
            kda_layer(c, &m->layers[l].kda, b, m->kind_index[l], h, y);
        else
            memset(y, 0, nD * sizeof(float));
    } else {
        /* under DCP a rank without heads still serves its share of the cache to the others */
        if (c->num_attention_heads > 0 || (m->tp && m->tp->dcp))
            mla_layer(m, &m->layers[l].mla, b, m->kind_index[l], h, y);
        else
            memset(y, 0, nD * sizeof(float));
    }
    if (m->tp) lunar_tp_all_reduce(m, y, nD);
}

static void ffn(const lunar_model *m, int l, const float *h, int n, float *y) {
    const lunar_config *c = &m->cfg;
    const lunar_ffn_weights *w = &m->layers[l].ffn;
    if (c->ffn_kind[l] == LUNAR_FFN_DENSE)
        PROF(SHARED, glu_mlp(c, y, h, w->gate_proj, w->up_proj, w->down_proj, n, 1));
    else
        moe_layer(m, w, h, n, y);
    if (m->tp) lunar_tp_all_reduce(m, y, (size_t)n * c->hidden_size); /* row-parallel down projections */
}

static void add_into(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

/* Kimi-Linear: residual stream x [n, D]; writes the final-normed rows to hout [n, D]. */
static void run_residual(const lunar_model *m, const step *b, float *x, int n, float *hout) {
    const lunar_config *c = &m->cfg;
    const int D = c->hidden_size;
    float *h = fbuf((size_t)n * D), *y = fbuf((size_t)n * D);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const lunar_layer_weights *w = &m->layers[l];
        PROF(NORM, op_rmsnorm(h, x, w->attn_norm, n, D, c->rms_norm_eps));
        attention(m, b, l, h, y);
        add_into(x, y, (size_t)n * D);
        PROF(NORM, op_rmsnorm(h, x, w->ffn_norm, n, D, c->rms_norm_eps));
        ffn(m, l, h, n, y);
        add_into(x, y, (size_t)n * D);
    }
    PROF(NORM, op_rmsnorm(hout, x, m->final_norm, n, D, c->rms_norm_eps));
    free(h), free(y);
}

/* K3 Attention Residuals (k3_spec 3.3). blocks: the banked block sums (b_0 = the embedding);
 * P: the running partial block sum, NULL right after a block was banked. Every sub-layer input is
 * AttnResMix(blocks ++ [P]) followed by the sub-layer's own norm (fused into the mix). */
static void run_attn_res(const lunar_model *m, const step *b, float *x, int n, float *hout) {
    const lunar_config *c = &m->cfg;
    const int D = c->hidden_size, bs = c->attn_res_block_size, L = c->num_hidden_layers;
    const float eps = c->rms_norm_eps;
    const int max_blocks = L / bs + 2;
    float **blocks = lunar_xcalloc((size_t)max_blocks, sizeof *blocks);
    const float **src = lunar_xcalloc((size_t)max_blocks + 1, sizeof *src);
    float *h = fbuf((size_t)n * D), *y = fbuf((size_t)n * D);
    float *P = x; /* the embedding starts the first block */
    int nb = 0;
#define CANDIDATES() (memcpy(src, blocks, (size_t)nb * sizeof *src), src[nb] = P, nb + 1)
    for (int l = 0; l < L; l++) {
        const lunar_layer_weights *w = &m->layers[l];
        int S = CANDIDATES();
        PROF(NORM, op_attnres_mix(h, src, S, w->attn_res_proj, w->attn_res_norm, w->attn_norm, n, D, eps));
        if (l % bs == 0) { /* bank the finished block (at layer 0: the embedding) */
            blocks[nb++] = P;
            P = NULL;
        }
        attention(m, b, l, h, y);
        if (P) {
            add_into(P, y, (size_t)n * D);
        } else {
            P = y;
            y = fbuf((size_t)n * D);
        }
        S = CANDIDATES();
        PROF(NORM, op_attnres_mix(h, src, S, w->mlp_res_proj, w->mlp_res_norm, w->ffn_norm, n, D, eps));
        ffn(m, l, h, n, y);
        add_into(P, y, (size_t)n * D);
    }
    /* output mix over b_0.. and the partial block, fused with model.norm */
    int S = CANDIDATES();
    PROF(NORM, op_attnres_mix(hout, src, S, m->out_res_proj, m->out_res_norm, m->final_norm, n, D, eps));
#undef CANDIDATES
    /* blocks[0] is x, owned by the caller */
    for (int i = 1; i < nb; i++) free(blocks[i]);
    if (P != x) free(P);
    free(blocks), free(src), free(h), free(y);
}

int lunar_forward_batch(const lunar_model *m, lunar_kv_pool *kv, lunar_state_pool *st,
                        const lunar_batch_seq *seqs, int n_seqs, float *logits, lunar_err *err) {
    const lunar_config *c = &m->cfg;
    const int D = c->hidden_size, V = c->vocab_size;
    if (n_seqs <= 0) return lunar_fail(err, "forward: empty batch");
    if (!m->embed->data) /* a device_lazy dummy model (model/dummy.h): its weights exist on the device only */
        return lunar_fail(err, "forward: this model's weights were generated for the CUDA backend only");
    int *off = lunar_xmalloc(((size_t)n_seqs + 1) * sizeof *off), T = 0, rows = 0;
    for (int j = 0; j < n_seqs; j++) {
        const lunar_batch_seq *sq = &seqs[j];
        if (sq->n <= 0 || sq->pos0 < 0) {
            free(off);
            return lunar_fail(err, "forward: sequence %d has %d tokens at position %d", j, sq->n, sq->pos0);
        }
        for (int i = 0; i < sq->n; i++)
            if (sq->ids[i] < 0 || sq->ids[i] >= V) {
                free(off);
                return lunar_fail(err, "token id %d at position %d is outside the vocabulary [0, %d)",
                                  sq->ids[i], sq->pos0 + i, V);
            }
        off[j] = T;
        T += sq->n;
        rows += sq->logits == LUNAR_LOGITS_ALL ? sq->n : sq->logits == LUNAR_LOGITS_LAST;
    }
    off[n_seqs] = T;
    step b = {seqs, n_seqs, off, T, kv, st};

    float *x = fbuf((size_t)T * D); /* embeddings, then the residual stream */
    float *h = fbuf((size_t)T * D); /* final normalised hidden states */
    const double te = lunar_prof_begin();
    for (int j = 0; j < n_seqs; j++) {
        if (m->tp) /* vocab-parallel: each rank holds a slice of the rows, zeros elsewhere */
            lunar_tp_embedding(m, x + (size_t)off[j] * D, seqs[j].ids, seqs[j].n);
        else
            op_embedding(x + (size_t)off[j] * D, m->embed, seqs[j].ids, seqs[j].n);
    }
    if (m->tp) lunar_tp_all_reduce(m, x, (size_t)T * D); /* one rank's row plus zeros: exact */
    lunar_prof_end(LUNAR_PROF_EMBED, te);
    if (c->attn_res_block_size > 0)
        run_attn_res(m, &b, x, T, h);
    else
        run_residual(m, &b, x, T, h);

    /* lm_head over the rows the sequences asked for only: it is the largest matmul of a step */
    float *sel = fbuf((size_t)(rows ? rows : 1) * D);
    int r = 0;
    for (int j = 0; j < n_seqs; j++) {
        int first = seqs[j].logits == LUNAR_LOGITS_ALL ? off[j] : off[j + 1] - 1;
        int cnt = seqs[j].logits == LUNAR_LOGITS_ALL ? seqs[j].n : seqs[j].logits == LUNAR_LOGITS_LAST;
        memcpy(sel + (size_t)r * D, h + (size_t)first * D, (size_t)cnt * D * sizeof(float));
        r += cnt;
    }
    if (rows) {
        const double tl = lunar_prof_begin();
        if (m->tp)
            lunar_tp_lm_head(m, logits, sel, rows);
        else
            op_matmul(logits, sel, m->lm_head, rows);
        lunar_prof_end(LUNAR_PROF_LM_HEAD, tl);
    }
    free(x), free(h), free(sel), free(off);
    if (m->tp && m->tp->failed) {
        m->tp->failed = 0;
        return lunar_fail(err, "tensor-parallel rank %d: %s", m->tp->rank, m->tp->err.msg);
    }
    return 0;
}

int lunar_seq_init(lunar_seq *s, const lunar_model *m, int max_tokens, lunar_err *err) {
    memset(s, 0, sizeof *s);
    if (max_tokens <= 0) return lunar_fail(err, "sequence capacity must be positive (got %d)", max_tokens);
    /* under DCP a rank holds every dcp-th token: blocks of 128 / dcp rows */
    const int dcp = m->tp ? m->tp->dcp_size : 1;
    const int n_blocks = (max_tokens + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
    if (lunar_kv_pool_init_dcp(&s->kv, &m->cfg, n_blocks, LUNAR_KV_F32, dcp, err)) return -1;
    if (lunar_state_pool_init(&s->st, &m->cfg, 1, 0, err)) {
        lunar_kv_pool_free(&s->kv);
        return -1;
    }
    s->blocks = lunar_xmalloc((size_t)n_blocks * sizeof *s->blocks);
    for (int i = 0; i < n_blocks; i++) s->blocks[i] = i;
    s->max_tokens = max_tokens;
    return 0;
}

void lunar_seq_reset(lunar_seq *s, const lunar_model *m) {
    (void)m;
    lunar_state_clear(&s->st, 0);
    s->pos = 0; /* cache rows past pos are never read */
}

void lunar_seq_free(lunar_seq *s) {
    lunar_kv_pool_free(&s->kv);
    lunar_state_pool_free(&s->st);
    free(s->blocks);
    memset(s, 0, sizeof *s);
}

int lunar_forward(const lunar_model *m, lunar_seq *s, const int32_t *ids, int n, float *logits,
                  int all_logits, lunar_err *err) {
    if (n <= 0) return lunar_fail(err, "forward: no tokens");
    if (s->pos + n > s->max_tokens)
        return lunar_fail(err, "forward: %d + %d tokens exceed the sequence capacity of %d", s->pos,
                          n, s->max_tokens);
    lunar_batch_seq one = {ids, n, s->pos, 0, s->blocks, all_logits ? LUNAR_LOGITS_ALL : LUNAR_LOGITS_LAST};
    if (lunar_forward_batch(m, &s->kv, &s->st, &one, 1, logits, err)) return -1;
    s->pos += n;
    return 0;
}
