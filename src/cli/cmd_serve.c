/* lunar serve MODEL_DIR: the OpenAI-compatible HTTP server (src/server/), vLLM-style flags. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cli/args.h"
#include "engine/engine_tp.h"
#include "parallel/launch.h"
#include "cli/commands.h"
#include "io/config.h"
#include "model/dummy.h"
#include "server/server.h"

static const char *USAGE =
    "usage: lunar serve MODEL_DIR [--host H] [--port P] [--served-model-name NAME[,NAME...]] [--tokenizer DIR]\n"
    "         [--max-model-len N] [--max-num-seqs N] [--max-num-batched-tokens N] [--gpu-memory-utilization F]\n"
    "         [--cache-memory-bytes N] [--kv-cache-dtype auto|bf16|fp8] [--kda-state-dtype fp32|fp16] [--api-key KEY] [--backend cpu|cuda|auto]\n"
    "         [--sampling-guard auto|on|off] [--max-body-bytes N] [--timeout-keep-alive S] [--max-pending N]\n"
    "         [--no-prefix-caching] [--quiet] [--fake-engine [--fake-script TEXT] [--fake-delay-ms MS]]\n"
    "         " LUNAR_LOAD_OPTIONS_USAGE " (dummy: MODEL_DIR may be a config.json)\n"
    "         [--tensor-parallel-size N [--decode-context-parallel-size D] [--enable-expert-parallel] [--master-port P]]\n"
    "         (--backend cpu: N rank threads; --backend cuda: N rank processes, one per GPU, no DCP)\n";

typedef struct serve_opts {
    const char *model_dir, *tokenizer, *host, *names, *api_key, *backend, *kv_dtype, *state_dtype, *guard, *fake_script;
    long port, max_model_len, max_num_seqs, max_batched, max_body, timeout, max_pending, fake_delay_ms;
    long long cache_bytes;
    double gpu_util;
    int fake, quiet, no_prefix;
    lunar_load_options load;
    long tp, dcp; /* --tensor-parallel-size, --decode-context-parallel-size */
    long master_port; /* CUDA rank processes: the rendezvous port on 127.0.0.1 */
    int ep;       /* --enable-expert-parallel */
} serve_opts;

