/* The CUDA backend's C-callable API: runtime (device, arena, streams, events, graphs) and the
 * launchers of every CUDA op. All data pointers are DEVICE pointers unless a name says host.
 * Every op computes what its CPU counterpart in ops.h computes (the CPU op is the reference and
 * tests/test_cuda_ops.c checks each one against it); what differs is stated per op, usually the
 * storage type of activations (bf16 where the GEMMs want it) and the rounding that implies.
 * Launchers are asynchronous on the given stream (NULL = the legacy default stream) and abort with
 * file and line on a CUDA error (programming errors, like LUNAR_ASSERT); only lunar_cuda_init
 * reports failure as a value. Compiled in only when nvcc was found (LUNAR_HAVE_CUDA). */
#ifndef LUNAR_BACKEND_CUDA_CUDA_OPS_H
#define LUNAR_BACKEND_CUDA_CUDA_OPS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "base/err.h"

/* The same types as cudaStream_t / cudaEvent_t / cudaGraphExec_t, without cuda_runtime.h. */
typedef struct CUstream_st *lunar_cuda_stream;
typedef struct CUevent_st *lunar_cuda_event;
typedef struct CUgraphExec_st *lunar_cuda_graph;

/* Storage type of an activation buffer. */
typedef enum lunar_cuda_dtype { LUNAR_CUDA_F32 = 0, LUNAR_CUDA_BF16 = 1 } lunar_cuda_dtype;

/* ---------------------------------------------------------------- runtime */

/* Selects `device`, allocates the whole memory budget once (arena_bytes; 0 = all free memory but
 * 1 GiB) and creates the cuBLASLt handle. Idempotent for the same device. 0 or -1 with err. */
int lunar_cuda_init(int device, size_t arena_bytes, lunar_err *err);
/* Free and total memory of `device` (before or after init). 0 or -1 with err. */
int lunar_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes, lunar_err *err);
void lunar_cuda_shutdown(void);
int lunar_cuda_ready(void); /* 1 after a successful init */
/* programmatic dependent launch of the decode-path kernels (cuda_common.cuh, launch_pdl): on unless
 * LUNAR_CUDA_PDL=0; lunar_cuda_pdl_set(0 / 1) overrides it (tests), -1 returns to the env */
int lunar_cuda_pdl_on(void);
void lunar_cuda_pdl_set(int on);
/* the weight prefetch before the PDL wait: 0 none (default), 1 the projections (gemv, KDA gate,
 * MLA absorb), 2 also the MoE decode pair (LUNAR_PDL_PREFETCH); 0 whenever PDL is off. _set
 * overrides (tests), -1 = env */
int lunar_cuda_pdl_prefetch(void);
void lunar_cuda_pdl_prefetch_set(int level);
/* one block's prefetch bound in bytes for a kernel of prefetch level `level` (1 or 2): 0 when the
 * current level is below it; LUNAR_PDL_PREFETCH_KB (default 4) */
unsigned lunar_cuda_pdl_prefetch_bytes(int level);
/* Name, SM count, L2 size, memory of the selected device (one line). */
const char *lunar_cuda_describe(void);

/* Bump allocator over the arena, 256-byte aligned. NULL when the budget is exhausted. Free by
 * rewinding to a mark (stack discipline); there is no per-allocation free. */
void *lunar_cuda_alloc(size_t bytes);
size_t lunar_cuda_mark(void);
void lunar_cuda_release(size_t mark);
size_t lunar_cuda_arena_used(void);
size_t lunar_cuda_arena_size(void);

/* Synchronous copies and fill (they wait for the device). */
void lunar_cuda_upload(void *dst_dev, const void *src_host, size_t bytes);
void lunar_cuda_download(void *dst_host, const void *src_dev, size_t bytes);
void lunar_cuda_fill_u32(void *dst_dev, uint32_t value, size_t count); /* count 32-bit words */
void lunar_cuda_sync(void);
/* dst[r * dpitch + i] = src[r * spitch + i] for r < rows, i < width (bytes, device to device),
 * enqueued on the forward's stream without waiting (capturable): a strided row copy such as the
 * reorder of tensor parallelism's gathered vocabulary slices. */
void lunar_cuda_copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t rows);
/* The stream the NULL-stream ops of the forward go to right now: the legacy default stream (NULL)
 * or, while a decode step is captured, the capture stream. Work that leaves the runtime's ops (the
 * NCCL collectives of tensor parallelism) is ordered against this one. */
lunar_cuda_stream lunar_cuda_current_stream(void);
/* p[i] = uniform in [lo, hi) from a counter hash of (seed, i): device-side test and bench data. */
void lunar_cuda_fill_uniform(float *p, size_t n, uint32_t seed, float lo, float hi);
/* p[i] = sigmoid(p[i]) in place (beta from raw projections). */
void lunar_cuda_sigmoid_inplace(float *p, size_t n);
/* bf16 copy of fp32 data (round to nearest even). */
void lunar_cuda_f32_to_bf16(uint16_t *dst, const float *src, size_t n);
void lunar_cuda_f32_to_bf16_on(uint16_t *dst, const float *src, size_t n, lunar_cuda_stream s);

lunar_cuda_stream lunar_cuda_stream_create(void);
void lunar_cuda_stream_destroy(lunar_cuda_stream s);
void lunar_cuda_stream_sync(lunar_cuda_stream s);
lunar_cuda_event lunar_cuda_event_create(void);
void lunar_cuda_event_destroy(lunar_cuda_event e);
void lunar_cuda_event_record(lunar_cuda_event e, lunar_cuda_stream s);
void lunar_cuda_stream_wait(lunar_cuda_stream s, lunar_cuda_event e);
float lunar_cuda_event_ms(lunar_cuda_event start, lunar_cuda_event stop); /* waits for stop */

/* Graph capture for decode steps: begin on a (non-default) stream, enqueue launches, end returns
 * an instantiated graph; replay with launch. Pointers and shapes are baked in at capture. */
void lunar_cuda_graph_begin(lunar_cuda_stream s);
lunar_cuda_graph lunar_cuda_graph_end(lunar_cuda_stream s);
void lunar_cuda_graph_launch(lunar_cuda_graph g, lunar_cuda_stream s);
void lunar_cuda_graph_destroy(lunar_cuda_graph g);
/* The forward's decode steps (model/forward_cuda.c): between begin and end, every op launched on
 * the NULL stream is captured instead of run (on an internal stream); end instantiates it (NULL +
 * message when the driver refused the capture; *nodes: the graph's node count, may be NULL).
 * Replay with lunar_cuda_graph_launch(g, NULL) (the legacy stream). Uploads, downloads, fills and
 * syncs abort while capturing: each is a host round trip the graph could not replay. */
int lunar_cuda_capture_begin(lunar_err *err);
int lunar_cuda_capture_end(lunar_cuda_graph *out, size_t *nodes, lunar_err *err);
int lunar_cuda_capturing(void);

