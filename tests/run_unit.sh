#!/usr/bin/env bash
# Runs every test binary given as an argument, then prints the sum of their
# "N passed, N failed" lines as the last line. Exits non-zero if any failed.
set -u
total_p=0 total_f=0 status=0
for t in "$@"; do
    echo "== $t"
    out=$("$t" 2>&1); rc=$?
    printf '%s\n' "$out"
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -n 1)
    if [ -z "$line" ]; then
        echo "!! $t printed no summary (exit $rc)"; total_f=$((total_f + 1)); status=1; continue
    fi
    p=${line%% passed*}; f=${line#*, }; f=${f%% failed*}
    total_p=$((total_p + p)); total_f=$((total_f + f))
    [ "$rc" -ne 0 ] && status=1
done
echo "${total_p} passed, ${total_f} failed"
exit $status
