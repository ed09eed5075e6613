/* The CUDA forward's model upload (weights converted and copied into the arena, the fused
 * projection matrices), the caches (paged latent + index keys, KDA conv and state slots) and the
 * memory plan of a step (lunar_cuda_step_bytes). The step itself: forward_cuda.c. */
#ifdef LUNAR_HAVE_CUDA

#include "model/forward_cuda_internal.h"

/* Counting mode (lunar_cuda_model_bytes): the upload walks the same code, lunar_cuda_fwd_alloc only adds up the
 * aligned sizes and returns a dummy pointer, and nothing is converted or copied. */
static int counting;
static size_t counted;

void *lunar_cuda_fwd_alloc(size_t bytes) {
    if (!bytes) bytes = 4;
    if (counting) {
        counted += (bytes + 255) / 256 * 256;
        return (void *)(uintptr_t)256;
    }
    void *p = lunar_cuda_alloc(bytes);
    LUNAR_ASSERT(p != NULL); /* the upload checked the budget first; temporaries are planned */
    return p;
}

/* LUNAR_CUDA_MOE=generic at upload: the per-expert path runs the MoE layers (and keeps what it reads) */
static int generic_at_upload(void) {
    const char *moe = getenv("LUNAR_CUDA_MOE");
    return moe && strcmp(moe, "generic") == 0;
}

static float *host_f32(const lunar_tensor *t, int64_t *n) {
    *n = lunar_tensor_numel(t);
    float *f = lunar_xmalloc((size_t)*n * sizeof(float));
    lunar_tensor_read_f32(t, 0, *n, f);
    return f;
}

static void up_bf16_host(uint16_t *d, const float *f, int64_t n) {
    uint16_t *h = lunar_xmalloc((size_t)n * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++) h[i] = lunar_f32_to_bf16(f[i]);
    lunar_cuda_upload(d, h, (size_t)n * 2);
    free(h);
}

/* t as bf16 into d (numel(t) elements) */
static void up_bf16_into(uint16_t *d, const lunar_tensor *t) {
    const int64_t n = lunar_tensor_numel(t);
    if (counting) return;
    if (lunar_dummy_is_lazy(t)) { /* DUMMY HOOK (model/dummy.h): --load-format dummy, generated on the device */
        LUNAR_ASSERT(lunar_dummy_device_bf16(d, t) == 0);
        return;
    }
    if (t->dtype == LUNAR_DTYPE_BF16 && t->nbytes >= (size_t)n * 2) { /* checkpoints: as stored */
        lunar_cuda_upload(d, t->data, (size_t)n * 2);
        return;
    }
    int64_t nf;
    float *f = host_f32(t, &nf);
    up_bf16_host(d, f, n);
    free(f);
}

static uint16_t *up_bf16(const lunar_tensor *t) {
    if (!t) return NULL;
    uint16_t *d = lunar_cuda_fwd_alloc((size_t)lunar_tensor_numel(t) * 2);
    up_bf16_into(d, t);
    return d;
}

/* E tensors of one shape (the experts' w1, say) stacked: bf16, or raw bytes (MXFP4 codes/scales) */
static uint16_t *up_stack_bf16(const lunar_expert_weights *x, int E, size_t off) {
    const lunar_tensor *t0 = *(const lunar_tensor *const *)((const char *)&x[0] + off);
    const size_t n = (size_t)lunar_tensor_numel(t0);
    uint16_t *d = lunar_cuda_fwd_alloc((size_t)E * n * 2);
    for (int e = 0; e < E; e++) {
        const lunar_tensor *t = *(const lunar_tensor *const *)((const char *)&x[e] + off);
        LUNAR_ASSERT((size_t)lunar_tensor_numel(t) == n);
        up_bf16_into(d + (size_t)e * n, t);
    }
    return d;
}
static uint8_t *up_stack_raw(const lunar_expert_weights *x, int E, size_t off) {
    const lunar_tensor *t0 = *(const lunar_tensor *const *)((const char *)&x[0] + off);
    const size_t n = t0->nbytes;
    uint8_t *d = lunar_cuda_fwd_alloc((size_t)E * n);
    for (int e = 0; e < E && !counting; e++) {
        const lunar_tensor *t = *(const lunar_tensor *const *)((const char *)&x[e] + off);
        LUNAR_ASSERT(t->nbytes == n && t->dtype == LUNAR_DTYPE_U8);
        if (lunar_dummy_is_lazy(t)) /* DUMMY HOOK: MXFP4 codes generated on the device */
            LUNAR_ASSERT(lunar_dummy_device_raw(d + (size_t)e * n, t) == 0);
        else
            lunar_cuda_upload(d + (size_t)e * n, t->data, n);
    }
    return d;
}

/* fp32 on the device; rounded: through bf16 first (a weight every other path of the device reads
 * in bf16 and this one kernel in fp32: the same values everywhere) */
