/* `make bench-gemm`: the decode-shaped GEMM (kernels/cpu/gemm_rows.c) against
 * OpenBLAS (sgemv for one row, sgemm otherwise: what the CPU backend called
 * before) on Linear shapes of the models served, at 1 to 128 rows, one thread,
 * measured side by side: the two alternate --reps times and the medians are
 * compared. Prints, per shape and rows, both times, the ratio and the
 * weight bytes read per second by gemm_rows; then, per rows, the worst
 * ratio over the shapes, and the crossover: the rows from which to which
 * gemm_rows is faster on every shape (the CPU backend's GEMM_ROWS_MIN_M and
 * GEMM_ROWS_MAX_M).
 *
 *   build/gemm_bench [--reps N] [--min-ms N] */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "cli/flags.h"
#include "kernels/cpu/gemm_rows.h"
#include "kernels/cpu/vec_isa.h"

#define MAX_REPS 99

/* (N, K): the shapes model's attention and MLP projections, then those of
 * a mid-size model (hidden 1024) and Janus-Pro-1B's (hidden 2048). */
static const int SHAPES[][2] = {{256, 256},   {1408, 256},  {256, 704},  {1024, 1024},
                                {5632, 1024}, {1024, 2816}, {2048, 2048}};
static const int ROWS[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128};
#define N_SHAPES ((int)(sizeof SHAPES / sizeof *SHAPES))
#define N_ROWS ((int)(sizeof ROWS / sizeof *ROWS))

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void blas(int M, int N, int K, const float *x, const float *w, float *y) {
    if (M == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, N, K, 1.0f, w, K, x, 1, 1.0f, y, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, w, K, 1.0f, y, N);
}

/* Seconds per call of one side, over calls that last at least min_s. */
static double time_side(int use_rows, int M, int N, int K, const float *x, const float *w, float *y,
                        double min_s) {
    int calls = 0;
    const double t0 = clock_now_s();
    double t;
    do {
        if (use_rows)
            gemm_rows(M, N, K, x, K, w, K, y, N);
        else
            blas(M, N, K, x, w, y);
        calls++;
    } while ((t = clock_now_s() - t0) < min_s);
    return t / calls;
}

int main(int argc, char **argv) {
    long long reps = 7, min_ms = 20;
    const cli_flag_t flags[] = {{"reps", 0, CLI_INT, &reps, 1, MAX_REPS, .metavar = "N",
                                 .help = "alternations of the two sides, median taken (default 7)"},
                                {"min-ms", 0, CLI_INT, &min_ms, 1, 10000, .metavar = "N",
                                 .help = "milliseconds of calls per timing (default 20)"},
                                {0}};
    int help = 0, rc = cli_flags_parse("gemm_bench", flags, argc, argv, &help);
    if (rc || help) {
        if (help)
            cli_flags_usage(stdout, flags);
        return rc;
    }
    openblas_set_num_threads(1);
    int max_n = 0, max_k = 0;
    for (int s = 0; s < N_SHAPES; s++) {
        max_n = SHAPES[s][0] > max_n ? SHAPES[s][0] : max_n;
        max_k = SHAPES[s][1] > max_k ? SHAPES[s][1] : max_k;
    }
    const int max_m = ROWS[N_ROWS - 1];
    float *x = malloc(sizeof(float) * (size_t)max_m * max_k);
    float *w = malloc(sizeof(float) * (size_t)max_n * max_k);
    float *y = malloc(sizeof(float) * (size_t)max_m * max_n);
    if (!x || !w || !y) {
        fprintf(stderr, "gemm_bench: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < (size_t)max_m * max_k; i++)
        x[i] = (float)(i % 7) * 0.01f;
    for (size_t i = 0; i < (size_t)max_n * max_k; i++)
        w[i] = (float)(i % 11) * 0.01f;
    memset(y, 0, sizeof(float) * (size_t)max_m * max_n);

    printf("gemm_rows kernel: %s; OpenBLAS %s, one thread; median of %lld alternations\n",
           vec_isa_name(vec_isa()), openblas_get_config(), reps);
    printf("%6s %6s %4s  %12s %12s  %8s  %10s\n", "N", "K", "rows", "openblas_us", "rows_us",
           "speedup", "weight_GB/s");
    double worst[N_ROWS];
    for (int r = 0; r < N_ROWS; r++)
        worst[r] = 1e30;
    for (int s = 0; s < N_SHAPES; s++) {
        const int N = SHAPES[s][0], K = SHAPES[s][1];
        for (int r = 0; r < N_ROWS; r++) {
            const int M = ROWS[r];
            double tb[MAX_REPS], tr[MAX_REPS];
            for (int i = 0; i < reps; i++) {
                tb[i] = time_side(0, M, N, K, x, w, y, min_ms * 1e-3);
                tr[i] = time_side(1, M, N, K, x, w, y, min_ms * 1e-3);
            }
            qsort(tb, (size_t)reps, sizeof *tb, cmp_double);
            qsort(tr, (size_t)reps, sizeof *tr, cmp_double);
            const double b = tb[reps / 2], g = tr[reps / 2], ratio = b / g;
            printf("%6d %6d %4d  %12.1f %12.1f  %7.2fx  %10.1f\n", N, K, M, b * 1e6, g * 1e6, ratio,
                   (double)N * K * 4 / g * 1e-9);
            if (ratio < worst[r])
                worst[r] = ratio;
        }
    }
    /* The longest run of row counts at which gemm_rows wins on every shape. */
    int best_lo = -1, best_len = 0;
    printf("rows:  worst speedup over the shapes\n");
    for (int r = 0, lo = -1; r < N_ROWS; r++) {
        printf("%4d:  %.2fx\n", ROWS[r], worst[r]);
        lo = worst[r] > 1 ? (lo < 0 ? r : lo) : -1;
        if (lo >= 0 && r - lo + 1 > best_len) {
            best_lo = lo;
            best_len = r - lo + 1;
        }
    }
    if (best_lo < 0)
        printf("crossover: gemm_rows is faster on every shape at no row count measured\n");
    else
        printf("crossover: gemm_rows is faster on every shape from %d to %d rows\n", ROWS[best_lo],
               ROWS[best_lo + best_len - 1]);
    free(x);
    free(w);
    free(y);
    return 0;
}
