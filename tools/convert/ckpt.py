"""Checkpoints read lazily and model files written tensor by tensor, for the converters.

A checkpoint's tensors come back as `Tensor`s: shape and stored type from the file's header or
pickle, values read only when asked (a first-axis slice or a reshape of a tensor stored in one
piece reads only its own bytes). `write_safetensors` then writes the converted model one
bounded chunk at a time, so a conversion's memory does not grow with the model: its peak is a
fixed amount (CHUNK_BYTES of source and output) over the interpreter, plus the largest tensor
a converter has to compute from (none of the released layouts needs one over a few MB).

Every size, stride, offset, storage key and archive entry is checked against the file before
anything is allocated, and every refusal is a ConversionError whose message names the file
and the problem. torch.save's zip format is read by a restricted unpickler (tensors, dicts,
ordered dicts and whatever a converter allows by name), so no code in a checkpoint runs.
Self-check by hand: python3 tools/convert/ckpt.py --self-check
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import re
import sys
import time
import zipfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quant  # noqa: E402  (tools/convert/quant.py: 8-bit Linear weights)
import safetensors_write  # noqa: E402  (tools/safetensors_write.py)

# The most bytes of source values (and of converted output) held at once while writing.
CHUNK_BYTES = 8 << 20
# data.pkl of the largest released checkpoint (Infinity-8B's shards) is well under 1 MB.
MAX_PICKLE_BYTES = 64 << 20
# A deflated entry may not claim to inflate more than this many times its stored size
# (torch.save stores entries uncompressed; float weights compress by a few percent).
MAX_INFLATE_RATIO = 20
MAX_DIMS = 16


class ConversionError(Exception):
    """A checkpoint the engine cannot run, or a damaged or hostile one; the message says why."""


# safetensors dtype -> (numpy type of the stored bits, numpy type of the values)
DTYPES = {
    "F64": (np.float64, np.float64), "F32": (np.float32, np.float32),
    "F16": (np.float16, np.float16), "BF16": (np.uint16, np.float32),
    "I64": (np.int64, np.int64), "I32": (np.int32, np.int32), "I16": (np.int16, np.int16),
    "I8": (np.int8, np.int8), "U8": (np.uint8, np.uint8), "BOOL": (np.bool_, np.bool_),
    "F8_E4M3": (np.uint8, np.float32),  # an 8-bit model's Linear weights (quant.py)
}
FLOATS = ("F64", "F32", "F16", "BF16")
# types held as bits numpy has no type for: Tensor.of never infers them from an array
_BITS_ONLY = ("BF16", "F8_E4M3")


def _shape_of_index(shape, idx):
    """The shape t[idx] has, for t of `shape`, without allocating t."""
    probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=shape,
                                            strides=(0,) * len(shape))
    return probe[idx].shape


class Tensor:
    """A tensor of a checkpoint: `shape` and `stored` (a DTYPES key) now, values on demand.

    Stored in one piece (`_span(begin, n)` reads n bytes of its C-order data from `begin`), or
    computed from another tensor (`_make()` gives its stored bits as an array). numpy reads its
    values through __array__, so np.asarray(t), np.array_equal(t, a) and t.astype(x) work."""

    __array_priority__ = 100

    def __init__(self, shape, stored, span=None, make=None, where=""):
        self.shape, self.stored, self.where = tuple(int(d) for d in shape), stored, where
        self._span, self._make = span, make

    # numpy-like facts, from the header alone
    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=object)))
    itemsize = property(lambda self: np.dtype(DTYPES[self.stored][0]).itemsize)
    nbytes = property(lambda self: self.size * self.itemsize)
    dtype = property(lambda self: np.dtype(DTYPES[self.stored][1]))

    def __repr__(self):
        return f"Tensor({list(self.shape)}, {self.stored}{', ' + self.where if self.where else ''})"

    @staticmethod
    def of(arr: np.ndarray, where="") -> "Tensor":
        """An in-memory array as a Tensor (a converter's computed value)."""
        arr = np.asarray(arr)
        stored = {np.dtype(b): k for k, (b, v) in DTYPES.items() if k not in _BITS_ONLY}.get(
            arr.dtype.newbyteorder("="))
        if stored is None:
            raise ConversionError(f"{where or 'tensor'}: dtype {arr.dtype} is not one arserve stores")
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("="))
        return Tensor(arr.shape, stored, make=lambda: arr, where=where)

    def bits(self) -> np.ndarray:
        """The stored bits as a C-contiguous array of its shape (BF16 as uint16)."""
        if self._span is not None:
            raw = self._span(0, self.nbytes)
            return np.frombuffer(raw, dtype=DTYPES[self.stored][0]).reshape(self.shape)
        arr = np.ascontiguousarray(self._make())
        if arr.shape != self.shape:
            raise AssertionError(f"{self.where}: computed {arr.shape}, declared {self.shape}")
        return arr

    def values(self) -> np.ndarray:
        return _values(self.bits(), self.stored)

    def __array__(self, dtype=None, copy=None):
        v = self.values()
        return v if dtype is None else v.astype(dtype)

    def astype(self, dtype):
        return self.values().astype(dtype)

    def __eq__(self, other):
        return self.values() == np.asarray(other)

    def __ne__(self, other):
        return self.values() != np.asarray(other)

    __hash__ = None

    def reshape(self, *shape) -> "Tensor":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = _shape_of_reshape(self.shape, shape)
        if self._span is not None:
            return Tensor(shape, self.stored, span=self._span, where=self.where)
        return Tensor(shape, self.stored, make=lambda: self.bits().reshape(shape), where=self.where)

    def __getitem__(self, idx) -> "Tensor":
        shape = _shape_of_index(self.shape, idx)
        first = idx[0] if isinstance(idx, tuple) and len(idx) == 1 else idx
        if self._span is not None and self.ndim and isinstance(first, (int, np.integer, slice)):
            # rows of a tensor stored in one piece: read only their bytes
            if isinstance(first, slice):
                start, _stop, step = first.indices(self.shape[0])
            else:
                start, step = int(first) + (self.shape[0] if first < 0 else 0), 1
            if step == 1:
                row = self.nbytes // self.shape[0] if self.shape[0] else 0
                base, span = start * row, self._span
                return Tensor(shape, self.stored, span=lambda b, n: span(base + b, n),
                              where=self.where)
        return Tensor(shape, self.stored, make=lambda: self.bits()[idx], where=self.where)

    def chunks(self, max_bytes=CHUNK_BYTES):
        """The stored bits, flattened, in pieces of at most max_bytes (whole elements); a tensor
        stored in one piece is read a piece at a time."""
        item, total = self.itemsize, self.nbytes
        if self._span is None:
            flat = self.bits().reshape(-1)
            step = max(1, max_bytes // item)
            for i in range(0, flat.size, step):
                yield flat[i:i + step]
            return
        step = max(item, max_bytes // item * item)
        for b in range(0, total, step):
            n = min(step, total - b)
            yield np.frombuffer(self._span(b, n), dtype=DTYPES[self.stored][0])


def _shape_of_reshape(shape, new):
    n = int(np.prod(shape, dtype=object))
    new = tuple(int(d) for d in new)
    if new.count(-1) == 1:
        rest = int(np.prod([d for d in new if d != -1], dtype=object))
        new = tuple(n // rest if d == -1 else d for d in new) if rest else new
    if int(np.prod(new, dtype=object)) != n or any(d < 0 for d in new):
        raise ValueError(f"cannot reshape {list(shape)} to {list(new)}")
    return new


def is_tensor(v) -> bool:
    return isinstance(v, (Tensor, np.ndarray))


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(v: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN."""
    u = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32)
    t = u >> 16  # one temporary, worked on in place: this runs on every chunk written
    t &= 1
    t += 0x7FFF
    t += u
    t >>= 16
    out = t.astype(np.uint16)
    nan = np.isnan(v)
    if nan.any():
        out[nan] = 0x7FC0
    return out


# --------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------

def _pread(f, offset, n):
    """n bytes of the open file f from offset (the file's name in the message if it is short)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = os.preadv(f.fileno(), [view[got:]], offset + got)
        if k <= 0:
            raise ConversionError(f"{f.name}: ends {n - got} bytes short of a tensor at byte "
                                  f"{offset + got} (truncated file?)")
        got += k
    return buf


def read_safetensors(path: str) -> dict:
    """{name: Tensor} of a safetensors file, its header checked (tools/safetensors_write.py)."""
    try:
        header, data_start = safetensors_write.read_header(path, DTYPES)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    f = open(path, "rb")  # closed when the last of its tensors goes
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin = data_start + info["data_offsets"][0]
        out[name] = Tensor(info["shape"], info["dtype"],
                           span=lambda b, n, begin=begin: _pread(f, begin + b, n),
                           where=f"{path}: '{name}'")
    return out


# --------------------------------------------------------------------------------------------
# torch.save's zip format
# --------------------------------------------------------------------------------------------

class _StorageType:
    def __init__(self, stored):
        self.stored = stored


_STORAGES = {
    "FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16",
    "BFloat16Storage": "BF16", "LongStorage": "I64", "IntStorage": "I32",
    "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8", "BoolStorage": "BOOL",
}
_TORCH_DTYPES = {"float32": "F32", "float": "F32", "float64": "F64", "double": "F64",
                 "float16": "F16", "half": "F16", "bfloat16": "BF16", "int64": "I64",
                 "long": "I64", "int32": "I32", "int": "I32", "int16": "I16", "int8": "I8",
                 "uint8": "U8", "bool": "BOOL"}


class _Storage:
    """A storage entry of the archive: where its bytes are and how many elements it holds."""

    def __init__(self, archive, entry, stored, numel):
        self.archive, self.entry, self.stored, self.numel = archive, entry, stored, numel

    def span(self, begin, n):
        with self.archive.zf.open(self.entry) as f:
            if begin:
                f.seek(begin)
            raw = f.read(n)
        if len(raw) != n:
            raise ConversionError(f"{self.archive.path}: entry '{self.entry.filename}' ends "
                                  f"{n - len(raw)} bytes short")
        return raw


def _int_list(v, what, where):
    if not isinstance(v, (tuple, list)) or len(v) > MAX_DIMS or \
            not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ConversionError(f"{where}: tensor {what} {v!r} is not a list of at most "
                              f"{MAX_DIMS} integers")
    if any(x < 0 for x in v):
        raise ConversionError(f"{where}: tensor {what} {list(v)} has a negative entry")
    return tuple(v)


def _rebuild_tensor(storage, storage_offset, size, stride, *_rest, **_kw):
    where = storage.archive.path if isinstance(storage, _Storage) else "checkpoint"
    if not isinstance(storage, _Storage):
        raise ConversionError(f"{where}: a tensor built on {type(storage).__name__}, not a storage")
    size = _int_list(size, "size", where)
    stride = _int_list(stride, "stride", where)
    if len(size) != len(stride):
        raise ConversionError(f"{where}: tensor size {list(size)} and stride {list(stride)} "
                              "differ in length")
    if not isinstance(storage_offset, int) or isinstance(storage_offset, bool) or storage_offset < 0:
        raise ConversionError(f"{where}: tensor storage offset {storage_offset!r}")
    numel = 1
    for d in size:
        numel *= d
    key = storage.entry.filename
    if numel and (numel > storage.numel
                  or storage_offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
                  > storage.numel):
        raise ConversionError(f"{where}: a tensor of size {list(size)}, stride {list(stride)}, "
                              f"offset {storage_offset} needs more than the {storage.numel} "
                              f"elements of its storage '{key}'")
    stored, item = storage.stored, np.dtype(DTYPES[storage.stored][0]).itemsize
    contiguous, run = True, 1
    for n, s in reversed(list(zip(size, stride))):
        if n != 1 and s != run:
            contiguous = False
        run *= n
    if not numel:
        return Tensor(size, stored, make=lambda: np.zeros(size, DTYPES[stored][0]), where=key)
    if contiguous:
        base = storage_offset * item
        return Tensor(size, stored, span=lambda b, n: storage.span(base + b, n), where=key)
    # a strided view (rare in state dicts): read the storage span it covers, then gather
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride))

    def make():
        raw = np.frombuffer(storage.span(storage_offset * item, extent * item),
                            dtype=DTYPES[stored][0])
        return np.lib.stride_tricks.as_strided(raw, size, [s * item for s in stride]).copy()
    return Tensor(size, stored, make=make, where=key)


def _rebuild_parameter(data, *_rest, **_kw):
    return data


class _TensorType:
    """torch.Tensor or torch.nn.Parameter, as _rebuild_from_type_v2 names the type to make."""


def _rebuild_from_type(func, new_type, args, state=None):
    """torch._tensor._rebuild_from_type_v2: a tensor rebuilt by func(*args) and given the type
    new_type and the Python attributes in state (as torch saves a tensor that carries some);
    the type must be a plain tensor's and the attributes are not kept."""
    if func is not _rebuild_tensor or new_type is not _TensorType or not isinstance(args, tuple):
        raise ConversionError("checkpoint: a tensor rebuilt by something other than "
                              "_rebuild_tensor_v2 into torch.Tensor")
    return func(*args)


class _TorchArchive:
    def __init__(self, path):
        self.path = path
        try:
            self.zf = zipfile.ZipFile(path)
            infos = self.zf.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise ConversionError(f"{path}: not a readable zip archive ({e})") from None
        self.entries = {}
        for info in infos:
            if info.filename in self.entries:
                raise ConversionError(f"{path}: the archive names '{info.filename}' twice")
            self.entries[info.filename] = info
        pkls = [n for n in self.entries if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise ConversionError(f"{path}: not a torch.save zip archive (no single "
                                  "ARCHIVE/data.pkl)")
        self.prefix = pkls[0][: -len("data.pkl")]
        order = self.entries.get(self.prefix + "byteorder")
        self.byteorder = self.read_small(order, 16).decode("ascii", "replace").strip() \
            if order else "little"
        if self.byteorder not in ("little", "big"):
            raise ConversionError(f"{path}: byteorder '{self.byteorder}'")
        if self.byteorder != sys.byteorder:
            raise ConversionError(f"{path}: saved {self.byteorder}-endian; arserve's converters "
                                  "read little-endian checkpoints")

    def check_entry(self, info, want=None):
        """Refuses an entry before any of it is inflated: compression, and its declared size."""
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ConversionError(f"{self.path}: entry '{info.filename}' uses compression "
                                  f"method {info.compress_type}; torch.save stores entries")
        if info.compress_type == zipfile.ZIP_DEFLATED and \
                info.file_size > MAX_INFLATE_RATIO * info.compress_size + (1 << 20):
            raise ConversionError(f"{self.path}: entry '{info.filename}' would inflate "
                                  f"{info.compress_size} bytes to {info.file_size}; refused")
        if want is not None and info.file_size != want:
            raise ConversionError(f"{self.path}: entry '{info.filename}' holds {info.file_size} "
                                  f"bytes, its storage declares {want}")

    def read_small(self, info, limit):
        self.check_entry(info)
        if info.file_size > limit:
            raise ConversionError(f"{self.path}: entry '{info.filename}' is {info.file_size} "
                                  f"bytes, over the {limit} this reader takes")
        with self.zf.open(info) as f:
            return f.read(limit + 1)[:limit]

    def storage(self, stype, key, numel):
        if not isinstance(stype, _StorageType):
            raise ConversionError(f"{self.path}: unsupported storage type {stype!r}")
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9_]{1,64}", key):
            raise ConversionError(f"{self.path}: storage key {key!r} is not a plain name")
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ConversionError(f"{self.path}: storage '{key}' declares {numel!r} elements")
        info = self.entries.get(f"{self.prefix}data/{key}")
        if info is None:
            raise ConversionError(f"{self.path}: storage '{key}' is not in the archive")
        self.check_entry(info, numel * np.dtype(DTYPES[stype.stored][0]).itemsize)
        return _Storage(self, info, stype.stored, numel)


_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): _TensorType,
    ("torch.nn.parameter", "Parameter"): _TensorType,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, archive: _TorchArchive, allowed: dict):
        super().__init__(f)
        self.archive, self.allowed = archive, allowed
        self.storages: dict = {}

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGES:
            return _StorageType(_STORAGES[name])
        if module == "torch" and name in _TORCH_DTYPES:  # storages saved as UntypedStorage
            return _StorageType(_TORCH_DTYPES[name])
        fn = _GLOBALS.get((module, name)) or self.allowed.get((module, name))
        if fn is None:
            raise ConversionError(f"{self.archive.path}: the checkpoint holds a {module}.{name} "
                                  "object; only tensors in (ordered) dicts are read")
        return fn

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ConversionError(f"{self.archive.path}: unsupported storage reference "
                                  f"{str(pid)[:80]}")
        _, stype, key, _location, numel = pid
        if key not in self.storages:
            self.storages[key] = self.archive.storage(stype, key, numel)
        st = self.storages[key]
        if st.stored != getattr(stype, "stored", None) or st.numel != numel:
            raise ConversionError(f"{self.archive.path}: storage '{key}' referenced with two "
                                  "types or sizes")
        return st


def read_torch(path: str, allowed: dict | None = None):
    """The object a zip-format torch.save wrote at path, tensors as lazy Tensors. `allowed`
    maps extra (module, name) globals to the callables that stand for them."""
    archive = _TorchArchive(path)
    info = archive.entries[archive.prefix + "data.pkl"]
    raw = archive.read_small(info, MAX_PICKLE_BYTES)
    try:
        return _Unpickler(io.BytesIO(raw), archive, allowed or {}).load()
    except ConversionError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, RecursionError, OverflowError, MemoryError) as e:
        raise ConversionError(f"{path}: data.pkl is not a checkpoint this reader takes "
                              f"({type(e).__name__}: {str(e)[:120]})") from None


