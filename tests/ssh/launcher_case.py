"""The part every namespace-bed launcher scenario shares (test_fanout.py, test_tree.py): a fresh
bed per test, the launcher's stdout/stderr kept in files (printed when the test fails), and
readiness read from the workers' own info files (fanout_worker.py --out DIR), never from a sleep.

Subclasses set HOSTS (bed size) and may set REFUSING_HOST; they run the launcher themselves and
keep its Popen in self.proc.
"""
import glob
import json
import os
import re
import subprocess
import sys
import time
import unittest

from netns_hosts import SshCluster

LINE_RE = re.compile(r"^\[(h\d+):(\d+)\]: ?(.*)$")  # a worker's line: "[HOST:RANK]: text"


class LauncherCase(unittest.TestCase):
    HOSTS = 3
    REFUSING_HOST = False
    LEFTOVER_GRACE = 15  # seconds for every remote process to disappear after the launcher ended
    WORKERS_TIMEOUT = 60  # seconds for every worker of a scenario to start

    def setUp(self):
        self.c = SshCluster(self.HOSTS, with_refusing_host=self.REFUSING_HOST).__enter__()
        self.out = self.c.path("out")
        os.makedirs(self.out)
        self.stdout_path = self.c.path("launcher.out")
        self.stderr_path = self.c.path("launcher.err")
        self.proc = None
        self._problems0 = self._problem_count()

    def _problem_count(self):
        result = getattr(getattr(self, "_outcome", None), "result", None)
        return len(result.failures) + len(result.errors) if result is not None else 0

    def tearDown(self):
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self._problem_count() != self._problems0:
                sys.stderr.write("---- launcher stderr ----\n%s\n---- launcher stdout (tail) ----\n%s\n"
                                 % (self.stderr()[-6000:], self.stdout()[-3000:]))
        finally:
            self.c.teardown()

    def wait_exit(self, timeout):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.fail("launcher did not exit within %ss" % timeout)

    def stdout(self):
        with open(self.stdout_path, errors="replace") as f:
            return f.read()

    def stderr(self):
        with open(self.stderr_path, errors="replace") as f:
            return f.read()

    def worker_lines(self):
        """[(host, rank, text)] of the launcher's stdout lines that carry a worker prefix."""
        out = []
        for line in self.stdout().splitlines():
            m = LINE_RE.match(line)
            if m:
                out.append((m.group(1), int(m.group(2)), m.group(3)))
        return out

    def infos(self):
        out = []
        for path in glob.glob(os.path.join(self.out, "w_*.json")):
            with open(path) as f:
                out.append(json.load(f))
        return out

    def wait_workers(self, count, timeout=None):
        timeout = timeout or self.WORKERS_TIMEOUT
        deadline = time.monotonic() + timeout
        while True:
            infos = self.infos()
            if len(infos) >= count:
                return infos
            if self.proc.poll() is not None:
                self.fail("launcher exited (%s) before %d workers started (%d did)"
                          % (self.proc.returncode, count, len(infos)))
            if time.monotonic() > deadline:
                self.fail("only %d of %d workers started within %ss" % (len(infos), count, timeout))
            time.sleep(0.05)

    def assert_clean(self):
        self.c.assert_no_leftovers(self.LEFTOVER_GRACE)
