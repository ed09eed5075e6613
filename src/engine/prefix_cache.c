#include "engine/prefix_cache.h"

#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "base/sha256.h"

lunar_hash128 lunar_block_hash(const lunar_hash128 *prev, const int32_t *tokens, int n) {
    lunar_sha256 s;
    uint8_t d[32];
    lunar_sha256_init(&s);
    if (prev) lunar_sha256_update(&s, prev->w, sizeof prev->w);
    lunar_sha256_update(&s, tokens, (size_t)n * sizeof *tokens);
    lunar_sha256_final(&s, d);
    lunar_hash128 h;
    memcpy(h.w, d, sizeof h.w);
    return h;
}

static int same(lunar_hash128 a, lunar_hash128 b) { return a.w[0] == b.w[0] && a.w[1] == b.w[1]; }

/* Open-addressing table from hash to an index (block or checkpoint number); tombstones are
 * avoided by rebuilding the chain on removal (backward-shift deletion). */
typedef struct table {
    lunar_hash128 *key;
    int *val; /* -1 empty */
    int cap;  /* power of two, >= 2 * entries */
} table;

static void table_init(table *t, int entries) {
    t->cap = 16;
    while (t->cap < 2 * entries) t->cap *= 2;
    t->key = lunar_xcalloc((size_t)t->cap, sizeof *t->key);
    t->val = lunar_xmalloc((size_t)t->cap * sizeof *t->val);
    for (int i = 0; i < t->cap; i++) t->val[i] = -1;
}

static int table_find(const table *t, lunar_hash128 h) {
    for (int i = (int)(h.w[0] & (uint64_t)(t->cap - 1));; i = (i + 1) & (t->cap - 1)) {
        if (t->val[i] < 0) return -1;
        if (same(t->key[i], h)) return i;
    }
}

static void table_put(table *t, lunar_hash128 h, int v) {
    int i = (int)(h.w[0] & (uint64_t)(t->cap - 1));
    while (t->val[i] >= 0) i = (i + 1) & (t->cap - 1);
    t->key[i] = h;
    t->val[i] = v;
}

static void table_del(table *t, int i) {
    t->val[i] = -1;
    for (int j = (i + 1) & (t->cap - 1); t->val[j] >= 0; j = (j + 1) & (t->cap - 1)) {
        lunar_hash128 k = t->key[j];
        int v = t->val[j];
        t->val[j] = -1;
        table_put(t, k, v);
    }
}

struct lunar_block_mgr {
    int n_blocks;
    int *ref;            /* requests holding the block */
    int *cached;         /* 1: published in the prefix cache */
    lunar_hash128 *hash; /* of a cached block */
    uint64_t *last_use;  /* for LRU eviction */
    int *free_list, n_free;
    table blocks;
    int ckpt_first, n_ckpt;
    lunar_hash128 *ckpt_hash;
    int *ckpt_valid;
    uint64_t *ckpt_use;
    table ckpts;
    uint64_t clock;
};

lunar_block_mgr *lunar_block_mgr_new(int n_blocks, int ckpt_first, int n_ckpt) {
    lunar_block_mgr *m = lunar_xcalloc(1, sizeof *m);
    m->n_blocks = n_blocks;
    m->ref = lunar_xcalloc((size_t)n_blocks, sizeof *m->ref);
    m->cached = lunar_xcalloc((size_t)n_blocks, sizeof *m->cached);
    m->hash = lunar_xcalloc((size_t)n_blocks, sizeof *m->hash);
    m->last_use = lunar_xcalloc((size_t)n_blocks, sizeof *m->last_use);
    m->free_list = lunar_xmalloc((size_t)n_blocks * sizeof *m->free_list);
    for (int i = 0; i < n_blocks; i++) m->free_list[i] = n_blocks - 1 - i; /* pop gives 0 first */
    m->n_free = n_blocks;
    table_init(&m->blocks, n_blocks);
    m->ckpt_first = ckpt_first;
    m->n_ckpt = n_ckpt;
    m->ckpt_hash = lunar_xcalloc((size_t)n_ckpt + 1, sizeof *m->ckpt_hash);
    m->ckpt_valid = lunar_xcalloc((size_t)n_ckpt + 1, sizeof *m->ckpt_valid);
    m->ckpt_use = lunar_xcalloc((size_t)n_ckpt + 1, sizeof *m->ckpt_use);
    table_init(&m->ckpts, n_ckpt);
    return m;
}

