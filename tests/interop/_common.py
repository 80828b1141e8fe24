"""Shared helpers of the interop tests: start ddprun-rdzvd / torch's TCPStore server, drive
ddprun's client through store_client_driver, and always kill what was started.

Readiness is read from the processes themselves (the daemon's `listening on HOST:PORT` line,
the port printed by the torch server script, the driver's `connected` line); nothing sleeps.
"""
import atexit
import datetime
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

BIN_DIR = os.environ.get("DDPRUN_BIN_DIR", "")
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
HOST = "127.0.0.1"

_children = []


def _track(proc):
    _children.append(proc)
    return proc


def kill_all():
    for p in _children:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
    for p in _children:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    _children.clear()


atexit.register(kill_all)


def binary(name):
    path = os.path.join(BIN_DIR, name)
    if not os.access(path, os.X_OK):
        raise SystemExit(f"{path} is missing: build it first (DDPRUN_BIN_DIR={BIN_DIR!r})")
    return path


class LineReader:
    """Line reader over a pipe with a deadline per line (no blocking forever)."""

    def __init__(self, stream):
        self.fd = stream.fileno()
        self.buf = b""

    def readline(self, timeout):
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line within {timeout} s (have {self.buf!r})")
            r, _, _ = select.select([self.fd], [], [], left)
            if r:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    raise EOFError(f"stream closed (have {self.buf!r})")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


def _drain(stream):
    def run():
        try:
            while stream.read(65536):
                pass
        except (OSError, ValueError):
            pass
    threading.Thread(target=run, daemon=True).start()


def start_rdzvd(extra=()):
    """Starts ddprun-rdzvd on 127.0.0.1, port 0; returns (process, port)."""
    p = _track(subprocess.Popen([binary("ddprun-rdzvd"), "--host", HOST, "--port", "0", *extra],
                                stdout=subprocess.PIPE, start_new_session=True))
    line = LineReader(p.stdout).readline(20)
    prefix = "listening on "
    assert line.startswith(prefix), f"unexpected first line from ddprun-rdzvd: {line!r}"
    port = int(line.rsplit(":", 1)[1])
    _drain(p.stdout)
    return p, port


# DDPRUN_TEST_TORCH_USE_LIBUV=0|1 passes use_libuv to torch's TCPStore (servers and clients;
# torch >= 2.3 only); unset keeps torch's default (libuv from 2.4 on where the build has it).
TORCH_SERVER_SCRIPT = r"""
import os, sys, datetime
import torch.distributed as dist
uv = os.environ.get("DDPRUN_TEST_TORCH_USE_LIBUV")
kw = {} if uv is None else {"use_libuv": uv == "1"}
s = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
                  wait_for_workers=False, **kw)
if uv is not None and hasattr(s, "libuvBackend") and s.libuvBackend != (uv == "1"):
    sys.exit(f"TCPStore ignored use_libuv={uv}")
print(s.port, flush=True)
sys.stdin.read()   # lives until the test closes our stdin (or dies)
"""


def start_torch_server():
    """Starts torch 1.13's own TCPStore server in a child process; returns (process, port)."""
    p = _track(subprocess.Popen([PYTHON, "-c", TORCH_SERVER_SCRIPT], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, start_new_session=True))
    port = int(LineReader(p.stdout).readline(60))
    return p, port


def torch_client(port, world_size=None, timeout_s=10):
    import torch.distributed as dist
    uv = os.environ.get("DDPRUN_TEST_TORCH_USE_LIBUV")
    kw = {} if uv is None else {"use_libuv": uv == "1"}
    return dist.TCPStore(HOST, port, world_size, False,
                         timeout=datetime.timedelta(seconds=timeout_s), **kw)


def _enc(a):
    if isinstance(a, str):
        a = a.encode()
    if isinstance(a, (bytes, bytearray)):
        return "h" + bytes(a).hex()
    if isinstance(a, bool):
        raise TypeError("bool argument")
    if isinstance(a, int):
        return str(a)
    raise TypeError(f"cannot encode {a!r}")


def _dec(v):
    if isinstance(v, str) and v.startswith("h"):
        return bytes.fromhex(v[1:])
    if isinstance(v, list):
        return [_dec(x) for x in v]
    return v


class DriverError(Exception):
    def __init__(self, kind, message):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class Driver:
    """ddprun's StoreClient in a store_client_driver child process."""

    def __init__(self, port, generation, timeout_ms=10000, connect_timeout_ms=10000,
                 prefix=None):
        args = [binary("store_client_driver"), "--host", HOST, "--port", str(port),
                "--generation", generation, "--timeout-ms", str(timeout_ms),
                "--connect-timeout-ms", str(connect_timeout_ms)]
        if prefix is not None:
            args += ["--prefix", prefix]
        self.proc = _track(subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            start_new_session=True))
        self.reader = LineReader(self.proc.stdout)
        first = json.loads(self.reader.readline(30))
        if not first["ok"]:
            raise DriverError(first["error"], first["message"])

    def send(self, op, *args):
        tokens = [op]
        for a in args:
            if isinstance(a, (list, tuple)):
                tokens += [_enc(x) for x in a]
            else:
                tokens.append(_enc(a))
        self.proc.stdin.write((" ".join(tokens) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout=30):
        reply = json.loads(self.reader.readline(timeout))
        if not reply["ok"]:
            raise DriverError(reply["error"], reply["message"])
        return _dec(reply["result"])

    def call(self, op, *args, timeout=30):
        self.send(op, *args)
        return self.receive(timeout)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            self.proc.wait(timeout=10)


class Checker:
    """Counts failed expectations instead of stopping at the first one."""

    def __init__(self):
        self.failures = []
        self.passed = 0

    def eq(self, what, got, want):
        if got == want:
            self.passed += 1
        else:
            self.failures.append(f"{what}: got {got!r}, want {want!r}")
            print(f"FAIL {what}: got {got!r}, want {want!r}", flush=True)

    def true(self, what, cond):
        self.eq(what, bool(cond), True)

    def finish(self, name):
        print(f"{name}: {self.passed} checks passed, {len(self.failures)} failed", flush=True)
        if self.failures:
            for f in self.failures:
                print("  -", f)
            sys.exit(1)


def main(fn):
    try:
        fn()
    finally:
        kill_all()


def detect(port, timeout_ms=2000):
    """detect_generation() through the driver; returns "legacy" / "modern_no_ping" / "modern"."""
    r = subprocess.run([binary("store_client_driver"), "--host", HOST, "--port", str(port),
                        "--detect-ms", str(timeout_ms)], capture_output=True, timeout=60)
    reply = json.loads(r.stdout.decode().strip().splitlines()[-1])
    if not reply["ok"]:
        raise DriverError(reply["error"], reply["message"])
    return reply["result"]
