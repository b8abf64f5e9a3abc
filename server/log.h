/* Logging to stderr with a level checked before any formatting happens. */
#ifndef ARSERVE_LOG_H
#define ARSERVE_LOG_H

typedef enum log_level { LOG_ERROR = 0, LOG_WARN, LOG_INFO, LOG_DEBUG } log_level_t;

extern log_level_t log_threshold;

/* Parses "error", "warn", "info" or "debug"; -1 if none. */
int log_level_parse(const char *s);

void log_write(log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define log_msg(level, ...)                                                                        \
    do {                                                                                           \
        if ((level) <= log_threshold)                                                              \
            log_write((level), __VA_ARGS__);                                                       \
    } while (0)

#endif
