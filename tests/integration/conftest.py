"""Fixtures for the daemon's integration tests: the real `arserve serve`
binary on a free loopback port, always stopped, its stderr checked for
sanitizer reports.

Paths come from the environment (`make test-integration` sets them), with
the default build's paths as fallbacks:
  ARSERVE_BIN         the binary (build/arserve)
  ARSERVE_TINY_MODEL  the tiny model (build/tiny-model): milliseconds per image
  ARSERVE_SLOW_MODEL  the slow model (build/slow-model): a second or two per image

Time bounds come from this machine, not from constants (tests/machine_speed.py
measures it): a bound is written in the reference machine's seconds and
scaled() here, as pytest-timeout's limits, HTTP_TIMEOUT, START_TIMEOUT,
STOP_GRACE and the waits of Daemon.wait_metrics are. Tests wait on events (a
/metrics figure, a response, a process exit) wherever they can; a bound that
remains is a safety net, and a failed test's report names the measured speed.

The daemon rejects ARSERVE_* variables it does not know, and a developer's
shell may export ARSERVE_API_KEY, so every daemon gets an environment with
all ARSERVE_* variables removed (but ARSERVE_ISA, which chooses the CPU
kernels for the whole run) and only the ones a test asks for added.
"""
import base64
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import machine_speed  # noqa: E402
from machine_speed import (  # noqa: E402,F401 (the hooks are pytest's)
    pytest_collection_modifyitems, pytest_runtest_makereport, pytest_terminal_summary, scaled)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What a sanitizer build writes to stderr when it finds something; a normal
# build never writes these.
SANITIZER_MARKERS = (
    "ERROR: AddressSanitizer",
    "ERROR: LeakSanitizer",
    "WARNING: ThreadSanitizer",
    "runtime error:",
)

READY_RE = re.compile(r"arserve: ready on ([0-9.]+):([0-9]+)")

# Seconds on the reference machine (scaled() by this one's measured speed
# once the session starts): how long start-up may take, how long a stopped
# daemon may take to exit after SIGTERM (beyond its drain timeout), one HTTP
# call's limit.
REFERENCE_START_TIMEOUT = 20.0
REFERENCE_STOP_GRACE = 10.0
REFERENCE_HTTP_TIMEOUT = 30.0


def repo_path(p):
    return p if os.path.isabs(p) else os.path.join(REPO, p)


def _env_path(name, default):
    return repo_path(os.environ.get(name) or default)


ARSERVE_BIN = _env_path("ARSERVE_BIN", "build/arserve")
TINY_MODEL = _env_path("ARSERVE_TINY_MODEL", "build/tiny-model")
SLOW_MODEL = _env_path("ARSERVE_SLOW_MODEL", "build/slow-model")

# ---- this machine's speed (tests/machine_speed.py) -----------------------------------

# Set from the measurement in pytest_configure.
START_TIMEOUT = REFERENCE_START_TIMEOUT
STOP_GRACE = REFERENCE_STOP_GRACE
HTTP_TIMEOUT = REFERENCE_HTTP_TIMEOUT


def pytest_configure(config):
    """The machine measured once per session (machine_speed), then the bounds."""
    global START_TIMEOUT, STOP_GRACE, HTTP_TIMEOUT
    machine_speed.pytest_configure(config)
    START_TIMEOUT = scaled(REFERENCE_START_TIMEOUT)
    STOP_GRACE = scaled(REFERENCE_STOP_GRACE)
    HTTP_TIMEOUT = scaled(REFERENCE_HTTP_TIMEOUT)


def speed():
    """The measurement in words, for a failure message."""
    return machine_speed.SPEED.describe()


def clean_env(extra=None):
    """os.environ without ARSERVE_* but ARSERVE_ISA (and without make's
    recursion variables, so a `make` started from a test behaves as if typed in
    a shell), with extra's variables set (those given as None removed)."""
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("ARSERVE_") or k == machine_speed.ISA_ENV)
           and k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sanitizer_reports(text):
    """The lines of text that carry a sanitizer report."""
    return [line for line in text.splitlines() if any(m in line for m in SANITIZER_MARKERS)]


