#!/usr/bin/env python3
"""SSH fan-out scenarios against the real ddprun launcher, on a real multi-host bed:
network namespaces h0..h2 with an sshd each (netns_hosts.SshCluster), ddprun run in the launcher
namespace with `--ssh-config CFG --hosts ...` (spec: /work/notes/fanout-spec.md).

    test_fanout.py [Fanout.test_<scenario> ...]     (no argument: all scenarios, one bed each)

Needs root (else prints SKIPPED and exits 77). Every scenario has its own bed (3 hosts with
sshd + `hx`, a namespace without sshd; `h9` is an address nothing answers at), internal
deadlines well below the ctest TIMEOUT, and ends by asserting that no process is left in any
namespace (launcher namespace included; only the sshd daemons may remain).

Output format assumed: every worker line reaches the launcher's stdout as `[hN:RANK]: text`
(one space after the colon is optional), whole lines.
"""
import glob
import os
import re
import signal
import subprocess
import sys
import time
import unittest
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from netns_hosts import preflight, skip, SkipTest  # noqa: E402
from launcher_case import LINE_RE, LauncherCase  # noqa: E402
sys.path.insert(0, os.path.join(HERE, "..", "metrics"))
import prom_text  # noqa: E402

BIN_DIR = os.path.abspath(os.environ.get("DDPRUN_BIN_DIR", os.path.join(HERE, "..", "..", "build", "bin")))
DDPRUN = os.path.join(BIN_DIR, "ddprun")
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")  # tests/torch2: python3-torch2
WORKER = os.path.join(HERE, "fanout_worker.py")
DDP_JOB = os.path.join(HERE, "ddp_job.py")
HOSTS3 = "h0,h1,h2"


