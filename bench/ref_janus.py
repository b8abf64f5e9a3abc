#!/usr/bin/env python3
"""The Janus-Pro-shaped random model of `make bench`, and transformers' Janus as its reference.

    .venv-tools/bin/python bench/ref_janus.py build OUT_DIR    # the model, both formats
    .venv-tools/bin/python bench/ref_janus.py check OUT_DIR    # one image through transformers
    python3 bench/ref_janus.py build OUT_DIR --layers 24 --device cuda    # Janus-Pro-1B's depth

`build` makes a `JanusForConditionalGeneration` (PyPI transformers) with Janus-Pro-1B's layer
shapes at reduced depth: hidden 2048, 16 heads of 128, FFN 5632, RMSNorm, RoPE, 2 decoder
layers; the generation path as released (a 16384-code VQ of dimension 8, the aligner MLP
8 -> 2048 -> 2048, the generation head 2048 -> 2048 -> 16384, 24 x 24 tokens, the VQ decoder
of 128 base channels x (1, 1, 2, 2, 4) drawing 384 x 384 pixels). The text vocabulary is the
64 words of the golden model's tokenizer (tests/golden/gen_golden.py), so the unused text tables do
not dwarf the layers. Weights are drawn from a fixed seed with tests/golden/gen_golden.py's rule (so
that logits spread out), stored in bfloat16, written with `save_pretrained` under OUT_DIR/hf
and converted by tools/convert/janus.py (`--dtype keep`: bf16) into OUT_DIR itself.
OUT_DIR/reference.json tells bench/speed_bench.py to run this file's `load` as the torch side.

`--layers N` sets the depth (24 is Janus-Pro-1B's whole language model: bench/gpu_bench.py's
model), `--device` where the weights are drawn (cuda: seconds for 1.3 G parameters; the
draws differ from the CPU's, so a model is only reproducible on one kind of device), and
`--shape tiny` the golden model's toy shapes instead (tests/golden/gen_golden.py's TINY: 64
wide, 8 x 8 tokens of 32 x 32 pixels) for `bench/gpu_bench.py --small`.

`load` runs transformers' own image generation (`generate(generation_mode="image")`: its static
KV cache in the model's bfloat16, CFG through its logits processor, its sampler) with the
sampling settings of the converted arserve.json, and the model's own VQ decode; a forward hook
on the generation head stamps each step.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOOLS = os.path.join(ROOT, "tools")
GOLDEN = os.path.join(ROOT, "tests", "golden")  # gen_golden.py

SEED = 7
PROMPT = "a red cat sits under a blue sky"  # words of the golden tokenizer's vocabulary
TEXT = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 2,
        "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "hidden_act": "silu"}
# The understanding tower is built by the class but never used for generation: smallest
# shape whose patch grid (384 / 16) gives the 576 image tokens generation counts.
VISION = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 384,
          "patch_size": 16, "projection_dim": 2048, "num_image_tokens": 576}
VQ = {"num_patches": 24, "projection_dim": 2048, "image_token_embed_dim": 2048}
SHAPES = ("pro-1b", "tiny")


def shape_configs(shape: str, gen_golden) -> tuple[dict, dict, dict]:
    """(text, vision, vq) keyword sets of the transformers configs of a shape."""
    if shape == "pro-1b":
        return dict(TEXT), dict(VISION), dict(VQ)
    if shape == "tiny":
        t = gen_golden.TINY
        return dict(t["text_config"]), dict(t["vision_config"]), dict(t["vq_config"])
    raise ValueError("ref_janus.py: unknown shape %r (%s)" % (shape, ", ".join(SHAPES)))


@__import__("contextlib").contextmanager
def _no_init():
    """transformers' own initialisation skipped: reinit_ overwrites every parameter anyway,
    and drawing 1.3 G parameters twice on a CPU takes a minute."""
    import torch.nn.init as init

    names = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
             "xavier_uniform_", "xavier_normal_", "constant_", "zeros_", "ones_")
    saved = {n: getattr(init, n) for n in names if hasattr(init, n)}
    for n in saved:
        setattr(init, n, lambda t, *a, **k: t)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


def reinit_(model, seed: int, device) -> None:
    """gen_golden.reinit_'s rule, drawn on `device` (its own generator there)."""
    import torch

    sys.path.insert(0, GOLDEN)
    import gen_golden

    if torch.device(device).type == "cpu":
        gen_golden.reinit_(model, seed)  # make bench's model, as it always was
    else:
        reinit_on_(model, seed, device)


