/* The CLI commands, driven in-process: argument errors are messages (exit status 1 or 2), and
 * `lunar logits` writes a .npy that holds exactly the logits the forward computes. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/file.h"
#include "cli/args.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "test.h"

int lunar_cmd_info(int argc, char **argv);
int lunar_cmd_logits(int argc, char **argv);
int lunar_cmd_generate(int argc, char **argv);

TEST(cli_parse_ids) {
    int32_t *ids;
    int n;
    lunar_err err;
    CHECK(lunar_parse_ids("1,22,333", &ids, &n, &err) == 0 && n == 3 && ids[2] == 333);
    free(ids);
    CHECK(lunar_parse_ids("1,,2", &ids, &n, &err) != 0 && strstr(err.msg, "item 2"));
    CHECK(lunar_parse_ids("1,x", &ids, &n, &err) != 0 && strstr(err.msg, "'x'"));
    CHECK(lunar_parse_ids("-1", &ids, &n, &err) != 0);
    CHECK(lunar_parse_ids("99999999999", &ids, &n, &err) != 0);
    CHECK(lunar_parse_ids("", &ids, &n, &err) != 0);
}

TEST(cli_kimi_linear_48b_parameter_counts) {
    lunar_config c;
    lunar_err err;
    CHECK_MSG(lunar_config_load(&c, "configs/kimi-linear-48b-a3b.json", &err) == 0, "%s", err.msg);
    lunar_param_counts p;
    lunar_config_count_params(&c, &p);
    /* The model card: 48 B total, 3 B activated. Routed experts alone are 26 x 256 x 3 x 2304 x
     * 1024 = 47.1 B (49.1 B in all); active is 8 of 256 experts per layer plus lm_head, attention,
     * shared experts and the dense layer = 3.1 B. */
    CHECK_MSG(p.total > 48.0e9 && p.total < 50.0e9, "total %lld", (long long)p.total);
    CHECK_MSG(p.active > 2.9e9 && p.active < 3.3e9, "active %lld", (long long)p.active);
    CHECK(p.routed_experts == 26LL * 256 * 3 * 2304 * 1024);
}

static int run_quiet(int (*cmd)(int, char **), int argc, char **argv) {
    fflush(stderr);
    fflush(stdout);
    int saved_err = dup(2), saved_out = dup(1);
    FILE *null = fopen("/dev/null", "w");
    dup2(fileno(null), 2);
    dup2(fileno(null), 1);
    int rc = cmd(argc, argv);
    fflush(stderr);
    fflush(stdout);
    dup2(saved_err, 2);
    dup2(saved_out, 1);
    close(saved_err);
    close(saved_out);
    fclose(null);
    return rc;
}

TEST(cli_errors_are_messages) {
    char *a1[] = {"logits", "tests/golden/tiny-a", "--ids", "1,2"}; /* no --out */
    CHECK(run_quiet(lunar_cmd_logits, 4, a1) == 1);
    char *a2[] = {"generate", "/nonexistent/model", "--ids", "1"};
    CHECK(run_quiet(lunar_cmd_generate, 4, a2) == 1);
    char *a3[] = {"generate", "tests/golden/tiny-a", "--ids", "1", "--backend", "tpu"};
    CHECK(run_quiet(lunar_cmd_generate, 6, a3) == 1);
    char *a4[] = {"generate", "tests/golden/tiny-a", "--ids", "1", "--top-p", "2"};
    CHECK(run_quiet(lunar_cmd_generate, 6, a4) == 1);
    char *a5[] = {"info"};
    CHECK(run_quiet(lunar_cmd_info, 1, a5) == 2);
    char *a6[] = {"info", "configs/kimi-linear-48b-a3b.json"};
    CHECK(run_quiet(lunar_cmd_info, 2, a6) == 0);
}

