/* One line per message: UTC time, level, text. */
#include "server/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

log_level_t log_threshold = LOG_INFO;

static const char *const NAMES[] = {"error", "warn", "info", "debug"};

int log_level_parse(const char *s) {
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, NAMES[i]))
            return i;
    return -1;
}

void log_write(log_level_t level, const char *fmt, ...) {
    char line[2048], when[32];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    /* One fprintf per line so concurrent threads do not interleave. */
    fprintf(stderr, "%s.%03ldZ %-5s %s\n", when, ts.tv_nsec / 1000000, NAMES[level], line);
}
