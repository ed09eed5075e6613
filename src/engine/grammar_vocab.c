/* The vocabulary index of the grammar engine: every token's bytes, a depth-first trie over them (mask
 * walks), and per string phase the tokens that stay inside a JSON string body or close it (tables that
 * decide most masks without a walk), for JSON strings and for raw (K3 argument) strings. */
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_internal.h"

int32_t lunar_vocab_size(const lunar_vocab *v) { return v->n; }

static int cmp_tok_bytes(const void *pa, const void *pb, void *ctx) {
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    const lunar_vocab *v = ctx;
    uint32_t la = v->off[a + 1] - v->off[a], lb = v->off[b + 1] - v->off[b];
    int c = memcmp(v->bytes + v->off[a], v->bytes + v->off[b], la < lb ? la : lb);
    if (c) return c;
    if (la != lb) return la < lb ? -1 : 1;
    return a < b ? -1 : a > b;
}

typedef struct {
    int32_t id, n, off;
} close_rec;
static int cmp_close(const void *pa, const void *pb, void *ctx) {
    const close_rec *a = pa, *b = pb;
    const lunar_vocab *v = ctx;
    uint32_t sa = v->off[a->id] + (uint32_t)a->off + 1, sb = v->off[b->id] + (uint32_t)b->off + 1;
    uint32_t la = v->off[a->id + 1] - sa, lb = v->off[b->id + 1] - sb;
    int c = memcmp(v->bytes + sa, v->bytes + sb, la < lb ? la : lb);
    if (c) return c;
    if (la != lb) return la < lb ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}
