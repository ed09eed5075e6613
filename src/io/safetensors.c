/* safetensors reader/writer. Format: u64 little-endian header length N, N bytes of JSON
 * ({name: {dtype, shape, data_offsets:[begin,end]}, "__metadata__": {str: str}}), then the data
 * section; offsets are relative to the start of the data section.
 *
 * Validation policy: everything in the header is untrusted. Offsets must lie inside the data
 * section and match shape x dtype size exactly. Overlapping tensors are rejected (a well-formed
 * writer never produces them, and aliasing weights would hide a corrupt file); gaps and trailing
 * bytes are allowed. Tensor data alignment is not required (consumers that need aligned access
 * must copy). Duplicate keys inside one header are rejected by the JSON parser. */
#include "io/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_HEADER_BYTES (100u * 1024 * 1024)
#define MAX_INDEX_BYTES (512u * 1024 * 1024)

typedef struct st_file {
    char *path;
    const uint8_t *map; /* whole file; NULL for parse_buffer */
    size_t map_len;
    char **meta; /* key, value, key, value, ... (owned) */
    size_t n_meta;
} st_file;

struct lunar_st {
    st_file *files;
    size_t n_files;
    lunar_tensor *tensors;
    uint32_t *file_of; /* tensor i came from files[file_of[i]] */
    size_t n, cap;
    uint32_t *slots; /* open-addressing hash of names: tensor index + 1, 0 = empty */
    uint32_t *slot_hash; /* low hash bits of the name in each slot */
    size_t n_slots;      /* power of two, kept >= 2n */
    void **owned;        /* buffers of tensors added with lunar_st_add (freed at close) */
    size_t n_owned;
};

/* ---- name table ---- */

static uint64_t hash_name(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* Slot holding name, or the empty slot where it would go. The stored hash bits skip most
 * string compares (a 497k-tensor checkpoint does ~1M lookups while loading). */
static size_t slot_of(const lunar_st *st, const char *name, uint32_t h) {
    size_t mask = st->n_slots - 1, i = h & mask;
    while (st->slots[i] &&
           (st->slot_hash[i] != h || strcmp(st->tensors[st->slots[i] - 1].name, name) != 0))
        i = (i + 1) & mask;
    return i;
}

static void rehash(lunar_st *st, size_t n_slots) {
    free(st->slots);
    free(st->slot_hash);
    st->slots = lunar_xcalloc(n_slots, sizeof *st->slots);
    st->slot_hash = lunar_xcalloc(n_slots, sizeof *st->slot_hash);
    st->n_slots = n_slots;
    for (size_t t = 0; t < st->n; t++) {
        uint32_t h = (uint32_t)hash_name(st->tensors[t].name);
        size_t i = slot_of(st, st->tensors[t].name, h);
        st->slots[i] = (uint32_t)t + 1;
        st->slot_hash[i] = h;
    }
}

const lunar_tensor *lunar_st_find(const lunar_st *st, const char *name) {
    if (!st || !st->n_slots || !name) return NULL;
    uint32_t s = st->slots[slot_of(st, name, (uint32_t)hash_name(name))];
    return s ? &st->tensors[s - 1] : NULL;
}

/* Takes ownership of t->name (malloc'd). Fails on a name already present (other shard). */
static int add_tensor(lunar_st *st, lunar_tensor *t, uint32_t file, lunar_err *err) {
    if (st->n >= UINT32_MAX - 1) {
        free((char *)t->name);
        return lunar_fail(err, "%s: too many tensors", st->files[file].path);
    }
    if (2 * (st->n + 1) > st->n_slots) rehash(st, st->n_slots ? 2 * st->n_slots : 64);
    uint32_t h = (uint32_t)hash_name(t->name);
    size_t slot = slot_of(st, t->name, h);
    if (st->slots[slot]) {
        uint32_t other = st->file_of[st->slots[slot] - 1];
        lunar_fail(err, "%s: tensor '%s': duplicate name, already defined in %s",
                   st->files[file].path, t->name, st->files[other].path);
        free((char *)t->name);
        return -1;
    }
    if (st->n == st->cap) {
        st->cap = st->cap ? 2 * st->cap : 64;
        st->tensors = realloc(st->tensors, st->cap * sizeof *st->tensors);
        st->file_of = realloc(st->file_of, st->cap * sizeof *st->file_of);
        LUNAR_ASSERT(st->tensors && st->file_of);
    }
    st->tensors[st->n] = *t;
    st->file_of[st->n] = file;
    st->slots[slot] = (uint32_t)++st->n;
    st->slot_hash[slot] = h;
    return 0;
}

/* ---- accessors ---- */

size_t lunar_st_count(const lunar_st *st) { return st ? st->n : 0; }

const lunar_tensor *lunar_st_at(const lunar_st *st, size_t i) {
    return st && i < st->n ? &st->tensors[i] : NULL;
}

const char *lunar_st_file_of(const lunar_st *st, const lunar_tensor *t) {
    if (!st || t < st->tensors || t >= st->tensors + st->n) return NULL;
    return st->files[st->file_of[t - st->tensors]].path;
}

const char *lunar_st_metadata(const lunar_st *st, const char *key) {
    if (!st || !st->n_files || !key) return NULL;
    const st_file *f = &st->files[st->n ? st->file_of[0] : 0];
    for (size_t i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[2 * i], key) == 0) return f->meta[2 * i + 1];
    return NULL;
}

