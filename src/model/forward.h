/* The Kimi-family forward on the CPU reference backend: prefill and incremental decode of one
 * sequence, carrying the KDA recurrent + conv states and a contiguous MLA latent cache.
 * (The paged caches and batching of many sequences belong to the engine.) */
#ifndef LUNAR_MODEL_FORWARD_H
#define LUNAR_MODEL_FORWARD_H

#include <stdint.h>

#include "model/model.h"

typedef struct lunar_seq {
    int pos;        /* tokens already processed */
    int max_tokens; /* capacity of the MLA latent cache */
    int n_kda, n_mla;
    float **conv;   /* [n_kda][3 * H*dk * (K-1)]: q, k, v conv states, each [H*dk, K-1] */
    float **kda;    /* [n_kda][H * dk * dk]: recurrent state S per head, [dk, dv] */
    float **mla;    /* [n_mla][max_tokens * (kv_lora + rope)]: normalised latent | k_pe */
    /* K3.1 DSA index keys per MLA layer, FP8 e4m3 with one power-of-two scale per token (SPEC
     * 1.1: 128 codes + 4 B = 132 B/token); NULL without an indexer */
    uint8_t **idx_codes; /* [n_mla][max_tokens * index_head_dim] */
    float **idx_scales;  /* [n_mla][max_tokens] */
} lunar_seq;

int lunar_seq_init(lunar_seq *s, const lunar_model *m, int max_tokens, lunar_err *err);
void lunar_seq_reset(lunar_seq *s, const lunar_model *m); /* back to an empty sequence */
void lunar_seq_free(lunar_seq *s);

/* Runs n tokens after the s->pos already seen and advances s->pos by n. Tokens beyond the
 * cache capacity or ids outside the vocabulary are errors.
 * logits: [n, V] when all_logits, else [1, V] for the last token only. */
int lunar_forward(const lunar_model *m, lunar_seq *s, const int32_t *ids, int n, float *logits,
                  int all_logits, lunar_err *err);

#endif
