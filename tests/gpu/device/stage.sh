#!/usr/bin/env bash
# Stages what run.sh needs on a GPU machine that has no Boost/CLI11/spdlog to build ddprun with:
#   tests/gpu/device/stage.sh DEST
# DEST/bin: ddprun, ddprun-rdzvd, ddprun-nccl-id, spawn_floor and native_allreduce from the
# Release tree (DDPRUN_RELEASE_DIR, default build-release), store_client_driver from the test
# tree (DDPRUN_BUILD_DIR, default build); DEST/lib: libddprun_worker and the shared libraries
# (spdlog, fmt) those binaries need beyond glibc and libstdc++; DEST/include: the worker headers.
# All stripped. Binaries from Debian 12 (glibc 2.36) run on any newer x86-64 glibc.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
dest=${1:?usage: stage.sh DEST}
rel=${DDPRUN_RELEASE_DIR:-$root/build-release}
tst=${DDPRUN_BUILD_DIR:-$root/build}
[[ $(uname -m) == x86_64 ]] || { echo "stage.sh: the device machines are x86-64; this is $(uname -m)" >&2; exit 1; }
ninja -C "$rel" ddprun ddprun-rdzvd ddprun-nccl-id ddprun_worker spawn_floor native_allreduce >/dev/null
ninja -C "$tst" store_client_driver >/dev/null
rm -rf "$dest"
cmake --install "$rel" --prefix "$dest" --strip --component worker >/dev/null
mkdir -p "$dest/bin" "$dest/lib"
# A Debian tree installs into the multiarch lib/x86_64-linux-gnu; run.sh links against DEST/lib.
if [[ -d "$dest/lib/x86_64-linux-gnu" ]]; then cp -a "$dest/lib/x86_64-linux-gnu/." "$dest/lib/"; fi
for b in ddprun ddprun-rdzvd ddprun-nccl-id spawn_floor native_allreduce; do
  install -s "$rel/bin/$b" "$dest/bin/$b"
done
install -s "$tst/bin/store_client_driver" "$dest/bin/store_client_driver"
for b in "$dest"/bin/*; do
  ldd "$b" | awk '/=> \// {print $3}'
done | sort -u | grep -E 'libspdlog|libfmt' | while read -r lib; do cp -L "$lib" "$dest/lib/"; done
du -sh "$dest" | cut -f1
