#!/bin/sh
# install_check.sh BUILD_DIR SOURCE_DIR: installs the build into a temporary
# prefix, then builds tests/install/hello.c against it twice (pkg-config, and
# a CMake project with find_package(kvfence)) and runs both programs.
set -eu
build=$1
src=$2
cc=${CC:-cc}
tmp=$(mktemp -d /tmp/kvf-install-XXXXXX)
trap 'rm -rf "$tmp"' EXIT INT TERM

cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" 2>&1 ||
    { cat "$tmp/install.log"; exit 1; }
pc=$(dirname "$(find "$tmp/prefix" -name kvfence.pc | head -n 1)")
[ -n "$pc" ] && [ -f "$pc/kvfence.pc" ] || { echo "no kvfence.pc installed"; exit 1; }
libdir=$(cd "$pc/.." && pwd)
test -f "$tmp/prefix/include/kvfence/kvfence.h"
test -f "$libdir/cmake/kvfence/kvfenceConfig.cmake"
test -f "$libdir/cmake/kvfence/kvfenceConfigVersion.cmake"

# 1. pkg-config
export PKG_CONFIG_PATH="$pc"
flags=$(pkg-config --cflags --libs kvfence)
echo "pkg-config: $flags"
# shellcheck disable=SC2086
$cc -std=c11 -Wall -Wextra -Werror -o "$tmp/hello-pc" "$src/tests/install/hello.c" $flags
LD_LIBRARY_PATH="$libdir" "$tmp/hello-pc"

# 2. find_package
cmake -S "$src/tests/install/consumer" -B "$tmp/consumer" \
    -DCMAKE_PREFIX_PATH="$tmp/prefix" -DHELLO_SOURCE="$src/tests/install/hello.c" \
    >"$tmp/consumer.log" 2>&1 || { cat "$tmp/consumer.log"; exit 1; }
cmake --build "$tmp/consumer" >>"$tmp/consumer.log" 2>&1 || { cat "$tmp/consumer.log"; exit 1; }
"$tmp/consumer/hello"
echo "install_check: OK"
