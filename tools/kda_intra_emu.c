/* CPU emulation of the KDA intra kernel forms' roundings (issue 7, session 15): which part of the
 * tensor-core form (tc) loses accuracy against the session-13 kernel (fast). One 64-token chunk at a
 * time, 128 key dims, in double as the reference; each form's L, the block inverse X = (I + L)^-1 and
 * W = X diag(beta) exp(Gamma) K, U = X diag(beta) V as kda_intra2_kernel rounds them:
 *   fp32 scalar: step 2's 8x8 triangles (fast), the inverse's level products (fast, diag), forward
 *   substitution of the diagonal blocks (all forms) -- emulated as float arithmetic;
 *   tf32 anchored mma: the factors x_r exp(Gamma_r - Gamma_a), k_i exp(Gamma_a - Gamma_i) rounded to
 *   tf32 (round half away, as tf32_i2<1>), fp32 sums; 3xTF32: hi.hi + hi.lo + lo.hi;
 *   step 8: X and exp(Gamma) k / V as tf32 operands, W and U rounded to bf16 (every form).
 * Forms: fast (off-diagonal blocks and the lower-left 8x8 of each diagonal block anchored tf32, the
 * 8x8 triangles fp32, level products fp32); tc (every tile anchored mid-row-block tf32, level
 * products tf32); diag (tc's L, fp32 level products); inv3 (tc's L, 3xTF32 level products); dg3 (the
 * diagonal blocks' tiles in 3xTF32, tf32 level products); tc3 (dg3 + inv3); exact (L, X, W, U, Aqk in
 * double, then bf16: what an error-free kernel would write).
 * Errors: ||Y - Y_ref||_F / ||Y_ref||_F over all chunks, for X, W, U and Aqk (bf16, unscaled), and the
 * share of the bf16 outputs W, U, Aqk whose bits differ from fast's.
 *   cc -O2 -o /tmp/kda_intra_emu tools/kda_intra_emu.c -lm && /tmp/kda_intra_emu [chunks] */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 64, D = 128, NF = 7 };
static const char *const fname[NF] = {"fast", "tc", "diag", "inv3", "dg3", "tc3", "exact"};

static uint64_t rs = 88172645463325252ull;
static double urand(double lo, double hi) {
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return lo + (hi - lo) * ((rs >> 11) * (1.0 / 9007199254740992.0));
}
static float tf32(float x) { /* the value the mma reads from tf32_i2<1>(x) */
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x1000u) & 0xffffe000u;
    memcpy(&x, &u, 4);
    return x;
}
static float bf16(float x) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, 4);
    return x;
}
/* a . b in the form's precision: 0 fp32 (products and sums in float), 1 tf32 operands (fp32 sums),
 * 2 3xTF32 */
static float dotp(const float *a, const float *b, int n, int prec) {
    float s = 0.0f;
    for (int j = 0; j < n; j++) {
        if (prec == 0) s += a[j] * b[j];
        else if (prec == 1) s += tf32(a[j]) * tf32(b[j]);
        else {
            const float ah = tf32(a[j]), bh = tf32(b[j]), al = tf32(a[j] - ah), bl = tf32(b[j] - bh);
            s += al * bh + ah * bl + ah * bh;
        }
    }
    return s;
}

static double G[B][D], k[B][D], q[B][D], v[B][D], beta[B];

/* x_r . k_i exp(Gamma_r - Gamma_i) (x = k for L, q for Aqk), i <= r: prec 0 fp32 scalar (the exact
 * exponent difference in float), else anchored at row a */
static float pent(const double (*x)[D], int r, int i, int a, int prec) {
    float xa[D], y[D];
    for (int d = 0; d < D; d++) {
        if (prec == 0) xa[d] = (float)x[r][d], y[d] = (float)k[i][d] * expf((float)(G[r][d] - G[i][d]));
        else xa[d] = (float)x[r][d] * expf((float)(G[r][d] - G[a][d])), y[d] = (float)k[i][d] * expf((float)(G[a][d] - G[i][d]));
    }
    return dotp(xa, y, D, prec);
}
/* the form's anchor and precision for entry (r, i) of L / Aqk */
static float fent(const double (*x)[D], int f, int r, int i) {
    const int m = r / 16, n = i / 16;
    if (f == 0) { /* fast */
        if (m != n) return pent(x, r, i, 16 * m, 1);
        if (r / 8 == i / 8) return pent(x, r, i, 0, 0);
        return pent(x, r, i, 16 * m + 8, 1); /* lower-left 8x8 */
    }
    return pent(x, r, i, 16 * m + 8, (f == 4 || f == 5) && m == n ? 2 : 1);
}

