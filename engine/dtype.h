/* Element types of weights and their conversions to fp32. Compute is fp32;
 * weights may be stored as fp32, fp16 or bf16. */
#ifndef ARSERVE_DTYPE_H
#define ARSERVE_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Storage types. Backends compute with the float types; the integer types
 * appear only in data files (golden data, token lists). */
typedef enum dtype { DTYPE_F32 = 0, DTYPE_F16, DTYPE_BF16, DTYPE_I32, DTYPE_I64, DTYPE_U8 } dtype_t;

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
        return 1;
    }
    return 0;
}

/* The safetensors spelling of each type. */
static inline const char *dtype_name(dtype_t t) {
    static const char *names[] = {"F32", "F16", "BF16", "I32", "I64", "U8"};
    return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "?";
}

static inline int dtype_is_float(dtype_t t) {
    return t == DTYPE_F32 || t == DTYPE_F16 || t == DTYPE_BF16;
}

/* How many of the n values at data (a float type) are NaN or infinite, read
 * from their bit patterns (all exponent bits set); *first is the index of
 * the first, when there is one. */
static inline size_t dtype_count_nonfinite(const void *data, dtype_t t, size_t n, size_t *first) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        int inf_or_nan;
        if (t == DTYPE_F32) {
            uint32_t u;
            memcpy(&u, (const char *)data + 4 * i, 4);
            inf_or_nan = (u & 0x7f800000u) == 0x7f800000u;
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

/* Converts n elements of float type t at src (any alignment: src may point
 * into a memory-mapped file) to fp32 at dst. */
static inline void dtype_to_f32(float *dst, const void *src, dtype_t t, size_t n) {
    const unsigned char *s = (const unsigned char *)src; /* the cast keeps this header C++-clean */
    if (t == DTYPE_F32) {
        memcpy(dst, src, n * 4);
    } else {
        int bf = t == DTYPE_BF16;
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = bf ? bf16_to_f32(h) : f16_to_f32(h);
        }
    }
}

#endif
