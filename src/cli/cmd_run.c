/* lunar logits / lunar generate: run the model on token ids. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "engine/sampler.h"
#include "io/npy.h"
#include "model/forward.h"
#include "model/tp_group.h"
#include "model/cache.h"
#include "model/forward_cuda.h"
#include "ops.h"
#include "text/tokenizer.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct run_opts {
    const char *model_dir, *ids, *prompt, *out, *backend;
    int cuda_precision; /* CPU: model the CUDA backend's roundings */
    long max_tokens;
    double temperature, top_p;
    long top_k, seed;
    lunar_load_options load;
    long tp, dcp; /* --tensor-parallel-size, --decode-context-parallel-size */
    int ep;       /* --enable-expert-parallel */
} run_opts;

/* Parses the options both commands share; `generate` selects the sampling ones. */
static int parse(int argc, char **argv, int generate, run_opts *o, lunar_err *err) {
    memset(o, 0, sizeof *o);
    o->max_tokens = 16;
    o->top_p = 1.0;
    o->tp = o->dcp = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (a[0] != '-') {
            if (o->model_dir) return lunar_fail(err, "unexpected argument '%s'", a);
            o->model_dir = a;
            continue;
        }
        if (strcmp(a, "--enable-expert-parallel") == 0) {
            o->ep = 1;
            continue;
        }
        if (strcmp(a, "--cuda-precision") == 0) {
            o->cuda_precision = 1;
            continue;
        }
        if (!(v = lunar_opt_value(argc, argv, &i, err))) return -1;
        double d;
        long n;
        if (strcmp(a, "--ids") == 0) o->ids = v;
        else if (strcmp(a, "--prompt") == 0) o->prompt = v;
        else if (strcmp(a, "--backend") == 0) o->backend = v;
        else if (strcmp(a, "--tensor-parallel-size") == 0 || strcmp(a, "-tp") == 0) {
            if (lunar_parse_int(a, v, 1, 1024, &o->tp, err)) return -1;
        } else if (strcmp(a, "--decode-context-parallel-size") == 0 || strcmp(a, "-dcp") == 0) {
            if (lunar_parse_int(a, v, 1, 1024, &o->dcp, err)) return -1;
        }
        else if (!generate && strcmp(a, "--out") == 0) o->out = v;
        else if (generate && strcmp(a, "--max-tokens") == 0) {
            if (lunar_parse_int(a, v, 0, 1 << 24, &o->max_tokens, err)) return -1;
        } else if (generate && strcmp(a, "--temperature") == 0) {
            if (lunar_parse_float(a, v, 0, 100, &o->temperature, err)) return -1;
        } else if (generate && strcmp(a, "--top-p") == 0) {
            if (lunar_parse_float(a, v, 1e-6, 1, &d, err)) return -1;
            o->top_p = d;
        } else if (generate && strcmp(a, "--top-k") == 0) {
            if (lunar_parse_int(a, v, 0, 1 << 30, &n, err)) return -1;
            o->top_k = n;
        } else if (generate && strcmp(a, "--seed") == 0) {
            if (lunar_parse_int(a, v, 0, 0x7fffffffffffffffL, &o->seed, err)) return -1;
        } else {
            int h = lunar_parse_load_option(a, v, &o->load, err);
            if (h < 0) return -1;
            if (!h) return lunar_fail(err, "unknown option '%s'", a);
        }
    }
    if (!o->model_dir) return lunar_fail(err, "missing MODEL_DIR");
    if (!o->ids && !o->prompt)
        return lunar_fail(err, "missing --ids (token ids, e.g. --ids 1,2,3) or --prompt TEXT");
    if (o->ids && o->prompt) return lunar_fail(err, "give --ids or --prompt, not both");
    if (!generate && !o->out) return lunar_fail(err, "missing --out FILE.npy");
    return 0;
}

/* --prompt: the text's ids under the model directory's tokenizer (special-token strings are
 * recognised, so a prompt may spell control tokens); *tok stays loaded for streaming output. */
static int prompt_ids(const run_opts *o, lunar_tokenizer **tok, int32_t **ids, int *n, lunar_err *err) {
    if (lunar_tokenizer_load(tok, o->model_dir, err)) return -1;
    lunar_ids v = {0};
    if (lunar_tokenize(*tok, o->prompt, strlen(o->prompt), true, &v, err)) return -1;
    if (!v.n) return lunar_fail(err, "--prompt: empty prompt");
    *ids = v.ids;
    *n = (int)v.n;
    return 0;
}

/* One sequence on the selected backend (CPU: its own caches, optionally modelling the CUDA
 * backend's roundings, or a CPU tensor-parallel group of rank threads; CUDA: device weights and
 * caches). */
