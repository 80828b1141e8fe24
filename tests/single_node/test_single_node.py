"""End-to-end single-node tests of `ddprun` (launcher + agent) with real processes.

Runs $DDPRUN_BIN_DIR/ddprun with the helper worker (ddprun_test_worker) and with real torch
workers. Every wait is bounded; readiness is a file written by the worker, never a sleep.
"""
import json
import os
import shutil
import socket
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from ports import free_port  # this directory

BIN = os.environ.get("DDPRUN_BIN_DIR", "")
DDPRUN = os.path.join(BIN, "ddprun")
WORKER = os.path.join(BIN, "ddprun_test_worker")
HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")

# ddprun keeps a failed job's run directory under TMPDIR (error files, stacks) for the user to read;
# these tests fail jobs on purpose, so every ddprun they start gets a TMPDIR of their own.
SCRATCH = tempfile.mkdtemp(prefix="ddprun-single-node-test-")
os.environ["TMPDIR"] = SCRATCH


def tearDownModule():
    shutil.rmtree(SCRATCH, ignore_errors=True)


def run(args, timeout=60, env=None, **kw):
    e = dict(os.environ)
    e.setdefault("PET_MASTER_PORT", "0")  # never torch's 29500: something else on the box may hold it
    e.update(env or {})
    return subprocess.run([DDPRUN] + args, capture_output=True, text=True, timeout=timeout, env=e, **kw)


def read_ready(proc, count, timeout, by_rank=False):
    """Pids from the workers' "ready <rank> <pid>" stdout lines (select-bounded, no sleeps); a dict
    rank -> pid with `by_rank`."""
    import select
    deadline = time.monotonic() + timeout
    pids = {}
    buf = b""
    fd = proc.stdout.fileno()
    while len(pids) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"workers not ready after {timeout}s: {pids}")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            raise AssertionError("ddprun closed stdout before the workers were ready")
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            parts = line.decode().split()
            if len(parts) == 3 and parts[0] == "ready":
                pids[int(parts[1])] = int(parts[2])
    return pids if by_rank else list(pids.values())


def read_stdout_until(proc, done, timeout, what):
    """What `proc` wrote on stdout until done(bytes so far) holds (select-bounded, no sleeps);
    raises AssertionError naming `what` at the deadline or at EOF."""
    import select
    out = b""
    deadline = time.monotonic() + timeout
    while not done(out):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what} did not come within {timeout} s: {out!r}")
        r, _, _ = select.select([proc.stdout], [], [], left)
        if r:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise AssertionError(f"ddprun closed stdout before {what}: {out!r}")
            out += chunk
    return out


