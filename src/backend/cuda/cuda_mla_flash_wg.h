// Internal to the CUDA backend: the wgmma flash kernel of the decompressed MLA prefill
// (cuda_mla_flash_wg.cu), called by cuda_mla_flash.cu per key chunk.
#ifndef LUNAR_BACKEND_CUDA_MLA_FLASH_WG_H
#define LUNAR_BACKEND_CUDA_MLA_FLASH_WG_H

#include <cuda_runtime.h>
#include <stdint.h>

// keys per tile: the chunk's rows must be a multiple of it
int lunar_mla_flash_wg_tile(void);
// One key chunk [k0, k1) of the causal flash attention, as cuda_mla_flash.cu's k_flash: o [n, H, 128]
// fp32 (unnormalised between chunks; normalised when last), ml [n, H, 2] the (row max, row sum)
// state between chunks (read unless first, written unless last), q [n, H, 192] fp32, KV [rows][H x
// 256] bf16 (per head k_nope 128 | v 128) and Kpe [rows][64] bf16 = positions k0 .. k0 + rows - 1,
// rows a multiple of the tile, k1 - k0 <= rows; sl = scale * log2 e. false: no tensor map (driver
// entry point missing or the map refused), nothing launched: the caller runs k_flash. pp: the
// producer / consumer variant (cuda_mla_flash.cu's default; LUNAR_MLA_FLASH=wgmma runs the other).
bool lunar_mla_flash_wg(float *o, float *ml, const float *q, const uint16_t *KV, const uint16_t *Kpe, int rows, int k0,
                        int k1, int pos0, int n, int H, float sl, int first, int last, int pp, cudaStream_t s);

#endif
