#!/usr/bin/env bash
# `make test`'s driver: runs each stage (a make target) in turn, stops at the
# first that fails, and ends with one line per stage run: its seconds and
# outcome, so a slow or failing stage shows in every CI log. Each stage's
# make runs TEST_JOBS jobs (the cores, by default): its builds in parallel,
# and the sanitizer stage's three suites beside each other; each target's
# output is printed whole when it ends (--output-sync).
#   tests/run_stages.sh MAKE STAGE...
set -u
make_cmd=$1
shift
since() { awk -v t0="$1" -v t1="$(date +%s.%N)" 'BEGIN { printf "%.1f", t1 - t0 }'; }
jobs=${TEST_JOBS:-$(nproc)}
rows=() status=0 t_all=$(date +%s.%N)
for stage in "$@"; do
    t0=$(date +%s.%N)
    $make_cmd -j"$jobs" --output-sync=target "$stage"
    rc=$?
    secs=$(since "$t0")
    if [ "$rc" -eq 0 ]; then outcome=ok; else outcome="FAILED (exit $rc)"; fi
    rows+=("$(printf '%-24s %7.1f s  %s' "$stage" "$secs" "$outcome")")
    if [ "$rc" -ne 0 ]; then
        status=$rc
        break
    fi
done
echo
echo "make test: seconds per stage"
printf '  %s\n' "${rows[@]}"
printf '  %-24s %7.1f s\n' "total" "$(since "$t_all")"
exit $status
