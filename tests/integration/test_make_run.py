"""`make run` as a newcomer types it, and the README's curl and openai
examples run as written against what it serves (only the port changed); its
first screen is a line per stage and the daemon's log, no compiler command
lines, pip output or Python warnings."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import (HTTP_TIMEOUT, REPO, b64_png_size, clean_env, free_port, png_size,
                      sanitizer_reports, scaled)

# `make run` builds and serves the ordinary binary: the release build only.
pytestmark = pytest.mark.release_build

# make run may have to build first (it runs `make deps all`): the reference
# machine's seconds, scaled() like every bound.
MAKE_RUN_START = 240


def test_make_run_defaults_to_loopback_8080():
    """`make run` without arguments serves the shipped model, models/shapes,
    on 127.0.0.1:8080 (dry run: what it would execute)."""
    p = subprocess.run(["make", "-n", "run"], cwd=REPO, capture_output=True, text=True,
                       timeout=scaled(60), env=clean_env())
    assert p.returncode == 0, p.stderr
    serve = [line for line in p.stdout.splitlines() if " serve " in line]
    assert serve, p.stdout
    assert re.search(r"--host 127\.0\.0\.1(\s|$)", serve[-1]), serve[-1]
    assert re.search(r"--port 8080(\s|$)", serve[-1]), serve[-1]
    assert re.search(r"--model models/shapes(\s|$)", serve[-1]), serve[-1]


class MakeRun:
    def __init__(self, tmp_path, *make_args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out_path = tmp_path / "make-run.stdout"
        self.err_path = tmp_path / "make-run.stderr"
        self.screen = None
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            # Its own process group, so the test can signal make and the daemon together.
            self.proc = subprocess.Popen(["make", "run", f"PORT={self.port}", *make_args],
                                         cwd=REPO, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=err, env=clean_env(), start_new_session=True)
        self.pgid = self.proc.pid

    def output(self):
        return self.out_path.read_text(errors="replace") + self.err_path.read_text(
            errors="replace")

    def wait_ready(self):
        """Waits for the ready line; keeps what the screen showed up to it
        (stdout to the ready line, stderr so far: the daemon's log)."""
        deadline = time.monotonic() + scaled(MAKE_RUN_START)
        want = f"arserve: ready on 127.0.0.1:{self.port}"
        while want not in (out := self.out_path.read_text(errors="replace")):
            if self.proc.poll() is not None:
                pytest.fail(f"make run exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"make run not ready within {scaled(MAKE_RUN_START):.0f} s:\n"
                            f"{self.output()}")
            time.sleep(0.05)
        err = self.err_path.read_text(errors="replace")
        lines = out.splitlines()
        ready = next(i for i, line in enumerate(lines) if want in line)
        self.screen = (lines[:ready + 1], err.splitlines())
        r = httpx.get(self.url + "/health", timeout=HTTP_TIMEOUT)
        assert r.status_code == 200

    def group_alive(self):
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False

    def stop(self):
        """Ctrl-C: SIGINT to make and the daemon (the terminal signals the
        whole foreground group); waits for the whole group to go.

        Not SIGTERM to the group: GNU make passes a SIGTERM on to its
        children, so the daemon would get two and take the second as
        "exit now" instead of draining."""
        if self.group_alive():
            os.killpg(self.pgid, signal.SIGINT)
        deadline = time.monotonic() + scaled(30)
        while self.group_alive() and time.monotonic() < deadline:
            try:
                self.proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
        if self.group_alive():
            os.killpg(self.pgid, signal.SIGKILL)
            self.proc.wait(timeout=scaled(10))
            pytest.fail(f"make run did not stop within {scaled(30):.0f} s of SIGINT:\n"
                        f"{self.output()}")
        self.proc.wait(timeout=scaled(10))


def build_missing_one_object(tmp_path):
    """A copy of the release build's objects of arserve (BUILD=... for make
    run) but for the smallest source's: make run compiles one file, archives
    and links, in a second."""
    build = tmp_path / "build"
    for d in ("base", "kernels/cpu", "engine", "server", "cli"):
        if os.path.isdir(os.path.join(REPO, "build", d)):
            shutil.copytree(os.path.join(REPO, "build", d), build / d)
    sources = sorted((os.path.getsize(os.path.join(REPO, "base", f)), f)
                     for f in os.listdir(os.path.join(REPO, "base")) if f.endswith(".c"))
    obj = build / "base" / (sources[0][1][:-2] + ".o")
    if obj.exists():
        obj.unlink()
    return build


@pytest.fixture(scope="module")
def make_run(tmp_path_factory):
    """`make run` as typed; once it serves, beside it (make_run.building)
    `make run` with a build that has one file to compile, for its first
    screen (test_make_run_first_screen_while_building waits for it)."""
    m = MakeRun(tmp_path_factory.mktemp("make-run"))
    m.building = None
    try:
        m.wait_ready()
        # After the first is ready: its deps stages are done, so the two never
        # install into .venv at once.
        build = build_missing_one_object(tmp_path_factory.mktemp("make-run-building"))
        m.building = MakeRun(build.parent, f"BUILD={build}")
        m.building.build = build
    except BaseException:
        m.stop()
        raise
    yield m
    for run in (m, m.building):
        if run is None:
            continue
        run.stop()
        reports = sanitizer_reports(run.output())
        assert not reports, "\n".join(reports)
        if run.screen is None:  # stopped before it served (its test deselected)
            continue
        err = run.err_path.read_text(errors="replace")
        assert "draining" in err and "stopped" in err, \
            f"the daemon did not drain and stop cleanly:\n{run.output()[-4000:]}"


# ---- make run's first screen ----------------------------------------------

# What the first screen must not show: make's and the tools' chatter.
NOT_ON_FIRST_SCREEN = (
    ("a compiler command line",
     re.compile(r"^\s*(\S*/)?(cc|gcc|g\+\+|c\+\+|clang|nvcc|ar|ld)(-[0-9.]+)?\s")),
    ("a compiler flag", re.compile(r"(^|\s)-(O[0-3sg]?|Wall|Wextra|fopenmp|MMD)(\s|$)")),
    ("pip's output", re.compile(r"^\s*(Collecting|Requirement already satisfied|Downloading|"
                                r"Installing collected packages|Successfully installed|"
                                r"Using cached)\b")),
    ("a Python warning", re.compile(r"[A-Za-z]*Warning\b|\bWARNING\b|warnings\.warn")),
    ("make's own chatter", re.compile(r"^make(\[\d+\])?: (Entering|Leaving) directory|"
                                      r"is up to date\.$|Nothing to be done")),
)
# A terminal's first screen.
FIRST_SCREEN_LINES = 24


def stage_lines(build, port):
    """make run's line per stage, in order (the Makefile's run), as patterns."""
    b = re.escape(str(build))
    return (
        ("the Debian packages", r"make run: (Debian packages: all \d+ installed|"
                                r"installing Debian packages \(apt-get, once\): .+)"),
        ("the venv", r"make run: Python venv \.venv(: up to date| \(pip, once\)\.\.\.)"),
        ("the build", rf"make run: ({b}/arserve: up to date|"
                      rf"building {b}/arserve \(compiling \d+ of \d+ files\)\.\.\.)"),
        ("the serve command", rf"make run: serving models/shapes: {b}/arserve serve "
                              rf"--model models/shapes --host 127\.0\.0\.1 --port {port}"),
        ("the ready line", rf"arserve: ready on 127\.0\.0\.1:{port}\b.*"
                           rf"http://127\.0\.0\.1:{port}/"),
    )


def check_first_screen(run, build):
    out, err = run.screen
    screen = "\n".join(out + ["--- stderr ---"] + err)
    for line in out + err:
        for what, pattern in NOT_ON_FIRST_SCREEN:
            assert not pattern.search(line), \
                f"make run's first screen shows {what}: {line!r}\n{screen}"
    at = -1
    for stage, pattern in stage_lines(build, run.port):
        found = [i for i, line in enumerate(out) if re.fullmatch(pattern, line)]
        assert len(found) == 1, \
            f"make run's first screen has {len(found)} lines for {stage}, not 1:\n{screen}"
        assert found[0] > at, f"{stage} comes out of order on make run's first screen:\n{screen}"
        at = found[0]
    assert len(out) + len(err) <= FIRST_SCREEN_LINES, \
        f"make run's first screen is {len(out) + len(err)} lines:\n{screen}"


@pytest.mark.timeout(MAKE_RUN_START + 60)
def test_make_run_first_screen(make_run):
    """A line per stage, then the daemon's log and its ready line naming the
    playground: no command lines, pip output or Python warnings (on a fresh
    clone too, where the venv and build stages do their work)."""
    check_first_screen(make_run, "build")


@pytest.mark.timeout(MAKE_RUN_START + 60)
def test_make_run_serves_health_and_images(make_run):
    with httpx.Client(base_url=make_run.url, timeout=HTTP_TIMEOUT) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/ready").status_code == 200
        models = c.get("/v1/models").json()["data"]
        assert len(models) == 1
        with open(os.path.join(REPO, "models", "shapes", "arserve.json")) as f:
            assert models[0]["id"] == json.load(f)["name"], models
        r = c.post("/v1/images/generations", json={"prompt": "a red circle", "seed": 7})
        assert r.status_code == 200, r.text
        size = r.json()["size"]
        w, h = make_run.size = tuple(int(x) for x in size.split("x"))
        assert b64_png_size(r.json()["data"][0]["b64_json"]) == (w, h)
        r = c.post("/v1/images/generations", json={"prompt": "a red circle", "seed": 7},
                   headers={"Accept": "image/png"})
        assert r.status_code == 200
        assert png_size(r.content) == (w, h)


# ---- the README's examples -----------------------------------------------

def readme_block(lang, must_contain):
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    for m in re.finditer(r"```" + lang + r"\n(.*?)```", text, re.S):
        if must_contain in m.group(1):
            return m.group(1)
    pytest.fail(f"README.md has no ```{lang} block with {must_contain!r}")


def served_size(run):
    """The size the daemon draws by default (one generation, asked once)."""
    if getattr(run, "size", None) is None:
        r = httpx.post(run.url + "/v1/images/generations",
                       json={"prompt": "a red circle", "seed": 1}, timeout=HTTP_TIMEOUT)
        run.size = tuple(int(x) for x in r.json()["size"].split("x"))
    return run.size


def on_port(code, port):
    assert "127.0.0.1:8080" in code, "the README's example no longer talks to 127.0.0.1:8080"
    return code.replace("127.0.0.1:8080", f"127.0.0.1:{port}")


@pytest.mark.timeout(MAKE_RUN_START + 60)
def test_readme_curl_example_works(make_run, tmp_path):
    code = on_port(readme_block("sh", "curl "), make_run.port)
    assert code.count("out.png") >= 2, code
    size = served_size(make_run)
    # Each command of the block on its own, so both must write out.png.
    commands = [c for c in re.split(r"\n(?=curl )", code) if c.strip().startswith("curl")]
    assert len(commands) >= 2, code
    for cmd in commands:
        out = tmp_path / "out.png"
        if out.exists():
            out.unlink()
        p = subprocess.run(["bash", "-c", "set -eo pipefail\n" + cmd], cwd=tmp_path,
                           capture_output=True, text=True, timeout=HTTP_TIMEOUT,
                           env=clean_env())
        assert p.returncode == 0, f"{cmd}\n{p.stdout}\n{p.stderr}"
        assert out.exists(), cmd
        assert png_size(out.read_bytes()) == size, cmd


@pytest.mark.timeout(MAKE_RUN_START + 60)
def test_readme_openai_example_works(make_run, tmp_path):
    code = on_port(readme_block("python", "OpenAI("), make_run.port)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=HTTP_TIMEOUT, env=clean_env())
    assert p.returncode == 0, f"{code}\n{p.stdout}\n{p.stderr}"
    assert png_size((tmp_path / "out.png").read_bytes()) == served_size(make_run)


@pytest.mark.timeout(MAKE_RUN_START + 60)
def test_make_run_first_screen_while_building(make_run):
    """The same when make run compiles: one line for the build stage, not the
    compiler's command lines. (Last: that make run builds while the others
    run.)"""
    building = make_run.building
    building.wait_ready()
    check_first_screen(building, building.build)
    out, _ = building.screen
    assert any(re.fullmatch(r"make run: building \S+/arserve \(compiling [1-9]\d* of \d+ files\)"
                            r"\.\.\.", line) for line in out), "\n".join(out)
