#!/usr/bin/env bash
# The GPU kit (`make gpu-kit`), checked where there is no GPU: it holds every
# binary tests/gpu/run.sh runs, its checksums and build facts, and packs
# under the bound; `run.sh --kit` on it passes the preflight's library check
# (every library of every binary inside the kit, or glibc's family,
# libstdc++, libgcc_s, cuBLAS and the driver) and then skips for want of a
# GPU; a kit missing a library, or with a file changed, fails the preflight
# naming it; and with a GPU that nvidia-smi reports but the CUDA runtime
# cannot use (a stand-in nvidia-smi), every stage runs, fails, is run again
# synchronised into reruns.log, and the summary says so in at most 8 files.
#
# And on a machine made bare of the kit's libraries (a mount namespace binds
# /dev/null over this machine's copy of each), the kit's arserve still draws
# the tiny model's image, byte for byte as this machine's own arserve does,
# which in that namespace cannot start.
#
#   tests/gpu/test_kit.sh KIT_DIR [ARSERVE]    # KIT_DIR.tar.xz beside it; ARSERVE: this machine's build
set -u
kit=${1:?usage: tests/gpu/test_kit.sh KIT_DIR [ARSERVE]}
host_arserve=${2:-}
cd "$(dirname "$0")/../.." || exit 1
RUN=tests/gpu/run.sh
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok      $1"; }
fail() { failed=$((failed + 1)); echo "not ok  $1"; [ -n "${2:-}" ] && printf '  %s\n' "$2"; }
check() { # name condition-exit-status detail
    if [ "$2" = 0 ]; then ok "$1"; else fail "$1" "${3:-}"; fi
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# What the kit holds.
for b in arserve speed_bench test_backend_ops test_backend_e2e test_golden test_golden_llamagen \
    test_golden_var test_golden_infinity test_backend_models; do
    [ -x "$kit/bin/$b" ]
    check "the kit holds bin/$b" $? "$(ls "$kit/bin" 2>&1 | tr '\n' ' ')"
done
for m in tiny-model var-tiny-model; do
    [ -f "$kit/models/$m/arserve.json" ]
    check "the kit holds models/$m" $?
done
(cd "$kit" && sha256sum -c --quiet SHA256SUMS) >/dev/null 2>&1
check "SHA256SUMS checks every file" $?
for k in commit built nvcc archs glibc cublas; do
    grep -q "^$k: ." "$kit/kit.txt" 2>/dev/null
    check "kit.txt says $k" $? "$(cat "$kit/kit.txt" 2>&1)"
done
size=$(stat -c %s "$kit.tar.xz" 2>/dev/null || echo 0)
[ "$size" -gt 0 ] && [ "$size" -le 20000000 ]
check "the packed kit is under 20 MB ($size bytes)" $?

# The dry run: from the packed kit, as it travels.
"$RUN" --kit "$kit.tar.xz" "$tmp/dry" >"$tmp/dry.out" 2>&1
rc=$?
check "run.sh --kit without a GPU exits 0" "$rc" "exit $rc: $(tail -n 3 "$tmp/dry.out")"
grep -q 'preflight: libraries  ok' "$tmp/dry.out"
check "the library check passes first" $? "$(grep preflight "$tmp/dry.out")"
grep -q 'run.sh: skip: no NVIDIA GPU here' "$tmp/dry.out"
check "it says why it skips" $? "$(tail -n 2 "$tmp/dry.out")"
grep -q '"result": "skip"' "$tmp/dry/summary.json" 2>/dev/null
check "summary.json says skip" $? "$(cat "$tmp/dry/summary.json" 2>&1 | head -c 400)"
cmp -s "$tmp/dry.out" "$tmp/dry/run.log"
check "run.log holds everything it printed" $? "$(diff "$tmp/dry.out" "$tmp/dry/run.log" | head -n 5)"
python3 -m json.tool "$tmp/dry/summary.json" >/dev/null 2>&1
check "summary.json is JSON" $?

# A kit that would load a library from outside itself, and one with a
# changed file.
cp -r "$kit" "$tmp/nolib"
rm -f "$tmp/nolib/lib/libcjson.so.1"
(cd "$tmp/nolib" && grep -v 'lib/libcjson.so.1$' SHA256SUMS >S && mv S SHA256SUMS)
"$RUN" --kit "$tmp/nolib" "$tmp/nolib-out" >"$tmp/nolib.out" 2>&1
rc=$?
[ "$rc" = 1 ] && grep -q 'preflight: libraries  fail .*libcjson.so.1 (/.*) from outside the kit' "$tmp/nolib.out"
check "a library missing from the kit fails the preflight, named" $? \
    "exit $rc: $(grep preflight "$tmp/nolib.out" | tail -n 1 | head -c 300)"
cp -r "$kit" "$tmp/changed"
echo >>"$tmp/changed/models/tiny-model/arserve.json"
"$RUN" --kit "$tmp/changed" "$tmp/changed-out" >"$tmp/changed.out" 2>&1
rc=$?
[ "$rc" = 1 ] && grep -q 'checksums differ: .*models/tiny-model/arserve.json' "$tmp/changed.out"
check "a changed file fails the preflight, named" $? "exit $rc: $(grep preflight "$tmp/changed.out" | tail -n 1)"
"$RUN" --kit "$tmp/none" "$tmp/none-out" >"$tmp/none.out" 2>&1
rc=$?
[ "$rc" = 1 ] && grep -q 'neither a kit folder nor its .tar.xz' "$tmp/none.out"
check "a kit that is not there is named" $? "exit $rc: $(tail -n 1 "$tmp/none.out")"
"$RUN" --kit "$kit" "$tmp/x" --budget-s 5 >"$tmp/budget.out" 2>&1
check "a budget under a minute is a usage error" "$([ $? = 2 ] && echo 0 || echo 1)" "$(cat "$tmp/budget.out")"

# A stand-in nvidia-smi: a GPU the CUDA runtime here cannot reach.
fake_gpu() { # name total free cap
    mkdir -p "$tmp/bin"
    printf '#!/bin/sh\necho "%s, %s, %s, 580.159.04, %s"\n' "$@" >"$tmp/bin/nvidia-smi"
    chmod +x "$tmp/bin/nvidia-smi"
}
fake_gpu "NVIDIA H100 80GB HBM3" 81559 80000 9.0
PATH=$tmp/bin:$PATH "$RUN" --kit "$kit" "$tmp/gpu" >"$tmp/gpu.out" 2>&1
rc=$?
check "stages that fail make it exit 1" "$([ $rc = 1 ] && echo 0 || echo 1)" "exit $rc: $(tail -n 3 "$tmp/gpu.out")"
grep -q 'preflight: gpu        ok   NVIDIA H100 80GB HBM3, 81559 MiB (80000 free)' "$tmp/gpu.out"
check "the preflight names the GPU and its memory" $? "$(grep preflight "$tmp/gpu.out")"
for s in ops e2e ops-graphs-off e2e-graphs-off golden golden_llamagen golden_var models generate; do
    grep -q "\"name\": \"$s\", \"status\": \"fail\"" "$tmp/gpu/summary.json" 2>/dev/null
    check "summary.json: stage $s ran and failed" $? "$(grep -o "\"name\": \"$s\"[^}]*" "$tmp/gpu/summary.json" 2>&1)"
