"""Command line: python -m tools.shapes_eval score --images DIR --prompts prompts.jsonl
              python -m tools.shapes_eval detect IMAGE.png ...
              python -m tools.shapes_eval run [--model DIR] [--limit N] ...  (generate, then score)
              python -m tools.shapes_eval codebook --codebook build/codebook.npz  (its upper bound)

Images are DIR/<id>.png or DIR/<id>_<n>.png, the prompt id as five digits (00042.png).
Prints per-category and overall accuracy; --json writes every image's result and
detections; --failures lists the wrong ones. A prompt with no image counts as wrong.
"""

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.shapes_eval import codebook_bound, run, scorer  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.shapes_eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sc = sub.add_parser("score", help="score a directory of PNGs")
    sc.add_argument("--images", required=True)
    sc.add_argument("--prompts", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl"))
    sc.add_argument("--json", help="write per-image results here")
    sc.add_argument("--failures", action="store_true", help="print the wrong images and why")
    sc.add_argument("--threshold", type=float, default=scorer.THRESHOLD)
    sc.add_argument("--min-area", type=int, default=scorer.MIN_AREA)
    de = sub.add_parser("detect", help="print the objects found in PNGs")
    de.add_argument("png", nargs="+")
    ru = sub.add_parser("run", help="generate the prompts' images with arserve, then score them",
                        description=run.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_arguments(ru)
    cb = sub.add_parser("codebook", help="score true scenes after a round trip through a code book",
                        description=codebook_bound.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    codebook_bound.add_arguments(cb)
    a = ap.parse_args(argv)

    if a.cmd == "run":
        return run.run_cli(a)
    if a.cmd == "codebook":
        return codebook_bound.codebook_cli(a)

    if a.cmd == "detect":
        import numpy as np
        from PIL import Image

        for fn in a.png:
            dets = scorer.detect(np.asarray(Image.open(fn).convert("RGB")))
            print("%s: %s" % (fn, "; ".join("%s %s %s at (%.0f, %.0f)" % (
                d["size"], d["colour"], d["shape"], d["centre"][0], d["centre"][1]) for d in dets) or "nothing"))
        return 0
    results = scorer.score_dir(a.images, a.prompts, a.threshold, a.min_area)
    table, overall, images = scorer.summarise(results)
    if a.failures:
        for r in results:
            if not r["correct"]:
                print("WRONG %s [%s] %r: %s" % (r["file"] or "%05d (missing)" % r["id"], r["category"],
                                                r["prompt"], r["reason"]))
    missing = sum(1 for r in results if r["file"] is None)
    if missing:
        print("warning: %d prompts have no image (counted wrong)" % missing, file=sys.stderr)
    print(scorer.format_table(table, overall, images))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"overall": overall, "images": images,
                       "categories": {k: {"correct": v[0], "n": v[1], "accuracy": v[2]} for k, v in table.items()},
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
