#!/usr/bin/env python3
"""Elastic multi-node jobs on one machine: agents bound to 127.0.0.2/.3/.4 (--local-addr), each
with --nproc-per-node 2, against a ddprun-rdzvd daemon or a rendezvous embedded in one agent.

    test_multinode.py SCENARIO [--backend c10d|etcd]

With --backend etcd the same scenarios run on --rdzv-backend etcd: "the daemon" is then a real
etcd member (etcd_cluster.py) the test starts on a free loopback port.

Every scenario is bounded (internal deadlines below the ctest TIMEOUT), kills everything it
started in `finally`, and then asserts that no process carrying the scenario's unique marker
(in the workers' argv, the agents' --rdzv-id, the daemon's --port-file, or the environment
variable DDPRUN_MN_MARKER that every child of the agents inherits, e.g. the ddprun-nccl-id
holders) is left: no orphans.
"""
import glob
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import etcd_cluster  # noqa: E402

BIN = os.environ["DDPRUN_BIN_DIR"]
SRC = os.environ["DDPRUN_SOURCE_DIR"]
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
DDPRUN = os.path.join(BIN, "ddprun")
RDZVD = os.path.join(BIN, "ddprun-rdzvd")
WORKER = os.path.join(SRC, "tests", "multinode", "mn_worker.py")
DDP_TRAIN = os.path.join(SRC, "examples", "ddp_train.py")
GLOO_WORKER = os.path.join(SRC, "tests", "single_node", "ddp_gloo_worker.py")
ADDRS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
# Fast timers: a lost node is noticed within 0.2 s x 3 = 0.6 s.
FAST_CONF = "last_call_timeout=0.5,heartbeat_interval=0.2,missed_heartbeats=3,join_timeout=20,read_timeout=20"


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


class Cluster:
    def __init__(self, name, backend="c10d"):
        self.backend = backend
        self.etcd = None
        self.marker = "ddprun-mn-%s-%s" % (name, uuid.uuid4().hex[:10])
        self.dir = tempfile.mkdtemp(prefix=self.marker + "_")
        self.out = os.path.join(self.dir, "out")
        os.mkdir(self.out)
        self.agents = {}  # addr -> (Popen, log path)
        self.daemon = None
        self.daemon_port = None
        self.env = dict(os.environ)
        self.env["PYTHON_EXEC"] = PYTHON
        self.env.pop("DDPRUN_RDZV_TOKEN", None)
        self.env["DDPRUN_LOG_LEVEL"] = "info"
        self.env["TMPDIR"] = self.dir  # the agents' log directories land here and go with it
        self.env["DDPRUN_MN_MARKER"] = self.marker  # inherited by everything the agents start

    # ---- processes ----

    def start_daemon(self, port=0, token=None, extra=()):
        if self.backend == "etcd":
            check(port == 0 and token is None, "the etcd backend has no daemon port or token")
            self.etcd = etcd_cluster.EtcdCluster(self.dir, self.env)
            return self.etcd.members[0].client_port
        args = [RDZVD, "--host", "127.0.0.1", "--port", str(port), "--port-file",
                os.path.join(self.dir, "port-" + self.marker)] + list(extra)
        env = dict(self.env)
        if token:
            env["DDPRUN_RDZV_TOKEN"] = token  # never on a command line
        log = open(os.path.join(self.dir, "daemon.log"), "ab")
        self.daemon = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, env=env)
        line = self._read_line(self.daemon, 10)
        check(line.startswith("listening on "), "daemon did not start: %r" % line)
        self.daemon_port = int(line.strip().rsplit(":", 1)[1])
        return self.daemon_port

    @staticmethod
    def _read_line(proc, timeout):
        fd = proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + timeout
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            check(left > 0, "timed out waiting for a line from pid %d" % proc.pid)
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1)
                if not chunk:
                    break
                buf += chunk
        return buf.decode()

    def start_agent(self, addr, endpoint, nnodes="3:3", max_restarts=0, conf=FAST_CONF, worker_args=(),
                    program=None, extra=(), env=None, nproc="2", name=None, run_id=None, local_addr=True):
        """`name` keys the agent (default: its address; several agents on one address need one).
        local_addr=False: no --local-addr (the agent picks its address towards the endpoint)."""
        name = name or addr
        log_path = os.path.join(self.dir, "agent-%s.log" % name)
        log = open(log_path, "ab")
        args = [DDPRUN, "--nnodes", nnodes, "--nproc-per-node", nproc, "--rdzv-backend", self.backend,
                "--rdzv-endpoint", endpoint, "--rdzv-id", run_id or self.marker]
        args += ["--local-addr", addr] if local_addr else []
        args += ["--max-restarts", str(max_restarts), "--rdzv-conf", conf, "--shutdown-timeout", "3"]
        args += list(extra)
        if program is None:
            args += [WORKER, self.marker, "--out", self.out] + list(worker_args)
        else:
            args += list(program)
        e = dict(self.env)
        if env:
            e.update(env)
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=e, cwd=self.dir)
        self.agents[name] = (p, log_path)
        return p

    def log(self, addr):
        with open(self.agents[addr][1], errors="replace") as f:
            return f.read()

    def wait_agents(self, timeout, addrs=None):
        deadline = time.monotonic() + timeout
        codes = {}
        for addr in (addrs or list(self.agents)):
            p = self.agents[addr][0]
            try:
                codes[addr] = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise Failure("agent %s did not exit within %s s; log:\n%s" % (addr, timeout, self.log(addr)))
        return codes

    # ---- worker env files ----

    def envs(self):
        out = []
        for path in glob.glob(os.path.join(self.out, "env_*.json")):
            with open(path) as f:
                out.append(json.load(f))
        return out

    def wait_envs(self, pred, count, timeout, what):
        deadline = time.monotonic() + timeout
        while True:
            got = [e for e in self.envs() if pred(e)]
            if len(got) >= count:
                return got
            if time.monotonic() > deadline:
                raise Failure("timed out waiting for %s: %d/%d worker env files; logs:\n%s" %
                              (what, len(got), count, self.all_logs()))
            time.sleep(0.05)

    def all_logs(self):
        return "\n".join("--- %s ---\n%s" % (a, self.log(a)[-3000:]) for a in self.agents)

    # ---- cleanup ----

    def kill_all(self):
        for p, _ in self.agents.values():
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                except ProcessLookupError:
                    pass
        for p, _ in self.agents.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if self.daemon and self.daemon.poll() is None:
            self.daemon.kill()
            self.daemon.wait(10)
        if self.etcd:
            self.etcd.kill_all()

    def status_args(self):
        """`ddprun status` arguments naming the backend."""
        return ["--rdzv-backend", "etcd"] if self.backend == "etcd" else []

    def marker_processes(self, comm=None):
        """(pid, cmdline) of live processes with the marker in argv or environment; `comm`: only
        processes with that name."""
        found = []
        env_marker = b"DDPRUN_MN_MARKER=" + self.marker.encode() + b"\0"
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                with open("/proc/%s/cmdline" % d, "rb") as f:
                    cmd = f.read()
                with open("/proc/%s/stat" % d) as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                with open("/proc/%s/comm" % d) as f:
                    name = f.read().strip()
            except OSError:
                continue
            try:
                with open("/proc/%s/environ" % d, "rb") as f:
                    environ = f.read()
            except OSError:
                environ = b""
            if comm is not None and name != comm:
                continue
            if (self.marker.encode() in cmd or env_marker in environ) and state != "Z":
                found.append((int(d), cmd.replace(b"\0", b" ").decode(errors="replace")))
        return found

    def assert_no_orphans(self):
        # Workers die with their agent (PDEATHSIG); give the kernel a moment to deliver it.
        deadline = time.monotonic() + 5
        left = self.marker_processes()
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = self.marker_processes()
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        check(not left, "orphan processes left behind: %s" % left)


