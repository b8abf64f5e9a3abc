"""A model's card (arserve.json) sets each policy's budget on that model
("kv_budgets"): every shipped model runs every policy it lists at the budget
a request without kv_budget gets, and a card budget the model cannot run at is
refused when the model loads, naming the file and the key."""
import json
import os
import shutil
import subprocess

import pytest

from conftest import ARSERVE_BIN, capacity_cells, clean_env, repo_path, scaled

SHIPPED_MODELS = [repo_path(f"models/{m}") for m in ("shapes", "shapes-var", "shapes-inf")]
GEN = "/v1/images/generations"


@pytest.mark.parametrize("model", SHIPPED_MODELS, ids=os.path.basename)
def test_every_listed_policy_runs_at_its_default_budget(start_daemon, model):
    d = start_daemon(model)
    card = d.client.get("/v1/models").json()["data"][0]["arserve"]
    with open(os.path.join(model, "arserve.json")) as f:
        own = json.load(f).get("kv_budgets", {})
    cells = capacity_cells(d.stderr())
    body = {"prompt": "a red circle"} if card["conditioning"] == "text" else {"class_label": 1}
    for p in card["kv_policies"]:
        name = p["name"]
        assert "n/a" not in cells[name], f"{name}: the start-up line says {cells[name]!r}"
        if "budget" in p:
            assert p["budget"] >= p["min_budget"], (name, p)
            assert p["budget"] == own.get(name, p["budget"]), (name, p, own)
        r = d.client.post(GEN, json={**body, "kv_policy": name, "seed": 3})
        assert r.status_code == 200, (name, r.text)
        kv = r.json()["kv_cache"]
        assert kv["policy"] == name
        if "budget" in p:
            assert kv["budget"] == p["budget"], (name, kv)


def card_with(tmp_path, model, budgets):
    """A copy of a shipped model whose card says kv_budgets."""
    out = tmp_path / os.path.basename(model)
    shutil.copytree(model, out)
    cfg = json.loads((out / "arserve.json").read_text())
    cfg["kv_budgets"] = budgets
    (out / "arserve.json").write_text(json.dumps(cfg))
    return str(out)


@pytest.mark.parametrize("model, budgets, want", [
    ("shapes", {"linear": 0.1},
     "'kv_budgets.linear' is 0.1, below 0.25, the least budget linear runs at on this model"),
    ("shapes", {"heatkv": 0.2},
     "'kv_budgets.heatkv': kv_policy heatkv does not apply to raster models"),
    ("shapes-var", {"linear": 0.5},
     "'kv_budgets.linear': kv_policy linear does not apply to next-scale models"),
])
def test_a_card_budget_the_model_cannot_run_is_refused_at_load(tmp_path, model, budgets, want):
    m = card_with(tmp_path, repo_path(f"models/{model}"), budgets)
    ask = ["--prompt", "a"] if model == "shapes" else ["--class", "1"]
    for cmd in (["serve", "--port", "0"], ["generate", *ask, "-o", str(tmp_path / "x.png")]):
        p = subprocess.run([ARSERVE_BIN, *cmd, "--model", m], capture_output=True, text=True,
                           env=clean_env(), timeout=scaled(60))
        assert p.returncode != 0, (cmd, p.stderr)
        assert f"{m}/arserve.json: {want}" in p.stderr, (cmd, p.stderr)


def test_generate_takes_the_cards_budget(tmp_path):
    """`arserve generate --kv-policy linear` on models/shapes runs at the card's
    0.25 (the policy's own 1/6 is too small for its 16 x 16 grid)."""
    p = subprocess.run([ARSERVE_BIN, "generate", "--model", repo_path("models/shapes"),
                        "--prompt", "a red circle", "--kv-policy", "linear", "-v",
                        "-o", str(tmp_path / "x.png")], capture_output=True, text=True,
                       env=clean_env(), timeout=scaled(60))
    assert p.returncode == 0, p.stderr
    assert "linear" in p.stderr and "0.25" in p.stderr, p.stderr
