/* The VQ-16 image decoder of Janus-Pro and LlamaGen (and, as "msvq", VAR's
 * multi-scale VQVAE decoder, which starts from a latent map and has a 3x3
 * post-quant conv): codebook lookup with L2 normalisation, post-quant conv, conv_in, mid (ResNet,
 * attention, ResNet), upsampling levels of ResNet blocks, GroupNorm + swish + conv_out, then 8-bit
 * RGB by the model's pixel conversion (vq_pixel_to_u8). As "bsq", Infinity's BSQ-VAE decoder:
 * the latent map straight into conv_in, no attention anywhere. */
#ifndef ARSERVE_VQ_DECODER_H
#define ARSERVE_VQ_DECODER_H

#include <stdint.h>

#include "engine/backend/backend.h"
#include "engine/model_config.h"
#include "engine/weights.h"

typedef struct vq_resblock {
    int c_in, c_out;
    tensor_t norm1_w, norm1_b, conv1_w, conv1_b, norm2_w, norm2_b, conv2_w, conv2_b;
    tensor_t nin_w, nin_b; /* only when c_in != c_out */
} vq_resblock_t;

typedef struct vq_attnblock {
    int c;
    tensor_t norm_w, norm_b, q_w, q_b, k_w, k_b, v_w, v_b, proj_w, proj_b;
} vq_attnblock_t;

typedef struct vq_level {
    int n_blocks, n_attn;
    vq_resblock_t *blocks;
    vq_attnblock_t *attn;
    int has_upsample;
    tensor_t up_w, up_b;
} vq_level_t;

typedef struct vq_decoder {
    const model_config_t *cfg;
    backend_t *be;
    tensor_t codebook, pq_w, pq_b, conv_in_w, conv_in_b;
    vq_resblock_t mid1, mid2;
    vq_attnblock_t mid_attn;
    int n_levels;
    vq_level_t levels[MODEL_MAX_LEVELS];
    tensor_t norm_out_w, norm_out_b, conv_out_w, conv_out_b;
    int bsq; /* decoder.type "bsq": no codebook, post-quant conv or attention */
} vq_decoder_t;

int vq_decoder_load(vq_decoder_t *d, const model_config_t *cfg, weight_set_t *ws, backend_t *be,
                    ar_error_t *err);
void vq_decoder_free(vq_decoder_t *d);

/* The decoder's buffers on one backend, sized for the model's image at
 * vq_work_init and reused by every decode on that backend: the thread that
 * draws images keeps one, so a decode allocates nothing. be may be a fork
 * of the backend the weights were loaded on (backend.h). */
typedef struct vq_work {
    backend_t *be;
    float *rows, *latent;               /* the codebook rows, then (E, h*w) */
    float *a, *b, *t1, *t2, *q, *k, *v; /* activations, each the largest one */
    float *scores;                      /* the attention matrix, (h*w)^2 */
    float *host;                        /* the output (3, H, W), downloaded */
    size_t positions;                   /* the most h * w they hold: the largest latent's */
} vq_work_t;

/* The backend memory vq_work_init allocates, in *n_buffers allocations
 * (n_buffers may be NULL). */
size_t vq_work_bytes(const vq_decoder_t *d, size_t *n_buffers);
int vq_work_init(vq_work_t *w, const vq_decoder_t *d, backend_t *be, ar_error_t *err);
void vq_work_free(vq_work_t *w); /* and zeroes it; accepts a zeroed one */
/* vq_work_init into a new allocation, and its free (accepts NULL). */
vq_work_t *vq_work_new(const vq_decoder_t *d, backend_t *be, ar_error_t *err);
void vq_work_delete(vq_work_t *w);

/* Decodes grid_height * grid_width tokens (raster order) into rgb, which
 * holds image_height * image_width * 3 bytes (row-major, RGB), on w's
 * backend. When pixels_f32 is not NULL it also receives the decoder output
 * before conversion, (3, H, W). */
int vq_decode(const vq_decoder_t *d, vq_work_t *w, const int *tokens, uint8_t *rgb,
              float *pixels_f32, ar_error_t *err);

/* Decodes a latent map (embed_dim, grid_height, grid_width) in the memory
 * of w's backend (VAR's accumulated f_hat) the same way, from
 * post_quant_conv on. latent may be w->latent. */
int vq_decode_latent(const vq_decoder_t *d, vq_work_t *w, const float *latent, uint8_t *rgb,
                     float *pixels_f32, ar_error_t *err);

/* The same for a latent of h x w (a model with several image sizes);
 * h * w at most the largest size's (vq_largest_latent); past it an error,
 * never a write past the buffers. */
int vq_decode_latent_hw(const vq_decoder_t *d, vq_work_t *w, const float *latent, int h, int w_,
                        uint8_t *rgb, float *pixels_f32, ar_error_t *err);

/* The latent map of the model's largest image size (the buffers' size). */
void vq_largest_latent(const model_config_t *cfg, size_t *h, size_t *w);

/* The post-quant convolution's kernel: 1 for vq16, 3 for msvq. */
int vq_post_quant_kernel(const model_config_t *cfg);

/* The pixel conversion, decoder.pixels: clip((x + 1) / 2 * 255, 0, 255)
 * truncated (Janus), or clamp(127.5 x + 128, 0, 255) truncated, i.e. rounded
 * (LlamaGen's sample scripts and torchvision's save_image). */
uint8_t vq_pixel_to_u8(float x, vq_pixels_t mode);

#endif
