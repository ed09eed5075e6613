/* Kimi tokenizer: loading tiktoken.model and the special-token table, Kimi's encode driver
 * (400,000 / 25,000 splitting, special-token strings), token lookup and incremental decoding.
 * BPE is in bpe.c, the pre-tokenisation regex in pretokenize.c. */
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "text/tokenizer_internal.h"
#include "text/unicode_overrides.h"

/* ---- growable id arrays ---- */

void lunar_ids_push(lunar_ids *v, int32_t id) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        int32_t *p = realloc(v->ids, cap * sizeof *p);
        if (!p) {
            fprintf(stderr, "out of memory growing a token list to %zu ids\n", cap);
            abort();
        }
        v->ids = p;
        v->cap = cap;
    }
    v->ids[v->n++] = id;
}

void lunar_ids_free(lunar_ids *v) {
    free(v->ids);
    v->ids = NULL;
    v->n = v->cap = 0;
}

/* ---- loading ---- */

static int read_file(const char *path, char **data, size_t *len, lunar_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return lunar_fail(err, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = lunar_xmalloc(cap);
    for (;;) {
        if (n == cap) {
            cap *= 2;
            char *p = realloc(buf, cap);
            LUNAR_ASSERT(p);
            buf = p;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return lunar_fail(err, "%s: read error", path);
    }
    *data = buf;
    *len = n;
    return 0;
}

static int b64_val(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* strict standard base64 with padding; returns the decoded length or -1 */
static long b64_decode(const char *s, size_t n, unsigned char *out) {
    if (n == 0 || n % 4) return -1;
    long o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            unsigned char c = (unsigned char)s[i + k];
            if (c == '=' && i + 4 == n && k >= 2) {
                v[k] = 0;
                pad++;
            } else {
                if (pad) return -1; /* data after '=' */
                v[k] = b64_val(c);
                if (v[k] < 0) return -1;
            }
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (unsigned char)(w >> 16);
        if (pad < 2) out[o++] = (unsigned char)(w >> 8);
        if (pad < 1) out[o++] = (unsigned char)w;
    }
    return o;
}

typedef struct {
    uint32_t off, len;
} span;

/* Parses "base64 rank" lines into tok->tok_bytes / tok_off (ranks must be 0..n-1, each once). The
 * arena is left with room for the specials appended later. */
static int load_ranks(lunar_tokenizer *tok, const char *path, lunar_err *err) {
    char *data = NULL;
    size_t len = 0;
    if (read_file(path, &data, &len, err)) return -1;
    size_t cap_lines = 1024, n = 0, pool_cap = len + 1, pool_n = 0;
    span *by_line = lunar_xmalloc(cap_lines * sizeof *by_line);
    long *rank_of = lunar_xmalloc(cap_lines * sizeof *rank_of);
    long *line_of = lunar_xmalloc(cap_lines * sizeof *line_of);
    unsigned char *pool = lunar_xmalloc(pool_cap);
    int rc = -1;
    long line = 0;
    for (size_t pos = 0; pos < len;) {
        line++;
        size_t end = pos;
        while (end < len && data[end] != '\n') end++;
        size_t e = end;
        if (e > pos && data[e - 1] == '\r') e--;
        const char *l = data + pos;
        size_t ll = e - pos;
        pos = end + 1;
        if (ll == 0) continue;
        const char *sp = memchr(l, ' ', ll);
        if (!sp) {
            lunar_fail(err, "%s:%ld: expected \"<base64 token> <rank>\"", path, line);
            goto done;
        }
        size_t tl = (size_t)(sp - l);
        if (tl / 4 * 3 > LUNAR_TOKEN_MAX_BYTES) {
            lunar_fail(err, "%s:%ld: token longer than %d bytes", path, line, LUNAR_TOKEN_MAX_BYTES);
            goto done;
        }
        long got = b64_decode(l, tl, pool + pool_n);
        if (got <= 0) {
            lunar_fail(err, "%s:%ld: invalid base64 token \"%.*s\"", path, line, (int)(tl > 64 ? 64 : tl), l);
            goto done;
        }
        const char *rs = sp + 1, *re_ = l + ll;
        long rank = 0;
        if (rs == re_) {
            lunar_fail(err, "%s:%ld: missing rank", path, line);
            goto done;
        }
        for (const char *c = rs; c < re_; c++) {
            if (*c < '0' || *c > '9' || rank > 100000000) {
                lunar_fail(err, "%s:%ld: invalid rank \"%.*s\"", path, line, (int)(re_ - rs > 32 ? 32 : re_ - rs), rs);
                goto done;
            }
            rank = rank * 10 + (*c - '0');
        }
        if (n == cap_lines) {
            cap_lines *= 2;
            by_line = realloc(by_line, cap_lines * sizeof *by_line);
            rank_of = realloc(rank_of, cap_lines * sizeof *rank_of);
            line_of = realloc(line_of, cap_lines * sizeof *line_of);
            LUNAR_ASSERT(by_line && rank_of && line_of);
        }
        by_line[n] = (span){(uint32_t)pool_n, (uint32_t)got};
        rank_of[n] = rank;
        line_of[n] = line;
        n++;
        pool_n += (size_t)got;
    }
    if (n == 0) {
        lunar_fail(err, "%s: no tokens", path);
        goto done;
    }
    /* place by rank */
    long *line_by_rank = lunar_xmalloc(n * sizeof *line_by_rank);
    for (size_t r = 0; r < n; r++) line_by_rank[r] = -1;
    span *by_rank = lunar_xmalloc(n * sizeof *by_rank);
    for (size_t i = 0; i < n; i++) {
        long r = rank_of[i];
        if (r >= (long)n) {
            lunar_fail(err, "%s:%ld: rank %ld out of range: the file has %zu tokens, ranks must be 0..%zu", path,
                       line_of[i], r, n, n - 1);
            free(line_by_rank);
            free(by_rank);
            goto done;
        }
        if (line_by_rank[r] >= 0) {
            lunar_fail(err, "%s:%ld: rank %ld already given on line %ld", path, line_of[i], r, line_by_rank[r]);
            free(line_by_rank);
            free(by_rank);
            goto done;
        }
        line_by_rank[r] = line_of[i];
        by_rank[r] = by_line[i];
    }
    tok->n_ranks = (int32_t)n;
    tok->n_vocab = (int32_t)n + LUNAR_TOKENIZER_NUM_RESERVED;
    tok->tok_off = lunar_xmalloc(((size_t)tok->n_vocab + 1) * sizeof *tok->tok_off);
    tok->tok_bytes = lunar_xmalloc(pool_n + (size_t)LUNAR_TOKENIZER_NUM_RESERVED * LUNAR_TOKEN_MAX_BYTES);
    size_t o = 0;
    for (size_t r = 0; r < n; r++) {
        tok->tok_off[r] = (uint32_t)o;
        memcpy(tok->tok_bytes + o, pool + by_rank[r].off, by_rank[r].len);
        o += by_rank[r].len;
    }
    tok->tok_off[n] = (uint32_t)o;
    int32_t bad, first;
    rc = lunar_tok_rank_map_build(tok, &bad, &first);
    if (rc == -1)
        lunar_fail(err, "%s:%ld: token of rank %d repeats the token of rank %d (line %ld)", path,
                   line_by_rank[bad], bad, first, line_by_rank[first]);
    else if (rc)
        lunar_fail(err, "%s: no token for the single byte 0x%02x", path, bad);
    free(line_by_rank);
    free(by_rank);
done:
    free(data);
    free(by_line);
    free(rank_of);
    free(line_of);
    free(pool);
    return rc;
}

static uint64_t *spec_slot(const lunar_tokenizer *tok, const char *s, size_t n, int32_t *id) {
    uint64_t h = lunar_tok_hash(s, n), tag = h >> 32;
    for (uint64_t i = h & tok->spec_mask;; i = (i + 1) & tok->spec_mask) {
        uint64_t v = tok->spec_slots[i];
        if (!v) {
            *id = -1;
            return &tok->spec_slots[i];
        }
        if ((v >> 32) == tag) {
            int32_t t = tok->n_ranks + (int32_t)(uint32_t)v - 1;
            uint32_t off = tok->tok_off[t];
            if (tok->tok_off[t + 1] - off == n && memcmp(tok->tok_bytes + off, s, n) == 0) {
                *id = t;
                return &tok->spec_slots[i];
            }
        }
    }
}

static int load_specials(lunar_tokenizer *tok, const char *path, lunar_err *err) {
    json_error_t je;
    json_t *root = json_load_file(path, JSON_DECODE_INT_AS_REAL, &je); /* model_max_length can exceed int64 */
    if (!root) return lunar_fail(err, "%s:%d: %s", path, je.line, je.text);
    int rc = -1;
    const char *names[LUNAR_TOKENIZER_NUM_RESERVED] = {0};
    tok->spec_flag = lunar_xcalloc(LUNAR_TOKENIZER_NUM_RESERVED, sizeof *tok->spec_flag);
    json_t *dec = json_object_get(root, "added_tokens_decoder");
    if (!json_is_object(dec)) {
        lunar_fail(err, "%s: no \"added_tokens_decoder\" object", path);
        goto done;
    }
    const char *key;
    json_t *val;
    json_object_foreach(dec, key, val) {
        char *endp;
        errno = 0;
        long id = strtol(key, &endp, 10);
        if (*key == '\0' || *endp != '\0' || errno) {
            lunar_fail(err, "%s: added_tokens_decoder key \"%s\" is not an id", path, key);
            goto done;
        }
        if (id < tok->n_ranks || id >= tok->n_vocab) {
            lunar_fail(err, "%s: added token id %ld outside the reserved ids %d..%d", path, id, tok->n_ranks,
                       tok->n_vocab - 1);
            goto done;
        }
        json_t *content = json_object_get(val, "content");
        if (!json_is_string(content) || json_string_length(content) == 0 ||
            json_string_length(content) >= 256 || strlen(json_string_value(content)) != json_string_length(content)) {
            lunar_fail(err, "%s: added token %ld: \"content\" must be a non-empty string under 256 bytes", path, id);
            goto done;
        }
        json_t *special = json_object_get(val, "special");
        names[id - tok->n_ranks] = json_string_value(content);
        tok->spec_flag[id - tok->n_ranks] = special ? json_is_true(special) : true;
    }
    /* arena + map, as tokenization_kimi.py: unnamed ids are <|reserved_token_{id}|> */
    tok->spec_slots = lunar_xcalloc(1024, sizeof *tok->spec_slots);
    tok->spec_mask = 1023;
    uint32_t o = tok->tok_off[tok->n_ranks];
    for (int k = 0; k < LUNAR_TOKENIZER_NUM_RESERVED; k++) {
        int32_t id = tok->n_ranks + k;
        char buf[64];
        const char *s = names[k];
        if (!s) {
            snprintf(buf, sizeof buf, "<|reserved_token_%d|>", id);
            s = buf;
        }
        size_t n = strlen(s);
        memcpy(tok->tok_bytes + o, s, n);
        o += (uint32_t)n;
        tok->tok_off[id + 1] = o;
        int32_t prev;
        uint64_t *slot = spec_slot(tok, s, n, &prev);
        if (prev >= 0) {
            lunar_fail(err, "%s: ids %d and %d have the same string \"%s\"", path, prev, id, s);
            goto done;
        }
        *slot = (lunar_tok_hash(s, n) >> 32) << 32 | (uint64_t)(k + 1);
        tok->spec_first[(unsigned char)s[0]] = 1;
        tok->spec_len_mask[n / 32] |= 1u << (n % 32);
        if (n > tok->spec_max_len) tok->spec_max_len = (uint32_t)n;
    }
    rc = 0;
done:
    json_decref(root);
    return rc;
}

static void override_blocks_init(void);

int lunar_tokenizer_load_files(lunar_tokenizer **out, const char *tiktoken_path, const char *config_path,
                               lunar_err *err) {
    *out = NULL;
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, override_blocks_init);
    lunar_tokenizer *tok = lunar_xcalloc(1, sizeof *tok);
    if (load_ranks(tok, tiktoken_path, err) || load_specials(tok, config_path, err) ||
        lunar_pretok_compile(tok, err)) {
        lunar_tokenizer_free(tok);
        return -1;
    }
    *out = tok;
    return 0;
}

int lunar_tokenizer_load(lunar_tokenizer **out, const char *dir, lunar_err *err) {
    size_t n = strlen(dir) + 32;
    char *a = lunar_xmalloc(n), *b = lunar_xmalloc(n);
    snprintf(a, n, "%s/tiktoken.model", dir);
    snprintf(b, n, "%s/tokenizer_config.json", dir);
    int rc = lunar_tokenizer_load_files(out, a, b, err);
    free(a);
    free(b);
    return rc;
}

void lunar_tokenizer_free(lunar_tokenizer *tok) {
    if (!tok) return;
    if (tok->re) lunar_pretok_free(tok);
    free(tok->tok_bytes);
    free(tok->tok_off);
    free(tok->rank_slots);
    free(tok->pair_rank);
    free(tok->spec_slots);
    free(tok->spec_flag);
    free(tok);
}

int32_t lunar_tokenizer_vocab_size(const lunar_tokenizer *tok) { return tok->n_vocab; }
int32_t lunar_tokenizer_num_ranks(const lunar_tokenizer *tok) { return tok->n_ranks; }

const char *lunar_token_bytes(const lunar_tokenizer *tok, int32_t id, size_t *len) {
    if (id < 0 || id >= tok->n_vocab) {
        *len = 0;
        return NULL;
    }
    *len = tok->tok_off[id + 1] - tok->tok_off[id];
    return tok->tok_bytes + tok->tok_off[id];
}

int32_t lunar_token_id(const lunar_tokenizer *tok, const char *special) {
    int32_t id;
    spec_slot(tok, special, strlen(special), &id);
    return id;
}

bool lunar_token_is_special(const lunar_tokenizer *tok, int32_t id) {
    return id >= tok->n_ranks && id < tok->n_vocab && tok->spec_flag[id - tok->n_ranks];
}

/* ---- encoding ---- */

/* the longest special string starting at s (at most n bytes), or -1 */
static int32_t special_at(const lunar_tokenizer *tok, const char *s, size_t n, size_t *mlen) {
    size_t maxl = n < tok->spec_max_len ? n : tok->spec_max_len;
    for (size_t l = maxl; l > 0; l--) {
        if (!(tok->spec_len_mask[l / 32] >> (l % 32) & 1)) continue;
        int32_t id;
        spec_slot(tok, s, l, &id);
        if (id >= 0) {
            *mlen = l;
            return id;
        }
    }
    return -1;
}

/* ---- Unicode overrides (see unicode_overrides.h): code points PCRE2's tables class differently
 * from tiktoken's are replaced, for the regex only, by same-length stand-ins ---- */

static uint64_t override_blocks[0x110000 / 256 / 64]; /* bit per 256-code-point block with overrides */

static void override_blocks_init(void) {
    for (int i = 0; i < LUNAR_UNICODE_OVERRIDE_RANGES; i++)
        for (uint32_t b = lunar_unicode_override[i][0] >> 8; b <= lunar_unicode_override[i][1] >> 8 && b < 0x1100; b++)
            override_blocks[b / 64] |= 1ull << (b % 64);
}

/* the stand-in for c, or 0 */
static uint32_t override_of(uint32_t c) {
    if (c < LUNAR_UNICODE_OVERRIDE_MIN || !(override_blocks[(c >> 8) / 64] >> ((c >> 8) % 64) & 1)) return 0;
    int lo = 0, hi = LUNAR_UNICODE_OVERRIDE_RANGES - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (c < lunar_unicode_override[mid][0]) hi = mid - 1;
        else if (c > lunar_unicode_override[mid][1]) lo = mid + 1;
        else return lunar_unicode_override[mid][2];
    }
    return 0;
}


