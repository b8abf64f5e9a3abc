"""What the training scripts share: the learning-rate schedule, the log, atomic checkpoints,
resuming, the training loop itself, reading an exported model's weights back, and how a run
uses its machine (--device, bf16 autocast on CUDA) and its wall clock (--max-minutes,
--ckpt-minutes)."""

import contextlib
import math
import multiprocessing
import os
import sys
import time

import torch

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/

# The exit status of a run that stopped at --max-minutes after writing its checkpoint: the
# same command continues it (sysexits.h's EX_TEMPFAIL, "try again later").
EXIT_TIME_LIMIT = 75


def lr_at(step, a):
    """a.lr after a linear warm-up over a.warmup steps, then cosine decay to a.min_lr_frac
    of it at a.steps (held there after)."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def log(path, msg):
    """Prints msg with the time and appends it to path."""
    line = time.strftime("%H:%M:%S ") + msg
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def save(path, obj):
    """torch.save through a temporary file, so a killed run never leaves half a checkpoint."""
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_weights(path):
    """A safetensors file's tensors as float32 torch tensors, by name, the values the engine
    computes with (tools/convert/quant.py float_tensors): an 8-bit Linear weight comes back
    as its values times its row's scale, without the scale, so a model tools/quantize.py made
    can be trained further or run beside the engine."""
    sys.path.insert(0, os.path.join(TOOLS, "convert"))
    sys.path.insert(0, TOOLS)
    import quant
    import safetensors_write

    return {k: torch.from_numpy(v) for k, v in quant.float_tensors(safetensors_write.read(path)).items()}


# What the same command needs to continue after a time limit, for the scripts that take --resume.
RESUME_WITH = "with --resume"


def continues(again):
    """'the same command ... continues' with again ("" for a script that always resumes)."""
    return "the same command %scontinues" % (again + " " if again else "")


def add_run_args(ap, again=RESUME_WITH):
    """The flags every training script takes for its machine and its wall clock; again: what
    the same command needs to continue after a time limit (WallClock.stopped's)."""
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: CUDA when torch sees a GPU, else the CPU. On CUDA the forward "
                         "and loss run under bf16 autocast and TF32 is allowed; on the CPU "
                         "everything stays F32, as before")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="stop after the first step that ends past this many minutes of wall "
                         "time, with its checkpoint written (exit status %d); %s; 0 = no limit"
                         % (EXIT_TIME_LIMIT, continues(again)))
    ap.add_argument("--ckpt-minutes", type=float, default=0.0,
                    help="also write OUT/ckpt.pt whenever this many minutes have passed since "
                         "the last one (besides every --ckpt-every steps); 0 = off")


def add_loop_args(ap, steps, batch, lr, warmup, eval_every, log_every=20, ckpt_every=100):
    """The flags of a script that runs train_loop, with its defaults: the seed, the schedule
    (--steps, --lr, --warmup, --min-lr-frac), --batch, --stop-at, the log, evaluation and
    checkpoint periods, --resume, --threads, and add_run_args' machine and clock flags."""
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=steps, help="the schedule's length")
    ap.add_argument("--stop-at", type=int, default=0,
                    help="stop after this step (its checkpoint is written); 0 = run to --steps")
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--lr", type=float, default=lr, help="the peak learning rate")
    ap.add_argument("--min-lr-frac", type=float, default=0.05, help="the cosine's floor, of --lr")
    ap.add_argument("--warmup", type=int, default=warmup, help="steps of linear warm-up")
    ap.add_argument("--log-every", type=int, default=log_every)
    ap.add_argument("--eval-every", type=int, default=eval_every)
    ap.add_argument("--ckpt-every", type=int, default=ckpt_every)
    ap.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt when it exists")
    ap.add_argument("--threads", type=int, default=1)
    add_run_args(ap)


