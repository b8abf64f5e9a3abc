/* The Linear GEMM over weights packed once at load: y[m][n] += sum_k
 * x[m][k] * w[n][k], with w [N, K] (PyTorch's Linear layout) stored in
 * panels of GEMM_PANEL output columns, each K deep, in its own type (fp32;
 * bf16 or fp16, converted in registers, or for many rows widened to fp32 a
 * k block of a few panels at a time, exactly, and run as fp32; int8 or fp8
 * e4m3 with a scale per output column, dequantised in registers:
 * gemm_packed_scaled). A tile of rows x panels of y stays
 * in registers while, per k, a panel row of w is loaded once and multiplied
 * by a broadcast element of each of the tile's rows: no horizontal sums,
 * and the weight is read once per tile of rows (gemm_rows.h reads it once
 * per two rows on AVX2). Vectorised for the machine it runs on
 * (vec_isa()); one thread, the caller splits N across its team at
 * multiples of GEMM_PANEL.
 *
 * The CPU backend's convolutions run here too: their weights are x, the
 * im2col columns of their output pixels, packed as panels, are w.
 *
 * Every y[m][n] is one chain of fused multiply-adds over k in order,
 * started from y's value (8-bit weights: a chain a k block, scaled, see
 * gemm_packed_scaled): the same bytes whatever M, the tiles or the split,
 * so an image does not depend on what else shares its batch. */
#ifndef ARSERVE_GEMM_PACKED_H
#define ARSERVE_GEMM_PACKED_H

#include <stddef.h>

#include "base/dtype.h"

/* Output columns a panel. */
#define GEMM_PANEL 16

/* The AMX tiles' depth, a multiple of which bf16 panels are deep. */
#define GEMM_TILE_DEPTH 32

/* The depth of a packed panel: K, but for bf16 K rounded up to
 * GEMM_TILE_DEPTH (with zeros past K; gemm_amx.h reads bf16 panels as they
 * are). */
int gemm_packed_depth(int K, dtype_t wt);

/* Elements a packed weight of N output columns, K deep, in type wt takes
 * (the last panel padded with zeros). With D = gemm_packed_depth(K, wt),
 * element (n, k) lies at (n / GEMM_PANEL) * D * GEMM_PANEL + k * GEMM_PANEL
 * + n % GEMM_PANEL; for bf16, which AMX tiles read as pairs of k side by
 * side, at (n / GEMM_PANEL) * D * GEMM_PANEL + (k / 2) * 2 * GEMM_PANEL
 * + (n % GEMM_PANEL) * 2 + k % 2 (gemm_amx_b_at). */
size_t gemm_packed_elems(int N, int K, dtype_t wt);

/* Packs w [N, K] (row stride ldw elements, of type wt) into dst, which
 * holds gemm_packed_elems(N, K, wt) elements of wt. */
void gemm_packed_pack(void *dst, const void *w, dtype_t wt, int N, int K, int ldw);

/* Panel p of a packed weight K deep: its columns from p * GEMM_PANEL. */
const void *gemm_packed_panel(const void *wp, dtype_t wt, int K, int p);

/* y[m * ldy + n] += sum over k < K of x[m * ldx + k] * w(n, k), m < M,
 * n < N, with wp packed as above from its first column (gemm_packed_panel
 * for a slice). Columns of y past N are neither read nor written. */
void gemm_packed(int M, int N, int K, const float *x, int ldx, const void *wp, dtype_t wt, float *y,
                 int ldy);

/* The k a block: the driver sums k in blocks of GEMM_KC, in order (a
 * panel group's block of w, 3 panels of fp32: 48 KiB, is read from L1 or
 * L2 by every tile of a row block). */
#define GEMM_KC 256

/* gemm_packed for any weight type. For wt DTYPE_I8, w(n, k) is its element
 * q(n, k) times scale[n]; for DTYPE_F8_E4M3, q(n, k) is its element's value
 * / VEC_F8_DIV (exact; the caller's scales carry the VEC_F8_DIV: vec_isa.h).
 * An 8-bit weight's scale joins once per k block, not per element: for
 * each block of GEMM_KC k in order, s = the chain of multiply-adds
 * x[m][k] * q(n, k) from 0, then y[m][n] = s * scale[n] + y[m][n] (each a
 * fused multiply-add where the instruction set has them): the same bytes
 * whatever M, the tiles or the split, one multiply a block in place of
 * one a weight. scale holds a whole number of panels of columns (padded
 * past N; the padding may be anything finite) and is ignored for float
 * types. */
void gemm_packed_scaled(int M, int N, int K, const float *x, int ldx, const void *wp, dtype_t wt,
                        const float *scale, float *y, int ldy);

#endif
