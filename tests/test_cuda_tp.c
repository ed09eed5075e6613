/* Tensor parallelism on GPUs (issue 10): `lunar logits --backend cuda --tensor-parallel-size 2`
 * (two rank processes, one per GPU, NCCL all-reduces / all-gather at forward.c's lunar_tp_*
 * points) against the single-GPU CUDA forward (`--tensor-parallel-size 1`) on tiny goldens, over
 * a prefill of the prompt and one decode step per decode id (--decode-after). Skipped without
 * CUDA + NCCL or a GPU; with one GPU only the world-of-one rank path runs (see the test).
 *
 * The runs are separate processes (the lunar binary beside this one): the launcher forks its
 * ranks, and a CUDA context does not survive fork, so neither may come from this process after
 * earlier device tests.
 *
 * Reference and tolerance: the single-GPU CUDA forward, not the fp32 goldens (the bf16 GEMM
 * operands move routing / DSA top-k decisions away from the goldens: tests/test_cuda_forward.c).
 * Against it the TP ranks differ only in fp32 summation order (each rank's partial products of
 * the row-parallel projections, summed by the all-reduce) and in the bf16 rounding of operands
 * that order changes, so the criterion is test_cuda_forward's: the median row within 3e-2 of
 * max |logit| and argmax agreement on >= 95 % of the rows (a near-tie routing flip moves a few
 * rows; a wrong shard or a missing all-reduce moves all of them). */
#include "test.h"

#if !defined(LUNAR_HAVE_CUDA) || !defined(LUNAR_HAVE_NCCL)

TEST(cuda_tp_skipped) { fprintf(stderr, "[skipped: lunar was built without CUDA and NCCL] "); }

#else

#include <libgen.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "base/file.h"
#include "io/safetensors.h"
#include "lunar_bin.h"

#define TP_REF_TOL 3e-2
#define TP_GRAPH_TOL 1e-2 /* graphs vs eager under TP: the collectives' summation order at most (O(1) if broken) */
#define TP_ARGMAX_MIN 0.95

