/* Tests for engine/format/png_io.c: round trips at odd sizes, byte-identical
 * re-encoding, an independent decode through libpng's simplified API, file
 * output and its errors, decoding every color type, and corrupt, truncated
 * and oversized input returning AR_ERR instead of crashing.
 * Run: gcc -std=c11 -D_GNU_SOURCE -I. tests/unit/test_png.c engine/format/png_io.c
 *      base/status.c -lpng && ./a.out */
#include "engine/format/png_io.h"
#include "tests/test.h"

#include <png.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static uint64_t rand_state = 12345;
static uint32_t rand_u32(void) {
    rand_state = rand_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rand_state >> 33);
}

static uint8_t *random_rgb(int w, int h) {
    uint8_t *p = malloc((size_t)w * h * 3);
    for (size_t i = 0; i < (size_t)w * h * 3; i++)
        p[i] = (uint8_t)rand_u32();
    return p;
}

static void test_round_trip_odd_sizes(void) {
    const int sizes[][2] = {{1, 1}, {37, 23}, {2, 301}, {301, 2}, {64, 64}, {1, 17}};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        int w = sizes[i][0], h = sizes[i][1];
        uint8_t *rgb = random_rgb(w, h), *png = NULL, *back = NULL;
        size_t len = 0;
        int bw = 0, bh = 0;
        ar_error_t err = {{0}};
        CHECK_MSG(png_encode(rgb, w, h, &png, &len, &err) == AR_OK, "%s", err.msg);
        CHECK(len > 8 && png_sig_cmp(png, 0, 8) == 0);
        CHECK_MSG(png_decode(png, len, &back, &bw, &bh, &err) == AR_OK, "%s", err.msg);
        CHECK(bw == w && bh == h);
        if (back)
            CHECK_MSG(memcmp(back, rgb, (size_t)w * h * 3) == 0, "%dx%d pixels differ", w, h);
        free(rgb);
        free(png);
        free(back);
    }
}

/* The same pixels give the same bytes, and a decoder we did not write (the
 * simplified API) reads them back exactly. */
static void test_deterministic_and_independently_readable(void) {
    int w = 37, h = 23;
    uint8_t *rgb = random_rgb(w, h), *a = NULL, *b = NULL;
    size_t la = 0, lb = 0;
    CHECK(png_encode(rgb, w, h, &a, &la, NULL) == AR_OK);
    CHECK(png_encode(rgb, w, h, &b, &lb, NULL) == AR_OK);
    CHECK(la == lb && a && b && memcmp(a, b, la) == 0);

    png_image img;
    memset(&img, 0, sizeof img);
    img.version = PNG_IMAGE_VERSION;
    CHECK(png_image_begin_read_from_memory(&img, a, la));
    CHECK(img.width == (png_uint_32)w && img.height == (png_uint_32)h);
    img.format = PNG_FORMAT_RGB;
    uint8_t *out = malloc(PNG_IMAGE_SIZE(img));
    CHECK(png_image_finish_read(&img, NULL, out, 0, NULL));
    CHECK(memcmp(out, rgb, (size_t)w * h * 3) == 0);
    png_image_free(&img);
    free(out);
    free(rgb);
    free(a);
    free(b);
}

