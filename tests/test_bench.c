/* --load-format dummy (model/dummy.c), the per-op profile, `lunar bench` and `lunar bench serve`'s
 * metric arithmetic. The dummy weights must be deterministic, finite, of the documented scales,
 * route experts evenly, keep a forward finite and O(1); the device generator must agree with the
 * host one bit for bit (the device half runs only with a CUDA device). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "base/file.h"
#include "model/dummy.h"
#include "model/forward.h"
#include "model/profile.h"
#include "ops.h"
#include "test.h"
#include "cuda_test.h"

#define SMALL_K31 "tests/data/dummy-k31-small"
#define TINY_K2 "models/kimi-linear-tiny/config.json"

static lunar_model *load_dummy(const char *path, uint64_t seed, int lazy) {
    lunar_load_options lo = {.load_format = "dummy", .seed = seed, .device_lazy = lazy};
    lunar_model *m = NULL;
    lunar_err err;
    CHECK_MSG(lunar_model_load_ex(&m, path, &lo, &err) == 0, "%s", err.msg);
    return m;
}

/* Every float tensor finite; the checks a real checkpoint load runs (MXFP4 scales) passed. */
TEST(dummy_weights_deterministic_and_finite) {
    lunar_model *a = load_dummy(SMALL_K31, 7, 0), *b = load_dummy(SMALL_K31, 7, 0), *c = load_dummy(SMALL_K31, 8, 0);
    if (!a || !b || !c) return;
    CHECK(a->cfg.experts_mxfp4 && a->cfg.index_topk > 0);
    size_t n = lunar_st_count(a->st), differ = 0;
    CHECK(n > 100 && n == lunar_st_count(b->st));
    for (size_t i = 0; i < n; i++) {
        const lunar_tensor *ta = lunar_st_at(a->st, i), *tb = lunar_st_find(b->st, ta->name),
                           *tc = lunar_st_find(c->st, ta->name);
        CHECK(tb && tc && ta->data && ta->nbytes == tb->nbytes);
        if (!tb || !tc) continue;
        CHECK_MSG(memcmp(ta->data, tb->data, ta->nbytes) == 0, "%s differs between two loads", ta->name);
        differ += memcmp(ta->data, tc->data, ta->nbytes) != 0;
        if (ta->dtype == LUNAR_DTYPE_U8) continue;
        for (int64_t k = 0; k < lunar_tensor_numel(ta); k++)
            if (!isfinite(lunar_tensor_get_f32(ta, k))) {
                CHECK_MSG(0, "%s[%lld] not finite", ta->name, (long long)k);
                break;
            }
    }
    /* norms (all ones) and zero biases do not depend on the seed; everything random does */
    CHECK_MSG(differ > n / 2, "only %zu of %zu tensors depend on the seed", differ, n);
    lunar_model_free(a), lunar_model_free(b), lunar_model_free(c);
}

/* Scales: matrices U(-a, a) with a = sqrt(3/in) have variance 1/in; MXFP4 dequantised rms near
 * 1/sqrt(in) with the two documented scale bytes; gate parameters in their ranges. */
