"""Safetensors files of a release, written by tools/safetensors_write.py's streaming writer:
the header from the shapes alone, then each tensor's bytes in turn, generated a chunk at a
time."""

from __future__ import annotations

import os
import sys

from .tensors import DTYPES, fill_chunks

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import safetensors_write  # noqa: E402  (tools/safetensors_write.py)


def _entries(tensors: list, seed: int):
    return [(t.name, DTYPES[t.dtype][2], t.shape, (lambda t=t: fill_chunks(t, seed)))
            for t in tensors]


def write(path: str, tensors: list, seed: int, metadata: dict | None = None, progress=None) -> None:
    done = [0]

    def count(total):
        if progress is not None:
            progress.add(total - done[0])
        done[0] = total
    meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None
    safetensors_write.write_stream(path, _entries(tensors, seed), meta, count)


def size(tensors: list, metadata: dict | None = None) -> int:
    meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None
    blob, _ = safetensors_write.header_blob(_entries(tensors, 0), meta)
    return 8 + len(blob) + sum(t.nbytes for t in tensors)
