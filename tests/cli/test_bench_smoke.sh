#!/usr/bin/env bash
# A smoke run of every bench target that the other suites do not run, each
# through its own make recipe with small variables, for seconds, and each
# one's output checked, so that none rots unseen:
#   make bench        the demo model (top-k 20), one thread, batches 1 and 2,
#                     one round, both sides, the daemon at concurrency 1
#                     (torch from .venv-bench, BENCH_TORCH=cpu)
#   make bench-kv     the tiny model, one prompt per category, one pool fill
#   make bench-scale  the tiny next-scale model at batch 2
#   make bench-gemm   one alternation of 1 ms per timing, each instruction set
#   make bench-conv   one alternation of 1 ms per timing, images up to 24 pixels
#   make bench-serve  the tiny model at two Poisson rates of 4 requests
#   make bench-real   every released model's layout at a tiny width, converted, served
#   make bench-8bit   the tiny Janus-Pro release in bf16, int8 and fp8, 3 steps a wave
#   make eval         the demo model on six prompts
# Outputs go to a temporary folder, not to build/ or docs/. Each make is
# killed, with everything it started, after RUN_TIMEOUT seconds (300: they
# take 0.1 to 15 here), so a hang fails the test instead of stalling it.
# usage: tests/cli/test_bench_smoke.sh MAKE tiny-model var-tiny-model path/to/python
set -u
make=$1 tiny=$2 var_tiny=$3 python=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
ok()   { passed=$((passed + 1)); echo "ok      $1"; }
fail() { failed=$((failed + 1)); echo "not ok  $1"; [ -n "${2:-}" ] && echo "$2" | sed 's/^/  /'; }

RUN_TIMEOUT=${RUN_TIMEOUT:-300}

# run NAME make-args...: runs make, its output in $tmp/NAME.out, and sets $secs.
run() {
    local name=$1
    shift
    local t0=$EPOCHREALTIME rc
    timeout -k 10 "$RUN_TIMEOUT" "$make" --no-print-directory "$@" >"$tmp/$name.out" 2>&1
    rc=$?
    [ "$rc" = 124 ] && echo "make $1: killed after $RUN_TIMEOUT s" >>"$tmp/$name.out"
    secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    return $rc
}

# make bench: both sides' rows at batches 1 and 2 with positive numbers, held to
# the AVX2 kernels by BENCH_ISA, in the
# JSON and in the table, the torch side sampling with the model's settings
# (top-k 20: the torch side refused it before it sampled as the engine does),
# and the daemon's images/s.
if run bench bench BENCH_TORCH=cpu BENCH_MODELS=models/shapes BENCH_THREADS=1 BENCH_BATCH=2 \
    BENCH_CONCURRENCY=1 BENCH_ISA=avx2 BENCH_ARGS="--rounds 1 --daemon-requests 2" \
    BENCH_JSON="$tmp/bench.json"; then
    if "$python" - "$tmp/bench.json" models/shapes/arserve.json "$tmp/bench.out" <<'PY' >"$tmp/bench.check" 2>&1
import json, re, sys
rows = json.load(open(sys.argv[1]))
want = json.load(open(sys.argv[2]))["sampling"]
table = open(sys.argv[3]).read()
assert len(rows) == 1, rows
r = rows[0]
assert r["model"] == "shapes" and r["threads"] == 1 and r["reference"] == "JanusLM (tools/train)", r
# BENCH_ISA=avx2 held arserve to the AVX2 kernels (an AVX-512 machine too); a machine
# without AVX2, FMA and F16C runs the portable ones.
cpu = set(open("/proc/cpuinfo").read().split())
assert r["vector_isa"] == ("avx2" if {"avx2", "fma", "f16c"} <= cpu else "portable"), r["vector_isa"]
assert [b["batch"] for b in r["batches"]] == [1, 2], r
for b in r["batches"]:
    for side in ("arserve", "torch"):
        for k in ("images_per_s", "step_s", "decode_s"):
            assert b[side][k] > 0, (b["batch"], side, k, b)
    assert 0 < b["arserve"]["roofline"] and 0 <= b["arserve"]["compute_roofline"], b
