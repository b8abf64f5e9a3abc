#!/usr/bin/env bash
# An AddressSanitizer build's two kinds of kernels (Makefile: DAEMON_ENGINE_LIB):
# the unit tests, which are where the CPU kernels are checked for overflows,
# run them instrumented; arserve, kv_bench and speed_bench, which the daemon
# suite and test-cli run on the demo models, run them built without the
# sanitizers. Read off the binaries' code: the CPU kernels' functions (every
# function kernels/cpu/ defines) with and without calls into AddressSanitizer.
#   tests/cli/test_asan_kernels.sh BUILD_DIR UNIT_TEST...
set -u
build=${1:?usage: test_asan_kernels.sh BUILD_DIR UNIT_TEST...}
shift
[ $# -gt 0 ] || { echo "usage: test_asan_kernels.sh BUILD_DIR UNIT_TEST..."; exit 2; }
pass=0 fail=0
ok() { echo "ok      $1"; pass=$((pass + 1)); }
bad() { echo "FAIL    $1"; fail=$((fail + 1)); }

kernels=$(nm --defined-only "$build"/plain/kernels/cpu/*.o 2>/dev/null | awk '$2 == "T" { print $3 }' | sort -u)
if [ -z "$kernels" ]; then
    echo "FAIL    no kernel functions in $build/plain/kernels/cpu/ (is $build an AddressSanitizer build?)"
    echo "0 passed, 1 failed"
    exit 1
fi

# The number of the CPU kernels' functions in $1 that call into AddressSanitizer
# (its reports, or its checks where gcc calls them out of line), and how many
# of them $1 has.
instrumented() {
    objdump -d --no-show-raw-insn "$1" | awk -v names="$kernels" '
        BEGIN { n = split(names, a, "\n"); for (i = 1; i <= n; i++) want[a[i]] = 1 }
        /^[0-9a-f]+ <.*>:$/ { f = substr($2, 2, length($2) - 3); seen[f] = 1; next }
        f in want && /call.*<__asan_(report_|load|store)/ { hit[f] = 1 }
        END { h = 0; s = 0; for (k in want) { if (k in seen) s++; if (k in hit) h++ }; print h, s }'
}

for bin in arserve kv_bench speed_bench; do
    read -r hits seen < <(instrumented "$build/$bin")
    if [ "$seen" -gt 0 ] && [ "$hits" -eq 0 ]; then
        ok "$bin: its $seen kernel functions are built without AddressSanitizer"
    else
        bad "$bin: $hits of its $seen kernel functions call AddressSanitizer"
    fi
done
for t in "$@"; do
    read -r hits seen < <(instrumented "$t")
    if [ "$hits" -gt 0 ]; then
        ok "${t##*/}: $hits of its $seen kernel functions are checked by AddressSanitizer"
    else
        bad "${t##*/}: none of its $seen kernel functions is checked by AddressSanitizer"
    fi
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
