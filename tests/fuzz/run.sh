#!/usr/bin/env bash
# Configures a clang fuzz build (KVF_FUZZ=ON) in BUILD_DIR, builds the
# libFuzzer targets of tests/fuzz, writes their seed corpora and runs every
# target for RUNS executions (or SECONDS each, whichever ends first), one
# after the other. Prints each target's last libFuzzer status line; exits
# non-zero if a target crashed (the input is left in BUILD_DIR/fuzz-artifacts).
#
#   tests/fuzz/run.sh [RUNS] [SECONDS] [BUILD_DIR]    (defaults: 100000, 600, build-fuzz)
#
# Environment: JOBS (build parallelism, default 2), FUZZ_TARGETS (a subset).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
runs=${1:-100000}
secs=${2:-600}
build=${3:-$root/build-fuzz}
targets=${FUZZ_TARGETS:-"fuzz_config fuzz_wal fuzz_cp_snapshot fuzz_services fuzz_tcp_frame fuzz_peer_envelope"}

CC=clang cmake -S "$root" -B "$build" -DKVF_FUZZ=ON -DKVF_WITH_CUDA=OFF >/dev/null
# shellcheck disable=SC2086
cmake --build "$build" -j"${JOBS:-2}" --target fuzz_seeds $targets
corpus=$build/fuzz-corpus
artifacts=$build/fuzz-artifacts
mkdir -p "$corpus" "$artifacts"
"$build/tests/fuzz/fuzz_seeds" "$corpus"

status=0
for t in $targets; do
    maxlen=4096
    [ "$t" = fuzz_wal ] && maxlen=8192
    dirs=("$corpus/$t")
    [ -d "$here/corpus/$t" ] && dirs+=("$here/corpus/$t")
    log=$build/fuzz-$t.log
    echo "== $t: $runs runs, at most $secs s (log: $log)"
    if "$build/tests/fuzz/$t" -runs="$runs" -max_total_time="$secs" -max_len="$maxlen" \
        -timeout=20 -print_final_stats=1 -artifact_prefix="$artifacts/$t-" "${dirs[@]}" \
        >"$log" 2>&1; then
        grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || tail -1 "$log"
    else
        echo "$t: FAILED (see $log, inputs in $artifacts)"
        grep -E 'ERROR|SUMMARY' "$log" | head -5 || true
        status=1
    fi
done
exit $status
