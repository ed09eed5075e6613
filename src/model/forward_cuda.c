/* Kimi-family forward on the CUDA backend (see forward_cuda.h): model/forward.c op for op; the
 * step and its decode graphs here, the upload, caches and memory plan in forward_cuda_upload.c. */
#include "model/forward_cuda.h"

#ifndef LUNAR_HAVE_CUDA

int lunar_cuda_model_upload(lunar_cuda_model **out, const lunar_model *m, lunar_err *err) {
    (void)m;
    *out = NULL;
    return lunar_fail(err, "lunar was built without CUDA");
}
void lunar_cuda_model_free(lunar_cuda_model *g) { (void)g; }
int lunar_cuda_model_fused_moe(lunar_cuda_model *g, int on) {
    (void)g, (void)on;
    return 0;
}
int lunar_cuda_model_graphs(lunar_cuda_model *g, int on) {
    (void)g, (void)on;
    return 0;
}
int lunar_cuda_model_combine_norm(lunar_cuda_model *g, int on) {
    (void)g, (void)on;
    return 0;
}
long lunar_cuda_model_combine_norm_folds(const lunar_cuda_model *g) {
    (void)g;
    return 0;
}
int lunar_cuda_kda_decode_rows(int on) { return (void)on, -1; }
long lunar_cuda_kda_decode_rows_runs(void) { return 0; }
void lunar_cuda_model_graph_stats(const lunar_cuda_model *g, long *captures, long *replays, size_t *nodes,
                                  double *capture_s) {
    (void)g;
    if (captures) *captures = 0;
    if (replays) *replays = 0;
    if (nodes) *nodes = 0;
    if (capture_s) *capture_s = 0;
}
int lunar_cuda_backend_init(double gpu_memory_utilization, lunar_err *err) {
    (void)gpu_memory_utilization;
    return lunar_fail(err, "lunar was built without CUDA");
}
size_t lunar_cuda_model_bytes(const lunar_model *m) { (void)m; return 0; }
size_t lunar_cuda_block_bytes(const lunar_model *m, int latent_fp8) { (void)m, (void)latent_fp8; return 0; }
size_t lunar_cuda_slot_bytes(const lunar_model *m, int state_fp16) { (void)m, (void)state_fp16; return 0; }
size_t lunar_cuda_step_bytes(const lunar_model *m, int max_tokens, int max_rows, int max_len) {
    (void)m, (void)max_tokens, (void)max_rows, (void)max_len;
    return 0;
}
void lunar_cuda_state_copy(lunar_cuda_caches *c, int to, int from) { (void)c, (void)to, (void)from; }
size_t lunar_cuda_arena_left(void) { return 0; }
const char *lunar_cuda_device_line(void) { return "no CUDA"; }
int lunar_cuda_caches_init(lunar_cuda_caches *c, const lunar_model *m, int n_blocks, int n_slots, int flags,
                           lunar_err *err) {
    (void)c, (void)m, (void)n_blocks, (void)n_slots, (void)flags;
    return lunar_fail(err, "lunar was built without CUDA");
}
void lunar_cuda_caches_free(lunar_cuda_caches *c) { (void)c; }
void lunar_cuda_state_clear(lunar_cuda_caches *c, int slot) { (void)c, (void)slot; }
int lunar_forward_batch_cuda(const lunar_cuda_model *g, lunar_cuda_caches *c,
                             const lunar_batch_seq *seqs, int n_seqs, float *logits, lunar_err *err) {
    (void)g, (void)c, (void)seqs, (void)n_seqs, (void)logits;
    return lunar_fail(err, "lunar was built without CUDA");
}
int lunar_forward_batch_cuda_sampled(const lunar_cuda_model *g, lunar_cuda_caches *c, const lunar_batch_seq *seqs,
                                     int n_seqs, float *logits, const lunar_device_sampling *ds, int32_t *ids,
                                     lunar_err *err) {
    (void)g, (void)c, (void)seqs, (void)n_seqs, (void)logits, (void)ds, (void)ids;
    return lunar_fail(err, "lunar was built without CUDA");
}
int lunar_cuda_seq_init(lunar_cuda_seq *s, const lunar_model *m, int max_tokens, int flags, lunar_err *err) {
    (void)s, (void)m, (void)max_tokens, (void)flags;
    return lunar_fail(err, "lunar was built without CUDA");
}
void lunar_cuda_seq_reset(lunar_cuda_seq *s) { (void)s; }
void lunar_cuda_seq_free(lunar_cuda_seq *s) { (void)s; }
int lunar_forward_cuda(const lunar_cuda_model *g, lunar_cuda_seq *s, const int32_t *ids, int n,
                       float *logits, int all_logits, lunar_err *err) {
    (void)g, (void)s, (void)ids, (void)n, (void)logits, (void)all_logits;
    return lunar_fail(err, "lunar was built without CUDA");
}

#else

#include "model/forward_cuda_internal.h"

/* the decode graphs' table (see "decode graphs" below) */
#define GRAPH_SLOTS 32

typedef struct graph_key {
    const void *latent, *idx_codes, *idx_scales, *conv, *state; /* the caches the graph writes */
    int n_blocks, n_slots, n_seqs, rows, max_len, sampled, fused_moe;
    size_t mark;
} graph_key;

typedef struct graph_ent {
    graph_key k;
    int seen;               /* eager steps of this key so far */
    lunar_cuda_graph x;     /* NULL until captured */
    const void *in;         /* the input block's address at capture */
    const void *bank;       /* the AttnRes bank's (right after the block; NULL without AttnRes) */
    const float *lg;        /* the logits rows' device address at capture */
    const int32_t *did;     /* the sampled ids' */
    unsigned long used;
} graph_ent;

struct lunar_cuda_graphs {
    int on;
    unsigned long tick;
    long captures, replays;
    size_t nodes;     /* of the last capture */
    double capture_s; /* host time of all captures + instantiations */
    graph_ent e[GRAPH_SLOTS];
};

/* ------------------------------------------------------------------ the step */

typedef struct dstep {
    const lunar_batch_seq *seqs;
    int n_seqs, T, max_blocks, max_len;
    int *off;            /* host [n_seqs + 1] */
    int32_t *row_seq, *lens, *pos, *slots, *bt; /* device: per token; block tables [n_seqs, max_blocks] */
    int32_t *zero;       /* device [1] = 0 */
    lunar_cuda_caches *c;
    /* a decode step (every sequence one token): sequence j's KDA conv / recurrent state as an index
     * into layer ki's pools (cache base + ki * conv_len, stride HD * (K - 1); + ki * state_len,
     * stride state_len), so each KDA layer takes one launch per op for the batch; NULL otherwise */
    int32_t *kda_conv_idx, *kda_state_idx;
    /* AttnRes (run_attn_res): the bank of ares_n slots [T, D] and its slots' device pointer table */
    float *ares_bank;
    const float *const *ares_tab;
    int ares_n;
} dstep;

static float *fd(size_t n) { return lunar_cuda_fwd_alloc(n * sizeof(float)); }

/* `lunar bench --profile` on CUDA: a region waits for the whole device before and after (both
 * streams), so its host wall time is its ops' device time plus their launches. The price is the
 * shared experts' overlap with the routed ones (timed apart here), and the syncs themselves:
 * profiled steps are slower than timed ones, the shares are what the profile is for. */
static double cp_begin(void) {
    if (!lunar_prof_active) return 0.0;
    lunar_cuda_sync();
    return lunar_prof_now();
}
static void cp_end(lunar_prof_family f, double t0) {
    if (!lunar_prof_active) return;
    lunar_cuda_sync();
    lunar_prof_end(f, t0);
}

/* LUNAR_STEP_EVENTS=1 (a diagnostic for `lunar bench`; 2: a line per layer too): a prefill step
 * (64+ rows, not a decode step: never captured; without AttnRes) records a device event, and the host's clock, at its start, around each
 * layer's attention and at the end of its enqueueing, and reports on stderr where its wall time
 * went: host preparation and upload, the device span by part (attention per kind, FFN with its
 * norms per kind, the head), the host's lag (whether the device ever waited for a launch), the
 * download and synchronisation. Nothing synchronises before the step's own final sync, so the
 * step runs as timed (an event record costs no device time). ncu sums kernel durations only: the
 * span minus that sum is the launch gaps and the side stream's overlap. */
#define SEV_MAX 1024
static struct {
    int on, live, L;
    lunar_cuda_event e[SEV_MAX];
    double host[SEV_MAX], t_entry, t_enq;
} sev;
/* event i: 0 start, 1 + 2 l + p layer l (p 0: before its attention, 1: after), 1 + 2 L the final
 * norm's end, 2 + 2 L the enqueue's end */
static void sev_rec(int i) {
    if (!sev.live || i < 0 || i >= SEV_MAX) return;
    if (!sev.e[i]) sev.e[i] = lunar_cuda_event_create();
    lunar_cuda_event_record(sev.e[i], NULL);
    sev.host[i] = lunar_prof_now();
}
static void step_ev(int l, int p) { sev_rec(1 + 2 * l + p); }
static void sev_begin(const lunar_config *c, int T, int decode) {
    if (!sev.on) {
        const char *v = getenv("LUNAR_STEP_EVENTS");
        sev.on = v && atoi(v) > 0 ? atoi(v) : -1;
    }
    sev.live = sev.on > 0 && T >= 64 && !decode && c->attn_res_block_size <= 0 && !lunar_cuda_capturing() &&
               3 + 2 * c->num_hidden_layers <= SEV_MAX;
    sev.L = c->num_hidden_layers;
    sev.t_entry = lunar_prof_now();
}
static void sev_report(const lunar_config *c, int T) {
    if (!sev.live) return;
    sev.live = 0;
    const double t_done = lunar_prof_now();
    const int L = sev.L, last = 2 + 2 * L;
    double d[SEV_MAX], attn[2] = {0, 0}, ffn[2] = {0, 0}, lag = 0;
    int na[2] = {0, 0}, nf[2] = {0, 0}, lagged = 0;
    for (int i = 0; i <= last; i++) {
        d[i] = i ? lunar_cuda_event_ms(sev.e[0], sev.e[i]) : 0.0;
        const double hl = 1e3 * (sev.host[i] - sev.host[0]) - d[i]; /* > 0: the device reached it first */
        if (hl > lag) lag = hl;
        lagged += hl > 0.02;
    }
    for (int l = 0; l < L; l++) {
        const int ka = c->attn_kind[l] == LUNAR_ATTN_KDA, kf = c->ffn_kind[l] == LUNAR_FFN_MOE;
        const double a = d[2 + 2 * l] - d[1 + 2 * l], f = d[3 + 2 * l] - d[2 + 2 * l];
        attn[ka] += a, na[ka]++, ffn[kf] += f, nf[kf]++;
        if (sev.on > 1)
            fprintf(stderr, "lunar step events: layer %2d %s %.3f ms, %s + norms %.3f ms\n", l, ka ? "KDA" : "MLA", a,
                    kf ? "MoE" : "dense", f);
    }
    fprintf(stderr,
            "lunar step events: T=%d wall %.3f ms = host prep+upload %.3f + enqueue %.3f + download/sync %.3f; "
            "device span %.3f ms: embed+norm %.3f, MLA attn %.3f (%d), KDA attn %.3f (%d), dense FFN %.3f (%d), "
            "MoE FFN %.3f (%d) [FFN: with the next attention norm], final norm..head %.3f; host behind the "
            "device at %d of %d marks (max %.3f ms)\n",
            T, 1e3 * (t_done - sev.t_entry), 1e3 * (sev.host[0] - sev.t_entry), 1e3 * (sev.t_enq - sev.host[0]),
            1e3 * (t_done - sev.t_enq), d[last], d[1], attn[0], na[0], attn[1], na[1], ffn[0], nf[0], ffn[1], nf[1],
            d[last] - d[1 + 2 * L], lagged, last + 1, lag);
}