static int parse(int argc, char **argv, serve_opts *o, lunar_err *err) {
    memset(o, 0, sizeof *o);
    o->host = "0.0.0.0";
    o->port = 8000;
    o->max_model_len = 8192;
    o->max_num_seqs = 64;
    o->max_batched = 2048;
    o->max_body = 32l << 20;
    o->timeout = 120;
    o->max_pending = 4096;
    o->gpu_util = 0.9;
    o->backend = "auto";
    o->kv_dtype = "auto";
    o->state_dtype = "fp32";
    o->guard = "auto";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        double d;
        if (a[0] != '-') {
            if (o->model_dir) return lunar_fail(err, "unexpected argument '%s'", a);
            o->model_dir = a;
            continue;
        }
        if (strcmp(a, "--fake-engine") == 0) { o->fake = 1; continue; }
        if (strcmp(a, "--quiet") == 0) { o->quiet = 1; continue; }
        if (strcmp(a, "--no-prefix-caching") == 0) { o->no_prefix = 1; continue; }
        if (strcmp(a, "--enable-expert-parallel") == 0) { o->ep = 1; continue; }
        if (!(v = lunar_opt_value(argc, argv, &i, err))) return -1;
        if (strcmp(a, "--host") == 0) o->host = v;
        else if (strcmp(a, "--port") == 0) { if (lunar_parse_int(a, v, 0, 65535, &o->port, err)) return -1; }
        else if (strcmp(a, "--served-model-name") == 0) o->names = v;
        else if (strcmp(a, "--tokenizer") == 0) o->tokenizer = v;
        else if (strcmp(a, "--max-model-len") == 0) { if (lunar_parse_int(a, v, 16, 1l << 31, &o->max_model_len, err)) return -1; }
        else if (strcmp(a, "--max-num-seqs") == 0) { if (lunar_parse_int(a, v, 1, 1 << 20, &o->max_num_seqs, err)) return -1; }
        else if (strcmp(a, "--max-num-batched-tokens") == 0) { if (lunar_parse_int(a, v, 1, 1l << 30, &o->max_batched, err)) return -1; }
        else if (strcmp(a, "--gpu-memory-utilization") == 0) { if (lunar_parse_float(a, v, 0.01, 1.0, &o->gpu_util, err)) return -1; }
        else if (strcmp(a, "--cache-memory-bytes") == 0) { if (lunar_parse_float(a, v, 0, 1e15, &d, err)) return -1; o->cache_bytes = (long long)d; }
        else if (strcmp(a, "--kv-cache-dtype") == 0) o->kv_dtype = v;
        /* vLLM names the recurrent-state dtype of hybrid models --mamba-ssm-cache-dtype */
        else if (strcmp(a, "--kda-state-dtype") == 0 || strcmp(a, "--mamba-ssm-cache-dtype") == 0) o->state_dtype = v;
        else if (strcmp(a, "--api-key") == 0) o->api_key = v;
        else if (strcmp(a, "--backend") == 0) o->backend = v;
        else if (strcmp(a, "--tensor-parallel-size") == 0 || strcmp(a, "-tp") == 0) { if (lunar_parse_int(a, v, 1, 1024, &o->tp, err)) return -1; }
        else if (strcmp(a, "--decode-context-parallel-size") == 0 || strcmp(a, "-dcp") == 0) { if (lunar_parse_int(a, v, 1, 1024, &o->dcp, err)) return -1; }
        else if (strcmp(a, "--master-port") == 0) { if (lunar_parse_int(a, v, 1, 65535, &o->master_port, err)) return -1; }
        else if (strcmp(a, "--sampling-guard") == 0) o->guard = v;
        else if (strcmp(a, "--max-body-bytes") == 0) { if (lunar_parse_int(a, v, 1024, 1l << 40, &o->max_body, err)) return -1; }
        else if (strcmp(a, "--timeout-keep-alive") == 0) { if (lunar_parse_int(a, v, 1, 86400, &o->timeout, err)) return -1; }
        else if (strcmp(a, "--max-pending") == 0) { if (lunar_parse_int(a, v, 1, 1 << 20, &o->max_pending, err)) return -1; }
        else if (strcmp(a, "--fake-script") == 0) o->fake_script = v;
        else if (strcmp(a, "--fake-delay-ms") == 0) { if (lunar_parse_int(a, v, 0, 60000, &o->fake_delay_ms, err)) return -1; }
        else {
            int h = lunar_parse_load_option(a, v, &o->load, err);
            if (h < 0) return -1;
            if (!h) return lunar_fail(err, "unknown option '%s'", a);
        }
    }
    if (!o->model_dir) return lunar_fail(err, "missing MODEL_DIR");
    if (strcmp(o->guard, "auto") && strcmp(o->guard, "on") && strcmp(o->guard, "off"))
        return lunar_fail(err, "--sampling-guard: auto, on or off");
    if (strcmp(o->kv_dtype, "auto") && strcmp(o->kv_dtype, "bf16") && strcmp(o->kv_dtype, "fp8"))
        return lunar_fail(err, "--kv-cache-dtype: auto, bf16 or fp8");
    if (strcmp(o->state_dtype, "fp32") && strcmp(o->state_dtype, "float32") && strcmp(o->state_dtype, "fp16") &&
        strcmp(o->state_dtype, "float16"))
        return lunar_fail(err, "--kda-state-dtype: fp32 or fp16");
    return 0;
}

/* comma-separated names -> array (the strings are carved out of a copy) */
static int split_names(const char *s, char **copy, const char ***names) {
    *copy = strdup(s);
    int n = 1;
    for (const char *p = s; *p; p++) n += *p == ',';
    *names = lunar_xcalloc((size_t)n, sizeof **names);
    int k = 0;
    for (char *tok = strtok(*copy, ","); tok; tok = strtok(NULL, ","))
        if (*tok) (*names)[k++] = tok;
    return k;
}

/* What every process of the server needs: the options, the parsed config, the server's settings. */
typedef struct serve_job {
    const serve_opts *o;
    const lunar_config *cfg;
    lunar_server_options *so;
    int world;      /* CUDA rank processes (1: none) */
    int (*sv)[2];   /* [world - 1] socketpairs: [0] rank 0's end, [1] the follower's */
} serve_job;

