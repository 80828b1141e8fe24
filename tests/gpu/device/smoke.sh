#!/usr/bin/env bash
# tests/gpu/device/run.sh on a machine without a GPU (ctest: gpu_device_script_smoke). The
# harness itself must work and report honestly: `info` passes, `gpus` fails (no NVIDIA GPU), the
# summary and the log say which expectation failed, and the run ends within its deadline.
#   smoke.sh BUILD_DIR       (BUILD_DIR/bin holds ddprun and the other binaries)
set -u
build=${1:?usage: smoke.sh BUILD_DIR}
here=$(cd "$(dirname "$0")" && pwd)
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  echo "SKIPPED: this machine has an NVIDIA GPU: run tests/gpu/device/run.sh itself"
  exit 77
fi
out=$(mktemp -d /tmp/ddprun-device-smoke-XXXXXX)
trap 'rm -rf "$out"' EXIT
fail() {
  echo "FAIL: $*"
  cat "$out/summary.txt" 2>/dev/null
  tail -40 "$out/log.txt" 2>/dev/null
  exit 1
}
start=$(date +%s)
DEVICE_DEADLINE_S=60 bash "$here/run.sh" "$build" "$out" info gpus >/dev/null 2>&1
rc=$?
((rc == 1)) || fail "run.sh exited $rc; want 1 (the gpus check must fail without a GPU)"
grep -qE '^info +PASS ' "$out/summary.txt" || fail "the info check did not pass"
grep -qE '^gpus +FAIL \(exit 1\) ' "$out/summary.txt" || fail "the gpus check was not reported as failed"
grep -q '^FAIL gpu counts 1 through NVML: exit 2 (want 0)' "$out/log.txt" || fail "the log does not name the failed expectation"
grep -q '^ok   CUDA_VISIBLE_DEVICES= is no GPU' "$out/log.txt" || fail "an expectation that holds without a GPU did not pass"
grep -qE '^ddprun [0-9]' "$out/log.txt" || fail "info did not run ddprun --version"
grep -qE '^whole run: [0-9]+ s' "$out/summary.txt" || fail "the summary has no whole-run line"
echo "run.sh harness without a GPU: info PASS, gpus FAIL as it should ($(($(date +%s) - start)) s)"
