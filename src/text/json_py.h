/* Byte-exact Python json.dumps for jansson values, with ensure_ascii=False:
 *   ints as Python ints, reals as Python repr(float) (shortest round-trip: 1.0, 1e-05, 1e+16, -0.0,
 *   Infinity, NaN), strings with Python's escapes (\" \\ \n \r \t \b \f, other C0 controls as \u00xx,
 *   everything else, DEL and non-ASCII included, raw UTF-8).
 * Flags pick separators and key order:
 *   0                          json.dumps(v, ensure_ascii=False)                         ", " ": "
 *   LUNAR_JSON_PY_COMPACT      ..., separators=(",", ":")
 *   LUNAR_JSON_PY_SORT_KEYS    ..., sort_keys=True (recursive; code-point order = UTF-8 byte order)
 * Without SORT_KEYS objects keep jansson's insertion order (= Python dict order after json.loads).
 * jansson cannot hold integers beyond int64; such inputs fail at parse time, not here. */
#ifndef LUNAR_TEXT_JSON_PY_H
#define LUNAR_TEXT_JSON_PY_H

#include <jansson.h>

#include "text/sbuf.h"

enum { LUNAR_JSON_PY_COMPACT = 1, LUNAR_JSON_PY_SORT_KEYS = 2 };

/* Appends the serialisation of v to out. */
void lunar_json_py_dump(const json_t *v, int flags, lunar_sbuf *out);
/* The same, as a malloc'd NUL-terminated string. */
char *lunar_json_py_dumps(const json_t *v, int flags);
/* Python repr(x) for a float, as json.dumps writes it (inf/nan as Infinity/-Infinity/NaN). */
void lunar_py_float_repr(double x, char out[40]);
/* Appends s[0..n) as a Python JSON string literal (with quotes). */
void lunar_json_py_string(const char *s, size_t n, lunar_sbuf *out);

#endif
