/* Winograd F(2x2, 3x3) convolution over gemm_packed (conv_winograd.h). With
 * B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1], G = [1 0 0; .5 .5 .5;
 * .5 -.5 .5; 0 0 1] and A^T = [1 1 1 0; 0 1 -1 -1]: a tile's patch d is
 * transformed as V = B^T d B (additions only), multiplied element-wise by
 * U = G g G^T and summed over the input channels (the GEMMs), and the sum
 * M turned back into the 2x2 outputs by A^T M A. */
#include "kernels/cpu/conv_winograd.h"
#include "kernels/cpu/gemm_amx.h"

#include <assert.h>
#include <string.h>

#include "kernels/cpu/gemm_packed.h"
#include "kernels/cpu/vec_isa.h"

size_t winograd_weight_floats(int c_out, int c_in) {
    return (size_t)WINOGRAD_POS * (size_t)c_out * (size_t)c_in;
}

void winograd_weights(float *u, const float *w, int c_out, int c_in) {
    const size_t plane = (size_t)c_out * c_in;
    for (int co = 0; co < c_out; co++)
        for (int ci = 0; ci < c_in; ci++) {
            const float *g = w + ((size_t)co * c_in + ci) * 9;
            float gg[4][3]; /* G g: rows of G times the kernel's columns */
            for (int c = 0; c < 3; c++) {
                const float g0 = g[c], g1 = g[3 + c], g2 = g[6 + c];
                gg[0][c] = g0;
                gg[1][c] = 0.5f * (g0 + g1 + g2);
                gg[2][c] = 0.5f * (g0 - g1 + g2);
                gg[3][c] = g2;
            }
            for (int r = 0; r < 4; r++) { /* (G g) G^T */
                const float a = gg[r][0], b = gg[r][1], c = gg[r][2];
                const float row[4] = {a, 0.5f * (a + b + c), 0.5f * (a - b + c), c};
                for (int s = 0; s < 4; s++)
                    u[(size_t)(4 * r + s) * plane + (size_t)co * c_in + ci] = row[s];
            }
        }
}

int64_t winograd_tiles(int ho, int wo) { return (int64_t)((ho + 1) / 2) * ((wo + 1) / 2); }

/* Tiles rounded up to whole panels: the width of a block's GEMMs. */
static int padded(int n) { return (n + GEMM_PANEL - 1) / GEMM_PANEL * GEMM_PANEL; }

/* Input channels the bf16 path transforms at a time, then rounds into the
 * tiles' layout while they are in cache: one k block of the tiles. */
#define BF16_CHANNELS 32

/* Floats of the scratch each path takes: the transformed patches (fp32 all
 * the channels at once; bf16 a chunk of them in fp32, then every channel
 * rounded, each position's a padded(n) x gemm_amx_pad(c_in) operand) and
 * the sums. */
static size_t f32_floats(int c_in, int c_out, int n) {
    return (size_t)WINOGRAD_POS * ((size_t)c_in + (size_t)c_out) * (size_t)padded(n);
}

static size_t bf16_floats(int c_in, int c_out, int n) {
    const size_t chunk = (size_t)(c_in < BF16_CHANNELS ? c_in : BF16_CHANNELS);
    return (size_t)WINOGRAD_POS *
           ((chunk + (size_t)c_out) * (size_t)padded(n) + gemm_amx_b_elems(padded(n), c_in) / 2);
}

size_t winograd_scratch_floats(int c_in, int c_out, int n) {
    const size_t a = f32_floats(c_in, c_out, n), b = bf16_floats(c_in, c_out, n);
    return a > b ? a : b;
}

size_t winograd_weight_bf16_elems(int c_out, int c_in) {
    return (size_t)WINOGRAD_POS * gemm_amx_pad(c_out) * gemm_amx_pad(c_in);
}

void winograd_weights_bf16(uint16_t *ub, const float *u, int c_out, int c_in) {
    const size_t per = (size_t)gemm_amx_pad(c_out) * gemm_amx_pad(c_in);
    for (int pos = 0; pos < WINOGRAD_POS; pos++)
        gemm_amx_round(ub + pos * per, u + (size_t)pos * c_out * c_in, c_in, c_out, c_in, 0,
                       gemm_amx_pad(c_out));
}

/* Input columns the patches of a panel's tiles in one row span. */
#define SEG (2 * GEMM_PANEL + 2)

