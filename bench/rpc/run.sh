#!/usr/bin/env bash
# bench/rpc/run.sh: runs bench_cp_rpc against a local kvfence-control, twice:
#   1. durable (--data-dir in a temp dir, as in production), with
#      --open-rooms $OPEN_ROOMS; then SIGTERM, restart on the same data dir and
#      report the server's "recovered ... in X ms" line (WAL recovery, DESIGN
#      §8 target < 2 s);
#   2. memory only (no --data-dir).
# Builds nothing: build first, e.g.
#   cmake -S . -B build && make -C build -j2 kvfence-control bench_cp_rpc
# usage: bench/rpc/run.sh [BUILD_DIR (build)]
# Environment: THREADS (8), DURATION (5 s), ABORT_ROOMS (2000),
#   OPEN_ROOMS (100000, durable run), OPEN_ROOMS_MEM (100000, memory run).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=${1:-build}
case $BUILD in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
SERVER=$BUILD/controlplane/kvfence-control
BENCH=$BUILD/bench/rpc/bench_cp_rpc
THREADS=${THREADS:-8}
DURATION=${DURATION:-5}
ABORT_ROOMS=${ABORT_ROOMS:-2000}
OPEN_ROOMS=${OPEN_ROOMS:-100000}
OPEN_ROOMS_MEM=${OPEN_ROOMS_MEM:-100000}

for f in "$SERVER" "$BENCH"; do
  if [ ! -x "$f" ]; then
    echo "run.sh: $f is missing: build it first (make -C $BUILD kvfence-control bench_cp_rpc)" >&2
    exit 2
  fi
done

# Metrics on a port of their own (the default 9464 may be taken), when this
# build serves them.
# The benchmark's fake nodes do not heartbeat: no session timeout.
EXTRA=(--heartbeat-timeout-ms 0)
if "$SERVER" --help 2>/dev/null | grep -q -- '--metrics-listen'; then
  EXTRA+=(--metrics-listen 127.0.0.1:0)
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvf-bench-rpc.XXXXXX")
SRV_PID=
PORT=

cleanup() {
  if [ -n "$SRV_PID" ] && kill -0 "$SRV_PID" 2>/dev/null; then
    kill -TERM "$SRV_PID" 2>/dev/null || true
    wait "$SRV_PID" 2>/dev/null || true
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

# start_server LOG [ARGS...]: starts the server, waits for its port file.
start_server() {
  local log=$1
  shift
  rm -f "$TMP/port"
  "$SERVER" --listen 127.0.0.1:0 --port-file "$TMP/port" ${EXTRA[@]+"${EXTRA[@]}"} "$@" 2>"$log" &
  SRV_PID=$!
  local i
  for i in $(seq 600); do
    [ -s "$TMP/port" ] && break
    if ! kill -0 "$SRV_PID" 2>/dev/null; then
      echo "run.sh: the server exited before serving; its log:" >&2
      cat "$log" >&2
      exit 1
    fi
    sleep 0.05
  done
  if [ ! -s "$TMP/port" ]; then
    echo "run.sh: the server did not write its port file in 30 s" >&2
    exit 1
  fi
  PORT=$(cat "$TMP/port")
}

# stop_server: SIGTERM, wait, check the exit status.
stop_server() {
  local rc=0 t0
  t0=$(now_ms)
  kill -TERM "$SRV_PID"
  wait "$SRV_PID" || rc=$?
  echo "  server stopped by SIGTERM in $(( $(now_ms) - t0 )) ms, exit status $rc"
  SRV_PID=
  [ "$rc" -eq 0 ] || { echo "run.sh: the server exited with $rc" >&2; exit 1; }
}

# server_log_summary LOG: warnings and errors the server logged.
server_log_summary() {
  local n
  n=$(grep -c '"level":"\(warn\|error\)"' "$1" || true)
  echo "  server log: $n warning/error lines"
  grep '"level":"\(warn\|error\)"' "$1" | head -5 | sed 's/^/    /' || true
}

run_bench() {
  local open=$1
  "$BENCH" --target "127.0.0.1:$PORT" --server-pid "$SRV_PID" --threads "$THREADS" \
    --duration "$DURATION" --abort-rooms "$ABORT_ROOMS" --open-rooms "$open"
}

echo "=== durable mode (--data-dir, WAL + snapshots) ==="
mkdir -p "$TMP/data"
start_server "$TMP/durable.log" --data-dir "$TMP/data"
run_bench "$OPEN_ROOMS"
echo "  data dir: $(du -sh "$TMP/data" | cut -f1)"
stop_server
server_log_summary "$TMP/durable.log"

echo
echo "=== WAL recovery: restart on the same data dir ($OPEN_ROOMS open rooms) ==="
t0=$(now_ms)
start_server "$TMP/recover.log" --data-dir "$TMP/data"
t1=$(now_ms)
line=$(grep -h '"msg":"recovered from' "$TMP/recover.log" | sed -e 's/.*"msg":"//' -e 's/"}$//' || true)
echo "  ${line:-no 'recovered' line in the server log}"
echo "  restart -> serving (port file written): $(( t1 - t0 )) ms"
ms=$(printf '%s\n' "$line" | sed -n 's/.* in \([0-9.]*\) ms.*/\1/p' | tail -1)
if [ -n "$ms" ]; then
  awk -v ms="$ms" 'BEGIN { printf "  recovery %.1f ms (target < 2000 ms): %s\n", ms, (ms < 2000 ? "met" : "NOT met") }'
fi
stop_server

echo
echo "=== memory-only mode (no --data-dir) ==="
start_server "$TMP/memory.log"
run_bench "$OPEN_ROOMS_MEM"
stop_server
server_log_summary "$TMP/memory.log"
