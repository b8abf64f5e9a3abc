/* Strict reader for arserve.json (docs/model-format.md): every value is
 * type- and range-checked, and every error names the file and the key path. */
#include "engine/model_config.h"

#include "base/file.h"
#include "engine/format/json_strict.h"
#include "engine/model_family.h"
#include "engine/policy/kv_policy.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Where we are while reading: the file for messages and the object's path. */
typedef struct ctx {
    const char *file;
    const char *path; /* "" at the top level, else "llm" etc. */
    ar_error_t *err;
} ctx_t;

static const char *key_path(const ctx_t *c, const char *key, char *buf, size_t n) {
    if (c->path[0])
        snprintf(buf, n, "%s.%s", c->path, key);
    else
        snprintf(buf, n, "%s", key);
    return buf;
}

/* Fails on keys of obj that are not in allowed (NULL-terminated). */
static int check_keys(const ctx_t *c, const cJSON *obj, const char *const *allowed) {
    for (const cJSON *it = obj->child; it; it = it->next) {
        int known = 0;
        for (const char *const *a = allowed; *a; a++)
            known |= strcmp(*a, it->string) == 0;
        char kp[256];
        if (!known)
            return ar_errorf(c->err, "%s: unknown key '%s'", c->file,
                             key_path(c, it->string, kp, sizeof kp));
        for (const cJSON *jt = it->next; jt; jt = jt->next)
            if (strcmp(jt->string, it->string) == 0)
                return ar_errorf(c->err, "%s: duplicate key '%s'", c->file,
                                 key_path(c, it->string, kp, sizeof kp));
    }
    return AR_OK;
}

static const cJSON *get_item(const ctx_t *c, const cJSON *obj, const char *key, int required,
                             int *status) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    *status = AR_OK;
    if (!it && required) {
        char kp[256];
        *status = ar_errorf(c->err, "%s: missing required key '%s'", c->file,
                            key_path(c, key, kp, sizeof kp));
    }
    return it;
}

static int get_int(const ctx_t *c, const cJSON *obj, const char *key, int lo, int hi, int *out) {
    int st;
    const cJSON *it = get_item(c, obj, key, 1, &st);
    if (!it)
        return st;
    char kp[256];
    key_path(c, key, kp, sizeof kp);
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) ||
        floor(it->valuedouble) != it->valuedouble)
        return ar_errorf(c->err, "%s: '%s' must be an integer", c->file, kp);
    if (it->valuedouble < lo || it->valuedouble > hi)
        return ar_errorf(c->err, "%s: '%s' is %.0f, outside [%d, %d]", c->file, kp, it->valuedouble,
                         lo, hi);
    *out = (int)it->valuedouble;
    return AR_OK;
}

static int get_float(const ctx_t *c, const cJSON *obj, const char *key, double lo, double hi,
                     float *out) {
    int st;
    const cJSON *it = get_item(c, obj, key, 1, &st);
    if (!it)
        return st;
    char kp[256];
    key_path(c, key, kp, sizeof kp);
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble))
        return ar_errorf(c->err, "%s: '%s' must be a number", c->file, kp);
    if (it->valuedouble < lo || it->valuedouble > hi)
        return ar_errorf(c->err, "%s: '%s' is %g, outside [%g, %g]", c->file, kp, it->valuedouble,
                         lo, hi);
    *out = (float)it->valuedouble;
    return AR_OK;
}

/* A norm's epsilon: in (0, 1] as a float (0, or a value float rounds to 0,
 * divides a zero row by zero). */
static int get_eps(const ctx_t *c, const cJSON *obj, const char *key, float *out) {
    if (get_float(c, obj, key, 0, 1, out))
        return AR_ERR;
    if (*out > 0)
        return AR_OK;
    char kp[256];
    key_path(c, key, kp, sizeof kp);
    return ar_errorf(c->err, "%s: '%s' is %g; a norm's epsilon must be greater than 0 (as a float)",
                     c->file, kp, cJSON_GetObjectItemCaseSensitive(obj, key)->valuedouble);
}

static int get_string(const ctx_t *c, const cJSON *obj, const char *key, int required, char *out,
                      size_t cap) {
    int st;
    const cJSON *it = get_item(c, obj, key, required, &st);
    if (!it)
        return st;
    char kp[256];
    key_path(c, key, kp, sizeof kp);
    if (!cJSON_IsString(it) || !it->valuestring)
        return ar_errorf(c->err, "%s: '%s' must be a string", c->file, kp);
    if (!it->valuestring[0])
        return ar_errorf(c->err, "%s: '%s' is empty", c->file, kp);
    if (strlen(it->valuestring) >= cap)
        return ar_errorf(c->err, "%s: '%s' is longer than %zu bytes", c->file, kp, cap - 1);
    strcpy(out, it->valuestring);
    return AR_OK;
}

