/* libFuzzer target: bytes as a POST /v1/images/generations body.
 *   1. the strict JSON check against cJSON: a text the check accepts, cJSON
 *      parses to its end (a disagreement is a crash);
 *   2. api_parse_image_request under the daemon's limits for a prompt model
 *      and for a class-conditional one; an accepted request is in range, and
 *      the response and SSE payloads built from it are strict JSON; a refused
 *      one is a well-formed error whose JSON is strict too.
 * Build and run: make -f Makefile -f tests/fuzz/fuzz.mk fuzz (tests/fuzz/fuzz.mk). */
#include "engine/format/json_strict.h"
#include "server/api.h"
#include "tests/fuzz/fuzz.h"

#include <cjson/cJSON.h>

#include <math.h>

static const int widths[] = {384, 256}, heights[] = {384, 512};
static const char *const class_names[] = {"a red circle", "a blue square", "two green triangles",
                                          "a large \xc3\xa9toile"};

static const api_limits_t prompt_limits = {.model_name = "shapes",
                                           .max_n = 4,
                                           .n_sizes = 2,
                                           .widths = widths,
                                           .heights = heights,
                                           .max_prompt_bytes = 4096,
                                           .codebook_size = 1024};

static const api_limits_t class_limits = {.model_name = "shapes-var",
                                          .max_n = 4,
                                          .n_sizes = 1,
                                          .widths = widths,
                                          .heights = heights,
                                          .max_prompt_bytes = 4096,
                                          .codebook_size = 4096,
                                          .num_classes = 4,
                                          .class_names = class_names};

/* 1: whatever the strict check accepts, cJSON parses, to the end. */
static void check_strict_against_cjson(const char *text, size_t len) {
    json_strict_fault_t f;
    if (json_strict_check(text, len, JSON_STRICT_MAX_DEPTH, &f) != AR_OK) {
        FUZZ_REQUIRE(f.offset <= len && f.why[0], "fault at byte %zu of %zu", f.offset, len);
        return;
    }
    size_t bom = len >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0 ? 3 : 0;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text + bom, len - bom, &end, 0);
    FUZZ_REQUIRE(root != NULL, "cJSON refused a text the strict check accepted");
    size_t at = (size_t)(end - text);
    while (at < len && strchr(" \t\r\n", text[at]))
        at++;
    FUZZ_REQUIRE(at == len, "cJSON stopped at byte %zu of %zu", at, len);
    cJSON_Delete(root);
}

static void check_accepted(const api_image_request_t *r, const api_limits_t *lim,
                           const uint8_t *data, size_t size) {
    FUZZ_REQUIRE(r->n >= 1 && r->n <= lim->max_n, "n %d", r->n);
    int size_ok = 0;
    for (int i = 0; i < lim->n_sizes; i++)
        size_ok |= r->width == lim->widths[i] && r->height == lim->heights[i];
    FUZZ_REQUIRE(size_ok, "size %dx%d", r->width, r->height);
    FUZZ_REQUIRE(r->prompt || r->has_class, "neither prompt nor class");
    if (r->prompt) {
        size_t n = strlen(r->prompt);
        FUZZ_REQUIRE(n >= 1 && n <= lim->max_prompt_bytes, "prompt of %zu bytes", n);
    }
    if (r->has_class)
        FUZZ_REQUIRE(r->class_label >= 0 && r->class_label < lim->num_classes, "class %d",
                     r->class_label);
    FUZZ_REQUIRE(r->partial_images >= 0 && r->partial_images <= 3, "partial_images");
    FUZZ_REQUIRE(!r->has_seed || r->seed <= (uint64_t)API_MAX_SEED, "seed");
    FUZZ_REQUIRE(!r->has_top_k || (r->top_k >= 0 && r->top_k <= lim->codebook_size), "top_k");
    FUZZ_REQUIRE(!r->has_top_p || (r->top_p > 0 && r->top_p <= 1), "top_p");
    FUZZ_REQUIRE(!r->has_temperature || (r->temperature >= 0 && r->temperature <= 100), "temp");
    FUZZ_REQUIRE(isfinite(r->kv_policy.budget), "budget");
    FUZZ_REQUIRE(strlen(r->user) < sizeof r->user, "user");

    sampler_params_t defaults = {0}, sp;
    api_image_request_sampler_params(r, &defaults, &sp);

    /* The payloads a run of this request would send, with the input itself
     * standing in for the PNG bytes. */
    char *b64 = api_base64(data, size > 512 ? 512 : size);
    FUZZ_REQUIRE(b64 && strlen(b64) == ((size > 512 ? 512 : size) + 2) / 3 * 4, "base64 length");
    const char *pngs[4] = {b64, b64, b64, b64};
    api_kv_report_t kv = {.policy = r->kv_policy, .planned_peak_bytes = size, .peak_bytes = size};
    api_timings_t t = {.queue_s = 0.25, .run_s = 1.5, .decode_png_s = 0.125, .steps = 576};
    int prompt_tokens = r->prompt ? (int)strlen(r->prompt) : 1;
    char *json = api_images_response_json(1700000000, r->n, pngs, r->width, r->height, 576 * r->n,
                                          prompt_tokens, &kv, &t, r->prompt);
    fuzz_require_json(json, "api_images_response_json");
    free(json);
    json = api_sse_progress(r->n, 576, r->n - 1);
    fuzz_require_json(json, "api_sse_progress");
    free(json);
    json = api_sse_partial_image(b64, r->partial_images, r->n - 1, 1700000000, r->width, r->height);
    fuzz_require_json(json, "api_sse_partial_image");
    free(json);
    /* Warnings quote the client's text: the prompt stands in for them. */
    json = api_sse_completed(b64, r->n - 1, 1700000000, r->width, r->height, 576, prompt_tokens,
                             NULL, NULL, r->prompt);
    fuzz_require_json(json, "api_sse_completed");
    free(json);
    /* The prompt and user are client text: echoed in an error, still JSON. */
    api_error_t e;
    api_errorf(&e, 400, r->prompt ? r->prompt : "", "invalid_value", "prompt '%s', user '%s'",
               r->prompt ? r->prompt : "", r->user);
    json = api_error_json(&e);
    fuzz_require_json(json, "api_error_json of an echoed prompt");
    free(json);
    free(b64);
}

static void check_refused(const api_error_t *e) {
    FUZZ_REQUIRE(e->status == 400 || e->status == 404, "status %d", e->status);
    FUZZ_REQUIRE(e->message[0] && e->code[0], "empty message or code");
    FUZZ_REQUIRE(strcmp(e->type, "invalid_request_error") == 0, "type %s", e->type);
    char *json = api_error_json(e);
    fuzz_require_json(json, "api_error_json");
    free(json);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *body = (const char *)data;
    check_strict_against_cjson(body, size);
    const api_limits_t *lims[] = {&prompt_limits, &class_limits};
    for (int k = 0; k < 2; k++) {
        api_image_request_t r;
        api_error_t e;
        if (api_parse_image_request(body, size, lims[k], &r, &e) == AR_OK) {
            check_accepted(&r, lims[k], data, size);
            api_image_request_free(&r);
        } else {
            check_refused(&e);
        }
    }
    return 0;
}
