#!/usr/bin/env python3
"""Golden data for engine/format/tokenizer.c's byte-level BPE: small tokenizers trained with the PyPI
`tokenizers` library (the one Hugging Face models ship for) and the ids and text it gives for a
few thousand strings. tests/unit/test_tokenizer_bpe.c checks arserve gives the same.

Writes OUT (default tests/golden/tokenizer/):

* janus.json: the JSON layout, normalizer, pre_tokenizer (five Splits, Digits with individual
  digits, ByteLevel without its regex), decoder and special tokens of Janus-Pro's tokenizer.json
  (DeepSeek-LLM's), with a small vocab trained here;
* gpt2.json: GPT-2's setup, ByteLevel(add_prefix_space=false, use_regex=true) as pre-tokenizer
  and decoder;
* digits.json: Digits(individual_digits=true) then ByteLevel(add_prefix_space=true) with the
  GPT-2 regex, and merges written as "a b" strings (the older format);
* mixed.json: Split with String and Regex patterns and every behaviour (invert too), Digits
  with runs, normalizers Replace and Prepend, ignore_merges, and added tokens both special and
  normal (lstrip, rstrip, single_word);
* classic.json: a character-level BPE (no ByteLevel) with Whitespace, unk_token and fuse_unk,
  continuing_subword_prefix and end_of_word_suffix, and the BPEDecoder;
* vectors.json: the strings (UTF-8 as "text", or invalid UTF-8 as "hex") and, per tokenizer,
  HF's ids (encode(..., add_special_tokens=False)) and, where it is not the string itself, HF's
  decode(ids) ("dec"; "dec_skip" where skip_special_tokens=True differs). For invalid UTF-8 the
  expected ids are HF's on bytes.decode("utf-8", errors="replace").

Procedure to remake (deterministic: fixed seed, single-threaded training):

    RAYON_NUM_THREADS=1 .venv-tools/bin/python tests/golden/gen_tokenizer_vectors.py
    make build/tests/test_tokenizer_bpe && build/tests/test_tokenizer_bpe

then commit tests/golden/tokenizer/. The committed files are what the tests read; nothing
in `make test` runs this script. janus, gpt2, digits and mixed come out byte for byte the
same on every run; classic (a character-level alphabet) does not: HF's trainer breaks ties
between equally frequent characters and pairs in hash order there, so a rerun gives another,
equally valid, classic.json and its ids.
"""

from __future__ import annotations

import argparse
import json
import os
import random

os.environ.setdefault("RAYON_NUM_THREADS", "1")

