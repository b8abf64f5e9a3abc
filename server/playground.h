/* The playground page GET / serves: server/playground.html, built into the
 * binary by server/playground.S. */
#ifndef ARSERVE_PLAYGROUND_H
#define ARSERVE_PLAYGROUND_H

#include <stddef.h>

extern const char playground_html[];
extern const size_t playground_html_len;

#endif
