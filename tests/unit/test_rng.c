/* Tests for base/rng.c: Philox4x32-10 against Random123's known answers, and
 * the range, independence and rough uniformity of rng_uniform.
 * Run: gcc -std=c11 -I. tests/unit/test_rng.c base/rng.c -lm && ./a.out */
#include "base/rng.h"
#include "tests/test.h"

#include <stdint.h>

/* Random123's kat_vectors for philox4x32 with 10 rounds: ctr, key, expected. */
static void test_philox_known_answers(void) {
    static const struct {
        uint32_t ctr[4], key[2], out[4];
    } kat[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
         {0xffffffff, 0xffffffff},
         {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
         {0xa4093822, 0x299f31d0},
         {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (size_t i = 0; i < sizeof kat / sizeof kat[0]; i++) {
        uint32_t out[4];
        rng_philox4x32(kat[i].key, kat[i].ctr, out);
        for (int w = 0; w < 4; w++)
            CHECK_MSG(out[w] == kat[i].out[w], "vector %zu word %d: %08x, expected %08x", i, w,
                      out[w], kat[i].out[w]);
    }
}

/* rng_uniform's documented word layout: key from the seed, counter words
 * (counter, stream), 53 top bits of the first two output words. */
static void test_uniform_word_layout(void) {
    uint64_t seed = 0x0123456789abcdefULL, stream = 0xfedcba9876543210ULL, counter = 42;
    const uint32_t key[2] = {0x89abcdef, 0x01234567};
    const uint32_t ctr[4] = {42, 0, 0x76543210, 0xfedcba98};
    uint32_t out[4];
    rng_philox4x32(key, ctr, out);
    double expect = (double)((((uint64_t)out[1] << 32) | out[0]) >> 11) / 9007199254740992.0;
    CHECK(rng_uniform(seed, stream, counter) == expect);
}

static void test_uniform_range_and_resolution(void) {
    for (uint64_t i = 0; i < 100000; i++) {
        double u = rng_uniform(7, i % 5, i);
        CHECK(u >= 0.0 && u < 1.0);
        double scaled = u * 9007199254740992.0; /* 2^53 */
        CHECK(scaled == (double)(uint64_t)scaled);
        if (test_failures_in_current)
            break;
    }
}

static void test_streams_counters_seeds_differ(void) {
    double base = rng_uniform(1, 0, 0);
    CHECK(rng_uniform(1, 0, 0) == base);
    CHECK(rng_uniform(1, 1, 0) != base);
    CHECK(rng_uniform(1, 0, 1) != base);
    CHECK(rng_uniform(2, 0, 0) != base);
    /* Swapping stream and counter must not alias. */
    CHECK(rng_uniform(1, 3, 5) != rng_uniform(1, 5, 3));
    /* High words matter too. */
    CHECK(rng_uniform(1, 0, 1ULL << 32) != base);
    CHECK(rng_uniform(1, 1ULL << 32, 0) != base);
    CHECK(rng_uniform(1ULL << 32, 0, 0) != base);
    /* A run of counters on neighbouring streams has no repeats. */
    double prev[64];
    int repeats = 0;
    for (int s = 0; s < 4; s++)
        for (int c = 0; c < 16; c++) {
            double u = rng_uniform(99, (uint64_t)s, (uint64_t)c);
            for (int j = 0; j < s * 16 + c; j++)
                repeats += prev[j] == u;
            prev[s * 16 + c] = u;
        }
    CHECK(repeats == 0);
}

/* 1e5 draws into 100 bins: chi-square with 99 degrees of freedom has mean 99
 * and sd 14; the bound (about 6 sd) only catches a broken generator. The mean
 * and the lag-1 correlation are checked the same loose way. */
static void test_uniform_chi_square(void) {
    enum { N = 100000, BINS = 100 };
    int hist[BINS] = {0};
    double sum = 0, lag = 0, prev = 0;
    for (int i = 0; i < N; i++) {
        double u = rng_uniform(20240601, 3, (uint64_t)i);
        hist[(int)(u * BINS)]++;
        sum += u;
        if (i)
            lag += (u - 0.5) * (prev - 0.5);
        prev = u;
    }
    double expect = (double)N / BINS, chi2 = 0;
    for (int b = 0; b < BINS; b++)
        chi2 += (hist[b] - expect) * (hist[b] - expect) / expect;
    CHECK_MSG(chi2 < 185.0, "chi2 = %.1f", chi2);
    CHECK_NEAR(sum / N, 0.5, 0.005, 0);
    CHECK_NEAR(lag / (N - 1) * 12.0, 0.0, 0.02, 0); /* correlation: cov / (1/12) */
}

int main(void) {
    TEST_RUN(test_philox_known_answers);
    TEST_RUN(test_uniform_word_layout);
    TEST_RUN(test_uniform_range_and_resolution);
    TEST_RUN(test_streams_counters_seeds_differ);
    TEST_RUN(test_uniform_chi_square);
    return TEST_SUMMARY();
}
