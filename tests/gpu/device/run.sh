#!/usr/bin/env bash
# ddprun on a real NVIDIA GPU with pip's torch 2.x (docs/gpus.md, "Verified on a GPU machine").
#
#   tests/gpu/device/run.sh PREFIX OUT [CHECK...]
#
# PREFIX  what stage.sh staged: bin/ (ddprun, ddprun-rdzvd, ddprun-nccl-id, spawn_floor,
#         store_client_driver, native_allreduce), lib/, include/
# OUT     results: summary.txt (one line per check: PASS/FAIL, seconds), log.txt (every check's
#         output), launch.json / launch.md (bench/launch/run.py against torchrun 2.x)
# CHECK   any of: info gpus nccl_pip holder_cost nccl_native nccl_torch store torchrun_c10d torch2
#         containment openssl hf floor launch (default: all, in that order; gpus..nccl_torch share the
#         GPU and run one after another, store/torchrun_c10d, torch2 and containment/openssl run
#         beside them on the CPUs, hf, floor and launch alone at the end)
#
# DEVICE_DEADLINE_S (default 480) bounds the whole run: each check's timeout is cut to what is
# left, so the logs always come back. PYTHON_EXEC (default python3) must hold torch 2.x; torchrun,
# nvcc and nvidia-smi come from PATH. Nothing here needs network access.
set -u
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../../.." && pwd)
self="$here/$(basename "$0")"
if [[ ${1:-} == --one ]]; then  # run.sh --one FUNCTION: one check, in its own process (for timeout)
  one=$2
  prefix=$DEVICE_PREFIX out=$DEVICE_OUT work=$DEVICE_WORK PY=$PYTHON_EXEC TORCHRUN=${DDPRUN_TORCHRUN2:-}
  HARNESS=$DEVICE_HARNESS_PYTHON
