"""8-bit Linear weights (docs/model-format.md, "8-bit Linear weights"): which tensors of each
architecture are stored in 8 bits, and the int8 and fp8 (e4m3) quantisers, symmetric with one
scale per output row, run a block of rows at a time so that a model of any size quantises in
bounded memory. The converters (`--dtype int8|fp8`, through ckpt.write_safetensors) and
tools/quantize.py use this module; it needs numpy only.

int8: scale = max |w| / 127 of the row, q = w / scale rounded to nearest, ties to even, clipped
to [-127, 127]. fp8: scale = max |w| / 448, q = the nearest e4m3 of w / scale, ties to even,
saturating at 448 (base/dtype.h's f32_to_f8e4m3, bit for bit). All of it in float32 on the
stored values widened to float32 (bf16 exactly); a row of zeros has scale 0 and q 0.
Self-check by hand: python3 tools/convert/quant.py --self-check
"""

from __future__ import annotations

import re
import sys

import numpy as np

# --dtype -> the safetensors type of the 8-bit values
KINDS = {"int8": "I8", "fp8": "F8_E4M3"}
# the largest 8-bit magnitude a row's max |w| maps to
QMAX = {"int8": 127.0, "fp8": 448.0}
# NAME's scales are the tensor NAME + SCALE_SUFFIX, F32 [out]
SCALE_SUFFIX = "_scale"
# Values (as float32) quantised at once: a block of whole rows of about this many bytes.
BLOCK_BYTES = 8 << 20


class QuantError(ValueError):
    """A tensor that cannot be quantised (not finite, not a matrix, not floating point)."""


# The tensors stored in 8 bits, per (family, architecture): exactly the matrices the engine
# reads as Linear weights (weight_load_linear, weight_load_linear_rows, weight_load_linear_stack,
# weight_load_qkv_biased) inside the transformer blocks, engine/family/raster.c, var.c and
# infinity.c (Infinity's T5 encoder blocks included). Embeddings, norms, biases, convolutions,
# T5's relative attention bias and what the engine reads with weight_read_f32 (VAR's and
# Infinity's ada_gss and scale_mul, the attentive pool's query) are never in these lists.
_BLOCKS = {
    ("raster", "janus"): (
        r"llm\.layers\.\d+\.attn\.(q|k|v|o)\.weight",
        r"llm\.layers\.\d+\.mlp\.(gate|up|down)\.weight",
    ),
    ("raster", "llamagen"): (
        r"llm\.layers\.\d+\.attn\.(wqkv|o)\.weight",
        r"llm\.layers\.\d+\.mlp\.(gate|up|down)\.weight",
    ),
    ("scale", "var"): (
        # adaln only where each block has its own (llm.shared_adaln false)
        r"var\.blocks\.\d+\.(adaln|attn\.qkv|attn\.proj|ffn\.fc1|ffn\.fc2)\.weight",
    ),
    ("scale", "infinity"): (
        r"inf\.blocks\.\d+\.(sa\.mat_qkv|sa\.proj|ca\.mat_q|ca\.mat_kv|ca\.proj|ffn\.fc1|ffn\.fc2)"
        r"\.weight",
        r"t5\.block\.\d+\.layer\.0\.SelfAttention\.(q|k|v|o)\.weight",
        r"t5\.block\.\d+\.layer\.1\.DenseReluDense\.(wi_0|wi_1|wo)\.weight",
    ),
}
# With --quantize-heads, also the other matrices the engine reads as Linear weights: the
# generation heads, Janus's aligner, VAR's and Infinity's word_embed (a Linear from the
# codebook's or the bits' width), the shared and head AdaLN, Infinity's text projections.
_HEADS = {
    ("raster", "janus"): (r"gen\.aligner\.\d+\.weight", r"gen\.head\.fc(1|2)\.weight"),
    ("raster", "llamagen"): (r"gen\.head\.weight",),
    ("scale", "var"): (r"var\.(word_embed|shared_adaln|head_adaln|head)\.weight",),
    ("scale", "infinity"): (
        r"inf\.text_proj_for_sos\.ca\.(mat_kv|proj)\.weight",
        r"inf\.text_proj_for_ca\.(0|2)\.weight",
        r"inf\.(shared_ada_lin\.1|head_nm\.ada_lin\.1|head|word_embed)\.weight",
    ),
}
ARCHITECTURES = tuple(_BLOCKS)


def linear_names(family: str, architecture: str, names, heads: bool = False) -> list[str]:
    """The names among `names` stored in 8 bits for a model of this family and architecture:
    the block Linears, and with `heads` the other Linears too."""
    key = (family, architecture)
    if key not in _BLOCKS:
        known = ", ".join(f"{f}/{a}" for f, a in ARCHITECTURES)
        raise QuantError(f"family '{family}', architecture '{architecture}': no list of Linear "
                         f"weights to quantise (known: {known})")
    pattern = re.compile("|".join(_BLOCKS[key] + (_HEADS[key] if heads else ())))
    return sorted(n for n in names if pattern.fullmatch(n))