assert r["rss_mib"]["arserve"] > 0 and r["rss_mib"]["torch"] > 0, r["rss_mib"]
assert want["top_k"] > 0, want  # the demo model asks for top-k: the case that was refused
assert r["torch_sampling"] == want, (r["torch_sampling"], want)
assert list(r["daemon"]) == ["1"] and r["daemon"]["1"] > 0, r["daemon"]
num = r"[0-9]+\.[0-9]+"
for batch in (1, 2):
    assert re.search(r"^shapes +1 +(avx512|avx2|portable) +%d +%s +%s +%sx +%s +%s .* %s +[0-9]+$"
                     % (batch, num, num, num, num, num, num), table, re.M), \
        "no table row for batch %d" % batch
assert r["torch_dtype"] == "float32", r["torch_dtype"]  # JanusLM: the demo model's fp32
assert re.search(r"^  shapes +JanusLM \(tools/train\) \(float32 on (avx2|portable)\); cfg [0-9.]+, "
                 r"temperature [0-9.]+, "
                 r"top-k %d, top-p [0-9.]+;" % want["top_k"], table, re.M), "no sampling line"
assert re.search(r"^  shapes +1 thread\(s\), (avx512|avx2|portable): C=1 %s \(" % num, table,
                 re.M), "no daemon line"
print("ok")
PY
    then ok "make bench: both sides at batches 1 and 2, the model's sampling, the daemon ($secs s)"
    else fail "make bench: both sides at batches 1 and 2, the model's sampling, the daemon" \
        "$(cat "$tmp/bench.check"; tail -30 "$tmp/bench.out")"
    fi
else
    fail "make bench runs on the demo model" "$(tail -30 "$tmp/bench.out")"
fi

# make bench-kv: every row of the tiny model's table ran or says why not;
# full and the rows that ran have images/s, and measured peaks equal planned.
if run kv bench-kv KV_BENCH_MODEL="$tiny" KV_BENCH_PER_CATEGORY=1 KV_BENCH_WAVES=1 \
    KV_BENCH_OUT="$tmp/kv"; then
    if "$python" - "$tmp/kv/results.json" "$tmp/kv/table.txt" <<'PY' >"$tmp/kv.check" 2>&1
import json, sys
res = json.load(open(sys.argv[1]))
rows = res["rows"]
ran = [r for r in rows if "error" not in r]
assert len(rows) == 10 and res["checks_failed"] == 0, res["checks_failed"]
assert ran[0]["policy"] == "full" and len(ran) >= 2, [r["name"] for r in ran]
for r in ran:
    assert r["images_per_s"] > 0 and r["admitted"] > 0, r["name"]
    assert r["measured_peak_bytes"] == r["planned_peak_bytes"] > 0, r["name"]
assert open(sys.argv[2]).read().startswith("KV policies on tiny-random")
print("ok")
PY
    then ok "make bench-kv: the tiny model's rows, images/s, measured == planned ($secs s)"
    else fail "make bench-kv: the tiny model's rows" "$(cat "$tmp/kv.check"; tail -20 "$tmp/kv.out")"
    fi
else
    fail "make bench-kv runs on the tiny model" "$(tail -30 "$tmp/kv.out")"
fi

# make bench-scale: images/s at batch 1 and 2 on the next-scale model.
num='[0-9]+\.[0-9]+'
if run scale bench-scale SCALE_BENCH_MODEL="$var_tiny" SCALE_BENCH_BATCH=2; then
    if grep -qE "^batch +1: +$num images/s" "$tmp/scale.out" &&
        [ "$(grep -cE "^ +scales \(s a wave\):( $num){4}$" "$tmp/scale.out")" = 4 ] &&
        grep -q "^cpu_activations f32:" "$tmp/scale.out" &&
        grep -q "^cpu_activations bf16:" "$tmp/scale.out" &&
        grep -qE "^batch +2: +$num images/s" "$tmp/scale.out" &&
        grep -qE "^batch 2 / batch 1: ${num}x$" "$tmp/scale.out" &&
        ! grep -qE "^batch +[12]: +0\.00 images/s" "$tmp/scale.out"; then
        ok "make bench-scale: images/s and each scale's seconds at batches 1 and 2, f32 and bf16 activations, on the tiny next-scale model ($secs s)"
    else
        fail "make bench-scale: images/s at batches 1 and 2" "$(cat "$tmp/scale.out")"
    fi
