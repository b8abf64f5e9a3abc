#!/usr/bin/env bash
# Seeds the GPU kit's build folder with the release build's CPU objects:
#   tests/gpu/seed_kit_objects.sh RELEASE_BUILD KIT_BUILD
# The kit compiles every C file with the release flags plus -DARSERVE_CUDA and the CUDA include
# path, and only engine/backend/backend_open.c reads ARSERVE_CUDA (check: grep), so the other
# objects are the release build's; compiling them again was ~75 CPU-seconds of make test. An
# object is copied (with its time and its dependency file, retargeted) when the kit's is missing
# or older; make then rebuilds only what is out of date, as it would. Nothing to do when the
# release build has not run.
set -eu
rel=$1 kit=$2
[ -d "$rel/engine" ] || exit 0
if grep -rl --include='*.c' --include='*.h' -w ARSERVE_CUDA base engine server cli kernels |
    grep -vx engine/backend/backend_open.c | grep -q .; then
    echo "seed_kit_objects: a file besides backend_open.c reads ARSERVE_CUDA; compiling all" >&2
    exit 0
fi
n=0
while IFS= read -r o; do
    [ "$o" = engine/backend/backend_open.o ] && continue
    if [ ! -e "$kit/$o" ] || [ "$rel/$o" -nt "$kit/$o" ]; then
        mkdir -p "$kit/$(dirname "$o")"
        cp -p "$rel/$o" "$kit/$o"
        d=${o%.o}.d
        if [ -f "$rel/$d" ]; then
            sed "s|^$rel/|$kit/|" "$rel/$d" >"$kit/$d"
            touch -r "$rel/$d" "$kit/$d"
        fi
        n=$((n + 1))
    fi
done < <(cd "$rel" && find base engine server cli kernels -name '*.o' 2>/dev/null)
echo "seed_kit_objects: $n CPU objects from $rel"