static int get_object(const ctx_t *c, const cJSON *obj, const char *key, const cJSON **out,
                      ctx_t *sub, const char *const *allowed) {
    int st;
    const cJSON *it = get_item(c, obj, key, 1, &st);
    if (!it)
        return st;
    char kp[256];
    key_path(c, key, kp, sizeof kp);
    if (!cJSON_IsObject(it))
        return ar_errorf(c->err, "%s: '%s' must be an object", c->file, kp);
    *sub = (ctx_t){c->file, key, c->err};
    *out = it;
    return check_keys(sub, it, allowed);
}

static int get_bool(const ctx_t *c, const cJSON *obj, const char *key, int *out) {
    int st;
    const cJSON *it = get_item(c, obj, key, 1, &st);
    if (!it)
        return st;
    char kp[256];
    if (!cJSON_IsBool(it))
        return ar_errorf(c->err, "%s: '%s' must be true or false", c->file,
                         key_path(c, key, kp, sizeof kp));
    *out = cJSON_IsTrue(it);
    return AR_OK;
}

/* The raster family's Llama-style transformer. Janus-Pro's reads text, so it
 * has a vocabulary; LlamaGen's first token is a class (the table's rows come
 * from condition.num_classes), so it has none. */
static int read_llm(const ctx_t *c, const cJSON *root, int with_vocab, llm_config_t *l) {
    static const char *const keys[] = {
        "vocab_size", "hidden_size",       "num_layers",   "num_heads",  "num_kv_heads",
        "head_dim",   "intermediate_size", "rms_norm_eps", "rope_theta", NULL};
    const cJSON *o;
    ctx_t s;
    if (get_object(c, root, "llm", &o, &s, with_vocab ? keys : keys + 1) ||
        (with_vocab && get_int(&s, o, "vocab_size", 1, 1 << 24, &l->vocab_size)) ||
        get_int(&s, o, "hidden_size", 1, 1 << 16, &l->hidden_size) ||
        get_int(&s, o, "num_layers", 1, 1024, &l->num_layers) ||
        get_int(&s, o, "num_heads", 1, 1024, &l->num_heads) ||
        get_int(&s, o, "num_kv_heads", 1, 1024, &l->num_kv_heads) ||
        get_int(&s, o, "head_dim", 2, 1024, &l->head_dim) ||
        get_int(&s, o, "intermediate_size", 1, 1 << 18, &l->intermediate_size) ||
        get_eps(&s, o, "rms_norm_eps", &l->norm_eps) ||
        get_float(&s, o, "rope_theta", 1, 1e9, &l->rope_theta))
        return AR_ERR;
    if (l->head_dim % 2)
        return ar_errorf(c->err, "%s: 'llm.head_dim' must be even (rotary pairs)", c->file);
    if (l->num_kv_heads != l->num_heads)
        return ar_errorf(c->err,
                         "%s: 'llm.num_kv_heads' (%d) differs from 'llm.num_heads' (%d): "
                         "grouped-query attention is not supported yet",
                         c->file, l->num_kv_heads, l->num_heads);
    return AR_OK;
}

/* The scale family's transformer (VAR): no vocabulary (the class table's
 * rows come from condition.num_classes), no rotary embedding, LayerNorm. */
static int read_llm_scale(const ctx_t *c, const cJSON *root, llm_config_t *l) {
    static const char *const keys[] = {"hidden_size",       "num_layers", "num_heads",
                                       "head_dim",          "norm_eps",   "shared_adaln",
                                       "intermediate_size", NULL};
    const cJSON *o;
    ctx_t s;
    if (get_object(c, root, "llm", &o, &s, keys) ||
        get_int(&s, o, "hidden_size", 1, 1 << 16, &l->hidden_size) ||
        get_int(&s, o, "num_layers", 1, 1024, &l->num_layers) ||
        get_int(&s, o, "num_heads", 1, 1024, &l->num_heads) ||
        get_int(&s, o, "head_dim", 1, 1024, &l->head_dim) ||
        get_int(&s, o, "intermediate_size", 1, 1 << 18, &l->intermediate_size) ||
        get_eps(&s, o, "norm_eps", &l->norm_eps) ||
        get_bool(&s, o, "shared_adaln", &l->shared_adaln))
        return AR_ERR;
    if ((long long)l->num_heads * l->head_dim != l->hidden_size)
        return ar_errorf(c->err,
                         "%s: 'llm.num_heads' x 'llm.head_dim' (%d x %d) must equal "
                         "'llm.hidden_size' (%d)",
                         c->file, l->num_heads, l->head_dim, l->hidden_size);
    l->num_kv_heads = l->num_heads;
    return AR_OK;
}

/* The raster image grid and codebook; Janus-Pro's generation aligner and
 * head (with_janus_head), which LlamaGen has not: its image tokens go
 * through one embedding table and its logits through one Linear, both as
 * wide as the transformer. */
