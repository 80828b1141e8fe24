"""CPU time of everything a launcher started, including what outlives it.

wait4 on the launcher reports the CPU time of the launcher and of the children it reaped itself.
A process the launcher leaves behind to finish on its own (ddprun's containment watchdog, which
removes the job's cgroups after the agent has exited; an MPI daemon; a leaked worker) is
reparented to init and its CPU time is lost to the measurement. Inside `adopting()` this harness
is a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so such processes become its children;
`reap()` waits for them and adds their CPU time. One that does not end within the bound is a
launcher that left something running: reap() kills it and says so.
"""
import ctypes
import os
import select
import time
from contextlib import contextmanager

PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def _subreaper(on):
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@contextmanager
def adopting():
    """While inside, orphans of the processes started here are reparented to this process."""
    _subreaper(True)
    try:
        yield
    finally:
        _subreaper(False)


def reap(bound_s=10.0):
    """Waits for every remaining child (the orphans adopted inside `adopting()`), for at most
    bound_s seconds. Returns (CPU ms, how many). Raises RuntimeError naming the processes that
    were still running at the bound (they are killed first)."""
    cpu_ms = 0.0
    count = 0
    deadline = time.monotonic() + bound_s
    while True:
        try:
            pid, _, ru = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return cpu_ms, count
        if pid != 0:
            cpu_ms += (ru.ru_utime + ru.ru_stime) * 1e3
            count += 1
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            running = _children()
            for p in running:
                try:
                    os.kill(p, 9)
                except ProcessLookupError:
                    pass
            raise RuntimeError(f"processes left running {bound_s:g} s after the launcher exited: "
                               + ", ".join(f"{p} ({_comm(p)})" for p in running))
        # Sleep until one of them exits (its pidfd becomes readable) or the bound.
        fds = []
        for p in _children():
            try:
                fds.append(os.pidfd_open(p))
            except ProcessLookupError:
                pass
        try:
            select.select(fds, [], [], left if fds else min(left, 0.001))
        finally:
            for fd in fds:
                os.close(fd)


def _children():
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"
