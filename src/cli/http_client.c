/* Minimal HTTP/1.1 client: see http_client.h. */
#include "cli/http_client.h"

#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

int lunar_url_parse(const char *url, lunar_url *u, lunar_err *err) {
    memset(u, 0, sizeof *u);
    const char *p = url;
    if (strncmp(p, "https://", 8) == 0) return lunar_fail(err, "%s: https is not supported (plain http only)", url);
    if (strncmp(p, "http://", 7) == 0) p += 7;
    const char *slash = strchr(p, '/'), *end = slash ? slash : p + strlen(p);
    const char *colon = memchr(p, ':', (size_t)(end - p));
    const char *hend = colon ? colon : end;
    if (hend == p || (size_t)(hend - p) >= sizeof u->host) return lunar_fail(err, "%s: no host", url);
    memcpy(u->host, p, (size_t)(hend - p));
    if (colon) {
        if ((size_t)(end - colon - 1) >= sizeof u->port || end == colon + 1) return lunar_fail(err, "%s: bad port", url);
        memcpy(u->port, colon + 1, (size_t)(end - colon - 1));
    } else {
        snprintf(u->port, sizeof u->port, "80");
    }
    if (slash) {
        size_t n = strlen(slash);
        while (n > 0 && slash[n - 1] == '/') n--;
        if (n >= sizeof u->path) return lunar_fail(err, "%s: path too long", url);
        memcpy(u->path, slash, n);
    }
    return 0;
}

static int send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k, n -= (size_t)k;
    }
    return 0;
}

/* The response reader: headers, then the body through the chunked decoder or as is. */
typedef struct reader {
    int fd;
    char buf[65536];
    size_t len, pos;
} reader;

/* more bytes into buf (compacting); 0 on EOF, -1 on error */
static ssize_t fill(reader *r) {
    if (r->pos > 0) {
        memmove(r->buf, r->buf + r->pos, r->len - r->pos);
        r->len -= r->pos, r->pos = 0;
    }
    if (r->len == sizeof r->buf) return -1;
    for (;;) {
        ssize_t k = recv(r->fd, r->buf + r->len, sizeof r->buf - r->len, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k > 0) r->len += (size_t)k;
        return k;
    }
}

/* a CRLF-terminated line (without CRLF) at r->pos; NULL on EOF/error */
static char *read_line(reader *r) {
    for (;;) {
        char *s = r->buf + r->pos, *e = memchr(s, '\n', r->len - r->pos);
        if (e) {
            *e = 0;
            if (e > s && e[-1] == '\r') e[-1] = 0;
            r->pos = (size_t)(e - r->buf) + 1;
            return s;
        }
        if (fill(r) <= 0) return NULL;
    }
}

int lunar_http_request(const lunar_url *u, const char *method, const char *path, const char *body,
                       const char *api_key, int timeout_s, int *status, lunar_http_body_fn on_body,
                       void *user, lunar_err *err) {
    *status = 0;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int gai = getaddrinfo(u->host, u->port, &hints, &ai);
    if (gai) return lunar_fail(err, "%s:%s: %s", u->host, u->port, gai_strerror(gai));
    int fd = -1;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        struct timeval tv = {.tv_sec = timeout_s};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) close(fd), fd = -1;
    }
    freeaddrinfo(ai);
    if (fd < 0) return lunar_fail(err, "cannot connect to %s:%s: %s", u->host, u->port, strerror(errno));

    const size_t blen = body ? strlen(body) : 0;
    char head[2048];
    int hn = snprintf(head, sizeof head,
                      "%s %s%s HTTP/1.1\r\nHost: %s:%s\r\nUser-Agent: lunar-bench\r\nAccept: */*\r\n"
                      "Connection: close\r\n%s%s%s%s%zu\r\n\r\n",
                      method, u->path, path, u->host, u->port, api_key ? "Authorization: Bearer " : "",
                      api_key ? api_key : "", api_key ? "\r\n" : "",
                      body ? "Content-Type: application/json\r\nContent-Length: " : "Content-Length: ", blen);
    if (hn < 0 || (size_t)hn >= sizeof head) {
        close(fd);
        return lunar_fail(err, "request head too long");
    }
    if (send_all(fd, head, (size_t)hn) || (blen && send_all(fd, body, blen))) {
        close(fd);
        return lunar_fail(err, "send to %s:%s failed: %s", u->host, u->port, strerror(errno));
    }
    reader *r = lunar_xcalloc(1, sizeof *r);
    r->fd = fd;
    int rc = 0, chunked = 0;
    long long content_len = -1;
    char *line = read_line(r);
    if (!line || sscanf(line, "HTTP/%*d.%*d %d", status) != 1) {
        rc = lunar_fail(err, "%s:%s: no HTTP status line (%s)", u->host, u->port, line ? "malformed" : "connection closed");
        goto out;
    }
    while ((line = read_line(r)) && *line) {
        if (strncasecmp(line, "Transfer-Encoding:", 18) == 0 && strstr(line + 18, "chunked")) chunked = 1;
        if (strncasecmp(line, "Content-Length:", 15) == 0) content_len = atoll(line + 15);
    }
    if (!line) {
        rc = lunar_fail(err, "%s:%s: connection closed in the headers", u->host, u->port);
        goto out;
    }
    int stop = 0;
    if (chunked) {
        while (!stop) {
            if (!(line = read_line(r))) {
                rc = lunar_fail(err, "connection closed inside a chunked body");
                break;
            }
            long long size = strtoll(line, NULL, 16);
            if (size <= 0) break; /* the last chunk (trailers are ignored) */
            while (size > 0 && !stop) {
                if (r->pos == r->len && fill(r) <= 0) {
                    rc = lunar_fail(err, "connection closed inside a chunk");
                    stop = 1;
                    break;
                }
                size_t k = r->len - r->pos < (size_t)size ? r->len - r->pos : (size_t)size;
                if (on_body && on_body(user, r->buf + r->pos, k)) stop = 1;
                r->pos += k, size -= (long long)k;
            }
            if (!stop && !read_line(r)) break; /* the CRLF after the chunk */
        }
    } else {
        long long left = content_len;
        while (!stop && left != 0) {
            if (r->pos == r->len) {
                ssize_t k = fill(r);
                if (k <= 0) {
                    if (k < 0 || left > 0) rc = lunar_fail(err, "connection %s before the body ended", k < 0 ? "failed" : "closed");
                    break;
                }
            }
            size_t k = r->len - r->pos;
            if (left > 0 && (long long)k > left) k = (size_t)left;
            if (on_body && on_body(user, r->buf + r->pos, k)) stop = 1;
            r->pos += k;
            if (left > 0) left -= (long long)k;
        }
    }
out:
    close(fd);
    free(r);
    return rc;
}
