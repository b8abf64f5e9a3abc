"""The tables of KV policies and knobs in docs/api.md and docs/kv-policies.md,
made from what the daemon says (GET /v1/models), so that engine/policy/ (the
policy table and KV_POLICY_KNOBS) stays the only list of them.

    python3 tools/kv_knob_docs.py                # 1, with a diff, when a table is stale
    python3 tools/kv_knob_docs.py --write        # makes them again

It serves the two shipped demo models, a raster one and a next-scale one
(every policy runs on one of them), on free loopback ports with the default
settings, and reads each one's model card. Each is served from a copy whose
arserve.json has no "kv_budgets", so the tables give the policies' own
budgets, not what a demo's card sets for its small grid. Between the markers below the
docs hold nothing else; tests/integration/test_kv_docs.py checks that they
are current, and that what the docs say by hand about defaults agrees.
"""
import argparse
import difflib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = (os.path.join("docs", "api.md"), os.path.join("docs", "kv-policies.md"))
MODELS = ("models/shapes", "models/shapes-var")
BEGIN = ("<!-- The KV policies and their knobs, as GET /v1/models lists them: made by "
         "tools/kv_knob_docs.py (edit engine/policy/, then run it with --write). -->")
END = "<!-- End of the tables tools/kv_knob_docs.py makes. -->"


def number(x):
    """A number as the tables write it: 4, 0.9, -0.008, -1e6."""
    x = float(x)
    if x.is_integer() and abs(x) < 1e5:
        return str(int(x))
    return ("%g" % x).replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


def budget(b):
    """1/6 where the budget is one over a whole number, else the number."""
    if b > 0:
        inv = round(1 / b)
        if inv >= 1 and 1 / inv == b:
            return "1/%d" % inv
    return number(b)


def values(k):
    if k["type"] == "integer":
        return "integer, %s..%s" % (number(k["min"]), number(k["max"]))
    return "number in %s%s, %s]" % ("(" if k["min_exclusive"] else "[", number(k["min"]),
                                    number(k["max"]))


def merge(cards):
    """The policies of every card (the arserve member of a model card), in the
    order they first come, each with its families, its budget per family
    (None where it takes none) and its knobs; the knobs likewise, each with
    its policies."""
    policies, knobs = {}, {}
    for card in cards:
        for p in card["kv_policies"]:
            e = policies.setdefault(p["name"], {"families": [], "budget": {}, "knobs": []})
            e["families"].append(card["family"])
            e["budget"][card["family"]] = p.get("budget")
            for k in p["knobs"]:
                if k["name"] not in e["knobs"]:
                    e["knobs"].append(k["name"])
                seen = knobs.setdefault(k["name"], dict(k, policies=[]))
                same = {f: seen[f] for f in k} == k
                if not same:
                    raise SystemExit("knob %s: %s says %s, another policy %s"
                                     % (k["name"], p["name"], k, seen))
                if p["name"] not in seen["policies"]:
                    seen["policies"].append(p["name"])
    return policies, knobs


def render(cards):
    """The markdown between the markers: the policies, then the knobs."""
    policies, knobs = merge(cards)
    out = ["| policy | families | budget (default) | knobs |", "|---|---|---|---|"]
    for name, e in policies.items():
        budgets = {b for b in e["budget"].values()}
        if len(budgets) == 1:
            b = budgets.pop()
            said = "none" if b is None else budget(b)
        else:
            said = ", ".join("%s (%s)" % ("none" if b is None else budget(b), f)
                             for f, b in e["budget"].items())
        out.append("| `%s` | %s | %s | %s |" % (name, ", ".join(e["families"]), said,
                                                 ", ".join("`%s`" % k for k in e["knobs"])
                                                 or "none"))
    out += ["", "| knob | policies | values | default | what it does |", "|---|---|---|---|---|"]
    for name, k in knobs.items():
        out.append("| `%s` | %s | %s | %s | %s |" % (name, ", ".join(k["policies"]), values(k),
                                                     number(k["default"]), k["description"]))
    return "\n".join(out) + "\n"


def section(text, path):
    """(before, the generated part, after) of a doc's text."""
    try:
        b = text.index(BEGIN + "\n\n") + len(BEGIN) + 2
        e = text.index("\n" + END, b)
    except ValueError:
        raise SystemExit("%s: no generated tables (the markers of tools/kv_knob_docs.py)" % path)
    return text[:b], text[b:e], text[e:]


def stale(body, write=False, root=REPO):
    """The docs whose tables are not body, each with a diff; write: make them
    body instead."""
    out = []
    for rel in DOCS:
        path = os.path.join(root, rel)
        with open(path) as f:
            text = f.read()
        before, now, after = section(text, rel)
        if now == body:
            continue
        out.append((rel, "".join(difflib.unified_diff(now.splitlines(True), body.splitlines(True),
                                                       rel + " (now)", rel + " (the daemon)"))))
        if write:
            with open(path, "w") as f:
                f.write(before + body + after)
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_card_budgets(model, into):
    """A copy of model in into whose card sets no policy's budget."""
    out = os.path.join(into, os.path.basename(model))
    shutil.copytree(model, out)
    path = os.path.join(out, "arserve.json")
    with open(path) as f:
        card = json.load(f)
    card.pop("kv_budgets", None)
    with open(path, "w") as f:
        json.dump(card, f)
    return out


def model_card(arserve, model, timeout=60):
    """The arserve member of GET /v1/models from a daemon serving model."""
    port = free_port()
    url = "http://127.0.0.1:%d" % port
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARSERVE_")}
    proc = subprocess.Popen([arserve, "serve", "--model", model, "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        t0 = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                    return json.load(r)["data"][0]["arserve"]
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit("arserve serve --model %s exited: %s"
                                     % (model, proc.stderr.read().decode()[-2000:]))
                if time.monotonic() - t0 > timeout:
                    raise SystemExit("arserve serve --model %s: no answer in %d s"
                                     % (model, timeout))
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arserve", default=os.path.join(REPO, "build", "arserve"))
    ap.add_argument("--write", action="store_true", help="make the tables again")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        body = render([model_card(a.arserve, without_card_budgets(os.path.join(REPO, m), tmp))
                       for m in MODELS])
    diffs = stale(body, write=a.write)
    for rel, diff in diffs:
        print(("wrote %s" % rel) if a.write else diff, end="" if not a.write else "\n")
    return 1 if diffs and not a.write else 0


if __name__ == "__main__":
    sys.exit(main())
