/* Shared by tests/test_grammar.c and tools/grammar/bench_mask.c: the schema cases and a
 * deterministic random sampler that drives a matcher over the real vocabulary. */
#ifndef LUNAR_TESTS_GRAMMAR_UTIL_H
#define LUNAR_TESTS_GRAMMAR_UTIL_H

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/grammar.h"
#include "text/tokenizer.h"

#define GU_CASES_DIR "tests/data/json-schema-cases"
#define GU_END_ID 163586 /* <|end_of_msg|> */

static const char *gu_case_dirs[] = {"AdditionalProperties", "AnyOf", "BasicTypes", "Defs",
                                     "RangeConstraints", "References", "Required", "SingleTypeInArray", NULL};

/* All schemas of the cases, in order; names[i] = "Dir:line". Returns the count. */
static inline int gu_load_cases(json_t ***schemas, char ***names) {
    int n = 0, cap = 128;
    *schemas = malloc((size_t)cap * sizeof(json_t *));
    *names = malloc((size_t)cap * sizeof(char *));
    for (int d = 0; gu_case_dirs[d]; d++) {
        char path[256], line[1 << 16];
        snprintf(path, sizeof path, GU_CASES_DIR "/%s/valid.jsonl", gu_case_dirs[d]);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        int ln = 0;
        while (fgets(line, sizeof line, f)) {
            ln++;
            json_error_t je;
            json_t *s = json_loads(line, 0, &je);
            if (!s) continue;
            if (n == cap) {
                cap *= 2;
                *schemas = realloc(*schemas, (size_t)cap * sizeof(json_t *));
                *names = realloc(*names, (size_t)cap * sizeof(char *));
            }
            (*schemas)[n] = s;
            char nm[128];
            snprintf(nm, sizeof nm, "%s:%d", gu_case_dirs[d], ln);
            (*names)[n++] = strdup(nm);
        }
        fclose(f);
    }
    return n;
}

static inline uint64_t gu_rng(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline double gu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    int n_tokens, done, dead, bad_accept;
    int narrowed;          /* budget: some mask was narrowed by the budget */
    int over_budget;       /* budget: a state needed more tokens to finish than were left */
    int64_t to_finish;     /* lunar_matcher_tokens_to_finish at the end (0: the value is complete) */
    char *text; /* bytes of the accepted tokens before the end token */
    size_t len;
    double *mask_s; /* per step mask time (optional) */
    int n_mask;
} gu_run;

/* Tokens whose bytes contain '"', '}' or ']' (bitmask over the vocabulary; malloc'd). */
static inline uint32_t *gu_closing_mask(const lunar_tokenizer *tok, int32_t vocab) {
    uint32_t *c = calloc((size_t)(vocab + 31) / 32, 4);
    for (int32_t id = 0; id < vocab && id < lunar_tokenizer_num_ranks(tok); id++) {
        size_t len;
        const char *b = lunar_token_bytes(tok, id, &len);
        if (b && (memchr(b, '"', len) || memchr(b, '}', len) || memchr(b, ']', len))) c[id >> 5] |= 1u << (id & 31);
    }
    return c;
}

/* The k-th (0-based) set bit of mask & (sel or all). */
static inline int32_t gu_kth(const uint32_t *mask, const uint32_t *sel, int words, uint64_t k) {
    for (int w = 0; w < words; w++) {
        uint32_t x = mask[w] & (sel ? sel[w] : ~0u);
        uint64_t c = (uint64_t)__builtin_popcount(x);
        if (k < c) {
            while (k--) x &= x - 1;
            return w * 32 + __builtin_ctz(x);
        }
        k -= c;
    }
    return -1;
}

/* Drives a matcher: uniform over allowed tokens, but with probability 1/2 over the allowed tokens
 * that close something ('"', '}', ']'), and the end token whenever it is allowed with probability
 * 0.9. Stops at done, an empty mask, or max_tokens. closing: from gu_closing_mask. */
