"""The fan-out launcher against a fake ssh: a script first on PATH that runs the remote command
on this machine with `sh -c`, so every "host" is a local agent and the whole launch (rendezvous,
agents, workers, output relay, launch tree) runs without root, namespaces or sshd. tests/ssh
covers the real OpenSSH client and server; this covers what ssh itself does not change: how the
launcher reads each session's output and what it makes of the session's end.

Run by ctest (ddprun_add_python_test) with DDPRUN_BIN_DIR and PYTHON_EXEC set. Every launch has
a deadline well below the ctest TIMEOUT.

The fake ssh takes the options the launcher passes (-T, -F, -p, -o), logs the destination to
$FAKE_SSH_LOG, and acts per destination: listed in $FAKE_SSH_EXIT0 it ends the session with 0
without running anything (a ForceCommand, a login script that exits), in $FAKE_SSH_REFUSE it
fails as an unreachable host does (ssh's message, exit 255), in $FAKE_SSH_TIMEOUT the same after
a second (a ConnectTimeout), in $FAKE_SSH_HANG the session is up
but nothing it runs ever starts ddprun (a login script that hangs, a stalled NFS mount): it waits
until the launcher ends it. `ssh -G HOST` prints the host's configuration as ssh would. With
$FAKE_SSH_ENV_I set, the remote command gets none of the launcher's environment but PATH.
"""
import os
import re
import resource
import select
import signal
import subprocess
import tempfile
import time
import unittest

BIN = os.path.abspath(os.path.join(os.environ["DDPRUN_BIN_DIR"], "ddprun"))
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
TREE = ["--ssh-tree-threshold", "1", "--ssh-tree-fanout", "2"]

FAKE_SSH = r"""#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in
    -T) shift ;;
    -G) echo "hostname $2"; echo "port 22"; exit 0 ;;
    -F|-p|-o) shift 2 ;;
    *) break ;;
  esac
done
dest=$1
shift
echo "$dest" >> "$FAKE_SSH_LOG"
case " $FAKE_SSH_EXIT0 " in *" $dest "*) exit 0 ;; esac
case " $FAKE_SSH_REFUSE " in
  *" $dest "*) echo "ssh: connect to host $dest port 22: Connection refused" >&2; exit 255 ;;
esac
case " $FAKE_SSH_TIMEOUT " in
  *" $dest "*) sleep 1; echo "ssh: connect to host $dest port 22: Connection timed out" >&2; exit 255 ;;
esac
case " $FAKE_SSH_HANG " in *" $dest "*) echo "fake ssh: $dest holds the session" >&2; exec sleep 300 ;; esac
# As a real remote login: nothing of the launcher's environment but PATH (which has this script).
[ -n "$FAKE_SSH_ENV_I" ] && exec env -i PATH="$PATH" sh -c "$*"
exec sh -c "$*"
"""

# The worker: for each size in argv[1] (a comma list) one line of that many bytes, its rank and
# index in front, on stdout; then the same sizes in reverse order on stderr.
WORKER = r"""import os, sys
rank = int(os.environ["RANK"])
sizes = [int(s) for s in sys.argv[1].split(",")]
def line(i, n):
    body = "%d.%d:" % (rank, i)
    body += "".join(chr(ord("a") + (k + i) % 26) for k in range(n - len(body)))
    return body
for i, n in enumerate(sizes):
    sys.stdout.write(line(i, n) + "\n")
    sys.stdout.flush()
for i, n in enumerate(reversed(sizes)):
    sys.stderr.write(line(i, n) + "\n")
    sys.stderr.flush()
"""

# Lines longer than the launcher's 64 KiB reads, exactly one read long, and several reads long.
LINE_SIZES = [200_000, 65_536, 65_529, 10, 300_001]
PREFIX_RE = re.compile(r"^\[(h\d+):(\d+)\]:")


def expected_text(rank, sizes):
    """What a worker wrote on one stream, its lines joined without their newlines."""
    out = ""
    for i, n in enumerate(sizes):
        body = "%d.%d:" % (rank, i)
        out += body + "".join(chr(ord("a") + (k + i) % 26) for k in range(n - len(body)))
    return out