/* ---------------------------------------------------------------- dense (cuda_dense.cu, cuda_gemm.cu) */

/* op_matmul with bf16 operands: y[n, out] = x[n, in] . W[out, in]^T, fp32 accumulation (cuBLASLt),
 * y stored as ydt. Equals op_matmul on the bf16-rounded x and W up to fp32 summation order (and
 * the final bf16 rounding when ydt is BF16). lm_head is this with ydt = F32. */
void lunar_cuda_matmul(void *y, lunar_cuda_dtype ydt, const uint16_t *x, const uint16_t *W, int n,
                       int out, int in, lunar_cuda_stream s);
/* The same product from fp32 x, rounded to bf16 inside the kernel (the values of an f32 -> bf16 copy
 * followed by lunar_cuda_matmul, with one launch and no copy): only where the skinny kernel takes
 * the shape (n <= 4, or the tensor-core kernel's rows: lunar_cuda_gemv_mma_range; in % 8 == 0, 16-byte
 * aligned x and W, W up to 64 M elements; LUNAR_CUDA_GEMV not 0). Returns -1, launching nothing, elsewhere. */
int lunar_cuda_matmul_f32x(void *y, lunar_cuda_dtype ydt, const float *x, const uint16_t *W, int n, int out,
                           int in, lunar_cuda_stream s);
/* y[n, out] += (x . W^T + add) with add [n, out] or NULL, in the skinny kernel's epilogue (fp32 y): the
 * bits of lunar_cuda_matmul_f32x into t, then add t += add and y += t as separate fp32 additions, in one
 * launch. The same shapes as lunar_cuda_matmul_f32x; returns -1, launching nothing, elsewhere. */
int lunar_cuda_matmul_f32x_into(float *y, const float *x, const uint16_t *W, int n, int out, int in,
                                const float *add, lunar_cuda_stream s);
/* lunar_cuda_matmul where the skinny kernel takes the shape (as lunar_cuda_matmul_f32x, bf16 x; any
 * out, where cuBLASLt's path wants out % 8 == 0); returns -1, launching nothing, elsewhere. */
int lunar_cuda_matmul_bf16x(void *y, lunar_cuda_dtype ydt, const uint16_t *x, const uint16_t *W, int n, int out,
                            int in, lunar_cuda_stream s);
/* the row counts the skinny GEMM runs on the tensor cores (cuda_gemm.cu gemv_mma_kernel): lo..hi, at most
 * 32 (unset: LUNAR_GEMV_MMA_MIN / _MAX, else 3 and 16; hi < lo: none); the previous range into prev_* */
void lunar_cuda_gemv_mma_range(int lo, int hi, int *prev_lo, int *prev_hi);

/* PTPC-FP8 (ops.h lunar_ptpc_quantize_row, op_matmul_ptpc_fp8; cuda_fp8_gemm.cu).
 * Quantise `rows` rows of x ([rows, in], bf16, or fp32 rounded to bf16 first, by xdt) to e4m3 codes
 * q [rows, in] with one fp32 scale per row s [rows]: bit-identical to lunar_ptpc_quantize_row on the same values (weights
 * once at upload, activations per call). */
void lunar_cuda_ptpc_quantize(uint8_t *q, float *s, const void *x, lunar_cuda_dtype xdt, int rows, int in,
                              lunar_cuda_stream st);
/* y[n, out] = (qx[t] . qw[o]) * sx[t] * sw[o], y stored as ydt, fp32 accumulation (differs from the
 * CPU op in summation order and, in the scaled form, where the two scales are applied), by the
 * first form that takes the shape: (1) "scaled": cuBLASLt e4m3 GEMM with outer-vector fp32 scales;
 * (2) "unscaled" (ydt F32 only): cuBLASLt e4m3 GEMM into y, then y *= s_x s_w; (3) "fallback": a
 * plain fp32 kernel (also where in % 16, out * sizeof(y) % 16 or a pointer's 16-byte alignment
 * rules FP8 GEMMs out). lunar_cuda_ptpc_stats counts the calls per form; lunar_cuda_ptpc_force
 * (tests): 0 = all forms, 1 = skip the scaled form, 2 = the fallback only. */
void lunar_cuda_ptpc_matmul(void *y, lunar_cuda_dtype ydt, const uint8_t *qx, const float *sx, const uint8_t *qw,
                            const float *sw, int n, int out, int in, lunar_cuda_stream s);
/* Decode rows (n <= 4; in % 16 == 0, qw 16-byte aligned, n * in * 4 <= 160 KB; LUNAR_PTPC_GEMV not
 * 0): the whole PTPC linear in one launch from the unquantised x (bf16, or fp32 rounded to bf16 as
 * the GEMM operand): x quantised per row as lunar_cuda_ptpc_quantize (same codes and scales), the
 * e4m3 weight codes streamed once, y = (dot * s_x) * s_w with fp32 sums. Returns -1, launching
 * nothing, elsewhere (the caller quantises and takes lunar_cuda_ptpc_matmul). */
int lunar_cuda_ptpc_gemv(void *y, lunar_cuda_dtype ydt, const void *x, lunar_cuda_dtype xdt, const uint8_t *qw,
                         const float *sw, int n, int out, int in, lunar_cuda_stream s);
/* calls per form so far (each pointer may be NULL); gemv: lunar_cuda_ptpc_gemv calls taken */
void lunar_cuda_ptpc_stats(long long *scaled, long long *unscaled, long long *fallback, long long *gemv);
void lunar_cuda_ptpc_force(int level);
/* why the last scaled (outer-vector) plan was refused, "" if none was */
const char *lunar_cuda_ptpc_scaled_note(void);

/* The MLA absorption for many rows (prefill): q [rows, H, N+P] fp32 -> q_lat [rows, H, R] =
 * q_nope . W_UK per head and q_pe [rows, H, P] (the rope columns), with W = kv_b_proj bf16
 * [H*(N+Vd), R]; two fp32 strided-batched GEMMs over heads on W widened into w32 (H*(N+Vd)*R
 * floats of scratch, written here). The un-absorption o [rows, H, Vd] = W_UV . o_lat per head
 * reads the same w32 (so it must follow an absorb call on the same W). Equals the row kernels
 * (lunar_glue_mla_absorb / _unabsorb) up to fp32 summation order. */
void lunar_cuda_mla_absorb_gemm(float *q_lat, float *q_pe, float *w32, const float *q, const uint16_t *W,
                                int rows, int H, int N, int P, int Vd, int R, lunar_cuda_stream s);
void lunar_cuda_mla_unabsorb_gemm(float *o, const float *o_lat, const float *w32, int rows, int H, int N,
                                  int Vd, int R, lunar_cuda_stream s);

/* op_embedding from a bf16 table E[vocab, dim]; ids in [0, vocab). */
void lunar_cuda_embedding(void *y, lunar_cuda_dtype ydt, const uint16_t *E, const int32_t *ids,
                          int n, int dim, lunar_cuda_stream s);
