#!/usr/bin/env python3
"""Launch-tree scenarios (agents that start agents) on the namespace bed: 7 hosts h0..h6, each a
network namespace with its own sshd, launched with `--ssh-tree-threshold 1 --ssh-tree-fanout 2`,
so the launcher ssh's to 2 subtree roots and the tree is 3 hosts deep (launcher -> root -> inner
-> leaf). Every guarantee of the flat fan-out is checked through the tree: rank order = host list
order, prefixed whole lines, a deep rank's exit code, SIGINT, SIGKILL of the launcher leaving
nothing in any namespace, an inner node killed (its subtree goes with it), an unreachable host
deep in the tree named with its path, and a real torch gloo DDP job across the tree.

    test_tree.py [Tree.test_<scenario> ...]     (no argument: all scenarios, one bed each)

Needs root (else prints SKIPPED and exits 77). Which host ssh'd to which is read from the sshds'
own logs (VERBOSE: "Connection from ADDR"), so the test fails if the launcher went flat.
"""
import os
import re
import signal
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from netns_hosts import cmdline, preflight, skip, SkipTest  # noqa: E402
from launcher_case import LINE_RE, LauncherCase  # noqa: E402

BIN_DIR = os.path.abspath(os.environ.get("DDPRUN_BIN_DIR", os.path.join(HERE, "..", "..", "build", "bin")))
DDPRUN = os.path.join(BIN_DIR, "ddprun")
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
WORKER = os.path.join(HERE, "fanout_worker.py")
DDP_JOB = os.path.join(HERE, "ddp_job.py")
N = 7
TREE = ["--ssh-tree-threshold", "1", "--ssh-tree-fanout", "2"]
# Neither sorted nor reversed: group ranks must follow this list, not host names or join order.
ORDER = ["h3", "h6", "h0", "h5", "h1", "h4", "h2"]


def expected_parents(order):
    """{host: the host (or 'launcher') that ssh's to it} for fan-out 2, as fanout.hpp describes:
    cut the list into 2 nearly equal contiguous runs, the first host of a run starts the rest."""
    parent = {}

    def cut(lo, hi, up):
        n = hi - lo
        if n <= 0:
            return
        k = min(2, n)
        base, extra = divmod(n, k)
        at = lo
        for i in range(k):
            ln = base + (1 if i < extra else 0)
            parent[order[at]] = up
            cut(at + 1, at + ln, order[at])
            at += ln

    cut(0, len(order), "launcher")
    return parent


