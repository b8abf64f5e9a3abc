#!/usr/bin/env bash
# A smoke test of build/speed_bench (`make bench`'s engine half, `make
# bench-scale`): a raster model at two batch sizes gives images/s, a decode
# step and its memory and compute roofline shares in its table and its JSON
# (with the prompt rows the torch side replays, and the bytes and elements
# of weights a step reads, checked against arserve.json and the files); --measure roofline runs no images; a next-scale
# model runs too; a bad --images is refused, and so are --backend cuda in a
# build without it (test-cli builds without CUDA=1) and an unknown backend.
# The CPU backend has no device counters (tests/cli/test_speed_bench_emu.sh
# checks them on the emulated CUDA backend).
# usage: tests/cli/test_speed_bench.sh path/to/speed_bench path/to/tiny-model
#        path/to/var-tiny-model path/to/python
set -u
bin=$1 model=$2 var_model=$3 python=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
ok()   { passed=$((passed + 1)); echo "ok      $1"; }
fail() { failed=$((failed + 1)); echo "not ok  $1"; [ -n "${2:-}" ] && echo "  $2"; }

"$bin" --model "$model" --batch 2 --images 2 --reps 1 >"$tmp/table" 2>&1
grep -qE '^batch   2: +[0-9.]+ images/s .*step [0-9.]+ ms, VQ decode [0-9.]+ ms, [0-9]+% of the memory roofline, [0-9]+% of the compute roofline$' "$tmp/table" &&
    grep -qE '^roofline: CPU read bandwidth: [0-9.]+ MiB of weights per step at [0-9.]+ GB/s read; [0-9.]+ M multiply-adds per row at [0-9.]+ GFLOP/s \((avx512|avx2|portable) FMA peak\)$' "$tmp/table" &&
    grep -qE '^batch 2 / batch 1: [0-9.]+x$' "$tmp/table" &&
    ok "a raster model's table: images/s, step, VQ decode, roofline" ||
    fail "a raster model's table: images/s, step, VQ decode, roofline" "$(cat "$tmp/table")"

"$bin" --model "$model" --batch 2 --images 2 --reps 1 --json --measure speed >"$tmp/speed.json" 2>&1
"$bin" --model "$model" --batch 2 --images 2 --json --measure roofline >"$tmp/roof.json" 2>&1
"$python" - "$tmp/speed.json" "$tmp/roof.json" "$model" <<'PY' >"$tmp/check" 2>&1 &&
import json, sys
speed, roof = (json.load(open(p)) for p in sys.argv[1:3])
assert [b["batch"] for b in speed["batches"]] == [1, 2], speed
for b in speed["batches"]:
    assert b["images_per_s"] > 0 and b["step_s"] > 0 and b["decode_s"] > 0, b
    assert "roofline" not in b, b  # --measure speed: no bandwidth buffer
    assert "launches_per_step" not in b and "device_peak_bytes" not in b, b  # no device
assert speed["backend"] == "cpu", speed
assert len(speed["cond"]) == len(speed["uncond"]) > 2, speed
assert speed["cond"][-1] == speed["uncond"][-1] and speed["cond"][0] == speed["uncond"][0]
assert "step_weight_bytes" not in speed
assert roof["batches"] == [], roof  # --measure roofline: no images
assert roof["read_bytes_per_s"] > 1e8 and roof["roofline_bandwidth"] == "cpu read", roof
# the weights a decode step reads: every layer, the final norm, the aligner, the
# head; not the embedding tables. Their count from arserve.json, their bytes as the
# CPU backend keeps them: matrices in the file's 16-bit type, everything else fp32.
import glob, math, struct
c = json.load(open(sys.argv[3] + "/arserve.json"))
l, im = c["llm"], c["image"]
L, HD, KVD, F = l["hidden_size"], l["num_heads"] * l["head_dim"], l["num_kv_heads"] * l["head_dim"], l["intermediate_size"]
layer = 2 * L + HD * L + 2 * KVD * L + L * HD + 3 * L * F
aligner = sum((im["embed_dim"] if j == 0 else L) * L + L for j in range(im["aligner_layers"]))
G, K = im["head_hidden_size"], im["codebook_size"]
count = l["num_layers"] * layer + L + aligner + G * L + G + K * G + K
header = {}
for path in glob.glob(sys.argv[3] + "/*.safetensors"):
    with open(path, "rb") as f:
        header.update(json.loads(f.read(struct.unpack("<Q", f.read(8))[0])))
step = [v for k, v in header.items() if k.startswith(("llm.layers.", "gen.aligner.", "gen.head."))
        or k == "llm.norm.weight"]
assert sum(math.prod(v["shape"]) for v in step) == count, (len(step), count)
want = sum(math.prod(v["shape"]) * (2 if len(v["shape"]) == 2 and v["dtype"] in ("BF16", "F16") else 4)
           for v in step)
