#include <dirent.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io/safetensors.h"
#include "test.h"

/* A fresh temp dir per test; removed (files, then dir) by rm_tmpdir. */
static char *make_tmpdir(char *buf) {
    strcpy(buf, "/tmp/lunar_st_XXXXXX");
    return mkdtemp(buf);
}

static void rm_tmpdir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[512];
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static void write_bytes(const char *path, const void *b, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(b, 1, n, f);
    fclose(f);
}

/* File image: 8-byte header length, header, then data_len zero bytes. */
static uint8_t *image(const char *header, size_t data_len, size_t *len) {
    size_t h = strlen(header);
    *len = 8 + h + data_len;
    uint8_t *b = calloc(1, *len);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    return b;
}

/* Parsing header+data must fail with a message containing the label and each needle. */
static void expect_bad(const char *header, size_t data_len, const char *n1, const char *n2, int line) {
    size_t len;
    uint8_t *b = image(header, data_len, &len);
    lunar_st *st = (lunar_st *)1;
    lunar_err err = {{0}};
    int rc = lunar_st_parse_buffer(&st, b, len, "bad.safetensors", &err);
    CHECK_MSG(rc == -1 && st == NULL, "line %d: expected failure for %s", line, header);
    CHECK_MSG(strstr(err.msg, "bad.safetensors"), "line %d: no file name in '%s'", line, err.msg);
    CHECK_MSG(!n1 || strstr(err.msg, n1), "line %d: '%s' not in '%s'", line, n1, err.msg);
    CHECK_MSG(!n2 || strstr(err.msg, n2), "line %d: '%s' not in '%s'", line, n2, err.msg);
    if (rc == 0) lunar_st_close(st);
    free(b);
}
#define BAD(h, n, a, b) expect_bad(h, n, a, b, __LINE__)

TEST(st_roundtrip_all_dtypes) {
    char dir[64], path[128];
    if (!make_tmpdir(dir)) {
        CHECK(0);
        return;
    }
    snprintf(path, sizeof path, "%s/all.safetensors", dir);
    lunar_tensor ts[LUNAR_DTYPE_COUNT + 1];
    uint8_t data[LUNAR_DTYPE_COUNT][48];
    char names[LUNAR_DTYPE_COUNT][16];
    for (int d = 0; d < LUNAR_DTYPE_COUNT; d++) {
        size_t es = lunar_dtype_size((lunar_dtype)d);
        for (size_t i = 0; i < sizeof data[d]; i++) data[d][i] = (uint8_t)(d * 31 + i);
        snprintf(names[d], sizeof names[d], "t.%s", lunar_dtype_name((lunar_dtype)d));
        /* 2 x (24/es) elements = 48 bytes for every dtype */
        ts[d] = (lunar_tensor){names[d], (lunar_dtype)d, 2, {2, (int64_t)(24 / es)}, data[d], 48};
    }
    /* an empty tensor too */
    ts[LUNAR_DTYPE_COUNT] = (lunar_tensor){"empty", LUNAR_DTYPE_BF16, 3, {4, 0, 2}, NULL, 0};
    const char *meta[] = {"format", "pt", "author", "lunar", NULL};
    lunar_err err = {{0}};
    CHECK_MSG(lunar_st_write(path, ts, LUNAR_DTYPE_COUNT + 1, meta, &err) == 0, "%s", err.msg);

    lunar_st *st = NULL;
    CHECK_MSG(lunar_st_open(&st, path, &err) == 0, "%s", err.msg);
    if (!st) goto out;
    CHECK(lunar_st_count(st) == LUNAR_DTYPE_COUNT + 1);
    for (int d = 0; d < LUNAR_DTYPE_COUNT; d++) {
        const lunar_tensor *t = lunar_st_find(st, names[d]);
        CHECK_MSG(t, "missing %s", names[d]);
        if (!t) continue;
        CHECK(t->dtype == (lunar_dtype)d && t->ndim == 2 && t->shape[0] == 2);
        CHECK(t->shape[1] == (int64_t)(24 / lunar_dtype_size((lunar_dtype)d)));
        CHECK(t->nbytes == 48 && memcmp(t->data, data[d], 48) == 0);
        CHECK(t->name != names[d] && strcmp(t->name, names[d]) == 0); /* owned copy */
        CHECK(strcmp(lunar_st_file_of(st, t), path) == 0);
    }
    const lunar_tensor *e = lunar_st_find(st, "empty");
    CHECK(e && e->ndim == 3 && e->nbytes == 0 && e->shape[1] == 0);
    CHECK(lunar_st_find(st, "nope") == NULL);
    CHECK(lunar_st_at(st, 0) != NULL && lunar_st_at(st, LUNAR_DTYPE_COUNT + 1) == NULL);
    CHECK(lunar_st_metadata(st, "format") && strcmp(lunar_st_metadata(st, "format"), "pt") == 0);
    CHECK(lunar_st_metadata(st, "author") && strcmp(lunar_st_metadata(st, "author"), "lunar") == 0);
    CHECK(lunar_st_metadata(st, "missing") == NULL);
    /* float read-back through the shared conversions */
    const lunar_tensor *f = lunar_st_find(st, "t.F32");
    float x;
    memcpy(&x, data[LUNAR_DTYPE_F32], 4);
    CHECK(f && lunar_tensor_get_f32(f, 0) == x);
    lunar_st_close(st);

    /* the header is padded to a multiple of 8 so the data section is 8-aligned */
    FILE *fp = fopen(path, "rb");
    uint8_t hl[8] = {0};
    CHECK(fp && fread(hl, 1, 8, fp) == 8);
    if (fp) fclose(fp);
    CHECK(hl[0] % 8 == 0);
out:
    rm_tmpdir(dir);
}

