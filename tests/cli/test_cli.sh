#!/usr/bin/env bash
# CLI tests for `arserve generate` on the tiny random model: it writes a PNG
# of the model's size, the same seed gives the same bytes, and bad input
# gives a clear error and a non-zero exit instead of a crash. Without
# --model, generate and serve find the shipped model (or say what to do).
# usage: tests/cli/test_cli.sh path/to/arserve path/to/tiny-model
set -u
bin=$1 model=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0

ok()   { passed=$((passed + 1)); echo "ok      $1"; }
fail() { failed=$((failed + 1)); echo "not ok  $1"; [ -n "${2:-}" ] && echo "  $2"; }

# png_size FILE -> "W H" from the IHDR chunk
png_size() { od -An -tu1 -j16 -N8 "$1" | awk '{print $1*16777216+$2*65536+$3*256+$4, $5*16777216+$6*65536+$7*256+$8}'; }
is_png() { [ "$(od -An -tx1 -N8 "$1" | tr -d ' \n')" = "89504e470d0a1a0a" ]; }

# expect_fail NAME EXIT_CODE TEXT -- command...: the command must exit with
# EXIT_CODE and print TEXT on stderr, and (in a sanitizer build) no report:
# LeakSanitizer keeps a failing command's own exit status, so a leak on an
# error path shows only on stderr.
expect_fail() {
    local name=$1 code=$2 text=$3; shift 4
    "$@" >"$tmp/out" 2>"$tmp/err"; local rc=$?
    if [ "$rc" -eq "$code" ] && grep -qF -- "$text" "$tmp/err" && ! grep -q "Sanitizer" "$tmp/err"; then
        ok "$name"
    else fail "$name" "exit $rc (want $code), stderr: $(head -c 600 "$tmp/err")"; fi
}

if "$bin" generate --model "$model" --prompt-ids 10,11,12 --seed 7 -o "$tmp/a.png" 2>"$tmp/err" \
    && is_png "$tmp/a.png"; then ok "generate writes a PNG"
else fail "generate writes a PNG" "$(cat "$tmp/err")"; fi

size=$(png_size "$tmp/a.png" 2>/dev/null)
[ "$size" = "32 32" ] && ok "PNG has the model's image size (32x32)" || fail "PNG size" "got '$size'"

grep -qE '64 steps in [0-9.]+ s .*images/s' "$tmp/err" && ok "summary line names steps, seconds, images/s" \
    || fail "summary line" "$(cat "$tmp/err")"

! grep -q '^backend ' "$tmp/err" && "$bin" generate --model "$model" --prompt-ids 10,11,12 --seed 7 \
    -o "$tmp/v.png" -v 2>"$tmp/verr" && cmp -s "$tmp/a.png" "$tmp/v.png" &&
    grep -qx 'backend cpu: computes in host memory, with no kernel launches or copies to count' "$tmp/verr" &&
    ok "-v says what a step cost the backend (the CPU: nothing to count), same image" ||
    fail "-v says what a step cost the backend" "$(cat "$tmp/verr")"

"$bin" generate --model "$model" --prompt-ids 10,11,12 --seed 7 -o "$tmp/b.png" -q
cmp -s "$tmp/a.png" "$tmp/b.png" && ok "same seed gives the same bytes" || fail "same seed gives the same bytes"

"$bin" generate --model "$model" --prompt-ids 10,11,12 --seed 8 -o "$tmp/c.png" -q
cmp -s "$tmp/a.png" "$tmp/c.png" && fail "another seed gives another image" || ok "another seed gives another image"

"$bin" generate --model "$model" --prompt-ids 10,11,12 --seed 7 --top-k 1 -o "$tmp/g1.png" -q &&
"$bin" generate --model "$model" --prompt-ids 10,11,12 --seed 99 --top-k 1 -o "$tmp/g2.png" -q &&
cmp -s "$tmp/g1.png" "$tmp/g2.png" && ok "top-k 1 is greedy: the seed does not matter" || fail "greedy ignores the seed"

"$bin" generate --model "$model" --prompt "a red circle on the left" --seed 1 -o "$tmp/t.png" -q \
    && is_png "$tmp/t.png" && ok "--prompt goes through the tokenizer" || fail "--prompt goes through the tokenizer"

expect_fail "missing model directory names the file" 1 "/nonexistent/arserve.json" -- \
    "$bin" generate --model /nonexistent --prompt x -o "$tmp/x.png"
expect_fail "non-integer --seed is refused" 2 "--seed" -- \
    "$bin" generate --model "$model" --prompt x --seed 1.5 -o "$tmp/x.png"
