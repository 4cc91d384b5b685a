#!/usr/bin/env bash
# Checks tests/model/kvfence.pml with spin (Debian's `spin` package) and gcc.
#
#   tests/model/run.sh CHECK [SECONDS]
#
# CHECK is one of:
#   rule        the rule as the daemons run it, every fault at once (pause,
#               kill, loss, duplication, reordering); no violation may be
#               found. Bitstate search, stopped once pan has used SECONDS of
#               CPU time (default 120): the bounded check CI runs. CPU time,
#               not wall time, so a busy machine searches as far as an idle
#               one (it only takes longer).
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
#               Both are breadth-first searches bounded by depth (-m), not by
#               time: they end on their own (the violations lie at depths 56
#               and 38), however loaded the machine is. SECONDS is ignored.
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

# cpu_bounded SECS CMD...: runs CMD (output in pan.out) and interrupts it with
# SIGINT, on which pan prints its statistics and stops, once it has used SECS
# seconds of CPU time. Returns 124 when it had to stop it, else CMD's status.
cpu_bounded() {
    local limit=$1 pid ticks hz stat
    shift
    hz=$(getconf CLK_TCK)
    "$@" >pan.out 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        # Fields 14 and 15 of /proc/PID/stat: user and system time in ticks
        # (pan's name has no space, so splitting on blanks is safe).
        stat=$(cat "/proc/$pid/stat" 2>/dev/null) || break
        read -r -a f <<<"$stat"
        ticks=$((f[13] + f[14]))
        if [ "$ticks" -ge $((limit * hz)) ]; then
            kill -INT "$pid" 2>/dev/null || true
            wait "$pid" || true
            return 124
        fi
        sleep 0.2
    done
    wait "$pid"
}

# run NAME EXPECT BOUND SPIN_DEFINES PAN_CFLAGS PAN_ARGS: one verification.
# BOUND: cpu (stop after $secs CPU seconds), depth (the search ends by itself,
# bounded by -m in PAN_ARGS) or wall (stop after $secs seconds: a backstop for
# the exhaustive slices, whose check then fails as incomplete).
# EXPECT: clean (no error may be found) or violation (I1 must be found).
run() {
    local name=$1 expect=$2 bound=$3 defs=$4 cflags=$5 args=$6 out rc=0
    echo "== $name: spin $defs; pan $cflags $args"
    # shellcheck disable=SC2086
    spin $defs -a kvfence.pml >/dev/null
    # shellcheck disable=SC2086
    gcc -O2 -w -DSAFETY $cflags -o pan pan.c
    rm -f kvfence.pml.trail
    # shellcheck disable=SC2086
    case "$bound" in
        cpu) cpu_bounded "$secs" ./pan $args || rc=$? ;;
        depth) ./pan $args >pan.out 2>&1 || rc=$? ;;
        wall) timeout -s INT "$secs" ./pan $args >pan.out 2>&1 || rc=$? ;;
    esac
    out=$(cat pan.out)
    grep -E "^pan:1|errors:|states, stored|transitions|total actual memory|elapsed time" <<<"$out" || true
    [ "$rc" = 124 ] && echo "($name: stopped after $secs s ($bound), as bounded)"
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
        run rule clean cpu "" "-DBITSTATE" "-w28 -m1000000" ;;
    exhaustive)
        for n in 0 1 2; do
            if [ "$slice" = all ] || [ "$slice" = "pause$n" ]; then
                run "exhaustive, pause of n$n" complete wall "-DMAX_KILLS=0 -DPAUSE_NODE=$n" \
                    "-DCOLLAPSE -DMEMLIM=14000" "-m1000000 -w26"
            fi
        done
        for n in 0 1 2; do
            if [ "$slice" = all ] || [ "$slice" = "kill$n" ]; then
                run "exhaustive, kill of n$n" complete wall "-DMAX_PAUSES=0 -DKILL_NODE=$n" \
                    "-DCOLLAPSE -DMEMLIM=14000" "-m1000000 -w26"
            fi
        done ;;
    old-rule)
        run old-rule violation depth "-DOLD_RULE -DMAX_KILLS=0 -DMAX_LOSSES=0 -DPAUSE_NODE=1" \
            "-DBFS -DCOLLAPSE" "-m60" ;;
    old-recv)
        run old-recv violation depth "-DOLD_RECV -DMAX_KILLS=0 -DMAX_PAUSES=0 -DMAX_LOSSES=0" \
            "-DBFS -DCOLLAPSE" "-m45" ;;
    *) echo "run.sh: unknown check '$check'" >&2; exit 2 ;;
esac
