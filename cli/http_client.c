/* The load client's HTTP: one connection per request, read to its end
 * (the request says Connection: close), then the body unframed. */
#include "cli/http_client.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"

int http_target_parse(http_target_t *t, const char *url, char *why, size_t why_cap) {
    memset(t, 0, sizeof *t);
    const char *p = url;
    if (strncmp(p, "http://", 7) != 0) {
        snprintf(why, why_cap, "'%s' is not an http:// URL (https: put a proxy in front)", url);
        return -1;
    }
    p += 7;
    const char *host_end, *after;
    if (*p == '[') { /* [IPv6] */
        host_end = strchr(p, ']');
        if (!host_end) {
            snprintf(why, why_cap, "'%s': no ']' after the IPv6 address", url);
            return -1;
        }
        p++;
        after = host_end + 1;
    } else {
        host_end = p + strcspn(p, ":/");
        after = host_end;
    }
    size_t host_len = (size_t)(host_end - p);
    if (host_len == 0 || host_len >= sizeof t->host) {
        snprintf(why, why_cap, "'%s': no host, or a host too long", url);
        return -1;
    }
    memcpy(t->host, p, host_len);
    const char *port = "80";
    size_t port_len = 2;
    if (*after == ':') {
        port = after + 1;
        port_len = strcspn(port, "/");
        if (port_len == 0 || port_len >= sizeof t->port || strspn(port, "0123456789") != port_len) {
            snprintf(why, why_cap, "'%s': the port is not a number", url);
            return -1;
        }
        after = port + port_len;
    } else if (*after && *after != '/') {
        snprintf(why, why_cap, "'%s': unexpected '%c' after the host", url, *after);
        return -1;
    }
    memcpy(t->port, port, port_len);
    size_t path_len = strlen(after);
    while (path_len && after[path_len - 1] == '/')
        path_len--;
    if (path_len >= sizeof t->base_path) {
        snprintf(why, why_cap, "'%s': the path is too long", url);
        return -1;
    }
    memcpy(t->base_path, after, path_len);
    return 0;
}

static int failf(http_response_t *r, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->why, sizeof r->why, fmt, ap);
    va_end(ap);
    r->status = 0;
    return -1;
}

/* Waits for events on fd until the deadline: 1 ready, 0 timed out, -1 error. */
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        double left = deadline - clock_now_s();
        if (left <= 0)
            return 0;
        struct pollfd p = {.fd = fd, .events = events};
        int rc = poll(&p, 1, (int)(left * 1000) + 1);
        if (rc > 0)
            return 1;
        if (rc < 0 && errno != EINTR)
            return -1;
    }
}

static int connect_to(const http_target_t *t, double deadline, http_response_t *r) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int rc = getaddrinfo(t->host, t->port, &hints, &ai);
    if (rc != 0)
        return failf(r, "cannot resolve %s: %s", t->host, gai_strerror(rc));
    int fd = -1;
    for (struct addrinfo *a = ai; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0)
            continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0)
            break;
        if (errno == EINPROGRESS && wait_fd(fd, POLLOUT, deadline) == 1) {
            int soerr = 0;
            socklen_t len = sizeof soerr;
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
            if (soerr == 0)
                break;
            errno = soerr;
        } else if (errno == EINPROGRESS) {
            errno = ETIMEDOUT;
        }
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    if (fd < 0)
        return failf(r, "cannot connect to %s:%s: %s", t->host, t->port, strerror(errno));
    return fd;
}

static int send_all(int fd, const char *p, size_t n, double deadline, http_response_t *r) {
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
        } else if (k < 0 && (errno == EAGAIN || errno == EINTR)) {
            if (wait_fd(fd, POLLOUT, deadline) != 1)
                return failf(r, "timed out sending the request");
        } else {
            return failf(r, "sending the request failed: %s", strerror(errno));
        }
    }
    return 0;
}

/* Reads until the peer closes; *buf grows (NUL-terminated). */
static int read_all(int fd, char **buf, size_t *len, double deadline, http_response_t *r) {
    size_t cap = 64 * 1024;
    *buf = malloc(cap + 1);
    *len = 0;
    if (!*buf)
        return failf(r, "out of memory");
    for (;;) {
        if (*len == cap) {
            char *grown = realloc(*buf, 2 * cap + 1);
            if (!grown)
                return failf(r, "out of memory");
            *buf = grown;
            cap *= 2;
        }
        ssize_t k = recv(fd, *buf + *len, cap - *len, 0);
        if (k > 0) {
            *len += (size_t)k;
        } else if (k == 0) {
            (*buf)[*len] = 0;
            return 0;
        } else if (errno == EAGAIN || errno == EINTR) {
            int w = wait_fd(fd, POLLIN, deadline);
            if (w == 0)
                return failf(r, "timed out waiting for the response (%zu bytes read)", *len);
            if (w < 0)
                return failf(r, "waiting for the response failed: %s", strerror(errno));
        } else {
            return failf(r, "reading the response failed: %s", strerror(errno));
        }
    }
}