class Fanout(LauncherCase):
    HOSTS = 3
    REFUSING_HOST = True

    # ---------- launching ----------

    def env(self, extra=None, drop=()):
        env = self.c.base_env({"PYTHON_EXEC": PYTHON, "DDPRUN_LOG_LEVEL": "info"})
        env.update(extra or {})
        for k in drop:
            env.pop(k, None)
        return env

    def launch(self, host_args, program, nproc=2, extra=(), env=None):
        argv = [DDPRUN, "--ssh-config", self.c.ssh_config] + list(host_args)
        if nproc is not None:
            argv += ["--nproc-per-node", str(nproc)]
        argv += ["--env", "PYTHON_EXEC"] + list(extra) + list(program)
        self.argv = argv
        with open(self.stdout_path, "wb") as o, open(self.stderr_path, "wb") as e:
            self.proc = self.c.run_in_launcher_ns(argv, env=env or self.env(), stdout=o, stderr=e,
                                                  cwd=self.c.dir)
        return self.proc

    def worker(self, *opts, args=None):
        prog = [WORKER, "--out", self.out] + list(opts)
        if args is not None:
            prog += ["--"] + list(args)
        return prog

    def assert_placement(self, infos, expected):
        """expected: {host: number of workers}; ranks 0..W-1 each exactly once, the right world."""
        world = sum(expected.values())
        self.assertEqual(sorted(i["rank"] for i in infos), list(range(world)), infos)
        per_host = {}
        for i in infos:
            self.assertEqual(i["world"], world)
            self.assertEqual(i["addr"], self.c.addrs[int(i["host"][1:])], "worker host/addr mismatch")
            per_host.setdefault(i["host"], []).append(i)
        self.assertEqual({h: len(v) for h, v in per_host.items()}, expected)
        for h, ws in per_host.items():
            self.assertEqual(sorted(w["local_rank"] for w in ws), list(range(len(ws))), h)
            self.assertEqual({w["local_world"] for w in ws}, {len(ws)}, h)
            self.assertEqual(len({w["group_rank"] for w in ws}), 1, h)

    # ---------- (a) real torch DDP over 3 hosts x 2 ----------

    def test_a_ddp_gloo_3x2(self):
        self.launch(["--hosts", HOSTS3], [DDP_JOB])
        code = self.wait_exit(240)
        self.assertEqual(code, 0, self.stderr()[-4000:])
        oks = {}
        for host, rank, text in self.worker_lines():
            m = re.match(r"^rank (\d+) ok world (\d+) host (\S+)$", text)
            if m:
                self.assertEqual(int(m.group(1)), rank, "prefix rank differs from the worker's rank")
                self.assertEqual(int(m.group(2)), 6)
                self.assertEqual(m.group(3), self.c.addrs[int(host[1:])], "prefix host is not the worker's host")
                oks[rank] = host
        self.assertEqual(sorted(oks), list(range(6)), self.stdout())
        self.assertEqual(sorted(list(oks.values()).count(h) for h in self.c.hosts), [2, 2, 2])
        # tests/torch2 runs this with torch 2.6 workers: every rank must have run that torch.
        want = os.environ.get("DDPRUN_TORCH2_VERSION")
        if want:
            versions = {rank: m.group(1) for _, rank, text in self.worker_lines()
                        for m in [re.match(r"^rank \d+ torch (\S+)$", text)] if m}
            self.assertEqual(versions, {r: want for r in range(6)}, "torch version per rank")
        self.assert_clean()

    # ---------- (b) prefixes, whole lines ----------

    def test_b_prefixes_whole_lines(self):
        n = 30
        self.launch(["--hosts", HOSTS3], self.worker("--lines", str(n)))
        self.assertEqual(self.wait_exit(90), 0)
        infos = {i["rank"]: i for i in self.infos()}
        self.assert_placement(infos.values(), {"h0": 2, "h1": 2, "h2": 2})
        lines = self.worker_lines()
        seen = {}
        for host, rank, text in lines:
            m = re.match(r"^line (\d+) of rank (\d+) host (h\d+)$", text)
            self.assertIsNotNone(m, "torn or foreign worker line: %r" % text)
            self.assertEqual(int(m.group(2)), rank)
            self.assertEqual(m.group(3), host)
            self.assertEqual(infos[rank]["host"], host)
            seen.setdefault(rank, []).append(int(m.group(1)))
        self.assertEqual(sorted(seen), list(range(6)))
        for rank, idx in seen.items():
            self.assertEqual(idx, list(range(n)), "rank %d lines lost or reordered" % rank)
        # No worker text outside a prefixed line.
        for line in self.stdout().splitlines():
            if "of rank" in line:
                self.assertRegex(line, LINE_RE)
        self.assert_clean()

    # ---------- (c) environment propagation; values never on a command line ----------

    def test_c_env_propagation(self):
        secret = "s3cr3t-%s" % uuid.uuid4().hex
        tricky = "a b 'single' \"double\" $HOME `x` \\back ; & | * %s\nsecond line\ttab" % secret
        env_file = self.c.path("job.env")
        file_secret = "f1le-%s" % uuid.uuid4().hex
        with open(env_file, "w") as f:
            f.write("# comment line\n\nexport FROM_FILE=%s\nEQUALS=a=b=c\nSPACED_FILE=one two  three\n"
                    % file_secret)
        hold = self.c.path("release")
        env = self.env({"TRICKY": tricky, "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0",
                        "CUDA_VISIBLE_DEVICES": "7,8", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                        "MASTER_ADDR": "192.0.2.77", "MASTER_PORT": "1", "NOT_CARRIED": "nope",
                        "GLOO_SOCKET_IFNAME": "eth0"})
        self.launch(["--hosts", HOSTS3],
                    self.worker("--hold", hold, "--max", "60"),
                    extra=["--env", "FOO=bar", "--env", "TRICKY", "--env-file", env_file], env=env)
        infos = self.wait_workers(6)
        # While every worker runs: neither value is on any command line in any namespace.
        cmdlines = self.c.all_cmdlines()
        self.assertTrue(any(b"--remote-agent" in c for c in cmdlines.values()),
                        "expected remote agents (ddprun --remote-agent) in the host namespaces")
        for pid, cmd in cmdlines.items():
            for needle in (secret, file_secret):
                self.assertNotIn(needle.encode(), cmd, "value visible in /proc/%d/cmdline: %r" % (pid, cmd))
        token = {i["env"].get("DDPRUN_RDZV_TOKEN") for i in infos} - {None}
        for t in token:
            for pid, cmd in cmdlines.items():
                self.assertNotIn(t.encode(), cmd, "rendezvous token visible in /proc/%d/cmdline" % pid)
        with open(hold, "w"):
            pass
        self.assertEqual(self.wait_exit(60), 0)
        self.assertEqual(len(infos), 6)
        for i in infos:
            e = i["env"]
            where = "rank %d on %s" % (i["rank"], i["host"])
            self.assertEqual(e.get("FOO"), "bar", where)
            self.assertEqual(e.get("TRICKY"), tricky, where)
            self.assertEqual(e.get("FROM_FILE"), file_secret, where)
            self.assertEqual(e.get("EQUALS"), "a=b=c", where)
            self.assertEqual(e.get("SPACED_FILE"), "one two  three", where)
            self.assertEqual(e.get("NCCL_DEBUG"), "INFO", where)
            self.assertEqual(e.get("NCCL_SOCKET_IFNAME"), "eth0", where)
            self.assertEqual(e.get("GLOO_SOCKET_IFNAME"), "eth0", where)
            self.assertEqual(e.get("CUDA_DEVICE_MAX_CONNECTIONS"), "1", where)
            self.assertEqual(e.get("PYTHON_EXEC"), PYTHON, where)
            self.assertNotEqual(e.get("CUDA_VISIBLE_DEVICES"), "7,8", where + ": CUDA_VISIBLE_DEVICES carried")
            self.assertNotEqual(e.get("MASTER_ADDR"), "192.0.2.77", where + ": MASTER_ADDR carried")
            self.assertNotEqual(e.get("MASTER_PORT"), "1", where + ": MASTER_PORT carried")
            self.assertNotIn("NOT_CARRIED", e, where)
            self.assertEqual(e.get("HOME"), "/root", where + ": the remote login's own HOME is kept")
        self.assert_clean()

    # ---------- (d) hostfile + include/exclude ----------

    def write_hostfile(self):
        path = self.c.path("hostfile")
        with open(path, "w") as f:
            f.write("# test hosts\nh0 slots=2\n\nh1 slots=2   # trailing comment\nh2 slots=2\n")
        return path

    def test_d_hostfile_exclude_host(self):
        self.launch(["--hostfile", self.write_hostfile(), "--exclude", "h1"], self.worker(), nproc=None)
        self.assertEqual(self.wait_exit(90), 0)
        self.assert_placement(self.infos(), {"h0": 2, "h2": 2})
        self.assert_clean()

    def test_d_hostfile_include_slots(self):
        # h0 slot 1 and h2 slot 0: one worker each; the slot becomes that host's device list.
        self.launch(["--hostfile", self.write_hostfile(), "--include", "h0:1@h2:0"], self.worker(), nproc=None)
        self.assertEqual(self.wait_exit(90), 0)
        infos = self.infos()
        self.assert_placement(infos, {"h0": 1, "h2": 1})
        devices = {i["host"]: i["env"].get("CUDA_VISIBLE_DEVICES") for i in infos}
        self.assertEqual(devices, {"h0": "1", "h2": "0"})
        self.assert_clean()

    def test_d_hostfile_exclude_slot(self):
        self.launch(["--hostfile", self.write_hostfile(), "--exclude", "h1@h2:0"], self.worker(), nproc=None)
        self.assertEqual(self.wait_exit(90), 0)
        infos = self.infos()
        self.assert_placement(infos, {"h0": 2, "h2": 1})
        self.assertEqual([i["env"].get("CUDA_VISIBLE_DEVICES") for i in infos if i["host"] == "h2"], ["1"])
        self.assert_clean()

    # ---------- (l) ranks follow the host list, not the ssh join order ----------

    def test_l_ranks_follow_host_order(self):
        # Two launches on one bed with different orders, neither sorted: the group rank of each
        # host is its position in the list, whatever order the agents joined in (DeepSpeed,
        # mpirun and horovodrun place ranks the same way).
        for order in (["h2", "h0", "h1"], ["h1", "h2", "h0"]):
            for path in glob.glob(os.path.join(self.out, "w_*.json")):
                os.remove(path)
            self.launch(["--hosts", ",".join(order)], self.worker(), nproc=2)
            self.assertEqual(self.wait_exit(90), 0, self.stderr()[-4000:])
            infos = self.infos()
            self.assert_placement(infos, {"h0": 2, "h1": 2, "h2": 2})
            for i in infos:
                pos = order.index(i["host"])
                self.assertEqual(i["group_rank"], pos, (order, i["host"]))
                self.assertEqual(i["rank"], 2 * pos + i["local_rank"], (order, i["host"]))
        self.assert_clean()

    # ---------- (e) one worker fails ----------

    def test_e_worker_failure_stops_all(self):
        t0 = time.monotonic()
        self.launch(["--hosts", HOSTS3], self.worker("--fail-rank", "3", "--exit", "7",
                                                     "--hold", self.c.path("never"), "--max", "120"))
        code = self.wait_exit(60)
        self.assertEqual(code, 7, self.stderr()[-3000:])
        self.assertLess(time.monotonic() - t0, 60)
        self.assertRegex(self.stderr(), r"\b3\b", "the failing rank is named")
        self.assert_clean()

    # ---------- (f) SIGKILL of the launcher ----------

    def test_f_launcher_sigkill_leaves_nothing(self):
        self.launch(["--hosts", HOSTS3], self.worker("--hold", self.c.path("never"), "--max", "120"))
        self.wait_workers(6)
        t0 = time.monotonic()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.assert_clean()
        print("all remote processes gone %.2fs after SIGKILL of the launcher" % (time.monotonic() - t0),
              file=sys.stderr)

    # ---------- (g) unreachable / refusing host ----------

    def unreachable(self, bad, causes):
        t0 = time.monotonic()
        self.launch(["--hosts", "h0,%s" % bad], self.worker("--hold", self.c.path("never"), "--max", "120"))
        code = self.wait_exit(60)
        elapsed = time.monotonic() - t0
        err = self.stderr()
        self.assertNotEqual(code, 0)
        self.assertLess(elapsed, 45, "took %.1fs" % elapsed)
        self.assertIn(bad, err)
        self.assertRegex(err, r"port 22|%s:22" % bad, "the ssh port is named")
        self.assertRegex(err, causes)
        self.assert_clean()

    def test_g_unreachable_host(self):
        self.unreachable("h9", r"No route to host|timed out")

    def test_g_refusing_host(self):
        self.unreachable("hx", r"Connection refused")

    def test_g_auth_refused(self):
        # The user's --ssh-option comes before ddprun's defaults and the config file, so this
        # turns key authentication off; BatchMode then has nothing left to try.
        t0 = time.monotonic()
        self.launch(["--hosts", "h0,h1", "--ssh-option", "PubkeyAuthentication=no"],
                    self.worker("--hold", self.c.path("never"), "--max", "120"))
        code = self.wait_exit(60)
        self.assertEqual(code, 1, self.stderr()[-3000:])
        self.assertLess(time.monotonic() - t0, 45)
        err = self.stderr()
        self.assertRegex(err, r"cannot reach host h[01] over ssh")
        self.assertIn("Permission denied", err)
        self.assertEqual(self.infos(), [], "no worker may start")
        self.assert_clean()

    def test_g_no_ddprun_on_host(self):
        missing = self.c.path("not-installed", "ddprun")
        self.launch(["--hosts", HOSTS3, "--remote-ddprun", missing],
                    self.worker("--hold", self.c.path("never"), "--max", "120"))
        code = self.wait_exit(60)
        self.assertEqual(code, 1, self.stderr()[-3000:])
        err = self.stderr()
        self.assertRegex(err, r"host h[012]: cannot run " + re.escape(missing))
        self.assertIn("--remote-ddprun", err)
        self.assert_clean()

    def test_g_agent_never_starts(self):
        # h1's session is up but its "ddprun" never starts (a login script or a stalled mount
        # holding it; here it waits on stdin, which the launcher closes when it gives up). One
        # connection in flight: h1 held it and the launcher used to wait for ever, silently.
        hang = self.c.path("hang-on-h1.sh")
        with open(hang, "w") as f:
            f.write('#!/bin/sh\n[ "$(hostname)" = h1 ] && exec cat >/dev/null\nexec %s "$@"\n' % DDPRUN)
        os.chmod(hang, 0o755)
        self.launch(["--hosts", "h1,h0,h2", "--ssh-max-inflight", "1", "--remote-ddprun", hang],
                    self.worker("--hold", self.c.path("never"), "--max", "120"),
                    extra=["--ssh-option", "ConnectTimeout=2", "--rdzv-conf", "join_timeout=3"])
        code = self.wait_exit(60)
        err = self.stderr()
        self.assertEqual(code, 1, err[-3000:])
        self.assertIn("ddprun: error: host h1: ssh connected but ddprun's agent did not start within 5 s", err)
        self.assertRegex(err, r"ddprun: check that this works from this machine [^\n]* h1 true")
        self.assertNotIn("[h0", err)  # the launch failed before the next host's turn
        self.assert_clean()

    # ---------- (k) one ssh connection drops ----------

    def test_k_ssh_connection_drop(self):
        self.launch(["--hosts", HOSTS3], self.worker("--hold", self.c.path("never"), "--max", "120"))
        infos = self.wait_workers(6)
        clients = [pid for pid in self.c.pids_in(self.c.launcher_ns)
                   if os.path.basename(self.c_argv(pid)[0] if self.c_argv(pid) else "") == "ssh"
                   and "h1" in self.c_argv(pid)]
        self.assertEqual(len(clients), 1, "expected exactly one ssh client for h1")
        os.kill(clients[0], signal.SIGKILL)
        code = self.wait_exit(45)
        self.assertEqual(code, 128 + signal.SIGKILL, self.stderr()[-3000:])  # the dropped host's ssh status
        self.assertIn("host h1", self.stderr())
        self.assert_clean()
        # h1's agent saw its stdin close and stopped its workers with SIGTERM (not cut off by SIGKILL).
        for i in infos:
            if i["host"] == "h1":
                path = os.path.join(self.out, "sig_%d_%d" % (i["rank"], i["pid"]))
                self.assertTrue(os.path.exists(path), "rank %d on h1 was not stopped with a signal" % i["rank"])

    def c_argv(self, pid):
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            return []

    # ---------- (h) ranks filter ----------

    def test_h_ranks_filter(self):
        self.launch(["--hosts", HOSTS3], self.worker("--lines", "5"), extra=["--ranks-filter", "0,3-5"])
        self.assertEqual(self.wait_exit(90), 0)
        self.assertEqual(len(self.infos()), 6, "every rank must still run")
        ranks = {r for _h, r, _t in self.worker_lines()}
        self.assertEqual(ranks, {0, 3, 4, 5})
        for rank in (0, 3, 4, 5):
            self.assertEqual(sum(1 for _h, r, t in self.worker_lines() if r == rank and t.startswith("line ")), 5)
        self.assert_clean()

    # ---------- (i) arguments reach the worker intact ----------

    def test_i_args_intact(self):
        args = ["a b", "it's", 'say "hi"', "$HOME", "`id`", "back\\slash", "", "semi;colon && true", "*",
                "multi\nline", "--nproc-per-node", "9", "-- ", "'", "\"", "ünï"]
        self.launch(["--hosts", HOSTS3], self.worker(args=args))
        self.assertEqual(self.wait_exit(90), 0)
        infos = self.infos()
        self.assertEqual(len(infos), 6)
        for i in infos:
            self.assertEqual(i["args"], args, "rank %d on %s" % (i["rank"], i["host"]))
            self.assertEqual(i["cwd"], self.c.dir, "remote cwd defaults to the launcher's cwd")
        self.assert_clean()

    # ---------- (j) SIGTERM of the launcher ----------

    def test_j_launcher_sigterm(self):
        self.launch(["--hosts", HOSTS3], self.worker("--hold", self.c.path("never"), "--max", "120"))
        infos = self.wait_workers(6)
        os.kill(self.proc.pid, signal.SIGTERM)
        self.assertEqual(self.wait_exit(45), 128 + signal.SIGTERM)
        self.assert_clean()
        # The workers were stopped with SIGTERM (forwarded), not just cut off.
        for i in infos:
            path = os.path.join(self.out, "sig_%d_%d" % (i["rank"], i["pid"]))
            self.assertTrue(os.path.exists(path), "rank %d on %s got no signal" % (i["rank"], i["host"]))
            with open(path) as f:
                self.assertIn("signal %d" % signal.SIGTERM, f.read())

    # ---------- (l) detached grandchildren end with the job on every host ----------

    DAEMON = (
        "import os, signal, sys\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        fd = os.open(os.devnull, os.O_RDWR)\n"
        "        [os.dup2(fd, i) for i in (0, 1, 2)]\n"
        "        os.write(w, str(os.getpid()).encode())\n"
        "        while True:\n"
        "            signal.pause()\n"
        "    os._exit(0)\n"
        "os.close(w)\n"
        "os.wait()\n"
        "pid = os.read(r, 32).decode()\n"
        "path = os.path.join(sys.argv[1], 'daemon_%s' % os.environ['RANK'])\n"
        "open(path + '.tmp', 'w').write(pid)\n"
        "os.rename(path + '.tmp', path)\n"
        "signal.pause()\n")

    def daemons_then(self, how):
        script = os.path.join(self.out, "daemon.py")
        with open(script, "w") as f:
            f.write(self.DAEMON)
        self.launch(["--hosts", HOSTS3], [PYTHON, script, self.out], extra=["--no-python"])
        deadline = time.monotonic() + 60
        while len(glob.glob(os.path.join(self.out, "daemon_*[0-9]"))) < 6:
            self.assertIsNone(self.proc.poll(), self.stderr()[-3000:])
            self.assertLess(time.monotonic(), deadline, "daemons not started")
            time.sleep(0.05)
        daemons = []
        for path in glob.glob(os.path.join(self.out, "daemon_*[0-9]")):
            with open(path) as f:
                daemons.append(int(f.read()))
        for pid in daemons:
            os.kill(pid, 0)  # alive, re-parented away from its worker
        os.kill(self.proc.pid, how)
        self.wait_exit(45)
        self.assert_clean()  # every process of the bed's hosts, the daemons included
        for pid in daemons:
            try:
                with open("/proc/%d/status" % pid) as f:
                    self.assertIn("State:\tZ", f.read(), "daemon %d left" % pid)
            except FileNotFoundError:
                pass

    def test_l_daemons_end_on_launcher_sigterm(self):
        self.daemons_then(signal.SIGTERM)

    def test_l_daemons_end_on_launcher_sigkill(self):
        self.daemons_then(signal.SIGKILL)

    # ---------- (m) --metrics-port / --metrics-host reach every host's agent ----------

    def test_m_metrics_on_every_host(self):
        hold = self.c.path("release_m")
        self.launch(["--hosts", HOSTS3], self.worker("--hold", hold, "--max", "120"),
                    extra=["--metrics-port", "9400", "--metrics-host", "0.0.0.0"])
        self.wait_workers(6)
        # Scraped from the launcher's namespace over the bed's network with a real HTTP client;
        # every line parsed by the strict parser of tests/metrics.
        fetch = ("import sys, urllib.request\n"
                 "with urllib.request.urlopen(sys.argv[1], timeout=10) as r:\n"
                 "    sys.stdout.write(r.read().decode())\n")
        for host, addr in zip(self.c.hosts, self.c.addrs):
            p = self.c.run_in_launcher_ns([PYTHON, "-c", fetch, "http://%s:9400/metrics" % addr],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = p.communicate(timeout=30)
            self.assertEqual(p.returncode, 0, "%s: %s" % (host, err.decode()[-2000:]))
            families = prom_text.parse(out.decode())
            self.assertEqual(prom_text.value(families, "ddprun_agent_workers", state="running"), 2, host)
            self.assertEqual(prom_text.value(families, "ddprun_agent_rounds_total"), 1, host)
            self.assertEqual(prom_text.value(families, "ddprun_agent_in_rendezvous"), 0, host)
        open(hold, "w").close()
        self.assertEqual(self.wait_exit(60), 0, self.stderr()[-3000:])
        self.assert_clean()



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
