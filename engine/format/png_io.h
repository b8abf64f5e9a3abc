/* PNG encoding and decoding through libpng, entirely in memory, with errors
 * returned as values: corrupt or truncated input is an AR_ERR with a message,
 * never a crash or an abort. */
#ifndef ARSERVE_PNG_IO_H
#define ARSERVE_PNG_IO_H

#include "base/status.h"

#include <stddef.h>
#include <stdint.h>

/* Largest width or height accepted either way, and the largest pixel count
 * png_decode will allocate for (64 Mpx, 192 MiB of RGB). */
#define PNG_IO_MAX_DIM 16384
#define PNG_IO_MAX_PIXELS ((size_t)1 << 26)

/* Encodes width x height 8-bit RGB pixels (rows top to bottom, 3 * width
 * bytes each, no padding) as a PNG in a malloc'd buffer the caller frees.
 * Default zlib level and libpng's default filters, and no time or text
 * chunks, so the same pixels always give the same bytes. AR_ERR (and *out
 * untouched) if a dimension is outside 1..PNG_IO_MAX_DIM or memory runs out. */
int png_encode(const uint8_t *rgb, int width, int height, uint8_t **out, size_t *out_len,
               ar_error_t *err);

/* png_encode, then writes the bytes to path (created or truncated). On a
 * write failure the message names the path and the errno text, and a
 * partially written file is removed. */
int png_write_file(const char *path, const uint8_t *rgb, int width, int height, ar_error_t *err);

/* Decodes a PNG held in memory to 8-bit RGB in a malloc'd buffer the caller
 * frees (3 * width bytes per row). Accepts gray, gray+alpha, palette, RGB and
 * RGBA at any bit depth, interlaced or not: palettes and low bit depths are
 * expanded, gray is replicated, 16-bit samples keep their high byte, and
 * alpha is dropped (not composited). AR_ERR on a bad signature, corrupt or
 * truncated data, or dimensions beyond PNG_IO_MAX_DIM / PNG_IO_MAX_PIXELS. */
int png_decode(const uint8_t *buf, size_t len, uint8_t **rgb, int *width, int *height,
               ar_error_t *err);

#endif
