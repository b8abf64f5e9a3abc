/* The model directory's arserve.json: architecture, prompt template and
 * default sampling parameters (docs/model-format.md). Reading is strict: an
 * unknown or missing key is an error naming the file and the key path. */
#ifndef ARSERVE_MODEL_CONFIG_H
#define ARSERVE_MODEL_CONFIG_H

#include "sampler.h"
#include "status.h"

#define MODEL_MAX_LEVELS 8
#define MODEL_MAX_WEIGHT_FILES 16

typedef struct llm_config {
    int vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim;
    int intermediate_size;
    float rms_norm_eps, rope_theta;
} llm_config_t;

typedef struct image_config {
    int grid_height, grid_width; /* lines, tokens per line */
    int codebook_size, embed_dim;
    int aligner_layers, head_hidden_size;
} image_config_t;

typedef struct decoder_config {
    char type[16]; /* "vq16" */
    int latent_channels, base_channels, num_res_blocks, out_channels;
    int n_levels, channel_multiplier[MODEL_MAX_LEVELS];
} decoder_config_t;

typedef struct prompt_config {
    char template_text[1024]; /* holds "{prompt}" once */
    char bos_token[64], pad_token[64], image_start_token[64];
} prompt_config_t;

typedef struct model_config {
    char name[128];
    char family[16];       /* "raster" */
    char architecture[16]; /* "janus" */
    int n_weight_files;
    char weight_files[MODEL_MAX_WEIGHT_FILES][256];
    char tokenizer[256];
    llm_config_t llm;
    image_config_t image;
    decoder_config_t decoder;
    prompt_config_t prompt;
    sampler_params_t sampling;
} model_config_t;

/* Parses and validates the arserve.json at path. */
int model_config_load(model_config_t *cfg, const char *path, ar_error_t *err);

/* Same, from a JSON text; `path` only names the source in messages. */
int model_config_parse(model_config_t *cfg, const char *json, size_t len, const char *path,
                       ar_error_t *err);

/* Image side in pixels: grid << (levels - 1). */
int model_config_image_height(const model_config_t *cfg);
int model_config_image_width(const model_config_t *cfg);

#endif
