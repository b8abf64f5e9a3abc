#!/usr/bin/env python3
"""Trains a demo model from nothing, every stage in order, each one resumable: the same command
run again continues where the last one stopped. Needs python3 with torch, numpy and Pillow;
nothing is downloaded, the data are drawn here (tools/shapes).

    python3 tools/train/pipeline.py --model shapes --out build/train-pipeline/shapes
    python3 tools/train/pipeline.py --model shapes-var --out build/train-pipeline/shapes-var
    python3 tools/train/pipeline.py --model shapes --tiny         (seconds on a CPU: the test's)

Stages of --model shapes (models/shapes, tools/train/raster/README.md sections 1, 2b, 4b, 5b, 6):
  data      OUT/data/train (20,000 scenes, seed 1), OUT/data/val (512, seed 2)
  codebook  OUT/codebook.npz (65 coverage masks from 2,000 scenes, seed 1: 521 codes)
  vq        train_vq.py --codebook: the code embeddings and the decoder, 3,000 steps -> OUT/vq
  tokens    tokenize_shapes.py -> OUT/tokens-train.npz, OUT/tokens-val.npz
  lm        train_lm.py, 7,000 steps of batch 16 -> OUT/lm
  export    export_vq.py and export_lm.py (--cfg 1.5 --top-k 20) -> OUT/model
Stages of --model shapes-var (models/shapes-var, tools/train/var/README.md; its samples are
drawn from seeded streams as it trains, so it needs no data stage):
  msvq      train_msvq.py (1,024 codes), 4,000 steps of batch 16 -> OUT/msvq
  var       train_var.py (depth 5, shared AdaLN), 3,000 steps of batch 32 on 32,000 samples -> OUT/var
  export    tools/train/var/export.py (--cfg 3) -> OUT/model

The hyper-parameters are those of the shipped models. Training stages resume from their
OUT/STAGE/ckpt.pt (every --ckpt-minutes of wall time besides their own step-based saves);
data and code book are kept once whole; tokens and exports are remade when their input is newer.
--max-minutes M bounds the whole command: the training stage running when time is up writes its
checkpoint and the command exits with status 75 (rerun it to continue). A training stage always
starts (one already finished returns at once) and makes at least one step, so every rerun gets
further; the data, code book, token and export stages are not interrupted (seconds to a minute or
two on a GPU machine's CPU): leave a margin, --max-minutes 8 in a 10-minute command.
Exit status 0: the model is in OUT/model.

--device auto (the default) trains on CUDA when torch sees a GPU (bf16 autocast, TF32), else
on the CPU in F32. --batch-mult K multiplies every training batch by K (the learning rates and
step counts stay as they are: a larger batch is a different run, asked for, not a default).
--copy-to DIR copies the logs, the CSV curves and OUT/model there after every command, whatever
its end (with --copy-ckpts the checkpoints too, to resume on another machine).
Each stage prints the command that runs it alone.
"""