static int read_image(const ctx_t *c, const cJSON *root, int with_janus_head, image_config_t *im) {
    static const char *const keys[] = {"grid_height", "grid_width",     "codebook_size",
                                       "embed_dim",   "aligner_layers", "head_hidden_size",
                                       NULL};
    static const char *const plain_keys[] = {"grid_height", "grid_width", "codebook_size",
                                             "embed_dim", NULL};
    const cJSON *o;
    ctx_t s;
    return get_object(c, root, "image", &o, &s, with_janus_head ? keys : plain_keys) ||
                   get_int(&s, o, "grid_height", 1, 256, &im->grid_height) ||
                   get_int(&s, o, "grid_width", 1, 256, &im->grid_width) ||
                   get_int(&s, o, "codebook_size", 2, 1 << 20, &im->codebook_size) ||
                   get_int(&s, o, "embed_dim", 1, 4096, &im->embed_dim) ||
                   (with_janus_head &&
                    (get_int(&s, o, "aligner_layers", 1, 16, &im->aligner_layers) ||
                     get_int(&s, o, "head_hidden_size", 1, 1 << 16, &im->head_hidden_size)))
               ? AR_ERR
               : AR_OK;
}

/* An array of n integers in [lo, hi] at key (1 <= n <= cap). */
static int get_int_array(const ctx_t *c, const cJSON *obj, const char *key, int cap, int lo, int hi,
                         int *out, int *n_out) {
    int st;
    const cJSON *arr = get_item(c, obj, key, 1, &st);
    if (!arr)
        return st;
    char kp[256];
    key_path(c, key, kp, sizeof kp);
    int n = cJSON_GetArraySize(arr);
    if (!cJSON_IsArray(arr) || n < 1 || n > cap)
        return ar_errorf(c->err, "%s: '%s' must be an array of 1 to %d integers", c->file, kp, cap);
    for (int i = 0; i < n; i++) {
        const cJSON *v = cJSON_GetArrayItem(arr, i);
        if (!cJSON_IsNumber(v) || floor(v->valuedouble) != v->valuedouble || v->valuedouble < lo ||
            v->valuedouble > hi)
            return ar_errorf(c->err, "%s: '%s[%d]' must be an integer in [%d, %d]", c->file, kp, i,
                             lo, hi);
        out[i] = (int)v->valuedouble;
    }
    *n_out = n;
    return AR_OK;
}

static int read_image_scale(const ctx_t *c, const cJSON *root, image_config_t *im) {
    static const char *const keys[] = {"scales",    "codebook_size", "embed_dim",
                                       "phi_count", "phi_ratio",     NULL};
    const cJSON *o;
    ctx_t s;
    if (get_object(c, root, "image", &o, &s, keys) ||
        get_int_array(&s, o, "scales", MODEL_MAX_SCALES, 1, 256, im->scales, &im->n_scales) ||
        get_int(&s, o, "codebook_size", 2, 1 << 20, &im->codebook_size) ||
        get_int(&s, o, "embed_dim", 1, 4096, &im->embed_dim) ||
        get_int(&s, o, "phi_count", 1, 64, &im->phi_count) ||
        get_float(&s, o, "phi_ratio", 0, 1, &im->phi_ratio))
        return AR_ERR;
    if (im->n_scales < 2)
        return ar_errorf(c->err, "%s: 'image.scales' must list at least 2 scales", c->file);
    for (int i = 1; i < im->n_scales; i++)
        if (im->scales[i] <= im->scales[i - 1])
            return ar_errorf(c->err,
                             "%s: 'image.scales' must increase strictly; scales[%d] = %d follows "
                             "%d",
                             c->file, i, im->scales[i], im->scales[i - 1]);
    im->grid_height = im->grid_width = im->scales[im->n_scales - 1];
    return AR_OK;
}

static int read_condition(const ctx_t *c, const cJSON *root, condition_config_t *cond) {
    static const char *const keys[] = {"num_classes", "class_names", NULL};
    const cJSON *o;
    ctx_t s;
    if (get_object(c, root, "condition", &o, &s, keys) ||
        get_int(&s, o, "num_classes", 1, 1 << 20, &cond->num_classes) ||
        get_string(&s, o, "class_names", 0, cond->class_names, sizeof cond->class_names))
        return AR_ERR;
    if (strstr(cond->class_names, "..") || cond->class_names[0] == '/')
        return ar_errorf(c->err,
                         "%s: 'condition.class_names' must be a relative file name inside the "
                         "model directory",
                         c->file);
    return AR_OK;
}

