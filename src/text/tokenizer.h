/* The Kimi tokenizer: tiktoken byte-level BPE over the `tiktoken.model` ranks, Kimi's pre-tokenisation
 * regex, and 256 reserved special ids after the ranks (163,584 + 256 = 163,840 for the real file).
 *
 * Encoding reproduces Kimi's tokenization_kimi.py `TikTokenTokenizer.encode` exactly: the text is cut
 * into 400,000-code-point pieces, each piece into runs of at most 25,000 consecutive whitespace or
 * non-whitespace code points (Python str.isspace), and every run is encoded on its own by tiktoken
 * (special-token strings, when allowed, then regex pieces, then BPE). For ordinary text (no such run)
 * this is plain tiktoken.
 *
 * A loaded tokenizer is immutable: encode / decode from several threads at once is fine. */
#ifndef LUNAR_TEXT_TOKENIZER_H
#define LUNAR_TEXT_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"

typedef struct lunar_tokenizer lunar_tokenizer;

/* Reserved special ids after the BPE ranks; unnamed ones are "<|reserved_token_{id}|>". */
#define LUNAR_TOKENIZER_NUM_RESERVED 256

/* Loads dir/tiktoken.model and dir/tokenizer_config.json. */
int lunar_tokenizer_load(lunar_tokenizer **out, const char *dir, lunar_err *err);
/* Loads the two files by path. Errors name the file (and the line, for tiktoken.model). */
int lunar_tokenizer_load_files(lunar_tokenizer **out, const char *tiktoken_path, const char *config_path,
                               lunar_err *err);
void lunar_tokenizer_free(lunar_tokenizer *tok);

/* 163840 for Kimi: BPE ranks + LUNAR_TOKENIZER_NUM_RESERVED. */
int32_t lunar_tokenizer_vocab_size(const lunar_tokenizer *tok);
/* Number of BPE ranks (163584 for Kimi); ids from here on are special. */
int32_t lunar_tokenizer_num_ranks(const lunar_tokenizer *tok);

/* A growable array of token ids. Zero-initialise; lunar_ids_free releases it. */
typedef struct lunar_ids {
    int32_t *ids;
    size_t n, cap;
} lunar_ids;
void lunar_ids_push(lunar_ids *v, int32_t id);
void lunar_ids_free(lunar_ids *v);

/* Appends the ids of text[0..len) to out. With allow_special, exact special-token strings (named or
 * "<|reserved_token_N|>") become their ids; without, they are ordinary text. Fails (out unchanged)
 * only when text is not valid UTF-8. */
int lunar_tokenize(const lunar_tokenizer *tok, const char *text, size_t len, bool allow_special,
                   lunar_ids *out, lunar_err *err);

/* The bytes of a token (a special token's are its string); NULL with *len 0 for an id out of range. */
const char *lunar_token_bytes(const lunar_tokenizer *tok, int32_t id, size_t *len);
/* The id of a special-token string ("<|im_end|>"), or -1. */
int32_t lunar_token_id(const lunar_tokenizer *tok, const char *special);
/* Whether id is a special token flagged "special" in tokenizer_config.json, i.e. one that
 * skip_special_tokens drops (tool-call and think markers are not). */
bool lunar_token_is_special(const lunar_tokenizer *tok, int32_t id);

/* Incremental detokenizer: feed ids one by one, get back only complete UTF-8. An incomplete
 * multi-byte sequence at the end of a token is held back until the next token completes it; bytes
 * that cannot become valid UTF-8 come out as U+FFFD, one per maximal invalid subpart, exactly like
 * Python's bytes.decode("utf-8", errors="replace") of all the bytes. A special token first flushes
 * what is held back (its string cannot continue a sequence); a skipped one is as if absent, as in
 * HF's decode(skip_special_tokens=True). Ids out of range are ignored. */
typedef struct lunar_detok {
    const lunar_tokenizer *tok;
    bool skip_special; /* drop tokens lunar_token_is_special says are special */
    int npend;
    unsigned char pend[4];
} lunar_detok;

/* Upper bound of what one push or flush writes: held-back bytes + a token's bytes, each possibly
 * becoming the 3-byte U+FFFD. */
#define LUNAR_DETOK_MAX_OUT (3 * (4 + 512))

void lunar_detok_init(lunar_detok *d, const lunar_tokenizer *tok, bool skip_special);
/* Writes the newly complete text to out (at most LUNAR_DETOK_MAX_OUT bytes) and returns its length. */
size_t lunar_detok_push(lunar_detok *d, int32_t id, char *out);
/* Ends the stream: held-back bytes come out as U+FFFD. Returns the length written to out. */
size_t lunar_detok_flush(lunar_detok *d, char *out);

/* Decodes a whole id sequence (push each, then flush) into a NUL-terminated malloc'd string. */
char *lunar_detokenize(const lunar_tokenizer *tok, const int32_t *ids, size_t n, bool skip_special,
                       size_t *len);

#endif
