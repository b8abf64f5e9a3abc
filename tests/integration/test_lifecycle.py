"""Requests under pressure, on the slow model (a second or two per image, so
requests are still running while the test looks): a full queue answers 429,
a client that goes away frees its KV, SIGTERM drains."""
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import (HTTP_TIMEOUT, SLOW_MODEL, full_image_kv_bytes, model_info, one_image_pool_mb,
                      png_size, scaled)

GEN = "/v1/images/generations"
# One engine thread: the slow model's timing then does not depend on how
# busy the machine's other cores are.
SLOW_ARGS = ["--threads", "1"]


@pytest.fixture(scope="module")
def slow_info():
    return model_info(SLOW_MODEL)


def post_in_thread(daemon, body, headers=None):
    """Starts a POST on its own connection; returns (thread, result dict)."""
    result = {}

    def run():
        try:
            with httpx.Client(base_url=daemon.url, timeout=HTTP_TIMEOUT) as c:
                result["response"] = c.post(GEN, json=body, headers=headers or {})
        except Exception as e:  # noqa: BLE001 - reported by the test
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def joined(t, result, timeout=HTTP_TIMEOUT):
    t.join(timeout)
    assert not t.is_alive(), "request thread still running"
    assert "error" not in result, repr(result.get("error"))
    return result["response"]


def running_is(n):
    return lambda m: m.get("arserve_requests_running") == n


# ---- queue overflow ------------------------------------------------------

def test_queue_overflow_is_429_with_retry_after_and_no_5xx(start_daemon, slow_info):
    d = start_daemon(SLOW_MODEL, [*SLOW_ARGS, "--max-running", "1", "--max-waiting", "1",
                                  "--retry-after-s", "3"])
    a = post_in_thread(d, {"prompt": "a red circle", "seed": 1})
    d.wait_metrics(running_is(1), what="request A running")
    b = post_in_thread(d, {"prompt": "a blue square", "seed": 2})
    d.wait_metrics(lambda m: m.get("arserve_requests_waiting") == 1, what="request B waiting")

    # One running, one waiting: the next ones are refused at once.
    t0 = time.monotonic()
    r = d.client.post(GEN, json={"prompt": "a green triangle", "seed": 3})
    assert time.monotonic() - t0 < scaled(2.0), "a 429 must not wait for a slot"
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "3"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "queue_full"
    assert err["type"] == "rate_limit_error"

    # A burst while the queue is full: every answer is a 200 or a 429.
    with ThreadPoolExecutor(6) as pool:
        def one(i):
            with httpx.Client(base_url=d.url, timeout=HTTP_TIMEOUT) as c:
                return c.post(GEN, json={"prompt": "a red circle", "seed": 10 + i})
        burst = list(pool.map(one, range(6), timeout=4 * HTTP_TIMEOUT))
    codes = sorted(x.status_code for x in burst)
    assert set(codes) <= {200, 429}, codes
    assert 429 in codes, codes
    for x in burst:
        if x.status_code == 429:
            assert x.headers.get("retry-after") == "3"

    # The two admitted ones finish normally.
    for t, res in (a, b):
        resp = joined(t, res)
        assert resp.status_code == 200, resp.text
        png = resp.json()["data"][0]["b64_json"]
        assert png

    m = d.metrics()
    codes = m.http_codes()
    assert not any(c.startswith("5") for c in codes), codes
    assert codes.get("429", 0) >= 1 + codes_count(burst, 429)
    assert m.get("arserve_admissions_refused_total", reason="queue_full") == \
        codes.get("429", 0)
    assert m.get("arserve_requests_waiting") == 0


def codes_count(responses, code):
    return sum(1 for r in responses if r.status_code == code)


