/* Text <-> token ids from a Hugging Face tokenizer.json: WordLevel and BPE
 * models (byte-level BPE as in GPT-2 and Janus-Pro / DeepSeek-LLM) and
 * SentencePiece Unigram (T5 / flan-t5, Infinity's text encoder; the model
 * and its charsmap live in tokenizer_unigram.c). The supported pieces, and
 * where we knowingly differ from HF `tokenizers`, are listed below;
 * tests/unit/test_tokenizer_bpe.c and test_tokenizer_unigram.c check
 * thousands of strings against HF. */
#ifndef ARSERVE_TOKENIZER_H
#define ARSERVE_TOKENIZER_H

#include "base/status.h"

#include <stdbool.h>
#include <stddef.h>

/* Ids must lie in [0, TOKENIZER_MAX_ID]; a larger one is a load error (it
 * would make the id -> text table absurdly large). */
#define TOKENIZER_MAX_ID ((1 << 24) - 1)

/* What tokenizer_load accepts:
 *  - model: {"type": "WordLevel", "vocab": {word: id}, "unk_token": str|null}:
 *    a word missing from vocab becomes unk_token's id if unk_token is in
 *    vocab, else an encoding error. Or {"type": "BPE", "vocab", "merges",
 *    "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
 *    "fuse_unk", "byte_fallback", "ignore_merges", "dropout"}: merges as
 *    "left right" strings or ["left", "right"] pairs, ranked by position (a
 *    repeated pair keeps its last rank, as in HF); both parts and their
 *    concatenation (less the right part's continuing_subword_prefix) must be
 *    in vocab. dropout must be null or 0 (dropout is random). prefix and
 *    suffix up to 32 bytes. As in HF, a character that is not in vocab
 *    becomes its <0xAB> byte tokens (byte_fallback), else unk_token (runs
 *    fused with fuse_unk), else is dropped; an unk_token missing from vocab
 *    is an encoding error when it is needed. Merging is HF's: lowest rank
 *    first, leftmost among equals, with a heap over the word's symbols, so a
 *    word of n characters costs O(n log n) and at most 3n heap entries.
 *    Or {"type": "Unigram", "vocab": [[piece, score], ...], "unk_id": id or
 *    null, "byte_fallback"}: ids are positions in vocab (a piece listed twice
 *    is looked up as its last id, as in HF); unk_id out of range, a score
 *    that is not a number, an item that is not a pair are load errors. Each
 *    word is segmented as HF's Unigram does (encode_optimized): Viterbi over
 *    every piece starting at each character, found with a byte trie, so a
 *    word of n bytes costs O(n * longest piece); a character no piece spells
 *    alone scores min(score) - 10 as unk; a later candidate replaces an
 *    earlier one only if strictly better, so on ties the path whose last
 *    piece starts first wins; consecutive unks fuse into one; a fused run
 *    becomes its <0xAB> pieces with byte_fallback, else unk_id (without
 *    unk_id: an encoding error, as HF's MissingUnkId). Scores are read from
 *    the file's digits as HF's serde_json reads them (not correctly rounded:
 *    ties between the same pieces in another order depend on those ulps).
 *    Other types (WordPiece) are load errors.
 *  - normalizer: null, Lowercase, Strip, NFC, Replace, Prepend, Precompiled,
 *    or a Sequence of these. Lowercase folds ASCII and Latin-1
 *    letters (U+00C0..U+00DE); other scripts are left alone (HF folds all of
 *    Unicode). NFC is accepted and does nothing: it is the identity on ASCII
 *    and on text already composed; decomposed input (e + U+0301) would differ
 *    from HF. Replace's pattern is a String or a Regex (PCRE2, as for Split
 *    below; T5's collapses " {2,}"). Precompiled: SentencePiece's
 *    precompiled_charsmap (base64 of a u32 trie size, a Darts double-array
 *    trie and NUL-terminated replacements; a bad base64, size or non-UTF-8
 *    blob is a load error, and so is an empty trie, on which HF would panic
 *    when encoding), applied as HF's spm_precompiled does: per extended
 *    grapheme cluster, a cluster under 6 bytes is replaced by the mapping of
 *    its *shortest* mapped prefix (the rest of the cluster is dropped: HF's
 *    quirk, kept), else each character is mapped or kept. Clusters are
 *    PCRE2's \X (10.42: Unicode 14, without Unicode 15.1's Indic conjunct
 *    rule GB9c): a cluster HF's unicode-segmentation draws differently
 *    (characters assigned after Unicode 14, Devanagari conjuncts) may
 *    normalise differently. NFD, NFKC, ... are load errors.
 *  - pre_tokenizer: null (the whole text is one word), or a Sequence of:
 *    Split ({"String": s} or {"Regex": r}; behavior Removed, Isolated,
 *    MergedWithPrevious, MergedWithNext or Contiguous; invert), Whitespace
 *    (HF's \w+|[^\w\s]+ with Oniguruma's Unicode \w), WhitespaceSplit,
 *    Digits (individual_digits; "digit" is Unicode N, as char::is_numeric),
 *    ByteLevel (add_prefix_space, per piece as in HF; use_regex: the GPT-2
 *    regex; then each byte as its GPT-2 character). Regexes run on PCRE2
 *    with UTF and UCP, ^ and $ matching at line ends as in Oniguruma's Ruby
 *    syntax; compiled once at load (JIT where available). A regex that can
 *    match the empty string is a load error (HF's splits around empty
 *    matches are not followed). PCRE2's Unicode tables (10.42: Unicode 14)
 *    may differ from Oniguruma's on characters assigned since, and PCRE2's
 *    \s also matches U+180E. Metaspace (replacement, one character;
 *    prepend_scheme "always", "first" or "never"; legacy add_prefix_space,
 *    false meaning "never"; split, default true): spaces become the
 *    replacement, which is prepended unless the piece starts with it
 *    ("always": every piece, so also the text after an added token as in
 *    HF; "first": only a piece at the prompt's offset 0), then with split a
 *    piece begins at each replacement. For "first", HF asks the piece's
 *    offset in the original text as HF's alignments give it; arserve follows
 *    them across the normalizers it has: a first character stripped or
 *    replaced by nothing moves it; a Precompiled charsmap's mappings keep
 *    their characters at the offset of what they replaced (inserted ones at
 *    the last's), and one of a leading character to nothing is not recorded
 *    by HF, so what follows stays at 0 (checked against HF with
 *    WhitespaceSplit before Metaspace "first"); not through ByteLevel or
 *    Prepend placed before it.
 *  - added_tokens: [{id, content, special, normalized, single_word, lstrip,
 *    rstrip}], booleans optional (normalized defaults to !special). As in HF,
 *    tokens with normalized=false are split out of the raw text before
 *    normalisation, the others out of the normalised text; the longest
 *    match at the leftmost position wins. Their ids must be those HF would
 *    give: the vocab's id if the content is in vocab, else the ids that follow
 *    the vocab, in file order.
 *  - decoder (tokenizer_decode only): null (tokens joined with spaces, as HF
 *    does without a decoder), ByteLevel (each token's characters mapped back
 *    to bytes, a token with any other character kept as it is), BPEDecoder
 *    (suffix becomes a space, nothing at the end), Metaspace (each
 *    replacement becomes a space; in the first token kept every one is
 *    dropped unless prepend_scheme is "never", as in HF). Any other type loads, and
 *    tokenizer_decode refuses it. Added tokens with normalized=true decode
 *    as their normalised content, as in HF.
 *  - post_processor, truncation, padding: ignored (the caller adds BOS and
 *    enforces its own length limit; for T5 the caller appends </s>, which
 *    HF's TemplateProcessing would add).
 * T5's tokenizer.json (Precompiled then Replace " {2,}" -> " ", Metaspace
 * with add_prefix_space as pre-tokenizer and decoder, Unigram, the added
 * tokens <pad>, </s>, <unk>, <extra_id_0..99>) is supported whole:
 * tokenizer_encode gives HF's encode(text, add_special_tokens=False).ids.
 * Input text may be any bytes: invalid UTF-8 is first made valid by replacing
 * each maximal ill-formed subsequence with U+FFFD, exactly as Python's
 * bytes.decode("utf-8", errors="replace"), so raw bytes tokenise as HF does
 * on the decoded string. Decoding replaces byte sequences that are not UTF-8
 * the same way (HF's from_utf8_lossy). */

