"""ddprun-watchdog's "g PID" line: a process the agent gave up on is not touched by the sweep.

When a worker does not end within --kill-timeout of its SIGKILL (stuck in the kernel), the agent
gives up on it and tells its watchdog. After the agent is gone the watchdog's token sweep (proc
mode) must not read that process's /proc/PID/environ again: the read can wait on the very lock
the stuck process holds, and the watchdog would then be stuck with it. Run against the x86-64
build in bin/, in proc mode, with two processes that hold the job token (stand-ins: they are
not stuck, so a read would not block; what is checked is that the given-up one is left alone):

- without "g": the sweep SIGKILLs both;
- with "g PID" for one: that one is left alone (it had its SIGKILL already), the other is
  SIGKILLed, and the watchdog ends.
"""
import os
import secrets
import socket
import subprocess
import sys
import time

BIN = os.environ.get("DDPRUN_BIN_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build", "bin"))
WATCHDOG = os.path.join(BIN, "ddprun-watchdog")


def holders(token, n):
    """n sleeping processes with the job token in their environment, each in a session of its own."""
    env = dict(os.environ, DDPRUN_JOB_TOKEN=token)
    return [subprocess.Popen(["sleep", "60"], env=env, start_new_session=True) for _ in range(n)]


def run_watchdog(token, given_up):
    agent_end, wd_end = socket.socketpair()
    wd = subprocess.Popen(["sh", "-c", f'exec "$@" 3<&{wd_end.fileno()}', "sh", WATCHDOG, "5"],
                          pass_fds=(wd_end.fileno(),), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wd_end.close()
    agent_end.settimeout(30)
    ready = agent_end.recv(1)
    if ready != b"+":
        sys.exit(f"FAIL: the watchdog did not say it was ready: {ready!r}")
    # The agent's session: none of ours (no process group of this test is signalled).
    lines = f"j proc 2 0\nt {os.getsid(0)} DDPRUN_JOB_TOKEN={token}\n"
    lines += "".join(f"g {pid}\n" for pid in given_up)
    agent_end.sendall(lines.encode())
    agent_end.close()  # the agent is gone: the watchdog sweeps
    _, err = wd.communicate(timeout=30)
    if wd.returncode != 0:
        sys.exit(f"FAIL: the watchdog exited {wd.returncode}: {err!r}")


def ended(proc, seconds):
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def main():
    if not os.access(WATCHDOG, os.X_OK):
        sys.exit(f"FAIL: {WATCHDOG} not found: build the ddprun-watchdog target")
    failures = []
    procs = []
    try:
        token = secrets.token_hex(16)
        procs = holders(token, 2)
        run_watchdog(token, [])
        if not all(ended(p, 10) for p in procs):
            failures.append("without a 'g' line the sweep left a holder of the job token alive")
        token = secrets.token_hex(16)
        procs = holders(token, 2)
        start = time.monotonic()
        run_watchdog(token, [procs[0].pid])
        if not ended(procs[1], 10):
            failures.append("the holder not given up on survived the sweep")
        if ended(procs[0], 0.5):
            failures.append(f"the process given up on (pid {procs[0].pid}) was signalled: its environ was read")
        if time.monotonic() - start > 5:
            failures.append("the watchdog waited for the process given up on")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if failures:
        sys.exit("FAIL: " + "; ".join(failures))
    print("PASS: the watchdog leaves a process given up on alone")


if __name__ == "__main__":
    main()