def free_port(host):
    s = socket.socket()
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def check_world(envs, world, nodes):
    ranks = sorted(int(e["RANK"]) for e in envs)
    check(ranks == list(range(world)), "ranks %s != 0..%d" % (ranks, world - 1))
    check({e["WORLD_SIZE"] for e in envs} == {str(world)}, "WORLD_SIZE %s" % {e["WORLD_SIZE"] for e in envs})
    check({e["GROUP_WORLD_SIZE"] for e in envs} == {str(nodes)}, "GROUP_WORLD_SIZE")
    masters = {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}
    check(len(masters) == 1, "MASTER differs between workers: %s" % masters)
    check({e["TORCHELASTIC_USE_AGENT_STORE"] for e in envs} == {"True"}, "TORCHELASTIC_USE_AGENT_STORE")
    check(sorted({e["GROUP_RANK"] for e in envs}) == [str(i) for i in range(nodes)], "GROUP_RANK")
    for e in envs:
        check(int(e["RANK"]) == int(e["GROUP_RANK"]) * 2 + int(e["LOCAL_RANK"]), "RANK/GROUP_RANK mismatch %s" % e)
    # tests/torch2 runs these scenarios with PYTHON_EXEC=python3-torch2: the workers must have
    # run the torch 2.x root's Python, not the host's.
    want = os.environ.get("DDPRUN_TORCH2_PY_VERSION")
    if want:
        check({e.get("python") for e in envs} == {want}, "worker Python %s, want the torch 2.x root's %s"
              % ({e.get("python") for e in envs}, want))


# ---------------------------------------------------------------- scenarios


def env_daemon(c):
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    go = os.path.join(c.dir, "go")
    for a in ADDRS:
        c.start_agent(a, ep, worker_args=["--wait-file", go, "--sleep", "30"])
    envs = c.wait_envs(lambda e: True, 6, 30, "6 workers")
    check_world(envs, 6, 3)
    check({e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"0"}, "restart count")
    check({e["TORCHELASTIC_RUN_ID"] for e in envs} == {c.marker}, "run id")
    # ddprun status shows the running job and its members.
    st = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", ep, "--rdzv-id", c.marker] + c.status_args(),
                        capture_output=True, text=True, timeout=20)
    check(st.returncode == 0, "ddprun status failed: %s %s" % (st.stdout, st.stderr))
    check("job '%s': running" % c.marker in st.stdout, "status output: %s" % st.stdout)
    for a in ADDRS:
        check(a in st.stdout, "status lacks %s: %s" % (a, st.stdout))
    open(go, "w").close()
    codes = c.wait_agents(30)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))


def env_embedded(c):
    # The endpoint is the first agent's own address. Port 0 cannot be shared by name in
    # advance, so the test binds and releases a free port on 127.0.0.2 (nobody else binds that
    # address). It is an address of this machine, so each agent may host it, as with torchrun,
    # whatever its --local-addr: the first to bind hosts, the others join it.
    port = free_port("127.0.0.2")
    ep = "127.0.0.2:%d" % port
    go = os.path.join(c.dir, "go")
    for a in ADDRS:
        c.start_agent(a, ep, worker_args=["--wait-file", go, "--sleep", "30"])
    envs = c.wait_envs(lambda e: True, 6, 30, "6 workers")
    check_world(envs, 6, 3)
    hosts = [a for a in ADDRS if "this agent hosts it" in c.log(a)]
    check(len(hosts) == 1, "want one host, got %s:\n%s" % (hosts, c.all_logs()))
    st = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", ep], capture_output=True, text=True, timeout=20)
    check(st.returncode == 0 and c.marker in st.stdout, "status: %s %s" % (st.stdout, st.stderr))
    open(go, "w").close()
    codes = c.wait_agents(30)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))


def ddp(c):
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    for a in ADDRS:
        c.start_agent(a, ep, program=[DDP_TRAIN, "--epochs", "1"], extra=["--tee", "3"])
    codes = c.wait_agents(150)
    logs = c.all_logs()
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, logs))
    check("all_reduce check passed: sum=21 expected=21 world_size=6" in logs, "no DDP check line:\n" + logs)


def store_opt_out(c):
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 of the workers hosts their store on the port
    # its agent reserved (and does not listen on), in both attempts; torch's env:// init and a
    # gloo all_reduce of 6 ranks over 3 nodes prove that it did.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    for a in ADDRS:
        c.start_agent(a, ep, max_restarts=1, program=[GLOO_WORKER, "fail-first"],
                      env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    codes = c.wait_agents(150)
    logs = c.all_logs()
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, logs))
    for rank in range(6):
        line = "allreduce ok rank=%d attempt=1 sum=21 agent_store=False" % rank
        check(line in logs, "no line %r:\n%s" % (line, logs))


def worker_failure_restart(c):
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    for a in ADDRS:
        c.start_agent(a, ep, max_restarts=1,
                      worker_args=["--fail-rank", "3", "--fail-attempt", "0", "--exit", "3", "--sleep", "1"])
    codes = c.wait_agents(60)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))
    second = [e for e in c.envs() if e["TORCHELASTIC_RESTART_COUNT"] == "1"]
    check_world(second, 6, 3)
    check(not [e for e in c.envs() if e["TORCHELASTIC_RESTART_COUNT"] not in ("0", "1")], "unexpected attempts")


