#!/usr/bin/env bash
# CLI tests for `arserve plan`: the side-by-side table on every preset in
# config/presets/ and on the tiny models, full-cache figures against a hand
# computation (HeatKV's Table 1 for Infinity), the per-scale trajectory of
# next-scale models, --batch and --kv-dtype, --device-gib's pool (the
# device less the weights' bytes), presets found from any
# directory, and bad flags refused with exit 2 and a message naming the flag.
# usage: tests/cli/test_plan.sh path/to/arserve path/to/tiny-model [path/to/var-tiny-model]
set -u
bin=$1 model=$2 var_model=${3:-}
python_for_plan=${PYTHON:-python3}
case $bin in /*) ;; *) bin=$PWD/$bin ;; esac
case $model in /*) ;; *) model=$PWD/$model ;; esac
case $var_model in /* | "") ;; *) var_model=$PWD/$var_model ;; esac
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0

ok()   { passed=$((passed + 1)); echo "ok      $1"; }
# The hand computations below count fp32 K and V (4 bytes): plan32 asks for
# them (the default, `serve`'s, is the weights' type: bf16 for presets).
plan32() { "$bin" plan --kv-dtype f32 "$@"; }
fail() { failed=$((failed + 1)); echo "not ok  $1"; [ -n "${2:-}" ] && echo "  $2"; }

# expect_fail NAME EXIT_CODE TEXT -- command...: the command must exit with
# EXIT_CODE and print TEXT on stderr.
expect_fail() {
    local name=$1 code=$2 text=$3; shift 4
    "$@" >"$tmp/out" 2>"$tmp/err"; local rc=$?
    if [ "$rc" -eq "$code" ] && grep -qF -- "$text" "$tmp/err"; then ok "$name"
    else fail "$name" "exit $rc (want $code), stderr: $(head -c 300 "$tmp/err")"; fi
}

# cell FILE LABEL COLUMN: the value in the side-by-side table (column 0 is
# the first policy), from the fixed-width layout: a 32-character label, then
# 17 characters per policy.
cell() {
    awk -v label="$2" -v col="$3" '{ l = substr($0, 1, 32); sub(/ +$/, "", l) }
        l == label { v = substr($0, 33 + 17 * col, 17); gsub(/ +$/, "", v); print v; exit }' "$1"
}

# The side-by-side table: a header naming the four policies and the rows that
# matter, with numbers in every column.
check_table() { # NAME FILE
    local name=$1 f=$2
    if grep -qE '^ +full +streaming +linear +headkv$' "$f" &&
       grep -q '^peak in the pool, blocks (B)' "$f" && grep -q '^images in the pool at once' "$f" &&
       grep -q '^KV dtype fp32' "$f" && grep -q 'blocks of [0-9]* token' "$f"; then ok "$name"
    else fail "$name" "$(head -c 600 "$f")"; fi
}

# On the 16 x 16 grids of LlamaGen-B and -L (256 px), LineAR's 1/6 and HeadKV's 1/8 hold
# fewer tokens than their anchor and recent lines: the table says n/a at the defaults, and
# every policy has numbers from 1/4 on.
for preset in janus-pro-1b janus-pro-7b llamagen-b llamagen-l llamagen-xl llamagen-xxl; do
    budget=(); case $preset in llamagen-b | llamagen-l) budget=(--budget 1/4) ;; esac
    if plan32 --model "$preset" "${budget[@]}" >"$tmp/$preset.txt" 2>"$tmp/err"; then
        check_table "plan --model $preset ${budget[*]} prints the side-by-side table" "$tmp/$preset.txt"
        n=$(for c in 0 1 2 3; do cell "$tmp/$preset.txt" "peak in the pool, blocks (B)" $c; done | grep -cE '^[0-9]+$')
        [ "$n" = 4 ] && ok "$preset: every policy fits its grid at ${budget[*]:-its default budget}" \
            || fail "$preset: every policy has numbers" "$(grep '^peak in the pool' "$tmp/$preset.txt")"
    else fail "plan --model $preset" "$(cat "$tmp/err")"; fi
done

# Janus-Pro-1B by hand: 24 layers x 16 heads x 128 x 2 (K, V) x 4 bytes (fp32)
# x tokens x 2 (CFG), tokens = prompt + 576 - 1 (the last token is never fed).
for P in 18 1 33; do
    args=(); [ "$P" != 18 ] && args=(--prompt-tokens "$P")
    plan32 --model janus-pro-1b "${args[@]}" >"$tmp/j.txt" 2>&1
    tokens=$((P + 575))
    hand=$((24 * 16 * 128 * 2 * 4 * tokens * 2))
    blocks=$(( (tokens + 3) / 4 * 4 * 24 * 16 * 128 * 2 * 4 * 2 ))
    got=$(cell "$tmp/j.txt" "peak KV per image, tokens (B)" 0)
    gotb=$(cell "$tmp/j.txt" "peak in the pool, blocks (B)" 0)
    gott=$(cell "$tmp/j.txt" "peak tokens per head" 0)
    if [ "$got" = "$hand" ] && [ "$gott" = "$tokens" ] &&
       grep -q "^full-cache KV per image (all $tokens tokens): $hand bytes" "$tmp/j.txt"; then
        ok "janus-pro-1b, prompt $P: full cache = 24x16x128x2x4x$tokens x2 = $hand bytes"
    else fail "janus-pro-1b full cache, prompt $P" "got '$got' ($gott tokens), want $hand ($tokens)"; fi
    [ "$gotb" = "$blocks" ] && ok "janus-pro-1b, prompt $P: in whole 4-token blocks = $blocks bytes" \
        || fail "janus-pro-1b blocks, prompt $P" "got '$gotb', want $blocks"
    bf=$(cell "$tmp/j.txt" "  the same in bf16/fp16 (B)" 0)
    [ "$bf" = $((hand / 2)) ] && ok "janus-pro-1b, prompt $P: bf16 row is half" || fail "bf16 row" "got '$bf'"
done

# Janus-Pro-7B and LlamaGen-XL (c2i: one condition token) by hand too.
plan32 --model janus-pro-7b --policy full >"$tmp/j7.txt" 2>&1
want=$((30 * 32 * 128 * 2 * 4 * 593 * 2))
[ "$(cell "$tmp/j7.txt" "peak KV per image, tokens (B)" 0)" = "$want" ] \
    && ok "janus-pro-7b: full cache = 30x32x128x2x4x593x2 = $want bytes" \
    || fail "janus-pro-7b full cache" "$(grep '^peak KV' "$tmp/j7.txt")"
# The class token is the whole prefix, whatever --prompt-tokens says.
for P in 1 18; do
    plan32 --model llamagen-xl --prompt-tokens $P --policy full >"$tmp/lg.txt" 2>&1
    want=$((36 * 20 * 64 * 2 * 4 * 576 * 2))
    [ "$(cell "$tmp/lg.txt" "peak KV per image, tokens (B)" 0)" = "$want" ] \
        && ok "llamagen-xl, --prompt-tokens $P: full cache = 36x20x64x2x4x576x2 = $want bytes" \
        || fail "llamagen-xl full cache" "$(grep '^peak KV' "$tmp/lg.txt")"
done
grep -q '^request  condition prefix: 1 class token' "$tmp/lg.txt" \
    && ok "llamagen-xl: the header says the prefix is one class token" \
    || fail "llamagen-xl header" "$(grep '^request' "$tmp/lg.txt")"
# LlamaGen-B at 256 px: 12 layers x 12 heads x 64, 1 + 255 tokens.
plan32 --model llamagen-b --policy full >"$tmp/lgb.txt" 2>&1
want=$((12 * 12 * 64 * 2 * 4 * 256 * 2))
[ "$(cell "$tmp/lgb.txt" "peak KV per image, tokens (B)" 0)" = "$want" ] \
    && ok "llamagen-b: full cache = 12x12x64x2x4x256x2 = $want bytes" \
    || fail "llamagen-b full cache" "$(grep '^peak KV' "$tmp/lgb.txt")"

# The compressed policies on Janus-Pro-1B at their defaults (prompt 18):
# streaming caps at floor(593/6) = 98, linear peaks at 18 + 4 lines x 24 = 114,
# headkv at the grouping step, 18 + 100 = 118.
f=$tmp/janus-pro-1b.txt
got="$(cell "$f" "peak tokens per head" 1) $(cell "$f" "peak tokens per head" 2) $(cell "$f" "peak tokens per head" 3)"
[ "$got" = "98 114 118" ] && ok "janus-pro-1b: streaming 98, linear 114, headkv 118 tokens per head at peak" \
    || fail "janus-pro-1b peaks" "got '$got'"
grep -qE '^  97-120 +91 -> 114 \(\+1/step\) .*repeats x19, every 24 steps, through step 552' "$f" \
    && ok "linear's trajectory: a sawtooth of one line, compacting at each line end" \
    || fail "linear's trajectory" "$(grep -A4 '^linear' "$f")"

# Images in the pool: floor(pool / peak); 4096 MiB holds 9 full Janus-Pro-1B images.
plan32 --model janus-pro-1b --pool-mb 4096 --policy full >"$tmp/p.txt" 2>&1
[ "$(cell "$tmp/p.txt" "images in the pool at once" 0)" = 9 ] && ok "--pool-mb 4096: 9 full-cache images" \
    || fail "--pool-mb" "$(grep '^images' "$tmp/p.txt")"
plan32 --model janus-pro-7b >"$tmp/p7.txt" 2>&1
grep -q "full: one image needs 1117.5 MiB, more than the pool" "$tmp/p7.txt" \
    && ok "janus-pro-7b: a full image does not fit the default 1024 MiB pool, and it says so" \
    || fail "janus-pro-7b too large" "$(grep '^images' "$tmp/p7.txt")"

# --policy limits the table to one column; --budget applies to every policy but full.
plan32 --model janus-pro-1b --policy linear --budget 1/4 >"$tmp/l.txt" 2>&1
if grep -qE '^ +linear$' "$tmp/l.txt" && [ "$(cell "$tmp/l.txt" "peak tokens per head" 0)" = $((18 + 144)) ] &&
   [ "$(cell "$tmp/l.txt" "budget" 0)" = "1/4 = 0.25" ]; then ok "--policy linear --budget 1/4: one column, 18 + 6 lines"
else fail "--policy linear --budget 1/4" "$(head -c 800 "$tmp/l.txt")"; fi

# The tiny model: a model directory; its 8 x 8 grid does not suit the default
# budgets, so those policies print why instead of numbers.
if plan32 --model "$model" >"$tmp/t.txt" 2>"$tmp/err"; then
    check_table "plan on the tiny model prints the side-by-side table" "$tmp/t.txt"
    [ "$(cell "$tmp/t.txt" "peak tokens per head" 0)" = $((18 + 63)) ] && ok "tiny model: full holds 18 + 63 tokens" \
        || fail "tiny model full" "$(grep '^peak tokens' "$tmp/t.txt")"
    grep -q '^headkv at budget 1/8 = 0.125: does not suit this grid: .*budget' "$tmp/t.txt" &&
    [ "$(cell "$tmp/t.txt" "peak tokens per head" 3)" = "n/a" ] \
        && ok "tiny model: headkv's defaults do not suit 8 x 8, and it says why" \
        || fail "tiny model headkv" "$(grep -A1 '^headkv' "$tmp/t.txt")"
else fail "plan on the tiny model" "$(cat "$tmp/err")"; fi
plan32 --model "$model" --budget 1/2 >"$tmp/t2.txt" 2>&1
got="$(cell "$tmp/t2.txt" "peak tokens per head" 1) $(cell "$tmp/t2.txt" "peak tokens per head" 2)"
[ "$got" = "40 50" ] && ok "tiny model at 1/2: streaming floor(81/2) = 40, linear 18 + 4 lines = 50" \
    || fail "tiny model at 1/2" "got '$got'"

# Only arserve.json is read: a folder holding nothing else plans the same.
mkdir -p "$tmp/archonly" && cp "$model/arserve.json" "$tmp/archonly/"
plan32 --model "$tmp/archonly" >"$tmp/a.txt" 2>&1 &&
    diff <(tail -n +2 "$tmp/a.txt" | grep -v 'kv-dtype auto') <(tail -n +2 "$tmp/t.txt" | grep -v 'kv-dtype auto') >/dev/null \
    && ok "a directory with only arserve.json (no weights) plans the same" || fail "arserve.json only" "$(head -5 "$tmp/a.txt")"
plan32 --model "$root/config/presets/janus-pro-1b" >"$tmp/d.txt" 2>&1 &&
    diff <(tail -n +2 "$tmp/d.txt") <(tail -n +2 "$tmp/janus-pro-1b.txt") >/dev/null \
    && ok "a preset's folder works as a model directory" || fail "preset folder as directory"

# Presets are found from any working directory (beside the binary), or in
# $ARSERVE_PRESETS_DIR.
if [ "$(cd "$(dirname "$bin")/.." && pwd)" = "$root" ]; then
    (cd "$tmp" && plan32 --model janus-pro-7b --policy full >/dev/null 2>"$tmp/err") \
        && ok "presets are found from another working directory" || fail "presets from elsewhere" "$(cat "$tmp/err")"
else ok "presets from another working directory: skipped (the binary is outside the repository)"; fi
mkdir -p "$tmp/presets/mine" && cp "$model/arserve.json" "$tmp/presets/mine/"
ARSERVE_PRESETS_DIR=$tmp/presets plan32 --model mine --policy full >/dev/null 2>"$tmp/err" \
    && ok "ARSERVE_PRESETS_DIR adds presets" || fail "ARSERVE_PRESETS_DIR" "$(cat "$tmp/err")"

# ---- next-scale presets (family scale) ----

# scale_row FILE STEP: the row of the per-scale table for STEP, its columns
# separated by single spaces ("11 48 2304 2304 6425 / ... 3925 / ...").
scale_row() {
    awk -v step="$2" '/^trajectory by scale/ { on = 1; next }
        on && $1 == step { $1 = $1; print; exit }' "$1"
}
# within FILE_VALUE WANT: |value - want| <= 0.1% of want
within() { awk -v v="$1" -v w="$2" 'BEGIN { d = v - w; if (d < 0) d = -d; exit !(v != "" && d <= w / 1000) }'; }

# VAR d16..d30: scales 1..16 (680 tokens, 424 cached: the last scale, 256
# tokens, never is); full = d layers x d heads x 64 x 2 (K, V) x 4 B x 424 x 2
# (CFG); streaming at 1/6 caps a head at floor(424/6) = 70 tokens after every
# layer (3 sink scales, 14 tokens, + the 56 newest; of a larger scale only
# its newest 56 are cached).
for d in 16 20 24 30; do
    f=$tmp/var-d$d.txt
    if plan32 --model var-d$d >"$f" 2>"$tmp/err"; then
        want=$((d * d * 64 * 2 * 4 * 424 * 2))
        got="$(cell "$f" "peak tokens per head" 0) $(cell "$f" "peak tokens per head" 1) $(cell "$f" "peak KV per image, tokens (B)" 0)"
        [ "$got" = "424 70 $want" ] && ok "var-d$d: full 424 tokens per head = ${d}x${d}x64x2x4x424x2 = $want B; streaming 70" \
            || fail "var-d$d peaks" "got '$got', want '424 70 $want'"
        [ "$(scale_row "$f" 9 | cut -d' ' -f1-4)" = "9 16 256 0" ] && [ "$(scale_row "$f" 4 | cut -d' ' -f1-4)" = "4 5 25 25" ] \
            && ok "var-d$d: the per-scale table (step, side, tokens, cached); the last scale is not cached" \
            || fail "var-d$d per-scale table" "$(sed -n '/^trajectory by scale/,/^$/p' "$f")"
    else fail "plan --model var-d$d" "$(cat "$tmp/err")"; fi
done
f=$tmp/var-d16.txt
grep -qE '^ +full +streaming +heatkv +heatkv_binary +amskv +scalekv$' "$f" && ! grep -qE '^(linear|headkv) at' "$f" \
    && ok "var-d16: the table lists the policies that run on scales (not linear, not headkv)" \
    || fail "var-d16 policies" "$(grep -E '^ +full' "$f")"
[ "$(cell "$f" "budget" 1)" = "1/6 = 0.1667" ] && grep -q '^streaming at budget 1/6 = 0.1667: cap 70 tokens per head after every layer: prefix 0 + 3 sink scales (14 tokens with the prefix) + the 56 most recent tokens' "$f" \
    && ok "var-d16: streaming on scales caps a head at its budget and says so" || fail "streaming budget on scales" "$(grep -E '^(budget|streaming)' "$f")"
expect_fail "one policy that refuses scales: exit 1 with the reason" 1 "linear works on raster models" -- \
    plan32 --model var-d16 --policy linear

# Infinity (HeatKV's Table 1, full cache at batch 8, "38550 MB" and "84328 MB"):
# 6425 cached tokens (every scale but the 64 x 64 one) x layers x width x
# (4 B K in f32 + 2 B V in bf16) x 2 CFG rows x 8 images, in MiB.
for m in "infinity-2b 32 2048 38550" "infinity-8b 40 3584 84328"; do
    set -- $m
    f=$tmp/$1.txt
    if "$bin" plan --model "$1" --batch 8 --kv-dtype f32,bf16 >"$f" 2>"$tmp/err"; then
        want=$((6425 * $2 * $3 * 6 * 2 * 8))
        line=$(grep '^full-cache KV of the batch' "$f")
        mb=$(cell "$f" "batch peak, tokens (MiB)" 0)
        if [ "$line" = "full-cache KV of the batch (8 images x 2 CFG rows, --batch): $want bytes = $(awk -v b="$want" 'BEGIN { printf "%.1f", b / 1048576 }') MiB" ] &&
           within "$mb" "$4" && [ "$(cell "$f" "peak tokens per head" 0)" = 6425 ]; then
            ok "$1 --batch 8 --kv-dtype f32,bf16: full cache $mb MiB (HeatKV Table 1: $4 MB, within 0.1%)"
        else fail "$1 Table 1" "line '$line', batch peak '$mb', want $want bytes, ~$4 MiB"; fi
    else fail "plan --model $1 --batch 8 --kv-dtype f32,bf16" "$(cat "$tmp/err")"; fi
done
# HeatKV's Table 1 budget columns: per-head capacities of 1300, 650 and 265
# of the 6425 cached tokens, times the full cache (2B: 7800/3900/1590 MB,
# 8B: 17062/8531/3478 MB). heatkv's own peak, the tokens alone, stays within
# the budget after every layer; the preset has no calibration, and says so.
for m in "infinity-2b 1300:7800 650:3900 265:1590" "infinity-8b 1300:17062 650:8531 265:3478"; do
    set -- $m
    mname=$1; shift
    for pair in "$@"; do
        n=${pair%%:*} paper=${pair#*:}
        f=$tmp/heat-$mname-$n.txt
        if "$bin" plan --model "$mname" --batch 8 --kv-dtype f32,bf16 --policy heatkv --budget-tokens "$n" >"$f" 2>"$tmp/err"; then
            b=$(cell "$f" "budget x full, batch (MiB)" 0) peak=$(cell "$f" "batch peak, tokens (MiB)" 0)
            if within "$b" "$paper" && awk -v p="$peak" -v b="$b" 'BEGIN { exit !(p > 0 && p <= b) }' &&
               grep -q '^heatkv and scalekv calibration: a synthetic ordering' "$f"; then
                ok "$mname heatkv --budget-tokens $n: budget $b MiB (HeatKV Table 1: $paper MB), peak $peak MiB within it"
            else fail "$mname heatkv $n" "budget '$b' (paper $paper), peak '$peak'"; fi
        else fail "plan --model $mname --policy heatkv --budget-tokens $n" "$(cat "$tmp/err")"; fi
    done
done
expect_fail "--budget-tokens past the full cache's peak is refused" 2 "--budget-tokens 7000: more than a head holds" -- \
    plan32 --model infinity-2b --budget-tokens 7000
expect_fail "--budget and --budget-tokens together are refused" 2 "give --budget or --budget-tokens, not both" -- \
    plan32 --model infinity-2b --budget 0.1 --budget-tokens 650
expect_fail "heatkv below its sink scales names the budget" 1 "budget 0.001 holds less than the 3 sink scales" -- \
    plan32 --model infinity-2b --policy heatkv --budget 0.001

f=$tmp/infinity-2b.txt
[ "$(scale_row "$f" 11 | cut -d' ' -f1-7)" = "11 48 2304 2304 6425 / 38784.0" ] &&
[ "$(scale_row "$f" 12 | cut -d' ' -f1-4)" = "12 64 4096 0" ] &&
[ "$(scale_row "$f" 0 | cut -d' ' -f1-5)" = "0 1 1 1 1" ] \
    && ok "infinity-2b: per scale (side, tokens, cached, held per head): 48 x 48 peaks at 6425, 64 x 64 is never cached" \
    || fail "infinity-2b per-scale table" "$(sed -n '/^trajectory by scale/,/^$/p' "$f")"
# The aspect-ratio table: Infinity's 15 templates at 1M (dynamic_resolution's
# schedules), 10521 tokens at 1:1 and 10774 at 1.25 (70 x 56 last, 3920 of
# them never cached), each size's full cache at the planned batch.
sz=$(sed -n '/^image sizes/,/^$/p' "$f")
[ "$(printf '%s\n' "$sz" | grep -c 'x')" -ge 15 ] &&
printf '%s\n' "$sz" | grep -Eq '^1024x1024 +1\.000 +64x64 +10521 +6425 +4818\.8 +38550\.0 +\(default\)$' &&
printf '%s\n' "$sz" | grep -Eq '^896x1120 +1\.250 +70x56 +10774 +6854 ' &&
printf '%s\n' "$sz" | grep -Eq '^1776x592 +0\.333 +37x111 +11123 +7016 ' \
    && ok "infinity-2b: the aspect-ratio table lists the 15 sizes with their tokens and full caches" \
    || fail "infinity-2b aspect-ratio table" "$sz"
got="$(cell "$f" "peak tokens per head" 1) $(cell "$f" "batch peak, tokens (MiB)" 1)"
# Streaming at 1/6 caps a head at floor(6425/6) = 1070 tokens after every
# layer: 1070 x 32 layers x 16 heads x 2 (CFG) x 8 x 768 B = 6420.0 MiB.
[ "$got" = "1070 6420.0" ] && ok "infinity-2b: streaming at 1/6 holds its cap, 1070 tokens per head, 6420.0 MiB for 8" \
    || fail "infinity-2b streaming" "got '$got'"
grep -q '^KV dtype K f32, V bf16 (4 + 2 bytes per element) as planned (--kv-dtype): 768 bytes per token' "$f" &&
grep -q "NOTE: the engine's pool holds K and V in one type: \`serve --kv-dtype f32\`" "$f" \
    && ok "--kv-dtype f32,bf16: the header names the types and says the engine's pool holds one" \
    || fail "--kv-dtype header" "$(grep -A3 '^KV dtype' "$f")"

# --batch multiplies the per-image peak; --kv-dtype: one type is both, the
# default is serve's (bf16 for a preset), 16-bit types halve every byte, fp8
# quarters them.
plan32 --model var-d16 --policy full >"$tmp/b1.txt" 2>&1
plan32 --model var-d16 --policy full --batch 3 >"$tmp/b3.txt" 2>&1
one=$(sed -n 's/^full-cache KV of the batch (1 image x 2 CFG rows, --batch): \([0-9]*\) bytes.*/\1/p' "$tmp/b1.txt")
three=$(sed -n 's/^full-cache KV of the batch (3 images x 2 CFG rows, --batch): \([0-9]*\) bytes.*/\1/p' "$tmp/b3.txt")
[ -n "$one" ] && [ "$one" = $((16 * 16 * 64 * 2 * 4 * 424 * 2)) ] && [ "$three" = $((3 * one)) ] &&
[ "$(cell "$tmp/b3.txt" "batch peak, tokens (MiB)" 0)" = 318.0 ] \
    && ok "--batch: default 1; --batch 3 is 3 x the image's $one bytes (318.0 MiB)" || fail "--batch" "one '$one', three '$three'"
