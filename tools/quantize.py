#!/usr/bin/env python3
"""Quantise a converted arserve model directory's Linear weights to 8 bits.

    .venv/bin/python tools/quantize.py MODEL_DIR OUT_DIR --dtype int8|fp8 [--quantize-heads] \\
        [--force]

Writes OUT_DIR as MODEL_DIR with the transformer blocks' Linear weights (and with
`--quantize-heads` the heads, embeddings' Linears, aligner, text projections and AdaLN outside
the blocks too) stored in 8 bits, one scale per output row beside each (NAME_scale; the format
is docs/model-format.md's "8-bit Linear weights", the lists per architecture
tools/convert/quant.py's, picked by arserve.json's family and architecture). Every other tensor
keeps its stored type (F64 becomes F32), each weights file keeps its name and metadata (plus a
`quantization` entry saying what it holds), and every other file (arserve.json, tokenizer.json,
kv_calibration.json, ...) is copied unchanged; a README.md gets one line saying what the
weights are. The result is what `tools/convert/*.py --dtype int8|fp8` writes from the release.

Refused with one line, nothing written: a directory without arserve.json, one that already
holds 8-bit weights, an OUT_DIR that exists and is not empty (unless --force), OUT_DIR the
same as MODEL_DIR, a weight that is not finite. Memory is bounded as the converters' is
(tools/convert/ckpt.py): a block of rows at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "convert"))
import ckpt  # noqa: E402  (tools/convert/ckpt.py: lazy reading, streamed writing)
import quant  # noqa: E402  (tools/convert/quant.py: the quantisers and the lists)
import safetensors_write  # noqa: E402  (tools/safetensors_write.py)

PROG = "quantize"
EIGHT_BIT = tuple(quant.KINDS.values())


class QuantizeError(Exception):
    """A model directory or an OUT_DIR this tool refuses; the message says why."""


def read_manifest(model: str) -> dict:
    path = os.path.join(model, "arserve.json")
    if not os.path.isdir(model):
        raise QuantizeError(f"{model}: no such directory")
    if not os.path.isfile(path):
        raise QuantizeError(f"{model}: no arserve.json: not an arserve model directory")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise QuantizeError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise QuantizeError(f"{path}: not a JSON object")
    for key in ("family", "architecture"):
        if not isinstance(manifest.get(key), str):
            raise QuantizeError(f"{path}: no '{key}' string")
    return manifest


def weight_files(model: str, manifest: dict) -> list[str]:
    """The weights files arserve.json names (relative to the directory), checked to exist."""
    files = manifest.get("weights", ["model.safetensors"])
    where = os.path.join(model, "arserve.json")
    if not isinstance(files, list) or not files or \
            not all(isinstance(f, str) and f for f in files):
        raise QuantizeError(f"{where}: 'weights' is not a list of file names")
    for f in files:
        if os.path.isabs(f) or ".." in f.replace("\\", "/").split("/"):
            raise QuantizeError(f"{where}: weights file '{f}' is not inside the directory")
        if not os.path.isfile(os.path.join(model, f)):
            raise QuantizeError(f"{model}: weights file '{f}' is missing")
    return [os.path.normpath(f) for f in files]


def headers(model: str, files: list[str]) -> dict:
    """{file: its safetensors header}; refuses a model that already holds 8-bit weights."""
    out = {}
    for f in files:
        path = os.path.join(model, f)
        try:
            header, _ = safetensors_write.read_header(path)
        except ValueError as e:
            raise QuantizeError(str(e)) from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            base = name[: -len(quant.SCALE_SUFFIX)] if name.endswith(quant.SCALE_SUFFIX) else None
            if info["dtype"] in EIGHT_BIT or (base and base in header):
                what = f"is {info['dtype']}" if info["dtype"] in EIGHT_BIT else \
                    f"is the scales of '{base}'"
                raise QuantizeError(f"{path}: already holds 8-bit weights ('{name}' {what}); "
                                    "quantise the model it was made from")
        out[f] = header
    return out


def card_line(kind: str, heads: bool) -> str:
    return f"weights: {quant.describe(kind, heads)} (tools/quantize.py)"


def copy_others(model: str, out: str, skip: set, line: str) -> list[str]:
    """Copies every file of model but the `skip` ones into out, keeping the tree; a README.md
    gets `line` appended. Returns the files copied."""
    copied = []
    for root, dirs, files in os.walk(model):
        dirs.sort()
        rel_root = os.path.relpath(root, model)
        os.makedirs(os.path.join(out, rel_root), exist_ok=True)
        for f in sorted(files):
            rel = os.path.normpath(os.path.join(rel_root, f))
            if rel in skip:
                continue
            src, dst = os.path.join(model, rel), os.path.join(out, rel)
            if rel == "README.md":
                with open(src, encoding="utf-8") as fi:
                    text = fi.read()
                with open(dst, "w", encoding="utf-8") as fo:
                    fo.write(text + ("" if text.endswith("\n") or not text else "\n")
                             + ("\n" if text else "") + line + "\n")
            else:
                shutil.copyfile(src, dst)
            copied.append(rel)
    return copied


def quantize(model: str, out: str, kind: str, heads: bool, force: bool) -> str:
    """Writes out from model; returns the summary line."""
    manifest = read_manifest(model)
    files = weight_files(model, manifest)
    if os.path.exists(out) and os.path.realpath(out) == os.path.realpath(model):
        raise QuantizeError(f"{out}: is MODEL_DIR itself; write the 8-bit model elsewhere")
    if os.path.exists(out) and not force and (not os.path.isdir(out) or os.listdir(out)):
        raise QuantizeError(f"{out}: exists and is not empty (--force to write into it)")
    head = headers(model, files)
    every = [n for h in head.values() for n in h if n != "__metadata__"]
    try:
        names = set(ckpt.quantised_names(manifest, every, kind, heads))
    except ckpt.ConversionError as e:
        raise QuantizeError(f"{os.path.join(model, 'arserve.json')}: {e}") from None

    made = not os.path.exists(out)
    before = after = 0
    try:
        os.makedirs(out, exist_ok=True)
        for f in files:
            src, dst = os.path.join(model, f), os.path.join(out, f)
            os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
            tensors = ckpt.read_safetensors(src)
            metadata = dict(head[f].get("__metadata__", {}))
            metadata["quantization"] = quant.describe(kind, heads)
            ckpt.write_safetensors(
                dst, tensors, kind, metadata,
                lambda line: print(f"{PROG}: {f}: {line}", file=sys.stderr, flush=True),
                sorted(names & tensors.keys()))
            before += os.path.getsize(src)
            after += os.path.getsize(dst)
        copied = copy_others(model, out, set(files), card_line(kind, heads))
    except BaseException:
        if made and os.path.isdir(out):
            shutil.rmtree(out)
        raise
    card = "README.md has a line saying so" if "README.md" in copied else \
        "no README.md: the weights files' metadata says so"
    return (f"{PROG}: wrote {out}: {len(names)} Linear weights in {kind}, the other "
            f"{len(every) - len(names)} tensors as stored; {before / 1e6:.1f} MB -> "
            f"{after / 1e6:.1f} MB; copied {len(copied)} other files ({card})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("model_dir", help="a converted arserve model directory")
    ap.add_argument("out_dir", help="the 8-bit model directory to write")
    ap.add_argument("--dtype", choices=tuple(quant.KINDS), required=True,
                    help="int8 (scale max|w|/127) or fp8 (e4m3, scale max|w|/448)")
    ap.add_argument("--quantize-heads", action="store_true",
                    help="also the Linears outside the blocks (heads, word_embed, aligner, text "
                    "projections, shared and head AdaLN)")
    ap.add_argument("--force", action="store_true", help="write into an existing OUT_DIR")
    args = ap.parse_args(argv)
    try:
        print(quantize(args.model_dir, args.out_dir, args.dtype, args.quantize_heads,
                       args.force))
    except (QuantizeError, ckpt.ConversionError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
