/* SentencePiece Unigram in engine/format/tokenizer*.c against HF `tokenizers`:
 * every string of tests/golden/tokenizer/unigram_vectors.json through T5's
 * real tokenizer.json (t5.json) and the layouts derived from it (made by
 * tests/golden/gen_tokenizer_unigram_vectors.py), ids and decoded text
 * compared; long inputs timed; load errors (charsmap, vocab, unk_id,
 * Metaspace) checked to name the file and the problem.
 * ARSERVE_TOKENIZER_GOLDEN overrides the folder. Run:
 *   make build/tests/test_tokenizer_unigram && build/tests/test_tokenizer_unigram */
#include "engine/format/tokenizer.h"
#include "tests/test.h"

#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_IDS 8192
#define MAX_TEXT (1 << 16)
/* A failing layout prints this many mismatches, then only counts them. */
#define MAX_REPORTS 5

static char fixture_dir[256];

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

/* The members of the JSON object text[0..len) (valid JSON): key and value
 * spans, the key without its quotes. Returns the count (at most max). The
 * text is spliced, not re-printed, so every number keeps its digits: HF
 * reads Unigram scores from their digits (see tokenizer_unigram.h). */
typedef struct member {
    const char *key, *value;
    size_t key_len, value_len;
} member_t;

static const char *skip_string(const char *p) {
    for (p++; *p != '"'; p++)
        if (*p == '\\')
            p++;
    return p + 1;
}

static int object_members(const char *text, member_t *out, int max) {
    const char *p = strchr(text, '{') + 1;
    int n = 0;
    for (;;) {
        while (*p && *p != '"' && *p != '}')
            p++;
        if (*p != '"' || n == max)
            return n;
        member_t *m = &out[n++];
        m->key = p + 1;
        p = skip_string(p);
        m->key_len = (size_t)(p - 1 - m->key);
        p = strchr(p, ':') + 1;
        while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r')
            p++;
        m->value = p;
        int depth = 0;
        while (*p && (depth > 0 || (*p != ',' && *p != '}'))) {
            if (*p == '"') {
                p = skip_string(p);
                continue;
            }
            depth += (*p == '[' || *p == '{') - (*p == ']' || *p == '}');
            p++;
        }
        m->value_len = (size_t)(p - m->value);
        while (m->value_len && strchr(" \n\t\r", m->value[m->value_len - 1]))
            m->value_len--;
    }
}

/* The golden file with the top-level members of patch (a JSON object's
 * text) put in place of its own, written to fixture_dir; returns its path
 * (static storage), NULL on error. */