TEST(st_directory_single_and_missing) {
    char dir[64], path[128];
    if (!make_tmpdir(dir)) return;
    lunar_err err = {{0}};
    lunar_st *st = NULL;
    CHECK(lunar_st_open(&st, dir, &err) == -1 && strstr(err.msg, dir));
    float v[3] = {1, 2, 3};
    lunar_tensor t = {"w", LUNAR_DTYPE_F32, 1, {3}, v, 12};
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK(lunar_st_write(path, &t, 1, NULL, &err) == 0);
    CHECK_MSG(lunar_st_open(&st, dir, &err) == 0, "%s", err.msg);
    if (st) {
        const lunar_tensor *w = lunar_st_find(st, "w");
        CHECK(w && lunar_tensor_get_f32(w, 2) == 3.0f);
        CHECK(lunar_st_metadata(st, "format") == NULL);
        lunar_st_close(st);
    }
    CHECK(lunar_st_open(&st, "/nonexistent/x.safetensors", &err) == -1 && strstr(err.msg, "/nonexistent/x"));
    rm_tmpdir(dir);
}

/* Writes two shards and an index into dir; extra is appended to the weight_map body. */
static void write_sharded(const char *dir, const char *index_json) {
    char p[256];
    float a[4] = {1, 2, 3, 4}, b[2] = {5, 6};
    uint16_t c[2] = {0x3f80, 0x4000}; /* bf16 1, 2 */
    lunar_tensor s1[2] = {{"a", LUNAR_DTYPE_F32, 2, {2, 2}, a, 16}, {"b", LUNAR_DTYPE_F32, 1, {2}, b, 8}};
    lunar_tensor s2[1] = {{"c", LUNAR_DTYPE_BF16, 1, {2}, c, 4}};
    const char *meta[] = {"format", "pt", NULL};
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
    lunar_st_write(p, s1, 2, meta, NULL);
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    lunar_st_write(p, s2, 1, NULL, NULL);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    write_bytes(p, index_json, strlen(index_json));
}

#define SH1 "\"model-00001-of-00002.safetensors\""
#define SH2 "\"model-00002-of-00002.safetensors\""

TEST(st_sharded) {
    char dir[64];
    if (!make_tmpdir(dir)) return;
    write_sharded(dir, "{\"metadata\": {\"total_size\": 28}, \"weight_map\": {\"a\": " SH1 ", \"c\": " SH2
                       ", \"b\": " SH1 "}}");
    lunar_err err = {{0}};
    lunar_st *st = NULL;
    CHECK_MSG(lunar_st_open(&st, dir, &err) == 0, "%s", err.msg);
    if (st) {
        CHECK(lunar_st_count(st) == 3);
        const lunar_tensor *a = lunar_st_find(st, "a"), *c = lunar_st_find(st, "c");
        CHECK(a && lunar_tensor_get_f32(a, 3) == 4.0f);
        CHECK(c && lunar_tensor_get_f32(c, 1) == 2.0f);
        CHECK(a && strstr(lunar_st_file_of(st, a), "model-00001-of-00002"));
        CHECK(c && strstr(lunar_st_file_of(st, c), "model-00002-of-00002"));
        CHECK(lunar_st_metadata(st, "format") && strcmp(lunar_st_metadata(st, "format"), "pt") == 0);
        lunar_st_close(st);
    }
    rm_tmpdir(dir);
}

