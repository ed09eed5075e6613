#include "cli/args.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int lunar_parse_ids(const char *s, int32_t **ids, int *n, lunar_err *err) {
    *ids = NULL;
    *n = 0;
    if (!s || !*s) return lunar_fail(err, "--ids: empty list (expected e.g. --ids 1,2,3)");
    int cap = 1;
    for (const char *p = s; *p; p++) cap += *p == ',';
    int32_t *out = lunar_xmalloc((size_t)cap * sizeof *out);
    int count = 0;
    const char *p = s;
    for (;;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end != ',' && *end != '\0')) {
            free(out);
            return lunar_fail(err, "--ids: item %d ('%.*s') is not a non-negative integer", count + 1,
                              (int)strcspn(p, ","), p);
        }
        out[count++] = (int32_t)v;
        if (*end == '\0') break;
        p = end + 1;
    }
    *ids = out;
    *n = count;
    return 0;
}

int lunar_parse_int(const char *opt, const char *s, long lo, long hi, long *out, lunar_err *err) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi)
        return lunar_fail(err, "%s: expected an integer in [%ld, %ld], got '%s'", opt, lo, hi, s);
    *out = v;
    return 0;
}

int lunar_parse_float(const char *opt, const char *s, double lo, double hi, double *out,
                      lunar_err *err) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !(v >= lo && v <= hi))
        return lunar_fail(err, "%s: expected a number in [%g, %g], got '%s'", opt, lo, hi, s);
    *out = v;
    return 0;
}

const char *lunar_opt_value(int argc, char **argv, int *i, lunar_err *err) {
    if (*i + 1 >= argc) {
        lunar_fail(err, "%s needs a value", argv[*i]);
        return NULL;
    }
    return argv[++*i];
}

int lunar_parse_load_option(const char *a, const char *v, lunar_load_options *lo, lunar_err *err) {
    long n;
    if (strcmp(a, "--load-format") == 0) {
        if (strcmp(v, "auto") && strcmp(v, "safetensors") && strcmp(v, "dummy"))
            return lunar_fail(err, "--load-format: '%s' is not one of auto, safetensors, dummy", v);
        lo->load_format = v;
    } else if (strcmp(a, "--num-layers") == 0) {
        if (lunar_parse_int(a, v, 1, 4096, &n, err)) return -1;
        lo->num_layers = (int)n;
    } else if (strcmp(a, "--tp-slice") == 0) {
        if (lunar_parse_int(a, v, 1, 1024, &n, err)) return -1;
        lo->tp_slice = (int)n;
    } else if (strcmp(a, "--quantization") == 0) {
        /* vLLM's spelling; the only online scheme implemented (SPEC 2) */
        if (strcmp(v, "ptpc_fp8"))
            return lunar_fail(err, "--quantization: '%s' is not supported (the only online quantization is ptpc_fp8)",
                              v);
        lo->ptpc_fp8 = 1;
    } else if (strcmp(a, "--dummy-seed") == 0) {
        if (lunar_parse_int(a, v, 0, 0x7fffffffffffffffL, &n, err)) return -1;
        lo->seed = (uint64_t)n;
    } else {
        return 0;
    }
    return 1;
}
