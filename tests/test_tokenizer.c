/* Kimi tokenizer against Python tiktoken (tests/data/tokenizer/corpus.jsonl from
 * tools/tokenizer/make_expected.py), decoding, streaming detokenization and load errors. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"
#include "text/tokenizer.h"

#define TOK_DIR "data/kimi-tokenizer"
#define CORPUS "tests/data/tokenizer/corpus.jsonl"

static lunar_tokenizer *load_cfg(const char *cfg) {
    char path[256];
    snprintf(path, sizeof path, TOK_DIR "/%s", cfg);
    lunar_tokenizer *tok = NULL;
    lunar_err err = {{0}};
    if (lunar_tokenizer_load_files(&tok, TOK_DIR "/tiktoken.model", path, &err))
        lunar_test_fail(__FILE__, __LINE__, "loading the tokenizer: %s", err.msg);
    return tok;
}

/* ---- text buffers and the corpus generators (mirrors make_expected.py gen_text) ---- */

typedef struct {
    char *s;
    size_t n, cap;
} buf;

static void buf_add(buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->s = realloc(b->s, b->cap);
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}

static size_t utf8_put(char *o, uint32_t c) {
    if (c < 0x80) return o[0] = (char)c, 1;
    if (c < 0x800) return o[0] = (char)(0xC0 | c >> 6), o[1] = (char)(0x80 | (c & 0x3F)), 2;
    if (c < 0x10000)
        return o[0] = (char)(0xE0 | c >> 12), o[1] = (char)(0x80 | (c >> 6 & 0x3F)), o[2] = (char)(0x80 | (c & 0x3F)), 3;
    o[0] = (char)(0xF0 | c >> 18), o[1] = (char)(0x80 | (c >> 12 & 0x3F));
    o[2] = (char)(0x80 | (c >> 6 & 0x3F)), o[3] = (char)(0x80 | (c & 0x3F));
    return 4;
}

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static buf gen_text(json_t *gen) {
    buf b = {0};
    buf_add(&b, "", 0);
    const char *type = json_string_value(json_object_get(gen, "type"));
    if (type && strcmp(type, "fragments") == 0) {
        uint64_t s = (uint64_t)json_integer_value(json_object_get(gen, "seed"));
        json_t *fr = json_object_get(gen, "fragments");
        size_t nf = json_array_size(fr), want = (size_t)json_integer_value(json_object_get(gen, "bytes"));
        while (b.n < want) {
            json_t *f = json_array_get(fr, splitmix64(&s) % nf);
            buf_add(&b, json_string_value(f), json_string_length(f));
        }
    } else if (type && strcmp(type, "codepoints") == 0) {
        json_t *sep = json_object_get(gen, "sep");
        uint32_t lo = (uint32_t)json_integer_value(json_object_get(gen, "lo"));
        uint32_t hi = (uint32_t)json_integer_value(json_object_get(gen, "hi"));
        for (uint32_t c = lo; c < hi; c++) {
            if (c >= 0xD800 && c < 0xE000) continue;
            char u[4];
            buf_add(&b, u, utf8_put(u, c));
            buf_add(&b, json_string_value(sep), json_string_length(sep));
        }
    } else {
        lunar_test_fail(__FILE__, __LINE__, "unknown generator");
    }
    return b;
}

static uint64_t fnv_ids(const int32_t *ids, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)ids[i];
        for (int k = 0; k < 4; k++) h = (h ^ ((v >> (8 * k)) & 0xFF)) * 0x100000001b3ull;
    }
    return h;
}

static bool valid_utf8(const char *s_, size_t n) {
    const unsigned char *s = (const unsigned char *)s_;
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        size_t need = c < 0x80 ? 0 : c >= 0xC2 && c <= 0xDF ? 1 : c >= 0xE0 && c <= 0xEF ? 2 : c >= 0xF0 && c <= 0xF4 ? 3 : 9;
        if (need == 9) return false;
        for (size_t k = 1; k <= need; k++)
            if (i + k >= n || (s[i + k] & 0xC0) != 0x80) return false;
        if (c == 0xE0 && s[i + 1] < 0xA0) return false;
        if (c == 0xED && s[i + 1] > 0x9F) return false;
        if (c == 0xF0 && s[i + 1] < 0x90) return false;
        if (c == 0xF4 && s[i + 1] > 0x8F) return false;
        i += need + 1;
    }
    return true;
}