static void sharded_bad(const char *index_json, const char *n1, const char *n2, int line) {
    char dir[64];
    if (!make_tmpdir(dir)) return;
    write_sharded(dir, index_json);
    lunar_err err = {{0}};
    lunar_st *st = NULL;
    CHECK_MSG(lunar_st_open(&st, dir, &err) == -1 && !st, "line %d: expected failure", line);
    CHECK_MSG(strstr(err.msg, n1), "line %d: '%s' not in '%s'", line, n1, err.msg);
    CHECK_MSG(!n2 || strstr(err.msg, n2), "line %d: '%s' not in '%s'", line, n2, err.msg);
    if (st) lunar_st_close(st);
    rm_tmpdir(dir);
}
#define SHBAD(j, a, b) sharded_bad(j, a, b, __LINE__)

TEST(st_sharded_errors) {
    SHBAD("{\"weight_map\": {\"a\": " SH1 ", \"c\": " SH1 "}}", "tensor 'c'", "model-00001-of-00002");
    SHBAD("{\"weight_map\": {\"a\": " SH1 ", \"zz\": " SH2 "}}", "tensor 'zz'", "model-00002-of-00002");
    SHBAD("{\"weight_map\": {\"a\": \"missing.safetensors\"}}", "missing.safetensors", "cannot open");
    SHBAD("{\"weight_map\": {\"a\": \"../x.safetensors\"}}", "index.json", "'a'");
    SHBAD("{\"weight_map\": {\"a\": 3}}", "index.json", "'a'");
    SHBAD("{\"weight_map\": []}", "index.json", "weight_map");
    SHBAD("{\"metadata\": {}}", "index.json", "weight_map");
    SHBAD("{\"weight_map\": {\"a\": " SH1 ",}", "index.json", "JSON");
    SHBAD("", "index.json", NULL);

    /* the same tensor name in two shards */
    char dir[64], p[256];
    if (!make_tmpdir(dir)) return;
    write_sharded(dir, "{\"weight_map\": {\"a\": " SH1 ", \"c\": " SH2 "}}");
    float z = 0;
    lunar_tensor dup[2] = {{"c", LUNAR_DTYPE_F32, 1, {1}, &z, 4}, {"a", LUNAR_DTYPE_F32, 1, {1}, &z, 4}};
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    lunar_st_write(p, dup, 2, NULL, NULL);
    lunar_err err = {{0}};
    lunar_st *st = NULL;
    CHECK(lunar_st_open(&st, dir, &err) == -1);
    CHECK_MSG(strstr(err.msg, "tensor 'a'") && strstr(err.msg, "duplicate") && strstr(err.msg, "model-00001") &&
                  strstr(err.msg, "model-00002"),
              "%s", err.msg);
    rm_tmpdir(dir);
}

