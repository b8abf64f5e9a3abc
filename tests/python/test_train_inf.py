"""tools/train/inf/model.py (the Infinity architecture the shapes-inf demo trains) against the
official code's outputs in tests/golden/infinity_tiny: with the folder's released-format
weights loaded by name (strict), the teacher-forced logits of both CFG rows at 1:1 and at
h/w 0.5, the next-scale inputs and latents from the bits, the decoded image and the T5
encoder's output. Then tools/train/inf/train.py at its --tiny size: every stage, a second run
with more steps continuing from the checkpoints, the export converted, and (given the arserve
binary) arserve's engine on the converted directory giving torch's teacher-forced logits
(tools/train/inf/check_engine.py) and drawing an image. Needs torch and transformers, so it runs under
the bench venv:

    .venv-bench/bin/python tests/python/test_train_inf.py [build/arserve]
        (part of make test-bench-smoke)

Under pytest without torch (make test-python's .venv) it is skipped, saying so.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "golden", "infinity_tiny")
try:
    import torch
except ImportError:
    torch = None
    REASON = "torch is not installed in %s (the bench venv has it)" % sys.executable
    if __name__ == "__main__":
        print("SKIP test_train_inf.py: " + REASON)
        sys.exit(0)
    import pytest

    pytestmark = pytest.mark.skip(reason=REASON)

LOGIT_TOL = 1e-4


def _setup():
    sys.path.insert(0, os.path.join(ROOT, "tools", "train", "inf"))
    import model as M
    from safetensors.numpy import load_file

    gold = {k: torch.from_numpy(v) for k, v in load_file(os.path.join(GOLDEN, "golden.safetensors")).items()}
    with open(os.path.join(GOLDEN, "arserve.json")) as f:
        sizes = {s["name"]: s for s in json.load(f)["image"]["sizes"]}
    return M, gold, sizes


def _transformer(M):
    net = M.Infinity(C=64, depth=2, H=2, d=8, text_channels=256, text_maxlen=16, chunks=2)
    sd = torch.load(os.path.join(GOLDEN, "official", "infinity.pth"), map_location="cpu", weights_only=True)
    net.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return net.eval()


def _worst(a, b):
    return float((a - b).abs().max())


def test_teacher_forced_logits_match_the_official_code():
    M, gold, sizes = _setup()
    net = _transformer(M)
    for case, size in (("tf", "64x64"), ("tf_wide", "88x44")):
        sched = [tuple(s) for s in sizes[size]["scales"]]
        grid = tuple(sizes[size]["rope_grid"])
        feats = gold["t5_out_0"][None]
        n = feats.shape[1]
        mask = torch.ones(1, n, dtype=torch.bool)
        inputs = gold["%s_input_0" % case][None]
        with torch.no_grad():
            cond = net(feats, mask, inputs, sched, grid).reshape(-1, 16)
            uncond = net(net.cfg_uncond[:n][None], mask, inputs, sched, grid).reshape(-1, 16)
            neg_feats = gold["t5_out_neg"][None]
            neg = net(neg_feats, torch.ones(1, neg_feats.shape[1], dtype=torch.bool), inputs, sched, grid)
        errs = (_worst(cond, gold["%s_logits_cond_0" % case]),
                _worst(uncond, gold["%s_logits_uncond_0" % case]),
                _worst(neg.reshape(-1, 16), gold["%s_logits_neg_0" % case]))
        print("%s: logits within %.3g (cond), %.3g (learned uncond), %.3g (negative prompt)" % ((case,) + errs))
        assert max(errs) <= LOGIT_TOL, (case, errs)


def test_next_scale_inputs_and_latents_match():
    M, gold, sizes = _setup()
    sched = [tuple(s) for s in sizes["64x64"]["scales"]]
    inputs, fhats = M.next_scale_inputs(gold["tf_bits_0"][None].long(), sched)
    e_in = _worst(inputs[0], gold["tf_input_0"])
    e_f = _worst(torch.stack([f[0] for f in fhats]), gold["tf_fhat_0"])
    print("next-scale inputs within %.3g, f_hat within %.3g" % (e_in, e_f))
    assert e_in <= 2e-6 and e_f <= 2e-6


def test_decoder_and_t5_match():
    M, gold, _ = _setup()
    dec = M.Decoder(d=8, base=32, mult=[2, 1, 1], num_res_blocks=1, patch=4)
    sd = torch.load(os.path.join(GOLDEN, "official", "vae.pth"), map_location="cpu", weights_only=True)["vae"]
    dec.load_state_dict({k[len("decoder."):]: v.float() for k, v in sd.items() if k.startswith("decoder.")},
                        strict=True)
    with torch.no_grad():
        img = dec.eval()(gold["tf_fhat_0"][-1][None]).clamp(-1, 1)[0]
    e_img = _worst(img, gold["tf_image_0"])
    from transformers import T5EncoderModel

    t5 = T5EncoderModel.from_pretrained(os.path.join(GOLDEN, "official", "t5")).float().eval()
    with torch.no_grad():
        out = t5(input_ids=gold["t5_ids_0"][None].long()).last_hidden_state[0]
    e_t5 = _worst(out, gold["t5_out_0"])
    print("decoded image within %.3g, T5 output within %.3g" % (e_img, e_t5))
    assert e_img <= 1e-4 and e_t5 <= 1e-4


def grown_from_the_model(train, model, cfg, t5, net):
    """--set init_depth: the exported model's blocks first, the new ones after them adding
    nothing yet, so the deeper transformer's logits are the model's; its T5 is the model's."""
    import model as M

    deeper = dict(cfg, depth=cfg["depth"] + 2, init_depth=cfg["depth"])
    t5_big, big = train.make_lm(deeper, len(train.tokenizer_json()["model"]["vocab"]))
    train.load_init(model, deeper, t5_big, big)
    for k, v in t5.state_dict().items():
        assert torch.equal(t5_big.state_dict()[k], v), "grown: T5's %s is not the model's" % k
    gen = torch.Generator().manual_seed(4)
    feats, mask = torch.randn(2, 5, cfg["text_channels"], generator=gen), torch.ones(2, 5, dtype=torch.bool)
    bits = torch.randint(0, 2, (2, sum(h * w for h, w in train.SCHEDULE), cfg["d"]), generator=gen)
    inputs, _ = M.next_scale_inputs(bits, train.SCHEDULE)
    with torch.no_grad():
        want = net(feats, mask, inputs, train.SCHEDULE, train.ROPE_GRID)
        got = big(feats, mask, inputs, train.SCHEDULE, train.ROPE_GRID)
    assert len(big.blocks()) == len(net.blocks()) + 2
    assert torch.equal(got, want), "grown: logits differ from the model's by %g" % (got - want).abs().max()


