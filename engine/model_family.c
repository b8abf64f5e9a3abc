/* The table of model families (model_family.h) and what derives from it. */
#include "engine/model_family.h"

#include <stdio.h>
#include <string.h>

#include "base/text.h"
#include "engine/policy/kv_calibration.h"

extern const model_family_t model_family_raster, model_family_scale, model_family_infinity;

/* Several entries may share a name (the scale family: VAR and Infinity):
 * the architecture picks one. */
static const model_family_t *const families[] = {&model_family_raster, &model_family_scale,
                                                 &model_family_infinity};
#define N_FAMILIES (int)(sizeof families / sizeof families[0])

const model_family_t *model_family_find(const char *name) {
    for (int i = 0; name && i < N_FAMILIES; i++)
        if (strcmp(name, families[i]->name) == 0)
            return families[i];
    return NULL;
}

const model_family_t *model_family_find_arch(const char *name, const char *arch) {
    for (int i = 0; name && i < N_FAMILIES; i++)
        if (strcmp(name, families[i]->name) == 0 &&
            model_family_has_architecture(families[i], arch))
            return families[i];
    return NULL;
}

const char *model_family_list(char *buf, size_t cap) {
    size_t used = 0;
    if (cap)
        buf[0] = 0;
    for (int i = 0; i < N_FAMILIES; i++)
        if (model_family_find(families[i]->name) == families[i])
            text_append(buf, cap, &used, "%s%s", used ? ", " : "", families[i]->name);
    return buf;
}

/* Every architecture of the families called name, comma-separated. */
const char *model_family_architectures(const char *name, char *buf, size_t cap) {
    size_t used = 0;
    if (cap)
        buf[0] = 0;
    for (int i = 0; i < N_FAMILIES; i++)
        for (const char *const *a = families[i]->architectures;
             strcmp(name, families[i]->name) == 0 && *a; a++)
            text_append(buf, cap, &used, "%s%s", used ? ", " : "", *a);
    return buf;
}

int model_family_has_architecture(const model_family_t *f, const char *arch) {
    for (const char *const *a = f->architectures; arch && *a; a++)
        if (strcmp(*a, arch) == 0)
            return 1;
    return 0;
}

const model_family_t *model_family_of(const model_config_t *cfg) {
    const model_family_t *f = model_family_find_arch(cfg->family, cfg->architecture);
    /* model_config_parse accepts only the table's families. */
    return f ? f : families[0];
}

void model_geometry(const model_config_t *cfg, int n_prompt, kv_geometry_t *g) {
    model_geometry_sized(cfg, n_prompt, cfg->image.default_size, g);
}

void model_geometry_sized(const model_config_t *cfg, int n_prompt, int size, kv_geometry_t *g) {
    model_family_of(cfg)->geometry(cfg, n_prompt, size, g);
}

static int n_sizes(const model_config_t *cfg) {
    return cfg->image.n_sizes > 0 ? cfg->image.n_sizes : 1;
}

int model_size_of_geometry(const model_config_t *cfg, const kv_geometry_t *g) {
    for (int size = 0; size < n_sizes(cfg); size++) {
        kv_geometry_t z;
        model_geometry_sized(cfg, g->n_prompt, size, &z);
        int same = z.n_segments == g->n_segments;
        for (int i = 0; same && i < z.n_segments; i++)
            same = z.segment_tokens[i] == g->segment_tokens[i];
        if (same)
            return size;
    }
    return -1;
}

int model_size_by_name(const model_config_t *cfg, const char *name, char *names, size_t cap) {
    int found = -1;
    size_t used = 0;
    if (names && cap)
        names[0] = 0;
    for (int size = 0; size < n_sizes(cfg); size++) {
        int w, h;
        char here[32];
        model_image_dims(cfg, size, &w, &h);
        snprintf(here, sizeof here, "%dx%d", w, h);
        if (found < 0 && strcmp(here, name) == 0)
            found = size;
        if (names && used < cap)
            used += (size_t)snprintf(names + used, cap - used, "%s%s", size ? ", " : "", here);
    }
    return found;
}

int model_check_calibrations(const model_config_t *cfg, const kv_calibration_set_t *s,
                             ar_error_t *err) {
    for (int i = 0; i < s->n; i++) {
        const kv_calibration_t *c = &s->c[i];
        kv_geometry_t g;
        model_geometry(cfg, 1, &g);
        if (c->n_layers != g.n_layers || c->n_heads != g.n_heads)
            kv_calibration_check(c, &g, err); /* names the layers and heads */
        else {
            /* Its size by name, or an unnamed entry's by its scales. */
            int size = c->size[0] ? model_size_by_name(cfg, c->size, NULL, 0) : -1;
            if (!c->size[0]) {
                g.n_segments = c->n_scales;
                memcpy(g.segment_tokens, c->scale_tokens, sizeof g.segment_tokens);
                size = model_size_of_geometry(cfg, &g);
            } else if (size >= 0) {
                model_geometry_sized(cfg, 1, size, &g);
                if (kv_calibration_check(c, &g, err) != AR_OK)
                    size = -1;
            }
            if (size >= 0)
                continue;
            if (c->size[0])
                ar_errorf(err,
                          "the KV calibration was made at %s, which the model has not, or not "
                          "with those scales: run `arserve calibrate` on it",
                          c->size);
            else
                ar_errorf(err,
                          "the KV calibration's scales (the last of %d tokens) are none of the "
                          "model's image sizes': run `arserve calibrate` on it",
                          c->scale_tokens[c->n_scales - 1]);
        }
        if (s->n > 1)
            ar_error_prefix(err, "calibration %d of %d", i + 1, s->n);
        return AR_ERR;
    }
    return AR_OK;
}

int model_steps(const model_config_t *cfg) {
    kv_geometry_t g;
    model_geometry(cfg, 1, &g);
    return kv_geometry_steps(&g);
}

int model_image_tokens(const model_config_t *cfg) {
    kv_geometry_t g;
    model_geometry(cfg, 1, &g);
    return kv_geometry_image_tokens(&g);
}

void model_image_dims(const model_config_t *cfg, int size, int *width, int *height) {
    const image_config_t *im = &cfg->image;
    *width = model_config_image_width(cfg);
    *height = model_config_image_height(cfg);
    if (size > 0 && size < im->n_sizes) {
        /* Other sizes scale the default's pixels by their last scale. */
        const image_size_t *z = &im->sizes[size], *d = &im->sizes[0];
        *width = *width / d->w[d->n_scales - 1] * z->w[z->n_scales - 1];
        *height = *height / d->h[d->n_scales - 1] * z->h[z->n_scales - 1];
    }
}

int model_token_width(const model_config_t *cfg) {
    const model_family_t *f = model_family_of(cfg);
    return f->token_width ? f->token_width(cfg) : 1;
}

int model_step_tokens(const model_config_t *cfg, int t) {
    return model_step_tokens_sized(cfg, 0, t);
}

int model_step_tokens_sized(const model_config_t *cfg, int size, int t) {
    kv_geometry_t g;
    model_geometry_sized(cfg, 1, size, &g);
    return kv_geometry_sampled(&g, t);
}