static int read_decoder(const ctx_t *c, const cJSON *root, const char *type, decoder_config_t *d) {
    static const char *const keys[] = {
        "type",           "latent_channels", "base_channels", "channel_multiplier",
        "num_res_blocks", "out_channels",    "pixels",        NULL};
    const cJSON *o;
    ctx_t s;
    char pixels[16] = "truncate";
    if (get_object(c, root, "decoder", &o, &s, keys) ||
        get_string(&s, o, "pixels", 0, pixels, sizeof pixels) ||
        get_string(&s, o, "type", 1, d->type, sizeof d->type) ||
        get_int(&s, o, "latent_channels", 1, 1 << 14, &d->latent_channels) ||
        get_int(&s, o, "base_channels", 32, 1 << 14, &d->base_channels) ||
        get_int(&s, o, "num_res_blocks", 0, 16, &d->num_res_blocks) ||
        get_int(&s, o, "out_channels", 3, 3, &d->out_channels))
        return AR_ERR;
    if (strcmp(d->type, type) != 0)
        return ar_errorf(c->err, "%s: 'decoder.type' is '%s'; this family's decoder is %s", c->file,
                         d->type, type);
    if (strcmp(pixels, "truncate") == 0)
        d->pixels = VQ_PIXELS_TRUNCATE;
    else if (strcmp(pixels, "round") == 0)
        d->pixels = VQ_PIXELS_ROUND;
    else
        return ar_errorf(c->err, "%s: 'decoder.pixels' is '%s'; supported: truncate, round",
                         c->file, pixels);
    if (get_int_array(&s, o, "channel_multiplier", MODEL_MAX_LEVELS, 1, 64, d->channel_multiplier,
                      &d->n_levels))
        return AR_ERR;
    for (int i = 0; i < d->n_levels; i++) {
        if ((d->base_channels * d->channel_multiplier[i]) % 32)
            return ar_errorf(c->err,
                             "%s: decoder level width base_channels*channel_multiplier[%d] = %d is "
                             "not a multiple of 32 (GroupNorm has 32 groups)",
                             c->file, i, d->base_channels * d->channel_multiplier[i]);
    }
    return AR_OK;
}

static int read_prompt(const ctx_t *c, const cJSON *root, prompt_config_t *p) {
    static const char *const keys[] = {"template", "bos_token", "pad_token", "image_start_token",
                                       NULL};
    const cJSON *o;
    ctx_t s;
    if (get_object(c, root, "prompt", &o, &s, keys) ||
        get_string(&s, o, "template", 1, p->template_text, sizeof p->template_text) ||
        get_string(&s, o, "bos_token", 1, p->bos_token, sizeof p->bos_token) ||
        get_string(&s, o, "pad_token", 1, p->pad_token, sizeof p->pad_token) ||
        get_string(&s, o, "image_start_token", 1, p->image_start_token,
                   sizeof p->image_start_token))
        return AR_ERR;
    const char *at = strstr(p->template_text, "{prompt}");
    if (!at || strstr(at + 1, "{prompt}"))
        return ar_errorf(c->err, "%s: 'prompt.template' must contain '{prompt}' exactly once",
                         c->file);
    return AR_OK;
}

static int read_sampling(const ctx_t *c, const cJSON *root, sampler_params_t *sp) {
    static const char *const keys[] = {"cfg", "temperature", "top_k", "top_p", NULL};
    const cJSON *o;
    ctx_t s;
    return get_object(c, root, "sampling", &o, &s, keys) ||
                   get_float(&s, o, "cfg", 0, 100, &sp->cfg) ||
                   get_float(&s, o, "temperature", 0, 100, &sp->temperature) ||
                   get_int(&s, o, "top_k", 0, 1 << 20, &sp->top_k) ||
                   get_float(&s, o, "top_p", 0, 1, &sp->top_p)
               ? AR_ERR
               : AR_OK;
}

/* "kv_budgets": {"linear": 0.25, ...}, optional: each key a policy that
 * takes a budget, each value in (0, 1]. Whether it suits the model's grid
 * is model_load's question (model_check_kv_budgets). */
static int read_kv_budgets(const ctx_t *c, const cJSON *root, model_config_t *cfg) {
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(root, "kv_budgets");
    if (!o)
        return AR_OK;
    if (!cJSON_IsObject(o))
        return ar_errorf(c->err, "%s: 'kv_budgets' must be an object of policy: budget", c->file);
    const cJSON *it;
    cJSON_ArrayForEach(it, o) {
        const int kind = kv_policy_parse(it->string);
        char names[256];
        if (kind < 0)
            return ar_errorf(c->err, "%s: 'kv_budgets.%s': no such kv_policy; one of %s", c->file,
                             it->string, kv_policy_list(names, sizeof names));
        if (!kv_policy_uses_budget((kv_policy_kind_t)kind, NULL))
            return ar_errorf(c->err, "%s: 'kv_budgets.%s': kv_policy %s takes no budget", c->file,
                             it->string, it->string);
        if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) || !(it->valuedouble > 0) ||
            it->valuedouble > 1)
            return ar_errorf(c->err, "%s: 'kv_budgets.%s' must be a number in (0, 1]", c->file,
                             it->string);
        cfg->kv_budgets[kind] = it->valuedouble;
    }
    return AR_OK;
}

