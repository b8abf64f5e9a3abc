"""tools/release_shapes: for every model at --tiny, the release's files are written with the
layout the tables say (read back by the converters' own reader, tools/convert/ckpt.py, with the
archive and header layout checked beside it, index JSONs against the shards), the bytes are deterministic in
the seed, and the shape tables at full size give the parameter counts and shard sizes of the
real releases. Where torch is importable, torch.load(weights_only=True) must agree.

    .venv/bin/python -m pytest tests/python/test_release_shapes.py -q
"""

import json
import math
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from conftest import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tools", "convert"))
import ckpt  # noqa: E402  (the converters' reader)
import safetensors_write  # noqa: E402
from tools.release_shapes import releases, tensors  # noqa: E402

MODELS = releases.MODELS
# Written again with the same and another seed: every model but the 1B Janus, whose tiny
# release is the 7B's unsharded (its full-size VQ-16 makes it the slowest to write).
SEEDED = [m for m in MODELS if m != "janus-pro-1b"]


def run(*args):
    return subprocess.run([sys.executable, "-m", "tools.release_shapes", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=scaled(120))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Each model at --tiny written twice with seed 0 and once with seed 1."""
    base = tmp_path_factory.mktemp("rs")
    out = {}
    for m in MODELS:
        for tag, seed in (("a", 0), ("b", 0), ("c", 1)) if m in SEEDED else (("a", 0),):
            d = base / f"{m}-{tag}"
            p = run(m, d, "--tiny", "--seed", seed)
            assert p.returncode == 0, p.stderr
            out[(m, tag)] = (d, p.stdout)
    return out


# ---- reading back: tools/convert/ckpt.py (the converters' reader), and the layout it does not
# look at: torch.save's archive (named for the file, entries stored, data 64-byte aligned,
# contiguous tensors in an OrderedDict), safetensors' data packed without holes ------------

def check_torch_layout(path):
    zf = zipfile.ZipFile(path)
    arch = os.path.splitext(os.path.basename(path))[0]
    names = zf.namelist()
    assert f"{arch}/data.pkl" in names and f"{arch}/version" in names, names[:5]
    assert zf.read(f"{arch}/byteorder") == b"little"
    with open(path, "rb") as raw:
        for info in zf.infolist():
            assert info.compress_type == zipfile.ZIP_STORED, info.filename
            if info.filename.startswith(f"{arch}/data/"):
                # torch aligns record data to 64 bytes (mmap loading relies on it)
                raw.seek(info.header_offset + 26)
                n, m = (int(x) for x in np.frombuffer(raw.read(4), "<u2"))
                assert (info.header_offset + 30 + n + m) % 64 == 0, info.filename


def check_safetensors_layout(path):
    header, start = safetensors_write.read_header(path)
    spans = sorted(h["data_offsets"] for k, h in header.items() if k != "__metadata__")
    assert [b for b, _ in spans] == [0] + [e for _, e in spans[:-1]]  # no holes
    assert start + (spans[-1][1] if spans else 0) == os.path.getsize(path)


def read_file(path, f=None):
    """{name: (stored bits, stored type)} of a release file, its layout checked."""
    if path.endswith(".safetensors"):
        check_safetensors_layout(path)
        sd = ckpt.read_file(path)
    else:
        check_torch_layout(path)
        obj = ckpt.read_file(path)
        if f is not None and f.wrap:
            assert list(obj) == [f.wrap]
            obj = obj[f.wrap]
        assert type(obj).__name__ == "OrderedDict"
        sd = obj
    return {k: (t.bits(), t.stored) for k, t in sd.items()}


STORED = {"f32": "F32", "bf16": "BF16", "i64": "I64"}


# ---- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_tiny_release_is_written_as_the_tables_say(written, model):
    d, stdout = written[(model, "a")]
    r = releases.release(model, tiny=True)
    got = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    assert got == sorted(f.path for f in r.files)
    assert f"{r.params:,} parameters" in stdout
    for f in r.files:
        path = d / f.path
        if f.kind == "text":
            assert path.read_text(encoding="utf-8") == f.text
            if f.path.endswith(".json"):
                json.loads(f.text)
            continue
        sd = read_file(str(path), f)
        assert list(sd) == [t.name for t in f.tensors] or f.kind == "safetensors"
        assert sorted(sd) == sorted(t.name for t in f.tensors)
        for t in f.tensors:
            arr, cls = sd[t.name]
            assert arr.shape == t.shape, t.name
            assert cls == STORED[t.dtype], t.name
            assert np.array_equal(arr, tensors.values(t, 0)), t.name


@pytest.mark.parametrize("model", SEEDED)
def test_bytes_depend_on_the_seed_only(written, model):
    a, b, c = (written[(model, k)][0] for k in "abc")
    r = releases.release(model, tiny=True)
    weights = [f.path for f in r.files if f.tensors]
    for p in weights:
        assert (a / p).read_bytes() == (b / p).read_bytes(), p
    # every randomly drawn tensor changes with the seed (not just the archive's id)
    for f in r.files:
        if f.tensors:
            sa, sc = read_file(str(a / f.path), f), read_file(str(c / f.path), f)
            for t in f.tensors:
                if t.init[0] == "normal" and t.init[1] > 0:
                    assert not np.array_equal(sa[t.name][0], sc[t.name][0]), t.name
    for f in r.files:
        if f.kind == "text":
            assert (a / f.path).read_bytes() == (c / f.path).read_bytes(), f.path


def test_a_tensor_does_not_depend_on_its_neighbours():
    t = tensors.linear("x.weight", 64, 32, "f32")
    alone = tensors.values(t, 5)
    chunked = np.concatenate(list(tensors.fill_chunks(t, 5)))
    assert np.array_equal(alone.reshape(-1), chunked)
    renamed = tensors.linear("y.weight", 64, 32, "f32")
    assert not np.array_equal(alone, tensors.values(renamed, 5))
    assert abs(alone.std() - 1 / math.sqrt(32)) < 0.02  # N(0, 1/fan_in)


def test_values_are_sensible():
    cb = tensors.unit_rows("quantize.embedding.weight", (100, 8), "f32")
    assert np.allclose(np.linalg.norm(tensors.values(cb, 0), axis=1), 1, atol=1e-5)
    nw = tensors.values(tensors.norm_weight("n.weight", 1000, "f32"), 0)
    assert abs(nw.mean() - 1) < 0.01 and nw.std() < 0.05
    bf = tensors.values(tensors.linear("w", 256, 256, "bf16"), 0)
    back = (bf.astype(np.uint32) << 16).view(np.float32)
    want = tensors.values(tensors.linear("w", 256, 256, "f32"), 0)
    assert np.max(np.abs(back - want)) <= np.max(np.abs(want)) * 2 ** -8
    assert tensors.to_bf16_bits(np.array([1.0 + 2 ** -8], np.float32))[0] == 0x3F80  # ties to even
    var = releases.release("var-d30", tiny=True)
    by = {t.name: t for t in var.tensors()}
    sm = tensors.values(by["blocks.0.attn.scale_mul_1H11"], 0)
    assert np.allclose(sm, math.log(4))  # VAR initialises scale_mul to ln 4
    lv = tensors.values(by["lvl_1L"], 0).reshape(-1)
    assert lv[0] == 0 and lv[1] == 1 and lv[-1] == 9 and lv.size == 680
    mask = tensors.values(by["attn_bias_for_masking"], 0)[0, 0]
    assert mask[0, 0] == 0 and mask[0, 1] == -np.inf and mask[679, 0] == 0 and mask[1, 4] == 0


def test_full_size_tables_match_the_real_releases():
    # parameter counts the official classes give (NOTES.md, model cards)
    inf2 = releases.release("infinity-2b")
    inf8 = releases.release("infinity-8b")
    tr2 = next(f for f in inf2.files if f.path == "infinity_2b_reg.pth")
    assert sum(t.numel for t in tr2.tensors if not t.buffer) == 2_204_564_032
    tr8 = [t for f in inf8.files if f.path.startswith("infinity_8b_weights/") for t in f.tensors]
    assert sum(t.numel for t in tr8 if not t.buffer) == 8_375_791_824
    enc = [t for f in inf2.files if "flan-t5-xl/" in f.path for t in f.tensors
           if t.name == "shared.weight" or t.name.startswith("encoder.")]
    assert sum(t.numel for t in enc) == 1_223_527_424
    for rel, vae, want in ((inf2, "infinity_vae_d32reg.pth", 65.1e6), (inf8, "infinity_vae_d56_f8_14_patchify.pth", 48.5e6)):
        dec = [t for f in rel.files if f.path == vae for t in f.tensors if t.name.startswith("decoder.")]
        assert round(sum(t.numel for t in dec) / 1e5) == round(want / 1e5)
    gpt = next(f for f in releases.release("llamagen-xl").files if f.path == "c2i_XL_384.pt")
    assert sum(t.numel for t in gpt.tensors) == 774_699_520  # gpt.py: "GPT_XL ... # 775M"
    # file sizes the release pages list (GB = 1e9 bytes, to their 3 significant digits)
    sizes = {
        ("janus-pro-1b", "pytorch_model.bin"): 4.18,
        ("janus-pro-7b", "pytorch_model-00001-of-00002.bin"): 9.99,
        ("janus-pro-7b", "pytorch_model-00002-of-00002.bin"): 4.85,
        ("infinity-2b", "infinity_2b_reg.pth"): 8.82,
        ("infinity-2b", "flan-t5-xl/model-00001-of-00002.safetensors"): 9.45,
        ("infinity-2b", "flan-t5-xl/model-00002-of-00002.safetensors"): 1.95,
        ("infinity-8b", "infinity_8b_weights/model-00001-of-00004.safetensors"): 8.22,
        ("infinity-8b", "infinity_8b_weights/model-00004-of-00004.safetensors"): 8.83,
        ("var-d30", "vae_ch160v4096z32.pth"): 0.436,
    }
    for (m, path), gb in sizes.items():
        f = next(f for f in releases.release(m).files if f.path == path)
        assert round(sum(t.nbytes for t in f.tensors) / 1e9, 3 if gb < 1 else 2) == gb, (m, path)


def test_tiny_keeps_the_release_structure():
    for m in MODELS:
        full, tiny = releases.release(m), releases.release(m, tiny=True)
        assert [f.path for f in full.files] == [f.path for f in tiny.files], m
        for a, b in zip(full.files, tiny.files):
            assert a.kind == b.kind and a.wrap == b.wrap, a.path
            if a.tensors:
                assert {t.dtype for t in a.tensors} == {t.dtype for t in b.tensors}, a.path
            if a.path.endswith("config.json") and a.kind == "text":
                # the 7B's language_config leaves its sizes to LlamaConfig's defaults, which a
                # tiny model must name
                extra = _keys(json.loads(b.text)) - _keys(json.loads(a.text))
                assert _keys(json.loads(a.text)) <= _keys(json.loads(b.text)), a.path
                assert extra <= {"language_config." + k for k in ("hidden_size", "intermediate_size",
                                 "num_attention_heads", "num_key_value_heads")}, (a.path, extra)


def _keys(obj, prefix=""):
    if isinstance(obj, dict):
        return {k2 for k, v in obj.items() for k2 in {prefix + k} | _keys(v, prefix + k + ".")}
    return set()


def test_janus_tokenizer_has_the_special_tokens_at_their_ids():
    r = releases.release("janus-pro-7b")
    tok = json.loads(next(f.text for f in r.files if f.path == "tokenizer.json"))
    added = {a["content"]: a["id"] for a in tok["added_tokens"]}
    assert added["<\uff5cbegin\u2581of\u2581sentence\uff5c>"] == 100000
    assert added["<\uff5c\u2581pad\u2581\uff5c>"] == 100015
    assert added["<image_placeholder>"] == 100581
    assert {"<|User|>", "<|Assistant|>", "<begin_of_image>"} <= set(added)
    assert len(tok["model"]["vocab"]) == 100000 and max(added.values()) < 102400
    ids = sorted(list(tok["model"]["vocab"].values()) + list(added.values()))
    assert ids == list(range(len(ids)))  # no holes, no duplicates
    for a, b in (m.split(" ") for m in tok["model"]["merges"][:2000]):
        assert a in tok["model"]["vocab"] and b in tok["model"]["vocab"] and a + b in tok["model"]["vocab"]


def test_index_json_names_every_tensor_of_its_shards(written):
    for m in ("janus-pro-7b", "infinity-8b", "infinity-2b"):
        d = written[(m, "a")][0]
        for idx in d.rglob("*.index.json"):
            j = json.loads(idx.read_text())
            files = sorted(set(j["weight_map"].values()))
            total = 0
            seen = set()
            for fn in files:
                p = idx.parent / fn
                sd = read_file(str(p))
                if fn.endswith(".safetensors"):
                    assert safetensors_write.read_metadata(str(p)) == {"format": "pt"}
                seen |= set(sd)
                assert all(j["weight_map"][k] == fn for k in sd)
                total += sum(a.nbytes for a, _ in sd.values())
            assert seen == set(j["weight_map"]) and total == j["metadata"]["total_size"], idx


def test_refusals(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    p = run("var-d30", tmp_path / "full", "--tiny")
    assert p.returncode == 1 and "--force" in p.stderr, p.stderr
    p = run("var-d30", tmp_path / "full", "--tiny", "--force")
    assert p.returncode == 0, p.stderr
    p = run("--list")
    assert p.returncode == 0 and "infinity_8b_weights/model-00004-of-00004.safetensors" in p.stdout
    assert "(694 tensors, 2,204,564,032 parameters)" in p.stdout


def test_disk_space_is_checked_first(tmp_path, monkeypatch):
    from tools.release_shapes import __main__ as cli
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 12, 10 ** 12 - 10 ** 6, 10 ** 6))

    def no_write(*a, **k):
        raise AssertionError("a file was written although the disk was too small")
    monkeypatch.setattr(cli, "write_file", no_write)  # a missing check must not write 45 GB
    rc = cli.main(["infinity-8b", str(tmp_path / "out")])
    assert rc == 1 and not (tmp_path / "out").exists()


def test_torch_load_agrees(written):
    torch = pytest.importorskip("torch")
    for m in MODELS:
        d = written[(m, "a")][0]
        for f in releases.release(m, tiny=True).files:
            if f.kind != "torch":
                continue
            obj = torch.load(d / f.path, map_location="cpu", weights_only=True)
            sd = obj[f.wrap] if f.wrap else obj
            assert list(sd) == [t.name for t in f.tensors]
            for t in f.tensors:
                v = sd[t.name]
                want = tensors.values(t, 0)
                got = v.view(torch.int16).numpy().view(np.uint16) if t.dtype == "bf16" else v.numpy()
                assert tuple(v.shape) == t.shape and np.array_equal(got, want), t.name
