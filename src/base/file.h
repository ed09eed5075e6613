#ifndef LUNAR_BASE_FILE_H
#define LUNAR_BASE_FILE_H

#include <stddef.h>

#include "base/err.h"

/* Reads a whole file into a NUL-terminated malloc'd buffer; *len excludes the NUL.
 * Refuses files larger than max_bytes (a guard against reading something huge by mistake). */
int lunar_read_file(const char *path, size_t max_bytes, char **buf, size_t *len, lunar_err *err);

#endif
