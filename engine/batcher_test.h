/* For tests only: what engine/batcher.h keeps out of the daemon's reach.
 * Production drivers call batcher_admit, batcher_step and batcher_finish
 * themselves (the daemon steps without the lock); the tests drive the core
 * a whole iteration at a time. */
#ifndef ARSERVE_BATCHER_TEST_H
#define ARSERVE_BATCHER_TEST_H

#include "engine/batcher.h"

/* The three parts in a row, for single-threaded drivers; returns how many
 * jobs were stepped (0: nothing was running) or -1 when the step failed. */
int batcher_iterate(batcher_t *b, double now);

#endif