"$bin" plan --model var-d16 --policy full --kv-dtype f32,f32 >"$tmp/k32.txt" 2>&1
diff -q <(tail -n +2 "$tmp/k32.txt") <(tail -n +2 "$tmp/b1.txt") >/dev/null && ! grep -q NOTE "$tmp/k32.txt" \
    && ok "--kv-dtype f32,f32 is f32 (one type, no note)" || fail "--kv-dtype f32,f32"
"$bin" plan --model var-d16 --policy full >"$tmp/kdef.txt" 2>&1
"$bin" plan --model var-d16 --policy full --kv-dtype fp8 >"$tmp/k8.txt" 2>&1
[ "$(cell "$tmp/kdef.txt" "peak KV per image, tokens (B)" 0)" = $((one / 2)) ] &&
grep -q '^KV dtype bf16 (2 bytes per element), as `serve` stores K and V' "$tmp/kdef.txt" &&
grep -q 'a preset without weights: bf16' "$tmp/kdef.txt" \
    && ok "a preset's default is bf16, what serve stores for real (bf16) checkpoints" \
    || fail "preset default" "$(grep -A3 '^KV dtype' "$tmp/kdef.txt")"
[ "$(cell "$tmp/k8.txt" "peak KV per image, tokens (B)" 0)" = $((one / 4)) ] \
    && ok "--kv-dtype fp8 quarters the bytes" || fail "--kv-dtype fp8" "$(cell "$tmp/k8.txt" "peak KV per image, tokens (B)" 0)"