/* The vocabulary-parallel embedding of one rank (tensor parallelism): E holds the rows [v0, v0 +
 * vn) of the table; y[t] = E[ids[t] - v0] for ids in that range, zeros for every other id (ids
 * from the whole vocabulary): op_embedding of the rank's rows, exactly, and the all-reduce of the
 * ranks' outputs is the full embedding (one non-zero term per row). fp32 output. */
void lunar_cuda_embedding_range(float *y, const uint16_t *E, const int32_t *ids, int n, int dim, int64_t v0,
                                int64_t vn, lunar_cuda_stream s);

/* op_attnres_mix fused with its out-norm, one pass over the candidates (cuda_attnres.cu): src
 * device array of S device pointers, each [n, D] fp32; u = proj * norm folded, fp32 [D]; on fp32
 * [D] or NULL (no out-norm); out [n, D] fp32 (not aliasing a candidate); outb [n, D] bf16 or NULL:
 * out's values rounded to nearest, the copy lunar_cuda_f32_to_bf16 would make (the next layer's GEMM
 * operand, one launch fewer). D <= 8192 (lunar_cuda_attnres_supported). */
int lunar_cuda_attnres_supported(int D);
void lunar_cuda_attnres_mix(float *out, uint16_t *outb, const float *const *src, int S, const float *u,
                            const float *on, int n, int D, float eps, lunar_cuda_stream s);
/* The AttnRes kernel's choice (tests, A/B; LUNAR_ATTNRES=block|cluster sets it at start): AUTO the
 * rule (cuda_attnres.cu: the cluster kernel for decode rows), BLOCK the one-block kernel always,
 * CLUSTER the cluster kernel wherever it applies (S <= 16). mode < 0: no change. Returns the previous. */
enum { LUNAR_ATTNRES_AUTO = 0, LUNAR_ATTNRES_BLOCK = 1, LUNAR_ATTNRES_CLUSTER = 2 };
int lunar_cuda_attnres_mode(int mode);

/* op_rmsnorm / op_rmsnorm_gated / op_l2norm. x, gate fp32; w bf16 [dim] (NULL: no weight, rmsnorm
 * only). Sum of squares in fp32 (tree order). y may alias x when ydt is F32. */
void lunar_cuda_rmsnorm(void *y, lunar_cuda_dtype ydt, const float *x, const uint16_t *w, int n,
                        int dim, float eps, lunar_cuda_stream s);
void lunar_cuda_rmsnorm_gated(void *y, lunar_cuda_dtype ydt, const float *x, const float *gate,
                              const uint16_t *w, int n, int dim, float eps, lunar_cuda_stream s);
void lunar_cuda_l2norm(float *y, const float *x, int n, int dim, float eps, lunar_cuda_stream s);
/* The residual add and the next norm in one launch: x += r (x [n, dim] updated in place), then
 * y = op_rmsnorm(x) as lunar_cuda_rmsnorm (y must not alias x or r). Bit-equal to the add followed by
 * lunar_cuda_rmsnorm. */
void lunar_cuda_add_rmsnorm(void *y, lunar_cuda_dtype ydt, float *x, const float *r, const uint16_t *w, int n,
                            int dim, float eps, lunar_cuda_stream s);
/* The same with an fp32 y and its bf16 copy yb [n, dim] (what lunar_cuda_f32_to_bf16 of y gives),
 * in one launch. y may be NULL: x and the bf16 copy alone (a prefill whose readers of the norm's
 * output all read the copy: [n, dim] fp32 not written). */
void lunar_cuda_add_rmsnorm_b(float *y, uint16_t *yb, float *x, const float *r, const uint16_t *w, int n, int dim,
                              float eps, lunar_cuda_stream s);

/* op_silu_mul / op_situ_mul on fp32 inputs; y stored as ydt (may alias gate or up when F32). */
void lunar_cuda_silu_mul(void *y, lunar_cuda_dtype ydt, const float *gate, const float *up,
                         int64_t n, lunar_cuda_stream s);
void lunar_cuda_situ_mul(void *y, lunar_cuda_dtype ydt, const float *gate, const float *up,
                         int64_t n, float beta, float beta_l, lunar_cuda_stream s);

/* op_short_conv for one sequence of T tokens: w fp32 [C, K] (K <= 8), state fp32 [C, K-1]. */
void lunar_cuda_short_conv(float *y, const float *x, const float *w, float *state, int T, int C,
                           int K, lunar_cuda_stream s);
/* Decode form: B sequences of one token each, x, y [B, C]; sequence b's state is
 * state_pool[slots[b]] ([C, K-1]); op_short_conv with T = 1 on each. */
void lunar_cuda_short_conv_decode(float *y, const float *x, const float *w, float *state_pool,
                                  const int32_t *slots, int B, int C, int K, lunar_cuda_stream s);

/* KDA decode after the fused input projection, one launch: op_short_conv (T = 1) of the 3 H dk
 * channels q|k|v of each of B sequences (row b at x + b x_stride; sequence b's state is
 * state_pool[slots[b]], [3 H dk, K-1], the q, k, v states in turn), op_l2norm (eps) of each q and k
 * head row, and beta = sigmoid(beta_in) (H logits at beta_in + b x_stride). Outputs q, k, v
 * [B, H dk] at qkv, qkv + B H dk, qkv + 2 B H dk; beta [B, H]. Bit-equal to
 * lunar_cuda_short_conv_decode + lunar_cuda_l2norm + lunar_cuda_sigmoid_inplace. dk a power of two
 * <= 1024. */
void lunar_cuda_kda_conv_qkv_decode(float *qkv, float *beta, const float *x, const float *beta_in,
                                    int64_t x_stride, const float *w, float *state_pool, const int32_t *slots,
                                    int B, int H, int dk, int K, float eps, lunar_cuda_stream s);

/* KDA prefill of one sequence after the fused input projection, one pass: x [T, x_stride] fp32
 * (16-byte aligned, x_stride % 4 == 0) holds the 3 H dk pre-conv channels q|k|v in columns 0 ..
 * 3 H dk - 1; q, k, v [T, H dk] = op_short_conv of each (conv weights w [3 H dk, K], state [3 H dk,
 * K-1] read, then advanced), q and k op_l2norm'ed per head row (eps); beta [T, H] = sigmoid of the
 * columns b_off ..; xa [T, a_w] and xg [T, g_w] = bf16 copies of the columns a_off .., g_off .. (the
 * low-rank gate inputs; width 0: none). dk = 128. */
void lunar_cuda_kda_conv_qkv_prefill(float *q, float *k, float *v, float *beta, uint16_t *xa, uint16_t *xg,
                                     const float *x, int64_t x_stride, int a_off, int a_w, int g_off, int g_w,
                                     int b_off, const float *w, float *state, int T, int H, int dk, int K, float eps,
                                     lunar_cuda_stream s);

