/* arserve.json reader: a valid config parses with every field; each kind of
 * mistake is an error that names the file and the key path. */
#include <stdlib.h>

#include "engine/model_config.h"
#include "tests/test.h"

static const char *VALID =
    "{\"format_version\": 1, \"name\": \"t\", \"family\": \"raster\", \"architecture\": \"janus\","
    " \"llm\": {\"vocab_size\": 64, \"hidden_size\": 64, \"num_layers\": 2, \"num_heads\": 4,"
    "  \"num_kv_heads\": 4, \"head_dim\": 16, \"intermediate_size\": 128,"
    "  \"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0},"
    " \"image\": {\"grid_height\": 8, \"grid_width\": 6, \"codebook_size\": 32, \"embed_dim\": 8,"
    "  \"aligner_layers\": 2, \"head_hidden_size\": 64},"
    " \"decoder\": {\"type\": \"vq16\", \"latent_channels\": 32, \"base_channels\": 32,"
    "  \"channel_multiplier\": [1, 2, 2], \"num_res_blocks\": 1, \"out_channels\": 3},"
    " \"prompt\": {\"template\": \"<|User|>: {prompt}\\n\\n<|Assistant|>:\", \"bos_token\": "
    "\"<bos>\","
    "  \"pad_token\": \"<pad>\", \"image_start_token\": \"<boi>\"},"
    " \"sampling\": {\"cfg\": 5.0, \"temperature\": 1.0, \"top_k\": 0, \"top_p\": 1.0}}";

/* Replaces the first occurrence of `from` in VALID with `to`. */
static char *mutate(const char *from, const char *to) {
    const char *at = strstr(VALID, from);
    if (!at) {
        fprintf(stderr, "test bug: '%s' not in VALID\n", from);
        abort();
    }
    size_t n = strlen(VALID) - strlen(from) + strlen(to) + 1;
    char *s = malloc(n);
    snprintf(s, n, "%.*s%s%s", (int)(at - VALID), VALID, to, at + strlen(from));
    return s;
}

static void test_valid_config_parses(void) {
    model_config_t c;
    ar_error_t err = {{0}};
    int rc = model_config_parse(&c, VALID, strlen(VALID), "m/arserve.json", &err);
    CHECK_MSG(rc == AR_OK, "%s", err.msg);
    CHECK(c.llm.hidden_size == 64 && c.llm.num_layers == 2 && c.llm.head_dim == 16);
    CHECK_NEAR(c.llm.norm_eps, 1e-6, 1e-12, 0);
    CHECK(c.image.grid_height == 8 && c.image.grid_width == 6 && c.image.codebook_size == 32);
    CHECK(c.decoder.n_levels == 3 && c.decoder.channel_multiplier[2] == 2);
    CHECK(model_config_image_height(&c) == 32 && model_config_image_width(&c) == 24);
    CHECK(strcmp(c.prompt.template_text, "<|User|>: {prompt}\n\n<|Assistant|>:") == 0);
    CHECK(strcmp(c.prompt.image_start_token, "<boi>") == 0);
    CHECK(c.sampling.cfg == 5.0f && c.sampling.top_k == 0 && c.sampling.top_p == 1.0f);
    CHECK(c.n_weight_files == 1 && strcmp(c.weight_files[0], "model.safetensors") == 0);
    CHECK(strcmp(c.tokenizer, "tokenizer.json") == 0);
}

/* The card's own budgets, per policy; a policy it does not name keeps 0
 * (the policy's own). */
static void test_kv_budgets_parse(void) {
    char *json = mutate("\"name\": \"t\",",
                        "\"name\": \"t\", \"kv_budgets\": {\"linear\": 0.25, \"headkv\": 0.2},");
    model_config_t c;
    ar_error_t err = {{0}};
    CHECK_MSG(model_config_parse(&c, json, strlen(json), "m/arserve.json", &err) == AR_OK, "%s",
              err.msg);
    CHECK(c.kv_budgets[KV_POLICY_LINEAR] == 0.25 && c.kv_budgets[KV_POLICY_HEADKV] == 0.2);
    CHECK(c.kv_budgets[KV_POLICY_STREAMING] == 0 && c.kv_budgets[KV_POLICY_FULL] == 0);
    free(json);
}

