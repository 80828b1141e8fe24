"""ddprun's client (store_client_driver, legacy generation) against torch 1.13's own
TCPStore server (is_master=True), mixed with torch clients on the same server."""
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (Checker, Driver, DriverError, detect, main, start_torch_server,  # noqa: E402
                     torch_client)


def test():
    ck = Checker()
    _, port = start_torch_server()
    t = torch_client(port)
    d = Driver(port, "legacy")
    d2 = Driver(port, "legacy")

    d.call("set", "k1", b"v1")
    ck.eq("torch reads ddprun's set", t.get("k1"), b"v1")
    t.set("k2", b"\x00binary\xff")
    ck.eq("ddprun reads torch's set", d.call("get", "k2"), b"\x00binary\xff")
    ck.eq("add", d.call("add", "cnt", 5), 5)
    ck.eq("torch add on the same counter", t.add("cnt", 1), 6)
    ck.eq("counter text", d.call("get", "cnt"), b"6")
    ck.eq("cas create", d.call("compare_set", "cas", b"", b"a"), b"a")
    ck.eq("cas missing echoes expected", d.call("compare_set", "nocas", b"x", b"y"), b"x")
    ck.eq("cas swap", d.call("compare_set", "cas", b"a", b"b"), b"b")
    ck.eq("cas mismatch", d.call("compare_set", "cas", b"a", b"c"), b"b")
    ck.eq("check present", d.call("check", ["k1", "cnt"]), True)
    ck.eq("check missing", d.call("check", ["k1", "nocas"]), False)
    ck.eq("wait present", d.call("wait", 1000, ["k1", "k2"]), None)

    # timeout: legacy reconnects; the stale registration died with the old connection, so a
    # later set of that key cannot desynchronise us.
    try:
        d.call("wait", 200, ["never"])
        ck.true("wait timed out", False)
    except DriverError as e:
        ck.eq("wait timeout kind", e.kind, "TimeoutError")
        ck.true("timeout message names the server", f"127.0.0.1:{port}" in e.message)
    t.set("never", "now")
    ck.eq("op after timeout", d.call("add", "cnt", 1), 7)
    ck.eq("get after timeout", d.call("get", "never"), b"now")

    # a blocked get woken by torch's set
    d2.send("get", "late")
    try:
        d2.receive(timeout=0.3)
        ck.true("get blocks while the key is missing", False)
    except TimeoutError:
        ck.true("get blocks while the key is missing", True)
    t.set("late", "here")
    ck.eq("blocked get woken by torch's set", d2.receive(timeout=20), b"here")

    ck.eq("num_keys", d.call("num_keys"), 6)  # k1 k2 cnt cas never late
    ck.eq("delete", d.call("delete_key", "k1"), True)
    ck.eq("delete again", d.call("delete_key", "k1"), False)
    ck.eq("torch sees the delete", t.num_keys(), 5)
    ck.eq("init/ via add_raw", d.call("add_raw", "init/", 1), 1)
    w = torch_client(port, world_size=2)
    ck.eq("torch world_size client adds to init/", d.call("add_raw", "init/", 0), 2)
    del w

    try:
        d.call("append", "k", b"v")
        ck.true("append refused", False)
    except DriverError as e:
        ck.true("modern op refused in legacy: " + e.message,
                e.kind == "Error" and "1.13 protocol generation" in e.message)
    ck.eq("connection still fine", d.call("get", "k2"), b"\x00binary\xff")
    # Probing: torch 1.13 is detected as legacy, and the probe does not break the server.
    ck.eq("detect_generation", detect(port), "legacy")
    ck.eq("server fine after the probe", d.call("get", "k2"), b"\x00binary\xff")
    ck.eq("torch client fine after the probe", t.get("k2"), b"\x00binary\xff")
    d.close()
    d2.close()
    ck.finish("ddprun client vs torch server")


if __name__ == "__main__":
    main(test)
