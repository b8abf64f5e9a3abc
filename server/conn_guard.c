/* Connection deadlines and limits (conn_guard.h). One mutex guards the
 * table of entries; a watcher thread cuts connections whose phase passed its
 * deadline, and the accept path cuts one when a limit is reached.
 *
 * Cutting a connection from outside its thread is safe because
 * libmicrohttpd notifies MHD_CONNECTION_NOTIFY_CLOSED before it closes the
 * socket, and the notice takes the same mutex: an entry's descriptor is
 * never one that was closed and reused. */
#include "server/conn_guard.h"

#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "base/clock.h"
#include "server/api.h"
#include "server/log.h"

/* Connections libmicrohttpd may hold beyond max_connections, so that a new
 * one reaches the guard, which then cuts the slowest. */
#define HARD_LIMIT_HEADROOM 64
#define WATCH_INTERVAL_S 0.2

typedef enum cut_reason {
    CUT_HEADER_TIMEOUT,
    CUT_IDLE_TIMEOUT,
    CUT_BODY_TIMEOUT,
    CUT_SHED,
    CUT_CONNECTION_LIMIT,
    CUT_PER_IP_LIMIT,
    N_CUT_REASONS
} cut_reason_t;

/* The metric label of each reason, its status and what the client reads;
 * an idle keep-alive connection is closed without an answer (its client
 * sent nothing to answer). */
static const struct {
    const char *label;
    int status;
    const char *message;
} REASONS[N_CUT_REASONS] = {
    [CUT_HEADER_TIMEOUT] = {"header_timeout", 408, "the request's headers took too long"},
    [CUT_IDLE_TIMEOUT] = {"idle_timeout", 0, NULL},
    [CUT_BODY_TIMEOUT] = {"body_timeout", 408, "the request's body took too long"},
    [CUT_SHED] = {"shed", 503,
                  "the server is at its connection limit and this connection was "
                  "the slowest; retry"},
    [CUT_CONNECTION_LIMIT] = {"connection_limit", 503,
                              "the server is at its connection limit; retry"},
    [CUT_PER_IP_LIMIT] = {"per_ip_limit", 503,
                          "too many connections from this address; close some and retry"},
};

typedef struct conn_entry {
    int in_use, cut;
    int fd;
    struct in_addr ip;
    conn_phase_t phase;
    double since;  /* when the phase began */
    long answered; /* requests answered on this connection */
} conn_entry_t;

struct conn_guard {
    conn_guard_options_t opt;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_t watcher;
    int stopping;
    int n_entries;
    conn_entry_t *entries;
    char *answers[N_CUT_REASONS]; /* whole HTTP responses, or NULL */
    metric_t *m_refused;
};

static char *make_answer(cut_reason_t r) {
    if (!REASONS[r].status)
        return NULL;
    api_error_t e;
    api_errorf(&e, REASONS[r].status, NULL, REASONS[r].label, "%s", REASONS[r].message);
    char *body = api_error_json(&e);
    if (!body)
        return NULL;
    const char *text = REASONS[r].status == 408 ? "Request Timeout" : "Service Unavailable";
    size_t n = strlen(body) + 256;
    char *out = malloc(n);
    if (out)
        snprintf(out, n,
                 "HTTP/1.1 %d %s\r\nConnection: close\r\nContent-Type: application/json\r\n"
                 "%sContent-Length: %zu\r\n\r\n%s",
                 REASONS[r].status, text, REASONS[r].status == 503 ? "Retry-After: 1\r\n" : "",
                 strlen(body), body);
    free(body);
    return out;
}

/* Answers (when the reason has an answer) and shuts the socket down; the
 * connection's own thread then sees the end and closes it. Lock held. */