def parent_pid(pid):
    with open("/proc/%d/stat" % pid) as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def listening_ports(pid):
    """TCP ports process `pid` listens on (its socket inodes matched against /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            link = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def bootstrap_port(hex_id):
    """The port of the bootstrap root an NCCL ID names (uint64 magic, then sockaddr_in/in6)."""
    raw = bytes.fromhex(hex_id)
    family = int.from_bytes(raw[8:10], "little")
    check(family in (socket.AF_INET, socket.AF_INET6), "NCCL ID with address family %d" % family)
    return int.from_bytes(raw[10:12], "big")


def nccl_ids(c):
    # --nccl-id env across 3 nodes x 2 workers: every node's holder offers IDs when it joins, the
    # rendezvous gives all of them the group-rank-0 node's; the other nodes stop their holders.
    # A worker failure restarts the job: a new round, new holders, a new ID shared by all 6.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    go = os.path.join(c.dir, "go")
    for a in ADDRS:
        c.start_agent(a, ep, max_restarts=1, extra=["--nccl-id", "env"], env={"NCCL_SOCKET_IFNAME": "lo"},
                      worker_args=["--wait-file", go, "--sleep", "30"])
    first = c.wait_envs(lambda e: e["TORCHELASTIC_RESTART_COUNT"] == "0", 6, 30, "round 0")
    check_world(first, 6, 3)
    # A worker failure once all 6 run: rank 3 is killed.
    os.kill([e["pid"] for e in first if e["RANK"] == "3"][0], signal.SIGKILL)
    second = c.wait_envs(lambda e: e["TORCHELASTIC_RESTART_COUNT"] == "1", 6, 40, "the restarted round")
    check_world(second, 6, 3)
    ids0 = {e["DDPRUN_NCCL_UNIQUE_ID"] for e in first}
    ids1 = {e["DDPRUN_NCCL_UNIQUE_ID"] for e in second}
    for ids, what in ((ids0, "round 0"), (ids1, "round 1")):
        check(len(ids) == 1, "%s: the workers got different NCCL IDs: %s" % (what, ids))
        (one,) = ids
        check(one is not None and len(one) == 256 and all(ch in "0123456789abcdef" for ch in one),
              "%s: DDPRUN_NCCL_UNIQUE_ID is not 256 lowercase hex: %r\n%s" % (what, one, c.all_logs()))
    check(ids0 != ids1, "the restart reused the NCCL ID %s" % ids0)
    check({e["DDPRUN_NCCL_UNIQUE_IDS"] for e in first + second} == {None}, "DDPRUN_NCCL_UNIQUE_IDS with one root")
    # Only the group-rank-0 node's holder still runs (its bootstrap root serves the round).
    holders = c.marker_processes(comm="ddprun-nccl-id")
    rank0_agent = [e["agent_pid"] for e in second if e["GROUP_RANK"] == "0"][0]
    check(len(holders) == 1, "want 1 holder (group rank 0's), found %s" % holders)
    check(parent_pid(holders[0][0]) == rank0_agent,
          "the holder's parent %d is not the group-rank-0 agent %d" % (parent_pid(holders[0][0]), rank0_agent))
    # ... and the round's ID names that holder's bootstrap root.
    (id1,) = ids1
    check(bootstrap_port(id1) in listening_ports(holders[0][0]),
          "the ID's root port %d is not one the holder listens on (%s)" %
          (bootstrap_port(id1), listening_ports(holders[0][0])))
    open(go, "w").close()
    codes = c.wait_agents(30)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))
    left = c.marker_processes(comm="ddprun-nccl-id")
    check(not left, "NCCL ID holders left after the job: %s" % left)


def budget_spent(c):
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    for a in ADDRS:
        c.start_agent(a, ep, max_restarts=0,
                      worker_args=["--fail-rank", "3", "--fail-attempt", "0", "--exit", "7", "--sleep", "30"])
    t0 = time.monotonic()
    codes = c.wait_agents(40)
    check(set(codes.values()) == {7}, "exit codes %s (want 7 everywhere)\n%s" % (codes, c.all_logs()))
    failing = [e for e in c.envs() if e["RANK"] == "3"]
    check(len(failing) == 1, "rank 3 ran %d times" % len(failing))
    agent_pid = failing[0]["agent_pid"]
    node = [a for a, (p, _) in c.agents.items() if p.pid == agent_pid]
    check(len(node) == 1, "cannot map rank 3 to its agent")
    for a in ADDRS:
        log = c.log(a)
        check("host       : %s" % node[0] in log, "summary on %s lacks the node %s:\n%s" % (a, node[0], log))
        check("rank       : 3 (local_rank: 1)" in log, "summary on %s lacks rank 3:\n%s" % (a, log))
        check("MnWorkerError: rank 3 failed on purpose" in log, "summary on %s lacks the error file message" % a)
        root = log[log.index("Root Cause (first observed failure):"):] if "Root Cause" in log else ""
        if a == node[0]:
            # The failing node has the rank's own report: its pid and the error file it wrote,
            # not only the message the rendezvous relayed.
            check("(pid: %d)" % failing[0]["pid"] in root and re.search(r"error_file : /\S+/error\.json", root),
                  "the failing node's root cause lacks the pid or the error file:\n%s" % log)
        else:
            check("(pid: on that node)" in root and "error_file : <N/A>" in root,
                  "root cause on %s:\n%s" % (a, log))
    check(time.monotonic() - t0 < 20, "stopping took too long")


def raised_without_error_file(c):
    # Rank 3 raises without torch's @record (no error file): every node's summary names what it
    # raised, as the agent's stacks hook recorded it (before, the other nodes had its exit code
    # only); its own node's diagnosis names it too.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    for a in ADDRS:
        c.start_agent(a, ep, max_restarts=0, worker_args=["--fail-rank", "3", "--raise", "--sleep", "30"])
    codes = c.wait_agents(40)
    check(set(codes.values()) == {1}, "exit codes %s (want 1 everywhere)\n%s" % (codes, c.all_logs()))
    failing = [e for e in c.envs() if e["RANK"] == "3"]
    node = [a for a, (p, _) in c.agents.items() if p.pid == failing[0]["agent_pid"]]
    check(len(node) == 1, "cannot map rank 3 to its agent")
    raised = "RuntimeError: MnWorkerError: rank 3 raised on purpose"
    for a in ADDRS:
        log = c.log(a)
        root = log[log.index("Root Cause (first observed failure):"):] if "Root Cause" in log else ""
        check("rank       : 3 (local_rank: 1)" in root, "summary on %s lacks rank 3:\n%s" % (a, log))
        if a == node[0]:
            check(re.search(r"rank 3 \(local 1, pid [0-9]+\): exit code 1: .*; raised " + re.escape(raised), log),
                  "the failing node's diagnosis does not name what rank 3 raised:\n%s" % log)
        else:
            check("message    : " + raised in root, "root cause on %s lacks what rank 3 raised:\n%s" % (a, log))


# A stand-in for torch's module, by name (the diagnosis tells a rank inside a collective by
# distributed_c10d.py in its stack): all_reduce waits on its peers, here for ever.
FAKE_C10D = """import os, time
def all_reduce(ready):
    open(ready, "w").close()
    time.sleep(120)