/* KDA prefill: g [n, H dk] = op_kda_gate(xa [n, in] . W^T), xa bf16 (16-byte aligned), W = f_b [H dk, in]
 * bf16 (16-byte aligned), g 8-byte aligned; bf16 products, fp32 sums (a GEMM's; another order than
 * cuBLAS's). Replaces lunar_cuda_matmul into pre + lunar_cuda_kda_gate. The gate by default on the
 * SFU (ex2 / lg2.approx: within ~4e-7 exp(A_log) of op_kda_gate's, absolute in g; LUNAR_KDA_GATE=exact
 * libm's, cuda_dense.cu). Returns -1 (nothing launched) unless dk = 128 and in % 16 == 0, 16 <= in <= 256. */
int lunar_cuda_kda_gate_gemm(float *g, const uint16_t *xa, const uint16_t *W, int n, int H, int dk, int in,
                             const float *A_log, const float *dt_bias, float lb, lunar_cuda_stream s);

/* KDA decode, one token: g [H dk] = op_kda_gate(f_b . x[0, in)) and, og non-NULL, og [H dk] =
 * g_b . x[in, 2 in), W = [f_b; g_b] bf16 ([H dk, in] each; f_b alone when og is NULL), x fp32 (its
 * bf16 rounding the GEMM operand, as lunar_cuda_matmul_f32x), 16-byte aligned, in % 8 == 0. The
 * outputs equal the skinny GEMM + lunar_cuda_kda_gate (+ skinny GEMM) they replace. */
void lunar_cuda_kda_gate_proj_decode(float *g, float *og, const float *x, const uint16_t *W, int H, int dk, int in,
                                     const float *A_log, const float *dt_bias, float lb, lunar_cuda_stream s);
/* The same for n token rows: x row r at x + r x_stride (x_stride % 4 == 0 where n > 1), g and og [n, H dk];
 * row 0's outputs the bits of lunar_cuda_kda_gate_proj_decode on it, every row's those of that call on it. */
void lunar_cuda_kda_gate_proj_rows(float *g, float *og, const float *x, int64_t x_stride, int n, const uint16_t *W,
                                   int H, int dk, int in, const float *A_log, const float *dt_bias, float lb,
                                   lunar_cuda_stream s);

/* ---------------------------------------------------------------- KDA (cuda_kda*.cu) */

/* op_kda_gate: A_log fp32 [>= H], dt_bias fp32 [H*dk]. */
void lunar_cuda_kda_gate(float *g, const float *f, const float *A_log, const float *dt_bias, int T,
                         int H, int dk, float lower_bound, lunar_cuda_stream s);

/* op_kda_chunked for one sequence, chunk 64, dk = dv = 128: fp32 q, k, v, g, beta, o and state
 * S [H, dk, dv] (updated in place). Gates, Gamma and the state fp32; matmul operands per
 * lunar_cuda_kda_chunk_precision; see cuda_kda_chunk.cu. ws: lunar_cuda_kda_chunk_ws bytes
 * of device scratch. */
size_t lunar_cuda_kda_chunk_ws(int T, int H);
/* Precision mode, returns the previous one. 2 (default): bf16 scratch and bf16 mma.sync state
 * pass, fp32 gates, Gamma and state (<= 5e-3 relative to the CPU op, fla chunk_kda's rounding);
 * 1: 3xTF32 split matmuls, fp32-accurate (~5e-6); 0: plain tf32 (~7e-4); 3: mode 2's outputs
 * from the older, slower intra-chunk kernel (benchmark comparison). */
int lunar_cuda_kda_chunk_precision(int mode);
/* Mode 2's state pass where its 32-column blocks fit one per SM (H <= 33): 4 the warp-specialised
 * kernel (the default), 0 kda_state_bf16_kernel (as at larger H; other values too: session 9's staged
 * kernel, 3 / 2, measured no faster and was removed); bit-equal. -1 (default): LUNAR_KDA_STATE.
 * Returns the previous setting. */
int lunar_cuda_kda_state_variant(int v);
/* Benchmarks: record events around the two kernels of each call (on), and read the last call's
 * intra-chunk and state-pass times. */
void lunar_cuda_kda_chunk_profile(int on);
void lunar_cuda_kda_chunk_profile_ms(float *intra_ms, float *state_ms);
void lunar_cuda_kda_chunked(float *o, const float *q, const float *k, const float *v,
                            const float *g, const float *beta, float *S, int T, int H, float scale,
                            void *ws, lunar_cuda_stream s);

/* op_kda_recurrent for B sequences of T tokens each (decode: T = 1; speculative verify: T > 1).
 * q, k, g: [B, T, H, dk]; v, o: [B, T, H, dv]; beta: [B, T, H]. Sequence b's state is
 * S_pool[slots[b]] ([H, dk, dv] fp32). S_steps NULL: the slot is updated in place. S_steps
 * non-NULL ([B, T, H, dk, dv]): the state after each position t is written to S_steps[b, t] and
 * the slot is left unchanged (the caller keeps the accepted one). dk = 128, dv % 32 == 0. */
void lunar_cuda_kda_recurrent(float *o, const float *q, const float *k, const float *v,
                              const float *g, const float *beta, float *S_pool,
                              const int32_t *slots, float *S_steps, int B, int T, int H, int dk,
                              int dv, float scale, lunar_cuda_stream s);
/* The same with the pool (and S_steps) in fp16 ([H, dk, dv] halves per slot): loaded once, updated in
 * fp32, rounded to nearest at the store (the fp16 state option, lunar_state_pool.fp16 on the CPU). */
void lunar_cuda_kda_recurrent_f16(float *o, const float *q, const float *k, const float *v, const float *g,
                                  const float *beta, uint16_t *S_pool, const int32_t *slots, uint16_t *S_steps,
                                  int B, int T, int H, int dk, int dv, float scale, lunar_cuda_stream s);

/* The gate projections lunar_cuda_kda_decode_fused may make itself (one sequence, in = 128): w =
 * [f_b; g_b] bf16 ([H dk, 128] each; f_b alone unless og), x fp32 [2 x 128] (f_a's then g_a's
 * outputs, 16-byte aligned), A_log [H], dt_bias [H dk], lb the lower bound: g and og as
 * lunar_cuda_kda_gate_proj_decode computes them (the same bits). */
typedef struct lunar_cuda_kda_gate_rows {
    const uint16_t *w;
    const float *x, *A_log, *dt_bias;
    float lb;
    int og;
} lunar_cuda_kda_gate_rows;

/* KDA decode core of one token per sequence, one launch (issue 9): what
 * lunar_cuda_kda_conv_qkv_decode (x, beta_in, x_stride, conv_w = [3 H dk, K], conv_pool with
 * conv_slots, l2_eps), lunar_cuda_kda_recurrent (g [B, H dk] the activated forget gate, S_pool with
 * slots, fp32 or, state_fp16, halves; scale) and lunar_cuda_rmsnorm_gated (og [B, H dk] the output
 * gate's pre-activation, o_norm bf16 [dk], eps) compute in turn, with the same bits: o [B, H dk]
 * is the gated-normed output. dk = dv = 128 (a cluster of the 4 value tiles of a head), K <= 8.
 * gr non-NULL (B = 1): g, and og where gr->og, are made from gr (then g, og may be NULL). */
