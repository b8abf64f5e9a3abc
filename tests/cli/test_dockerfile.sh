#!/usr/bin/env bash
# Docker cannot build here, so this checks the Dockerfile's structure
# instead: two stages (a CUDA devel image that builds with CUDA=1, a CUDA
# runtime image that ships), a non-root USER, EXPOSE 8080, a HEALTHCHECK on
# /health, a CMD that serves on 0.0.0.0 and finds its model, every file it
# COPYs from the build context exists (COPY --from=<stage> is not from the
# context), and every folder whose sources `make CUDA=1 all` compiles is
# copied into the build stage.
# usage: tests/cli/test_dockerfile.sh [path/to/Dockerfile]
set -u
file=${1:-Dockerfile}
ctx=$(dirname "$file")
passed=0 failed=0
ok()   { passed=$((passed + 1)); echo "ok      $1"; }
fail() { failed=$((failed + 1)); echo "not ok  $1"; [ -n "${2:-}" ] && echo "  $2"; }

if [ ! -f "$file" ]; then
    echo "not ok  $file exists"; echo "0 passed, 1 failed"; exit 1
fi
# Instructions with continuation lines joined and comments dropped.
instr=$(sed -e 's/[[:space:]]*$//' "$file" | grep -v '^[[:space:]]*#' |
        awk '/\\$/ { sub(/\\$/, ""); buf = buf $0 " "; next } { print buf $0; buf = "" }' |
        grep -v '^[[:space:]]*$')
keyword() { printf '%s\n' "$instr" | grep -iE "^[[:space:]]*$1([[:space:]]|$)"; }

froms=$(keyword FROM)
n_from=$(printf '%s\n' "$froms" | grep -c .)
[ "$n_from" -eq 2 ] && ok "two FROM stages" || fail "two FROM stages" "found $n_from"
first=$(printf '%s\n' "$froms" | sed -n 1p) last=$(printf '%s\n' "$froms" | sed -n 2p)
printf '%s' "$first" | grep -qE 'nvidia/cuda:.*-devel-' && ok "build stage is a CUDA devel image" \
    || fail "build stage is a CUDA devel image" "$first"
printf '%s' "$last" | grep -qE 'nvidia/cuda:.*-runtime-' && ok "runtime stage is a CUDA runtime image" \
    || fail "runtime stage is a CUDA runtime image" "$last"
grep -qE '^ARG CUDA_VERSION=13\.' "$file" && ok "CUDA 13" || fail "CUDA 13" "no ARG CUDA_VERSION=13.x"
keyword RUN | grep -q 'make .*CUDA=1' && ok "builds with make CUDA=1" || fail "builds with make CUDA=1"

# Everything after the last FROM is the shipped image.
final=$(printf '%s\n' "$instr" | awk 'toupper($1) == "FROM" { buf = "" } { buf = buf $0 "\n" } END { printf "%s", buf }')
user=$(printf '%s\n' "$final" | grep -iE '^USER[[:space:]]' | tail -n 1 | awk '{print $2}')
if [ -n "$user" ] && [ "$user" != root ] && [ "${user%%:*}" != 0 ]; then ok "runs as non-root user '$user'"
else fail "runs as a non-root user" "USER is '${user:-unset}'"; fi
printf '%s\n' "$final" | grep -qiE '^EXPOSE[[:space:]]+8080\b' && ok "EXPOSE 8080" || fail "EXPOSE 8080"
hc=$(printf '%s\n' "$final" | grep -iE '^HEALTHCHECK[[:space:]]')
if printf '%s' "$hc" | grep -qE 'CMD .*(curl|wget).*/health'; then ok "HEALTHCHECK on /health"
else fail "HEALTHCHECK on /health" "${hc:-none}"; fi
tool=$(printf '%s' "$hc" | grep -oE 'curl|wget' | head -n 1)
if [ -n "$tool" ] && printf '%s\n' "$final" | grep -iE '^RUN' | grep -qw "$tool"; then
    ok "the healthcheck's $tool is installed in the runtime stage"
else fail "the healthcheck's tool is installed in the runtime stage" "${tool:-none}"; fi
cmd=$(printf '%s\n' "$final" | grep -iE '^CMD[[:space:]]' | tail -n 1)
if printf '%s' "$cmd" | grep -q '"serve"' && printf '%s' "$cmd" | grep -qE '"--host",[[:space:]]*"0\.0\.0\.0"'; then
    ok "CMD serves on 0.0.0.0"
else fail "CMD serves on 0.0.0.0" "${cmd:-none}"; fi

# The default command finds a model: its CMD names one, or models/ (with the
# shipped models/shapes) is copied to <arserve's folder>/../models, where
# arserve looks when given none (cli_default_model in cli/main.c).
bin_dest=$(printf '%s\n' "$final" | grep -iE '^COPY[[:space:]]' | awk '$NF ~ /\/arserve$/ { print $NF }' | tail -n 1)
models_dest=$(printf '%s\n' "$final" | grep -iE '^COPY[[:space:]]+models/?[[:space:]]' | awk '{ print $NF }' | tail -n 1)
if printf '%s' "$cmd" | grep -q '"--model"'; then ok "CMD names its model"
elif [ -n "$bin_dest" ] && [ "${models_dest%/}" = "$(dirname "$(dirname "$bin_dest")")/models" ] &&
     [ -f "$ctx/models/shapes/arserve.json" ]; then
    ok "the shipped model is copied where arserve looks ($models_dest beside $bin_dest)"
else fail "the default command finds a model" "arserve at '${bin_dest:-?}', models/ at '${models_dest:-not copied}'"; fi

# COPY sources from the context: every argument but the last, flags skipped.
missing=""
n_copied=0
while read -r line; do
    set -f
    # shellcheck disable=SC2086
    set -- $line
    set +f
    shift
    from_stage=0
    while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do
        case $1 in --from=*) from_stage=1 ;; esac
        shift
    done
    [ "$from_stage" = 1 ] && continue
    while [ $# -gt 1 ]; do
        n_copied=$((n_copied + 1))
        [ -e "$ctx/$1" ] || missing="$missing $1"
        shift
    done
done < <(keyword COPY)
if [ "$n_copied" -gt 0 ] && [ -z "$missing" ]; then ok "all $n_copied COPY sources exist in the context"
else fail "every COPY source exists in the context" "missing:${missing:- (no COPY from the context)}"; fi

# The build stage has every folder the CUDA build compiles (as make -n says).
build_stage=$(printf '%s\n' "$instr" | awk 'toupper($1) == "FROM" { n++ } n == 1')
src_dirs=$(cd "$ctx" && make -n CUDA=1 BUILD=/nonexistent/dockerfile-check all 2>/dev/null |
           grep -oE ' -c [^ ]+' | awk '{ print $2 }' | xargs -r -n1 dirname | sort -u)
not_copied=""
# copies DIR: the build stage copies DIR or a folder above it.
copies() {
    local d=$1
    while :; do
        printf '%s\n' "$build_stage" | grep -qiE "^COPY[[:space:]]+(.*[[:space:]])?$d/?[[:space:]]" &&
            return 0
        [ "${d%/*}" = "$d" ] && return 1
        d=${d%/*}
    done
}
for d in $src_dirs; do
    copies "$d" || not_copied="$not_copied $d/"
done
if [ -n "$src_dirs" ] && [ -z "$not_copied" ]; then
    ok "the build stage copies every source folder of the binary ($(echo $src_dirs))"
else fail "the build stage copies every source folder of the binary" "not copied:${not_copied:- (make -n listed none)}"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
