"""tools/convert/llamagen.py on the small official-format checkpoints under
tests/golden/llamagen_tiny/official/ (written with FoundationVision/LlamaGen's own classes, see
tests/golden/llamagen_tiny/README.md: a committed fixture, since the official code is not
available at test time): its output must equal the committed golden model directory tensor by
tensor, the real sizes' expected tensor sets are right, and what the engine cannot run is
refused with a message naming the problem.

The converter reads torch.save's zip format with numpy alone, so this runs in the test venv
without torch; where torch is importable the reader is also checked against torch.load and a
checkpoint in the other containers sample_c2i.py accepts is written with it.

    .venv/bin/python -m pytest tests/python/test_convert_llamagen.py -q
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")
CONVERTER = os.path.join(TOOLS, "convert", "llamagen.py")
GOLDEN = os.path.join(ROOT, "tests", "golden", "llamagen_tiny")
GPT_PT = os.path.join(GOLDEN, "official", "c2i_tiny.pt")
VQ_PT = os.path.join(GOLDEN, "official", "vq_tiny.pt")
ARGS = ("--n-head", "4", "--image-size", "32")

sys.path.insert(0, TOOLS)
import safetensors_write  # noqa: E402
from conftest import scaled  # noqa: E402

_spec = importlib.util.spec_from_file_location("convert_llamagen", CONVERTER)
conv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conv)


def run(*args):
    p = subprocess.run([sys.executable, CONVERTER, *map(str, args)], capture_output=True,
                       text=True, timeout=scaled(120))
    return p.returncode, p.stdout, p.stderr


def sds():
    gpt = conv.state_dict(conv.load_container(GPT_PT), GPT_PT)
    vq = conv.state_dict(conv.load_container(VQ_PT), VQ_PT, keys=("model",))
    return gpt, vq


def refusal(gpt=None, vq=None, **kw):
    g, v = sds()
    kw.setdefault("n_head", 4)
    with pytest.raises(conv.ConversionError) as e:
        conv.build(gpt if gpt is not None else g, vq if vq is not None else v, 32, "x", **kw)
    return str(e.value)


def test_converter_reproduces_the_golden_model(tmp_path):
    out = tmp_path / "out"
    rc, stdout, err = run(GPT_PT, VQ_PT, out, *ARGS, "--name", "llamagen-tiny-random")
    assert rc == 0, err
    assert "134 tensors" in stdout and "3 layers x 64" in stdout and "grid 8 x 8" in stdout, stdout
    with open(os.path.join(GOLDEN, "arserve.json")) as f:
        want_manifest = json.load(f)
    assert json.loads((out / "arserve.json").read_text()) == want_manifest
    got = safetensors_write.read(str(out / "model.safetensors"))
    want = safetensors_write.read(os.path.join(GOLDEN, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == np.float32 and want[name].dtype == np.float32, name
        assert np.array_equal(got[name], want[name]), name


def test_layout_is_the_documented_one():
    t = safetensors_write.read(os.path.join(GOLDEN, "model.safetensors"))
    gpt, vq = sds()
    assert t["llm.class_embed.weight"].shape == (11, 64)  # 10 classes + the null class
    assert t["gen.embed.weight"].shape == (128, 64)
    assert t["gen.head.weight"].shape == (128, 64)
    assert t["llm.layers.2.attn.wqkv.weight"].shape == (192, 64)  # kept fused, q rows first
    assert np.array_equal(t["llm.layers.0.mlp.gate.weight"],
                          gpt["layers.0.feed_forward.w1.weight"].astype(np.float32))
    assert np.array_equal(t["llm.layers.0.mlp.up.weight"],
                          gpt["layers.0.feed_forward.w3.weight"].astype(np.float32))
    assert t["vq.codebook.weight"].shape == (128, 8)
    assert t["vq.post_quant_conv.weight"].shape == (32, 8, 1, 1)
    assert t["vq.decoder.mid.attn_1.q.weight"].shape == (64, 64, 1, 1)
    assert t["vq.decoder.up.0.attn.1.proj_out.weight"].shape == (64, 64, 1, 1)
    assert t["vq.decoder.up.1.block.0.nin_shortcut.weight"].shape == (32, 64, 1, 1)
    assert "vq.decoder.up.2.upsample.conv.weight" not in t
    assert not any("encoder" in k or "codebook_used" in k for k in t)
    assert "quantize.codebook_used" in vq and any(k.startswith("encoder.") for k in vq)


def test_reader_agrees_with_torch_load():
    torch = pytest.importorskip("torch")  # optional cross-check; the tests above need no torch
    for path in (GPT_PT, VQ_PT):
        mine = conv.load_container(path)["model"]
        ref = torch.load(path, map_location="cpu", weights_only=True)["model"]
        assert sorted(mine) == sorted(ref)
        for k, v in ref.items():
            assert np.array_equal(mine[k], v.numpy()), k


@pytest.mark.parametrize("container", ["module", "state_dict", None])
def test_other_containers_and_training_args(tmp_path, container):
    torch = pytest.importorskip("torch")
    import argparse
    sd = torch.load(GPT_PT, map_location="cpu", weights_only=True)["model"]
    obj = {container: sd, "args": argparse.Namespace(gpt_model="GPT-B"), "steps": 7} \
        if container else sd
    path = tmp_path / "c2i_tiny_32.pt"  # the image size from the file name
    torch.save(obj, path)
    rc, _, err = run(path, VQ_PT, tmp_path / "out", "--n-head", "4")
    assert rc == 0, err
    got = safetensors_write.read(str(tmp_path / "out" / "model.safetensors"))
    assert np.array_equal(got["gen.head.weight"],
                          safetensors_write.read(os.path.join(GOLDEN, "model.safetensors"))
                          ["gen.head.weight"])


def test_real_sizes_expect_the_published_shapes():
    # GPT-XL c2i 384: 36 layers of 1280, 20 heads, FFN find_multiple(int(2 * 4 * 1280 / 3), 256)
    F = conv.find_multiple(int(2 * 4 * 1280 / 3), 256)
    assert F == 3584
    a = {"L": 36, "D": 1280, "F": F, "V": 16384, "classes": 1000}
    t = conv.gpt_expected(a)
    assert len(t) == 4 + 7 * 36
    assert t["cls_embedding.embedding_table.weight"] == ("llm.class_embed.weight", (1001, 1280))
    assert t["layers.35.attention.wqkv.weight"][1] == (3840, 1280)
    # vq_ds16_c2i: ch 128, ch_mult 1,1,2,2,4, z 256, codebook 16384 x 8, 3 ResNet blocks a level
    q = {"V": 16384, "E": 8, "z": 256, "levels": 5, "n_res": 3,
         "widths": [512, 256, 256, 128, 128], "base": 128, "mult": [1, 1, 2, 2, 4]}
    v = conv.vq_expected(q)
    assert v["decoder.conv_in.weight"] == ("vq.decoder.conv_in.weight", (512, 256, 3, 3))
    assert v["decoder.conv_blocks.0.attn.2.q.weight"][1] == (512, 512, 1, 1)
    assert v["decoder.conv_blocks.4.res.2.conv2.weight"][1] == (128, 128, 3, 3)
    assert "decoder.conv_blocks.4.upsample.conv.weight" not in v


def test_published_size_is_recognised_and_checked():
    gpt, _ = sds()
    assert "none of GPT-B" in refusal(n_head=None) and "--n-head" in refusal(n_head=None)
    msg = refusal(gpt_model="GPT-B")
    assert "3 layers of width 64, but --gpt-model GPT-B has 12 of 768" in msg, msg


def test_stray_and_missing_tensors_are_named():
    gpt, vq = sds()
    msg = refusal(gpt={**gpt, "layers.0.attention.bias": np.zeros(3, np.float32)})
    assert "unrecognised tensor layers.0.attention.bias" in msg, msg
    msg = refusal(vq={**vq, "decoder.extra.weight": np.zeros(3, np.float32)})
    assert "decoder.extra.weight" in msg, msg
    g = dict(gpt)
    del g["layers.1.ffn_norm.weight"]
    assert "missing tensor 'layers.1.ffn_norm.weight'" in refusal(gpt=g)
    g = dict(gpt, **{"output.weight": np.zeros((128, 32), np.float32)})
    assert "'output.weight' has shape [128, 32], expected [128, 64]" in refusal(gpt=g)
    # the RoPE table, if a checkpoint carries it, is derived: skipped, not refused
    m, t, _ = conv.build({**gpt, "freqs_cis": np.zeros((65, 8, 2), np.float32)}, vq, 32, "x",
                         n_head=4)
    assert "freqs_cis" not in t and len(t) == 134


def test_text_to_image_is_refused():
    gpt, _ = sds()
    t2i = {**gpt, "cls_embedding.cap_proj.fc1.weight": np.zeros((64, 2048), np.float32)}
    msg = refusal(gpt=t2i)
    assert "text-to-image" in msg and "T5" in msg, msg


def test_grouped_query_and_bad_sizes_are_refused():
    gpt, vq = sds()
    g = dict(gpt, **{"layers.0.attention.wqkv.weight": np.zeros((64 + 2 * 16, 64), np.float32)})
    assert "grouped-query attention is not supported" in refusal(gpt=g)
    g = dict(gpt, **{"tok_embeddings.weight": np.zeros((100, 64), np.float32)})
    assert "has 100 rows but" in refusal(gpt=g)
    with pytest.raises(conv.ConversionError, match="not a multiple of the VQ's downsampling 4"):
        conv.build(gpt, vq, 30, "x", n_head=4)


def test_image_size_needed_when_the_name_does_not_say(tmp_path):
    rc, _, err = run(GPT_PT, VQ_PT, tmp_path / "out", "--n-head", "4")
    assert rc == 1 and "give --image-size" in err, err
    assert conv.image_size_from_name("/x/c2i_XL_384.pt") == 384
    assert conv.image_size_from_name("c2i_B_256.pt") == 256
    assert not (tmp_path / "out").exists(), "nothing is written for a refused checkpoint"
