/* A growable byte buffer for the text layer (prompt rendering, JSON output, parser events). Always
 * NUL-terminated after the first append, so p can be used as a C string when the bytes hold no NUL. */
#ifndef LUNAR_TEXT_SBUF_H
#define LUNAR_TEXT_SBUF_H

#include <stddef.h>

typedef struct lunar_sbuf {
    char *p;
    size_t len, cap;
} lunar_sbuf;

void lunar_sbuf_put(lunar_sbuf *b, const void *data, size_t n);
void lunar_sbuf_puts(lunar_sbuf *b, const char *s);
void lunar_sbuf_putc(lunar_sbuf *b, char c);
void lunar_sbuf_printf(lunar_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Hands the bytes to the caller (malloc'd, NUL-terminated, never NULL) and empties b. */
char *lunar_sbuf_take(lunar_sbuf *b);
void lunar_sbuf_free(lunar_sbuf *b);

#endif
