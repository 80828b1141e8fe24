"""torchrun's current flags and agent environment under ddprun, end to end (real processes).

Classes (each runnable alone, e.g. `test_torchrun_compat.py FileTimer`):
  PortZero    --rdzv-endpoint HOST:0: several jobs on one machine, each hosting on a free port.
  RdzvConf    --rdzv-conf as lenient as torchrun (unknown keys, literal quotes, timeout+join_timeout).
  FileTimer   TORCHELASTIC_ENABLE_FILE_TIMER with torch's FileTimerClient ($PYTHON_EXEC: 1.13, or
              2.6 through the torch2 tier) and with a native writer; the FIFO after a SIGKILL of
              ddprun (removed by the watchdog unless replaced or read by another process).
  Health      TORCHELASTIC_HEALTH_CHECK_PORT answers over HTTP while the job runs.
  EventLog    --event-log-handler console / file:PATH / null, --logs-specs.
  Summary     the failure summary names the script and lists the failed ranks.
  PeerFlags   a peer tool's option is refused instead of read as an abbreviation.
  Forms       torchrun command lines: the static backend at --rdzv-endpoint, "--" after the
              script, --log-dir /dev/null, a directory or zip application as the program.
Every wait is bounded by a subprocess timeout; readiness comes from the workers' own files.
"""
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import unittest

BIN = os.environ.get("DDPRUN_BIN_DIR", "")
DDPRUN = os.path.join(BIN, "ddprun")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_diagnosis import children, comm  # noqa: E402  (this directory)
from ports import free_port  # noqa: E402
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")

# ddprun keeps a failed job's run directory under TMPDIR (error files, stacks) for the user to read;
# these tests fail jobs on purpose, so every ddprun they start gets a TMPDIR of their own.
SCRATCH = tempfile.mkdtemp(prefix="ddprun-compat-test-")
os.environ["TMPDIR"] = SCRATCH


def tearDownModule():
    shutil.rmtree(SCRATCH, ignore_errors=True)


def run(args, timeout=90, env=None, cwd=None):
    e = dict(os.environ)
    e["PYTHON_EXEC"] = PYTHON
    e["PET_MASTER_PORT"] = "0"  # the worker store on a free port: other jobs may hold 29500
    e.update(env or {})
    return subprocess.run([DDPRUN] + args, capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd)


class Base(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="ddprun_compat_")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def p(self, name):
        return os.path.join(self.dir, name)

    def ok(self, r):
        self.assertEqual(r.returncode, 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}")


