#!/usr/bin/env python3
"""Single-node launcher benchmark: ddprun vs torchrun 1.13 and 2.6 vs mpirun, side by side in one run.

Measures (each repeated, median with min-max; ratios pair by pair within the run):
  * whole-command time of N x /bin/true for N = 1 ... 64 (--sizes): ddprun --standalone,
    torchrun 1.13 (monitor interval 0.1 and 5), `mpirun -np N` (Open MPI, local, quiet), and the
    floor: a C program (spawn_floor.c) that posix_spawns N /bin/true and reaps them, timed by
    the same harness;
  * timeline at 8 workers: first and last worker started after the launcher's exec, and
    teardown = launcher exit - the last worker's exit (timed_worker.sh logs both);
  * crash -> group restarted: rank 0 exits 1 on attempt 0 while 7 peers block; time from the
    failure to the first worker of attempt 1;
  * agent footprint: RSS and CPU of the launcher process while 8 workers sleep.

torchrun 1.13 runs through bench/launch/torchrun_fixed.py under /usr/bin/python3 (Debian's torch
1.13), with --monitor_interval 5 (its 1.13 default) and 0.1 (current torch default); torchrun 2.6
(Debian trixie's, scripts/torch2/torchrun2, only as root with the cached root; see bench/torch2.py)
at its default 0.1. --quick leaves the interval-5 runs out (about 8 s each) and sweeps N = 2, 8 only.

Usage: run.py --ddprun build/bin/ddprun [--quick] [--sizes 1,2,4] [--out results.json]
       [--markdown out.md] [--update-doc docs/performance.md]
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from doc_block import update_doc as write_doc_block  # noqa: E402
import torch2  # noqa: E402
import orphans  # noqa: E402  (bench/launch)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "timed_worker.sh")
TORCHRUN = os.path.join(HERE, "torchrun_fixed.py")
TORCH_PY = os.environ.get("TORCH_PYTHON", "/usr/bin/python3")


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


MPI_ENV = {  # keep mpirun local and quiet; /bin/true never calls MPI_Init
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl_base_warn_component_unused": "0", "OMPI_MCA_plm": "isolated",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}
# Open MPI 4.1.4 (Debian) often hangs after all of its N /bin/true exited once N >= 32 on this box
# (workers that live a little longer, /bin/sleep 0.5, do not trigger it); a run that takes longer
# than this is killed and counted as hung, not timed.
MPI_HANG_S = 3.0


def launcher_cmd(kind, nproc, extra=(), worker=WORKER):
    """argv for a single-node standalone launch of `nproc` workers of `worker`."""
    if kind == "ddprun":
        return [ARGS.ddprun, "--standalone", f"--nproc-per-node={nproc}", *extra, worker]
    if kind == "floor":
        return [ARGS.floor, str(nproc), worker]
    if kind == "mpirun":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nproc), worker]
    if kind == "torchrun2_mi0.1":
        return [torch2.TORCHRUN2, "--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.1",
                *extra, "--no-python", worker]
    mi = {"torchrun_mi5": "5", "torchrun_mi0.1": "0.1"}[kind]
    return [TORCH_PY, TORCHRUN, "--standalone", f"--nproc_per_node={nproc}",
            f"--monitor_interval={mi}", *extra, "--no_python", worker]


def read_log(path):
    starts, fails, ends = [], [], []
    with open(path) as f:
        for line in f:
            parts = line.split()
            t = float(parts[0])
            if parts[1] == "start":
                restart = int(parts[3].split("=")[1] or 0)
                starts.append((t, restart))
            elif parts[1] == "fail":
                fails.append(t)
            elif parts[1] == "end":
                ends.append(t)
    return starts, fails, ends


def run_once(cmd, env_extra, timeout=120):
    with tempfile.TemporaryDirectory() as d:
        outf = os.path.join(d, "log")
        env = dict(os.environ, OUTF=outf, TMPDIR=d, **env_extra)  # launchers' log dirs go with d
        t0 = time.time()
        p = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=timeout)
        t1 = time.time()
        if p.returncode != 0:
            raise RuntimeError(f"{cmd} exited {p.returncode}: {p.stderr.decode()[-2000:]}")
        starts, fails, ends = read_log(outf)
    return t0, t1, starts, fails, ends


def whole_command_ms(kind, n):
    """One timed run of N x /bin/true: (wall ms, CPU ms) where CPU is user + sys of the launcher
    and every process it reaped (wait4's rusage), plus what it left to finish after its exit
    (orphans.py: ddprun's containment watchdog), much less sensitive to other load on the box
    than the wall time; None when mpirun hung (killed after MPI_HANG_S)."""
    with tempfile.TemporaryDirectory() as d, orphans.adopting():
        env = dict(os.environ, TMPDIR=d, **(MPI_ENV if kind == "mpirun" else {}))
        t0 = time.time()
        p = subprocess.Popen(launcher_cmd(kind, n, worker="/bin/true"), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        limit = MPI_HANG_S if kind == "mpirun" else 120
        timer = threading.Timer(limit, p.kill)
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        wall = (time.time() - t0) * 1e3
        # What the launcher left to finish on its own (ddprun's watchdog removing the cgroups,
        # MPI daemons): its CPU time is the launch's too. A hung mpirun's leftovers are killed.
        hung = kind == "mpirun" and p.returncode == -9 and wall >= limit * 1e3
        try:
            left_cpu, _ = orphans.reap(bound_s=1.0 if hung else 10.0)
        except RuntimeError:
            if not hung:
                raise
            left_cpu = 0.0
        if hung:
            return None
        if p.returncode != 0:
            raise RuntimeError(f"{launcher_cmd(kind, n, worker='/bin/true')} exited {p.returncode}")
        return wall, (ru.ru_utime + ru.ru_stime) * 1e3 + left_cpu


def bench_sweep(kinds, nprocs, reps_for):
    """Whole command, N x /bin/true. Kinds are interleaved rep by rep, so rep i of torchrun pairs
    with rep i of ddprun run moments apart: ratios are taken pair by pair, then summarized."""
    res = {}
    for n in nprocs:
        xs = {k: [] for k in kinds}
        cpu = {k: [] for k in kinds}
        hung = {k: 0 for k in kinds}
        reps = {k: reps_for(k, n) for k in kinds}
        for i in range(max(reps.values())):
            for kind in kinds:
                if i < reps[kind]:
                    v = whole_command_ms(kind, n)
                    if v is None:
                        hung[kind] += 1
                    xs[kind].append(None if v is None else v[0])
                    cpu[kind].append(None if v is None else v[1])
        for kind in kinds:
            if reps[kind] == 0:
                continue
            ok = [v for v in xs[kind] if v is not None]
            entry = {"runs_ms": xs[kind], "cpu_runs_ms": cpu[kind], "hung": hung[kind]}
            if ok:
                entry["total_ms"] = summary(ok)
                entry["cpu_ms"] = summary([c for c in cpu[kind] if c is not None])
            if kind != "ddprun":
                pairs = [(a, b) for a, b in zip(xs[kind], xs["ddprun"]) if a is not None]
                if pairs:
                    key = "ddprun_over_floor" if kind == "floor" else "over_ddprun"
                    entry[key] = summary([b / a if kind == "floor" else a / b for a, b in pairs])
                if kind == "floor":
                    cpairs = [(a, b) for a, b in zip(cpu[kind], cpu["ddprun"]) if a and b]
                    if cpairs:
                        entry["ddprun_over_floor_cpu"] = summary([b / a for a, b in cpairs])
            res[f"{kind}/{n}"] = entry
            med = entry.get("total_ms", {}).get("median", float("nan"))
            print(f"launch {kind:15s} N={n:3d}: total {med:8.1f} ms"
                  + (f" ({hung[kind]} hung)" if hung[kind] else ""), flush=True)
    return res


def bench_timeline(kinds, n, reps):
    """First worker started, last worker started, teardown (last worker's exit -> launcher exit),
    with workers that log their times (timed_worker.sh)."""
    res = {}
    for kind in kinds:
        first, last, teardown = [], [], []
        for _ in range(reps[kind]):
            try:
                t0, t1, starts, _, ends = run_once(launcher_cmd(kind, n),
                                                   MPI_ENV if kind == "mpirun" else {},
                                                   timeout=20 if kind == "mpirun" else 120)
            except subprocess.TimeoutExpired:
                if kind != "mpirun":
                    raise
                continue  # an mpirun hang (see MPI_HANG_S): no timeline for that rep
            assert len(starts) == n and len(ends) == n, (kind, n, starts, ends)
            first.append((min(s for s, _ in starts) - t0) * 1e3)
            last.append((max(s for s, _ in starts) - t0) * 1e3)
            teardown.append((t1 - max(ends)) * 1e3)
        res[kind] = {"first_worker_ms": summary(first), "last_worker_ms": summary(last),
                     "teardown_ms": summary(teardown)}
        print(f"timeline {kind:15s} N={n}: first {statistics.median(first):8.1f} ms, last "
              f"{statistics.median(last):8.1f} ms, teardown {statistics.median(teardown):8.1f} ms",
              flush=True)
    return res


def bench_restart(kinds, reps):
    res = {}
    for kind in kinds:
        xs = []
        for _ in range(reps[kind]):
            extra = ["--max-restarts=1"] if kind == "ddprun" else ["--max_restarts=1"]
            _, _, starts, fails, _ = run_once(launcher_cmd(kind, 8, extra), {"FAIL_ONCE": "1"})
            restarted = [s for s, r in starts if r == 1]
            assert fails and restarted, (kind, starts, fails)
            xs.append((min(restarted) - fails[0]) * 1e3)
        res[kind] = {"restart_ms": summary(xs)}
        print(f"restart {kind:15s}: {statistics.median(xs):8.1f} ms", flush=True)
    return res


def proc_stats(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    return rss, ticks


def bench_footprint(kinds, window_s):
    res = {}
    hz = os.sysconf("SC_CLK_TCK")
    for kind in kinds:
        with tempfile.TemporaryDirectory() as d:
            outf = os.path.join(d, "log")
            env = dict(os.environ, OUTF=outf, HOLD="1", TMPDIR=d)
            p = subprocess.Popen(launcher_cmd(kind, 8), env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                deadline = time.time() + 60
                while time.time() < deadline:  # readiness: all 8 workers logged their start
                    if os.path.exists(outf) and sum(1 for _ in open(outf)) >= 8:
                        break
                    time.sleep(0.05)
                else:
                    raise RuntimeError(f"{kind}: workers did not start")
                time.sleep(0.5)
                rss0, t0 = proc_stats(p.pid)
                time.sleep(window_s)
                rss1, t1 = proc_stats(p.pid)
            finally:
                os.killpg(p.pid, 9)
                p.wait()
        cpu_pct = 100.0 * (t1 - t0) / hz / window_s
        res[kind] = {"rss_mib": max(rss0, rss1) / 1024.0, "idle_cpu_pct": cpu_pct}
        print(f"footprint {kind:15s}: RSS {max(rss0, rss1)/1024:.1f} MiB, idle CPU {cpu_pct:.2f} %",
              flush=True)
    return res


def fmt(s, digits=1):
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


LABEL = {"floor": "floor", "ddprun": "ddprun", "mpirun": "mpirun", "torchrun_mi0.1": "torchrun 1.13 mi 0.1",
         "torchrun_mi5": "torchrun 1.13 mi 5", "torchrun2_mi0.1": "torchrun 2.6 mi 0.1"}


def cell(entry, key="total_ms", digits=1):
    if entry is None:
        return "–"
    if key not in entry:
        return f"hung {entry.get('hung', 0)}/{len(entry.get('runs_ms', []))}"
    s = entry[key]
    text = fmt(s, digits) if s["n"] > 1 else f"{s['median']:.{digits}f} (n = 1)"
    if entry.get("hung"):
        text += f", hung {entry['hung']}/{len(entry['runs_ms'])}"
    return text


def ratio_cell(entry, key, digits=1):
    if entry is None or key not in entry:
        return "–"
    s = entry[key]
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}×"
    return f"{s['median']:.{digits}f}× ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def markdown(r):
    lines = []
    m = r["machine"]
    label = dict(LABEL)
    if m.get("torch2", "").startswith("2.") and not m["torch2"].startswith("2.6"):
        label["torchrun2_mi0.1"] = f"torchrun {'.'.join(m['torch2'].split('.')[:2])} mi 0.1"
    lines.append(f"Measured {r['date']} with `{r['command']}` on {m['cpus']} vCPU ({m['cpu_model']}), "
                 f"kernel {m['kernel']}, Python {m['python']}, torch {m['torch']}"
                 + (f" and {m['torch2']} ({m.get('torch2_from', 'Debian trixie, in a chroot')})" if m.get("torch2", "").startswith("2.")
                    else f"; torchrun 2.6 not measured: {m['torch2']}" if m.get("torch2") else "")
                 + f", {m['mpirun']}; "
                 f"{'quick' if r['quick'] else 'full'} run; median (min–max) of the runs; load "
                 f"average {r['load_before']:.1f} before, {r['load_after']:.1f} after; whole run "
                 f"{r['whole_run_s']:.0f} s.\n")
    ns = sorted({int(k.split("/")[1]) for k in r["launch"]})
    kinds = [k for k in label if any(f"{k}/{n}" in r["launch"] for n in ns)]
    reps = {k: max(len(r["launch"][f"{k}/{n}"]["runs_ms"]) for n in ns if f"{k}/{n}" in r["launch"])
            for k in kinds}
    def ran_at(k):
        at = [n for n in ns if f"{k}/{n}" in r["launch"]]
        return "" if at == ns else f" at N = {', '.join(map(str, at))} only"
    lines.append("**Whole command**, N × `/bin/true`, ms (runs per N: "
                 + ", ".join(f"{label[k]} ≤ {reps[k]}{ran_at(k)}" for k in kinds)
                 + "; mpirun runs that hang are killed after "
                 + f"{r['mpi_hang_s']:g} s and counted, not timed):\n")
    lines.append("| N | " + " | ".join(label[k] for k in kinds) + " |")
    lines.append("|---" * (len(kinds) + 1) + "|")
    for n in ns:
        lines.append(f"| {n} | " + " | ".join(cell(r["launch"].get(f"{k}/{n}")) for k in kinds) + " |")
    lines.append("")
    lines.append("**Ratios**, computed pair by pair (rep i of a launcher against rep i of ddprun, "
                 "run moments apart), median (min–max); the goal is ddprun / floor ≤ 1.25×"
                 "; CPU time = user + sys of the launcher, all it reaped (wait4) and what it left to finish "
                 "after its exit (ddprun's containment watchdog, adopted as a child subreaper), "
                 "which other load on the box disturbs much less than the wall time:\n")
    others = [k for k in kinds if k not in ("ddprun", "floor")]
    has_cpu = any("ddprun_over_floor_cpu" in r["launch"].get(f"floor/{n}", {}) for n in ns)
    heads = ["N", "ddprun / floor"] + (["ddprun / floor, CPU time"] if has_cpu else [])
    heads += [f"{label[k]} / ddprun" for k in others]
    lines.append("| " + " | ".join(heads) + " |")
    lines.append("|---" * (len(others) + 2 + (1 if has_cpu else 0)) + "|")
    for n in ns:
        row = [ratio_cell(r["launch"].get(f"floor/{n}"), "ddprun_over_floor", 2)]
        if has_cpu:
            row.append(ratio_cell(r["launch"].get(f"floor/{n}"), "ddprun_over_floor_cpu", 2))
        row += [ratio_cell(r["launch"].get(f"{k}/{n}"), "over_ddprun") for k in others]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    fit = r.get("per_worker_fit")
    if fit:
        lines.append("")
        lines.append("Least-squares line through the medians, whole command = a + b·N: "
                     + "; ".join(f"{label[k]} b = {v['slope_ms']:.2f} ms/worker, a = {v['intercept_ms']:.1f} ms"
                                 + (f" (N ≤ {v['n_max']}: the runs that did not hang)"
                                    if v.get('n_max', max(ns)) < max(ns) else "")
                                 for k, v in fit.items()) + ".")
    lines.append("")
    n_t = r["timeline_n"]
    lines.append(f"**Timeline**, {n_t} workers of `timed_worker.sh` (which logs `date +%s.%N` on entry "
                 "and again just before it exits), ms after the launcher's exec; teardown = launcher "
                 "exit − the last worker's exit line:\n")
    lines.append("| launcher | first worker started | last worker started | teardown |")
    lines.append("|---|---|---|---|")
    for kind, v in r["timeline"].items():
        lines.append(f"| {label[kind]} | {fmt(v['first_worker_ms'])} | {fmt(v['last_worker_ms'])} | "
                     f"{fmt(v['teardown_ms'])} |")
    lines.append("")
    lines.append("| crash → group restarted (8 workers, one node) | ms | / ddprun |")
    lines.append("|---|---|---|")
    base = r["restart"]["ddprun"]["restart_ms"]["median"]
    for kind, v in r["restart"].items():
        ratio = "" if kind == "ddprun" else f"{v['restart_ms']['median'] / base:.0f}×"
        lines.append(f"| {label[kind]} | {fmt(v['restart_ms'])} | {ratio} |")
    lines.append("")
    lines.append(f"| agent with 8 sleeping workers ({r['footprint_window_s']:g} s window) | RSS (MiB) | idle CPU (% of a core) |")
    lines.append("|---|---|---|")
    for kind, v in r["footprint"].items():
        lines.append(f"| {label[kind]} | {v['rss_mib']:.1f} | {v['idle_cpu_pct']:.2f} |")
    return "\n".join(lines) + "\n"


def linear_fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--ddprun", help="the ddprun binary (required unless --render)")
    ap.add_argument("--floor", help="spawn_floor binary (default: next to --ddprun)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", help="worker counts N for the whole-command sweep "
                    "(default 1,2,4,8,16,32,64; quick 2,8)")
    ap.add_argument("--no-mpirun", action="store_true", help="leave mpirun out")
    ap.add_argument("--kinds", help="launchers besides the floor, comma-separated (default "
                    "ddprun,mpirun,torchrun_mi0.1,torchrun_mi5 and, as root with the torch 2.x root, "
                    "torchrun2_mi0.1; quick without torchrun_mi5)")
    ap.add_argument("--out")
    ap.add_argument("--markdown")
    ap.add_argument("--update-doc", metavar="MD",
                    help="replace the launch-bench block of this file (docs/performance.md)")
    ap.add_argument("--render", metavar="JSON",
                    help="only re-render the markdown (and --update-doc) from a saved --out JSON")
    ARGS = ap.parse_args()
    if ARGS.render:
        with open(ARGS.render) as f:
            md = markdown(json.load(f))
        print(md)
        if ARGS.update_doc:
            update_doc(ARGS.update_doc, md)
        return
    if not ARGS.ddprun:
        ap.error("--ddprun is required (unless --render)")
    ARGS.ddprun = os.path.abspath(ARGS.ddprun)
    ARGS.floor = ARGS.floor or os.path.join(os.path.dirname(ARGS.ddprun), "spawn_floor")
    t_start = time.time()
    load_before = os.getloadavg()[0]

    have_mpi = not ARGS.no_mpirun and shutil.which("mpirun") is not None
    have_torch2, torch2_version = torch2.available()
    if not have_torch2:
        print(f"launch: torchrun 2.6 left out: {torch2_version}", flush=True)
    if ARGS.quick:
        # torchrun at monitor interval 5 costs ~8 s a run: the quick run keeps it out.
        kinds = ["ddprun", "torchrun_mi0.1"]
        nprocs = [2, 8]
        reps = {"floor": 3, "ddprun": 3, "mpirun": 3, "torchrun_mi0.1": 1, "torchrun2_mi0.1": 1}
        window = 0.5
    else:
        kinds = ["ddprun", "torchrun_mi0.1", "torchrun_mi5"]
        nprocs = [1, 2, 4, 8, 16, 32, 64]
        reps = {"floor": 10, "ddprun": 10, "mpirun": 5, "torchrun_mi0.1": 3, "torchrun_mi5": 2,
                "torchrun2_mi0.1": 3}
        window = 3.0
    if have_torch2:
        kinds.append("torchrun2_mi0.1")
    if ARGS.sizes:
        nprocs = [int(x) for x in ARGS.sizes.split(",") if x]
    if ARGS.kinds:
        wanted = ARGS.kinds.split(",")
        have_mpi = have_mpi and "mpirun" in wanted
        kinds = ["ddprun"] + [k for k in wanted if k.startswith("torchrun")
                              and (have_torch2 or not k.startswith("torchrun2"))]
    sweep_kinds = ["floor", "ddprun"] + (["mpirun"] if have_mpi else []) + kinds[1:]
    # quick: torchrun's timeline (one more 3 s run) is left out; its code path is ddprun's.
    timeline_kinds = ["ddprun"] + (["mpirun"] if have_mpi else []) + ([] if ARGS.quick else kinds[1:])

    def reps_for(kind, n):
        if kind == "mpirun" and n >= 32 and not ARGS.quick:
            return 3  # mostly hangs there (MPI_HANG_S each)
        if kind == "torchrun_mi5" and n not in (1, 8, 64) and n in (1, 2, 4, 8, 16, 32, 64):
            return 0  # ~8 s a run whatever N is (the monitor's sleep): the ends and 8 only
        if kind in ("torchrun_mi0.1", "torchrun2_mi0.1") and n > 8 and not ARGS.quick:
            return 2
        if ARGS.quick and kind.startswith("torchrun") and n != max(nprocs):
            return 0  # quick: torchrun (2-4 s a run) only at the largest N
        return reps[kind]

    torch_version = subprocess.run(
        [TORCH_PY, "-c", "import importlib.metadata as m; print(m.version('torch'))"],  # no `import torch` (1 s)
        capture_output=True, text=True).stdout.strip()
    mpi_version = "no mpirun"
    if have_mpi:
        mpi_version = subprocess.run(["mpirun", "--version"], capture_output=True,
                                     text=True).stdout.splitlines()[0].strip()
    cpu_model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                      if l.startswith("model name")), platform.machine())
    r = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["bench/launch/run.py"] + sys.argv[1:]),
        "quick": ARGS.quick,
        "machine": {"cpus": os.cpu_count(), "cpu_model": cpu_model, "kernel": platform.release(),
                    "python": platform.python_version(), "torch": torch_version,
                    "torch2": torch2_version, "torch2_from": torch2.FROM,
                    "mpirun": mpi_version},
        "mpi_hang_s": MPI_HANG_S,
        "launch": bench_sweep(sweep_kinds, nprocs, reps_for),
        "timeline_n": 8,
    }
    r["timeline"] = bench_timeline(timeline_kinds, 8, reps)
    r["restart"] = bench_restart(kinds, reps)
    r["footprint"] = bench_footprint(["ddprun"] if ARGS.quick else kinds, window)
    r["footprint_window_s"] = window
    if len(nprocs) >= 3:
        fit = {}
        for kind in ("floor", "ddprun", "mpirun"):
            pts = [(n, r["launch"][f"{kind}/{n}"]["total_ms"]["median"]) for n in nprocs
                   if "total_ms" in r["launch"].get(f"{kind}/{n}", {})]
            if len(pts) >= 3:
                a, b = linear_fit([p[0] for p in pts], [p[1] for p in pts])
                fit[kind] = {"intercept_ms": a, "slope_ms": b, "points": len(pts),
                             "n_max": max(p[0] for p in pts)}
        r["per_worker_fit"] = fit
    r["load_before"] = load_before
    r["load_after"] = os.getloadavg()[0]
    r["whole_run_s"] = time.time() - t_start
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump(r, f, indent=1)
    md = markdown(r)
    if ARGS.markdown:
        with open(ARGS.markdown, "w") as f:
            f.write(md)
    if ARGS.update_doc:
        update_doc(ARGS.update_doc, md)
    print(md)


def update_doc(path, md):
    write_doc_block(path, "launch-bench", "bench/launch/run.py", md)


if __name__ == "__main__":
    main()