def gone(pid, timeout):
    """True once `pid` no longer exists (pidfd when available)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        import select
        p = select.poll()
        p.register(fd, select.POLLIN)
        return bool(p.poll(int(timeout * 1000)))
    finally:
        os.close(fd)


class StreamReader:
    """What a child wrote on a pipe, read as it comes (select-bounded, no sleeps) and without
    waiting for EOF: a process that outlives the child (a frozen worker) may hold the pipe open."""

    def __init__(self, stream):
        self.fd = stream.fileno()
        os.set_blocking(self.fd, False)
        self.text = ""

    def _read(self):
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            self.text += chunk.decode(errors="replace")

    def wait_for(self, needle, timeout):
        import select
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no '{needle}' within {timeout} s in: {self.text}")
            select.select([self.fd], [], [], left)
            self._read()

    def rest(self):
        self._read()
        return self.text


class SingleNode(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="ddprun_single_node_")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def p(self, name):
        return os.path.join(self.dir, name)

    def test_env_per_rank_and_store(self):
        r = run(["--standalone", "--nproc-per-node", "3", "--log-dir", self.p("logs"), "--rdzv-id", "job7",
                 "--no-python", WORKER, "--dump-env", self.p("env_%r.json"), "--store-check"])
        self.assertEqual(r.returncode, 0, r.stderr)
        ports = set()
        for lr in range(3):
            with open(self.p(f"env_{lr}.json")) as f:
                env = json.load(f)
            self.assertEqual(env["RANK"], str(lr))
            self.assertEqual(env["LOCAL_RANK"], str(lr))
            self.assertEqual(env["WORLD_SIZE"], "3")
            self.assertEqual(env["TORCHELASTIC_USE_AGENT_STORE"], "True")
            self.assertEqual(env["TORCHELASTIC_SIGNALS_TO_HANDLE"], "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
            self.assertEqual(env["TORCHELASTIC_RESTART_COUNT"], "0")
            self.assertTrue(env["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{lr}/error.json"))
            self.assertTrue(env["TORCHELASTIC_ERROR_FILE"].startswith(self.p("logs") + "/"))
            ports.add(env["MASTER_PORT"])
        self.assertEqual(len(ports), 1)
        self.assertNotIn("0", ports)
        for n in (1, 2, 3):
            self.assertIn(f"store-check ok {n}", r.stdout)

    def test_exit_code_and_summary(self):
        r = run(["--nproc-per-node", "2", "--master-port", "0", "--no-python", WORKER, "--only-rank", "1",
                 "--exit", "7"])
        self.assertEqual(r.returncode, 7, r.stderr)
        self.assertIn("Root Cause (first observed failure)", r.stderr)
        self.assertIn("rank       : 1 (local_rank: 1)", r.stderr)

    def test_sigsegv(self):
        r = run(["--standalone", "--no-python", WORKER, "--signal-self", "11"])
        self.assertEqual(r.returncode, 139, r.stderr)
        self.assertIn("SIGSEGV (signal 11)", r.stderr)

    def test_worker_signal_dispositions(self):
        # Each worker's child resets what the agent handles or ignores for itself (SIGPIPE) before
        # exec, from a list the agent makes once per round; what ddprun's own parent ignored
        # (nohup) stays ignored. Read from the workers' /proc/self/status, two ranks, two rounds.
        def ignore_usr2():
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)

        # Round 0 fails, but only once both ranks have printed: the first failure stops the other
        # rank, which could otherwise be ended before its grep wrote anything.
        r = run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--no-python", "sh", "-c",
                 'grep -E "^Sig(Ign|Cgt)" /proc/self/status; R=$TORCHELASTIC_RESTART_COUNT; touch "$1/$LOCAL_RANK.$R"; '
                 'i=0; while { [ ! -e "$1/0.$R" ] || [ ! -e "$1/1.$R" ]; } && [ $i -lt 2000 ]; do '
                 'i=$((i+1)); sleep 0.005; done; [ "$R" = 1 ]', "sh", self.dir],
                preexec_fn=ignore_usr2)
        self.assertEqual(r.returncode, 0, r.stderr)
        ign = [int(line.split()[1], 16) for line in r.stdout.splitlines() if line.startswith("SigIgn:")]
        self.assertEqual(len(ign), 4, r.stdout)  # 2 ranks x 2 rounds
        for mask in ign:
            self.assertTrue(mask & (1 << (signal.SIGUSR2 - 1)), f"SIGUSR2 no longer ignored: {mask:x}")
            self.assertFalse(mask & (1 << (signal.SIGPIPE - 1)), f"SIGPIPE left ignored: {mask:x}")
            # exec itself resets handled signals, so these only catch a child that set them to
            # SIG_IGN; SIGPIPE and SIGUSR2 above are what a wrong list would change.
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
                self.assertFalse(mask & (1 << (sig - 1)), f"{sig!r} ignored in the worker: {mask:x}")

    def test_restarts(self):
        r = run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--no-python", WORKER,
                 "--dump-env", self.p("env_%r_%a.json"), "--fail-on-attempt", "0", "--only-rank", "0",
                 "--exit", "5"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("restarting worker group (attempt 1 of 2)", r.stderr)
        with open(self.p("env_1_1.json")) as f:
            self.assertEqual(json.load(f)["TORCHELASTIC_RESTART_COUNT"], "1")
        self.assertFalse(os.path.exists(self.p("env_0_2.json")))

    def test_sigint_forwarded(self):
        proc = subprocess.Popen([DDPRUN, "--standalone", "--nproc-per-node", "2", "--no-python", WORKER,
                                 "--ready-file", "-", "--sleep-ms", "60000"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            pids = read_ready(proc, 2, 20)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=20)
            self.assertEqual(proc.returncode, 130)
            for pid in pids:
                self.assertTrue(gone(pid, 5), pid)
        finally:
            proc.kill()
            proc.communicate()
            proc.stdout.close()

    def test_an_inherited_ignored_sigchld_loses_no_exit_status(self):
        # SIGCHLD ignored by the parent survives exec: the kernel would then reap the workers itself
        # and ddprun (waitid: ECHILD) failed with "waitid failed" at the first worker's exit.
        code = ("import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); "
                "os.execv(sys.argv[1], sys.argv[1:])")
        base = [PYTHON, "-c", code, DDPRUN, "--nproc-per-node", "2", "--master-port", "0", "--no-python", WORKER]
        env = dict(os.environ, PET_MASTER_PORT="0")
        r = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = subprocess.run(base + ["--only-rank", "1", "--exit", "7"], capture_output=True, text=True, timeout=60,
                           env=env)
        self.assertEqual(r.returncode, 7, r.stderr)
        self.assertIn("rank       : 1 (local_rank: 1)", r.stderr)

    def test_sigpipe_to_handle_is_forwarded(self):
        # With SIGPIPE in --signals-to-handle it is forwarded like the others (before, ddprun's own
        # SIG_IGN for console writes replaced the handler: the signal went nowhere).
        proc = subprocess.Popen([DDPRUN, "--standalone", "--signals-to-handle", "SIGTERM,SIGPIPE", "--no-python",
                                 WORKER, "--ready-file", "-", "--sleep-ms", "60000"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            pids = read_ready(proc, 1, 20)
            proc.send_signal(signal.SIGPIPE)
            proc.wait(timeout=20)
            self.assertEqual(proc.returncode, 128 + signal.SIGPIPE)
            for pid in pids:
                self.assertTrue(gone(pid, 5), pid)
        finally:
            proc.kill()
            out, err = proc.communicate()
            proc.stdout.close()
            proc.stderr.close()

    def test_a_signal_is_written_to_the_launchers_error_file(self):
        # torchrun's @record main writes its SignalException ("Process PID got signal: N").
        error_file = self.p("launcher-error.json")
        env = dict(os.environ, TORCHELASTIC_ERROR_FILE=error_file)
        proc = subprocess.Popen([DDPRUN, "--standalone", "--no-python", WORKER, "--ready-file", "-", "--sleep-ms",
                                 "60000"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        try:
            read_ready(proc, 1, 20)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)
            self.assertEqual(proc.returncode, 143)
            with open(error_file) as f:
                message = json.load(f)["message"]["message"]
            self.assertEqual(message, f"Process {proc.pid} got signal: {int(signal.SIGTERM)}")
        finally:
            proc.kill()
            proc.communicate()
            proc.stdout.close()

    def test_worker_reads_the_terminal(self):
        # A worker reading ddprun's terminal (pdb, breakpoint(), input()) gets the typed line: it
        # runs in a session of its own, as torch 2.6 starts workers. A process group of ddprun's
        # session is a background job of that terminal and would be stopped by SIGTTIN.
        import pty
        import select
        pid, fd = pty.fork()
        if pid == 0:
            try:
                os.execv(DDPRUN, [DDPRUN, "--master-port", "0", "--no-python", sys.executable, "-c",
                                  "print('ready', flush=True); print('got', input(), flush=True)"])
            finally:
                os._exit(127)
        out = b""
        sent = False
        deadline = time.monotonic() + 30
        try:
            while True:  # until the terminal's last user is gone (EIO) or the deadline
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if not select.select([fd], [], [], left)[0]:
                    continue
                try:
                    chunk = os.read(fd, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
                if not sent and b"ready" in out:
                    os.write(fd, b"hello\n")
                    sent = True
            self.assertIn(b"got hello", out, out.decode(errors="replace"))
            # ddprun exits right after its worker: wait for that (its pidfd turns readable), bounded.
            exited = os.pidfd_open(pid)
            try:
                self.assertTrue(select.select([exited], [], [], 10)[0], "ddprun did not exit after its worker")
            finally:
                os.close(exited)
            done, status = os.waitpid(pid, 0)
            self.assertEqual(done, pid)
            self.assertEqual(os.waitstatus_to_exitcode(status), 0, out.decode(errors="replace"))
        finally:
            os.close(fd)
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass

    def test_stopped_worker_gets_the_stop_signal_at_once(self):
        # Rank 1 handles SIGTERM and is stopped (as a debugger or SIGTTIN leaves it) when rank 0
        # fails. A handled signal waits until the process runs again, so ddprun continues it
        # (SIGCONT) right after the SIGTERM: the handler runs at once, not at the shutdown timeout.
        script = ("import os, signal, sys, time\n"
                  "marker = sys.argv[1]\n"
                  "signal.signal(signal.SIGTERM, lambda *a: (print('rank 1 got SIGTERM', flush=True), os._exit(0)))\n"
                  "if os.environ['RANK'] == '1':\n"
                  "    with open(marker + '.tmp', 'w') as f: f.write(str(os.getpid()))\n"
                  "    os.rename(marker + '.tmp', marker)\n"
                  "    os.kill(os.getpid(), signal.SIGSTOP)\n"
                  "    time.sleep(60)\n"
                  "    sys.exit(9)\n"
                  "for _ in range(3000):\n"  # rank 0: fail once rank 1 is stopped (state T)
                  "    if os.path.exists(marker):\n"
                  "        with open('/proc/%s/stat' % open(marker).read()) as f:\n"
                  "            if f.read().rsplit(')', 1)[1].split()[0] == 'T': sys.exit(3)\n"
                  "    time.sleep(0.01)\n"
                  "sys.exit(8)\n")
        start = time.monotonic()
        r = run(["--nproc-per-node", "2", "--master-port", "0", "--shutdown-timeout", "20", "--no-python",
                 sys.executable, "-c", script, self.p("stopped")], timeout=60)
        elapsed = time.monotonic() - start
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("rank 1 got SIGTERM", r.stdout, r.stderr)
        self.assertLess(elapsed, 15, r.stderr)

    def test_output_of_a_process_the_worker_left_running(self):
        # Rank 0 starts two background processes that keep its stdout and exits: one that writes
        # as fast as it can (yes), one that ticks for 2 s and then leaves a file. 1 s after rank
        # 0's exit ddprun stops waiting for its stream. Before, it read the pipe there until EOF
        # (never, with yes: the agent hung) and then closed it, so the ticking process died of
        # SIGPIPE at its next line. Now what they write is read and dropped until the attempt
        # ends; rank 1 ends the job once the ticking process is done.
        done = self.p("bg_done")
        script = ('if [ "$LOCAL_RANK" = 0 ]; then yes & '
                  '( i=0; while [ $i -lt 40 ]; do echo tick $i; i=$((i+1)); sleep 0.05; done; touch "$1" ) & '
                  'exit 0; fi; '
                  'i=0; while [ ! -e "$1" ] && [ $i -lt 400 ]; do i=$((i+1)); sleep 0.05; done; [ -e "$1" ]')
        r = run(["--nproc-per-node", "2", "--tee", "3", "--no-python", "sh", "-c", script, "sh", done], timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        self.assertTrue(os.path.exists(done), "the ticking process did not finish: ended by SIGPIPE?")

    def test_kill9_leaves_no_orphans(self):
        proc = subprocess.Popen([DDPRUN, "--standalone", "--nproc-per-node", "2", "--no-python", WORKER,
                                 "--ready-file", "-", "--sleep-ms", "60000", "--ignore-sigterm"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            pids = read_ready(proc, 2, 20)
            proc.kill()
            proc.wait(timeout=10)
            for pid in pids:
                self.assertTrue(gone(pid, 5), f"worker {pid} survived kill -9 of ddprun")
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()

    def test_tee_prefix_and_log_layout(self):
        r = run(["--standalone", "--nproc-per-node", "2", "--tee", "3", "--log-dir", self.p("logs"),
                 "--rdzv-id", "job9", "--no-python", WORKER, "--print-lines", "2"],
                env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${role_name}:${rank}]"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("[default:1]rank 1 line 1 stdout\n", r.stdout)
        self.assertIn("[default:0]rank 0 line 0 stderr\n", r.stderr)
        # The job dir is <log_dir>/<run_id>_<random>; standalone picks its own run id.
        jobs = os.listdir(self.p("logs"))
        self.assertEqual(len(jobs), 1)
        with open(os.path.join(self.p("logs"), jobs[0], "attempt_0", "1", "stdout.log")) as f:
            self.assertEqual(f.read(), "rank 1 line 0 stdout\nrank 1 line 1 stdout\n")

    def test_prompt_without_newline_is_shown_under_tee(self):
        # A worker's prompt ("(Pdb) ", input()'s) has no newline: under --tee the console got it
        # only with the line's end, after the user had answered a prompt they never saw. Now it
        # is shown once the worker pauses, and its line goes on after it.
        gate = self.p("answered")
        prog = ("import os, sys, time\n"
                "sys.stdout.write('(Pdb) '); sys.stdout.flush()\n"
                "deadline = time.monotonic() + 30\n"
                "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline: time.sleep(0.01)\n"
                "print('continue')\n")
        e = dict(os.environ, PET_MASTER_PORT="0")
        proc = subprocess.Popen([DDPRUN, "--nproc-per-node", "1", "--tee", "3", "--log-dir", self.p("logs"),
                                 "--no-python", PYTHON, "-c", prog, gate],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e)
        try:
            out = read_stdout_until(proc, lambda o: b"[default0]:(Pdb) " in o, 20, "the prompt")
            open(gate, "w").close()
            rest, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        self.assertEqual(proc.returncode, 0, err)
        self.assertEqual(out + rest, b"[default0]:(Pdb) continue\n")
        jobs = os.listdir(self.p("logs"))
        with open(os.path.join(self.p("logs"), jobs[0], "attempt_0", "0", "stdout.log")) as f:
            self.assertEqual(f.read(), "(Pdb) continue\n")

    def test_a_failed_workers_last_lines_come_before_its_exit_is_reported(self):
        # The console stalls (nobody reads ddprun's stderr), so the agent stops reading the
        # worker's pipe; the worker fills it and exits 1. What it wrote last was still in the pipe
        # when its exit was reported: "ended with exit code 1" and the diagnosis came before the
        # worker's last lines (its traceback). Now the pipe is read first.
        prog = ("import fcntl, os, select, sys\n"
                "fcntl.fcntl(2, fcntl.F_SETFL, fcntl.fcntl(2, fcntl.F_GETFL) | os.O_NONBLOCK)\n"
                "n = written = 0\n"
                "while True:\n"
                "    line = ('line %d ' % n).encode() + b'x' * 1000 + b'\\n'\n"
                "    try:\n"
                "        os.write(2, line)\n"
                "    except BlockingIOError:\n"
                "        # Full: the agent stopped reading (its console queue is full) once nothing\n"
                "        # moves for a while after more than its queue holds.\n"
                "        if written > (1 << 20) and not select.select([], [2], [], 0.5)[1]:\n"
                "            break\n"
                "        select.select([], [2], [], 1.0)\n"
                "        continue\n"
                "    written += len(line)\n"
                "    n += 1\n"
                "print('stalled %d' % (n - 1), flush=True)\n"
                "sys.exit(1)\n")
        e = dict(os.environ, PET_MASTER_PORT="0")
        events = self.p("events.jsonl")
        proc = subprocess.Popen([DDPRUN, "--nproc-per-node", "1", "--tee", "3", "--log-dir", self.p("logs"),
                                 "--event-log-handler", "file:" + events, "--no-python", PYTHON, "-c", prog],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e)
        try:
            # The worker is done writing; nobody read its stderr yet.
            out = read_stdout_until(proc, lambda o: b"\n" in o, 60, "the worker's stalled line")
            deadline = time.monotonic() + 60

            def failed_event():
                try:
                    with open(events) as f:
                        return "torchelastic.worker.status.FAILED" in f.read()
                except FileNotFoundError:
                    return False
            # The agent has handled the exit (its event follows the "ended with" line) before
            # anyone reads its stderr, so the console cannot drain the pipe first.
            while not failed_event():
                self.assertLess(time.monotonic(), deadline, "no FAILED event")
                time.sleep(0.02)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        self.assertEqual(proc.returncode, 1)
        self.assertTrue(out.startswith(b"[default0]:stalled "), out)
        last = "[default0]:line %s x" % out.split()[1].decode()
        text = err.decode(errors="replace")
        self.assertIn(last, text)
        self.assertIn("ended with exit code 1", text)
        self.assertLess(text.index(last), text.index("ended with exit code 1"))

    def test_uninterruptible_state_timeout_as_current_torchrun(self):
        # Rank 1 waits in the kernel (state D) for 60 s: past the timeout the group is unhealthy,
        # the workers stop and ddprun exits 1 without using its restarts.
        start = time.monotonic()
        r = run(["--nproc-per-node", "2", "--max-restarts", "3", "--no-python", WORKER, "--only-rank", "1",
                 "--vfork-sleep-ms", "60000"], env={"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT": "1"}, timeout=50)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertLess(time.monotonic() - start, 30)
        self.assertIn("worker group unhealthy: local rank 1 (pid", r.stderr)
        self.assertIn("in uninterruptible sleep (D state), at least TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT=1 s",
                      r.stderr)
        self.assertNotIn("restarting worker group", r.stderr)
        # Shorter than the timeout, or without it: nothing happens.
        r = run(["--nproc-per-node", "2", "--no-python", WORKER, "--only-rank", "1", "--vfork-sleep-ms", "2500"],
                env={"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT": "5"})  # sampled once a second
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("is in uninterruptible sleep (D state)", r.stderr)
        r = run(["--no-python", WORKER, "--vfork-sleep-ms", "300"],
                env={"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT": "soon"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT=soon is not a number of seconds: ignored", r.stderr)
        self.assertNotIn("D state", r.stderr)

    def run_with_a_stuck_worker(self, worker_args, stop, kill_timeout="1", env=None):
        """Runs 2 workers of ddprun_test_worker (`worker_args` after --ready-file -), freezes local
        rank 0 in a cgroup v1 freezer, calls stop(proc) and waits for ddprun's end. A frozen task is
        in the D state and acts on SIGKILL only once thawed: the worker stuck in a driver or a file
        system that no signal ends. stop() gets ddprun's stderr as a StreamReader too, and finds
        the frozen worker's pid in self.stuck_pid. Returns (returncode, stderr, seconds from stop to
        the end)."""
        root = None
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, opts = line.split()[:4]
                if fstype == "cgroup" and "freezer" in opts.split(","):
                    root = mnt
        if root is None or not os.access(root, os.W_OK):
            self.skipTest("no writable cgroup v1 freezer hierarchy (the only way to make SIGKILL wait)")
        with open("/proc/self/cgroup") as f:
            own = next(l.split(":", 2)[2].strip() for l in f if l.split(":")[1] == "freezer")
        cg = os.path.join(root + own, f"ddprun-test-stuck-{os.getpid()}")
        os.mkdir(cg)
        stuck = job_cg = None
        try:
            e = dict(os.environ, PET_MASTER_PORT="0", **(env or {}))
            proc = subprocess.Popen([DDPRUN, "--nproc-per-node", "2", "--max-restarts", "2", "--shutdown-timeout",
                                     "0.5", "--kill-timeout", kill_timeout, "--no-python", WORKER, "--ready-file", "-"] +
                                    worker_args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e)
            # The frozen worker holds the streams it inherited open past ddprun's end: no EOF.
            errors = StreamReader(proc.stderr)
            try:
                pids = read_ready(proc, 2, 20, by_rank=True)
                stuck, other = pids[0], pids[1]
                with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                    f.write(str(stuck))
                with open(os.path.join(cg, "freezer.state"), "w") as f:
                    f.write("FROZEN")
                deadline = time.monotonic() + 10
                while True:
                    with open(os.path.join(cg, "freezer.state")) as f:
                        if f.read().strip() == "FROZEN":
                            break
                    self.assertLess(time.monotonic(), deadline, "the freezer did not freeze the worker")
                    time.sleep(0.01)
                start = time.monotonic()
                self.stuck_pid = stuck
                stop(proc, errors)
                proc.wait(timeout=40)
                took = time.monotonic() - start
                err = errors.rest()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
                proc.stderr.close()
            self.assertTrue(gone(other, 5), "the other worker outlived ddprun")
            self.assertFalse(gone(stuck, 0), "the frozen worker ended: the test made nothing stuck")
            self.assertIn(f"(pid {stuck}, state D", err)
            with open(f"/proc/{stuck}/cgroup") as f:  # the job's cgroup v2, if containment made one
                job_cg = next((l.split(":", 2)[2].strip() for l in f if l.startswith("0::/ddprun-")), None)
            return proc.returncode, err, took
        finally:
            if stuck is not None:
                with open(os.path.join(cg, "freezer.state"), "w") as f:
                    f.write("THAWED")  # its pending SIGKILL ends it now
                self.assertTrue(gone(stuck, 10), "the thawed worker did not end")
                # Ended soon enough, it leaves no cgroup behind: the watchdog's removal was still trying.
                with open("/proc/mounts") as f:
                    v2 = next((l.split()[1] for l in f if l.split()[2] == "cgroup2"), None)
                if job_cg and v2:
                    deadline = time.monotonic() + 15
                    while os.path.exists(v2 + job_cg):
                        self.assertLess(time.monotonic(), deadline, f"{v2 + job_cg} was left behind")
                        time.sleep(0.05)
            deadline = time.monotonic() + 10
            while True:
                try:
                    os.rmdir(cg)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)

    def test_a_worker_that_sigkill_cannot_end_is_given_up_on(self):
        # After SIGTERM to ddprun: the grace, SIGKILL, then --kill-timeout, and ddprun exits.
        rc, err, took = self.run_with_a_stuck_worker(["--sleep-ms", "60000"],
                                                     lambda p, _: p.send_signal(signal.SIGTERM))
        self.assertEqual(rc, 143, err)
        self.assertLess(took, 20, err)  # liveness: without the give-up it waits forever
        self.assertIn("did not end after SIGKILL (stuck in the kernel); ddprun stopped waiting for it after "
                      "--kill-timeout=1 s and leaves the job without a restart", err)
        self.assertIn("did not end within 1000 ms of SIGKILL: no longer waited for", err)
        self.assertIn("workers stopped after a signal; exiting with 143", err)

    def test_a_stuck_worker_ends_the_job_without_a_restart(self):
        # Rank 1 fails while rank 0 is stuck: restarts are left, but a fresh group would run beside
        # a process that still holds what it held. ddprun names the failure and exits 1.
        flag = self.p("go")
        rc, err, took = self.run_with_a_stuck_worker(
            ["--wait-file", flag, "--only-rank", "1", "--exit", "3", "--gated-no-sleep", "--sleep-ms", "60000"],
            lambda p, _: open(flag, "w").close())
        self.assertEqual(rc, 1, err)
        self.assertLess(took, 20, err)
        self.assertIn("ended with exit code 3", err)
        self.assertIn("ddprun stopped waiting for it after --kill-timeout=1 s and leaves the job without a restart", err)
        self.assertIn("Root Cause (first observed failure)", err)
        self.assertIn("exitcode   : 3", err)
        self.assertNotIn("restarting worker group", err)
        self.assertIn("workers stopped (the worker group was unhealthy); exiting with 1", err)

    def test_a_worker_the_file_timer_kills_that_does_not_end_is_given_up_on(self):
        # torch's FileTimerClient asks for a SIGKILL of the stuck rank 0: ddprun sends it, waits
        # --kill-timeout for the exit, then gives up on it, stops rank 1 and exits 1 without the
        # restarts that are left (before, it waited for rank 0 forever).
        fifo = self.p("timer_fifo")

        def stop(p, errors):
            with open(fifo, "w") as f:
                f.write('{"version": 1, "pid": %d, "scope_id": "step", "expiration_time": 1, "signal": 9}\n'
                        % self.stuck_pid)

        rc, err, took = self.run_with_a_stuck_worker(
            ["--sleep-ms", "60000"], stop,
            env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TORCHELASTIC_TIMER_FILE": fifo})
        self.assertEqual(rc, 1, err)
        self.assertLess(took, 20, err)
        self.assertIn("scope 'step' of worker pid", err)
        self.assertIn("did not end within 1000 ms of SIGKILL: no longer waited for", err)
        self.assertIn("ddprun stopped waiting for it after --kill-timeout=1 s and leaves the job without a restart", err)
        self.assertNotIn("restarting worker group", err)
        self.assertIn("workers stopped (the worker group was unhealthy); exiting with 1", err)

    def test_a_second_signal_after_the_sigkill_gives_up_at_once(self):
        # SIGINT, SIGINT (no more grace: SIGKILL), SIGINT: no wait for --kill-timeout (30 s here).
        def stop(p, errors):  # three signals, each handled before the next (not one coalesced pending one)
            p.send_signal(signal.SIGINT)
            errors.wait_for("received SIGINT: forwarding it to the workers", 10)
            p.send_signal(signal.SIGINT)
            errors.wait_for("still running at a second SIGINT during the stop: sending SIGKILL", 10)
            p.send_signal(signal.SIGINT)

        rc, err, took = self.run_with_a_stuck_worker(["--sleep-ms", "60000"], stop, kill_timeout="30")
        self.assertEqual(rc, 130, err)
        self.assertLess(took, 10, err)
        self.assertIn("has not ended since its SIGKILL: no longer waited for, at a SIGINT", err)
        self.assertIn("ddprun stopped waiting for it at a SIGINT after the SIGKILL", err)

    def test_prefix_template_as_current_torchrun(self):
        # ${hostname} (gethostname, as torchrun), $rank without braces, $$ for a dollar.
        r = run(["--nproc-per-node", "2", "--tee", "3", "--log-line-prefix-template", "${hostname}|$rank|$$:",
                 "--no-python", WORKER, "--print-lines", "1"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"{socket.gethostname()}|1|$:rank 1 line 0 stdout\n", r.stdout)

    def test_log_dir_holds_only_what_torchrun_leaves_after_a_python_job(self):
        # ddprun's Python hook and the empty stack files it opened per rank are gone at the end;
        # the logs stay (a failed run also keeps the stacks that were written).
        script = self.p("hello.py")
        with open(script, "w") as f:
            f.write("print('hello')\n")
        r = run(["--nproc-per-node", "2", "--redirects", "3", "--log-dir", self.p("logs"), script],
                env={"PYTHON_EXEC": PYTHON})
        self.assertEqual(r.returncode, 0, r.stderr)
        found = sorted(os.path.relpath(os.path.join(d, n), self.p("logs")).split(os.sep, 1)[1]
                       for d, dirs, files in os.walk(self.p("logs")) for n in dirs + files
                       if os.path.dirname(os.path.relpath(os.path.join(d, n), self.p("logs"))) != "")
        self.assertEqual(found, ["attempt_0", "attempt_0/0", "attempt_0/0/stderr.log", "attempt_0/0/stdout.log",
                                 "attempt_0/1", "attempt_0/1/stderr.log", "attempt_0/1/stdout.log"])
        # With a rendezvous too: nothing left after a success.
        r = run(["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--nproc-per-node", "2",
                 "--log-dir", self.p("logs2"), script], env={"PYTHON_EXEC": PYTHON})
        self.assertEqual(r.returncode, 0, r.stderr)
        left = [os.path.relpath(os.path.join(d, n), self.p("logs2")) for d, dirs, files in os.walk(self.p("logs2"))
                for n in files]
        self.assertEqual(left, [])

    def test_redirects_and_filter(self):
        r = run(["--standalone", "--nproc-per-node", "3", "--redirects", "0:3", "--local-ranks-filter", "1",
                 "--log-dir", self.p("logs"), "--no-python", WORKER, "--print-lines", "1"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("rank 1 line 0 stdout", r.stdout)
        self.assertNotIn("rank 0 line 0 stdout", r.stdout)
        self.assertNotIn("rank 2 line 0 stdout", r.stdout)

    def test_error_file_summary(self):
        r = run(["--standalone", "--no-python", WORKER, "--write-error-file", "ValueError: boom", "--exit", "1"])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("message    : ValueError: boom", r.stderr)
        self.assertIn("Traceback (most recent call last):", r.stderr)

    def test_port_in_use(self):
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        try:
            r = run(["--master-port", str(port), "--no-python", WORKER])
            self.assertNotEqual(r.returncode, 0)
            self.assertIn(f"127.0.0.1:{port}", r.stderr)
            self.assertIn("--master-port 0", r.stderr)
        finally:
            s.close()

    def test_torch_gloo_allreduce_over_agent_store(self):
        r = run(["--standalone", "--nproc-per-node", "2", os.path.join(HERE, "ddp_gloo_worker.py")],
                timeout=120, env={"PYTHON_EXEC": PYTHON})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("allreduce ok rank=0 attempt=0 sum=3 agent_store=True", r.stdout)
        self.assertIn("allreduce ok rank=1 attempt=0 sum=3 agent_store=True", r.stdout)

    def test_torch_restart_reinitialises_over_fresh_store(self):
        r = run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                 os.path.join(HERE, "ddp_gloo_worker.py"), "fail-first"],
                timeout=120, env={"PYTHON_EXEC": PYTHON})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("allreduce ok rank=0 attempt=1 sum=3 agent_store=True", r.stdout)
        self.assertIn("allreduce ok rank=1 attempt=1 sum=3 agent_store=True", r.stdout)

    def test_torch_opt_out_of_the_agent_store(self):
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 hosts the store (torch 1.13 reads
        # TORCHELASTIC_USE_AGENT_STORE=False as 2.x does). It could not bind MASTER_PORT if the
        # agent listened there; each attempt's rank 0 binds it anew.
        r = run(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                 os.path.join(HERE, "ddp_gloo_worker.py"), "fail-first"],
                timeout=120, env={"PYTHON_EXEC": PYTHON, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("allreduce ok rank=0 attempt=1 sum=3 agent_store=False", r.stdout)
        self.assertIn("allreduce ok rank=1 attempt=1 sum=3 agent_store=False", r.stdout)



# Writes 64 KiB pieces to stdout without end, from a thread; once 512 KiB have gone, says so on
# the FIFO argv[1] (more than the pipes between it and the test's console hold: the agent's
# console writes would now block).
FLOOD = r"""
import os, sys, threading, time
def flood():
    piece = (b"x" * 1023 + b"\n") * 64
    total, told = 0, False
    while True:
        sys.stdout.buffer.write(piece)
        sys.stdout.buffer.flush()
        total += len(piece)
        if total >= 512 * 1024 and not told:
            told = True
            with open(sys.argv[1], "w") as f:
                f.write("flooded\n")
