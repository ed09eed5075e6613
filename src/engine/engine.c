/* The engine: requests in, tokens out, on a scheduler thread of its own.
 *
 * Each step (vLLM-style continuous batching with chunked prefill):
 *  1. running requests first, in admission order: one token for a decode, a prefill chunk for a
 *     request still reading its prompt, within max_num_batched_tokens; a request that needs a
 *     cache block when none is left preempts the most recently admitted one (whose caches are
 *     dropped; it is recomputed later, never lost);
 *  2. waiting requests are admitted while the budget, max_num_seqs and the cache allow, each
 *     resuming from its longest cached prefix (latent blocks + a KDA state checkpoint);
 *  3. one forward over the batch; 4. every request whose computed tokens caught up with its
 *     tokens samples one token, reports it, and may finish.
 * Prefill chunks that cross a checkpoint boundary are cut there, so the KDA state at every
 * boundary a prompt passes is observed and can be saved for the prefix cache. */
#include "lunar.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "backend/backend.h"
#include "engine/engine_tp.h"
#include "engine/grammar.h"
#include "engine/prefix_cache.h"
#include "engine/request.h"
#include "engine/sampler.h"
#include "model/forward.h"
#include "model/tp_group.h"
#include "model/forward_cuda.h"
#include "text/tokenizer.h"

struct lunar_engine {
    lunar_engine_options opt;
    lunar_model *model;
    lunar_tokenizer *tok; /* for stop strings; NULL when the model has none */
    lunar_kv_pool kv;
    lunar_state_pool st;
    lunar_tp_group *tpg;  /* tensor parallelism: rank threads own the caches instead of kv, st */
    /* CUDA backend (gpu != NULL): weights, paged latent cache and state pool on the device; kv and
     * st stay empty and every cache operation goes to gc (see state_clear / state_copy) */
    lunar_cuda_model *gpu;
    lunar_cuda_caches gc;
    /* CUDA tensor parallelism (opt.tp_link): this rank's comm, shards and their upload (gpu is
     * rk.gpu); every device operation is first sent to the follower ranks (engine_tp.h) */
    lunar_cuda_rank rk;
    int link_failed;      /* a follower is gone: every later step fails with link_err */
    lunar_err link_err;
    lunar_block_mgr *blocks;
    int ckpt_tokens;      /* checkpoint interval in tokens */
    int *free_slots, n_free_slots;
    int32_t end_ids[4];   /* the model's end-of-turn tokens */
    int n_end_ids;

    req_list waiting, running;

    pthread_mutex_t mu;   /* guards incoming, cancels, metrics, stop */
    pthread_cond_t cv;
    pthread_t thread;
    int stop;
    req_list incoming;
    uint64_t *cancels;
    int n_cancels, cap_cancels;
    uint64_t next_id;
    lunar_engine_metrics metrics;

    float *logits;        /* [max_num_seqs, V] */
    void *sample_scratch; /* [2 V] floats */
    uint32_t *mask;       /* grammar mask words */
};

void lunar_engine_options_default(lunar_engine_options *o) {
    memset(o, 0, sizeof *o);
    o->backend = "auto";
    o->max_num_seqs = 64;
    o->max_num_batched_tokens = 2048;
    o->max_model_len = 8192;
    o->cache_memory_bytes = 0; /* auto */
    o->gpu_memory_utilization = 0.9;
    o->kv_cache_dtype = "auto";
    o->enable_prefix_caching = 1;
    o->prefix_checkpoint_blocks = 1;
}

void lunar_sampling_params_default(lunar_sampling_params *p) {
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->repetition_penalty = 1.0f;
    p->max_tokens = 16;
}

/* ---------------------------------------------------------------- memory plan */

/* Splits the cache budget: one KDA state slot per running request, checkpoint slots for the
 * prefix cache (a quarter of what remains, at most 4 per running request), the rest in blocks. */
