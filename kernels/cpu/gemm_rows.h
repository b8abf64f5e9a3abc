/* The decode-shaped GEMM: a few rows of activations times a big Linear
 * weight, y[m][n] += sum_k x[m][k] * w[n][k], reading each weight row once
 * for all the rows (OpenBLAS's sgemm packs the whole weight on every call,
 * which at two or eight rows costs more than the multiply; its sgemv reads
 * the weight once per row), in fp32, bf16 or fp16 weights. Vectorised for the machine it runs on:
 * AVX-512, AVX2 with FMA and F16C, or portable C, as vec_isa() says. One thread; the caller splits
 * n across its team. */
#ifndef ARSERVE_GEMM_ROWS_H
#define ARSERVE_GEMM_ROWS_H

#include "base/dtype.h"

/* y[m * ldy + n] += sum_k x[m * ldx + k] * w[n * ldw + k], m < M, n < N, k < K. */
void gemm_rows(int M, int N, int K, const float *x, int ldx, const float *w, int ldw, float *y,
               int ldy);

/* The same with w's elements of type wt (fp32, bf16 or fp16; ldw in
 * elements): 16-bit weights are converted to fp32 in registers, so the sums
 * equal gemm_rows's over the converted weights, bit for bit. */
void gemm_rows_typed(int M, int N, int K, const float *x, int ldx, const void *w, dtype_t wt,
                     int ldw, float *y, int ldy);

#endif
