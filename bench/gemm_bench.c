/* `make bench-gemm`: the Linear GEMM of the CPU backend, over weights packed
 * once at load (kernels/cpu/gemm_packed.c), against what it replaced:
 * OpenBLAS (sgemv for one row, sgemm otherwise) and gemm_rows
 * (kernels/cpu/gemm_rows.c, the weight read row by row, one weight vector
 * per two or four activation rows), on Linear shapes of the models served,
 * at 1 to 576 rows (or --rows), one thread, weights of --dtype (gemm_rows and
 * gemm_packed read 16-bit weights as they are, OpenBLAS their fp32
 * conversion, which the backend made per call), on every instruction set this
 * machine runs (AVX2 forced on an AVX-512 machine, as ARSERVE_ISA=avx2
 * does). The three sides alternate --reps times and the medians are
 * compared. Prints, per instruction set, shape and rows, the three times,
 * gemm_packed's speedup over each and the weight bytes it reads per
 * second; then, per rows, its worst speedup over the shapes, and the
 * crossovers: the rows at which it is faster than each on every shape.
 *
 *   build/gemm_bench [--reps N] [--min-ms N] [--isa NAME] [--dtype f32|bf16|f16] [--rows LIST] */
#include <cblas.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "cli/flags.h"
#include "kernels/cpu/gemm_packed.h"
#include "kernels/cpu/gemm_rows.h"
#include "kernels/cpu/vec_isa.h"

#define MAX_REPS 99

/* (N, K): the shapes model's attention and MLP projections, then those of
 * a mid-size model (hidden 1024) and Janus-Pro-1B's (hidden 2048). */
static const int SHAPES[][2] = {{256, 256},   {1408, 256},  {256, 704},  {1024, 1024},
                                {5632, 1024}, {1024, 2816}, {2048, 2048}};
/* Decode (2 rows an image with guidance: 16 is a batch of 8), then prefill
 * and next-scale steps (a 16x16 scale is 256 rows, Janus's prompt 576); --rows
 * replaces them (an Infinity 32x32 scale with guidance is 2,048 rows). The
 * row counts timed: rows_at[0 .. n_rows). */
#define MAX_ROWS 16
#define MAX_ROW_COUNT 8192
static int rows_at[MAX_ROWS] = {1, 2, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256, 576};
static int n_rows = 13;
#define N_SHAPES ((int)(sizeof SHAPES / sizeof *SHAPES))

enum { SIDE_BLAS, SIDE_ROWS, SIDE_PACKED, N_SIDES };

typedef struct operands {
    const float *x, *w;  /* w: fp32 */
    const void *wt, *wp; /* w in type dt, and packed */
    dtype_t dt;
    float *y;
} operands_t;

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void call(int side, int M, int N, int K, const operands_t *o) {
    if (side == SIDE_PACKED)
        gemm_packed(M, N, K, o->x, K, o->wp, o->dt, o->y, N);
    else if (side == SIDE_ROWS)
        gemm_rows_typed(M, N, K, o->x, K, o->wt, o->dt, K, o->y, N);
    else if (M == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, N, K, 1.0f, o->w, K, o->x, 1, 1.0f, o->y, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, o->x, K, o->w, K, 1.0f,
                    o->y, N);
}

/* Seconds per call of one side, over calls that last at least min_s. */
static double time_side(int side, int M, int N, int K, const operands_t *o, double min_s) {
    int calls = 0;
    const double t0 = clock_now_s();
    double t;
    do {
        call(side, M, N, K, o);
        calls++;
    } while ((t = clock_now_s() - t0) < min_s);
    return t / calls;
}

/* The longest run of row counts at which worst[] is above 1, printed. */
static void crossover(const double *worst, const char *other) {
    int best_lo = -1, best_len = 0;
    for (int r = 0, lo = -1; r < n_rows; r++) {
        lo = worst[r] > 1 ? (lo < 0 ? r : lo) : -1;
        if (lo >= 0 && r - lo + 1 > best_len) {
            best_lo = lo;
            best_len = r - lo + 1;
        }
    }
    if (best_lo < 0)
        printf("crossover against %s: gemm_packed is faster on every shape at no row count "
               "measured\n",
               other);
    else
        printf("crossover against %s: gemm_packed is faster on every shape from %d to %d rows\n",
               other, rows_at[best_lo], rows_at[best_lo + best_len - 1]);
}

