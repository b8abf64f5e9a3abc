/* Run-time choice of the CPU kernels' instruction set (vec_isa.h). */
#include "kernels/cpu/vec_isa.h"

#include <cpuid.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* F16C (fp16 conversions), which every AVX2 processor has; asked of cpuid,
 * as clang's __builtin_cpu_supports does not know the name. */
static int has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

int vec_isa_supported(vec_isa_t isa) {
    __builtin_cpu_init();
    switch (isa) {
    case VEC_AVX512:
        return __builtin_cpu_supports("avx512f");
    case VEC_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case VEC_PORTABLE:
        return 1;
    default:
        return 0;
    }
}

static vec_isa_t chosen = VEC_N_ISA;
static pthread_once_t choose_once = PTHREAD_ONCE_INIT;

/* The best this machine runs, or the one ARSERVE_ISA names (the whole test
 * suite on the AVX2 kernels of an AVX-512 machine: ARSERVE_ISA=avx2); a name
 * this machine cannot run is said on stderr and the best is used. */
static void choose_best(void) {
    int isa = 0;
    while (!vec_isa_supported((vec_isa_t)isa))
        isa++;
    const char *asked = getenv(VEC_ISA_ENV);
    if (asked && *asked) {
        int i = 0;
        while (i < VEC_N_ISA && strcmp(asked, vec_isa_name((vec_isa_t)i)))
            i++;
        if (i < VEC_N_ISA && vec_isa_supported((vec_isa_t)i))
            isa = i;
        else
            fprintf(stderr,
                    "arserve: %s=%s: not one of avx512, avx2, portable that this machine runs; "
                    "using %s\n",
                    VEC_ISA_ENV, asked, vec_isa_name((vec_isa_t)isa));
    }
    __atomic_store_n(&chosen, (vec_isa_t)isa, __ATOMIC_RELEASE);
}

vec_isa_t vec_isa(void) {
    pthread_once(&choose_once, choose_best);
    return __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
}

int vec_isa_use(vec_isa_t isa) {
    if ((unsigned)isa >= VEC_N_ISA || !vec_isa_supported(isa))
        return 0;
    pthread_once(&choose_once, choose_best);
    __atomic_store_n(&chosen, isa, __ATOMIC_RELEASE);
    return 1;
}

const char *vec_isa_name(vec_isa_t isa) {
    static const char *const names[VEC_N_ISA] = {"avx512", "avx2", "portable"};
    return (unsigned)isa < VEC_N_ISA ? names[isa] : "?";
}
