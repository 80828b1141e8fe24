"""ddprun-rdzvd as a systemd service, without systemd: the test plays the service manager.

It binds the notification socket (abstract and path names), starts the real daemon with
NOTIFY_SOCKET pointing at it and waits for READY=1, then checks the port is already accepting.
--token-file: the token is used (a wrong one is refused) and never logged; bad files are refused
with exit 2. --log-format json: every stderr line parses. DDPRUN_LOG_FORMAT=json does the same for
the agent. The checked-in unit goes through `systemd-analyze verify` when that is installed.
Every wait is bounded (socket timeouts, subprocess timeouts); nothing sleeps.
"""
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import unittest

BIN = os.environ.get("DDPRUN_BIN_DIR", "")
SRC = os.environ.get("DDPRUN_SOURCE_DIR", "")
RDZVD = os.path.join(BIN, "ddprun-rdzvd")
DDPRUN = os.path.join(BIN, "ddprun")


class Daemon:
    """ddprun-rdzvd on 127.0.0.1, port 0; stdout's first line gives the port."""

    def __init__(self, args, env=None):
        e = dict(os.environ)
        e.pop("NOTIFY_SOCKET", None)
        e.update(env or {})
        self.proc = subprocess.Popen([RDZVD, "--host", "127.0.0.1", "--port", "0"] + args,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e, text=True)
        self.port = None

    def read_port(self):
        line = self.proc.stdout.readline()  # the daemon prints it at once or exits (EOF)
        if not line.startswith("listening on 127.0.0.1:"):
            raise AssertionError("no listening line: %r; stderr: %s" % (line, self.stop()))
        self.port = int(line.rsplit(":", 1)[1])
        return self.port

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
        _, err = self.proc.communicate(timeout=30)
        return err


def fake_systemd(abstract, tmp):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = "@ddprun-rdzvd-test-%d" % os.getpid()
        s.bind("\0" + name[1:])
    else:
        name = os.path.join(tmp, "notify")
        s.bind(name)
    s.settimeout(30)
    return s, name


