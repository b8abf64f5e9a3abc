/* The Linear GEMM with activations rounded to bf16 (what PyTorch's bf16
 * autocast multiplies), on the AMX tiles of CPUs that have them (Intel's
 * Sapphire Rapids and later): y[m][n] += sum_k bf16(x[m][k]) * w(n, k) for
 * bf16 weights as gemm_packed_pack lays them out, the products summed in fp32 by
 * the tiles' dot products (pairs of k at a time, in the hardware's order).
 * About ten times the multiply-adds a cycle of the AVX-512 kernel, at the
 * price of the activations' rounding (8 bits of mantissa): an option of the
 * CPU backend (cpu_activations bf16), never the default.
 *
 * gemm_amx_round gives the activations in the layout gemm_amx reads; one
 * thread each, the caller splits the rows or the pairs of panels. */
#ifndef ARSERVE_GEMM_AMX_H
#define ARSERVE_GEMM_AMX_H

#include <stddef.h>
#include <stdint.h>

/* 1 where the CPU has AMX with bf16, the kernel granted this process the
 * tile state (asked once, on the first call) and the kernels run AVX-512
 * (vec_isa.h: ARSERVE_ISA=avx2 turns AMX off too); 0 otherwise. */
int gemm_amx_usable(void);

/* Rows and depth of the rounded activations: M and K rounded up to 32. */
int gemm_amx_pad(int n);

/* n floats to bf16, to nearest even (vectorised where AMX is usable). */
void gemm_amx_to_bf16(uint16_t *dst, const float *src, size_t n);

/* Rounds rows [r0, r1) of x [M, K] (row stride ldx floats) to bf16 (to
 * nearest, ties to even) into xb, gemm_amx_pad(K) elements a row, the
 * columns past K zero; rows at or past M (up to gemm_amx_pad(M)) are zero. */
void gemm_amx_round(uint16_t *xb, const float *x, int ldx, int M, int K, int r0, int r1);

/* The weight operand's layout, the one gemm_packed_pack gives bf16 weights
 * (gemm_packed.h) and attention builds for its keys and values: column n
 * (of N; the last panel's columns past N zero), depth k (of K, rounded up
 * to 32 with zeros) at gemm_amx_b_at(n, k, gemm_amx_pad(K)): panels of 16
 * columns, each Kp deep with pairs of k side by side, one after another. */
static inline size_t gemm_amx_b_at(int n, int k, int Kp) {
    return (size_t)(n / 16) * (size_t)Kp * 16 + (size_t)(k / 2) * 32 + (size_t)(n % 16) * 2 +
           (size_t)(k % 2);
}

/* Elements of such an operand: gemm_amx_pad(N) x gemm_amx_pad(K) (whole
 * pairs of panels; a packed weight may end at an odd panel). */
size_t gemm_amx_b_elems(int N, int K);

/* An fp32 operand packed by gemm_packed_pack (N columns, K deep) rounded
 * to bf16 (to nearest even) into depth rows [k0, k0 + gemm_amx_pad(K)) of
 * dst, an operand Kp deep in the layout above (k0 a multiple of 32; rows
 * past k0 + K zero, other rows untouched): what the convolutions' patches
 * take to the tiles, a block of channels at a time. With k0 0 and Kp
 * gemm_amx_pad(K), the rounded weight as gemm_packed_pack lays out bf16. */
void gemm_amx_pack_f32(uint16_t *dst, int Kp, int k0, const float *src, int N, int K);

/* y[m * ldy + n] += sum over k < K of xb[m][k] * w(n, k), m < M, n < N, for
 * xb from gemm_amx_round and wb in the layout above. Columns of y past N
 * are neither read nor written. Only where gemm_amx_usable(). */
void gemm_amx(int M, int N, int K, const uint16_t *xb, const uint16_t *wb, float *y, int ldy);
/* gemm_amx with y = the sums (y not read): the same bytes as gemm_amx on a
 * y of zeros, without the pass that zeroes it. */
void gemm_amx_store(int M, int N, int K, const uint16_t *xb, const uint16_t *wb, float *y, int ldy);

#endif
