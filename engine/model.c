/* Loading a model directory and building its CFG prompt rows. */
#include "engine/model.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/file.h"
#include "base/text.h"

static int special_id(const model_t *m, const char *key, const char *token, int *out,
                      ar_error_t *err) {
    *out = tokenizer_token_id(m->tok, token);
    if (*out < 0)
        return ar_errorf(err,
                         "%s/%s: token '%s' (prompt.%s in arserve.json) is not in the tokenizer",
                         m->dir, m->cfg.tokenizer, token, key);
    if (*out >= m->cfg.llm.vocab_size)
        return ar_errorf(err, "%s/%s: token '%s' has id %d, outside llm.vocab_size %d", m->dir,
                         m->cfg.tokenizer, token, *out, m->cfg.llm.vocab_size);
    return AR_OK;
}

/* condition.class_names: num_classes lines, each a name of 1 to 127
 * printable bytes, no two alike. */
static int load_class_names(model_t *m, ar_error_t *err) {
    const int n = m->cfg.condition.num_classes;
    char path[2048], line[256];
    snprintf(path, sizeof path, "%s/%s", m->dir, m->cfg.condition.class_names);
    /* A regular file only; read at most num_classes + 1 lines of 256 bytes. */
    int fd = file_open_regular(path, NULL, NULL, err);
    if (fd < 0)
        return AR_ERR;
    FILE *f = fdopen(fd, "r");
    if (!f) {
        close(fd);
        return ar_errorf(err, "%s: cannot read: %s", path, strerror(errno));
    }
    m->class_names = calloc((size_t)n, sizeof *m->class_names);
    int i = 0, rc = AR_ERR;
    if (!m->class_names) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    while (fgets(line, sizeof line, f)) {
        size_t len = strcspn(line, "\r\n");
        if (line[len] == 0 && !feof(f)) {
            ar_errorf(err, "%s: line %d is longer than 127 bytes", path, i + 1);
            goto out;
        }
        line[len] = 0;
        if (i >= n) {
            ar_errorf(err, "%s: more than condition.num_classes = %d names", path, n);
            goto out;
        }
        if (len == 0 || len > 127) {
            ar_errorf(err, "%s: line %d: a class name has 1 to 127 bytes", path, i + 1);
            goto out;
        }
        if (model_class_find(m, line) >= 0) {
            ar_errorf(err, "%s: line %d: '%s' is listed twice", path, i + 1, line);
            goto out;
        }
        if (!(m->class_names[i++] = strdup(line))) {
            ar_errorf(err, "out of memory");
            goto out;
        }
    }
    if (i != n) {
        ar_errorf(err, "%s: %d names; condition.num_classes is %d", path, i, n);
        goto out;
    }
    rc = AR_OK;
out:
    fclose(f);
    return rc;
}

int model_load(model_t *m, const char *dir, backend_t *be, ar_error_t *err) {
    return model_load_with(m, dir, be, 0, err);
}

/* Each budget the card sets (arserve.json "kv_budgets") runs on the model:
 * its policy applies to the family, and the budget holds what the policy
 * must keep on the default size's grid with a one-token prompt. A policy
 * that runs at no budget here (HeatKV without a calibration) is left to
 * each request's own message. */
static int check_kv_budgets(const model_config_t *cfg, const char *dir, ar_error_t *err) {
    kv_geometry_t g;
    model_geometry(cfg, 1, &g);
    for (int k = 0; k < KV_POLICY_COUNT; k++) {
        if (!(cfg->kv_budgets[k] > 0))
            continue;
        const char *name = kv_policy_name((kv_policy_kind_t)k);
        if (!kv_policy_suits((kv_policy_kind_t)k, &g))
            return ar_errorf(err,
                             "%s/arserve.json: 'kv_budgets.%s': kv_policy %s does not apply "
                             "to %s models",
                             dir, name, name, model_family_of(cfg)->models_name);
        kv_policy_params_t p;
        kv_policy_defaults(&p, (kv_policy_kind_t)k);
        const double least = kv_policy_min_budget(&p, &g);
        p.budget = cfg->kv_budgets[k];
        ar_error_t why;
        if (least > 0 && kv_policy_check(&p, &g, NULL, &why) != AR_OK)
            return ar_errorf(err,
                             "%s/arserve.json: 'kv_budgets.%s' is %g, below %g, the least "
                             "budget %s runs at on this model",
                             dir, name, cfg->kv_budgets[k], least, name);
    }
    return AR_OK;
}

