/* `--load-format dummy` (as vLLM): deterministic random weights of a config's full shapes, for
 * benchmarks without a checkpoint. Every tensor the loader binds (model/weights.c's walk) is
 * created in an in-memory safetensors set with the checkpoint's name, shape and dtype; its values
 * come from model/dummy_gen.h, keyed by (seed, name, element index).
 *
 * Scales (why each choice keeps a forward O(1) and its routing even):
 *   matrices [out, in]   U(-a, a), a = sqrt(3 / in): unit-variance inputs give unit-variance outputs
 *   embed_tokens         U(-sqrt 3, sqrt 3): unit-variance rows
 *   *norm.weight         1;  indexer k_norm.bias 0
 *   conv1d [HD, 1, K]    U(-a, a), a = sqrt(3 / K)
 *   router gate [E, D]   U(-a, a), a = sqrt(3 / D), e_score_correction_bias 0: expert scores are
 *                        i.i.d. across experts for any input, so every expert is picked equally often
 *                        in expectation (tests/test_bench.c measures the spread)
 *   A_log, dt_bias       unbounded gate (Kimi-Linear): A ~ U(1, 16), dt_bias = softplus^-1(dt) for
 *                        dt in [1e-3, 1e-1] (Mamba's / FLA's initialisation);
 *                        bounded gate (K3, g = lb * sigmoid(exp(A_log) (f + dt_bias))): A_log in
 *                        [-2, 0], dt_bias in [-2, 2], which spreads g over (lb, 0)
 *   MXFP4 experts        uniform E2M1 codes (rms 2.93) with E8M0 block scales 2^e or 2^(e-1),
 *                        e chosen so the dequantised rms is about 1/sqrt(in)
 * Dtypes: BF16, except A_log, dt_bias, conv weights and e_score_correction_bias in F32 (as vLLM
 * holds them) and the MXFP4 packed/scale tensors in U8. */
#ifndef LUNAR_MODEL_DUMMY_H
#define LUNAR_MODEL_DUMMY_H

#include <stddef.h>
#include <stdint.h>

#include "io/safetensors.h"
#include "model/dummy_gen.h"
#include "model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* BF16 matrices at least this large (and every MXFP4 packed tensor) are left ungenerated (data
 * NULL) in device_lazy mode. */
#define LUNAR_DUMMY_LAZY_MIN ((int64_t)1 << 20)

/* Builds the set of every tensor cfg implies. device_lazy: large BF16 matrices and MXFP4 packed
 * tensors get data NULL, to be generated on the device by the CUDA upload (the hook below). */
int lunar_dummy_build(lunar_st **out, const lunar_config *cfg, uint64_t seed, int device_lazy,
                      lunar_err *err);
/* Forgets a set built with device_lazy (call before lunar_st_close). */
void lunar_dummy_forget(const lunar_st *st);

/* The generator and storage dtype of the tensor `name` (checkpoint spelling) of shape [ndim]. */
void lunar_dummy_gen_for(const lunar_config *cfg, uint64_t seed, const char *name, int ndim,
                         const int64_t *shape, lunar_dummy_gen *g, lunar_dtype *dtype);

/* Fills dst[0, n) with elements [i0, i0 + n) of a generator in a storage dtype (BF16, F32, or U8
 * for MXFP4 packed / scale tensors: which one by the name suffix, via gen->kind and scale_tensor).
 * Host side, parallel over the elements. */
void lunar_dummy_fill_host(void *dst, lunar_dtype dtype, const lunar_dummy_gen *g, int scale_tensor,
                           int64_t i0, int64_t n);

/* ---- the CUDA upload's hook (model/forward_cuda.c) ----
 * A tensor of a device_lazy dummy set has data NULL. These generate its values directly into
 * device memory (the same values the host would produce), so a 98 GB model never exists on the
 * host. They return 0, or -1 when t is not such a tensor. */
