/* Attention's inner loops (vec_attn.h): vec_attn_kernel.inc instantiated
 * per instruction set, dispatched by vec_isa(). */
#include "kernels/cpu/vec_attn.h"

#include "kernels/cpu/vec_isa.h"

/* Rows a kernel prefetches ahead of the one it reads. */
#define PREFETCH_AHEAD 8

#include "vec_portable.inc"
#define DOTS dots_portable
#define AXPYS axpys_portable
#include "vec_attn_kernel.inc"
#include "vec_undef.inc"

#include "vec_avx2.inc"
#define DOTS dots_avx2
#define AXPYS axpys_avx2
#include "vec_attn_kernel.inc"
#include "vec_undef.inc"

#include "vec_avx512.inc"
#define DOTS dots_avx512
#define AXPYS axpys_avx512
#include "vec_attn_kernel.inc"
#include "vec_undef.inc"

void vec_dots(float *scores, const float *q, const float *const *k, int n, int d, float scale) {
    switch (vec_isa()) {
    case VEC_AVX512:
        dots_avx512(scores, q, k, n, d, scale);
        return;
    case VEC_AVX2:
        dots_avx2(scores, q, k, n, d, scale);
        return;
    default:
        dots_portable(scores, q, k, n, d, scale);
        return;
    }
}

void vec_axpys(float *acc, const float *p, const float *const *v, int n, int d) {
    switch (vec_isa()) {
    case VEC_AVX512:
        axpys_avx512(acc, p, v, n, d);
        return;
    case VEC_AVX2:
        axpys_avx2(acc, p, v, n, d);
        return;
    default:
        axpys_portable(acc, p, v, n, d);
        return;
    }
}
