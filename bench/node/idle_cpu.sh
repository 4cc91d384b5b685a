#!/bin/bash
# idle_cpu.sh BUILD_DIR [SECONDS]: what an attached kvfence-node with nothing
# to do costs: its CPU time (utime + stime, all threads) and its owner
# thread's wake-ups (voluntary context switches of "kvf-owner") over SECONDS
# (default 30). One kvfence-control and one kvfence-node on 127.0.0.1, in a
# temporary directory that is removed at the end. Goal: an idle node's owner
# sleeps until a descriptor or a deadline (heartbeats, 1/s) wakes it.
set -eu
B=${1:?usage: idle_cpu.sh BUILD_DIR [SECONDS]}
S=${2:-30}
D=$(mktemp -d /tmp/kvf-idle-XXXXXX)
CP=""
N=""
cleanup() {
    [ -n "$N" ] && kill "$N" 2>/dev/null && wait "$N" 2>/dev/null
    [ -n "$CP" ] && kill "$CP" 2>/dev/null && wait "$CP" 2>/dev/null
    rm -rf "$D"
}
trap cleanup EXIT
wait_file() {
    for _ in $(seq 100); do
        [ -s "$1" ] && return 0
        sleep 0.1
    done
    echo "no $1 after 10 s" >&2
    exit 1
}
"$B/controlplane/kvfence-control" --listen 127.0.0.1:0 --port-file "$D/cp.port" \
    --metrics-listen "" >"$D/cp.log" 2>&1 &
CP=$!
wait_file "$D/cp.port"
"$B/dataplane/kvfence-node" --control "127.0.0.1:$(head -1 "$D/cp.port")" --node-id idle1 \
    --local-socket "$D/n.sock" --port-file "$D/n.port" >"$D/n.log" 2>&1 &
N=$!
wait_file "$D/n.port"
sleep 2
ticks() { awk '{print $14 + $15}' "/proc/$N/stat"; }
owner() {
    for t in /proc/"$N"/task/*; do
        if [ "$(cat "$t/comm")" = kvf-owner ]; then
            awk '/^voluntary_ctxt_switches/{print $2}' "$t/status"
            return
        fi
    done
    echo 0
}
t0=$(ticks)
w0=$(owner)
sleep "$S"
t1=$(ticks)
w1=$(owner)
hz=$(getconf CLK_TCK)
echo "idle kvfence-node over ${S} s: cpu $(( (t1 - t0) * 1000 / hz )) ms," \
    "owner thread wake-ups $((w1 - w0))"
