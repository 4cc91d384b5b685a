#!/usr/bin/env bash
# bench/rpc/ratio.sh: what a room lifecycle costs against bare gRPC calls,
# measured in one run, alternated (issue 24).
#
# Each round runs, one after the other on the same machine:
#   echo     bench_rpc_echo --serve (the project's rpc glue, CQ threads that
#            answer at once) and its closed-loop client, THREADS in flight;
#   memory   kvfence-control without --data-dir and bench_cp_rpc phase 1
#            (lifecycles: 2 JoinRoom + 2 Completed node messages + 2 leases
#            RELEASED, the fake nodes acknowledge every RoomUpdate);
#   durable  the same with --data-dir (WAL + fsync);
# and prints, per round and as medians, the ratio of a lifecycle's wall time
# to N = 4 bare calls' (2 joins + 2 node messages: the operations a lifecycle
# is made of), and the same for the server's CPU time, plus the RoomUpdates
# sent per lifecycle. Targets (issue 24): memory <= 1.5x, durable <= 2x.
# Builds nothing: build first (ninja -C build kvfence-control bench_cp_rpc
# bench_rpc_echo).
# usage: bench/rpc/ratio.sh [BUILD_DIR (build)]
# Environment: ROUNDS (3), THREADS (8), DURATION (4 s), N (4), SERVER (the
# kvfence-control to measure; default BUILD_DIR's, e.g. an older build's).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=${1:-build}
case $BUILD in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
SERVER=${SERVER:-$BUILD/controlplane/kvfence-control}
BENCH=$BUILD/bench/rpc/bench_cp_rpc
ECHO=$BUILD/bench/rpc/bench_rpc_echo
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-8}
DURATION=${DURATION:-4}
N=${N:-4}

for f in "$SERVER" "$BENCH" "$ECHO"; do
  if [ ! -x "$f" ]; then
    echo "ratio.sh: $f is missing: build it first" >&2
    exit 2
  fi
done

TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvf-ratio.XXXXXX")
SRV_PID=
cleanup() {
  if [ -n "$SRV_PID" ] && kill -0 "$SRV_PID" 2>/dev/null; then
    kill -TERM "$SRV_PID" 2>/dev/null || true
    wait "$SRV_PID" 2>/dev/null || true
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT

# wait_port: waits for $TMP/port (30 s), sets PORT.
wait_port() {
  local i
  for i in $(seq 600); do
    [ -s "$TMP/port" ] && break
    if ! kill -0 "$SRV_PID" 2>/dev/null; then
      echo "ratio.sh: the server exited before serving" >&2
      exit 1
    fi
    sleep 0.05
  done
  [ -s "$TMP/port" ] || { echo "ratio.sh: no port file after 30 s" >&2; exit 1; }
  PORT=$(cat "$TMP/port")
}

stop_server() {
  kill -TERM "$SRV_PID"
  wait "$SRV_PID" || { echo "ratio.sh: the server exited with $?" >&2; exit 1; }
  SRV_PID=
}

# field LINE NAME: the value of NAME=... in a RESULT line.
field() { printf '%s\n' "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"; }

run_echo() {
  rm -f "$TMP/port"
  "$ECHO" --serve --port-file "$TMP/port" 2>"$TMP/echo.log" &
  SRV_PID=$!
  wait_port
  "$ECHO" --target "127.0.0.1:$PORT" --server-pid "$SRV_PID" --threads "$THREADS" \
    --duration "$DURATION" | grep '^RESULT'
  stop_server
}

run_life() {
  rm -f "$TMP/port"
  local extra=()
  if [ "$1" = durable ]; then
    rm -rf "$TMP/data"
    mkdir -p "$TMP/data"
    extra=(--data-dir "$TMP/data")
  fi
  "$SERVER" --listen 127.0.0.1:0 --port-file "$TMP/port" --heartbeat-timeout-ms 0 \
    --metrics-listen 127.0.0.1:0 ${extra[@]+"${extra[@]}"} 2>"$TMP/$1.log" &
  SRV_PID=$!
  wait_port
  "$BENCH" --target "127.0.0.1:$PORT" --server-pid "$SRV_PID" --threads "$THREADS" \
    --duration "$DURATION" --abort-rooms 0 --no-pings | grep '^RESULT'
  stop_server
}

echo "ratio.sh: $ROUNDS rounds of echo / memory / durable, $THREADS threads, $DURATION s each, N = $N;"
echo "  machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg) at the start"
printf '%-5s %8s %9s %9s %7s %7s %9s %9s %7s %7s %6s %6s %6s %6s %6s\n' round "echo/s" \
  "memory/s" "durable/s" "mem x" "dur x" "mem cpu x" "dur cpu x" "cpu e" "cpu m" "cpu d" "upd m" \
  "ack m" "upd d" "ack d"
: >"$TMP/rows"
for r in $(seq "$ROUNDS"); do
  e=$(run_echo)
  m=$(run_life memory)
  d=$(run_life durable)
  # A lifecycle's wall time over N bare calls' wall time (both THREADS in
  # flight): (1 / lifecycles per s) / (N / calls per s); the same for the
  # server's CPU (us per lifecycle over N times us per call).
  awk -v r="$r" -v e="$(field "$e" calls_per_s)" -v ec="$(field "$e" srv_cpu_us)" \
    -v m="$(field "$m" lifecycles_per_s)" -v mc="$(field "$m" srv_cpu_us)" \
    -v mu="$(field "$m" updates_per_lifecycle)" -v ma="$(field "$m" acks_per_lifecycle)" \
    -v d="$(field "$d" lifecycles_per_s)" -v dc="$(field "$d" srv_cpu_us)" \
    -v du="$(field "$d" updates_per_lifecycle)" -v da="$(field "$d" acks_per_lifecycle)" \
    -v n="$N" 'BEGIN {
      printf "%-5s %8.0f %9.0f %9.0f %6.2fx %6.2fx %8.2fx %8.2fx %7.1f %7.1f %6.0f %6.2f %6.2f %6.2f %6.2f\n",
        r, e, m, d, e / (n * m), e / (n * d), mc / (n * ec), dc / (n * ec), ec, mc, dc, mu, ma, du, da
    }' | tee -a "$TMP/rows"
done
echo "  (x: a lifecycle over $N bare calls, wall time and server CPU; cpu: server CPU in us per"
echo "   echo call / memory lifecycle / durable lifecycle; upd, ack: RoomUpdates and"
echo "   RoomUpdateAcks per lifecycle, memory and durable)"
# Medians of the ratio columns.
awk '{ for (c = 5; c <= 8; c++) { v[c, NR] = $c + 0 } } END {
  for (c = 5; c <= 8; c++) {
    for (i = 1; i <= NR; i++) a[i] = v[c, i]
    for (i = 1; i <= NR; i++) for (j = i + 1; j <= NR; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    med[c] = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2
  }
  printf "median: lifecycle / %d bare calls: memory %.2fx (target <= 1.5x), durable %.2fx (target <= 2x); server CPU: memory %.2fx, durable %.2fx\n", n, med[5], med[6], med[7], med[8]
}' n="$N" "$TMP/rows"
echo "  load $(cut -d' ' -f1-3 /proc/loadavg) at the end"
