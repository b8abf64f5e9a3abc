/* SentencePiece Unigram for tokenizer.c: the Viterbi segmentation of HF
 * `tokenizers`' Unigram model (unigram/model.rs, encode_optimized) over a
 * byte trie of the pieces, and SentencePiece's precompiled charsmap (HF's
 * Precompiled normalizer, the spm_precompiled crate: a Darts double-array
 * trie and a blob of NUL-terminated replacements). Contract:
 * tokenizer_unigram.h and tokenizer.h. */
#include "engine/format/tokenizer_unigram.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

/* HF's kUnkPenalty: an unknown character scores the lowest piece score minus this. */
#define UNIGRAM_UNK_PENALTY 10.0
/* HF maps a whole grapheme cluster only when it is shorter than this many bytes. */
#define CHARSMAP_GRAPHEME_MAX 6

static size_t utf8_len(unsigned char c) { return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; }

/* ---- byte trie of the pieces: (node, byte) -> child in one hash table ---- */

typedef struct trie_slot {
    uint64_t key; /* node << 8 | byte, + 1; 0: empty */
    int child;
} trie_slot_t;

struct unigram {
    trie_slot_t *slots;
    size_t mask;
    int *node_piece; /* [n_nodes]: the piece ending at the node, -1 if none */
    int n_nodes;
    double *scores;
    int n_pieces, unk_id;
    double unk_score; /* lowest score - UNIGRAM_UNK_PENALTY */
    bool byte_fallback;
    int byte_id[256]; /* the id of "<0xAB>", -1 if absent */
};

static size_t trie_index(const unigram_t *u, uint64_t key) {
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & u->mask;
}

/* The child of node along byte b, -1 if none. */
static int trie_child(const unigram_t *u, int node, unsigned char b) {
    uint64_t key = ((uint64_t)node << 8 | b) + 1;
    for (size_t i = trie_index(u, key);; i = (i + 1) & u->mask) {
        if (u->slots[i].key == key)
            return u->slots[i].child;
        if (u->slots[i].key == 0)
            return -1;
    }
}

static int trie_add_child(unigram_t *u, int node, unsigned char b) {
    uint64_t key = ((uint64_t)node << 8 | b) + 1;
    size_t i = trie_index(u, key);
    while (u->slots[i].key != 0 && u->slots[i].key != key)
        i = (i + 1) & u->mask;
    if (u->slots[i].key == 0) {
        u->slots[i] = (trie_slot_t){key, u->n_nodes};
        u->node_piece[u->n_nodes++] = -1;
    }
    return u->slots[i].child;
}

/* The id of the piece s[0..n) exactly, -1 if it is not a piece. */
static int unigram_lookup(const unigram_t *u, const char *s, size_t n) {
    int node = 0;
    for (size_t i = 0; i < n && node >= 0; i++)
        node = trie_child(u, node, (unsigned char)s[i]);
    return node >= 0 ? u->node_piece[node] : -1;
}

unigram_t *unigram_new(const char *const *pieces, const double *scores, int n, int unk_id,
                       bool byte_fallback, const char *path, ar_error_t *err) {
    size_t total = 1;
    for (int i = 0; i < n; i++)
        total += strlen(pieces[i]);
    unigram_t *u = calloc(1, sizeof *u);
    size_t cap = 16;
    while (cap < 2 * total + 1)
        cap <<= 1;
    if (u) {
        u->slots = calloc(cap, sizeof *u->slots);
        u->node_piece = malloc(total * sizeof *u->node_piece);
        u->scores = malloc(((size_t)n + 1) * sizeof *u->scores);
    }
    if (!u || !u->slots || !u->node_piece || !u->scores) {
        unigram_free(u);
        ar_errorf(err, "%s: out of memory for the Unigram model", path);
        return NULL;
    }
    u->mask = cap - 1;
    u->node_piece[0] = -1;
    u->n_nodes = 1;
    u->n_pieces = n;
    u->unk_id = unk_id;
    u->byte_fallback = byte_fallback;
    double min_score = INFINITY;
    for (int i = 0; i < n; i++) {
        int node = 0;
        for (const char *p = pieces[i]; *p; p++)
            node = trie_add_child(u, node, (unsigned char)*p);
        u->node_piece[node] = i; /* a repeated piece keeps its last id, as HF's map */
        u->scores[i] = scores[i];
        if (scores[i] < min_score)
            min_score = scores[i];
    }
    u->unk_score = min_score - UNIGRAM_UNK_PENALTY;
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        u->byte_id[b] = unigram_lookup(u, name, strlen(name));
    }
    return u;
}

