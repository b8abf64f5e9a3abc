#!/usr/bin/env python3
"""The PyTorch reference for LlamaGen in `make bench`: LlamaGen's own classes on the same weights.

    LLAMAGEN_SRC=/path/to/LlamaGen python bench/ref_llamagen.py build OUT_DIR
    LLAMAGEN_SRC=/path/to/LlamaGen python bench/ref_llamagen.py check OUT_DIR [--threads 1]

The reference is the official implementation (FoundationVision/LlamaGen): `Transformer(ModelArgs)`
of autoregressive/models/gpt.py, `generate()` of autoregressive/models/generate.py with its KV
cache, and `VQModel.decode_code` of tokenizer/tokenizer_image/vq_model.py. That code is not on
PyPI and is not part of this repository: it is imported from a checkout named by $LLAMAGEN_SRC
(or --src), put at the front of sys.path. The folders used are autoregressive/models/,
tokenizer/tokenizer_image/ and utils/ (torchvision is not needed).

`build OUT_DIR` makes a random class-to-image model of LlamaGen's shapes: GPT-B's width (768, 12
heads, FFN 2048 as ModelArgs computes it) at 4 layers, 1000 classes plus the null class, one class
token, 256 px through VQ-16 (16 x 16 = 256 tokens, codebook 16384 x 8, the VQ_16 builder's encoder
and decoder). Every parameter is redrawn from a seeded generator (the official init zeroes
`output.weight`, which would make every logit 0), in the manner of
tests/golden/llamagen_tiny/README.md: RMSNorm and GroupNorm weights N(1, 0.1^2), other 1-D
parameters N(0, 0.05^2), the class table, token embeddings and codebook N(0, 1), `output.weight`
N(0, 0.3^2 x 64 / 768) (llamagen_tiny's logit scale at width 64, a standard deviation of about
2.4; N(0, 0.3^2) at width 768 would give logits of up to about 36, 175 after CFG, and sampling
would be all but greedy), every other matrix or convolution N(0, 1/fan_in) (the decoder's
`conv_out` 1.5x that deviation). Both state dicts are stored in bfloat16, as LlamaGen releases them
(`torch.save({"model": state_dict})`), in OUT_DIR/official/c2i_bench.pt and vq_bench.pt;
tools/convert/llamagen.py then writes the arserve model directory (arserve.json,
model.safetensors, bf16) into OUT_DIR, and OUT_DIR/reference.json records how to rebuild the
official models. The same bytes every time.

`check OUT_DIR` loads the reference, checks the cached greedy decode's logits against the uncached
full-sequence forward's for a few steps (within bf16 rounding; it prints how many of their argmax
tokens agree, as a near tie may flip), then generates and decodes one image with the model's
sampling settings and prints the times.

As a module (bench/speed_bench.py): `build(out_dir, src)`, and `load(model_dir, ref, threads)` ->
`(lm, decode, cfg)`:

  lm.generate(cond, uncond, batch, cfg_w, temperature, gen=None, times=None)
      cond, uncond: the engine's prompt rows for a class, [class] and [num_classes] (the null
      class, which the official generate() adds itself: any other uncond is refused); batch
      images of that class through the official generate() (a bf16 KV cache, CFG, the
      arserve.json's top_k and top_p; temperature 0 = greedy); returns [batch, 256] int64
      tokens. `gen` (a torch.Generator) seeds the global RNG the official sampler draws from;
      `times` gets time.perf_counter() after each of the model's forward passes, one per token
      (the prefill's first), so its differences are the decode steps.
  lm.logits(cond, uncond, tokens)
      [2, N, V] float32 logits of the cond and uncond rows before each of N tokens, from the
      official full-sequence forward without the KV cache (for checking the cached decode).
  lm.gpt
      the official Transformer itself.
  decode(tokens)
      [B, 256] tokens -> [B, 256, 256, 3] uint8 via VQModel.decode_code, converted to pixels as
      sample_c2i.py's save_image(normalize=True, value_range=(-1, 1)) does.

The GPT runs in bfloat16 as stored (sample_c2i.py's default precision), the VQ decoder in float32
with the stored values, as sample_c2i.py loads them; no autocast. Needs torch and numpy
(.venv-tools).
"""