static void form_L(int f, float L[B][B]) {
    memset(L, 0, sizeof(float) * B * B);
    for (int r = 0; r < B; r++)
        for (int i = 0; i < r; i++) L[r][i] = (float)beta[r] * fent(k, f, r, i);
}

static void form_X(int f, float L[B][B], float X[B][B]) {
    const int lp = f == 0 || f == 2 ? 0 : f == 3 || f == 5 ? 2 : 1; /* level products' precision */
    memset(X, 0, sizeof(float) * B * B);
    for (int m = 0; m < 4; m++) /* forward substitution, fp32 */
        for (int c = 0; c < 16; c++)
            for (int r = 0; r < 16; r++) {
                float s = r == c ? 1.0f : 0.0f;
                for (int kk = 0; kk < r; kk++) s -= L[16 * m + r][16 * m + kk] * X[16 * m + kk][16 * m + c];
                X[16 * m + r][16 * m + c] = s;
            }
    for (int d = 1; d < 4; d++)
        for (int m = d; m < 4; m++) {
            const int n = m - d;
            float P[16][16], a[64], b[64];
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) {
                    int nn = 0;
                    for (int kb = n; kb < m; kb++)
                        for (int kk = 0; kk < 16; kk++) a[nn] = L[16 * m + r][16 * kb + kk], b[nn++] = X[16 * kb + kk][16 * n + c];
                    P[r][c] = dotp(a, b, nn, lp);
                }
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++) {
                    for (int kk = 0; kk < 16; kk++) a[kk] = X[16 * m + r][16 * m + kk], b[kk] = P[kk][c];
                    X[16 * m + r][16 * n + c] = -dotp(a, b, 16, lp);
                }
        }
}

