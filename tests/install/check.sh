#!/usr/bin/env bash
# Installs the build in a staging directory and builds a program against it with pkg-config only,
# as another project would use an installed Linum. Usage: tests/install/check.sh <build-dir>
set -euo pipefail
build=$1
here=$(cd "$(dirname "$0")" && pwd)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
# Only the library is installed: build it alone (a plain `meson install` builds every target first,
# linum-bench included, which the test suite does not need: about a minute of CI).
meson compile -C "$build" linum >/dev/null
meson install -C "$build" --destdir "$stage" --quiet --no-rebuild
pc=$(find "$stage" -name linum.pc | head -n 1)
prefix=$(sed -n 's/^prefix=//p' "$pc")
export PKG_CONFIG_PATH=$(dirname "$pc")
flags=$(pkg-config --define-variable=prefix="$stage$prefix" --cflags --libs linum)
c++ "$here/consumer.cpp" -o "$stage/consumer" $flags
out=$("$stage/consumer")
[ "$out" = "2 4 6" ] || { echo "installed Linum: consumer printed '$out', expected '2 4 6'"; exit 1; }
echo "installed Linum: headers, library and pkg-config file work ($out)"