/* y[n, W.out] = xb[n, W.in] . W^T on stream st: cuBLASLt where its alignment holds, else the
 * generic kernel (any shape) */
static int glue_gemm_only(void) { /* LUNAR_CUDA_GLUE_GEMM: every GEMM through the generic kernel */
    static int glue_only = -1;
    if (glue_only < 0) glue_only = getenv("LUNAR_CUDA_GLUE_GEMM") != NULL;
    return glue_only;
}
/* PTPC-FP8 of x (bf16, or fp32: rounded to bf16 by the quantiser, as the GEMM operand): decode rows
 * in one launch (lunar_cuda_ptpc_gemv), else x's per-token codes into scratch, then the FP8 GEMM. On
 * a side stream the scratch stays until the caller's mark (the main stream may reuse released
 * memory at once) */
static void mm_fp8(float *y, const void *x, lunar_cuda_dtype xdt, const dmat *W, int n, lunar_cuda_stream st) {
    const uint8_t *qw = (const uint8_t *)W->p;
    if (lunar_cuda_ptpc_gemv(y, LUNAR_CUDA_F32, x, xdt, qw, W->s8, n, W->out, W->in, st) == 0) return;
    size_t mk = lunar_cuda_mark();
    uint8_t *qx = lunar_cuda_fwd_alloc((size_t)n * W->in);
    float *sx = lunar_cuda_fwd_alloc((size_t)n * 4);
    lunar_cuda_ptpc_quantize(qx, sx, x, xdt, n, W->in, st);
    lunar_cuda_ptpc_matmul(y, LUNAR_CUDA_F32, qx, sx, qw, W->s8, n, W->out, W->in, st);
    if (!st) lunar_cuda_release(mk);
}
static void mm_b(float *y, const uint16_t *xb, const dmat *W, int n, lunar_cuda_stream st) {
    if (W->s8) {
        mm_fp8(y, xb, LUNAR_CUDA_BF16, W, n, st);
        return;
    }
    /* the skinny kernel takes any out (the K3.1 TP8 slice's KDA input projection has 12 beta rows at
     * the end, so out % 8 == 4: it went through the generic glue kernel), cuBLASLt's path out % 8 == 0 */
    if (!glue_gemm_only() && W->in % 8 == 0 &&
        lunar_cuda_matmul_bf16x(y, LUNAR_CUDA_F32, xb, W->p, n, W->out, W->in, st) == 0)
        return;
    if (!glue_gemm_only() && W->in % 8 == 0 && W->out % 8 == 0)
        lunar_cuda_matmul(y, LUNAR_CUDA_F32, xb, W->p, n, W->out, W->in, st);
    else
        lunar_glue_matmul(y, xb, W->p, n, W->out, W->in, st);
}

/* y[n, W.out] = x[n, W.in] . W^T, x rounded to bf16 (the GEMM operand) */
static void mm(float *y, const float *x, const dmat *W, int n) {
    if (n <= 0) return;
    if (W->s8) { /* the quantiser (or the decode kernel) rounds x to bf16 itself */
        mm_fp8(y, x, LUNAR_CUDA_F32, W, n, NULL);
        return;
    }
    /* decode rows: the skinny kernel rounds x itself (one launch instead of two), at any out */
    if (!glue_gemm_only() && W->in % 8 == 0 &&
        lunar_cuda_matmul_f32x(y, LUNAR_CUDA_F32, x, W->p, n, W->out, W->in, NULL) == 0)
        return;
    size_t mk = lunar_cuda_mark();
    uint16_t *xb = lunar_cuda_fwd_alloc((size_t)n * W->in * 2);
    lunar_cuda_f32_to_bf16(xb, x, (size_t)n * W->in);
    mm_b(y, xb, W, n, NULL);
    lunar_cuda_release(mk); /* stream-ordered: later allocations are used after this launch */
}

/* into[n, W.out] += x . W^T (+ add, or NULL) in the skinny kernel's epilogue, where it takes the shape
 * (decode rows): the bits of mm into t, t += add, into += t (lunar_cuda_matmul_f32x_into), one launch
 * instead of three. Returns 1 where it ran, else 0 with nothing launched (the caller runs mm and the
 * adds). into = NULL: 0. */
static int mm_into(float *into, const float *x, const dmat *W, int n, const float *add) {
    if (!into || n <= 0 || W->s8 || glue_gemm_only() || W->in % 8) return 0;
    return lunar_cuda_matmul_f32x_into(into, x, W->p, n, W->out, W->in, add, NULL) == 0;
}

/* a bf16 copy of x [n] in a new arena buffer */
static const uint16_t *bf16_copy(const float *x, size_t n) {
    uint16_t *b = lunar_cuda_fwd_alloc(n * 2);
    lunar_cuda_f32_to_bf16(b, x, n);
    return b;
}

/* into (or NULL): as mm_into for the down projection; returns 1 where it took the output (y unwritten) */
static int glu(const lunar_config *c, float *y, const float *x, const dmat *gate, const dmat *up,
               const dmat *down, int n, float *into) {
    if (n <= 0) return 0;
    size_t mk = lunar_cuda_mark();
    const int I = gate->out;
    float *a = fd((size_t)n * I), *b = fd((size_t)n * I);
    mm(a, x, gate, n);
    mm(b, x, up, n);
    if (c->act_situ)
        lunar_cuda_situ_mul(a, LUNAR_CUDA_F32, a, b, (int64_t)n * I, c->situ_beta, c->situ_linear_beta, NULL);
    else
        lunar_cuda_silu_mul(a, LUNAR_CUDA_F32, a, b, (int64_t)n * I, NULL);
    const int done = mm_into(into, a, down, n, NULL);
    if (!done) mm(y, a, down, n);
    lunar_cuda_release(mk);
    return done;
}

static int kda_gate_old(void) { /* LUNAR_KDA_GATE=old: the prefill's f_b GEMM, then the gate pass */
    static int v = -1;
    if (v < 0) v = getenv("LUNAR_KDA_GATE") && strcmp(getenv("LUNAR_KDA_GATE"), "old") == 0;
    return v;
}

/* the multi-row decode path of kda_layer: -1 the environment's choice (LUNAR_KDA_DECODE_ROWS), else on / off */
static int kda_rows = -1;
static long kda_rows_runs;
int lunar_cuda_kda_decode_rows(int on) {
    const int prev = kda_rows;
    kda_rows = on;
    return prev;
}
long lunar_cuda_kda_decode_rows_runs(void) { return kda_rows_runs; }