def png_size(data):
    """(width, height) of PNG bytes; fails the test if they are not a PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"not a PNG: {data[:16]!r}"
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "PNG"
        im.load()  # decodes every row: a truncated or corrupt PNG raises
        return im.size


def b64_png_size(b64):
    return png_size(base64.b64decode(b64, validate=True))


def parse_metrics(text):
    """Prometheus text -> {(name, frozenset(labels.items())): value}."""
    out = {}
    line_re = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = line_re.match(line)
        assert m, f"unparseable metrics line: {line!r}"
        labels = frozenset(label_re.findall(m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


class Metrics:
    """One scrape of /metrics."""

    def __init__(self, text):
        self.text = text
        self.samples = parse_metrics(text)

    def get(self, name, default=0.0, **labels):
        return self.samples.get((name, frozenset(labels.items())), default)

    def http_codes(self):
        """{code: count} over every route of arserve_http_requests_total."""
        codes = {}
        for (n, ls), v in self.samples.items():
            if n == "arserve_http_requests_total":
                c = dict(ls)["code"]
                codes[c] = codes.get(c, 0) + v
        return codes

    def histogram_above(self, name, bound):
        """Observations of a histogram greater than bound (bound must be a bucket)."""
        le = self.samples.get((name + "_bucket", frozenset({("le", _fmt_le(bound))})))
        assert le is not None, f"{name} has no bucket le={bound}:\n{self.text}"
        return self.get(name + "_count") - le


def tcp_sockets(port):
    """(state, bytes received and not read) of each IPv4 socket whose local port
    is port, from the kernel's table (/proc/net/tcp; state 01 established, 0A
    listening, whose count is then its accept queue), or None where there is none."""
    try:
        with open("/proc/net/tcp") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return None
    out = []
    for row in rows:
        f = row.split()
        if int(f[1].split(":")[1], 16) == port:
            out.append((f[3], int(f[4].split(":")[1], 16)))
    return out


def daemon_backlog(port):
    """What the daemon listening on port has not taken in yet: connections waiting
    to be accepted plus accepted ones holding bytes it has not read (None where
    the kernel's table cannot be read)."""
    sockets = tcp_sockets(port)
    return None if sockets is None else sum(n for state, n in sockets if state in ("01", "0A"))


def is_idle(m):
    """A scrape of a daemon with no request running or waiting and an empty KV pool."""
    return (m.get("arserve_requests_running") == 0 and m.get("arserve_requests_waiting") == 0
            and m.get("arserve_kv_pool_reserved_bytes") == 0
            and m.get("arserve_kv_pool_used_bytes") == 0)


def _fmt_le(bound):
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


CAPACITY_RE = re.compile(r"KV pool [0-9.]+ MiB of \S+ K and V in blocks of [0-9]+ tokens: (.*)")


def capacity_cells(log):
    """The start-up capacity line's cells by policy: {"full": "full 12945 images",
    "streaming": "streaming@0.167 1440", "heatkv": "heatkv n/a (...)", ...}."""
    m = CAPACITY_RE.search(log)
    assert m, f"no capacity line in the log:\n{log}"
    return {re.match(r"[a-z_]+", cell).group(0): cell for cell in m.group(1).split(", ")}


class Daemon:
    """A running `arserve serve` on 127.0.0.1 with the kernel's free port."""

    def __init__(self, tmp_dir, model, args=(), env=None, drain_timeout_s=10, binary=None):
        binary = repo_path(binary) if binary else ARSERVE_BIN
        if not os.access(binary, os.X_OK):
            pytest.fail(f"{binary} is missing: build it with `make all` "
                        "(or point ARSERVE_BIN at a build)")
        if not os.path.exists(os.path.join(model, "arserve.json")):
            pytest.fail(f"model {model} is missing: `make test-integration` builds it")
        self.tmp_dir = tmp_dir
        self.drain_timeout_s = drain_timeout_s
        self.stdout_path = os.path.join(tmp_dir, "daemon.stdout")
        self.stderr_path = os.path.join(tmp_dir, "daemon.stderr")
        # The pool figures the tests compute count fp32 K and V: daemons store
        # them so unless a test names a type (serve's default is the weights',
        # f16 for the tiny model: test_api's test_kv_dtype_* checks it).
        kv = [] if any(str(x).startswith("--kv-dtype") for x in args) else ["--kv-dtype", "f32"]
        argv = [binary, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
                "--drain-timeout-s", str(drain_timeout_s), *kv, *args]
        self.argv = argv
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         env=clean_env(env), cwd=tmp_dir)
        self.stopped = False
        self.signalled = False  # a test sent a signal itself
        self.expect_rc = 0      # the exit status finish() accepts
        try:
            self.port = self._wait_ready()
            self.url = f"http://127.0.0.1:{self.port}"
            self.client = httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT)
            self._wait_health()
        except BaseException:  # a failure or a pytest-timeout: never leave it running
            self.kill()
            raise

    def _wait_ready(self):
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            with open(self.stdout_path, encoding="utf-8", errors="replace") as f:
                m = READY_RE.search(f.read())
            if m:
                assert m.group(1) == "127.0.0.1"
                return int(m.group(2))
            if self.proc.poll() is not None:
                pytest.fail(f"arserve exited with {self.proc.returncode} before it was ready:\n"
                            f"{self.stderr()}")
            time.sleep(0.02)
        self.kill()
        pytest.fail(f"arserve printed no 'ready on' line within {START_TIMEOUT} s:\n{self.stderr()}")

    def _wait_health(self):
        deadline = time.monotonic() + START_TIMEOUT
        last = None
        while time.monotonic() < deadline:
            try:
                r = self.client.get("/health", timeout=scaled(2))
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"/health did not answer 200 within {START_TIMEOUT} s (last: {last})")

    def rss_kib(self):
        """The process's resident set (VmRSS of /proc/PID/status), in KiB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        pytest.fail(f"no VmRSS in /proc/{self.proc.pid}/status (has arserve exited?)")

    def open_fds(self):
        """How many file descriptors the process holds (sockets included)."""
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def wait_idle(self, timeout=10.0, what="the daemon idle"):
        """Waits until nothing runs or waits and the KV pool holds nothing
        (timeout as wait_metrics')."""
        return self.wait_metrics(is_idle, timeout=timeout, what=what)

    def wait_taken_in(self, timeout=5.0):
        """Waits until the daemon has accepted every connection made to it and read
        every byte sent (daemon_backlog 0): what a test sent has reached it.
        timeout as wait_metrics'."""
        limit = scaled(timeout)
        deadline = time.monotonic() + limit
        while daemon_backlog(self.port):
            if time.monotonic() > deadline:
                pytest.fail(f"the daemon had not taken in {daemon_backlog(self.port)} "
                            f"connection(s) or byte(s) after {limit:.1f} s ({speed()})")
            time.sleep(0.01)

    def stderr(self):
        with open(self.stderr_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def metrics(self):
        r = self.client.get("/metrics")
        assert r.status_code == 200, r.text
        return Metrics(r.text)

    def wait_metrics(self, pred, timeout=10.0, what="condition"):
        """Polls /metrics until pred(Metrics) is true; returns that scrape. timeout
        is in the reference machine's seconds: it is scaled() here."""
        limit = scaled(timeout)
        deadline = time.monotonic() + limit
        while True:
            m = self.metrics()
            if pred(m):
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {limit:.1f} s waiting for {what} "
                            f"({speed()}); metrics:\n{m.text}")
            time.sleep(0.02)

    def signal(self, sig):
        """Sends sig (a test that stops the daemon itself)."""
        self.signalled = True
        self.proc.send_signal(sig)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=scaled(10))

    def stop(self):
        """SIGTERM, wait for the drain, SIGKILL after that. Returns the exit
        status; fails the test if SIGKILL was needed or the process had died
        on its own before."""
        if self.stopped:
            return self.proc.returncode
        self.stopped = True
        self.client.close()
        if self.proc.poll() is not None and not self.signalled:
            pytest.fail(f"arserve died during the test with status {self.proc.returncode}:\n"
                        f"{self.stderr()[-4000:]}")
        if not self.signalled:  # a test that signalled it waits for its own drain
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=self.drain_timeout_s + STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"arserve did not exit within {self.drain_timeout_s + STOP_GRACE} s of "
                        f"SIGTERM; killed:\n{self.stderr()[-4000:]}")

    def finish(self):
        """Teardown: stop, then fail on a bad exit status or a sanitizer report."""
        try:
            rc = self.stop()
        finally:
            self.kill()
        reports = sanitizer_reports(self.stderr())
        assert not reports, ("sanitizer reports in the daemon's stderr:\n" + "\n".join(reports)
                             + "\n--- stderr ---\n" + self.stderr()[-8000:])
        assert rc == self.expect_rc, \
            f"arserve exited with status {rc} after SIGTERM:\n{self.stderr()[-4000:]}"


