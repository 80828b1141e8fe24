#!/usr/bin/env python3
"""Proves the ssh test bed (netns_hosts.SshCluster) and records the OpenSSH behaviour the fan-out
launcher's design relies on. Needs root; otherwise prints SKIPPED and exits 77.

Checks:
  * every host answers over ssh from the launcher namespace with its own hostname and address;
  * hosts reach each other and the launcher by name (workers talk host to host);
  * a host without sshd refuses (exit 255, "Connection refused"), an empty address is unreachable
    (exit 255, bounded);
  * when the ssh client is SIGKILLed (or SIGTERMed), the remote command (no tty):
      - reading stdin: sees EOF at once            -> the agent's control channel works;
      - writing stdout: gets SIGPIPE / EPIPE        -> chatty workers die on their own;
      - silent (neither): is NOT signalled and keeps running (no SIGHUP without a pty)
        -> the remote agent must watch its stdin and stop the workers itself.
  * the bed carries a real cross-host job: one ddprun agent per host started over plain ssh
    (c10d rendezvous embedded in h0's agent, no fan-out launcher involved) runs ddp_job.py
    (torch gloo DDP, 3 hosts x 2 workers) to success, each rank reporting its host's address;
  * nothing is left in any namespace afterwards.
"""
import os
import re
import signal
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from netns_hosts import SshCluster  # noqa: E402

PROBE = os.path.join(HERE, "ssh_probe.py")
DDP_JOB = os.path.join(HERE, "ddp_job.py")
DDPRUN = os.path.join(os.path.abspath(os.environ.get("DDPRUN_BIN_DIR", os.path.join(HERE, "..", "..", "build", "bin"))), "ddprun")
PYTHON = "/usr/bin/python3"
CLUSTER = None


def setUpModule():
    global CLUSTER
    CLUSTER = SshCluster(3, with_refusing_host=True).__enter__()


def tearDownModule():
    if CLUSTER is not None:
        CLUSTER.teardown()


def read_until(path, pred, timeout):
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
        if pred(text):
            return text
        time.sleep(0.02)
    return text


