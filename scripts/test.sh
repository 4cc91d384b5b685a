#!/usr/bin/env bash
# The README's test command: installs what a fresh Debian 12 machine lacks,
# checks formatting, then builds and runs every test twice: a normal build and
# an AddressSanitizer + UndefinedBehaviorSanitizer build.
#
#   scripts/test.sh              both builds
#   KVF_TEST_BUILDS=normal scripts/test.sh   only the normal build
#   (default "normal asan fuzz": fuzz builds the libFuzzer targets with clang
#   and runs each for 20,000 executions)
#   KVF_TEST_BUILDS="debug release minsize clang" scripts/test.sh
#                                            build only, warnings as errors
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh

jobs=$(nproc)
builds=${KVF_TEST_BUILDS:-"normal asan fuzz"}

echo "== format check"
files=$(git ls-files '*.c' '*.h' 2>/dev/null || find . -name '*.[ch]' -not -path './build*')
clang-format --dry-run -Werror $files
echo "== API reference (docs/api.md) current with the protos"
/usr/bin/python3 scripts/gen_api_docs.py --check

for b in $builds; do
    case "$b" in
    normal) dir=build; flags=(-DKVF_SANITIZE=OFF -DKVF_EXPLORER_STEPS=5000000) ;;
    asan) dir=build-asan; flags=(-DKVF_SANITIZE=ON -DKVF_EXPLORER_STEPS=1000000) ;;
    # Every CMake build type and clang must build without a warning; these
    # only build (KVF_TEST_BUILDS="release minsize clang ..." to run them).
    debug) dir=build-debug; flags=(-DCMAKE_BUILD_TYPE=Debug) ;;
    release) dir=build-release; flags=(-DCMAKE_BUILD_TYPE=Release) ;;
    minsize) dir=build-minsize; flags=(-DCMAKE_BUILD_TYPE=MinSizeRel) ;;
    clang) dir=build-clang; flags=(-DCMAKE_C_COMPILER=clang) ;;
    # The libFuzzer targets (tests/fuzz), each for a short bounded run.
    fuzz) dir=build-fuzz; flags=(-DCMAKE_C_COMPILER=clang -DKVF_FUZZ=ON -DKVF_WITH_CUDA=OFF) ;;
    *) echo "unknown build '$b'" >&2; exit 2 ;;
    esac
    echo "== $b build ($dir)"
    # Warnings are errors here (KVF_WERROR), not in a user's build.
    cmake -S . -B "$dir" -DKVF_WERROR=ON "${flags[@]}" >/dev/null
    targets=()
    [ "$b" = fuzz ] && targets=(--target fuzz_seeds fuzz_config fuzz_wal fuzz_cp_snapshot
        fuzz_services fuzz_tcp_frame fuzz_peer_envelope)
    cmake --build "$dir" -j "$jobs" "${targets[@]}" >/dev/null
    case "$b" in debug | release | minsize | clang) continue ;; esac
    echo "== $b tests"
    # Sanitizer reports fail the test; leaks at exit too.
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
    export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    labels=()
    [ "$b" = fuzz ] && labels=(-L fuzz)
    (cd "$dir" && ctest --output-on-failure -j "$jobs" "${labels[@]}")
done
