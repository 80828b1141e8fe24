"""ddprun-watchdog for aarch64, built here with clang and run under qemu-user.

agent/watchdog/main.c is written without a C library for x86-64 and aarch64; the suite runs the
x86-64 build through ddprun everywhere (tests/single_node/test_diagnosis.py). This builds the
aarch64 one from the same source (kernel UAPI headers: the generic ones, with arm64's few
differences, as arch/arm64/include/uapi/asm does) and runs it under qemu-aarch64, checking what
depends on the machine: the system call numbers and registers, the start-up code, the statx and
getdents64 layouts.

- run by hand (no fd 3, fd 3 not a socket): the usage line, exit 2, nothing touched;
- the agent's socket, "j" (the job), "t" (the agent's session, job token) and EOF: every process with the token
  in its environment and its process group (outside the agent's session) is
  SIGKILLed, others are not;
- "r DIR": the run directory goes, with a subdirectory, without following a symbolic link;
- "f MAJOR MINOR INODE PATH": the file timer's FIFO goes (statx's inode field).

Exit 77 (skipped) without clang-14, ld.lld-14 or qemu-aarch64 (scripts/setup installs them).
"""
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

SRC = os.environ.get("DDPRUN_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
MAIN_C = os.path.join(SRC, "agent", "watchdog", "main.c")

# arch/arm64/include/uapi/asm: what differs from asm-generic for the headers main.c includes.
ARM64_UNISTD = """#define __ARCH_WANT_RENAMEAT
#define __ARCH_WANT_NEW_STAT
#define __ARCH_WANT_SET_GET_RLIMIT
#define __ARCH_WANT_TIME32_SYSCALLS
#define __ARCH_WANT_SYS_CLONE3
#include <asm-generic/unistd.h>
"""
ARM64_FCNTL = """#define O_DIRECTORY 040000
#define O_NOFOLLOW 0100000
#define O_DIRECT 0200000
#define O_LARGEFILE 0400000
#include <asm-generic/fcntl.h>
"""


def tools():
    clang, lld, qemu = shutil.which("clang-14"), shutil.which("ld.lld-14") or shutil.which("ld.lld"), \
        shutil.which("qemu-aarch64")
    if not (clang and lld and qemu):
        print(f"SKIP: needs clang-14, ld.lld and qemu-aarch64 (found {clang}, {lld}, {qemu}); "
              "scripts/setup installs them")
        sys.exit(77)
    return clang, qemu


def build(clang, work):
    asm = os.path.join(work, "inc", "asm")
    os.makedirs(asm)
    for name in os.listdir("/usr/include/asm-generic"):
        with open(os.path.join(asm, name), "w") as f:
            f.write(f"#include <asm-generic/{name}>\n")
    with open(os.path.join(asm, "unistd.h"), "w") as f:
        f.write(ARM64_UNISTD)
    with open(os.path.join(asm, "fcntl.h"), "w") as f:
        f.write(ARM64_FCNTL)
    resource = subprocess.run([clang, "-print-resource-dir"], capture_output=True, text=True, check=True).stdout.strip()
    obj, exe = os.path.join(work, "main.o"), os.path.join(work, "ddprun-watchdog")
    subprocess.run([clang, "--target=aarch64-linux-gnu", "-O2", "-ffreestanding", "-fno-builtin", "-fno-stack-protector",
                    "-Wall", "-Wextra", "-Werror", "-nostdinc", "-I", os.path.join(work, "inc"), "-I", "/usr/include",
                    "-isystem", os.path.join(resource, "include"), "-c", MAIN_C, "-o", obj], check=True)
    subprocess.run([clang, "--target=aarch64-linux-gnu", "-fuse-ld=lld", "-nostdlib", "-static", "-o", exe, obj],
                   check=True)
    with open(exe, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183, "not an aarch64 ELF"
    return exe


def main():
    clang, qemu = tools()
    failures = []
    with tempfile.TemporaryDirectory(prefix="ddprun-wd-a64-") as work:
        exe = build(clang, work)
        args = ["5"]  # the protocol version (the agent's kWatchdogProtocol)

        # By hand: no fd 3, then fd 3 a file.
        r = subprocess.run([qemu, exe], capture_output=True, text=True, timeout=60)
        if r.returncode != 2 or "not a command to run by hand" not in r.stderr:
            failures.append(f"no arguments: exit {r.returncode}, {r.stderr!r}")
        r = subprocess.run(["sh", "-c", 'exec "$@" 3</dev/null', "sh", qemu, exe, *args], capture_output=True,
                           text=True, timeout=60)
        if r.returncode != 2 or "not a command to run by hand" not in r.stderr:
            failures.append(f"fd 3 a file: exit {r.returncode}, {r.stderr!r}")

        # The agent's socket: a token, a run directory, EOF.
        run_dir = os.path.join(work, "run")
        outside = os.path.join(work, "outside")
        os.makedirs(os.path.join(run_dir, "sub", "deeper"))
        os.makedirs(outside)
        for path in (os.path.join(run_dir, "stray"), os.path.join(run_dir, "sub", "deeper", "file"),
                     os.path.join(outside, "precious")):
            with open(path, "w") as f:
                f.write("x")
        os.symlink(outside, os.path.join(run_dir, "sub", "link"))
        token = f"DDPRUN_JOB_TOKEN=a64-{os.getpid()}"
        token_env = {token.split("=")[0]: token.split("=", 1)[1], "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        # A job process in a session of its own (as a worker is), with a process in its group
        # that dropped the token: the group is swept, so that one ends too.
        member = subprocess.Popen(["sh", "-c", "env -u DDPRUN_JOB_TOKEN sleep 600 & echo $!; exec sleep 600"],
                                  env=token_env, start_new_session=True, stdout=subprocess.PIPE, text=True)
        tokenless = int(member.stdout.readline())
        tokenless_fd = os.pidfd_open(tokenless)
        bystander = subprocess.Popen(["sleep", "600"], env={"DDPRUN_JOB_TOKEN": "another-job"}, start_new_session=True)
        # A holder in the agent's session (a session of its own here, told in the "t" line) with a
        # process without the token in its group: the holder ends, its group is not signalled.
        in_agent_session = subprocess.Popen(
            ["sh", "-c", "env -u DDPRUN_JOB_TOKEN sleep 600 & echo $!; exec sleep 600"], env=token_env,
            start_new_session=True, stdout=subprocess.PIPE, text=True)
        spared = int(in_agent_session.stdout.readline())
        spared_fd = os.pidfd_open(spared)
        try:
            agent_end, wd_end = socket.socketpair()
            wd = subprocess.Popen(["sh", "-c", f'exec "$@" 3<&{wd_end.fileno()}', "sh", qemu, exe, *args],
                                  pass_fds=(wd_end.fileno(),), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            wd_end.close()
            agent_end.settimeout(60)
            ready = agent_end.recv(1)  # what the agent waits for before its first workers
            if ready != b"+":
                failures.append(f"the watchdog did not say it was ready: {ready!r}")
            # The file timer's FIFO ("f"): removed.
            fifo = os.path.join(work, "timer.fifo")
            os.mkfifo(fifo)
            st = os.lstat(fifo)
            lines = (f"j proc 1 0\nt {in_agent_session.pid} {token}\nr {run_dir}\n"
                     f"f {os.major(st.st_dev)} {os.minor(st.st_dev)} {st.st_ino} {fifo}\n")
            agent_end.sendall(lines.encode())
            agent_end.close()  # the agent is gone
            _, err = wd.communicate(timeout=60)
            if wd.returncode != 0:
                failures.append(f"watchdog exit {wd.returncode}: {err!r}")
            try:
                member.wait(timeout=10)
            except subprocess.TimeoutExpired:
                failures.append("the job's process was not killed")
            if member.returncode is not None and member.returncode != -signal.SIGKILL:
                failures.append(f"the job's process ended with {member.returncode}, not SIGKILL")
            if bystander.poll() is not None:
                failures.append("a process of another job was killed")
            try:
                in_agent_session.wait(timeout=10)
            except subprocess.TimeoutExpired:
                failures.append("the job's process in the agent's session was not killed")
            # Exited (pidfd readable): the group's SIGKILL was sent before the watchdog's exit.
            if not select.select([tokenless_fd], [], [], 10)[0]:
                failures.append("the process without the token in a job process's group was not killed")
            # By now a SIGKILL sent to the agent's session's group would have landed too.
            if select.select([spared_fd], [], [], 0.2)[0]:
                failures.append("a process group in the agent's session was signalled")
            if os.path.exists(run_dir):
                failures.append(f"the run directory is still there: {os.listdir(run_dir)}")
            if os.listdir(outside) != ["precious"]:
                failures.append("the removal followed a symbolic link")
            if os.path.exists(fifo):
                failures.append("the file timer's FIFO is still there")
        finally:
            for p in (member, bystander, in_agent_session):
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for fd in (tokenless_fd, spared_fd):
                if not select.select([fd], [], [], 0)[0]:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                os.close(fd)
            member.stdout.close()
            in_agent_session.stdout.close()
    if failures:
        sys.exit("FAIL: " + "; ".join(failures))
    print("PASS: ddprun-watchdog for aarch64 (qemu-user): refusals, token sweep, run directory removal")


if __name__ == "__main__":
    main()
