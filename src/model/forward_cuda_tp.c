/* The collectives of the CUDA forward under tensor parallelism (see forward_cuda_tp.h). */
#include "model/forward_cuda_tp.h"

#include <stdlib.h>
#include <string.h>

#include "model/shard.h"
#include "parallel/comm.h"

#ifdef LUNAR_HAVE_CUDA
static void failed(lunar_tp *tp, const lunar_err *e) {
    if (tp->failed) return; /* the first failure explains the step */
    tp->failed = 1;
    tp->err = *e;
}
#endif

int lunar_cuda_tp_check(const lunar_model *m, lunar_err *err) {
    const lunar_tp *tp = m->tp;
    if (!tp || tp->dcp_size <= 1) return 0;
    /* any DCP size dividing TP: the DCP comm is the TP comm or its split (lunar_dcp_comm) */
    for (int j = 0; j < tp->dcp_size; j++)
        if (tp->dcp_heads[j] == 0) /* such a rank skips its MLA layers on the device, yet holds rows */
            return lunar_fail(err, "--decode-context-parallel-size %d with --backend cuda: every rank needs an "
                                   "MLA head (the model has %d per rank at most)", tp->dcp_size, tp->mla_heads_max);
    return 0;
}

void lunar_tp_vocab_slice(int64_t V, int64_t C, int r, int64_t *v0, int64_t *vn) {
    *v0 = (int64_t)r * C < V ? (int64_t)r * C : V;
    *vn = (*v0 + C < V ? *v0 + C : V) - *v0;
}

int lunar_cuda_tp_status(const lunar_model *m, lunar_err *err) {
    if (!m->tp) return 0;
    lunar_tp *tp = m->tp;
#ifdef LUNAR_HAVE_CUDA
    lunar_err e;
    /* a collective that failed while running (the enqueue succeeded): once per step, after the wait */
    if (!tp->failed && tp->size > 1 && lunar_comm_nccl_check(tp->comm, &e)) failed(tp, &e);
    /* a DCP group smaller than TP has its own comm (lunar_dcp_comm), with its own error state */
    if (!tp->failed && tp->dcp && tp->dcp != tp->comm && lunar_comm_nccl_check(tp->dcp, &e)) failed(tp, &e);
#endif
    if (!tp->failed) return 0;
    tp->failed = 0;
    return lunar_fail(err, "tensor-parallel rank %d: %s", tp->rank, tp->err.msg);
}

#ifndef LUNAR_HAVE_CUDA

int lunar_cuda_rank_init(int device, double util, lunar_err *err) {
    (void)device, (void)util;
    return lunar_fail(err, "lunar was built without CUDA");
}

void lunar_cuda_tp_all_reduce(const lunar_model *m, float *x, size_t n) { (void)m, (void)x, (void)n; }
void lunar_cuda_tp_embedding(const lunar_model *m, float *x, const uint16_t *embed, const int32_t *ids, int T) {
    (void)m, (void)x, (void)embed, (void)ids, (void)T;
}
float *lunar_cuda_tp_lm_head(const lunar_model *m, float *lg, int rows) {
    (void)m, (void)rows;
    return lg;
}
void lunar_cuda_tp_latent_cols(const lunar_model *m, float *dst, const float *y, int n, int Lat) {
    (void)m, (void)dst, (void)y, (void)n, (void)Lat;
}
void lunar_cuda_dcp_mla(const lunar_model *m, const lunar_cuda_dcp_layer *a, float *o) { (void)m, (void)a, (void)o; }

#else

#include "backend/cuda/cuda_ops.h"

int lunar_cuda_rank_init(int device, double util, lunar_err *err) {
    size_t free_b = 0, total_b = 0;
    if (lunar_cuda_mem_info(device, &free_b, &total_b, err)) return -1;
    size_t want = (size_t)(util * (double)total_b);
    const size_t headroom = (size_t)1 << 30; /* the driver, cuBLASLt and NCCL's own buffers */
    if (want + headroom > free_b) want = free_b > headroom ? free_b - headroom : 0;
    if (want < ((size_t)256 << 20))
        return lunar_fail(err, "CUDA: only %.2f GiB of %.2f GiB free on device %d", free_b / 1073741824.0,
                          total_b / 1073741824.0, device);
    return lunar_cuda_init(device, want, err);
}

void lunar_cuda_tp_all_reduce(const lunar_model *m, float *x, size_t n) {
    lunar_tp *tp = m->tp;
    if (tp->size == 1 || tp->failed) return; /* after a failure the ranks are out of step: stop talking */
    lunar_err e;
    if (lunar_comm_nccl_all_reduce_on(tp->comm, x, n, lunar_cuda_current_stream(), &e)) failed(tp, &e);
}

void lunar_cuda_tp_embedding(const lunar_model *m, float *x, const uint16_t *embed, const int32_t *ids, int T) {
    const lunar_tp *tp = m->tp;
    lunar_cuda_embedding_range(x, embed, ids, T, m->cfg.hidden_size, tp->vocab0, tp->vocab_n, NULL);
    lunar_cuda_tp_all_reduce(m, x, (size_t)T * m->cfg.hidden_size);
}

float *lunar_cuda_tp_lm_head(const lunar_model *m, float *lg, int rows) {
    lunar_tp *tp = m->tp;
    const int64_t V = m->cfg.vocab_size, C = tp->vocab_chunk;
    const size_t part = (size_t)rows * C; /* rank r's rows * vocab_n_r floats, packed, then padding */
    float *all = lg, *full = lunar_cuda_alloc((size_t)rows * V * sizeof(float));
    LUNAR_ASSERT(full);
    if (tp->size > 1) {
        all = lunar_cuda_alloc(part * tp->size * sizeof(float));
        LUNAR_ASSERT(all);
        lunar_err e;
        if (!tp->failed &&
            lunar_comm_nccl_all_gather_on(tp->comm, lg, all, part, lunar_cuda_current_stream(), &e))
            failed(tp, &e);
    }
    for (int r = 0; r < tp->size; r++) { /* rank r's [rows, vn] block into columns [v0, v0 + vn) */
        int64_t v0, vn;
        lunar_tp_vocab_slice(V, C, r, &v0, &vn);
        lunar_cuda_copy_2d(full + v0, (size_t)V * sizeof(float), all + (size_t)r * part, (size_t)vn * sizeof(float),
                           (size_t)vn * sizeof(float), (size_t)rows);
    }
    return full;
}

void lunar_cuda_tp_latent_cols(const lunar_model *m, float *dst, const float *y, int n, int Lat) {
    const lunar_tp *tp = m->tp;
    lunar_cuda_copy_2d(dst, (size_t)tp->lat_n * sizeof(float), y + tp->lat0, (size_t)Lat * sizeof(float),
                       (size_t)tp->lat_n * sizeof(float), (size_t)n);
}

#endif
