/* --load-format dummy: see model/dummy.h for the scales and why. */
#include "model/dummy.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Per-tensor key: FNV-1a of the name, mixed with the seed. */
static uint64_t name_key(uint64_t seed, const char *name, size_t len) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)name[i]) * 1099511628211ull;
    return lunar_dummy_hash(h, seed);
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* RANGE generator over [lo, hi] on a grid of 2^-12 (exact: see dummy_gen.h). */
static void set_range(lunar_dummy_gen *g, double lo, double hi) {
    const double step = 1.0 / 4096;
    g->kind = LUNAR_DUMMY_RANGE;
    g->lo = (float)(floor(lo / step) * step);
    g->step = (float)step;
    g->n_steps = (uint32_t)((hi - g->lo) / step) + 1;
}

static void set_uniform(lunar_dummy_gen *g, double fan_in) {
    g->kind = LUNAR_DUMMY_UNIFORM;
    g->a = (float)(sqrt(3.0 / (fan_in > 0 ? fan_in : 1)) / 8388608.0); /* a / 2^23 */
}

void lunar_dummy_gen_for(const lunar_config *cfg, uint64_t seed, const char *name, int ndim,
                         const int64_t *shape, lunar_dummy_gen *g, lunar_dtype *dtype) {
    memset(g, 0, sizeof *g);
    g->key = name_key(seed, name, strlen(name));
    *dtype = LUNAR_DTYPE_BF16;
    const int64_t last = shape[ndim - 1];
    const int packed = ends_with(name, ".weight_packed"), scale = ends_with(name, ".weight_scale");
    if (packed || scale) {
        /* both halves of one MXFP4 matrix share the key of its base name */
        g->key = name_key(seed, name, strlen(name) - strlen(packed ? ".weight_packed" : ".weight_scale"));
        g->kind = LUNAR_DUMMY_MXFP4;
        g->in = packed ? 2 * last : 32 * last;
        /* E2M1 codes drawn uniformly have rms sqrt(68.5 / 8) = 2.93; blocks use 2^e or 2^(e-1)
         * with equal odds (mean square factor 0.625). Target rms 1/sqrt(in). */
        double want = 1.0 / sqrt((double)g->in) / (2.93 * sqrt(0.625));
        g->exp0 = 127 + (int32_t)lround(log2(want));
        *dtype = LUNAR_DTYPE_U8;
        return;
    }
    if (ends_with(name, "norm.weight")) {
        g->kind = LUNAR_DUMMY_CONST, g->a = 1.0f;
    } else if (ends_with(name, "k_norm.bias") || ends_with(name, "e_score_correction_bias")) {
        g->kind = LUNAR_DUMMY_CONST, g->a = 0.0f;
        if (ends_with(name, "e_score_correction_bias")) *dtype = LUNAR_DTYPE_F32;
    } else if (ends_with(name, "A_log")) {
        if (cfg->kda_gate_lower_bound < 0) set_range(g, -2.0, 0.0);
        else set_range(g, 0.0, log(16.0));
        *dtype = LUNAR_DTYPE_F32;
    } else if (ends_with(name, "dt_bias")) {
        /* softplus^-1(dt) = log(expm1(dt)): dt 1e-3 -> -6.91, dt 0.1 -> -2.25 */
        if (cfg->kda_gate_lower_bound < 0) set_range(g, -2.0, 2.0);
        else set_range(g, log(expm1(1e-3)), log(expm1(0.1)));
        *dtype = LUNAR_DTYPE_F32;
    } else if (strstr(name, "conv1d.weight")) {
        set_uniform(g, cfg->kda_conv_size);
        *dtype = LUNAR_DTYPE_F32;
    } else if (ends_with(name, "embed_tokens.weight")) {
        set_uniform(g, 1.0);
    } else {
        set_uniform(g, ndim >= 2 ? (double)last : (double)shape[0]);
    }
}