void unigram_free(unigram_t *u) {
    if (!u)
        return;
    free(u->slots);
    free(u->node_piece);
    free(u->scores);
    free(u);
}

/* The best path ending at a byte position: its score, where its last piece
 * starts (-1: not reached yet) and that piece's id. */
typedef struct best_node {
    double score;
    int start, id;
} best_node_t;

void unigram_scratch_free(unigram_scratch_t *sc) {
    free(sc->nodes);
    free(sc->path);
    *sc = (unigram_scratch_t){0};
}

/* Emits the id of one token of the path, s[0..n): its piece, else (a fused
 * run of unknowns) its byte pieces with byte_fallback, else unk. */
static int emit_token(const unigram_t *u, const char *s, size_t n, unigram_emit_fn emit, void *ctx,
                      ar_error_t *err) {
    int id = unigram_lookup(u, s, n);
    if (id >= 0) {
        emit(ctx, id, NULL, 0);
        return AR_OK;
    }
    if (u->byte_fallback) {
        bool all = true;
        for (size_t i = 0; i < n && all; i++)
            all = u->byte_id[(unsigned char)s[i]] >= 0;
        if (all) {
            for (size_t i = 0; i < n; i++)
                emit(ctx, u->byte_id[(unsigned char)s[i]], NULL, 0);
            return AR_OK;
        }
    }
    if (u->unk_id < 0)
        return ar_errorf(err, "prompt has a character the Unigram model cannot spell and the model "
                              "has no unk_id");
    emit(ctx, u->unk_id, s, n);
    return AR_OK;
}

int unigram_encode(const unigram_t *u, const char *s, size_t n, unigram_scratch_t *sc,
                   unigram_emit_fn emit, void *ctx, ar_error_t *err) {
    if (n == 0)
        return AR_OK;
    if (n + 1 > sc->cap) {
        best_node_t *nodes = realloc(sc->nodes, (n + 1) * sizeof *nodes);
        if (nodes)
            sc->nodes = nodes;
        int *path = nodes ? realloc(sc->path, (n + 1) * sizeof *path) : NULL;
        if (!nodes || !path)
            return ar_errorf(err, "out of memory encoding a prompt");
        sc->path = path;
        sc->cap = n + 1;
    }
    best_node_t *best = sc->nodes;
    for (size_t i = 0; i <= n; i++)
        best[i] = (best_node_t){0.0, -1, 0};
    /* Forward: every piece that starts at a character boundary relaxes the
     * node where it ends. A later candidate replaces an earlier one only if
     * strictly better, so among equal scores the path whose last piece
     * starts first (the longest last piece) wins, as in HF. */
    for (size_t start = 0; start < n;) {
        double here = best[start].score;
        size_t mblen = utf8_len((unsigned char)s[start]);
        if (mblen > n - start)
            mblen = n - start;
        bool has_single = false;
        int node = 0;
        for (size_t end = start; end < n;) {
            node = trie_child(u, node, (unsigned char)s[end++]);
            if (node < 0)
                break;
            int id = u->node_piece[node];
            if (id < 0)
                continue;
            double candidate = u->scores[id] + here;
            if (best[end].start < 0 || candidate > best[end].score)
                best[end] = (best_node_t){candidate, (int)start, id};
            if (end - start == mblen)
                has_single = true;
        }
        if (!has_single) {
            /* A character that no piece spells alone: unk, at the unk penalty. */
            best_node_t *target = &best[start + mblen];
            double candidate = u->unk_score + here;
            if (target->start < 0 || candidate > target->score) {
                if (u->unk_id < 0)
                    return ar_errorf(err, "prompt has a character the Unigram model cannot "
                                          "spell and the model has no unk_id");
                *target = (best_node_t){candidate, (int)start, u->unk_id};
            }
        }
        start += mblen;
    }
    /* Backward: the path's token boundaries; consecutive unk pieces fuse. */
    int *path = sc->path;
    size_t n_path = 0;
    bool in_unk = false;
    for (size_t end = n; end > 0;) {
        const best_node_t *b = &best[end];
        bool unk = u->unk_id >= 0 && b->id == u->unk_id;
        if (!(unk && in_unk))
            path[n_path++] = (int)end; /* a token ends here */
        in_unk = unk;
        end = (size_t)b->start;
    }
    size_t from = 0;
    for (size_t k = n_path; k-- > 0;) {
        size_t to = (size_t)path[k];
        if (emit_token(u, s + from, to - from, emit, ctx, err) != AR_OK)
            return AR_ERR;
        from = to;
    }
    return AR_OK;
}

