#!/usr/bin/env python3
"""End-to-end jobs on --rdzv-backend etcd that the c10d suite has no twin for: torchrun-style user
scripts, high availability (a 3-member etcd cluster losing its leader), and etcd errors. Real
ddprun agents and workers on loopback (127.0.0.2/.3/.4), real etcd members started by the test
(etcd_cluster.py). The chaos set shared with c10d runs from test_multinode.py --backend etcd.

    test_etcd.py SCENARIO

Bounded like test_multinode.py (same Cluster: kills everything in `finally`, asserts no process
carrying the scenario's marker is left, etcd members included).
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import etcd_cluster  # noqa: E402
from test_multinode import (ADDRS, DDPRUN, FAST_CONF, PYTHON, Cluster, Failure, check,  # noqa: E402
                            check_world)

HA_HOSTS = ["127.0.0.11", "127.0.0.12", "127.0.0.13"]


def write_script(c, name, text):
    path = os.path.join(c.dir, name)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


def read_env_files(directory, prefix):
    out = []
    for n in os.listdir(directory):
        if n.startswith(prefix) and n.endswith(".env"):
            with open(os.path.join(directory, n)) as f:
                out.append(dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line))
    return out


def wait_for(pred, timeout, what, c):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise Failure("timed out waiting for %s; logs:\n%s" % (what, c.all_logs()))
        time.sleep(0.05)


def scripts(c):
    # torchrun-style: a bash user script (--no-python) under --nproc-per-node auto and a Python
    # one with a number, two agents on ONE node (same --local-addr), --nnodes 1:2 elastic.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    go = os.path.join(c.dir, "go")
    bash = write_script(c, "user.sh", """#!/bin/bash
set -e
out="$1"; go="$2"
env | grep -E '^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_RUN_ID|TORCHELASTIC_RESTART_COUNT)=' > "$out/.bash_$RANK.tmp"
mv "$out/.bash_$RANK.tmp" "$out/bash_$RANK.env"
for i in $(seq 1 1500); do [ -e "$go" ] && exit 0; sleep 0.02; done
exit 4
""")
    py = write_script(c, "user.py", """import os, sys, time
out, go = sys.argv[1], sys.argv[2]
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"]
tmp = os.path.join(out, ".py_%s.tmp" % os.environ["RANK"])
with open(tmp, "w") as f:
    f.write("".join("%s=%s\\n" % (k, os.environ[k]) for k in keys))
os.rename(tmp, os.path.join(out, "py_%s.env" % os.environ["RANK"]))
deadline = time.monotonic() + 30
while time.monotonic() < deadline and not os.path.exists(go):
    time.sleep(0.02)
sys.exit(0 if os.path.exists(go) else 4)
""")
    nauto = os.sysconf("SC_NPROCESSORS_ONLN")
    conf = FAST_CONF.replace("last_call_timeout=0.5", "last_call_timeout=2")
    c.start_agent(ADDRS[0], ep, nnodes="1:2", conf=conf, nproc="auto", name="bash",
                  program=["--no-python", bash, c.out, go])
    c.start_agent(ADDRS[0], ep, nnodes="1:2", conf=conf, nproc="2", name="py", program=[py, c.out, go])
    world = nauto + 2
    wait_for(lambda: len([e for e in read_env_files(c.out, "") if e["WORLD_SIZE"] == str(world)]) >= world, 30,
             "%d workers in one 2-node round" % world, c)
    envs = [e for e in read_env_files(c.out, "") if e["WORLD_SIZE"] == str(world)]
    check(sorted(int(e["RANK"]) for e in envs) == list(range(world)), "ranks %s" % [e["RANK"] for e in envs])
    check({e["GROUP_WORLD_SIZE"] for e in envs} == {"2"}, "GROUP_WORLD_SIZE")
    check(len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1, "MASTER differs")
    check({e["MASTER_ADDR"] for e in envs} == {ADDRS[0]}, "MASTER_ADDR %s" % {e["MASTER_ADDR"] for e in envs})
    check({e["TORCHELASTIC_RUN_ID"] for e in envs} == {c.marker}, "run id")
    bash_envs = read_env_files(c.out, "bash_")
    check({e["LOCAL_WORLD_SIZE"] for e in bash_envs} == {str(nauto)}, "nproc auto: %s" % bash_envs)
    sizes = {int(e["GROUP_RANK"]): int(e["LOCAL_WORLD_SIZE"]) for e in envs}
    check(sorted(sizes) == [0, 1] and sorted(sizes.values()) == sorted([nauto, 2]), "groups %s" % sizes)
    for e in envs:
        offset = sum(sizes[g] for g in sizes if g < int(e["GROUP_RANK"]))
        check(int(e["RANK"]) == offset + int(e["LOCAL_RANK"]), "RANK/GROUP_RANK/LOCAL_RANK %s" % e)
    open(go, "w").close()
    codes = c.wait_agents(30)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))


def python_raise(c):
    # A Python worker raising on one node: every node exits 1 and names the failing rank and node.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    py = write_script(c, "raise.py", """import os, sys, time
