#include "base/memory.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The first line of path, without its newline, into buf; 0 or -1. */
static int first_line(const char *path, char *buf, size_t cap) {
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    const int ok = fgets(buf, (int)cap, f) != NULL;
    fclose(f);
    if (!ok)
        return -1;
    buf[strcspn(buf, "\n")] = 0;
    return 0;
}

/* A cgroup file holding a byte count, or "max"; SIZE_MAX for max, unread,
 * or a v1 "no limit" (a page-rounded 2^63 - 1). */
static size_t cgroup_bytes(const char *dir, const char *name) {
    char path[4096], line[64];
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path ||
        first_line(path, line, sizeof line) != 0 || !strcmp(line, "max"))
        return SIZE_MAX;
    char *end;
    const unsigned long long v = strtoull(line, &end, 10);
    return end != line && *end == 0 && v < (1ull << 62) ? (size_t)v : SIZE_MAX;
}

/* The room a cgroup's limit leaves: limit - usage, SIZE_MAX without a limit. */
static size_t cgroup_room(const char *dir, const char *limit_file, const char *usage_file) {
    const size_t max = cgroup_bytes(dir, limit_file);
    const size_t current = cgroup_bytes(dir, usage_file);
    if (max == SIZE_MAX)
        return SIZE_MAX;
    return current == SIZE_MAX ? max : current < max ? max - current : 0;
}

int host_memory_read_from(host_memory_t *out, const char *meminfo, const char *cgroup_dir,
                          int cgroup_version) {
    out->available = 0;
    out->cgroup_room = SIZE_MAX;
    FILE *f = fopen(meminfo, "r");
    if (!f)
        return -1;
    char line[256];
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        unsigned long long kib;
        if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) {
            out->available = (size_t)kib * 1024;
            found = 1;
        }
    }
    fclose(f);
    if (cgroup_dir && cgroup_version == 2)
        out->cgroup_room = cgroup_room(cgroup_dir, "memory.max", "memory.current");
    else if (cgroup_dir && cgroup_version == 1)
        out->cgroup_room =
            cgroup_room(cgroup_dir, "memory.limit_in_bytes", "memory.usage_in_bytes");
    return found ? 0 : -1;
}

int host_memory_read(host_memory_t *out) {
    /* /proc/self/cgroup: "0::/path" (v2), or "N:memory:/path" among v1's
     * controllers (a hybrid host has both; v1's memory line holds the limit). */
    char line[4096], v1[4200] = "", v2[4200] = "";
    FILE *f = fopen("/proc/self/cgroup", "r");
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *path = strchr(line, ':') ? strchr(strchr(line, ':') + 1, ':') : NULL;
        if (!path)
            continue;
        *path++ = 0;
        const char *controllers = strchr(line, ':') + 1;
        if (!strcmp(line, "0") && !controllers[0])
            snprintf(v2, sizeof v2, "/sys/fs/cgroup%s", path);
        else if (!strcmp(controllers, "memory") || !strncmp(controllers, "memory,", 7) ||
                 strstr(controllers, ",memory"))
            snprintf(v1, sizeof v1, "/sys/fs/cgroup/memory%s", path);
    }
    if (f)
        fclose(f);
    if (v1[0])
        return host_memory_read_from(out, "/proc/meminfo", v1, 1);
    return host_memory_read_from(out, "/proc/meminfo", v2[0] ? v2 : NULL, 2);
}