TEST(cli_logits_writes_npy) {
    char out[] = "/tmp/lunar-test-logits-XXXXXX";
    int fd = mkstemp(out);
    CHECK(fd >= 0);
    close(fd);
    char *argv[] = {"logits", "tests/golden/tiny-a", "--ids", "5,6,7", "--out", out, "--backend", "cpu"};
    CHECK(run_quiet(lunar_cmd_logits, 8, argv) == 0);
    char *buf;
    size_t len;
    lunar_err err;
    if (lunar_read_file(out, 1 << 26, &buf, &len, &err) == 0) {
        CHECK(len > 10 && memcmp(buf, "\x93NUMPY\x01\x00", 8) == 0);
        size_t hlen = (size_t)(unsigned char)buf[8] | (size_t)(unsigned char)buf[9] << 8;
        CHECK((10 + hlen) % 64 == 0);
        CHECK(strstr(buf + 10, "'descr': '<f4'") != NULL);
        lunar_config c;
        CHECK(lunar_config_load(&c, "tests/golden/tiny-a/config.json", &err) == 0);
        char shape[64];
        snprintf(shape, sizeof shape, "'shape': (3, %d)", c.vocab_size);
        CHECK_MSG(strstr(buf + 10, shape) != NULL, "header: %.*s", (int)hlen, buf + 10);
        CHECK(len == 10 + hlen + 3 * (size_t)c.vocab_size * 4);
        free(buf);
    } else {
        CHECK_MSG(0, "%s", err.msg);
    }
    unlink(out);
}

/* `lunar logits` on the tiny K3.1 model reproduces the oracle's prefill logits through the CLI, and
 * `lunar generate` runs on it. */
