"""The Layout table of docs/development.md against the tree: every folder it names exists, every folder of
the tree that holds code is named, and a folder's C includes only its own headers and those of
the folders under it in the table (the floors the table promises)."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
C_EXT = (".c", ".h", ".inc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layout_rows(doc=os.path.join(ROOT, "docs", "development.md")):
    """The folders of the Layout table, top row first."""
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1).rstrip("/") for m in re.finditer(r"^\| `([^`]+)` \|", section, re.M)]


def tracked_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return [p for p in out.split("\n") if p]


def room_of(path, rows):
    """The row a file belongs to: the longest folder of the table that holds it."""
    best = None
    for r in rows:
        if path.startswith(r + "/") and (best is None or len(r) > len(best)):
            best = r
    return best


def include_violations(rows, files):
    """(file, include) pairs where a file includes a header of a folder above its own."""
    floor = {r: i for i, r in enumerate(rows)}
    bad = []
    for f in files:
        if not f.endswith(C_EXT) or f.startswith("tests/"):
            continue
        own = room_of(f, rows)
        with open(os.path.join(ROOT, f), encoding="utf-8", errors="replace") as fh:
            includes = INCLUDE.findall(fh.read())
        for inc in includes:
            target = inc if os.path.exists(os.path.join(ROOT, inc)) else \
                os.path.normpath(os.path.join(os.path.dirname(f), inc))
            other = room_of(target, rows)
            if own and other and floor[other] < floor[own]:
                bad.append((f, inc))
    return bad


def test_every_folder_named_exists():
    rows = layout_rows()
    assert rows, "docs/development.md has no Layout table"
    missing = [r for r in rows if not os.path.isdir(os.path.join(ROOT, r))]
    assert not missing, "docs/development.md's Layout names folders the tree lacks: %s" % missing


def test_every_code_folder_is_named():
    rows = layout_rows()
    files = tracked_files()
    top = {p.split("/", 1)[0] for p in files if "/" in p and not p.startswith(".")}
    # The engine's rooms each have a row of their own.
    subs = {p.rsplit("/", 1)[0] for p in files if p.startswith("engine/") and p.count("/") >= 2}
    unnamed = sorted(d for d in top | subs if d not in rows)
    assert not unnamed, "folders docs/development.md's Layout does not name: %s" % unnamed


def test_includes_run_down_the_table():
    bad = include_violations(layout_rows(), tracked_files())
    assert not bad, "includes of a folder above the includer's (docs/development.md's Layout): %s" % bad


def test_an_include_that_runs_up_is_found(tmp_path):
    """The check itself: a base/ file including an engine header is reported."""
    rows = layout_rows()
    assert include_violations(rows, ["base/status.h"]) == []
    probe = os.path.join(ROOT, "base", "layout_probe_%d.h" % os.getpid())
    with open(probe, "w") as f:
        f.write('#include "engine/generate.h"\n')
    try:
        bad = include_violations(rows, [os.path.relpath(probe, ROOT)])
    finally:
        os.unlink(probe)
    assert bad == [(os.path.relpath(probe, ROOT), "engine/generate.h")]