else
  one=
  prefix=$(cd "${1:?usage: run.sh PREFIX OUT [CHECK...]}" && pwd)
  out=${2:?usage: run.sh PREFIX OUT [CHECK...]}
  shift 2
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  checks=("$@")
  ((${#checks[@]})) || checks=(info gpus nccl_pip holder_cost nccl_native nccl_torch store torchrun_c10d torch2 containment openssl hf floor launch)

  PY=${PYTHON_EXEC:-python3}
  PY=$(command -v "$PY")
  TORCHRUN=$(command -v torchrun || true)
  export PATH="$prefix/bin:$PATH" LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export DDPRUN_BIN_DIR="$prefix/bin" DDPRUN_SOURCE_DIR="$src" PYTHON_EXEC="$PY" DDPRUN_TORCH2_PYTHON="$PY"
  export DDPRUN_TEST_PYTHON="$PY" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  export DDPRUN_TORCH2_VERSION=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null)
  export DDPRUN_TORCH2_PY_VERSION=$("$PY" -c 'import platform; print(platform.python_version())')
  [[ -n $TORCHRUN ]] && export DDPRUN_TORCHRUN2="$TORCHRUN"
  export TORCH_PYTHON="$PY"
  unset DDPRUN_NCCL_LIBRARY  # the holder must find NCCL by itself (the wheel beside torch)
  work=$(mktemp -d /tmp/ddprun-device-XXXXXX)
  # The test scripts' own interpreter: PYTHON_EXEC, unless that is a wrapper that cannot start
  # itself again (the chroot of scripts/torch2, when this script is tried on a box without a GPU).
  HARNESS=${DEVICE_HARNESS_PYTHON:-$PY}
  export DEVICE_PREFIX="$prefix" DEVICE_OUT="$out" DEVICE_WORK="$work" DEVICE_HARNESS_PYTHON="$HARNESS"
fi
want() { local c; for c in "${checks[@]}"; do [[ $c == "$1" ]] && return 0; done; return 1; }


# check NAME LIMIT_S FUNCTION: runs FUNCTION in its own process (run.sh --one, so that timeout
# can end it) with its output in its own log; the summary line and the log are appended to OUT
# when it ends.
check() {
  local name=$1 limit=$2; shift 2
  local left=$((deadline_s - $(date +%s) - 5))
  ((left < limit)) && limit=$left
  local t0=$(date +%s.%N) rc
  if ((limit < 5)); then
    rc=124; echo "skipped: the run's deadline (DEVICE_DEADLINE_S) is reached" >"$work/$name.log"
  else
    timeout -k 5 "$limit" bash "$self" --one "$@" >"$work/$name.log" 2>&1; rc=$?
  fi
  local secs=$(awk "BEGIN { print $(date +%s.%N) - $t0 }")
  local verdict=PASS; ((rc == 0)) || verdict="FAIL (exit $rc$( ((rc == 124)) && echo ", timed out after ${limit} s"))"
  {
    command -v flock >/dev/null && flock 9
    printf '%-16s %-40s %6.1f s\n' "$name" "$verdict" "$secs" >>"$out/summary.txt"
    { printf '\n===== %s: %s (%.1f s) =====\n' "$name" "$verdict" "$secs"; cat "$work/$name.log"; } >>"$out/log.txt"
  } 9>"$work/.lock"
  return $rc
}

# expect DESC RC PATTERN CMD...: CMD must exit RC and print (stdout+stderr) PATTERN (grep -E).
expect() {
  local desc=$1 want_rc=$2 pattern=$3; shift 3
  local got rc
  got=$("$@" 2>&1); rc=$?
  if [[ $rc == "$want_rc" ]] && grep -qE -- "$pattern" <<<"$got"; then
    echo "ok   $desc"
    echo "$got" | grep -E -- "$pattern" | head -3 | sed 's/^/       /'
    return 0
  fi
  echo "FAIL $desc: exit $rc (want $want_rc), output must match /$pattern/:"
  { echo "$got" | grep -E '"ok": false|Error|error:' | head -12; echo "       ..."; echo "$got" | tail -30; } | sed 's/^/       /'
  FAILED=1
  return 1
}

nccl_dirs() {  # the pip wheel's NCCL (lib dir, include dir) beside torch
  "$PY" - <<'PYEOF'
import glob, os, sysconfig
libs = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "lib", "libnccl.so.2"))
incs = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "include", "nccl.h"))
print(os.path.dirname(libs[0]) if libs else "", os.path.dirname(incs[0]) if incs else "")
PYEOF
}

c_info() {
  uname -a; grep PRETTY_NAME /etc/os-release; echo "cpus: $(getconf _NPROCESSORS_ONLN)"; free -g | head -2
  nvidia-smi -L
  nvidia-smi --query-gpu=name,uuid,pci.bus_id,driver_version,memory.total --format=csv,noheader
  "$PY" -c 'import torch, torch.distributed as d; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count(), "nccl backend", d.is_nccl_available())'
  "$PY" -c 'import torch.distributed as d, datetime; s = d.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False); print("TCPStore server default: libuv", getattr(s, "libuvBackend", "?"))'
  "$PY" - <<'PYEOF'
import importlib.metadata as m
for p in ("accelerate", "transformers", "cupy-cuda13x", "nvidia-nccl-cu13", "mpi4py"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, "not installed")
PYEOF
  echo "torchrun: ${TORCHRUN:-missing}"; echo "python: $PY"
  nvcc --version | tail -2
  echo "pip NCCL (lib, include): $(nccl_dirs)"
  ldconfig -p | grep -E 'libnccl|libnvidia-ml|libcuda\.so' | head
  ls /dev/nvidia* 2>&1 | head -5; ls /proc/driver/nvidia/gpus 2>&1
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f' | sed 's/^0000//')
  echo "GPU bus $bus numa_node: $(cat /sys/bus/pci/devices/$bus/numa_node 2>&1)"
  ls -d /sys/devices/system/node/node* 2>&1; cat /sys/devices/system/node/node*/cpulist 2>&1
  echo "affinity: $(taskset -pc $$ 2>&1)"
  mount | grep -E 'cgroup' | head -5
  for b in ddprun ddprun-rdzvd ddprun-nccl-id; do echo "== ldd $b"; ldd "$prefix/bin/$b" | grep -E 'not found|spdlog|fmt|stdc'; done
  ddprun --version
}

