/* Tests for kernels/cpu/conv_winograd.c: on every instruction set, the
 * Winograd F(2x2, 3x3) convolution matches a double-precision direct
 * correlation within a few ulps of the terms' magnitude, on odd and even
 * image sizes, pads 0 to 2 and channel counts that are not multiples of a
 * tile or a panel, with image rows of more and fewer tiles than a panel; a
 * block of tiles writes exactly its pixels; and an output's bytes do not
 * depend on how the tiles are cut into blocks. */
#include "kernels/cpu/conv_winograd.h"
#include "kernels/cpu/vec_isa.h"
#include "tests/test.h"

#include <stdlib.h>

static uint64_t rand_state = 0x2545F4914F6CDD1DULL;
static float rand_float(void) { return test_xorshift_float(&rand_state); }

#define GUARD 1e30f

typedef struct {
    int c_in, c_out, h, w, pad, ho, wo;
    float *in, *wt, *bias, *u;
} conv_case_t;

static conv_case_t case_new(int c_in, int c_out, int h, int w, int pad) {
    conv_case_t c = {c_in, c_out, h,    w,   pad, h + 2 * pad - 2, w + 2 * pad - 2,
                     NULL, NULL,  NULL, NULL};
    c.in = malloc(sizeof(float) * (size_t)c_in * h * w);
    c.wt = malloc(sizeof(float) * (size_t)c_out * c_in * 9);
    c.bias = malloc(sizeof(float) * (size_t)c_out);
    c.u = malloc(sizeof(float) * winograd_weight_floats(c_out, c_in));
    for (int i = 0; i < c_in * h * w; i++)
        c.in[i] = rand_float();
    for (int i = 0; i < c_out * c_in * 9; i++)
        c.wt[i] = rand_float();
    for (int i = 0; i < c_out; i++)
        c.bias[i] = rand_float();
    winograd_weights(c.u, c.wt, c_out, c_in);
    return c;
}

static void case_free(conv_case_t *c) {
    free(c->in);
    free(c->wt);
    free(c->bias);
    free(c->u);
}

/* out (c_out * ho * wo floats) from tiles cut in blocks of `block` tiles. */
static void conv_in_blocks(const conv_case_t *c, float *out, int block, int with_bias) {
    const int64_t tiles = winograd_tiles(c->ho, c->wo);
    float *scratch = malloc(sizeof(float) * winograd_scratch_floats(c->c_in, c->c_out, block));
    for (int64_t t0 = 0; t0 < tiles; t0 += block) {
        const int n = (int)(tiles - t0 < block ? tiles - t0 : block);
        winograd_conv3x3(out, c->in, c->u, with_bias ? c->bias : NULL, c->c_in, c->c_out, c->h,
                         c->w, c->pad, t0, n, scratch);
    }
    free(scratch);
}

/* Outputs off the direct correlation by more than 2^-20 of their terms'
 * magnitude (Winograd's transforms add at most 4 terms before and after the
 * product, so a few ulps of it). */
static int count_wrong(const conv_case_t *c, const float *out, int with_bias) {
    int bad = 0;
    for (int co = 0; co < c->c_out; co++)
        for (int y = 0; y < c->ho; y++)
            for (int x = 0; x < c->wo; x++) {
                double want = with_bias ? c->bias[co] : 0.0, mag = fabs(want);
                for (int ci = 0; ci < c->c_in; ci++)
                    for (int ky = 0; ky < 3; ky++)
                        for (int kx = 0; kx < 3; kx++) {
                            const int iy = y + ky - c->pad, ix = x + kx - c->pad;
                            if (iy < 0 || iy >= c->h || ix < 0 || ix >= c->w)
                                continue;
                            const double t =
                                (double)c->wt[((co * c->c_in + ci) * 3 + ky) * 3 + kx] *
                                c->in[(ci * c->h + iy) * c->w + ix];
                            want += t;
                            mag += fabs(t);
                        }
                const float got = out[((size_t)co * c->ho + y) * c->wo + x];
                if (!(fabs(got - want) <= 0x1p-20 * (mag + 1e-3))) {
                    if (!bad)
                        fprintf(stderr,
                                "  %s c_in=%d c_out=%d %dx%d pad %d: out[%d][%d][%d] = %.9g,"
                                " want %.9g\n",
                                vec_isa_name(vec_isa()), c->c_in, c->c_out, c->h, c->w, c->pad, co,
                                y, x, got, want);
                    bad++;
                }
            }
    return bad;
}