/* into (or NULL): the output added into it where mm_into takes o_proj (returns 1, out unwritten) */
static int kda_layer(const lunar_config *c, const dlayer *w, const dstep *b, int ki, const float *h,
                     const uint16_t *hb_in, float *out, float *into, int mode, int prefill_mode) {
    const int H = c->kda_num_heads, dk = c->kda_head_dim, HD = H * dk, K = c->kda_conv_size, n = b->T;
    size_t mk = lunar_cuda_mark();
    const int dec = b->kda_conv_idx && dk == 128;
    const int gout = w->g.p ? w->g.out : w->ga.out;
    /* decode with the fused matrix (up_cat): one GEMM for the six projections of h, one launch for
     * the convolutions, norms and beta (lunar_cuda_kda_conv_qkv_decode), the low-rank and gate
     * inputs read in place: 10 launches fewer per layer. Batch 1 always; 3-16 rows (session 21:
     * the split path's ~17 launches a layer were most of a B = 8 step's; at 2 rows, where the fused
     * GEMM runs on the CUDA-core kernel, the K3.1 slice measured 3 % slower) where the gate projections
     * take strided rows (lunar_cuda_kda_gate_proj_rows: f_a and a low-rank g_a the widths of f_b's
     * and g_b's inputs; a full-rank gate's rows are copied out of the projection's output in one
     * strided copy); LUNAR_KDA_DECODE_ROWS=0 the split path above one row */
    if (kda_rows < 0) kda_rows = !(getenv("LUNAR_KDA_DECODE_ROWS") && atoi(getenv("LUNAR_KDA_DECODE_ROWS")) <= 0);
    const int rows_ok = kda_rows && n >= 3 && n <= 16 && w->kfg.p && w->fa.out == w->fb.in &&
                        (w->g.p ? gout == HD : gout == w->fb.in) && w->fb.in % 8 == 0 && w->kin.out % 4 == 0;
    const int one = dec && w->kin.p && (n == 1 || rows_ok);
    if (one && n > 1) kda_rows_runs++; /* a statistic for the tests (relaxed: one stream enqueues) */
    /* opt-in (mode: lunar_cuda_model.kda_decode, LUNAR_KDA_DECODE=nogate|fused): the convolutions,
     * the recurrence and the gated norm in one launch (lunar_cuda_kda_decode_fused), =fused the
     * gate projections inside it too where their input width is 128. Correct (bit-equal) but not
     * faster on the H200 under PDL: 40 / 60 nodes fewer, same / +0.13 ms (docs/benchmarks.md) */
    const int fused = one && n == 1 && mode != KDA_DECODE_SPLIT && dk == 128 && K <= 8;
    lunar_cuda_kda_gate_rows gr = {0};
    /* q and k adjacent (k 256-byte aligned as an allocation would be): where nothing pads between
     * them, their L2 norms (per head row) are one launch over 2 n H rows */
    const size_t qk_stride = one ? (size_t)n * HD : ((size_t)n * HD + 63) / 64 * 64;
    /* prefill through the fused projection (prefill_mode, lunar_cuda_model.kda_prefill): its output
     * y [n, kin.out] (q|k|v|f_a|g_a|b) goes through one pass (lunar_cuda_kda_conv_qkv_prefill) that
     * leaves q, k, v, beta and the bf16 f_a / g_a outputs; y is dead after it and holds pre, g and o
     * (3 n H dk <= n kin.out floats) */
    const int pf = prefill_mode && !dec && dk == 128 && K <= 8 && w->kin.p && !w->g.p && w->kin.out % 4 == 0 &&
                   w->fa.out == w->fb.in && w->ga.out == w->gb.in;
    float *yp = pf ? fd((size_t)n * w->kin.out) : NULL;
    float *pre = pf ? yp : fd((size_t)n * HD), *q = fd(2 * qk_stride + (one ? (size_t)n * HD : 0)), *k = q + qk_stride;
    float *v = one ? q + 2 * (size_t)n * HD : fd((size_t)n * HD);
    float *g = pf ? yp + (size_t)n * HD : fd((size_t)n * HD), *low = pf ? NULL : fd((size_t)n * dk);
    /* o at the end of y's spare room rather than right after g: with n H dk a power of two (8192 tokens
     * x 4096 = 128 MiB) g and o would otherwise lie exactly a power of two apart, and the chunk kernel,
     * reading g[t] as it writes o[t], measured 1.6-1.9 ms slower per 8K prefill than with the split
     * path's separate buffers (an address-aliasing guess this placement tests) */
    const size_t o_off = pf ? 2 * (size_t)n * HD + ((size_t)n * (w->kin.out - 3 * HD)) / 64 * 64 : 0;
    float *beta = fd((size_t)n * H), *o = pf ? yp + o_off : fd((size_t)n * HD);
    uint16_t *fa16 = pf ? lunar_cuda_fwd_alloc((size_t)n * w->fa.out * 2) : NULL;
    uint16_t *ga16 = pf ? lunar_cuda_fwd_alloc((size_t)n * w->ga.out * 2) : NULL;
    const size_t state_stride = (size_t)HD * (K - 1);
    const dmat *proj[3] = {&w->q, &w->k, &w->v};
    const float *conv[3] = {w->qc, w->kc, w->vc};
    float *dst[3] = {q, k, v};
    double t0 = cp_begin();
    const uint16_t *hb = hb_in; /* h's bf16 copy: from the norm (run_residual), or made below */
    float *gin = NULL; /* one: the gate's projection (g, or g_a) in the fused output */
    int gate_done = 0; /* one: pre already holds the output gate's pre-activation */
    float *y = NULL, *beta_in = NULL; /* one: the fused projection's outputs, beta's logits among them */
    if (one) {
        y = fd((size_t)n * w->kin.out);
        beta_in = y + 3 * HD + w->fa.out + gout;
        mm(y, h, &w->kin, n);
        if (!fused)
            lunar_cuda_kda_conv_qkv_decode(q, beta, y, beta_in, w->kin.out, w->qc, b->c->conv + ki * b->c->conv_len,
                                           b->kda_state_idx, n, H, dk, K, KDA_L2_EPS, NULL);
        gin = y + 3 * HD + w->fa.out;
        /* the gate projections and the gate in one launch where f_a and g_a outputs lie as it reads
         * them (adjacent, each the width of the next matrix's input) */
        if (fused && mode == KDA_DECODE_FUSED && w->kfg.p && w->fa.out == 128 && w->fb.in == 128 &&
            (w->g.p || gout == 128)) {
            gr = (lunar_cuda_kda_gate_rows){w->kfg.p, y + 3 * HD, w->A_log, w->dt_bias, c->kda_gate_lower_bound,
                                            !w->g.p};
            if (!w->g.p) gin = NULL; /* the fused core makes the output gate too */
        } else if (w->kfg.p && w->fa.out == w->fb.in && (w->g.p || gout == w->fb.in) && w->fb.in % 8 == 0) {
            lunar_cuda_kda_gate_proj_rows(g, w->g.p ? NULL : pre, y + 3 * HD, w->kin.out, n, w->kfg.p, H, dk,
                                          w->fb.in, w->A_log, w->dt_bias, c->kda_gate_lower_bound, NULL);
            if (!w->g.p) {
                gin = NULL, gate_done = 1; /* pre holds g_b's outputs */
            } else if (n > 1) { /* the full-rank gate's rows [n, H dk] out of y's */
                lunar_cuda_copy_2d(pre, (size_t)HD * 4, gin, (size_t)w->kin.out * 4, (size_t)HD * 4, (size_t)n);
                gin = NULL, gate_done = 1;
            }
        } else {
            mm(pre, y + 3 * HD, &w->fb, n);
            lunar_cuda_kda_gate(g, pre, w->A_log, w->dt_bias, n, H, dk, c->kda_gate_lower_bound, NULL);
        }
    } else if (pf) {
        if (!hb) hb = bf16_copy(h, (size_t)n * c->hidden_size);
        mm_b(yp, hb, &w->kin, n, NULL);
        const int a_off = 3 * HD, g_off = a_off + w->fa.out, b_off = g_off + w->ga.out;
        for (int j = 0; j < b->n_seqs; j++) {
            const size_t t = (size_t)b->off[j];
            float *st = b->c->conv + ((size_t)b->seqs[j].slot * b->c->n_kda + ki) * b->c->conv_len;
            lunar_cuda_kda_conv_qkv_prefill(q + t * HD, k + t * HD, v + t * HD, beta + t * H, fa16 + t * w->fa.out,
                                            ga16 + t * w->ga.out, yp + t * w->kin.out, w->kin.out, a_off, w->fa.out,
                                            g_off, w->ga.out, b_off, w->qc, st, b->seqs[j].n, H, dk, K, KDA_L2_EPS,
                                            NULL);
        }
        /* y is dead from here: pre, g, o live in it. The gate in f_b's epilogue (one write of g instead
         * of pre's write, read and g's write; LUNAR_KDA_GATE=old: cuBLAS + lunar_cuda_kda_gate) */
        if (kda_gate_old() || w->fb.s8 ||
            lunar_cuda_kda_gate_gemm(g, fa16, w->fb.p, n, H, dk, w->fb.in, w->A_log, w->dt_bias,
                                     c->kda_gate_lower_bound, NULL) != 0) {
            mm_b(pre, fa16, &w->fb, n, NULL);
            lunar_cuda_kda_gate(g, pre, w->A_log, w->dt_bias, n, H, dk, c->kda_gate_lower_bound, NULL);
        }
    } else {
        /* h's bf16 copy once for the six projections that read it (mm would make one each) */
        if (!hb) hb = bf16_copy(h, (size_t)n * c->hidden_size);
        for (int i = 0; i < 3; i++) {
            mm_b(pre, hb, proj[i], n, NULL);
            if (dec) {
                float *pool = b->c->conv + ki * b->c->conv_len + i * state_stride;
                lunar_cuda_short_conv_decode(dst[i], pre, conv[i], pool, b->kda_conv_idx, n, HD, K, NULL);
                continue;
            }
            for (int j = 0; j < b->n_seqs; j++) {
                const size_t r = (size_t)b->off[j] * HD;
                float *st = b->c->conv + ((size_t)b->seqs[j].slot * b->c->n_kda + ki) * b->c->conv_len +
                            i * state_stride;
                lunar_cuda_short_conv(dst[i] + r, pre + r, conv[i], st, b->seqs[j].n, HD, K, NULL);
            }
        }
        if (qk_stride == (size_t)n * HD) {
            lunar_cuda_l2norm(q, q, 2 * n * H, dk, KDA_L2_EPS, NULL);
        } else {
            lunar_cuda_l2norm(q, q, n * H, dk, KDA_L2_EPS, NULL);
            lunar_cuda_l2norm(k, k, n * H, dk, KDA_L2_EPS, NULL);
        }
        mm_b(low, hb, &w->fa, n, NULL);
        mm(pre, low, &w->fb, n);
        lunar_cuda_kda_gate(g, pre, w->A_log, w->dt_bias, n, H, dk, c->kda_gate_lower_bound, NULL);
        mm_b(beta, hb, &w->b, n, NULL);
        lunar_cuda_sigmoid_inplace(beta, (size_t)n * H);
    }
    cp_end(LUNAR_PROF_KDA_PROJ, t0);
    t0 = cp_begin();
    const float scale = 1.0f / sqrtf((float)dk);
    /* the fp16 state option: the recurrent kernel reads and rounds fp16 slots itself; the other
     * paths run on an fp32 copy of the slot, rounded back after the call (as the CPU rounds S) */
    const int f16 = b->c->state_fp16;
    const size_t sl = b->c->state_len;
    if (fused) {
        /* the output gate's pre-activation first: the fused core applies the gated norm */
        const float *og = gr.og ? NULL : pre;
        if (gin && w->g.p) og = gin;
        else if (gin) mm(pre, gin, &w->gb, n);
        void *S = f16 ? (void *)((uint16_t *)b->c->state + ki * sl) : (void *)((float *)b->c->state + ki * sl);
        lunar_cuda_kda_decode_fused(o, y, w->kin.out, beta_in, w->qc, b->c->conv + ki * b->c->conv_len,
                                    b->kda_state_idx, gr.w ? NULL : g, og, w->o_norm, S, f16, b->kda_state_idx, 1, H,
                                    dk, K, KDA_L2_EPS, c->rms_norm_eps, scale, gr.w ? &gr : NULL, NULL);
    } else if (dec && f16)
        lunar_cuda_kda_recurrent_f16(o, q, k, v, g, beta, (uint16_t *)b->c->state + ki * sl, b->kda_state_idx, NULL,
                                     n, 1, H, dk, dk, scale, NULL);
    else if (dec)
        lunar_cuda_kda_recurrent(o, q, k, v, g, beta, (float *)b->c->state + ki * sl, b->kda_state_idx, NULL,
                                 n, 1, H, dk, dk, scale, NULL);
    float *S32 = f16 && !dec ? fd(sl) : NULL;
    for (int j = 0; j < b->n_seqs && !dec; j++) {
        const int nj = b->seqs[j].n;
        const size_t r = (size_t)b->off[j] * HD, at = ((size_t)b->seqs[j].slot * b->c->n_kda + ki) * sl;
        uint16_t *S16 = f16 ? (uint16_t *)b->c->state + at : NULL;
        float *S = f16 ? S32 : (float *)b->c->state + at;
        const float *bj = beta + (size_t)b->off[j] * H;
        if (dk == 128 && nj == 1 && f16) {
            lunar_cuda_kda_recurrent_f16(o + r, q + r, k + r, v + r, g + r, bj, S16, b->zero, NULL, 1, 1, H,
                                         dk, dk, scale, NULL);
            continue;
        }
        if (f16) lunar_glue_f16_to_f32(S32, S16, sl, NULL);
        if (dk == 128 && nj == 1) {
            lunar_cuda_kda_recurrent(o + r, q + r, k + r, v + r, g + r, bj, S, b->zero, NULL, 1, 1, H,
                                     dk, dk, scale, NULL);
        } else if (dk == 128) {
            size_t m2 = lunar_cuda_mark();
            void *ws = lunar_cuda_fwd_alloc(lunar_cuda_kda_chunk_ws(nj, H));
            lunar_cuda_kda_chunked(o + r, q + r, k + r, v + r, g + r, bj, S, nj, H, scale, ws, NULL);
            lunar_cuda_release(m2);
        } else { /* generic head size: the recurrence token by token (prefill included) */
            lunar_glue_kda_recurrent(o + r, q + r, k + r, v + r, g + r, bj, S, nj, H, dk, dk, scale, NULL);
        }
        if (f16) lunar_glue_f32_to_f16(S16, S32, sl, NULL);
    }
    cp_end(LUNAR_PROF_KDA_CORE, t0);
    t0 = cp_begin();
    if (fused) {
        /* o is the gated norm's output already */
    } else if (gate_done) {
        /* lunar_cuda_kda_gate_proj_decode wrote it */
    } else if (pf) {
        mm_b(pre, ga16, &w->gb, n, NULL);
    } else if (gin && w->g.p) {
        pre = gin;
    } else if (gin) {
        mm(pre, gin, &w->gb, n);
    } else if (w->g.p) {
        mm_b(pre, hb, &w->g, n, NULL);
    } else {
        mm_b(low, hb, &w->ga, n, NULL);
        mm(pre, low, &w->gb, n);
    }
    int done = 0;
    if (!dec && n >= 64) {
        /* prefill rows: the norm writes o_proj's bf16 operand itself (the same rounding as mm's
         * conversion, one pass over [n, H dk] fp32 fewer) */
        uint16_t *ob = lunar_cuda_fwd_alloc((size_t)n * HD * 2);
        lunar_cuda_rmsnorm_gated(ob, LUNAR_CUDA_BF16, o, pre, w->o_norm, n * H, dk, c->rms_norm_eps, NULL);
        mm_b(out, ob, &w->o, n, NULL);
    } else {
        if (!fused) lunar_cuda_rmsnorm_gated(o, LUNAR_CUDA_F32, o, pre, w->o_norm, n * H, dk, c->rms_norm_eps, NULL);
        done = mm_into(into, o, &w->o, n, NULL);
        if (!done) mm(out, o, &w->o, n);
    }
    cp_end(LUNAR_PROF_KDA_OUT, t0);
    lunar_cuda_release(mk);
    return done;
}

/* a matrix fused into `whole` (up_cat): whether it is one of its slices, and its outputs within
 * y, one row of whole's outputs */
static int in_cat(const dmat *whole, const dmat *part) {
    return whole->p && part->p >= whole->p && part->p < whole->p + (size_t)whole->out * whole->in;
}
static float *cat_out(float *y, const dmat *whole, const dmat *part) {
    LUNAR_ASSERT(in_cat(whole, part));
    return y + (part->p - whole->p) / whole->in;
}