static bool ids_equal(const lunar_ids *got, json_t *want) {
    if (got->n != json_array_size(want)) return false;
    for (size_t i = 0; i < got->n; i++)
        if (got->ids[i] != (int32_t)json_integer_value(json_array_get(want, i))) return false;
    return true;
}

static size_t first_diff(const lunar_ids *got, json_t *want) {
    size_t i = 0;
    while (i < got->n && i < json_array_size(want) && got->ids[i] == (int32_t)json_integer_value(json_array_get(want, i)))
        i++;
    return i;
}

/* streams ids through the detokenizer: every chunk must be valid UTF-8; returns the whole text */
static char *stream_decode(const lunar_tokenizer *tok, const int32_t *ids, size_t n, size_t *len, int *bad_chunks) {
    buf b = {0};
    buf_add(&b, "", 0);
    lunar_detok d;
    lunar_detok_init(&d, tok, false);
    char out[LUNAR_DETOK_MAX_OUT];
    for (size_t i = 0; i <= n; i++) {
        size_t o = i < n ? lunar_detok_push(&d, ids[i], out) : lunar_detok_flush(&d, out);
        if (!valid_utf8(out, o)) ++*bad_chunks;
        buf_add(&b, out, o);
    }
    *len = b.n;
    return b.s;
}

TEST(tokenizer_basics) {
    lunar_tokenizer *k2 = load_cfg("tokenizer_config.k2.json"), *k3 = load_cfg("tokenizer_config.k3.json");
    if (!k2 || !k3) return;
    CHECK(lunar_tokenizer_vocab_size(k2) == 163840);
    CHECK(lunar_tokenizer_num_ranks(k2) == 163584);
    CHECK(lunar_token_id(k2, "<|im_end|>") == 163586);
    CHECK(lunar_token_id(k2, "[BOS]") == 163584);
    CHECK(lunar_token_id(k2, "<think>") == 163606);
    CHECK(lunar_token_id(k2, "<|reserved_token_163600|>") == 163600);
    CHECK(lunar_token_id(k2, "<|reserved_token_163586|>") == -1);
    CHECK(lunar_token_id(k2, "<|im_end") == -1);
    CHECK(lunar_token_id(k3, "<|end_of_msg|>") == 163586);
    CHECK(lunar_token_id(k3, "<|open|>") == 163587);
    CHECK(lunar_token_id(k3, "<|close|>") == 163588);
    CHECK(lunar_token_id(k3, "<|sep|>") == 163589);
    CHECK(lunar_token_id(k3, "<|media_pad|>") == 163605);
    CHECK(lunar_token_id(k3, "<|im_end|>") == -1);
    CHECK(lunar_token_is_special(k2, 163586));
    CHECK(!lunar_token_is_special(k2, 163606)); /* <think> survives skip_special_tokens */
    CHECK(!lunar_token_is_special(k2, 163597));
    CHECK(!lunar_token_is_special(k2, 163600)); /* unnamed reserved */
    CHECK(!lunar_token_is_special(k2, 100));
    size_t n;
    const char *s = lunar_token_bytes(k2, 0, &n);
    CHECK(n == 1 && s[0] == '!');
    s = lunar_token_bytes(k2, 163839, &n);
    CHECK(n == 5 && memcmp(s, "[PAD]", 5) == 0);
    s = lunar_token_bytes(k2, 163700, &n);
    CHECK(n == strlen("<|reserved_token_163700|>") && memcmp(s, "<|reserved_token_163700|>", n) == 0);
    CHECK(lunar_token_bytes(k2, 163840, &n) == NULL && n == 0);
    CHECK(lunar_token_bytes(k2, -1, &n) == NULL);
    lunar_ids ids = {0};
    lunar_err err = {{0}};
    CHECK(lunar_tokenize(k2, "a<|im_end|>", 11, true, &ids, &err) == 0);
    CHECK(ids.n == 2 && ids.ids[1] == 163586);
    ids.n = 0;
    CHECK(lunar_tokenize(k2, "ab\xC3(", 4, true, &ids, &err) == -1);
    CHECK(strstr(err.msg, "UTF-8") && strstr(err.msg, "byte 2"));
    CHECK(ids.n == 0);
    CHECK(lunar_tokenize(k2, "\xED\xA0\x80", 3, true, &ids, &err) == -1); /* surrogate */
    CHECK(lunar_tokenize(k2, "", 0, true, &ids, &err) == 0 && ids.n == 0);
    lunar_ids_free(&ids);
    lunar_tokenizer_free(k2);
    lunar_tokenizer_free(k3);
}

