/* Model loading: a checkpoint made from the config's own tensor list loads; a missing tensor, a
 * wrong shape or a truncated file is a clear error naming the file/tensor and both shapes. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/file.h"
#include "io/safetensors.h"
#include "model/forward.h"
#include "test.h"

/* A small but complete Kimi-Linear config: 2 KDA layers, 1 MLA layer, dense layer 0, MoE after. */
static const char *tiny_config =
    "{\"model_type\": \"kimi_linear\", \"vocab_size\": 50, \"hidden_size\": 16,"
    " \"num_hidden_layers\": 3, \"rms_norm_eps\": 1e-5, \"tie_word_embeddings\": false,"
    " \"intermediate_size\": 24, \"first_k_dense_replace\": 1, \"moe_layer_freq\": 1,"
    " \"num_experts\": 4, \"num_experts_per_token\": 2, \"moe_intermediate_size\": 8,"
    " \"num_shared_experts\": 1, \"moe_renormalize\": true, \"routed_scaling_factor\": 2.0,"
    " \"num_expert_group\": 1, \"topk_group\": 1, \"num_attention_heads\": 2,"
    " \"num_key_value_heads\": 2, \"q_lora_rank\": null, \"kv_lora_rank\": 8,"
    " \"qk_nope_head_dim\": 4, \"qk_rope_head_dim\": 2, \"v_head_dim\": 4, \"mla_use_nope\": true,"
    " \"linear_attn_config\": {\"kda_layers\": [1, 2], \"full_attn_layers\": [3],"
    " \"num_heads\": 2, \"head_dim\": 8, \"short_conv_kernel_size\": 4},"
    " \"bos_token_id\": 1, \"eos_token_id\": 2, \"pad_token_id\": 0}";

typedef struct collect {
    lunar_tensor t[256];
    char names[256][128];
    float *bufs[256];
    int n;
    unsigned seed;
} collect;

static void add_tensor(void *ctx, const char *name, int ndim, const int64_t *shape) {
    collect *c = ctx;
    LUNAR_ASSERT(c->n < 256);
    lunar_tensor *t = &c->t[c->n];
    snprintf(c->names[c->n], sizeof c->names[0], "%s", name);
    t->name = c->names[c->n];
    t->dtype = LUNAR_DTYPE_F32;
    t->ndim = ndim;
    memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    int64_t numel = lunar_tensor_numel(t);
    c->bufs[c->n] = lunar_xmalloc((size_t)numel * sizeof(float));
    lunar_test_fill(c->bufs[c->n], numel, c->seed++, -0.1f, 0.1f);
    t->data = c->bufs[c->n];
    t->nbytes = (size_t)numel * sizeof(float);
    c->n++;
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    LUNAR_ASSERT(f);
    fputs(text, f);
    fclose(f);
}

/* Makes DIR/config.json and DIR/model.safetensors; `mutate` edits the tensor list first. */
static void make_model(const char *dir, void (*mutate)(collect *)) {
    char path[512];
    lunar_config cfg;
    lunar_err err;
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_text(path, tiny_config);
    LUNAR_ASSERT(lunar_config_load(&cfg, path, &err) == 0);
    collect *c = calloc(1, sizeof *c);
    lunar_config_walk_tensors(&cfg, add_tensor, c);
    if (mutate) mutate(c);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK_MSG(lunar_st_write(path, c->t, (size_t)c->n, NULL, &err) == 0, "%s", err.msg);
    for (int i = 0; i < 256; i++) free(c->bufs[i]);
    free(c);
}

static int find(collect *c, const char *name) {
    for (int i = 0; i < c->n; i++)
        if (strcmp(c->names[i], name) == 0) return i;
    return -1;
}

static void drop_beta(collect *c) {
    int i = find(c, "model.layers.1.self_attn.b_proj.weight");
    LUNAR_ASSERT(i >= 0);
    /* move the last tensor into the hole; its buffer moves with it so cleanup stays simple */
    float *hole = c->bufs[i];
    c->t[i] = c->t[c->n - 1];
    memcpy(c->names[i], c->names[c->n - 1], sizeof c->names[0]);
    c->t[i].name = c->names[i];
    c->bufs[i] = c->bufs[c->n - 1];
    c->bufs[c->n - 1] = hole;
    c->n--;
}

static void reshape_kv_b(collect *c) {
    int i = find(c, "model.layers.2.self_attn.kv_b_proj.weight");
    LUNAR_ASSERT(i >= 0 && c->t[i].shape[0] == 16 && c->t[i].shape[1] == 8);
    c->t[i].shape[0] = 8, c->t[i].shape[1] = 16;
}

static char *temp_dir(void) {
    char tmpl[] = "/tmp/lunar-test-model-XXXXXX";
    char *d = mkdtemp(tmpl);
    LUNAR_ASSERT(d);
    return strdup(d);
}

static void remove_dir(const char *dir) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    rmdir(dir);
}

TEST(model_loads_and_runs_from_its_own_tensor_list) {
    char *dir = temp_dir();
    make_model(dir, NULL);
    lunar_model *m;
    lunar_err err;
    CHECK_MSG(lunar_model_load(&m, dir, &err) == 0, "%s", err.msg);
    if (m) {
        lunar_seq s;
        int32_t ids[5] = {1, 7, 3, 49, 0};
        float logits[5 * 50];
        CHECK(lunar_seq_init(&s, m, 8, &err) == 0);
        CHECK(lunar_forward(m, &s, ids, 5, logits, 1, &err) == 0);
        for (int i = 0; i < 5 * 50; i++) CHECK(isfinite(logits[i]));
        /* past capacity and out-of-vocabulary ids are errors, not crashes */
        CHECK(lunar_forward(m, &s, ids, 4, logits, 0, &err) != 0 && strstr(err.msg, "capacity"));
        int32_t bad = 50;
        CHECK(lunar_forward(m, &s, &bad, 1, logits, 0, &err) != 0 && strstr(err.msg, "vocabulary"));
        lunar_seq_free(&s);
        lunar_model_free(m);
    }
    remove_dir(dir);
    free(dir);
}