threading.Thread(target=flood, daemon=True).start()
while True:
    time.sleep(3600)
"""


class ConsoleStall(unittest.TestCase):
    """A console that stops reading (Ctrl-S, a `| less` on one page) must not stop the agent."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="ddprun_console_")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def test_agent_answers_and_stops_while_its_console_does_not_read(self):
        # Before: the agent wrote the --tee'd output to its stdout on its event loop; with that
        # pipe full it blocked there: no health answer, no heartbeat, SIGTERM not acted on
        # until someone read.
        import select
        import socket
        script = os.path.join(self.dir, "flood.py")
        with open(script, "w") as f:
            f.write(FLOOD)
        fifo = os.path.join(self.dir, "flooded")
        os.mkfifo(fifo)
        # Not a bind(0) port: released, it may go to the agent's own store bind(0) next (which
        # then fails the endpoint's bind and the job).
        port = free_port()
        env = dict(os.environ, TORCHELASTIC_HEALTH_CHECK_PORT=str(port))
        with open(self.p("err"), "wb") as err:
            proc = subprocess.Popen([DDPRUN, "--master-port", "0", "--nproc-per-node", "1", "--tee", "3",
                                     "--log-dir", self.p("logs"), "--no-python", PYTHON, script, fifo],
                                    stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env)
        try:
            rd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            try:
                ready, _, _ = select.select([rd], [], [], 60)
                self.assertTrue(ready, "the worker did not get 512 KiB out")
            finally:
                os.close(rd)
            # Nobody reads ddprun's stdout. Its event loop still answers:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.settimeout(10)
                c.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
                self.assertTrue(c.recv(4096).startswith(b"HTTP/1.1 200 OK"))
            # and stops the job on SIGTERM, waiting at most a moment for the console at exit.
            proc.send_signal(signal.SIGTERM)
            self.assertEqual(proc.wait(timeout=30), 128 + signal.SIGTERM)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        with open(self.p("err"), "rb") as f:
            err = f.read().decode(errors="replace")
        self.assertIn("received SIGTERM", err)

    def p(self, name):
        return os.path.join(self.dir, name)


if __name__ == "__main__":
    if not os.path.exists(DDPRUN):
        print(f"{DDPRUN} not built", file=sys.stderr)
        sys.exit(1)
    unittest.main(verbosity=2)