static const char *patched_file(const char *name, const char *file, const char *patch) {
    static char out[600];
    char path[512];
    snprintf(path, sizeof path, "%s/%s", golden_dir(), file);
    char *text = slurp(path);
    CHECK_MSG(text != NULL, "cannot read %s", path);
    if (!text)
        return NULL;
    member_t mine[64], theirs[64];
    int n_mine = object_members(text, mine, 64), n_theirs = object_members(patch, theirs, 64);
    snprintf(out, sizeof out, "%s/%s.json", fixture_dir, name);
    FILE *f = fopen(out, "wb");
    if (!f) {
        perror(out);
        exit(2);
    }
    const char *sep = "{";
    for (int i = 0; i < n_theirs; i++, sep = ",")
        fprintf(f, "%s\"%.*s\":%.*s", sep, (int)theirs[i].key_len, theirs[i].key,
                (int)theirs[i].value_len, theirs[i].value);
    for (int i = 0; i < n_mine; i++) {
        bool replaced = false;
        for (int k = 0; k < n_theirs; k++)
            replaced |= mine[i].key_len == theirs[k].key_len &&
                        memcmp(mine[i].key, theirs[k].key, mine[i].key_len) == 0;
        if (!replaced) {
            fprintf(f, "%s\"%.*s\":", sep, (int)mine[i].key_len, mine[i].key);
            fwrite(mine[i].value, 1, mine[i].value_len, f);
            sep = ",";
        }
    }
    fputs("}", f);
    fclose(f);
    free(text);
    return out;
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

/* Ids around the first difference, each with its piece. */
static void print_ids(const tokenizer_t *t, const char *what, const int *ids, int n, int from) {
    fprintf(stderr, "    %s (%d ids) from [%d]:", what, n, from);
    for (int i = from; i < n && i < from + 12; i++) {
        const char *text = tokenizer_token_text(t, ids[i]);
        fprintf(stderr, " %d'%s'", ids[i], text ? text : "?");
    }
    fprintf(stderr, n > from + 12 ? " ...\n" : "\n");
}

static int n_strings_checked, n_ids_checked;

static void check_layout(const char *name, const cJSON *entry, const cJSON *strings) {
    const char *path =
        patched_file(name, cJSON_GetObjectItemCaseSensitive(entry, "file")->valuestring,
                     cJSON_GetObjectItemCaseSensitive(entry, "patch")->valuestring);
    if (!path)
        return;
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t != NULL, "%s", err.msg);
    if (!t)
        return;
    const cJSON *all_ids = cJSON_GetObjectItemCaseSensitive(entry, "ids");
    const cJSON *decs = cJSON_GetObjectItemCaseSensitive(entry, "dec");
    const cJSON *decs_skip = cJSON_GetObjectItemCaseSensitive(entry, "dec_skip");
    static int ids[MAX_IDS], want[MAX_IDS];
    static char buf[MAX_TEXT], out[MAX_TEXT], out_skip[MAX_TEXT], lossy[MAX_TEXT];
    int bad_ids = 0, bad_dec = 0, index = 0;
    const cJSON *item, *want_json = all_ids->child;
    cJSON_ArrayForEach(item, strings) {
        int i = index++;
        const char *text = vector_text(item, buf, sizeof buf);
        int n_want = cJSON_GetArraySize(want_json);
        CHECK(text && n_want <= MAX_IDS);
        if (!text || n_want > MAX_IDS)
            continue;
        int k = 0;
        for (const cJSON *id = want_json->child; id; id = id->next)
            want[k++] = id->valueint;
        want_json = want_json->next;
        int n = -1;
        int rc = tokenizer_encode(t, text, ids, MAX_IDS, &n, &err);
        bool same = rc == AR_OK && n == n_want && memcmp(ids, want, sizeof *ids * n) == 0;
        n_strings_checked++;
        n_ids_checked += n_want;
        if (!same && bad_ids++ < MAX_REPORTS) {
            fprintf(stderr, "  FAIL %s: string %d \"%.100s\": ", name, i, text);
            if (rc != AR_OK) {
                fprintf(stderr, "%s\n", err.msg);
            } else {
                int first = 0;
                while (first < n && first < n_want && ids[first] == want[first])
                    first++;
                fprintf(stderr, "first difference at id %d\n", first);
                print_ids(t, "got ", ids, n, first > 2 ? first - 2 : 0);
                print_ids(t, "want", want, n_want, first > 2 ? first - 2 : 0);
            }
        }
        /* Decoding HF's ids gives HF's text: the string itself (invalid
         * UTF-8 replaced) unless "dec" says otherwise. */
        char key[16];
        snprintf(key, sizeof key, "%d", i);
        const cJSON *dec = cJSON_GetObjectItemCaseSensitive(decs, key);
        const cJSON *dec_skip = cJSON_GetObjectItemCaseSensitive(decs_skip, key);
        const char *want_text = cJSON_IsString(dec) ? dec->valuestring : NULL;
        if (!want_text) {
            if (cJSON_IsString(cJSON_GetObjectItemCaseSensitive(item, "text"))) {
                want_text = text;
            } else {
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
                    "want \"%.80s\" / \"%.80s\"\n",
                    name, i, rd == AR_OK ? out : err.msg, rs == AR_OK ? out_skip : err.msg,
                    want_text, want_skip);
    }
    CHECK_MSG(bad_ids == 0, "%s: %d of %d strings encode differently from HF", name, bad_ids,
              index);
    CHECK_MSG(bad_dec == 0, "%s: %d of %d decodes differ from HF", name, bad_dec, index);
    tokenizer_free(t);
    unlink(path);
}

static cJSON *vectors;

static void check_named(const char *name) {
    const cJSON *entry = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(vectors, "tokenizers"), name);
    CHECK_MSG(entry != NULL, "unigram_vectors.json has no layout '%s'", name);
    if (entry)
        check_layout(name, entry, cJSON_GetObjectItemCaseSensitive(vectors, "strings"));
}

