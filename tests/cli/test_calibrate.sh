#!/usr/bin/env bash
# CLI tests for `arserve calibrate` on a copy of a next-scale model: it
# writes a calibration (of VAR from classes, of Infinity from text) whose
# attention rows each sum to 1 (every query row's softmax mass, the scale's
# own keys included), which the model then loads
# and `arserve plan` uses for heatkv; bad prompts files and a raster model
# are refused with the file, line or reason named.
# usage: tests/cli/test_calibrate.sh path/to/arserve path/to/var-model path/to/raster-model
#        path/to/infinity-model
set -u
bin=$1 var_model=$2 raster_model=$3 inf_model=$4
case $bin in /*) ;; *) bin=$PWD/$bin ;; esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
ok()   { passed=$((passed + 1)); echo "ok      $1"; }
fail() { failed=$((failed + 1)); echo "not ok  $1"; [ -n "${2:-}" ] && echo "  $2"; }

# The calibration file's invariants: every attention row sums to 1 and sees
# no later scale; orderings are permutations; history top-K ratios bounded.
cat >"$tmp/check.py" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
K, T = len(d["scale_tokens"]), d["n_layers"] * d["n_heads"]
b = d["beta"]
assert d["prompts"] == 2 and d["sink_scales"] == int(sys.argv[2])
assert sorted(d["cas_order"]) == list(range(T)) and len(d["scas_order"]) == K - 1
for h in range(T):
    for q in range(K):
        row = b[(h * K + q) * K:(h * K + q + 1) * K]
        assert abs(sum(row) - 1) < 1e-4, (h, q, row)
        assert all(x == 0 for x in row[q + 1:]), (h, q, row)
# ScaleKV's history top-K ratio: none at scale 0 (no history), at most the
# history's whole mass 1 - beta[q][q], and some wherever there is history.
htr = d["htr"]
assert len(htr) == T * K
for h in range(T):
    assert htr[h * K] == 0
    for q in range(1, K):
        hist = 1 - b[(h * K + q) * K + q]
        assert 0 < htr[h * K + q] <= hist + 1e-5, (h, q, htr[h * K + q], hist)
PY

cp -r "$var_model" "$tmp/m"
rm -f "$tmp/m/kv_calibration.json"
classes=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['condition']['num_classes'])" "$tmp/m/arserve.json")
printf '# two classes\n0\n\n%d\n' $((classes - 1)) >"$tmp/prompts.txt"
if "$bin" calibrate --model "$tmp/m" --prompts "$tmp/prompts.txt" --sink-scales 1 >"$tmp/out" 2>"$tmp/err"; then
    if grep -q "wrote $tmp/m/kv_calibration.json: .* 2 generations, 1 sink scales" "$tmp/out" &&
       grep -q '2/2 generations' "$tmp/err" &&
       python3 "$tmp/check.py" "$tmp/m/kv_calibration.json" 1
    then ok "calibrate: writes orderings, a progress bar, attention rows that sum to 1, and history top-K ratios"
    else fail "calibrate output" "$(cat "$tmp/out" "$tmp/err")"; fi
else fail "calibrate --model var-tiny" "$(cat "$tmp/err")"; fi
"$bin" plan --model "$tmp/m" --policy heatkv --budget 1 >"$tmp/plan" 2>&1 &&
    grep -q "^heatkv and scalekv calibration: the model's calibration" "$tmp/plan" \
    && ok "plan reads the model's calibration" || fail "plan with a calibration" "$(tail -5 "$tmp/plan")"

# Infinity (text prompts, read by cross-attention: no cached prefix).
mkdir "$tmp/inf"
cp "$inf_model"/arserve.json "$inf_model"/*.safetensors "$inf_model"/tokenizer.json "$tmp/inf/"
rm -f "$tmp/inf/golden.safetensors"
printf 'a red circle\n# a comment\na blue square\n' >"$tmp/text.txt"
if "$bin" calibrate --model "$tmp/inf" --prompts "$tmp/text.txt" >"$tmp/out" 2>"$tmp/err"; then
    if grep -q "wrote $tmp/inf/kv_calibration.json: 2 layers x 2 heads, 7 scales, 2 generations, 3 sink scales at [0-9]*x[0-9]*, K and V in f32; it calibrates 1 image size" \
            "$tmp/out" && python3 "$tmp/check.py" "$tmp/inf/kv_calibration.json" 3 &&
       "$bin" plan --model "$tmp/inf" --policy heatkv --budget 0.4 2>&1 |
           grep -q "^heatkv and scalekv calibration: the model's calibration"
    then ok "calibrate on Infinity: text prompts, attention rows that sum to 1, read by plan"
    else fail "calibrate on Infinity's output" "$(cat "$tmp/out" "$tmp/err")"; fi
else fail "calibrate --model infinity_tiny" "$(cat "$tmp/err")"; fi
# --kv-dtype bf16: the same images drawn on a cache of half the bytes (for a
# model whose f32 cache does not fit); the statistics move by bf16's rounding.
if "$bin" calibrate --model "$tmp/inf" --prompts "$tmp/text.txt" --kv-dtype bf16 \
        --out "$tmp/bf16.json" >"$tmp/out" 2>"$tmp/err"; then
    if grep -q "wrote $tmp/bf16.json: .*, K and V in bf16;" "$tmp/out" &&
       python3 "$tmp/check.py" "$tmp/bf16.json" 3 &&
       python3 - "$tmp/inf/kv_calibration.json" "$tmp/bf16.json" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
d = max(abs(x - y) for x, y in zip(a["beta"], b["beta"]))
assert len(a["beta"]) == len(b["beta"]) and 0 < d < 0.05, d
PY
    then ok "calibrate --kv-dtype bf16: a bf16 cache, attention rows within 0.05 of f32's"
    else fail "calibrate --kv-dtype bf16 output" "$(cat "$tmp/out" "$tmp/err")"; fi
else fail "calibrate --kv-dtype bf16" "$(cat "$tmp/err")"; fi
"$bin" calibrate --model "$tmp/inf" --prompts "$tmp/text.txt" --kv-dtype f64 >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "\-\-kv-dtype: the type 'f64' is not one of f32, bf16, f16, fp8" "$tmp/err" \
    && ok "an unknown --kv-dtype is refused, listing the types" || fail "bad --kv-dtype" "$(cat "$tmp/err")"
"$bin" calibrate --model "$tmp/inf" --prompts "$tmp/text.txt" --kv-dtype bf16 --kv-scales >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "kv-dtype: fp8 KV scales are measured on an f32 cache only" "$tmp/err" \
    && ok "--kv-dtype with --kv-scales is refused" || fail "--kv-dtype --kv-scales" "$(cat "$tmp/err")"
# --size: another image size's calibration beside the default's (one file,
# version 2); heatkv then runs at both, and at a third size is refused.
sizes=$(python3 -c "import json,sys; print(' '.join(z['name'] for z in json.load(open(sys.argv[1]))['image']['sizes']))" "$tmp/inf/arserve.json")
set -- $sizes
default=$1 other=$2 third=$3
if "$bin" calibrate --model "$tmp/inf" --prompts "$tmp/text.txt" --size "$other" --sink-scales 2 >"$tmp/out" 2>"$tmp/err"; then
    if grep -q "2 sink scales at $other, K and V in f32; it calibrates 2 image sizes: $default, $other" "$tmp/out" &&
       python3 - "$tmp/inf/kv_calibration.json" "$default" "$other" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["version"] == 2 and [c["size"] for c in d["calibrations"]] == sys.argv[2:4], d.get("version")
assert [c["sink_scales"] for c in d["calibrations"]] == [3, 2]
PY
    then
        for z in "$default" "$other"; do
            "$bin" generate --model "$tmp/inf" --prompt "a red circle" --size "$z" --kv-policy heatkv \
                --kv-budget 0.4 --threads 1 -o "$tmp/z.png" >"$tmp/gen" 2>&1 || break
        done
        if grep -q "$other, prompt tokens" "$tmp/gen" &&
           ! "$bin" generate --model "$tmp/inf" --prompt "a red circle" --size "$third" --kv-policy heatkv \
               --kv-budget 0.4 --threads 1 -o "$tmp/z.png" >"$tmp/gen" 2>&1 &&
           grep -q "heatkv needs the model's KV calibration at this image size" "$tmp/gen"
        then ok "calibrate --size adds a size's calibration; heatkv runs at the calibrated sizes only"
        else fail "heatkv at the calibrated sizes" "$(cat "$tmp/gen")"; fi
    else fail "calibrate --size output" "$(cat "$tmp/out" "$tmp/err")"; fi
else fail "calibrate --size $other" "$(cat "$tmp/err")"; fi
"$bin" calibrate --model "$tmp/inf" --prompts "$tmp/text.txt" --size 7x7 >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "size: '7x7' is not one of the model's sizes: $default, $other, $third" "$tmp/err" \
    && ok "an unknown --size is refused, listing the model's sizes" || fail "bad --size" "$(cat "$tmp/err")"
"$bin" calibrate --model "$tmp/inf" --prompts "$tmp/text.txt" --size "$other" --kv-scales >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "default size only" "$tmp/err" \
    && ok "--size with --kv-scales is refused" || fail "--size --kv-scales" "$(cat "$tmp/err")"
# An entry named for a size the model lacks: refused at load, naming the file.
python3 - "$tmp/inf/kv_calibration.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); d["calibrations"][1]["size"] = "9x9"
json.dump(d, open(sys.argv[1], "w"))
PY
"$bin" plan --model "$tmp/inf" --policy heatkv --budget 0.4 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "kv_calibration.json: calibration 2 of 2: the KV calibration was made at 9x9" "$tmp/err" \
    && ok "a calibration of a size the model lacks is refused, naming the file and entry" \
    || fail "calibration of a missing size" "$(cat "$tmp/err")"
"$bin" generate --model "$tmp/inf" --prompt "a red circle" --threads 1 -o "$tmp/z.png" >/dev/null 2>"$tmp/err"
[ $? -ne 0 ] && grep -q "kv_calibration.json (move it away" "$tmp/err" \
    && ok "... and by the model's load" || fail "load with a calibration of a missing size" "$(cat "$tmp/err")"
rm "$tmp/inf/kv_calibration.json"

printf 'a red circle\na small blue square on the left of a large green circle\n' >"$tmp/long.txt"
"$bin" calibrate --model "$tmp/inf" --prompts "$tmp/long.txt" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "prompt 2: prompt is [0-9]* tokens with </s>, more than the model's limit 16" "$tmp/err" \
    && ok "a text prompt too long for the model names the prompt" || fail "long prompt" "$(cat "$tmp/err")"

printf 'no such class\n' >"$tmp/bad.txt"
"$bin" calibrate --model "$tmp/m" --prompts "$tmp/bad.txt" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "$tmp/bad.txt:1: 'no such class' is neither a class name" "$tmp/err" \
    && ok "an unknown class names the file and line" || fail "bad prompt" "$(cat "$tmp/err")"
"$bin" calibrate --model "$raster_model" --prompts "$tmp/prompts.txt" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -qi "next-scale\|class" "$tmp/err" \
    && ok "a raster model is refused" || fail "raster model" "$(cat "$tmp/err")"
"$bin" calibrate --model "$tmp/m" >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "usage: arserve calibrate" "$tmp/err" \
    && ok "--prompts is required" || fail "missing --prompts" "$(cat "$tmp/err")"

# A calibration of another shape: the model refuses to load, naming the file.
python3 - "$tmp/m/kv_calibration.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); d["n_heads"] += 1
T = d["n_layers"] * d["n_heads"]
d["cas_order"] = list(range(T)); d["scas_order"] = [list(range(T))] * len(d["scas_order"]); d.pop("beta"); d.pop("htr")
json.dump(d, open(sys.argv[1], "w"))
PY
"$bin" calibrate --model "$tmp/m" --prompts "$tmp/prompts.txt" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "kv_calibration.json (move it away" "$tmp/err" && grep -q "arserve calibrate" "$tmp/err" \
    && ok "a calibration of another shape is refused at load, naming the file" || fail "stale calibration" "$(cat "$tmp/err")"

# --kv-scales: each layer and head's largest |K| and |V| for fp8 caches, on
# a text-prompted model (and a class-conditional one).
cp -r "$raster_model" "$tmp/r"
rm -f "$tmp/r/kv_scales.json"
printf 'a red cat sits under a blue sky\n# skipped\n\nthe small dog runs\n' >"$tmp/text.txt"
if "$bin" calibrate --model "$tmp/r" --prompts "$tmp/text.txt" --kv-scales >"$tmp/out" 2>"$tmp/err"; then
    if grep -q "wrote $tmp/r/kv_scales.json: fp8 KV scales of .* from 2 generations" "$tmp/out" &&
       grep -q '2/2 generations' "$tmp/err" &&
       python3 - "$tmp/r/kv_scales.json" "$tmp/r/arserve.json" <<'PY'
import json, sys
d, c = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))["llm"]
T = c["num_layers"] * c.get("num_kv_heads", c["num_heads"])
assert d["format"] == "arserve-kv-scales" and d["prompts"] == 2
assert d["n_layers"] * d["n_heads"] == T, (d["n_layers"], d["n_heads"], T)
for key in ("k_amax", "v_amax"):
    assert len(d[key]) == T and all(0 < x < 1e4 for x in d[key]), d[key]
PY
    then ok "calibrate --kv-scales: one positive |K| and |V| per layer and head, a progress bar"
    else fail "calibrate --kv-scales output" "$(cat "$tmp/out" "$tmp/err")"; fi
else fail "calibrate --kv-scales on a raster model" "$(cat "$tmp/err")"; fi
# fp8 caches take the scales; other types ignore them.
gen() { "$bin" generate --model "$1" --prompt "a red cat sits under a blue sky" --seed 3 \
            --threads 1 --kv-dtype "$2" -o "$3" >/dev/null 2>"$tmp/err"; }
if gen "$tmp/r" fp8 "$tmp/scaled.png" && gen "$raster_model" fp8 "$tmp/unscaled.png" &&
   gen "$tmp/r" f32 "$tmp/f32a.png" && gen "$raster_model" f32 "$tmp/f32b.png"; then
    ! cmp -s "$tmp/scaled.png" "$tmp/unscaled.png" && cmp -s "$tmp/f32a.png" "$tmp/f32b.png" \
        && ok "generate --kv-dtype fp8 draws with the measured scales; f32 ignores them" \
        || fail "kv scales in generate" "fp8 same: $(cmp -s "$tmp/scaled.png" "$tmp/unscaled.png" && echo yes)"
else fail "generate with kv_scales.json" "$(cat "$tmp/err")"; fi
rm -f "$tmp/m/kv_calibration.json" # the stale one above
printf '0\n' >"$tmp/one.txt"
"$bin" calibrate --model "$tmp/m" --prompts "$tmp/one.txt" --kv-scales --out "$tmp/var_scales.json" >"$tmp/out" 2>"$tmp/err" &&
    grep -q "wrote $tmp/var_scales.json: .* 1 generations" "$tmp/out" \
    && ok "calibrate --kv-scales on a class-conditional model, --out" || fail "var --kv-scales" "$(cat "$tmp/err")"
printf 'no such class\n' >"$tmp/bad.txt"
"$bin" calibrate --model "$tmp/m" --prompts "$tmp/bad.txt" --kv-scales >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "$tmp/bad.txt:1: 'no such class' is neither a class name" "$tmp/err" \
    && ok "--kv-scales: an unknown class names the file and line" || fail "--kv-scales bad class" "$(cat "$tmp/err")"
# Damaged or foreign scale files stop the model's load, naming the file and field.
cp "$tmp/r/kv_scales.json" "$tmp/good.json"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['v_amax'][1]=-1; json.dump(d,open(sys.argv[1],'w'))" "$tmp/r/kv_scales.json"
gen "$tmp/r" fp8 "$tmp/x.png"
grep -q "$tmp/r/kv_scales.json: v_amax\[1\] must be a finite number >= 0" "$tmp/err" \
    && ok "a negative amax is refused at load, naming the file and the entry" || fail "negative amax" "$(cat "$tmp/err")"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['n_layers']+=1; n=d['n_layers']*d['n_heads']; d['k_amax']=d['v_amax']=[1.0]*n; json.dump(d,open(sys.argv[1],'w'))" "$tmp/r/kv_scales.json"
gen "$tmp/r" fp8 "$tmp/x.png"
grep -q "$tmp/r/kv_scales.json: measured on .* layers .* calibrate --kv-scales again" "$tmp/err" \
    && ok "scales of another shape are refused at load, saying how to remake them" || fail "scales shape" "$(cat "$tmp/err")"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('k_amax'); json.dump(d,open(sys.argv[1],'w'))" "$tmp/r/kv_scales.json"
gen "$tmp/r" fp8 "$tmp/x.png"
grep -q "$tmp/r/kv_scales.json: \"k_amax\" is missing" "$tmp/err" \
    && ok "a missing k_amax is named" || fail "missing k_amax" "$(cat "$tmp/err")"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
