/* NCCL collectives with world size 1 on one GPU (the device machine; skipped without a device or
 * without NCCL): the unique id, the rendezvous of a one-rank world, the comm on device 0, and
 * all-reduce / all-gather / all-to-all / barrier on device buffers (with one rank each is the
 * identity, so the exact input must come back), plus init errors returned as values; and the DCP
 * sub-communicator (ncclCommSplit, lunar_comm_split / lunar_dcp_comm) at world size 1: a comm of its
 * own with its own collectives, freed before its parent (which then still works).
 * Several GPUs are exercised by `lunar bench-comm --tensor-parallel-size N`, which checks sums. */
#include <stdint.h>
#include <string.h>

#include "parallel/comm.h"
#include "test.h"

#if !defined(LUNAR_HAVE_CUDA) || !defined(LUNAR_HAVE_NCCL)

TEST(nccl_skipped) { fprintf(stderr, "[skipped: lunar was built without CUDA and NCCL] "); }

#else

#include "backend/backend.h"
#include "backend/cuda/cuda_ops.h"

static int device_on(void) {
    char desc[256];
    lunar_err err;
    if (lunar_cuda_device_count(desc, sizeof desc) <= 0) {
        fprintf(stderr, "[skipped: no CUDA device: %s] ", desc);
        return 0;
    }
    if (lunar_cuda_init(0, (size_t)1 << 30, &err)) {
        fprintf(stderr, "[skipped: no CUDA device: %s] ", err.msg);
        return 0;
    }
    return 1;
}

TEST(nccl_world_size_1) {
    if (!device_on()) return;
    lunar_err err;
    unsigned char id[LUNAR_NCCL_ID_BYTES];
    CHECK(lunar_nccl_available());
    CHECK_MSG(lunar_nccl_get_unique_id(id, &err) == 0, "%s", err.msg);
    CHECK_MSG(lunar_rendezvous("127.0.0.1", 0, 0, 1, id, sizeof id, 1000, &err) == 0, "%s", err.msg);
    lunar_comm *c = NULL;
    if (lunar_comm_nccl_init(&c, id, 0, 1, 0, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    CHECK(c->rank == 0 && c->size == 1);
    enum { N = 10007 }; /* odd: no size happens to be a multiple of anything */
    float *host = lunar_xmalloc(N * sizeof(float)), *back = lunar_xmalloc(N * sizeof(float));
    lunar_test_fill(host, N, 7, -3, 3);
    const size_t mark = lunar_cuda_mark();
    float *a = lunar_cuda_alloc(N * sizeof(float)), *b = lunar_cuda_alloc(N * sizeof(float));
    lunar_cuda_upload(a, host, N * sizeof(float));
    CHECK_MSG(lunar_all_reduce_sum(c, a, N, &err) == 0, "%s", err.msg);
    lunar_cuda_download(back, a, N * sizeof(float));
    CHECK(memcmp(back, host, N * sizeof(float)) == 0);
    lunar_cuda_fill_u32(b, 0x7fc00000u, N); /* NaN: the gather must overwrite all of it */
    CHECK_MSG(lunar_all_gather(c, a, b, N, &err) == 0, "%s", err.msg);
    lunar_cuda_download(back, b, N * sizeof(float));
    CHECK(memcmp(back, host, N * sizeof(float)) == 0);
    lunar_cuda_fill_u32(b, 0x7fc00000u, N);
    CHECK_MSG(lunar_all_to_all(c, a, b, N, &err) == 0, "%s", err.msg);
    lunar_cuda_download(back, b, N * sizeof(float));
    CHECK(memcmp(back, host, N * sizeof(float)) == 0);
    CHECK_MSG(lunar_barrier(c, &err) == 0, "%s", err.msg);
    /* DCP 1 makes no comm; a split of one rank is a new comm whose gather and stream-ordered calls work */
    lunar_comm *d = (lunar_comm *)1, *s = NULL;
    CHECK(lunar_dcp_comm(c, 1, &d, &err) == 0 && d == NULL);
    CHECK_MSG(lunar_comm_split(c, 0, 0, &s, &err) == 0 && s, "%s", err.msg);
    if (s) {
        CHECK(s != c && s->rank == 0 && s->size == 1);
        lunar_cuda_fill_u32(b, 0x7fc00000u, N);
        CHECK_MSG(lunar_all_gather(s, a, b, N, &err) == 0, "%s", err.msg);
        lunar_cuda_download(back, b, N * sizeof(float));
        CHECK(memcmp(back, host, N * sizeof(float)) == 0);
        lunar_cuda_fill_u32(b, 0x7fc00000u, N);
        CHECK_MSG(lunar_comm_nccl_all_gather_on(s, a, b, N, NULL, &err) == 0, "%s", err.msg);
        lunar_cuda_sync();
        lunar_cuda_download(back, b, N * sizeof(float));
        CHECK(memcmp(back, host, N * sizeof(float)) == 0);
        CHECK_MSG(lunar_comm_nccl_check(s, &err) == 0, "%s", err.msg);
        lunar_comm_free(s); /* before its parent, which still works */
        CHECK_MSG(lunar_all_reduce_sum(c, a, N, &err) == 0, "%s", err.msg);
    }
    lunar_comm_free(c);
    lunar_cuda_release(mark);
    /* a rank outside its world is an error value, not a crash */
    CHECK(lunar_comm_nccl_init(&c, id, 1, 1, 0, &err) == -1 && c == NULL);
    free(host), free(back);
}

#endif