void lunar_cuda_kda_decode_fused(float *o, const float *x, int64_t x_stride, const float *beta_in,
                                 const float *conv_w, float *conv_pool, const int32_t *conv_slots, const float *g,
                                 const float *og, const uint16_t *o_norm, void *S_pool, int state_fp16,
                                 const int32_t *slots, int B, int H, int dk, int K, float l2_eps, float eps,
                                 float scale, const lunar_cuda_kda_gate_rows *gr, lunar_cuda_stream s);

/* ---------------------------------------------------------------- MLA (cuda_mla.cu) */

/* Storage of the paged MLA latent cache: bf16, or FP8 e4m3 with one per-tensor scale. */
typedef enum lunar_cuda_kv { LUNAR_CUDA_KV_BF16 = 0, LUNAR_CUDA_KV_FP8 = 1 } lunar_cuda_kv;

/* One MLA layer's paged latent cache (model/cache.h's layout): latent [n_blocks][128][576], row
 * [c (512) | k_pe (64)]; token p of sequence b sits in block block_tables[b * max_blocks + p / 128],
 * row p % 128. FP8: value = e4m3 * scale. */
typedef struct lunar_cuda_mla_cache {
    const void *latent;
    lunar_cuda_kv dtype;
    float scale;
    const int32_t *block_tables;
    int max_blocks;
} lunar_cuda_mla_cache;

/* Device scratch (bytes) for the split-K partials of a call with these rows, heads and longest
 * length (sparse: max_n = topk); 0 when the call runs unsplit (ws may then be NULL). */
size_t lunar_cuda_mla_ws(int rows, int H, int max_n);

/* op_mla_attention_absorbed's core over the paged cache, R = 512, P = 64: for each row r (a query
 * token of sequence row_seq[r], row_seq NULL = r) and head h,
 *   p_j = softmax_j(scale * (q_lat . c_j + q_pe . k_pe_j)), j < lens[r];  o_lat = sum_j p_j c_j
 * with q_lat [rows, H, 512] = W_k^T q_nope (absorbed by the caller), q_pe [rows, H, 64], o_lat
 * [rows, H, 512] fp32 (the caller applies W_v). Decode: one row per sequence, lens = its length.
 * Causal prefill: one row per token t, row_seq = the sequence, lens = pos0 + t + 1. max_len >=
 * every lens[r] (host value; it sizes the split-K). q and P are rounded to bf16 for the tensor
 * cores; a row with lens 0 gets o = 0. */
void lunar_cuda_mla_absorbed(float *o_lat, const float *q_lat, const float *q_pe,
                             const lunar_cuda_mla_cache *c, const int32_t *row_seq,
                             const int32_t *lens, int max_len, int rows, int H, float scale,
                             void *ws, lunar_cuda_stream s);

/* op_mla_attention_sparse's core (DSA): as above over the positions idx[r, 0..topk) of the row's
 * sequence (-1 entries skipped); a row with no valid entry gets o = 0. ws: lunar_cuda_mla_ws(rows,
 * H, topk). */
void lunar_cuda_mla_sparse(float *o_lat, const float *q_lat, const float *q_pe,
                           const lunar_cuda_mla_cache *c, const int32_t *row_seq,
                           const int32_t *idx, int topk, int rows, int H, float scale, void *ws,
                           lunar_cuda_stream s);

/* Decode context parallelism (cuda_mla_partial.cu): op_mla_attention_partial and
 * op_mla_merge_partials on the device, same arguments and layouts (qlat [T, H, R + P], cache
 * [*, R + P] fp32 contiguous, rows/count device int32, rows NULL = 0..count-1; parts [n][rows,
 * R + 1]). fp32 throughout; the partial uses an online softmax (the CPU takes the max first), so
 * results differ from the CPU's by fp32 summation order only. R <= 12286. */
void lunar_cuda_mla_partial(float *olat, float *lse, const float *qlat, const float *cache,
                            const int32_t *rows, const int32_t *count, int stride, int T, int H, int R,
                            int P, float scale, lunar_cuda_stream s);
/* The same with each (token, head)'s rows cut into `splits` equal slices, one block each, merged
 * after (splits 1: lunar_cuda_mla_partial). ws: lunar_cuda_mla_partial_ws bytes of device scratch
 * (none for splits 1). For decode, where a few (token, head) pairs would leave the GPU idle. */
size_t lunar_cuda_mla_partial_ws(int T, int H, int R, int splits);
void lunar_cuda_mla_partial_split(float *olat, float *lse, const float *qlat, const float *cache,
                                  const int32_t *rows, const int32_t *count, int stride, int T, int H, int R,
                                  int P, float scale, int splits, void *ws, lunar_cuda_stream s);
void lunar_cuda_mla_merge_partials(float *out, const float *parts, int n, size_t part_stride, int rows,
                                   int R, lunar_cuda_stream s);
/* DSA under DCP, shard_dcp.c's lunar_dcp_local_rows on the device: out[t, 0..count[t]) <- the
 * entries p of idx[t, 0..topk) (global positions, -1 = none) with p % D == dr, in order, as local
 * rows p / D (out may be idx; entries past count are not written). */
void lunar_cuda_dcp_local_rows(int32_t *out, int32_t *count, const int32_t *idx, int T, int topk, int D, int dr,
                               lunar_cuda_stream s);
/* The partial of lunar_cuda_mla_partial_split for G query groups of T tokens (qall [G][T, H, R + P]),
 * every group over token t's rows, read in place from DCP rank's pages: local row li of sequence
 * row_seq[t] is in block c->block_tables[seq, li / (128 / D)] at row li % (128 / D) of a pool whose
 * blocks have 128 / D rows (shard_dcp.c's layout, lunar_dcp_token), decoded as the CPU reads them
 * (bf16, or e4m3 * c->scale); rows NULL = local rows 0..count[t]-1. out [G][T, H, R + 1]: each (g, t,
 * h)'s olat then its lse (the DCP exchange's send layout). ws: lunar_cuda_mla_partial_ws(G T, H, R,
 * splits). One launch (two with splits), no host data: capturable in a CUDA graph. */
void lunar_cuda_dcp_partial_paged(float *out, const float *qall, const lunar_cuda_mla_cache *c,
                                  const int32_t *row_seq, const int32_t *rows, const int32_t *count, int stride,
                                  int G, int T, int H, int R, int P, int D, float scale, int splits, void *ws,
                                  lunar_cuda_stream s);
/* A step's tokens (row_seq, pos [T]) on DCP rank dr of D: slots[t] = the local slot of token t when
 * pos % D == dr (block bt[seq, pos / 128] of 128 / D rows, row (pos % 128) / D; lunar_dcp_token),
 * else -1 (lunar_cuda_latent_store skips it); count[t] = the sequence's rows up to pos that the
 * rank holds (positions dr, dr + D, ..: the causal count). */
