"""Minimal safetensors writer and reader (numpy only) for the scripts that make
tiny models and golden data; files it writes open with engine/format/safetensors.c.
Self-check by hand: python tools/safetensors_write.py --self-check
"""

import json
import os
import struct
import sys

import numpy as np

# numpy dtype -> safetensors dtype. bfloat16 and fp8 e4m3 have no numpy dtype: pass them as a
# ('BF16', uint16 array) or ('F8_E4M3', uint8 array) tuple holding the raw bit patterns.
_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
}
# the types passed as (name, bits) tuples, and the numpy type of their bits
_BITS = {"BF16": np.dtype(np.uint16), "F8_E4M3": np.dtype(np.uint8)}
_NUMPY = {v: k for k, v in _DTYPES.items()}
_NUMPY.update(_BITS)

MAX_HEADER = 100_000_000  # the reference implementation's limit


def _as_tensor(name, value):
    """Returns (safetensors dtype, little-endian contiguous array)."""
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise ValueError(f"bad tensor name {name!r}")
    if isinstance(value, tuple):
        if len(value) != 2 or value[0] not in _BITS:
            raise TypeError(f"tensor {name!r}: tuples must be ('BF16', uint16 array) or "
                            "('F8_E4M3', uint8 array)")
        dtype, arr = value[0], np.asarray(value[1])
        if arr.dtype != _BITS[dtype]:
            raise TypeError(f"tensor {name!r}: {dtype} bits must be a {_BITS[dtype]} array, "
                            f"not {arr.dtype}")
    else:
        arr = np.asarray(value)
        dtype = _DTYPES.get(arr.dtype.newbyteorder("="))
        if dtype is None:
            raise TypeError(
                f"tensor {name!r}: unsupported dtype {arr.dtype} "
                "(float32, float16, int32, int64, int8, uint8, or ('BF16', uint16 array) or "
                "('F8_E4M3', uint8 array))"
            )
    # asarray, not ascontiguousarray, which would turn a 0-d scalar into shape [1].
    return dtype, np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C")


# Bytes per element of every safetensors dtype (the format's list); readers take a subset.
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
            "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


def write(path, tensors, metadata=None):
    """Writes tensors (dict name -> numpy array, ('BF16', uint16 array) or
    ('F8_E4M3', uint8 array)) to path, sorted by name and packed contiguously;
    metadata is an optional dict[str, str] stored as __metadata__. The header is
    padded with spaces to a multiple of 8 bytes so the data section starts 8-byte
    aligned."""
    entries = []
    for name in tensors:
        dtype, arr = _as_tensor(name, tensors[name])
        entries.append((name, dtype, arr.shape, (lambda arr=arr: [arr])))
    write_stream(path, entries, metadata)


def header_blob(entries, metadata=None):
    """(the header's bytes after the 8-byte length, the header) for entries (name, dtype, shape,
    ...) in name order, each tensor's data_offsets packed from 0; padded with spaces to a
    multiple of 8 so the data section starts 8-byte aligned."""
    header = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata must be a dict of str to str")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape, *_ in sorted(entries, key=lambda e: e[0]):
        if not isinstance(name, str) or not name or name == "__metadata__" or name in header:
            raise ValueError(f"bad or repeated tensor name {name!r}")
        nbytes = int(np.prod(shape, dtype=object)) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    if len(blob) > MAX_HEADER:
        raise ValueError(f"header of {len(blob)} bytes exceeds {MAX_HEADER}")
    return blob, header


def write_stream(path, entries, metadata=None, progress=None):
    """Writes a safetensors file from entries (name, dtype, shape, pieces): the header from
    the names, types and shapes first, then each tensor in name order from pieces(), an
    iterable of arrays whose bytes, in turn, are its C-order data (written little-endian);
    their total must be the shape's. progress(bytes written so far) follows each piece."""
    blob, header = header_blob(entries, metadata)
    done = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, _dtype, _shape, pieces in sorted(entries, key=lambda e: e[0]):
            begin, end = header[name]["data_offsets"]
            for piece in pieces():
                piece = np.asarray(piece)
                piece = np.ascontiguousarray(piece, dtype=piece.dtype.newbyteorder("<"))
                f.write(piece.reshape(-1).view(np.uint8).data)
                done += piece.nbytes
                if progress:
                    progress(done)
            wrote = f.tell() - len(blob) - 8 - begin
            if wrote != end - begin:
                raise ValueError(f"{path}: tensor {name!r} wrote {wrote} bytes, its shape "
                                 f"needs {end - begin}")