c_gpus() {
  FAILED=0
  local uuid bus
  uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f' | sed 's/^0000//')
  expect "gpu counts 1 through NVML" 0 "1 worker\(s\)" env -u CUDA_VISIBLE_DEVICES ddprun --nproc-per-node gpu --dry-run /bin/true
  expect "dry run names the GPU by UUID and bus id" 0 "device: cuda:0 = GPU 0 \($uuid, $bus\)" env -u CUDA_VISIBLE_DEVICES ddprun --nproc-per-node gpu --dry-run /bin/true
  expect "the plan says NVML was used" 0 "gpus: 1 GPU\(s\) selected .*nvml" env -u CUDA_VISIBLE_DEVICES ddprun --nproc-per-node gpu --dry-run /bin/true
  expect "auto counts the GPU" 0 "1 worker\(s\)" env -u CUDA_VISIBLE_DEVICES ddprun --nproc-per-node auto --dry-run /bin/true
  expect "CUDA_VISIBLE_DEVICES=0" 0 "1 worker\(s\)" env CUDA_VISIBLE_DEVICES=0 ddprun --nproc-per-node gpu --dry-run /bin/true
  expect "CUDA_VISIBLE_DEVICES=<uuid prefix>" 0 "1 worker\(s\)" env CUDA_VISIBLE_DEVICES="${uuid:0:12}" ddprun --nproc-per-node gpu --dry-run /bin/true
  expect "CUDA_VISIBLE_DEVICES=0,1 stops at the missing device" 0 "1 worker\(s\)" env CUDA_VISIBLE_DEVICES=0,1 ddprun --nproc-per-node gpu --dry-run /bin/true
  expect "CUDA_VISIBLE_DEVICES=0,0 stops at the repeat" 0 "1 worker\(s\)" env CUDA_VISIBLE_DEVICES=0,0 ddprun --nproc-per-node gpu --dry-run /bin/true
  expect "CUDA_VISIBLE_DEVICES=0,-1,0" 0 "1 worker\(s\)" env CUDA_VISIBLE_DEVICES=0,-1,0 ddprun --nproc-per-node gpu --dry-run /bin/true
  expect "CUDA_VISIBLE_DEVICES= is no GPU" 2 "names no usable GPU" env CUDA_VISIBLE_DEVICES= ddprun --nproc-per-node gpu --dry-run /bin/true
  expect "CUDA_VISIBLE_DEVICES=1 is past the only device" 2 "names no usable GPU" env CUDA_VISIBLE_DEVICES=1 ddprun --nproc-per-node gpu --dry-run /bin/true
  expect "CUDA_VISIBLE_DEVICES=GPU-ffff... unknown UUID" 2 "names no usable GPU" env CUDA_VISIBLE_DEVICES=GPU-ffffffff ddprun --nproc-per-node gpu --dry-run /bin/true
  expect "--gpu-isolation gives the worker its device alone" 0 "CUDA_VISIBLE_DEVICES=(0|$uuid)" env -u CUDA_VISIBLE_DEVICES ddprun --nproc-per-node gpu --gpu-isolation --dry-run /bin/true
  expect "--gpus $uuid selects by UUID" 0 "CUDA_VISIBLE_DEVICES=$uuid" env -u CUDA_VISIBLE_DEVICES ddprun --nproc-per-node 1 --gpus "$uuid" --dry-run /bin/true
  expect "two workers on one GPU need --gpu-sharing" 2 "gpu-sharing" env -u CUDA_VISIBLE_DEVICES ddprun --nproc-per-node 2 --gpu-isolation --dry-run /bin/true
  # --numa-binding node: the GPU's node's CPUs (node 0 when the GPU reports -1), within our affinity.
  local node cpus
  node=$(cat "/sys/bus/pci/devices/$bus/numa_node" 2>/dev/null || echo -1); ((node < 0)) && node=0
  cpus=$(cat "/sys/devices/system/node/node$node/cpulist" 2>/dev/null || cat /sys/devices/system/cpu/online)
  echo "GPU $bus: numa_node file says $(cat /sys/bus/pci/devices/$bus/numa_node 2>&1), node $node cpus $cpus"
  expect "--numa-binding node shows the GPU's NUMA CPUs" 0 "cpus: $cpus \(--numa-binding node\)" env -u CUDA_VISIBLE_DEVICES ddprun --nproc-per-node gpu --numa-binding node --dry-run /bin/true
  expect "--numa-binding node binds the running worker" 0 "^Cpus_allowed_list:[[:space:]]+$cpus\$" env -u CUDA_VISIBLE_DEVICES ddprun --standalone --nproc-per-node gpu --numa-binding node --no-python grep Cpus_allowed_list /proc/self/status
  # A real run: the worker sees its ordinal and the device order it was given (none in shared
  # mode, as torchrun), and the holder (auto) found NCCL without DDPRUN_NCCL_LIBRARY (pip's wheel
  # beside torch, through PATH's python3).
  expect "auto exports an NCCL ID on a GPU node" 0 "order= dev=0 id=[0-9a-f]{256}" env -u CUDA_VISIBLE_DEVICES -u CUDA_DEVICE_ORDER ddprun --standalone --nproc-per-node gpu --no-python sh -c 'echo "order=$CUDA_DEVICE_ORDER dev=$DDPRUN_CUDA_DEVICE id=$DDPRUN_NCCL_UNIQUE_ID"'
  expect "the holder alone prints an ID" 0 "^[0-9a-f]{256}$" sh -c 'ddprun-nccl-id </dev/null'
  expect "NCCL_DEBUG=INFO: NCCL's lines stay off the IDs (auto on a GPU node)" 0 "id=[0-9a-f]{256}$" env -u CUDA_VISIBLE_DEVICES NCCL_DEBUG=INFO ddprun --standalone --nproc-per-node gpu --no-python sh -c 'echo "id=$DDPRUN_NCCL_UNIQUE_ID"'
  expect "NCCL_DEBUG=INFO: the holder's NCCL lines reach ddprun's stderr" 0 "NCCL INFO" env -u CUDA_VISIBLE_DEVICES NCCL_DEBUG=INFO ddprun --standalone --nproc-per-node gpu --no-python /bin/true
  expect "--nccl-roots 2 exports two IDs" 0 "ids=[0-9a-f]{256},[0-9a-f]{256}$" ddprun --standalone --nproc-per-node 1 --nccl-id env --nccl-roots 2 --no-python sh -c 'echo "ids=$DDPRUN_NCCL_UNIQUE_IDS"'
  return $FAILED
}

