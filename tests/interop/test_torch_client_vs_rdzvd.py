"""torch 1.13's own TCPStore client (is_master=False) against ddprun-rdzvd, mixed with
ddprun's client (store_client_driver) on the same server."""
import datetime
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Checker, Driver, detect, main, start_rdzvd, torch_client  # noqa: E402


def test():
    ck = Checker()
    _, port = start_rdzvd()
    a = torch_client(port)
    b = torch_client(port)
    drv = Driver(port, "modern")

    a.set("k1", "v1")
    ck.eq("get own", a.get("k1"), b"v1")
    ck.eq("get other torch client", b.get("k1"), b"v1")
    ck.eq("get via ddprun client", drv.call("get", "k1"), b"v1")
    drv.call("set", "fromcpp", b"\x00\x01bytes")
    ck.eq("torch reads ddprun's set", a.get("fromcpp"), b"\x00\x01bytes")

    ck.eq("add", a.add("cnt", 5), 5)
    ck.eq("add other", b.add("cnt", -2), 3)
    ck.eq("add via ddprun", drv.call("add", "cnt", 10), 13)
    ck.eq("counter as text", a.get("cnt"), b"13")

    ck.eq("cas missing+empty creates", a.compare_set("cas", "", "first"), b"first")
    ck.eq("cas missing+expected echoes expected", a.compare_set("nocas", "x", "y"), b"x")
    ck.eq("nocas not created", drv.call("check", ["nocas"]), False)
    ck.eq("cas equal swaps", a.compare_set("cas", "first", "second"), b"second")
    ck.eq("cas different returns current", b.compare_set("cas", "nope", "third"), b"second")
    ck.eq("check via ddprun (1.13 python has no check())", drv.call("check", ["cas", "k1"]), True)

    a.wait(["k1", "cnt"])
    a.wait(["k1"], datetime.timedelta(seconds=2))
    ck.true("wait present keys returned", True)

    # wait with a timeout on a missing key -> RuntimeError; a later op on a NEW client works
    timed = torch_client(port)
    try:
        timed.wait(["never"], datetime.timedelta(milliseconds=200))
        ck.true("wait on missing key timed out", False)
    except RuntimeError as e:
        ck.true(f"wait timeout raised RuntimeError ({e})", True)
    fresh = torch_client(port)
    ck.eq("new client after timeout", fresh.add("cnt", 1), 14)
    ck.eq("other clients unaffected by the timeout", b.get("k1"), b"v1")

    # a wait woken by another client's set
    got = {}

    def waiter():
        c = torch_client(port, timeout_s=20)
        got["value"] = c.get("late")  # WAIT + GET

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    t.join(timeout=0.3)
    ck.true("waiter blocks while the key is missing", t.is_alive())
    b.set("late", "here")
    t.join(timeout=20)
    ck.true("waiter woken by another client's set", not t.is_alive())
    ck.eq("woken waiter's value", got.get("value"), b"here")

    # delete_key
    ck.eq("delete present", a.delete_key("k1"), True)
    ck.eq("delete absent", a.delete_key("k1"), False)

    # num_keys; init/ counts when a client is created with world_size
    # keys now: fromcpp cnt cas late (k1 deleted)
    ck.eq("num_keys", a.num_keys(), 4)
    w1 = torch_client(port, world_size=3)
    ck.eq("num_keys includes init/", a.num_keys(), 5)
    w2 = torch_client(port, world_size=3)
    ck.eq("init/ counts clients created with world_size", drv.call("add_raw", "init/", 0), 2)
    ck.eq("num_keys unchanged by second world_size client", w2.num_keys(), 5)
    ck.eq("ddprun list_keys hides init/",
          drv.call("list_keys"), [b"cas", b"cnt", b"fromcpp", b"late"])
    ck.eq("detect_generation on ddprun-rdzvd", detect(port), "modern")
    del w1, w2
    drv.close()
    ck.finish("torch client vs ddprun-rdzvd")


if __name__ == "__main__":
    main(test)
