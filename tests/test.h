/* A minimal unit-test harness: each test binary calls TEST_RUN(fn) per test
 * and returns TEST_SUMMARY(), which prints "N passed, N failed" as its last
 * line. CHECK records a failure with file and line and keeps going. */
#ifndef ARSERVE_TEST_H
#define ARSERVE_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Writes content to a fresh temporary file (/tmp/arserve-test-XXXXXX.json,
 * made by mkstemps, so that two test runs at once never share one); returns its
 * malloc'd path, which test_remove_temp deletes and frees. */
static inline char *test_temp_file(const char *content) {
    char *path = strdup("/tmp/arserve-test-XXXXXX.json");
    int fd = path ? mkstemps(path, 5) : -1;
    if (fd < 0) {
        perror("mkstemps");
        abort();
    }
    size_t n = strlen(content);
    if (write(fd, content, n) != (ssize_t)n)
        abort();
    close(fd);
    return path;
}

static inline void test_remove_temp(char *path) {
    unlink(path);
    free(path);
}

/* A uniform float in [-1, 1) from a xorshift64 state (never 0): the kernel
 * tests' inputs, the same on every run. */
static inline float test_xorshift_float(uint64_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return (float)((double)(*state >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static int test_failures_in_current;
static int test_passed, test_failed;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "  FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                      \
            test_failures_in_current++;                                                            \
        }                                                                                          \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                       \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "  FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                      \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            test_failures_in_current++;                                                            \
        }                                                                                          \
    } while (0)

/* |a - b| <= abs_tol + |b| * rel_tol */
#define CHECK_NEAR(a, b, abs_tol, rel_tol)                                                         \
    do {                                                                                           \
        double a_ = (a), b_ = (b);                                                                 \
        if (!(fabs(a_ - b_) <= (abs_tol) + fabs(b_) * (rel_tol))) {                                \
            fprintf(stderr, "  FAIL %s:%d: %s = %.9g, expected %.9g\n", __FILE__, __LINE__, #a,    \
                    a_, b_);                                                                       \
            test_failures_in_current++;                                                            \
        }                                                                                          \
    } while (0)

#define CHECK_STR_CONTAINS(haystack, needle)                                                       \
    CHECK_MSG(strstr((haystack), (needle)) != NULL, "\"%s\" does not contain \"%s\"", (haystack),  \
              (needle))

#define CHECK_STR_EQ(got, want)                                                                    \
    CHECK_MSG(strcmp((got), (want)) == 0, "got \"%s\", want \"%s\"", (got), (want))

#define TEST_RUN(fn)                                                                               \
    do {                                                                                           \
        test_failures_in_current = 0;                                                              \
        fn();                                                                                      \
        if (test_failures_in_current) {                                                            \
            test_failed++;                                                                         \
            fprintf(stderr, "not ok  %s\n", #fn);                                                  \
        } else {                                                                                   \
            test_passed++;                                                                         \
            fprintf(stderr, "ok      %s\n", #fn);                                                  \
        }                                                                                          \
    } while (0)

#define TEST_SUMMARY()                                                                             \
    (printf("%d passed, %d failed\n", test_passed, test_failed), test_failed ? 1 : 0)

#endif
