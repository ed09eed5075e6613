// CUDA runtime: device selection, the one arena allocated at start-up, streams, events, graphs,
// and the cuBLASLt handle with its workspace.
#include <cublasLt.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

static struct {
    int ready, device;
    char *base;
    size_t size, used;
    cublasLtHandle_t lt;
    void *ws, *ws2; /* cuBLASLt workspaces: the legacy stream's, and one side stream's */
    size_t ws_bytes;
    char desc[512];
} rt;

cudaStream_t lunar_cuda_cur_stream = 0;
/* the stream decode steps are captured on: a blocking one, so that a stray launch on the legacy
 * stream during a capture is an error (cudaErrorStreamCaptureImplicit), not a silently eager op */
static cudaStream_t capture_stream;

static const size_t kAlign = 256;
static const size_t kGemmWorkspace = 64ull << 20;

extern "C" int lunar_cuda_init(int device, size_t arena_bytes, lunar_err *err) {
    if (rt.ready) {
        if (device == rt.device) return 0;
        return lunar_fail(err, "CUDA backend already initialised on device %d", rt.device);
    }
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
        return lunar_fail(err, "no CUDA device: %s",
                          e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    if (device < 0 || device >= n) return lunar_fail(err, "CUDA device %d of %d", device, n);
    if ((e = cudaSetDevice(device)) != cudaSuccess)
        return lunar_fail(err, "cudaSetDevice(%d): %s", device, cudaGetErrorString(e));
    size_t free_b = 0, total_b = 0;
    if ((e = cudaMemGetInfo(&free_b, &total_b)) != cudaSuccess)
        return lunar_fail(err, "cudaMemGetInfo: %s", cudaGetErrorString(e));
    if (arena_bytes == 0) arena_bytes = free_b > (2ull << 30) ? free_b - (1ull << 30) : free_b / 2;
    arena_bytes = (arena_bytes + kAlign - 1) / kAlign * kAlign;
    if (arena_bytes > free_b)
        return lunar_fail(err, "CUDA arena of %.2f GiB exceeds free device memory %.2f GiB",
                          arena_bytes / 1073741824.0, free_b / 1073741824.0);
    void *p = NULL;
    if ((e = cudaMalloc(&p, arena_bytes)) != cudaSuccess)
        return lunar_fail(err, "cudaMalloc(%zu): %s", arena_bytes, cudaGetErrorString(e));
    cublasLtHandle_t lt;
    if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) {
        cudaFree(p);
        return lunar_fail(err, "cublasLtCreate failed");
    }
    rt.base = (char *)p;
    rt.size = arena_bytes;
    rt.used = 0;
    rt.lt = lt;
    rt.device = device;
    rt.ready = 1;
    rt.ws_bytes = kGemmWorkspace;
    rt.ws = lunar_cuda_alloc(rt.ws_bytes);
    rt.ws2 = lunar_cuda_alloc(rt.ws_bytes);
    if (!rt.ws || !rt.ws2) {
        lunar_cuda_shutdown();
        return lunar_fail(err, "CUDA arena too small for the GEMM workspace");
    }
    cudaDeviceProp pr;
    CUDA_CHECK(cudaGetDeviceProperties(&pr, device));
    snprintf(rt.desc, sizeof rt.desc, "%.200s, sm_%d%d, %d SMs, L2 %d MiB, %.0f GiB (arena %.1f GiB)",
             pr.name, pr.major, pr.minor, pr.multiProcessorCount, pr.l2CacheSize >> 20,
             total_b / 1073741824.0, arena_bytes / 1073741824.0);
    return 0;
}

extern "C" int lunar_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes, lunar_err *err) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
        return lunar_fail(err, "no CUDA device: %s", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    if (device < 0 || device >= n) return lunar_fail(err, "CUDA device %d of %d", device, n);
    if (rt.ready && rt.device != device)
        return lunar_fail(err, "CUDA backend initialised on device %d, not %d", rt.device, device);
    if ((e = cudaSetDevice(device)) != cudaSuccess || (e = cudaMemGetInfo(free_bytes, total_bytes)) != cudaSuccess)
        return lunar_fail(err, "cudaMemGetInfo on device %d: %s", device, cudaGetErrorString(e));
    return 0;
}

extern "C" void lunar_cuda_shutdown(void) {
    if (!rt.ready) return;
    cudaDeviceSynchronize();
    if (capture_stream) cudaStreamDestroy(capture_stream);
    capture_stream = NULL;
    cublasLtDestroy(rt.lt);
    cudaFree(rt.base);
    memset(&rt, 0, sizeof rt);
}

extern "C" int lunar_cuda_ready(void) { return rt.ready; }