from tokenizers import (  # noqa: E402
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

SEED = 20250704

# Janus-Pro's (DeepSeek-LLM's) pre-tokenizer regexes, in order, each a Split(Isolated).
JANUS_SPLITS = [
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",  # noqa: E501,RUF001
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",  # noqa: RUF001
    "\\s+$",
    "[一-龥ࠀ-一가-퟿]+",
]
JANUS_SPECIALS = [
    "<｜begin▁of▁sentence｜>",  # noqa: RUF001
    "<｜end▁of▁sentence｜>",  # noqa: RUF001
    "<｜▁pad▁｜>",  # noqa: RUF001
    "<image_placeholder>",
    "<begin_of_image>",
    "<end_of_image>",
]

# ---- text generators -------------------------------------------------------------------

ASCII_WORDS = (
    "a red circle on the left two green triangles above blue square below small large "
    "image of picture photo with and or not it's don't we're they've I'm you'll he'd "
    "Hello World HTTP JSON arserve tokenizer Janus-Pro BPE x y z the quick brown fox jumps "
    "over lazy dog 3D e-mail U.S.A. co-op naïve résumé"
).split()
ACCENTED = "café naïve Ångström Straße ÉCOLE garçon São Paulo Zürich façade jalapeño Øre æther œuvre".split()
DECOMPOSED = ["e\u0301", "cafe\u0301", "n\u0303o", "A\u030a", "u\u0308ber", "i\u0307", "a\u0328\u0301"]
GREEK_CYRILLIC = "καλημέρα κόσμε ΑΒΓ λόγος привет мир Москва ЁЖИК україна ґанок".split()
CJK = list("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济喜离虽坐集编宝谈府拉黑且随格尽剑讲布杀微怕母调局根曾准团段终乐切级克精哪官示冷域读")
KANA = list("あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコサシスセソタチツテトナニヌネノ")
HANGUL = "안녕하세요 세계 한국어 토크나이저 그림 빨간 원 왼쪽 두 개의 초록 삼각형".split()
EMOJI = ["😀", "👍", "👍🏽", "👨\u200d👩\u200d👧", "🏳️\u200d🌈", "🇫🇷", "❤️", "🎨", "🖼️", "🔴", "🟢", "✨",
         "👩🏾\u200d💻"]
PUNCT = list(".,;:!?-()[]{}'\"/\\@#$%^&*_+=<>|`~") + list("。、！？（）「」—–…·«»“”‘’")
DIGIT_RUNS = ["0", "7", "42", "123", "2024", "3.14", "1,000,000", "007", "１２３", "٣٤٥", "²", "½", "Ⅻ",
              "9999999999"]
SPACES = [" ", " ", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", "\u3000", "\u00a0", " \t ", "\u2003",
          "\r"]


def random_word(rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.35:
        return rng.choice(ASCII_WORDS)
    if pick < 0.45:
        return rng.choice(ACCENTED)
    if pick < 0.48:
        return rng.choice(DECOMPOSED)
    if pick < 0.56:
        return rng.choice(GREEK_CYRILLIC)
    if pick < 0.66:
        return "".join(rng.choice(CJK) for _ in range(rng.randint(1, 6)))
    if pick < 0.70:
        return "".join(rng.choice(KANA) for _ in range(rng.randint(1, 5)))
    if pick < 0.76:
        return rng.choice(HANGUL)
    if pick < 0.82:
        return rng.choice(EMOJI)
    if pick < 0.90:
        return rng.choice(DIGIT_RUNS)
    return "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 3)))


def random_text(rng: random.Random, specials: list[str], max_words: int = 12) -> str:
    parts = []
    for _ in range(rng.randint(1, max_words)):
        parts.append(random_word(rng))
        r = rng.random()
        if r < 0.7:
            parts.append(" ")
        elif r < 0.85:
            parts.append(rng.choice(SPACES))
        elif r < 0.9 and specials:
            parts.append(rng.choice(specials))
    text = "".join(parts)
    if rng.random() < 0.2:
        text = rng.choice(SPACES) + text
    if rng.random() < 0.3:
        text = text.rstrip(" ")
    return text


def training_corpus(n: int) -> list[str]:
    rng = random.Random(SEED)
    return [random_text(rng, []) for _ in range(n)]


INVALID_PIECES = [
    b"\xff", b"\xfe", b"\x80", b"\xbf", b"\xc0\xaf", b"\xc1\xbf", b"\xc3", b"\xe2\x82", b"\xe0\x80\x80",
    b"\xe0\x9f\xbf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf0\x9f\x98", b"\xf0\x80\x80\x80",
    b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xc3\x28", b"\xe2\x28\xa1",
    b"\xf0\x28\x8c\x28", b"\x80\x80\x80", b"\xc2", b"\xef\xbf\xbf", b"\xf4\x8f\xbf\xbf",
]


def test_strings(specials: list[str]) -> list[bytes]:
    rng = random.Random(SEED + 1)
    out: list[str | bytes] = []
    fixed = [
        "", " ", "  ", "a", "Hello world", "Hello, world!", " leading", "trailing ", "trailing   ",
        "a\r\nb", "\r\n", "\t\ttab", "x\u3000y", "x\u00a0y", "\u3000\u3000", "can't won't it's",
        "12345678901234567890", "3.14159", "１２３４", "v2.0.1-rc3", "#1 100% $5", "e\u0301",
        "👨\u200d👩\u200d👧\u200d👦", "🏳️\u200d🌈 flag", "中文字符测试", "한국어 텍스트", "日本語のテキスト",
        "Ελληνικά", "Русский текст", "mixed中文English123", "\n\n\n", " \n ", "a  \n  b",
        "\u0301", "\u200b", "\u2028\u2029", "\ufeffBOM", "\U0001d400\U0001d401", "\u00b5\u00df",
        "word" * 60, "x" * 500, "中" * 100, "😀" * 40, " " * 300, "1" * 60, "a b " * 40, "\t" * 50,
    ]
    for s in specials:
        fixed += [s, "a" + s + "b", " " + s + " ", s + s, "text " + s + " more"]
    out += fixed
    for _ in range(2000):
        out.append(random_text(rng, specials, 7))
    for _ in range(40):  # long words
        out.append("".join(random_word(rng) for _ in range(rng.randint(5, 30))))
    for _ in range(260):  # invalid UTF-8
        parts = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.5:
                parts.append(rng.choice(INVALID_PIECES))
            else:
                parts.append(random_word(rng).encode())
            if rng.random() < 0.3:
                parts.append(b" ")
        out.append(b"".join(parts))
    for _ in range(40):  # random bytes, no NUL
        out.append(bytes(rng.randint(1, 255) for _ in range(rng.randint(1, 24))))
    seen = set()
    result = []
    for s in out:
        b = s.encode() if isinstance(s, str) else s
        if b in seen or b"\x00" in b:
            continue
        seen.add(b)
        result.append(b)
    return result


# ---- tokenizers ------------------------------------------------------------------------------


def train(tok: Tokenizer, vocab_size: int, corpus: list[str], byte_level: bool,
          **kw) -> Tokenizer:
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [],
        **kw,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def make_janus(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in JANUS_SPLITS]
        + [pre_tokenizers.Digits(individual_digits=True),
           pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    train(tok, 2000, corpus, True)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in JANUS_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single=JANUS_SPECIALS[0] + " $A", pair=JANUS_SPECIALS[0] + " $A " + JANUS_SPECIALS[0] + " $B",
        special_tokens=[(JANUS_SPECIALS[0], tok.token_to_id(JANUS_SPECIALS[0]))])
    return tok


def make_gpt2(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    train(tok, 1200, corpus, True)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return tok


def make_digits(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    train(tok, 800, corpus, True)
    return tok


def make_mixed(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.normalizer = normalizers.Sequence([normalizers.Replace("``", '"'), normalizers.Replace("\t", "  "),
                                           normalizers.Prepend("~")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[\r\n]+"), behavior="removed"),
        pre_tokenizers.Split("-", behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"\p{P}"), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"\p{Han}"), behavior="contiguous"),
        pre_tokenizers.Split(Regex(r"\S+"), behavior="isolated", invert=True),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    train(tok, 1000, corpus, True)
    tok.add_tokens([AddedToken("square", single_word=True), AddedToken("[img]", lstrip=True, rstrip=True),
                    AddedToken("café")])
    tok.add_special_tokens([AddedToken("<|sep|>", special=True, normalized=False, lstrip=True),
                            AddedToken("<img>", special=True, normalized=False, rstrip=True)])
    return tok


def make_classic(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]", fuse_unk=True, continuing_subword_prefix="##",
                               end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    train(tok, 1500, corpus, False, special_tokens=["[UNK]"], limit_alphabet=300,
          continuing_subword_prefix="##", end_of_word_suffix="</w>")
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/golden/tokenizer")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    corpus = training_corpus(20000)
    toks = {
        "janus": make_janus(corpus),
        "gpt2": make_gpt2(corpus),
        "digits": make_digits(corpus),
        "mixed": make_mixed(corpus),
        "classic": make_classic(corpus),
    }
    specials = JANUS_SPECIALS + ["<|endoftext|>", "<|sep|>", "<img>", "[img]", "square", "café", "``"]
    strings = test_strings(specials)
    doc: dict = {"strings": [], "tokenizers": {}}
    texts = []
    for b in strings:
        try:
            doc["strings"].append({"text": b.decode("utf-8")})
        except UnicodeDecodeError:
            doc["strings"].append({"hex": b.hex()})
        texts.append(b.decode("utf-8", errors="replace"))
    for name, tok in toks.items():
        path = os.path.join(args.out, name + ".json")
        tok.save(path, pretty=False)
        if name == "digits":  # the older merges format: "a b" strings
            with open(path, encoding="utf-8") as f:
                j = json.load(f)
            j["model"]["merges"] = [" ".join(m) for m in j["model"]["merges"]]
            with open(path, "w", encoding="utf-8") as f:
                json.dump(j, f, ensure_ascii=False, separators=(",", ":"))
        tok = Tokenizer.from_file(path)  # what the file says, not what we built
        entry: dict = {"file": name + ".json", "ids": [], "dec": {}, "dec_skip": {}}
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
    with open(os.path.join(args.out, "vectors.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    n_ids = sum(len(x) for e in doc["tokenizers"].values() for x in e["ids"])
    print(f"{len(texts)} strings x {len(toks)} tokenizers, {n_ids} ids -> {args.out}")


if __name__ == "__main__":
    main()