static float *up_f32_r(const lunar_tensor *t, int rounded) {
    if (!t) return NULL;
    const int64_t n = lunar_tensor_numel(t);
    float *d = lunar_cuda_fwd_alloc((size_t)n * 4);
    if (counting) return d;
    int64_t nf;
    float *f = host_f32(t, &nf);
    if (rounded)
        for (int64_t i = 0; i < n; i++) f[i] = lunar_bf16_to_f32(lunar_f32_to_bf16(f[i]));
    lunar_cuda_upload(d, f, (size_t)n * 4);
    free(f);
    return d;
}
static float *up_f32(const lunar_tensor *t) { return up_f32_r(t, 0); }

static dmat up_mat(const lunar_tensor *t) {
    dmat r = {0};
    /* TP hook: a rank's share of a matrix may be empty (a tiny MXFP4 expert split in blocks of 32
     * columns): no matrix, which the callers skip */
    if (!t || lunar_tensor_numel(t) == 0) return r;
    r.out = (int)t->shape[0];
    r.in = (int)(lunar_tensor_numel(t) / t->shape[0]);
    r.p = up_bf16(t);
    return r;
}

/* A linear SPEC 2 lets --quantization ptpc_fp8 quantise: up_mat, or (ptpc) its codes and row
 * scales from a temporary bf16 copy released at once (counting: the largest such copy is added
 * once, the upload's transient peak) */
static int ptpc;
static size_t ptpc_tmp;
static dmat up_lin(const lunar_tensor *t) {
    if (!ptpc || !t || lunar_tensor_numel(t) == 0) return up_mat(t);
    dmat r = {0};
    r.out = (int)t->shape[0];
    r.in = (int)(lunar_tensor_numel(t) / t->shape[0]);
    r.p = lunar_cuda_fwd_alloc((size_t)r.out * r.in);
    r.s8 = lunar_cuda_fwd_alloc((size_t)r.out * 4);
    if (counting) {
        if ((size_t)r.out * r.in * 2 > ptpc_tmp) ptpc_tmp = (size_t)r.out * r.in * 2;
        return r;
    }
    size_t mk = lunar_cuda_mark();
    const uint16_t *b = up_bf16(t);
    lunar_cuda_ptpc_quantize((uint8_t *)r.p, r.s8, b, LUNAR_CUDA_BF16, r.out, r.in, NULL);
    lunar_cuda_sync();
    lunar_cuda_release(mk);
    return r;
}

/* Matrices that read the same input concatenated along their outputs into one allocation, each
 * views[i] a slice of it (no second copy): a batch-1 decode step then reads them with one GEMM
 * launch instead of one each (issue 9: ~2-3 us of fixed cost per graph node). Returns the whole;
 * {0} (and each matrix uploaded alone) where they cannot be fused: PTPC codes, an absent or
 * empty matrix (a TP share), different input widths, or LUNAR_CUDA_FUSE=0 (A/B runs; =noshared:
 * the MoE's shared gate/up + router stay apart, see moe_fused). */
static int fuse_off, fuse_moe_off;
static dmat up_cat(const lunar_tensor *const *ts, dmat *const *views, int k) {
    dmat r = {0};
    int ok = !ptpc && !fuse_off && k > 0 && ts[0] && lunar_tensor_numel(ts[0]) > 0;
    const int in = ok ? (int)(lunar_tensor_numel(ts[0]) / ts[0]->shape[0]) : 0;
    for (int i = 0; i < k && ok; i++)
        ok = ts[i] && lunar_tensor_numel(ts[i]) > 0 && lunar_tensor_numel(ts[i]) / ts[i]->shape[0] == in;
    if (!ok || in % 8 != 0) {
        for (int i = 0; i < k; i++) *views[i] = up_lin(ts[i]);
        return r;
    }
    for (int i = 0; i < k; i++) r.out += (int)ts[i]->shape[0];
    r.in = in;
    r.p = lunar_cuda_fwd_alloc((size_t)r.out * in * 2);
    uint16_t *at = r.p;
    for (int i = 0; i < k; i++) {
        const int o = (int)ts[i]->shape[0];
        *views[i] = (dmat){at, o, in, NULL};
        up_bf16_into(at, ts[i]);
        at += (size_t)o * in;
    }
    return r;
}

static dmat up_mxfp4(const lunar_mxfp4 *w) {
    dmat r = {0};
    if (lunar_tensor_numel(w->packed) == 0) return r; /* an empty TP share, as up_mat */
    r.out = (int)w->packed->shape[0];
    r.in = (int)(lunar_tensor_numel(w->packed) / w->packed->shape[0]) * 2;
    r.p = lunar_cuda_fwd_alloc((size_t)r.out * r.in * 2);
    if (counting) return r;
    if (lunar_dummy_is_lazy(w->packed)) { /* DUMMY HOOK (model/dummy.h): dequantised on the device */
        LUNAR_ASSERT(lunar_dummy_device_mxfp4_bf16(r.p, w) == 0);
        return r;
    }
    float *f = lunar_xmalloc((size_t)r.out * r.in * sizeof(float));
    for (int i = 0; i < r.out; i++) lunar_mxfp4_dequant_row(f + (size_t)i * r.in, w, i);
    up_bf16_host(r.p, f, (int64_t)r.out * r.in); /* exact: E2M1 * 2^k has 3 significant bits */
    free(f);
    return r;
}

