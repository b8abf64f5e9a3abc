/* Unit tests for engine/format/tokenizer.c: writes small tokenizer.json files to a
 * temp dir and checks encoding and load errors. Set TEST_TOKENIZER_KEEP=1 to
 * keep the files (their paths are printed), e.g. to re-check them against HF. */
#include "engine/format/tokenizer.h"
#include "tests/test.h"

#include <stdlib.h>
#include <unistd.h>

#define MAX_FIXTURES 64

static char fixture_dir[256];
static char fixture_paths[MAX_FIXTURES][320];
static int n_fixtures;

/* Writes json to <tmp>/<name>.json with every ' turned into " (so fixtures
 * read as JSON; none of them needs a literal apostrophe). Returns the path. */
static const char *write_fixture(const char *name, const char *json) {
    if (n_fixtures == MAX_FIXTURES) {
        fprintf(stderr, "too many fixtures\n");
        exit(2);
    }
    char *path = fixture_paths[n_fixtures++];
    snprintf(path, sizeof fixture_paths[0], "%s/%s.json", fixture_dir, name);
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

/* Writes the bytes as they are (for malformed files). */
static const char *write_raw_fixture(const char *name, const char *bytes) {
    const char *path = write_fixture(name, "");
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        exit(2);
    }
    fputs(bytes, f);
    fclose(f);
    return path;
}

static tokenizer_t *load_ok(const char *path) {
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t != NULL, "%s", err.msg);
    return t;
}

/* Loads path expecting failure; returns the message. */
static const char *load_error(const char *path) {
    static ar_error_t err;
    err.msg[0] = '\0';
    tokenizer_t *t = tokenizer_load(path, &err);
    CHECK_MSG(t == NULL, "%s loaded but should not have", path);
    tokenizer_free(t);
    return err.msg;
}

/* Encodes text and compares with want[0..n_want). */
static void check_ids(const tokenizer_t *t, const char *text, const int *want, int n_want) {
    int ids[64], n = -1;
    ar_error_t err = {{0}};
    int rc = tokenizer_encode(t, text, ids, 64, &n, &err);
    CHECK_MSG(rc == AR_OK, "encoding \"%s\": %s", text, err.msg);
    if (rc != AR_OK)
        return;
    int same = n == n_want;
    for (int i = 0; same && i < n; i++)
        same = ids[i] == want[i];
    if (!same) {
        fprintf(stderr, "  encoding \"%s\" gave", text);
        for (int i = 0; i < n; i++)
            fprintf(stderr, " %d", ids[i]);
        fprintf(stderr, ", expected");
        for (int i = 0; i < n_want; i++)
            fprintf(stderr, " %d", want[i]);
        fputc('\n', stderr);
    }
    CHECK_MSG(same, "ids for \"%s\"", text);
}

#define CHECK_IDS(t, text, ...)                                                                    \
    do {                                                                                           \
        const int want_[] = {__VA_ARGS__};                                                         \
        check_ids((t), (text), want_, (int)(sizeof want_ / sizeof want_[0]));                      \
    } while (0)

/* ---- fixtures ----
 * Expected ids below were produced by HF `tokenizers` 0.23.3 on the very files
 * these fixtures write (run with TEST_TOKENIZER_KEEP=1), by hand, once:
 *   from tokenizers import Tokenizer
 *   Tokenizer.from_file(path).encode(text, add_special_tokens=False).ids
 * Where we knowingly differ from HF (non-ASCII punctuation) the test says so. */

/* Whitespace pre-tokenizer, no normalizer, two chat-template added tokens;
 * post_processor and decoder are present to show they are accepted. */
static const char *FIXTURE_CHAT =
    "{'version': '1.0', 'truncation': null, 'padding': null,"
    " 'added_tokens': ["
    "  {'id': 0, 'content': '[UNK]', 'single_word': false, 'lstrip': false, 'rstrip': false,"
    "   'normalized': false, 'special': true},"
    "  {'id': 14, 'content': '<|User|>', 'single_word': false, 'lstrip': false, 'rstrip': false,"
    "   'normalized': false, 'special': true},"
    "  {'id': 15, 'content': '<|Assistant|>', 'single_word': false, 'lstrip': false,"
    "   'rstrip': false, 'normalized': false, 'special': true}],"
    " 'normalizer': null,"
    " 'pre_tokenizer': {'type': 'Whitespace'},"
    " 'post_processor': {'type': 'ByteLevel', 'add_prefix_space': true, 'trim_offsets': false,"
    "   'use_regex': true},"
    " 'decoder': {'type': 'Fuse'},"
    " 'model': {'type': 'WordLevel', 'unk_token': '[UNK]', 'vocab': {"
    "  '[UNK]': 0, 'a': 1, 'red': 2, 'circle': 3, ',': 4, 'left': 5, '.': 6, ':': 7,"
    "  'blue': 8, 'square': 9, '_': 10, 'x1': 11, '!?': 12, '\xc3\xa9': 13}}}";

