"""Attack-suite harness: start ddprun-rdzvd (or any server) under a memory cap, talk raw bytes.

Reusable by every attack test in tests/security/:

  with Daemon(["--max-connections-per-peer", "64"], mem_cap=1 << 30) as d:
      c = d.connect()            # raw socket, modern handshake optional (handshake(c))
      d.alive(); d.rss(); d.peak_rss(); d.log()

Rules it enforces: loopback only; every wait bounded by a deadline and driven by a readiness
signal (the daemon's "listening on" line, a reply, an EOF), never by a sleep; every process it
starts is stopped (SIGTERM, then SIGKILL) on exit. The memory cap is RLIMIT_AS applied in the
child before exec, so a regression that allocates without bound fails with bad_alloc (the test
sees the daemon die) instead of waking the OOM killer. Sanitizer builds reserve terabytes of
address space, so the cap is skipped for binaries built with ASan (RSS assertions still hold).
"""
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import tempfile
import time

BIN = os.environ.get("DDPRUN_BIN_DIR", "")
RDZVD = os.path.join(BIN, "ddprun-rdzvd")
DDPRUN = os.path.join(BIN, "ddprun")
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
HOST = "127.0.0.1"
MiB = 1 << 20
GiB = 1 << 30
VALIDATE = bytes.fromhex("00cef7853c")

# Modern (2.x) opcodes and legacy (1.13) ones used by the attacks.
SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE, APPEND, MULTI_GET, MULTI_SET, CANCEL_WAIT, PING = (
    1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)
LEGACY_SET, LEGACY_GET, LEGACY_WATCH_KEY = 0, 2, 7


def u64(v):
    return struct.pack("<Q", v)


def i64(v):
    return struct.pack("<q", v)


def u32(v):
    return struct.pack("<I", v)


def s(data):
    if isinstance(data, str):
        data = data.encode()
    return u64(len(data)) + data


def sanitized(binary):
    """True when `binary` is instrumented with ASan (it reserves huge virtual memory)."""
    try:
        with open(binary, "rb") as f:
            return b"__asan_init" in f.read()
    except OSError:
        return False


def limits_preexec(mem_cap=None, nofile=None):
    def apply():
        if mem_cap:
            resource.setrlimit(resource.RLIMIT_AS, (mem_cap, mem_cap))
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        os.setsid()
    return apply