static int plan_memory(lunar_engine *e, int64_t budget, int64_t block_bytes, int64_t slot_bytes, int *n_blocks,
                       int *n_ckpt, lunar_err *err) {
    const lunar_engine_options *o = &e->opt;
    const int blocks_per_seq = (o->max_model_len + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
    int64_t left = budget - (int64_t)o->max_num_seqs * slot_bytes;
    if (left <= 0)
        return lunar_fail(err, "cache memory of %lld bytes cannot hold the KDA states of %d sequences "
                               "(%lld bytes each): lower --max-num-seqs or raise the budget",
                          (long long)budget, o->max_num_seqs, (long long)slot_bytes);
    *n_ckpt = 0;
    if (o->enable_prefix_caching && slot_bytes > 0) {
        int64_t k = left / 4 / slot_bytes;
        *n_ckpt = (int)(k < 4LL * o->max_num_seqs ? k : 4LL * o->max_num_seqs);
        left -= (int64_t)*n_ckpt * slot_bytes;
    }
    int64_t nb = block_bytes > 0 ? left / block_bytes : (int64_t)blocks_per_seq * o->max_num_seqs;
    if (nb > (1 << 24)) nb = 1 << 24;
    if (nb < blocks_per_seq)
        return lunar_fail(err, "cache memory leaves %lld blocks of %d tokens, fewer than one sequence of "
                               "max_model_len %d needs (%d): lower --max-model-len or raise the budget",
                          (long long)nb, LUNAR_BLOCK_SIZE, o->max_model_len, blocks_per_seq);
    *n_blocks = (int)nb;
    return 0;
}

/* ---------------------------------------------------------------- create / destroy */

static void *engine_main(void *arg);

/* The device weights: a rank's own (comm and shards with them) or the single GPU's. */
static void free_device_model(lunar_engine *e) {
    if (e->rk.gpu) lunar_cuda_rank_close(&e->rk);
    else lunar_cuda_model_free(e->gpu);
    e->gpu = NULL;
}

/* Everything the engine allocated but its thread and its TP group, newest first, and e itself: the
 * end of lunar_engine_create's failure path and of lunar_engine_destroy. */
static void release_memory(lunar_engine *e) {
    lunar_cuda_caches_free(&e->gc); /* the caches before the weights: the arena is a stack */
    free_device_model(e);
    lunar_kv_pool_free(&e->kv);
    lunar_state_pool_free(&e->st);
    lunar_block_mgr_free(e->blocks);
    free(e->free_slots), free(e->logits), free(e->sample_scratch), free(e->mask);
    lunar_tokenizer_free(e->tok);
    lunar_model_free(e->model);
    free(e);
}

static int file_exists(const char *dir, const char *name) {
    char path[1200];
    struct stat sb;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &sb) == 0;
}

