"""Minimal safetensors writer and reader (numpy only) for the scripts that make
tiny models and golden data; files it writes open with engine/format/safetensors.c.
Self-check by hand: python tools/safetensors_write.py --self-check
"""

import json
import struct
import sys

import numpy as np

# numpy dtype -> safetensors dtype. bfloat16 has no numpy dtype: pass it as a
# ('BF16', uint16 array) tuple holding the raw bf16 bit patterns.
_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint8): "U8",
}
_NUMPY = {v: k for k, v in _DTYPES.items()}
_NUMPY["BF16"] = np.dtype(np.uint16)

MAX_HEADER = 100_000_000  # the reference implementation's limit


def _as_tensor(name, value):
    """Returns (safetensors dtype, little-endian contiguous array)."""
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise ValueError(f"bad tensor name {name!r}")
    if isinstance(value, tuple):
        if len(value) != 2 or value[0] != "BF16":
            raise TypeError(f"tensor {name!r}: tuples must be ('BF16', uint16 array)")
        arr = np.asarray(value[1])
        if arr.dtype != np.uint16:
            raise TypeError(f"tensor {name!r}: BF16 bits must be a uint16 array, not {arr.dtype}")
        dtype = "BF16"
    else:
        arr = np.asarray(value)
        dtype = _DTYPES.get(arr.dtype.newbyteorder("="))
        if dtype is None:
            raise TypeError(
                f"tensor {name!r}: unsupported dtype {arr.dtype} "
                "(float32, float16, int32, int64, uint8, or ('BF16', uint16 array))"
            )
    # asarray, not ascontiguousarray, which would turn a 0-d scalar into shape [1].
    return dtype, np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C")


def write(path, tensors, metadata=None):
    """Writes tensors (dict name -> numpy array, or ('BF16', uint16 array)) to
    path, sorted by name and packed contiguously; metadata is an optional
    dict[str, str] stored as __metadata__. The header is padded with spaces to
    a multiple of 8 bytes so the data section starts 8-byte aligned."""
    header = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata must be a dict of str to str")
        header["__metadata__"] = dict(metadata)
    arrays = []
    offset = 0
    for name in sorted(tensors):
        dtype, arr = _as_tensor(name, tensors[name])
        header[name] = {
            "dtype": dtype,
            "shape": [int(d) for d in arr.shape],
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    if len(blob) > MAX_HEADER:
        raise ValueError(f"{path}: header of {len(blob)} bytes exceeds {MAX_HEADER}")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


def _read_header(path):
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: file shorter than 8 bytes")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > MAX_HEADER or n > len(raw) - 8:
        raise ValueError(f"{path}: bad header length {n}")
    header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    return header, memoryview(raw)[8 + n :]


def read(path):
    """Returns dict name -> numpy array (a copy); BF16 tensors come back as
    ('BF16', uint16 array), as write takes them. Checks offsets and sizes."""
    header, data = _read_header(path)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _NUMPY.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r}: unknown dtype {info['dtype']!r}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not 0 <= begin <= end <= len(data) or end - begin != nbytes:
            raise ValueError(f"{path}: tensor {name!r}: bad data_offsets {[begin, end]}")
        arr = np.frombuffer(data[begin:end], dtype=dtype.newbyteorder("<")).reshape(shape)
        arr = arr.astype(dtype)  # native byte order, and a copy that outlives the file
        out[name] = ("BF16", arr) if info["dtype"] == "BF16" else arr
    return out


def read_metadata(path):
    """Returns the __metadata__ dict (empty if there is none)."""
    header, _ = _read_header(path)
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
                assert back[k][0] == "BF16" and np.array_equal(back[k][1], v[1])
            else:
                assert np.array_equal(back[k], np.asarray(v)) and back[k].shape == np.shape(v), k
        assert read_metadata(path) == {"model": "tiny"}
    print("safetensors_write self-check ok")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-check"]:
        _self_check()
    else:
        sys.exit(__doc__)