@pytest.fixture
def start_daemon(tmp_path_factory):
    """start_daemon(model=TINY_MODEL, args=(), env=None, drain_timeout_s=10, binary=None)
    -> Daemon (binary: another build than ARSERVE_BIN); every daemon started is
    stopped and checked at the test's teardown."""
    started = []

    def start(model=TINY_MODEL, args=(), env=None, drain_timeout_s=10, binary=None):
        d = Daemon(str(tmp_path_factory.mktemp("arserve")), model, args, env, drain_timeout_s,
                   binary)
        started.append(d)
        return d

    yield start
    errors = []
    for d in started:
        try:
            d.finish()
        except BaseException as e:  # noqa: BLE001 - report every daemon, then fail
            errors.append(e)
    if errors:
        raise errors[0]


@pytest.fixture(scope="module")
def tiny_daemon(tmp_path_factory):
    """One tiny-model daemon shared by a module's tests (default settings,
    except a 64 KiB body limit so the 413 case stays small)."""
    d = Daemon(str(tmp_path_factory.mktemp("arserve")), TINY_MODEL,
               ["--max-body-bytes", "65536"])
    yield d
    d.finish()


def model_info(model_dir):
    """The model's name and image size, from its arserve.json (an image is
    grid * 2^(decoder levels - 1) pixels on each side)."""
    with open(os.path.join(model_dir, "arserve.json")) as f:
        cfg = json.load(f)
    scale = 2 ** (len(cfg["decoder"]["channel_multiplier"]) - 1)
    w, h = cfg["image"]["grid_width"] * scale, cfg["image"]["grid_height"] * scale
    return {"model": cfg["name"], "width": w, "height": h, "size": f"{w}x{h}",
            "steps": cfg["image"]["grid_width"] * cfg["image"]["grid_height"]}