static void test_t5_tokenizer_json_matches_hf(void) { check_named("t5"); }
static void test_whitespace_split_metaspace_layout_matches_hf(void) {
    check_named("t5_whitespace_split");
}
static void test_prepend_first_no_split_strip_layout_matches_hf(void) {
    check_named("t5_first_nosplit");
}
static void test_whitespace_split_then_prepend_first_matches_hf(void) {
    check_named("t5_whitespace_split_first");
}
static void test_byte_fallback_prepend_never_matches_hf(void) { check_named("t5_bytes_never"); }

static tokenizer_t *load_t5(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/t5.json", golden_dir());
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t != NULL, "%s", err.msg);
    return t;
}

/* What T5 reads as <unk> (id 2; HF: 'a cat 猫猫 on 🙂 sofa' -> [3, 9, 1712, 3,
 * 2, 30, 3, 2, 5650], tokens '猫猫' and '🙂' unknown) is listed, each run once. */
static void test_t5_unknown_pieces_are_listed(void) {
    tokenizer_t *t = load_t5();
    if (!t)
        return;
    ar_error_t err = {{0}};
    char out[128];
    CHECK(tokenizer_unknown(t, "a cat \xe7\x8c\xab\xe7\x8c\xab on \xf0\x9f\x99\x82 sofa", out,
                            sizeof out, &err) == 2);
    CHECK_MSG(strcmp(out, "'\xe7\x8c\xab\xe7\x8c\xab', '\xf0\x9f\x99\x82'") == 0, "%s", out);
    CHECK(tokenizer_unknown(t, "a photo of a red cube", out, sizeof out, &err) == 0);
    CHECK(tokenizer_words(t, NULL, 0) == 0); /* open text: no word list */
    tokenizer_free(t);
}