def read_file(path: str, allowed: dict | None = None):
    """A safetensors file as {name: Tensor}, or what a zip-format torch.save wrote."""
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: no such file")
    if path.endswith(".safetensors"):
        return read_safetensors(path)
    if zipfile.is_zipfile(path):
        return read_torch(path, allowed)
    raise ConversionError(f"{path}: neither safetensors nor a zip-format torch checkpoint (the "
                          "legacy pre-1.6 format: load and re-save it with torch.save first)")


def state_dict(obj, path: str, what: str) -> dict:
    if not isinstance(obj, dict) or not all(isinstance(k, str) and is_tensor(v)
                                            for k, v in obj.items()):
        kinds = sorted(map(str, obj))[:6] if isinstance(obj, dict) else type(obj).__name__
        raise ConversionError(f"{path}: expected {what} as a state dict of tensors, found {kinds}")
    return dict(obj)


def shard_files(folder: str, index_names=None) -> list[str]:
    """The weight files of a folder: those its *.index.json weight map names (each a plain
    file name in the folder), else every *.safetensors / *.pth / *.bin file in it."""
    names = sorted(os.listdir(folder))
    idx = [n for n in names if n.endswith(".index.json") and
           (index_names is None or n in index_names)]
    if len(idx) > 1:
        raise ConversionError(f"{folder}: several weight maps ({', '.join(idx)})")
    if not idx:
        files = [n for n in names if n.endswith((".safetensors", ".pth", ".bin"))]
        if not files:
            raise ConversionError(f"{folder}: a folder without an *.index.json or weight files")
        return [os.path.join(folder, n) for n in files]
    where = os.path.join(folder, idx[0])
    try:
        with open(where, encoding="utf-8") as f:
            wm = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise ConversionError(f"{where}: not a weight map ({e})") from None
    if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
        raise ConversionError(f"{where}: no weight_map of tensor names to shard files")
    files = sorted(set(wm.values()))
    for s in files:
        if os.path.basename(s) != s or s.startswith(".") or not s:
            raise ConversionError(f"{where}: shard '{s}' is not a file name in the folder")
    missing = [s for s in files if not os.path.isfile(os.path.join(folder, s))]
    if missing:
        raise ConversionError(f"{where}: shards missing: {', '.join(missing[:4])}")
    return [os.path.join(folder, s) for s in files]