/* proj * norm folded in fp32, as op_attnres_mix */
static float *up_fold(const lunar_tensor *proj, const lunar_tensor *norm) {
    if (!proj) return NULL;
    float *d = lunar_cuda_fwd_alloc((size_t)lunar_tensor_numel(proj) * 4);
    if (counting) return d;
    int64_t n, n2;
    float *u = host_f32(proj, &n), *r = host_f32(norm, &n2);
    LUNAR_ASSERT(n == n2);
    for (int64_t i = 0; i < n; i++) u[i] *= r[i];
    lunar_cuda_upload(d, u, (size_t)n * 4);
    free(u), free(r);
    return d;
}

int lunar_cuda_backend_init(double gpu_memory_utilization, lunar_err *err) {
    if (lunar_cuda_ready()) return 0;
    if (!(gpu_memory_utilization > 0.0 && gpu_memory_utilization <= 1.0))
        return lunar_fail(err, "--gpu-memory-utilization must be in (0, 1] (got %g)", gpu_memory_utilization);
    size_t free_b = 0, total_b = 0;
    if (lunar_cuda_mem_info(0, &free_b, &total_b, err)) return -1;
    size_t want = (size_t)(gpu_memory_utilization * (double)total_b);
    /* what others hold is not ours; leave the driver a little (context, cuBLASLt kernels) */
    const size_t headroom = (size_t)256 << 20;
    if (want + headroom > free_b) want = free_b > headroom ? free_b - headroom : 0;
    if (want < ((size_t)256 << 20))
        return lunar_fail(err, "CUDA: only %.2f GiB of %.2f GiB free on device 0", free_b / 1073741824.0,
                          total_b / 1073741824.0);
    return lunar_cuda_init(0, want, err);
}

/* Every weight the forward reads, in one place (the dummy-weights loader of the benchmarks may
 * hook here). In counting mode only the sizes are summed. */
