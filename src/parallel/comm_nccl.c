/* The NCCL transport of parallel/comm.h: one rank per process and GPU. Buffers are device pointers;
 * each vtable collective is enqueued on the comm's own stream and waited for, so a caller sees the
 * same synchronous contract as the CPU transport; the GPU forward uses the stream-ordered _on calls
 * instead (no host wait: they order against the forward's stream through events). All-to-all is the grouped send/recv pattern NCCL documents for
 * it. Built only with CUDA and nccl.h (LUNAR_HAVE_NCCL); otherwise every entry point says so. */
#include "parallel/comm.h"

#include <string.h>

#ifdef LUNAR_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

typedef struct nccl_impl {
    ncclComm_t comm;
    cudaStream_t stream;
    float *one; /* a device float for the barrier */
    /* the stream-ordered calls: `in` marks the caller's stream before the collective (the comm's
     * stream waits for it), `out` the comm's stream after it (the caller's stream waits for that) */
    cudaEvent_t in, out;
} nccl_impl;

static nccl_impl *impl_of(lunar_comm *c) { return c->impl; }

#define NCCL_OK(call, what)                                                                    \
    do {                                                                                       \
        ncclResult_t r_ = (call);                                                              \
        if (r_ != ncclSuccess) return lunar_fail(err, "NCCL %s: %s", what, ncclGetErrorString(r_)); \
    } while (0)

static int finish(nccl_impl *p, const char *what, lunar_err *err) {
    cudaError_t e = cudaStreamSynchronize(p->stream);
    if (e != cudaSuccess) return lunar_fail(err, "NCCL %s: %s", what, cudaGetErrorString(e));
    return 0;
}

static int nccl_all_reduce(lunar_comm *c, float *buf, size_t n, lunar_err *err) {
    nccl_impl *p = impl_of(c);
    NCCL_OK(ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, p->comm, p->stream), "all-reduce");
    return finish(p, "all-reduce", err);
}

static int nccl_all_gather(lunar_comm *c, const float *send, float *recv, size_t n, lunar_err *err) {
    nccl_impl *p = impl_of(c);
    NCCL_OK(ncclAllGather(send, recv, n, ncclFloat32, p->comm, p->stream), "all-gather");
    return finish(p, "all-gather", err);
}

static int nccl_all_to_all(lunar_comm *c, const float *send, float *recv, size_t n, lunar_err *err) {
    nccl_impl *p = impl_of(c);
    NCCL_OK(ncclGroupStart(), "all-to-all");
    for (int r = 0; r < c->size; r++) {
        NCCL_OK(ncclSend(send + (size_t)r * n, n, ncclFloat32, r, p->comm, p->stream), "all-to-all send");
        NCCL_OK(ncclRecv(recv + (size_t)r * n, n, ncclFloat32, r, p->comm, p->stream), "all-to-all recv");
    }
    NCCL_OK(ncclGroupEnd(), "all-to-all");
    return finish(p, "all-to-all", err);
}

static int nccl_barrier(lunar_comm *c, lunar_err *err) {
    nccl_impl *p = impl_of(c);
    NCCL_OK(ncclAllReduce(p->one, p->one, 1, ncclFloat32, ncclSum, p->comm, p->stream), "barrier");
    return finish(p, "barrier", err);
}

static const lunar_comm_vt nccl_vt;
static int comm_wrap(lunar_comm **out, ncclComm_t comm, int rank, int size, lunar_err *err);

/* ncclCommSplit (NCCL >= 2.18): collective over c; a new comm of c's device with its own stream,
 * events and buffers. The key orders the ranks of a color (NCCL breaks ties by the rank in c). */
static int nccl_split(lunar_comm *c, int color, int key, lunar_comm **out, lunar_err *err) {
    *out = NULL;
    ncclComm_t sub = NULL;
    NCCL_OK(ncclCommSplit(impl_of(c)->comm, color, key, &sub, NULL), "split");
    if (!sub) return lunar_fail(err, "NCCL split: rank %d got no comm for color %d", c->rank, color);
    int rank = 0, size = 0;
    ncclResult_t r = ncclCommUserRank(sub, &rank);
    if (r == ncclSuccess) r = ncclCommCount(sub, &size);
    if (r != ncclSuccess) {
        ncclCommDestroy(sub);
        return lunar_fail(err, "NCCL split: %s", ncclGetErrorString(r));
    }
    return comm_wrap(out, sub, rank, size, err);
}

static void nccl_destroy(lunar_comm *c) {
    nccl_impl *p = impl_of(c);
    ncclCommDestroy(p->comm);
    if (p->in) cudaEventDestroy(p->in);
    if (p->out) cudaEventDestroy(p->out);
    cudaFree(p->one);
    cudaStreamDestroy(p->stream);
    free(p);
    free(c);
}

static const lunar_comm_vt nccl_vt = {nccl_all_reduce, nccl_all_gather, nccl_all_to_all, nccl_barrier,
                                      nccl_split, nccl_destroy};

int lunar_nccl_available(void) { return 1; }

#define CUDA_OK(call, what)                                                                        \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) return lunar_fail(err, "NCCL %s: %s", what, cudaGetErrorString(e_)); \
    } while (0)

/* The comm's stream joins the caller's (fork), or the caller's joins the comm's (join). Events
 * rather than handing NCCL the caller's stream: that stream is the legacy default stream outside a
 * capture, which NCCL versions treat unevenly; the fork/join costs two event records. */