/* ---- scores as HF reads them ---- */

/* The f64 literals 1e0..1e308, serde_json's POW10. */
static const double POW10[309] = {
    1e000, 1e001, 1e002, 1e003, 1e004, 1e005, 1e006, 1e007, 1e008, 1e009, 1e010, 1e011, 1e012,
    1e013, 1e014, 1e015, 1e016, 1e017, 1e018, 1e019, 1e020, 1e021, 1e022, 1e023, 1e024, 1e025,
    1e026, 1e027, 1e028, 1e029, 1e030, 1e031, 1e032, 1e033, 1e034, 1e035, 1e036, 1e037, 1e038,
    1e039, 1e040, 1e041, 1e042, 1e043, 1e044, 1e045, 1e046, 1e047, 1e048, 1e049, 1e050, 1e051,
    1e052, 1e053, 1e054, 1e055, 1e056, 1e057, 1e058, 1e059, 1e060, 1e061, 1e062, 1e063, 1e064,
    1e065, 1e066, 1e067, 1e068, 1e069, 1e070, 1e071, 1e072, 1e073, 1e074, 1e075, 1e076, 1e077,
    1e078, 1e079, 1e080, 1e081, 1e082, 1e083, 1e084, 1e085, 1e086, 1e087, 1e088, 1e089, 1e090,
    1e091, 1e092, 1e093, 1e094, 1e095, 1e096, 1e097, 1e098, 1e099, 1e100, 1e101, 1e102, 1e103,
    1e104, 1e105, 1e106, 1e107, 1e108, 1e109, 1e110, 1e111, 1e112, 1e113, 1e114, 1e115, 1e116,
    1e117, 1e118, 1e119, 1e120, 1e121, 1e122, 1e123, 1e124, 1e125, 1e126, 1e127, 1e128, 1e129,
    1e130, 1e131, 1e132, 1e133, 1e134, 1e135, 1e136, 1e137, 1e138, 1e139, 1e140, 1e141, 1e142,
    1e143, 1e144, 1e145, 1e146, 1e147, 1e148, 1e149, 1e150, 1e151, 1e152, 1e153, 1e154, 1e155,
    1e156, 1e157, 1e158, 1e159, 1e160, 1e161, 1e162, 1e163, 1e164, 1e165, 1e166, 1e167, 1e168,
    1e169, 1e170, 1e171, 1e172, 1e173, 1e174, 1e175, 1e176, 1e177, 1e178, 1e179, 1e180, 1e181,
    1e182, 1e183, 1e184, 1e185, 1e186, 1e187, 1e188, 1e189, 1e190, 1e191, 1e192, 1e193, 1e194,
    1e195, 1e196, 1e197, 1e198, 1e199, 1e200, 1e201, 1e202, 1e203, 1e204, 1e205, 1e206, 1e207,
    1e208, 1e209, 1e210, 1e211, 1e212, 1e213, 1e214, 1e215, 1e216, 1e217, 1e218, 1e219, 1e220,
    1e221, 1e222, 1e223, 1e224, 1e225, 1e226, 1e227, 1e228, 1e229, 1e230, 1e231, 1e232, 1e233,
    1e234, 1e235, 1e236, 1e237, 1e238, 1e239, 1e240, 1e241, 1e242, 1e243, 1e244, 1e245, 1e246,
    1e247, 1e248, 1e249, 1e250, 1e251, 1e252, 1e253, 1e254, 1e255, 1e256, 1e257, 1e258, 1e259,
    1e260, 1e261, 1e262, 1e263, 1e264, 1e265, 1e266, 1e267, 1e268, 1e269, 1e270, 1e271, 1e272,
    1e273, 1e274, 1e275, 1e276, 1e277, 1e278, 1e279, 1e280, 1e281, 1e282, 1e283, 1e284, 1e285,
    1e286, 1e287, 1e288, 1e289, 1e290, 1e291, 1e292, 1e293, 1e294, 1e295, 1e296, 1e297, 1e298,
    1e299, 1e300, 1e301, 1e302, 1e303, 1e304, 1e305, 1e306, 1e307, 1e308,
};

