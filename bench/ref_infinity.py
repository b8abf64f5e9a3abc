#!/usr/bin/env python3
"""arserve beside the official Infinity code on the same weights: seconds per image, the T5
encoder's, the steps (each scale's) and the decoder's, in float32 and in bf16 (PyTorch's
autocast; arserve's cpu_activations bf16), side by side in one run, as bench/ref_var.py does
for VAR.

    INFINITY_SRC=/path/to/Infinity python bench/ref_infinity.py RELEASE_DIR MODEL_DIR \\
        [--pn 0.25M] [--threads 1] [--reps 2] [--batch 1] [--isa avx2] [--sides arserve:f32,...]

RELEASE_DIR holds an Infinity-2B-layout release (infinity_2b_reg.pth, infinity_vae_d32reg.pth,
flan-t5-xl/; `python3 -m tools.release_shapes infinity-mid DIR` writes the mid size issue 62
measures), MODEL_DIR what tools/convert/infinity.py made of it (`--pn` as converted). The
reference is FoundationVision/Infinity's `Infinity.autoregressive_infer_cfg` with its BSQ-VAE
(`vae_model`) and transformers' `T5EncoderModel`, imported from a checkout named by
$INFINITY_SRC (or --src); it is not on PyPI and not part of this repository. That code imports
packages a CPU run does not use: flash_attn (its cross-attention calls
`flash_attn_varlen_kvpacked_func`, given here as scaled_dot_product_attention per sequence),
timm (DropPath, identity at inference) and torchvision; they are stood in for while the official
modules import, then removed. Its width, depth and heads are the converted model's (its
arserve.json), its block chunks the checkpoint's; the rest are the 2B's inference settings (tools/run_infinity.py of the official repository:
bit labels, 2-D RoPE in every layer normalised by h and w, the level embedding on the first
block only, no spatial patchify). Every tensor of two or more dimensions is rounded to bf16,
as the converted model holds them. Both sides draw --prompt with the model's cfg and tau, top-k
and top-p off. Needs torch, transformers, einops, pytz and imageio (.venv-bench, with
`pip install einops pytz imageio`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import types

from ref_var import common_args, setup, side_by_side

STOOD_IN = ("flash_attn", "timm", "timm.models", "timm.models.layers", "timm.loss", "torchvision",
            "torchvision.transforms")


def _stand_ins(torch):
    """Modules the official code imports but a CPU inference does not need, put in sys.modules
    unless the real ones are installed."""
    import torch.nn.functional as F

    def varlen_kvpacked(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                        dropout_p=0.0, softmax_scale=None, **_):
        # q [Nq, H, c] and kv [Nk, 2, H, c] packed by sequence, as flash_attn takes them
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens_q) - 1):
            q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
            qi = q[q0:q1].transpose(0, 1)
            ki, vi = (kv[k0:k1, j].transpose(0, 1).to(qi.dtype) for j in (0, 1))
            out[q0:q1] = F.scaled_dot_product_attention(qi, ki, vi, scale=softmax_scale
                                                        ).transpose(0, 1).to(out.dtype)
        return out

    def no_flash(*a, **k):
        raise RuntimeError("flash_attn_func: the official self-attention must take its SDPA path")

    class DropPath(torch.nn.Identity):
        def __init__(self, *a, **k):
            super().__init__()

    class SoftTargetCrossEntropy(torch.nn.Module):
        pass

    attrs = {"flash_attn": dict(flash_attn_func=no_flash, flash_attn_varlen_kvpacked_func=varlen_kvpacked),
             "timm": {}, "timm.models": dict(register_model=lambda f: f),
             "timm.models.layers": dict(DropPath=DropPath, drop_path=lambda x, *a, **k: x),
             "timm.loss": dict(SoftTargetCrossEntropy=SoftTargetCrossEntropy),
             "torchvision": dict(transforms=None), "torchvision.transforms": {}}
    added = []
    for name in STOOD_IN:
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__dict__.update(attrs[name])
            added.append(name)
    return added


class Official:
    """The official Infinity, its BSQ-VAE and T5 on the release's weights (rounded to bf16)."""

    def __init__(self, src: str, release: str, model: str, pn: str, threads: int):
        import torch
        self.torch = torch
        torch.set_num_threads(threads)
        sys.path.insert(0, src)
        added = _stand_ins(torch)
        from infinity.models.bsq_vae.vae import vae_model  # noqa: E402 (the official checkout's)
        from infinity.models.infinity import Infinity  # noqa: E402
        from infinity.utils.dynamic_resolution import dynamic_resolution_h_w  # noqa: E402
        for name in added:  # transformers looks for the real packages
            sys.modules.pop(name, None)
        from transformers import AutoTokenizer, T5EncoderModel

        sd = torch.load(os.path.join(release, "infinity_2b_reg.pth"), map_location="cpu",
                        weights_only=True, mmap=True)
        idx = [tuple(map(int, m.groups())) for m in
               (re.match(r"block_chunks\.(\d+)\.module\.(\d+)\.", k) for k in sd) if m]
        chunks = 1 + max(c for c, _ in idx)
        llm = json.load(open(os.path.join(model, "arserve.json")))["llm"]
        width, depth, heads = llm["hidden_size"], llm["num_layers"], llm["num_heads"]
        self.t5_dir = os.path.join(release, "flan-t5-xl")
        t5_width = json.load(open(os.path.join(self.t5_dir, "config.json")))["d_model"]
        self.vae = vae_model(os.path.join(release, "infinity_vae_d32reg.pth"), "dynamic", 32, 2 ** 32,
                             patch_size=16, encoder_ch_mult=[1, 2, 4, 4, 4],
                             decoder_ch_mult=[1, 2, 4, 4, 4], test_mode=True)
        self.inf = Infinity(vae_local=self.vae, text_channels=t5_width, text_maxlen=512, shared_aln=True,
                            raw_scale_schedule=None, checkpointing="full-block", customized_flash_attn=False,
                            fused_norm=True, pad_to_multiplier=128, use_flex_attn=False,
                            add_lvl_embeding_only_first_block=1, use_bit_label=1, rope2d_each_sa_layer=1,
                            rope2d_normalized_by_hw=2, pn=pn, apply_spatial_patchify=0, inference_mode=True,
                            train_h_div_w_list=[1.0], depth=depth, embed_dim=width, num_heads=heads,
                            drop_path_rate=0.0, mlp_ratio=4, block_chunks=chunks)
        own = self.inf.state_dict()
        missing = set(own) - set(sd)
        if missing:
            raise SystemExit(f"ref_infinity: the checkpoint lacks {sorted(missing)[:5]}")
        self.tok = AutoTokenizer.from_pretrained(self.t5_dir)
        self.enc = T5EncoderModel.from_pretrained(self.t5_dir, torch_dtype=torch.float32)
        with torch.no_grad():
            for k, v in sd.items():
                if k in own:
                    own[k].copy_(v)
            for net in (self.inf, self.vae, self.enc):
                for p in list(net.parameters()) + list(net.buffers()):
                    if p.is_floating_point() and p.ndim >= 2:
                        p.copy_(p.to(torch.bfloat16))
                net.eval()
        del sd
        self.inf.rng = torch.Generator(device="cpu")
        self.schedule = [(1, h, w) for (_, h, w) in dynamic_resolution_h_w[1.0][pn]["scales"]]
        self.marks, self.decoder = [], [0.0]
        logits, decode = self.inf.get_logits, self.vae.decode

        def get_logits(*a, **k):
            out = logits(*a, **k)
            self.marks.append(time.perf_counter())
            return out

        def timed_decode(*a, **k):
            t = time.perf_counter()
            out = decode(*a, **k)
            self.decoder[0] = time.perf_counter() - t
            return out
        self.inf.get_logits, self.vae.decode = get_logits, timed_decode

    def _encode(self, prompt: str, batch: int):
        """The prompt's T5 features packed as the official code takes a batch of them: `batch`
        copies one after another, their lengths, offsets and the longest."""
        t = self.tok(text=[prompt], max_length=512, padding="max_length", truncation=True,
                     return_tensors="pt")
        feat = self.enc(input_ids=t.input_ids, attention_mask=t.attention_mask)["last_hidden_state"].float()
        n = int(t.attention_mask.sum())
        cu = self.torch.tensor([i * n for i in range(batch + 1)], dtype=self.torch.int32)
        return self.torch.cat([feat[0, :n]] * batch), [n] * batch, cu, n

    def run(self, prompt: str, bf16: bool, sampling: dict, batch: int = 1) -> dict:
        """Per image: `batch` images of the prompt drawn at once, the times / batch."""
        torch, S = self.torch, len(self.schedule)
        self.marks.clear()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            t0 = time.perf_counter()
            cond = self._encode(prompt, batch)
            t1 = time.perf_counter()
            self.inf.autoregressive_infer_cfg(
                vae=self.vae, scale_schedule=self.schedule, label_B_or_BLT=cond, g_seed=0, B=batch,
                negative_label_B_or_BLT=None, force_gt_Bhw=None, cfg_sc=3,
                cfg_list=[sampling["cfg"]] * S, tau_list=[sampling.get("temperature", 1.0)] * S,
                top_k=0, top_p=0.0, returns_vemb=1, ratio_Bl1=None, gumbel=0, norm_cfg=False,
                cfg_exp_k=0.0, cfg_insertion_layer=[0], vae_type=32, softmax_merge_topk=-1,
                ret_img=True, trunk_scale=1000, gt_leak=-1, gt_ls_Bl=None, inference_mode=True,
                sampling_per_bits=1)
            t2 = time.perf_counter()
        scales = [(b - a) / batch for a, b in zip([t1] + self.marks[:-1], self.marks)]
        steps = t2 - t1 - self.decoder[0]
        return {"steps_s": steps / batch, "decoder_s": self.decoder[0] / batch,
                "total_s": (t2 - t0) / batch, "scales_s": scales, "t5_s": (t1 - t0) / batch}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, "infinity_2b_reg.pth, the VAE, flan-t5-xl/", "INFINITY_SRC",
                "FoundationVision/Infinity")
    ap.add_argument("--prompt", default="a red circle")
    ap.add_argument("--pn", default="0.25M", help="the schedule converted (default 0.25M)")
    a = ap.parse_args(argv)
    if not a.arserve_only and not a.src:
        ap.error("the official side needs an Infinity checkout: --src or $INFINITY_SRC "
                 "(or --arserve-only)")
    setup(a)
    sampling = json.load(open(os.path.join(a.model, "arserve.json")))["sampling"]
    official = None if a.arserve_only else Official(a.src, a.release, a.model, a.pn, a.threads)
    return side_by_side(a, ["--prompt", a.prompt],
                        official and (lambda bf16: official.run(a.prompt, bf16, sampling, a.batch)),
                        "ref_infinity",
                        f"Infinity: {os.path.basename(a.model.rstrip('/'))}, \"{a.prompt}\"")


if __name__ == "__main__":
    sys.exit(main())
