/* Model families as a table: a family is how a model turns a request into
 * steps. It owns the request's KV geometry (its condition prefix, then its
 * segments: lines for raster models, scales for next-scale ones), the
 * forward pass that advances requests one step, and the image decoder that
 * turns finished or unfinished tokens into pixels. The planner, the
 * policies and the generation loop ask the family; none of them computes
 * "steps" or "tokens per step" itself. */
#ifndef ARSERVE_MODEL_FAMILY_H
#define ARSERVE_MODEL_FAMILY_H

#include <stdint.h>

#include "base/status.h"
#include "engine/model_config.h"
#include "engine/policy/kv_policy.h"
#include "engine/weights.h"

struct model;
struct gen_request;
struct vq_work;
struct backend;

typedef struct model_family {
    const char *name;                 /* arserve.json "family" */
    const char *const *architectures; /* its "architecture" values, NULL-terminated */
    const char *segment_name;         /* what a segment is called: "line" or "scale" */
    const char *models_name;          /* what its models are called: "raster", "next-scale" */
    /* The KV geometry of a request whose condition prefix has n_prompt
     * tokens, of image size `size` (an index into image.sizes; 0 for a
     * model with one size), cfg already validated. */
    void (*geometry)(const model_config_t *cfg, int n_prompt, int size, kv_geometry_t *g);
    /* Optional (NULL: 1): values a request keeps per image token (Infinity:
     * one per bit). */
    int (*token_width)(const model_config_t *cfg);
    /* Loads the family's networks from ws onto m->be into m->net (which
     * only the family reads); frees what it took on failure. */
    int (*load)(struct model *m, weight_set_t *ws, ar_error_t *err);
    void (*free)(struct model *m);
    /* One forward pass over both sequences of every request in reqs (each
     * feeding what its current step feeds, collecting key mass where its
     * collect flags say), then each request's tokens of the step sampled
     * (or taken from its forced tokens) into its token array. */
    int (*step)(struct model *m, struct gen_request *const *reqs, int n, ar_error_t *err);
    /* The image from a request's tokens after n_done of its steps -> rgb
     * (image_height x image_width x 3): the finished image when n_done is
     * every step, else a preview. Runs on w's backend (m->be or a fork of
     * it), touching nothing of m but its read-only weights and config, so
     * a thread other than the one stepping may draw. */
    int (*draw)(const struct model *m, struct vq_work *w, const int *tokens, int size, int n_done,
                uint8_t *rgb, ar_error_t *err);
    /* The backend memory a draw needs: w's buffers (vq_work_bytes) and
     * whatever the family allocates per draw, in *n_buffers allocations. */
    size_t (*draw_bytes)(const struct model *m, size_t *n_buffers);
    /* A draw's buffers on be (draw_bytes of it), made once and reused by
     * every draw on that backend; NULL when they do not fit (err says why). */
    struct vq_work *(*draw_work_new)(const struct model *m, struct backend *be, ar_error_t *err);
    void (*draw_work_free)(struct vq_work *w); /* accepts NULL */
} model_family_t;

/* The first family called name; NULL if there is none. */
const model_family_t *model_family_find(const char *name);
/* The family called name whose architectures include arch; NULL if none. */
const model_family_t *model_family_find_arch(const char *name, const char *arch);
/* "raster" (the names, comma-separated) into buf; returns buf. */
const char *model_family_list(char *buf, size_t cap);
/* Every architecture of the families called name ("var, infinity") into
 * buf; returns buf. */
const char *model_family_architectures(const char *name, char *buf, size_t cap);
/* 1 when arch is one of f's architectures. */
int model_family_has_architecture(const model_family_t *f, const char *arch);

/* The family of a validated config. */
const model_family_t *model_family_of(const model_config_t *cfg);
/* The KV geometry of a request of this model with n_prompt prefix tokens,
 * at the model's default image size. */
void model_geometry(const model_config_t *cfg, int n_prompt, kv_geometry_t *g);
/* The same at image size `size` (an index into image.sizes, checked by the
 * caller). */
void model_geometry_sized(const model_config_t *cfg, int n_prompt, int size, kv_geometry_t *g);
/* The image size whose scales are g's (a next-scale geometry), or -1. */
int model_size_of_geometry(const model_config_t *cfg, const kv_geometry_t *g);
/* The size named "WxH" (as the API's size field), or -1; names, when not
 * NULL, gets the model's size names, comma-separated. */
int model_size_by_name(const model_config_t *cfg, const char *name, char *names, size_t cap);
/* AR_OK when every calibration of s fits this model (its layers and heads,
 * and the scales of one of its sizes); else the message names the first
 * that does not. */
int model_check_calibrations(const model_config_t *cfg, const struct kv_calibration_set *s,
                             ar_error_t *err);
/* Steps of every request of this model (the prefix does not change them). */
int model_steps(const model_config_t *cfg);
/* Image tokens of every request of this model. */
int model_image_tokens(const model_config_t *cfg);
/* The pixels of image size `size` (0: the default, the only one of a
 * model with one size). */
void model_image_dims(const model_config_t *cfg, int size, int *width, int *height);
/* Values a request keeps per image token (the family's token width: 1,
 * or Infinity's bits). */
int model_token_width(const model_config_t *cfg);
/* Image tokens one image gets at step t (0-based) of this model: 1 for a
 * raster model, the whole scale t for a next-scale one; 0 past the last
 * step. Its CFG pair samples these once: the unconditional sequence's
 * logits only steer them. */
int model_step_tokens(const model_config_t *cfg, int t);
/* The same for a request of image size `size`. */
int model_step_tokens_sized(const model_config_t *cfg, int size, int t);

#endif
