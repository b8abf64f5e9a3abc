/* Files a model directory or a config names, opened and read the one way:
 * only a regular file (a FIFO would block start-up forever, a link to
 * /dev/zero would be read without end), and never more of it than its
 * reader says a file of its kind may have. Every error names the file. */
#ifndef ARSERVE_FILE_H
#define ARSERVE_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

/* path opened read-only and close-on-exec if it is a regular file (a link
 * is followed): the descriptor, with *size its bytes (size may be NULL), or
 * -1 with err naming the file and what it is instead. Never blocks: a FIFO
 * is opened without waiting for a writer, then refused. what names the
 * file in messages ("config file": "PATH: cannot open config file: ..."),
 * or NULL. */
int file_open_regular(const char *path, const char *what, uint64_t *size, ar_error_t *err);

/* The whole regular file at path, NUL-terminated, *len its bytes (len may be
 * NULL), if it has at most max bytes; NULL with err naming the file and the
 * problem otherwise. The caller frees it. */
char *file_read_all(const char *path, const char *what, size_t max, size_t *len, ar_error_t *err);

#endif
