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

#include <stddef.h>
#include <stdint.h>

#include "base/tensor.h"

/* CPU backend: below this many multiply-adds an op runs on the calling thread. OpenMP fork/join
 * and spin-waiting cost tens of microseconds, more than a small op (a decode step of a tiny model,
 * or any op when the cores are shared). */
#define PAR_MIN_WORK (1 << 18)

/* ---------------------------------------------------------------- dense */

/* The CUDA backend's precision, modelled on the CPU (process-wide, off by default; for the tests
 * that compare the CUDA forward with this reference): when on, op_matmul and op_matmul_mxfp4 round
 * both operands to bf16 (activations and weights, as the device feeds its GEMMs), op_embedding,
 * op_rmsnorm and op_rmsnorm_gated round their tables/weights to bf16, and the MLA attention ops
 * their W_kvb. fp32 accumulation is unchanged. Why a model of it rather than a looser tolerance:
 * top-k routing and the DSA top-k are discontinuous, so bf16 operands alone move some tokens to
 * other experts on the tiny goldens (max rel err 0.2-0.9 of the logits), which no tolerance that
 * still catches a wrong op can absorb; with the same roundings on both sides only summation order
 * differs. Not thread-safe to toggle while ops run. */
void op_set_bf16_operands(int on);
int op_bf16_operands(void);
/* Its helpers for the ops: x rounded to bf16 in place when on (else untouched); a rounded copy
 * (caller frees) when on, NULL when off. */
void op_bf16_round_in_place(float *x, size_t n);
float *op_bf16_copy(const float *x, size_t n);

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

/* ---------------------------------------------------------------- MLA, decode context parallelism
 * The absorbed form split into its three stages, so the middle one can run over a subset of the
 * cache (the tokens one DCP rank holds) and the partial results be merged exactly afterwards
 * (docs/parallel.md). Composed over the whole cache they compute op_mla_attention_absorbed. */

/* qlat[T, H, R + P] = [W_k_h^T q_nope_h | q_pe_h] per token and head (W_kvb as above). */
void op_mla_absorb_q(float *qlat, const float *q, const lunar_tensor *W_kvb, int T, int H, int N,
                     int P, int Vd, int R);

/* Attention of absorbed queries over listed cache rows, normalised over those rows only:
 *   s_j = scale * (qlat_lat . c_j + qlat_pe . k_pe_j)      j in rows(t)
 *   olat[t, h] = sum_j softmax_j(s) c_j          [R];   lse[t, h] = log sum_j exp(s_j)
 * rows(t) = rows[t * stride + i] for i < count[t], or 0 .. count[t]-1 when rows is NULL. A query
 * with count 0 gets olat = 0 and lse = -INFINITY (it contributes nothing to a merge).
 * qlat: [T, H, R + P]; cache: [*, R + P]; olat: [T, H, R]; lse: [T, H]. */
void op_mla_attention_partial(float *olat, float *lse, const float *qlat, const float *cache,
                              const int32_t *rows, const int32_t *count, int stride, int T, int H,
                              int R, int P, float scale);

/* Merges n partial results of the same queries over disjoint row sets, in order i = 0..n-1:
 *   M = max_i lse_i;  w_i = exp(lse_i - M);  out = sum_i w_i olat_i / sum_i w_i
 * part i: olat at parts + i * part_stride ([rows, R] with row pitch R + 1) and its lse in the
 * last column, i.e. one part is [rows, R + 1]. out: [rows, R]. Rows whose parts are all empty
 * (every lse -inf) get 0. */
void op_mla_merge_partials(float *out, const float *parts, int n, size_t part_stride, int rows, int R);

/* o[T, H, Vd] = W_v_h olat_h (the absorbed form's output projection). */
void op_mla_output_v(float *o, const float *olat, const lunar_tensor *W_kvb, int T, int H, int N,
                     int Vd, int R);

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

/* ---------------------------------------------------------------- Kimi-K3: AttnRes, SiTU, LayerNorm */

/* AttnRes depth mixing (k3_spec 3.2; fla naive_attnres with scale 1). For every token t and the S
 * candidate sources src[i] (each [n, D], i = 0..S-1):
 *   score_i = sum_d v_i[d] * (r[d] * p[d]) / sqrt(mean_d v_i[d]^2 + eps)   (= RMSNorm(v_i; r) . p)
 *   m       = sum_i softmax_i(score) v_i         (the RAW v_i; no temperature, no 1/sqrt(D))
 *   out     = out_norm ? RMSNorm(m; out_norm, eps) : m
 * proj p: the site's [1, D] (or [D]) pseudo-query; norm r: [D]; out_norm: [D] or NULL. The model's
 * final mix is the same operator (model.output_attn_res_*, out_norm = model.norm). One eps serves
 * both norms (K3: rms_norm_eps for both). With S = 1, m = v_0 exactly. Sums in double.
 * out may alias none of the sources. */
void op_attnres_mix(float *out, const float *const *src, int S, const lunar_tensor *proj,
                    const lunar_tensor *norm, const lunar_tensor *out_norm, int n, int D, float eps);

