/* A scripted engine stand-in for tests: see backend.h. One thread; every tick each running request gets its
 * next token. Callbacks are made without the lock held (the server may call cancel from its own locks). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "server/backend.h"

typedef struct freq {
    uint64_t id;
    lunar_request r;
    int produced, cancelled, n_prompt;
    struct freq *next;
} freq;

typedef struct fake {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    uint64_t next_id;
    freq *head;
    int32_t *script;
    int n_script, stop_at_end, delay_us, max_running;
    lunar_engine_metrics m;
} fake;

typedef struct pending {
    lunar_event ev;
    lunar_event_fn fn;
    void *user;
    freq *dead; /* freed after the callback */
} pending;

static void make_event(fake *f, freq *q, pending *p) {
    memset(p, 0, sizeof *p);
    p->fn = q->r.on_event;
    p->user = q->r.user;
    lunar_event *ev = &p->ev;
    ev->request_id = q->id;
    ev->prompt_tokens = q->n_prompt;
    if (q->cancelled || f->stop) {
        ev->finish = LUNAR_FINISH_ABORT;
    } else if (f->n_script == 0) {
        ev->finish = LUNAR_FINISH_STOP;
    } else {
        ev->has_token = 1;
        ev->token = f->script[q->produced % f->n_script];
        ev->logprob = -0.5f;
        if (q->r.sampling.logprobs) {
            ev->n_top = q->r.sampling.top_logprobs < f->n_script ? q->r.sampling.top_logprobs : f->n_script;
            for (int i = 0; i < ev->n_top; i++) {
                ev->top_ids[i] = f->script[i];
                ev->top_logprobs[i] = -0.5f - (float)i;
            }
        }
        q->produced++;
        if (q->r.sampling.max_tokens == 7777 && q->produced == 1) {
            ev->finish = LUNAR_FINISH_ERROR;
            ev->message = "scripted failure";
        } else if (f->stop_at_end && q->produced >= f->n_script) {
            ev->finish = LUNAR_FINISH_STOP;
        } else if (q->produced >= q->r.sampling.max_tokens) {
            ev->finish = LUNAR_FINISH_LENGTH;
        }
        f->m.generation_tokens++;
    }
    ev->completion_tokens = q->produced;
    if (ev->finish != LUNAR_FINISH_NONE) {
        p->dead = q;
        f->m.requests_finished++;
    }
}

static void *loop(void *arg) {
    fake *f = arg;
    pending *batch = NULL;
    int cap = 0;
    for (;;) {
        pthread_mutex_lock(&f->mu);
        while (!f->head && !f->stop) pthread_cond_wait(&f->cv, &f->mu);
        if (!f->head && f->stop) {
            pthread_mutex_unlock(&f->mu);
            break;
        }
        int n = 0;
        for (freq *q = f->head; q; q = q->next) n++;
        if (n > cap) {
            cap = n * 2;
            batch = realloc(batch, (size_t)cap * sizeof *batch);
        }
        int k = 0;
        freq **pp = &f->head;
        while (*pp) {
            freq *q = *pp;
            make_event(f, q, &batch[k]);
            if (batch[k].dead) *pp = q->next;
            else pp = &q->next;
            k++;
        }
        f->m.steps++;
        pthread_mutex_unlock(&f->mu);
        for (int i = 0; i < k; i++) {
            batch[i].fn(batch[i].user, &batch[i].ev);
            if (batch[i].dead) {
                free((void *)batch[i].dead->r.prompt);
                free(batch[i].dead);
            }
        }
        if (f->delay_us > 0) usleep((useconds_t)f->delay_us);
        else sched_yield();
    }
    free(batch);
    return NULL;
}

static int submit(void *ctx, const lunar_request *r, uint64_t *id, lunar_err *err) {
    fake *f = ctx;
    if (r->n_prompt <= 0) return lunar_fail(err, "empty prompt");
    if (r->sampling.max_tokens < 1) return lunar_fail(err, "max_tokens must be at least 1");
    freq *q = lunar_xcalloc(1, sizeof *q);
    q->r = *r;
    q->r.sampling.stop = NULL; /* not copied: the fake does not match stop strings (the server does) */
    q->r.sampling.n_stop = 0;
    q->r.sampling.stop_token_ids = NULL;
    q->r.sampling.logit_bias_ids = NULL;
    q->r.sampling.logit_bias_values = NULL;
    int32_t *p = lunar_xmalloc((size_t)r->n_prompt * sizeof *p);
    memcpy(p, r->prompt, (size_t)r->n_prompt * sizeof *p);
    q->r.prompt = p;
    q->n_prompt = r->n_prompt;
    pthread_mutex_lock(&f->mu);
    q->id = ++f->next_id;
    *id = q->id;
    freq **pp = &f->head;
    while (*pp) pp = &(*pp)->next;
    *pp = q;
    f->m.prompt_tokens += r->n_prompt;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return 0;
}

static void cancel(void *ctx, uint64_t id) {
    fake *f = ctx;
    pthread_mutex_lock(&f->mu);
    for (freq *q = f->head; q; q = q->next)
        if (q->id == id) q->cancelled = 1;
    pthread_mutex_unlock(&f->mu);
}

static void metrics(void *ctx, lunar_engine_metrics *m) {
    fake *f = ctx;
    pthread_mutex_lock(&f->mu);
    *m = f->m;
    int n = 0;
    for (freq *q = f->head; q; q = q->next) n++;
    m->running = f->max_running > 0 && n > f->max_running ? f->max_running : n;
    m->waiting = n - m->running;
    m->kv_blocks_total = 1000;
    m->kv_blocks_used = n;
    pthread_mutex_unlock(&f->mu);
}

static void destroy(void *ctx) {
    fake *f = ctx;
    pthread_mutex_lock(&f->mu);
    f->stop = 1;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->th, NULL);
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
    free(f->script);
    free(f);
}

int lunar_srv_backend_fake(lunar_srv_backend *b, const lunar_srv_fake_options *o, lunar_err *err) {
    fake *f = lunar_xcalloc(1, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    f->n_script = o->n_script;
    f->script = lunar_xmalloc((size_t)(o->n_script > 0 ? o->n_script : 1) * sizeof *f->script);
    if (o->n_script > 0) memcpy(f->script, o->script, (size_t)o->n_script * sizeof *f->script);
    f->stop_at_end = o->stop_at_end;
    f->delay_us = o->token_delay_us;
    f->max_running = o->max_running;
    if (pthread_create(&f->th, NULL, loop, f)) {
        free(f->script);
        free(f);
        return lunar_fail(err, "cannot start the fake engine thread");
    }
    *b = (lunar_srv_backend){.ctx = f, .submit = submit, .cancel = cancel, .metrics = metrics, .destroy = destroy};
    return 0;
}