/* Two added tokens, one a prefix of the other, the shorter listed first. */
static const char *FIXTURE_LONGEST =
    "{'added_tokens': ["
    "  {'id': 2, 'content': '<img>', 'single_word': false, 'lstrip': false, 'rstrip': false,"
    "   'normalized': false, 'special': true},"
    "  {'id': 3, 'content': '<img></img>', 'single_word': false, 'lstrip': false,"
    "   'rstrip': false, 'normalized': false, 'special': true}],"
    " 'normalizer': null, 'pre_tokenizer': {'type': 'WhitespaceSplit'},"
    " 'post_processor': null, 'decoder': null,"
    " 'model': {'type': 'WordLevel', 'unk_token': '[UNK]', 'vocab': {'[UNK]': 0, 'a': 1}}}";

/* Strip + Lowercase + NFC; a raw special token and a normalised added token. */
static const char *FIXTURE_LOWER =
    "{'added_tokens': ["
    "  {'id': 5, 'content': '<User>', 'single_word': false, 'lstrip': false, 'rstrip': false,"
    "   'normalized': false, 'special': true},"
    "  {'id': 6, 'content': '<Q>', 'single_word': false, 'lstrip': false, 'rstrip': false,"
    "   'normalized': true, 'special': false}],"
    " 'normalizer': {'type': 'Sequence', 'normalizers': ["
    "   {'type': 'Strip', 'strip_left': true, 'strip_right': true},"
    "   {'type': 'Lowercase'}, {'type': 'NFC'}]},"
    " 'pre_tokenizer': {'type': 'Whitespace'}, 'post_processor': null, 'decoder': null,"
    " 'model': {'type': 'WordLevel', 'unk_token': '[UNK]', 'vocab': {"
    "  '[UNK]': 0, 'a': 1, 'red': 2, 'circle': 3, 'caf\xc3\xa9': 4}}}";

/* single_word, lstrip and rstrip on added tokens. */
static const char *FIXTURE_FLAGS =
    "{'added_tokens': ["
    "  {'id': 4, 'content': '<|a|>', 'single_word': true, 'lstrip': false, 'rstrip': false,"
    "   'normalized': false, 'special': true},"
    "  {'id': 5, 'content': '<s>', 'single_word': false, 'lstrip': true, 'rstrip': true,"
    "   'normalized': false, 'special': true},"
    "  {'id': 6, 'content': '<|a|>x', 'single_word': false, 'lstrip': false, 'rstrip': false,"
    "   'normalized': false, 'special': true}],"
    " 'normalizer': null, 'pre_tokenizer': {'type': 'Whitespace'},"
    " 'post_processor': null, 'decoder': null,"
    " 'model': {'type': 'WordLevel', 'unk_token': '[UNK]', 'vocab': {"
    "  '[UNK]': 0, 'a': 1, 'b': 2, 'x': 3}}}";

/* No pre-tokenizer: the whole text (between added tokens) is one word. */
static const char *FIXTURE_NO_PRE =
    "{'added_tokens': [], 'normalizer': null, 'pre_tokenizer': null,"
    " 'model': {'type': 'WordLevel', 'unk_token': '[UNK]', 'vocab': {"
    "  '[UNK]': 0, 'a': 1, 'a b': 2}}}";

/* An unk_token that is not in the vocab (HF rejects a null unk_token, so
 * this is how an HF-loadable file says "no unk"; we accept null too). */
static const char *FIXTURE_NO_UNK =
    "{'pre_tokenizer': {'type': 'WhitespaceSplit'},"
    " 'model': {'type': 'WordLevel', 'unk_token': '<unk>', 'vocab': {'a': 0, 'b.': 1}}}";

/* ---- encoding ---- */

