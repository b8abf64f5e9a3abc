"""`arserve bench`, the load client, against a real daemon: the files it writes (the
report with vLLM's key names, a line per request, a CSV row per run), latency counted
from each request's scheduled time (no coordinated omission), failures counted by
status and error code, goodput against an SLO, weighted request mixes, rate sweeps,
trace replay, the KV gauges it scrapes, the progress bar on a terminal only, and the
usage errors a user meets first. Most runs use the tiny model on one engine thread;
the slow model (about a second per image) where service time has to be visible."""
import csv
import json
import os
import pty
import subprocess

import pytest

from conftest import (ARSERVE_BIN, SLOW_MODEL, TINY_MODEL, Daemon, clean_env, free_port, model_info,
                      scaled)

# The subject is the load client (Python): the release build only.
pytestmark = pytest.mark.release_build

# The keys of a run's report a user compares across runs (vLLM's benchmark_serving
# names where they apply), and the latency metrics each have mean/median/std/pNN of.
REPORT_KEYS = ("label", "source", "arrival", "request_rate", "num_requests", "duration",
               "completed", "num_failed", "failed", "total_input_tokens",
               "total_output_tokens", "request_throughput", "images_per_s",
               "output_throughput", "request_goodput", "goodput_slo_ms", "kv_pool")
METRICS = ("e2el", "queue", "step", "decode_png")
STATS = ("mean", "median", "std", "p50", "p90", "p95", "p99")
KV_POOL_KEYS = ("samples", "capacity_bytes", "max_used_bytes", "mean_used_bytes",
                "max_reserved_bytes", "mean_reserved_bytes", "max_running", "mean_running",
                "max_waiting", "mean_waiting")
BAR = "done,"  # in every redraw of the progress bar: "[####...] 10/10 done, 0 failed, ..."


def bench(args, cwd, timeout=60, stderr=subprocess.PIPE):
    """Runs `arserve bench ARGS`; returns the CompletedProcess (text). No API key from
    the developer's shell reaches the daemon. timeout: the reference machine's seconds
    (a safety net, scaled here)."""
    env = clean_env()
    env.pop("OPENAI_API_KEY", None)
    return subprocess.run([ARSERVE_BIN, "bench", *map(str, args)], cwd=str(cwd),
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
                          text=True, timeout=scaled(timeout), env=env)


def bench_ok(args, cwd, timeout=60):
    p = bench(args, cwd, timeout)
    assert p.returncode == 0, f"bench exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p


def read_report(out, label):
    with open(os.path.join(out, label + ".json")) as f:
        return json.load(f)


