#!/usr/bin/env bash
# The CUDA backend on a real GPU, from the GPU kit (`make gpu-kit`): no build,
# no network, no venv, so it runs on a GPU machine that has the NVIDIA
# driver, cuBLAS and python3 but none of our Debian libraries.
#
#   tests/gpu/run.sh --kit KIT OUTDIR [--budget-s S]   # KIT: the folder or its .tar.xz
#   tests/gpu/run.sh                                    # make gpu-kit here, then run it
#
# From the repository's root (the golden data and the shipped models are
# read from there). First a preflight: the kit's checksums; every library
# of every kit binary resolved, inside the kit or to the C library's
# family, libstdc++ and libgcc_s; cuBLAS and the driver found (and linked
# into the kit's lib/ when the loader would not find them); the binaries
# start. Then the GPU: its name, memory, driver and compute capability,
# and enough free memory. Without a GPU it says why it skips and exits 0,
# after the library check has passed.
#
# Then each stage under `timeout`, within the budget (default 480 s, so a
# rerun of the whole fits a 10-minute call), its output streamed to
# OUTDIR/run.log: the backend ops against the CPU, the tiny model end to end
# on both backends for every KV policy, the golden tests of Janus, LlamaGen,
# VAR and Infinity on the CUDA backend, the shipped models on cuda against cpu,
# `arserve generate --backend cuda` against cpu, and the timings against
# PyTorch on the same GPU (bench/gpu_bench.py). A stage that fails is run
# again with CUDA_LAUNCH_BLOCKING=1 and ARSERVE_CUDA_CHECK=1 (every op
# synchronised and checked, so the log names the op that faulted) and once
# under compute-sanitizer's memcheck, into OUTDIR/reruns.log. It ends with
# OUTDIR/summary.json and at most 8 files in OUTDIR, and each stage's
# seconds. Exit status: 0 all passed (or skipped: no GPU), 1 a stage or the
# preflight failed, 2 a usage error.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD

# What a kit binary may take from the machine it runs on (make_kit.sh has
# the same two lists): glibc's family, the C++ and GCC runtimes, and what
# only the GPU machine has.
SYSTEM_LIBS='^(linux-vdso\.so|ld-linux-x86-64\.so|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libresolv\.so|libstdc\+\+\.so|libgcc_s\.so)'
GPU_LIBS='^(libcuda\.so|libcublas\.so|libcublasLt\.so)'
# The GPU memory the stages need free: the Janus-Pro-1B-shaped model of the
# timing stage in bf16 (about 4 GB) with its KV pool and cuBLAS's workspace.
MIN_FREE_MIB=12288
MAX_OUT_FILES=8

usage() {
    echo "usage: $0 [--kit KIT OUTDIR [--budget-s SECONDS]]" >&2
    exit 2
}

kit="" out="" budget=480
if [ $# -eq 0 ]; then
    make gpu-kit || { echo "tests/gpu/run.sh: FAIL: make gpu-kit"; exit 1; }
    kit=build/gpu-kit out=build/gpu-run
fi
while [ $# -gt 0 ]; do
    case $1 in
    --kit)
        [ $# -ge 3 ] || usage
        kit=$2 out=$3
        shift 3
        ;;
    --budget-s)
        [ $# -ge 2 ] && [[ $2 =~ ^[0-9]+$ ]] && [ "$2" -ge 60 ] || {
            echo "tests/gpu/run.sh: --budget-s takes whole seconds, at least 60" >&2
            exit 2
        }
        budget=$2
        shift 2
        ;;
    *) usage ;;
    esac
done
[ -n "$kit" ] || usage

mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
rm -f "$out/run.log" "$out/reruns.log" "$out/summary.json"
LOG=$out/run.log
RERUNS=$out/reruns.log
exec > >(tee -a "$LOG") 2>&1
TEE=$!

T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((budget - $(elapsed))); }

