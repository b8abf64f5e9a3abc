/* Tests for base/memory.c: MemAvailable read from a meminfo file, and the
 * room a cgroup's limit leaves (version 2's memory.max and memory.current,
 * version 1's limit_in_bytes and usage_in_bytes, "max" and v1's 2^63 being
 * no limit), on files written here; then this machine's own. */
#include "base/memory.h"
#include "tests/test.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[] = "/tmp/arserve_memory_XXXXXX";

static const char *write_file(const char *name, const char *text) {
    static char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
    return path;
}

static void test_meminfo_and_cgroups(void) {
    host_memory_t m;
    const char *meminfo = write_file("meminfo", "MemTotal:       24000000 kB\n"
                                                "MemFree:         1000000 kB\n"
                                                "MemAvailable:   12000000 kB\n");
    char info[256];
    snprintf(info, sizeof info, "%s", meminfo);
    CHECK(host_memory_read_from(&m, info, NULL, 2) == 0);
    CHECK(m.available == 12000000ull * 1024 && m.cgroup_room == SIZE_MAX);
    CHECK(host_memory_usable(&m) == m.available);

    write_file("memory.max", "4294967296\n");
    write_file("memory.current", "1073741824\n");
    CHECK(host_memory_read_from(&m, info, dir, 2) == 0);
    CHECK(m.cgroup_room == 3ull << 30 && host_memory_usable(&m) == 3ull << 30);
    write_file("memory.max", "max\n");
    CHECK(host_memory_read_from(&m, info, dir, 2) == 0 && m.cgroup_room == SIZE_MAX);
    write_file("memory.max", "1000\n"); /* over its limit already: no room */
    write_file("memory.current", "2000\n");
    CHECK(host_memory_read_from(&m, info, dir, 2) == 0 && host_memory_usable(&m) == 0);

    write_file("memory.limit_in_bytes", "9223372036854771712\n"); /* v1: no limit */
    write_file("memory.usage_in_bytes", "11754700800\n");
    CHECK(host_memory_read_from(&m, info, dir, 1) == 0 && m.cgroup_room == SIZE_MAX);
    write_file("memory.limit_in_bytes", "8589934592\n");
    CHECK(host_memory_read_from(&m, info, dir, 1) == 0);
    CHECK(m.cgroup_room == 0); /* usage above the limit: none */
    write_file("memory.usage_in_bytes", "2147483648\n");
    CHECK(host_memory_read_from(&m, info, dir, 1) == 0 && m.cgroup_room == 6ull << 30);

    const char *no_line = write_file("meminfo_old", "MemTotal: 1000 kB\nMemFree: 10 kB\n");
    CHECK(host_memory_read_from(&m, no_line, NULL, 2) == -1 && m.available == 0);
    CHECK(host_memory_read_from(&m, "/nonexistent/meminfo", NULL, 2) == -1);
}

/* This machine's: some memory is available, no more than it has. */
static void test_this_machine(void) {
    host_memory_t m;
    CHECK(host_memory_read(&m) == 0);
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    CHECK(m.available > 0 && m.available <= (size_t)pages * (size_t)page);
    CHECK(host_memory_usable(&m) <= m.available);
}

int main(void) {
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    TEST_RUN(test_meminfo_and_cgroups);
    TEST_RUN(test_this_machine);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    return TEST_SUMMARY();
}