TEST(cli_k31_logits_match_golden_and_generate_runs) {
    lunar_st *g;
    lunar_err err;
    if (lunar_st_open(&g, "tests/golden/k31-b/golden.safetensors", &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    const lunar_tensor *pid = lunar_st_find(g, "prompt_ids"), *pl = lunar_st_find(g, "prefill_logits");
    CHECK(pid && pl);
    if (!pid || !pl) {
        lunar_st_close(g);
        return;
    }
    const int T = (int)pid->shape[0], V = (int)pl->shape[1];
    char ids[8192] = "";
    size_t len = 0;
    for (int i = 0; i < T && len + 16 < sizeof ids; i++)
        len += (size_t)snprintf(ids + len, sizeof ids - len, "%s%d", i ? "," : "", ((const int32_t *)pid->data)[i]);
    char out[] = "/tmp/lunar-test-k31-XXXXXX";
    int fd = mkstemp(out);
    close(fd);
    char *argv[] = {"logits", "tests/golden/k31-b", "--ids", ids, "--out", out};
    CHECK(run_quiet(lunar_cmd_logits, 6, argv) == 0);
    char *buf;
    size_t n;
    if (lunar_read_file(out, 1 << 26, &buf, &n, &err) == 0) {
        size_t hlen = (size_t)(unsigned char)buf[8] | (size_t)(unsigned char)buf[9] << 8;
        CHECK(n == 10 + hlen + (size_t)T * V * 4);
        if (n == 10 + hlen + (size_t)T * V * 4) {
            float *got = lunar_xmalloc((size_t)T * V * sizeof(float));
            memcpy(got, buf + 10 + hlen, (size_t)T * V * sizeof(float));
            double e = lunar_max_rel_err(got, pl->data, (long)T * V);
            CHECK_MSG(e <= 1e-4, "max rel err %.3g", e);
            free(got);
        }
        free(buf);
    }
    unlink(out);
    char *gen[] = {"generate", "tests/golden/k31-b", "--ids", "1,2,3,4", "--max-tokens", "6", "--temperature", "0.7", "--seed", "3"};
    CHECK(run_quiet(lunar_cmd_generate, 10, gen) == 0);
    lunar_st_close(g);
}

/* `lunar logits --decode-after K`: a prefill of K ids, then one decode step per id, gives the rows of
 * one prefill of all of them (up to the fp32 order of the two paths: 1e-6 of max |logit| on tiny-a)
 * and fails on a bad K. */
static float *logits_rows(const char *extra, int *ok) {
    char out[] = "/tmp/lunar-test-dec-XXXXXX";
    int fd = mkstemp(out);
    close(fd);
    char *argv[] = {"logits", "tests/golden/tiny-a", "--ids", "5,6,7,8,9", "--out", out, "--backend", "cpu",
                    "--decode-after", (char *)extra};
    *ok = run_quiet(lunar_cmd_logits, extra ? 10 : 8, argv) == 0;
    char *buf = NULL;
    size_t len;
    lunar_err err;
    float *x = NULL;
    if (*ok && lunar_read_file(out, 1 << 26, &buf, &len, &err) == 0) {
        size_t hlen = (size_t)(unsigned char)buf[8] | (size_t)(unsigned char)buf[9] << 8;
        x = lunar_xmalloc(len - 10 - hlen);
        memcpy(x, buf + 10 + hlen, len - 10 - hlen);
        free(buf);
    }
    unlink(out);
    return x;
}

TEST(cli_logits_decode_after) {
    int ok1, ok2, ok3;
    float *a = logits_rows(NULL, &ok1), *b = logits_rows("2", &ok2);
    CHECK(ok1 && ok2 && a && b);
    lunar_config c;
    lunar_err err;
    CHECK(lunar_config_load(&c, "tests/golden/tiny-a/config.json", &err) == 0);
    double mx = 0, d = 0;
    for (long i = 0; a && b && i < 5L * c.vocab_size; i++) mx = fmax(mx, fabs(a[i])), d = fmax(d, fabs(a[i] - b[i]));
    CHECK_MSG(a && b && d <= 1e-5 * mx, "decode rows differ from the prefill rows by %g (max |logit| %g)", d, mx);
    free(logits_rows("x", &ok3));
    CHECK(!ok3);
    free(a), free(b);
}

/* --quantization (serve, bench, logits, generate share the load options): ptpc_fp8 is accepted and
 * changes the logits a little (the CPU forward's linears quantised), anything else is refused by
 * name. */
static float *logits_npy(const char *quant, size_t *n) {
    char out[] = "/tmp/lunar-test-ptpc-XXXXXX";
    int fd = mkstemp(out);
    LUNAR_ASSERT(fd >= 0);
    close(fd);
    char *argv[] = {"logits", "tests/golden/tiny-a", "--ids", "5,6,7,9", "--out", out, "--backend", "cpu",
                    "--quantization", (char *)quant};
    float *v = NULL;
    char *buf;
    size_t len;
    lunar_err err;
    if (run_quiet(lunar_cmd_logits, quant ? 10 : 8, argv) == 0 && lunar_read_file(out, 1 << 26, &buf, &len, &err) == 0) {
        size_t h = 10 + ((size_t)(unsigned char)buf[8] | (size_t)(unsigned char)buf[9] << 8);
        *n = (len - h) / 4;
        v = malloc(len - h);
        memcpy(v, buf + h, len - h);
        free(buf);
    }
    unlink(out);
    return v;
}

TEST(cli_quantization_ptpc_fp8) {
    lunar_load_options lo = {0};
    lunar_err err;
    CHECK(lunar_parse_load_option("--quantization", "ptpc_fp8", &lo, &err) == 1 && lo.ptpc_fp8 == 1);
    CHECK(lunar_parse_load_option("--quantization", "fp8", &lo, &err) == -1 && strstr(err.msg, "'fp8'") &&
          strstr(err.msg, "ptpc_fp8"));
    size_t n0 = 0, n1 = 0;
    float *plain = logits_npy(NULL, &n0), *q = logits_npy("ptpc_fp8", &n1);
    CHECK(plain && q && n0 == n1 && n0 > 0);
    if (plain && q && n0 == n1) {
        double amax = 0, dmax = 0;
        int differ = 0;
        for (size_t i = 0; i < n0; i++) {
            CHECK(isfinite(q[i]));
            amax = fmax(amax, fabs(plain[i]));
            dmax = fmax(dmax, fabs(q[i] - plain[i]));
            differ += q[i] != plain[i];
        }
        CHECK_MSG(differ > (int)(n0 / 2) && dmax <= 0.15 * amax, "differ %d of %zu, max diff %g of max %g", differ,
                  n0, dmax, amax);
    }
    char *bad[] = {"logits", "tests/golden/tiny-a", "--ids", "1", "--out", "/dev/null", "--quantization", "awq"};
    CHECK(run_quiet(lunar_cmd_logits, 8, bad) == 1);
    free(plain), free(q);
}
