"""Command line: write one model's release-shaped random checkpoint folder, or list them.

    python3 -m tools.release_shapes MODEL OUT_DIR [--seed N] [--tiny] [--force]
    python3 -m tools.release_shapes --list [--tiny]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from . import releases, safetensors_out, tokenizers_out, torchzip


class Progress:
    """Bytes written of the total, on stderr every few seconds."""

    def __init__(self, total: int, every: float = 3.0):
        self.total, self.done, self.every = total, 0, every
        self.start = self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            print(f"  {self.done / 1e9:.2f} / {self.total / 1e9:.2f} GB "
                  f"({100 * self.done / max(self.total, 1):.0f}%, {rate / 1e6:.0f} MB/s)",
                  file=sys.stderr, flush=True)


def file_size(f: releases.File) -> int:
    """Exact for text and safetensors; for torch archives the data plus an upper bound."""
    if f.kind == "text":
        return len(f.text.encode("utf-8"))
    if f.kind == "safetensors":
        return safetensors_out.size(f.tensors, f.metadata)
    return sum(t.nbytes for t in f.tensors) + torchzip.overhead(f.path, f.tensors, f.wrap)


def write_file(out_dir: str, f: releases.File, seed: int, progress: Progress) -> int:
    path = os.path.join(out_dir, f.path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if f.kind == "text":
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(f.text)
    elif f.kind == "safetensors":
        safetensors_out.write(path, f.tensors, seed, f.metadata, progress)
    else:
        torchzip.write(path, f.tensors, seed, f.wrap, progress)
    return os.path.getsize(path)


def list_models(tiny: bool) -> None:
    for m in releases.MODELS:
        r = releases.release(m, tiny)
        total = sum(file_size(f) for f in r.files)
        print(f"{m}{' (--tiny)' if tiny else ''}: {len(r.files)} files, ~{total / 1e9:.3f} GB, "
              f"{r.params:,} parameters ({r.elements:,} elements with buffers)")
        for f in r.files:
            params = sum(t.numel for t in f.tensors if not t.buffer)
            extra = f" ({len(f.tensors)} tensors, {params:,} parameters)" if f.tensors else ""
            print(f"  {f.path:58s} {file_size(f):>15,} B{extra}")


def existing_parent(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.release_shapes", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", choices=releases.MODELS + releases.BENCH_MODELS)
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    ap.add_argument("--tiny", action="store_true", help="same layout at a small width and depth")
    ap.add_argument("--force", action="store_true", help="write into an existing non-empty OUT_DIR")
    ap.add_argument("--list", action="store_true", help="list the models, their files and sizes")
    args = ap.parse_args(argv)
    if args.list:
        list_models(args.tiny)
        return 0
    if not args.model or not args.out_dir:
        ap.error("MODEL and OUT_DIR are required (or --list)")
    out = args.out_dir
    if os.path.exists(out) and (not os.path.isdir(out) or (os.listdir(out) and not args.force)):
        print(f"release_shapes: {out} exists and is not an empty folder (--force to write into it)",
              file=sys.stderr)
        return 1
    r = releases.release(args.model, args.tiny)
    need = sum(file_size(f) for f in r.files)
    free = shutil.disk_usage(existing_parent(out)).free
    if need + (64 << 20) > free:
        print(f"release_shapes: {args.model} needs {need / 1e9:.2f} GB but {existing_parent(out)} has "
              f"{free / 1e9:.2f} GB free; nothing written", file=sys.stderr)
        return 1
    for f in r.files:
        if f.path.endswith("tokenizer.json"):
            problem = tokenizers_out.check_with_library(f.text, {})
            if problem:
                print(f"release_shapes: {f.path}: {problem}", file=sys.stderr)
                return 1
    os.makedirs(out, exist_ok=True)
    start = time.monotonic()
    progress = Progress(sum(t.nbytes for t in r.tensors()))
    written = 0
    for f in r.files:
        n = write_file(out, f, args.seed, progress)
        written += n
        print(f"wrote {os.path.join(out, f.path)} ({n:,} bytes)")
    for note in r.notes:
        print(f"note: {note}")
    print(f"{args.model}{' --tiny' if args.tiny else ''} seed {args.seed}: {len(r.files)} files, "
          f"{written:,} bytes, {r.params:,} parameters ({r.elements:,} elements with buffers), "
          f"{time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