void lunar_dummy_fill_host(void *dst, lunar_dtype dtype, const lunar_dummy_gen *g, int scale_tensor,
                           int64_t i0, int64_t n) {
    if (g->kind == LUNAR_DUMMY_MXFP4) {
        uint8_t *d = dst;
#pragma omp parallel for schedule(static) if (n > 65536)
        for (int64_t i = 0; i < n; i++)
            d[i] = scale_tensor ? lunar_dummy_mxfp4_scale(g, (uint64_t)(i0 + i))
                                : lunar_dummy_mxfp4_packed(g, (uint64_t)(i0 + i));
    } else if (dtype == LUNAR_DTYPE_F32) {
        float *d = dst;
#pragma omp parallel for schedule(static) if (n > 65536)
        for (int64_t i = 0; i < n; i++) d[i] = lunar_dummy_value(g, (uint64_t)(i0 + i));
    } else {
        LUNAR_ASSERT(dtype == LUNAR_DTYPE_BF16);
        uint16_t *d = dst;
#pragma omp parallel for schedule(static) if (n > 65536)
        for (int64_t i = 0; i < n; i++) d[i] = lunar_dummy_bf16(lunar_dummy_value(g, (uint64_t)(i0 + i)));
    }
}

/* ---- the sets whose large tensors are generated on the device ---- */

typedef struct lazy_set {
    const lunar_st *st;
    lunar_config cfg;
    uint64_t seed;
} lazy_set;

static pthread_mutex_t lazy_mu = PTHREAD_MUTEX_INITIALIZER;
static lazy_set *lazy_sets;
static int n_lazy_sets;

static int lazy_find(const lunar_tensor *t, lunar_dummy_gen *g) {
    int found = 0;
    pthread_mutex_lock(&lazy_mu);
    for (int i = 0; i < n_lazy_sets && !found; i++) {
        const lunar_st *st = lazy_sets[i].st;
        size_t n = lunar_st_count(st);
        if (n && t >= lunar_st_at(st, 0) && t <= lunar_st_at(st, n - 1)) {
            lunar_dtype dt;
            lunar_dummy_gen_for(&lazy_sets[i].cfg, lazy_sets[i].seed, t->name, t->ndim, t->shape, g, &dt);
            found = 1;
        }
    }
    pthread_mutex_unlock(&lazy_mu);
    return found;
}

/* TP shards of lazy tensors (lunar_dummy_window): a list searched by address. A K3.1 slice has
 * ~10^4 of them and the upload asks about each once: a linear search is cheap enough. */
typedef struct lazy_window {
    const lunar_tensor *t, *parent;
    int64_t base, ld, cols;
} lazy_window;

static lazy_window *windows;
static int n_windows, cap_windows;

void lunar_dummy_window(const lunar_tensor *t, const lunar_tensor *parent, int64_t base, int64_t ld, int64_t cols) {
    pthread_mutex_lock(&lazy_mu);
    if (n_windows == cap_windows) {
        cap_windows = cap_windows ? 2 * cap_windows : 256;
        windows = realloc(windows, (size_t)cap_windows * sizeof *windows);
        LUNAR_ASSERT(windows);
    }
    windows[n_windows++] = (lazy_window){t, parent, base, ld, cols};
    pthread_mutex_unlock(&lazy_mu);
}

void lunar_dummy_window_forget(const lunar_tensor *t) {
    pthread_mutex_lock(&lazy_mu);
    for (int i = n_windows - 1; i >= 0; i--)
        if (windows[i].t == t) {
            windows[i] = windows[--n_windows];
            break;
        }
    pthread_mutex_unlock(&lazy_mu);
}

/* The generator of a lazy tensor's values; *w: its window when it is a shard (w->t NULL: the
 * tensor itself belongs to a lazy set). 0 when t is not lazy. */
static int lazy_lookup(const lunar_tensor *t, lunar_dummy_gen *g, lazy_window *w) {
    memset(w, 0, sizeof *w);
    if (lazy_find(t, g)) return 1;
    pthread_mutex_lock(&lazy_mu);
    for (int i = n_windows - 1; i >= 0 && !w->t; i--)
        if (windows[i].t == t) *w = windows[i];
    pthread_mutex_unlock(&lazy_mu);
    return w->t && lazy_find(w->parent, g);
}