def read_shards(paths: list[str], what: str, allowed=None) -> dict:
    """The union of the state dicts in paths; a tensor in two shards is refused."""
    sd, origin = {}, {}
    for p in paths:
        for k, v in state_dict(read_file(p, allowed), p, what).items():
            if k in sd:
                raise ConversionError(f"{p}: tensor '{k}' is also in {origin[k]}")
            sd[k], origin[k] = v, p
    return sd


def equal(a, b, max_bytes=CHUNK_BYTES) -> bool:
    """a == b everywhere, read a piece at a time."""
    a = a if isinstance(a, Tensor) else Tensor.of(a)
    b = b if isinstance(b, Tensor) else Tensor.of(b)
    if a.shape != b.shape:
        return False
    return all(np.array_equal(_values(x, a.stored), _values(y, b.stored))
               for x, y in zip(a.chunks(max_bytes), b.chunks(max_bytes * b.itemsize // a.itemsize)))


def _values(bits, stored):
    if stored == "BF16":
        return _bf16_to_f32(bits)
    return quant.e4m3_to_f32(bits) if stored == "F8_E4M3" else bits


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------

OUT_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
# A converter's --dtype: a float type for every matrix, or 8-bit Linear weights (quant.py).
DTYPE_CHOICES = (*OUT_TYPES, *quant.KINDS)


def out_type(t: Tensor, dtype: str) -> str:
    """The type a tensor is written in: matrices (2 or more dimensions) in the requested float
    type (`keep`, `int8` and `fp8`: as stored; the Linear weights stored in 8 bits are picked
    by name, write_safetensors' `quantise`), vectors and scalars as stored (the released
    Infinity checkpoints keep biases and norms in f32 beside bf16 matrices), F64 as F32."""
    if t.stored not in FLOATS:
        raise ConversionError(f"{t.where}: stored as {t.stored}, expected floating point")
    if t.ndim >= 2 and dtype in OUT_TYPES:
        return OUT_TYPES[dtype]
    return "F32" if t.stored == "F64" else t.stored


def _convert(bits: np.ndarray, src: str, dst: str, where: str) -> np.ndarray:
    if src == dst:
        return bits
    vals = _bf16_to_f32(bits) if src == "BF16" else bits
    if dst == "BF16":
        return _f32_to_bf16(vals)
    if dst == "F16":
        finite = np.isfinite(vals)
        big = float(np.abs(vals[finite]).max()) if finite.any() else 0.0
        if big > 65504.0:
            raise ConversionError(f"{where}: a value of magnitude {big:g} does not fit float16; "
                                  "use --dtype bf16 or f32")
        return vals.astype(np.float16)
    return vals.astype(np.float32)


def write_safetensors(path: str, tensors: dict, dtype: str, metadata=None, log=None,
                      quantise=()) -> dict:
    """Writes tensors ({name: Tensor or array}) to path, each matrix in `dtype` (f32, f16,
    bf16 or keep) and every other tensor as stored, one chunk at a time, through path.partial
    (removed on failure). With `dtype` int8 or fp8 the tensors named in `quantise` (Linear
    weights, quant.linear_names) are written in 8 bits, each followed by NAME_scale, a block
    of rows at a time (quant.entries), and every other tensor as stored (F64 as F32); the
    metadata's `quantized_from` then names the type most of them were stored in, which the
    engine counts them as when it picks the weights' type (the KV cache's by default).
    Returns {name: type written}. `log` gets a progress line every few seconds."""
    if dtype not in (*OUT_TYPES, "keep", *quant.KINDS):
        raise ValueError(f"dtype {dtype!r}")
    items = {k: (v if isinstance(v, Tensor) else Tensor.of(v, k)) for k, v in tensors.items()}
    quantise = set(quantise)
    if quantise and dtype not in quant.KINDS or not quantise <= items.keys():
        raise ValueError(f"quantise {sorted(quantise)[:4]} with dtype {dtype!r}: only tensors "
                         "written, and only with int8 or fp8")
    for k, t in items.items():
        if not t.where:
            t.where = k
    if quantise:
        stored = collections.Counter(
            "F32" if items[k].stored == "F64" else items[k].stored for k in sorted(quantise))
        metadata = {**(metadata or {}), "quantized_from": stored.most_common(1)[0][0]}
    entries = []
    for k, t in items.items():
        if k not in quantise:
            dst = out_type(t, dtype)
            entries.append((k, dst, t.shape,
                            (lambda t=t, dst=dst: (_convert(c, t.stored, dst, t.where)
                                                   for c in t.chunks()))))
            continue
        if k + quant.SCALE_SUFFIX in items:
            raise ConversionError(f"{t.where}: the model already has a tensor "
                                  f"'{k}{quant.SCALE_SUFFIX}', the name of its 8-bit scales")
        if t.stored not in FLOATS:
            raise ConversionError(f"{t.where}: stored as {t.stored}, expected floating point")
        try:
            entries += quant.entries(k, t, dtype, CHUNK_BYTES)
        except quant.QuantError as e:
            raise ConversionError(str(e)) from None
    types = {name: dst for name, dst, _shape, _pieces in entries}
    total = sum(int(np.prod(shape, dtype=object)) * safetensors_write.ITEMSIZE[dst]
                for _name, dst, shape, _pieces in entries)
    last = [time.monotonic(), 0]

    def progress(done):
        now = time.monotonic()
        if log and now - last[0] >= 5:
            log(f"wrote {done / 1e9:.2f} of {total / 1e9:.2f} GB ({100 * done / max(total, 1):.0f}%)")
            last[0] = now
    tmp = path + ".partial"
    try:
        try:
            safetensors_write.write_stream(tmp, entries, metadata, progress)
        except quant.QuantError as e:  # a weight that cannot be quantised, found on the way
            raise ConversionError(str(e)) from None
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return types


def quantised_names(manifest: dict, tensors, dtype: str, heads: bool = False) -> list[str]:
    """The tensors stored in 8 bits for `dtype` int8 or fp8 (none for a float dtype) in a
    model of manifest's family and architecture (quant.linear_names); none found, or
    `heads` without an 8-bit dtype, is an error."""
    if dtype not in quant.KINDS:
        if heads:
            raise ConversionError("--quantize-heads needs --dtype int8 or fp8")
        return []
    family, arch = manifest.get("family"), manifest.get("architecture")
    try:
        names = quant.linear_names(family, arch, tensors, heads)
    except quant.QuantError as e:
        raise ConversionError(str(e)) from None
    if not names:
        raise ConversionError(f"{family}/{arch}: none of the model's tensors is a Linear weight "
                              "to quantise")
    return names


def write_model(out_dir: str, tensors: dict, dtype: str, source: str, prog: str,
                manifest: dict | None = None, quantize_heads: bool = False) -> dict:
    """OUT_DIR/model.safetensors from a converter's tensors (write_safetensors), progress on
    stderr as `prog: ...`; an OUT_DIR this call made is removed again if the write fails.
    With `dtype` int8 or fp8 the Linear weights of manifest's architecture (the blocks', and
    with quantize_heads the others too) are written in 8 bits, the rest as stored, and the
    file's metadata says so (`quantization`)."""
    names = quantised_names(manifest or {}, tensors, dtype, quantize_heads)
    metadata = {"format": "pt", "source": source}
    if names:
        metadata["quantization"] = quant.describe(dtype, quantize_heads)
    made = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        return write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, dtype,
                                 metadata,
                                 lambda line: print(f"{prog}: {line}", file=sys.stderr, flush=True),
                                 names)
    except BaseException:
        if made and not os.listdir(out_dir):
            os.rmdir(out_dir)
        raise


# Runs a script as `python3 SCRIPT ARGS...` would and writes the process's own peak RSS on exit:
# VmHWM of its memory map, not getrusage's ru_maxrss, which a child started by fork or vfork
# inherits from its parent's high-water mark across exec.
_MEASURED = """import atexit, runpy, sys
def peak():
    with open("/proc/self/status") as f:
        return next(line.split()[1] for line in f if line.startswith("VmHWM:"))
out, sys.argv = sys.argv[1], sys.argv[2:]
atexit.register(lambda: open(out, "w").write(peak()))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_measured(argv, **kw):
    """(subprocess.run's result, peak RSS in bytes) of `python3 argv...` (argv[0] a script),
    the converters' memory as a user's `/usr/bin/time -v` would report it; kw go to run."""
    import subprocess
    import tempfile
    with tempfile.NamedTemporaryFile("r") as rss:
        p = subprocess.run([sys.executable, "-c", _MEASURED, rss.name, *map(str, argv)], **kw)
        return p, int(rss.read() or 0) * 1024


def _self_check():
    import tempfile
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "a.safetensors")
        safetensors_write.write(p, {"a": a, "b": np.arange(3, dtype=np.float32)})
        t = read_safetensors(p)
        assert np.array_equal(t["a"], a) and np.array_equal(t["a"][2:4], a[2:4])
        assert np.array_equal(t["a"][3], a[3]) and np.array_equal(t["a"].reshape(7, 5), a.reshape(7, 5))
        assert np.array_equal(t["a"][:, 1], a[:, 1])
        q = os.path.join(d, "q.safetensors")
        types = write_safetensors(q, {"a": t["a"], "b": t["b"]}, "bf16")
        assert types == {"a": "BF16", "b": "F32"}, types
        back = safetensors_write.read(q)
        assert np.array_equal(back["a"][1], _f32_to_bf16(a))
        q8 = os.path.join(d, "q8.safetensors")
        types = write_safetensors(q8, {"a": t["a"], "b": t["b"]}, "int8", quantise=["a"])
        assert types == {"a": "I8", "a_scale": "F32", "b": "F32"}, types
        back = safetensors_write.read(q8)
        want, scale = quant.quantise_rows(a, "int8")
        assert np.array_equal(back["a"], want) and np.array_equal(back["a_scale"], scale)
    print("ckpt self-check ok")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-check"]:
        _self_check()
    else:
        sys.exit(__doc__)
