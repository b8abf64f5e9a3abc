/* Text to and from people, shared by every command-line tool (the flags of
 * cli/, the daemon's settings, the benchmark's specs): one number parser,
 * where the whole string is the number with nothing around it, and one
 * help-text wrapper. */
#ifndef ARSERVE_TEXT_H
#define ARSERVE_TEXT_H

#include <stddef.h>
#include <stdio.h>

typedef enum number_status {
    NUMBER_OK = 0,
    NUMBER_SYNTAX,   /* not a number of the kind asked for */
    NUMBER_OVERFLOW, /* an integer beyond long long */
} number_status_t;

/* [-]digits: "12", "-3"; not " 12", "+12" or "1.0". */
number_status_t text_parse_int(const char *s, long long *out);

/* A number as strtod reads it ("0.25", "1e-1", "nan": callers check the
 * range, which a NaN or an infinity is never in), or a fraction of two
 * unsigned integers, the second positive ("1/6"). */
number_status_t text_parse_real(const char *s, double *out);

/* Prints text wrapped at 78 columns: the first line after `first` spaces,
 * the others after `indent` spaces (first 0: the cursor stands where the
 * text should start). A word longer than a line gets a line of its own. */
void text_print_wrapped(FILE *f, int first, int indent, const char *text);

/* Appends the printf-style text at buf + *used, never writing past cap
 * (the text is cut there, still terminated), and advances *used by what it
 * would have written: lists of names for help texts and error messages are
 * built with it. Nothing happens once *used >= cap. */
void text_append(char *buf, size_t cap, size_t *used, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
