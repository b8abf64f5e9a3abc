/* A loaded model directory: config, tokenizer or class names, and its
 * family's networks (engine/family/: raster: the language model and the VQ
 * decoder; scale: the VAR transformer, the Phi convolutions and the VQVAE
 * decoder) on one backend, which only the family reads; and the condition rows it feeds (the
 * conditional row and the unconditional row for classifier-free guidance). */
#ifndef ARSERVE_MODEL_H
#define ARSERVE_MODEL_H

#include "base/arena.h"
#include "engine/backend/backend.h"
#include "engine/format/tokenizer.h"
#include "engine/kv/fp8_scales.h"
#include "engine/model_config.h"
#include "engine/model_family.h"
#include "engine/policy/kv_calibration.h"

/* Longest prompt row (BOS + templated text + image-start) we accept. */
#define MODEL_MAX_PROMPT_TOKENS 1024

typedef struct model {
    char dir[1024];
    model_config_t cfg;
    const model_family_t *family;
    tokenizer_t *tok;
    /* The family's networks and step buffers: its load makes them, its free
     * frees them; nothing but the family reads them. */
    void *net;
    char **class_names; /* scale, when condition.class_names is given: num_classes names */
    int bos_id, pad_id, image_start_id;
    kv_calibration_set_t calib; /* KV_CALIBRATION_FILE when the directory has one */
    fp8_scales_t fp8_scales;    /* FP8_SCALES_FILE when it has one: fp8 caches take its scales */
    size_t weight_bytes;        /* as stored in the files */
    dtype_t weight_dtype;       /* the float type most of them are stored in */
    /* Host scratch of the step path (gen_step and what it calls): grown to
     * the largest step seen, so steady-state steps allocate nothing. */
    arena_t arena;
    /* The image decoder's buffers on be, for gen_decode and gen_preview
     * (made at the first; a thread drawing beside the stepping one keeps
     * its own). */
    struct vq_work *draw;
    backend_t *be;
} model_t;

/* Loads dir/arserve.json, its tokenizer and weights, and its KV
 * calibration and fp8 KV scales when there are (which must fit the model).
 * Errors name the file. */
int model_load(model_t *m, const char *dir, backend_t *be, ar_error_t *err);
/* model_load with flags: MODEL_LOAD_UNCHECKED skips the check that every
 * weight is finite (a pass over all of them; model_load makes it). */
#define MODEL_LOAD_UNCHECKED 1u
int model_load_with(model_t *m, const char *dir, backend_t *be, unsigned flags, ar_error_t *err);
void model_free(model_t *m);

/* m->draw, made on m->be at the first call; NULL (err says why) when its
 * buffers do not fit. */
struct vq_work *model_draw_work(model_t *m, ar_error_t *err);

/* The condition rows of a class (scale family): cond = [label], uncond =
 * [num_classes], *n = 1. The message names the valid range. */
int model_prompt_from_class(const model_t *m, int label, int *cond, int *uncond, int *n,
                            ar_error_t *err);

/* The class called name (exactly, as in the model's class names); -1 when
 * there is none or the model has no names. */
int model_class_find(const model_t *m, const char *name);

/* A class written as its name or its number: the class, or -1 when s is
 * neither a class name nor a decimal number in [0, num_classes). */
int model_class_parse(const model_t *m, const char *s);

/* 1 when requests name a class (the scale family), 0 when they give a prompt. */
int model_is_class_conditional(const model_t *m);

/* The warning a prompt's text earns when the model's tokenizer cannot read
 * all of it (words its vocabulary lacks, read as unknown or dropped), for
 * field ("prompt", "negative_prompt"): "prompt: 2 words the model does not
 * know were read as unknown: 'cat', 'sofa' (...)" into out (cap bytes).
 * Returns 1 when there is one, 0 when the model reads every word (and for
 * class-conditional models). */
int model_prompt_warning(const model_t *m, const char *field, const char *text, char *out,
                         size_t cap);

/* Builds the two prompt rows for text (for a class-conditional model: text
 * must be one of its class names exactly): cond = BOS + tokens(template with
 * text) + image-start; uncond = the same length, BOS and image-start kept,
 * everything between replaced by pad (the reference's unconditional row).
 * Rows hold at most MODEL_MAX_PROMPT_TOKENS. */
int model_prompt_from_text(const model_t *m, const char *text, int *cond, int *uncond, int *n,
                           ar_error_t *err);

/* Same, with the templated text's token ids given directly (no tokenizer). */
int model_prompt_from_ids(const model_t *m, const int *ids, int n_ids, int *cond, int *uncond,
                          int *n, ar_error_t *err);

#endif