static uint32_t utf8_next(const unsigned char *p, size_t *i);

/* the run as the regex should see it, when it holds an override: malloc'd, same length */
static char *make_shadow(const char *s, size_t n) {
    char *m = lunar_xmalloc(n ? n : 1);
    memcpy(m, s, n);
    for (size_t i = 0; i < n;) {
        size_t at = i;
        uint32_t st = override_of(utf8_next((const unsigned char *)s, &i));
        if (!st) continue;
        unsigned char *o = (unsigned char *)m + at;
        if (i - at == 3) {
            LUNAR_ASSERT(st >= 0x800 && st < 0x10000);
            o[0] = (unsigned char)(0xE0 | st >> 12), o[1] = (unsigned char)(0x80 | (st >> 6 & 0x3F));
            o[2] = (unsigned char)(0x80 | (st & 0x3F));
        } else {
            LUNAR_ASSERT(i - at == 4 && st >= 0x10000);
            o[0] = (unsigned char)(0xF0 | st >> 18), o[1] = (unsigned char)(0x80 | (st >> 12 & 0x3F));
            o[2] = (unsigned char)(0x80 | (st >> 6 & 0x3F)), o[3] = (unsigned char)(0x80 | (st & 0x3F));
        }
    }
    return m;
}

/* one of Kimi's runs: tiktoken's encode (specials allowed or not); the regex reads m (s or its shadow) */
static int encode_run(const lunar_tokenizer *tok, const char *s, size_t n, bool has_override, bool allow_special,
                      lunar_ids *out, lunar_err *err) {
    if (has_override) {
        char *m = make_shadow(s, n);
        int rc = 0;
        size_t start = 0;
        for (size_t i = 0; allow_special && i < n; i++) {
            if (!tok->spec_first[(unsigned char)s[i]]) continue;
            size_t ml;
            int32_t id = special_at(tok, s + i, n - i, &ml);
            if (id < 0) continue;
            if ((rc = lunar_pretok_encode(tok, m + start, s + start, i - start, out, err))) break;
            lunar_ids_push(out, id);
            i += ml - 1;
            start = i + 1;
        }
        if (!rc) rc = lunar_pretok_encode(tok, m + start, s + start, n - start, out, err);
        free(m);
        return rc;
    }
    if (!allow_special) return lunar_pretok_encode(tok, s, s, n, out, err);
    size_t start = 0;
    for (size_t i = 0; i < n; i++) {
        if (!tok->spec_first[(unsigned char)s[i]]) continue;
        size_t ml;
        int32_t id = special_at(tok, s + i, n - i, &ml);
        if (id < 0) continue;
        if (lunar_pretok_encode(tok, s + start, s + start, i - start, out, err)) return -1;
        lunar_ids_push(out, id);
        i += ml - 1;
        start = i + 1;
    }
    return lunar_pretok_encode(tok, s + start, s + start, n - start, out, err);
}