int model_load_with(model_t *m, const char *dir, backend_t *be, unsigned flags, ar_error_t *err) {
    memset(m, 0, sizeof *m);
    m->be = be;
    if (strlen(dir) >= sizeof m->dir)
        return ar_errorf(err, "%s: model path too long", dir);
    strcpy(m->dir, dir);
    char path[2048];
    snprintf(path, sizeof path, "%s/arserve.json", dir);
    if (model_config_load(&m->cfg, path, err) != AR_OK)
        return AR_ERR;
    if (m->cfg.tokenizer[0]) {
        snprintf(path, sizeof path, "%s/%s", dir, m->cfg.tokenizer);
        if (!(m->tok = tokenizer_load(path, err)))
            return AR_ERR;
        /* Every id the tokenizer gives must have an embedding row: fewer
         * pieces than rows is usual (T5's 32,100 for 32,128), more is not. */
        const int has_text = model_config_has_text_encoder(&m->cfg);
        const int rows = has_text ? m->cfg.text.vocab_size : m->cfg.llm.vocab_size;
        if (tokenizer_vocab_size(m->tok) > rows) {
            ar_errorf(
                err,
                "%s: the tokenizer has ids up to %d, but %s.vocab_size in arserve.json is %d: "
                "ids past %d would have no embedding row (is this the model's tokenizer?)",
                path, tokenizer_vocab_size(m->tok) - 1, has_text ? "text" : "llm", rows, rows - 1);
            model_free(m);
            return AR_ERR;
        }
        if (m->cfg.prompt.bos_token[0] &&
            (special_id(m, "bos_token", m->cfg.prompt.bos_token, &m->bos_id, err) ||
             special_id(m, "pad_token", m->cfg.prompt.pad_token, &m->pad_id, err) ||
             special_id(m, "image_start_token", m->cfg.prompt.image_start_token, &m->image_start_id,
                        err))) {
            model_free(m);
            return AR_ERR;
        }
    }
    if (m->cfg.condition.class_names[0] && load_class_names(m, err) != AR_OK) {
        model_free(m);
        return AR_ERR;
    }
    weight_set_t ws;
    if (weight_set_open(&ws, dir, &m->cfg, be, err) != AR_OK) {
        model_free(m);
        return AR_ERR;
    }
    ws.check_finite = !(flags & MODEL_LOAD_UNCHECKED);
    m->family = model_family_of(&m->cfg);
    int rc = m->family->load(m, &ws, err);
    m->weight_bytes = ws.bytes_loaded;
    m->weight_dtype = weight_set_main_dtype(&ws);
    weight_set_close(&ws);
    if (rc != AR_OK) {
        m->family = NULL;
        model_free(m);
        return rc;
    }
    snprintf(path, sizeof path, "%s/%s", dir, KV_CALIBRATION_FILE);
    if (access(path, F_OK) == 0) {
        if (kv_calibration_set_load(&m->calib, path, err) != AR_OK) {
            model_free(m);
            return AR_ERR;
        }
        if (model_check_calibrations(&m->cfg, &m->calib, err) != AR_OK) {
            ar_error_prefix(err, "%s (move it away to load the model without it)", path);
            model_free(m);
            return AR_ERR;
        }
        m->cfg.kv_calibrations = &m->calib;
    }
    if (check_kv_budgets(&m->cfg, dir, err) != AR_OK) {
        model_free(m);
        return AR_ERR;
    }
    snprintf(path, sizeof path, "%s/%s", dir, FP8_SCALES_FILE);
    if (access(path, F_OK) == 0) {
        kv_geometry_t g;
        model_geometry(&m->cfg, 0, &g);
        if (fp8_scales_load(&m->fp8_scales, path, err) != AR_OK) {
            model_free(m);
            return AR_ERR;
        }
        if (m->fp8_scales.n_layers != g.n_layers || m->fp8_scales.n_heads != g.n_heads) {
            ar_errorf(err,
                      "%s: measured on %d layers x %d KV heads, the model has %d x %d (run arserve "
                      "calibrate --kv-scales again, or move it away)",
                      path, m->fp8_scales.n_layers, m->fp8_scales.n_heads, g.n_layers, g.n_heads);
            model_free(m);
            return AR_ERR;
        }
    }
    return AR_OK;
}