static int read_weight_list(const ctx_t *c, const cJSON *root, model_config_t *cfg) {
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(root, "weights");
    if (!arr) {
        cfg->n_weight_files = 1;
        strcpy(cfg->weight_files[0], "model.safetensors");
        return AR_OK;
    }
    int n = cJSON_GetArraySize(arr);
    if (!cJSON_IsArray(arr) || n < 1 || n > MODEL_MAX_WEIGHT_FILES)
        return ar_errorf(c->err, "%s: 'weights' must be an array of 1 to %d file names", c->file,
                         MODEL_MAX_WEIGHT_FILES);
    for (int i = 0; i < n; i++) {
        const cJSON *v = cJSON_GetArrayItem(arr, i);
        if (!cJSON_IsString(v) || !v->valuestring[0] ||
            strlen(v->valuestring) >= sizeof cfg->weight_files[0] || strstr(v->valuestring, "..") ||
            v->valuestring[0] == '/')
            return ar_errorf(c->err,
                             "%s: 'weights[%d]' must be a relative file name inside the model "
                             "directory",
                             c->file, i);
        strcpy(cfg->weight_files[i], v->valuestring);
    }
    cfg->n_weight_files = n;
    return AR_OK;
}

/* The sections after the family and architecture: the raster family's
 * (tokenizer, Llama-style LM, image grid and aligner, VQ-16, prompt) or the
 * scale family's (transformer, scales, class condition, multi-scale VQVAE). */
/* LlamaGen (class-to-image): a class token instead of a prompt, no
 * tokenizer, 2D RoPE (head_dim a multiple of 4, one head group per width). */
static int read_llamagen(const ctx_t *c, const cJSON *root, model_config_t *cfg) {
    static const char *const keys[] = {"format_version", "name",     "family",     "architecture",
                                       "weights",        "llm",      "image",      "condition",
                                       "decoder",        "sampling", "kv_budgets", NULL};
    const llm_config_t *l = &cfg->llm;
    if (check_keys(c, root, keys) || read_llm(c, root, 0, &cfg->llm) ||
        read_image(c, root, 0, &cfg->image) || read_condition(c, root, &cfg->condition) ||
        read_decoder(c, root, "vq16", &cfg->decoder))
        return AR_ERR;
    cfg->llm.vocab_size = cfg->condition.num_classes + 1;
    if (l->head_dim % 4)
        return ar_errorf(c->err,
                         "%s: 'llm.head_dim' (%d) must be a multiple of 4 (2D RoPE: half the "
                         "pairs turn with the row, half with the column)",
                         c->file, l->head_dim);
    if ((long long)l->num_heads * l->head_dim != l->hidden_size)
        return ar_errorf(c->err,
                         "%s: 'llm.num_heads' x 'llm.head_dim' (%d x %d) must equal "
                         "'llm.hidden_size' (%d)",
                         c->file, l->num_heads, l->head_dim, l->hidden_size);
    return AR_OK;
}

static int read_raster(const ctx_t *c, const cJSON *root, model_config_t *cfg) {
    static const char *const keys[] = {
        "format_version", "name",    "family", "architecture", "weights",    "tokenizer", "llm",
        "image",          "decoder", "prompt", "sampling",     "kv_budgets", NULL};
    if (strcmp(cfg->architecture, "llamagen") == 0)
        return read_llamagen(c, root, cfg);
    strcpy(cfg->tokenizer, "tokenizer.json");
    if (check_keys(c, root, keys) ||
        get_string(c, root, "tokenizer", 0, cfg->tokenizer, sizeof cfg->tokenizer) ||
        read_llm(c, root, 1, &cfg->llm) || read_image(c, root, 1, &cfg->image) ||
        read_decoder(c, root, "vq16", &cfg->decoder) || read_prompt(c, root, &cfg->prompt))
        return AR_ERR;
    if (strstr(cfg->tokenizer, "..") || cfg->tokenizer[0] == '/')
        return ar_errorf(c->err,
                         "%s: 'tokenizer' must be a relative file name inside the model directory",
                         c->file);
    return AR_OK;
}

/* VAR's one size: its square scales, named by the image's pixels. */
static void image_single_size(model_config_t *cfg) {
    image_config_t *im = &cfg->image;
    image_size_t *z = &im->sizes[0];
    im->n_sizes = 1;
    im->default_size = 0;
    z->n_scales = im->n_scales;
    for (int i = 0; i < im->n_scales; i++)
        z->h[i] = z->w[i] = im->scales[i];
    snprintf(z->name, sizeof z->name, "%dx%d", model_config_image_width(cfg),
             model_config_image_height(cfg));
}

