#!/usr/bin/env bash
# Functions that exist only for tests are declared in *_test.h headers, not
# in the production ones: code that includes only the production header does
# not compile a call to them, and no production file but the one defining
# them includes a *_test.h.
# usage: tests/cli/test_test_only_api.sh CC [CFLAGS...]
set -u
cc=$1; shift
cflags=("$@")
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
ok()   { passed=$((passed + 1)); echo "ok      $1"; }
fail() { failed=$((failed + 1)); echo "not ok  $1"; [ -n "${2:-}" ] && echo "  $2"; }

# compiles HEADER FUNCTION: whether a file including HEADER can take
# FUNCTION's address (the compiler's messages in $tmp/err).
compiles() {
    printf '#include "%s"\nvoid *test_only_probe(void) { return (void *)%s; }\n' "$1" "$2" >"$tmp/probe.c"
    (cd "$root" && LC_ALL=C "$cc" "${cflags[@]}" -I. -fsyntax-only "$tmp/probe.c") >"$tmp/err" 2>&1
}

# production header, test-only function, its test header
while read -r prod fn test_hdr; do
    if compiles "$prod" "$fn"; then
        fail "$prod does not declare $fn" "it compiled: $fn belongs in $test_hdr"
    elif grep -q "'$fn' undeclared" "$tmp/err"; then
        ok "$prod does not declare $fn"
    else
        fail "$prod does not declare $fn" "the probe failed for another reason: $(head -c 300 "$tmp/err")"
    fi
    compiles "$test_hdr" "$fn" && ok "$test_hdr declares $fn" \
        || fail "$test_hdr declares $fn" "$(head -c 300 "$tmp/err")"
done <<'LIST'
engine/batcher.h batcher_iterate engine/batcher_test.h
server/scheduler.h sched_kv_overruns server/scheduler_test.h
server/config.h server_config_to_json server/config_test.h
server/metrics.h metric_add_v server/metrics_test.h
server/metrics.h metric_set_v server/metrics_test.h
server/metrics.h metric_value_v server/metrics_test.h
LIST

# A *_test.h may be included by tests and by the file that defines what it
# declares (engine/batcher.c for engine/batcher_test.h), by nothing else.
strays=$(cd "$root" && grep -rlE '#include "[^"]*_test\.h"' base kernels engine server cli bench 2>/dev/null |
    while read -r f; do
        grep -oE '#include "[^"]*_test\.h"' "$f" | sed -E 's/#include "(.*)_test\.h"/\1.c/' |
            grep -qvxF "$f" && echo "$f"
    done)
[ -z "$strays" ] && ok "only tests and the defining files include *_test.h" \
    || fail "only tests and the defining files include *_test.h" "$strays"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
