/* The inner loops of the CPU backend's attention, vectorised for the
 * machine (vec_isa.h): a query's scores against a chunk of keys, and the
 * probability-weighted sum of their values. Keys and values are given by
 * pointer (rows of a paged cache sit in scattered blocks), their elements
 * fp32, bf16 or fp16 (16-bit rows widened in registers: the sums equal
 * those over the rows widened first, bit for bit); the kernels prefetch the
 * rows ahead themselves, where the hardware cannot follow. */
#ifndef ARSERVE_VEC_ATTN_H
#define ARSERVE_VEC_ATTN_H

#include "base/dtype.h"

/* scores[j] = scale * (q . k[j]) over d elements, for j < n; k's elements
 * of type kt (fp32, bf16 or fp16). */
void vec_dots(float *scores, const float *q, const void *const *k, dtype_t kt, int n, int d,
              float scale);

/* acc[i] += sum over j < n of p[j] * v[j][i], for i < d, v's elements of
 * type vt (fp32, bf16 or fp16); per element the terms are added in order
 * of j. */
void vec_axpys(float *acc, const float *p, const void *const *v, dtype_t vt, int n, int d);

#endif
