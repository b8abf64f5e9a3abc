/* libFuzzer target: the Server-Sent-Event writer of server/api.c.
 * Input: EVENT NUL TEXT [NUL ...]; the last 16 bytes also give the builders'
 * integer arguments. Checks that
 *   - api_sse_frame(EVENT, TEXT) is NULL exactly when EVENT is empty or holds
 *     CR or LF, and otherwise a well-formed frame: "event: EVENT\n", then
 *     "data: " lines with no CR or LF inside, then one blank line, nothing
 *     more; and an SSE reader, joining the data lines with "\n", gets TEXT
 *     back with its line breaks (CRLF, CR, LF alike) as LF;
 *   - every event builder (progress, partial image, completed, error) gives
 *     NULL for negative arguments and otherwise strict JSON without newlines,
 *     whose "type" is its event name once framed and read back.
 * Build and run: make -f Makefile -f tests/fuzz/fuzz.mk fuzz (tests/fuzz/fuzz.mk). */
#include "server/api.h"
#include "tests/fuzz/fuzz.h"

#include <cjson/cJSON.h>

/* What an SSE reader does with text as data: every CRLF, CR or LF is one
 * line break, and lines are joined with LF. malloc'd. */
static char *sse_normalised(const char *text) {
    size_t n = strlen(text);
    char *out = malloc(n + 1), *w = out;
    FUZZ_REQUIRE(out, "out of memory");
    for (size_t i = 0; i < n; i++) {
        if (text[i] == '\r') {
            *w++ = '\n';
            if (text[i + 1] == '\n')
                i++;
        } else {
            *w++ = text[i];
        }
    }
    *w = 0;
    return out;
}

/* Checks frame's shape and returns its data lines joined with LF (malloc'd). */
static char *check_frame(const char *frame, const char *event) {
    size_t ev = strlen(event);
    FUZZ_REQUIRE(strncmp(frame, "event: ", 7) == 0, "frame does not start with 'event: '");
    FUZZ_REQUIRE(strncmp(frame + 7, event, ev) == 0 && frame[7 + ev] == '\n',
                 "event line is not the event");
    const char *p = frame + 7 + ev + 1;
    char *data = malloc(strlen(p) + 1), *w = data;
    FUZZ_REQUIRE(data, "out of memory");
    int lines = 0;
    while (*p != '\n') {
        FUZZ_REQUIRE(strncmp(p, "data: ", 6) == 0, "a line without 'data: ': %.40s", p);
        p += 6;
        size_t k = strcspn(p, "\r\n");
        FUZZ_REQUIRE(p[k] == '\n', "data line %d ends in %s", lines,
                     p[k] == '\r' ? "a raw CR" : "the end of the frame");
        if (lines++)
            *w++ = '\n';
        memcpy(w, p, k);
        w += k;
        p += k + 1;
    }
    *w = 0;
    FUZZ_REQUIRE(lines >= 1, "a frame with no data line");
    FUZZ_REQUIRE(p[1] == 0, "bytes after the blank line that ends the frame");
    return data;
}

/* frame(event, json) read back must be json, whose "type" is event. */
static void check_event(const char *json, const char *event, const char *what) {
    fuzz_require_json(json, what);
    char *frame = api_sse_frame(event, json);
    FUZZ_REQUIRE(frame, "api_sse_frame refused %s", what);
    char *data = check_frame(frame, event);
    FUZZ_REQUIRE(strcmp(data, json) == 0, "%s: data read back differs", what);
    cJSON *root = json_parse_strict(data, strlen(data), 8, NULL, NULL);
    FUZZ_REQUIRE(root, "%s: data does not parse", what);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(root, "type");
    if (strcmp(event, API_SSE_ERROR) != 0)
        FUZZ_REQUIRE(cJSON_IsString(type) && strcmp(type->valuestring, event) == 0,
                     "%s: type is not %s", what, event);
    cJSON_Delete(root);
    free(data);
    free(frame);
}

/* Valid UTF-8, judged by cJSON's printing of it as a string (which escapes
 * quotes, backslashes and control characters but copies other bytes) and the
 * strict check of the result. */
static int utf8_valid(const char *s) {
    cJSON *str = cJSON_CreateString(s);
    char *printed = str ? cJSON_PrintUnformatted(str) : NULL;
    cJSON_Delete(str);
    FUZZ_REQUIRE(printed, "out of memory");
    int ok = json_strict_check(printed, strlen(printed), 1, NULL) == AR_OK;
    free(printed);
    return ok;
}

static int32_t int_at(const uint8_t *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                     (uint32_t)p[3] << 24);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = malloc(size + 2);
    FUZZ_REQUIRE(buf, "out of memory");
    memcpy(buf, data, size);
    buf[size] = buf[size + 1] = 0;
    const char *event = buf;
    const char *text = buf + strlen(buf) + 1;

    char *frame = api_sse_frame(event, text);
    if (!event[0] || strpbrk(event, "\r\n")) {
        FUZZ_REQUIRE(frame == NULL, "a frame for an event that is empty or holds CR or LF");
    } else {
        FUZZ_REQUIRE(frame != NULL, "no frame for event '%.40s'", event);
        char *back = check_frame(frame, event);
        char *want = sse_normalised(text);
        FUZZ_REQUIRE(strcmp(back, want) == 0, "the data read back is not the text");
        free(want);
        free(back);
    }
    free(frame);

    uint8_t tail[16] = {0};
    memcpy(tail, data + (size > 16 ? size - 16 : 0), size > 16 ? 16 : size);
    int a = int_at(tail), b = int_at(tail + 4), c = int_at(tail + 8);
    int w = tail[12] | tail[13] << 8, h = tail[14] | tail[15] << 8;
    char *b64 = api_base64((const uint8_t *)text, strlen(text));
    FUZZ_REQUIRE(b64, "api_base64 failed");

    char *json = api_sse_progress(a, b, c);
    if (a < 0 || b < 0 || c < 0)
        FUZZ_REQUIRE(json == NULL, "progress with a negative argument");
    else
        check_event(json, API_SSE_PROGRESS, "api_sse_progress");
    free(json);
    json = api_sse_partial_image(b64, a & 3, c & 0xffff, (long)b, w, h);
    check_event(json, API_SSE_PARTIAL_IMAGE, "api_sse_partial_image");
    free(json);
    json = api_sse_completed(b64, c, (long)a, w, h, b, a, NULL, NULL, NULL);
    if (c < 0 || b < 0 || a < 0)
        FUZZ_REQUIRE(json == NULL, "completed with a negative argument");
    else
        check_event(json, API_SSE_COMPLETED, "api_sse_completed");
    free(json);
    /* A late error carries client text (a prompt, a field name) that passed the
     * request's UTF-8 check: cut to the message's size, it stays valid. */
    if (utf8_valid(text) && utf8_valid(event)) {
        api_error_t e;
        api_errorf(&e, (a & 1) ? 500 : 400, event, "invalid_value", "%s", text);
        json = api_error_json(&e);
        check_event(json, API_SSE_ERROR, "api_error_json");
        free(json);
    }
    free(b64);
    free(buf);
    return 0;
}
