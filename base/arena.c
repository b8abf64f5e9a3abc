/* The step arena (arena.h). */
#include "base/arena.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ARENA_ALIGN 64

static size_t round_up(size_t n) { return (n + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1); }

void *arena_alloc(arena_t *a, size_t n) {
    n = round_up(n ? n : 1);
    if (n <= a->cap - a->used) {
        void *p = a->base + a->used;
        a->used += n;
        return p;
    }
    /* Past the chunk: a block of its own for this step, counted so the next
     * reset makes the chunk big enough. */
    if (a->n_extra == a->cap_extra) {
        const int cap = a->cap_extra ? 2 * a->cap_extra : 8;
        void **e = realloc(a->extra, (size_t)cap * sizeof *e);
        if (!e)
            return NULL;
        a->extra = e;
        a->cap_extra = cap;
    }
    void *p = aligned_alloc(ARENA_ALIGN, n);
    if (!p)
        return NULL;
    a->extra[a->n_extra++] = p;
    a->spill += n;
    return p;
}

void *arena_calloc(arena_t *a, size_t count, size_t size) {
    if (size && count > SIZE_MAX / size)
        return NULL;
    void *p = arena_alloc(a, count * size);
    if (p)
        memset(p, 0, count * size);
    return p;
}

/* Every block handed out is gone; if the last scope spilled past the
 * chunk, the chunk grows to hold it all. */
static void arena_reset(arena_t *a) {
    for (int i = 0; i < a->n_extra; i++)
        free(a->extra[i]);
    a->n_extra = 0;
    if (a->spill) {
        const size_t want = a->used + a->spill, cap = round_up(want + want / 2);
        unsigned char *b = aligned_alloc(ARENA_ALIGN, cap);
        if (b) { /* else the next step spills again */
            free(a->base);
            a->base = b;
            a->cap = cap;
        }
        a->spill = 0;
    }
    a->used = 0;
}

void arena_begin(arena_t *a) {
    if (a->depth++ == 0)
        arena_reset(a);
}

void arena_end(arena_t *a) {
    if (a->depth > 0)
        a->depth--;
}

void arena_free(arena_t *a) {
    for (int i = 0; i < a->n_extra; i++)
        free(a->extra[i]);
    free(a->base);
    free(a->extra);
    memset(a, 0, sizeof *a);
}
