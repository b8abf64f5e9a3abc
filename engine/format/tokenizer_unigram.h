/* Internal to engine/format/tokenizer*.c: SentencePiece's Unigram model as
 * HF `tokenizers` runs it (Viterbi over scored pieces, a byte trie of the
 * pieces) and SentencePiece's precompiled charsmap normaliser (HF's
 * `Precompiled`, the spm_precompiled crate). The public contract is
 * tokenizer.h; nothing outside the tokenizer includes this. */
#ifndef ARSERVE_TOKENIZER_UNIGRAM_H
#define ARSERVE_TOKENIZER_UNIGRAM_H

#include "base/status.h"

#include <stdbool.h>
#include <stddef.h>

/* ---- a growable byte buffer, NUL-terminated (tokenizer.c) ---- */

typedef struct tok_buf {
    char *p;
    size_t n, cap;
} tok_buf_t;

/* Appends s[0..n) and a NUL past it; AR_ERR when out of memory. */
int tok_buf_append(tok_buf_t *b, const void *s, size_t n);

/* ---- the Unigram model ---- */

typedef struct unigram unigram_t;

/* Builds the model over pieces[0..n) (NUL-terminated UTF-8, borrowed: they
 * must outlive the model) with scores[0..n) (copied). A piece listed twice
 * is looked up as its last id, as HF's map does. unk_id is -1 (none) or in
 * [0, n). Returns NULL and fills err (naming path) on failure. */
unigram_t *unigram_new(const char *const *pieces, const double *scores, int n, int unk_id,
                       bool byte_fallback, const char *path, ar_error_t *err);

void unigram_free(unigram_t *u);

/* Per-call scratch, grown as words need; zero-initialise, free with
 * unigram_scratch_free. One per thread. */
typedef struct unigram_scratch {
    void *nodes; /* best path ending at each byte */
    int *path;   /* token ends of the best path */
    size_t cap;  /* entries in each */
} unigram_scratch_t;

void unigram_scratch_free(unigram_scratch_t *sc);

/* One id of the path; unknown, when not NULL, is the text unknown[0..n) the
 * id stands for because no piece spells it (the unk id). */
typedef void (*unigram_emit_fn)(void *ctx, int id, const char *unknown, size_t n);

/* Segments the word s[0..n) (valid UTF-8) as HF's Unigram::tokenize does and
 * calls emit for each id: the best-scoring path, runs of unknown characters
 * fused into one unk (or their <0xAB> byte pieces with byte_fallback).
 * AR_ERR (err filled) if an unknown character needs unk_id and there is
 * none, or out of memory. */
int unigram_encode(const unigram_t *u, const char *s, size_t n, unigram_scratch_t *sc,
                   unigram_emit_fn emit, void *ctx, ar_error_t *err);

/* The JSON number p[0..n) as HF reads a score: serde_json's parser without
 * its float_roundtrip feature (a u64 of the leading digits times or over one
 * power of ten), which can be an ulp or two from the correctly rounded value
 * strtod gives. Viterbi ties between paths of equal pieces in another order
 * are decided by those ulps, so arserve reads scores the same way. AR_ERR if
 * it is not a number or out of f64 range. */
int unigram_score_parse(const char *p, size_t n, double *out);

/* ---- the precompiled charsmap (normalizer "Precompiled") ---- */

typedef struct charsmap charsmap_t;

/* Decodes and checks the base64 precompiled_charsmap (where: the JSON path,
 * for messages). NULL and err filled (naming path and where) if it is not
 * base64, too short, or its trie or normalised-string blob is malformed. */
charsmap_t *charsmap_load(const char *base64, const char *path, const char *where, ar_error_t *err);

void charsmap_free(charsmap_t *m);

/* Normalises s[0..n) (valid UTF-8) into a fresh *out (NUL-terminated,
 * *out_len bytes; the caller frees it), as HF's Precompiled does: per
 * extended grapheme cluster, the mapping of the cluster's shortest mapped
 * prefix when the cluster is under 6 bytes and has one, else each character
 * mapped or kept. origin: how many leading bytes of s stand at the
 * prompt's original offset 0 (HF's alignments; 0: none); *origin_out (may
 * be NULL): the same of the output, as HF aligns it: each kept or mapped
 * character takes the next input character's place (an inserted one the
 * last's), and a grapheme mapped to nothing before any output is not
 * recorded, so what follows takes its place. AR_ERR only when out of
 * memory. Thread-safe. */
int charsmap_normalize(const charsmap_t *m, const char *s, size_t n, char **out, size_t *out_len,
                       size_t origin, size_t *origin_out);

#endif
