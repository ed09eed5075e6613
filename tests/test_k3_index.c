/* The real Kimi-K3 checkpoint index (tests/data/kimi-k3/, copied from shared/data: 497,220 tensors,
 * 96 shards, 1.56 TB) against the tensor list our binder derives from the published config: every
 * text-model tensor in the index is one the loader binds, and every tensor the loader binds is in
 * the index. What remains is the MoonViT tower and projector (vision_tower.*, mm_projector.*),
 * loaded by the vision work. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "io/config.h"
#include "model/model.h"
#include "test.h"

typedef struct names {
    char **v;
    size_t n, cap;
} names;

static void collect(void *ctx, const char *name, int ndim, const int64_t *shape) {
    names *s = ctx;
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 1024;
        s->v = realloc(s->v, s->cap * sizeof *s->v);
        LUNAR_ASSERT(s->v);
    }
    s->v[s->n++] = strdup(name);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static char *gunzip_file(const char *path, size_t *len) {
    gzFile f = gzopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 24, n = 0;
    char *buf = malloc(cap);
    int got;
    while ((got = gzread(f, buf + n, (unsigned)(cap - n))) > 0) {
        n += (size_t)got;
        if (n == cap) buf = realloc(buf, cap *= 2);
    }
    gzclose(f);
    *len = n;
    return buf;
}

TEST(k3_binder_covers_the_real_checkpoint_index) {
    lunar_config cfg;
    lunar_err err;
    CHECK_MSG(lunar_config_load(&cfg, "configs/kimi-k3.json", &err) == 0, "%s", err.msg);
    CHECK(cfg.experts_mxfp4 && cfg.routed_expert_hidden_size == 3584 && cfg.attn_res_block_size == 12);
    names ours = {0};
    lunar_config_walk_tensors(&cfg, collect, &ours);
    qsort(ours.v, ours.n, sizeof *ours.v, cmp_str);

    size_t len;
    char *text = gunzip_file("tests/data/kimi-k3/model.safetensors.index.json.gz", &len);
    CHECK_MSG(text != NULL, "cannot read the K3 index");
    if (!text) return;
    json_error_t je;
    json_t *root = json_loadb(text, len, 0, &je);
    free(text);
    json_t *wm = json_object_get(root, "weight_map");
    CHECK(json_object_size(wm) == 497220);

    size_t matched = 0, vision = 0, unknown = 0;
    const char *key;
    json_t *val;
    json_object_foreach(wm, key, val) {
        const char *k = key;
        if (bsearch(&k, ours.v, ours.n, sizeof *ours.v, cmp_str)) {
            matched++;
        } else if (strncmp(key, "vision_tower.", 13) == 0 || strncmp(key, "mm_projector.", 13) == 0) {
            vision++;
        } else if (unknown++ < 5) {
            CHECK_MSG(0, "index tensor '%s' is not bound by the loader", key);
        }
    }
    /* every tensor we bind exists in the index */
    size_t missing = 0;
    for (size_t i = 0; i < ours.n; i++)
        if (!json_object_get(wm, ours.v[i]) && missing++ < 5)
            CHECK_MSG(0, "loader expects '%s', absent from the index", ours.v[i]);
    CHECK_MSG(unknown == 0 && missing == 0 && matched == ours.n,
              "matched %zu of %zu bound tensors; %zu unknown, %zu missing", matched, ours.n, unknown, missing);
    CHECK_MSG(vision == 168, "vision tensors: %zu", vision);
    json_decref(root);
    for (size_t i = 0; i < ours.n; i++) free(ours.v[i]);
    free(ours.v);
}

TEST(k3_parameter_counts_match_the_spec) {
    lunar_config cfg;
    lunar_err err;
    CHECK(lunar_config_load(&cfg, "configs/kimi-k3.json", &err) == 0);
    lunar_param_counts p;
    lunar_config_count_params(&cfg, &p);
    /* k3_spec 2.3: ~2.78 T total; 896 experts x 33.03 M x 92 layers routed; ~105 B active with the
     * embedding (our active count leaves the 1.174 B embedding lookup out). */
    CHECK_MSG(p.total > 2.75e12 && p.total < 2.81e12, "total %lld", (long long)p.total);
    CHECK(p.routed_experts == 92LL * 896 * 3 * 3584 * 3072);
    CHECK_MSG(p.active > 102e9 && p.active < 106e9, "active %lld", (long long)p.active);
}