/* Python str.isspace(): White_Space plus the C0 separators 0x1C..0x1F */
static bool py_isspace(uint32_t c) {
    if (c < 0x80) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
    return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
           c == 0x202F || c == 0x205F || c == 0x3000;
}

/* A UTF-8 lead byte c >= 0x80 (Python's strict decoder: no surrogates, no overlongs, <= U+10FFFF):
 * how many continuation bytes follow it, and the range [lo, hi] the first of them must fall in (the
 * others are 0x80..0xBF); 0 for a byte that cannot start a character. */
static size_t utf8_lead(unsigned char c, unsigned char *lo, unsigned char *hi) {
    *lo = 0x80, *hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) return 1;
    if (c == 0xE0) return *lo = 0xA0, 2;
    if (c == 0xED) return *hi = 0x9F, 2;
    if (c >= 0xE1 && c <= 0xEF) return 2;
    if (c == 0xF0) return *lo = 0x90, 3;
    if (c == 0xF4) return *hi = 0x8F, 3;
    if (c >= 0xF1 && c <= 0xF3) return 3;
    return 0;
}

/* length of the valid UTF-8 prefix */
static size_t utf8_valid_prefix(const unsigned char *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = p[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        unsigned char lo, hi;
        const size_t need = utf8_lead(c, &lo, &hi);
        if (!need) return i;
        if (i + need >= n) return i;
        if (p[i + 1] < lo || p[i + 1] > hi) return i;
        for (size_t k = 2; k <= need; k++)
            if ((p[i + k] & 0xC0) != 0x80) return i;
        i += need + 1;
    }
    return i;
}