# ---- the summary --------------------------------------------------------------
# One JSON object, written by hand (no jq or python needed): each stage's
# name, status (pass, fail, skip), seconds, tests passed and failed, and a
# line of detail.
STAGES=()
GPU_JSON='null'
PREFLIGHT=()
json_str() {
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    s=$(printf '%s' "$s" | tr -d '\000-\037')
    printf '"%s"' "$s"
}
add_stage() { # name status seconds passed failed detail
    STAGES+=("{\"name\": $(json_str "$1"), \"status\": $(json_str "$2"), \"seconds\": $3, \"passed\": $4, \"failed\": $5, \"detail\": $(json_str "$6")}")
    printf '%-18s %-5s %4ss  %s\n' "$1" "$2" "$3" "$6" >>"$out/.stages"
}
finish() { # result reason
    local IFS=,
    {
        echo "{"
        echo "  \"result\": $(json_str "$1"),"
        echo "  \"reason\": $(json_str "$2"),"
        echo "  \"kit\": $(json_str "$(sed ':a;N;$!ba;s/\n/; /g' "$KIT/kit.txt" 2>/dev/null)"),"
        echo "  \"gpu\": $GPU_JSON,"
        echo "  \"preflight\": [${PREFLIGHT[*]}],"
        echo "  \"stages\": [${STAGES[*]}],"
        echo "  \"budget_s\": $budget,"
        echo "  \"total_s\": $(elapsed)"
        echo "}"
    } >"$out/summary.json"
    echo "== seconds per stage"
    [ -f "$out/.stages" ] && cat "$out/.stages"
    rm -f "$out/.stages"
    echo "total $(elapsed) s of a $budget s budget"
    local n
    n=$(find "$out" -maxdepth 1 -type f | wc -l)
    [ "$n" -le "$MAX_OUT_FILES" ] ||
        echo "tests/gpu/run.sh: warning: $n files in $out, more than the $MAX_OUT_FILES that come back"
    echo "tests/gpu/run.sh: $1${2:+: $2}"
    exec >&- 2>&-
    wait "$TEE" 2>/dev/null
    case $1 in
    pass | skip) exit 0 ;;
    *) exit 1 ;;
    esac
}
preflight_item() { # name ok|fail detail
    PREFLIGHT+=("{\"check\": $(json_str "$1"), \"ok\": $([ "$2" = ok ] && echo true || echo false), \"detail\": $(json_str "$3")}")
    printf 'preflight: %-10s %-4s %s\n' "$1" "$2" "$3"
    [ "$2" = ok ] || finish fail "preflight: $1: $3"
}

# ---- the kit ------------------------------------------------------------------
echo "== tests/gpu/run.sh --kit $kit $out (budget $budget s)"
if [ -d "$kit" ]; then
    KIT=$(cd "$kit" && pwd)
elif [ -f "$kit" ]; then
    unpack=$(mktemp -d /tmp/arserve-kit.XXXXXX)
    trap 'rm -rf "$unpack"' EXIT
    # tar runs xz; a machine without xz has python3's lzma.
    if command -v xz >/dev/null; then
        tar -C "$unpack" -xJf "$kit"
    else
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$kit" "$unpack"
    fi || { KIT=""; preflight_item kit fail "cannot unpack $kit"; }
    KIT=$(find "$unpack" -mindepth 1 -maxdepth 1 -type d | head -n 1)
else
    KIT=""
    preflight_item kit fail "$kit is neither a kit folder nor its .tar.xz (make gpu-kit)"
fi
[ -f "$KIT/SHA256SUMS" ] && [ -f "$KIT/kit.txt" ] ||
    preflight_item kit fail "$kit has no SHA256SUMS or kit.txt: not a kit from make gpu-kit"
if ! bad=$(cd "$KIT" && sha256sum -c --quiet SHA256SUMS 2>&1); then
    preflight_item kit fail "checksums differ: $(echo "$bad" | head -n 3 | tr '\n' ' ')"
fi
preflight_item kit ok "$(sed ':a;N;$!ba;s/\n/; /g' "$KIT/kit.txt")"