/* serde_json's overflow! test: would a * 10 + b exceed max? */
#define SERDE_OVERFLOW(a, b, max) ((a) >= (max) / 10 && ((a) > (max) / 10 || (b) > (max) % 10))

/* serde_json's f64_from_parts without float_roundtrip. */
static int serde_from_parts(bool positive, uint64_t significand, int64_t exponent, double *out) {
    double f = (double)significand;
    for (;;) {
        int64_t a = exponent < 0 ? -exponent : exponent;
        if (a <= 308) {
            if (exponent >= 0) {
                f *= POW10[a];
                if (isinf(f))
                    return AR_ERR;
            } else {
                f /= POW10[a];
            }
            break;
        }
        if (f == 0.0)
            break;
        if (exponent >= 0)
            return AR_ERR;
        f /= 1e308;
        exponent += 308;
    }
    *out = positive ? f : -f;
    return AR_OK;
}

int unigram_score_parse(const char *p, size_t n, double *out) {
    size_t i = 0;
    bool positive = true;
    if (i < n && p[i] == '-')
        positive = false, i++;
    if (i >= n || p[i] < '0' || p[i] > '9')
        return AR_ERR;
    uint64_t sig = 0;
    int64_t exp10 = 0;
    bool overflowed = false;
    /* Integer part: digits past what a u64 holds only raise the exponent. */
    if (p[i] == '0') {
        i++;
    } else {
        for (; i < n && p[i] >= '0' && p[i] <= '9'; i++) {
            unsigned d = (unsigned)(p[i] - '0');
            if (overflowed || SERDE_OVERFLOW(sig, d, UINT64_MAX)) {
                overflowed = true;
                exp10++;
            } else {
                sig = sig * 10 + d;
            }
        }
    }
    if (i < n && p[i] == '.') {
        i++;
        size_t first = i;
        /* Fraction: digits are taken until one would overflow, then dropped. */
        bool dropping = false;
        for (; i < n && p[i] >= '0' && p[i] <= '9'; i++) {
            unsigned d = (unsigned)(p[i] - '0');
            if (dropping || SERDE_OVERFLOW(sig, d, UINT64_MAX)) {
                dropping = true;
                continue;
            }
            sig = sig * 10 + d;
            exp10--;
        }
        if (i == first)
            return AR_ERR;
    }
    if (i < n && (p[i] == 'e' || p[i] == 'E')) {
        i++;
        bool positive_exp = true;
        if (i < n && (p[i] == '+' || p[i] == '-'))
            positive_exp = p[i++] == '+';
        if (i >= n || p[i] < '0' || p[i] > '9')
            return AR_ERR;
        int64_t e = 0;
        for (; i < n && p[i] >= '0' && p[i] <= '9'; i++) {
            int64_t d = p[i] - '0';
            if (SERDE_OVERFLOW(e, d, (int64_t)INT32_MAX)) {
                if (sig != 0 && positive_exp)
                    return AR_ERR;
                *out = positive ? 0.0 : -0.0;
                return AR_OK;
            }
            e = e * 10 + d;
        }
        exp10 += positive_exp ? e : -e;
    }
    if (i != n)
        return AR_ERR;
    return serde_from_parts(positive, sig, exp10, out);
}

/* ---- precompiled charsmap ---- */

struct charsmap {
    uint32_t *units; /* the double array */
    size_t n_units;
    char *blob; /* NUL-separated replacements */
    size_t blob_len;
    pcre2_code *grapheme; /* \X */
};

