#!/usr/bin/env python3
"""Golden data for the SentencePiece Unigram tokenizer in engine/format/tokenizer.c and
tokenizer_unigram.c: the ids and text Hugging Face `tokenizers` gives for a few thousand strings
through T5's real tokenizer.json and three layouts derived from it.
tests/unit/test_tokenizer_unigram.c checks arserve gives the same.

tests/golden/tokenizer/t5.json is T5's tokenizer.json, committed byte for byte as found: the
copy stable-diffusion.cpp (MIT) embeds for SD3's T5 text encoder (its embed/t5_tokenizer.json,
blob ab7243242a9d0aceb8015105347c00a216350124), which is HF transformers' conversion of T5's
SentencePiece model spiece.model (Apache-2.0, Google's T5): 32100 pieces (32000 scored pieces
and <extra_id_99>..<extra_id_0> at 32000..32099), unk_id 2, the nmt_nfkc precompiled charsmap
then Replace(Regex " {2,}" -> " "), Metaspace(replacement "▁", add_prefix_space true) as
pre-tokenizer and decoder, added tokens <pad>, </s>, <unk> and the 100 extra ids. t5-base,
t5-v1_1 and flan-t5 (Infinity's flan-t5-xl) ship the same SentencePiece model, so the same
pieces, scores and charsmap; their files differ only in the layout of the pre-tokenizer and
normalizer, which the derived layouts below cover.

Writes OUT/unigram_vectors.json (default OUT tests/golden/tokenizer/):

* "strings": the test strings (UTF-8 as "text", or invalid UTF-8 as "hex"): those of
  gen_tokenizer_vectors.py (the BPE suite's, same seed), plus strings that exercise the charsmap
  (its own keys: full-width letters, ligatures, composed and decomposed accents, control
  characters, keys with a shorter key as prefix, which HF maps by that prefix only), CJK,
  emoji, whitespace runs, leading and trailing spaces, characters T5 cannot spell, added tokens,
  long words and text-to-image prompts;
* "tokenizers": per layout, the file it is read from, a "patch" (a JSON object's text, kept as
  a string so that its numbers keep their digits: its members replace t5.json's, spliced in by
  the test before loading), and HF's ids (encode(text,
  add_special_tokens=False)), "dec" where decode(ids) is not the string itself and "dec_skip"
  where decode(ids, skip_special_tokens=True) differs from that. The layouts:
  - t5: the file as it is;
  - t5_whitespace_split: pre-tokenizer Sequence[WhitespaceSplit, Metaspace(add_prefix_space)],
    the older converter's layout;
  - t5_first_nosplit: normalizer Sequence[Precompiled, Strip(right), Replace(Regex " {2,}" ->
    "▁")] (today's converter), Metaspace(prepend_scheme "first", split false) as pre-tokenizer
    and decoder, as Llama-style files have;
  - t5_whitespace_split_first: T5's charsmap with pre-tokenizer Sequence[WhitespaceSplit,
    Metaspace(prepend_scheme "first")], where a character the charsmap drops after a word's
    first character must not mark that word's lead as dropped;
  - t5_bytes_never: T5's first 4000 pieces and the 256 <0xAB> byte pieces, byte_fallback true,
    no normalizer, WhitespaceSplit then Metaspace(prepend_scheme "never"); so unknown runs
    become their bytes.

Procedure to remake (deterministic; nothing here trains):

    .venv-bench/bin/python tests/golden/gen_tokenizer_unigram_vectors.py
    make build/tests/test_tokenizer_unigram && build/tests/test_tokenizer_unigram

then commit tests/golden/tokenizer/unigram_vectors.json. The committed files are what the tests
read; nothing in `make test` runs this script.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gen_tokenizer_vectors import random_word, test_strings  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

SEED = 20250705

METASPACE = {"type": "Metaspace", "replacement": "▁", "add_prefix_space": True}


def charsmap_keys(t5: dict) -> list[str]:
    """Every key of the precompiled charsmap's double-array trie, in trie order."""
    b64 = t5["normalizer"]["normalizers"][0]["precompiled_charsmap"]
    raw = base64.b64decode(b64)
    size = struct.unpack("<I", raw[:4])[0]
    units = struct.unpack("<%dI" % (size // 4), raw[4:4 + size])

    def offset(u: int) -> int:
        return (u >> 10) << ((u & (1 << 9)) >> 6)

    keys: list[bytes] = []
    stack = [(offset(units[0]), b"")]
    while stack:
        base, prefix = stack.pop()
        for c in range(1, 256):
            p = base ^ c
            if p < len(units) and (units[p] & ((1 << 31) | 0xFF)) == c:
                if (units[p] >> 8) & 1:
                    keys.append(prefix + bytes([c]))
                stack.append((p ^ offset(units[p]), prefix + bytes([c])))
    return [k.decode("utf-8") for k in keys]


def layouts(t5: dict) -> dict[str, dict]:
    precompiled = t5["normalizer"]["normalizers"][0]
    small_vocab = t5["model"]["vocab"][:4000]
    small_vocab += [["<0x%02X>" % b, -14.0 - b / 256] for b in range(256)]
    return {
        "t5": {},
        "t5_whitespace_split": {
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"},
                                                                    METASPACE]}},
        "t5_first_nosplit": {
            "normalizer": {"type": "Sequence", "normalizers": [
                precompiled, {"type": "Strip", "strip_left": False, "strip_right": True},
                {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "▁"}]},
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                              "split": False},
            "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                        "split": False}},
        "t5_whitespace_split_first": {
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "WhitespaceSplit"},
                {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}]}},
        "t5_bytes_never": {
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "WhitespaceSplit"},
                {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never"}]},
            "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never"},
            "added_tokens": t5["added_tokens"][:3],
            "model": {"type": "Unigram", "unk_id": 2, "vocab": small_vocab, "byte_fallback": True}},
    }


