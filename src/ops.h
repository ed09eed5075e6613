/* Every op the Kimi family forward uses: signature, shapes and semantics. This is the contract
 * each backend implements; the CPU backend (src/backend/cpu/) is the reference.
 *
 * Conventions
 *  - Activations are fp32, row-major; a leading `n` or `T` is the number of tokens.
 *  - Weights are lunar_tensor views (F32, BF16 or F16), widened to fp32 on the fly; [out, in] for
 *    linears, as in PyTorch and the checkpoints.
 *  - Outputs never alias inputs unless the op says so.
 *  - Ops do not fail on valid shapes; shape mismatches are programming errors (LUNAR_ASSERT).
 */
#ifndef LUNAR_OPS_H
#define LUNAR_OPS_H

#include <stdint.h>

#include "base/tensor.h"

/* ---------------------------------------------------------------- dense */

/* y[n, out] = x[n, in] . W[out, in]^T. W: F32/BF16/F16, 2-D. */
void op_matmul(float *y, const float *x, const lunar_tensor *W, int n);

/* y[n, dim] = E[ids[i], :]. ids must be in [0, E.shape[0]). */
void op_embedding(float *y, const lunar_tensor *E, const int32_t *ids, int n);

/* Per row of `dim`: y = x / sqrt(mean(x^2) + eps) * w. w: [dim] or NULL (no weight). y may alias x. */
void op_rmsnorm(float *y, const float *x, const lunar_tensor *w, int n, int dim, float eps);

/* Gated RMSNorm (KDA output norm): per row of `dim`,
 * y = x / sqrt(mean(x^2) + eps) * w * sigmoid(gate). w: [dim], shared by all rows. y may alias x. */
void op_rmsnorm_gated(float *y, const float *x, const float *gate, const lunar_tensor *w, int n,
                      int dim, float eps);

/* Per row of `dim`: y = x / sqrt(sum(x^2) + eps). y may alias x. */
void op_l2norm(float *y, const float *x, int n, int dim, float eps);

/* y[i] = silu(gate[i]) * up[i], silu(a) = a * sigmoid(a). y may alias gate or up. */
void op_silu_mul(float *y, const float *gate, const float *up, int64_t n);

/* SwiGLU MLP: y[n, D] = W_down( silu(W_gate x) * (W_up x) ). gate/up: [I, D], down: [D, I]. */
void op_swiglu_mlp(float *y, const float *x, const lunar_tensor *W_gate, const lunar_tensor *W_up,
                   const lunar_tensor *W_down, int n);

/* ---------------------------------------------------------------- KDA */

/* Causal depthwise short convolution followed by SiLU, over T tokens and C channels.
 * w: [C, 1, K] (or [C, K]); tap K-1 multiplies the current token (PyTorch Conv1d, left pad K-1).
 * state: [C, K-1], the previous K-1 inputs of each channel, oldest first (zeros at sequence
 * start). On return state holds the last K-1 inputs (x included), ready for the next call.
 * x, y: [T, C]. y must not alias x. */
void op_short_conv(float *y, const float *x, const lunar_tensor *w, float *state, int T, int C,
                   int K);

/* KDA forget gate in log space, fp32. f: [T, H*dk] (f_b(f_a(x))), A_log: H values (a tensor of
 * >= H floats; extra padding ignored), dt_bias: [H*dk]. Writes g: [T, H*dk]:
 *   lower_bound == 0: g = -exp(A_log[h]) * softplus(f + dt_bias)   (softplus linear above 20)
 *   lower_bound <  0: g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)) */
void op_kda_gate(float *g, const float *f, const lunar_tensor *A_log, const lunar_tensor *dt_bias,
                 int T, int H, int dk, float lower_bound);

/* KDA, token by token (decode and the reference). Per token t and head h, with S: [dk, dv]:
 *   S  = Diag(exp(g_t)) S
 *   S += beta_t k_t (v_t - S^T k_t)^T
 *   o_t = S^T (q_t * scale)
 * q, k: [T, H, dk] (already L2-normalised), v: [T, H, dv], g: [T, H, dk] (log decay),
 * beta: [T, H] (post-sigmoid). S: [H, dk, dv] fp32, updated in place. o: [T, H, dv]. */
void op_kda_recurrent(float *o, const float *q, const float *k, const float *v, const float *g,
                      const float *beta, float *S, int T, int H, int dk, int dv, float scale);

/* The same result computed chunk-parallel (WY/UT representation, kda.md section 2): within each
 * chunk of `chunk` tokens the UT transform T = (I + L)^-1 Diag(beta), W = T (exp(Gamma) * K),
 * U = T V; then sequentially over chunks V_new = U - W S, O = (Q*exp(Gamma)) S + A_qk V_new,
 * S = Diag(exp(Gamma_C)) S + (K*exp(Gamma_C - Gamma))^T V_new. T need not be a multiple of chunk
 * (the last chunk is short; transformers zero-pads, which gives the same result). The CPU reference
 * keeps Gamma in double (transformers: fp32 cumsum, ~1e-5 relative noise); agrees with
 * op_kda_recurrent to ~5e-7 relative. */
void op_kda_chunked(float *o, const float *q, const float *k, const float *v, const float *g,
                    const float *beta, float *S, int T, int H, int dk, int dv, float scale,
                    int chunk);

/* ---------------------------------------------------------------- MLA */

/* Multi-head latent attention without positional rotation (NoPE), over a contiguous latent cache.
 * cache: [L, R + P] rows of [c (R = kv_lora_rank, already RMS-normalised) | k_pe (P = rope dim)].
 * q: [T, H, N + P] (N = qk_nope_head_dim), query t sits at absolute position pos0 + t and sees
 * cache rows 0..pos0+t (causal). W_kvb: [H*(N + Vd), R], per head N rows of k_nope then Vd rows
 * of v. For each head: k_j = [W_kvb_k c_j | k_pe_j], v_j = W_kvb_v c_j,
 *   o_t = sum_j softmax_j(scale * q_t . k_j) v_j.      o: [T, H, Vd].
 * naive: decompresses K and V for every position; absorbed: folds W_kvb into the query and the
 * output (q_lat = W_kvb_k^T q_nope, o = W_kvb_v (sum_j p_j c_j)). Both compute the same function. */
void op_mla_attention_naive(float *o, const float *q, const float *cache, const lunar_tensor *W_kvb,
                            int T, int pos0, int H, int N, int P, int Vd, int R, float scale);
void op_mla_attention_absorbed(float *o, const float *q, const float *cache,
                               const lunar_tensor *W_kvb, int T, int pos0, int H, int N, int P,
                               int Vd, int R, float scale);

/* ---------------------------------------------------------------- MoE routing */

/* Sigmoid router with selection bias (DeepSeek-V3 / Kimi): per token, s = sigmoid(logits);
 * selection score = s + bias (bias [E] or NULL). With n_group > 1, experts are split into
 * n_group groups, each group scored by the sum of its two best selection scores, and only the
 * topk_group best groups are eligible. The k best eligible experts are chosen (ties to the lower
 * index); their weights are the unbiased s, divided by their sum (+1e-20) when renorm, then
 * multiplied by scale. logits: [n, E]; experts, weights: [n, k], in decreasing selection score.
 * (transformers always runs the group step; with n_group = topk_group = 1 it selects everything,
 * which is what n_group <= 1 means here.) */
void op_router_topk(int32_t *experts, float *weights, const float *logits, const lunar_tensor *bias,
                    int n, int E, int k, int n_group, int topk_group, int renorm, float scale);

#endif
