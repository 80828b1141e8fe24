"""`ddprun status --json` and `--watch` against a real ddprun-rdzvd holding two jobs: one running
(a one-node c10d job whose worker waits for a file) and one waiting for a second node. The JSON
is parsed and checked field by field; --watch is checked piped (plain blocks, JSON lines, bounded
by --watch-count or stopped with SIGINT) and on a pty (the ANSI home+clear redraw). Readiness is
by output: the daemon's `listening on` line, and watch updates until the jobs show up.

Run by ctest with DDPRUN_BIN_DIR set.
"""
import json
import os
import pty
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest

BIN = os.path.abspath(os.environ["DDPRUN_BIN_DIR"])
DDPRUN = os.path.join(BIN, "ddprun")
RDZVD = os.path.join(BIN, "ddprun-rdzvd")
REDRAW = "\x1b[H\x1b[2J"


def read_line(proc, deadline):
    """One stdout line of `proc`, or an AssertionError at the deadline."""
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("no output from %s before the deadline" % proc.args)
        r, _, _ = select.select([fd], [], [], left)
        if r:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError("%s closed stdout (exit %s)" % (proc.args, proc.poll()))
            return line


class StatusAgainstDaemon(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            cls.start()
        except BaseException:
            cls.tearDownClass()  # unittest skips it when setUpClass fails
            raise

    @classmethod
    def start(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="ddprun-status-")
        cls.go = os.path.join(cls.tmp.name, "go")
        cls.procs = []
        cls.log = open(os.path.join(cls.tmp.name, "log"), "w")
        cls.daemon = subprocess.Popen([RDZVD, "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"],
                                      stdout=subprocess.PIPE, stderr=cls.log, text=True)
        cls.procs.append(cls.daemon)
        line = read_line(cls.daemon, time.monotonic() + 20)
        assert line.startswith("listening on 127.0.0.1:"), line
        cls.endpoint = line.split()[-1]
        common = [DDPRUN, "--rdzv-backend", "c10d", "--rdzv-endpoint", cls.endpoint, "--nproc-per-node", "1",
                  "--local-addr", "127.0.0.1", "--log-level", "warning", "--no-python", "/bin/sh", "-c"]
        wait_for_go = "while [ ! -e %s ]; do sleep 0.05; done" % cls.go
        for run_id, nnodes in (("runjob", "1"), ("waitjob", "2:2")):
            argv = common[:1] + ["--nnodes", nnodes, "--rdzv-id", run_id] + common[1:] + [wait_for_go]
            cls.procs.append(subprocess.Popen(argv, stdout=cls.log, stderr=cls.log,
                                              cwd=cls.tmp.name))
        # Wait (bounded) until both jobs are formed, by watching the daemon's status as JSON lines.
        watch = subprocess.Popen([DDPRUN, "status", "--rdzv-endpoint", cls.endpoint, "--watch", "0.1", "--json"],
                                 stdout=subprocess.PIPE, stderr=cls.log, text=True)
        cls.procs.append(watch)
        deadline = time.monotonic() + 60
        cls.snapshot = None
        while cls.snapshot is None:
            doc = json.loads(read_line(watch, deadline))
            jobs = {j["run_id"]: j for j in doc.get("jobs", [])}
            if (jobs.get("runjob", {}).get("state") == "running" and len(jobs.get("waitjob", {}).get("members", [])) == 1):
                cls.snapshot = doc
        watch.send_signal(signal.SIGINT)
        cls.watch_rc = watch.wait(timeout=20)

    @classmethod
    def tearDownClass(cls):
        open(cls.go, "w").close()
        for p in reversed(cls.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in cls.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        cls.log.close()
        cls.tmp.cleanup()

    def status(self, *args, timeout=30):
        return subprocess.run([DDPRUN, "status", "--rdzv-endpoint", self.endpoint] + list(args),
                              capture_output=True, text=True, timeout=timeout)

    def test_watch_json_stops_on_sigint_with_0(self):
        self.assertEqual(self.watch_rc, 0)

    def test_json_fields(self):
        doc = self.snapshot
        self.assertEqual(doc["endpoint"], self.endpoint)
        self.assertIsNone(doc["run_id"])
        self.assertRegex(doc["time"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
        jobs = {j["run_id"]: j for j in doc["jobs"]}
        run, wait = jobs["runjob"], jobs["waitjob"]
        for job in (run, wait):
            self.assertEqual(set(job), {"run_id", "state", "closed", "round", "min_nodes", "max_nodes",
                                        "restarts_used", "max_restarts", "progress", "result", "timers_s",
                                        "last_failure", "members"})
            self.assertEqual(set(job["timers_s"]), {"join_timeout", "last_call", "exit_barrier", "rebuild_grace",
                                                    "forgotten"})
            self.assertIsNone(job["last_failure"])
        self.assertEqual((run["state"], run["min_nodes"], run["max_nodes"]), ("running", 1, 1))
        self.assertEqual(run["round"], 0)  # the first round
        self.assertEqual(len(run["members"]), 1)
        m = run["members"][0]
        self.assertEqual(set(m), {"node", "node_addr", "pid", "instance", "addr", "role", "group_rank",
                                  "local_world_size", "state", "heartbeat_age_s", "lease_left_s"})
        self.assertEqual((m["role"], m["group_rank"], m["local_world_size"], m["state"]), ("participant", 0, 1, "ok"))
        self.assertEqual(m["addr"], "127.0.0.1")
        self.assertEqual(m["node"], "%s:%d/%s" % (m["node_addr"], m["pid"], m["instance"]))
        self.assertIsInstance(m["heartbeat_age_s"], float)
        self.assertGreater(m["lease_left_s"], 0)
        self.assertEqual((wait["state"], wait["min_nodes"], wait["max_nodes"]), ("waiting", 2, 2))
        w = wait["members"][0]
        self.assertEqual((w["role"], w["group_rank"]), ("joined", None))
        self.assertIsInstance(wait["timers_s"]["join_timeout"], float)

    def test_json_one_job_and_unknown_job(self):
        r = self.status("--rdzv-id", "runjob", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        doc = json.loads(r.stdout)
        self.assertEqual(r.stdout.count("\n"), 1)
        self.assertEqual(doc["run_id"], "runjob")
        self.assertNotIn("time", doc)
        self.assertEqual([j["run_id"] for j in doc["jobs"]], ["runjob"])
        r = self.status("--rdzv-id", "nosuchjob", "--json")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertEqual(json.loads(r.stdout)["jobs"], [])

    def test_watch_piped_prints_plain_blocks(self):
        r = self.status("--watch", "0.1", "--watch-count", "2")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("\x1b", r.stdout)
        self.assertEqual(r.stdout.count("ddprun status %s at " % self.endpoint), 2)
        self.assertEqual(r.stdout.count("job 'runjob': running"), 2)
        r = self.status("--watch=0.1", "--watch-count", "3", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        docs = [json.loads(line) for line in r.stdout.splitlines()]
        self.assertEqual(len(docs), 3)
        self.assertTrue(all(d["endpoint"] == self.endpoint for d in docs))

    def test_watch_on_a_terminal_redraws_in_place(self):
        pid, fd = pty.fork()
        if pid == 0:
            os.execv(DDPRUN, [DDPRUN, "status", "--rdzv-endpoint", self.endpoint, "--watch", "0.1"])
        try:
            out = b""
            deadline = time.monotonic() + 30
            while out.count(REDRAW.encode()) < 2 or not out.endswith(b"\n"):
                left = deadline - time.monotonic()
                self.assertGreater(left, 0, "no second redraw: %r" % out)
                r, _, _ = select.select([fd], [], [], left)
                if r:
                    out += os.read(fd, 65536)
            text = out.decode()
            self.assertTrue(text.startswith(REDRAW), text[:40])
            frame = text.split(REDRAW)[1]
            self.assertIn("job 'runjob': running", frame)
            self.assertIn("job 'waitjob': waiting", frame)
            os.kill(pid, signal.SIGINT)
            _, status = os.waitpid(pid, 0)
            self.assertTrue(os.WIFEXITED(status), status)
            self.assertEqual(os.WEXITSTATUS(status), 0)
        finally:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            os.close(fd)


class StatusWithoutServer(unittest.TestCase):
    def test_watch_names_the_unreachable_endpoint_and_goes_on(self):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ep = "127.0.0.1:%d" % s.getsockname()[1]
        s.close()  # nothing listens there now
        r = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", ep, "--timeout", "2", "--watch", "0.1",
                            "--watch-count", "2"], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertEqual(r.stdout.count("error: cannot get the rendezvous status from %s" % ep), 2)
        r = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", ep, "--timeout", "2", "--watch", "0.1",
                            "--watch-count", "1", "--json"], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(ep, json.loads(r.stdout)["error"])

    def test_timeout_bounds_a_name_server_that_does_not_answer(self):
        # getaddrinfo made slow for one name by a preloaded shim (ddprun resolves through glibc):
        # the query must end at --timeout, not when the resolver gives up.
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            self.skipTest("no C compiler to build the getaddrinfo shim")
        tmp = tempfile.TemporaryDirectory(prefix="ddprun-slowdns-")
        self.addCleanup(tmp.cleanup)
        src = os.path.join(tmp.name, "slowdns.c")
        lib = os.path.join(tmp.name, "slowdns.so")
        with open(src, "w") as f:
            f.write("#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <netdb.h>\n#include <string.h>\n"
                    "#include <unistd.h>\n#include <stdio.h>\n#include <stdlib.h>\n"
                    "int getaddrinfo(const char* n, const char* s, const struct addrinfo* h, struct addrinfo** r) {\n"
                    "  static int (*real)(const char*, const char*, const struct addrinfo*, struct addrinfo**);\n"
                    "  if (!real) real = dlsym(RTLD_NEXT, \"getaddrinfo\");\n"
                    "  if (n && strcmp(n, \"blackholed.test\") == 0) {\n"
                    "    const char* log = getenv(\"SLOWDNS_LOG\");\n"
                    "    if (log) { FILE* f = fopen(log, \"a\"); if (f) { fputs(\"lookup\\n\", f); fclose(f); } }\n"
                    "    sleep(30);\n"
                    "  }\n"
                    "  if (n && strcmp(n, \"slow.test\") == 0) { usleep(300000); n = \"127.0.0.1\"; }\n"
                    "  return real(n, s, h, r);\n}\n")
        subprocess.run([cc, "-shared", "-fPIC", "-o", lib, src, "-ldl"], check=True, timeout=120)
        started = time.monotonic()
        r = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", "blackholed.test:29400", "--timeout", "1"],
                           capture_output=True, text=True, timeout=60, env=dict(os.environ, LD_PRELOAD=lib))
        took = time.monotonic() - started
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("cannot resolve 'blackholed.test' within 1000 ms", r.stderr)
        self.assertLess(took, 20, "ended by the name server, not by --timeout")  # 30 s before
        # --watch asks every interval: a lookup still under way is waited on again, not started
        # again (a thread each, blocked for as long as the name server keeps silent).
        log = os.path.join(tmp.name, "lookups")
        r = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", "blackholed.test:29400", "--timeout", "0.2",
                            "--watch", "0.1", "--watch-count", "6"], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, LD_PRELOAD=lib, SLOWDNS_LOG=log))
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertEqual(r.stdout.count("cannot resolve 'blackholed.test' within 200 ms"), 6, r.stdout + r.stderr)
        with open(log) as f:
            self.assertEqual(f.read().count("lookup"), 1, "one lookup per tick")
        # A name server slower than --timeout: the answer that came after a tick gave up is used
        # by the next one (here it names a port where nothing listens: refused, not unresolved).
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        r = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", "slow.test:%d" % port, "--timeout", "0.1",
                            "--watch", "1", "--watch-count", "3"], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, LD_PRELOAD=lib))
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("cannot resolve 'slow.test' within 100 ms", r.stdout)
        self.assertLess(r.stdout.count("cannot resolve"), 3, r.stdout)

    def test_usage_errors(self):
        for args, text in ((["--watch-count", "2"], "needs --watch"), (["--watch", "-1"], "'-1'"),
                           (["--watch", "0"], "--watch=0"),
                           (["--watch", "0.05"], "--watch=0.05: not a number of seconds from 0.1 to 1000000"), (["--json=1"], "takes no value"),
                           (["--watch", "1", "--watch-count", "x"], "--watch-count=x")):
            r = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", "127.0.0.1:1"] + args, capture_output=True,
                               text=True, timeout=30)
            self.assertEqual(r.returncode, 2, (args, r.stderr))
            self.assertIn(text, r.stderr, args)



