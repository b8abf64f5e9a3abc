"""8-bit Linear weights in the daemon: a model quantised by tools/quantize.py serves images
(int8 and fp8), and a broken 8-bit file is refused at start-up with a message naming the file
and the tensor: a missing scale, a scale that is not finite or not F32, an 8-bit tensor where
the engine reads anything but a Linear weight, an fp8 NaN (with the weight check off too); a
quantised model's KV keeps its 16-bit type."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import (ARSERVE_BIN, HTTP_TIMEOUT, REPO, TINY_MODEL, b64_png_size, clean_env,
                      model_info, scaled)

sys.path.insert(0, os.path.join(REPO, "tools"))
import safetensors_write  # noqa: E402

GEN = "/v1/images/generations"
QKV = "llm.layers.0.attn.q.weight"


def quantise_dir(src, dst, dtype):
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "quantize.py"), src, str(dst),
                    "--dtype", dtype], check=True, capture_output=True)
    return str(dst)


def quantise(dst, dtype):
    return quantise_dir(TINY_MODEL, dst, dtype)


def weights_path(model):
    return os.path.join(model, "model.safetensors")


def rewrite(model, change):
    """Reads the model's weights, lets change(tensors) edit the dict, writes them back."""
    path = weights_path(model)
    tensors = safetensors_write.read(path)
    change(tensors)
    safetensors_write.write(path, tensors)


def refused(model, *args):
    p = subprocess.run([ARSERVE_BIN, "serve", "--port", "0", "--model", model, *args],
                       capture_output=True, text=True, timeout=scaled(30), env=clean_env())
    assert p.returncode != 0, p.stderr
    assert "model.safetensors" in p.stderr, p.stderr
    return p.stderr


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_a_quantised_model_serves_images(start_daemon, tmp_path, dtype):
    model = quantise(tmp_path / dtype, dtype)
    d = start_daemon(model=model)
    r = d.client.post(GEN, json={"prompt": "a red circle", "seed": 3}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    info = model_info(model)
    assert b64_png_size(r.json()["data"][0]["b64_json"]) == (info["width"], info["height"])


def test_a_missing_scale_is_named(tmp_path):
    model = quantise(tmp_path / "m", "int8")
    rewrite(model, lambda t: t.pop(QKV + "_scale"))
    err = refused(model)
    assert f"the scales of 8-bit weight '{QKV}'" in err and f"'{QKV}_scale' not found" in err, err


def test_a_scale_that_is_not_finite_is_named(tmp_path):
    model = quantise(tmp_path / "m", "int8")

    def poison(t):
        t[QKV + "_scale"][5] = float("inf")
    rewrite(model, poison)
    err = refused(model)
    assert f"tensor '{QKV}'" in err and "the scale of row 5 is inf, not finite" in err, err


def test_a_scale_of_another_type_is_named(tmp_path):
    model = quantise(tmp_path / "m", "int8")
    rewrite(model, lambda t: t.update({QKV + "_scale": t[QKV + "_scale"].astype("float16")}))
    err = refused(model)
    assert f"'{QKV}_scale': dtype F16, expected F32" in err, err


def test_an_8bit_tensor_that_is_not_a_linear_weight_is_named(tmp_path):
    model = quantise(tmp_path / "m", "int8")
    rewrite(model, lambda t: t.update({"llm.embed.weight":
                                       np.zeros(t["llm.embed.weight"][1].shape, np.int8)}))
    err = refused(model)
    assert "tensor 'llm.embed.weight': dtype I8, but only Linear weights may be 8-bit" in err, err


def fp8_with_nan(path, byte):
    """A tiny fp8 model whose QKV holds the NaN pattern byte at element 3."""
    model = quantise(path, "fp8")

    def poison(t):
        kind, bits = t[QKV]
        bits = bits.copy()
        bits.flat[3] = byte
        t[QKV] = (kind, bits)
    rewrite(model, poison)
    return model


@pytest.mark.parametrize("check", ["on", "off"])
def test_an_fp8_nan_is_named(tmp_path, check):
    """With the weight check off too: the vector kernels would widen it to a finite value,
    portable C to NaN."""
    model = fp8_with_nan(tmp_path / "m", 0xff if check == "off" else 0x7f)
    err = refused(model, "--check-weights", check)
    assert f"tensor '{QKV}'" in err and "element 3 is an fp8 NaN" in err, err


def holds_8bit(model):
    """Whether the model's first weights file says it holds 8-bit weights (its metadata's
    `quantization` entry, which tools/quantize.py writes)."""
    with open(os.path.join(model, "arserve.json")) as f:
        first = json.load(f)["weights"][0]
    with open(os.path.join(model, first), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return "quantization" in header.get("__metadata__", {})


def test_a_quantised_models_kv_keeps_the_16_bit_type(tmp_path):
    """An 8-bit weight counts as the type it was quantised from (the file's quantized_from) in
    the weights' type that --kv-dtype auto takes, its scales not at all: the demo models keep
    theirs, bf16 (shapes: bf16 blocks beside an f16 decoder; quantised here) and f16
    (shapes-var, whose blocks ship in int8 quantised from f16)."""
    assert holds_8bit(os.path.join(REPO, "models", "shapes-var"))
    for name, kv in (("shapes", "bf16"), ("shapes-var", "f16")):
        src = os.path.join(REPO, "models", name)
        quantised = [] if holds_8bit(src) else [quantise_dir(src, tmp_path / f"{name}-int8", "int8")]
        for model in [src] + quantised:
            p = subprocess.run([ARSERVE_BIN, "plan", "--model", model], capture_output=True,
                               text=True, timeout=scaled(30), env=clean_env())
            assert p.returncode == 0, p.stderr
            assert f"`serve --kv-dtype auto` stores {kv}: the weights' type" in p.stdout, \
                (model, p.stdout)