/* SiTU-GLU (k3_spec 6.1, ATOM SiTUv2): y = beta*tanh(g/beta)*sigmoid(g) * (beta_l*tanh(u/beta_l)).
 * beta_l <= 0 means "no linear beta" (u used unchanged). K3: beta = 4, beta_l = 25. y may alias g
 * or u. */
void op_situ_mul(float *y, const float *gate, const float *up, int64_t n, float beta,
                 float beta_l);

/* The gated activation an MLP or expert uses: SwiGLU (silu(g) * u) or SiTU(g, u; beta, beta_l). */
typedef enum lunar_glu_kind { LUNAR_GLU_SWIGLU = 0, LUNAR_GLU_SITU = 1 } lunar_glu_kind;
typedef struct lunar_glu {
    lunar_glu_kind kind;
    float beta, beta_l; /* SiTU only */
} lunar_glu;
/* y[i] = act(gate[i], up[i]). y may alias gate or up. */
void op_glu(float *y, const float *gate, const float *up, int64_t n, const lunar_glu *act);

/* SiTU MLP: y[n, D] = W_down( SiTU(W_gate x, W_up x) ). Shapes as op_swiglu_mlp. */
void op_situ_mlp(float *y, const float *x, const lunar_tensor *W_gate, const lunar_tensor *W_up,
                 const lunar_tensor *W_down, int n, float beta, float beta_l);

/* LayerNorm (PyTorch nn.LayerNorm, biased variance): per row of dim,
 * y = (x - mean) / sqrt(var + eps) * w + b. w, b: [dim] or NULL. y may alias x. Sums in double. */
void op_layernorm(float *y, const float *x, const lunar_tensor *w, const lunar_tensor *b, int n,
                  int dim, float eps);

/* ---------------------------------------------------------------- MXFP4 (OCP MX, compressed-tensors) */

/* One MXFP4 linear [out, in]: packed U8 [out, in/2] (column 2j in the LOW nibble of byte j, 2j+1
 * in the high nibble), scale U8 [out, in/32] (E8M0, 2^(s-127), one per 32 inputs). in % 32 == 0. */
typedef struct lunar_mxfp4 {
    const lunar_tensor *packed, *scale;
} lunar_mxfp4;

/* E2M1 code (low 4 bits used): bit 3 sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}. */
float lunar_e2m1_to_f32(uint8_t code);
/* E8M0: 2^(s-127) for s in 0..254; s = 255 is NaN (OCP MX). */
float lunar_e8m0_to_f32(uint8_t s);

/* Rule for E8M0 255 ("NaN" in OCP MX): the loader calls lunar_mxfp4_validate on every MXFP4
 * tensor pair and refuses the checkpoint on the first 255 (an error naming the tensor, row and
 * group). The kernels themselves never check: a 255 dequantises to NaN for its 32 weights, so
 * NaN propagates to every output that reads them (never a silently wrong finite value).
 * Also checks dtypes (U8) and shapes ([out, in/2] with [out, in/32], in % 32 == 0).
 * Returns 0 or -1 with err filled. */
struct lunar_err;
int lunar_mxfp4_validate(const lunar_mxfp4 *w, const char *name, struct lunar_err *err);

/* dst[in] = row r of W dequantised: E2M1(code) * 2^(scale - 127), exact in fp32 (a 255 scale
 * gives NaN). */
void lunar_mxfp4_dequant_row(float *dst, const lunar_mxfp4 *w, int64_t r);

/* fp32 -> MXFP4 for one row of `in` (multiple of 32) values, the OCP MX reference rule: per block of
 * 32, amax = max |x|; shared_exp = floor(log2(amax)) - 2 (emax of E2M1), clamped to [-127, 127]
 * (amax = 0 -> -127, byte 0); element = E2M1(x / 2^shared_exp) rounded to nearest, ties to the even
 * code (= compressed-tensors cast_to_fp4), saturating at +-6. A block holding a NaN or Inf gets
 * scale 255 (NaN). packed: in/2 bytes, scale: in/32 bytes. */
void lunar_mxfp4_quantize_row(uint8_t *packed, uint8_t *scale, const float *x, int in);

/* y[n, out] = x[n, in] . W^T with W MXFP4; one weight row dequantised at a time (per thread), never
 * the whole matrix. Accumulation as op_matmul (fp32). */
void op_matmul_mxfp4(float *y, const float *x, const lunar_mxfp4 *W, int n);

/* An MXFP4 expert: y[n, D] = w2( act(w1 x, w3 x) ). w1 (gate), w3 (up): [I, D]; w2 (down): [D, I]. */
void op_mxfp4_mlp(float *y, const float *x, const lunar_mxfp4 *w1, const lunar_mxfp4 *w3,
                  const lunar_mxfp4 *w2, int n, const lunar_glu *act);

/* ---------------------------------------------------------------- FP8, Hadamard, DSA indexer */

