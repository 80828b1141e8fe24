#!/usr/bin/env python3
"""Draws docs/img/*.png from the benchmark JSON files with gnuplot (gnuplot-nox), so that every
plotted point is a measured median (error bars: min-max of the same runs) and nothing is drawn by
hand. Run by scripts/bench after a full run:

  /usr/bin/python3 bench/plots.py --results bench/results --tag full --out-dir docs/img

Writes launch.png (whole command vs N, log-log), launch-ratio.png (ddprun / floor vs N, wall and CPU,
with the 1.25x goal), rendezvous.png (round close, setup and total vs N, with the least-squares line
of bench/rendezvous/run.py, the 100,000-agent goal and its model), rendezvous-relay.png (total vs N, one daemon directly and
a root with relays, against the 10 s goal), restart.png (crash -> group
restarted, log y), store.png (serial p50 latency by server and client), store_barrier.png (the
barrier at scale, ms vs ranks N per server) and fanout-tree.png (SSH launch, flat vs tree: last
worker started and launcher CPU vs hosts). A missing JSON skips its plot.
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
    1.25x goal."""
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
    total = "\n".join(f"{x['nodes']} {x['total_s']['median'] * 1e3} {x['total_s']['min'] * 1e3} "
                      f"{x['total_s']['max'] * 1e3}" for x in rows if "total_s" in x) or "NaN NaN NaN NaN"
    fit = (r["meta"].get("fits") or {}).get("close")
    extra = ""
    if fit:
        extra = (f", [{fit.get('n_min', 16)}:{fit.get('n_max', 10000)}] {fit['intercept_ms']} + "
                 f"{fit['per_agent_us'] / 1e3} * x with lines dt 2 "
                 f"title sprintf('least squares: %.1f µs per agent', {fit['per_agent_us']})")
    blocks = ""
    goal = r.get("goal_total")
    if goal:
        blocks += f"$goal << EOD\n{goal['nodes']} {goal['s'] * 1e3}\nEOD\n"
        extra += f", '$goal' using 1:2 with points pt 6 ps 2 title 'goal: {goal['nodes']} agents, total {goal['s']:g} s'"
    model = r["meta"].get("model")
    if model:
        blocks += f"$model << EOD\n{model['nodes']} {model['total_s'] * 1e3}\nEOD\n"
        extra += (f", '$model' using 1:2 with points pt 8 ps 2 title 'model at {model['nodes']} (not measured): "
                  f"wall-time fit {model['total_s']:.1f} s'")
        if model.get("daemon_cpu_s") is not None:
            blocks += f"$cpu << EOD\n{model['nodes']} {model['daemon_cpu_s'] * 1e3}\nEOD\n"
            extra += (f", '$cpu' using 1:2 with points pt 10 ps 2 title 'model at {model['nodes']}: daemon CPU "
                      f"{model['daemon_cpu_s']:.1f} s'")
    gnuplot(HEAD + blocks + f"$close << EOD\n{close}\nEOD\n$setup << EOD\n{setup}\nEOD\n$total << EOD\n{total}\nEOD\n"
            f"set title 'ddprun-rdzvd native rendezvous, N simulated agents ({r['meta']['date']})'\n"
            "set logscale xy\nset xlabel 'agents N'\nset ylabel 'ms (median, bars min-max)'\n"
            "set xrange [10:300000]\n"
            "plot '$close' using 1:2:3:4 with yerrorlines title 'last join -> all assigned', "
            "'$setup' using 1:2:3:4 with yerrorlines title 'setup: connect + auth + N-1 joins', "
            "'$total' using 1:2:3:4 with yerrorlines title 'total: setup + close'" + extra + "\n",
            out)


def rdzv_relay_plot(r, out):
    """Rendezvous total (connect + auth + joins + close) vs N: one daemon directly, and a root with
    relays (R beside each point), against the 10 s goal for 100,000 agents."""
    series = [("one daemon, direct", [x for x in r["results"] if "total_s" in x]),
              ("root + R relays", [x for x in r.get("relay_results", []) if "total_s" in x])]
    blocks, plots = [], []
    for label, rows in series:
        if not rows:
            continue
        blocks.append("\n".join(f"{x['nodes']} {x['total_s']['median']} {x['total_s']['min']} {x['total_s']['max']} "
                                f"\"{'R=' + str(x['relays']) if x.get('relays') else ''}\"" for x in rows))
        i = len(blocks) - 1
        plots.append(f"'$data' index {i} using 1:2:3:4 with yerrorlines title '{label}'")
        if rows[0].get("relays"):
            plots.append(f"'$data' index {i} using 1:2:5 with labels offset 0,1 notitle")
    if not any(rows for _, rows in series[1:]):
        print("plots: no relay series in the rendezvous JSON, rendezvous-relay.png skipped")
        return
    goal = r.get("goal_total") or {"nodes": 100000, "s": 10.0}
    gnuplot(HEAD + "$data << EOD\n" + "\n\n\n".join(blocks) + "\nEOD\n"
            f"set title 'Rendezvous of N agents, total: connect + auth + joins + close ({r['meta']['cpus']} vCPU, "
            f"{r['meta']['date']})'\n"
            "set logscale xy\nset xlabel 'agents N'\nset ylabel 's (median, bars min-max)'\n"
            "set xrange [10:300000]\nset yrange [*:60]\nset key top left\n"
            f"set arrow from graph 0, first {goal['s']} to graph 1, first {goal['s']} nohead dt 2 lw 2\n"
            f"set label 'goal: {goal['nodes']:,} agents in {goal['s']:g} s' at graph 0.4, first {goal['s'] * 1.3}\n"
            "plot " + ", ".join(plots) + "\n", out)


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