class FakeSshCase(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="ddprun-fake-ssh-")
        self.dir = self.tmp.name
        bindir = os.path.join(self.dir, "bin")
        os.mkdir(bindir)
        ssh = os.path.join(bindir, "ssh")
        with open(ssh, "w") as f:
            f.write(FAKE_SSH)
        os.chmod(ssh, 0o755)
        self.bindir = bindir
        self.log = os.path.join(self.dir, "ssh.log")
        with open(os.path.join(self.dir, "worker.py"), "w") as f:
            f.write(WORKER)

    def tearDown(self):
        self.tmp.cleanup()

    def ddprun(self, args, env_extra=None, timeout=60, preexec_fn=None, launcher_addr="127.0.0.1"):
        env = dict(os.environ)
        env.update({"PATH": self.bindir + ":" + env.get("PATH", "/usr/bin:/bin"),
                    "PYTHON_EXEC": PYTHON, "FAKE_SSH_LOG": self.log, "FAKE_SSH_EXIT0": "",
                    "FAKE_SSH_REFUSE": "", "FAKE_SSH_HANG": "", "FAKE_SSH_ENV_I": "", "DDPRUN_LOG_LEVEL": "info"})
        env.update(env_extra or {})
        argv = [BIN] + (["--launcher-addr", launcher_addr] if launcher_addr else [])
        argv += ["--shutdown-timeout", "5"] + args
        return subprocess.run(argv, cwd=self.dir, env=env, capture_output=True, timeout=timeout, preexec_fn=preexec_fn)

    def ssh_destinations(self):
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return f.read().split()


class SessionEndsBeforeTheAgent(FakeSshCase):
    """An ssh session that ends with 0 before its agent said it was ready ran nothing there."""

    def check(self, r, host):
        err = r.stderr.decode(errors="replace")
        self.assertEqual(r.returncode, 1, err)
        self.assertRegex(err, r"ddprun: error: host %s\b[^\n]*: the ssh session ended \(exit 0\) before ddprun's agent "
                              r"started there" % host)
        self.assertIn("--remote-ddprun", err)
        self.assertIn("ForceCommand", err)
        return err

    def test_flat_remote_ddprun_that_exits_0(self):
        r = self.ddprun(["--hosts", "h1,h2", "--remote-ddprun", "/bin/true", "worker.py", "10"])
        self.check(r, "h[12]")

    def test_flat_one_host_ends_its_session(self):
        r = self.ddprun(["--hosts", "h1,h2", "worker.py", "10"], env_extra={"FAKE_SSH_EXIT0": "h2"})
        self.check(r, "h2")

    def test_tree_host_below_a_node_ends_its_session(self):
        # launcher -> h0 -> h1; launcher -> h2 -> h3: h3 is started by the node h2.
        r = self.ddprun(TREE + ["--hosts", "h0,h1,h2,h3", "worker.py", "10"], env_extra={"FAKE_SSH_EXIT0": "h3"})
        err = self.check(r, "h3")
        self.assertIn("launch tree: launcher -> h2 -> h3", err)
        self.assertEqual(sorted(self.ssh_destinations()), ["h0", "h1", "h2", "h3"])


class UnreachableHost(FakeSshCase):
    def test_hint_is_the_launchers_own_ssh_command(self):
        cfg = os.path.join(self.dir, "ssh config")
        open(cfg, "w").close()
        r = self.ddprun(["--hosts", "h0,u@h1", "--ssh-port", "2222", "--ssh-config", cfg, "--ssh-option",
                         "ConnectTimeout=3", "worker.py", "10"], env_extra={"FAKE_SSH_REFUSE": "u@h1"})
        err = r.stderr.decode(errors="replace")
        self.assertEqual(r.returncode, 1, err)
        self.assertIn("ddprun: error: cannot reach host u@h1 over ssh: ssh: connect to host u@h1 port 22", err)
        hint = [line for line in err.splitlines() if line.startswith("ddprun: check that")]
        self.assertEqual(len(hint), 1, err)
        ssh = os.path.join(self.bindir, "ssh")
        self.assertIn("%s -T -F '%s' -p 2222 -o ConnectTimeout=3 -o BatchMode=yes" % (ssh, cfg), hint[0])
        self.assertTrue(hint[0].endswith(" u@h1 true"), hint[0])


    def test_every_unreachable_host_is_named(self):
        # h1 fails at once, h2 and h3 a second later (their ConnectTimeout). Before, the first
        # failure cut the others' ssh: only h1 was named, and a launch found one bad host per run.
        r = self.ddprun(["--hosts", "h0,h1,h2,h3", "worker.py", "10"],
                        env_extra={"FAKE_SSH_REFUSE": "h1", "FAKE_SSH_TIMEOUT": "h2 h3"})
        err = r.stderr.decode(errors="replace")
        self.assertEqual(r.returncode, 1, err)
        self.assertIn("cannot reach host h1 over ssh: ssh: connect to host h1 port 22: Connection refused", err)
        for h in ("h2", "h3"):
            self.assertIn("cannot reach host %s over ssh: ssh: connect to host %s port 22: Connection timed out" %
                          (h, h), err)


