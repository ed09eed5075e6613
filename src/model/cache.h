/* The per-request memory of the Kimi family, laid out as the engine pages it:
 *  - the MLA latent cache, in blocks of block_size (128) tokens: 576 values per token per MLA layer;
 *  - the K3.1 DSA index keys, paged the same way: FP8 e4m3 codes + one power-of-two scale per token;
 *  - the KDA state pool: one slot per running request holding, per KDA layer, the recurrent state
 *    S [H, dk, dk] and the short-conv state [3, H*dk, K-1].
 * The CPU reference keeps values in fp32 and emulates the storage precision on write (BF16 or FP8
 * latent, fp16 KDA state), so it computes what the GPU computes from the same stored values. */
#ifndef LUNAR_MODEL_CACHE_H
#define LUNAR_MODEL_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "io/config.h"

#define LUNAR_BLOCK_SIZE 128

typedef enum lunar_kv_dtype { LUNAR_KV_F32, LUNAR_KV_BF16, LUNAR_KV_FP8 } lunar_kv_dtype;

typedef struct lunar_kv_pool {
    int block_size;       /* tokens per block */
    int n_blocks;
    int n_mla;            /* MLA layers */
    int row;              /* kv_lora_rank + qk_rope_head_dim (576) */
    lunar_kv_dtype dtype; /* storage precision (emulated) */
    float *latent;        /* [n_mla][n_blocks][block_size][row] */
    int idx_dim;          /* index_head_dim; 0 without a DSA indexer */
    uint8_t *idx_codes;   /* [n_mla][n_blocks][block_size][idx_dim] FP8 e4m3 */
    float *idx_scales;    /* [n_mla][n_blocks][block_size] (x idx_rep) */
    /* Index keys per slot: 1, or the DCP size D under decode context parallelism. Then a block
     * still covers 128 positions of a sequence, but a rank stores only the 128 / D of them with
     * p % D == its DCP rank (block_size = 128 / D latent rows), while each row carries the index
     * keys of all D positions p - p % D .. + D-1 (replicated, so the top-k is global). */
    int idx_rep;
} lunar_kv_pool;

typedef struct lunar_state_pool {
    int n_slots, n_kda;
    size_t conv_len;  /* 3 * H*dk * (K-1) per layer */
    size_t state_len; /* H * dk * dk per layer */
    int fp16;         /* emulate an fp16 recurrent state (rounded after every update) */
    float *conv;      /* [n_slots][n_kda][conv_len] */
    float *state;     /* [n_slots][n_kda][state_len] */
} lunar_state_pool;

int lunar_kv_pool_init(lunar_kv_pool *p, const lunar_config *c, int n_blocks, lunar_kv_dtype dtype,
                       lunar_err *err);
/* The pool of one DCP rank: n_blocks blocks of 128 / dcp latent rows, idx_rep = dcp (dcp must
 * divide 128; dcp 1: lunar_kv_pool_init). */
int lunar_kv_pool_init_dcp(lunar_kv_pool *p, const lunar_config *c, int n_blocks, lunar_kv_dtype dtype,
                           int dcp, lunar_err *err);
void lunar_kv_pool_free(lunar_kv_pool *p);
/* Latent row of token `pos` of a sequence with this block table, in MLA layer `layer`. */
float *lunar_kv_latent_row(const lunar_kv_pool *p, int layer, const int32_t *blocks, int pos);
/* Index of token `pos` of a sequence in MLA layer `layer`'s slots: its index-key codes are
 * idx_codes + i * idx_dim and its scale idx_scales[i]. */
size_t lunar_kv_token(const lunar_kv_pool *p, int layer, const int32_t *blocks, int pos);
/* Rounds v[row] to the pool's storage precision (in place). */
void lunar_kv_round(const lunar_kv_pool *p, float *v);

int lunar_state_pool_init(lunar_state_pool *p, const lunar_config *c, int n_slots, int fp16,
                          lunar_err *err);
void lunar_state_pool_free(lunar_state_pool *p);
float *lunar_state_conv(const lunar_state_pool *p, int slot, int layer);
float *lunar_state_kda(const lunar_state_pool *p, int slot, int layer);
void lunar_state_clear(lunar_state_pool *p, int slot);
/* Copies every KDA layer's state of slot `from` into slot `to` (prefix-cache checkpoints). */
void lunar_state_copy(lunar_state_pool *p, int to, int from);

#endif
