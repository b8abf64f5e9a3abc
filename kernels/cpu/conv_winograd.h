/* 3x3 convolutions by Winograd's minimal filtering F(2x2, 3x3) (Lavin and
 * Gray, "Fast Algorithms for Convolutional Neural Networks", 2016): each
 * 2x2 block of output pixels (a tile) comes from its 4x4 input patch d and
 * the kernel g as Y = A^T [(G g G^T) . (B^T d B)] A, so that a tile's 36
 * multiplies per channel pair become 16. The 16 element-wise products
 * over the channels are 16 GEMMs (gemm_packed: the transformed kernels are
 * its rows, the transformed patches of a block of tiles its panels), which
 * is where the time goes; the transforms are additions.
 *
 * The sums are not the direct convolution's (the patch is combined before
 * it is multiplied), so outputs differ from it by rounding (a few ulps of
 * the largest term, tests/unit/test_conv_winograd.c bounds it). Every
 * output is the same chain of operations whatever the block or the thread
 * that computes it. */
#ifndef ARSERVE_CONV_WINOGRAD_H
#define ARSERVE_CONV_WINOGRAD_H

#include <stddef.h>
#include <stdint.h>

/* Positions of the transformed 4x4 tile: the GEMMs a block makes. */
#define WINOGRAD_POS 16

/* Floats the transformed kernels of a [c_out, c_in, 3, 3] weight take:
 * WINOGRAD_POS matrices [c_out, c_in]. */
size_t winograd_weight_floats(int c_out, int c_in);

/* u = the transformed kernels (G g G^T) of w [c_out, c_in, 3, 3], as
 * position-major matrices u[pos][co][ci]. */
void winograd_weights(float *u, const float *w, int c_out, int c_in);

/* Tiles of the output's tile grid: ceil(ho / 2) * ceil(wo / 2). */
int64_t winograd_tiles(int ho, int wo);

/* Tiles a block transforms and multiplies at most, in the CPU backend and
 * make bench-conv: two AVX-512 tiles of gemm_packed wide. */
#define WINOGRAD_BLOCK_TILES 96
/* The same on the AMX tiles (winograd_conv3x3_bf16): wider, since each
 * block reads every position's rounded kernels (8 MiB at 512 channels) and
 * the tiles are quick to multiply; on the mid-size Infinity's decoder
 * shapes (128 to 512 channels, one thread) 256 tiles against 96 took 0.75
 * to 0.95 of the time. */
#define WINOGRAD_BLOCK_TILES_BF16 256

/* Floats of scratch winograd_conv3x3 needs for a block of n tiles. */
size_t winograd_scratch_floats(int c_in, int c_out, int n);

/* out[co, y, x] = bias[co] (0 when bias is NULL) + the 3x3 correlation of
 * in [c_in, h, w] (zero-padded by pad, stride 1) with the kernels that u
 * holds, for the output pixels of tiles [t0, t0 + n) (row-major over the
 * tile grid of the ho x wo output, ho = h + 2 pad - 2); other pixels of out
 * are not touched. scratch holds winograd_scratch_floats(c_in, c_out, n). */
void winograd_conv3x3(float *out, const float *in, const float *u, const float *bias, int c_in,
                      int c_out, int h, int w, int pad, int64_t t0, int n, float *scratch);

/* cpu_activations bf16 on an AMX CPU (gemm_amx.h): the transformed kernels
 * rounded to bf16, per position a [c_out, c_in] matrix in gemm_amx_round's
 * layout (rows and columns padded to 32), and the convolution with the
 * patches rounded too, the products on the tiles (its error: a bf16
 * rounding of each transformed kernel and patch, docs/cpu-kernels.md). */
size_t winograd_weight_bf16_elems(int c_out, int c_in);
void winograd_weights_bf16(uint16_t *ub, const float *u, int c_out, int c_in);
void winograd_conv3x3_bf16(float *out, const float *in, const uint16_t *ub, const float *bias,
                           int c_in, int c_out, int h, int w, int pad, int64_t t0, int n,
                           float *scratch);

#endif
