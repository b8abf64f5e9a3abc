"""bench/ref_var.py and bench/ref_infinity.py, the benches beside the official code, without the
official code (which is not in this repository): their arserve halves on the shipped VAR- and
Infinity-architecture models, the table of both precisions with each scale's seconds, and a
clear refusal when the official side has no checkout to import."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import ref_var  # noqa: E402

ARSERVE = os.environ.get("ARSERVE_BIN", os.path.join(ROOT, "build", "arserve"))
SHAPES_VAR = os.path.join(ROOT, "models", "shapes-var")


def test_sides_picks_the_rows_and_refuses_others(capsys):
    """--sides: only the rows named run (an emulated official bf16 can take 40 minutes);
    a row that is not one is refused by name before anything runs."""
    assert ref_var.main([ROOT, SHAPES_VAR, "--arserve", ARSERVE, "--arserve-only", "--reps", "1",
                         "--label", "0", "--sides", "arserve:bf16,official:bf16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[1] for line in out if line.startswith("| arserve |")] == ["bf16"], out
    with pytest.raises(SystemExit, match="--sides arserve:f16"):
        ref_var.main([ROOT, SHAPES_VAR, "--arserve", ARSERVE, "--arserve-only", "--sides", "arserve:f16"])


def test_arserve_half_times_every_scale_in_both_precisions(capsys):
    assert ref_var.main([ROOT, SHAPES_VAR, "--arserve", ARSERVE, "--arserve-only", "--reps", "1",
                         "--label", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split(" | ") for line in out if line.startswith("| arserve |")]
    assert [r[1] for r in rows] == ["f32", "bf16"], out
    n_scales = len(ref_var.json.load(open(os.path.join(SHAPES_VAR, "arserve.json")))["image"]
                   ["scales"])
    for r in rows:
        steps, decoder, image = (float(v) for v in r[2:5])
        assert image == pytest.approx(steps + decoder, abs=0.011)
        assert len(r[5].rstrip(" |").split()) == n_scales


def test_time_line_parsed_and_checked():
    line = "x\ntime: 3 steps 0.60 s (0.10 0.20 0.30), decoder and PNG 0.40 s\nbackend cpu\n"
    assert ref_var.parse_time_line(line) == {"steps_s": 0.6, "decoder_s": 0.4, "total_s": 1.0,
                                             "scales_s": [0.1, 0.2, 0.3]}
    with pytest.raises(ValueError, match="2 scales for 3 steps"):
        ref_var.parse_time_line("time: 3 steps 0.60 s (0.10 0.20), decoder and PNG 0.40 s")
    with pytest.raises(ValueError, match="no time line"):
        ref_var.parse_time_line("nothing")


def test_official_side_without_a_checkout_is_refused():
    env = {k: v for k, v in os.environ.items() if k != "VAR_SRC"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ref_var.py"), ROOT,
                        SHAPES_VAR], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and "$VAR_SRC" in p.stderr, p.stderr


SHAPES_INF = os.path.join(ROOT, "models", "shapes-inf")


def test_infinity_bench_arserve_half(capsys):
    """bench/ref_infinity.py, Infinity's, on the same helpers: its arserve half on the shipped
    Infinity-architecture model."""
    import ref_infinity
    assert ref_infinity.main([ROOT, SHAPES_INF, "--arserve", ARSERVE, "--arserve-only", "--reps",
                              "1", "--prompt", "a red circle"]) == 0
    out = capsys.readouterr().out
    assert [r.split(" | ")[1] for r in out.splitlines() if r.startswith("| arserve |")] == \
        ["f32", "bf16"], out


def test_infinity_official_side_without_a_checkout_is_refused():
    env = {k: v for k, v in os.environ.items() if k != "INFINITY_SRC"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ref_infinity.py"), ROOT,
                        SHAPES_INF], capture_output=True, text=True, env=env, timeout=60,
                       cwd=os.path.join(ROOT, "bench"))
    assert p.returncode == 2 and "$INFINITY_SRC" in p.stderr, p.stderr


def test_infinity_bench_batch_and_isa_per_image():
    """--batch 2 times arserve through speed_bench beside the binary and gives per-image figures
    (every scale, the image at least its steps and decoder); --isa avx2 is named in the heading.
    A process of its own: --isa sets the environment."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ref_infinity.py"), ROOT,
                        SHAPES_INF, "--arserve", os.path.abspath(ARSERVE), "--arserve-only",
                        "--reps", "1", "--batch", "2", "--isa", "avx2"], capture_output=True,
                       text=True, timeout=600, cwd=os.path.join(ROOT, "bench"))
    assert p.returncode == 0, p.stderr
    assert "batch 2, avx2 forced, per image" in p.stdout, p.stdout
    rows = [line.split(" | ") for line in p.stdout.splitlines() if line.startswith("| arserve |")]
    assert [r[1] for r in rows] == ["f32", "bf16"], p.stdout
    scales = [[float(t) for t in r[5].rstrip(" |").split()] for r in rows]
    for r, sc in zip(rows, scales):
        steps, decoder, image = (float(v) for v in r[2:5])
        assert 0 < steps and 0 < decoder and image >= 0.8 * (steps + decoder), r
        # Each figure is printed to 0.01 s: the scales' sum and the steps' total can part by
        # half a hundredth per figure (7 scales: 0.04 s; 0.02 failed once on shapes-inf).
        rounding = 0.005 * (len(sc) + 1) + 1e-9
        assert len(sc) == len(scales[0]) > 1 and sum(sc) == pytest.approx(steps, abs=rounding), r


def test_batch_below_one_is_refused():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ref_var.py"), ROOT,
                        SHAPES_VAR, "--arserve-only", "--batch", "0"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode != 0 and "--batch 0" in p.stderr, p.stderr


def test_a_side_that_fails_is_reported_and_the_others_run():
    """The official code failing (as PyTorch 2.15's did under --isa avx2: NaN probabilities)
    loses that side's row only: its error in the table, the others' medians kept."""
    calls = []

    def run(side, prec):
        calls.append((side, prec))
        if side == "official" and prec == "f32":
            raise RuntimeError("traceback ...\nprobability tensor contains either `inf`, `nan`")
        return {"steps_s": 1.0, "decoder_s": 0.5, "total_s": 1.5, "scales_s": [0.4, 0.6]}

    sides = [("arserve", "f32"), ("official", "f32")]
    rows = ref_var.alternate(sides, 2, run, "t")
    assert calls.count(("official", "f32")) == 1 and calls.count(("arserve", "f32")) == 3
    assert rows[("official", "f32")] == {"failed": "RuntimeError: probability tensor contains "
                                                   "either `inf`, `nan`"}
    assert rows[("arserve", "f32")]["total_s"] == 1.5
    out = ref_var.table(rows)
    assert "| official | f32 | failed: RuntimeError: probability" in out and "x the official" \
        not in out, out


def test_isa_sets_both_sides_environment(monkeypatch):
    """--isa avx2 sets what arserve's processes and PyTorch read, before torch loads."""
    env = {}
    monkeypatch.setattr(ref_var.os, "environ", env)
    ref_var.setup(ref_var.argparse.Namespace(batch=1, isa="avx2", sides="arserve:f32"))
    assert env == {"ARSERVE_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                   "ONEDNN_MAX_CPU_ISA": "AVX2"}
    env.clear()
    ref_var.setup(ref_var.argparse.Namespace(batch=1, isa=None, sides="arserve:f32"))
    assert env == {}
