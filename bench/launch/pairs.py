#!/usr/bin/env python3
"""Paired launch measurement: ddprun against the posix_spawn floor, rep by rep.

For each N, runs `spawn_floor N /bin/true` and `ddprun --standalone --nproc-per-node N
--no-python /bin/true` in turn (each rep takes the next of all the orders of the launchers, so
that none always runs in the same place: with three, the one always in the middle of an order
that only flipped was 0.03-0.09 ms slower than an identical copy of it), each started with posix_spawn and reaped with wait4, and records per run the wall time
and the CPU time (user + sys of the launcher, every process it reaped, and every process it left
to finish after its exit, such as ddprun's containment watchdog: see orphans.py).
CPU time is much less sensitive to other jobs on a shared box than wall time. Prints, per N, the
medians and the median of the pair-by-pair ratios ddprun / floor.

With --before OTHER_DDPRUN a second ddprun build (e.g. the previous commit's) joins the rotation,
so a change is measured against the floor and against its predecessor in the same minutes.

Usage: pairs.py --ddprun build/bin/ddprun [--before old/ddprun] [--floor .../spawn_floor]
       [--sizes 1,8,64] [--reps 15] [--json out.json] [-- extra ddprun flags]
"""
import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import orphans  # noqa: E402  (bench/launch)


def run(argv, env):
    with orphans.adopting():
        t0 = time.perf_counter()
        pid = os.posix_spawn(argv[0], argv, env,
                             file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                                           (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
                                           (os.POSIX_SPAWN_OPEN, 2, "/dev/null", os.O_WRONLY, 0)])
        _, status, ru = os.wait4(pid, 0)
        wall = (time.perf_counter() - t0) * 1e3
        left_cpu, _ = orphans.reap()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv} exited {os.waitstatus_to_exitcode(status)}")
    return wall, (ru.ru_utime + ru.ru_stime) * 1e3 + left_cpu


def med(xs):
    return statistics.median(xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ddprun", required=True)
    ap.add_argument("--floor")
    ap.add_argument("--before", help="a second ddprun binary measured in the same rotation")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json")
    ap.add_argument("extra", nargs="*", help="extra ddprun flags (after --)")
    a = ap.parse_args()
    ddprun = os.path.abspath(a.ddprun)
    floor = a.floor or os.path.join(os.path.dirname(ddprun), "spawn_floor")
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reps": a.reps,
           "load_before": os.getloadavg()[0], "sizes": {}}
    kinds = ["floor", "ddprun"] + (["before"] if a.before else [])
    head = "| N | floor wall | ddprun wall | wall ratio | floor CPU | ddprun CPU | CPU ratio |"
    if a.before:
        head += " before wall | before CPU | before wall ratio | before CPU ratio |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for n in [int(x) for x in a.sizes.split(",")]:
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, TMPDIR=d)
            def ddprun_cmd(binary):
                return [binary, "--standalone", f"--nproc-per-node={n}", *a.extra, "--no-python", "/bin/true"]
            cmds = {"floor": [floor, str(n), "/bin/true"], "ddprun": ddprun_cmd(ddprun)}
            if a.before:
                cmds["before"] = ddprun_cmd(os.path.abspath(a.before))
            res = {k: [] for k in kinds}
            for k in kinds[1:]:
                run(cmds[k], env)  # warm the page cache once
            orders = list(itertools.permutations(kinds))
            for i in range(a.reps):
                for k in orders[i % len(orders)]:
                    res[k].append(run(cmds[k], env))
        row = {"runs": res}
        fw = [w for w, _ in res["floor"]]
        fc = [c for _, c in res["floor"]]
        row["floor_wall_ms"], row["floor_cpu_ms"] = med(fw), med(fc)
        for k in kinds[1:]:
            w = [x for x, _ in res[k]]
            c = [x for _, x in res[k]]
            row[f"{k}_wall_ms"], row[f"{k}_cpu_ms"] = med(w), med(c)
            row[f"{k}_wall_ratio"] = med([b / x for x, b in zip(fw, w)])
            row[f"{k}_cpu_ratio"] = med([b / max(x, 1e-3) for x, b in zip(fc, c)])
        out["sizes"][n] = row
        line = (f"| {n} | {row['floor_wall_ms']:.2f} | {row['ddprun_wall_ms']:.2f} | {row['ddprun_wall_ratio']:.2f}x | "
                f"{row['floor_cpu_ms']:.1f} | {row['ddprun_cpu_ms']:.1f} | {row['ddprun_cpu_ratio']:.2f}x |")
        if a.before:
            line += (f" {row['before_wall_ms']:.2f} | {row['before_cpu_ms']:.1f} | {row['before_wall_ratio']:.2f}x |"
                     f" {row['before_cpu_ratio']:.2f}x |")
        print(line, flush=True)
    out["load_after"] = os.getloadavg()[0]
    print(f"load average {out['load_before']:.1f} before, {out['load_after']:.1f} after", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