/* FP8 e4m3 with one power-of-two scale per vector (DeepSeek-V3.2 act_quant, scale_fmt ue8m0):
 *   amax = max(max_i |x_i|, 1e-4);  scale = 2^ceil(log2(amax / 448))  (exact, from the bits);
 *   q_i  = e4m3( clamp(x_i / scale, -448, 448) )   (round to nearest even; x / scale is exact)
 * Returns scale (an fp32 power of two); x ~= e4m3_to_f32(q) * scale. n values. */
float lunar_fp8_quantize_pow2(uint8_t *q, const float *x, int n);

/* PTPC-FP8 (per-token activation scale, per-output-channel weight scale; vLLM's ptpc_fp8), the
 * optional quantisation of the BF16 linears (SPEC §2). One vector (a weight row or a token):
 *   amax = max_i |x_i| (NaN ignored);  s = amax / 448 in fp32 (s = 1 when that is not > 0);
 *   q_i  = lunar_f32_to_e4m3(x_i / s)  (fp32 division, then round to nearest even, saturating at
 *          +-448: x_i / s may exceed 448 by an ulp);
 * returns s; x ~= e4m3_to_f32(q) * s. n values. */
float lunar_ptpc_quantize_row(uint8_t *q, const float *x, int n);
/* y[n, out] = (q_x[t] . q_w[o]) * s_x[t] * s_w[o] with (q_w[o], s_w[o]) = lunar_ptpc_quantize_row of
 * weight row o and (q_x[t], s_x[t]) that of token t (x rounded to bf16 first, and W too, when
 * op_set_bf16_operands is on: what the device quantises); the dot in fp32 over the decoded codes
 * (exact products), as op_matmul sums; scaled in the order (dot * s_x) * s_w. W: F32/BF16/F16. */
void op_matmul_ptpc_fp8(float *y, const float *x, const lunar_tensor *W, int n);

/* In-place orthonormal Walsh-Hadamard rotation of `rows` vectors of length len (a power of two):
 * x <- H x / sqrt(len), H the Sylvester (natural-order) Hadamard matrix, H[i][j] = (-1)^popcount(i&j)
 * (fast_hadamard_transform with scale len^-0.5). Applying it twice is the identity. */
void op_hadamard(float *x, int rows, int len);

/* Non-interleaved ("NeoX", half-split) RoPE on the first rot dims of each of nh heads of width hd:
 * for i < rot/2, (x_i, x_{i+rot/2}) is rotated by angle pos * inv_freq[i]; pos = pos0 + t.
 * x: [T, nh, hd] in place. inv_freq: [rot/2] (e.g. theta^(-2i/rot), or YaRN-corrected);
 * angles and cos/sin in double. DeepSeek-V3.2's indexer (index_rope = true). */
void op_rope_neox(float *x, const float *inv_freq, int T, int pos0, int nh, int hd, int rot);

/* The index-key cache of one layer, positions 0..L-1: either FP8 (codes [L, d] e4m3 + scales [L]
 * fp32 powers of two, from lunar_fp8_quantize_pow2) or fp32 keys [L, d] (quantisation off). */
typedef struct lunar_index_cache {
    const uint8_t *codes; /* non-NULL: FP8 mode */
    const float *scales;
    const float *keys;    /* used when codes == NULL */
} lunar_index_cache;

/* DSA lightning indexer (SPEC 1.1). Query token t sits at position pos0 + t and sees s <= pos0 + t.
 * iq: [T, nh, d] (already rotated by the Hadamard), w: [T, nh] (already times nh^-0.5 * d^-0.5).
 *   I(t, s) = sum_h w_h * ReLU(iq_h . ik_s)
 * FP8 mode: each query head is quantised like a key, (q8_h, sq_h) = lunar_fp8_quantize_pow2(iq_h),
 * and I(t, s) = sk_s * sum_h (w_h * sq_h) * ReLU(q8_h . k8_s): the e4m3 dot is formed exactly (in
 * double: every product is a multiple of 2^-18 below 2^18) and the head sum in double; since the
 * scales are powers of two this equals scoring the dequantised vectors. fp32 mode: the fp32 vectors,
 * dots and head sum in double. In both modes I is rounded to fp32 (the GPU kernels' logit type)
 * before ranking, so near-equal scores tie and the tie rule decides.
 * Selection: n = pos0 + t + 1 visible positions; if n <= topk all of them, else the topk best by I
 * with ties to the lower position. idx: [T, topk], the chosen positions in ASCENDING order, padded
 * with -1; count: [T] (may be NULL) = min(n, topk). */
void op_dsa_indexer(int32_t *idx, int32_t *count, const float *iq, const float *w,
                    const lunar_index_cache *cache, int T, int pos0, int nh, int d, int topk);

/* Sparse MLA (DSA): op_mla_attention_absorbed where query t attends only to the cache rows listed
 * in idx[t, 0..topk) (-1 entries skipped; each other entry in [0, L)), in the order listed. With
 * idx = 0..pos0+t ascending it computes exactly (bitwise) what the dense absorbed op does. A query
 * with no valid index gets o = 0. */
void op_mla_attention_sparse(float *o, const float *q, const float *cache,
                             const lunar_tensor *W_kvb, const int32_t *idx, int topk, int T, int L,
                             int H, int N, int P, int Vd, int R, float scale);

#endif
