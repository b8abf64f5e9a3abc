/* Text to and from people (text.h). */
#include "base/text.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

number_status_t text_parse_int(const char *s, long long *out) {
    /* strtoll alone would accept " 12" and "+12". */
    if (!s || !(s[0] == '-' || isdigit((unsigned char)s[0])))
        return NUMBER_SYNTAX;
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end)
        return NUMBER_SYNTAX;
    if (errno == ERANGE)
        return NUMBER_OVERFLOW;
    *out = v;
    return NUMBER_OK;
}

number_status_t text_parse_real(const char *s, double *out) {
    if (!s || !s[0] || isspace((unsigned char)s[0]))
        return NUMBER_SYNTAX;
    const char *slash = strchr(s, '/');
    char *end = NULL;
    if (slash) {
        if (!isdigit((unsigned char)s[0]) || !isdigit((unsigned char)slash[1]))
            return NUMBER_SYNTAX;
        errno = 0;
        long long num = strtoll(s, &end, 10);
        if (end != slash || errno)
            return NUMBER_SYNTAX;
        long long den = strtoll(slash + 1, &end, 10);
        if (*end || errno || den <= 0)
            return NUMBER_SYNTAX;
        *out = (double)num / (double)den;
        return NUMBER_OK;
    }
    *out = strtod(s, &end);
    return end != s && !*end ? NUMBER_OK : NUMBER_SYNTAX;
}

void text_print_wrapped(FILE *f, int first, int indent, const char *text) {
    const int width = 78 - indent;
    for (int pad = first; *text; pad = indent) {
        int n = (int)strlen(text);
        if (n > width) {
            n = width;
            while (n > 0 && text[n] != ' ')
                n--;
            if (n == 0)
                n = (int)strcspn(text, " "); /* one word longer than a line */
        }
        fprintf(f, "%*s%.*s\n", pad, "", n, text);
        text += n;
        while (*text == ' ')
            text++;
    }
}

void text_append(char *buf, size_t cap, size_t *used, const char *fmt, ...) {
    if (*used >= cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(buf + *used, cap - *used, fmt, ap);
    va_end(ap);
    *used += n > 0 ? (size_t)n : 0;
}
