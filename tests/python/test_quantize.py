"""8-bit models end to end: tools/quantize.py on the tiny models (each block Linear within half
a step of the original, everything else and every other file unchanged, the refusals in one
line), every converter's --dtype int8 / fp8 on its official-format fixture, and the engine
reading an 8-bit model as a float32 model holding the dequantised weights (the same images).

    ARSERVE_BIN=build/arserve .venv/bin/python -m pytest tests/python/test_quantize.py -q
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")
CONVERT = os.path.join(TOOLS, "convert")
GOLDEN = os.path.join(ROOT, "tests", "golden")
QUANTIZE = os.path.join(TOOLS, "quantize.py")
ARSERVE = os.environ.get("ARSERVE_BIN", os.path.join(ROOT, "build", "arserve"))
sys.path.insert(0, CONVERT)
sys.path.insert(0, TOOLS)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quant  # noqa: E402
import safetensors_write  # noqa: E402
from test_convert_janus import tiny_config  # noqa: E402
from test_quant import e4m3_spacing, expected  # noqa: E402

EIGHT = {"int8": "I8", "fp8": "F8_E4M3"}


def run(*args, timeout=60):
    p = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                       timeout=scaled(timeout))
    return p.returncode, p.stdout, p.stderr


def load(model_dir):
    """(arserve.json, {name: (safetensors dtype, array of the stored bits or values)},
    {file: metadata}) of a model directory."""
    with open(os.path.join(model_dir, "arserve.json")) as f:
        manifest = json.load(f)
    tensors, meta = {}, {}
    for w in manifest.get("weights", ["model.safetensors"]):
        path = os.path.join(model_dir, w)
        header, _ = safetensors_write.read_header(path)
        meta[w] = header.get("__metadata__", {})
        for name, v in safetensors_write.read(path).items():
            tensors[name] = (header[name]["dtype"], v[1] if isinstance(v, tuple) else v)
    return manifest, tensors, meta


def values(dtype, arr):
    """float64 values of stored bits (BF16 widened; 8-bit tensors are not values alone)."""
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return arr.astype(np.float64)


def check_quantised(orig, got, kind, names):
    """got = orig with `names` in 8 bits (NAME + NAME_scale), within half a step; every other
    tensor of the same type and bits."""
    assert set(got) == set(orig) | {n + "_scale" for n in names}
    for name, (dtype, arr) in orig.items():
        if name not in names:
            assert got[name][0] == dtype and np.array_equal(got[name][1], arr), name
            continue
        (qt, q), (st, s) = got[name], got[name + "_scale"]
        assert qt == EIGHT[kind] and q.shape == arr.shape, name
        assert st == "F32" and s.shape == (arr.shape[0],), name
        w = values(dtype, arr)
        deq = quant.dequantise(q, s, kind).astype(np.float64)
        if kind == "int8":
            half = 0.5 * s.astype(np.float64)[:, None]
        else:
            x = np.divide(w, s[:, None], out=np.zeros_like(w), where=s[:, None] > 0)
            half = 0.5 * e4m3_spacing(x) * s.astype(np.float64)[:, None]
        assert (np.abs(deq - w) <= half * (1 + 1e-5)).all(), name
        assert np.allclose(np.abs(w).max(axis=1), np.abs(deq).max(axis=1), rtol=1e-6), name


# ---- tools/quantize.py -------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """make_tiny_model.py's janus (with a README.md and a file in a subfolder, to be copied)
    and var-tiny."""
    base = tmp_path_factory.mktemp("models")
    out = {}
    for preset in ("tiny", "var-tiny"):
        d = base / preset
        rc, _, err = run(os.path.join(TOOLS, "make_tiny_model.py"), "--preset", preset,
                         "--seed", "1", "--out", d)
        assert rc == 0, err
        out[preset] = d
    (out["tiny"] / "README.md").write_text("# tiny-random\n\nA tiny random model.\n")
    (out["tiny"] / "notes").mkdir()
    (out["tiny"] / "notes" / "kept.txt").write_text("copied as it is\n")
    return out


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("preset, heads", [("tiny", False), ("var-tiny", True)])
def test_quantize_round_trip(models, tmp_path, kind, preset, heads):
    src, out = models[preset], tmp_path / "q"
    rc, stdout, err = run(QUANTIZE, src, out, "--dtype", kind,
                          *(["--quantize-heads"] if heads else []))
    assert rc == 0, err
    manifest, orig, _ = load(src)
    _, got, meta = load(out)
    names = expected(manifest, heads)
    check_quantised(orig, got, kind, names)
    assert f"{len(names)} Linear weights in {kind}" in stdout, stdout
    assert meta["model.safetensors"]["quantization"] == quant.describe(kind, heads)
    assert meta["model.safetensors"]["made_by"] == "tools/make_tiny_model.py"  # kept
    # every other file, unchanged
    src_files = sorted(os.path.relpath(os.path.join(r, f), src)
                       for r, _, fs in os.walk(src) for f in fs)
    out_files = sorted(os.path.relpath(os.path.join(r, f), out)
                       for r, _, fs in os.walk(out) for f in fs)
    assert src_files == out_files
    for f in src_files:
        if f not in ("model.safetensors", "README.md"):
            assert (out / f).read_bytes() == (src / f).read_bytes(), f
    if preset == "tiny":
        readme = (out / "README.md").read_text()
        assert readme.startswith((src / "README.md").read_text())
        assert readme.endswith(f"\nweights: {quant.describe(kind, heads)} (tools/quantize.py)\n")


def test_quantize_refusals_are_one_line(models, tmp_path):
    src = models["tiny"]
    out = tmp_path / "q"
    assert run(QUANTIZE, src, out, "--dtype", "int8")[0] == 0

    def refused(*args, says):
        rc, stdout, err = run(QUANTIZE, *args)
        assert rc == 1 and says in err, (rc, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err

    refused(out, tmp_path / "again", "--dtype", "fp8", says="already holds 8-bit weights")
    assert not (tmp_path / "again").exists()
    refused(src, out, "--dtype", "fp8", says="exists and is not empty (--force")
    assert run(QUANTIZE, src, out, "--dtype", "fp8", "--force")[0] == 0
    assert load(out)[1]["llm.layers.0.attn.q.weight"][0] == "F8_E4M3"
    refused(tmp_path, tmp_path / "x", "--dtype", "int8", says="no arserve.json")
    refused(src, src, "--dtype", "int8", says="is MODEL_DIR itself")

    # a weight that is not finite: named by tensor and row, and nothing left behind
    bad = tmp_path / "nan"
    shutil.copytree(src, bad)
    t = safetensors_write.read(str(bad / "model.safetensors"))
    w = t["llm.layers.1.mlp.down.weight"][1].copy()
    w[5, 3] = 0x7FC0  # a bf16 NaN
    t["llm.layers.1.mlp.down.weight"] = ("BF16", w)
    safetensors_write.write(str(bad / "model.safetensors"), t)
    refused(bad, tmp_path / "nan-q", "--dtype", "int8",
            says="'llm.layers.1.mlp.down.weight': row 5 holds NaN")
    assert not (tmp_path / "nan-q").exists()


# ---- the converters' --dtype int8 / fp8 ---------------------------------------------------

def converted(tmp_path, converter, args, kind, golden, heads=False):
    out = tmp_path / "out"
    rc, _, err = run(os.path.join(CONVERT, converter), *args, out, "--dtype", kind,
                     *(["--quantize-heads"] if heads else []), timeout=120)
    assert rc == 0, err
    manifest, orig, _ = load(golden)
    got_manifest, got, meta = load(out)
    assert got_manifest == manifest
    assert meta["model.safetensors"]["quantization"] == quant.describe(kind, heads)
    names = expected(manifest, heads)
    # the goldens are the same conversion in f32: compare with the source values as f32
    orig = {k: ("F32", values(d, a).astype(np.float32)) for k, (d, a) in orig.items()}
    got = {k: (("F32", values(d, a).astype(np.float32)) if d not in EIGHT.values() else (d, a))
           for k, (d, a) in got.items()}
    check_quantised(orig, got, kind, names)


def test_convert_var_int8(tmp_path):
    off = os.path.join(GOLDEN, "var_tiny", "official")
    converted(tmp_path, "var.py", [os.path.join(off, "var.pth"), os.path.join(off, "vae.pth"),
                                   "--patch-nums", "1,2,3,4", "--name", "var-tiny-random"],
              "int8", os.path.join(GOLDEN, "var_tiny"))


def test_convert_llamagen_fp8_with_heads(tmp_path):
    off = os.path.join(GOLDEN, "llamagen_tiny", "official")
    converted(tmp_path, "llamagen.py",
              [os.path.join(off, "c2i_tiny.pt"), os.path.join(off, "vq_tiny.pt"), "--n-head", "4",
               "--image-size", "32", "--name", "llamagen-tiny-random"],
              "fp8", os.path.join(GOLDEN, "llamagen_tiny"), heads=True)


def test_convert_infinity_int8(tmp_path):
    golden = os.path.join(GOLDEN, "infinity_tiny")
    off = os.path.join(golden, "official")
    name = json.load(open(os.path.join(golden, "arserve.json")))["name"]
    converted(tmp_path, "infinity.py",
              [os.path.join(off, "infinity.pth"), os.path.join(off, "vae.pth"),
               os.path.join(off, "t5"), "--pn", "0.06M", "--name", name], "int8", golden)


_JANUS_LAYER = {"attn_norm.weight": "input_layernorm.weight",
                "attn.q.weight": "self_attn.q_proj.weight",
                "attn.k.weight": "self_attn.k_proj.weight",
                "attn.v.weight": "self_attn.v_proj.weight",
                "attn.o.weight": "self_attn.o_proj.weight",
                "mlp_norm.weight": "post_attention_layernorm.weight",
                "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
                "mlp.down.weight": "mlp.down_proj.weight"}


def transformers_name(name):
    """The transformers-layout Janus name of a canonical one (janus.py's map, reversed)."""
    parts = name.split(".")
    if name.startswith("llm.layers."):
        return f"model.language_model.layers.{parts[2]}.{_JANUS_LAYER['.'.join(parts[3:])]}"
    fixed = {"llm.embed.weight": "model.language_model.embed_tokens.weight",
             "llm.norm.weight": "model.language_model.norm.weight",
             "gen.embed.weight": "model.generation_embeddings.weight",
             "vq.codebook.weight": "model.vqmodel.quantize.embedding.weight"}
    if name in fixed:
        return fixed[name]
    if name.startswith("gen.aligner."):
        j = int(parts[2])
        return (f"model.generation_aligner.fc1.{parts[3]}" if j == 0 else
                f"model.generation_aligner.hidden_layers.{j - 1}.{parts[3]}")
    if name.startswith("gen.head."):
        return {"fc1": "model.generation_head.proj_out",
                "fc2": "model.generation_head.vision_head"}[parts[2]] + "." + parts[3]
    assert name.startswith("vq."), name
    return "model.vqmodel." + name[len("vq."):]


def test_convert_janus_int8_with_heads(tmp_path):
    """A transformers-layout checkpoint made from the janus_tiny golden's own weights."""
    golden = os.path.join(GOLDEN, "janus_tiny")
    spec = importlib.util.spec_from_file_location("convert_janus", os.path.join(CONVERT, "janus.py"))
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    src = tmp_path / "src"
    src.mkdir()
    weights = safetensors_write.read(os.path.join(golden, "model.safetensors"))
    renamed = {transformers_name(k): v for k, v in weights.items()}
    assert {conv.canonical_name(k): k for k in renamed}.keys() == weights.keys()
    safetensors_write.write(str(src / "model.safetensors"), renamed)
    (src / "config.json").write_text(json.dumps(tiny_config()))
    shutil.copyfile(os.path.join(golden, "tokenizer.json"), src / "tokenizer.json")
    converted(tmp_path, "janus.py",
              [src, "--name", "janus-tiny-random", "--bos-token", "<bos>", "--pad-token",
               "<pad>", "--image-start-token", "<begin_of_image>"],
              "int8", golden, heads=True)


def test_quantize_heads_needs_an_8bit_dtype(tmp_path):
    off = os.path.join(GOLDEN, "var_tiny", "official")
    rc, _, err = run(os.path.join(CONVERT, "var.py"), os.path.join(off, "var.pth"),
                     os.path.join(off, "vae.pth"), tmp_path / "out", "--patch-nums", "1,2,3,4",
                     "--quantize-heads")
    assert rc == 1 and "--quantize-heads needs --dtype int8 or fp8" in err, err
    assert not (tmp_path / "out").exists()


# ---- the engine reads them as the format says ---------------------------------------------

def dequantised_copy(model, out):
    """model with every 8-bit Linear weight replaced by its values as F32 (q times scale)."""
    shutil.copytree(model, out)
    manifest, tensors, meta = load(out)
    for w in manifest.get("weights", ["model.safetensors"]):
        path = os.path.join(out, w)
        t = safetensors_write.read(path)
        plain = {}
        for name, v in t.items():
            dtype = tensors[name][0]
            if name.endswith("_scale") and name[:-6] in t:
                continue
            if dtype in EIGHT.values():
                kind = "int8" if dtype == "I8" else "fp8"
                plain[name] = quant.dequantise(tensors[name][1], t[name + "_scale"], kind)
            else:
                plain[name] = v
        safetensors_write.write(path, plain, meta[w])


ENGINE_MODELS = [  # (model, --quantize-heads, conditioning): every architecture, each list
    ("tiny", False, ["--prompt", "red circle"]),
    ("var-tiny", True, ["--class", "3"]),
    ("janus_tiny", True, ["--prompt", "red cat"]),
    ("llamagen_tiny", True, ["--class", "1"]),
    ("infinity_tiny", True, ["--prompt", "a cat"]),
]


@pytest.mark.skipif(not os.access(ARSERVE, os.X_OK), reason=f"no arserve binary at {ARSERVE}")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_engine_reads_8bit_weights_as_their_dequantised_values(models, tmp_path, kind):
    """The engine loads every tensor of each list as a Linear weight (it refuses an 8-bit
    tensor anywhere else), and its 8-bit GEMMs sum what float32 weights holding q * scale sum,
    but for rounding (the scale joins once per k block: kernels/cpu/gemm_packed.h), so on these
    models an image from the 8-bit model is the float32 copy's, byte for byte: the rows, scales
    and e4m3 codes mean to the engine what they mean here."""
    images = {}
    for name, heads, cond in ENGINE_MODELS:
        src = models[name] if name in models else os.path.join(GOLDEN, name)
        q, deq = tmp_path / f"{name}-q", tmp_path / f"{name}-deq"
        rc, _, err = run(QUANTIZE, src, q, "--dtype", kind,
                         *(["--quantize-heads"] if heads else []))
        assert rc == 0, err
        dequantised_copy(q, deq)
        for m in (q, deq, src):
            png = tmp_path / f"{os.path.basename(m)}.png"
            p = subprocess.run([ARSERVE, "generate", "--model", str(m), *cond, "--seed", "7",
                                "--threads", "1", "-o", str(png)],
                               capture_output=True, text=True, timeout=scaled(60))
            assert p.returncode == 0, (m, p.stderr)
            images[os.path.basename(m)] = png.read_bytes()
        assert images[f"{name}-q"] == images[f"{name}-deq"], name
    # and the weights did change: the 8-bit janus model's image is not the original's
    assert images["tiny-q"] != images["tiny"]
