/* tiktoken's byte-pair merge. A piece that is itself a token is that token. Otherwise, starting from
 * single bytes, the adjacent pair whose concatenation has the lowest rank is merged, the leftmost on
 * ties, until no adjacent pair is a token. Short pieces use tiktoken's own array algorithm (O(n^2),
 * fastest for small n); long ones a min-heap of (rank, start) over a linked list of parts with lazy
 * deletion, O(n log n). Both pick exactly the same pair at every step: the heap's minimum among
 * current pairs is the lowest rank, and among equal ranks the smallest start, i.e. the leftmost. */
#include <stdlib.h>
#include <string.h>

#include "text/tokenizer_internal.h"

static inline uint64_t load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline uint64_t load32(const unsigned char *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

static inline uint64_t mix(uint64_t h) {
    h ^= h >> 32;
    h *= 0xD6E8FEB86659FD93ull;
    h ^= h >> 32;
    return h;
}

/* Short strings (most lookups) are read with a few overlapping loads, no loop and no memcpy call. */
uint64_t lunar_tok_hash(const void *p_, size_t n) {
    const unsigned char *p = p_;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n * 0xFF51AFD7ED558CCDull;
    if (n <= 16) {
        uint64_t a, b;
        if (n >= 8) a = load64(p), b = load64(p + n - 8);
        else if (n >= 4) a = load32(p), b = load32(p + n - 4);
        else if (n > 0) a = (uint64_t)p[0] << 16 | (uint64_t)p[n / 2] << 8 | p[n - 1], b = 0;
        else a = b = 0;
        return mix((h ^ a) * 0xBF58476D1CE4E5B9ull ^ (b * 0x94D049BB133111EBull));
    }
    while (n > 8) {
        h = (h ^ load64(p)) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 29;
        p += 8;
        n -= 8;
    }
    h = (h ^ load64(p + n - 8)) * 0x94D049BB133111EBull;
    return mix(h);
}

static inline bool bytes_eq(const char *a, const void *b_, size_t n) {
    const unsigned char *b = b_, *ua = (const unsigned char *)a;
    if (n <= 8 && n >= 4) return load32(ua) == load32(b) && load32(ua + n - 4) == load32(b + n - 4);
    if (n <= 16 && n >= 8) return load64(ua) == load64(b) && load64(ua + n - 8) == load64(b + n - 8);
    if (n < 4) return ua[0] == b[0] && ua[n / 2] == b[n / 2] && ua[n - 1] == b[n - 1];
    return memcmp(a, b, n) == 0;
}

int32_t lunar_tok_rank(const lunar_tokenizer *tok, const void *p, size_t n) {
    if (n > tok->max_rank_len || n == 0) return -1;
    uint64_t h = lunar_tok_hash(p, n), tag = h >> 32;
    for (uint64_t i = h & tok->rank_mask;; i = (i + 1) & tok->rank_mask) {
        uint64_t s = tok->rank_slots[i];
        if (!s) return -1;
        if ((s >> 32) == tag) {
            uint32_t r = (uint32_t)s - 1;
            uint32_t off = tok->tok_off[r];
            if (tok->tok_off[r + 1] - off == n && bytes_eq(tok->tok_bytes + off, p, n))
                return (int32_t)r;
        }
    }
}

int lunar_tok_rank_map_build(lunar_tokenizer *tok, int32_t *bad, int32_t *first) {
    uint64_t cap = 1024;
    while (cap < (uint64_t)tok->n_ranks * 3) cap <<= 1;
    tok->rank_slots = lunar_xcalloc(cap, sizeof *tok->rank_slots);
    tok->rank_mask = cap - 1;
    tok->max_rank_len = 0;
    for (int32_t r = 0; r < tok->n_ranks; r++) {
        uint32_t off = tok->tok_off[r], n = tok->tok_off[r + 1] - off;
        if (n > tok->max_rank_len) tok->max_rank_len = n;
        int32_t dup = lunar_tok_rank(tok, tok->tok_bytes + off, n);
        if (dup >= 0) {
            *bad = r;
            *first = dup;
            return -1;
        }
        uint64_t h = lunar_tok_hash(tok->tok_bytes + off, n), i = h & tok->rank_mask;
        while (tok->rank_slots[i]) i = (i + 1) & tok->rank_mask;
        tok->rank_slots[i] = (h >> 32) << 32 | (uint64_t)(r + 1);
    }
    tok->pair_rank = lunar_xmalloc(65536 * sizeof *tok->pair_rank);
    for (int k = 0; k < 65536; k++) {
        unsigned char two[2] = {(unsigned char)(k >> 8), (unsigned char)k};
        tok->pair_rank[k] = lunar_tok_rank(tok, two, 2);
    }
    for (int b = 0; b < 256; b++) {
        unsigned char c = (unsigned char)b;
        tok->byte_rank[b] = lunar_tok_rank(tok, &c, 1);
        if (tok->byte_rank[b] < 0) {
            *bad = b;
            return -2;
        }
    }
    return 0;
}

#define SMALL_PIECE 256
#define NO_RANK INT32_MAX

/* tiktoken's _byte_pair_merge: parts[i] = (start, rank of the bytes from start to the start of the part two on) */
static void bpe_small(const lunar_tokenizer *tok, const uint8_t *p, size_t n, lunar_ids *out) {
    uint32_t start[SMALL_PIECE + 1];
    int32_t rank[SMALL_PIECE + 1];
    size_t m = n + 1;
    for (size_t i = 0; i <= n; i++) start[i] = (uint32_t)i;
    int32_t min_r = NO_RANK;
    size_t min_i = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        int32_t r = tok->pair_rank[p[i] << 8 | p[i + 1]];
        rank[i] = r < 0 ? NO_RANK : r;
        if (rank[i] < min_r) min_r = rank[i], min_i = i;
    }
    rank[n - 1] = rank[n] = NO_RANK;
    while (min_r != NO_RANK) {
        size_t i = min_i;
        /* after removing part i+1: the pair starting at i-1 now ends at start[i+2], the one at i at start[i+3] */
        if (i > 0) {
            int32_t r = i + 2 < m ? lunar_tok_rank(tok, p + start[i - 1], start[i + 2] - start[i - 1]) : -1;
            rank[i - 1] = r < 0 ? NO_RANK : r;
        }
        int32_t r = i + 3 < m ? lunar_tok_rank(tok, p + start[i], start[i + 3] - start[i]) : -1;
        rank[i] = r < 0 ? NO_RANK : r;
        memmove(start + i + 1, start + i + 2, (m - i - 2) * sizeof *start);
        memmove(rank + i + 1, rank + i + 2, (m - i - 2) * sizeof *rank);
        m--;
        min_r = NO_RANK;
        for (size_t k = 0; k + 1 < m; k++)
            if (rank[k] < min_r) min_r = rank[k], min_i = k;
    }
    for (size_t k = 0; k + 1 < m; k++) {
        int32_t r = lunar_tok_rank(tok, p + start[k], start[k + 1] - start[k]);
        LUNAR_ASSERT(r >= 0);
        lunar_ids_push(out, r);
    }
}