void lunar_dummy_forget(const lunar_st *st) {
    pthread_mutex_lock(&lazy_mu);
    for (int i = 0; i < n_lazy_sets; i++)
        if (lazy_sets[i].st == st) lazy_sets[i] = lazy_sets[--n_lazy_sets];
    pthread_mutex_unlock(&lazy_mu);
}

/* ---- building the set ---- */

typedef struct builder {
    const lunar_config *cfg;
    uint64_t seed;
    int lazy;
    lunar_st *st;
    lunar_err *err;
    int failed;
} builder;

static void add_one(void *ctx, const char *name, int ndim, const int64_t *shape) {
    builder *b = ctx;
    if (b->failed) return;
    lunar_dummy_gen g;
    lunar_dtype dt;
    lunar_dummy_gen_for(b->cfg, b->seed, name, ndim, shape, &g, &dt);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    const int scale = ends_with(name, ".weight_scale");
    void *data = NULL;
    /* device_lazy: the tensors the upload converts through the hook stay ungenerated (every MXFP4
     * packed tensor, the big BF16 matrices); vectors, MXFP4 scales (checked at bind time) and
     * small matrices are made here. */
    const int lazy = b->lazy && !scale &&
                     ((g.kind == LUNAR_DUMMY_UNIFORM && n >= LUNAR_DUMMY_LAZY_MIN) || g.kind == LUNAR_DUMMY_MXFP4);
    if (!lazy) {
        data = malloc((size_t)n * lunar_dtype_size(dt) + 1);
        if (!data) {
            b->failed = 1;
            lunar_fail(b->err, "dummy weights: cannot allocate %lld bytes for '%s'",
                       (long long)n * (long long)lunar_dtype_size(dt), name);
            return;
        }
        lunar_dummy_fill_host(data, dt, &g, scale, 0, n);
    }
    if (lunar_st_add(b->st, name, dt, ndim, shape, data, b->err)) b->failed = 1;
}

int lunar_dummy_build(lunar_st **out, const lunar_config *cfg, uint64_t seed, int device_lazy,
                      lunar_err *err) {
    *out = NULL;
    builder b = {.cfg = cfg, .seed = seed, .lazy = device_lazy, .err = err};
    b.st = lunar_st_new("<dummy weights>");
    lunar_config_walk_tensors(cfg, add_one, &b);
    if (b.failed) {
        lunar_st_close(b.st);
        return -1;
    }
    if (device_lazy) {
        pthread_mutex_lock(&lazy_mu);
        lazy_sets = realloc(lazy_sets, (size_t)(n_lazy_sets + 1) * sizeof *lazy_sets);
        LUNAR_ASSERT(lazy_sets);
        lazy_sets[n_lazy_sets++] = (lazy_set){b.st, *cfg, seed};
        pthread_mutex_unlock(&lazy_mu);
    }
    *out = b.st;
    return 0;
}

/* ---- the device hook ---- */

int lunar_dummy_is_lazy(const lunar_tensor *t) {
    lunar_dummy_gen g;
    lazy_window w;
    return t && !t->data && lazy_lookup(t, &g, &w);
}

#ifdef LUNAR_HAVE_CUDA
int lunar_dummy_device_bf16(uint16_t *dst_dev, const lunar_tensor *t) {
    lunar_dummy_gen g;
    lazy_window w;
    if (!t || t->data || !lazy_lookup(t, &g, &w) || g.kind == LUNAR_DUMMY_MXFP4) return -1;
    const uint64_t n = (uint64_t)lunar_tensor_numel(t);
    if (w.t)
        lunar_cuda_dummy_bf16_2d(dst_dev, &g, (uint64_t)w.base, (uint64_t)w.ld, (uint64_t)w.cols, n);
    else
        lunar_cuda_dummy_bf16(dst_dev, &g, 0, n);
    return 0;
}

