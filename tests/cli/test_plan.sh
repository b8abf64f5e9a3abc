#!/usr/bin/env bash
# CLI tests for `arserve plan`: the side-by-side table on every preset in
# config/models/ and on the tiny model, full-cache figures against a hand
# computation, presets found from any directory, and bad flags refused
# with exit 2 and a message naming the flag.
# usage: tests/cli/test_plan.sh path/to/arserve path/to/tiny-model
set -u
bin=$1 model=$2
case $bin in /*) ;; *) bin=$PWD/$bin ;; esac
case $model in /*) ;; *) model=$PWD/$model ;; esac
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0

ok()   { passed=$((passed + 1)); echo "ok      $1"; }
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

for preset in janus-pro-1b janus-pro-7b llamagen-xl; do
    if "$bin" plan --model "$preset" >"$tmp/$preset.txt" 2>"$tmp/err"; then
        check_table "plan --model $preset prints the side-by-side table" "$tmp/$preset.txt"
        n=$(for c in 0 1 2 3; do cell "$tmp/$preset.txt" "peak in the pool, blocks (B)" $c; done | grep -cE '^[0-9]+$')
        [ "$n" = 4 ] && ok "$preset: every policy fits its 24 x 24 grid at its default budget" \
            || fail "$preset: every policy has numbers" "$(grep '^peak in the pool' "$tmp/$preset.txt")"
    else fail "plan --model $preset" "$(cat "$tmp/err")"; fi
done

# Janus-Pro-1B by hand: 24 layers x 16 heads x 128 x 2 (K, V) x 4 bytes (fp32)
# x tokens x 2 (CFG), tokens = prompt + 576 - 1 (the last token is never fed).
for P in 18 1 33; do
    args=(); [ "$P" != 18 ] && args=(--prompt-tokens "$P")
    "$bin" plan --model janus-pro-1b "${args[@]}" >"$tmp/j.txt" 2>&1
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
"$bin" plan --model janus-pro-7b --policy full >"$tmp/j7.txt" 2>&1
want=$((30 * 32 * 128 * 2 * 4 * 593 * 2))
[ "$(cell "$tmp/j7.txt" "peak KV per image, tokens (B)" 0)" = "$want" ] \
    && ok "janus-pro-7b: full cache = 30x32x128x2x4x593x2 = $want bytes" \
    || fail "janus-pro-7b full cache" "$(grep '^peak KV' "$tmp/j7.txt")"
"$bin" plan --model llamagen-xl --prompt-tokens 1 --policy full >"$tmp/lg.txt" 2>&1
want=$((36 * 20 * 64 * 2 * 4 * 576 * 2))
[ "$(cell "$tmp/lg.txt" "peak KV per image, tokens (B)" 0)" = "$want" ] \
    && ok "llamagen-xl: full cache = 36x20x64x2x4x576x2 = $want bytes" \
    || fail "llamagen-xl full cache" "$(grep '^peak KV' "$tmp/lg.txt")"

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
"$bin" plan --model janus-pro-1b --pool-mb 4096 --policy full >"$tmp/p.txt" 2>&1
[ "$(cell "$tmp/p.txt" "images in the pool at once" 0)" = 9 ] && ok "--pool-mb 4096: 9 full-cache images" \
    || fail "--pool-mb" "$(grep '^images' "$tmp/p.txt")"
"$bin" plan --model janus-pro-7b >"$tmp/p7.txt" 2>&1
grep -q "full: one image needs 1117.5 MiB, more than the pool" "$tmp/p7.txt" \
    && ok "janus-pro-7b: a full image does not fit the default 1024 MiB pool, and it says so" \
    || fail "janus-pro-7b too large" "$(grep '^images' "$tmp/p7.txt")"

# --policy limits the table to one column; --budget applies to every policy but full.
"$bin" plan --model janus-pro-1b --policy linear --budget 1/4 >"$tmp/l.txt" 2>&1
if grep -qE '^ +linear$' "$tmp/l.txt" && [ "$(cell "$tmp/l.txt" "peak tokens per head" 0)" = $((18 + 144)) ] &&
   [ "$(cell "$tmp/l.txt" "budget" 0)" = "1/4 = 0.25" ]; then ok "--policy linear --budget 1/4: one column, 18 + 6 lines"
else fail "--policy linear --budget 1/4" "$(head -c 800 "$tmp/l.txt")"; fi

# The tiny model: a model directory; its 8 x 8 grid does not suit the default
# budgets, so those policies print why instead of numbers.
if "$bin" plan --model "$model" >"$tmp/t.txt" 2>"$tmp/err"; then
    check_table "plan on the tiny model prints the side-by-side table" "$tmp/t.txt"
    [ "$(cell "$tmp/t.txt" "peak tokens per head" 0)" = $((18 + 63)) ] && ok "tiny model: full holds 18 + 63 tokens" \
        || fail "tiny model full" "$(grep '^peak tokens' "$tmp/t.txt")"
    grep -q '^headkv at budget 1/8 = 0.125: does not suit this grid: .*budget' "$tmp/t.txt" &&
    [ "$(cell "$tmp/t.txt" "peak tokens per head" 3)" = "n/a" ] \
        && ok "tiny model: headkv's defaults do not suit 8 x 8, and it says why" \
        || fail "tiny model headkv" "$(grep -A1 '^headkv' "$tmp/t.txt")"
else fail "plan on the tiny model" "$(cat "$tmp/err")"; fi
"$bin" plan --model "$model" --budget 1/2 >"$tmp/t2.txt" 2>&1
got="$(cell "$tmp/t2.txt" "peak tokens per head" 1) $(cell "$tmp/t2.txt" "peak tokens per head" 2)"
[ "$got" = "40 50" ] && ok "tiny model at 1/2: streaming floor(81/2) = 40, linear 18 + 4 lines = 50" \
    || fail "tiny model at 1/2" "got '$got'"

# Only arserve.json is read: a folder holding nothing else plans the same.
mkdir -p "$tmp/archonly" && cp "$model/arserve.json" "$tmp/archonly/"
"$bin" plan --model "$tmp/archonly" >"$tmp/a.txt" 2>&1 && diff <(tail -n +2 "$tmp/a.txt") <(tail -n +2 "$tmp/t.txt") >/dev/null \
    && ok "a directory with only arserve.json (no weights) plans the same" || fail "arserve.json only" "$(head -5 "$tmp/a.txt")"
"$bin" plan --model "$root/config/models/janus-pro-1b" >"$tmp/d.txt" 2>&1 &&
    diff <(tail -n +2 "$tmp/d.txt") <(tail -n +2 "$tmp/janus-pro-1b.txt") >/dev/null \
    && ok "a preset's folder works as a model directory" || fail "preset folder as directory"

# Presets are found from any working directory (beside the binary), or in
# $ARSERVE_PRESETS_DIR.
if [ "$(cd "$(dirname "$bin")/.." && pwd)" = "$root" ]; then
    (cd "$tmp" && "$bin" plan --model janus-pro-7b --policy full >/dev/null 2>"$tmp/err") \
        && ok "presets are found from another working directory" || fail "presets from elsewhere" "$(cat "$tmp/err")"
else ok "presets from another working directory: skipped (the binary is outside the repository)"; fi
mkdir -p "$tmp/presets/mine" && cp "$model/arserve.json" "$tmp/presets/mine/"
ARSERVE_PRESETS_DIR=$tmp/presets "$bin" plan --model mine --policy full >/dev/null 2>"$tmp/err" \
    && ok "ARSERVE_PRESETS_DIR adds presets" || fail "ARSERVE_PRESETS_DIR" "$(cat "$tmp/err")"

# Refusals.
expect_fail "an unknown preset lists the available ones" 2 "janus-pro-1b, janus-pro-7b, llamagen-xl" -- \
    "$bin" plan --model janus-pro-3b
expect_fail "an unknown preset is named with --model" 2 "--model: 'janus-pro-3b'" -- \
    "$bin" plan --model janus-pro-3b
expect_fail "a missing --model is refused" 2 "--model" -- "$bin" plan
expect_fail "an unknown --policy names the flag and the choices" 2 "--policy: 'h2o' is not one of full, streaming, linear, headkv" -- \
    "$bin" plan --model janus-pro-1b --policy h2o
expect_fail "--budget 0 is refused" 2 "--budget" -- "$bin" plan --model janus-pro-1b --budget 0
expect_fail "--budget above 1 is refused" 2 "--budget" -- "$bin" plan --model janus-pro-1b --budget 1.5
expect_fail "--budget that is not a number is refused" 2 "--budget" -- "$bin" plan --model janus-pro-1b --budget half
expect_fail "--budget 1/0 is refused" 2 "--budget" -- "$bin" plan --model janus-pro-1b --budget 1/0
expect_fail "--pool-mb 0 is refused" 2 "--pool-mb" -- "$bin" plan --model janus-pro-1b --pool-mb 0
expect_fail "--pool-mb that is not an integer is refused" 2 "--pool-mb" -- "$bin" plan --model janus-pro-1b --pool-mb 1.5
expect_fail "--prompt-tokens 0 is refused" 2 "--prompt-tokens" -- "$bin" plan --model janus-pro-1b --prompt-tokens 0
expect_fail "--prompt-tokens past the prompt limit is refused" 2 "--prompt-tokens" -- \
    "$bin" plan --model janus-pro-1b --prompt-tokens 5000
expect_fail "an unknown flag is refused" 2 "unrecognized" -- "$bin" plan --model janus-pro-1b --bogus
expect_fail "a flag without its value is refused" 2 "--budget" -- "$bin" plan --model janus-pro-1b --budget
expect_fail "a stray argument is refused" 2 "unexpected argument 'extra'" -- "$bin" plan --model janus-pro-1b extra
expect_fail "one policy that does not suit the grid: exit 1 with the reason" 1 "budget" -- \
    "$bin" plan --model janus-pro-1b --policy linear --budget 1/8
"$bin" plan --model janus-pro-1b --budget 1/8 >"$tmp/b8.txt" 2>&1 && grep -q '^linear at budget 1/8 = 0.125: does not suit this grid: budget 0.125 keeps 3 of 24 lines' "$tmp/b8.txt" \
    && [ "$(cell "$tmp/b8.txt" "peak tokens per head" 3)" = 118 ] \
    && ok "side by side at 1/8: linear says why (3 of 24 lines), the others have numbers" \
    || fail "side by side at 1/8" "$(grep '^linear' "$tmp/b8.txt")"
cp -r "$model" "$tmp/badcfg"
sed -i 's/"num_layers": 2/"num_layerz": 2/' "$tmp/badcfg/arserve.json"
expect_fail "a bad arserve.json is an error naming the key" 1 "llm.num_layerz" -- "$bin" plan --model "$tmp/badcfg"
"$bin" plan --help >"$tmp/h.txt" 2>&1 && grep -q -- "--prompt-tokens" "$tmp/h.txt" && ok "plan --help" || fail "plan --help"
"$bin" --help | grep -q '^  plan ' && ok "arserve --help lists plan" || fail "arserve --help lists plan"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