def test_max_waiting_0_runs_now_or_answers_429(start_daemon):
    """--max-waiting 0 is no queue: a request that can start now runs, one
    that cannot (the one slot taken) gets 429 at once, saying why, and
    nothing is left waiting."""
    d = start_daemon(SLOW_MODEL, [*SLOW_ARGS, "--max-running", "1", "--max-waiting", "0",
                                  "--retry-after-s", "3"])
    r = d.client.post(GEN, json={"prompt": "a red circle", "seed": 1})
    assert r.status_code == 200, r.text

    a = post_in_thread(d, {"prompt": "a red circle", "seed": 2})
    d.wait_metrics(running_is(1), timeout=10, what="request A running")
    t0 = time.monotonic()
    r = d.client.post(GEN, json={"prompt": "a blue square", "seed": 3})
    assert time.monotonic() - t0 < scaled(2.0), "a 429 must not wait for a slot"
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "3"
    err = r.json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
    assert "no waiting queue (max_waiting 0)" in err["message"], err
    assert d.metrics().get("arserve_requests_waiting") == 0
    resp = joined(*a)
    assert resp.status_code == 200, resp.text

    # Free again: the next request runs.
    d.wait_idle(timeout=10)
    r = d.client.post(GEN, json={"prompt": "a blue square", "seed": 3})
    assert r.status_code == 200, r.text
    m = d.metrics()
    assert m.get("arserve_admissions_refused_total", reason="queue_full") == 1
    assert m.get("arserve_images_total", status="ok") == 3


# ---- a client that goes away --------------------------------------------

def raw_post(daemon, body):
    """A POST on a raw socket, so the test decides when the client vanishes."""
    s = socket.create_connection(("127.0.0.1", daemon.port), timeout=HTTP_TIMEOUT)
    data = json.dumps(body).encode()
    s.sendall(b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\nContent-Length: " + str(len(data)).encode()
              + b"\r\n\r\n" + data)
    return s


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_disconnect_mid_generation_frees_kv(start_daemon, slow_info, stream):
    d = start_daemon(SLOW_MODEL, SLOW_ARGS)
    idle = d.metrics()
    assert idle.get("arserve_kv_pool_reserved_bytes") == 0
    body = {"prompt": "a red circle", "seed": 9, "n": 2}
    if stream:
        body["stream"] = True
    s = raw_post(d, body)
    busy = d.wait_metrics(lambda m: m.get("arserve_requests_running") == 1
                          and m.get("arserve_kv_pool_used_bytes") > 0,
                          what="the request generating")
    assert busy.get("arserve_kv_pool_reserved_bytes") > 0
    if stream:
        # Read a little of the stream first: the response has started.
        assert s.recv(64).startswith(b"HTTP/1.1 200")
    t_close = time.monotonic()
    s.close()

    # A scrape is not atomic across families (each is read under its own
    # lock, in name order), so wait for every figure the test reads: the
    # scheduler counts the images and ends the job before it frees the
    # job's KV blocks, and a scrape between the two saw blocks still in use.
    after = d.wait_metrics(lambda m: m.get("arserve_requests_running") == 0
                           and m.get("arserve_kv_pool_reserved_bytes") == 0
                           and m.get("arserve_kv_pool_used_bytes") == 0
                           and m.get("arserve_images_total", status="cancelled") == 2,
                           timeout=5.0, what="the cancelled request's KV to be freed")
    freed_in = time.monotonic() - t_close
    assert after.get("arserve_kv_pool_used_bytes") == 0
    assert after.get("arserve_requests_cancelled_total") == \
        idle.get("arserve_requests_cancelled_total") + 1
    assert after.get("arserve_images_total", status="cancelled") == 2
    assert after.get("arserve_images_total", status="ok") == 0, \
        "the request ran to completion instead of being cancelled"
    # (images_total ok == 0 above says they did not run to their end.)
    assert freed_in < scaled(3.0), f"KV freed {freed_in:.2f} s after the client left"
    # A client that leaves is a client that left, not an internal error.
    log = d.stderr()
    assert "cancelling" in log and "internal error" not in log, log

    # The daemon is healthy and serves the next request.
    r = d.client.post(GEN, json={"prompt": "a blue square", "seed": 1},
                      headers={"Accept": "image/png"})
    assert r.status_code == 200
    assert png_size(r.content) == (slow_info["width"], slow_info["height"])
    # (The gauges are updated at the end of the engine iteration, which can
    # come a moment after the response.)
    d.wait_metrics(lambda m: m.get("arserve_kv_pool_reserved_bytes") == 0
                   and m.get("arserve_requests_running") == 0, timeout=5.0,
                   what="the KV pool idle again")