// launch_pdl (cuda_common.cuh) sets programmatic stream serialization unless LUNAR_CUDA_PDL=0 (on by
// default since the H200 run of session 4: graphs with it == eager without it bit for bit, the
// forward tests vs the CPU unchanged, Kimi-Linear-48B decode B=1 3.22 -> 3.01 ms)
static int pdl_state = -1;
extern "C" int lunar_cuda_pdl_on(void) {
    if (pdl_state < 0) pdl_state = !(getenv("LUNAR_CUDA_PDL") && strcmp(getenv("LUNAR_CUDA_PDL"), "0") == 0);
    return pdl_state;
}
extern "C" void lunar_cuda_pdl_set(int on) { pdl_state = on < 0 ? -1 : on != 0; }
// The weight prefetch before the PDL wait (cuda_common.cuh, issue 9): LUNAR_PDL_PREFETCH=0 (default)
// none, 1 the projections' weights (gemv, KDA gate projection, MLA (un)absorption), 2 also the MoE
// decode pair (gate/up: the shared expert's rows; down: the routed slice); read once. Off whenever
// PDL is (a kernel launched plainly starts after its predecessor anyway). Opt-in: on the H200
// (docs/benchmarks.md "Decode B = 1: weight prefetch under PDL") 32 KB per block was 4-5 % slower
// at Kimi-Linear-48B B = 1 / 8 and the K3.1 slice, 1-4 KB 1.3 % faster at Kimi-Linear B = 1 only.
static int pf_state = -1;
extern "C" int lunar_cuda_pdl_prefetch(void) {
    if (pf_state < 0) {
        const char *e = getenv("LUNAR_PDL_PREFETCH");
        pf_state = e && *e ? atoi(e) : 0;
        if (pf_state < 0 || pf_state > 2) pf_state = 0;
    }
    return lunar_cuda_pdl_on() ? pf_state : 0;
}
extern "C" void lunar_cuda_pdl_prefetch_set(int level) { pf_state = level < 0 ? -1 : level > 2 ? 2 : level; }
// the bound on one block's pre-wait prefetch: LUNAR_PDL_PREFETCH_KB (default 4, 1..1024), read once
extern "C" unsigned lunar_cuda_pdl_prefetch_bytes(int level) {
    static unsigned kb = 0;
    if (!kb) {
        const char *e = getenv("LUNAR_PDL_PREFETCH_KB");
        const int v = e && *e ? atoi(e) : 4;
        kb = v < 1 ? 1 : v > 1024 ? 1024 : (unsigned)v;
    }
    return lunar_cuda_pdl_prefetch() >= level ? kb * 1024u : 0u;
}
extern "C" const char *lunar_cuda_describe(void) { return rt.ready ? rt.desc : "not initialised"; }

extern "C" void *lunar_cuda_alloc(size_t bytes) {
    CUDA_REQUIRE(rt.ready);
    size_t b = (bytes + kAlign - 1) / kAlign * kAlign;
    if (b > rt.size - rt.used) return NULL;
    void *p = rt.base + rt.used;
    rt.used += b;
    return p;
}
extern "C" size_t lunar_cuda_mark(void) { return rt.used; }
extern "C" void lunar_cuda_release(size_t mark) {
    CUDA_REQUIRE(mark <= rt.used);
    rt.used = mark;
}
extern "C" size_t lunar_cuda_arena_used(void) { return rt.used; }
extern "C" size_t lunar_cuda_arena_size(void) { return rt.size; }

void *lunar_cuda_cublaslt_handle(void) { return (void *)rt.lt; }
void *lunar_cuda_gemm_workspace(size_t *bytes) {
    *bytes = rt.ws_bytes;
    return rt.ws;
}
void *lunar_cuda_gemm_workspace_side(size_t *bytes) {
    *bytes = rt.ws_bytes;
    return rt.ws2;
}

/* A host round trip inside a captured step would be baked into the graph as nothing (the copy
 * happens once, at capture) or fail the capture: a programming error, caught here by name. */
#define NOT_CAPTURING(what)                                                                      \
    do {                                                                                        \
        if (lunar_cuda_cur_stream) {                                                            \
            fprintf(stderr, "CUDA backend: %s inside a captured decode step (a host round trip " \
                            "the graph cannot replay)\n", what);                                 \
            abort();                                                                            \
        }                                                                                       \
    } while (0)

