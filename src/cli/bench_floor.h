/* The physical floors `lunar bench` prints beside each figure: the bytes a decode step must move
 * (weights it touches + the caches it reads and writes) and the FLOPs a prefill must do, from the
 * config and the loaded tensors' storage sizes. Divided by a bandwidth / peak they give the time
 * no implementation on that hardware can beat. */
#ifndef LUNAR_CLI_BENCH_FLOOR_H
#define LUNAR_CLI_BENCH_FLOOR_H

#include <stdint.h>

#include "model/model.h"

typedef struct lunar_weight_bytes {
    double dense;      /* every non-expert, non-embedding tensor: read once per step (lm_head included) */
    double per_expert; /* one routed expert of one layer (w1 + w3 + w2, as stored) */
    double embed_row;  /* one embedding row */
    int n_moe;         /* MoE layers */
} lunar_weight_bytes;

/* Sizes as stored in m (checkpoint or dummy: BF16, or MXFP4 packed + scales for the experts). */
void lunar_weight_bytes_of(const lunar_model *m, lunar_weight_bytes *w);

/* Expected distinct experts B tokens touch when each picks k of E uniformly: E (1 - (1 - k/E)^B). */
double lunar_experts_touched(int E, int k, int B);

/* Bytes one decode step of B sequences at context ctx moves: weights touched, the MLA latent rows
 * read (all ctx, or the top-k the DSA indexer selects) and written, the DSA index keys scored, and
 * every KDA state read and written. kv_elem: bytes per stored latent value (4 CPU fp32, 2 bf16). */
double lunar_decode_bytes(const lunar_model *m, const lunar_weight_bytes *w, int B, int64_t ctx,
                          int kv_elem);
/* The same with state_elem bytes per stored KDA state value (4 fp32, 2 the fp16 state option). */
double lunar_decode_bytes_st(const lunar_model *m, const lunar_weight_bytes *w, int B, int64_t ctx, int kv_elem,
                             int state_elem);
/* The same on one rank of a decode-context-parallel group of dcp: it reads and writes the latent
 * rows of its positions only (every dcp-th: ceil of 1/dcp of them); the index keys stay whole. */
double lunar_decode_bytes_dcp(const lunar_model *m, const lunar_weight_bytes *w, int B, int64_t ctx, int kv_elem,
                              int state_elem, int dcp);

/* FLOPs of a prefill of n tokens from empty caches: 2 x active weights per token (the lm_head
 * for the last token only), causal MLA attention (or DSA: top-k keys plus the indexer's scoring of
 * every key), and the chunked KDA (state in/out and intra-chunk terms, chunk 64). */
double lunar_prefill_flops(const lunar_config *c, int64_t n);

#endif