"""

# Rank 3 never enters all_reduce; rank 0 "times out" in it once every other rank is in place.
NEVER_ENTERS = """import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import distributed_c10d
rank, out = int(os.environ["RANK"]), sys.argv[1]
if rank == 3:
    open(os.path.join(out, "ready_3"), "w").close()
    time.sleep(120)
if rank != 0:
    distributed_c10d.all_reduce(os.path.join(out, "ready_%d" % rank))
deadline = time.monotonic() + 30
while not all(os.path.exists(os.path.join(out, "ready_%d" % r)) for r in (1, 2, 3)) and time.monotonic() < deadline:
    time.sleep(0.01)
raise RuntimeError("Timed out waiting 4000ms in all_reduce")
"""


def two_nodes_running(c, name, text):
    # A daemon and two agents of 2 ranks each running the Python program `text` (saved as `name`
    # in the test's directory) with the output directory as its argument; their exit codes.
    script = os.path.join(c.dir, name)
    with open(script, "w") as f:
        f.write(text)
    ep = "127.0.0.1:%d" % c.start_daemon()
    for a in ADDRS[:2]:
        c.start_agent(a, ep, nnodes="2:2", program=[script, c.out])
    return c.wait_agents(60)


def remote_culprit_stacks(c):
    # The culprit runs on the node where no rank failed: that node takes its ranks' stacks when
    # the job fails elsewhere and names rank 3 (before, no node took its stack: the failing node
    # saw only ranks inside the collective, the other one failed no rank of its own).
    with open(os.path.join(c.dir, "distributed_c10d.py"), "w") as f:
        f.write(FAKE_C10D)
    codes = two_nodes_running(c, "never_enters.py", NEVER_ENTERS)
    check(set(codes.values()) == {1}, "exit codes %s (want 1 everywhere)\n%s" % (codes, c.all_logs()))
    want = "culprit    : rank 3 never entered the collective the others wait in: it was in <module> at never_enters.py:"
    named = [a for a in ADDRS[:2] if want in c.log(a)]
    check(len(named) == 1, "want rank 3 named on one node, found %s:\n%s" % (named, c.all_logs()))
    log = c.log(named[0])
    check(log.index(want) < log.index("Root Cause (first observed failure):"),
          "the block follows the summary on %s:\n%s" % (named[0], log))
    check(re.search(r"rank 2 \(local 0, pid [0-9]+\): in a collective, in all_reduce at distributed_c10d\.py:4", log),
          "rank 2's line on %s:\n%s" % (named[0], log))


SLOW_STACKS = """import os, signal, sys, time
rank, out = int(os.environ["RANK"]), sys.argv[1]
def path(name):
    return os.path.join(out, name)
def wait_for(name):
    deadline = time.monotonic() + 30
    while not os.path.exists(path(name)) and time.monotonic() < deadline:
        time.sleep(0.005)
if rank == 1:
    # Its stacks come late: the stacks signal stays pending, and the agent waits its whole bound.
    signal.pthread_sigmask(signal.SIG_BLOCK, [int(os.environ.get("DDPRUN_STACKS_SIGNAL", "61"))])
open(path("ready_%d" % rank), "w").close()
if rank == 0:
    for r in (1, 2, 3):
        wait_for("ready_%d" % r)
    open(path("failed_0"), "w").close()
    sys.exit(3)
if rank == 2:
    wait_for("failed_0")
    time.sleep(1.0)
    sys.exit(5)
