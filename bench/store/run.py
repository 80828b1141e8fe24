#!/usr/bin/python3
"""Store benchmark: ddprun-rdzvd vs torch 1.13's own TCPStore server, same clients, one run.

  /usr/bin/python3 bench/store/run.py --bin-dir build/bin [--quick] [--reps N]
        [--out results.json] [--markdown table.md] [--update-doc docs/performance.md]

Measures, against both servers:
  * serial get/add latency (p50/p99 µs): ddprun's C++ client (store_bench; modern, modern
    with pipelined_get, and legacy generation against ddprun-rdzvd, legacy against torch) and
    torch's Python client;
  * throughput, 50 concurrent C++ clients (threads, one connection and one request in flight
    each), ops/s;
  * N-client connect + add + wait barrier (N = 64, 256, 1024): release -> last client done,
    plus errors (resets/timeouts) and connect retries.
Each figure is the median of --reps runs with min-max. Writes JSON (--out) and a markdown
table (--markdown) for docs/performance.md; nothing there is typed by hand.
Needs /usr/bin/python3 with torch 1.13 (Debian python3-torch).
"""
import argparse
import datetime
import json
import os
import platform
import resource
import select
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from doc_block import update_doc as write_doc_block  # noqa: E402

HOST = "127.0.0.1"
GOALS = {"serial_us": 30.0, "throughput_ops": 90000.0, "barrier1024_ms": 250.0}
TORCH_ANCHORS = "torch 1.13 anchors (performance-anchors.md S12/S13): get 134 µs, add 64 µs, 1024 barrier 835 ms"

TORCH_SERVER = r"""
import resource, sys, datetime
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=120),
                  wait_for_workers=False)
import torch
print(s.port, torch.__version__, flush=True)
sys.stdin.read()
"""

TORCH_CLIENT = r"""
import datetime, json, sys, time
import torch.distributed as dist
n = int(sys.argv[1])
out = {}
for spec in sys.argv[2:]:  # PORT:OP ...
    port, op = spec.split(":")
    c = dist.TCPStore("127.0.0.1", int(port), None, False, timeout=datetime.timedelta(seconds=60))
    c.set("py_key", "v" * 16)
    f = (lambda: c.get("py_key")) if op == "get" else (lambda: c.add("py_key_ctr", 1))
    for _ in range(500): f()
    lat = []
    pc = time.perf_counter_ns
    for _ in range(n):
        t = pc(); f(); lat.append(pc() - t)
    lat.sort()
    out[spec] = {"p50_us": lat[len(lat) // 2] / 1e3, "p99_us": lat[int(0.99 * (len(lat) - 1))] / 1e3,
                 "mean_us": sum(lat) / len(lat) / 1e3}
    del c
print(json.dumps(out))
"""

children = []


def readline(proc, timeout):
    deadline = time.monotonic() + timeout
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            raise SystemExit(f"no readiness line from {proc.args[0]} within {timeout} s")
        ch = os.read(proc.stdout.fileno(), 1)
        if not ch:
            raise SystemExit(f"{proc.args[0]} exited before it was ready")
        buf += ch
    return buf.decode().strip()


def start_ours(bin_dir):
    p = subprocess.Popen([os.path.join(bin_dir, "ddprun-rdzvd"), "--host", HOST, "--port", "0",
                          "--log-level", "warning"], stdout=subprocess.PIPE)
    children.append(p)
    line = readline(p, 20)
    assert line.startswith("listening on "), line
    return p, int(line.rsplit(":", 1)[1])