typedef struct {
    int32_t id, n, pend;
} stay_rec;
static int cmp_stay(const void *pa, const void *pb) {
    const stay_rec *a = pa, *b = pb;
    if (a->n != b->n) return a->n < b->n ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

static int raw_phase(int p) { return p == S_BODY || (p >= S_C1 && p <= S_F4); }

static void build_str_tables(lunar_vocab *v, int raw) {
    stay_rec *stay = lunar_xmalloc((size_t)v->n_ranks * sizeof *stay);
    close_rec *cl = lunar_xmalloc((size_t)v->n_ranks * sizeof *cl);
    for (int p = S_BODY; p < S_DONE; p++) {
        if (raw && !raw_phase(p)) continue;
        str_table *t = raw ? &v->rt[p] : &v->st[p];
        int ns = 0, nc = 0;
        t->stay_mask = lunar_xcalloc((size_t)v->words, sizeof(uint32_t));
        for (int32_t id = 0; id < v->n_ranks; id++) {
            const uint8_t *s = v->bytes + v->off[id];
            uint32_t len = v->off[id + 1] - v->off[id];
            int ph = p, n = 0, starts;
            uint32_t k;
            for (k = 0; k < len; k++) {
                ph = raw ? raw_phase_step(ph, s[k], &starts) : str_phase_step(ph, s[k], &starts);
                if (ph < 0) break;
                n += starts;
                if (ph == S_DONE) break;
            }
            if (ph < 0 || len == 0) continue;
            if (ph == S_DONE) {
                cl[nc++] = (close_rec){id, n, (int32_t)k};
            } else {
                stay[ns++] = (stay_rec){id, n, phase_pend(ph)};
                t->stay_mask[id >> 5] |= 1u << (id & 31);
            }
        }
        qsort(stay, (size_t)ns, sizeof *stay, cmp_stay);
        qsort_r(cl, (size_t)nc, sizeof *cl, cmp_close, v);
        t->n_stay = ns;
        t->stay_ids = lunar_xmalloc((size_t)(ns ? ns : 1) * sizeof(int32_t));
        t->stay_n = lunar_xmalloc((size_t)(ns ? ns : 1) * sizeof(int32_t));
        t->stay_pend = lunar_xmalloc((size_t)(ns ? ns : 1));
        t->max_pend = 0;
        for (int i = 0; i < ns; i++) {
            t->stay_ids[i] = stay[i].id, t->stay_n[i] = stay[i].n, t->stay_pend[i] = (uint8_t)stay[i].pend;
            if (stay[i].pend > t->max_pend) t->max_pend = stay[i].pend;
        }
        t->max_n = ns ? stay[ns - 1].n : 0;
        t->n_close = nc;
        t->close_ids = lunar_xmalloc((size_t)(nc ? nc : 1) * sizeof(int32_t));
        t->close_n = lunar_xmalloc((size_t)(nc ? nc : 1) * sizeof(int32_t));
        t->close_off = lunar_xmalloc((size_t)(nc ? nc : 1) * sizeof(int32_t));
        for (int i = 0; i < nc; i++) t->close_ids[i] = cl[i].id, t->close_n[i] = cl[i].n, t->close_off[i] = cl[i].off;
    }
    free(stay);
    free(cl);
}

int lunar_vocab_build(lunar_vocab **out, const lunar_tokenizer *tok, lunar_err *err) {
    *out = NULL;
    lunar_vocab *v = lunar_xcalloc(1, sizeof *v);
    v->n = lunar_tokenizer_vocab_size(tok);
    v->n_ranks = lunar_tokenizer_num_ranks(tok);
    if (v->n <= 0 || v->n_ranks < 0 || v->n_ranks > v->n) {
        free(v);
        return lunar_fail(err, "vocab: bad tokenizer sizes");
    }
    v->words = (v->n + 31) / 32;
    size_t total = 0;
    for (int32_t id = 0; id < v->n_ranks; id++) {
        size_t len = 0;
        lunar_token_bytes(tok, id, &len);
        total += len;
    }
    v->off = lunar_xmalloc(((size_t)v->n_ranks + 1) * sizeof(uint32_t));
    v->bytes = lunar_xmalloc(total ? total : 1);
    total = 0;
    for (int32_t id = 0; id < v->n_ranks; id++) {
        size_t len = 0;
        const char *s = lunar_token_bytes(tok, id, &len);
        v->off[id] = (uint32_t)total;
        if (len) memcpy(v->bytes + total, s, len);
        total += len;
    }
    v->off[v->n_ranks] = (uint32_t)total;
    int seen_byte[256] = {0}, n_seen = 0;
    for (int32_t id = 0; id < v->n_ranks; id++)
        if (v->off[id + 1] - v->off[id] == 1 && !seen_byte[v->bytes[v->off[id]]]) seen_byte[v->bytes[v->off[id]]] = 1, n_seen++;
    v->bytes_complete = n_seen == 256;

    /* trie over the byte tokens (special ids are never bytes: only G_TOKENS elements allow them) */
    int32_t *order = lunar_xmalloc(((size_t)v->n_ranks + 1) * sizeof(int32_t));
    int32_t n_ord = 0;
    for (int32_t id = 0; id < v->n_ranks; id++)
        if (v->off[id + 1] > v->off[id]) order[n_ord++] = id;
    qsort_r(order, (size_t)n_ord, sizeof(int32_t), cmp_tok_bytes, v);
    size_t cap = total + 1;
    v->nb = lunar_xmalloc(cap);
    v->nd = lunar_xmalloc(cap * sizeof(uint16_t));
    v->ntok = lunar_xmalloc(cap * sizeof(int32_t));
    v->nskip = lunar_xmalloc(cap * sizeof(int32_t));
    v->same_next = lunar_xmalloc((size_t)v->n * sizeof(int32_t));
    for (int32_t i = 0; i < v->n; i++) v->same_next[i] = -1;
    int32_t *path = NULL; /* node index per depth (1-based) */
    int path_cap = 0, depth = 0, nn = 0;
    int32_t prev = -1;
    for (int32_t oi = 0; oi < n_ord; oi++) {
        int32_t id = order[oi];
        const uint8_t *s = v->bytes + v->off[id];
        int len = (int)(v->off[id + 1] - v->off[id]);
        if (len > 65535) continue;
        int lcp = 0;
        if (prev >= 0) {
            const uint8_t *ps = v->bytes + v->off[prev];
            int pl = (int)(v->off[prev + 1] - v->off[prev]);
            while (lcp < len && lcp < pl && ps[lcp] == s[lcp]) lcp++;
            if (lcp == len && pl == len) { /* same bytes as prev */
                int32_t t = v->ntok[path[len - 1]];
                while (v->same_next[t] >= 0) t = v->same_next[t];
                v->same_next[t] = id;
                continue;
            }
        }
        while (depth > lcp) v->nskip[path[--depth]] = nn;
        if (len > path_cap) {
            path_cap = len * 2;
            path = realloc(path, (size_t)path_cap * sizeof(int32_t));
        }
        for (int d = lcp; d < len; d++) {
            v->nb[nn] = s[d];
            v->nd[nn] = (uint16_t)(d + 1);
            v->ntok[nn] = -1;
            path[depth++] = nn++;
        }
        v->ntok[nn - 1] = id;
        if (len > v->max_depth) v->max_depth = len;
        prev = id;
    }
    while (depth > 0) v->nskip[path[--depth]] = nn;
    v->n_nodes = nn;
    for (int c = 0; c < 256; c++) v->root_child[c] = -1;
    for (int32_t i = 0; i < nn; i = v->nskip[i]) v->root_child[v->nb[i]] = i;
    free(path);
    free(order);
    build_str_tables(v, 0);
    build_str_tables(v, 1);
    *out = v;
    return 0;
}

void lunar_vocab_free(lunar_vocab *v) {
    if (!v) return;
    for (int p = 0; p < 2 * S_NPHASE; p++) {
        str_table *t = p < S_NPHASE ? &v->st[p] : &v->rt[p - S_NPHASE];
        free(t->stay_mask), free(t->stay_ids), free(t->stay_n), free(t->stay_pend);
        free(t->close_ids), free(t->close_n), free(t->close_off);
    }
    free(v->off), free(v->bytes), free(v->nb), free(v->nd), free(v->ntok), free(v->nskip);
    free(v->same_next);
    free(v);
}