PROMPTS = [
    "a photo of a red cube on a wooden table",
    "A photo of a cat sitting on a windowsill, golden hour, 35mm film",
    "an astronaut riding a horse on the moon, digital art, highly detailed, 8k",
    "Two green triangles above a blue square, minimalist poster",
    "a close-up portrait of an old fisherman, wrinkles, dramatic lighting --ar 16:9",
    "Café Müller in Zürich at night; neon signs reading «OPEN 24/7»",
    "一只在草地上奔跑的小狗，水彩画风格",
    "東京の夜景、雨、ネオン",
    "Ein rotes Auto vor einem alten Schloss",
    "<extra_id_0> a painting of <extra_id_1> by Monet</s>",
]

UNKNOWN = ["☃", "😀", "🦖", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ꙮ", "𓂀", "ᚠᛇᚻ", "ⴰⵣⵓⵍ", "ሰላም", "ᏣᎳᎩ", "{", "}", "~", "<", "\\",
           "^", "`", "|"]
MARKS = ["\u0300", "\u0301", "\u0302", "\u0303", "\u0308", "\u030a", "\u0327", "\u0328", "\u0331",
         "\u0345", "\u05b7", "\u0e31", "\u093f", "\u094d", "\u200d", "\ufe0f", "\u20e3", "\u1160",
         "\u11a8", "\u302a"]
SPACING = [" ", "  ", "   ", "\t", "\n", "\r\n", "\r", "\u3000", "\u00a0", "\u2003", "\x0b", "\x0c",
           "\x85", "\u2028", " \t ", "\x01", "\x7f", "\u200b", "\ufeff"]
ADDED = ["<pad>", "</s>", "<unk>", "<extra_id_0>", "<extra_id_99>", "<extra_id_42>", "<extra_id_100>",
         "<extra_id_", "</s", "<s>"]


