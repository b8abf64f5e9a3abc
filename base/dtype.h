/* Element types of weights and of the KV cache, and their conversions to
 * and from fp32. Compute is fp32; weights may be stored as fp32, fp16 or
 * bf16; the KV cache as any of those or fp8 (e4m3). */
#ifndef ARSERVE_DTYPE_H
#define ARSERVE_DTYPE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Storage types. Backends compute with the float types; I32, I64 and U8
 * appear only in data files (golden data, token lists). DTYPE_F8_E4M3 (the
 * OCP "e4m3fn" format: no infinities, the largest finite value 448) is a
 * KV cache type and, with DTYPE_I8 (int8, -127 to 127), an 8-bit Linear
 * weight's: one fp32 scale per output row beside it (docs/model-format.md,
 * backend.h's weight_load_8bit). */
typedef enum dtype {
    DTYPE_F32 = 0,
    DTYPE_F16,
    DTYPE_BF16,
    DTYPE_I32,
    DTYPE_I64,
    DTYPE_U8,
    DTYPE_F8_E4M3,
    DTYPE_I8
} dtype_t;

static inline size_t dtype_size(dtype_t t) {
    switch (t) {
    case DTYPE_F32:
    case DTYPE_I32:
        return 4;
    case DTYPE_F16:
    case DTYPE_BF16:
        return 2;
    case DTYPE_I64:
        return 8;
    case DTYPE_U8:
    case DTYPE_F8_E4M3:
    case DTYPE_I8:
        return 1;
    }
    return 0;
}

/* The safetensors spelling of each type. */
static inline const char *dtype_name(dtype_t t) {
    static const char *names[] = {"F32", "F16", "BF16", "I32", "I64", "U8", "F8_E4M3", "I8"};
    return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "?";
}

static inline int dtype_is_float(dtype_t t) {
    return t == DTYPE_F32 || t == DTYPE_F16 || t == DTYPE_BF16;
}

/* The 8-bit types a Linear weight may be stored in (with its scales). */
static inline int dtype_is_weight8(dtype_t t) { return t == DTYPE_I8 || t == DTYPE_F8_E4M3; }

/* How many of the n values at data (a float type or fp8 e4m3) are NaN or
 * infinite, read from their bit patterns (all exponent bits set); *first is the index of
 * the first, when there is one. */
static inline size_t dtype_count_nonfinite(const void *data, dtype_t t, size_t n, size_t *first) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        int inf_or_nan;
        if (t == DTYPE_F32) {
            uint32_t u;
            memcpy(&u, (const char *)data + 4 * i, 4);
            inf_or_nan = (u & 0x7f800000u) == 0x7f800000u;
        } else if (t == DTYPE_F8_E4M3) { /* no infinities; NaN is S.1111.111 */
            inf_or_nan = (((const unsigned char *)data)[i] & 0x7fu) == 0x7fu;
        } else {
            uint16_t h;
            memcpy(&h, (const char *)data + 2 * i, 2);
            inf_or_nan = t == DTYPE_BF16 ? (h & 0x7f80u) == 0x7f80u : (h & 0x7c00u) == 0x7c00u;
        }
        if (inf_or_nan && !bad++)
            *first = i;
    }
    return bad;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) {
                man <<= 1;
                exp--;
            }
            u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* kept, the leading bits of a value, rounded to nearest even by its
 * dropped bits rest, half being the weight of half a unit of kept. A carry
 * out of the mantissa into the exponent is what rounding up means there. */
static inline uint32_t round_half_even(uint32_t kept, uint32_t rest, uint32_t half) {
    return kept + (rest > half || (rest == half && (kept & 1u)));
}

/* Round to nearest even; overflow gives infinity and NaN stays NaN, as
 * torch's .half(). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) /* rounds to 65520 or more: infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {   /* below 2^-14: a subnormal (or zero) of step 2^-24 */
        if (a < 0x33000000u) /* at most 2^-25: rounds to zero */
            return sign;
        const uint32_t man = (a & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)(a >> 23); /* 14..24 */
        return (uint16_t)(sign | round_half_even(man >> shift, man & ((1u << shift) - 1),
                                                 1u << (shift - 1)));
    }
    const uint32_t h = ((a >> 13) - ((127u - 15u) << 10)) & 0xffffu;
    return (uint16_t)(sign | round_half_even(h, a & 0x1fffu, 0x1000u));
}

/* fp8 e4m3 ("e4m3fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits;
 * subnormals below 2^-6 in steps of 2^-9; 0x7f and 0xff are NaN. */
static inline float f8e4m3_to_f32(uint8_t b) {
    const float sign = (b & 0x80u) ? -1.0f : 1.0f;
    const int exp = (b >> 3) & 0xf, man = b & 7;
    if (exp == 0xf && man == 7) {
        const uint32_t nan = 0x7fc00000u;
        float f;
        memcpy(&f, &nan, 4);
        return f;
    }
    if (exp == 0)
        return sign * (float)man * (1.0f / 512.0f);
    const uint32_t u = ((uint32_t)(exp - 7 + 127) << 23) | ((uint32_t)man << 20);
    float f;
    memcpy(&f, &u, 4);
    return sign * f;
}

/* Round to nearest even, saturating: a magnitude past 448 becomes 448 (as
 * an fp8 KV cache stores, CUDA's __NV_SATFINITE); NaN stays NaN. */
static inline uint8_t f32_to_f8e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint8_t)(sign | 0x7fu);
    if (a >= 0x43e00000u) /* 448 or more (infinity included) */
        return (uint8_t)(sign | 0x7eu);
    if (a < 0x3c800000u) { /* below 2^-6: multiples of 2^-9; 8 of them is 2^-6, code 0x08 */
        float m;
        memcpy(&m, &a, 4);
        return (uint8_t)(sign | (uint8_t)nearbyintf(m * 512.0f));
    }
    const uint32_t code =
        round_half_even((((a >> 23) - 127u + 7u) << 3) | ((a >> 20) & 7u), a & 0xfffffu, 0x80000u);
    return (uint8_t)(sign | (code > 0x7eu ? 0x7eu : code));
}

/* Converts n elements of float type t (fp8 included) at src (any
 * alignment: src may point into a memory-mapped file) to fp32 at dst. */
static inline void dtype_to_f32(float *dst, const void *src, dtype_t t, size_t n) {
    const unsigned char *s = (const unsigned char *)src; /* the cast keeps this header C++-clean */
    if (t == DTYPE_F32) {
        memcpy(dst, src, n * 4);
    } else if (t == DTYPE_F8_E4M3) {
        for (size_t i = 0; i < n; i++)
            dst[i] = f8e4m3_to_f32(s[i]);
    } else {
        int bf = t == DTYPE_BF16;
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = bf ? bf16_to_f32(h) : f16_to_f32(h);
        }
    }
}

/* The reverse: n fp32 values at src to float type t at dst, each rounded
 * to nearest even (fp8 saturating, see f32_to_f8e4m3). */
static inline void dtype_from_f32(void *dst, const float *src, dtype_t t, size_t n) {
    unsigned char *d = (unsigned char *)dst;
    if (t == DTYPE_F32) {
        memcpy(dst, src, n * 4);
    } else if (t == DTYPE_F8_E4M3) {
        for (size_t i = 0; i < n; i++)
            d[i] = f32_to_f8e4m3(src[i]);
    } else {
        for (size_t i = 0; i < n; i++) {
            const uint16_t h = t == DTYPE_BF16 ? f32_to_bf16(src[i]) : f32_to_f16(src[i]);
            memcpy(d + 2 * i, &h, 2);
        }
    }
}

#endif