class PortZero(Base):
    def test_two_c10d_jobs_on_port_zero_at_once(self):
        # torchrun's recipe for several single-node jobs on one machine. Both run at the same time:
        # each waits for a file only the other one writes, so neither can finish alone.
        prog = ["--no-python", "/bin/sh", "-c"]
        script = ('touch "$1/started.$2"; i=0; while [ ! -e "$1/started.$3" ]; do i=$((i+1)); '
                  '[ $i -gt 3000 ] && exit 7; sleep 0.01; done; echo "port=$MASTER_PORT"')
        e = dict(os.environ, PYTHON_EXEC=PYTHON)
        procs = [subprocess.Popen([DDPRUN, "--rdzv-backend=c10d", "--nnodes=1", "--rdzv-endpoint=localhost:0",
                                   "--nproc-per-node=2"] + prog + [script, "sh", self.dir, me, other],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
                 for me, other in (("a", "b"), ("b", "a"))]
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=45)  # the old behaviour gave up after 60 s
                self.assertEqual(p.returncode, 0, f"stdout:\n{out}\nstderr:\n{err}")
                self.assertIn("hosts the rendezvous at localhost:", err)
                outs.append(out)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        self.assertEqual(sum(o.count("port=") for o in outs), 4)

    def test_static_single_node_port_zero_is_a_free_port(self):
        # The static backend meets at the endpoint (torchrun's rule): port 0 is a free port there.
        r = run(["--rdzv-endpoint=localhost:0", "--nproc-per-node=2", "--no-python", "/bin/sh", "-c",
                 'echo "port=$MASTER_PORT"'])
        self.ok(r)
        self.assertEqual(r.stdout.count("port="), 2)
        self.assertNotIn("port=0\n", r.stdout)

    def test_port_zero_with_several_nodes_is_refused(self):
        r = run(["--rdzv-backend=c10d", "--nnodes=2", "--rdzv-endpoint=localhost:0", "--no-python", "/bin/true"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("port 0", r.stderr)
        self.assertIn("give a fixed port for 2 nodes", r.stderr)


class RdzvConf(Base):
    def test_lenient_keys_and_literal_quotes(self):
        r = run(["--rdzv-backend=c10d", "--nnodes=1", "--rdzv-endpoint=localhost:0",
                 "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=9,foo=bar,use_libuv=0,store_type=tcp,"
                 "keep_alive_interval=2,read_timeout=30'", "--no-python", "/bin/true"])
        self.ok(r)
        self.assertIn("ignored: unknown key 'foo'", r.stderr)
        self.assertIn("ignored: use_libuv=0", r.stderr)
        self.assertIn("ignored: timeout=9", r.stderr)

    def test_bad_value_of_a_known_key_is_still_an_error(self):
        r = run(["--rdzv-conf=join_timeout=soon", "--no-python", "/bin/true"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("join_timeout", r.stderr)


class FileTimer(Base):
    def test_torch_file_timer_client_kills_and_the_group_restarts(self):
        fifo = self.p("watchdog.fifo")
        r = run(["--nproc-per-node=2", "--max-restarts=1", os.path.join(HERE, "file_timer_worker.py"), self.dir],
                timeout=150, env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TORCHELASTIC_TIMER_FILE": fifo})
        self.ok(r)
        self.assertTrue(os.path.exists(self.p("armed")), r.stderr)
        with open(self.p("timer_file.0.0")) as f:
            self.assertEqual(f.read(), fifo)
        self.assertIn("scope 'stuck_step' of worker pid", r.stderr)
        self.assertIn("SIGKILL", r.stderr)
        self.assertTrue(os.path.exists(self.p("restarted.0")) and os.path.exists(self.p("restarted.1")))
        self.assertFalse(os.path.exists(fifo), "the agent removes its FIFO")

    def test_requested_signal_is_used(self):
        r = run(["--max-restarts=0", os.path.join(HERE, "file_timer_worker.py"), self.dir, str(int(signal.SIGTERM))],
                timeout=150, env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"})
        self.assertEqual(r.returncode, 128 + signal.SIGTERM, r.stderr)
        self.assertIn("killing it with SIGTERM", r.stderr)
        with open(self.p("timer_file.0.0")) as f:
            path = f.read()
        self.assertTrue(path.startswith("/tmp/watchdog_timer_"), path)  # torch's default name
        self.assertFalse(os.path.exists(path))

    def test_native_writer(self):
        # What FileTimerClient writes, from a shell: one JSON line per request.
        script = ('if [ "$TORCHELASTIC_RESTART_COUNT" = 1 ]; then exit 0; fi; '
                  'printf \'{"version": 1, "pid": %d, "scope_id": "release_me", "expiration_time": %d, '
                  '"signal": 9}\\n\' $$ $(( $(date +%s) + 1 )) > "$TORCHELASTIC_TIMER_FILE"; '
                  'printf \'{"version": 1, "pid": %d, "scope_id": "release_me", "expiration_time": -1, '
                  '"signal": 0}\\n\' $$ > "$TORCHELASTIC_TIMER_FILE"; '
                  'printf \'{"version": 1, "pid": %d, "scope_id": "native", "expiration_time": %d.5, '
                  '"signal": 15}\\n\' $$ $(( $(date +%s) + 1 )) > "$TORCHELASTIC_TIMER_FILE"; '
                  'echo not json > "$TORCHELASTIC_TIMER_FILE"; exec sleep 60')
        r = run(["--max-restarts=1", "--no-python", "/bin/sh", "-c", script], timeout=90,
                env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"})
        self.ok(r)
        self.assertIn("scope 'native' of worker pid", r.stderr)
        self.assertIn("killing it with SIGTERM", r.stderr)
        self.assertNotIn("release_me", r.stderr)
        self.assertIn("ignoring a line", r.stderr)

    def test_only_the_attempts_own_processes_are_signalled(self):
        # A request naming a process outside the job (here a stand-in for sshd or another job's
        # agent) is refused; the worker's own expired timer right after it shows the agent read both.
        victim = subprocess.Popen(["sleep", "120"])
        try:
            script = ('printf \'{"version": 1, "pid": %d, "scope_id": "victim", "expiration_time": %d, '
                      '"signal": 9}\\n\' "$VICTIM" $(( $(date +%s) - 1 )) > "$TORCHELASTIC_TIMER_FILE"; '
                      'printf \'{"version": 1, "pid": %d, "scope_id": "own", "expiration_time": %d, '
                      '"signal": 15}\\n\' $$ $(( $(date +%s) - 1 )) > "$TORCHELASTIC_TIMER_FILE"; exec sleep 60')
            r = run(["--max-restarts=0", "--no-python", "/bin/sh", "-c", script], timeout=90,
                    env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "VICTIM": str(victim.pid)})
            self.assertEqual(r.returncode, 128 + signal.SIGTERM, r.stderr)
            self.assertIn("scope 'own' of worker pid", r.stderr)
            self.assertIn(f"not signalling pid {victim.pid}", r.stderr)
            self.assertIsNone(victim.poll(), "the agent killed a process outside the job")
        finally:
            victim.kill()
            victim.wait()

    def test_a_dead_workers_timers_go_with_it(self):
        # Attempt 0 arms a 2 s timer and fails at once; its pid must not be signalled later (a
        # recycled pid would be some other process). Attempt 1 arms 4 s and is killed by it.
        script = ('if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then '
                  'printf \'{"version": 1, "pid": %d, "scope_id": "dead_scope", "expiration_time": %d, '
                  '"signal": 9}\\n\' $$ $(( $(date +%s) + 2 )) > "$TORCHELASTIC_TIMER_FILE"; exit 1; fi; '
                  'printf \'{"version": 1, "pid": %d, "scope_id": "late", "expiration_time": %d, '
                  '"signal": 15}\\n\' $$ $(( $(date +%s) + 4 )) > "$TORCHELASTIC_TIMER_FILE"; exec sleep 60')
        r = run(["--max-restarts=1", "--no-python", "/bin/sh", "-c", script], timeout=90,
                env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"})
        self.assertEqual(r.returncode, 128 + signal.SIGTERM, r.stderr)
        self.assertIn("scope 'late' of worker pid", r.stderr)
        self.assertNotIn("dead_scope", r.stderr)
        # The cause names ddprun's file timer (its signal is not a candidate for an OOM kill).
        self.assertIn("killed by ddprun's file timer (a FileTimer scope expired)", r.stderr)

    def test_timer_file_naming_a_script_is_refused(self):
        script = self.p("train.py")
        with open(script, "w") as f:
            f.write("print('hi')\n")
        r = run(["--no-python", "/bin/true"], env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1",
                                                   "TORCHELASTIC_TIMER_FILE": script})
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(script, r.stderr)
        self.assertIn("not a FIFO", r.stderr)
        with open(script) as f:
            self.assertEqual(f.read(), "print('hi')\n")

    def test_off_by_default(self):
        r = run(["--no-python", "/bin/sh", "-c", 'test -z "$TORCHELASTIC_TIMER_FILE"'])
        self.ok(r)

    def test_fifo_is_removed_when_ddprun_is_killed(self):
        # SIGKILLed, the agent cannot remove its FIFO: the watchdog does, once it sees the agent
        # gone, only while the path names that FIFO and nobody reads it (a new job's agent given
        # the same path would, and its FIFO may even have the old one's inode). With the watchdog
        # program and with the agent's fork where the program is missing.
        lone_dir = self.p("lone")
        os.makedirs(lone_dir)
        shutil.copy2(DDPRUN, lone_dir)
        script = 'echo "$TORCHELASTIC_TIMER_FILE" > "$1"; echo ready; exec sleep 60'
        for binary in (DDPRUN, os.path.join(lone_dir, "ddprun")):
            for replaced in (False, "by a new FIFO", "read by another process"):
                with self.subTest(watchdog="program" if binary == DDPRUN else "fork", replaced=replaced):
                    told = self.p(f"fifo-path-{replaced}-{binary == DDPRUN}")
                    e = dict(os.environ, PYTHON_EXEC=PYTHON, PET_MASTER_PORT="0", TORCHELASTIC_ENABLE_FILE_TIMER="1")
                    proc = subprocess.Popen([binary, "--no-python", "/bin/sh", "-c", script, "sh", told],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            env=e, text=True)
                    fifo = None
                    reader = -1
                    try:
                        self.assertTrue(select.select([proc.stdout], [], [], 60)[0], "no readiness line")
                        self.assertEqual(proc.stdout.readline().strip(), "ready")
                        with open(told) as f:
                            fifo = f.read().strip()
                        self.assertTrue(fifo.startswith("/tmp/watchdog_timer_"), fifo)
                        watchdogs = [pid for pid in children(proc.pid) if comm(pid) == "ddp-watchdog"]
                        self.assertEqual(len(watchdogs), 1, "ddprun runs one watchdog")
                        pidfd = os.pidfd_open(watchdogs[0])
                        if replaced == "by a new FIFO":  # somebody else's FIFO at the path now: it stays
                            os.unlink(fifo)
                            os.mkfifo(fifo, 0o600)
                        elif replaced:  # a reader other than the agent (a new job's agent): it stays
                            reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
                        proc.kill()
                        proc.wait(timeout=30)
                        try:
                            # The watchdog's end (its pidfd readable) comes after its cleanup.
                            self.assertTrue(select.select([pidfd], [], [], 30)[0], "the watchdog did not end")
                        finally:
                            os.close(pidfd)
                        self.assertEqual(os.path.exists(fifo), bool(replaced),
                                         f"the FIFO {replaced} was removed" if replaced
                                         else "ddprun's FIFO outlived its watchdog")
                    finally:
                        if reader >= 0:
                            os.close(reader)
                        if proc.poll() is None:
                            proc.kill()
                            proc.wait()
                        proc.stdout.close()
                        proc.stderr.close()
                        if fifo and os.path.exists(fifo):
                            os.unlink(fifo)


class Health(Base):
    def test_health_endpoint_answers_while_the_job_runs(self):
        port = free_port()
        out = self.p("answer")
        r = run([os.path.join(HERE, "health_probe.py"), str(port), out],
                env={"TORCHELASTIC_HEALTH_CHECK_PORT": str(port), "PYTHON_EXEC": "/usr/bin/python3"})
        self.ok(r)
        with open(out, "rb") as f:
            raw = f.read().decode()
        head, _, body = raw.partition("\r\n\r\n")
        self.assertTrue(head.startswith("HTTP/1.1 200 OK"), raw)
        doc = json.loads(body)
        self.assertEqual(doc["status"], "alive")
        self.assertEqual(doc["state"], "running round 0")
        self.assertIsInstance(doc["last_progress_time"], int)

    def test_bad_port_is_an_error(self):
        r = run(["--no-python", "/bin/true"], env={"TORCHELASTIC_HEALTH_CHECK_PORT": "http"})
        self.assertEqual(r.returncode, 2)
        self.assertIn("TORCHELASTIC_HEALTH_CHECK_PORT", r.stderr)


class EventLog(Base):
    def test_file_handler_records_the_job(self):
        log = self.p("events.jsonl")
        r = run(["--event-log-handler", "file:" + log, "--max-restarts=1", "--no-python", "/bin/sh", "-c",
                 'exit $((1 - TORCHELASTIC_RESTART_COUNT))'])
        self.ok(r)
        with open(log) as f:
            events = [json.loads(line) for line in f]
        names = [e["name"] for e in events]
        self.assertEqual(names, ["ddprun.agent.started", "ddprun.round.started", "torchelastic.worker.status.FAILED",
                                 "ddprun.round.restart", "ddprun.round.started",
                                 "torchelastic.worker.status.SUCCEEDED"])
        failed = events[2]
        self.assertEqual(failed["source"], "WORKER")
        self.assertEqual(failed["metadata"]["global_rank"], 0)
        self.assertEqual(events[4]["metadata"]["agent_restarts"], 1)
        for e in events:
            self.assertIsInstance(e["timestamp"], int)
            self.assertEqual(e["metadata"]["entry_point"], "/bin/sh")

    def test_console_and_null(self):
        r = run(["--event-log-handler=console", "--no-python", "/bin/true"])
        self.ok(r)
        self.assertIn('"name":"torchelastic.worker.status.SUCCEEDED"', r.stderr)
        for handler in ("null", "dynamic_rendezvous"):
            r = run(["--event-log-handler=" + handler, "--no-python", "/bin/true"])
            self.ok(r)
            self.assertNotIn('"name":', r.stderr)
        r = run(["--event-log-handler=syslog", "--no-python", "/bin/true"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("console", r.stderr)

    def test_logs_specs(self):
        self.ok(run(["--logs-specs=default", "--no-python", "/bin/true"]))
        r = run(["--logs-specs=my_plugin", "--no-python", "/bin/true"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("torchrun.logs_specs", r.stderr)


class DuplicateFilters(Base):
    def test_matching_lines_are_copied_to_the_filtered_logs(self):
        import glob
        script = ('echo "apple pie"; echo banana; echo "or,ange juice"; echo "apple err" >&2; '
                  'echo "kiwi err" >&2')
        r = run(["--log-dir", self.dir, "--nproc-per-node=2", "--duplicate-stdout-filters=apple,or,,ange",
                 "--duplicate-stderr-filters=kiwi", "--no-python", "/bin/sh", "-c", script])
        self.ok(r)
        # The console still gets every line, unprefixed as without the filters.
        self.assertEqual(r.stdout.count("banana\n"), 2)
        self.assertEqual(r.stdout.count("apple pie\n"), 2)
        self.assertEqual(r.stderr.count("apple err\n"), 2)
        [attempt] = glob.glob(os.path.join(self.dir, "*", "attempt_0"))
        with open(os.path.join(attempt, "filtered_stdout.log")) as f:
            out = sorted(f.read().splitlines())
        self.assertEqual(out, ["[default0]:apple pie", "[default0]:or,ange juice",
                               "[default1]:apple pie", "[default1]:or,ange juice"])
        with open(os.path.join(attempt, "filtered_stderr.log")) as f:
            self.assertEqual(sorted(f.read().splitlines()), ["[default0]:kiwi err", "[default1]:kiwi err"])


    def test_a_line_longer_than_the_output_buffer(self):
        import glob
        # 100 KiB of one line, the filter straddling the agent's 64 KiB buffer, then a last line
        # without a newline: stdout.log gets the bytes unchanged, the filtered copy whole lines.
        script = ('python = __import__("sys").stdout; '
                  'python.write("a" * 65530 + "NEEDLE" + "b" * 40000 + "\\nplain\\nlast NEEDLE")')
        r = run(["--log-dir", self.dir, "--tee=1", "--duplicate-stdout-filters=NEEDLE", "--no-python",
                 "/usr/bin/python3", "-c", script])
        self.ok(r)
        [attempt] = glob.glob(os.path.join(self.dir, "*", "attempt_0"))
        with open(os.path.join(attempt, "0", "stdout.log")) as f:
            self.assertEqual(f.read(), "a" * 65530 + "NEEDLE" + "b" * 40000 + "\nplain\nlast NEEDLE")
        with open(os.path.join(attempt, "filtered_stdout.log")) as f:
            self.assertEqual(f.read(), "[default0]:" + "a" * 65530 + "NEEDLE" + "b" * 40000 +
                             "\n[default0]:last NEEDLE\n")

    def test_the_unprefixed_console_stream_is_unchanged_by_the_filters(self):
        # Without --tee/--redirects the console gets the rank's bytes as without filters: no
        # newline of ddprun's where the 64 KiB buffer cuts a line, nor after a last line without
        # one (a JSON-lines file written through stdout stays one line per record).
        text = "a" * 65530 + "NEEDLE" + "b" * 40000 + "\nplain\nlast NEEDLE"
        script = 'import sys; sys.stdout.write("a" * 65530 + "NEEDLE" + "b" * 40000 + "\\nplain\\nlast NEEDLE")'
        r = run(["--log-dir", self.dir, "--duplicate-stdout-filters=NEEDLE", "--no-python", "/usr/bin/python3", "-c",
                 script])
        self.ok(r)
        self.assertEqual(r.stdout, text)


class Summary(Base):
    def test_summary_names_the_script(self):
        script = self.p("train.py")
        with open(script, "w") as f:
            f.write("import sys\nsys.exit(3)\n")
        r = run(["--nproc-per-node=1", "train.py"], cwd=self.dir)
        self.assertEqual(r.returncode, 3)
        self.assertIn("train.py FAILED", r.stderr)
        self.assertNotIn("python3 FAILED", r.stderr)

    def test_every_rank_that_failed_on_its_own_is_listed_root_cause_first(self):
        # Rank 1 fails first (exit 5). Rank 2 ignores SIGTERM and exits 4 by itself once rank 1 is
        # gone: a failure of its own, listed under "Failures:". Rank 0 is ended by ddprun's
        # SIGTERM: a consequence, not listed.
        script = ('case $RANK in '
                  '1) touch "$0/one"; exit 5;; '
                  '2) trap "" TERM; i=0; while [ ! -e "$0/one" ]; do i=$((i+1)); [ $i -gt 3000 ] && exit 9; '
                  'sleep 0.01; done; sleep 0.3; exit 4;; '
                  '*) exec sleep 60;; esac')
        events = self.p("events.jsonl")
        r = run(["--nproc-per-node=3", "--event-log-handler=file:" + events, "--no-python", "/bin/sh", "-c", script,
                 self.dir])
        self.assertEqual(r.returncode, 5, r.stderr)
        with open(events) as f:
            failed = [json.loads(line)["metadata"] for line in f
                      if json.loads(line)["name"] == "torchelastic.worker.status.FAILED"
                      and json.loads(line)["source"] == "WORKER"]
        self.assertEqual([(e["global_rank"], e["raw_error"]) for e in failed],
                         [(1, "exit code 5"), (2, "exit code 4")])
        summary = r.stderr[r.stderr.index("/bin/sh FAILED"):]
        failures, _, root = summary.partition("Root Cause (first observed failure):")
        self.assertIn("[0]:", root)
        self.assertIn("rank       : 1 (local_rank: 1)", root)
        self.assertIn("exitcode   : 5", root)
        self.assertIn("[1]:", failures)
        self.assertIn("rank       : 2 (local_rank: 2)", failures)
        self.assertIn("exitcode   : 4", failures)
        self.assertIn("failed on its own after the first failure", failures)
        self.assertNotIn("<NO_OTHER_FAILURES>", failures)
        self.assertNotIn("rank       : 0 ", summary)


class LauncherErrorFile(Base):
    # torchrun's main is decorated with @record: a scheduler that sets TORCHELASTIC_ERROR_FILE for
    # the launcher reads the root cause back from it.
    WORKER = ("import json, os, sys\n"
              "if os.environ['RANK'] == '1':\n"
              "    with open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w') as f:\n"
              "        json.dump({'message': {'message': 'ValueError: rank 1 broke', 'extraInfo': {\n"
              "            'py_callstack': 'Traceback ... ValueError: rank 1 broke', 'timestamp': '1'}}}, f)\n"
              "    sys.exit(3)\n")

    def test_the_root_cause_rank_error_file_with_its_exit_code(self):
        with open(self.p("w.py"), "w") as f:
            f.write(self.WORKER)
        mine = self.p("launcher.json")
        r = run(["--nproc-per-node=2", "w.py"], cwd=self.dir, env={"TORCHELASTIC_ERROR_FILE": mine})
        self.assertEqual(r.returncode, 3, r.stderr)
        with open(mine) as f:
            message = json.load(f)["message"]
        self.assertEqual(message["message"], "ValueError: rank 1 broke")
        self.assertEqual(message["errorCode"], 3)
        self.assertIn("Traceback", message["extraInfo"]["py_callstack"])

    def test_ddprun_own_failures_in_torch_format(self):
        mine = self.p("launcher.json")
        r = run(["--nnodes=2:1", "w.py"], cwd=self.dir, env={"TORCHELASTIC_ERROR_FILE": mine})
        self.assertEqual(r.returncode, 2, r.stderr)
        with open(mine) as f:
            self.assertIn("--nnodes=2:1", json.load(f)["message"]["message"])
        os.unlink(mine)
        with open(self.p("w.py"), "w") as f:
            f.write("pass\n")
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # nothing listens there
        r = run(["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:%d" % port,
                 "--rdzv-conf=is_host=0,read_timeout=1", "w.py"], cwd=self.dir, env={"TORCHELASTIC_ERROR_FILE": mine})
        self.assertEqual(r.returncode, 1, r.stderr)
        with open(mine) as f:
            message = json.load(f)["message"]
        self.assertIn("unreachable", message["message"])
        self.assertIn("timestamp", message["extraInfo"])
        # A link planted at the path is replaced, not written through.
        os.unlink(mine)
        target = self.p("target")
        open(target, "w").close()
        os.symlink(target, mine)
        r = run(["--nnodes=2:1", "w.py"], cwd=self.dir, env={"TORCHELASTIC_ERROR_FILE": mine})
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertFalse(os.path.islink(mine))
        self.assertEqual(os.path.getsize(target), 0)
        # ddprun status is not a launch: its errors are not recorded.
        os.unlink(mine)
        r = run(["status"], cwd=self.dir, env={"TORCHELASTIC_ERROR_FILE": mine})
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertFalse(os.path.exists(mine))
        # A job that succeeds writes nothing.
        r = run(["--nproc-per-node=1", "w.py"], cwd=self.dir, env={"TORCHELASTIC_ERROR_FILE": mine})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(os.path.exists(mine))


class PeerFlags(Base):
    def test_deepspeed_launcher_flag(self):
        r = run(["--launcher", "pdsh", "--hosts", "h1,h2", "--no-python", "/bin/true"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("DeepSpeed's option", r.stderr)
        self.assertNotIn("cannot host the rendezvous", r.stderr)

    def test_mpirun_flags(self):
        for flag, tool in (("--np", "horovodrun"), ("--prefix", "mpirun")):
            r = run([flag, "4", "--no-python", "/bin/true"])
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(tool, r.stderr)
        # The flags themselves, spelled out, still work.
        self.ok(run(["--prefix-output", "--no-python", "/bin/true"]))


class Forms(Base):
    # One write per line: under `python -u` print() writes each argument separately, and two
    # ranks sharing ddprun's stdout interleave mid-line ("argvargv  ['x']['x']").
    ARGV = ("import os, sys; sys.stdout.write('argv %s %s %s\\n' % (sys.argv[1:], os.environ['MASTER_ADDR'], "
            "os.environ['MASTER_PORT']))\n")

    def test_static_endpoint_is_where_a_single_node_job_serves(self):
        port = free_port()
        r = run(["--rdzv-endpoint", "127.0.0.1:%d" % port, "--no-python", "/bin/sh", "-c",
                 'echo "at=$MASTER_ADDR:$MASTER_PORT"'])
        self.ok(r)
        self.assertIn("at=127.0.0.1:%d\n" % port, r.stdout)

    def test_static_endpoint_is_where_two_nodes_meet(self):
        # Node 0 is also given --master-port (the endpoint wins, as in torchrun); node 1 only the
        # endpoint. The dry run names the same place.
        port, other = free_port(), free_port()
        common = ["--nnodes=2", "--rdzv-endpoint=127.0.0.1:%d" % port, "--rdzv-conf=join_timeout=30,read_timeout=30"]
        dry = run(common + ["--node-rank=1", "--dry-run", "--no-python", "/bin/true"])
        self.ok(dry)
        self.assertIn("rendezvous at 127.0.0.1:%d," % port, dry.stdout)
        e = dict(os.environ, PYTHON_EXEC=PYTHON)
        prog = ["--no-python", "/bin/sh", "-c", 'echo "rank=$RANK world=$WORLD_SIZE"']
        nodes = [subprocess.Popen([DDPRUN] + common + ["--node-rank=0", "--master-port=%d" % other] + prog,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e),
                 subprocess.Popen([DDPRUN] + common + ["--node-rank=1"] + prog,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)]
        try:
            outs = [p.communicate(timeout=60) for p in nodes]
        finally:
            for p in nodes:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        for p, (out, err) in zip(nodes, outs):
            self.assertEqual(p.returncode, 0, f"stdout:\n{out}\nstderr:\n{err}")
        self.assertIn("rank=0 world=2", outs[0][0])
        self.assertIn("rank=1 world=2", outs[1][0])
        self.assertIn("ignoring --master-port=%d" % other, outs[0][1])

    def test_local_rank_placeholders_in_the_arguments(self):
        # torchrun substitutes ${local_rank} in the worker arguments (Template.safe_substitute),
        # the script's path included. ddprun does so in the arguments that name it; the others
        # (here "d=$$", as in `sh -c 'echo $$'`) are passed as they are, where torchrun would
        # also turn their "$$" into "$".
        for i in range(2):
            with open(self.p("t%d.py" % i), "w") as f:
                f.write("import os, sys; sys.stdout.write('script%d rank %%s argv %%s\\n' %% "
                        "(os.environ['LOCAL_RANK'], sys.argv[1:]))\n" % i)
        r = run(["--nproc-per-node", "2", "t${local_rank}.py", "--out=log_${local_rank}", "$local_rank", "d=$$",
                 "$HOME", "${rank}", "p=$$:${local_rank}"], cwd=self.dir)
        self.ok(r)
        for rank in range(2):
            argv = ["--out=log_%d" % rank, str(rank), "d=$$", "$HOME", "${rank}", "p=$:%d" % rank]
            self.assertIn("script%d rank %d argv %r\n" % (rank, rank, argv), r.stdout)

    def test_the_opt_out_of_the_agent_store(self):
        # torch 2.x's dynamic rendezvous (--standalone, c10d, etcd-v2) reads it; the static one
        # does not. With it, nothing listens at MASTER_PORT until the workers' rank 0 does.
        show = 'echo "use=$TORCHELASTIC_USE_AGENT_STORE port=$MASTER_PORT"'
        opt_out = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        r = run(["--standalone", "--no-python", "/bin/sh", "-c", show], env=opt_out)
        self.ok(r)
        m = re.search(r"use=False port=(\d+)\n", r.stdout)
        self.assertIsNotNone(m, r.stdout)
        self.assertNotIn("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", r.stderr)
        probe = self.p("probe.py")
        with open(probe, "w") as f:  # run as rank 0 while its agent holds the port
            f.write("import os, socket\n"
                    "try:\n"
                    "    socket.create_connection(('127.0.0.1', int(os.environ['MASTER_PORT'])), 5)\n"
                    "    print('listening')\n"
                    "except ConnectionRefusedError:\n"
                    "    print('refused')\n")
        r = run(["--standalone", probe], env=opt_out)
        self.ok(r)
        self.assertEqual(r.stdout.strip().splitlines()[-1], "refused", r.stdout)
        r = run(["--standalone", probe])
        self.ok(r)
        self.assertEqual(r.stdout.strip().splitlines()[-1], "listening", r.stdout)
        # The static rendezvous (one node without --standalone) always shares, as torchrun's.
        r = run(["--no-python", "/bin/sh", "-c", show], env=opt_out)
        self.ok(r)
        self.assertIn("use=True", r.stdout)
        self.assertIn("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 has no effect with the static rendezvous", r.stderr)
        # Only exactly "1", as torch reads it.
        r = run(["--standalone", "--no-python", "/bin/sh", "-c", show],
                env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "true"})
        self.ok(r)
        self.assertIn("use=True", r.stdout)

    def test_double_dash_after_the_script_is_dropped(self):
        script = self.p("t.py")
        with open(script, "w") as f:
            f.write(self.ARGV)
        for words, expected in ((["t.py", "--", "--lr", "0.1"], ['--lr', '0.1']),
                                (["t.py", "a", "--", "b"], ['a', '--', 'b']),
                                (["--", "t.py", "--", "b"], ['--', 'b'])):
            r = run(words, cwd=self.dir)
            self.ok(r)
            self.assertIn("argv %r" % (expected,), r.stdout)

    def test_run_path_script_as_typed(self):
        # torchrun --run-path: sys.argv[0] and __file__ are the path as typed, relative here.
        os.mkdir(self.p("sub"))
        with open(self.p("sub/t.py"), "w") as f:
            f.write("import sys; sys.stdout.write('argv0 %s file %s rest %s\\n' % (sys.argv[0], __file__, "
                    "sys.argv[1:]))\n")
        r = run(["--run-path", "sub/t.py", "--lr", "1"], cwd=self.dir)
        self.ok(r)
        self.assertIn("argv0 sub/t.py file sub/t.py rest ['--lr', '1']\n", r.stdout)

    def test_run_path_records_the_exception_as_torchrun_does(self):
        # torchrun's run_script_path is decorated with @record: the summary shows the traceback.
        with open(self.p("boom.py"), "w") as f:
            f.write("def main():\n    raise ValueError('plain exc')\n\nmain()\n")
        r = run(["--run-path", "boom.py"], cwd=self.dir)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertRegex(r.stderr, r"error_file : /\S+/error\.json")
        self.assertIn("message    : ValueError: plain exc", r.stderr)
        self.assertIn('boom.py", line 2, in main', r.stderr)
        # SystemExit is the script's own exit code, not an error to record.
        with open(self.p("quit.py"), "w") as f:
            f.write("import sys\nsys.exit(4)\n")
        r = run(["--run-path", "quit.py"], cwd=self.dir)
        self.assertEqual(r.returncode, 4, r.stderr)
        self.assertIn("error_file : <N/A>", r.stderr)

    def test_nccl_async_error_handling_names_follow_the_torch_on_the_path(self):
        # torch 1.x reads only NCCL_ASYNC_ERROR_HANDLING; 2.2+ reads TORCH_NCCL_ASYNC_ERROR_HANDLING
        # first and warns on every rank that still has the old name, which torchrun 2.x never sets.
        script = self.p("aeh.py")
        with open(script, "w") as f:
            f.write("import os, sys; sys.stdout.write('aeh %s %s\\n' % (os.environ.get('NCCL_ASYNC_ERROR_HANDLING'), "
                    "os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING')))\n")
        r = run([script], cwd=self.dir)  # Debian's torch 1.13 on the path
        self.ok(r)
        self.assertIn("aeh 1 1\n", r.stdout)
        os.makedirs(self.p("newer/torch"))
        with open(self.p("newer/torch/version.py"), "w") as f:
            f.write("from typing import Optional\n__version__ = '2.6.0+debian'\n")
        r = run([script], cwd=self.dir, env={"PYTHONPATH": self.p("newer")})
        self.ok(r)
        self.assertIn("aeh None 1\n", r.stdout)
        # A value the user exported is theirs, under any torch.
        r = run([script], cwd=self.dir, env={"NCCL_ASYNC_ERROR_HANDLING": "0"})
        self.ok(r)
        self.assertIn("aeh 0 1\n", r.stdout)

    def test_a_c_locale_is_coerced_as_under_torchrun(self):
        # torchrun is a Python program: in a C locale Python sets LC_CTYPE=C.UTF-8 in its own
        # environment (PEP 538), so torchrun's native workers inherit it; ddprun's get the same.
        src = os.environ.get("DDPRUN_SOURCE_DIR", os.path.dirname(os.path.dirname(HERE)))
        torchrun = [PYTHON, os.path.join(src, "bench", "launch", "torchrun_fixed.py"), "--standalone",
                    "--nproc_per_node", "1", "--monitor_interval", "0.1", "--no_python"]
        ddprun = [DDPRUN, "--standalone", "--nproc-per-node", "1", "--no-python"]
        worker = ["sh", "-c", 'echo "lc=${LC_CTYPE-unset}"']
        base = {k: v for k, v in os.environ.items() if k not in ("LANG", "LC_ALL", "LC_CTYPE", "PYTHONCOERCECLOCALE")}
        base["LOGLEVEL"] = "WARNING"
        seen = {}
        for name, extra in (("nothing set", {}), ("LANG=C", {"LANG": "C"}), ("LANG=C.UTF-8", {"LANG": "C.UTF-8"}), ("LC_ALL=C", {"LC_ALL": "C"}),
                            ("PYTHONCOERCECLOCALE=0", {"PYTHONCOERCECLOCALE": "0"})):
            got = []
            for cmd in (torchrun, ddprun):
                r = subprocess.run(cmd + worker, capture_output=True, text=True, timeout=90, env=dict(base, **extra))
                self.ok(r)
                m = re.search(r"lc=(\S+)", r.stdout)
                self.assertIsNotNone(m, f"{cmd[0]} with {name}:\n{r.stdout}\n{r.stderr}")
                got.append(m.group(1))
            self.assertEqual(got[1], got[0], f"ddprun against torchrun with {name}")
            seen[name] = got[0]
        # The comparison means something: torchrun coerced in some cases and not in others.
        self.assertEqual(seen["nothing set"], "C.UTF-8")
        self.assertEqual(seen["LC_ALL=C"], "unset")

    def test_log_dir_dev_null(self):
        # torch 2.6: no log directory, TORCHELASTIC_ERROR_FILE empty, the job runs. Rank 1 is off
        # the console (--local-ranks-filter) and has no file to go to; ddprun's temporary run
        # directory goes at the end even though the job failed (no error files, no stacks).
        tmp = self.p("tmp")
        os.mkdir(tmp)
        # Rank 1 fails only once rank 0 has written its line: on a busy box rank 1 could fail, and
        # the group be stopped, before rank 0's shell ran its echo (seen once in CI).
        flag = self.p("rank0-said-it")
        script = ('echo "rank$LOCAL_RANK error_file=[$TORCHELASTIC_ERROR_FILE]"; '
                  f'if [ "$LOCAL_RANK" = 0 ]; then : > {flag}; else while [ ! -e {flag} ]; do sleep 0.01; done; fi; '
                  'exit $LOCAL_RANK')
        r = run(["--log-dir", "/dev/null", "--nproc-per-node=2", "--local-ranks-filter=0", "--stacks=off",
                 "--no-python", "/bin/sh", "-c", script], env={"TMPDIR": tmp})
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("rank0 error_file=[]\n", r.stdout)
        self.assertNotIn("rank1", r.stdout)
        self.assertIn("error_file : <N/A>", r.stderr)
        self.assertNotIn("log directory set to", r.stderr)
        self.assertEqual(os.listdir(tmp), [])
        self.assertFalse(os.path.isdir("/dev/null"))
        # --redirects/--tee have no file to write: the streams stay on the console, as in torch 2.6.
        r = run(["--log-dir=/dev/null", "--redirects=3", "--no-python", "/bin/sh", "-c", "echo out; echo err >&2"],
                env={"TMPDIR": tmp})
        self.ok(r)
        self.assertIn("out\n", r.stdout)
        self.assertIn("err\n", r.stderr)
        self.assertIn("--log-dir=/dev/null writes no log files: ignoring --redirects=3", r.stderr)

    def test_directory_and_zip_application_as_the_program(self):
        import zipapp
        app = self.p("appdir")
        os.mkdir(app)
        with open(os.path.join(app, "__main__.py"), "w") as f:
            f.write(self.ARGV)
        r = run(["appdir", "--lr", "1"], cwd=self.dir)
        self.ok(r)
        self.assertIn("argv ['--lr', '1']", r.stdout)
        zipapp.create_archive(app, self.p("app.pyz"))
        os.chmod(self.p("app.pyz"), 0o755)  # executable, without a #! line: only Python runs it
        r = run(["--nproc-per-node=2", "app.pyz", "x"], cwd=self.dir)
        self.ok(r)
        self.assertEqual(r.stdout.count("argv ['x']"), 2)
        os.mkdir(self.p("data"))
        r = run(["./data"], cwd=self.dir)
        self.assertEqual(r.returncode, 2)
        self.assertIn("is a directory without __main__.py", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