def start_run(a):
    """A parsed add_loop_args run's machine and files: (device, OUT/train.log, OUT/ckpt.pt,
    the step it ends at: --stop-at or --steps)."""
    torch.set_num_threads(a.threads)
    dev = pick_device(a.device)
    os.makedirs(a.out, exist_ok=True)
    end = min(a.steps, a.stop_at) if a.stop_at else a.steps
    return dev, os.path.join(a.out, "train.log"), os.path.join(a.out, "ckpt.pt"), end


def check_run_args(ap, a):
    """Refuses what add_run_args' flags cannot mean, through ap.error (exit status 2)."""
    if a.max_minutes < 0 or a.ckpt_minutes < 0:
        ap.error("--max-minutes and --ckpt-minutes must be >= 0")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch %s sees no CUDA device (torch.cuda.is_available() is "
                 "false)" % torch.__version__)


def pick_device(name):
    """torch.device for --device; on CUDA, TF32 matrix products and convolutions are allowed."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    return dev


def autocast(dev):
    """bf16 autocast on CUDA; nothing on the CPU (F32 there, bit for bit what it was)."""
    if dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def describe_device(dev):
    if dev.type == "cuda":
        return "cuda (%s, bf16 autocast, TF32 allowed)" % torch.cuda.get_device_name(dev)
    return "cpu (%d threads, F32)" % torch.get_num_threads()


class WallClock:
    """When a run checkpoints by time (--ckpt-minutes) and when it must stop (--max-minutes)."""

    def __init__(self, max_minutes, ckpt_minutes):
        self.start = self.last_ckpt = time.monotonic()
        self.max_s = max_minutes * 60.0
        self.ckpt_s = ckpt_minutes * 60.0

    def checkpointed(self):
        """Call after every write of OUT/ckpt.pt: the next timed one is ckpt_s from now."""
        self.last_ckpt = time.monotonic()

    def ckpt_due(self):
        return self.ckpt_s > 0 and time.monotonic() - self.last_ckpt >= self.ckpt_s

    def out_of_time(self):
        return self.max_s > 0 and time.monotonic() - self.start >= self.max_s

    def minutes(self):
        return (time.monotonic() - self.start) / 60.0

    def stopped(self, step, end, again=RESUME_WITH):
        """The log line of a run that stops at its time limit after step of end; again: what
        the same command needs to continue ("" for a script that always resumes)."""
        return ("stopped at step %d of %d after %.1f minutes (--max-minutes %g); %s"
                % (step, end, self.minutes(), self.max_s / 60.0, continues(again)))


def edge_loss(out, x):
    """The mean absolute difference of the images' horizontal and vertical gradients (the
    tokenizers' sharpness term)."""
    dxo, dxx = out[..., :, 1:] - out[..., :, :-1], x[..., :, 1:] - x[..., :, :-1]
    dyo, dyx = out[..., 1:, :] - out[..., :-1, :], x[..., 1:, :] - x[..., :-1, :]
    return (dxo - dxx).abs().mean() + (dyo - dyx).abs().mean()


def describe_losses(m):
    """A tokenizer's log text (train_loop's describe) from its means of loss, mse, l1, edge and q
    (the quantiser's loss), with the training PSNR of images in [-1, 1]."""
    return "loss %.4f mse %.5f l1 %.4f edge %.4f q %.4f train_psnr %.2f" % (
        m["loss"], m["mse"], m["l1"], m["edge"], m["q"], 10 * math.log10(4.0 / max(m["mse"], 1e-12)))


def log_tokenizer_eval(logf, out, step, psnr, psnr_mean, n, codes_used, detail, seconds):
    """A tokenizer's held-out evaluation: the log's EVAL line (detail: what the family adds)
    and a row of OUT/psnr.csv (step, val_psnr, val_psnr_mean_per_image, codes_used)."""
    log(logf, "EVAL step %d val_psnr %.2f dB (mean per image %.2f) on %d held-out images; codes used %d%s (%.0f s)"
        % (step, psnr, psnr_mean, n, codes_used, detail, seconds))
    with open(os.path.join(out, "psnr.csv"), "a") as f:
        f.write("%d,%.3f,%.3f,%d\n" % (step, psnr, psnr_mean, codes_used))


