/* The collectives of the CUDA forward under tensor parallelism (see forward_cuda_tp.h). */
#include "model/forward_cuda_tp.h"

#include <string.h>

#include "model/shard.h"

int lunar_cuda_tp_check(const lunar_model *m, lunar_err *err) {
    if (m->tp && m->tp->dcp_size > 1)
        return lunar_fail(err, "--decode-context-parallel-size runs on the CPU backend only for now");
    return 0;
}

int lunar_cuda_tp_status(const lunar_model *m, lunar_err *err) {
    if (!m->tp || !m->tp->failed) return 0;
    m->tp->failed = 0;
    return lunar_fail(err, "tensor-parallel rank %d: %s", m->tp->rank, m->tp->err.msg);
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
void lunar_cuda_tp_lm_head(const lunar_model *m, float *logits, float *lg, int rows) {
    (void)m, (void)logits, (void)lg, (void)rows;
}
void lunar_cuda_tp_latent_cols(const lunar_model *m, float *dst, const float *y, int n, int Lat) {
    (void)m, (void)dst, (void)y, (void)n, (void)Lat;
}

#else

#include "backend/cuda/cuda_glue.h"
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

static void failed(lunar_tp *tp, const lunar_err *e) {
    if (tp->failed) return; /* the first failure explains the step */
    tp->failed = 1;
    tp->err = *e;
}

void lunar_cuda_tp_all_reduce(const lunar_model *m, float *x, size_t n) {
    lunar_tp *tp = m->tp;
    if (tp->size == 1 || tp->failed) return; /* after a failure the ranks are out of step: stop talking */
    lunar_err e;
    lunar_cuda_sync(); /* the comm's own stream must see the forward's writes */
    if (lunar_all_reduce_sum(tp->comm, x, n, &e)) failed(tp, &e);
}

void lunar_cuda_tp_embedding(const lunar_model *m, float *x, const uint16_t *embed, const int32_t *ids, int T) {
    const lunar_tp *tp = m->tp;
    const int D = m->cfg.hidden_size;
    int32_t *loc = lunar_xmalloc(((size_t)T + 1) * sizeof *loc), *tok = lunar_xmalloc(((size_t)T + 1) * sizeof *tok);
    float *one = lunar_xmalloc(((size_t)T + 1) * sizeof *one);
    int k = 0;
    for (int t = 0; t < T; t++) {
        const int64_t r = ids[t] - tp->vocab0;
        if (r >= 0 && r < tp->vocab_n) loc[k] = (int32_t)r, tok[k] = t, one[k] = 1.0f, k++;
    }
    lunar_cuda_fill_u32(x, 0, (size_t)T * D);
    if (k) { /* this rank's rows, scattered with weight 1 onto zeros: the looked-up values exactly */
        const size_t mk = lunar_cuda_mark();
        int32_t *dloc = lunar_cuda_alloc((size_t)k * 4), *dtok = lunar_cuda_alloc((size_t)k * 4);
        float *dw = lunar_cuda_alloc((size_t)k * 4), *e = lunar_cuda_alloc((size_t)k * D * 4);
        LUNAR_ASSERT(dloc && dtok && dw && e);
        lunar_cuda_upload(dloc, loc, (size_t)k * 4);
        lunar_cuda_upload(dtok, tok, (size_t)k * 4);
        lunar_cuda_upload(dw, one, (size_t)k * 4);
        lunar_cuda_embedding(e, LUNAR_CUDA_F32, embed, dloc, k, D, NULL);
        lunar_glue_scatter_add(x, e, dtok, dw, k, D, NULL);
        lunar_cuda_sync(); /* the host tables go below */
        lunar_cuda_release(mk);
    }
    free(loc), free(tok), free(one);
    lunar_cuda_tp_all_reduce(m, x, (size_t)T * D);
}

void lunar_cuda_tp_lm_head(const lunar_model *m, float *logits, float *lg, int rows) {
    lunar_tp *tp = m->tp;
    const int64_t V = m->cfg.vocab_size, C = tp->vocab_chunk;
    const size_t part = (size_t)rows * C; /* rank r's rows * vocab_n_r floats, packed, then padding */
    const size_t mk = lunar_cuda_mark();
    float *all = lunar_cuda_alloc(part * tp->size * sizeof(float));
    LUNAR_ASSERT(all);
    lunar_err e;
    lunar_cuda_sync();
    if (!tp->failed && lunar_all_gather(tp->comm, lg, all, part, &e)) failed(tp, &e);
    if (!tp->failed) {
        float *h = lunar_xmalloc(part * tp->size * sizeof(float));
        lunar_cuda_download(h, all, part * tp->size * sizeof(float));
        for (int r = 0; r < tp->size; r++) { /* rank r's slice: [r*C, min(V, (r+1)*C)) */
            const int64_t v0 = r * C < V ? r * C : V, vn = (v0 + C < V ? v0 + C : V) - v0;
            const float *src = h + (size_t)r * part;
            for (int i = 0; i < rows; i++)
                memcpy(logits + (size_t)i * V + v0, src + (size_t)i * vn, (size_t)vn * sizeof(float));
        }
        free(h);
    }
    lunar_cuda_release(mk);
}

void lunar_cuda_tp_latent_cols(const lunar_model *m, float *dst, const float *y, int n, int Lat) {
    const lunar_tp *tp = m->tp;
    /* a strided column copy through the host: the latent is small ([n, Lat]) and this keeps the
     * device code free of a kernel only TP needs */
    float *h = lunar_xmalloc(((size_t)n * Lat + 1) * sizeof(float));
    float *s = lunar_xmalloc(((size_t)n * tp->lat_n + 1) * sizeof(float));
    lunar_cuda_download(h, y, (size_t)n * Lat * sizeof(float));
    for (int t = 0; t < n; t++)
        memcpy(s + (size_t)t * tp->lat_n, h + (size_t)t * Lat + tp->lat0, (size_t)tp->lat_n * sizeof(float));
    lunar_cuda_upload(dst, s, (size_t)n * tp->lat_n * sizeof(float));
    lunar_cuda_sync();
    free(h), free(s);
}

#endif