static void test_write_file(void) {
    char path[] = "/tmp/arserve_test_png_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0)
        return;
    close(fd);
    int w = 5, h = 3;
    uint8_t *rgb = random_rgb(w, h), *mem = NULL, *back = NULL;
    size_t mem_len = 0;
    ar_error_t err = {{0}};
    CHECK_MSG(png_write_file(path, rgb, w, h, &err) == AR_OK, "%s", err.msg);
    CHECK(png_encode(rgb, w, h, &mem, &mem_len, NULL) == AR_OK);

    FILE *f = fopen(path, "rb");
    uint8_t file_buf[4096];
    size_t n = f ? fread(file_buf, 1, sizeof file_buf, f) : 0;
    if (f)
        fclose(f);
    CHECK(n == mem_len && memcmp(file_buf, mem, n) == 0);
    int bw, bh;
    CHECK(png_decode(file_buf, n, &back, &bw, &bh, &err) == AR_OK);
    CHECK(bw == w && bh == h && back && memcmp(back, rgb, (size_t)w * h * 3) == 0);
    unlink(path);

    /* A path that cannot be created: the message names it and the errno text. */
    const char *bad = "/nonexistent-arserve-dir/out.png";
    CHECK(png_write_file(bad, rgb, w, h, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, bad);
    CHECK_STR_CONTAINS(err.msg, "No such file or directory");
    /* Bad dimensions name the path too, and create nothing. */
    CHECK(png_write_file(path, rgb, 0, h, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, path);
    CHECK(access(path, F_OK) != 0);
    free(rgb);
    free(mem);
    free(back);
}

static void test_bad_dims_rejected(void) {
    static uint8_t px[16384 * 3];
    const int bad[][2] = {{0, 1},     {1, 0},     {-1, 5},         {5, -7},
                          {16385, 1}, {1, 16385}, {100000, 100000}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint8_t *out = (uint8_t *)"untouched";
        size_t len = 77;
        ar_error_t err = {{0}};
        CHECK(png_encode(px, bad[i][0], bad[i][1], &out, &len, &err) == AR_ERR);
        CHECK_STR_CONTAINS(err.msg, "1..16384");
        CHECK(len == 77 && strcmp((char *)out, "untouched") == 0);
    }
    /* The limits themselves are fine. */
    uint8_t *out = NULL;
    size_t len = 0;
    CHECK(png_encode(px, 16384, 1, &out, &len, NULL) == AR_OK);
    free(out);
    out = NULL;
    CHECK(png_encode(px, 1, 16384, &out, &len, NULL) == AR_OK);
    free(out);
    CHECK(png_encode(NULL, 1, 1, &out, &len, NULL) == AR_ERR);
}

static void check_decode_fails(const uint8_t *buf, size_t len, const char *what) {
    uint8_t *rgb = (uint8_t *)"untouched";
    int w = -5, h = -5;
    ar_error_t err = {{0}};
    int rc = png_decode(buf, len, &rgb, &w, &h, &err);
    CHECK_MSG(rc == AR_ERR, "%s: decoded", what);
    CHECK_MSG(strncmp(err.msg, "png_decode: ", 12) == 0 && strlen(err.msg) > 12,
              "%s: message \"%s\"", what, err.msg);
    CHECK(w == -5 && h == -5 && strcmp((char *)rgb, "untouched") == 0);
    if (rc == AR_OK)
        free(rgb);
}

static void test_truncated_and_garbage(void) {
    int w = 9, h = 7;
    uint8_t *rgb = random_rgb(w, h), *png = NULL;
    size_t len = 0;
    CHECK(png_encode(rgb, w, h, &png, &len, NULL) == AR_OK);
    char what[64];
    /* Every proper prefix, including ones that end inside IEND. */
    for (size_t cut = 0; cut < len; cut++) {
        snprintf(what, sizeof what, "prefix of %zu/%zu bytes", cut, len);
        check_decode_fails(png, cut, what);
    }
    /* Every single-byte corruption after the signature breaks a CRC or a
     * length (our encoder writes only critical chunks), so each is an error. */
    int failures = 0;
    for (size_t i = 8; i < len; i++) {
        uint8_t *bad = malloc(len);
        memcpy(bad, png, len);
        bad[i] ^= 0x5a;
        uint8_t *out = NULL;
        int bw = 0, bh = 0;
        ar_error_t err = {{0}};
        if (png_decode(bad, len, &out, &bw, &bh, &err) == AR_OK) {
            CHECK(bw == w && bh == h);
            free(out);
        } else {
            failures++;
            CHECK(err.msg[0] != '\0');
        }
        free(bad);
    }
    CHECK_MSG(failures == (int)(len - 8), "%d of %zu corruptions detected", failures, len - 8);
    /* Pure garbage, and garbage behind a valid signature. */
    uint8_t junk[512];
    for (int trial = 0; trial < 200; trial++) {
        for (size_t i = 0; i < sizeof junk; i++)
            junk[i] = (uint8_t)rand_u32();
        if (trial % 2)
            memcpy(junk, png, 8);
        if (trial % 4 == 3)
            memcpy(junk, png, 33); /* signature and a valid IHDR */
        snprintf(what, sizeof what, "garbage trial %d", trial);
        check_decode_fails(junk, sizeof junk, what);
    }
    check_decode_fails((const uint8_t *)"", 0, "empty");
    free(rgb);
    free(png);
}

/* CRC-32 as PNG defines it, for hand-built chunks. */
static uint32_t crc32_png(const uint8_t *p, size_t n) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1)));
    }
    return c ^ 0xffffffffu;
}