time.sleep(120)
"""


def victim_not_named(c):
    # Rank 0 fails (exit 3); rank 2, on the other node, fails because of it a second later (exit 5,
    # as a connection reset would). Rank 0's node takes its survivors' stacks, which rank 1 makes
    # slow (2 s). Before, that node reported rank 0 only after the stacks: meanwhile rank 2's
    # report could come first and name rank 2 the root cause, or (with this test's 0.6 s leases)
    # the node's heartbeats stopped and the rendezvous dropped it as lost, starting a round 1.
    codes = two_nodes_running(c, "slow_stacks.py", SLOW_STACKS)
    check(set(codes.values()) == {3}, "exit codes %s (want 3 everywhere)\n%s" % (codes, c.all_logs()))
    for a in ADDRS[:2]:
        log = c.log(a)
        root = log.partition("Root Cause (first observed failure):")[2]
        check("rank       : 0 (local_rank: 0)" in root, "root cause on %s is not rank 0:\n%s" % (a, log))
        check("round 1:" not in log and "is not a member of rendezvous" not in log,
              "the failing round was not the last one on %s:\n%s" % (a, log))


def summary_lists_failed_ranks(c):
    # Rank 3 fails first (exit 7); rank 2, on the same node, ignores the teardown's SIGTERM and
    # exits 5 by itself. That node's summary lists rank 2 under "Failures:" and rank 3 as the
    # root cause; the other nodes' ranks were ended by the teardown and are not listed.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    for a in ADDRS:
        c.start_agent(a, ep, max_restarts=0,
                      worker_args=["--fail-rank", "3", "--exit", "7", "--second-fail-rank", "2", "--second-exit", "5",
                                   "--sleep", "30"])
    codes = c.wait_agents(40)
    check(set(codes.values()) == {7}, "exit codes %s (want 7 everywhere)\n%s" % (codes, c.all_logs()))
    failing = [e for e in c.envs() if e["RANK"] == "3"]
    agent_pid = failing[0]["agent_pid"]
    (node,) = [a for a, (p, _) in c.agents.items() if p.pid == agent_pid]
    for a in ADDRS:
        log = c.log(a)
        summary = log[log.index("FAILED\n"):] if "FAILED\n" in log else ""
        failures, _, root = summary.partition("Root Cause (first observed failure):")
        check("rank       : 3 (local_rank: 1)" in root, "root cause on %s is not rank 3:\n%s" % (a, log))
        if a == node:
            check("[1]:" in failures and "rank       : 2 (local_rank: 0)" in failures and
                  "exitcode   : 5" in failures and "host       : %s" % node in failures,
                  "the failing node's summary does not list rank 2:\n%s" % log)
            # Its diagnosis, printed at rank 3's failure while rank 2 still ran, is amended once
            # rank 2 ends on its own, before the summary.
            first = re.search(r"Diagnosis \(([^)]+)\): rank 3 failed first", log)
            amended = "Diagnosis (%s), amended as more ranks ended:\n" % (first.group(1) if first else "?")
            check(first and amended in log and first.start() < log.index(amended) < log.index("FAILED\n"),
                  "no amendment of the diagnosis between it and the summary:\n%s" % log)
            check(re.search(r"amended as more ranks ended:\n  rank 2 \(local 0, pid \d+\): failed on its own after "
                            r"the first failure \(exit code 5\); its stack a moment before: ", log),
                  "rank 2's amended line:\n%s" % log)
        else:
            check("<NO_OTHER_FAILURES>" in failures, "summary on %s lists ranks the teardown ended:\n%s" % (a, log))


def shrink(c, how):
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    for a in ADDRS:
        c.start_agent(a, ep, nnodes="2:3", worker_args=["--exit-when-world", "4", "--sleep", "60"])
    c.wait_envs(lambda e: e["WORLD_SIZE"] == "6", 6, 30, "the 3-node round")
    victim = c.agents["127.0.0.4"][0]
    t0 = time.monotonic()
    victim.send_signal(how)
    envs = c.wait_envs(lambda e: e["WORLD_SIZE"] == "4", 4, 20, "the 2-node round")
    elapsed = time.monotonic() - t0
    check_world(envs, 4, 2)
    check({e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"0"}, "membership change used a restart")
    codes = c.wait_agents(30, ["127.0.0.2", "127.0.0.3"])
    check(set(codes.values()) == {0}, "survivors' exit codes %s\n%s" % (codes, c.all_logs()))
    # c10d: lease = 0.2 s x 3 plus one last call (0.5 s) and worker start: well under 5 s.
    # etcd: the node's lease has etcd's minimum TTL (2 s) and etcd checks expiry every 0.5 s.
    limit = 8 if c.backend == "etcd" else 5
    check(elapsed < limit, "shrink took %.1f s" % elapsed)
    if how == signal.SIGSTOP:
        victim.send_signal(signal.SIGCONT)
        victim.kill()
    victim.wait(10)


def agent_kill(c):
    shrink(c, signal.SIGKILL)


def agent_stop(c):
    shrink(c, signal.SIGSTOP)


def spare(c):
    # torch's redundancy list: a node beyond --nnodes MAX waits as a spare, and takes the place
    # (and the group rank) of a node that is lost, without a restart of the budget.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    go = os.path.join(c.dir, "go")
    args = ["--wait-file", go, "--sleep", "60"]
    for a in ADDRS[:2]:
        c.start_agent(a, ep, nnodes="2:2", worker_args=args)
    c.wait_envs(lambda e: e["WORLD_SIZE"] == "4", 4, 30, "the 2-node round")
    standby = c.start_agent(ADDRS[2], ep, nnodes="2:2", worker_args=args)
    deadline = time.monotonic() + 20
    while "waiting as a spare node" not in c.log(ADDRS[2]):
        check(standby.poll() is None and time.monotonic() < deadline,
              "the third agent did not wait as a spare:\n%s" % c.all_logs())
        time.sleep(0.05)
    check(not [e for e in c.envs() if e["agent_pid"] == standby.pid], "the spare started workers while full")
    victim = c.agents[ADDRS[1]][0]
    lost_rank = {e["GROUP_RANK"] for e in c.envs() if e["agent_pid"] == victim.pid}
    victim.kill()
    envs = c.wait_envs(lambda e: e["agent_pid"] == standby.pid, 2, 20, "the spare's workers")
    check({e["WORLD_SIZE"] for e in envs} == {"4"}, "WORLD_SIZE %s" % {e["WORLD_SIZE"] for e in envs})
    check({e["GROUP_RANK"] for e in envs} == lost_rank,
          "the spare did not take the lost node's group rank %s: %s" % (lost_rank, envs))
    check({e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"0"}, "taking a lost node's place used a restart")
    open(go, "w").close()
    codes = c.wait_agents(30, [ADDRS[0], ADDRS[2]])
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))
    victim.wait(10)


def grow(c):
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    for a in ADDRS[:2]:
        c.start_agent(a, ep, nnodes="2:3", worker_args=["--exit-when-world", "6", "--sleep", "60"])
    c.wait_envs(lambda e: e["WORLD_SIZE"] == "4", 4, 30, "the 2-node round")
    progress = "waiting for nodes: 2/2 joined (min 2, max 3), last call in"
    check(any(progress in c.log(a) for a in ADDRS[:2]), "no progress line %r:\n%s" % (progress, c.all_logs()))
    c.start_agent(ADDRS[2], ep, nnodes="2:3", worker_args=["--exit-when-world", "6", "--sleep", "60"])
    envs = c.wait_envs(lambda e: e["WORLD_SIZE"] == "6", 6, 30, "the 3-node round")
    check_world(envs, 6, 3)
    check({e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"0"}, "membership change used a restart")
    # torchrun's layout, attempt_<restart count>/<local rank>: the first round of the two nodes
    # in attempt_0, the round the membership change started (no restart) in attempt_0.1.
    def attempt_dir(e):
        return os.path.basename(os.path.dirname(os.path.dirname(e["TORCHELASTIC_ERROR_FILE"])))
    first = [e for e in c.envs() if e["WORLD_SIZE"] == "4"]
    check({attempt_dir(e) for e in first} == {"attempt_0"}, "first round: %s" % [attempt_dir(e) for e in first])
    later = {attempt_dir(e) for e in envs if e["agent_pid"] != c.agents[ADDRS[2]][0].pid}
    check(later == {"attempt_0.1"}, "after the membership change: %s" % later)
    codes = c.wait_agents(30)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))


def daemon_restart(c):
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    go = os.path.join(c.dir, "go")
    # With NCCL IDs: the rebuilt round keeps the assignment's ID (all ranks agree on it) and no
    # node starts a new holder while the round goes on.
    for a in ADDRS:
        c.start_agent(a, ep, worker_args=["--wait-file", go, "--sleep", "40"], extra=["--nccl-id", "env"],
                      env={"NCCL_SOCKET_IFNAME": "lo"})
    c.wait_envs(lambda e: True, 6, 30, "6 workers")
    holders = c.marker_processes(comm="ddprun-nccl-id")
    check(len(holders) == 1, "want 1 NCCL ID holder, found %s" % holders)
    c.daemon.kill()
    c.daemon.wait(10)
    time.sleep(1.0)  # the daemon stays away for a while (longer than the 0.6 s lease)
    c.start_daemon(port=port)
    # The job goes on: the agents re-register; the workers were never stopped.
    deadline = time.monotonic() + 20
    while True:
        st = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", ep, "--rdzv-id", c.marker],
                            capture_output=True, text=True, timeout=20)
        if st.returncode == 0 and "running" in st.stdout and all(a in st.stdout for a in ADDRS):
            break
        check(time.monotonic() < deadline, "the job was not rebuilt: %s %s\n%s" % (st.stdout, st.stderr, c.all_logs()))
        time.sleep(0.2)
    check(c.marker_processes(comm="ddprun-nccl-id") == holders,
          "the NCCL ID holders changed during the rebuild: %s -> %s" % (holders, c.marker_processes(comm="ddprun-nccl-id")))
    open(go, "w").close()
    codes = c.wait_agents(30)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))
    envs = c.envs()
    check(len(envs) == 6, "workers were restarted: %d env files" % len(envs))
    check(len({e["DDPRUN_NCCL_UNIQUE_ID"] for e in envs}) == 1, "different NCCL IDs in one round")


def daemon_restart_spare(c):
    # A daemon restart with a spare waiting, and the spare re-registering first (the participant's
    # agent is stopped meanwhile): the fresh job the spare makes must not close a round of its own
    # (with --nnodes 1 it alone would fill it); the participant, back within rebuild_grace,
    # rebuilds the running round, whose workers were never stopped, and the spare is a spare again.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    go = os.path.join(c.dir, "go")
    args = ["--wait-file", go, "--sleep", "40"]
    participant = c.start_agent(ADDRS[0], ep, nnodes="1:1", worker_args=args)
    c.wait_envs(lambda e: True, 2, 30, "2 workers")
    c.start_agent(ADDRS[1], ep, nnodes="1:1", worker_args=args)
    deadline = time.monotonic() + 20
    while "waiting as a spare node" not in c.log(ADDRS[1]):
        check(time.monotonic() < deadline, "no spare:\n%s" % c.all_logs())
        time.sleep(0.05)

    def roles():
        st = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", ep, "--rdzv-id", c.marker, "--json"],
                            capture_output=True, text=True, timeout=20)
        if st.returncode != 0:
            return None, {}
        jobs = json.loads(st.stdout)["jobs"]
        if not jobs:
            return None, {}
        return jobs[0]["state"], {m["addr"]: m["role"] for m in jobs[0]["members"]}

    participant.send_signal(signal.SIGSTOP)
    try:
        c.daemon.kill()
        c.daemon.wait(10)
        c.start_daemon(port=port)
        deadline = time.monotonic() + 20
        while True:
            state, got = roles()
            if ADDRS[1] in got:
                break
            check(time.monotonic() < deadline, "the spare did not re-register:\n%s" % c.all_logs())
            time.sleep(0.1)
        check((state, got) == ("waiting", {ADDRS[1]: "joined"}),
              "the spare's fresh job should wait for the participants: %s %s" % (state, got))
    finally:
        participant.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 20
    while roles() != ("running", {ADDRS[0]: "participant", ADDRS[1]: "spare"}):
        check(time.monotonic() < deadline, "the job was not rebuilt with its spare: %s\n%s" % (roles(), c.all_logs()))
        time.sleep(0.2)
    open(go, "w").close()
    codes = c.wait_agents(30)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))
    envs = c.envs()
    check(len(envs) == 2, "workers were restarted or the spare ran some: %d env files" % len(envs))


def token(c):
    port = c.start_daemon(token="s3cret")
    ep = "127.0.0.1:%d" % port
    c.start_agent(ADDRS[0], ep, nnodes="1:2", worker_args=["--sleep", "0"], env={"DDPRUN_RDZV_TOKEN": "wrong"})
    c.start_agent(ADDRS[1], ep, nnodes="1:2", worker_args=["--sleep", "0"])
    codes = c.wait_agents(20)
    for a in ADDRS[:2]:
        check(codes[a] == 1, "agent %s exit %s, want 1\n%s" % (a, codes[a], c.log(a)))
        log = c.log(a)
        check("refused" in log and "token" in log, "no clear token error on %s:\n%s" % (a, log))
    check(not c.envs(), "a refused agent started workers")
    # With the right token (DDPRUN_RDZV_TOKEN) the job runs.
    c.agents.clear()
    c.start_agent(ADDRS[2], ep, nnodes="1:1", worker_args=["--sleep", "0"], env={"DDPRUN_RDZV_TOKEN": "s3cret"})
    codes = c.wait_agents(20)
    check(codes[ADDRS[2]] == 0, "agent with the right token: %s\n%s" % (codes, c.all_logs()))
    envs = c.envs()
    check(envs and not any(e["token_seen"] for e in envs), "a worker inherited DDPRUN_RDZV_TOKEN: %s" % envs)


def token_rotation(c):
    # The token rotated by a daemon restart (a systemd unit's credential): the agents of the
    # running job still hold the old token and re-register with it, which the daemon accepts for
    # REJOINs from --previous-token-file; the job goes on, through a restart too (its agents
    # JOIN the next round on the connections they re-registered on). A new agent with the old
    # token cannot JOIN; `ddprun status` with the new token sees the job.
    def secret_file(name, value):
        path = os.path.join(c.dir, name)
        with open(path, "w") as f:
            f.write(value + "\n")
        os.chmod(path, 0o600)
        return path
    port = c.start_daemon(token="old-secret")
    ep = "127.0.0.1:%d" % port
    go = os.path.join(c.dir, "go")
    for a in ADDRS[:2]:
        c.start_agent(a, ep, nnodes="2:2", max_restarts=1, worker_args=["--wait-file", go, "--sleep", "40"],
                      env={"DDPRUN_RDZV_TOKEN": "old-secret"})
    first = c.wait_envs(lambda e: True, 4, 30, "4 workers")
    c.daemon.kill()
    c.daemon.wait(10)
    time.sleep(1.0)  # longer than the 0.6 s lease: the agents reconnect to the new daemon
    c.start_daemon(port=port, extra=["--token-file", secret_file("new-token", "new-secret"),
                                     "--previous-token-file", secret_file("old-token", "old-secret")])
    status_env = dict(c.env, DDPRUN_RDZV_TOKEN="new-secret")
    deadline = time.monotonic() + 20
    while True:
        st = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", ep, "--rdzv-id", c.marker],
                            capture_output=True, text=True, timeout=20, env=status_env)
        if st.returncode == 0 and "running" in st.stdout and all(a in st.stdout for a in ADDRS[:2]):
            break
        check(time.monotonic() < deadline, "the job was not rebuilt: %s %s\n%s" % (st.stdout, st.stderr, c.all_logs()))
        time.sleep(0.2)
    c.start_agent(ADDRS[2], ep, nnodes="1:1", run_id=c.marker + "-late", worker_args=["--sleep", "0"],
                  env={"DDPRUN_RDZV_TOKEN": "old-secret"})
    late = c.wait_agents(20, [ADDRS[2]])
    check(late[ADDRS[2]] == 1, "a new agent with the old token: exit %s\n%s" % (late, c.log(ADDRS[2])))
    check("a JOIN needs the current token" in c.log(ADDRS[2]), "no clear refusal:\n%s" % c.log(ADDRS[2]))
    # A worker dies: the group restarts, its agents joining the next round with the old token.
    os.kill(next(e["pid"] for e in first if e["RANK"] == "0"), signal.SIGKILL)
    c.wait_envs(lambda e: e["TORCHELASTIC_RESTART_COUNT"] == "1", 4, 30, "4 restarted workers")
    open(go, "w").close()
    codes = c.wait_agents(30, ADDRS[:2])
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))
    envs = c.envs()
    check(len(envs) == 8, "want 4 workers in each of 2 attempts, the late agent none: %d env files" % len(envs))


def static_backend(c):
    # torchrun's static backend across 3 nodes: node rank 0 hosts at --master-addr:--master-port,
    # GROUP_RANK = --node-rank, and a worker failure still restarts every node.
    port = free_port("127.0.0.2")
    procs = []
    # Start the non-zero ranks first: they wait for node rank 0 to serve.
    for rank in (2, 1, 0):
        a = ADDRS[rank]
        log = open(os.path.join(c.dir, "agent-%s.log" % a), "ab")
        args = [DDPRUN, "--nnodes", "3", "--nproc-per-node", "2", "--node-rank", str(rank), "--master-addr",
                "127.0.0.2", "--master-port", str(port), "--local-addr", a, "--rdzv-id", c.marker,
                "--max-restarts", "1", "--rdzv-conf", FAST_CONF, "--shutdown-timeout", "3",
                WORKER, c.marker, "--out", c.out, "--fail-rank", "5", "--fail-attempt", "0", "--exit", "2",
                "--sleep", "1"]
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=c.env, cwd=c.dir)
        c.agents[a] = (p, log.name)
    codes = c.wait_agents(60)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))
    envs = [e for e in c.envs() if e["TORCHELASTIC_RESTART_COUNT"] == "1"]
    check_world(envs, 6, 3)
    for e in envs:
        node = [a for a, (p, _) in c.agents.items() if p.pid == e["agent_pid"]][0]
        check(e["GROUP_RANK"] == str(ADDRS.index(node)), "GROUP_RANK %s on node %s" % (e["GROUP_RANK"], node))
    # MASTER_ADDR is the node running RANK 0 (node rank 0), in every round, whichever node joined
    # first (torchrun: "the host that is running worker with rank 0").
    for e in c.envs():
        check(e["MASTER_ADDR"] == ADDRS[0], "MASTER_ADDR %s for RANK %s" % (e["MASTER_ADDR"], e["RANK"]))


def exit_barrier(c):
    # One node's worker outlives exit_barrier_timeout after the others succeeded: the job fails
    # on every node with a named exit-barrier error and exit code 1.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    conf = FAST_CONF + ",exit_barrier_timeout=1"
    for a in ADDRS:
        c.start_agent(a, ep, conf=conf, worker_args=["--sleep", "0", "--slow-rank", "5", "--slow-sleep", "30"])
    codes = c.wait_agents(20)
    check(set(codes.values()) == {1}, "exit codes %s, want 1\n%s" % (codes, c.all_logs()))
    for a in ADDRS:
        check("exit barrier timed out" in c.log(a), "no exit-barrier error on %s:\n%s" % (a, c.log(a)))


def daemon_gone(c):
    # The daemon dies and stays away longer than read_timeout: every agent stops its workers and
    # exits 1 naming the endpoint.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    conf = FAST_CONF.replace("read_timeout=20", "read_timeout=2")
    for a in ADDRS:
        c.start_agent(a, ep, conf=conf, worker_args=["--sleep", "60"])
    c.wait_envs(lambda e: True, 6, 30, "6 workers")
    c.daemon.kill()
    c.daemon.wait(10)
    t0 = time.monotonic()
    codes = c.wait_agents(20)
    check(set(codes.values()) == {1}, "exit codes %s, want 1\n%s" % (codes, c.all_logs()))
    check(time.monotonic() - t0 < 10, "giving up took %.1f s" % (time.monotonic() - t0))
    for a in ADDRS:
        log = c.log(a)
        check("ddprun: error:" in log and ep in log, "no error naming %s on %s:\n%s" % (ep, a, log))


def below_min(c):
    # A lost node leaves fewer than min: the survivors wait for a replacement up to join_timeout,
    # then fail with a named error.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    conf = FAST_CONF.replace("join_timeout=20", "join_timeout=2")
    for a in ADDRS:
        c.start_agent(a, ep, nnodes="3:3", conf=conf, worker_args=["--sleep", "60"])
    c.wait_envs(lambda e: True, 6, 30, "6 workers")
    c.agents["127.0.0.4"][0].kill()
    codes = c.wait_agents(20, ["127.0.0.2", "127.0.0.3"])
    check(set(codes.values()) == {1}, "exit codes %s, want 1\n%s" % (codes, c.all_logs()))
    for a in ["127.0.0.2", "127.0.0.3"]:
        log = c.log(a)
        check("timed out" in log and "127.0.0.4" in log, "no named join-timeout error on %s:\n%s" % (a, log))


def agent_sigterm(c):
    # SIGTERM to one agent: it stops its workers, leaves, exits 143; the others go on smaller.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    for a in ADDRS:
        c.start_agent(a, ep, nnodes="2:3", worker_args=["--exit-when-world", "4", "--sleep", "60"])
    c.wait_envs(lambda e: e["WORLD_SIZE"] == "6", 6, 30, "the 3-node round")
    c.agents["127.0.0.4"][0].send_signal(signal.SIGTERM)
    codes = c.wait_agents(20, ["127.0.0.4"])
    check(codes["127.0.0.4"] == 128 + signal.SIGTERM, "SIGTERMed agent exit %s\n%s" % (codes, c.log("127.0.0.4")))
    envs = c.wait_envs(lambda e: e["WORLD_SIZE"] == "4", 4, 20, "the 2-node round")
    check_world(envs, 4, 2)
    codes = c.wait_agents(30, ["127.0.0.2", "127.0.0.3"])
    check(set(codes.values()) == {0}, "survivors' exit codes %s\n%s" % (codes, c.all_logs()))


def embedded_host_lost(c):
    # The agent hosting the rendezvous (no daemon) is SIGKILLed, then, in a second job, stopped
    # with SIGTERM: the others exit 1 at once, saying so, instead of retrying for read_timeout
    # (20 s here; the wait below is shorter) and blaming a ddprun-rdzvd nobody started.
    for how in (signal.SIGKILL, signal.SIGTERM):
        port = free_port("127.0.0.2")
        ep = "127.0.0.2:%d" % port
        run_id = "%s-%d" % (c.marker, how)
        names = ["%s-%d" % (a, how) for a in ADDRS]
        c.start_agent(ADDRS[0], ep, nnodes="2:3", run_id=run_id, name=names[0], worker_args=["--sleep", "60"])
        for a, name in zip(ADDRS[1:], names[1:]):  # is_host=0: the first agent hosts, whoever probes first
            c.start_agent(a, ep, nnodes="2:3", run_id=run_id, name=name, conf=FAST_CONF + ",is_host=0",
                          worker_args=["--sleep", "60"])
        c.wait_envs(lambda e: e["TORCHELASTIC_RUN_ID"] == run_id and e["WORLD_SIZE"] == "6", 6, 30, "6 workers")
        check("this agent hosts it" in c.log(names[0]), "127.0.0.2 did not host:\n" + c.all_logs())
        c.agents[names[0]][0].send_signal(how)
        codes = c.wait_agents(15, names[1:])
        check(set(codes.values()) == {1}, "exit codes %s\n%s" % (codes, c.all_logs()))
        # Killed, it is gone; stopped by a signal, it tells the others the job is over before it
        # goes (no round without it first).
        want = ("was hosted by the agent on that node (no ddprun-rdzvd), and it is gone" if how == signal.SIGKILL
                else "the agent hosting the rendezvous at %s stopped after a signal" % ep)
        for name in names[1:]:
            check(want in c.log(name), "no clear message on %s:\n%s" % (name, c.log(name)))
            check("round 1" not in c.log(name), "a round was started without the host:\n%s" % c.log(name))
        host_code = c.wait_agents(15, names[:1])[names[0]]
        # SIGKILL: the kernel's verdict; SIGTERM: ddprun's own exit after forwarding it, 128 + 15.
        check(host_code == (-how if how == signal.SIGKILL else 128 + how),
              "the host exited %s after signal %d" % (host_code, how))


def embedded_failure_restart(c):
    # Worker failure with the rendezvous embedded in one agent: all nodes restart, then succeed.
    port = free_port("127.0.0.2")
    ep = "127.0.0.2:%d" % port
    for a in ADDRS:
        c.start_agent(a, ep, max_restarts=2,
                      worker_args=["--fail-rank", "0", "--fail-attempt", "0", "--exit", "5", "--sleep", "1"])
    codes = c.wait_agents(60)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))
    check_world([e for e in c.envs() if e["TORCHELASTIC_RESTART_COUNT"] == "1"], 6, 3)
    check(not [e for e in c.envs() if e["TORCHELASTIC_RESTART_COUNT"] == "2"], "a second restart happened")


STORE_VALIDATE = bytes.fromhex("00cef7853c")


def store_request(addr, port, payload, reply_len):
    """One TCPStore exchange with the store at addr:port, as torch's client speaks it."""
    with socket.create_connection((addr, port), timeout=10) as s:
        s.sendall(STORE_VALIDATE + payload)
        reply = b""
        while len(reply) < reply_len:
            chunk = s.recv(reply_len - len(reply))
            check(chunk, "the store at %s:%d closed the connection" % (addr, port))
            reply += chunk
        return reply


