/* `make bench-conv`: the CPU backend's 3x3 convolution, direct (im2col
 * panels into gemm_packed: the backend's conv2d on kernels as loaded)
 * against Winograd F(2x2, 3x3) over transformed kernels
 * (kernels/cpu/conv_winograd.c, in the backend's blocks), on one thread, on the channel counts and
 * image sizes of the VQ decoders served (the demo models' 32 to 128 channels, Janus-Pro's 128 to
 * 512 at 24 to 384 pixels), on every instruction set this machine runs (AVX2 forced on an AVX-512
 * machine, as ARSERVE_ISA=avx2 does). The two sides alternate --reps times and the medians are
 * compared. Prints per instruction set, channels and size the two times, Winograd's speedup and the
 * largest difference between the two outputs; then the crossover: the fewest channels from which
 * Winograd is faster at every size and channel count measured (what the backend's
 * CONV_WINOGRAD_MIN_CHANNELS is chosen from).
 *
 *   build/conv_bench [--reps N] [--min-ms N] [--isa NAME] [--max-side N] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "cli/flags.h"
#include "engine/backend/backend.h"
#include "kernels/cpu/conv_winograd.h"
#include "kernels/cpu/vec_isa.h"

#define MAX_REPS 99

/* Channels in = out, as a decoder level's ResNet convolutions. */
static const int CHANNELS[] = {16, 32, 48, 64, 96, 128, 256, 512};
/* Image sides: a decoder's levels. */
static const int SIDES[] = {16, 24, 48, 96};
#define N_CHANNELS ((int)(sizeof CHANNELS / sizeof *CHANNELS))
#define N_SIDES ((int)(sizeof SIDES / sizeof *SIDES))

enum { DIRECT, WINOGRAD, N_ALGOS };

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The two sides' operands at one channel count. */
typedef struct sides {
    backend_t *be;
    tensor_t w, b; /* the direct side's kernels as loaded, and the bias */
    float *u;      /* the transformed kernels */
    const float *bias;
    float *scratch; /* a block's */
} sides_t;

static void conv(const sides_t *s, int algo, float *out, const float *in, int c, int side) {
    if (algo == DIRECT) {
        s->be->conv2d(s->be, out, in, &s->w, &s->b, c, side, side, 1);
        return;
    }
    const int64_t tiles = winograd_tiles(side, side);
    for (int64_t t0 = 0; t0 < tiles; t0 += WINOGRAD_BLOCK_TILES) {
        const int n = (int)(tiles - t0 < WINOGRAD_BLOCK_TILES ? tiles - t0 : WINOGRAD_BLOCK_TILES);
        winograd_conv3x3(out, in, s->u, s->bias, c, c, side, side, 1, t0, n, s->scratch);
    }
}

/* Seconds per convolution, over calls that last at least min_s. */
static double time_conv(const sides_t *s, int algo, float *out, const float *in, int c, int side,
                        double min_s) {
    int calls = 0;
    const double t0 = clock_now_s();
    double t;
    do {
        conv(s, algo, out, in, c, side);
        calls++;
    } while ((t = clock_now_s() - t0) < min_s);
    return t / calls;
}

