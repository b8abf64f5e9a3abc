"""bench/gpu_bench.py, the GPU run's timing stage, end to end at toy shapes on the CPU: its
--small pipeline with the CPU build's arserve and speed_bench (--backend cpu) builds both toy
models, times arserve in-process and its daemon, and transformers' Janus in its own process,
and writes timing.json with every figure there and positive, timing.md with the side-by-side
table, and nothing else but timing.log. Refusals first: a --bin without the binaries, and
--backend cuda on a machine without a GPU, stop with exit 2 and say why before anything runs.

    .venv-bench/bin/python tests/bench/test_gpu_bench.py build     (make test-bench-smoke)

About 20 s on two cores (torch's and transformers' imports are most of it).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "gpu_bench.py")
BATCHES = ("1", "8", "32")
# The whole --small run's bound: 20 s here; a hang or a slow machine's budget skips fail.
TIMEOUT_S = 600

failed = 0


def check(cond, what, detail=""):
    global failed
    if cond:
        print("ok      " + what)
    else:
        failed += 1
        print("not ok  " + what + ("\n  " + str(detail)[:3000] if detail else ""))


def run(args, timeout=120):
    return subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def positive(x):
    return isinstance(x, (int, float)) and x > 0


def test_refusals(tmp, bin_dir):
    empty = os.path.join(tmp, "empty-bin")
    os.makedirs(empty)
    p = run(["--bin", empty, "--out", os.path.join(tmp, "o1"), "--small", "--backend", "cpu"])
    check(p.returncode == 2 and "has no executable arserve" in p.stderr,
          "a --bin without arserve stops at once with exit 2, naming it", p.stderr + p.stdout)
    if shutil.which("nvidia-smi"):
        print("skip    --backend cuda without a GPU (nvidia-smi is here)")
        return
    p = run(["--bin", bin_dir, "--out", os.path.join(tmp, "o2"), "--small"])
    check(p.returncode == 2 and "no GPU" in p.stderr,
          "--backend cuda (the default) without a GPU stops with exit 2: no GPU",
          p.stderr + p.stdout)
    check(not os.path.exists(os.path.join(tmp, "o2", "timing.json")) or
          json.load(open(os.path.join(tmp, "o2", "timing.json")))["stages"] == [],
          "... before any stage ran")


def test_small_run(tmp, bin_dir):
    out = os.path.join(tmp, "out")
    work = os.path.join(tmp, "work")
    t = time.monotonic()
    p = run(["--bin", bin_dir, "--out", out, "--small", "--backend", "cpu", "--work", work,
             "--budget-s", "300"], timeout=TIMEOUT_S)
    took = time.monotonic() - t
    check(p.returncode == 0, "gpu_bench.py --small --backend cpu exits 0 (%.1f s)" % took,
          p.stderr[-2000:] + p.stdout[-2000:])
    check(sorted(os.listdir(out)) == ["timing.json", "timing.log", "timing.md"],
          "OUTDIR holds timing.json, timing.md and timing.log, nothing else", os.listdir(out))
    check(all(os.path.exists(os.path.join(work, m, "arserve.json")) for m in ("janus", "var")),
          "the models were made in --work (not in OUTDIR)", work)
    try:
        r = json.load(open(os.path.join(out, "timing.json")))
    except (OSError, ValueError) as e:
        check(False, "timing.json reads", e)
        return
    check(r.get("small") is True and r.get("backend") == "cpu" and r.get("budget_s") == 300,
          "timing.json says --small, the backend and the budget",
          {k: r.get(k) for k in ("small", "backend", "budget_s")})
    m = r.get("machine", {})
    check(all(m.get(k) for k in ("torch", "transformers", "numpy", "python", "cpus")),
          "the versions and the machine are recorded", m)

    stages = {s["name"]: s for s in r.get("stages", [])}
    want = ["build", "arserve janus batch 1, 8", "arserve var batch 1, 8", "arserve var batch 32",
            "daemon janus", "daemon var", "pytorch eager", "arserve janus batch 1, 8, graphs off",
            "arserve janus batch 32"]
    check(all(stages.get(n, {}).get("status") == "ok" for n in want),
          "every stage ran and passed", {n: stages.get(n) for n in want})
    check(all(positive(stages[n]["seconds"]) for n in want if n in stages),
          "each stage's seconds are recorded", stages)
    check(stages.get("pytorch compiled", {}).get("status") == "skipped" and
          "GPU" in stages["pytorch compiled"].get("note", ""),
          "the compiled PyTorch variant is skipped without a GPU, saying why",
          stages.get("pytorch compiled"))
    check(positive(r.get("total_s")) and r["total_s"] <= 300, "the run's total is within budget",
          r.get("total_s"))

    for key in ("janus", "var"):
        sp = r["arserve"][key]["speed"]
        rows_ok = all(positive(sp.get(b, {}).get(k)) for b in BATCHES
                      for k in ("step_ms", "images_per_s", "decode_ms"))
        check(rows_ok and [sp[b]["batch"] for b in BATCHES] == [1, 8, 32],
              "arserve %s in-process: step ms, images/s and VQ ms at batch 1, 8 and 32" % key, sp)
        for k in ("launches_per_step", "h2d_copies_per_step", "device_peak_bytes"):
            check(all(k in sp.get(b, {}) for b in BATCHES),
                  "arserve %s rows carry %s (null on the CPU)" % (key, k), sp)
        d = r["arserve"][key]["daemon"]
        good = all(positive(d.get(c, {}).get("images_per_s")) and d[c]["failed"] == 0 and
                   d[c]["completed"] == d[c]["requests"] >= int(c) and
                   0 < d[c]["median_e2el_ms"] <= d[c]["p90_e2el_ms"] <= d[c]["p99_e2el_ms"]
                   for c in BATCHES)
        check(good, "the %s daemon at concurrency 1, 8 and 32: images/s and p50 <= p90 <= p99"
              % key, d)
    off = r["arserve"]["janus"].get("speed_graphs_off", {})
    check(all(positive(off.get(b, {}).get("step_ms")) for b in ("1", "8")),
          "the Janus step op by op (--gpu-graphs off) at batch 1 and 8", off)
    check(all(0 < r["arserve"]["janus"]["speed"][b]["roofline"] <= 1.5 for b in BATCHES),
          "the Janus step's memory roofline share is there", r["arserve"]["janus"]["speed"])

    eg = r["pytorch"]["janus"].get("eager", {})
    rows = eg.get("batches", {})
    check(all(positive(rows.get(b, {}).get(k)) for b in BATCHES
              for k in ("step_ms", "images_per_s", "decode_ms")),
          "PyTorch eager: step ms, images/s and VQ ms at batch 1, 8 and 32", eg)
    check(all(rows.get(b, {}).get("tokens") == [int(b), 64] for b in BATCHES),
          "PyTorch made whole images (64 tokens each) at every batch", rows)
    check(positive(eg.get("load_s")) and eg.get("steps") == 64, "PyTorch's load time and steps",
          eg)

    md = open(os.path.join(out, "timing.md")).read()
    header = "| batch | arserve step ms | eager step ms | ratio |"
    check(header in md and all(("\n| %s | " % b) in md for b in BATCHES),
          "timing.md has the side-by-side table with its batch rows", md[:1500])
    ratio_rows = [line for line in md.splitlines() if line.startswith("| 1 | ")]
    check(ratio_rows and ratio_rows[0].count("x |") >= 2,
          "... and arserve / PyTorch ratios in it", ratio_rows)
    check("## Steps as CUDA graphs against op by op" in md and
          "| batch | step ms on | step ms off | ratio |" in md,
          "timing.md has the graphs on/off table", md)
    check("## Stages" in md and "| build | ok |" in md, "timing.md lists the stages", md[-1500:])
    check(header in p.stdout and "build: ok in" in p.stdout,
          "the table and each stage's seconds are printed", p.stdout[-1500:])


def main():
    bin_dir = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build"))
    tmp = tempfile.mkdtemp(prefix="test_gpu_bench.")
    try:
        test_refusals(tmp, bin_dir)
        test_small_run(tmp, bin_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("%s: %d failed" % (os.path.basename(__file__), failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