else
    fail "make bench-scale runs on the tiny next-scale model" "$(tail -30 "$tmp/scale.out")"
fi

# make bench-gemm: per instruction set this machine runs (AVX-512 and the
# AVX2 forced, or AVX2 alone), a row per shape and row count with the three
# sides' times, and both crossover lines. --rows gives 512 in place of the
# default's last count (576), so the rows timed are the list's.
if run gemm bench-gemm GEMM_BENCH_ARGS="--reps 1 --min-ms 1 --rows 1,2,4,6,8,12,16,24,32,64,128,256,512"; then
    isas=$(grep -c '^kernels: \(avx512\|avx2\), F32 weights; ' "$tmp/gemm.out")
    rows=$(awk '$1 ~ /^[0-9]+$/ && NF == 9 && $4 > 0 && $5 > 0 && $6 > 0 && $9 > 0' "$tmp/gemm.out" | wc -l)
    crossings=$(grep -c '^crossover against \(openblas\|gemm_rows\): gemm_packed is faster on every shape ' "$tmp/gemm.out")
    last=$(grep -c '^ 512:  [0-9.]*x [0-9.]*x$' "$tmp/gemm.out")
    if [ "$isas" -ge 1 ] && [ "$rows" = $((isas * 91)) ] && [ "$crossings" = $((isas * 2)) ] &&
        [ "$last" = "$isas" ] && ! grep -q '^ *576:' "$tmp/gemm.out"; then
        ok "make bench-gemm: $isas instruction set(s) x 7 shapes x 13 row counts, three sides timed, the crossovers ($secs s)"
    else
        fail "make bench-gemm: per instruction set 7 shapes x 13 row counts and two crossovers" \
            "$isas instruction sets, $rows rows, $crossings crossovers: $(tail -20 "$tmp/gemm.out")"
    fi
else
    fail "make bench-gemm runs" "$(tail -30 "$tmp/gemm.out")"
fi
# --rows: row counts out of order, or a trailing comma, are refused naming the flag.
for bad in 576,24 24,; do
    if ! run gemmbad bench-gemm GEMM_BENCH_ARGS="--rows $bad" &&
        grep -q "^gemm_bench: --rows $bad: want up to 16 ascending row counts" "$tmp/gemmbad.out"; then
        ok "make bench-gemm: --rows $bad is refused"
    else
        fail "make bench-gemm: --rows $bad is refused" "$(tail -5 "$tmp/gemmbad.out")"
    fi
done

# make bench-conv: per instruction set, a row per channel count and image side
# with both sides' times and a difference within Winograd's rounding, and the
# crossover line.
if run conv bench-conv CONV_BENCH_ARGS="--reps 1 --min-ms 1 --max-side 24"; then
    isas=$(grep -c '^kernels: \(avx512\|avx2\), one thread; ' "$tmp/conv.out")
    rows=$(awk '$1 ~ /^[0-9]+$/ && NF == 6 && $3 > 0 && $4 > 0 && $6 + 0 < 1e-4' "$tmp/conv.out" | wc -l)
    crossings=$(grep -c '^crossover: Winograd is ' "$tmp/conv.out")
    if [ "$isas" -ge 1 ] && [ "$rows" = $((isas * 16)) ] && [ "$crossings" = "$isas" ]; then
        ok "make bench-conv: $isas instruction set(s) x 8 channel counts x 2 sides, both timed, outputs agreeing, the crossover ($secs s)"
    else
        fail "make bench-conv: per instruction set 8 channel counts x 2 sides and the crossover" \
            "$isas instruction sets, $rows rows, $crossings crossovers: $(tail -20 "$tmp/conv.out")"
    fi
else
    fail "make bench-conv runs" "$(tail -30 "$tmp/conv.out")"
fi

