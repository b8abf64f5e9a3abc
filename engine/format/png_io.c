/* PNG in and out of memory through libpng. libpng reports errors by
 * longjmp: each entry point keeps its changing state in a job struct owned by
 * the caller's frame, so nothing local to the setjmp frame is clobbered. */
#include "engine/format/png_io.h"

#include <errno.h>
#include <png.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* libpng's error pointer: where the error callback leaves its message. */
typedef struct png_io_error {
    char msg[256];
} png_io_error_t;

static void png_io_on_error(png_structp png, png_const_charp msg) {
    png_io_error_t *e = png_get_error_ptr(png);
    snprintf(e->msg, sizeof e->msg, "%s", msg ? msg : "unknown libpng error");
    png_longjmp(png, 1);
}

/* Warnings (a bad ancillary chunk CRC, an odd iCCP profile) are not the
 * caller's problem and must not reach a daemon's stderr. */
static void png_io_on_warning(png_structp png, png_const_charp msg) {
    (void)png;
    (void)msg;
}

/* ---- encoding ---- */

typedef struct png_write_job {
    png_io_error_t err; /* first: libpng's error pointer */
    png_structp png;
    png_infop info;
    uint8_t *buf; /* the encoded bytes so far */
    size_t len, cap;
} png_write_job_t;

static void png_io_sink_write(png_structp png, png_bytep data, size_t n) {
    png_write_job_t *job = png_get_io_ptr(png);
    if (n > SIZE_MAX - job->len)
        png_error(png, "encoded size overflows size_t");
    if (job->len + n > job->cap) {
        size_t cap = job->cap ? job->cap : 4096;
        while (cap < job->len + n)
            cap = cap > SIZE_MAX / 2 ? job->len + n : cap * 2;
        uint8_t *grown = realloc(job->buf, cap);
        if (!grown)
            png_error(png, "out of memory for the encoded image");
        job->buf = grown;
        job->cap = cap;
    }
    memcpy(job->buf + job->len, data, n);
    job->len += n;
}

static void png_io_sink_flush(png_structp png) { (void)png; }

static void png_io_encode_body(png_write_job_t *job, const uint8_t *rgb, int width, int height) {
    png_set_write_fn(job->png, job, png_io_sink_write, png_io_sink_flush);
    png_set_IHDR(job->png, job->info, (png_uint_32)width, (png_uint_32)height, 8,
                 PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
                 PNG_FILTER_TYPE_DEFAULT);
    png_write_info(job->png, job->info);
    const size_t stride = (size_t)width * 3;
    for (int y = 0; y < height; y++)
        png_write_row(job->png, rgb + (size_t)y * stride);
    png_write_end(job->png, NULL);
}

/* The setjmp frame: no locals, so a longjmp back here clobbers nothing. */
static int png_io_encode_guarded(png_write_job_t *job, const uint8_t *rgb, int width, int height) {
    if (setjmp(png_jmpbuf(job->png)))
        return AR_ERR;
    png_io_encode_body(job, rgb, width, height);
    return AR_OK;
}

int png_encode(const uint8_t *rgb, int width, int height, uint8_t **out, size_t *out_len,
               ar_error_t *err) {
    if (!rgb || !out || !out_len)
        return ar_errorf(err, "png_encode: null argument");
    if (width < 1 || width > PNG_IO_MAX_DIM || height < 1 || height > PNG_IO_MAX_DIM)
        return ar_errorf(err, "png_encode: %dx%d: width and height must be in 1..%d", width, height,
                         PNG_IO_MAX_DIM);
    png_write_job_t job;
    memset(&job, 0, sizeof job);
    job.png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &job.err, png_io_on_error,
                                      png_io_on_warning);
    if (!job.png)
        return ar_errorf(err, "png_encode: cannot create a libpng write struct");
    job.info = png_create_info_struct(job.png);
    int rc = AR_ERR;
    if (job.info)
        rc = png_io_encode_guarded(&job, rgb, width, height);
    else
        snprintf(job.err.msg, sizeof job.err.msg, "cannot create a libpng info struct");
    png_destroy_write_struct(&job.png, &job.info);
    if (rc != AR_OK) {
        free(job.buf);
        return ar_errorf(err, "png_encode: %dx%d: %s", width, height, job.err.msg);
    }
    *out = job.buf;
    *out_len = job.len;
    return AR_OK;
}

int png_write_file(const char *path, const uint8_t *rgb, int width, int height, ar_error_t *err) {
    uint8_t *bytes = NULL;
    size_t n = 0;
    if (!path)
        return ar_errorf(err, "png_write_file: null path");
    if (png_encode(rgb, width, height, &bytes, &n, err) != AR_OK)
        return ar_error_prefix(err, "%s", path);
    FILE *f = fopen(path, "wb");
    if (!f) {
        int e = errno;
        free(bytes);
        return ar_errorf(err, "%s: cannot open for writing: %s", path, strerror(e));
    }
    errno = 0;
    int write_errno = fwrite(bytes, 1, n, f) == n ? 0 : (errno ? errno : EIO);
    free(bytes);
    errno = 0;
    int close_errno = fclose(f) == 0 ? 0 : (errno ? errno : EIO);
    if (write_errno || close_errno) {
        remove(path);
        return ar_errorf(err, "%s: %s failed: %s", path, write_errno ? "write" : "close",
                         strerror(write_errno ? write_errno : close_errno));
    }
    return AR_OK;
}

