#!/usr/bin/env bash
# A smoke test of the speed bench on the CUDA backend under the emulator
# (build/speed_bench-emu --backend cuda; seconds on the tiny model): each
# batch size's kernel launches, host<->device copies and their bytes per
# decode step, and the peak device memory, in the table and in --json (the
# keys bench/gpu_bench.py reads), and the memory roofline against the
# device copy's bandwidth instead of the CPU's.
# On the tiny next-scale model, a step's launches with --batch-invariant
# off (one GEMM over every image's rows) fewer than with it on (a GEMM per
# sequence) at both batch sizes.
# usage: tests/cli/test_speed_bench_emu.sh path/to/speed_bench-emu path/to/tiny-model path/to/python path/to/var-tiny-model
set -u
bin=$1 model=$2 python=$3 var_model=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
ok()   { passed=$((passed + 1)); echo "ok      $1"; }
fail() { failed=$((failed + 1)); echo "not ok  $1"; [ -n "${2:-}" ] && echo "  $2"; }
# The emulator's and the bench's OpenMP teams take turns: spinning waits
# would make this minutes on a small machine (see test_backend_e2e in the Makefile).
export OMP_WAIT_POLICY=passive

timeout 120 "$bin" --model "$model" --backend cuda --batch 2 --images 2 --reps 1 >"$tmp/table" 2>&1
# every count of a batch size's per-step line, positive where it must be; one graph a step
positive='per step: ([0-9.]+) launches \(([0-9.]+) kernels\), 1\.0 graph launches, ([0-9.]+) host->device and ([0-9.]+) device->host copies \(([0-9.]+) KiB\), [0-9.]+ stream waits; peak device memory ([0-9.]+) MiB$'
grep -qE '^tiny-random on the cuda backend: ' "$tmp/table" &&
    [ "$(grep -cE "^batch +[12]: .*, [0-9]+% of the memory roofline$" "$tmp/table")" = 2 ] &&
    [ "$(grep -cE "$positive" "$tmp/table")" = 2 ] &&
    grep -E "$positive" "$tmp/table" | sed -E "s/.*$positive/\1 \2 \3 \4 \5 \6/" |
    awk '{ for (i = 1; i <= 6; i++) if (!($i > 0)) exit 1; if ($2 < $1) exit 1 } END { exit NR == 2 ? 0 : 1 }' &&
    grep -qE '^roofline: device copy bandwidth: [0-9.]+ MiB of weights per step at [0-9.]+ GB/s \(a [0-9]+ MiB device-to-device copy, bytes read and written\); no compute roofline on a device$' "$tmp/table" &&
    ok "the table: launches, copies and their bytes per step and peak device memory, positive, for both batch sizes; the device copy roofline" ||
    fail "the table: launches, copies and their bytes per step and peak device memory, positive, for both batch sizes; the device copy roofline" "$(cat "$tmp/table")"

timeout 120 "$bin" --model "$model" --backend cuda --batch 2 --images 2 --reps 1 --json >"$tmp/out.json" 2>"$tmp/err"
"$python" - "$tmp/out.json" <<'PY' >"$tmp/check" 2>&1 &&
import json, sys
o = json.load(open(sys.argv[1]))
assert o["backend"] == "cuda", o
assert [b["batch"] for b in o["batches"]] == [1, 2], o
for b in o["batches"]:
    assert b["kernels_per_step"] > b["launches_per_step"], b  # attention: split and combine
    for k in ("images_per_s", "step_s", "decode_s", "launches_per_step", "h2d_copies_per_step",
              "d2h_copies_per_step", "copy_bytes_per_step", "device_peak_bytes"):
        assert b[k] > 0, (k, b)
    # the peak holds at least the backend's own 96 MiB of scratch and cuBLAS workspace
    assert 96 << 20 <= b["device_peak_bytes"] <= o["device_reserved_bytes"], (b, o["device_reserved_bytes"])
    assert b["compute_roofline"] == 0, b
    memory = o["step_weight_bytes"] / o["read_bytes_per_s"] / b["step_s"]
    assert abs(b["roofline"] - memory) <= 1e-9 * memory, (b, memory)
# two images a step at batch 2: more of the staged host arrays, not fewer
one, two = o["batches"]
assert two["copy_bytes_per_step"] > one["copy_bytes_per_step"], (one, two)
assert two["device_peak_bytes"] >= one["device_peak_bytes"], (one, two)
assert o["roofline_bandwidth"] == "device copy" and o["device_copy_bytes"] >= 8 << 20, o
assert o["read_bytes_per_s"] > 0 and o["fma_flops_per_s"] == 0, o
print("ok")
PY
    ok "--json: launches_per_step, h2d/d2h_copies_per_step, copy_bytes_per_step, device_peak_bytes per batch; the roofline at the device copy's bandwidth" ||
    fail "--json: launches_per_step, h2d/d2h_copies_per_step, copy_bytes_per_step, device_peak_bytes per batch; the roofline at the device copy's bandwidth" \
        "$(cat "$tmp/check" "$tmp/out.json" "$tmp/err")"

for mode in on off; do
    timeout 120 "$bin" --model "$var_model" --backend cuda --batch 4 --images 4 --reps 1 --json \
        --batch-invariant $mode >"$tmp/var-$mode.json" 2>"$tmp/err-$mode"
done
"$python" - "$tmp/var-on.json" "$tmp/var-off.json" <<'PY' >"$tmp/check" 2>&1 &&
import json, sys
on, off = (json.load(open(p)) for p in sys.argv[1:3])
assert on["batch_invariant"] is True and off["batch_invariant"] is False, (on, off)
for a, b in zip(on["batches"], off["batches"]):
    assert b["launches_per_step"] < a["launches_per_step"], (a, b)
print("ok")
PY
    ok "next-scale: --batch-invariant off (one GEMM for the batch) launches fewer kernels a step than on" ||
    fail "next-scale: --batch-invariant off (one GEMM for the batch) launches fewer kernels a step than on" \
        "$(cat "$tmp/check" "$tmp/var-on.json" "$tmp/var-off.json" "$tmp/err-on" "$tmp/err-off")"

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
