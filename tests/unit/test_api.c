/* Tests for server/api.c: image request validation (valid bodies, a table of
 * bad ones with their status, param and code, nesting and UTF-8 edges, random
 * mutations under ASan), the JSON and SSE builders parsed back with cJSON, and
 * base64 against RFC 4648's vectors.
 * Run: gcc -std=c11 -D_GNU_SOURCE -I. tests/unit/test_api.c server/api.c
 *      engine/policy/kv_policy.c base/status.c -lcjson -lm && ./a.out */
#include "server/api.h"
#include "tests/test.h"

#include <cjson/cJSON.h>

#include <stdint.h>
#include <stdlib.h>

static const int test_widths[] = {384, 256};
static const int test_heights[] = {384, 256};

static const api_limits_t test_limits = {
    .model_name = "janus-pro-tiny",
    .max_n = 4,
    .n_sizes = 2,
    .widths = test_widths,
    .heights = test_heights,
    .max_prompt_bytes = 32,
    .codebook_size = 16384,
};

/* A splitmix64 stream for the mutation test. */
static uint64_t test_rand_state = 0x243f6a8885a308d3ULL;
static uint64_t test_rand_u64(void) {
    uint64_t z = (test_rand_state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Parses body from an exactly-sized heap copy, so ASan sees any read past len. */
static int parse_exact(const char *body, size_t len, const api_limits_t *lim,
                       api_image_request_t *req, api_error_t *err) {
    char *copy = malloc(len ? len : 1);
    if (len)
        memcpy(copy, body, len);
    int rc = api_parse_image_request(copy, len, lim, req, err);
    free(copy);
    return rc;
}

static int parse(const char *body, api_image_request_t *req, api_error_t *err) {
    return parse_exact(body, strlen(body), &test_limits, req, err);
}

/* Well-formed UTF-8, by a decoder independent of api.c's: code points
 * reassembled and checked for overlongs, surrogates and range. */
static int test_utf8_valid(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        uint32_t cp;
        int extra;
        if (*p < 0x80) {
            p++;
            continue;
        } else if ((*p & 0xE0) == 0xC0) {
            cp = *p & 0x1F, extra = 1;
        } else if ((*p & 0xF0) == 0xE0) {
            cp = *p & 0x0F, extra = 2;
        } else if ((*p & 0xF8) == 0xF0) {
            cp = *p & 0x07, extra = 3;
        } else {
            return 0;
        }
        p++;
        for (int k = 0; k < extra; k++, p++) {
            if ((*p & 0xC0) != 0x80)
                return 0;
            cp = cp << 6 | (*p & 0x3F);
        }
        static const uint32_t min_cp[] = {0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[extra] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
    }
    return 1;
}

/* The error is complete, and api_error_json renders it as the API promises. */
static void check_error_shape(const api_error_t *err) {
    CHECK(err->status == 400 || err->status == 404 || err->status == 500);
    CHECK(err->message[0] != 0);
    CHECK(err->code[0] != 0);
    CHECK(test_utf8_valid(err->message));
    CHECK(test_utf8_valid(err->param));
    CHECK_STR_CONTAINS(err->type, "error");
    char *json = api_error_json(err);
    CHECK(json != NULL);
    cJSON *root = json ? cJSON_Parse(json) : NULL;
    CHECK(root != NULL);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(root, "error");
    CHECK(cJSON_IsObject(e));
    const cJSON *msg = cJSON_GetObjectItemCaseSensitive(e, "message");
    const cJSON *param = cJSON_GetObjectItemCaseSensitive(e, "param");
    CHECK(cJSON_IsString(msg) && strcmp(msg->valuestring, err->message) == 0);
    CHECK(err->param[0] ? cJSON_IsString(param) && strcmp(param->valuestring, err->param) == 0
                        : cJSON_IsNull(param));
    cJSON_Delete(root);
    free(json);
}

static void test_minimal_request_gets_defaults(void) {
    api_image_request_t r;
    api_error_t err;
    CHECK(parse("{\"prompt\": \"a red square\"}", &r, &err) == AR_OK);
    CHECK(r.prompt && strcmp(r.prompt, "a red square") == 0);
    CHECK(r.n == 1 && r.width == 384 && r.height == 384);
    CHECK(r.want_b64 == 1 && r.stream == 0 && r.partial_images == 0);
    CHECK(!r.has_seed && !r.has_guidance_scale && !r.has_temperature && !r.has_top_k &&
          !r.has_top_p && !r.kv.has_kind && r.kv.budget == 0);
    CHECK(r.user[0] == 0);
    api_image_request_free(&r);
    CHECK(r.prompt == NULL);
    api_image_request_free(&r); /* twice is safe */
}

static void test_full_request_sets_every_field(void) {
    const char *body =
        " {\n\t\"prompt\": \"caf\\u00e9 \\ud83d\\ude00 [{\\\"x\\\"}] \\\\u0000\",\r\n"
        " \"model\": \"janus-pro-tiny\", \"n\": 4, \"size\": \"256x256\",\n"
        " \"response_format\": \"b64_json\", \"output_format\": \"png\",\n"
        " \"user\": \"u-42\", \"seed\": 9007199254740991, \"guidance_scale\": 5,\n"
        " \"temperature\": 0, \"top_k\": 16384, \"top_p\": 1, \"kv_policy\": "
        "\"headkv\",\n \"kv_budget\": 0.25, \"stream\": true, \"partial_images\": 3} ";
    api_image_request_t r;
    api_error_t err;
    int rc = parse(body, &r, &err);
    CHECK_MSG(rc == AR_OK, "%s", err.message);
    CHECK(r.prompt && strcmp(r.prompt, "caf\xc3\xa9 \xf0\x9f\x98\x80 [{\"x\"}] \\u0000") == 0);
    CHECK(r.n == 4 && r.width == 256 && r.height == 256 && r.want_b64 == 1);
    CHECK(strcmp(r.user, "u-42") == 0);
    CHECK(r.has_seed && r.seed == 9007199254740991ULL);
    CHECK(r.has_guidance_scale && r.guidance_scale == 5.0f);
    CHECK(r.has_temperature && r.temperature == 0.0f);
    CHECK(r.has_top_k && r.top_k == 16384);
    CHECK(r.has_top_p && r.top_p == 1.0f);
    CHECK(r.kv.has_kind && r.kv.kind == KV_POLICY_HEADKV && r.kv_policy.kind == KV_POLICY_HEADKV);
    CHECK(r.kv.budget == 0.25 && r.kv_policy.budget == 0.25);
    CHECK(r.stream == 1 && r.partial_images == 3);
    api_image_request_free(&r);
}

static void test_null_means_not_given(void) {
    api_image_request_t r;
    api_error_t err;
    const char *body = "{\"prompt\":\"x\",\"model\":null,\"n\":null,\"size\":null,"
                       "\"response_format\":null,\"output_format\":null,\"user\":null,"
                       "\"seed\":null,\"guidance_scale\":null,\"temperature\":null,\"top_k\":null,"
                       "\"top_p\":null,\"kv_policy\":null,\"kv_budget\":null,\"stream\":null,"
                       "\"partial_images\":null}";
    CHECK(parse(body, &r, &err) == AR_OK);
    CHECK(r.n == 1 && r.width == 384 && !r.has_seed && !r.has_top_p && !r.kv.has_kind);
    CHECK(r.stream == 0 && r.user[0] == 0);
    api_image_request_free(&r);
}

static void test_size_auto_is_first_size(void) {
    api_image_request_t r;
    api_error_t err;
    CHECK(parse("{\"prompt\":\"x\",\"size\":\"auto\"}", &r, &err) == AR_OK);
    CHECK(r.width == 384 && r.height == 384);
    api_image_request_free(&r);
}

static void test_edge_values_accepted(void) {
    static const char *const bodies[] = {
        "{\"prompt\":\"12345678901234567890123456789012\"}", /* exactly max_prompt_bytes */
        "{\"prompt\":\"x\",\"seed\":0}", "{\"prompt\":\"x\",\"seed\":-0}",
        "{\"prompt\":\"x\",\"seed\":4.2e1}", "{\"prompt\":\"x\",\"n\":1.0}",
        "{\"prompt\":\"x\",\"top_p\":1e-9,\"kv_policy\":\"linear\",\"kv_budget\":1}",
        "{\"prompt\":\"x\",\"guidance_scale\":100,\"temperature\":100}",
        "{\"prompt\":\"x\",\"top_k\":0,\"partial_images\":0,\"stream\":false}",
        "{\"prompt\":\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\"}", /* brackets in a string */
        /* user of 127 bytes */
        ("{\"prompt\":\"x\",\"user\":\"012345678901234567890123456789012345678901234567890123456789"
         "0123456789012345678901234567890123456789012345678901234567890123456\"}"),
        "\xef\xbb\xbf{\"prompt\":\"x\"}", /* UTF-8 BOM, which cJSON skips */
    };
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        api_image_request_t r;
        api_error_t err;
        int rc = parse(bodies[i], &r, &err);
        CHECK_MSG(rc == AR_OK, "%s: %s", bodies[i], err.message);
        api_image_request_free(&r);
    }
    api_image_request_t r;
    api_error_t err;
    CHECK(parse("{\"prompt\":\"x\",\"seed\":4.2e1}", &r, &err) == AR_OK && r.seed == 42);
    api_image_request_free(&r);
}

typedef struct bad_case {
    const char *body;
    int status;
    const char *param, *code;
    const char *message_has; /* NULL: no extra check */
} bad_case_t;

static const bad_case_t bad_cases[] = {
    /* the body as a whole */
    {"", 400, "", "invalid_json", "malformed JSON"},
    {" \n\t ", 400, "", "invalid_json", "empty body"},
    {"{\"prompt\": \"x\"", 400, "", "invalid_json", "malformed JSON"},
    {"{\"prompt\": \"x\",}", 400, "", "invalid_json", "malformed JSON"},
    {"{\"prompt\": \"x\"} {}", 400, "", "invalid_json", "after the JSON value"},
    {"{prompt: \"x\"}", 400, "", "invalid_json", "malformed JSON"},
    {"{\"prompt\": NaN}", 400, "", "invalid_json", "malformed JSON"},
    {"{\"prompt\": \"x\", \"n\": Infinity}", 400, "", "invalid_json", "malformed JSON"},
    {"[{\"prompt\": \"x\"}]", 400, "", "invalid_json", "JSON object"},
    {"\"a cat\"", 400, "", "invalid_json", "JSON object"},
    {"null", 400, "", "invalid_json", "JSON object"},
    {"42", 400, "", "invalid_json", "JSON object"},
    {"{\"prompt\":\"x\",\"a\":[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]}", 400, "", "invalid_json",
     "nested deeper than 16"},
    {"{\"prompt\":\"a\x01z\"}", 400, "", "invalid_json", "control character"},
    {"{\"prompt\":\"a\tz\"}", 400, "", "invalid_json", "control character"},
    {"{\"prompt\":\"x\"}\x0c", 400, "", "invalid_json", "control character"},
    /* UTF-8 and escapes */
    {"{\"prompt\":\"\\ud800\"}", 400, "", "invalid_json", "malformed JSON"},
    {"{\"prompt\":\"\\udc00x\"}", 400, "", "invalid_json", "malformed JSON"},
    {"{\"prompt\":\"\\ud800\\u0041\"}", 400, "", "invalid_json", "malformed JSON"},
    /* \u0000 would cut the string: refused, naming the field it is in */
    {"{\"prompt\":\"a\\u0000b\"}", 400, "prompt", "invalid_value",
     "prompt must not contain \\u0000 (a NUL character; byte 12 of the body)"},
    {"{\"prompt\":\"x\",\"user\":\"u\\u0000\"}", 400, "user", "invalid_value", "user must not"},
    {"{\"prompt\":\"x\",\"us\\u0000er\":\"u\"}", 400, "", "invalid_json",
     "a member name contains \\u0000"},
    {"{\"prompt\":\"\xc0\xaf\"}", 400, "", "invalid_json", "invalid UTF-8 at byte 11"},
    {"{\"prompt\":\"\xed\xa0\x80\"}", 400, "", "invalid_json", "invalid UTF-8"},
    {"{\"prompt\":\"\xf4\x90\x80\x80\"}", 400, "", "invalid_json", "invalid UTF-8"},
    {"{\"prompt\":\"\xe2\x82\"}", 400, "", "invalid_json", "invalid UTF-8"},
    {"{\"prompt\":\"\xff\"}", 400, "", "invalid_json", "invalid UTF-8"},
    {"{\"prompt\":\"\x80\"}", 400, "", "invalid_json", "invalid UTF-8"},
    /* unknown and duplicate fields */
    {"{\"prompt\":\"x\",\"quality\":\"high\"}", 400, "quality", "unknown_parameter", "'quality'"},
    {"{\"Prompt\":\"x\"}", 400, "Prompt", "unknown_parameter", NULL},
    {"{\"prompt\":\"x\",\"\":1}", 400, "", "unknown_parameter", "''"},
    {"{\"prompt\":\"x\",\"n\":1,\"n\":2}", 400, "n", "duplicate_parameter", "twice"},
    {"{\"prompt\":\"x\",\"prompt\":\"y\"}", 400, "prompt", "duplicate_parameter", NULL},
    {"{\"prompt\":\"x\",\"seed\":null,\"seed\":1}", 400, "seed", "duplicate_parameter", NULL},
    /* prompt */
    {"{}", 400, "prompt", "missing_required_parameter", "required"},
    {"{\"n\":1}", 400, "prompt", "missing_required_parameter", NULL},
    {"{\"prompt\":null}", 400, "prompt", "missing_required_parameter", NULL},
    {"{\"prompt\":\"\"}", 400, "prompt", "invalid_value", "non-empty"},
    {"{\"prompt\":\"123456789012345678901234567890123\"}", 400, "prompt", "invalid_value",
     "at most 32 bytes; got 33 bytes"},
    {"{\"prompt\":5}", 400, "prompt", "invalid_type", "got a number"},
    {"{\"prompt\":[\"x\"]}", 400, "prompt", "invalid_type", "got an array"},
    {"{\"prompt\":{}}", 400, "prompt", "invalid_type", "got an object"},
    {"{\"prompt\":true}", 400, "prompt", "invalid_type", "got a boolean"},
    /* model */
    {"{\"prompt\":\"x\",\"model\":\"dall-e-3\"}", 404, "model", "model_not_found",
     "janus-pro-tiny"},
    {"{\"prompt\":\"x\",\"model\":1}", 400, "model", "invalid_type", NULL},
    /* n */
    {"{\"prompt\":\"x\",\"n\":0}", 400, "n", "invalid_value", "from 1 to 4; got 0"},
    {"{\"prompt\":\"x\",\"n\":5}", 400, "n", "invalid_value", "got 5"},
    {"{\"prompt\":\"x\",\"n\":-1}", 400, "n", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"n\":1e400}", 400, "n", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"n\":1.5}", 400, "n", "invalid_type", "an integer from 1 to 4; got 1.5"},
    {"{\"prompt\":\"x\",\"n\":\"2\"}", 400, "n", "invalid_type", "got a string"},
    /* size */
    {"{\"prompt\":\"x\",\"size\":\"512x512\"}", 400, "size", "invalid_value",
     "size '512x512' is not supported; the nearest is 384x384; supported: 384x384, 256x256"},
    {"{\"prompt\":\"x\",\"size\":\"384X384\"}", 400, "size", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"size\":\"384x384 \"}", 400, "size", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"size\":\"0384x384\"}", 400, "size", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"size\":\"x\"}", 400, "size", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"size\":\"\"}", 400, "size", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"size\":\"99999999999x1\"}", 400, "size", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"size\":384}", 400, "size", "invalid_type", NULL},
    /* formats and user */
    {"{\"prompt\":\"x\",\"response_format\":\"url\"}", 400, "response_format", "unsupported_value",
     "not supported"},
    {"{\"prompt\":\"x\",\"response_format\":\"png\"}", 400, "response_format", "invalid_value",
     "b64_json"},
    {"{\"prompt\":\"x\",\"response_format\":true}", 400, "response_format", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"output_format\":\"jpeg\"}", 400, "output_format", "unsupported_value",
     "supported: png"},
    {"{\"prompt\":\"x\",\"output_format\":\"gif\"}", 400, "output_format", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"output_format\":1}", 400, "output_format", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"user\":[]}", 400, "user", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"user\":\"012345678901234567890123456789012345678901234567890123456789"
     "01234567890123456789012345678901234567890123456789012345678901234567\"}",
     400, "user", "invalid_value", "at most 127 bytes; got 128 bytes"},
    /* seed */
    {"{\"prompt\":\"x\",\"seed\":-1}", 400, "seed", "invalid_value", "from 0 to 9007199254740991"},
    {"{\"prompt\":\"x\",\"seed\":9007199254740992}", 400, "seed", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"seed\":18446744073709551615}", 400, "seed", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"seed\":1e300}", 400, "seed", "invalid_value", "got 1e+300"},
    {"{\"prompt\":\"x\",\"seed\":0.5}", 400, "seed", "invalid_type", "got 0.5"},
    {"{\"prompt\":\"x\",\"seed\":\"42\"}", 400, "seed", "invalid_type", NULL},
    /* sampling */
    {"{\"prompt\":\"x\",\"guidance_scale\":100.5}", 400, "guidance_scale", "invalid_value",
     "a number from 0 to 100"},
    {"{\"prompt\":\"x\",\"guidance_scale\":-0.5}", 400, "guidance_scale", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"guidance_scale\":\"5\"}", 400, "guidance_scale", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"temperature\":-1}", 400, "temperature", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"temperature\":true}", 400, "temperature", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"top_k\":16385}", 400, "top_k", "invalid_value", "from 0 to 16384"},
    {"{\"prompt\":\"x\",\"top_k\":-1}", 400, "top_k", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"top_k\":2.5}", 400, "top_k", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"top_k\":\"3\"}", 400, "top_k", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"top_p\":0}", 400, "top_p", "invalid_value",
     "a number greater than 0 and at most 1; got 0"},
    {"{\"prompt\":\"x\",\"top_p\":1.01}", 400, "top_p", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"top_p\":\"0.9\"}", 400, "top_p", "invalid_type", NULL},
    /* KV and streaming */
    {"{\"prompt\":\"x\",\"kv_policy\":\"lru\"}", 400, "kv_policy", "invalid_value",
     "one of full, streaming, linear, headkv, heatkv, heatkv_binary, amskv, scalekv, auto; got "
     "'lru'"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"FULL\"}", 400, "kv_policy", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"kv_policy\":1}", 400, "kv_policy", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"kv_budget\":0}", 400, "kv_budget", "invalid_value", "greater than 0"},
    {"{\"prompt\":\"x\",\"kv_budget\":1.5}", 400, "kv_budget", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"kv_budget\":\"0.5\"}", 400, "kv_budget", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"kv_budget_min\":0}", 400, "kv_budget_min", "invalid_value",
     "greater than 0"},
    {"{\"prompt\":\"x\",\"kv_budget_min\":1.5}", 400, "kv_budget_min", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"kv_budget_min\":\"0.5\"}", 400, "kv_budget_min", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"kv_budget_min\":0.5}", 400, "kv_budget_min", "invalid_value",
     "full takes no budget"},
    /* a budget on a policy that takes none would be ignored: refused, naming it */
    {"{\"prompt\":\"x\",\"kv_policy\":\"full\",\"kv_budget\":0.5}", 400, "kv_budget",
     "invalid_value", "kv_budget: kv_policy full takes no budget"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"amskv\",\"kv_budget\":0.05}", 400, "kv_budget",
     "invalid_value", "kv_policy amskv takes no budget"},
    {"{\"prompt\":\"x\",\"kv_budget\":1}", 400, "kv_budget", "invalid_value",
     "this request has no kv_policy and the server's default, full, takes no budget"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"kv_budget\":0.5,\"kv_budget_min\":0.6}", 400,
     "kv_budget_min", "invalid_value", "above the range's top, kv_budget 0.5"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"auto\"}", 400, "kv_policy", "invalid_value",
     "no compressed policy"},
    {"{\"prompt\":\"x\",\"stream\":\"true\"}", 400, "stream", "invalid_type", "boolean"},
    {"{\"prompt\":\"x\",\"stream\":1}", 400, "stream", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"partial_images\":4}", 400, "partial_images", "invalid_value",
     "from 0 to 3; got 4"},
    {"{\"prompt\":\"x\",\"partial_images\":-1}", 400, "partial_images", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"partial_images\":\"2\"}", 400, "partial_images", "invalid_type", NULL},
    /* async jobs: a boolean, and never with a stream (either order) */
    {"{\"prompt\":\"x\",\"async\":1}", 400, "async", "invalid_type", "async must be a boolean"},
    {"{\"prompt\":\"x\",\"async\":true,\"stream\":true}", 400, "async", "invalid_value",
     "stream and async cannot both be true"},
    {"{\"stream\":true,\"prompt\":\"x\",\"async\":true}", 400, "async", "invalid_value", NULL},
    /* the first fault in document order is the one reported */
    {"{\"n\":9,\"prompt\":\"\",\"bogus\":1}", 400, "n", "invalid_value", NULL},
    /* KV policy knobs: ranges, types, duplicates, and the policy they belong to */
    {"{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"anchor_lines\":-1}", 400, "anchor_lines",
     "invalid_value", "an integer from 0 to 4096; got -1"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"anchor_lines\":1.5}", 400, "anchor_lines",
     "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"recent_lines\":\"2\"}", 400, "recent_lines",
     "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"recent_lines\":4097}", 400, "recent_lines",
     "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"kv_policy\":\"streaming\",\"sink_tokens\":-1}", 400, "sink_tokens",
     "invalid_value", "from 0 to 65536"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"streaming\",\"sink_scales\":257}", 400, "sink_scales",
     "invalid_value", "an integer from 0 to 256; got 257"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"sink_scales\":3}", 400, "sink_scales",
     "invalid_value",
     "sink_scales is a knob of kv_policy streaming, heatkv, heatkv_binary; this request's "
     "kv_policy is linear"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"headkv\",\"headkv_threshold\":0}", 400, "headkv_threshold",
     "invalid_value", "a number greater than 0 and at most 1; got 0"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"headkv\",\"headkv_alpha\":1.5}", 400, "headkv_alpha",
     "invalid_value", "a number from 0 to 1; got 1.5"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"headkv\",\"headkv_buffer\":0}", 400, "headkv_buffer",
     "invalid_value", "from 1 to 65536"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"headkv\",\"headkv_local_window\":-2}", 400,
     "headkv_local_window", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"kv_policy\":\"headkv\",\"headkv_recent_lines\":true}", 400,
     "headkv_recent_lines", "invalid_type", NULL},
    {"{\"prompt\":\"x\",\"kv_policy\":\"headkv\",\"headkv_group_tokens\":0}", 400,
     "headkv_group_tokens", "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"anchor_lines\":1,\"anchor_lines\":2}", 400,
     "anchor_lines", "duplicate_parameter", NULL},
    {"{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"sink_tokens\":4}", 400, "sink_tokens",
     "invalid_value",
     "sink_tokens is a knob of kv_policy streaming; this request's kv_policy is linear"},
    {"{\"prompt\":\"x\",\"headkv_buffer\":4,\"kv_policy\":\"streaming\"}", 400, "headkv_buffer",
     "invalid_value", "knob of kv_policy headkv"},
    {"{\"prompt\":\"x\",\"kv_policy\":\"full\",\"recent_lines\":1}", 400, "recent_lines",
     "invalid_value", NULL},
    {"{\"prompt\":\"x\",\"headkv_alpha\":0.5}", 400, "headkv_alpha", "invalid_value",
     "no kv_policy and the server's default is full"},
    /* a field's own fault comes before the knobs' policy check */
    {"{\"kv_policy\":\"linear\",\"sink_tokens\":1,\"n\":9,\"prompt\":\"x\"}", 400, "n",
     "invalid_value", NULL},
};

static void test_bad_requests_table(void) {
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const bad_case_t *c = &bad_cases[i];
        api_image_request_t r;
        api_error_t err;
        memset(&err, 0x55, sizeof err);
        int rc = parse(c->body, &r, &err);
        CHECK_MSG(rc == AR_ERR, "case %zu accepted: %s", i, c->body);
        if (rc != AR_ERR) {
            api_image_request_free(&r);
            continue;
        }
        CHECK(r.prompt == NULL); /* nothing to free after a failure */
        CHECK_MSG(err.status == c->status && strcmp(err.param, c->param) == 0 &&
                      strcmp(err.code, c->code) == 0,
                  "case %zu %s: got %d param '%s' code '%s': %s", i, c->body, err.status, err.param,
                  err.code, err.message);
        CHECK(strcmp(err.type, "invalid_request_error") == 0);
        if (c->message_has)
            CHECK_STR_CONTAINS(err.message, c->message_has);
        /* every field error names its field in the message */
        if (c->param[0])
            CHECK_STR_CONTAINS(err.message, c->param);
        check_error_shape(&err);
    }
}

