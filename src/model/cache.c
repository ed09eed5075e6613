#include "model/cache.h"

#include <stdlib.h>
#include <string.h>

#include "base/tensor.h"

int lunar_kv_pool_init(lunar_kv_pool *p, const lunar_config *c, int n_blocks, lunar_kv_dtype dtype,
                       lunar_err *err) {
    return lunar_kv_pool_init_dcp(p, c, n_blocks, dtype, 1, err);
}

int lunar_kv_pool_init_dcp(lunar_kv_pool *p, const lunar_config *c, int n_blocks, lunar_kv_dtype dtype,
                           int dcp, lunar_err *err) {
    memset(p, 0, sizeof *p);
    p->idx_rep = dcp;
    if (n_blocks <= 0) return lunar_fail(err, "KV pool: need at least one block (got %d)", n_blocks);
    if (dcp < 1 || LUNAR_BLOCK_SIZE % dcp != 0)
        return lunar_fail(err, "KV pool: decode context parallel size %d does not divide the block size %d", dcp,
                          LUNAR_BLOCK_SIZE);
    p->block_size = LUNAR_BLOCK_SIZE / dcp;
    p->n_blocks = n_blocks;
    p->n_mla = c->n_mla_layers;
    p->row = c->kv_lora_rank + c->qk_rope_head_dim;
    p->dtype = dtype;
    p->idx_dim = c->index_topk > 0 ? c->index_head_dim : 0;
    const size_t tokens = (size_t)p->n_mla * n_blocks * p->block_size;
    int ok = !p->n_mla || (p->latent = calloc(tokens * p->row, sizeof(float)));
    if (ok && p->idx_dim) {
        ok = (p->idx_codes = calloc(tokens * dcp, (size_t)p->idx_dim)) != NULL;
        ok = ok && (p->idx_scales = calloc(tokens * dcp, sizeof(float)));
    }
    if (!ok) {
        lunar_kv_pool_free(p);
        return lunar_fail(err, "KV pool: cannot allocate %d blocks of %d tokens", n_blocks, LUNAR_BLOCK_SIZE);
    }
    return 0;
}

void lunar_kv_pool_free(lunar_kv_pool *p) {
    free(p->latent), free(p->idx_codes), free(p->idx_scales);
    memset(p, 0, sizeof *p);
}

size_t lunar_kv_token(const lunar_kv_pool *p, int layer, const int32_t *blocks, int pos) {
    int32_t b = blocks[pos / p->block_size];
    LUNAR_ASSERT(b >= 0 && b < p->n_blocks);
    return ((size_t)layer * p->n_blocks + (size_t)b) * p->block_size + (size_t)(pos % p->block_size);
}

float *lunar_kv_latent_row(const lunar_kv_pool *p, int layer, const int32_t *blocks, int pos) {
    return p->latent + lunar_kv_token(p, layer, blocks, pos) * p->row;
}

void lunar_kv_round(const lunar_kv_pool *p, float *v) {
    if (p->dtype == LUNAR_KV_BF16) {
        for (int i = 0; i < p->row; i++) v[i] = lunar_bf16_to_f32(lunar_f32_to_bf16(v[i]));
    } else if (p->dtype == LUNAR_KV_FP8) {
        /* per-tensor scale 1.0, as ATOM's _k_scale (k3_spec 8): the latent is RMS-normalised, so
         * its values sit well inside e4m3's range */
        for (int i = 0; i < p->row; i++) v[i] = lunar_e4m3_to_f32(lunar_f32_to_e4m3(v[i]));
    }
}

int lunar_state_pool_init(lunar_state_pool *p, const lunar_config *c, int n_slots, int fp16,
                          lunar_err *err) {
    memset(p, 0, sizeof *p);
    if (n_slots <= 0) return lunar_fail(err, "KDA state pool: need at least one slot (got %d)", n_slots);
    const size_t HD = (size_t)c->kda_num_heads * c->kda_head_dim;
    p->n_slots = n_slots;
    p->n_kda = c->n_kda_layers;
    p->conv_len = 3 * HD * (size_t)(c->kda_conv_size - 1);
    p->state_len = HD * (size_t)c->kda_head_dim;
    p->fp16 = fp16;
    const size_t per = (size_t)n_slots * p->n_kda;
    if (per && (!(p->conv = calloc(per * p->conv_len, sizeof(float))) ||
                !(p->state = calloc(per * p->state_len, sizeof(float))))) {
        lunar_state_pool_free(p);
        return lunar_fail(err, "KDA state pool: cannot allocate %d slots", n_slots);
    }
    return 0;
}

void lunar_state_pool_free(lunar_state_pool *p) {
    free(p->conv), free(p->state);
    memset(p, 0, sizeof *p);
}

float *lunar_state_conv(const lunar_state_pool *p, int slot, int layer) {
    return p->conv + ((size_t)slot * p->n_kda + (size_t)layer) * p->conv_len;
}

float *lunar_state_kda(const lunar_state_pool *p, int slot, int layer) {
    return p->state + ((size_t)slot * p->n_kda + (size_t)layer) * p->state_len;
}

void lunar_state_clear(lunar_state_pool *p, int slot) {
    if (!p->n_kda) return;
    memset(lunar_state_conv(p, slot, 0), 0, (size_t)p->n_kda * p->conv_len * sizeof(float));
    memset(lunar_state_kda(p, slot, 0), 0, (size_t)p->n_kda * p->state_len * sizeof(float));
}

void lunar_state_copy(lunar_state_pool *p, int to, int from) {
    if (!p->n_kda || to == from) return;
    memcpy(lunar_state_conv(p, to, 0), lunar_state_conv(p, from, 0),
           (size_t)p->n_kda * p->conv_len * sizeof(float));
    memcpy(lunar_state_kda(p, to, 0), lunar_state_kda(p, from, 0),
           (size_t)p->n_kda * p->state_len * sizeof(float));
}