static void test_words_and_punctuation_split_like_hf_whitespace(void) {
    tokenizer_t *t = load_ok(write_fixture("chat", FIXTURE_CHAT));
    if (!t)
        return;
    CHECK_IDS(t, "a red circle, left.", 1, 2, 3, 4, 5, 6);
    /* "x1_" and "a_b" are single words (\w includes _ and digits); "!?!" is one
     * punctuation run; \x1c is punctuation, not space; \v\f\r\t are spaces. */
    CHECK_IDS(t, "x1_ x1 a_b !? !?! _ .,", 0, 11, 0, 12, 0, 10, 0);
    CHECK_IDS(t,
              "a\t\v\f\r\nred\x1c"
              "blue",
              1, 2, 0, 8);
    CHECK_IDS(t, "blue,square.", 8, 4, 9, 6);
    /* U+00A0 and U+3000 are whitespace; e-acute is a word character. */
    CHECK_IDS(t, "a\xc2\xa0red\xe3\x80\x80\xc3\xa9", 1, 2, 13);
    tokenizer_free(t);
}

static void test_empty_and_blank_text_give_no_ids(void) {
    tokenizer_t *t = load_ok(write_fixture("chat_empty", FIXTURE_CHAT));
    if (!t)
        return;
    int ids[4], n = -1;
    ar_error_t err = {{0}};
    CHECK(tokenizer_encode(t, "", ids, 4, &n, &err) == AR_OK && n == 0);
    CHECK(tokenizer_encode(t, " \n\t ", ids, 4, &n, &err) == AR_OK && n == 0);
    CHECK(tokenizer_encode(t, "", NULL, 0, &n, &err) == AR_OK && n == 0);
    tokenizer_free(t);
}

/* Whitespace splits as HF's Oniguruma \w+|[^\w\s]+ does on non-ASCII text:
 * U+2014 (em dash) and U+00B2 are punctuation, a combining accent and U+2163
 * (a letter number) are word characters. HF gives these ids. */
static void test_non_ascii_punctuation_splits_like_hf(void) {
    tokenizer_t *t = load_ok(write_fixture("chat_dash", FIXTURE_CHAT));
    if (!t)
        return;
    CHECK_IDS(t, "a\xe2\x80\x94red", 1, 0, 2);
    CHECK_IDS(t, "a\xc2\xb2red", 1, 0, 2);
    CHECK_IDS(t,
              "re\xcc\x81"
              "d \xe2\x85\xa3"
              "a",
              0, 0);
    tokenizer_free(t);
}

static void test_added_tokens_split_out_mid_text(void) {
    tokenizer_t *t = load_ok(write_fixture("chat_added", FIXTURE_CHAT));
    if (!t)
        return;
    CHECK_IDS(t, "<|User|>: a red circle\n\n<|Assistant|>:", 14, 7, 1, 2, 3, 15, 7);
    CHECK_IDS(t, "<|User|><|Assistant|><|User|>", 14, 15, 14);
    CHECK_IDS(t, "red<|User|>blue", 2, 14, 8);
    /* A partial token is ordinary text: "<|", "User", "|" */
    CHECK_IDS(t, "<|User|", 0, 0, 0);
    /* Added tokens are matched in the raw text, so "[UNK]" typed by a user is
     * the unk token, as in HF. */
    CHECK_IDS(t, "a [UNK] b", 1, 0, 0);
    tokenizer_free(t);
}

static void test_longest_added_token_wins(void) {
    tokenizer_t *t = load_ok(write_fixture("longest", FIXTURE_LONGEST));
    if (!t)
        return;
    CHECK_IDS(t, "a<img></img>a <img>a", 1, 3, 1, 2, 1);
    CHECK_IDS(t, "<img><img></img><img></im", 2, 3, 2, 0);
    tokenizer_free(t);
}

static void test_lowercase_strip_sequence_normalizer(void) {
    tokenizer_t *t = load_ok(write_fixture("lower", FIXTURE_LOWER));
    if (!t)
        return;
    CHECK_IDS(t, "A Red CIRCLE", 1, 2, 3);
    CHECK_IDS(t, "  CAF\xc3\x89  ", 4); /* Latin-1 capital E-acute folds too */
    /* Raw added tokens are matched before lowercasing; "<USER>" is not one. */
    CHECK_IDS(t, "<User>  A  <User> red", 5, 1, 5, 2);
    CHECK_IDS(t, "<USER>", 0, 0, 0);
    /* A normalised added token matches after lowercasing, in either case. */
    CHECK_IDS(t, "a <Q> <q>red", 1, 6, 6, 2);
    tokenizer_free(t);
}

