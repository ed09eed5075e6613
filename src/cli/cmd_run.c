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
#include "model/forward_cuda_tp.h"
#include "model/shard.h"
#include "parallel/launch.h"
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
    long master_port; /* CUDA rank processes: the rendezvous port on 127.0.0.1 */
    long decode_after; /* logits: ids[0, K) as one prefill step, then one decode step per id (0: one step) */
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
        else if (strcmp(a, "--master-port") == 0) {
            if (lunar_parse_int(a, v, 1, 65535, &o->master_port, err)) return -1;
        }
        else if (!generate && strcmp(a, "--out") == 0) o->out = v;
        else if (!generate && strcmp(a, "--decode-after") == 0) {
            if (lunar_parse_int(a, v, 0, 1 << 24, &o->decode_after, err)) return -1;
        }
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
    lunar_model *rank_m; /* CUDA tensor parallelism: this process's shards and its NCCL comms */
    lunar_comm *comm, *dcp; /* dcp: lunar_dcp_comm's (the TP comm, a split of it, or NULL) */
} runner;

/* ri: this process is a CUDA rank (cuda_tp_main): its GPU, its comm, its shards of m. */
static int runner_init(runner *r, lunar_backend_kind be, const lunar_model *m, const run_opts *o, int max_tokens,
                       const lunar_rank_info *ri, lunar_err *err) {
    memset(r, 0, sizeof *r);
    const int cuda_precision = o->cuda_precision;
    r->be = be, r->m = m, r->cuda_precision = cuda_precision;
    if (ri) {
        lunar_tp_opts t = {(int)o->tp, (int)o->dcp, o->ep};
        /* the comm first: NCCL takes its buffers outside the arena, which then takes what is left */
        if (lunar_tp_check(&m->cfg, &t, err) ||
            lunar_comm_nccl_init(&r->comm, ri->id, ri->rank, ri->world, ri->local_rank, err))
            return -1;
        /* the DCP group (ranks r / dcp, DCP rank r % dcp): the TP comm itself or its split */
        if (lunar_dcp_comm(r->comm, t.dcp, &r->dcp, err) || lunar_cuda_rank_init(ri->local_rank, 0.9, err) ||
            lunar_shard_model(&r->rank_m, m, &t, ri->rank, r->comm, r->dcp, err) ||
            lunar_cuda_tp_check(r->rank_m, err)) {
            lunar_model_free(r->rank_m);
            lunar_dcp_comm_free(r->comm, r->dcp);
            lunar_comm_free(r->comm);
            return -1;
        }
        r->m = m = r->rank_m;
    } else if (o->tp > 1 || o->dcp > 1 || o->ep) {
        if (be != LUNAR_BACKEND_CPU)
            return lunar_fail(err, "--tensor-parallel-size on CUDA needs an explicit --backend cuda (one process per "
                                   "GPU); --backend cpu runs CPU rank threads");
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
    if (lunar_cuda_model_upload(&r->gm, m, err) == 0) {
        if (lunar_cuda_seq_init(&r->gpu, m, max_tokens, 0, err) == 0) return 0;
        lunar_cuda_model_free(r->gm);
    }
    lunar_model_free(r->rank_m);
    lunar_dcp_comm_free(r->comm, r->dcp);
    lunar_comm_free(r->comm);
    return -1;
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
        lunar_model_free(r->rank_m);
        lunar_dcp_comm_free(r->comm, r->dcp);
        lunar_comm_free(r->comm);
    }
}

/* --backend cuda with --tensor-parallel-size > 1 (or expert parallelism): one rank process per GPU
 * of this node. The parent must not touch the device before the launcher forks (a CUDA context
 * does not survive fork), so the backend is taken as named, not probed. */
static int cuda_tp(const run_opts *o) {
    return (o->tp > 1 || o->ep) && o->backend && strcmp(o->backend, "cuda") == 0;
}

