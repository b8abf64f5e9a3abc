#!/usr/bin/env python3
"""Reference sampler of the shapes VAR model in torch, from an exported model directory
(arserve.json + model.safetensors + classes.txt) or from the training checkpoints; and a
ShapesEval run of it.

Greedy reference for one class (seed-independent: top-k 1 after CFG, so the argmax of
(1 + t) l_cond - t l_uncond with t = cfg * si / (S - 1), lowest id on ties):

    .venv-tools/bin/python tools/train/var/sample_var.py --model models/shapes-var \\
        greedy --class "a red circle" --out build/train_var/ref/red_circle

writes OUT/tokens.json ({"class", "label", "cfg", "scales", "tokens": [[...] per scale, raster
order]}), OUT/image.png (pixels as the engine makes them: trunc(clip((x + 1) / 2 * 255))),
OUT/pixels.npy (the decoder's float output, (3, H, W)) and OUT/logits.npy (the CFG-combined
logits of every token, (L, V), for comparing with the engine).

ShapesEval on prompts whose text is a class name (single_object and colors), images
sampled in torch with the given sampling settings; image n of prompt id uses torch seed
S + 100000 n + id (torch's RNG, not the engine's, so images differ from arserve's):

    .venv-tools/bin/python tools/train/var/sample_var.py --model models/shapes-var \\
        eval --categories single_object,colors --seed 0 --cfg 3 --out build/train_var/eval

Sampling per token: logits / temperature, then top-k (0 = off), then top-p (1 = off) over
the softmax, then a multinomial draw.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tools", "train"))
import safetensors_write  # noqa: E402
from msvq import DEFAULT_CFG as VQ_DEFAULT, MSVQ, down_to, to_u8  # noqa: E402
from var_model import VAR  # noqa: E402


def load_model_dir(d):
    with open(os.path.join(d, "arserve.json")) as f:
        js = json.load(f)
    im, dec, llm = js["image"], js["decoder"], js["llm"]
    vcfg = dict(VQ_DEFAULT, image_size=im["scales"][-1] << (len(dec["channel_multiplier"]) - 1), scales=im["scales"], codebook_size=im["codebook_size"], embed_dim=im["embed_dim"],
                phi_count=im["phi_count"], phi_ratio=im["phi_ratio"], base_channels=dec["base_channels"],
                channel_multiplier=dec["channel_multiplier"], num_res_blocks=dec["num_res_blocks"],
                out_channels=dec["out_channels"])
    mcfg = {"width": llm["hidden_size"], "heads": llm["num_heads"], "depth": llm["num_layers"],
            "ffn": llm["intermediate_size"], "num_classes": js["condition"]["num_classes"],
            "scales": im["scales"], "codebook_size": im["codebook_size"], "embed_dim": im["embed_dim"],
            "shared_adaln": bool(llm.get("shared_adaln", False))}
    t = {}
    for w in js.get("weights", ["model.safetensors"]):
        t.update(safetensors_write.read(os.path.join(d, w)))
    vq, var = MSVQ(vcfg), VAR(mcfg)
    vsd, msd = {}, {}
    for k, v in t.items():
        v = torch.from_numpy(np.asarray(v, dtype=np.float32).copy())
        if k.startswith("var."):
            msd[k[4:]] = v
        elif k.startswith("vq.phi."):
            i, _, rest = k[len("vq.phi."):].partition(".")
            vsd["phi.%s.conv.%s" % (i, rest)] = v
        elif k.startswith("vq."):
            vsd[k[3:]] = v
        else:
            raise KeyError(k)
    var.load_state_dict(msd, strict=True)
    missing, unexpected = vq.load_state_dict(vsd, strict=False)
    assert not unexpected and all(m.startswith("encoder.") for m in missing), (missing, unexpected)
    names = None
    cn = js["condition"].get("class_names")
    if cn:
        with open(os.path.join(d, cn)) as f:
            names = [line.rstrip("\n") for line in f]
    return vq.eval(), var.eval(), names, js


def pick(logits, temperature, top_k, top_p, gen):
    """logits (N, V) -> ids (N,)."""
    if top_k == 1:
        return logits.argmax(-1)
    lg = logits / max(temperature, 1e-8)
    if top_k and top_k < lg.shape[-1]:
        kth = torch.topk(lg, top_k, dim=-1).values[:, -1:]
        lg = lg.masked_fill(lg < kth, float("-inf"))
    if top_p < 1.0:
        srt, order = torch.sort(lg, dim=-1, descending=True)
        p = torch.softmax(srt, -1)
        cum = p.cumsum(-1)
        drop = cum - p >= top_p  # keep the smallest prefix reaching top_p
        srt = srt.masked_fill(drop, float("-inf"))
        lg = torch.full_like(lg, float("-inf")).scatter(-1, order, srt)
    return torch.multinomial(torch.softmax(lg, -1), 1, generator=gen)[:, 0]


@torch.no_grad()
def generate(var, vq, labels, cfg=3.0, temperature=1.0, top_k=0, top_p=1.0, gen=None, keep_logits=False):
    """labels (B,) -> (images float (B, 3, H, W), [idx (B, pn, pn)] per scale, logits (B, L, V)
    or None). Recomputes the whole prefix each scale (no cache): same numbers as a cache."""
    labels = torch.as_tensor(labels).long()
    B, S = len(labels), len(var.scales)
    lab2 = torch.cat([labels, torch.full_like(labels, var.num_classes)])
    x_in = torch.zeros(2 * B, 0, vq.cfg["embed_dim"])
    f_hat = 0
    idxs, all_logits, start = [], [], 0
    for si, pn in enumerate(var.scales):
        lg = var(lab2, x_in)[:, start:start + pn * pn]
        t = cfg * si / (S - 1)
        comb = (1 + t) * lg[:B] - t * lg[B:]
        if keep_logits:
            all_logits.append(comb)
        idx = pick(comb.reshape(-1, comb.shape[-1]), temperature, top_k, top_p, gen).view(B, pn, pn)
        idxs.append(idx)
        f_hat = f_hat + vq.code_map(idx, si)
        if si < S - 1:
            nxt = down_to(f_hat, var.scales[si + 1]).flatten(2).transpose(1, 2)
            x_in = torch.cat([x_in, nxt.repeat(2, 1, 1)], 1)
        start += pn * pn
    img = vq.decode_fhat(f_hat)
    return img, idxs, (torch.cat(all_logits, 1) if keep_logits else None)


def cmd_greedy(vq, var, names, a):
    label = names.index(a.cls) if a.cls is not None else a.label
    img, idxs, logits = generate(var, vq, [label], cfg=a.cfg, top_k=1, keep_logits=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tokens.json"), "w") as f:
        json.dump({"class": names[label] if names else None, "label": label, "cfg": a.cfg, "scales": var.scales,
                   "tokens": [i[0].flatten().tolist() for i in idxs]}, f)
        f.write("\n")
    Image.fromarray(to_u8(img)[0].numpy()).save(os.path.join(a.out, "image.png"))
    np.save(os.path.join(a.out, "pixels.npy"), img[0].numpy())
    np.save(os.path.join(a.out, "logits.npy"), logits[0].numpy())
    print("class %d %r: tokens per scale %s -> %s" % (label, names[label] if names else "",
                                                      [i[0].flatten().tolist()[:8] for i in idxs], a.out))


def cmd_eval(vq, var, names, a):
    sys.path.insert(0, ROOT)
    from tools.shapes_eval import scorer
    cats = a.categories.split(",")
    prompts = [p for p in scorer.load_prompts(a.prompts) if p["category"] in cats]
    if a.limit:
        prompts = prompts[:a.limit]
    os.makedirs(a.out, exist_ok=True)
    for fn in os.listdir(a.out):
        if fn.endswith(".png"):
            os.remove(os.path.join(a.out, fn))
    t0 = time.time()
    todo = [(p, n) for p in prompts for n in range(a.images_per_prompt)]
    for s in range(0, len(todo), a.batch):
        chunk = todo[s:s + a.batch]
        imgs = []
        for p, n in chunk:  # one generator per image: its seed alone fixes it
            gen = torch.Generator().manual_seed(a.seed + 100000 * n + p["id"])
            img, _, _ = generate(var, vq, [names.index(p["prompt"])], a.cfg, a.temperature, a.top_k, a.top_p, gen)
            imgs.append(img)
        for (p, n), img in zip(chunk, imgs):
            name = "%05d.png" % p["id"] if a.images_per_prompt == 1 else "%05d_%d.png" % (p["id"], n)
            Image.fromarray(to_u8(img)[0].numpy()).save(os.path.join(a.out, name))
    t_gen = time.time() - t0
    results = scorer.score_dir(a.out, prompts)
    table, overall, images = scorer.summarise(results)
    print(scorer.format_table(table, overall, images))
    print("cfg %g temperature %g top_k %d top_p %g seed %d: %d images in %.0f s" % (
        a.cfg, a.temperature, a.top_k, a.top_p, a.seed, len(todo), t_gen))
    if a.failures:
        for r in results:
            if not r["correct"]:
                print("WRONG %s %r: %s" % (r["file"], r["prompt"], r["reason"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"table": table, "overall": overall, "args": vars(a), "results": results}, f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="exported model directory")
    ap.add_argument("--vq", help="msvq training checkpoint (instead of --model)")
    ap.add_argument("--var", help="VAR training checkpoint (instead of --model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cfg", type=float, default=None, help="default: the model's")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("greedy")
    g.add_argument("--class", dest="cls")
    g.add_argument("--label", type=int, default=0)
    g.add_argument("--out", required=True)
    e = sub.add_parser("eval")
    e.add_argument("--prompts", default=os.path.join(ROOT, "tools", "shapes_eval", "prompts.jsonl"))
    e.add_argument("--categories", default="single_object,colors")
    e.add_argument("--limit", type=int, default=0)
    e.add_argument("--images-per-prompt", type=int, default=1)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--temperature", type=float, default=None)
    e.add_argument("--top-k", type=int, default=None)
    e.add_argument("--top-p", type=float, default=None)
    e.add_argument("--batch", type=int, default=8)
    e.add_argument("--out", required=True)
    e.add_argument("--json")
    e.add_argument("--failures", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.model:
        vq, var, names, js = load_model_dir(a.model)
        samp = js["sampling"]
    else:
        import data
        from export import load_ckpts
        vq, var = load_ckpts(a.vq, a.var)
        names, samp = data.CLASS_NAMES, {"cfg": 3.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    if a.cfg is None:
        a.cfg = samp["cfg"]
    if a.cmd == "eval":
        for k in ("temperature", "top_k", "top_p"):
            if getattr(a, k) is None:
                setattr(a, k, samp[k])
        cmd_eval(vq, var, names, a)
    else:
        cmd_greedy(vq, var, names, a)


if __name__ == "__main__":
    main()
