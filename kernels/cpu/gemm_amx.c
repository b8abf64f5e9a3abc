/* The bf16 Linear GEMM on AMX tiles (gemm_amx.h).
 *
 * Tiles 0-3 hold a 32 x 32 block of y (2 x 2 tiles of 16 x 16 fp32), 4 and
 * 5 two 16-row strips of the activations 32 deep, 6 and 7 two panels of
 * the weight 32 deep. A tile's dot product takes the weight as pairs of
 * consecutive k side by side ("VNNI" order), the order gemm_packed keeps
 * bf16 panels in, so the weight is read where it lies. */
#include "kernels/cpu/gemm_amx.h"

#include <assert.h>
#include <string.h>

#include "base/dtype.h"
#include "kernels/cpu/gemm_packed.h"
#include "kernels/cpu/vec_isa.h"

#ifndef AMX_BLOCK_BYTES
#define AMX_BLOCK_BYTES (128 * 1024)
#endif
#ifndef AMX_PREFETCH_K
#define AMX_PREFETCH_K 32
#endif
#ifndef AMX_GROUP_BYTES
#define AMX_GROUP_BYTES (512 * 1024)
#endif

/* Pairs of weight panels taken at once, and rows of the activations run
 * against them at a time: each about AMX_*_BYTES, so that both stay in a
 * core's L2 while the tiles go over them. */
static inline int amx_group_pairs(int Kp) {
    const int g = (int)(AMX_GROUP_BYTES / ((size_t)2 * Kp * 16 * sizeof(uint16_t)));
    return g < 1 ? 1 : g;
}

static inline int amx_block_rows(int Kp) {
    const int r = (int)(AMX_BLOCK_BYTES / ((size_t)Kp * sizeof(uint16_t))) / 32 * 32;
    return r < 32 ? 32 : r;
}

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_ok;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

/* CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE; then Linux hands the
 * tile state out only to a process that asks. */
static void amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)))
        return;
    amx_ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int gemm_amx_usable(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_ok && vec_isa() == VEC_AVX512; /* ARSERVE_ISA=avx2 plays a CPU without */
}

/* The tile configuration: palette 1, every tile 16 rows of 64 bytes. */
typedef struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