def full_image_kv_bytes(model_dir):
    """The pool bytes one full-cache image of model_dir takes, as `arserve plan`
    counts them for f32 K and V (how the test daemons store them)."""
    p = subprocess.run([ARSERVE_BIN, "plan", "--model", model_dir, "--kv-dtype", "f32",
                        "--policy", "full"], capture_output=True, text=True, env=clean_env(),
                       timeout=scaled(30))
    assert p.returncode == 0, p.stderr
    m = re.search(r"^peak in the pool, blocks \(B\)\s+([0-9]+)$", p.stdout, re.M)
    assert m, p.stdout
    return int(m.group(1))


def one_image_pool_mb(model_dir):
    """A KV pool, in whole MiB, that holds one full-cache image of model_dir with
    at least a tenth to spare and can never hold two (nor even one and a half):
    the slow model's 9.3 MiB image gets 11 MiB, the sanitizer builds' 0.9 MiB one
    1 MiB."""
    image = full_image_kv_bytes(model_dir)
    mb = -(-int(1.1 * image) // (1 << 20))
    assert (mb << 20) < 1.5 * image, \
        f"no whole MiB pool holds one {image}-byte image of {model_dir} with a tenth to spare " \
        "and less than one and a half"
    return mb


@pytest.fixture(scope="session")
def tiny_info():
    return model_info(TINY_MODEL)