static void engine_options(const serve_opts *o, lunar_engine_options *eo) {
    lunar_srv_engine_options_default(eo);
    eo->model_dir = o->model_dir;
    eo->backend = o->backend;
    eo->max_num_seqs = (int)o->max_num_seqs;
    eo->max_num_batched_tokens = (int)o->max_batched;
    eo->max_model_len = (int)o->max_model_len;
    eo->kv_cache_dtype = o->kv_dtype;
    eo->kda_state_fp16 = strcmp(o->state_dtype, "fp16") == 0 || strcmp(o->state_dtype, "float16") == 0;
    eo->enable_prefix_caching = !o->no_prefix;
    eo->load_format = o->load.load_format;
    eo->num_layers = o->load.num_layers;
    eo->tp_slice = o->load.tp_slice;
    eo->dummy_seed = o->load.seed;
    eo->ptpc_fp8 = o->load.ptpc_fp8;
    eo->tensor_parallel_size = (int)o->tp;
    eo->decode_context_parallel_size = (int)o->dcp;
    eo->enable_expert_parallel = o->ep;
    if (o->cache_bytes > 0) eo->cache_memory_bytes = o->cache_bytes;
    if (o->gpu_util > 0) eo->gpu_memory_utilization = o->gpu_util;
}

/* The server in this process (rank 0 under CUDA TP, linked by l): the backend, the HTTP server,
 * then a wait for SIGINT / SIGTERM. */
static int serve_body(const serve_job *j, const lunar_tp_link *l, lunar_err *err) {
    const serve_opts *o = j->o;
    const lunar_config *cfg = j->cfg;
    lunar_server_options *so = j->so;
    /* signals go to sigwait below, not to the engine's, NCCL's or the server's threads (they
     * inherit this mask): a SIGTERM that reached one of them would end the process uncleanly */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (o->fake) {
        const char *dflt = cfg->arch == LUNAR_ARCH_KIMI_K3
                               ? "Hello from the fake engine.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
                               : "Hello from the fake engine.<|im_end|>";
        const char *text = o->fake_script ? o->fake_script : dflt;
        lunar_ids ids = {0};
        if (lunar_tokenize(so->tok, text, strlen(text), true, &ids, err)) return -1;
        lunar_srv_fake_options fo = {.script = ids.ids, .n_script = (int)ids.n, .stop_at_end = 1,
                                     .token_delay_us = (int)o->fake_delay_ms * 1000, .max_running = (int)o->max_num_seqs};
        int frc = lunar_srv_backend_fake(&so->backend, &fo, err);
        lunar_ids_free(&ids);
        if (frc) return -1;
    } else {
        lunar_engine_options eo;
        engine_options(o, &eo);
        eo.tp_link = l;
        if (lunar_srv_backend_engine(&so->backend, &eo, err)) return -1;
    }

    lunar_server *srv;
    if (lunar_server_start(&srv, so, err)) return -1;
    fprintf(stderr, "lunar serve: %s (%s) on http://%s:%d  model name%s: %s%s%s%s\n", o->model_dir, cfg->model_type,
            o->host, lunar_server_port(srv), so->policy.n_model_names > 1 ? "s" : "", o->names ? o->names : o->model_dir,
            so->policy.sampling_guard ? "  sampling guard on" : "", o->fake ? "  FAKE ENGINE" : "",
            l ? "  CUDA tensor parallel" : "");
    fflush(stderr);
    int sig;
    sigwait(&set, &sig);
    fprintf(stderr, "lunar serve: signal %d, stopping\n", sig);
    lunar_server_stop(srv);
    return 0;
}

/* A rank process of the CUDA TP server: rank 0 serves, the others follow it. Each keeps only its
 * own ends of the links (so that a rank that goes away is seen as EOF by its peers). */
static int serve_rank(const lunar_rank_info *ri, void *arg) {
    const serve_job *j = arg;
    lunar_err err;
    lunar_tp_link l = {ri->rank, ri->world, ri->local_rank, {0}, NULL};
    memcpy(l.id, ri->id, sizeof l.id);
    int fds[1024];
    for (int k = 0; k < j->world - 1; k++) {
        const int mine = ri->rank == 0 || ri->rank == k + 1;
        close(j->sv[k][ri->rank == 0 ? 1 : 0]); /* the other side's end */
        if (ri->rank == 0) fds[k] = j->sv[k][0];
        else if (mine) fds[0] = j->sv[k][1];
        else close(j->sv[k][1]);
    }
    l.fds = fds;
    int rc;
    if (ri->rank == 0) {
        rc = serve_body(j, &l, &err);
    } else {
        /* a follower stops when rank 0 says so or goes away, never on a signal of its own: a
         * terminal's Ctrl-C reaches every process of the group, and rank 0 must stop first */
        signal(SIGINT, SIG_IGN), signal(SIGTERM, SIG_IGN);
        lunar_engine_options eo;
        engine_options(j->o, &eo);
        rc = lunar_engine_follow(&eo, &l, &err);
    }
    if (rc) fprintf(stderr, "lunar serve: rank %d: %s\n", ri->rank, err.msg);
    return rc ? 1 : 0;
}