TEST(tokenizer_corpus) {
    lunar_tokenizer *k2 = load_cfg("tokenizer_config.k2.json"), *k3 = load_cfg("tokenizer_config.k3.json");
    FILE *f = fopen(CORPUS, "rb");
    CHECK_MSG(f, "cannot open " CORPUS);
    if (!k2 || !k3 || !f) goto out;
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    int n_cases = 0, n_hashed = 0, n_decode = 0, lineno = 0;
    lunar_ids ids = {0};
    lunar_err err = {{0}};
    while ((got = getline(&line, &cap, f)) > 0) {
        lineno++;
        json_error_t je;
        json_t *rec = json_loads(line, JSON_ALLOW_NUL, &je);
        if (!rec) {
            lunar_test_fail(__FILE__, __LINE__, CORPUS ":%d: %s", lineno, je.text);
            continue;
        }
        const char *kind = json_string_value(json_object_get(rec, "kind"));
        const char *name = json_string_value(json_object_get(rec, "name"));
        if (strcmp(kind, "case") == 0) {
            json_t *jt = json_object_get(rec, "text");
            const char *text = json_string_value(jt);
            size_t len = json_string_length(jt);
            struct {
                const lunar_tokenizer *tok;
                bool special;
                const char *key;
            } modes[] = {{k2, false, "ordinary"}, {k3, false, "ordinary"}, {k2, true, "special_k2"}, {k3, true, "special_k3"}};
            for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) {
                json_t *want = json_object_get(rec, modes[m].key);
                if (!want) want = json_object_get(rec, "ordinary");
                ids.n = 0;
                if (lunar_tokenize(modes[m].tok, text, len, modes[m].special, &ids, &err)) {
                    lunar_test_fail(__FILE__, __LINE__, "%s: %s", name, err.msg);
                    continue;
                }
                size_t d = first_diff(&ids, want);
                CHECK_MSG(ids_equal(&ids, want), "%s (%s): %zu ids, want %zu; first difference at %zu: %d vs %lld",
                          name, modes[m].key, ids.n, json_array_size(want), d, d < ids.n ? ids.ids[d] : -1,
                          (long long)json_integer_value(json_array_get(want, d)));
                /* decode(encode(x)) == x, streamed and whole */
                size_t dl;
                int bad = 0;
                char *back = stream_decode(modes[m].tok, ids.ids, ids.n, &dl, &bad);
                CHECK_MSG(dl == len && memcmp(back, text, len) == 0, "%s (%s): decode(encode(x)) != x", name,
                          modes[m].key);
                CHECK_MSG(bad == 0, "%s: %d streamed chunks not valid UTF-8", name, bad);
                free(back);
            }
            n_cases++;
        } else if (strcmp(kind, "hashed") == 0) {
            buf text = gen_text(json_object_get(rec, "gen"));
            bool special = json_is_true(json_object_get(rec, "special"));
            ids.n = 0;
            if (lunar_tokenize(k2, text.s, text.n, special, &ids, &err)) {
                lunar_test_fail(__FILE__, __LINE__, "%s: %s", name, err.msg);
            } else {
                char hex[17];
                snprintf(hex, sizeof hex, "%016llx", (unsigned long long)fnv_ids(ids.ids, ids.n));
                size_t want_n = (size_t)json_integer_value(json_object_get(rec, "count"));
                CHECK_MSG(ids.n == want_n && strcmp(hex, json_string_value(json_object_get(rec, "fnv"))) == 0,
                          "%s: %zu ids (hash %s), want %zu (hash %s)", name, ids.n, hex, want_n,
                          json_string_value(json_object_get(rec, "fnv")));
                size_t dl;
                char *back = lunar_detokenize(k2, ids.ids, ids.n, false, &dl);
                CHECK_MSG(dl == text.n && memcmp(back, text.s, dl) == 0, "%s: decode(encode(x)) != x", name);
                free(back);
            }
            free(text.s);
            n_hashed++;
        } else if (strcmp(kind, "decode") == 0) {
            json_t *jids = json_object_get(rec, "ids"), *jt = json_object_get(rec, "text");
            size_t n = json_array_size(jids);
            int32_t *v = malloc(n * sizeof *v);
            for (size_t i = 0; i < n; i++) v[i] = (int32_t)json_integer_value(json_array_get(jids, i));
            size_t dl;
            int bad = 0;
            char *s = stream_decode(k2, v, n, &dl, &bad);
            CHECK_MSG(dl == json_string_length(jt) && memcmp(s, json_string_value(jt), dl) == 0,
                      "%s: streamed decode differs from Python's", name);
            CHECK_MSG(bad == 0, "%s: %d streamed chunks not valid UTF-8", name, bad);
            free(s);
            free(v);
            n_decode++;
        }
        json_decref(rec);
    }
    free(line);
    lunar_ids_free(&ids);
    printf("    corpus: %d cases x 4 modes, %d hashed texts, %d decode cases\n", n_cases, n_hashed, n_decode);
    CHECK(n_cases > 400 && n_hashed > 1000 && n_decode >= 200);
