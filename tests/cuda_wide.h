/* The random Kimi-Linear checkpoint at the tuned kernels' shapes (tests/test_cuda_forward.c):
 * KDA head_dim 128, MLA 512 + 64, fused-MoE widths; for the CUDA tests that need those paths.
 * The K3 one adds AttnRes, the latent MXFP4 MoE and the DSA indexer. Both removed with
 * lunar_test_wide_model_rm. */
#ifndef LUNAR_TESTS_CUDA_WIDE_H
#define LUNAR_TESTS_CUDA_WIDE_H

/* writes config.json + model.safetensors into a new temporary directory (dir: room for 64 bytes);
 * 0 on success */
int lunar_test_wide_model_dir(char *dir);
/* the same with 4 KDA heads (its fused KDA projection 1796 wide: a multiple of 4) */
int lunar_test_wide4_model_dir(char *dir);
/* the same for the K3 / K3.1-shaped model (AttnRes, latent MXFP4 MoE, DSA indexer, output gate) */
int lunar_test_k3_model_dir(char *dir);
/* the K3 one with 4 KDA heads (its fused KDA projection, with the full-rank gate, 2180 wide) */
int lunar_test_k3h4_model_dir(char *dir);
void lunar_test_wide_model_rm(const char *dir);

#include "model/model.h"

/* make (one of the two above) writes the model into a new folder (dir: room for 64 bytes), then it
 * is loaded with lo (NULL: the defaults): the model, or NULL after a failed check naming the load
 * error. lunar_test_model_done frees it (NULL too) and removes the folder. */
lunar_model *lunar_test_model_load(char *dir, int (*make)(char *), const lunar_load_options *lo);
void lunar_test_model_done(lunar_model *m, const char *dir);

/* logits rows got against want [rows, V] (tests/test_cuda_forward.c): per-row e = max |got - want| /
 * max |want| over all rows; returns the median row e, sets *worst to the largest, adds the rows whose
 * argmax agrees (near ties of 5e-3 max |want| counted) to *agree and, strict non-NULL, the equal picks
 * to *strict */
double lunar_test_cmp_rows(const float *got, const float *want, int rows, int V, int *agree, int *strict,
                           double *worst);

/* m uploaded to the device with its MoE layers on the fused path (fused) or the generic per-expert one
 * (LUNAR_CUDA_MOE=generic set around the upload, so that MXFP4 experts keep their widened copies); 0 on
 * success, after a check that the path asked for exists (lunar_cuda_model_fused_moe). The model type is
 * model/forward_cuda.h's lunar_cuda_model. */
struct lunar_cuda_model;
int lunar_test_cuda_upload(struct lunar_cuda_model **gm, const lunar_model *m, int fused, lunar_err *err);

#endif