/* What Infinity's text encoder gets: the ids, then </s> appended by the caller. */
static void test_t5_prompt_ids_and_added_tokens(void) {
    tokenizer_t *t = load_t5();
    if (!t)
        return;
    ar_error_t err = {{0}};
    int ids[64], n = 0;
    CHECK(tokenizer_vocab_size(t) == 32100);
    CHECK(tokenizer_token_id(t, "</s>") == 1 && tokenizer_token_id(t, "<extra_id_0>") == 32099);
    /* HF: [3, 9, 1202, 13, 3, 9, 1131, 123, 346, 30, 3, 9, 5726, 953] */
    static const int want[] = {3, 9, 1202, 13, 3, 9, 1131, 123, 346, 30, 3, 9, 5726, 953};
    CHECK(tokenizer_encode(t, "a photo of a red cube on a wooden table", ids, 64, &n, &err) ==
          AR_OK);
    CHECK(n == 14 && memcmp(ids, want, sizeof want) == 0);
    CHECK(tokenizer_encode(t, "<extra_id_0>hi</s>", ids, 64, &n, &err) == AR_OK && n == 3 &&
          ids[0] == 32099 && ids[1] == 7102 && ids[2] == 1);
    CHECK(tokenizer_encode(t, "a photo", ids, 2, &n, &err) == AR_ERR && n == 3);
    CHECK_STR_CONTAINS(err.msg, "prompt is 3 tokens, more than the limit 2");
    tokenizer_free(t);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* 10k-character prompts (one word, spaces, unknown characters, accents):
 * the trie keeps Viterbi linear in the length. */
static void test_long_inputs_stay_fast(void) {
    tokenizer_t *t = load_t5();
    if (!t)
        return;
    static char text[40001];
    static int ids[40001];
    static const char *const fills[] = {"a", " ", "\xE2\x98\x83", "e\xCC\x81", "ab c"};
    for (size_t f = 0; f < sizeof fills / sizeof *fills; f++) {
        size_t k = strlen(fills[f]), len = 0;
        while (len + k <= 40000 && len / k < 10000)
            memcpy(text + len, fills[f], k), len += k;
        text[len] = '\0';
        ar_error_t err = {{0}};
        double t0 = now_s();
        int n = -1;
        int rc = tokenizer_encode(t, text, ids, 40001, &n, &err);
        double dt = now_s() - t0;
        CHECK_MSG(rc == AR_OK, "%s", err.msg);
        CHECK_MSG(dt < 0.5, "10000 x '%s' took %.3f s", fills[f], dt);
    }
    tokenizer_free(t);
}

/* ---- load and encode errors ---- */

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

#define UNIGRAM_MODEL                                                                              \
    "'model': {'type': 'Unigram', 'unk_id': 0, 'vocab': [['<unk>', 0.0], ['a', -1.5]]}"
#define PRECOMPILED(map) "'normalizer': {'type': 'Precompiled', 'precompiled_charsmap': '" map "'}"

static void test_unigram_load_errors_name_file_and_problem(void) {
    const char *msg;
    msg = load_error(write_fixture("score", "{'model': {'type': 'Unigram', 'unk_id': 0, 'vocab': "
                                            "[['<unk>', 0.0], ['a', 'high']]}}"));
    CHECK_STR_CONTAINS(msg, "model.vocab[1] ('a'): the score is not a number");
    msg = load_error(write_fixture("pair", "{'model': {'type': 'Unigram', 'unk_id': 0, 'vocab': "
                                           "[['<unk>', 0.0], ['a']]}}"));
    CHECK_STR_CONTAINS(msg, "model.vocab[1] is not [piece, score]");
    msg =
        load_error(write_fixture("vocab_obj", "{'model': {'type': 'Unigram', 'vocab': {'a': 0}}}"));
    CHECK_STR_CONTAINS(msg, "model.vocab is missing or not an array of [piece, score]");
    msg =
        load_error(write_fixture("unk_range", "{'model': {'type': 'Unigram', 'unk_id': 2, 'vocab': "
                                              "[['<unk>', 0.0], ['a', -1.5]]}}"));
    CHECK_STR_CONTAINS(msg, "model.unk_id 2 is out of range: model.vocab has 2 pieces");
    msg =
        load_error(write_fixture("unk_neg", "{'model': {'type': 'Unigram', 'unk_id': -1, 'vocab': "
                                            "[['<unk>', 0.0]]}}"));
    CHECK_STR_CONTAINS(msg, "model.unk_id is not null or a whole number");
    /* A piece past 256 bytes: its trie would take about 49 bytes a byte
     * (a 100 MB piece took 4.9 GB); refused before it is built. */
    char long_piece[1200];
    snprintf(long_piece, sizeof long_piece,
             "{'model': {'type': 'Unigram', 'unk_id': 0, 'vocab': [['<unk>', 0.0], ['%0257d', "
             "-1.0]]}}",
             0);
    msg = load_error(write_fixture("long_piece", long_piece));
    CHECK_STR_CONTAINS(msg, "model.vocab[1] is a piece of 257 bytes; pieces have at most 256");
    snprintf(long_piece, sizeof long_piece,
             "{'model': {'type': 'Unigram', 'unk_id': 0, 'vocab': [['<unk>', 0.0], ['%0256d', "
             "-1.0]]}}",
             0);
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(write_fixture("piece_256", long_piece), &err);
    CHECK_MSG(t != NULL, "a piece of 256 bytes: %s", err.msg);
    tokenizer_free(t);
    msg = load_error(write_fixture("b64", "{" PRECOMPILED("AB$=") ", " UNIGRAM_MODEL "}"));
    CHECK_STR_CONTAINS(msg,
                       "normalizer.precompiled_charsmap is not standard base64 (at character 2)");
    msg = load_error(write_fixture("short", "{" PRECOMPILED("AAA=") ", " UNIGRAM_MODEL "}"));
    CHECK_STR_CONTAINS(msg, "is shorter than its 4-byte trie size");
    /* A trie of 0x100 bytes declared, 4 given. */
    msg = load_error(
        write_fixture("trie_long", "{" PRECOMPILED("AAEAAAAAAAA=") ", " UNIGRAM_MODEL "}"));
    CHECK_STR_CONTAINS(msg, "normalizer.precompiled_charsmap declares a trie longer than the data");
    msg =
        load_error(write_fixture("trie_zero", "{" PRECOMPILED("AAAAAA==") ", " UNIGRAM_MODEL "}"));
    CHECK_STR_CONTAINS(msg, "declares a trie size that is 0 or not a multiple of 4");
    /* A 4-byte trie, then the blob "\xff": not UTF-8. */
    msg = load_error(write_fixture("blob", "{" PRECOMPILED("BAAAAAAAAAD/") ", " UNIGRAM_MODEL "}"));
    CHECK_STR_CONTAINS(msg, "has a normalised-string blob that is not UTF-8");
    msg = load_error(
        write_fixture("nomap", "{'normalizer': {'type': 'Precompiled'}, " UNIGRAM_MODEL "}"));
    CHECK_STR_CONTAINS(msg, "normalizer.precompiled_charsmap is missing or not a string");
    msg = load_error(write_fixture("scheme",
                                   "{'pre_tokenizer': {'type': 'Metaspace', 'replacement':"
                                   " '_', 'prepend_scheme': 'sometimes'}, " UNIGRAM_MODEL "}"));
    CHECK_STR_CONTAINS(msg,
                       "pre_tokenizer.prepend_scheme is not \"always\", \"first\" or \"never\"");
    msg = load_error(write_fixture("aps", "{'decoder': {'type': 'Metaspace', 'replacement': '_', "
                                          "'add_prefix_space': false}, " UNIGRAM_MODEL "}"));
    CHECK_STR_CONTAINS(msg,
                       "decoder.add_prefix_space is false but prepend_scheme is not \"never\"");
    msg = load_error(write_fixture("rep", "{'pre_tokenizer': {'type': 'Metaspace', 'replacement': "
                                          "'ab'}, " UNIGRAM_MODEL "}"));
    CHECK_STR_CONTAINS(msg, "pre_tokenizer.replacement is missing or not one character");
}

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/* Standard base64 of s[0..n), padded; the caller frees it. */
static char *b64_encode(const unsigned char *s, size_t n) {
    char *out = malloc((n + 2) / 3 * 4 + 1), *o = out;
    for (size_t i = 0; i < n; i += 3) {
        const uint32_t w = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0) |
                           (i + 2 < n ? s[i + 2] : 0);
        *o++ = B64[w >> 18 & 63];
        *o++ = B64[w >> 12 & 63];
        *o++ = i + 1 < n ? B64[w >> 6 & 63] : '=';
        *o++ = i + 2 < n ? B64[w & 63] : '=';
    }
    *o = 0;
    return out;
}

