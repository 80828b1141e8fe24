"""End-to-end tests of containment and failure diagnosis through the real `ddprun` binary.

- containment: a worker's double-forked, setsid daemon ends after a normal end, after SIGTERM
  and after SIGKILL of ddprun (by pid, by process group, and by name with `pkill ddprun` and
  `pkill -f ddprun`, which must spare the watchdog), with each containment mechanism this box offers, with the
  ddprun-watchdog program and with the fork the agent uses where that program is missing; the
  run directory the watchdog removes after ddprun's exit;
- cause of death: a worker past its memory cgroup's limit is reported out of memory with its peak,
  with a memory cgroup per rank and with only the enclosing cgroup's count;
- culprit: a 2-rank gloo job where rank 1 sleeps outside all_reduce names rank 1 and its frame;
- hang: --hang-timeout ends a job that makes no progress, with the ranks' stacks.

Every wait is bounded and driven by output or files (readiness lines, pidfds), never a sleep.
"""
import ctypes
import glob
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest

BIN = os.environ.get("DDPRUN_BIN_DIR", "")
DDPRUN = os.path.join(BIN, "ddprun")
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")

# Double fork + setsid: the grandchild is re-parented away from the worker, in its own session.
DAEMON = r'''
import os, sys, signal
out = sys.argv[1]
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        fd = os.open(os.devnull, os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(fd, i)
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        os.close(r)
        while True:
            signal.pause()
    os._exit(0)
os.close(w)
os.wait()
pid = os.read(r, 32).decode()
with open(out, "w") as f:
    f.write(pid)
print("ready", flush=True)
if sys.argv[2] == "block":
    signal.pause()
sys.stdin.readline()  # the test's go-ahead: the daemon was seen alive
'''

# A worker whose daemon (fork, setsid, fork) forks and exits over and over: at each step the
# child takes over and its parent exits, so no pid of it lives long. Every step adds one
# to a counter in a shared mapping of the file argv[1]: a count that still moves says the loop
# runs; the second long holds the loop's process group. The worker prints "ready" once the loop
# has taken 100 steps, then waits to be ended. The loop ends by itself after argv[2] seconds, so
# one that escaped does not run on.
FORK_LOOP_C = r'''
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char** argv) {
  if (argc != 3) return 2;
  const int fd = open(argv[1], O_RDWR | O_CREAT, 0644);
  if (fd < 0 || ftruncate(fd, 2 * sizeof(long)) != 0) return 1;
  volatile long* count = mmap(0, 2 * sizeof(long), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (count == MAP_FAILED) return 1;
  const time_t end = time(0) + atoi(argv[2]);
  const pid_t daemon = fork();
  if (daemon < 0) return 1;
  if (daemon > 0) {
    while (*count < 100 && time(0) <= end) usleep(1000);
    printf("ready\n");
    fflush(stdout);
    for (;;) pause();
  }
  count[1] = setsid();
  if (fork() != 0) _exit(0);
  for (;;) {
    ++*count;
    usleep(200);  /* each pid lives ~0.2 ms: far less than a scan of /proc, gentle on the pid space */
    if (time(0) > end) _exit(0);
    if (fork() > 0) _exit(0);
  }
}
'''

# wrapped.py DDPRUN LOOP COUNTER HOW, as pid 1 of a PID namespace of its own: processes at pids
# 20001-20400 first, then the namespace's last pid set back to 300, so the fork loop's pids are
# below older processes' (as once the machine's pid counter wraps). ddprun then ends `how`;
# prints the loop's count once its helpers are gone and 0.5 s later.
WRAPPED = r'''import os, select, signal, subprocess, sys, time
ddprun, loop, counter, how = sys.argv[1:5]
def set_last_pid(n):
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(n))
def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
def count():
    with open(counter, "rb") as f:
        return int.from_bytes(f.read(8), "little", signed=True)
set_last_pid(20000)
for _ in range(400):
    if os.fork() == 0:
        signal.pause()
        os._exit(0)
set_last_pid(300)
proc = subprocess.Popen([ddprun, "--master-port", "0", "--containment", "proc", "--nproc-per-node", "1",
                         "--no-python", loop, counter, "60"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
buf = b""
deadline = time.monotonic() + 30
while b"ready\n" not in buf:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
        sys.exit(f"no ready line: {buf!r}")
    chunk = os.read(proc.stdout.fileno(), 4096)
    if not chunk:
        sys.exit(f"stdout closed before ready: {buf!r}")
    buf += chunk
helpers = []
for name in os.listdir("/proc"):
    try:
        with open(f"/proc/{name}/stat") as f:
            if int(f.read().rsplit(")", 1)[1].split()[1]) == proc.pid:
                helpers.append(int(name))
    except (OSError, ValueError):
        pass
proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
proc.wait(timeout=30)
deadline = time.monotonic() + 10
while not all(gone(p) for p in helpers):  # orphans are this process's: zombies until reaped
    if time.monotonic() > deadline:
        sys.exit(f"helpers {helpers} did not end")
    time.sleep(0.01)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # an escaped loop's steps are reparented here
before = count()
if before > 19000:  # a pid a step at least: its pids no longer below the older processes'
    sys.exit(f"the loop took {before} steps before ddprun ended: the wrap was not what was tested")
time.sleep(0.5)
print(before, count())
'''

NEST_SH = r'''
# nest.sh OUT MODE HOW FREEZE: a child of this worker moves into a cgroup made inside the job's
# own, which it then freezes with FREEZE=frozen.
out=$1
if [ "$2" = cgroup1 ]; then
    root=$(awk '$3 == "cgroup" && $4 ~ /(^|,)freezer(,|$)/ {print $2; exit}' /proc/mounts)
    cg=$root$(grep ':freezer:' /proc/self/cgroup | cut -d: -f3)
else
    root=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts)
    cg=$root$(grep '^0::' /proc/self/cgroup | cut -d: -f3)
fi
mkdir "$cg/inner" || exit 9
setsid sleep 60 </dev/null >/dev/null 2>&1 &
echo $! > "$cg/inner/cgroup.procs" || exit 8
if [ "$4" = frozen ]; then
    if [ "$2" = cgroup1 ]; then echo FROZEN > "$cg/inner/freezer.state"; else echo 1 > "$cg/inner/cgroup.freeze"; fi || exit 7
fi
echo "$! $cg/inner" > "$out"
echo ready
[ "$3" = sigkill ] && exec sleep 60
exit 0
'''

# Rank 0 fails; ranks 1 and 2 are alive when their stacks are taken (rank 0's exit), ignore the
# teardown's SIGTERM and then fail on their own (exit code 1); rank 3 waits, and its SIGTERM
# handler exits 1 on the teardown's SIGTERM.
ALL_FAIL = r'''
import glob, os, signal, sys, time
marker = os.path.join(sys.argv[1], "rank0-failing")
if os.environ["RANK"] == "0":
    while not all(os.path.exists(os.path.join(sys.argv[1], "ready-%d" % r)) for r in (1, 2, 3)):
        time.sleep(0.01)
    open(marker, "w").close()
    raise RuntimeError("rank 0 fails first")
if os.environ["RANK"] == "3":  # stopped by the teardown through its own handler: not "on its own"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    open(os.path.join(sys.argv[1], "ready-3"), "w").close()
    while True:
        time.sleep(0.05)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(sys.argv[1], "ready-" + os.environ["RANK"]), "w").close()
# Its stacks are taken at rank 0's exit: it fails once its dump is written (faulthandler writes
# the whole dump in its signal handler, before this loop runs again).
stacks = os.path.join(sys.argv[1], "logs", "*", "attempt_0", os.environ["LOCAL_RANK"], "stacks.txt")
while not any(os.path.getsize(f) > 0 for f in glob.glob(stacks)):
    time.sleep(0.01)
raise RuntimeError("rank " + os.environ["RANK"] + " fails too")
'''

DAEMON_SECOND_ATTEMPT = r'''
import os, runpy, sys
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)  # attempt 0 fails and leaves nothing behind
sys.argv = [sys.argv[0], sys.argv[1], "exit"]
runpy.run_path(sys.argv[0].replace("daemon_second.py", "daemon.py"))  # attempt 1 leaves a daemon
'''

STUCK = r'''import datetime, os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=4))
if dist.get_rank() == 1:
    time.sleep(600)
t = torch.ones(4)
dist.all_reduce(t)
'''

HUNG = r'''import threading
print("ready", flush=True)
threading.Event().wait()
'''

OOM = r'''import sys
chunks = []
for _ in range(64):
    chunks.append(bytearray(32 * 1024 * 1024))
print("survived", flush=True)
'''