int main(int argc, char **argv) {
    const int chunks = argc > 1 ? atoi(argv[1]) : 16;
    static const double corrs[] = {0.0, 1.0, 2.0};
    static const double lbs[] = {-5.0, -1.0};
    printf("| keys (corr) | gate bound | form | X rel err | W rel err | U rel err | Aqk rel err | W, U, Aqk bf16 != fast's |\n"
           "|---|---|---|---|---|---|---|---|\n");
    for (int ci = 0; ci < 3; ci++)
        for (int li = 0; li < 2; li++) {
            double ex[NF] = {0}, ew[NF] = {0}, eu[NF] = {0}, ea[NF] = {0}, nx = 0, nw = 0, nu = 0, na = 0;
            long flips[NF] = {0}, nflip = 0;
            static float Wf[B][D], Uf[B][D], Af[B][B]; /* fast's bf16 outputs */
            for (int ch = 0; ch < chunks; ch++) {
                double base[D];
                for (int d = 0; d < D; d++) base[d] = urand(-1, 1);
                for (int r = 0; r < B; r++) {
                    double nk = 0;
                    for (int d = 0; d < D; d++) k[r][d] = corrs[ci] * base[d] + urand(-1, 1), nk += k[r][d] * k[r][d];
                    double nq = 0;
                    for (int d = 0; d < D; d++) q[r][d] = urand(-1, 1), nq += q[r][d] * q[r][d];
                    for (int d = 0; d < D; d++) k[r][d] /= sqrt(nk), q[r][d] /= sqrt(nq), v[r][d] = urand(-1, 1);
                    beta[r] = 1.0 / (1.0 + exp(-urand(-3, 3)));
                }
                const double a = exp(urand(-2, 1));
                for (int d = 0; d < D; d++) {
                    const double bd = urand(-1, 1);
                    double acc = 0;
                    for (int r = 0; r < B; r++) /* the bounded gate: lb sigmoid(e^A (f + dt_bias)) */
                        acc += lbs[li] / (1.0 + exp(-a * (urand(-4, 2) + bd))), G[r][d] = acc;
                }
                /* reference in double */
                static double Lr[B][B], Xr[B][B], Wr[B][D], Ur[B][D], Ar[B][B];
                memset(Lr, 0, sizeof Lr);
                for (int r = 0; r < B; r++)
                    for (int i = 0; i <= r; i++) {
                        double s = 0;
                        for (int d = 0; d < D; d++) s += q[r][d] * k[i][d] * exp(G[r][d] - G[i][d]);
                        Ar[r][i] = s, na += s * s;
                    }
                for (int r = 0; r < B; r++)
                    for (int i = 0; i < r; i++) {
                        double s = 0;
                        for (int d = 0; d < D; d++) s += k[r][d] * k[i][d] * exp(G[r][d] - G[i][d]);
                        Lr[r][i] = beta[r] * s;
                    }
                for (int c = 0; c < B; c++)
                    for (int r = 0; r < B; r++) {
                        double s = r == c ? 1.0 : 0.0;
                        for (int kk = c; kk < r; kk++) s -= Lr[r][kk] * Xr[kk][c];
                        Xr[r][c] = r < c ? 0.0 : s;
                    }
                for (int r = 0; r < B; r++)
                    for (int d = 0; d < D; d++) {
                        double sw = 0, su = 0;
                        for (int i = 0; i <= r; i++)
                            sw += Xr[r][i] * beta[i] * exp(G[i][d]) * k[i][d], su += Xr[r][i] * beta[i] * v[i][d];
                        Wr[r][d] = sw, Ur[r][d] = su;
                    }
                for (int r = 0; r < B; r++) {
                    for (int c = 0; c < B; c++) nx += Xr[r][c] * Xr[r][c];
                    for (int d = 0; d < D; d++) nw += Wr[r][d] * Wr[r][d], nu += Ur[r][d] * Ur[r][d];
                }
                for (int f = 0; f < NF; f++) {
                    static float L[B][B], X[B][B];
                    if (f == NF - 1) { /* exact */
                        for (int r = 0; r < B; r++) {
                            for (int d = 0; d < D; d++) {
                                const float w = bf16((float)Wr[r][d]), u = bf16((float)Ur[r][d]);
                                ew[f] += (w - Wr[r][d]) * (w - Wr[r][d]), eu[f] += (u - Ur[r][d]) * (u - Ur[r][d]);
                                flips[f] += (w != Wf[r][d]) + (u != Uf[r][d]);
                            }
                            for (int i = 0; i <= r; i++) {
                                const float aq = bf16((float)Ar[r][i]);
                                ea[f] += (aq - Ar[r][i]) * (aq - Ar[r][i]);
                                flips[f] += aq != Af[r][i];
                            }
                        }
                        continue;
                    }
                    form_L(f, L);
                    form_X(f, L, X);
                    for (int r = 0; r < B; r++) {
                        float xr[B], ek[B], vv[B];
                        for (int c = 0; c < B; c++) {
                            ex[f] += (X[r][c] - Xr[r][c]) * (X[r][c] - Xr[r][c]);
                            xr[c] = X[r][c] * (float)beta[c];
                        }
                        for (int d = 0; d < D; d++) {
                            for (int i = 0; i < B; i++)
                                ek[i] = (float)k[i][d] * expf((float)G[i][d]), vv[i] = (float)v[i][d];
                            const float w = bf16(dotp(xr, ek, r + 1, 1)), u = bf16(dotp(xr, vv, r + 1, 1));
                            ew[f] += (w - Wr[r][d]) * (w - Wr[r][d]), eu[f] += (u - Ur[r][d]) * (u - Ur[r][d]);
                            if (!f) Wf[r][d] = w, Uf[r][d] = u, nflip += 2;
                            else flips[f] += (w != Wf[r][d]) + (u != Uf[r][d]);
                        }
                        for (int i = 0; i <= r; i++) {
                            const float aq = bf16(fent(q, f, r, i));
                            ea[f] += (aq - Ar[r][i]) * (aq - Ar[r][i]);
                            if (!f) Af[r][i] = aq, nflip++;
                            else flips[f] += aq != Af[r][i];
                        }
                    }
                }
            }
            for (int f = 0; f < NF; f++)
                printf("| %.0f | %.0f | %s | %.3e | %.3e | %.3e | %.3e | %.2f %% |\n", corrs[ci], lbs[li], fname[f],
                       sqrt(ex[f] / nx), sqrt(ew[f] / nw), sqrt(eu[f] / nu), sqrt(ea[f] / na), 100.0 * flips[f] / nflip);
            fflush(stdout);
        }
    return 0;
}