void lunar_st_close(lunar_st *st) {
    if (!st) return;
    for (size_t i = 0; i < st->n; i++) free((char *)st->tensors[i].name);
    for (size_t i = 0; i < st->n_files; i++) {
        st_file *f = &st->files[i];
        if (f->map) munmap((void *)f->map, f->map_len);
        for (size_t k = 0; k < 2 * f->n_meta; k++) free(f->meta[k]);
        free(f->meta);
        free(f->path);
    }
    for (size_t i = 0; i < st->n_owned; i++) free(st->owned[i]);
    free(st->owned);
    free(st->files);
    free(st->tensors);
    free(st->file_of);
    free(st->slots);
    free(st->slot_hash);
    free(st);
}

static uint32_t add_file(lunar_st *st, const char *path) {
    st->files = realloc(st->files, (st->n_files + 1) * sizeof *st->files);
    LUNAR_ASSERT(st->files);
    st_file *f = &st->files[st->n_files];
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    LUNAR_ASSERT(f->path);
    return (uint32_t)st->n_files++;
}

/* ---- header parsing ---- */

typedef struct span {
    uint64_t begin, end;
    const char *name;
} span;

static int by_begin(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static int parse_metadata(st_file *f, json_t *meta, lunar_err *err) {
    if (!json_is_object(meta))
        return lunar_fail(err, "%s: '__metadata__' must be an object of strings", f->path);
    const char *k;
    json_t *v;
    f->meta = lunar_xcalloc(2 * json_object_size(meta), sizeof *f->meta);
    json_object_foreach(meta, k, v) {
        if (!json_is_string(v))
            return lunar_fail(err, "%s: '__metadata__' key '%s': value must be a string", f->path, k);
        f->meta[2 * f->n_meta] = strdup(k);
        f->meta[2 * f->n_meta + 1] = strdup(json_string_value(v));
        LUNAR_ASSERT(f->meta[2 * f->n_meta] && f->meta[2 * f->n_meta + 1]);
        f->n_meta++;
    }
    return 0;
}

/* Validates one header entry; on success fills t (name not set). */
static int parse_entry(const char *path, const char *name, json_t *e, uint64_t data_len,
                       lunar_tensor *t, uint64_t off[2], lunar_err *err) {
    if (!json_is_object(e)) return lunar_fail(err, "%s: tensor '%s': entry is not an object", path, name);
    json_t *jd = json_object_get(e, "dtype"), *js = json_object_get(e, "shape"),
           *jo = json_object_get(e, "data_offsets");
    if (!json_is_string(jd)) return lunar_fail(err, "%s: tensor '%s': missing or non-string 'dtype'", path, name);
    if (lunar_dtype_from_name(json_string_value(jd), &t->dtype) != 0)
        return lunar_fail(err, "%s: tensor '%s': unknown dtype '%.32s'", path, name, json_string_value(jd));
    if (!json_is_array(js)) return lunar_fail(err, "%s: tensor '%s': missing or non-array 'shape'", path, name);
    if (json_array_size(js) > LUNAR_MAX_DIMS)
        return lunar_fail(err, "%s: tensor '%s': shape has %zu dims (at most %d supported)", path, name,
                          json_array_size(js), LUNAR_MAX_DIMS);
    t->ndim = (int)json_array_size(js);
    uint64_t numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        json_t *d = json_array_get(js, (size_t)i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return lunar_fail(err, "%s: tensor '%s': shape[%d] is not a non-negative integer", path, name, i);
        t->shape[i] = json_integer_value(d);
        if (__builtin_mul_overflow(numel, (uint64_t)t->shape[i], &numel) || numel > (uint64_t)INT64_MAX)
            return lunar_fail(err, "%s: tensor '%s': shape overflows", path, name);
    }
    uint64_t nbytes;
    if (__builtin_mul_overflow(numel, (uint64_t)lunar_dtype_size(t->dtype), &nbytes))
        return lunar_fail(err, "%s: tensor '%s': shape overflows", path, name);
    if (!json_is_array(jo) || json_array_size(jo) != 2 || !json_is_integer(json_array_get(jo, 0)) ||
        !json_is_integer(json_array_get(jo, 1)))
        return lunar_fail(err, "%s: tensor '%s': 'data_offsets' must be [begin, end] integers", path, name);
    json_int_t b = json_integer_value(json_array_get(jo, 0)), en = json_integer_value(json_array_get(jo, 1));
    if (b < 0 || en < b)
        return lunar_fail(err, "%s: tensor '%s': data_offsets [%lld, %lld] are not 0 <= begin <= end", path,
                          name, (long long)b, (long long)en);
    if ((uint64_t)en > data_len)
        return lunar_fail(err, "%s: tensor '%s': data_offsets [%lld, %lld] past the end of the data (%llu bytes)",
                          path, name, (long long)b, (long long)en, (unsigned long long)data_len);
    if ((uint64_t)(en - b) != nbytes) {
        char sh[128];
        return lunar_fail(err, "%s: tensor '%s': data_offsets [%lld, %lld] do not match shape %s of %s (%llu bytes)",
                          path, name, (long long)b, (long long)en,
                          lunar_shape_str(sh, sizeof sh, t->ndim, t->shape), lunar_dtype_name(t->dtype),
                          (unsigned long long)nbytes);
    }
    off[0] = (uint64_t)b;
    off[1] = (uint64_t)en;
    t->nbytes = (size_t)nbytes;
    return 0;
}

/* Parses buf (whole file) as files[fi], adding its tensors to st. */
static int parse_file(lunar_st *st, uint32_t fi, const uint8_t *buf, size_t len, lunar_err *err) {
    const char *path = st->files[fi].path;
    if (len < 8) return lunar_fail(err, "%s: file too short (%zu bytes) for a safetensors header", path, len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | buf[i];
    if (hlen > MAX_HEADER_BYTES)
        return lunar_fail(err, "%s: header length %llu is absurd (limit %u)", path, (unsigned long long)hlen,
                          MAX_HEADER_BYTES);
    if (hlen > len - 8)
        return lunar_fail(err, "%s: header length %llu exceeds file size %zu", path, (unsigned long long)hlen, len);
    json_error_t je;
    json_t *root = json_loadb((const char *)buf + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!root) return lunar_fail(err, "%s: header is not valid JSON: %s (at byte %d)", path, je.text, je.position);
    int rc = 0;
    span *spans = NULL;
    size_t n_spans = 0;
    if (!json_is_object(root)) {
        rc = lunar_fail(err, "%s: header is not a JSON object", path);
        goto done;
    }
    const uint8_t *data = buf + 8 + hlen;
    uint64_t data_len = len - 8 - hlen;
    spans = lunar_xcalloc(json_object_size(root), sizeof *spans);
    const char *name;
    json_t *e;
    json_object_foreach(root, name, e) {
        if (strcmp(name, "__metadata__") == 0) {
            if ((rc = parse_metadata(&st->files[fi], e, err)) != 0) goto done;
            continue;
        }
        lunar_tensor t = {0};
        uint64_t off[2] = {0, 0};
        if ((rc = parse_entry(path, name, e, data_len, &t, off, err)) != 0) goto done;
        t.data = data + off[0];
        t.name = strdup(name);
        LUNAR_ASSERT(t.name);
        if ((rc = add_tensor(st, &t, fi, err)) != 0) goto done;
        spans[n_spans++] = (span){off[0], off[1], st->tensors[st->n - 1].name};
    }
    /* Reject overlapping byte ranges (empty tensors overlap nothing). */
    qsort(spans, n_spans, sizeof *spans, by_begin);
    uint64_t prev_end = 0;
    const char *prev = NULL;
    for (size_t i = 0; i < n_spans; i++) {
        if (spans[i].begin == spans[i].end) continue;
        if (prev && spans[i].begin < prev_end) {
            rc = lunar_fail(err, "%s: tensor '%s': data_offsets overlap those of tensor '%s'", path,
                            spans[i].name, prev);
            goto done;
        }
        prev_end = spans[i].end;
        prev = spans[i].name;
    }
done:
    free(spans);
    json_decref(root);
    return rc;
}

static lunar_st *st_new(void) { return lunar_xcalloc(1, sizeof(lunar_st)); }

int lunar_st_parse_buffer(lunar_st **out, const uint8_t *buf, size_t len, const char *label,
                          lunar_err *err) {
    *out = NULL;
    lunar_st *st = st_new();
    uint32_t fi = add_file(st, label ? label : "<buffer>");
    if (parse_file(st, fi, buf, len, err) != 0) {
        lunar_st_close(st);
        return -1;
    }
    *out = st;
    return 0;
}

/* ---- files ---- */

static int map_file(const char *path, const uint8_t **map, size_t *len, lunar_err *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return lunar_fail(err, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return lunar_fail(err, "%s: not a regular file", path);
    }
    *len = (size_t)sb.st_size;
    *map = NULL;
    if (*len > 0) {
        void *p = mmap(NULL, *len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            close(fd);
            return lunar_fail(err, "%s: mmap failed: %s", path, strerror(errno));
        }
        *map = p;
    }
    close(fd);
    return 0;
}

/* Maps path as a new file of st and parses its header. */
static int open_one(lunar_st *st, const char *path, uint32_t *fi_out, lunar_err *err) {
    uint32_t fi = add_file(st, path);
    st_file *f = &st->files[fi];
    if (map_file(path, &f->map, &f->map_len, err) != 0) return -1;
    if (fi_out) *fi_out = fi;
    return parse_file(st, fi, f->map, f->map_len, err);
}

static char *join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = lunar_xmalloc(a + b + 2);
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

static int open_sharded(lunar_st *st, const char *dir, const char *index_path, lunar_err *err) {
    const uint8_t *map;
    size_t len;
    if (map_file(index_path, &map, &len, err) != 0) return -1;
    if (len > MAX_INDEX_BYTES) {
        munmap((void *)map, len);
        return lunar_fail(err, "%s: index file is absurdly large (%zu bytes)", index_path, len);
    }
    json_error_t je;
    json_t *root = len ? json_loadb((const char *)map, len, JSON_REJECT_DUPLICATES, &je) : NULL;
    if (map) munmap((void *)map, len);
    if (!root)
        return lunar_fail(err, "%s: not valid JSON: %s", index_path, len ? je.text : "empty file");
    int rc = 0;
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(root) || !json_is_object(wm)) {
        rc = lunar_fail(err, "%s: key 'weight_map': missing or not an object", index_path);
        goto done;
    }
    /* Open every distinct shard once, in order of first mention. Index entries are usually
     * grouped by shard, so remembering the last one avoids scanning the file list. */
    const char *name, *last = NULL;
    uint32_t last_fi = 0;
    json_t *v;
    json_object_foreach(wm, name, v) {
        if (!json_is_string(v)) {
            rc = lunar_fail(err, "%s: weight_map['%s']: shard file name must be a string", index_path, name);
            goto done;
        }
        const char *shard = json_string_value(v);
        if (!shard[0] || shard[0] == '/' || strstr(shard, "..")) {
            rc = lunar_fail(err, "%s: weight_map['%s']: shard file name '%s' must be relative, inside %s",
                            index_path, name, shard, dir);
            goto done;
        }
        if (last && strcmp(shard, last) == 0) continue;
        char *p = join(dir, shard);
        bool seen = false;
        for (size_t i = 0; i < st->n_files && !seen; i++) seen = strcmp(st->files[i].path, p) == 0;
        if (!seen) rc = open_one(st, p, NULL, err);
        free(p);
        if (rc) goto done;
        last = shard;
    }
    /* Every mapped tensor must be where the index says. */
    last = NULL;
    json_object_foreach(wm, name, v) {
        const char *shard = json_string_value(v);
        if (!last || strcmp(shard, last) != 0) {
            char *p = join(dir, shard);
            for (last_fi = 0; last_fi < st->n_files && strcmp(st->files[last_fi].path, p) != 0; last_fi++) {
            }
            free(p);
            LUNAR_ASSERT(last_fi < st->n_files);
            last = shard;
        }
        const lunar_tensor *t = lunar_st_find(st, name);
        if (!t) {
            rc = lunar_fail(err, "%s: tensor '%s' is mapped to %s, which does not contain it", index_path, name,
                            st->files[last_fi].path);
            goto done;
        }
        if (st->file_of[t - st->tensors] != last_fi) {
            rc = lunar_fail(err, "%s: tensor '%s' is mapped to %s but found in %s", index_path, name,
                            st->files[last_fi].path, lunar_st_file_of(st, t));
            goto done;
        }
    }
done:
    json_decref(root);
    return rc;
}

int lunar_st_open(lunar_st **out, const char *path, lunar_err *err) {
    *out = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0) return lunar_fail(err, "%s: cannot open: %s", path, strerror(errno));
    lunar_st *st = st_new();
    int rc;
    if (S_ISDIR(sb.st_mode)) {
        char *index = join(path, "model.safetensors.index.json");
        if (access(index, F_OK) == 0) {
            rc = open_sharded(st, path, index, err);
        } else {
            char *single = join(path, "model.safetensors");
            if (access(single, F_OK) == 0)
                rc = open_one(st, single, NULL, err);
            else
                rc = lunar_fail(err, "%s: directory has neither model.safetensors.index.json nor model.safetensors",
                                path);
            free(single);
        }
        free(index);
    } else {
        rc = open_one(st, path, NULL, err);
    }
    if (rc) {
        lunar_st_close(st);
        return -1;
    }
    *out = st;
    return 0;
}

