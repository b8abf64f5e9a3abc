/* Philox4x32-10 (Salmon et al., SC 2011, section 3.3) and the uniform double
 * built from it. The multipliers and Weyl key increments are the paper's; the
 * known-answer vectors in tests/unit/test_rng.c are Random123's. */
#include "base/rng.h"

#define PHILOX_M0 UINT32_C(0xD2511F53)
#define PHILOX_M1 UINT32_C(0xCD9E8D57)
#define PHILOX_W0 UINT32_C(0x9E3779B9) /* golden ratio */
#define PHILOX_W1 UINT32_C(0xBB67AE85) /* sqrt(3) - 1 */
#define PHILOX_ROUNDS 10

void rng_philox4x32(const uint32_t key[2], const uint32_t ctr[4], uint32_t out[4]) {
    uint32_t k0 = key[0], k1 = key[1];
    uint32_t x0 = ctr[0], x1 = ctr[1], x2 = ctr[2], x3 = ctr[3];
    for (int r = 0; r < PHILOX_ROUNDS; r++) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * x0;
        uint64_t p1 = (uint64_t)PHILOX_M1 * x2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        x0 = hi1 ^ x1 ^ k0;
        x1 = lo1;
        x2 = hi0 ^ x3 ^ k1;
        x3 = lo0;
        /* The key schedule bumps between rounds; its tenth value is unused. */
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = x0;
    out[1] = x1;
    out[2] = x2;
    out[3] = x3;
}

double rng_uniform(uint64_t seed, uint64_t stream, uint64_t counter) {
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    const uint32_t ctr[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), (uint32_t)stream,
                             (uint32_t)(stream >> 32)};
    uint32_t out[4];
    rng_philox4x32(key, ctr, out);
    uint64_t bits = ((uint64_t)out[0] | (uint64_t)out[1] << 32) >> 11;
    return (double)bits * 0x1p-53;
}