def describe(kind: str, heads: bool) -> str:
    """One line saying what a model quantised this way holds (model cards, file metadata)."""
    which = "block and head Linears" if heads else "block Linears"
    return f"{which} {kind} per output channel (NAME{SCALE_SUFFIX}), the rest as released"


# --------------------------------------------------------------------------------------------
# fp8 e4m3
# --------------------------------------------------------------------------------------------

def f32_to_e4m3(x) -> np.ndarray:
    """The e4m3 ("e4m3fn") bits of float32 values: round to nearest even, a magnitude past 448
    (infinity included) saturating to 448, NaN to 0x7f with its sign; base/dtype.h's
    f32_to_f8e4m3 for every float32, vectorised."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    # normal results: the exponent (rebiased 127 -> 7) and 3 mantissa bits are a >> 20 less
    # 120 << 3, rounded by the 20 bits dropped; below 2^-6 this wraps and is replaced
    code = a >> np.uint32(20)
    code -= np.uint32(120 << 3)
    rest = a & np.uint32(0xFFFFF)
    half = np.uint32(0x80000)
    code += (rest > half) | ((rest == half) & (code & np.uint32(1)).astype(bool))
    small = a < np.uint32(0x3C800000)  # below 2^-6: subnormals, multiples of 2^-9
    if small.any():
        code[small] = np.rint(a[small].view(np.float32) * np.float32(512.0))
    code[a >= np.uint32(0x43E00000)] = 0x7E  # 448 or more
    code[a > np.uint32(0x7F800000)] = 0x7F  # NaN
    out = code.astype(np.uint8)
    out |= (u >> np.uint32(24)).astype(np.uint8) & np.uint8(0x80)
    return out


def _e4m3_table() -> np.ndarray:
    b = np.arange(256)
    exp, man = (b >> 3) & 15, b & 7
    mag = np.where(exp == 0, man / 512.0, 2.0 ** (exp - 7.0) * (1 + man / 8.0))
    mag[(exp == 15) & (man == 7)] = np.nan
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_table()  # bits -> value, the 256 codes (0x7f and 0xff NaN)


def e4m3_to_f32(bits) -> np.ndarray:
    return E4M3_VALUES[np.asarray(bits, dtype=np.uint8)]


# --------------------------------------------------------------------------------------------
# quantising
# --------------------------------------------------------------------------------------------

def quantise_rows(v, kind: str, where: str = "tensor", row0: int = 0):
    """(8-bit values, float32 scales) of the float32 rows v ([rows, in]): int8 values as int8,
    fp8 as their uint8 bits. A row holding NaN or an infinity is refused, naming where and
    the row (row0 + its index)."""
    v = np.asarray(v, dtype=np.float32)
    if v.ndim != 2:
        raise QuantError(f"{where}: rows of shape {list(v.shape)}, expected [rows, in]")
    amax = np.max(np.abs(v), axis=1, initial=np.float32(0))  # NaN propagates
    bad = np.flatnonzero(~np.isfinite(amax))
    if bad.size:
        r = int(bad[0])
        what = "NaN" if np.isnan(v[r]).any() else "an infinity"
        raise QuantError(f"{where}: row {row0 + r} holds {what}; only finite weights can be "
                         f"quantised ({bad.size} such row{'s' if bad.size > 1 else ''} in "
                         f"rows {row0}..{row0 + len(v) - 1})")
    scale = (amax / np.float32(QMAX[kind])).astype(np.float32)
    live = scale > 0  # 0 for a row of zeros (or of values too small to have a float32 scale)
    x = v / np.where(live, scale, np.float32(1))[:, None]
    if kind == "int8":
        np.rint(x, out=x)
        np.clip(x, -127, 127, out=x)
        q = x.astype(np.int8)
    elif kind == "fp8":
        q = f32_to_e4m3(x)
    else:
        raise QuantError(f"{where}: unknown 8-bit type '{kind}' (int8 or fp8)")
    q[~live] = 0
    return q, scale


def dequantise(q, scale, kind: str) -> np.ndarray:
    """Row n of the float32 matrix: q's row n times scale[n], as the engine reads it."""
    vals = e4m3_to_f32(q) if kind == "fp8" else np.asarray(q, dtype=np.float32)
    return vals * np.asarray(scale, dtype=np.float32)[:, None]


