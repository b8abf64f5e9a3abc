/* `arserve serve` once its settings are read: loads the model, starts the
 * scheduler and the HTTP front, logs what the KV pool admits, and drains on
 * SIGTERM/SIGINT: /ready turns 503, new requests get 503, running ones
 * finish within the drain timeout, then it returns 0. A second signal exits
 * at once (one sent 0.25 s or more after the first: two a moment apart,
 * as `timeout` sends them, are one stop). */
#ifndef ARSERVE_DAEMON_H
#define ARSERVE_DAEMON_H

#include "server/config.h"

/* Runs the daemon until it is told to stop; the process's exit status: 0
 * after a drain, 1 when it could not start or its engine died, 2 when the
 * configuration does not suit the model (the message names the key). */
int daemon_run(const server_config_t *cfg, const char *version);

#endif
