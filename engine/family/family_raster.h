/* The raster family's networks (engine/family/family_raster.c): what its
 * load puts in model_t.net, for its own files and for tests and tools that
 * reach past the family table (the golden tests' decoder, the speed
 * bench's roofline). */
#ifndef ARSERVE_FAMILY_RASTER_H
#define ARSERVE_FAMILY_RASTER_H

#include "engine/family/raster.h"
#include "engine/family/vq_decoder.h"
#include "engine/model.h"

typedef struct raster_net {
    raster_model_t lm; /* the language model */
    vq_decoder_t dec;  /* the VQ-16 image decoder */
} raster_net_t;

/* m's networks; m must be a loaded raster-family model. */
static inline raster_net_t *raster_net_of(const model_t *m) { return m->net; }

#endif