/* ---- decoding ---- */

typedef struct png_read_job {
    png_io_error_t err; /* first: libpng's error pointer */
    png_structp png;
    png_infop info;
    const uint8_t *src;
    size_t src_len, src_pos;
    uint8_t *pixels; /* owned until handed to the caller */
    png_bytep *rows;
    png_uint_32 width, height;
} png_read_job_t;

static void png_io_source_read(png_structp png, png_bytep data, size_t n) {
    png_read_job_t *job = png_get_io_ptr(png);
    if (n > job->src_len - job->src_pos)
        png_error(png, "unexpected end of data (truncated PNG)");
    memcpy(data, job->src + job->src_pos, n);
    job->src_pos += n;
}

/* Returns AR_OK, or AR_ERR with job->err filled; libpng's own errors leave
 * through the longjmp instead. */
static int png_io_decode_body(png_read_job_t *job) {
    png_structp png = job->png;
    png_infop info = job->info;
    png_set_read_fn(png, job, png_io_source_read);
    png_set_user_limits(png, PNG_IO_MAX_DIM, PNG_IO_MAX_DIM);
    png_read_info(png, info);

    png_uint_32 w = png_get_image_width(png, info), h = png_get_image_height(png, info);
    if (w < 1 || h < 1 || w > PNG_IO_MAX_DIM || h > PNG_IO_MAX_DIM ||
        (size_t)w * h > PNG_IO_MAX_PIXELS) {
        snprintf(job->err.msg, sizeof job->err.msg,
                 "%lux%lu image is over the limit (%d per side, %zu pixels)", (unsigned long)w,
                 (unsigned long)h, PNG_IO_MAX_DIM, PNG_IO_MAX_PIXELS);
        return AR_ERR;
    }
    int color = png_get_color_type(png, info), depth = png_get_bit_depth(png, info);
    if (color == PNG_COLOR_TYPE_PALETTE)
        png_set_palette_to_rgb(png);
    if (color == PNG_COLOR_TYPE_GRAY && depth < 8)
        png_set_expand_gray_1_2_4_to_8(png);
    if (depth == 16)
        png_set_strip_16(png);
    png_set_strip_alpha(png); /* acts only on rows that carry alpha */
    if (!(color & PNG_COLOR_MASK_COLOR))
        png_set_gray_to_rgb(png);
    png_set_interlace_handling(png);
    png_read_update_info(png, info);
    if (png_get_channels(png, info) != 3 || png_get_bit_depth(png, info) != 8 ||
        png_get_rowbytes(png, info) != (size_t)w * 3) {
        snprintf(job->err.msg, sizeof job->err.msg,
                 "color type %d at %d bits did not convert to 8-bit RGB", color, depth);
        return AR_ERR;
    }

    job->pixels = malloc((size_t)w * h * 3);
    job->rows = malloc((size_t)h * sizeof *job->rows);
    if (!job->pixels || !job->rows) {
        snprintf(job->err.msg, sizeof job->err.msg, "out of memory for a %lux%lu image",
                 (unsigned long)w, (unsigned long)h);
        return AR_ERR;
    }
    for (png_uint_32 y = 0; y < h; y++)
        job->rows[y] = job->pixels + (size_t)y * w * 3;
    png_read_image(png, job->rows);
    png_read_end(png, NULL); /* checks the chunks after the image, up to IEND */
    job->width = w;
    job->height = h;
    return AR_OK;
}

/* The setjmp frame: no locals, so a longjmp back here clobbers nothing. */
static int png_io_decode_guarded(png_read_job_t *job) {
    if (setjmp(png_jmpbuf(job->png)))
        return AR_ERR;
    return png_io_decode_body(job);
}

int png_decode(const uint8_t *buf, size_t len, uint8_t **rgb, int *width, int *height,
               ar_error_t *err) {
    if (!buf || !rgb || !width || !height)
        return ar_errorf(err, "png_decode: null argument");
    if (len < 8 || png_sig_cmp(buf, 0, 8) != 0)
        return ar_errorf(err, "png_decode: not a PNG (%s)",
                         len < 8 ? "shorter than the signature" : "bad signature");
    png_read_job_t job;
    memset(&job, 0, sizeof job);
    job.src = buf;
    job.src_len = len;
    job.png =
        png_create_read_struct(PNG_LIBPNG_VER_STRING, &job.err, png_io_on_error, png_io_on_warning);
    if (!job.png)
        return ar_errorf(err, "png_decode: cannot create a libpng read struct");
    job.info = png_create_info_struct(job.png);
    int rc = AR_ERR;
    if (job.info)
        rc = png_io_decode_guarded(&job);
    else
        snprintf(job.err.msg, sizeof job.err.msg, "cannot create a libpng info struct");
    png_destroy_read_struct(&job.png, &job.info, NULL);
    free(job.rows);
    if (rc != AR_OK) {
        free(job.pixels);
        return ar_errorf(err, "png_decode: %s", job.err.msg);
    }
    *rgb = job.pixels;
    *width = (int)job.width;
    *height = (int)job.height;
    return AR_OK;
}