/* Its inverse (no checks: the input is T5's own charsmap). */
static unsigned char *b64_decode(const char *s, size_t *n) {
    const size_t len = strlen(s);
    unsigned char *out = malloc(len / 4 * 3), *o = out;
    for (size_t i = 0; i < len; i += 4) {
        uint32_t w = 0;
        int pad = 0;
        for (int k = 0; k < 4; k++) {
            const char *at = strchr(B64, s[i + k]);
            pad += s[i + k] == '=';
            w = w << 6 | (s[i + k] == '=' || !at ? 0 : (uint32_t)(at - B64));
        }
        *o++ = (unsigned char)(w >> 16);
        if (pad < 2)
            *o++ = (unsigned char)(w >> 8);
        if (pad < 1)
            *o++ = (unsigned char)w;
    }
    *n = (size_t)(o - out);
    return out;
}

/* T5's charsmap with every unit of its trie corrupted (XORed with a seeded
 * random word, or all set to one value) is refused at load, naming it: such
 * a trie loaded before and silently changed what prompts normalise to. The
 * file as it is loads. */
static void test_a_corrupted_charsmap_trie_is_refused(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/t5.json", golden_dir());
    char *text = slurp(path);
    cJSON *root = text ? cJSON_Parse(text) : NULL;
    free(text);
    cJSON *norms =
        root ? cJSON_GetObjectItem(cJSON_GetObjectItem(root, "normalizer"), "normalizers") : NULL;
    cJSON *map = cJSON_GetObjectItem(cJSON_GetArrayItem(norms, 0), "precompiled_charsmap");
    CHECK_MSG(cJSON_IsString(map), "%s: no normalizers[0].precompiled_charsmap", path);
    if (!cJSON_IsString(map)) {
        cJSON_Delete(root);
        return;
    }
    size_t n;
    unsigned char *raw = b64_decode(map->valuestring, &n);
    const uint32_t trie_bytes =
        (uint32_t)raw[0] | (uint32_t)raw[1] << 8 | (uint32_t)raw[2] << 16 | (uint32_t)raw[3] << 24;
    CHECK(trie_bytes > 0 && 4 + trie_bytes <= n);
    unsigned char *copy = malloc(n);
    for (int variant = 0; variant < 4; variant++) {
        memcpy(copy, raw, n);
        uint64_t x = 0x9E3779B97F4A7C15ull * (uint64_t)(variant + 1);
        for (size_t u = 0; variant > 0 && u < trie_bytes / 4; u++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            for (int k = 0; k < 4; k++) {
                unsigned char *b = copy + 4 + 4 * u + k;
                *b = variant == 3 ? (unsigned char)(0xA5 + k) : *b ^ (unsigned char)(x >> 8 * k);
            }
        }
        char *enc = b64_encode(copy, n);
        cJSON_SetValuestring(map, enc);
        free(enc);
        char *json = cJSON_PrintUnformatted(root);
        snprintf(path, sizeof path, "%s/charsmap_%d.json", fixture_dir, variant);
        FILE *f = fopen(path, "wb");
        fputs(json, f);
        fclose(f);
        free(json);
        ar_error_t err = {{0}};
        tokenizer_t *t = tokenizer_load(path, &err);
        if (variant == 0) {
            CHECK_MSG(t != NULL, "T5's own charsmap, re-encoded: %s", err.msg);
        } else {
            CHECK_MSG(t == NULL, "variant %d of the corrupted trie loaded", variant);
            CHECK_STR_CONTAINS(err.msg, "normalizers[0].precompiled_charsmap: its trie");
            CHECK_STR_CONTAINS(err.msg, "a corrupted charsmap");
        }
        tokenizer_free(t);
        unlink(path);
    }
    free(copy);
    free(raw);
    cJSON_Delete(root);
}

