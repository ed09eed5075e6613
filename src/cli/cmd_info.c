/* lunar info MODEL_DIR|CONFIG.json: architecture, parameter counts, bytes by dtype. */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/commands.h"
#include "io/config.h"
#include "io/draft_config.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "model/plan.h"

static void print_layers(const lunar_config *c, lunar_attn_kind kind) {
    int first = 1;
    for (int l = 0; l < c->num_hidden_layers; l++)
        if (c->attn_kind[l] == kind) {
            printf("%s%d", first ? "" : ",", l);
            first = 0;
        }
}

static void print_count(const char *label, int64_t n) {
    if (n) printf("  %-22s %16lld  (%.3f B)\n", label, (long long)n, (double)n / 1e9);
}

/* A DSpark draft config (it has target_layer_ids): its own keys, not a Kimi model_type. */
static int info_draft(const char *cfg_path) {
    lunar_draft_config d;
    lunar_err err;
    if (lunar_draft_config_load(&d, cfg_path, &err) != 0) {
        fprintf(stderr, "lunar info: %s\n", err.msg);
        return 1;
    }
    printf("model_type: DSpark draft\n");
    printf("layers: %d x (MLA %d heads, q_lora %d, kv_lora %d, nope %d + rope %d, v %d; dense MLP %d)\n",
           d.num_hidden_layers, d.num_attention_heads, d.q_lora_rank, d.kv_lora_rank, d.qk_nope_head_dim,
           d.qk_rope_head_dim, d.v_head_dim, d.intermediate_size);
    printf("hidden %d, vocab %d; taps", d.hidden_size, d.vocab_size);
    for (int i = 0; i < d.n_taps; i++) printf("%s%d", i ? "," : " ", d.target_layer_ids[i]);
    printf(" of a %d-layer target (width %d)\n", d.target_num_hidden_layers, d.target_hidden_size);
    printf("Markov head %s, rank %d; mask token %d; block of %d drafts + anchor\n", d.markov_head_type,
           d.markov_rank, d.mask_token_id, d.block_size);
    int64_t n = lunar_draft_count_params(&d);
    printf("parameters: %.3f B loaded (embedding and lm_head are the target's)\n", (double)n / 1e9);
    return 0;
}

int lunar_cmd_info(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: lunar info MODEL_DIR|CONFIG.json\n");
        return 2;
    }
    const char *path = argv[1];
    struct stat sb;
    char cfg_path[1100];
    int is_dir = stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
    snprintf(cfg_path, sizeof cfg_path, is_dir ? "%s/config.json" : "%s", path);
    lunar_config c;
    lunar_err err;
    int draft = lunar_draft_config_sniff(cfg_path, &err);
    if (draft < 0) {
        fprintf(stderr, "lunar info: %s\n", err.msg);
        return 1;
    }
    if (draft) return info_draft(cfg_path);
    if (lunar_config_load(&c, cfg_path, &err) != 0) {
        fprintf(stderr, "lunar info: %s\n", err.msg);
        return 1;
    }
    printf("model_type: %s\n", c.model_type);
    printf("layers: %d (hidden %d, vocab %d)\n", c.num_hidden_layers, c.hidden_size, c.vocab_size);
    printf("  KDA x%d (heads %d x %d, conv %d%s) at ", c.n_kda_layers, c.kda_num_heads,
           c.kda_head_dim, c.kda_conv_size, c.kda_gate_lower_bound < 0 ? ", bounded gate" : "");
    print_layers(&c, LUNAR_ATTN_KDA);
    printf("\n  MLA x%d (heads %d, kv_lora %d, nope %d + rope %d, v %d) at ", c.n_mla_layers,
           c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
           c.v_head_dim);
    print_layers(&c, LUNAR_ATTN_MLA);
    if (c.index_topk > 0)
        printf("\n  DSA indexer on every MLA layer: %d heads x %d, top-%d%s", c.index_n_heads,
               c.index_head_dim, c.index_topk, c.index_rope ? ", RoPE" : "");
    printf("\n  MoE: %d experts, top-%d, expert inter %d, %d shared; dense inter %d; first %d dense\n",
           c.num_experts, c.num_experts_per_token, c.moe_intermediate_size, c.num_shared_experts,
           c.intermediate_size, c.first_k_dense_replace);

    lunar_param_counts p;
    lunar_config_count_params(&c, &p);
    printf("parameters:\n");
    print_count("embedding", p.embedding);
    print_count("lm_head", p.lm_head);
    print_count("attention", p.attention);
    print_count("dense MLP", p.dense_mlp);
    print_count("shared experts", p.shared_experts);
    print_count("routed experts", p.routed_experts);
    print_count("routers", p.router);
    print_count("norms", p.norms);
    printf("  total %.2f B, active per token %.2f B\n", (double)p.total / 1e9, (double)p.active / 1e9);

    if (!is_dir) return 0;
    lunar_st *st;
    if (lunar_st_open(&st, path, &err) != 0) {
        printf("checkpoint: none loaded (%s)\n", err.msg);
        return 0;
    }
    size_t bytes[LUNAR_DTYPE_COUNT] = {0}, total = 0;
    int64_t numel = 0;
    for (size_t i = 0; i < lunar_st_count(st); i++) {
        const lunar_tensor *t = lunar_st_at(st, i);
        bytes[t->dtype] += t->nbytes;
        total += t->nbytes;
        numel += lunar_tensor_numel(t);
    }
    printf("checkpoint: %zu tensors, %lld values, %.3f GB\n", lunar_st_count(st), (long long)numel,
           (double)total / 1e9);
    for (int d = 0; d < LUNAR_DTYPE_COUNT; d++)
        if (bytes[d]) printf("  %-8s %14zu bytes\n", lunar_dtype_name((lunar_dtype)d), bytes[d]);
    lunar_st_close(st);
    return 0;
}
