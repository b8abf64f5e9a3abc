/* Row ops of a ragged batch, shared by the next-scale transformers
 * (var.c, infinity.c): sequence s owns rows [q_start[s], q_start[s + 1]).
 * Linears run over every sequence's rows at once, or sequence by sequence
 * where the backend is asked for batch invariance (backend.h); each
 * sequence's AdaLN modulation comes from its own table. */
#ifndef ARSERVE_SEQ_ROWS_H
#define ARSERVE_SEQ_ROWS_H

#include <stddef.h>

#include "engine/backend/backend.h"

/* The six chunks of a block's AdaLN table, each `width` floats, in the
 * order VAR and Infinity lay them out. */
enum { ADALN_GAMMA1, ADALN_GAMMA2, ADALN_SCALE1, ADALN_SCALE2, ADALN_SHIFT1, ADALN_SHIFT2 };

/* y = x w^T + b over every sequence's rows: one GEMM for all, or, where
 * be->batch_invariant asks for it, one GEMM per sequence (a GEMM's rounding
 * may depend on how many rows it has: OpenBLAS and cuBLAS pick their
 * kernels and tiles by shape) unless w is a prepared Linear weight (w->layout
 * == LAYOUT_LINEAR), whose rows the backend keeps independent anyway. A
 * stacked w (backend.h's matmul) gives its blocks of every sequence's rows
 * either way; q_start[0] is then 0. */
void seq_rows_matmul(backend_t *be, float *y, const float *x, const tensor_t *w, const tensor_t *b,
                     const int *q_start, int n_seq);

/* xn = LayerNorm(x) * (1 + scale) + shift over rows of dim, sequence s's
 * scale at tabs[s] + sc and shift at tabs[s] + sh (backend memory). */
void seq_rows_norm_modulate(backend_t *be, float *xn, const float *x, const int *q_start, int n_seq,
                            const float *const *tabs, size_t sc, size_t sh, int dim, float eps);

/* x += a * gate over rows of dim, sequence s's gate at tabs[s] + g. */
void seq_rows_gated_residual(backend_t *be, float *x, const float *a, const int *q_start, int n_seq,
                             const float *const *tabs, size_t g, int dim);

#endif
