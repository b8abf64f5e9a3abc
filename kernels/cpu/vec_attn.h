/* The inner loops of the CPU backend's attention, vectorised for the
 * machine (vec_isa.h): a query's scores against a chunk of keys, and the
 * probability-weighted sum of their values. Keys and values are given by
 * pointer (rows of a paged cache sit in scattered blocks); the kernels
 * prefetch the rows ahead themselves, where the hardware cannot follow. */
#ifndef ARSERVE_VEC_ATTN_H
#define ARSERVE_VEC_ATTN_H

/* scores[j] = scale * (q . k[j]) over d floats, for j < n. */
void vec_dots(float *scores, const float *q, const float *const *k, int n, int d, float scale);

/* acc[i] += sum over j < n of p[j] * v[j][i], for i < d; per element the
 * terms are added in order of j. */
void vec_axpys(float *acc, const float *p, const float *const *v, int n, int d);

#endif