"$bin" plan --model "$model" --policy full >"$tmp/md.txt" 2>&1
grep -q '^KV dtype f16 (2 bytes per element), as `serve` stores K and V' "$tmp/md.txt" &&
grep -q "the weights' type" "$tmp/md.txt" \
    && ok "a model directory's default is its weights' type (the tiny model's f16)" \
    || fail "model directory default" "$(grep -A2 '^KV dtype' "$tmp/md.txt")"
"$bin" plan --model var-d16 --policy full --kv-dtype bf16 >"$tmp/k16.txt" 2>&1
"$bin" plan --model var-d16 --policy full --kv-dtype f16,bf16 >"$tmp/kf16.txt" 2>&1
h=$(cell "$tmp/k16.txt" "peak KV per image, tokens (B)" 0)
[ "$h" = $((one / 2)) ] && [ "$(cell "$tmp/kf16.txt" "peak KV per image, tokens (B)" 0)" = "$h" ] &&
grep -q '^KV dtype bf16 (2 bytes per element), as `serve` stores' "$tmp/k16.txt" &&
grep -q '^KV dtype f16 (2 bytes per element) as planned (--kv-dtype)' <("$bin" plan --model var-d16 --policy full --kv-dtype f16) \
    && ok "--kv-dtype bf16 (one value: both) and f16,bf16 halve the bytes" || fail "--kv-dtype 16-bit" "got '$h', want $((one / 2))"

