"""The store contract: ONE list of operations with the results every client/server pair must
produce. Run by test_store_contract.py through torch's client and ddprun's client, against
ddprun-rdzvd and against torch 1.13's own server (which also validates the expectations
themselves against the reference implementation).

Only operations that exist in torch 1.13's Python TCPStore are listed (it has no check(),
append or multi_*); those are covered by the C++ client tests against our server.
Results: None (no reply value), int, bool, bytes, or "timeout".
"""
import datetime

BIG = bytes(range(256)) * 400  # 100 KiB, every byte value

CONTRACT = [
    ("set", ("k1", b"v1"), None),
    ("get", ("k1",), b"v1"),
    ("set", ("k1", b"v2"), None),  # overwrite
    ("get", ("k1",), b"v2"),
    ("set", ("bin", b"\x00\xff\x01\n "), None),
    ("get", ("bin",), b"\x00\xff\x01\n "),
    ("set", ("empty", b""), None),
    ("get", ("empty",), b""),
    ("set", ("big", BIG), None),
    ("get", ("big",), BIG),
    ("set", ("a//b/ключ", b"slashes and utf-8 kept as bytes"), None),
    ("get", ("a//b/ключ",), b"slashes and utf-8 kept as bytes"),
    ("add", ("cnt", 5), 5),
    ("add", ("cnt", -2), 3),
    ("add", ("cnt", 0), 3),
    ("get", ("cnt",), b"3"),
    ("add", ("huge", 2**62), 2**62),
    ("add", ("neg", -7), -7),
    ("get", ("neg",), b"-7"),
    ("set", ("lenient", b" 7abc"), None),  # std::stoll: leading space, trailing garbage
    ("add", ("lenient", 1), 8),
    ("get", ("lenient",), b"8"),
    # compare_set, all four branches of protocol §4.4
    ("compare_set", ("cas", b"", b"first"), b"first"),      # missing + expected empty: create
    ("compare_set", ("nocas", b"x", b"y"), b"x"),           # missing + expected set: echo expected
    ("compare_set", ("cas", b"first", b"second"), b"second"),  # present, equal: swap
    ("compare_set", ("cas", b"zzz", b"third"), b"second"),  # present, different: current
    ("get", ("cas",), b"second"),
    ("wait", (["k1", "cnt"], 2000), None),
    ("wait", ([], 2000), None),
    ("wait", (["missing"], 200), "timeout"),
    ("get_timeout", ("missing", 200), "timeout"),
    ("num_keys", (), 10),  # k1 bin empty big a//b cnt huge neg lenient cas (nocas not created)
    ("delete_key", ("k1",), True),
    ("delete_key", ("k1",), False),
    ("delete_key", ("never-set",), False),
    ("num_keys", (), 9),
    ("get_timeout", ("k1", 200), "timeout"),  # deleted keys are gone for WAIT too
    ("set", ("k1", b"back"), None),
    ("get", ("k1",), b"back"),
    ("num_keys", (), 10),
]


class TorchRunner:
    """torch 1.13's Python TCPStore client. After a timeout the 1.13 client is unusable
    (a late STOP_WAITING would desynchronise it, protocol §5.1), so it is replaced."""

    def __init__(self, port):
        import torch.distributed as dist
        self.dist = dist
        self.port = port
        self.client = self._new()

    def _new(self):
        return self.dist.TCPStore("127.0.0.1", self.port, None, False,
                                  timeout=datetime.timedelta(seconds=10))

    def run(self, op, args):
        c = self.client
        try:
            if op == "set":
                return c.set(args[0], args[1])
            if op == "get":
                return c.get(args[0])
            if op == "add":
                return c.add(args[0], args[1])
            if op == "compare_set":
                return c.compare_set(args[0], args[1], args[2])
            if op == "wait":
                return c.wait(args[0], datetime.timedelta(milliseconds=args[1]))
            if op == "get_timeout":
                c.set_timeout(datetime.timedelta(milliseconds=args[1]))
                try:
                    return c.get(args[0])
                finally:
                    c.set_timeout(datetime.timedelta(seconds=10))
            if op == "num_keys":
                return c.num_keys()
            if op == "delete_key":
                return c.delete_key(args[0])
        except RuntimeError as e:
            if "imeout" in str(e) or "timed out" in str(e):
                self.client = self._new()
                return "timeout"
            return f"error: {e}"
        raise ValueError(op)


class DriverRunner:
    """ddprun's StoreClient through store_client_driver."""

    def __init__(self, port, generation):
        from _common import Driver
        self.driver = Driver(port, generation)

    def run(self, op, args):
        from _common import DriverError
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


def run_contract(runner, name, checker):
    for i, (op, args, want) in enumerate(CONTRACT):
        got = runner.run(op, args)
        shown = [a if not isinstance(a, bytes) or len(a) < 40 else f"<{len(a)} bytes>" for a in args]
        checker.eq(f"{name} #{i} {op}{tuple(shown)}", got, want)
