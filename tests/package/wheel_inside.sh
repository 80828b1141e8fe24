#!/bin/bash
# Uses an installed ddprun wheel from the venv VENV (its bin first on PATH); run by wheel_test.sh.
# usage: wheel_inside.sh VENV WORKDIR SOURCE_DIR BUILD_DIR
# SOURCE_DIR and BUILD_DIR are only named so that no mapped file may lie in them ("/" = unknown).
set -euo pipefail
venv=$1 work=$2 src=$3 build=$4
fail() { echo "FAIL: $*"; exit 1; }
cd "$work"  # ddprun starts workers in its own cwd; the caller's may be a hidden directory
[[ "$(command -v ddprun)" == "$venv/bin/ddprun" ]] || fail "ddprun on PATH is '$(command -v ddprun)', not the venv's"
for b in ddprun ddprun-rdzvd ddprun-nccl-id; do [[ -x "$venv/bin/$b" ]] || fail "$venv/bin/$b missing"; done
v=$(ddprun --version) || fail "ddprun --version"
v2=$("$venv/bin/python" -m ddprun --version) || fail "python -m ddprun --version"
[[ "$v" == "$v2" ]] || fail "python -m ddprun printed '$v2', ddprun printed '$v'"
ddprun-rdzvd --version >/dev/null || fail "ddprun-rdzvd --version"
echo "ok: $v (console script and python -m ddprun)"

cat >"$work/worker.sh" <<'W'
#!/bin/sh
echo "worker rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK"
W
chmod +x "$work/worker.sh"
out=$(timeout 60 ddprun --master-port 0 --nproc-per-node 2 "$work/worker.sh" 2>&1) || { echo "$out"; fail "2-rank shell job"; }
for r in 0 1; do grep -q "worker rank=$r world=2 local=$r" <<<"$out" || { echo "$out"; fail "rank $r missing"; }; done
echo "ok: ddprun --nproc-per-node 2 with a shell worker"
# The agent's containment watchdog is the wheel's ddprun-watchdog (else the agent would fork one).
out=$(bash "$(dirname "$0")/job_watchdog.sh" 2>&1) || { echo "$out"; fail "watchdog job"; }
grep -qE "^$venv/lib/python3[^/]*/site-packages/ddprun/_bin/ddprun-watchdog$" <<<"$out" \
  || { echo "$out"; fail "the agent's watchdog is not the wheel's ddprun-watchdog"; }
echo "ok: the agent's watchdog is the wheel's ddprun-watchdog"

# Starts ddprun-rdzvd on a free loopback port (extra flags: "$@"): sets dpid and port from its
# readiness line.
start_daemon() {
  local fifo=$work/rdzvd.out line
  rm -f "$fifo"; mkfifo "$fifo"
  ddprun-rdzvd --host 127.0.0.1 --port 0 "$@" >"$fifo" 2>"$work/rdzvd.err" &
  dpid=$!
  exec 3<"$fifo"
  read -r -t 30 line <&3 || { cat "$work/rdzvd.err"; fail "ddprun-rdzvd $* printed no 'listening on' line within 30 s"; }
  port=${line##*:}
}

start_daemon --log-format json
out=$(timeout 30 ddprun status --rdzv-endpoint "127.0.0.1:$port" 2>&1) || { echo "$out"; fail "ddprun status"; }
# The process is the bundled binary itself (the entry point exec'd it), with the wheel's libraries.
exe=$(readlink "/proc/$dpid/exe")
[[ "$exe" == "$venv"/lib/python3*/site-packages/ddprun/_bin/ddprun-rdzvd ]] || fail "daemon runs '$exe'"
maps=$(grep -oE '/[^ ]+$' "/proc/$dpid/maps" | sort -u)
for f in $maps; do
  case "$f" in
    "$venv"/*) ;;
    */libc.so.6|*/libm.so.6|*/ld-linux-x86-64.so.2|*/libpthread.so.0|*/libdl.so.2|*/librt.so.1) ;;
    *) fail "the daemon maps $f, which is neither in the venv nor part of glibc" ;;
  esac
  if [[ "$src" != / && "$f" == "$src"/* ]] || [[ "$f" == "$build"/* ]]; then fail "the daemon maps $f from the source/build tree"; fi
done
grep -q "$venv/.*/_lib/libspdlog" <<<"$maps" || fail "libspdlog not mapped from the wheel: $maps"
echo "ok: ddprun-rdzvd from the wheel answered ddprun status; non-glibc libraries all from the wheel"
kill -TERM "$dpid"; wait "$dpid" || fail "ddprun-rdzvd exited $? on SIGTERM"

# ddprun loads OpenSSL only when a feature needs it (here the token handshake), with dlopen:
# the wheel bundles libssl/libcrypto, and the agent must map them from the wheel.
DDPRUN_RDZV_TOKEN=wheel-token start_daemon
out=$(DDPRUN_RDZV_TOKEN=wheel-token timeout 60 ddprun --nnodes 1 --nproc-per-node 1 --rdzv-backend c10d \
        --rdzv-endpoint "127.0.0.1:$port" --rdzv-id wheel-token-job --no-python \
        sh -c 'grep -oE "/[^ ]+/libssl\.so[^ ]*$" /proc/$PPID/maps | sort -u' 2>&1) || { echo "$out"; fail "token job"; }
grep -qE "^$venv/.*/_lib/libssl\.so\.3$" <<<"$out" || { echo "$out"; fail "the agent did not map libssl.so.3 from the wheel"; }
echo "ok: a token job loaded OpenSSL from the wheel"
kill -TERM "$dpid"; wait "$dpid" || fail "ddprun-rdzvd (token) exited $? on SIGTERM"

if "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  t0=$(date +%s)
  out=$(cd "$work" && PYTHON_EXEC="$venv/bin/python" timeout 240 ddprun --master-port 0 --nproc-per-node 2 \
          ddp_train.py --epochs 1 --samples 128 2>&1) || { echo "$out"; fail "examples/ddp_train.py under 2 ranks"; }
  grep -q "all_reduce check passed: sum=3 expected=3 world_size=2" <<<"$out" || { echo "$out"; fail "DDP check line missing"; }
  echo "ok: examples/ddp_train.py (torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')) under 2 ranks in $(( $(date +%s) - t0 )) s"
else
  echo "note: no torch in this venv; the DDP example is not run here"
fi
