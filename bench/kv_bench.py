"""`make bench-kv`: the KV policies side by side on the demo model, in one run.

    python bench/kv_bench.py --bin build/kv_bench --model models/shapes [--per-category 4]
                             [--threads 1] [--pool-images 2] [--waves 2] [--out build/bench-kv]

build/kv_bench (bench/kv_bench.c) generates every image through the KV planner and the paged
pool, as the daemon's scheduler does, and measures; this script picks the prompts, scores the
PNGs and prints one table. Rows on a raster model: full, then streaming, linear and headkv at
budgets 1/4, 1/6 and 1/8; on a next-scale model: full, amskv (no budget), then streaming,
heatkv, heatkv_binary and scalekv at HeatKV's 1/25, 1/10 and 1/5, with the papers' claims
checked under the table. Columns:

  tokens/head   tokens one (layer, head) holds at its peak, the condition prefix included
  peak KiB      KV bytes one image (its CFG pair) holds at its peak: measured by the engine
                (pool blocks after a step's appends) and predicted by the planner; they must
                be equal, for every image and at every iteration (the script exits 1 if not)
  admitted      images of the reference prompt the planner admits at once into one fixed
                pool (--pool-images full-cache images), and the ratio to full
  images/s      images per second running that many at once on this machine (token steps
                and VQ decodes, no PNG encoding; --waves fills of the pool), ratio to full
  x ideal       admitted / full's, over full's measured peak / the row's measured peak
  PSNR          dB of each image against the full-cache image of the same prompt and seed,
                mean over the prompts (identical images count as 100 dB)
  SSIM          the same pairs' structural similarity (11x11 Gaussian window, mean over RGB)
  running       images stepped at once on average with four pool-fills of the reference
                prompt queued at once: plans kept to the end > plans that tighten
  ShapesEval    accuracy by tools/shapes_eval: mean over its six categories, --per-category
                prompts each (the first of prompts.jsonl, the same for every row), seed = id

Rows the policies' default knobs cannot run on the model's grid are run with scaled knobs
(FALLBACKS below) and marked; a row that cannot run even so prints "n/a" and the budget it
needs. Everything is written to --out too: the PNGs, results.json and table.txt.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.shapes_eval import scorer  # noqa: E402

BUDGETS = ["1/4", "1/6", "1/8"]
POLICIES = ["streaming", "linear", "headkv"]
# Next-scale models: HeatKV's budgets (its Table 1: 4%, 10%, 20%); AMS-KV's capacities come
# from the pyramid, not a budget: one row.
SCALE_BUDGETS = ["1/25", "1/10", "1/5"]
SCALE_POLICIES = ["streaming", "heatkv", "heatkv_binary", "scalekv"]
SCALE_SINGLE_ROWS = ["amskv:1"]



def scale_fallbacks():
    """Knobs for next-scale rows whose defaults do not fit: streaming and HeatKV keep their
    sink scales whole (3 by default, 14 of the demo model's 91 cached tokens per head), more
    than 4% and 10% allow; those rows keep one sink scale, alike for both. heatkv_binary's CAS
    ordering is made for the calibration's sink scales, so it has no fallback: its rows below
    the sinks print n/a."""
    return {"streaming": "sink_scales=1", "heatkv": "sink_scales=1"}


def fallbacks(line_width):
    """Knobs for rows whose defaults do not fit the grid (docs/kv-policies.md, "The KV
    benchmark"). On the demo's 16 x 16 grid LineAR at 1/6 and 1/8 keeps 2 lines: no anchor,
    the line above (the context raster generation needs most) and the line being generated.
    HeadKV at 1/8 holds 32 image tokens per global head: one recent line instead of two, and
    a local window of one line (the default 32 is about one line of the papers' 24-wide
    grids) so that a local head stays within a global one."""
    return {
        "linear": "anchor_lines=0,recent_lines=1",
        "headkv": "headkv_recent_lines=1,headkv_local_window=%d" % line_width,
    }


PSNR_CAP = 100.0


def select_prompts(path, per_category):
    """The first per_category prompts of each category, in file order."""
    prompts = scorer.load_prompts(path)
    taken, count = [], {}
    for p in prompts:
        if count.get(p["category"], 0) < per_category:
            count[p["category"]] = count.get(p["category"], 0) + 1
            taken.append(p)
    short = [c for c in scorer.CATEGORIES if count.get(c, 0) < per_category]
    if short:
        sys.exit(f"kv_bench: {path} has fewer than {per_category} prompts of {short}")
    return taken


def class_label_prompts(cfg, model_dir, n):
    """For a class-conditional raster model (LlamaGen): n classes spread over its labels, each
    named as the engine takes it (a class name when the model has names, else the index).
    ShapesEval cannot score them: its prompts describe shapes, not ImageNet classes."""
    num = cfg["condition"]["num_classes"]
    names = None
    if cfg["condition"].get("class_names"):
        with open(os.path.join(model_dir, cfg["condition"]["class_names"])) as f:
            names = f.read().splitlines()
    labels = sorted({i * num // n for i in range(n)})
    return [{"id": i, "prompt": names[lab] if names else str(lab), "category": None,
             "spec": None} for i, lab in enumerate(labels)]


def select_class_prompts(path, per_category, classes):
    """For a class-conditional model: the first per_category prompts of each category whose
    text is one of the model's class names (ShapesEval's single objects and colours)."""
    prompts = [p for p in scorer.load_prompts(path) if p["prompt"] in classes]
    taken, count = [], {}
    for p in prompts:
        if count.get(p["category"], 0) < per_category:
            count[p["category"]] = count.get(p["category"], 0) + 1
            taken.append(p)
    if not taken:
        sys.exit(f"kv_bench: no prompt of {path} is a class name of the model")
    return taken


def _gauss_blur(x, sigma=1.5, radius=5):
    k = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    k /= k.sum()
    x = np.apply_along_axis(lambda v: np.convolve(v, k, mode="valid"), 0, x)
    return np.apply_along_axis(lambda v: np.convolve(v, k, mode="valid"), 1, x)


def ssim(a, b):
    """Mean SSIM (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03) over
    the RGB channels of two uint8 images."""
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    out = []
    for ch in range(3):
        x, y = a[..., ch].astype(np.float64), b[..., ch].astype(np.float64)
        mx, my = _gauss_blur(x), _gauss_blur(y)
        sxx = _gauss_blur(x * x) - mx * mx
        syy = _gauss_blur(y * y) - my * my
        sxy = _gauss_blur(x * y) - mx * my
        m = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
        out.append(m.mean())
    return float(np.mean(out))


def psnr(a, b):
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return PSNR_CAP if mse == 0 else min(PSNR_CAP, 10 * math.log10(255.0 ** 2 / mse))


def load_png(path):
    return np.asarray(Image.open(path).convert("RGB"))


def row_label(r):
    if r["policy"] == "full" or r["spec"] in SCALE_SINGLE_ROWS:
        return r["policy"]
    return "%s %s" % (r["policy"], r["spec"].split(":")[1])


def ratio(x, ref):
    return "%.2f" % (x / ref) if ref else "-"


def scale_claims(rows):
    """The papers' claims, checked on this model's rows, whichever way they go."""
    by = {row_label(r): r for r in rows}
    out = []
    for b in SCALE_BUDGETS:
        h, stream = by.get("heatkv " + b), by.get("streaming " + b)
        if h and stream:
            out.append("HeatKV beats StreamingLLM at %s: %s (PSNR %.1f vs %.1f dB, SSIM %.3f vs "
                       "%.3f; streaming keeps %d tokens per head, heatkv %d)"
                       % (b, "yes" if h["psnr_db"] > stream["psnr_db"] else "no", h["psnr_db"],
                          stream["psnr_db"], h["ssim"], stream["ssim"],
                          stream["peak_tokens_per_head"], h["peak_tokens_per_head"]))
    h10 = by.get("heatkv 1/10")
    others = [r for r in rows if r["policy"] not in ("full", "heatkv")
              and (r["spec"].endswith(":1/5") or r["spec"] in SCALE_SINGLE_ROWS)]
    # (amskv has no budget: it counts among them at whatever it keeps)
    if h10 and others:
        best = max(others, key=lambda r: r["psnr_db"])
        out.append("HeatKV at 1/10 at least as faithful as the best other row at 1/5 or amskv "
                   "(%s, %.1f dB): %s (%.1f dB)"
                   % (row_label(best), best["psnr_db"],
                      "yes" if h10["psnr_db"] >= best["psnr_db"] else "no", h10["psnr_db"]))
    am = by.get("amskv")
    if am:
        full = next(r for r in rows if r["policy"] == "full")
        out.append("AMS-KV at its defaults: PSNR %.1f dB, SSIM %.3f, ShapesEval %.3f (full %.3f), "
                   "measured peak %.0f%% of its plan"
                   % (am["psnr_db"], am["ssim"], am["shapes_eval"], full["shapes_eval"],
                      100.0 * am["measured_peak_bytes"] / am["planned_peak_bytes"]))
    return out


def pool_checks(rows):
    """What the pool's use was held to, by policy, from what kv_bench says of
    each row (plan_exact, layered: the policy table's words)."""
    def names(pick):
        seen = []
        for r in rows:
            if pick(r) and r["policy"] not in seen:
                seen.append(r["policy"])
        return ", ".join(seen)
    parts = []
    exact = names(lambda r: r["plan_exact"] and not r["layered"])
    if exact:
        parts.append("== for " + exact)
    bound = names(lambda r: not r["plan_exact"])
    if bound:
        parts.append("<= for " + bound + " (their plans are worst cases some heads or layers "
                     "stay below)")
    layered = names(lambda r: r["plan_exact"] and r["layered"])
    if layered:
        parts.append("== for " + layered + " in the capacity run (all images at the same "
                     "step), <= where images at different steps peak at different layers")
    return "; ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "kv_bench"))
    ap.add_argument("--model", default=os.path.join(REPO, "models", "shapes"))
    ap.add_argument("--prompts", default=os.path.join(REPO, "tools", "shapes_eval", "prompts.jsonl"))
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pool-images", type=float, default=2)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--fills", type=int, default=4,
                    help="pool-fills of the reference prompt queued at once in the sustained runs")
    ap.add_argument("--out", default=os.path.join(REPO, "build", "bench-kv"))
    ap.add_argument("--rows", default="",
                    help="POLICY:BUDGET rows after full, joined by commas (linear:1/2,linear:3/4),"
                         " instead of the model family's default rows")
    a = ap.parse_args(argv)
    if not os.path.exists(os.path.join(a.model, "arserve.json")):
        sys.exit(f"kv_bench: no model at {a.model} (make bench-kv KV_BENCH_MODEL=DIR)")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.model, "arserve.json")) as f:
        cfg = json.load(f)
    by_scale = cfg.get("family") == "scale"  # VAR (class names), Infinity (text)
    by_class = not by_scale and "condition" in cfg  # LlamaGen: raster rows, class prompts
    if by_class:
        scaled_knobs = fallbacks(cfg["image"]["grid_width"])
        prompts = class_label_prompts(cfg, a.model, a.per_category * len(scorer.CATEGORIES))
        row_specs = ["full"] + ["%s:%s" % (p, b) for p in POLICIES for b in BUDGETS]
    elif by_scale:
        scaled_knobs = scale_fallbacks()
        if "condition" in cfg:
            with open(os.path.join(a.model, cfg["condition"]["class_names"])) as f:
                prompts = select_class_prompts(a.prompts, a.per_category, set(f.read().splitlines()))
        else:
            prompts = select_prompts(a.prompts, a.per_category)
        row_specs = ["full"] + SCALE_SINGLE_ROWS + [
            "%s:%s" % (p, b) for p in SCALE_POLICIES for b in SCALE_BUDGETS]
    else:
        scaled_knobs = fallbacks(cfg["image"]["grid_width"])
        prompts = select_prompts(a.prompts, a.per_category)
        row_specs = ["full"] + ["%s:%s" % (p, b) for p in POLICIES for b in BUDGETS]
    if a.rows:
        row_specs = ["full"] + [r.strip() for r in a.rows.split(",") if r.strip()]
    by_id = {p["id"]: p for p in prompts}
    tsv = os.path.join(a.out, "prompts.tsv")
    with open(tsv, "w") as f:
        for p in prompts:
            f.write("%d\t%d\t%s\n" % (p["id"], p["id"], p["prompt"]))

    cmd = [a.bin, "--model", a.model, "--prompts", tsv, "--out", a.out,
           "--pool-images", str(a.pool_images), "--threads", str(a.threads),
           "--waves", str(a.waves), "--fills", str(a.fills)]
    for policy, knobs in scaled_knobs.items():
        cmd += ["--fallback", "%s:%s" % (policy, knobs)]
    for spec in row_specs:
        cmd += ["--row", spec]
    t0 = time.monotonic()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if p.returncode not in (0, 3):
        sys.exit(f"kv_bench: {a.bin} failed with status {p.returncode}")
    doc = json.loads(p.stdout)
    failed = p.returncode == 3 or doc["checks_failed"] > 0

    rows = doc["rows"]
    full = rows[0]
    full_png = {im["id"]: load_png(os.path.join(full["dir"], "%05d.png" % im["id"]))
                for im in full["images"]}
    for r in rows:
        if "error" in r:
            continue
        values, sims, results = [], [], []
        for im in r["images"]:
            img = load_png(os.path.join(r["dir"], "%05d.png" % im["id"]))
            values.append(psnr(img, full_png[im["id"]]))
            sims.append(ssim(img, full_png[im["id"]]))
            spec = by_id[im["id"]]
            if not by_class:
                ok, _, _ = scorer.score_image(img, spec["spec"])
                results.append({"category": spec["category"], "correct": ok})
            if r["peak_check"] == "equal" and im["peak_bytes"] != im["planned_peak_bytes"]:
                failed = True
        r["psnr_db"] = float(np.mean(values))
        r["ssim"] = float(np.mean(sims))
        r["identical_images"] = sum(v == PSNR_CAP for v in values)
        r["shapes_eval"] = scorer.summarise(results)[1] if not by_class else float("nan")
        if r["peak_check"] == "equal" and r["measured_peak_bytes"] != r["planned_peak_bytes"]:
            failed = True

    # The table.
    marks = {}
    lines = []
    shape = ("%d scales, %d px" % (doc["n_scales"], doc["width"]) if by_scale
             else "%dx%d tokens" % (doc["grid_width"], doc["grid_height"]))
    what = ("%d classes (%d per ShapesEval category's worth; ShapesEval n/a: its prompts are "
            "not this model's classes)" % (len(prompts), a.per_category) if by_class else
            "%d prompts (up to %d per ShapesEval category)" % (len(prompts), a.per_category))
    lines.append("KV policies on %s (%s): %s, seed = prompt id; one run, %s CPU thread(s), speed "
                 "over %d fill(s) of the pool"
                 % (doc["model"], shape, what, a.threads or "all", doc["waves"]))
    lines.append("pool: %.1f KiB = %g full-cache images of the reference prompt %r "
                 "(%d tokens); blocks of %d tokens"
                 % (doc["pool_bytes"] / 1024, doc["pool_images"], doc["reference_prompt"]["text"],
                    doc["reference_prompt"]["n_prompt"], doc["block_tokens"]))
    lines.append("")
    fmt = "%-20s %7s %10s %10s  %-12s %6s %-13s %8s %6s %10s  %s"
    head = fmt % ("row", "tokens/", "peak KiB", "peak KiB", "admitted", "x", "images/s",
                  "PSNR dB", "SSIM", "ShapesEval", "running")
    head2 = fmt % ("", "head", "measured", "planned", "(x full)", "ideal", "(x full)", "vs full",
                   "", "accuracy", "plan > tight")
    lines += [head, head2, "-" * len(head)]
    for r in rows:
        label = row_label(r)
        if r.get("scaled"):
            mark = marks.setdefault(r["policy"], "*" * (len(marks) + 1))
            label += mark
        if "error" in r:
            if "(budget >= " in r["error"]:
                why = "needs budget >= " + r["error"].split("(budget >= ")[-1].rstrip(")")
            else:
                why = r["error"]
            lines.append("%-16s n/a (%s)" % (label, why))
            continue
        eq = "" if r["measured_peak_bytes"] == r["planned_peak_bytes"] else \
            " <=" if r["peak_check"] == "at most" else " !"
        # The ideal: as many more images as the full cache's peak over this row's kept peak.
        ideal = full["measured_peak_bytes"] / r["measured_peak_bytes"]
        lines.append(fmt % (
            label, r["peak_tokens_per_head"], "%.1f" % (r["measured_peak_bytes"] / 1024),
            "%.1f%s" % (r["planned_peak_bytes"] / 1024, eq),
            "%d (%s)" % (r["admitted"], ratio(r["admitted"], full["admitted"])),
            "%.2f" % (r["admitted"] / full["admitted"] / ideal),
            "%.2f (%s)" % (r["images_per_s"], ratio(r["images_per_s"], full["images_per_s"])),
            "ref" if r is full else "%.1f" % r["psnr_db"],
            "ref" if r is full else "%.3f" % r["ssim"],
            "n/a" if by_class else "%.3f" % r["shapes_eval"],
            "%.2f > %.2f" % (r["sustained_running_plan"], r["sustained_running_tight"])))
    lines.append("")

    # Footnotes: what was scaled, what coincides, what a column hides.
    for policy, mark in marks.items():
        scaled = [r for r in rows if r["policy"] == policy and r.get("scaled")]
        lines.append("%s %s at %s: the defaults do not fit (%s); run with %s."
                     % (mark, policy, ", ".join(r["spec"].split(":")[1] for r in scaled),
                        scaled[0]["defaults_refused"], scaled_knobs[policy].replace(",", ", ")))
    ok_rows = [r for r in rows if "error" not in r]
    same = {}  # LineAR keeps whole lines: budgets that round to as many lines coincide
    for r in ok_rows:
        if r["policy"] == "linear":
            key = (r["peak_tokens_per_head"], json.dumps(r["knobs"], sort_keys=True))
            same.setdefault(key, []).append(r["spec"].split(":")[1])
    for key, budgets in same.items():
        if len(budgets) > 1:
            lines.append("linear at %s keeps the same %d of %d lines (floor(budget x %d)): the "
                         "same trajectory and images; their speeds differ by noise alone."
                         % (" and ".join(budgets),
                            (key[0] - doc["reference_prompt"]["n_prompt"]) // doc["grid_width"],
                            doc["grid_height"], doc["grid_height"]))
    grouped = [r for r in ok_rows if r["policy"] == "headkv"
               and r["peak_step"] == r["knobs"]["headkv_group_tokens"]]
    if grouped:
        lines.append("headkv peaks when heads are grouped (step headkv_group_tokens = %d), before "
                     "its first compression and above its budget at %s."
                     % (grouped[0]["knobs"]["headkv_group_tokens"],
                        ", ".join(r["spec"].split(":")[1] for r in grouped)))
    if not by_scale:
        lines.append("streaming's budget counts the prefix; linear's and headkv's count image "
                     "tokens only (docs/kv-policies.md).")
    lines.append("x ideal: admitted / full's, over the full cache's peak / the row's measured "
                 "peak (1.00: the pool packs exactly what the row keeps). running: images "
                 "stepped at once, on average, with %d fill(s) of the pool of copies of the "
                 "reference prompt queued at once, with the admission-time plans kept to the "
                 "end > with plans that tighten as requests run (docs/kv-cache.md)." % a.fills)
    if by_scale:
        lines += scale_claims(ok_rows)
    bounded = sorted({r["policy"] for r in ok_rows if r["peak_check"] != "equal"})
    checks = "every image, both runs" + (
        " (%s rows marked '<=': a bound)" % ", ".join(bounded) if bounded else "")
    checks += "; the pool's use vs the planner's reservation at every iteration: " + \
        pool_checks(ok_rows)
    lines.append("measured == planned peak: %s (%d iterations in all)%s."
                 % (checks, sum(r["iterations"] for r in ok_rows),
                    "; FAILED: see the log above" if failed else ""))
    identical = sum(r["identical_images"] for r in ok_rows if r is not full)
    if identical:
        lines.append("%d compressed images are identical to their full-cache image (100 dB)."
                     % identical)
    lines.append("kv_bench %.0f s, everything %.0f s."
                 % (doc["wall_s"], time.monotonic() - t0))
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(a.out, "table.txt"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    if failed:
        print("kv_bench: the measured KV peak differs from the planner's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
