/* For tests only: what server/scheduler.h keeps out of the daemon's reach.
 * The daemon logs overruns as they happen (and counts them in /metrics);
 * the tests ask for the count. */
#ifndef ARSERVE_SCHEDULER_TEST_H
#define ARSERVE_SCHEDULER_TEST_H

#include "server/scheduler.h"

/* Iterations whose measured KV peak passed the planner's reservation (a
 * planner or policy bug, logged; DEBUG=1 builds abort on the first). */
long long sched_kv_overruns(scheduler_t *s);

#endif