# The tiny next-scale model, a model directory.
if [ -n "$var_model" ]; then
    if plan32 --model "$var_model" >"$tmp/vt.txt" 2>"$tmp/err"; then
        [ "$(cell "$tmp/vt.txt" "peak tokens per head" 0)" = 14 ] && [ "$(scale_row "$tmp/vt.txt" 3 | cut -d' ' -f1-4)" = "3 4 16 0" ] \
            && ok "the tiny next-scale model: 1 + 4 + 9 = 14 tokens cached, the 4 x 4 scale never" \
            || fail "tiny next-scale model" "$(head -c 600 "$tmp/vt.txt")"
    else fail "plan on the tiny next-scale model" "$(cat "$tmp/err")"; fi
else ok "the tiny next-scale model: skipped (no third argument)"; fi

# Bad --batch and --kv-dtype values name the flag.
# --device-gib: the pool serve's --kv-pool-mb auto makes on a device of that
# size, --pool-share of what the weights' file bytes leave, counted by hand.
"$bin" plan --model "$model" --device-gib 1 --pool-share 0.5 >"$tmp/dev" 2>&1
wbytes=$(stat -c %s "$model"/*.safetensors | awk '{s += $1} END {print s}')
hbytes=$("$python_for_plan" - "$model" <<'PY'
import json, os, struct, sys
total = 0
for f in os.listdir(sys.argv[1]):
    if f.endswith(".safetensors"):
        with open(os.path.join(sys.argv[1], f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items()
                     if k != "__metadata__")
print(total)
PY
)
want_mb=$(awk -v w="$hbytes" 'BEGIN { printf "%d", 0.5 * (1073741824 - w) / 1048576 }')
if grep -qE "^pool     $want_mb MiB:" "$tmp/dev" &&
   grep -qF -- "--device-gib 1: 50% of the" "$tmp/dev" && [ "$hbytes" -gt 0 ] && [ "$hbytes" -le "$wbytes" ]
then ok "--device-gib: the pool is --pool-share of the device less the weights ($want_mb MiB)"
else fail "--device-gib: the pool is --pool-share of the device less the weights" \
    "want $want_mb MiB: $(grep -A1 '^pool' "$tmp/dev")"; fi
expect_fail "--device-gib on a preset (no weight files) is refused" 2 "--device-gib needs the model's weights" -- \
    "$bin" plan --model janus-pro-7b --device-gib 80
expect_fail "--device-gib smaller than the weights is refused" 2 "more than the 1e-06 GiB device" -- \
    "$bin" plan --model "$model" --device-gib 0.000001
expect_fail "--batch 0 is refused" 2 "--batch" -- "$bin" plan --model var-d16 --batch 0
expect_fail "--batch that is not an integer is refused" 2 "--batch: 'two' is not an integer" -- \
    plan32 --model var-d16 --batch two
expect_fail "--batch past its limit is refused" 2 "--batch" -- "$bin" plan --model var-d16 --batch 100000
expect_fail "--kv-dtype with an unknown type is refused" 2 "--kv-dtype: the type 'f8' is not one of f32, bf16, f16, fp8" -- \
    "$bin" plan --model var-d16 --kv-dtype f8
expect_fail "--kv-dtype names the part at fault" 2 "--kv-dtype: V's type 'int8' is not one of f32, bf16, f16" -- \
    "$bin" plan --model var-d16 --kv-dtype f32,int8
expect_fail "--kv-dtype with an empty part is refused" 2 "--kv-dtype: K's type ''" -- \
    "$bin" plan --model var-d16 --kv-dtype ,bf16
expect_fail "--kv-dtype with three types is refused" 2 "--kv-dtype: 'f32,bf16,f16' has more than two types" -- \
    "$bin" plan --model var-d16 --kv-dtype f32,bf16,f16
expect_fail "--kv-dtype is case-sensitive" 2 "--kv-dtype" -- "$bin" plan --model var-d16 --kv-dtype F32
expect_fail "--kv-dtype without a value is refused" 2 "--kv-dtype needs a value" -- "$bin" plan --model var-d16 --kv-dtype

# Refusals.
expect_fail "an unknown preset lists the available ones" 2 "janus-pro-1b, janus-pro-7b, llamagen-b, llamagen-l, llamagen-xl, llamagen-xxl" -- \
    plan32 --model janus-pro-3b
expect_fail "an unknown preset is named with --model" 2 "--model: 'janus-pro-3b'" -- \
    plan32 --model janus-pro-3b
expect_fail "a missing --model is refused" 2 "--model" -- "$bin" plan
expect_fail "an unknown --policy names the flag and the choices" 2 "--policy: 'h2o' is not one of full, streaming, linear, headkv, heatkv, heatkv_binary, amskv, scalekv" -- \
    plan32 --model janus-pro-1b --policy h2o
expect_fail "--budget 0 is refused" 2 "--budget" -- "$bin" plan --model janus-pro-1b --budget 0
expect_fail "--budget above 1 is refused" 2 "--budget" -- "$bin" plan --model janus-pro-1b --budget 1.5
expect_fail "--budget that is not a number is refused" 2 "--budget" -- "$bin" plan --model janus-pro-1b --budget half
expect_fail "--budget 1/0 is refused" 2 "--budget" -- "$bin" plan --model janus-pro-1b --budget 1/0
expect_fail "--pool-mb 0 is refused" 2 "--pool-mb" -- "$bin" plan --model janus-pro-1b --pool-mb 0
expect_fail "--pool-mb that is not an integer is refused" 2 "--pool-mb" -- "$bin" plan --model janus-pro-1b --pool-mb 1.5
expect_fail "--prompt-tokens 0 is refused" 2 "--prompt-tokens" -- "$bin" plan --model janus-pro-1b --prompt-tokens 0
expect_fail "--prompt-tokens past the prompt limit is refused" 2 "--prompt-tokens" -- \
    plan32 --model janus-pro-1b --prompt-tokens 5000
expect_fail "an unknown flag is refused" 2 "unrecognized" -- "$bin" plan --model janus-pro-1b --bogus
expect_fail "a flag without its value is refused" 2 "--budget" -- "$bin" plan --model janus-pro-1b --budget
expect_fail "a stray argument is refused" 2 "unexpected argument 'extra'" -- "$bin" plan --model janus-pro-1b extra
expect_fail "one policy that does not suit the grid: exit 1 with the reason" 1 "budget" -- \
    plan32 --model janus-pro-1b --policy linear --budget 1/8
plan32 --model janus-pro-1b --budget 1/8 >"$tmp/b8.txt" 2>&1 && grep -q '^linear at budget 1/8 = 0.125: does not suit this grid: budget 0.125 keeps 3 of 24 lines' "$tmp/b8.txt" \
    && [ "$(cell "$tmp/b8.txt" "peak tokens per head" 3)" = 118 ] \
    && ok "side by side at 1/8: linear says why (3 of 24 lines), the others have numbers" \
    || fail "side by side at 1/8" "$(grep '^linear' "$tmp/b8.txt")"
cp -r "$model" "$tmp/badcfg"
sed -i 's/"num_layers": 2/"num_layerz": 2/' "$tmp/badcfg/arserve.json"
expect_fail "a bad arserve.json is an error naming the key" 1 "llm.num_layerz" -- "$bin" plan --model "$tmp/badcfg"
"$bin" plan --help >"$tmp/h.txt" 2>&1 && grep -q -- "--prompt-tokens" "$tmp/h.txt" && grep -q -- "--batch N" "$tmp/h.txt" &&
    grep -q -- "--kv-dtype K,V" "$tmp/h.txt" && ok "plan --help" || fail "plan --help"
"$bin" --help | grep -q '^  plan ' && ok "arserve --help lists plan" || fail "arserve --help lists plan"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
