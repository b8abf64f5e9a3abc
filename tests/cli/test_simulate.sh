#!/usr/bin/env bash
# CLI tests for `arserve simulate`: on a cost table whose numbers make the
# clock easy to follow (an iteration costs 10 ms whatever it steps; the tiny
# model's requests take 64 steps), the simulated times must be exactly what
# the daemon's batcher would do: one request at a time under --max-running 1,
# all at once under a larger one, spread over replicas, serialised by a KV
# pool that holds one request, refused when the queue is full or the pool
# too small, decode on the engine thread and PNGs on the workers, a closed
# loop pacing itself. Then the paper projections' cost tables run on their
# presets, and bad input is refused with exit 2 naming the problem.
# usage: tests/cli/test_simulate.sh path/to/arserve path/to/tiny-model path/to/var-tiny-model python
set -u
bin=$1 model=$2 var_model=$3 py=$4
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0

ok()   { passed=$((passed + 1)); echo "ok      $1"; }
fail() { failed=$((failed + 1)); echo "not ok  $1"; [ -n "${2:-}" ] && echo "  $2"; }

# costs FILE INTERCEPT DECODE PNG: a raster cost table.
costs() {
    cat >"$1" <<EOF
{"family": "raster", "source": "test",
 "step": {"intercept_s": $2, "per_sequence_s": 0, "per_kv_attended_s": 0, "per_new_token_s": 0},
 "decode_s_per_image": $3, "png_s_per_image": $4}
EOF
}
costs "$tmp/c.json" 0.01 0 0
costs "$tmp/cd.json" 0.01 0.1 0.05

# sim NAME EXPR ARGS...: runs simulate with --out, then checks the Python
# expression EXPR over r (the run's report) and q (its requests).
sim() {
    local name=$1 expr=$2; shift 2
    rm -rf "$tmp/out"
    # The byte figures below count fp32 K and V (the tiny model's own type, what
    # `serve` stores by default, is f16).
    if ! "$bin" simulate --model "$model" --label run --out "$tmp/out" --kv-dtype f32 "$@" >"$tmp/log" 2>&1; then
        fail "$name" "simulate failed: $(tail -c 300 "$tmp/log")"
        return
    fi
    if "$py" - "$tmp/out" "$expr" <<'EOF'; then ok "$name"; else fail "$name" "$(tail -c 600 "$tmp/log")"; fi
import json, sys
d, expr = sys.argv[1], sys.argv[2]
r = json.load(open(f"{d}/run.json"))
q = [json.loads(l) for l in open(f"{d}/run.requests.jsonl")]
near = lambda a, b: abs(a - b) < 1e-6
if not eval(expr):
    print("failed:", expr, "\nreport:", json.dumps({k: v for k, v in r.items() if "ms" in k or k in
          ("duration", "completed", "failed", "kv_pool")}, indent=1))
    sys.exit(1)
EOF
}

sim "one at a time under --max-running 1: 5 x 64 steps x 10 ms, each waiting for the last" \
    'near(r["duration"], 3.2) and near(r["mean_e2el_ms"], 1920) and near(r["mean_queue_ms"], 1280) and r["completed"] == 5' \
    --costs "$tmp/c.json" --arrival burst -n 5 --max-running 1
sim "all five in one batch under --max-running 8: done together at 0.64 s" \
    'near(r["duration"], 0.64) and near(r["p99_e2el_ms"], 640) and r["kv_pool"]["max_running"] == 5' \
    --costs "$tmp/c.json" --arrival burst -n 5 --max-running 8
sim "five replicas of --max-running 1 take one each" \
    'near(r["duration"], 0.64) and near(r["mean_queue_ms"], 0)' \
    --costs "$tmp/c.json" --arrival burst -n 5 --max-running 1 --replicas 5
# Two requests of 4 images in a 1 MiB pool: an image holds 2048 bytes per
# token, 18 + t tokens at step t, so the pair holds 8192 (18 + t) bytes and
# the pool 128 such units. The second may start at iteration k when, at every
# later step j, (18 + k + j) + (18 + j) <= 128 up to the first's last step
# (k + j = 63): k >= 34. It ends at 0.34 + 0.64 s.
sim "a 1 MiB pool admits the second request of 4 images when the two trajectories fit: iteration 34" \
    'near(r["duration"], 0.98) and near(r["mean_queue_ms"], 170) and r["kv_pool"]["max_reserved_bytes"] <= 1048576' \
    --costs "$tmp/c.json" --arrival burst -n 2 --images 4 --kv-pool-mb 1
# The same two with a budget range (LineAR from 1/2 up to 1, the whole
# cache): the first, alone, runs at the top; the second starts two
# iterations later at a lower budget whose trajectory fits beside the
# first's (its floor, 4 of 8 lines, fits from there on), instead of waiting
# for iteration 34: queued 0 and 20 ms.
echo '{"prompt": "a red circle", "n": 4, "kv_policy": "linear", "kv_budget": 1, "kv_budget_min": 0.5}' \
    >"$tmp/elastic.mix.jsonl"