/* The four input rows of a run of len tiles whose patches start at (iy0,
 * ix0): rows[a][s] = plane(iy0 + a, ix0 + s), s < 2 len + 2. A row that
 * lies whole in the image is read where it is; one that does not is copied
 * into seg[a] with 0 outside the image. */
static void patch_rows(const float *rows[4], float seg[4][SEG], const float *plane, int h, int w,
                       int iy0, int ix0, int len) {
    const int cols = 2 * len + 2;
    for (int a = 0; a < 4; a++) {
        const int iy = iy0 + a;
        if (iy < 0 || iy >= h) {
            memset(seg[a], 0, (size_t)cols * sizeof(float));
            rows[a] = seg[a];
            continue;
        }
        const float *row = plane + (size_t)iy * w;
        if (ix0 >= 0 && ix0 + cols <= w) {
            rows[a] = row + ix0;
            continue;
        }
        const int lo = ix0 < 0 ? -ix0 : 0, hi = w - ix0 < cols ? w - ix0 : cols;
        memset(seg[a], 0, (size_t)cols * sizeof(float));
        if (hi > lo)
            memcpy(seg[a] + lo, row + ix0 + lo, (size_t)(hi - lo) * sizeof(float));
        rows[a] = seg[a];
    }
}

#define WINO_CAT(name, isa) name##_##isa
#define WINO_NAME(name, isa) WINO_CAT(name, isa)
#define WINO_FN(name) WINO_NAME(name, WINO_ISA)

#include "vec_avx512.inc"
#define WINO_ISA avx512
#include "conv_winograd_kernel.inc"
#undef WINO_ISA
#include "vec_undef.inc"

#include "vec_avx2.inc"
#define WINO_ISA avx2
#include "conv_winograd_kernel.inc"
#undef WINO_ISA
#include "vec_undef.inc"

#include "vec_portable.inc"
#define WINO_ISA portable
#include "conv_winograd_kernel.inc"
#undef WINO_ISA
#include "vec_undef.inc"

/* An instruction set's transforms. */
typedef struct transforms {
    void (*patches)(float *v, size_t v_pos, const float *const rows[4], int j0, int len);
    void (*sums)(float *plane, int ho, int wo, int oy, int ox, const float *m, size_t m_pos,
                 int len, float b0);
} transforms_t;

static const transforms_t TRANSFORMS[VEC_N_ISA] = {
    [VEC_AVX512] = {transform_patches_avx512, transform_sums_avx512},
    [VEC_AVX2] = {transform_patches_avx2, transform_sums_avx2},
    [VEC_PORTABLE] = {transform_patches_portable, transform_sums_portable},
};

/* The runs of tiles [t, end) that lie in one row of a tile grid tw wide:
 * the next one's row ty, column tx and length. */
static int next_run(int64_t t, int64_t end, int tw, int *ty, int *tx) {
    *ty = (int)(t / tw);
    *tx = (int)(t % tw);
    return (int)(end - t < tw - *tx ? end - t : tw - *tx);
}

/* Channels [ci0, ci0 + cc) of the block's patches, transformed, into v:
 * panel q's channel ci0 + c at v + (q * cc + c) * 16 of each position's
 * cc x np matrix (v_pos floats apart), tiles past n 0. A channel's panels
 * lie next to each other in its rows: read them in turn; a panel's tiles
 * that lie in one row are read as runs of its input rows. */
static void transform_block(float *v, const transforms_t *tf, const float *in, int ci0, int cc,
                            int h, int w, int pad, int tw, int64_t t0, int n) {
    const int np = padded(n);
    const size_t v_pos = (size_t)cc * np;
    if (np > n)
        for (int pos = 0; pos < WINOGRAD_POS; pos++)
            for (int c = 0; c < cc; c++)
                memset(v + pos * v_pos + ((size_t)(np / GEMM_PANEL - 1) * cc + c) * GEMM_PANEL +
                           n % GEMM_PANEL,
                       0, (size_t)(np - n) * sizeof(float));
    for (int c = 0; c < cc; c++)
        for (int q = 0; q * GEMM_PANEL < n; q++) {
            const int64_t first = t0 + q * GEMM_PANEL;
            const int64_t end =
                first + (n - q * GEMM_PANEL < GEMM_PANEL ? n - q * GEMM_PANEL : GEMM_PANEL);
            float *vq = v + ((size_t)q * cc + c) * GEMM_PANEL;
            for (int64_t t = first; t < end;) {
                int ty, tx;
                const int len = next_run(t, end, tw, &ty, &tx);
                float seg[4][SEG];
                const float *rows[4];
                patch_rows(rows, seg, in + (size_t)(ci0 + c) * h * w, h, w, 2 * ty - pad,
                           2 * tx - pad, len);
                tf->patches(vq, v_pos, rows, (int)(t - first), len);
                t += len;
            }
        }
}

