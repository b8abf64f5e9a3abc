/* The convolution-shaped GEMM: a small matrix A (a convolution's weights,
 * c_out x c_in*k*k) times a wide one B (its im2col columns, one per output
 * pixel) that the caller packs in panels of GEMM_PANEL columns, each panel
 * stored K rows deep, so the kernel reads B as one stream and keeps a tile
 * of C in registers for the whole sum. Vectorised for the machine it runs
 * on (vec_isa()); one thread, the caller splits the panels across its team.
 * The image decoder's convolutions run here, not in OpenBLAS, whose kernels
 * the OPENBLAS_CORETYPE setting may hold below the machine's vector width. */
#ifndef ARSERVE_GEMM_PANELS_H
#define ARSERVE_GEMM_PANELS_H

#include <stddef.h>

/* Columns a panel. Packed column n of a K-deep B lies at
 * (n / GEMM_PANEL) * K * GEMM_PANEL + k * GEMM_PANEL + n % GEMM_PANEL. */
#define GEMM_PANEL 16

/* The floats that panels of N columns, K deep, take (the last one padded). */
size_t gemm_panels_floats(int N, int K);

/* C[m * ldc + n] = bias[m] (0 when bias is NULL) + sum over k < K of
 * A[m * lda + k] * B(k, n), for m < M and n < N, B packed as above in bp.
 * Panel columns past N are read, never written. */
void gemm_panels(int M, int N, int K, const float *A, int lda, const float *bp, const float *bias,
                 float *C, int ldc);

#endif
