"""The training pipeline (tools/train/pipeline.py) end to end at its --tiny size on the CPU:
both demo models from nothing to a model directory, a run stopped by its time limit and run
again continues from its checkpoint (not from scratch) to the same weights as an unbroken run,
and bad flags are refused; given the arserve binary, each tiny model directory draws an image
with it. Needs torch, so it runs under the bench venv:

    .venv-bench/bin/python tests/python/test_train_pipeline.py [build/arserve]
        (make test-train-pipeline, part of make test-bench-smoke)

Under pytest without torch (make test-python's .venv) it is skipped, saying so.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import torch
except ImportError:
    torch = None
    REASON = "torch is not installed in %s (the bench venv has it: make test-train-pipeline)" % sys.executable
    if __name__ == "__main__":
        print("SKIP test_train_pipeline.py: " + REASON)
        sys.exit(0)
    import pytest
    pytest.skip(REASON, allow_module_level=True)

sys.path.insert(0, os.path.join(ROOT, "tools", "train"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_fingerprints
import numpy as np  # noqa: E402
import pipeline  # noqa: E402
import tokenize_shapes  # noqa: E402
from train_util import EXIT_TIME_LIMIT  # noqa: E402

STEPS = 6  # the --tiny training stages' --steps
ARSERVE = None  # the binary, when the command line names one


def run(args):
    """pipeline.main(args) with its output held back: (exit status, output)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            rc = pipeline.main(args + ["--device", "cpu", "--threads", "1"])
        except SystemExit as e:
            rc = e.code
        except Exception:
            print(buf.getvalue()[-4000:])
            raise
    return rc, buf.getvalue()