sim "a budget range starts the second of those two at iteration 2, below its top" \
    'near(r["mean_queue_ms"], 10) and r["kv_pool"]["max_running"] == 2 and r["kv_pool"]["max_reserved_bytes"] <= 1048576' \
    --costs "$tmp/c.json" --arrival burst -n 2 --kv-pool-mb 1 --mix "$tmp/elastic.mix.jsonl"
if grep -q "run: 2 requests with a budget range admitted at a mean budget of 0\.[0-9]*, 1 below their top" "$tmp/log"; then
    ok "simulate says the budgets the ranges were admitted at"
else
    fail "simulate says the budgets the ranges were admitted at" "$(grep budget "$tmp/log")"
fi
sim "a request of 7 images (1.1 MiB) is larger than the pool: 400 kv_pool_too_small" \
    'r["failed"] == {"400": 1} and q[0]["code"] == "kv_pool_too_small"' \
    --costs "$tmp/c.json" --arrival burst -n 1 --images 7 --kv-pool-mb 1
sim "--max-waiting 1: of four at once, one waits and three get 429 queue_full" \
    'r["failed"] == {"429": 3} and r["completed"] == 1 and sum(x["code"] == "queue_full" for x in q) == 3' \
    --costs "$tmp/c.json" --arrival burst -n 4 --max-running 1 --max-waiting 1
# Latency objectives (--slo-p99-ms): 640 ms of steps alone cannot keep 100 ms: refused at once.
sim "--slo-p99-ms 100: a request of 640 ms alone is refused, 429 objective_unreachable" \
    'r["failed"] == {"429": 2} and all(x["code"] == "objective_unreachable" for x in q)' \
    --costs "$tmp/c.json" --arrival burst -n 2 --slo-p99-ms 100
# With 10 ms a step and 10 more per image, one image alone takes 1.28 s. Under a 1.505 s
# objective the second waits while admitting it would make the first late: at iteration k
# the first would end at 0.02 k + 0.03 (64 - k), within 1.505 from k = 42 (0.84 s), when the
# second, late even alone (0.84 + 1.28), starts. The third waits for the first to end (1.5 s);
# the second's 42 steps left then take 30 ms each (2.76 s), the third's last 22 20 ms (3.2 s).
cat >"$tmp/cs.json" <<EOF
{"family": "raster", "source": "test",
 "step": {"intercept_s": 0.01, "per_sequence_s": 0.005, "per_kv_attended_s": 0, "per_new_token_s": 0},
 "decode_s_per_image": 0, "png_s_per_image": 0}
EOF
sim "--slo-p99-ms 1505: the second waits until it makes no one late, the third for the first" \
    '[round(x["e2el_ms"], 6) for x in q] == [1500, 2760, 3200] and [round(x["queue_ms"], 6) for x in q] == [0, 840, 1500]' \
    --costs "$tmp/cs.json" --arrival burst -n 3 --slo-p99-ms 1505
if grep -q "run: admissions by what decided them: 1 free, 0 memory, 2 time" "$tmp/log"; then
    ok "simulate says what decided each admission"
else
    fail "simulate says what decided each admission" "$(grep admissions "$tmp/log")"
fi
# Both end their steps at 0.64 s; the engine decodes the first (0.74), whose
# PNG the worker encodes (0.79) while the engine decodes the second (0.84),
# whose PNG follows (0.89).
sim "decode on the engine (0.1 s each), PNGs on one worker (0.05 s each)" \
    'sorted(round(x["e2el_ms"], 6) for x in q) == [790, 890] and near(r["mean_decode_png_ms"], 200) and near(r["mean_step_ms"], 10)' \
    --costs "$tmp/cd.json" --arrival burst -n 2 --max-running 8 --png-workers 1
# The same with 25 ms on each request's HTTP thread: every answer 25 ms later, the PNGs not.
sed 's/"png_s_per_image": 0.05}/"png_s_per_image": 0.05, "http_s_per_request": 0.025}/' \
    "$tmp/cd.json" >"$tmp/ch.json"
sim "each answer's HTTP side (0.025 s) after its PNGs" \
    'sorted(round(x["e2el_ms"], 6) for x in q) == [815, 915] and near(r["mean_decode_png_ms"], 200)' \
    --costs "$tmp/ch.json" --arrival burst -n 2 --max-running 8 --png-workers 1
sim "a closed loop of two clients: three rounds of 0.64 s" \
    'near(r["duration"], 1.92) and r["max_concurrency"] == 2 and near(max(x["t"] for x in q), 1.28)' \
    --costs "$tmp/c.json" --arrival concurrency --concurrency 2 -n 6 --max-running 8
# One server, service 0.64 s: each request ends at max(its arrival, the
# last end) + 0.64 (Lindley's recursion), whatever the gaps.
sim "Poisson arrivals at 1/s on one server of 0.64 s: every end as Lindley's recursion says" \
    'all(near(x["done"], max(x["t"], p) + 0.64) for x, p in zip(q, [0] + [y["done"] for y in q])) and r["completed"] == 20 and r["p99_queue_ms"] > 0' \
    --costs "$tmp/c.json" --rate 1 -n 20 --max-running 1 --seed 3