int lunar_engine_create(lunar_engine **out, const lunar_engine_options *o, lunar_err *err) {
    *out = NULL;
    if (!o->model_dir) return lunar_fail(err, "engine: no model directory");
    if (o->max_num_seqs <= 0 || o->max_num_batched_tokens <= 0 || o->max_model_len <= 0)
        return lunar_fail(err, "engine: max_num_seqs, max_num_batched_tokens and max_model_len must be positive");
    if (o->prefix_checkpoint_blocks <= 0) return lunar_fail(err, "engine: prefix_checkpoint_blocks must be positive");
    lunar_backend_kind be;
    if (lunar_backend_select(o->backend, &be, err)) return -1;
    lunar_kv_dtype kvd = LUNAR_KV_F32;
    const char *kd = o->kv_cache_dtype ? o->kv_cache_dtype : "auto";
    if (strcmp(kd, "bf16") == 0) kvd = LUNAR_KV_BF16;
    else if (strcmp(kd, "fp8") == 0 || strcmp(kd, "fp8_e4m3") == 0) kvd = LUNAR_KV_FP8;
    else if (strcmp(kd, "auto") != 0 && strcmp(kd, "fp32") != 0)
        return lunar_fail(err, "--kv-cache-dtype: '%s' is not one of auto, fp32, bf16, fp8", kd);

    lunar_engine *e = lunar_xcalloc(1, sizeof *e);
    e->opt = *o;
    e->ckpt_tokens = o->prefix_checkpoint_blocks * LUNAR_BLOCK_SIZE;
    /* dummy weights on the CUDA backend are generated on the device at upload (model/dummy.h), also
     * as a rank's shards (lazy windows) under CUDA TP */
    lunar_load_options lo = {.load_format = o->load_format, .num_layers = o->num_layers, .tp_slice = o->tp_slice,
                             .seed = o->dummy_seed, .device_lazy = be == LUNAR_BACKEND_CUDA,
                             .ptpc_fp8 = o->ptpc_fp8};
    if (lunar_model_load_ex(&e->model, o->model_dir, &lo, err)) goto fail;
    if (file_exists(o->model_dir, "tiktoken.model") && lunar_tokenizer_load(&e->tok, o->model_dir, err)) goto fail;
    const lunar_config *c = &e->model->cfg;
    if (c->eos_token_id >= 0) e->end_ids[e->n_end_ids++] = c->eos_token_id;

    int n_blocks = 0, n_ckpt = 0;
    const lunar_tp_opts tpo = {o->tensor_parallel_size > 1 ? o->tensor_parallel_size : 1,
                               o->decode_context_parallel_size > 1 ? o->decode_context_parallel_size : 1,
                               o->enable_expert_parallel};
    const int use_tp = tpo.tp > 1 || tpo.dcp > 1 || tpo.ep;
    if (use_tp && be == LUNAR_BACKEND_CUDA && !o->tp_link) {
        if (tpo.dcp > 1 && tpo.tp == 1)
            lunar_fail(err, "--decode-context-parallel-size %d needs --tensor-parallel-size >= %d (DCP reuses the TP "
                            "ranks, one process per GPU)", tpo.dcp, tpo.dcp);
        else
            lunar_fail(err, "tensor / expert / decode context parallelism on CUDA runs as one process per GPU: "
                            "`lunar serve --backend cuda --tensor-parallel-size N` starts them");
        goto fail;
    }
    if (be == LUNAR_BACKEND_CUDA) {
        /* one arena of gpu_memory_utilization x the device: the weights, one step's temporaries,
         * and the caches in all that is left */
        const int fp8 = kvd == LUNAR_KV_FP8; /* else bf16 (auto / fp32 / bf16: the device's latent is bf16) */
        const int cflags = lunar_engine_cuda_cache_flags(o);
        const lunar_tp_link *l = o->tp_link;
        if (l) {
            if (lunar_cuda_rank_open(&e->rk, e->model, o, l, err)) goto fail;
            e->gpu = e->rk.gpu;
        } else if (lunar_cuda_backend_init(o->gpu_memory_utilization > 0 ? o->gpu_memory_utilization : 0.9, err) ||
                   lunar_cuda_model_upload(&e->gpu, e->model, err)) {
            goto fail;
        }
        const lunar_model *dm = l ? e->rk.rank_m : e->model; /* what this device holds */
        /* under TP the plan must fit every rank (their shards, hence their rooms, may differ): the
         * fewest blocks and checkpoint slots any rank can hold */
        const int world = l ? l->world : 1;
        lunar_rank_room *rooms = lunar_xcalloc((size_t)world, sizeof *rooms);
        rooms[0] = lunar_cuda_rank_room(dm, o);
        int prc = l ? lunar_tp_link_rooms(l, rooms + 1, 600000, err) : 0;
        for (int r = 0; r < world && prc == 0; r++) {
            int nb, nc;
            prc = plan_memory(e, rooms[r].budget, rooms[r].block_bytes, rooms[r].slot_bytes, &nb, &nc, err);
            if (prc == 0 && (r == 0 || nb < n_blocks)) n_blocks = nb;
            if (prc == 0 && (r == 0 || nc < n_ckpt)) n_ckpt = nc;
        }
        const int64_t step = (int64_t)lunar_cuda_step_bytes(dm, o->max_num_batched_tokens, o->max_num_seqs,
                                                            o->max_model_len);
        free(rooms);
        if (prc) goto fail;
        if (l) {
            lunar_wire_msg m = {0};
            lunar_wire_reset(&m, LUNAR_WIRE_INIT);
            lunar_wire_push(&m, n_blocks), lunar_wire_push(&m, o->max_num_seqs + n_ckpt);
            prc = lunar_tp_link_send(l, &m, err);
            lunar_wire_free(&m);
            if (prc) goto fail;
        }
        if (lunar_cuda_caches_init(&e->gc, dm, n_blocks, o->max_num_seqs + n_ckpt, cflags, err)) goto fail;
        /* under DCP a block of 128 positions costs a rank 128 / D latent rows: D times the blocks */
        char dcp_note[96] = "";
        if (tpo.dcp > 1)
            snprintf(dcp_note, sizeof dcp_note, ", DCP %d: %d latent rows per block and rank", tpo.dcp,
                     LUNAR_BLOCK_SIZE / tpo.dcp);
        fprintf(stderr, "lunar: CUDA %s: weights %.2f GiB, caches %d blocks = %lld tokens (%s latent%s) + %d state slots (%s), step reserve %.2f GiB%s\n",
                lunar_cuda_device_line(), lunar_cuda_model_bytes(dm) / 1073741824.0, n_blocks,
                (long long)n_blocks * LUNAR_BLOCK_SIZE, fp8 ? "fp8" : "bf16", dcp_note,
                o->max_num_seqs + n_ckpt, o->kda_state_fp16 ? "fp16" : "fp32", step / 1073741824.0, l ? " (rank 0; each rank alike)" : "");
        if (l && tpo.dcp > 1) { /* which GPUs exchange attention partials (the rest is TP-wide) */
            char groups[192];
            lunar_dcp_layout(groups, sizeof groups, l->world, tpo.dcp);
            fprintf(stderr, "lunar: DCP groups: %s\n", groups);
        }
    } else {
        const int64_t row = c->kv_lora_rank + c->qk_rope_head_dim;
        const int64_t block_bytes = (int64_t)c->n_mla_layers * LUNAR_BLOCK_SIZE *
                                    (row * (int64_t)sizeof(float) + (c->index_topk ? c->index_head_dim + 4 : 0));
        const int64_t HD = (int64_t)c->kda_num_heads * c->kda_head_dim;
        const int64_t slot_bytes = (int64_t)c->n_kda_layers *
                                   (3 * HD * (c->kda_conv_size - 1) + HD * c->kda_head_dim) * (int64_t)sizeof(float);
        const int64_t budget = o->cache_memory_bytes > 0 ? o->cache_memory_bytes : (int64_t)1 << 30;
        if (plan_memory(e, budget, block_bytes, slot_bytes, &n_blocks, &n_ckpt, err)) goto fail;
        if (use_tp) {
            if (lunar_tp_group_create(&e->tpg, e->model, &tpo, err) ||
                lunar_tp_group_pools(e->tpg, n_blocks, kvd, o->max_num_seqs + n_ckpt, o->kda_state_fp16, err))
                goto fail;
        } else {
            if (lunar_kv_pool_init(&e->kv, c, n_blocks, kvd, err)) goto fail;
            if (lunar_state_pool_init(&e->st, c, o->max_num_seqs + n_ckpt, o->kda_state_fp16, err)) goto fail;
        }
    }
    e->blocks = lunar_block_mgr_new(n_blocks, o->max_num_seqs, n_ckpt);
    e->free_slots = lunar_xmalloc((size_t)o->max_num_seqs * sizeof *e->free_slots);
    for (int i = 0; i < o->max_num_seqs; i++) e->free_slots[i] = o->max_num_seqs - 1 - i;
    e->n_free_slots = o->max_num_seqs;
    const size_t V = (size_t)c->vocab_size;
    e->logits = malloc((size_t)o->max_num_seqs * V * sizeof(float));
    e->sample_scratch = malloc(2 * V * sizeof(float));
    e->mask = lunar_xcalloc((V + 31) / 32, sizeof(uint32_t));
    if (!e->logits || !e->sample_scratch) {
        lunar_fail(err, "engine: cannot allocate logits for %d sequences", o->max_num_seqs);
        goto fail;
    }
    e->metrics.kv_blocks_total = n_blocks;
    e->next_id = 1;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        lunar_fail(err, "engine: cannot start the scheduler thread");
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->cv);
        goto fail;
    }
    *out = e;
    return 0;
