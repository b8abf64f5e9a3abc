"""tools/convert/var.py on the small official-format checkpoints under
tests/golden/var_tiny/official/ (written with FoundationVision/VAR's own classes, see
tests/golden/var_tiny/README.md): its output must equal the committed golden model directory
tensor by tensor, and what the engine cannot run is refused with a message naming the problem.

The converter reads torch.save's zip format with numpy alone, so this runs in the test venv
without torch; where torch is importable the reader is also checked against torch.load.

    .venv/bin/python -m pytest tests/python/test_convert_var.py -q
"""

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")
CONVERTER = os.path.join(TOOLS, "convert", "var.py")
GOLDEN = os.path.join(ROOT, "tests", "golden", "var_tiny")
VAR_PTH = os.path.join(GOLDEN, "official", "var.pth")
VAE_PTH = os.path.join(GOLDEN, "official", "vae.pth")

sys.path.insert(0, TOOLS)
import safetensors_write  # noqa: E402
from conftest import scaled  # noqa: E402

_spec = importlib.util.spec_from_file_location("convert_var", CONVERTER)
convert_var = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_var)


def run(*args):
    p = subprocess.run([sys.executable, CONVERTER, *map(str, args)], capture_output=True,
                       text=True, timeout=scaled(120))
    return p.returncode, p.stderr


def refusal(var_sd=None, vae_sd=None, patch_nums=(1, 2, 3, 4)):
    var_sd = var_sd if var_sd is not None else convert_var.load_checkpoint(VAR_PTH)
    vae_sd = vae_sd if vae_sd is not None else convert_var.load_checkpoint(VAE_PTH)
    with pytest.raises(convert_var.ConversionError) as e:
        convert_var.build(var_sd, vae_sd, patch_nums, "x")
    return str(e.value)