# A trace replays its own times and prefixes.
"$bin" simulate --model "$model" --costs "$tmp/c.json" --rate 2 -n 6 --seed 1 --label a \
    --out "$tmp/tr" >/dev/null 2>&1
if "$bin" simulate --model "$model" --costs "$tmp/c.json" --trace "$tmp/tr/a.requests.jsonl" \
    --label b --out "$tmp/tr" >/dev/null 2>&1 &&
    "$py" -c 'import json,sys; a=[json.loads(l) for l in open(sys.argv[1])]; b=[json.loads(l) for l in open(sys.argv[2])]
assert [x["t"] for x in a] == [x["t"] for x in b] and [x["e2el_ms"] for x in a] == [x["e2el_ms"] for x in b]' \
    "$tmp/tr/a.requests.jsonl" "$tmp/tr/b.requests.jsonl"; then
    ok "a trace replays the same arrivals to the same latencies"
else
    fail "a trace replays the same arrivals to the same latencies"
fi

# The timeline: one row per iteration, the admitted concurrency over time.
"$bin" simulate --model "$model" --costs "$tmp/c.json" --arrival burst -n 3 --max-running 2 \
    --timeline "$tmp/tl.csv" >/dev/null 2>&1
if [ "$(sed -n 2p "$tmp/tl.csv" | cut -d, -f4)" = 2 ] && [ "$(wc -l <"$tmp/tl.csv")" -eq $((1 + 128)) ]; then
    ok "the timeline has a row per iteration with the images stepped"
else
    fail "the timeline has a row per iteration with the images stepped" "$(head -3 "$tmp/tl.csv")"
fi

# The paper projections (docs/capacity.md) run on their presets.
for c in "$root"/config/costs/*.json; do
    [ -e "$c" ] || continue
    read -r preset pool dt < <("$py" -c 'import json,sys; d=json.load(open(sys.argv[1]))
print(d["preset"], d["kv_pool_mb"], d["kv_dtype"])' "$c")
    mix="${c%.json}.mix.jsonl"
    if "$bin" simulate --model "$preset" --costs "$c" --mix "$mix" --arrival burst -n 4 \
        --kv-pool-mb "$pool" --kv-dtype "$dt" >"$tmp/log" 2>&1 && grep -q "4 completed" "$tmp/log"; then
        ok "projection $(basename "$c") runs on preset $preset"
    else
        fail "projection $(basename "$c") runs on preset $preset" "$(tail -c 400 "$tmp/log")"
    fi
done
# The Infinity-2B table was derived from AMS-KV's 0.826 images/s (full cache, A100): saturated,
# it gives that back when every row of every scale is priced (the last scale, computed but never
# cached, is 40% of an image: unpriced, the projection said 1.54).
c="$root/config/costs/infinity-2b-a100-full.json"
if "$bin" simulate --model infinity-2b --costs "$c" --mix "${c%.json}.mix.jsonl" --arrival burst \
    -n 200 --kv-pool-mb 69632 --kv-dtype f32,bf16 --max-running 4096 --label run \
    --out "$tmp/inf" >"$tmp/log" 2>&1 &&
    "$py" -c 'import json,sys; r=json.load(open(sys.argv[1])); sys.exit(abs(r["images_per_s"] / 0.826 - 1) > 0.03)' \
        "$tmp/inf/run.json"; then
    ok "the Infinity-2B table gives back the 0.826 images/s it was derived from"
else
    fail "the Infinity-2B table gives back the 0.826 images/s it was derived from" \
        "$(grep throughput "$tmp/log")"
fi

expect_fail() {
    local name=$1 code=$2 text=$3; shift 4
    "$@" >"$tmp/out.txt" 2>"$tmp/err"; local rc=$?
    if [ "$rc" -eq "$code" ] && grep -qF -- "$text" "$tmp/err"; then ok "$name"
    else fail "$name" "exit $rc (want $code), stderr: $(head -c 300 "$tmp/err")"; fi
}
expect_fail "no --costs: usage" 2 "--costs FILE" -- "$bin" simulate --model "$model"
expect_fail "a cost table of another family is refused" 2 "raster family" -- \
    "$bin" simulate --model "$var_model" --costs "$tmp/c.json"
echo '{"family": "raster", "step": {}}' >"$tmp/bad.json"
expect_fail "a cost table missing a coefficient names the file and the key" 2 "intercept_s" -- \
    "$bin" simulate --model "$model" --costs "$tmp/bad.json"
expect_fail "--trace with --rates is refused" 2 "--trace" -- \
    "$bin" simulate --model "$model" --costs "$tmp/c.json" --trace "$tmp/tr/a.requests.jsonl" --rates 1,2
expect_fail "an unknown model preset is named" 2 "neither a model directory nor a preset" -- \
    "$bin" simulate --model no-such-model --costs "$tmp/c.json"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