def spawn_torch():
    p = subprocess.Popen([sys.executable, "-c", TORCH_SERVER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    children.append(p)
    return p


def await_torch(p):
    port, version = readline(p, 60).split()
    return int(port), version


def pin(pid, cpus):
    """Sets the CPU affinity of every thread of `pid` (torch's server runs in a thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def run_json(cmd, timeout):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def git_revision():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "unknown") + ("+local changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def build_type(bin_dir):
    """CMAKE_BUILD_TYPE of the build that produced bin_dir (its CMakeCache.txt is one up)."""
    try:
        with open(os.path.join(bin_dir, "..", "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("CMAKE_BUILD_TYPE:"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True, help="folder with ddprun-rdzvd and store_bench")
    ap.add_argument("--quick", action="store_true", help="one short run of everything (<= ~20 s)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3, quick 1)")
    ap.add_argument("--out", default=None, help="write the JSON results here")
    ap.add_argument("--markdown", default=None, help="write the markdown table here")
    ap.add_argument("--update-doc", default=None, metavar="MD",
                    help="replace the block between the store-bench markers in this file "
                         "(docs/performance.md) with the generated table")
    ap.add_argument("--no-pin-serial", dest="pin_serial", action="store_false",
                    help="do not pin the serial-latency runs (servers and client) to one vCPU")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    quick = args.quick
    reps = args.reps or (1 if quick else 3)
    n_cpp = 3000 if quick else 20000
    n_py = 1000 if quick else 10000
    tp_secs = 0.25 if quick else 1.5
    barrier_ns = [64, 256] if quick else [64, 256, 1024]  # quick: stays well under a minute in CI
    bench = os.path.join(args.bin_dir, "store_bench")

    t_start = time.monotonic()
    load_before = os.getloadavg()
    torch_srv = spawn_torch()  # starts while ddprun-rdzvd starts (import torch takes ~1 s)
    ours, ours_port = start_ours(args.bin_dir)
    torch_port, torch_version = await_torch(torch_srv)
    servers = {"ddprun-rdzvd": ours_port, "torch-1.13": torch_port}
    # (label, server, client, generation)
    serial_cfgs = [("ddprun-rdzvd", "C++ modern"), ("ddprun-rdzvd", "C++ modern pipelined-get"),
                   ("ddprun-rdzvd", "C++ legacy"),
                   ("torch-1.13", "C++ legacy"), ("ddprun-rdzvd", "Python torch"),
                   ("torch-1.13", "Python torch")]
    raw = {}

    def add(key, value):
        raw.setdefault(key, []).append(value)

    try:
        all_cpus = os.sched_getaffinity(0)
        for rep in range(reps):
            # Serial latency: servers and client on one vCPU. On this VM a wake-up across idle
            # vCPUs costs ~100 us (haltpoll), which would swamp a ~15 us round trip and vary
            # with whatever else runs; on one vCPU both servers are measured the same way.
            serial_pin = ["taskset", "-c", str(min(all_cpus))] if args.pin_serial else []
            if args.pin_serial:
                for srv in (ours, torch_srv):
                    pin(srv.pid, {min(all_cpus)})
            # torch's Python client: one interpreter (one `import torch`) for all its configs
            specs = [f"{servers[s]}:{op}" for s, c in serial_cfgs if c == "Python torch"
                     for op in ("get", "add")]
            py = run_json([*serial_pin, sys.executable, "-c", TORCH_CLIENT, str(n_py), *specs], 300)
            for server, client in serial_cfgs:
                port = servers[server]
                for op in ("get", "add"):
                    if not client.startswith("C++"):
                        r = py[f"{port}:{op}"]
                    else:
                        gen = client.split()[1]
                        piped = "1" if "pipelined" in client else "0"
                        r = run_json([*serial_pin, bench, "serial", "--port", str(port), "--generation", gen,
                                      "--op", op, "--n", str(n_cpp), "--pipelined-get", piped], 120)
                    add(("serial", server, client, op, "p50_us"), r["p50_us"])
                    add(("serial", server, client, op, "p99_us"), r["p99_us"])
            for srv in (ours, torch_srv):
                pin(srv.pid, all_cpus)
            for server, gen in (("ddprun-rdzvd", "modern"), ("torch-1.13", "legacy")):
                for op in ("add", "get"):
                    r = run_json([bench, "throughput", "--port", str(servers[server]),
                                  "--generation", gen, "--op", op, "--clients", "50",
                                  "--seconds", str(tp_secs)], 120)
                    add(("throughput", server, f"C++ {gen} x50", op, "ops_per_s"), r["ops_per_s"])
                    add(("throughput", server, f"C++ {gen} x50", op, "errors"), r["errors"])
                r = run_json([bench, "throughput-epoll", "--port", str(servers[server]),
                              "--generation", gen, "--clients", "50", "--seconds", str(tp_secs)], 120)
                add(("throughput", server, f"raw epoll {gen} x50", "add", "ops_per_s"), r["ops_per_s"])
                add(("throughput", server, f"raw epoll {gen} x50", "add", "errors"), r["errors"])
            for server, gen in (("ddprun-rdzvd", "modern"), ("torch-1.13", "legacy")):
                for n in barrier_ns:
                    r = run_json([bench, "barrier", "--port", str(servers[server]), "--generation",
                                  gen, "--clients", str(n), "--tag", f"{rep}_{n}"], 180)
                    add(("barrier", server, f"C++ {gen}", n, "ms"), r["release_to_last_ms"])
                    add(("barrier", server, f"C++ {gen}", n, "errors"), r["errors"])
                    add(("barrier", server, f"C++ {gen}", n, "retries"), r["connect_retries"])
    finally:
        for p in children:
            p.kill()
            p.wait()
    elapsed = time.monotonic() - t_start
    load_after = os.getloadavg()

    results = []
    for key, values in raw.items():
        kind, server, client, what, unit = key
        results.append({"kind": kind, "server": server, "client": client, "what": str(what),
                        "unit": unit, **summary(values)})
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(([f"nice -n {os.nice(0)}"] if os.nice(0) else []) + [sys.executable] + sys.argv),
        "build_type": build_type(args.bin_dir),
        "ddprun_revision": git_revision(),
        "quick": quick, "reps": reps, "serial_ops_cpp": n_cpp, "serial_ops_python": n_py,
        "throughput_seconds": tp_secs, "serial_pinned_to_one_cpu": args.pin_serial, "cpus": os.cpu_count(), "machine": platform.machine(),
        "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch_version, "loadavg_before": load_before, "loadavg_after": load_after,
        "elapsed_s": round(elapsed, 1), "goals": GOALS,
    }
    doc = {"meta": meta, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    md = markdown(doc)
    print(md)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    if args.update_doc:
        update_doc(args.update_doc, md)




def update_doc(path, md):
    write_doc_block(path, "store-bench", "bench/store/run.py", md)


def fmt(r, digits=1):
    def f(v):
        return f"{v:,.{digits}f}"
    if r["min"] == r["max"]:
        return f(r["median"])
    return f"{f(r['median'])} ({f(r['min'])}–{f(r['max'])})"


def markdown(doc):
    m, res = doc["meta"], doc["results"]
    idx = {(r["kind"], r["server"], r["client"], r["what"], r["unit"]): r for r in res}
    out = [f"Measured {m['date']} with `{m['command']}` ({m['build_type']} build of ddprun "
           f"{m['ddprun_revision']}): "
           f"{m['cpus']} vCPU, kernel {m['kernel']}, "
           f"Python {m['python']}, torch {m['torch']}; {m['reps']} run(s) per figure, median "
           f"(min–max); {m['serial_ops_cpp']} serial ops per C++ run, {m['serial_ops_python']} per "
           f"Python run; load average {m['loadavg_before'][0]:.1f} before, "
           f"{m['loadavg_after'][0]:.1f} after; whole run {m['elapsed_s']} s.", ""]
    pinned = (" Servers and client pinned to one vCPU: on this VM a wake-up across idle vCPUs costs"
              " ~100 µs, which would swamp the round trip for both servers alike."
              if m.get("serial_pinned_to_one_cpu") else "")
    out += ["**Serial latency** (one client, one connection; `get` = WAIT + GET, two round trips)." + pinned, "",
            "| server | client | get p50 µs | get p99 µs | add p50 µs | add p99 µs |",
            "|---|---|---|---|---|---|"]
    seen = []
    for r in res:
        if r["kind"] == "serial" and (r["server"], r["client"]) not in seen:
            seen.append((r["server"], r["client"]))
    for s, c in seen:
        cells = [fmt(idx[("serial", s, c, op, u)]) for op in ("get", "add") for u in ("p50_us", "p99_us")]
        out.append(f"| {s} | {c} | " + " | ".join(cells) + " |")
    out += ["", "**Throughput**, 50 connections, one request in flight each: `C++ … x50` = 50 threads "
            "each with its own StoreClient; `raw epoll … x50` = one thread multiplexing 50 raw-protocol "
            "connections with epoll (ADD only, like redis-benchmark; shows the server's capacity "
            "without 50 threads competing for the 2 vCPUs)", "",
            "| server | client | add ops/s | get ops/s | errors |", "|---|---|---|---|---|"]
    for s, c in sorted({(r["server"], r["client"]) for r in res if r["kind"] == "throughput"}):
        ops = [op for op in ("add", "get") if ("throughput", s, c, op, "errors") in idx]
        errs = sum(sum(idx[("throughput", s, c, op, "errors")]["runs"]) for op in ops)
        get = fmt(idx[("throughput", s, c, "get", "ops_per_s")], 0) if "get" in ops else "–"
        out.append(f"| {s} | {c} | {fmt(idx[('throughput', s, c, 'add', 'ops_per_s')], 0)} | "
                   f"{get} | {errs:.0f} |")
    out += ["", "**Connection storm barrier**: N client threads released together; each connects, "
            "`add(barrier, 1)`, the N-th sets `done`, all `wait([done])`; time from release to the "
            "last client done", "",
            "| server | client | N | ms | errors | connect retries |", "|---|---|---|---|---|---|"]
    for r in res:
        if r["kind"] == "barrier" and r["unit"] == "ms":
            s, c, n = r["server"], r["client"], r["what"]
            errs = sum(idx[("barrier", s, c, n, "errors")]["runs"])
            retries = sum(idx[("barrier", s, c, n, "retries")]["runs"])
            out.append(f"| {s} | {c} | {n} | {fmt(r)} | {errs:.0f} | {retries:.0f} |")
    g = m["goals"]
    out += ["", f"Goals (performance-anchors.md G6–G8): serial ≤ {g['serial_us']:.0f} µs, "
            f"≥ {g['throughput_ops']:,.0f} ops/s with 50 clients, 1024-client barrier ≤ "
            f"{g['barrier1024_ms']:.0f} ms with 0 errors. {TORCH_ANCHORS}.", ""]
    return "\n".join(out)


if __name__ == "__main__":
    try:
        main()
    finally:
        for p in children:
            if p.poll() is None:
                p.kill()