/* the .npy of `lunar logits` ([rows, V] f32); NULL on error */
static float *read_npy(const char *path, int rows, int V) {
    char *buf;
    size_t len;
    lunar_err err;
    if (lunar_read_file(path, (size_t)1 << 30, &buf, &len, &err)) return NULL;
    size_t hlen = len > 10 ? ((size_t)(unsigned char)buf[8] | (size_t)(unsigned char)buf[9] << 8) : 0;
    float *x = NULL;
    if (len == 10 + hlen + (size_t)rows * V * 4) {
        x = lunar_xmalloc((size_t)rows * V * 4);
        memcpy(x, buf + 10 + hlen, (size_t)rows * V * 4);
    }
    free(buf);
    return x;
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* median over rows of max |got - want| / max |want|; *agree: rows with the same argmax */
static double cmp_rows(const float *got, const float *want, int rows, int V, int *agree) {
    double mx = 0;
    for (long i = 0; i < (long)rows * V; i++) mx = fmax(mx, fabs(want[i]));
    double *e = lunar_xmalloc((size_t)rows * sizeof *e);
    for (int r = 0; r < rows; r++) {
        double md = 0;
        for (long i = (long)r * V; i < (long)(r + 1) * V; i++)
            md = isnan(got[i]) ? INFINITY : fmax(md, fabs((double)got[i] - want[i]));
        e[r] = mx > 0 ? md / mx : md;
        *agree += argmax(got + (size_t)r * V, V) == argmax(want + (size_t)r * V, V);
    }
    for (int i = 1; i < rows; i++) /* insertion sort: a few dozen rows */
        for (int k = i; k > 0 && e[k] < e[k - 1]; k--) {
            double t = e[k];
            e[k] = e[k - 1], e[k - 1] = t;
        }
    const double med = e[rows / 2];
    free(e);
    return med;
}

/* n comma-separated pseudo-random token ids below V (the same prompt in every process) */
static void random_ids(char *buf, int n, int V) {
    for (int i = 0; i < n; i++) buf += sprintf(buf, "%s%d", i ? "," : "", (int)((i * 2654435761u >> 8) % (unsigned)V));
}

/* Runs bin with argv (argv[0] = bin) in a child, with env NAME=VALUE set and stderr sent to log when
 * given; its exit status (128 + signal when killed). */
static int spawn_wait(const char *bin, char *const argv[], const char *env_name, const char *env_value,
                      const char *log) {
    fflush(stdout), fflush(stderr);
    pid_t p = fork();
    if (p == 0) {
        if (env_name) setenv(env_name, env_value, 1);
        if (log && !freopen(log, "w", stderr)) _exit(126);
        execv(bin, argv);
        _exit(127);
    }
    int st = 0;
    waitpid(p, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* lunar logits MODEL --ids IDS --decode-after T --backend cuda --out OUT [extra...]; its exit status */
static int run_lunar(const char *bin, const char *model, const char *ids, int T, const char *out, const char *tp,
                     const char *ep, const char *dcp) {
    char dec[32];
    snprintf(dec, sizeof dec, "%d", T);
    char *argv[] = {(char *)bin, "logits", (char *)model, "--ids", (char *)ids, "--decode-after", dec,
                    "--backend", "cuda", "--out", (char *)out, "--tensor-parallel-size", (char *)tp,
                    "--master-port", "29611", "--decode-context-parallel-size", dcp ? (char *)dcp : "1",
                    (char *)ep, NULL};
    return spawn_wait(bin, argv, NULL, NULL, NULL);
}

/* runs[k] = {tensor-parallel size, "--enable-expert-parallel" or NULL, decode-context-parallel size
 * or NULL} against the plain 1-GPU run */
static void tp_model(const char *bin, const char *name, const char *const (*runs)[3], int n_runs) {
    char gpath[512], model_dir[512];
    lunar_err err;
    lunar_st *g;
    snprintf(gpath, sizeof gpath, "tests/golden/%s/golden.safetensors", name);
    if (lunar_st_open(&g, gpath, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    const char *md = lunar_st_metadata(g, "model_dir");
    if (md)
        snprintf(model_dir, sizeof model_dir, "%s", md);
    else
        snprintf(model_dir, sizeof model_dir, "tests/golden/%s", name);
    const lunar_tensor *pid = lunar_st_find(g, "prompt_ids"), *did = lunar_st_find(g, "decode_ids"),
                       *pl = lunar_st_find(g, "prefill_logits");
    CHECK(pid && did && pl);
    if (!pid || !did || !pl) {
        lunar_st_close(g);
        return;
    }
    const int T = (int)pid->shape[0], nd = (int)did->shape[0], N = T + nd, V = (int)pl->shape[1];
    char *ids = lunar_xmalloc((size_t)N * 12 + 1), *w = ids;
    for (int i = 0; i < N; i++)
        w += sprintf(w, "%s%d", i ? "," : "", i < T ? ((const int32_t *)pid->data)[i] : ((const int32_t *)did->data)[i - T]);
    char ref_path[] = "/tmp/lunar-tp1-XXXXXX", tp_path[] = "/tmp/lunar-tp2-XXXXXX";
    int f1 = mkstemp(ref_path), f2 = mkstemp(tp_path);
    LUNAR_ASSERT(f1 >= 0 && f2 >= 0);
    close(f1), close(f2);
    int rc1 = run_lunar(bin, model_dir, ids, T, ref_path, "1", NULL, NULL);
    CHECK_MSG(rc1 == 0, "%s: lunar logits on one GPU exited %d", name, rc1);
    float *ref = rc1 == 0 ? read_npy(ref_path, N, V) : NULL;
    for (int k = 0; k < n_runs && ref; k++) {
        const char *tp = runs[k][0], *ep = runs[k][1] ? "+EP" : runs[k][2] ? "+DCP" : "   ";
        int rc2 = run_lunar(bin, model_dir, ids, T, tp_path, tp, runs[k][1], runs[k][2]);
        CHECK_MSG(rc2 == 0, "%s: lunar logits with TP %s%s exited %d", name, tp, ep, rc2);
        float *got = rc2 == 0 ? read_npy(tp_path, N, V) : NULL;
        CHECK_MSG(got != NULL, "%s: no logits from TP %s%s", name, tp, ep);
        if (!got) continue;
        int a_pre = 0, a_dec = 0;
        const double e_pre = cmp_rows(got, ref, T, V, &a_pre);
        const double e_dec = nd ? cmp_rows(got + (size_t)T * V, ref + (size_t)T * V, nd, V, &a_dec) : 0;
        fprintf(stderr, "\n  %-17s TP %s%s vs 1 GPU, median row: prefill %.1e decode %.1e, argmax %d/%d %d/%d", name,
                tp, ep, e_pre, e_dec, a_pre, T, a_dec, nd);
        CHECK_MSG(e_pre <= TP_REF_TOL && e_dec <= TP_REF_TOL, "%s: TP %s%s vs 1 GPU: prefill %.3g decode %.3g", name,
                  tp, ep, e_pre, e_dec);
        /* a world of one reorders no sum: the rank path must give the plain bits (H200: it does) */
        if (strcmp(tp, "1") == 0)
            CHECK_MSG(memcmp(got, ref, (size_t)N * V * sizeof(float)) == 0, "%s: TP 1%s differs from the plain run",
                      name, ep);
        CHECK_MSG(a_pre >= TP_ARGMAX_MIN * T && a_dec >= TP_ARGMAX_MIN * nd,
                  "%s: TP %s%s: argmax prefill %d/%d decode %d/%d", name, tp, ep, a_pre, T, a_dec, nd);
        free(got);
    }
    free(ref), free(ids);
    unlink(ref_path), unlink(tp_path);
    lunar_st_close(g);
}

/* With one GPU, "TP 1 + EP" still takes the whole rank-process path (the launcher, an NCCL comm of
 * one rank, the shard model, every TP hook of the CUDA forward with a world of one: the scattered
 * embedding, the all-gather of lm_head, the latent column slice, the generic MoE) and must give
 * the plain single-GPU logits; TP 2 (with and without EP) needs two GPUs. */
TEST(cuda_tp_matches_one_gpu) {
    char bin[1100];
    const int n = lunar_bin_for(1, "the rank path", bin, sizeof bin);
    if (n < 0) return;
    if (n < 2) fprintf(stderr, "[one GPU: TP 2 skipped, TP 1 + EP only] ");
    /* KDA + MLA + MoE (Kimi-Linear), dense + MoE, K3 (AttnRes, latent MoE; also with EP), K3.1 (DSA) */
    static const char *const one[][3] = {{"1", "--enable-expert-parallel", NULL}};
    static const char *const two[][3] = {{"1", "--enable-expert-parallel", NULL}, {"2", NULL, NULL}};
    static const char *const two_ep[][3] = {
        {"1", "--enable-expert-parallel", NULL}, {"2", NULL, NULL}, {"2", "--enable-expert-parallel", NULL}};
    tp_model(bin, "kimi-linear-tiny", n < 2 ? one : two, n < 2 ? 1 : 2);
    tp_model(bin, "tiny-a", n < 2 ? one : two, n < 2 ? 1 : 2);
    tp_model(bin, "k3-a", n < 2 ? one : two_ep, n < 2 ? 1 : 3);
    tp_model(bin, "k31-a", n < 2 ? one : two, n < 2 ? 1 : 2);
}

/* Decode context parallelism on CUDA (forward_cuda_dcp.c, --decode-context-parallel-size): TP 2 with DCP 2
 * (each GPU holds every other position's latent row, attends with both ranks' heads over them, the
 * partials merged by their log-sum-exp) against one GPU, under the same rule as TP: the merge
 * reorders the softmax sums (fp32) and the absorbed path runs fp32 over bf16 / FP8 rows where the
 * one-GPU kernels round q and P for the tensor cores, so differences of summation order and bf16
 * rounding are expected, and a wrong row, slot or head (O(1) logits) is not. Models with MLA: the
 * causal path (kimi-linear-tiny) and DSA (k31-a: the replicated top-k reduced to local rows). */
TEST(cuda_dcp_tp2_matches_one_gpu) {
    char bin[1100];
    const int n = lunar_bin_for(2, "DCP 2", bin, sizeof bin);
    if (n < 0) return;
    static const char *const dcp[][3] = {{"2", NULL, "2"}};
    tp_model(bin, "kimi-linear-tiny", dcp, 1);
    tp_model(bin, "k31-a", dcp, 1);
}

/* `--load-format dummy` under TP: the weights are generated on each device, a rank's shards as
 * windows of the full tensors (model/dummy.h: lunar_dummy_window), never on the host. The K3.1-
 * shaped small configs have lazy tensors of every kind a shard cuts: embed_tokens / lm_head rows
 * (1M elements, at the lazy threshold), MXFP4 expert rows (gate/up) and 32-column groups (down);
 * dummy-k31-tp's experts are wide enough (128 channels a rank) for the fused MoE kernels, so it
 * also runs the fused MXFP4 path under TP with the latent MoE's all-reduce and column slice.
 * A wrong window (offset, stride, nibble order) or a missing all-reduce gives a different model:
 * the median row error is then O(1), not the 3e-2 of summation order. Random dummy weights give
 * near-uniform logits (margins of 1e-3), so a few argmax flips are expected (measured on the
 * H200: 29/32 and 7/8 rows agree on dummy-k31-small) and only three quarters are required. */
#define DUMMY_ARGMAX_MIN 0.75
static int run_dummy(const char *bin, const char *cfg, const char *ids, int T, const char *out, const char *tp,
                     const char *dcp) {
    char dec[32];
    snprintf(dec, sizeof dec, "%d", T);
    char *argv[] = {(char *)bin, "logits", (char *)cfg, "--load-format", "dummy", "--ids",
                    (char *)ids, "--decode-after", dec, "--backend", "cuda", "--out", (char *)out,
                    "--tensor-parallel-size", (char *)tp, "--decode-context-parallel-size", (char *)dcp,
                    "--master-port", "29613", NULL};
    return spawn_wait(bin, argv, NULL, NULL, NULL);
}

TEST(cuda_tp_dummy_lazy_shards) {
    char bin[1100];
    const int n = lunar_bin_for(2, "TP 2", bin, sizeof bin);
    if (n < 0) return;
    enum { N = 40, T = 32, V = 4096 };
    char ids[N * 8];
    random_ids(ids, N, V);
    static const char *const cfgs[] = {"tests/data/dummy-k31-small", "tests/data/dummy-k31-tp"};
    for (int c = 0; c < 2; c++) {
        char ref_path[] = "/tmp/lunar-dtp1-XXXXXX", tp_path[] = "/tmp/lunar-dtp2-XXXXXX";
        int f1 = mkstemp(ref_path), f2 = mkstemp(tp_path);
        LUNAR_ASSERT(f1 >= 0 && f2 >= 0);
        close(f1), close(f2);
        const int rc1 = run_dummy(bin, cfgs[c], ids, T, ref_path, "1", "1"),
                  rc2 = run_dummy(bin, cfgs[c], ids, T, tp_path, "2", "1");
        CHECK_MSG(rc1 == 0 && rc2 == 0, "%s: lunar logits exited %d (1 GPU) and %d (TP 2)", cfgs[c], rc1, rc2);
        float *ref = rc1 == 0 ? read_npy(ref_path, N, V) : NULL, *got = rc2 == 0 ? read_npy(tp_path, N, V) : NULL;
        CHECK(!rc1 == !!ref && !rc2 == !!got);
        if (ref && got) {
            int a_pre = 0, a_dec = 0;
            const double e_pre = cmp_rows(got, ref, T, V, &a_pre);
            const double e_dec = cmp_rows(got + (size_t)T * V, ref + (size_t)T * V, N - T, V, &a_dec);
            fprintf(stderr, "\n  %s (lazy shards) TP 2 vs 1 GPU, median row: prefill %.1e decode %.1e, argmax %d/%d %d/%d",
                    cfgs[c], e_pre, e_dec, a_pre, T, a_dec, N - T);
            CHECK_MSG(e_pre <= TP_REF_TOL && e_dec <= TP_REF_TOL, "%s: prefill %.3g decode %.3g", cfgs[c], e_pre, e_dec);
            CHECK(a_pre >= DUMMY_ARGMAX_MIN * T && a_dec >= DUMMY_ARGMAX_MIN * (N - T));
        }
        free(ref), free(got);
        unlink(ref_path), unlink(tp_path);
    }
}

/* DCP's two device paths at Kimi-Linear-48B's MLA shapes (R 512, P 64, 32 heads: 16 a rank;
 * dummy weights, 4 layers, the 4th MLA). The tiny models never take the first: a prompt of 80 ids
 * is a fresh prefill, which under DCP runs one GPU's GEMM prefill kernel over the chunk's rows
 * (every rank holds them all before storing its share: lunar_cuda_dcp_fresh_pages); the 16 decode
 * steps after it attend over the shares through the partials, the exchange and the merge, on
 * pages of 64 rows a block. TP 2 + DCP 2 against one GPU under the dummy rule (a wrong share, slot
 * or page size is O(1)); the prefill rows against plain TP 2 are printed (the same kernels over the
 * same rows: expected equal up to the collectives' run-to-run order). */
static int run_kl48(const char *bin, const char *ids, int T, const char *out, const char *tp, const char *dcp) {
    char dec[32];
    snprintf(dec, sizeof dec, "%d", T);
    char *argv[] = {(char *)bin, "logits", "configs/kimi-linear-48b-a3b.json", "--load-format", "dummy",
                    "--num-layers", "4", "--ids", (char *)ids, "--decode-after", dec, "--backend", "cuda",
                    "--out", (char *)out, "--tensor-parallel-size", (char *)tp,
                    "--decode-context-parallel-size", (char *)dcp, "--master-port", "29617", NULL};
    return spawn_wait(bin, argv, NULL, NULL, NULL);
}

TEST(cuda_dcp_kl48_fresh_prefill_and_decode) {
    char bin[1100];
    const int n = lunar_bin_for(2, "DCP 2", bin, sizeof bin);
    if (n < 0) return;
    enum { N = 96, T = 80, V = 163840 };
    char ids[N * 8];
    random_ids(ids, N, V);
    char p1[] = "/tmp/lunar-dcpk1-XXXXXX", p2[] = "/tmp/lunar-dcpk2-XXXXXX", p3[] = "/tmp/lunar-dcpk3-XXXXXX";
    int f1 = mkstemp(p1), f2 = mkstemp(p2), f3 = mkstemp(p3);
    LUNAR_ASSERT(f1 >= 0 && f2 >= 0 && f3 >= 0);
    close(f1), close(f2), close(f3);
    const int rc1 = run_kl48(bin, ids, T, p1, "1", "1"), rc2 = run_kl48(bin, ids, T, p2, "2", "1"),
              rc3 = run_kl48(bin, ids, T, p3, "2", "2");
    CHECK_MSG(rc1 == 0 && rc2 == 0 && rc3 == 0, "lunar logits exited %d (1 GPU), %d (TP 2), %d (TP 2 + DCP 2)", rc1,
              rc2, rc3);
    float *ref = rc1 == 0 ? read_npy(p1, N, V) : NULL, *tp = rc2 == 0 ? read_npy(p2, N, V) : NULL,
          *got = rc3 == 0 ? read_npy(p3, N, V) : NULL;
    if (ref && got) {
        int a_pre = 0, a_dec = 0, a_tp = 0;
        const double e_pre = cmp_rows(got, ref, T, V, &a_pre);
        const double e_dec = cmp_rows(got + (size_t)T * V, ref + (size_t)T * V, N - T, V, &a_dec);
        const double e_tp = tp ? cmp_rows(got, tp, T, V, &a_tp) : -1;
        fprintf(stderr, "\n  KL48 shapes (dummy, 4 layers) TP 2+DCP 2 vs 1 GPU, median row: prefill %.1e decode %.1e, "
                        "argmax %d/%d %d/%d; prefill vs TP 2: median %.1e, argmax %d/%d",
                e_pre, e_dec, a_pre, T, a_dec, N - T, e_tp, a_tp, T);
        CHECK_MSG(e_pre <= TP_REF_TOL && e_dec <= TP_REF_TOL, "prefill %.3g decode %.3g", e_pre, e_dec);
        CHECK(a_pre >= DUMMY_ARGMAX_MIN * T && a_dec >= DUMMY_ARGMAX_MIN * (N - T));
    } else {
        CHECK_MSG(0, "unreadable logits (1 GPU %s, DCP %s)", ref ? "ok" : "missing", got ? "ok" : "missing");
    }
    free(ref), free(tp), free(got);
    unlink(p1), unlink(p2), unlink(p3);
}

/* DCP smaller than TP (issue 10): groups of D consecutive ranks, each with its own NCCL comm split
 * off the TP comm (lunar_dcp_comm), the partials exchanged inside the group, every all-reduce over
 * all TP ranks. Against one GPU under the dummy rule, as above: KL48's MLA shapes (the causal path;
 * 32 heads, 8 a rank at TP 4) and dummy-k31-small (DSA: the replicated top-k reduced to local rows;
 * 8 heads, 2 a rank), TP 4 + DCP 2 with 4 GPUs, and TP 8 + DCP 2 and 4 with 8. A group that
 * exchanged with the wrong ranks (another group's rows, or the TP comm's) gives O(1) errors, as
 * would a DCP rank that is not TP rank % D (its slots hold other positions). Skipped with fewer
 * than 4 GPUs; tp_dcp_comm_groups (CPU) and nccl_world_size_1 (one GPU) test the group split. */
static void dcp_small_case(const char *bin, const char *tp, const char *dcp) {
    enum { N = 96, T = 80, V = 163840, NS = 40, TS = 32, VS = 4096 };
    char ids[N * 8], sids[NS * 8];
    random_ids(ids, N, V);
    random_ids(sids, NS, VS);
    for (int c = 0; c < 2; c++) {
        const int n = c ? NS : N, t = c ? TS : T, v = c ? VS : V;
        char p1[] = "/tmp/lunar-dcps1-XXXXXX", p2[] = "/tmp/lunar-dcps2-XXXXXX";
        int f1 = mkstemp(p1), f2 = mkstemp(p2);
        LUNAR_ASSERT(f1 >= 0 && f2 >= 0);
        close(f1), close(f2);
        const char *what = c ? "dummy-k31-small (DSA)" : "KL48 shapes (dummy, 4 layers)";
        const int rc1 = c ? run_dummy(bin, "tests/data/dummy-k31-small", sids, t, p1, "1", "1")
                          : run_kl48(bin, ids, t, p1, "1", "1");
        const int rc2 = c ? run_dummy(bin, "tests/data/dummy-k31-small", sids, t, p2, tp, dcp)
                          : run_kl48(bin, ids, t, p2, tp, dcp);
        CHECK_MSG(rc1 == 0 && rc2 == 0, "%s: lunar logits exited %d (1 GPU) and %d (TP %s + DCP %s)", what, rc1, rc2,
                  tp, dcp);
        float *ref = rc1 == 0 ? read_npy(p1, n, v) : NULL, *got = rc2 == 0 ? read_npy(p2, n, v) : NULL;
        CHECK(!rc1 == !!ref && !rc2 == !!got);
        if (ref && got) {
            int a_pre = 0, a_dec = 0;
            const double e_pre = cmp_rows(got, ref, t, v, &a_pre);
            const double e_dec = cmp_rows(got + (size_t)t * v, ref + (size_t)t * v, n - t, v, &a_dec);
            fprintf(stderr, "\n  %s TP %s+DCP %s vs 1 GPU, median row: prefill %.1e decode %.1e, argmax %d/%d %d/%d",
                    what, tp, dcp, e_pre, e_dec, a_pre, t, a_dec, n - t);
            CHECK_MSG(e_pre <= TP_REF_TOL && e_dec <= TP_REF_TOL, "%s TP %s + DCP %s: prefill %.3g decode %.3g", what,
                      tp, dcp, e_pre, e_dec);
            CHECK(a_pre >= DUMMY_ARGMAX_MIN * t && a_dec >= DUMMY_ARGMAX_MIN * (n - t));
        }
        free(ref), free(got);
        unlink(p1), unlink(p2);
    }
}

TEST(cuda_dcp_smaller_than_tp_matches_one_gpu) {
    char bin[1100];
    const int n = lunar_bin_for(4, "TP 4 + DCP 2", bin, sizeof bin);
    if (n < 0) return;
    dcp_small_case(bin, "4", "2");
    if (n < 8) {
        fprintf(stderr, "\n  [%d GPUs: TP 8 + DCP 2 / 4 skipped, they need eight]", n);
        return;
    }
    dcp_small_case(bin, "8", "2");
    dcp_small_case(bin, "8", "4");
}

/* CUDA graphs under TP (LUNAR_TP_GRAPHS=1): the decode steps of a graph-eligible model (Kimi-
 * Linear-48B-A3B's shapes, dummy weights, 4 layers: KDA head 128, fused MoE at 512 channels a rank)
 * captured with their NCCL collectives and replayed, against the same TP 2 run eagerly. A graph is
 * the eager step's work, so the rows agree to the collectives' summation order at most (NCCL may
 * pick another algorithm for a captured call); a stale input, a missing collective or a replay
 * out of step between the ranks moves them by O(1). The run must report captures and replays,
 * else the test would compare eager with eager. */
static int run_logits_env(const char *bin, const char *ids, int T, const char *out, const char *graphs,
                          const char *dcp, const char *log) {
    char dec[32];
    snprintf(dec, sizeof dec, "%d", T);
    char *argv[] = {(char *)bin, "logits", "configs/kimi-linear-48b-a3b.json", "--load-format", "dummy",
                    "--num-layers", "4", "--ids", (char *)ids, "--decode-after", dec, "--backend", "cuda",
                    "--out", (char *)out, "--tensor-parallel-size", "2", "--master-port", "29615",
                    "--decode-context-parallel-size", (char *)dcp, NULL};
    return spawn_wait(bin, argv, "LUNAR_TP_GRAPHS", graphs, log);
}

/* TP 2, and TP 2 + DCP 2 (whose MLA layers take the device-only DCP path: slots, counts and the
 * in-place partial from the step's tables, the exchange's two all-gathers inside the graph) */
static void graphs_case(const char *bin, const char *dcp) {
    enum { N = 12, T = 4, V = 163840 };
    char ids[N * 8];
    random_ids(ids, N, V);
    char eager_path[] = "/tmp/lunar-tpg0-XXXXXX", graph_path[] = "/tmp/lunar-tpg1-XXXXXX",
         log_path[] = "/tmp/lunar-tpglog-XXXXXX";
    int f0 = mkstemp(eager_path), f1 = mkstemp(graph_path), f2 = mkstemp(log_path);
    LUNAR_ASSERT(f0 >= 0 && f1 >= 0 && f2 >= 0);
    close(f0), close(f1), close(f2);
    const int rc0 = run_logits_env(bin, ids, T, eager_path, "0", dcp, "/dev/null");
    const int rc1 = run_logits_env(bin, ids, T, graph_path, "1", dcp, log_path);
    CHECK_MSG(rc0 == 0 && rc1 == 0, "lunar logits exited %d (eager) and %d (graphs)", rc0, rc1);
    char *logtxt = NULL;
    size_t len = 0;
    lunar_err err;
    long cap = 0, rep = 0;
    if (lunar_read_file(log_path, 1 << 20, &logtxt, &len, &err) == 0) {
        const char *g = strstr(logtxt, "CUDA graphs: ");
        if (g) sscanf(g, "CUDA graphs: %ld captured, %ld replayed", &cap, &rep);
    }
    CHECK_MSG(cap >= 1 && rep >= 1, "no decode step was captured and replayed under TP (%ld, %ld): %.300s", cap, rep,
              logtxt ? logtxt : "");
    float *ref = rc0 == 0 ? read_npy(eager_path, N, V) : NULL, *got = rc1 == 0 ? read_npy(graph_path, N, V) : NULL;
    CHECK(!rc0 == !!ref && !rc1 == !!got);
    if (ref && got) {
        int a_dec = 0, same = 0;
        const double e_dec = cmp_rows(got + (size_t)T * V, ref + (size_t)T * V, N - T, V, &a_dec);
        for (int r = T; r < N; r++) same += memcmp(got + (size_t)r * V, ref + (size_t)r * V, (size_t)V * 4) == 0;
        fprintf(stderr, "\n  KL48 x4 layers TP 2 + DCP %s, graphs (%ld captured, %ld replayed) vs eager: decode median "
                        "row %.1e, argmax %d/%d, bitwise equal rows %d/%d",
                dcp, cap, rep, e_dec, a_dec, N - T, same, N - T);
        CHECK_MSG(e_dec <= TP_GRAPH_TOL, "decode rows: median %.3g", e_dec);
    }
    free(ref), free(got), free(logtxt);
    unlink(eager_path), unlink(graph_path), unlink(log_path);
}

TEST(graphs_tp_cuda_match_eager) {
    char bin[1100];
    if (lunar_bin_for(2, "TP 2", bin, sizeof bin) < 0) return;
    graphs_case(bin, "1");
    graphs_case(bin, "2");
}

#endif