/* into: as kda_layer's */
static int mla_layer(const lunar_cuda_model *gm, const dlayer *w, const dstep *b, int ki,
                     const float *h, const uint16_t *hb_in, float *out, float *into) {
    const lunar_config *c = &gm->m->cfg;
    const int nh = c->num_attention_heads, N = c->qk_nope_head_dim, P = c->qk_rope_head_dim,
              Vd = c->v_head_dim, R = c->kv_lora_rank, qk = N + P, n = b->T, row = R + P;
    lunar_cuda_caches *kv = b->c;
    size_t mk = lunar_cuda_mark();
    float *q = fd((size_t)n * nh * qk), *kvr = fd((size_t)n * row), *o = fd((size_t)n * nh * Vd);
    float *qa = NULL;
    double t0 = cp_begin();
    /* batch 1 with the fused matrix (up_cat): every projection of h from one GEMM of fp32 h, the
     * outputs read in place (cat_out) */
    float *y1 = n == 1 && w->min.p ? fd((size_t)w->min.out) : NULL;
    const uint16_t *hb = NULL;
    if (y1)
        mm(y1, h, &w->min, 1);
    else /* h's bf16 copy for every projection of h: from the norm (run_residual), or made here */
        hb = hb_in ? hb_in : bf16_copy(h, (size_t)n * c->hidden_size);
    if (w->mq.p && y1) {
        q = cat_out(y1, &w->min, &w->mq);
    } else if (w->mq.p) {
        mm_b(q, hb, &w->mq, n, NULL);
    } else {
        qa = y1 ? cat_out(y1, &w->min, &w->qa) : fd((size_t)n * c->q_lora_rank);
        if (!y1) mm_b(qa, hb, &w->qa, n, NULL);
        lunar_cuda_rmsnorm(qa, LUNAR_CUDA_F32, qa, w->qa_norm, n, c->q_lora_rank, MLA_LATENT_NORM_EPS, NULL);
        mm(q, qa, &w->qb, n);
    }
    /* latent row = [RMSNorm(c) | k_pe], stored bf16 (or FP8) into the pages */
    if (y1)
        kvr = cat_out(y1, &w->min, &w->kva);
    else
        mm_b(kvr, hb, &w->kva, n, NULL);
    const size_t layer_toks = (size_t)kv->n_blocks * LUNAR_BLOCK_SIZE;
    const int fp8 = kv->latent_fp8, dcp = gm->m->tp && gm->m->tp->dcp_size > 1; /* DCP: stored below */
    void *latent = (char *)kv->latent + (size_t)ki * kv->n_blocks * kv->latent_rows * row * (fp8 ? 1 : 2);
    if (!dcp) lunar_glue_latent_store(latent, fp8, kvr, w->kva_norm, b->slots, n, R, P, MLA_LATENT_NORM_EPS, NULL);

    const int ni = c->index_n_heads, di = c->index_head_dim, topk = c->index_topk;
    int32_t *idx = NULL;
    cp_end(LUNAR_PROF_MLA_PROJ, t0);
    if (topk > 0) {
        t0 = cp_begin(); /* K3.1 DSA indexer: projections, rotation, FP8 key write, scores, top-k */
        float *iq = fd((size_t)n * ni * di), *ik = fd((size_t)n * di), *wt = fd((size_t)n * ni);
        mm(iq, qa, &w->iwq, n);
        if (y1) { /* min holds both indexer matrices wherever it exists (upload_weights) */
            ik = cat_out(y1, &w->min, &w->iwk), wt = cat_out(y1, &w->min, &w->iwp);
        } else {
            mm_b(ik, hb, &w->iwk, n, NULL);
            mm_b(wt, hb, &w->iwp, n, NULL);
        }
        const float wscale = 1.0f / sqrtf((float)ni) / sqrtf((float)di);
        uint8_t *codes = kv->idx_codes + (size_t)ki * layer_toks * di;
        float *scales = kv->idx_scales + (size_t)ki * layer_toks;
        /* without RoPE the key's norm, rotation and FP8 write, the weights' scale and the queries'
         * rotation in one launch (the same bits as the four below); LUNAR_DSA_PREP=0 the four */
        static int prep = -1;
        if (prep < 0) prep = !(getenv("LUNAR_DSA_PREP") && atoi(getenv("LUNAR_DSA_PREP")) <= 0);
        if (!prep || c->index_rope ||
            lunar_cuda_dsa_index_prep(codes, scales, ik, iq, wt, b->slots, n, ni, di, w->ik_w, w->ik_b,
                                      INDEX_K_NORM_EPS, wscale, NULL) != 0) {
            lunar_glue_layernorm(ik, ik, w->ik_w, w->ik_b, n, di, INDEX_K_NORM_EPS, NULL);
            lunar_glue_scale(wt, wscale, (size_t)n * ni, NULL);
            if (c->index_rope) {
                lunar_glue_rope_neox(iq, gm->rope_inv, b->pos, n, ni, di, c->qk_rope_head_dim, NULL);
                lunar_glue_rope_neox(ik, gm->rope_inv, b->pos, n, 1, di, c->qk_rope_head_dim, NULL);
            }
            lunar_glue_hadamard(iq, n * ni, di, NULL);
            lunar_cuda_dsa_index_write(codes, scales, ik, b->slots, n, di, NULL); /* rotates ik itself */
        }
        idx = lunar_cuda_fwd_alloc((size_t)n * topk * sizeof(int32_t));
        float *scores = fd((size_t)n * b->max_len);
        lunar_cuda_dsa_index_score(scores, b->max_len, iq, wt, codes, scales, b->bt, b->max_blocks,
                                   b->row_seq, b->lens, b->max_len, n, ni, di, NULL);
        lunar_cuda_dsa_topk(idx, NULL, scores, b->max_len, b->lens, n, topk, NULL);
        cp_end(LUNAR_PROF_DSA, t0);
    }
    /* LUNAR_MLA_PREFILL: unset = the decompressed flash prefill (cuda_mla_flash.cu) where it
     * applies, =absorbed: the absorbed GEMM prefill (cuda_mla_prefill.cu), =kernel: the row
     * kernel for prefill too */
    static int prefill_mode = -1; /* 0 flash, 1 absorbed, 2 kernel */
    if (prefill_mode < 0) {
        const char *e = getenv("LUNAR_MLA_PREFILL");
        prefill_mode = e && strcmp(e, "absorbed") == 0 ? 1 : e && strcmp(e, "kernel") == 0 ? 2 : 0;
    }
    /* the one-sequence prefill through the flash or GEMM kernels (below), over the pages of table bt */
    const int prefill_gemm = R == 512 && P == 64 && topk <= 0 && b->n_seqs == 1 && n >= MLA_PREFILL_GEMM_MIN &&
                             prefill_mode != 2;
    const int32_t *bt = b->bt;
    if (dcp) { /* TP hook: the latent rows sharded over the DCP group (forward_cuda_tp.h) */
        lunar_cuda_dcp_layer a = {n,   b->bt, b->max_blocks, b->row_seq, b->pos,   b->max_len, latent, fp8,
                                  kvr, w->kva_norm, MLA_LATENT_NORM_EPS, q, w->kvb.p, idx};
        if (!(prefill_gemm && b->seqs[0].pos0 == 0)) {
            lunar_cuda_dcp_mla(gm->m, &a, o);
            goto out_proj;
        }
        /* a fresh prefill: this rank's rows stored, then one GPU's prefill over the whole chunk */
        lunar_cuda_dcp_store(gm->m, &a);
        int32_t *fresh_bt;
        latent = lunar_cuda_dcp_fresh_pages(&a, R, P, &fresh_bt);
        bt = fresh_bt;
    }
    const float scale = 1.0f / sqrtf((float)qk);
    /* also under DCP, over the fresh-prefill pages (session 5, 2 GPUs: cuda_dcp 10/10; KL48 TP 2 +
     * DCP 2 prefill 8K 0.162 -> 0.140 s) */
    if (prefill_mode == 0 && prefill_gemm && N == 128 && Vd == 128) {
        /* decompressed: k = [W_UK c | k_pe], v = W_UV c per head; 2 * (192 + 128) flops per
         * (query, head, key) instead of the absorbed form's 2 * (576 + 512), no (un)absorption */
        t0 = cp_begin();
        const int pos0 = b->seqs[0].pos0;
        void *ws = lunar_cuda_fwd_alloc(lunar_glue_mla_flash_ws(n, nh, pos0 + n, 0));
        lunar_glue_mla_flash(o, q, w->kvb.p, latent, fp8, bt, LUNAR_BLOCK_SIZE, pos0, n, nh, scale, 0, ws, NULL);
        cp_end(LUNAR_PROF_MLA_ATTN, t0);
        goto out_proj;
    }
    /* absorbed attention over the pages: q_lat = W_UK^T q_nope, core, then W_UV */
    float *q_lat = fd((size_t)n * nh * R), *q_pe = fd((size_t)n * nh * P), *o_lat = fd((size_t)n * nh * R);
    t0 = cp_begin();
    /* many rows: GEMMs over heads (the row kernel re-reads each head's weights per row) */
    /* LUNAR_MLA_ABSORB=kernel: the row kernels at any size; =gemm: the GEMMs at any size (A/B runs;
     * at batch 1 the row kernels cost ~0.25 ms per layer in the profile, the GEMMs are not yet
     * measured there) */
    static int absorb_min = -2;
    if (absorb_min == -2) {
        const char *e = getenv("LUNAR_MLA_ABSORB");
        absorb_min = e && strcmp(e, "kernel") == 0 ? -1 : e && strcmp(e, "gemm") == 0 ? 1 : MLA_ABSORB_GEMM_MIN;
    }
    float *w32 = absorb_min > 0 && n >= absorb_min ? fd((size_t)nh * (N + Vd) * R) : NULL;
    if (w32)
        lunar_cuda_mla_absorb_gemm(q_lat, q_pe, w32, q, w->kvb.p, n, nh, N, P, Vd, R, NULL);
    else
        lunar_glue_mla_absorb(q_lat, q_pe, q, w->kvb.p, n, nh, N, P, Vd, R, NULL);
    cp_end(LUNAR_PROF_MLA_ABSORB, t0);
    t0 = cp_begin();
    if (prefill_gemm) {
        void *ws = lunar_cuda_fwd_alloc(lunar_glue_mla_prefill_ws(n, nh, b->seqs[0].pos0 + n));
        lunar_glue_mla_prefill(o_lat, q_lat, q_pe, latent, fp8, bt, LUNAR_BLOCK_SIZE, b->seqs[0].pos0, n, nh, scale,
                               ws, NULL);
    } else if (R == 512 && P == 64) {
        lunar_cuda_mla_cache cd = {latent, fp8 ? LUNAR_CUDA_KV_FP8 : LUNAR_CUDA_KV_BF16, 1.0f, b->bt, b->max_blocks};
        const int ml = topk > 0 ? topk : b->max_len;
        size_t wsb = lunar_cuda_mla_ws(n, nh, ml);
        void *ws = wsb ? lunar_cuda_fwd_alloc(wsb) : NULL;
        if (topk > 0)
            lunar_cuda_mla_sparse(o_lat, q_lat, q_pe, &cd, b->row_seq, idx, topk, n, nh, scale, ws, NULL);
        else
            lunar_cuda_mla_absorbed(o_lat, q_lat, q_pe, &cd, b->row_seq, b->lens, b->max_len, n, nh,
                                    scale, ws, NULL);
    } else {
        lunar_glue_mla_attn(o_lat, q_lat, q_pe, latent, fp8, b->bt, b->max_blocks, b->row_seq, b->lens, idx,
                            topk, b->max_len, n, nh, R, P, scale, NULL);
    }
    cp_end(LUNAR_PROF_MLA_ATTN, t0);
    t0 = cp_begin();
    if (w32)
        lunar_cuda_mla_unabsorb_gemm(o, o_lat, w32, n, nh, N, Vd, R, NULL);
    else
        lunar_glue_mla_unabsorb(o, o_lat, w->kvb.p, n, nh, N, Vd, R, NULL);
    cp_end(LUNAR_PROF_MLA_ABSORB, t0);
out_proj:
    t0 = cp_begin();
    if (w->mg.p) { /* K3 output gate */
        float *gate = y1 ? cat_out(y1, &w->min, &w->mg) : fd((size_t)n * nh * Vd);
        if (!y1) mm_b(gate, hb, &w->mg, n, NULL);
        lunar_glue_sigmoid_mul(o, gate, (size_t)n * nh * Vd, NULL);
    }
    const int done = mm_into(into, o, &w->mo, n, NULL);
    if (!done) mm(out, o, &w->mo, n);
    cp_end(LUNAR_PROF_MLA_OUT, t0);
    lunar_cuda_release(mk);
    return done;
}

