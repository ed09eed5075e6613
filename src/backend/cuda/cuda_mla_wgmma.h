// Internal to the CUDA backend: the wgmma MLA decode kernels (cuda_mla_wgmma*.cu) and what it shares
// with cuda_mla.cu (the split merge, the SM count). Shapes as lunar_cuda_mla_absorbed's.
#ifndef LUNAR_BACKEND_CUDA_MLA_WGMMA_H
#define LUNAR_BACKEND_CUDA_MLA_WGMMA_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/cuda/cuda_ops.h"

// workspace bytes of lunar_mla_wgmma_decode for these shapes (0: no split)
size_t lunar_mla_wgmma_ws(int rows, int H, int max_n);
// dense absorbed decode (row_seq / lens as lunar_cuda_mla_absorbed), o [rows, H, 512]
void lunar_mla_wgmma_decode(float *o, const float *q_lat, const float *q_pe, const lunar_cuda_mla_cache *c,
                            const int32_t *row_seq, const int32_t *lens, int max_n, int rows, int H, float scale,
                            void *ws, cudaStream_t s);
// o[rh] = sum_s 2^(lse[s, rh] - M) o_part[s, rh] / sum_s 2^(lse[s, rh] - M) * out_scale, rh < RH
// (0 where no split saw a position); o_part [splits][RH][512], lse [splits][RH]
void lunar_mla_merge_splits(float *o, const float *o_part, const float *lse, int RH, int splits, float out_scale,
                            cudaStream_t s);
int lunar_mla_sm_count(void);

#endif
