/* Attention's inner loops (vec_attn.h): vec_attn_kernel.inc instantiated
 * per instruction set, dispatched by vec_isa(). */
#include "vec_attn.h"

#include <immintrin.h>

#include "vec_isa.h"

/* Rows a kernel prefetches ahead of the one it reads. */
#define PREFETCH_AHEAD 8

#define TARGET
#define VEC float
#define VLEN 1
#define VZERO() 0.0f
#define VLOAD(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VSET1(x) (x)
#define VADD(a, b) ((a) + (b))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VHSUM(v) (v)
#define DOTS dots_portable
#define AXPYS axpys_portable
#include "vec_attn_kernel.inc"
#undef TARGET
#undef VEC
#undef VLEN
#undef VZERO
#undef VLOAD
#undef VSTORE
#undef VSET1
#undef VADD
#undef VFMA
#undef VHSUM

__attribute__((target("avx2,fma"))) static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define TARGET __attribute__((target("avx2,fma")))
#define VEC __m256
#define VLEN 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(x) _mm256_set1_ps(x)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VHSUM(v) hsum_avx2(v)
#define DOTS dots_avx2
#define AXPYS axpys_avx2
#include "vec_attn_kernel.inc"
#undef TARGET
#undef VEC
#undef VLEN
#undef VZERO
#undef VLOAD
#undef VSTORE
#undef VSET1
#undef VADD
#undef VFMA
#undef VHSUM

#define TARGET __attribute__((target("avx512f")))
#define VEC __m512
#define VLEN 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(x) _mm512_set1_ps(x)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define DOTS dots_avx512
#define AXPYS axpys_avx512
#include "vec_attn_kernel.inc"

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
