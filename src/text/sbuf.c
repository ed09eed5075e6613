#include "text/sbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "base/err.h"

static void reserve(lunar_sbuf *b, size_t extra) {
    if (b->len + extra + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    LUNAR_ASSERT(p != NULL);
    b->p = p;
    b->cap = cap;
}

void lunar_sbuf_put(lunar_sbuf *b, const void *data, size_t n) {
    reserve(b, n);
    if (n) memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = 0;
}

void lunar_sbuf_puts(lunar_sbuf *b, const char *s) { lunar_sbuf_put(b, s, strlen(s)); }

void lunar_sbuf_putc(lunar_sbuf *b, char c) { lunar_sbuf_put(b, &c, 1); }

void lunar_sbuf_printf(lunar_sbuf *b, const char *fmt, ...) {
    char tmp[256];
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    LUNAR_ASSERT(n >= 0);
    if ((size_t)n < sizeof tmp) {
        lunar_sbuf_put(b, tmp, (size_t)n);
    } else {
        reserve(b, (size_t)n);
        vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap2);
        b->len += (size_t)n;
    }
    va_end(ap2);
}

char *lunar_sbuf_take(lunar_sbuf *b) {
    if (!b->p) reserve(b, 0), b->p[0] = 0;
    char *p = b->p;
    b->p = NULL;
    b->len = b->cap = 0;
    return p;
}

void lunar_sbuf_free(lunar_sbuf *b) {
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}