static int read_scale(const ctx_t *c, const cJSON *root, model_config_t *cfg) {
    static const char *const keys[] = {"format_version", "name",     "family",     "architecture",
                                       "weights",        "llm",      "image",      "condition",
                                       "decoder",        "sampling", "kv_budgets", NULL};
    if (check_keys(c, root, keys) || read_llm_scale(c, root, &cfg->llm) ||
        read_image_scale(c, root, &cfg->image) || read_condition(c, root, &cfg->condition) ||
        read_decoder(c, root, "msvq", &cfg->decoder))
        return AR_ERR;
    cfg->llm.vocab_size = cfg->condition.num_classes + 1;
    if (cfg->decoder.latent_channels != cfg->image.embed_dim)
        return ar_errorf(c->err,
                         "%s: 'decoder.latent_channels' (%d) must equal 'image.embed_dim' (%d): "
                         "the decoder reads the accumulated latent map",
                         c->file, cfg->decoder.latent_channels, cfg->image.embed_dim);
    image_single_size(cfg);
    return AR_OK;
}

/* Infinity's T5 encoder and the condition it feeds. */
static int read_text(const ctx_t *c, const cJSON *root, text_config_t *t) {
    static const char *const keys[] = {"vocab_size", "hidden_size",      "num_layers",
                                       "num_heads",  "head_dim",         "intermediate_size",
                                       "norm_eps",   "relative_buckets", "relative_max_distance",
                                       "max_tokens", "pool_heads",       "eos_id",
                                       NULL};
    const cJSON *o;
    ctx_t s;
    if (get_object(c, root, "text", &o, &s, keys) ||
        get_int(&s, o, "vocab_size", 2, 1 << 20, &t->vocab_size) ||
        get_int(&s, o, "hidden_size", 1, 1 << 16, &t->hidden_size) ||
        get_int(&s, o, "num_layers", 1, 1024, &t->num_layers) ||
        get_int(&s, o, "num_heads", 1, 1024, &t->num_heads) ||
        get_int(&s, o, "head_dim", 1, 1024, &t->head_dim) ||
        get_int(&s, o, "intermediate_size", 1, 1 << 18, &t->intermediate_size) ||
        get_eps(&s, o, "norm_eps", &t->norm_eps) ||
        get_int(&s, o, "relative_buckets", 2, 1024, &t->relative_buckets) ||
        get_int(&s, o, "relative_max_distance", 2, 1 << 16, &t->relative_max_distance) ||
        get_int(&s, o, "max_tokens", 1, 1 << 14, &t->max_tokens) ||
        get_int(&s, o, "pool_heads", 1, 1024, &t->pool_heads) ||
        get_int(&s, o, "eos_id", 0, 1 << 20, &t->eos_id))
        return AR_ERR;
    if (t->eos_id >= t->vocab_size)
        return ar_errorf(c->err, "%s: 'text.eos_id' (%d) is not below 'text.vocab_size' (%d)",
                         c->file, t->eos_id, t->vocab_size);
    if (t->relative_buckets % 2)
        return ar_errorf(c->err,
                         "%s: 'text.relative_buckets' (%d) must be even (bidirectional: half "
                         "for each direction)",
                         c->file, t->relative_buckets);
    if (t->hidden_size % t->pool_heads)
        return ar_errorf(c->err, "%s: 'text.pool_heads' (%d) must divide 'text.hidden_size' (%d)",
                         c->file, t->pool_heads, t->hidden_size);
    return AR_OK;
}

/* A [height, width] pair; what names it in messages (a key path). */
static int get_hw(const ctx_t *c, const cJSON *pair, const char *what, int *h, int *w) {
    if (!cJSON_IsArray(pair) || cJSON_GetArraySize(pair) != 2)
        return ar_errorf(c->err, "%s: '%s' must be a pair [height, width]", c->file, what);
    int v[2];
    for (int k = 0; k < 2; k++) {
        const cJSON *x = cJSON_GetArrayItem(pair, k);
        if (!cJSON_IsNumber(x) || floor(x->valuedouble) != x->valuedouble || x->valuedouble < 1 ||
            x->valuedouble > 256)
            return ar_errorf(c->err, "%s: '%s[%d]' must be an integer in [1, 256]", c->file, what,
                             k);
        v[k] = (int)x->valuedouble;
    }
    *h = v[0];
    *w = v[1];
    return AR_OK;
}

