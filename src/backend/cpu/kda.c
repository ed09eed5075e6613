/* CPU reference: Kimi Delta Attention (KDA). The forget gate, the token-by-token recurrence (decode
 * and the reference) and the chunk-parallel WY/UT form (prefill), in fp32 like transformers'
 * torch_recurrent_kda / torch_chunk_kda. Layouts: q, k, g [T, H, dk]; v, o [T, H, dv]; beta [T, H];
 * S [H, dk, dv] (key rows, value columns). Parallel over heads. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"
#include "ops.h"

/* lower_bound == 0: g = -exp(A_log[h]) * softplus(f + dt_bias), softplus(x) = x above 20
 *                   (HF KimiLinearForgetGate: torch.where(g > 20, g, log(1 + exp(g))));
 * lower_bound <  0: g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))  (FLA safe gate). */
void op_kda_gate(float *g, const float *f, const lunar_tensor *A_log, const lunar_tensor *dt_bias,
                 int T, int H, int dk, float lower_bound) {
    LUNAR_ASSERT(lunar_tensor_numel(A_log) >= H && lunar_tensor_numel(dt_bias) == (int64_t)H * dk);
    const int D = H * dk;
    float *a = lunar_xmalloc((size_t)H * sizeof(float));
    float *bias = lunar_xmalloc((size_t)D * sizeof(float));
    lunar_tensor_read_f32(A_log, 0, H, a);
    lunar_tensor_read_f32(dt_bias, 0, D, bias);
    for (int h = 0; h < H; h++) a[h] = expf(a[h]); /* decay rate exp(A_log) */
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            for (int j = 0; j < dk; j++) {
                size_t i = (size_t)t * D + (size_t)h * dk + j;
                float x = f[i] + bias[h * dk + j];
                if (lower_bound < 0.0f) {
                    g[i] = lower_bound / (1.0f + expf(-a[h] * x));
                } else {
                    float sp = x > 20.0f ? x : log1pf(expf(x));
                    g[i] = -a[h] * sp;
                }
            }
        }
    }
    free(a);
    free(bias);
}

/* Per token t, head h (HF torch_recurrent_kda):
 *   S  = Diag(exp(g_t)) S                    decay each key row
 *   d  = beta_t (v_t - S^T k_t)              delta rule against the decayed state
 *   S += k_t d^T
 *   o_t = S^T (q_t * scale) */
void op_kda_recurrent(float *o, const float *q, const float *k, const float *v, const float *g,
                      const float *beta, float *S, int T, int H, int dk, int dv, float scale) {
#pragma omp parallel if ((int64_t)T * H * dk * dv > PAR_MIN_WORK)
    {
        float *d = lunar_xmalloc((size_t)dv * sizeof(float));
        float *qs = lunar_xmalloc((size_t)dk * sizeof(float));
#pragma omp for schedule(static)
        for (int h = 0; h < H; h++) {
            float *Sh = S + (size_t)h * dk * dv;
            for (int t = 0; t < T; t++) {
                size_t th = (size_t)t * H + h;
                const float *qt = q + th * dk, *kt = k + th * dk, *gt = g + th * dk;
                const float *vt = v + th * dv;
                float *ot = o + th * dv;
                for (int j = 0; j < dk; j++) {
                    float a = expf(gt[j]);
                    for (int c = 0; c < dv; c++) Sh[(size_t)j * dv + c] *= a;
                }
                for (int c = 0; c < dv; c++) d[c] = 0.0f;
                for (int j = 0; j < dk; j++)
                    for (int c = 0; c < dv; c++) d[c] += Sh[(size_t)j * dv + c] * kt[j];
                for (int c = 0; c < dv; c++) d[c] = (vt[c] - d[c]) * beta[th];
                for (int j = 0; j < dk; j++)
                    for (int c = 0; c < dv; c++) Sh[(size_t)j * dv + c] += kt[j] * d[c];
                for (int j = 0; j < dk; j++) qs[j] = qt[j] * scale;
                for (int c = 0; c < dv; c++) ot[c] = 0.0f;
                for (int j = 0; j < dk; j++)
                    for (int c = 0; c < dv; c++) ot[c] += Sh[(size_t)j * dv + c] * qs[j];
            }
        }
        free(d);
        free(qs);
    }
}