static void test_kv_knobs_given_and_resolved(void) {
    api_image_request_t r;
    api_error_t err;
    kv_policy_params_t p;
    const char *body = "{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"anchor_lines\":0,"
                       "\"recent_lines\":null}";
    CHECK_MSG(parse(body, &r, &err) == AR_OK, "%s", err.message);
    const kv_policy_knob_t *anchor = kv_policy_knob_find("anchor_lines");
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++)
        CHECK(anchor && r.kv.knobs_given[i] == (i == anchor - kv_policy_knobs));
    /* No daemon defaults: the papers' knobs and the policy's own budget. */
    kv_policy_resolve(NULL, &r.kv, &p, NULL, NULL);
    CHECK(p.kind == KV_POLICY_LINEAR && p.budget == 1.0 / 6);
    CHECK(p.anchor_lines == 0 && p.recent_lines == 2 && p.sink_tokens == 4);
    /* The daemon's defaults: its budget and knobs, under what the request gave. */
    kv_policy_params_t d;
    kv_policy_defaults(&d, KV_POLICY_HEADKV);
    d.budget = 0.25;
    d.anchor_lines = 3;
    d.recent_lines = 1;
    d.headkv_group_tokens = 50;
    kv_policy_resolve(&d, &r.kv, &p, NULL, NULL);
    CHECK(p.kind == KV_POLICY_LINEAR && p.budget == 0.25);
    CHECK(p.anchor_lines == 0 && p.recent_lines == 1 && p.headkv_group_tokens == 50);
    api_image_request_free(&r);

    /* Without kv_policy the daemon's default policy applies, and its knobs may be given. */
    api_limits_t lim = test_limits;
    lim.kv_defaults = &d;
    body = "{\"prompt\":\"x\",\"kv_budget\":0.5,\"headkv_alpha\":0,\"headkv_threshold\":1}";
    CHECK_MSG(parse_exact(body, strlen(body), &lim, &r, &err) == AR_OK, "%s", err.message);
    kv_policy_resolve(&d, &r.kv, &p, NULL, NULL);
    CHECK(p.kind == KV_POLICY_HEADKV && p.budget == 0.5 && p.headkv_alpha == 0);
    CHECK(p.headkv_threshold == 1 && p.headkv_buffer == 8 && p.headkv_group_tokens == 50);
    api_image_request_free(&r);
    body = "{\"prompt\":\"x\",\"sink_tokens\":2}";
    CHECK(parse_exact(body, strlen(body), &lim, &r, &err) == AR_ERR);
    CHECK(strcmp(err.param, "sink_tokens") == 0);
    CHECK_STR_CONTAINS(err.message, "the server's default is headkv");
    /* A daemon budget of 0 means each policy's own. */
    d.budget = 0;
    body = "{\"prompt\":\"x\",\"kv_policy\":\"streaming\",\"sink_tokens\":65536}";
    CHECK_MSG(parse_exact(body, strlen(body), &lim, &r, &err) == AR_OK, "%s", err.message);
    kv_policy_resolve(&d, &r.kv, &p, NULL, NULL);
    CHECK(p.kind == KV_POLICY_STREAMING && p.budget == 1.0 / 6 && p.sink_tokens == 65536);
    api_image_request_free(&r);
    body = "{\"prompt\":\"x\",\"kv_policy\":\"streaming\",\"sink_scales\":0}";
    CHECK_MSG(parse_exact(body, strlen(body), &lim, &r, &err) == AR_OK, "%s", err.message);
    kv_policy_resolve(&d, &r.kv, &p, NULL, NULL);
    CHECK(p.kind == KV_POLICY_STREAMING && p.sink_scales == 0 && p.sink_tokens == 4);
    api_image_request_free(&r);
    /* Every knob is a request field. */
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++) {
        const kv_policy_knob_t *k = &kv_policy_knobs[i];
        char text[160];
        snprintf(text, sizeof text, "{\"prompt\":\"x\",\"kv_policy\":\"%s\",\"%s\":%g}",
                 kv_policy_name(kv_policy_knob_owner(k)), k->name, k->hi);
        CHECK_MSG(parse(text, &r, &err) == AR_OK, "%s: %s", text, err.message);
        kv_policy_resolve(NULL, &r.kv, &p, NULL, NULL);
        CHECK_MSG(kv_policy_knob_get(&p, k) == k->hi, "%s", k->name);
        api_image_request_free(&r);
    }
}