# make bench-serve: the three policies' sweeps completed every request, the
# table says the admitted budgets, the simulator replayed the trace, the cost
# table and the plot exist. The tiny model's 8 lines need linear at 1/2 (its
# default 1/4 is refused on them), in the fixed and the elastic runs.
if run serve bench-serve MODEL="$tiny" SWEEP_OUT="$tmp/sweep" SWEEP_PNG="$tmp/sweep.png" \
    SWEEP_ARGS="--rates 20,40 --validate-rates 40 -n 4 --sweeps 2 --compressed '{\"kv_policy\": \"linear\", \"kv_budget\": 0.5}' \
    --elastic '{\"kv_policy\": \"linear\", \"kv_budget\": 1, \"kv_budget_min\": 0.5}'"; then
    if "$python" - "$tmp/sweep" "$tmp/sweep.png" "$tmp/serve.out" <<'PY' >"$tmp/serve.check" 2>&1
import csv, json, os, re, sys
out, png, log = sys.argv[1:4]
for policy in ("full", "compressed", "elastic", "objective"):
    rows = list(csv.DictReader(open(os.path.join(out, "sweep-1", policy, "results.csv"))))
    assert [r["label"] for r in rows] == ["rate-20", "rate-40"], (policy, rows)
    for r in rows:
        # the objective run's requests may be refused (429) when the SLO is out of reach
        assert float(r["completed"]) + float(r["num_failed"]) == 4, (policy, r)
        assert policy == "objective" or float(r["num_failed"]) == 0, (policy, r)
        assert float(r["images_per_s"]) > 0 and float(r["p99_e2el_ms"]) > 0, (policy, r)
for table in ("profile", "learned"):
    sim = json.load(open(os.path.join(out, "simulated", "sweep-1", f"{table}-40", "trace.json")))
    assert sim["completed"] == 4 and sim["request_throughput"] > 0, (table, sim)
assert json.load(open(os.path.join(out, "costs.json")))
for path in ("learned.json", "sweep-1/learned-40.json"):
    learned = json.load(open(os.path.join(out, path)))
    assert learned["source"].startswith("learned from the engine's last"), learned["source"]
assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
# Each elastic row: a mean budget in [0.5, 1] and a share below the top in [0, 1].
text = open(log).read()
assert "below top" in text, text
rows = re.findall(r"^elastic +(\d+) .* ([\d.]+) +([\d.]+) +(nan|[\d.]+)$", text, re.M)
assert [r[0] for r in rows] == ["20", "40"], text
for _, budget, below, _ in rows:
    assert 0.5 <= float(budget) <= 1 and 0 <= float(below) <= 1, rows
decided = re.findall(r"^objective at (\d+) requests/s: admissions (\d+) free, (\d+) memory-bound, "
                     r"(\d+) time-bound; goodput ([\d.]+) against the best fixed choice's "
                     r"\((full|compressed)\) ([\d.]+)$", text, re.M)
assert [d[0] for d in decided] == ["20", "40"], text
# two sweeps: every admission of both counted (each admitted request completes; a refused
# one is not admitted), the goodput's range given
for d in decided:
    done = sum(float(r["completed"]) for k in (1, 2)
               for r in csv.DictReader(open(os.path.join(out, f"sweep-{k}", "objective",
                                                         "results.csv")))
               if r["label"] == f"rate-{d[0]}")
    assert sum(int(x) for x in d[1:4]) == done, (d, done)
assert re.search(r"^compressed +20 +[\d.]+ +[\d.]+ +[\d.]+-[\d.]+ ", text, re.M), text
summary = json.load(open(os.path.join(out, "summary.json")))
assert summary["sweeps"] == 2 and len(summary["rates"]["40"]["full"]["goodput"]) == 2, summary
for table in ("profile", "learned"):
    assert len(summary["simulator"][table]["40"]["mean_e2el_ms"]) == 2, summary["simulator"]
assert "simulator (learned table) vs daemon" in text and "the daemon's learned table at the end: " in text
print("ok")
PY
    then ok "make bench-serve: four policies at two rates (an objective), the budgets, the simulator on two tables, the plot ($secs s)"
    else fail "make bench-serve: four policies, the budgets, the simulator, the plot" \
        "$(cat "$tmp/serve.check"; tail -20 "$tmp/serve.out")"
    fi
else
    fail "make bench-serve runs on the tiny model" "$(tail -30 "$tmp/serve.out")"
fi