int lunar_dummy_is_lazy(const lunar_tensor *t);
int lunar_dummy_device_bf16(uint16_t *dst_dev, const lunar_tensor *t);             /* [numel] bf16 */
int lunar_dummy_device_mxfp4_bf16(uint16_t *dst_dev, const lunar_mxfp4 *w);        /* [out, in] bf16 */
int lunar_dummy_device_raw(uint8_t *dst_dev, const lunar_tensor *t);               /* MXFP4 packed bytes */

/* Tensor-parallel shards of lazy tensors (model/shard.c): t is a window of parent (a lazy tensor of
 * a device_lazy set): its element (r, c), with rows of `cols` elements, is element base + r * ld + c
 * of parent (elements are bytes for MXFP4 packed tensors). A window is lazy too: the hooks above
 * generate exactly the parent's values at those places, so the shards of a lazy dummy model are
 * the shards of the same model, bit for bit, and no rank ever holds the full model. */
void lunar_dummy_window(const lunar_tensor *t, const lunar_tensor *parent, int64_t base, int64_t ld, int64_t cols);
void lunar_dummy_window_forget(const lunar_tensor *t);

/* Device launchers (backend/cuda/cuda_dummy.cu; only with LUNAR_HAVE_CUDA): elements [i0, i0+n). */
void lunar_cuda_dummy_bf16(uint16_t *dst, const lunar_dummy_gen *g, uint64_t i0, uint64_t n);
void lunar_cuda_dummy_f32(float *dst, const lunar_dummy_gen *g, uint64_t i0, uint64_t n);
void lunar_cuda_dummy_mxfp4_packed(uint8_t *dst, const lunar_dummy_gen *g, uint64_t i0, uint64_t n);
void lunar_cuda_dummy_mxfp4_scale(uint8_t *dst, const lunar_dummy_gen *g, uint64_t i0, uint64_t n);
/* The dequantised matrix [rows, in] (rows from row0) as bf16 (exact: E2M1 x 2^k fits bf16). */
void lunar_cuda_dummy_mxfp4_bf16(uint16_t *dst, const lunar_dummy_gen *g, int64_t row0, int64_t rows);
/* Windows: dst[r * cols + c] = element base + r * ld + c, for n = rows * cols elements (bf16 values,
 * MXFP4 packed bytes); the dequantised MXFP4 columns [col0, col0 + cols) of rows [row0, row0 + rows). */
void lunar_cuda_dummy_bf16_2d(uint16_t *dst, const lunar_dummy_gen *g, uint64_t base, uint64_t ld, uint64_t cols,
                              uint64_t n);
void lunar_cuda_dummy_mxfp4_packed_2d(uint8_t *dst, const lunar_dummy_gen *g, uint64_t base, uint64_t ld,
                                      uint64_t cols, uint64_t n);
void lunar_cuda_dummy_mxfp4_bf16_cols(uint16_t *dst, const lunar_dummy_gen *g, int64_t row0, int64_t rows,
                                      int64_t col0, int64_t cols);

/* ---- config transforms ---- */

/* Keeps layers [0, L): the schedule tables are already per layer; the KDA/MLA counts follow. */
int lunar_config_truncate_layers(lunar_config *cfg, int L, lunar_err *err);
/* The shapes one rank of tensor parallelism tp holds (vLLM/ATOM's split):
 *   attention heads (MLA and KDA) / tp   (q_b, kv_b, o, g, KDA q/k/v/conv/f_b/g/b/o, A_log, dt_bias)
 *   moe_intermediate_size / tp           (routed experts TP-split, shared experts too)
 *   intermediate_size / tp               (dense layers)
 *   vocab_size / tp                      (vocab-parallel embedding and lm_head)
 *   replicated: q_a/kv_a projections, the router, the latent down/up projections, AttnRes, norms,
 *   the DSA indexer (vLLM replicates it).
 * The all-reduces a real rank runs (two per layer) and the logits all-gather are not modelled.
 * Fails when a split is not exact or leaves MXFP4 blocks partial. */
int lunar_config_tp_slice(lunar_config *cfg, int tp, lunar_err *err);

/* path, or path/config.json when path is a directory, into out. */
void lunar_config_path(const char *path, char *out, size_t cap);

#ifdef __cplusplus
}
#endif

#endif
