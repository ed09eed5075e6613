/* safetensors checkpoints: one file, or a directory with model.safetensors.index.json and shards.
 * Files are mmapped read-only; tensors are views into the mapping. Every header field, offset and
 * size is checked against the file before use, so a truncated or malformed file is an error that
 * names the file and the tensor, never a crash. */
#ifndef LUNAR_IO_SAFETENSORS_H
#define LUNAR_IO_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "base/tensor.h"

typedef struct lunar_st lunar_st; /* a set of mapped files and their tensors */

/* path: a .safetensors file, or a directory holding model.safetensors.index.json (sharded) or
 * model.safetensors (single). */
int lunar_st_open(lunar_st **out, const char *path, lunar_err *err);
void lunar_st_close(lunar_st *st);

size_t lunar_st_count(const lunar_st *st);
const lunar_tensor *lunar_st_at(const lunar_st *st, size_t i);
const lunar_tensor *lunar_st_find(const lunar_st *st, const char *name); /* NULL if absent */
/* Name of the file a tensor came from (for error messages). */
const char *lunar_st_file_of(const lunar_st *st, const lunar_tensor *t);
/* `__metadata__` string value of the file holding tensor 0 (or of the single file); NULL if absent. */
const char *lunar_st_metadata(const lunar_st *st, const char *key);

/* Parses a safetensors header held in memory: buf is the whole file (8-byte length + JSON +
 * data). Exposed for the fuzz test; on success *out holds the tensors with data pointing into buf. */
int lunar_st_parse_buffer(lunar_st **out, const uint8_t *buf, size_t len, const char *label,
                          lunar_err *err);

/* Writes tensors to a .safetensors file (used by tests and tools that produce fixtures).
 * metadata: NULL-terminated key/value pairs {k0, v0, k1, v1, ..., NULL} or NULL. */
int lunar_st_write(const char *path, const lunar_tensor *tensors, size_t n,
                   const char *const *metadata, lunar_err *err);

/* An empty in-memory set (label names it in errors), and adding a tensor to it: the set takes
 * ownership of data (malloc'd), which may be NULL for a tensor whose values live elsewhere (the
 * device-side dummy weights); nbytes is set from the shape either way. */
lunar_st *lunar_st_new(const char *label);
int lunar_st_add(lunar_st *st, const char *name, lunar_dtype dtype, int ndim, const int64_t *shape,
                 void *data, lunar_err *err);

#endif