TEST(st_malformed_headers) {
    const char *ok = "{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,8],\"data_offsets\":[0,64]}}";
    size_t len;
    uint8_t *b = image(ok, 64, &len);
    lunar_st *st = NULL;
    lunar_err err = {{0}};
    CHECK_MSG(lunar_st_parse_buffer(&st, b, len, "ok.safetensors", &err) == 0, "%s", err.msg);
    if (st) {
        CHECK(lunar_st_count(st) == 1 && lunar_st_find(st, "w")->data == b + len - 64);
        lunar_st_close(st);
    }
    free(b);

    BAD("{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,8],\"data_offsets\":[0,100]}}", 100, "tensor 'w'",
        "data_offsets [0, 100] do not match shape [4, 8] of BF16 (64 bytes)");
    BAD("{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,8],\"data_offsets\":[0,64]}}", 63, "tensor 'w'", "past the end");
    BAD("{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,8],\"data_offsets\":[64,0]}}", 64, "tensor 'w'", "begin <= end");
    BAD("{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,8],\"data_offsets\":[-2,62]}}", 64, "tensor 'w'", "data_offsets");
    BAD("{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,8],\"data_offsets\":[0]}}", 64, "tensor 'w'", "data_offsets");
    BAD("{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,8],\"data_offsets\":[0,6.4e1]}}", 64, "tensor 'w'", "data_offsets");
    BAD("{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,8]}}", 64, "tensor 'w'", "data_offsets");
    BAD("{\"w\":{\"dtype\":\"BF17\",\"shape\":[4,8],\"data_offsets\":[0,64]}}", 64, "tensor 'w'", "BF17");
    BAD("{\"w\":{\"dtype\":\"bf16\",\"shape\":[4,8],\"data_offsets\":[0,64]}}", 64, "tensor 'w'", "dtype");
    BAD("{\"w\":{\"dtype\":16,\"shape\":[4,8],\"data_offsets\":[0,64]}}", 64, "tensor 'w'", "dtype");
    BAD("{\"w\":{\"shape\":[4,8],\"data_offsets\":[0,64]}}", 64, "tensor 'w'", "dtype");
    BAD("{\"w\":{\"dtype\":\"BF16\",\"shape\":[-4,8],\"data_offsets\":[0,64]}}", 64, "tensor 'w'", "shape[0]");
    BAD("{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,8.5],\"data_offsets\":[0,64]}}", 64, "tensor 'w'", "shape[1]");
    BAD("{\"w\":{\"dtype\":\"BF16\",\"shape\":[4,\"8\"],\"data_offsets\":[0,64]}}", 64, "tensor 'w'", "shape[1]");
    BAD("{\"w\":{\"dtype\":\"BF16\",\"shape\":4,\"data_offsets\":[0,64]}}", 64, "tensor 'w'", "shape");
    BAD("{\"w\":{\"dtype\":\"BF16\",\"data_offsets\":[0,64]}}", 64, "tensor 'w'", "shape");
    BAD("{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1],\"data_offsets\":[0,1]}}", 1, "tensor 'w'", "5 dims");
    BAD("{\"w\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}", 8, "tensor 'w'",
        "overflow");
    BAD("{\"w\":{\"dtype\":\"F64\",\"shape\":[2305843009213693952],\"data_offsets\":[0,8]}}", 8, "tensor 'w'",
        "overflow");
    BAD("{\"w\":[1,2]}", 8, "tensor 'w'", "not an object");
    BAD("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
        "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]}}",
        8, "overlap", "tensor 'a'");
    BAD("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
        "\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}",
        8, "duplicate", NULL);
    BAD("{\"__metadata__\":{\"format\":1}}", 0, "__metadata__", "format");
    BAD("{\"__metadata__\":[]}", 0, "__metadata__", NULL);
    BAD("[1,2,3]", 0, "not a JSON object", NULL);
    BAD("{\"w\":", 0, "not valid JSON", NULL);
    BAD("", 0, "not valid JSON", NULL);
    BAD("{\"\xff\xfe\":1}", 0, "not valid JSON", NULL);

    /* Empty (zero-size) tensors may share an offset; adjacent tensors are fine. */
    b = image("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
              "\"e\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[2,2]},"
              "\"b\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[4,5]}}",
              5, &len);
    CHECK_MSG(lunar_st_parse_buffer(&st, b, len, "ok.safetensors", &err) == 0, "%s", err.msg);
    if (st) {
        CHECK(lunar_st_count(st) == 3 && lunar_st_find(st, "b")->ndim == 0);
        lunar_st_close(st);
    }
    free(b);
}

TEST(st_bad_lengths) {
    lunar_st *st = NULL;
    lunar_err err = {{0}};
    uint8_t small[7] = {0};
    CHECK(lunar_st_parse_buffer(&st, small, 7, "tiny.safetensors", &err) == -1 && strstr(err.msg, "tiny.safetensors") &&
          strstr(err.msg, "too short"));
    CHECK(lunar_st_parse_buffer(&st, small, 0, "tiny.safetensors", &err) == -1);
    uint8_t huge[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, '{', '}'};
    CHECK(lunar_st_parse_buffer(&st, huge, 16, "huge.safetensors", &err) == -1 && strstr(err.msg, "absurd"));
    uint8_t past[16] = {9, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' '};
    CHECK(lunar_st_parse_buffer(&st, past, 12, "past.safetensors", &err) == -1 && strstr(err.msg, "exceeds"));

    char dir[64], p[128];
    if (!make_tmpdir(dir)) return;
    snprintf(p, sizeof p, "%s/empty.safetensors", dir);
    write_bytes(p, "", 0);
    CHECK(lunar_st_open(&st, p, &err) == -1 && strstr(err.msg, "empty.safetensors"));
    snprintf(p, sizeof p, "%s/trunc.safetensors", dir);
    write_bytes(p, "\x40\0\0\0\0\0\0\0{}", 10);
    CHECK(lunar_st_open(&st, p, &err) == -1 && strstr(err.msg, "trunc.safetensors"));
    rm_tmpdir(dir);
}