out:
    if (f) fclose(f);
    lunar_tokenizer_free(k2);
    lunar_tokenizer_free(k3);
}

/* pushes ids one at a time, returns the concatenated output */
static size_t push_all(lunar_detok *d, const int32_t *ids, size_t n, char *out, bool flush) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) o += lunar_detok_push(d, ids[i], out + o);
    if (flush) o += lunar_detok_flush(d, out + o);
    return o;
}

TEST(tokenizer_detok_streaming) {
    lunar_tokenizer *tok = load_cfg("tokenizer_config.k2.json");
    if (!tok) return;
    /* byte tokens: the rank of a single byte b */
    int32_t byte_id[256];
    for (int i = 0; i < 163584; i++) {
        size_t n;
        const char *s = lunar_token_bytes(tok, i, &n);
        if (n == 1) byte_id[(unsigned char)s[0]] = i;
    }
    lunar_detok d;
    char out[8 * LUNAR_DETOK_MAX_OUT];
    /* "é" = C3 A9 split over two tokens: nothing, then the character */
    lunar_detok_init(&d, tok, false);
    CHECK(lunar_detok_push(&d, byte_id[0xC3], out) == 0);
    CHECK(lunar_detok_push(&d, byte_id[0xA9], out) == 2 && memcmp(out, "\xC3\xA9", 2) == 0);
    /* 4-byte emoji fed byte by byte */
    const unsigned char smile[4] = {0xF0, 0x9F, 0x98, 0x80};
    for (int i = 0; i < 3; i++) CHECK(lunar_detok_push(&d, byte_id[smile[i]], out) == 0);
    CHECK(lunar_detok_push(&d, byte_id[smile[3]], out) == 4 && memcmp(out, smile, 4) == 0);
    /* broken: C3 then 'a' -> U+FFFD a; E2 82 then special -> U+FFFD <|im_end|>; pending at flush -> U+FFFD */
    int32_t seq1[] = {byte_id[0xC3], byte_id['a']};
    size_t o = push_all(&d, seq1, 2, out, false);
    CHECK(o == 4 && memcmp(out, "\xEF\xBF\xBD" "a", 4) == 0);
    int32_t seq2[] = {byte_id[0xE2], byte_id[0x82], 163586};
    o = push_all(&d, seq2, 3, out, false);
    CHECK(o == 13 && memcmp(out, "\xEF\xBF\xBD<|im_end|>", 13) == 0);
    int32_t seq3[] = {byte_id[0xF0], byte_id[0x9F]};
    o = push_all(&d, seq3, 2, out, true);
    CHECK(o == 3 && memcmp(out, "\xEF\xBF\xBD", 3) == 0);
    /* invalid lead bytes and a surrogate encoding come out at once, one U+FFFD per maximal subpart */
    int32_t seq4[] = {byte_id[0xFF], byte_id[0xED], byte_id[0xA0], byte_id[0x80]};
    o = push_all(&d, seq4, 4, out, false);
    CHECK(o == 12);
    /* skip_special: <|im_end|> dropped, <think> kept, a sequence continues across a skipped token */
    lunar_detok_init(&d, tok, true);
    int32_t seq5[] = {byte_id[0xC3], 163586, byte_id[0xA9], 163606};
    o = push_all(&d, seq5, 4, out, true);
    CHECK(o == 9 && memcmp(out, "\xC3\xA9<think>", 9) == 0);
    /* emoji ZWJ sequences and CJK through real encodings: every chunk valid, the whole exact */
    const char *texts[] = {"👨‍👩‍👧‍👦 family, 👩🏽‍💻 coder, 🏳️‍🌈 flag", "漢字かなカナ한국어", "naïve café ñ ü ß",
                           "\xF0\x9F\xA7\x91\xE2\x80\x8D\xF0\x9F\xA4\x9D\xE2\x80\x8D\xF0\x9F\xA7\x91"};
    for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) {
        lunar_ids ids = {0};
        lunar_err err = {{0}};
        CHECK(lunar_tokenize(tok, texts[t], strlen(texts[t]), false, &ids, &err) == 0);
        size_t dl;
        int bad = 0;
        char *back = stream_decode(tok, ids.ids, ids.n, &dl, &bad);
        CHECK(dl == strlen(texts[t]) && memcmp(back, texts[t], dl) == 0);
        CHECK(bad == 0);
        free(back);
        /* and byte by byte */
        lunar_detok_init(&d, tok, false);
        o = 0;
        for (size_t i = 0; texts[t][i]; i++) {
            size_t k = lunar_detok_push(&d, byte_id[(unsigned char)texts[t][i]], out + o);
            CHECK(valid_utf8(out + o, k));
            o += k;
        }
        o += lunar_detok_flush(&d, out + o);
        CHECK(o == strlen(texts[t]) && memcmp(out, texts[t], o) == 0);
        lunar_ids_free(&ids);
    }
    lunar_tokenizer_free(tok);
}

