"""ShapesEval of a model end to end: generates an image per prompt with `arserve generate`
(one single-threaded process per job, `--jobs` at once), then scores the folder.

    python -m tools.shapes_eval run [--model models/shapes] [--limit N] [--images-per-prompt K]
        [--seed S] [--jobs J] [--out DIR] [--json out.json] [--arserve-arg="--cfg 3"]

Image n of prompt id is DIR/<id>.png (K = 1) or DIR/<id>_<n>.png, generated with seed
S + 100000 * n + id, so image 0 of a prompt is the same whatever K is. --limit N takes N
prompts evenly across the six categories (round robin, in file order). Prints accuracy per
category, overall (mean of the categories) and the wall time of generation and of scoring;
--json writes them with every image's result. numpy + Pillow only.
"""

import argparse
import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

from tools.shapes_eval import scorer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = os.path.join(ROOT, "tools", "shapes_eval", "prompts.jsonl")
IMAGE_NAME = re.compile(r"^\d{5}(_\d+)?\.png$")
SEED_STRIDE = 100000  # seeds of image n start at S + n * SEED_STRIDE (ids have 5 digits)


def default_jobs():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def select(prompts, limit):
    """The first `limit` prompts taken round robin over the categories (scorer.CATEGORIES
    order, then any others), each category in file order; all of them if limit is None."""
    if limit is None or limit >= len(prompts):
        return list(prompts)
    by_cat = {}
    for p in prompts:
        by_cat.setdefault(p["category"], []).append(p)
    order = [c for c in scorer.CATEGORIES if c in by_cat] + sorted(set(by_cat) - set(scorer.CATEGORIES))
    chosen, i = [], 0
    while len(chosen) < limit:
        for c in order:
            if i < len(by_cat[c]) and len(chosen) < limit:
                chosen.append(by_cat[c][i])
        i += 1
    return sorted(chosen, key=lambda p: p["id"])


def jobs_for(prompts, k, seed, out_dir):
    """(prompt, path, seed) of every image to generate."""
    out = []
    for p in prompts:
        for n in range(k):
            name = "%05d.png" % p["id"] if k == 1 else "%05d_%d.png" % (p["id"], n)
            out.append((p, os.path.join(out_dir, name), seed + SEED_STRIDE * n + p["id"]))
    return out


def arserve_command(arserve, model, prompt, seed, path, extra=()):
    return [arserve, "generate", "--model", model, "--prompt", prompt, "--seed", str(seed),
            "--threads", "1", "-q", "-o", path, *extra]