/* The value of header name in the head [h, end), or NULL. */
static const char *header(const char *h, const char *end, const char *name, size_t *vlen) {
    size_t n = strlen(name);
    for (const char *line = strstr(h, "\r\n"); line && line + 2 < end;
         line = strstr(line + 2, "\r\n")) {
        const char *l = line + 2;
        if ((size_t)(end - l) > n && !strncasecmp(l, name, n) && l[n] == ':') {
            const char *v = l + n + 1;
            v += strspn(v, " \t");
            *vlen = strcspn(v, "\r\n");
            return v;
        }
    }
    return NULL;
}

/* Decodes a chunked body in place; -1 when it is malformed. */
static long long unchunk(char *body, size_t len) {
    size_t in = 0, out = 0;
    for (;;) {
        char *end;
        if (in >= len)
            return -1;
        unsigned long long size = strtoull(body + in, &end, 16);
        char *eol = strstr(body + in, "\r\n");
        if (end == body + in || !eol)
            return -1;
        in = (size_t)(eol - body) + 2;
        if (size == 0)
            return (long long)out;
        if (size > len - in)
            return -1;
        memmove(body + out, body + in, size);
        out += size;
        in += size + 2;
    }
}

int http_request(const http_target_t *t, const char *method, const char *path, const char *headers,
                 const char *content_type, const char *body, size_t body_len, double timeout_s,
                 http_response_t *r) {
    memset(r, 0, sizeof *r);
    const double deadline = clock_now_s() + timeout_s;
    int fd = connect_to(t, deadline, r);
    if (fd < 0)
        return -1;
    char head[1024];
    int n = snprintf(head, sizeof head,
                     "%s %s%s HTTP/1.1\r\nHost: %s:%s\r\nConnection: close\r\nUser-Agent: "
                     "arserve-bench\r\n%s",
                     method, t->base_path, path, t->host, t->port, headers ? headers : "");
    if (body && n > 0 && (size_t)n < sizeof head)
        n += snprintf(head + n, sizeof head - (size_t)n,
                      "Content-Type: %s\r\nContent-Length: %zu\r\n", content_type, body_len);
    if (n > 0 && (size_t)n < sizeof head)
        n += snprintf(head + n, sizeof head - (size_t)n, "\r\n");
    char *raw = NULL;
    size_t raw_len = 0;
    int rc = n > 0 && (size_t)n < sizeof head ? 0 : failf(r, "request head too long");
    if (rc == 0)
        rc = send_all(fd, head, (size_t)n, deadline, r);
    if (rc == 0 && body)
        rc = send_all(fd, body, body_len, deadline, r);
    if (rc == 0)
        rc = read_all(fd, &raw, &raw_len, deadline, r);
    close(fd);
    if (rc != 0) {
        free(raw);
        return -1;
    }
    char *head_end = strstr(raw, "\r\n\r\n");
    int status = 0;
    if (!head_end || sscanf(raw, "HTTP/1.%*d %d", &status) != 1 || status < 100) {
        free(raw);
        return failf(r, "not an HTTP response (%zu bytes)", raw_len);
    }
    size_t vlen = 0;
    const char *te = header(raw, head_end, "Transfer-Encoding", &vlen);
    const char *cl = header(raw, head_end, "Content-Length", &vlen);
    char *b = head_end + 4;
    size_t blen = raw_len - (size_t)(b - raw);
    if (te && !strncasecmp(te, "chunked", 7)) {
        long long got = unchunk(b, blen);
        if (got < 0) {
            free(raw);
            return failf(r, "malformed chunked body");
        }
        blen = (size_t)got;
    } else if (cl) {
        unsigned long long want = strtoull(cl, NULL, 10);
        if (want > blen) {
            free(raw);
            return failf(r, "body cut short: %zu of %llu bytes", blen, want);
        }
        blen = (size_t)want;
    }
    memmove(raw, b, blen);
    raw[blen] = 0;
    r->status = status;
    r->body = raw;
    r->len = blen;
    return 0;
}

void http_response_free(http_response_t *r) {
    free(r->body);
    r->body = NULL;
    r->len = 0;
}
