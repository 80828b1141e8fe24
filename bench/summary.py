#!/usr/bin/env python3
"""Generates the figures of docs/performance.md's "Limits and where it goes next" section from the
benchmark JSON files (bench/results/*-full.json), between the limits-bench markers: the prose
around the block only refers to these figures, it never types them.

  /usr/bin/python3 bench/summary.py --results bench/results --tag full [--update-doc docs/performance.md]
"""
import argparse
import json
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from doc_block import update_doc as write_doc_block  # noqa: E402


G2_TEARDOWN_MS = 10.0  # goal G2 of performance-anchors.md (a goal, not a measurement)


def load(results, name, tag):
    path = os.path.join(results, f"{name}-{tag}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def med(entry, key="total_ms"):
    return entry[key]["median"]


NAME = {"torchrun_mi0.1": "torchrun 1.13 (mi 0.1)", "torchrun_mi5": "torchrun 1.13 (mi 5)",
        "torchrun2_mi0.1": "torchrun 2.6 (mi 0.1)"}


def name(kind):
    return NAME.get(kind, kind)


def launch_lines(r):
    out = []
    L = r["launch"]
    ns = sorted({int(k.split("/")[1]) for k in L})
    lo, hi = ns[0], ns[-1]
    if f"ddprun/{hi}" in L and f"floor/{hi}" in L:
        out.append(f"* Launch, whole command: ddprun costs {med(L[f'ddprun/{lo}']) - med(L[f'floor/{lo}']):.1f} ms "
                   f"above the posix_spawn floor at N = {lo} and {med(L[f'ddprun/{hi}']) - med(L[f'floor/{hi}']):.1f} ms "
                   f"at N = {hi} (ddprun / floor pair by pair: {L[f'floor/{hi}']['ddprun_over_floor']['median']:.1f}× "
                   f"at N = {hi}).")
    fit = r.get("per_worker_fit") or {}
    if "ddprun" in fit and "floor" in fit:
        out.append(f"* Per extra worker, ddprun's slope is {fit['ddprun']['slope_ms'] / fit['floor']['slope_ms']:.1f}× "
                   f"the floor's and its fixed part {fit['ddprun']['intercept_ms'] - fit['floor']['intercept_ms']:.1f} ms "
                   f"above the floor's. Least squares over N = {lo}…{hi}: ddprun "
                   f"{fit['ddprun']['slope_ms']:.2f} ms, floor {fit['floor']['slope_ms']:.2f} ms"
                   + (f", mpirun {fit['mpirun']['slope_ms']:.2f} ms (N ≤ {fit['mpirun'].get('n_max', hi)})"
                      if "mpirun" in fit else "")
                   + f"; fixed part: ddprun {fit['ddprun']['intercept_ms']:.1f} ms, floor "
                   f"{fit['floor']['intercept_ms']:.1f} ms.")
    tl = r.get("timeline", {})
    if "ddprun" in tl:
        t = tl["ddprun"]
        out.append(f"* Timeline at {r['timeline_n']} workers, ddprun: first worker "
                   f"{t['first_worker_ms']['median']:.1f} ms, last worker {t['last_worker_ms']['median']:.1f} ms "
                   f"after exec, teardown {t['teardown_ms']['median']:.1f} ms"
                   + "".join(f"; {name(k)}: first {v['first_worker_ms']['median']:.0f} ms, teardown "
                             f"{v['teardown_ms']['median']:.0f} ms" for k, v in tl.items() if k != "ddprun")
                   + ".")
    if "ddprun" in tl and "mpirun" in tl:
        d, m = tl["ddprun"]["teardown_ms"]["median"], tl["mpirun"]["teardown_ms"]["median"]
        out.append(f"* Teardown at {r['timeline_n']} workers: ddprun's is {'below' if d < m else 'above'} "
                   f"mpirun's ({d:.1f} against {m:.1f} ms) and {'within' if d <= G2_TEARDOWN_MS else 'over'} "
                   f"the {G2_TEARDOWN_MS:g} ms goal (performance-anchors.md G2).")
    gens = [k for k in ("torchrun_mi0.1", "torchrun2_mi0.1") if "total_ms" in L.get(f"{k}/{hi}", {})]
    if gens and f"ddprun/{hi}" in L:
        out.append(f"* Whole command at N = {hi}: ddprun {med(L[f'ddprun/{hi}']):.1f} ms"
                   + "".join(f", {name(k)} {med(L[f'{k}/{hi}']) / 1e3:.2f} s "
                             f"({L[f'{k}/{hi}']['over_ddprun']['median']:.0f}× ddprun)" for k in gens) + ".")
    hung = {k: (v["hung"], len(v["runs_ms"])) for k, v in L.items() if k.startswith("mpirun/") and v["hung"]}
    if hung:
        out.append("* mpirun (Open MPI) runs killed as hung: "
                   + ", ".join(f"N = {k.split('/')[1]}: {h} of {n}" for k, (h, n) in sorted(
                       hung.items(), key=lambda kv: int(kv[0].split('/')[1]))) + ".")
    if "restart" in r:
        out.append(f"* Crash → group restarted, one node, 8 workers: ddprun "
                   f"{r['restart']['ddprun']['restart_ms']['median']:.1f} ms"
                   + "".join(f", {name(k)} {v['restart_ms']['median']:.0f} ms" for k, v in r["restart"].items()
                             if k != "ddprun") + ".")
    if "footprint" in r and "ddprun" in r["footprint"]:
        out.append(f"* Agent RSS with 8 sleeping workers: ddprun {r['footprint']['ddprun']['rss_mib']:.1f} MiB"
                   + "".join(f", {name(k)} {v['rss_mib']:.0f} MiB" for k, v in r["footprint"].items() if k != "ddprun")
                   + ".")
    return out


def elastic_lines(r):
    out = []
    nl = r["node_loss"]
    out.append("* Node loss (ddprun, default heartbeats): survivors' first new worker "
               + ", ".join(f"{v['first_ms']['median']:.0f} ms after {how}" for how, v in nl.items()) + ".")
    rs = r["restart"]
    out.append("* Crash → group restarted, 3 nodes × 2 workers, all 6 new workers: "
               + ", ".join(f"{name(k)} {v['last_ms']['median']:.0f} ms" for k, v in rs.items()) + ".")
    for k, v in r.get("torch_kill", {}).items():
        what = ("no new worker" if v["first_new_worker_ms"] is None
                else f"a new worker after {v['first_new_worker_ms']:.0f} ms")
        out.append(f"* {name(k)}, one of 3 agents SIGKILLed: {what} within {v['watched_s']:.0f} s; "
                   f"{v['survivors_running']} of 2 survivor agents still running.")
    return out


def rdzv_lines(r):
    out = []
    fits = r["meta"].get("fits") or {}
    rows = [x for x in r["results"] if "skipped" not in x]
    c, s = fits.get("close"), fits.get("setup")
    if c:
        out.append(f"* Rendezvous round close: {c['per_agent_us']:.1f} µs per agent (least squares on "
                   f"relative residuals, largest {100 * c['max_rel_residual']:.0f} %)" + ("; linear over the range" if c["superlinear_from"] is None else
                   f"; superlinear from N = {c['superlinear_from']['from']}") + ".")
    if s:
        bend = s["superlinear_from"]
        last = rows[-1]
        out.append(f"* Rendezvous setup (connect + joins): "
                   + (f"superlinear from N = {bend['from']}→{bend['to']} (local exponent {bend['exponent']:.2f}); "
                      if bend else "linear over the range; ")
                   + f"{last['setup_s']['median']:.2f} s for N = {last['nodes']}.")
    goal = r.get("goal_total")
    at_goal = next((x for x in rows if goal and x["nodes"] == goal["nodes"] and "total_s" in x), None)
    model = r["meta"].get("model")
    if at_goal:
        out.append(f"* Rendezvous of {goal['nodes']} agents (connect + auth + joins + close): "
                   f"{at_goal['total_s']['median']:.1f} s (goal ≤ {goal['s']:g} s).")
    elif goal and model:
        cpu = (f"; by CPU time the daemon would need {model['daemon_cpu_s']:.1f} s"
               if model.get("daemon_cpu_s") is not None else "")
        out.append(f"* Rendezvous of {goal['nodes']} agents on one daemon: not measured here (open-files limit "
                   f"{r['meta'].get('fd_limit')}); modelled from N ≤ {model['from_n_max']}: "
                   f"{model['total_s']:.1f} s of wall time{cpu} (goal ≤ {goal['s']:g} s).")
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        per = (b["rss_kib"]["median"] - a["rss_kib"]["median"]) / (b["nodes"] - a["nodes"])
        out.append(f"* Daemon memory: {per:.1f} KiB per extra agent (RSS at N = {b['nodes']}: "
                   f"{b['rss_kib']['median'] / 1024:.1f} MiB).")
    relayed = [x for x in r.get("relay_results", []) if "total_s" in x]
    if relayed:
        x = relayed[-1]
        n = x["nodes"]

        def per_agent(after, idle):
            return (x[after]["median"] - x[idle]["median"]) / n if after in x and idle in x else float("nan")

        def cpu(key):
            setup, close = f"{key}_cpu_setup_s", f"{key}_cpu_close_s"
            return x[setup]["median"] + x[close]["median"] if setup in x and close in x else float("nan")

        goal_text = ""
        if goal and n == goal["nodes"]:
            met = "met" if x["total_s"]["median"] <= goal["s"] else "not met"
            goal_text = f" (goal ≤ {goal['s']:g} s: {met})"
        out.append(f"* Rendezvous through {x['relays']} relays: {n} agents in {x['total_s']['median']:.1f} s"
                   f"{goal_text}; CPU root {cpu('daemon'):.1f} s, relays {cpu('relay'):.1f} s, bench "
                   f"{cpu('bench'):.1f} s; memory per agent: root {per_agent('rss_kib', 'rss_idle_kib'):.2f} KiB, "
                   f"relays {per_agent('relay_rss_kib', 'relay_rss_idle_kib'):.2f} KiB.")
    elif r.get("relay_results"):
        out.append(f"* Rendezvous through relays: {r['relay_results'][0]['skipped']}.")
    return out


def store_lines(r):
    out = []
    rows = {(x["server"], x["client"], x["what"], x["unit"]): x["median"] for x in r["results"]
            if x["kind"] == "serial"}
    g = rows.get(("ddprun-rdzvd", "C++ modern", "get", "p50_us"))
    pg = rows.get(("ddprun-rdzvd", "C++ modern pipelined-get", "get", "p50_us"))
    add = rows.get(("ddprun-rdzvd", "C++ modern", "add", "p50_us"))
    if g and pg and add:
        out.append(f"* Store, serial p50: get (WAIT + GET) {g:.1f} µs, pipelined get {pg:.1f} µs, "
                   f"add {add:.1f} µs.")
    storm = {(x["server"], x["client"], x["what"], x["unit"]): x["median"] for x in r["results"]
             if x["kind"] == "storm"}
    sizes = r["meta"].get("storm_sizes") or []
    if sizes:
        n = str(max(sizes))
        ms = storm.get(("ddprun-rdzvd", "torch 2.6 ranks", n, "ms"))
        kib = storm.get(("ddprun-rdzvd", "torch 2.6 ranks", n, "kib_per_rank"))
        survived = [s for s, c in r["meta"].get("storm_rows", []) if not s.startswith("ddprun")
                    and (s, c, n, "ms") in storm]
        if ms is not None:
            out.append(f"* Store barrier, {int(n):,} torch 2.6 ranks: {ms:,.0f} ms on ddprun-rdzvd"
                       + (f", {kib:.1f} KiB per rank" if kib else "")
                       + f"; torch's servers that survived that size: {', '.join(survived) or 'none'}.")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="full")
    ap.add_argument("--update-doc")
    args = ap.parse_args()
    lines = [f"Figures from `bench/results/*-{args.tag}.json` (`bench/summary.py`), each a median of the "
             "runs in the sections above:", ""]
    for name, fn in (("launch", launch_lines), ("elastic", elastic_lines), ("rdzv", rdzv_lines),
                     ("store", store_lines)):
        r = load(args.results, name, args.tag)
        if r is None:
            lines.append(f"* {name}: no `{name}-{args.tag}.json`.")
            continue
        lines += fn(r)
    md = "\n".join(lines) + "\n"
    print(md)
    if args.update_doc:
        write_doc_block(args.update_doc, "limits-bench", "bench/summary.py", md)


if __name__ == "__main__":
    main()