class Progress:
    """`done/total` on stderr: redrawn in place on a terminal, else a line every 10%."""

    def __init__(self, total, jobs):
        self.total, self.jobs, self.done = total, jobs, 0
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.next_line = 0

    def step(self):
        self.done += 1
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        msg = "generating: %d/%d images, %.0f s, about %.0f s left (%d at a time)" % (
            self.done, self.total, elapsed, eta, self.jobs)
        if self.tty:
            sys.stderr.write("\r" + msg + ("\n" if self.done == self.total else ""))
        elif self.done >= self.next_line or self.done == self.total:
            sys.stderr.write(msg + "\n")
            self.next_line = self.done + max(1, self.total // 10)
        sys.stderr.flush()


def generate(todo, arserve, model, jobs, extra=(), quiet=False):
    """Runs every generation, `jobs` at a time; raises RuntimeError with the first failure's
    command and stderr (the others still queued are cancelled)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    progress = None if quiet else Progress(len(todo), jobs)

    def one(item):
        p, path, seed = item
        cmd = arserve_command(arserve, model, p["prompt"], seed, path, extra)
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError("%s\nexited with %d:\n%s" % (shlex.join(cmd), r.returncode,
                                                           (r.stdout + r.stderr).strip()))

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, item) for item in todo]
        try:
            for f in concurrent.futures.as_completed(futures):
                f.result()
                if progress:
                    progress.step()
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def run(model, out_dir, arserve=None, prompts_path=PROMPTS, limit=None, images_per_prompt=1,
        seed=0, jobs=None, extra=(), quiet=False, categories=None):
    """Generates and scores; returns the summary dict that --json writes. categories: only
    the prompts of these categories (all when None)."""
    arserve = arserve or os.path.join(ROOT, "build", "arserve")
    jobs = jobs or default_jobs()
    prompts = scorer.load_prompts(prompts_path)
    if categories:
        prompts = [p for p in prompts if p["category"] in categories]
    prompts = select(prompts, limit)
    os.makedirs(out_dir, exist_ok=True)
    # Images of an earlier run would be scored too.
    for name in os.listdir(out_dir):
        if IMAGE_NAME.match(name):
            os.remove(os.path.join(out_dir, name))
    todo = jobs_for(prompts, images_per_prompt, seed, out_dir)

    t0 = time.monotonic()
    generate(todo, arserve, model, jobs, extra, quiet)
    t1 = time.monotonic()
    results = scorer.score_dir(out_dir, prompts)
    t2 = time.monotonic()
    table, overall, images = scorer.summarise(results)
    return {
        "model": model, "arserve": arserve, "arserve_args": list(extra), "prompts": prompts_path,
        "n_prompts": len(prompts), "images_per_prompt": images_per_prompt, "seed": seed,
        "jobs": jobs, "images_dir": out_dir,
        "overall": overall, "images": images, "colour_recall": scorer.colour_recall(results),
        "categories": {c: {"correct": v[0], "n": v[1], "accuracy": v[2]} for c, v in table.items()},
        "generation_s": t1 - t0, "scoring_s": t2 - t1,
        "results": results,
    }


def add_arguments(ap):
    ap.add_argument("--model", metavar="DIR", default=os.path.join(ROOT, "models", "shapes"),
                    help="model directory (default: models/shapes of this checkout)")
    ap.add_argument("--arserve", metavar="BIN", default=os.path.join(ROOT, "build", "arserve"),
                    help="the arserve binary (default: build/arserve of this checkout)")
    ap.add_argument("--prompts", metavar="FILE", default=PROMPTS, help="prompts.jsonl (default: the standard 300)")
    ap.add_argument("--limit", type=int, metavar="N", help="only N prompts, evenly across the categories")
    ap.add_argument("--images-per-prompt", type=int, default=1, metavar="K",
                    help="images per prompt (default 1)")
    ap.add_argument("--seed", type=int, default=0, metavar="S", help="base seed (default 0)")
    ap.add_argument("--jobs", type=int, default=default_jobs(), metavar="J",
                    help="generations at once, one CPU thread each (default: %(default)s, the cores)")
    ap.add_argument("--out", metavar="DIR", help="folder for the images (default: a temporary one, removed)")
    ap.add_argument("--json", metavar="FILE", help="write the numbers and every image's result here")
    ap.add_argument("--arserve-arg", action="append", default=[], metavar="ARGS",
                    help='extra flags for arserve generate, split like a shell: --arserve-arg="--cfg 3"')
    ap.add_argument("--failures", action="store_true", help="print the wrong images and why")
    ap.add_argument("--category", action="append", choices=scorer.CATEGORIES, metavar="NAME",
                    help="only this category's prompts (repeatable; e.g. single_object for a "
                         "class-conditional model whose classes are those prompts)")


def run_cli(a):
    if a.limit is not None and a.limit < 1 or a.images_per_prompt < 1 or a.jobs < 1:
        print("run: --limit, --images-per-prompt and --jobs must be >= 1", file=sys.stderr)
        return 2
    if a.seed < 0 or a.seed + SEED_STRIDE * a.images_per_prompt > 2 ** 53:
        print("run: --seed out of range", file=sys.stderr)
        return 2
    if not os.access(a.arserve, os.X_OK):
        print("run: %s is not an executable; build it with `make`" % a.arserve, file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(a.model, "arserve.json")):
        print("run: %s has no arserve.json" % a.model, file=sys.stderr)
        return 2
    extra = [x for arg in a.arserve_arg for x in shlex.split(arg)]
    tmp = None if a.out else tempfile.TemporaryDirectory(prefix="shapes_eval_")
    try:
        s = run(a.model, a.out or tmp.name, a.arserve, a.prompts, a.limit, a.images_per_prompt,
                a.seed, a.jobs, extra, categories=a.category)
    except RuntimeError as e:
        print("run: generation failed: %s" % e, file=sys.stderr)
        return 1
    finally:
        if tmp:
            tmp.cleanup()
    if a.failures:
        for r in s["results"]:
            if not r["correct"]:
                print("WRONG %s [%s] %r: %s" % (r["file"] or "%05d (missing)" % r["id"],
                                                r["category"], r["prompt"], r["reason"]))
    table = {c: (v["correct"], v["n"], v["accuracy"]) for c, v in s["categories"].items()}
    print("ShapesEval of %s: %d prompts x %d image(s), seed %d%s" % (
        s["model"], s["n_prompts"], s["images_per_prompt"], s["seed"],
        ", arserve " + shlex.join(extra) if extra else ""))
    print(scorer.format_table(table, s["overall"], s["images"]))
    print("colour recall %.3f (the prompts' colours present in the image, any shape)" % s["colour_recall"])
    n = s["n_prompts"] * s["images_per_prompt"]
    print("generation %.1f s (%d images, %d at a time, %.2f images/s); scoring %.1f s" % (
        s["generation_s"], n, s["jobs"], n / max(s["generation_s"], 1e-9), s["scoring_s"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.shapes_eval run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))
