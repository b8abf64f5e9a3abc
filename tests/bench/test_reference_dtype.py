"""Which dtype `make bench` runs a reference implementation's torch side in
(speed_bench.py's reference_in_float32): its own (the loader's) under --torch-dtype model,
float32 under --torch-dtype float32, and under auto float32 wherever torch does not run
AVX-512 kernels, where its bf16 paths are slow (checked in a child process held to AVX2, as
--isa avx2 holds it; on a machine with AVX-512, auto keeps the reference's own dtype there).

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


def in_child(env, choice):
    """reference_in_float32(choice) in a fresh process with `env` added (torch reads
    ATEN_CPU_CAPABILITY when it is imported)."""
    code = ("import json, sys; sys.path.insert(0, %r); import speed_bench as s; "
            "print(json.dumps(s.reference_in_float32(%r)))" % (os.path.join(ROOT, "bench"), choice))
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_model_keeps_the_references_own_dtype():
    assert speed_bench.reference_in_float32("model") is False
    assert in_child({"ATEN_CPU_CAPABILITY": "avx2"}, "model") is False


def test_float32_is_float32_everywhere():
    assert speed_bench.reference_in_float32("float32") is True


def test_auto_is_float32_where_torch_runs_avx2():
    assert in_child({"ATEN_CPU_CAPABILITY": "avx2"}, "auto") is True


def test_auto_keeps_the_own_dtype_where_torch_runs_avx512():
    import torch

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        print("  (skipped: torch runs %s kernels here, not AVX-512)"
              % torch.backends.cpu.get_cpu_capability())
        return
    assert in_child({}, "auto") is False


if __name__ == "__main__":
    sys.exit(bench_tests.run(globals()))
