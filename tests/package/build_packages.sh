#!/bin/bash
# ctest fixture: builds both packages from the already built tree into OUT (skips, exit 77, when
# the packaging tools are missing: dpkg-shlibdeps from dpkg-dev, patchelf).
# usage: build_packages.sh SOURCE_DIR BUILD_DIR OUT
set -euo pipefail
src=$1 build=$2 out=$3
for tool in dpkg-shlibdeps patchelf cpack; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool is not installed (scripts/setup installs it)"; exit 77; }
done
DDPRUN_BUILD_DIR=$build DDPRUN_PACKAGE_OUT=$out exec bash "$src/scripts/package" --no-build