def test_disconnect_while_waiting_is_dropped(start_daemon):
    d = start_daemon(SLOW_MODEL, [*SLOW_ARGS, "--max-running", "1"])
    a = post_in_thread(d, {"prompt": "a red circle", "seed": 1})
    d.wait_metrics(running_is(1), what="request A running")
    s = raw_post(d, {"prompt": "a blue square", "seed": 2})
    d.wait_metrics(lambda m: m.get("arserve_requests_waiting") == 1, what="B waiting")
    s.close()
    resp = joined(*a)
    assert resp.status_code == 200
    # (images_total can trail A's response by a moment: waited for too.)
    m = d.wait_metrics(lambda m: m.get("arserve_requests_waiting") == 0
                       and m.get("arserve_requests_running") == 0
                       and m.get("arserve_images_total", status="ok") >= 1, what="idle")
    assert m.get("arserve_requests_cancelled_total") == 1
    assert m.get("arserve_images_total", status="ok") == 1
    assert m.get("arserve_images_total", status="cancelled") == 1
    assert m.get("arserve_kv_pool_reserved_bytes") == 0


def test_a_half_closed_client_gets_nothing_on_the_wire(start_daemon):
    """A client that shuts its sending side mid-generation has gone away: its
    job is cancelled and the connection closed with no bytes written. 499 is
    the code the metrics and the access log give it (nginx's), never a status
    line: no HTTP status 499 exists."""
    d = start_daemon(SLOW_MODEL, SLOW_ARGS)
    s = raw_post(d, {"prompt": "a red circle", "seed": 3, "n": 2})
    d.wait_metrics(running_is(1), what="the request generating")
    s.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := s.recv(4096):
        got += chunk
    s.close()
    assert got == b"", got[:200]
    m = d.wait_metrics(lambda m: m.get("arserve_requests_running") == 0
                       and m.get("arserve_images_total", status="cancelled") == 2,
                       what="the request cancelled")
    assert m.get("arserve_http_requests_total", route=GEN, code="499") == 1
    assert m.get("arserve_images_total", status="ok") == 0
    # The access log's line can trail the metric that counts the 499 (it did once under
    # AddressSanitizer): waited for.
    wait_for(lambda: " 499 " in d.stderr(), "the access log's 499 line")
    log = d.stderr()
    assert "internal error" not in log, log


# ---- SIGTERM drains -------------------------------------------------------

def test_sigterm_drains_in_flight_request_then_exits_0(start_daemon, slow_info):
    d = start_daemon(SLOW_MODEL, SLOW_ARGS, drain_timeout_s=30)
    inflight = post_in_thread(d, {"prompt": "a red circle", "seed": 5},
                              headers={"Accept": "image/png"})
    d.wait_metrics(lambda m: m.get("arserve_requests_running") == 1
                   and m.get("arserve_image_tokens_generated_total") > 0,
                   what="the request generating")
    assert d.client.get("/ready").status_code == 200

    d.signal(signal.SIGTERM)
    # /ready turns 503 while the request is still running...
    deadline = time.monotonic() + scaled(5)
    while True:
        r = d.client.get("/ready")
        if r.status_code == 503:
            break
        assert r.status_code == 200
        assert time.monotonic() < deadline, f"/ready still 200 {scaled(5):.1f} s after SIGTERM"
        time.sleep(0.02)
    assert inflight[0].is_alive(), "the request finished before the drain could be observed"
    # ...new requests are refused with 503...
    r = d.client.post(GEN, json={"prompt": "a blue square", "seed": 6})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "server_error"
    # ...the process lives and says so...
    assert d.client.get("/health").status_code == 200
    assert d.proc.poll() is None

    # ...and the request in flight completes.
    resp = joined(*inflight)
    assert resp.status_code == 200, resp.text
    assert png_size(resp.content) == (slow_info["width"], slow_info["height"])

    rc = d.proc.wait(timeout=scaled(15))
    assert rc == 0, d.stderr()
    assert "draining" in d.stderr()


