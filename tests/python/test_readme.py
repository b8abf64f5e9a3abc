"""The README as a new user reads it: short, with a table of contents that leads to its
headings, links that lead somewhere (its own and those of docs/*.md), and commands that run
as written: every converter command names a converter of tools/convert/ with the flags and
the positional arguments its --help gives, and every `arserve serve` or `arserve generate`
command only flags its --help lists, the CUDA backend asked of the CUDA build only."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from machine_speed import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
ARSERVE = os.environ.get("ARSERVE_BIN", os.path.join(ROOT, "build", "arserve"))
MAX_LINES = 400
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def docs():
    """README.md and every docs/*.md, as paths relative to the root."""
    d = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(d)
                                  if f.endswith(".md"))


def prose_lines(text):
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, line))
    return out


def code_blocks(text):
    """The fenced code blocks' bodies, each with the line number of its first line."""
    out, body, start, fenced = [], [], 0, False
    for i, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line.lstrip()):
            if fenced:
                out.append((start, "\n".join(body)))
            fenced, body, start = not fenced, [], i + 1
        elif fenced:
            body.append(line)
    return out


def slug(heading):
    """GitHub's anchor for a heading: the text as rendered (links and code marks gone), lower
    case, anything but letters, digits, '_', '-' and spaces dropped, spaces made '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(text):
    """(level, text) of each heading outside code blocks, in order."""
    out = []
    for _, line in prose_lines(text):
        m = re.match(r"(#{1,6}) +(.*?) *#*$", line)
        if m:
            out.append((len(m.group(1)), m.group(2)))
    return out


def anchors(text):
    """Every anchor a heading of the text defines, GitHub's duplicates suffixed -1, -2..."""
    seen, out = {}, set()
    for _, h in headings(text):
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else "%s-%d" % (s, n))
    return out


def links(text):
    """(line number, target) of each Markdown link and image outside code (fenced blocks and
    `code spans`)."""
    out = []
    for i, line in prose_lines(text):
        line = re.sub(r"`[^`]*`", "", line)
        out += [(i, m.group(1)) for m in LINK.finditer(line)]
    return out


def bad_links(rel):
    """The links of one doc that lead nowhere: a file that does not exist, or an anchor that
    no heading of its file defines."""
    here = os.path.dirname(os.path.join(ROOT, rel))
    bad = []
    for line, target in links(read(os.path.join(ROOT, rel))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(here, path)) if path else os.path.join(ROOT, rel)
        if not os.path.exists(full):
            bad.append("%s:%d: %s: no such file" % (rel, line, target))
        elif anchor and full.endswith(".md") and anchor not in anchors(read(full)):
            bad.append("%s:%d: %s: no heading has the anchor #%s" % (rel, line, target, anchor))
    return bad


def commands(text, pattern):
    """Shell lines of the text's code blocks (continuations joined) that match pattern, each
    as (line number, the words shlex makes of it, comments dropped)."""
    out = []
    for start, body in code_blocks(text):
        lines = body.split("\n")
        i = 0
        while i < len(lines):
            first, line = start + i, lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i]
            i += 1
            if re.search(pattern, line):
                out.append((first, shlex.split(line, comments=True)))
    return out


def argparse_usage(help_text):
    """From an argparse --help: every flag it lists, the optional ones that take a value, and
    the positional arguments of its usage line."""
    usage = help_text.split("\n\n", 1)[0]
    usage = " ".join(usage.split())
    assert usage.startswith("usage: "), help_text
    usage = usage.split(" ", 2)[2] if usage.count(" ") >= 2 else ""
    takes_value = {m.group(1) for m in re.finditer(r"\[(-[-\w]+) [^\[\]]+\]", usage)}
    positionals = re.sub(r"\[[^\[\]]*\]", " ", usage).split()
    flags = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][-\w]*)", help_text))
    return flags, takes_value, positionals


# ---- length and the table of contents -----------------------------------------------------

def test_readme_is_short():
    n = read(README).count("\n")
    assert n < MAX_LINES, "README.md has %d lines; keep it under %d and move the rest to docs/" % (
        n, MAX_LINES)


def test_readme_contents_lead_to_every_section():
    text = read(README)
    head = text.split("\n")[:30]
    assert "## Contents" in head, "README.md has no '## Contents' in its first 30 lines"
    toc = text.split("\n## Contents\n", 1)[1].split("\n## ", 1)[0]
    entries = re.findall(r"^- \[([^\]]+)\]\(#([^)]+)\)$", toc, re.M)
    assert entries, "README.md's Contents lists no sections"
    have = anchors(text)
    missing = [a for _, a in entries if a not in have]
    assert not missing, "Contents entries that lead to no heading: %s" % missing
    sections = [slug(h) for level, h in headings(text) if level == 2 and h != "Contents"]
    assert [a for _, a in entries] == sections, (
        "Contents must list every section (##) of README.md in order:\n  listed %s\n  sections %s"
        % ([a for _, a in entries], sections))


# ---- links --------------------------------------------------------------------------------

@pytest.mark.parametrize("rel", docs())
def test_relative_links_lead_somewhere(rel):
    bad = bad_links(rel)
    assert not bad, "\n".join(bad)


def test_a_broken_link_is_found(tmp_path, monkeypatch):
    """The check itself: a missing file and a missing anchor are both reported, and GitHub's
    anchors for headings with code, punctuation and repeats are the ones it makes."""
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    (tmp_path / "docs" / "y.md").write_text("# Y\n\n## `tokenizer.json`\n\n## Build: CUDA=1\n")
    doc.write_text("# X\n\n## Same\n\n## Same\n\n[a](y.md#tokenizerjson) [b](y.md#build-cuda1) "
                   "[c](#same-1) `[not a link](nowhere.md)`\n\n```\n[nor](this.md)\n```\n"
                   "[d](z.md) [e](y.md#nope) [f](https://example.org/#x)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    bad = bad_links(os.path.join("docs", "x.md"))
    assert len(bad) == 2 and "z.md: no such file" in bad[0] and "#nope" in bad[1], bad


# ---- commands -----------------------------------------------------------------------------

def converter_commands():
    out = []
    for rel in docs():
        for line, words in commands(read(os.path.join(ROOT, rel)),
                                    r"\.venv/bin/python +tools/convert/"):
            out.append(("%s:%d" % (rel, line), words))
    return out


def test_readme_converts_every_family():
    named = {os.path.basename(w[1]) for where, w in converter_commands()
             if where.startswith("README.md:")}
    assert named == {"janus.py", "llamagen.py", "var.py", "infinity.py"}, named


def check_converter_command(words):
    """What is wrong with one converter command line, as a list of messages."""
    assert words[0] == ".venv/bin/python", words
    script = words[1]
    if not os.path.isfile(os.path.join(ROOT, script)):
        return ["%s: no such converter" % script]
    p = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=scaled(60))
    assert p.returncode == 0, p.stderr
    flags, takes_value, positionals = argparse_usage(p.stdout)
    wrong, given, args = [], [], iter(words[2:])
    for w in args:
        if w.startswith("-"):
            flag = w.split("=", 1)[0]
            if flag not in flags:
                wrong.append("%s: %s is not a flag of its --help" % (script, flag))
            elif flag in takes_value and "=" not in w:
                next(args, None)
        else:
            given.append(w)
    if len(given) != len(positionals):
        wrong.append("%s: %d positional arguments (%s), its usage has %d (%s)"
                     % (script, len(given), " ".join(given), len(positionals),
                        " ".join(positionals)))
    return wrong


def test_converter_commands_run_as_written():
    found = converter_commands()
    assert found, "no `.venv/bin/python tools/convert/...` command in README.md or docs/"
    bad = ["%s: %s" % (where, msg) for where, words in found
           for msg in check_converter_command(words)]
    assert not bad, "\n".join(bad)


def test_a_wrong_converter_command_is_found():
    """The check itself: an unknown flag, a value taken for a positional, a missing argument
    and a converter that does not exist are each reported."""
    ok = ".venv/bin/python tools/convert/var.py a.pth b.pth out --dtype bf16 --force"
    assert check_converter_command(shlex.split(ok)) == []
    for wrong in (".venv/bin/python tools/convert/var.py a.pth b.pth out --dtypes bf16",
                  ".venv/bin/python tools/convert/var.py a.pth b.pth --dtype bf16",
                  ".venv/bin/python tools/convert/var.py a.pth b.pth out extra",
                  ".venv/bin/python tools/convert/nope.py a b c"):
        assert check_converter_command(shlex.split(wrong)), wrong


@pytest.mark.skipif(not os.access(ARSERVE, os.X_OK), reason="no arserve binary (ARSERVE_BIN)")
def test_arserve_commands_use_flags_it_has():
    helps, bad = {}, []
    for line, words in commands(read(README), r"\barserve +(serve|generate)\b"):
        binary = words[0]
        sub = next(w for w in words[1:] if w in ("serve", "generate"))
        if sub not in helps:
            p = subprocess.run([ARSERVE, sub, "--help"], capture_output=True, text=True,
                               timeout=scaled(30))
            helps[sub] = set(re.findall(r"(?<![\w-])(--[a-z][-a-z0-9]*)", p.stdout + p.stderr))
            assert helps[sub], (sub, p.stdout, p.stderr)
        for w in words:
            if w.startswith("--") and w.split("=", 1)[0] not in helps[sub]:
                bad.append("README.md:%d: arserve %s has no %s" % (line, sub, w))
        if "cuda" in words and words[words.index("cuda") - 1] == "--backend" and \
                binary != "build-cuda/arserve":
            bad.append("README.md:%d: --backend cuda needs the CUDA build, build-cuda/arserve "
                       "(make CUDA=1), not %s" % (line, binary))
    assert helps, "README.md shows no arserve serve or generate command"
    assert not bad, "\n".join(bad)
