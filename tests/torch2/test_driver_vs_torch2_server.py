"""ddprun's client (store_client_driver, modern generation) against torch 2.6's own TCPStore
server (the non-libuv backend, the one Debian's build has), mixed with torch 2.6 clients on the
same server: every operation both sides have, waits and timeouts, the generation probe."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _torch2 import Torch2Driver, start_torch2_server  # noqa: E402
from _common import Checker, Driver, DriverError, detect, main  # noqa: E402


def test():
    ck = Checker()
    _, port = start_torch2_server()
    t = Torch2Driver(port)
    d = Driver(port, "modern")
    d2 = Driver(port, "modern")

    d.call("set", "k1", b"v1")
    ck.eq("torch 2.6 reads ddprun's set", t.call("get", "k1"), b"v1")
    t.call("set", "k2", b"\x00binary\xff")
    ck.eq("ddprun reads torch 2.6's set", d.call("get", "k2"), b"\x00binary\xff")
    ck.eq("add", d.call("add", "cnt", 5), 5)
    ck.eq("torch add on the same counter", t.call("add", "cnt", 1), 6)
    ck.eq("counter text", d.call("get", "cnt"), b"6")
    ck.eq("cas create", d.call("compare_set", "cas", b"", b"a"), b"a")
    ck.eq("cas missing echoes expected", d.call("compare_set", "nocas", b"x", b"y"), b"x")
    ck.eq("cas swap", d.call("compare_set", "cas", b"a", b"b"), b"b")
    ck.eq("cas mismatch", d.call("compare_set", "cas", b"a", b"c"), b"b")
    ck.eq("check present", d.call("check", ["k1", "cnt"]), True)
    ck.eq("check missing", d.call("check", ["k1", "nocas"]), False)
    ck.eq("wait present", d.call("wait", 1000, ["k1", "k2"]), None)
    # APPEND has no reply: a read on the same connection orders it before the other client's.
    d.call("append", "log", b"a")
    ck.eq("append creates", d.call("get", "log"), b"a")
    t.call("append", "log", b"b")
    ck.eq("append from both clients", d.call("get", "log"), b"ab")
    d.call("multi_set", ["m1", b"one", "m2", b"two"])
    ck.eq("torch multi_get of ddprun's multi_set", t.call("multi_get", "m1", "m2"), [b"one", b"two"])
    ck.eq("ddprun multi_get", d.call("multi_get", ["m2", "k1"]), [b"two", b"v1"])

    try:
        d.call("wait", 200, ["never"])
        ck.true("wait timed out", False)
    except DriverError as e:
        ck.eq("wait timeout kind", e.kind, "TimeoutError")
        ck.true("timeout message names the server", f"127.0.0.1:{port}" in e.message)
    t.call("set", "never", b"now")
    ck.eq("op after timeout", d.call("add", "cnt", 1), 7)
    ck.eq("get after timeout", d.call("get", "never"), b"now")

    d2.send("get", "late")
    try:
        d2.receive(timeout=0.3)
        ck.true("get blocks while the key is missing", False)
    except TimeoutError:
        ck.true("get blocks while the key is missing", True)
    t.call("set", "late", b"here")
    ck.eq("blocked get woken by torch 2.6's set", d2.receive(timeout=20), b"here")

    # keys: k1 k2 cnt cas log m1 m2 never late
    ck.eq("num_keys", d.call("num_keys"), 9)
    ck.eq("delete", d.call("delete_key", "k1"), True)
    ck.eq("delete again", d.call("delete_key", "k1"), False)
    ck.eq("torch sees the delete", t.call("num_keys"), 8)
    w = Torch2Driver(port, world_size=2)
    ck.eq("torch world_size client adds to init/", d.call("add_raw", "init/", 0), 1)
    ck.eq("detect_generation", detect(port), "modern")
    ck.eq("server fine after the probe", d.call("get", "k2"), b"\x00binary\xff")
    ck.eq("torch client fine after the probe", t.call("get", "k2"), b"\x00binary\xff")
    for c in (d, d2, t, w):
        c.close()
    ck.finish("ddprun client vs torch 2.6 server")


if __name__ == "__main__":
    main(test)