static void upload_weights(lunar_cuda_model *g, const lunar_model *m) {
    const lunar_config *c = &m->cfg;
    g->m = m;
    ptpc = c->ptpc_fp8, ptpc_tmp = 0;
    const char *fz = getenv("LUNAR_CUDA_FUSE");
    /* under real TP ranks too: session 5's 2-GPU call ran cuda_tp, cuda_dcp and graphs_tp with the
     * fused launches and PDL (all equal to one GPU as before; KL48 TP 2 decode B=1 4.01 -> 2.99 ms) */
    fuse_off = fz && strcmp(fz, "0") == 0;
    fuse_moe_off = fuse_off || (fz && strcmp(fz, "noshared") == 0);
    g->fuse_off = fuse_off; /* the step's fused launches follow the upload's choice */
    g->combine_norm = getenv("LUNAR_COMBINE_NORM") && atoi(getenv("LUNAR_COMBINE_NORM")) > 0;
    const char *kd = getenv("LUNAR_KDA_DECODE");
    g->kda_decode = fuse_off || !kd                 ? KDA_DECODE_SPLIT
                    : strcmp(kd, "fused") == 0  ? KDA_DECODE_FUSED
                    : strcmp(kd, "nogate") == 0 ? KDA_DECODE_NOGATE
                                                : KDA_DECODE_SPLIT;
    const char *kp = getenv("LUNAR_KDA_PREFILL");
    g->kda_prefill = !(kp && strcmp(kp, "split") == 0);
    g->embed = up_bf16(m->embed);
    g->lm_head = up_mat(m->lm_head);
    g->final_norm = up_bf16(m->final_norm);
    g->final_norm_f = up_f32(m->final_norm);
    g->out_u = up_fold(m->out_res_proj, m->out_res_norm);
    if (c->index_topk > 0 && c->index_rope) {
        const int rot = c->qk_rope_head_dim;
        float *inv = lunar_xmalloc((size_t)rot / 2 * sizeof(float));
        for (int i = 0; i < rot / 2; i++) inv[i] = (float)pow(c->rope_theta, -2.0 * i / rot);
        g->rope_inv = lunar_cuda_fwd_alloc((size_t)rot / 2 * 4);
        if (!counting) lunar_cuda_upload(g->rope_inv, inv, (size_t)rot / 2 * 4);
        free(inv);
    }
    g->L = lunar_xcalloc((size_t)c->num_hidden_layers, sizeof *g->L);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const lunar_layer_weights *w = &m->layers[l];
        dlayer *d = &g->L[l];
        d->attn_norm = up_bf16(w->attn_norm), d->ffn_norm = up_bf16(w->ffn_norm);
        d->attn_norm_f = up_f32(w->attn_norm), d->ffn_norm_f = up_f32(w->ffn_norm);
        d->ares_u = up_fold(w->attn_res_proj, w->attn_res_norm);
        d->mres_u = up_fold(w->mlp_res_proj, w->mlp_res_norm);
        if (c->attn_kind[l] == LUNAR_ATTN_KDA) {
            const lunar_kda_weights *k = &w->kda;
            const int full_g = k->g_proj != NULL;
            const lunar_tensor *ts[6] = {k->q_proj, k->k_proj, k->v_proj, k->f_a_proj,
                                         full_g ? k->g_proj : k->g_a_proj, k->b_proj};
            dmat *vs[6] = {&d->q, &d->k, &d->v, &d->fa, full_g ? &d->g : &d->ga, &d->b};
            d->kin = up_cat(ts, vs, 6);
            /* the three conv weights adjacent ([3 H dk, K]) for the fused decode launch */
            const int64_t nc = lunar_tensor_numel(k->q_conv);
            float *cv = lunar_cuda_fwd_alloc((size_t)nc * 3 * 4);
            const lunar_tensor *cs[3] = {k->q_conv, k->k_conv, k->v_conv};
            for (int i = 0; i < 3 && !counting; i++) {
                int64_t ni;
                float *f = host_f32(cs[i], &ni);
                LUNAR_ASSERT(ni == nc);
                lunar_cuda_upload(cv + (size_t)i * nc, f, (size_t)nc * 4);
                free(f);
            }
            d->qc = cv, d->kc = cv + nc, d->vc = cv + 2 * nc;
            d->dt_bias = up_f32(k->dt_bias), d->A_log = up_f32(k->A_log);
            if (full_g) {
                d->fb = up_lin(k->f_b_proj);
                d->kfg = d->fb.s8 || fuse_off ? (dmat){0} : d->fb;
                d->ga = up_lin(k->g_a_proj), d->gb = up_lin(k->g_b_proj);
            } else {
                const lunar_tensor *t2[2] = {k->f_b_proj, k->g_b_proj};
                dmat *v2[2] = {&d->fb, &d->gb};
                d->kfg = up_cat(t2, v2, 2);
                d->g = up_lin(k->g_proj);
            }
            d->o_norm = up_bf16(k->o_norm), d->o = up_lin(k->o_proj);
        } else {
            const lunar_mla_weights *a = &w->mla;
            /* every projection of h in one matrix (up_cat): q (or q_a), kv_a, the indexer's wk and
             * weights_proj, the output gate, those present */
            const lunar_tensor *ts[5];
            dmat *vs[5];
            int nt = 0;
            if (a->q_proj) ts[nt] = a->q_proj, vs[nt++] = &d->mq;
            else ts[nt] = a->q_a_proj, vs[nt++] = &d->qa;
            ts[nt] = a->kv_a_proj, vs[nt++] = &d->kva;
            if (a->g_proj) ts[nt] = a->g_proj, vs[nt++] = &d->mg;
            /* the indexer's matrices are never PTPC (up_mat): under ptpc alone, as before */
            if (!ptpc && a->idx_wk && a->idx_weights_proj)
                ts[nt] = a->idx_wk, vs[nt++] = &d->iwk, ts[nt] = a->idx_weights_proj, vs[nt++] = &d->iwp;
            else
                d->iwk = up_mat(a->idx_wk), d->iwp = up_mat(a->idx_weights_proj);
            d->min = up_cat(ts, vs, nt);
            if (a->q_proj) d->qa = up_lin(a->q_a_proj); /* absent where q_proj is there */
            d->qb = up_lin(a->q_b_proj);
            d->qa_norm = up_bf16(a->q_a_norm);
            d->kva_norm = up_f32_r(a->kv_a_norm, 1); /* a norm weight: bf16 as lunar_cuda_rmsnorm's */
            d->kvb = up_mat(a->kv_b_proj), d->mo = up_lin(a->o_proj);
            d->iwq = up_mat(a->idx_wq_b);
            d->ik_w = up_f32(a->idx_k_norm_w), d->ik_b = up_f32(a->idx_k_norm_b);
        }
        const lunar_ffn_weights *f = &w->ffn;
        if (c->ffn_kind[l] == LUNAR_FFN_DENSE) {
            d->gate = up_lin(f->gate_proj), d->up = up_lin(f->up_proj), d->down = up_lin(f->down_proj);
        } else {
            d->rbias = up_f32(f->router_bias);
            if (f->shared_gate && !ptpc && !fuse_moe_off) { /* the router is never PTPC: fused only without it */
                const lunar_tensor *ts[3] = {f->shared_gate, f->shared_up, f->router};
                dmat *vs[3] = {&d->sg, &d->su, &d->router};
                d->sin = up_cat(ts, vs, 3);
            } else {
                d->router = up_mat(f->router);
                d->sg = up_lin(f->shared_gate), d->su = up_lin(f->shared_up);
            }
            d->sd = up_lin(f->shared_down);
            d->ldown = up_lin(f->latent_down), d->lup = up_lin(f->latent_up);
            d->lnorm = up_bf16(f->latent_norm);
            const int E = c->num_experts;
            /* TP hook: a rank's experts hold its slice of the intermediate channels */
            const lunar_expert_weights *x0 = &f->experts[0];
            const int I = !m->tp ? c->moe_intermediate_size
                          : c->experts_mxfp4 ? (x0->q1.packed ? (int)x0->q1.packed->shape[0] : 0)
                                             : (x0->w1 ? (int)x0->w1->shape[0] : 0);
            const int De = c->routed_expert_hidden_size ? c->routed_expert_hidden_size : c->hidden_size;
            d->w1 = lunar_xcalloc((size_t)E, sizeof(dmat));
            d->w3 = lunar_xcalloc((size_t)E, sizeof(dmat));
            d->w2 = lunar_xcalloc((size_t)E, sizeof(dmat));
            /* TP hook: a rank holds shares of the experts (or, under EP, some whole experts only):
             * the generic path reads every expert's own shape and skips the absent ones */
            /* TP hook: the fused kernels take a rank's slice (its partial sums join the layer's
             * all-reduce; the latent sum is all-reduced before its norm, below), not EP's gaps */
            d->fused_ok = De % 128 == 0 && I > 0 && I % 128 == 0 && !(m->tp && m->tp->ep);
            lunar_cuda_moe_experts *X = &d->mx;
            X->E = E, X->D = De, X->I = I, X->mxfp4 = c->experts_mxfp4, X->act = c->act_situ;
            X->beta = c->situ_beta, X->beta_l = c->situ_linear_beta;
            const lunar_expert_weights *xs = f->experts;
            if (d->fused_ok && c->experts_mxfp4) {
                X->w1q = up_stack_raw(xs, E, offsetof(lunar_expert_weights, q1.packed));
                X->w1s = up_stack_raw(xs, E, offsetof(lunar_expert_weights, q1.scale));
                X->w3q = up_stack_raw(xs, E, offsetof(lunar_expert_weights, q3.packed));
                X->w3s = up_stack_raw(xs, E, offsetof(lunar_expert_weights, q3.scale));
                X->w2q = up_stack_raw(xs, E, offsetof(lunar_expert_weights, q2.packed));
                X->w2s = up_stack_raw(xs, E, offsetof(lunar_expert_weights, q2.scale));
            } else if (d->fused_ok) {
                uint16_t *s1 = up_stack_bf16(xs, E, offsetof(lunar_expert_weights, w1));
                uint16_t *s3 = up_stack_bf16(xs, E, offsetof(lunar_expert_weights, w3));
                uint16_t *s2 = up_stack_bf16(xs, E, offsetof(lunar_expert_weights, w2));
                X->w1 = s1, X->w3 = s3, X->w2 = s2;
                for (int e = 0; e < E; e++) {
                    d->w1[e] = (dmat){s1 + (size_t)e * I * De, I, De, NULL};
                    d->w3[e] = (dmat){s3 + (size_t)e * I * De, I, De, NULL};
                    d->w2[e] = (dmat){s2 + (size_t)e * De * I, De, I, NULL};
                }
                /* issue 9, opt-in (LUNAR_MOE_SHARED_ROW=1): at batch 1 the shared expert runs as
                 * one more routed row of the decode kernels (virtual expert E, weight 1) where it
                 * has the routed experts' shape, bf16, no latent, one rank: two side-stream
                 * launches and the join fewer per layer. Not the default: Kimi-Linear-48B B=1
                 * measured 3.12 ms against 2.99 (docs/benchmarks.md "MoE decode (session 5)"):
                 * the ninth row takes the gate/up kernel past one wave of blocks, and the shared
                 * GEMMs no longer overlap the routed ones. */
                const char *sr = getenv("LUNAR_MOE_SHARED_ROW");
                const dmat *sg = &d->sg, *su = &d->su, *sd = &d->sd;
                if (sr && !strcmp(sr, "1") && !c->routed_expert_hidden_size && !m->tp && sg->p && su->p &&
                    sd->p && !sg->s8 && !su->s8 && !sd->s8 && sg->out == I && sg->in == De && su->out == I &&
                    su->in == De && sd->out == De && sd->in == I)
                    X->s1 = sg->p, X->s3 = su->p, X->s2 = sd->p;
            }
            /* MXFP4 experts widened to BF16 for the generic path: only where the fused path cannot
             * take the layer or LUNAR_CUDA_MOE=generic asks for that path at upload (session 19: the
             * widened copies are 3.8x the packed bytes, so with them a full K3.1 MoE layer took 75 GB
             * of the device instead of 15.7, and the TP8 slice's bench fit 10 layers) */
            const int widen = !d->fused_ok || generic_at_upload();
            d->generic_off = c->experts_mxfp4 && !widen;
            for (int e = 0; e < E; e++) {
                const lunar_expert_weights *x = &f->experts[e];
                if (c->experts_mxfp4 && x->q1.packed) {
                    if (widen)
                        d->w1[e] = up_mxfp4(&x->q1), d->w3[e] = up_mxfp4(&x->q3), d->w2[e] = up_mxfp4(&x->q2);
                } else if (!d->fused_ok) {
                    d->w1[e] = up_mat(x->w1), d->w3[e] = up_mat(x->w3), d->w2[e] = up_mat(x->w2);
                }
            }
        }
    }
}

