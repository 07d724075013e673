#!/bin/sh
# Fuzz the C solver under AddressSanitizer and UBSan (leaks included).
#
#     .ci/fuzz.sh [iterations [seconds [seed]]]    e.g. .ci/fuzz.sh 100000
#
# Exits non-zero on any sanitizer report or malformed result.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$(mktemp -d "${TMPDIR:-/tmp}/remat-fuzz.XXXXXX")
trap 'rm -rf "$bin"' EXIT
${CC:-gcc} -std=c99 -O1 -g -fno-omit-frame-pointer \
    -fsanitize=address,undefined -fno-sanitize-recover=all \
    -I"$root/src_c" "$root/src_c/solver.c" "$root/src_c/problem.c" "$root/src_c/minmemory.c" "$root/src_c/mintime.c" \
    "$root/src_c/mintime_table.c" "$root/src_c/mintime_row.c" "$root/src_c/fuzz.c" \
    -lm -o "$bin/fuzz"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:exitcode=86 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$bin/fuzz" "${1:-2000}" "${2:-0}" "${3:-1}"
