/* MLA: naive against a direct double-precision formula, and naive == absorbed. */
#include "ops.h"
#include "ops_util.h"
#include "test.h"

/* Direct: k_j = [W_k c_j | k_pe_j], v_j = W_v c_j, o_t = sum_{j <= pos0+t} softmax(scale q.k_j) v_j */
static void mla_reference(double *o, const float *q, const float *cache, const lunar_tensor *W,
                          int T, int pos0, int H, int N, int P, int Vd, int R, float scale) {
    const int L = pos0 + T, ld = R + P;
    double *s = malloc(sizeof(double) * L), *kv = malloc(sizeof(double) * (N + Vd));
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            const float *qt = q + ((size_t)t * H + h) * (N + P);
            int nj = pos0 + t + 1;
            double mx = -INFINITY, sum = 0;
            for (int j = 0; j < nj; j++) {
                const float *cj = cache + (size_t)j * ld;
                double d = 0;
                for (int n = 0; n < N; n++) {
                    double kn = 0;
                    for (int r = 0; r < R; r++)
                        kn += lunar_tensor_get_f32(W, ((int64_t)h * (N + Vd) + n) * R + r) * (double)cj[r];
                    d += kn * qt[n];
                }
                for (int p = 0; p < P; p++) d += (double)qt[N + p] * cj[R + p];
                s[j] = scale * d;
                mx = fmax(mx, s[j]);
            }
            for (int j = 0; j < nj; j++) sum += (s[j] = exp(s[j] - mx));
            double *ot = o + ((size_t)t * H + h) * Vd;
            for (int x = 0; x < Vd; x++) ot[x] = 0;
            for (int j = 0; j < nj; j++) {
                const float *cj = cache + (size_t)j * ld;
                for (int x = 0; x < Vd; x++) {
                    double vx = 0;
                    for (int r = 0; r < R; r++)
                        vx += lunar_tensor_get_f32(W, ((int64_t)h * (N + Vd) + N + x) * R + r) * (double)cj[r];
                    ot[x] += s[j] / sum * vx;
                }
            }
        }
    }
    free(s), free(kv);
}

/* fp32 dots of length <= R + N and a softmax over <= 10 positions: ~1e-6 relative observed;
 * 1e-5 catches any misindexing (errors of order 1e-1). */
static void check_mla(int T, int pos0, int H, int N, int P, int Vd, int R, lunar_dtype dt, unsigned seed) {
    const int L = pos0 + T;
    float *cache = test_rand((long)L * (R + P), seed, -1, 1);
    float *q = test_rand((long)T * H * (N + P), seed + 1, -2, 2);
    float *wv = test_rand((long)H * (N + Vd) * R, seed + 2, -0.5f, 0.5f);
    lunar_tensor W = test_tensor2(dt, (int64_t)H * (N + Vd), R, wv);
    float scale = 1.0f / sqrtf((float)(N + P));
    long no = (long)T * H * Vd;
    float *on = test_poisoned(no), *oa = test_poisoned(no), *od_f = test_alloc(no);
    double *od = malloc(sizeof(double) * no);
    op_mla_attention_naive(on, q, cache, &W, T, pos0, H, N, P, Vd, R, scale);
    op_mla_attention_absorbed(oa, q, cache, &W, T, pos0, H, N, P, Vd, R, scale);
    mla_reference(od, q, cache, &W, T, pos0, H, N, P, Vd, R, scale);
    for (long i = 0; i < no; i++) od_f[i] = (float)od[i];
    double en = lunar_max_rel_err(on, od_f, no), ea = lunar_max_rel_err(oa, on, no);
    CHECK_MSG(en <= 1e-5, "naive vs reference T=%d pos0=%d: %.3g", T, pos0, en);
    CHECK_MSG(ea <= 1e-5, "absorbed vs naive T=%d pos0=%d: %.3g", T, pos0, ea);
    test_tensor_free(&W);
    free(cache), free(q), free(wv), free(on), free(oa), free(od_f), free(od);
}

TEST(mla_naive_matches_formula_and_absorbed) {
    check_mla(1, 0, 1, 4, 2, 4, 8, LUNAR_DTYPE_F32, 1);        /* first token: softmax over one */
    check_mla(4, 6, 3, 7, 5, 9, 11, LUNAR_DTYPE_BF16, 2);      /* prefill continuation, odd dims */
    check_mla(1, 9, 2, 7, 3, 5, 13, LUNAR_DTYPE_F16, 3);       /* decode */
    check_mla(5, 0, 2, 16, 8, 16, 32, LUNAR_DTYPE_BF16, 4);    /* prefill from scratch */
}

TEST(mla_causal_mask) {
    /* changing cache rows after position pos0 + t must not change output t */
    const int T = 3, pos0 = 2, H = 2, N = 5, P = 3, Vd = 4, R = 6, L = pos0 + T;
    float *cache = test_rand(L * (R + P), 9, -1, 1), *q = test_rand(T * H * (N + P), 10, -1, 1);
    float *wv = test_rand(H * (N + Vd) * R, 11, -1, 1);
    lunar_tensor W = test_tensor2(LUNAR_DTYPE_F32, H * (N + Vd), R, wv);
    float *o1 = test_poisoned(T * H * Vd), *o2 = test_poisoned(T * H * Vd);
    op_mla_attention_absorbed(o1, q, cache, &W, T, pos0, H, N, P, Vd, R, 0.3f);
    for (int i = (pos0 + 1) * (R + P); i < L * (R + P); i++) cache[i] += 1.0f;
    op_mla_attention_absorbed(o2, q, cache, &W, T, pos0, H, N, P, Vd, R, 0.3f);
    CHECK(memcmp(o1, o2, sizeof(float) * H * Vd) == 0); /* t = 0 sees rows 0..pos0 only */
    CHECK(memcmp(o1 + H * Vd, o2 + H * Vd, sizeof(float) * H * Vd) != 0);
    test_tensor_free(&W);
    free(cache), free(q), free(wv), free(o1), free(o2);
}
