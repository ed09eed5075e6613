/* External oracles (tools/reference/k3ops_oracle.py writes tests/golden/k3ops_oracle.safetensors):
 * fla's naive_attnres for op_attnres_mix, and transformers' DeepseekV32Indexer (LayerNorm k_norm,
 * non-interleaved RoPE, ReLU head-weighted scores, top-k) for op_layernorm + op_rope_neox +
 * op_dsa_indexer. A minimal safetensors reader lives here (F32/I32 only) so the test does not
 * depend on the io layer. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>

#include "ops.h"
#include "ops_util.h"
#include "test.h"

static const char *ORACLE = "tests/golden/k3ops_oracle.safetensors";

typedef struct {
    unsigned char *buf;
    long len;
    json_t *hdr;
    size_t base;
} st_file;

static int st_load(st_file *f) {
    FILE *fp = fopen(ORACLE, "rb");
    if (!fp) return -1;
    fseek(fp, 0, SEEK_END);
    f->len = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    f->buf = malloc((size_t)f->len);
    size_t got = fread(f->buf, 1, (size_t)f->len, fp);
    fclose(fp);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = hl << 8 | f->buf[i];
    if (got != (size_t)f->len || hl + 8 > (uint64_t)f->len) return -1;
    f->hdr = json_loadb((const char *)f->buf + 8, (size_t)hl, 0, NULL);
    f->base = 8 + (size_t)hl;
    return f->hdr ? 0 : -1;
}

/* Pointer to the named tensor's data (little-endian host assumed, as the rest of lunar); numel out. */
static const void *st_get(st_file *f, const char *name, const char *dtype, long *numel) {
    json_t *e = json_object_get(f->hdr, name);
    if (!e || strcmp(json_string_value(json_object_get(e, "dtype")), dtype) != 0) return NULL;
    json_t *sh = json_object_get(e, "shape"), *off = json_object_get(e, "data_offsets");
    long n = 1;
    for (size_t i = 0; i < json_array_size(sh); i++) n *= (long)json_integer_value(json_array_get(sh, i));
    *numel = n;
    return f->buf + f->base + json_integer_value(json_array_get(off, 0));
}

#define GET(f, name, dt, n)                                                 \
    ({                                                                      \
        const void *p_ = st_get(f, name, dt, n);                            \
        CHECK_MSG(p_ != NULL, "%s: tensor %s (%s) missing", ORACLE, name, dt); \
        p_;                                                                 \
    })

TEST(oracle_fla_attnres) {
    st_file f;
    if (st_load(&f) != 0) {
        CHECK_MSG(0, "cannot read %s (regenerate with tools/reference/k3ops_oracle.py)", ORACLE);
        return;
    }
    long ns, np, nr, no, nout, nmix;
    const float *src = GET(&f, "attnres.src", "F32", &ns), *p = GET(&f, "attnres.proj", "F32", &np);
    const float *r = GET(&f, "attnres.norm", "F32", &nr), *on = GET(&f, "attnres.out_norm", "F32", &no);
    const float *want = GET(&f, "attnres.out", "F32", &nout), *wmix = GET(&f, "attnres.mix", "F32", &nmix);
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
    json_decref(f.hdr);
    free(f.buf);
}

static int cmp_int(const void *a, const void *b) { return *(const int32_t *)a - *(const int32_t *)b; }

TEST(oracle_transformers_dsv32_indexer) {
    st_file f;
    if (st_load(&f) != 0) {
        CHECK_MSG(0, "cannot read %s", ORACLE);
        return;
    }
    long nq, nk, nkw, nkb, nw, ninv, ntk;
    const float *q0 = GET(&f, "idx.q", "F32", &nq), *kpre = GET(&f, "idx.k_pre", "F32", &nk);
    const float *kw = GET(&f, "idx.k_norm.weight", "F32", &nkw), *kb = GET(&f, "idx.k_norm.bias", "F32", &nkb);
    const float *w = GET(&f, "idx.w", "F32", &nw), *inv = GET(&f, "idx.inv_freq", "F32", &ninv);
    const int32_t *want = GET(&f, "idx.topk", "I32", &ntk);
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
    json_decref(f.hdr);
    free(f.buf);
}
