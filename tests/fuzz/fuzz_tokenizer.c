/* libFuzzer target: bytes as a model's tokenizer.json, through tokenizer_load
 * (engine/format/tokenizer.c, which reads a path: the input goes to a memfd), then
 * encoding with what loaded: fixed prompts, the input itself as a prompt, and
 * the text of the first tokens. Every id encoded must name a token
 * (tokenizer_token_text, the decode direction), and looking a token's text
 * up must give a token with that text; decoding what was encoded must work
 * where the file's decoder is supported. The input also goes, as a prompt,
 * through a fixed byte-level BPE tokenizer (tests/golden/tokenizer/janus.json,
 * Janus-Pro's pipeline; run from the repository root): ASCII comes back
 * unchanged from decode(encode(text)).
 * Build and run: make -f Makefile -f tests/fuzz/fuzz.mk fuzz (tests/fuzz/fuzz.mk). */
#include "engine/format/tokenizer.h"
#include "tests/fuzz/fuzz.h"

#define MAX_IDS 256
/* Three ids per input byte at most (an invalid byte is U+FFFD: 3 bytes). */
#define FUZZ_BPE_MAX_IDS 3200

static fuzz_file_t file;
static tokenizer_t *janus;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_file_init(&file, "tokenizer.json");
    ar_error_t err = {{0}};
    janus = tokenizer_load("tests/golden/tokenizer/janus.json", &err);
    if (!janus) {
        fprintf(stderr, "fuzz_tokenizer: %s (run from the repository root)\n", err.msg);
        abort();
    }
    return 0;
}

/* The prompt through the BPE tokenizer: every id a token, and the text back. */
static void bpe_round_trip(const char *text, size_t n) {
    static int ids[FUZZ_BPE_MAX_IDS];
    static char back[4 * FUZZ_BPE_MAX_IDS + 64];
    int n_ids = -1;
    ar_error_t err = {{0}};
    FUZZ_REQUIRE(tokenizer_encode(janus, text, ids, FUZZ_BPE_MAX_IDS, &n_ids, &err) == AR_OK,
                 "janus.json refused a prompt: %s", err.msg);
    size_t len = 0;
    FUZZ_REQUIRE(tokenizer_decode(janus, ids, n_ids, false, back, sizeof back, &len, &err) == AR_OK,
                 "decoding %d ids failed: %s", n_ids, err.msg);
    bool ascii = true;
    for (size_t i = 0; i < n; i++)
        ascii = ascii && (unsigned char)text[i] < 0x80;
    if (ascii)
        FUZZ_REQUIRE(len == n && memcmp(back, text, n) == 0, "'%.60s' decoded as '%.60s'", text,
                     back);
}

static void encode_checked(const tokenizer_t *t, const char *text) {
    int ids[MAX_IDS], n = -1;
    ar_error_t err = {{0}};
    if (tokenizer_encode(t, text, ids, MAX_IDS, &n, &err) != AR_OK) {
        /* *n_ids: 0, or past the limit the count it needed. */
        FUZZ_REQUIRE((n == 0 || n > MAX_IDS) && err.msg[0],
                     "a failed encode left %d ids or no message", n);
        return;
    }
    FUZZ_REQUIRE(n >= 0 && n <= MAX_IDS, "%d ids", n);
    for (int i = 0; i < n; i++) {
        FUZZ_REQUIRE(ids[i] >= 0 && ids[i] < tokenizer_vocab_size(t), "id %d of %d", ids[i],
                     tokenizer_vocab_size(t));
        FUZZ_REQUIRE(tokenizer_token_text(t, ids[i]) != NULL, "id %d has no text", ids[i]);
    }
    char back[4096];
    size_t len;
    if (tokenizer_decode(t, ids, n, false, back, sizeof back, &len, &err) != AR_OK)
        FUZZ_REQUIRE(strstr(err.msg, "decoder type") || len >= sizeof back,
                     "decoding %d ids failed: %s", n, err.msg);
    /* What it cannot spell: a count, and a list that fits its buffer (a small
     * one too, cut with ", ..."). */
    char unknown[64];
    const int n_unknown = tokenizer_unknown(t, text, unknown, sizeof unknown, &err);
    FUZZ_REQUIRE(n_unknown >= 0 && strlen(unknown) < sizeof unknown,
                 "tokenizer_unknown: %d, '%.60s'", n_unknown, unknown);
    FUZZ_REQUIRE((n_unknown == 0) == (unknown[0] == 0), "%d pieces listed as '%.60s'", n_unknown,
                 unknown);
    /* The same text with room for one id: the whole count, or the limit error. */
    int one;
    if (tokenizer_encode(t, text, ids, 1, &one, &err) == AR_OK)
        FUZZ_REQUIRE(one == n && n <= 1, "%d ids, then %d with a limit of 1", n, one);
    else
        FUZZ_REQUIRE(one == n && n > 1, "the limit refused %d ids, saying %d", n, one);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char prompt[1025];
    size_t plen = size < sizeof prompt - 1 ? size : sizeof prompt - 1;
    memcpy(prompt, data, plen);
    prompt[plen] = 0;
    bpe_round_trip(prompt, strlen(prompt));
    fuzz_file_write(&file, data, size);
    ar_error_t err = {{0}};
    tokenizer_t *t = tokenizer_load(file.path, &err);
    if (!t) {
        FUZZ_REQUIRE(strstr(err.msg, file.path) != NULL, "message does not name the file: %s",
                     err.msg);
        return 0;
    }
    static const char *const prompts[] = {"a red circle on the left",
                                          "",
                                          " ",
                                          "  two   GREEN triangles\t\n",
                                          "<bos>a<pad>",
                                          "\xc3\x80\xc3\x89 caf\xc3\xa9 \xe3\x80\x80 x",
                                          "\xff\xfe\xc3",
                                          "a,b.c!?"};
    for (size_t i = 0; i < sizeof prompts / sizeof prompts[0]; i++)
        encode_checked(t, prompts[i]);
    char own[1025];
    size_t n = size < sizeof own - 1 ? size : sizeof own - 1;
    memcpy(own, data, n);
    own[n] = 0;
    encode_checked(t, own);
    int vocab = tokenizer_vocab_size(t);
    for (int id = 0; id < vocab && id < 64; id++) {
        const char *text = tokenizer_token_text(t, id);
        if (!text)
            continue;
        int back = tokenizer_token_id(t, text);
        FUZZ_REQUIRE(back >= 0 && strcmp(tokenizer_token_text(t, back), text) == 0,
                     "token %d '%.40s' looks up as %d", id, text, back);
        encode_checked(t, text);
    }
    tokenizer_free(t);
    return 0;
}