c_nccl_native() {
  FAILED=0
  local libdir incdir
  read -r libdir incdir < <(nccl_dirs)
  [[ -n $libdir && -n $incdir ]] || { echo "FAIL no libnccl.so.2 / nccl.h in the pip wheel beside torch"; return 1; }
  local flags=(-O2 -std=c++17 -I"$prefix/include" -I"$incdir" -L"$prefix/lib" -L"$libdir" -lddprun_worker -l:libnccl.so.2
               -Xlinker -rpath="$prefix/lib:$libdir")
  nvcc -o "$work/nccl_allreduce" "$src/examples/nccl_allreduce.cu" "${flags[@]}" || { echo "FAIL nvcc nccl_allreduce.cu"; return 1; }
  nvcc -x cu -o "$work/nccl_worker" "$here/nccl_worker.cpp" "${flags[@]}" || { echo "FAIL nvcc nccl_worker.cpp"; return 1; }
  echo "built with $(nvcc --version | tail -1)"
  expect "examples/nccl_allreduce.cu (C API), --nccl-id auto" 0 "rank 0/1 on cuda:0: sum=1 expected=1 OK" ddprun --standalone --nproc-per-node gpu "$work/nccl_allreduce"
  expect "examples/nccl_allreduce.cu, --nccl-id env" 0 "sum=1 expected=1 OK" ddprun --standalone --nproc-per-node gpu --nccl-id env "$work/nccl_allreduce"
  expect "examples/nccl_allreduce.cu, --nccl-id comm-id" 0 "sum=1 expected=1 OK" ddprun --standalone --nproc-per-node gpu --nccl-id comm-id "$work/nccl_allreduce"
  expect "C++ API worker (store barrier + NCCL), auto" 0 "id from DDPRUN_NCCL_UNIQUE_ID: sum=1 expected=1 OK" ddprun --standalone --nproc-per-node gpu "$work/nccl_worker"
  expect "C++ API worker, --nccl-id comm-id" 0 "id from NCCL_COMM_ID: sum=1 expected=1 OK" ddprun --standalone --nproc-per-node gpu --nccl-id comm-id "$work/nccl_worker"
  expect "a restart gets a fresh ID (attempt 1 runs NCCL again)" 0 "restart=1 .*OK" ddprun --standalone --nproc-per-node gpu --max-restarts 1 --no-python sh -c \
    '[ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && exit 3; printf "restart=%s " "$TORCHELASTIC_RESTART_COUNT"; exec "$0"' "$work/nccl_worker"
  expect "examples/native_allreduce (CPU store sum), 4 ranks" 0 "" ddprun --standalone --nproc-per-node 4 "$prefix/bin/native_allreduce"
  return $FAILED
}

