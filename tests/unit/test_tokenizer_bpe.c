/* Byte-level BPE in engine/format/tokenizer.c against HF `tokenizers`: every string
 * of tests/golden/tokenizer/vectors.json through every committed tokenizer
 * (made by tests/golden/gen_tokenizer_vectors.py; Janus-Pro's pre-tokenizer among
 * them), ids and decoded text compared; long inputs timed; load errors
 * checked to name the file and the problem. ARSERVE_TOKENIZER_GOLDEN
 * overrides the folder. */
#include "engine/format/tokenizer.h"
#include "tests/test.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_IDS 8192
#define MAX_TEXT (1 << 16)
/* A failing tokenizer prints this many mismatches, then only counts them. */
#define MAX_REPORTS 8

static const char *golden_dir(void) {
    const char *d = getenv("ARSERVE_TOKENIZER_GOLDEN");
    return d && *d ? d : "tests/golden/tokenizer";
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    if (buf)
        buf[n] = '\0';
    fclose(f);
    return buf;
}

/* The test string: "text" as is, or "hex" decoded into buf. */
static const char *vector_text(const cJSON *item, char *buf, size_t cap) {
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(item, "text");
    if (cJSON_IsString(text))
        return text->valuestring;
    const char *hex = cJSON_GetObjectItemCaseSensitive(item, "hex")->valuestring;
    size_t n = strlen(hex) / 2;
    if (n + 1 > cap)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        sscanf(hex + 2 * i, "%2x", &v);
        buf[i] = (char)v;
    }
    buf[n] = '\0';
    return buf;
}

static void print_ids(const char *what, const int *ids, int n) {
    fprintf(stderr, "    %s:", what);
    for (int i = 0; i < n && i < 40; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, n > 40 ? " ...\n" : "\n");
}

static int n_strings_checked, n_ids_checked;

static void check_tokenizer(const char *name, const cJSON *entry, const cJSON *strings) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", golden_dir(),
             cJSON_GetObjectItemCaseSensitive(entry, "file")->valuestring);
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t != NULL, "%s", err.msg);
    if (!t)
        return;
    const cJSON *all_ids = cJSON_GetObjectItemCaseSensitive(entry, "ids");
    const cJSON *decs = cJSON_GetObjectItemCaseSensitive(entry, "dec");
    const cJSON *decs_skip = cJSON_GetObjectItemCaseSensitive(entry, "dec_skip");
    static int ids[MAX_IDS], want[MAX_IDS];
    static char buf[MAX_TEXT], out[MAX_TEXT], out_skip[MAX_TEXT];
    int bad_ids = 0, bad_dec = 0, index = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, strings) {
        int i = index++;
        const char *text = vector_text(item, buf, sizeof buf);
        const cJSON *want_json = cJSON_GetArrayItem(all_ids, i);
        int n_want = cJSON_GetArraySize(want_json);
        CHECK(text && n_want <= MAX_IDS);
        if (!text || n_want > MAX_IDS)
            continue;
        for (int k = 0; k < n_want; k++)
            want[k] = cJSON_GetArrayItem(want_json, k)->valueint;
        int n = -1;
        int rc = tokenizer_encode(t, text, ids, MAX_IDS, &n, &err);
        bool same = rc == AR_OK && n == n_want && memcmp(ids, want, sizeof *ids * n) == 0;
        n_strings_checked++;
        n_ids_checked += n_want;
        if (!same && bad_ids++ < MAX_REPORTS) {
            fprintf(stderr, "  FAIL %s: string %d \"%.80s\": ", name, i, text);
            if (rc != AR_OK) {
                fprintf(stderr, "%s\n", err.msg);
            } else {
                fputc('\n', stderr);
                print_ids("got ", ids, n);
                print_ids("want", want, n_want);
            }
        }
        /* Decoding HF's ids gives HF's text: the string itself (invalid
         * UTF-8 replaced) unless "dec" says otherwise. */
        char key[16];
        snprintf(key, sizeof key, "%d", i);
        const cJSON *dec = cJSON_GetObjectItemCaseSensitive(decs, key);
        const cJSON *dec_skip = cJSON_GetObjectItemCaseSensitive(decs_skip, key);
        const char *want_text = cJSON_IsString(dec) ? dec->valuestring : NULL;
        char lossy[MAX_TEXT];
        if (!want_text) {
            if (cJSON_IsString(cJSON_GetObjectItemCaseSensitive(item, "text"))) {
                want_text = text;
            } else {
                /* HF's expectation for raw bytes is on the replaced string;
                 * decoding ids of that string gives the replaced string back. */
                size_t dlen;
                int r = tokenizer_decode(t, want, n_want, false, lossy, sizeof lossy, &dlen, &err);
                want_text = r == AR_OK ? lossy : "";
            }
        }
        const char *want_skip = cJSON_IsString(dec_skip) ? dec_skip->valuestring : want_text;
        size_t len;
        int rd = tokenizer_decode(t, want, n_want, false, out, sizeof out, &len, &err);
        int rs = tokenizer_decode(t, want, n_want, true, out_skip, sizeof out_skip, &len, &err);
        if ((rd != AR_OK || strcmp(out, want_text) != 0 || rs != AR_OK ||
             strcmp(out_skip, want_skip) != 0) &&
            bad_dec++ < MAX_REPORTS)
            fprintf(stderr,
                    "  FAIL %s: decode of string %d: got \"%.80s\" / \"%.80s\" (skip special), "
                    "want \"%.80s\" / \"%.80s\" %s\n",
                    name, i, rd == AR_OK ? out : err.msg, rs == AR_OK ? out_skip : err.msg,
                    want_text, want_skip, "");
    }
    CHECK_MSG(bad_ids == 0, "%s: %d of %d strings encode differently from HF", name, bad_ids,
              index);
    CHECK_MSG(bad_dec == 0, "%s: %d of %d decodes differ from HF", name, bad_dec, index);
    tokenizer_free(t);
}

