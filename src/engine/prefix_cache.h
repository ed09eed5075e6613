/* Paged-cache bookkeeping for the engine: the block allocator of the MLA latent / index-key pool,
 * with reference counts so requests can share the blocks of a common prefix, and the prefix cache
 * of a hybrid model.
 *
 * Prefix cache. A full block is named by a chain hash of all tokens up to its end
 * (h_i = SHA-256(h_{i-1} || tokens of block i), 128 bits kept). Its latent rows are reusable by any
 * request with the same prefix. KDA layers carry a recurrent state instead of per-token rows, so
 * the cache also keeps KDA state checkpoints, taken exactly at block boundaries and named by the
 * same chain hash: a request resumes from the longest prefix for which both the latent blocks and
 * a checkpoint at its end exist. Blocks and checkpoints no request uses are evicted least recently
 * used first. */
#ifndef LUNAR_ENGINE_PREFIX_CACHE_H
#define LUNAR_ENGINE_PREFIX_CACHE_H

#include <stdint.h>

typedef struct lunar_hash128 {
    uint64_t w[2];
} lunar_hash128;

/* h = H(prev || tokens[0..n)); prev NULL for the first block. */
lunar_hash128 lunar_block_hash(const lunar_hash128 *prev, const int32_t *tokens, int n);

typedef struct lunar_block_mgr lunar_block_mgr;

/* n_blocks latent blocks; checkpoint slots are state-pool slots [ckpt_first, ckpt_first + n_ckpt). */
lunar_block_mgr *lunar_block_mgr_new(int n_blocks, int ckpt_first, int n_ckpt);
void lunar_block_mgr_free(lunar_block_mgr *m);

/* A fresh block (ref 1), evicting an unused cached block if needed; -1 when none is left. */
int lunar_block_alloc(lunar_block_mgr *m);
/* Drops one reference; a block nobody holds returns to the free list (or stays cached). */
void lunar_block_release(lunar_block_mgr *m, int block);
int lunar_block_free_count(const lunar_block_mgr *m); /* free + evictable */
int lunar_block_used_count(const lunar_block_mgr *m); /* held by a request */

/* Publishes a full block under its hash (no-op if the hash is already cached). */
void lunar_block_cache_insert(lunar_block_mgr *m, lunar_hash128 h, int block);
/* The cached block for h with one more reference taken, or -1. */
int lunar_block_cache_lookup(lunar_block_mgr *m, lunar_hash128 h);

/* A checkpoint slot to write the state for boundary h into: an existing one for h is reused,
 * else a free or least recently used one. -1 if there are no checkpoint slots. *is_new tells
 * whether the caller must copy the state in. */
int lunar_ckpt_slot_for(lunar_block_mgr *m, lunar_hash128 h, int *is_new);
/* The checkpoint slot holding the state at boundary h, or -1. */
int lunar_ckpt_lookup(lunar_block_mgr *m, lunar_hash128 h);

#endif
