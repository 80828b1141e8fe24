#!/usr/bin/env python3
"""Single-node launcher benchmark: ddprun vs torchrun 1.13, measured side by side in one run.

Measures (each repeated, median with min-max):
  * whole-command time of `--nproc-per-node N /bin/true`, next to the floor: a C program that
    posix_spawns N /bin/true and reaps them, timed by the same harness;
  * first worker started after command start (a shell worker logs `date +%s.%N` on entry);
  * crash -> group restarted: rank 0 exits 1 on attempt 0 while 7 peers block; time from the
    failure to the first worker of attempt 1;
  * agent footprint: RSS and CPU of the launcher process while 8 workers sleep.

torchrun runs through bench/launch/torchrun_fixed.py under /usr/bin/python3 (Debian's torch
1.13), with --monitor_interval 5 (its 1.13 default) and 0.1 (current torch default).

Usage: run.py --ddprun build/bin/ddprun [--quick] [--out results.json] [--markdown out.md]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from doc_block import update_doc as write_doc_block  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "timed_worker.sh")
TORCHRUN = os.path.join(HERE, "torchrun_fixed.py")
TORCH_PY = os.environ.get("TORCH_PYTHON", "/usr/bin/python3")


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def launcher_cmd(kind, nproc, extra=(), worker=WORKER):
    """argv for a single-node standalone launch of `nproc` workers of `worker`."""
    if kind == "ddprun":
        return [ARGS.ddprun, "--standalone", f"--nproc-per-node={nproc}", *extra, worker]
    if kind == "floor":
        return [ARGS.floor, str(nproc), worker]
    mi = {"torchrun_mi5": "5", "torchrun_mi0.1": "0.1"}[kind]
    return [TORCH_PY, TORCHRUN, "--standalone", f"--nproc_per_node={nproc}",
            f"--monitor_interval={mi}", *extra, "--no_python", worker]


def read_log(path):
    starts, fails = [], []
    with open(path) as f:
        for line in f:
            parts = line.split()
            t = float(parts[0])
            if parts[1] == "start":
                restart = int(parts[3].split("=")[1] or 0)
                starts.append((t, restart))
            elif parts[1] == "fail":
                fails.append(t)
    return starts, fails


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
        starts, fails = read_log(outf)
    return t0, t1, starts, fails


def bench_launch(kinds, nprocs, reps):
    res = {}
    for n in nprocs:
        for _ in range(reps["ddprun"]):  # the floor: N bare posix_spawn + wait, same harness
            t0 = time.time()
            subprocess.run(launcher_cmd("floor", n, worker="/bin/true"), check=True, timeout=60)
            res.setdefault(f"floor/{n}", []).append((time.time() - t0) * 1e3)
        res[f"floor/{n}"] = {"total_ms": summary(res[f"floor/{n}"])}
        print(f"launch {'floor':15s} N={n:3d}: total {res[f'floor/{n}']['total_ms']['median']:8.1f} ms", flush=True)
        for kind in kinds:
            total, first = [], []
            for _ in range(reps[kind]):
                # Whole command: N workers of /bin/true.
                with tempfile.TemporaryDirectory() as d:
                    t0 = time.time()
                    subprocess.run(launcher_cmd(kind, n, worker="/bin/true"), check=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120,
                                   env=dict(os.environ, TMPDIR=d))
                    total.append((time.time() - t0) * 1e3)
                # First worker: workers that log their start time.
                t0, _, starts, _ = run_once(launcher_cmd(kind, n), {})
                assert len(starts) == n, (kind, n, starts)
                first.append((min(s for s, _ in starts) - t0) * 1e3)
            res[f"{kind}/{n}"] = {"total_ms": summary(total), "first_worker_ms": summary(first)}
            print(f"launch {kind:15s} N={n:3d}: total {statistics.median(total):8.1f} ms, "
                  f"first worker {statistics.median(first):8.1f} ms", flush=True)
    return res


def bench_restart(kinds, reps):
    res = {}
    for kind in kinds:
        xs = []
        for _ in range(reps[kind]):
            extra = ["--max-restarts=1"] if kind == "ddprun" else ["--max_restarts=1"]
            _, _, starts, fails = run_once(launcher_cmd(kind, 8, extra), {"FAIL_ONCE": "1"})
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


def markdown(r):
    lines = []
    m = r["machine"]
    lines.append(f"Measured {r['date']} with `{r['command']}` on {m['cpus']} vCPU, {m['kernel']}, {m['python']}, "
                 f"torch {m['torch']}; {'quick' if r['quick'] else 'full'} run; "
                 f"median (min–max) of the runs shown.\n")
    lines.append("| workers | launcher | whole command, N × /bin/true (ms) | first worker started (ms) | whole command: torchrun / ddprun |")
    lines.append("|---|---|---|---|---|")
    for key, v in r["launch"].items():
        kind, n = key.split("/")
        ratio = ""
        if kind == "floor":
            lines.append(f"| {n} | floor: {n} × posix_spawn + wait | {fmt(v['total_ms'])} | – | |")
            continue
        if kind != "ddprun":
            base = r["launch"][f"ddprun/{n}"]["total_ms"]["median"]
            ratio = f"{v['total_ms']['median'] / base:.0f}×"
        lines.append(f"| {n} | {kind} | {fmt(v['total_ms'])} | {fmt(v['first_worker_ms'])} | {ratio} |")
    lines.append("")
    lines.append("| crash → group restarted (8 workers) | ms | torchrun / ddprun |")
    lines.append("|---|---|---|")
    base = r["restart"]["ddprun"]["restart_ms"]["median"]
    for kind, v in r["restart"].items():
        ratio = "" if kind == "ddprun" else f"{v['restart_ms']['median'] / base:.0f}×"
        lines.append(f"| {kind} | {fmt(v['restart_ms'])} | {ratio} |")
    lines.append("")
    lines.append("| agent with 8 sleeping workers | RSS (MiB) | idle CPU (% of a core) |")
    lines.append("|---|---|---|")
    for kind, v in r["footprint"].items():
        lines.append(f"| {kind} | {v['rss_mib']:.1f} | {v['idle_cpu_pct']:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--ddprun", required=True)
    ap.add_argument("--floor", help="spawn_floor binary (default: next to --ddprun)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--markdown")
    ap.add_argument("--update-doc", metavar="MD",
                    help="replace the launch-bench block of this file (docs/performance.md)")
    ARGS = ap.parse_args()
    ARGS.ddprun = os.path.abspath(ARGS.ddprun)
    ARGS.floor = ARGS.floor or os.path.join(os.path.dirname(ARGS.ddprun), "spawn_floor")

    kinds = ["ddprun", "torchrun_mi0.1", "torchrun_mi5"]
    if ARGS.quick:
        reps = {"ddprun": 5, "torchrun_mi0.1": 1, "torchrun_mi5": 1}
        nprocs = [8]
        window = 1.0
    else:
        reps = {"ddprun": 15, "torchrun_mi0.1": 3, "torchrun_mi5": 2}
        nprocs = [1, 8, 32]
        window = 3.0
    torch_version = subprocess.run([TORCH_PY, "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True).stdout.strip()
    r = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["bench/launch/run.py"] + sys.argv[1:]),
        "quick": ARGS.quick,
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                    "python": platform.python_version(), "torch": torch_version},
        "launch": bench_launch(kinds, nprocs, reps),
        "restart": bench_restart(kinds, reps),
        "footprint": bench_footprint(kinds, window),
    }
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