static void test_added_token_single_word_lstrip_rstrip(void) {
    tokenizer_t *t = load_ok(write_fixture("flags", FIXTURE_FLAGS));
    if (!t)
        return;
    CHECK_IDS(t, "x<|a|>b x <|a|> b  <s>  a <|a|>x", 3, 0, 1, 0, 2, 3, 4, 2, 5, 1, 6);
    CHECK_IDS(t, "a<s>b", 1, 5, 2);
    tokenizer_free(t);
}

static void test_null_pre_tokenizer_keeps_text_whole(void) {
    tokenizer_t *t = load_ok(write_fixture("no_pre", FIXTURE_NO_PRE));
    if (!t)
        return;
    CHECK_IDS(t, "a b", 2);
    CHECK_IDS(t, "a", 1);
    CHECK_IDS(t, "a ", 0);
    tokenizer_free(t);
}

static void test_unknown_word_maps_to_unk(void) {
    tokenizer_t *t = load_ok(write_fixture("chat_unk", FIXTURE_CHAT));
    if (!t)
        return;
    CHECK_IDS(t, "a green circle", 1, 0, 3);
    CHECK_IDS(t, "Red", 0); /* no normalizer: case matters */
    tokenizer_free(t);
}

/* tokenizer_unknown names what the vocabulary lacks, each piece once, a run
 * of unknown words and punctuation as one piece; the list is cut with ", ..."
 * but the count is every piece. */
static void test_unknown_words_are_listed(void) {
    tokenizer_t *t = load_ok(write_fixture("chat_unknown", FIXTURE_CHAT));
    if (!t)
        return;
    char out[256];
    ar_error_t err = {{0}};
    CHECK(tokenizer_unknown(t, "a red circle, left.", out, sizeof out, &err) == 0);
    CHECK_STR_EQ(out, "");
    CHECK(tokenizer_unknown(t, "a green circle and a green cat;", out, sizeof out, &err) == 3);
    CHECK_STR_EQ(out, "'green', 'and', 'cat;'");
    CHECK(tokenizer_unknown(t, "<|User|> zebra<|Assistant|>", out, sizeof out, &err) == 1);
    CHECK_STR_EQ(out, "'zebra'");
    char small[24];
    CHECK(tokenizer_unknown(t, "one two three four", small, sizeof small, &err) == 4);
    CHECK_STR_EQ(small, "'one', 'two', ...");
    const char *words[32];
    CHECK(tokenizer_words(t, words, 32) == 13); /* 14 vocab words less [UNK] */
    CHECK_STR_EQ(words[0], "a");
    CHECK_STR_EQ(words[12], "\xc3\xa9");
    tokenizer_free(t);
}