TEST(dummy_weights_scales) {
    lunar_model *m = load_dummy(SMALL_K31, 1, 0);
    if (!m) return;
    const lunar_layer_weights *w = &m->layers[1];
    const lunar_tensor *q = w->kda.q_proj; /* [H*dk, D] */
    double s = 0, s2 = 0;
    const int64_t n = lunar_tensor_numel(q), in = q->shape[1];
    float amax = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = lunar_tensor_get_f32(q, i);
        s += v, s2 += (double)v * v;
        amax = fmaxf(amax, fabsf(v));
    }
    const double var = s2 / n - (s / n) * (s / n);
    /* 65536 samples: the variance estimate is within ~1 % (3 sigma) of 1/in */
    CHECK_MSG(fabs(var * in - 1) < 0.05, "q_proj variance %.4g, want %.4g", var, 1.0 / in);
    CHECK(amax <= sqrtf(3.0f / in) * 1.004f); /* bf16 rounding of a */

    const lunar_mxfp4 *x = &w->ffn.experts[3].q1;
    lunar_dummy_gen g;
    lunar_dtype dt;
    lunar_dummy_gen_for(&m->cfg, 1, x->packed->name, 2, x->packed->shape, &g, &dt);
    const uint8_t *sc = x->scale->data;
    int lo = 0, hi = 0;
    for (int64_t i = 0; i < lunar_tensor_numel(x->scale); i++) {
        lo += sc[i] == g.exp0 - 1, hi += sc[i] == g.exp0;
    }
    CHECK(lo + hi == lunar_tensor_numel(x->scale) && lo > 0 && hi > 0);
    const int rows = (int)x->packed->shape[0], cols = (int)x->packed->shape[1] * 2;
    float *row = malloc((size_t)cols * sizeof *row);
    s2 = 0;
    for (int r = 0; r < rows; r++) {
        lunar_mxfp4_dequant_row(row, x, r);
        for (int k = 0; k < cols; k++) s2 += (double)row[k] * row[k];
        /* the generator's own dequantisation is the checkpoint format's */
        for (int k = 0; k < cols; k += 7) CHECK(row[k] == lunar_dummy_mxfp4_value(&g, r, k));
    }
    free(row);
    const double rms = sqrt(s2 / ((double)rows * cols)) * sqrt((double)cols);
    CHECK_MSG(rms > 0.6 && rms < 1.6, "MXFP4 rms x sqrt(in) = %.3f", rms);

    const lunar_tensor *A = w->kda.A_log, *dtb = w->kda.dt_bias;
    for (int64_t i = 0; i < lunar_tensor_numel(A); i++) {
        float v = lunar_tensor_get_f32(A, i);
        CHECK(v >= -2.0f && v <= 0.0f); /* bounded gate (K3) */
    }
    for (int64_t i = 0; i < lunar_tensor_numel(dtb); i++) {
        float v = lunar_tensor_get_f32(dtb, i);
        CHECK(v >= -2.0f && v <= 2.0f);
    }
    CHECK(lunar_tensor_get_f32(w->attn_norm, 5) == 1.0f && lunar_tensor_get_f32(w->ffn.router_bias, 0) == 0.0f);
    lunar_model_free(m);

    /* Kimi-Linear's unbounded gate: A = exp(A_log) in [1, 16], dt = softplus(dt_bias) in [1e-3, 0.1] */
    m = load_dummy(TINY_K2, 1, 0);
    if (!m) return;
    A = m->layers[0].kda.A_log, dtb = m->layers[0].kda.dt_bias;
    for (int64_t i = 0; i < lunar_tensor_numel(A); i++) {
        float e = expf(lunar_tensor_get_f32(A, i));
        CHECK(e >= 0.999f && e <= 16.01f);
    }
    for (int64_t i = 0; i < lunar_tensor_numel(dtb); i++) {
        float sp = log1pf(expf(lunar_tensor_get_f32(dtb, i)));
        CHECK(sp >= 0.99e-3f && sp <= 0.101f);
    }
    lunar_model_free(m);
}

/* Experts are used evenly: 4096 unit-variance inputs through a dummy router pick every expert,
 * and no expert more than twice its fair share (the expected load is 4096 * k / E = 512 per expert;
 * a biased router, e.g. a constant e_score_correction_bias ramp, concentrates it on a few). */
