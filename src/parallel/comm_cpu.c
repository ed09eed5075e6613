/* The CPU-thread transport of parallel/comm.h: ranks are threads of one process. A collective is
 * two barrier phases: every rank publishes its buffer pointer, then (after the first barrier) reads
 * what it needs from the others into private memory, then (after the second barrier, when nobody
 * reads its buffer any more) writes its result. Sums run over ranks in order 0..size-1 in fp32, so
 * every rank gets the same bits and a rerun reproduces them. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "parallel/comm.h"

typedef struct cpu_world {
    int size;
    pthread_barrier_t bar;
    const float **ptr; /* [size] the buffer each rank published for the current collective */
    int *color, *key;  /* [size] a split's arguments, published like ptr */
    struct cpu_world **made; /* [size] the worlds a split's leaders made */
    atomic_int refs;   /* handles still alive */
} cpu_world;

static cpu_world *world_of(lunar_comm *c) { return c->impl; }

static void wait_all(cpu_world *w) { pthread_barrier_wait(&w->bar); }

static int cpu_all_reduce(lunar_comm *c, float *buf, size_t n, lunar_err *err) {
    (void)err;
    cpu_world *w = world_of(c);
    if (w->size == 1) return 0;
    float *sum = lunar_xmalloc(n * sizeof(float));
    w->ptr[c->rank] = buf;
    wait_all(w);
    memcpy(sum, w->ptr[0], n * sizeof(float));
    for (int r = 1; r < w->size; r++) {
        const float *p = w->ptr[r];
        for (size_t i = 0; i < n; i++) sum[i] += p[i];
    }
    wait_all(w); /* every rank has read every buffer: now they may be overwritten */
    memcpy(buf, sum, n * sizeof(float));
    free(sum);
    return 0;
}

static int cpu_all_gather(lunar_comm *c, const float *send, float *recv, size_t n, lunar_err *err) {
    (void)err;
    cpu_world *w = world_of(c);
    /* send may alias recv + rank * n (in-place gather): read everything first, write after */
    float *tmp = lunar_xmalloc(n * w->size * sizeof(float));
    w->ptr[c->rank] = send;
    wait_all(w);
    for (int r = 0; r < w->size; r++) memcpy(tmp + (size_t)r * n, w->ptr[r], n * sizeof(float));
    wait_all(w);
    memcpy(recv, tmp, n * w->size * sizeof(float));
    free(tmp);
    return 0;
}

static int cpu_all_to_all(lunar_comm *c, const float *send, float *recv, size_t n, lunar_err *err) {
    (void)err;
    cpu_world *w = world_of(c);
    float *tmp = lunar_xmalloc(n * w->size * sizeof(float));
    w->ptr[c->rank] = send;
    wait_all(w);
    for (int r = 0; r < w->size; r++)
        memcpy(tmp + (size_t)r * n, w->ptr[r] + (size_t)c->rank * n, n * sizeof(float));
    wait_all(w);
    memcpy(recv, tmp, n * w->size * sizeof(float));
    free(tmp);
    return 0;
}

static int cpu_barrier(lunar_comm *c, lunar_err *err) {
    (void)err;
    wait_all(world_of(c));
    return 0;
}

static void cpu_destroy(lunar_comm *c) {
    cpu_world *w = world_of(c);
    if (atomic_fetch_sub(&w->refs, 1) == 1) {
        pthread_barrier_destroy(&w->bar);
        free(w->ptr), free(w->color), free(w->key), free(w->made);
        free(w);
    }
    free(c);
}

static cpu_world *world_new(int size) {
    LUNAR_ASSERT(size >= 1);
    cpu_world *w = lunar_xcalloc(1, sizeof *w);
    w->size = size;
    w->ptr = lunar_xcalloc((size_t)size, sizeof *w->ptr);
    w->color = lunar_xcalloc((size_t)size, sizeof *w->color);
    w->key = lunar_xcalloc((size_t)size, sizeof *w->key);
    w->made = lunar_xcalloc((size_t)size, sizeof *w->made);
    atomic_init(&w->refs, size);
    LUNAR_ASSERT(pthread_barrier_init(&w->bar, NULL, (unsigned)size) == 0);
    return w;
}

static const lunar_comm_vt cpu_vt;

static lunar_comm *handle_new(cpu_world *w, int rank) {
    lunar_comm *c = lunar_xcalloc(1, sizeof *c);
    c->rank = rank;
    c->size = w->size;
    c->vt = &cpu_vt;
    c->impl = w;
    return c;
}

/* Three phases: every rank publishes (color, key); each group's first member (by key, then rank)
 * makes the group's world; every member takes its handle from it. The last barrier keeps `made`
 * until all have read it (a next split would overwrite it). */
static int cpu_split(lunar_comm *c, int color, int key, lunar_comm **out, lunar_err *err) {
    (void)err;
    cpu_world *w = world_of(c);
    const int me = c->rank;
    w->color[me] = color, w->key[me] = key;
    wait_all(w);
    int n = 0, mine = 0, leader = -1;
    for (int q = 0; q < w->size; q++) {
        if (w->color[q] != color) continue;
        n++;
        if (w->key[q] < key || (w->key[q] == key && q < me)) mine++;
        if (leader < 0 || w->key[q] < w->key[leader]) leader = q; /* ties: the lower rank, met first */
    }
    if (leader == me) w->made[me] = world_new(n);
    wait_all(w);
    *out = handle_new(w->made[leader], mine);
    wait_all(w);
    return 0;
}

static const lunar_comm_vt cpu_vt = {cpu_all_reduce, cpu_all_gather, cpu_all_to_all, cpu_barrier, cpu_split,
                                     cpu_destroy};

void lunar_comm_cpu_world(lunar_comm **comms, int size) {
    cpu_world *w = world_new(size);
    for (int r = 0; r < size; r++) comms[r] = handle_new(w, r);
}