TEST(st_write_rejects_bad_input) {
    char dir[64], p[128];
    if (!make_tmpdir(dir)) return;
    snprintf(p, sizeof p, "%s/x.safetensors", dir);
    float v[2] = {0};
    lunar_err err = {{0}};
    lunar_tensor bad_n = {"w", LUNAR_DTYPE_F32, 1, {3}, v, 8};
    CHECK(lunar_st_write(p, &bad_n, 1, NULL, &err) == -1 && strstr(err.msg, "tensor 'w'"));
    lunar_tensor dup[2] = {{"w", LUNAR_DTYPE_F32, 1, {2}, v, 8}, {"w", LUNAR_DTYPE_F32, 1, {2}, v, 8}};
    CHECK(lunar_st_write(p, dup, 2, NULL, &err) == -1 && strstr(err.msg, "'w'"));
    CHECK(lunar_st_write("/nonexistent/dir/x.safetensors", dup, 1, NULL, &err) == -1 &&
          strstr(err.msg, "/nonexistent/dir"));
    rm_tmpdir(dir);
}

/* Many tensors: lookup must stay correct through hash-table growth. */
TEST(st_many_tensors_lookup) {
    enum { N = 5000 };
    lunar_tensor *ts = calloc(N, sizeof *ts);
    char(*names)[64] = calloc(N, 64);
    int32_t *vals = calloc(N, sizeof *vals);
    for (int i = 0; i < N; i++) {
        snprintf(names[i], 64, "model.layers.%d.mlp.experts.%d.w1.weight", i / 100, i % 100);
        vals[i] = i * 7;
        ts[i] = (lunar_tensor){names[i], LUNAR_DTYPE_I32, 1, {1}, &vals[i], 4};
    }
    char dir[64], p[128];
    if (make_tmpdir(dir)) {
        snprintf(p, sizeof p, "%s/many.safetensors", dir);
        lunar_err err = {{0}};
        lunar_st *st = NULL;
        CHECK(lunar_st_write(p, ts, N, NULL, &err) == 0);
        CHECK_MSG(lunar_st_open(&st, p, &err) == 0, "%s", err.msg);
        if (st) {
            int bad = 0;
            for (int i = 0; i < N; i++) {
                const lunar_tensor *t = lunar_st_find(st, names[i]);
                int32_t x = -1;
                if (t) memcpy(&x, t->data, 4);
                bad += !t || x != i * 7;
            }
            CHECK(bad == 0);
            CHECK(lunar_st_find(st, "model.layers.0.mlp.experts.100.w1.weight") == NULL);
            lunar_st_close(st);
        }
        rm_tmpdir(dir);
    }
    free(ts);
    free(names);
    free(vals);
}

/* Every committed broken file must fail cleanly with its name in the message. */
TEST(st_corpus) {
    DIR *d = opendir("tests/corpus/safetensors");
    CHECK_MSG(d, "tests/corpus/safetensors missing (run from the repository root)");
    if (!d) return;
    struct dirent *e;
    int n = 0;
    char p[512];
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(p, sizeof p, "tests/corpus/safetensors/%s", e->d_name);
        lunar_st *st = NULL;
        lunar_err err = {{0}};
        int rc = lunar_st_open(&st, p, &err);
        int want_ok = strncmp(e->d_name, "ok_", 3) == 0;
        CHECK_MSG(want_ok ? rc == 0 : rc == -1, "%s: rc %d (%s)", p, rc, err.msg);
        CHECK_MSG(rc == 0 || strstr(err.msg, e->d_name), "%s: message '%s'", p, err.msg);
        if (st) lunar_st_close(st);
        n++;
    }
    closedir(d);
    CHECK(n >= 15);
}