TEST(dummy_router_uses_experts_evenly) {
    lunar_model *m = load_dummy(SMALL_K31, 3, 0);
    if (!m) return;
    const lunar_config *c = &m->cfg;
    const int T = 4096, D = c->hidden_size, E = c->num_experts, k = c->num_experts_per_token;
    float *x = malloc((size_t)T * D * sizeof *x), *logits = malloc((size_t)T * E * sizeof *logits),
          *wt = malloc((size_t)T * k * sizeof *wt);
    int32_t *sel = malloc((size_t)T * k * sizeof *sel);
    lunar_test_fill(x, (long)T * D, 11, -1.7320508f, 1.7320508f);
    const lunar_ffn_weights *f = &m->layers[2].ffn;
    op_matmul(logits, x, f->router, T);
    op_router_topk(sel, wt, logits, f->router_bias, T, E, k, c->num_expert_group, c->topk_group,
                   c->moe_renormalize, c->routed_scaling_factor);
    int *load = calloc((size_t)E, sizeof *load), mn = T, mx = 0;
    for (int i = 0; i < T * k; i++) load[sel[i]]++;
    for (int e = 0; e < E; e++) mn = load[e] < mn ? load[e] : mn, mx = load[e] > mx ? load[e] : mx;
    const double fair = (double)T * k / E;
    CHECK_MSG(mn > 0.5 * fair && mx < 2.0 * fair, "expert loads %d..%d, fair %.0f", mn, mx, fair);
    free(x), free(logits), free(wt), free(sel), free(load);
    lunar_model_free(m);
}

/* A forward of the small K3.1-shaped dummy: finite logits of O(1) spread, prefill then decode, and
 * the profile accounts for the step. */
TEST(dummy_forward_finite_and_profiled) {
    lunar_model *m = load_dummy(SMALL_K31, 5, 0);
    if (!m) return;
    const int V = m->cfg.vocab_size, n = 24;
    int32_t ids[24];
    for (int i = 0; i < n; i++) ids[i] = (i * 977 + 13) % V;
    float *logits = malloc((size_t)n * V * sizeof *logits);
    lunar_seq s;
    lunar_err err;
    CHECK(lunar_seq_init(&s, m, n + 2, &err) == 0);
    CHECK_MSG(lunar_forward(m, &s, ids, n, logits, 1, &err) == 0, "%s", err.msg);
    double s2 = 0;
    int finite = 1;
    for (long i = 0; i < (long)n * V; i++) finite &= isfinite(logits[i]) != 0, s2 += (double)logits[i] * logits[i];
    CHECK(finite);
    const double rms = sqrt(s2 / ((double)n * V));
    CHECK_MSG(rms > 0.05 && rms < 20, "logit rms %.3g", rms);
    lunar_profile p;
    memset(&p, 0, sizeof p);
    lunar_profile_install(&p);
    int32_t next = 7;
    const double t0 = lunar_prof_now();
    CHECK(lunar_forward(m, &s, &next, 1, logits, 0, &err) == 0);
    const double wall = lunar_prof_now() - t0;
    lunar_profile_install(NULL);
    double sum = 0;
    for (int f = 0; f < LUNAR_PROF_N; f++) sum += p.seconds[f];
    for (int i = 0; i < V; i++) finite &= isfinite(logits[i]) != 0;
    CHECK(finite);
    /* every family this model has ran (MLA_ATTN twice per MLA layer: the page gather, the core);
     * the regions cover most of the step */
    CHECK(p.calls[LUNAR_PROF_KDA_CORE] == 6 && p.calls[LUNAR_PROF_MLA_ATTN] == 4 && p.calls[LUNAR_PROF_LM_HEAD] == 1);
    CHECK(p.calls[LUNAR_PROF_EXPERTS] == 7 && p.calls[LUNAR_PROF_DSA] > 0 && p.calls[LUNAR_PROF_LATENT] == 14);
    CHECK_MSG(sum <= wall * 1.001 && sum > 0.5 * wall, "profiled %.3g s of a %.3g s step", sum, wall);
    lunar_seq_free(&s);
    free(logits);
    lunar_model_free(m);
}