void model_free(model_t *m) {
    if (m->family) {
        m->family->draw_work_free(m->draw);
        m->family->free(m);
    }
    m->draw = NULL;
    m->family = NULL;
    tokenizer_free(m->tok);
    m->tok = NULL;
    for (int i = 0; m->class_names && i < m->cfg.condition.num_classes; i++)
        free(m->class_names[i]);
    free(m->class_names);
    m->class_names = NULL;
    kv_calibration_set_free(&m->calib);
    m->cfg.kv_calibrations = NULL;
    fp8_scales_free(&m->fp8_scales);
    arena_free(&m->arena);
}

struct vq_work *model_draw_work(model_t *m, ar_error_t *err) {
    if (!m->draw)
        m->draw = m->family->draw_work_new(m, m->be, err);
    return m->draw;
}

int model_is_class_conditional(const model_t *m) { return m->cfg.condition.num_classes > 0; }

int model_class_find(const model_t *m, const char *name) {
    for (int i = 0; m->class_names && i < m->cfg.condition.num_classes; i++)
        if (m->class_names[i] && strcmp(m->class_names[i], name) == 0)
            return i;
    return -1;
}

int model_class_parse(const model_t *m, const char *s) {
    long long v;
    const int by_name = model_class_find(m, s);
    if (by_name >= 0)
        return by_name;
    return text_parse_int(s, &v) == NUMBER_OK && v >= 0 && v < m->cfg.condition.num_classes ? (int)v
                                                                                            : -1;
}

int model_prompt_from_class(const model_t *m, int label, int *cond, int *uncond, int *n,
                            ar_error_t *err) {
    const int classes = m->cfg.condition.num_classes;
    if (!model_is_class_conditional(m))
        return ar_errorf(err, "this model takes a prompt, not a class");
    if (label < 0 || label >= classes)
        return ar_errorf(err, "class %d is outside [0, %d)", label, classes);
    cond[0] = label;
    uncond[0] = classes;
    *n = 1;
    return AR_OK;
}

/* The most prompt ids (the tokenizer's, before the model adds its own) a
 * prompt may have: the text encoder's tokens less </s> on a model with
 * one, else the rows less BOS and the image start. */
static int max_prompt_ids(const model_t *m) {
    return model_config_has_text_encoder(&m->cfg) ? m->cfg.text.max_tokens - 1
                                                  : MODEL_MAX_PROMPT_TOKENS - 2;
}

/* The error for a prompt of n_ids ids, more than max_prompt_ids, counted
 * as the model counts its rows. */
static int prompt_too_long(const model_t *m, int n_ids, ar_error_t *err) {
    if (model_config_has_text_encoder(&m->cfg))
        return ar_errorf(err, "prompt is %d tokens with </s>, more than the model's limit %d",
                         n_ids + 1, m->cfg.text.max_tokens);
    return ar_errorf(err, "prompt is %d tokens, more than the limit %d", n_ids + 2,
                     MODEL_MAX_PROMPT_TOKENS);
}

/* Infinity: the prompt's T5 ids and </s>; the unconditional row is the
 * learned rows cfg_uncond[:n], marked -1 (no ids). */
