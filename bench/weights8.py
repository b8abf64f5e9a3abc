"""8-bit weights against 16-bit, side by side (make bench-8bit): a raster model's decode step
with its Linear weights in bf16, int8 and fp8 e4m3.

A Janus-Pro-1B release written at its real shapes (tools/release_shapes, random weights) is
converted three times by tools/convert/janus.py (--dtype bf16, int8, fp8: the blocks' Linear
weights in the type asked, every other tensor as released); build/speed_bench times each
model's decode steps at batch 1 and at --batch, --steps steps a wave (the step cost is what is
compared: a whole 576-step image per wave would take hours), the three models alternating
--reps times on each instruction set asked (ARSERVE_ISA), and the medians are compared:

    .venv/bin/python bench/weights8.py --threads 1 --isa avx512,avx2
    .venv/bin/python bench/weights8.py --tiny --work build/w8-tiny     # smoke: seconds

Prints a table (step times, speed over bf16, the files' bytes) and writes every measurement to
WORK/weights8.json. Converted models are kept in WORK and reused (--again converts anew).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ("bf16", "int8", "fp8")


def model_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".safetensors"))


def convert(work, tiny, again):
    """WORK/{bf16,int8,fp8}: the release converted each way (kept between runs)."""
    todo = [d for d in DTYPES if again or not os.path.exists(os.path.join(work, d, "arserve.json"))]
    if not todo:
        return
    rel = os.path.join(work, "release")
    if os.path.exists(rel):
        shutil.rmtree(rel)
    say(f"writing a Janus-Pro-1B release{' (tiny)' if tiny else ''} in {rel}")
    subprocess.run([sys.executable, "-m", "tools.release_shapes", "janus-pro-1b", rel,
                    "--seed", "0"] + (["--tiny"] if tiny else []), cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    for d in todo:
        out = os.path.join(work, d)
        if os.path.exists(out):
            shutil.rmtree(out)
        say(f"converting with --dtype {d}")
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert", "janus.py"), rel,
                        out, "--dtype", d], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(rel)


def time_steps(a, model, isa):
    """speed_bench's JSON for one model on one instruction set."""
    env = dict(os.environ, ARSERVE_ISA=isa) if isa else os.environ
    argv = [a.bin, "--model", model, "--batch", str(a.batch), "--images", str(a.batch),
            "--reps", "1", "--steps", str(a.steps), "--threads", str(a.threads),
            "--measure", "speed", "--json"]
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"weights8: {' '.join(argv)} failed:\n{p.stderr}")
    return json.loads(p.stdout)


def say(msg):
    print(f"weights8: {msg}", file=sys.stderr, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "weights8"))
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "speed_bench"))
    ap.add_argument("--tiny", action="store_true", help="tools/release_shapes' tiny Janus-Pro")
    ap.add_argument("--again", action="store_true", help="convert the release anew")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24, help="decode steps a wave")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", default="", help="comma-separated (avx512, avx2); empty: the best")
    a = ap.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    convert(a.work, a.tiny, a.again)
    isas = [s for s in a.isa.split(",") if s] or [""]
    runs = {}  # (isa, dtype) -> [speed_bench JSON]
    for isa in isas:
        for rep in range(a.reps):
            order = DTYPES[rep % 3:] + DTYPES[:rep % 3]  # each type first in turn
            for d in order:
                say(f"{isa or 'best'}: {d}, set {rep + 1} of {a.reps}")
                runs.setdefault((isa, d), []).append(time_steps(a, os.path.join(a.work, d), isa))
    rows = []
    for isa in isas:
        for d in DTYPES:
            got = runs[(isa, d)]
            step = {b: statistics.median(r["batches"][i]["step_s"] for r in got)
                    for i, b in enumerate((1, a.batch))}
            rows.append({"isa": isa or "best", "dtype": d, "bytes": model_bytes(
                os.path.join(a.work, d)), "step_s": step,
                "step_s_all": {b: [r["batches"][i]["step_s"] for r in got]
                               for i, b in enumerate((1, a.batch))}})
    print(f"Janus-Pro-1B{' (tiny)' if a.tiny else ''} decode step, {a.threads} thread(s), "
          f"{a.steps} steps a wave, median of {a.reps} sets")
    print(f"| isa | weights | model GB | step, batch 1 | vs bf16 | step, batch {a.batch} | vs bf16 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(x for x in rows if x["isa"] == r["isa"] and x["dtype"] == "bf16")
        cells = []
        for b in (1, a.batch):
            cells += [f"{r['step_s'][b] * 1e3:.1f} ms", f"{base['step_s'][b] / r['step_s'][b]:.2f}x"]
        print(f"| {r['isa']} | {r['dtype']} | {r['bytes'] / 1e9:.2f} | " + " | ".join(cells) + " |")
    with open(os.path.join(a.work, "weights8.json"), "w") as f:
        json.dump({"threads": a.threads, "steps": a.steps, "batch": a.batch, "reps": a.reps,
                   "tiny": a.tiny, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