def store_has(addr, port, key):
    """CHECK (opcode 5) of one key: 0 = READY."""
    k = key.encode()
    return store_request(addr, port, bytes([5]) + struct.pack("<QQ", 1, len(k)) + k, 1) == b"\x00"


def store_set(addr, port, key, value):
    k, v = key.encode(), value.encode()
    ping = bytes([13]) + struct.pack("<I", 7)  # PING: the SET was served when its answer comes
    store_request(addr, port, bytes([1]) + struct.pack("<Q", len(k)) + k + struct.pack("<Q", len(v)) + v + ping, 4)


def rejoined_while_stopping(c):
    # The round after a restart assigned while the workers are still stopping: the daemon restarts
    # during the stop, the agent's client reconnects and rejoins by itself (without waiting for the
    # stop), and the new round's assignment arrives before the old workers are gone. The new
    # round's workers must get a fresh key space in the agent's store, as after an ordinary
    # restart: a key the first round set must be gone. Before, the round started on the old keys.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    go = os.path.join(c.dir, "go")
    fail_now = os.path.join(c.dir, "fail_now")
    # A fresh daemon closes the round a rejoin without an assignment opens after its rebuild grace
    # (10 s), well within the stop's grace of 25 s (the last --shutdown-timeout wins), reconnect
    # backoff and all.
    c.start_agent(ADDRS[0], ep, nnodes="1:1", max_restarts=1, extra=["--shutdown-timeout", "25"],
                  worker_args=["--fail-rank", "1", "--fail-attempt", "0", "--fail-when", fail_now,
                               "--term-ignore-attempt", "0", "--wait-file", go, "--sleep", "40"])
    first = c.wait_envs(lambda e: True, 2, 30, "the first round's 2 workers")
    master = (first[0]["MASTER_ADDR"], int(first[0]["MASTER_PORT"]))
    store_set(*master, "stale", "from the first round")
    check(store_has(*master, "stale"), "the key set in the first round is not there")
    open(fail_now, "w").close()
    # The restart is pushed; rank 0 ignores SIGTERM, so the stop takes the whole grace.
    deadline = time.monotonic() + 20
    while "all nodes restart together" not in c.log(ADDRS[0]):
        check(time.monotonic() < deadline, "no restart:\n%s" % c.all_logs())
        time.sleep(0.02)
    c.daemon.kill()
    c.daemon.wait(10)
    c.start_daemon(port=port)
    later = c.wait_envs(lambda e: e["pid"] not in {f["pid"] for f in first}, 2, 40, "the next round's 2 workers")
    master = (later[0]["MASTER_ADDR"], int(later[0]["MASTER_PORT"]))
    log = c.log(ADDRS[0])
    check(not store_has(*master, "stale"), "the next round's workers see the first round's key:\n%s" % log)
    check("assigned before this node asked for it: resetting the worker store" in log, "no reset line:\n%s" % log)
    open(go, "w").close()
    codes = c.wait_agents(30)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))


