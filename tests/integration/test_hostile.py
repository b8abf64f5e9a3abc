"""Hostile clients against a real daemon on loopback: requests mangled by
zzuf, clients killed mid-generation round after round, clients that give up
before their image is done. After each, the daemon must be alive, idle (no
request running or waiting, an empty KV pool, no connection left open) and
serving.

Bounds are written for the reference machine and stretched by this machine's
measured speed (conftest.scaled; Daemon.wait_metrics scales its own); counts are
fixed and small.
"""
import json
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import (SLOW_MODEL, TINY_MODEL, b64_png_size, is_idle, model_info, png_size,
                      scaled)

GEN = "/v1/images/generations"

# Every test here: a minute on the reference machine at most (conftest stretches it).
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def slow_info():
    return model_info(SLOW_MODEL)


@pytest.fixture(scope="module")
def tiny_info():
    return model_info(TINY_MODEL)


def wait_fds(d, baseline, timeout, what):
    """Waits until the daemon holds no more descriptors than baseline: every
    connection the test opened is closed on the daemon's side too."""
    deadline = time.monotonic() + timeout
    while True:
        n = d.open_fds()
        if n <= baseline:
            return n
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: the daemon still holds {n} descriptors ({baseline} before) "
                        f"{timeout:.1f} s later: connections left open")
        time.sleep(0.05)


def normal_request_succeeds(d, info):
    r = d.client.post(GEN, json={"prompt": "a red circle", "seed": 3})
    assert r.status_code == 200, f"a normal request after the test: {r.status_code} {r.text}"
    assert b64_png_size(r.json()["data"][0]["b64_json"]) == (info["width"], info["height"])


def no_5xx_but_503(m):
    codes = m.http_codes()
    bad = {c: n for c, n in codes.items() if c.startswith("5") and c != "503"}
    assert not bad, f"the daemon counted 5xx answers other than 503: {codes}"


# ---- 1. mangled traffic ------------------------------------------------------

ZZUF = shutil.which("zzuf")
RATIOS = (0.01, 0.05, 0.2, 0.5)
CASES_PER_RATIO = 20
# A mangled exchange: the daemon has ANSWER_S to answer what it got; a
# request it is still reading then (a Content-Length grown by a flipped bit, a
# header block never ended) gets the client's end of stream, after which the
# daemon has CLOSE_S to answer or close. Longer than either is a hang.
ANSWER_S = 1.0
CLOSE_S = 3.0

STATUS_LINE_RE = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9]) [^\r\n]*")


def _get(path):
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n".encode()