/* Scratch for one head's chunk: C rows of everything. */
typedef struct chunk_buf {
    float *Q, *K, *V;  /* [C, dk] (q * scale), [C, dk], [C, dv]: this head's rows, contiguous */
    double *G;         /* [C, dk] Gamma: inclusive cumulative log decay within the chunk */
    float *A, *Aqk;    /* [C, C] */
    float *W, *U, *Vn; /* [C, dk], [C, dv], [C, dv] */
    float *tmp;        /* [max(C, dk, dv)] */
} chunk_buf;

/* One chunk of c tokens for one head; S [dk, dv] is the state before the chunk, updated in place.
 * Notation of kda.md section 2 (rows r, i in [0, c)):
 *   Gamma_r = sum_{s <= r} g_s
 *   L[r,i]  = beta_r sum_j k_r[j] k_i[j] exp(Gamma_r[j] - Gamma_i[j])    (i < r)
 *   A_qk[r,i] =      sum_j q_r[j] k_i[j] exp(Gamma_r[j] - Gamma_i[j])    (i <= r)
 *   Tm = (I + L)^-1,  W = Tm (beta * exp(Gamma) * K),  U = Tm (beta * V)
 *   V_new = U - W S
 *   O     = (Q * exp(Gamma)) S + A_qk V_new
 *   S     = Diag(exp(Gamma_last)) S + (K * exp(Gamma_last - Gamma))^T V_new
 * Every exponent is <= 0 (g <= 0 and i <= r), so nothing overflows: the pairwise decay is
 * exponentiated per pair, never as exp(Gamma_r) * exp(-Gamma_i).
 * Gamma is accumulated in double: within a 64-token chunk it reaches -100s, and an fp32 running
 * sum then loses ~|Gamma| * 2^-24 ~ 1e-5 absolute, which the differences Gamma_r - Gamma_i
 * (O(1) near the diagonal) would turn into ~1e-5 relative error in the decays. In double the
 * differences are exact to fp32 precision, so the chunked form tracks the recurrence to ~1e-6
 * (transformers' fp32 cumsum carries that ~1e-5 error; well inside the 1e-4 budget). */