import argparse
import json
import os
import subprocess
import sys
import time
import types
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SEED = 20251124
NAME = "llamagen-b-4l-random"
IMAGE_SIZE = 256
DOWNSAMPLE = 16
# Transformer(ModelArgs(**GPT_ARGS)): GPT-B's width and heads at 4 of its 12 layers.
GPT_ARGS = {"n_layer": 4, "n_head": 12, "dim": 768, "vocab_size": 16384,
            "block_size": (IMAGE_SIZE // DOWNSAMPLE) ** 2, "num_classes": 1000,
            "cls_token_num": 1, "class_dropout_prob": 0.1, "model_type": "c2i"}
# VQ_models[VQ_MODEL](**VQ_ARGS), as sample_c2i.py builds it.
VQ_MODEL = "VQ-16"
VQ_ARGS = {"codebook_size": 16384, "codebook_embed_dim": 8}

NEEDED = ("autoregressive/models/gpt.py", "autoregressive/models/generate.py",
          "tokenizer/tokenizer_image/vq_model.py", "utils/drop_path.py")
NO_SRC = ("set LLAMAGEN_SRC to a checkout of https://github.com/FoundationVision/LlamaGen "
          "(its autoregressive/ and tokenizer/ folders)")


def official(src=None):
    """The official modules, imported from src (default $LLAMAGEN_SRC): a namespace with torch,
    gpt (autoregressive.models.gpt), generate (autoregressive.models.generate) and vq
    (tokenizer.tokenizer_image.vq_model)."""
    src = src or os.environ.get("LLAMAGEN_SRC")
    if not src:
        raise SystemExit("ref_llamagen.py: " + NO_SRC)
    src = os.path.abspath(src)
    missing = [p for p in NEEDED if not os.path.isfile(os.path.join(src, p))]
    if missing:
        raise SystemExit("ref_llamagen.py: %s lacks %s: %s" % (src, ", ".join(missing), NO_SRC))
    if src not in sys.path:
        sys.path.insert(0, src)
    import torch
    import autoregressive.models.generate as generate
    import autoregressive.models.gpt as gpt
    import tokenizer.tokenizer_image.vq_model as vq
    # generate.py's decode loop enters torch.backends.cuda.sdp_kernel(), deprecated in torch 2.x
    # (a no-op on the CPU): keep its warning out of the output.
    warnings.filterwarnings("ignore", message=r".*sdp_kernel\(\)", category=FutureWarning)
    return types.SimpleNamespace(torch=torch, gpt=gpt, generate=generate, vq=vq, src=src)


# ---- build -------------------------------------------------------------------------------

def randomise(torch, model, g, norm_types, unit, wide, conv_out=None):
    """Redraws every parameter of model from generator g, in named_parameters() order: norm
    weights N(1, 0.1^2), other 1-D N(0, 0.05^2), the names in unit N(0, 1), those in wide
    N(0, 0.3^2 x 64 / fan_in), the rest N(0, 1/fan_in) (conv_out 1.5x that deviation)."""
    norms = {name + ".weight" for name, m in model.named_modules() if isinstance(m, norm_types)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean, std = 0.0, None
            if name in norms:
                mean, std = 1.0, 0.1
            elif p.ndim == 1:
                std = 0.05
            elif name in unit:
                std = 1.0
            elif name in wide:
                std = 0.3 * (64 / p.shape[1]) ** 0.5
            else:
                std = (p[0].numel() ** -0.5) * (1.5 if name == conv_out else 1.0)
            p.copy_(torch.randn(p.shape, generator=g) * std + mean)


def build(out_dir, src=None):
    """Writes the random LlamaGen-shaped model into out_dir (see the module docstring); returns
    the reference.json dict."""
    o = official(src)
    torch = o.torch
    torch.manual_seed(SEED)
    gpt = o.gpt.Transformer(o.gpt.ModelArgs(**GPT_ARGS)).eval()
    vq = o.vq.VQ_models[VQ_MODEL](**VQ_ARGS).eval()
    g = torch.Generator().manual_seed(SEED)
    randomise(torch, gpt, g, (o.gpt.RMSNorm,),
              unit={"cls_embedding.embedding_table.weight", "tok_embeddings.weight"},
              wide={"output.weight"})
    randomise(torch, vq, g, (torch.nn.GroupNorm,), unit={"quantize.embedding.weight"},
              wide=set(), conv_out="decoder.conv_out.weight")

    def bf16(model):
        return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
                for k, v in model.state_dict().items()}

    off = os.path.join(out_dir, "official")
    os.makedirs(off, exist_ok=True)
    gpt_path, vq_path = os.path.join(off, "c2i_bench.pt"), os.path.join(off, "vq_bench.pt")
    torch.save({"model": bf16(gpt)}, gpt_path)
    torch.save({"model": bf16(vq)}, vq_path)
    n_gpt = sum(p.numel() for p in gpt.parameters())
    n_vq = sum(p.numel() for p in vq.parameters())
    n_dec = sum(p.numel() for n, p in vq.named_parameters()
                if not n.startswith(("encoder.", "quant_conv.")))
    print("ref_llamagen.py: wrote %s (GPT, %.2fM parameters: %d layers x %d, %d heads, FFN %d) "
          "and %s (%s, %.2fM parameters, %.2fM without the encoder), bfloat16"
          % (gpt_path, n_gpt / 1e6, GPT_ARGS["n_layer"], GPT_ARGS["dim"], GPT_ARGS["n_head"],
             gpt.layers[0].feed_forward.w1.out_features, vq_path, VQ_MODEL, n_vq / 1e6,
             n_dec / 1e6))

    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert", "llamagen.py"),
                    gpt_path, vq_path, out_dir, "--dtype", "bf16",
                    "--image-size", str(IMAGE_SIZE), "--n-head", str(GPT_ARGS["n_head"]),
                    "--name", NAME, "--force"], check=True)

    ref = {"impl": "llamagen", "source": "https://github.com/FoundationVision/LlamaGen",
           "gpt": "official/c2i_bench.pt", "vq": "official/vq_bench.pt",
           "gpt_args": GPT_ARGS, "precision": "bf16",
           "vq_model": VQ_MODEL, "vq_args": VQ_ARGS,
           "image_size": IMAGE_SIZE, "downsample_size": DOWNSAMPLE, "seed": SEED}
    with open(os.path.join(out_dir, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, indent=2)
        f.write("\n")
    print("ref_llamagen.py: wrote %s" % os.path.join(out_dir, "reference.json"))
    return ref


# ---- load --------------------------------------------------------------------------------

class OfficialLM:
    """The official GPT and generate(), driven with the engine's prompt rows."""

    def __init__(self, o, gpt, sampling, n_tokens):
        self.o, self.gpt, self.sampling, self.n_tokens = o, gpt, sampling, n_tokens

    @property
    def dtype(self):
        """The torch dtype the GPT runs in."""
        return next(self.gpt.parameters()).dtype

    def _label(self, cond, uncond):
        if len(cond) != 1 or not 0 <= cond[0] < self.gpt.num_classes:
            raise ValueError("cond %r: one class in [0, %d)" % (cond, self.gpt.num_classes))
        if list(uncond) != [self.gpt.num_classes]:
            raise ValueError("uncond %r: the official generate() uses the null class [%d]"
                             % (uncond, self.gpt.num_classes))
        return int(cond[0])

    def generate(self, cond, uncond, batch, cfg_w, temperature, gen=None, times=None):
        """[batch, n_tokens] int64 tokens of class cond[0] (see the module docstring)."""
        torch = self.o.torch
        label = self._label(cond, uncond)
        if gen is not None:
            torch.manual_seed(int(torch.randint(0, 2**62, (), generator=gen)))
        s = self.sampling
        hook = None
        if times is not None:
            hook = self.gpt.register_forward_hook(lambda *_: times.append(time.perf_counter()))
        try:
            seq = self.o.generate.generate(
                self.gpt, torch.full((batch,), label, dtype=torch.long), self.n_tokens,
                cfg_scale=cfg_w, temperature=temperature, top_k=s.get("top_k", 0),
                top_p=s.get("top_p", 1.0), sample_logits=temperature > 0)
        finally:
            if hook is not None:
                hook.remove()
        return seq.long()

    def logits(self, cond, uncond, tokens):
        """[2, N, V] float32 logits of the cond and uncond rows before each of tokens (N ints),
        from the official full-sequence forward (no KV cache, causal attention)."""
        torch = self.o.torch
        label = self._label(cond, uncond)
        caches = [b.attention.kv_cache for b in self.gpt.layers]
        for b in self.gpt.layers:
            b.attention.kv_cache = None
        try:
            idx = torch.tensor([tokens[:-1], tokens[:-1]], dtype=torch.long)
            n = self.gpt.cls_token_num + idx.shape[1]
            with torch.no_grad():
                out, _ = self.gpt(idx, torch.tensor([label, self.gpt.num_classes]),
                                  input_pos=torch.arange(n))
        finally:
            for b, c in zip(self.gpt.layers, caches):
                b.attention.kv_cache = c
        return out[:, self.gpt.cls_token_num - 1:]


def load(model_dir, ref=None, threads=None, src=None, dtype=None):
    """(lm, decode, cfg) for the model directory build() wrote: the official GPT (in
    reference.json's precision, bf16 by default, or `dtype`) and VQModel from ref's files (ref:
    reference.json's dict, read from model_dir if None), cfg the parsed arserve.json. threads:
    torch's intra-op threads (None: torch's default)."""
    o = official(src)
    torch = o.torch
    if threads:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set in this process
            pass
    with open(os.path.join(model_dir, "arserve.json")) as f:
        cfg = json.load(f)
    if ref is None:
        with open(os.path.join(model_dir, "reference.json")) as f:
            ref = json.load(f)
    if ref.get("impl") != "llamagen":
        raise SystemExit("ref_llamagen.py: %s: reference.json is for %r, not llamagen"
                         % (model_dir, ref.get("impl")))

    def state(name):
        sd = torch.load(os.path.join(model_dir, ref[name]), map_location="cpu", weights_only=True)
        sd = sd["model"] if "model" in sd else sd
        sd.pop("freqs_cis", None)  # recomputed by the model, as sample_c2i.py ignores it
        return sd

    precision = dtype or {"none": torch.float32, "bf16": torch.bfloat16,
                          "fp16": torch.float16}[ref.get("precision", "bf16")]
    gpt = o.gpt.Transformer(o.gpt.ModelArgs(**ref["gpt_args"])).to(dtype=precision)
    gpt.load_state_dict(state("gpt"))
    gpt.eval()
    vq = o.vq.VQ_models[ref["vq_model"]](**ref["vq_args"])
    vq.load_state_dict(state("vq"))
    vq.eval()

    im = cfg["image"]
    n_tokens = im["grid_height"] * im["grid_width"]
    if n_tokens != gpt.block_size or cfg["condition"]["num_classes"] != gpt.num_classes:
        raise SystemExit("ref_llamagen.py: %s: arserve.json (%d tokens, %d classes) and "
                         "reference.json (%d, %d) disagree" % (
                             model_dir, n_tokens, cfg["condition"]["num_classes"],
                             gpt.block_size, gpt.num_classes))
    qzshape = [ref["vq_args"]["codebook_embed_dim"], im["grid_height"], im["grid_width"]]

    @torch.no_grad()
    def decode(tokens):
        """[B, N] tokens -> [B, H, W, 3] uint8, as sample_c2i.py decodes and saves."""
        tokens = torch.as_tensor(tokens).long()
        x = vq.decode_code(tokens, [tokens.shape[0]] + qzshape)
        # torchvision's save_image(normalize=True, value_range=(-1, 1)): clamp, map to [0, 1],
        # then mul(255).add_(0.5).clamp_(0, 255).to(uint8)
        x = (x.clamp(-1, 1) + 1) / 2
        x = x.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8)
        return x.permute(0, 2, 3, 1).contiguous()

    return OfficialLM(o, gpt, cfg["sampling"], n_tokens), decode, cfg