FIFO_ERROR_FILE = r'''import os, sys, time
if os.environ["LOCAL_RANK"] == "0":
    os.mkfifo(os.environ["TORCHELASTIC_ERROR_FILE"])  # torch's error file, replaced by a FIFO
    sys.exit(3)
time.sleep(600)
'''

# Ranks 1..3 stop themselves (no faulthandler can answer in a stopped process); rank 0 fails once
# all three are stopped.
STOPPED = r'''import os, signal, sys, time
d = sys.argv[1]
if os.environ["LOCAL_RANK"] != "0":
    with open(os.path.join(d, os.environ["LOCAL_RANK"] + ".tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(d, os.environ["LOCAL_RANK"] + ".tmp"), os.path.join(d, os.environ["LOCAL_RANK"]))
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)
def stopped(rank):
    try:
        with open(os.path.join(d, rank)) as f:
            pid = f.read()
        with open("/proc/%s/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False
deadline = time.monotonic() + 60
while not all(stopped(r) for r in ("1", "2", "3")) and time.monotonic() < deadline:
    time.sleep(0.01)  # no event tells another process of a stop
sys.exit(9)
'''


# Rank 0 raises while a non-daemon thread keeps its process alive; rank 1 fails later, on its own.
RAISED_BUT_ALIVE = r'''import os, sys, threading, time
marker = os.path.join(sys.argv[1], "raised")
if os.environ["LOCAL_RANK"] == "0":
    def keeper():
        while threading.main_thread().is_alive():  # the main thread ends by its exception
            time.sleep(0.01)
        open(marker, "w").close()
        time.sleep(600)
    threading.Thread(target=keeper).start()
    raise ValueError("boom in rank 0")
deadline = time.monotonic() + 60
while not os.path.exists(marker) and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3)  # the gap the diagnosis must see: rank 0 raised well before rank 1 ends
sys.exit(5)
'''


# Victims of a failure that raise before the failing rank ends: a gloo peer raises "Connection
# closed by peer" (or times out) while the rank that failed still tears down. Rank 0 is such a
# victim: it raises a collective failure, then (atexit) backdates the hook's record of it by 1 s,
# as if it had raised well before the failing rank ends, tells the failing rank through a FIFO and
# waits for the teardown. "raised": rank 1 then raises its own ValueError (the culprit, exiting
# first). "timeout": rank 1 never enters the collective (the culprit, still running) and rank 2
# fails with a timeout once rank 0 has raised.
FORKED_CHILD_FAILS = """import ctypes
import os
import signal
import sys


def child():
    if sys.argv[1] == "segv":
        ctypes.string_at(0)
    raise ValueError("the forked child's")


pid = os.fork()
if pid == 0:
    child()
os.waitpid(pid, 0)
os.kill(os.getpid(), signal.SIGKILL)
"""

VICTIM_RAISED_FIRST = r"""import atexit, os, sys, time
rank = int(os.environ["RANK"])
fifo, mode = sys.argv[1], sys.argv[2]


def lost_peer():
    if mode == "raised":
        raise RuntimeError("[./gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:4242")
    raise RuntimeError("[./gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 4000ms for recv operation")


def stay():
    record = sys._ddprun_stacks_file.name + ".exception"
    then = time.time() - 1
    os.utime(record, (then, then))
    with open(fifo, "w") as f:
        f.write("x")
    time.sleep(600)


if rank == 0:
    atexit.register(stay)
    lost_peer()
elif rank == 1 and mode == "timeout":
    open(fifo + "-r1", "w").close()  # rank 2 times out only once this rank is at its sleep
    time.sleep(600)
else:
    with open(fifo) as f:
        f.read()
    if mode == "timeout":
        with open(fifo + "-r1") as f:
            f.read()
    if mode == "raised":
        raise ValueError("boom")
    lost_peer()
"""