int lunar_dummy_device_mxfp4_bf16(uint16_t *dst_dev, const lunar_mxfp4 *q) {
    lunar_dummy_gen g;
    lazy_window w;
    if (!q->packed || q->packed->data || !lazy_lookup(q->packed, &g, &w) || g.kind != LUNAR_DUMMY_MXFP4) return -1;
    if (w.t) /* a window of the packed bytes: two codes a byte */
        lunar_cuda_dummy_mxfp4_bf16_cols(dst_dev, &g, w.base / w.ld, q->packed->shape[0], 2 * (w.base % w.ld),
                                         2 * w.cols);
    else
        lunar_cuda_dummy_mxfp4_bf16(dst_dev, &g, 0, q->packed->shape[0]);
    return 0;
}

int lunar_dummy_device_raw(uint8_t *dst_dev, const lunar_tensor *t) {
    lunar_dummy_gen g;
    lazy_window w;
    if (!t || t->data || !lazy_lookup(t, &g, &w) || g.kind != LUNAR_DUMMY_MXFP4) return -1;
    if (w.t)
        lunar_cuda_dummy_mxfp4_packed_2d(dst_dev, &g, (uint64_t)w.base, (uint64_t)w.ld, (uint64_t)w.cols, t->nbytes);
    else
        lunar_cuda_dummy_mxfp4_packed(dst_dev, &g, 0, (uint64_t)t->nbytes);
    return 0;
}
#else
int lunar_dummy_device_bf16(uint16_t *dst_dev, const lunar_tensor *t) {
    (void)dst_dev, (void)t;
    return -1;
}
int lunar_dummy_device_mxfp4_bf16(uint16_t *dst_dev, const lunar_mxfp4 *w) {
    (void)dst_dev, (void)w;
    return -1;
}
int lunar_dummy_device_raw(uint8_t *dst_dev, const lunar_tensor *t) {
    (void)dst_dev, (void)t;
    return -1;
}
#endif

/* ---- config transforms ---- */

int lunar_config_truncate_layers(lunar_config *cfg, int L, lunar_err *err) {
    if (L <= 0 || L > cfg->num_hidden_layers)
        return lunar_fail(err, "--num-layers %d: the model has %d layers", L, cfg->num_hidden_layers);
    cfg->num_hidden_layers = L;
    cfg->n_kda_layers = cfg->n_mla_layers = 0;
    for (int l = 0; l < L; l++) {
        if (cfg->attn_kind[l] == LUNAR_ATTN_KDA) cfg->n_kda_layers++;
        else cfg->n_mla_layers++;
    }
    return 0;
}

static int split(int *v, int tp, const char *what, lunar_err *err) {
    if (*v % tp) return lunar_fail(err, "--tp-slice %d: %s %d is not divisible by %d", tp, what, *v, tp);
    *v /= tp;
    return 0;
}

int lunar_config_tp_slice(lunar_config *cfg, int tp, lunar_err *err) {
    if (tp <= 1) return 0;
    if (split(&cfg->num_attention_heads, tp, "num_attention_heads", err) ||
        (cfg->n_kda_layers && split(&cfg->kda_num_heads, tp, "linear_attn_config.num_heads", err)) ||
        (cfg->num_experts && split(&cfg->moe_intermediate_size, tp, "moe_intermediate_size", err)) ||
        split(&cfg->intermediate_size, tp, "intermediate_size", err) ||
        split(&cfg->vocab_size, tp, "vocab_size", err))
        return -1;
    if (cfg->experts_mxfp4 && cfg->moe_intermediate_size % 32)
        return lunar_fail(err, "--tp-slice %d: MXFP4 experts of width %d leave partial 32-blocks", tp,
                          cfg->moe_intermediate_size);
    /* token ids beyond the slice's vocabulary would be another rank's: keep the special ids valid */
    if (cfg->eos_token_id >= cfg->vocab_size) cfg->eos_token_id = -1;
    if (cfg->bos_token_id >= cfg->vocab_size) cfg->bos_token_id = -1;
    if (cfg->pad_token_id >= cfg->vocab_size) cfg->pad_token_id = -1;
    return 0;
}

void lunar_config_path(const char *path, char *out, size_t cap) {
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
        snprintf(out, cap, "%s/config.json", path);
    else
        snprintf(out, cap, "%s", path);
}