/* MoE: router + top-k on the device; the (token, slot) pairs are grouped per expert on the host
 * (one small download), each expert runs as bf16 GEMMs over its gathered rows, and the weighted
 * outputs are added in expert order, as the CPU. */
static void moe_generic(const lunar_model *mdl, const lunar_config *c, const dlayer *w, const float *h, int n,
                        float *out) {
    const int D = c->hidden_size, E = c->num_experts, k = c->num_experts_per_token;
    const int Lat = c->routed_expert_hidden_size, De = Lat ? Lat : D;
    size_t mk = lunar_cuda_mark();
    float *logits = fd((size_t)n * E), *wt = fd((size_t)n * k);
    int32_t *sel = lunar_cuda_fwd_alloc((size_t)n * k * sizeof(int32_t));
    double t0 = cp_begin();
    mm(logits, h, &w->router, n);
    lunar_cuda_router_topk(sel, wt, logits, w->rbias, n, E, k, c->num_expert_group, c->topk_group,
                           c->moe_renormalize, c->routed_scaling_factor, NULL);
    int32_t *hsel = lunar_xmalloc((size_t)n * k * sizeof(int32_t));
    float *hwt = lunar_xmalloc((size_t)n * k * sizeof(float));
    lunar_cuda_download(hsel, sel, (size_t)n * k * sizeof(int32_t));
    lunar_cuda_download(hwt, wt, (size_t)n * k * sizeof(float));
    int32_t *tok = lunar_xmalloc((size_t)n * k * sizeof(int32_t));
    float *tw = lunar_xmalloc((size_t)n * k * sizeof(float));
    int *eoff = lunar_xmalloc(((size_t)E + 1) * sizeof(int)), m = 0;
    for (int e = 0; e < E; e++) {
        eoff[e] = m;
        for (int t = 0; t < n; t++)
            for (int j = 0; j < k; j++)
                if (hsel[t * k + j] == e) tok[m] = t, tw[m] = hwt[t * k + j], m++;
    }
    eoff[E] = m;
    int32_t *dtok = lunar_cuda_fwd_alloc((size_t)m * sizeof(int32_t) + 4);
    float *dtw = fd((size_t)m + 1);
    lunar_cuda_upload(dtok, tok, (size_t)m * sizeof(int32_t));
    lunar_cuda_upload(dtw, tw, (size_t)m * sizeof(float));
    cp_end(LUNAR_PROF_ROUTER, t0);

    const float *z = h;
    float *acc = out;
    if (Lat) {
        t0 = cp_begin();
        float *zb = fd((size_t)n * Lat);
        mm(zb, h, &w->ldown, n);
        z = zb;
        acc = fd((size_t)n * Lat);
        cp_end(LUNAR_PROF_LATENT, t0);
    }
    t0 = cp_begin();
    lunar_cuda_fill_u32(acc, 0, (size_t)n * De);
    float *xin = fd((size_t)n * De), *xout = fd((size_t)n * De);
    for (int e = 0; e < E; e++) {
        const int me = eoff[e + 1] - eoff[e];
        if (!me || !w->w1[e].p) continue; /* TP hook: under EP another rank holds the expert */
        lunar_glue_gather(xin, z, dtok + eoff[e], me, De, NULL);
        glu(c, xout, xin, &w->w1[e], &w->w3[e], &w->w2[e], me, NULL);
        lunar_glue_scatter_add(acc, xout, dtok + eoff[e], dtw + eoff[e], me, De, NULL);
    }
    cp_end(LUNAR_PROF_EXPERTS, t0);
    if (Lat) {
        t0 = cp_begin();
        if (mdl->tp) lunar_cuda_tp_all_reduce(mdl, acc, (size_t)n * Lat); /* TP hook: before the norm */
        if (w->lnorm) lunar_cuda_rmsnorm(acc, LUNAR_CUDA_F32, acc, w->lnorm, n, Lat, c->rms_norm_eps, NULL);
        if (mdl->tp) { /* TP hook: this rank's column slice of routed_expert_up_proj */
            float *cols = fd((size_t)n * mdl->tp->lat_n + 1);
            lunar_cuda_tp_latent_cols(mdl, cols, acc, n, Lat);
            mm(out, cols, &w->lup, n);
        } else
            mm(out, acc, &w->lup, n);
        cp_end(LUNAR_PROF_LATENT, t0);
    }
    if (w->sg.p) {
        t0 = cp_begin();
        float *sh = fd((size_t)n * D);
        glu(c, sh, h, &w->sg, &w->su, &w->sd, n, NULL);
        lunar_glue_add(out, sh, (size_t)n * D, NULL);
        cp_end(LUNAR_PROF_SHARED, t0);
    }
    lunar_cuda_sync();
    free(hsel), free(hwt), free(tok), free(tw), free(eoff);
    lunar_cuda_release(mk);
}

/* The fused routed path (cuda_moe.cu): router GEMM, fused top-k, permutation, the experts over
 * expert-contiguous rows (decode kernel up to 64 tokens, grouped GEMM above), the combine; no
 * host round trip. The shared experts run meanwhile on the side stream: their buffers are taken
 * from the arena before anything else of the layer (the arena is a stack shared by both streams,
 * so nothing the main stream frees may lie under them), they start once h's bf16 copy exists
 * (ev_x) and the main stream waits for them (ev_shared) before adding them. The roundings are the
 * generic path's: bf16 GEMM operands, the activated product rounded to bf16 before w2. */
/* The norm after the MoE's residual add (run_residual, LUNAR_COMBINE_NORM=1): x += the layer's
 * output; h = RMSNorm(x) w, hb (or NULL) its bf16 copy. Where moe_fused can fold the combine into
 * it (no latent, the shared experts joined in the combine, no TP sum between), it runs the three in
 * one launch (lunar_cuda_moe_combine_add_rmsnorm, bit-equal) and leaves `out` unwritten. */
typedef struct {
    float *x, *h;
    uint16_t *hb;
    const uint16_t *w;
} moe_fold;

/* returns 1 where `fold` ran (out unwritten); 2 where the layer's output was added into `into` (or
 * NULL: not asked; AttnRes' partial sum, one rank) by the latent up-projection's epilogue, the shared
 * experts' output with it (out unwritten); else 0 */