def resume(path, logf, opt, config, same=None):
    """The checkpoint at path (OUT/ckpt.pt), its optimiser state loaded into opt, or None when
    there is none. config: this run's, which must equal the checkpoint's (same(ck) says whether
    it does, for checkpoints that keep it under other keys); otherwise the run exits naming both.
    The caller loads its modules from the dict returned."""
    if not os.path.exists(path):
        return None
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if not (same(ck) if same else ck["config"] == config):
        raise SystemExit("%s: checkpoint config %r differs from this run's %r"
                         % (path, ck.get("config", ck.get("llm")), config))
    opt.load_state_dict(ck["opt"])
    log(logf, "resumed from %s at step %d" % (path, ck["step"]))
    return ck


def train_loop(a, logf, opt, step, end, train_step, checkpoint, describe, log_every, ckpt_every,
               evaluate=None, again=RESUME_WITH):
    """Trains from step to end, the loop every training script runs: each step sets the
    learning rate (lr_at with a's lr, warmup, steps, min_lr_frac), then train_step(step) takes
    it (forward, backward, optimiser; anything after, such as a code book's restarts) and
    returns its scalars as floats. Every log_every steps the log gets 'step N lr L ' +
    describe(means of those scalars since the last line) + the seconds a step took;
    checkpoint(step) writes OUT/ckpt.pt every ckpt_every steps, at end, on --ckpt-minutes and
    before a stop at --max-minutes. evaluate(step), when given, runs after that and returns
    whether it evaluated (the means and the step timer restart then). Returns 0 at end, or
    EXIT_TIME_LIMIT after a stop at --max-minutes (again: what the same command needs to
    continue)."""
    clock = WallClock(a.max_minutes, a.ckpt_minutes)

    def save():
        checkpoint(step)
        clock.checkpointed()
        return step

    saved = step
    t_last, n_last, acc = time.time(), 0, {}
    while step < end:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        for k, v in train_step(step).items():
            acc[k] = acc.get(k, 0.0) + v
        step += 1
        n_last += 1
        if step % log_every == 0:
            log(logf, "step %d lr %.2e %s %.2f s/step" % (
                step, lr_at(step - 1, a), describe({k: v / n_last for k, v in acc.items()}),
                (time.time() - t_last) / n_last))
            t_last, n_last, acc = time.time(), 0, {}
        if step % ckpt_every == 0 or step == end or clock.ckpt_due():
            saved = save()
        if evaluate is not None and evaluate(step):
            t_last, n_last, acc = time.time(), 0, {}
        if step < end and clock.out_of_time():
            if saved != step:
                saved = save()
            log(logf, clock.stopped(step, end, again=again))
            return EXIT_TIME_LIMIT
    log(logf, "done at step %d" % step)
    return 0


def compile_harness(cc, source, lib, exe):
    """Compiles a C harness (source: its text) against the engine library lib
    (build/libarengine.a) into exe, with the Makefile's flags and libraries; the checks that
    hold arserve's engine to a trained model's torch outputs use it."""
    import subprocess

    src = exe + ".c"
    with open(src, "w") as f:
        f.write(source)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([cc, "-std=c11", "-D_GNU_SOURCE", "-O2", "-fopenmp", "-I" + root,
                    "-I/usr/include/x86_64-linux-gnu/openblas-pthread", src, lib, "-lopenblas",
                    "-lcjson", "-lpng", "-lpcre2-8", "-lm", "-lpthread", "-ljemalloc", "-o", exe],
                   check=True)


@contextlib.contextmanager
def worker_pool(n):
    """A pool of n forked processes for numpy work (None when n <= 1), ended on exit. Made
    before the run touches CUDA: the children never do."""
    if n <= 1:
        yield None
        return
    pool = multiprocessing.get_context("fork").Pool(n)
    try:
        yield pool
    finally:
        pool.terminate()
        pool.join()
