"""Regenerates the PNGs that tests/python/test_shipped_model.py expects the shipped models
(models/shapes, models/shapes-var, models/shapes-inf) to draw, with the test's own command,
and records the SHA-256 of the model files each was made from beside it.

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
ENV = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


class Shipped:
    """One shipped model and the image (side x side pixels) it must draw: `flag` is --prompt
    or --class."""

    def __init__(self, model, flag, condition, seed, side, png):
        self.model, self.flag, self.condition, self.seed = model, flag, condition, seed
        self.side = side
        self.png, self.hashes = png, png[:-len(".png")] + ".json"

    def command(self, arserve, out):
        """The generation, run in the repository root."""
        # fp32 K and V: the expected PNGs were drawn with them (the default, the
        # weights' 16-bit type, rounds the cache and draws slightly other pixels).
        return [arserve, "generate", "--model", self.model, self.flag, self.condition,
                "--seed", str(self.seed), "--threads", "1", "--backend", "cpu",
                "--kv-dtype", "f32", "-o", out]

    def generate(self, arserve, out, timeout=120):
        """Runs command() with ENV in the repository root; returns the CompletedProcess."""
        return subprocess.run(self.command(arserve, out), cwd=ROOT, env=dict(os.environ, **ENV),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)

    def model_hashes(self):
        """{file name: SHA-256} of every file of the model directory."""
        d = os.path.join(ROOT, self.model)
        out = {}
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
        return out


SHIPPED = [
    Shipped("models/shapes", "--prompt", "a red circle on the left", 1, 128,
            "tests/golden/shapes/red_circle_left_seed1.png"),
    Shipped("models/shapes-var", "--class", "a red circle", 1, 64,
            "tests/golden/shapes_var/red_circle_seed1.png"),
    Shipped("models/shapes-inf", "--prompt", "a red circle", 1, 64,
            "tests/golden/shapes_inf/red_circle_seed1.png"),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arserve", default="build/arserve",
                    help="the arserve binary, relative to the repository root (default build/arserve)")
    a = ap.parse_args(argv)
    for m in SHIPPED:
        if not os.path.isdir(os.path.join(ROOT, m.model)):
            continue
        os.makedirs(os.path.join(ROOT, os.path.dirname(m.png)), exist_ok=True)
        r = m.generate(a.arserve, m.png)
        if r.returncode != 0:
            print("make_expected: %s exited with %d:\n%s"
                  % (" ".join(m.command(a.arserve, m.png)), r.returncode, r.stderr),
                  file=sys.stderr)
            return 1
        with open(os.path.join(ROOT, m.hashes), "w") as f:
            json.dump({"model": m.model, "files_sha256": m.model_hashes()}, f, indent=1)
            f.write("\n")
        print("wrote %s and %s; commit both" % (m.png, m.hashes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