static void kda_chunk(float *o, const float *g, const float *beta, float *S, int t0, int c, int H,
                      int h, int dk, int dv, chunk_buf *b, const float *q, const float *k,
                      const float *v, float scale) {
    const int C = c;
    /* gather this head's rows; Gamma as a running sum in token order (torch cumsum) */
    for (int r = 0; r < c; r++) {
        size_t th = (size_t)(t0 + r) * H + h;
        for (int j = 0; j < dk; j++) {
            b->Q[r * dk + j] = q[th * dk + j] * scale;
            b->K[r * dk + j] = k[th * dk + j];
            b->G[r * dk + j] = (r ? b->G[(r - 1) * dk + j] : 0.0) + g[th * dk + j];
        }
        memcpy(b->V + (size_t)r * dv, v + th * dv, (size_t)dv * sizeof(float));
    }
    const float *bt = beta; /* beta of row r: bt[(t0 + r) * H + h] */
#define BETA(r) bt[(size_t)(t0 + (r)) * H + h]

    /* A = -L (strictly lower) and A_qk (lower, diagonal included), sharing the pairwise decays */
    for (int r = 0; r < c; r++) {
        const double *Gr = b->G + r * dk;
        const float *kr = b->K + r * dk, *qr = b->Q + r * dk;
        for (int i = 0; i <= r; i++) {
            const double *Gi = b->G + i * dk;
            const float *ki = b->K + i * dk;
            float sk = 0.0f, sq = 0.0f;
            for (int j = 0; j < dk; j++) {
                float e = expf((float)(Gr[j] - Gi[j]));
                float kie = ki[j] * e;
                sk += kr[j] * kie;
                sq += qr[j] * kie;
            }
            b->A[r * C + i] = i < r ? -BETA(r) * sk : 0.0f;
            b->Aqk[r * C + i] = sq;
        }
        for (int i = r + 1; i < c; i++) b->A[r * C + i] = b->Aqk[r * C + i] = 0.0f;
    }

    /* (I + L)^-1 by forward substitution, row by row as HF does on A = -L:
     *   A[r, :r] += sum_m A[r, m] A[m, :r]   (rows m < r already final), then add I. */
    for (int r = 1; r < c; r++) {
        float *row = b->A + r * C;
        memcpy(b->tmp, row, (size_t)r * sizeof(float));
        for (int i = 0; i < r; i++) {
            float s = b->tmp[i];
            for (int m = i + 1; m < r; m++) s += b->tmp[m] * b->A[m * C + i];
            row[i] = s;
        }
    }
    for (int r = 0; r < c; r++) b->A[r * C + r] = 1.0f;

    /* W = Tm (beta * exp(Gamma) * K),  U = Tm (beta * V) */
    for (int r = 0; r < c; r++) {
        float *Wr = b->W + r * dk, *Ur = b->U + (size_t)r * dv;
        for (int j = 0; j < dk; j++) Wr[j] = 0.0f;
        for (int j = 0; j < dv; j++) Ur[j] = 0.0f;
        for (int i = 0; i <= r; i++) {
            float a = b->A[r * C + i] * BETA(i);
            const float *ki = b->K + i * dk, *vi = b->V + (size_t)i * dv;
            const double *Gi = b->G + i * dk;
            for (int j = 0; j < dk; j++) Wr[j] += a * (ki[j] * expf((float)Gi[j]));
            for (int j = 0; j < dv; j++) Ur[j] += a * vi[j];
        }
    }
#undef BETA

    /* V_new = U - W S;  O = (Q * exp(Gamma)) S + A_qk V_new */
    for (int r = 0; r < c; r++) {
        float *vn = b->Vn + (size_t)r * dv;
        const float *Wr = b->W + r * dk;
        memcpy(vn, b->U + (size_t)r * dv, (size_t)dv * sizeof(float));
        for (int j = 0; j < dk; j++)
            for (int x = 0; x < dv; x++) vn[x] -= Wr[j] * S[(size_t)j * dv + x];
    }
    for (int r = 0; r < c; r++) {
        float *orow = o + ((size_t)(t0 + r) * H + h) * dv;
        const float *Qr = b->Q + r * dk;
        const double *Gr = b->G + r * dk;
        for (int x = 0; x < dv; x++) orow[x] = 0.0f;
        for (int j = 0; j < dk; j++) {
            float qe = Qr[j] * expf((float)Gr[j]);
            for (int x = 0; x < dv; x++) orow[x] += qe * S[(size_t)j * dv + x];
        }
        for (int i = 0; i <= r; i++) {
            float a = b->Aqk[r * C + i];
            const float *vn = b->Vn + (size_t)i * dv;
            for (int x = 0; x < dv; x++) orow[x] += a * vn[x];
        }
    }

    /* S = Diag(exp(Gamma_last)) S + (K * exp(Gamma_last - Gamma))^T V_new */
    const double *Gl = b->G + (c - 1) * dk;
    for (int j = 0; j < dk; j++) {
        float *Sj = S + (size_t)j * dv;
        float a = expf((float)Gl[j]);
        for (int x = 0; x < dv; x++) Sj[x] *= a;
        for (int r = 0; r < c; r++) {
            float kd = b->K[r * dk + j] * expf((float)(Gl[j] - b->G[r * dk + j]));
            const float *vn = b->Vn + (size_t)r * dv;
            for (int x = 0; x < dv; x++) Sj[x] += kd * vn[x];
        }
    }
}

void op_kda_chunked(float *o, const float *q, const float *k, const float *v, const float *g,
                    const float *beta, float *S, int T, int H, int dk, int dv, float scale,
                    int chunk) {
    LUNAR_ASSERT(chunk >= 1);
    const int C = chunk;
    int tmpn = C > dk ? C : dk;
    if (dv > tmpn) tmpn = dv;
#pragma omp parallel if ((int64_t)T * H * dk * dv > PAR_MIN_WORK)
    {
        chunk_buf b;
        float *mem = lunar_xmalloc(sizeof(float) * ((size_t)C * (3 * dk + 3 * dv + 2 * C) + tmpn));
        double *gmem = lunar_xmalloc(sizeof(double) * (size_t)C * dk);
        float *p = mem;
        b.G = gmem;
        b.Q = p, p += (size_t)C * dk;
        b.K = p, p += (size_t)C * dk;
        b.W = p, p += (size_t)C * dk;
        b.V = p, p += (size_t)C * dv;
        b.U = p, p += (size_t)C * dv;
        b.Vn = p, p += (size_t)C * dv;
        b.A = p, p += (size_t)C * C;
        b.Aqk = p, p += (size_t)C * C;
        b.tmp = p;
#pragma omp for schedule(static)
        for (int h = 0; h < H; h++) {
            float *Sh = S + (size_t)h * dk * dv;
            for (int t0 = 0; t0 < T; t0 += C) {
                int c = T - t0 < C ? T - t0 : C;
                kda_chunk(o, g, beta, Sh, t0, c, H, h, dk, dv, &b, q, k, v, scale);
            }
        }
        free(mem);
        free(gmem);
    }
}