fail:
    lunar_tp_group_free(e->tpg);
    release_memory(e);
    return -1;
}

const struct lunar_model *lunar_engine_model(const lunar_engine *e) { return e->model; }

/* ---------------------------------------------------------------- submit / cancel / metrics */

int lunar_engine_submit(lunar_engine *e, const lunar_request *r, uint64_t *id, lunar_err *err) {
    const lunar_config *c = &e->model->cfg;
    if (lunar_request_validate(r, c->vocab_size, e->opt.max_model_len, err)) return -1;
    if (r->sampling.n_stop > 0 && !e->tok)
        return lunar_fail(err, "stop: stop strings need a tokenizer (tiktoken.model) in the model directory");
    request *q = lunar_request_new(r, e->tok);
    pthread_mutex_lock(&e->mu);
    q->id = e->next_id++;
    lunar_req_list_push(&e->incoming, q);
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (id) *id = q->id;
    return 0;
}

void lunar_engine_cancel(lunar_engine *e, uint64_t id) {
    pthread_mutex_lock(&e->mu);
    if (e->n_cancels == e->cap_cancels) {
        e->cap_cancels = e->cap_cancels ? 2 * e->cap_cancels : 16;
        e->cancels = realloc(e->cancels, (size_t)e->cap_cancels * sizeof *e->cancels);
        LUNAR_ASSERT(e->cancels);
    }
    e->cancels[e->n_cancels++] = id;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

void lunar_engine_metrics_get(lunar_engine *e, lunar_engine_metrics *m) {
    pthread_mutex_lock(&e->mu);
    *m = e->metrics;
    pthread_mutex_unlock(&e->mu);
}

/* ---------------------------------------------------------------- request lifecycle */

static void emit(request *q, lunar_event *ev) {
    ev->request_id = q->id;
    ev->prompt_tokens = q->n_prompt;
    ev->completion_tokens = q->n_tokens - q->n_prompt;
    ev->cached_tokens = q->cached_tokens;
    if (q->on_event) q->on_event(q->user, ev);
}

/* Gives back what a request holds in the caches (publishing its full blocks first). */
static void release_caches(lunar_engine *e, request *q) {
    for (int i = 0; i < q->n_blocks; i++) lunar_block_release(e->blocks, q->blocks[i]);
    q->n_blocks = 0;
    q->n_hashes = 0;
    if (q->slot >= 0) e->free_slots[e->n_free_slots++] = q->slot;
    q->slot = -1;
}

static void update_gauges(lunar_engine *e) {
    e->metrics.running = e->running.n;
    e->metrics.waiting = e->waiting.n + e->incoming.n;
    e->metrics.kv_blocks_used = lunar_block_used_count(e->blocks);
}

/* Ends a request: its caches go back, the gauges are updated, then its last event is sent (so a
 * client that saw every request finish also sees the engine idle), then it is freed. */
static void retire(lunar_engine *e, request *q, lunar_event *ev) {
    release_caches(e, q);
    lunar_req_list_remove(&e->running, q);
    lunar_req_list_remove(&e->waiting, q);
    pthread_mutex_lock(&e->mu);
    e->metrics.requests_finished++;
    update_gauges(e);
    pthread_mutex_unlock(&e->mu);
    emit(q, ev);
    lunar_request_free(q);
}

static void finish(lunar_engine *e, request *q, lunar_finish_reason why, const char *msg) {
    lunar_event ev = {0};
    ev.finish = why;
    ev.message = msg;
    retire(e, q, &ev);
}

/* Preempts a running request: its caches go, its tokens stay; it is recomputed when readmitted. */
static void preempt(lunar_engine *e, request *q) {
    release_caches(e, q);
    q->n_computed = 0;
    q->cached_tokens = 0;
    lunar_req_list_remove(&e->running, q);
    lunar_req_list_push_front(&e->waiting, q);
    pthread_mutex_lock(&e->mu);
    e->metrics.preemptions++;
    pthread_mutex_unlock(&e->mu);
}

/* Makes sure q has blocks for positions [0, upto); preempts younger running requests when the
 * pool is full. Returns 0, or -1 when q itself would have to go. */
static int ensure_blocks(lunar_engine *e, request *q, int upto) {
    const int need = (upto + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
    while (q->n_blocks < need) {
        int b = lunar_block_alloc(e->blocks);
        if (b >= 0) {
            lunar_request_add_block(q, b);
            continue;
        }
        request *victim = e->running.n ? e->running.v[e->running.n - 1] : NULL;
        if (!victim || victim == q) return -1;
        preempt(e, victim);
    }
    return 0;
}

/* CUDA TP: an operation on rank 0's device goes to the followers first, in the order rank 0 makes
 * them. A follower that is gone fails this and every later step (their requests end with an
 * error: HTTP 500), while the launcher, which saw it exit, stops the server. */
static void link_send(lunar_engine *e, uint32_t kind, int a, int b, int nw) {
    if (!e->opt.tp_link || e->link_failed) return;
    lunar_wire_msg m = {0};
    lunar_wire_reset(&m, kind);
    lunar_wire_push(&m, a);
    if (nw > 1) lunar_wire_push(&m, b);
    if (lunar_tp_link_send(e->opt.tp_link, &m, &e->link_err)) e->link_failed = 1;
    lunar_wire_free(&m);
}

static void state_copy(lunar_engine *e, int to, int from) {
    link_send(e, LUNAR_WIRE_COPY, to, from, 2);
    if (e->tpg) lunar_tp_group_state_copy(e->tpg, to, from);
    else if (e->gpu) lunar_cuda_state_copy(&e->gc, to, from);
    else lunar_state_copy(&e->st, to, from);
}

static void state_clear(lunar_engine *e, int slot) {
    link_send(e, LUNAR_WIRE_CLEAR, slot, 0, 1);
    if (e->tpg) lunar_tp_group_state_clear(e->tpg, slot);
    else if (e->gpu) lunar_cuda_state_clear(&e->gc, slot);
    else lunar_state_clear(&e->st, slot);
}

/* Largest prefix of q's tokens whose latent blocks and KDA state checkpoint are cached; takes
 * the blocks, copies the checkpoint into q's slot. Leaves at least one token to compute. */
static void prefix_lookup(lunar_engine *e, request *q) {
    if (!e->opt.enable_prefix_caching) return;
    const int usable = (q->n_tokens - 1) / LUNAR_BLOCK_SIZE; /* blocks that may be skipped */
    const int need_ckpt = e->model->cfg.n_kda_layers > 0;
    lunar_hash128 h[usable > 0 ? usable : 1];
    int n = 0;
    for (; n < usable; n++) {
        h[n] = lunar_block_hash(n ? &h[n - 1] : NULL, q->tokens + n * LUNAR_BLOCK_SIZE, LUNAR_BLOCK_SIZE);
        /* only peek here: references are taken below for the chosen prefix */
        int b = lunar_block_cache_lookup(e->blocks, h[n]);
        if (b < 0) break;
        lunar_block_release(e->blocks, b);
    }
    /* the longest checkpointed boundary within the cached blocks */
    int use = n, ckpt = -1;
    if (need_ckpt) {
        for (use = n; use > 0; use--)
            if ((use * LUNAR_BLOCK_SIZE) % e->ckpt_tokens == 0 && (ckpt = lunar_ckpt_lookup(e->blocks, h[use - 1])) >= 0)
                break;
    }
    pthread_mutex_lock(&e->mu);
    e->metrics.prefix_cache_queries += q->n_tokens;
    e->metrics.prefix_cache_hits += (int64_t)use * LUNAR_BLOCK_SIZE;
    pthread_mutex_unlock(&e->mu);
    if (use == 0) return;
    for (int i = 0; i < use; i++) {
        lunar_request_add_block(q, lunar_block_cache_lookup(e->blocks, h[i]));
        lunar_request_add_hash(q, h[i]);
    }
    if (ckpt >= 0) state_copy(e, q->slot, ckpt);
    q->n_computed = use * LUNAR_BLOCK_SIZE;
    q->cached_tokens = q->n_computed;
}

/* Tokens to run for q this step: all it lacks, within budget, cut at the next checkpoint
 * boundary when the chunk would cross one without reaching the end (so that boundary's state
 * is seen and saved). */
static int chunk_for(const lunar_engine *e, const request *q, int budget) {
    int lack = q->n_tokens - q->n_computed, n = lack < budget ? lack : budget;
    if (!e->opt.enable_prefix_caching || n <= 1) return n;
    int end = q->n_computed + n, boundary = end / e->ckpt_tokens * e->ckpt_tokens;
    if (boundary > q->n_computed && boundary < end) n = boundary - q->n_computed;
    return n;
}

/* After a step computed q up to n_computed: publishes the blocks that became full and, at a
 * checkpoint boundary, the KDA state. */
static void publish(lunar_engine *e, request *q) {
    if (!e->opt.enable_prefix_caching) return;
    const int full = q->n_computed / LUNAR_BLOCK_SIZE;
    while (q->n_hashes < full) {
        int i = q->n_hashes;
        lunar_hash128 h = lunar_block_hash(i ? &q->hashes[i - 1] : NULL, q->tokens + i * LUNAR_BLOCK_SIZE,
                                           LUNAR_BLOCK_SIZE);
        lunar_request_add_hash(q, h);
        lunar_block_cache_insert(e->blocks, h, q->blocks[i]);
    }
    if (full > 0 && q->n_computed % e->ckpt_tokens == 0 && e->model->cfg.n_kda_layers > 0) {
        int is_new;
        int slot = lunar_ckpt_slot_for(e->blocks, q->hashes[full - 1], &is_new);
        if (slot >= 0 && is_new) state_copy(e, slot, q->slot);
    }
}

/* ---------------------------------------------------------------- the step */

typedef struct planned {
    request *q;
    int n;
} planned;

static void step(lunar_engine *e) {
    const int cap = e->opt.max_num_seqs;
    planned *plan = lunar_xmalloc((size_t)cap * sizeof *plan);
    int np = 0, budget = e->opt.max_num_batched_tokens;

    /* 1. running requests, oldest first */
    for (int i = 0; i < e->running.n && budget > 0;) {
        request *q = e->running.v[i];
        int n = chunk_for(e, q, budget);
        if (ensure_blocks(e, q, q->n_computed + n)) {
            preempt(e, q); /* the youngest itself: back to waiting */
            continue;
        }
        plan[np++] = (planned){q, n};
        budget -= n;
        i++;
    }
    /* a preemption may have removed a request planned earlier in this loop: keep only live ones */
    int kept = 0;
    for (int i = 0; i < np; i++)
        if (plan[i].q->slot >= 0) plan[kept++] = plan[i];
    np = kept;

    /* 2. admit waiting requests */
    while (budget > 0 && e->waiting.n && e->running.n < cap && e->n_free_slots > 0) {
        request *q = e->waiting.v[0];
        q->slot = e->free_slots[--e->n_free_slots];
        state_clear(e, q->slot);
        prefix_lookup(e, q);
        int n = chunk_for(e, q, budget);
        const int need = (q->n_computed + n + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
        if (need - q->n_blocks > lunar_block_free_count(e->blocks)) { /* wait for blocks to free up */
            release_caches(e, q);
            q->n_computed = q->cached_tokens = 0;
            break;
        }
        lunar_req_list_remove(&e->waiting, q);
        lunar_req_list_push(&e->running, q);
        LUNAR_ASSERT(ensure_blocks(e, q, q->n_computed + n) == 0);
        plan[np++] = (planned){q, n};
        budget -= n;
    }

    if (np == 0) {
        /* nothing runnable: a waiting request that cannot fit even into an empty cache */
        if (!e->running.n && e->waiting.n) finish(e, e->waiting.v[0], LUNAR_FINISH_ERROR, "request does not fit in the KV cache");
        free(plan);
        return;
    }

    /* 3. one forward */
    lunar_batch_seq *seqs = lunar_xmalloc((size_t)np * sizeof *seqs);
    for (int i = 0; i < np; i++) {
        request *q = plan[i].q;
        int last = q->n_computed + plan[i].n == q->n_tokens;
        seqs[i] = (lunar_batch_seq){q->tokens + q->n_computed, plan[i].n, q->n_computed, q->slot, q->blocks,
                                    last ? LUNAR_LOGITS_LAST : LUNAR_LOGITS_NONE};
    }
    /* on CUDA, rows whose token needs nothing but temperature / top-k / top-p are sampled on the
     * device and their logits stay there (LUNAR_CUDA_HOST_SAMPLING=1: all on the host, to compare) */
    lunar_device_sampling *ds = NULL;
    int32_t *dev_ids = NULL;
    static int host_only = -1;
    if (host_only < 0) host_only = getenv("LUNAR_CUDA_HOST_SAMPLING") != NULL;
    if (e->gpu && !host_only) { /* under TP too: rank 0 holds the gathered logits on its device */
        ds = lunar_xcalloc((size_t)np + 1, sizeof *ds);
        dev_ids = lunar_xcalloc((size_t)np + 1, sizeof *dev_ids);
        for (int i = 0, r = 0; i < np; i++) {
            if (seqs[i].logits != LUNAR_LOGITS_LAST) continue;
            lunar_device_sampling *d = &ds[r++];
            d->on = lunar_request_device_sampling(plan[i].q, &d->temperature, &d->top_k, &d->top_p, &d->u);
        }
    }
    lunar_err err;
    if (e->opt.tp_link && !e->link_failed) { /* the followers run the same step on their shards */
        lunar_wire_msg m = {0};
        lunar_wire_step_encode(&m, seqs, np);
        if (lunar_tp_link_send(e->opt.tp_link, &m, &e->link_err)) e->link_failed = 1;
        lunar_wire_free(&m);
    }
    int rc = e->link_failed ? (err = e->link_err, -1)
             : e->tpg ? lunar_tp_group_forward_batch(e->tpg, seqs, np, e->logits, &err)
             : e->gpu ? lunar_forward_batch_cuda_sampled(e->gpu, &e->gc, seqs, np, e->logits, ds, dev_ids, &err)
                      : lunar_forward_batch(e->model, &e->kv, &e->st, seqs, np, e->logits, &err);
    free(seqs);
    pthread_mutex_lock(&e->mu);
    e->metrics.steps++;
    pthread_mutex_unlock(&e->mu);

    /* 4. sample, report, finish */
    const int V = e->model->cfg.vocab_size;
    int row = 0;
    int64_t prompt_done = 0, generated = 0;
    for (int i = 0; i < np; i++) {
        request *q = plan[i].q;
        if (rc) {
            finish(e, q, LUNAR_FINISH_ERROR, err.msg);
            continue;
        }
        int was_prefill = q->n_computed < q->n_prompt;
        q->n_computed += plan[i].n;
        if (was_prefill) prompt_done += plan[i].n < q->n_prompt ? plan[i].n : q->n_prompt;
        publish(e, q);
        if (q->n_computed < q->n_tokens) continue; /* mid-prompt chunk */
        float *lg = e->logits + (size_t)row * V;
        lunar_event ev = {0};
        lunar_finish_reason why =
            ds && ds[row].on ? lunar_request_accept(q, dev_ids[row], e->end_ids, e->n_end_ids, &ev)
                             : lunar_request_sample(q, lg, V, e->end_ids, e->n_end_ids, e->sample_scratch, e->mask, &ev);
        row++;
        generated++;
        if (why != LUNAR_FINISH_NONE) {
            ev.finish = why; /* the last token and the finish travel in one event */
            retire(e, q, &ev);
        } else {
            emit(q, &ev);
        }
    }
    free(ds), free(dev_ids);
    pthread_mutex_lock(&e->mu);
    e->metrics.prompt_tokens += prompt_done;
    e->metrics.generation_tokens += generated;
    pthread_mutex_unlock(&e->mu);
    free(plan);
}

/* ---------------------------------------------------------------- thread */

static void *engine_main(void *arg) {
    lunar_engine *e = arg;
    uint64_t *cancels = NULL;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        update_gauges(e);
        while (!e->stop && !e->incoming.n && !e->n_cancels && !e->waiting.n && !e->running.n)
            pthread_cond_wait(&e->cv, &e->mu);
        if (e->stop) {
            pthread_mutex_unlock(&e->mu);
            break;
        }
        while (e->incoming.n) lunar_req_list_push(&e->waiting, lunar_req_list_pop_front(&e->incoming));
        int nc = e->n_cancels;
        cancels = realloc(cancels, ((size_t)nc + 1) * sizeof *cancels);
        if (nc) memcpy(cancels, e->cancels, (size_t)nc * sizeof *cancels);
        e->n_cancels = 0;
        pthread_mutex_unlock(&e->mu);

        for (int i = 0; i < nc; i++) {
            request *q = lunar_req_list_find(&e->running, cancels[i]);
            if (!q) q = lunar_req_list_find(&e->waiting, cancels[i]);
            if (q) finish(e, q, LUNAR_FINISH_ABORT, "cancelled");
        }
        step(e);
    }
    free(cancels);
    return NULL;
}

void lunar_engine_destroy(lunar_engine *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    while (e->incoming.n) lunar_req_list_push(&e->waiting, lunar_req_list_pop_front(&e->incoming));
    while (e->running.n) finish(e, e->running.v[0], LUNAR_FINISH_ABORT, "engine shut down");
    while (e->waiting.n) finish(e, e->waiting.v[0], LUNAR_FINISH_ABORT, "engine shut down");
    free(e->running.v), free(e->waiting.v), free(e->incoming.v), free(e->cancels);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    lunar_tp_group_free(e->tpg);
    if (e->opt.tp_link && !e->link_failed) { /* the followers stop cleanly (a lost one has gone already) */
        lunar_wire_msg m = {0};
        lunar_wire_reset(&m, LUNAR_WIRE_STOP);
        lunar_err err;
        if (lunar_tp_link_send(e->opt.tp_link, &m, &err)) fprintf(stderr, "lunar: %s\n", err.msg);
        lunar_wire_free(&m);
    }
    release_memory(e);
}
