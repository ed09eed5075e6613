/* End-to-end golden tests: the CPU forward against logits recorded from transformers'
 * KimiLinearForCausalLM (tools/golden/make_golden.py) for Kimi-Linear, and from the fp32 PyTorch
 * reference pinned to fla/transformers (tools/reference/) for K3 and K3.1. For every directory
 * tests/golden/NAME/:
 *  1. prefill over prompt_ids, all rows of logits vs prefill_logits;
 *  2. then one token at a time through decode_ids vs decode_logits (recurrent KDA, absorbed MLA);
 *  3. a fresh full recompute over prompt + decode ids vs both (chunked KDA, naive MLA).
 * Tolerance 1e-4 relative to the largest |logit|: both sides compute in fp32 from the same
 * (bf16-representable or fp32) weights, so differences are summation-order rounding, ~1e-6. */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include "base/file.h"
#include "base/sha256.h"
#include "io/safetensors.h"
#include "model/forward.h"
#include "test.h"

#define GOLDEN_TOL 1e-4

static const lunar_tensor *need(const lunar_st *g, const char *name, const char *dir) {
    const lunar_tensor *t = lunar_st_find(g, name);
    CHECK_MSG(t != NULL, "%s: golden file lacks '%s'", dir, name);
    return t;
}

static void run_golden(const char *dir) {
    char path[1300], model_dir[1200];
    lunar_err err;
    lunar_st *g;
    snprintf(path, sizeof path, "%s/golden.safetensors", dir);
    if (lunar_st_open(&g, path, &err) != 0) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    const char *magic = lunar_st_metadata(g, "magic"), *md = lunar_st_metadata(g, "model_dir");
    CHECK_MSG(magic && strcmp(magic, "lunar-golden") == 0, "%s: not a lunar golden file", path);
    snprintf(model_dir, sizeof model_dir, "%s", md ? md : dir);

    /* A golden file is only meaningful for the config it was made from. */
    char *cfg_text;
    size_t cfg_len;
    snprintf(path, sizeof path, "%s/config.json", model_dir);
    if (lunar_read_file(path, 1 << 20, &cfg_text, &cfg_len, &err) == 0) {
        char hex[65];
        lunar_sha256_hex(cfg_text, cfg_len, hex);
        const char *want = lunar_st_metadata(g, "config_sha256");
        CHECK_MSG(want && strcmp(want, hex) == 0,
                  "%s: config.json changed since the golden file was made; regenerate with: %s",
                  model_dir, lunar_st_metadata(g, "command") ? lunar_st_metadata(g, "command") : "?");
        free(cfg_text);
    } else {
        CHECK_MSG(0, "%s", err.msg);
    }

    lunar_model *m;
    if (lunar_model_load(&m, model_dir, &err) != 0) {
        CHECK_MSG(0, "%s", err.msg);
        lunar_st_close(g);
        return;
    }
    const lunar_tensor *pid = need(g, "prompt_ids", dir), *pl = need(g, "prefill_logits", dir),
                       *did = need(g, "decode_ids", dir), *dl = need(g, "decode_logits", dir);
    if (!pid || !pl || !did || !dl) goto out;
    const int T = (int)pid->shape[0], nd = (int)did->shape[0], V = m->cfg.vocab_size;
    CHECK(pl->shape[0] == T && pl->shape[1] == V && dl->shape[0] == nd && dl->shape[1] == V);
    const float *want_pre = pl->data, *want_dec = dl->data;
    int32_t *ids = lunar_xmalloc((size_t)(T + nd) * sizeof(int32_t));
    memcpy(ids, pid->data, (size_t)T * sizeof(int32_t));
    memcpy(ids + T, did->data, (size_t)nd * sizeof(int32_t));
    float *logits = lunar_xmalloc((size_t)(T + nd) * V * sizeof(float));

    lunar_seq s;
    CHECK(lunar_seq_init(&s, m, T + nd, &err) == 0);
    /* 1 + 2: prefill, then decode token by token */
    CHECK(lunar_forward(m, &s, ids, T, logits, 1, &err) == 0);
    double e_pre = lunar_max_rel_err(logits, want_pre, (long)T * V);
    CHECK_MSG(e_pre <= GOLDEN_TOL, "%s: prefill max rel err %.3g", dir, e_pre);
    double e_dec = 0;
    for (int i = 0; i < nd; i++) {
        CHECK(lunar_forward(m, &s, ids + T + i, 1, logits, 0, &err) == 0);
        double e = lunar_max_rel_err(logits, want_dec + (size_t)i * V, V);
        e_dec = e > e_dec ? e : e_dec;
    }
    CHECK_MSG(e_dec <= GOLDEN_TOL, "%s: decode max rel err %.3g", dir, e_dec);

    /* 3: full recompute from an empty sequence */
    lunar_seq_reset(&s, m);
    CHECK(lunar_forward(m, &s, ids, T + nd, logits, 1, &err) == 0);
    double e_full = fmax(lunar_max_rel_err(logits, want_pre, (long)T * V),
                         lunar_max_rel_err(logits + (size_t)T * V, want_dec, (long)nd * V));
    CHECK_MSG(e_full <= GOLDEN_TOL, "%s: full recompute max rel err %.3g", dir, e_full);
    fprintf(stderr, " [%s: prefill %.1e decode %.1e full %.1e]", strrchr(dir, '/') + 1, e_pre, e_dec,
            e_full);
    lunar_seq_free(&s);
    free(ids);
    free(logits);
out:
    lunar_model_free(m);
    lunar_st_close(g);
}

TEST(golden_models_match_their_oracles) {
    DIR *d = opendir("tests/golden");
    CHECK_MSG(d != NULL, "tests/golden is missing (run the tests from the repository root)");
    if (!d) return;
    char names[64][256];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64)
        if (e->d_name[0] != '.') snprintf(names[n++], sizeof names[0], "%s", e->d_name);
    closedir(d);
    CHECK_MSG(n >= 3, "expected at least 3 golden models, found %d", n);
    for (int i = 0; i < n; i++) {
        char dir[300];
        snprintf(dir, sizeof dir, "tests/golden/%s", names[i]);
        run_golden(dir);
    }
}
