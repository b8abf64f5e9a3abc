/* The model directory's arserve.json: architecture, prompt template and
 * default sampling parameters (docs/model-format.md). Reading is strict: an
 * unknown or missing key is an error naming the file and the key path. */
#ifndef ARSERVE_MODEL_CONFIG_H
#define ARSERVE_MODEL_CONFIG_H

#include "base/status.h"
#include "engine/policy/kv_policy.h"
#include "engine/sampler.h"

#define MODEL_MAX_LEVELS 8
#define MODEL_MAX_WEIGHT_FILES 16

#define MODEL_MAX_SCALES 32
/* Infinity's aspect-ratio templates: 15 in the released schedules. */
#define MODEL_MAX_SIZES 16

/* The transformer that holds the KV cache, whatever the family. For the
 * scale family vocab_size is the class table's rows (num_classes + 1),
 * num_kv_heads = num_heads, and norm_eps is LayerNorm's; rope_theta is 0. */
typedef struct llm_config {
    int vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim;
    int intermediate_size;
    float norm_eps, rope_theta;
    int shared_adaln; /* scale family: one AdaLN table for every block */
} llm_config_t;

/* One image size a next-scale model serves (Infinity: an aspect-ratio
 * template at the model's schedule): the token map of every scale, coarsest
 * first, and the grid 2D RoPE positions are scaled to (the last scale of the
 * 1M schedule of that aspect ratio). VAR has one, square. */
typedef struct image_size {
    char name[24]; /* "WIDTHxHEIGHT" in pixels, as the API's size field */
    int n_scales;
    int h[MODEL_MAX_SCALES], w[MODEL_MAX_SCALES];
    int rope_h, rope_w; /* Infinity only */
} image_size_t;

typedef struct image_config {
    int grid_height, grid_width; /* raster: lines, tokens per line; scale: the last scale */
    int codebook_size, embed_dim;
    int aligner_layers, head_hidden_size; /* raster, janus (both 0 for llamagen) */
    /* scale family: sides of the square token maps, coarsest first */
    int n_scales, scales[MODEL_MAX_SCALES];
    int phi_count;   /* shared residual convolutions */
    float phi_ratio; /* Phi(h) = (1 - r) h + r conv(h) */
    /* scale family: the sizes a request may ask for (VAR: one, its scales),
     * the default first (default_size is 0); grid_height/width and n_scales
     * describe the default (scales is VAR's, square) */
    int n_sizes, default_size;
    image_size_t sizes[MODEL_MAX_SIZES];
    /* infinity: bits per token the transformer predicts (embed_dim is the
     * same number), and the 2x2 spatial patchify of Infinity-8B (the VAE's
     * latent is then twice each side of the token map, with bits / 4
     * channels) */
    int bits, spatial_patchify;
} image_config_t;

/* Infinity's text encoder: a T5 encoder (flan-t5-xl's for the released
 * models) and what turns its output into the transformer's condition. */
typedef struct text_config {
    int vocab_size, hidden_size, num_layers, num_heads, head_dim, intermediate_size;
    int relative_buckets, relative_max_distance; /* T5's relative position bias */
    float norm_eps;
    int max_tokens; /* the longest prompt, in tokens with </s> (rows of cfg_uncond) */
    int pool_heads; /* heads of the attentive pool that makes the start token */
    int eos_id;     /* </s>, appended to every prompt */
} text_config_t;

/* What a class-conditional request (scale family, raster llamagen) is
 * conditioned on: a class. */
typedef struct condition_config {
    int num_classes;       /* class num_classes is the unconditional one */
    char class_names[256]; /* optional file, one name per line ("" when none) */
} condition_config_t;

/* How the decoder's output x (about [-1, 1]) becomes an 8-bit value. */
typedef enum vq_pixels {
    VQ_PIXELS_TRUNCATE, /* Janus: clip((x + 1) / 2 * 255, 0, 255), truncated */
    VQ_PIXELS_ROUND,    /* LlamaGen: clamp(127.5 x + 128, 0, 255), truncated (rounds) */
} vq_pixels_t;

typedef struct decoder_config {
    char type[16]; /* "vq16", or "msvq" (a 3x3 post-quant conv, no normalised lookup) */
    int latent_channels, base_channels, num_res_blocks, out_channels;
    int n_levels, channel_multiplier[MODEL_MAX_LEVELS];
    vq_pixels_t pixels; /* optional key "pixels": "truncate" (default) or "round" */
} decoder_config_t;

typedef struct prompt_config {
    char template_text[1024]; /* holds "{prompt}" once */
    char bos_token[64], pad_token[64], image_start_token[64];
} prompt_config_t;

typedef struct model_config {
    char name[128];
    char family[16];       /* "raster" or "scale" */
    char architecture[16]; /* raster: "janus" or "llamagen"; scale: "var" or "infinity" */
    int n_weight_files;
    char weight_files[MODEL_MAX_WEIGHT_FILES][256];
    char tokenizer[256];
    llm_config_t llm;
    image_config_t image;
    decoder_config_t decoder;
    prompt_config_t prompt;       /* raster, janus */
    condition_config_t condition; /* scale; raster, llamagen */
    text_config_t text;           /* scale, infinity */
    sampler_params_t sampling;
    /* "kv_budgets" (optional): a policy's budget on this model when neither
     * a request nor the server's settings give one; 0: the policy's own. */
    double kv_budgets[KV_POLICY_COUNT];
    /* Not from arserve.json: the model directory's KV calibrations (one per
     * image size calibrated), set by model_load when it has them (or by
     * `arserve plan`, synthetic ones). */
    const struct kv_calibration_set *kv_calibrations;
} model_config_t;

/* The card's kv_budgets into the defaults requests resolve against. */
static inline void model_config_kv_card(const model_config_t *cfg, kv_policy_params_t *defaults) {
    for (int k = 0; k < KV_POLICY_COUNT; k++)
        defaults->card_budgets[k] = cfg->kv_budgets[k];
}

/* 1 when the model reads its prompt with a text encoder (Infinity's T5),
 * which also takes a negative prompt as its unconditional row. */
static inline int model_config_has_text_encoder(const model_config_t *cfg) {
    return cfg->text.max_tokens > 0;
}

/* Parses and validates the arserve.json at path. */
int model_config_load(model_config_t *cfg, const char *path, ar_error_t *err);

/* Same, from a JSON text; `path` only names the source in messages. */
int model_config_parse(model_config_t *cfg, const char *json, size_t len, const char *path,
                       ar_error_t *err);

/* Image side in pixels: grid << (levels - 1). */
int model_config_image_height(const model_config_t *cfg);
int model_config_image_width(const model_config_t *cfg);

#endif