static int prompt_from_ids_t5(const model_t *m, const int *ids, int n_ids, int *cond, int *uncond,
                              int *n, ar_error_t *err) {
    const text_config_t *t = &m->cfg.text;
    for (int i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= t->vocab_size)
            return ar_errorf(err, "prompt token id %d is outside the vocabulary [0, %d)", ids[i],
                             t->vocab_size);
    for (int i = 0; i < n_ids; i++) {
        cond[i] = ids[i];
        uncond[i] = -1;
    }
    cond[n_ids] = t->eos_id;
    uncond[n_ids] = -1;
    *n = n_ids + 1;
    return AR_OK;
}

int model_prompt_from_ids(const model_t *m, const int *ids, int n_ids, int *cond, int *uncond,
                          int *n, ar_error_t *err) {
    if (n_ids > max_prompt_ids(m))
        return prompt_too_long(m, n_ids, err);
    if (model_config_has_text_encoder(&m->cfg))
        return prompt_from_ids_t5(m, ids, n_ids, cond, uncond, n, err);
    if (model_is_class_conditional(m))
        return ar_errorf(err, "this model is class-conditional: give a class, not token ids");
    for (int i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= m->cfg.llm.vocab_size)
            return ar_errorf(err, "prompt token id %d is outside the vocabulary [0, %d)", ids[i],
                             m->cfg.llm.vocab_size);
    cond[0] = uncond[0] = m->bos_id;
    for (int i = 0; i < n_ids; i++) {
        cond[1 + i] = ids[i];
        uncond[1 + i] = m->pad_id;
    }
    cond[n_ids + 1] = uncond[n_ids + 1] = m->image_start_id;
    *n = n_ids + 2;
    return AR_OK;
}

int model_prompt_warning(const model_t *m, const char *field, const char *text, char *out,
                         size_t cap) {
    if (!m->tok || !text || model_is_class_conditional(m))
        return 0;
    char pieces[256];
    ar_error_t err;
    const int n = tokenizer_unknown(m->tok, text, pieces, sizeof pieces, &err);
    if (n <= 0)
        return 0;
    const int closed = tokenizer_words(m->tok, NULL, 0) > 0;
    snprintf(out, cap, "%s: %d %s the model does not know %s: %s%s", field, n,
             closed ? (n == 1 ? "word" : "words") : (n == 1 ? "piece" : "pieces"),
             closed
                 ? (n == 1 ? "was read as unknown" : "were read as unknown")
                 : (n == 1 ? "was read as unknown or dropped" : "were read as unknown or dropped"),
             pieces, closed ? " (GET /v1/models lists the words it knows)" : "");
    return 1;
}

int model_prompt_from_text(const model_t *m, const char *text, int *cond, int *uncond, int *n,
                           ar_error_t *err) {
    if (model_is_class_conditional(m)) {
        const int label = model_class_find(m, text);
        if (label < 0)
            return ar_errorf(err,
                             m->class_names
                                 ? "'%s' is not one of this model's %d class names (its %s; "
                                   "GET /v1/models lists them)"
                                 : "'%s': this model has %d classes and no class names%s; give "
                                   "a class index",
                             text, m->cfg.condition.num_classes, m->cfg.condition.class_names);
        return model_prompt_from_class(m, label, cond, uncond, n, err);
    }
    const char *tpl = m->cfg.prompt.template_text[0] ? m->cfg.prompt.template_text : "{prompt}";
    const char *at = strstr(tpl, "{prompt}");
    size_t len = strlen(tpl) - strlen("{prompt}") + strlen(text) + 1;
    char *full = malloc(len);
    int *ids = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof *ids);
    int n_ids = 0, rc = AR_ERR;
    if (!full || !ids) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    snprintf(full, len, "%.*s%s%s", (int)(at - tpl), tpl, text, at + strlen("{prompt}"));
    const int max_ids = max_prompt_ids(m);
    if (tokenizer_encode(m->tok, full, ids, max_ids, &n_ids, err) != AR_OK) {
        if (n_ids > max_ids)
            prompt_too_long(m, n_ids, err);
        goto out;
    }
    rc = model_prompt_from_ids(m, ids, n_ids, cond, uncond, n, err);
out:
    free(full);
    free(ids);
    return rc;
}
