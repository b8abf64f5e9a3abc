/* Connection-level defences of the HTTP front, beside libmicrohttpd (which
 * only knows an idle timeout and a hard connection limit):
 *   - a total deadline for a request's headers and one for its body, however
 *     slowly the bytes trickle in (an idle keep-alive connection gets the
 *     header deadline too);
 *   - a connection limit that sheds the slowest connections first: when a
 *     new connection would pass it, the connection that has spent longest
 *     reading headers or a body is cut instead, so a slow-header attack
 *     cannot lock out clients that send a request at once;
 *   - the same per client address.
 * A connection cut before its request is answered gets a short HTTP answer
 * (408 for a deadline, 503 for a limit) and is shut down; each cut is
 * counted in arserve_http_connections_refused_total by reason.
 *
 * Every connection is in one phase: CONN_HEADERS from its start and after
 * each answer (waiting for the next request), CONN_BODY while a request
 * body arrives, CONN_ACTIVE while a request is being answered (no deadline
 * here: the request timeout covers it). The HTTP layer moves it between
 * them. */
#ifndef ARSERVE_CONN_GUARD_H
#define ARSERVE_CONN_GUARD_H

#include <microhttpd.h>

#include "base/status.h"
#include "server/metrics.h"

typedef enum conn_phase { CONN_HEADERS, CONN_BODY, CONN_ACTIVE } conn_phase_t;

typedef struct conn_guard_options {
    int max_connections; /* connections open at once */
    int max_per_ip;      /* connections open at once from one address; 0: no limit */
    double header_timeout_s, body_timeout_s;
} conn_guard_options_t;

typedef struct conn_guard conn_guard_t;

/* Starts the deadline watcher; NULL with err filled on failure. */
conn_guard_t *conn_guard_create(const conn_guard_options_t *opt, metrics_t *metrics,
                                ar_error_t *err);
/* Stops the watcher and frees the guard. Call after MHD_stop_daemon. */
void conn_guard_destroy(conn_guard_t *g);

/* The hard limit to give libmicrohttpd: above max_connections, so that the
 * guard, not libmicrohttpd, chooses which connection goes. */
unsigned conn_guard_hard_limit(const conn_guard_t *g);

/* MHD_OPTION_NOTIFY_CONNECTION's callback (cls: the guard). */
void conn_guard_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                       enum MHD_ConnectionNotificationCode code);

/* Moves connection c to phase, restarting that phase's clock; a move to
 * CONN_HEADERS also counts an answered request. A connection the guard
 * has no entry for (or no longer has) is left alone. */
void conn_guard_phase(conn_guard_t *g, struct MHD_Connection *c, conn_phase_t phase);

#endif