void lunar_block_mgr_free(lunar_block_mgr *m) {
    if (!m) return;
    free(m->ref), free(m->cached), free(m->hash), free(m->last_use), free(m->free_list);
    free(m->blocks.key), free(m->blocks.val);
    free(m->ckpt_hash), free(m->ckpt_valid), free(m->ckpt_use), free(m->ckpts.key), free(m->ckpts.val);
    free(m);
}

/* Unpublishes the least recently used cached block nobody holds; -1 if there is none. */
static int evict_block(lunar_block_mgr *m) {
    int best = -1;
    for (int b = 0; b < m->n_blocks; b++)
        if (m->cached[b] && m->ref[b] == 0 && (best < 0 || m->last_use[b] < m->last_use[best])) best = b;
    if (best < 0) return -1;
    int i = table_find(&m->blocks, m->hash[best]);
    LUNAR_ASSERT(i >= 0);
    table_del(&m->blocks, i);
    m->cached[best] = 0;
    return best;
}

int lunar_block_alloc(lunar_block_mgr *m) {
    int b = m->n_free ? m->free_list[--m->n_free] : evict_block(m);
    if (b < 0) return -1;
    m->ref[b] = 1;
    m->last_use[b] = ++m->clock;
    return b;
}

void lunar_block_release(lunar_block_mgr *m, int b) {
    LUNAR_ASSERT(b >= 0 && b < m->n_blocks && m->ref[b] > 0);
    if (--m->ref[b] == 0 && !m->cached[b]) m->free_list[m->n_free++] = b;
}

int lunar_block_free_count(const lunar_block_mgr *m) {
    int n = m->n_free;
    for (int b = 0; b < m->n_blocks; b++) n += m->cached[b] && m->ref[b] == 0;
    return n;
}

int lunar_block_used_count(const lunar_block_mgr *m) {
    int n = 0;
    for (int b = 0; b < m->n_blocks; b++) n += m->ref[b] > 0;
    return n;
}

void lunar_block_cache_insert(lunar_block_mgr *m, lunar_hash128 h, int b) {
    if (m->cached[b] || table_find(&m->blocks, h) >= 0) return;
    m->cached[b] = 1;
    m->hash[b] = h;
    m->last_use[b] = ++m->clock;
    table_put(&m->blocks, h, b);
}

int lunar_block_cache_lookup(lunar_block_mgr *m, lunar_hash128 h) {
    int i = table_find(&m->blocks, h);
    if (i < 0) return -1;
    int b = m->blocks.val[i]; /* cached blocks are never on the free list, held or not */
    m->ref[b]++;
    m->last_use[b] = ++m->clock;
    return b;
}

int lunar_ckpt_lookup(lunar_block_mgr *m, lunar_hash128 h) {
    int i = table_find(&m->ckpts, h);
    if (i < 0) return -1;
    int c = m->ckpts.val[i];
    m->ckpt_use[c] = ++m->clock;
    return m->ckpt_first + c;
}

int lunar_ckpt_slot_for(lunar_block_mgr *m, lunar_hash128 h, int *is_new) {
    *is_new = 0;
    if (m->n_ckpt == 0) return -1;
    int i = table_find(&m->ckpts, h);
    if (i >= 0) {
        int c = m->ckpts.val[i];
        m->ckpt_use[c] = ++m->clock;
        return m->ckpt_first + c;
    }
    int c = -1;
    for (int k = 0; k < m->n_ckpt; k++)
        if (!m->ckpt_valid[k]) {
            c = k;
            break;
        }
    if (c < 0) { /* evict the least recently used checkpoint */
        c = 0;
        for (int k = 1; k < m->n_ckpt; k++)
            if (m->ckpt_use[k] < m->ckpt_use[c]) c = k;
        int j = table_find(&m->ckpts, m->ckpt_hash[c]);
        LUNAR_ASSERT(j >= 0);
        table_del(&m->ckpts, j);
    }
    m->ckpt_valid[c] = 1;
    m->ckpt_hash[c] = h;
    m->ckpt_use[c] = ++m->clock;
    table_put(&m->ckpts, h, c);
    *is_new = 1;
    return m->ckpt_first + c;
}
