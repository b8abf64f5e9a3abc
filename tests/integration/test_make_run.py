"""`make run` as a newcomer types it, and the README's curl and openai
examples run as written against what it serves (only the port changed)."""
import json
import os
import re
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
    def __init__(self, tmp_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out_path = tmp_path / "make-run.stdout"
        self.err_path = tmp_path / "make-run.stderr"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            # Its own process group, so the test can signal make and the daemon together.
            self.proc = subprocess.Popen(["make", "run", f"PORT={self.port}"], cwd=REPO,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         env=clean_env(), start_new_session=True)
        self.pgid = self.proc.pid

    def output(self):
        return self.out_path.read_text(errors="replace") + self.err_path.read_text(
            errors="replace")

    def wait_ready(self):
        deadline = time.monotonic() + scaled(MAKE_RUN_START)
        want = f"arserve: ready on 127.0.0.1:{self.port}"
        while want not in self.out_path.read_text(errors="replace"):
            if self.proc.poll() is not None:
                pytest.fail(f"make run exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"make run not ready within {scaled(MAKE_RUN_START):.0f} s:\n"
                            f"{self.output()}")
            time.sleep(0.1)
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


@pytest.fixture(scope="module")
def make_run(tmp_path_factory):
    m = MakeRun(tmp_path_factory.mktemp("make-run"))
    try:
        m.wait_ready()
    except BaseException:
        m.stop()
        raise
    yield m
    m.stop()
    reports = sanitizer_reports(m.output())
    assert not reports, "\n".join(reports)
    err = m.err_path.read_text(errors="replace")
    assert "draining" in err and "stopped" in err, \
        f"the daemon did not drain and stop cleanly:\n{m.output()[-4000:]}"


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
        w, h = (int(x) for x in size.split("x"))
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


def served_size(url):
    r = httpx.post(url + "/v1/images/generations", json={"prompt": "a red circle", "seed": 1},
                   timeout=HTTP_TIMEOUT)
    w, h = (int(x) for x in r.json()["size"].split("x"))
    return w, h


def on_port(code, port):
    assert "127.0.0.1:8080" in code, "the README's example no longer talks to 127.0.0.1:8080"
    return code.replace("127.0.0.1:8080", f"127.0.0.1:{port}")


@pytest.mark.timeout(MAKE_RUN_START + 60)
def test_readme_curl_example_works(make_run, tmp_path):
    code = on_port(readme_block("sh", "curl "), make_run.port)
    assert code.count("out.png") >= 2, code
    size = served_size(make_run.url)
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
    assert png_size((tmp_path / "out.png").read_bytes()) == served_size(make_run.url)
