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
    plus errors (resets/timeouts) and connect retries;
  * the barrier at scale (N = 1024, 4096, 16384; --quick: 256): store_barrier_bench replays
    the store traffic of N torch ranks (torch 2.6's and 1.13's init_process_group barrier) from
    epoll threads against ddprun-rdzvd, torch 1.13's server and torch 2.6's (libuv and the
    older backend, when scripts/torch2's root is there), a fresh server per run; a run that
    fails is reported as "did not survive" with what happened, and not repeated.
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
import torch2  # noqa: E402

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

# A TCPStore server for the storm stage: prints "PORT VERSION PID" once listening. argv[1]:
# "1"/"0" = use_libuv (torch 2.x only), absent = the version's default.
TORCH_STORM_SERVER = r"""
import resource, sys, datetime, os
import torch, torch.distributed as dist
kw = {"use_libuv": sys.argv[1] == "1"} if len(sys.argv) > 1 else {}
s = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=300),
                  wait_for_workers=False, **kw)
print(s.port, torch.__version__, os.getpid(), flush=True)
sys.stdin.read()
"""

# The storm stage's rows: (server, clients replayed, server kind, generation, pattern,
# 1.13 callback connection, ranks per source address (0: all from 127.0.0.1)).
STORM_ROWS = [
    ("ddprun-rdzvd", "torch 2.6 ranks", "ours", "modern", "wait", False, 0),
    ("ddprun-rdzvd", "torch 1.13 ranks", "ours", "legacy", "poll", True, 0),
    ("ddprun-rdzvd, default limits", "torch 2.6 ranks, 8 per address", "ours-defaults", "modern", "wait", False, 8),
    ("torch-1.13", "torch 1.13 ranks", "torch-1.13", "legacy", "poll", True, 0),
    ("torch-2.6 libuv", "torch 2.6 ranks", "torch-2.6-libuv", "modern", "wait", False, 0),
    ("torch-2.6 non-libuv", "torch 2.6 ranks", "torch-2.6-nolibuv", "modern", "wait", False, 0),
]
STORM_GOAL_MS = 2000.0

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


def raise_nofile_for(conns):
    """Lets this process and its children open `conns` sockets (plus some): as root the hard
    limit is raised up to fs.nr_open; otherwise the soft limit goes to the hard one."""
    want = conns + 4096
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want:
        return soft
    if hard < want and os.geteuid() == 0:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                cap = int(f.read())
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, cap), min(want, cap)))
            return min(want, cap)
        except (OSError, ValueError):
            pass
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def start_storm_server(kind, bin_dir):
    """(process, port, pid, version) of a fresh server of `kind` (see STORM_ROWS)."""
    if kind.startswith("ours"):
        cmd = [os.path.join(bin_dir, "ddprun-rdzvd"), "--host", HOST, "--port", "0", "--log-level", "error"]
        if kind == "ours":  # every rank from 127.0.0.1: one address, so the per-address cap goes
            cmd += ["--max-connections-per-peer", "0"]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE)
        children.append(p)
        line = readline(p, 20)
        assert line.startswith("listening on "), line
        return p, int(line.rsplit(":", 1)[1]), p.pid, "ddprun"
    if kind == "torch-1.13":
        cmd = [sys.executable, "-c", TORCH_STORM_SERVER]
    else:
        cmd = [torch2.PYTHON2, "-c", TORCH_STORM_SERVER, "1" if kind == "torch-2.6-libuv" else "0"]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    children.append(p)
    port, version, pid = readline(p, 120).split()
    return p, int(port), int(pid), version


def stop_storm_server(p):
    if p.poll() is None:
        p.kill()
    p.wait()
    children.remove(p)


