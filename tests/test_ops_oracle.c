/* External oracles (tools/reference/k3ops_oracle.py writes tests/data/k3ops_oracle.safetensors):
 * fla's naive_attnres for op_attnres_mix, and transformers' DeepseekV32Indexer (LayerNorm k_norm,
 * non-interleaved RoPE, ReLU head-weighted scores, top-k) for op_layernorm + op_rope_neox +
 * op_dsa_indexer. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "io/safetensors.h"
#include "ops.h"
#include "ops_util.h"
#include "test.h"

static const char *ORACLE = "tests/data/k3ops_oracle.safetensors";

static int st_load(lunar_st **st) {
    lunar_err err;
    if (lunar_st_open(st, ORACLE, &err) == 0) return 0;
    CHECK_MSG(0, "%s (regenerate with python3 tools/reference/k3ops_oracle.py)", err.msg);
    return -1;
}

/* Data of the named tensor of the given dtype; its element count in *numel. */
static const void *st_get(lunar_st *st, const char *name, lunar_dtype dt, long *numel) {
    const lunar_tensor *t = lunar_st_find(st, name);
    if (!t || t->dtype != dt) return NULL;
    *numel = (long)lunar_tensor_numel(t);
    return t->data;
}

#define GET(f, name, dt, n)                                                 \
    ({                                                                      \
        const void *p_ = st_get(f, name, LUNAR_DTYPE_##dt, n);              \
        CHECK_MSG(p_ != NULL, "%s: tensor %s (%s) missing", ORACLE, name, #dt); \
        p_;                                                                 \
    })

TEST(oracle_fla_attnres) {
    lunar_st *f;
    if (st_load(&f) != 0) return;
    long ns = 0, np = 0, nr = 0, no = 0, nout = 0, nmix = 0;
    const float *src = GET(f, "attnres.src", F32, &ns), *p = GET(f, "attnres.proj", F32, &np);
    const float *r = GET(f, "attnres.norm", F32, &nr), *on = GET(f, "attnres.out_norm", F32, &no);
    const float *want = GET(f, "attnres.out", F32, &nout), *wmix = GET(f, "attnres.mix", F32, &nmix);
    if (!src || !p || !r || !on || !want || !wmix) goto done;
    {
        const int D = (int)np, S = 5, n = (int)(ns / S / D);
        const float *srcs[5];
        for (int i = 0; i < S; i++) srcs[i] = src + (size_t)i * n * D;
        lunar_tensor P = test_tensor1(LUNAR_DTYPE_F32, D, p), R = test_tensor1(LUNAR_DTYPE_F32, D, r);
        lunar_tensor O = test_tensor1(LUNAR_DTYPE_F32, D, on);
        float *out = test_poisoned(n * D);
        /* torch fp32 einsum/softmax vs our double sums: a few fp32 ulps; 5e-6 relative */
        op_attnres_mix(out, srcs, S, &P, &R, &O, n, D, 1e-5f);
        CHECK_MSG(lunar_max_rel_err(out, want, n * D) <= 5e-6, "vs fla (out-norm): %.3g", lunar_max_rel_err(out, want, n * D));
        op_attnres_mix(out, srcs, S, &P, &R, NULL, n, D, 1e-5f);
        CHECK_MSG(lunar_max_rel_err(out, wmix, n * D) <= 5e-6, "vs fla (mix): %.3g", lunar_max_rel_err(out, wmix, n * D));
        test_tensor_free(&P), test_tensor_free(&R), test_tensor_free(&O);
        free(out);
    }
done:
    lunar_st_close(f);
}

static int cmp_int(const void *a, const void *b) { return *(const int32_t *)a - *(const int32_t *)b; }

TEST(oracle_transformers_dsv32_indexer) {
    lunar_st *f;
    if (st_load(&f) != 0) return;
    long nq = 0, nk = 0, nkw = 0, nkb = 0, nw = 0, ninv = 0, ntk = 0;
    const float *q0 = GET(f, "idx.q", F32, &nq), *kpre = GET(f, "idx.k_pre", F32, &nk);
    const float *kw = GET(f, "idx.k_norm.weight", F32, &nkw), *kb = GET(f, "idx.k_norm.bias", F32, &nkb);
    const float *w = GET(f, "idx.w", F32, &nw), *inv = GET(f, "idx.inv_freq", F32, &ninv);
    const int32_t *want = GET(f, "idx.topk", I32, &ntk);
    if (!q0 || !kpre || !kw || !kb || !w || !inv || !want) goto done;
    {
        const int d = (int)nkw, T = (int)(nk / d), nh = (int)(nw / T), rot = (int)ninv * 2, topk = (int)(ntk / T);
        float *q = test_alloc(nq), *k = test_alloc(nk);
        memcpy(q, q0, sizeof(float) * nq);
        lunar_tensor W = test_tensor1(LUNAR_DTYPE_F32, d, kw), B = test_tensor1(LUNAR_DTYPE_F32, d, kb);
        op_layernorm(k, kpre, &W, &B, T, d, 1e-6f);
        op_rope_neox(q, inv, T, 0, nh, d, rot);
        op_rope_neox(k, inv, T, 0, 1, d, rot);
        lunar_index_cache c = {.keys = k};
        int32_t *idx = malloc(sizeof(int32_t) * T * topk), *cnt = malloc(sizeof(int32_t) * T);
        op_dsa_indexer(idx, cnt, q, w, &c, T, 0, nh, d, topk);
        for (int t = 0; t < T; t++) {
            /* transformers fills short rows with masked (-inf) positions; compare the visible set */
            int32_t ref[64];
            int m = 0;
            for (int i = 0; i < topk; i++)
                if (want[t * topk + i] <= t) ref[m++] = want[t * topk + i];
            qsort(ref, (size_t)m, sizeof *ref, cmp_int);
            CHECK(cnt[t] == m);
            for (int i = 0; i < topk; i++)
                CHECK_MSG(idx[t * topk + i] == (i < m ? ref[i] : -1), "t=%d i=%d: %d vs %d", t, i, idx[t * topk + i],
                          i < m ? ref[i] : -1);
        }
        test_tensor_free(&W), test_tensor_free(&B);
        free(q), free(k), free(idx), free(cnt);
    }
done:
    lunar_st_close(f);
}