def _post(body, accept="application/json"):
    data = json.dumps(body).encode()
    head = (f"POST {GEN} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Accept: {accept}\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    return head, data


# (name, header bytes, body bytes): every route, and generations of each kind.
TEMPLATES = [
    ("page", _get("/"), b""),
    ("health", _get("/health"), b""),
    ("ready", _get("/ready"), b""),
    ("models", _get("/v1/models"), b""),
    ("metrics", _get("/metrics"), b""),
    ("gen", *_post({"prompt": "a red circle", "seed": 7})),
    ("gen_png", *_post({"prompt": "a blue square", "seed": 8}, accept="image/png")),
    ("gen_stream", *_post({"prompt": "a green triangle", "seed": 9, "n": 2, "stream": True,
                           "partial_images": 1})),
]


def mangle(data, seed, ratio):
    """data with a fraction ratio of its bits flipped by zzuf (seeded, so the
    same bytes every run)."""
    argv = [ZZUF, f"-s{seed}", f"-r{ratio}"]
    out = subprocess.run(argv, input=data, capture_output=True, timeout=scaled(10))
    assert out.returncode == 0, f"{argv} failed: {out.stderr!r}"
    assert len(out.stdout) == len(data), f"{argv} changed the length"
    return out.stdout


def cases(ratio_index, ratio):
    """CASES_PER_RATIO (name, seed, bytes): every template in turn; on the
    second pass through them the generations have only their body mangled,
    so the JSON parser gets mangled bodies behind intact headers too."""
    out = []
    for i in range(CASES_PER_RATIO):
        name, head, body = TEMPLATES[i % len(TEMPLATES)]
        seed = 1000 * (ratio_index + 1) + i
        if body and (i // len(TEMPLATES)) % 2 == 1:
            out.append((name + "/body", seed, head + mangle(body, seed, ratio)))
        else:
            out.append((name, seed, mangle(head + body, seed, ratio)))
    return out


def parse_response(buf, at_eof):
    """(status code, complete) of the first response in buf, complete when
    its whole body is in buf; None while the status line is not; raises
    ValueError for bytes that are not an HTTP/1.x response."""
    eol = buf.find(b"\r\n")
    if eol < 0:
        if not b"HTTP/1.".startswith(buf[:7]):
            raise ValueError("not a status line")
        if buf and at_eof or len(buf) > 256:
            raise ValueError("no end to the status line")
        return None
    m = STATUS_LINE_RE.fullmatch(buf[:eol])
    if not m:
        raise ValueError("malformed status line")
    code = int(m.group(1))
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return code, False
    headers = {}
    for line in buf[eol + 2:end].split(b"\r\n"):
        k, sep, v = line.partition(b":")
        if not sep:
            raise ValueError(f"malformed header line {line!r}")
        headers[k.strip().lower()] = v.strip()
    body = buf[end + 4:]
    if code in (204, 304) or 100 <= code < 200:
        return code, True
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        return code, _chunked_complete(body)
    if b"content-length" in headers:
        return code, len(body) >= int(headers[b"content-length"])
    return code, at_eof  # delimited by the end of the connection


def _chunked_complete(body):
    pos = 0
    while True:
        eol = body.find(b"\r\n", pos)
        if eol < 0:
            return False
        size = int(body[pos:eol].split(b";")[0], 16)
        if size == 0:  # the last chunk, then trailers up to an empty line
            return body.find(b"\r\n\r\n", eol) >= 0
        pos = eol + 2 + size + 2
        if pos > len(body):
            return False


def exchange(port, data):
    """Sends data on a fresh connection and reads the first answer. Returns
    (outcome, status code or None, seconds): outcome is 'answered', 'closed'
    (the daemon hung up without a word), 'malformed: ...', 'truncated' or
    'hang', with '+eof' added when the daemon had not answered within
    ANSWER_S and the test ended its side of the stream."""
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port), timeout=scaled(ANSWER_S))
    buf, eof, half_closed, code = b"", False, False, None
    deadline = t0 + scaled(ANSWER_S)

    def done(outcome):
        return outcome + ("+eof" if half_closed else ""), code, time.monotonic() - t0

    try:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused the start of it and hung up: read what it said
        while True:
            try:
                got = parse_response(buf, eof)
            except ValueError as e:
                return done(f"malformed: {e}: {buf[:120]!r}")
            code = got[0] if got else None
            if got and got[1]:
                return done("answered")
            if eof:
                return done("truncated" if buf else "closed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if half_closed or buf:
                    return done("hang")
                # Still reading our request, or still working: end our side
                # of the stream; the daemon must then finish within CLOSE_S.
                s.shutdown(socket.SHUT_WR)
                half_closed = True
                deadline = time.monotonic() + scaled(CLOSE_S)
                continue
            s.settimeout(remaining)
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                continue
            except ConnectionResetError:
                chunk = b""
            if chunk:
                buf += chunk
            else:
                eof = True
    finally:
        s.close()


def version_of(data):
    """The HTTP version token of a request's first line, as sent."""
    line = data.split(b"\n", 1)[0].rstrip(b"\r")
    return line.rsplit(b" ", 1)[-1] if b" " in line else b""


@pytest.mark.parametrize("ratio_index,ratio", list(enumerate(RATIOS)),
                         ids=[f"r{r}" for r in RATIOS])
def test_mangled_requests_get_well_formed_answers_and_leave_the_daemon_idle(
        start_daemon, tiny_info, ratio_index, ratio):
    if not ZZUF:
        pytest.fail("zzuf is missing: `make deps` installs it (apt-get install zzuf)")
    d = start_daemon(TINY_MODEL)
    todo = cases(ratio_index, ratio)
    d.metrics()  # the fixture's own keep-alive connection is open from here on
    fds_before = d.open_fds()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: (c, *exchange(d.port, c[2])), todo,
                                timeout=scaled(len(todo) * (ANSWER_S + CLOSE_S))))

    summary, problems, slowest = {}, [], 0.0
    for (name, seed, data), outcome, code, took in results:
        kind = outcome.split(":")[0]
        key = f"{kind} {code}" if code else kind
        summary[key] = summary.get(key, 0) + 1
        slowest = max(slowest, took)
        shown = data if len(data) <= 160 else data[:80] + b" ... " + data[-80:]
        where = f"{name} (zzuf -s{seed} -r{ratio}, {took:.2f} s): {shown!r}"
        if kind not in ("answered", "closed", "answered+eof", "closed+eof"):
            problems.append(f"{outcome}: {where}")
        elif code is not None and code >= 500 and code != 503:
            # 505 is the right answer to a version that is not HTTP/1.x.
            if not (code == 505 and version_of(data) not in (b"HTTP/1.0", b"HTTP/1.1")):
                problems.append(f"status {code}: {where}")
    print(f"ratio {ratio}: {summary}; slowest exchange {slowest:.2f} s")
    assert not problems, (f"ratio {ratio}: {len(problems)} bad exchanges of {len(todo)} "
                          f"({summary}):\n" + "\n".join(problems))
    assert any(k.startswith("answered") for k in summary), \
        f"no mangled request was answered at all ({summary}): is the test sending anything?"

    assert d.proc.poll() is None, f"arserve died: {d.stderr()[-4000:]}"
    assert d.client.get("/health").status_code == 200
    m = d.wait_idle(timeout=5.0, what="idle after the mangled requests")
    no_5xx_but_503(m)
    wait_fds(d, fds_before, scaled(5.0), "after the mangled requests")
    normal_request_succeeds(d, tiny_info)