done
grep -q '"name": "ops", .*no CUDA device' "$tmp/gpu/summary.json"
check "a failed stage's detail says why" $? "$(grep -o '"name": "ops"[^}]*' "$tmp/gpu/summary.json")"
grep -q '^== ops: CUDA_LAUNCH_BLOCKING=1 ARSERVE_CUDA_CHECK=1 .*/bin/test_backend_ops' "$tmp/gpu/reruns.log" 2>/dev/null
check "a failed test binary is run again synchronised, into reruns.log" $? "$(head -n 3 "$tmp/gpu/reruns.log" 2>&1)"
grep -q '^== generate: CUDA_LAUNCH_BLOCKING' "$tmp/gpu/reruns.log"
check "a failed command that is not a test binary is not" "$([ $? = 1 ] && echo 0 || echo 1)"
n=$(find "$tmp/gpu" -maxdepth 1 -type f | wc -l)
[ "$n" -le 8 ] && [ -f "$tmp/gpu/run.log" ] && [ -f "$tmp/gpu/summary.json" ]
check "at most 8 files come back, run.log and summary.json among them ($n)" $? "$(ls "$tmp/gpu")"
grep -q '^== seconds per stage' "$tmp/gpu.out" && grep -qE '^ops +fail +[0-9]+s' "$tmp/gpu.out"
check "it ends with each stage's seconds" $? "$(tail -n 12 "$tmp/gpu.out")"

