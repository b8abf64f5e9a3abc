/* The raster (next-token) family: Janus-Pro's or LlamaGen's language model
 * (raster.c) samples one image token per step, in raster order, and the
 * VQ-16 decoder (vq_decoder.c) turns the grid of tokens into pixels. Its KV
 * segments are the grid's lines: grid_height lines of grid_width tokens, one
 * token fed per step, after the condition prefix (a prompt, or LlamaGen's
 * one class token). */
#include <stdlib.h>
#include <string.h>

#include "engine/family/family_raster.h"
#include "engine/generate.h"
#include "engine/model_family.h"

static const char *const raster_architectures[] = {"janus", "llamagen", NULL};

static void raster_geometry(const model_config_t *cfg, int n_prompt, int size, kv_geometry_t *g) {
    (void)size; /* one grid */
    /* A class-conditional model's prefix is its one class token, whatever
     * prompt length a caller (`arserve plan`) assumed. */
    if (cfg->condition.num_classes > 0)
        n_prompt = 1;
    kv_geometry_uniform(g, n_prompt, KV_STEP_TOKEN, cfg->image.grid_height, cfg->image.grid_width,
                        cfg->llm.num_layers, cfg->llm.num_kv_heads);
}

static void raster_family_free(model_t *m) {
    raster_net_t *net = m->net;
    if (!net)
        return;
    raster_free(&net->lm);
    vq_decoder_free(&net->dec);
    free(net);
    m->net = NULL;
}

static int raster_family_load(model_t *m, weight_set_t *ws, ar_error_t *err) {
    raster_net_t *net = m->net = calloc(1, sizeof *net);
    if (!net)
        return ar_errorf(err, "out of memory");
    if (raster_load(&net->lm, &m->cfg, ws, m->be, err) != AR_OK ||
        vq_decoder_load(&net->dec, &m->cfg, ws, m->be, err) != AR_OK) {
        raster_family_free(m);
        return AR_ERR;
    }
    net->lm.arena = &m->arena;
    return AR_OK;
}

/* Step 0 feeds both prompt rows (prefill); every later step feeds the token
 * sampled at the step before to both rows. */
static int raster_step(model_t *m, gen_request_t *const *reqs, int n, ar_error_t *err) {
    if (n <= 0)
        return AR_OK;
    const int K = m->cfg.image.codebook_size;
    /* gen_step's scope: gone when the step ends. */
    raster_input_t *in = arena_alloc(&m->arena, (size_t)2 * n * sizeof *in);
    float *logits = arena_alloc(&m->arena, (size_t)2 * n * K * sizeof *logits);
    if (!in || !logits)
        return ar_errorf(err, "out of memory");
    for (int i = 0; i < n; i++) {
        gen_request_t *r = reqs[i];
        const int prefill = r->step == 0;
        for (int j = 0; j < 2; j++)
            in[2 * i + j] = (raster_input_t){
                .seq = &r->seq[j],
                .n = prefill ? r->n_prompt : 1,
                .ids = prefill ? (j ? r->uncond_ids : r->cond_ids) : &r->tokens[r->step - 1],
                .is_image = !prefill,
                .image_index = prefill ? 0 : r->step - 1,
                .collect_mass = r->collect[j],
            };
    }
    if (raster_forward(&raster_net_of(m)->lm, in, 2 * n, logits, err) != AR_OK)
        return AR_ERR;
    for (int i = 0; i < n; i++) {
        gen_request_t *r = reqs[i];
        memcpy(r->logits, logits + (size_t)2 * i * K, (size_t)2 * K * sizeof(float));
        r->n_logits = (size_t)2 * K;
        r->tokens[r->step] = r->forced
                                 ? r->forced[r->step]
                                 : sampler_next(&r->sampler, r->logits, r->logits + K, &r->params,
                                                r->seed, r->stream, (uint64_t)r->step);
    }
    return AR_OK;
}

/* Tokens not generated yet are drawn as token 0. */
static int raster_draw(const model_t *m, vq_work_t *w, const int *tokens, int size, int n_done,
                       uint8_t *rgb, ar_error_t *err) {
    (void)size; /* one grid */
    const int n = model_image_tokens(&m->cfg);
    if (n_done >= n)
        return vq_decode(&raster_net_of(m)->dec, w, tokens, rgb, NULL, err);
    int *grid = calloc((size_t)n, sizeof *grid);
    if (!grid)
        return ar_errorf(err, "out of memory");
    memcpy(grid, tokens, (size_t)(n_done > 0 ? n_done : 0) * sizeof *grid);
    int rc = vq_decode(&raster_net_of(m)->dec, w, grid, rgb, NULL, err);
    free(grid);
    return rc;
}

static size_t raster_draw_bytes(const model_t *m, size_t *n_buffers) {
    return vq_work_bytes(&raster_net_of(m)->dec, n_buffers);
}

static struct vq_work *raster_draw_work_new(const model_t *m, backend_t *be, ar_error_t *err) {
    return vq_work_new(&raster_net_of(m)->dec, be, err);
}

const model_family_t model_family_raster = {
    .name = "raster",
    .architectures = raster_architectures,
    .segment_name = "line",
    .models_name = "raster",
    .geometry = raster_geometry,
    .load = raster_family_load,
    .free = raster_family_free,
    .step = raster_step,
    .draw = raster_draw,
    .draw_bytes = raster_draw_bytes,
    .draw_work_new = raster_draw_work_new,
    .draw_work_free = vq_work_delete,
};