/* image.sizes[i]: {"name", "scales": [[h, w], ...], "rope_grid": [h, w]}. */
static int read_size(const ctx_t *c, const cJSON *o, int i, image_size_t *z) {
    static const char *const keys[] = {"name", "scales", "rope_grid", NULL};
    char kp[64];
    snprintf(kp, sizeof kp, "image.sizes[%d]", i);
    ctx_t s = {c->file, kp, c->err};
    if (!cJSON_IsObject(o))
        return ar_errorf(c->err, "%s: '%s' must be an object", c->file, kp);
    if (check_keys(&s, o, keys) || get_string(&s, o, "name", 1, z->name, sizeof z->name))
        return AR_ERR;
    int st;
    const cJSON *arr = get_item(&s, o, "scales", 1, &st);
    if (!arr)
        return st;
    char sp[96];
    snprintf(sp, sizeof sp, "%s.scales", kp);
    const int n = cJSON_GetArraySize(arr);
    if (!cJSON_IsArray(arr) || n < 2 || n > MODEL_MAX_SCALES)
        return ar_errorf(c->err, "%s: '%s' must be an array of 2 to %d [height, width] pairs",
                         c->file, sp, MODEL_MAX_SCALES);
    z->n_scales = n;
    for (int k = 0; k < n; k++) {
        char ip[112];
        snprintf(ip, sizeof ip, "%s[%d]", sp, k);
        if (get_hw(c, cJSON_GetArrayItem(arr, k), ip, &z->h[k], &z->w[k]))
            return AR_ERR;
        if (k && (z->h[k] < z->h[k - 1] || z->w[k] < z->w[k - 1] ||
                  z->h[k] * z->w[k] <= z->h[k - 1] * z->w[k - 1]))
            return ar_errorf(c->err, "%s: '%s' must grow: [%d, %d] follows [%d, %d]", c->file, sp,
                             z->h[k], z->w[k], z->h[k - 1], z->w[k - 1]);
    }
    const cJSON *rg = get_item(&s, o, "rope_grid", 1, &st);
    if (!rg)
        return st;
    snprintf(sp, sizeof sp, "%s.rope_grid", kp);
    return get_hw(c, rg, sp, &z->rope_h, &z->rope_w);
}

/* Infinity's image section: bits per token, patchify, and its sizes. */
static int read_image_infinity(const ctx_t *c, const cJSON *root, image_config_t *im) {
    static const char *const keys[] = {"bits", "spatial_patchify", "sizes", "default_size", NULL};
    const cJSON *o;
    ctx_t s;
    char def[24];
    if (get_object(c, root, "image", &o, &s, keys) || get_int(&s, o, "bits", 1, 1024, &im->bits) ||
        get_bool(&s, o, "spatial_patchify", &im->spatial_patchify) ||
        get_string(&s, o, "default_size", 1, def, sizeof def))
        return AR_ERR;
    if (im->spatial_patchify && im->bits % 4)
        return ar_errorf(c->err,
                         "%s: 'image.bits' (%d) must be a multiple of 4 with "
                         "'image.spatial_patchify' (2x2 patches of the VAE's bits)",
                         c->file, im->bits);
    int st;
    const cJSON *arr = get_item(&s, o, "sizes", 1, &st);
    if (!arr)
        return st;
    const int n = cJSON_GetArraySize(arr);
    if (!cJSON_IsArray(arr) || n < 1 || n > MODEL_MAX_SIZES)
        return ar_errorf(c->err, "%s: 'image.sizes' must be an array of 1 to %d sizes", c->file,
                         MODEL_MAX_SIZES);
    im->n_sizes = n;
    im->default_size = -1;
    for (int i = 0; i < n; i++) {
        image_size_t *z = &im->sizes[i];
        if (read_size(c, cJSON_GetArrayItem(arr, i), i, z))
            return AR_ERR;
        for (int j = 0; j < i; j++)
            if (strcmp(im->sizes[j].name, z->name) == 0)
                return ar_errorf(c->err, "%s: 'image.sizes' names '%s' twice", c->file, z->name);
        if (z->n_scales != im->sizes[0].n_scales)
            return ar_errorf(c->err,
                             "%s: 'image.sizes[%d]' has %d scales, 'image.sizes[0]' %d: every "
                             "size of a model runs the same schedule",
                             c->file, i, z->n_scales, im->sizes[0].n_scales);
        if (strcmp(z->name, def) == 0)
            im->default_size = i;
    }
    if (im->default_size < 0)
        return ar_errorf(c->err, "%s: 'image.default_size' is '%s', which 'image.sizes' lacks",
                         c->file, def);
    /* The default first, the others in file order: size 0 is the default
     * wherever a size is left zeroed. */
    const image_size_t first = im->sizes[im->default_size];
    memmove(&im->sizes[1], &im->sizes[0], (size_t)im->default_size * sizeof im->sizes[0]);
    im->sizes[0] = first;
    im->default_size = 0;
    im->embed_dim = im->bits;
    return AR_OK;
}

/* Infinity: T5 text encoder, cross-attention transformer with bitwise
 * head, a schedule per aspect ratio, BSQ-VAE decoder (docs/model-format.md). */
