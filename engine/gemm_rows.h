/* The decode-shaped GEMM: a few rows of activations times a big Linear
 * weight, y[m][n] += sum_k x[m][k] * w[n][k], reading each weight row once
 * for all the rows (OpenBLAS's sgemm packs the whole weight on every call,
 * which at two or eight rows costs more than the multiply; its sgemv reads
 * the weight once per row). Vectorised for the machine it runs on: AVX-512,
 * AVX2 with FMA, or portable C, chosen once at run time. One thread; the
 * caller splits n across its team. */
#ifndef ARSERVE_GEMM_ROWS_H
#define ARSERVE_GEMM_ROWS_H

/* The kernels, best first; gemm_rows_use picks one (tests and benches). */
typedef enum gemm_rows_isa {
    GEMM_ROWS_AVX512,
    GEMM_ROWS_AVX2,
    GEMM_ROWS_PORTABLE,
    GEMM_ROWS_N_ISA
} gemm_rows_isa_t;

/* y[m * ldy + n] += sum_k x[m * ldx + k] * w[n * ldw + k], m < M, n < N, k < K. */
void gemm_rows(int M, int N, int K, const float *x, int ldx, const float *w, int ldw, float *y,
               int ldy);

/* The kernel gemm_rows runs ("avx512", "avx2" or "portable"). */
const char *gemm_rows_isa_name(gemm_rows_isa_t isa);
gemm_rows_isa_t gemm_rows_isa(void);
/* 1 when this machine runs isa's kernel. */
int gemm_rows_supported(gemm_rows_isa_t isa);
/* Makes gemm_rows run isa's kernel (supported ones only; returns 0 if not). */
int gemm_rows_use(gemm_rows_isa_t isa);

#endif
