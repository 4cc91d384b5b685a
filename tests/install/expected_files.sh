#!/bin/sh
# expected_files.sh BUILD_DIR SOURCE_DIR: prints, sorted, the files an install
# of BUILD_DIR with --prefix /usr must hold (relative to DESTDIR), from
# tests/install/expected-files.txt: @LIBDIR@, @BUILDTYPE@, @VERSION@ and
# @MAJOR@ filled in from the build's cache, and @PYTHON_SOURCES@ replaced by
# every .py file and py.typed of the source package clients/python/kvfence
# (a module added there is installed without a change here). install_check.sh
# and deb_check.sh compare the install tree and the .deb with it.
set -eu
build=$1
src=$2
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
libdir=$(cache CMAKE_INSTALL_LIBDIR)
version=$(cache CMAKE_PROJECT_VERSION)
buildtype=$(cache CMAKE_BUILD_TYPE | tr '[:upper:]' '[:lower:]')
pydir=usr/lib/python3/dist-packages
sed -e '/^#/d' -e '/^$/d' "$src/tests/install/expected-files.txt" | while IFS= read -r line; do
    if [ "$line" = "@PYTHON_SOURCES@" ]; then
        (cd "$src/clients/python" && find kvfence -path '*/__pycache__' -prune -o \
            \( -name '*.py' -o -name py.typed \) -type f -print) | sed "s|^|$pydir/|"
    else
        echo "$line" | sed -e "s|@LIBDIR@|${libdir:-lib}|g" -e "s|@BUILDTYPE@|${buildtype:-noconfig}|g" \
            -e "s|@VERSION@|$version|g" -e "s|@MAJOR@|${version%%.*}|g"
    fi
done | sort
