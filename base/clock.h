/* Monotonic time in seconds, for durations (not wall-clock dates). */
#ifndef ARSERVE_CLOCK_H
#define ARSERVE_CLOCK_H

#include <time.h>

static inline double clock_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

#endif
