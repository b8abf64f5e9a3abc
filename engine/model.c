/* Loading a model directory and building its CFG prompt rows. */
#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int model_load(model_t *m, const char *dir, backend_t *be, ar_error_t *err) {
    memset(m, 0, sizeof *m);
    m->be = be;
    if (strlen(dir) >= sizeof m->dir)
        return ar_errorf(err, "%s: model path too long", dir);
    strcpy(m->dir, dir);
    char path[2048];
    snprintf(path, sizeof path, "%s/arserve.json", dir);
    if (model_config_load(&m->cfg, path, err) != AR_OK)
        return AR_ERR;
    snprintf(path, sizeof path, "%s/%s", dir, m->cfg.tokenizer);
    if (!(m->tok = tokenizer_load(path, err)))
        return AR_ERR;
    if (special_id(m, "bos_token", m->cfg.prompt.bos_token, &m->bos_id, err) ||
        special_id(m, "pad_token", m->cfg.prompt.pad_token, &m->pad_id, err) ||
        special_id(m, "image_start_token", m->cfg.prompt.image_start_token, &m->image_start_id,
                   err)) {
        model_free(m);
        return AR_ERR;
    }
    weight_set_t ws;
    if (weight_set_open(&ws, dir, &m->cfg, be, err) != AR_OK) {
        model_free(m);
        return AR_ERR;
    }
    m->family = model_family_of(&m->cfg);
    int rc = m->family->load(m, &ws, err);
    m->weight_bytes = ws.bytes_loaded;
    weight_set_close(&ws);
    if (rc != AR_OK) {
        m->family = NULL;
        model_free(m);
    }
    return rc;
}

void model_free(model_t *m) {
    if (m->family)
        m->family->free(m);
    m->family = NULL;
    tokenizer_free(m->tok);
    m->tok = NULL;
}

int model_prompt_from_ids(const model_t *m, const int *ids, int n_ids, int *cond, int *uncond,
                          int *n, ar_error_t *err) {
    if (n_ids + 2 > MODEL_MAX_PROMPT_TOKENS)
        return ar_errorf(err, "prompt is %d tokens, more than the limit %d", n_ids + 2,
                         MODEL_MAX_PROMPT_TOKENS);
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

int model_prompt_from_text(const model_t *m, const char *text, int *cond, int *uncond, int *n,
                           ar_error_t *err) {
    const char *tpl = m->cfg.prompt.template_text, *at = strstr(tpl, "{prompt}");
    size_t len = strlen(tpl) - strlen("{prompt}") + strlen(text) + 1;
    char *full = malloc(len);
    int *ids = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof *ids);
    int n_ids = 0, rc = AR_ERR;
    if (!full || !ids) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    snprintf(full, len, "%.*s%s%s", (int)(at - tpl), tpl, text, at + strlen("{prompt}"));
    if (tokenizer_encode(m->tok, full, ids, MODEL_MAX_PROMPT_TOKENS - 2, &n_ids, err) != AR_OK)
        goto out;
    rc = model_prompt_from_ids(m, ids, n_ids, cond, uncond, n, err);
out:
    free(full);
    free(ids);
    return rc;
}