/* --num-layers and --tp-slice: K3.1 Pro TP8 per-rank shapes from the shipped config. */
TEST(dummy_config_transforms) {
    lunar_config c;
    lunar_err err;
    CHECK(lunar_config_load(&c, "configs/kimi-k3.1-pro.json", &err) == 0);
    CHECK_MSG(lunar_config_tp_slice(&c, 8, &err) == 0, "%s", err.msg);
    CHECK(c.num_attention_heads == 12 && c.kda_num_heads == 12 && c.moe_intermediate_size == 384 &&
          c.intermediate_size == 4224 && c.vocab_size == 20480 && c.index_n_heads == 32);
    CHECK(lunar_config_truncate_layers(&c, 8, &err) == 0);
    CHECK(c.num_hidden_layers == 8 && c.n_mla_layers == 2 && c.n_kda_layers == 6);
    CHECK(lunar_config_truncate_layers(&c, 9, &err) != 0);
    CHECK(lunar_config_load(&c, "configs/kimi-k3.1-pro.json", &err) == 0);
    CHECK(lunar_config_tp_slice(&c, 7, &err) != 0 && strstr(err.msg, "divisible"));
    /* MXFP4 blocks of 32 inputs: TP 32 leaves experts of 96 = 3 blocks, TP 128 would leave 24 */
    CHECK(lunar_config_load(&c, "configs/kimi-k3.1-pro.json", &err) == 0);
    CHECK(lunar_config_tp_slice(&c, 128, &err) != 0);
}

/* The device_lazy set leaves the big matrices empty; whatever the host generates for them is what
 * the hook would: the host fill of a slice equals the same slice of the whole. */
TEST(dummy_lazy_set_and_slices) {
    lunar_model *m = load_dummy(TINY_K2, 9, 1), *h = load_dummy(TINY_K2, 9, 0);
    if (!m || !h) return;
    CHECK(lunar_dummy_is_lazy(m->embed) && !m->embed->data); /* 163840 x 32 >= 2^20 */
    { /* the CPU forward refuses it with a message instead of reading missing data */
        lunar_seq q;
        lunar_err err;
        int32_t id = 1;
        float *lg = malloc((size_t)m->cfg.vocab_size * sizeof *lg);
        CHECK(lunar_seq_init(&q, m, 2, &err) == 0);
        CHECK(lunar_forward(m, &q, &id, 1, lg, 0, &err) != 0 && strstr(err.msg, "CUDA backend only"));
        lunar_seq_free(&q);
        free(lg);
    }
    CHECK(!lunar_dummy_is_lazy(h->embed) && !lunar_dummy_is_lazy(m->final_norm));
    lunar_dummy_gen g;
    lunar_dtype dt;
    lunar_dummy_gen_for(&m->cfg, 9, m->embed->name, 2, m->embed->shape, &g, &dt);
    const int64_t i0 = 1000003, n = 4099;
    uint16_t *part = malloc((size_t)n * 2);
    lunar_dummy_fill_host(part, dt, &g, 0, i0, n);
    CHECK(memcmp(part, (const uint16_t *)h->embed->data + i0, (size_t)n * 2) == 0);
    free(part);
    lunar_model_free(m), lunar_model_free(h);
}

#ifdef LUNAR_HAVE_CUDA
#include "backend/cuda/cuda_ops.h"
#include "model/forward_cuda.h"

/* The upload hook end to end: a device_lazy dummy model (big matrices and MXFP4 experts generated on
 * the device) computes the same decode logits as the same weights uploaded from the host. Both
 * uploads hold identical bf16 values, so the only allowed difference is nondeterministic summation
 * order in the kernels (1e-5 of the largest logit is far below any wrong-weight effect, O(1)). */