extern "C" void lunar_cuda_upload(void *dst, const void *src, size_t bytes) {
    NOT_CAPTURING("lunar_cuda_upload");
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
extern "C" void lunar_cuda_download(void *dst, const void *src, size_t bytes) {
    NOT_CAPTURING("lunar_cuda_download");
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

__global__ void fill_u32_kernel(uint32_t *p, uint32_t v, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = v;
}
extern "C" void lunar_cuda_fill_u32(void *dst, uint32_t value, size_t count) {
    NOT_CAPTURING("lunar_cuda_fill_u32 (it synchronises)");
    if (!count) return;
    unsigned blocks = ceil_div_u((long long)count, 256);
    if (blocks > 65536) blocks = 65536;
    fill_u32_kernel<<<blocks, 256>>>((uint32_t *)dst, value, count);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaDeviceSynchronize());
}
extern "C" void lunar_cuda_sync(void) {
    NOT_CAPTURING("lunar_cuda_sync");
    CUDA_CHECK(cudaDeviceSynchronize());
}

extern "C" void lunar_cuda_copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                                   size_t rows) {
    if (!width || !rows) return;
    CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDeviceToDevice,
                                 lunar_cuda_cur_stream));
}
extern "C" lunar_cuda_stream lunar_cuda_current_stream(void) { return (lunar_cuda_stream)lunar_cuda_cur_stream; }

extern "C" lunar_cuda_stream lunar_cuda_stream_create(void) {
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return (lunar_cuda_stream)s;
}
extern "C" void lunar_cuda_stream_destroy(lunar_cuda_stream s) {
    CUDA_CHECK(cudaStreamDestroy(to_stream(s)));
}
extern "C" void lunar_cuda_stream_sync(lunar_cuda_stream s) {
    CUDA_CHECK(cudaStreamSynchronize(to_stream(s)));
}
extern "C" lunar_cuda_event lunar_cuda_event_create(void) {
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreate(&e));
    return (lunar_cuda_event)e;
}
extern "C" void lunar_cuda_event_destroy(lunar_cuda_event e) {
    CUDA_CHECK(cudaEventDestroy((cudaEvent_t)e));
}
extern "C" void lunar_cuda_event_record(lunar_cuda_event e, lunar_cuda_stream s) {
    CUDA_CHECK(cudaEventRecord((cudaEvent_t)e, to_stream(s)));
}
extern "C" void lunar_cuda_stream_wait(lunar_cuda_stream s, lunar_cuda_event e) {
    CUDA_CHECK(cudaStreamWaitEvent(to_stream(s), (cudaEvent_t)e, 0));
}
extern "C" float lunar_cuda_event_ms(lunar_cuda_event a, lunar_cuda_event b) {
    CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, (cudaEvent_t)a, (cudaEvent_t)b));
    return ms;
}

extern "C" void lunar_cuda_graph_begin(lunar_cuda_stream s) {
    CUDA_REQUIRE(s != NULL);
    CUDA_CHECK(cudaStreamBeginCapture(to_stream(s), cudaStreamCaptureModeThreadLocal));
}
extern "C" lunar_cuda_graph lunar_cuda_graph_end(lunar_cuda_stream s) {
    cudaGraph_t g;
    CUDA_CHECK(cudaStreamEndCapture(to_stream(s), &g));
    cudaGraphExec_t x;
    CUDA_CHECK(cudaGraphInstantiate(&x, g, 0));
    CUDA_CHECK(cudaGraphDestroy(g));
    return (lunar_cuda_graph)x;
}
/* Decode-step capture: the NULL stream of every op becomes the capture stream until the end; the
 * side stream joins through its events (fork/join inside the capture). Errors are values here:
 * a capture the driver refused leaves *out NULL and the caller runs the step eagerly. */
extern "C" int lunar_cuda_capture_begin(lunar_err *err) {
    CUDA_REQUIRE(rt.ready && !lunar_cuda_cur_stream);
    cudaError_t e;
    if (!capture_stream && (e = cudaStreamCreate(&capture_stream)) != cudaSuccess)
        return lunar_fail(err, "cudaStreamCreate: %s", cudaGetErrorString(e));
    if ((e = cudaStreamBeginCapture(capture_stream, cudaStreamCaptureModeThreadLocal)) != cudaSuccess)
        return lunar_fail(err, "cudaStreamBeginCapture: %s", cudaGetErrorString(e));
    lunar_cuda_cur_stream = capture_stream;
    return 0;
}
extern "C" int lunar_cuda_capture_end(lunar_cuda_graph *out, size_t *nodes, lunar_err *err) {
    CUDA_REQUIRE(lunar_cuda_cur_stream == capture_stream && capture_stream);
    *out = NULL;
    lunar_cuda_cur_stream = 0;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(capture_stream, &g);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* the sticky-free capture error, not the device's */
        return lunar_fail(err, "cudaStreamEndCapture: %s", cudaGetErrorString(e));
    }
    size_t n = 0;
    if (nodes && cudaGraphGetNodes(g, NULL, &n) == cudaSuccess) *nodes = n;
    cudaGraphExec_t x;
    e = cudaGraphInstantiate(&x, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) return lunar_fail(err, "cudaGraphInstantiate: %s", cudaGetErrorString(e));
    *out = (lunar_cuda_graph)x;
    return 0;
}
extern "C" int lunar_cuda_capturing(void) { return lunar_cuda_cur_stream != 0; }

