#!/usr/bin/env bash
# Fetch the horovod 0.28.1 sdist and patch it so that it builds against torch 2.13 (CPU, gloo).
#
#   bench/build_horovod.sh PYTHON DIR     # prints the patched source folder (DIR/horovod-0.28.1)
#
# `make bench-deps` runs this, then installs the folder into the venv. Each patch is checked: when its
# pattern is not in the file (another sdist, an already patched tree), the script stops and says which.
#   1. CMAKE_CXX_STANDARD 14 -> 17, in CMakeLists.txt and horovod/torch/CMakeLists.txt: torch 2.x's
#      headers use C++17 (`if constexpr`, std::optional), so the torch extension does not compile as C++14.
#   2. horovod/common/gloo/gloo_context.cc: GlooContext::InitializeForProcessSet (every process set, the
#      global one included) creates its gloo device from its own gloo_iface_, which nothing sets, instead
#      of the global context's HOROVOD_GLOO_IFACE; gloo then binds to the address the host name resolves
#      to (127.0.0.1 here), which processes on other machines (or network namespaces) cannot reach. It
#      takes the global context's interface instead.
set -euo pipefail

PYTHON=$1
DIR=$2
VERSION=0.28.1
SRC=$DIR/horovod-$VERSION

# patch FILE FROM TO: replace the line FROM with TO, failing loudly when FROM is not there.
patch_line() {
  local file=$1 from=$2 to=$3
  if ! grep -qxF "$from" "$file"; then
    echo "build_horovod.sh: '$from' is not a line of $file; is this horovod $VERSION, unpatched?" >&2
    exit 1
  fi
  sed -i "s/^$(printf '%s' "$from" | sed 's/[][\.*^$/]/\\&/g')\$/$to/" "$file"
  grep -qxF "$to" "$file"
}

mkdir -p "$DIR"
rm -rf "$SRC"
"$PYTHON" -m pip download --disable-pip-version-check --quiet --no-deps --no-binary :all: \
  -d "$DIR" "horovod==$VERSION" >&2
tar -xzf "$DIR/horovod-$VERSION.tar.gz" -C "$DIR"

patch_line "$SRC/CMakeLists.txt" 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
patch_line "$SRC/horovod/torch/CMakeLists.txt" '    set(CMAKE_CXX_STANDARD 14)' '    set(CMAKE_CXX_STANDARD 17)'
# (2): the assignment occurs in every Initialize*; only the one in InitializeForProcessSet changes.
gloo=$SRC/horovod/common/gloo/gloo_context.cc
fixed='  device_attr.iface = gloo_iface_ = global_context.gloo_iface_;'
sed -i '/^void GlooContext::InitializeForProcessSet(/,/CreateDevice(device_attr)/ s/^  device_attr\.iface = gloo_iface_;$/'"$fixed"'/' "$gloo"
if [ "$(grep -cxF "$fixed" "$gloo")" != 1 ]; then
  echo "build_horovod.sh: InitializeForProcessSet's device_attr.iface line is not in $gloo as expected" >&2
  exit 1
fi

echo "$SRC"