# Rank 0 fails; rank 1 ignores SIGTERM and SIGINT, so the teardown waits out its grace.
FAIL_THEN_STUBBORN = r'''import os, signal, sys, time
ready = os.path.join(sys.argv[1], "stubborn")
if os.environ["LOCAL_RANK"] == "0":
    deadline = time.monotonic() + 60
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)  # rank 1 must ignore the teardown's signals before rank 0 fails
    raise ValueError("rank 0 broke")
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
open(ready, "w").close()
time.sleep(600)
'''


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie waiting for its parent is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid, timeout):
    """True once `pid` no longer runs (pidfd readable = exited)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        return bool(p.poll(int(timeout * 1000))) or not alive(pid)
    finally:
        os.close(fd)


def read_until(proc, token, timeout):
    """Reads proc.stdout until a line equal to `token` (select-bounded)."""
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no '{token}' line after {timeout}s: {buf!r}")
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            raise AssertionError(f"stdout closed before '{token}': {buf!r}")
        buf += chunk
        if token.encode() in buf.split(b"\n"):
            return


def abandon_gated(proc, gate):
    """Cleanup of a job waiting for `gate` (a test's finally): opens the gate, kills what is left."""
    open(gate, "a").close()
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def read_stderr_until(proc, token, timeout, err=b""):
    """Reads proc.stderr (select-bounded) until `token` (bytes) is in what was read, `err` included;
    returns all of it."""
    deadline = time.monotonic() + timeout
    while token not in err:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {token!r} on stderr after {timeout}s: {err.decode(errors='replace')}")
        if select.select([proc.stderr], [], [], left)[0]:
            chunk = os.read(proc.stderr.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"stderr closed before {token!r}: {err.decode(errors='replace')}")
            err += chunk
    return err


def children(pid):
    """Processes whose parent is `pid`, from every /proc/N/stat (the per-thread `children` files
    can miss a child while a thread of `pid` ends)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(name))
    return out


def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def cgroup_roots():
    """The directories ddprun creates its job cgroups in (this process's cgroup per hierarchy)."""
    roots = []
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.strip().split(":", 2)
            path = "" if path == "/" else path
            if ctrls == "" and os.path.isdir("/sys/fs/cgroup/unified"):
                roots.append("/sys/fs/cgroup/unified" + path)
            elif ctrls in ("freezer", "memory"):
                roots.append(f"/sys/fs/cgroup/{ctrls}{path}")
    return roots


def job_cgroups(root, pid):
    """The job cgroups of the ddprun of `pid` under `root` (ddprun-PID-RANDOM)."""
    return glob.glob(os.path.join(root, "ddprun-%d-*" % pid))


def cgroup2_mount():
    """Where cgroup2 is mounted: /sys/fs/cgroup/unified on a hybrid host, /sys/fs/cgroup on a
    cgroup v2 one; None without cgroup2."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f if " - cgroup2 " in line and line.split()[3] == "/"]
    for usual in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if usual in points:
            return usual
    return points[0] if points else None


def cgroup2_root():
    """This process's cgroup in the cgroup2 hierarchy (where ddprun makes its job cgroup)."""
    mount = cgroup2_mount()
    if mount is None:
        return None
    with open("/proc/self/cgroup") as f:
        path = next((l.strip()[3:] for l in f if l.startswith("0::")), None)
    if path is None:
        return None
    return mount + ("" if path == "/" else path)


ROOT_MEMORY_ENABLED = []  # cgroup2 roots whose memory controller a test switched on


def limited_memory_cgroup(limit, kind):
    """Makes a memory cgroup limited to `limit` bytes without swap, for ddprun to be started in:
    ("v1", dir) below our own v1 memory cgroup, or ("v2", dir) below the cgroup2 root (our own
    cgroup holds processes, so it cannot give a child the memory controller); None when `kind`
    is not available here."""
    name = f"ddprun-oom-test-{os.getpid()}"
    if kind == "v1":
        with open("/proc/self/cgroup") as f:
            own = [l.split(":", 2)[2].strip() for l in f if ":memory:" in l]
        if not own or not os.path.isdir("/sys/fs/cgroup/memory"):
            return None
        cg = "/sys/fs/cgroup/memory" + own[0].rstrip("/") + "/" + name
        files = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
    else:
        root = "/sys/fs/cgroup"
        try:
            with open(root + "/cgroup.controllers") as f:
                if "memory" not in f.read().split():
                    return None
            with open(root + "/cgroup.subtree_control") as f:
                enabled = "memory" in f.read().split()
            if not enabled:
                with open(root + "/cgroup.subtree_control", "w") as f:
                    f.write("+memory")
                ROOT_MEMORY_ENABLED.append(root)  # undone by the test's cleanup
        except OSError:
            return None
        cg = root + "/" + name
        files = ("memory.max", "memory.swap.max")
    os.mkdir(cg)
    for name, value in zip(files, (str(limit), str(limit) if kind == "v1" else "0")):
        if os.path.exists(cg + "/" + name):
            with open(cg + "/" + name, "w") as f:
                f.write(value)
    return kind, cg


def pid_namespace_maker():
    """unshare's path where this process may make a PID namespace (root, and not refused by a
    container), else None."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        return None
    r = subprocess.run([unshare, "-fp", "--mount-proc", "--kill-child", "true"], capture_output=True, timeout=30)
    return unshare if r.returncode == 0 else None


def modes():
    """Containment mechanisms this box offers (auto picks the first)."""
    out = ["proc"]
    if os.path.isdir("/sys/fs/cgroup/freezer"):
        out.append("cgroup1")
    with open("/proc/mounts") as f:
        if any(line.split()[2] == "cgroup2" for line in f):
            out.append("cgroup2")
    return out


def caught(pid, sig):
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return (int(line.split()[1], 16) >> (sig - 1)) & 1 == 1
    return False


class Diagnosis(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="ddprun_diag_")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def script(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def ddprun(self, args, binary=DDPRUN, **kw):
        return subprocess.Popen([binary, "--log-dir", os.path.join(self.dir, "logs"), "--master-port", "0"] + args,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)

    def run_one_rank(self, script, *script_args, **kw):
        """One Python rank running `script`, to its end: (ddprun's exit code, its stderr as text)."""
        proc = self.ddprun(["--nproc-per-node", "1", "--no-python", PYTHON, script] + list(script_args), **kw)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, err.decode(errors="replace")

    def fork_loop(self):
        """FORK_LOOP_C built (skips the test without a C compiler)."""
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            self.skipTest("no C compiler to build the fork loop")
        loop = os.path.join(self.dir, "fork_loop")
        if not os.path.exists(loop):
            src = self.script("fork_loop.c", FORK_LOOP_C)
            subprocess.run([cc, "-O2", "-o", loop, src], check=True, timeout=120)
        return loop

    def lone_ddprun(self):
        """A copy of ddprun without ddprun-watchdog beside it: the agent forks its watchdog."""
        d = os.path.join(self.dir, "lone")
        os.makedirs(d, exist_ok=True)
        shutil.copy2(DDPRUN, d)
        return os.path.join(d, "ddprun")

    # ---- containment ----

    def run_daemon_case(self, mode, how, binary=DDPRUN, restarted=False):
        """A worker leaves a daemon, then ddprun ends `how`. With `restarted`, attempt 0 fails
        leaving nothing and attempt 1 leaves the daemon (its end must still find it)."""
        script = self.script("daemon.py", DAEMON)
        pidfile = os.path.join(self.dir, f"daemon-{mode}-{how}-{restarted}.pid")
        if how.startswith("pkill"):
            if shutil.which("pkill") is None:
                self.skipTest("no pkill (procps) here")
            # Out of this test's directory ("ddprun_diag_..."): `pkill -f ddprun` must match the
            # agent by its own command line, not the job's processes by their paths.
            plain = tempfile.mkdtemp(prefix="containment_")
            self.addCleanup(shutil.rmtree, plain, True)
            script = shutil.copy(script, plain)
            pidfile = os.path.join(plain, os.path.basename(pidfile))
        args = [PYTHON, script, pidfile, "exit" if how == "normal" else "block"]
        if restarted:
            args = ["--max-restarts", "1", PYTHON, self.script("daemon_second.py", DAEMON_SECOND_ATTEMPT), pidfile]
        proc = self.ddprun(["--containment", mode, "--nproc-per-node", "1", "--no-python"] + args, binary=binary,
                           start_new_session=(how == "killpg"))
        try:
            read_until(proc, "ready", 30)
            with open(pidfile) as f:
                daemon = int(f.read())
            self.assertTrue(alive(daemon))
            watchdogs = [c for c in children(proc.pid) if comm(c) == "ddp-watchdog"]
            self.assertEqual(len(watchdogs), 1, "ddprun runs one watchdog")
            # The program beside ddprun (where it was built), else (the lone copy) a fork of the agent.
            program = binary == DDPRUN and os.access(DDPRUN + "-watchdog", os.X_OK)
            expected = os.path.realpath(DDPRUN + "-watchdog" if program else binary)
            self.assertEqual(os.path.realpath(f"/proc/{watchdogs[0]}/exe"), expected)
            # In a session of its own: a signal to ddprun's process group does not reach it.
            self.assertNotEqual(os.getpgid(watchdogs[0]), os.getpgid(proc.pid))
            # Nothing in its name or command line says "ddprun" (`pkill ddprun` must spare it).
            with open(f"/proc/{watchdogs[0]}/cmdline", "rb") as f:
                self.assertNotIn(b"ddprun", f.read())
            if how == "normal":
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
            elif how == "sigterm":
                proc.send_signal(signal.SIGTERM)
            elif how == "sigkill":
                proc.send_signal(signal.SIGKILL)
            elif how == "killpg":  # `kill -9 -PGID`, `timeout -s KILL`: ddprun's whole process group
                os.killpg(proc.pid, signal.SIGKILL)
            elif how in ("pkill", "pkill -f"):  # by name, limited to this test's processes (-P)
                kill = ["pkill", "-9", "-P", f"{os.getpid()},{proc.pid}"] + (["-f"] if how == "pkill -f" else [])
                r = subprocess.run(kill + ["ddprun"], capture_output=True, text=True, timeout=30)
                self.assertEqual(r.returncode, 0, f"pkill matched nothing: {r.stderr}")
            _, err = proc.communicate(timeout=30)
            self.assertTrue(wait_gone(daemon, 10), f"{mode}/{how}: daemon {daemon} outlived ddprun: {err.decode()}")
            if how == "normal":
                self.assertEqual(proc.returncode, 0, err.decode())
            # The watchdog ends once the job is swept, and the job's cgroups are gone with it.
            self.assertTrue(wait_gone(watchdogs[0], 10), "the watchdog did not end")
            for root in cgroup_roots():
                self.assertEqual(job_cgroups(root, proc.pid), [], f"{mode}/{how}: job cgroups left")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    def test_daemon_ends_with_the_job(self):
        for mode in modes():
            for how in ("normal", "sigterm", "sigkill", "killpg", "pkill", "pkill -f"):
                with self.subTest(mode=mode, how=how):
                    self.run_daemon_case(mode, how)

    def test_a_daemon_that_forks_and_exits_without_pause_ends_with_the_job(self):
        # No pid of the loop lives long: a proc scan lists one that is gone by its turn. Every
        # mode, ddprun stopped (its own sweep) and killed (the watchdog's: the program's and the
        # agent's fork where the program is missing).
        loop = self.fork_loop()
        lone = self.lone_ddprun()
        cases = [(m, h, DDPRUN) for m in modes() for h in ("sigterm", "sigkill")]
        cases += [(m, "sigkill", lone) for m in modes()]
        for mode, how, binary in cases:
            with self.subTest(mode=mode, how=how, watchdog="forked" if binary == lone else "program"):
                counter = os.path.join(self.dir, f"count-{mode}-{how}-{binary == lone}")
                errors = open(counter + ".err", "w+b")
                # stderr to a file: an escaped loop holds on to what ddprun's workers inherit
                proc = subprocess.Popen([binary, "--master-port", "0", "--containment", mode, "--nproc-per-node", "1",
                                         "--no-python", loop, counter, "60"],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
                try:
                    read_until(proc, "ready", 30)
                    helpers = children(proc.pid)  # the worker and the watchdog, which sweeps after a SIGKILL
                    proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
                    proc.wait(timeout=30)
                    for pid in helpers:
                        self.assertTrue(wait_gone(pid, 10), f"{comm(pid)} ({pid}) did not end")

                    def count():
                        with open(counter, "rb") as f:
                            return int.from_bytes(f.read(8), "little", signed=True)

                    # Ended means the count stands still; a live loop takes ~2,000 steps in 0.5 s.
                    before = count()
                    time.sleep(0.5)
                    errors.seek(0)
                    self.assertEqual(count(), before, f"the fork loop outlived ddprun: {errors.read().decode()}")
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                    proc.stdout.close()
                    errors.close()
                    # An escaped loop stays in its process group: end all of it at once.
                    group = 0
                    if os.path.exists(counter):
                        with open(counter, "rb") as f:
                            group = int.from_bytes(f.read(16)[8:], "little", signed=True)
                    if group > 1:
                        try:
                            os.killpg(group, signal.SIGKILL)
                        except ProcessLookupError:
                            pass

    def test_a_fork_loop_whose_pids_wrapped_below_older_processes_ends_with_the_job(self):
        # Once the pid counter wraps (at 32768 by default), the loop's newest pid is below older
        # processes'. A proc sweep that read the highest pids first read those first, found the
        # loop's listed pid gone by its turn, scan after scan, and ended with the loop alive. Here
        # in a PID namespace whose last pid the test sets; the agent's sweep and both watchdogs'.
        unshare = pid_namespace_maker()
        if unshare is None or not os.path.exists("/proc/sys/kernel/ns_last_pid"):
            self.skipTest("needs root, unshare and ns_last_pid for a PID namespace whose pids it sets")
        loop = self.fork_loop()
        helper = self.script("wrapped.py", WRAPPED)
        lone = self.lone_ddprun()
        for how, binary in (("sigterm", DDPRUN), ("sigkill", DDPRUN), ("sigkill", lone)):
            with self.subTest(how=how, watchdog="forked" if binary == lone else "program"):
                counter = os.path.join(self.dir, f"wrapped-{how}-{binary == lone}")
                # Everything in the namespace ends with its pid 1, an escaped loop included.
                r = subprocess.run([unshare, "-fp", "--mount-proc", "--kill-child", PYTHON, helper, binary, loop, counter,
                                    how],
                                   capture_output=True, text=True, timeout=120)
                self.assertEqual(r.returncode, 0, r.stderr)
                before, after = map(int, r.stdout.split()[-2:])
                self.assertEqual(after, before, f"the fork loop outlived ddprun: {r.stderr}")

    def test_a_process_in_a_cgroup_made_inside_the_job_ends_with_it(self):
        # A worker's child makes a cgroup of its own inside its rank's (v1) or the job's (v2)
        # cgroup and moves there (nested runtimes, CRIU and Ray do). Before: with cgroup1 it
        # outlived ddprun (a v1 cgroup.procs lists only its own members), with cgroup2 the
        # nested cgroup and the job's were left behind. Frozen by the job itself: a v1 cgroup
        # frozen on its own stayed frozen when the sweep thawed the ranks', and its SIGKILLed
        # process with it, for good.
        script = self.script("nest.sh", NEST_SH)
        lone = self.lone_ddprun()  # its watchdog is the agent's fork, which sweeps with the agent's code
        for mode in [m for m in modes() if m != "proc"]:
            for how, binary, freeze in [(h, b, f) for f in ("", "frozen")
                                        for h, b in (("normal", DDPRUN), ("sigkill", DDPRUN), ("sigkill", lone))]:
                with self.subTest(mode=mode, how=how, watchdog="forked" if binary == lone else "program", freeze=freeze):
                    out = os.path.join(self.dir, f"nested-{mode}-{how}-{binary == lone}-{freeze}")
                    proc = subprocess.Popen([binary, "--master-port", "0", "--containment", mode,
                                             "--nproc-per-node", "1", "--no-python", "/bin/sh", script, out, mode,
                                             how, freeze],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL)
                    pid = 0
                    cgroup = ""
                    try:
                        read_until(proc, "ready", 30)
                        with open(out) as f:
                            pid, cgroup = f.read().split()
                        pid = int(pid)
                        if how == "sigkill":
                            proc.send_signal(signal.SIGKILL)
                        proc.wait(timeout=30)
                        self.assertTrue(wait_gone(pid, 10), f"the process in {cgroup} outlived ddprun ({mode}, {how})")
                        start = cgroup.index("/ddprun-%d-" % proc.pid)
                        end = cgroup.find("/", start + 1)
                        job = cgroup if end < 0 else cgroup[:end]
                        deadline = time.monotonic() + 10  # the watchdog removes them after ddprun's exit
                        while os.path.exists(job) and time.monotonic() < deadline:
                            time.sleep(0.02)
                        self.assertFalse(os.path.exists(job), f"{job} was left ({mode}, {how})")
                    finally:
                        if proc.poll() is None:
                            proc.kill()
                            proc.wait()
                        proc.stdout.close()
                        if cgroup:  # a process left frozen would not take the SIGKILL below
                            try:
                                with open(os.path.join(cgroup, "freezer.state" if mode == "cgroup1"
                                                       else "cgroup.freeze"), "w") as f:
                                    f.write("THAWED" if mode == "cgroup1" else "0")
                            except OSError:
                                pass
                        if pid:
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except ProcessLookupError:
                                pass

    def test_daemon_of_a_restarted_attempt_ends_with_the_job(self):
        # Attempt 0's sweep finds the job cgroup empty; attempt 1's daemon must still be ended.
        for mode in modes():
            with self.subTest(mode=mode):
                self.run_daemon_case(mode, "normal", restarted=True)

    def test_workers_of_the_attempt_after_a_sweep_that_killed_a_daemon_start(self):
        # Attempt 0 leaves a daemon outside its process group (wandb's service, a compile pool)
        # and fails; the sweep between attempts kills it (cgroup.kill on cgroup v2). Before: on
        # kernels where a clone into a cgroup killed that way is SIGKILLed at birth, every
        # worker of attempt 1 died at once (exit 137, "rank 0 failed first (SIGKILL)").
        script = self.script("restarted.sh", """
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
    setsid sleep 60 </dev/null >/dev/null 2>&1 &
    echo "daemon $!"
    exit 3
fi
echo "attempt $TORCHELASTIC_RESTART_COUNT of rank $RANK ran"
""")
        for mode in modes():
            with self.subTest(mode=mode):
                proc = self.ddprun(["--containment", mode, "--nproc-per-node", "2", "--max-restarts", "1",
                                    "--no-python", "/bin/sh", script])
                out, err = proc.communicate(timeout=60)
                out, err = out.decode(), err.decode()
                self.assertEqual(proc.returncode, 0, f"{mode}: {out}{err}")
                for rank in (0, 1):
                    self.assertIn(f"attempt 1 of rank {rank} ran", out, f"{mode}: {err}")
                for daemon in re.findall(r"daemon (\d+)", out):
                    self.assertTrue(wait_gone(int(daemon), 10), f"{mode}: daemon {daemon} outlived its attempt")

    def test_daemon_ends_with_the_job_with_a_forked_watchdog(self):
        lone = self.lone_ddprun()
        for mode in modes():
            for how in ("normal", "sigkill", "pkill", "pkill -f"):
                with self.subTest(mode=mode, how=how):
                    self.run_daemon_case(mode, how, binary=lone)

    def test_a_forked_watchdog_with_a_short_command_line_does_not_say_ddprun(self):
        # The fork copies the agent's command line and overwrites it with its own name, cut to
        # fit: `ddprun x` (9 bytes) is shorter than "ddp-watchdog", and was left as it was.
        lone = self.lone_ddprun()
        bindir = os.path.join(self.dir, "pathbin")
        os.makedirs(bindir)
        with open(os.path.join(bindir, "x"), "w") as f:
            f.write("#!/bin/sh\necho ready\nexec sleep 60\n")
        os.chmod(os.path.join(bindir, "x"), 0o755)
        env = dict(os.environ, PATH=bindir + ":" + os.environ.get("PATH", "/usr/bin:/bin"), PET_MASTER_PORT="0")
        proc = subprocess.Popen(["ddprun", "x"], executable=lone, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            read_until(proc, "ready", 30)
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                self.assertEqual(f.read(), b"ddprun\0x\0")
            watchdogs = [c for c in children(proc.pid) if comm(c) == "ddp-watchdog"]
            self.assertEqual(len(watchdogs), 1, "ddprun runs one watchdog")
            with open(f"/proc/{watchdogs[0]}/cmdline", "rb") as f:
                self.assertNotIn(b"ddprun", f.read())
        finally:
            proc.kill()
            proc.communicate()

    def test_a_watchdog_of_another_build_is_reported_while_the_job_runs(self):
        # A ddprun-watchdog that refuses the protocol (played by a script that exits 2, as one of
        # another build does) is reported while the job runs, and ddprun removes the job's cgroups
        # itself at its end. Before, it said so only at the end, and left the cgroups.
        d = os.path.join(self.dir, "mixed")
        os.makedirs(d)
        shutil.copy2(DDPRUN, d)
        with open(os.path.join(d, "ddprun-watchdog"), "w") as f:
            f.write("#!/bin/sh\nexit 2\n")
        os.chmod(os.path.join(d, "ddprun-watchdog"), 0o755)
        for mode in modes():
            with self.subTest(mode=mode):
                gate = os.path.join(self.dir, f"gate-{mode}")
                proc = subprocess.Popen([os.path.join(d, "ddprun"), "--master-port", "0", "--containment", mode,
                                         "--no-python", "/bin/sh", "-c",
                                         'i=0; while [ ! -e "$1" ] && [ $i -lt 3000 ]; do i=$((i+1)); sleep 0.02; done',
                                         "sh", gate], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE)
                try:
                    err = read_stderr_until(proc, b"refused to start (exit 2)", 30)  # while the job runs
                    self.assertIn(b"install ddprun and ddprun-watchdog from the same build", err)
                    self.open_gate_and_finish(proc, gate, err)
                finally:
                    abandon_gated(proc, gate)

    def test_a_signal_ends_the_wait_for_a_watchdog_that_does_not_start(self):
        # A watchdog that never says it is ready (a script that reports its pid and sleeps) held a
        # Ctrl-C for the agent's whole wait, 10 s, before the workers started and got it.
        d = os.path.join(self.dir, "stalled")
        os.makedirs(d)
        shutil.copy2(DDPRUN, d)
        started = os.path.join(self.dir, "stalled-watchdog")
        os.mkfifo(started)
        with open(os.path.join(d, "ddprun-watchdog"), "w") as f:
            f.write(f'#!/bin/sh\necho $$ > "{started}"\nexec sleep 120\n')
        os.chmod(os.path.join(d, "ddprun-watchdog"), 0o755)
        reader = os.open(started, os.O_RDONLY | os.O_NONBLOCK)
        watchdog = None
        # proc mode: the fake watchdog removes no job cgroup after ddprun is gone.
        proc = subprocess.Popen([os.path.join(d, "ddprun"), "--master-port", "0", "--containment", "proc",
                                 "--no-python", "/bin/sleep", "60"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            self.assertTrue(select.select([reader], [], [], 30)[0], "the watchdog was not started")
            watchdog = int(os.read(reader, 64).split()[0])
            # The agent starts the watchdog first and handles SIGINT a moment later; a SIGINT before
            # that ends it by the default action (-2, no workers started yet; seen once in CI).
            # Its handler is in place when /proc says SIGINT is caught.
            deadline = time.monotonic() + 30
            while not caught(proc.pid, signal.SIGINT):
                self.assertLess(time.monotonic(), deadline, "ddprun never handled SIGINT")
                time.sleep(0.005)
            os.kill(proc.pid, signal.SIGINT)
            err = proc.communicate(timeout=8)[1]  # before the 10 s wait would have ended
            self.assertEqual(proc.returncode, 130, err.decode())
            self.assertNotIn(b"did not start within", err)
        finally:
            os.close(reader)
            if watchdog is not None:
                os.kill(watchdog, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    def open_gate_and_finish(self, proc, gate, err):
        """Lets a job waiting for `gate` end: it must exit 0 and leave no job cgroup behind."""
        open(gate, "w").close()
        err += proc.communicate(timeout=60)[1]
        self.assertEqual(proc.returncode, 0, err.decode())
        for root in cgroup_roots():
            self.assertEqual(job_cgroups(root, proc.pid), [], "job cgroups left")

    def test_as_a_containers_init_it_leaves_no_job_cgroup(self):
        # ddprun as its PID namespace's pid 1 (a container's command): when it exits the kernel
        # ends its watchdog with everything else there, so the agent removes the job's cgroups
        # itself. Before, each run left its job cgroup behind.
        unshare = pid_namespace_maker()
        if unshare is None:
            self.skipTest("needs root and unshare for a PID namespace")
        env = dict(os.environ, PET_MASTER_PORT="0")
        for _ in range(2):
            r = subprocess.run([unshare, "-fp", "--mount-proc", "--kill-child", DDPRUN, "--nproc-per-node", "1", "--no-python",
                                "/bin/cat", "/proc/self/cgroup"], capture_output=True, text=True, timeout=60, env=env)
            self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("/ddprun-1-", r.stdout)  # it ran in a job cgroup of its own
        for root in cgroup_roots():
            self.assertEqual(job_cgroups(root, 1), [], "job cgroups left by pid 1")

    def test_a_watchdog_killed_while_the_job_runs_is_reported_then(self):
        # Its end is an event (a pidfd): reported while the job runs, however late it comes; ddprun
        # then removes the job's cgroups itself.
        gate = os.path.join(self.dir, "gate-killed")
        proc = subprocess.Popen([DDPRUN, "--master-port", "0", "--no-python", "/bin/sh", "-c",
                                 'echo ready; i=0; while [ ! -e "$1" ] && [ $i -lt 3000 ]; do i=$((i+1)); sleep 0.02; done',
                                 "sh", gate], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            read_until(proc, "ready", 30)
            watchdogs = [c for c in children(proc.pid) if comm(c) == "ddp-watchdog"]
            self.assertEqual(len(watchdogs), 1, "ddprun runs one watchdog")
            os.kill(watchdogs[0], signal.SIGKILL)
            err = read_stderr_until(proc, b"ended before the job (killed by SIGKILL)", 30)  # while the job runs
            self.open_gate_and_finish(proc, gate, err)
        finally:
            abandon_gated(proc, gate)

    def test_the_first_worker_finds_the_watchdog_ready(self):
        # No worker runs before the watchdog is ready: named ddp-watchdog (so `pkill ddprun`
        # spares it) and in a session of its own (so `kill -- -PGID` and a Ctrl-C spare it). The
        # program is made slow to start here (a script that sleeps before it execs it); the agent
        # used to go on at the script's exec, and its workers ran beside a watchdog still called
        # ddprun-watchdog; a forked watchdog was in the agent's process group until the scheduler
        # ran it (seen on a loaded machine). Each worker lists ddprun's children: pid, name, session.
        program = DDPRUN + "-watchdog"
        binaries = [("forked", self.lone_ddprun())]
        if os.access(program, os.X_OK):
            slow = os.path.join(self.dir, "slow")
            os.makedirs(slow)
            shutil.copy2(DDPRUN, slow)
            with open(os.path.join(slow, "ddprun-watchdog"), "w") as f:
                f.write(f'#!/bin/sh\n/bin/sleep 1\nexec {shlex.quote(program)} "$@"\n')
            os.chmod(os.path.join(slow, "ddprun-watchdog"), 0o755)
            binaries.append(("program, slow to start", os.path.join(slow, "ddprun")))
        # (From every /proc/N/stat: /proc/PID/task/TID/children needs CONFIG_PROC_CHILDREN. The names
        # involved hold no space, so field 4 is the parent and field 6 the session.)
        script = ('for f in /proc/[0-9]*/stat; do set -f; set -- $(cat "$f" 2>/dev/null); set +f; '
                  '[ "$4" = "$PPID" ] && [ "$1" != "$$" ] && echo "child $1 $(cat /proc/$1/comm) $6"; done; '
                  'echo "agent $(cut -d" " -f6 /proc/$PPID/stat)"')
        for kind, binary in binaries:
            with self.subTest(watchdog=kind):
                proc = self.ddprun(["--nccl-id", "off", "--no-python", "/bin/sh", "-c", script], binary=binary)
                out, err = proc.communicate(timeout=60)
                out, err = out.decode(), err.decode()
                self.assertEqual(proc.returncode, 0, err)
                agent_sid = re.findall(r"^agent (\d+)$", out, re.M)
                seen = re.findall(r"^child (\d+) (\S+) (\d+)$", out, re.M)
                self.assertEqual(len(agent_sid), 1, out)
                self.assertEqual(len(seen), 1, f"the worker saw ddprun's other children as {seen}")
                _, name, sid = seen[0]
                self.assertEqual(name, "ddp-watchdog", f"the worker ran beside {name}")
                self.assertNotEqual(sid, agent_sid[0], "the watchdog was in ddprun's session")

    def test_watchdog_program_refuses_to_run_by_hand(self):
        # Without the agent's socket on fd 3 it does nothing (above all, sweeps nothing).
        program = DDPRUN + "-watchdog"
        if not os.access(program, os.X_OK):
            self.skipTest("no ddprun-watchdog built for this machine: the agent forks its watchdog")
        # A cgroup v2 directory it could sweep and remove, where this box has a writable one.
        cg = next((os.path.join(r, f"ddprun-watchdog-test-{os.getpid()}") for r in cgroup_roots()
                   if r.startswith("/sys/fs/cgroup/unified")), None)
        r = subprocess.run([program], capture_output=True, text=True, timeout=10)
        self.assertEqual(r.returncode, 2)
        self.assertIn("not a command to run by hand", r.stderr)
        # With an fd 3 that is not the agent's socket (a file: it would read EOF at once and then
        # sweep and remove JOB_DIR), it refuses too; the cgroup it names stays.
        if cg:
            os.mkdir(cg)
        try:
            r = subprocess.run(["sh", "-c", 'exec "$@" 3</dev/null', "sh", program, "5"], capture_output=True,
                               text=True, timeout=10, stdin=subprocess.DEVNULL)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("not a command to run by hand", r.stderr)
            # The agent's socket but another version of the protocol (an agent of another build,
            # whose lines it would misread): refused the same way.
            for old in (["3"], ["2", "cgroup2", cg or "/nonexistent", "1", "0", ""], ["1"]):
                ours, theirs = socket.socketpair()
                with ours, theirs:
                    ours.sendall(f"j cgroup2 1 0\nc {cg or '/nonexistent'}\n".encode())
                    ours.shutdown(socket.SHUT_WR)
                    r = subprocess.run(["sh", "-c", f'exec "$@" 3<&{theirs.fileno()}', "sh", program] + old,
                                       pass_fds=(theirs.fileno(),), capture_output=True, text=True, timeout=10,
                                       stdin=subprocess.DEVNULL)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("not a command to run by hand", r.stderr)
            # The agent's socket and this protocol, but no job told ("j"): it touches nothing.
            ours, theirs = socket.socketpair()
            with ours, theirs:
                ours.sendall(f"c {cg or '/nonexistent'}\nr {cg or '/nonexistent'}\n".encode())
                ours.shutdown(socket.SHUT_WR)
                r = subprocess.run(["sh", "-c", f'exec "$@" 3<&{theirs.fileno()}', "sh", program, "5"],
                                   pass_fds=(theirs.fileno(),), capture_output=True, text=True, timeout=10,
                                   stdin=subprocess.DEVNULL)
            self.assertEqual(r.returncode, 0, r.stderr)
            if cg:
                self.assertTrue(os.path.isdir(cg), "the cgroup named by hand was removed")
        finally:
            if cg and os.path.isdir(cg):
                os.rmdir(cg)

    def test_rank_cgroups_left_in_the_job_cgroup_are_removed(self):
        # A job cgroup of the same name left by an earlier agent with this pid (containers reuse
        # pids) may hold rank cgroups the new job never made: the job's rmdir says EBUSY, and only
        # then are they looked for (an absent one costs a lookup in cgroupfs). Played here by a
        # worker that makes one in its job cgroup; with the watchdog program and with the fork.
        root = cgroup2_root()
        if root is None or "cgroup2" not in modes():
            self.skipTest("no writable cgroup v2 hierarchy")
        mount = cgroup2_mount()
        worker = self.script("stale.sh", 'cg=$(sed -n "s/^0:://p" /proc/self/cgroup); mkdir "$1$cg/rank0"\n')
        for binary in (DDPRUN, self.lone_ddprun()):
            with self.subTest(watchdog="program" if binary == DDPRUN else "fork"):

                def start():
                    proc = subprocess.Popen([binary, "--master-port", "0", "--containment", "cgroup2",
                                             "--nproc-per-node", "1", "--no-python", "/bin/sh", worker, mount],
                                            stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                    _, err = proc.communicate(timeout=60)
                    return proc, err

                proc, err = self.adopted_watchdogs_end(start)
                self.assertEqual(proc.returncode, 0, err.decode())
                jobs = job_cgroups(root, proc.pid)
                job = jobs[0] if jobs else f"{root}/ddprun-{proc.pid}-none"
                left = os.listdir(job) if os.path.isdir(job) else None
                if left is not None:
                    for name in left:
                        if os.path.isdir(os.path.join(job, name)):
                            os.rmdir(os.path.join(job, name))
                    os.rmdir(job)
                self.assertIsNone(left, f"{job} left with {left}")

    def test_watchdog_program_removes_rank_cgroups_it_was_not_told_of(self):
        # The same, with the program run as the agent runs it: the job's lines, then EOF without "d".
        program = DDPRUN + "-watchdog"
        if not os.access(program, os.X_OK):
            self.skipTest("no ddprun-watchdog built for this machine: the agent forks its watchdog")
        root = cgroup2_root()
        if root is None:
            self.skipTest("no writable cgroup v2 hierarchy")
        for stale in ((), ("rank0", "rank2")):
            with self.subTest(stale=stale):
                cg = os.path.join(root, f"ddprun-watchdog-test-{os.getpid()}")
                os.mkdir(cg)
                for name in stale:
                    os.mkdir(os.path.join(cg, name))
                ours, theirs = socket.socketpair()
                try:
                    ours.sendall(f"j cgroup2 3 0\nc {cg}\n".encode())
                    wd = subprocess.Popen(["sh", "-c", f'exec "$@" 3<&{theirs.fileno()}', "sh", program, "5"],
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
                    theirs.close()
                    ours.close()
                    _, err = wd.communicate(timeout=30)
                    self.assertEqual(wd.returncode, 0, err.decode())
                    self.assertFalse(os.path.exists(cg), f"{cg} left with {os.listdir(cg) if os.path.isdir(cg) else ''}")
                finally:
                    for name in stale:
                        if os.path.isdir(os.path.join(cg, name)):
                            os.rmdir(os.path.join(cg, name))
                    if os.path.isdir(cg):
                        os.rmdir(cg)

    def test_run_directory_is_removed_after_exit(self):
        # Without --log-dir, a successful run's directory under TMPDIR goes, with whatever a worker
        # left in it; the watchdog removes it (and the job's cgroups) once ddprun has exited.
        # This process adopts the watchdog (a child subreaper) to wait for its end.
        keep = os.path.join(self.dir, "outside")
        os.makedirs(keep, exist_ok=True)
        with open(os.path.join(keep, "precious"), "w") as f:
            f.write("not ddprun's")
        worker = self.script("litter.sh", 'd=$(dirname "$TORCHELASTIC_ERROR_FILE")/r$LOCAL_RANK; '
                                          'mkdir -p "$d/sub/deeper"; echo x > "$d/stray"; echo y > "$d/sub/deeper/file"; '
                                          f'ln -s {keep} "$d/sub/link"\n')
        libc = ctypes.CDLL(None, use_errno=True)
        for binary in (DDPRUN, self.lone_ddprun()):
            with self.subTest(watchdog="program" if binary == DDPRUN else "fork"):
                tmp = tempfile.mkdtemp(dir=self.dir)
                env = dict(os.environ, TMPDIR=tmp)
                self.assertEqual(libc.prctl(36, 1, 0, 0, 0), 0)  # PR_SET_CHILD_SUBREAPER
                try:
                    proc = subprocess.Popen([binary, "--master-port", "0", "--nproc-per-node", "2", "--log-level",
                                             "debug", "--no-python", "/bin/sh", worker], env=env,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    _, err = proc.communicate(timeout=60)
                    adopted = children(os.getpid())
                finally:
                    libc.prctl(36, 0, 0, 0, 0)
                self.assertEqual(proc.returncode, 0, err)
                # The agent handed the removal over rather than doing it itself.
                self.assertIn("left to the watchdog to remove after the agent's exit", err)
                self.assertTrue(adopted, "no watchdog outlived ddprun")
                for pid in adopted:  # the watchdog, re-parented to this process at ddprun's exit
                    self.assertTrue(wait_gone(pid, 10), f"pid {pid} ({comm(pid)}) did not end")
                    os.waitpid(pid, 0)
                self.assertEqual(os.listdir(tmp), [], "the run directory outlived the watchdog")
                self.assertEqual(os.listdir(keep), ["precious"], "the removal followed a symbolic link")
                for root in cgroup_roots():
                    self.assertEqual(job_cgroups(root, proc.pid), [], "job cgroups left")

    def adopted_watchdogs_end(self, start):
        """Runs `start()` (which starts ddprun and waits for its end) as a child subreaper, then
        waits for what ddprun left to finish (its watchdog); returns start()'s result."""
        libc = ctypes.CDLL(None, use_errno=True)
        self.assertEqual(libc.prctl(36, 1, 0, 0, 0), 0)  # PR_SET_CHILD_SUBREAPER
        try:
            result = start()
            adopted = children(os.getpid())
        finally:
            libc.prctl(36, 0, 0, 0, 0)
        for pid in adopted:
            self.assertTrue(wait_gone(pid, 10), f"pid {pid} ({comm(pid)}) did not end")
            os.waitpid(pid, 0)
        return result

    def test_run_directory_after_sigkill_and_errors(self):
        # Without --log-dir: ddprun SIGKILLed leaves its run directory only when it holds a file with
        # data (the watchdog applies the agent's rule); an agent ending on an error removes it too.
        for binary in (DDPRUN, self.lone_ddprun()):
            for data in (False, True):
                with self.subTest(watchdog="program" if binary == DDPRUN else "fork", data=data):
                    tmp = tempfile.mkdtemp(dir=self.dir)
                    worker = self.script("hold.sh", ('echo kept > "$(dirname "$TORCHELASTIC_ERROR_FILE")/note"; '
                                                     if data else "") + 'echo ready; exec sleep 600\n')

                    def start():
                        proc = subprocess.Popen([binary, "--master-port", "0", "--nproc-per-node", "1", "--no-python",
                                                 "/bin/sh", worker], env=dict(os.environ, TMPDIR=tmp),
                                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)
                        read_until(proc, "ready", 30)
                        proc.kill()
                        proc.communicate(timeout=30)

                    self.adopted_watchdogs_end(start)
                    left = os.listdir(tmp)
                    if data:
                        self.assertEqual(len(left), 1, left)
                        self.assertEqual(os.listdir(os.path.join(tmp, left[0])), ["note"])
                    else:
                        self.assertEqual(left, [], "the run directory of a SIGKILLed ddprun was left")
        # An error after the run directory was made (the metrics port is taken): the agent removes it
        # itself (with --containment off there is no watchdog to do it).
        for containment in ("auto", "off"):
            with self.subTest(error="metrics port taken", containment=containment), socket.socket() as taken:
                taken.bind(("127.0.0.1", 0))
                taken.listen()
                tmp = tempfile.mkdtemp(dir=self.dir)
                r = self.adopted_watchdogs_end(lambda: subprocess.run(
                    [DDPRUN, "--master-port", "0", "--nproc-per-node", "1", "--containment", containment,
                     "--metrics-port", str(taken.getsockname()[1]), "--no-python", "/bin/true"],
                    env=dict(os.environ, TMPDIR=tmp), capture_output=True, text=True, timeout=60))
                self.assertNotEqual(r.returncode, 0, r.stderr)
                self.assertIn("metrics", r.stderr)
                self.assertEqual(os.listdir(tmp), [], "an agent ending on an error left its run directory")

    # ---- cause of death ----

    def run_oom(self, kind, cg, wrapper=(), flags=()):
        """Runs the OOM script under ddprun started in cgroup `cg` (256 MiB, no swap); returns stderr."""
        script = self.script("oom.py", OOM)

        def join():
            with open(cg + "/cgroup.procs", "w") as f:
                f.write("0")

        try:
            proc = subprocess.Popen(list(wrapper) + [DDPRUN, "--log-dir", os.path.join(self.dir, "logs"), "--master-port", "0",
                                                     "--nproc-per-node", "1", *flags, "--no-python", PYTHON, script],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    preexec_fn=join)
            out, err = proc.communicate(timeout=120)
            err = err.decode()
            self.assertNotEqual(proc.returncode, 0, err)
            self.assertNotIn("survived", out.decode())
            return err
        finally:
            # What is left in the cgroup is ddprun's watchdog, removing ddprun's cgroups below it.
            with open(cg + "/cgroup.procs") as f:
                for pid in f.read().split():
                    self.assertTrue(wait_gone(int(pid), 10), f"pid {pid} still in {cg}")
            for root, dirs, _ in os.walk(cg, topdown=False):
                for d in dirs:
                    try:
                        os.rmdir(os.path.join(root, d))
                    except FileNotFoundError:
                        pass
            os.rmdir(cg)
            while ROOT_MEMORY_ENABLED:
                try:
                    with open(ROOT_MEMORY_ENABLED.pop() + "/cgroup.subtree_control", "w") as f:
                        f.write("-memory")
                except OSError:
                    pass  # another cgroup uses it by now: leave it on

    def test_out_of_memory_names_the_cause_and_peak(self):
        # --rank-memory on: ranks get memory cgroups of their own with the v1 memory hierarchy (and
        # with cgroup v2 only in the root cgroup, where no limit above the job can be set: not
        # tested).
        made = limited_memory_cgroup(256 << 20, "v1")
        if made is None:
            self.skipTest("no v1 memory hierarchy")
        err = self.run_oom(*made, flags=("--rank-memory", "on"))
        self.assertIn("out of memory: the kernel's OOM killer ended it (memory limit 256.0 MiB)", err)
        self.assertRegex(err, r"peak memory \d+\.\d MiB \(the rank's processes, cgroup\)")

    def test_out_of_memory_without_rank_memory_cgroups(self):
        # The default, and the usual cluster case: cgroup v2 below a cgroup that holds processes (a
        # container, a systemd scope, a batch job), where the job cgroup cannot have the memory
        # controller anyway. The kill is counted in the enclosing memory cgroup.
        for kind in ("v2", "v1"):
            for how in ("default", "rank-memory unavailable", "cgroup namespace"):
                if how == "rank-memory unavailable" and kind != "v1":
                    continue
                with self.subTest(kind=kind, how=how):
                    made = limited_memory_cgroup(256 << 20, kind)
                    if made is None:
                        continue
                    wrapper, flags = (), ()
                    rel = made[1][len("/sys/fs/cgroup/memory" if kind == "v1" else "/sys/fs/cgroup"):]
                    if how == "rank-memory unavailable":
                        # --rank-memory on where the memory hierarchy is read-only (a private
                        # mount namespace): the same fallback.
                        wrapper = ("unshare", "-m", "sh", "-c", 'mount -o remount,bind,ro /sys/fs/cgroup/memory && exec "$@"', "sh")
                        flags = ("--rank-memory", "on")
                    elif how == "cgroup namespace":
                        # A container with its own cgroup namespace: the limited cgroup is the
                        # root of the hierarchy ddprun sees ("cgroup /"), and it counts.
                        # (on a fresh tmpfs: the hierarchy's own mount point refuses a second mount)
                        mount = "mount -t tmpfs none /sys/fs/cgroup && " + (
                            "mkdir /sys/fs/cgroup/memory && mount -t cgroup -o memory memory /sys/fs/cgroup/memory"
                            if kind == "v1" else "mount -t cgroup2 none /sys/fs/cgroup")
                        wrapper = ("unshare", "-C", "-m", "sh", "-c", mount + ' && exec "$@"', "sh")
                        rel = "/"
                    err = self.run_oom(*made, wrapper=wrapper, flags=flags)
                    self.assertIn(f"out of memory (likely): the kernel's OOM killer ended 1 process(es) of cgroup {rel} during "
                                  "this attempt (memory limit 256.0 MiB), and this SIGKILL did not come from ddprun", err)
                    self.assertRegex(err, r"peak RSS \d+\.\d MiB \(the worker process\)")
                    self.ran_oom = True
        if not getattr(self, "ran_oom", False):
            self.skipTest("no memory cgroup can be made here")

    # ---- culprit of a collective timeout ----

    def test_stuck_rank_is_named_with_its_frame(self):
        script = self.script("stuck.py", STUCK)
        proc = self.ddprun(["--nproc-per-node", "2", script], env=dict(os.environ, PATH="/usr/bin:/bin"))
        out, err = proc.communicate(timeout=180)
        err = err.decode()
        self.assertNotEqual(proc.returncode, 0, err)
        self.assertIn("culprit    : rank 1 never entered all_reduce: it was in <module> at stuck.py:6 (`time.sleep(600)`)",
                      err)
        # The culprit comes before the victims' lines in the block.
        self.assertLess(err.index("culprit    : rank 1"), err.index("rank 0 (local 0"))

    def test_an_error_file_replaced_by_a_fifo_is_noted_not_waited_on(self):
        script = self.script("fifo.py", FIFO_ERROR_FILE)
        proc = self.ddprun(["--nproc-per-node", "2", "--stacks", "off", "--no-python", PYTHON, script])
        try:
            out, err = proc.communicate(timeout=60)  # the agent blocked in open(2) forever before
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        err = err.decode()
        self.assertEqual(proc.returncode, 3, err)
        self.assertIn("could not be used: is a FIFO", err)
        self.assertIn("exitcode   : 3", err)

    def test_stacks_of_several_ranks_are_collected_at_once(self):
        script = self.script("stopped.py", STOPPED)
        marks = os.path.join(self.dir, "marks")
        os.mkdir(marks)
        proc = self.ddprun(["--nproc-per-node", "4", "--no-python", PYTHON, script, marks])
        out, err = proc.communicate(timeout=120)
        err = err.decode()
        self.assertEqual(proc.returncode, 9, err)
        # Each stopped rank's faulthandler cannot answer: the reason stays beside eu-stack's result.
        for rank in (1, 2, 3):
            self.assertRegex(err, r"rank %d \(local %d, pid \d+\): .*no faulthandler dump within 2000 ms" % (rank, rank))
        # One bound for all of them (2 s for the dumps, 2 s for eu-stack), not 2 s or more per rank
        # one after the other (6 s and more before).
        took = float(re.search(r"collected the stacks of 3 rank\(s\) in ([0-9.]+) ms", err).group(1))
        self.assertLess(took, 5500, err)

    def test_a_rank_that_raised_first_but_still_runs_is_the_culprit(self):
        script = self.script("raised.py", RAISED_BUT_ALIVE)
        proc = self.ddprun(["--nproc-per-node", "2", "--no-python", PYTHON, script, self.dir])
        out, err = proc.communicate(timeout=120)
        err = err.decode()
        self.assertEqual(proc.returncode, 5, err)  # the first exit is still the root cause, as in torchrun
        self.assertRegex(err, r"culprit    : rank 0 raised ValueError: boom in rank 0 [0-9.]+ s before rank 1 ended, "
                              r"and was still running then")

    def run_victims(self, mode, nproc):
        script = self.script("victims.py", VICTIM_RAISED_FIRST)
        fifo = os.path.join(self.dir, "victim-raised")
        os.mkfifo(fifo)
        os.mkfifo(fifo + "-r1")
        proc = self.ddprun(["--nproc-per-node", str(nproc), "--no-python", PYTHON, script, fifo, mode])
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        err = err.decode()
        self.assertEqual(proc.returncode, 1, err)
        return err[err.index("Diagnosis ("):]

    def test_a_victim_that_raised_a_collective_failure_first_is_not_the_culprit(self):
        # Rank 1 raised its own error and failed first; rank 0 only lost its peer (it used to be
        # named the culprit, as having raised 1 s before rank 1 ended).
        block = self.run_victims("raised", 2)
        self.assertEqual(re.findall(r"culprit    : (.*)", block), [], block)
        self.assertRegex(block, r"rank 1 \(local 1, pid [0-9]+\): exit code 1: .*; raised ValueError: boom\n")
        self.assertRegex(block, r"rank 0 \(local 0, pid [0-9]+\): had failed in a collective too, in stay at victims\.py:18")

    def test_a_victim_that_timed_out_first_is_not_named_beside_the_rank_that_never_entered(self):
        # Rank 2 timed out; rank 0 had timed out too (a victim, on its way out, not in a
        # collective any more); rank 1 never entered it: the one culprit.
        block = self.run_victims("timeout", 3)
        self.assertEqual(re.findall(r"culprit    : rank (\d+)", block), ["1"], block)
        self.assertIn("culprit    : rank 1 never entered a collective: it was in <module> at victims.py:26 "
                      "(`time.sleep(600)`)", block)

    def test_an_exception_that_is_not_utf8_is_recorded_whole(self):
        # The hook's record of a message with an undecodable byte (a surrogate escape) lost its
        # last line, the one the block names: it was written with strict encoding.
        script = self.script("bad_bytes.py", 'raise ValueError("bad " + b"\\xff".decode("utf-8", "surrogateescape"))\n')
        code, err = self.run_one_rank(script)
        self.assertEqual(code, 1, err)
        self.assertRegex(err, r"rank 0 \(local 0, pid [0-9]+\): exit code 1: .*; raised ValueError: bad \\udcff\n")

    def test_a_long_one_line_exception_is_named_from_its_start(self):
        # A message of many KiB on one line: the block read the record's last 4 KiB and showed a
        # piece of its middle, without the exception's type.
        script = self.script("long.py", 'raise ValueError("start " + "x" * 20000 + " end")\n')
        code, err = self.run_one_rank(script)
        block = err[err.index("Diagnosis ("):] if "Diagnosis (" in err else err[-3000:]
        self.assertEqual(code, 1, block)
        self.assertRegex(block, r"rank 0 \(local 0, pid [0-9]+\): exit code 1: .*; raised ValueError: start x{200,}\.\.\.\n")

    def test_a_rank_killed_by_a_fatal_signal_is_named_with_its_frame(self):
        # Before: a rank that segfaulted in a C extension was named only by its signal; the hook
        # now enables faulthandler for fatal signals into its stacks file, and the block names
        # the frame. A user who enabled faulthandler (PYTHONFAULTHANDLER) keeps the dump on stderr.
        script = self.script("segv.py", "import ctypes\n\ndef crash():\n    ctypes.string_at(0)\n\ncrash()\n")
        code, err = self.run_one_rank(script)
        self.assertEqual(code, 128 + signal.SIGSEGV, err)
        self.assertRegex(err, r"rank 0 \(local 0, pid [0-9]+\): SIGSEGV \(signal 11\).*; crashed in string_at at "
                              r"__init__\.py:[0-9]+")
        self.assertRegex(err, r"stacks +: .*/attempt_0/0/stacks\.txt")
        self.assertNotIn("Fatal Python error", err)

        env = dict(os.environ, PYTHONFAULTHANDLER="1")
        code, err = self.run_one_rank(script, env=env)
        self.assertEqual(code, 128 + signal.SIGSEGV, err)
        self.assertIn("Fatal Python error: Segmentation fault", err)
        self.assertIn('segv.py", line 4 in crash', err)
        self.assertNotIn("crashed in", err)

    def test_a_forked_childs_crash_or_exception_is_not_the_ranks(self):
        # A child forked from the rank (a DataLoader worker) inherited the hook: its fatal dump went
        # into the rank's stacks file and its uncaught exception into the rank's record, so a rank
        # the OOM killer then ended (SIGKILL) was said to have crashed in, or raised, the child's.
        script = self.script("forked.py", FORKED_CHILD_FAILS)
        for mode in ("segv", "raise"):
            code, err = self.run_one_rank(script, mode)
            self.assertEqual(code, 128 + signal.SIGKILL, err)
            self.assertRegex(err, r"rank 0 \(local 0, pid [0-9]+\): SIGKILL \(signal 9\)", err)
            self.assertNotIn("crashed in", err)
            self.assertNotIn("raised ValueError", err)
            if mode == "segv":  # the child's own dump, on its stderr (the rank's output)
                self.assertIn("Fatal Python error: Segmentation fault", err)
                self.assertIn('forked.py", line 9 in child', err)
                # and nothing of it in the rank's stacks file (removed at the end when empty)
                log_dir = re.search(r"log directory set to: (\S+)", err).group(1)
                stacks = os.path.join(log_dir, "attempt_0", "0", "stacks.txt")
                if os.path.exists(stacks):
                    with open(stacks) as f:
                        self.assertNotIn("Fatal Python error", f.read())
            else:
                self.assertIn("ValueError: the forked child's", err)

    def test_ranks_that_fail_on_their_own_after_the_first_are_not_shown_as_stuck(self):
        # Their stacks were taken while they were still running; the block says how they ended.
        script = self.script("all_fail.py", ALL_FAIL)
        proc = self.ddprun(["--nproc-per-node", "4", "--no-python", PYTHON, script, self.dir])
        _, err = proc.communicate(timeout=120)
        err = err.decode()
        self.assertEqual(proc.returncode, 1, err)
        block = err[err.index("Diagnosis ("):]
        self.assertIn("rank 0 failed first (exit code 1)", block)
        for rank in (1, 2):
            self.assertRegex(block, r"rank %d \(local %d, pid [0-9]+\): failed on its own after the first failure "
                                    r"\(exit code 1\); its stack a moment before: " % (rank, rank))
        # Failures: ranks 1 and 2, which failed on their own; not rank 3, which ended through its
        # handler of the teardown's SIGTERM (a consequence, as a rank the teardown killed).
        failures = err[err.index("Failures:"):err.index("Root Cause")]
        self.assertEqual(sorted(re.findall(r"rank       : (\d+)", failures)), ["1", "2"], failures)
        self.assertNotIn("which it handles", failures)
        self.assertRegex(block, r"rank 3 \(local 3, pid [0-9]+\): in .*; it then ended with exit code 1 after "
                                r"ddprun's teardown signal, which it handles")

    def test_ctrl_c_twice_after_a_failure_keeps_its_summary(self):
        script = self.script("stubborn.py", FAIL_THEN_STUBBORN)
        proc = self.ddprun(["--nproc-per-node", "2", "--shutdown-timeout", "60", "--no-python", PYTHON, script,
                            self.dir])
        err = b""

        def read_err_until(token, timeout=60):
            nonlocal err
            err = read_stderr_until(proc, token, timeout, err)

        try:
            read_err_until(b"collected the stacks")  # rank 0 failed, the teardown's grace runs
            proc.send_signal(signal.SIGINT)
            read_err_until(b"received SIGINT")
            proc.send_signal(signal.SIGINT)  # the user insists
            rest = proc.communicate(timeout=60)[1]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        text = (err + rest).decode()
        self.assertEqual(proc.returncode, 130, text)
        self.assertIn("still running at a second SIGINT during the stop: sending SIGKILL", text)
        self.assertNotIn("did not stop within", text)  # the grace (60 s) did not run out
        self.assertIn("Root Cause (first observed failure)", text)  # what failed is still reported
        self.assertIn("Diagnosis (", text)

    # ---- hang detection ----

    def test_hang_timeout_ends_a_hung_job(self):
        script = self.script("hung.py", HUNG)
        started = time.monotonic()
        proc = self.ddprun(["--nproc-per-node", "2", "--hang-timeout", "2", "--no-python", PYTHON, script])
        out, err = proc.communicate(timeout=60)
        err = err.decode()
        self.assertEqual(proc.returncode, 137, err)
        self.assertIn("Diagnosis (", err)
        self.assertIn("hung: hang detector (no output and no CPU progress for 2 s)", err)
        self.assertIn("killed by ddprun's hang detector", err)
        self.assertRegex(err, r"rank 1 \(local 1, pid \d+\): in wait at threading.py:\d+")
        self.assertLess(time.monotonic() - started, 40)


if __name__ == "__main__":
    unittest.main()