static void free_host_side(lunar_cuda_model *g) {
    if (g->L)
        for (int l = 0; l < g->m->cfg.num_hidden_layers; l++) free(g->L[l].w1), free(g->L[l].w2), free(g->L[l].w3);
    free(g->L);
    free(g);
}

size_t lunar_cuda_model_bytes(const lunar_model *m) {
    lunar_cuda_model *g = lunar_xcalloc(1, sizeof *g);
    counting = 1, counted = 0;
    upload_weights(g, m);
    counted += ptpc_tmp;
    counting = 0;
    free_host_side(g);
    return counted;
}

int lunar_cuda_model_upload(lunar_cuda_model **out, const lunar_model *m, lunar_err *err) {
    *out = NULL;
    if (lunar_cuda_backend_init(DEFAULT_GPU_UTIL, err)) return -1;
    const size_t need = lunar_cuda_model_bytes(m), left = lunar_cuda_arena_size() - lunar_cuda_arena_used();
    if (need > left)
        return lunar_fail(err, "CUDA: the weights need %.2f GiB on the device, the arena has %.2f GiB left "
                               "(raise --gpu-memory-utilization)", need / 1073741824.0, left / 1073741824.0);
    lunar_cuda_model *g = lunar_xcalloc(1, sizeof *g);
    g->mark = lunar_cuda_mark();
    upload_weights(g, m);
    g->side = lunar_cuda_stream_create();
    g->ev_x = lunar_cuda_event_create(), g->ev_shared = lunar_cuda_event_create();
    /* the fused routed experts by default (no host round trip, one launch per step for all the
     * experts instead of ~10 per active expert, 11x the decode speed of Kimi-Linear at batch 1 on
     * the H200); LUNAR_CUDA_MOE=generic keeps the per-expert path reachable for comparison */
    g->fused_moe = !generic_at_upload();
    /* decode steps as CUDA graphs by default; LUNAR_CUDA_GRAPHS=0 (or lunar_cuda_model_graphs, the
     * CLI's --enforce-eager) runs every step eagerly, for comparison */
    const char *gr = getenv("LUNAR_CUDA_GRAPHS");
    g->graphs = lunar_cuda_fwd_graphs_new(!(gr && strcmp(gr, "0") == 0));
    lunar_cuda_sync();
    *out = g;
    return 0;
}