static int read_infinity(const ctx_t *c, const cJSON *root, model_config_t *cfg) {
    static const char *const keys[] = {
        "format_version", "name",  "family",  "architecture", "weights",    "tokenizer", "llm",
        "text",           "image", "decoder", "sampling",     "kv_budgets", NULL};
    image_config_t *im = &cfg->image;
    strcpy(cfg->tokenizer, "tokenizer.json");
    if (check_keys(c, root, keys) ||
        get_string(c, root, "tokenizer", 0, cfg->tokenizer, sizeof cfg->tokenizer) ||
        read_llm_scale(c, root, &cfg->llm) || read_text(c, root, &cfg->text) ||
        read_image_infinity(c, root, im) || read_decoder(c, root, "bsq", &cfg->decoder))
        return AR_ERR;
    if (strstr(cfg->tokenizer, "..") || cfg->tokenizer[0] == '/')
        return ar_errorf(c->err,
                         "%s: 'tokenizer' must be a relative file name inside the model directory",
                         c->file);
    if (!cfg->llm.shared_adaln)
        return ar_errorf(c->err,
                         "%s: 'llm.shared_adaln' must be true for infinity (its released models "
                         "share one AdaLN table)",
                         c->file);
    if (cfg->llm.head_dim % 4)
        return ar_errorf(c->err, "%s: 'llm.head_dim' (%d) must be a multiple of 4 (2D RoPE)",
                         c->file, cfg->llm.head_dim);
    const int vae_bits = im->spatial_patchify ? im->bits / 4 : im->bits;
    if (cfg->decoder.latent_channels != vae_bits)
        return ar_errorf(c->err,
                         "%s: 'decoder.latent_channels' (%d) must equal the VAE's bits per "
                         "position (%d: 'image.bits'%s)",
                         c->file, cfg->decoder.latent_channels, vae_bits,
                         im->spatial_patchify ? " / 4, patchified" : "");
    const image_size_t *z = &im->sizes[im->default_size];
    im->n_scales = z->n_scales;
    const int up = im->spatial_patchify ? 2 : 1;
    im->grid_height = z->h[z->n_scales - 1] * up;
    im->grid_width = z->w[z->n_scales - 1] * up;
    for (int i = 0; i < im->n_sizes; i++) {
        const image_size_t *y = &im->sizes[i];
        char want[24];
        snprintf(want, sizeof want, "%dx%d",
                 (y->w[y->n_scales - 1] * up) << (cfg->decoder.n_levels - 1),
                 (y->h[y->n_scales - 1] * up) << (cfg->decoder.n_levels - 1));
        if (strcmp(want, y->name) != 0)
            return ar_errorf(c->err,
                             "%s: 'image.sizes[%d].name' is '%s', but its last scale draws %s "
                             "(WIDTHxHEIGHT pixels)",
                             c->file, i, y->name, want);
    }
    cfg->llm.vocab_size = 0;
    return AR_OK;
}

int model_config_parse(model_config_t *cfg, const char *json, size_t len, const char *path,
                       ar_error_t *err) {
    memset(cfg, 0, sizeof *cfg);
    cJSON *root = json_parse_strict(json, len, JSON_STRICT_DEFAULT_DEPTH, NULL, err);
    if (!root)
        return ar_error_prefix(err, "%s: not valid JSON", path);
    ctx_t c = {path, "", err};
    int version = 0, rc = AR_ERR;
    if (!cJSON_IsObject(root)) {
        ar_errorf(err, "%s: the top level must be a JSON object", path);
        goto out;
    }
    if (get_int(&c, root, "format_version", 1, 1, &version) ||
        get_string(&c, root, "name", 1, cfg->name, sizeof cfg->name) ||
        get_string(&c, root, "family", 1, cfg->family, sizeof cfg->family) ||
        get_string(&c, root, "architecture", 1, cfg->architecture, sizeof cfg->architecture))
        goto out;
    const model_family_t *family = model_family_find(cfg->family);
    if (!family) {
        char names[128];
        ar_errorf(err, "%s: 'family' is '%s'; supported: %s", path, cfg->family,
                  model_family_list(names, sizeof names));
        goto out;
    }
    if (!model_family_find_arch(cfg->family, cfg->architecture)) {
        char names[128];
        ar_errorf(err, "%s: 'architecture' is '%s'; supported for family %s: %s", path,
                  cfg->architecture, family->name,
                  model_family_architectures(family->name, names, sizeof names));
        goto out;
    }
    if (read_weight_list(&c, root, cfg) ||
        (strcmp(family->name, "scale") != 0           ? read_raster(&c, root, cfg)
         : strcmp(cfg->architecture, "infinity") == 0 ? read_infinity(&c, root, cfg)
                                                      : read_scale(&c, root, cfg)) ||
        read_sampling(&c, root, &cfg->sampling) || read_kv_budgets(&c, root, cfg))
        goto out;
    rc = AR_OK;
out:
    cJSON_Delete(root);
    return rc;
}

int model_config_load(model_config_t *cfg, const char *path, ar_error_t *err) {
    size_t n;
    char *buf = file_read_all(path, NULL, (size_t)1 << 20, &n, err);
    if (!buf)
        return AR_ERR;
    int rc = model_config_parse(cfg, buf, n, path, err);
    free(buf);
    return rc;
}

int model_config_image_height(const model_config_t *cfg) {
    return cfg->image.grid_height << (cfg->decoder.n_levels - 1);
}

int model_config_image_width(const model_config_t *cfg) {
    return cfg->image.grid_width << (cfg->decoder.n_levels - 1);
}