def read_jsonl(out, label):
    with open(os.path.join(out, label + ".requests.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_csv(out):
    with open(os.path.join(out, "results.csv"), newline="") as f:
        return list(csv.reader(f))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny-model daemon on one engine thread, shared by the module's tests."""
    d = Daemon(str(tmp_path_factory.mktemp("arserve")), TINY_MODEL, ["--threads", "1"])
    yield d
    d.finish()


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """A slow-model daemon on one engine thread: each image takes a visible while."""
    d = Daemon(str(tmp_path_factory.mktemp("arserve")), SLOW_MODEL, ["--threads", "1"])
    yield d
    d.finish()


POISSON_N, POISSON_RATE = 20, 40


@pytest.fixture(scope="module")
def poisson_run(tiny, tmp_path_factory):
    """One Poisson run with --out: (out dir, stdout, stderr). Its per-request JSONL is
    also the trace the replay test sends again."""
    base = tmp_path_factory.mktemp("bench")
    out = str(base / "out")
    p = bench_ok(["--url", tiny.url, "--rate", POISSON_RATE, "-n", POISSON_N, "--seed", 3,
                  "--out", out], base)
    return out, p.stdout, p.stderr


def test_poisson_run_writes_report_jsonl_and_csv(poisson_run):
    """A Poisson run's three files agree with each other and with what was sent: the
    report has vLLM's keys and counts every request, the JSONL has one line per request
    at Poisson times with latency from the scheduled time, the CSV one row. Users diff
    these across runs and feed the JSONL back as a trace."""
    out, stdout, stderr = poisson_run
    steps = model_info(TINY_MODEL)["steps"]
    r = read_report(out, "rate-40")
    for k in REPORT_KEYS:
        assert k in r, f"report lacks {k}: {sorted(r)}"
    for m in METRICS:
        for s in STATS:
            assert f"{s}_{m}_ms" in r, f"report lacks {s}_{m}_ms"
    for k in KV_POOL_KEYS:
        assert k in r["kv_pool"], f"kv_pool lacks {k}"
    assert (r["label"], r["source"], r["arrival"], r["request_rate"]) == \
        ("rate-40", "bench", "poisson", POISSON_RATE)
    assert r["num_requests"] == POISSON_N
    assert r["completed"] == POISSON_N and r["num_failed"] == 0 and r["failed"] == {}, r

    lines = read_jsonl(out, "rate-40")
    assert len(lines) == POISSON_N
    t = [q["t"] for q in lines]
    assert t[0] > 0, "a Poisson schedule's first arrival is after a gap, not at 0"
    assert all(a <= b for a, b in zip(t, t[1:])), f"scheduled times not in order: {t}"
    gaps = [b - a for a, b in zip([0.0] + t, t)]
    mean_gap = sum(gaps) / len(gaps)
    assert 0.4 / POISSON_RATE < mean_gap < 2.5 / POISSON_RATE, f"mean gap {mean_gap}: {gaps}"
    assert max(gaps) > 2 * min(gaps), f"gaps look evenly spaced, not exponential: {gaps}"
    for q in lines:
        assert q["status"] == 200 and q["code"] == "", q
        assert q["sent"] >= q["t"] - 1e-6, f"sent before its scheduled time: {q}"
        assert q["done"] > q["sent"], q
        # Latency counts from the scheduled time, so it covers the send and more.
        assert q["e2el_ms"] >= (q["done"] - q["sent"]) * 1e3 - 0.01, q
        assert q["e2el_ms"] == pytest.approx((q["done"] - q["t"]) * 1e3, abs=0.01), q
        assert q["output_tokens"] == steps and q["steps"] == steps and q["images"] == 1, q
        assert q["queue_ms"] >= 0 and q["run_ms"] > 0 and q["decode_png_ms"] > 0, q
        assert q["request"] == {"prompt": "a red circle", "n": 1}, q

    # The summary is computed from those requests.
    assert r["total_output_tokens"] == sum(q["output_tokens"] for q in lines) == POISSON_N * steps
    assert r["total_input_tokens"] == sum(q["input_tokens"] for q in lines) > 0
    assert r["duration"] == pytest.approx(max(q["done"] for q in lines), abs=1e-5)
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"],
                                                   rel=1e-9)
    assert r["request_throughput"] == pytest.approx(POISSON_N / r["duration"], rel=1e-9)
    assert r["images_per_s"] == pytest.approx(POISSON_N / r["duration"], rel=1e-9)
    e2el = sorted(q["e2el_ms"] for q in lines)
    assert r["mean_e2el_ms"] == pytest.approx(sum(e2el) / len(e2el), abs=0.01)
    assert e2el[0] - 0.01 <= r["p50_e2el_ms"] <= r["p90_e2el_ms"] <= r["p99_e2el_ms"] \
        <= e2el[-1] + 0.01
    assert r["median_e2el_ms"] == r["p50_e2el_ms"]
    assert r["mean_step_ms"] > 0 and r["mean_decode_png_ms"] > 0

    rows = read_csv(out)
    assert len(rows) == 2, f"CSV is not a header and one row: {rows}"
    row = dict(zip(rows[0], rows[1]))
    assert row["label"] == "rate-40"
    assert float(row["completed"]) == r["completed"] == POISSON_N
    assert float(row["request_throughput"]) == pytest.approx(r["request_throughput"], rel=1e-5)

    # The summary reaches stdout; no progress bar when stderr is not a terminal.
    assert f"{POISSON_N} completed" in stdout, stdout
    assert BAR not in stderr, f"a progress bar on a pipe:\n{stderr!r}"


def test_latency_counts_from_the_scheduled_time(slow, tmp_path):
    """Four requests due at once with one allowed in flight go one after another, and
    each one's wait in the client is latency: the last request's e2el covers every
    request's service, not just its own. A client that timed from the send (coordinated
    omission) would report the daemon's latency as flat while users wait ever longer."""
    out = str(tmp_path / "out")
    bench_ok(["--url", slow.url, "--arrival", "burst", "-n", 4, "--max-inflight", 1,
              "--scrape-interval", 0, "--out", out], tmp_path)
    lines = read_jsonl(out, "burst-4")
    assert [q["status"] for q in lines] == [200] * 4, lines
    assert all(q["t"] == 0 for q in lines), "a burst schedules every request at 0"
    sent = sorted(q["sent"] for q in lines)
    done = sorted(q["done"] for q in lines)
    for k in range(1, 4):  # one at a time: each sent after the one before it finished
        assert sent[k] >= done[k - 1] - 1e-3, f"request {k} sent while another was in flight"
    service = [(q["done"] - q["sent"]) * 1e3 for q in lines]
    last = max(lines, key=lambda q: q["sent"])
    assert last["e2el_ms"] >= 0.9 * sum(service), \
        f"last e2el {last['e2el_ms']} ms < 0.9 x total service {sum(service)} ms: {lines}"
    # Beyond its own service, it waited out the others' (a client timing from
    # the send would report its own service alone); compared with what the
    # others took, not a multiple of its own, since service times vary.
    own = (last["done"] - last["sent"]) * 1e3
    assert last["e2el_ms"] - own >= 0.9 * (sum(service) - own), (own, lines)

    # The report's latency is the same, counted from the schedule.
    r = read_report(out, "burst-4")
    from_sched = [q["done"] * 1e3 for q in lines]  # t == 0
    assert r["mean_e2el_ms"] == pytest.approx(sum(from_sched) / 4, abs=0.01)
    assert r["p99_e2el_ms"] >= 0.9 * sum(service)
    assert r["mean_e2el_ms"] > 1.8 * sum(service) / 4, \
        f"mean e2el {r['mean_e2el_ms']} ms is about the service time: {r}"


def test_failures_counted_by_status_and_code(start_daemon, tmp_path):
    """A daemon with room for one running and one waiting request answers most of a
    burst of six with 429: the report counts them under "429", every request is either
    completed or failed, and the per-request lines carry the daemon's error code, so a
    user can tell a full queue from a broken connection."""
    d = start_daemon(SLOW_MODEL, ["--threads", "1", "--max-running", "1", "--max-waiting", "1"])
    out = str(tmp_path / "out")
    p = bench_ok(["--url", d.url, "--arrival", "burst", "-n", 6, "--scrape-interval", 0,
                  "--out", out], tmp_path)
    r = read_report(out, "burst-6")
    assert r["failed"].get("429", 0) >= 1, f"no 429 counted: {r['failed']}"
    assert set(r["failed"]) == {"429"}, r["failed"]
    assert r["completed"] + r["num_failed"] == 6, r
    assert r["num_failed"] == sum(r["failed"].values()), r
    assert r["completed"] >= 1
    lines = read_jsonl(out, "burst-6")
    assert len(lines) == 6
    rejected = [q for q in lines if q["status"] == 429]
    assert len(rejected) == r["failed"]["429"]
    assert all(q["code"] == "queue_full" for q in rejected), rejected
    assert all(q["code"] == "" for q in lines if q["status"] == 200), lines
    row = dict(zip(*read_csv(out)))
    assert float(row["num_failed"]) == r["num_failed"]
    assert '"429"' in p.stdout, p.stdout
    # Throughput counts the completed requests only.
    assert r["request_throughput"] == pytest.approx(r["completed"] / r["duration"], rel=1e-9)


def test_goodput_counts_requests_within_the_slo(tiny, tmp_path):
    """request_goodput counts only requests within --goodput-e2el-ms: none under an
    impossible SLO (while throughput is positive), all under a generous one. Goodput is
    what capacity planning reads, so it must move with the SLO."""
    strict, loose = str(tmp_path / "strict"), str(tmp_path / "loose")
    common = ["--url", tiny.url, "--arrival", "burst", "-n", 5, "--scrape-interval", 0]
    bench_ok(common + ["--goodput-e2el-ms", 0.001, "--out", strict], tmp_path)
    bench_ok(common + ["--goodput-e2el-ms", 1e8, "--out", loose], tmp_path)
    s, lo = read_report(strict, "burst-5"), read_report(loose, "burst-5")
    assert s["completed"] == lo["completed"] == 5
    assert s["request_throughput"] > 0
    assert s["request_goodput"] == 0, s
    assert s["goodput_slo_ms"]["e2el"] == 0.001
    assert lo["request_goodput"] == pytest.approx(lo["request_throughput"], rel=1e-12), lo
    assert lo["goodput_slo_ms"]["e2el"] == 1e8


MIX = [
    {"prompt": "a red circle", "kv_policy": "full", "weight": 3},
    # Budget 1/2: streaming's default budget does not fit the tiny model's 8 x 8 grid.
    {"prompt": "two green triangles", "kv_policy": "streaming", "kv_budget": 0.5, "weight": 1},
]


def test_mix_draws_bodies_by_weight_and_seed(tiny, tmp_path):
    """A JSONL mix sends its bodies in proportion to their weights (3:1 here, without
    the "weight" key in what is sent), and the same --seed draws the same sequence,
    another seed another one: a benchmark is repeatable, and mixes are not a fixed
    rotation."""
    mix = tmp_path / "mix.jsonl"
    mix.write_text("# full and streaming, 3:1\n" + "\n".join(json.dumps(m) for m in MIX) + "\n")
    bodies = [{k: v for k, v in m.items() if k != "weight"} for m in MIX]
    runs = {}
    for name, seed in (("a", 11), ("b", 11), ("c", 12)):
        out = str(tmp_path / name)
        bench_ok(["--url", tiny.url, "--arrival", "burst", "-n", 40, "--mix", mix,
                  "--seed", seed, "--scrape-interval", 0, "--out", out], tmp_path)
        lines = read_jsonl(out, "burst-40")
        assert [q["status"] for q in lines] == [200] * 40, \
            [q for q in lines if q["status"] != 200][:3]
        runs[name] = [q["request"] for q in lines]
    seq = runs["a"]
    assert all(b in bodies for b in seq), f"a body not from the mix: {seq[:3]}"
    full = sum(b == bodies[0] for b in seq)
    assert 0 < full < 40, "only one mix entry was sent"
    assert 22 <= full <= 37, f"{full} of 40 were the weight-3 entry (expected about 30)"
    assert runs["b"] == seq, "the same seed drew a different sequence"
    assert runs["c"] != seq, "another seed drew the same sequence"


def test_mix_line_without_prompt_names_file_and_line(tmp_path):
    """A mix line that is no request (no prompt) stops bench with status 2 and names the
    file and line, before anything is sent."""
    mix = tmp_path / "bad.jsonl"
    mix.write_text(json.dumps(MIX[0]) + "\n" + json.dumps({"kv_policy": "full"}) + "\n")
    out = tmp_path / "out"
    p = bench(["--url", f"http://127.0.0.1:{free_port()}", "--mix", mix, "-n", 2,
               "--out", out], tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert f"{mix}:2" in p.stderr, p.stderr
    assert "prompt" in p.stderr, p.stderr
    assert not out.exists(), "a report was written for a run that never started"


def test_rate_sweep_writes_one_report_per_rate(tiny, tmp_path):
    """--rates runs once per rate, in order: a report per rate named by it, and one CSV
    with one header and a row per run in that order. The same seed at twice the rate
    gives the same arrivals at half the times (the rate really paces the schedule)."""
    out = str(tmp_path / "out")
    p = bench_ok(["--url", tiny.url, "--rates", "20,40", "-n", 10, "--scrape-interval", 0,
                  "--out", out], tmp_path)
    r20, r40 = read_report(out, "rate-20"), read_report(out, "rate-40")
    assert (r20["request_rate"], r40["request_rate"]) == (20, 40)
    assert r20["completed"] == r40["completed"] == 10
    rows = read_csv(out)
    assert len(rows) == 3, f"CSV is not a header and two rows: {rows}"
    assert rows[0][0] == "label" and "completed" in rows[0]
    assert [row[0] for row in rows[1:]] == ["rate-20", "rate-40"]
    assert [float(dict(zip(rows[0], row))["request_rate"]) for row in rows[1:]] == [20, 40]
    t20 = [q["t"] for q in read_jsonl(out, "rate-20")]
    t40 = [q["t"] for q in read_jsonl(out, "rate-40")]
    assert t40 == pytest.approx([t / 2 for t in t20], abs=2e-6)
    assert p.stdout.index("rate-20") < p.stdout.index("rate-40")


def test_trace_replays_the_scheduled_times(poisson_run, tiny, tmp_path):
    """--trace with a run's own per-request JSONL sends the same bodies at the same
    scheduled times, and names the run "trace": a recorded load can be replayed against
    another build or configuration."""
    src, _, _ = poisson_run
    orig = read_jsonl(src, "rate-40")
    out = str(tmp_path / "out")
    bench_ok(["--url", tiny.url, "--trace", os.path.join(src, "rate-40.requests.jsonl"),
              "--scrape-interval", 0, "--out", out], tmp_path)
    assert sorted(os.listdir(out)) == ["results.csv", "trace.json", "trace.requests.jsonl"]
    r = read_report(out, "trace")
    assert (r["label"], r["arrival"], r["request_rate"]) == ("trace", "trace", 0), r
    assert r["completed"] == len(orig)
    lines = read_jsonl(out, "trace")
    assert [q["t"] for q in lines] == pytest.approx([q["t"] for q in orig], abs=2e-6)
    assert [q["request"] for q in lines] == [q["request"] for q in orig]
    for q in lines:
        assert q["status"] == 200, q
        # Sent at its time: never early, and not long after (the open loop keeps pace).
        assert q["t"] - 1e-6 <= q["sent"] < q["t"] + 0.5, q
    assert dict(zip(*read_csv(out)))["label"] == "trace"


def test_kv_gauges_scraped_during_the_run(slow, tmp_path):
    """While a run lasts, bench samples the daemon's KV pool and queue gauges from
    /metrics: the report's kv_pool has samples, the daemon's pool capacity, and saw a
    request running and KV in use. This is what ties latency to memory pressure."""
    capacity = slow.metrics().get("arserve_kv_pool_capacity_bytes")
    assert capacity > 0
    out = str(tmp_path / "out")
    bench_ok(["--url", slow.url, "--arrival", "burst", "-n", 2, "--scrape-interval", 0.1,
              "--out", out], tmp_path)
    r = read_report(out, "burst-2")
    assert r["completed"] == 2
    pool = r["kv_pool"]
    assert pool["samples"] > 0, pool
    assert pool["capacity_bytes"] == capacity, pool
    assert pool["max_running"] >= 1, pool
    assert 0 < pool["max_used_bytes"] <= capacity, pool
    assert 0 <= pool["mean_used_bytes"] <= pool["max_used_bytes"], pool
    assert float(dict(zip(*read_csv(out)))["kv_pool.max_running"]) == pool["max_running"]


def test_scrape_interval_is_honoured(tiny, tmp_path):
    """--scrape-interval S samples /metrics every S seconds: a run far shorter than S
    takes the one sample at its start (two at most), not one per answer. Sampling on
    every completion loads the daemon being measured at high rates and weights the
    gauges' means toward the moments requests end."""
    out = str(tmp_path / "out")
    interval = scaled(30)
    bench_ok(["--url", tiny.url, "--arrival", "burst", "-n", 40, "--scrape-interval", interval,
              "--out", out], tmp_path)
    r = read_report(out, "burst-40")
    assert r["duration"] < interval
    assert 1 <= r["kv_pool"]["samples"] <= 2, \
        (f"{r['kv_pool']['samples']} scrapes in {r['duration']:.2f} s at --scrape-interval "
         f"{interval:.0f}: "
         "the scraper re-scrapes whenever a request finishes (cli/cmd_bench.c scraper: its "
         "pthread_cond_timedwait on r->changed wakes at every send_one broadcast)")


def run_on_pty(args, cwd, timeout=60):
    """Runs bench with stderr on a pseudo-terminal; returns (status, what the terminal
    got). timeout as bench()'s."""
    master, slave = pty.openpty()
    env = clean_env()
    env.pop("OPENAI_API_KEY", None)
    try:
        p = subprocess.Popen([ARSERVE_BIN, "bench", *map(str, args)], cwd=str(cwd),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave,
                             env=env)
    finally:
        os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        return p.wait(timeout=scaled(timeout)), b"".join(chunks).decode("utf-8", "replace")
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
            p.wait()


def test_progress_bar_only_on_a_terminal(tiny, tmp_path):
    """On a terminal, bench draws a progress bar on stderr (filled at the end); with
    --no-progress it draws none. (A pipe gets none either: the Poisson test checks.)"""
    common = ["--url", tiny.url, "--rate", 50, "-n", 10, "--scrape-interval", 0]
    rc, tty = run_on_pty(common, tmp_path)
    assert rc == 0, tty
    assert BAR in tty and "[#" in tty, f"no progress bar on the terminal:\n{tty!r}"
    assert "10/10 done, 0 failed" in tty, tty
    rc, tty = run_on_pty(common + ["--no-progress"], tmp_path)
    assert rc == 0, tty
    assert BAR not in tty and "[#" not in tty, f"a progress bar despite --no-progress:\n{tty!r}"
    assert "arserve bench: rate-50" in tty  # stderr did reach the terminal


def test_bad_usage_and_unreachable_daemon(tmp_path):
    """Usage errors exit 2 naming the flag; a daemon that cannot be reached is a run
    whose requests all failed with "connection", reported, with status 0 (the report,
    not the exit status, says how a run went)."""
    p = bench(["--url", "ftp://x", "-n", 1], tmp_path)
    assert p.returncode == 2 and "--url" in p.stderr, (p.returncode, p.stderr)
    p = bench(["--rates", "1,2", "--arrival", "burst", "-n", 1], tmp_path)
    assert p.returncode == 2 and "--rates" in p.stderr, (p.returncode, p.stderr)

    out = str(tmp_path / "out")
    port = free_port()  # nothing listens there once free_port closed it
    p = bench(["--url", f"http://127.0.0.1:{port}", "--arrival", "burst", "-n", 3,
               "--timeout", 10, "--out", out], tmp_path)
    assert p.returncode == 0, (p.returncode, p.stderr)
    r = read_report(out, "burst-3")
    assert r["failed"] == {"connection": 3}, r["failed"]
    assert (r["completed"], r["num_failed"]) == (0, 3)
    assert r["request_throughput"] == 0 and r["request_goodput"] == 0
    assert r["kv_pool"]["samples"] == 0
    lines = read_jsonl(out, "burst-3")
    assert [(q["status"], q["code"]) for q in lines] == [(0, "connection")] * 3
    assert '{"connection":3}' in p.stdout, p.stdout