def test_sigterm_idle_exits_0_quickly(start_daemon):
    d = start_daemon(SLOW_MODEL, SLOW_ARGS)
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.proc.wait(timeout=scaled(10)) == 0
    assert time.monotonic() - t0 < scaled(3.0)


def test_drain_timeout_cuts_off_and_still_exits_0(start_daemon):
    d = start_daemon(SLOW_MODEL, SLOW_ARGS + ["--max-n", "16"], drain_timeout_s=1)
    # Sixteen images in one request: far longer than the one-second drain
    # (four took 1.2 s once the engine read 16-bit weights, too close to it).
    inflight = post_in_thread(d, {"prompt": "a red circle", "seed": 5, "n": 16})
    d.wait_metrics(running_is(1), what="the request running")
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.proc.wait(timeout=scaled(15)) == 0, d.stderr()
    assert time.monotonic() - t0 < scaled(6.0)
    inflight[0].join(HTTP_TIMEOUT)
    assert not inflight[0].is_alive()
    # The cut-off client got an error status or a closed connection, not a hang.
    res = inflight[1]
    if "response" in res:
        assert res["response"].status_code >= 500


def process_state(pid):
    """The state letter of /proc/PID/stat (R, S, T for stopped, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def wait_for(pred, what, timeout=10.0):
    deadline = time.monotonic() + scaled(timeout)
    while not pred():
        assert time.monotonic() < deadline, f"{what}: not within {scaled(timeout):.1f} s"
        time.sleep(0.02)


def test_a_signal_delivered_twice_at_once_still_drains(start_daemon):
    """`timeout`, a supervisor and its process group, a terminal's Ctrl-C
    under a wrapper: one stop can reach the daemon as two signals a moment
    apart. They count once: the running request finishes."""
    d = start_daemon(SLOW_MODEL, SLOW_ARGS, drain_timeout_s=60)
    inflight = post_in_thread(d, {"prompt": "a red circle", "seed": 5})
    d.wait_metrics(running_is(1), what="the request running")
    # Two different signals, so that the kernel cannot merge them, sent
    # while the daemon is stopped: both wait and arrive together when it
    # goes on, however long this test takes between the two.
    d.signal(signal.SIGSTOP)
    wait_for(lambda: process_state(d.proc.pid) == "T", "the daemon stopped")
    d.signal(signal.SIGTERM)
    d.signal(signal.SIGINT)
    d.signal(signal.SIGCONT)
    assert d.proc.wait(timeout=scaled(30)) == 0, d.stderr()[-4000:]
    inflight[0].join(HTTP_TIMEOUT)
    assert inflight[1]["response"].status_code == 200, inflight[1]
    assert "second signal" not in d.stderr()


def test_second_signal_exits_at_once(start_daemon):
    d = start_daemon(SLOW_MODEL, SLOW_ARGS, drain_timeout_s=60)
    inflight = post_in_thread(d, {"prompt": "a red circle", "seed": 5, "n": 4})
    d.wait_metrics(running_is(1), what="the request running")
    d.signal(signal.SIGTERM)
    # Once the daemon has taken it (it says it drains), past its 0.25 s in
    # which a repeat counts as the same stop.
    wait_for(lambda: "draining:" in d.stderr(), "the daemon draining")
    time.sleep(0.3)
    assert d.proc.poll() is None, "exited before draining"
    t0 = time.monotonic()
    d.signal(signal.SIGINT)
    d.proc.wait(timeout=scaled(5))
    assert time.monotonic() - t0 < scaled(3.0)
    inflight[0].join(HTTP_TIMEOUT)
    d.expect_rc = d.proc.returncode  # checked above: it exited at once


# ---- the per-request deadline ---------------------------------------------

def test_request_deadline_fails_the_request_and_frees_its_kv(start_daemon):
    d = start_daemon(SLOW_MODEL, [*SLOW_ARGS, "--request-timeout-s", "1", "--max-n", "16"])
    t0 = time.monotonic()
    # Sixteen images against a one-second deadline. The deadline cuts the engine's steps (the
    # batcher), not the drawing after them: the steps of the whole request must outlast it.
    # Eight were not enough for the ThreadSanitizer pass's model on an idle AMX machine (its
    # first request's steps ended in under a second, then drawing took two: a 200); sixteen
    # outlast it there every time tried.
    r = d.client.post(GEN, json={"prompt": "a red circle", "seed": 1, "n": 16})
    assert time.monotonic() - t0 < scaled(4.0), "the deadline did not cut the request short"
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "server_error" and err["code"] == "timeout"
    m = d.wait_metrics(lambda m: m.get("arserve_requests_running") == 0
                       and m.get("arserve_kv_pool_reserved_bytes") == 0,
                       what="the expired request's KV to be freed")
    assert m.get("arserve_images_total", status="timeout") == 16
    assert m.get("arserve_images_total", status="ok") == 0


# ---- requests that could never run are refused at once ---------------------

def refused_at_once(d, body, code):
    """body is refused with a 400 naming n, without waiting in the queue (a
    request that can never be admitted would block the queue's head until
    its deadline: the short client timeout turns that into a failure)."""
    r = d.client.post(GEN, json=body, timeout=scaled(5))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and err["code"] == code, err
    return err


def test_request_larger_than_the_pool_is_refused_at_once(start_daemon):
    # A pool that runs one full-cache image at a time and can never hold two.
    d = start_daemon(SLOW_MODEL, [*SLOW_ARGS, "--kv-pool-mb", str(one_image_pool_mb(SLOW_MODEL))])
    a = post_in_thread(d, {"prompt": "a red circle", "seed": 1})
    d.wait_metrics(running_is(1), what="request A running")
    err = refused_at_once(d, {"prompt": "a red circle", "seed": 2, "n": 2}, "kv_pool_too_small")
    assert "KV cache" in err["message"], err
    # A request behind the refused one is served as usual.
    r = d.client.post(GEN, json={"prompt": "a red circle", "seed": 3})
    assert r.status_code == 200, r.text
    assert joined(*a).status_code == 200
    m = d.metrics()
    assert m.get("arserve_admissions_refused_total", reason="too_large") == 1
    assert m.get("arserve_images_total", status="ok") == 2


def test_an_image_larger_than_the_whole_pool_is_refused_naming_a_compressed_policy(start_daemon):
    """One full-cache image needs more than the whole pool (as Infinity-8B's 1024 px image
    beside a 2 GiB pool): a 400 naming kv_policy, saying that a compressed policy or a larger
    pool makes it fit, at once; the same image under StreamingLLM at a quarter of the cache is
    drawn by that daemon, its peak the plan's and within the pool."""
    mb = full_image_kv_bytes(SLOW_MODEL) // 2 >> 20
    if mb < 1:
        pytest.skip(f"{SLOW_MODEL}'s image needs under 2 MiB of KV: no whole-MiB pool below it")
    d = start_daemon(SLOW_MODEL, [*SLOW_ARGS, "--kv-pool-mb", str(mb)])
    r = d.client.post(GEN, json={"prompt": "a red circle", "seed": 1}, timeout=scaled(5))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_policy" and err["code"] == "kv_pool_too_small", err
    assert "compressed kv_policy" in err["message"] and "kv_pool_mb" in err["message"], err
    r = d.client.post(GEN, json={"prompt": "a red circle", "seed": 1, "kv_policy": "streaming",
                                 "kv_budget": 0.25})
    assert r.status_code == 200, r.text
    kv = r.json()["kv_cache"]
    assert kv["planned_peak_bytes"] == kv["peak_bytes"] <= mb << 20, kv