/* Loads the model and the ids, selects the backend; on success the caller owns m, ids, tok. */
static int setup(const run_opts *o, lunar_backend_kind *be_out, lunar_model **m, int32_t **ids, int *n,
                 lunar_tokenizer **tok, lunar_err *err) {
    lunar_backend_kind be = LUNAR_BACKEND_CUDA;
    *tok = NULL;
    if (!cuda_tp(o) && lunar_backend_select(o->backend, &be, err)) return -1;
    *be_out = be;
    if (o->prompt ? prompt_ids(o, tok, ids, n, err) : lunar_parse_ids(o->ids, ids, n, err)) {
        lunar_tokenizer_free(*tok);
        return -1;
    }
    /* dummy weights for the device are generated there (model/dummy.h), also as rank shards */
    lunar_load_options lo = o->load;
    lo.device_lazy = be == LUNAR_BACKEND_CUDA && lo.load_format && strcmp(lo.load_format, "dummy") == 0;
    if (lunar_model_load_ex(m, o->model_dir, &lo, err)) {
        free(*ids);
        lunar_tokenizer_free(*tok);
        return -1;
    }
    return 0;
}

/* What one process (or rank 0 of the CUDA ranks, which alone writes or prints) runs. */
typedef struct run_job {
    const run_opts *o;
    lunar_backend_kind be;
    const lunar_model *m;
    const int32_t *ids;
    int n;
    lunar_tokenizer *tok;
    int generate;
} run_job;

static int logits_body(const run_job *j, const lunar_rank_info *ri, lunar_err *err) {
    const int V = j->m->cfg.vocab_size, n = j->n;
    float *logits = malloc((size_t)n * V * sizeof(float));
    if (!logits) return lunar_fail(err, "cannot allocate %d x %d logits", n, V);
    runner s;
    int rc = -1;
    if (runner_init(&s, j->be, j->m, j->o, n, ri, err) == 0) {
        /* --decode-after K: the rows of a prefill of K tokens, then of a decode step per token */
        const int pre = j->o->decode_after > 0 && j->o->decode_after < n ? (int)j->o->decode_after : n;
        int frc = runner_forward(&s, j->ids, pre, logits, 1, err);
        for (int i = pre; i < n && frc == 0; i++) frc = runner_forward(&s, j->ids + i, 1, logits + (size_t)i * V, 0, err);
        if (frc == 0) {
            int64_t shape[2] = {n, V};
            rc = ri && ri->rank != 0 ? 0 : lunar_npy_write_f32(j->o->out, logits, 2, shape, err);
        }
        long cap = 0, rep = 0;
        if (s.gm) lunar_cuda_model_graph_stats(s.gm, &cap, &rep, NULL, NULL);
        if (cap && (!ri || ri->rank == 0)) /* the decode rows came from graphs (tests/test_cuda_tp.c) */
            fprintf(stderr, "lunar: CUDA graphs: %ld captured, %ld replayed\n", cap, rep);
        runner_free(&s);
    }
    free(logits);
    return rc;
}

static int generate_body(const run_job *j, const lunar_rank_info *ri, lunar_err *err) {
    const run_opts *o = j->o;
    const lunar_model *m = j->m;
    const int V = m->cfg.vocab_size, n = j->n;
    lunar_tokenizer *tok = j->tok;
    float *logits = lunar_xmalloc((size_t)V * sizeof(float));
    void *scratch = lunar_xmalloc((size_t)V * 2 * sizeof(float));
    /* every CUDA rank holds the same gathered logits and the same seed: the ranks sample the same
     * tokens and stay in step without exchanging them */
    lunar_sampling sp = {.temperature = (float)o->temperature, .top_k = (int)o->top_k,
                         .top_p = (float)o->top_p, .seed = (uint64_t)o->seed};
    lunar_rng rng;
    lunar_rng_seed(&rng, sp.seed);
    runner s;
    int rc = 1;
    if (runner_init(&s, j->be, m, o, n + (int)o->max_tokens, ri, err) == 0) {
        double t0 = now_s();
        rc = runner_forward(&s, j->ids, n, logits, 0, err) ? 1 : 0;
        double t1 = now_s(), t_prefill = t1 - t0;
        int generated = 0;
        /* with a tokenizer the output is streamed as text, never splitting a UTF-8 character */
        lunar_detok dt;
        char piece[LUNAR_DETOK_MAX_OUT];
        if (tok) lunar_detok_init(&dt, tok, false);
        for (; rc == 0 && generated < o->max_tokens; generated++) {
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
            if (generated + 1 < o->max_tokens && runner_forward(&s, &next, 1, logits, 0, err))
                rc = 1;
        }
        if (tok) fwrite(piece, 1, lunar_detok_flush(&dt, piece), stdout);
        printf("\n");
        fflush(stdout);
        double t_decode = now_s() - t1;
        if (rc == 0 && (!ri || ri->rank == 0))
            fprintf(stderr, "prefill: %d tokens in %.3f s (%.1f tok/s); decode: %d tokens in %.3f s "
                            "(%.2f tok/s, backend %s, tp %ld, dcp %ld)\n",
                    n, t_prefill, n / t_prefill, generated, t_decode,
                    generated > 1 ? (generated - 1) / t_decode : 0.0, lunar_backend_name(j->be), o->tp, o->dcp);
        runner_free(&s);
    }
    free(logits), free(scratch);
    return rc ? -1 : 0;
}

