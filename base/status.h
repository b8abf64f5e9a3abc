/* Errors as values: a function that can fail returns AR_OK or AR_ERR and, on
 * AR_ERR, leaves a human-readable message (file, field, reason) in an
 * ar_error_t the caller owns. */
#ifndef ARSERVE_STATUS_H
#define ARSERVE_STATUS_H

#include <stddef.h>

enum { AR_OK = 0, AR_ERR = -1 };

typedef struct ar_error {
    char msg[1024];
} ar_error_t;

/* Formats msg into err (which may be NULL) and returns AR_ERR. */
int ar_errorf(ar_error_t *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prepends "prefix: " to the message already in err; returns AR_ERR. */
int ar_error_prefix(ar_error_t *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
