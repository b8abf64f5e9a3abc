#!/usr/bin/env python3
"""Checks that arserve runs a model trained by train.py as torch does: the export (OUT/official,
F16 matrices) loaded into model.py and T5, and arserve's engine on the converted directory
(OUT/model), teacher-forced on the same random bits for a few captions; the logits of both CFG
rows (the caption's and the learned unconditional rows) at every scale must agree.

    python3 tools/train/inf/check_engine.py --out build/train-inf [--lib build/libarengine.a]

A small C harness is compiled against the engine library (cc with the Makefile's flags and
libraries; nothing in the tree is built or changed): it loads the directory with model_load and
steps a request whose tokens are forced (gen_request_t.forced), writing each step's logits.
Exit status 1 when the largest difference is over --tol.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools", "train"))
sys.path.insert(0, ROOT)
import train_util as U  # noqa: E402

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/planner.h"
static int fail(const char *what, const ar_error_t *err) {
    fprintf(stderr, "harness: %s: %s\n", what, err->msg);
    return 1;
}
int main(int argc, char **argv) { /* DIR IDS.bin N_IDS BITS.bin OUT.bin */
    if (argc != 6) return 2;
    ar_error_t err = {{0}};
    backend_t *be = backend_cpu_create(1, &err);
    model_t m;
    if (!be || model_load(&m, argv[1], be, &err)) return fail("load", &err);
    const model_config_t *c = &m.cfg;
    const image_size_t *z = &c->image.sizes[0];
    int n = atoi(argv[3]), L = 0, d = c->image.bits;
    for (int s = 0; s < z->n_scales; s++) L += z->h[s] * z->w[s];
    int *ids = malloc(sizeof(int) * n), *unc = malloc(sizeof(int) * n), *bits = malloc(sizeof(int) * L * d);
    FILE *fi = fopen(argv[2], "rb"), *fb = fopen(argv[4], "rb"), *fo = fopen(argv[5], "wb");
    if (!fi || !fb || !fo || fread(ids, sizeof(int), n, fi) != (size_t)n ||
        fread(bits, sizeof(int), (size_t)L * d, fb) != (size_t)L * d) return 3;
    for (int i = 0; i < n; i++) unc[i] = -1;
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    const int bt = planner_block_tokens(c);
    planner_plan_t plan;
    if (planner_plan_sized(&plan, c, &full, 1, 0, bt, planner_kv_f32, NULL, &err)) return fail("plan", &err);
    kv_pool_t pool;
    if (kv_pool_init(&pool, be, 2 * (int)(plan.peak_bytes / kv_pool_block_bytes(bt, c->llm.head_dim, DTYPE_F32)),
                     bt, c->llm.head_dim, DTYPE_F32, &err)) return fail("pool", &err);
    const gen_image_opts_t opts = {0};
    const sampler_params_t sp = {3.0f, 1.0f, 0, 0.0f};
    gen_request_t r;
    if (gen_request_init_opts(&r, &m, &pool, NULL, ids, unc, n, &opts, &sp, 1, 0, &err)) return fail("request", &err);
    r.forced = bits;
    gen_request_t *batch[] = {&r};
    while (!gen_request_done(&r)) {
        const int pp = z->h[r.step] * z->w[r.step];
        if (gen_step(batch, 1, &err)) return fail("step", &err);
        fwrite(r.logits, sizeof(float), (size_t)2 * pp * 2 * d, fo);
    }
    fclose(fo);
    gen_request_free(&r);
    planner_plan_free(&plan);
    kv_pool_free(&pool);
    model_free(&m);
    be->destroy(be);
    return 0;
}
"""


def torch_logits(out, captions, bits):
    """Both rows' teacher-forced logits [L, 2 d] per caption, from OUT/official."""
    import model as M
    import train as T
    from transformers import T5EncoderModel

    off = os.path.join(out, "official")
    ck = torch.load(os.path.join(out, "lm", "ckpt.pt"), map_location="cpu", weights_only=False)
    cfg = ck["config"]
    net = M.Infinity(cfg["C"], cfg["depth"], cfg["H"], cfg["d"], cfg["text_channels"], cfg["text_maxlen"],
                     chunks=cfg["depth"])
    sd = torch.load(os.path.join(off, "infinity.pth"), map_location="cpu", weights_only=True)
    net.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    t5 = T5EncoderModel.from_pretrained(os.path.join(off, "t5")).float().eval()
    vocab = T.tokenizer_json()["model"]["vocab"]
    inputs, _ = M.next_scale_inputs(bits[None], T.SCHEDULE)
    rows = []
    with torch.no_grad():
        for cap in captions:
            ids = torch.tensor([T.encode(vocab, cap)])
            mask = torch.ones_like(ids, dtype=torch.bool)
            feats = t5(input_ids=ids).last_hidden_state
            lc = net(feats, mask, inputs, T.SCHEDULE, T.ROPE_GRID)[0].reshape(len(bits), -1)
            lu = net(net.cfg_uncond[:ids.shape[1]][None], mask, inputs, T.SCHEDULE, T.ROPE_GRID)
            rows.append((ids[0].tolist(), lc, lu[0].reshape(len(bits), -1)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="train.py's --out, after its export stage")
    ap.add_argument("--lib", default=os.path.join(ROOT, "build", "libarengine.a"))
    ap.add_argument("--cc", default=os.environ.get("CC", "cc"))
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args(argv)
    import train as T

    with open(os.path.join(a.out, "model", "arserve.json")) as f:
        d = json.load(f)["image"]["bits"]
    L = sum(h * w for h, w in T.SCHEDULE)
    bits = torch.randint(0, 2, (L, d), generator=torch.Generator().manual_seed(7))
    captions = ["a red circle on the left", "two green triangles"]
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "harness")
        U.compile_harness(a.cc, HARNESS, a.lib, exe)
        bits.numpy().astype(np.int32).tofile(os.path.join(tmp, "bits.bin"))
        for ids, lc, lu in torch_logits(a.out, captions, bits):
            np.asarray(ids, np.int32).tofile(os.path.join(tmp, "ids.bin"))
            res = os.path.join(tmp, "logits.bin")
            subprocess.run([exe, os.path.join(a.out, "model"), os.path.join(tmp, "ids.bin"), str(len(ids)),
                            os.path.join(tmp, "bits.bin"), res], check=True)
            got, at, tok = np.fromfile(res, np.float32), 0, 0  # floats read, tokens done
            for h, w in T.SCHEDULE:
                step = got[at:at + 2 * h * w * 2 * d].reshape(2, h * w, 2 * d)  # cond, uncond
                rows = slice(tok, tok + h * w)
                worst = max(worst, float(np.abs(step[0] - lc[rows].numpy()).max()),
                            float(np.abs(step[1] - lu[rows].numpy()).max()))
                at, tok = at + step.size, tok + h * w
    print("check_engine: %d captions x %d tokens x 2 rows, teacher-forced: arserve's logits within "
          "%.3g of torch's (tolerance %g)" % (len(captions), L, worst, a.tol))
    return 0 if worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
