/* For tests only: what server/config.h keeps out of the daemon's reach.
 * The tests write settings back out to check that they load back, and that
 * config/arserve.example.json is the defaults. */
#ifndef ARSERVE_SERVER_CONFIG_TEST_H
#define ARSERVE_SERVER_CONFIG_TEST_H

#include "server/config.h"

/* The settings as a JSON object, one key per line in table order, as a
 * malloc'd string (NULL if out of memory; free() it). The key itself is never
 * written. redact = 0: exactly the keys a config file may hold, so the output
 * loads back (config/arserve.example.json is to_json(defaults, 0)). redact != 0:
 * adds "api_key": "<redacted>", or "" when no key is set. */
char *server_config_to_json(const server_config_t *c, int redact);

#endif
