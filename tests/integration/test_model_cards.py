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


# ---- words a model does not know -------------------------------------------------------------

def known_words(model):
    """What the model's tokenizer reads: its WordLevel vocabulary less the
    special tokens and the unknown one, in id order."""
    with open(os.path.join(model, "tokenizer.json")) as f:
        tok = json.load(f)
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    vocab = tok["model"]["vocab"]
    return [w for w, _ in sorted(vocab.items(), key=lambda kv: kv[1])
            if w not in special and w != tok["model"].get("unk_token")]


def test_unknown_words_are_named_in_every_answer(start_daemon):
    """A prompt with words models/shapes does not know is drawn, and the
    answer says which (synchronous, streamed and async alike); a prompt it
    knows has no warnings; GET /v1/models lists the words it knows."""
    from test_async_jobs import wait_job
    from test_streaming import read_sse
    model = repo_path("models/shapes")
    d = start_daemon(model)
    card = d.client.get("/v1/models").json()["data"][0]["arserve"]
    assert card["vocabulary"] == known_words(model)
    assert "cat" not in card["vocabulary"] and "circle" in card["vocabulary"]
    want = ("prompt: 3 words the model does not know were read as unknown: 'cat', 'sitting', "
            "'sofa' (GET /v1/models lists the words it knows)")
    body = {"prompt": "a cat sitting on a sofa", "seed": 1}
    r = d.client.post(GEN, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["warnings"] == [want]
    r = d.client.post(GEN, json={"prompt": "a red circle", "seed": 1})
    assert r.status_code == 200 and "warnings" not in r.json(), r.text
    done = [data for event, data in read_sse(d, {**body, "stream": True})
            if event == "image_generation.completed"]
    assert len(done) == 1 and done[0]["warnings"] == [want]
    r = d.client.post(GEN, json={**body, "async": True})
    assert r.status_code == 202, r.text
    job = wait_job(d, r.json()["id"], lambda j: j["status"] == "done", what="the async job")
    assert job["result"]["warnings"] == [want]


def test_an_unknown_word_in_the_negative_prompt_is_named(start_daemon):
    d = start_daemon(repo_path("models/shapes-inf"))
    r = d.client.post(GEN, json={"prompt": "a red circle", "negative_prompt": "blurry red",
                                 "seed": 1})
    assert r.status_code == 200, r.text
    assert r.json()["warnings"] == [
        "negative_prompt: 1 word the model does not know was read as unknown: 'blurry' "
        "(GET /v1/models lists the words it knows)"]


def test_generate_warns_of_unknown_words(tmp_path):
    p = subprocess.run([ARSERVE_BIN, "generate", "--model", repo_path("models/shapes"),
                        "--prompt", "a zebra", "-o", str(tmp_path / "x.png")],
                       capture_output=True, text=True, env=clean_env(), timeout=scaled(60))
    assert p.returncode == 0, p.stderr
    assert ("arserve generate: warning: prompt: 1 word the model does not know was read as "
            "unknown: 'zebra'") in p.stderr, p.stderr
