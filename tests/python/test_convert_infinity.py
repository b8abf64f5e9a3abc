"""tools/convert/infinity.py on the small official-format checkpoints under
tests/golden/infinity_tiny*/official/ (written with FoundationVision/Infinity's own classes, see
tests/golden/infinity_tiny/README.md): its output must equal the committed golden model
directories tensor by tensor, the sharded and module-named forms of the same weights must give
the same result, and what the engine cannot run is refused with a message naming it.

The converter reads torch.save's zip format and safetensors with numpy alone, so this runs in
the test venv without torch; where torch is importable the reader is also checked against it.

    .venv/bin/python -m pytest tests/python/test_convert_infinity.py -q
"""

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")
CONVERTER = os.path.join(TOOLS, "convert", "infinity.py")
GOLDEN = os.path.join(ROOT, "tests", "golden", "infinity_tiny")
GOLDENS = [d for d in (GOLDEN, os.path.join(ROOT, "tests", "golden", "infinity_tiny_patchify"))
           if os.path.isdir(d)]


def official(golden=GOLDEN):
    o = os.path.join(golden, "official")
    return os.path.join(o, "infinity.pth"), os.path.join(o, "vae.pth"), os.path.join(o, "t5")


INF_PTH, VAE_PTH, T5_DIR = official()

sys.path.insert(0, TOOLS)
import safetensors_write  # noqa: E402
from conftest import scaled  # noqa: E402

_spec = importlib.util.spec_from_file_location("convert_infinity", CONVERTER)
conv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conv)


def run(*args):
    p = subprocess.run([sys.executable, CONVERTER, *map(str, args)], capture_output=True,
                       text=True, timeout=scaled(120))
    return p.returncode, p.stdout + p.stderr


def loaded(golden=GOLDEN):
    inf, vae, t5 = official(golden)
    cfg, t5sd = conv.load_t5(t5)
    return conv.load_infinity(inf), conv.load_vae(vae), cfg, t5sd


def refusal(inf_sd=None, vae_sd=None, t5_cfg=None, t5_sd=None, pn="0.06M", ratios=None):
    a, b, c, d = loaded()
    with pytest.raises(conv.ConversionError) as e:
        conv.build(inf_sd if inf_sd is not None else a, vae_sd if vae_sd is not None else b,
                   t5_cfg if t5_cfg is not None else c, t5_sd if t5_sd is not None else d,
                   pn, "x", ratios)
    return str(e.value)