void lunar_cuda_dcp_step_rows(int32_t *slots, int32_t *count, const int32_t *row_seq, const int32_t *pos,
                              const int32_t *bt, int max_blocks, int T, int D, int dr, lunar_cuda_stream s);
/* qsend [T, Hm, R + P] <- q_lat [T, nh, R] | q_pe [T, nh, P] per head, heads nh..Hm-1 zero (the DCP
 * group's padding heads). */
void lunar_cuda_dcp_pack_q(float *qsend, const float *q_lat, const float *q_pe, int T, int nh, int Hm, int R,
                           int P, lunar_cuda_stream s);

/* ---------------------------------------------------------------- DSA indexer (cuda_dsa.cu) */

/* f32 -> e4m3 on the device (the hardware conversion the kernels use) against the CPU's rounding
 * rule over every 2^32 float bit pattern: the number of inputs whose codes differ (0 expected; syncs) */
unsigned long long lunar_cuda_e4m3_mismatches(void);
/* Index keys into the paged FP8 key cache: for each token i, k[i] (fp32 [d], before the rotation)
 * is rotated by op_hadamard (d a power of two, <= 1024) and quantised by lunar_fp8_quantize_pow2
 * into codes[slots[i] * d ..] and scales[slots[i]] (slot = block * 128 + offset). Bitwise the CPU's
 * codes and scales. */
void lunar_cuda_dsa_index_write(uint8_t *codes, float *scales, const float *k,
                                const int32_t *slots, int n, int d, lunar_cuda_stream s);
/* The indexer's per-token prep of n tokens in one launch, the bits of the four it replaces:
 * lunar_glue_layernorm(ik, ik, ln_w, ln_b, n, d, eps), lunar_glue_scale(wt, wscale, n * ni),
 * lunar_glue_hadamard(iq, n * ni, d) and lunar_cuda_dsa_index_write(codes, scales, ik, slots, n, d)
 * (ik itself is left as it was). For 16 <= d <= 128 a power of two; returns -1, launching nothing,
 * elsewhere. */
int lunar_cuda_dsa_index_prep(uint8_t *codes, float *scales, const float *ik, float *iq, float *wt,
                              const int32_t *slots, int n, int ni, int d, const float *ln_w, const float *ln_b,
                              float eps, float wscale, lunar_cuda_stream s);

/* op_dsa_indexer's FP8 scores: for row r (query of sequence row_seq[r], NULL = r) and every
 * position j < lens[r], scores[r * ld + j] = I(r, j) as op_dsa_indexer forms it (query heads
 * quantised like keys, exact e4m3 dots, the head sum in double in head order, rounded once to
 * fp32): bitwise the CPU's scores. iq [rows, nh, d] (rotated), w [rows, nh]; nh <= 64, d <= 128,
 * d % 16 == 0. Keys through block_tables [n_seq, max_blocks] (128-token blocks). */
void lunar_cuda_dsa_index_score(float *scores, int ld, const float *iq, const float *w,
                                const uint8_t *codes, const float *scales,
                                const int32_t *block_tables, int max_blocks,
                                const int32_t *row_seq, const int32_t *lens, int max_len, int rows,
                                int nh, int d, lunar_cuda_stream s);

/* Which kernel computes those scores (all bitwise the CPU's): AUTO (default) is INT8 unless the
 * environment says LUNAR_DSA_SCORE=fp64 (or int8-sync / int8-pipe: the two INT8 kernels below); INT8:
 * e4m3 as three int8 limbs on the int8 tensor cores, several rows per block when rows > 256;
 * INT8_GROUPED: the same with several rows per block at any size (tests of the mixed-sequence
 * blocks); FP64: the dots in fp64 on the CUDA cores. INT8 is one of two kernels: SYNC (each tile's
 * codes loaded after the previous tile's math, 4 tiles per block) or PIPE (codes by cp.async ahead
 * of the math, fewer tiles per block at small sizes); the _SYNC / _PIPE modes pick one (tests,
 * benchmarks). Sets the mode, returns the previous one. */
enum {
    LUNAR_DSA_SCORE_AUTO = 0,
    LUNAR_DSA_SCORE_INT8 = 1,
    LUNAR_DSA_SCORE_FP64 = 2,
    LUNAR_DSA_SCORE_INT8_GROUPED = 3,
    LUNAR_DSA_SCORE_INT8_SYNC = 4,
    LUNAR_DSA_SCORE_INT8_SYNC_GROUPED = 5,
    LUNAR_DSA_SCORE_INT8_PIPE = 6,
    LUNAR_DSA_SCORE_INT8_PIPE_GROUPED = 7,
};
int lunar_cuda_dsa_score_mode(int mode);

/* op_dsa_indexer's selection from those scores: row r keeps the topk best of its lens[r]
 * positions (ties to the lower position), idx [rows, topk] ascending, padded with -1; count [rows]
 * = min(lens[r], topk) (may be NULL). Exact radix select on (score, position). Scores must not be
 * NaN. lens[r] < 2^31. */
void lunar_cuda_dsa_topk(int32_t *idx, int32_t *count, const float *scores, int ld,
                         const int32_t *lens, int rows, int topk, lunar_cuda_stream s);

/* ---------------------------------------------------------------- latent MoE (cuda_moe.cu) */

/* op_router_topk on fp32 logits [n, E] (E <= 4096); bias fp32 [E] or NULL (cuda_router.cu). One warp
 * per token (E <= 1024, k <= 64; else, or with LUNAR_ROUTER=block, one block): sigmoid, bias, group
 * mask, k rounds of argmax (ties to the lower index, as the CPU), renormalise in selection order,
 * scale. experts, weights: [n, k]. */
void lunar_cuda_router_topk(int32_t *experts, float *weights, const float *logits,
                            const float *bias, int n, int E, int k, int n_group, int topk_group,
                            int renorm, float scale, lunar_cuda_stream s);

/* Expert-contiguous order of the n*k (token, slot) pairs. Rows of expert e are
 * [offsets[e], offsets[e+1]); their order inside an expert is unspecified (atomics), which
 * changes no result: every row is computed independently and the combine sums a token's k rows
 * in slot order. active[0..*n_active) lists the experts with rows (increasing id); tiles lists
 * the prefill M tiles (expert, first row) of LUNAR_CUDA_MOE_BM rows, *n_tiles of them; groups
 * the decode token groups (expert, first row) of up to 8 rows, *n_groups of them, and gdone one
 * zeroed counter per group (the fused decode kernel's gate/up -> down dependency). */