assert want < 4 * count  # the tiny model has 16-bit matrices
assert roof["step_weight_bytes"] == want, (roof["step_weight_bytes"], want)
assert roof["step_weight_elems"] == count, (roof["step_weight_elems"], count)
# an FMA peak well above one multiply-add a nanosecond, as any vector unit has
# (none is measured for the portable kernels)
assert (roof["fma_flops_per_s"] > 4e9 and roof["vector_isa"] in ("avx512", "avx2")
        or roof["fma_flops_per_s"] == 0 and roof["vector_isa"] == "portable"), roof
print("ok")
PY
    ok "--json: both batch sizes, the prompt rows, a step's weight bytes and elements, the FMA peak; --measure splits them" ||
    fail "--json: both batch sizes, the prompt rows, a step's weight bytes and elements, the FMA peak; --measure splits them" \
        "$(cat "$tmp/check" "$tmp/speed.json" "$tmp/roof.json")"

"$bin" --model "$model" --batch 2 --images 2 --reps 1 --json >"$tmp/all.json" 2>&1
"$python" - "$tmp/all.json" <<'PY' >"$tmp/shares" 2>&1 &&
import json, sys
o = json.load(open(sys.argv[1]))
for b in o["batches"]:
    # a step's time if bound by reading its weights once, or by their
    # multiply-adds for two rows an image (the CFG pair) at the FMA peak
    memory = o["step_weight_bytes"] / o["read_bytes_per_s"] / b["step_s"]
    compute = 2 * 2 * b["batch"] * o["step_weight_elems"] / o["fma_flops_per_s"] / b["step_s"]
    assert abs(b["roofline"] - memory) <= 1e-9 * memory, (b, memory)
    assert abs(b["compute_roofline"] - compute) <= 1e-9 * compute, (b, compute)
print("ok")
PY
    ok "the roofline shares: weight bytes at the read bandwidth, two rows' multiply-adds at the FMA peak" ||
    fail "the roofline shares: weight bytes at the read bandwidth, two rows' multiply-adds at the FMA peak" \
        "$(cat "$tmp/shares" "$tmp/all.json")"

"$bin" --model "$var_model" --batch 2 --images 4 --reps 1 >"$tmp/var" 2>&1
grep -qE '^batch 2 / batch 1: [0-9.]+x$' "$tmp/var" && ! grep -q roofline "$tmp/var" &&
    ok "a next-scale model at two batch sizes (no roofline: its steps are scales)" ||
    fail "a next-scale model at two batch sizes (no roofline: its steps are scales)" "$(cat "$tmp/var")"

"$bin" --model "$model" --batch 2 --images 3 >"$tmp/bad" 2>&1
rc=$?
[ "$rc" = 2 ] && grep -q 'a multiple of --batch' "$tmp/bad" && ok "--images not a multiple of --batch: exit 2" ||
    fail "--images not a multiple of --batch: exit 2" "exit $rc: $(cat "$tmp/bad")"
"$bin" --model "$model" --batch 2 --images 2 --backend cuda >"$tmp/cuda" 2>&1
rc=$?
[ "$rc" = 1 ] && grep -q '^speed_bench: --backend cuda: .*built without the cuda backend.*rebuild with make CUDA=1$' "$tmp/cuda" &&
    ok "--backend cuda in a build without it: exit 1, saying how to build it in" ||
    fail "--backend cuda in a build without it: exit 1, saying how to build it in" "exit $rc: $(cat "$tmp/cuda")"
"$bin" --model "$model" --batch 2 --images 2 --backend metal >"$tmp/metal" 2>&1
rc=$?
[ "$rc" = 1 ] && grep -q '^speed_bench: --backend metal: unknown backend (cpu, cuda or auto)$' "$tmp/metal" &&
    ok "an unknown --backend: exit 1, naming the backends" ||
    fail "an unknown --backend: exit 1, naming the backends" "exit $rc: $(cat "$tmp/metal")"
# --steps N: each wave stops after N steps past the prompt (a raster model's
# decode steps, a next-scale model's scales) and draws no image.
"$bin" --model "$model" --batch 2 --images 2 --reps 1 --steps 3 --json --measure speed \
    >"$tmp/cut.json" 2>&1
"$bin" --model "$var_model" --batch 2 --images 2 --reps 1 --steps 2 --json --measure speed \
    >"$tmp/cut-var.json" 2>&1
"$python" - "$tmp/cut.json" "$tmp/cut-var.json" <<'PY' >"$tmp/check" 2>&1 &&
import json, sys
raster, var = (json.load(open(p)) for p in sys.argv[1:3])
assert raster["steps"] == 3 and var["steps"] == 2, (raster, var)
for b in raster["batches"] + var["batches"]:
    assert b["step_s"] > 0 and b["decode_s"] == 0, b  # no image drawn
for b in var["batches"]:
    assert len(b["scale_s"]) == 2, b  # two scales of four
PY
    ok "--steps cuts each wave short and draws no image" ||
    fail "--steps cuts each wave short and draws no image" "$(cat "$tmp/check" "$tmp/cut.json")"

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