typedef struct tokenizer tokenizer_t;

/* Reads and validates the tokenizer.json at path. Returns NULL and fills err
 * with a message naming the file and the problem on any error. */
tokenizer_t *tokenizer_load(const char *path, ar_error_t *err);

/* Frees t; NULL is fine. */
void tokenizer_free(tokenizer_t *t);

/* Encodes text into ids[0..*n_ids). Returns AR_OK, or AR_ERR: with *n_ids
 * the count needed (> max_ids) if more than max_ids ids would be needed
 * ("prompt is N tokens, more than the limit M"; ids[0..max_ids) written),
 * with *n_ids = 0 if a word is unknown and there is no unk token.
 * Thread-safe: t is not modified. */
int tokenizer_encode(const tokenizer_t *t, const char *text, int *ids, int max_ids, int *n_ids,
                     ar_error_t *err);

/* What of text (encoded as tokenizer_encode does) no token spells: words a
 * WordLevel vocabulary lacks, characters a Unigram or BPE model reads as its
 * unknown token or drops; characters in a row are one piece. Writes them
 * quoted, each once, "'cat', 'sofa'", into out (cap >= 8 bytes; ", ..."
 * when more do not fit) and returns how many distinct pieces there are
 * (0: the model reads all of it), or -1 with err filled. Byte-fallback
 * pieces are spelled, so not listed. Thread-safe. */
int tokenizer_unknown(const tokenizer_t *t, const char *text, char *out, size_t cap,
                      ar_error_t *err);

/* Decodes ids[0..n_ids) into out (cap bytes, NUL-terminated), as HF's
 * tokenizer.decode(ids, skip_special_tokens=skip_special) does with the
 * decoder the file declares (see above); *len (if not NULL) gets the text's
 * length in bytes, also when it does not fit. Returns AR_ERR if an id is not
 * a token, the decoder is not supported, or the text and its NUL do not fit
 * in cap. Thread-safe. */
int tokenizer_decode(const tokenizer_t *t, const int *ids, int n_ids, bool skip_special, char *out,
                     size_t cap, size_t *len, ar_error_t *err);

/* The id of an added token or vocab word (added tokens first); -1 if absent. */
int tokenizer_token_id(const tokenizer_t *t, const char *token);

/* A WordLevel model's words, the whole of what it reads (its vocabulary but
 * the special tokens and the unknown one), in id order, into words[0..cap)
 * (pointers live as long as t); returns how many there are. 0 for BPE and
 * Unigram models, whose pieces spell open text. */
int tokenizer_words(const tokenizer_t *t, const char **words, int cap);

/* 1 + the largest id of any vocab word or added token. */
int tokenizer_vocab_size(const tokenizer_t *t);

/* The text of id (added token or vocab word), NULL if no token has that id.
 * For logs and tests; the pointer lives as long as t. */
const char *tokenizer_token_text(const tokenizer_t *t, int id);

#endif
