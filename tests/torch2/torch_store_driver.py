"""torch's own Python TCPStore client driven from stdin, for the torch 2.x store tests.

    python3-torch2 torch_store_driver.py --port P [--world-size N] [--timeout-ms N]

The line protocol of tests/interop/store_client_driver.cpp (commands in, one JSON reply per
line out, binary as "h" + hex), so the interop helpers (_common.Driver) drive a torch 2.6
client exactly as they drive ddprun's: set K V | get K [timeout_ms] | add K N | compare_set K E D
| check K... | wait TIMEOUT_MS K... | num_keys | delete_key K | append K V | multi_get K... |
multi_set K V [K V...] | version | quit. The first line is the connect result. Errors come back
as {"ok":false,"error":"TimeoutError"|"Error",...}; unlike the 1.13 client, a 2.x client stays
usable after a timeout (it cancels its wait), so it is never replaced.
"""
import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist


def unhex(tok):
    if not tok.startswith("h"):
        raise ValueError(f"argument {tok!r} must be 'h' + hex")
    return bytes.fromhex(tok[1:])


def enc(v):
    if v is None or isinstance(v, bool) or isinstance(v, int):
        return v
    if isinstance(v, (bytes, bytearray)):
        return "h" + bytes(v).hex()
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return [enc(x) for x in v]
    raise TypeError(repr(v))


def key(tok):
    return unhex(tok).decode("utf-8", "surrogateescape")


def run(store, default_timeout, t):
    op, a = t[0], t[1:]
    if op == "set":
        return store.set(key(a[0]), unhex(a[1]))
    if op == "get":
        if len(a) > 1:
            store.set_timeout(datetime.timedelta(milliseconds=int(a[1])))
            try:
                return store.get(key(a[0]))
            finally:
                store.set_timeout(default_timeout)
        return store.get(key(a[0]))
    if op == "add":
        return store.add(key(a[0]), int(a[1]))
    if op == "compare_set":
        return store.compare_set(key(a[0]), unhex(a[1]), unhex(a[2]))
    if op == "check":
        return store.check([key(x) for x in a])
    if op == "wait":
        keys = [key(x) for x in a[1:]]
        if int(a[0]) < 0:
            return store.wait(keys)
        return store.wait(keys, datetime.timedelta(milliseconds=int(a[0])))
    if op == "num_keys":
        return store.num_keys()
    if op == "delete_key":
        return store.delete_key(key(a[0]))
    if op == "append":
        return store.append(key(a[0]), unhex(a[1]))
    if op == "multi_get":
        return store.multi_get([key(x) for x in a])
    if op == "multi_set":
        return store.multi_set([key(x) for x in a[0::2]], [unhex(x) for x in a[1::2]])
    if op == "version":
        return torch.__version__
    raise ValueError(f"unknown op {op!r}")


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world-size", type=int, default=None)
    p.add_argument("--timeout-ms", type=int, default=10000)
    a = p.parse_args()
    timeout = datetime.timedelta(milliseconds=a.timeout_ms)
    try:
        uv = os.environ.get("DDPRUN_TEST_TORCH_USE_LIBUV")  # tests/interop/_common.py
        kw = {} if uv is None else {"use_libuv": uv == "1"}
        store = dist.TCPStore(a.host, a.port, a.world_size, False, timeout=timeout, **kw)
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        reply({"ok": False, "error": "NetworkError", "message": str(e)})
        sys.exit(2)
    reply({"ok": True, "result": "connected"})
    for line in sys.stdin:
        t = line.split()
        if not t:
            continue
        if t[0] == "quit":
            break
        try:
            reply({"ok": True, "result": enc(run(store, timeout, t))})
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            kind = "TimeoutError" if ("imeout" in msg or "timed out" in msg or
                                      isinstance(e, dist.DistStoreError) and "wait" in msg) else "Error"
            reply({"ok": False, "error": kind, "message": f"{type(e).__name__}: {msg}"})


if __name__ == "__main__":
    main()