# make bench-8bit: the tiny release converted three ways and each model's steps timed at
# batches 1 and 2 on the machine's best instruction set, a row per type in the table and the
# JSON, 8-bit models' files smaller than bf16's.
if run w8 bench-8bit W8_WORK="$tmp/w8" W8_BATCH=2 W8_STEPS=3 W8_REPS=1 W8_ISA= W8_ARGS=--tiny; then
    if "$python" - "$tmp/w8/weights8.json" "$tmp/w8.out" <<'PY' >"$tmp/w8.check" 2>&1
import json, sys
res = json.load(open(sys.argv[1]))
table = open(sys.argv[2]).read()
assert [r["dtype"] for r in res["rows"]] == ["bf16", "int8", "fp8"], res
for r in res["rows"]:
    assert r["step_s"]["1"] > 0 and r["step_s"]["2"] > 0, r
    assert f"| best | {r['dtype']} |" in table, table
bf16 = res["rows"][0]["bytes"]
assert all(r["bytes"] < bf16 for r in res["rows"][1:]), res["rows"]
print("ok")
PY
    then ok "make bench-8bit: bf16, int8 and fp8 converted and timed side by side ($secs s)"
    else fail "make bench-8bit: three types timed" "$(cat "$tmp/w8.check"; tail -20 "$tmp/w8.out")"
    fi
else
    fail "make bench-8bit runs on the tiny release" "$(tail -30 "$tmp/w8.out")"
fi

# make bench-real: every model's release written at its tiny width, converted within the
# stated bound, served (the 7B Janus is the 1B's tiny model sharded: converted only), each
# request's KV planned equal to measured and the daemon's RSS
# within its weights, pool and overhead (the bench exits non-zero otherwise), and the table
# with a row per request and the refusals named.
if run real bench-real REAL_ARGS="--tiny" REAL_WORK="$tmp/real" REAL_DOC=-; then
    if "$python" - "$tmp/real/results.json" "$tmp/real.out" <<'PY' >"$tmp/real.check" 2>&1
import json, sys
sys.path.insert(0, "bench")
import real_scale
res = json.load(open(sys.argv[1]))
table = open(sys.argv[2]).read()
assert sorted(res) == sorted(real_scale.MODELS), sorted(res)
for name, m in real_scale.MODELS.items():
    d = res[name]
    assert d["convert"]["peak_rss"] <= d["convert"]["bound"], (name, d["convert"])
    assert not real_scale.cases(name, True) or d["load"]["rss"] > 0, name
    for case in real_scale.cases(name, True):
        r = d[real_scale.case_key(case)]
        assert r["status"] == 200 and r["planned"] == r["measured"] > 0, (name, case, r)
    assert f"| {name} |" in table, name
print("ok")
PY
    then ok "make bench-real: six models' releases converted and served, plan = measured ($secs s)"
    else fail "make bench-real: six models converted and served, plan = measured" \
        "$(cat "$tmp/real.check"; tail -20 "$tmp/real.out")"
    fi
else
    fail "make bench-real runs every model at its tiny width" "$(tail -30 "$tmp/real.out")"
fi

# make eval: six prompts generated and scored, one per category.
if run eval eval EVAL_ARGS="--limit 6" EVAL_OUT="$tmp/eval"; then
    if "$python" - "$tmp/eval" <<'PY' >"$tmp/eval.check" 2>&1
import json, os, sys
s = json.load(open(os.path.join(sys.argv[1], "shapes_eval.json")))
assert s["n_prompts"] == 6 and len(s["results"]) == 6, s["n_prompts"]
assert all(v["n"] == 1 for v in s["categories"].values()) and len(s["categories"]) == 6
assert sorted(os.listdir(sys.argv[1])) == ["%05d.png" % i for i in range(6)] + ["shapes_eval.json"]
assert 0 <= s["overall"] <= 1 and 0 <= s["colour_recall"] <= 1 and s["generation_s"] > 0, s
print("ok")
PY
    then ok "make eval: six prompts generated and scored ($secs s)"
    else fail "make eval: six prompts generated and scored" "$(cat "$tmp/eval.check"; tail -20 "$tmp/eval.out")"
    fi
else
    fail "make eval runs on six prompts" "$(tail -30 "$tmp/eval.out")"
fi

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