# ---- 2. killed clients, round after round ---------------------------------------

KILL_ROUNDS = 10
VICTIM_IMAGES = 2   # each victim asks for this many: seconds of work, never done in time
# The victims run under another KV policy than the background load, so the
# daemon's per-policy admission counter counts the victims alone.
VICTIM_POLICY = "streaming"
BACKGROUND_CLIENTS = 2
SLOW_ARGS = ["--threads", "1"]


def raw_post(port, body):
    s = socket.create_connection(("127.0.0.1", port), timeout=scaled(10.0))
    data = json.dumps(body).encode()
    s.sendall(f"POST {GEN} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def reset_close(s):
    """Closes with an RST (SO_LINGER 0) instead of a FIN: a client that crashed."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def background_load(d, stop, results, seed0):
    """Normal requests, one after another, until stop is set."""
    with httpx.Client(base_url=d.url, timeout=scaled(60.0)) as c:
        i = 0
        while not stop.is_set():
            try:
                r = c.post(GEN, json={"prompt": "a red circle", "seed": seed0 + i},
                           headers={"Accept": "image/png"})
                results.append((r.status_code, r.content if r.status_code == 200 else r.text))
            except Exception as e:  # noqa: BLE001 - reported by the test
                results.append((None, repr(e)))
            i += 1


def test_clients_killed_mid_generation_in_a_loop_leave_the_pool_idle(start_daemon, slow_info):
    curl = shutil.which("curl")
    if not curl:
        pytest.fail("curl is missing: `make deps` installs it")
    d = start_daemon(SLOW_MODEL, SLOW_ARGS)
    m0 = d.metrics()
    assert is_idle(m0), m0.text
    fds_before = d.open_fds()

    stop, background, threads = threading.Event(), [], []
    for k in range(BACKGROUND_CLIENTS):
        t = threading.Thread(target=background_load, args=(d, stop, background, 100 * k),
                             daemon=True)
        t.start()
        threads.append(t)

    victims = 0
    curls = []
    try:
        for rnd in range(KILL_ROUNDS):
            # Three at once, each killed its own way: a plain request reset
            # by a crashed client, a stream closed after its first bytes, a
            # curl SIGKILLed.
            seed = 1000 + 10 * rnd
            victim = {"prompt": "a red circle", "n": VICTIM_IMAGES, "kv_policy": VICTIM_POLICY}
            plain = raw_post(d.port, {**victim, "seed": seed})
            stream = raw_post(d.port, {**victim, "seed": seed + 1, "stream": True,
                                       "partial_images": 2})
            proc = subprocess.Popen(
                [curl, "-s", "-o", "/dev/null", "-H", "Content-Type: application/json",
                 "--data", json.dumps({**victim, "seed": seed + 2}), f"{d.url}{GEN}"],
                stdin=subprocess.DEVNULL)
            curls.append(proc)
            victims += 3
            # All three queued, none waiting (the pool holds them all): all
            # running; two engine iterations later, generating.
            admitted = d.wait_metrics(
                lambda m: m.get("arserve_images_admitted_total", policy=VICTIM_POLICY)
                == victims * VICTIM_IMAGES and m.get("arserve_requests_waiting") == 0,
                timeout=10.0, what=f"round {rnd}'s three requests running")
            it = admitted.get("arserve_iterations_total")
            d.wait_metrics(lambda m: m.get("arserve_iterations_total") >= it + 2,
                           timeout=10.0, what=f"round {rnd}'s requests generating")
            assert stream.recv(16).startswith(b"HTTP/1.1 200"), "the stream did not start"
            reset_close(plain)
            stream.close()
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=scaled(5.0))
        t_last_kill = time.monotonic()

        # Every victim is cancelled, promptly: it never runs to its end.
        m = d.wait_metrics(lambda m: m.get("arserve_requests_cancelled_total") >=
                           m0.get("arserve_requests_cancelled_total") + victims,
                           timeout=3.0, what=f"{victims} killed clients' requests cancelled")
        cancelled_in = time.monotonic() - t_last_kill
    finally:
        stop.set()
        for p in curls:
            if p.poll() is None:
                p.kill()
                p.wait()
        for t in threads:
            t.join(scaled(60.0))
    assert not any(t.is_alive() for t in threads), "a background client is still running"

    # The normal load beside the killing was served in full.
    assert background, "the background clients sent nothing"
    for code, payload in background:
        assert code == 200, f"a normal request beside the killed ones: {code} {payload}"
        assert png_size(payload) == (slow_info["width"], slow_info["height"])

    t0 = time.monotonic()
    m = d.wait_idle(timeout=5.0, what="the pool idle after the load's end")
    print(f"{victims} clients killed in {KILL_ROUNDS} rounds beside {len(background)} normal "
          f"requests; all cancelled {cancelled_in:.2f} s after the last kill; "
          f"idle {time.monotonic() - t0:.2f} s after the normal load ended")
    assert m.get("arserve_requests_cancelled_total") == \
        m0.get("arserve_requests_cancelled_total") + victims
    assert m.get("arserve_images_total", status="cancelled") == victims * VICTIM_IMAGES
    assert m.get("arserve_images_total", status="ok") == len(background), \
        "a killed client's request ran to completion"
    no_5xx_but_503(m)
    wait_fds(d, fds_before, scaled(5.0), "after the killed clients")
    normal_request_succeeds(d, slow_info)
    log = d.stderr()
    assert "internal error" not in log, log[-4000:]


# ---- 3. clients with deadlines shorter than their job ------------------------------

# Ten requests, two of them abandoned: each pass of the suite (release and both
# sanitizers) runs it, and twenty cost 40 s under ThreadSanitizer for no path
# that ten miss.
DEADLINE_REQUESTS = 10
SHORT_EVERY = 5         # one in five gives up early
SHORT_DEADLINE_S = 0.3  # the client's timeout; its job (8 images) takes seconds
# 8, not the default most of 4 (the daemon is started with --max-n 8): a 4-image job, batched,
# once ended within the 0.1 s the daemon takes to see its client gone, under ThreadSanitizer on
# a slow machine (x3.4 bounds), and was counted finished, not cancelled.
SHORT_IMAGES = 8
DEADLINE_CLIENTS = 4


def test_clients_that_give_up_early_are_cancelled_and_the_rest_served(start_daemon, slow_info):
    d = start_daemon(SLOW_MODEL, SLOW_ARGS + ["--max-n", str(SHORT_IMAGES)])
    m0 = d.metrics()
    fds_before = d.open_fds()

    def one(i):
        short = i % SHORT_EVERY == SHORT_EVERY // 2
        body = {"prompt": "a red circle", "seed": i}
        if short:
            body["n"] = SHORT_IMAGES
        timeout = scaled(SHORT_DEADLINE_S) if short else scaled(60.0)
        t0 = time.monotonic()
        try:
            with httpx.Client(base_url=d.url, timeout=timeout) as c:
                r = c.post(GEN, json=body)
            return short, r.status_code, r, time.monotonic() - t0
        except httpx.TimeoutException as e:
            return short, "timeout", e, time.monotonic() - t0

    t0 = time.monotonic()
    with ThreadPoolExecutor(DEADLINE_CLIENTS) as pool:
        results = list(pool.map(one, range(DEADLINE_REQUESTS), timeout=scaled(50.0)))
    took = time.monotonic() - t0

    n_short = sum(1 for short, *_ in results if short)
    assert n_short == DEADLINE_REQUESTS // SHORT_EVERY
    for short, code, r, t in results:
        if short:
            assert code == "timeout", \
                f"a request with a {scaled(SHORT_DEADLINE_S)} s deadline was answered " \
                f"({code}) in {t:.2f} s: its job is meant to outlast the deadline"
        else:
            assert code == 200, f"a normal request beside the abandoned ones: {code} {r.text}"
            assert b64_png_size(r.json()["data"][0]["b64_json"]) == \
                (slow_info["width"], slow_info["height"])

    # The abandoned requests are cancelled (not run to their end) and freed.
    m = d.wait_metrics(lambda m: is_idle(m) and m.get("arserve_requests_cancelled_total")
                       >= m0.get("arserve_requests_cancelled_total") + n_short,
                       timeout=5.0, what=f"the {n_short} abandoned requests cancelled and "
                       "the pool idle")
    print(f"{DEADLINE_REQUESTS} requests ({n_short} abandoned after {scaled(SHORT_DEADLINE_S)} s) "
          f"in {took:.2f} s")
    assert m.get("arserve_requests_cancelled_total") == \
        m0.get("arserve_requests_cancelled_total") + n_short
    assert m.get("arserve_images_total", status="cancelled") == n_short * SHORT_IMAGES
    assert m.get("arserve_images_total", status="ok") == DEADLINE_REQUESTS - n_short
    no_5xx_but_503(m)
    wait_fds(d, fds_before, scaled(5.0), "after the abandoned requests")
    normal_request_succeeds(d, slow_info)
