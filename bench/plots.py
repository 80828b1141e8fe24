#!/usr/bin/env python3
"""Draws docs/img/*.png from the benchmark JSON files with gnuplot (gnuplot-nox), so that every
plotted point is a measured median (error bars: min-max of the same runs) and nothing is drawn by
hand. Run by scripts/bench after a full run:

  /usr/bin/python3 bench/plots.py --results bench/results --tag full --out-dir docs/img

Writes launch.png (whole command vs N, log-log), launch-ratio.png (ddprun / floor vs N, wall
and CPU, with the 1.25x goal), rendezvous.png (round close and setup vs N, with
the least-squares line of bench/rendezvous/run.py), restart.png (crash -> group restarted, log y)
and store.png (serial p50 latency by server and client). A missing JSON skips its plot.
"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile

LAUNCH_KINDS = [("floor", "floor (posix_spawn + wait)"), ("ddprun", "ddprun"), ("mpirun", "mpirun"),
                ("torchrun_mi0.1", "torchrun 1.13, mi 0.1"), ("torchrun_mi5", "torchrun 1.13, mi 5"),
                ("torchrun2_mi0.1", "torchrun 2.6, mi 0.1")]
HEAD = ("set terminal pngcairo size 900,560 font 'DejaVu Sans,11'\n"
        "set termoption noenhanced\nset grid\nset key top left\n")


def load(results, name, tag):
    path = os.path.join(results, f"{name}-{tag}.json")
    if not os.path.exists(path):
        print(f"plots: {path} missing, its plot is skipped")
        return None
    with open(path) as f:
        return json.load(f)


def gnuplot(script, out):
    with tempfile.NamedTemporaryFile("w", suffix=".gp", delete=False) as f:
        f.write(f"set output '{out}'\n" + script)
        name = f.name
    try:
        subprocess.run(["gnuplot", name], check=True)
    finally:
        os.unlink(name)
    print(f"plots: wrote {out}")


def launch_plot(r, out):
    ns = sorted({int(k.split("/")[1]) for k in r["launch"]})
    blocks, plots = [], []
    for kind, label in LAUNCH_KINDS:
        rows = [(n, r["launch"][f"{kind}/{n}"]["total_ms"]) for n in ns
                if "total_ms" in r["launch"].get(f"{kind}/{n}", {})]
        if not rows:
            continue
        blocks.append("\n".join(f"{n} {s['median']} {s['min']} {s['max']}" for n, s in rows))
        i = len(blocks) - 1
        plots.append(f"'$data' index {i} using 1:2:3:4 with yerrorlines title '{label}'")
    data = "$data << EOD\n" + "\n\n\n".join(blocks) + "\nEOD\n"
    gnuplot(HEAD + data +
            f"set title 'Whole command, N x /bin/true ({r['machine']['cpus']} vCPU, {r['date'][:10]})'\n"
            "set logscale xy\nset xlabel 'workers N'\nset ylabel 'ms (median, bars min-max)'\n"
            f"set xtics ({', '.join(str(n) for n in ns)})\nset key top left\n"
            "plot " + ", ".join(plots) + "\n", out)


def launch_ratio_plot(r, out):
    """ddprun / floor vs N, wall and CPU time (pair-by-pair medians, bars min-max), against the
    1.25x goal of issue 18."""
    ns = sorted({int(k.split("/")[1]) for k in r["launch"]})
    blocks, plots = [], []
    for key, label in (("ddprun_over_floor", "wall time"), ("ddprun_over_floor_cpu", "CPU time (user + sys)")):
        rows = [(n, r["launch"][f"floor/{n}"][key]) for n in ns if key in r["launch"].get(f"floor/{n}", {})]
        if rows:
            blocks.append("\n".join(f"{n} {s['median']} {s['min']} {s['max']}" for n, s in rows))
            plots.append(f"'$data' index {len(blocks) - 1} using 1:2:3:4 with yerrorlines title 'ddprun / floor, {label}'")
    if not blocks:
        return
    data = "$data << EOD\n" + "\n\n\n".join(blocks) + "\nEOD\n"
    gnuplot(HEAD + data +
            f"set title 'ddprun / spawn floor, N x /bin/true, paired runs ({r['machine']['cpus']} vCPU, {r['date'][:10]})'\n"
            "set logscale x\nset xlabel 'workers N'\nset ylabel 'ratio (median of pairs, bars min-max)'\n"
            f"set xtics ({', '.join(str(n) for n in ns)})\nset xrange [0.8:{max(ns) * 1.25}]\nset yrange [0.8:*]\nset key top right\n"
            "plot " + ", ".join(plots) + ", 1.25 with lines dt 2 lw 2 title 'goal: 1.25x', "
            "1 with lines lt 0 title 'floor'\n", out)


def rdzv_plot(r, out):
    rows = [x for x in r["results"] if "skipped" not in x]
    close = "\n".join(f"{x['nodes']} {x['ms']['median']} {x['ms']['min']} {x['ms']['max']}" for x in rows)
    setup = "\n".join(f"{x['nodes']} {x['setup_s']['median'] * 1e3} {x['setup_s']['min'] * 1e3} "
                      f"{x['setup_s']['max'] * 1e3}" for x in rows)
    fit = (r["meta"].get("fits") or {}).get("close")
    extra = ""
    if fit:
        extra = (f", [{fit.get('n_min', 16)}:{fit.get('n_max', 10000)}] {fit['intercept_ms']} + "
                 f"{fit['per_agent_us'] / 1e3} * x with lines dt 2 "
                 f"title sprintf('least squares: %.1f µs per agent', {fit['per_agent_us']})")
    gnuplot(HEAD + f"$close << EOD\n{close}\nEOD\n$setup << EOD\n{setup}\nEOD\n"
            f"set title 'ddprun-rdzvd native rendezvous, N simulated agents ({r['meta']['date']})'\n"
            "set logscale xy\nset xlabel 'agents N'\nset ylabel 'ms (median, bars min-max)'\n"
            "plot '$close' using 1:2:3:4 with yerrorlines title 'last join -> all assigned', "
            "'$setup' using 1:2:3:4 with yerrorlines title 'setup: connect + N-1 joins'" + extra + "\n",
            out)


def restart_plot(launch, elastic, out):
    bars = []
    if launch:
        for kind, v in launch["restart"].items():
            s = v["restart_ms"]
            bars.append((f"1 node x 8: {dict(LAUNCH_KINDS).get(kind, kind)}", s["median"], s["min"], s["max"]))
    if elastic:
        for kind, v in elastic["restart"].items():
            s = v["last_ms"]
            bars.append((f"3 nodes x 2: {dict(LAUNCH_KINDS).get(kind, kind)}", s["median"], s["min"], s["max"]))
    if not bars:
        return
    data = "\n".join(f"{i} {m} {lo} {hi} \"{name}\"" for i, (name, m, lo, hi) in enumerate(bars))
    gnuplot(HEAD + f"$data << EOD\n{data}\nEOD\n"
            "set title 'Crash -> group restarted (1 node: first new worker; 3 nodes: all 6 new workers)'\n"
            "set logscale y\nset ylabel 'ms (median, bars min-max)'\nset style fill solid 0.5\n"
            "set boxwidth 0.6\nset xtics rotate by -30 left\nset bmargin 9\nset key off\n"
            "set yrange [1:*]\n"
            "plot '$data' using 1:2:xtic(5) with boxes, '' using 1:2:3:4 with yerrorbars\n", out)


def store_plot(r, out):
    rows = [x for x in r["results"] if x["kind"] == "serial" and x["unit"] == "p50_us"]
    if not rows:
        return
    names = []
    for x in rows:
        if (x["server"], x["client"]) not in names:
            names.append((x["server"], x["client"]))
    lines = []
    for i, (server, client) in enumerate(names):
        v = {x["what"]: x for x in rows if x["server"] == server and x["client"] == client}
        g, a = v.get("get"), v.get("add")
        lines.append(f"{i} {g['median'] if g else 'NaN'} {g['min'] if g else 'NaN'} {g['max'] if g else 'NaN'} "
                     f"{a['median'] if a else 'NaN'} {a['min'] if a else 'NaN'} {a['max'] if a else 'NaN'} "
                     f"\"{server} / {client}\"")
    gnuplot(HEAD + "$data << EOD\n" + "\n".join(lines) + "\nEOD\n"
            "set title 'Store: serial p50 latency, one client (median, bars min-max)'\n"
            "set ylabel 'µs'\nset style data histograms\nset style histogram errorbars gap 1 lw 1\n"
            "set style fill solid 0.5\nset xtics rotate by -30 left\nset bmargin 10\nset key top right\n"
            "set yrange [0:*]\n"
            "plot '$data' using 2:3:4:xtic(8) title 'get', '' using 5:6:7 title 'add'\n", out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="full")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    if shutil.which("gnuplot") is None:
        raise SystemExit("plots: gnuplot not found: run scripts/setup (installs gnuplot-nox)")
    os.makedirs(args.out_dir, exist_ok=True)
    launch = load(args.results, "launch", args.tag)
    elastic = load(args.results, "elastic", args.tag)
    rdzv = load(args.results, "rdzv", args.tag)
    store = load(args.results, "store", args.tag)
    if launch:
        launch_plot(launch, os.path.join(args.out_dir, "launch.png"))
        launch_ratio_plot(launch, os.path.join(args.out_dir, "launch-ratio.png"))
    if rdzv:
        rdzv_plot(rdzv, os.path.join(args.out_dir, "rendezvous.png"))
    if launch or elastic:
        restart_plot(launch, elastic, os.path.join(args.out_dir, "restart.png"))
    if store:
        store_plot(store, os.path.join(args.out_dir, "store.png"))


if __name__ == "__main__":
    main()
