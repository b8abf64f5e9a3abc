"""Capacity projections for the papers' GPU configurations (docs/capacity.md):
each cost table in config/costs/ (derived from a paper's reported step times,
not measured here) runs through `arserve simulate` on its model preset, its
KV pool and its KV types, twice: a burst of requests, for the images a GPU
holds at once and its throughput when saturated; then Poisson arrivals at a
share of that throughput, for the latency a serving team would see. Prints a
Markdown table; every number in it is a projection.

usage: python bench/capacity_projections.py [--arserve build/arserve] [--images-per-s 10]
"""
import argparse
import glob
import json
import math
import os
import subprocess
import tempfile


def simulate(arserve, cfg, path, out, *flags):
    cmd = [arserve, "simulate", "--model", cfg["preset"], "--costs", path,
           "--mix", path[:-len(".json")] + ".mix.jsonl", "--kv-pool-mb", str(cfg["kv_pool_mb"]),
           "--kv-dtype", cfg["kv_dtype"], "--max-running", "4096", "--max-waiting", "1000000",
           "--label", "run", "--out", out] + list(flags)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out, "run.json")) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arserve", default="build/arserve")
    ap.add_argument("--costs", default="config/costs")
    ap.add_argument("-n", type=int, default=1000, help="requests of the burst")
    ap.add_argument("--load", type=float, default=0.8,
                    help="Poisson rate as a share of the saturated throughput (default 0.8)")
    ap.add_argument("--images-per-s", type=float, default=10,
                    help="the demand the GPU count is given for (default 10 images/s)")
    a = ap.parse_args()
    print(f"| configuration | policy | images at once | images/s saturated | "
          f"p50 / p99 latency at {a.load:g} x that | GPUs for {a.images_per_s:g} images/s |")
    print("|---|---|---|---|---|---|")
    for path in sorted(glob.glob(os.path.join(a.costs, "*.json"))):
        with open(path) as f:
            cfg = json.load(f)
        with open(path[:-len(".json")] + ".mix.jsonl") as f:
            req = json.loads(f.readline())
        policy = req["kv_policy"] + (f" {req['kv_budget']:.3g}" if "kv_budget" in req else "")
        with tempfile.TemporaryDirectory() as d:
            sat = simulate(a.arserve, cfg, path, d, "--arrival", "burst", "-n", str(a.n))
            rate = a.load * sat["request_throughput"]
            lat = simulate(a.arserve, cfg, path, os.path.join(d, "p"), "--rate", f"{rate:.6g}",
                           "-n", str(a.n), "--seed", "1")
        gpus = math.ceil(a.images_per_s / sat["images_per_s"])
        print(f"| {cfg['preset']} on {cfg['gpu']}, {cfg['kv_pool_mb'] / 1024:g} GiB KV "
              f"({cfg['kv_dtype']}) | {policy} | {sat['kv_pool']['max_running']:g} | "
              f"{sat['images_per_s']:.2f} | {lat['median_e2el_ms'] / 1e3:.1f} s / "
              f"{lat['p99_e2el_ms'] / 1e3:.1f} s | {gpus} |")


if __name__ == "__main__":
    main()
