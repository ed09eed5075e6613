/* The rank 0 -> follower messages of the CUDA tensor-parallel server (parallel/step_wire.h) and the
 * launcher's handling of a rank that fails while another one blocks (parallel/launch.h). CPU only. */
#include "test.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "parallel/launch.h"
#include "parallel/step_wire.h"

/* Two sequences (a prefill chunk at position 0, a decode at 300) through a socket and back. */
TEST(step_wire_round_trip) {
    int sv[2];
    lunar_err err;
    LUNAR_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    int32_t ids0[5] = {1, 2, 3, 4, 5}, ids1[1] = {77}, bl0[1] = {9}, bl1[3] = {4, 6, 8};
    lunar_batch_seq in[2] = {{ids0, 5, 0, 3, bl0, LUNAR_LOGITS_ALL}, {ids1, 1, 300, 0, bl1, LUNAR_LOGITS_LAST}};
    lunar_wire_msg m = {0}, r = {0};
    lunar_wire_step_encode(&m, in, 2);
    CHECK_MSG(lunar_wire_send(sv[0], &m, &err) == 0, "%s", err.msg);
    lunar_wire_reset(&m, LUNAR_WIRE_CLEAR);
    lunar_wire_push(&m, 12);
    CHECK(lunar_wire_send(sv[0], &m, &err) == 0);
    CHECK(lunar_wire_recv(sv[1], &r, 1000, &err) == 1);
    lunar_batch_seq *out = NULL;
    int n = 0, rows = 0;
    CHECK_MSG(lunar_wire_step_decode(&r, &out, &n, &rows, &err) == 0, "%s", err.msg);
    CHECK(n == 2 && rows == 6);
    for (int j = 0; out && j < n && j < 2; j++) {
        CHECK(out[j].n == in[j].n && out[j].pos0 == in[j].pos0 && out[j].slot == in[j].slot &&
              out[j].logits == in[j].logits);
        CHECK(memcmp(out[j].ids, in[j].ids, (size_t)in[j].n * 4) == 0);
        const int nb = (in[j].pos0 + in[j].n + LUNAR_BLOCK_SIZE - 1) / LUNAR_BLOCK_SIZE;
        CHECK(memcmp(out[j].blocks, in[j].blocks, (size_t)nb * 4) == 0);
    }
    free(out);
    CHECK(lunar_wire_recv(sv[1], &r, 1000, &err) == 1 && r.kind == LUNAR_WIRE_CLEAR && r.n == 1 && r.w[0] == 12);
    /* nothing more: a timeout is an error; the peer's close is a clean 0 */
    CHECK(lunar_wire_recv(sv[1], &r, 50, &err) == -1 && strstr(err.msg, "within"));
    close(sv[0]);
    CHECK(lunar_wire_recv(sv[1], &r, 1000, &err) == 0);
    /* writing to a closed peer is an error, not a SIGPIPE that kills the process */
    CHECK(lunar_wire_send(sv[1], &m, &err) == -1 && strstr(err.msg, "gone"));
    close(sv[1]);
    lunar_wire_free(&m), lunar_wire_free(&r);
}

/* A message whose lengths do not add up is refused, whichever length is wrong. */
TEST(step_wire_rejects_inconsistent_steps) {
    int32_t ids[3] = {1, 2, 3}, bl[1] = {0};
    lunar_batch_seq s = {ids, 3, 0, 0, bl, LUNAR_LOGITS_LAST};
    lunar_wire_msg m = {0};
    lunar_batch_seq *out = NULL;
    int n, rows;
    lunar_err err;
    lunar_wire_step_encode(&m, &s, 1);
    const size_t good = m.n;
    CHECK(lunar_wire_step_decode(&m, &out, &n, &rows, &err) == 0 && n == 1 && rows == 1);
    free(out);
    for (size_t cut = 0; cut < good; cut++) { /* every truncation */
        m.n = cut;
        CHECK_MSG(lunar_wire_step_decode(&m, &out, &n, &rows, &err) == -1 && !out, "truncated at %zu accepted", cut);
    }
    m.n = good;
    lunar_wire_push(&m, 5); /* a trailing word */
    CHECK(lunar_wire_step_decode(&m, &out, &n, &rows, &err) == -1);
    m.n = good;
    const int32_t saved[6] = {m.w[0], m.w[1], m.w[2], m.w[3], m.w[4], m.w[5]};
    const int32_t bad[][2] = {{0, 0}, {0, 2}, {1, 0}, {2, -1}, {3, -1}, {4, 7}, {5, 2}, {5, 0}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) { /* count, n, pos0, slot, logits, n_blocks */
        m.w[bad[k][0]] = bad[k][1];
        CHECK_MSG(lunar_wire_step_decode(&m, &out, &n, &rows, &err) == -1, "word %d = %d accepted", bad[k][0],
                  bad[k][1]);
        memcpy(m.w, saved, sizeof saved);
    }
    lunar_wire_reset(&m, LUNAR_WIRE_STOP);
    CHECK(lunar_wire_step_decode(&m, &out, &n, &rows, &err) == -1);
    lunar_wire_free(&m);
    /* a foreign header */
    int sv[2];
    LUNAR_ASSERT(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    const uint32_t junk[4] = {0x12345678u, 1, 0, 0};
    CHECK(write(sv[0], junk, sizeof junk) == (ssize_t)sizeof junk);
    lunar_wire_msg r = {0};
    CHECK(lunar_wire_recv(sv[1], &r, 1000, &err) == -1 && strstr(err.msg, "magic"));
    /* a header promising more than arrives before the close */
    const uint32_t torn[5] = {LUNAR_WIRE_MAGIC, LUNAR_WIRE_COPY, 8, 0, 1};
    CHECK(write(sv[0], torn, sizeof torn) == (ssize_t)sizeof torn);
    close(sv[0]);
    CHECK(lunar_wire_recv(sv[1], &r, 1000, &err) == -1 && strstr(err.msg, "cut short"));
    close(sv[1]);
    lunar_wire_free(&r);
}

/* ---------------------------------------------------------------- launcher: no hang on a failure */

static int fake_id(void *id, lunar_err *err) {
    (void)err;
    memset(id, 7, LUNAR_NCCL_ID_BYTES);
    return 0;
}

/* rank 1 fails at once; rank 0 waits forever, as a rank blocked in a collective with it would */
static int fail_or_block(const lunar_rank_info *ri, void *arg) {
    (void)arg;
    if (ri->rank == 1) return 4;
    for (;;) pause();
    return 0;
}

static int test_port(void) {
    lunar_rdv_server s;
    lunar_err err;
    if (lunar_rdv_listen(&s, "127.0.0.1", 0, &err)) return 0;
    close(s.fd);
    return s.port;
}

TEST(launch_failed_rank_stops_the_others) {
    lunar_dist_opts o = {1, 0, 2, "127.0.0.1", test_port()};
    lunar_err err;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const int rc = lunar_launch_node(&o, fake_id, fail_or_block, NULL, 10000, &err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    CHECK_MSG(rc == -1 && strstr(err.msg, "rank 1") && strstr(err.msg, "status 4"), "rc %d: %s", rc, err.msg);
    CHECK_MSG(s < 5, "the launcher took %.1f s to stop the blocked rank", s);
}