def same_as_golden(out, golden):
    with open(os.path.join(golden, "arserve.json")) as f:
        want_manifest = json.load(f)
    assert json.loads((out / "arserve.json").read_text()) == want_manifest
    got = safetensors_write.read(str(out / "model.safetensors"))
    want = safetensors_write.read(os.path.join(golden, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        assert np.array_equal(got[name], want[name]), name


@pytest.mark.parametrize("golden", GOLDENS, ids=os.path.basename)
def test_converter_reproduces_the_golden_model(tmp_path, golden):
    out = tmp_path / "out"
    inf, vae, t5 = official(golden)
    name = json.load(open(os.path.join(golden, "arserve.json")))["name"]
    rc, err = run(inf, vae, t5, out, "--pn", "0.06M", "--name", name)
    assert rc == 0, err
    same_as_golden(out, golden)
    for f in ("arserve.json", "model.safetensors", "tokenizer.json"):
        assert (out / f).read_bytes() == open(os.path.join(golden, f), "rb").read(), f
    assert (out / "tokenizer.json").read_bytes() == open(os.path.join(t5, "tokenizer.json"), "rb").read()


def test_layout_is_the_documented_one():
    t = safetensors_write.read(os.path.join(GOLDEN, "model.safetensors"))
    m = json.load(open(os.path.join(GOLDEN, "arserve.json")))
    C, H, bits, Ct5 = 64, 2, 8, 256
    assert m["family"] == "scale" and m["architecture"] == "infinity"
    assert m["llm"]["hidden_size"] == C and m["llm"]["num_heads"] == H
    assert m["text"]["pool_heads"] == 2 and m["text"]["max_tokens"] == 16
    assert m["image"]["bits"] == bits and m["image"]["spatial_patchify"] is False
    sizes = {s["name"]: s for s in m["image"]["sizes"]}
    assert len(sizes) == 15 and m["image"]["default_size"] == "64x64"
    assert sizes["64x64"]["scales"] == [[1, 1], [2, 2], [4, 4], [6, 6], [8, 8], [12, 12], [16, 16]]
    assert sizes["64x64"]["rope_grid"] == [64, 64]
    # h/w 0.5: the last 0.06M scale is 11 x 22 tokens, 44 x 88 pixels; 1M ends at 45 x 90
    assert sizes["88x44"]["scales"][-1] == [11, 22] and sizes["88x44"]["rope_grid"] == [45, 90]
    assert t["inf.blocks.1.ada_gss"].shape == (6, C)
    assert t["inf.blocks.0.sa.scale_mul_1H11"].shape == (H,)
    assert t["inf.text_proj_for_sos.ca.mat_q"].shape == (C,)
    assert t["inf.cfg_uncond"].shape == (16, Ct5)
    assert t["inf.head.weight"].shape == (2 * bits, C)
    assert t["t5.shared.weight"].shape == (300, Ct5)
    assert t["t5.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape == (32, 4)
    assert "t5.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in t
    assert t["t5.block.1.layer.1.DenseReluDense.wi_0.weight"].shape == (128, Ct5)
    # decoder: up.0 is the coarsest level (applied first), the official up.2
    assert t["vq.decoder.conv_in.weight"].shape == (32, 8, 3, 3)
    assert t["vq.decoder.up.2.block.0.nin_shortcut.weight"].shape == (64, 32, 1, 1)
    assert "vq.decoder.up.2.upsample.conv.weight" not in t
    assert t["vq.decoder.up.0.upsample.conv.weight"].shape == (32, 32, 3, 3)
    assert not any(k.startswith(("vq.encoder", "vq.quant")) or "zero_k_bias" in k for k in t)
    # block_chunks.{c}.module.{j} -> blocks.{c * per_chunk + j}
    sd = conv.load_infinity(INF_PTH)
    assert np.array_equal(t["inf.blocks.1.sa.mat_qkv.weight"],
                          sd["block_chunks.1.module.0.sa.mat_qkv.weight"].astype(np.float32))
    vae = conv.load_vae(VAE_PTH)
    assert np.array_equal(t["vq.decoder.up.0.block.1.conv1.weight"],
                          vae["decoder.up.2.block.1.conv1.weight"].astype(np.float32))


def test_reader_agrees_with_torch_load():
    torch = pytest.importorskip("torch")  # optional cross-check; the tests above need no torch
    mine = conv.load_infinity(INF_PTH)
    ref = torch.load(INF_PTH, map_location="cpu", weights_only=True)
    assert sorted(mine) == sorted(ref)
    for k, v in ref.items():
        assert np.array_equal(mine[k], v.numpy()) and mine[k].dtype == v.numpy().dtype, k
    mine = conv.load_vae(VAE_PTH)
    ref = torch.load(VAE_PTH, map_location="cpu", weights_only=True)["vae"]
    assert sorted(mine) == sorted(ref)


def test_f16_output_is_the_golden_rounded(tmp_path):
    rc, err = run(INF_PTH, VAE_PTH, T5_DIR, tmp_path / "out", "--pn", "0.06M", "--dtype", "f16")
    assert rc == 0, err
    got = safetensors_write.read(str(tmp_path / "out" / "model.safetensors"))
    want = safetensors_write.read(os.path.join(GOLDEN, "model.safetensors"))
    for name in want:
        if want[name].ndim >= 2:  # matrices in the type asked for
            assert got[name].dtype == np.float16, name
            assert np.array_equal(got[name], want[name].astype(np.float16)), name
        else:  # vectors as stored
            assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name


def _write_shards(sd, folder, n=3):
    """sd split into n safetensors shards with a weight map, as Hugging Face shards."""
    os.makedirs(folder, exist_ok=True)
    keys = sorted(sd)
    wm = {}
    for i in range(n):
        part = {k: sd[k] for k in keys[i::n]}
        fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        safetensors_write.write(os.path.join(folder, fn), part)
        wm.update({k: fn for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return [os.path.join(folder, f"model-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]


def test_sharded_transformer_and_t5_give_the_same_model(tmp_path):
    inf_sd, _, cfg, t5sd = loaded()
    files = _write_shards(inf_sd, str(tmp_path / "infinity_8b_weights"))
    t5 = tmp_path / "t5"
    _write_shards({("encoder." + k if k.startswith("block") else k): v for k, v in t5sd.items()}, str(t5), 2)
    shutil.copy(os.path.join(T5_DIR, "config.json"), t5)
    shutil.copy(os.path.join(T5_DIR, "tokenizer.json"), t5)
    name = json.load(open(os.path.join(GOLDEN, "arserve.json")))["name"]
    for i, src in enumerate((tmp_path / "infinity_8b_weights", ",".join(files))):
        out = tmp_path / f"out{i}"
        rc, err = run(src, VAE_PTH, t5, out, "--pn", "0.06M", "--name", name)
        assert rc == 0, err
        same_as_golden(out, GOLDEN)


def test_unchunked_blocks_and_module_names_are_accepted():
    inf_sd, vae_sd, cfg, t5sd = loaded()
    want = conv.build(inf_sd, vae_sd, cfg, t5sd, "0.06M", "x")
    # blocks.{i} instead of block_chunks.{c}.module.{j}
    flat = {k.replace("block_chunks.0.module.0.", "blocks.0.").replace("block_chunks.1.module.0.", "blocks.1."): v
            for k, v in inf_sd.items()}
    # the VAE's module names (Conv and Normalize wrappers) instead of the checkpoint's
    wrapped = {}
    for k, v in vae_sd.items():
        parts = k.split(".")
        if parts[0] == "decoder" and parts[-2] in conv._WRAPPED:
            parts.insert(-1, "norm" if parts[-2].startswith("norm") else "conv")
        wrapped[".".join(parts)] = v
    assert "decoder.up.1.upsample.conv.conv.weight" in wrapped
    assert "decoder.mid.block_1.norm1.norm.weight" in wrapped
    got = conv.build(flat, wrapped, cfg, t5sd, "0.06M", "x")
    assert got[0] == want[0] and sorted(got[1]) == sorted(want[1])
    for k in want[1]:
        assert np.array_equal(got[1][k], want[1][k]), k


def test_full_t5_checkpoint_drops_the_decoder():
    inf_sd, vae_sd, cfg, t5sd = loaded()
    full = dict(t5sd)
    full["decoder.block.0.layer.0.SelfAttention.q.weight"] = np.zeros((64, 256), np.float32)
    full["lm_head.weight"] = np.zeros((300, 256), np.float32)
    m, t, notes = conv.build(inf_sd, vae_sd, cfg, full, "0.06M", "x")
    assert any("dropped 2 decoder tensors" in n for n in notes), notes
    assert not any(k.startswith("t5.decoder") or "lm_head" in k for k in t)


def test_ratios_and_pn():
    inf_sd, vae_sd, cfg, t5sd = loaded()
    m, _, _ = conv.build(inf_sd, vae_sd, cfg, t5sd, "0.06M", "x", [0.5, 1.0])
    assert [s["name"] for s in m["image"]["sizes"]] == ["88x44", "64x64"]
    assert m["image"]["default_size"] == "64x64"
    m, _, _ = conv.build(inf_sd, vae_sd, cfg, t5sd, "1M", "x", [1.0])
    assert m["image"]["sizes"][0]["name"] == "256x256" and len(m["image"]["sizes"][0]["scales"]) == 13
    assert "--ratios: 0.7 is not one of" in refusal(ratios=[0.7])
    assert "--pn '2M'" in refusal(pn="2M")


def test_the_schedule_table_has_infinity_shape():
    t = conv.templates()
    assert [r for r, _ in t] == [1.0, 1.25, 0.8, 1.333, 0.75, 1.5, 0.666, 1.75, 0.571, 2.0, 0.5,
                                 2.5, 0.4, 3.0, 0.333]
    for r, hw in t:
        assert len(hw) == 13 and hw[0] == (1, 1)
        for n in (7, 10, 12, 13):  # each pn's last scale has the template's aspect ratio
            h, w = hw[n - 1]
            assert abs(h / w - r) < 0.01 or abs(h / w - 1 / round(1 / r, 3)) < 0.01, (r, n)
    one = dict(t)[1.0]
    assert sum(h * w for h, w in one) == 10521 and sum(h * w for h, w in one[:7]) == 521


# ---- refusals ---------------------------------------------------------------------------------

def _inf(**edit):
    sd = conv.load_infinity(INF_PTH)
    for k, v in edit.items():
        k = k.replace("__", ".")
        if v is None:
            del sd[k]
        else:
            sd[k] = v
    return sd


def test_swiglu_is_refused():
    msg = refusal(inf_sd=_inf(**{"block_chunks.0.module.0.ffn.fcg.weight": np.zeros((256, 64), np.float32)}))
    assert "'blocks.0.ffn.fcg.weight'" in msg and "swiglu=True" in msg, msg


def test_rms_norm_is_refused():
    msg = refusal(inf_sd=_inf(**{"block_chunks.1.module.0.ca_norm.bias": None}))
    assert "'blocks.1.ca_norm' has no bias" in msg and "rms_norm=True" in msg, msg


def test_without_cos_attn_is_refused():
    msg = refusal(inf_sd=_inf(**{"block_chunks.0.module.0.sa.scale_mul_1H11": None}))
    assert "'blocks.0.sa.scale_mul_1H11'" in msg and "cos_attn=False" in msg, msg


def test_non_shared_adaln_is_refused():
    msg = refusal(inf_sd=_inf(**{"block_chunks.0.module.0.ada_lin.1.weight": np.zeros((384, 64), np.float32)}))
    assert "shared_aln=False" in msg and "'blocks.0.ada_lin.1.weight'" in msg, msg


def test_deeper_head_is_refused():
    sd = _inf(**{"head.weight": None, "head.bias": None})
    sd["head.0.weight"] = np.zeros((64, 64), np.float32)
    sd["head.2.weight"] = np.zeros((16, 64), np.float32)
    msg = refusal(inf_sd=sd)
    assert "head.0.weight" in msg and "head_depth > 1" in msg, msg


def test_unknown_and_missing_tensors_are_named():
    msg = refusal(inf_sd=_inf(**{"block_chunks.0.module.0.sa.extra": np.zeros(4, np.float32)}))
    assert "does not know how to run" in msg and "blocks.0.sa.extra" in msg, msg
    msg = refusal(inf_sd=_inf(**{"block_chunks.1.module.0.ca.v_bias": None}))
    assert "missing tensor 'blocks.1.ca.v_bias'" in msg, msg
    msg = refusal(inf_sd=_inf(**{"block_chunks.0.module.0.sa.zero_k_bias": np.ones(64, np.float32)}))
    assert "zero_k_bias' is not zero" in msg, msg


def test_cfg_uncond_must_match_the_text_encoder():
    sd = _inf()
    sd["cfg_uncond"] = sd["cfg_uncond"][:, :128]
    msg = refusal(inf_sd=sd)
    assert "'cfg_uncond' has 128 columns but 'text_norm.weight' has 256" in msg, msg
    sd = _inf()
    for k in ("cfg_uncond", "text_norm.weight", "text_proj_for_sos.ca.mat_kv.weight", "text_proj_for_ca.0.weight"):
        sd[k] = sd[k][..., :128]
    sd["text_proj_for_sos.ca.mat_q"] = sd["text_proj_for_sos.ca.mat_q"].reshape(1, 1, 64)
    msg = refusal(inf_sd=sd)
    assert "'cfg_uncond' has 128 columns (text_channels)" in msg and "d_model is 256" in msg, msg


def test_pool_heads_must_follow_the_text_width():
    sd = _inf()
    sd["text_proj_for_sos.ca.mat_q"] = sd["text_proj_for_sos.ca.mat_q"].reshape(1, 4, 16)
    msg = refusal(inf_sd=sd)
    assert "the attentive pool has 4 heads" in msg and "256 // 128 = 2" in msg, msg


def test_bits_must_match_the_decoder():
    sd = conv.load_vae(VAE_PTH)
    sd["decoder.conv_in.weight"] = sd["decoder.conv_in.weight"][:, :6]
    msg = refusal(vae_sd=sd)
    assert "8 bits per token" in msg and "takes 6 channels" in msg, msg


def test_attention_in_the_vae_is_refused():
    sd = conv.load_vae(VAE_PTH)
    sd["decoder.mid.attn_1.q.weight"] = np.zeros((32, 32, 1, 1), np.float32)
    msg = refusal(vae_sd=sd)
    assert "'decoder.mid.attn_1.q.weight'" in msg and "cnn_attention" in msg, msg


def test_quantizer_projection_is_refused():
    sd = conv.load_vae(VAE_PTH)
    sd["quantizer.lfq.project_out.weight"] = np.zeros((8, 8), np.float32)
    msg = refusal(vae_sd=sd)
    assert "'quantizer.lfq.project_out.weight'" in msg and "projection" in msg, msg


def test_non_gated_t5_is_refused():
    _, _, cfg, _ = loaded()
    msg = refusal(t5_cfg=dict(cfg, feed_forward_proj="relu"))
    assert "feed_forward_proj is 'relu'" in msg and "gated-gelu" in msg, msg


def test_swapped_checkpoints_are_named():
    inf_sd, vae_sd, _, _ = loaded()
    msg = refusal(inf_sd=vae_sd, vae_sd=inf_sd)
    assert "not an Infinity transformer checkpoint" in msg, msg


def test_existing_output_and_missing_tokenizer(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    rc, err = run(INF_PTH, VAE_PTH, T5_DIR, tmp_path / "out", "--pn", "0.06M")
    assert rc == 1 and "exists and is not empty" in err, err
    t5 = tmp_path / "t5"
    shutil.copytree(T5_DIR, t5)
    os.remove(t5 / "tokenizer.json")
    rc, err = run(INF_PTH, VAE_PTH, t5, tmp_path / "o2", "--pn", "0.06M")
    assert rc == 1 and "no tokenizer.json" in err, err
    assert not (tmp_path / "o2").exists(), "nothing is written for a refused conversion"


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_checkpoint_holding_code_is_refused_without_running_it(tmp_path):
    path = tmp_path / "evil.pth"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps({"x": _Evil()}, protocol=2))
    rc, err = run(path, VAE_PTH, T5_DIR, tmp_path / "out", "--pn", "0.06M")
    assert rc == 1 and "system object" in err and "only tensors" in err and "pwned" not in err, err
