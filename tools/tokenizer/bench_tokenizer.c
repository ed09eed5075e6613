/* Tokenizer throughput: build/bench_tokenizer TEXT_FILE [repeats] [special]
 * Loads data/kimi-tokenizer (k2 table), encodes the file `repeats` times, prints the best MB/s and the
 * id count and FNV-1a hash of the ids (to compare with tools/tokenizer/bench.py). Built by
 * `make bench-tokenizer`; not part of the tests. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "text/tokenizer.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s TEXT_FILE [repeats] [special]\n", argv[0]);
        return 2;
    }
    int reps = argc > 2 ? atoi(argv[2]) : 5;
    int special = argc > 3 && strcmp(argv[3], "special") == 0;
    FILE *f = fopen(argv[1], "rb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    if (!text || fread(text, 1, (size_t)n, f) != (size_t)n) return 1;
    fclose(f);
    lunar_err err;
    lunar_tokenizer *tok;
    double t0 = now();
    if (lunar_tokenizer_load_files(&tok, "data/kimi-tokenizer/tiktoken.model",
                                   "data/kimi-tokenizer/tokenizer_config.k2.json", &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    double load = now() - t0, best = 1e30;
    lunar_ids ids = {0};
    for (int r = 0; r < reps; r++) {
        ids.n = 0;
        t0 = now();
        if (lunar_tokenize(tok, text, (size_t)n, special, &ids, &err)) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        double t = now() - t0;
        if (t < best) best = t;
    }
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < ids.n; i++)
        for (int k = 0; k < 4; k++) h = (h ^ (((uint32_t)ids.ids[i] >> (8 * k)) & 0xFF)) * 0x100000001b3ull;
    printf("lunar: %ld bytes -> %zu ids (fnv %016llx), best of %d: %.3f s, %.2f MB/s (load %.3f s)\n", n, ids.n,
           (unsigned long long)h, reps, best, (double)n / best / 1e6, load);
    lunar_ids_free(&ids);
    lunar_tokenizer_free(tok);
    free(text);
    return 0;
}
