#include "base/err.h"

#include <stdarg.h>
#include <string.h>

int lunar_fail(lunar_err *err, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return -1;
}

int lunar_fail_prefix(lunar_err *err, const char *fmt, ...) {
    if (err) {
        char prefix[512], old[sizeof err->msg];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(prefix, sizeof prefix, fmt, ap);
        va_end(ap);
        memcpy(old, err->msg, sizeof old);
        size_t np = strnlen(prefix, sizeof prefix);
        size_t room = sizeof err->msg - 1;
        if (np > room) np = room;
        memcpy(err->msg, prefix, np);
        size_t no = strnlen(old, sizeof old);
        if (no > room - np) no = room - np;
        memcpy(err->msg + np, old, no);
        err->msg[np + no] = '\0';
    }
    return -1;
}

void *lunar_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory allocating %zu bytes\n", n);
        abort();
    }
    return p;
}

void *lunar_xcalloc(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "out of memory allocating %zu x %zu bytes\n", count, size);
        abort();
    }
    return p;
}
