/* Mask timing over the schema cases: for every case of tests/data/json-schema-cases (as given and
 * wrapped as a strict tool's parameters) and json_object mode, a deterministic random sampler
 * drives a matcher over the Kimi vocabulary (tests/grammar_util.h) and every
 * lunar_matcher_fill_mask_budget call (max_tokens 2048, as the engine) is timed. Prints per-case and overall mean / p50 / p99 / max.
 *   make bench-grammar && build/bench_grammar [seeds per case (default 3)] [-v] */
#include "../../tests/grammar_util.h"

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    int seeds = 3, verbose = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-v")) verbose = 1;
        else seeds = atoi(argv[i]);
    }
    lunar_tokenizer *tok;
    lunar_err err = {{0}};
    if (lunar_tokenizer_load_files(&tok, "data/kimi-tokenizer/tiktoken.model",
                                   "data/kimi-tokenizer/tokenizer_config.k3.json", &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    lunar_vocab *v;
    double t0 = gu_now();
    if (lunar_vocab_build(&v, tok, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    printf("vocab build: %.1f ms (%d tokens)\n", (gu_now() - t0) * 1e3, lunar_vocab_size(v));
    uint32_t *closing = gu_closing_mask(tok, lunar_vocab_size(v));
    json_t **sc;
    char **names;
    int n = gu_load_cases(&sc, &names);
    int32_t end = GU_END_ID;
    size_t cap = 1 << 16, nt = 0;
    double *all = malloc(cap * sizeof(double)), compile_s = 0, compile_max = 0;
    int n_grammars = 0, n_runs = 0;
    for (int i = 0; i <= n; i++)
        for (int w = 0; w < (i < n ? 2 : 1); w++) {
            json_t *s = i == n ? NULL : w ? lunar_json_schema_tool_value(sc[i]) : json_incref(sc[i]);
            lunar_grammar *g;
            double tc = gu_now();
            if (lunar_grammar_from_json_schema(&g, v, s, &end, 1, &err)) {
                printf("%s: %s\n", i < n ? names[i] : "json_object", err.msg);
                json_decref(s);
                continue;
            }
            tc = gu_now() - tc;
            compile_s += tc;
            if (tc > compile_max) compile_max = tc;
            n_grammars++;
            for (int sd = 0; sd < seeds; sd++) {
                /* masks as the engine takes them: under the budget of max_tokens 2048 */
                gu_run r = gu_sample_ex(g, tok, closing, lunar_vocab_size(v), (uint64_t)(i * 7 + w + sd * 1000), 2048, 1,
                                        1, 0);
                double tot = 0, mx = 0;
                for (int k = 0; k < r.n_mask; k++) {
                    tot += r.mask_s[k];
                    if (r.mask_s[k] > mx) mx = r.mask_s[k];
                    if (nt == cap) all = realloc(all, (cap *= 2) * sizeof(double));
                    all[nt++] = r.mask_s[k];
                }
                n_runs++;
                if (verbose)
                    printf("%-22s %s seed %d: %4d tokens, mean %.3f ms, max %.3f ms\n", i < n ? names[i] : "json_object",
                           w ? "tool " : "plain", sd, r.n_tokens, r.n_mask ? tot / r.n_mask * 1e3 : 0, mx * 1e3);
                free(r.text), free(r.mask_s);
            }
            lunar_grammar_free(g);
            json_decref(s);
        }
    double sum = 0;
    for (size_t k = 0; k < nt; k++) sum += all[k];
    qsort(all, nt, sizeof(double), cmp_d);
    printf("%d grammars (compile: mean %.3f ms, max %.3f ms), %d runs, %zu masks\n", n_grammars,
           compile_s / n_grammars * 1e3, compile_max * 1e3, n_runs, nt);
    printf("mask time: mean %.4f ms  p50 %.4f ms  p90 %.4f ms  p99 %.4f ms  max %.3f ms\n", sum / (double)nt * 1e3,
           all[nt / 2] * 1e3, all[(size_t)(nt * 0.9)] * 1e3, all[(size_t)(nt * 0.99)] * 1e3, all[nt - 1] * 1e3);
    return 0;
}