fake_gpu "NVIDIA H100 80GB HBM3" 81559 2000 9.0
PATH=$tmp/bin:$PATH "$RUN" --kit "$kit" "$tmp/mem" >"$tmp/mem.out" 2>&1
rc=$?
[ "$rc" = 1 ] && grep -q 'preflight: memory     fail 2000 MiB free, the stages need' "$tmp/mem.out"
check "too little free GPU memory fails the preflight" $? "exit $rc: $(grep preflight "$tmp/mem.out" | tail -n 1)"
fake_gpu "Tesla T4" 15360 15000 7.5
PATH=$tmp/bin:$PATH "$RUN" --kit "$kit" "$tmp/arch" >"$tmp/arch.out" 2>&1
rc=$?
[ "$rc" = 1 ] && grep -q 'preflight: arch .*fail .*this GPU is sm_75' "$tmp/arch.out"
check "a GPU the kit has no code for fails the preflight" $? "exit $rc: $(grep preflight "$tmp/arch.out" | tail -n 1)"

# The bare machine. Each of the kit's libraries hidden where this machine's
# loader would find it; the kit's binaries must not notice.
if [ -z "$host_arserve" ]; then
    echo "skip    the kit on a machine without its libraries: no ARSERVE to compare with given"
elif ! unshare -m true 2>/dev/null; then
    echo "skip    the kit on a machine without its libraries: unshare -m is not permitted here (needs root)"
else
    # The libraries mount itself loads (PCRE2 among them) are hidden last:
    # once one is hidden, mount cannot start again. -f: a file hidden once
    # through /lib is not hidden again through /usr/lib (the same folder).
    mount_libs=$(ldd "$(command -v mount)" | awk '{print $1}')
    libs="$(ls "$kit/lib" | grep -vxF "$mount_libs") $(ls "$kit/lib" | grep -xF "$mount_libs")"
    bare() { # command...: run with every kit library hidden from the system's folders
        unshare -m bash -c '
            for l in '"$(echo $libs)"'; do
                for d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64 /usr/local/lib; do
                    if [ -f "$d/$l" ] && ! mount --bind /dev/null "$d/$l"; then
                        echo "cannot hide $d/$l"; exit 99
                    fi
                done
            done
            exec "$@"' bare "$@"
    }
    gen=(generate --backend cpu --model "$kit/models/tiny-model" --prompt "a red circle" --seed 3 -q)
    "$host_arserve" "${gen[@]}" -o "$tmp/host.png" >/dev/null 2>&1
    bare "$host_arserve" --version >"$tmp/bare-host.out" 2>&1
    rc=$?
    check "hidden libraries stop this machine's own arserve" "$([ $rc != 0 ] && [ $rc != 99 ] && echo 0 || echo 1)" \
        "$(head -c 300 "$tmp/bare-host.out")"
    bare "$kit/bin/arserve" "${gen[@]}" -o "$tmp/kit.png" >"$tmp/bare-kit.out" 2>&1
    check "the kit's arserve draws without them" $? "$(head -c 300 "$tmp/bare-kit.out")"
    cmp -s "$tmp/host.png" "$tmp/kit.png"
    check "its image is this machine's, byte for byte" $?
fi

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
