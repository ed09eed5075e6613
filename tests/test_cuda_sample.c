/* lunar_cuda_sample (src/backend/cuda/cuda_sample.cu) against engine/sampler.c's lunar_sample on
 * random rows (ties planted, a flat row, two vocabulary sizes) under greedy, temperature, top-k,
 * top-p and both: greedy must be the CPU's token exactly; a stochastic draw must lie in the set the
 * CPU allows (its top-k, then its top-p prefix, by the CPU's own ranking), repeat itself for the same
 * draw u (the request's seed), and agree with the CPU's choice on >= 97 % of rows (the masses are
 * summed in another order, so a u within rounding of a boundary may pick the neighbour). Skipped
 * without a CUDA device. */
#include "test.h"

#ifndef LUNAR_HAVE_CUDA

TEST(cuda_sample_skipped) { fprintf(stderr, "[skipped: no CUDA device: lunar was built without CUDA] "); }

#else

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_ops.h"
#include "engine/sampler.h"

typedef struct ranked {
    float v;
    int id;
} ranked;

static int by_rank(const void *a, const void *b) {
    const ranked *x = a, *y = b;
    if (x->v != y->v) return x->v > y->v ? -1 : 1;
    return x->id - y->id;
}

/* allowed[id] = 1 for the CPU's candidate set (top-k, then the top-p prefix, one extra member of
 * slack at the top-p boundary for rounding) */
static void allowed_set(unsigned char *allowed, const float *lg, int V, const lunar_sampling *s) {
    ranked *r = malloc((size_t)V * sizeof *r);
    for (int i = 0; i < V; i++) r[i] = (ranked){lg[i], i};
    qsort(r, (size_t)V, sizeof *r, by_rank);
    int n = s->top_k > 0 && s->top_k < V ? s->top_k : V;
    if (s->top_p < 1.0f) {
        double total = 0, cum = 0;
        for (int i = 0; i < n; i++) total += expf((r[i].v - r[0].v) / s->temperature);
        int keep = 0;
        while (keep < n) {
            cum += expf((r[keep++].v - r[0].v) / s->temperature);
            if (cum >= (double)s->top_p * total) break;
        }
        n = keep < n ? keep + 1 : n;
    }
    memset(allowed, 0, (size_t)V);
    for (int i = 0; i < n; i++) allowed[r[i].id] = 1;
    free(r);
}

TEST(cuda_sample_vs_cpu_sampler) {
    char desc[256];
    lunar_err err;
    if (lunar_cuda_device_count(desc, sizeof desc) <= 0 || lunar_cuda_init(0, 0, &err) != 0) {
        fprintf(stderr, "[skipped: no CUDA device: %s] ", desc);
        return;
    }
    static const lunar_sampling modes[] = {
        {0.0f, 0, 1.0f, 0},  {0.7f, 0, 1.0f, 0}, {1.0f, 1, 1.0f, 0},  {1.0f, 5, 1.0f, 0},   {0.8f, 50, 1.0f, 0},
        {1.0f, 0, 0.1f, 0},  {1.0f, 0, 0.9f, 0}, {0.6f, 50, 0.8f, 0}, {1.3f, 0, 0.999f, 0},
    };
    static const int vocabs[] = {1000, 32007};
    const int rows = 48;
    int total = 0, agree = 0;
    for (unsigned vi = 0; vi < sizeof vocabs / sizeof vocabs[0]; vi++) {
        const int V = vocabs[vi];
        float *lg = malloc((size_t)rows * V * sizeof(float));
        lunar_test_fill(lg, (long)rows * V, 77u + vi, -4.0f, 4.0f);
        for (int r = 0; r < rows; r++) { /* ties: copies of the row's best, and of others */
            float *x = lg + (size_t)r * V;
            int best = 0;
            for (int i = 1; i < V; i++)
                if (x[i] > x[best]) best = i;
            if (r % 3 == 0) x[(best + 17) % V] = x[best];
            for (int i = 0; i < 20; i++) x[(i * 131 + r) % V] = x[(i * 7 + 3) % V];
        }
        for (int i = 0; i < V; i++) lg[(size_t)(rows - 1) * V + i] = 0.25f; /* a flat row */
        size_t mark = lunar_cuda_mark();
        float *dlg = lunar_cuda_alloc((size_t)rows * V * sizeof(float));
        int32_t *dids = lunar_cuda_alloc((size_t)rows * sizeof(int32_t));
        lunar_cuda_sample_params *dp = lunar_cuda_alloc((size_t)rows * sizeof *dp);
        lunar_cuda_upload(dlg, lg, (size_t)rows * V * sizeof(float));
        lunar_cuda_sample_params *hp = malloc((size_t)rows * sizeof *hp);
        int32_t *got = malloc((size_t)rows * sizeof *got), *again = malloc((size_t)rows * sizeof *again);
        unsigned char *allowed = malloc((size_t)V);
        for (unsigned mi = 0; mi < sizeof modes / sizeof modes[0]; mi++) {
            const lunar_sampling *s = &modes[mi];
            int want[64];
            for (int r = 0; r < rows; r++) {
                lunar_rng a, b;
                lunar_rng_seed(&a, 1000u * mi + (unsigned)r);
                b = a;
                hp[r] = (lunar_cuda_sample_params){s->temperature, s->top_k, s->top_p, lunar_rng_uniform(&a)};
                want[r] = lunar_sample(lg + (size_t)r * V, V, s, &b, NULL);
            }
            lunar_cuda_upload(dp, hp, (size_t)rows * sizeof *hp);
            lunar_cuda_fill_u32(dids, 0xffffffffu, (size_t)rows); /* poison */
            lunar_cuda_sample(dids, dlg, rows, V, dp, NULL);
            lunar_cuda_download(got, dids, (size_t)rows * sizeof *got);
            lunar_cuda_sample(dids, dlg, rows, V, dp, NULL);
            lunar_cuda_download(again, dids, (size_t)rows * sizeof *again);
            for (int r = 0; r < rows; r++) {
                CHECK_MSG(got[r] >= 0 && got[r] < V, "V=%d mode %u row %d: id %d", V, mi, r, got[r]);
                if (got[r] < 0 || got[r] >= V) continue;
                CHECK_MSG(again[r] == got[r], "V=%d mode %u row %d: %d then %d for the same u", V, mi, r, got[r],
                          again[r]);
                if (s->temperature <= 0.0f || s->top_k == 1) {
                    CHECK_MSG(got[r] == want[r], "V=%d greedy row %d: %d, CPU %d", V, r, got[r], want[r]);
                } else {
                    allowed_set(allowed, lg + (size_t)r * V, V, s);
                    CHECK_MSG(allowed[got[r]], "V=%d mode %u row %d: token %d outside the allowed set", V, mi, r,
                              got[r]);
                }
                total++;
                agree += got[r] == want[r];
            }
        }
        free(hp), free(got), free(again), free(allowed), free(lg);
        lunar_cuda_release(mark);
    }
    CHECK_MSG(agree >= 0.97 * total, "GPU and CPU samplers agree on %d of %d draws", agree, total);
    fprintf(stderr, "[%d/%d draws equal to the CPU's] ", agree, total);
}

#endif