def reinit_on_(model, seed: int, device) -> None:
    """gen_golden.reinit_'s rule, drawn with a generator of `device`, in place."""
    import math

    import torch

    sys.path.insert(0, GOLDEN)
    import gen_golden

    g = torch.Generator(device=device).manual_seed(seed)
    tables = ("embed_tokens.weight", "generation_embeddings.weight", "quantize.embedding.weight",
              "position_embedding.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
            if name.endswith(tables):
                pass
            elif p.ndim >= 2:
                gain = gen_golden.HEAD_GAIN if name.endswith("generation_head.vision_head.weight") \
                    else 1.0
                r.mul_(gain / math.sqrt(p[0].numel()))
            elif name.endswith(".weight"):
                r.mul_(gen_golden.NORM_NOISE).add_(1.0)
            elif name.endswith(".bias"):
                r.mul_(gen_golden.BIAS_NOISE)
            else:
                raise RuntimeError(f"no initialisation rule for parameter {name}")
            p.copy_(r)


def build(out_dir: str, layers: int | None = None, device: str = "cpu",
          shape: str = "pro-1b") -> None:
    """The model at `shape` (SHAPES) with `layers` decoder layers (None: the shape's own, 2),
    drawn on `device`, written under OUT_DIR/hf and converted into OUT_DIR."""
    import torch

    sys.path.insert(0, GOLDEN)
    sys.path.insert(0, os.path.join(TOOLS, "convert"))
    import gen_golden
    import janus as convert_janus
    from transformers import (JanusConfig, JanusForConditionalGeneration, JanusVisionConfig,
                              JanusVQVAEConfig, LlamaConfig)

    text, vision, vq = shape_configs(shape, gen_golden)
    text["vocab_size"] = len(gen_golden.VOCAB)
    if layers:
        text["num_hidden_layers"] = layers
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta")}
    tid = gen_golden.token_id
    config = JanusConfig(
        text_config=LlamaConfig(**text, bos_token_id=tid("<bos>"), pad_token_id=tid("<pad>"),
                                eos_token_id=None),
        vision_config=JanusVisionConfig(**vision),
        vq_config=JanusVQVAEConfig(**vq),
        image_token_id=tid(gen_golden.UNK))
    torch.manual_seed(SEED)
    with torch.device(device), _no_init():
        model = JanusForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    where = {p.device.type for p in model.parameters()}
    if where != {torch.device(device).type}:  # a transformers that builds on "meta" first
        raise SystemExit("ref_janus.py: the model's parameters are on %s, not %s"
                         % (", ".join(sorted(where)), device))
    reinit_(model, SEED, device)
    model = model.to(torch.bfloat16)
    gc = model.generation_config
    gc.bos_token_id, gc.pad_token_id = tid("<bos>"), tid("<pad>")
    gc.generation_kwargs = {"boi_token_id": tid("<begin_of_image>")}
    gc.guidance_scale = gen_golden.CFG_WEIGHT
    hf = os.path.join(out_dir, "hf")
    os.makedirs(hf, exist_ok=True)
    model.save_pretrained(hf)
    gen_golden.write_hf_tokenizer_files(gen_golden.build_tokenizer(), hf)
    name = "janus-%s-%dl-random" % ("pro" if shape == "pro-1b" else shape,
                                     text["num_hidden_layers"])
    if convert_janus.main([hf, out_dir, "--dtype", "keep", "--name", name]):
        raise SystemExit("ref_janus.py: tools/convert/janus.py failed")
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump({"impl": "transformers-janus", "checkpoint": "hf", "prompt": PROMPT}, f, indent=1)
    n = sum(p.numel() for p in model.parameters())
    used = n - sum(p.numel() for p in model.model.vision_model.parameters())
    print("ref_janus.py: %s: %.1f M parameters (%.1f M outside the unused vision tower), bf16"
          % (out_dir, n / 1e6, used / 1e6))


class Reference:
    """transformers' JanusForConditionalGeneration with speed_bench.py's generate/decode."""

    def __init__(self, model, sampling, device="cpu"):
        self.model, self.sampling, self.device = model, sampling, device

    @property
    def dtype(self):
        """The torch dtype the model runs in."""
        return self.model.dtype

    def generate(self, cond, uncond, batch, cfg_w, temperature, gen, times=None, **extra):
        """[batch, N] image tokens; `extra` goes to transformers' generate as it is."""
        import torch

        # transformers builds the unconditional row itself (pad for all but BOS and BOI), as
        # arserve does: check that it is the row arserve fed, so both run the same input.
        gc = self.model.generation_config
        bos, boi = cond[0], cond[-1]
        gc.generation_kwargs = {"boi_token_id": boi}  # not kept by save_pretrained
        mine = [t if t in (bos, boi) else gc.pad_token_id for t in cond]
        if mine != list(uncond):
            raise SystemExit("ref_janus.py: arserve's unconditional row %s is not transformers' %s"
                             % (uncond, mine))
        if gen is not None:
            torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
        stamp = None
        if times is not None:
            stamp = self.model.model.generation_head.register_forward_hook(
                lambda m, i, o: times.append(time.perf_counter()))
        ids = torch.tensor([cond] * batch, device=self.device)
        s = self.sampling
        try:
            with torch.no_grad():
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), generation_mode="image",
                    do_sample=temperature > 0, temperature=temperature or None,
                    top_k=s.get("top_k") or None, top_p=s.get("top_p", 1.0),
                    guidance_scale=cfg_w, **extra)
        finally:
            if stamp is not None:
                stamp.remove()
        return out

    def decode(self, tokens):
        """[B, N] tokens -> [B, H, W, 3] uint8, as Janus's demo converts (truncating)."""
        import torch

        with torch.no_grad():
            x = self.model.model.vqmodel.decode(tokens).float()
        return ((x.permute(0, 2, 3, 1) + 1) / 2 * 255).clamp(0, 255).to(torch.uint8)