c_nccl_pip() {
  # pip's NCCL beside torch when no libnccl is on the loader path: every other candidate is
  # hidden (bind-mounted over by /dev/null) in a private mount namespace.
  FAILED=0
  local hide=() f
  for f in $(ldconfig -p | awk '/libnccl\.so\.2 / {print $NF}') /usr/local/cuda/lib/libnccl.so.2 /usr/local/cuda/lib64/libnccl.so.2; do
    [[ -e $f ]] && hide+=("$f")
  done
  echo "hidden: ${hide[*]:-none}"
  expect "the holder loads pip's NCCL, found through PATH's python3" 0 "file=[^ ]*/site-packages/nvidia/[^/]+/lib/libnccl.so.2 " \
    unshare -m sh -c 'for f in "$@"; do mount --bind /dev/null "$f" || exit 9; done; LD_DEBUG=files ddprun-nccl-id </dev/null' sh "${hide[@]}"
  expect "a job exports the ID from pip's NCCL (--nccl-id env)" 0 "id=[0-9a-f]{256}" \
    unshare -m sh -c 'for f in "$@"; do mount --bind /dev/null "$f" || exit 9; done; ddprun --standalone --nproc-per-node gpu --nccl-id env --no-python sh -c "echo id=\$DDPRUN_NCCL_UNIQUE_ID"' sh "${hide[@]}"
  expect "without any NCCL, --nccl-id env says what it tried" 1 "NCCL" \
    unshare -m sh -c 'd=$1; shift; for f in "$@"; do mount --bind /dev/null "$f" || exit 9; done; env -u PYTHON_EXEC PATH=/usr/bin:/bin "$d" --standalone --nproc-per-node gpu --nccl-id env /bin/true' sh "$prefix/bin/ddprun" "${hide[@]}"
  return $FAILED
}

