/* Row ops of a ragged batch, sequence by sequence (seq_rows.h). */
#include "engine/family/seq_rows.h"

void seq_rows_matmul(backend_t *be, float *y, const float *x, const tensor_t *w, const tensor_t *b,
                     const int *q_start, int n_seq) {
    const size_t in = (size_t)w->shape[1], out = (size_t)w->shape[0];
    /* A prepared Linear weight keeps rows independent (backend.h): one GEMM
     * reads w once for all, batch invariant or not. */
    if (w->layout == LAYOUT_LINEAR || !be->batch_invariant) {
        be->matmul(be, y + (size_t)q_start[0] * out, x + (size_t)q_start[0] * in, w, b,
                   q_start[n_seq] - q_start[0]);
        return;
    }
    for (int s = 0; s < n_seq; s++)
        be->matmul(be, y + (size_t)q_start[s] * out, x + (size_t)q_start[s] * in, w, b,
                   q_start[s + 1] - q_start[s]);
}

void seq_rows_norm_modulate(backend_t *be, float *xn, const float *x, const int *q_start, int n_seq,
                            const float *const *tabs, size_t sc, size_t sh, int dim, float eps) {
    be->layernorm(be, xn, x, q_start[n_seq], dim, eps);
    for (int s = 0; s < n_seq; s++) {
        float *xs = xn + (size_t)q_start[s] * dim;
        be->modulate(be, xs, xs, tabs[s] + sc, tabs[s] + sh, q_start[s + 1] - q_start[s], dim);
    }
}

void seq_rows_gated_residual(backend_t *be, float *x, const float *a, const int *q_start, int n_seq,
                             const float *const *tabs, size_t g, int dim) {
    for (int s = 0; s < n_seq; s++)
        be->gate_add(be, x + (size_t)q_start[s] * dim, a + (size_t)q_start[s] * dim, tabs[s] + g,
                     q_start[s + 1] - q_start[s], dim);
}