TEST(dummy_device_upload_hook_matches_host_upload) {
    if (!lunar_test_cuda_device()) return;
    const char *paths[2] = {TINY_K2, SMALL_K31};
    for (int p = 0; p < 2; p++) {
        lunar_model *lz = load_dummy(paths[p], 2, 1), *h = load_dummy(paths[p], 2, 0);
        if (!lz || !h) return;
        const int V = h->cfg.vocab_size;
        float *a = malloc((size_t)V * sizeof *a), *b = malloc((size_t)V * sizeof *b);
        lunar_cuda_model *gl = NULL, *gh = NULL;
        lunar_cuda_seq sl, sh;
        lunar_err err;
        int32_t id = 5;
        CHECK_MSG(lunar_cuda_model_upload(&gl, lz, &err) == 0, "%s", err.msg);
        CHECK_MSG(lunar_cuda_model_upload(&gh, h, &err) == 0, "%s", err.msg);
        CHECK(lunar_cuda_seq_init(&sl, lz, 4, 0, &err) == 0 && lunar_cuda_seq_init(&sh, h, 4, 0, &err) == 0);
        CHECK_MSG(lunar_forward_cuda(gl, &sl, &id, 1, a, 0, &err) == 0, "%s", err.msg);
        CHECK_MSG(lunar_forward_cuda(gh, &sh, &id, 1, b, 0, &err) == 0, "%s", err.msg);
        const double e = lunar_max_rel_err(a, b, V);
        CHECK_MSG(e <= 1e-5, "%s: lazy vs host upload logits differ by %.3g", paths[p], e);
        lunar_cuda_seq_free(&sh), lunar_cuda_seq_free(&sl);
        lunar_cuda_model_free(gh), lunar_cuda_model_free(gl);
        free(a), free(b);
        lunar_model_free(lz), lunar_model_free(h);
    }
}

/* The device generator against the host one, bit for bit, for every kind and storage type. */
TEST(dummy_device_matches_host) {
    if (!lunar_test_cuda_device()) return;
    lunar_err err;
    CHECK_MSG(lunar_cuda_init(0, 0, &err) == 0, "%s", err.msg);
    lunar_model *m = load_dummy(SMALL_K31, 4, 0);
    if (!m) return;
    const size_t mark = lunar_cuda_mark();
    for (size_t i = 0; i < lunar_st_count(m->st); i++) {
        const lunar_tensor *t = lunar_st_at(m->st, i);
        lunar_dummy_gen g;
        lunar_dtype dt;
        lunar_dummy_gen_for(&m->cfg, 4, t->name, t->ndim, t->shape, &g, &dt);
        const int64_t n = lunar_tensor_numel(t);
        void *d = lunar_cuda_alloc(t->nbytes + 16), *back = malloc(t->nbytes + 16);
        const int scale = strstr(t->name, ".weight_scale") != NULL;
        if (g.kind == LUNAR_DUMMY_MXFP4 && scale) lunar_cuda_dummy_mxfp4_scale(d, &g, 0, (uint64_t)n);
        else if (g.kind == LUNAR_DUMMY_MXFP4) lunar_cuda_dummy_mxfp4_packed(d, &g, 0, (uint64_t)n);
        else if (dt == LUNAR_DTYPE_F32) lunar_cuda_dummy_f32(d, &g, 0, (uint64_t)n);
        else lunar_cuda_dummy_bf16(d, &g, 0, (uint64_t)n);
        lunar_cuda_download(back, d, t->nbytes);
        CHECK_MSG(memcmp(back, t->data, t->nbytes) == 0, "%s: device values differ from the host's", t->name);
        free(back);
    }
    /* the dequantised MXFP4 matrix the CUDA upload's hook writes */
    const lunar_mxfp4 *x = &m->layers[1].ffn.experts[5].q2;
    lunar_dummy_gen g;
    lunar_dtype dt;
    lunar_dummy_gen_for(&m->cfg, 4, x->packed->name, 2, x->packed->shape, &g, &dt);
    const int rows = (int)x->packed->shape[0], cols = (int)g.in;
    uint16_t *d = lunar_cuda_alloc((size_t)rows * cols * 2), *back = malloc((size_t)rows * cols * 2);
    float *row = malloc((size_t)cols * sizeof *row);
    lunar_cuda_dummy_mxfp4_bf16(d, &g, 0, rows);
    lunar_cuda_download(back, d, (size_t)rows * cols * 2);
    for (int r = 0; r < rows; r++) {
        lunar_mxfp4_dequant_row(row, x, r);
        for (int k = 0; k < cols; k++) CHECK(lunar_bf16_to_f32(back[(size_t)r * cols + k]) == row[k]);
    }
    free(back), free(row);
    /* the upload hook on a device_lazy model: the embedding never generated on the host */
    lunar_model *lz = load_dummy(TINY_K2, 9, 1), *h = load_dummy(TINY_K2, 9, 0);
    if (lz && h) {
        CHECK(lunar_dummy_is_lazy(lz->embed));
        uint16_t *e = lunar_cuda_alloc(h->embed->nbytes);
        void *eb = malloc(h->embed->nbytes);
        CHECK(lunar_dummy_device_bf16(e, lz->embed) == 0);
        lunar_cuda_download(eb, e, h->embed->nbytes);
        CHECK(memcmp(eb, h->embed->data, h->embed->nbytes) == 0);
        free(eb);
    }
    lunar_model_free(lz), lunar_model_free(h);
    lunar_cuda_release(mark);
    lunar_model_free(m);
}
#endif