if os.environ["RANK"] == "1":
    raise ValueError("ddprun etcd test: rank 1 raises")
time.sleep(30)
""")
    for a in ADDRS[:2]:
        c.start_agent(a, ep, nnodes="2:2", program=[py])
    codes = c.wait_agents(40)
    check(set(codes.values()) == {1}, "exit codes %s (want 1 everywhere)\n%s" % (codes, c.all_logs()))
    # The traceback is in the output of the node that ran rank 1 (no @record: no error file), the
    # root cause on every node names that node and the rank, and on the other node what it raised
    # (the last line of the traceback the agent's stacks hook recorded, relayed as its message).
    raised = [a for a in ADDRS[:2] if 'raise ValueError("ddprun etcd test' in c.log(a)]
    check(len(raised) == 1, "want the traceback on one node, found %s:\n%s" % (raised, c.all_logs()))
    for a in ADDRS[:2]:
        log = c.log(a)
        check("rank       : 1 (local_rank: 1)" in log, "summary on %s lacks rank 1:\n%s" % (a, log))
        check("host       : %s" % raised[0] in log, "summary on %s lacks the node %s:\n%s" % (a, raised[0], log))
        if a != raised[0]:
            check("message    : ValueError: ddprun etcd test: rank 1 raises" in log,
                  "summary on %s lacks what rank 1 raised:\n%s" % (a, log))


def restarts_seen(c):
    return sum(c.log(a).count("all nodes restart together") for a in ADDRS)


def ha_failover(c):
    # 3 etcd members; SIGKILL the leader while a 3-node job runs (no worker restart may follow),
    # then again right after a worker failure started a restart (the restart completes once).
    c.etcd = etcd_cluster.EtcdCluster(c.dir, c.env, size=3, hosts=HA_HOSTS)
    # The agents talk to the first member of the list: make it the leader, so the first kill
    # breaks their connections and their watches as well as the raft quorum's leadership.
    leader = c.etcd.wait_leader()
    order = [leader] + [i for i in range(3) if i != leader]
    ep = ",".join(c.etcd.members[i].endpoint for i in order)
    go = os.path.join(c.dir, "go")
    for a in ADDRS:
        c.start_agent(a, ep, max_restarts=1, worker_args=["--wait-file", go, "--sleep", "60"])
    first = c.wait_envs(lambda e: e["TORCHELASTIC_RESTART_COUNT"] == "0", 6, 30, "round 0")
    check_world(first, 6, 3)

    check(c.etcd.wait_leader() == leader, "the etcd leader changed before the test killed it")
    c.etcd.members[leader].kill()
    c.etcd.wait_leader(exclude=leader)
    # Longer than the node lease (2 s) and etcd's election: a lost lease would have shown by now.
    time.sleep(4)
    check(restarts_seen(c) == 0, "the leader's failover restarted the job:\n" + c.all_logs())
    check(len(c.envs()) == 6, "workers were restarted by the failover: %d env files" % len(c.envs()))
    st = subprocess.run([DDPRUN, "status", "--rdzv-backend", "etcd", "--rdzv-endpoint", ep, "--rdzv-id", c.marker],
                        capture_output=True, text=True, timeout=20)
    check(st.returncode == 0 and "job '%s': running" % c.marker in st.stdout,
          "status after the failover: %s %s" % (st.stdout, st.stderr))
    c.etcd.restart(leader)  # back to 3 members, so the next kill keeps a quorum

    # A worker failure starts a restart; kill the (new) leader while the nodes rejoin.
    os.kill([e["pid"] for e in first if e["RANK"] == "3"][0], signal.SIGKILL)
    wait_for(lambda: restarts_seen(c) >= 1, 20, "the restart", c)
    leader = c.etcd.wait_leader()
    c.etcd.members[leader].kill()
    second = c.wait_envs(lambda e: e["TORCHELASTIC_RESTART_COUNT"] == "1", 6, 40, "the restarted round")
    check_world(second, 6, 3)
    open(go, "w").close()
    codes = c.wait_agents(30)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))
    check(not [e for e in c.envs() if e["TORCHELASTIC_RESTART_COUNT"] not in ("0", "1")], "a second restart")
    check(len(c.envs()) == 12, "want 6 + 6 workers, got %d env files" % len(c.envs()))


def minority_stall(c):
    # The member the agents talk to stops answering (SIGSTOP: a partition of a minority member
    # that keeps its sockets open). The agents move to the other members; the job completes.
    c.etcd = etcd_cluster.EtcdCluster(c.dir, c.env, size=3, hosts=HA_HOSTS)
    leader = c.etcd.wait_leader()
    follower = [i for i in range(3) if i != leader][0]
    order = [follower] + [i for i in range(3) if i != follower]
    ep = ",".join(c.etcd.members[i].endpoint for i in order)
    go = os.path.join(c.dir, "go")
    for a in ADDRS:
        c.start_agent(a, ep, max_restarts=1, worker_args=["--wait-file", go, "--sleep", "60"])
    c.wait_envs(lambda e: True, 6, 30, "round 0")
    c.etcd.members[follower].proc.send_signal(signal.SIGSTOP)
    time.sleep(8)  # longer than the agents' request timeout and the node lease
    open(go, "w").close()
    codes = c.wait_agents(40)
    c.etcd.members[follower].proc.send_signal(signal.SIGCONT)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))
    check(len(c.envs()) == 6 and restarts_seen(c) == 0,
          "the stalled member caused %d restart(s), %d env files:\n%s" % (restarts_seen(c), len(c.envs()),
                                                                        c.all_logs()))


def unreachable(c):
    # Nobody serves the etcd endpoint: the agent exits 1 naming it, within the join timeout.
    port = etcd_cluster.free_port("127.0.0.1")
    ep = "127.0.0.1:%d" % port
    conf = FAST_CONF.replace("join_timeout=20", "join_timeout=3")
    t0 = time.monotonic()
    c.start_agent(ADDRS[0], ep, nnodes="1:2", conf=conf, worker_args=["--sleep", "0"])
    codes = c.wait_agents(20)
    elapsed = time.monotonic() - t0
    check(codes[ADDRS[0]] == 1, "exit %s, want 1\n%s" % (codes, c.all_logs()))
    log = c.log(ADDRS[0])
    check("ddprun: error:" in log and ep in log, "no error naming %s:\n%s" % (ep, log))
    check(elapsed < 3 + 5, "giving up took %.1f s (join timeout 3 s)" % elapsed)
    check(not c.envs(), "workers started without a rendezvous")


class WatchHoldingProxy:
    """A proxy in front of one etcd member that passes every connection through except those whose
    first request is a watch: it reads those and never answers (as a proxy that buffers streaming
    replies does). Threads; closed with close()."""

    def __init__(self, upstream_port):
        self.upstream = ("127.0.0.1", upstream_port)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.held = 0
        self.socks = []
        self.lock = threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def keep(self, s):
        with self.lock:
            self.socks.append(s)

    def accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.keep(conn)
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn):
        head = b""
        while b"\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                return
            head += chunk
        if head.startswith(b"POST /v3/watch"):
            with self.lock:
                self.held += 1
            while conn.recv(4096):  # held: read, never answered
                pass
            return
        up = socket.create_connection(self.upstream)
        self.keep(up)
        up.sendall(head)
        threading.Thread(target=self.pump, args=(up, conn), daemon=True).start()
        self.pump(conn, up)

    @staticmethod
    def pump(src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.listener.close()
        with self.lock:
            for s in self.socks:
                s.close()


def watch_never_streams(c):
    # etcd behind a proxy that passes the calls but never answers a watch (nginx with
    # proxy_buffering on): the agent's calls succeed, its watch breaks each time before it works.
    # It gives up after read_timeout naming the watch, instead of waiting for events for good.
    port = c.start_daemon()
    proxy = WatchHoldingProxy(port)
    try:
        conf = FAST_CONF.replace("read_timeout=20", "read_timeout=6")
        t0 = time.monotonic()
        c.start_agent(ADDRS[0], "127.0.0.1:%d" % proxy.port, nnodes="1:1", conf=conf, worker_args=["--sleep", "60"])
        codes = c.wait_agents(60)
        elapsed = time.monotonic() - t0
        log = c.log(ADDRS[0])
        check(codes[ADDRS[0]] == 1, "exit %s, want 1\n%s" % (codes, c.all_logs()))
        check("without a stream that worked" in log and "the watch on etcd" in log,
              "no error naming the watch:\n%s" % log)
        check("keeps breaking before its stream works" in log, "no warning before the give-up:\n%s" % log)
        check(proxy.held >= 3, "the proxy held %d watches" % proxy.held)
        check(elapsed < 6 + 30, "giving up took %.1f s (read_timeout 6 s)" % elapsed)
    finally:
        proxy.close()


def unresolvable_first(c):
    # The first etcd member's name does not resolve here (".invalid" never does, and without a
    # DNS query): the agent picks its address towards the next member and runs the job.
    port = c.start_daemon()
    ep = "no-such-member.invalid:2379,127.0.0.1:%d" % port
    c.start_agent(ADDRS[0], ep, nnodes="1:1", local_addr=False, worker_args=["--sleep", "0"])
    codes = c.wait_agents(30)
    check(codes[ADDRS[0]] == 0, "exit %s, want 0\n%s" % (codes, c.all_logs()))
    envs = c.envs()
    check(len(envs) == 2 and {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}, "workers %s" % envs)


def bad_credentials(c):
    # etcd with auth on: a wrong password fails with an error naming the endpoint and the user;
    # the right one (password_file, DDPRUN_ETCD_PASSWORD) runs the job.
    port = c.start_daemon()
    ep = "127.0.0.1:%d" % port
    ctl = ["/usr/bin/etcdctl", "--endpoints", ep]
    ctl_env = dict(c.env, ETCDCTL_API="3")
    for cmd in (["user", "add", "root:rootpw"], ["auth", "enable"]):
        r = subprocess.run(ctl + cmd, capture_output=True, text=True, timeout=20, env=ctl_env)
        check(r.returncode == 0, "etcdctl %s: %s %s" % (cmd, r.stdout, r.stderr))
    wrong = os.path.join(c.dir, "wrong.pw")
    right = os.path.join(c.dir, "right.pw")
    with open(wrong, "w") as f:
        f.write("nope\n")
    with open(right, "w") as f:
        f.write("rootpw\n")
    conf = FAST_CONF.replace("join_timeout=20", "join_timeout=5")
    t0 = time.monotonic()
    c.start_agent(ADDRS[0], ep, nnodes="1:1", conf=conf + ",username=root,password_file=" + wrong,
                  worker_args=["--sleep", "0"])
    codes = c.wait_agents(20)
    check(codes[ADDRS[0]] == 1, "wrong password: exit %s\n%s" % (codes, c.all_logs()))
    log = c.log(ADDRS[0])
    check("ddprun: error:" in log and ep in log, "no error naming %s:\n%s" % (ep, log))
    check("auth" in log.lower() or "password" in log.lower(), "the error does not say auth failed:\n" + log)
    check(time.monotonic() - t0 < 5 + 5, "the auth error took %.1f s" % (time.monotonic() - t0))
    check(not c.envs(), "workers started with a wrong password")
    c.agents.clear()
    c.start_agent(ADDRS[1], ep, nnodes="1:1", conf=conf + ",username=root,password_file=" + right,
                  worker_args=["--sleep", "0"])
    c.start_agent(ADDRS[2], ep, nnodes="1:1", conf=conf + ",username=root", worker_args=["--sleep", "0"],
                  run_id=c.marker + "-env", env={"DDPRUN_ETCD_PASSWORD": "rootpw"})
    codes = c.wait_agents(30)
    check(set(codes.values()) == {0}, "right password: exit codes %s\n%s" % (codes, c.all_logs()))
    st = subprocess.run([DDPRUN, "status", "--rdzv-backend", "etcd", "--rdzv-endpoint", ep, "--rdzv-conf",
                         "username=root,password_file=" + wrong], capture_output=True, text=True, timeout=20)
    check(st.returncode == 1 and ep in st.stderr, "status with a wrong password: %s %s" % (st.stdout, st.stderr))


def tls(c):
    # etcd serving https with client-certificate auth: protocol=https + cacert/cert/key (relative
    # paths, from the agent's working directory) run a 2-node job; status reads it over TLS.
    tdir = os.path.join(c.dir, "tls")
    os.mkdir(tdir)
    files = etcd_cluster.TlsFiles(tdir)
    c.etcd = etcd_cluster.EtcdCluster(c.dir, c.env, tls=files)
    ep = c.etcd.endpoints
    conf = FAST_CONF + ",protocol=https,cacert=tls/ca.pem,cert=tls/client.pem,key=tls/client.key"
    go = os.path.join(c.dir, "go")
    for a in ADDRS[:2]:
        c.start_agent(a, ep, nnodes="2:2", conf=conf, worker_args=["--wait-file", go, "--sleep", "30"])
    envs = c.wait_envs(lambda e: True, 4, 30, "4 workers")
    check_world(envs, 4, 2)
    st = subprocess.run([DDPRUN, "status", "--rdzv-backend", "etcd", "--rdzv-endpoint", "https://" + ep,
                         "--rdzv-id", c.marker, "--rdzv-conf",
                         "cacert=%s,cert=%s,key=%s" % (files.ca, files.client_cert, files.client_key)],
                        capture_output=True, text=True, timeout=20)
    check(st.returncode == 0 and "job '%s': running" % c.marker in st.stdout,
          "status over TLS: %s %s" % (st.stdout, st.stderr))
    # Without the client certificate etcd refuses the handshake: status fails naming the endpoint.
    st = subprocess.run([DDPRUN, "status", "--rdzv-backend", "etcd", "--rdzv-endpoint", ep, "--timeout", "3",
                         "--rdzv-conf", "protocol=https,cacert=" + files.ca], capture_output=True, text=True,
                        timeout=20)
    check(st.returncode == 1 and ep in st.stderr, "status without a client cert: %s %s" % (st.stdout, st.stderr))
    open(go, "w").close()
    codes = c.wait_agents(30)
    check(set(codes.values()) == {0}, "exit codes %s\n%s" % (codes, c.all_logs()))


SCENARIOS = {f.__name__: f for f in [scripts, python_raise, ha_failover, minority_stall, unreachable,
                                      unresolvable_first, bad_credentials, tls, watch_never_streams]}


def main():
    name = sys.argv[1]
    c = Cluster("etcd-" + name, "etcd")
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