def storm(bin_dir, sizes, reps, timeout_s, add, failures):
    """The barrier at scale; fills `add` (median-able figures) and `failures` (did not survive)."""
    bench = os.path.join(bin_dir, "store_barrier_bench")
    have2, why2 = torch2.available()
    rows = [r for r in STORM_ROWS if have2 or not r[2].startswith("torch-2.6")]
    nofile = raise_nofile_for(2 * max(sizes))  # 1.13 ranks open two connections each
    failed = set()
    for rep in range(reps):
        for n in sizes:
            for server, client, kind, gen, pattern, cb, per_addr in rows:
                if (server, client, n) in failed:
                    continue  # did not survive once: not repeated
                conns = n * (2 if cb else 1)
                if conns + 1024 > nofile:  # the server keeps ~1k descriptors in reserve
                    failed.add((server, client, n))
                    failures.append({"server": server, "client": client, "n": n, "rep": rep,
                                     "error": f"not run: {conns:,} connections need more than this "
                                              f"box's open-files limit of {nofile:,} (raising it "
                                              "needs CAP_SYS_RESOURCE)"})
                    continue
                p, port, pid, _ = start_storm_server(kind, bin_dir)
                try:
                    cmd = [bench, "--port", str(port), "--clients", str(n), "--generation", gen,
                           "--pattern", pattern, "--callback-conn", "1" if cb else "0",
                           "--ranks-per-address", str(per_addr), "--tag", f"{rep}_{n}",
                           "--timeout-s", str(timeout_s), "--server-pid", str(pid)]
                    try:
                        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 60)
                        out = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
                    except subprocess.TimeoutExpired:
                        out = None
                    alive = p.poll() is None
                    if out is None or out["errors"] or not alive:
                        what = ("server exited (status %s)" % p.returncode if not alive else
                                "no result from store_barrier_bench" if out is None else
                                f"rank failed (the run stops there): {out['first_error']}")
                        failed.add((server, client, n))
                        failures.append({"server": server, "client": client, "n": n, "rep": rep,
                                         "error": what[:300]})
                        print(f"storm: {server} / {client} / N={n}: did not survive: {what[:300]}",
                              file=sys.stderr)
                        continue
                    add(("storm", server, client, n, "ms"), out["release_to_last_ms"])
                    add(("storm", server, client, n, "connected_ms"), out["release_to_connected_ms"])
                    if kind.startswith("ours") and out["server_rss_peak_kib"] > 0:
                        add(("storm", server, client, n, "kib_per_rank"),
                            (out["server_rss_peak_kib"] - out["server_rss_before_kib"]) / n)
                finally:
                    stop_storm_server(p)
    return rows, (None if have2 else why2)


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
    ap.add_argument("--storm-sizes", default=None,
                    help="comma-separated barrier-at-scale sizes (default 1024,4096,16384; quick 256; "
                         "'' skips the stage)")
    ap.add_argument("--storm-timeout", type=float, default=60.0,
                    help="seconds one barrier-at-scale run may take before it counts as failed")
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
    if args.storm_sizes is None:
        storm_ns = [256] if quick else [1024, 4096, 16384]
    else:
        storm_ns = [int(x) for x in args.storm_sizes.split(",") if x.strip()]
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
        for p in list(children):
            stop_storm_server(p)
    storm_failures = []
    storm_rows, storm_no_torch2 = [], None
    if storm_ns:
        try:
            storm_rows, storm_no_torch2 = storm(args.bin_dir, storm_ns, reps, args.storm_timeout, add,
                                                storm_failures)
        finally:
            for p in list(children):
                stop_storm_server(p)
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
        "storm_sizes": storm_ns, "storm_timeout_s": args.storm_timeout, "storm_goal_ms": STORM_GOAL_MS,
        "storm_rows": [[r[0], r[1]] for r in storm_rows], "storm_failures": storm_failures,
        "storm_torch2_missing": storm_no_torch2,
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


def storm_markdown(m, idx):
    """The barrier-at-scale table (empty when the stage did not run)."""
    sizes = m.get("storm_sizes") or []
    if not sizes:
        return []
    fails = {(f["server"], f["client"], f["n"]): f["error"] for f in m.get("storm_failures", [])}
    out = ["", "**Barrier at scale**: `store_barrier_bench` replays the store traffic of N torch ranks "
           "released at once (epoll threads, the real wire bytes; a fresh server per run). torch 2.6 "
           "ranks: connect, VALIDATE + PING, `add(init/, 1)`, `add(K, 1)`, `add(K, 0)`, the rank "
           "reading N sets `K:last_worker`, all `wait([K:last_worker])` (TCPStore + "
           "`_store_based_barrier`). torch 1.13 ranks: connect plus the watch-callback connection, "
           "`add(init/, 1)`, `add(K, 1)`, then `add(K, 0)` every 10 ms until it reads N. Time from "
           "release to the last rank done, ms; every rank from 127.0.0.1 (so ddprun-rdzvd runs with "
           "`--max-connections-per-peer 0`), except the default-limits row (8 ranks per address, "
           "127.1.x.x). A run with a failed rank counts as \"did not survive\" (the run stops at the first "
           "failed rank, whose error is shown) and is not repeated.",
           "", "| server | ranks | " + " | ".join(f"N = {n:,}" for n in sizes) + " | server KiB per rank |",
           "|---|---|" + "---|" * (len(sizes) + 1)]
    for server, client in m.get("storm_rows", []):
        cells = []
        for n in sizes:
            r = idx.get(("storm", server, client, str(n), "ms"))
            if (server, client, n) in fails:
                err = fails[(server, client, n)].replace("|", "/")
                cells.append(err if err.startswith("not run") else "did not survive: " + err)
            elif r:
                cells.append(fmt(r, 0))
            else:
                cells.append("–")
        mem = idx.get(("storm", server, client, str(sizes[-1]), "kib_per_rank"))
        out.append(f"| {server} | {client} | " + " | ".join(cells) + f" | {fmt(mem) if mem else '–'} |")
    if m.get("storm_torch2_missing"):
        out += ["", f"torch 2.6 not measured: {m['storm_torch2_missing']}."]
    out += ["", f"Goal: 16,384 ranks ≤ {m.get('storm_goal_ms', STORM_GOAL_MS):,.0f} ms. "
            "Server KiB per rank: the server's RSS growth with every rank connected and done, divided "
            f"by N, at N = {sizes[-1]:,}."]
    return out


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
    out += storm_markdown(m, idx)
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
