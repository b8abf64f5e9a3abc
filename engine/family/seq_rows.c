/* Row ops of a ragged batch, sequence by sequence (seq_rows.h). */
#include "engine/family/seq_rows.h"

#include <assert.h>

void seq_rows_matmul(backend_t *be, float *y, const float *x, const tensor_t *w, const tensor_t *b,
                     const int *q_start, int n_seq) {
    const int stacked = w->ndim == 3;
    const size_t groups = stacked ? (size_t)w->shape[0] : 1, out = (size_t)w->shape[stacked],
                 in = (size_t)w->shape[stacked + 1], rows = (size_t)q_start[n_seq];
    /* A prepared Linear weight keeps rows independent (backend.h): one GEMM
     * reads w once for all, batch invariant or not. */
    if (w->layout == LAYOUT_LINEAR || !be->batch_invariant) {
        assert(!stacked || q_start[0] == 0); /* a stack's blocks are of every row */
        be->matmul(be, y + (size_t)q_start[0] * out, x + (size_t)q_start[0] * in, w, b,
                   q_start[n_seq] - q_start[0]);
        return;
    }
    /* A GEMM per sequence, and per matrix of a stack (as loaded: its
     * matrices one after the other), each into its block of every row. */
    for (size_t g = 0; g < groups; g++) {
        tensor_t wg = *w, bg = b ? *b : (tensor_t){0};
        if (stacked) {
            wg.ndim = 2;
            wg.shape[0] = (int64_t)out;
            wg.shape[1] = (int64_t)in;
            wg.data = (char *)w->data + g * out * in * dtype_size(w->dtype);
            if (w->scale) /* as loaded: each matrix's rows' scales after the last's */
                wg.scale = (float *)w->scale + g * out;
            if (b) {
                bg.ndim = 1;
                bg.shape[0] = (int64_t)out;
                bg.data = (char *)b->data + g * out * dtype_size(b->dtype);
            }
        }
        for (int s = 0; s < n_seq; s++)
            be->matmul(be, y + (g * rows + (size_t)q_start[s]) * out, x + (size_t)q_start[s] * in,
                       &wg, b ? &bg : NULL, q_start[s + 1] - q_start[s]);
    }
}

void seq_rows_norm_modulate(backend_t *be, float *xn, const float *x, const int *q_start, int n_seq,
                            const float *const *tabs, size_t sc, size_t sh, int dim, float eps) {
    be->layernorm(be, xn, x, q_start[n_seq], dim, eps);
    if (be->modulate_seqs) {
        be->modulate_seqs(be, xn, xn, q_start, tabs, n_seq, sc, sh, dim);
        return;
    }
    for (int s = 0; s < n_seq; s++) {
        float *xs = xn + (size_t)q_start[s] * dim;
        be->modulate(be, xs, xs, tabs[s] + sc, tabs[s] + sh, q_start[s + 1] - q_start[s], dim);
    }
}

void seq_rows_gated_residual(backend_t *be, float *x, const float *a, const int *q_start, int n_seq,
                             const float *const *tabs, size_t g, int dim) {
    if (be->gate_add_seqs) {
        be->gate_add_seqs(be, x, a, q_start, tabs, n_seq, g, dim);
        return;
    }
    for (int s = 0; s < n_seq; s++)
        be->gate_add(be, x + (size_t)q_start[s] * dim, a + (size_t)q_start[s] * dim, tabs[s] + g,
                     q_start[s + 1] - q_start[s], dim);
}