# ---- by hand -----------------------------------------------------------------------------

def check(model_dir, src=None, threads=1, label=0, seed=0, n_check=8):
    t0 = time.perf_counter()
    lm, decode, cfg = load(model_dir, None, threads, src)
    torch = lm.o.torch
    s = cfg["sampling"]
    cond, uncond = [label], [cfg["condition"]["num_classes"]]
    print("ref_llamagen.py: loaded %s in %.1f s (official code from %s; %d thread(s); sampling "
          "cfg %g, temperature %g, top_k %d, top_p %g)" % (
              model_dir, time.perf_counter() - t0, lm.o.src, torch.get_num_threads(), s["cfg"],
              s["temperature"], s.get("top_k", 0), s.get("top_p", 1.0)))

    # The cached decode (generate(), bf16 KV cache) against the uncached full-sequence forward,
    # teacher-forced on its greedy tokens: the same logits up to bf16 rounding (a wrong class,
    # position or cache would differ by their whole size). A near tie may still flip a token.
    seen = []
    hook = lm.gpt.register_forward_hook(lambda m, i, out: seen.append(out[0][:, -1].float()))
    try:
        greedy = lm.generate(cond, uncond, 1, s["cfg"], 0.0)[0, :n_check].tolist()
    finally:
        hook.remove()
    cached = torch.stack(seen[:n_check], 1)
    full = lm.logits(cond, uncond, greedy)
    rel = ((cached - full).norm() / full.norm()).item()
    mixed = full[1] + s["cfg"] * (full[0] - full[1])
    argmax = mixed.argmax(-1).tolist()
    print("greedy, class %d: %s (cached generate)" % (label, greedy))
    print("                %s (full-sequence forward's argmax on them: %d of %d equal); "
          "logits differ by %.2g of their norm, bf16" % (
              argmax, sum(a == b for a, b in zip(argmax, greedy)), n_check, rel))
    if rel > 0.05:
        print("ref_llamagen.py: the cached decode's logits are not the full forward's",
              file=sys.stderr)
        return 1

    times = []
    t0 = time.perf_counter()
    toks = lm.generate(cond, uncond, 1, s["cfg"], s["temperature"],
                       torch.Generator().manual_seed(seed), times)
    t1 = time.perf_counter()
    img = decode(toks)
    t2 = time.perf_counter()
    steps = sorted(b - a for a, b in zip(times, times[1:]))
    print("one image, class %d, seed %d: tokens %.2f s (%d forwards, median decode step %.2f ms), "
          "VQ decode %.2f s, total %.2f s; image %s, mean pixel %.1f, first tokens %s" % (
              label, seed, t1 - t0, len(times), 1e3 * steps[len(steps) // 2], t2 - t1, t2 - t0,
              "x".join(map(str, img.shape[1:])), img.float().mean().item(),
              toks[0, :8].tolist()))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the random model, its arserve directory and "
                       "reference.json into OUT_DIR")
    c = sub.add_parser("check", help="load OUT_DIR's reference, check it, time one image")
    for p in (b, c):
        p.add_argument("out_dir", metavar="OUT_DIR")
        p.add_argument("--src", help="LlamaGen checkout (default $LLAMAGEN_SRC)")
    c.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    c.add_argument("--class", dest="label", type=int, default=0, help="class (default 0)")
    c.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        build(a.out_dir, a.src)
        return 0
    return check(a.out_dir, a.src, a.threads, a.label, a.seed)


if __name__ == "__main__":
    sys.exit(main())
