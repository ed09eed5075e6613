/* SHA-256 (FIPS 180-4), for golden-file config hashes and content hashes. */
#ifndef LUNAR_BASE_SHA256_H
#define LUNAR_BASE_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct lunar_sha256 {
    uint32_t h[8];
    uint64_t len;      /* bytes hashed so far */
    uint8_t buf[64];
    size_t nbuf;
} lunar_sha256;

void lunar_sha256_init(lunar_sha256 *s);
void lunar_sha256_update(lunar_sha256 *s, const void *data, size_t n);
void lunar_sha256_final(lunar_sha256 *s, uint8_t out[32]);
/* Hex digest (64 chars + NUL) of a buffer. */
void lunar_sha256_hex(const void *data, size_t n, char out[65]);

#endif