c_holder_cost() {  # what the NCCL ID costs a launch on a GPU node (median of 30, ms)
  # PREFIX/before/ (optional): an earlier ddprun + ddprun-nccl-id, measured in the same rotation.
  "$HARNESS" - "$prefix/bin" "$prefix/before" <<'PYEOF'
import os, statistics, subprocess, sys, time
b, before = sys.argv[1], sys.argv[2]
def t(cmd, n=30):
    xs = []
    for _ in range(n):
        a = time.perf_counter()
        subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        xs.append((time.perf_counter() - a) * 1000)
    return f"median {statistics.median(xs):.2f} ms, min {min(xs):.2f} ms"
for label, cmd in [("spawn_floor 8 /bin/true", [b + "/spawn_floor", "8", "/bin/true"]),
                   ("ddprun-nccl-id (holder alone)", [b + "/ddprun-nccl-id"]),
                   ("ddprun -n 8 /bin/true (auto: holder)", [b + "/ddprun", "--standalone", "--nproc-per-node", "8", "/bin/true"]),
                   ("ddprun -n 8 --nccl-id off /bin/true", [b + "/ddprun", "--standalone", "--nproc-per-node", "8", "--nccl-id", "off", "/bin/true"]),
                   ("ddprun -n 8 --nccl-id off --containment off", [b + "/ddprun", "--standalone", "--nproc-per-node", "8", "--nccl-id", "off", "--containment", "off", "/bin/true"])] + (
                  [("before: ddprun -n 8 /bin/true (auto: holder)", [before + "/ddprun", "--standalone", "--nproc-per-node", "8", "/bin/true"]),
                   ("before: ddprun -n 8 --nccl-id off /bin/true", [before + "/ddprun", "--standalone", "--nproc-per-node", "8", "--nccl-id", "off", "/bin/true"])]
                  if os.path.exists(before + "/ddprun") else []):
    print(f"{label:48s} {t(cmd)}", flush=True)
PYEOF
}

c_nccl_torch() {
  FAILED=0
  expect "torch DDP over NCCL, ddprun --nccl-id auto" 0 '"ok": true' ddprun --standalone --nproc-per-node gpu "$here/ddp_nccl.py" id
  expect "torch DDP over NCCL, ddprun --nccl-id comm-id" 0 '"ok": true' ddprun --standalone --nproc-per-node gpu --nccl-id comm-id "$here/ddp_nccl.py" comm-id
  expect "torch DDP over NCCL, torchrun" 0 '"ok": true' "$TORCHRUN" --standalone --nproc-per-node gpu "$here/ddp_nccl.py" plain
  expect "CuPy NCCL communicator from DDPRUN_NCCL_UNIQUE_ID" 0 '"ok": true' ddprun --standalone --nproc-per-node gpu "$here/cupy_nccl_id.py"
  expect "torch DDP over NCCL with NCCL_DEBUG=INFO, ddprun --nccl-id auto" 0 '"ok": true' env NCCL_DEBUG=INFO ddprun --standalone --nproc-per-node gpu "$here/ddp_nccl.py" id
  return $FAILED
}

c_store() {
  FAILED=0
  local uv
  for uv in 1 0; do
    expect "torch $DDPRUN_TORCH2_VERSION clients (use_libuv=$uv) against ddprun-rdzvd" 0 "" \
      env DDPRUN_TEST_TORCH_USE_LIBUV=$uv "$HARNESS" "$src/tests/interop/test_torch_client_vs_rdzvd.py"
    expect "ddprun's client against torch $DDPRUN_TORCH2_VERSION's server (use_libuv=$uv)" 0 "" \
      env DDPRUN_TEST_TORCH_USE_LIBUV=$uv "$HARNESS" "$src/tests/torch2/test_driver_vs_torch2_server.py"
  done
  expect "the store contract over every pair (torch's default server)" 0 "" "$HARNESS" "$src/tests/torch2/test_store_contract2.py"
  return $FAILED
}

c_torchrun_c10d() {
  "$HARNESS" "$src/tests/rendezvous_service/test_torchrun_c10d.py"
}

c_torch2() {
  FAILED=0
  expect "4 gloo ranks: env contract beside torchrun $DDPRUN_TORCH2_VERSION, restart" 0 "" "$HARNESS" "$src/tests/torch2/test_single_node.py"
  expect "culprit rank named with its frame" 0 "" "$HARNESS" "$src/tests/torch2/test_stuck_rank.py"
  return $FAILED
}

c_containment() {  # that machine's cgroups (v2 only there): sweeps in every mode, OOM causes, culprit, hang
  FAILED=0
  echo "own cgroup: $(cat /proc/self/cgroup | tr '\n' ' ')"
  echo "root cgroup.subtree_control: $(cat /sys/fs/cgroup/cgroup.subtree_control 2>&1)"
  expect "a worker runs in the job's cgroup (rank0 below it where memory is delegated)" 0 "^0::/.*ddprun-[0-9]+-[0-9]+(/rank0)?$" \
    ddprun --standalone --nproc-per-node 1 --nccl-id off --no-python cat /proc/self/cgroup
  env DDPRUN_BIN_DIR="$prefix/bin" PYTHON_EXEC="$PY" "$HARNESS" "$src/tests/single_node/test_diagnosis.py" -v 2>&1 || FAILED=1
  return $FAILED
}

