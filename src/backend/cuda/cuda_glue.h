/* Small CUDA kernels the model forward (model/forward_cuda.c) needs beyond the ops of cuda_ops.h:
 * generic-shape fallbacks (any head size) of the GEMM, the KDA recurrence and the absorbed/sparse
 * MLA attention, plus elementwise glue. All pointers are device pointers; async on stream s. */
#ifndef LUNAR_BACKEND_CUDA_CUDA_GLUE_H
#define LUNAR_BACKEND_CUDA_CUDA_GLUE_H

#include <stddef.h>
#include <stdint.h>

#include "backend/cuda/cuda_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y[n, out] (fp32) = x[n, in] . W[out, in]^T, bf16 operands, fp32 accumulation: any shape. */
void lunar_glue_matmul(float *y, const uint16_t *x, const uint16_t *W, int n, int out, int in,
                       lunar_cuda_stream s);
void lunar_glue_copy(void *dst, const void *src, size_t bytes, lunar_cuda_stream s);
/* y = x widened (fp16 -> fp32) or rounded to nearest (fp32 -> fp16), n elements. */
void lunar_glue_f16_to_f32(float *y, const uint16_t *x, size_t n, lunar_cuda_stream s);
void lunar_glue_f32_to_f16(uint16_t *y, const float *x, size_t n, lunar_cuda_stream s);
void lunar_glue_add(float *x, const float *y, size_t n, lunar_cuda_stream s);        /* x += y */
void lunar_glue_sigmoid_mul(float *o, const float *g, size_t n, lunar_cuda_stream s); /* o *= sigmoid(g) */
void lunar_glue_scale(float *x, float a, size_t n, lunar_cuda_stream s);
/* rows: y[i] = x[idx[i]] ([D] rows); scatter: acc[idx[i]] += w[i] * y[i] (idx unique per call). */
void lunar_glue_gather(float *y, const float *x, const int32_t *idx, int m, int D, lunar_cuda_stream s);
void lunar_glue_scatter_add(float *acc, const float *y, const int32_t *idx, const float *w, int m,
                            int D, lunar_cuda_stream s);
/* op_attnres_mix: src device array of S row-major [n, D] pointers; u = proj * norm (fp32 [D]);
 * on (fp32 [D]) or NULL. Reductions in double as the CPU. */
void lunar_glue_attnres_mix(float *out, const float *const *src, int S, const float *u,
                            const float *on, int n, int D, float eps, lunar_cuda_stream s);
/* op_layernorm with fp32 w, b (NULL allowed), in place allowed. */
void lunar_glue_layernorm(float *y, const float *x, const float *w, const float *b, int n, int dim,
                          float eps, lunar_cuda_stream s);
void lunar_glue_hadamard(float *x, int rows, int len, lunar_cuda_stream s);
/* op_rope_neox on x [T, nh, hd], token t at position pos[t]; inv_freq fp32 [rot/2]. */
void lunar_glue_rope_neox(float *x, const float *inv_freq, const int32_t *pos, int T, int nh, int hd,
                          int rot, lunar_cuda_stream s);
/* op_kda_recurrent for one sequence, any dk, dv <= 1024: S [H, dk, dv] fp32 in place. */
void lunar_glue_kda_recurrent(float *o, const float *q, const float *k, const float *v,
                              const float *g, const float *beta, float *S, int T, int H, int dk,
                              int dv, float scale, lunar_cuda_stream s);
/* latent rows: row = [RMSNorm(c) * w | k_pe] of kvr [n, R+P] stored as bf16 (fp8 = 0) or FP8 e4m3
 * codes of scale 1 (fp8 = 1, as the CPU's lunar_kv_round) into the paged cache latent [..][R+P] at
 * slots[i] (block * 128 + offset; a negative slot: row i is not stored). w fp32 [R]. */
void lunar_glue_latent_store(void *latent, int fp8, const float *kvr, const float *w, const int32_t *slots,
                             int n, int R, int P, float eps, lunar_cuda_stream s);
/* q [rows, H, N+P] -> q_lat [rows, H, R] = W_UK^T q_nope, q_pe [rows, H, P]; W bf16 [H*(N+Vd), R]. */
void lunar_glue_mla_absorb(float *q_lat, float *q_pe, const float *q, const uint16_t *W, int rows,
                           int H, int N, int P, int Vd, int R, lunar_cuda_stream s);
/* o [rows, H, Vd] = W_UV o_lat. */
void lunar_glue_mla_unabsorb(float *o, const float *o_lat, const uint16_t *W, int rows, int H, int N,
                             int Vd, int R, lunar_cuda_stream s);
/* The absorbed (idx NULL: positions 0..lens[r]) or sparse (idx [rows, topk], -1 skipped) attention
 * core over a bf16 (fp8 = 0) or FP8 (fp8 = 1) paged latent cache, any R, P; max_len >= every
 * lens / topk (shared memory). */
void lunar_glue_mla_attn(float *o_lat, const float *q_lat, const float *q_pe, const void *latent, int fp8,
                         const int32_t *block_tables, int max_blocks, const int32_t *row_seq,
                         const int32_t *lens, const int32_t *idx, int topk, int max_len, int rows,
                         int H, int R, int P, float scale, lunar_cuda_stream s);

/* MLA prefill of ONE sequence, absorbed form, R = 512, P = 64 (cuda_mla_prefill.cu): rows t of
 * q_lat [n, H, 512] / q_pe [n, H, 64] at positions pos0 + t over the sequence's latent pages (bf16, or FP8)
 * (bt: its block table, page tokens per block, positions 0 .. pos0 + n - 1 already written), causal;
 * o_lat [n, H, 512] fp32. Scores and outputs are cuBLASLt GEMMs over query chunks; ws:
 * lunar_glue_mla_prefill_ws(n, H, pos0 + n) bytes. */
size_t lunar_glue_mla_prefill_ws(int n, int H, int L);
void lunar_glue_mla_prefill(float *o_lat, const float *q_lat, const float *q_pe, const void *latent, int fp8,
                            const int32_t *bt, int page, int pos0, int n, int H, float scale, void *ws,
                            lunar_cuda_stream s);

/* MLA prefill of ONE sequence in the decompressed form (cuda_mla_flash.cu), N = Vd = 128, R = 512,
 * P = 64: o [n, H, 128] fp32 = op_mla_attention_naive's output for the rows t of q [n, H, 192] fp32
 * at positions pos0 + t over the sequence's latent pages (bf16, or FP8 of scale 1; bt: its block
 * table, page tokens per block, positions 0 .. pos0 + n - 1 already written), causal. W: W_kvb
 * bf16 [H * 256, 512]. The per-head keys and values are lifted from the latent with one GEMM per
 * key chunk of kc positions (0: as many as fit 256 MiB; rounded up to 128), then a flash-attention kernel
 * (wgmma, cuda_mla_flash_wg.cu; LUNAR_MLA_FLASH=mma: the mma.sync one); q, k, v and
 * the probabilities are bf16 operands, sums fp32. ws: lunar_glue_mla_flash_ws(n, H, pos0 + n, kc). */
size_t lunar_glue_mla_flash_ws(int n, int H, int L, int kc);
void lunar_glue_mla_flash(float *o, const float *q, const uint16_t *W, const void *latent, int fp8,
                          const int32_t *bt, int page, int pos0, int n, int H, float scale, int kc, void *ws,
                          lunar_cuda_stream s);

#ifdef __cplusplus
}
#endif
#endif
