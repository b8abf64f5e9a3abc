"""The docs say what the daemon says about its KV policies and knobs.

docs/api.md and docs/kv-policies.md hold tables of the policies and knobs that
tools/kv_knob_docs.py makes from GET /v1/models: they must be what a daemon
with the default settings answers now, on the two shipped demo models (a
raster one and a next-scale one, which together run every policy). Where the
docs state a default by hand (a table's default column, a "Defaults:"
bullet, "`knob` ... (default 3"), it must be the daemon's too.
"""
import os
import re
import subprocess
import sys

import pytest

from conftest import ARSERVE_BIN, REPO, Daemon, clean_env, repo_path, scaled

# The subject is the docs' tables: the release build only.
pytestmark = pytest.mark.release_build

sys.path.insert(0, os.path.join(REPO, "tools"))
import kv_knob_docs  # noqa: E402

SHAPES_MODEL = repo_path("models/shapes")
VAR_MODEL = repo_path(os.environ.get("ARSERVE_VAR_MODEL") or "models/shapes-var")


@pytest.fixture(scope="module")
def cards(tmp_path_factory):
    """The arserve member of GET /v1/models on each demo model, served as
    tools/kv_knob_docs.py serves it (its card's own budgets taken out)."""
    out = []
    for model in (SHAPES_MODEL, VAR_MODEL):
        copy = kv_knob_docs.without_card_budgets(model, str(tmp_path_factory.mktemp("model")))
        d = Daemon(str(tmp_path_factory.mktemp("arserve")), copy)
        try:
            r = d.client.get("/v1/models")
            assert r.status_code == 200, r.text
            out.append(r.json()["data"][0]["arserve"])
        finally:
            d.finish()
    return out


def test_the_demo_models_run_every_policy(cards):
    """Every policy --kv-policy takes runs on one of the two models, so the
    tables miss none."""
    help_text = subprocess.run([ARSERVE_BIN, "serve", "--help"], capture_output=True, text=True,
                               env=clean_env(), timeout=scaled(30)).stdout
    m = re.search(r"--kv-policy NAME\s.*?One of\s+([a-z_|]+),\s+default", help_text, re.S)
    assert m, help_text
    listed = {p["name"] for c in cards for p in c["kv_policies"]}
    assert listed == set(m.group(1).split("|"))


def test_generated_tables_are_current(cards):
    body = kv_knob_docs.render(cards)
    stale = kv_knob_docs.stale(body)
    assert not stale, ("the KV tables are not what the daemon says; run `python3 "
                       "tools/kv_knob_docs.py --write`:\n" + "".join(d for _, d in stale))


# ---- what the docs state by hand ------------------------------------------------------

NUMBER = r"-?[0-9][0-9.e+-]*(?:/[0-9]+)?"


def value_of(text):
    """The number a cell or a statement starts with: "8 tokens" -> 8, "1/8" -> 0.125."""
    m = re.match(r"\s*(" + NUMBER + ")", text)
    assert m, f"no number in {text!r}"
    num, _, den = m.group(1).partition("/")
    return float(num) / float(den) if den else float(num)


def statements(text, policies):
    """(line, name, value, policy) of each default stated by hand: a table
    row whose first cell is a `name` under a "default" column, a `name =
    value` in a "- Defaults:" bullet, and `name` ... (default value) in
    prose. policy: the policy whose section ("## streaming ...") holds it."""
    out, policy, header = [], None, None
    lines = text.split("\n")
    for i, line in enumerate(lines):
        h = re.match(r"#{2,3} (\w+)", line)
        if h:
            policy = h.group(1) if h.group(1) in policies else None
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if header is None:
                header = [c.lower() for c in cells]
            elif "default" in header and not set(line) <= set("|-: "):
                name = re.fullmatch(r"`(\w+)`", cells[0])
                if name:
                    out.append((i + 1, name.group(1), value_of(cells[header.index("default")]),
                                policy))
            continue
        header = None
        if line.startswith("- Defaults:"):
            bullet = line
            for more in lines[i + 1:]:
                if not more.startswith("  "):
                    break
                bullet += " " + more.strip()
            for m in re.finditer(r"`(\w+) = (" + NUMBER + ")`", bullet):
                out.append((i + 1, m.group(1), value_of(m.group(2)), policy))
    # Prose, its lines joined (a statement may break across them).
    line_of = []
    for i, line in enumerate(lines):
        line_of += [i + 1] * (len(line) + 1)
    joined = re.sub(r"\n\s*", lambda m: " " + " " * (len(m.group(0)) - 1), text)
    for m in re.finditer(r"`(\w+)`[^`|]{0,40}?\(default (" + NUMBER + ")", joined):
        out.append((line_of[m.start()], m.group(1), value_of(m.group(2)),
                    policy_at(lines, line_of[m.start()], policies)))
    return out


def policy_at(lines, lineno, policies):
    for line in reversed(lines[:lineno]):
        h = re.match(r"#{2,3} (\w+)", line)
        if h:
            return h.group(1) if h.group(1) in policies else None
    return None


def test_hand_written_defaults_are_the_daemons(cards):
    policies, knobs = kv_knob_docs.merge(cards)
    checked, wrong = [], []
    for rel in kv_knob_docs.DOCS:
        with open(os.path.join(REPO, rel)) as f:
            text = f.read()
        before, body, after = kv_knob_docs.section(text, rel)
        # The generated tables blanked out, the lines counted as they are.
        for line, name, value, policy in statements(before + "\n" * body.count("\n") + after,
                                                    policies):
            where = f"{rel}:{line}"
            if name == "budget":
                assert policy, f"{where}: a budget outside a policy's section"
                b = set(policies[policy]["budget"].values())
                truth = b.pop() if len(b) == 1 else None
            elif name in knobs:
                truth = knobs[name]["default"]
            else:
                continue  # not a knob (a setting, a symbol of a formula)
            checked.append((where, name))
            if truth is None or abs(value - truth) > 1e-12 * max(1, abs(truth)):
                wrong.append(f"{where}: {name} = {value:g}, the daemon's default is {truth}")
    assert not wrong, "\n".join(wrong)
    # The docs state defaults in a dozen places: finding none would mean
    # the parser no longer sees them.
    assert len(checked) >= 15, checked