class Impostor:
    """A TCP server on 127.0.0.1 that answers the first connection with `reply` (bytes, or a
    callable given the socket) and then holds the connection without reading."""

    def __init__(self, reply):
        import threading
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.endpoint = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.reply = reply
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            try:
                if callable(self.reply):
                    self.reply(conn, self.done)
                else:
                    conn.sendall(self.reply)
            except OSError:
                pass
            self.done.wait(60)

    def close(self):
        self.done.set()
        self.sock.close()
        self.thread.join(10)


def native_frame(op, payload):
    body = json.dumps(payload).encode()
    return bytes([op]) + len(body).to_bytes(4, "little") + body


CHALLENGE = native_frame(0x68, {"server_nonce": "ab" * 32, "auth": False})


class StatusAgainstImpostor(unittest.TestCase):
    def status(self, server, timeout="10"):
        started = time.monotonic()
        r = subprocess.run([DDPRUN, "status", "--rdzv-endpoint", server.endpoint, "--timeout", timeout],
                           capture_output=True, text=True, timeout=60)
        return r, time.monotonic() - started

    def test_a_server_that_repeats_its_challenge_is_refused_at_once(self):
        # Before: every CHALLENGE started another write of the request (into the buffer the
        # writes before still pointed at) to a server that never reads: ~200 MB/s of memory,
        # until --timeout, then "no reply".
        def flood(conn, done):
            while not done.is_set():
                conn.sendall(CHALLENGE * 64)
        server = Impostor(flood)
        self.addCleanup(server.close)
        r, took = self.status(server)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("the server sent a second CHALLENGE out of turn", r.stderr)
        self.assertLess(took, 8, "ended by --timeout, not by the second CHALLENGE")

    def test_a_server_of_another_protocol_is_named_from_its_first_bytes(self):
        # Before: "rendezvous HELLO payload of 793793620 bytes exceeds the limit": "HTTP" read as
        # an op and a length.
        server = Impostor(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        self.addCleanup(server.close)
        r, _ = self.status(server)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("not ddprun's rendezvous protocol (opcode 0x48 is not a server-to-client rendezvous operation; it begins \"HTTP/1.1 400 Bad", r.stderr)

    def test_a_status_over_the_reply_bound_suggests_one_job(self):
        # Before: the hint for it never matched the decoder's words; the generic one came instead.
        server = Impostor(CHALLENGE + bytes([0x67]) + ((64 << 20) + 1).to_bytes(4, "little"))
        self.addCleanup(server.close)
        r, _ = self.status(server)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("STATUS_REPLY payload of 67108865 bytes exceeds the limit", r.stderr)
        self.assertIn("ask for one with --rdzv-id ID", r.stderr)

    def test_a_status_of_tiny_values_is_refused_in_bounded_memory(self):
        # Before: a STATUS_REPLY of `[0,0,...]` was built into a DOM of ~17x its size before it was
        # found not to be a status (1.7 GB for 64 MiB); now its decode stops at 6x its size. 32 MiB
        # took ~850 MB before, ~300 MB now (the DOM cap plus the read buffer).
        body = b'{"jobs":[' + b"0," * (16 << 20) + b"0]}"
        server = Impostor(CHALLENGE + bytes([0x67]) + len(body).to_bytes(4, "little") + body)
        self.addCleanup(server.close)
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([DDPRUN, "status", "--rdzv-endpoint", server.endpoint, "--timeout", "60"],
                                    stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            err.seek(0)
            stderr = err.read().decode()
        self.assertEqual(proc.returncode, 1, stderr)
        self.assertIn("cannot get the rendezvous status from %s: bad rendezvous STATUS_REPLY message: a payload of "
                      "%d bytes would take more than 192.0 MiB to decode" % (server.endpoint, len(body)), stderr)
        self.assertIn("check that --rdzv-endpoint names a ddprun-rdzvd", stderr)
        self.assertLess(usage.ru_maxrss, 450 << 10, "peak RSS in KiB")


if __name__ == "__main__":
    unittest.main(verbosity=2)
