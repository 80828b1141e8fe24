#!/bin/bash
# The wheel installed the way ML engineers do it: `pip install` into a fresh venv. First the wheel
# itself: its manylinux tag against the GLIBC_2.N its files need, RUNPATHs, build paths, the bundled
# libraries' licenses. Then two places:
#  A. this host: a venv of /usr/bin/python3 with --system-site-packages (Debian's torch 1.13 is a
#     system package); the source and build trees are hidden under empty tmpfs mounts in a private
#     mount namespace (root), so nothing of them can be used. ddprun on the venv's PATH, --version,
#     `python -m ddprun`, a 2-rank shell job, the daemon answering `ddprun status`, the daemon's
#     mapped libraries all from the wheel or glibc, and examples/ddp_train.py under 2 ranks.
#  B. the cached fresh bookworm root (tests/package/bookworm_root.sh; root only), which has no
#     spdlog, fmt or Boost at all: a plain venv there, the same commands, libraries from the venv.
# usage: wheel_test.sh PACKAGE_DIR SOURCE_DIR BUILD_DIR     (exit 77: skipped)
set -euo pipefail
pkgdir=$1 src=$(cd "$2" && pwd) build=$(cd "$3" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
whl=$(ls "$pkgdir"/ddprun-*.whl 2>/dev/null | head -n1)
[[ -n "$whl" ]] || { echo "FAIL: no ddprun-*.whl in $pkgdir (the package_build test makes it)"; exit 1; }
/usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null || { echo "SKIP: /usr/bin/python3 has no venv/ensurepip (apt-get install python3-venv)"; exit 77; }
start=$(date +%s)
work=$(mktemp -d /var/tmp/ddprun-wheel-test.XXXXXX)
cleanup() {
  if grep -qF " $work" /proc/self/mountinfo; then
    echo "error: something is still mounted under $work; not deleting it" >&2; return
  fi
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT
cp "$whl" "$work/"
cp "$src/examples/ddp_train.py" "$here/wheel_inside.sh" "$here/job_watchdog.sh" "$work/"
whl=$work/$(basename "$whl")

# --- the wheel's own claims ----------------------------------------------------------------------
# The manylinux_2_N tag must be the newest GLIBC_2.N any ELF file in it needs (checked here with
# objdump, independently of build_wheel.py); every RUNPATH is $ORIGIN-relative; no path of the
# build machine's trees is left in a file.
mkdir -p "$work/unzipped"
/usr/bin/python3 -m zipfile -e "$whl" "$work/unzipped"
tag_n=$(basename "$whl" | sed -nE 's/.*-manylinux_2_([0-9]+)_[a-z0-9_]+\.whl$/\1/p')
[[ -n "$tag_n" ]] || { echo "FAIL: $(basename "$whl") has no manylinux_2_N tag"; exit 1; }
newest=0
while IFS= read -r f; do
  n=$( (objdump -T "$f" 2>/dev/null || true) | grep -oE 'GLIBC_2\.[0-9]+' | cut -d. -f2 | sort -n | tail -n1 || true)
  if (( ${n:-0} > newest )); then newest=$n; fi
  rp=$( (readelf -d "$f" 2>/dev/null || true) | sed -nE 's/.*\((RPATH|RUNPATH)\).*\[(.*)\]/\2/p')
  [[ -z "$rp" || "$rp" == '$ORIGIN'* ]] || { echo "FAIL: $f has RUNPATH $rp"; exit 1; }
  if grep -qaF -e "$src/" -e "$build/" "$f"; then echo "FAIL: $f names the source or build tree"; exit 1; fi
done < <(find "$work/unzipped" -type f -exec sh -c 'head -c4 "$1" | grep -q ELF' sh {} \; -print)
[[ "$newest" == "$tag_n" ]] || { echo "FAIL: the wheel is tagged manylinux_2_$tag_n but its files need GLIBC_2.$newest"; exit 1; }
# The bundled libraries' licenses travel with them (OpenSSL's Apache-2.0, fmt's and spdlog's MIT,
# the GCC runtime library exception).
for lib in libssl libstdc++ libfmt libspdlog libgcc; do
  ls "$work"/unzipped/ddprun-*.dist-info/licenses/"$lib"*.copyright >/dev/null 2>&1 \
    || { echo "FAIL: the wheel bundles $lib but not its copyright file (dist-info/licenses/)"; exit 1; }
done
rm -rf "$work/unzipped"
echo "ok: the bundled libraries' copyright files are in dist-info/licenses/"
echo "ok: tag manylinux_2_$tag_n = the newest GLIBC_2.N needed; RUNPATHs \$ORIGIN-relative; no build paths"

# --- A: a venv on this host ---------------------------------------------------------------------
t0=$(date +%s)
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-index --no-deps "$whl" || { echo "FAIL: pip install $whl"; exit 1; }
echo "ok: venv + pip install in $(( $(date +%s) - t0 )) s"
run_a=(env -i PATH="$work/venv/bin:/usr/bin:/bin" HOME="$work" LANG=C.UTF-8
       bash "$work/wheel_inside.sh" "$work/venv" "$work" "$src" "$build")
if [[ $(id -u) -eq 0 ]]; then
  # Hide the trees: an empty tmpfs over each (the build tree may lie inside the source tree).
  unshare --mount --propagation private bash -euo pipefail -c '
    src=$1 build=$2; shift 2
    mount -t tmpfs -o size=1m,mode=0755 tmpfs "$build"
    mount -t tmpfs -o size=1m,mode=0755 tmpfs "$src"
    [ -z "$(ls -A "$src")" ] || { echo "FAIL: the source tree is still visible"; exit 1; }
    exec "$@"' bash "$src" "$build" "${run_a[@]}"
  echo "ok: (the source tree $src and build tree $build were hidden)"
else
  echo "note: not root: the trees stay visible; the mapped-file check still refuses any path in them"
  "${run_a[@]}"
fi

# --- B: a fresh bookworm root without ddprun's libraries -----------------------------------------
if [[ $(id -u) -ne 0 ]]; then
  echo "SKIP (part B): installing into a Debian root needs root"
  echo "PASS (part A only): wheel used from a venv ($(( $(date +%s) - start )) s)"
  exit 0
fi
base=$("$here/bookworm_root.sh") || exit $?
mkdir -p "$work"/{upper,ovl,root}
unshare --mount --propagation private --pid --fork bash -euo pipefail -c '
  work=$1 base=$2 whl=$3
  m=$work/root
  mount -t overlay overlay -o "lowerdir=$base,upperdir=$work/upper,workdir=$work/ovl" "$m"
  mount -t proc proc "$m/proc"
  mount -t tmpfs -o mode=1777 tmpfs "$m/tmp"
  mount --bind /dev "$m/dev"
  mkdir -p "$m/root/t"
  cp "$whl" "$work/wheel_inside.sh" "$work/job_watchdog.sh" "$m/root/t/"
  chroot "$m" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 bash -euo pipefail -c "
    for lib in libspdlog libfmt libboost_filesystem; do
      if grep -q \$lib <<<\"\$(ldconfig -p)\"; then echo \"FAIL: the fresh root has \$lib\"; exit 1; fi
    done
    python3 -m venv /root/venv
    /root/venv/bin/python -m pip install -q --no-index --no-deps /root/t/*.whl
    PATH=/root/venv/bin:\$PATH bash /root/t/wheel_inside.sh /root/venv /root/t / /nonexistent-build
  "
' bash "$work" "$base" "$whl"
echo "ok: (part B ran in a fresh bookworm root without spdlog, fmt or Boost)"
echo "PASS: wheel used from fresh venvs ($(( $(date +%s) - start )) s)"
