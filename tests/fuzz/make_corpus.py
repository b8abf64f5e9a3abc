#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/) and
regression inputs (tests/fuzz/regressions/<target>/) from the repository's own
files and the hand-made shapes below. The files are committed; rerun this
after changing it:  python3 tests/fuzz/make_corpus.py

Seeds are small valid inputs of each parser (real examples where the
repository has them). Regressions are the hostile shapes each parser must
refuse without a crash: the cJSON CVE-2023-53154 trailing comma at the end of
the buffer (after a long number such as 1e400), 100000 levels of nesting,
and for safetensors u64 wrap in offsets and the length prefix, shape-product
overflow, a header length past the 100 MB cap, overlapping offsets and
offsets past the end of the file."""

import base64
import json
import os
import shutil
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUZZ = os.path.join(ROOT, "tests", "fuzz")
DEEP = 100000


def write(kind, target, name, data):
    path = os.path.join(FUZZ, kind, target, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def repo_file(rel):
    with open(os.path.join(ROOT, rel), "rb") as f:
        return f.read()


def common_json_regressions(target, prefix):
    """The JSON shapes every JSON reader must refuse: prefix is the start of a
    realistic document, cut where the hostile part begins."""
    write("regressions", target, "cve_2023_53154_comma_at_end", b'{"1":1,')
    write("regressions", target, "cve_2023_53154_1e400_comma_at_end", prefix + b"1e400,")
    write("regressions", target, "trailing_comma_after_1e400", prefix + b"1e400,}")
    write("regressions", target, "deep_nesting_100000", prefix + b"[" * DEEP)
    write("regressions", target, "leading_zero", prefix + b"01}")
    write("regressions", target, "nul_after_value", b"{}\x00")
    write("regressions", target, "nul_inside_string", b'{"a\x00b": 1}')


# ---- fuzz_request ------------------------------------------------------------

def request():
    t = "fuzz_request"
    bodies = {
        "readme": {"prompt": "a red circle on the left", "seed": 7},
        "all_openai_fields": {"model": "shapes", "prompt": "two green triangles", "n": 2,
                              "size": "384x384", "response_format": "b64_json",
                              "output_format": "png", "user": "user-1"},
        "sampling": {"prompt": "a blue square above a yellow diamond", "guidance_scale": 5,
                     "temperature": 0.9, "top_k": 100, "top_p": 0.95, "seed": 9007199254740991},
        "stream": {"prompt": "x", "stream": True, "partial_images": 2, "size": "auto"},
        "linear": {"prompt": "a square", "kv_policy": "linear", "kv_budget": 0.25,
                   "anchor_lines": 1, "recent_lines": 2},
        "streaming": {"prompt": "a square", "kv_policy": "streaming", "kv_budget": 0.1667,
                      "sink_tokens": 4},
        "headkv": {"prompt": "p", "kv_policy": "headkv", "headkv_threshold": 0.9,
                   "headkv_alpha": 0.5, "headkv_buffer": 8, "headkv_local_window": 32,
                   "headkv_recent_lines": 2, "headkv_group_tokens": 100},
        "class_index": {"class_label": 2, "kv_policy": "heatkv", "sink_scales": 3},
        "class_name": {"class_label": "a blue square", "kv_policy": "amskv",
                       "amskv_condensed_scales": 2, "amskv_min_scales": 1,
                       "amskv_max_scales": 2, "amskv_threshold": -0.008},
        "class_prompt": {"prompt": "a red circle", "kv_policy": "scalekv", "kv_budget": 0.1,
                         "scalekv_drafters": 0.0625},
        "nulls": {"prompt": "x", "seed": None, "n": None, "kv_policy": None},
        "bad_n": {"prompt": "x", "n": 5},
    }
    for name, body in bodies.items():
        write("corpus", t, name, json.dumps(body))
    write("corpus", t, "escapes", '{"prompt": "caf\\u00e9 \\ud83d\\ude00 \\"q\\" \u00e9\u20ac",'
                                  ' "user": "\\t"}')
    write("corpus", t, "bom_and_space", b'\xef\xbb\xbf \r\n{"prompt":"x"}\n')
    common_json_regressions(t, b'{"prompt":"x","n":')
    write("regressions", t, "lone_surrogate", b'{"prompt":"\\ud800"}')
    write("regressions", t, "overlong_utf8", b'{"prompt":"\xc0\xaf"}')
    write("regressions", t, "long_number_64_chars", b'{"prompt":"x","seed":' + b"1" * 64 + b"}")
    # Found by fuzz_request: top_p above 0 that rounds to 0 as a float was
    # accepted and run as top_p 0 (the crash input as found, then minimal).
    write("regressions", t, "top_p_rounds_to_zero_found",
          b'{"prompt": "lqb\xf1\xa3\x98\x80td","temperature": 0, "top_k": 1200, '
          b'"top_p": 0.91091e-72}')
    write("regressions", t, "top_p_rounds_to_zero", b'{"prompt":"x","top_p":1e-46}')


# ---- fuzz_sse ----------------------------------------------------------------

def sse():
    t = "fuzz_sse"
    progress = json.dumps({"type": "arserve.progress", "image_index": 0, "steps_done": 1,
                           "steps_total": 576}, separators=(",", ":"))
    write("corpus", t, "progress", "arserve.progress\0" + progress)
    write("corpus", t, "completed", "image_generation.completed\0{\"b64_json\":\"iVBORw0=\"}"
          + "\1\0\0\0\x40\2\0\0\0\0\0\0\x80\1\x80\1")
    write("corpus", t, "multiline", "error\0line one\nline two\n\nline four")
    write("corpus", t, "utf8_message", ("error\0" + "\u00e9\u20ac\U0001F600" * 60).encode())
    write("corpus", t, "empty_event", "\0{}")
    # Found by fuzz_sse: a CR in the payload was left inside a data line.
    write("regressions", t, "cr_in_data", "image_generation.partial_image\0a\rb\r\nc\n\rd")
    write("regressions", t, "lf_in_event", "arserve.progress\nevent: forged\0{}")
    write("regressions", t, "cr_in_event", "arserve.progress\rdata: x\0{}")
    # A 2-byte character straddling the error message's 511-byte cut.
    write("regressions", t, "utf8_cut_at_message_end", ("error\0" + "a" * 510 + "\u00e9" * 4).encode())
    write("regressions", t, "deep_text", "error\0" + "[" * DEEP)


# ---- fuzz_model_config -------------------------------------------------------

def model_config():
    t = "fuzz_model_config"
    for rel in ["models/shapes/arserve.json", "models/shapes-var/arserve.json",
                "config/presets/janus-pro-1b/arserve.json", "config/presets/llamagen-xl/arserve.json",
                "config/presets/var-d16/arserve.json", "config/presets/infinity-2b/arserve.json"]:
        write("corpus", t, rel.split("/")[-2], repo_file(rel))
    common_json_regressions(t, b'{"format_version": 1, "name": "t", "family": "raster", "llm": {"vocab_size": ')
    # The largest image: 256 x 2^7 (UBSan checks the shift).
    cfg = json.loads(repo_file("models/shapes/arserve.json"))
    cfg["image"]["grid_height"] = cfg["image"]["grid_width"] = 256
    cfg["decoder"]["channel_multiplier"] = [1] * 8
    write("regressions", t, "largest_image", json.dumps(cfg))


# ---- fuzz_tokenizer ----------------------------------------------------------

def tiny_charsmap():
    """A hand-built SentencePiece precompiled charsmap (a Darts double array, then the
    NUL-terminated replacements): 'a' -> 'b', 'ab' -> 'c', tab -> ' ', 'x' -> ''."""
    blob = b"b\0c\0 \0\0"
    units = [0] * 769
    units[0] = 256 << 10  # the root: its children at 256 ^ byte

    def node(pos, label, base, value):  # a key ending at pos; its value at base
        units[pos] = label | 1 << 8 | (pos ^ base) << 10
        units[base] = 1 << 31 | value

    node(256 ^ ord("a"), ord("a"), 512, 0)
    node(512 ^ ord("b"), ord("b"), 768, 2)
    node(256 ^ ord("\t"), ord("\t"), 1, 4)
    node(256 ^ ord("x"), ord("x"), 2, 6)
    raw = struct.pack("<I", 4 * len(units)) + struct.pack("<%dI" % len(units), *units) + blob
    return base64.b64encode(raw).decode()


def tokenizer():
    t = "fuzz_tokenizer"
    write("corpus", t, "shapes", repo_file("models/shapes/tokenizer.json"))
    write("corpus", t, "janus_tiny", repo_file("tests/golden/janus_tiny/tokenizer.json"))
    small = {
        "version": "1.0",
        "added_tokens": [
            {"id": 0, "content": "<bos>", "special": True},
            {"id": 5, "content": " <sep> ", "special": False, "normalized": True,
             "single_word": True, "lstrip": True, "rstrip": True},
        ],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"},
                                                           {"type": "Strip"}]},
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "model": {"type": "WordLevel", "unk_token": "<unk>",
                  "vocab": {"<bos>": 0, "<unk>": 1, "a": 2, "red": 3, "caf\u00e9": 4}},
    }
    write("corpus", t, "sequence_normalizer", json.dumps(small))
    small["pre_tokenizer"] = None
    small["normalizer"] = None
    small["model"]["unk_token"] = None
    write("corpus", t, "no_pretokenizer_no_unk", json.dumps(small))
    # Byte-level BPE: a committed golden tokenizer, and a small hand-made one
    # with every Split behaviour and both merge formats' neighbours.
    write("corpus", t, "bpe_digits", repo_file("tests/golden/tokenizer/digits.json"))
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 324))
    alphabet = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    vocab = {c: i for i, c in enumerate(alphabet)}
    for word in ["\u0120a", "ab", "\u0120ab", "re", "red"]:
        vocab[word] = len(vocab)
    bpe = {
        "version": "1.0",
        "added_tokens": [{"id": len(vocab), "content": "<|bos|>", "special": True,
                          "normalized": False}],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Replace", "pattern": {"String": "``"}, "content": "\""},
            {"type": "Prepend", "prepend": " "}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "[\r\n]"}, "behavior": "Isolated", "invert": False},
            {"type": "Split", "pattern": {"String": "-"}, "behavior": "MergedWithPrevious"},
            {"type": "Split", "pattern": {"Regex": "\\p{P}"}, "behavior": "MergedWithNext"},
            {"type": "Split", "pattern": {"Regex": "\\s+$"}, "behavior": "Contiguous"},
            {"type": "Split", "pattern": {"Regex": "\\S+"}, "behavior": "Removed", "invert": True},
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}]},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False, "vocab": vocab,
                  "merges": [["\u0120", "a"], "a b", ["\u0120a", "b"], "r e", ["re", "d"]]},
    }
    write("corpus", t, "bpe_split_sequence", json.dumps(bpe, ensure_ascii=False))
    # SentencePiece Unigram (T5's pipeline) with a hand-built precompiled charsmap.
    unigram = {
        "version": "1.0",
        "added_tokens": [{"id": 1, "content": "</s>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Precompiled", "precompiled_charsmap": tiny_charsmap()},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"},
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True}]},
        "decoder": {"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True},
        "model": {"type": "Unigram", "unk_id": 0, "byte_fallback": True, "vocab": [
            ["<unk>", 0.0], ["</s>", 0.0], ["\u2581", -2.0], ["b", -1.5], ["c", -2.5],
            ["\u2581b", -3.0], ["bb", -2.75], ["<0x41>", -9.0], ["<0xE2>", -9.0]]},
    }
    write("corpus", t, "unigram_metaspace", json.dumps(unigram, ensure_ascii=False))
    common_json_regressions(t, b'{"model": {"type": "WordLevel", "vocab": {"a": ')
    write("regressions", t, "largest_id",
          json.dumps({"model": {"type": "WordLevel", "vocab": {"a": (1 << 24) - 1}}}))
    write("regressions", t, "id_past_limit",
          json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 1 << 24}}}))


# ---- fuzz_safetensors --------------------------------------------------------

def st_file(header, data=b"", length=None, pad=True):
    """8-byte little-endian header length, the header (space-padded to a
    multiple of 8 like the reference writer), then data."""
    h = header.encode() if isinstance(header, str) else header
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def tensor(name, dtype, shape, begin, end):
    return '"%s":{"dtype":"%s","shape":%s,"data_offsets":[%s,%s]}' % (
        name, dtype, shape, begin, end)


def safetensors():
    t = "fuzz_safetensors"
    two = "{" + '"__metadata__":{"format":"pt","made_by":"tests/fuzz"},' + \
        tensor("a", "F32", "[2]", 0, 8) + "," + tensor("b", "U8", "[1,3]", 8, 11) + "}"
    write("corpus", t, "two_tensors", st_file(two, bytes(range(11))))
    every = "{" + ",".join([tensor("f16", "F16", "[2]", 0, 4), tensor("bf16", "BF16", "[1,2]", 4, 8),
                            tensor("i32", "I32", "[1]", 8, 12), tensor("i64", "I64", "[]", 12, 20),
                            tensor("empty", "F32", "[0,4]", 20, 20)]) + "}"
    write("corpus", t, "every_dtype", st_file(every, bytes(20)))
    write("corpus", t, "empty_header", st_file("{}"))
    # The real VQ decoder's header (its metadata and names), data cut off:
    # the reader must refuse it for offsets past the end, not crash.
    vq = repo_file("models/shapes/vq.safetensors")
    n = struct.unpack("<Q", vq[:8])[0]
    write("corpus", t, "shapes_vq_header_only", vq[:8 + n])

    def reg(name, data):
        write("regressions", t, name, data)
    big = 18446744073709551615
    reg("offsets_u64_max", st_file("{" + tensor("w", "U8", "[1]", big - 7, big) + "}", b"\0"))
    reg("offsets_wrap_begin_gt_end", st_file("{" + tensor("w", "U8", "[8]", 18446744073709551608, 0) + "}"))
    reg("offsets_2_to_64", st_file("{" + tensor("w", "U8", "[1]", 0, 18446744073709551616) + "}", b"\0"))
    reg("offsets_2_to_53", st_file("{" + tensor("w", "U8", "[9007199254740992]", 0, 9007199254740992) + "}"))
    reg("length_prefix_u64_max", st_file("{}", length=big))
    reg("length_prefix_wraps_plus_8", st_file("{}", length=big - 7))
    reg("shape_product_overflow", st_file(
        "{" + tensor("w", "U8", "[4294967296,4294967296,4294967296]", 0, 1) + "}", b"\0"))
    reg("shape_times_dtype_overflow", st_file(
        "{" + tensor("w", "I64", "[2147483648,2147483648,4]", 0, 8) + "}", bytes(8)))
    reg("shape_2_53_squared", st_file(
        "{" + tensor("w", "F32", "[9007199254740992,9007199254740992]", 0, 4) + "}", bytes(4)))
    reg("header_length_past_100MB", st_file("{}", length=100000001))
    reg("header_length_100MB_past_eof", st_file("{}", length=100000000))
    reg("overlapping_offsets", st_file(
        "{" + tensor("a", "F32", "[2]", 0, 8) + "," + tensor("b", "F32", "[2]", 4, 12) + "}", bytes(12)))
    reg("same_span_twice", st_file(
        "{" + tensor("a", "F32", "[1]", 0, 4) + "," + tensor("b", "F32", "[1]", 0, 4) + "}", bytes(4)))
    reg("zero_size_inside_other", st_file(
        "{" + tensor("a", "F32", "[2]", 0, 8) + "," + tensor("b", "F32", "[0]", 4, 4) + "}", bytes(8)))
    reg("offsets_past_eof", st_file("{" + tensor("w", "F32", "[2]", 0, 8) + "}", bytes(4)))
    # CVE-2023-53154's shape at the very end of the header, nothing after it.
    reg("cve_2023_53154_header_ends_after_comma", st_file(
        b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1e400,', pad=False))
    reg("cve_2023_53154_object_comma", st_file(b'{"1":1,', pad=False))
    reg("deep_nesting_100000", st_file(b'{"w":' + b"[" * DEEP))


def main():
    for kind in ("corpus", "regressions"):
        shutil.rmtree(os.path.join(FUZZ, kind), ignore_errors=True)
    request()
    sse()
    model_config()
    tokenizer()
    safetensors()


if __name__ == "__main__":
    main()
