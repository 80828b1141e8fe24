"""Helpers of the torch 2.x suites on top of tests/interop/_common.py: a torch 2.6 client in a
python3-torch2 child (torch_store_driver.py, the store_client_driver line protocol), torch
2.6's own TCPStore server, and a contract runner for the 2.6 client."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "interop"))

import _common  # noqa: E402
from _common import Driver, DriverError, LineReader, _track  # noqa: E402,F401

TORCH2 = os.environ.get("DDPRUN_TORCH2_PYTHON", "")


class Torch2Driver(Driver):
    """torch 2.6's TCPStore client (is_master=False) in a python3-torch2 child."""

    def __init__(self, port, world_size=None, timeout_ms=10000):
        args = [TORCH2, os.path.join(HERE, "torch_store_driver.py"), "--port", str(port),
                "--timeout-ms", str(timeout_ms)]
        if world_size is not None:
            args += ["--world-size", str(world_size)]
        self.proc = _track(subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            start_new_session=True))
        self.reader = LineReader(self.proc.stdout)
        import json
        first = json.loads(self.reader.readline(120))  # a cold torch import takes seconds
        if not first["ok"]:
            raise DriverError(first["error"], first["message"])


def start_torch2_server():
    """torch 2.6's own TCPStore server (non-libuv: the build has no libuv); (process, port)."""
    p = _track(subprocess.Popen([TORCH2, "-c", _common.TORCH_SERVER_SCRIPT], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, start_new_session=True))
    port = int(LineReader(p.stdout).readline(120))
    return p, port


class Torch2Runner:
    """contract.py's operations through a torch 2.6 client (Torch2Driver)."""

    def __init__(self, port):
        self.driver = Torch2Driver(port)

    def run(self, op, args):
        d = self.driver
        try:
            if op in ("set", "add", "compare_set", "delete_key", "num_keys"):
                return d.call(op, *args)
            if op == "get":
                return d.call("get", args[0])
            if op == "get_timeout":
                return d.call("get", args[0], args[1])
            if op == "wait":
                return d.call("wait", args[1], list(args[0]))
        except DriverError as e:
            if e.kind == "TimeoutError":
                return "timeout"
            return f"error: {e}"
        raise ValueError(op)
