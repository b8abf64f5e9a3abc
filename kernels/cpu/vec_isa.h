/* The vector instruction set the CPU kernels run with (kernels/cpu/gemm_rows.c,
 * kernels/cpu/vec_attn.c): the best this machine has, chosen once at run time,
 * or one a test or bench asks for. */
#ifndef ARSERVE_VEC_ISA_H
#define ARSERVE_VEC_ISA_H

/* Best first. */
typedef enum vec_isa { VEC_AVX512, VEC_AVX2, VEC_PORTABLE, VEC_N_ISA } vec_isa_t;

/* The environment variable that chooses the kernels' instruction set for a
 * whole process (a name of vec_isa_name's), instead of the best one. */
#define VEC_ISA_ENV "ARSERVE_ISA"

/* The one the kernels run now. */
vec_isa_t vec_isa(void);
/* "avx512", "avx2", "portable" ("?" out of range). */
const char *vec_isa_name(vec_isa_t isa);
/* 1 when this machine runs isa's kernels (AVX-512F; AVX2 with FMA and F16C;
 * any). */
int vec_isa_supported(vec_isa_t isa);
/* Makes the kernels run isa's versions; 0 (and no change) when this machine
 * cannot. */
int vec_isa_use(vec_isa_t isa);

/* The kernels' attribute that keeps ThreadSanitizer out of them (as it
 * never saw inside OpenBLAS, which did their work before): they read
 * weights, read-only once loaded, and write what belongs to the calling
 * thread, and instrumented they made the TSan suite 40 s slower. */
#if defined(__SANITIZE_THREAD__)
#define VEC_NO_TSAN __attribute__((no_sanitize("thread")))
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define VEC_NO_TSAN __attribute__((no_sanitize("thread")))
#endif
#endif
#ifndef VEC_NO_TSAN
#define VEC_NO_TSAN
#endif

/* The vocabularies' VLOAD_F8 widen an fp8 e4m3 element to its value / this
 * (the fp16 with its bits, which F16C converts); whoever scales what they
 * return multiplies the 256 back in with the scale. */
#define VEC_F8_DIV 256.0f

#endif
