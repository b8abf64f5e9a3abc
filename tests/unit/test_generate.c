/* End to end on the tiny random model: loading, prompt rows, sampling that
 * a seed reproduces whatever else shares the forward passes, and model
 * directories with mistakes giving errors that name the file and problem. */
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/generate.h"
#include "engine/planner.h"
#include "tests/test.h"

static const char *tiny;
static backend_t *be;

/* A pool for n full-cache requests of the longest prompt the tests use. */
static kv_pool_t *pool_new(const model_t *m, int n) {
    const llm_config_t *l = &m->cfg.llm;
    int bt = planner_block_tokens(&m->cfg);
    int per_head = (64 + model_steps(&m->cfg) + bt - 1) / bt;
    static kv_pool_t p;
    ar_error_t err = {{0}};
    if (kv_pool_init(&p, be, n * 2 * l->num_layers * l->num_kv_heads * per_head, bt, l->head_dim,
                     DTYPE_F32, &err) != AR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        abort();
    }
    return &p;
}

static void test_prompt_rows(void) {
    model_t m;
    ar_error_t err = {{0}};
    if (model_load(&m, tiny, be, &err) != AR_OK) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n = 0;
    CHECK_MSG(model_prompt_from_text(&m, "A red circle", cond, uncond, &n, &err) == AR_OK, "%s",
              err.msg);
    /* <bos> <|User|> : a red circle <|Assistant|> : <begin_of_image> */
    CHECK(n == 9);
    CHECK(cond[0] == m.bos_id && cond[n - 1] == m.image_start_id);
    CHECK(cond[1] == tokenizer_token_id(m.tok, "<|User|>"));
    CHECK(cond[3] == tokenizer_token_id(m.tok, "a") && cond[4] == tokenizer_token_id(m.tok, "red"));
    CHECK(uncond[0] == m.bos_id && uncond[n - 1] == m.image_start_id);
    for (int i = 1; i < n - 1; i++)
        CHECK(uncond[i] == m.pad_id);
    model_free(&m);
}

static void run_alone(model_t *m, kv_pool_t *pool, const int *cond, const int *uncond, int n,
                      uint64_t seed, int *tokens_out) {
    sampler_params_t sp = m->cfg.sampling;
    gen_request_t r;
    ar_error_t err = {{0}};
    CHECK_MSG(gen_request_init(&r, m, pool, NULL, cond, uncond, n, &sp, seed, 0, &err) == AR_OK,
              "%s", err.msg);
    gen_request_t *b[] = {&r};
    while (!gen_request_done(&r))
        CHECK(gen_step(b, 1, &err) == AR_OK);
    memcpy(tokens_out, r.tokens, (size_t)r.n_steps * sizeof(int));
    gen_request_free(&r);
}

static void test_seed_reproduces_in_any_batch(void) {
    model_t m;
    ar_error_t err = {{0}};
    if (model_load(&m, tiny, be, &err) != AR_OK) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n = 0;
    model_prompt_from_text(&m, "two green triangles", cond, uncond, &n, &err);
    int steps = m.cfg.image.grid_height * m.cfg.image.grid_width;
    int *alone = malloc((size_t)4 * steps * sizeof(int));
    kv_pool_t *pool = pool_new(&m, 4);
    for (int k = 0; k < 4; k++)
        run_alone(&m, pool, cond, uncond, n, 100 + k, alone + k * steps);
    /* Same four seeds, joining at iterations 0, 2, 5 and 9 of one batch. */
    gen_request_t r[4];
    sampler_params_t sp = m.cfg.sampling;
    for (int k = 0; k < 4; k++)
        gen_request_init(&r[k], &m, pool, NULL, cond, uncond, n, &sp, 100 + k, 0, &err);
    static const int joins[4] = {0, 2, 5, 9};
    for (int iter = 0;; iter++) {
        gen_request_t *b[4];
        int nb = 0, left = 0;
        for (int k = 0; k < 4; k++) {
            left += !gen_request_done(&r[k]);
            if (iter >= joins[k] && !gen_request_done(&r[k]))
                b[nb++] = &r[k];
        }
        if (!left)
            break;
        CHECK(gen_step(b, nb, &err) == AR_OK);
    }
    for (int k = 0; k < 4; k++) {
        CHECK_MSG(memcmp(r[k].tokens, alone + k * steps, (size_t)steps * sizeof(int)) == 0,
                  "seed %d: tokens differ when batched", 100 + k);
        gen_request_free(&r[k]);
    }
    CHECK_MSG(memcmp(alone, alone + steps, (size_t)steps * sizeof(int)) != 0,
              "two seeds gave the same image");
    CHECK(kv_pool_blocks_in_use(pool) == 0);
    kv_pool_free(pool);
    free(alone);
    model_free(&m);
}

/* Copies the tiny model to a temp dir with one substitution in arserve.json. */
static void broken_copy(char *dir, const char *from, const char *to) {
    strcpy(dir, "/tmp/arserve-test-XXXXXX");
    if (!mkdtemp(dir))
        abort();
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "cp '%s'/* '%s'/ && sed -i 's|%s|%s|' '%s/arserve.json'", tiny, dir,
             from, to, dir);
    if (system(cmd) != 0)
        abort();
}

static void remove_dir(const char *dir) {
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

static void test_broken_models_name_the_problem(void) {
    static const struct {
        const char *from, *to, *want;
    } cases[] = {
        {"\"intermediate_size\": 128", "\"intermediate_size\": 96",
         "tensor 'llm.layers.0.mlp.gate.weight': shape [128, 64] expected [96, 64]"},
        {"\"bos_token\": \"<bos>\"", "\"bos_token\": \"<nope>\"",
         "token '<nope>' (prompt.bos_token in arserve.json) is not in the tokenizer"},
        {"\"model.safetensors\"", "\"missing.safetensors\"", "missing.safetensors"},
        {"\"aligner_layers\": 2", "\"aligner_layers\": 3", "gen.aligner.2.weight' not found"},
        {"\"tokenizer\": \"tokenizer.json\"", "\"tokenizer\": \"nope.json\"", "nope.json"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char dir[64];
        broken_copy(dir, cases[i].from, cases[i].to);
        model_t m;
        ar_error_t err = {{0}};
        int rc = model_load(&m, dir, be, &err);
        CHECK_MSG(rc == AR_ERR, "case %zu loaded", i);
        CHECK_STR_CONTAINS(err.msg, cases[i].want);
        CHECK_STR_CONTAINS(err.msg, dir);
        if (rc == AR_OK)
            model_free(&m);
        remove_dir(dir);
    }
}

int main(void) {
    tiny = getenv("ARSERVE_TINY_MODEL");
    if (!tiny) {
        printf("ARSERVE_TINY_MODEL is not set (make test-unit sets it)\n0 passed, 1 failed\n");
        return 1;
    }
    ar_error_t err = {{0}};
    be = backend_cpu_create(0, &err);
    TEST_RUN(test_prompt_rows);
    TEST_RUN(test_seed_reproduces_in_any_batch);
    TEST_RUN(test_broken_models_name_the_problem);
    be->destroy(be);
    return TEST_SUMMARY();
}