def job(port, token, rdzv_id, timeout=120):
    env = dict(os.environ, DDPRUN_RDZV_TOKEN=token)
    return subprocess.run([DDPRUN, "--master-port", "0", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", "127.0.0.1:%d" % port, "--rdzv-id", rdzv_id, "/bin/true"],
                          capture_output=True, text=True, timeout=timeout, env=env)


class Service(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ddprun-rdzvd-service-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def write(self, name, content, mode=0o600):
        path = os.path.join(self.tmp, name)
        with open(path, "w") as f:
            f.write(content)
        os.chmod(path, mode)
        return path

    def check_ready(self, abstract):
        sock, name = fake_systemd(abstract, self.tmp)
        d = Daemon([], env={"NOTIFY_SOCKET": name})
        try:
            msg = sock.recv(4096).decode()
            # READY=1 means: accepting. Connect before reading the stdout line.
            status = dict(kv.split("=", 1) for kv in msg.split("\n"))
            self.assertEqual(status["READY"], "1", msg)
            self.assertTrue(status["STATUS"].startswith("listening on 127.0.0.1:"), msg)
            port = int(status["STATUS"].rsplit(":", 1)[1])
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
            self.assertEqual(d.read_port(), port)
        finally:
            err = d.stop()
            sock.close()
        self.assertEqual(d.proc.returncode, 0, err)
        self.assertNotIn("cannot tell systemd", err)

    def test_notify_ready_abstract_socket(self):
        self.check_ready(abstract=True)

    def test_notify_ready_path_socket(self):
        self.check_ready(abstract=False)

    def test_unreachable_notify_socket_is_a_warning(self):
        d = Daemon([], env={"NOTIFY_SOCKET": os.path.join(self.tmp, "nobody-listens")})
        d.read_port()
        err = d.stop()
        self.assertEqual(d.proc.returncode, 0, err)
        self.assertIn("cannot tell systemd the daemon is ready: cannot send to NOTIFY_SOCKET=", err)

    def test_token_file_and_json_logs(self):
        token = "svc-test-token-%d" % os.getpid()
        path = self.write("token", token + "\n")
        d = Daemon(["--token-file", path, "--log-format", "json", "--log-level", "debug"])
        try:
            port = d.read_port()
            ok = job(port, token, "good")
            self.assertEqual(ok.returncode, 0, ok.stderr)
            bad = job(port, token + "x", "bad")
            self.assertNotEqual(bad.returncode, 0)
            self.assertIn("authentication failed", bad.stderr)
        finally:
            err = d.stop()
        self.assertEqual(d.proc.returncode, 0, err)
        self.assertNotIn(token, err)
        lines = err.splitlines()
        self.assertGreater(len(lines), 3)
        for line in lines:
            obj = json.loads(line)  # every line, not only the ones that look like JSON
            self.assertEqual(list(obj), ["time", "level", "logger", "pid", "message"], line)
            self.assertEqual(obj["logger"], "ddprun-rdzvd")
            self.assertEqual(obj["pid"], d.proc.pid)
            self.assertIn(obj["level"], ("trace", "debug", "info", "warning", "error", "critical"))
            self.assertRegex(obj["time"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
        self.assertTrue(any("--token-file " + path in json.loads(l)["message"] for l in lines), err)

    def test_world_readable_token_file_warns(self):
        path = self.write("token", "abc\n", 0o644)
        d = Daemon(["--token-file", path, "--log-format", "json"])
        d.read_port()
        err = d.stop()
        warnings = [json.loads(l) for l in err.splitlines() if json.loads(l)["level"] == "warning"]
        self.assertTrue(any("readable by every user (mode 0644)" in w["message"] for w in warnings), err)
        self.assertNotIn('"abc', err)

    def test_bad_token_files_are_refused(self):
        cases = [
            (self.write("empty", "\n"), "is empty"),
            (os.path.join(self.tmp, "missing"), "cannot open --token-file"),
            (self.tmp, "is not a regular file"),
        ]
        for path, expect in cases:
            r = subprocess.run([RDZVD, "--port", "0", "--token-file", path], capture_output=True, text=True,
                               timeout=30)
            self.assertEqual(r.returncode, 2, (path, r.stderr))
            self.assertIn(expect, r.stderr)
            self.assertIn(path, r.stderr)
            self.assertEqual(r.stdout, "", "it must not start listening")
        r = subprocess.run([RDZVD, "--token", "a", "--token-file", cases[0][0]], capture_output=True, text=True,
                           timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--token on the command line is refused", r.stderr)
        self.assertNotIn(" a\n", r.stderr)
        for bad in ("nan", "inf", "-1", "1e9", "abc"):
            r = subprocess.run([RDZVD, "--port", "0", "--job-expiry", bad], capture_output=True, text=True,
                               timeout=30)
            self.assertEqual(r.returncode, 2, (bad, r.stderr))
            self.assertIn("--job-expiry " + bad + ": not a number of seconds from 0 to 2592000", r.stderr)
            self.assertEqual(r.stdout, "", "it must not start listening")
        # A value the store would take but no GET could return.
        r = subprocess.run([RDZVD, "--port", "0", "--max-value-bytes", "2000", "--max-queued-reply-bytes", "2007"],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--max-value-bytes 2000 is more than one reply may queue (--max-queued-reply-bytes 2007",
                      r.stderr)
        self.assertEqual(r.stdout, "", "it must not start listening")
        r = subprocess.run([RDZVD, "--log-format", "xml"], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--log-format", r.stderr)

    def test_agent_json_logs_from_the_environment(self):
        env = dict(os.environ, DDPRUN_LOG_FORMAT="json", DDPRUN_LOG_LEVEL="info")
        r = subprocess.run([DDPRUN, "--master-port", "0", "--nproc-per-node", "2", "/bin/true"], capture_output=True,
                           text=True, timeout=60, env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stderr.splitlines()
        self.assertTrue(lines, "no log lines at info level")
        for line in lines:
            obj = json.loads(line)
            self.assertTrue(obj["logger"].startswith("ddprun"), line)

    def test_unit_file_verifies(self):
        analyze = shutil.which("systemd-analyze")
        if not analyze:
            self.skipTest("systemd-analyze is not installed (Debian package systemd)")
        with open(os.path.join(SRC, "packaging", "systemd", "ddprun-rdzvd.service")) as f:
            unit = f.read()
        self.assertIn("ExecStart=/usr/bin/ddprun-rdzvd --token-file ${CREDENTIALS_DIRECTORY}/token", unit)
        self.assertIn("Type=notify", unit)
        # The unit as installed under another prefix: ExecStart names this build's binary.
        path = self.write("ddprun-rdzvd.service", unit.replace("/usr/bin/ddprun-rdzvd", RDZVD), 0o644)
        r = subprocess.run([analyze, "verify", path], capture_output=True, text=True, timeout=60, cwd=self.tmp)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual((r.stdout + r.stderr).strip(), "")

    def unit_text(self):
        with open(os.path.join(SRC, "packaging", "systemd", "ddprun-rdzvd.service")) as f:
            return f.read()

    def unit_argv(self, unit, args, creds):
        """ExecStart= expanded as systemd does: ${CREDENTIALS_DIRECTORY} and $DDPRUN_RDZVD_ARGS
        (split on whitespace), the binary taken from this build."""
        line = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
        argv = []
        for word in shlex.split(line):
            if word == "$DDPRUN_RDZVD_ARGS":
                argv += args.split()
            else:
                argv.append(word.replace("${CREDENTIALS_DIRECTORY}", creds))
        self.assertEqual(argv[0], "/usr/bin/ddprun-rdzvd")
        return [RDZVD] + argv[1:]

    def test_unit_execstart_by_hand(self):
        """The unit's own command line with what systemd hands it: the credential directory
        (LoadCredential=), NOTIFY_SOCKET, DDPRUN_RDZVD_ARGS. READY=1, the token works, SIGTERM
        (systemctl stop) exits 0; a bad flag exits with a status the unit does not restart."""
        unit = self.unit_text()
        creds = os.path.join(self.tmp, "credentials")
        os.mkdir(creds, 0o700)
        token = "unit-token-%d" % os.getpid()
        path = os.path.join(creds, "token")
        with open(path, "w") as f:
            f.write(token + "\n")
        os.chmod(path, 0o400)  # as systemd writes a credential
        sock, name = fake_systemd(False, self.tmp)
        env = dict(os.environ, NOTIFY_SOCKET=name, CREDENTIALS_DIRECTORY=creds)
        env.pop("DDPRUN_RDZV_TOKEN", None)
        argv = self.unit_argv(unit, "--host 127.0.0.1 --port 0 --log-format json", creds)
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
        try:
            msg = sock.recv(4096).decode()
            self.assertTrue(msg.startswith("READY=1\nSTATUS=listening on 127.0.0.1:"), msg)
            port = int(msg.rsplit(":", 1)[1])
            r = job(port, token, "unit-job")
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertNotEqual(job(port, "wrong", "unit-job2").returncode, 0)
            # One thread: far below TasksMax=.
            tasks = len(os.listdir("/proc/%d/task" % proc.pid))
            self.assertLessEqual(tasks, int(re.search(r"^TasksMax=(\d+)$", unit, re.M).group(1)))
        finally:
            if proc.poll() is None:
                proc.terminate()
            _, err = proc.communicate(timeout=30)
            sock.close()
        self.assertEqual(proc.returncode, 0, err)
        self.assertNotIn(token, err)

        # A bad flag in /etc/default/ddprun-rdzvd (here: --token-file given twice) is exit 2, which
        # RestartPreventExitStatus= names: the unit fails at once instead of restarting in a loop.
        argv = self.unit_argv(unit, "--port 0 --token-file " + path, creds)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)
        prevent = re.search(r"^RestartPreventExitStatus=(.*)$", unit, re.M)
        self.assertIsNotNone(prevent, "the unit restarts on a bad flag (no RestartPreventExitStatus=)")
        self.assertIn(str(r.returncode), prevent.group(1).split(), r.stderr)

    def test_unit_exposure(self):
        """`systemd-analyze security --offline` rates the unit's sandbox 1.2 of 10 ("OK"); a
        hardening line lost in an edit raises it past the threshold."""
        analyze = shutil.which("systemd-analyze")
        if not analyze:
            self.skipTest("systemd-analyze is not installed (Debian package systemd)")
        path = self.write("ddprun-rdzvd.service", self.unit_text().replace("/usr/bin/ddprun-rdzvd", RDZVD), 0o644)
        r = subprocess.run([analyze, "security", "--offline=true", "--threshold=12", path], capture_output=True,
                           text=True, timeout=60, cwd=self.tmp)
        if "--offline" in r.stderr and "unrecognized" in r.stderr:
            self.skipTest("this systemd-analyze has no --offline (systemd < 250)")
        self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr)

    def test_unit_limits_fit_the_defaults(self):
        """LimitNOFILE= covers the default --max-connections (65536) plus the daemon's reserve of
        1,024 descriptors; the MemoryMax= suggestion is explained against the flags."""
        unit = self.unit_text()
        nofile = int(re.search(r"^LimitNOFILE=(\d+)$", unit, re.M).group(1))
        self.assertGreaterEqual(nofile, 65536 + 1024)
        for flag in ("--max-total-bytes", "--max-buffered-bytes", "--max-member-bytes"):
            self.assertTrue(flag in unit, "the unit's MemoryMax= note does not mention " + flag)

    def test_unit_syscalls_pass_the_filter(self):
        """Every system call the daemon makes (start, a job with the token, SIGTERM; traced with
        strace) is in the unit's SystemCallFilter= (@system-service minus @privileged): one outside
        it would kill the daemon with SIGSYS under systemd."""
        analyze, strace = shutil.which("systemd-analyze"), shutil.which("strace")
        if not analyze or not strace:
            self.skipTest("needs systemd-analyze and strace")
        unit = self.unit_text()
        self.assertIn("SystemCallFilter=@system-service\nSystemCallFilter=~@privileged", unit)

        def expand(group, seen=None):
            out = subprocess.run([analyze, "syscall-filter", group], capture_output=True, text=True,
                                 timeout=60, check=True).stdout
            calls = set()
            for line in out.splitlines()[1:]:
                w = line.strip()
                if w and not w.startswith("#"):
                    calls |= expand(w) if w.startswith("@") else {w}
            return calls

        allowed = expand("@system-service") - expand("@privileged")
        token = self.write("token", "strace-token\n")
        trace = os.path.join(self.tmp, "trace")
        sock, name = fake_systemd(False, self.tmp)
        env = dict(os.environ, NOTIFY_SOCKET=name)
        proc = subprocess.Popen([strace, "-f", "-qq", "-c", "-o", trace, RDZVD, "--host", "127.0.0.1", "--port", "0",
                                 "--token-file", token, "--metrics-port", "0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
        try:
            msg = sock.recv(4096).decode()
            port = int(msg.rsplit(":", 1)[1])
            r = job(port, "strace-token", "strace-job")
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        finally:
            # SIGTERM to the daemon itself (strace passes it on only as the tracer's own).
            kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            for k in kids:
                os.kill(int(k), signal.SIGTERM)
            proc.communicate(timeout=60)
            sock.close()
        used = set()
        with open(trace) as f:
            for line in f:
                w = line.split()
                if w and re.fullmatch(r"[a-z_0-9]+", w[-1]) and w[-1] not in ("total", "syscall"):
                    used.add(w[-1])
        self.assertGreater(len(used), 10, "strace saw almost nothing")
        self.assertEqual(sorted(used - allowed), [], "system calls outside the unit's SystemCallFilter=")


if __name__ == "__main__":
    if not os.access(RDZVD, os.X_OK):
        raise SystemExit("DDPRUN_BIN_DIR must name the built binaries (%s missing)" % RDZVD)
    unittest.main(verbosity=2)
