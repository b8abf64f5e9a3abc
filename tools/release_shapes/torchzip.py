"""torch.save's zip format written without torch: `ARCHIVE/data.pkl` (pickle protocol 2 naming
torch._utils._rebuild_tensor_v2 and torch.*Storage through persistent ids, as torch.save does),
`ARCHIVE/byteorder`, one `ARCHIVE/data/N` entry per storage (stored, 64-byte aligned like
torch's writer), `ARCHIVE/version`; streamed entry by entry, so memory stays one chunk."""

from __future__ import annotations

import hashlib
import os
import struct
import zipfile

from .tensors import DTYPES, Tensor, fill_chunks

ALIGN = 64  # torch's PyTorchStreamWriter aligns every record's data to 64 bytes
_DATE = (1980, 1, 1, 0, 0, 0)


# ---- a pickle emitter for the few opcodes torch.save's state dicts use ----------------------

def _glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b


def _int(i: int) -> bytes:
    if 0 <= i < 256:
        return b"K" + bytes([i])
    if 0 <= i < 65536:
        return b"M" + struct.pack("<H", i)
    if -(1 << 31) <= i < (1 << 31):
        return b"J" + struct.pack("<i", i)
    raw = i.to_bytes((i.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _tuple(items: list) -> bytes:
    body = b"".join(items)
    if not items:
        return b")"
    if len(items) <= 3:
        return body + {1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(items)]
    return b"(" + body + b"t"


def contiguous_strides(shape) -> list:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return stride[::-1]


def tensor_record(storage: str, key, numel: int, offset: int, size, stride,
                  from_type: bool = False) -> bytes:
    """The pickle of one tensor as torch.save writes it: torch._utils._rebuild_tensor_v2(
    storage, offset, size, stride, False, OrderedDict()), the storage a persistent id
    ('storage', torch.<storage>, key, 'cpu', numel); with from_type, wrapped in
    torch._tensor._rebuild_from_type_v2(that, torch.Tensor, args, {}) as torch writes a tensor
    that carries Python attributes. Any values go in, so tests can write hostile ones."""
    pid = _tuple([_str("storage"), _glob("torch", storage), _str(str(key)), _str("cpu"),
                  _int(numel)])
    args = _tuple([pid + b"Q", _int(offset), _tuple([_int(d) for d in size]),
                   _tuple([_int(s) for s in stride]), b"\x89",
                   _glob("collections", "OrderedDict") + b")R"])
    rebuild = _glob("torch._utils", "_rebuild_tensor_v2")
    if from_type:
        return (_glob("torch._tensor", "_rebuild_from_type_v2")
                + _tuple([rebuild, _glob("torch", "Tensor"), args, b"}"]) + b"R")
    return rebuild + args + b"R"


def _tensor(t: Tensor, key: int) -> bytes:
    return tensor_record(DTYPES[t.dtype][1], key, t.numel, 0, t.shape, contiguous_strides(t.shape))


def state_pickle(records: list, wrap: str | None = None) -> bytes:
    """data.pkl for an OrderedDict of (name, tensor_record bytes), or {wrap: that dict}."""
    out = [_glob("collections", "OrderedDict"), b")R"]
    for start in range(0, len(records), 1000):  # pickle batches SETITEMS by 1000
        out.append(b"(")
        for name, rec in records[start:start + 1000]:
            out.append(_str(name) + rec)
        out.append(b"u")
    body = b"".join(out)
    if wrap is not None:
        body = b"}" + _str(wrap) + body + b"s"
    return b"\x80\x02" + body + b"."


def pickle_bytes(tensors: list, wrap: str | None = None) -> bytes:
    """data.pkl for an OrderedDict state dict, or {wrap: state_dict} when wrap is a key."""
    return state_pickle([(t.name, _tensor(t, key)) for key, t in enumerate(tensors)], wrap)


# ---- the archive -----------------------------------------------------------------------------

def _aligned_info(zf: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    """A ZipInfo whose data starts on a 64-byte boundary: torch pads the local header's extra
    field ('FB' + length + 'Z' * n); with force_zip64 zipfile appends its 20-byte zip64 field."""
    zi = zipfile.ZipInfo(name, date_time=_DATE)
    zi.compress_type = zipfile.ZIP_STORED
    start = zf.fp.tell() + 30 + len(name.encode("utf-8")) + 4 + 20
    pad = (-start) % ALIGN
    zi.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return zi


def _put(zf: zipfile.ZipFile, name: str, chunks, progress=None) -> None:
    with zf.open(_aligned_info(zf, name), "w", force_zip64=True) as w:
        for c in chunks:
            mv = memoryview(c).cast("B") if not isinstance(c, bytes) else c
            w.write(mv)
            if progress is not None:
                progress.add(len(mv))


def archive_name(path: str) -> str:
    """torch >= 2 names the archive folder after the file (its stem)."""
    return os.path.splitext(os.path.basename(path))[0]


def write_archive(path: str, data_pkl: bytes, storages, seed: int = 0, progress=None) -> None:
    """A torch.save archive: data.pkl, then each (key, chunks) of storages as data/key."""
    arch = archive_name(path)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        _put(zf, f"{arch}/data.pkl", [data_pkl])
        _put(zf, f"{arch}/.format_version", [b"1"])
        _put(zf, f"{arch}/.storage_alignment", [str(ALIGN).encode()])
        _put(zf, f"{arch}/byteorder", [b"little"])
        for key, chunks in storages:
            _put(zf, f"{arch}/data/{key}", chunks, progress)
        _put(zf, f"{arch}/version", [b"3\n"])
        # torch writes a random id here; ours is derived from the file name and seed
        sid = int.from_bytes(hashlib.sha256(f"{arch}:{seed}".encode()).digest()[:16], "little")
        _put(zf, f"{arch}/.data/serialization_id", [f"{sid:040d}"[:40].encode()])


def write(path: str, tensors: list, seed: int, wrap: str | None = None, progress=None) -> None:
    """Writes tensors (in order) as torch.save(OrderedDict) or torch.save({wrap: OrderedDict})."""
    write_archive(path, pickle_bytes(tensors, wrap),
                  ((key, fill_chunks(t, seed)) for key, t in enumerate(tensors)), seed, progress)


def overhead(path: str, tensors: list, wrap: str | None = None) -> int:
    """Bytes of the archive beyond the tensor data, at most (headers, padding, pickle, directory)."""
    arch = archive_name(path)
    n = len(tensors) + 7
    per = 30 + 4 + 20 + ALIGN + 46 + 4 + 28 + 2 * (len(arch) + 30)
    return n * per + len(pickle_bytes(tensors, wrap)) + 200
