#include "text/json_py.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/err.h"

void lunar_py_float_repr(double x, char out[40]) {
    if (isnan(x)) {
        strcpy(out, "NaN");
        return;
    }
    if (isinf(x)) {
        strcpy(out, x > 0 ? "Infinity" : "-Infinity");
        return;
    }
    if (x == 0) {
        strcpy(out, signbit(x) ? "-0.0" : "0.0");
        return;
    }
    /* shortest %.Ne that reads back to x (the nearest N-digit decimal: what dtoa mode 0 picks) */
    char e[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, x);
        if (strtod(e, NULL) == x) break;
    }
    const char *s = e;
    int neg = 0;
    if (*s == '-') neg = 1, s++;
    char digits[24];
    int nd = 0;
    for (; *s && *s != 'e'; s++)
        if (*s >= '0' && *s <= '9') digits[nd++] = *s;
    LUNAR_ASSERT(*s == 'e');
    int exp10 = atoi(s + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    int decpt = exp10 + 1; /* x = 0.d1d2... * 10^decpt */
    char *o = out;
    if (neg) *o++ = '-';
    if (decpt <= -4 || decpt > 16) {
        *o++ = digits[0];
        if (nd > 1) {
            *o++ = '.';
            memcpy(o, digits + 1, (size_t)nd - 1);
            o += nd - 1;
        }
        sprintf(o, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
        return;
    }
    if (decpt <= 0) {
        *o++ = '0';
        *o++ = '.';
        for (int i = 0; i < -decpt; i++) *o++ = '0';
        memcpy(o, digits, (size_t)nd);
        o += nd;
    } else if (decpt >= nd) {
        memcpy(o, digits, (size_t)nd);
        o += nd;
        for (int i = nd; i < decpt; i++) *o++ = '0';
        *o++ = '.';
        *o++ = '0';
    } else {
        memcpy(o, digits, (size_t)decpt);
        o += decpt;
        *o++ = '.';
        memcpy(o, digits + decpt, (size_t)(nd - decpt));
        o += nd - decpt;
    }
    *o = 0;
}

void lunar_json_py_string(const char *s, size_t n, lunar_sbuf *out) {
    lunar_sbuf_putc(out, '"');
    size_t run = 0; /* start of the pending raw run */
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char u[8];
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (c < 0x20) {
                snprintf(u, sizeof u, "\\u%04x", c);
                esc = u;
            }
        }
        if (!esc) continue;
        lunar_sbuf_put(out, s + run, i - run);
        lunar_sbuf_puts(out, esc);
        run = i + 1;
    }
    lunar_sbuf_put(out, s + run, n - run);
    lunar_sbuf_putc(out, '"');
}

static int key_cmp(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

void lunar_json_py_dump(const json_t *v, int flags, lunar_sbuf *out) {
    const char *item_sep = (flags & LUNAR_JSON_PY_COMPACT) ? "," : ", ";
    const char *key_sep = (flags & LUNAR_JSON_PY_COMPACT) ? ":" : ": ";
    char num[40];
    switch (json_typeof(v)) {
    case JSON_NULL: lunar_sbuf_puts(out, "null"); break;
    case JSON_TRUE: lunar_sbuf_puts(out, "true"); break;
    case JSON_FALSE: lunar_sbuf_puts(out, "false"); break;
    case JSON_INTEGER:
        lunar_sbuf_printf(out, "%lld", (long long)json_integer_value(v));
        break;
    case JSON_REAL:
        lunar_py_float_repr(json_real_value(v), num);
        lunar_sbuf_puts(out, num);
        break;
    case JSON_STRING:
        lunar_json_py_string(json_string_value(v), json_string_length(v), out);
        break;
    case JSON_ARRAY: {
        size_t n = json_array_size(v);
        lunar_sbuf_putc(out, '[');
        for (size_t i = 0; i < n; i++) {
            if (i) lunar_sbuf_puts(out, item_sep);
            lunar_json_py_dump(json_array_get(v, i), flags, out);
        }
        lunar_sbuf_putc(out, ']');
        break;
    }
    case JSON_OBJECT: {
        size_t n = json_object_size(v), k = 0;
        const char **keys = lunar_xmalloc((n ? n : 1) * sizeof *keys);
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)v, key, val) keys[k++] = key;
        if (flags & LUNAR_JSON_PY_SORT_KEYS) qsort(keys, n, sizeof *keys, key_cmp);
        lunar_sbuf_putc(out, '{');
        for (size_t i = 0; i < n; i++) {
            if (i) lunar_sbuf_puts(out, item_sep);
            lunar_json_py_string(keys[i], strlen(keys[i]), out);
            lunar_sbuf_puts(out, key_sep);
            lunar_json_py_dump(json_object_get(v, keys[i]), flags, out);
        }
        lunar_sbuf_putc(out, '}');
        free(keys);
        break;
    }
    }
}

char *lunar_json_py_dumps(const json_t *v, int flags) {
    lunar_sbuf b = {0};
    lunar_json_py_dump(v, flags, &b);
    return lunar_sbuf_take(&b);
}
