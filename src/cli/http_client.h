/* A minimal blocking HTTP/1.1 client for `lunar bench serve`: one request per connection
 * (Connection: close), plain http only, chunked or close-delimited bodies, and a callback that sees
 * the body bytes as they arrive so a streaming client can timestamp each server-sent event.
 *
 * Why not libcurl: the bench talks plain http to a server on the same host or network, the device
 * machines the benchmarks run on cannot install packages, and a byte-level client lets TTFT/ITL be
 * timestamped at the moment each event's bytes arrive, with no library buffering in between. */
#ifndef LUNAR_CLI_HTTP_CLIENT_H
#define LUNAR_CLI_HTTP_CLIENT_H

#include <stddef.h>

#include "base/err.h"

typedef struct lunar_url {
    char host[256];
    char port[16];
    char path[512]; /* the base path, without a trailing '/' ("" for the root) */
} lunar_url;

/* "http://host:port/base" -> parts; https is refused with a message. */
int lunar_url_parse(const char *url, lunar_url *u, lunar_err *err);

/* Body bytes as they arrive (already de-chunked). Return nonzero to stop reading. */
typedef int (*lunar_http_body_fn)(void *user, const char *data, size_t n);

/* Sends method path (appended to u->path) with body (NULL for none) and an optional bearer key;
 * *status gets the HTTP status. timeout_s bounds every read and the connect. */
int lunar_http_request(const lunar_url *u, const char *method, const char *path, const char *body,
                       const char *api_key, int timeout_s, int *status, lunar_http_body_fn on_body,
                       void *user, lunar_err *err);

#endif
