#!/usr/bin/python3
"""Rendezvous benchmark: N simulated agents against ddprun-rdzvd's native rendezvous.

  python3 bench/rendezvous/run.py --bin-dir build/bin [--sizes 16,256,1024,4096,10000]
        [--reps N] [--out results.json] [--markdown table.md] [--update-doc docs/performance.md]

For each N, rdzv_bench (bench/rendezvous/rdzv_bench.cpp) starts a fresh ddprun-rdzvd on
127.0.0.1 port 0, opens N connections (one per simulated agent, real frames, one epoll thread),
lets N-1 agents join one job with min = max = N and waits until the daemon has answered each,
then sends the last JOIN and measures the time until every agent holds its ASSIGNMENT. It reads
the daemon's VmRSS / VmHWM from /proc. Each figure is the median of --reps runs (min-max).
Sizes above the open-files limit are skipped with a note. Writes JSON (--out) and a markdown
block (--markdown, --update-doc between the rdzv-bench markers); nothing is typed by hand.
"""
import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from doc_block import update_doc as write_doc_block  # noqa: E402

GOALS_MS = {16: 10.0, 1024: 100.0, 10000: 1500.0}


def run_one(bench, daemon, n, timeout):
    p = subprocess.run([bench, "--nodes", str(n), "--daemon", daemon, "--timeout", str(timeout)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout + 30)
    line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if p.returncode == 3:
        return json.loads(line)
    if p.returncode != 0:
        raise SystemExit(f"rdzv_bench --nodes {n} failed (exit {p.returncode}): {p.stderr.strip()}")
    return json.loads(line)


def summarize(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def fmt(s, digits=1, scale=1.0):
    med, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
    if len(s["runs"]) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def markdown(results, meta):
    lines = [
        f"Measured {meta['date']} on {meta['machine']} ({meta['cpus']} CPUs, Linux {meta['kernel']}), "
        f"`{meta['command']}`; median of {meta['reps_text']} (min–max).",
        "",
        "| agents (N) | last join → all assigned (ms) | goal (ms) | daemon RSS after (MiB) | daemon peak RSS (MiB) | setup: connect + N-1 joins (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        n = r["nodes"]
        if "skipped" in r:
            lines.append(f"| {n} | skipped: {r['skipped']} | | | | |")
            continue
        goal = GOALS_MS.get(n)
        goal_text = "" if goal is None else (f"≤ {goal:g} ✓" if r["ms"]["median"] <= goal else f"≤ {goal:g} ✗")
        lines.append(f"| {n} | {fmt(r['ms'], 1)} | {goal_text} | {fmt(r['rss_kib'], 1, 1 / 1024)} | "
                     f"{fmt(r['hwm_kib'], 1, 1 / 1024)} | {fmt(r['setup_s'], 2)} |")
    lines += [
        "",
        "The daemon is idle when the last JOIN is sent (every earlier join has been answered), so",
        "the figure is the round close: ranks, offsets and N ASSIGNMENT frames encoded and written.",
        "An idle daemon holds about 5 MiB. The setup column grows faster than N: each join still",
        "scans the job's members a few times (role counts, earliest lease) — see docs/daemon.md,",
        "\"Limits\".",
    ]
    return "\n".join(lines)


def update_doc(path, md):
    write_doc_block(path, "rdzv-bench", "bench/rendezvous/run.py", md)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True, help="build/bin with rdzv_bench and ddprun-rdzvd")
    ap.add_argument("--sizes", default="16,256,1024,4096,10000")
    ap.add_argument("--reps", type=int, default=3, help="runs per size (sizes above 4096: 1)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--out", default=None, metavar="JSON")
    ap.add_argument("--markdown", default=None, metavar="MD")
    ap.add_argument("--update-doc", default=None, metavar="MD",
                    help="replace the block between the rdzv-bench markers in this file")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    bench = os.path.join(args.bin_dir, "rdzv_bench")
    daemon = os.path.join(args.bin_dir, "ddprun-rdzvd")
    for path in (bench, daemon):
        if not os.access(path, os.X_OK):
            raise SystemExit(f"{path} not found: build the rdzv_bench and ddprun-rdzvd targets first")

    results = []
    for n in [int(s) for s in args.sizes.split(",") if s]:
        reps = args.reps if n <= 4096 else 1
        runs = []
        for _ in range(reps):
            r = run_one(bench, daemon, n, args.timeout)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if "skipped" in r:
                break
            runs.append(r)
        if not runs:
            results.append(r)
            continue
        results.append({
            "nodes": n,
            "ms": summarize([x["last_join_to_all_assigned_ms"] for x in runs]),
            "setup_s": summarize([x["setup_s"] for x in runs]),
            "rss_kib": summarize([x["daemon_rss_kib"] for x in runs]),
            "hwm_kib": summarize([x["daemon_hwm_kib"] for x in runs]),
            "raw": runs,
        })

    reps_text = f"{args.reps} runs" + (" (1 above N = 4096)" if args.reps > 1 else "")
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.node() or "unknown host",
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "command": "python3 bench/rendezvous/run.py --bin-dir build/bin --update-doc docs/performance.md",
        "reps_text": reps_text,
        "fd_limit": hard,
    }
    md = markdown(results, meta)
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "goals_ms": GOALS_MS, "results": results}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md + "\n")
    if args.update_doc:
        update_doc(args.update_doc, md)


if __name__ == "__main__":
    main()
