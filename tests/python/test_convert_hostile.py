"""Damaged and hostile checkpoints are refused by every converter with one line naming the file
and the problem, before anything of the declared size is allocated or inflated, and never with
a traceback (tools/convert/ckpt.py). Each case is a file a few KB long, written here by hand in
torch.save's zip layout or as safetensors; no torch needed.

    .venv/bin/python -m pytest tests/python/test_convert_hostile.py -q
"""

import json
import os
import pickle
import struct
import sys
import zipfile

import numpy as np
import pytest

from conftest import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERT = os.path.join(ROOT, "tools", "convert")
VAR_GOLDEN = os.path.join(ROOT, "tests", "golden", "var_tiny", "official")
INF_GOLDEN = os.path.join(ROOT, "tests", "golden", "infinity_tiny", "official")
sys.path.insert(0, CONVERT)
sys.path.insert(0, ROOT)
import ckpt  # noqa: E402
from tools.release_shapes import torchzip  # noqa: E402

# The most a converter may hold while refusing a hostile file (the interpreter and numpy take
# about 40 MB; each case declares 2 GiB or more).
REFUSAL_RSS_BYTES = 200 << 20


# --- torch.save's layout, written by tools/release_shapes/torchzip.py ------------------------

def tensor(key, numel, offset, size, stride, storage="FloatStorage", from_type=False):
    return torchzip.tensor_record(storage, key, numel, offset, size, stride, from_type)


def write_pth(path, state, storages, compress=None):
    """state: {name: tensor(...)}; storages: {key: bytes} written as ARCHIVE/data/key."""
    if compress is None:
        torchzip.write_archive(str(path), torchzip.state_pickle(list(state.items())),
                               [(k, [v]) for k, v in storages.items()])
        return str(path)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", torchzip.state_pickle(list(state.items())))
        for key, data in storages.items():
            zf.writestr(f"archive/data/{key}", data, compress_type=compress)
    return str(path)


def one_float_pth(tmp_path, **kw):
    """A one-tensor checkpoint over a 4-float storage, with the tensor's fields overridden."""
    t = dict(key="0", numel=4, offset=0, size=(2, 2), stride=(2, 1))
    t.update(kw)
    return write_pth(tmp_path / "w.pth", {"w": tensor(**t)},
                     {"0": np.arange(4, dtype=np.float32).tobytes()})


# --- running a converter as a user does ------------------------------------------------------

def run(script, *args):
    """(exit code, stderr, peak RSS in bytes) of a converter run."""
    p, peak = ckpt.run_measured([os.path.join(CONVERT, script), *args], capture_output=True,
                                text=True, timeout=scaled(120))
    return p.returncode, p.stderr, peak


def refused(rc, err, *words):
    lines = err.strip().splitlines()
    assert rc == 1, err
    assert "Traceback" not in err and len(lines) == 1, err
    for w in words:
        assert w in lines[0], err
    return lines[0]


def var_refuses(tmp_path, var_pth, *words):
    rc, err, peak = run("var.py", var_pth, os.path.join(VAR_GOLDEN, "vae.pth"), tmp_path / "out",
                        "--patch-nums", "1,2,3,4")
    refused(rc, err, str(var_pth), *words)
    assert not (tmp_path / "out").exists()
    return peak


# --- the cases -------------------------------------------------------------------------------

def test_a_negative_size_is_refused(tmp_path):
    var_refuses(tmp_path, one_float_pth(tmp_path, size=(2, -2)), "size [2, -2]", "negative")


def test_a_size_whose_product_overflows_int64_is_refused(tmp_path):
    big = (1 << 40, 1 << 40)
    var_refuses(tmp_path, one_float_pth(tmp_path, size=big, stride=(1, 1)),
                "needs more than the 4 elements")


def test_a_storage_key_that_climbs_out_of_the_archive_is_refused(tmp_path):
    var_refuses(tmp_path, one_float_pth(tmp_path, key="../../etc/passwd"),
                "storage key '../../etc/passwd' is not a plain name")


def test_a_storage_the_archive_lacks_is_refused(tmp_path):
    var_refuses(tmp_path, one_float_pth(tmp_path, key="7"), "storage '7' is not in the archive")


def test_stride_zero_over_a_tiny_storage_allocates_nothing(tmp_path):
    # 1 KB declaring 2^31 floats (8 GiB) over a storage of 4: refused before any allocation
    path = one_float_pth(tmp_path, size=(1 << 31,), stride=(0,))
    assert os.path.getsize(path) < 2048
    peak = var_refuses(tmp_path, path, "size [2147483648]", "4 elements")
    assert peak < REFUSAL_RSS_BYTES, peak


def test_a_storage_larger_than_its_entry_is_refused(tmp_path):
    path = write_pth(tmp_path / "w.pth", {"w": tensor("0", 1 << 31, 0, (1 << 31,), (1,))},
                     {"0": b"\0" * 16})
    var_refuses(tmp_path, path, "entry 'w/data/0' holds 16 bytes",
                "declares 8589934592")


