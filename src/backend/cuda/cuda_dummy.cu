// --load-format dummy on the device: the generators of model/dummy_gen.h (the same inline functions
// the host runs, so the values are the same bits) writing BF16 / F32 / MXFP4 packed + scales, or the
// dequantised MXFP4 matrix as BF16, straight into device memory. A full-size model's weights never
// exist on the host. Launches are on the legacy default stream; the upload syncs after them.
#include <stdint.h>

#include "backend/cuda/cuda_common.cuh"
#include "model/dummy_gen.h"

namespace {

constexpr int kThreads = 256;

// Grid-stride loops: one launch covers any n (tensors of 10^10 elements), blocks capped.
unsigned grid_for(uint64_t n) {
    uint64_t b = (n + kThreads - 1) / kThreads;
    return (unsigned)(b < 65536 ? (b ? b : 1) : 65536);
}

__global__ void k_bf16(uint16_t *dst, lunar_dummy_gen g, uint64_t i0, uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = lunar_dummy_bf16(lunar_dummy_value(&g, i0 + i));
}

__global__ void k_f32(float *dst, lunar_dummy_gen g, uint64_t i0, uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = lunar_dummy_value(&g, i0 + i);
}

__global__ void k_packed(uint8_t *dst, lunar_dummy_gen g, uint64_t i0, uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = lunar_dummy_mxfp4_packed(&g, i0 + i);
}

__global__ void k_scale(uint8_t *dst, lunar_dummy_gen g, uint64_t i0, uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = lunar_dummy_mxfp4_scale(&g, i0 + i);
}

__global__ void k_mxfp4_bf16(uint16_t *dst, lunar_dummy_gen g, int64_t row0, uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        const int64_t r = row0 + (int64_t)(i / (uint64_t)g.in), c = (int64_t)(i % (uint64_t)g.in);
        dst[i] = lunar_dummy_bf16(lunar_dummy_mxfp4_value(&g, r, c));
    }
}

// Windows of a tensor (TP shards of lazy dummy tensors): element i of the window is element
// base + (i / cols) * ld + i % cols of the tensor.
__global__ void k_bf16_2d(uint16_t *dst, lunar_dummy_gen g, uint64_t base, uint64_t ld, uint64_t cols, uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = lunar_dummy_bf16(lunar_dummy_value(&g, base + i / cols * ld + i % cols));
}

__global__ void k_packed_2d(uint8_t *dst, lunar_dummy_gen g, uint64_t base, uint64_t ld, uint64_t cols, uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = lunar_dummy_mxfp4_packed(&g, base + i / cols * ld + i % cols);
}

__global__ void k_mxfp4_bf16_cols(uint16_t *dst, lunar_dummy_gen g, int64_t row0, int64_t col0, uint64_t cols,
                                  uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = lunar_dummy_bf16(lunar_dummy_mxfp4_value(&g, row0 + (int64_t)(i / cols), col0 + (int64_t)(i % cols)));
}

}  // namespace

extern "C" {

void lunar_cuda_dummy_bf16(uint16_t *dst, const lunar_dummy_gen *g, uint64_t i0, uint64_t n) {
    if (!n) return;
    k_bf16<<<grid_for(n), kThreads>>>(dst, *g, i0, n);
    CUDA_CHECK_LAUNCH();
}

void lunar_cuda_dummy_f32(float *dst, const lunar_dummy_gen *g, uint64_t i0, uint64_t n) {
    if (!n) return;
    k_f32<<<grid_for(n), kThreads>>>(dst, *g, i0, n);
    CUDA_CHECK_LAUNCH();
}

void lunar_cuda_dummy_mxfp4_packed(uint8_t *dst, const lunar_dummy_gen *g, uint64_t i0, uint64_t n) {
    if (!n) return;
    k_packed<<<grid_for(n), kThreads>>>(dst, *g, i0, n);
    CUDA_CHECK_LAUNCH();
}

void lunar_cuda_dummy_mxfp4_scale(uint8_t *dst, const lunar_dummy_gen *g, uint64_t i0, uint64_t n) {
    if (!n) return;
    k_scale<<<grid_for(n), kThreads>>>(dst, *g, i0, n);
    CUDA_CHECK_LAUNCH();
}

void lunar_cuda_dummy_mxfp4_bf16(uint16_t *dst, const lunar_dummy_gen *g, int64_t row0, int64_t rows) {
    const uint64_t n = (uint64_t)rows * (uint64_t)g->in;
    if (!n) return;
    k_mxfp4_bf16<<<grid_for(n), kThreads>>>(dst, *g, row0, n);
    CUDA_CHECK_LAUNCH();
}

void lunar_cuda_dummy_bf16_2d(uint16_t *dst, const lunar_dummy_gen *g, uint64_t base, uint64_t ld, uint64_t cols,
                              uint64_t n) {
    if (!n || !cols) return;
    k_bf16_2d<<<grid_for(n), kThreads>>>(dst, *g, base, ld, cols, n);
    CUDA_CHECK_LAUNCH();
}

void lunar_cuda_dummy_mxfp4_packed_2d(uint8_t *dst, const lunar_dummy_gen *g, uint64_t base, uint64_t ld,
                                      uint64_t cols, uint64_t n) {
    if (!n || !cols) return;
    k_packed_2d<<<grid_for(n), kThreads>>>(dst, *g, base, ld, cols, n);
    CUDA_CHECK_LAUNCH();
}

void lunar_cuda_dummy_mxfp4_bf16_cols(uint16_t *dst, const lunar_dummy_gen *g, int64_t row0, int64_t rows,
                                      int64_t col0, int64_t cols) {
    const uint64_t n = (uint64_t)rows * (uint64_t)cols;
    if (!n) return;
    k_mxfp4_bf16_cols<<<grid_for(n), kThreads>>>(dst, *g, row0, col0, (uint64_t)cols, n);
    CUDA_CHECK_LAUNCH();
}

}  // extern "C"