/* winograd_conv3x3, its products from u in fp32 or, where ub is not NULL,
 * from ub on the AMX tiles. */
static void conv3x3(float *out, const float *in, const float *u, const uint16_t *ub,
                    const float *bias, int c_in, int c_out, int h, int w, int pad, int64_t t0,
                    int n, float *scratch) {
    const int ho = h + 2 * pad - 2, wo = w + 2 * pad - 2, tw = (wo + 1) / 2;
    assert(ho > 0 && wo > 0 && n > 0 && t0 + n <= winograd_tiles(ho, wo));
    const int np = padded(n);
    const size_t m_pos = (size_t)c_out * np;
    float *m = scratch, *v = scratch + WINOGRAD_POS * m_pos;
    const transforms_t *tf = &TRANSFORMS[vec_isa()];

    /* M[pos] = U[pos] V[pos], summed over the channels. */
    if (ub) {
        /* A chunk of channels transformed, then rounded into each position's operand
         * (its depth rows from ci0) while in cache; the products written, not added. */
        const int cc_max = c_in < BF16_CHANNELS ? c_in : BF16_CHANNELS, Kp = gemm_amx_pad(c_in);
        uint16_t *vb = (uint16_t *)(v + (size_t)WINOGRAD_POS * cc_max * np);
        const size_t vb_pos = gemm_amx_b_elems(np, c_in);
        const size_t ub_pos = (size_t)gemm_amx_pad(c_out) * Kp;
        for (int ci0 = 0; ci0 < c_in; ci0 += BF16_CHANNELS) {
            const int cc = c_in - ci0 < BF16_CHANNELS ? c_in - ci0 : BF16_CHANNELS;
            transform_block(v, tf, in, ci0, cc, h, w, pad, tw, t0, n);
            for (int pos = 0; pos < WINOGRAD_POS; pos++)
                gemm_amx_pack_f32(vb + pos * vb_pos, Kp, ci0, v + (size_t)pos * cc * np, np, cc);
        }
        for (int pos = 0; pos < WINOGRAD_POS; pos++)
            gemm_amx_store(c_out, n, c_in, ub + pos * ub_pos, vb + pos * vb_pos, m + pos * m_pos,
                           np);
    } else {
        const size_t v_pos = (size_t)c_in * np, u_pos = (size_t)c_out * c_in;
        transform_block(v, tf, in, 0, c_in, h, w, pad, tw, t0, n);
        memset(m, 0, WINOGRAD_POS * m_pos * sizeof(float));
        for (int pos = 0; pos < WINOGRAD_POS; pos++)
            gemm_packed(c_out, n, c_in, u + pos * u_pos, c_in, v + pos * v_pos, DTYPE_F32,
                        m + pos * m_pos, np);
    }
    /* The outputs. */
    for (int co = 0; co < c_out; co++)
        for (int64_t t = t0; t < t0 + n;) {
            int ty, tx;
            const int64_t end = (t - t0) / GEMM_PANEL * GEMM_PANEL + GEMM_PANEL + t0;
            const int len = next_run(t, end < t0 + n ? end : t0 + n, tw, &ty, &tx);
            tf->sums(out + (size_t)co * ho * wo, ho, wo, 2 * ty, 2 * tx,
                     m + (size_t)co * np + (t - t0), m_pos, len, bias ? bias[co] : 0.0f);
            t += len;
        }
}

void winograd_conv3x3(float *out, const float *in, const float *u, const float *bias, int c_in,
                      int c_out, int h, int w, int pad, int64_t t0, int n, float *scratch) {
    conv3x3(out, in, u, NULL, bias, c_in, c_out, h, w, pad, t0, n, scratch);
}

void winograd_conv3x3_bf16(float *out, const float *in, const uint16_t *ub, const float *bias,
                           int c_in, int c_out, int h, int w, int pad, int64_t t0, int n,
                           float *scratch) {
    conv3x3(out, in, NULL, ub, bias, c_in, c_out, h, w, pad, t0, n, scratch);
}
