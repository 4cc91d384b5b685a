#!/bin/sh
# tests/chaos/run.sh: runs the chaos tests (README.md).
#
#   run.sh short [BUILD_DIR]   what ctest's chaos_short runs: 3 kill -9 cycles, one round per node kill
#                              case, 2 attempts per node pause case, 2 full-disk cycles
#   run.sh long  [BUILD_DIR]   20 kill -9 cycles (KVF_CHAOS_CYCLES), 5 rounds per node kill case
#                              (KVF_CHAOS_NODE_ROUNDS), 4 attempts per pause case (KVF_CHAOS_PAUSED_ATTEMPTS),
#                              6 full-disk cycles (KVF_CHAOS_DISK_CYCLES), and the segment roll at
#                              the default 64 MiB (KVF_CHAOS_SEGMENT_ROLL=1; skipped in short);
#                              the figures go to BUILD_DIR/chaos-report-<mode>.json
#
# BUILD_DIR defaults to ./build. KVF_CONTROL_BIN and KVF_NODE_BIN default to the build's binaries.
# KVF_CHAOS_LIMIT_S bounds the whole run (140 s short, 900 s long), for bigger sizes.
# Extra arguments after BUILD_DIR go to pytest (e.g. -k damage). Every test bounds its own waits;
# the whole run is bounded by `timeout` too.
set -eu
mode=${1:-short}
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
build=$(cd "${2:-$src/build}" && pwd)
[ $# -ge 2 ] && shift 2 || shift $#
case $mode in
  short) : "${KVF_CHAOS_CYCLES:=3}" "${KVF_CHAOS_NODE_ROUNDS:=1}" "${KVF_CHAOS_PAUSED_ATTEMPTS:=2}"
    : "${KVF_CHAOS_DISK_CYCLES:=2}" "${KVF_CHAOS_SEGMENT_ROLL:=0}"; limit=140 ;;
  long) : "${KVF_CHAOS_CYCLES:=20}" "${KVF_CHAOS_NODE_ROUNDS:=5}" "${KVF_CHAOS_PAUSED_ATTEMPTS:=4}"
    : "${KVF_CHAOS_DISK_CYCLES:=6}" "${KVF_CHAOS_SEGMENT_ROLL:=1}"; limit=900 ;;
  *) echo "usage: $0 short|long [BUILD_DIR] [pytest args]" >&2; exit 2 ;;
esac
: "${KVF_CHAOS_LIMIT_S:=$limit}"  # the whole run's bound, for bigger sizes
: "${KVF_CONTROL_BIN:=$build/controlplane/kvfence-control}"
: "${KVF_NODE_BIN:=$build/dataplane/kvfence-node}"
: "${KVF_CHAOS_REPORT:=$build/chaos-report-$mode.json}"
: "${KVF_PYTHON:=/usr/bin/python3}"
PYTHONPATH=$build/tests/interop/stubs:$src/tests/interop:$src/clients/python:$build/clients/python:$src/clients/python/examples
PYTHONDONTWRITEBYTECODE=1
export KVF_CHAOS_CYCLES KVF_CHAOS_NODE_ROUNDS KVF_CHAOS_PAUSED_ATTEMPTS KVF_CHAOS_DISK_CYCLES KVF_CHAOS_SEGMENT_ROLL KVF_CONTROL_BIN KVF_NODE_BIN KVF_CHAOS_REPORT PYTHONPATH \
  PYTHONDONTWRITEBYTECODE
# pytest's own temp dirs are removed on the way out, also after a failure; a test's mounts and
# processes are undone by its fixtures.
tmp=$(mktemp -d /tmp/kvf-chaos-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
rc=0
timeout -k 10 "$KVF_CHAOS_LIMIT_S" "$KVF_PYTHON" -m pytest -q -p no:cacheprovider -rxX --basetemp="$tmp" \
  "$here" "$@" || rc=$?
echo "chaos $mode: rc $rc in $(( $(date +%s) - start )) s; figures in $KVF_CHAOS_REPORT"
exit $rc
