/* Unit tests for what the fuzz targets (tests/fuzz) found in server/api.c;
 * test_api.c covers the rest.
 *  - fuzz_sse: SSE readers end a line at CRLF, CR or LF, so each of them in a
 *    payload must start a new "data: " line in api_sse_frame; a raw CR left
 *    inside a data line would end it early and let what follows be read as a
 *    field of its own ("event:", "id:", "retry:").
 *  - fuzz_request: top_p is in (0, 1] but held in a float; a value above 0
 *    that rounds to 0 as a float must be refused, not run as top_p 0. */
#include "server/api.h"
#include "tests/test.h"

#include <stdlib.h>
#include <string.h>

static void check_frame(const char *json, const char *want) {
    char *f = api_sse_frame("error", json);
    CHECK_MSG(f && strcmp(f, want) == 0, "frame of \"%s\" is \"%s\"", json, f ? f : "(null)");
    free(f);
}

static void test_cr_lf_and_crlf_each_start_a_data_line(void) {
    check_frame("a\nb", "event: error\ndata: a\ndata: b\n\n");
    check_frame("a\rb", "event: error\ndata: a\ndata: b\n\n");
    check_frame("a\r\nb", "event: error\ndata: a\ndata: b\n\n");
    check_frame("a\n\rb", "event: error\ndata: a\ndata: \ndata: b\n\n");
    check_frame("\r", "event: error\ndata: \ndata: \n\n");
    check_frame("a\r", "event: error\ndata: a\ndata: \n\n");
}

static void test_a_cr_cannot_forge_a_field(void) {
    char *f = api_sse_frame("error", "x\revent: forged\rdata: y");
    CHECK(f && strcmp(f, "event: error\ndata: x\ndata: event: forged\ndata: data: y\n\n") == 0);
    CHECK(f && !strchr(f, '\r'));
    free(f);
    CHECK(api_sse_frame("a\rb", "{}") == NULL);
}

static void test_top_p_that_rounds_to_zero_is_refused(void) {
    static const int w[] = {384}, h[] = {384};
    const api_limits_t lim = {.max_n = 4,
                              .n_sizes = 1,
                              .widths = w,
                              .heights = h,
                              .max_prompt_bytes = 32,
                              .codebook_size = 16};
    static const char *const tiny[] = {"{\"prompt\":\"x\",\"top_p\":0.91091e-72}",
                                       "{\"prompt\":\"x\",\"top_p\":1e-46}"};
    for (int i = 0; i < 2; i++) {
        api_image_request_t r;
        api_error_t err;
        CHECK(api_parse_image_request(tiny[i], strlen(tiny[i]), &lim, &r, &err) == AR_ERR);
        CHECK(err.status == 400 && strcmp(err.param, "top_p") == 0);
        CHECK_STR_CONTAINS(err.message, "which is 0 in single precision");
    }
    /* The smallest float above 0 (2^-149) stays: it is in range as given. */
    const char *least = "{\"prompt\":\"x\",\"top_p\":1.5e-45}";
    api_image_request_t r;
    api_error_t err;
    CHECK(api_parse_image_request(least, strlen(least), &lim, &r, &err) == AR_OK);
    CHECK(r.has_top_p && r.top_p > 0);
    api_image_request_free(&r);
}

int main(void) {
    TEST_RUN(test_cr_lf_and_crlf_each_start_a_data_line);
    TEST_RUN(test_a_cr_cannot_forge_a_field);
    TEST_RUN(test_top_p_that_rounds_to_zero_is_refused);
    return TEST_SUMMARY();
}
