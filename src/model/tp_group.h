/* A tensor-parallel group on the CPU backend: tp persistent rank threads in this process, each
 * holding its shards (model/shard.h), its own caches, and the CPU collectives. The caller drives
 * the group from one thread as it would drive a single model: every call runs on all ranks at
 * once and returns rank 0's logits (all ranks compute the same bits). */
#ifndef LUNAR_MODEL_TP_GROUP_H
#define LUNAR_MODEL_TP_GROUP_H

#include "model/forward.h"
#include "model/shard.h"

typedef struct lunar_tp_group lunar_tp_group;

/* Shards `full` (which must outlive the group) over o->tp rank threads. */
int lunar_tp_group_create(lunar_tp_group **out, const lunar_model *full, const lunar_tp_opts *o,
                          lunar_err *err);
void lunar_tp_group_free(lunar_tp_group *g);
const lunar_model *lunar_tp_group_rank_model(const lunar_tp_group *g, int rank);

/* Paged caches on every rank, as lunar_kv_pool_init / lunar_state_pool_init (n_blocks global
 * block ids: under DCP a rank fills only every dcp-th token, in local slots of those blocks). */
int lunar_tp_group_pools(lunar_tp_group *g, int n_blocks, lunar_kv_dtype dtype, int n_slots, int fp16,
                         lunar_err *err);
/* lunar_forward_batch on every rank with its pools. */
int lunar_tp_group_forward_batch(lunar_tp_group *g, const lunar_batch_seq *seqs, int n_seqs,
                                 float *logits, lunar_err *err);
void lunar_tp_group_state_copy(lunar_tp_group *g, int to, int from);
void lunar_tp_group_state_clear(lunar_tp_group *g, int slot);

/* One sequence with caches of its own on every rank (the lunar_seq API, for generate and tests). */
int lunar_tp_group_seq_init(lunar_tp_group *g, int max_tokens, lunar_err *err);
int lunar_tp_group_forward(lunar_tp_group *g, const int32_t *ids, int n, float *logits, int all_logits,
                           lunar_err *err);

#endif