def test_converter_reproduces_the_golden_model(tmp_path):
    out = tmp_path / "out"
    rc, err = run(VAR_PTH, VAE_PTH, out, "--patch-nums", "1,2,3,4", "--name", "var-tiny-random")
    assert rc == 0, err
    with open(os.path.join(GOLDEN, "arserve.json")) as f:
        want_manifest = json.load(f)
    assert json.loads((out / "arserve.json").read_text()) == want_manifest
    got = safetensors_write.read(str(out / "model.safetensors"))
    want = safetensors_write.read(os.path.join(GOLDEN, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        assert np.array_equal(got[name], want[name]), name
    assert (out / "model.safetensors").read_bytes() == open(os.path.join(GOLDEN, "model.safetensors"), "rb").read()


def test_layout_is_the_documented_one():
    # A few names and shapes from docs/model-format.md, "Tensor names (var)".
    t = safetensors_write.read(os.path.join(GOLDEN, "model.safetensors"))
    C, H, L, V, E = 128, 2, 30, 64, 8
    assert t["var.pos_start"].shape == (1, C)
    assert t["var.pos_embed"].shape == (L, C)
    assert t["var.class_embed.weight"].shape == (11, C)
    assert t["var.blocks.1.attn.scale_mul"].shape == (H,)
    assert t["var.blocks.0.adaln.weight"].shape == (6 * C, C)
    assert t["var.head_adaln.weight"].shape == (2 * C, C)
    assert t["var.head.weight"].shape == (V, C)
    assert t["vq.codebook.weight"].shape == (V, E)
    assert [t[f"vq.phi.{k}.weight"].shape for k in range(4)] == [(E, E, 3, 3)] * 4
    # up.0 is the coarsest level (64 channels, with attention), VAR's up.1
    assert t["vq.decoder.up.0.block.0.conv1.weight"].shape == (64, 64, 3, 3)
    assert t["vq.decoder.up.0.attn.1.q.weight"].shape == (64, 64, 1, 1)
    assert t["vq.decoder.up.1.block.0.nin_shortcut.weight"].shape == (32, 64, 1, 1)
    assert "vq.decoder.up.1.upsample.conv.weight" not in t
    assert not any(k.startswith("vq.encoder") or "quant_conv." in k.replace("post_quant_conv.", "")
                   for k in t)
    # the qkv split: q, k, v are the three thirds of VAR's fused qkv
    vae = convert_var.load_checkpoint(VAE_PTH)
    qkv = vae["decoder.up.1.attn.0.qkv.weight"].astype(np.float32)
    for j, n in enumerate("qkv"):
        assert np.array_equal(t[f"vq.decoder.up.0.attn.0.{n}.weight"], qkv[64 * j:64 * (j + 1)])


def test_reader_agrees_with_torch_load():
    torch = pytest.importorskip("torch")  # optional cross-check; the tests above need no torch
    for path in (VAR_PTH, VAE_PTH):
        mine = convert_var.load_checkpoint(path)
        ref = torch.load(path, map_location="cpu", weights_only=True)
        assert sorted(mine) == sorted(ref)
        for k, v in ref.items():
            assert np.array_equal(mine[k], v.numpy()) and mine[k].dtype == v.numpy().dtype, k


def test_f16_output_is_the_golden_rounded(tmp_path):
    rc, err = run(VAR_PTH, VAE_PTH, tmp_path / "out", "--patch-nums", "1,2,3,4", "--dtype", "f16")
    assert rc == 0, err
    got = safetensors_write.read(str(tmp_path / "out" / "model.safetensors"))
    want = safetensors_write.read(os.path.join(GOLDEN, "model.safetensors"))
    for name in want:
        if want[name].ndim >= 2:  # matrices in the type asked for
            assert got[name].dtype == np.float16, name
            assert np.array_equal(got[name], want[name].astype(np.float16)), name
        else:  # vectors as stored
            assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name


def test_patch_nums_that_do_not_add_up_to_pos_1LC_are_refused(tmp_path):
    rc, err = run(VAR_PTH, VAE_PTH, tmp_path / "out", "--patch-nums", "1,2,4")
    assert rc == 1
    assert "'pos_1LC' has 30 positions" in err and "1,2,4 add up to 21 tokens" in err, err
    assert not (tmp_path / "out").exists(), "nothing is written for a refused checkpoint"
    # the default (VAR's 256 px scales, 680 tokens) does not fit the tiny model either
    rc, err = run(VAR_PTH, VAE_PTH, tmp_path / "out")
    assert rc == 1 and "add up to 680 tokens" in err, err


def test_scale_count_must_match_lvl_embed():
    # 1 + 4 + 25 = 30 tokens, as many as pos_1LC, but three scales for four level embeddings
    msg = refusal(patch_nums=(1, 2, 5))
    assert "'lvl_embed.weight'" in msg and "4 levels" in msg and "3 scales" in msg, msg


def test_first_scale_must_match_pos_start():
    msg = refusal(patch_nums=(2, 3, 4, 5))
    assert "'pos_start' has 1 rows but the first scale 2 has 4 tokens" in msg, msg


def test_without_attn_l2_norm_is_refused():
    sd = {k: v for k, v in convert_var.load_checkpoint(VAR_PTH).items() if "scale_mul" not in k}
    msg = refusal(var_sd=sd)
    assert "attn_l2_norm=False" in msg and "scale_mul_1H11" in msg, msg


def test_unknown_tensors_are_refused():
    sd = convert_var.load_checkpoint(VAR_PTH)
    sd["blocks.0.ffn.fcg.weight"] = np.zeros((4, 4), np.float32)
    msg = refusal(var_sd=sd)
    assert "does not know how to run" in msg and "blocks.0.ffn.fcg.weight" in msg, msg


def test_swapped_checkpoints_are_named():
    var_sd, vae_sd = convert_var.load_checkpoint(VAR_PTH), convert_var.load_checkpoint(VAE_PTH)
    msg = refusal(var_sd=vae_sd, vae_sd=var_sd)
    assert "not a VAR transformer checkpoint" in msg, msg


def test_decoder_without_attention_is_refused():
    sd = {k: v for k, v in convert_var.load_checkpoint(VAE_PTH).items()
          if not k.startswith("decoder.mid.attn_1.")}
    msg = refusal(vae_sd=sd)
    assert "decoder.mid.attn_1.qkv.weight" in msg and "without self-attention" in msg, msg


def test_identity_phi_is_refused():
    sd = {k: v for k, v in convert_var.load_checkpoint(VAE_PTH).items()
          if "quant_resi" not in k}
    msg = refusal(vae_sd=sd)
    assert "quant_resi=0" in msg, msg


def test_codebook_must_match_the_head():
    sd = convert_var.load_checkpoint(VAE_PTH)
    sd["quantize.embedding.weight"] = sd["quantize.embedding.weight"][:32]
    msg = refusal(vae_sd=sd)
    assert "predicts 64 codes" in msg and "codebook of 32" in msg, msg


def test_class_names(tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("\n".join(f"class {i}" for i in range(9)) + "\n")
    rc, err = run(VAR_PTH, VAE_PTH, tmp_path / "bad", "--patch-nums", "1,2,3,4",
                  "--class-names", names)
    assert rc == 1 and "9 class names" in err and "10 classes" in err, err
    names.write_text("\n".join(f"class {i}" for i in range(10)) + "\n")
    rc, err = run(VAR_PTH, VAE_PTH, tmp_path / "ok", "--patch-nums", "1,2,3,4",
                  "--class-names", names)
    assert rc == 0, err
    manifest = json.loads((tmp_path / "ok" / "arserve.json").read_text())
    assert manifest["condition"] == {"num_classes": 10, "class_names": "classes.txt"}
    assert (tmp_path / "ok" / "classes.txt").read_text() == names.read_text()


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_checkpoint_holding_code_is_refused_without_running_it(tmp_path):
    path = tmp_path / "evil.pth"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps({"x": _Evil()}, protocol=2))
    rc, err = run(path, VAE_PTH, tmp_path / "out", "--patch-nums", "1,2,3,4")
    assert rc == 1 and "system object" in err and "only tensors" in err, err
