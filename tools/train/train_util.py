"""What the training scripts share: the learning-rate schedule, the log, atomic checkpoints."""

import math
import os
import time

import torch


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
