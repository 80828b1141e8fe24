#!/bin/bash
# Installs the "worker" component of an already built ddprun tree into a temp prefix, then
# builds an outside project against it (find_package(ddprun) and pkg-config) and runs it.
# usage: install_consumer_test.sh CMAKE BUILD_DIR CONSUMER_SRC GENERATOR [LIBDIR]
# LIBDIR: the tree's CMAKE_INSTALL_LIBDIR (lib/x86_64-linux-gnu on Debian; default lib).
set -euo pipefail
cmake_bin=$1 build=$2 src=$3 gen=$4 libdir=${5:-lib}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$cmake_bin" --install "$build" --component worker --prefix "$tmp/prefix" > "$tmp/install.log"
# Only the worker component: no ddprun binaries.
[ -e "$tmp/prefix/bin/ddprun" ] && fail "the worker component installed the ddprun binary"
for f in include/ddprun/worker.hpp include/ddprun/worker.h "$libdir/cmake/ddprun/ddprunConfig.cmake" \
         "$libdir/pkgconfig/ddprun-worker.pc"; do
  [ -f "$tmp/prefix/$f" ] || fail "missing $f in the install tree"
done
ls "$tmp/prefix/$libdir"/libddprun_worker.so* > /dev/null || fail "missing libddprun_worker.so"

"$cmake_bin" -S "$src" -B "$tmp/build" -G "$gen" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_C_FLAGS="${DDPRUN_CONSUMER_FLAGS:-}" -DCMAKE_CXX_FLAGS="${DDPRUN_CONSUMER_FLAGS:-}" \
  -DCMAKE_EXE_LINKER_FLAGS="${DDPRUN_CONSUMER_FLAGS:-}" > "$tmp/cfg.log" \
  || { cat "$tmp/cfg.log"; fail "consumer configure"; }
"$cmake_bin" --build "$tmp/build" > "$tmp/build.log" || { cat "$tmp/build.log"; fail "consumer build"; }

id=$(printf 'ab%.0s' $(seq 1 127))cd
run_env=(env -i PATH="$PATH" RANK=5 WORLD_SIZE=8 LOCAL_RANK=1 LOCAL_WORLD_SIZE=4 MASTER_ADDR=10.1.2.3
         MASTER_PORT=29555 DDPRUN_NCCL_UNIQUE_ID="$id")
expect_cxx="cxx rank=5/8 local=1/4 master=10.1.2.3:29555 nccl=abcd"
expect_c="c rank=5/8 local=1/4 master=10.1.2.3:29555 nccl=abcd"
out=$("${run_env[@]}" "$tmp/build/consumer_cxx") || fail "consumer_cxx exited non-zero"
[ "$out" = "$expect_cxx" ] || fail "consumer_cxx printed '$out'"
out=$("${run_env[@]}" "$tmp/build/consumer_c") || fail "consumer_c exited non-zero"
[ "$out" = "$expect_c" ] || fail "consumer_c printed '$out'"
# A missing variable is an error naming it.
if err=$(env -i RANK=0 "$tmp/build/consumer_cxx" 2>&1); then fail "consumer_cxx succeeded without env"; fi
case "$err" in *"is not set"*) ;; *) fail "unexpected error: $err" ;; esac

# pkg-config: compile the C consumer by hand.
export PKG_CONFIG_PATH="$tmp/prefix/$libdir/pkgconfig"
flags=$(pkg-config --cflags --libs ddprun-worker) || fail "pkg-config ddprun-worker"
cc ${DDPRUN_CONSUMER_FLAGS:-} "$src/consumer.c" -o "$tmp/consumer_pc" $flags || fail "cc with pkg-config flags ($flags)"
out=$(LD_LIBRARY_PATH="$tmp/prefix/$libdir" "${run_env[@]}" LD_LIBRARY_PATH="$tmp/prefix/$libdir" "$tmp/consumer_pc") \
  || fail "consumer_pc exited non-zero"
[ "$out" = "$expect_c" ] || fail "consumer_pc printed '$out'"
echo "PASS: installed worker package consumed via find_package and pkg-config"