int lunar_cuda_model_fused_moe(lunar_cuda_model *g, int on) {
    int any = 0, whole = 1;
    for (int l = 0; l < g->m->cfg.num_hidden_layers; l++) any |= g->L[l].fused_ok, whole &= !g->L[l].generic_off;
    if (!on && !whole) return 0; /* MXFP4 experts uploaded without their widened copies: the fused path stays */
    g->fused_moe = on != 0;
    return on ? any : 1;
}

int lunar_cuda_model_combine_norm(lunar_cuda_model *g, int on) {
    const int was = g->combine_norm;
    g->combine_norm = on != 0;
    return was;
}
long lunar_cuda_model_combine_norm_folds(const lunar_cuda_model *g) { return g->combine_norm_folds; }

void lunar_cuda_model_free(lunar_cuda_model *g) {
    if (!g) return;
    lunar_cuda_sync();
    lunar_cuda_fwd_graphs_free(g->graphs);
    lunar_cuda_event_destroy(g->ev_x), lunar_cuda_event_destroy(g->ev_shared);
    lunar_cuda_stream_destroy(g->side);
    lunar_cuda_release(g->mark);
    free_host_side(g);
}

size_t lunar_cuda_arena_left(void) {
    return lunar_cuda_ready() ? lunar_cuda_arena_size() - lunar_cuda_arena_used() : 0;
}
const char *lunar_cuda_device_line(void) { return lunar_cuda_describe(); }


/* latent rows a block of 128 positions takes on this rank: 1/D of them under DCP */
static int latent_rows_of(const lunar_model *m) {
    return m->tp && m->tp->dcp_size > 1 ? LUNAR_BLOCK_SIZE / m->tp->dcp_size : LUNAR_BLOCK_SIZE;
}