/* Without unk_id, a character no piece spells is an encoding error (HF
 * raises MissingUnkId); spelled text still encodes; the ids are HF's. */
static void test_unknown_character_without_unk_id_is_an_error(void) {
    const char *path = write_fixture(
        "no_unk", "{'pre_tokenizer': {'type': 'Metaspace', 'replacement': '_'}, "
                  "'decoder': {'type': 'Metaspace', 'replacement': '_'}, 'model': {'type': "
                  "'Unigram', 'unk_id': null, 'vocab': [['_', -2.0], ['a', -1.0], ['b', -1.0], "
                  "['ab', -1.5], ['_ab', -3.6], ['_a', -2.5]]}}");
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t != NULL, "%s", err.msg);
    if (t) {
        int ids[8], n = 0;
        /* "_ab": _ + ab and _a + b tie at -3.5 and beat _ab (-3.6); HF keeps
         * the path whose last piece starts first: [_, ab]. */
        CHECK(tokenizer_encode(t, "ab", ids, 8, &n, &err) == AR_OK && n == 2 && ids[0] == 0 &&
              ids[1] == 3);
        CHECK(tokenizer_encode(t, "abc", ids, 8, &n, &err) == AR_ERR && n == 0);
        CHECK_STR_CONTAINS(err.msg, "no unk_id");
        char out[16];
        CHECK(tokenizer_decode(t, ids, 0, false, out, sizeof out, NULL, &err) == AR_OK);
    }
    tokenizer_free(t);
    unlink(path);
}