/* Palette 1, every tile 16 rows of 64 bytes. */
__attribute__((target("amx-tile"))) static void tiles_configure(void) {
    tile_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Columns [0, nc) (nc <= 32) of y += xb times the pair of
 * panels b0, b1 (Kp deep), every row of xb (y = the product where not
 * accumulate: y is not read); the tiles configured. */
__attribute__((target("amx-tile,amx-bf16"))) static void
panel_pair(int M, int nc, int Kp, const uint16_t *xb, const uint16_t *b0, const uint16_t *b1,
           float *y, int ldy, int accumulate) {
    float c[32 * 32] __attribute__((aligned(64)));
    const size_t a_stride = (size_t)Kp * sizeof(uint16_t);
    for (int m0 = 0; m0 < M; m0 += 32) {
        const int mc = M - m0 < 32 ? M - m0 : 32, full = mc == 32 && nc == 32;
        /* A whole block's tiles come from y itself; an edge's through c. */
        float *cb = full ? y + (size_t)m0 * ldy : c;
        const size_t cs = full ? (size_t)ldy * sizeof(float) : 128,
                     c16 = full ? 16 * (size_t)ldy : 16 * 32;
        if (!accumulate) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        } else {
            if (!full)
                for (int r = 0; r < 32; r++) {
                    memset(c + r * 32, 0, 32 * sizeof(float));
                    if (r < mc)
                        memcpy(c + r * 32, y + (size_t)(m0 + r) * ldy, (size_t)nc * sizeof(float));
                }
            _tile_loadd(0, cb, cs);
            _tile_loadd(1, cb + 16, cs);
            _tile_loadd(2, cb + c16, cs);
            _tile_loadd(3, cb + c16 + 16, cs);
        }
        const uint16_t *a0 = xb + (size_t)m0 * Kp, *a1 = a0 + (size_t)16 * Kp;
        for (int k0 = 0; k0 < Kp; k0 += 32) {
            if (M <= 32) /* one block of rows: the weight streams from memory once */
                for (int l = 0; l < 16; l++) {
                    _mm_prefetch((const char *)(b0 + (size_t)(k0 + AMX_PREFETCH_K) * GEMM_PANEL) +
                                     64 * l,
                                 _MM_HINT_T0);
                    _mm_prefetch((const char *)(b1 + (size_t)(k0 + AMX_PREFETCH_K) * GEMM_PANEL) +
                                     64 * l,
                                 _MM_HINT_T0);
                }
            _tile_loadd(4, a0 + k0, a_stride);
            _tile_loadd(5, a1 + k0, a_stride);
            _tile_loadd(6, b0 + (size_t)k0 * GEMM_PANEL, 64);
            _tile_loadd(7, b1 + (size_t)k0 * GEMM_PANEL, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, cb, cs);
        _tile_stored(1, cb + 16, cs);
        _tile_stored(2, cb + c16, cs);
        _tile_stored(3, cb + c16 + 16, cs);
        for (int r = 0; !full && r < mc; r++)
            memcpy(y + (size_t)(m0 + r) * ldy, c + r * 32, (size_t)nc * sizeof(float));
    }
}

__attribute__((target("amx-tile,amx-bf16"))) static void amx_run(int M, int N, int K,
                                                                 const uint16_t *xb,
                                                                 const uint16_t *wb, float *y,
                                                                 int ldy, int accumulate) {
    if (M <= 0 || N <= 0)
        return;
    if (K <= 0) {
        for (int r = 0; !accumulate && r < M; r++)
            memset(y + (size_t)r * ldy, 0, (size_t)N * sizeof(float));
        return;
    }
    const int Kp = gemm_amx_pad(K), n_panels = (N + GEMM_PANEL - 1) / GEMM_PANEL;
    const size_t panel = (size_t)Kp * GEMM_PANEL;
    const int group = amx_group_pairs(Kp), mb = amx_block_rows(Kp);
    tiles_configure();
    for (int p0 = 0; p0 < n_panels; p0 += 2 * group) {
        const int p_end = n_panels - p0 < 2 * group ? n_panels : p0 + 2 * group;
        for (int m0 = 0; m0 < M; m0 += mb) {
            const int mc = M - m0 < mb ? M - m0 : mb;
            for (int p = p0; p < p_end; p += 2) {
                /* A lone last panel is read twice; the second copy's
                 * columns, past N, are not stored. */
                const uint16_t *b0 = wb + (size_t)p * panel,
                               *b1 = p + 1 < n_panels ? b0 + panel : b0;
                const int n0 = p * GEMM_PANEL, nc = N - n0 < 32 ? N - n0 : 32;
                panel_pair(mc, nc, Kp, xb + (size_t)m0 * Kp, b0, b1, y + (size_t)m0 * ldy + n0, ldy,
                           accumulate);
            }
        }
    }
    _tile_release();
}

void gemm_amx(int M, int N, int K, const uint16_t *xb, const uint16_t *wb, float *y, int ldy) {
    amx_run(M, N, K, xb, wb, y, ldy, 1);
}

void gemm_amx_store(int M, int N, int K, const uint16_t *xb, const uint16_t *wb, float *y,
                    int ldy) {
    amx_run(M, N, K, xb, wb, y, ldy, 0);
}

/* n floats to bf16, to nearest even (NaN stays a quiet NaN; subnormal
 * inputs, far below any activation, round to zero): 16 at a time by
 * AVX512-BF16's conversion, which every AMX CPU has; elsewhere one by one. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void
to_bf16_avx512(uint16_t *dst, const float *src, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        _mm256_mask_storeu_epi16(dst + i, k,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, src + i)));
    }
}

/* Two rows of a panel (k and k + 1, 16 floats each) rounded into one row of
 * 16 pairs: the two rows' bf16 side by side, then interleaved by one
 * permutation. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void
pack_f32_avx512(uint16_t *dst, const float *src, int n_panels, int K, int Kp, int rows) {
    const __m512i pick =
        _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int p = 0; p < n_panels; p++) {
        const float *panel = src + (size_t)p * K * GEMM_PANEL;
        uint16_t *to = dst + (size_t)p * Kp * GEMM_PANEL;
        for (int k = 0; k < rows; k += 2) {
            const __m512 r0 =
                k < K ? _mm512_loadu_ps(panel + (size_t)k * GEMM_PANEL) : _mm512_setzero_ps();
            const __m512 r1 = k + 1 < K ? _mm512_loadu_ps(panel + (size_t)(k + 1) * GEMM_PANEL)
                                        : _mm512_setzero_ps();
            const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(r1, r0);
            _mm512_storeu_si512(to + (size_t)k * GEMM_PANEL, _mm512_permutexvar_epi16(pick, two));
        }
    }
}

void gemm_amx_to_bf16(uint16_t *dst, const float *src, size_t n) {
    if (gemm_amx_usable()) {
        to_bf16_avx512(dst, src, n);
        return;
    }
    for (size_t i = 0; i < n; i++)
        dst[i] = f32_to_bf16(src[i]);
}

#else /* no AMX off x86-64 */

void gemm_amx_to_bf16(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = f32_to_bf16(src[i]);
}

int gemm_amx_usable(void) { return 0; }

void gemm_amx(int M, int N, int K, const uint16_t *xb, const uint16_t *wb, float *y, int ldy) {
    (void)M, (void)N, (void)K, (void)xb, (void)wb, (void)y, (void)ldy;
}

void gemm_amx_store(int M, int N, int K, const uint16_t *xb, const uint16_t *wb, float *y,
                    int ldy) {
    (void)M, (void)N, (void)K, (void)xb, (void)wb, (void)y, (void)ldy;
}

#endif

static void pack_f32_portable(uint16_t *dst, const float *src, int n_panels, int K, int Kp,
                              int rows) {
    for (int p = 0; p < n_panels; p++)
        for (int k = 0; k < rows; k++)
            for (int j = 0; j < GEMM_PANEL; j++)
                dst[gemm_amx_b_at(p * GEMM_PANEL + j, k, Kp)] =
                    k < K ? f32_to_bf16(src[((size_t)p * K + k) * GEMM_PANEL + j]) : 0;
}

void gemm_amx_pack_f32(uint16_t *dst, int Kp, int k0, const float *src, int N, int K) {
    const int n_panels = (N + GEMM_PANEL - 1) / GEMM_PANEL, rows = gemm_amx_pad(K);
    assert(k0 % GEMM_TILE_DEPTH == 0 && k0 + rows <= Kp);
    /* Row k of a panel starts k * GEMM_PANEL elements in (rows in pairs). */
    dst += (size_t)k0 * GEMM_PANEL;
#if defined(__x86_64__)
    if (gemm_amx_usable()) {
        pack_f32_avx512(dst, src, n_panels, K, Kp, rows);
        return;
    }
#endif
    pack_f32_portable(dst, src, n_panels, K, Kp, rows);
}

int gemm_amx_pad(int n) { return gemm_packed_depth(n, DTYPE_BF16); }

size_t gemm_amx_b_elems(int N, int K) { return (size_t)gemm_amx_pad(N) * gemm_amx_pad(K); }

void gemm_amx_round(uint16_t *xb, const float *x, int ldx, int M, int K, int r0, int r1) {
    const int Kp = gemm_amx_pad(K);
    for (int r = r0; r < r1; r++) {
        uint16_t *dst = xb + (size_t)r * Kp;
        if (r >= M) {
            memset(dst, 0, (size_t)Kp * sizeof *dst);
            continue;
        }
        gemm_amx_to_bf16(dst, x + (size_t)r * ldx, (size_t)K);
        memset(dst + K, 0, (size_t)(Kp - K) * sizeof *dst);
    }
}