static void put_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* Signature, IHDR with the given size (8-bit RGB), one empty IDAT, IEND. */
static size_t header_only_png(uint8_t *buf, uint32_t w, uint32_t h) {
    static const uint8_t sig[8] = {137, 80, 78, 71, 13, 10, 26, 10};
    size_t n = 0;
    memcpy(buf, sig, 8);
    n = 8;
    put_be32(buf + n, 13);
    memcpy(buf + n + 4, "IHDR", 4);
    put_be32(buf + n + 8, w);
    put_be32(buf + n + 12, h);
    buf[n + 16] = 8; /* depth */
    buf[n + 17] = 2; /* RGB */
    buf[n + 18] = buf[n + 19] = buf[n + 20] = 0;
    put_be32(buf + n + 21, crc32_png(buf + n + 4, 17));
    n += 25;
    put_be32(buf + n, 0);
    memcpy(buf + n + 4, "IDAT", 4);
    put_be32(buf + n + 8, crc32_png(buf + n + 4, 4));
    n += 12;
    put_be32(buf + n, 0);
    memcpy(buf + n + 4, "IEND", 4);
    put_be32(buf + n + 8, crc32_png(buf + n + 4, 4));
    return n + 12;
}

static void test_oversized_rejected(void) {
    uint8_t buf[64];
    ar_error_t err = {{0}};
    uint8_t *rgb = NULL;
    int w, h;
    /* Too wide for the per-side cap (libpng's user limit catches it). */
    size_t n = header_only_png(buf, 20000, 1);
    CHECK(png_decode(buf, n, &rgb, &w, &h, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "IHDR");
    /* Within the per-side cap but over the pixel cap: refused before any
     * allocation, with our own message. */
    n = header_only_png(buf, 16384, 16384);
    CHECK(png_decode(buf, n, &rgb, &w, &h, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "16384x16384");
    CHECK_STR_CONTAINS(err.msg, "limit");
    /* A small valid header with no image data is an error, not a crash. */
    n = header_only_png(buf, 4, 4);
    CHECK(png_decode(buf, n, &rgb, &w, &h, &err) == AR_ERR);
    CHECK(err.msg[0] != '\0');
    /* The builder itself is right: a zero-width header is refused by libpng. */
    n = header_only_png(buf, 0, 4);
    CHECK(png_decode(buf, n, &rgb, &w, &h, &err) == AR_ERR);
}

/* ---- decoding other color types, written with libpng's low-level API ---- */

typedef struct raw_image {
    int w, h, color, depth, interlace;
    uint8_t *packed; /* rows as libpng wants them */
    size_t stride;
    png_color palette[16];
    png_byte trns[16];
    int npalette, ntrns;
} raw_image_t;

/* The setjmp frame has no locals that change, so nothing is clobbered. */
static int raw_write(const raw_image_t *im, FILE *f) {
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    if (!info)
        return 0;
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_write_struct(&png, &info);
        return 0;
    }
    png_init_io(png, f);
    png_set_IHDR(png, info, (png_uint_32)im->w, (png_uint_32)im->h, im->depth, im->color,
                 im->interlace, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    if (im->npalette)
        png_set_PLTE(png, info, im->palette, im->npalette);
    if (im->ntrns)
        png_set_tRNS(png, info, im->trns, im->ntrns, NULL);
    png_write_info(png, info);
    int passes = png_set_interlace_handling(png);
    for (int pass = 0; pass < passes; pass++)
        for (int y = 0; y < im->h; y++)
            png_write_row(png, im->packed + (size_t)y * im->stride);
    png_write_end(png, info);
    png_destroy_write_struct(&png, &info);
    return 1;
}

static int channels_of(int color) {
    switch (color) {
    case PNG_COLOR_TYPE_GRAY:
    case PNG_COLOR_TYPE_PALETTE:
        return 1;
    case PNG_COLOR_TYPE_GRAY_ALPHA:
        return 2;
    case PNG_COLOR_TYPE_RGB:
        return 3;
    default:
        return 4;
    }
}

/* Builds a random image of the given type, encodes it with raw_write and
 * checks that png_decode gives the RGB we expect. */
static void check_color_type(int color, int depth, int interlace) {
    const int w = 13, h = 11, ch = channels_of(color);
    raw_image_t im;
    memset(&im, 0, sizeof im);
    im.w = w;
    im.h = h;
    im.color = color;
    im.depth = depth;
    im.interlace = interlace;
    im.stride = ((size_t)w * ch * depth + 7) / 8;
    im.packed = calloc((size_t)h, im.stride);
    uint8_t *expect = malloc((size_t)w * h * 3);
    const int maxv = (1 << depth) - 1;
    if (color == PNG_COLOR_TYPE_PALETTE) {
        im.npalette = depth == 8 ? 16 : (1 << depth);
        for (int i = 0; i < im.npalette; i++) {
            im.palette[i].red = (png_byte)rand_u32();
            im.palette[i].green = (png_byte)rand_u32();
            im.palette[i].blue = (png_byte)rand_u32();
            im.trns[i] = (png_byte)(i * 16);
        }
        im.ntrns = im.npalette;
    }
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) {
            uint8_t *px = expect + ((size_t)y * w + x) * 3;
            for (int c = 0; c < ch; c++) {
                int limit = color == PNG_COLOR_TYPE_PALETTE ? im.npalette - 1 : maxv;
                int v = (int)(rand_u32() % (uint32_t)(limit + 1));
                /* Pack sample v at bit position (x * ch + c) * depth, MSB first. */
                size_t bit = ((size_t)x * ch + c) * depth;
                uint8_t *row = im.packed + (size_t)y * im.stride;
                if (depth == 16) {
                    row[bit / 8] = (uint8_t)(v >> 8);
                    row[bit / 8 + 1] = (uint8_t)v;
                } else {
                    row[bit / 8] |= (uint8_t)(v << (8 - depth - bit % 8));
                }
                int v8 = depth == 16 ? v >> 8 : v * 255 / maxv; /* libpng's expansion */
                if (color == PNG_COLOR_TYPE_PALETTE) {
                    px[0] = im.palette[v].red;
                    px[1] = im.palette[v].green;
                    px[2] = im.palette[v].blue;
                } else if (ch <= 2 && c == 0) {
                    px[0] = px[1] = px[2] = (uint8_t)v8;
                } else if (ch >= 3 && c < 3) {
                    px[c] = (uint8_t)v8;
                }
            }
        }
    char *mem = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&mem, &len);
    int wrote = f && raw_write(&im, f);
    if (f)
        fclose(f);
    CHECK_MSG(wrote, "color %d depth %d: libpng could not write the fixture", color, depth);
    uint8_t *rgb = NULL;
    int bw = 0, bh = 0;
    ar_error_t err = {{0}};
    int rc = wrote ? png_decode((const uint8_t *)mem, len, &rgb, &bw, &bh, &err) : AR_ERR;
    CHECK_MSG(rc == AR_OK, "color %d depth %d interlace %d: %s", color, depth, interlace, err.msg);
    if (rc == AR_OK) {
        CHECK(bw == w && bh == h);
        CHECK_MSG(memcmp(rgb, expect, (size_t)w * h * 3) == 0,
                  "color %d depth %d interlace %d: pixels differ", color, depth, interlace);
    }
    free(rgb);
    free(mem);
    free(expect);
    free(im.packed);
}