def raise_own_fd_limit(at_least):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < at_least:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(at_least, soft)), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def proc_status(pid, field):
    """A /proc/PID/status field in bytes (VmRSS, VmHWM ...), or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def wait_io(fileobj, deadline_or_timeout, write=False, absolute=True):
    """poll() (select() cannot take descriptors >= 1024) until readable/writable or the deadline."""
    left = deadline_or_timeout - time.monotonic() if absolute else deadline_or_timeout
    if left <= 0:
        return False
    p = select.poll()
    p.register(fileobj, select.POLLOUT if write else select.POLLIN)
    return bool(p.poll(int(left * 1000) + 1))


def stop(proc):
    """SIGTERM, then SIGKILL if it is still there after 15 s; reaped either way."""
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(15)


def read_line(fd, deadline):
    """One line from a pipe fd, bounded by `deadline` (monotonic)."""
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no complete line before the deadline (got {buf!r})")
        if not wait_io(fd, deadline):
            continue
        ch = os.read(fd, 1)
        if not ch:
            raise AssertionError(f"stream closed before a complete line (got {buf!r})")
        buf += ch
    return buf.decode()


class Daemon:
    """ddprun-rdzvd on 127.0.0.1, port 0, under RLIMIT_AS `mem_cap` (and RLIMIT_NOFILE `nofile`)."""

    def __init__(self, flags=(), mem_cap=2 * GiB, nofile=None, binary=RDZVD, start_timeout=30):
        self.tmp = tempfile.TemporaryDirectory(prefix="ddprun_security_")
        self.log_path = os.path.join(self.tmp.name, "daemon.log")
        port_file = os.path.join(self.tmp.name, "port")
        self.sanitized = sanitized(binary)
        cap = None if self.sanitized else mem_cap
        self.log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "--host", HOST, "--port", "0", "--port-file", port_file, *flags],
            stdout=subprocess.PIPE, stderr=self.log_file, preexec_fn=limits_preexec(cap, nofile))
        try:
            line = read_line(self.proc.stdout.fileno(), time.monotonic() + start_timeout)
            if not line.startswith("listening on "):
                raise AssertionError(f"unexpected first line from the daemon: {line!r}")
            with open(port_file) as f:
                self.port = int(f.read().strip())
        except BaseException:
            self.stop()
            raise
        self.baseline_rss = self.rss()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    @property
    def pid(self):
        return self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def rss(self):
        return proc_status(self.pid, "VmRSS")

    def peak_rss(self):
        return proc_status(self.pid, "VmHWM")

    def log(self):
        self.log_file.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_log(self, accept, what, timeout=20):
        """The log once accept(log) is true, polled (the daemon writes it; no other signal), or an
        AssertionError naming `what` with the log's end after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log()
            if accept(text):
                return text
            if time.monotonic() >= deadline:
                raise AssertionError(f"{what}: not in the daemon's log within {timeout} s:\n{text[-3000:]}")
            time.sleep(0.02)

    def connect(self, source=None, timeout=10, rcvbuf=None):
        return connect(self.port, source=source, timeout=timeout, rcvbuf=rcvbuf)

    def stop(self, timeout=15):
        """SIGTERM, bounded wait, SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log_file.close()
        code = self.proc.returncode
        self.tmp.cleanup()
        return code


def connect(port, source=None, timeout=10, host=HOST, rcvbuf=None):
    """`rcvbuf`: SO_RCVBUF set before the connect, so the window is small from the first segment
    and the kernel cannot take much of a reply the client does not read."""
    if rcvbuf is None:
        sock = socket.create_connection((host, port), timeout=timeout,
                                        source_address=(source, 0) if source else None)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(timeout)
        if source:
            sock.bind((source, 0))
        sock.connect((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exact(sock, n, timeout=10):
    sock.settimeout(timeout)
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise ConnectionError(f"closed by the server after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def closed_by_peer(sock, timeout=10):
    """True when the server closes `sock` (EOF or reset) within `timeout`, draining any data
    it still had queued (replies the attacker never read)."""
    deadline = time.monotonic() + timeout
    sock.setblocking(False)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not wait_io(sock, deadline):
                continue
            try:
                chunk = sock.recv(1 << 20)
            except (ConnectionResetError, BrokenPipeError):
                return True
            except BlockingIOError:
                continue
            if not chunk:
                return True
    finally:
        sock.setblocking(True)


def send_until_blocked(sock, data, max_bytes):
    """Sends copies of `data` without reading until the kernel refuses more or `max_bytes` went
    out; returns the bytes sent. Never blocks."""
    sock.setblocking(False)
    sent = 0
    view = memoryview(data)
    pos = 0
    try:
        while sent < max_bytes:
            try:
                n = sock.send(view[pos:])
            except BlockingIOError:
                if not wait_io(sock, 0.5, write=True, absolute=False):
                    break
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += n
            pos = (pos + n) % len(data)
    finally:
        sock.setblocking(True)
    return sent


class Client:
    """A modern TCPStore client over one raw socket (what a legitimate torch 2.x client sends)."""

    def __init__(self, port, source=None, timeout=10):
        self.sock = connect(port, source=source, timeout=timeout)
        self.sock.sendall(VALIDATE + bytes([PING]) + u32(0x5151))
        assert recv_exact(self.sock, 4, timeout) == u32(0x5151)

    def close(self):
        self.sock.close()

    def set(self, key, value):
        self.sock.sendall(bytes([SET]) + s(key) + s(value))

    def get(self, key, timeout=10):
        self.sock.sendall(bytes([GET]) + s(key))
        n = struct.unpack("<Q", recv_exact(self.sock, 8, timeout))[0]
        return recv_exact(self.sock, n, timeout)

    def add(self, key, delta, timeout=10):
        self.sock.sendall(bytes([ADD]) + s(key) + i64(delta))
        return struct.unpack("<q", recv_exact(self.sock, 8, timeout))[0]

    def ping(self, nonce=7, timeout=10):
        self.sock.sendall(bytes([PING]) + u32(nonce))
        return recv_exact(self.sock, 4, timeout) == u32(nonce)

    def wait_send(self, keys):
        self.sock.sendall(bytes([WAIT]) + u64(len(keys)) + b"".join(s(k) for k in keys))

    def wait_reply(self, timeout=10):
        return recv_exact(self.sock, 1, timeout) == b"\x00"

    def works(self, tag="probe"):
        """One round trip proving the server still serves this connection."""
        return self.add("__security_probe_" + tag, 1) >= 1 and self.ping()