/* budget: masks come from lunar_matcher_fill_mask_budget with the tokens left of max_tokens (as the
 * engine does); stubborn: the opposite bias, never closing while anything else is allowed (the end
 * token only when nothing else is), the walk that most needs the budget to end. */
static inline gu_run gu_sample_ex(const lunar_grammar *g, const lunar_tokenizer *tok, const uint32_t *closing,
                                  int32_t vocab, uint64_t seed, int max_tokens, int timing, int budget, int stubborn) {
    gu_run r = {0};
    lunar_matcher *m = lunar_matcher_new(g);
    int words = (vocab + 31) / 32;
    uint32_t *mask = malloc((size_t)words * 4);
    size_t cap = 256;
    r.text = malloc(cap);
    if (timing) r.mask_s = malloc((size_t)max_tokens * sizeof(double));
    uint64_t st = seed * 0x1234567ull + 1;
    while (r.n_tokens < max_tokens && !lunar_matcher_is_done(m)) {
        double t0 = timing ? gu_now() : 0;
        if (budget) {
            int64_t left = max_tokens - r.n_tokens, need = lunar_matcher_tokens_to_finish(m);
            r.narrowed |= lunar_matcher_fill_mask_budget(m, mask, left);
            if (need > left) r.over_budget = 1;
        } else {
            lunar_matcher_fill_mask(m, mask);
        }
        if (timing) r.mask_s[r.n_mask++] = gu_now() - t0;
        uint64_t na = 0, nc = 0;
        for (int w = 0; w < words; w++) {
            na += (uint64_t)__builtin_popcount(mask[w]);
            nc += (uint64_t)__builtin_popcount(mask[w] & closing[w]);
        }
        if (!na) {
            r.dead = 1;
            break;
        }
        int end_ok = mask[GU_END_ID >> 5] >> (GU_END_ID & 31) & 1;
        int32_t pick;
        if (stubborn) {
            if (end_ok) mask[GU_END_ID >> 5] &= ~(1u << (GU_END_ID & 31)), na--;
            uint64_t open = na - nc + (end_ok && closing[GU_END_ID >> 5] >> (GU_END_ID & 31) & 1);
            if (open) {
                for (int w = 0; w < words; w++) mask[w] &= ~closing[w];
                pick = gu_kth(mask, NULL, words, gu_rng(&st) % open);
            } else if (nc) {
                pick = gu_kth(mask, closing, words, gu_rng(&st) % nc);
            } else {
                pick = GU_END_ID;
            }
        } else if (end_ok && gu_rng(&st) % 10 < 9) pick = GU_END_ID;
        else if (nc && gu_rng(&st) % 2) pick = gu_kth(mask, closing, words, gu_rng(&st) % nc);
        else pick = gu_kth(mask, NULL, words, gu_rng(&st) % na);
        if (lunar_matcher_accept(m, pick)) {
            r.bad_accept = 1;
            break;
        }
        r.n_tokens++;
        if (pick < lunar_tokenizer_num_ranks(tok)) {
            size_t len;
            const char *b = lunar_token_bytes(tok, pick, &len);
            if (r.len + len + 1 > cap) {
                cap = (r.len + len + 1) * 2;
                r.text = realloc(r.text, cap);
            }
            memcpy(r.text + r.len, b, len);
            r.len += len;
        }
    }
    r.text[r.len] = 0;
    r.done = lunar_matcher_is_done(m);
    r.to_finish = lunar_matcher_tokens_to_finish(m);
    lunar_matcher_free(m);
    free(mask);
    return r;
}

static inline gu_run gu_sample(const lunar_grammar *g, const lunar_tokenizer *tok, const uint32_t *closing, int32_t vocab,
                               uint64_t seed, int max_tokens, int timing) {
    return gu_sample_ex(g, tok, closing, vocab, seed, max_tokens, timing, 0, 0);
}

#endif
