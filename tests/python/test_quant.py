"""tools/convert/quant.py, the 8-bit Linear weights' quantisers and lists: int8 and fp8 values
against an independent float64 reference, fp8 rounding against a line-by-line port of
base/dtype.h's f32_to_f8e4m3 over float32's edge cases and random bit patterns, ties to even,
saturation, zero rows, non-finite weights refused by row, row blocks of any size giving the
same file, and each architecture's list matching the tiny models' tensors exactly.

    .venv/bin/python -m pytest tests/python/test_quant.py -q
"""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")
GOLDEN = os.path.join(ROOT, "tests", "golden")
sys.path.insert(0, os.path.join(TOOLS, "convert"))
sys.path.insert(0, TOOLS)
import ckpt  # noqa: E402
import quant  # noqa: E402
import safetensors_write  # noqa: E402

U = 2.0 ** -149  # the smallest float32 subnormal


# ---- references --------------------------------------------------------------------------

def f8_scalar(f: float) -> int:
    """base/dtype.h's f32_to_f8e4m3, statement by statement, on one float32."""
    (u,) = struct.unpack("<I", struct.pack("<f", f))
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7F
    if a >= 0x43E00000:
        return sign | 0x7E
    if a < 0x3C800000:
        (m,) = struct.unpack("<f", struct.pack("<I", a))
        return sign | round(m * 512.0)  # nearbyintf in the default mode: ties to even
    kept = (((a >> 23) - 127 + 7) << 3) | ((a >> 20) & 7)
    rest, half = a & 0xFFFFF, 0x80000
    code = kept + (rest > half or (rest == half and (kept & 1)))
    return sign | min(code, 0x7E)


def _e4m3_positive():
    """The 127 finite non-negative e4m3 values, code order (= value order), from the format's
    definition: exponent bias 7, 3 mantissa bits, subnormals m / 512."""
    vals = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        vals.append(m / 512.0 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8.0))
    return np.array(vals)


E4M3 = _e4m3_positive()


def e4m3_ref(x) -> np.ndarray:
    """The nearest e4m3 code of each value (float64 arithmetic on the table above), ties to
    the even code, magnitudes past 448 saturating to 448, NaN 0x7f; the sign bit kept."""
    with np.errstate(invalid="ignore"):  # signalling NaNs among random bit patterns
        x = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(x), 448.0)
    i = np.clip(np.searchsorted(E4M3, mag), 1, len(E4M3) - 1)
    lo, hi = E4M3[i - 1], E4M3[i]
    up = (hi - mag < mag - lo) | ((hi - mag == mag - lo) & (i % 2 == 0))
    code = np.where(up, i, i - 1)
    code = np.where(np.isnan(x), 0x7F, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def near_tie(x64) -> np.ndarray:
    """Where a float64 quotient is so near a rounding tie that the float32 quotient the
    quantiser rounds (as the format says) may fall on either side."""
    return np.abs(np.abs(x64) % 1.0 - 0.5) <= np.abs(x64) * 2.0 ** -22


def int8_ref(w):
    """(q, scale) from the format's definition in float64: scale the float32 of max |w| / 127
    (float32 division, which float64 division then rounding reproduces), q the quotient
    rounded half to even and clipped."""
    w64 = np.asarray(w, dtype=np.float64)
    scale = (np.abs(w64).max(axis=1) / 127.0).astype(np.float32)
    s64 = scale.astype(np.float64)[:, None]
    x = np.divide(w64, s64, out=np.zeros_like(w64), where=s64 > 0)
    return np.clip(np.round(x), -127, 127), scale, x


def e4m3_spacing(x):
    """The gap between e4m3 values around |x| (its binade's, 2^-9 below 2^-6)."""
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -6)))
    return 2.0 ** (e - 3)


# ---- fp8 rounding ------------------------------------------------------------------------

def edge_floats() -> np.ndarray:
    f32 = np.float32
    vals = list(E4M3) + list((E4M3[1:] + E4M3[:-1]) / 2)  # every value and every midpoint
    vals += [448.0, 464.0, 479.0, 480.0, 1e30, float(np.finfo(f32).max), np.inf, np.nan,
             U, 2 * U, 2.0 ** -126, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -6, 2.0 ** -7, 1e-20,
             0.0, 1.0 + 2.0 ** -23]
    x = np.array(vals, dtype=f32)
    with np.errstate(over="ignore"):  # float32's max steps up to infinity
        x = np.concatenate([x, np.nextafter(x, f32(np.inf)), np.nextafter(x, f32(0))])
    return np.concatenate([x, -x])


