#!/usr/bin/env bash
# The README's run command: installs what is missing, builds, starts a local
# kvfence cluster (kvfence-control with its embedded store in a temporary data
# directory, and two kvfence-node processes n1 and n2 on loopback: TCP
# transport, shared-memory pools) and runs the demo load generator
# (clients/python/examples/demo.py) against it.
#
#   scripts/run.sh [run.sh options] [demo options]
#
# run.sh options:
#   --build-dir DIR   build tree (default: build)
#   --no-build        skip install-deps.sh and the build (use DIR as it is)
#   --build-only      install what is missing, configure and build the daemons,
#                     the CLI and the Python client, then stop (no cluster)
#   --keep            keep the cluster running after the demo, until Ctrl-C
#   --existing ADDR   no local cluster: run the demo against kvfence-control at
#                     ADDR; also pass --node1-socket/--node2-socket (and
#                     --node1-id/--node2-id if not n1/n2)
# Every other option goes to demo.py (--rooms, --abort-share, --tp, --pages-min,
# --pages-max, --page-size, --chunks, --concurrency, --seed, --json; see
# demo.py --help). Exit status: the demo's (0: every room terminal, 0
# corrupted pages, no room stuck until the demo's 10 s watchdog aborted it).
#
# Ctrl-C (or TERM) stops everything: the demo, the nodes, then the control
# plane (SIGTERM, SIGKILL after 10 s), and removes the temporary directory and
# the demo's shared-memory objects.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

build_dir=build
do_build=1
build_only=0
keep=0
existing=""
demo_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --build-dir) build_dir=$2; shift 2 ;;
        --build-dir=*) build_dir=${1#*=}; shift ;;
        --no-build) do_build=0; shift ;;
        --build-only) build_only=1; shift ;;
        --keep) keep=1; shift ;;
        --existing) existing=$2; shift 2 ;;
        --existing=*) existing=${1#*=}; shift ;;
        *) demo_args+=("$1"); shift ;;
    esac
done
case "$build_dir" in /*) ;; *) build_dir=$root/$build_dir ;; esac

if [ "$do_build" = 1 ]; then
    bash scripts/install-deps.sh
    # Configure errors (a missing package, named) go to stderr.
    cmake -S . -B "$build_dir" >/dev/null
    cmake --build "$build_dir" -j "$(nproc)" --target kvfence-control kvfence-node kvfence-cli \
        python_client >/dev/null
fi
[ "$build_only" = 1 ] && { echo "run.sh: built in $build_dir"; exit 0; }
control_bin=$build_dir/controlplane/kvfence-control
node_bin=$build_dir/dataplane/kvfence-node
cli_bin=$build_dir/clients/cli/kvfence
"$control_bin" --version
"$node_bin" --version

export PYTHONPATH=$root/clients/python:$build_dir/clients/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
demo=(/usr/bin/python3 "$root/clients/python/examples/demo.py")

if [ -n "$existing" ]; then
    exec "${demo[@]}" --control "$existing" "${demo_args[@]}"
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvfence-run.XXXXXX")
pids=()       # nodes first, the control plane last (stopped in reverse order)
demo_pid=""
stopped=0

stop_pid() { # pid name
    local pid=$1 i
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "run.sh: $2 (pid $pid) did not stop within 10 s: SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

cleanup() {
    [ "$stopped" = 1 ] && return
    stopped=1
    trap - INT TERM
    if [ -n "$demo_pid" ]; then
        stop_pid "$demo_pid" demo
    fi
    local i
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        stop_pid "${pids[i]%%:*}" "${pids[i]#*:}"
    done
    # the demo unlinks its shm objects; these are left only if it was killed
    if [ -n "$demo_pid" ]; then
        rm -f /dev/shm/kvf-demo-"$demo_pid"-* 2>/dev/null || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'echo "run.sh: stopping" >&2; cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM

wait_file() { # path lines pid name log
    local i
    for i in $(seq 200); do
        if [ -f "$1" ] && [ "$(grep -c . "$1" 2>/dev/null)" -ge "$2" ]; then
            return 0
        fi
        if ! kill -0 "$3" 2>/dev/null; then
            echo "run.sh: $4 exited before it was ready; its log:" >&2
            tail -n 30 "$5" >&2
            return 1
        fi
        sleep 0.05
    done
    echo "run.sh: $4 not ready within 10 s; its log:" >&2
    tail -n 30 "$5" >&2
    return 1
}

mkdir -p "$tmp/data"
"$control_bin" --listen 127.0.0.1:0 --port-file "$tmp/control.port" --data-dir "$tmp/data" \
    --metrics-listen 127.0.0.1:0 --metrics-port-file "$tmp/metrics.port" \
    >"$tmp/control.log" 2>&1 </dev/null &
pids+=("$!:kvfence-control")
wait_file "$tmp/control.port" 1 "$!" kvfence-control "$tmp/control.log"
address=127.0.0.1:$(head -n1 "$tmp/control.port" | tr -d '[:space:]')
metrics_port=$(head -n1 "$tmp/metrics.port" 2>/dev/null | tr -d '[:space:]' || true)

node_pids=()
for n in n1 n2; do
    "$node_bin" --control "$address" --node-id "$n" --local-socket "$tmp/$n.sock" \
        --data-host 127.0.0.1 --data-port 0 --port-file "$tmp/$n.port" \
        >"$tmp/$n.log" 2>&1 </dev/null &
    pids=("$!:kvfence-node $n" "${pids[@]}")
    node_pids+=("$!")
done
wait_file "$tmp/n1.port" 2 "${node_pids[0]}" "kvfence-node n1" "$tmp/n1.log"
wait_file "$tmp/n2.port" 2 "${node_pids[1]}" "kvfence-node n2" "$tmp/n2.log"
echo "cluster: kvfence-control $address (metrics 127.0.0.1:${metrics_port:-?}), nodes n1 n2 (logs in $tmp)"

rc=0
metrics_arg=()
[ -n "${metrics_port:-}" ] && metrics_arg=(--metrics "127.0.0.1:$metrics_port")
"${demo[@]}" --control "$address" --node1-socket "$tmp/n1.sock" --node2-socket "$tmp/n2.sock" \
    "${metrics_arg[@]}" "${demo_args[@]}" &
demo_pid=$!
wait "$demo_pid" || rc=$?
demo_pid=""

if [ "$keep" = 1 ]; then
    cat <<EOF

The cluster keeps running (Ctrl-C stops it):
  control plane  $address   (metrics: http://127.0.0.1:${metrics_port:-?}/metrics)
  node sockets   $tmp/n1.sock  $tmp/n2.sock
  grpcurl -plaintext -import-path $root/api -proto kvfence/v1/control.proto $address kvfence.v1.Admin/GetStats
  $cli_bin --server $address stats      (also: nodes, rooms, leases, watch)
  for the engine quickstart (docs/engines.md), in another shell:
  export KVFENCE_CONTROL=$address KVFENCE_N1_SOCKET=$tmp/n1.sock KVFENCE_N2_SOCKET=$tmp/n2.sock PYTHONPATH=$root/clients/python:$build_dir/clients/python
EOF
    while true; do sleep 1; done
fi
exit "$rc"
