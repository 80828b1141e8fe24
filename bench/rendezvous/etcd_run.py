#!/usr/bin/python3
"""etcd rendezvous benchmark beside ddprun-rdzvd's (run.py): N simulated agents on etcd.

  python3 bench/rendezvous/etcd_run.py --bin-dir build/bin [--sizes 16,64,256,1024] [--reps N]
        [--members 1] [--lease-ttl 5] [--out results.json]

For each N a fresh etcd (Debian's /usr/bin/etcd, --members members on 127.0.0.1, ports picked
free, data under a temp dir) and one etcd_bench run (bench/rendezvous/etcd_bench.cpp): setup
(connect + N-1 joins), round close (last join -> all assigned) and restart (a worker failure ->
every agent reassigned in round 1). Each figure is the median of --reps runs (min-max). A phase
that does not finish within --timeout is reported as such (the phases before it keep their
figures). --lease-ttl is each simulated agent's etcd lease TTL in seconds. Prints a markdown
table and writes JSON (--out).
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "multinode"))
import etcd_cluster  # noqa: E402


def run_one(bench, n, members, timeout, lease_ttl):
    d = tempfile.mkdtemp(prefix="ddprun-etcd-bench-")
    cluster = None
    try:
        cluster = etcd_cluster.EtcdCluster(d, dict(os.environ), size=members)
        p = subprocess.run([bench, "--nodes", str(n), "--endpoints", cluster.endpoints, "--timeout", str(timeout),
                            "--lease-ttl", str(lease_ttl)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout + 60)
        lines = p.stdout.strip().splitlines()
        if p.returncode != 0 and not (lines and "error" in lines[-1]):
            raise SystemExit(f"etcd_bench --nodes {n} failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
        if p.returncode != 0:
            print(f"N={n}: {json.loads(lines[-1])['error']} (after {timeout:.0f} s); "
                  f"stderr tail: {p.stderr.strip()[-300:]}", flush=True)
        return json.loads(lines[-1])
    finally:
        if cluster:
            cluster.kill_all()
        shutil.rmtree(d, ignore_errors=True)


def summarize(values):
    done = [v for v in values if v is not None]
    if len(done) < len(values):
        return {"median": None, "runs": values}
    return {"median": statistics.median(done), "min": min(done), "max": max(done), "runs": values}


def fmt(s):
    if s["median"] is None:
        return "did not finish"
    if len(s["runs"]) == 1:
        return f"{s['median']:.1f}"
    return f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--sizes", default="16,64,256,1024")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--members", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--lease-ttl", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    bench = os.path.join(a.bin_dir, "etcd_bench")
    results = []
    for n in [int(x) for x in a.sizes.split(",")]:
        runs = [run_one(bench, n, a.members, a.timeout, a.lease_ttl) for _ in range(a.reps)]
        r = {"nodes": n}
        for key in ("setup_ms", "close_ms", "restart_ms"):
            r[key] = summarize([x.get(key) for x in runs])
        results.append(r)
        print(f"N={n}: setup {fmt(r['setup_ms'])} ms, close {fmt(r['close_ms'])} ms, "
              f"restart {fmt(r['restart_ms'])} ms", flush=True)
    meta = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "members": a.members,
            "reps": a.reps, "lease_ttl_s": a.lease_ttl, "command": " ".join(["bench/rendezvous/etcd_run.py"] + sys.argv[1:])}
    lines = [f"etcd {a.members} member(s) on 127.0.0.1, {meta['cpus']} vCPU; agent lease TTL {a.lease_ttl} s; "
             f"median of {a.reps} run(s) (min–max).",
             "", "| agents (N) | setup: N-1 joins (ms) | last join → all assigned (ms) | "
             "failure → all reassigned (ms) |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['nodes']} | {fmt(r['setup_ms'])} | {fmt(r['close_ms'])} | {fmt(r['restart_ms'])} |")
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