SCENARIOS = {f.__name__: f for f in [env_daemon, env_embedded, ddp, store_opt_out, worker_failure_restart, budget_spent,
                                      summary_lists_failed_ranks, victim_not_named, raised_without_error_file,
                                      remote_culprit_stacks,
                                      agent_kill, agent_stop, grow, spare, daemon_restart, daemon_restart_spare, token, token_rotation,
                                      daemon_gone,
                                      below_min, agent_sigterm, embedded_failure_restart, embedded_host_lost,
                                      static_backend,
                                      exit_barrier, nccl_ids, rejoined_while_stopping]}


def main():
    name = sys.argv[1]
    backend = "c10d"
    if len(sys.argv) > 2:
        check(len(sys.argv) == 4 and sys.argv[2] == "--backend", "usage: test_multinode.py SCENARIO [--backend B]")
        backend = sys.argv[3]
    c = Cluster(name, backend)
    ok = False
    try:
        SCENARIOS[name](c)
        ok = True
    finally:
        c.kill_all()
        try:
            c.assert_no_orphans()
        finally:
            if ok and not os.environ.get("DDPRUN_MN_KEEP"):
                shutil.rmtree(c.dir, ignore_errors=True)
            if not ok or os.environ.get("DDPRUN_MN_KEEP"):
                print("test directory kept: " + c.dir, file=sys.stderr)
    print("%s: ok" % name)


if __name__ == "__main__":
    try:
        main()
    except Failure as e:
        print("FAIL: %s" % e, file=sys.stderr)
        sys.exit(1)