static int moe_fused(const lunar_cuda_model *g, const lunar_config *c, const dlayer *w, const float *h,
                     const uint16_t *hb_in, int n, float *out, const moe_fold *fold, float *into) {
    const int D = c->hidden_size, E = c->num_experts, k = c->num_experts_per_token;
    const int Lat = c->routed_expert_hidden_size, De = Lat ? Lat : D, I = w->mx.I;
    size_t mk = lunar_cuda_mark();
    const uint16_t *hb = hb_in; /* h's bf16 copy: from the norm (run_residual), or made here */
    if (!hb_in) {
        uint16_t *b = lunar_cuda_fwd_alloc((size_t)n * D * 2);
        lunar_cuda_f32_to_bf16_on(b, h, (size_t)n * D, NULL);
        hb = b;
    }
    float *sh = NULL;
    int into_done = 0;
    LUNAR_ASSERT(!into || (!fold && !g->m->tp));
    double t0 = cp_begin();
    /* batch 1 with the shared expert as a routed row (w->mx.s1, issue 9): the router GEMM alone,
     * no side stream; the decode kernels read the shared weights as expert E */
    const int shrow = n == 1 && w->mx.s1 && !g->fuse_off && k < 64;
    /* batch 1 with the fused matrix (up_cat): the shared gate, up and the router in one GEMM on the
     * main stream, the side stream starting from its output */
    float *y1 = n == 1 && w->sin.p && !shrow ? fd((size_t)w->sin.out) : NULL;
    if (y1) mm_b(y1, hb, &w->sin, 1, NULL);
    if (w->sg.p && !shrow) {
        const int Is = w->sg.out;
        sh = fd((size_t)n * D);
        float *sa = y1 ? cat_out(y1, &w->sin, &w->sg) : fd((size_t)n * Is);
        float *sb = y1 ? cat_out(y1, &w->sin, &w->su) : fd((size_t)n * Is);
        uint16_t *sab = lunar_cuda_fwd_alloc((size_t)n * Is * 2);
        lunar_cuda_event_record(g->ev_x, NULL);
        lunar_cuda_stream_wait(g->side, g->ev_x);
        if (!y1) {
            mm_b(sa, hb, &w->sg, n, g->side);
            mm_b(sb, hb, &w->su, n, g->side);
        }
        if (c->act_situ)
            lunar_cuda_situ_mul(sab, LUNAR_CUDA_BF16, sa, sb, (int64_t)n * Is, c->situ_beta, c->situ_linear_beta,
                                g->side);
        else
            lunar_cuda_silu_mul(sab, LUNAR_CUDA_BF16, sa, sb, (int64_t)n * Is, g->side);
        mm_b(sh, sab, &w->sd, n, g->side);
        lunar_cuda_event_record(g->ev_shared, g->side);
        cp_end(LUNAR_PROF_SHARED, t0); /* the h -> bf16 copy included */
        t0 = cp_begin();
    }
    float *logits = y1 ? cat_out(y1, &w->sin, &w->router) : fd((size_t)n * E);
    if (!y1) mm_b(logits, hb, &w->router, n, NULL);
    lunar_cuda_moe_route r;
    const int kr = k + shrow; /* permuted rows per token */
    lunar_cuda_moe_route_init(&r, lunar_cuda_fwd_alloc(lunar_cuda_moe_route_bytes(n, kr, E)), n, kr, E);
    if (n == 1 && kr <= 64 && !g->fuse_off) { /* one launch for the top-k and the permutation */
        lunar_cuda_moe_route_one(&r, logits, w->rbias, c->num_expert_group, c->topk_group, c->moe_renormalize,
                                 c->routed_scaling_factor, shrow, NULL);
    } else {
        lunar_cuda_router_topk(r.experts, r.weights, logits, w->rbias, n, E, k, c->num_expert_group,
                               c->topk_group, c->moe_renormalize, c->routed_scaling_factor, NULL);
        lunar_cuda_moe_permute(&r, NULL);
    }
    cp_end(LUNAR_PROF_ROUTER, t0);
    const uint16_t *zb = hb;
    if (Lat) {
        t0 = cp_begin();
        uint16_t *z16 = lunar_cuda_fwd_alloc((size_t)n * Lat * 2);
        /* decode rows: the skinny kernel stores z in bf16 itself (the copy's round-to-nearest, the same
         * bits, one launch fewer); else the fp32 product and the copy */
        if (w->ldown.s8 || glue_gemm_only() || w->ldown.in % 8 ||
            lunar_cuda_matmul_bf16x(z16, LUNAR_CUDA_BF16, hb, w->ldown.p, n, Lat, w->ldown.in, NULL) != 0) {
            float *z = fd((size_t)n * Lat);
            mm_b(z, hb, &w->ldown, n, NULL);
            lunar_cuda_f32_to_bf16_on(z16, z, (size_t)n * Lat, NULL);
        }
        zb = z16;
        /* the route's kernels ran at least two launches before the experts (ldown, and the bf16 copy
         * where there is one) */
        r.settled = 1;
        cp_end(LUNAR_PROF_LATENT, t0);
    }
    t0 = cp_begin();
    uint16_t *hbuf = lunar_cuda_fwd_alloc((size_t)n * kr * I * 2);
    float *acc = Lat ? fd((size_t)n * Lat) : out, *ybuf = NULL;
    /* The weighted expert rows of a prefill (n > 64) in bf16: half the bytes for the down GEMM's
     * stores and the combine's loads (8K prefill: 604 MB a layer in fp32), at one more bf16 rounding
     * of each row (relative 2^-9, as the bf16 h the down GEMM multiplies) before the fp32 sum. The
     * default for MXFP4 experts since session 11 (path 24 writes them by bulk copies: the K3.1 TP8
     * slice's 8K prefill 2.2 % faster than fp32 rows, the K3-shaped model's median row error vs
     * the CPU unchanged; docs/benchmarks.md "MoE prefill, MXFP4 round 4"), for BF16 experts since
     * session 13 (path 29: Kimi-Linear-48B's 8K prefill 1.0 % faster, the combine 180 -> 111 us a
     * layer; "MoE prefill BF16, items by a counter"). vLLM's fused MoE also keeps each expert's
     * output row in the activation dtype before the sum. LUNAR_MOE_YBUF=fp32 the fp32 rows. */
    static int yrows_b = -1;
    if (yrows_b < 0) {
        const char *e = getenv("LUNAR_MOE_YBUF");
        yrows_b = !(e && !strcmp(e, "fp32"));
    }
    uint16_t *yb16 = yrows_b && n > 64 ? lunar_cuda_fwd_alloc((size_t)n * kr * De * 2) : NULL;
    if (yb16 && lunar_cuda_moe_experts_run_b(yb16, hbuf, zb, &w->mx, &r, 0, NULL)) yb16 = NULL;
    if (!yb16) {
        ybuf = fd((size_t)n * kr * De);
        lunar_cuda_moe_experts_run(ybuf, hbuf, zb, &w->mx, &r, 0, NULL);
    }
    /* no latent: the shared experts' output joins in the combine (one launch fewer) */
    const int join = sh && !Lat && !g->fuse_off;
    if (join) lunar_cuda_stream_wait(NULL, g->ev_shared);
    /* every reader of h and hb (the experts, the side stream) is behind this point in stream order */
    const int folded = fold && !Lat && !g->fuse_off && (!sh || join) &&
                       lunar_cuda_moe_combine_add_rmsnorm(fold->h, fold->hb, fold->x, ybuf, yb16, &r,
                                                          join ? sh : NULL, fold->w, D, c->rms_norm_eps, NULL) == 0;
    /* LUNAR_MOE_LATENT_NORM=1 (opt-in): on the latent path of one rank the combine and routed_expert_norm
     * in one launch, the same bits (combine_norm_kernel with x = NULL). At one token one block a row then
     * loads the k rows over the whole latent (ncu, session 20: 11.5 us a launch against 7.4 for the
     * combine's many blocks and the norm), so not the default until a device A/B says otherwise */
    static int lat_fold = -1;
    if (lat_fold < 0) lat_fold = getenv("LUNAR_MOE_LATENT_NORM") && atoi(getenv("LUNAR_MOE_LATENT_NORM")) > 0;
    const int lat_norm = lat_fold && !folded && Lat && !g->m->tp && w->lnorm && !g->fuse_off &&
                         lunar_cuda_moe_combine_add_rmsnorm(acc, NULL, NULL, ybuf, yb16, &r, NULL, w->lnorm, Lat,
                                                            c->rms_norm_eps, NULL) == 0;
    if (!folded && !lat_norm && yb16)
        lunar_cuda_moe_combine_add_b(acc, yb16, &r, De, join ? sh : NULL, NULL);
    else if (!folded && !lat_norm)
        lunar_cuda_moe_combine_add(acc, ybuf, &r, De, join ? sh : NULL, NULL);
    cp_end(LUNAR_PROF_EXPERTS, t0);
    if (Lat) {
        t0 = cp_begin();
        if (g->m->tp) lunar_cuda_tp_all_reduce(g->m, acc, (size_t)n * Lat); /* TP hook: before the norm */
        if (w->lnorm && !lat_norm)
            lunar_cuda_rmsnorm(acc, LUNAR_CUDA_F32, acc, w->lnorm, n, Lat, c->rms_norm_eps, NULL);
        if (g->m->tp) { /* TP hook: this rank's column slice of routed_expert_up_proj */
            float *cols = fd((size_t)n * g->m->tp->lat_n + 1);
            lunar_cuda_tp_latent_cols(g->m, cols, acc, n, Lat);
            mm(out, cols, &w->lup, n);
        } else {
            /* into: the shared experts' output joins in the epilogue, so the join comes first */
            if (into && sh && !join) lunar_cuda_stream_wait(NULL, g->ev_shared);
            into_done = mm_into(into, acc, &w->lup, n, sh && !join ? sh : NULL);
            if (!into_done) mm(out, acc, &w->lup, n);
        }
        cp_end(LUNAR_PROF_LATENT, t0);
    }
    if (sh && !join && !into_done) {
        lunar_cuda_stream_wait(NULL, g->ev_shared);
        lunar_glue_add(out, sh, (size_t)n * D, NULL);
    }
    lunar_cuda_release(mk); /* stream-ordered after the join above */
    return into_done ? 2 : folded;
}

/* the fused path, where it exists, reads h's bf16 copy hb (or makes one where hb is NULL) */
static int moe_fused_on(const lunar_cuda_model *g, const dlayer *w) { return g->fused_moe && w->fused_ok; }
static int moe_layer(const lunar_cuda_model *g, const lunar_config *c, const dlayer *w, const float *h,
                     const uint16_t *hb, int n, float *out, const moe_fold *fold, float *into) {
    if (moe_fused_on(g, w)) return moe_fused(g, c, w, h, hb, n, out, fold, into);
    moe_generic(g->m, c, w, h, n, out);
    return 0;
}

/* hb: h's bf16 copy where the caller's norm made one (else NULL: the layer makes it if it needs it).
 * into (or NULL; one rank only): where the output projection's epilogue can add the output into it,
 * it does and returns 1 (y unwritten); else 0 (y written). */
static int attention(const lunar_cuda_model *g, const dstep *b, int l, const float *h, const uint16_t *hb,
                     float *y, float *into) {
    const lunar_config *c = &g->m->cfg;
    const int heads = c->attn_kind[l] == LUNAR_ATTN_KDA ? c->kda_num_heads : c->num_attention_heads;
    LUNAR_ASSERT(!into || !g->m->tp);
    int done = 0;
    if (heads == 0) /* TP hook: a rank may hold no head of a small model; it adds zeros */
        lunar_cuda_fill_u32(y, 0, (size_t)b->T * c->hidden_size);
    else if (c->attn_kind[l] == LUNAR_ATTN_KDA)
        done = kda_layer(c, &g->L[l], b, g->m->kind_index[l], h, hb, y, into, g->kda_decode, g->kda_prefill);
    else
        done = mla_layer(g, &g->L[l], b, g->m->kind_index[l], h, hb, y, into);
    if (g->m->tp) lunar_cuda_tp_all_reduce(g->m, y, (size_t)b->T * c->hidden_size); /* TP hook: o_proj */
    return done;
}

/* fold (or NULL): the norm after the residual add, for the MoE to fold its combine into (not under
 * TP: the sum across ranks comes between); returns 1 where it did (y unwritten, x and fold's h, hb
 * written). into (or NULL; one rank only, no fold): as attention's; returns 2 where it took the
 * output (y unwritten). */
static int ffn(const lunar_cuda_model *g, int l, const float *h, const uint16_t *hb, int n, float *y,
               const moe_fold *fold, float *into) {
    const lunar_config *c = &g->m->cfg;
    const dlayer *w = &g->L[l];
    int folded = 0;
    LUNAR_ASSERT(!into || (!fold && !g->m->tp));
    if (c->ffn_kind[l] == LUNAR_FFN_DENSE) {
        const double t0 = cp_begin();
        folded = glu(c, y, h, &w->gate, &w->up, &w->down, n, into) ? 2 : 0;
        cp_end(LUNAR_PROF_SHARED, t0);
    } else
        folded = moe_layer(g, c, w, h, hb, n, y, g->m->tp ? NULL : fold, into);
    if (g->m->tp) lunar_cuda_tp_all_reduce(g->m, y, (size_t)n * c->hidden_size); /* TP hook: down projections */
    return folded;
}

static void run_residual(const lunar_cuda_model *g, const dstep *b, float *x, int n, float *hout) {
    const lunar_config *c = &g->m->cfg;
    const int D = c->hidden_size;
    float *h = fd((size_t)n * D), *y = fd((size_t)n * D);
    /* prefill rows: the attention norm writes h's bf16 copy too, the operand of the layer's input
     * projections (KDA, MLA), instead of the layer converting h in a launch of its own (8K prefill:
     * 27 copies of 8192 x 2304 floats); LUNAR_PREFILL_HB=0 the separate copy (A/B switch). From 64
     * rows, so a decode step of batch 64 takes it too (its layers convert h otherwise; measured within
     * the noise there, session 8); smaller decode batches keep their paths (batch 1 reads fp32 h). */
    static int pre_hb = -1;
    if (pre_hb < 0) pre_hb = !(getenv("LUNAR_PREFILL_HB") && atoi(getenv("LUNAR_PREFILL_HB")) <= 0);
    const int attn_b16 = pre_hb && n >= 64;
    /* where a norm writes the bf16 copy for a layer that reads only it (the KDA / MLA projections of 2+
     * rows, the fused MoE's router, shared experts and grouped GEMM), h's fp32 rows are dead: the norm
     * leaves them unwritten (8K prefill: 75 MB fewer per norm, 52 norms: 81.5 -> 62.5 us each, the
     * profiled norm family 4.89-4.96 -> 3.87-3.96 ms; docs/benchmarks.md "Prefill 8K, round 5").
     * LUNAR_PREFILL_H32=1 writes them as before (A/B). */
    static int h32 = -1;
    if (h32 < 0) h32 = getenv("LUNAR_PREFILL_H32") && atoi(getenv("LUNAR_PREFILL_H32")) > 0;
    float *h_opt = h32 ? h : NULL;
    /* the FFN norm also writes h's bf16 copy where the fused MoE reads one (one launch fewer) */
    uint16_t *hb = g->fuse_off && !attn_b16 ? NULL : lunar_cuda_fwd_alloc((size_t)n * D * 2);
    /* g->combine_norm (LUNAR_COMBINE_NORM=1, opt-in until measured): a MoE layer's combine is folded
     * into the norm after it (the next layer's attention norm, or the final norm): the combine's
     * [n, D] output is neither written nor read back, one launch fewer a MoE layer; the same bits */
    const int cnorm = g->combine_norm;
    int folded = 0; /* the previous layer's MoE ran the norm this layer's attention starts with */
    /* each residual add (x += y) is fused with the norm after it: one launch fewer per sub-layer */
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const dlayer *w = &g->L[l];
        double t0 = cp_begin();
        if (l == 0)
            lunar_cuda_rmsnorm(h, LUNAR_CUDA_F32, x, w->attn_norm, n, D, c->rms_norm_eps, NULL);
        else if (folded) {
        } else if (attn_b16) /* the previous layer's FFN output; hb's last reader (the MoE) has finished */
            lunar_cuda_add_rmsnorm_b(h_opt, hb, x, y, w->attn_norm, n, D, c->rms_norm_eps, NULL);
        else
            lunar_cuda_add_rmsnorm(h, LUNAR_CUDA_F32, x, y, w->attn_norm, n, D, c->rms_norm_eps, NULL);
        cp_end(LUNAR_PROF_NORM, t0);
        step_ev(l, 0);
        attention(g, b, l, h, attn_b16 && l > 0 ? hb : NULL, y, NULL);
        step_ev(l, 1);
        t0 = cp_begin();
        const int b16 = hb && !g->fuse_off && c->ffn_kind[l] != LUNAR_FFN_DENSE && moe_fused_on(g, w);
        if (b16) /* moe_fused reads h only where it is given no bf16 copy */
            lunar_cuda_add_rmsnorm_b(attn_b16 ? h_opt : h, hb, x, y, w->ffn_norm, n, D, c->rms_norm_eps, NULL);
        else
            lunar_cuda_add_rmsnorm(h, LUNAR_CUDA_F32, x, y, w->ffn_norm, n, D, c->rms_norm_eps, NULL);
        cp_end(LUNAR_PROF_NORM, t0);
        const int last = l + 1 == c->num_hidden_layers;
        const moe_fold fold = {x, last ? hout : attn_b16 ? h_opt : h, last || !attn_b16 ? NULL : hb,
                               last ? g->final_norm : g->L[l + 1].attn_norm};
        folded = ffn(g, l, h, b16 ? hb : NULL, n, y, cnorm ? &fold : NULL, NULL);
        /* a statistic for the tests (the model is the upload's heap object; the step only takes it const) */
        ((lunar_cuda_model *)g)->combine_norm_folds += folded;
    }
    const double t0 = cp_begin();
    if (folded) {
    } else if (c->num_hidden_layers > 0)
        lunar_cuda_add_rmsnorm(hout, LUNAR_CUDA_F32, x, y, g->final_norm, n, D, c->rms_norm_eps, NULL);
    else
        lunar_cuda_rmsnorm(hout, LUNAR_CUDA_F32, x, g->final_norm, n, D, c->rms_norm_eps, NULL);
    cp_end(LUNAR_PROF_NORM, t0);
    sev_rec(1 + 2 * c->num_hidden_layers);
}

