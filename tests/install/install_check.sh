#!/bin/sh
# install_check.sh BUILD_DIR SOURCE_DIR: `cmake --install` of the build, as a
# package would do it (DESTDIR=<tmp>/root, --prefix /usr), then checks the
# tree and uses what it installed:
#   1. the contents: every path tests/install/expected-files.txt lists is
#      installed, and nothing else (GNUInstallDirs: daemons in sbin, the CLI
#      in bin, libkvfence and its pkg-config and CMake files in the libdir,
#      the header, the Python package in lib/python3/dist-packages, the docs);
#   2. the installed daemons and clients run: kvfence-control serves on
#      loopback, the installed CLI asks it for stats, the installed Python
#      package (nothing from the source or build tree on its path) pings it,
#      kvfence-node answers --help;
#   3. tests/install/hello.c builds against the tree with pkg-config and with
#      find_package(kvfence), and runs.
set -eu
build=$1
src=$2
cc=${CC:-cc}
python=${KVF_PYTHON:-/usr/bin/python3}
tmp=$(mktemp -d /tmp/kvf-install-XXXXXX)
cpid=
cleanup() {
    [ -n "$cpid" ] && kill "$cpid" 2>/dev/null && wait "$cpid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT INT TERM
fail() { echo "install_check: FAILED: $*" >&2; exit 1; }

root=$tmp/root
prefix=$root/usr
DESTDIR=$root cmake --install "$build" --prefix /usr >"$tmp/install.log" 2>&1 ||
    { cat "$tmp/install.log"; fail "cmake --install"; }

# ---- 1. contents: exactly the expected paths (libdir and version filled in)
sh "$src/tests/install/expected_files.sh" "$build" "$src" >"$tmp/want"
libdir=$(sed -n 's/^CMAKE_INSTALL_LIBDIR:[A-Z]*=//p' "$build/CMakeCache.txt")
[ -n "$libdir" ] || libdir=lib
version=$(sed -n 's/^CMAKE_PROJECT_VERSION:[A-Z]*=//p' "$build/CMakeCache.txt")
(cd "$root" && find . \( -type f -o -type l \) | sed 's|^\./||' | sort) >"$tmp/have"
if ! cmp -s "$tmp/want" "$tmp/have"; then
    echo "install tree (< expected only, > installed only):"
    diff "$tmp/want" "$tmp/have" | grep '^[<>]' || true
    fail "the install tree differs from tests/install/expected-files.txt"
fi
echo "install tree: $(wc -l <"$tmp/have") files as expected"
for exe in usr/sbin/kvfence-control usr/sbin/kvfence-node usr/bin/kvfence; do
    [ -x "$root/$exe" ] || fail "$exe is not executable"
done

# ---- 2. the installed programs run
"$prefix/bin/kvfence" --version | grep -q "^kvfence $version$" || fail "installed kvfence --version"
"$prefix/sbin/kvfence-node" --help >"$tmp/node-help.txt" 2>&1 || fail "installed kvfence-node --help"
grep -q -- '--local-socket' "$tmp/node-help.txt" || fail "kvfence-node --help names no --local-socket"
"$prefix/sbin/kvfence-control" --listen 127.0.0.1:0 --port-file "$tmp/port" --metrics-listen "" \
    >"$tmp/control.log" 2>&1 &
cpid=$!
i=0
while [ ! -s "$tmp/port" ]; do
    i=$((i + 1))
    [ "$i" -le 100 ] || { cat "$tmp/control.log"; fail "installed kvfence-control did not serve in 10 s"; }
    kill -0 "$cpid" 2>/dev/null || { cat "$tmp/control.log"; fail "installed kvfence-control exited"; }
    sleep 0.1
done
addr=127.0.0.1:$(cat "$tmp/port")
"$prefix/bin/kvfence" --server "$addr" stats >"$tmp/stats.txt" || fail "installed kvfence stats"
grep -q '^uptime_ms ' "$tmp/stats.txt" || { cat "$tmp/stats.txt"; fail "kvfence stats: no uptime_ms row"; }
pydir=$prefix/lib/python3/dist-packages
(cd "$tmp" && env -u PYTHONPATH PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$pydir" "$python" -c "
import sys, kvfence
assert kvfence.__file__.startswith('$pydir/'), kvfence.__file__
with kvfence.AdminClient('$addr') as a:
    a.ping(timeout=5)
    print('python: kvfence', kvfence.__version__, 'from', kvfence.__file__, 'pinged $addr')
") || fail "the installed Python package"
kill "$cpid" && wait "$cpid" 2>/dev/null || true
cpid=

# ---- 3. a program against the library: pkg-config, then find_package
pc=$prefix/$libdir/pkgconfig
export PKG_CONFIG_PATH="$pc"
flags=$(pkg-config --cflags --libs kvfence)
echo "pkg-config: $flags"
# shellcheck disable=SC2086
$cc -std=c11 -Wall -Wextra -Werror -o "$tmp/hello-pc" "$src/tests/install/hello.c" $flags
LD_LIBRARY_PATH="$prefix/$libdir" "$tmp/hello-pc"

cmake -S "$src/tests/install/consumer" -B "$tmp/consumer" \
    -DCMAKE_PREFIX_PATH="$prefix" -DHELLO_SOURCE="$src/tests/install/hello.c" \
    >"$tmp/consumer.log" 2>&1 || { cat "$tmp/consumer.log"; exit 1; }
cmake --build "$tmp/consumer" >>"$tmp/consumer.log" 2>&1 || { cat "$tmp/consumer.log"; exit 1; }
"$tmp/consumer/hello"
echo "install_check: OK"