# ---- cuBLAS and the driver --------------------------------------------------------
# A library the loader cannot find for the kit's binaries is looked for where
# CUDA and torch's wheels keep it and linked into the kit's lib/, which the
# binaries search first (their DT_RPATH): nothing else's environment changes.
# (Whole outputs into variables first: with pipefail, `ldd | grep -q`
# fails when grep's early exit kills ldd with SIGPIPE.)
resolves() {
    local deps
    deps=$(ldd "$KIT/bin/arserve" 2>/dev/null)
    grep -q "^[[:space:]]*$1 => /" <<<"$deps"
}
find_lib() { # name: the first copy of it in the usual places
    local dirs=("${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/local/cuda/lib
        /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/x86_64-linux/lib /usr/local/nvidia/lib64
        /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/wsl/lib)
    local py
    py=$(python3 -c 'import nvidia, sys; print("\n".join(nvidia.__path__))' 2>/dev/null)
    for d in "${dirs[@]}"; do
        [ -e "$d/$1" ] && { echo "$d/$1"; return 0; }
    done
    [ -n "$py" ] && find $py -name "$1" 2>/dev/null | head -n 1 | grep . && return 0
    return 1
}
link_in() { # name [companion...]: found and linked into the kit, or 1
    local path
    path=$(find_lib "$1") || return 1
    for n in "$@"; do
        [ -e "$(dirname "$path")/$n" ] && ln -sf "$(dirname "$path")/$n" "$KIT/lib/$n"
    done
    return 0
}
cublas=$(ldd "$KIT/bin/arserve" | awk '/libcublas\.so/{print $1; exit}')
if ! resolves "$cublas"; then
    link_in "$cublas" "$cublas" "${cublas/libcublas/libcublasLt}" ||
        preflight_item cublas fail "$cublas is nowhere the loader, CUDA or torch's nvidia wheels keep it"
fi
preflight_item cublas ok "$(ldd "$KIT/bin/arserve" | awk '/libcublas\.so/{print $3; exit}')"
driver=none
cache=$(ldconfig -p 2>/dev/null)
if grep -q 'libcuda\.so\.1 ' <<<"$cache"; then
    driver=$(awk '/libcuda\.so\.1 /{print $NF; exit}' <<<"$cache")
elif link_in libcuda.so.1 libcuda.so.1; then
    driver="$(readlink "$KIT/lib/libcuda.so.1") (linked into the kit)"
fi
preflight_item driver ok "$driver"

