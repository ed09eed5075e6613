/* The CUDA model forward end to end against the golden logits (as tests/test_golden.c does for the
 * CPU): for every tests/golden/NAME, prefill (all rows), decode token by token, and a full
 * recompute from empty caches, on the device. Skipped without a CUDA device.
 *
 * Measured per phase: e = max |logit_gpu - logit_golden| / max |logit_golden| over all rows, and
 * the fraction of rows whose greedy argmax agrees. Tolerance: the device rounds every GEMM operand
 * (activations and weights) to bf16 (2^-9 relative per operand) and stores the MLA latent in bf16;
 * through 3-7 layers with fp32 accumulation and fp32 norms that compounds to a few 1e-3 of the
 * largest logit on these tiny models (the CPU ops tests bound one bf16 rounding at 3.9e-3), so
 * e <= 5e-2 leaves ~10x headroom while still catching any wrong op (a wrong op moves logits by
 * O(max |logit|)). Argmax agreement >= 95 % of rows: near-ties may flip under bf16 rounding. */
#include "test.h"

#ifndef LUNAR_HAVE_CUDA

TEST(cuda_forward_skipped) { fprintf(stderr, "[skipped: no CUDA device: lunar was built without CUDA] "); }

#else

#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "io/safetensors.h"
#include "model/forward_cuda.h"

#define CUDA_GOLDEN_TOL 5e-2
#define CUDA_ARGMAX_MIN 0.95

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* e and the number of agreeing argmax rows */
static double cmp_rows(const float *got, const float *want, int rows, int V, int *agree) {
    double mx = 0, md = 0;
    for (long i = 0; i < (long)rows * V; i++) {
        mx = fmax(mx, fabs(want[i]));
        md = fmax(md, fabs((double)got[i] - want[i]));
    }
    for (int r = 0; r < rows; r++) *agree += argmax(got + (size_t)r * V, V) == argmax(want + (size_t)r * V, V);
    return mx > 0 ? md / mx : md;
}

static void run_one(const char *dir) {
    char path[1300], model_dir[1200];
    lunar_err err;
    lunar_st *g;
    snprintf(path, sizeof path, "%s/golden.safetensors", dir);
    if (lunar_st_open(&g, path, &err) != 0) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    const char *md = lunar_st_metadata(g, "model_dir");
    snprintf(model_dir, sizeof model_dir, "%s", md ? md : dir);
    lunar_model *m;
    if (lunar_model_load(&m, model_dir, &err) != 0) {
        CHECK_MSG(0, "%s", err.msg);
        lunar_st_close(g);
        return;
    }
    if (m->cfg.index_topk > 0 && m->cfg.index_head_dim < 32) {
        /* lunar_cuda_dsa_index_write needs index_head_dim >= 32 (power of two): no generic path yet */
        fprintf(stderr, "\n  %-18s skipped: index_head_dim %d < 32 (DSA key write)", strrchr(dir, '/') + 1,
                m->cfg.index_head_dim);
        lunar_model_free(m);
        lunar_st_close(g);
        return;
    }
    const lunar_tensor *pid = lunar_st_find(g, "prompt_ids"), *pl = lunar_st_find(g, "prefill_logits"),
                       *did = lunar_st_find(g, "decode_ids"), *dl = lunar_st_find(g, "decode_logits");
    CHECK(pid && pl && did && dl);
    const int T = (int)pid->shape[0], nd = (int)did->shape[0], V = m->cfg.vocab_size;
    int32_t *ids = lunar_xmalloc((size_t)(T + nd) * sizeof(int32_t));
    memcpy(ids, pid->data, (size_t)T * sizeof(int32_t));
    memcpy(ids + T, did->data, (size_t)nd * sizeof(int32_t));
    float *logits = lunar_xmalloc((size_t)(T + nd) * V * sizeof(float));
    const float *want_pre = pl->data, *want_dec = dl->data;

    lunar_cuda_model *gm = NULL;
    lunar_cuda_seq s;
    CHECK_MSG(lunar_cuda_model_upload(&gm, m, &err) == 0, "%s", err.msg);
    CHECK_MSG(gm && lunar_cuda_seq_init(&s, m, T + nd, &err) == 0, "%s", err.msg);
    if (!gm) goto out;
    int a_pre = 0, a_dec = 0, a_full = 0;
    CHECK(lunar_forward_cuda(gm, &s, ids, T, logits, 1, &err) == 0);
    double e_pre = cmp_rows(logits, want_pre, T, V, &a_pre), e_dec = 0;
    for (int i = 0; i < nd; i++) {
        CHECK(lunar_forward_cuda(gm, &s, ids + T + i, 1, logits, 0, &err) == 0);
        e_dec = fmax(e_dec, cmp_rows(logits, want_dec + (size_t)i * V, 1, V, &a_dec));
    }
    lunar_cuda_seq_reset(&s);
    CHECK(lunar_forward_cuda(gm, &s, ids, T + nd, logits, 1, &err) == 0);
    double e_full = fmax(cmp_rows(logits, want_pre, T, V, &a_full),
                         cmp_rows(logits + (size_t)T * V, want_dec, nd, V, &a_full));
    fprintf(stderr, "\n  %-18s prefill %.2e (%d/%d argmax) decode %.2e (%d/%d) full %.2e (%d/%d)",
            strrchr(dir, '/') + 1, e_pre, a_pre, T, e_dec, a_dec, nd, e_full, a_full, T + nd);
    CHECK_MSG(e_pre <= CUDA_GOLDEN_TOL && e_dec <= CUDA_GOLDEN_TOL && e_full <= CUDA_GOLDEN_TOL,
              "%s: max rel err prefill %.3g decode %.3g full %.3g", dir, e_pre, e_dec, e_full);
    CHECK_MSG(a_pre >= CUDA_ARGMAX_MIN * T && a_dec >= CUDA_ARGMAX_MIN * nd && a_full >= CUDA_ARGMAX_MIN * (T + nd),
              "%s: argmax agreement prefill %d/%d decode %d/%d full %d/%d", dir, a_pre, T, a_dec, nd,
              a_full, T + nd);
    lunar_cuda_seq_free(&s);
    lunar_cuda_model_free(gm);
out:
    free(ids), free(logits);
    lunar_model_free(m);
    lunar_st_close(g);
}

TEST(cuda_forward_matches_goldens) {
    char desc[256];
    if (lunar_cuda_device_count(desc, sizeof desc) <= 0) {
        fprintf(stderr, "[skipped: no CUDA device: %s] ", desc);
        return;
    }
    DIR *d = opendir("tests/golden");
    CHECK_MSG(d != NULL, "tests/golden is missing (run the tests from the repository root)");
    if (!d) return;
    char names[64][256];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64)
        if (e->d_name[0] != '.') snprintf(names[n++], sizeof names[0], "%s", e->d_name);
    closedir(d);
    for (int i = 0; i < n; i++) {
        char dir[600];
        snprintf(dir, sizeof dir, "tests/golden/%.255s", names[i]);
        run_one(dir);
    }
}

#endif
