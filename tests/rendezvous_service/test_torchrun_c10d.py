"""torchrun 1.13 agents use ddprun-rdzvd as their c10d rendezvous endpoint.

ddprun-rdzvd stays a plain TCPStore next to its native rendezvous, so two stock torchrun agents
(--rdzv_backend c10d, --rdzv_conf is_host=0 so neither hosts its own store) run their
compare-and-set rendezvous, keep-alives and exit barrier on it and must both exit 0. The daemon's
readiness comes from its `listening on HOST:PORT` line; everything is killed on the way out, and
no process of the run may be left behind.

Under tests/torch2 (DDPRUN_TORCH2_VERSION set) the agents are torchrun 2.6 (scripts/torch2/torchrun2)
and their workers a real gloo all_reduce (tests/single_node/ddp_gloo_worker.py): torch 2.6's c10d
handler makes the rendezvous store the agent store, so the workers' init_process_group(env://)
runs over ddprun-rdzvd too.
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

    torch2 = os.environ.get("DDPRUN_TORCH2_VERSION")
    if torch2:
        torchrun = [os.environ.get("DDPRUN_TORCHRUN2") or os.path.join(SOURCE_DIR, "scripts", "torch2", "torchrun2")]
        program = [os.path.join(SOURCE_DIR, "tests", "single_node", "ddp_gloo_worker.py")]
    else:
        torchrun = [PYTHON, os.path.join(SOURCE_DIR, "bench", "launch", "torchrun_fixed.py")]
        program = ["--no_python", "/bin/true"]
    cmd = torchrun + ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                      "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "t1", "--rdzv_conf", "is_host=0",
                      "--max_restarts", "0", "--monitor_interval", "0.1"] + program
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
    if torch2:
        joined = "\n".join(outputs)
        for rank in (0, 1):
            if f"allreduce ok rank={rank} attempt=0 sum=3" not in joined:
                raise SystemExit(f"FAIL: no all_reduce result from rank {rank}:\n{joined}")
    if daemon.poll() is not None:
        raise SystemExit(f"FAIL: ddprun-rdzvd died during the run (exit {daemon.returncode})")
    daemon.send_signal(signal.SIGTERM)
    rc = daemon.wait(timeout=10)
    assert rc == 0, f"ddprun-rdzvd exited {rc} on SIGTERM"
    left = leftovers(f"TMPDIR={scratch.name}".encode())
    if left:
        raise SystemExit(f"FAIL: processes of the run left behind: {left}")
    which = f"torchrun {torch2} agents (and their gloo workers)" if torch2 else "torchrun 1.13 agents"
    print(f"OK: two {which} completed a c10d rendezvous on ddprun-rdzvd")


def leftovers(needle):
    """Live processes whose environment holds `needle` (every child of the agents inherits it)."""
    found = []
    deadline = time.monotonic() + 5
    while True:
        found = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if needle + b"\0" not in f.read():
                        continue
                with open(f"/proc/{d}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    found.append((int(d), f.read().replace(b"\0", b" ").decode(errors="replace")))
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


if __name__ == "__main__":
    try:
        main()
    finally:
        kill_all()