# ---- the libraries ------------------------------------------------------------------
for b in "$KIT"/bin/*; do
    deps=$(ldd "$b" 2>&1)
    missing=$(echo "$deps" | grep -E 'not found' | awk '{print $1}' | tr '\n' ' ')
    [ -z "$missing" ] || preflight_item libraries fail "$(basename "$b") needs $missing(not found)"
    outside=$(echo "$deps" | awk '/=> \//{print $1, $3}' | while read -r name path; do
        [[ $name =~ $SYSTEM_LIBS || $name =~ $GPU_LIBS ]] && continue
        case ${path/\/bin\/..\/lib\//\/lib\/} in "$KIT"/lib/*) ;; *) echo -n "$name ($path) " ;; esac
    done)
    outside=${outside% }
    [ -z "$outside" ] ||
        preflight_item libraries fail "$(basename "$b") loads $outside from outside the kit"
done
need=$(sed -n 's/^glibc: //p' "$KIT/kit.txt")
have=$(ldd --version 2>/dev/null | head -n 1 | grep -o '[0-9][0-9.]*$')
if [ -n "$need" ] && [ -n "$have" ] &&
    [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | tail -n 1)" != "$have" ]; then
    preflight_item libraries fail "the kit needs glibc $need, this machine has $have"
fi
version=$("$KIT/bin/arserve" --version 2>&1) ||
    preflight_item libraries fail "arserve --version: $version"
preflight_item libraries ok "$(ls "$KIT/bin" | wc -l) binaries resolve every library (glibc $have, the kit's needs $need); $version"

# ---- the GPU ------------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1; then
    finish skip "no NVIDIA GPU here (no nvidia-smi); the kit's libraries all resolve"
fi
gpu=$(nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version,compute_cap \
    --format=csv,noheader,nounits 2>&1 | head -n 1)
IFS=, read -r g_name g_total g_free g_driver g_cap <<<"$gpu"
g_name=$(echo "$g_name" | xargs) g_total=${g_total// /} g_free=${g_free// /}
g_driver=${g_driver// /} g_cap=${g_cap// /}
if ! [[ $g_total =~ ^[0-9]+$ && $g_free =~ ^[0-9]+$ ]]; then
    finish skip "no NVIDIA GPU here (nvidia-smi: $(echo "$gpu" | head -c 200)); the kit's libraries all resolve"
fi
GPU_JSON="{\"name\": $(json_str "$g_name"), \"memory_mib\": $g_total, \"free_mib\": $g_free, \"driver\": $(json_str "$g_driver"), \"compute_capability\": $(json_str "$g_cap")}"
preflight_item gpu ok "$g_name, $g_total MiB ($g_free free), driver $g_driver, compute capability $g_cap"
archs=$(sed -n 's/^archs: //p' "$KIT/kit.txt")
cap=${g_cap//./}
if ! [[ " $archs " == *" $cap "* ]]; then
    last=${archs##* }
    [ -n "$last" ] && [ "${last//[!0-9]/}" -le "${cap//[!0-9]/}" ] 2>/dev/null ||
        preflight_item arch fail "the kit has code for sm_${archs// /, sm_} only; this GPU is sm_$cap"
    preflight_item arch ok "no sm_$cap code: the driver compiles compute_$last's PTX"
else
    preflight_item arch ok "sm_$cap"
fi
[ "$g_free" -ge "$MIN_FREE_MIB" ] ||
    preflight_item memory fail "$g_free MiB free, the stages need $MIN_FREE_MIB"
preflight_item memory ok "$g_free MiB free"

# ---- the stages ---------------------------------------------------------------------
status=0
export ARSERVE_TEST_BACKEND=cuda
export ARSERVE_TINY_MODEL=$KIT/models/tiny-model ARSERVE_VAR_TINY_MODEL=$KIT/models/var-tiny-model

# run NAME CAP CMD...: CMD under timeout (CAP seconds, or what the budget has
# left, keeping RESERVE for the stages after), streamed into the log; its
# last "N passed, N failed" line, if any, counts its tests.
RESERVE=0
run() {
    local name=$1 cap=$2
    shift 2
    local t=$(($(left) - RESERVE))
    [ "$t" -gt "$cap" ] && t=$cap
    if [ "$t" -lt 10 ]; then
        add_stage "$name" skip 0 0 0 "the budget is spent ($(elapsed) s of $budget)"
        return 0
    fi
    echo "== $name: $* (timeout ${t}s)"
    local s0 rc tally
    s0=$(date +%s)
    timeout -k 10 "$t" "$@" 2>&1 | tee "$out/.stage"
    rc=${PIPESTATUS[0]}
    local secs=$(($(date +%s) - s0))
    tally=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$out/.stage" | tail -n 1)
    local p=${tally%% passed*} f=${tally#*, }
    f=${f%% failed*}
    [ -n "$tally" ] || p=0 f=0
    if [ "$rc" = 0 ]; then
        add_stage "$name" pass "$secs" "$p" "$f" "${tally:-exit 0}"
        rm -f "$out/.stage"
        return 0
    fi
    local why="exit $rc"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="timed out after ${t}s"
    # The first line that says what failed, else the last one that is not the tally.
    local first
    first=$(grep -vE '^[0-9]+ passed, [0-9]+ failed' "$out/.stage" |
        grep -m1 -E 'FAIL|not ok|[Ee]rror|cannot|failed|[Aa]borted|[Ss]egmentation')
    [ -n "$first" ] || first=$(grep -vE '^[0-9]+ passed, [0-9]+ failed' "$out/.stage" | tail -n 1)
    add_stage "$name" fail "$secs" "$p" "$f" "$why${tally:+; $tally}: $(echo "$first" | head -c 300)"
    rm -f "$out/.stage"
    status=1
    case $1 in "$B"/test_*) rerun "$name" "$@" ;; esac
    return 1
}

# A failed stage again, synchronised and checked after every op, and the
# first failed stage once more under compute-sanitizer (a later one would
# most often fault where the first did, and memcheck is slow), each bounded
# by what the budget has left; appended to reruns.log, its telling lines
# printed.
SANITIZED=0
rerun() {
    local name=$1
    shift
    local t=$(($(left) - RESERVE)) r=$out/.rerun
    [ "$t" -gt 120 ] && t=120
    [ "$t" -ge 10 ] || { echo "== $name: no budget left to rerun" | tee -a "$RERUNS"; return; }
    echo "== $name again: CUDA_LAUNCH_BLOCKING=1 ARSERVE_CUDA_CHECK=1 (timeout ${t}s; reruns.log)"
    {
        echo "== $name: CUDA_LAUNCH_BLOCKING=1 ARSERVE_CUDA_CHECK=1 $*"
        CUDA_LAUNCH_BLOCKING=1 ARSERVE_CUDA_CHECK=1 timeout -k 10 "$t" "$@" 2>&1
        echo "(exit $?)"
    } >"$r"
    t=$(($(left) - RESERVE))
    [ "$t" -gt 180 ] && t=180
    if [ "$SANITIZED" = 1 ]; then
        :
    elif ! command -v compute-sanitizer >/dev/null; then
        echo "== $name: no compute-sanitizer on this machine" >>"$r"
    elif [ "$t" -ge 10 ]; then
        SANITIZED=1
        echo "== $name under compute-sanitizer --tool memcheck (timeout ${t}s; reruns.log)"
        {
            echo "== $name: compute-sanitizer --tool memcheck $*"
            timeout -k 10 "$t" compute-sanitizer --tool memcheck --print-limit 20 "$@" 2>&1
            echo "(exit $?)"
        } >>"$r"
    fi
    grep -E 'ARSERVE_CUDA_CHECK|cuda backend|Invalid|ERROR SUMMARY|FAIL|\(exit' "$r" | head -n 12
    cat "$r" >>"$RERUNS"
    rm -f "$r"
}

# Keeps the timing stage's share (at most half the budget): the correctness
# stages come first and may use what is left after it.
RESERVE=$((budget / 2 < 240 ? budget / 2 : 240))
B=$KIT/bin
run ops 90 "$B/test_backend_ops"
run e2e 120 "$B/test_backend_e2e"
# The same two op by op: a step captured into a graph is the default, and
# where it fails on a GPU and this passes, the graphs are to blame.
run ops-graphs-off 90 env ARSERVE_TEST_GRAPHS=off "$B/test_backend_ops"
run e2e-graphs-off 120 env ARSERVE_TEST_GRAPHS=off "$B/test_backend_e2e"
for g in test_golden test_golden_llamagen test_golden_var test_golden_infinity; do
    if [ -x "$B/$g" ]; then
        run "${g#test_}" 90 "$B/$g"
    else
        add_stage "${g#test_}" fail 0 0 0 "$g is not in the kit"
        status=1
    fi
done
if [ -x "$B/test_backend_models" ]; then
    run models 150 "$B/test_backend_models"
else
    add_stage models fail 0 0 0 "test_backend_models is not in the kit"
    status=1
fi

# The tiny model's greedy image on both backends, the GPU in split
# activations (the mode within rounding of the CPU): identical PNGs expected.
generate() {
    local be
    for be in cuda cpu; do
        "$B/arserve" generate --backend "$be" --gpu-activations split --model "$ARSERVE_TINY_MODEL" \
            --prompt "a red circle" --seed 1 --temperature 0 -q -o "$out/generate-$be.png" ||
            return 1
    done
    if cmp -s "$out/generate-cpu.png" "$out/generate-cuda.png"; then
        echo "generate: the cuda and cpu images are identical"
    else
        echo "generate: the cuda and cpu images differ (greedy; test_backend_e2e compares the tokens)"
    fi
}
export B out
export -f generate
run generate 60 bash -c generate

RESERVE=0
if python3 -c 'import torch, transformers' 2>/dev/null; then
    run timing "$(($(left) - 10))" python3 bench/gpu_bench.py --bin "$B" --out "$out" \
        --budget-s "$(($(left) - 20))"
else
    add_stage timing skip 0 0 0 "python3 with torch and transformers is not here"
fi

[ "$status" = 0 ] && finish pass "" || finish fail "$(grep -c ' fail ' "$out/.stages" 2>/dev/null) stages failed"
