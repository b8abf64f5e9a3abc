/* Text -> token ids from a Hugging Face tokenizer.json. Word-level models only
 * for now; the supported pieces, and where we knowingly differ from HF
 * `tokenizers` on non-ASCII text, are listed below. */
#ifndef ARSERVE_TOKENIZER_H
#define ARSERVE_TOKENIZER_H

#include "status.h"

/* Ids must lie in [0, TOKENIZER_MAX_ID]; a larger one is a load error (it
 * would make the id -> text table absurdly large). */
#define TOKENIZER_MAX_ID ((1 << 24) - 1)

/* What tokenizer_load accepts:
 *  - model: {"type": "WordLevel", "vocab": {word: id}, "unk_token": str|null}.
 *    Any other type (BPE, Unigram, WordPiece) is an error. A word missing from
 *    vocab becomes unk_token's id if unk_token is in vocab, else an error.
 *  - normalizer: null, Lowercase, Strip, NFC, or a Sequence of these.
 *    Lowercase folds ASCII and Latin-1 letters (U+00C0..U+00DE); other
 *    scripts are left alone (HF folds all of Unicode). NFC is accepted and
 *    does nothing: it is the identity on ASCII and on text already composed;
 *    decomposed input (e + U+0301) would differ from HF.
 *  - pre_tokenizer: null (the whole text is one word), WhitespaceSplit, or
 *    Whitespace (HF's regex \w+|[^\w\s]+). Whitespace is ASCII whitespace plus
 *    the Unicode White_Space characters (U+00A0, U+3000, ...); every other
 *    byte >= 0x80 counts as a word character, so non-ASCII punctuation such
 *    as U+2014 stays inside the word where HF would split it off.
 *  - added_tokens: [{id, content, special, normalized, single_word, lstrip,
 *    rstrip}], booleans optional (normalized defaults to !special). As in HF,
 *    tokens with normalized=false are split out of the raw text before
 *    normalisation, the others out of the normalised text; the longest
 *    match at the leftmost position wins. Their ids must be those HF would
 *    give: the vocab's id if the content is in vocab, else the ids that follow
 *    the vocab, in file order.
 *  - post_processor, decoder, truncation, padding: ignored (the caller adds
 *    BOS and enforces its own length limit).
 * Input text may be any bytes; invalid UTF-8 is tokenised as-is. */

typedef struct tokenizer tokenizer_t;

/* Reads and validates the tokenizer.json at path. Returns NULL and fills err
 * with a message naming the file and the problem on any error. */
tokenizer_t *tokenizer_load(const char *path, ar_error_t *err);

/* Frees t; NULL is fine. */
void tokenizer_free(tokenizer_t *t);

/* Encodes text into ids[0..*n_ids). Returns AR_OK, or AR_ERR (with *n_ids = 0)
 * if more than max_ids ids would be needed ("prompt is N tokens, more than the
 * limit M") or a word is unknown and there is no unk token. Thread-safe: t is
 * not modified. */
int tokenizer_encode(const tokenizer_t *t, const char *text, int *ids, int max_ids, int *n_ids,
                     ar_error_t *err);

/* The id of an added token or vocab word (added tokens first); -1 if absent. */
int tokenizer_token_id(const tokenizer_t *t, const char *token);

/* 1 + the largest id of any vocab word or added token. */
int tokenizer_vocab_size(const tokenizer_t *t);

/* The text of id (added token or vocab word), NULL if no token has that id.
 * For logs and tests; the pointer lives as long as t. */
const char *tokenizer_token_text(const tokenizer_t *t, int id);

#endif
