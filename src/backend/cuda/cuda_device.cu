// CUDA device discovery. Compiled only when nvcc is present at build time.
#include <cuda_runtime.h>
#include <stdio.h>

extern "C" int lunar_cuda_device_count(char *desc, int desc_cap) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(desc, (size_t)desc_cap, "%s", cudaGetErrorString(e));
        return 0;
    }
    if (n == 0) {
        snprintf(desc, (size_t)desc_cap, "no CUDA device");
        return 0;
    }
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) {
        snprintf(desc, (size_t)desc_cap, "device 0 properties unavailable");
        return n;
    }
    snprintf(desc, (size_t)desc_cap, "%d x %s (sm_%d%d, %.0f GiB)", n, p.name, p.major, p.minor,
             (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    return n;
}
