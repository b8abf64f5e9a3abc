"""tokenizer.json files in the layout the releases ship, built by hand so that their bytes do
not depend on which libraries are installed: Janus-Pro's byte-level BPE (DeepSeek-LLM's five
Split pre-tokenizers, Digits, ByteLevel; special tokens as added tokens at fixed ids) and
flan-t5's Unigram (Metaspace, `</s>` appended, `<extra_id_N>` added tokens)."""

from __future__ import annotations

import json

# DeepSeek-LLM's pre-tokenizer regexes (tests/golden/gen_tokenizer_vectors.py has the same list)
JANUS_SPLITS = [
    '[\r\n]',
    '\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+',
    '\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+',
    '\\s+$',
    '[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+',
]

BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
PAD = "<\uff5c\u2581pad\u2581\uff5c>"
JANUS_ADDITIONAL = ["<image_placeholder>", "<patch_placeholder>", "<|ref|>", "<|/ref|>", "<|det|>",
                    "<|/det|>", "<|grounding|>", "<|User|>", "<|Assistant|>"]

# Janus-Pro's special-token ids in the full-size vocabulary. 100000/100001 (BOS/EOS) are
# DeepSeek-LLM's, 100015 is the pad id Janus code hard-codes, 100581 is transformers'
# JanusConfig.image_token_id; the others are not confirmed (see README.md).
JANUS_IDS = {BOS: 100000, EOS: 100001, PAD: 100015, "<begin_of_image>": 100016,
             "<end_of_image>": 100017, **{s: 100581 + i for i, s in enumerate(JANUS_ADDITIONAL)}}


def bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character table that ByteLevel uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _bpe(n_vocab: int):
    """A valid byte-level BPE of exactly n_vocab tokens: the 256 byte symbols, then two-symbol
    merges (letters and the space symbol first), then three-symbol merges of the first pairs."""
    sym = bytes_to_unicode()
    alphabet = [sym[b] for b in range(256)]
    common = [sym[b] for b in b" etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789.,'-"]
    rank = {c: i for i, c in enumerate(common)}
    order = sorted(alphabet, key=lambda c: (rank.get(c, len(common)), ord(c)))
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    pairs = ((a, b) for a in order for b in order)
    for a, b in pairs:
        if len(vocab) >= n_vocab:
            break
        vocab[a + b] = len(vocab)
        merges.append(f"{a} {b}")
    firsts = [a + b for a in order[:64] for b in order[:64]]
    for ab in firsts:
        for c in order:
            if len(vocab) >= n_vocab:
                break
            if ab + c not in vocab:
                vocab[ab + c] = len(vocab)
                merges.append(f"{ab} {c}")
        if len(vocab) >= n_vocab:
            break
    return vocab, merges


def _added(content, i, special=True):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": not special, "special": special}


def janus_tokenizer(n_bpe: int, special_ids: dict) -> str:
    """tokenizer.json text. special_ids: token -> id (ids >= n_bpe); ids between them that no
    named token takes are filled with reserved placeholders so the id range has no holes."""
    vocab, merges = _bpe(n_bpe)
    by_id = {i: s for s, i in special_ids.items()}
    top = max(by_id)
    added = []
    for i in range(n_bpe, top + 1):
        if i in by_id:
            added.append(_added(by_id[i], i))
        else:
            added.append(_added(f"<\uff5cplace\u2581holder\u2581no\u2581{i - n_bpe}\uff5c>", i))
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": []},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers":
                          [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
                           for r in JANUS_SPLITS]
                          + [{"type": "Digits", "individual_digits": True},
                             {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": False}]},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                                    {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": BOS, "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 0}}],
                           "special_tokens": {BOS: {"id": BOS, "ids": [special_ids[BOS]], "tokens": [BOS]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": merges},
    }
    return json.dumps(tok, ensure_ascii=False, indent=2)


def t5_tokenizer(n_pieces: int, n_extra: int) -> str:
    """flan-t5's layout: Unigram over `<pad>` 0, `</s>` 1, `<unk>` 2 and n_pieces - 3 pieces,
    then `<extra_id_{n_extra-1}>` .. `<extra_id_0>` as added tokens. Pieces are the printable
    ASCII characters (with and without the '▁' word marker), then letter bigrams and trigrams,
    scored by length so that longer pieces win. The real file's Precompiled normalizer
    (sentencepiece's NFKC charsmap) is left out: only the Replace of runs of spaces is kept."""
    chars = [chr(c) for c in range(33, 127)]
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    pieces = [["<pad>", 0.0], ["</s>", 0.0], ["<unk>", 0.0], ["\u2581", -2.0]]
    cands = [("\u2581" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    cands += [("\u2581" + a + b, -5.0 - 0.01 * i) for i, (a, b) in enumerate((a, b) for a in letters for b in letters)]
    cands += [(a + b, -6.0 - 0.01 * i) for i, (a, b) in enumerate((a, b) for a in letters for b in letters)]
    cands += [("\u2581" + a + b + c, -7.0 - 0.001 * i)
              for i, (a, b, c) in enumerate((a, b, c) for a in letters for b in letters for c in letters)]
    cands += [(a + b + c, -8.0 - 0.001 * i)
              for i, (a, b, c) in enumerate((a, b, c) for a in letters for b in letters for c in letters)]
    k = 0
    while len(pieces) < n_pieces:
        if k < len(cands):
            pieces.append([cands[k][0], round(cands[k][1], 4)])
        else:  # past the generated pieces: four-letter words, rarer still
            w = "".join(letters[(k >> s) % 26] for s in (0, 5, 10, 15))
            pieces.append(["\u2581" + w, -12.0])
        k += 1
    added = [_added(p, i) for i, p in enumerate(("<pad>", "</s>", "<unk>"))]
    added += [_added(f"<extra_id_{n_extra - 1 - j}>", n_pieces + j) for j in range(n_extra)]
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"Sequence": {"id": "A", "type_id": 0}},
                                      {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": "</s>", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 0}},
                                    {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                           "special_tokens": {"</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}},
        "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        "model": {"type": "Unigram", "unk_id": 2, "vocab": pieces, "byte_fallback": False},
    }
    return json.dumps(tok, ensure_ascii=False, indent=2)


def check_with_library(text: str, expect: dict) -> str | None:
    """Loads text with the `tokenizers` library when it is installed and checks the given
    token -> id pairs; returns a problem, or None (also when the library is absent)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    tok = Tokenizer.from_str(text)
    for s, i in expect.items():
        if tok.token_to_id(s) != i:
            return f"the tokenizers library reads {s!r} as id {tok.token_to_id(s)}, expected {i}"
    return None