size_t lunar_cuda_block_bytes(const lunar_model *m, int latent_fp8) {
    const lunar_config *k = &m->cfg;
    const size_t row = (size_t)k->kv_lora_rank + k->qk_rope_head_dim;
    const size_t idx = k->index_topk > 0 ? (size_t)k->index_head_dim + 4 : 0;
    return (size_t)k->n_mla_layers *
           ((size_t)latent_rows_of(m) * row * (latent_fp8 ? 1 : 2) + (size_t)LUNAR_BLOCK_SIZE * idx);
}


size_t lunar_cuda_slot_bytes(const lunar_model *m, int state_fp16) {
    const lunar_config *k = &m->cfg;
    const size_t HD = (size_t)k->kda_num_heads * k->kda_head_dim;
    return (size_t)k->n_kda_layers * (3 * HD * (k->kda_conv_size - 1) * 4 + HD * k->kda_head_dim * (state_fp16 ? 2 : 4));
}

/* An upper bound of the step's temporaries (forward_batch below, layer by layer: what stays for
 * the whole step plus the largest layer's own buffers), 256-byte rounding and the kernels'
 * workspaces included. */
size_t lunar_cuda_step_bytes(const lunar_model *m, int max_tokens, int max_rows, int max_len) {
    const lunar_config *c = &m->cfg;
    max_len = decode_len_bucket(max_len); /* what a decode step plans with */
    const size_t T = (size_t)max_tokens, D = c->hidden_size, V = c->vocab_size;
    const size_t HD = (size_t)c->kda_num_heads * c->kda_head_dim, nh = c->num_attention_heads;
    const size_t qk = (size_t)c->qk_nope_head_dim + c->qk_rope_head_dim, R = c->kv_lora_rank,
                 P = c->qk_rope_head_dim, Vd = c->v_head_dim;
    const size_t nb = c->attn_res_block_size > 0 ? (size_t)c->num_hidden_layers / c->attn_res_block_size + 3 : 0;
    size_t step = 4 * (T * 8 + (4 + nb) * T * D + (size_t)max_rows * (D + V)) + 64 * 256;
    step += 2 * T * D + 256; /* run_residual's bf16 copy of h */
    size_t widest = D; /* the widest GEMM input (its bf16 copy) */
    /* the split path: pre, q, k, v, g, o [T, H dk], low [T, dk], beta; the fused prefill (kda_layer's
     * pf): y [T, 3 H dk + 2 dk + H] (holding pre, g, o later), q, k, v, beta, two bf16 [T, dk] */
    size_t kda = 4 * (6 * T * HD + 3 * T * c->kda_head_dim + 2 * T * c->kda_num_heads) + 8 * 256;
    if (HD) {
        if (HD > widest) widest = HD;
        if (c->kda_head_dim == 128) kda += lunar_cuda_kda_chunk_ws(max_tokens, c->kda_num_heads);
    }
    const size_t ni = c->index_n_heads, di = c->index_head_dim, topk = c->index_topk;
    size_t mla = 4 * (T * nh * qk + T * (R + P) + T * nh * Vd + T * c->q_lora_rank + 2 * T * nh * R +
                      T * nh * P + T * nh * Vd);
    if (topk) mla += 4 * (T * ni * di + T * di + T * ni + T * topk + T * (size_t)max_len);
    if (R == 512 && P == 64) mla += lunar_cuda_mla_ws(max_tokens, (int)nh, topk ? (int)topk : max_len);
    if (R == 512 && P == 64 && !topk && max_tokens >= MLA_PREFILL_GEMM_MIN) { /* either prefill form: the larger */
        const size_t a = lunar_glue_mla_prefill_ws(max_tokens, (int)nh, max_len),
                     f = lunar_glue_mla_flash_ws(max_tokens, (int)nh, max_len, 0);
        mla += (a > f ? a : f) + 256;
    }
    mla += 4 * nh * ((size_t)c->qk_nope_head_dim + Vd) * R + 256; /* the absorption's fp32 weights */
    if (m->tp && m->tp->dcp_size > 1) mla += lunar_cuda_dcp_step_bytes(m, T);
    if (nh * Vd > widest) widest = nh * Vd;
    const size_t E = c->num_experts, k = c->num_experts_per_token;
    const size_t De = c->routed_expert_hidden_size ? (size_t)c->routed_expert_hidden_size : D;
    size_t I = (size_t)c->intermediate_size;
    const size_t Ie = (size_t)c->moe_intermediate_size * (c->num_shared_experts > 1 ? c->num_shared_experts : 1);
    if (Ie > I) I = Ie;
    if (I > widest) widest = I;
    /* the generic MoE's gathers and GLU, or the fused path's bf16 copies, shared-expert buffers,
     * permuted rows (k per token) and route tables */
    size_t ffn = 4 * (T * E + 2 * T * k + 4 * T * De + 2 * T * D + 4 * T * I) + 16 * 256;
    if (E) ffn += 4 * T * k * (De + I) + lunar_cuda_moe_route_bytes(max_tokens, (int)k, (int)E);
    size_t layer = kda > mla ? kda : mla;
    if (ffn > layer) layer = ffn;
    return step + layer + T * widest * 2 + ((size_t)16 << 20);
}