def ckpt(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def same_weights(a, b):
    sa, sb = ckpt(a)["model"], ckpt(b)["model"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def arserve_generate(model_dir, png, args):
    """arserve generate on one thread, seed 1, into png; fails the test on a non-zero exit."""
    r = subprocess.run([ARSERVE, "generate", "--model", model_dir, "--seed", "1", "--threads", "1", "--quiet",
                        "--output", png] + args, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


def draws_with_arserve(model_dir):
    """arserve generate loads the exported directory and writes a PNG (when ARSERVE is set)."""
    if ARSERVE is None:
        print("skip: no arserve binary named on the command line; the model is not served")
        return
    png = os.path.join(model_dir, "..", "a-red-circle.png")
    arserve_generate(model_dir, png, ["--prompt", "a red circle"])
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def engine_decodes_as_torch(ref):
    """check_vq_engine.py: arserve's VQ decoder, compiled into a harness against the engine
    library beside the binary, decodes the tiny run's tokens as torch does."""
    if ARSERVE is None:
        print("skip: no arserve binary named on the command line; no engine library to check")
        return
    import check_vq_engine

    lib = os.path.join(os.path.dirname(os.path.abspath(ARSERVE)), "libarengine.a")
    assert check_vq_engine.main(["--ckpt", os.path.join(ref, "vq", "ckpt.pt"), "--val",
                                 os.path.join(ref, "data", "val"), "--lib", lib, "--n", "2"]) == 0


def tokens_from_the_codebook_alone(ref, out):
    """tokenize_shapes --codebook (no checkpoint) gives the tokens the pipeline got from its
    decoder's checkpoint."""
    with contextlib.redirect_stdout(io.StringIO()):
        rc = tokenize_shapes.main(["--codebook", os.path.join(ref, "codebook.npz"),
                                   "--data", os.path.join(ref, "data", "train"), "--out", out, "--batch", "5"])
    assert rc in (None, 0), rc
    with np.load(out) as got, np.load(os.path.join(ref, "tokens-train.npz")) as want:
        assert got["tokens"].dtype == want["tokens"].dtype
        assert (got["tokens"] == want["tokens"]).all(), "the code book's tokens differ from the checkpoint's"
        assert (got["captions"] == want["captions"]).all()


def continues_from_export(ref, out):
    """train_lm.py --init starts from an exported model's LM: one step at learning rate 0 keeps
    exactly the exported weights; another size is refused, naming a tensor."""
    import pipeline as P
    import train_lm
    from safetensors.torch import load_file

    llm = P.TINY["lm"][P.TINY["lm"].index("--llm") + 1]
    args = ["--tokens", os.path.join(ref, "tokens-train.npz"), "--val-tokens", os.path.join(ref, "tokens-val.npz"),
            "--out", out, "--codebook-size", str(ckpt(os.path.join(ref, "lm", "ckpt.pt"))["image"]["codebook_size"]),
            "--init", os.path.join(ref, "model"), "--batch", "2", "--steps", "1", "--lr", "0", "--device", "cpu"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_lm.main(args + ["--llm", llm]) == 0
    stored = load_file(os.path.join(ref, "model", "lm.safetensors"))
    got = ckpt(os.path.join(out, "ckpt.pt"))["model"]
    for k, v in stored.items():
        assert torch.equal(got[k], v.float()), "--init: %s is not the exported tensor" % k
    shutil.rmtree(out)
    wider = llm.replace('"hidden_size": 32', '"hidden_size": 48')
    assert wider != llm
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            train_lm.main(args + ["--llm", wider])
            raise AssertionError("--init into another size was accepted")
        except SystemExit as e:
            assert "--init" in str(e) and "differs" in str(e), e
    grows_from_export(args, llm, stored, out)


def grows_from_export(args, llm, stored, out):
    """train_lm.py --init-depth: the exported layers first, the new ones after them adding
    nothing (their output projections zero), so the deeper model's logits equal the exported
    one's; a depth the exported model does not have is refused."""
    import train_lm
    from lm_model import JanusLM

    d0 = json.loads(llm)["num_layers"]
    deeper = json.dumps(dict(json.loads(llm), num_layers=d0 + 2))
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_lm.main(args + ["--llm", deeper, "--init-depth", str(d0)]) == 0
    ck = ckpt(os.path.join(out, "ckpt.pt"))
    for k, v in stored.items():
        assert torch.equal(ck["model"][k], v.float()), "--init-depth: %s is not the exported tensor" % k
    big = JanusLM(ck["llm"], ck["image"])
    big.load_state_dict(ck["model"])
    small = JanusLM(dict(ck["llm"], num_layers=d0), ck["image"])
    small.load_state_dict({k: v.float() for k, v in stored.items()})
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, ck["llm"]["vocab_size"], (2, 5), generator=gen)
    valid = torch.ones(2, 5, dtype=torch.bool)
    image = torch.randint(0, ck["image"]["codebook_size"], (2, 6), generator=gen)
    with torch.no_grad():
        want, have = small(ids, valid, image), big(ids, valid, image)
    assert torch.equal(want, have), "grown logits differ by %g" % float((want - have).abs().max())
    shutil.rmtree(out)
    for bad in (["--llm", deeper, "--init-depth", str(d0 + 1)], ["--llm", llm, "--init-depth", str(d0 + 1)]):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                train_lm.main(args + bad)
                raise AssertionError("%s was accepted" % bad)
            except SystemExit as e:
                assert e.code == 2 or "--init" in str(e), e


def checkpoints_by_wall_time(ref, out):
    """--ckpt-minutes writes ckpt.pt by the clock between the step-based saves: with a tiny
    one and --ckpt-every far off, every step is saved."""
    import train_lm

    saves = []
    real_save = train_lm.save

    def spy(path, obj):
        saves.append((os.path.basename(path), obj["step"]))
        real_save(path, obj)

    train_lm.save = spy
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            rc = train_lm.main(["--tokens", os.path.join(ref, "tokens-train.npz"), "--val-tokens",
                                os.path.join(ref, "tokens-val.npz"), "--out", out, "--codebook-size", "41",
                                "--llm", '{"hidden_size": 16, "num_layers": 1, "num_heads": 1, "num_kv_heads": 1, '
                                '"head_dim": 16, "intermediate_size": 32}', "--batch", "2", "--steps", "4",
                                "--device", "cpu", "--ckpt-every", "1000", "--eval-every", "1000",
                                "--ckpt-minutes", "0.000001"])
    finally:
        train_lm.save = real_save
    assert rc == 0
    assert saves == [("ckpt.pt", s) for s in (1, 2, 3, 4)], saves


def check_stopped_then_resumed(out, stage, model, tail, extra=()):
    """One run at a tiny --max-minutes stops in `stage` after its first step (status 75,
    checkpoint written); the same command again makes at least one step more, starting from
    that checkpoint; without the limit it finishes."""
    limited = ["--model", model, "--tiny", "--out", out, "--max-minutes", "0.0001"] + list(extra)
    rc, log = run(limited)
    assert rc == EXIT_TIME_LIMIT, (rc, log[-2000:])
    assert "time limit" in log and "run the same command again" in log, log[-1000:]
    first = ckpt(os.path.join(out, stage, "ckpt.pt"))["step"]
    assert 1 <= first < STEPS, first
    assert not os.path.exists(os.path.join(out, "model")), "exported before training finished"
    rc, log = run(limited)
    assert rc == EXIT_TIME_LIMIT, (rc, log[-2000:])
    second = ckpt(os.path.join(out, stage, "ckpt.pt"))["step"]
    assert first < second < STEPS, (first, second)
    rc, log = run(["--model", model, "--tiny", "--out", out] + list(extra))
    assert rc == 0, (rc, log[-2000:])
    with open(os.path.join(out, stage, "train.log")) as f:
        trainlog = f.read()
    assert trainlog.count("start: args") == 1, "the stage started again from scratch"
    for step in (first, second):
        assert "resumed from %s at step %d" % (os.path.join(out, stage, "ckpt.pt"), step) in trainlog, trainlog
    assert "done at step %d" % STEPS in trainlog
    assert ckpt(os.path.join(out, stage, "ckpt.pt"))["step"] == STEPS
    for name in tail:
        assert os.path.getsize(os.path.join(out, "model", name)) > 0, name


def as_recorded(name, model_dir):
    """The tiny run exported the weights recorded before the families shared one loop
    (tests/python/train_fingerprints.py)."""
    import train_fingerprints

    bad = train_fingerprints.differences(name, model_dir)
    assert not bad, "%s: not the recorded weights: %s" % (name, "; ".join(bad[:4]))


def test_tiny_shapes_pipeline_stops_and_resumes_to_the_same_model():
    tmp = tempfile.mkdtemp(prefix="train-pipeline-")
    try:
        ref, out = os.path.join(tmp, "unbroken"), os.path.join(tmp, "stopped")
        rc, log = run(["--model", "shapes", "--tiny", "--out", ref])
        assert rc == 0, (rc, log[-2000:])
        for stage in ("data", "codebook", "vq", "tokens", "lm", "export"):
            assert "== %s:" % stage in log, stage
        draws_with_arserve(os.path.join(ref, "model"))
        as_recorded("tiny-shapes", os.path.join(ref, "model"))
        engine_decodes_as_torch(ref)
        tokens_from_the_codebook_alone(ref, os.path.join(tmp, "tokens-cb.npz"))
        checkpoints_by_wall_time(ref, os.path.join(tmp, "lm-timed"))
        continues_from_export(ref, os.path.join(tmp, "lm-continued"))
        # The stopped run encodes with the code book in 2 processes: the same tokens.
        check_stopped_then_resumed(out, "vq", "shapes",
                                   ["arserve.json", "lm.safetensors", "vq.safetensors", "tokenizer.json"],
                                   ["--workers", "2"])
        for stage in ("vq", "lm"):
            assert same_weights(os.path.join(ref, stage, "ckpt.pt"), os.path.join(out, stage, "ckpt.pt")), \
                "%s: the resumed run's weights differ from the unbroken run's" % stage
        for name in ("arserve.json", "lm.safetensors", "vq.safetensors", "tokenizer.json"):
            assert read(os.path.join(ref, "model", name)) == read(os.path.join(out, "model", name)), name
        # A finished pipeline under a spent budget: every stage returns at once, status 0.
        stamp = os.stat(os.path.join(out, "model", "lm.safetensors")).st_mtime_ns
        rc, log = run(["--model", "shapes", "--tiny", "--out", out, "--max-minutes", "0.0001",
                       "--copy-to", os.path.join(tmp, "copy")])
        assert rc == 0, (rc, log[-2000:])
        assert os.stat(os.path.join(out, "model", "lm.safetensors")).st_mtime_ns == stamp, "exported again"
        assert read(os.path.join(tmp, "copy", "model", "lm.safetensors")) == read(
            os.path.join(out, "model", "lm.safetensors"))
        assert os.path.exists(os.path.join(tmp, "copy", "vq", "train.log"))
        assert not os.path.exists(os.path.join(tmp, "copy", "vq", "ckpt.pt")), "checkpoints copied unasked"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def reads_8bit_export(model, var_want, out):
    """--init from a model tools/quantize.py made 8-bit (the shipped shapes-var is int8): each
    int8 weight is read as its values times its row's scale, within half a step of the exported
    tensor, and no scale is left over as a tensor of its own."""
    import export as export_var
    from safetensors.torch import load_file

    q = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "quantize.py"), "--dtype", "int8", model, out],
                       capture_output=True, text=True)
    assert q.returncode == 0, q.stderr
    scales = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            scales.update({k[len("var."):-len("_scale")]: v for k, v in load_file(os.path.join(out, f)).items()
                           if k.startswith("var.") and k.endswith("_scale")})
    assert scales, "quantize.py left the tiny VAR's weights as they were"
    got = export_var.load_exported(out)[1]
    assert sorted(got) == sorted(var_want), sorted(set(got) ^ set(var_want))
    for k, want in var_want.items():
        if k not in scales:
            assert torch.equal(got[k], want), "%s: not 8-bit, yet read back changed" % k
            continue
        step = scales[k].float()[:, None]
        assert bool(((got[k] - want).abs() <= step / 2 * 1.0001 + 1e-12).all()), "%s: not its int8 values times scale" % k


