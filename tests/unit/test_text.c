/* base/text.h: appending to a bounded buffer, as the name lists of help
 * texts and error messages are built. */
#include <string.h>

#include "base/text.h"
#include "tests/test.h"

static void test_append_builds_a_list(void) {
    char buf[64];
    size_t used = 0;
    buf[0] = 0;
    const char *names[] = {"cpu", "cuda", "metal"};
    for (int i = 0; i < 3; i++)
        text_append(buf, sizeof buf, &used, "%s%s", i ? ", " : "", names[i]);
    CHECK_MSG(strcmp(buf, "cpu, cuda, metal") == 0, "got \"%s\"", buf);
    CHECK(used == strlen("cpu, cuda, metal"));
}

/* A full buffer is cut, still terminated, and later appends change nothing. */
static void test_append_never_writes_past_cap(void) {
    char buf[16];
    memset(buf, 'x', sizeof buf);
    size_t used = 0;
    text_append(buf, 8, &used, "%s", "abcdefghij");
    CHECK_MSG(strcmp(buf, "abcdefg") == 0, "got \"%s\"", buf);
    CHECK(used == 10);
    text_append(buf, 8, &used, "%s", "more");
    CHECK_MSG(strcmp(buf, "abcdefg") == 0, "got \"%s\"", buf);
    CHECK(used == 10);
    CHECK(buf[8] == 'x'); /* nothing past cap */
}

int main(void) {
    TEST_RUN(test_append_builds_a_list);
    TEST_RUN(test_append_never_writes_past_cap);
    return TEST_SUMMARY();
}