static void write_file(const char *path, const char *s) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fputs(s, f);
    fclose(f);
}

/* a tiny valid model: all 256 bytes as ranks 0..255 */
static void write_bytes_model(const char *path, const char *extra) {
    static const char *b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    FILE *f = fopen(path, "wb");
    if (!f) return;
    for (int b = 0; b < 256; b++) fprintf(f, "%c%c== %d\n", b64[b >> 2], b64[(b & 3) << 4], b);
    fputs(extra, f);
    fclose(f);
}

static void expect_load_error(const char *model, const char *cfg, const char *want1, const char *want2) {
    lunar_tokenizer *tok = NULL;
    lunar_err err = {{0}};
    int rc = lunar_tokenizer_load_files(&tok, model, cfg, &err);
    CHECK_MSG(rc == -1 && tok == NULL, "loading %s / %s should fail", model, cfg);
    CHECK_MSG(strstr(err.msg, want1) && (!want2 || strstr(err.msg, want2)), "error \"%s\" lacks \"%s\" / \"%s\"",
              err.msg, want1, want2 ? want2 : "");
    lunar_tokenizer_free(tok);
}

TEST(tokenizer_load_errors) {
    char dir[] = "/tmp/lunar_tok_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char model[128], cfg[128], badcfg[128];
    snprintf(model, sizeof model, "%s/tiktoken.model", dir);
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    snprintf(badcfg, sizeof badcfg, "%s/bad_config.json", dir);
    write_file(cfg, "{\"added_tokens_decoder\": {\"258\": {\"content\": \"<|x|>\", \"special\": true}}}");

    write_bytes_model(model, "YWI= 256\nYWJj 257\n"); /* ab, abc */
    lunar_tokenizer *tok = NULL;
    lunar_err err = {{0}};
    CHECK_MSG(lunar_tokenizer_load(&tok, dir, &err) == 0, "%s", err.msg);
    if (tok) {
        CHECK(lunar_tokenizer_vocab_size(tok) == 258 + 256);
        CHECK(lunar_token_id(tok, "<|x|>") == 258);
        CHECK(lunar_token_id(tok, "<|reserved_token_259|>") == 259);
        lunar_ids ids = {0};
        CHECK(lunar_tokenize(tok, "abc ab", 6, true, &ids, &err) == 0);
        CHECK(ids.n == 3 && ids.ids[0] == 257 && ids.ids[1] == ' ' && ids.ids[2] == 256);
        lunar_ids_free(&ids);
        lunar_tokenizer_free(tok);
    }
    /* the config's id 257 is a rank here: outside the reserved ids */
    write_bytes_model(model, "YWI= 256\n");
    write_file(badcfg, "{\"added_tokens_decoder\": {\"256\": {\"content\": \"<|x|>\"}}}");
    expect_load_error(model, badcfg, "bad_config.json", "outside the reserved ids");
    write_file(badcfg, "{\"added_tokens_decoder\": [}");
    expect_load_error(model, badcfg, "bad_config.json:1", NULL);
    write_file(badcfg, "{\"x\": 1}");
    expect_load_error(model, badcfg, "bad_config.json", "added_tokens_decoder");
    write_file(badcfg, "{\"added_tokens_decoder\": {\"257\": {\"content\": \"[A]\"}, \"258\": {\"content\": \"[A]\"}}}");
    expect_load_error(model, badcfg, "bad_config.json", "same string");

    write_bytes_model(model, "YWI= 256\nnot*base64 257\n");
    expect_load_error(model, cfg, "tiktoken.model:258:", "base64");
    write_bytes_model(model, "YWI= 256\nYWJj\n");
    expect_load_error(model, cfg, "tiktoken.model:258:", NULL);
    write_bytes_model(model, "YWI= 256\nYWJj 12x\n");
    expect_load_error(model, cfg, "tiktoken.model:258:", "invalid rank");
    write_bytes_model(model, "YWI= 256\nYWJj 256\n");
    expect_load_error(model, cfg, "tiktoken.model:258:", "already given on line 257");
    write_bytes_model(model, "YWI= 256\nYWJj 300\n");
    expect_load_error(model, cfg, "tiktoken.model:258:", "out of range");
    write_bytes_model(model, "YWI= 256\nYWI= 257\n");
    expect_load_error(model, cfg, "tiktoken.model:258:", "repeats the token of rank 256");
    write_file(model, "YWI= 0\n");
    expect_load_error(model, cfg, "tiktoken.model", "single byte");
    write_file(model, "");
    expect_load_error(model, cfg, "tiktoken.model", "no tokens");
    char missing[160];
    snprintf(missing, sizeof missing, "%s/nope.model", dir);
    expect_load_error(missing, cfg, "nope.model", "cannot open");
    write_bytes_model(model, "");
    snprintf(missing, sizeof missing, "%s/nope.json", dir);
    expect_load_error(model, missing, "nope.json", NULL);

    unlink(model);
    unlink(cfg);
    unlink(badcfg);
    rmdir(dir);
}