/* The seen-set has room for every member, however many fields and knobs
 * there are: a request may give every field and all of its policy's knobs
 * at once, and any one of them given twice is a duplicate naming it. A
 * seen-set narrower than the members (a 32-bit mask once there are 33)
 * misses some duplicates or sees some that are not. */
static void test_every_member_once_and_each_twice(void) {
    static const char *const fields =
        "\"prompt\":\"x\",\"model\":\"janus-pro-tiny\",\"n\":1,\"size\":\"384x384\","
        "\"response_format\":\"b64_json\",\"output_format\":\"png\",\"user\":\"u\","
        "\"seed\":1,\"guidance_scale\":1,\"temperature\":1,\"top_k\":1,\"top_p\":1,"
        "\"stream\":false,\"partial_images\":0,\"async\":false";
    for (int k = 0; k < KV_POLICY_COUNT; k++) {
        /* {fields, "kv_policy": k, every knob of k at its default} */
        char members[64][96];
        int n = 0;
        char copy[1024];
        snprintf(copy, sizeof copy, "%s", fields);
        for (char *save = NULL, *m = strtok_r(copy, ",", &save); m; m = strtok_r(NULL, ",", &save))
            snprintf(members[n++], sizeof members[0], "%s", m);
        snprintf(members[n++], sizeof members[0], "\"kv_policy\":\"%s\"",
                 kv_policy_name((kv_policy_kind_t)k));
        if (kv_policy_uses_budget((kv_policy_kind_t)k, NULL))
            snprintf(members[n++], sizeof members[0], "\"kv_budget\":0.5");
        for (int i = 0; i < KV_POLICY_N_KNOBS; i++)
            if (kv_policy_knob_of(&kv_policy_knobs[i], (kv_policy_kind_t)k))
                snprintf(members[n++], sizeof members[0], "\"%s\":%.17g", kv_policy_knobs[i].name,
                         kv_policy_knobs[i].def);
        for (int twice = -1; twice < n; twice++) {
            char body[8192] = "{";
            for (int i = 0; i < n; i++)
                snprintf(body + strlen(body), sizeof body - strlen(body), "%s%s", i ? "," : "",
                         members[i]);
            if (twice >= 0)
                snprintf(body + strlen(body), sizeof body - strlen(body), ",%s", members[twice]);
            strcat(body, "}");
            api_image_request_t r;
            api_error_t err = {0};
            const int rc = parse(body, &r, &err);
            if (twice < 0) {
                CHECK_MSG(rc == AR_OK, "%s: %s", kv_policy_name((kv_policy_kind_t)k), err.message);
                for (int i = 0; rc == AR_OK && i < KV_POLICY_N_KNOBS; i++)
                    CHECK(r.kv.knobs_given[i] ==
                          kv_policy_knob_of(&kv_policy_knobs[i], (kv_policy_kind_t)k));
            } else {
                char name[96];
                snprintf(name, sizeof name, "%.*s", (int)strcspn(members[twice] + 1, "\""),
                         members[twice] + 1);
                CHECK_MSG(rc == AR_ERR && !strcmp(err.code, "duplicate_parameter") &&
                              !strcmp(err.param, name),
                          "%s twice: %s", name, rc == AR_OK ? "accepted" : err.message);
            }
            if (rc == AR_OK)
                api_image_request_free(&r);
        }
    }
}