typedef struct runner {
    lunar_backend_kind be;
    lunar_tp_group *g;
    const lunar_model *m;
    int pos, cuda_precision;
    lunar_kv_pool kv;
    lunar_state_pool st;
    int32_t *blocks;
    lunar_cuda_model *gm;
    lunar_cuda_seq gpu;
} runner;

static int runner_init(runner *r, lunar_backend_kind be, const lunar_model *m, const run_opts *o, int max_tokens,
                       lunar_err *err) {
    memset(r, 0, sizeof *r);
    const int cuda_precision = o->cuda_precision;
    r->be = be, r->m = m, r->cuda_precision = cuda_precision;
    if (o->tp > 1 || o->dcp > 1 || o->ep) {
        if (be != LUNAR_BACKEND_CPU)
            return lunar_fail(err, "--tensor-parallel-size / --decode-context-parallel-size run as CPU rank "
                                   "threads for now: add --backend cpu");
        lunar_tp_opts t = {(int)o->tp, (int)o->dcp, o->ep};
        if (lunar_tp_group_create(&r->g, m, &t, err)) return -1;
        if (lunar_tp_group_seq_init(r->g, max_tokens, err)) {
            lunar_tp_group_free(r->g);
            r->g = NULL;
            return -1;
        }
        return 0;
    }
    if (be == LUNAR_BACKEND_CPU) {
        /* --cuda-precision: bf16 GEMM operands and weights (op_set_bf16_operands) and a bf16 latent
         * cache, as the device computes, so that the two backends can be compared token for token */
        const int nb = (max_tokens + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
        if (lunar_kv_pool_init(&r->kv, &m->cfg, nb, cuda_precision ? LUNAR_KV_BF16 : LUNAR_KV_F32, err)) return -1;
        if (lunar_state_pool_init(&r->st, &m->cfg, 1, 0, err)) {
            lunar_kv_pool_free(&r->kv);
            return -1;
        }
        r->blocks = lunar_xmalloc((size_t)nb * sizeof *r->blocks);
        for (int i = 0; i < nb; i++) r->blocks[i] = i;
        return 0;
    }
    if (lunar_cuda_model_upload(&r->gm, m, err)) return -1;
    if (lunar_cuda_seq_init(&r->gpu, m, max_tokens, err)) {
        lunar_cuda_model_free(r->gm);
        return -1;
    }
    return 0;
}

static int runner_forward(runner *r, const int32_t *ids, int n, float *logits, int all, lunar_err *err) {
    if (r->g) return lunar_tp_group_forward(r->g, ids, n, logits, all, err);
    if (r->be != LUNAR_BACKEND_CPU) return lunar_forward_cuda(r->gm, &r->gpu, ids, n, logits, all, err);
    lunar_batch_seq one = {ids, n, r->pos, 0, r->blocks, all ? LUNAR_LOGITS_ALL : LUNAR_LOGITS_LAST};
    op_set_bf16_operands(r->cuda_precision);
    int rc = lunar_forward_batch(r->m, &r->kv, &r->st, &one, 1, logits, err);
    op_set_bf16_operands(0);
    if (rc == 0) r->pos += n;
    return rc;
}

static void runner_free(runner *r) {
    if (r->g) {
        lunar_tp_group_free(r->g);
    } else if (r->be == LUNAR_BACKEND_CPU) {
        lunar_kv_pool_free(&r->kv);
        lunar_state_pool_free(&r->st);
        free(r->blocks);
    } else {
        lunar_cuda_seq_free(&r->gpu); /* before the weights: the device arena is a stack */
        lunar_cuda_model_free(r->gm);
    }
}

/* Loads the model and the ids, selects the backend; on success the caller owns m, ids, tok. */
static int setup(const run_opts *o, lunar_backend_kind *be_out, lunar_model **m, int32_t **ids, int *n,
                 lunar_tokenizer **tok, lunar_err *err) {
    lunar_backend_kind be;
    *tok = NULL;
    if (lunar_backend_select(o->backend, &be, err)) return -1;
    *be_out = be;
    if (o->prompt ? prompt_ids(o, tok, ids, n, err) : lunar_parse_ids(o->ids, ids, n, err)) {
        lunar_tokenizer_free(*tok);
        return -1;
    }
    if (lunar_model_load_ex(m, o->model_dir, &o->load, err)) {
        free(*ids);
        lunar_tokenizer_free(*tok);
        return -1;
    }
    return 0;
}

int lunar_cmd_logits(int argc, char **argv) {
    run_opts o;
    lunar_err err;
    lunar_model *m = NULL;
    int32_t *ids = NULL;
    lunar_tokenizer *tok = NULL;
    lunar_backend_kind be = LUNAR_BACKEND_CPU;
    int n = 0, rc = 1;
    if (parse(argc, argv, 0, &o, &err) || setup(&o, &be, &m, &ids, &n, &tok, &err)) {
        fprintf(stderr, "lunar logits: %s\n", err.msg);
        fprintf(stderr, "usage: lunar logits MODEL_DIR --ids 1,2,3 --out FILE.npy [--backend cpu|cuda|auto] [--cuda-precision]\n       " LUNAR_LOAD_OPTIONS_USAGE "\n");
        return 1;
    }
    const int V = m->cfg.vocab_size;
    float *logits = malloc((size_t)n * V * sizeof(float));
    runner s;
    if (!logits) {
        fprintf(stderr, "lunar logits: cannot allocate %d x %d logits\n", n, V);
    } else if (runner_init(&s, be, m, &o, n, &err) == 0) {
        if (runner_forward(&s, ids, n, logits, 1, &err) == 0) {
            int64_t shape[2] = {n, V};
            rc = lunar_npy_write_f32(o.out, logits, 2, shape, &err) ? 1 : 0;
        }
        runner_free(&s);
    }
    if (rc) fprintf(stderr, "lunar logits: %s\n", err.msg);
    free(logits);
    free(ids);
    lunar_tokenizer_free(tok);
    lunar_model_free(m);
    return rc;
}

int lunar_cmd_generate(int argc, char **argv) {
    run_opts o;
    lunar_err err;
    lunar_model *m = NULL;
    int32_t *ids = NULL;
    lunar_tokenizer *tok = NULL;
    lunar_backend_kind be = LUNAR_BACKEND_CPU;
    int n = 0;
    if (parse(argc, argv, 1, &o, &err) || setup(&o, &be, &m, &ids, &n, &tok, &err)) {
        fprintf(stderr, "lunar generate: %s\n", err.msg);
        fprintf(stderr, "usage: lunar generate MODEL_DIR (--ids 1,2,3 | --prompt TEXT) --max-tokens N "
                        "[--temperature T --top-p P --top-k K --seed S --backend cpu|cuda|auto --cuda-precision]\n       " LUNAR_LOAD_OPTIONS_USAGE "\n"
                        "       [--tensor-parallel-size N [--decode-context-parallel-size D] "
                        "[--enable-expert-parallel]]  (CPU: N rank threads)\n");
        return 1;
    }
    const int V = m->cfg.vocab_size;
    float *logits = lunar_xmalloc((size_t)V * sizeof(float));
    void *scratch = lunar_xmalloc((size_t)V * 2 * sizeof(float));
    lunar_sampling sp = {.temperature = (float)o.temperature, .top_k = (int)o.top_k,
                         .top_p = (float)o.top_p, .seed = (uint64_t)o.seed};
    lunar_rng rng;
    lunar_rng_seed(&rng, sp.seed);
    runner s;
    int rc = 1;
    if (runner_init(&s, be, m, &o, n + (int)o.max_tokens, &err) == 0) {
        double t0 = now_s();
        rc = runner_forward(&s, ids, n, logits, 0, &err) ? 1 : 0;
        double t1 = now_s(), t_prefill = t1 - t0;
        int generated = 0;
        /* with a tokenizer the output is streamed as text, never splitting a UTF-8 character */
        lunar_detok dt;
        char piece[LUNAR_DETOK_MAX_OUT];
        if (tok) lunar_detok_init(&dt, tok, false);
        for (; rc == 0 && generated < o.max_tokens; generated++) {
            int32_t next = lunar_sample(logits, V, &sp, &rng, scratch);
            if (tok && next < lunar_tokenizer_vocab_size(tok))
                fwrite(piece, 1, lunar_detok_push(&dt, next, piece), stdout);
            else
                printf("%s%d", generated ? "," : "", next);
            fflush(stdout);
            if (next == m->cfg.eos_token_id) {
                generated++;
                break;
            }
            if (generated + 1 < o.max_tokens && runner_forward(&s, &next, 1, logits, 0, &err))
                rc = 1;
        }
        if (tok) fwrite(piece, 1, lunar_detok_flush(&dt, piece), stdout);
        printf("\n");
        fflush(stdout);
        double t_decode = now_s() - t1;
        if (rc == 0)
            fprintf(stderr, "prefill: %d tokens in %.3f s (%.1f tok/s); decode: %d tokens in %.3f s "
                            "(%.2f tok/s, backend %s, tp %ld, dcp %ld)\n",
                    n, t_prefill, n / t_prefill, generated, t_decode,
                    generated > 1 ? (generated - 1) / t_decode : 0.0, lunar_backend_name(be), o.tp, o.dcp);
        runner_free(&s);
    }
    if (rc) fprintf(stderr, "lunar generate: %s\n", err.msg);
    free(logits), free(scratch), free(ids);
    lunar_tokenizer_free(tok);
    lunar_model_free(m);
    return rc;
}
