/* kernel_trace: a CUPTI injection library that records when every kernel ran, as it ran.
 *
 * Why: ncu times each kernel alone (application replay, no PDL overlap, no side stream), so its sum
 * is not where a graphed decode step's time goes; nsys is not on the device image. CUPTI's
 * concurrent-kernel activity reports each kernel's start and end from the GPU's own clock, kernels
 * replayed inside a CUDA graph included, overlapped as they ran (a PDL successor's blocks starting
 * before its predecessor ended, the side stream beside the main one).
 *
 * Use: the CUDA driver loads a library named by CUDA_INJECTION64_PATH and calls its
 * InitializeInjection at cuInit; nothing in lunar changes.
 *   CUDA_INJECTION64_PATH=$P/lib/libkernel_trace.so KERNEL_TRACE_OUT=trace.csv lunar bench ...
 * Writes one CSV line a kernel (times in ns of the GPU clock, the name mangled):
 *   start,end,stream,graph_id,graph_node,correlation,grid,block,name
 * tools/device/timeline.py reads it. A tool of the device scripts, not of lunar: built by
 * tools/device/prebuild.sh against the toolkit's CUPTI (carried with it). */
#include <cupti.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define BUF_BYTES (8u << 20)
#define BUF_ALIGN 8

static FILE *out;
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long n_kernels, n_dropped;

static void check(CUptiResult r, const char *what) {
    if (r == CUPTI_SUCCESS) return;
    const char *msg = "?";
    cuptiGetResultString(r, &msg);
    fprintf(stderr, "kernel_trace: %s: %s\n", what, msg);
}

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records) {
    *buf = aligned_alloc(BUF_ALIGN, BUF_BYTES);
    *size = *buf ? BUF_BYTES : 0;
    *max_records = 0; /* as many as fit */
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *rec = NULL;
    pthread_mutex_lock(&out_lock);
    while (out && cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
        fprintf(out, "%llu,%llu,%u,%u,%llu,%u,%dx%dx%d,%dx%dx%d,%s\n", (unsigned long long)k->start,
                (unsigned long long)k->end, k->streamId, k->graphId, (unsigned long long)k->graphNodeId,
                k->correlationId, k->gridX, k->gridY, k->gridZ, k->blockX, k->blockY, k->blockZ,
                k->name ? k->name : "?");
        n_kernels++;
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS) n_dropped += dropped;
    pthread_mutex_unlock(&out_lock);
    free(buf);
}

/* a context's records are flushed before it goes (the runtime's own teardown runs before this
 * library's atexit handler) */
static void CUPTIAPI on_callback(void *user, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void *data) {
    (void)user, (void)data;
    if (domain == CUPTI_CB_DOMAIN_RESOURCE && id == CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING)
        cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
}

static void at_exit(void) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    pthread_mutex_lock(&out_lock);
    if (out) {
        fclose(out);
        out = NULL;
        fprintf(stderr, "kernel_trace: %llu kernels written, %llu records dropped\n", n_kernels, n_dropped);
    }
    pthread_mutex_unlock(&out_lock);
}

int InitializeInjection(void);
int InitializeInjection(void) {
    const char *path = getenv("KERNEL_TRACE_OUT");
    if (!path || !*path) {
        fprintf(stderr, "kernel_trace: KERNEL_TRACE_OUT is not set: nothing traced\n");
        return 1;
    }
    out = fopen(path, "w");
    if (!out) {
        fprintf(stderr, "kernel_trace: cannot write %s\n", path);
        return 1;
    }
    CUpti_SubscriberHandle sub;
    check(cuptiSubscribe(&sub, on_callback, NULL), "cuptiSubscribe");
    check(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING),
          "cuptiEnableCallback");
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    /* concurrent, not serialised: the trace must show the overlap it is for */
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
    atexit(at_exit);
    return 1;
}