def _unique_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(path, dtypes=None):
    """(header, byte offset of the data section) of the safetensors file at path, checked as
    the reference implementation checks it, before any tensor is read: the header's length,
    a JSON object without repeated keys, each tensor's dtype (one of `dtypes`, default
    ITEMSIZE's), shape, and data_offsets inside the file, of the shape's size and not
    overlapping another's. Raises ValueError naming the file and the problem."""
    dtypes = ITEMSIZE if dtypes is None else dtypes
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: file shorter than 8 bytes: not safetensors")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or n > size - 8:
            raise ValueError(f"{path}: header length {n} does not fit the file of {size} bytes "
                             f"(or exceeds {MAX_HEADER}): not safetensors")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    data = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ValueError(f"{path}: __metadata__ is not a map of strings")
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{where}: needs exactly dtype, shape and data_offsets")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in dtypes or dtype not in ITEMSIZE:
            raise ValueError(f"{where}: dtype {dtype!r} is not one of {', '.join(dtypes)}")
        if not isinstance(shape, list) or not all(_int(d) and d >= 0 for d in shape):
            raise ValueError(f"{where}: shape {shape!r} is not a list of sizes")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_int(o) for o in offs) or \
                not 0 <= offs[0] <= offs[1] <= data:
            raise ValueError(f"{where}: data_offsets {offs!r} outside the {data} data bytes")
        nbytes = int(np.prod(shape, dtype=object)) * ITEMSIZE[dtype]
        if offs[1] - offs[0] != nbytes:
            raise ValueError(f"{where}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, "
                             f"shape {shape} x {dtype} needs {nbytes}")
        spans.append((offs[0], offs[1], name))
    spans.sort()
    for (_, e0, a), (b1, _, b) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"{path}: tensors {a!r} and {b!r} overlap")
    return header, 8 + n


def read(path):
    """Returns dict name -> numpy array (a copy); BF16 and F8_E4M3 tensors come back as
    ('BF16', uint16 array) and ('F8_E4M3', uint8 array), as write takes them. Checks offsets
    and sizes."""
    header, start = read_header(path, _NUMPY)
    with open(path, "rb") as f:
        f.seek(start)
        data = memoryview(f.read())
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _NUMPY[info["dtype"]]
        begin, end = info["data_offsets"]
        arr = np.frombuffer(data[begin:end], dtype=dtype.newbyteorder("<")).reshape(info["shape"])
        arr = arr.astype(dtype)  # native byte order, and a copy that outlives the file
        out[name] = (info["dtype"], arr) if info["dtype"] in _BITS else arr
    return out


def read_metadata(path):
    """Returns the __metadata__ dict (empty if there is none)."""
    header, _ = read_header(path)
    return dict(header.get("__metadata__", {}))


def _self_check():
    import os
    import tempfile

    rng = np.random.default_rng(0)
    tensors = {
        "w.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "a.f16": rng.standard_normal(7).astype(np.float16),
        "b.bf16": ("BF16", np.array([0x3F80, 0x4040, 0xC000], dtype=np.uint16)),
        "ids": np.arange(4, dtype=np.int32),
        "big": np.array([-(1 << 40)], dtype=np.int64),
        "bytes": np.arange(5, dtype=np.uint8),
        "q.i8": np.array([[-127, 0], [5, 127]], dtype=np.int8),
        "q.f8": ("F8_E4M3", np.array([0x00, 0x7E, 0xFE, 0x38], dtype=np.uint8)),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "scalar": np.float32(2.5),
        "be": np.arange(3, dtype=">f4"),
        "transposed": np.arange(6, dtype=np.float32).reshape(2, 3).T,
    }
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.safetensors")
        write(path, tensors, {"model": "tiny"})
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        assert n % 8 == 0
        back = read(path)
        assert sorted(back) == sorted(tensors)
        for k, v in tensors.items():
            if isinstance(v, tuple):
                assert back[k][0] == v[0] and np.array_equal(back[k][1], v[1])
                assert back[k][1].dtype == v[1].dtype, k
            else:
                assert np.array_equal(back[k], np.asarray(v)) and back[k].shape == np.shape(v), k
        assert read_metadata(path) == {"model": "tiny"}
    print("safetensors_write self-check ok")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-check"]:
        _self_check()
    else:
        sys.exit(__doc__)