/* AttnRes without a pointer upload per mix (which a captured step could not replay): the banked
 * blocks and the partial sum live in one bank of ares_slots(c) buffers [n, D] in bank order,
 * slot 0 the embeddings, slot i the i-th block's sum, the partial sum always in the slot after
 * the last banked block. A mix's candidates are then the slots 0..nb, a prefix of one pointer
 * table that the step uploads with its other inputs (dstep.ares_tab), the same for every mix. */
static int ares_slots(const lunar_config *c) {
    const int bs = c->attn_res_block_size;
    return bs > 0 ? (c->num_hidden_layers + bs - 1) / bs + 1 : 0;
}

/* outb: out's bf16 copy too (the layer's GEMM operand, which the layer would otherwise make) */
static void mix(float *out, uint16_t *outb, const float *const *tab, int S, const float *u, const float *on, int n,
                int D, float eps) {
    const double t0 = cp_begin();
    if (lunar_cuda_attnres_supported(D)) { /* one pass over the candidates (cuda_attnres.cu) */
        lunar_cuda_attnres_mix(out, outb, tab, S, u, on, n, D, eps, NULL);
    } else {
        lunar_glue_attnres_mix(out, tab, S, u, on, n, D, eps, NULL);
        if (outb) lunar_cuda_f32_to_bf16(outb, out, (size_t)n * D);
    }
    cp_end(LUNAR_PROF_NORM, t0);
}

/* op for op forward.c's AttnRes loop: where it banks P and starts a new partial sum from the
 * sub-layer's output (P = NULL, then P = y), the output is written into the next slot instead */
static void run_attn_res(const lunar_cuda_model *g, const dstep *b, int n, float *hout) {
    const lunar_config *c = &g->m->cfg;
    const int D = c->hidden_size, bs = c->attn_res_block_size, L = c->num_hidden_layers;
    const size_t nD = (size_t)n * D;
    const float eps = c->rms_norm_eps;
    const float *const *tab = b->ares_tab;
    float *h = fd(nD), *y = fd(nD);
    uint16_t *hb = lunar_cuda_fwd_alloc(nD * 2); /* h's bf16 copy, written by the mix */
    int nb = 0, live = 1; /* banked blocks; whether slot nb holds a partial sum (x at first) */
    const int tp = g->m->tp != NULL; /* under TP the ranks' sum comes between the product and the add */
    for (int l = 0; l < L; l++) {
        const dlayer *w = &g->L[l];
        mix(h, hb, tab, nb + 1, w->ares_u, w->attn_norm_f, n, D, eps);
        if (l % bs == 0) nb++, live = 0;
        LUNAR_ASSERT(nb < b->ares_n);
        float *P = b->ares_bank + (size_t)nb * nD;
        /* P += the sub-layer's output in its last GEMM's epilogue where it can (decode rows, one rank:
         * the add's launch fewer), else through y and an add */
        if (!attention(g, b, l, h, hb, live ? y : P, live && !tp ? P : NULL) && live)
            lunar_glue_add(P, y, nD, NULL);
        live = 1;
        mix(h, hb, tab, nb + 1, w->mres_u, w->ffn_norm_f, n, D, eps);
        if (ffn(g, l, h, hb, n, y, NULL, tp ? NULL : P) != 2) lunar_glue_add(P, y, nD, NULL);
    }
    mix(hout, NULL, tab, nb + 1, g->out_u, g->final_norm_f, n, D, eps);
}

int lunar_forward_batch_cuda(const lunar_cuda_model *g, lunar_cuda_caches *c,
                             const lunar_batch_seq *seqs, int n_seqs, float *logits, lunar_err *err) {
    return lunar_forward_batch_cuda_sampled(g, c, seqs, n_seqs, logits, NULL, NULL, err);
}

/* ------------------------------------------------------------------ decode graphs
 *
 * A decode step of Kimi-Linear issues ~1100 launches (and the host waits for none of them), so at
 * batch 1 the step costs its launches, not its bytes. Eligible decode steps are captured once into
 * a CUDA graph and replayed: everything the kernels read that changes from step to step (ids,
 * positions, lengths, slots, block tables, KDA state indices, sampling parameters) lives in one
 * device block uploaded before the replay, and every other pointer is the same at each replay
 * because the arena is a stack: the same mark and the same sequence of allocations give the same
 * addresses (checked: the key holds the mark, and the input block's address is compared).
 *
 * Exact batch sizes, captured lazily, not padded buckets: a padded row would need a scratch KDA
 * state slot and a scratch cache page to write into (it updates both), which the caches do not
 * have; an exact size costs one capture per batch size met (the engine's batch changes slowly).
 * The context is bucketed instead (decode_len_bucket): the MLA decode kernel's split plan depends
 * on the longest context, so every decode step, graphed or not, plans with the bucket, and a graph
 * serves all the steps of its bucket with results identical to the eager ones.
 *
 * A key's first step runs eagerly (it warms the kernels' one-time set-up: lazy module loading,
 * cuBLASLt plans, shared-memory attributes), its second is captured and replayed. */

/* Tensor parallelism's steps have no host round trip (forward_cuda_tp.h) and NCCL kernels can be
 * captured; every rank captures and replays the same collectives in the same order, as all run
 * the same steps. On by default since session 3 measured them on two H200s (bitwise equal to eager,
 * graphs_tp_cuda_match_eager; KL48 TP 2 B=1 4.06 vs 5.22 ms eager); LUNAR_TP_GRAPHS=0 (or
 * LUNAR_CUDA_GRAPHS=0, bench's --enforce-eager) turns them off. */
static int tp_graphs_on(void) {
    static int on = -1;
    if (on < 0) on = !(getenv("LUNAR_TP_GRAPHS") && atoi(getenv("LUNAR_TP_GRAPHS")) <= 0);
    return on;
}

/* Can this step be captured? Everything with a host round trip or host-side per-sequence pointers
 * stays eager: profiling (its regions synchronise), tensor parallelism with LUNAR_TP_GRAPHS=0 (above),
 * the generic MoE (routing downloaded to the host), the generic KDA decode (head size other than
 * 128: per-sequence state pointers). AttnRes reads its candidates from the step's input block. */
static int graph_eligible(const lunar_cuda_model *g, int n_seqs, int T) {
    const lunar_config *c = &g->m->cfg;
    if (!g->graphs->on || T != n_seqs || lunar_prof_active || (g->m->tp && !tp_graphs_on())) return 0;
    if (c->n_kda_layers && c->kda_head_dim != 128) return 0;
    for (int l = 0; l < c->num_hidden_layers; l++)
        if (c->ffn_kind[l] == LUNAR_FFN_MOE && !(g->fused_moe && g->L[l].fused_ok)) return 0;
    return 1;
}

static graph_ent *graph_find(struct lunar_cuda_graphs *gs, const graph_key *k) {
    graph_ent *lru = &gs->e[0];
    for (int i = 0; i < GRAPH_SLOTS; i++) {
        graph_ent *e = &gs->e[i];
        if (e->used && memcmp(&e->k, k, sizeof *k) == 0) {
            e->used = ++gs->tick;
            return e;
        }
        if (e->used < lru->used) lru = e;
    }
    if (lru->x) lunar_cuda_graph_destroy(lru->x); /* the least recently used key makes room */
    memset(lru, 0, sizeof *lru);
    lru->k = *k;
    lru->used = ++gs->tick;
    return lru;
}

struct lunar_cuda_graphs *lunar_cuda_fwd_graphs_new(int on) {
    struct lunar_cuda_graphs *gs = lunar_xcalloc(1, sizeof *gs);
    gs->on = on;
    return gs;
}

void lunar_cuda_fwd_graphs_free(struct lunar_cuda_graphs *gs) {
    if (!gs) return;
    for (int i = 0; i < GRAPH_SLOTS; i++)
        if (gs->e[i].x) lunar_cuda_graph_destroy(gs->e[i].x);
    free(gs);
}

int lunar_cuda_model_graphs(lunar_cuda_model *g, int on) {
    const int was = g->graphs->on;
    g->graphs->on = on != 0;
    return was;
}

void lunar_cuda_model_graph_stats(const lunar_cuda_model *g, long *captures, long *replays, size_t *nodes,
                                  double *capture_s) {
    if (captures) *captures = g->graphs->captures;
    if (replays) *replays = g->graphs->replays;
    if (nodes) *nodes = g->graphs->nodes;
    if (capture_s) *capture_s = g->graphs->capture_s;
}

/* The device work of one step, from the input block to the logits rows (lg) and, when sampling,
 * their sampled ids (did): what a graph captures. Host-free under tensor parallelism too: its
 * collectives are stream-ordered and its logits gathered on the device (forward_cuda_tp.h). */
static void step_enqueue(const lunar_cuda_model *g, const dstep *b, const int32_t *ids, const int32_t *sel,
                         int rows, const lunar_cuda_sample_params *dp, float **lg_out, int32_t **did_out,
                         double *t_lm) {
    const lunar_config *cf = &g->m->cfg;
    const int D = cf->hidden_size, V = cf->vocab_size, T = b->T;
    float *x = b->ares_bank ? b->ares_bank : fd((size_t)T * D), *h = fd((size_t)T * D); /* AttnRes: slot 0 */
    sev_rec(0);
    double t0 = cp_begin();
    if (g->m->tp) /* TP hook: vocab-parallel embedding */
        lunar_cuda_tp_embedding(g->m, x, g->embed, ids, T);
    else
        lunar_cuda_embedding(x, LUNAR_CUDA_F32, g->embed, ids, T, D, NULL);
    cp_end(LUNAR_PROF_EMBED, t0);
    if (cf->attn_res_block_size > 0)
        run_attn_res(g, b, T, h);
    else
        run_residual(g, b, x, T, h);
    *lg_out = NULL, *did_out = NULL;
    if (!rows) return;
    const int64_t Vl = g->m->tp ? g->m->tp->vocab_chunk : V; /* TP hook: this rank's padded slice */
    float *hs = fd((size_t)rows * D), *lg = fd((size_t)rows * Vl);
    *t_lm = cp_begin(); /* ended by the caller, after the logits' download or the sampled ids' */
    lunar_glue_gather(hs, h, sel, rows, D, NULL);
    if (g->lm_head.out > 0) mm(lg, hs, &g->lm_head, rows);
    if (g->m->tp) /* TP hook: all-gather of the vocabulary slices, [rows, V] on the device */
        lg = lunar_cuda_tp_lm_head(g->m, lg, rows);
    *lg_out = lg;
    if (dp) { /* every row: one launch; the others' ids are ignored */
        int32_t *did = lunar_cuda_fwd_alloc((size_t)rows * sizeof *did);
        lunar_cuda_sample(did, lg, rows, V, dp, NULL);
        *did_out = did;
    }
    sev_rec(2 + 2 * cf->num_hidden_layers);
    sev.t_enq = lunar_prof_now();
}

