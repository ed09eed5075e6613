/* lunar plan --config FILE [options]: how a Kimi model lays out in GPU memory under tensor
 * parallelism -- weights per GPU by kind and dtype, cache bytes per token and per request, what is
 * left for caches, and how many GPUs the model needs. See src/model/plan.c for the accounting. */
#include <stdio.h>
#include <string.h>

#include "cli/args.h"
#include "cli/commands.h"
#include "io/config.h"
#include "io/draft_config.h"
#include "model/plan.h"

static const char *usage_text =
    "usage: lunar plan --config FILE [--tp N] [--dcp N] [--draft FILE]\n"
    "                  [--kv-cache-dtype fp8|bf16] [--index-cache-dtype fp8|mxfp4]\n"
    "                  [--kda-state-dtype fp32|fp16] [--latent-moe-dtype bf16|mxfp4]\n"
    "                  [--max-model-len N] [--max-num-seqs N] [--max-num-batched-tokens N]\n"
    "                  [--gpu-memory GB] [--gpu-memory-utilization F]\n"
    "defaults: --tp 1 --dcp 1 --kv-cache-dtype fp8 --index-cache-dtype fp8 --kda-state-dtype fp32\n"
    "          --max-model-len 1048576 --max-num-seqs 256 --max-num-batched-tokens 8192\n"
    "          --gpu-memory 141 (H200) --gpu-memory-utilization 0.9\n";

static int parse_dtype(const char *opt, const char *v, const char *a, lunar_cache_dtype da,
                       const char *b, lunar_cache_dtype db, lunar_cache_dtype *out, lunar_err *err) {
    if (strcmp(v, a) == 0) *out = da;
    else if (strcmp(v, b) == 0) *out = db;
    else return lunar_fail(err, "%s: expected %s or %s, got '%s'", opt, a, b, v);
    return 0;
}

static const char *const opts_with_value[] = {
    "--config", "--draft", "--tp", "--dcp", "--kv-cache-dtype", "--index-cache-dtype",
    "--kda-state-dtype", "--latent-moe-dtype", "--max-model-len", "--max-num-seqs",
    "--max-num-batched-tokens", "--gpu-memory", "--gpu-memory-utilization", NULL};

static int parse(int argc, char **argv, const char **config, const char **draft, lunar_plan_opts *o,
                 lunar_err *err) {
    lunar_plan_opts_default(o);
    *config = *draft = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int known = 0;
        for (const char *const *k = opts_with_value; *k; k++) known |= strcmp(a, *k) == 0;
        if (!known) return lunar_fail(err, a[0] == '-' ? "unknown option '%s'" : "unexpected argument '%s'", a);
        const char *v = lunar_opt_value(argc, argv, &i, err);
        if (!v) return -1;
        long n;
        double x;
        lunar_cache_dtype lat = LUNAR_CACHE_BF16;
        if (strcmp(a, "--config") == 0) *config = v;
        else if (strcmp(a, "--draft") == 0) *draft = v;
        else if (strcmp(a, "--tp") == 0) {
            if (lunar_parse_int(a, v, 1, 4096, &n, err)) return -1;
            o->tp = (int)n;
        } else if (strcmp(a, "--dcp") == 0) {
            if (lunar_parse_int(a, v, 1, 4096, &n, err)) return -1;
            o->dcp = (int)n;
        } else if (strcmp(a, "--kv-cache-dtype") == 0) {
            if (parse_dtype(a, v, "fp8", LUNAR_CACHE_FP8, "bf16", LUNAR_CACHE_BF16, &o->kv_dtype, err)) return -1;
        } else if (strcmp(a, "--index-cache-dtype") == 0) {
            if (parse_dtype(a, v, "fp8", LUNAR_CACHE_FP8, "mxfp4", LUNAR_CACHE_MXFP4, &o->index_dtype, err)) return -1;
        } else if (strcmp(a, "--kda-state-dtype") == 0) {
            if (parse_dtype(a, v, "fp32", LUNAR_CACHE_FP32, "fp16", LUNAR_CACHE_FP16, &o->state_dtype, err)) return -1;
        } else if (strcmp(a, "--latent-moe-dtype") == 0) {
            if (parse_dtype(a, v, "bf16", LUNAR_CACHE_BF16, "mxfp4", LUNAR_CACHE_MXFP4, &lat, err)) return -1;
            o->latent_moe_mxfp4 = lat == LUNAR_CACHE_MXFP4;
        } else if (strcmp(a, "--max-model-len") == 0) {
            if (lunar_parse_int(a, v, 1, 1L << 40, &n, err)) return -1;
            o->max_model_len = n;
        } else if (strcmp(a, "--max-num-seqs") == 0) {
            if (lunar_parse_int(a, v, 1, 1L << 24, &n, err)) return -1;
            o->max_num_seqs = n;
        } else if (strcmp(a, "--max-num-batched-tokens") == 0) {
            if (lunar_parse_int(a, v, 1, 1L << 30, &n, err)) return -1;
            o->max_num_batched_tokens = n;
        } else if (strcmp(a, "--gpu-memory") == 0) {
            if (lunar_parse_float(a, v, 1e-3, 1e6, &x, err)) return -1;
            o->gpu_memory_gb = x;
        } else if (strcmp(a, "--gpu-memory-utilization") == 0) {
            if (lunar_parse_float(a, v, 1e-3, 1, &x, err)) return -1;
            o->gpu_util = x;
        }
    }
    if (!*config) return lunar_fail(err, "--config FILE is required");
    return 0;
}

