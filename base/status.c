/* Error message helpers shared by every module. */
#include "base/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int ar_errorf(ar_error_t *err, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return AR_ERR;
}

int ar_error_prefix(ar_error_t *err, const char *fmt, ...) {
    if (!err)
        return AR_ERR;
    char old[sizeof err->msg];
    memcpy(old, err->msg, sizeof old);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n + 3 <= sizeof err->msg) {
        size_t room = sizeof err->msg - (size_t)n - 3;
        memcpy(err->msg + n, ": ", 2);
        size_t len = strnlen(old, room);
        memcpy(err->msg + n + 2, old, len);
        err->msg[n + 2 + len] = 0;
    }
    return AR_ERR;
}
