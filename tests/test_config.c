#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include "io/config.h"
#include "test.h"

TEST(config_kimi_linear_48b) {
    lunar_config c;
    lunar_err err = {{0}};
    int rc = lunar_config_load(&c, "configs/kimi-linear-48b-a3b.json", &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    if (rc) return;
    CHECK(c.arch == LUNAR_ARCH_KIMI_LINEAR && strcmp(c.model_type, "kimi_linear") == 0);
    CHECK(c.vocab_size == 163840 && c.hidden_size == 2304 && c.num_hidden_layers == 27);
    CHECK_NEAR(c.rms_norm_eps, 1e-5, 1e-12);
    CHECK(c.tie_word_embeddings == 0);
    CHECK(c.bos_token_id == 163584 && c.eos_token_id == 163586 && c.pad_token_id == 163839);

    CHECK(c.n_kda_layers == 20 && c.n_mla_layers == 7);
    static const int mla[] = {3, 7, 11, 15, 19, 23, 26};
    for (int l = 0, j = 0; l < 27; l++) {
        int is_mla = j < 7 && mla[j] == l;
        j += is_mla;
        CHECK_MSG(c.attn_kind[l] == (is_mla ? LUNAR_ATTN_MLA : LUNAR_ATTN_KDA), "layer %d", l);
        CHECK_MSG(c.ffn_kind[l] == (l == 0 ? LUNAR_FFN_DENSE : LUNAR_FFN_MOE), "ffn layer %d", l);
    }
    CHECK(c.kda_num_heads == 32 && c.kda_head_dim == 128 && c.kda_conv_size == 4);
    CHECK(c.kda_gate_lower_bound == 0.0f);

    CHECK(c.num_attention_heads == 32 && c.q_lora_rank == 0 && c.kv_lora_rank == 512);
    CHECK(c.qk_nope_head_dim == 128 && c.qk_rope_head_dim == 64 && c.v_head_dim == 128);
    CHECK(c.mla_use_nope == 1);

    CHECK(c.intermediate_size == 9216 && c.first_k_dense_replace == 1 && c.moe_layer_freq == 1);
    CHECK(c.num_experts == 256 && c.num_experts_per_token == 8 && c.moe_intermediate_size == 1024);
    CHECK(c.num_shared_experts == 1 && c.moe_renormalize == 1);
    CHECK_NEAR(c.routed_scaling_factor, 2.446, 1e-6);
    CHECK(c.num_expert_group == 1 && c.topk_group == 1);
}

TEST(config_kimi_k3) {
    lunar_config c;
    lunar_err err = {{0}};
    int rc = lunar_config_load(&c, "configs/kimi-k3.json", &err);
    CHECK_MSG(rc == 0, "%s", err.msg);
    if (rc) return;
    CHECK(c.arch == LUNAR_ARCH_KIMI_K3 && strcmp(c.model_type, "kimi_k3") == 0);
    CHECK(c.num_hidden_layers == 93 && c.n_kda_layers == 69 && c.n_mla_layers == 24);
    CHECK(c.attn_kind[3] == LUNAR_ATTN_MLA && c.attn_kind[91] == LUNAR_ATTN_MLA && c.attn_kind[92] == LUNAR_ATTN_MLA);
    CHECK(c.attn_kind[0] == LUNAR_ATTN_KDA && c.attn_kind[90] == LUNAR_ATTN_KDA);
    CHECK(c.hidden_size == 7168 && c.kda_num_heads == 96 && c.num_attention_heads == 96);
    CHECK(c.q_lora_rank == 1536 && c.kda_gate_lower_bound == -5.0f);
    CHECK(c.num_experts == 896 && c.num_experts_per_token == 16 && c.num_shared_experts == 2);
    CHECK(c.ffn_kind[0] == LUNAR_FFN_DENSE && c.ffn_kind[1] == LUNAR_FFN_MOE && c.ffn_kind[92] == LUNAR_FFN_MOE);
    CHECK_NEAR(c.routed_scaling_factor, 1.0, 0);
    CHECK(c.bos_token_id == 163584 && c.eos_token_id == 163586);
}

/* A minimal valid config with `extra` spliced in after the model_type (later keys are fine:
 * they must not repeat one of the base keys). */
#define BASE "\"vocab_size\": 100, \"hidden_size\": 64, \"num_hidden_layers\": 4, \"intermediate_size\": 128, " \
             "\"num_attention_heads\": 2"

static int parse(lunar_config *c, const char *json, lunar_err *err) {
    return lunar_config_parse(c, json, strlen(json), "configs/x.json", err);
}

TEST(config_defaults_and_rules) {
    lunar_config c;
    lunar_err err = {{0}};
    /* nothing optional: transformers' defaults */
    CHECK_MSG(parse(&c, "{\"model_type\": \"kimi_linear\", " BASE "}", &err) == 0, "%s", err.msg);
    CHECK(c.kda_num_heads == 32 && c.kda_head_dim == 128 && c.kda_conv_size == 4);
    CHECK(c.attn_kind[0] == LUNAR_ATTN_KDA && c.attn_kind[1] == LUNAR_ATTN_KDA && c.attn_kind[3] == LUNAR_ATTN_KDA);
    CHECK(c.num_experts == 256 && c.num_experts_per_token == 8 && c.q_lora_rank == 0);
    CHECK(c.bos_token_id == -1 && c.eos_token_id == -1 && c.pad_token_id == -1);
    CHECK(c.ffn_kind[0] == LUNAR_FFN_DENSE && c.ffn_kind[1] == LUNAR_FFN_MOE);
    CHECK(c.mla_use_nope == 1 && c.moe_renormalize == 1 && c.kda_gate_lower_bound == 0.0f);
    CHECK(c.kv_lora_rank == 512 && c.qk_nope_head_dim == 128 && c.qk_rope_head_dim == 64 && c.v_head_dim == 128);

    /* transformers' default schedule without linear_attn_config: MLA at 0-based 4, 8, ... */
    CHECK_MSG(parse(&c, "{\"model_type\": \"kimi_linear\", \"vocab_size\": 10, \"hidden_size\": 8, "
                        "\"num_hidden_layers\": 9, \"intermediate_size\": 8, \"num_attention_heads\": 1}",
                    &err) == 0,
              "%s", err.msg);
    CHECK(c.n_mla_layers == 2 && c.attn_kind[4] == LUNAR_ATTN_MLA && c.attn_kind[8] == LUNAR_ATTN_MLA);
    CHECK(c.attn_kind[0] == LUNAR_ATTN_KDA && c.attn_kind[3] == LUNAR_ATTN_KDA);

    /* moe_layer_freq and first_k_dense_replace; num_experts 0 means all dense; ints for floats */
    CHECK_MSG(parse(&c, "{\"model_type\": \"kimi_linear\", " BASE ", \"first_k_dense_replace\": 1, "
                        "\"moe_layer_freq\": 2, \"routed_scaling_factor\": 2, \"eos_token_id\": [7, 8]}",
                    &err) == 0,
              "%s", err.msg);
    CHECK(c.ffn_kind[0] == LUNAR_FFN_DENSE && c.ffn_kind[1] == LUNAR_FFN_DENSE && c.ffn_kind[2] == LUNAR_FFN_MOE &&
          c.ffn_kind[3] == LUNAR_FFN_DENSE);
    CHECK(c.routed_scaling_factor == 2.0f && c.eos_token_id == 7);
    CHECK(parse(&c, "{\"model_type\": \"kimi_linear\", " BASE ", \"num_experts\": 0}", &err) == 0);
    for (int l = 0; l < 4; l++) CHECK(c.ffn_kind[l] == LUNAR_FFN_DENSE);

    /* alias spellings; explicit layer_types / mlp_layer_types win */
    CHECK_MSG(parse(&c, "{\"model_type\": \"kimi_linear\", " BASE ", \"num_local_experts\": 16, "
                        "\"num_experts_per_tok\": 4, \"n_group\": 4, \"topk_group\": 2, "
                        "\"layer_types\": [\"full_attention\", \"linear_attention\", \"linear_attention\", "
                        "\"full_attention\"], \"mlp_layer_types\": [\"sparse\", \"dense\", \"sparse\", \"dense\"]}",
                    &err) == 0,
              "%s", err.msg);
    CHECK(c.num_experts == 16 && c.num_experts_per_token == 4 && c.num_expert_group == 4 && c.topk_group == 2);
    CHECK(c.attn_kind[0] == LUNAR_ATTN_MLA && c.attn_kind[1] == LUNAR_ATTN_KDA && c.attn_kind[3] == LUNAR_ATTN_MLA);
    CHECK(c.n_mla_layers == 2 && c.ffn_kind[0] == LUNAR_FFN_MOE && c.ffn_kind[1] == LUNAR_FFN_DENSE);

    /* kimi_k3 reads from text_config */
    CHECK_MSG(parse(&c, "{\"model_type\": \"kimi_k3\", \"bos_token_id\": 5, \"text_config\": {" BASE
                        ", \"linear_attn_config\": {\"kda_layers\": [1, 2, 3], \"full_attn_layers\": [4], "
                        "\"gate_lower_bound\": -5}}}",
                    &err) == 0,
              "%s", err.msg);
    CHECK(c.arch == LUNAR_ARCH_KIMI_K3 && c.n_kda_layers == 3 && c.attn_kind[3] == LUNAR_ATTN_MLA);
    CHECK(c.kda_gate_lower_bound == -5.0f && c.bos_token_id == 5);
}

/* json must fail, with each needle in the message (plus the file name). */
static void bad(const char *json, const char *n1, const char *n2, int line) {
    lunar_config c;
    lunar_err err = {{0}};
    int rc = parse(&c, json, &err);
    CHECK_MSG(rc == -1, "line %d: expected failure", line);
    CHECK_MSG(strstr(err.msg, "configs/x.json"), "line %d: no file name in '%s'", line, err.msg);
    CHECK_MSG(!n1 || strstr(err.msg, n1), "line %d: '%s' not in '%s'", line, n1, err.msg);
    CHECK_MSG(!n2 || strstr(err.msg, n2), "line %d: '%s' not in '%s'", line, n2, err.msg);
}
#define BAD(j, a, b) bad(j, a, b, __LINE__)
#define KL "{\"model_type\": \"kimi_linear\", "

TEST(config_errors) {
    BAD(KL BASE ", \"linear_attn_config\": {\"num_heads\": \"32\"}}", "key 'linear_attn_config.num_heads'",
        "expected a positive integer, found \"32\"");
    BAD("{\"model_type\": \"llama\", " BASE "}", "key 'model_type'", "\"llama\"");
    BAD("{" BASE "}", "key 'model_type'", "missing");
    BAD("{\"model_type\": 3, " BASE "}", "key 'model_type'", NULL);
    BAD(KL "\"vocab_size\": 100}", "key 'hidden_size'", "missing");
    BAD(KL BASE ", \"hidden_size\": 0}", NULL, NULL); /* duplicate key */
    BAD(KL "\"vocab_size\": 100, \"hidden_size\": -64, \"num_hidden_layers\": 4}", "key 'hidden_size'", "-64");
    BAD(KL "\"vocab_size\": 100, \"hidden_size\": 64.0, \"num_hidden_layers\": 4}", "key 'hidden_size'", "64.0");
    BAD(KL "\"vocab_size\": 100, \"hidden_size\": 64, \"num_hidden_layers\": 300}", "key 'num_hidden_layers'", "300");
    BAD(KL "\"vocab_size\": 100, \"hidden_size\": 64, \"num_hidden_layers\": 0}", "key 'num_hidden_layers'", NULL);
    BAD(KL BASE ", \"linear_attn_config\": {\"kda_layers\": [1, 2, 3], \"full_attn_layers\": [5]}}",
        "key 'linear_attn_config.full_attn_layers'", "5");
    BAD(KL BASE ", \"linear_attn_config\": {\"kda_layers\": [0, 1, 2, 3], \"full_attn_layers\": [4]}}",
        "key 'linear_attn_config.kda_layers'", "0");
    BAD(KL BASE ", \"linear_attn_config\": {\"kda_layers\": [1, 2, 3, 4], \"full_attn_layers\": [4]}}",
        "full_attn_layers", "layer 4 is in both");
    BAD(KL BASE ", \"linear_attn_config\": {\"kda_layers\": [1, 2, 3, 2], \"full_attn_layers\": [4]}}",
        "kda_layers", "layer 2 is listed twice");
    BAD(KL BASE ", \"linear_attn_config\": {\"kda_layers\": [1, 2], \"full_attn_layers\": [4]}}", "kda_layers",
        "layer 3 is in neither");
    BAD(KL BASE ", \"linear_attn_config\": {\"kda_layers\": [1, 2, 3]}}", "linear_attn_config.full_attn_layers",
        "missing");
    BAD(KL BASE ", \"linear_attn_config\": {\"kda_layers\": \"1,2,3\", \"full_attn_layers\": [4]}}",
        "linear_attn_config.kda_layers", NULL);
    BAD(KL BASE ", \"linear_attn_config\": [1]}", "key 'linear_attn_config'", NULL);
    BAD(KL BASE ", \"linear_attn_config\": {\"gate_lower_bound\": \"-5\"}}", "linear_attn_config.gate_lower_bound",
        NULL);
    BAD(KL BASE ", \"num_experts\": 8, \"num_experts_per_token\": 9}", "key 'num_experts_per_token'", "9");
    BAD(KL BASE ", \"num_experts\": 8, \"num_expert_group\": 3}", "key 'num_expert_group'", NULL);
    BAD(KL BASE ", \"num_experts\": 8, \"num_expert_group\": 2, \"topk_group\": 3}", "key 'topk_group'", NULL);
    BAD(KL BASE ", \"num_key_value_heads\": 1}", "key 'num_key_value_heads'", NULL);
    BAD(KL BASE ", \"q_lora_rank\": -1}", "key 'q_lora_rank'", NULL);
    BAD(KL BASE ", \"v_head_dim\": 0}", "key 'v_head_dim'", NULL);
    BAD(KL BASE ", \"qk_nope_head_dim\": 0}", "key 'qk_nope_head_dim'", NULL);
    BAD(KL BASE ", \"rms_norm_eps\": \"1e-5\"}", "key 'rms_norm_eps'", NULL);
    BAD(KL BASE ", \"rms_norm_eps\": -1e-5}", "key 'rms_norm_eps'", NULL);
    BAD(KL BASE ", \"tie_word_embeddings\": 0}", "key 'tie_word_embeddings'", NULL);
    BAD(KL BASE ", \"eos_token_id\": \"x\"}", "key 'eos_token_id'", NULL);
    BAD(KL BASE ", \"moe_layer_freq\": 0}", "key 'moe_layer_freq'", NULL);
    BAD(KL BASE ", \"layer_types\": [\"full_attention\"]}", "key 'layer_types'", NULL);
    BAD(KL BASE ", \"mlp_layer_types\": [\"dense\", \"dense\", \"moe\", \"dense\"]}", "key 'mlp_layer_types[2]'",
        "\"moe\"");
    BAD("{\"model_type\": \"kimi_k3\", \"text_config\": {" BASE ", \"kv_lora_rank\": 0}}",
        "key 'text_config.kv_lora_rank'", NULL);
    BAD("{\"model_type\": \"kimi_k3\", \"text_config\": 5}", "key 'text_config'", NULL);
    BAD("{\"model_type\": \"kimi_k3\", \"text_config\": {\"vocab_size\": 1}}", "key 'text_config.hidden_size'",
        "missing");
    BAD("[1]", "not a JSON object", NULL);
    BAD("{", "not valid JSON", NULL);
    BAD("", "not valid JSON", NULL);

    lunar_config c;
    lunar_err err = {{0}};
    CHECK(lunar_config_load(&c, "configs/does-not-exist.json", &err) == -1 &&
          strstr(err.msg, "configs/does-not-exist.json"));
}

/* Every committed broken config must fail cleanly with its name in the message. */
TEST(config_corpus) {
    DIR *d = opendir("tests/corpus/config");
    CHECK_MSG(d, "tests/corpus/config missing (run from the repository root)");
    if (!d) return;
    struct dirent *e;
    int n = 0;
    char p[512];
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(p, sizeof p, "tests/corpus/config/%s", e->d_name);
        lunar_config c;
        lunar_err err = {{0}};
        int rc = lunar_config_load(&c, p, &err);
        int want_ok = strncmp(e->d_name, "ok_", 3) == 0;
        CHECK_MSG(want_ok ? rc == 0 : rc == -1, "%s: rc %d (%s)", p, rc, err.msg);
        CHECK_MSG(rc == 0 || strstr(err.msg, e->d_name), "%s: message '%s'", p, err.msg);
        n++;
    }
    closedir(d);
    CHECK(n >= 15);
}
