"""init_process_group's store barrier against ddprun-rdzvd at sizes CI bears.

* 64 real torch 1.13 clients (TCPStore with world_size, so each adds init/ and opens its
  watch-callback connection) run torch's own elastic barrier (set + get of every rank's key).
* store_barrier_bench (bench/store) replays 1,024 torch 2.6 ranks (VALIDATE + PING, add init/,
  add K 1, add K 0, the last sets K:last_worker, all wait) and 512 torch 1.13 ranks (two
  connections each, add K 0 polled every 10 ms): every rank must finish, and torch reads the
  counters back (exactly N adds on each key).
* 1,024 ranks, 8 per source address (127.1.x.x), against the daemon's default limits: pass.
* The same storm from one address against --max-connections-per-peer 100: refused, as
  docs/daemon.md says (a store with thousands of clients on one address needs the flag).
"""
import json
import os
import resource
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Checker, Driver, binary, main, start_rdzvd, torch_client  # noqa: E402


def fd_budget():
    """How many connections one side may open here (both the bench and the daemon raise their
    soft open-files limit to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return hard - 512


def storm(port, n, *args):
    r = subprocess.run([binary("store_barrier_bench"), "--port", str(port), "--clients", str(n),
                        "--timeout-s", "60", *args], capture_output=True, text=True, timeout=120)
    lines = r.stdout.strip().splitlines()
    assert lines, f"store_barrier_bench printed nothing (exit {r.returncode}): {r.stderr[-2000:]}"
    return json.loads(lines[-1])


def counter(client, key):
    return client.add(key, 0)


def test():
    ck = Checker()
    budget = fd_budget()
    _, port = start_rdzvd(["--max-connections-per-peer", "0"])
    reader = torch_client(port)
    raw = Driver(port, "modern")  # init/ is the one key torch's client sends without its "/" prefix

    # Real torch clients and torch's own barrier code.
    from torch.distributed.elastic.utils.store import barrier

    n_torch = 64
    errors = []
    clients = [torch_client(port, world_size=n_torch, timeout_s=60) for _ in range(n_torch)]

    def rank(r):
        try:
            barrier(clients[r], r, n_torch, "scale/torch", barrier_timeout=60)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(f"rank {r}: {e}")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n_torch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    ck.eq("torch 1.13 ranks left in the barrier", sum(t.is_alive() for t in threads), 0)
    ck.eq("torch 1.13 barrier errors", errors, [])
    ck.eq("init/ counts every torch client", raw.call("add_raw", "init/", 0), n_torch)
    clients.clear()

    # Replayed torch 2.6 ranks.
    n26 = min(1024, budget)
    out = storm(port, n26, "--generation", "modern", "--pattern", "wait", "--tag", "m")
    ck.eq("2.6 replay errors", (out["errors"], out["first_error"]), (0, ""))
    ck.true("2.6 replay: every rank done", out["release_to_last_ms"] > 0)
    ck.eq("2.6 replay: init/ adds", raw.call("add_raw", "init/", 0), n_torch + n26)
    ck.eq("2.6 replay: barrier adds", counter(reader, "store_based_barrier_key:m"), n26)
    ck.eq("2.6 replay: the last rank set the key", reader.get("store_based_barrier_key:m:last_worker"), b"1")

    # Replayed torch 1.13 ranks (two connections each).
    n113 = min(512, budget // 2)
    out = storm(port, n113, "--generation", "legacy", "--pattern", "poll", "--callback-conn", "1", "--tag", "l")
    ck.eq("1.13 replay errors", (out["errors"], out["first_error"]), (0, ""))
    ck.eq("1.13 replay: barrier adds", counter(reader, "store_based_barrier_key:l"), n113)

    # Default limits, ranks spread over addresses as on real nodes.
    _, port2 = start_rdzvd()
    out = storm(port2, n26, "--ranks-per-address", "8", "--tag", "d")
    ck.eq("8 ranks per address, default limits: errors", (out["errors"], out["first_error"]), (0, ""))

    # One address past the per-peer cap: refused, not hung.
    _, port3 = start_rdzvd(["--max-connections-per-peer", "100"])
    out = storm(port3, 256, "--tag", "c")
    ck.true(f"one address past --max-connections-per-peer fails ({out['first_error']})", out["errors"] > 0)

    ck.finish("store_barrier_scale")


if __name__ == "__main__":
    main(test)
