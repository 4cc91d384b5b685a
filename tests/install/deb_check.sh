#!/bin/sh
# deb_check.sh BUILD_DIR SOURCE_DIR: builds the Debian package with
# `cpack -G DEB` from the build and checks it without installing it:
#   1. its control fields: Package, Version, Architecture, and Depends naming
#      the Python package's dependencies and the daemons' libraries;
#   2. its contents: exactly tests/install/expected-files.txt (the tree
#      `cmake --install --prefix /usr` makes, install_check.sh);
#   3. every shared library a packaged program or library needs is a file of a
#      Debian package this package depends on (dpkg -S on this machine), so
#      that `dpkg -i` on a fresh root pulls it in; the one exception is CUDA's
#      runtime in a CUDA build, which no Debian package here provides
#      (deploy/README.md, "Packages": build the .deb with -DKVF_WITH_CUDA=OFF);
#   4. the extracted daemons and CLI run (--version; kvfence-control serves
#      and the CLI asks it for stats).
# `dpkg -i` itself needs root and a fresh root file system: not done here.
set -eu
build=$1
src=$2
tmp=$(mktemp -d /tmp/kvf-deb-XXXXXX)
cpid=
cleanup() {
    [ -n "$cpid" ] && kill "$cpid" 2>/dev/null && wait "$cpid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT INT TERM
fail() { echo "deb_check: FAILED: $*" >&2; exit 1; }

(cd "$build" && cpack -G DEB -B "$tmp/out" >"$tmp/cpack.log" 2>&1) || { cat "$tmp/cpack.log"; fail "cpack -G DEB"; }
deb=$(ls "$tmp"/out/*.deb 2>/dev/null | head -n 1)
[ -n "$deb" ] || { cat "$tmp/cpack.log"; fail "cpack made no .deb"; }
echo "package: $(basename "$deb"), $(wc -c <"$deb") bytes"

# ---- 1. control fields
version=$(sed -n 's/^CMAKE_PROJECT_VERSION:[A-Z]*=//p' "$build/CMakeCache.txt")
field() { dpkg-deb -f "$deb" "$1"; }
[ "$(field Package)" = kvfence ] || fail "Package: $(field Package)"
[ "$(field Version)" = "$version" ] || fail "Version: $(field Version), the project is $version"
[ "$(field Architecture)" = "$(dpkg --print-architecture)" ] || fail "Architecture: $(field Architecture)"
depends=$(field Depends)
echo "Depends: $depends"
deps=$(echo "$depends" | tr ',' '\n' | sed 's/^ *//; s/[ (].*//' | sort -u)
for p in python3 python3-grpcio python3-protobuf libgrpc29 libprotobuf-c1 libzmq5 libmicrohttpd12; do
    echo "$deps" | grep -qx "$p" || fail "Depends does not name $p"
done

# ---- 2. contents
sh "$src/tests/install/expected_files.sh" "$build" "$src" >"$tmp/want"
libdir=$(sed -n 's/^CMAKE_INSTALL_LIBDIR:[A-Z]*=//p' "$build/CMakeCache.txt")
[ -n "$libdir" ] || libdir=lib
dpkg-deb -c "$deb" | grep -v '^d' | awk '{print $6}' | sed 's|^\./||' | sort >"$tmp/have"
if ! cmp -s "$tmp/want" "$tmp/have"; then
    diff "$tmp/want" "$tmp/have" | grep '^[<>]' || true
    fail "the package's files differ from tests/install/expected-files.txt"
fi
echo "contents: $(wc -l <"$tmp/have") files as expected"

# ---- 3. every needed library comes with a dependency
dpkg-deb -x "$deb" "$tmp/root"
cuda=${KVF_HAVE_CUDA:-OFF}
for f in "$tmp"/root/usr/sbin/* "$tmp"/root/usr/bin/* "$tmp/root/usr/$libdir/libkvfence.so.$version"; do
    LD_LIBRARY_PATH="$tmp/root/usr/$libdir" ldd "$f" >"$tmp/ldd.txt" 2>&1 || fail "ldd $f"
    if grep -q 'not found' "$tmp/ldd.txt"; then cat "$tmp/ldd.txt"; fail "$(basename "$f"): a library is missing"; fi
    for lib in $(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
        path=$(sed -n "s|^[[:space:]]*$lib => \([^ ]*\).*|\1|p" "$tmp/ldd.txt")
        case "$lib" in libcudart.so.*)
            [ "$cuda" = ON ] || fail "$(basename "$f") needs $lib in a build without CUDA"
            echo "note: $(basename "$f") needs $lib ($path), which no Debian dependency provides (a CUDA build)"
            continue ;;
        esac
        # dpkg knows a file by the path its package ships (usrmerge: /lib or /usr/lib).
        real=$(readlink -f "$path")
        pkg=
        for cand in "$path" "$real" "/usr$path" "${path#/usr}" "/usr$real" "${real#/usr}"; do
            pkg=$(dpkg -S "$cand" 2>/dev/null | head -n 1 | cut -d: -f1)
            [ -z "$pkg" ] || break
        done
        [ -n "$pkg" ] || fail "$(basename "$f"): $lib ($path) belongs to no Debian package"
        echo "$deps" | grep -qx "$pkg" || fail "$(basename "$f") needs $lib from $pkg, which Depends does not name"
    done
done
echo "libraries: every one needed comes from a package in Depends"

# ---- 4. the packaged programs run
r=$tmp/root/usr
"$r/sbin/kvfence-control" --version | grep -q "$version" || fail "kvfence-control --version"
"$r/sbin/kvfence-node" --version | grep -q "$version" || fail "kvfence-node --version"
"$r/bin/kvfence" --version | grep -q "^kvfence $version$" || fail "kvfence --version"
"$r/sbin/kvfence-control" --listen 127.0.0.1:0 --port-file "$tmp/port" --metrics-listen "" >"$tmp/control.log" 2>&1 &
cpid=$!
i=0
while [ ! -s "$tmp/port" ]; do
    i=$((i + 1))
    [ "$i" -le 100 ] || { cat "$tmp/control.log"; fail "the packaged kvfence-control did not serve in 10 s"; }
    kill -0 "$cpid" 2>/dev/null || { cat "$tmp/control.log"; fail "the packaged kvfence-control exited"; }
    sleep 0.1
done
"$r/bin/kvfence" --server "127.0.0.1:$(cat "$tmp/port")" stats | grep -q '^uptime_ms ' || fail "the packaged CLI: stats"
echo "deb_check: OK"
