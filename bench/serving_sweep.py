"""The serving measurement of docs/capacity.md, in one run on the machine at hand:

1. `arserve bench --profile` fits this machine's cost table for the model;
2. a daemon serves the model with a small KV pool, starting from that table and
   learning its own from its iterations, and `arserve bench` sweeps Poisson
   request rates for the full cache, for a compressed policy at a fixed budget,
   for an elastic budget range (kv_budget_min: admitted at the largest budget
   that fits the pool) and for the same range with the SLO as each request's
   objective (deadline_ms: admission then prices time too), the same pool for
   all: the throughput-latency curve of each, goodput at the SLO, the mean
   budget requests were admitted at (from the daemon's
   arserve_kv_admitted_budget_ratio histogram, scraped around each rate), what
   decided the objective run's admissions (arserve_admissions_total), and the
   rate at which p99 end-to-end latency passes the SLO;
3. the compressed runs' per-request traces are replayed through `arserve
   simulate` with the daemon's settings, priced by the profile's table and by
   the table the daemon had learned when that run ended (GET /v1/capacity):
   the simulator's error on throughput, mean and p99 latency and mean queue
   wait at each rate asked;
4. the curves are plotted (matplotlib) into a PNG.

With --sweeps N the rates are swept N times (ascending, then descending, ..),
the tables give medians and ranges, and out/summary.json keeps every sweep's
figures.

usage: python bench/serving_sweep.py --arserve build/arserve --model models/shapes \
           --out build/sweep --png docs/serving-sweep.png
"""
import argparse
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            sys.exit(f"the daemon exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    sys.exit("the daemon did not become ready")


def run(cmd):
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def rows(path):
    with open(path) as f:
        return [{k: (v if k in ("label", "source", "arrival") else float(v)) for k, v in r.items()}
                for r in csv.DictReader(f)]


def budget_sums(url, policy):
    """(sum, count) of arserve_kv_admitted_budget_ratio for policy, and
    arserve_kv_budget_below_max_total's count for it, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    got = [0.0, 0.0, 0.0]
    heads = (f'arserve_kv_admitted_budget_ratio_sum{{policy="{policy}"}} ',
             f'arserve_kv_admitted_budget_ratio_count{{policy="{policy}"}} ',
             f'arserve_kv_budget_below_max_total{{policy="{policy}"}} ')
    for line in text.splitlines():
        for i, head in enumerate(heads):
            if line.startswith(head):
                got[i] = float(line[len(head):])
    return got


def regimes(url):
    """arserve_admissions_total by regime, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    got = {"free": 0.0, "memory": 0.0, "time": 0.0}
    for line in text.splitlines():
        for k in got:
            head = f'arserve_admissions_total{{regime="{k}"}} '
            if line.startswith(head):
                got[k] = float(line[len(head):])
    return got


def admitted(before, after, top):
    """(mean budget, share admitted below the top, their mean budget) between
    two budget_sums readings, top the range's top (the rest ran at it); nan
    where nothing was admitted (or none below)."""
    total, n, below = (b - a for a, b in zip(before, after))
    if not n:
        return float("nan"), float("nan"), float("nan")
    rest = (total - (n - below) * top) / below if below else float("nan")
    return total / n, below / n, rest


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def slo_crossing(rs, slo_ms):
    """The request rate at which p99 end-to-end latency passes slo_ms, interpolated
    linearly between the two sweep points around it (None if it never does, or
    already does at the lowest rate)."""
    for a, b in zip(rs, rs[1:]):
        if a["p99_e2el_ms"] <= slo_ms < b["p99_e2el_ms"]:
            f = (slo_ms - a["p99_e2el_ms"]) / (b["p99_e2el_ms"] - a["p99_e2el_ms"])
            return a["request_rate"] + f * (b["request_rate"] - a["request_rate"])
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arserve", default="build/arserve")
    ap.add_argument("--model", default="models/shapes")
    ap.add_argument("--out", default="build/sweep")
    ap.add_argument("--png", default="docs/serving-sweep.png")
    ap.add_argument("--pool-mb", type=int, default=9, help="the KV pool (default 9 MiB: two "
                    "full-cache images of the demo model)")
    ap.add_argument("--threads", type=int, default=1, help="the daemon's CPU threads")
    ap.add_argument("--rates", default="1,2,3,4,5,6")
    ap.add_argument("-n", type=int, default=40, help="requests per rate")
    ap.add_argument("--slo-ms", type=float, default=3000, help="the p99 end-to-end SLO")
    ap.add_argument("--compressed", default='{"kv_policy": "linear", "kv_budget": 0.25}',
                    help="the compressed policy's request fields (JSON)")
    ap.add_argument("--elastic", default='{"kv_policy": "linear", "kv_budget": 1, '
                    '"kv_budget_min": 0.25}',
                    help="the elastic range's request fields (JSON); empty: no elastic run")
    ap.add_argument("--no-objective", action="store_true",
                    help="no run of the elastic range with the SLO as its objective")
    ap.add_argument("--validate-rates", default=None,
                    help="the compressed runs replayed through the simulator, comma-separated "
                    "(default: the sweep's middle rate)")
    ap.add_argument("--prompt", default="a red circle above a blue square",
                    help="every request's prompt (a class name for a class-conditional model)")
    ap.add_argument("--sweeps", type=int, default=1,
                    help="sweeps of every rate, the rates in turn ascending, then descending "
                    "(a machine whose speed drifts moves every rate alike); the tables give "
                    "the median and the range")
    a = ap.parse_args()
    if a.sweeps < 1:
        sys.exit("--sweeps must be at least 1")
    os.makedirs(a.out, exist_ok=True)
    costs = os.path.join(a.out, "costs.json")
    run([a.arserve, "bench", "--profile", "--model", a.model, "--threads", str(a.threads),
         "--max-batch", "16", "--out", costs])

    policies = {"full": {"kv_policy": "full"}, "compressed": json.loads(a.compressed)}
    if a.elastic:
        policies["elastic"] = json.loads(a.elastic)
        if not a.no_objective:
            policies["objective"] = {**json.loads(a.elastic), "deadline_ms": int(a.slo_ms)}
    rates = a.rates.split(",")
    validate = (a.validate_rates or rates[len(rates) // 2]).split(",")
    budgets = {}  # (sweep, policy, rate) -> the mean budget requests were admitted at
    decided = {}  # (sweep, policy, rate) -> admissions by regime
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    daemon_flags = ["--kv-pool-mb", str(a.pool_mb), "--max-running", "64", "--max-waiting",
                    "256", "--png-workers", "2"]
    proc = subprocess.Popen([a.arserve, "serve", "--model", a.model, "--port", str(port),
                             "--threads", str(a.threads), "--log-level", "warn",
                             "--cost-table", costs] + daemon_flags)

    def sweep_dir(k, name):
        return os.path.join(a.out, f"sweep-{k}", name)

    def learned_at(k, rate):
        return os.path.join(a.out, f"sweep-{k}", f"learned-{float(rate):g}.json")

    try:
        wait_ready(url, proc)
        mixes = {}
        for name, fields in policies.items():
            mixes[name] = os.path.join(a.out, f"{name}.mix.jsonl")
            with open(mixes[name], "w") as f:
                f.write(json.dumps({"prompt": a.prompt, **fields}) + "\n")
            for k in range(1, a.sweeps + 1):
                os.makedirs(os.path.dirname(sweep_dir(k, name)), exist_ok=True)
                if os.path.exists(os.path.join(sweep_dir(k, name), "results.csv")):
                    os.remove(os.path.join(sweep_dir(k, name), "results.csv"))
        # Rate by rate, the policies in turn at each (a machine whose speed
        # drifts during the sweep moves all of them alike), one run at a time
        # (results.csv gains a row each), so the daemon's budget histogram
        # can be read around each.
        for k in range(1, a.sweeps + 1):
            for rate in (rates if k % 2 else rates[::-1]):
                for name, fields in policies.items():
                    kind = fields.get("kv_policy", "full")
                    before, r0 = budget_sums(url, kind), regimes(url)
                    run([a.arserve, "bench", "--url", url, "--mix", mixes[name], "--rates", rate,
                         "-n", str(a.n), "--seed", str(k), "--goodput-e2el-ms", str(a.slo_ms),
                         "--out", sweep_dir(k, name), "--no-progress"])
                    after, r1 = budget_sums(url, kind), regimes(url)
                    budgets[(k, name, float(rate))] = admitted(before, after,
                                                               float(fields.get("kv_budget", 1)))
                    decided[(k, name, float(rate))] = {key: r1[key] - r0[key] for key in r0}
                    if name == "compressed" and rate in validate:
                        # The table the daemon had learned when this run ended: what
                        # replaying its trace is priced by.
                        with urllib.request.urlopen(url + "/v1/capacity", timeout=10) as r:
                            with open(learned_at(k, rate), "w") as f:
                                json.dump(json.loads(r.read())["cost_table"], f, indent=1)
        learned = os.path.join(a.out, "learned.json")
        with urllib.request.urlopen(url + "/v1/capacity", timeout=10) as r:
            capacity = json.loads(r.read())
        with open(learned, "w") as f:
            json.dump(capacity["cost_table"], f, indent=1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)

    curves = {}  # policy -> sweep -> rows, in rate order
    for name in policies:
        curves[name] = {}
        for k in range(1, a.sweeps + 1):
            rs = sorted(rows(os.path.join(sweep_dir(k, name), "results.csv")),
                        key=lambda r: r["request_rate"])
            for r in rs:
                if not r["completed"]:
                    sys.exit(f"{name} at {r['request_rate']:g} requests/s (sweep {k}): no request "
                             f"completed; see {sweep_dir(k, name)}/*.requests.jsonl for the "
                             "answers (a class-conditional model takes a class name: --prompt)")
            curves[name][k] = rs
    print(f"\nKV pool {a.pool_mb} MiB, {a.threads} thread(s); p99 SLO {a.slo_ms:g} ms; "
          f"{a.sweeps} sweep(s): medians, and the range where more than one")
    print(f"{'policy':<12}{'rate':>6}{'req/s':>8}{'goodput':>9}{'range':>14}{'images/s':>10}"
          f"{'p50 ms':>9}{'p99 ms':>9}{'queue ms':>10}{'running':>9}{'budget':>8}"
          f"{'below top':>10}{'at':>7}")
    summary = {"pool_mb": a.pool_mb, "threads": a.threads, "slo_ms": a.slo_ms, "n": a.n,
               "sweeps": a.sweeps, "rates": {}}
    for name, by_sweep in curves.items():
        for i, rate in enumerate(float(x) for x in sorted(rates, key=float)):
            got = [by_sweep[k][i] for k in by_sweep]
            med = {key: median([r[key] for r in got]) for key in got[0]
                   if not isinstance(got[0][key], str)}
            good = [r["request_goodput"] for r in got]
            bud = [budgets[(k, name, rate)] for k in by_sweep]
            b, below, at = (median(v) for v in zip(*bud))
            span = f"{min(good):.2f}-{max(good):.2f}" if len(good) > 1 else ""
            print(f"{name:<12}{rate:>6g}{med['request_throughput']:>8.2f}"
                  f"{med['request_goodput']:>9.2f}{span:>14}{med['images_per_s']:>10.2f}"
                  f"{med['median_e2el_ms']:>9.0f}{med['p99_e2el_ms']:>9.0f}"
                  f"{med['mean_queue_ms']:>10.0f}{med['kv_pool.max_running']:>9g}{b:>8.3f}"
                  f"{below:>10.2f}{at:>7.3f}")
            summary["rates"].setdefault(f"{rate:g}", {})[name] = {
                "goodput": good, "p99_ms": [r["p99_e2el_ms"] for r in got],
                "throughput": [r["request_throughput"] for r in got], "budget": b,
                "regimes": {key: sum(decided[(k, name, rate)][key] for k in by_sweep)
                            for key in ("free", "memory", "time")}}
        x = slo_crossing([{key: median([by_sweep[k][i][key] for k in by_sweep])
                           for key in ("request_rate", "p99_e2el_ms")}
                          for i in range(len(rates))], a.slo_ms)
        print(f"{name}: p99 passes {a.slo_ms:g} ms at "
              + (f"{x:.2f} requests/s" if x else "no rate of the sweep"))
    print("budget: the mean budget requests were admitted at; below top: the share admitted "
          "below their range's top; at: their mean budget (medians over the sweeps)")
    for rate, at_rate in summary["rates"].items() if "objective" in policies else ():
        good = {name: median(at_rate[name]["goodput"]) for name in at_rate}
        best = max(("full", "compressed"), key=good.get)
        d = at_rate["objective"]["regimes"]
        print(f"objective at {rate} requests/s: admissions {d['free']:g} free, "
              f"{d['memory']:g} memory-bound, {d['time']:g} time-bound; goodput "
              f"{good['objective']:.2f} against the best fixed choice's ({best}) {good[best]:.2f}")

    # The simulator against the measured traces, each priced by the profile's
    # table and by the table the daemon had learned when that run ended.
    print(f"\nthe daemon's learned table at the end: {capacity['cost_table']['source']}")
    errors = {}  # (table, rate, key) -> error per sweep, percent
    for k in range(1, a.sweeps + 1):
        for rate in validate:
            trace = os.path.join(sweep_dir(k, "compressed"),
                                 f"rate-{float(rate):g}.requests.jsonl")
            meas = json.load(open(os.path.join(sweep_dir(k, "compressed"),
                                               f"rate-{float(rate):g}.json")))
            for table, path in (("profile", costs), ("learned", learned_at(k, rate))):
                sim_dir = os.path.join(a.out, "simulated", f"sweep-{k}", f"{table}-{float(rate):g}")
                os.makedirs(os.path.dirname(sim_dir), exist_ok=True)
                run([a.arserve, "simulate", "--model", a.model, "--costs", path, "--trace", trace,
                     "--label", "trace", "--out", sim_dir] + daemon_flags)
                sim = json.load(open(os.path.join(sim_dir, "trace.json")))
                print(f"simulator ({table} table) vs daemon, compressed policy at {rate} "
                      f"requests/s, sweep {k} ({meas['completed']:g} requests):")
                for key in ("request_throughput", "mean_e2el_ms", "p99_e2el_ms", "mean_queue_ms"):
                    m, s = meas[key], sim[key]
                    err = (s - m) / m * 100 if m else float("nan")
                    errors.setdefault((table, rate, key), []).append(err)
                    print(f"  {key:<20} daemon {m:10.3f}  simulated {s:10.3f}  error {err:+6.1f}%")
    print("\nthe simulator's error, median over the sweeps [range]:")
    for (table, rate, key), errs in sorted(errors.items(), key=lambda e: (e[0][0], float(e[0][1]))):
        span = f" [{min(errs):+.1f}, {max(errs):+.1f}]" if len(errs) > 1 else ""
        print(f"  {table:<8} {rate:>5} req/s  {key:<20} {median(errs):+6.1f}%{span}")
        summary.setdefault("simulator", {}).setdefault(table, {}).setdefault(rate, {})[key] = errs
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for name, by_sweep in curves.items():
        rs = [{key: median([by_sweep[k][i][key] for k in by_sweep])
               for key in ("request_rate", "images_per_s", "p99_e2el_ms")}
              for i in range(len(rates))]
        label = {"full": "full cache", "compressed": a.compressed,
                 "objective": f"{a.elastic} with deadline_ms {a.slo_ms:g}"}.get(name, a.elastic)
        ax[0].plot([r["request_rate"] for r in rs], [r["images_per_s"] for r in rs], "o-",
                   label=label)
        ax[1].plot([r["images_per_s"] for r in rs], [r["p99_e2el_ms"] / 1e3 for r in rs], "o-",
                   label=label)
    ax[0].set_xlabel("offered load (requests/s, Poisson)")
    ax[0].set_ylabel("throughput (images/s)")
    ax[1].axhline(a.slo_ms / 1e3, color="grey", linestyle="--", label=f"SLO {a.slo_ms / 1e3:g} s")
    ax[1].set_xlabel("throughput (images/s)")
    ax[1].set_ylabel("p99 end-to-end latency (s)")
    ax[1].set_yscale("log")
    for x in ax:
        x.grid(alpha=0.3)
        x.legend(fontsize=8)
    medians = f", medians of {a.sweeps} sweeps" if a.sweeps > 1 else ""
    fig.suptitle(f"arserve bench on {os.path.basename(a.model)}, one {a.pool_mb} MiB KV pool, "
                 f"{a.threads} CPU thread(s){medians}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(a.png) or ".", exist_ok=True)
    fig.savefig(a.png, dpi=100)
    print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
