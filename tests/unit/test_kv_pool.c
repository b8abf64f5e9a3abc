/* The paged KV pool: block-size choice, reserve and exhaustion (which
 * changes nothing), compaction through the backend's gather (rows land
 * where the keep list says, whole blocks come back), release, double frees
 * caught as errors, and a random walk of many heads checked against a host
 * model of who owns which token after every operation. */
#include <stdlib.h>
#include <string.h>

#include "engine/kv/kv_pool.h"
#include "tests/test.h"

static backend_t *be;

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static uint64_t rng_next(void) { /* xorshift64 */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static int rng_below(int n) { return (int)(rng_next() % (uint64_t)n); }

static void test_block_tokens_keep_last_block_under_5_percent(void) {
    /* 20 (bt - 1) < budget for the chosen bt, not for 2 bt. */
    static const int cases[][2] = {{-5, 1},  {0, 1},    {1, 1},     {20, 1},           {21, 2},
                                   {32, 2},  {60, 2},   {61, 4},    {72, 4},           {140, 4},
                                   {141, 8}, {301, 16}, {1000, 32}, {1 << 30, 1 << 20}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const int got = kv_pool_choose_block_tokens(cases[i][0]);
        CHECK_MSG(got == cases[i][1], "budget %d tokens: block_tokens %d, expected %d", cases[i][0],
                  got, cases[i][1]);
        CHECK((got & (got - 1)) == 0);
        CHECK(cases[i][0] <= 20 || 20 * (got - 1) < cases[i][0]);
    }
    /* The demo model (16 x 16 grid) and Janus-Pro (24 x 24) at budget 1/8. */
    CHECK(kv_pool_choose_block_tokens(256 / 8) == 2);
    CHECK(kv_pool_choose_block_tokens(576 / 8) == 4);
}

static void test_init_rejects_bad_sizes(void) {
    kv_pool_t p;
    ar_error_t err = {{0}};
    CHECK(kv_pool_init(&p, be, 0, 4, 16, DTYPE_F32, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "smaller than one block");
    CHECK(kv_pool_init(&p, be, 4, 0, 16, DTYPE_F32, &err) == AR_ERR);
    CHECK(kv_pool_init(&p, be, 4, 4, -1, DTYPE_F32, &err) == AR_ERR);
    CHECK(kv_pool_init(&p, be, 3, 4, 16, DTYPE_F32, &err) == AR_OK);
    CHECK(p.n_blocks == 3 && kv_pool_blocks_in_use(&p) == 0);
    CHECK(kv_pool_block_bytes(4, 16, DTYPE_F32) == 2 * 4 * 16 * sizeof(float));
    CHECK(kv_pool_capacity_bytes(&p) == 3 * kv_pool_block_bytes(4, 16, DTYPE_F32));
    kv_pool_free(&p);
}

/* Reserve allocates whole blocks, only what the new length needs beyond
 * what the head holds; when the pool cannot give them all, nothing moves. */
static void test_reserve_whole_blocks_and_exhaustion_changes_nothing(void) {
    kv_pool_t p;
    ar_error_t err = {{0}};
    CHECK(kv_pool_init(&p, be, 5, 4, 8, DTYPE_F32, &err) == AR_OK);
    kv_head_t a = {0}, b = {0};
    CHECK(kv_head_reserve(&p, &a, 0, &err) == AR_OK && a.n_blocks == 0);
    CHECK(kv_head_reserve(&p, &a, 1, &err) == AR_OK && a.n_blocks == 1);
    a.len = 1;
    CHECK(kv_head_reserve(&p, &a, 4, &err) == AR_OK && a.n_blocks == 1);
    CHECK(kv_head_reserve(&p, &a, 9, &err) == AR_OK && a.n_blocks == 3);
    a.len = 9;
    CHECK(kv_pool_blocks_in_use(&p) == 3 &&
          kv_pool_used_bytes(&p) == 3 * kv_pool_block_bytes(4, 8, DTYPE_F32));
    CHECK(kv_head_reserve(&p, &b, 8, &err) == AR_OK && b.n_blocks == 2);
    CHECK(p.peak_in_use == 5 && p.n_free == 0);
    /* Exhausted: a third block for b is refused and b is as it was. */
    int before[2] = {b.blocks[0], b.blocks[1]};
    err.msg[0] = 0;
    CHECK(kv_head_reserve(&p, &b, 9, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "KV pool exhausted");
    CHECK(b.n_blocks == 2 && b.blocks[0] == before[0] && b.blocks[1] == before[1]);
    CHECK(kv_pool_blocks_in_use(&p) == 5);
    /* Every block is owned exactly once. */
    int owned[5] = {0};
    for (int i = 0; i < a.n_blocks; i++)
        owned[a.blocks[i]]++;
    for (int i = 0; i < b.n_blocks; i++)
        owned[b.blocks[i]]++;
    for (int i = 0; i < 5; i++)
        CHECK(owned[i] == 1 && p.in_use[i]);
    /* Trim returns what a head's length does not need. */
    a.len = 5;
    kv_head_trim(&p, &a);
    CHECK(a.n_blocks == 2 && kv_pool_blocks_in_use(&p) == 4);
    kv_pool_reset_peak(&p);
    CHECK(p.peak_in_use == 4);
    CHECK(kv_head_release(&p, &a, &err) == AR_OK && a.blocks == NULL && a.n_blocks == 0);
    CHECK(kv_head_release(&p, &b, &err) == AR_OK);
    CHECK(kv_pool_blocks_in_use(&p) == 0 && p.bad_frees == 0);
    kv_pool_free(&p);
}

static void test_double_free_is_an_error_not_a_crash(void) {
    kv_pool_t p;
    ar_error_t err = {{0}};
    CHECK(kv_pool_init(&p, be, 4, 2, 4, DTYPE_F32, &err) == AR_OK);
    kv_head_t a = {0};
    CHECK(kv_head_reserve(&p, &a, 4, &err) == AR_OK);
    kv_head_t copy = a; /* a second owner of the same blocks: a bug */
    copy.blocks = malloc(2 * sizeof(int));
    memcpy(copy.blocks, a.blocks, 2 * sizeof(int));
    CHECK(kv_head_release(&p, &a, &err) == AR_OK);
    CHECK(kv_pool_blocks_in_use(&p) == 0);
    err.msg[0] = 0;
    CHECK(kv_head_release(&p, &copy, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "double free");
    CHECK(p.bad_frees == 2 && p.n_free == 4);
    /* The pool still works: all four blocks can be taken once, no more. */
    kv_head_t b = {0};
    CHECK(kv_head_reserve(&p, &b, 8, &err) == AR_OK && kv_pool_blocks_in_use(&p) == 4);
    CHECK(kv_head_reserve(&p, &b, 9, &err) == AR_ERR);
    /* A block id the pool never had is reported the same way. */
    kv_head_t bogus = {.len = 1, .n_blocks = 1, .cap = 1, .blocks = malloc(sizeof(int))};
    bogus.blocks[0] = 99;
    CHECK(kv_head_release(&p, &bogus, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "not a block of the pool");
    CHECK(kv_head_release(&p, &b, &err) == AR_OK && p.bad_frees == 3);
    kv_pool_free(&p);
}

/* Each token's K row holds (tag, index, ...), its V row (-tag, index, ...),
 * so a row's identity can be read back from the pool. */
static void write_token(kv_pool_t *p, const kv_head_t *h, int j, float tag) {
    const int bt = p->blocks.block_tokens, hd = p->blocks.head_dim;
    float row[64];
    for (int e = 0; e < hd; e++)
        row[e] = tag + (float)e * 0.001f;
    float *k = (float *)p->blocks.base + ((size_t)h->blocks[j / bt] * 2 * bt + j % bt) * hd;
    be->upload(be, k, row, (size_t)hd * sizeof(float));
    for (int e = 0; e < hd; e++)
        row[e] = -row[e];
    be->upload(be, k + (size_t)bt * hd, row, (size_t)hd * sizeof(float));
}

static int token_ok(kv_pool_t *p, const kv_head_t *h, int j, float tag) {
    const int bt = p->blocks.block_tokens, hd = p->blocks.head_dim;
    float k[64], v[64];
    const float *at =
        (const float *)p->blocks.base + ((size_t)h->blocks[j / bt] * 2 * bt + j % bt) * hd;
    be->download(be, k, at, (size_t)hd * sizeof(float));
    be->download(be, v, at + (size_t)bt * hd, (size_t)hd * sizeof(float));
    for (int e = 0; e < hd; e++)
        if (k[e] != tag + (float)e * 0.001f || v[e] != -(tag + (float)e * 0.001f))
            return 0;
    return 1;
}

static void test_compact_moves_rows_and_returns_whole_blocks(void) {
    kv_pool_t p;
    ar_error_t err = {{0}};
    CHECK(kv_pool_init(&p, be, 8, 3, 5, DTYPE_F32, &err) == AR_OK);
    kv_head_t h = {0};
    CHECK(kv_head_reserve(&p, &h, 11, &err) == AR_OK && h.n_blocks == 4);
    h.len = 11;
    for (int j = 0; j < 11; j++)
        write_token(&p, &h, j, (float)(100 + j));
    float mass_host[11];
    for (int j = 0; j < 11; j++)
        mass_host[j] = (float)j;
    float *mass = be->alloc(be, sizeof mass_host);
    be->upload(be, mass, mass_host, sizeof mass_host);
    const int keep[] = {0, 1, 5, 9, 10};
    CHECK(kv_head_compact(&p, &h, keep, 5, mass, &err) == AR_OK);
    CHECK(h.len == 5 && h.n_blocks == 2 && kv_pool_blocks_in_use(&p) == 2);
    for (int i = 0; i < 5; i++)
        CHECK_MSG(token_ok(&p, &h, i, (float)(100 + keep[i])), "row %d", i);
    be->download(be, mass_host, mass, sizeof mass_host);
    for (int i = 0; i < 5; i++)
        CHECK(mass_host[i] == (float)keep[i]);
    /* Bad keep lists are refused with nothing changed. */
    const int unsorted[] = {0, 2, 1}, too_far[] = {0, 5}, dup[] = {1, 1};
    CHECK(kv_head_compact(&p, &h, unsorted, 3, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "strictly ascending");
    CHECK(kv_head_compact(&p, &h, too_far, 2, NULL, &err) == AR_ERR);
    CHECK(kv_head_compact(&p, &h, dup, 2, NULL, &err) == AR_ERR);
    CHECK(kv_head_compact(&p, &h, keep, 6, NULL, &err) == AR_ERR);
    CHECK(h.len == 5 && h.n_blocks == 2);
    for (int i = 0; i < 5; i++)
        CHECK(token_ok(&p, &h, i, (float)(100 + keep[i])));
    /* Keeping everything moves nothing; keeping nothing frees every block. */
    const int all[] = {0, 1, 2, 3, 4};
    CHECK(kv_head_compact(&p, &h, all, 5, NULL, &err) == AR_OK && h.n_blocks == 2);
    CHECK(kv_head_compact(&p, &h, NULL, 0, NULL, &err) == AR_OK);
    CHECK(h.len == 0 && h.n_blocks == 0 && kv_pool_blocks_in_use(&p) == 0);
    CHECK(kv_head_release(&p, &h, &err) == AR_OK);
    be->free(be, mass);
    kv_pool_free(&p);
}

/* Many heads grow, shrink and go away in random order, so their tables
 * interleave over the pool. A host model of each head's tokens (their tags)
 * is compared with the pool after every operation, and the accounting
 * (blocks per head = ceil(len / bt), in-use = sum, every block owned once)
 * checked throughout. */
static void test_random_heads_against_a_host_model(void) {
    static const int sizes[] = {1, 3, 16};
    for (int c = 0; c < 3; c++) {
        enum { HEADS = 6, MAXLEN = 60, OPS = 400 };
        const int bt = sizes[c];
        const int n_blocks = HEADS * ((MAXLEN + bt - 1) / bt) / 4; /* too few for all at max */
        kv_pool_t p;
        ar_error_t err = {{0}};
        CHECK(kv_pool_init(&p, be, n_blocks, bt, 4, DTYPE_F32, &err) == AR_OK);
        kv_head_t h[HEADS] = {{0}};
        float tags[HEADS][MAXLEN];
        float next_tag = 1;
        int refused = 0, bad = 0;
        for (int op = 0; op < OPS; op++) {
            const int i = rng_below(HEADS), what = rng_below(10);
            if (what < 7) { /* append 1..7 tokens */
                int n = 1 + rng_below(7);
                if (h[i].len + n > MAXLEN)
                    n = MAXLEN - h[i].len;
                const int in_use = kv_pool_blocks_in_use(&p), had = h[i].n_blocks;
                if (kv_head_reserve(&p, &h[i], h[i].len + n, &err) != AR_OK) {
                    refused++;
                    CHECK(kv_pool_blocks_in_use(&p) == in_use && h[i].n_blocks == had);
                    continue;
                }
                for (int j = h[i].len; j < h[i].len + n; j++) {
                    tags[i][j] = next_tag++;
                    write_token(&p, &h[i], j, tags[i][j]);
                }
                h[i].len += n;
            } else if (what < 9) { /* compact to a random subset */
                int keep[MAXLEN], n_keep = 0;
                for (int j = 0; j < h[i].len; j++)
                    if (rng_below(3))
                        keep[n_keep++] = j;
                CHECK(kv_head_compact(&p, &h[i], keep, n_keep, NULL, &err) == AR_OK);
                for (int j = 0; j < n_keep; j++)
                    tags[i][j] = tags[i][keep[j]];
            } else {
                CHECK(kv_head_release(&p, &h[i], &err) == AR_OK);
            }
            int total = 0;
            int *owner = calloc((size_t)n_blocks, sizeof *owner);
            for (int k = 0; k < HEADS; k++) {
                CHECK(h[k].n_blocks == (h[k].len + bt - 1) / bt);
                total += h[k].n_blocks;
                for (int b = 0; b < h[k].n_blocks; b++) {
                    owner[h[k].blocks[b]]++;
                    CHECK(p.in_use[h[k].blocks[b]]);
                }
                for (int j = 0; j < h[k].len; j++)
                    bad += !token_ok(&p, &h[k], j, tags[k][j]);
            }
            for (int b = 0; b < n_blocks; b++)
                CHECK(owner[b] <= 1 && owner[b] == p.in_use[b]);
            CHECK(total == kv_pool_blocks_in_use(&p));
            free(owner);
        }
        CHECK_MSG(bad == 0, "block_tokens %d: %d token rows read back wrong", bt, bad);
        CHECK_MSG(refused > 0, "block_tokens %d: the walk never exhausted the pool", bt);
        for (int k = 0; k < HEADS; k++)
            CHECK(kv_head_release(&p, &h[k], &err) == AR_OK);
        CHECK(kv_pool_blocks_in_use(&p) == 0 && p.bad_frees == 0);
        kv_pool_free(&p);
    }
}

int main(void) {
    ar_error_t err = {{0}};
    be = backend_cpu_create(1, &err);
    if (!be) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    TEST_RUN(test_block_tokens_keep_last_block_under_5_percent);
    TEST_RUN(test_init_rejects_bad_sizes);
    TEST_RUN(test_reserve_whole_blocks_and_exhaustion_changes_nothing);
    TEST_RUN(test_double_free_is_an_error_not_a_crash);
    TEST_RUN(test_compact_moves_rows_and_returns_whole_blocks);
    TEST_RUN(test_random_heads_against_a_host_model);
    be->destroy(be);
    return TEST_SUMMARY();
}