typedef struct {
    int32_t rank;
    uint32_t start, end; /* the pair's bytes; stale when the part at start no longer ends its pair at end */
} heap_ent;

static bool ent_less(heap_ent a, heap_ent b) {
    return a.rank < b.rank || (a.rank == b.rank && a.start < b.start);
}

static void heap_push(heap_ent *h, size_t *n, heap_ent e) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!ent_less(e, h[parent])) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = e;
}

static heap_ent heap_pop(heap_ent *h, size_t *n) {
    heap_ent top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && ent_less(h[c + 1], h[c])) c++;
        if (!ent_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) h[i] = last;
    return top;
}

/* parts are identified by their start byte; next[s] / prev[s] link live parts, end of part s = next[s] */
static void bpe_large(const lunar_tokenizer *tok, const uint8_t *p, size_t n, lunar_ids *out) {
    uint32_t *next = lunar_xmalloc((n + 1) * sizeof *next);
    uint32_t *prev = lunar_xmalloc((n + 1) * sizeof *prev);
    bool *dead = lunar_xcalloc(n + 1, sizeof *dead);
    size_t hcap = 2 * n + 4, hn = 0;
    heap_ent *heap = lunar_xmalloc(hcap * sizeof *heap);
    for (size_t i = 0; i <= n; i++) next[i] = (uint32_t)i + 1, prev[i] = (uint32_t)i - 1;
    for (size_t i = 0; i + 1 < n; i++) {
        int32_t r = tok->pair_rank[p[i] << 8 | p[i + 1]];
        if (r >= 0) heap_push(heap, &hn, (heap_ent){r, (uint32_t)i, (uint32_t)i + 2});
    }
    while (hn > 0) {
        heap_ent e = heap_pop(heap, &hn);
        uint32_t s = e.start;
        if (dead[s] || next[s] >= n || next[next[s]] != e.end) continue;
        /* merge s with its successor */
        uint32_t victim = next[s];
        dead[victim] = true;
        next[s] = e.end;
        prev[e.end] = s;
        if (hn + 2 > hcap) {
            hcap *= 2;
            heap = realloc(heap, hcap * sizeof *heap);
            LUNAR_ASSERT(heap);
        }
        if (e.end < n) {
            int32_t r = lunar_tok_rank(tok, p + s, next[e.end] - s);
            if (r >= 0) heap_push(heap, &hn, (heap_ent){r, s, next[e.end]});
        }
        if (s > 0) {
            uint32_t q = prev[s];
            int32_t r = lunar_tok_rank(tok, p + q, e.end - q);
            if (r >= 0) heap_push(heap, &hn, (heap_ent){r, q, e.end});
        }
    }
    for (uint32_t s = 0; s < n; s = next[s]) {
        int32_t r = lunar_tok_rank(tok, p + s, next[s] - s);
        LUNAR_ASSERT(r >= 0);
        lunar_ids_push(out, r);
    }
    free(next);
    free(prev);
    free(dead);
    free(heap);
}

void lunar_bpe_piece(const lunar_tokenizer *tok, const uint8_t *p, size_t n, lunar_ids *out) {
    if (n == 0) return;
    if (n == 1) {
        lunar_ids_push(out, tok->byte_rank[p[0]]);
        return;
    }
    int32_t whole = lunar_tok_rank(tok, p, n);
    if (whole >= 0) {
        lunar_ids_push(out, whole);
        return;
    }
    if (n <= SMALL_PIECE)
        bpe_small(tok, p, n, out);
    else
        bpe_large(tok, p, n, out);
}
