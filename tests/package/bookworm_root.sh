#!/bin/bash
# Prints the path of a cached, pristine Debian bookworm root for the package tests, creating it
# on first use (debootstrap --variant=minbase, about 2-4 min and 450 MB; later runs: instant).
# It holds python3-venv and a C/C++ toolchain (cmake, g++, make, pkg-config) so that a package's
# CMake/pkg-config files and its wheel can be tried, but none of ddprun's runtime libraries
# (Boost, spdlog, fmt): installing the .deb must pull those in through its Depends.
# Tests never write to it: they mount an overlay on top (tests/package/in_root.sh).
#   DDPRUN_ROOT_CACHE   cache directory (default /var/cache/ddprun)
#   DDPRUN_DEBIAN_MIRROR  mirror for debootstrap (default: the host's first Debian URI)
# Needs root, debootstrap and network access to the mirror; exits 77 (skip) without them.
set -euo pipefail
cache=${DDPRUN_ROOT_CACHE:-/var/cache/ddprun}
name=bookworm-minbase-pkgtest-v1
root=$cache/$name
include=python3,python3-venv,cmake,g++,make,pkg-config

if [[ $(id -u) -ne 0 ]]; then echo "SKIP: creating a Debian root needs root" >&2; exit 77; fi
command -v debootstrap >/dev/null || { echo "SKIP: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 77; }
mkdir -p "$cache"
exec 9>"$root.lock"
flock 9   # one creator at a time; the others wait and reuse it
if [[ -f "$root/.ddprun-root-complete" ]]; then echo "$root"; exit 0; fi

mirror=${DDPRUN_DEBIAN_MIRROR:-}
if [[ -z "$mirror" ]]; then
  mirror=$(grep -rhoE '^(URIs:|deb) *(\[[^]]*\] *)?https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
             /etc/apt/sources.list.d/ 2>/dev/null | grep -oE 'https?://[^ ]+' | head -n1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi

# A leftover from an interrupted run: debootstrap ran in its own mount namespace (below), so no
# mount can outlive it; check anyway before deleting anything.
for old in "$cache/$name".tmp.*; do
  [[ -e "$old" ]] || continue
  if grep -qF " $old" /proc/self/mountinfo; then
    echo "error: $old has something mounted in it; unmount it, then delete it" >&2; exit 1
  fi
  rm -rf --one-file-system "$old"
done

tmp=$cache/$name.tmp.$$
log=$cache/$name.log
echo "creating the bookworm root $root from $mirror (log: $log)" >&2
start=$(date +%s)
# A private mount namespace: debootstrap's /proc and /sys mounts die with it, whatever happens.
if ! unshare --mount --propagation private \
       debootstrap --variant=minbase --include="$include" bookworm "$tmp" "$mirror" >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  echo "error: debootstrap bookworm from $mirror failed (full log: $log)" >&2
  exit 1
fi
# Cached root keeps package lists so that `apt-get install ./x.deb` resolves Depends at once.
cp /etc/resolv.conf "$tmp/etc/resolv.conf" 2>/dev/null || true
if ! chroot "$tmp" apt-get update -q >>"$log" 2>&1; then
  tail -n 20 "$log" >&2; echo "error: apt-get update inside the new root failed (log: $log)" >&2; exit 1
fi
chroot "$tmp" apt-get clean
touch "$tmp/.ddprun-root-complete"
mv "$tmp" "$root"
echo "created $root in $(( $(date +%s) - start )) s" >&2
echo "$root"