def test_an_entry_that_would_inflate_to_gigabytes_is_refused_before_inflating(tmp_path):
    # 256 MiB of zeros deflate to a quarter of a megabyte; the declared sizes agree with the
    # pickle's, so only the ratio gives the bomb away
    numel = 1 << 26
    path = tmp_path / "bomb.pth"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", torchzip.state_pickle([("w", tensor("0", numel, 0, (numel,), (1,)))]))
        info = zipfile.ZipInfo("archive/data/0")
        info.compress_type = zipfile.ZIP_DEFLATED
        with zf.open(info, "w", force_zip64=True) as f:
            zero = bytes(16 << 20)
            for _ in range(numel * 4 // len(zero)):
                f.write(zero)
    assert os.path.getsize(path) < (2 << 20)
    peak = var_refuses(tmp_path, str(path), "would inflate", "refused")
    assert peak < REFUSAL_RSS_BYTES, peak


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_code_in_a_checkpoint_is_refused_without_running_it(tmp_path):
    path = tmp_path / "evil.pth"
    evil = _Evil()
    evil.marker = tmp_path / "ran"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"x": evil}, protocol=2))
    var_refuses(tmp_path, str(path), "system object", "only tensors")
    assert not evil.marker.exists()


def test_a_truncated_pickle_is_refused(tmp_path):
    path = tmp_path / "cut.pth"
    raw = torchzip.state_pickle([("w", tensor("0", 4, 0, (2, 2), (2, 1)))])
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", raw[: len(raw) // 2])
        zf.writestr("archive/data/0", bytes(16))
    var_refuses(tmp_path, str(path), "data.pkl is not a checkpoint")


def test_a_tensor_saved_with_python_attributes_reads_as_a_plain_one(tmp_path):
    # torch saves such a tensor through _rebuild_from_type_v2 (seen in infinity_2b_reg.pth)
    path = write_pth(tmp_path / "w.pth",
                     {"w": tensor("0", 4, 0, (2, 2), (2, 1), from_type=True)},
                     {"0": np.arange(4, dtype=np.float32).tobytes()})
    sd = ckpt.read_file(path)
    assert np.array_equal(sd["w"], np.arange(4, dtype=np.float32).reshape(2, 2))
    torch = pytest.importorskip("torch")  # the record is torch's own where torch is here
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(4.0).reshape(2, 2))


def test_not_a_zip_and_not_safetensors_is_refused(tmp_path):
    path = tmp_path / "junk.pth"
    path.write_bytes(b"\x80\x02}q\x00." + bytes(100))
    var_refuses(tmp_path, str(path), "neither safetensors nor a zip-format torch checkpoint")


# --- safetensors and shard folders (the Infinity converter reads both) ------------------------

def safetensors_file(path, header: dict, data: bytes):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


@pytest.mark.parametrize("header,data,words", [
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), "not a list of sizes"),
    ({"w": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 4]}}, bytes(4),
     "needs 4835703278458516698824704"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), "overlap"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), "outside the 8 data bytes"),
    ({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), "dtype 'Q4'"),
])
def test_a_bad_safetensors_header_is_refused(tmp_path, header, data, words):
    path = safetensors_file(tmp_path / "w.safetensors", header, data)
    with pytest.raises(ckpt.ConversionError) as e:
        ckpt.read_safetensors(str(path))
    assert str(path) in str(e.value) and words in str(e.value), str(e.value)


def test_a_header_length_past_the_file_is_refused(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ckpt.ConversionError, match="does not fit the file"):
        ckpt.read_safetensors(str(path))


def test_a_repeated_tensor_name_is_refused(tmp_path):
    path = tmp_path / "w.safetensors"
    blob = (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
            b' "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}')
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(4))
    with pytest.raises(ckpt.ConversionError, match="'w' appears twice"):
        ckpt.read_safetensors(str(path))


def test_a_truncated_shard_is_refused_with_its_name_and_nothing_left_behind(tmp_path):
    # the header promises 16 MB the file does not have: found when the tensor is written
    shards = tmp_path / "infinity_8b_weights"
    shards.mkdir()
    sd = ckpt.read_file(os.path.join(INF_GOLDEN, "infinity.pth"))
    import safetensors_write
    safetensors_write.write(str(shards / "model-00001-of-00001.safetensors"),
                            {k: np.asarray(v, dtype=np.float32) for k, v in sd.items()
                             if v.stored in ckpt.FLOATS})
    whole = (shards / "model-00001-of-00001.safetensors").read_bytes()
    (shards / "model-00001-of-00001.safetensors").write_bytes(whole[: len(whole) - 4096])
    rc, err, _ = run("infinity.py", shards, os.path.join(INF_GOLDEN, "vae.pth"),
                     os.path.join(INF_GOLDEN, "t5"), tmp_path / "out", "--pn", "0.06M")
    refused(rc, err, "model-00001-of-00001.safetensors")
    assert "outside the" in err or "short" in err, err
    assert not (tmp_path / "out").exists()


def test_a_weight_map_naming_a_file_outside_its_folder_is_refused(tmp_path):
    shards = tmp_path / "infinity_8b_weights"
    shards.mkdir()
    (shards / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    rc, err, _ = run("infinity.py", shards, os.path.join(INF_GOLDEN, "vae.pth"),
                     os.path.join(INF_GOLDEN, "t5"), tmp_path / "out", "--pn", "0.06M")
    refused(rc, err, "model.safetensors.index.json", "'../../etc/passwd' is not a file name")


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    import safetensors_write
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    safetensors_write.write(str(a), {"w": np.zeros(2, np.float32)})
    safetensors_write.write(str(b), {"w": np.zeros(2, np.float32)})
    with pytest.raises(ckpt.ConversionError, match="'w' is also in"):
        ckpt.read_shards([str(a), str(b)], "weights")
