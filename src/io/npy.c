#include "io/npy.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

int lunar_npy_write_f32(const char *path, const float *data, int ndim, const int64_t *shape,
                        lunar_err *err) {
    char dict[256], dims[160] = "";
    size_t len = 0;
    size_t count = 1;
    for (int i = 0; i < ndim; i++) {
        len += (size_t)snprintf(dims + len, sizeof dims - len, "%s%lld", i ? ", " : "",
                                (long long)shape[i]);
        count *= (size_t)shape[i];
    }
    if (ndim == 1) snprintf(dims + len, sizeof dims - len, ","); /* Python's 1-tuple: (n,) */
    int dl = snprintf(dict, sizeof dict, "{'descr': '<f4', 'fortran_order': False, 'shape': (%s), }", dims);
    /* magic(6) + version(2) + header length(2) + dict, padded with spaces and ending in '\n' so
     * the data starts on a 64-byte boundary (the format's recommendation) */
    size_t total = 10 + (size_t)dl + 1;
    size_t pad = (64 - total % 64) % 64;
    uint16_t hlen = (uint16_t)(dl + pad + 1);

    FILE *f = fopen(path, "wb");
    if (!f) return lunar_fail(err, "%s: cannot create: %s", path, strerror(errno));
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(hlen & 0xff),
                             (unsigned char)(hlen >> 8)};
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(dict, 1, (size_t)dl, f) == (size_t)dl;
    for (size_t i = 0; ok && i < pad; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    ok = ok && fwrite(data, sizeof(float), count, f) == count; /* x86/ARM: little-endian */
    if (fclose(f) != 0) ok = 0;
    if (!ok) return lunar_fail(err, "%s: write failed: %s", path, strerror(errno));
    return 0;
}