extern "C" void lunar_cuda_graph_launch(lunar_cuda_graph g, lunar_cuda_stream s) {
    CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)g, to_stream(s)));
}
extern "C" void lunar_cuda_graph_destroy(lunar_cuda_graph g) {
    CUDA_CHECK(cudaGraphExecDestroy((cudaGraphExec_t)g));
}

__device__ __forceinline__ uint32_t hash_u32(uint32_t x) {
    x ^= x >> 16, x *= 0x7feb352du, x ^= x >> 15, x *= 0x846ca68bu, x ^= x >> 16;
    return x;
}
__global__ void fill_uniform_kernel(float *p, size_t n, uint32_t seed, float lo, float hi) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = hash_u32((uint32_t)i ^ hash_u32(seed + (uint32_t)(i >> 32) * 0x9e3779b9u));
        p[i] = lo + (hi - lo) * ((h >> 8) * (1.0f / 16777216.0f));
    }
}
__global__ void sigmoid_kernel(float *p, size_t n) {
    pdl_enter();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = 1.0f / (1.0f + expf(-p[i]));
}
__global__ void to_bf16_kernel(__nv_bfloat16 *d, const float *s, size_t n) {
    pdl_enter();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        d[i] = __float2bfloat16_rn(s[i]);
}
// Eight elements a thread: two 16-byte loads, one 16-byte store (the scalar kernel above, one
// 4-byte load and a 2-byte store a thread, measured 82 us for an 8K x 2304 copy in the 8K prefill,
// ~1.1 TB/s). Each element rounds as there (__floats2bfloat162_rn is two __float2bfloat16_rn), so
// the copies are bit-identical; the n % 8 tail goes to the first threads of the grid.
__global__ void to_bf16x8_kernel(__nv_bfloat16 *d, const float *s, size_t n) {
    pdl_enter();
    const size_t n8 = n / 8, stride = (size_t)gridDim.x * blockDim.x;
    const size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (size_t i = t; i < n8; i += stride) {
        const float4 a = reinterpret_cast<const float4 *>(s)[2 * i];
        const float4 b = reinterpret_cast<const float4 *>(s)[2 * i + 1];
        __nv_bfloat162 p[4] = {__floats2bfloat162_rn(a.x, a.y), __floats2bfloat162_rn(a.z, a.w),
                               __floats2bfloat162_rn(b.x, b.y), __floats2bfloat162_rn(b.z, b.w)};
        reinterpret_cast<uint4 *>(d)[i] = *reinterpret_cast<const uint4 *>(p);
    }
    if (t < n - 8 * n8) d[8 * n8 + t] = __float2bfloat16_rn(s[8 * n8 + t]);
}
static unsigned grid_for(size_t n) {
    size_t b = (n + 255) / 256;
    return (unsigned)(b > 65536 ? 65536 : (b ? b : 1));
}
extern "C" void lunar_cuda_fill_uniform(float *p, size_t n, uint32_t seed, float lo, float hi) {
    fill_uniform_kernel<<<grid_for(n), 256, 0, to_stream(NULL)>>>(p, n, seed, lo, hi);
    CUDA_CHECK_LAUNCH();
}
extern "C" void lunar_cuda_sigmoid_inplace(float *p, size_t n) {
    launch_pdl(sigmoid_kernel, dim3(grid_for(n)), dim3(256), 0, to_stream(NULL), p, n);
    CUDA_CHECK_LAUNCH();
}
extern "C" void lunar_cuda_f32_to_bf16(uint16_t *dst, const float *src, size_t n) {
    lunar_cuda_f32_to_bf16_on(dst, src, n, NULL);
}
extern "C" void lunar_cuda_f32_to_bf16_on(uint16_t *dst, const float *src, size_t n, lunar_cuda_stream s) {
    // LUNAR_TO_BF16=scalar: the one-element kernel everywhere (the vector kernel's A/B switch)
    static int scalar = -1;
    if (scalar < 0) scalar = getenv("LUNAR_TO_BF16") && !strcmp(getenv("LUNAR_TO_BF16"), "scalar");
    if (!scalar && n >= 8 && (((uintptr_t)dst | (uintptr_t)src) & 15) == 0)
        launch_pdl(to_bf16x8_kernel, dim3(grid_for(n / 8)), dim3(256), 0, to_stream(s), (__nv_bfloat16 *)dst, src,
                   n);
    else
        launch_pdl(to_bf16_kernel, dim3(grid_for(n)), dim3(256), 0, to_stream(s), (__nv_bfloat16 *)dst, src, n);
    CUDA_CHECK_LAUNCH();
}