static void test_decode_color_types(void) {
    check_color_type(PNG_COLOR_TYPE_GRAY, 8, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_GRAY, 1, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_GRAY, 2, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_GRAY, 4, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_GRAY, 16, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_GRAY_ALPHA, 8, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_GRAY_ALPHA, 16, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_PALETTE, 8, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_PALETTE, 4, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_PALETTE, 1, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_RGB, 8, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_RGB, 16, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_RGB_ALPHA, 8, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_RGB_ALPHA, 16, PNG_INTERLACE_NONE);
    check_color_type(PNG_COLOR_TYPE_RGB, 8, PNG_INTERLACE_ADAM7);
    check_color_type(PNG_COLOR_TYPE_PALETTE, 2, PNG_INTERLACE_ADAM7);
    check_color_type(PNG_COLOR_TYPE_GRAY_ALPHA, 8, PNG_INTERLACE_ADAM7);
}

int main(void) {
    TEST_RUN(test_round_trip_odd_sizes);
    TEST_RUN(test_deterministic_and_independently_readable);
    TEST_RUN(test_write_file);
    TEST_RUN(test_bad_dims_rejected);
    TEST_RUN(test_truncated_and_garbage);
    TEST_RUN(test_oversized_rejected);
    TEST_RUN(test_decode_color_types);
    return TEST_SUMMARY();
}
