/* Internals shared by tokenizer.c (loading, specials, driver, decoding), bpe.c and pretokenize.c. */
#ifndef LUNAR_TEXT_TOKENIZER_INTERNAL_H
#define LUNAR_TEXT_TOKENIZER_INTERNAL_H

#include "text/tokenizer.h"

/* Longest token (BPE or special) accepted, in bytes; the real file's longest is 256. */
#define LUNAR_TOKEN_MAX_BYTES 512

struct lunar_tokenizer {
    int32_t n_ranks, n_vocab;
    /* token id -> bytes: tok_bytes[tok_off[id] .. tok_off[id + 1]) for every id < n_vocab */
    char *tok_bytes;
    uint32_t *tok_off;
    uint32_t max_rank_len; /* longest BPE token, for skipping hopeless lookups */
    /* open-addressing byte string -> rank map: slot = (hash high 32 bits << 32) | (rank + 1), 0 = empty */
    uint64_t *rank_slots;
    uint64_t rank_mask;
    int32_t byte_rank[256];
    int32_t *pair_rank; /* [65536]: rank of the two bytes (hi << 8 | lo), or -1 */
    /* specials: same kind of map over their strings (id - n_ranks + 1 in the low bits) */
    uint64_t *spec_slots;
    uint64_t spec_mask;
    bool *spec_flag; /* [LUNAR_TOKENIZER_NUM_RESERVED]: "special": true in the config */
    uint8_t spec_first[256]; /* first bytes of special strings */
    uint32_t spec_len_mask[8]; /* bit set for each special-string length (< 256) present */
    uint32_t spec_max_len;
    void *re; /* pcre2_code_8 * (pretokenize.c) */
};

uint64_t lunar_tok_hash(const void *p, size_t n);
/* rank of bytes p[0..n), or -1 */
int32_t lunar_tok_rank(const lunar_tokenizer *tok, const void *p, size_t n);
/* builds the rank map over tok_bytes/tok_off[0..n_ranks]; -1: rank *bad has the bytes of rank *first;
 * -2: the single byte *bad is no token */
int lunar_tok_rank_map_build(lunar_tokenizer *tok, int32_t *bad, int32_t *first);

/* BPE of one pre-tokenised piece, ids appended to out */
void lunar_bpe_piece(const lunar_tokenizer *tok, const uint8_t *p, size_t n, lunar_ids *out);

/* Pre-tokenisation regex (PCRE2) */
int lunar_pretok_compile(lunar_tokenizer *tok, lunar_err *err);
void lunar_pretok_free(lunar_tokenizer *tok);
/* Splits valid UTF-8 match[0..len) with the regex and BPEs the same spans of text into out (match is
 * text itself, or a same-length copy with stand-ins for Unicode overrides). */
int lunar_pretok_encode(const lunar_tokenizer *tok, const char *match, const char *text, size_t len,
                        lunar_ids *out, lunar_err *err);

#endif