int lunar_cuda_caches_init(lunar_cuda_caches *c, const lunar_model *m, int n_blocks, int n_slots, int flags,
                           lunar_err *err) {
    const lunar_config *k = &m->cfg;
    memset(c, 0, sizeof *c);
    if (!lunar_cuda_ready()) return lunar_fail(err, "CUDA caches: the device is not initialised");
    c->mark = lunar_cuda_mark();
    c->n_blocks = n_blocks, c->n_slots = n_slots;
    c->n_mla = k->n_mla_layers, c->n_kda = k->n_kda_layers;
    c->row = k->kv_lora_rank + k->qk_rope_head_dim;
    c->idx_dim = k->index_topk > 0 ? k->index_head_dim : 0;
    const size_t toks = (size_t)c->n_mla * n_blocks * LUNAR_BLOCK_SIZE; /* index keys: every position */
    c->latent_rows = latent_rows_of(m);
    const size_t lat_rows = (size_t)c->n_mla * n_blocks * c->latent_rows;
    const int HD = k->kda_num_heads * k->kda_head_dim;
    c->conv_len = (size_t)3 * HD * (k->kda_conv_size - 1);
    c->state_len = (size_t)k->kda_num_heads * k->kda_head_dim * k->kda_head_dim;
    c->latent_fp8 = (flags & LUNAR_CUDA_CACHE_FP8_LATENT) != 0;
    c->state_fp16 = (flags & LUNAR_CUDA_CACHE_FP16_STATE) != 0;
    const size_t state_bytes = (size_t)n_slots * c->n_kda * c->state_len * (c->state_fp16 ? 2 : 4) + 4;
    const size_t latent_bytes = lat_rows * c->row * (c->latent_fp8 ? 1 : 2) + 4;
    c->latent = lunar_cuda_alloc(latent_bytes);
    c->idx_codes = lunar_cuda_alloc(toks * (size_t)c->idx_dim + 4);
    c->idx_scales = lunar_cuda_alloc((c->idx_dim ? toks * 4 : 0) + 4); /* only with an indexer, as
                                                 lunar_cuda_block_bytes counts it */
    c->conv = lunar_cuda_alloc((size_t)n_slots * c->n_kda * c->conv_len * 4 + 4);
    c->state = lunar_cuda_alloc(state_bytes);
    if (!c->latent || !c->idx_codes || !c->idx_scales || !c->conv || !c->state) {
        lunar_cuda_release(c->mark);
        return lunar_fail(err, "CUDA caches: device arena exhausted (%d blocks, %d slots)", n_blocks, n_slots);
    }
    lunar_cuda_fill_u32(c->latent, 0, latent_bytes / 4);
    /* index keys too: a reader of positions nobody wrote (lunar bench's decode at a context it did
     * not prefill) must see zero codes and zero scales, not whatever the arena held (NaN scales) */
    lunar_cuda_fill_u32(c->idx_codes, 0, (toks * (size_t)c->idx_dim + 4) / 4);
    lunar_cuda_fill_u32(c->idx_scales, 0, ((c->idx_dim ? toks * 4 : 0) + 4) / 4);
    for (int s = 0; s < n_slots; s++) lunar_cuda_state_clear(c, s);
    return 0;
}

void lunar_cuda_caches_free(lunar_cuda_caches *c) {
    if (c->latent) lunar_cuda_release(c->mark);
    memset(c, 0, sizeof *c);
}

void lunar_cuda_state_copy(lunar_cuda_caches *c, int to, int from) {
    const size_t nc = (size_t)c->n_kda * c->conv_len, ns = (size_t)c->n_kda * c->state_len;
    if (to == from) return;
    if (nc) lunar_glue_copy(c->conv + (size_t)to * nc, c->conv + (size_t)from * nc, nc * 4, NULL);
    const size_t sb = ns * (c->state_fp16 ? 2 : 4);
    if (ns) lunar_glue_copy((char *)c->state + (size_t)to * sb, (char *)c->state + (size_t)from * sb, sb, NULL);
}

void lunar_cuda_state_clear(lunar_cuda_caches *c, int slot) {
    size_t nc = (size_t)c->n_kda * c->conv_len, ns = (size_t)c->n_kda * c->state_len;
    if (nc) lunar_cuda_fill_u32(c->conv + (size_t)slot * nc, 0, nc);
    const size_t sb = ns * (c->state_fp16 ? 2 : 4); /* a multiple of 4: state_len = H * dk * dk */
    if (ns) lunar_cuda_fill_u32((char *)c->state + (size_t)slot * sb, 0, sb / 4);
}

#endif