void charsmap_free(charsmap_t *m) {
    if (!m)
        return;
    free(m->units);
    free(m->blob);
    pcre2_code_free(m->grapheme);
    free(m);
}

static int base64_value(unsigned char c) {
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
}

/* Standard base64 with padding, as HF's BASE64_STANDARD; *bad gets the
 * offset of the first bad character. NULL on a bad string or no memory. */
static unsigned char *base64_decode(const char *s, size_t *out_len, size_t *bad) {
    size_t n = strlen(s);
    *bad = n;
    if (n % 4 != 0)
        return NULL;
    unsigned char *out = malloc(n / 4 * 3 + 1);
    if (!out)
        return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            unsigned char c = (unsigned char)s[i + k];
            if (c == '=' && i + 4 == n && k >= 2 && (k == 3 || s[i + 3] == '=')) {
                v[k] = 0;
                pad++;
                continue;
            }
            v[k] = base64_value(c);
            if (v[k] < 0 || pad) {
                *bad = i + k;
                free(out);
                return NULL;
            }
        }
        uint32_t w =
            (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (unsigned char)(w >> 16);
        if (pad < 2)
            out[o++] = (unsigned char)(w >> 8);
        if (pad < 1)
            out[o++] = (unsigned char)w;
    }
    *out_len = o;
    return out;
}

static bool blob_is_utf8(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t need = c < 0x80                   ? 1
                      : (c >= 0xC2 && c <= 0xDF) ? 2
                      : (c >= 0xE0 && c <= 0xEF) ? 3
                      : (c >= 0xF0 && c <= 0xF4) ? 4
                                                 : 0;
        if (!need || need > n - i)
            return false;
        unsigned lo = 0x80, hi = 0xBF;
        if (c == 0xE0)
            lo = 0xA0;
        else if (c == 0xED)
            hi = 0x9F;
        else if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F;
        for (size_t k = 1; k < need; k++, lo = 0x80, hi = 0xBF)
            if (s[i + k] < lo || s[i + k] > hi)
                return false;
        i += need;
    }
    return true;
}

static const char *charsmap_check(const charsmap_t *m);