#define LUNAR_CUDA_MOE_BM 128
typedef struct lunar_cuda_moe_route {
    int n, k, E;
    int32_t *experts;   /* [n, k] (router output, input of the permutation) */
    float *weights;     /* [n, k] */
    int32_t *offsets;   /* [E + 2]: [E + 1] only with route_one's shared row (virtual expert E) */
    int32_t *row_token; /* [n*k] token of each permuted row */
    float *row_weight;  /* [n*k] router weight of each permuted row */
    int32_t *pair_row;  /* [n*k] permuted row of pair (t, j) */
    int32_t *active;    /* [E] */
    int32_t *tiles;     /* [2 * max tiles] (expert, first row) */
    int32_t *groups;    /* [2 * max groups] (expert, first row) */
    int32_t *gdone;     /* [max groups + 1]: per group, then the fused kernel's exit count */
    int32_t *counts;    /* [E + 3] scratch; counts[E] = n_active, [E + 1] = n_tiles, [E + 2] = n_groups */
    int32_t *cursor;    /* [E] scratch */
    /* set by the caller (init: 0) when the route's kernels ran at least two launches before the experts on
     * their stream (K3's latent path: route, latent down-projection, bf16 copy, experts): the experts'
     * gate/up kernel may then read the route and start its weight copies before its PDL wait
     * (cuda_common.cuh's rule; cuda_moe_f16wg.cu's pre note) */
    int settled;
} lunar_cuda_moe_route;
size_t lunar_cuda_moe_route_bytes(int n, int k, int E);
/* Carves r's buffers out of ws (lunar_cuda_moe_route_bytes of device memory). */
void lunar_cuda_moe_route_init(lunar_cuda_moe_route *r, void *ws, int n, int k, int E);
/* Fills offsets .. tiles from r->experts / r->weights. Any n >= 1, empty and overloaded experts. */
void lunar_cuda_moe_permute(lunar_cuda_moe_route *r, lunar_cuda_stream s);
/* One token (r->n == 1, r->k <= 64): lunar_cuda_router_topk into r->experts / r->weights and then
 * lunar_cuda_moe_permute's result, in one launch (the decode step at batch 1 took five: top-k,
 * memset, count, scan, scatter). Leaves r as the pair would, byte for byte. shared = 1: the top-k
 * is r->k - 1 and the shared expert joins as one more routed row: virtual expert E (the experts'
 * s1/s3/s2), permuted row r->k - 1, weight 1, last in the combine's sum (the decode kernels read
 * its weights; the side stream's SiLU and down projection disappear). */
void lunar_cuda_moe_route_one(lunar_cuda_moe_route *r, const float *logits, const float *bias, int n_group,
                              int topk_group, int renorm, float scale, int shared, lunar_cuda_stream s);
/* The router kernels' choice (tests; LUNAR_ROUTER sets it at start): 0 the warp router, grouped, its
 * sigmoid and permutation loops rolled from 16 candidates a lane (E > 256; =warp); 1 the block router
 * (=block); 2 the warp router, flat (=flat); 3 the warp router, grouped, unrolled (=unrolled); 4 the
 * sorting router up to 256 tokens, E <= 1024, k <= 32, no groups, else mode 0 (unset: the default).
 * mode < 0: no change. Returns the previous. */
int lunar_cuda_router_mode(int mode);

/* The routed experts, stacked per expert. MXFP4 (compressed-tensors layout per expert, as
 * lunar_mxfp4): w1q/w3q [E, I, D/2], w1s/w3s [E, I, D/32], w2q [E, D, I/2], w2s [E, D, I/32];
 * BF16: w1/w3 [E, I, D], w2 [E, D, I]. act: 0 SwiGLU, 1 SiTU(beta, beta_l). D, I multiples of
 * 128. */
typedef struct lunar_cuda_moe_experts {
    int E, D, I, mxfp4, act;
    float beta, beta_l;
    const uint8_t *w1q, *w1s, *w3q, *w3s, *w2q, *w2s;
    const uint16_t *w1, *w3, *w2;
    /* BF16 only, or NULL: the shared expert as virtual expert E (same I), s1/s3 [I, D], s2 [D, I],
     * read by the decode kernels (paths 1 and 8) for a route_one(shared = 1) route */
    const uint16_t *s1, *s3, *s2;
} lunar_cuda_moe_experts;

/* The experts on the permuted rows: hbuf[r, I] = bf16(act(w1 z, w3 z)) for z = x[row_token[r]]
 * (bf16 [n, D]), ybuf[r, D] = row_weight[r] * (w2 hbuf[r]) (fp32). Weights widened to bf16 in
 * registers (exact: E2M1 * 2^(s-127) has 3 significant bits), tensor cores (mma.sync bf16,
 * fp32 accumulation). path: 0 auto (n <= 64: the decode kernel pair; MXFP4 with a clamped SiTU path
 * 16, other MXFP4 path 8 at I >= 1024 and n >= 32; LUNAR_MOE_DECODE=pair|v2|fused|f16 forcing one; above,
 * path 12 for BF16 experts and path 22 for MXFP4, or for both path 2 / 4 / 6 when LUNAR_MOE_PREFILL=old /
 * wg / ws), 1 the decode kernel
 * pair (n <= 64), 2 the mma.sync grouped GEMM, 3 the fused decode kernel (one persistent grid for
 * both GEMMs; MXFP4 and n <= 64, BF16 falls back to 1), 4 the wgmma grouped GEMM (cuda_moe_wg.cu),
 * 5 the same with 128-row weight tiles throughout (4 uses 256 where R allows), 6 the
 * warp-specialised wgmma grouped GEMM (cuda_moe_ws.cu: a producer warpgroup, TMA for BF16 weights;
 * shapes it does not take run 4), 7 the same in clusters of 2 blocks sharing BF16 weight tiles by
 * TMA multicast (MXFP4: path 6), 8 the warp-team decode kernels (cuda_moe_dec.cu, n <= 64, MXFP4
 * and BF16; LUNAR_MOE_DECODE=v2 selects it in auto), 9 the same on 3 blocks only (tests: every warp
 * walks many units), 10 path 6 with the BF16 proxy fences moved from the consumer warps to the
 * producer (LUNAR_MOE_PREFILL=wsf selects it for BF16 experts, MXFP4 experts keep 14 then; path
 * 10 with MXFP4 weights runs path 6), 11 the same arriving one chunk after the copies instead of
 * two, 12 path 6 with the SFU approximations of exp / tanh / division in the gate/up epilogue
 * (MXFP4: 6; LUNAR_MOE_PREFILL=wsfast selects it for BF16 experts, MXFP4 experts keep 14), 14 the
 * warp-specialised wgmma kernel for MXFP4 experts with the widening in the consumer warpgroups,
 * each weight chunk widened once for two M tiles of an expert (cuda_moe_ws.cu; LUNAR_MOE_PREFILL=
 * wsmx2 selects it for MXFP4 experts, BF16 experts keep 12; BF16 weights: 12; 13, its one-tile
 * predecessor, was removed in session 9 and aborts as any unknown path), 16 the decode pair on f16
 * tensor cores (cuda_moe_f16.cu, n <= 64; MXFP4 experts with SiTU's clamp on u only, |h| <= beta *
 * beta_l, else path 1; h in f16 there), 17 path 12 in clusters of 2 blocks sharing each BF16
 * weight chunk by TMA multicast over an expert's pairs of M tiles, the odd last tiles paired without
 * multicast (LUNAR_MOE_PREFILL=wsmc selects it for BF16 experts, MXFP4 experts keep 14; MXFP4
 * weights: 6), 18 path 17 releasing the peer block's stages with CTA-scope remote arrivals
 * (LUNAR_MOE_PREFILL=wsmc2, as 17), 22 path 14 with the down epilogue's row weights loaded once per
 * item and the next item looked up before the drain (MXFP4's prefill default since session 10;
 * LUNAR_MOE_PREFILL=wsmx2 selects 14, =wsmxe 22, BF16 experts keep 12 under both; BF16 weights: 12).
 * hbuf: [n*k, I] bf16 (f16 under path 16), ybuf: [n*k, D] fp32 scratch. */
