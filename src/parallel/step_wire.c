/* Rank 0 -> follower messages of the CUDA tensor-parallel server (see step_wire.h). */
#include "parallel/step_wire.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

void lunar_wire_reset(lunar_wire_msg *m, uint32_t kind) {
    m->kind = kind;
    m->n = 0;
}

void lunar_wire_push(lunar_wire_msg *m, int32_t v) {
    if (m->n == m->cap) {
        m->cap = m->cap ? 2 * m->cap : 64;
        m->w = realloc(m->w, m->cap * sizeof *m->w);
        LUNAR_ASSERT(m->w);
    }
    m->w[m->n++] = v;
}

void lunar_wire_free(lunar_wire_msg *m) {
    free(m->w);
    memset(m, 0, sizeof *m);
}

static int blocks_of(const lunar_batch_seq *s) { return (s->pos0 + s->n + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE; }

void lunar_wire_step_encode(lunar_wire_msg *m, const lunar_batch_seq *seqs, int n_seqs) {
    lunar_wire_reset(m, LUNAR_WIRE_STEP);
    lunar_wire_push(m, n_seqs);
    for (int j = 0; j < n_seqs; j++) {
        const lunar_batch_seq *s = &seqs[j];
        const int nb = blocks_of(s);
        lunar_wire_push(m, s->n), lunar_wire_push(m, s->pos0), lunar_wire_push(m, s->slot);
        lunar_wire_push(m, s->logits), lunar_wire_push(m, nb);
        for (int i = 0; i < s->n; i++) lunar_wire_push(m, s->ids[i]);
        for (int i = 0; i < nb; i++) lunar_wire_push(m, s->blocks[i]);
    }
}

int lunar_wire_step_decode(const lunar_wire_msg *m, lunar_batch_seq **out, int *n_out, int *rows, lunar_err *err) {
    *out = NULL;
    *n_out = *rows = 0;
    if (m->kind != LUNAR_WIRE_STEP) return lunar_fail(err, "step message: kind %u is not a step", m->kind);
    if (m->n < 1 || m->w[0] < 1 || (size_t)m->w[0] > m->n / 5)
        return lunar_fail(err, "step message: bad sequence count");
    const int n_seqs = m->w[0];
    lunar_batch_seq *seqs = lunar_xcalloc((size_t)n_seqs, sizeof *seqs);
    size_t at = 1;
    int r = 0;
    for (int j = 0; j < n_seqs; j++) {
        if (m->n - at < 5) goto torn;
        const int32_t *h = m->w + at;
        const int32_t n = h[0], pos0 = h[1], slot = h[2], lg = h[3], nb = h[4];
        at += 5;
        if (n < 1 || pos0 < 0 || slot < 0 || nb < 0 || (lg != LUNAR_LOGITS_NONE && lg != LUNAR_LOGITS_LAST &&
                                                        lg != LUNAR_LOGITS_ALL))
            goto torn;
        /* the block table must cover exactly the positions the step reaches */
        if ((int64_t)pos0 + n > INT32_MAX - LUNAR_BLOCK_SIZE ||
            nb != (pos0 + n + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE || m->n - at < (size_t)n + (size_t)nb)
            goto torn;
        seqs[j] = (lunar_batch_seq){m->w + at, n, pos0, slot, m->w + at + n, lg};
        at += (size_t)n + (size_t)nb;
        r += lg == LUNAR_LOGITS_ALL ? n : lg == LUNAR_LOGITS_LAST;
    }
    if (at != m->n) goto torn;
    *out = seqs, *n_out = n_seqs, *rows = r;
    return 0;
torn:
    free(seqs);
    return lunar_fail(err, "step message: inconsistent lengths (torn or foreign message)");
}

int lunar_wire_send(int fd, const lunar_wire_msg *m, lunar_err *err) {
    const uint64_t bytes = (uint64_t)m->n * 4;
    uint32_t hdr[4] = {LUNAR_WIRE_MAGIC, m->kind, (uint32_t)bytes, (uint32_t)(bytes >> 32)};
    const char *parts[2] = {(const char *)hdr, (const char *)m->w};
    const size_t lens[2] = {sizeof hdr, (size_t)bytes};
    for (int p = 0; p < 2; p++)
        for (size_t done = 0; done < lens[p];) {
            ssize_t k = send(fd, parts[p] + done, lens[p] - done, MSG_NOSIGNAL); /* EPIPE, not SIGPIPE */
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) return lunar_fail(err, "rank link: write failed (%s): a rank has gone", strerror(errno));
            done += (size_t)k;
        }
    return 0;
}

/* Reads len bytes; 1 = done, 0 = EOF before the first byte, -1 = error. */
static int read_full(int fd, void *buf, size_t len, int timeout_ms, lunar_err *err) {
    size_t done = 0;
    while (done < len) {
        if (timeout_ms >= 0) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            int k = poll(&p, 1, timeout_ms);
            if (k < 0 && errno == EINTR) continue;
            if (k == 0) return lunar_fail(err, "rank link: no message within %d ms", timeout_ms);
            if (k < 0) return lunar_fail(err, "rank link: poll failed (%s)", strerror(errno));
        }
        ssize_t k = read(fd, (char *)buf + done, len - done);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return lunar_fail(err, "rank link: read failed (%s)", strerror(errno));
        if (k == 0) return done ? lunar_fail(err, "rank link: message cut short (the peer has gone)") : 0;
        done += (size_t)k;
    }
    return 1;
}

int lunar_wire_recv(int fd, lunar_wire_msg *m, int timeout_ms, lunar_err *err) {
    uint32_t hdr[4];
    int rc = read_full(fd, hdr, sizeof hdr, timeout_ms, err);
    if (rc <= 0) return rc;
    const uint64_t bytes = (uint64_t)hdr[2] | (uint64_t)hdr[3] << 32;
    if (hdr[0] != LUNAR_WIRE_MAGIC) return lunar_fail(err, "rank link: bad magic 0x%08x", hdr[0]);
    if (bytes % 4 || bytes > LUNAR_WIRE_MAX_PAYLOAD)
        return lunar_fail(err, "rank link: bad payload size %llu", (unsigned long long)bytes);
    lunar_wire_reset(m, hdr[1]);
    const size_t n = (size_t)(bytes / 4);
    if (n > m->cap) {
        m->cap = n;
        m->w = realloc(m->w, n * sizeof *m->w);
        LUNAR_ASSERT(m->w);
    }
    if (n) {
        rc = read_full(fd, m->w, (size_t)bytes, timeout_ms, err);
        if (rc <= 0) return rc ? -1 : lunar_fail(err, "rank link: message cut short (the peer has gone)");
    }
    m->n = n;
    return 1;
}
