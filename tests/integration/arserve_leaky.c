/* What makes build/arserve-leaky leak: linked with -Wl,--wrap=sched_job_release,
 * every job the HTTP layer releases (one per generation request) also loses
 * ARSERVE_TEST_LEAK_BYTES of touched memory. test_soak.py runs its RSS-growth
 * check on that build and must see it fail: a leak detector shown to detect.
 * Linked into arserve-leaky only, so the daemon's own code carries no switch. */
#include <stdlib.h>
#include <string.h>

#include "server/scheduler.h"

#ifndef ARSERVE_TEST_LEAK_BYTES
#error "build with -DARSERVE_TEST_LEAK_BYTES=N (the Makefile's TEST_LEAK_BYTES)"
#endif

void __real_sched_job_release(sched_job_t *j);
void __wrap_sched_job_release(sched_job_t *j);

/* The lost block escapes here, so the compiler cannot drop the malloc. */
static void *volatile leak_sink;

void __wrap_sched_job_release(sched_job_t *j) {
    __real_sched_job_release(j);
    char *lost = malloc(ARSERVE_TEST_LEAK_BYTES);
    if (lost)
        memset(lost, 1, ARSERVE_TEST_LEAK_BYTES); /* touched, so it counts in RSS */
    leak_sink = lost;
}