def load(model_dir: str, ref: dict, threads: int, device: str = "cpu", dtype=None):
    """(lm, decode, arserve.json) for bench/speed_bench.py's torch worker (and
    bench/gpu_bench.py's, on `device`), in `dtype` (None: the checkpoint's bfloat16)."""
    import torch
    from transformers import JanusForConditionalGeneration

    dtype = dtype or torch.bfloat16
    torch.set_num_threads(threads)
    with open(os.path.join(model_dir, "arserve.json")) as f:
        cfg = json.load(f)
    path = os.path.join(model_dir, ref["checkpoint"])
    try:  # straight onto the device; transformers versions that need accelerate for it refuse
        model = JanusForConditionalGeneration.from_pretrained(
            path, dtype=dtype, device_map=None if device == "cpu" else device)
    except (ImportError, ValueError):
        model = JanusForConditionalGeneration.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    r = Reference(model, cfg["sampling"], device)
    return r, r.decode, cfg


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("build", "check"))
    p.add_argument("out_dir")
    p.add_argument("--layers", type=int, help="decoder layers (default: the shape's, 2)")
    p.add_argument("--device", default="cpu", help="where build draws the weights (default cpu)")
    p.add_argument("--shape", choices=SHAPES, default="pro-1b",
                   help="layer shapes: Janus-Pro-1B's (default) or the golden model's tiny ones")
    a = p.parse_args(argv)
    if a.what == "build":
        build(a.out_dir, a.layers, a.device, a.shape)
        return 0
    with open(os.path.join(a.out_dir, "reference.json")) as f:
        ref = json.load(f)
    lm, decode, cfg = load(a.out_dir, ref, 1)
    sys.path.insert(0, GOLDEN)
    import gen_golden

    cond, uncond = gen_golden.prompt_ids(gen_golden.build_tokenizer())
    times = []
    t0 = time.perf_counter()
    toks = lm.generate(cond, uncond, 1, cfg["sampling"]["cfg"], cfg["sampling"]["temperature"],
                       None, times)
    t1 = time.perf_counter()
    img = decode(toks)
    print("ref_janus.py: %d tokens in %.1f s (%.1f ms a step), decode %.1f s, image %s"
          % (toks.shape[1], t1 - t0, 1e3 * (times[-1] - times[1]) / (len(times) - 2),
             time.perf_counter() - t1, tuple(img.shape)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
