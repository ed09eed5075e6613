/* The engine under load: hundreds of requests of random lengths, continuous batching with chunked
 * prefill, preemption under a small cache, cancellation, prefix-cache hits. Every greedy output is
 * compared with the same prompt run alone through the plain single-sequence forward.
 *
 * Exactness: the batched run cuts prompts into different chunks than the lone run, and the chunked
 * KDA sums in a different order, so logits agree to ~1e-6, not bitwise. Greedy outputs are
 * therefore required to be identical except where the lone run's top-2 logits are within 1e-4 of
 * each other at the first difference (a numerical tie), and such ties must be rare. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "lunar.h"
#include "backend/backend.h"
#include "model/cache.h"
#include "model/forward.h"
#include "ops.h"
#include "test.h"

#define MODEL "tests/golden/tiny-a"
#define TIE 1e-4
/* On CUDA the lone runs are the CPU modelling the device's roundings (see run_alone); what still
 * separates them is fp32 summation order and the rare bf16 operand it rounds the other way, which
 * can flip a routing decision of tiny-a's MoE and then a greedy token with a large gap. Measured on
 * the H200 (first run, 240 requests): 10 diverged, 5 of them not at a tie (gap 0.3-0.6). A
 * scheduling error (wrong slot, page, position or state copy) breaks most requests instead: up to
 * 8 % of the outputs may diverge on CUDA. */
#define CUDA_TIE 2e-2
#define CUDA_DIVERGED_MAX 0.08

typedef struct collected {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_req, n_done;
    struct out {
        uint64_t id;
        int32_t toks[128];
        int n;
        lunar_finish_reason finish;
        int cached, prompt_tokens;
        int events_after_finish;
        float logprob[128];
        int n_top;
    } *o;
} collected;

typedef struct ctx {
    collected *c;
    int i;
} ctx;