static int fork_from(lunar_comm *c, cudaStream_t s, const char *what, nccl_impl **pp, lunar_err *err) {
    if (c->vt != &nccl_vt) return lunar_fail(err, "%s: not an NCCL comm", what);
    nccl_impl *p = *pp = impl_of(c);
    CUDA_OK(cudaEventRecord(p->in, s), what);
    CUDA_OK(cudaStreamWaitEvent(p->stream, p->in, 0), what);
    return 0;
}
static int join_into(nccl_impl *p, cudaStream_t s, const char *what, lunar_err *err) {
    CUDA_OK(cudaEventRecord(p->out, p->stream), what);
    CUDA_OK(cudaStreamWaitEvent(s, p->out, 0), what);
    return 0;
}

int lunar_comm_nccl_all_reduce_on(lunar_comm *c, float *buf, size_t n, void *stream, lunar_err *err) {
    nccl_impl *p;
    if (fork_from(c, (cudaStream_t)stream, "all-reduce", &p, err)) return -1;
    NCCL_OK(ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, p->comm, p->stream), "all-reduce");
    return join_into(p, (cudaStream_t)stream, "all-reduce", err);
}

int lunar_comm_nccl_all_gather_on(lunar_comm *c, const float *send, float *recv, size_t n, void *stream,
                                  lunar_err *err) {
    nccl_impl *p;
    if (fork_from(c, (cudaStream_t)stream, "all-gather", &p, err)) return -1;
    NCCL_OK(ncclAllGather(send, recv, n, ncclFloat32, p->comm, p->stream), "all-gather");
    return join_into(p, (cudaStream_t)stream, "all-gather", err);
}

int lunar_comm_nccl_check(lunar_comm *c, lunar_err *err) {
    if (c->vt != &nccl_vt) return lunar_fail(err, "NCCL check: not an NCCL comm");
    ncclResult_t a = ncclSuccess;
    NCCL_OK(ncclCommGetAsyncError(impl_of(c)->comm, &a), "async error query");
    if (a != ncclSuccess) return lunar_fail(err, "NCCL: %s", ncclGetErrorString(a));
    return 0;
}

int lunar_nccl_get_unique_id(void *id, lunar_err *err) {
    _Static_assert(sizeof(ncclUniqueId) == LUNAR_NCCL_ID_BYTES, "NCCL unique id size");
    ncclUniqueId u;
    NCCL_OK(ncclGetUniqueId(&u), "get unique id");
    memcpy(id, &u, sizeof u);
    return 0;
}

/* The comm's own stream, its two events and the barrier's float on the current device, around an
 * initialised NCCL comm (destroyed on failure). */
static int comm_wrap(lunar_comm **out, ncclComm_t comm, int rank, int size, lunar_err *err) {
    cudaError_t e;
    nccl_impl *p = lunar_xcalloc(1, sizeof *p);
    p->comm = comm;
    if ((e = cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&p->in, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&p->out, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaMalloc((void **)&p->one, sizeof(float))) != cudaSuccess ||
        (e = cudaMemset(p->one, 0, sizeof(float))) != cudaSuccess) {
        if (p->one) cudaFree(p->one);
        if (p->stream) cudaStreamDestroy(p->stream);
        if (p->in) cudaEventDestroy(p->in);
        if (p->out) cudaEventDestroy(p->out);
        ncclCommDestroy(comm);
        free(p);
        return lunar_fail(err, "NCCL rank %d: %s", rank, cudaGetErrorString(e));
    }
    lunar_comm *c = lunar_xcalloc(1, sizeof *c);
    c->rank = rank;
    c->size = size;
    c->vt = &nccl_vt;
    c->impl = p;
    *out = c;
    return 0;
}

int lunar_comm_nccl_init(lunar_comm **out, const void *id, int rank, int size, int device,
                         lunar_err *err) {
    *out = NULL;
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return lunar_fail(err, "NCCL rank %d: cuda device %d: %s", rank, device, cudaGetErrorString(e));
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclCommInitRank(&comm, size, u, rank);
    if (r != ncclSuccess) return lunar_fail(err, "NCCL rank %d of %d: init: %s", rank, size, ncclGetErrorString(r));
    return comm_wrap(out, comm, rank, size, err);
}

#else /* built without NCCL */

int lunar_comm_nccl_all_reduce_on(lunar_comm *c, float *buf, size_t n, void *stream, lunar_err *err) {
    (void)c, (void)buf, (void)n, (void)stream;
    return lunar_fail(err, "this lunar was built without NCCL (needs CUDA and nccl.h)");
}
int lunar_comm_nccl_all_gather_on(lunar_comm *c, const float *send, float *recv, size_t n, void *stream,
                                  lunar_err *err) {
    (void)c, (void)send, (void)recv, (void)n, (void)stream;
    return lunar_fail(err, "this lunar was built without NCCL (needs CUDA and nccl.h)");
}
int lunar_comm_nccl_check(lunar_comm *c, lunar_err *err) {
    (void)c;
    return lunar_fail(err, "this lunar was built without NCCL (needs CUDA and nccl.h)");
}

int lunar_nccl_available(void) { return 0; }

int lunar_nccl_get_unique_id(void *id, lunar_err *err) {
    (void)id;
    return lunar_fail(err, "this lunar was built without NCCL (needs CUDA and nccl.h)");
}

int lunar_comm_nccl_init(lunar_comm **out, const void *id, int rank, int size, int device,
                         lunar_err *err) {
    (void)id, (void)rank, (void)size, (void)device;
    *out = NULL;
    return lunar_fail(err, "this lunar was built without NCCL (needs CUDA and nccl.h)");
}

#endif
