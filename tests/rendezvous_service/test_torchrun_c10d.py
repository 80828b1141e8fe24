"""torchrun 1.13 agents use ddprun-rdzvd as their c10d rendezvous endpoint.

ddprun-rdzvd stays a plain TCPStore next to its native rendezvous, so two stock torchrun agents
(--rdzv_backend c10d, --rdzv_conf is_host=0 so neither hosts its own store) run their
compare-and-set rendezvous, keep-alives and exit barrier on it and must both exit 0. The daemon's
readiness comes from its `listening on HOST:PORT` line; everything is killed on the way out.
"""
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

BIN_DIR = os.environ.get("DDPRUN_BIN_DIR", "")
SOURCE_DIR = os.environ.get("DDPRUN_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
DEADLINE_S = 120

children = []


def kill_all():
    for p in children:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in children:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def spawn(cmd, **kw):
    p = subprocess.Popen(cmd, start_new_session=True, **kw)
    children.append(p)
    return p


def read_line(proc, timeout):
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(f"FAIL: no readiness line from ddprun-rdzvd within {timeout} s (have {buf!r})")
        r, _, _ = select.select([fd], [], [], left)
        if r:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise SystemExit(f"FAIL: ddprun-rdzvd exited before it was ready (have {buf!r})")
            buf += chunk
    return buf.split(b"\n", 1)[0].decode()


def main():
    daemon_path = os.path.join(BIN_DIR, "ddprun-rdzvd")
    if not os.access(daemon_path, os.X_OK):
        raise SystemExit(f"FAIL: {daemon_path} is missing: build ddprun-rdzvd first")
    daemon = spawn([daemon_path, "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"],
                   stdout=subprocess.PIPE)
    line = read_line(daemon, 30)
    prefix = "listening on 127.0.0.1:"
    assert line.startswith(prefix), line
    port = int(line[len(prefix):])

    torchrun = os.path.join(SOURCE_DIR, "bench", "launch", "torchrun_fixed.py")
    cmd = [PYTHON, torchrun, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "t1", "--rdzv_conf", "is_host=0",
           "--max_restarts", "0", "--monitor_interval", "0.1", "--no_python", "/bin/true"]
    # torchrun writes its log directories under TMPDIR: keep them in a directory of ours.
    scratch = tempfile.TemporaryDirectory(prefix="ddprun-torchrun-c10d-")
    env = dict(os.environ, LOGLEVEL="WARNING", OMP_NUM_THREADS="1", TMPDIR=scratch.name)
    agents = [spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) for _ in range(2)]
    deadline = time.monotonic() + DEADLINE_S
    outputs = []
    for i, a in enumerate(agents):
        try:
            out, _ = a.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_all()
            raise SystemExit(f"FAIL: torchrun agent {i} did not finish within {DEADLINE_S} s")
        outputs.append(out.decode(errors="replace"))
        if a.returncode != 0:
            print(outputs[-1])
            raise SystemExit(f"FAIL: torchrun agent {i} exited with {a.returncode}")
    if daemon.poll() is not None:
        raise SystemExit(f"FAIL: ddprun-rdzvd died during the run (exit {daemon.returncode})")
    daemon.send_signal(signal.SIGTERM)
    rc = daemon.wait(timeout=10)
    assert rc == 0, f"ddprun-rdzvd exited {rc} on SIGTERM"
    print("OK: two torchrun 1.13 agents completed a c10d rendezvous on ddprun-rdzvd")


if __name__ == "__main__":
    try:
        main()
    finally:
        kill_all()