def test_more_images_than_max_running_is_refused_at_once(start_daemon):
    d = start_daemon(SLOW_MODEL, [*SLOW_ARGS, "--max-running", "2"])
    a = post_in_thread(d, {"prompt": "a red circle", "seed": 1, "n": 2})
    d.wait_metrics(running_is(1), what="request A running")
    err = refused_at_once(d, {"prompt": "a red circle", "seed": 2, "n": 3}, "too_many_images")
    assert "2 images" in err["message"], err
    r = d.client.post(GEN, json={"prompt": "a red circle", "seed": 3})
    assert r.status_code == 200, r.text
    assert joined(*a).status_code == 200
    assert d.metrics().get("arserve_admissions_refused_total", reason="too_large") == 1


# ---- a queued stream is kept alive -------------------------------------------

def test_stream_queued_behind_a_long_request_gets_keep_alives(start_daemon):
    # Sixteen images fill every running slot for seconds (2 s or more on every
    # build here); a stream that arrives meanwhile waits in the queue, and its
    # connection must not look dead to proxies and clients: an SSE comment
    # every --sse-keepalive-s until it starts. At 0.2 s the comment comes ten
    # times sooner than the long request can end (at the default 2 s the two
    # raced, and the long request sometimes won).
    d = start_daemon(SLOW_MODEL, [*SLOW_ARGS, "--max-n", "16", "--max-running", "16",
                                  "--sse-keepalive-s", "0.2"])
    long_request = raw_post(d, {"prompt": "a red circle", "seed": 1, "n": 16})
    d.wait_metrics(running_is(1), what="the long request running")
    comments, waiting_seen = [], False
    with d.client.stream("POST", GEN, json={"prompt": "a red circle", "seed": 2,
                                           "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            assert line.startswith(":"), f"the stream started before a keep-alive: {line!r}"
            comments.append(line)
            waiting_seen = d.metrics().get("arserve_requests_waiting") == 1
            break
    assert comments == [": keep-alive"], comments
    assert waiting_seen, "the keep-alive did not arrive while the stream was queued"
    # The stream's client left while it was queued: it is cancelled without
    # starting, the long request still running.
    d.wait_metrics(lambda m: m.get("arserve_requests_waiting") == 0
                   and m.get("arserve_images_total", status="cancelled") == 1
                   and m.get("arserve_images_total", status="ok") == 0,
                   what="the queued stream cancelled")
    # Then the long request's client leaves: it is cancelled and all KV freed.
    long_request.close()
    d.wait_metrics(lambda m: m.get("arserve_requests_running") == 0
                   and m.get("arserve_kv_pool_reserved_bytes") == 0
                   and m.get("arserve_images_total", status="cancelled") == 17,
                   what="both requests cancelled")


def _environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)


def test_serve_waits_passively_unless_told_otherwise(start_daemon):
    """`serve` starts itself again with OMP_WAIT_POLICY=passive (libgomp reads
    it only as it loads), keeping its pid and arguments; a caller's own
    OMP_WAIT_POLICY or GOMP_SPINCOUNT is left as it is."""
    d = start_daemon(env={"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None})
    env = _environ(d.proc.pid)
    assert env.get(b"OMP_WAIT_POLICY") == b"passive"
    with open(f"/proc/{d.proc.pid}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[:-1] == [a.encode() for a in d.argv]
    assert d.client.get("/health").status_code == 200
    d = start_daemon(env={"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": None})
    assert _environ(d.proc.pid).get(b"OMP_WAIT_POLICY") == b"active"
    d = start_daemon(env={"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "1000"})
    assert b"OMP_WAIT_POLICY" not in _environ(d.proc.pid)


def test_threads_beyond_the_cores_are_warned_of(start_daemon):
    """--threads that, with the drawing thread, asks for more cores than the
    process may use is said once at start, naming both settings; the default
    (--threads 0, the cores the drawing thread leaves) is not."""
    cores = len(os.sched_getaffinity(0))
    d = start_daemon(args=("--threads", str(cores)))
    assert d.client.get("/health").status_code == 200
    warned = [l for l in d.stderr().splitlines() if "ask for more than" in l]
    assert len(warned) == 1, d.stderr()
    assert f"--threads {cores} and --draw-threads 1" in warned[0]
    assert f"the {cores} core(s)" in warned[0]
    d = start_daemon()
    assert "ask for more than" not in d.stderr()
