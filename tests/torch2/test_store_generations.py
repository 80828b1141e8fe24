"""Both torch generations on one ddprun-rdzvd port at the same time: a torch 1.13 client (this
process), torch 2.6 clients (python3-torch2 children) and ddprun's client in both generations,
interleaved on shared keys: values, counters, compare-and-set, waits woken across generations,
2.x-only operations (check, append, multi_get/multi_set), a 2.6 wait timeout (the 2.6 client
cancels its wait and stays usable; the 1.13 client beside it is unaffected), and the init/
counter both generations bump."""
import datetime
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _torch2 import Torch2Driver, _common  # noqa: E402
from _common import Checker, Driver, DriverError, detect, main, start_rdzvd, torch_client  # noqa: E402


def test():
    ck = Checker()
    _, port = start_rdzvd()
    old = torch_client(port)                 # torch 1.13, legacy generation
    new = Torch2Driver(port)                 # torch 2.6, modern generation
    new2 = Torch2Driver(port)
    legacy = Driver(port, "legacy")          # ddprun's client, both generations
    modern = Driver(port, "modern")
    ck.true("torch 2.x client: " + new.call("version"), new.call("version").startswith("2."))

    old.set("k1", "from 1.13")
    ck.eq("2.6 reads 1.13's set", new.call("get", "k1"), b"from 1.13")
    new.call("set", "k2", b"\x00from 2.6\xff")
    ck.eq("1.13 reads 2.6's set", old.get("k2"), b"\x00from 2.6\xff")
    ck.eq("ddprun legacy reads 2.6's set", legacy.call("get", "k2"), b"\x00from 2.6\xff")
    ck.eq("ddprun modern reads 1.13's set", modern.call("get", "k1"), b"from 1.13")

    ck.eq("add 1.13", old.add("cnt", 5), 5)
    ck.eq("add 2.6", new.call("add", "cnt", 7), 12)
    ck.eq("add ddprun legacy", legacy.call("add", "cnt", -2), 10)
    ck.eq("add ddprun modern", modern.call("add", "cnt", 1), 11)
    ck.eq("counter text seen by 2.6", new.call("get", "cnt"), b"11")

    ck.eq("cas create by 2.6", new.call("compare_set", "cas", b"", b"a"), b"a")
    ck.eq("cas swap by 1.13", old.compare_set("cas", "a", "b"), b"b")
    ck.eq("cas mismatch by 2.6", new.call("compare_set", "cas", b"a", b"c"), b"b")
    ck.eq("cas missing echoes expected (2.6)", new.call("compare_set", "nocas", b"x", b"y"), b"x")

    # 2.x-only operations, the results visible to 1.13
    ck.eq("check present (2.6)", new.call("check", "k1", "k2", "cnt"), True)
    ck.eq("check missing (2.6)", new.call("check", "k1", "nocas"), False)
    # APPEND has no reply: a read on the same connection orders it before the other client's.
    new.call("append", "log", b"a")
    ck.eq("append creates (2.6)", new.call("get", "log"), b"a")
    new2.call("append", "log", b"b")
    ck.eq("append from two 2.6 clients, read by 1.13", old.get("log"), b"ab")
    new.call("multi_set", "m1", b"one", "m2", b"two")
    ck.eq("multi_get (2.6)", new2.call("multi_get", "m1", "m2", "k1"), [b"one", b"two", b"from 1.13"])
    ck.eq("1.13 reads multi_set", old.get("m2"), b"two")

    # waits woken across generations
    new.send("get", "late26")          # 2.6 blocks (WAIT + GET) ...
    try:
        new.receive(timeout=0.3)
        ck.true("2.6 get blocks while the key is missing", False)
    except TimeoutError:
        ck.true("2.6 get blocks while the key is missing", True)
    old.set("late26", "woken by 1.13")  # ... until the 1.13 client sets the key
    ck.eq("2.6 waiter woken by 1.13's set", new.receive(timeout=20), b"woken by 1.13")

    got = {}

    def waiter():
        got["value"] = torch_client(port, timeout_s=20).get("late13")

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    t.join(timeout=0.3)
    ck.true("1.13 get blocks while the key is missing", t.is_alive())
    new2.call("set", "late13", b"woken by 2.6")
    t.join(timeout=20)
    ck.eq("1.13 waiter woken by 2.6's set", got.get("value"), b"woken by 2.6")

    # A 2.6 wait that times out: CANCEL_WAIT; that client and every other one go on.
    try:
        new.call("wait", 200, ["never"])
        ck.true("2.6 wait on a missing key timed out", False)
    except DriverError as e:
        ck.eq("2.6 wait timeout kind (" + e.message + ")", e.kind, "TimeoutError")
    ck.eq("same 2.6 client after its timeout", new.call("add", "cnt", 1), 12)
    old.set("never", "now")
    ck.eq("the cancelled wait left no stale wake-up", new.call("get", "never"), b"now")
    ck.eq("1.13 unaffected", old.get("k1"), b"from 1.13")

    ck.eq("delete by 2.6", new.call("delete_key", "k1"), True)
    ck.eq("delete again by 1.13", old.delete_key("k1"), False)
    # keys: k2 cnt cas log m1 m2 late26 late13 never
    ck.eq("num_keys (1.13)", old.num_keys(), 9)
    ck.eq("num_keys (2.6)", new.call("num_keys"), 9)

    # init/ counts clients created with a world size, whatever their generation.
    w13 = torch_client(port, world_size=2)
    w26 = Torch2Driver(port, world_size=2)
    ck.eq("init/ counted a 1.13 and a 2.6 client", modern.call("add_raw", "init/", 0), 2)
    ck.eq("detect_generation on ddprun-rdzvd", detect(port), "modern")
    for d in (new, new2, w26, legacy, modern):
        d.close()
    del w13
    ck.finish("torch 1.13 + 2.6 clients on one ddprun-rdzvd port")


if __name__ == "__main__":
    main(test)