static void test_unknown_word_without_unk_is_an_error(void) {
    tokenizer_t *t = load_ok(write_fixture("no_unk", FIXTURE_NO_UNK));
    if (!t)
        return;
    CHECK_IDS(t, "a b. a", 0, 1, 0);
    int ids[8], n = -1;
    ar_error_t err = {{0}};
    CHECK(tokenizer_encode(t, "a green b.", ids, 8, &n, &err) == AR_ERR);
    CHECK(n == 0);
    CHECK_STR_CONTAINS(err.msg, "'green'");
    CHECK_STR_CONTAINS(err.msg, "no unk token");
    tokenizer_free(t);

    /* unk_token naming a word that is not in the vocab counts as none. */
    t = load_ok(write_fixture("unk_not_in_vocab",
                              "{'model': {'type': 'WordLevel', 'unk_token': '[UNK]',"
                              " 'vocab': {'a': 0}}, 'pre_tokenizer': {'type': 'Whitespace'}}"));
    if (!t)
        return;
    CHECK(tokenizer_encode(t, "a b", ids, 8, &n, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'b'");
    tokenizer_free(t);
}

static void test_limit_error_counts_all_tokens(void) {
    tokenizer_t *t = load_ok(write_fixture("chat_limit", FIXTURE_CHAT));
    if (!t)
        return;
    int ids[6], n = -1;
    ar_error_t err = {{0}};
    CHECK(tokenizer_encode(t, "a red circle, left.", ids, 4, &n, &err) == AR_ERR);
    CHECK(n == 6); /* the count needed, for the caller's own message */
    CHECK_STR_CONTAINS(err.msg, "prompt is 6 tokens, more than the limit 4");
    CHECK(tokenizer_encode(t, "a red circle, left.", ids, 6, &n, &err) == AR_OK && n == 6);
    CHECK(tokenizer_encode(t, "a", NULL, 0, &n, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "prompt is 1 tokens, more than the limit 0");
    tokenizer_free(t);
}

/* Bytes that are not UTF-8 become U+FFFD first (unknown words here), in every mode. */
static void test_invalid_utf8_is_tokenised_as_bytes(void) {
    tokenizer_t *t = load_ok(write_fixture("chat_utf8", FIXTURE_CHAT));
    tokenizer_t *lower = load_ok(write_fixture("lower_utf8", FIXTURE_LOWER));
    if (!t || !lower) {
        tokenizer_free(t);
        tokenizer_free(lower);
        return;
    }
    CHECK_IDS(t, "\xff\xfe a \xc3 red \xe2\x80", 0, 1, 0, 2, 0);
    CHECK_IDS(lower, "A \xc3", 1, 0);
    CHECK_IDS(lower, "\xc2", 0);

    /* Random bytes: no crash, no sanitizer report, sane counts. */
    unsigned seed = 12345;
    char text[64];
    int ids[64], n;
    ar_error_t err;
    for (int iter = 0; iter < 3000; iter++) {
        int len = (int)((seed = seed * 1103515245u + 12345u) >> 16) % 63;
        for (int i = 0; i < len; i++) {
            seed = seed * 1103515245u + 12345u;
            text[i] = (char)((seed >> 16) & 0xff);
            if (!text[i])
                text[i] = ' ';
        }
        text[len] = '\0';
        const tokenizer_t *which = iter % 2 ? t : lower;
        int rc = tokenizer_encode(which, text, ids, 64, &n, &err);
        CHECK(rc == AR_OK && n >= 0 && n <= len);
    }
    tokenizer_free(t);
    tokenizer_free(lower);
}

/* ---- lookups ---- */

static void test_token_id_and_text_lookups(void) {
    tokenizer_t *t = load_ok(write_fixture("chat_lookup", FIXTURE_CHAT));
    if (!t)
        return;
    CHECK(tokenizer_token_id(t, "<|User|>") == 14);
    CHECK(tokenizer_token_id(t, "<|Assistant|>") == 15);
    CHECK(tokenizer_token_id(t, "red") == 2);
    CHECK(tokenizer_token_id(t, "[UNK]") == 0);
    CHECK(tokenizer_token_id(t, "green") == -1);
    CHECK(tokenizer_token_id(t, "") == -1);
    CHECK(tokenizer_vocab_size(t) == 16);
    CHECK(tokenizer_token_text(t, 14) && strcmp(tokenizer_token_text(t, 14), "<|User|>") == 0);
    CHECK(tokenizer_token_text(t, 3) && strcmp(tokenizer_token_text(t, 3), "circle") == 0);
    CHECK(tokenizer_token_text(t, 16) == NULL);
    CHECK(tokenizer_token_text(t, -1) == NULL);
    tokenizer_free(t);

    /* Ids with holes: vocab_size is 1 + the largest id; holes have no text. */
    t = load_ok(write_fixture("holes", "{'model': {'type': 'WordLevel', 'unk_token': null,"
                                       " 'vocab': {'a': 0, 'b': 3}}}"));
    if (!t)
        return;
    CHECK(tokenizer_vocab_size(t) == 4);
    CHECK(tokenizer_token_text(t, 1) == NULL);
    CHECK(tokenizer_token_text(t, 3) && strcmp(tokenizer_token_text(t, 3), "b") == 0);
    tokenizer_free(t);
}

/* Enough words to make the hash table grow well past its first size. */
static void test_large_vocab_lookups(void) {
    enum { N = 5000 };
    size_t cap = (size_t)N * 24 + 256;
    char *json = malloc(cap);
    CHECK(json != NULL);
    if (!json)
        return;
    size_t off = (size_t)snprintf(json, cap,
                                  "{'pre_tokenizer': {'type': 'Whitespace'},"
                                  " 'model': {'type': 'WordLevel', 'vocab': {");
    for (int i = 0; i < N; i++)
        off += (size_t)snprintf(json + off, cap - off, "%s'w%d': %d", i ? ", " : "", i, N - 1 - i);
    snprintf(json + off, cap - off, "}}}");
    tokenizer_t *t = load_ok(write_fixture("large", json));
    free(json);
    if (!t)
        return;
    int bad = 0;
    char word[16];
    for (int i = 0; i < N; i++) {
        snprintf(word, sizeof word, "w%d", i);
        bad += tokenizer_token_id(t, word) != N - 1 - i;
    }
    CHECK(bad == 0);
    CHECK(tokenizer_vocab_size(t) == N);
    CHECK(tokenizer_token_id(t, "w5000") == -1);
    CHECK_IDS(t, "w0 w4999 w17", N - 1, 0, N - 1 - 17);
    tokenizer_free(t);
}

/* ---- load errors ---- */

static void test_unsupported_model_type_is_an_error(void) {
    const char *path =
        write_fixture("wordpiece", "{'model': {'type': 'WordPiece', 'vocab': {'a': 0}}}");
    const char *msg = load_error(path);
    CHECK_STR_CONTAINS(msg, path);
    CHECK_STR_CONTAINS(
        msg, "tokenizer model type 'WordPiece' is not supported (WordLevel, BPE and Unigram are)");
    msg = load_error(write_fixture("no_type", "{'model': {'vocab': {'a': 0}}}"));
    CHECK_STR_CONTAINS(msg, "model.type is missing");
}

static void test_malformed_json_names_the_file(void) {
    const char *path = write_raw_fixture("malformed", "{\"model\": {\"type\": \"WordLevel\",\n"
                                                      "  \"vocab\": {\"a\": 0,}}}");
    const char *msg = load_error(path);
    CHECK_STR_CONTAINS(msg, path);
    CHECK_STR_CONTAINS(msg, "invalid JSON at line 2");
    msg = load_error(write_raw_fixture("empty", ""));
    CHECK_STR_CONTAINS(msg, "empty file");
    msg = load_error(write_raw_fixture("trailing", "{\"model\": {}} x"));
    CHECK_STR_CONTAINS(msg, "unexpected data after the JSON value");
    msg = load_error(write_raw_fixture("array", "[1, 2]"));
    CHECK_STR_CONTAINS(msg, "top level is not a JSON object");
    char missing[400];
    snprintf(missing, sizeof missing, "%s/does-not-exist.json", fixture_dir);
    msg = load_error(missing);
    CHECK_STR_CONTAINS(msg, missing);
    CHECK_STR_CONTAINS(msg, "cannot open");
}

static void test_missing_or_bad_vocab_is_an_error(void) {
    const char *path = write_fixture("no_vocab", "{'model': {'type': 'WordLevel',"
                                                 " 'unk_token': '[UNK]'}}");
    const char *msg = load_error(path);
    CHECK_STR_CONTAINS(msg, path);
    CHECK_STR_CONTAINS(msg, "model.vocab is missing");
    msg = load_error(write_fixture("no_model", "{'normalizer': null}"));
    CHECK_STR_CONTAINS(msg, "'model' is missing");
    msg = load_error(write_fixture("frac_id", "{'model': {'type': 'WordLevel',"
                                              " 'vocab': {'a': 0, 'b': 1.5}}}"));
    CHECK_STR_CONTAINS(msg, "model.vocab['b']");
    msg = load_error(write_fixture("str_id", "{'model': {'type': 'WordLevel',"
                                             " 'vocab': {'a': '0'}}}"));
    CHECK_STR_CONTAINS(msg, "model.vocab['a']");
    msg = load_error(write_fixture("neg_id", "{'model': {'type': 'WordLevel',"
                                             " 'vocab': {'a': -1}}}"));
    CHECK_STR_CONTAINS(msg, "model.vocab['a']");
    msg = load_error(write_fixture("huge_id", "{'model': {'type': 'WordLevel',"
                                              " 'vocab': {'a': 1e12}}}"));
    CHECK_STR_CONTAINS(msg, "model.vocab['a']");
}

static void test_duplicate_words_or_ids_are_errors(void) {
    const char *msg = load_error(write_fixture("dup_word", "{'model': {'type': 'WordLevel',"
                                                           " 'vocab': {'a': 0, 'red': 1,"
                                                           " 'red': 2}}}"));
    CHECK_STR_CONTAINS(msg, "'red' twice");
    msg = load_error(write_fixture("dup_id", "{'model': {'type': 'WordLevel',"
                                             " 'vocab': {'a': 0, 'red': 1, 'blue': 1}}}"));
    CHECK_STR_CONTAINS(msg, "id 1 to both 'red' and 'blue'");
}

static void test_unsupported_normalizer_or_pre_tokenizer_is_an_error(void) {
    const char *msg = load_error(write_fixture("nfkc", "{'normalizer': {'type': 'Sequence',"
                                                       " 'normalizers': [{'type': 'Lowercase'},"
                                                       " {'type': 'NFKC'}]},"
                                                       " 'model': {'type': 'WordLevel',"
                                                       " 'vocab': {'a': 0}}}"));
    CHECK_STR_CONTAINS(msg, "normalizer type 'NFKC' is not supported");
    msg = load_error(write_fixture("punctuation", "{'pre_tokenizer': {'type': 'Punctuation'},"
                                                  " 'model': {'type': 'WordLevel',"
                                                  " 'vocab': {'a': 0}}}"));
    CHECK_STR_CONTAINS(msg, "pre_tokenizer type 'Punctuation' is not supported");
    msg = load_error(write_fixture("strip_bad", "{'normalizer': {'type': 'Strip',"
                                                " 'strip_left': 1},"
                                                " 'model': {'type': 'WordLevel',"
                                                " 'vocab': {'a': 0}}}"));
    CHECK_STR_CONTAINS(msg, "normalizer.strip_left is not a boolean");
}

/* Sequences in Sequences: a few levels load, deeper ones are refused with
 * the path to the offending one; a Sequence without its list is named. */
static void test_sequences_nest_to_a_limit(void) {
    char norm[1024] = "{'type': 'Lowercase'}", pre[1024] = "{'type': 'WhitespaceSplit'}",
         json[4096];
    for (int level = 1; level <= 5; level++) {
        char tmp[1024];
        snprintf(tmp, sizeof tmp, "{'type': 'Sequence', 'normalizers': [%s]}", norm);
        snprintf(norm, sizeof norm, "%s", tmp);
        snprintf(tmp, sizeof tmp, "{'type': 'Sequence', 'pretokenizers': [%s]}", pre);
        snprintf(pre, sizeof pre, "%s", tmp);
        snprintf(json, sizeof json,
                 "{'normalizer': %s, 'pre_tokenizer': %s,"
                 " 'model': {'type': 'WordLevel', 'vocab': {'a': 0}}}",
                 norm, pre);
        char name[32];
        snprintf(name, sizeof name, "nest%d", level);
        const char *path = write_fixture(name, json);
        if (level <= 4) {
            ar_error_t err = {{0}};
            tokenizer_t *tk = tokenizer_load(path, &err);
            CHECK_MSG(tk != NULL, "%d levels: %s", level, err.msg);
            tokenizer_free(tk);
        } else
            CHECK_STR_CONTAINS(load_error(path), "normalizer.normalizers[0].normalizers[0]"
                                                 ".normalizers[0].normalizers[0]: Sequence "
                                                 "normalizers nested too deeply");
    }
    const char *msg = load_error(write_fixture("nest_pre", "{'pre_tokenizer': {'type': 'Sequence',"
                                                           " 'pretokenizers': [{'type': 'Sequence',"
                                                           " 'pretokenizers': [{'type': 'Sequence',"
                                                           " 'pretokenizers': [{'type': 'Sequence',"
                                                           " 'pretokenizers': [{'type': 'Sequence',"
                                                           " 'pretokenizers': []}]}]}]}]},"
                                                           " 'model': {'type': 'WordLevel',"
                                                           " 'vocab': {'a': 0}}}"));
    CHECK_STR_CONTAINS(msg ? msg : "", "Sequence pre-tokenizers nested too deeply");
    msg = load_error(write_fixture("seq_no_list", "{'normalizer': {'type': 'Sequence'},"
                                                  " 'model': {'type': 'WordLevel',"
                                                  " 'vocab': {'a': 0}}}"));
    CHECK_STR_CONTAINS(msg ? msg : "", "normalizer.normalizers is missing or not an array");
}

/* HF ignores the ids in added_tokens and assigns its own; we refuse a file
 * whose ids disagree rather than encode differently from the model's HF. */
static void test_added_token_ids_must_match_hf(void) {
    const char *msg = load_error(write_fixture("added_gap", "{'added_tokens': [{'id': 9,"
                                                            " 'content': '<x>', 'special': true}],"
                                                            " 'model': {'type': 'WordLevel',"
                                                            " 'vocab': {'a': 0, 'b': 1}}}"));
    CHECK_STR_CONTAINS(msg, "added token '<x>' has id 9, but HF tokenizers would give it id 2");
    msg = load_error(write_fixture("added_vocab_id", "{'added_tokens': [{'id': 5,"
                                                     " 'content': 'b', 'special': true}],"
                                                     " 'model': {'type': 'WordLevel',"
                                                     " 'vocab': {'a': 0, 'b': 1}}}"));
    CHECK_STR_CONTAINS(msg, "added token 'b' has id 5, but model.vocab gives it id 1");
    msg = load_error(write_fixture("added_clash", "{'added_tokens': [{'id': 2,"
                                                  " 'content': '<x>', 'special': true}],"
                                                  " 'model': {'type': 'WordLevel',"
                                                  " 'vocab': {'a': 0, 'b': 2}}}"));
    CHECK_STR_CONTAINS(msg, "which model.vocab gives to 'b'");
    msg = load_error(write_fixture("added_no_content", "{'added_tokens': [{'id': 1}],"
                                                       " 'model': {'type': 'WordLevel',"
                                                       " 'vocab': {'a': 0}}}"));
    CHECK_STR_CONTAINS(msg, "added_tokens[0].content");
}

/* An added token refused after a normalized one: the normalizer's scratch
 * buffers are freed too (LeakSanitizer fails this test in the sanitizer
 * builds when they are not). */
static void test_added_token_error_after_a_normalized_one_frees_the_scratch(void) {
    const char *msg = load_error(write_fixture(
        "added_late_error", "{'normalizer': {'type': 'Replace', 'pattern': {'String': 'x'},"
                            " 'content': 'y'},"
                            " 'added_tokens': [{'id': 1, 'content': '<x>', 'normalized': true},"
                            "  {'id': 9, 'content': '<z>', 'special': true}],"
                            " 'model': {'type': 'WordLevel', 'vocab': {'a': 0}}}"));
    CHECK_STR_CONTAINS(msg, "added token '<z>' has id 9, but HF tokenizers would give it id 2");
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(fixture_dir, sizeof fixture_dir, "%s/test_tokenizer.XXXXXX",
             tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(fixture_dir)) {
        perror("mkdtemp");
        return 2;
    }
    TEST_RUN(test_words_and_punctuation_split_like_hf_whitespace);
    TEST_RUN(test_empty_and_blank_text_give_no_ids);
    TEST_RUN(test_non_ascii_punctuation_splits_like_hf);
    TEST_RUN(test_added_tokens_split_out_mid_text);
    TEST_RUN(test_longest_added_token_wins);
    TEST_RUN(test_lowercase_strip_sequence_normalizer);
    TEST_RUN(test_added_token_single_word_lstrip_rstrip);
    TEST_RUN(test_null_pre_tokenizer_keeps_text_whole);
    TEST_RUN(test_unknown_word_maps_to_unk);
    TEST_RUN(test_unknown_words_are_listed);
    TEST_RUN(test_unknown_word_without_unk_is_an_error);
    TEST_RUN(test_limit_error_counts_all_tokens);
    TEST_RUN(test_invalid_utf8_is_tokenised_as_bytes);
    TEST_RUN(test_token_id_and_text_lookups);
    TEST_RUN(test_large_vocab_lookups);
    TEST_RUN(test_unsupported_model_type_is_an_error);
    TEST_RUN(test_malformed_json_names_the_file);
    TEST_RUN(test_missing_or_bad_vocab_is_an_error);
    TEST_RUN(test_duplicate_words_or_ids_are_errors);
    TEST_RUN(test_unsupported_normalizer_or_pre_tokenizer_is_an_error);
    TEST_RUN(test_sequences_nest_to_a_limit);
    TEST_RUN(test_added_token_ids_must_match_hf);
    TEST_RUN(test_added_token_error_after_a_normalized_one_frees_the_scratch);
    if (getenv("TEST_TOKENIZER_KEEP")) {
        fprintf(stderr, "fixtures kept in %s\n", fixture_dir);
    } else {
        for (int i = 0; i < n_fixtures; i++)
            unlink(fixture_paths[i]);
        rmdir(fixture_dir);
    }
    return TEST_SUMMARY();
}
