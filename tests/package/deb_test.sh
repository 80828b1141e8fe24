#!/bin/bash
# The .deb installed the way an admin does it, into a fresh Debian bookworm root that has none of
# ddprun's libraries: `apt-get install ./ddprun_*.deb` must pull them in through Depends. Then,
# inside that root (chroot, own mount and PID namespaces), with no path of the build tree visible:
#   ddprun/ddprun-rdzvd --version; the expected files; a 2-rank job with a shell worker; the
#   daemon from its token file with JSON logs answering `ddprun status` and hosting a job; the
#   daemon's mapped files all under /usr; an outside project built against the worker library with
#   find_package(ddprun) and with pkg-config, run as a 2-rank native job; the systemd unit verified
#   with the host's systemd-analyze against the installed root; last, tests/package/deb_lifecycle.sh:
#   upgrade over an older build, remove and purge with the unit enabled (maintainer scripts).
# The DDP torch example is not run in here: python3-torch with its dependencies is ~1 GB per run;
# tests/package/wheel_test.sh runs it from an installed wheel with Debian's torch.
# usage: deb_test.sh PACKAGE_DIR SOURCE_DIR   (root only; exit 77 = skipped)
set -euo pipefail
pkgdir=$1 src=$2
here=$(cd "$(dirname "$0")" && pwd)
if [[ $(id -u) -ne 0 ]]; then echo "SKIP: installing into a Debian root needs root"; exit 77; fi
deb=$(ls "$pkgdir"/ddprun_*.deb 2>/dev/null | head -n1)
[[ -n "$deb" ]] || { echo "FAIL: no ddprun_*.deb in $pkgdir (the package_build test makes it)"; exit 1; }
start=$(date +%s)
base=$("$here/bookworm_root.sh") || exit $?
echo "base root: $base (ready after $(( $(date +%s) - start )) s)"

work=$(mktemp -d /var/tmp/ddprun-deb-test.XXXXXX)
cleanup() {
  # Every mount lived in the namespace below and died with it; refuse to delete through one anyway.
  if grep -qF " $work" /proc/self/mountinfo; then
    echo "error: something is still mounted under $work; not deleting it" >&2; return
  fi
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT
mkdir -p "$work"/{upper,ovl,root}
cp "$deb" "$work/"
cp -r "$src/tests/worker_lib/consumer" "$work/consumer"
cp "$here/deb_inside.sh" "$work/inside.sh"
cp "$here/job_watchdog.sh" "$work/job_watchdog.sh"
cp "$here/deb_lifecycle.sh" "$work/lifecycle.sh"

# Own mount namespace (private propagation: nothing leaks to the host's mount table and all of it
# goes away when the last process in it exits) and own PID namespace (every daemon or worker
# started inside dies with it).
unshare --mount --propagation private --pid --fork bash -euo pipefail -c '
  work=$1 base=$2
  m=$work/root
  mount -t overlay overlay -o "lowerdir=$base,upperdir=$work/upper,workdir=$work/ovl" "$m"
  mount -t proc proc "$m/proc"
  mount -t tmpfs -o mode=1777 tmpfs "$m/tmp"
  mount --bind /dev "$m/dev"
  cp /etc/resolv.conf "$m/etc/resolv.conf"
  mkdir -p "$m/root/t"
  cp "$work"/ddprun_*.deb "$work/inside.sh" "$work/lifecycle.sh" "$work/job_watchdog.sh" "$m/root/t/"
  cp -r "$work/consumer" "$m/root/t/consumer"
  chroot "$m" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    bash /root/t/inside.sh
  # The installed unit, checked by the host systemd-analyze (the root has no systemd, so
  # --root= cannot be used: it would look for sysinit.target in the root); ExecStart= is pointed at
  # the installed binary so that its existence is checked too.
  if command -v systemd-analyze >/dev/null; then
    unit=$m/usr/lib/systemd/system/ddprun-rdzvd.service
    mkdir -p "$work/unit"
    sed "s|^ExecStart=/usr/bin/ddprun-rdzvd |ExecStart=$m/usr/bin/ddprun-rdzvd |" "$unit" >"$work/unit/ddprun-rdzvd.service"
    out=$(cd "$work/unit" && systemd-analyze verify "$work/unit/ddprun-rdzvd.service" 2>&1) || {
      echo "$out"; echo "FAIL: systemd-analyze verify of the installed unit"; exit 1; }
    [[ -z "$out" ]] || { echo "$out"; echo "FAIL: systemd-analyze verify printed warnings"; exit 1; }
    echo "ok: systemd-analyze verify accepts the installed ddprun-rdzvd.service"
  else
    echo "note: systemd-analyze not installed; the unit was not verified"
  fi
  # Last (it removes the package): upgrade over an older build, remove, purge.
  chroot "$m" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    bash /root/t/inside.sh lifecycle
' bash "$work" "$base"
echo "PASS: .deb installed into a fresh bookworm root and used from there ($(( $(date +%s) - start )) s)"
