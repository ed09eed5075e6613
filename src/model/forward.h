/* The Kimi-family forward on the CPU reference backend, over a batch of sequences that share the
 * paged caches of model/cache.h: each sequence contributes a prefill chunk or one decode token.
 * lunar_seq wraps the batch API for one sequence with caches of its own (CLI, tests). */
#ifndef LUNAR_MODEL_FORWARD_H
#define LUNAR_MODEL_FORWARD_H

#include <stdint.h>

#include "model/cache.h"
#include "model/model.h"

enum { LUNAR_LOGITS_NONE = 0, LUNAR_LOGITS_LAST = 1, LUNAR_LOGITS_ALL = 2 };

typedef struct lunar_batch_seq {
    const int32_t *ids;    /* [n] token ids */
    int n;                 /* tokens of this sequence in the step (>= 1) */
    int pos0;              /* tokens already in its caches */
    int slot;              /* its KDA state-pool slot */
    const int32_t *blocks; /* block table covering positions [0, pos0 + n) */
    int logits;            /* LUNAR_LOGITS_*: which rows of logits it wants */
} lunar_batch_seq;

/* Runs one step. logits receives, sequence by sequence, the rows each asked for ([rows, V]).
 * Errors: ids outside the vocabulary, empty sequences. */
int lunar_forward_batch(const lunar_model *m, lunar_kv_pool *kv, lunar_state_pool *st,
                        const lunar_batch_seq *seqs, int n_seqs, float *logits, lunar_err *err);

/* One sequence with caches of its own. */
typedef struct lunar_seq {
    int pos;        /* tokens already processed */
    int max_tokens; /* capacity */
    lunar_kv_pool kv;
    lunar_state_pool st;
    int32_t *blocks; /* identity block table */
} lunar_seq;

int lunar_seq_init(lunar_seq *s, const lunar_model *m, int max_tokens, lunar_err *err);
void lunar_seq_reset(lunar_seq *s, const lunar_model *m); /* back to an empty sequence */
void lunar_seq_free(lunar_seq *s);

/* Runs n tokens after the s->pos already seen and advances s->pos by n.
 * logits: [n, V] when all_logits, else [1, V] for the last token only. */
int lunar_forward(const lunar_model *m, lunar_seq *s, const int32_t *ids, int n, float *logits,
                  int all_logits, lunar_err *err);

#endif
