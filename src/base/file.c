#include "base/file.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int lunar_read_file(const char *path, size_t max_bytes, char **buf, size_t *len, lunar_err *err) {
    *buf = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return lunar_fail(err, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return lunar_fail(err, "%s: not a regular file", path);
    }
    if ((size_t)sb.st_size > max_bytes) {
        fclose(f);
        return lunar_fail(err, "%s: file is %lld bytes, more than the %zu allowed", path,
                          (long long)sb.st_size, max_bytes);
    }
    size_t n = (size_t)sb.st_size;
    char *b = malloc(n + 1);
    if (!b) {
        fclose(f);
        return lunar_fail(err, "%s: cannot allocate %zu bytes", path, n + 1);
    }
    if (fread(b, 1, n, f) != n) {
        free(b);
        fclose(f);
        return lunar_fail(err, "%s: read failed", path);
    }
    fclose(f);
    b[n] = '\0';
    *buf = b;
    *len = n;
    return 0;
}
