"""The worker library and torch 2.6 in one job: every rank of `ddprun --standalone
--nproc-per-node 4` runs examples/native_allreduce (the worker library's store client: add,
set/get, barriers under /ddprun/attempt_0/) and a torch 2.6 gloo worker (init_process_group over
the same agent store, torch 2.x's unprefixed keys) at the same time. Both must finish with the
right sums on every rank, and nothing may be left running."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ["DDPRUN_BIN_DIR"]
SRC = os.environ["DDPRUN_SOURCE_DIR"]
DDPRUN = os.path.join(BIN, "ddprun")
NATIVE = os.path.join(BIN, "native_allreduce")
TORCH_WORKER = os.path.join(SRC, "tests", "single_node", "ddp_gloo_worker.py")


def leftovers(needle):
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle not in f.read():
                    continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            found.append(int(d))
        except OSError:
            continue
    return found


def main():
    for path in (DDPRUN, NATIVE):
        if not os.access(path, os.X_OK):
            sys.exit(f"FAIL: {path} is not built")
    scratch = tempfile.mkdtemp(prefix="ddprun-t2-mix-")
    env = dict(os.environ, TMPDIR=scratch)
    proc = subprocess.Popen([DDPRUN, "--standalone", "--nproc-per-node", "4",
                             os.path.join(HERE, "mixed_rank.sh"), NATIVE, TORCH_WORKER],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        sys.exit(f"FAIL: the mixed job did not finish within 200 s\n{out}\n{err[-4000:]}")
    print(out)
    print(err[-4000:], file=sys.stderr)
    failures = []
    if proc.returncode != 0:
        failures.append(f"ddprun exited {proc.returncode}")
    native = sorted(int(m.group(1)) for m in re.finditer(
        r"rank (\d+)/4 \(local \d+, restart 0\): sum=10 expected=10 peer \d+ value=\d+ OK", out))
    torch_ok = sorted(int(m.group(1)) for m in re.finditer(
        r"allreduce ok rank=(\d+) attempt=0 sum=10(?!\d)", out))
    if native != [0, 1, 2, 3]:
        failures.append(f"native OK lines from ranks {native}, want 0-3")
    if torch_ok != [0, 1, 2, 3]:
        failures.append(f"torch 2.6 all_reduce lines from ranks {torch_ok}, want 0-3")
    left = leftovers(f"TMPDIR={scratch}".encode() + b"\0")
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        failures.append(f"processes left behind: {left}")
    shutil.rmtree(scratch, ignore_errors=True)
    if failures:
        sys.exit("FAIL: " + "; ".join(failures))
    print("PASS: the worker library and torch 2.6 shared the agent store in every rank")


if __name__ == "__main__":
    main()
