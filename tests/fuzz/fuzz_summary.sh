#!/usr/bin/env bash
# Prints one line per fuzz target from its `make fuzz` log: executions,
# executions per second, edge coverage (cov), features (ft), corpus entries
# and bytes, and the entries this run added.
# Usage: tests/fuzz/fuzz_summary.sh FUZZ_DIR TARGET...
set -u
dir=$1; shift
printf '%-18s %12s %8s %6s %7s %14s %6s %7s\n' target execs exec/s cov ft corpus new rss_mb
for t in "$@"; do
    log=$dir/logs/$t.log
    [ -f "$log" ] || { printf '%-18s (no log)\n' "$t"; continue; }
    # The last status line, e.g. "#123456 DONE cov: 812 ft: 3071 corp: 402/61Kb lim: 4096 exec/s: 205 rss: 90Mb"
    last=$(grep -E '^#[0-9]+[[:space:]]+(DONE|NEW|REDUCE|pulse|INITED)' "$log" | tail -n 1)
    stat() { grep -o "stat::$1: *[0-9]*" "$log" | grep -o '[0-9]*$' | tail -n 1; }
    cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
    ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
    corp=$(sed -n 's/.* corp: \([0-9]*\/[0-9]*[A-Za-z]*\).*/\1/p' <<<"$last")
    printf '%-18s %12s %8s %6s %7s %14s %6s %7s\n' "$t" "$(stat number_of_executed_units)" \
        "$(stat average_exec_per_sec)" "${cov:-?}" "${ft:-?}" "${corp:-?}" \
        "$(stat new_units_added)" "$(stat peak_rss_mb)"
done