int lunar_cmd_plan(int argc, char **argv) {
    if (argc == 2 && (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0)) {
        fputs(usage_text, stdout);
        return 0;
    }
    const char *config_path, *draft_path;
    lunar_plan_opts o;
    lunar_err err;
    if (parse(argc, argv, &config_path, &draft_path, &o, &err) != 0) {
        fprintf(stderr, "lunar plan: %s\n%s", err.msg, usage_text);
        return 2;
    }
    lunar_config cfg;
    lunar_draft_config draft;
    if (lunar_config_load(&cfg, config_path, &err) != 0) {
        fprintf(stderr, "lunar plan: --config: %s\n", err.msg);
        return 1;
    }
    if (draft_path && lunar_draft_config_load(&draft, draft_path, &err) != 0) {
        fprintf(stderr, "lunar plan: --draft: %s\n", err.msg);
        return 1;
    }
    int64_t vision = lunar_vision_params_load(config_path, &err);
    if (vision < 0) {
        fprintf(stderr, "lunar plan: --config: %s\n", err.msg);
        return 1;
    }
    const lunar_draft_config *d = draft_path ? &draft : NULL;
    lunar_plan p;
    if (lunar_plan_compute(&p, &cfg, vision, d, &o, &err) != 0) {
        fprintf(stderr, "lunar plan: %s\n", err.msg);
        return 1;
    }
    lunar_plan_print(stdout, &p, &cfg, d, vision);

    int tp1 = lunar_plan_min_tp(&cfg, vision, d, &o, 0), tpn = lunar_plan_min_tp(&cfg, vision, d, &o, 1);
    printf("\nGPUs of %.0f GB at utilisation %.2f for the weights + one request of %lld tokens:\n",
           o.gpu_memory_gb, o.gpu_util, (long long)o.max_model_len);
    if (tp1) printf("  dcp %d: tp %d (%d node%s of 8)\n", o.dcp < tp1 ? o.dcp : tp1, tp1, (tp1 + 7) / 8, tp1 > 8 ? "s" : "");
    else printf("  dcp %d: no power-of-two tp up to 64 fits\n", o.dcp);
    if (tpn) printf("  dcp = tp: tp %d (%d node%s of 8)\n", tpn, (tpn + 7) / 8, tpn > 8 ? "s" : "");
    else printf("  dcp = tp: no power-of-two tp up to 64 fits\n");
    return 0;
}