charsmap_t *charsmap_load(const char *base64, const char *path, const char *where,
                          ar_error_t *err) {
    size_t len = 0, bad = 0;
    unsigned char *raw = base64_decode(base64, &len, &bad);
    if (!raw) {
        ar_errorf(err, "%s: %s is not standard base64 (at character %zu)", path, where, bad);
        return NULL;
    }
    charsmap_t *m = calloc(1, sizeof *m);
    if (!m) {
        free(raw);
        ar_errorf(err, "%s: out of memory for %s", path, where);
        return NULL;
    }
    uint32_t trie_bytes = len >= 4 ? (uint32_t)raw[0] | (uint32_t)raw[1] << 8 |
                                         (uint32_t)raw[2] << 16 | (uint32_t)raw[3] << 24
                                   : 0;
    const char *problem = NULL;
    if (len < 4)
        problem = "is shorter than its 4-byte trie size";
    else if (trie_bytes == 0 || trie_bytes % 4 != 0)
        problem = "declares a trie size that is 0 or not a multiple of 4";
    else if (trie_bytes > len - 4)
        problem = "declares a trie longer than the data";
    else if (!blob_is_utf8(raw + 4 + trie_bytes, len - 4 - trie_bytes))
        problem = "has a normalised-string blob that is not UTF-8";
    if (problem) {
        free(raw);
        charsmap_free(m);
        ar_errorf(err, "%s: %s %s (%zu bytes decoded)", path, where, problem, len);
        return NULL;
    }
    m->n_units = trie_bytes / 4;
    m->blob_len = len - 4 - trie_bytes;
    m->units = malloc(m->n_units * sizeof *m->units);
    m->blob = malloc(m->blob_len + 1);
    int code;
    PCRE2_SIZE offset;
    m->grapheme = pcre2_compile((PCRE2_SPTR) "\\X", PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                &code, &offset, NULL);
    if (!m->units || !m->blob || !m->grapheme) {
        free(raw);
        charsmap_free(m);
        ar_errorf(err, "%s: out of memory for %s", path, where);
        return NULL;
    }
    for (size_t i = 0; i < m->n_units; i++) {
        const unsigned char *p = raw + 4 + 4 * i;
        m->units[i] =
            (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    }
    memcpy(m->blob, raw + 4 + trie_bytes, m->blob_len);
    m->blob[m->blob_len] = '\0';
    free(raw);
    if ((problem = charsmap_check(m))) {
        ar_errorf(err, "%s: %s: its trie %s (%zu units): a corrupted charsmap", path, where,
                  problem, m->n_units);
        charsmap_free(m);
        return NULL;
    }
    (void)pcre2_jit_compile(m->grapheme, PCRE2_JIT_COMPLETE);
    return m;
}

/* Darts-clone's unit fields, as spm_precompiled reads them. */
static size_t unit_offset(uint32_t u) { return (size_t)(u >> 10) << ((u & (1u << 9)) >> 6); }
static bool unit_has_leaf(uint32_t u) { return (u >> 8) & 1; }
static uint32_t unit_label(uint32_t u) { return u & (1u << 31 | 0xFF); }

/* Walks the trie as charsmap_transform reads it, each node's children once
 * per base (nodes may share a base, and so their children: T5's 44,288
 * units hold 262,072 paths): every value index in the arrays and the start
 * of a replacement in the blob, and at least one key. NULL when it holds,
 * else what does not. A corrupted trie would otherwise load and change
 * what prompts normalise to, silently. */
static const char *charsmap_check(const charsmap_t *m) {
    size_t *todo = malloc(m->n_units * sizeof *todo);
    uint8_t *seen = calloc(m->n_units, 1);
    const char *problem = NULL;
    size_t n_todo = 0, keys = 0;
    if (!todo || !seen)
        problem = "could not be checked (out of memory)";
    const size_t root = unit_offset(m->units[0]);
    if (!problem && root < m->n_units) {
        seen[root] = 1;
        todo[n_todo++] = root;
    }
    while (n_todo && !problem) {
        const size_t base = todo[--n_todo];
        for (unsigned c = 1; c <= 0xFF && !problem; c++) {
            const size_t child = base ^ c;
            if (child >= m->n_units || unit_label(m->units[child]) != c)
                continue;
            const uint32_t unit = m->units[child];
            const size_t next = child ^ unit_offset(unit);
            if (unit_has_leaf(unit)) {
                const size_t at = next < m->n_units ? m->units[next] & 0x7FFFFFFFu : m->blob_len;
                if (at >= m->blob_len || (at > 0 && m->blob[at - 1] != '\0'))
                    problem = "has a value that is not the start of a replacement";
                keys++;
            }
            if (next < m->n_units && !seen[next]) {
                seen[next] = 1;
                todo[n_todo++] = next;
            }
        }
    }
    free(todo);
    free(seen);
    if (!problem && keys == 0)
        problem = "holds no key";
    return problem;
}

/* HF's Precompiled::transform: the replacement of the *shortest* key that
 * prefixes s[0..n) (HF keeps the first result of a common-prefix search;
 * SentencePiece itself takes the longest), or NULL; *out_len its length.
 * Indices outside the arrays (HF would panic) mean no key. */
static const char *charsmap_transform(const charsmap_t *m, const char *s, size_t n,
                                      size_t *out_len) {
    size_t pos = unit_offset(m->units[0]);
    for (size_t i = 0; i < n && s[i]; i++) {
        unsigned char c = (unsigned char)s[i];
        pos ^= c;
        if (pos >= m->n_units || unit_label(m->units[pos]) != c)
            return NULL;
        uint32_t unit = m->units[pos];
        pos ^= unit_offset(unit);
        if (!unit_has_leaf(unit))
            continue;
        if (pos >= m->n_units)
            return NULL;
        size_t at = m->units[pos] & 0x7FFFFFFFu;
        if (at > m->blob_len || (at < m->blob_len && ((unsigned char)m->blob[at] & 0xC0) == 0x80))
            return NULL;
        *out_len = strlen(m->blob + at);
        return m->blob + at;
    }
    return NULL;
}

/* HF's alignment of the output, followed as far as its start stands at
 * offset 0: in the next input character to take (its byte offset in s),
 * whether the last one taken stood at 0, whether any was, and the bytes
 * of output that do. */
typedef struct origin_walk {
    const char *s;
    size_t n, origin, in, out;
    bool last_at_0, taken, open;
} origin_walk_t;

/* One output character of out_bytes: change 0 takes the next input
 * character's place, 1 is inserted after the last taken (before any: at 0). */
static void walk_emit(origin_walk_t *w, size_t out_bytes, int inserted) {
    bool at_0;
    if (inserted) {
        at_0 = !w->taken || w->last_at_0;
    } else {
        at_0 = w->in < w->origin;
        w->last_at_0 = at_0;
        w->taken = true;
        if (w->in < w->n)
            w->in += utf8_len((unsigned char)w->s[w->in]);
    }
    if (w->open && at_0)
        w->out += out_bytes;
    else
        w->open = false;
}

/* Input characters a shorter mapping removes: skipped after the last output
 * character; before any, HF records nothing, and they are not skipped. */
static void walk_skip(origin_walk_t *w, size_t chars, bool any_output) {
    for (size_t k = 0; any_output && k < chars && w->in < w->n; k++)
        w->in += utf8_len((unsigned char)w->s[w->in]);
}

static size_t utf8_chars(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i += utf8_len((unsigned char)s[i]))
        c++;
    return c;
}