/* ---- writer ---- */

int lunar_st_write(const char *path, const lunar_tensor *tensors, size_t n,
                   const char *const *metadata, lunar_err *err) {
    json_t *root = json_object();
    int rc = -1;
    char *hdr = NULL;
    FILE *f = NULL;
    if (metadata && metadata[0]) {
        json_t *m = json_object();
        json_object_set_new(root, "__metadata__", m);
        for (size_t i = 0; metadata[i]; i += 2) {
            if (!metadata[i + 1]) {
                lunar_fail(err, "%s: metadata key '%s' has no value", path, metadata[i]);
                goto done;
            }
            if (json_object_set_new(m, metadata[i], json_string(metadata[i + 1])) != 0) {
                lunar_fail(err, "%s: metadata key '%s': not valid UTF-8", path, metadata[i]);
                goto done;
            }
        }
    }
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const lunar_tensor *t = &tensors[i];
        if (!t->name || !t->name[0] || strcmp(t->name, "__metadata__") == 0 || json_object_get(root, t->name)) {
            lunar_fail(err, "%s: tensor %zu: missing, reserved or duplicate name '%s'", path, i,
                       t->name ? t->name : "(null)");
            goto done;
        }
        if (t->dtype < 0 || t->dtype >= LUNAR_DTYPE_COUNT || t->ndim < 0 || t->ndim > LUNAR_MAX_DIMS ||
            (uint64_t)lunar_tensor_numel(t) * lunar_dtype_size(t->dtype) != t->nbytes || (t->nbytes && !t->data)) {
            lunar_fail(err, "%s: tensor '%s': inconsistent dtype/shape/nbytes", path, t->name);
            goto done;
        }
        json_t *e = json_object(), *shape = json_array();
        json_object_set_new(e, "dtype", json_string(lunar_dtype_name(t->dtype)));
        for (int d = 0; d < t->ndim; d++) json_array_append_new(shape, json_integer(t->shape[d]));
        json_object_set_new(e, "shape", shape);
        json_object_set_new(e, "data_offsets",
                            json_pack("[II]", (json_int_t)off, (json_int_t)(off + t->nbytes)));
        if (json_object_set_new(root, t->name, e) != 0) {
            lunar_fail(err, "%s: tensor %zu: name is not valid UTF-8", path, i);
            goto done;
        }
        off += t->nbytes;
    }
    hdr = json_dumps(root, JSON_COMPACT);
    LUNAR_ASSERT(hdr);
    size_t hlen = strlen(hdr), padded = (hlen + 7) & ~(size_t)7;
    uint8_t lenbuf[8];
    for (int i = 0; i < 8; i++) lenbuf[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    f = fopen(path, "wb");
    if (!f) {
        lunar_fail(err, "%s: cannot create: %s", path, strerror(errno));
        goto done;
    }
    bool ok = fwrite(lenbuf, 1, 8, f) == 8 && fwrite(hdr, 1, hlen, f) == hlen;
    for (size_t i = hlen; i < padded && ok; i++) ok = fputc(' ', f) != EOF;
    for (size_t i = 0; i < n && ok; i++)
        if (tensors[i].nbytes) ok = fwrite(tensors[i].data, 1, tensors[i].nbytes, f) == tensors[i].nbytes;
    if (fclose(f) != 0) ok = false;
    f = NULL;
    if (!ok) {
        lunar_fail(err, "%s: write failed: %s", path, strerror(errno));
        goto done;
    }
    rc = 0;
done:
    free(hdr);
    json_decref(root);
    return rc;
}

/* ---- in-memory sets (--load-format dummy) ---- */

lunar_st *lunar_st_new(const char *label) {
    lunar_st *st = lunar_xcalloc(1, sizeof *st);
    add_file(st, label);
    return st;
}

int lunar_st_add(lunar_st *st, const char *name, lunar_dtype dtype, int ndim, const int64_t *shape,
                 void *data, lunar_err *err) {
    LUNAR_ASSERT(ndim >= 1 && ndim <= LUNAR_MAX_DIMS);
    lunar_tensor t;
    memset(&t, 0, sizeof t);
    t.name = strdup(name);
    LUNAR_ASSERT(t.name);
    t.dtype = dtype;
    t.ndim = ndim;
    size_t n = 1;
    for (int i = 0; i < ndim; i++) n *= (size_t)(t.shape[i] = shape[i]);
    t.nbytes = n * lunar_dtype_size(dtype);
    t.data = data;
    if (add_tensor(st, &t, 0, err)) {
        free(data);
        return -1;
    }
    if (data) {
        st->owned = realloc(st->owned, (st->n_owned + 1) * sizeof *st->owned);
        LUNAR_ASSERT(st->owned);
        st->owned[st->n_owned++] = data;
    }
    return 0;
}