def test_fp8_rounding_is_the_engines_bit_for_bit():
    rng = np.random.default_rng(64)
    edges = edge_floats()
    random_bits = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32)
    scalar_set = np.concatenate([edges, random_bits.view(np.float32)])
    got = quant.f32_to_e4m3(scalar_set)
    want = np.array([f8_scalar(float(f)) for f in scalar_set], dtype=np.uint8)
    bad = np.flatnonzero(got != want)
    assert not bad.size, [(float(scalar_set[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]

    # every 4093rd float32 bit pattern and a million random ones, against the table
    sweep = np.concatenate([np.arange(0, 2 ** 32, 4093, dtype=np.uint64).astype(np.uint32),
                            rng.integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(np.uint32)])
    x = np.concatenate([edges, sweep.view(np.float32)])
    got, want = quant.f32_to_e4m3(x), e4m3_ref(x)
    bad = np.flatnonzero(got != want)
    assert not bad.size, [(float(x[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


def test_fp8_decoding_inverts_encoding():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    assert np.array_equal(quant.f32_to_e4m3(quant.e4m3_to_f32(codes)), codes)
    assert np.array_equal(quant.e4m3_to_f32(codes[:0x7F]).astype(np.float64), E4M3)
    assert np.isnan(quant.e4m3_to_f32(np.array([0x7F, 0xFF], np.uint8))).all()


# ---- the quantisers ----------------------------------------------------------------------

def random_rows(rng, rows=64, cols=96):
    """Rows of very different magnitudes, some bf16-valued (as the releases store them)."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w *= (10.0 ** rng.uniform(-6, 4, rows)).astype(np.float32)[:, None]
    w[: rows // 2] = ckpt._bf16_to_f32(ckpt._f32_to_bf16(w[: rows // 2]))
    w[3, 7] = -np.abs(w[3]).max() * 2  # a row whose max is negative
    return w


def test_int8_matches_the_float64_reference():
    w = random_rows(np.random.default_rng(1))
    q, scale = quant.quantise_rows(w, "int8")
    q_ref, scale_ref, x = int8_ref(w)
    assert q.dtype == np.int8 and scale.dtype == np.float32
    assert np.array_equal(scale, scale_ref)
    differ = q != q_ref
    assert not (differ & ~near_tie(x)).any()
    assert (np.abs(q - x)[differ] <= 0.5 + 1e-5).all()  # the other neighbour of a near-tie
    assert (np.abs(q).max(axis=1) == 127).all()  # each row's max maps to +-127
    err = np.abs(quant.dequantise(q, scale, "int8").astype(np.float64) - w)
    assert (err <= scale[:, None] * (0.5 + 1e-5)).all()


def test_fp8_matches_the_float64_reference():
    w = random_rows(np.random.default_rng(2))
    q, scale = quant.quantise_rows(w, "fp8")
    w64 = w.astype(np.float64)
    scale_ref = (np.abs(w64).max(axis=1) / 448.0).astype(np.float32)
    assert q.dtype == np.uint8 and np.array_equal(scale, scale_ref)
    x = w64 / scale_ref.astype(np.float64)[:, None]
    want = e4m3_ref(x)
    # where the float64 quotient is not within float32 rounding of an e4m3 midpoint, the
    # codes agree exactly
    gap = np.abs(np.abs(x) - np.abs(quant.e4m3_to_f32(want)))
    near_midpoint = gap >= 0.5 * e4m3_spacing(x) * (1 - 2.0 ** -20)
    assert not ((q != want) & ~near_midpoint).any()
    assert (np.abs(q.astype(int) - want.astype(int)) <= 1).all()
    assert ((q & 0x7F).max(axis=1) == 0x7E).all()  # each row's max maps to +-448
    err = np.abs(quant.dequantise(q, scale, "fp8").astype(np.float64) - w64)
    assert (err <= 0.5 * e4m3_spacing(x) * scale[:, None] * (1 + 1e-5)).all()


def test_ties_round_to_even():
    # int8: max 127 gives scale 1, so the quotients are the values themselves
    w = np.array([[127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]], np.float32)
    q, scale = quant.quantise_rows(w, "int8")
    assert scale.tolist() == [1.0] and q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 126]]
    # fp8: max 448 gives scale 1; midpoints between e4m3 neighbours go to the even code
    w = np.array([[448, 1.0625, 1.1875, 17, 19, 2.0 ** -10, 3 * 2.0 ** -10, -1.0625, 432]],
                 np.float32)
    q, scale = quant.quantise_rows(w, "fp8")
    assert scale.tolist() == [1.0]
    assert quant.e4m3_to_f32(q).tolist() == [[448, 1.0, 1.25, 16, 20, 0, 2 * 2.0 ** -9, -1.0,
                                              448]]


def test_quotients_past_the_range_saturate():
    # A row whose max is subnormal gets a scale rounded far down (178u / 127 -> 1u): the
    # quotients pass 127 and 448 and must be clipped, not wrapped.
    w = np.array([[178 * U, -178 * U, U, 0]], np.float32)
    q, scale = quant.quantise_rows(w, "int8")
    assert scale.tolist() == [np.float32(U)] and q.tolist() == [[127, -127, 1, 0]]
    w = np.array([[627 * U, -627 * U, U]], np.float32)
    q, scale = quant.quantise_rows(w, "fp8")
    assert scale.tolist() == [np.float32(U)]
    assert quant.e4m3_to_f32(q).tolist() == [[448, -448, 1]]


def test_zero_rows_have_scale_zero():
    w = np.array([[0, 0, 0], [-0.0, 0, -0.0], [U, -U, 0], [1, -2, 3]], np.float32)
    for kind in ("int8", "fp8"):
        q, scale = quant.quantise_rows(w, kind)
        assert scale[:3].tolist() == [0, 0, 0] and scale[3] > 0, kind
        assert (q[:3].view(np.uint8) == 0).all(), kind  # +0 bits, not -0, not NaN


@pytest.mark.parametrize("bad, what", [(np.nan, "NaN"), (-np.inf, "an infinity")])
def test_non_finite_weights_are_refused_by_row(bad, what):
    w = np.ones((6, 5), np.float32)
    w[4, 2] = bad
    for kind in ("int8", "fp8"):
        with pytest.raises(quant.QuantError) as e:
            quant.quantise_rows(w, kind, "blk.weight", row0=100)
        assert f"blk.weight: row 104 holds {what}" in str(e.value), str(e.value)


# ---- streaming: row blocks and the file entries ------------------------------------------

def stream(name, t, kind, block_bytes, scale_first=False):
    (n, dt, shape, values), (sn, sdt, sshape, scales) = quant.entries(name, t, kind, block_bytes)
    assert (n, sn, dt, sdt, shape, sshape) == (name, name + "_scale", quant.KINDS[kind], "F32",
                                                t.shape, (t.shape[0],))
    if scale_first:
        s = np.concatenate(list(scales()))
        q = np.concatenate(list(values()))
    else:
        q = np.concatenate(list(values()))
        s = np.concatenate(list(scales()))
    return q, s


@pytest.mark.parametrize("stored", ["F32", "BF16", "F16", "F64"])
def test_row_blocks_of_any_size_give_the_same_values(tmp_path, stored):
    w = random_rows(np.random.default_rng(3), rows=37, cols=24)
    if stored == "BF16":
        value = ("BF16", ckpt._f32_to_bf16(w))
    else:
        value = w.astype({"F32": np.float32, "F16": np.float16, "F64": np.float64}[stored])
    path = str(tmp_path / "w.safetensors")
    if stored == "F64":  # safetensors_write writes no F64: a hand-made file
        blob = json.dumps({"w": {"dtype": "F64", "shape": [37, 24],
                                 "data_offsets": [0, value.nbytes]}}).encode()
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob + value.tobytes())
    else:
        safetensors_write.write(path, {"w": value})
    t = ckpt.read_safetensors(path)["w"]
    widened = np.asarray(t, dtype=np.float32)  # the stored values in float32
    for kind in ("int8", "fp8"):
        want_q, want_s = quant.quantise_rows(widened, kind)
        for block in (4 * 24, 4 * 24 * 5, 1 << 20):  # 1 row, 5 rows (a short last), all
            q, s = stream("w", t, kind, block)
            assert np.array_equal(q, want_q) and np.array_equal(s, want_s), (kind, block)
        q, s = stream("w", t, kind, 4 * 24 * 3, scale_first=True)
        assert np.array_equal(q, want_q) and np.array_equal(s, want_s), kind


def test_a_bad_row_in_a_later_block_is_named_in_the_file_write(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "CHUNK_BYTES", 3 * 4 * 4)  # blocks of 3 rows: row 7 is in the third
    w = np.ones((10, 4), np.float32)
    w[7, 1] = np.nan
    path = str(tmp_path / "out.safetensors")
    with pytest.raises(ckpt.ConversionError) as e:
        ckpt.write_safetensors(path, {"m.weight": w}, "int8", quantise=["m.weight"])
    assert "m.weight" in str(e.value) and "row 7 holds NaN" in str(e.value), str(e.value)
    assert not os.path.exists(path) and not os.path.exists(path + ".partial")


def test_write_safetensors_stores_name_and_scales(tmp_path):
    rng = np.random.default_rng(5)
    w, b = rng.standard_normal((6, 8)).astype(np.float32), rng.standard_normal(6)
    path = str(tmp_path / "q.safetensors")
    types = ckpt.write_safetensors(path, {"l.weight": w, "l.bias": b, "e.weight": w}, "fp8",
                                   quantise=["l.weight"])
    assert types == {"l.weight": "F8_E4M3", "l.weight_scale": "F32", "l.bias": "F32",
                     "e.weight": "F32"}, types  # F64 bias as F32, the embedding as stored
    back = safetensors_write.read(path)
    q, s = quant.quantise_rows(w, "fp8")
    assert back["l.weight"][0] == "F8_E4M3" and np.array_equal(back["l.weight"][1], q)
    assert np.array_equal(back["l.weight_scale"], s) and np.array_equal(back["e.weight"], w)
    assert np.array_equal(back["l.bias"], b.astype(np.float32))
    # read back through the converters' reader: F8_E4M3's values are the e4m3 values
    t = ckpt.read_safetensors(path)
    assert np.array_equal(np.asarray(t["l.weight"]), quant.e4m3_to_f32(q))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_float_tensors_reads_8bit_weights_as_values_times_scales(tmp_path, kind):
    """What the torch sides compute with (make bench's JanusLM, --init): each 8-bit weight
    its values times its row's scale, within half a step of the float weight; the scale no
    tensor of its own; BF16 and F16 tensors widened exactly."""
    rng = np.random.default_rng(6)
    w, b = rng.standard_normal((6, 8)).astype(np.float32), rng.standard_normal(6).astype(np.float16)
    e = rng.standard_normal((3, 8)).astype(np.float32)
    e_bits = (e.view(np.uint32) >> 16).astype(np.uint16)  # bf16, truncated: exact when widened
    path = str(tmp_path / "q.safetensors")
    ckpt.write_safetensors(path, {"l.weight": w, "l.bias": b}, kind, quantise=["l.weight"])
    back = safetensors_write.read(path)
    back["e.weight"] = ("BF16", e_bits)
    got = quant.float_tensors(back)
    assert sorted(got) == ["e.weight", "l.bias", "l.weight"], sorted(got)
    assert all(v.dtype == np.float32 for v in got.values())
    q, scale = quant.quantise_rows(w, kind)
    assert np.array_equal(got["l.weight"], quant.dequantise(q, scale, kind))
    # int8: steps of one scale; e4m3: 3 mantissa bits, steps of at most |q| / 8 (2^-9 subnormal)
    step = scale[:, None] * (1.0 if kind == "int8" else np.maximum(np.abs(w / scale[:, None]) / 8, 2.0 ** -9))
    assert np.all(np.abs(got["l.weight"] - w) <= step / 2 * 1.0001), "not within half a step of the weight"
    assert np.array_equal(got["e.weight"], (e_bits.astype(np.uint32) << 16).view(np.float32))
    assert np.array_equal(got["l.bias"], np.asarray(back["l.bias"], np.float32))


# ---- which tensors, per architecture -----------------------------------------------------

BLOCK_LINEARS = {  # per block, what engine/family/*.c reads with weight_load_linear*
    "janus": ["attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight",
              "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"],
    "llamagen": ["attn.wqkv.weight", "attn.o.weight", "mlp.gate.weight", "mlp.up.weight",
                 "mlp.down.weight"],
    "var": ["adaln.weight", "attn.qkv.weight", "attn.proj.weight", "ffn.fc1.weight",
            "ffn.fc2.weight"],
    "infinity": ["sa.mat_qkv.weight", "sa.proj.weight", "ca.mat_q.weight", "ca.mat_kv.weight",
                 "ca.proj.weight", "ffn.fc1.weight", "ffn.fc2.weight"],
}
T5_LINEARS = ["layer.0.SelfAttention.q.weight", "layer.0.SelfAttention.k.weight",
              "layer.0.SelfAttention.v.weight", "layer.0.SelfAttention.o.weight",
              "layer.1.DenseReluDense.wi_0.weight", "layer.1.DenseReluDense.wi_1.weight",
              "layer.1.DenseReluDense.wo.weight"]
HEAD_LINEARS = {
    "janus": lambda m: [f"gen.aligner.{j}.weight" for j in range(m["image"]["aligner_layers"])]
    + ["gen.head.fc1.weight", "gen.head.fc2.weight"],
    "llamagen": lambda m: ["gen.head.weight"],
    "var": lambda m: ["var.word_embed.weight", "var.head_adaln.weight", "var.head.weight"]
    + (["var.shared_adaln.weight"] if m["llm"]["shared_adaln"] else []),
    "infinity": lambda m: ["inf.text_proj_for_sos.ca.mat_kv.weight",
                           "inf.text_proj_for_sos.ca.proj.weight",
                           "inf.text_proj_for_ca.0.weight", "inf.text_proj_for_ca.2.weight",
                           "inf.shared_ada_lin.1.weight", "inf.head_nm.ada_lin.1.weight",
                           "inf.head.weight", "inf.word_embed.weight"],
}
PREFIX = {"janus": "llm.layers", "llamagen": "llm.layers", "var": "var.blocks",
          "infinity": "inf.blocks"}


def expected(manifest, heads=False):
    arch = manifest["architecture"]
    names = {f"{PREFIX[arch]}.{i}.{s}" for i in range(manifest["llm"]["num_layers"])
             for s in BLOCK_LINEARS[arch]}
    if arch == "infinity":
        names |= {f"t5.block.{i}.{s}" for i in range(manifest["text"]["num_layers"])
                  for s in T5_LINEARS}
    return names | (set(HEAD_LINEARS[arch](manifest)) if heads else set())


def tensor_names(model_dir):
    with open(os.path.join(model_dir, "arserve.json")) as f:
        manifest = json.load(f)
    names = set()
    for w in manifest.get("weights", ["model.safetensors"]):
        header, _ = safetensors_write.read_header(os.path.join(model_dir, w))
        names |= {n for n in header if n != "__metadata__"}
    return manifest, names


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """The tiny models of every architecture: make_tiny_model.py's janus and var-tiny, and the
    committed LlamaGen and Infinity goldens (converted from official-format files)."""
    made = tmp_path_factory.mktemp("tiny")
    dirs = [os.path.join(GOLDEN, "janus_tiny"), os.path.join(GOLDEN, "llamagen_tiny"),
            os.path.join(GOLDEN, "infinity_tiny"), os.path.join(GOLDEN, "infinity_tiny_patchify"),
            os.path.join(GOLDEN, "var_tiny")]
    for preset in ("tiny", "var-tiny"):
        out = str(made / preset)
        subprocess.run([sys.executable, os.path.join(TOOLS, "make_tiny_model.py"), "--preset",
                        preset, "--seed", "1", "--out", out], check=True, capture_output=True,
                       timeout=scaled(60))
        dirs.append(out)
    return dirs


def test_each_architecture_quantises_its_block_linears_and_nothing_else(tiny_models):
    seen = set()
    for d in tiny_models:
        manifest, names = tensor_names(d)
        seen.add(manifest["architecture"])
        for heads in (False, True):
            want = expected(manifest, heads)
            assert want <= names, (d, sorted(want - names))  # the lists are not vacuous
            got = quant.linear_names(manifest["family"], manifest["architecture"], names, heads)
            assert set(got) == want, (d, heads, sorted(set(got) ^ want))
        # never a norm, bias, embedding table, convolution, T5's relative attention bias or a
        # tensor the engine reads as raw floats, even with the heads
        got = quant.linear_names(manifest["family"], manifest["architecture"], names, True)
        assert not [n for n in got if any(s in n for s in (
            "norm", "bias", "embed.weight", "class_embed", "lvl_embed", "level_embed", "pos_",
            "vq.", "ada_gss", "adaln_gss", "scale_mul", "cfg_uncond", "t5.shared"))
            and "word_embed" not in n], (d, got)
    assert seen == {"janus", "llamagen", "var", "infinity"}


def test_an_unknown_architecture_is_refused():
    with pytest.raises(quant.QuantError) as e:
        quant.linear_names("raster", "gpt2", ["llm.layers.0.attn.q.weight"])
    assert "architecture 'gpt2'" in str(e.value) and "raster/janus" in str(e.value)
