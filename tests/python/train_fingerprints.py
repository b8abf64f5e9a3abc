"""What the tiny training runs of the three families (tools/train/pipeline.py --tiny for shapes
and shapes-var, tools/train/inf/train.py --tiny) export, as recorded: every tensor's sum, sum
of squares and sum of magnitudes in float64, a matrix's or convolution's held to a relative
1e-4 (the sum to 1e-4 of the magnitudes: a sum near zero is no looser or stricter than its
tensor), a vector's (biases, norms) to 2e-2. The training package is refactored under these: a
change to the order of a run's random draws or of its steps moves every matrix by far more
than 1e-4 (a learning rate one step late: 1e-3 at the median, all 44 of tiny-var's), while
another CPU's rounding does not (matrices 1.1e-5 apart at most between an AVX-512 Intel and an
AVX2 AMD machine). Vectors are looser because some of them train on rounding: a bias whose
output only reaches the loss through a GroupNorm has a gradient that is zero in exact
arithmetic along the group's mean, and Adam's normalised step turns the rounding there into a
whole step; the decoders' such biases were up to 9.5e-3 apart between those two machines. The
recorded file was written by the code before the families shared one loop (issue 63).

    python3 tests/python/train_fingerprints.py --record NAME MODEL_DIR   (rewrites the entry)
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDED = os.path.join(HERE, "train_fingerprints.json")
RTOL, VECTOR_RTOL, ATOL = 1e-4, 2e-2, 1e-6


def fingerprint(model_dir):
    """{file: {tensor: [sum, sum of squares, sum of magnitudes]}} of every *.safetensors in
    model_dir."""
    import torch
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(model_dir, name), "pt") as f:
            out[name] = {k: [float(t.sum()), float((t * t).sum()), float(t.abs().sum())]
                         for k in sorted(f.keys()) for t in [f.get_tensor(k).double()]}
    return out


def dims(model_dir):
    """{file: {tensor: number of dimensions}} of every *.safetensors in model_dir."""
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                out[name] = {k: len(f.get_slice(k).get_shape()) for k in f.keys()}
    return out


def differences(name, model_dir):
    """The tensors of model_dir that are not as recorded under name (empty: all are)."""
    with open(RECORDED) as f:
        want = json.load(f)[name]
    got, ndim = fingerprint(model_dir), dims(model_dir)
    bad = []
    if sorted(got) != sorted(want):
        return ["files %s, recorded %s" % (sorted(got), sorted(want))]
    for fname, tensors in want.items():
        if sorted(got[fname]) != sorted(tensors):
            bad.append("%s: other tensors than recorded" % fname)
            continue
        for k, ref in tensors.items():
            scale = (ref[2], ref[1], ref[2])  # the sum is held relative to the magnitudes
            rtol = RTOL if ndim[fname][k] >= 2 else VECTOR_RTOL
            if any(abs(g - r) > ATOL + rtol * m for g, r, m in zip(got[fname][k], ref, scale)):
                bad.append("%s %s: sum, squares, magnitudes %r, recorded %r" % (fname, k, got[fname][k], ref))
    return bad


def main(argv):
    if len(argv) != 3 or argv[0] != "--record":
        sys.exit(__doc__)
    name, model_dir = argv[1], argv[2]
    rec = {}
    if os.path.exists(RECORDED):
        with open(RECORDED) as f:
            rec = json.load(f)
    rec[name] = fingerprint(model_dir)
    with open(RECORDED, "w") as f:
        json.dump(rec, f, indent=0, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
