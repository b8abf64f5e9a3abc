/* Attention's inner loops (vec_attn.h): vec_attn_kernel.inc instantiated
 * per instruction set and element type, dispatched by vec_isa(). */
#include "kernels/cpu/vec_attn.h"

#include <stdint.h>

#include "kernels/cpu/vec_isa.h"

/* Rows a kernel prefetches ahead of the one it reads. */
#define PREFETCH_AHEAD 8

/* One instruction set's kernels for fp32, bf16 and fp16 rows (its
 * vocabulary included first), named dots_<isa>_<type> and axpys_<...>. */
#define ATTN_CAT(f, isa, t) f##_##isa##_##t
#define ATTN_NAME(f, isa, t) ATTN_CAT(f, isa, t)

#include "vec_portable.inc"
#define ATTN_ISA portable
#include "vec_attn_types.inc"
#undef ATTN_ISA
#include "vec_undef.inc"

#include "vec_avx2.inc"
#define ATTN_ISA avx2
#include "vec_attn_types.inc"
#undef ATTN_ISA
#include "vec_undef.inc"

#include "vec_avx512.inc"
#define ATTN_ISA avx512
#include "vec_attn_types.inc"
#undef ATTN_ISA
#include "vec_undef.inc"

typedef void (*dots_fn)(float *, const float *, const void *const *, int, int, float);
typedef void (*axpys_fn)(float *, const float *, const void *const *, int, int);

enum { T_F32, T_BF16, T_F16, T_N };

#define ATTN_ROW(f, isa)                                                                           \
    { ATTN_NAME(f, isa, f32), ATTN_NAME(f, isa, bf16), ATTN_NAME(f, isa, f16) }
static const dots_fn DOTS_FN[VEC_N_ISA][T_N] = {[VEC_AVX512] = ATTN_ROW(dots, avx512),
                                                [VEC_AVX2] = ATTN_ROW(dots, avx2),
                                                [VEC_PORTABLE] = ATTN_ROW(dots, portable)};
static const axpys_fn AXPYS_FN[VEC_N_ISA][T_N] = {[VEC_AVX512] = ATTN_ROW(axpys, avx512),
                                                  [VEC_AVX2] = ATTN_ROW(axpys, avx2),
                                                  [VEC_PORTABLE] = ATTN_ROW(axpys, portable)};

static int type_index(dtype_t t) {
    return t == DTYPE_BF16 ? T_BF16 : t == DTYPE_F16 ? T_F16 : T_F32;
}

void vec_dots(float *scores, const float *q, const void *const *k, dtype_t kt, int n, int d,
              float scale) {
    DOTS_FN[vec_isa()][type_index(kt)](scores, q, k, n, d, scale);
}

void vec_axpys(float *acc, const float *p, const void *const *v, dtype_t vt, int n, int d) {
    AXPYS_FN[vec_isa()][type_index(vt)](acc, p, v, n, d);
}
