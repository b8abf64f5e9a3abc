#!/usr/bin/env python3
"""arserve beside the official VAR code on the same weights: seconds per image, the steps (each
scale's) and the decoder's, in float32 and in bf16 (PyTorch's autocast; arserve's
cpu_activations bf16), side by side in one run.

    VAR_SRC=/path/to/VAR python bench/ref_var.py RELEASE_DIR MODEL_DIR [--threads 1] [--reps 2]
    python bench/ref_var.py RELEASE_DIR MODEL_DIR --arserve-only      # no official code

RELEASE_DIR holds a VAR release's two checkpoints (var_d{depth}.pth and vae_ch160v4096z32.pth, as
`python3 -m tools.release_shapes var-d30 DIR` writes them), MODEL_DIR what
tools/convert/var.py made of them. The reference is the official implementation
(FoundationVision/VAR): `build_vae_var` and `VAR.autoregressive_infer_cfg` of models/. It is not
on PyPI and not part of this repository: it is imported from a checkout named by $VAR_SRC (or
--src), put at the front of sys.path, and built with its flash and fused kernels off (the CPU has
neither). Every tensor of two or more dimensions is rounded to bf16 first, as the converted
model holds them (tools/convert/ckpt.py), so both sides multiply the same values.

Each side draws class --label with the model's sampling settings (arserve.json's cfg, top_k,
top_p), `--reps` times after a warm-up, the two sides and the two precisions alternating; the
table gives the medians. The official side's scales are timed by a wrapper on its `get_logits`
(each scale's time runs to its logits, the previous scale's sampling included) and its decoder
by one on `fhat_to_img`; arserve's by `arserve generate -v --repeat 2` (the `time:` line of its
second image, drawn on the buffers the first made: both sides warm).

`--batch N` draws N images at once on both sides (arserve's through build/speed_bench, the official
code with B=N) and gives the figures per image; `--isa avx2` runs both as on a CPU without
AVX-512 (ISA_ENV: arserve's ARSERVE_ISA, the limits of MKL and oneDNN, which do PyTorch's
GEMMs and convolutions).

Needs torch (for the official side) and numpy: .venv-bench has both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIME_LINE = re.compile(r"^time: (\d+) steps ([0-9.]+) s \(([0-9. ]+)\), decoder and PNG ([0-9.]+) s$",
                       re.M)


def parse_time_line(stderr: str) -> dict:
    """`arserve generate -v`'s time line: steps, each scale's seconds, the decoder's."""
    m = TIME_LINE.search(stderr)
    if not m:
        raise ValueError(f"no time line in arserve generate -v's output:\n{stderr[-2000:]}")
    scales = [float(t) for t in m.group(3).split()]
    if len(scales) != int(m.group(1)):
        raise ValueError(f"time line with {len(scales)} scales for {m.group(1)} steps")
    steps, decoder = float(m.group(2)), float(m.group(4))
    return {"steps_s": steps, "decoder_s": decoder, "total_s": steps + decoder, "scales_s": scales}


def run_arserve(binary: str, model: str, ask: list, threads: int, mode: str, batch: int = 1) -> dict:
    """One `arserve generate -v --repeat 2` of what ask asks (["--class", "207"], ["--prompt",
    ...]): the second image's times, drawn on the buffers the first made, as the official side's
    are after its warm-up in one process (and as a serving daemon draws). A batch of more than
    one is timed by speed_bench beside the binary instead (run_batch)."""
    if batch > 1:
        return run_batch(binary, model, ask, threads, mode, batch)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [binary, "generate", "--model", model, *ask, "--threads", str(threads),
               "--cpu-activations", mode, "-v", "--repeat", "2", "-o", os.path.join(tmp, "x.png")]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-2000:]}")
        return parse_time_line(p.stderr)


def run_batch(binary: str, model: str, ask: list, threads: int, mode: str, batch: int) -> dict:
    """Per-image figures of a batch of `batch` images drawn at once: `speed_bench --json` (built
    beside binary) draws one wave of batch 1 and one of the batch; of the batch's row, the image
    is 1 / images_per_s, each scale its wave's seconds / batch, the decoder decode_s (each image's
    own). A class-conditional model draws classes 0, 1, ... there, a prompted one ask's prompt."""
    cmd = [os.path.join(os.path.dirname(os.path.abspath(binary)), "speed_bench"), "--model", model,
           "--batch", str(batch), "--images", str(batch), "--reps", "1", "--threads", str(threads),
           "--cpu-activations", mode, "--measure", "speed", "--json"]
    if ask[:1] == ["--prompt"]:
        cmd += ask[:2]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    row = next(b for b in json.loads(p.stdout)["batches"] if b["batch"] == batch)
    scales = [t / batch for t in row["scale_s"]]
    return {"steps_s": sum(scales), "decoder_s": row["decode_s"],
            "total_s": 1 / row["images_per_s"], "scales_s": scales}