class UnresolvableHost(FakeSshCase):
    def test_first_host_that_does_not_resolve_gets_the_host_error(self):
        # The launcher asks the route towards the first host for its own address: a first host
        # that does not resolve is the host list's mistake, said as for any other host.
        r = self.ddprun(["--hosts", "nosuch.invalid,h0", "worker.py", "10"], launcher_addr=None)
        err = r.stderr.decode(errors="replace")
        self.assertEqual(r.returncode, 1, err)
        self.assertIn("ddprun: error: cannot reach host nosuch.invalid over ssh: cannot resolve nosuch.invalid", err)
        self.assertRegex(err, r"check that this works from this machine \(host name, [^\n]*: \S*/ssh -T [^\n]* "
                              r"nosuch.invalid true")
        self.assertNotIn("--launcher-addr", err)
        self.assertEqual(self.ssh_destinations(), [])


class AgentNeverStarts(FakeSshCase):
    """A host whose ssh session is up but whose agent never starts is named, and the launch ends."""

    def test_alone_in_flight_it_fails_the_launch_at_its_deadline(self):
        # One connection in flight: the hung host held it, and the launcher waited for ever
        # without a word. The deadline is ssh's ConnectTimeout plus the join timeout: 1 + 2 s.
        start = time.monotonic()
        r = self.ddprun(["--hosts", "h0,h1", "--ssh-max-inflight", "1", "--ssh-option", "ConnectTimeout=1",
                         "--rdzv-conf", "join_timeout=2", "worker.py", "10"], env_extra={"FAKE_SSH_HANG": "h0"})
        elapsed = time.monotonic() - start
        err = r.stderr.decode(errors="replace")
        self.assertEqual(r.returncode, 1, err)
        self.assertIn("ddprun: error: host h0: ssh connected but ddprun's agent did not start within 3 s: "
                      "fake ssh: h0 holds the session\n", err)
        hint = [line for line in err.splitlines() if line.startswith("ddprun: check that")]
        self.assertEqual(len(hint), 1, err)
        self.assertIn(" -o ConnectTimeout=1 -o BatchMode=yes", hint[0])
        self.assertIn(" h0 true", hint[0])
        self.assertIn("join_timeout", hint[0])
        self.assertNotIn("had not started", err)  # named once
        self.assertEqual(self.ssh_destinations(), ["h0"])  # the launch failed before h1's turn
        self.assertLess(elapsed, 30, err)

    def test_named_when_the_rendezvous_gives_up_first(self):
        # Its deadline (60 + 2 s) is far: the other host's agent gives up on the rendezvous after
        # 2 s and the job fails; the host it waited for is named.
        r = self.ddprun(["--hosts", "h0,h1", "--ssh-option", "ConnectTimeout=60", "--rdzv-conf", "join_timeout=2",
                         "worker.py", "10"], env_extra={"FAKE_SSH_HANG": "h1"})
        err = r.stderr.decode(errors="replace")
        self.assertNotEqual(r.returncode, 0, err)
        self.assertRegex(err, r"\nddprun: host h1: ddprun's agent had not started there when the job stopped, "
                              r"\d+\.\d s after ssh began connecting\n")
        self.assertRegex(err, r"ddprun: check that this works from this machine [^\n]* h1 true")
        self.assertEqual(sorted(self.ssh_destinations()), ["h0", "h1"])

    def test_named_when_the_launcher_is_interrupted(self):
        # Ctrl-C on a launcher that waits for the hung host: it says whom it was waiting for.
        env = dict(os.environ)
        env.update({"PATH": self.bindir + ":" + env.get("PATH", "/usr/bin:/bin"), "PYTHON_EXEC": PYTHON,
                    "FAKE_SSH_LOG": self.log, "FAKE_SSH_HANG": "h0"})
        p = subprocess.Popen([BIN, "--launcher-addr", "127.0.0.1", "--hosts", "h0,h1", "--ssh-max-inflight", "1",
                              "worker.py", "10"], cwd=self.dir, env=env, stderr=subprocess.PIPE)
        seen = b""
        try:
            # Until the launcher relays the hung session's line (bounded): h0's ssh is up.
            deadline = time.monotonic() + 30
            while b"[h0] fake ssh: h0 holds the session" not in seen:
                ready, _, _ = select.select([p.stderr], [], [], max(0.0, deadline - time.monotonic()))
                chunk = os.read(p.stderr.fileno(), 65536) if ready else b""
                self.assertTrue(chunk, "no line of the hung session: %r" % seen)
                seen += chunk
            p.send_signal(signal.SIGINT)
            _, rest = p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        err = (seen + rest).decode(errors="replace")
        self.assertEqual(p.returncode, 128 + signal.SIGINT, err)
        self.assertIn("ddprun: host h0: ddprun's agent had not started there when the job stopped", err)

    def test_tree_node_names_the_host_below_it(self):
        # launcher -> h0 -> h1; launcher -> h2 -> h3: h1 hangs below the node h0, which names it
        # (at its deadline or when the other agents' rendezvous gives up, whichever comes first).
        r = self.ddprun(TREE + ["--hosts", "h0,h1,h2,h3", "--ssh-option", "ConnectTimeout=1", "--rdzv-conf",
                                "join_timeout=2", "worker.py", "10"], env_extra={"FAKE_SSH_HANG": "h1"})
        err = r.stderr.decode(errors="replace")
        self.assertNotEqual(r.returncode, 0, err)
        self.assertRegex(err, r"\[h0\] ddprun: (error: )?host h1 \(launch tree: launcher -> h0 -> h1\): "
                              r"(ssh connected but ddprun's agent did not start within 3 s|"
                              r"ddprun's agent had not started there when the job stopped)")