/* A replacement r (rlen bytes) of old_chars input characters, as HF's
 * Precompiled records it: r's characters take the input's places in turn;
 * with more characters than were replaced the last few are inserted, with
 * fewer the rest are skipped. */
static void walk_replace(origin_walk_t *w, const char *r, size_t rlen, size_t old_chars,
                         bool any_output) {
    const size_t new_chars = utf8_chars(r, rlen);
    size_t k = 0;
    for (size_t i = 0; i < rlen; k++) {
        const size_t cl = utf8_len((unsigned char)r[i]);
        const size_t taking = new_chars > old_chars ? old_chars : new_chars;
        walk_emit(w, cl, k >= taking);
        i += cl;
    }
    if (new_chars < old_chars)
        walk_skip(w, old_chars - new_chars, any_output || new_chars > 0);
}

int charsmap_normalize(const charsmap_t *m, const char *s, size_t n, char **out, size_t *out_len,
                       size_t origin, size_t *origin_out) {
    tok_buf_t b = {0};
    int rc = tok_buf_append(&b, "", 0);
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md)
        rc = AR_ERR;
    origin_walk_t w = {.s = s, .n = n, .origin = origin, .open = true};
    for (size_t i = 0; i < n && rc == AR_OK;) {
        /* One extended grapheme cluster (PCRE2's \X), at least one character. */
        size_t glen = utf8_len((unsigned char)s[i]);
        if (pcre2_match(m->grapheme, (PCRE2_SPTR)s, n, i, PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED, md,
                        NULL) > 0) {
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            if (ov[1] > i)
                glen = ov[1] - i;
        }
        if (glen > n - i)
            glen = n - i;
        size_t rlen = 0;
        const char *r =
            glen < CHARSMAP_GRAPHEME_MAX ? charsmap_transform(m, s + i, glen, &rlen) : NULL;
        if (r) {
            walk_replace(&w, r, rlen, utf8_chars(s + i, glen), b.n > 0);
            rc = tok_buf_append(&b, r, rlen);
        } else {
            for (size_t k = i; k < i + glen && rc == AR_OK;) {
                size_t clen = utf8_len((unsigned char)s[k]);
                if (clen > i + glen - k)
                    clen = i + glen - k;
                r = charsmap_transform(m, s + k, clen, &rlen);
                if (r)
                    walk_replace(&w, r, rlen, 1, b.n > 0);
                else
                    walk_emit(&w, clen, 0);
                rc = r ? tok_buf_append(&b, r, rlen) : tok_buf_append(&b, s + k, clen);
                k += clen;
            }
        }
        i += glen;
    }
    if (origin_out)
        *origin_out = w.out;
    pcre2_match_data_free(md);
    if (rc != AR_OK) {
        free(b.p);
        return AR_ERR;
    }
    *out = b.p;
    *out_len = b.n;
    return AR_OK;
}