# What --isa avx2 sets, before torch loads: arserve's kernels (vec_isa.h) and the libraries that
# do PyTorch's heavy work on a CPU: MKL (its float32 GEMMs: 147 -> 100 GFLOP/s on one core here
# under this limit, none under oneDNN's) and oneDNN (its convolutions and bf16 GEMMs). Not
# ATEN_CPU_CAPABILITY=avx2: under it PyTorch 2.15 turns the official Infinity's first block's
# activations non-finite on this machine (NaN one run, 1e33 the next), so PyTorch's own
# element-wise kernels keep AVX-512, an advantage to the official side.
ISA_ENV = {"avx2": {"ARSERVE_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                    "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def release_files(release: str) -> tuple[str, str, int]:
    """The transformer's and the VQVAE's checkpoints, and the depth its name gives."""
    names = sorted(os.listdir(release))
    var = [n for n in names if re.fullmatch(r"var_d(\d+)\.pth", n)]
    vae = [n for n in names if n.startswith("vae_") and n.endswith(".pth")]
    if len(var) != 1 or len(vae) != 1:
        raise SystemExit(f"ref_var: {release} should hold one var_d*.pth and one vae_*.pth, not {names}")
    depth = int(re.fullmatch(r"var_d(\d+)\.pth", var[0]).group(1))
    return os.path.join(release, var[0]), os.path.join(release, vae[0]), depth


class Official:
    """The official VAR on the release's weights (rounded to bf16 as converted)."""

    def __init__(self, src: str, release: str, threads: int):
        import torch
        self.torch = torch
        torch.set_num_threads(threads)
        sys.path.insert(0, src)
        from models import build_vae_var  # noqa: E402 (the official checkout's)
        var_file, vae_file, depth = release_files(release)
        self.vae, self.var = build_vae_var(device="cpu", depth=depth, shared_aln=False,
                                           flash_if_available=False, fused_if_available=False)
        for net, path in ((self.var, var_file), (self.vae, vae_file)):
            # memory-mapped and copied tensor by tensor into the model: VAR-d30's 8.5 GB once
            # in memory, not three times
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            sd = sd.get("vae", sd) if "vae" in sd and isinstance(sd["vae"], dict) else sd
            own = net.state_dict()
            if set(own) != set(sd):
                raise SystemExit(f"ref_var: {path}: keys differ from the official model's: "
                                 f"{sorted(set(own) ^ set(sd))[:5]}")
            with torch.no_grad():
                for k, v in sd.items():
                    own[k].copy_(v.to(torch.bfloat16) if v.is_floating_point() and v.ndim >= 2
                                 else v)
            del sd
            net.eval()
        self.marks, self.decoder = [], [0.0]
        logits = self.var.get_logits

        def get_logits(*a, **k):
            out = logits(*a, **k)
            self.marks.append(time.perf_counter())
            return out
        self.var.get_logits = get_logits
        vae = self.var.vae_proxy[0]
        to_img = vae.fhat_to_img

        def fhat_to_img(f):
            t = time.perf_counter()
            out = to_img(f)
            self.decoder[0] = time.perf_counter() - t
            return out
        vae.fhat_to_img = fhat_to_img

    def run(self, label: int, bf16: bool, sampling: dict, batch: int = 1) -> dict:
        """Per image: a batch of `batch` images of the label drawn at once, its times / batch."""
        torch = self.torch
        self.marks.clear()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            t0 = time.perf_counter()
            self.var.autoregressive_infer_cfg(B=batch, label_B=label, g_seed=0, cfg=sampling["cfg"],
                                              top_k=sampling["top_k"], top_p=sampling["top_p"])
            total = time.perf_counter() - t0
        scales = [(b - a) / batch for a, b in zip([t0] + self.marks[:-1], self.marks)]
        return {"steps_s": (total - self.decoder[0]) / batch, "decoder_s": self.decoder[0] / batch,
                "total_s": total / batch, "scales_s": scales}


def median_of(runs: list) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in ("steps_s", "decoder_s", "total_s")}
    out["scales_s"] = [statistics.median(s) for s in zip(*(r["scales_s"] for r in runs))]
    out["runs"] = len(runs)
    return out


def alternate(sides: list, reps: int, run, name: str) -> dict:
    """run(side, precision) for every side, reps times after a warm-up, the sides alternating;
    the medians by side. A side whose run raises is dropped, the others go on: its row is
    {"failed": the error}."""
    runs, failed = {s: [] for s in sides}, {}
    for rep in range(reps + 1):  # the first is a warm-up
        for side, prec in sides:
            if (side, prec) in failed:
                continue
            when = 'warm-up' if rep == 0 else f'rep {rep}'
            try:
                r = run(side, prec)
            except Exception as e:  # the official code's own failures included
                last = (str(e).strip().splitlines() or [""])[-1]
                failed[(side, prec)] = f"{type(e).__name__}: {last}"
                print(f"{name}: {when}: {side} {prec}: failed, {failed[(side, prec)]}",
                      file=sys.stderr, flush=True)
                continue
            print(f"{name}: {when}: {side} {prec}: {r['total_s']:.2f} s", file=sys.stderr,
                  flush=True)
            if rep:
                runs[(side, prec)].append(r)
    return {s: {"failed": failed[s]} if s in failed else median_of(r) for s, r in runs.items()}


def table(rows: dict) -> str:
    lines = ["| side | precision | steps s | decoder s | image s | each scale s |",
             "|---|---|---|---|---|---|"]
    for (side, prec), r in rows.items():
        if "failed" in r:
            lines.append(f"| {side} | {prec} | failed: {r['failed']} | | | |")
            continue
        lines.append(f"| {side} | {prec} | {r['steps_s']:.2f} | {r['decoder_s']:.2f} | "
                     f"{r['total_s']:.2f} | {' '.join(f'{s:.2f}' for s in r['scales_s'])} |")
    for prec in ("f32", "bf16"):
        a, o = rows.get(("arserve", prec)), rows.get(("official", prec))
        if a and o and "failed" not in a and "failed" not in o:
            lines.append(f"\n{prec}: arserve {o['total_s'] / a['total_s']:.2f}x the official code "
                         f"(steps {o['steps_s'] / a['steps_s']:.2f}x, decoder "
                         f"{o['decoder_s'] / a['decoder_s']:.2f}x)")
    return "\n".join(lines)


# Every row a side-by-side bench can run: side:precision.
SIDES = ("arserve:f32", "arserve:bf16", "official:f32", "official:bf16")


def common_args(ap: argparse.ArgumentParser, release: str, env: str, repo: str) -> None:
    """The arguments every side-by-side bench takes: the release (release says what it holds),
    the converted model, the official checkout (--src, default $env; repo names it) and the
    runs'."""
    ap.add_argument("release", help=f"the release's folder ({release})")
    ap.add_argument("model", help="the converted arserve model")
    ap.add_argument("--src", default=os.environ.get(env),
                    help=f"a checkout of {repo} (default ${env})")
    ap.add_argument("--arserve", default=os.path.join(ROOT, "build", "arserve"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--arserve-only", action="store_true", help="no official side")
    ap.add_argument("--batch", type=int, default=1,
                    help="images drawn at once, figures per image (default 1; arserve's through "
                         "speed_bench beside --arserve)")
    ap.add_argument("--isa", choices=sorted(ISA_ENV),
                    help="both sides as on a CPU without AVX-512: " + "; ".join(
                        f"{k}: {' '.join(f'{n}={v}' for n, v in e.items())}"
                        for k, e in ISA_ENV.items()))
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--sides", default=",".join(SIDES),
                    help="the rows to run, of %s (default all; e.g. without official:bf16 where "
                         "the CPU emulates bf16 and autocast takes many times the others)" % ",".join(SIDES))


def setup(a) -> None:
    """What the runs' arguments ask of the process: --batch checked, --isa's environment set
    (before torch is imported, and for arserve's processes)."""
    if a.batch < 1:
        raise SystemExit(f"--batch {a.batch}: at least 1")
    bad = [x for x in a.sides.split(",") if x not in SIDES]
    if bad or not a.sides:
        raise SystemExit(f"--sides {a.sides}: each of {','.join(SIDES)}")
    os.environ.update(ISA_ENV.get(a.isa or "", {}))


def side_by_side(a, ask: list, official_run, name: str, heading: str) -> int:
    """arserve (`generate` with ask) in both precisions and, unless official_run is None, the
    official code (official_run(bf16)), alternated; the table printed under heading, and
    written to a.json when given."""
    sides = [tuple(x.split(":")) for x in SIDES if x in a.sides.split(",")
             and (official_run or not x.startswith("official:"))]
    rows = alternate(sides, a.reps, lambda side, prec: (
        run_arserve(a.arserve, a.model, ask, a.threads, prec, a.batch) if side == "arserve"
        else official_run(prec == "bf16")), name)
    print(f"{heading}, {a.threads} thread(s), batch {a.batch}"
          f"{f', {a.isa} forced' if a.isa else ''}, per image, median of {a.reps}")
    print(table(rows))
    failures = any("failed" in r for r in rows.values())
    if failures:
        print("(a failed side's error is in its row; the other sides ran to the end)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"side": s, "precision": p, **r} for (s, p), r in rows.items()], f, indent=1)
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, "var_d*.pth, vae_*.pth", "VAR_SRC", "FoundationVision/VAR")
    ap.add_argument("--label", type=int, default=207)
    a = ap.parse_args(argv)
    if not a.arserve_only and not a.src:
        ap.error("the official side needs a VAR checkout: --src or $VAR_SRC (or --arserve-only)")
    setup(a)
    sampling = json.load(open(os.path.join(a.model, "arserve.json")))["sampling"]
    official = None if a.arserve_only else Official(a.src, a.release, a.threads)
    return side_by_side(a, ["--class", str(a.label)],
                        official and (lambda bf16: official.run(a.label, bf16, sampling, a.batch)),
                        "ref_var", f"VAR: {os.path.basename(a.model.rstrip('/'))}, class {a.label}")


if __name__ == "__main__":
    sys.exit(main())