def exported_model_continues(train, out, again):
    """--init: an exported model read back into torch is the model (exported again, the same
    bytes); the vae stage under --init trains an encoder and leaves the exported decoder as it
    is; a caption mix is taken by name and a bad one refused."""
    import contextlib
    import io

    from safetensors.torch import load_file

    model = os.path.join(out, "model")
    cfg = dict(train.TINY)
    vocab = train.tokenizer_json()["model"]["vocab"]
    t5, net = train.make_lm(cfg, len(vocab))
    vae = train.BSQVAE(cfg)
    train.load_exported(model, cfg, t5=t5, net=net, decoder=vae.decoder)
    os.makedirs(os.path.join(again, "vae"))
    os.makedirs(os.path.join(again, "lm"))
    torch.save({"models": [vae.state_dict()]}, os.path.join(again, "vae", "ckpt.pt"))
    torch.save({"models": [t5.state_dict(), net.state_dict()]}, os.path.join(again, "lm", "ckpt.pt"))
    assert train.main(["--out", again, "--tiny", "--stages", "export"]) == 0
    first, second = (load_file(os.path.join(d, "model.safetensors")) for d in (model, os.path.join(again, "model")))
    assert sorted(first) == sorted(second)
    for k in first:
        assert torch.equal(first[k], second[k]), "%s: not the exported model's" % k

    cont = os.path.join(again, "continued")
    mix = '{"plain": 2, "one": 1}'
    assert train.main(["--out", cont, "--tiny", "--init", model, "--stages", "vae,lm", "--set",
                       "lm_mix=" + mix, "--set", 'lm_default_colour="black"', "--set",
                       'lm_default_position="centre"', "--set", 'lm_default_pair=["left", "right"]']) == 0
    ck = torch.load(os.path.join(cont, "vae", "ckpt.pt"), weights_only=False)["models"][0]
    dec = {k[len("decoder."):]: v for k, v in ck.items() if k.startswith("decoder.")}
    for k, v in vae.decoder.state_dict().items():
        assert torch.equal(dec[k], v), "--init: the vae stage changed the exported decoder (%s)" % k
    torch.manual_seed(1)  # as train.main seeds before the stages: the encoder it started from
    enc = train.BSQVAE(cfg).encoder.state_dict()
    assert any(not torch.equal(ck["encoder." + k], v) for k, v in enc.items()), "the encoder did not train"
    grown_from_the_model(train, model, cfg, t5, net)
    for bad, named in (('lm_mix={"four": 1}', "four"), ('lm_default_colour="mauve"', "mauve"),
                       ("init_depth=3", "init_depth"),
                       ('lm_default_pair=["left", "left"]', "two different places"),
                       ('lm_default_pair="left"', "two different places")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                train.main(["--out", cont, "--tiny", "--set", bad])
                raise AssertionError("--set %s was accepted" % bad)
            except SystemExit as e:
                said = err.getvalue()
                assert e.code == 2 and bad.split("=")[0] in said and named in said, said


def test_tiny_training_to_a_model_arserve_serves(tmp_path=None):
    import tempfile

    if tmp_path is None:
        with tempfile.TemporaryDirectory(prefix="train-inf-") as tmp:
            return test_tiny_training_to_a_model_arserve_serves(tmp)
    import subprocess

    import contextlib
    import io

    sys.path.insert(0, os.path.join(ROOT, "tools", "train", "inf"))
    import train
    import train_util as U

    out = str(tmp_path)
    args = ["--out", out, "--tiny"]
    assert train.main(args + ["--stages", "vae,lm", "--set", "lm_steps=2"]) == 0
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # a time limit: one step, its checkpoint, exit 75
        assert train.main(args + ["--set", "lm_steps=4", "--max-minutes", "1e-9"]) == U.EXIT_TIME_LIMIT
    stop = [line for line in said.getvalue().splitlines() if "stopped at step 3 of 4" in line]
    assert stop and stop[0].endswith("the same command continues"), said.getvalue()  # no --resume here
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert train.main(args + ["--set", "lm_steps=4"]) == 0
    assert "lm from step 3 of 4" in said.getvalue(), said.getvalue()  # continued, not restarted
    assert "vae from step" not in said.getvalue()  # the finished stage is not run again
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train_fingerprints

    bad = train_fingerprints.differences("tiny-inf", os.path.join(out, "model"))
    assert not bad, "not the weights recorded before the shared loop: %s" % "; ".join(bad[:4])
    with open(os.path.join(out, "model", "arserve.json")) as f:
        manifest = json.load(f)
    assert manifest["architecture"] == "infinity" and manifest["image"]["default_size"] == "64x64"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            train.main(args + ["--set", "no_such=1"])
            raise AssertionError("an unknown --set was accepted")
        except SystemExit as e:
            assert e.code == 2 and "no such setting" in err.getvalue(), err.getvalue()
    exported_model_continues(train, out, os.path.join(out, "again"))
    arserve = os.environ.get("ARSERVE_BIN") or (sys.argv[1] if len(sys.argv) > 1 else "")
    if not arserve:
        print("skip: the engine's logits and drawing with the tiny model (no arserve binary given)")
        return
    import check_engine

    lib = os.path.join(os.path.dirname(os.path.abspath(arserve)), "libarengine.a")
    assert check_engine.main(["--out", out, "--lib", lib]) == 0, "arserve's logits are not torch's"
    png = os.path.join(out, "x.png")
    run = subprocess.run([arserve, "generate", "--model", os.path.join(out, "model"), "--prompt",
                          "a red circle on the left", "-o", png], capture_output=True, text=True)
    assert run.returncode == 0 and os.path.getsize(png) > 0, run.stdout + run.stderr
    print("tiny shapes-inf: trained, resumed, converted, drawn:", (run.stdout + run.stderr).strip())


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
            print("ok", name)