def unigram_strings(keys: list[str]) -> list[str]:
    rng = random.Random(SEED)
    short = [k for k in keys if len(k.encode()) <= 4]
    out = list(PROMPTS)
    out += [k for k in keys if ord(k[0]) < 0x80] + [k + "x" for k in keys if ord(k[0]) < 0x20]
    out += ["ﬁne ﬂow ﬀ", "ＡＢＣ ａｂｃ １２３", "①②③ ⅰⅱ Ⅻ", "㍿ ㌔ ㎏", "Å Å Å", "ｅ\u0301", "e\u0301\u0302",
            "A\u0302\u0300", "\r\n\r\n", "a\r\nb", " \u0301", "\u0301a", "ᄀ\u1161\u11a8", "각\u11a8",
            "1\ufe0f\u20e3", "🇫🇷🇩🇪", "👩🏾\u200d💻", "x" * 300, "abc" * 120, " " * 40 + "a" + " " * 40,
            "\t\t\tindented", "trailing\n\n", "  two leading", "\x01\x02start", "end\x01", "\u3000全角",
            "supercalifragilisticexpialidocious" * 3, "pneumonoultramicroscopicsilicovolcanoconiosis"]
    for _ in range(1200):  # charsmap keys among words, marks and spaces
        parts = []
        for _ in range(rng.randint(1, 10)):
            r = rng.random()
            if r < 0.35:
                parts.append(rng.choice(short if rng.random() < 0.7 else keys))
            elif r < 0.55:
                parts.append(random_word(rng))
            elif r < 0.65:
                parts.append(rng.choice("aeiouAEIOUnc") + rng.choice(MARKS) +
                             (rng.choice(MARKS) if rng.random() < 0.3 else ""))
            elif r < 0.75:
                parts.append(rng.choice(UNKNOWN) * rng.randint(1, 3))
            elif r < 0.8:
                parts.append(rng.choice(ADDED))
            else:
                parts.append(rng.choice(SPACING))
            if rng.random() < 0.5:
                parts.append(" ")
        out.append("".join(parts))
    for _ in range(60):  # long words: no spaces at all
        out.append("".join(rng.choice([random_word(rng), rng.choice(short)]) for _ in range(40)))
    # Characters the charsmap normalises to nothing (soft hyphen, zero-width
    # ones) after a word's first character, and alone: with prepend_scheme
    # "first" only the first word's dropped lead matters.
    for z in ("\u00ad", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u180e"):
        out += [f"a{z}b", f"cat{z} dog", f"x{z}", f"{z}", f" a{z}", f"ab{z}{z}c d{z}e",
                f"{z}word next", f"red{z}\u0301 cube"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/golden/tokenizer")
    args = ap.parse_args()
    t5_path = os.path.join(args.out, "t5.json")
    with open(t5_path, encoding="utf-8") as f:
        t5 = json.load(f)
    specials = ["<pad>", "</s>", "<unk>", "<extra_id_0>", "<extra_id_99>"]
    strings = test_strings(specials)
    seen = set(strings)
    for s in unigram_strings(charsmap_keys(t5)):
        b = s.encode()
        if b not in seen and b"\x00" not in b:
            seen.add(b)
            strings.append(b)
    doc: dict = {"strings": [], "tokenizers": {}}
    texts = []
    for b in strings:
        try:
            doc["strings"].append({"text": b.decode("utf-8")})
        except UnicodeDecodeError:
            doc["strings"].append({"hex": b.hex()})
        texts.append(b.decode("utf-8", errors="replace"))
    for name, patch in layouts(t5).items():
        j = dict(t5)
        j.update(patch)
        tok = Tokenizer.from_str(json.dumps(j, ensure_ascii=False))
        entry: dict = {"file": "t5.json", "patch": json.dumps(patch, ensure_ascii=False), "ids": [],
                       "dec": {}, "dec_skip": {}}
        for i, text in enumerate(texts):
            ids = tok.encode(text, add_special_tokens=False).ids
            entry["ids"].append(ids)
            dec = tok.decode(ids, skip_special_tokens=False)
            if dec != text:
                entry["dec"][str(i)] = dec
            dec_skip = tok.decode(ids, skip_special_tokens=True)
            if dec_skip != dec:
                entry["dec_skip"][str(i)] = dec_skip
        doc["tokenizers"][name] = entry
    path = os.path.join(args.out, "unigram_vectors.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    n_ids = sum(len(x) for e in doc["tokenizers"].values() for x in e["ids"])
    print(f"{len(texts)} strings x {len(doc['tokenizers'])} layouts, {n_ids} ids -> {path}")


if __name__ == "__main__":
    main()