def fanout_tree_plot(r, out):
    """SSH fan-out, flat vs launch tree: last worker started (left) and the launcher's own CPU
    (right) against the host count, one line per fan-out."""
    tree = r.get("tree") or {}
    if not tree:
        return
    ns = sorted(int(n) for n in tree)
    fanouts = sorted({int(f) for e in tree.values() for f in e["tree"]})
    kinds = [("flat", lambda e: (e["flat_last_worker_s"], e["flat_launcher_cpu_s"]))] + [
        (f"tree F={f}", lambda e, f=f: (e["tree"][str(f)]["last_worker_s"], e["tree"][str(f)]["launcher_cpu_s"])
         if str(f) in e["tree"] else None) for f in fanouts]
    blocks, left, right = [], [], []
    for label, get in kinds:
        rows = [(n, get(tree[str(n)])) for n in ns if get(tree[str(n)])]
        blocks.append("\n".join(f"{n} {a['median']} {a['min']} {a['max']} {c['median']} {c['min']} {c['max']}"
                                for n, (a, c) in rows))
        i = len(blocks) - 1
        left.append(f"'$data' index {i} using 1:2:3:4 with yerrorlines title '{label}'")
        right.append(f"'$data' index {i} using 1:5:6:7 with yerrorlines title '{label}'")
    data = "$data << EOD\n" + "\n\n\n".join(blocks) + "\nEOD\n"
    gnuplot(HEAD.replace("size 900,560", "size 1200,520") + data +
            f"set multiplot layout 1,2 title 'SSH launch: flat vs tree, namespaces on one {r['machine']['cpus']}-vCPU "
            "machine (median, bars min-max)'\n"
            f"set xlabel 'hosts'\nset xtics ({', '.join(str(n) for n in ns)})\n"
            "set ylabel 'last worker started (s)'\nset yrange [0:*]\nplot " + ", ".join(left) + "\n"
            "set ylabel 'launcher + its ssh clients, CPU (s)'\nplot " + ", ".join(right) + "\n"
            "unset multiplot\n", out)


def store_barrier_plot(r, out):
    """Barrier at scale: release -> last rank done vs N, one line per server and ranks replayed;
    a size where a server did not survive has no point (the table in performance.md says why)."""
    rows = [x for x in r["results"] if x["kind"] == "storm" and x["unit"] == "ms"]
    if not rows:
        return
    names = [tuple(n) for n in r["meta"].get("storm_rows", [])] or sorted({(x["server"], x["client"]) for x in rows})
    blocks, plots = [], []
    for server, client in names:
        pts = sorted((int(x["what"]), x) for x in rows if x["server"] == server and x["client"] == client)
        if not pts:
            continue
        blocks.append("\n".join(f"{n} {x['median']} {x['min']} {x['max']}" for n, x in pts))
        plots.append(f"'$data' index {len(blocks) - 1} using 1:2:3:4 with yerrorlines title '{server} / {client}'")
    goal = r["meta"].get("storm_goal_ms", 2000)
    gnuplot(HEAD + "$data << EOD\n" + "\n\n\n".join(blocks) + "\nEOD\n"
            f"set title 'Store barrier at scale: release -> last rank done ({r['meta']['cpus']} vCPU, "
            f"{r['meta']['date'][:10]}; no point = did not survive)'\n"
            "set key bottom right\nset xrange [500:30000]\nset logscale xy\nset xlabel 'ranks N'\nset ylabel 'ms (median, bars min-max)'\n"
            f"set arrow from graph 0, first {goal} to graph 1, first {goal} nohead dt 2\n"
            f"set label 'goal {goal:.0f} ms' at graph 0.02, first {goal * 1.15}\n"
            "plot " + ", ".join(plots) + "\n", out)


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
        rdzv_relay_plot(rdzv, os.path.join(args.out_dir, "rendezvous-relay.png"))
    if launch or elastic:
        restart_plot(launch, elastic, os.path.join(args.out_dir, "restart.png"))
    if store:
        store_plot(store, os.path.join(args.out_dir, "store.png"))
        store_barrier_plot(store, os.path.join(args.out_dir, "store_barrier.png"))
    fanout = load(args.results, "fanout", args.tag)
    if fanout:
        fanout_tree_plot(fanout, os.path.join(args.out_dir, "fanout-tree.png"))


if __name__ == "__main__":
    main()
