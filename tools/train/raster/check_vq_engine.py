#!/usr/bin/env python3
"""Checks that arserve's own VQ decoder (engine/family/vq_decoder.c) decodes the exported
decoder exactly as torch does.

    python tools/train/raster/check_vq_engine.py --ckpt build/train/vq/ckpt.pt \\
        --val build/shapes/val --lib build/libarengine.a

Steps: export the checkpoint's decoder (F16, as export_vq.py) into a scratch model
directory next to a random tiny language model (tools/make_tiny_model.py's weights with
this image config); tokenize --n held-out images with the torch encoder; compile a small
C harness against the engine library (cc, the Makefile's flags and libraries; nothing in
the tree is built or changed) that loads the directory with model_load and runs vq_decode
on those tokens; compare with torch's decode of the same tokens using the same F16-rounded
weights. Reports the largest difference of the float outputs, the fraction of equal
8-bit pixels, and the PSNR against the original images of both.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(HERE))  # tools/train: train_util
import make_tiny_model  # noqa: E402  (tools/make_tiny_model.py)
import safetensors_write  # noqa: E402
from export_vq import fragment_config, load_model, vq_tensors  # noqa: E402
from train_util import compile_harness  # noqa: E402
from vq_model import to_u8, tokenize_u8  # noqa: E402

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include "engine/family/family_raster.h"
int main(int argc, char **argv) {
    ar_error_t err = {{0}};
    backend_t *be = backend_cpu_create(1, &err);
    if (!be) { fprintf(stderr, "%s\n", err.msg); return 1; }
    model_t m;
    if (model_load(&m, argv[1], be, &err)) { fprintf(stderr, "%s\n", err.msg); return 1; }
    int n = atoi(argv[4]);
    int g = m.cfg.image.grid_height * m.cfg.image.grid_width;
    int H = model_config_image_height(&m.cfg), W = model_config_image_width(&m.cfg);
    FILE *ft = fopen(argv[2], "rb"), *fo = fopen(argv[3], "wb");
    int *tok = malloc(sizeof(int) * g);
    float *pix = malloc(sizeof(float) * 3 * H * W);
    unsigned char *rgb = malloc(3 * H * W);
    for (int i = 0; i < n; i++) {
        if (fread(tok, sizeof(int), g, ft) != (size_t)g) return 2;
        if (vq_decode(&raster_net_of(&m)->dec, model_draw_work(&m, &err), tok, rgb, pix, &err)) { fprintf(stderr, "%s\n", err.msg); return 1; }
        fwrite(pix, sizeof(float), 3 * H * W, fo);
        fwrite(rgb, 1, 3 * H * W, fo);
    }
    fclose(ft); fclose(fo);
    model_free(&m);
    be->destroy(be);
    return 0;
}
"""


def write_model_dir(d, model, cfg):
    frag = fragment_config(cfg)
    conf = json.loads(json.dumps(make_tiny_model.CONFIG))
    conf["name"] = "vq-check"
    conf["image"].update(frag["image"])
    conf["decoder"] = frag["decoder"]
    conf["weights"] = ["model.safetensors", "vq.safetensors"]
    rest = {k: v for k, v in make_tiny_model.make_weights(conf, np.random.default_rng(0)).items()
            if not k.startswith("vq.")}
    safetensors_write.write(os.path.join(d, "model.safetensors"), rest)
    vq = vq_tensors(model)
    safetensors_write.write(os.path.join(d, "vq.safetensors"), vq)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        tok = make_tiny_model.word_level_tokenizer(make_tiny_model.SPECIALS, make_tiny_model.WORDS,
                                                   conf["llm"]["vocab_size"])
        json.dump(tok, f)
    with open(os.path.join(d, "arserve.json"), "w") as f:
        json.dump(conf, f, indent=1)
    return vq


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--val", required=True, help="npz shard directory")
    ap.add_argument("--lib", default=os.path.join(ROOT, "build", "libarengine.a"))
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from tools.shapes.dataset import load_shards

    model, ck = load_model(a.ckpt)
    cfg = ck["config"]
    _, val = load_shards(a.val)
    val = val[: a.n]
    with tempfile.TemporaryDirectory() as d:
        vq = write_model_dir(d, model, cfg)
        sd = model.state_dict()
        for k, v in vq.items():
            sd[k[3:]] = torch.from_numpy(v.astype(np.float32))
        model.load_state_dict(sd)
        with torch.no_grad():
            tokens = tokenize_u8(model, val, ck.get("codebook_masks"))
            ref = model.decode_indices(tokens)
        tokens.numpy().astype(np.int32).tofile(os.path.join(d, "tokens.bin"))
        exe = os.path.join(d, "harness")
        compile_harness(a.cc, HARNESS, a.lib, exe)
        out = os.path.join(d, "out.bin")
        subprocess.run([exe, d, os.path.join(d, "tokens.bin"), out, str(len(val))], check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
        raw = np.fromfile(out, np.uint8)
    h, w = val.shape[1:3]
    per = 3 * h * w * 4 + 3 * h * w
    eng_f, eng_u8 = [], []
    for i in range(len(val)):
        rec = raw[i * per : (i + 1) * per]
        eng_f.append(rec[: 3 * h * w * 4].view(np.float32).reshape(3, h, w))
        eng_u8.append(rec[3 * h * w * 4 :].reshape(h, w, 3))
    eng_f, eng_u8 = np.stack(eng_f), np.stack(eng_u8)
    ref_u8 = to_u8(ref).numpy()
    diff = np.abs(eng_f - ref.numpy()).max()

    def psnr(x):
        return 10 * math.log10(255.0 ** 2 / ((x.astype(np.float64) - val) ** 2).mean())

    print("engine vs torch on %d images: max |float difference| %.2e, equal 8-bit values %.4f%%" % (
        len(val), diff, 100 * (eng_u8 == ref_u8).mean()))
    print("PSNR vs originals: engine %.2f dB, torch %.2f dB" % (psnr(eng_u8), psnr(ref_u8)))
    return 0 if diff < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