int lunar_forward_batch_cuda_sampled(const lunar_cuda_model *g, lunar_cuda_caches *c, const lunar_batch_seq *seqs,
                                     int n_seqs, float *logits, const lunar_device_sampling *ds, int32_t *sampled,
                                     lunar_err *err) {
    const lunar_config *cf = &g->m->cfg;
    const int V = cf->vocab_size;
    if (n_seqs <= 0) return lunar_fail(err, "forward: empty batch");
    int *off = lunar_xmalloc(((size_t)n_seqs + 1) * sizeof *off), T = 0, rows = 0, max_blocks = 1, max_len = 1;
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
        if (sq->slot < 0 || sq->slot >= c->n_slots ||
            (sq->pos0 + sq->n + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE > c->n_blocks) {
            free(off);
            return lunar_fail(err, "forward: sequence %d exceeds the device caches", j);
        }
        off[j] = T;
        T += sq->n;
        rows += sq->logits == LUNAR_LOGITS_ALL ? sq->n : sq->logits == LUNAR_LOGITS_LAST;
        int L = sq->pos0 + sq->n, nbk = (L + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
        if (nbk > max_blocks) max_blocks = nbk;
        if (L > max_len) max_len = L;
    }
    off[n_seqs] = T;
    const int decode = T == n_seqs;
    sev_begin(cf, T, decode);
    if (decode) { /* the bucket (see decode graphs above); table entries past a sequence's pages stay 0 */
        max_len = decode_len_bucket(max_len);
        max_blocks = (max_len + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
    }
    int on = 0;
    for (int r = 0; ds && r < rows; r++) on += ds[r].on != 0;
    const int kda_idx = decode && c->n_kda;

    /* the input block: every per-step table in one upload, int32 words:
     * ids, row_seq, lens, pos, slots [T] | block tables [n_seqs, max_blocks] | sel [rows + 1] |
     * zero [1] | KDA conv, state indices [2 n_seqs] (decode) | sampling parameters [rows] (16-byte aligned) |
     * AttnRes slot pointers [ares_slots] (16-byte aligned; the bank is allocated right after the
     * block, so the host knows its addresses before the upload) */
    const int n_ares = ares_slots(cf);
    const size_t o_bt = (size_t)5 * T, o_sel = o_bt + (size_t)n_seqs * max_blocks, o_zero = o_sel + rows + 1,
                 o_kda = o_zero + 1, o_sp = (o_kda + (kda_idx ? 2 * (size_t)n_seqs : 0) + 3) / 4 * 4,
                 o_ares = (o_sp + (on ? (size_t)rows * sizeof(lunar_cuda_sample_params) / 4 : 0) + 3) / 4 * 4,
                 words = o_ares + (size_t)n_ares * sizeof(float *) / 4;
    int32_t *hin = lunar_xcalloc(words, 4);
    int32_t *h_ids = hin, *h_rs = hin + T, *h_lens = hin + 2 * T, *h_pos = hin + 3 * T, *h_slots = hin + 4 * T,
            *h_bt = hin + o_bt, *h_sel = hin + o_sel;
    int r = 0;
    for (int j = 0; j < n_seqs; j++) {
        const lunar_batch_seq *sq = &seqs[j];
        const int nbk = (sq->pos0 + sq->n + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
        for (int i = 0; i < nbk; i++) h_bt[(size_t)j * max_blocks + i] = sq->blocks[i];
        for (int i = 0; i < sq->n; i++) {
            const int t = off[j] + i, p = sq->pos0 + i;
            h_ids[t] = sq->ids[i], h_rs[t] = j, h_lens[t] = p + 1, h_pos[t] = p;
            h_slots[t] = sq->blocks[p / LUNAR_BLOCK_SIZE] * LUNAR_BLOCK_SIZE + p % LUNAR_BLOCK_SIZE;
        }
        if (sq->logits == LUNAR_LOGITS_ALL)
            for (int i = 0; i < sq->n; i++) h_sel[r++] = off[j] + i;
        else if (sq->logits == LUNAR_LOGITS_LAST)
            h_sel[r++] = off[j + 1] - 1;
    }
    for (int j = 0; kda_idx && j < n_seqs; j++) /* a decode step: each sequence's KDA pools by index */
        hin[o_kda + j] = seqs[j].slot * c->n_kda * 3, hin[o_kda + n_seqs + j] = seqs[j].slot * c->n_kda;
    if (on) {
        lunar_cuda_sample_params *hp = (lunar_cuda_sample_params *)(hin + o_sp);
        for (int i = 0; i < rows; i++)
            hp[i] = (lunar_cuda_sample_params){ds[i].on ? ds[i].temperature : 0.0f, ds[i].top_k, ds[i].top_p, ds[i].u};
    }

    const size_t mk = lunar_cuda_mark();
    int32_t *in = lunar_cuda_fwd_alloc(words * 4);
    float *bank = n_ares ? fd((size_t)n_ares * T * cf->hidden_size) : NULL;
    for (int i = 0; i < n_ares; i++) {
        const float *slot = bank + (size_t)i * T * cf->hidden_size;
        memcpy(hin + o_ares + (size_t)i * sizeof slot / 4, &slot, sizeof slot);
    }
    lunar_cuda_upload(in, hin, words * 4);
    const size_t after_in = lunar_cuda_mark(); /* the bank included: the graph's addresses start here */
    dstep b = {seqs, n_seqs, T, max_blocks, max_len, off, in + T, in + 2 * T, in + 3 * T, in + 4 * T, in + o_bt,
               in + o_zero, c, kda_idx ? in + o_kda : NULL, kda_idx ? in + o_kda + n_seqs : NULL, bank,
               n_ares ? (const float *const *)(in + o_ares) : NULL, n_ares};
    const int32_t *ids = in, *sel = in + o_sel;
    const lunar_cuda_sample_params *dp = on ? (const lunar_cuda_sample_params *)(in + o_sp) : NULL;

    graph_ent *ge = NULL;
    if (graph_eligible(g, n_seqs, T)) {
        graph_key k;
        memset(&k, 0, sizeof k); /* padding bytes too: the key is compared with memcmp */
        k.latent = c->latent, k.idx_codes = c->idx_codes, k.idx_scales = c->idx_scales, k.conv = c->conv;
        k.state = c->state, k.n_blocks = c->n_blocks, k.n_slots = c->n_slots, k.n_seqs = n_seqs, k.rows = rows;
        k.max_len = max_len, k.sampled = on != 0, k.fused_moe = g->fused_moe, k.mark = mk;
        ge = graph_find(g->graphs, &k);
    }
    float *lg = NULL;
    int32_t *did = NULL;
    double t_lm = 0.0;
    if (ge && !ge->x && ge->seen > 0) { /* the key's second step: capture it */
        lunar_err cerr;
        size_t nodes = 0;
        const double tc = lunar_prof_now();
        int rc = lunar_cuda_capture_begin(&cerr);
        if (!rc) {
            step_enqueue(g, &b, ids, sel, rows, dp, &lg, &did, &t_lm);
            rc = lunar_cuda_capture_end(&ge->x, &nodes, &cerr);
        }
        if (rc) { /* the step still runs, eagerly; graphs stay off in this process */
            fprintf(stderr, "lunar: CUDA graphs disabled: %s\n", cerr.msg);
            g->graphs->on = 0;
            ge = NULL;
            lunar_cuda_release(after_in);
        } else {
            ge->in = in, ge->bank = bank, ge->lg = lg, ge->did = did;
            g->graphs->captures++, g->graphs->nodes = nodes;
            g->graphs->capture_s += lunar_prof_now() - tc;
        }
    }
    if (ge && ge->x) {
        /* same mark, same first allocations: the captured addresses hold (the table in the input
         * block names the bank's slots; the kernels that write them have them baked in) */
        LUNAR_ASSERT(ge->in == in && ge->bank == bank);
        lunar_cuda_graph_launch(ge->x, NULL);
        lg = (float *)ge->lg, did = (int32_t *)ge->did;
        g->graphs->replays++;
    } else {
        step_enqueue(g, &b, ids, sel, rows, dp, &lg, &did, &t_lm);
        if (ge) ge->seen++;
    }
    if (rows && logits) { /* the logits rows to the host, or the sampled ids and the other rows */
        if (!on) {
            lunar_cuda_download(logits, lg, (size_t)rows * V * sizeof(float));
        } else {
            lunar_cuda_download(sampled, did, (size_t)rows * sizeof *did);
            for (int i = 0; i < rows; i++)
                if (!ds[i].on)
                    lunar_cuda_download(logits + (size_t)i * V, lg + (size_t)i * V, (size_t)V * sizeof(float));
        }
    }
    if (rows) cp_end(LUNAR_PROF_LM_HEAD, t_lm);
    lunar_cuda_sync();
    sev_report(cf, T);
    lunar_cuda_release(mk);
    free(hin), free(off);
    return lunar_cuda_tp_status(g->m, err); /* TP hook: a failed collective */
}


int lunar_cuda_seq_init(lunar_cuda_seq *s, const lunar_model *m, int max_tokens, int flags, lunar_err *err) {
    memset(s, 0, sizeof *s);
    if (max_tokens <= 0) return lunar_fail(err, "sequence capacity must be positive (got %d)", max_tokens);
    const int n_blocks = (max_tokens + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
    if (lunar_cuda_caches_init(&s->c, m, n_blocks, 1, flags, err)) return -1;
    s->blocks = lunar_xmalloc((size_t)n_blocks * sizeof *s->blocks);
    for (int i = 0; i < n_blocks; i++) s->blocks[i] = i;
    s->max_tokens = max_tokens;
    return 0;
}

void lunar_cuda_seq_reset(lunar_cuda_seq *s) {
    lunar_cuda_state_clear(&s->c, 0);
    s->pos = 0;
}

void lunar_cuda_seq_free(lunar_cuda_seq *s) {
    lunar_cuda_caches_free(&s->c);
    free(s->blocks);
    memset(s, 0, sizeof *s);
}

int lunar_forward_cuda(const lunar_cuda_model *g, lunar_cuda_seq *s, const int32_t *ids, int n,
                       float *logits, int all_logits, lunar_err *err) {
    if (n <= 0) return lunar_fail(err, "forward: no tokens");
    if (s->pos + n > s->max_tokens)
        return lunar_fail(err, "forward: %d + %d tokens exceed the sequence capacity of %d", s->pos, n,
                          s->max_tokens);
    lunar_batch_seq one = {ids, n, s->pos, 0, s->blocks, all_logits ? LUNAR_LOGITS_ALL : LUNAR_LOGITS_LAST};
    if (lunar_forward_batch_cuda(g, &s->c, &one, 1, logits, err)) return -1;
    s->pos += n;
    return 0;
}

#endif
