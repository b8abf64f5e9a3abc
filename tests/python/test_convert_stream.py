"""The converters hold a bounded amount of a checkpoint at a time (tools/convert/ckpt.py): a
256 MiB tensor, in safetensors or in torch.save's zip layout, is converted to bf16 while the
process's peak RSS stays under 100 MiB, and the output is the input rounded; quantised to fp8
(tools/convert/quant.py, a block of rows at a time) its peak does not grow with it either.

    .venv/bin/python -m pytest tests/python/test_convert_stream.py -q
"""

import json
import os
import struct
import sys

import numpy as np

from conftest import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERT = os.path.join(ROOT, "tools", "convert")
sys.path.insert(0, CONVERT)
sys.path.insert(0, os.path.dirname(CONVERT))
sys.path.insert(0, os.path.dirname(__file__))
import ckpt  # noqa: E402
import quant  # noqa: E402
import safetensors_write  # noqa: E402
from test_convert_hostile import tensor  # noqa: E402
from tools.release_shapes import torchzip  # noqa: E402

COLS = 4096
SMALL, LARGE = 4096, 16384  # rows: 64 MiB and 256 MiB of f32
# Converting 4x the bytes may cost no more than this much more memory (reading a tensor
# whole costs four times its size: its bytes, its values, and the rounding's temporaries).
GROWTH = 24 << 20
BOUND = 160 << 20  # and never more than this (the interpreter with numpy is about 30 MB)

# Converts SRC's tensors 'w' and 'b' to bf16 into DST.
_CONVERT = """import sys
sys.path.insert(0, sys.argv[3])
import ckpt
src, dst = sys.argv[1:3]
sd = ckpt.read_file(src)
ckpt.write_safetensors(dst, {"w": sd["w"], "b": sd["b"]}, "bf16")
"""
# Quantises SRC's tensor 'w' to fp8 (the quantiser with the most temporaries) into DST.
_QUANTISE = """import sys
sys.path.insert(0, sys.argv[3])
import ckpt
src, dst = sys.argv[1:3]
sd = ckpt.read_file(src)
ckpt.write_safetensors(dst, {"w": sd["w"], "b": sd["b"]}, "fp8", quantise=["w"])
"""


def _pattern(i0, n):
    """Rows i0 .. i0 + n of a tensor that is not all zeros (so rounding is seen)."""
    r = np.arange(i0, i0 + n, dtype=np.float32)[:, None]
    return (r * 1.0009765625 + np.arange(COLS, dtype=np.float32)[None, :] * 3.0517578125e-05)


def _rows(f, rows):
    for i0 in range(0, rows, 1024):
        f.write(_pattern(i0, min(1024, rows - i0)).tobytes())


def convert(tmp_path, src, rows):
    """(peak RSS) of converting src, whose output is checked against the input rounded."""
    dst, script = tmp_path / "out.safetensors", tmp_path / "convert.py"
    script.write_text(_CONVERT)
    p, peak = ckpt.run_measured([script, src, dst, CONVERT], capture_output=True, text=True,
                                timeout=scaled(300))
    assert p.returncode == 0, p.stderr
    header, _ = safetensors_write.read_header(str(dst))
    assert header["w"]["dtype"] == "BF16" and header["b"]["dtype"] == "F32", header
    out = ckpt.read_safetensors(str(dst))
    for i0 in (0, rows // 2, rows - 8):  # a few rows, read back exactly
        want = ckpt._f32_to_bf16(_pattern(i0, 8))
        assert np.array_equal(out["w"][i0:i0 + 8].bits(), want), i0
    assert np.array_equal(out["b"], np.arange(COLS, dtype=np.float32))
    return peak


def write_safetensors_src(path, rows):
    n = rows * COLS * 4
    header = {"b": {"dtype": "F32", "shape": [COLS], "data_offsets": [0, COLS * 4]},
              "w": {"dtype": "F32", "shape": [rows, COLS], "data_offsets": [COLS * 4, COLS * 4 + n]}}
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.write(np.arange(COLS, dtype=np.float32).tobytes())
        _rows(f, rows)


def write_torch_src(path, rows):
    state = [("w", tensor("0", rows * COLS, 0, (rows, COLS), (COLS, 1))),
             ("b", tensor("1", COLS, 0, (COLS,), (1,)))]
    chunks = (_pattern(i0, min(1024, rows - i0)) for i0 in range(0, rows, 1024))
    torchzip.write_archive(str(path), torchzip.state_pickle(state),
                           [("0", chunks), ("1", [np.arange(COLS, dtype=np.float32)])])


def peaks(tmp_path, write, suffix):
    out = []
    for rows in (SMALL, LARGE):
        src = tmp_path / f"in{rows}{suffix}"
        write(src, rows)
        out.append(convert(tmp_path, src, rows))
        os.remove(src)
    small, large = out
    assert large - small < GROWTH and large < BOUND, \
        f"peak RSS {small / 2**20:.0f} MiB converting 64 MiB, {large / 2**20:.0f} MiB converting 256 MiB"


def test_a_tensor_in_safetensors_converts_in_bounded_memory(tmp_path):
    peaks(tmp_path, write_safetensors_src, ".safetensors")


def test_a_tensor_in_a_torch_archive_converts_in_bounded_memory(tmp_path):
    peaks(tmp_path, write_torch_src, ".pth")


def quantise(tmp_path, src, rows):
    """(peak RSS) of quantising src, a few of whose rows are checked against quantise_rows."""
    dst, script = tmp_path / "out.safetensors", tmp_path / "quantise.py"
    script.write_text(_QUANTISE)
    p, peak = ckpt.run_measured([script, src, dst, CONVERT], capture_output=True, text=True,
                                timeout=scaled(300))
    assert p.returncode == 0, p.stderr
    out = ckpt.read_safetensors(str(dst))
    assert out["w"].stored == "F8_E4M3" and out["w_scale"].shape == (rows,)
    for i0 in (0, rows // 2, rows - 8):
        q, s = quant.quantise_rows(_pattern(i0, 8), "fp8")
        assert np.array_equal(out["w"][i0:i0 + 8].bits(), q), i0
        assert np.array_equal(out["w_scale"][i0:i0 + 8].bits(), s), i0
    return peak


def test_a_tensor_quantises_in_bounded_memory(tmp_path):
    out = []
    for rows in (SMALL, LARGE):
        src = tmp_path / f"in{rows}.safetensors"
        write_safetensors_src(src, rows)
        out.append(quantise(tmp_path, src, rows))
        os.remove(src)
    small, large = out
    assert large - small < GROWTH and large < BOUND, \
        f"peak RSS {small / 2**20:.0f} MiB quantising 64 MiB, {large / 2**20:.0f} MiB quantising 256 MiB"