/* The unk penalty, min(score) - 10, decides between an unk and a piece that
 * spans the unknown character when a neighbour scores high: 'a' (9.9) + unk
 * (-15) loses to 'ab' (-5), 'c' (10.1) + unk beats 'cb' (-5); runs of
 * unknowns fuse. The ids are HF's for this file. */
static void test_unk_penalty_is_min_score_minus_ten(void) {
    const char *path = write_fixture("penalty", "{'model': {'type': 'Unigram', 'unk_id': 0, "
                                                "'vocab': [['<unk>', 0.0], ['a', 9.9], ['ab', "
                                                "-5.0], ['c', 10.1], ['cb', -5.0]]}}");
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t != NULL, "%s", err.msg);
    if (t) {
        int ids[8], n = 0;
        CHECK(tokenizer_encode(t, "ab", ids, 8, &n, &err) == AR_OK && n == 1 && ids[0] == 2);
        CHECK(tokenizer_encode(t, "cb", ids, 8, &n, &err) == AR_OK && n == 2 && ids[0] == 3 &&
              ids[1] == 0);
        CHECK(tokenizer_encode(t, "bb", ids, 8, &n, &err) == AR_OK && n == 1 && ids[0] == 0);
        CHECK(tokenizer_encode(t, "abcb", ids, 8, &n, &err) == AR_OK && n == 3 && ids[0] == 2 &&
              ids[1] == 3 && ids[2] == 0);
    }
    tokenizer_free(t);
    unlink(path);
}

static tokenizer_t *shared;

static void *encode_many(void *arg) {
    static const char *const texts[] = {"a red circle 123 中文 😀", "  two\r\nlines  ",
                                        "\xff\xfe bytes ﬁ", "<extra_id_3>x</s>"};
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
    shared = load_t5();
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
    snprintf(fixture_dir, sizeof fixture_dir, "%s/test_tokenizer_unigram.XXXXXX",
             tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(fixture_dir)) {
        perror("mkdtemp");
        return 2;
    }
    char path[512];
    snprintf(path, sizeof path, "%s/unigram_vectors.json", golden_dir());
    char *text = slurp(path);
    CHECK_MSG(text != NULL, "cannot read %s", path);
    vectors = text ? cJSON_Parse(text) : NULL;
    free(text);
    CHECK_MSG(vectors != NULL, "%s is not JSON", path);
    if (vectors) {
        TEST_RUN(test_t5_tokenizer_json_matches_hf);
        TEST_RUN(test_whitespace_split_metaspace_layout_matches_hf);
        TEST_RUN(test_prepend_first_no_split_strip_layout_matches_hf);
        TEST_RUN(test_whitespace_split_then_prepend_first_matches_hf);
        TEST_RUN(test_byte_fallback_prepend_never_matches_hf);
        fprintf(stderr, "        %d strings, %d ids compared with HF tokenizers\n",
                n_strings_checked, n_ids_checked);
    }
    TEST_RUN(test_t5_prompt_ids_and_added_tokens);
    TEST_RUN(test_t5_unknown_pieces_are_listed);
    TEST_RUN(test_long_inputs_stay_fast);
    TEST_RUN(test_unigram_load_errors_name_file_and_problem);
    TEST_RUN(test_a_corrupted_charsmap_trie_is_refused);
    TEST_RUN(test_unknown_character_without_unk_id_is_an_error);
    TEST_RUN(test_unk_penalty_is_min_score_minus_ten);
    TEST_RUN(test_encode_is_thread_safe);
    cJSON_Delete(vectors);
    rmdir(fixture_dir);
    return TEST_SUMMARY();
}
