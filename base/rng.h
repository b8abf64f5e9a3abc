/* Counter-based random numbers (Philox4x32-10, Salmon et al., "Parallel Random
 * Numbers: As Easy as 1, 2, 3", SC 2011): a draw is a pure function of (seed,
 * stream, counter), so a request's seed gives the same image on any backend,
 * thread count or batch composition. */
#ifndef ARSERVE_RNG_H
#define ARSERVE_RNG_H

#include <stdint.h>

/* One Philox4x32-10 block: ten rounds of the bijection keyed by key, applied
 * to ctr. Matches Random123's philox4x32_R(10, ctr, key) word for word. */
void rng_philox4x32(const uint32_t key[2], const uint32_t ctr[4], uint32_t out[4]);

/* A uniform double in [0, 1) with 53 random bits, a multiple of 2^-53.
 * key = {seed low word, seed high word}; ctr = {counter low, counter high,
 * stream low, stream high}; the 53 bits are the top bits of
 * out[0] | (uint64_t)out[1] << 32. Distinct (stream, counter) pairs under one
 * seed never share a block. */
double rng_uniform(uint64_t seed, uint64_t stream, uint64_t counter);

#endif