/* ---- floors, statistics, and the commands ---- */

#include <jansson.h>

#include "cli/bench_floor.h"
#include "cli/bench_serve.h"

int lunar_cmd_bench(int argc, char **argv);

/* The anchor: Kimi-Linear-48B-A3B in BF16 moves ~6 GB per batch-1 decode step (its active
 * weights), a 1.4 ms floor at 4.3 TB/s; prefill of 8K tokens is ~5e13 FLOPs. */
TEST(bench_floors_kimi_linear_48b) {
    lunar_model m;
    memset(&m, 0, sizeof m);
    lunar_err err;
    CHECK(lunar_config_load(&m.cfg, "configs/kimi-linear-48b-a3b.json", &err) == 0);
    lunar_weight_bytes w;
    lunar_weight_bytes_of(&m, &w); /* no tensors: BF16 sizes from the shapes */
    CHECK(w.n_moe == 26 && fabs(w.per_expert - 3.0 * 2304 * 1024 * 2) < 1);
    const double b1 = lunar_decode_bytes(&m, &w, 1, 1, 2);
    CHECK_MSG(b1 > 5.5e9 && b1 < 6.6e9, "batch-1 bytes %.3g", b1);
    CHECK_NEAR(b1 / 4.3e12 * 1e3, 1.4, 0.1);
    /* 64 tokens touch 222 of 256 experts in expectation; long contexts add the latent rows */
    CHECK_NEAR(lunar_experts_touched(256, 8, 64), 222.3, 0.5);
    const double kv = lunar_decode_bytes(&m, &w, 1, 131072, 2) - lunar_decode_bytes(&m, &w, 1, 0, 2);
    CHECK_NEAR(kv, 7.0 * 131072 * 576 * 2, 1);
    const double f = lunar_prefill_flops(&m.cfg, 8192);
    CHECK_MSG(f > 4e13 && f < 6e13, "prefill flops %.3g", f);
    /* DSA caps the attended keys: K3.1 Pro's attention FLOPs grow linearly past index_topk */
    lunar_config k;
    CHECK(lunar_config_load(&k, "configs/kimi-k3.1-pro.json", &err) == 0);
    const double d1 = lunar_prefill_flops(&k, 65536) - lunar_prefill_flops(&k, 32768);
    const double d2 = lunar_prefill_flops(&k, 98304) - lunar_prefill_flops(&k, 65536);
    CHECK(d2 > d1); /* the indexer's scoring of every key stays quadratic */
}