static void on_event(void *user, const lunar_event *ev) {
    ctx *x = user;
    collected *c = x->c;
    pthread_mutex_lock(&c->mu);
    struct out *o = &c->o[x->i];
    if (o->finish) o->events_after_finish++;
    if (ev->has_token && o->n < 128) {
        o->logprob[o->n] = ev->logprob;
        o->toks[o->n++] = ev->token;
    }
    o->n_top = ev->n_top;
    o->cached = ev->cached_tokens;
    o->prompt_tokens = ev->prompt_tokens;
    if (ev->finish) {
        o->finish = ev->finish;
        c->n_done++;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
}

static void wait_all(collected *c, int n) {
    pthread_mutex_lock(&c->mu);
    while (c->n_done < n) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

/* Whether the engines below run on the CUDA backend ("auto" with a device). */
static int on_cuda(void) {
    lunar_backend_kind k;
    lunar_err err;
    return lunar_backend_select("auto", &k, &err) == 0 && k == LUNAR_BACKEND_CUDA;
}

/* Greedy run of one prompt alone on the CPU; gaps[k] = top-1 minus top-2 logit at step k. When the
 * engine runs on CUDA the reference models the device's roundings (bf16 GEMM operands, bf16 latent
 * cache: see op_set_bf16_operands), so that only summation order separates the two and a tie is
 * what differs by less than CUDA_TIE. */
static int run_alone(const lunar_model *m, const int32_t *prompt, int n, int max_tokens, int32_t *out,
                     float *gaps) {
    lunar_err err;
    const int V = m->cfg.vocab_size, cuda = on_cuda();
    const int nb = (n + max_tokens + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
    lunar_kv_pool kv;
    lunar_state_pool st;
    LUNAR_ASSERT(lunar_kv_pool_init(&kv, &m->cfg, nb, cuda ? LUNAR_KV_BF16 : LUNAR_KV_F32, &err) == 0);
    LUNAR_ASSERT(lunar_state_pool_init(&st, &m->cfg, 1, 0, &err) == 0);
    int32_t *blocks = lunar_xmalloc((size_t)nb * sizeof *blocks);
    for (int i = 0; i < nb; i++) blocks[i] = i;
    op_set_bf16_operands(cuda);
    float *lg = lunar_xmalloc((size_t)V * sizeof *lg);
    lunar_batch_seq sq = {prompt, n, 0, 0, blocks, LUNAR_LOGITS_LAST};
    LUNAR_ASSERT(lunar_forward_batch(m, &kv, &st, &sq, 1, lg, &err) == 0);
    int k = 0;
    for (; k < max_tokens; k++) {
        int best = 0, second = -1;
        for (int i = 1; i < V; i++) {
            if (lg[i] > lg[best]) second = best, best = i;
            else if (second < 0 || lg[i] > lg[second]) second = i;
        }
        gaps[k] = lg[best] - lg[second];
        out[k] = best;
        if (best == m->cfg.eos_token_id) {
            k++;
            break;
        }
        if (k + 1 < max_tokens) {
            lunar_batch_seq d = {&out[k], 1, n + k, 0, blocks, LUNAR_LOGITS_LAST};
            LUNAR_ASSERT(lunar_forward_batch(m, &kv, &st, &d, 1, lg, &err) == 0);
        }
    }
    op_set_bf16_operands(0);
    lunar_kv_pool_free(&kv);
    lunar_state_pool_free(&st);
    free(blocks);
    free(lg);
    return k;
}

static unsigned rnd(unsigned *s) {
    *s = *s * 1103515245u + 12345u;
    return (*s >> 8) & 0xffffff;
}

/* Submits n random greedy requests to an engine with these limits, checks each against its lone
 * run. Returns the engine metrics. */
static void stress(int n, int max_seqs, int budget, int64_t cache_bytes, int cancel_every,
                   int shared_prefix, lunar_engine_metrics *mt) {
    lunar_engine_options o;
    lunar_engine_options_default(&o);
    o.model_dir = MODEL;
    o.max_num_seqs = max_seqs;
    o.max_num_batched_tokens = budget;
    o.max_model_len = 512;
    o.cache_memory_bytes = cache_bytes;
    lunar_engine *e;
    lunar_err err;
    if (lunar_engine_create(&e, &o, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    const lunar_model *m = lunar_engine_model(e);
    const int V = m->cfg.vocab_size;
    collected c = {.n_req = n};
    pthread_mutex_init(&c.mu, NULL);
    pthread_cond_init(&c.cv, NULL);
    c.o = lunar_xcalloc((size_t)n, sizeof *c.o);
    ctx *cx = lunar_xcalloc((size_t)n, sizeof *cx);
    int32_t **prompts = lunar_xcalloc((size_t)n, sizeof *prompts);
    int *plen = lunar_xcalloc((size_t)n, sizeof *plen), *maxt = lunar_xcalloc((size_t)n, sizeof *maxt);
    unsigned seed = 12345u + (unsigned)n;
    int32_t prefix[300];
    for (int i = 0; i < 300; i++) prefix[i] = (int32_t)(rnd(&seed) % (unsigned)V);
    for (int i = 0; i < n; i++) {
        /* shared-prefix runs: prompts of 271-300 tokens sharing their first 270 (two full blocks) */
        plen[i] = shared_prefix ? 271 + (int)(rnd(&seed) % 30) : 1 + (int)(rnd(&seed) % 300);
        maxt[i] = 1 + (int)(rnd(&seed) % 24);
        prompts[i] = lunar_xmalloc((size_t)plen[i] * sizeof(int32_t));
        for (int k = 0; k < plen[i]; k++)
            prompts[i][k] = shared_prefix && k < 270 ? prefix[k] : (int32_t)(rnd(&seed) % (unsigned)V);
        cx[i] = (ctx){&c, i};
        lunar_request r = {.prompt = prompts[i], .n_prompt = plen[i], .on_event = on_event, .user = &cx[i]};
        lunar_sampling_params_default(&r.sampling);
        r.sampling.temperature = 0;
        r.sampling.max_tokens = maxt[i];
        r.sampling.logprobs = i % 2; /* on CUDA, requests without logprobs are sampled on the device */
        CHECK_MSG(lunar_engine_submit(e, &r, &c.o[i].id, &err) == 0, "%s", err.msg);
        if (cancel_every && i % cancel_every == 0) lunar_engine_cancel(e, c.o[i].id);
    }
    wait_all(&c, n);
    lunar_engine_metrics_get(e, mt);

    int32_t ref[128];
    float gaps[128];
    int ties = 0, checked = 0, aborted = 0, wide = 0;
    const int cuda = on_cuda();
    for (int i = 0; i < n; i++) {
        struct out *oi = &c.o[i];
        CHECK(oi->events_after_finish == 0);
        CHECK(oi->prompt_tokens == plen[i]);
        if (oi->finish == LUNAR_FINISH_ABORT) {
            aborted++;
            continue;
        }
        CHECK_MSG(oi->finish == LUNAR_FINISH_STOP || oi->finish == LUNAR_FINISH_LENGTH, "request %d finish %d", i,
                  oi->finish);
        if (getenv("DBG")) fprintf(stderr, "req %d plen %d cached %d\n", i, plen[i], oi->cached);
        int nr = run_alone(m, prompts[i], plen[i], maxt[i], ref, gaps);
        checked++;
        int k = 0;
        while (k < nr && k < oi->n && ref[k] == oi->toks[k]) k++;
        for (int j = 0; j < oi->n; j++) CHECK(oi->logprob[j] <= 0 && oi->logprob[j] > -50);
        if (k == nr && k == oi->n) continue;
        ties++;
        if (cuda) { /* see CUDA_DIVERGED_MAX */
            if (!(k < nr && gaps[k] < CUDA_TIE)) wide++;
            continue;
        }
        CHECK_MSG(k < nr && gaps[k] < TIE, "request %d (prompt %d, max %d) differs at token %d of %d/%d; gap %.3g",
                  i, plen[i], maxt[i], k, oi->n, nr, k < nr ? gaps[k] : -1.0);
    }
    CHECK_MSG(ties * 50 <= checked + 50 || (cuda && ties <= CUDA_DIVERGED_MAX * checked),
              "%d of %d outputs diverged (%d not at a tie)", ties, checked, wide);
    if (cancel_every) CHECK(aborted > 0);
    lunar_engine_destroy(e);
    for (int i = 0; i < n; i++) free(prompts[i]);
    free(prompts), free(plen), free(maxt), free(c.o), free(cx);
    pthread_mutex_destroy(&c.mu);
    pthread_cond_destroy(&c.cv);
}

TEST(engine_stress_matches_alone) {
    lunar_engine_metrics mt;
    stress(240, 16, 256, 64 << 20, 0, 0, &mt);
    CHECK(mt.requests_finished == 240 && mt.running == 0 && mt.waiting == 0);
    CHECK_MSG(mt.kv_blocks_used == 0, "blocks still held: %d", mt.kv_blocks_used);
}

TEST(engine_preemption_under_a_small_cache) {
    lunar_engine_metrics mt;
    /* tiny-a latent rows are 16 floats: 1 MLA layer x 128 x 16 x 4 B = 8 KiB a block; 48 KiB of
     * cache after the KDA slots leaves a handful of blocks for 8 sequences of up to 324 tokens */
    stress(40, 8, 96, 160 << 10, 0, 0, &mt);
    CHECK_MSG(mt.preemptions > 0, "expected preemptions with a small cache (got %lld)", (long long)mt.preemptions);
    CHECK(mt.kv_blocks_used == 0);
}

TEST(engine_cancellation_frees_everything) {
    lunar_engine_metrics mt;
    stress(60, 8, 128, 64 << 20, 3, 0, &mt);
    CHECK(mt.kv_blocks_used == 0 && mt.running == 0 && mt.waiting == 0);
}

TEST(engine_prefix_cache_hits_and_equal_outputs) {
    lunar_engine_metrics mt;
    stress(40, 4, 512, 64 << 20, 0, 1, &mt);
    /* every request admitted after the first batch finished its prefill reuses both blocks */
    CHECK_MSG(mt.prefix_cache_hits >= 256 * 30, "prefix cache hits %lld tokens", (long long)mt.prefix_cache_hits);
}

/* --quantization ptpc_fp8 reaches the engine's model (serve builds its engine from these options;
 * the CUDA TP followers load with the same field) */
TEST(engine_ptpc_fp8_option_reaches_the_model) {
    for (int q = 0; q < 2; q++) {
        lunar_engine_options o;
        lunar_engine_options_default(&o);
        o.model_dir = MODEL;
        o.backend = "cpu";
        o.ptpc_fp8 = q;
        lunar_engine *e;
        lunar_err err;
        CHECK_MSG(lunar_engine_create(&e, &o, &err) == 0, "%s", err.msg);
        if (!e) continue;
        CHECK(lunar_engine_model(e)->cfg.ptpc_fp8 == q);
        lunar_engine_destroy(e);
    }
}