import argparse
import glob
import os
import shlex
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (HERE, os.path.join(HERE, "raster"), os.path.join(HERE, "var"), os.path.join(ROOT, "tools"), ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

from train_util import EXIT_TIME_LIMIT  # noqa: E402

STAGES = {"shapes": ["data", "codebook", "vq", "tokens", "lm", "export"],
          "shapes-var": ["msvq", "var", "export"]}
TRAINING = {"vq", "lm", "msvq", "var"}

# The shipped models' runs (the scripts' headers and READMEs), and a tiny version of each for
# tests: a few steps of small networks on a few dozen images.
FULL = {
    "train": ["--n", "20000", "--seed", "1"],
    "val": ["--n", "512", "--seed", "2"],
    "codebook": ["--masks", "65", "--images", "2000", "--seed", "1"],
    "vq": ["--seed", "1", "--steps", "3000", "--eval-every", "250"],
    "lm": ["--seed", "1", "--steps", "7000"],
    "lm_batch": 16, "vq_batch": 8,
    "export_lm": ["--cfg", "1.5", "--top-k", "20"],
    "msvq": ["--seed", "1", "--steps", "4000", "--config", '{"codebook_size": 1024}'],
    "msvq_batch": 16,
    "var": ["--seed", "1", "--steps", "3000", "--n-train", "32000", "--config",
            '{"depth": 5, "shared_adaln": true}'],
    "var_batch": 32,
    "export_var": ["--cfg", "3.0", "--temperature", "1.0", "--top-k", "0", "--top-p", "1.0"],
}
TINY_STEPS = ["--steps", "6", "--warmup", "2", "--log-every", "1", "--eval-every", "3", "--ckpt-every", "2"]
TINY = {
    "train": ["--n", "24", "--seed", "1", "--shard-size", "8"],
    "val": ["--n", "8", "--seed", "2"],
    "codebook": ["--masks", "5", "--images", "10", "--seed", "1"],
    "vq": ["--seed", "1", "--eval-images", "4", "--config",
           '{"base_channels": 32, "channel_multiplier": [1, 1, 1, 1], '
           '"encoder_channel_multiplier": [1, 1, 1, 1]}'] + TINY_STEPS,
    "lm": ["--seed", "1", "--llm", '{"hidden_size": 32, "num_layers": 1, "num_heads": 2, '
           '"num_kv_heads": 2, "head_dim": 16, "intermediate_size": 64}'] + TINY_STEPS,
    "lm_batch": 2, "vq_batch": 2,
    "export_lm": ["--cfg", "1.5", "--top-k", "20"],
    "msvq": ["--seed", "1", "--ae-warmup", "2", "--restart-every", "2", "--eval-images", "4",
             "--final-eval-images", "8", "--config",
             '{"base_channels": 32, "channel_multiplier": [2, 1, 1, 1], "encoder_widths": [32, 32, 32], '
             '"codebook_size": 32}'] + TINY_STEPS,
    "msvq_batch": 2,
    "var": ["--seed", "1", "--n-train", "16", "--n-val", "8", "--config",
            '{"width": 32, "heads": 2, "depth": 1, "ffn": 64}'] + TINY_STEPS,
    "var_batch": 4,
    "export_var": ["--cfg", "3.0"],
}


class TimeLimit(Exception):
    """A training stage stopped at the time limit, its checkpoint written."""


class Pipeline:
    def __init__(self, a):
        self.a = a
        self.sizes = TINY if a.tiny else FULL
        self.out = a.out
        self.deadline = time.monotonic() + a.max_minutes * 60.0 if a.max_minutes else None
        self.extra = {}
        for stage, args in a.stage_args:
            self.extra.setdefault(stage, []).extend(shlex.split(args))

    def path(self, *parts):
        return os.path.join(self.out, *parts)

    def run_args(self):
        """The flags every training stage gets: device, threads, clock, and --resume."""
        args = ["--device", self.a.device, "--threads", str(self.a.threads),
                "--ckpt-minutes", "%g" % self.a.ckpt_minutes, "--resume"]
        if self.deadline is not None:
            # Past the deadline a stage still starts: a finished one returns at once, any
            # other makes one step and stops, so every rerun gets further.
            left = max((self.deadline - time.monotonic()) / 60.0, 1e-6)
            args += ["--max-minutes", "%.6g" % left]
        return args

    def batch(self, key):
        return ["--batch", str(self.sizes[key] * self.a.batch_mult)]

    def call(self, stage, script, module, argv):
        """Runs module.main(argv) here (one torch start-up for all stages) after printing the
        command that does the same alone; returns its exit status."""
        print("== %s: %s %s" % (stage, os.path.relpath(script, ROOT), shlex.join(argv)), flush=True)
        t0 = time.time()
        rc = module.main(argv) or 0
        print("== %s: %s after %.1f s" % (stage, "time limit" if rc == EXIT_TIME_LIMIT else
                                           "exit status %d" % rc, time.time() - t0), flush=True)
        if rc == EXIT_TIME_LIMIT:
            raise TimeLimit("stopped at its checkpoint")
        if rc:
            raise RuntimeError("stage %s failed with exit status %d" % (stage, rc))

    @staticmethod
    def fresh(out, inputs):
        """out exists and is newer than every input."""
        return os.path.exists(out) and all(os.path.getmtime(out) >= os.path.getmtime(i) for i in inputs)

    def stage_data(self):
        from tools.shapes import dataset
        for name in ("train", "val"):
            self.call("data", dataset.__file__, dataset,
                      ["--out", self.path("data", name), "--resume"] + self.sizes[name] + self.extra.get("data", []))

    def stage_codebook(self):
        from tools.shapes import codebook
        out = self.path("codebook.npz")
        if os.path.exists(out):
            print("== codebook: %s is there" % out)
            return
        os.makedirs(self.out, exist_ok=True)
        tmp = self.path("codebook.tmp.npz")
        self.call("codebook", codebook.__file__, codebook,
                  ["--out", tmp] + self.sizes["codebook"] + self.extra.get("codebook", []))
        os.replace(tmp, out)

    def codes(self):
        """Codes of the code book: white, then each palette colour over each mask."""
        import numpy as np
        from tools.shapes import codebook
        with np.load(self.path("codebook.npz")) as z:
            return 1 + len(codebook.PALETTE) * len(z["masks"])

    def stage_vq(self):
        import train_vq
        self.call("vq", train_vq.__file__, train_vq,
                  ["--train", self.path("data", "train"), "--val", self.path("data", "val"),
                   "--out", self.path("vq"), "--codebook", self.path("codebook.npz"),
                   "--workers", str(self.a.workers)] + self.sizes["vq"] + self.batch("vq_batch")
                  + self.run_args() + self.extra.get("vq", []))

    def stage_tokens(self):
        import tokenize_shapes
        ckpt = self.path("vq", "ckpt.pt")
        for name in ("train", "val"):
            out = self.path("tokens-%s.npz" % name)
            if self.fresh(out, [ckpt]):
                print("== tokens: %s is newer than %s" % (out, ckpt))
                continue
            self.call("tokens", tokenize_shapes.__file__, tokenize_shapes,
                      ["--ckpt", ckpt, "--data", self.path("data", name), "--out", out,
                       "--device", self.a.device, "--threads", str(self.a.threads),
                       "--workers", str(self.a.workers)] + self.extra.get("tokens", []))

    def stage_lm(self):
        import train_lm
        self.call("lm", train_lm.__file__, train_lm,
                  ["--tokens", self.path("tokens-train.npz"), "--val-tokens", self.path("tokens-val.npz"),
                   "--out", self.path("lm"), "--codebook-size", str(self.codes())]
                  + self.sizes["lm"] + self.batch("lm_batch") + self.run_args() + self.extra.get("lm", []))

    def stage_export_shapes(self):
        import export_lm
        import export_vq
        vq_ckpt, lm_ckpt = self.path("vq", "ckpt.pt"), self.path("lm", "ckpt.pt")
        vq_out = self.path("vq", "export")
        if not self.fresh(os.path.join(vq_out, "vq.safetensors"), [vq_ckpt]):
            self.call("export", export_vq.__file__, export_vq,
                      ["--ckpt", vq_ckpt, "--out", vq_out, "--val", self.path("data", "val")])
        model = self.path("model")
        if self.fresh(os.path.join(model, "arserve.json"), [lm_ckpt, os.path.join(vq_out, "vq.safetensors")]):
            print("== export: %s is newer than its checkpoints" % model)
            return
        self.call("export", export_lm.__file__, export_lm,
                  ["--lm", lm_ckpt, "--tokenizer", self.path("lm", "tokenizer.json"), "--vq", vq_out,
                   "--out", model] + self.sizes["export_lm"] + self.extra.get("export", []))

    def stage_msvq(self):
        import train_msvq
        self.call("msvq", train_msvq.__file__, train_msvq,
                  ["--out", self.path("msvq")] + self.sizes["msvq"] + self.batch("msvq_batch")
                  + self.run_args() + self.extra.get("msvq", []))

    def stage_var(self):
        import train_var
        self.call("var", train_var.__file__, train_var,
                  ["--vq", self.path("msvq", "ckpt.pt"), "--out", self.path("var")] + self.sizes["var"]
                  + self.batch("var_batch") + self.run_args() + self.extra.get("var", []))

    def stage_export_var(self):
        import export as export_var
        vq_ckpt, var_ckpt = self.path("msvq", "ckpt.pt"), self.path("var", "ckpt.pt")
        model = self.path("model")
        if self.fresh(os.path.join(model, "arserve.json"), [vq_ckpt, var_ckpt]):
            print("== export: %s is newer than its checkpoints" % model)
            return
        self.call("export", export_var.__file__, export_var,
                  ["--vq", vq_ckpt, "--var", var_ckpt, "--out", model] + self.sizes["export_var"]
                  + self.extra.get("export", []))

    def run(self, stage):
        if stage == "export":
            return self.stage_export_shapes() if self.a.model == "shapes" else self.stage_export_var()
        return getattr(self, "stage_" + stage)()

    def copy_results(self, dest):
        """Logs, curves, tokenizer and the model directory (and checkpoints with --copy-ckpts)
        into dest, under the same relative paths as in OUT."""
        pats = ["*/train.log", "*/*.csv", "lm/tokenizer.json", "model/*", "pipeline.log"]
        if self.a.copy_ckpts:
            pats.append("*/ckpt.pt")
        n = 0
        for pat in pats:
            for src in glob.glob(self.path(pat)):
                if not os.path.isfile(src):
                    continue
                dst = os.path.join(dest, os.path.relpath(src, self.out))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copyfile(src, dst)
                n += 1
        print("== copied %d files to %s" % (n, dest), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, choices=sorted(STAGES))
    ap.add_argument("--out", help="working directory (default build/train-pipeline/MODEL, -tiny with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="tiny networks, data and step counts (tests)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of every stage")
    ap.add_argument("--workers", type=int, default=0,
                    help="processes that encode with the code book (vq, tokens); 0 = every CPU "
                         "core on CUDA (up to 16), 1 on the CPU")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="wall-time budget of this command; 0 = none")
    ap.add_argument("--ckpt-minutes", type=float, default=2.0,
                    help="training stages also checkpoint this often (minutes of wall time)")
    ap.add_argument("--batch-mult", type=int, default=1,
                    help="multiply every training batch by this (learning rates and steps unchanged)")
    ap.add_argument("--stage-args", nargs=2, action="append", default=[], metavar=("STAGE", "ARGS"),
                    help="more arguments for a stage's script, appended last (so they override): "
                         "--stage-args lm '--steps 10000'")
    ap.add_argument("--copy-to", metavar="DIR", help="copy logs, curves and the model here at the end")
    ap.add_argument("--copy-ckpts", action="store_true", help="with --copy-to: the checkpoints too")
    a = ap.parse_args(argv)
    for stage, _ in a.stage_args:
        if stage not in STAGES[a.model]:
            ap.error("--stage-args: no stage %r in --model %s (its stages: %s)"
                     % (stage, a.model, ", ".join(STAGES[a.model])))
    if a.max_minutes < 0 or a.ckpt_minutes < 0:
        ap.error("--max-minutes and --ckpt-minutes must be >= 0")
    if a.batch_mult < 1 or a.threads < 1 or a.workers < 0:
        ap.error("--batch-mult and --threads must be >= 1, --workers >= 0")
    if a.copy_ckpts and not a.copy_to:
        ap.error("--copy-ckpts needs --copy-to")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch %s sees no CUDA device" % torch.__version__)
    on_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if a.workers == 0:
        a.workers = min(16, os.cpu_count() or 1) if on_cuda else 1
    if not a.out:
        a.out = os.path.join(ROOT, "build", "train-pipeline", a.model + ("-tiny" if a.tiny else ""))
    os.makedirs(a.out, exist_ok=True)

    pipe = Pipeline(a)
    t0 = time.time()
    print("== pipeline %s%s in %s: %s on %s" % (a.model, " (tiny)" if a.tiny else "", a.out,
                                              ", ".join(STAGES[a.model]), "cuda" if on_cuda else "cpu"), flush=True)
    rc, stage, msg = 1, None, None
    try:
        for stage in STAGES[a.model]:
            pipe.run(stage)
        rc, msg = 0, "done: the model is in %s" % pipe.path("model")
    except TimeLimit as e:
        rc = EXIT_TIME_LIMIT
        msg = "time limit (--max-minutes %g) in stage %s: %s; run the same command again to continue" % (
            a.max_minutes, stage, e)
    finally:
        msg = msg or "failed in stage %s" % stage
        with open(pipe.path("pipeline.log"), "a") as f:
            f.write("%s %s %s after %.1f minutes: %s\n" % (
                time.strftime("%Y-%m-%d %H:%M:%S"), a.model, shlex.join(sys.argv[1:] if argv is None else argv),
                (time.time() - t0) / 60.0, msg))
        print("== " + msg, flush=True)
        if a.copy_to:
            pipe.copy_results(a.copy_to)
    return rc


if __name__ == "__main__":
    sys.exit(main())
