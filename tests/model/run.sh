#!/usr/bin/env bash
# Checks tests/model/kvfence.pml with spin (Debian's `spin` package) and gcc.
#
#   tests/model/run.sh CHECK [SECONDS]
#
# CHECK is one of:
#   rule        the rule as the daemons run it, every fault at once (pause,
#               kill, loss, duplication, reordering); no violation may be
#               found. Bitstate search, stopped after SECONDS (default 120):
#               the bounded check CI runs.
#   exhaustive  the same rule, exhaustively, in six slices whose union is every
#               behaviour of the model with one pause or one kill: a pause of
#               n0, of n1, of n2 (no kill), a kill of n0, of n1, of n2 (no
#               pause), each with losses, duplicates and reordering. Every
#               slice must run to its end (SECONDS bounds each, default 3 h)
#               with no error. Needs a few GiB; figures in README.md. Run it
#               alone, with nice. `exhaustive pause1` (or kill0, ...) runs one
#               slice.
#   old-rule    the rule before issue 12 (a LOST participant fenced by its
#               peers is quiescent), with only the sink node n1 pausing: spin
#               must find the paused-sink release, a buffered frame landing
#               in released pages (I1).
#   old-recv    a sink's receive in progress not counted as an op: spin must
#               find a frame landing after the release (I1).
# Exit status 0 when the check came out as it must; the spin trail of an
# unexpected violation is printed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
check=${1:?usage: run.sh rule|exhaustive|old-rule|old-recv [SECONDS|SLICE]}
secs=${2:-120}
slice=all
if [ "$check" = exhaustive ]; then
    case "${2:-}" in
        pause[012] | kill[012]) slice=$2; secs=${3:-10800} ;;
        *) secs=${2:-10800} ;;
    esac
fi
command -v spin >/dev/null || { echo "run.sh: spin not found: install the Debian package 'spin'" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/kvf-model.XXXXXX")
trap 'rm -rf "$work"' EXIT
cp "$here/kvfence.pml" "$work/"
cd "$work"

# run NAME EXPECT SPIN_DEFINES PAN_CFLAGS PAN_ARGS: one verification.
# EXPECT: clean (no error may be found) or violation (I1 must be found).
run() {
    local name=$1 expect=$2 defs=$3 cflags=$4 args=$5 out rc=0
    echo "== $name: spin $defs; pan $cflags $args"
    # shellcheck disable=SC2086
    spin $defs -a kvfence.pml >/dev/null
    # shellcheck disable=SC2086
    gcc -O2 -w -DSAFETY $cflags -o pan pan.c
    rm -f kvfence.pml.trail
    # shellcheck disable=SC2086
    out=$(timeout -s INT "$secs" ./pan $args 2>&1) || rc=$?
    grep -E "^pan:1|errors:|states, stored|transitions|total actual memory|elapsed time" <<<"$out" || true
    [ "$rc" = 124 ] && echo "($name: stopped after $secs s, as bounded)"
    local found=0
    grep -q "^pan:1: " <<<"$out" && found=1
    if [ "$expect" != violation ] && [ "$found" = 1 ]; then
        echo "$name: spin found a violation:"
        # shellcheck disable=SC2086
        spin $defs -t -p -g kvfence.pml | tail -60
        return 1
    fi
    if [ "$expect" = violation ]; then
        if [ "$found" = 0 ]; then
            echo "$name: spin found no violation, and one was expected"
            return 1
        fi
        grep -q "assertion violated  !(released" <<<"$out" || {
            echo "$name: the violation is not I1"
            return 1
        }
        echo "$name: the violation, as expected (I1):"
        # shellcheck disable=SC2086
        spin $defs -t kvfence.pml | grep -E "assert|violated" | head -3
    fi
    if [ "$expect" = clean ] && [ "$rc" != 0 ] && [ "$rc" != 124 ]; then
        echo "$name: pan exited $rc"
        return 1
    fi
    if [ "$expect" = complete ]; then
        # Exhaustive: the search must have run to its end, with no error.
        if [ "$rc" != 0 ] || ! grep -q "errors: 0" <<<"$out" ||
            grep -qE "max search depth too small|out of memory" <<<"$out"; then
            echo "$name: the search did not complete cleanly (exit $rc)"
            return 1
        fi
        grep -E "State-vector|hash conflicts" <<<"$out" || true
        echo "$name: complete, errors: 0"
    fi
    return 0
}

case "$check" in
    rule)
        run rule clean "" "-DBITSTATE" "-w28 -m1000000" ;;
    exhaustive)
        for n in 0 1 2; do
            if [ "$slice" = all ] || [ "$slice" = "pause$n" ]; then
                run "exhaustive, pause of n$n" complete "-DMAX_KILLS=0 -DPAUSE_NODE=$n" \
                    "-DCOLLAPSE -DMEMLIM=14000" "-m1000000 -w26"
            fi
        done
        for n in 0 1 2; do
            if [ "$slice" = all ] || [ "$slice" = "kill$n" ]; then
                run "exhaustive, kill of n$n" complete "-DMAX_PAUSES=0 -DKILL_NODE=$n" \
                    "-DCOLLAPSE -DMEMLIM=14000" "-m1000000 -w26"
            fi
        done ;;
    old-rule)
        run old-rule violation "-DOLD_RULE -DMAX_KILLS=0 -DMAX_LOSSES=0 -DPAUSE_NODE=1" "-DBFS -DCOLLAPSE" "" ;;
    old-recv)
        run old-recv violation "-DOLD_RECV -DMAX_KILLS=0 -DMAX_PAUSES=0 -DMAX_LOSSES=0" \
            "-DBFS -DCOLLAPSE" "" ;;
    *) echo "run.sh: unknown check '$check'" >&2; exit 2 ;;
esac
