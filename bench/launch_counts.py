#!/usr/bin/env python3
"""What a decode step costs the CUDA backend in kernels, launches and copies, per layer.

Runs the speed bench built against the CUDA emulator (build/speed_bench-emu; the
counts do not depend on the device, only on the ops issued) on two raster models
that differ only in depth (make_tiny_model.py's tiny and janus-1b-depth presets:
2 and 24 layers), in each GPU activation mode, and prints the launches (launcher and cuBLAS
calls), kernels (a launcher may start more than one; a cuBLAS call counts one), uploads and
stream waits of a decode step, and the kernels and launches one layer adds:
(deep - shallow) / (layers_deep - layers_shallow). With --next-scale DIR it also
prints a next-scale model's per-step counts (a step is a scale) with batch
invariance on and off.

    python bench/launch_counts.py --bench build/speed_bench-emu \\
        --shallow build/tiny-model --deep build/janus-1b-depth [--max-per-layer 12] \\
        [--modes bf16,split] [--batch 8] [--next-scale build/var-d16-depth]

--max-per-layer N exits 1 when a layer in 16-bit (bf16) activations starts more
than N kernels: the smoke run in `make test` holds the goal of 12.
"""
import argparse
import json
import os
import subprocess
import sys


def run(bench, model, batch, extra):
    cmd = [bench, "--model", model, "--backend", "cuda", "--batch", str(batch), "--images",
           str(batch), "--reps", "1", "--json", "--measure", "speed"] + extra
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=900)
    return json.loads(out.stdout)


def layers(model):
    with open(os.path.join(model, "arserve.json")) as f:
        return json.load(f)["llm"]["num_layers"]


def row(o, batch):
    return next(b for b in o["batches"] if b["batch"] == batch)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", required=True, help="speed_bench built against the emulator")
    ap.add_argument("--shallow", required=True, help="raster model, few layers")
    ap.add_argument("--deep", required=True, help="the same model with more layers")
    ap.add_argument("--batch", type=int, default=8, help="the batch beside batch 1 (default 8)")
    ap.add_argument("--max-per-layer", type=float, default=0,
                    help="fail when a layer starts more kernels in bf16 activations (0: no check)")
    ap.add_argument("--modes", default="bf16,split",
                    help="GPU activation modes to count, comma-separated (default bf16,split)")
    ap.add_argument("--next-scale", help="a next-scale model for per-step counts")
    ap.add_argument("--next-scale-batch", type=int, default=4,
                    help="the next-scale model's batch beside batch 1 (default 4: a scale of "
                         "16 x 16 tokens is slow under the emulator)")
    a = ap.parse_args()
    n_shallow, n_deep = layers(a.shallow), layers(a.deep)
    if n_deep <= n_shallow:
        sys.exit(f"launch_counts: --deep must have more layers than --shallow "
                 f"({n_deep} <= {n_shallow})")
    print(f"raster decode step, per step; {n_deep} layers "
          f"({os.path.basename(a.deep.rstrip('/'))}) against {n_shallow}")
    print("| activations | batch | kernels | launches | uploads | waits | kernels a layer | "
          "launches a layer |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for mode in a.modes.split(","):
        shallow = run(a.bench, a.shallow, a.batch, ["--gpu-activations", mode])
        deep = run(a.bench, a.deep, a.batch, ["--gpu-activations", mode])
        for batch in (1, a.batch):
            s, d = row(shallow, batch), row(deep, batch)
            layer = {k: (d[k] - s[k]) / (n_deep - n_shallow)
                     for k in ("kernels_per_step", "launches_per_step")}
            if mode == "bf16":
                worst = max(worst, layer["kernels_per_step"])
            print(f"| {mode} | {batch} | {d['kernels_per_step']:.1f} | "
                  f"{d['launches_per_step']:.1f} | {d['h2d_copies_per_step']:.1f} | "
                  f"{d['syncs_per_step']:.1f} | {layer['kernels_per_step']:.1f} | "
                  f"{layer['launches_per_step']:.1f} |")
    if a.next_scale:
        print(f"\nnext-scale step (a scale), {os.path.basename(a.next_scale.rstrip('/'))}, "
              f"bf16 activations")
        print("| batch invariant | batch | kernels | launches | uploads | waits |")
        print("|---|---|---|---|---|---|")
        for inv in ("on", "off"):
            o = run(a.bench, a.next_scale, a.next_scale_batch, ["--batch-invariant", inv])
            for batch in (1, a.next_scale_batch):
                r = row(o, batch)
                print(f"| {inv} | {batch} | {r['kernels_per_step']:.1f} | "
                      f"{r['launches_per_step']:.1f} | "
                      f"{r['h2d_copies_per_step']:.1f} | {r['syncs_per_step']:.1f} |")
    if a.max_per_layer and worst > a.max_per_layer:
        print(f"launch_counts: FAIL: a layer starts {worst:.1f} kernels in bf16 activations, "
              f"more than {a.max_per_layer:g}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
