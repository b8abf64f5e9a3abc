/* Host scratch memory for one step: a bump allocator whose blocks live
 * until the outermost arena_end. It keeps its memory between steps, so once
 * it has grown to a step's needs, later steps of that size allocate
 * nothing (the steady state the daemon runs in). Scopes nest: a caller
 * may take blocks, then call a function that opens a scope of its own; the
 * blocks go when the outermost scope ends. */
#ifndef ARSERVE_ARENA_H
#define ARSERVE_ARENA_H

#include <stddef.h>

typedef struct arena {
    unsigned char *base; /* the chunk steps carve, cap bytes */
    size_t cap, used;
    size_t spill; /* bytes this step took from the heap beyond cap */
    void **extra; /* those blocks, freed at the next reset */
    int n_extra, cap_extra;
    int depth; /* open scopes */
} arena_t;

/* Opens a scope; the outermost one starts with the arena empty. */
void arena_begin(arena_t *a);
/* Closes a scope; the outermost one frees nothing, it only lets the next
 * begin take everything back. */
void arena_end(arena_t *a);

/* n bytes aligned to 64, inside a scope, valid until the outermost scope
 * ends; NULL when out of memory. */
void *arena_alloc(arena_t *a, size_t n);
/* arena_alloc, zeroed. */
void *arena_calloc(arena_t *a, size_t count, size_t size);
void arena_free(arena_t *a);

#endif