static void test_tiny_model_config_loads(void) {
    const char *dir = getenv("ARSERVE_TINY_MODEL");
    if (!dir) {
        printf("skip: ARSERVE_TINY_MODEL not set\n");
        return;
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/arserve.json", dir);
    model_config_t c;
    ar_error_t err = {{0}};
    CHECK_MSG(model_config_load(&c, path, &err) == AR_OK, "%s", err.msg);
}

static void test_missing_file_is_named(void) {
    model_config_t c;
    ar_error_t err = {{0}};
    CHECK(model_config_load(&c, "/nonexistent/arserve.json", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "/nonexistent/arserve.json");
}

static void test_mistakes_name_the_key(void) {
    static const struct {
        const char *from, *to, *want;
    } cases[] = {
        {"\"name\": \"t\",", "\"name\": \"t\", \"colour\": 1,", "unknown key 'colour'"},
        {"\"num_layers\": 2", "\"num_layerz\": 2", "unknown key 'llm.num_layerz'"},
        {"\"num_layers\": 2,", "", "missing required key 'llm.num_layers'"},
        {"\"hidden_size\": 64", "\"hidden_size\": \"64\"", "'llm.hidden_size' must be an integer"},
        {"\"hidden_size\": 64", "\"hidden_size\": 64.5", "'llm.hidden_size' must be an integer"},
        {"\"hidden_size\": 64", "\"hidden_size\": 0", "'llm.hidden_size' is 0, outside"},
        {"\"rms_norm_eps\": 1e-6", "\"rms_norm_eps\": 0",
         "'llm.rms_norm_eps' is 0; a norm's epsilon must be greater than 0"},
        {"\"rms_norm_eps\": 1e-6", "\"rms_norm_eps\": 1e-50", "'llm.rms_norm_eps' is 1e-50"},
        {"\"head_dim\": 16", "\"head_dim\": 15", "'llm.head_dim' must be even"},
        {"\"num_kv_heads\": 4", "\"num_kv_heads\": 2", "grouped-query"},
        {"\"top_p\": 1.0", "\"top_p\": 1.5", "'sampling.top_p' is 1.5, outside"},
        {"\"cfg\": 5.0", "\"cfg\": null", "'sampling.cfg' must be a number"},
        {"{prompt}", "{prompt", "'prompt.template' must contain '{prompt}' exactly once"},
        {"\"bos_token\": \"<bos>\"", "\"bos_token\": \"\"", "'prompt.bos_token' is empty"},
        {"\"family\": \"raster\"", "\"family\": \"diffusion\"", "'family' is 'diffusion'"},
        {"\"type\": \"vq16\"", "\"type\": \"vq8\"", "'decoder.type' is 'vq8'"},
        {"\"base_channels\": 32", "\"base_channels\": 48", "not a multiple of 32"},
        {"[1, 2, 2]", "[]", "'decoder.channel_multiplier' must be an array"},
        {"\"format_version\": 1", "\"format_version\": 2", "'format_version' is 2"},
        {"\"llm\": {", "\"llm\": [{", "not valid JSON"},
        {"\"name\": \"t\",", "\"name\": \"t\", \"weights\": [\"../x.safetensors\"],",
         "'weights[0]'"},
        {"\"name\": \"t\",", "\"name\": \"t\", \"name\": \"u\",", "duplicate key 'name'"},
        {"\"name\": \"t\",", "\"name\": \"t\", \"kv_budgets\": [0.25],",
         "'kv_budgets' must be an object"},
        {"\"name\": \"t\",", "\"name\": \"t\", \"kv_budgets\": {\"lineAR\": 0.25},",
         "'kv_budgets.lineAR': no such kv_policy; one of full, streaming, linear"},
        {"\"name\": \"t\",", "\"name\": \"t\", \"kv_budgets\": {\"full\": 0.5},",
         "'kv_budgets.full': kv_policy full takes no budget"},
        {"\"name\": \"t\",", "\"name\": \"t\", \"kv_budgets\": {\"linear\": 0},",
         "'kv_budgets.linear' must be a number in (0, 1]"},
        {"\"name\": \"t\",", "\"name\": \"t\", \"kv_budgets\": {\"linear\": 1.5},",
         "'kv_budgets.linear' must be a number in (0, 1]"},
        {"\"name\": \"t\",", "\"name\": \"t\", \"kv_budgets\": {\"linear\": \"1/4\"},",
         "'kv_budgets.linear' must be a number in (0, 1]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *json = mutate(cases[i].from, cases[i].to);
        model_config_t c;
        ar_error_t err = {{0}};
        int rc = model_config_parse(&c, json, strlen(json), "m/arserve.json", &err);
        CHECK_MSG(rc == AR_ERR, "case %zu was accepted", i);
        CHECK_STR_CONTAINS(err.msg, cases[i].want);
        CHECK_STR_CONTAINS(err.msg, "m/arserve.json");
        free(json);
    }
}

static const char *LLAMAGEN =
    "{\"format_version\": 1, \"name\": \"l\", \"family\": \"raster\", \"architecture\": "
    "\"llamagen\","
    " \"llm\": {\"hidden_size\": 64, \"num_layers\": 2, \"num_heads\": 4, \"num_kv_heads\": 4,"
    "  \"head_dim\": 16, \"intermediate_size\": 256, \"rms_norm_eps\": 1e-5, \"rope_theta\": "
    "10000},"
    " \"image\": {\"grid_height\": 8, \"grid_width\": 8, \"codebook_size\": 128, \"embed_dim\": 8},"
    " \"condition\": {\"num_classes\": 10},"
    " \"decoder\": {\"type\": \"vq16\", \"latent_channels\": 32, \"base_channels\": 32,"
    "  \"channel_multiplier\": [1, 1, 2], \"num_res_blocks\": 1, \"out_channels\": 3,"
    "  \"pixels\": \"round\"},"
    " \"sampling\": {\"cfg\": 4.0, \"temperature\": 1.0, \"top_k\": 2000, \"top_p\": 1.0}}";

/* LlamaGen: a class table of num_classes + 1 rows instead of a vocabulary,
 * no tokenizer or prompt, no Janus aligner or head keys, a rounding pixel
 * conversion; its own mistakes named. */
static void test_llamagen_config(void) {
    model_config_t c;
    ar_error_t err = {{0}};
    CHECK_MSG(model_config_parse(&c, LLAMAGEN, strlen(LLAMAGEN), "l/arserve.json", &err) == AR_OK,
              "%s", err.msg);
    CHECK(strcmp(c.architecture, "llamagen") == 0 && c.condition.num_classes == 10);
    CHECK(c.llm.vocab_size == 11 && c.image.aligner_layers == 0 && c.image.head_hidden_size == 0);
    CHECK(c.tokenizer[0] == 0 && c.decoder.pixels == VQ_PIXELS_ROUND);
    CHECK(model_config_image_height(&c) == 32);
    static const struct {
        const char *from, *to, *want;
    } cases[] = {
        {"\"hidden_size\": 64,", "\"vocab_size\": 11, \"hidden_size\": 64,",
         "unknown key 'llm.vocab_size'"},
        {"\"embed_dim\": 8}", "\"embed_dim\": 8, \"aligner_layers\": 1}",
         "unknown key 'image.aligner_layers'"},
        {"\"condition\": {\"num_classes\": 10},", "", "missing required key 'condition'"},
        {"\"head_dim\": 16", "\"head_dim\": 18", "multiple of 4"},
        {"\"num_heads\": 4, \"num_kv_heads\": 4", "\"num_heads\": 2, \"num_kv_heads\": 2",
         "must equal 'llm.hidden_size'"},
        {"\"pixels\": \"round\"", "\"pixels\": \"floor\"", "'decoder.pixels' is 'floor'"},
        {"\"name\": \"l\",", "\"name\": \"l\", \"tokenizer\": \"t.json\",",
         "unknown key 'tokenizer'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *at = strstr(LLAMAGEN, cases[i].from);
        if (!at) {
            CHECK_MSG(0, "test bug: case %zu", i);
            continue;
        }
        char json[2048];
        snprintf(json, sizeof json, "%.*s%s%s", (int)(at - LLAMAGEN), LLAMAGEN, cases[i].to,
                 at + strlen(cases[i].from));
        CHECK_MSG(model_config_parse(&c, json, strlen(json), "l/arserve.json", &err) == AR_ERR,
                  "case %zu was accepted", i);
        CHECK_STR_CONTAINS(err.msg, cases[i].want);
    }
}

/* Infinity's epsilons, the transformer's and the T5 encoder's: 0 is
 * refused, naming the key (a zero row would divide by zero). */
static void test_infinity_norm_eps_must_be_positive(void) {
    size_t len = 0;
    char *text = NULL;
    FILE *f = fopen("tests/golden/infinity_tiny/arserve.json", "rb");
    CHECK(f != NULL);
    if (!f)
        return;
    char buf[4096];
    FILE *mem = open_memstream(&text, &len);
    for (size_t n; (n = fread(buf, 1, sizeof buf, f)) > 0;)
        fwrite(buf, 1, n, mem);
    fclose(f);
    fclose(mem);
    static const char *const keys[] = {"llm.norm_eps", "text.norm_eps"};
    for (int k = 0; k < 2; k++) {
        /* The k-th "norm_eps" of the file: llm's comes first, then text's. */
        char *at = strstr(text, "\"norm_eps\": ");
        for (int i = 0; at && i < k; i++)
            at = strstr(at + 1, "\"norm_eps\": ");
        CHECK(at != NULL);
        if (!at)
            break;
        char *json = malloc(len + 16);
        const char *end = at + strcspn(at, ",\n}");
        snprintf(json, len + 16, "%.*s\"norm_eps\": 0%s", (int)(at - text), text, end);
        model_config_t c;
        ar_error_t err = {{0}};
        CHECK_MSG(model_config_parse(&c, json, strlen(json), "m/arserve.json", &err) == AR_ERR,
                  "%s: 0 accepted", keys[k]);
        char want[96];
        snprintf(want, sizeof want, "m/arserve.json: '%s' is 0; a norm's epsilon", keys[k]);
        CHECK_STR_CONTAINS(err.msg, want);
        free(json);
    }
    free(text);
}

static void test_not_an_object(void) {
    model_config_t c;
    ar_error_t err = {{0}};
    CHECK(model_config_parse(&c, "[1]", 3, "x.json", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "must be a JSON object");
    CHECK(model_config_parse(&c, "", 0, "x.json", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "not valid JSON");
}

int main(void) {
    TEST_RUN(test_valid_config_parses);
    TEST_RUN(test_kv_budgets_parse);
    TEST_RUN(test_tiny_model_config_loads);
    TEST_RUN(test_missing_file_is_named);
    TEST_RUN(test_mistakes_name_the_key);
    TEST_RUN(test_not_an_object);
    TEST_RUN(test_infinity_norm_eps_must_be_positive);
    TEST_RUN(test_llamagen_config);
    return TEST_SUMMARY();
}