static cJSON *load_vectors(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/vectors.json", golden_dir());
    char *text = slurp(path);
    CHECK_MSG(text != NULL, "cannot read %s", path);
    if (!text)
        return NULL;
    cJSON *doc = cJSON_Parse(text);
    free(text);
    CHECK_MSG(doc != NULL, "%s is not JSON", path);
    return doc;
}

static cJSON *vectors;

static void check_named(const char *name) {
    const cJSON *entry = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(vectors, "tokenizers"), name);
    CHECK_MSG(entry != NULL, "vectors.json has no tokenizer '%s'", name);
    if (entry)
        check_tokenizer(name, entry, cJSON_GetObjectItemCaseSensitive(vectors, "strings"));
}

static void test_janus_pro_pre_tokenizer_matches_hf(void) { check_named("janus"); }
static void test_gpt2_byte_level_regex_matches_hf(void) { check_named("gpt2"); }
static void test_digits_and_string_merges_match_hf(void) { check_named("digits"); }
static void test_split_behaviours_normalizers_added_tokens_match_hf(void) { check_named("mixed"); }
static void test_classic_bpe_unk_prefix_suffix_match_hf(void) { check_named("classic"); }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* 10k spaces and a 10k-letter word, as one prompt each: linear-ish merging
 * keeps them far below a second; decoding gives the text back. */
static void test_long_inputs_stay_fast(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/janus.json", golden_dir());
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t != NULL, "%s", err.msg);
    if (!t)
        return;
    static char text[10001], back[10001 + 16];
    static int ids[10001];
    const char fills[] = {' ', 'a', '7', '\n'};
    for (size_t f = 0; f < sizeof fills; f++) {
        memset(text, fills[f], 10000);
        text[10000] = '\0';
        double t0 = now_s();
        int n = -1;
        int rc = tokenizer_encode(t, text, ids, 10001, &n, &err);
        double dt = now_s() - t0;
        CHECK_MSG(rc == AR_OK, "%s", err.msg);
        CHECK_MSG(dt < 0.5, "10000 x '%c' took %.3f s", fills[f], dt);
        size_t len;
        CHECK(rc != AR_OK ||
              (tokenizer_decode(t, ids, n, false, back, sizeof back, &len, &err) == AR_OK &&
               strcmp(back, text) == 0));
    }
    tokenizer_free(t);
}

static void test_decode_reports_errors_and_sizes(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/janus.json", golden_dir());
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t != NULL, "%s", err.msg);
    if (!t)
        return;
    int ids[16], n = 0;
    CHECK(tokenizer_encode(t, "a red circle", ids, 16, &n, &err) == AR_OK);
    char small[4];
    size_t len = 0;
    CHECK(tokenizer_decode(t, ids, n, false, small, sizeof small, &len, &err) == AR_ERR);
    CHECK(len == strlen("a red circle"));
    CHECK_STR_CONTAINS(err.msg, "more than the buffer's 3");
    int bad = tokenizer_vocab_size(t);
    CHECK(tokenizer_decode(t, &bad, 1, false, small, sizeof small, &len, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "is not a token");
    CHECK(tokenizer_decode(t, ids, 0, false, small, sizeof small, &len, &err) == AR_OK &&
          len == 0 && small[0] == '\0');
    tokenizer_free(t);
}

/* ---- load errors ---- */

static char fixture_dir[256];

static const char *write_fixture(const char *name, const char *json) {
    static char paths[32][320];
    static int n;
    char *path = paths[n++ % 32];
    snprintf(path, sizeof paths[0], "%s/%s.json", fixture_dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        exit(2);
    }
    for (const char *p = json; *p; p++)
        fputc(*p == '\'' ? '"' : *p, f);
    fclose(f);
    return path;
}

