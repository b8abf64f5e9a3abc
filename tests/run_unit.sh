#!/usr/bin/env bash
# Runs every test binary given as an argument, UNIT_JOBS of them at a time
# (the cores by default), prints each one's output whole and in the order
# given as soon as it and those before it have ended, then the sum of their
# "N passed, N failed" lines as the last line. Exits non-zero if any failed.
set -u
jobs=${UNIT_JOBS:-$(nproc)}
case $jobs in '' | *[!0-9]* | 0) echo "run_unit.sh: UNIT_JOBS must be a positive integer, not '$jobs'"; exit 2 ;; esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tests=("$@")
total_p=0 total_f=0 status=0 shown=0

# Prints the results of the tests from $shown on that have ended, in order.
show_ended() {
    while [ "$shown" -lt "${#tests[@]}" ] && [ -e "$tmp/$shown.rc" ]; do
        local t=${tests[$shown]} rc line p f
        rc=$(cat "$tmp/$shown.rc")
        echo "== $t"
        cat "$tmp/$shown.out"
        line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$tmp/$shown.out" | tail -n 1)
        shown=$((shown + 1))
        if [ -z "$line" ]; then
            echo "!! $t printed no summary (exit $rc)"; total_f=$((total_f + 1)); status=1; continue
        fi
        p=${line%% passed*}; f=${line#*, }; f=${f%% failed*}
        total_p=$((total_p + p)); total_f=$((total_f + f))
        [ "$rc" -ne 0 ] && status=1
    done
}

for i in "${!tests[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do
        wait -n
        show_ended
    done
    # The exit status is written after the output, under another name, so a
    # test counts as ended only once both are complete.
    ( "${tests[$i]}" >"$tmp/$i.out" 2>&1; echo $? >"$tmp/$i.rc.part" && mv "$tmp/$i.rc.part" "$tmp/$i.rc" ) &
done
wait
show_ended
echo "${total_p} passed, ${total_f} failed"
exit $status
