"""The dtype `make bench` runs a reference implementation's torch side in (speed_bench.py's
reference_dtype): its own under --torch-dtype model (bfloat16 for transformers' Janus and for
LlamaGen unless reference.json says otherwise), float32 under --torch-dtype float32, and
under auto float32 wherever torch does not run AVX-512 kernels, where its bf16 paths are slow
(checked in a child process held to AVX2, as --isa avx2 holds it; on a machine with AVX-512,
auto keeps the reference's own dtype there).

    .venv-bench/bin/python tests/bench/test_reference_dtype.py     (make test-bench-smoke)
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import speed_bench  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_tests  # noqa: E402

JANUS = {"impl": "transformers-janus"}
LLAMAGEN_BF16 = {"impl": "llamagen"}
LLAMAGEN_FP32 = {"impl": "llamagen", "precision": "none"}


def in_child(env, choice):
    """reference_dtype of the three references in a fresh process with `env` added."""
    code = ("import json, sys; sys.path.insert(0, %r); import speed_bench as s; "
            "print(json.dumps([s.reference_dtype(r, %r) for r in %r]))"
            % (os.path.join(ROOT, "bench"), choice, [JANUS, LLAMAGEN_BF16, LLAMAGEN_FP32]))
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_model_keeps_each_references_own_dtype():
    assert [speed_bench.reference_dtype(r, "model") for r in (JANUS, LLAMAGEN_BF16, LLAMAGEN_FP32)] \
        == ["bfloat16", "bfloat16", "float32"]


def test_float32_is_float32_everywhere():
    assert [speed_bench.reference_dtype(r, "float32") for r in (JANUS, LLAMAGEN_BF16)] \
        == ["float32", "float32"]


def test_auto_is_float32_where_torch_runs_avx2():
    assert in_child({"ATEN_CPU_CAPABILITY": "avx2"}, "auto") == ["float32"] * 3


def test_auto_keeps_the_own_dtype_where_torch_runs_avx512():
    import torch

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        print("  (skipped: torch runs %s kernels here, not AVX-512)"
              % torch.backends.cpu.get_cpu_capability())
        return
    assert in_child({}, "auto") == ["bfloat16", "bfloat16", "float32"]


if __name__ == "__main__":
    sys.exit(bench_tests.run(globals()))