class CommandTooLongForExec(FakeSshCase):
    def test_e2big_names_the_host_and_what_to_shorten(self):
        # Under the one-argument limit the launcher checks up front, over the whole exec's: with a
        # 256 KiB stack Linux takes 128 KiB of arguments and environment together. Each quote of
        # the argument takes 4 bytes in the remote command ('\''); the environment is inherited by ssh.
        def small_stack():
            resource.setrlimit(resource.RLIMIT_STACK, (256 * 1024, resource.getrlimit(resource.RLIMIT_STACK)[1]))

        r = self.ddprun(["--hosts", "h0", "worker.py", "'" * 30_000], env_extra={"PADDING": "p" * 60_000},
                        preexec_fn=small_stack)
        err = r.stderr.decode(errors="replace")
        self.assertEqual(r.returncode, 1, err)
        self.assertRegex(err, r"ddprun: error: host h0: cannot start ssh: its command line \(\d+ bytes\) and this "
                              r"process's environment are too long for one exec: .*Argument list too long")
        self.assertIn("ddprun: shorten the program's arguments", err)
        self.assertNotIn("OpenSSH", err)
        self.assertEqual(self.ssh_destinations(), [])


class LongLines(FakeSshCase):
    """Every byte of a worker's output stays under its [host:RANK]: prefix, whatever the line length."""

    def check(self, args, hosts):
        r = self.ddprun(args + ["--hosts", ",".join(hosts), "worker.py", ",".join(map(str, LINE_SIZES))])
        out = r.stdout.decode()
        err = r.stderr.decode(errors="replace")
        self.assertEqual(r.returncode, 0, err[-3000:])
        for name, text, sizes in (("stdout", out, LINE_SIZES), ("stderr", err, list(reversed(LINE_SIZES)))):
            per_rank = {}
            for line in text.split("\n")[:-1]:
                m = PREFIX_RE.match(line)
                if m is None:
                    # Only the launcher's and the agents' own log lines stand without a rank.
                    self.assertTrue(line.startswith("[ddprun"), "%s: a line outside any worker's prefix: %r"
                                    % (name, line[:200]))
                    continue
                host, rank = m.group(1), int(m.group(2))
                self.assertEqual(host, hosts[rank], line[:100])
                per_rank.setdefault(rank, []).append(line[m.end():])
            self.assertEqual(sorted(per_rank), list(range(len(hosts))), name)
            for rank, pieces in per_rank.items():
                self.assertTrue(all(pieces), "%s: an empty piece of rank %d" % (name, rank))
                got = "".join(pieces)
                self.assertEqual(len(got), sum(sizes), "%s of rank %d: bytes lost or added" % (name, rank))
                self.assertEqual(got, expected_text(rank, sizes), "%s of rank %d differs" % (name, rank))

    def test_flat(self):
        self.check([], ["h0", "h1"])

    def test_tree(self):
        # Depth 3 (launcher -> h0 -> h1 -> h2): h2's lines pass two tree nodes.
        self.check(TREE, ["h%d" % i for i in range(7)])