def float_tensors(tensors: dict) -> dict:
    """safetensors_write.read's tensors as float32 arrays, the values the engine computes
    with: BF16 widened, each 8-bit Linear weight (I8, or ('F8_E4M3', bits)) times its
    NAME_scale rows, the scales themselves left out."""
    out = {}
    for name, v in tensors.items():
        if name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in tensors:
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        stored, bits = v if isinstance(v, tuple) else (None, v)
        if scale is not None:
            out[name] = dequantise(bits, scale, "fp8" if stored == "F8_E4M3" else "int8")
        elif stored is not None:
            out[name] = _widen(bits, stored)
        else:
            out[name] = np.asarray(v, dtype=np.float32)
    return out


def _widen(bits: np.ndarray, stored: str) -> np.ndarray:
    if stored == "BF16":
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if stored in ("F32", "F16", "F64"):
        return bits.astype(np.float32, copy=False)
    raise QuantError(f"stored as {stored}, expected floating point")


def row_blocks(t, block_bytes: int = BLOCK_BYTES):
    """(first row, float32 rows) of the matrix t, a block of whole rows at a time.

    t is a ckpt.Tensor or anything with its shape, stored (a safetensors float type),
    itemsize and chunks(max_bytes): the stored bits flattened, read in pieces of at most
    max_bytes, which a whole number of rows' bytes makes row-aligned."""
    rows, cols = t.shape
    if rows == 0 or cols == 0:
        yield 0, np.zeros((rows, cols), np.float32)
        return
    n = max(1, block_bytes // (4 * cols))
    r0 = 0
    for piece in t.chunks(n * cols * t.itemsize):
        try:
            v = _widen(piece, t.stored).reshape(-1, cols)
        except QuantError as e:
            raise QuantError(f"{t.where}: {e}") from None
        yield r0, v
        r0 += len(v)
    if r0 != rows:
        raise QuantError(f"{t.where}: read {r0} rows of {rows}")


def entries(name: str, t, kind: str, block_bytes: int = BLOCK_BYTES) -> list:
    """The two entries (name, dtype, shape, pieces) of safetensors_write.write_stream for the
    matrix t quantised: NAME, its 8-bit values, and NAME_scale, F32 [out].

    One pass over t gives both: NAME's pieces() quantises a block of rows at a time and keeps
    the scales (4 bytes a row) for NAME_scale's, which the file writes later (NAME sorts
    before NAME + "_scale"); asked first, NAME_scale's pieces() computes them itself."""
    if kind not in KINDS:
        raise QuantError(f"{t.where or name}: unknown 8-bit type '{kind}' (int8 or fp8)")
    if len(t.shape) != 2:
        raise QuantError(f"{t.where or name}: shape {list(t.shape)} is not a Linear weight's "
                         "[out, in]")
    where = t.where or name
    kept = {}

    def scales_of(blocks):
        out = np.zeros(t.shape[0], np.float32)
        for r0, v in blocks:
            q, s = quantise_rows(v, kind, where, r0)
            out[r0:r0 + len(s)] = s
            yield q
        kept["scale"] = out

    def values():
        return scales_of(row_blocks(t, block_bytes))

    def scale():
        if "scale" not in kept:
            for _ in scales_of(row_blocks(t, block_bytes)):
                pass
        yield kept.pop("scale")

    return [(name, KINDS[kind], tuple(t.shape), values),
            (name + SCALE_SUFFIX, "F32", (t.shape[0],), scale)]


def _self_check():
    # ties to even, saturation and NaN of f32_to_e4m3 against values worked by hand
    x = np.array([0.0, -0.0, 1.0, 448.0, 464.0, 1e9, np.inf, -np.inf, np.nan, 2.0 ** -9,
                  2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875, 2.0 ** -6], np.float32)
    want = [0x00, 0x80, 0x38, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x01, 0x00, 0x02, 0x38, 0x3A,
            0x08]
    assert f32_to_e4m3(x).tolist() == want, [hex(b) for b in f32_to_e4m3(x)]
    assert np.array_equal(e4m3_to_f32(f32_to_e4m3(E4M3_VALUES[:0x7F])), E4M3_VALUES[:0x7F])
    w = np.array([[0.5, 1.5, 2.5, -127.0], [0, 0, 0, 0]], np.float32)
    q, s = quantise_rows(w, "int8")
    assert q.tolist() == [[0, 2, 2, -127], [0, 0, 0, 0]] and s.tolist() == [1.0, 0.0]
    q, s = quantise_rows(w * np.float32(448 / 127), "fp8")
    assert s[0] == np.float32(127.0 * np.float32(448 / 127)) / np.float32(448)
    assert linear_names("raster", "janus", ["llm.layers.3.attn.q.weight", "llm.embed.weight",
                                            "gen.head.fc1.weight"]) == ["llm.layers.3.attn.q.weight"]
    print("quant self-check ok")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-check"]:
        _self_check()
    else:
        sys.exit(__doc__)
