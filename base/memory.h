/* How much host memory this process may still take: what the kernel calls
 * available (MemAvailable: free pages and what can be reclaimed without
 * swapping), within the room its cgroup's limit (cgroup v2 memory.max less
 * memory.current; version 1's limit_in_bytes less usage_in_bytes) leaves.
 * For sizing a pool from the machine. */
#ifndef ARSERVE_BASE_MEMORY_H
#define ARSERVE_BASE_MEMORY_H
#include <stddef.h>

typedef struct host_memory {
    size_t available;   /* MemAvailable, bytes; 0 when it could not be read */
    size_t cgroup_room; /* memory.max - memory.current; SIZE_MAX: no limit (or none found) */
} host_memory_t;

/* Reads meminfo (a /proc/meminfo-style file) and, with cgroup_dir not NULL,
 * that cgroup's limit and usage: version 2's memory.max and memory.current,
 * version 1's memory.limit_in_bytes and memory.usage_in_bytes. 0, or -1
 * when meminfo has no MemAvailable line. */
int host_memory_read_from(host_memory_t *out, const char *meminfo, const char *cgroup_dir,
                          int cgroup_version);

/* The same for this process: /proc/meminfo and the cgroup /proc/self/cgroup
 * names under /sys/fs/cgroup. */
int host_memory_read(host_memory_t *out);

/* What the process may take: the smaller of the two. */
static inline size_t host_memory_usable(const host_memory_t *m) {
    return m->available < m->cgroup_room ? m->available : m->cgroup_room;
}

#endif
