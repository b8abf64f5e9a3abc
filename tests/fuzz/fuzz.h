/* Helpers shared by the libFuzzer targets in tests/fuzz (fuzz.mk builds and
 * runs them): a check that aborts with a message, so libFuzzer saves the input
 * as a crash; the strict JSON check of text arserve wrote; and a memfd that
 * stands in for a file, for readers that take a path. */
#ifndef ARSERVE_FUZZ_H
#define ARSERVE_FUZZ_H

#include "engine/format/json_strict.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* A broken invariant: print it and abort, which libFuzzer reports as a crash
 * and saves the input for. */
#define FUZZ_REQUIRE(cond, ...)                                                                    \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz invariant broken at %s:%d: %s: ", __FILE__, __LINE__, #cond);    \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* text (NUL-terminated, from a builder) is strict JSON with no newline. */
static inline void fuzz_require_json(const char *text, const char *what) {
    FUZZ_REQUIRE(text != NULL, "%s returned NULL", what);
    json_strict_fault_t f;
    size_t n = strlen(text);
    FUZZ_REQUIRE(json_strict_check(text, n, JSON_STRICT_MAX_DEPTH, &f) == AR_OK,
                 "%s wrote invalid JSON: byte %zu: %s: %.200s", what, f.offset, f.why, text);
    FUZZ_REQUIRE(!memchr(text, '\n', n) && !memchr(text, '\r', n), "%s wrote a newline", what);
}

/* A memory-backed file holding the current input, and a path that opens it.
 * Created once per process; fuzz_file_write replaces its content. */
typedef struct fuzz_file {
    int fd;
    char path[64];
} fuzz_file_t;

static inline void fuzz_file_init(fuzz_file_t *f, const char *name) {
    f->fd = memfd_create(name, MFD_CLOEXEC);
    FUZZ_REQUIRE(f->fd >= 0, "memfd_create failed");
    snprintf(f->path, sizeof f->path, "/proc/self/fd/%d", f->fd);
}

static inline void fuzz_file_write(fuzz_file_t *f, const void *data, size_t size) {
    FUZZ_REQUIRE(ftruncate(f->fd, 0) == 0, "ftruncate failed");
    const char *p = data;
    size_t done = 0;
    while (done < size) {
        ssize_t w = pwrite(f->fd, p + done, size - done, (off_t)done);
        FUZZ_REQUIRE(w > 0, "pwrite failed");
        done += (size_t)w;
    }
}

#endif
