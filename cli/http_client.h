/* A small blocking HTTP/1.1 client for `arserve bench`: one request per
 * connection (Connection: close), to a numeric IPv4 or IPv6 address or a
 * host name, with one deadline for connecting, sending and reading. It
 * reads bodies framed by Content-Length, chunked encoding or the end of
 * the connection. Enough for a load client on loopback or a LAN; no TLS
 * (put a proxy in front for that). */
#ifndef ARSERVE_CLI_HTTP_CLIENT_H
#define ARSERVE_CLI_HTTP_CLIENT_H

#include <stddef.h>

/* Where a client sends: parsed once from "http://host:port". */
typedef struct http_target {
    char host[256];
    char port[16];
    char base_path[256]; /* "" or "/prefix" (without a trailing slash) */
} http_target_t;

/* Parses url ("http://127.0.0.1:8080", "http://[::1]:80/prefix"); 0, or -1
 * with why filled. */
int http_target_parse(http_target_t *t, const char *url, char *why, size_t why_cap);

typedef struct http_response {
    int status;    /* 0 when no response came (why says what happened) */
    char *body;    /* malloc'd, NUL-terminated (also after binary bodies) */
    size_t len;    /* body bytes */
    char why[160]; /* the transport's failure, when status is 0 */
} http_response_t;

/* Sends method path (appended to the target's base path) with body (may be
 * NULL) as content_type, and reads the whole response before timeout_s
 * passes. headers: extra "Name: value\r\n" lines (may be NULL). Returns
 * 0 when a response came (any status), -1 otherwise (r->why says why);
 * r->body is to be freed with http_response_free either way. */
int http_request(const http_target_t *t, const char *method, const char *path, const char *headers,
                 const char *content_type, const char *body, size_t body_len, double timeout_s,
                 http_response_t *r);
void http_response_free(http_response_t *r);

#endif
