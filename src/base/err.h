/* Errors are values: library calls return 0 on success or -1 and fill a lunar_err.
 * Only programming errors (broken invariants) abort, through LUNAR_ASSERT, with file and line. */
#ifndef LUNAR_BASE_ERR_H
#define LUNAR_BASE_ERR_H

#include <stdio.h>
#include <stdlib.h>

typedef struct lunar_err {
    char msg[1024];
} lunar_err;

/* Formats the message into err (when err is not NULL) and returns -1, so callers can write
 * `return lunar_fail(err, "...")`. */
int lunar_fail(lunar_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prefixes an existing message with context ("loading x: " + old message); returns -1. */
int lunar_fail_prefix(lunar_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define LUNAR_ASSERT(cond)                                                                 \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "%s:%d: internal error: assertion `%s` failed\n", __FILE__,   \
                    __LINE__, #cond);                                                      \
            abort();                                                                       \
        }                                                                                  \
    } while (0)

/* malloc/calloc that abort on exhaustion: out-of-memory for small host buffers is not a
 * recoverable condition in this program. Large model-sized allocations use the checked forms. */
void *lunar_xmalloc(size_t n);
void *lunar_xcalloc(size_t count, size_t size);

#endif
