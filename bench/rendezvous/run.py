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
import math
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


def growth_fit(results, key, scale):
    """Least squares t = a + b*N over the medians, on relative residuals (weights 1/t^2: the sizes
    span three decades, and plain least squares would fit the largest N only), the largest
    relative residual, and the local exponent k = ln(t2/t1) / ln(N2/N1) between consecutive sizes
    (k ~ 1: linear, ~ 2: quadratic)."""
    pts = [(r["nodes"], r[key]["median"] * scale) for r in results if "skipped" not in r]
    pts = [(x, y) for x, y in pts if y > 0]
    if len(pts) < 3:
        return None
    ws = [1.0 / (y * y) for _, y in pts]
    sw = sum(ws)
    mx = sum(w * x for w, (x, _) in zip(ws, pts)) / sw
    my = sum(w * y for w, (_, y) in zip(ws, pts)) / sw
    b = (sum(w * (x - mx) * (y - my) for w, (x, y) in zip(ws, pts))
         / sum(w * (x - mx) ** 2 for w, (x, _) in zip(ws, pts)))
    a = my - b * mx
    worst = max(abs(y - (a + b * x)) / y for x, y in pts)
    steps = [{"from": x1, "to": x2, "exponent": math.log(y2 / y1) / math.log(x2 / x1)}
             for (x1, y1), (x2, y2) in zip(pts, pts[1:])]
    bend = next((st for st in steps if st["exponent"] > LINEAR_EXPONENT_MAX), None)
    return {"intercept_ms": a, "per_agent_us": b * 1e3, "max_rel_residual": worst,
            "n_min": pts[0][0], "n_max": pts[-1][0], "steps": steps, "superlinear_from": bend}


LINEAR_EXPONENT_MAX = 1.25  # a local exponent above this counts as "no longer linear"


def fit_text(name, f):
    steps = ", ".join(f"{st['from']}→{st['to']}: {st['exponent']:.2f}" for st in f["steps"])
    if f["superlinear_from"] is None:
        verdict = (f"linear or better over the whole range (every local exponent ≤ "
                   f"{LINEAR_EXPONENT_MAX:g})")
    else:
        st = f["superlinear_from"]
        verdict = (f"stops being linear between N = {st['from']} and {st['to']} (local exponent "
                   f"{st['exponent']:.2f} > {LINEAR_EXPONENT_MAX:g})")
    return (f"* {name}: least squares on relative residuals over the medians, t ≈ "
            f"{f['intercept_ms']:.2f} ms + {f['per_agent_us']:.1f} µs × N (largest residual "
            f"{100 * f['max_rel_residual']:.0f} % of its point); local exponent "
            f"ln(t₂/t₁)/ln(N₂/N₁) between sizes: {steps}; {verdict}.")


def markdown(results, meta):
    lines = [
        f"Measured {meta['date']} on {meta['machine']} ({meta['cpus']} vCPU {meta['cpu_model']}, Linux {meta['kernel']}), "
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
    fits = meta.get("fits") or {}
    if fits:
        lines += ["", "Growth (generated from the medians above):", ""]
        if fits.get("close"):
            lines.append(fit_text("Round close (last join → all assigned)", fits["close"]))
        if fits.get("setup"):
            lines.append(fit_text("Setup (connect + N-1 joins, as ms)", fits["setup"]))
    lines += [
        "",
        "The daemon is idle when the last JOIN is sent (every earlier join has been answered), so",
        "the figure is the round close: ranks, offsets and N ASSIGNMENT frames encoded and written.",
        "The N = 16 row is close to an idle daemon's RSS. The setup column is N connects and N-1",
        "joins from one bench thread; how both columns grow is in the fit above (docs/daemon.md,",
        "\"Limits\", has the daemon's cost per operation).",
    ]
    return "\n".join(lines)


def update_doc(path, md):
    write_doc_block(path, "rdzv-bench", "bench/rendezvous/run.py", md)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", help="build/bin with rdzv_bench and ddprun-rdzvd (required unless --render)")
    ap.add_argument("--sizes", default="16,256,1024,4096,10000")
    ap.add_argument("--reps", type=int, default=3, help="runs per size (sizes above 4096: 1)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--out", default=None, metavar="JSON")
    ap.add_argument("--markdown", default=None, metavar="MD")
    ap.add_argument("--update-doc", default=None, metavar="MD",
                    help="replace the block between the rdzv-bench markers in this file")
    ap.add_argument("--render", metavar="JSON",
                    help="only re-render the markdown (and --update-doc) from a saved --out JSON")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        saved["meta"]["fits"] = {"close": growth_fit(saved["results"], "ms", 1.0),
                                 "setup": growth_fit(saved["results"], "setup_s", 1e3)}
        md = markdown(saved["results"], saved["meta"])
        print(md)
        if args.update_doc:
            update_doc(args.update_doc, md)
        return
    if not args.bin_dir:
        ap.error("--bin-dir is required (unless --render)")
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
        "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                           if l.startswith("model name")), platform.machine()),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "command": " ".join(["bench/rendezvous/run.py"] + sys.argv[1:]),
        "reps_text": reps_text,
        "fd_limit": hard,
    }
    meta["fits"] = {"close": growth_fit(results, "ms", 1.0),
                    "setup": growth_fit(results, "setup_s", 1e3)}
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