static void test_matches_the_direct_correlation(void) {
    static const int shapes[][5] = {
        /* c_in, c_out, h, w, pad */
        {1, 1, 3, 3, 0},    {3, 5, 4, 4, 1},   {8, 17, 7, 9, 1}, {19, 9, 11, 6, 1},
        {16, 16, 8, 40, 1}, {5, 33, 9, 37, 2}, {33, 4, 5, 5, 0}, {4, 50, 36, 36, 1},
    };
    for (int isa = 0; isa < VEC_N_ISA; isa++) {
        if (!vec_isa_use((vec_isa_t)isa)) {
            fprintf(stderr, "  (%s: not on this machine)\n", vec_isa_name(isa));
            continue;
        }
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            conv_case_t c =
                case_new(shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], shapes[s][4]);
            const size_t n = (size_t)c.c_out * c.ho * c.wo;
            float *out = malloc(sizeof(float) * n);
            for (int with_bias = 0; with_bias < 2; with_bias++) {
                conv_in_blocks(&c, out, 48, with_bias);
                CHECK_MSG(count_wrong(&c, out, with_bias) == 0, "%s shape %zu, bias %d",
                          vec_isa_name(isa), s, with_bias);
            }
            free(out);
            case_free(&c);
        }
    }
}

static void test_a_block_writes_exactly_its_pixels(void) {
    conv_case_t c = case_new(6, 7, 9, 13, 1); /* 9 x 13 output: 5 rows of 7 tiles, odd edges */
    const size_t n = (size_t)c.c_out * c.ho * c.wo;
    float *out = malloc(sizeof(float) * n);
    float *scratch = malloc(sizeof(float) * winograd_scratch_floats(c.c_in, c.c_out, 20));
    const int t0 = 9, count = 20; /* tiles 9..28: rows 1 to 4, partly */
    for (size_t i = 0; i < n; i++)
        out[i] = GUARD;
    winograd_conv3x3(out, c.in, c.u, c.bias, c.c_in, c.c_out, c.h, c.w, c.pad, t0, count, scratch);
    int wrong = 0;
    for (int co = 0; co < c.c_out; co++)
        for (int y = 0; y < c.ho; y++)
            for (int x = 0; x < c.wo; x++) {
                const int t = y / 2 * 7 + x / 2;
                const int inside = t >= t0 && t < t0 + count;
                wrong += inside == (out[((size_t)co * c.ho + y) * c.wo + x] == GUARD);
            }
    CHECK_MSG(wrong == 0, "%d pixels written outside tiles 9..28 or left unwritten inside", wrong);
    free(scratch);
    free(out);
    case_free(&c);
}

static void test_bytes_do_not_depend_on_the_blocks(void) {
    conv_case_t c = case_new(24, 40, 30, 34, 1);
    const size_t n = (size_t)c.c_out * c.ho * c.wo;
    float *one = malloc(sizeof(float) * n), *cut = malloc(sizeof(float) * n);
    conv_in_blocks(&c, one, (int)winograd_tiles(c.ho, c.wo), 1);
    static const int blocks[] = {1, 7, 16, 48, 100};
    for (size_t b = 0; b < sizeof blocks / sizeof *blocks; b++) {
        conv_in_blocks(&c, cut, blocks[b], 1);
        CHECK_MSG(memcmp(one, cut, sizeof(float) * n) == 0,
                  "blocks of %d tiles give other bytes than one block", blocks[b]);
    }
    free(one);
    free(cut);
    case_free(&c);
}

int main(void) {
    TEST_RUN(test_matches_the_direct_correlation);
    TEST_RUN(test_a_block_writes_exactly_its_pixels);
    TEST_RUN(test_bytes_do_not_depend_on_the_blocks);
    return TEST_SUMMARY();
}