static void test_size_message_lists_allowed_sizes(void) {
    static const int w[] = {384}, h[] = {384};
    api_limits_t lim = test_limits;
    lim.n_sizes = 1;
    lim.widths = w;
    lim.heights = h;
    const char *body = "{\"prompt\":\"x\",\"size\":\"512x512\"}";
    api_image_request_t r;
    api_error_t err;
    CHECK(parse_exact(body, strlen(body), &lim, &r, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.message, "size '512x512' is not supported; supported: 384x384");
}

/* negative_prompt: kept where the model takes one (Infinity), with the
 * prompt's rules; refused by name where it does not. */
static void test_negative_prompt_where_the_model_takes_one(void) {
    api_limits_t lim = test_limits;
    api_image_request_t r;
    api_error_t err;
    const char *ok_body = "{\"prompt\":\"x\",\"negative_prompt\":\"blurry\"}";
    CHECK(parse_exact(ok_body, strlen(ok_body), &lim, &r, &err) == AR_ERR);
    CHECK(strcmp(err.param, "negative_prompt") == 0);
    CHECK_STR_CONTAINS(err.message, "negative_prompt: this model takes none");
    lim.negative_prompt = 1;
    CHECK_MSG(parse_exact(ok_body, strlen(ok_body), &lim, &r, &err) == AR_OK, "%s", err.message);
    CHECK(r.negative_prompt && strcmp(r.negative_prompt, "blurry") == 0);
    api_image_request_free(&r);
    CHECK(r.negative_prompt == NULL);
    const char *bad[] = {
        "{\"prompt\":\"x\",\"negative_prompt\":\"\"}", "{\"prompt\":\"x\",\"negative_prompt\":3}",
        "{\"prompt\":\"x\",\"negative_prompt\":\"0123456789012345678901234567890123\"}"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        CHECK_MSG(parse_exact(bad[i], strlen(bad[i]), &lim, &r, &err) == AR_ERR, "%s", bad[i]);
        CHECK_MSG(strcmp(err.param, "negative_prompt") == 0, "%s: param %s", bad[i], err.param);
    }
}

static void test_nesting_cap_counts_structure_only(void) {
    char body[256];
    /* "a" holds 15 arrays: with the body object that is 16 levels, allowed by
     * the scan, so the error is about the unknown field instead. */
    for (int arrays = 15; arrays <= 16; arrays++) {
        int k = snprintf(body, sizeof body, "{\"prompt\":\"x\",\"a\":");
        for (int i = 0; i < arrays; i++)
            body[k++] = '[';
        for (int i = 0; i < arrays; i++)
            body[k++] = ']';
        body[k++] = '}';
        body[k] = 0;
        api_image_request_t r;
        api_error_t err;
        CHECK(parse(body, &r, &err) == AR_ERR);
        CHECK(strcmp(err.code, arrays == 15 ? "unknown_parameter" : "invalid_json") == 0);
    }
    /* A million open brackets are refused at the 17th, long before cJSON. */
    size_t n = 1000000;
    char *deep = malloc(n);
    memset(deep, '[', n);
    api_image_request_t r;
    api_error_t err;
    CHECK(parse_exact(deep, n, &test_limits, &r, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.message, "nested deeper than 16 levels at byte 16");
    /* Inside a string, brackets and escaped quotes are text. */
    const char *s = "{\"prompt\":\"\\\"[[[[[[[[[[[[[[[[[[[[\"}";
    CHECK(parse(s, &r, &err) == AR_OK);
    api_image_request_free(&r);
    free(deep);
}

static void test_embedded_nul_bytes_rejected(void) {
    static const char with_nul[] = "{\"prompt\":\"x\"}\0{\"n\":2}";
    static const char nul_between[] = "{\0\"prompt\":\"x\"}";
    static const char nul_in_string[] = "{\"prompt\":\"a\0b\"}";
    const char *bodies[] = {with_nul, nul_between, nul_in_string};
    size_t lens[] = {sizeof with_nul - 1, sizeof nul_between - 1, sizeof nul_in_string - 1};
    for (int i = 0; i < 3; i++) {
        api_image_request_t r;
        api_error_t err;
        CHECK(parse_exact(bodies[i], lens[i], &test_limits, &r, &err) == AR_ERR);
        CHECK(strcmp(err.code, "invalid_json") == 0);
        CHECK_STR_CONTAINS(err.message, "control character 0x00");
    }
    /* A body that stops short of its NUL-terminated text is judged by len. */
    const char *body = "{\"prompt\":\"x\"}garbage";
    api_image_request_t r;
    api_error_t err;
    CHECK(api_parse_image_request(body, 14, &test_limits, &r, &err) == AR_OK);
    api_image_request_free(&r);
    CHECK(api_parse_image_request(NULL, 0, &test_limits, &r, &err) == AR_ERR);
    CHECK(strcmp(err.code, "invalid_json") == 0);
}

static void test_long_unknown_key_truncated_on_char_boundary(void) {
    /* 40 two-byte characters: param holds 47 bytes, so it must stop at 46. */
    char body[256];
    int k = snprintf(body, sizeof body, "{\"prompt\":\"x\",\"");
    for (int i = 0; i < 40; i++)
        k += snprintf(body + k, sizeof body - k, "\xc3\xa9");
    snprintf(body + k, sizeof body - k, "\":1}");
    api_image_request_t r;
    api_error_t err;
    CHECK(parse(body, &r, &err) == AR_ERR);
    CHECK(strcmp(err.code, "unknown_parameter") == 0);
    CHECK(strlen(err.param) == 46);
    CHECK(test_utf8_valid(err.param));
    CHECK(test_utf8_valid(err.message));
    CHECK_STR_CONTAINS(err.message, "...'");
    check_error_shape(&err);
}

/* A number longer than cJSON reads is judged by its field like any number:
 * every numeric field through the same check, byte offsets of later faults
 * unchanged, numbers inside strings left alone. */
static void test_long_numbers_name_their_field(void) {
    static const struct {
        const char *field, *code, *message_has;
        const char *head, *digit; /* the number: head, then 400 of digit */
    } cases[] = {
        {"seed", "invalid_value", "too large for a double", "", "9"},
        {"seed", "invalid_value", "too small for a double", "-", "9"},
        {"n", "invalid_value", "an integer from 1 to 4; got a number too large", "", "9"},
        {"top_k", "invalid_value", "too large for a double", "", "1"},
        {"partial_images", "invalid_value", "too large for a double", "", "7"},
        {"temperature", "invalid_value", "too large for a double", "", "5"},
        {"kv_budget", "invalid_value", "too large for a double", "", "3"},
        {"anchor_lines", "invalid_value", "too large for a double", "", "3"},
        {"prompt", "invalid_type", "got a number", "", "9"},
        {"seed", "invalid_value", "got 1e+99", "1", "0"}, /* in a double's range, not seed's */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char body[600];
        int k = snprintf(body, sizeof body, "{\"prompt\":\"x\",\"%s\":%s", cases[i].field,
                         cases[i].head);
        if (!strcmp(cases[i].field, "prompt"))
            k = snprintf(body, sizeof body, "{\"prompt\":%s", cases[i].head);
        if (!strcmp(cases[i].field, "anchor_lines"))
            k = snprintf(body, sizeof body, "{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"%s\":%s",
                         cases[i].field, cases[i].head);
        int digits = !strcmp(cases[i].head, "1") ? 99 : 400;
        for (int d = 0; d < digits; d++)
            body[k++] = cases[i].digit[0];
        snprintf(body + k, sizeof body - k, "}");
        api_image_request_t r;
        api_error_t err;
        int rc = parse(body, &r, &err);
        CHECK_MSG(rc == AR_ERR, "case %zu accepted", i);
        if (rc != AR_ERR) {
            api_image_request_free(&r);
            continue;
        }
        CHECK_MSG(err.status == 400 && !strcmp(err.param, cases[i].field) &&
                      !strcmp(err.code, cases[i].code),
                  "case %zu: %d param '%s' code '%s': %s", i, err.status, err.param, err.code,
                  err.message);
        CHECK_STR_CONTAINS(err.message, cases[i].message_has);
        check_error_shape(&err);
    }
    /* Equal to a value in range: accepted as that value. */
    char body[600];
    int k = snprintf(body, sizeof body, "{\"prompt\":\"x\",\"n\":2.");
    for (int d = 0; d < 100; d++)
        body[k++] = '0';
    snprintf(body + k, sizeof body - k, ",\"seed\":7}");
    api_image_request_t r;
    api_error_t err;
    CHECK_MSG(parse(body, &r, &err) == AR_OK, "%s", err.message);
    CHECK(r.n == 2 && r.has_seed && r.seed == 7);
    api_image_request_free(&r);
    /* A long run of digits in a string is text; a fault after a long number
     * is reported at its own byte. */
    char digits[101];
    memset(digits, '9', 100);
    digits[100] = 0;
    snprintf(body, sizeof body, "{\"prompt\":\"x\",\"user\":\"%s\"}", digits);
    CHECK_MSG(parse(body, &r, &err) == AR_OK, "%s", err.message);
    CHECK(strcmp(r.user, digits) == 0);
    api_image_request_free(&r);
    k = snprintf(body, sizeof body, "{\"prompt\":\"x\",\"seed\":");
    for (int d = 0; d < 100; d++)
        body[k++] = '9';
    k += snprintf(body + k, sizeof body - k, ",}");
    CHECK(parse(body, &r, &err) == AR_ERR && !strcmp(err.code, "invalid_json"));
    char at[32];
    snprintf(at, sizeof at, "at byte %d", k - 2);
    CHECK_STR_CONTAINS(err.message, at);
    /* Malformed long numbers stay malformed. */
    k = snprintf(body, sizeof body, "{\"prompt\":\"x\",\"seed\":0");
    for (int d = 0; d < 100; d++)
        body[k++] = '9';
    snprintf(body + k, sizeof body - k, "}");
    CHECK(parse(body, &r, &err) == AR_ERR && !strcmp(err.code, "invalid_json"));
    CHECK_STR_CONTAINS(err.message, "leading zero");
}

static void test_invalid_limits_are_a_server_error(void) {
    api_limits_t lim = test_limits;
    lim.n_sizes = 0;
    api_image_request_t r;
    api_error_t err;
    const char *body = "{\"prompt\":\"x\"}";
    CHECK(parse_exact(body, strlen(body), &lim, &r, &err) == AR_ERR);
    CHECK(err.status == 500 && strcmp(err.type, "server_error") == 0);
    CHECK(parse_exact(body, strlen(body), NULL, &r, &err) == AR_ERR && err.status == 500);
    /* model_name NULL accepts any model */
    lim = test_limits;
    lim.model_name = NULL;
    body = "{\"prompt\":\"x\",\"model\":\"anything\"}";
    CHECK(parse_exact(body, strlen(body), &lim, &r, &err) == AR_OK);
    api_image_request_free(&r);
}

/* Random byte flips, cuts, repeats and truncations of a full body: every
 * outcome is a valid request or a complete error, read within len (the
 * buffer is exactly sized for ASan), and nothing leaks. */
static void test_mutated_bodies_never_misbehave(void) {
    static const char base[] =
        "{\"prompt\":\"caf\\u00e9 \\ud83d\\ude00\",\"model\":\"janus-pro-tiny\",\"n\":2,"
        "\"size\":\"256x256\",\"seed\":7,\"top_p\":0.5,\"kv_policy\":\"linear\",\"stream\":true,"
        "\"user\":\"u\"}";
    static const char alphabet[] = "{}[]\":,\\u0x-.e 9\xc3\xa9\xed\xff\x01";
    char buf[512];
    int ok = 0, failed = 0;
    for (int iter = 0; iter < 20000; iter++) {
        size_t len = sizeof base - 1;
        memcpy(buf, base, len);
        int edits = 1 + (int)(test_rand_u64() % 4);
        for (int e = 0; e < edits && len > 0; e++) {
            size_t at = test_rand_u64() % len;
            switch (test_rand_u64() % 4) {
            case 0:
                buf[at] = alphabet[test_rand_u64() % (sizeof alphabet - 1)];
                break;
            case 1: { /* cut a run */
                size_t cut = 1 + test_rand_u64() % 8;
                if (cut > len - at)
                    cut = len - at;
                memmove(buf + at, buf + at + cut, len - at - cut);
                len -= cut;
                break;
            }
            case 2: { /* repeat a run */
                size_t run = 1 + test_rand_u64() % 12;
                if (run > len - at)
                    run = len - at;
                if (len + run <= sizeof buf) {
                    memmove(buf + at + run, buf + at, len - at);
                    len += run;
                }
                break;
            }
            default:
                len = at;
            }
        }
        api_image_request_t r;
        api_error_t err;
        if (parse_exact(buf, len, &test_limits, &r, &err) == AR_OK) {
            ok++;
            CHECK(r.prompt && r.prompt[0] && strlen(r.prompt) <= test_limits.max_prompt_bytes);
            CHECK(test_utf8_valid(r.prompt));
            CHECK(r.n >= 1 && r.n <= test_limits.max_n);
            CHECK(r.partial_images >= 0 && r.partial_images <= 3);
            api_image_request_free(&r);
        } else {
            failed++;
            CHECK(r.prompt == NULL);
            CHECK(err.status == 400 || err.status == 404);
            CHECK(err.message[0] && err.code[0] && test_utf8_valid(err.message));
        }
    }
    CHECK(ok > 0 && failed > 0); /* the mutations reach both outcomes */
}

static void test_sampler_params_overlay(void) {
    sampler_params_t defaults = {.cfg = 5.0f, .temperature = 1.0f, .top_k = 0, .top_p = 1.0f};
    sampler_params_t p;
    api_image_request_t r;
    api_error_t err;
    CHECK(parse("{\"prompt\":\"x\",\"top_k\":50}", &r, &err) == AR_OK);
    api_image_request_sampler_params(&r, &defaults, &p);
    CHECK(p.cfg == 5.0f && p.temperature == 1.0f && p.top_k == 50 && p.top_p == 1.0f);
    api_image_request_free(&r);
    CHECK(parse("{\"prompt\":\"x\",\"guidance_scale\":3,\"temperature\":0.5,\"top_p\":0.9}", &r,
                &err) == AR_OK);
    api_image_request_sampler_params(&r, &defaults, &p);
    CHECK(p.cfg == 3.0f && p.temperature == 0.5f && p.top_k == 0 && p.top_p == 0.9f);
    api_image_request_free(&r);
}

/* ---- builders ---- */

static cJSON *parse_owned(char *json) {
    CHECK(json != NULL);
    cJSON *root = json ? cJSON_Parse(json) : NULL;
    CHECK(root != NULL);
    free(json);
    return root;
}

static const cJSON *get(const cJSON *o, const char *key) {
    return cJSON_GetObjectItemCaseSensitive(o, key);
}

static int is_num(const cJSON *o, const char *key, double v) {
    const cJSON *x = get(o, key);
    return cJSON_IsNumber(x) && x->valuedouble == v;
}

static int is_str(const cJSON *o, const char *key, const char *v) {
    const cJSON *x = get(o, key);
    return cJSON_IsString(x) && strcmp(x->valuestring, v) == 0;
}

static void check_usage(const cJSON *u, int image_tokens, int prompt_tokens) {
    CHECK(cJSON_IsObject(u));
    CHECK(is_num(u, "input_tokens", prompt_tokens));
    CHECK(is_num(u, "output_tokens", image_tokens));
    CHECK(is_num(u, "total_tokens", prompt_tokens + image_tokens));
    const cJSON *d = get(u, "input_tokens_details");
    CHECK(is_num(d, "text_tokens", prompt_tokens) && is_num(d, "image_tokens", 0));
}

static void test_error_json_shape(void) {
    api_error_t e = {.status = 400,
                     .message = "n must be \"an integer\"\n",
                     .type = "x_error",
                     .param = "n",
                     .code = "invalid_value"};
    cJSON *root = parse_owned(api_error_json(&e));
    const cJSON *o = get(root, "error");
    CHECK(cJSON_GetArraySize(root) == 1 && cJSON_GetArraySize(o) == 4);
    CHECK(is_str(o, "message", "n must be \"an integer\"\n"));
    CHECK(is_str(o, "type", "x_error") && is_str(o, "param", "n"));
    CHECK(is_str(o, "code", "invalid_value"));
    cJSON_Delete(root);
    e.param[0] = e.code[0] = 0;
    root = parse_owned(api_error_json(&e));
    CHECK(cJSON_IsNull(get(get(root, "error"), "param")));
    CHECK(cJSON_IsNull(get(get(root, "error"), "code")));
    cJSON_Delete(root);
    CHECK(api_error_json(NULL) == NULL);
}

static void test_images_response_shape(void) {
    const char *const pngs[] = {"iVBORw0KGgo=", "AAAA"};
    char *text =
        api_images_response_json(1700000000L, 2, pngs, 384, 256, 1152, 17, NULL, NULL, NULL);
    CHECK(text && !strchr(text, '\n'));
    cJSON *root = parse_owned(text);
    CHECK(get(root, "kv_cache") == NULL);
    CHECK(is_num(root, "created", 1700000000.0));
    const cJSON *data = get(root, "data");
    CHECK(cJSON_IsArray(data) && cJSON_GetArraySize(data) == 2);
    CHECK(is_str(cJSON_GetArrayItem(data, 0), "b64_json", "iVBORw0KGgo="));
    CHECK(is_str(cJSON_GetArrayItem(data, 1), "b64_json", "AAAA"));
    CHECK(is_str(root, "output_format", "png") && is_str(root, "size", "384x256"));
    check_usage(get(root, "usage"), 1152, 17);
    cJSON_Delete(root);
    root = parse_owned(api_images_response_json(1, 0, NULL, 384, 384, 0, 0, NULL, NULL, NULL));
    CHECK(cJSON_GetArraySize(get(root, "data")) == 0);
    cJSON_Delete(root);
    CHECK(api_images_response_json(1, 1, NULL, 384, 384, 0, 0, NULL, NULL, NULL) == NULL);

    /* The KV extension: the policy the request ran with, its budget and its own knobs only. */
    api_kv_report_t kv = {.planned_peak_bytes = 1 << 20, .peak_bytes = 1 << 19};
    kv_policy_defaults(&kv.policy, KV_POLICY_LINEAR);
    kv.policy.budget = 0.25;
    kv.policy.anchor_lines = 0;
    root = parse_owned(api_images_response_json(1, 1, pngs, 384, 384, 576, 5, &kv, NULL, NULL));
    const cJSON *k = get(root, "kv_cache");
    CHECK(is_str(k, "policy", "linear") && is_num(k, "budget", 0.25));
    CHECK(is_num(k, "anchor_lines", 0) && is_num(k, "recent_lines", 2));
    CHECK(get(k, "sink_tokens") == NULL && get(k, "headkv_alpha") == NULL);
    CHECK(is_num(k, "planned_peak_bytes", 1 << 20) && is_num(k, "peak_bytes", 1 << 19));
    CHECK(cJSON_GetArraySize(k) == 6);
    cJSON_Delete(root);
    kv_policy_defaults(&kv.policy, KV_POLICY_FULL);
    root = parse_owned(api_images_response_json(1, 1, pngs, 384, 384, 576, 5, &kv, NULL, NULL));
    k = get(root, "kv_cache");
    CHECK(is_str(k, "policy", "full") && get(k, "budget") == NULL && cJSON_GetArraySize(k) == 3);
    CHECK(get(root, "timings") == NULL);
    cJSON_Delete(root);

    /* The timings extension: each figure under its own name. */
    const api_timings_t t = {.queue_s = 0.5, .run_s = 2.25, .steps = 24, .decode_png_s = 0.125};
    root = parse_owned(api_images_response_json(1, 1, pngs, 384, 384, 576, 5, NULL, &t, NULL));
    const cJSON *tm = get(root, "timings");
    CHECK(is_num(tm, "queue_s", 0.5) && is_num(tm, "run_s", 2.25));
    CHECK(is_num(tm, "steps", 24) && is_num(tm, "decode_png_s", 0.125));
    CHECK(cJSON_GetArraySize(tm) == 4 && get(root, "kv_cache") == NULL);
    CHECK(get(root, "warnings") == NULL);
    cJSON_Delete(root);

    /* Warnings, one a line, as an array; none ("") leaves it out. */
    root = parse_owned(api_images_response_json(1, 1, pngs, 384, 384, 576, 5, NULL, NULL,
                                                "prompt: one\nnegative_prompt: two"));
    const cJSON *w = get(root, "warnings");
    CHECK(cJSON_IsArray(w) && cJSON_GetArraySize(w) == 2);
    CHECK(w && !strcmp(cJSON_GetArrayItem(w, 0)->valuestring, "prompt: one"));
    CHECK(w && !strcmp(cJSON_GetArrayItem(w, 1)->valuestring, "negative_prompt: two"));
    cJSON_Delete(root);
    root = parse_owned(api_images_response_json(1, 1, pngs, 384, 384, 576, 5, NULL, NULL, ""));
    CHECK(get(root, "warnings") == NULL);
    cJSON_Delete(root);
}

static void test_async_parsed(void) {
    api_image_request_t r;
    api_error_t err = {0};
    CHECK(parse("{\"prompt\":\"x\",\"async\":true}", &r, &err) == AR_OK && r.async == 1);
    api_image_request_free(&r);
    CHECK(parse("{\"prompt\":\"x\",\"async\":true,\"stream\":false}", &r, &err) == AR_OK);
    CHECK(r.async == 1 && r.stream == 0);
    api_image_request_free(&r);
    CHECK(parse("{\"prompt\":\"x\"}", &r, &err) == AR_OK && r.async == 0);
    api_image_request_free(&r);
}

static void test_job_json_shape(void) {
    api_job_report_t j = {.id = "job_0123456789abcdef0123456789abcdef",
                          .status = "queued",
                          .poll_url = "/v1/images/jobs/job_0123456789abcdef0123456789abcdef",
                          .created = 1700000000L,
                          .queue_position = 3,
                          .steps_total = 64};
    cJSON *root = parse_owned(api_job_json(&j));
    CHECK(is_str(root, "id", j.id) && is_str(root, "object", "image.generation.job"));
    CHECK(is_str(root, "status", "queued") && is_num(root, "created", 1700000000.0));
    CHECK(cJSON_IsNull(get(root, "started")) && cJSON_IsNull(get(root, "completed")));
    CHECK(is_num(root, "queue_position", 3) && is_str(root, "poll_url", j.poll_url));
    CHECK(is_num(get(root, "progress"), "steps_done", 0));
    CHECK(is_num(get(root, "progress"), "steps_total", 64));
    CHECK(cJSON_IsNull(get(root, "result")) && cJSON_IsNull(get(root, "error")));
    CHECK(cJSON_GetArraySize(root) == 11);
    cJSON_Delete(root);

    /* Done: the result is the synchronous response's object. */
    const char *const pngs[] = {"AAAA"};
    const api_timings_t t = {.queue_s = 0.5, .run_s = 1, .steps = 64, .decode_png_s = 0.25};
    j = (api_job_report_t){.id = j.id,
                           .status = "done",
                           .poll_url = j.poll_url,
                           .created = 1700000000L,
                           .started = 1700000001L,
                           .completed = 1700000002L,
                           .steps_done = 64,
                           .steps_total = 64,
                           .n = 1,
                           .b64_pngs = pngs,
                           .width = 32,
                           .height = 32,
                           .image_tokens = 64,
                           .prompt_tokens = 5,
                           .timings = &t};
    root = parse_owned(api_job_json(&j));
    CHECK(is_num(root, "started", 1700000001.0) && is_num(root, "completed", 1700000002.0));
    const cJSON *res = get(root, "result");
    CHECK(is_num(res, "created", 1700000002.0) && is_str(res, "size", "32x32"));
    CHECK(is_str(cJSON_GetArrayItem(get(res, "data"), 0), "b64_json", "AAAA"));
    check_usage(get(res, "usage"), 64, 5);
    CHECK(is_num(get(res, "timings"), "steps", 64));
    CHECK(cJSON_IsNull(get(root, "error")));
    cJSON_Delete(root);

    /* Cancelled: the API's error object, no result. */
    api_error_t e;
    api_errorf(&e, 499, NULL, "cancelled", "the request was cancelled");
    j = (api_job_report_t){.id = j.id,
                           .status = "cancelled",
                           .poll_url = j.poll_url,
                           .created = 1,
                           .completed = 2,
                           .error = &e};
    root = parse_owned(api_job_json(&j));
    CHECK(cJSON_IsNull(get(root, "result")));
    CHECK(is_str(get(root, "error"), "code", "cancelled"));
    CHECK(is_str(get(root, "error"), "message", "the request was cancelled"));
    cJSON_Delete(root);
    j.id = NULL;
    CHECK(api_job_json(&j) == NULL);

    root = parse_owned(api_job_deleted_json("job_x", "done", 1));
    CHECK(is_str(root, "id", "job_x") && is_str(root, "status", "done"));
    CHECK(cJSON_IsTrue(get(root, "deleted")));
    cJSON_Delete(root);
}

/* Item i of array a is the string s. */
static int is_str_item(const cJSON *a, int i, const char *s) {
    const cJSON *v = cJSON_GetArrayItem(a, i);
    return cJSON_IsString(v) && strcmp(v->valuestring, s) == 0;
}

/* A raster model's card: 16 lines of 16 tokens, token steps. */
static api_model_card_t raster_card(kv_geometry_t *g) {
    kv_geometry_uniform(g, 1, KV_STEP_TOKEN, 16, 16, 2, 2);
    return (api_model_card_t){.created = 1700000001L,
                              .family = "raster",
                              .segment_name = "line",
                              .geom = g,
                              .sampling = {.cfg = 4.5f, .temperature = 1, .top_k = 20, .top_p = 1}};
}

static void test_models_shape(void) {
    kv_geometry_t g;
    const api_model_card_t card = raster_card(&g);
    const int w = 64, h = 48;
    api_limits_t lim = {.model_name = "janus \"pro\"",
                        .max_n = 4,
                        .n_sizes = 1,
                        .widths = &w,
                        .heights = &h,
                        .max_prompt_bytes = 4096};
    cJSON *root = parse_owned(api_models_json(&lim, &card));
    CHECK(is_str(root, "object", "list"));
    const cJSON *data = get(root, "data");
    CHECK(cJSON_GetArraySize(data) == 1);
    const cJSON *m = cJSON_GetArrayItem(data, 0);
    CHECK(is_str(m, "id", "janus \"pro\"") && is_str(m, "object", "model"));
    CHECK(is_num(m, "created", 1700000001.0) && is_str(m, "owned_by", "arserve"));
    CHECK(get(m, "num_classes") == NULL && get(m, "classes") == NULL);
    const cJSON *a = get(m, "arserve");
    CHECK(is_str(a, "family", "raster") && is_str(a, "conditioning", "text"));
    CHECK(is_num(a, "width", 64) && is_num(a, "height", 48) && is_num(a, "steps", 256));
    const cJSON *sizes = get(a, "sizes");
    CHECK(cJSON_GetArraySize(sizes) == 1 && is_str_item(sizes, 0, "64x48"));
    CHECK(cJSON_IsFalse(get(a, "negative_prompt")));
    CHECK(is_str(a, "step_unit", "token") && is_str(a, "segment_name", "line"));
    const cJSON *seg = get(a, "segment_tokens");
    CHECK(cJSON_GetArraySize(seg) == 16 && cJSON_GetArrayItem(seg, 15)->valuedouble == 16);
    const cJSON *sp = get(a, "sampling");
    CHECK(is_num(sp, "guidance_scale", 4.5) && is_num(sp, "temperature", 1));
    CHECK(is_num(sp, "top_k", 20) && is_num(sp, "top_p", 1));
    const cJSON *l = get(a, "limits");
    CHECK(is_num(l, "max_n", 4) && is_num(l, "max_prompt_bytes", 4096));
    CHECK(is_num(l, "max_partial_images", API_MAX_PARTIAL_IMAGES));
    /* Without server defaults: full by default, and only the policies that
     * run on a raster geometry, each budgeted one with its own budget and
     * the least it takes. */
    CHECK(is_str(a, "kv_policy", "full"));
    const cJSON *pols = get(a, "kv_policies");
    int n_raster = 0;
    for (int k = 0; k < KV_POLICY_COUNT; k++)
        n_raster += kv_policy_suits((kv_policy_kind_t)k, &g);
    CHECK(n_raster >= 2 && cJSON_GetArraySize(pols) == n_raster);
    const cJSON *p0 = cJSON_GetArrayItem(pols, 0);
    CHECK(is_str(p0, "name", "full") && get(p0, "budget") == NULL);
    int saw_linear = 0;
    for (const cJSON *p = pols->child; p; p = p->next) {
        CHECK(!is_str(p, "name", "amskv") && !is_str(p, "name", "heatkv"));
        if (is_str(p, "name", "linear"))
            saw_linear = is_num(p, "budget", kv_policy_default_budget(KV_POLICY_LINEAR)) &&
                         is_num(p, "min_budget", 0.25);
    }
    CHECK(saw_linear);
    cJSON_Delete(root);

    /* The server's defaults: its policy, and its budget for every policy. */
    kv_policy_params_t defaults;
    kv_policy_defaults(&defaults, KV_POLICY_STREAMING);
    defaults.budget = 0.5;
    lim.kv_defaults = &defaults;
    static const char *const names[] = {"circle", "square"};
    lim.num_classes = 2;
    lim.class_names = names;
    root = parse_owned(api_models_json(&lim, &card));
    m = cJSON_GetArrayItem(get(root, "data"), 0);
    a = get(m, "arserve");
    CHECK(is_num(m, "num_classes", 2) && is_str(a, "conditioning", "class"));
    const cJSON *second = cJSON_GetArrayItem(get(m, "classes"), 1);
    CHECK(cJSON_IsString(second) && !strcmp(second->valuestring, "square"));
    CHECK(is_str(a, "kv_policy", "streaming"));
    for (const cJSON *p = get(a, "kv_policies")->child; p; p = p->next)
        CHECK(is_str(p, "name", "full") || is_num(p, "budget", 0.5));
    cJSON_Delete(root);

    /* A next-scale geometry steps by segment. */
    const int scales[] = {1, 4, 9};
    kv_geometry_t gs = g;
    gs.step_unit = KV_STEP_SEGMENT;
    gs.n_segments = 3;
    memcpy(gs.segment_tokens, scales, sizeof scales);
    api_model_card_t scale_card = card;
    scale_card.geom = &gs;
    scale_card.family = "scale";
    scale_card.segment_name = "scale";
    root = parse_owned(api_models_json(&lim, &scale_card));
    a = get(cJSON_GetArrayItem(get(root, "data"), 0), "arserve");
    CHECK(is_num(a, "steps", 3) && is_str(a, "step_unit", "segment"));
    CHECK(is_str(a, "segment_name", "scale"));
    for (const cJSON *p = get(a, "kv_policies")->child; p; p = p->next)
        CHECK(!is_str(p, "name", "linear"));
    cJSON_Delete(root);

    lim.model_name = NULL;
    CHECK(api_models_json(&lim, &card) == NULL);
    CHECK(api_models_json(&lim, NULL) == NULL);
}

/* Each policy of a model card lists exactly its knobs of the knob table,
 * in its order, with type, range, help and the server's default. */
static void test_models_list_every_knob(void) {
    kv_geometry_t g;
    const api_model_card_t card = raster_card(&g);
    const int w = 64, h = 48;
    kv_policy_params_t d;
    kv_policy_defaults(&d, KV_POLICY_FULL);
    d.recent_lines = 1; /* the server's default differs from the paper's */
    const api_limits_t lim = {.model_name = "m",
                              .max_n = 4,
                              .n_sizes = 1,
                              .widths = &w,
                              .heights = &h,
                              .max_prompt_bytes = 4096,
                              .kv_defaults = &d};
    cJSON *root = parse_owned(api_models_json(&lim, &card));
    const cJSON *a = get(cJSON_GetArrayItem(get(root, "data"), 0), "arserve");
    int policies = 0;
    for (const cJSON *p = get(a, "kv_policies")->child; p; p = p->next, policies++) {
        const int kind = kv_policy_parse(cJSON_GetStringValue(get(p, "name")));
        CHECK(kind >= 0);
        const cJSON *k = get(p, "knobs")->child;
        for (int i = 0; kind >= 0 && i < KV_POLICY_N_KNOBS; i++) {
            const kv_policy_knob_t *t = &kv_policy_knobs[i];
            if (!kv_policy_knob_of(t, (kv_policy_kind_t)kind))
                continue;
            CHECK_MSG(k && is_str(k, "name", t->name), "%s: %s missing", kv_policy_name(kind),
                      t->name);
            if (!k)
                break;
            CHECK(is_str(k, "type", t->type == KV_KNOB_INT ? "integer" : "number"));
            CHECK(is_num(k, "min", t->lo) && is_num(k, "max", t->hi));
            CHECK(cJSON_IsBool(get(k, "min_exclusive")) &&
                  cJSON_IsTrue(get(k, "min_exclusive")) == t->lo_open);
            CHECK(is_num(k, "default", kv_policy_knob_get(&d, t)) &&
                  is_str(k, "description", t->help));
            k = k->next;
        }
        CHECK_MSG(k == NULL, "%s lists a knob of another policy", kv_policy_name(kind));
    }
    CHECK(policies >= 2);
    const cJSON *linear = NULL;
    for (const cJSON *p = get(a, "kv_policies")->child; p; p = p->next)
        if (is_str(p, "name", "linear"))
            linear = p;
    int saw_recent = 0;
    for (const cJSON *k = linear ? get(linear, "knobs")->child : NULL; k; k = k->next)
        saw_recent += is_str(k, "name", "recent_lines") && is_num(k, "default", 1);
    CHECK(saw_recent == 1);
    cJSON_Delete(root);
}

static void test_sse_payloads(void) {
    cJSON *p = parse_owned(api_sse_progress(10, 576, 1));
    CHECK(is_str(p, "type", API_SSE_PROGRESS) && is_num(p, "steps_done", 10));
    CHECK(is_num(p, "steps_total", 576) && is_num(p, "image_index", 1));
    cJSON_Delete(p);

    p = parse_owned(api_sse_partial_image("QUJD", 2, 0, 1700000002L, 384, 384));
    CHECK(is_str(p, "type", "image_generation.partial_image") && is_str(p, "b64_json", "QUJD"));
    CHECK(is_num(p, "partial_image_index", 2) && is_num(p, "image_index", 0));
    CHECK(is_num(p, "created_at", 1700000002.0) && is_str(p, "size", "384x384"));
    CHECK(is_str(p, "output_format", "png") && is_str(p, "quality", "auto"));
    CHECK(is_str(p, "background", "opaque"));
    cJSON_Delete(p);

    p = parse_owned(api_sse_completed("QUJD", 3, 1700000003L, 256, 256, 576, 12, NULL, NULL, NULL));
    CHECK(is_str(p, "type", "image_generation.completed") && is_str(p, "b64_json", "QUJD"));
    CHECK(is_num(p, "image_index", 3) && is_num(p, "created_at", 1700000003.0));
    CHECK(is_str(p, "size", "256x256") && is_str(p, "output_format", "png"));
    check_usage(get(p, "usage"), 576, 12);
    CHECK(get(p, "kv_cache") == NULL && get(p, "timings") == NULL);
    cJSON_Delete(p);

    /* With the job's KV report and timings, as a non-streamed answer has. */
    api_kv_report_t kv = {.planned_peak_bytes = 4096, .peak_bytes = 2048};
    kv_policy_defaults(&kv.policy, KV_POLICY_LINEAR);
    const api_timings_t t = {.queue_s = 0.25, .run_s = 1.5, .steps = 16, .decode_png_s = 0.125};
    p = parse_owned(api_sse_completed("QUJD", 0, 1, 256, 256, 576, 12, &kv, &t, NULL));
    const cJSON *k = get(p, "kv_cache");
    CHECK(is_str(k, "policy", "linear") && is_num(k, "planned_peak_bytes", 4096));
    CHECK(is_num(k, "peak_bytes", 2048) && is_num(get(p, "timings"), "steps", 16));
    CHECK(is_num(get(p, "timings"), "run_s", 1.5));
    cJSON_Delete(p);

    CHECK(api_sse_progress(-1, 5, 0) == NULL);
    CHECK(api_sse_partial_image(NULL, 0, 0, 0, 1, 1) == NULL);
    CHECK(api_sse_completed(NULL, 0, 0, 1, 1, 0, 0, NULL, NULL, NULL) == NULL);
}

static void test_sse_frame(void) {
    char *f = api_sse_frame(API_SSE_COMPLETED, "{\"a\":1}");
    CHECK(f && strcmp(f, "event: image_generation.completed\ndata: {\"a\":1}\n\n") == 0);
    free(f);
    f = api_sse_frame("error", "{\n\"a\": 1\n}");
    CHECK(f && strcmp(f, "event: error\ndata: {\ndata: \"a\": 1\ndata: }\n\n") == 0);
    free(f);
    f = api_sse_frame("x", "");
    CHECK(f && strcmp(f, "event: x\ndata: \n\n") == 0);
    free(f);
    CHECK(api_sse_frame("bad\nname", "{}") == NULL);
    CHECK(api_sse_frame("", "{}") == NULL);
    CHECK(api_sse_frame("x", NULL) == NULL);
    /* a builder's payload in a frame is one data line */
    char *json = api_sse_progress(1, 2, 0);
    f = api_sse_frame(API_SSE_PROGRESS, json);
    CHECK(f && strncmp(f, "event: arserve.progress\ndata: {", 31) == 0);
    CHECK(f && strchr(f + 31, '\n') == f + strlen(f) - 2);
    free(json);
    free(f);
}

/* ---- base64 ---- */

static void test_base64_rfc4648_vectors(void) {
    static const char *const in[] = {"", "f", "fo", "foo", "foob", "fooba", "foobar"};
    static const char *const want[] = {"",         "Zg==",     "Zm8=",    "Zm9v",
                                       "Zm9vYg==", "Zm9vYmE=", "Zm9vYmFy"};
    for (int i = 0; i < 7; i++) {
        char *b = api_base64((const uint8_t *)in[i], strlen(in[i]));
        CHECK_MSG(b && strcmp(b, want[i]) == 0, "base64(\"%s\") = %s", in[i], b ? b : "NULL");
        free(b);
    }
    static const uint8_t high[] = {0xfb, 0xff, 0xbf, 0x00};
    char *b = api_base64(high, 4);
    CHECK(b && strcmp(b, "+/+/AA==") == 0); /* both non-alphanumeric symbols */
    free(b);
    CHECK(api_base64(NULL, 1) == NULL);
    b = api_base64(NULL, 0);
    CHECK(b && b[0] == 0);
    free(b);
}

static int b64_value(char c) {
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
}

static void test_base64_round_trips(void) {
    uint8_t data[300], back[300];
    for (size_t n = 0; n <= sizeof data; n++) {
        for (size_t i = 0; i < n; i++)
            data[i] = (uint8_t)test_rand_u64();
        char *b = api_base64(data, n);
        CHECK(b && strlen(b) == (n + 2) / 3 * 4);
        if (!b)
            continue;
        size_t got = 0, len = strlen(b);
        int bad = 0;
        for (size_t q = 0; q < len; q += 4) {
            int v[4];
            for (int k = 0; k < 4; k++)
                v[k] = b[q + k] == '=' ? 0 : b64_value(b[q + k]);
            bad |= v[0] < 0 || v[1] < 0 || v[2] < 0 || v[3] < 0;
            uint32_t w =
                (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
            uint8_t bytes[3] = {(uint8_t)(w >> 16), (uint8_t)(w >> 8), (uint8_t)w};
            int keep = b[q + 2] == '=' ? 1 : b[q + 3] == '=' ? 2 : 3;
            for (int k = 0; k < keep && got < sizeof back; k++)
                back[got++] = bytes[k];
        }
        CHECK(!bad && got == n && memcmp(back, data, n) == 0);
        free(b);
    }
}

/* A budget range: kv_budget_min below kv_budget, or below the policy's
 * own budget when kv_budget is not given; kv_policy auto is the model's
 * compressed policy from its least budget (the scheduler's to find) to 1. */
static void test_budget_range(void) {
    api_image_request_t r;
    api_error_t err;
    const char *body =
        "{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"kv_budget\":0.75,\"kv_budget_min\":0.25}";
    CHECK_MSG(parse_exact(body, strlen(body), &test_limits, &r, &err) == AR_OK, "%s", err.message);
    CHECK(r.kv_policy.kind == KV_POLICY_LINEAR && r.kv_policy.budget == 0.75 &&
          r.kv_budget_min == 0.25 && !r.kv_auto);
    api_image_request_free(&r);
    body = "{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"kv_budget_min\":0.125}";
    CHECK_MSG(parse_exact(body, strlen(body), &test_limits, &r, &err) == AR_OK, "%s", err.message);
    CHECK(r.kv_budget_min == 0.125 &&
          r.kv_policy.budget == kv_policy_default_budget(KV_POLICY_LINEAR));
    api_image_request_free(&r);
    body = "{\"prompt\":\"x\",\"kv_policy\":\"linear\"}";
    CHECK(parse_exact(body, strlen(body), &test_limits, &r, &err) == AR_OK && r.kv_budget_min == 0);
    api_image_request_free(&r);
    api_limits_t lim = test_limits;
    lim.kv_auto = KV_POLICY_LINEAR;
    body = "{\"prompt\":\"x\",\"kv_policy\":\"auto\"}";
    CHECK_MSG(parse_exact(body, strlen(body), &lim, &r, &err) == AR_OK, "%s", err.message);
    CHECK(r.kv_auto && r.kv_policy.kind == KV_POLICY_LINEAR && r.kv_policy.budget == 1 &&
          r.kv_budget_min == API_BUDGET_LEAST);
    api_image_request_free(&r);
    body = "{\"prompt\":\"x\",\"kv_policy\":\"auto\",\"kv_budget\":0.5,\"kv_budget_min\":0.3}";
    CHECK_MSG(parse_exact(body, strlen(body), &lim, &r, &err) == AR_OK, "%s", err.message);
    CHECK(r.kv_policy.budget == 0.5 && r.kv_budget_min == 0.3);
    api_image_request_free(&r);
    /* auto's knobs are linear's. */
    body = "{\"prompt\":\"x\",\"kv_policy\":\"auto\",\"sink_tokens\":2}";
    CHECK(parse_exact(body, strlen(body), &lim, &r, &err) == AR_ERR &&
          strcmp(err.param, "sink_tokens") == 0);
}

/* The daemon's range for a policy (config kv_budget_ranges) fills what a
 * request running it leaves out; its own kv_budget fixes the budget; other
 * policies and auto are untouched. */
static void test_daemon_budget_ranges(void) {
    kv_budget_range_t ranges[KV_POLICY_COUNT] = {{0}};
    ranges[KV_POLICY_LINEAR] = (kv_budget_range_t){0.25, 0.75};
    api_limits_t lim = test_limits;
    lim.kv_ranges = ranges;
    lim.kv_auto = KV_POLICY_LINEAR;
    static const struct {
        const char *body;
        double budget, min; /* min -1: API_BUDGET_LEAST */
    } cases[] = {
        {"{\"prompt\":\"x\",\"kv_policy\":\"linear\"}", 0.75, 0.25},
        {"{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"kv_budget\":0.5}", 0.5, 0},
        {"{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"kv_budget_min\":0.5}", 0.75, 0.5},
        {"{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"kv_budget\":0.5,\"kv_budget_min\":0.3}", 0.5,
         0.3},
        {"{\"prompt\":\"x\",\"kv_policy\":\"auto\"}", 1, -1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        api_image_request_t r;
        api_error_t err;
        CHECK_MSG(parse_exact(cases[i].body, strlen(cases[i].body), &lim, &r, &err) == AR_OK,
                  "%s: %s", cases[i].body, err.message);
        CHECK_MSG(r.kv_policy.budget == cases[i].budget && r.kv_budget_min == cases[i].min,
                  "%s: budget %g min %g", cases[i].body, r.kv_policy.budget, r.kv_budget_min);
        api_image_request_free(&r);
    }
    api_image_request_t r;
    api_error_t err;
    const char *body = "{\"prompt\":\"x\",\"kv_policy\":\"streaming\"}";
    CHECK(parse_exact(body, strlen(body), &lim, &r, &err) == AR_OK && r.kv_budget_min == 0);
    api_image_request_free(&r);
    body = "{\"prompt\":\"x\",\"kv_policy\":\"linear\",\"kv_budget_min\":0.8}";
    CHECK(parse_exact(body, strlen(body), &lim, &r, &err) == AR_ERR);
    CHECK(!strcmp(err.param, "kv_budget_min"));
    CHECK_STR_CONTAINS(err.message, "above the range's top, kv_budget 0.75 (the top of the "
                                    "daemon's range)");
    /* A range without its top runs up to the policy's own budget. */
    ranges[KV_POLICY_LINEAR] = (kv_budget_range_t){0.0625, 0};
    body = "{\"prompt\":\"x\",\"kv_policy\":\"linear\"}";
    CHECK(parse_exact(body, strlen(body), &lim, &r, &err) == AR_OK && r.kv_budget_min == 0.0625 &&
          r.kv_policy.budget == kv_policy_default_budget(KV_POLICY_LINEAR));
    api_image_request_free(&r);
}

int main(void) {
    TEST_RUN(test_minimal_request_gets_defaults);
    TEST_RUN(test_budget_range);
    TEST_RUN(test_daemon_budget_ranges);
    TEST_RUN(test_full_request_sets_every_field);
    TEST_RUN(test_null_means_not_given);
    TEST_RUN(test_size_auto_is_first_size);
    TEST_RUN(test_edge_values_accepted);
    TEST_RUN(test_bad_requests_table);
    TEST_RUN(test_kv_knobs_given_and_resolved);
    TEST_RUN(test_every_member_once_and_each_twice);
    TEST_RUN(test_negative_prompt_where_the_model_takes_one);
    TEST_RUN(test_size_message_lists_allowed_sizes);
    TEST_RUN(test_nesting_cap_counts_structure_only);
    TEST_RUN(test_embedded_nul_bytes_rejected);
    TEST_RUN(test_long_unknown_key_truncated_on_char_boundary);
    TEST_RUN(test_long_numbers_name_their_field);
    TEST_RUN(test_invalid_limits_are_a_server_error);
    TEST_RUN(test_mutated_bodies_never_misbehave);
    TEST_RUN(test_sampler_params_overlay);
    TEST_RUN(test_error_json_shape);
    TEST_RUN(test_images_response_shape);
    TEST_RUN(test_async_parsed);
    TEST_RUN(test_job_json_shape);
    TEST_RUN(test_models_shape);
    TEST_RUN(test_models_list_every_knob);
    TEST_RUN(test_sse_payloads);
    TEST_RUN(test_sse_frame);
    TEST_RUN(test_base64_rfc4648_vectors);
    TEST_RUN(test_base64_round_trips);
    return TEST_SUMMARY();
}