static int tp_rank(const lunar_rank_info *ri, void *arg) {
    const run_job *j = arg;
    lunar_err err;
    if (ri->rank != 0 && !freopen("/dev/null", "w", stdout)) return 1; /* rank 0 prints */
    if ((j->generate ? generate_body : logits_body)(j, ri, &err)) {
        fprintf(stderr, "rank %d: %s\n", ri->rank, err.msg);
        return 1;
    }
    return 0;
}

/* The job in this process, or under cuda_tp in o->tp forked rank processes (GPU j for rank j). */
static int run(const run_job *j, lunar_err *err) {
    if (!cuda_tp(j->o)) return (j->generate ? generate_body : logits_body)(j, NULL, err);
    lunar_dist_opts d = {1, 0, (int)j->o->tp, "127.0.0.1", (int)j->o->master_port};
    return lunar_launch_node(&d, lunar_nccl_get_unique_id, tp_rank, (void *)j, 300000, err);
}

static const char LOGITS_USAGE[] =
    "usage: lunar logits MODEL_DIR --ids 1,2,3 --out FILE.npy [--decode-after K] [--backend cpu|cuda|auto] [--cuda-precision]\n"
    "       " LUNAR_LOAD_OPTIONS_USAGE "\n"
    "       [--tensor-parallel-size N [--enable-expert-parallel] [--master-port P]]  "
    "(CPU: N rank threads; CUDA: N rank processes, one per GPU)\n";
static const char GENERATE_USAGE[] =
    "usage: lunar generate MODEL_DIR (--ids 1,2,3 | --prompt TEXT) --max-tokens N "
    "[--temperature T --top-p P --top-k K --seed S --backend cpu|cuda|auto --cuda-precision]\n"
    "       " LUNAR_LOAD_OPTIONS_USAGE "\n"
    "       [--tensor-parallel-size N [--decode-context-parallel-size D] "
    "[--enable-expert-parallel] [--master-port P]]  (CPU: N rank threads; CUDA: N rank "
    "processes, one per GPU; CUDA DCP: D = N)\n";

/* `lunar logits` and `lunar generate`: parse, load, run (one process, or N rank processes) */
static int run_command(int argc, char **argv, int generate) {
    const char *name = generate ? "generate" : "logits";
    run_opts o;
    lunar_err err;
    lunar_model *m = NULL;
    int32_t *ids = NULL;
    lunar_tokenizer *tok = NULL;
    lunar_backend_kind be = LUNAR_BACKEND_CPU;
    int n = 0;
    if (parse(argc, argv, generate, &o, &err) || setup(&o, &be, &m, &ids, &n, &tok, &err)) {
        fprintf(stderr, "lunar %s: %s\n%s", name, err.msg, generate ? GENERATE_USAGE : LOGITS_USAGE);
        return 1;
    }
    run_job j = {&o, be, m, ids, n, tok, generate};
    int rc = run(&j, &err) ? 1 : 0;
    if (rc) fprintf(stderr, "lunar %s: %s\n", name, err.msg);
    free(ids);
    lunar_tokenizer_free(tok);
    lunar_model_free(m);
    return rc;
}

int lunar_cmd_logits(int argc, char **argv) { return run_command(argc, argv, 0); }
int lunar_cmd_generate(int argc, char **argv) { return run_command(argc, argv, 1); }
