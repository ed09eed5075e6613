/* The truncation check both output-parser tests run (test_chat_parse_k2.c, test_chat_parse_k3.c): every
 * prefix of an answer, cut as by max tokens, fed whole, byte by byte and in 4-byte chunks. */
#ifndef LUNAR_TESTS_CHAT_TRUNCATE_H
#define LUNAR_TESTS_CHAT_TRUNCATE_H

#include <string.h>

#include "chat_events.h"
#include "test.h"

/* a collected stream as a C string (an empty one has no buffer yet) */
#define S(b) ((b).p ? (b).p : "")

/* A parser test's runner: feeds out[0..len) in chunks of `chunk` bytes (0: whole) to a fresh parser
 * that starts in the reasoning channel when `reasoning`, finishing it as truncated when `truncated`. */
typedef void (*chat_run_fn)(const char *out, size_t len, int reasoning, int chunk, int truncated, chat_collect *c);

/* Each prefix gives a well-formed event sequence, finish "length", the same result however it is fed,
 * and calls that are a prefix of ALL (the full answer's calls) unless the cut splits a control spelling
 * (splits(out, len)); extra_ok (may be NULL) adds a parser-specific condition. Stops after 5 failures. */
static inline void chat_check_truncations(const char *out, const char *all, chat_run_fn run,
                                          int (*splits)(const char *out, size_t len),
                                          int (*extra_ok)(const chat_collect *c)) {
    const size_t n = strlen(out);
    int bad = 0;
    for (size_t len = 0; len <= n && bad < 5; len++) {
        chat_collect c[3];
        static const int chunks[] = {0, 1, 4};
        for (int k = 0; k < 3; k++) {
            run(out, len, 1, chunks[k], 1, &c[k]);
            int ok = chat_collect_ok(&c[k]) && (!extra_ok || extra_ok(&c[k])) && strcmp(S(c[k].finish), "length") == 0;
            const char *got = S(c[k].calls);
            size_t gl = strlen(got);
            if (gl && got[gl - 1] == ']') gl--;
            ok = ok && (splits(out, len) || strncmp(got, all, gl) == 0);
            if (k) ok = ok && strcmp(S(c[k].calls), S(c[0].calls)) == 0 &&
                        strcmp(S(c[k].content), S(c[0].content)) == 0 &&
                        strcmp(S(c[k].reasoning), S(c[0].reasoning)) == 0;
            CHECK_MSG(ok, "cut at %zu/%d: order %d, calls '%s' content '%s'", len, chunks[k], c[k].bad_order, got,
                      S(c[k].content));
            bad += !ok;
        }
        for (int k = 0; k < 3; k++) chat_collect_free(&c[k]);
    }
}

#endif
