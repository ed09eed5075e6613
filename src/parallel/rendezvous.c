/* TCP rendezvous of parallel/comm.h: rank 0 hands a blob (the NCCL unique id) to every other rank.
 * Wire format, both directions fixed-size: hello = "LUNR" + u32 rank (big-endian);
 * answer = u32 length + the blob. One connection per rank, closed after the answer. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "parallel/comm.h"

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Waits until fd is readable (POLLIN) or writable, at most until the deadline. */
static int wait_fd(int fd, short ev, long deadline) {
    for (;;) {
        long left = deadline - now_ms();
        if (left <= 0) return -1;
        struct pollfd p = {fd, ev, 0};
        int r = poll(&p, 1, (int)left);
        if (r > 0) return 0;
        if (r < 0 && errno != EINTR) return -1;
    }
}

static int read_full(int fd, void *buf, size_t n, long deadline) {
    char *p = buf;
    while (n) {
        if (wait_fd(fd, POLLIN, deadline)) return -1;
        ssize_t r = read(fd, p, n);
        if (r <= 0) {
            if (r < 0 && errno == EINTR) continue;
            return -1;
        }
        p += r, n -= (size_t)r;
    }
    return 0;
}

static int write_full(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n) {
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r, n -= (size_t)r;
    }
    return 0;
}

static int resolve(const char *addr, int port, struct sockaddr_storage *sa, socklen_t *len,
                   lunar_err *err) {
    struct addrinfo hints, *res;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int rc = getaddrinfo(addr, ps, &hints, &res);
    if (rc) return lunar_fail(err, "rendezvous: cannot resolve '%s': %s", addr, gai_strerror(rc));
    memcpy(sa, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

int lunar_rdv_listen(lunar_rdv_server *s, const char *addr, int port, lunar_err *err) {
    struct sockaddr_storage sa;
    socklen_t len;
    s->fd = -1;
    if (port < 0 || port > 65535) return lunar_fail(err, "rendezvous: port %d out of range", port);
    if (resolve(addr, port, &sa, &len, err)) return -1;
    int fd = socket(sa.ss_family, SOCK_STREAM, 0);
    if (fd < 0) return lunar_fail(err, "rendezvous: socket: %s", strerror(errno));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&sa, len) || listen(fd, 128)) {
        int e = errno;
        close(fd);
        return lunar_fail(err, "rendezvous: cannot listen on %s:%d: %s", addr, port, strerror(e));
    }
    len = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &len);
    s->port = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                             : ((struct sockaddr_in *)&sa)->sin_port);
    s->fd = fd;
    return 0;
}

int lunar_rdv_serve(lunar_rdv_server *s, int world, const void *blob, size_t len, int timeout_ms,
                    lunar_err *err) {
    const long deadline = now_ms() + timeout_ms;
    unsigned char *seen = lunar_xcalloc((size_t)world, 1);
    int left = world - 1, rc = 0;
    while (left > 0) {
        if (wait_fd(s->fd, POLLIN, deadline)) {
            rc = lunar_fail(err, "rendezvous: %d of %d ranks did not connect within %d ms", left,
                            world - 1, timeout_ms);
            break;
        }
        int c = accept(s->fd, NULL, NULL);
        if (c < 0) continue;
        unsigned char hello[8];
        uint32_t r = 0;
        if (read_full(c, hello, sizeof hello, deadline) == 0 && memcmp(hello, "LUNR", 4) == 0) {
            memcpy(&r, hello + 4, 4);
            r = ntohl(r);
            if (r >= 1 && (int)r < world && !seen[r]) {
                uint32_t n = htonl((uint32_t)len);
                if (write_full(c, &n, 4) == 0 && write_full(c, blob, len) == 0) {
                    seen[r] = 1;
                    left--;
                }
            } else {
                /* a stray or duplicate rank: the launch is misconfigured, say so */
                close(c);
                rc = lunar_fail(err, "rendezvous: unexpected hello from rank %u (world %d%s)", r, world,
                                r >= 1 && (int)r < world ? ", rank already joined" : "");
                break;
            }
        }
        close(c);
    }
    free(seen);
    close(s->fd);
    s->fd = -1;
    return rc;
}

int lunar_rdv_join(const char *addr, int port, int rank, void *blob, size_t len, int timeout_ms,
                   lunar_err *err) {
    struct sockaddr_storage sa;
    socklen_t salen;
    if (resolve(addr, port, &sa, &salen, err)) return -1;
    const long deadline = now_ms() + timeout_ms;
    for (;;) {
        int fd = socket(sa.ss_family, SOCK_STREAM, 0);
        if (fd < 0) return lunar_fail(err, "rendezvous: socket: %s", strerror(errno));
        if (connect(fd, (struct sockaddr *)&sa, salen) == 0) {
            unsigned char hello[8] = {'L', 'U', 'N', 'R'};
            uint32_t r = htonl((uint32_t)rank), n = 0;
            memcpy(hello + 4, &r, 4);
            int ok = write_full(fd, hello, sizeof hello) == 0 && read_full(fd, &n, 4, deadline) == 0;
            ok = ok && ntohl(n) == len && read_full(fd, blob, len, deadline) == 0;
            close(fd);
            if (ok) return 0;
            return lunar_fail(err, "rendezvous: rank %d: bad answer from %s:%d (expected %zu bytes)", rank,
                              addr, port, len);
        }
        close(fd);
        if (now_ms() >= deadline)
            return lunar_fail(err, "rendezvous: rank %d cannot reach %s:%d within %d ms", rank, addr, port,
                              timeout_ms);
        usleep(20000); /* the master may not be listening yet */
    }
}

int lunar_rendezvous(const char *addr, int port, int rank, int world, void *blob, size_t len,
                     int timeout_ms, lunar_err *err) {
    if (world < 1 || rank < 0 || rank >= world)
        return lunar_fail(err, "rendezvous: rank %d outside a world of %d", rank, world);
    if (world == 1) return 0;
    if (rank > 0) return lunar_rdv_join(addr, port, rank, blob, len, timeout_ms, err);
    lunar_rdv_server s;
    if (lunar_rdv_listen(&s, addr, port, err)) return -1;
    return lunar_rdv_serve(&s, world, blob, len, timeout_ms, err);
}