static void cut(conn_guard_t *g, conn_entry_t *e, cut_reason_t r) {
    if (g->answers[r]) {
        const char *a = g->answers[r];
        (void)!send(e->fd, a, strlen(a), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    shutdown(e->fd, SHUT_RDWR);
    e->cut = 1;
    metric_add(g->m_refused, 1, REASONS[r].label);
    log_msg(LOG_DEBUG, "http: connection cut (%s)", REASONS[r].label);
}

static void *watch(void *arg) {
    conn_guard_t *g = arg;
    pthread_mutex_lock(&g->lock);
    while (!g->stopping) {
        const double now = clock_now_s();
        for (int i = 0; i < g->n_entries; i++) {
            conn_entry_t *e = &g->entries[i];
            if (!e->in_use || e->cut || e->phase == CONN_ACTIVE)
                continue;
            if (e->phase == CONN_BODY && now - e->since > g->opt.body_timeout_s)
                cut(g, e, CUT_BODY_TIMEOUT);
            else if (e->phase == CONN_HEADERS && now - e->since > g->opt.header_timeout_s)
                cut(g, e, e->answered ? CUT_IDLE_TIMEOUT : CUT_HEADER_TIMEOUT);
        }
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        long ns = until.tv_nsec + (long)(WATCH_INTERVAL_S * 1e9);
        until.tv_sec += ns / 1000000000L;
        until.tv_nsec = ns % 1000000000L;
        pthread_cond_timedwait(&g->wake, &g->lock, &until);
    }
    pthread_mutex_unlock(&g->lock);
    return NULL;
}

/* Frees everything but the watcher thread (not running, or joined). */
static void release(conn_guard_t *g) {
    pthread_mutex_destroy(&g->lock);
    pthread_cond_destroy(&g->wake);
    for (int r = 0; r < N_CUT_REASONS; r++)
        free(g->answers[r]);
    free(g->entries);
    free(g);
}

conn_guard_t *conn_guard_create(const conn_guard_options_t *opt, metrics_t *metrics,
                                ar_error_t *err) {
    conn_guard_t *g = calloc(1, sizeof *g);
    if (!g) {
        ar_errorf(err, "out of memory");
        return NULL;
    }
    g->opt = *opt;
    g->n_entries = opt->max_connections + HARD_LIMIT_HEADROOM;
    g->entries = calloc((size_t)g->n_entries, sizeof *g->entries);
    for (int r = 0; r < N_CUT_REASONS; r++)
        g->answers[r] = make_answer((cut_reason_t)r);
    static const char *const labels[] = {"reason"};
    g->m_refused = metrics_counter(
        metrics, "arserve_http_connections_refused_total",
        "Connections cut before their request was answered, by reason: header_timeout, "
        "idle_timeout, body_timeout, shed (the slowest, cut for a new one at the connection "
        "limit), connection_limit, per_ip_limit.",
        1, labels);
    for (int r = 0; g->m_refused && r < N_CUT_REASONS; r++)
        metric_add(g->m_refused, 0, REASONS[r].label);
    pthread_mutex_init(&g->lock, NULL);
    pthread_cond_init(&g->wake, NULL);
    if (!g->entries || !g->m_refused || pthread_create(&g->watcher, NULL, watch, g)) {
        ar_errorf(err, "cannot start the connection watcher (out of memory or threads)");
        release(g);
        return NULL;
    }
    return g;
}

void conn_guard_destroy(conn_guard_t *g) {
    if (!g)
        return;
    pthread_mutex_lock(&g->lock);
    g->stopping = 1;
    pthread_cond_signal(&g->wake);
    pthread_mutex_unlock(&g->lock);
    pthread_join(g->watcher, NULL);
    release(g);
}

unsigned conn_guard_hard_limit(const conn_guard_t *g) { return (unsigned)g->n_entries; }

/* The slowest connection still reading a request (from address ip, or from
 * anywhere when ip is NULL) other than self: the one longest in its phase. */
static conn_entry_t *slowest(conn_guard_t *g, const conn_entry_t *self, const struct in_addr *ip) {
    conn_entry_t *best = NULL;
    for (int i = 0; i < g->n_entries; i++) {
        conn_entry_t *e = &g->entries[i];
        if (!e->in_use || e->cut || e == self || e->phase == CONN_ACTIVE ||
            (ip && e->ip.s_addr != ip->s_addr))
            continue;
        if (!best || e->since < best->since)
            best = e;
    }
    return best;
}

/* Room for a new connection e within a limit that counts n open ones: when
 * they are over it, the slowest of them goes, or e itself when all are
 * being answered. */
static void enforce(conn_guard_t *g, conn_entry_t *e, int n, int limit, const struct in_addr *ip,
                    cut_reason_t refuse) {
    if (e->cut || !limit || n <= limit)
        return;
    conn_entry_t *victim = slowest(g, e, ip);
    if (victim)
        cut(g, victim, CUT_SHED);
    else
        cut(g, e, refuse);
}

static void admit(conn_guard_t *g, struct MHD_Connection *c, conn_entry_t *e) {
    const union MHD_ConnectionInfo *fd =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    const union MHD_ConnectionInfo *addr =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    *e = (conn_entry_t){.in_use = 1, .fd = fd ? fd->connect_fd : -1, .since = clock_now_s()};
    if (addr && addr->client_addr && addr->client_addr->sa_family == AF_INET)
        e->ip = ((const struct sockaddr_in *)addr->client_addr)->sin_addr;
    int open = 0, same_ip = 0;
    for (int i = 0; i < g->n_entries; i++) {
        const conn_entry_t *o = &g->entries[i];
        if (o->in_use && !o->cut) {
            open++;
            same_ip += o->ip.s_addr == e->ip.s_addr;
        }
    }
    enforce(g, e, same_ip, g->opt.max_per_ip, &e->ip, CUT_PER_IP_LIMIT);
    enforce(g, e, open, g->opt.max_connections, NULL, CUT_CONNECTION_LIMIT);
}

void conn_guard_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                       enum MHD_ConnectionNotificationCode code) {
    conn_guard_t *g = cls;
    pthread_mutex_lock(&g->lock);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        conn_entry_t *e = NULL;
        for (int i = 0; !e && i < g->n_entries; i++)
            if (!g->entries[i].in_use)
                e = &g->entries[i];
        *socket_context = e;
        if (e) {
            admit(g, c, e);
        } else { /* cannot happen: libmicrohttpd's limit is the table's size */
            const union MHD_ConnectionInfo *fd =
                MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
            if (fd)
                shutdown(fd->connect_fd, SHUT_RDWR);
            metric_add(g->m_refused, 1, REASONS[CUT_CONNECTION_LIMIT].label);
        }
    } else if (*socket_context) {
        conn_entry_t *e = *socket_context;
        e->in_use = 0;
        *socket_context = NULL;
    }
    pthread_mutex_unlock(&g->lock);
}

void conn_guard_phase(conn_guard_t *g, struct MHD_Connection *c, conn_phase_t phase) {
    pthread_mutex_lock(&g->lock);
    /* Read under the lock: the closing notice clears it under the lock too. */
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    conn_entry_t *e = ci ? ci->socket_context : NULL;
    if (e) {
        e->answered += phase == CONN_HEADERS;
        e->phase = phase;
        e->since = clock_now_s();
    }
    pthread_mutex_unlock(&g->lock);
}