void lunar_cuda_moe_experts_run(float *ybuf, uint16_t *hbuf, const uint16_t *x,
                                const lunar_cuda_moe_experts *w, const lunar_cuda_moe_route *r,
                                int path, lunar_cuda_stream s);
/* Benchmarks: e (or NULL to stop) recorded on the stream between the gate/up and the down kernel
 * of paths 14, 16 and 22, so that events around lunar_cuda_moe_experts_run time each kernel. */
void lunar_cuda_moe_split_event(lunar_cuda_event e);
/* The same with ybuf [n*k, D] in bf16, each weighted expert row rounded once (round to nearest
 * even) from the fp32 value the other form stores (the forward's prefill default for MXFP4 experts
 * since session 11, for BF16 experts since session 13; LUNAR_MOE_YBUF=fp32 keeps fp32 rows: the
 * combine reads half the bytes, the down GEMM writes half). Only the prefill grouped GEMMs' shared
 * epilogue writes bf16 rows (paths 4-7, 10-12, 14, 17, 18, 22, 24-26, 28, 29 at n > 64, as path
 * resolves there; 24, 26 and 28 by bulk copies):
 * returns -1, launching nothing, where the path would be another (the caller runs the fp32 form). */
int lunar_cuda_moe_experts_run_b(uint16_t *ybuf, uint16_t *hbuf, const uint16_t *x, const lunar_cuda_moe_experts *w,
                                 const lunar_cuda_moe_route *r, int path, lunar_cuda_stream s);
/* acc[t, :] = sum_j ybuf[pair_row[t, j], :] (slot order), fp32 [n, D]. */
void lunar_cuda_moe_combine(float *acc, const float *ybuf, const lunar_cuda_moe_route *r, int D,
                            lunar_cuda_stream s);
/* The same with add [n, D] (16-byte aligned, or NULL) added to each token's sum: bit-equal to the
 * combine followed by lunar_glue_add(acc, add). */
void lunar_cuda_moe_combine_add(float *acc, const float *ybuf, const lunar_cuda_moe_route *r, int D,
                                const float *add, lunar_cuda_stream s);
/* The same over a bf16 ybuf (lunar_cuda_moe_experts_run_b): each row widened exactly, then the sum
 * in the same order (bit-equal to the fp32 form over the widened rows). */
void lunar_cuda_moe_combine_add_b(float *acc, const uint16_t *ybuf, const lunar_cuda_moe_route *r, int D,
                                  const float *add, lunar_cuda_stream s);

/* The combine folded into the residual add + RMSNorm after it: x[t] += sum_j rows[pair_row[t, j]]
 * (+ add[t]), y = rmsnorm(x) w, yb (or NULL) y's bf16 copy (y may be NULL where yb is not, as in
 * lunar_cuda_add_rmsnorm_b); rows: ybuf (fp32) or ybuf_b (bf16), exactly one. Bit-equal to lunar_cuda_moe_combine_add[_b] into a buffer followed by
 * lunar_cuda_add_rmsnorm[_b] from it. x = NULL: no residual, y = rmsnorm(sum (+ add)) w, bit-equal to
 * lunar_cuda_moe_combine_add[_b] into y followed by lunar_cuda_rmsnorm of y (K3's latent norm). Returns
 * -1, launching nothing, where that pair's norm would not be the vector kernel (LUNAR_NORM=block,
 * dim % 4, dim > 8192, misaligned rows): the caller runs the pair. */
int lunar_cuda_moe_combine_add_rmsnorm(float *y, uint16_t *yb, float *x, const float *ybuf, const uint16_t *ybuf_b,
                                       const lunar_cuda_moe_route *r, const float *add, const uint16_t *w, int dim,
                                       float eps, lunar_cuda_stream s);

/* The whole latent routed path of forward.c's moe_layer: x bf16 [n, H];
 * router bf16 [E, H], bias fp32 [E] or NULL; down bf16 [Lat, H]; norm bf16 [Lat] or NULL; up bf16
 * [H, Lat]; experts at width Lat. y [n, H] as ydt. ws: lunar_cuda_moe_layer_ws bytes. */
size_t lunar_cuda_moe_layer_ws(int n, int H, int k, const lunar_cuda_moe_experts *w);
void lunar_cuda_moe_layer(void *y, lunar_cuda_dtype ydt, const uint16_t *x, int n, int H,
                          const uint16_t *router, const float *bias, int k, int n_group,
                          int topk_group, int renorm, float scale, const uint16_t *down,
                          const uint16_t *norm, float eps, const uint16_t *up,
                          const lunar_cuda_moe_experts *w, int path, void *ws,
                          lunar_cuda_stream s);
/* Shared experts are not part of it: they depend only on x, so the caller runs them (bf16 GEMMs
 * and lunar_cuda_situ_mul) on a second stream after an event recorded once x is ready, and joins
 * with lunar_cuda_stream_wait before adding them to y (model/forward_cuda.c, moe_fused). */

/* ---------------------------------------------------------------- sampling (cuda_sample.cu) */

/* engine/sampler.c's lunar_sample on the device, one row of fp32 logits [rows, V] each: greedy
 * (argmax, ties to the lower id) when temperature <= 0 or top_k == 1; else temperature, top-k
 * (best by logit, then lower id), top-p (the shortest best-first prefix reaching top_p of the
 * survivors' mass), and the draw u in [0, 1) (taken on the host from the request's own stream,
 * lunar_rng_uniform, so a seed reproduces a generation on either backend): the first candidate in
 * rank order (id order without top-k/top-p) whose running mass exceeds u * total. The sets and the
 * order are the CPU's exactly; masses are summed in another order (fp64 partial sums), so a draw
 * within rounding of a boundary may pick the neighbour. params: device [rows]; ids: device [rows]. */
typedef struct lunar_cuda_sample_params {
    float temperature;
    int top_k;
    float top_p;
    float u;
} lunar_cuda_sample_params;
void lunar_cuda_sample(int32_t *ids, const float *logits, int rows, int V,
                       const lunar_cuda_sample_params *params, lunar_cuda_stream s);

#ifdef __cplusplus
}
#endif

#endif