static const char *load_error(const char *path) {
    static ar_error_t err;
    err.msg[0] = '\0';
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t == NULL, "%s loaded but should not have", path);
    tokenizer_free(t);
    CHECK_STR_CONTAINS(err.msg, path);
    unlink(path);
    return err.msg;
}

#define BPE_VOCAB "'vocab': {'a': 0, 'b': 1, 'ab': 2}"

static void test_bpe_load_errors_name_file_and_problem(void) {
    const char *msg;
    msg = load_error(
        write_fixture("merge_oov", "{'model': {'type': 'BPE', " BPE_VOCAB ", 'merges': ['a c']}}"));
    CHECK_STR_CONTAINS(msg, "model.merges[0]: 'c' is not in model.vocab");
    msg = load_error(write_fixture("merge_result", "{'model': {'type': 'BPE', " BPE_VOCAB
                                                   ", 'merges': [['b', 'a']]}}"));
    CHECK_STR_CONTAINS(msg, "the merged token 'ba' is not in model.vocab");
    msg = load_error(write_fixture("merge_shape", "{'model': {'type': 'BPE', " BPE_VOCAB
                                                  ", 'merges': ['a b', 'ab']}}"));
    CHECK_STR_CONTAINS(msg, "model.merges[1] is not");
    msg = load_error(write_fixture("merge_triple", "{'model': {'type': 'BPE', " BPE_VOCAB
                                                   ", 'merges': [['a', 'b', 'a']]}}"));
    CHECK_STR_CONTAINS(msg, "model.merges[0] is not");
    msg = load_error(
        write_fixture("merges_type", "{'model': {'type': 'BPE', " BPE_VOCAB ", 'merges': {}}}"));
    CHECK_STR_CONTAINS(msg, "model.merges is not an array");
    msg = load_error(write_fixture("dropout", "{'model': {'type': 'BPE', " BPE_VOCAB
                                              ", 'merges': [], 'dropout': 0.1}}"));
    CHECK_STR_CONTAINS(msg, "model.dropout must be null or 0");
    msg = load_error(write_fixture("wordpiece", "{'model': {'type': 'WordPiece', 'vocab': {}}}"));
    CHECK_STR_CONTAINS(msg, "tokenizer model type 'WordPiece' is not supported");
    msg = load_error(write_fixture("nfkc", "{'normalizer': {'type': 'NFKC'}, 'model': {'type': "
                                           "'BPE', " BPE_VOCAB ", 'merges': []}}"));
    CHECK_STR_CONTAINS(msg, "normalizer type 'NFKC' is not supported");
    msg = load_error(write_fixture("replace_regex",
                                   "{'normalizer': {'type': 'Replace', "
                                   "'pattern': {'Regex': ' *'}, 'content': ''},"
                                   " 'model': {'type': 'BPE', " BPE_VOCAB ", 'merges': []}}"));
    CHECK_STR_CONTAINS(msg, "normalizer.pattern.Regex: regex ' *' can match the empty string");
    msg = load_error(write_fixture("bad_regex",
                                   "{'pre_tokenizer': {'type': 'Split', 'pattern':"
                                   " {'Regex': '[a-'}, 'behavior': 'Isolated'},"
                                   " 'model': {'type': 'BPE', " BPE_VOCAB ", 'merges': []}}"));
    CHECK_STR_CONTAINS(msg, "pre_tokenizer.pattern.Regex: bad regex '[a-' at offset");
    msg = load_error(write_fixture("empty_regex",
                                   "{'pre_tokenizer': {'type': 'Split', 'pattern':"
                                   " {'Regex': 'a*'}, 'behavior': 'Isolated'},"
                                   " 'model': {'type': 'BPE', " BPE_VOCAB ", 'merges': []}}"));
    CHECK_STR_CONTAINS(msg, "can match the empty string");
    msg = load_error(write_fixture("behavior",
                                   "{'pre_tokenizer': {'type': 'Split', 'pattern':"
                                   " {'String': 'a'}, 'behavior': 'Sideways'},"
                                   " 'model': {'type': 'BPE', " BPE_VOCAB ", 'merges': []}}"));
    CHECK_STR_CONTAINS(msg, "pre_tokenizer.behavior is missing or not one of");
    msg = load_error(write_fixture("metaspace",
                                   "{'pre_tokenizer': {'type': 'Sequence', "
                                   "'pretokenizers': [{'type': 'Metaspace'}]},"
                                   " 'model': {'type': 'BPE', " BPE_VOCAB ", 'merges': []}}"));
    CHECK_STR_CONTAINS(msg, "pre_tokenizer.pretokenizers[0].replacement is missing or not one "
                            "character");
}

