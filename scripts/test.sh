#!/usr/bin/env bash
# The README's test command: installs what a fresh Debian 12 machine lacks,
# checks formatting, then builds and runs every test twice: a normal build and
# an AddressSanitizer + UndefinedBehaviorSanitizer build.
#
#   scripts/test.sh              both builds
#   KVF_TEST_BUILDS=normal scripts/test.sh   only the normal build
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh

jobs=$(nproc)
builds=${KVF_TEST_BUILDS:-"normal asan"}

echo "== format check"
files=$(git ls-files '*.c' '*.h' 2>/dev/null || find . -name '*.[ch]' -not -path './build*')
clang-format --dry-run -Werror $files

for b in $builds; do
    case "$b" in
    normal) dir=build; flags=(-DKVF_SANITIZE=OFF -DKVF_EXPLORER_STEPS=5000000) ;;
    asan) dir=build-asan; flags=(-DKVF_SANITIZE=ON -DKVF_EXPLORER_STEPS=1000000) ;;
    *) echo "unknown build '$b'" >&2; exit 2 ;;
    esac
    echo "== $b build ($dir)"
    cmake -S . -B "$dir" "${flags[@]}" >/dev/null
    cmake --build "$dir" -j "$jobs" >/dev/null
    echo "== $b tests"
    # Sanitizer reports fail the test; leaks at exit too.
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
    export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    (cd "$dir" && ctest --output-on-failure -j "$jobs")
done
