#!/usr/bin/env python3
"""--nccl-id comm-id end to end: workers see NCCL_COMM_ID=<rank-0 address>:<port>, the same on
every rank of an attempt, a new port after a restart, and no DDPRUN_NCCL_UNIQUE_ID.

    test_comm_id.py single     one node (--standalone), 2 workers, one restart
    test_comm_id.py multinode  3 agents on 127.0.0.2/.3/.4 x 2 workers against ddprun-rdzvd, one restart

Bounded (internal deadlines below the ctest TIMEOUT); kills what it started in `finally`.
"""
import glob
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

BIN = os.path.abspath(os.environ["DDPRUN_BIN_DIR"])
DDPRUN = os.path.join(BIN, "ddprun")
RDZVD = os.path.join(BIN, "ddprun-rdzvd")
WORKER = os.path.join(os.environ["DDPRUN_SOURCE_DIR"], "tests", "gpu", "binding_worker.py")
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
ADDRS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
FAST_CONF = "last_call_timeout=0.5,heartbeat_interval=0.2,missed_heartbeats=3,join_timeout=20,read_timeout=20"


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


def reports(out):
    got = []
    for path in glob.glob(os.path.join(out, "w_*.json")):
        with open(path) as f:
            got.append(json.load(f))
    return got


def check_attempt(envs, attempt, world, logs):
    mine = [e for e in envs if e["TORCHELASTIC_RESTART_COUNT"] == str(attempt)]
    check(sorted(int(e["RANK"]) for e in mine) == list(range(world)),
          "attempt %d: ranks %s\n%s" % (attempt, sorted(e["RANK"] for e in mine), logs))
    values = {e["NCCL_COMM_ID"] for e in mine}
    check(len(values) == 1, "attempt %d: the workers got different NCCL_COMM_IDs: %s" % (attempt, values))
    (value,) = values
    check(value is not None, "attempt %d: NCCL_COMM_ID is not set\n%s" % (attempt, logs))
    host, _, port = value.rpartition(":")
    masters = {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in mine}
    check(len(masters) == 1, "MASTER differs: %s" % masters)
    ((master_addr, master_port),) = masters
    check(host == master_addr, "attempt %d: NCCL_COMM_ID host %r is not MASTER_ADDR %r" % (attempt, host, master_addr))
    check(port.isdigit() and 0 < int(port) < 65536 and port != master_port,
          "attempt %d: bad port in NCCL_COMM_ID=%s (MASTER_PORT %s)" % (attempt, value, master_port))
    check({e["DDPRUN_NCCL_UNIQUE_ID"] for e in mine} == {None}, "DDPRUN_NCCL_UNIQUE_ID set in comm-id mode")
    return value


def base_env(d):
    env = dict(os.environ)
    env.update({"PYTHON_EXEC": PYTHON, "TMPDIR": d, "DDPRUN_LOG_LEVEL": "info"})
    env.pop("DDPRUN_RDZV_TOKEN", None)
    return env


def single(d):
    out = os.path.join(d, "out")
    os.mkdir(out)
    p = subprocess.run([DDPRUN, "--standalone", "--nproc-per-node", "2", "--nccl-id", "comm-id", "--max-restarts", "1",
                        WORKER, out, "--fail-rank", "1"], env=base_env(d), capture_output=True, text=True, timeout=60)
    check(p.returncode == 0, "ddprun exited %d:\n%s" % (p.returncode, p.stderr))
    envs = reports(out)
    first = check_attempt(envs, 0, 2, p.stderr)
    second = check_attempt(envs, 1, 2, p.stderr)
    check(first.startswith("127.0.0.1:"), "single node: NCCL_COMM_ID=%s is not on 127.0.0.1" % first)
    check(first != second, "the restart reused NCCL_COMM_ID=%s" % first)


def read_line(proc, timeout):
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n") and time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            break
        chunk = os.read(fd, 1)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace")


def multinode(d):
    out = os.path.join(d, "out")
    os.mkdir(out)
    marker = "ddprun-commid-" + uuid.uuid4().hex[:10]
    env = base_env(d)
    procs = []
    logs = []
    try:
        daemon = subprocess.Popen([RDZVD, "--host", "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, env=env)
        procs.append(daemon)
        line = read_line(daemon, 10)
        check(line.startswith("listening on "), "daemon did not start: %r" % line)
        ep = "127.0.0.1:" + line.strip().rsplit(":", 1)[1]
        for a in ADDRS:
            log = os.path.join(d, "agent-%s.log" % a)
            logs.append(log)
            procs.append(subprocess.Popen(
                [DDPRUN, "--nnodes", "3:3", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", ep,
                 "--rdzv-id", marker, "--local-addr", a, "--max-restarts", "1", "--rdzv-conf", FAST_CONF,
                 "--shutdown-timeout", "3", "--nccl-id", "comm-id", WORKER, out, "--fail-rank", "3"],
                stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, cwd=d))
        deadline = time.monotonic() + 60
        codes = []
        for p in procs[1:]:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        text = "".join("--- %s ---\n%s" % (l, open(l, errors="replace").read()[-3000:]) for l in logs)
        check(codes == [0, 0, 0], "agent exit codes %s\n%s" % (codes, text))
        envs = reports(out)
        first = check_attempt(envs, 0, 6, text)
        second = check_attempt(envs, 1, 6, text)
        check(first.rpartition(":")[0] in ADDRS, "NCCL_COMM_ID=%s is not on a node's address" % first)
        check(first != second, "the restart reused NCCL_COMM_ID=%s" % first)
        check("ddprun-nccl-id" not in text, "a holder ran in comm-id mode")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def main():
    scenario = sys.argv[1]
    d = tempfile.mkdtemp(prefix="ddprun-commid-")
    try:
        {"single": single, "multinode": multinode}[scenario](d)
    except Failure as e:
        print("FAIL:", e)
        return 1
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print("PASS", scenario)
    return 0


if __name__ == "__main__":
    sys.exit(main())