c_openssl() {  # OpenSSL loaded on first use, from that machine's libssl.so.3
  ldconfig -p | grep -E 'libssl\.so\.3|libcrypto\.so\.3'
  env DDPRUN_BIN_DIR="$prefix/bin" "$HARNESS" "$src/tests/launcher/openssl_lazy_test.py" -v 2>&1
}

c_floor() {  # launch against the posix_spawn floor (bench/launch/pairs.py), with and without the NCCL holder
  local extra
  for extra in "" "--nccl-id off" "--nccl-id off --containment off"; do
    echo "== ddprun ${extra:-(defaults)}"
    # shellcheck disable=SC2086
    "$HARNESS" "$src/bench/launch/pairs.py" --ddprun "$prefix/bin/ddprun" --floor "$prefix/bin/spawn_floor" \
      --sizes "${FLOOR_SIZES:-1,8,64}" --reps "${FLOOR_REPS:-20}" --json "$out/pairs${extra//[^a-z]/_}.json" -- $extra || return 1
  done
}

c_hf() {
  FAILED=0
  local script l t0 t1
  for script in accelerate_cpu trainer_cpu; do
    for l in ddprun torchrun; do
      t0=$(date +%s.%N)
      if [[ $l == ddprun ]]; then
        expect "$script under ddprun --nproc-per-node 4" 0 '"ok": true' ddprun --standalone --nproc-per-node 4 "$here/$script.py"
      else
        expect "$script under torchrun --nproc-per-node 4" 0 '"ok": true' "$TORCHRUN" --standalone --nproc-per-node 4 "$here/$script.py"
      fi
      t1=$(date +%s.%N)
      echo "       wall: $(awk "BEGIN { printf \"%.1f\", $t1 - $t0 }") s ($script, $l)"
    done
  done
  return $FAILED
}

c_launch() {
  "$HARNESS" "$src/bench/launch/run.py" --ddprun "$prefix/bin/ddprun" --floor "$prefix/bin/spawn_floor" --no-mpirun \
    --kinds ddprun,torchrun2_mi0.1 --sizes "${LAUNCH_SIZES:-1,2,4,8,16}" --out "$out/launch.json" --markdown "$out/launch.md"
}

if [[ -n $one ]]; then
  "$one"
  exit $?
fi
start_s=$(date +%s)
deadline_s=$((start_s + ${DEVICE_DEADLINE_S:-480}))
: >"$out/summary.txt"
: >"$out/log.txt"
want info && check info 60 c_info
pids=()
if want gpus || want nccl_pip || want holder_cost || want nccl_native || want nccl_torch; then
  (
    want gpus && check gpus 90 c_gpus
    want nccl_pip && check nccl_pip 60 c_nccl_pip
    want holder_cost && check holder_cost 60 c_holder_cost
    want nccl_native && check nccl_native 150 c_nccl_native
    want nccl_torch && check nccl_torch 150 c_nccl_torch
  ) &
  pids+=($!)
fi
if want store || want torchrun_c10d; then
  (
    want store && check store 200 c_store
    want torchrun_c10d && check torchrun_c10d 120 c_torchrun_c10d
  ) &
  pids+=($!)
fi
if want torch2; then check torch2 300 c_torch2 & pids+=($!); fi
if want containment || want openssl; then
  (
    want containment && check containment 240 c_containment
    want openssl && check openssl 90 c_openssl
  ) &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p"; done
want hf && check hf 240 c_hf
want floor && check floor 120 c_floor
want launch && check launch 240 c_launch
echo "whole run: $(($(date +%s) - start_s)) s" >>"$out/summary.txt"
cat "$out/summary.txt"
rm -rf "$work"
! grep -q FAIL "$out/summary.txt"
