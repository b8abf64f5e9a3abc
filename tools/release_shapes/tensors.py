"""What one tensor of a release is (name, shape, dtype, how to fill it) and the deterministic
filler: each tensor draws from its own generator seeded by (seed, sha256 of its name), in
chunks of whole rows, so its bytes depend on neither the write order nor the chunk size."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

# dtype tag -> (numpy dtype of the stored bytes, torch storage class, safetensors dtype)
DTYPES = {
    "f32": (np.dtype("<f4"), "FloatStorage", "F32"),
    "bf16": (np.dtype("<u2"), "BFloat16Storage", "BF16"),
    "f16": (np.dtype("<f2"), "HalfStorage", "F16"),
    "i64": (np.dtype("<i8"), "LongStorage", "I64"),
}

CHUNK_VALUES = 1 << 22  # values per generated chunk (16 MiB of f32): bounds memory, not output


@dataclass(frozen=True)
class Tensor:
    """One tensor of a checkpoint. `init` is a tuple naming the filler (see `fill_chunks`);
    `buffer` marks registered buffers, which the parameter count leaves out."""

    name: str
    shape: tuple
    dtype: str
    init: tuple
    buffer: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype][0].itemsize


# ---- constructors used by the model tables -------------------------------------------------

def linear(name, out_f, in_f, dtype, gain=1.0):
    """nn.Linear / 1x1-conv weight: N(0, gain^2 / fan_in), the variance-preserving scale."""
    return Tensor(name, (out_f, in_f), dtype, ("normal", gain / math.sqrt(in_f), 0.0))


def conv(name, out_c, in_c, k, dtype, gain=1.0):
    return Tensor(name, (out_c, in_c, k, k), dtype, ("normal", gain / math.sqrt(in_c * k * k), 0.0))


def bias(name, n, dtype, std=0.02):
    return Tensor(name, (n,), dtype, ("normal", std, 0.0))


def norm_weight(name, n, dtype):
    """RMSNorm / LayerNorm / GroupNorm scale: 1 with a little noise (trained scales are near 1)."""
    return Tensor(name, (n,), dtype, ("normal", 0.02, 1.0))


def normal(name, shape, dtype, std, mean=0.0, buffer=False):
    return Tensor(name, tuple(shape), dtype, ("normal", std, mean), buffer)


def const(name, shape, dtype, value, buffer=False):
    return Tensor(name, tuple(shape), dtype, ("const", value), buffer)


def unit_rows(name, shape, dtype):
    """A code book whose rows the model L2-normalises (LlamaGen's / Janus's VQ-16)."""
    return Tensor(name, tuple(shape), dtype, ("unit_rows",))


# ---- filling -------------------------------------------------------------------------------

def generator(seed: int, name: str) -> np.random.Generator:
    h = hashlib.sha256(name.encode("utf-8")).digest()
    words = [int.from_bytes(h[i:i + 4], "little") for i in range(0, 16, 4)]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & 0xFFFFFFFF, *words])))


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even as torch does."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)


def _finish(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return to_bf16_bits(values)
    return values.astype(DTYPES[dtype][0], copy=False)


def fill_chunks(t: Tensor, seed: int):
    """Yields t's stored bytes (little-endian numpy arrays), in order, a chunk of rows at a time."""
    kind = t.init[0]
    n = t.numel
    row = t.shape[-1] if t.shape else 1
    if kind == "values":  # exact contents given by the table (small buffers)
        yield _finish(np.asarray(t.init[1]).reshape(-1), t.dtype)
        return
    if n == 0:
        return
    rows_per = max(1, CHUNK_VALUES // max(row, 1))
    rng = generator(seed, t.name) if kind in ("normal", "unit_rows", "ints") else None
    done = 0
    while done < n:
        count = min(rows_per * row, n - done)
        if kind == "normal":
            std, mean = t.init[1], t.init[2]
            v = rng.standard_normal(count, dtype=np.float32)
            if std != 1.0:
                v *= np.float32(std)
            if mean:
                v += np.float32(mean)
        elif kind == "unit_rows":
            v = rng.standard_normal(count, dtype=np.float32).reshape(-1, row)
            v /= np.linalg.norm(v, axis=1, keepdims=True)
            v = v.reshape(-1)
        elif kind == "ints":  # integer-valued floats in [0, hi), e.g. a usage ring of code ids
            v = rng.integers(0, t.init[1], count).astype(np.float32)
        elif kind == "const":
            v = np.full(count, t.init[1], dtype=np.float64 if t.dtype == "i64" else np.float32)
        else:
            raise ValueError(f"{t.name}: unknown filler {kind!r}")
        yield _finish(v, t.dtype)
        done += count


def values(t: Tensor, seed: int) -> np.ndarray:
    """The whole tensor as stored (tests and small tensors only)."""
    parts = list(fill_chunks(t, seed))
    flat = np.concatenate(parts) if parts else np.zeros(0, DTYPES[t.dtype][0])
    return flat.reshape(t.shape)