static uint32_t utf8_next(const unsigned char *p, size_t *i) {
    unsigned char c = p[*i];
    if (c < 0x80) return (*i)++, c;
    if (c < 0xE0) {
        uint32_t v = (uint32_t)(c & 0x1F) << 6 | (p[*i + 1] & 0x3F);
        *i += 2;
        return v;
    }
    if (c < 0xF0) {
        uint32_t v = (uint32_t)(c & 0x0F) << 12 | (uint32_t)(p[*i + 1] & 0x3F) << 6 | (p[*i + 2] & 0x3F);
        *i += 3;
        return v;
    }
    uint32_t v = (uint32_t)(c & 0x07) << 18 | (uint32_t)(p[*i + 1] & 0x3F) << 12 | (uint32_t)(p[*i + 2] & 0x3F) << 6 |
                 (p[*i + 3] & 0x3F);
    *i += 4;
    return v;
}

#define KIMI_MAX_ENCODE_CHARS 400000
#define KIMI_MAX_RUN_CHARS 25000

int lunar_tokenize(const lunar_tokenizer *tok, const char *text, size_t len, bool allow_special, lunar_ids *out,
                   lunar_err *err) {
    const unsigned char *p = (const unsigned char *)text;
    size_t valid = utf8_valid_prefix(p, len);
    if (valid != len) return lunar_fail(err, "text is not valid UTF-8 at byte %zu", valid);
    size_t n0 = out->n;
    /* Kimi: 400,000-char pieces, each cut into runs of <= 25,000 (non-)whitespace chars (see header) */
    if (len == 0) return 0;
    size_t i = 0;
    while (i < len) {
        size_t seg = i, run = 0, chars = 0;
        bool is_space = false, ovr = false;
        size_t j = i;
        is_space = py_isspace(utf8_next(p, &j));
        while (i < len && chars < KIMI_MAX_ENCODE_CHARS) {
            size_t at = i;
            uint32_t c = utf8_next(p, &i);
            bool now = py_isspace(c);
            chars++;
            if (now != is_space) {
                run = 1;
                is_space = now;
            } else if (++run > KIMI_MAX_RUN_CHARS) {
                if (encode_run(tok, text + seg, at - seg, ovr, allow_special, out, err)) goto fail;
                seg = at;
                run = 1;
                ovr = false;
            }
            if (c >= LUNAR_UNICODE_OVERRIDE_MIN && override_of(c)) ovr = true;
        }
        if (encode_run(tok, text + seg, i - seg, ovr, allow_special, out, err)) goto fail;
    }
    return 0;
fail:
    out->n = n0;
    return -1;
}

