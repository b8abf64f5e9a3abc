#!/usr/bin/env python3
"""What a decode step costs the CUDA backend in kernels, launches and copies, per layer.

Runs the speed bench built against the CUDA emulator (build/speed_bench-emu; the
counts do not depend on the device, only on the ops issued) on two raster models
that differ only in depth (make_tiny_model.py's tiny and janus-1b-depth presets:
2 and 24 layers), in each GPU activation mode, and prints the launches (launcher and cuBLAS
calls), kernels (a launcher may start more than one; a cuBLAS call counts one), uploads and
stream waits of a decode step, and the kernels and launches one layer adds:
(deep - shallow) / (layers_deep - layers_shallow), with the step captured into a CUDA
graph (--gpu-graphs on, the default: the graph launches and the graphs built are
counted too) and op by op (off). With --next-scale DIR it also prints a next-scale
model's per-step counts (a step is a scale) with batch invariance on and off.

    python bench/launch_counts.py --bench build/speed_bench-emu \\
        --shallow build/tiny-model --deep build/janus-1b-depth [--max-per-layer 12] \\
        [--modes bf16,split] [--graphs on,off] [--batch 8] [--next-scale build/var-d16-depth]

--max-per-layer N exits 1 when a layer in 16-bit (bf16) activations starts more
than N kernels, and when a decode step with graphs costs more than one upload, one
graph launch, one download and one wait: the smoke run in `make test` holds both goals.
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
    ap.add_argument("--graphs", default="on,off",
                    help="graph modes to count, comma-separated (default on,off)")
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
    print("| activations | graphs | batch | kernels | launches | graph launches | uploads | "
          "downloads | waits | kernels a layer | launches a layer | graphs built |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst, over = 0.0, []
    for mode in a.modes.split(","):
        for graphs in a.graphs.split(","):
            flags = ["--gpu-activations", mode, "--gpu-graphs", graphs]
            shallow = run(a.bench, a.shallow, a.batch, flags)
            deep = run(a.bench, a.deep, a.batch, flags)
            for batch in (1, a.batch):
                s, d = row(shallow, batch), row(deep, batch)
                layer = {k: (d[k] - s[k]) / (n_deep - n_shallow)
                         for k in ("kernels_per_step", "launches_per_step")}
                if mode == "bf16":
                    worst = max(worst, layer["kernels_per_step"])
                step = (d["h2d_copies_per_step"], d["graph_launches_per_step"],
                        d["d2h_copies_per_step"], d["syncs_per_step"])
                if graphs == "on" and max(step) > 1.0:
                    over.append(f"{mode} batch {batch}: {step[0]:.1f} uploads, {step[1]:.1f} graph "
                                f"launches, {step[2]:.1f} downloads, {step[3]:.1f} waits a step")
                print(f"| {mode} | {graphs} | {batch} | {d['kernels_per_step']:.1f} | "
                      f"{d['launches_per_step']:.1f} | {step[1]:.1f} | {step[0]:.1f} | "
                      f"{step[2]:.1f} | {step[3]:.1f} | {layer['kernels_per_step']:.1f} | "
                      f"{layer['launches_per_step']:.1f} | {d['graph_builds']:.0f} |")
    if a.next_scale:
        print(f"\nnext-scale step (a scale), {os.path.basename(a.next_scale.rstrip('/'))}, "
              f"bf16 activations")
        print("| batch invariant | graphs | batch | kernels | launches | graph launches | uploads | "
              "waits |")
        print("|---|---|---|---|---|---|---|---|")
        for inv in ("on", "off"):
            for graphs in a.graphs.split(","):
                o = run(a.bench, a.next_scale, a.next_scale_batch,
                        ["--batch-invariant", inv, "--gpu-graphs", graphs])
                for batch in (1, a.next_scale_batch):
                    r = row(o, batch)
                    print(f"| {inv} | {graphs} | {batch} | {r['kernels_per_step']:.1f} | "
                          f"{r['launches_per_step']:.1f} | {r['graph_launches_per_step']:.1f} | "
                          f"{r['h2d_copies_per_step']:.1f} | {r['syncs_per_step']:.1f} |")
    failed = 0
    if a.max_per_layer and worst > a.max_per_layer:
        print(f"launch_counts: FAIL: a layer starts {worst:.1f} kernels in bf16 activations, "
              f"more than {a.max_per_layer:g}")
        failed = 1
    if a.max_per_layer and over:
        for o in over:
            print(f"launch_counts: FAIL: with graphs, {o} (goal: one of each)")
        failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