/* One instruction set's table; 0, or 1 when a weight could not be made. */
static int run_isa(backend_t *be, long long reps, double min_s, int max_side) {
    printf("\nkernels: %s, one thread; median of %lld alternations\n", vec_isa_name(vec_isa()),
           reps);
    printf("%5s %5s  %11s %11s  %8s  %9s\n", "chan", "side", "direct_ms", "winograd_ms", "speedup",
           "max_diff");
    double worst[N_CHANNELS];
    ar_error_t err = {0};
    for (int ci = 0; ci < N_CHANNELS; ci++) {
        const int c = CHANNELS[ci];
        worst[ci] = 1e30;
        const int64_t wshape[4] = {c, c, 3, 3}, bshape[1] = {c};
        float *host = malloc(sizeof(float) * (size_t)c * c * 9), *bias = malloc(sizeof(float) * c);
        for (size_t i = 0; i < (size_t)c * c * 9; i++)
            host[i] = (float)((int)(i % 13) - 6) * 0.01f;
        for (int i = 0; i < c; i++)
            bias[i] = 0.1f * (float)(i % 3);
        sides_t sd = {
            be,   {0},
            {0},  malloc(sizeof(float) * winograd_weight_floats(c, c)),
            NULL, malloc(sizeof(float) * winograd_scratch_floats(c, c, WINOGRAD_BLOCK_TILES))};
        if (!sd.u || !sd.scratch ||
            be->weight_load(be, &sd.w, host, DTYPE_F32, 4, wshape, &err) != AR_OK ||
            be->weight_load(be, &sd.b, bias, DTYPE_F32, 1, bshape, &err) != AR_OK) {
            fprintf(stderr, "conv_bench: %s\n", err.msg[0] ? err.msg : "out of memory");
            return 1;
        }
        winograd_weights(sd.u, host, c, c);
        sd.bias = sd.b.data;
        free(host);
        free(bias);
        for (int si = 0; si < N_SIDES; si++) {
            const int side = SIDES[si];
            if (side > max_side)
                continue;
            const size_t n = (size_t)c * side * side;
            float *in = malloc(sizeof(float) * n), *out[N_ALGOS];
            for (size_t i = 0; i < n; i++)
                in[i] = (float)((int)(i % 17) - 8) * 0.05f;
            double t[N_ALGOS][MAX_REPS], med[N_ALGOS];
            for (int a = 0; a < N_ALGOS; a++)
                out[a] = malloc(sizeof(float) * n);
            for (int r = 0; r < reps; r++)
                for (int a = 0; a < N_ALGOS; a++)
                    t[a][r] = time_conv(&sd, a, out[a], in, c, side, min_s);
            double diff = 0;
            for (size_t i = 0; i < n; i++)
                diff = fmax(diff, fabs((double)out[DIRECT][i] - out[WINOGRAD][i]));
            for (int a = 0; a < N_ALGOS; a++) {
                qsort(t[a], (size_t)reps, sizeof **t, cmp_double);
                med[a] = t[a][reps / 2];
                free(out[a]);
            }
            free(in);
            const double speedup = med[DIRECT] / med[WINOGRAD];
            printf("%5d %5d  %11.3f %11.3f  %7.2fx  %9.2g\n", c, side, med[DIRECT] * 1e3,
                   med[WINOGRAD] * 1e3, speedup, diff);
            worst[ci] = speedup < worst[ci] ? speedup : worst[ci];
        }
        be->weight_free(be, &sd.w);
        be->weight_free(be, &sd.b);
        free(sd.u);
        free(sd.scratch);
    }
    int from = N_CHANNELS;
    while (from > 0 && worst[from - 1] > 1)
        from--;
    if (from == N_CHANNELS)
        printf("crossover: Winograd is slower than direct at %d channels or an unmeasured count\n",
               CHANNELS[N_CHANNELS - 1]);
    else
        printf("crossover: Winograd is faster at every size from %d channels up\n", CHANNELS[from]);
    return 0;
}

int main(int argc, char **argv) {
    long long reps = 5, min_ms = 50, max_side = 96;
    const char *isa_name = NULL;
    const cli_flag_t flags[] = {
        {"reps", 0, CLI_INT, &reps, 1, MAX_REPS, .metavar = "N",
         .help = "alternations of the two sides, median taken (default 5)"},
        {"min-ms", 0, CLI_INT, &min_ms, 1, 10000, .metavar = "N",
         .help = "milliseconds of calls per timing (default 50)"},
        {"isa", 0, CLI_STRING, &isa_name, .metavar = "NAME",
         .help = "only this instruction set (avx512, avx2; default: each this machine runs)"},
        {"max-side", 0, CLI_INT, &max_side, 16, 96, .metavar = "N",
         .help = "largest image side measured (default 96)"},
        {0}};
    int help = 0, rc = cli_flags_parse("conv_bench", flags, argc, argv, &help);
    if (rc || help) {
        if (help)
            cli_flags_usage(stdout, flags);
        return rc;
    }
    ar_error_t err = {0};
    backend_t *be = backend_cpu_create(1, &err);
    if (!be) {
        fprintf(stderr, "conv_bench: %s\n", err.msg);
        return 1;
    }
    int ran = 0, failed = 0;
    /* The vector kernels only, as make bench-gemm. */
    for (int isa = 0; isa < VEC_PORTABLE && !failed; isa++) {
        if (isa_name && strcmp(isa_name, vec_isa_name((vec_isa_t)isa)))
            continue;
        if (!vec_isa_use((vec_isa_t)isa)) {
            printf("\nkernels: %s: not on this machine\n", vec_isa_name((vec_isa_t)isa));
            continue;
        }
        failed = run_isa(be, reps, min_ms * 1e-3, (int)max_side);
        ran++;
    }
    be->destroy(be);
    if (failed)
        return 1;
    if (!ran) {
        fprintf(stderr, "conv_bench: --isa %s: not one of avx512, avx2 that this machine runs\n",
                isa_name ? isa_name : "");
        return 2;
    }
    return 0;
}