/* ---- decoding ---- */

void lunar_detok_init(lunar_detok *d, const lunar_tokenizer *tok, bool skip_special) {
    memset(d, 0, sizeof *d);
    d->tok = tok;
    d->skip_special = skip_special;
}

static const char REPLACEMENT[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

/* Decodes b[0..n) like Python's "replace" handler into out; with !final an incomplete sequence at the
 * end (a valid prefix of a character) is kept in d->pend instead. */
static size_t decode_bytes(lunar_detok *d, const unsigned char *b, size_t n, bool final, char *out) {
    size_t i = 0, o = 0;
    d->npend = 0;
    while (i < n) {
        unsigned char c = b[i];
        if (c < 0x80) {
            out[o++] = (char)c;
            i++;
            continue;
        }
        unsigned char lo, hi;
        const size_t need = utf8_lead(c, &lo, &hi);
        if (!need) {
            memcpy(out + o, REPLACEMENT, 3), o += 3;
            i++;
            continue;
        }
        /* how many of the following bytes continue it validly */
        size_t k = 1;
        while (k <= need && i + k < n) {
            unsigned char x = b[i + k];
            bool ok = k == 1 ? (x >= lo && x <= hi) : (x & 0xC0) == 0x80;
            if (!ok) break;
            k++;
        }
        if (k > need) { /* complete */
            memcpy(out + o, b + i, need + 1);
            o += need + 1;
            i += need + 1;
        } else if (i + k == n && !final) { /* a valid prefix cut by the end: wait for more */
            memcpy(d->pend, b + i, k);
            d->npend = (int)k;
            i = n;
        } else { /* maximal invalid subpart b[i..i+k) */
            memcpy(out + o, REPLACEMENT, 3), o += 3;
            i += k;
        }
    }
    return o;
}

size_t lunar_detok_push(lunar_detok *d, int32_t id, char *out) {
    size_t n;
    const char *s = lunar_token_bytes(d->tok, id, &n);
    if (!s) return 0;
    size_t o = 0;
    if (id >= d->tok->n_ranks) {
        /* a skipped one is as if absent (what is held back may continue after it, as in HF's decode) */
        if (d->skip_special && lunar_token_is_special(d->tok, id)) return 0;
        o = lunar_detok_flush(d, out); /* its string cannot continue a sequence */
        memcpy(out + o, s, n);
        return o + n;
    }
    unsigned char buf[4 + LUNAR_TOKEN_MAX_BYTES];
    memcpy(buf, d->pend, (size_t)d->npend);
    memcpy(buf + d->npend, s, n);
    return decode_bytes(d, buf, (size_t)d->npend + n, false, out);
}

size_t lunar_detok_flush(lunar_detok *d, char *out) {
    unsigned char buf[4];
    size_t n = (size_t)d->npend;
    memcpy(buf, d->pend, n);
    return decode_bytes(d, buf, n, true, out);
}

char *lunar_detokenize(const lunar_tokenizer *tok, const int32_t *ids, size_t n, bool skip_special, size_t *len) {
    size_t cap = 256 + LUNAR_DETOK_MAX_OUT, o = 0;
    char *s = lunar_xmalloc(cap);
    lunar_detok d;
    lunar_detok_init(&d, tok, skip_special);
    for (size_t i = 0; i <= n; i++) {
        if (o + LUNAR_DETOK_MAX_OUT + 1 > cap) {
            cap = cap * 2 + LUNAR_DETOK_MAX_OUT;
            char *p = realloc(s, cap);
            LUNAR_ASSERT(p);
            s = p;
        }
        o += i < n ? lunar_detok_push(&d, ids[i], s + o) : lunar_detok_flush(&d, s + o);
    }
    s[o] = '\0';
    if (len) *len = o;
    return s;
}