TEST(bench_serve_statistics) {
    const double v[5] = {4, 1, 3, 2, 10};
    lunar_stats s;
    lunar_stats_of(v, 5, &s);
    CHECK_NEAR(s.mean, 4.0, 1e-12);
    CHECK_NEAR(s.median, 3.0, 1e-12);
    CHECK_NEAR(s.p99, 4 + 6 * 0.96, 1e-12); /* numpy: rank 0.99 * 4 = 3.96 between 4 and 10 */
    CHECK_NEAR(s.std, sqrt((0 + 9 + 1 + 4 + 36) / 5.0), 1e-12);
    lunar_stats_of(v, 0, &s);
    CHECK(s.n == 0 && s.mean == 0);
}

static json_t *run_bench(int argc, char **argv, const char *json_path) {
    fflush(stdout), fflush(stderr);
    int saved = dup(1), saved_err = dup(2);
    FILE *null = fopen("/dev/null", "w");
    dup2(fileno(null), 1), dup2(fileno(null), 2);
    int rc = lunar_cmd_bench(argc, argv);
    fflush(stdout), fflush(stderr);
    dup2(saved, 1), dup2(saved_err, 2);
    close(saved), close(saved_err), fclose(null);
    CHECK_MSG(rc == 0, "lunar bench exited %d", rc);
    json_error_t je;
    json_t *j = json_load_file(json_path, 0, &je);
    CHECK_MSG(j != NULL, "%s: %s", json_path, je.text);
    return j;
}

/* `lunar bench` on the bundled model: every figure present, positive, and on the right side of its
 * floor; lengths over --max-len are reported as skipped; --project-layers adds projections. */
TEST(bench_command_bundled_model_json) {
    char path[] = "/tmp/lunar_bench_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    char *argv[] = {"bench", "models/kimi-linear-tiny", "--input-lens", "64,512", "--batch-sizes", "1,4",
                    "--contexts", "100", "--steps", "2", "--max-len", "256", "--profile", "--peak-tflops",
                    "0.5", "--project-layers", "8", "--json", path};
    json_t *j = run_bench((int)(sizeof argv / sizeof *argv), argv, path);
    unlink(path);
    if (!j) return;
    CHECK(json_integer_value(json_object_get(j, "layers")) == 4);
    CHECK(json_real_value(json_object_get(j, "bandwidth_gbs")) > 0.05);
    json_t *pre = json_object_get(j, "prefill"), *dec = json_object_get(j, "decode");
    CHECK(json_array_size(pre) == 2 && json_array_size(dec) == 2);
    json_t *p0 = json_array_get(pre, 0);
    const double s = json_real_value(json_object_get(p0, "seconds")), mfu = json_real_value(json_object_get(p0, "mfu"));
    CHECK(s > 0 && mfu > 0 && mfu < 1);
    CHECK(json_real_value(json_object_get(p0, "projected_seconds")) > 0);
    CHECK(json_object_get(json_array_get(pre, 1), "skipped") != NULL); /* 512 > --max-len 256 */
    for (size_t i = 0; i < json_array_size(dec); i++) {
        json_t *d = json_array_get(dec, i);
        const double tpot = json_real_value(json_object_get(d, "tpot_ms")),
                     fr = json_real_value(json_object_get(d, "floor_over_tpot"));
        CHECK_MSG(tpot > 0 && fr > 0 && fr < 2, "tpot %.3g ms, floor/tpot %.3g", tpot, fr);
        CHECK(json_integer_value(json_object_get(d, "batch")) == (i ? 4 : 1));
        CHECK(json_real_value(json_object_get(d, "bytes_per_step")) > 2.0 * 163840 * 32); /* lm_head at least */
        CHECK(json_object_get(d, "projected_tpot_ms") != NULL);
    }
    json_t *prof = json_object_get(j, "profile_ms");
    CHECK(json_real_value(json_object_get(prof, "lm_head")) > 0 && json_real_value(json_object_get(prof, "kda_core")) > 0);
    json_decref(j);
}
