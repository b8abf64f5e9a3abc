/* Stepping image requests through the raster model and the host sampler. */
#include "generate.h"

#include <stdlib.h>
#include <string.h>

int gen_request_init(gen_request_t *r, model_t *m, const int *cond, const int *uncond,
                     int n_prompt, const sampler_params_t *params, uint64_t seed, uint64_t stream,
                     ar_error_t *err) {
    memset(r, 0, sizeof *r);
    r->model = m;
    r->params = *params;
    r->seed = seed;
    r->stream = stream;
    r->n_prompt = n_prompt;
    r->n_steps = m->cfg.image.grid_height * m->cfg.image.grid_width;
    int K = m->cfg.image.codebook_size;
    r->cond_ids = malloc((size_t)n_prompt * sizeof(int));
    r->uncond_ids = malloc((size_t)n_prompt * sizeof(int));
    r->tokens = calloc((size_t)r->n_steps, sizeof(int));
    r->logits = malloc((size_t)2 * K * sizeof(float));
    if (!r->cond_ids || !r->uncond_ids || !r->tokens || !r->logits) goto oom;
    memcpy(r->cond_ids, cond, (size_t)n_prompt * sizeof(int));
    memcpy(r->uncond_ids, uncond, (size_t)n_prompt * sizeof(int));
    /* The last sampled token is never fed back. */
    int capacity = n_prompt + r->n_steps - 1;
    if (sampler_init(&r->sampler, K, err) != AR_OK ||
        raster_seq_init(&r->seq[0], &m->lm, capacity, err) != AR_OK ||
        raster_seq_init(&r->seq[1], &m->lm, capacity, err) != AR_OK) {
        gen_request_free(r);
        return AR_ERR;
    }
    return AR_OK;
oom:
    gen_request_free(r);
    return ar_errorf(err, "out of memory");
}

void gen_request_free(gen_request_t *r) {
    if (!r->model) return;
    for (int i = 0; i < 2; i++)
        if (r->seq[i].block) raster_seq_free(&r->seq[i], &r->model->lm);
    sampler_free(&r->sampler);
    free(r->cond_ids);
    free(r->uncond_ids);
    free(r->tokens);
    free(r->logits);
    memset(r, 0, sizeof *r);
}

int gen_step(gen_request_t *const *reqs, int n, ar_error_t *err) {
    if (n <= 0) return AR_OK;
    model_t *m = reqs[0]->model;
    int K = m->cfg.image.codebook_size;
    raster_input_t *in = malloc((size_t)2 * n * sizeof *in);
    gen_request_t **live = malloc((size_t)n * sizeof *live);
    float *logits = malloc((size_t)2 * n * K * sizeof(float));
    int n_live = 0, rc = AR_ERR;
    if (!in || !live || !logits) {
        ar_errorf(err, "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++) {
        gen_request_t *r = reqs[i];
        if (gen_request_done(r)) continue;
        if (r->model != m) {
            ar_errorf(err, "requests of different models cannot share a step");
            goto out;
        }
        int prefill = r->step == 0;
        for (int j = 0; j < 2; j++)
            in[2 * n_live + j] = (raster_input_t){
                .seq = &r->seq[j],
                .n = prefill ? r->n_prompt : 1,
                .ids = prefill ? (j ? r->uncond_ids : r->cond_ids) : &r->tokens[r->step - 1],
                .is_image = !prefill,
            };
        live[n_live++] = r;
    }
    if (raster_forward(&m->lm, in, 2 * n_live, logits, err) != AR_OK) goto out;
    for (int i = 0; i < n_live; i++) {
        gen_request_t *r = live[i];
        memcpy(r->logits, logits + (size_t)2 * i * K, (size_t)2 * K * sizeof(float));
        r->tokens[r->step] =
            r->forced ? r->forced[r->step]
                      : sampler_next(&r->sampler, r->logits, r->logits + K, &r->params, r->seed,
                                     r->stream, (uint64_t)r->step);
        r->step++;
    }
    rc = AR_OK;
out:
    free(in);
    free(live);
    free(logits);
    return rc;
}

int gen_decode(gen_request_t *r, uint8_t *rgb, ar_error_t *err) {
    if (!gen_request_done(r)) return ar_errorf(err, "the image is not finished");
    return vq_decode(&r->model->dec, r->tokens, rgb, NULL, err);
}
