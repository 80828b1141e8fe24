"""ddprun-watchdog's "f MAJOR MINOR INODE PATH" line: the inode is read as a 64-bit number.

The agent tells its watchdog which FIFO the file timer made (device and inode), and the
watchdog removes it after the agent is gone only if PATH still names that very file. Inodes use
all 64 bits on XFS, overlayfs and large ext4 file systems; a parse that kept 32 of them would take
a FIFO whose inode differs by 2**32 for the agent's. Run against the x86-64 build in bin/ (the
aarch64 build is checked under qemu by watchdog_aarch64_test.py):

- the FIFO's inode + 2**32: the FIFO stays;
- an inode past 2**64 - 1 (the line is refused): the FIFO stays;
- the FIFO's own device and inode: the FIFO goes.
"""
import os
import socket
import subprocess
import sys
import tempfile

BIN = os.environ.get("DDPRUN_BIN_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build", "bin"))
WATCHDOG = os.path.join(BIN, "ddprun-watchdog")


def run_watchdog(work, fifo, ino_text):
    """Starts the watchdog with its socket on fd 3, tells it the job and the FIFO, then ends the
    conversation as a dying agent would (EOF). Returns whether the FIFO is still there."""
    fake_cgroup = os.path.join(work, "cg")  # a plain directory: nothing to sweep in it
    os.makedirs(fake_cgroup, exist_ok=True)
    st = os.lstat(fifo)
    agent_end, wd_end = socket.socketpair()
    # The watchdog waits up to 1 s for its parent (the agent) to go before it touches the FIFO.
    wd = subprocess.Popen(["sh", "-c", f'exec "$@" 3<&{wd_end.fileno()}', "sh", WATCHDOG, "5"],
                          pass_fds=(wd_end.fileno(),), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wd_end.close()
    agent_end.settimeout(30)
    ready = agent_end.recv(1)  # what the agent waits for before its first workers
    if ready != b"+":
        sys.exit(f"FAIL: the watchdog did not say it was ready: {ready!r}")
    lines = (f"j cgroup2 1 0\nc {fake_cgroup}\n"
             f"f {os.major(st.st_dev)} {os.minor(st.st_dev)} {ino_text} {fifo}\n")
    agent_end.sendall(lines.encode())
    agent_end.close()
    _, err = wd.communicate(timeout=30)
    if wd.returncode != 0:
        sys.exit(f"FAIL: the watchdog exited {wd.returncode}: {err!r}")
    return os.path.exists(fifo)


def main():
    if not os.access(WATCHDOG, os.X_OK):
        sys.exit(f"FAIL: {WATCHDOG} not found: build the ddprun-watchdog target")
    failures = []
    with tempfile.TemporaryDirectory(prefix="ddprun-wd-fifo-") as work:
        fifo = os.path.join(work, "timer.fifo")

        def fresh_fifo():
            if not os.path.exists(fifo):
                os.mkfifo(fifo)
            return os.lstat(fifo).st_ino

        ino = fresh_fifo()
        if not run_watchdog(work, fifo, str(ino + 2**32)):
            failures.append(f"inode {ino} + 2**32 was taken for the FIFO's ({ino}): the parse kept 32 bits")
        ino = fresh_fifo()
        if not run_watchdog(work, fifo, str(2**64 + ino)):
            failures.append(f"inode 2**64 + {ino} (past 64 bits) was taken for the FIFO's")
        ino = fresh_fifo()
        if run_watchdog(work, fifo, str(ino)):
            failures.append(f"the FIFO with the inode the line named ({ino}) is still there")
    if failures:
        sys.exit("FAIL: " + "; ".join(failures))
    print("PASS: the watchdog reads the FIFO's inode as 64 bits")


if __name__ == "__main__":
    main()