class Bed(unittest.TestCase):
    def tearDown(self):
        CLUSTER.kill_leftovers()

    def test_each_host_answers_with_its_name_and_address(self):
        c = CLUSTER
        for i, h in enumerate(c.hosts):
            r = c.ssh(h, "hostname; ip -4 -o addr show dev eth0; cat /proc/self/net/fib_trie | grep -c %s"
                      % c.addrs[i])
            self.assertEqual(r.returncode, 0, r.stderr)
            lines = r.stdout.splitlines()
            self.assertEqual(lines[0], h)
            self.assertIn("inet %s/24" % c.addrs[i], lines[1])
            for j, other in enumerate(c.addrs):
                if j != i:
                    self.assertNotIn(other, r.stdout)

    def test_hosts_reach_each_other_and_the_launcher_by_name(self):
        c = CLUSTER
        r = c.ssh("h0", "getent hosts h2 launcher; exec 3<>/dev/tcp/h2/22 && head -c 8 <&3")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("%s" % c.addrs[2], r.stdout)
        self.assertIn(c.launcher_addr, r.stdout)
        self.assertTrue(r.stdout.rstrip().endswith("SSH-2.0-"), r.stdout)

    def test_refused_and_unreachable_hosts(self):
        c = CLUSTER
        r = c.ssh("hx", "true")
        self.assertEqual(r.returncode, 255)
        self.assertIn("port 22: Connection refused", r.stderr)
        t0 = time.monotonic()
        r = c.ssh("h9", "true", timeout=30)
        self.assertEqual(r.returncode, 255)
        self.assertRegex(r.stderr, r"%s port 22: (No route to host|Connection timed out)" % c.unreachable_addr)
        self.assertLess(time.monotonic() - t0, 15)

    def client_death(self, mode, signo):
        c = CLUSTER
        out = c.path("probe-%s-%d.txt" % (mode, signo))
        p = c.run_in_launcher_ns(c.ssh_argv("h1", "exec %s -u %s %s %s" % (PYTHON, PROBE, out, mode)),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            started = read_until(out, lambda t: "started" in t, 10)
            self.assertIn("started", started)
            remote_pid = int(started.split()[1])
            if mode != "silent":
                self.assertEqual(p.stdout.read(5), b"tick\n")
            os.kill(p.pid, signo)
            p.wait(10)
            if mode == "silent":
                # Absence of a signal can only be shown by waiting a bounded while.
                time.sleep(1.0)
                with open(out) as f:
                    text = f.read()
                alive = os.path.exists("/proc/%d" % remote_pid)
                return text, alive
            text = read_until(out, lambda t: "exit" in t, 5)
            return text, None
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()

    def test_client_killed_remote_reader_sees_eof(self):
        for signo in (signal.SIGKILL, signal.SIGTERM):
            text, _ = self.client_death("read", signo)
            self.assertIn("eof", text, "signal %d: %r" % (signo, text))
            self.assertNotIn("signal %d" % signal.SIGHUP, text.splitlines())
            print("observed (reader, client signal %d): %r" % (signo, text.split()), file=sys.stderr)
            CLUSTER.assert_no_leftovers(5)

    def test_client_killed_remote_writer_gets_sigpipe(self):
        text, _ = self.client_death("noread", signal.SIGKILL)
        self.assertTrue("signal %d" % signal.SIGPIPE in text.splitlines() or "stdout-error 32" in text.splitlines(), text)
        self.assertNotIn("signal %d" % signal.SIGHUP, text.splitlines())
        print("observed (writer): %r" % text.split(), file=sys.stderr)
        CLUSTER.assert_no_leftovers(5)

    def test_client_killed_silent_remote_is_not_signalled(self):
        text, alive = self.client_death("silent", signal.SIGKILL)
        print("observed (silent): %r alive=%s" % (text.split(), alive), file=sys.stderr)
        self.assertNotIn("signal", text)
        self.assertTrue(alive, "the silent remote command died: %r" % text)
        left = CLUSTER.all_leftover_pids()
        self.assertTrue(any(PROBE in cmd for pids in left.values() for _, cmd in pids), left)
        CLUSTER.kill_leftovers()
        CLUSTER.assert_no_leftovers(5)

    def test_multi_host_ddp_via_ssh_agents(self):
        c = CLUSTER
        if not os.access(DDPRUN, os.X_OK):
            self.fail("ddprun not found at %s (DDPRUN_BIN_DIR)" % DDPRUN)
        # Inside the bed's namespaces nothing else listens, so a fixed port is safe here.
        endpoint = "%s:29400" % c.addrs[0]
        procs = []
        for i, h in enumerate(c.hosts):
            cmd = ("cd %s && exec env PYTHON_EXEC=%s %s --nnodes 3 --nproc-per-node 2 --rdzv-backend c10d "
                   "--rdzv-endpoint %s --rdzv-id smoke --local-addr %s --shutdown-timeout 3 %s"
                   % (c.dir, PYTHON, DDPRUN, endpoint, c.addrs[i], DDP_JOB))
            procs.append(c.run_in_launcher_ns(c.ssh_argv(h, cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=180)
                outs.append((p.returncode, out.decode(errors="replace"), err.decode(errors="replace")))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for i, (code, out, err) in enumerate(outs):
            self.assertEqual(code, 0, "agent on %s: %s\n%s" % (c.hosts[i], out, err))
        ranks = {}
        for i, (_code, out, _err) in enumerate(outs):
            for m in re.finditer(r"rank (\d+) ok world (\d+) host (\S+)", out):
                self.assertEqual(m.group(2), "6")
                self.assertEqual(m.group(3), c.addrs[i], "a worker of %s ran elsewhere" % c.hosts[i])
                ranks[int(m.group(1))] = i
        self.assertEqual(sorted(ranks), list(range(6)), outs)
        c.assert_no_leftovers(10)


if __name__ == "__main__":
    unittest.main(verbosity=2)