class PromptWithoutNewline(FakeSshCase):
    """A worker's line without a newline (a prompt, a progress bar) reaches the launcher's console
    once it has waited 100 ms on its host and again on the launcher, through a launch tree too;
    before, the relay held it until the line ended."""

    PROG = ("import os, sys, time\n"
            "rank = int(os.environ['RANK'])\n"
            "sys.stdout.write('(Pdb) '); sys.stdout.flush()\n"
            "deadline = time.monotonic() + 120\n"
            "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline: time.sleep(0.01)\n"
            "print('continue %d' % rank)\n")

    def check(self, args, hosts):
        gate = os.path.join(self.dir, "answered")
        with open(os.path.join(self.dir, "prompt.py"), "w") as f:
            f.write(self.PROG)
        env = dict(os.environ)
        env.update({"PATH": self.bindir + ":" + env.get("PATH", "/usr/bin:/bin"), "PYTHON_EXEC": PYTHON,
                    "FAKE_SSH_LOG": self.log, "FAKE_SSH_EXIT0": "", "FAKE_SSH_REFUSE": "", "FAKE_SSH_HANG": "",
                    "FAKE_SSH_ENV_I": ""})
        proc = subprocess.Popen([BIN, "--launcher-addr", "127.0.0.1", "--shutdown-timeout", "5", "--hosts",
                                 ",".join(hosts)] + args + ["prompt.py", gate],
                                cwd=self.dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out = b""
            want = [b"[%s:%d]:(Pdb) " % (h.encode(), r) for r, h in enumerate(hosts)]
            deadline = time.monotonic() + 30  # the workers wait 120 s for the gate
            while not all(w in out for w in want):
                left = deadline - time.monotonic()
                self.assertGreater(left, 0, "the prompts never reached the console: %r" % out)
                r, _, _ = select.select([proc.stdout], [], [], left)
                if r:
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    self.assertTrue(chunk, "the launcher closed stdout before the prompts: %r" % out)
                    out += chunk
            open(gate, "w").close()
            rest, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        self.assertEqual(proc.returncode, 0, err.decode(errors="replace")[-3000:])
        text = (out + rest).decode()
        # Each host's line ends whole: on its prompt's line, or under its prefix where another
        # host's prompt took the console between.
        for r, h in enumerate(hosts):
            self.assertRegex(text, r"(\[%s:%d\]:\(Pdb\) |\[%s:%d\]:)continue %d\n" % (h, r, h, r, r))
        for line in text.split("\n")[:-1]:
            self.assertRegex(line, r"^\[h\d+:\d+\]:")

    def test_flat(self):
        self.check(["--nproc-per-node", "1"], ["h0", "h1"])

    def test_tree(self):
        self.check(TREE + ["--nproc-per-node", "1"], ["h0", "h1", "h2"])


class AgentSettingsReachTheHosts(FakeSshCase):
    """torch's agent settings (TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT here) reach each host's
    agent, which reads them: from the launcher's environment by default, and by --env, on hosts
    whose sessions start with none of the launcher's environment."""

    def check(self, args, env_extra, hosts):
        r = self.ddprun(["--hosts", ",".join(hosts), "--nproc-per-node", "1"] + args + ["--no-python", "true"],
                        env_extra=dict(env_extra, FAKE_SSH_ENV_I="1"))
        err = r.stderr.decode(errors="replace")
        self.assertEqual(r.returncode, 0, err)
        for h in hosts:
            self.assertIn("[ddprun@%s info] TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT=soon is not a number of seconds: "
                          "ignored" % h, err)

    def test_from_the_launchers_environment(self):
        self.check([], {"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT": "soon"}, ["h0", "h1"])

    def test_by_env_flag_through_a_tree(self):
        self.check(TREE + ["--env", "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT=soon"], {}, ["h0", "h1", "h2"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