/* A tokenizer whose decoder we do not know still encodes; decoding says why not. */
static void test_unsupported_decoder_refuses_to_decode(void) {
    const char *path = write_fixture("wordpiece_dec",
                                     "{'decoder': {'type': 'WordPiece'}, "
                                     "'model': {'type': 'BPE', " BPE_VOCAB ", 'merges': ['a b']}}");
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t != NULL, "%s", err.msg);
    if (t) {
        int ids[4], n = 0;
        CHECK(tokenizer_encode(t, "ab", ids, 4, &n, &err) == AR_OK && n == 1 && ids[0] == 2);
        char out[16];
        CHECK(tokenizer_decode(t, ids, n, false, out, sizeof out, NULL, &err) == AR_ERR);
        CHECK_STR_CONTAINS(err.msg, "decoder type 'WordPiece' is not supported");
        CHECK_STR_CONTAINS(err.msg, path);
    }
    tokenizer_free(t);
    unlink(path);
}

/* ^ and $ match at line ends, as in HF's Oniguruma (Ruby syntax); the ids
 * are HF's for this file. */
static void test_regex_anchors_match_at_line_ends(void) {
    const char *path = write_fixture(
        "anchors", "{'pre_tokenizer': {'type': 'Split', 'pattern': {'Regex': 'x$|^b'},"
                   " 'behavior': 'Isolated'}, 'model': {'type': 'WordLevel', 'vocab': {'[UNK]': 0,"
                   " 'a': 1, 'x': 2, '\\n': 3, 'b': 4, 'c': 5}, 'unk_token': '[UNK]'}}");
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t != NULL, "%s", err.msg);
    if (t) {
        int ids[8], n = 0;
        CHECK(tokenizer_encode(t, "ax\nbx", ids, 8, &n, &err) == AR_OK && n == 5 && ids[0] == 1 &&
              ids[1] == 2 && ids[2] == 3 && ids[3] == 4 && ids[4] == 2);
        CHECK(tokenizer_encode(t, "axc\nbc", ids, 8, &n, &err) == AR_OK && n == 3 && ids[0] == 0 &&
              ids[1] == 4 && ids[2] == 5);
    }
    tokenizer_free(t);
    unlink(path);
}

/* Two threads encoding with one tokenizer get the same ids as one thread. */
#include <pthread.h>

static tokenizer_t *shared;

static void *encode_many(void *arg) {
    static const char *const texts[] = {"a red circle 123 中文 😀", "  two\r\nlines  ",
                                        "\xff\xfe bytes", "<image_placeholder>x"};
    int *bad = arg, ids[256], again[256], n, m;
    ar_error_t err;
    for (int iter = 0; iter < 300; iter++) {
        const char *text = texts[iter % 4];
        if (tokenizer_encode(shared, text, ids, 256, &n, &err) != AR_OK ||
            tokenizer_encode(shared, text, again, 256, &m, &err) != AR_OK || n != m ||
            memcmp(ids, again, sizeof *ids * n) != 0)
            (*bad)++;
    }
    return NULL;
}

static void test_encode_is_thread_safe(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/janus.json", golden_dir());
    ar_error_t err = {{0}};
    shared = tokenizer_load(path, &err);
    CHECK_MSG(shared != NULL, "%s", err.msg);
    if (!shared)
        return;
    pthread_t th[4];
    int bad[4] = {0};
    for (int i = 0; i < 4; i++)
        pthread_create(&th[i], NULL, encode_many, &bad[i]);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECK(bad[i] == 0);
    }
    tokenizer_free(shared);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(fixture_dir, sizeof fixture_dir, "%s/test_tokenizer_bpe.XXXXXX",
             tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(fixture_dir)) {
        perror("mkdtemp");
        return 2;
    }
    vectors = load_vectors();
    if (vectors) {
        TEST_RUN(test_janus_pro_pre_tokenizer_matches_hf);
        TEST_RUN(test_gpt2_byte_level_regex_matches_hf);
        TEST_RUN(test_digits_and_string_merges_match_hf);
        TEST_RUN(test_split_behaviours_normalizers_added_tokens_match_hf);
        TEST_RUN(test_classic_bpe_unk_prefix_suffix_match_hf);
        fprintf(stderr, "        %d strings, %d ids compared with HF tokenizers\n",
                n_strings_checked, n_ids_checked);
    }
    TEST_RUN(test_long_inputs_stay_fast);
    TEST_RUN(test_decode_reports_errors_and_sizes);
    TEST_RUN(test_bpe_load_errors_name_file_and_problem);
    TEST_RUN(test_unsupported_decoder_refuses_to_decode);
    TEST_RUN(test_regex_anchors_match_at_line_ends);
    TEST_RUN(test_encode_is_thread_safe);
    cJSON_Delete(vectors);
    rmdir(fixture_dir);
    return TEST_SUMMARY();
}