static void run_isa(const operands_t *o, long long reps, double min_s) {
    printf("\nkernels: %s, %s weights; OpenBLAS %s, one thread; median of %lld alternations\n",
           vec_isa_name(vec_isa()), dtype_name(o->dt), openblas_get_config(), reps);
    printf("%6s %6s %4s  %11s %11s %11s  %9s %9s  %10s\n", "N", "K", "rows", "openblas_us",
           "rows_us", "packed_us", "vs_blas", "vs_rows", "weight_GB/s");
    double worst[2][MAX_ROWS];
    for (int r = 0; r < n_rows; r++)
        worst[0][r] = worst[1][r] = 1e30;
    for (int s = 0; s < N_SHAPES; s++) {
        const int N = SHAPES[s][0], K = SHAPES[s][1];
        operands_t sh = *o;
        gemm_packed_pack((void *)sh.wp, o->wt, o->dt, N, K, K);
        for (int r = 0; r < n_rows; r++) {
            const int M = rows_at[r];
            double t[N_SIDES][MAX_REPS], med[N_SIDES];
            for (int i = 0; i < reps; i++)
                for (int side = 0; side < N_SIDES; side++)
                    t[side][i] = time_side(side, M, N, K, &sh, min_s);
            for (int side = 0; side < N_SIDES; side++) {
                qsort(t[side], (size_t)reps, sizeof **t, cmp_double);
                med[side] = t[side][reps / 2];
            }
            const double vs_blas = med[SIDE_BLAS] / med[SIDE_PACKED],
                         vs_rows = med[SIDE_ROWS] / med[SIDE_PACKED];
            /* %.3g: a rate of a loaded machine (a timing descheduled) still reads as one,
             * not as 0.0 */
            printf("%6d %6d %4d  %11.1f %11.1f %11.1f  %8.2fx %8.2fx  %10.3g\n", N, K, M,
                   med[SIDE_BLAS] * 1e6, med[SIDE_ROWS] * 1e6, med[SIDE_PACKED] * 1e6, vs_blas,
                   vs_rows, (double)N * K * dtype_size(o->dt) / med[SIDE_PACKED] * 1e-9);
            worst[0][r] = vs_blas < worst[0][r] ? vs_blas : worst[0][r];
            worst[1][r] = vs_rows < worst[1][r] ? vs_rows : worst[1][r];
        }
    }
    printf("rows:  gemm_packed's worst speedup over the shapes, against openblas and gemm_rows\n");
    for (int r = 0; r < n_rows; r++)
        printf("%4d:  %.2fx %.2fx\n", rows_at[r], worst[0][r], worst[1][r]);
    crossover(worst[0], "openblas");
    crossover(worst[1], "gemm_rows");
}

/* --rows: ascending row counts, comma-separated, into rows_at; 0, or -1 with
 * the reason on stderr. */
static int parse_rows(const char *list) {
    int n = 0;
    for (const char *p = list; *p;) {
        char *end;
        const long v = strtol(p, &end, 10);
        if (end == p || (*end && (*end != ',' || !end[1])) || v < 1 || v > MAX_ROW_COUNT ||
            n == MAX_ROWS || (n > 0 && v <= rows_at[n - 1])) {
            fprintf(stderr,
                    "gemm_bench: --rows %s: want up to %d ascending row counts in [1, %d], "
                    "comma-separated\n",
                    list, MAX_ROWS, MAX_ROW_COUNT);
            return -1;
        }
        rows_at[n++] = (int)v;
        p = *end ? end + 1 : end;
    }
    if (n == 0) {
        fprintf(stderr, "gemm_bench: --rows: empty\n");
        return -1;
    }
    n_rows = n;
    return 0;
}

