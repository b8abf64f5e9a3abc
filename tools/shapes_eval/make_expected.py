"""Regenerates the PNG that tests/python/test_shipped_model.py expects the shipped model
(models/shapes) to draw, with the test's own command, and records the SHA-256 of the model
files it was made from beside it.

    make expected-png        # or: python tools/shapes_eval/make_expected.py [--arserve BIN]

Run it when the model files change (a retrained model), then commit both files. If the model
files did not change, a different PNG means the engine's output changed: fix that instead,
unless the change was meant (then regenerate and say why in the commit).

The command pins everything the bytes depend on: the CPU backend, one thread, and
OpenBLAS's kernel (OPENBLAS_CORETYPE=Haswell, so that the host CPU's model does not pick
another GEMM kernel with another summation order).
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "models/shapes"
EXPECTED_PNG = "tests/golden/shapes/red_circle_left_seed1.png"
EXPECTED_HASHES = "tests/golden/shapes/red_circle_left_seed1.json"
PROMPT = "a red circle on the left"
SEED = 1
ENV = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def command(arserve, out):
    """The generation, run in the repository root."""
    return [arserve, "generate", "--model", MODEL, "--prompt", PROMPT, "--seed", str(SEED),
            "--threads", "1", "--backend", "cpu", "-o", out]


def generate(arserve, out, timeout=120):
    """Runs command() with ENV in the repository root; returns the CompletedProcess."""
    return subprocess.run(command(arserve, out), cwd=ROOT, env=dict(os.environ, **ENV),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def model_hashes():
    """{file name: SHA-256} of every file of the model directory."""
    d = os.path.join(ROOT, MODEL)
    out = {}
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arserve", default="build/arserve",
                    help="the arserve binary, relative to the repository root (default build/arserve)")
    a = ap.parse_args(argv)
    os.makedirs(os.path.join(ROOT, os.path.dirname(EXPECTED_PNG)), exist_ok=True)
    r = generate(a.arserve, EXPECTED_PNG)
    if r.returncode != 0:
        print("make_expected: %s exited with %d:\n%s" % (" ".join(command(a.arserve, EXPECTED_PNG)),
                                                         r.returncode, r.stderr), file=sys.stderr)
        return 1
    with open(os.path.join(ROOT, EXPECTED_HASHES), "w") as f:
        json.dump({"model": MODEL, "files_sha256": model_hashes()}, f, indent=1)
        f.write("\n")
    print("wrote %s and %s; commit both" % (EXPECTED_PNG, EXPECTED_HASHES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