class Tree(LauncherCase):
    HOSTS = N
    LEFTOVER_GRACE = 20
    WORKERS_TIMEOUT = 90  # a 3-deep tree on a 2-vCPU bed

    def launch(self, hosts, program, extra=()):
        argv = [DDPRUN, "--ssh-config", self.c.ssh_config, "--hosts", ",".join(hosts), "--nproc-per-node", "1"] + \
            TREE + ["--env", "PYTHON_EXEC"] + list(extra) + list(program)
        env = self.c.base_env({"PYTHON_EXEC": PYTHON, "DDPRUN_LOG_LEVEL": "info"})
        with open(self.stdout_path, "wb") as o, open(self.stderr_path, "wb") as e:
            self.proc = self.c.run_in_launcher_ns(argv, env=env, stdout=o, stderr=e, cwd=self.c.dir)
        return self.proc

    def worker(self, *opts):
        return [WORKER, "--out", self.out] + list(opts)

    def hold(self, *opts):
        return self.worker("--hold", self.c.path("never"), "--max", "120", *opts)

    def ssh_sources(self):
        """{host: set of host names (or 'launcher') that opened an ssh connection to it}."""
        by_addr = {self.c.launcher_addr: "launcher"}
        by_addr.update({a: h for h, a in zip(self.c.hosts, self.c.addrs)})
        out = {}
        for i, h in enumerate(self.c.hosts):
            for m in re.finditer(r"Connection from (\S+) port", self.c.sshd_log(i)):
                out.setdefault(h, set()).add(by_addr.get(m.group(1), m.group(1)))
        return out

    # ---------- the tree itself: who started whom, ranks, prefixes, exit 0 ----------

    def test_a_depth3_order_prefixes(self):
        self.launch(ORDER, self.worker("--lines", "5"))
        self.assertEqual(self.wait_exit(120), 0, self.stderr()[-4000:])
        self.assertIn("launch tree (fan-out 2, depth 3)", self.stderr())
        # Ranks follow the host list (1 worker per host: rank = position).
        infos = self.infos()
        self.assertEqual(sorted(i["rank"] for i in infos), list(range(N)))
        for i in infos:
            self.assertEqual(i["world"], N)
            self.assertEqual(i["rank"], ORDER.index(i["host"]), i["host"])
            self.assertEqual(i["group_rank"], ORDER.index(i["host"]), i["host"])
        # Every worker line arrives whole, once, with its own host and rank, whatever the depth.
        lines = [LINE_RE.match(x) for x in self.stdout().splitlines()]
        got = sorted((m.group(1), int(m.group(2)), m.group(3)) for m in lines if m)
        want = sorted((h, r, "line %d of rank %d host %s" % (k, r, h))
                      for r, h in enumerate(ORDER) for k in range(5))
        self.assertEqual(got, want)
        # The tree, from the sshds' side: each host was reached from its parent only (the
        # launcher's health check reaches every host before the launch; it counts as launcher).
        for host, parent in expected_parents(ORDER).items():
            sources = self.ssh_sources().get(host, set()) - {"launcher"}
            self.assertEqual(sources, set() if parent == "launcher" else {parent}, host)
        self.assertEqual(max(self.depths().values()), 3)
        self.assert_clean()

    def depths(self):
        parents = expected_parents(ORDER)
        d = {}
        for h in ORDER:
            k, p = 1, parents[h]
            while p != "launcher":
                k, p = k + 1, parents[p]
            d[h] = k
        return d

    # ---------- SIGKILL of the launcher: nothing left at any depth ----------

    def test_b_sigkill_leaves_nothing(self):
        self.launch(ORDER, self.hold())
        self.wait_workers(N)
        t0 = time.monotonic()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.assert_clean()
        print("all processes gone %.2fs after SIGKILL of the launcher (depth 3)" % (time.monotonic() - t0),
              file=sys.stderr)

    # ---------- a rank deep in the tree fails: its code reaches the launcher ----------

    def test_c_deep_failure_exit_code(self):
        deepest = max(ORDER, key=lambda h: (self.depths()[h], -ORDER.index(h)))
        rank = ORDER.index(deepest)
        self.assertEqual(self.depths()[deepest], 3)
        self.launch(ORDER, self.hold("--fail-rank", str(rank), "--exit", "7"))
        self.assertEqual(self.wait_exit(90), 7, self.stderr()[-4000:])
        self.assertRegex(self.stderr(), r"\b%d\b" % rank, "the failing rank is named")
        self.assert_clean()

    # ---------- Ctrl-C: forwarded down the tree, 130, workers got SIGINT ----------

    def test_d_sigint(self):
        self.launch(ORDER, self.hold())
        infos = self.wait_workers(N)
        os.kill(self.proc.pid, signal.SIGINT)
        self.assertEqual(self.wait_exit(60), 128 + signal.SIGINT, self.stderr()[-4000:])
        self.assert_clean()
        # Every worker was stopped by a signal, not cut off. The first hosts to stop leave the
        # rendezvous, and an agent the SIGINT has not reached yet may stop its workers for that
        # membership change first (SIGTERM): the signal travels one ssh hop per level.
        got = {}
        for i in infos:
            path = os.path.join(self.out, "sig_%d_%d" % (i["rank"], i["pid"]))
            self.assertTrue(os.path.exists(path), "rank %d on %s got no signal" % (i["rank"], i["host"]))
            with open(path) as f:
                got[i["host"]] = f.read()
            self.assertRegex(got[i["host"]], r"signal (%d|%d)" % (signal.SIGINT, signal.SIGTERM), i["host"])
        self.assertTrue(any("signal %d" % signal.SIGINT in v for v in got.values()), got)

    # ---------- a host deep in the tree cannot be reached ----------

    def test_e_unreachable_deep(self):
        # h9: an address nothing answers at, at a leaf position (under h3 -> h6).
        order = ["h3", "h6", "h9", "h5", "h1", "h4", "h2"]
        self.launch(order, self.hold(), extra=["--ssh-option", "ConnectTimeout=3"])
        code = self.wait_exit(90)
        err = self.stderr()
        self.assertEqual(code, 1, err[-4000:])
        self.assertIn("cannot reach host h9 over ssh (launch tree: launcher -> h3 -> h6 -> h9)", err)
        # Named once by the node that tried (h6), not re-prefixed by every level above it.
        self.assertRegex(err, r"(?m)^\[h6\] ddprun: error: cannot reach host h9 over ssh")
        self.assertRegex(err, r"(?m)^\[h9\] ssh: ")
        self.assertRegex(err, r"port 22|h9:22", "the ssh port is named")
        self.assert_clean()


    # ---------- an inner tree node dies: its whole subtree goes, the launcher stops the rest ----------

    def test_f_inner_node_killed(self):
        self.launch(ORDER, self.hold())
        self.wait_workers(N)
        # h6 (launcher -> h3 -> h6 -> h0): the tree node is the --remote-agent process whose parent
        # is an sshd session (its own agent, same command line, is the node's child).
        i = self.c.hosts.index("h6")
        node = None
        for pid in self.c.pids_in(self.c.host_ns[i]):
            cmd = cmdline(pid)
            if "--remote-agent" in cmd and "sshd" in cmdline(ppid(pid)):
                node = pid
        self.assertIsNotNone(node, "no tree node process found on h6")
        os.kill(node, signal.SIGKILL)
        code = self.wait_exit(90)
        self.assertNotEqual(code, 0)
        self.assert_clean()


    # ---------- real torch through the tree: gloo DDP over 7 hosts, 3 levels deep ----------

    def test_g_ddp_gloo_depth3(self):
        self.launch(ORDER, [DDP_JOB])
        self.assertEqual(self.wait_exit(240), 0, self.stderr()[-4000:])
        ok = sorted(LINE_RE.match(x).group(1, 2) for x in self.stdout().splitlines()
                    if LINE_RE.match(x) and " ok world %d " % N in x)
        self.assertEqual(ok, sorted((h, str(r)) for r, h in enumerate(ORDER)), self.stdout()[-3000:])
        self.assert_clean()


def ppid(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def main():
    try:
        preflight()
    except SkipTest as e:
        skip(str(e))
    if not os.access(DDPRUN, os.X_OK):
        print("ddprun binary not found at %s (set DDPRUN_BIN_DIR)" % DDPRUN, file=sys.stderr)
        return 1
    prog = unittest.main(verbosity=2, exit=False)
    return 0 if prog.result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