TEST(model_missing_tensor_is_named) {
    char *dir = temp_dir();
    make_model(dir, drop_beta);
    lunar_model *m;
    lunar_err err;
    CHECK(lunar_model_load(&m, dir, &err) != 0);
    CHECK_MSG(strstr(err.msg, "model.layers.1.self_attn.b_proj.weight") && strstr(err.msg, "[2, 16]"),
              "message: %s", err.msg);
    remove_dir(dir);
    free(dir);
}

TEST(model_wrong_shape_names_both_shapes) {
    char *dir = temp_dir();
    make_model(dir, reshape_kv_b);
    lunar_model *m;
    lunar_err err;
    CHECK(lunar_model_load(&m, dir, &err) != 0);
    CHECK_MSG(strstr(err.msg, "kv_b_proj") && strstr(err.msg, "[16, 8]") && strstr(err.msg, "[8, 16]") &&
                  strstr(err.msg, "model.safetensors"),
              "message: %s", err.msg);
    remove_dir(dir);
    free(dir);
}

TEST(model_truncated_checkpoint_is_an_error) {
    char *dir = temp_dir(), path[512];
    make_model(dir, NULL);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK(truncate(path, 4000) == 0);
    lunar_model *m;
    lunar_err err;
    CHECK(lunar_model_load(&m, dir, &err) != 0);
    CHECK_MSG(strstr(err.msg, "model.safetensors") != NULL, "message: %s", err.msg);
    remove_dir(dir);
    free(dir);
}

TEST(model_param_counts_match_tensor_list) {
    lunar_config cfg;
    lunar_err err;
    CHECK(lunar_config_parse(&cfg, tiny_config, strlen(tiny_config), "tiny", &err) == 0);
    lunar_param_counts p;
    lunar_config_count_params(&cfg, &p);
    /* routed experts: 2 MoE layers x 4 experts x 3 x 16 x 8 */
    CHECK(p.routed_experts == 2 * 4 * 3 * 16 * 8);
    CHECK(p.active == p.total - p.embedding - p.routed_experts + 2 * 2 * 3 * 16 * 8);
    CHECK(p.embedding == 50 * 16 && p.lm_head == 50 * 16);
}

/* K3.1 with a DeepSeek-V3.2-style indexer (index_rope = true): RoPE on the index queries and keys
 * by absolute position. The RoPE op itself is pinned to transformers' DeepseekV32Indexer
 * (tests/test_ops_oracle.c); here: positions are consistent between prefill + decode and a full
 * recompute, and turning RoPE on changes which positions are selected. */
TEST(model_k31_index_rope_positions_consistent) {
    char *dir = temp_dir(), path[512];
    char *cfg;
    size_t len;
    lunar_err err;
    CHECK(lunar_read_file("tests/golden/k31-a/config.json", 1 << 20, &cfg, &len, &err) == 0);
    char *at = strstr(cfg, "\"index_rope\": false");
    CHECK_MSG(at != NULL, "k31-a config lacks index_rope");
    if (!at) return;
    memcpy(at, "\"index_rope\":  true", strlen("\"index_rope\": false"));
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_text(path, cfg);
    free(cfg);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    char *abs = realpath("tests/golden/k31-a/model.safetensors", NULL);
    CHECK(abs && symlink(abs, path) == 0);
    free(abs);
    lunar_model *m, *m0;
    CHECK_MSG(lunar_model_load(&m, dir, &err) == 0, "%s", err.msg);
    CHECK(lunar_model_load(&m0, "tests/golden/k31-a", &err) == 0);
    if (m && m0) {
        CHECK(m->cfg.index_rope == 1 && m->cfg.index_topk == 8);
        const int V = m->cfg.vocab_size, T = 90;
        int32_t ids[90];
        for (int i = 0; i < T; i++) ids[i] = (i * 31 + 7) % (V - 8);
        float *full = lunar_xmalloc((size_t)T * V * sizeof(float)), *inc = lunar_xmalloc((size_t)V * sizeof(float));
        float *plain = lunar_xmalloc((size_t)T * V * sizeof(float));
        lunar_seq s;
        CHECK(lunar_seq_init(&s, m, T, &err) == 0);
        CHECK(lunar_forward(m, &s, ids, T, full, 1, &err) == 0);
        lunar_seq_reset(&s, m);
        CHECK(lunar_forward(m, &s, ids, T - 4, inc, 0, &err) == 0);
        for (int t = T - 4; t < T; t++) {
            CHECK(lunar_forward(m, &s, ids + t, 1, inc, 0, &err) == 0);
            double e = lunar_max_rel_err(inc, full + (size_t)t * V, V);
            CHECK_MSG(e < 1e-4, "position %d: decode vs recompute %.3g", t, e);
        }
        lunar_seq_free(&s);
        CHECK(lunar_seq_init(&s, m0, T, &err) == 0);
        CHECK(lunar_forward(m0, &s, ids, T, plain, 1, &err) == 0);
        CHECK_MSG(lunar_max_rel_err(full, plain, (long)T * V) > 1e-3, "RoPE changed nothing");
        lunar_seq_free(&s);
        free(full), free(inc), free(plain);
    }
    lunar_model_free(m);
    lunar_model_free(m0);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
    free(dir);
}