static void close_links(void *arg) { /* the launcher's copies: only the ranks hold the links */
    const serve_job *j = arg;
    for (int k = 0; k < j->world - 1; k++) close(j->sv[k][0]), close(j->sv[k][1]);
}

/* --backend cuda with --tensor-parallel-size > 1 or expert parallelism: rank processes, one per
 * GPU. The parent must not touch the device before the fork, so the backend is taken as named. */
static int cuda_tp(const serve_opts *o) {
    return !o->fake && (o->tp > 1 || o->ep) && strcmp(o->backend, "cuda") == 0;
}

static int serve(serve_job *j, lunar_err *err) {
    if (!cuda_tp(j->o)) return serve_body(j, NULL, err);
    j->world = (int)j->o->tp;
    if (j->world > 1024) return lunar_fail(err, "--tensor-parallel-size %d: too many ranks for one node", j->world);
    j->sv = lunar_xcalloc((size_t)j->world, sizeof *j->sv);
    for (int k = 0; k < j->world - 1; k++)
        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, j->sv[k])) {
            for (int q = 0; q < k; q++) close(j->sv[q][0]), close(j->sv[q][1]);
            free(j->sv);
            return lunar_fail(err, "cannot make the rank links");
        }
    lunar_dist_opts d = {1, 0, j->world, "127.0.0.1", (int)j->o->master_port};
    int rc = lunar_launch_node_ex(&d, lunar_nccl_get_unique_id, serve_rank, j, close_links, 600000, err);
    free(j->sv);
    return rc;
}

int lunar_cmd_serve(int argc, char **argv) {
    serve_opts o;
    lunar_err err;
    if (parse(argc, argv, &o, &err)) {
        fprintf(stderr, "lunar serve: %s\n%s", err.msg, USAGE);
        return 2;
    }
    char path[4200];
    lunar_config cfg;
    if (o.load.load_format && strcmp(o.load.load_format, "dummy") == 0)
        lunar_config_path(o.model_dir, path, sizeof path);
    else
        snprintf(path, sizeof path, "%s/config.json", o.model_dir);
    if (lunar_config_load(&cfg, path, &err) ||
        (o.load.tp_slice > 1 && lunar_config_tp_slice(&cfg, o.load.tp_slice, &err))) {
        fprintf(stderr, "lunar serve: %s\n", err.msg);
        return 1;
    }
    lunar_tokenizer *tok = NULL;
    /* --tokenizer DIR: tiktoken.model + tokenizer_config.json from elsewhere (test models ship none) */
    if (lunar_tokenizer_load(&tok, o.tokenizer ? o.tokenizer : o.model_dir, &err)) {
        fprintf(stderr, "lunar serve: %s\n", err.msg);
        return 1;
    }
    char *names_copy = NULL;
    const char **names = NULL;
    int n_names = split_names(o.names ? o.names : o.model_dir, &names_copy, &names);

    lunar_server_options so;
    lunar_server_options_default(&so);
    so.host = o.host;
    so.port = (int)o.port;
    so.api_key = o.api_key;
    so.max_body_bytes = (size_t)o.max_body;
    so.idle_timeout_s = (unsigned)o.timeout;
    so.max_pending = (int)o.max_pending;
    so.quiet = o.quiet;
    so.model_root = o.model_dir;
    so.tok = tok;
    so.policy.arch = cfg.arch;
    so.policy.model_names = names;
    so.policy.n_model_names = n_names;
    so.policy.max_model_len = (int)o.max_model_len;
    so.policy.sampling_guard = strcmp(o.guard, "on") == 0 || (strcmp(o.guard, "auto") == 0 && cfg.arch == LUNAR_ARCH_KIMI_K3);
    so.policy.max_n = so.policy.sampling_guard ? 1 : 16;
    so.policy.vocab_size = lunar_tokenizer_vocab_size(tok);
    so.model_vocab_size = cfg.vocab_size;

    serve_job job = {&o, &cfg, &so, 1, NULL};
    int rc = serve(&job, &err) ? 1 : 0;
    if (rc) fprintf(stderr, "lunar serve: %s\n", err.msg);
    free(names);
    free(names_copy);
    lunar_tokenizer_free(tok);
    return rc;
}