def var_continues_from_export(ref, out):
    """train_msvq.py --init trains an encoder for an exported model's decoder, code book and
    Phi, which stay the exported tensors; train_var.py --init on its tokens starts from the
    exported transformer (one step at learning rate 0 keeps it), with --default-colour drawing
    the classes that name none in it; another size is refused."""
    import export as export_var
    import pipeline as P
    import train_msvq
    import train_var

    model = os.path.join(ref, "model")
    vq_want, var_want = export_var.load_exported(model)
    cfg_at = P.TINY["msvq"].index("--config") + 1
    msvq = ["--out", os.path.join(out, "msvq"), "--init", model, "--config", P.TINY["msvq"][cfg_at],
            "--steps", "2", "--batch", "2", "--eval-every", "1000", "--final-eval-images", "2"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_msvq.main(msvq) == 0
    got = ckpt(os.path.join(out, "msvq", "ckpt.pt"))["model"]
    for k, v in vq_want.items():
        assert torch.equal(got[k], v), "train_msvq --init changed the exported %s" % k
    enc0 = ckpt(os.path.join(ref, "msvq", "ckpt.pt"))["model"]
    assert any(not torch.equal(got[k], v) for k, v in enc0.items() if k.startswith("encoder.")), "no encoder trained"
    var_cfg = P.TINY["var"][P.TINY["var"].index("--config") + 1]
    args = ["--vq", os.path.join(out, "msvq", "ckpt.pt"), "--out", os.path.join(out, "var"), "--init", model,
            "--n-train", "8", "--n-val", "4", "--steps", "1", "--batch", "2", "--lr", "0", "--default-colour", "black"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_var.main(args + ["--config", var_cfg]) == 0
    got = ckpt(os.path.join(out, "var", "ckpt.pt"))["model"]
    for k, v in var_want.items():
        assert torch.equal(got[k], v), "train_var --init: %s is not the exported tensor" % k
    with np.load(os.path.join(out, "var", "tokens-train.npz")) as z:
        assert str(z["default_colour"]) == "black"
    tokens_cached_per_stream(os.path.join(out, "msvq", "ckpt.pt"), os.path.join(out, "var"))
    reads_8bit_export(model, var_want, os.path.join(out, "int8"))
    shutil.rmtree(os.path.join(out, "var"))
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            train_var.main(args + ["--config", var_cfg.replace('"width": 32', '"width": 64')])
            raise AssertionError("--init into another width was accepted")
        except SystemExit as e:
            assert "--init" in str(e) and "differs" in str(e), e
    var_grows_from_export(model, var_want, args, var_cfg, out)


def tokens_cached_per_stream(vq_path, out):
    """train_var.py's token cache is reused only for the stream it was made from: the same
    file asked for another --data-seed is tokenised again, as a fresh file would be."""
    import train_var

    vq, log = train_var.load_vq(vq_path), os.path.join(out, "cache-test.log")
    cached, fresh = os.path.join(out, "tokens-train.npz"), os.path.join(out, "tokens-fresh.npz")
    with np.load(cached) as z:
        seed, n, old = int(z["seed"]), len(z["labels"]), z["codes"].copy()
    with contextlib.redirect_stdout(io.StringIO()):
        again = train_var.tokenize_set(vq, seed + 1, n, cached, log, default_colour="black")[1]
        want = train_var.tokenize_set(vq, seed + 1, n, fresh, log, default_colour="black")[1]
    assert (again == want).all() and not (again == old).all(), "another stream's tokens reused"


def var_grows_from_export(model, var_want, args, var_cfg, out):
    """train_var.py --init-depth: the exported model's blocks first, the new ones after them
    adding nothing (their output projections zero), so the deeper transformer's logits equal
    the model's; a depth the --init model does not have is refused by name."""
    import train_var
    from var_model import VAR

    d0 = int(var_cfg.split('"depth": ')[1].split(",")[0])
    deeper = var_cfg.replace('"depth": %d' % d0, '"depth": %d' % (d0 + 2))
    grown = args + ["--config", deeper, "--init-depth", str(d0)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_var.main(grown) == 0
    ck = ckpt(os.path.join(out, "var", "ckpt.pt"))
    got = ck["model"]
    for k, v in var_want.items():
        assert torch.equal(got[k], v), "train_var --init-depth: %s is not the exported tensor" % k
    big = VAR(ck["config"])
    big.load_state_dict(got)
    small = VAR(dict(ck["config"], depth=d0))
    small.load_state_dict(var_want)
    gen = torch.Generator().manual_seed(5)
    labels = torch.tensor([0, small.num_classes])
    x_in = torch.randn(2, small.L - small.first_l, ck["config"]["embed_dim"], generator=gen)
    with torch.no_grad():
        want, have = small(labels, x_in), big(labels, x_in)
    assert torch.equal(want, have), "grown logits differ by %g" % float((want - have).abs().max())
    assert float(got["blocks.%d.attn.qkv.weight" % d0].abs().sum()) > 0, "a new block left empty"
    shutil.rmtree(os.path.join(out, "var"))
    for bad in (["--config", deeper, "--init-depth", str(d0 + 1)],
                ["--config", var_cfg, "--init-depth", str(d0 + 2)]):
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                train_var.main(args + bad)
                raise AssertionError("%s was accepted" % bad)
            except SystemExit as e:
                assert "--init" in str(e), e


def test_tiny_var_pipeline_stops_and_resumes_to_the_same_model():
    tmp = tempfile.mkdtemp(prefix="train-pipeline-var-")
    try:
        ref, out = os.path.join(tmp, "unbroken"), os.path.join(tmp, "stopped")
        rc, log = run(["--model", "shapes-var", "--tiny", "--out", ref])
        assert rc == 0, (rc, log[-2000:])
        draws_with_arserve(os.path.join(ref, "model"))
        as_recorded("tiny-var", os.path.join(ref, "model"))
        var_continues_from_export(ref, os.path.join(tmp, "continued"))
        check_stopped_then_resumed(out, "msvq", "shapes-var",
                                   ["arserve.json", "classes.txt", "model-00001-of-00001.safetensors"])
        for stage in ("msvq", "var"):
            assert same_weights(os.path.join(ref, stage, "ckpt.pt"), os.path.join(out, stage, "ckpt.pt")), stage
        name = "model-00001-of-00001.safetensors"
        assert read(os.path.join(ref, "model", name)) == read(os.path.join(out, "model", name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def folded_adaln(shared):
    """The per-block VAR that a shared-AdaLN VAR is: each block's table is the shared Linear
    with the block's own rows added to its bias."""
    from var_model import VAR

    cfg = dict(shared.cfg, shared_adaln=False)
    sd = {k: v for k, v in shared.state_dict().items() if not k.startswith("shared_adaln.")}
    for i in range(cfg["depth"]):
        gss = sd.pop("blocks.%d.adaln_gss" % i)
        sd["blocks.%d.adaln.weight" % i] = shared.shared_adaln.weight.detach().clone()
        sd["blocks.%d.adaln.bias" % i] = shared.shared_adaln.bias.detach() + gss.flatten()
    folded = VAR(cfg)
    folded.load_state_dict(sd, strict=True)
    return folded.eval()


def greedy_png(model_dir, out):
    """arserve's greedy image of class 5, as int16 RGB."""
    from PIL import Image

    arserve_generate(model_dir, out, ["--class", "5", "--top-k", "1"])
    return np.asarray(Image.open(out).convert("RGB"), dtype=np.int16)


def test_shared_adaln_var_computes_and_serves_as_its_per_block_fold():
    """var_model's shared AdaLN (VAR's shared_aln: one table for every block plus each block's
    own rows, the smaller export) computes what the per-block model it folds into computes:
    in torch, and through export.py in arserve (the same greedy image)."""
    import data
    import export
    from msvq import DEFAULT_CFG as MSVQ_CFG
    from msvq import MSVQ
    from var_model import VAR

    torch.manual_seed(3)
    vq = MSVQ(dict(MSVQ_CFG, base_channels=32, channel_multiplier=[2, 1, 1, 1], encoder_widths=[32, 32, 32],
                   codebook_size=32)).eval()
    shared = VAR({"width": 32, "heads": 2, "depth": 2, "ffn": 64, "num_classes": data.NUM_CLASSES,
                  "scales": vq.cfg["scales"], "codebook_size": 32, "embed_dim": vq.cfg["embed_dim"],
                  "shared_adaln": True})
    with torch.no_grad():  # away from the damped start, so every table matters
        for p in shared.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    shared.eval()
    assert not any(k.startswith("blocks.0.adaln.") for k in shared.state_dict())
    folded = folded_adaln(shared)
    labels = torch.tensor([0, 5, data.NUM_CLASSES])
    x_in = torch.randn(3, shared.L - shared.first_l, vq.cfg["embed_dim"])
    with torch.no_grad():
        want, got = folded(labels, x_in), shared(labels, x_in)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    if ARSERVE is None:
        print("skip: no arserve binary named on the command line; the exports are not served")
        return
    tmp = tempfile.mkdtemp(prefix="train-var-shared-")
    try:
        torch.save({"model": vq.state_dict(), "config": vq.cfg}, os.path.join(tmp, "vq.pt"))
        images = []
        for name, var in (("shared", shared), ("folded", folded)):
            torch.save({"model": var.state_dict(), "config": var.cfg}, os.path.join(tmp, name + ".pt"))
            with contextlib.redirect_stdout(io.StringIO()):
                export.main(["--vq", os.path.join(tmp, "vq.pt"), "--var", os.path.join(tmp, name + ".pt"),
                             "--out", os.path.join(tmp, name)])
            images.append(greedy_png(os.path.join(tmp, name), os.path.join(tmp, name + ".png")))
        with open(os.path.join(tmp, "shared", "arserve.json")) as f:
            assert '"shared_adaln": true' in f.read()
        assert int(np.abs(images[0] - images[1]).max()) <= 1, np.abs(images[0] - images[1]).max()
        assert os.path.getsize(os.path.join(tmp, "shared", "model-00001-of-00001.safetensors")) < \
            os.path.getsize(os.path.join(tmp, "folded", "model-00001-of-00001.safetensors"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_prompt_rows_without_the_tokenizers_package_are_the_packages():
    """train_lm.word_level_ids, used where the tokenizers package is missing (a bare GPU
    machine), encodes every caption of a sample of the world as the package does."""
    import train_lm
    from tools.shapes import dataset

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        print("skip: the tokenizers package is not installed here; nothing to compare with")
        return
    records, _ = dataset.generate(5, 0, 300)
    captions = [r["caption"] for r in records] + ["A Red circle, left of: a blue square!"]
    tok = train_lm.tokenizer_json(64)
    with_package = train_lm.encode_prompts(tok, captions[:-1], use_package=True)
    without = train_lm.encode_prompts(tok, captions[:-1], use_package=False)
    assert with_package == without
    odd = train_lm.TEMPLATE.replace("{prompt}", captions[-1])
    from tokenizers import Tokenizer
    import json
    want = Tokenizer.from_str(json.dumps(tok)).encode(odd, add_special_tokens=False).ids
    assert train_lm.word_level_ids(tok, odd) == want


def test_bad_flags_are_refused():
    import train_lm

    def status(f, args):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                f(args)
            except SystemExit as e:
                return e.code, err.getvalue()
        return None, err.getvalue()

    code, msg = status(pipeline.main, ["--model", "shapes", "--stage-args", "msvq", "--steps 3"])
    assert code == 2 and "no stage 'msvq'" in msg, (code, msg)
    code, msg = status(pipeline.main, ["--model", "shapes", "--batch-mult", "0"])
    assert code == 2, (code, msg)
    base = ["--tokens", "x.npz", "--val-tokens", "y.npz", "--out", "z"]
    code, msg = status(train_lm.main, base + ["--max-minutes", "-1"])
    assert code == 2 and "--max-minutes" in msg, (code, msg)
    code, msg = status(train_lm.main, base + ["--device", "tpu"])
    assert code == 2 and "invalid choice" in msg, (code, msg)
    if not torch.cuda.is_available():
        code, msg = status(train_lm.main, base + ["--device", "cuda"])
        assert code == 2 and "no CUDA device" in msg, (code, msg)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "tests", "bench"))
    import bench_tests

    if len(sys.argv) > 1:
        ARSERVE = os.path.abspath(sys.argv[1])
        if not os.access(ARSERVE, os.X_OK):
            sys.exit("test_train_pipeline.py: %s is not an executable" % ARSERVE)

    sys.exit(bench_tests.run(globals()))