expect_fail "--top-p out of range is refused" 2 "--top-p" -- \
    "$bin" generate --model "$model" --prompt x --top-p 2 -o "$tmp/x.png"
expect_fail "--prompt and --prompt-ids together are refused" 2 "exactly one" -- \
    "$bin" generate --model "$model" --prompt x --prompt-ids 1 -o "$tmp/x.png"
expect_fail "a prompt id outside the vocabulary is refused" 2 "outside the vocabulary" -- \
    "$bin" generate --model "$model" --prompt-ids 1,9999 -o "$tmp/x.png"
# --backend: cpu always; cuda only in a CUDA=1 build (this test runs the
# cpu-only one); an unknown name is refused.
if "$bin" generate --model "$model" --prompt-ids 10,11,12 --seed 7 --backend cpu -q -o "$tmp/c.png" \
    && cmp -s "$tmp/a.png" "$tmp/c.png"; then ok "--backend cpu gives the default's bytes"
else fail "--backend cpu gives the default's bytes"; fi
if "$bin" --version | grep -q "backend: cpu)"; then
    expect_fail "--backend cuda without CUDA=1 says how to get it" 1 "rebuild with make CUDA=1" -- \
        "$bin" generate --model "$model" --prompt-ids 10,11,12 --backend cuda -o "$tmp/x.png"
fi
expect_fail "an unknown --backend is refused" 1 "unknown backend" -- \
    "$bin" generate --model "$model" --prompt-ids 10,11,12 --backend metal -o "$tmp/x.png"
expect_fail "an unknown flag is refused" 2 "unrecognized" -- \
    "$bin" generate --model "$model" --prompt x --bogus
expect_fail "an unwritable output names the path" 1 "$tmp/nodir/x.png" -- \
    "$bin" generate --model "$model" --prompt x -q -o "$tmp/nodir/x.png"

cp -r "$model" "$tmp/badcfg"
sed -i 's/"num_layers": 2/"num_layerz": 2/' "$tmp/badcfg/arserve.json"
expect_fail "an unknown config key is named" 1 "llm.num_layerz" -- \
    "$bin" generate --model "$tmp/badcfg" --prompt x -o "$tmp/x.png"

cp -r "$model" "$tmp/trunc"
truncate -s 5000 "$tmp/trunc/model.safetensors"
expect_fail "truncated weights are an error naming the file" 1 "model.safetensors" -- \
    "$bin" generate --model "$tmp/trunc" --prompt x -o "$tmp/x.png"

# A model file that is not a regular file is refused at once, naming it: a
# FIFO would block the load forever, a link to /dev/zero read without end
# (timeout only turns a hang into a failure here; the refusal is instant).
for f in tokenizer.json arserve.json model.safetensors; do
    rm -rf "$tmp/special" && cp -r "$model" "$tmp/special" && rm "$tmp/special/$f"
    mkfifo "$tmp/special/$f"
    expect_fail "$f as a FIFO is refused, named, without waiting" 1 "$f: cannot read: not a regular file (a FIFO)" -- \
        timeout 120 "$bin" generate --model "$tmp/special" --prompt x -o "$tmp/x.png"
    rm "$tmp/special/$f" && ln -s /dev/zero "$tmp/special/$f"
    expect_fail "$f linked to /dev/zero is refused, named" 1 "$f: cannot read: not a regular file (a character device)" -- \
        timeout 120 "$bin" generate --model "$tmp/special" --prompt x -o "$tmp/x.png"
done

# One past its kind's limit is refused by its size, before a byte is read
# (sparse: the test writes nothing).
rm -rf "$tmp/special" && cp -r "$model" "$tmp/special" && truncate -s 257M "$tmp/special/tokenizer.json"
expect_fail "a 257 MiB tokenizer.json is refused by its size" 1 \
    "tokenizer.json: the file is 269484032 bytes, more than the 268435456 it may have" -- \
    "$bin" generate --model "$tmp/special" --prompt x -o "$tmp/x.png"