int main(int argc, char **argv) {
    long long reps = 5, min_ms = 20;
    const char *isa_name = NULL, *dtype = "f32", *rows = NULL;
    const cli_flag_t flags[] = {
        {"reps", 0, CLI_INT, &reps, 1, MAX_REPS, .metavar = "N",
         .help = "alternations of the three sides, median taken (default 5)"},
        {"min-ms", 0, CLI_INT, &min_ms, 1, 10000, .metavar = "N",
         .help = "milliseconds of calls per timing (default 20)"},
        {"isa", 0, CLI_STRING, &isa_name, .metavar = "NAME",
         .help = "only this instruction set (avx512, avx2; default: each this machine runs)"},
        {"dtype", 0, CLI_STRING, &dtype, .metavar = "TYPE",
         .help = "the weights' type: f32 (default), bf16 or f16"},
        {"rows", 0, CLI_STRING, &rows, .metavar = "LIST",
         .help = "row counts to time, ascending, e.g. 576,2048 (default 1 to 576)"},
        {0}};
    int help = 0, rc = cli_flags_parse("gemm_bench", flags, argc, argv, &help);
    if (rc || help) {
        if (help)
            cli_flags_usage(stdout, flags);
        return rc;
    }
    if (rows && parse_rows(rows) != 0)
        return 2;
    dtype_t dt;
    if (!strcmp(dtype, "f32"))
        dt = DTYPE_F32;
    else if (!strcmp(dtype, "bf16"))
        dt = DTYPE_BF16;
    else if (!strcmp(dtype, "f16"))
        dt = DTYPE_F16;
    else {
        fprintf(stderr, "gemm_bench: --dtype %s: not one of f32, bf16, f16\n", dtype);
        return 2;
    }
    openblas_set_num_threads(1);
    int max_n = 0, max_k = 0;
    for (int s = 0; s < N_SHAPES; s++) {
        max_n = SHAPES[s][0] > max_n ? SHAPES[s][0] : max_n;
        max_k = SHAPES[s][1] > max_k ? SHAPES[s][1] : max_k;
    }
    const int max_m = rows_at[n_rows - 1];
    float *x = malloc(sizeof(float) * (size_t)max_m * max_k);
    float *w = malloc(sizeof(float) * (size_t)max_n * max_k);
    void *wt = malloc(dtype_size(dt) * (size_t)max_n * max_k);
    void *wp = malloc(dtype_size(dt) * gemm_packed_elems(max_n, max_k, dt));
    float *y = malloc(sizeof(float) * (size_t)max_m * max_n);
    if (!x || !w || !wt || !wp || !y) {
        fprintf(stderr, "gemm_bench: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < (size_t)max_m * max_k; i++)
        x[i] = (float)(i % 7) * 0.01f;
    for (size_t i = 0; i < (size_t)max_n * max_k; i++) {
        w[i] = (float)(i % 11) * 0.01f;
        if (dt == DTYPE_BF16)
            ((uint16_t *)wt)[i] = f32_to_bf16(w[i]);
        else if (dt == DTYPE_F16)
            ((uint16_t *)wt)[i] = f32_to_f16(w[i]);
        else
            ((float *)wt)[i] = w[i];
    }
    memset(y, 0, sizeof(float) * (size_t)max_m * max_n);
    const operands_t o = {x, w, wt, wp, dt, y};
    int ran = 0;
    /* The vector kernels only: the portable ones are a fallback, not a
     * contender. */
    for (int isa = 0; isa < VEC_PORTABLE; isa++) {
        if (isa_name && strcmp(isa_name, vec_isa_name((vec_isa_t)isa)))
            continue;
        if (!vec_isa_use((vec_isa_t)isa)) {
            printf("\nkernels: %s: not on this machine\n", vec_isa_name((vec_isa_t)isa));
            continue;
        }
        run_isa(&o, reps, min_ms * 1e-3);
        ran++;
    }
    free(x);
    free(w);
    free(wt);
    free(wp);
    free(y);
    if (!ran) {
        fprintf(stderr, "gemm_bench: --isa %s: not one of avx512, avx2 that this machine runs\n",
                isa_name ? isa_name : "");
        return 2;
    }
    return 0;
}