# tokenizer.json checked against arserve.json: every id it can give needs an
# embedding row; a Unigram unk_id must still name the unknown piece.
inf=$root/tests/golden/infinity_tiny
tok_case() { # NAME DIR PYTHON: a copy of DIR whose tokenizer.json PYTHON edits (t: the JSON)
    rm -rf "$tmp/$1" && mkdir "$tmp/$1" && cp "$2"/arserve.json "$2"/*.safetensors "$2"/tokenizer.json "$tmp/$1/"
    rm -f "$tmp/$1/golden.safetensors"
    python3 -c "import json,sys; p=sys.argv[1]; t=json.load(open(p)); $3; json.dump(t, open(p,'w'))" \
        "$tmp/$1/tokenizer.json"
}
tok_case more "$inf" 't["model"]["vocab"] += [["x%d" % i, -20.0] for i in range(5000)]'
expect_fail "a tokenizer with more ids than text.vocab_size is refused" 1 \
    "tokenizer.json: the tokenizer has ids up to 5299, but text.vocab_size in arserve.json is 300" -- \
    "$bin" generate --model "$tmp/more" --prompt x -o "$tmp/x.png"
tok_case wordlevel "$model" 'v=t["model"]["vocab"]; v.update({"w%d" % i: 1000 + i for i in range(3)})'
expect_fail "a tokenizer with more ids than llm.vocab_size is refused" 1 \
    "but llm.vocab_size in arserve.json is 64" -- \
    "$bin" generate --model "$tmp/wordlevel" --prompt x -o "$tmp/x.png"
tok_case nounk "$inf" 'del t["model"]["vocab"][2]; t["added_tokens"] = [a for a in t["added_tokens"] if a["content"] != "<unk>"]'
expect_fail "a Unigram vocab that lost <unk> is refused, naming unk_id" 1 \
    "model.unk_id 2 names" -- \
    "$bin" generate --model "$tmp/nounk" --prompt x -o "$tmp/x.png"
tok_case fewer "$inf" 't["model"]["vocab"].pop()'
"$bin" generate --model "$tmp/fewer" --prompt "a red circle" -q -o "$tmp/fewer.png" 2>"$tmp/err" \
    && ok "fewer pieces than embedding rows load (T5 has 32,100 for 32,128)" \
    || fail "a tokenizer with 299 of 300 rows" "$(cat "$tmp/err")"
rm -f "$tmp/fewer.png"

# --kv-policy and --kv-budget run a request's policy on one image, and -v
# says what the cache held at its peak beside what the planner planned.
for p in full streaming; do
    if "$bin" generate --model "$model" --prompt-ids 10,11,12 --kv-policy $p -v -o "$tmp/p.png" \
            2>"$tmp/err" && line=$(grep "^KV cache: $p" "$tmp/err") &&
       held=$(sed -E 's/.*peak ([0-9.]+) MiB held.*/\1/' <<<"$line") &&
       planned=$(sed -E 's/.*held, ([0-9.]+) MiB planned.*/\1/' <<<"$line") &&
       [ -n "$held" ] && [ "$held" = "$planned" ]
    then ok "generate --kv-policy $p: the KV peak held is the planned one ($held MiB)"
    else fail "generate --kv-policy $p -v" "$(cat "$tmp/err")"; fi
done
# --cpu-activations bf16 rounds the activations of bf16 Linear weights (the
# bf16 golden model's): an image still, and not f32's bytes; a wrong mode is
# a usage error naming the choices.
b16="$root/tests/golden/janus_tiny_bf16"
if "$bin" generate --model "$b16" --prompt-ids 10,11,12 -q -o "$tmp/f32.png" 2>"$tmp/err" &&
   "$bin" generate --model "$b16" --prompt-ids 10,11,12 -q --cpu-activations bf16 \
       -o "$tmp/bf16.png" 2>>"$tmp/err" && is_png "$tmp/bf16.png" &&
   ! cmp -s "$tmp/f32.png" "$tmp/bf16.png"
then ok "generate --cpu-activations bf16 draws, rounding what f32 keeps"
else fail "generate --cpu-activations bf16" "$(cat "$tmp/err")"; fi
if "$bin" generate --model "$model" --prompt-ids 10,11,12 -q --cpu-activations bf16 \
       -o "$tmp/w.png" 2>"$tmp/err" && grep -q "warning: --cpu-activations bf16 changes nothing here: the model's weights are F16" "$tmp/err"
then ok "generate --cpu-activations bf16 on F16 weights warns that it changes nothing"
else fail "generate --cpu-activations bf16 on F16 weights" "$(cat "$tmp/err")"; fi
expect_fail "an unknown --cpu-activations names the choices" 2 "f32, bf16" -- \
    "$bin" generate --model "$b16" --prompt-ids 10,11,12 --cpu-activations fp8 -o "$tmp/x.png"
# -v says where the time went: each of a next-scale model's steps (its scales)
# and the decoder; the steps' times add up to the total printed.
if "$bin" generate --model "$inf" --prompt "a red circle" -v -o "$tmp/t.png" 2>"$tmp/err" &&
   line=$(grep "^time: " "$tmp/err") &&
   python3 - "$line" <<'PY'
import re, sys
m = re.fullmatch(r"time: (\d+) steps ([0-9.]+) s \(([0-9. ]+)\), decoder and PNG ([0-9.]+) s", sys.argv[1])
steps = [float(t) for t in m.group(3).split()]
assert len(steps) == int(m.group(1)) == 7, steps
assert abs(sum(steps) - float(m.group(2))) <= 0.005 * len(steps) + 1e-9, (steps, m.group(2))
PY
then ok "generate -v times each scale and the decoder ($line)"
else fail "generate -v's time line" "$(cat "$tmp/err")"; fi
# --repeat: the same image again in one process, a summary line each, -v's
# time line once (the last image's), the PNG the one a single run writes.
if "$bin" generate --model "$inf" --prompt "a red circle" -v --repeat 3 -o "$tmp/r.png" 2>"$tmp/err" &&
   [ "$(grep -c "(image [123] of 3)$" "$tmp/err")" = 3 ] && [ "$(grep -c "^time: " "$tmp/err")" = 1 ] &&
   cmp -s "$tmp/r.png" "$tmp/t.png"
then ok "generate --repeat 3 draws the same image three times, timing each"
else fail "generate --repeat 3" "$(cat "$tmp/err")"; fi
expect_fail "--repeat with --logits-out is a usage error" 2 "--logits-out takes one image" -- \
    "$bin" generate --model "$model" --prompt-ids 10,11,12 --repeat 2 --logits-out "$tmp/l.f32" -o "$tmp/x.png"
expect_fail "--repeat 0 is refused" 2 "repeat" -- \
    "$bin" generate --model "$model" --prompt-ids 10,11,12 --repeat 0 -o "$tmp/x.png"
if "$bin" generate --model "$model" --prompt-ids 10,11,12 --kv-policy streaming --kv-budget 0.5 \
        -v -o "$tmp/p.png" 2>"$tmp/err" && grep -q "^KV cache: streaming at budget 0.5," "$tmp/err"
then ok "generate --kv-budget sets the budget"
else fail "generate --kv-budget 0.5" "$(cat "$tmp/err")"; fi
expect_fail "a budget on full is a usage error naming --kv-budget" 2 "--kv-budget: kv_budget: kv_policy full takes no budget" -- \
    "$bin" generate --model "$model" --prompt-ids 10,11,12 --kv-policy full --kv-budget 0.5 -o "$tmp/x.png"
expect_fail "a policy for other models is a usage error naming --kv-policy" 2 "--kv-policy: heatkv works on next-scale models" -- \
    "$bin" generate --model "$model" --prompt-ids 10,11,12 --kv-policy heatkv -o "$tmp/x.png"
expect_fail "an unknown policy names the choices" 2 "is not one of full, streaming" -- \
    "$bin" generate --model "$model" --prompt-ids 10,11,12 --kv-policy lru -o "$tmp/x.png"
rm -f "$tmp/p.png"

[ ! -e "$tmp/x.png" ] && ok "failed runs write no PNG" || fail "failed runs write no PNG"

# Without --model: $ARSERVE_MODEL, else the shipped model found from the
# binary's own path, <dir>/../models/shapes then <dir>/models/shapes (copies
# of the binary beside copies of the tiny model stand for the layouts).
mkdir -p "$tmp/prefix/bin" "$tmp/prefix/models" "$tmp/flat/models" "$tmp/none/bin" "$tmp/empty"
cp "$bin" "$tmp/prefix/bin/arserve" && cp "$bin" "$tmp/flat/arserve" && cp "$bin" "$tmp/none/bin/arserve"
cp -r "$model" "$tmp/prefix/models/shapes" && cp -r "$model" "$tmp/flat/models/shapes"
ln -s "$tmp/prefix/bin/arserve" "$tmp/link"
for layout in prefix/bin/arserve flat/arserve link; do
    rm -f "$tmp/d.png"
    if (cd "$tmp/empty" && env -u ARSERVE_MODEL "$tmp/$layout" generate --prompt-ids 10,11,12 --seed 7 \
            -q -o "$tmp/d.png") && cmp -s "$tmp/a.png" "$tmp/d.png"; then
        ok "no --model: $layout finds its shipped models/shapes"
    else fail "no --model: $layout finds its shipped models/shapes"; fi
done
rm -f "$tmp/d.png"
if ARSERVE_MODEL=$model "$tmp/none/bin/arserve" generate --prompt-ids 10,11,12 --seed 7 -q -o "$tmp/d.png" \
    && cmp -s "$tmp/a.png" "$tmp/d.png"; then ok "no --model: ARSERVE_MODEL is used"
else fail "no --model: ARSERVE_MODEL is used"; fi
expect_fail "no --model and no shipped model names the paths tried" 1 \
    "no arserve.json in $tmp/none/models/shapes or $tmp/none/bin/models/shapes" -- \
    env -u ARSERVE_MODEL "$tmp/none/bin/arserve" generate --prompt x -o "$tmp/x.png"
expect_fail "no --model and no shipped model says to pass --model" 1 "pass --model DIR" -- \
    env -u ARSERVE_MODEL "$tmp/none/bin/arserve" generate --prompt x -o "$tmp/x.png"
expect_fail "ARSERVE_MODEL without arserve.json is named" 1 "ARSERVE_MODEL=$tmp/empty has no arserve.json" -- \
    env ARSERVE_MODEL="$tmp/empty" "$tmp/prefix/bin/arserve" generate --prompt x -o "$tmp/x.png"
expect_fail "serve without a model says to pass --model" 1 "pass --model DIR" -- \
    env -u ARSERVE_MODEL "$tmp/none/bin/arserve" serve --port 0
# serve finds the shipped model too: it gets ready, then drains on SIGTERM.
# (Waited for as long as it lives; `timeout` only ends a daemon that hangs,
# and --foreground passes our one SIGTERM on once, not to the child and
# then its group: test_lifecycle.py covers a signal delivered twice.)
: >"$tmp/serve.out"
env -u ARSERVE_MODEL timeout --foreground 600 "$tmp/prefix/bin/arserve" serve --port 0 >"$tmp/serve.out" 2>"$tmp/serve.err" &
serve_pid=$!
until grep -q "ready on" "$tmp/serve.out" || ! kill -0 "$serve_pid" 2>/dev/null; do sleep 0.1; done
kill -TERM "$serve_pid" 2>/dev/null
wait "$serve_pid"; serve_rc=$?
if [ "$serve_rc" -eq 0 ] && grep -q "ready on" "$tmp/serve.out" && grep -qF "from $tmp/prefix/models/shapes" "$tmp/serve.err"
then ok "no --model: serve finds its shipped models/shapes"
else fail "no --model: serve finds its shipped models/shapes" "exit $serve_rc: $(tail -c 300 "$tmp/serve.err")"; fi
# The checkout itself: build/arserve -> models/shapes (the shipped demo model).
if [ -f "$(dirname "$bin")/../models/shapes/arserve.json" ]; then
    if env -u ARSERVE_MODEL "$bin" generate --prompt "a red circle" --seed 1 -o "$tmp/s.png" 2>"$tmp/err" \
        && [ "$(png_size "$tmp/s.png")" = "128 128" ]; then ok "no --model: $bin finds models/shapes (128x128)"
    else fail "no --model: $bin finds models/shapes" "$(cat "$tmp/err")"; fi
fi

# An Infinity-architecture model (the golden tiny one): --size picks an
# aspect ratio, --negative-prompt replaces the unconditional row; a size the
# model lacks lists its sizes; a model without a negative path refuses one.
inf="$root/tests/golden/infinity_tiny"
if "$bin" generate --model "$inf" --prompt "a golden dragon" --size 100x40 \
        --negative-prompt "dark blurry" -q -o "$tmp/inf.png" 2>"$tmp/err" &&
   [ "$(png_size "$tmp/inf.png")" = "100 40" ] &&
   "$bin" generate --model "$inf" --prompt "a golden dragon" --size 100x40 -q \
        -o "$tmp/inf2.png" 2>"$tmp/err" && ! cmp -s "$tmp/inf.png" "$tmp/inf2.png"; then
    ok "infinity: --size 100x40 draws 100x40, and --negative-prompt changes the image"
else fail "infinity --size / --negative-prompt" "$(cat "$tmp/err")"; fi
expect_fail "infinity: a size the model lacks is refused with its sizes" 2 \
    "--size: '65x65' is not one of the model's sizes: 64x64, " -- \
    "$bin" generate --model "$inf" --prompt a --size 65x65 -o "$tmp/x.png"
expect_fail "a model without a negative path refuses --negative-prompt" 2 \
    "--negative-prompt: this model takes none" -- \
    "$bin" generate --model "$model" --prompt a --negative-prompt b -o "$tmp/x.png"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
