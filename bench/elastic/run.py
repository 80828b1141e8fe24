#!/usr/bin/env python3
"""Multi-node failures on loopback, ddprun vs torchrun 1.13 and 2.6, default heartbeats and timeouts.

* Node loss (ddprun): 3 agents (127.0.0.2/.3/.4, 2 workers each, --nnodes 2:3) against a
  ddprun-rdzvd on 127.0.0.1. One agent is SIGKILLed (its connection closes at once) or SIGSTOPped
  (it just goes silent, so only the lease expires); the figure is the time from the signal to the
  first and to the last worker of the smaller world (WORLD_SIZE 4) starting on the survivors.
* Crash -> group restarted, 3 nodes: the same job (--max-restarts 1) under ddprun (against
  ddprun-rdzvd) and torchrun 1.13 c10d (against torch's own TCPStore server in a separate process,
  is_host=0, monitor interval 0.1 and 5) and torchrun 2.6 c10d (the same against torch 2.6's own
  server, monitor interval 0.1; Debian trixie's torch in the chroot of scripts/torch2, only as
  root with the cached root, see bench/torch2.py); rank 0's worker is SIGKILLed; time to the first
  and to the last of the 6 new workers.
* Agent SIGKILL under torchrun: after that restart one torchrun agent is SIGKILLed and the
  survivors are watched for --kill-window seconds (torch 1.13 does not act on a lost agent until a
  collective times out; the table says what was seen, "no reaction" included), for each torchrun.

Usage: run.py --bin-dir build/bin [--quick] [--reps N] [--kill-window S] [--out results.json]
       [--markdown out.md] [--update-doc docs/performance.md]
"""
import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from doc_block import update_doc as write_doc_block  # noqa: E402
import torch2  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "elastic_worker.sh")
ADDRS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


def read_starts(path):
    """[(time, world, rank)] of the workers' start lines."""
    return [(t, int(kv["world"]), int(kv["rank"])) for t, kv in read_lines(path)]


def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # a benchmark harness, not a test: 10 ms polling is fine
        v = pred()
        if v:
            return v
        time.sleep(0.01)
    raise RuntimeError(f"timed out waiting for {what}")


def one_run(bin_dir, how):
    with tempfile.TemporaryDirectory(prefix="ddprun-elastic-bench-") as d:
        outf = os.path.join(d, "starts")
        env = dict(os.environ, OUTF=outf, TMPDIR=d, DDPRUN_LOG_LEVEL="warning")
        daemon = subprocess.Popen([os.path.join(bin_dir, "ddprun-rdzvd"), "--host", "127.0.0.1",
                                   "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  env=env)
        agents = []
        try:
            line = daemon.stdout.readline().decode()
            port = int(line.strip().rsplit(":", 1)[1])
            for addr in ADDRS:
                agents.append(subprocess.Popen(
                    [os.path.join(bin_dir, "ddprun"), "--nnodes", "2:3", "--nproc-per-node", "2",
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                     "--rdzv-id", "bench", "--local-addr", addr, "--max-restarts", "0", WORKER],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True))
            wait_for(lambda: len([s for s in read_starts(outf) if s[1] == 6]) == 6, 60,
                     "6 workers of the first round")
            victim = agents[2]
            t_kill = time.time()
            os.kill(victim.pid, signal.SIGKILL if how == "SIGKILL" else signal.SIGSTOP)
            starts = wait_for(lambda: (lambda s: s if len(s) == 4 else None)(
                [x for x in read_starts(outf) if x[1] == 4]), 60, "4 workers of the smaller world")
            first = (min(s[0] for s in starts) - t_kill) * 1e3
            last = (max(s[0] for s in starts) - t_kill) * 1e3
            return first, last
        finally:
            for a in agents:
                try:
                    os.killpg(a.pid, signal.SIGCONT)
                    os.killpg(a.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                a.wait()
            daemon.kill()
            daemon.wait()




TORCH_PY = os.environ.get("TORCH_PYTHON", "/usr/bin/python3")
TORCHRUN = os.path.join(HERE, "..", "launch", "torchrun_fixed.py")
# torch 1.13's own TCPStore server in a process of its own, so that no agent hosts the store and
# any agent can be killed (the counterpart of ddprun-rdzvd).
TORCH_STORE = ("import sys, time, torch.distributed as d\n"
               "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
               "print('listening on 127.0.0.1:%d' % s.port, flush=True)\n"
               "time.sleep(3600)\n")


def read_lines(path):
    """[(time, {key: value})] of the workers' start lines."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) >= 3 and p[1] == "start":
                out.append((float(p[0]), dict(x.split("=", 1) for x in p[2:])))
    return out


def kill_marked(marker):
    """SIGKILL every process whose environment carries BENCH_MARKER=marker (torchrun's workers
    outlive a killed agent: no parent-death signal in 1.13)."""
    needle = b"DDPRUN_BENCH_MARKER=" + marker.encode() + b"\0"
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read():
                    os.kill(int(d), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def cluster_run(kind, bin_dir, mi, kill_window_s):
    """3 agents x 2 workers (--nnodes 2:3) of `kind` ('ddprun', 'torchrun' (1.13) or 'torchrun2'
    (2.6)). Crashes rank 0's
    worker (SIGKILL by pid) and times the group restart: the first and the last of the 6 new
    workers. With kill_window_s, then SIGKILLs one agent and watches the survivors for that long."""
    marker = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="ddprun-elastic-bench-") as d:
        outf = os.path.join(d, "starts")
        env = dict(os.environ, OUTF=outf, TMPDIR=d, DDPRUN_LOG_LEVEL="warning",
                   DDPRUN_BENCH_MARKER=marker)
        if kind == "ddprun":
            server_cmd = [os.path.join(bin_dir, "ddprun-rdzvd"), "--host", "127.0.0.1", "--port", "0"]
        elif kind == "torchrun2":
            server_cmd = [torch2.PYTHON2, "-c", TORCH_STORE]
        else:
            server_cmd = [TORCH_PY, "-c", TORCH_STORE]
        server = subprocess.Popen(server_cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        agents = []
        try:
            port = int(server.stdout.readline().decode().strip().rsplit(":", 1)[1])
            for addr in ADDRS:
                if kind == "ddprun":
                    cmd = [os.path.join(bin_dir, "ddprun"), "--nnodes", "2:3", "--nproc-per-node", "2",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                           "--rdzv-id", "bench", "--local-addr", addr, "--max-restarts", "1", WORKER]
                elif kind == "torchrun2":
                    cmd = [torch2.TORCHRUN2, "--nnodes=2:3", "--nproc-per-node=2",
                           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                           "--rdzv-id=bench", "--rdzv-conf=is_host=0", "--max-restarts=1",
                           f"--monitor-interval={mi}", "--no-python", WORKER]
                else:
                    cmd = [TORCH_PY, TORCHRUN, "--nnodes=2:3", "--nproc_per_node=2",
                           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                           "--rdzv_id=bench", "--rdzv_conf=is_host=0", "--max_restarts=1",
                           f"--monitor_interval={mi}", "--no_python", WORKER]
                agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL, start_new_session=True))
            first_round = wait_for(lambda: (lambda s: s if len(s) == 6 else None)(
                [x for x in read_lines(outf) if x[1]["world"] == "6"]), 120, "6 workers of round 1")
            victim_pid = int(next(kv["pid"] for _, kv in first_round if kv["rank"] == "0"))
            t_crash = time.time()
            os.kill(victim_pid, signal.SIGKILL)
            new = wait_for(lambda: (lambda s: s if len(s) >= 6 else None)(
                [x for x in read_lines(outf) if x[0] > t_crash]), 120, "6 restarted workers")
            res = {"first_ms": (min(t for t, _ in new) - t_crash) * 1e3,
                   "last_ms": (sorted(t for t, _ in new)[5] - t_crash) * 1e3}
            if kill_window_s:
                time.sleep(0.5)
                t_kill = time.time()
                os.kill(agents[2].pid, signal.SIGKILL)
                deadline = t_kill + kill_window_s
                while time.time() < deadline:
                    if any(t > t_kill for t, _ in read_lines(outf)):
                        break
                    if any(a.poll() is not None for a in agents[:2]):
                        break
                    time.sleep(0.05)
                after = sorted(t for t, _ in read_lines(outf) if t > t_kill)
                res["kill"] = {"window_s": kill_window_s,
                               "watched_s": time.time() - t_kill,
                               "first_new_worker_ms": (after[0] - t_kill) * 1e3 if after else None,
                               "survivors_running": sum(1 for a in agents[:2] if a.poll() is None)}
            return res
        finally:
            for a in agents:
                try:
                    os.killpg(a.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                a.wait()
            kill_marked(marker)
            server.kill()
            server.wait()


def summ(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def fmt(s):
    if len(s["runs"]) == 1:
        return f"{s['median']:.0f} (n = 1)"
    return f"{s['median']:.0f} ({s['min']:.0f}–{s['max']:.0f})"


LABEL = {"ddprun": "ddprun", "torchrun_mi0.1": "torchrun 1.13 mi 0.1", "torchrun_mi5": "torchrun 1.13 mi 5",
         "torchrun2_mi0.1": "torchrun 2.6 mi 0.1"}


def markdown(r):
    m = r["machine"]
    md = [f"Measured {r['date']} with `{r['command']}` on {m['cpus']} vCPU ({m['cpu_model']}), kernel "
          f"{m['kernel']}, torch {m['torch']}"
          + (f" and {m['torch2']} (Debian trixie, in a chroot)" if m.get("torch2", "").startswith("2.")
             else f" (torchrun 2.6 not measured: {m['torch2']})" if m.get("torch2") else "")
          + "; default heartbeats and timeouts of both launchers; "
          f"median (min–max) of the runs shown; load average {r['load_before']:.1f} before, "
          f"{r['load_after']:.1f} after; whole run {r['whole_run_s']:.0f} s.", "",
          f"**Node loss**, ddprun ({r['reps']} runs each):", "",
          "| one of 3 agents … | survivors' first new worker (ms) | all 4 new workers (ms) | goal |",
          "|---|---|---|---|"]
    for how in r["node_loss"]:
        v = r["node_loss"][how]
        label = "SIGKILLed (connection closes)" if how == "SIGKILL" else "SIGSTOPped (silent: lease expiry)"
        md.append(f"| {label} | {fmt(v['first_ms'])} | {fmt(v['last_ms'])} | ≤ 3000 |")
    md += ["", "**Crash → group restarted, 3 loopback nodes × 2 workers** (`--nnodes 2:3`, "
           "`--max-restarts 1`; rank 0's worker is SIGKILLed; time to the first and to the last of "
           "the 6 new workers; ratios pair by pair against ddprun's run of the same index):", "",
           "| launcher | first new worker (ms) | all 6 new workers (ms) | all 6: / ddprun |",
           "|---|---|---|---|"]
    base = r["restart"]["ddprun"]["last_ms"]["runs"]
    for kind, v in r["restart"].items():
        ratio = ""
        if kind != "ddprun":
            rs = [a / b for a, b in zip(v["last_ms"]["runs"], base)]
            ratio = (f"{statistics.median(rs):.0f}× ({min(rs):.0f}–{max(rs):.0f})" if len(rs) > 1
                     else f"{rs[0]:.0f}×")
        md.append(f"| {LABEL[kind]} | {fmt(v['first_ms'])} | {fmt(v['last_ms'])} | {ratio} |")
    md += ["", "**Agent SIGKILLed, torchrun** (same 3-node job after its restart; one agent "
           "is SIGKILLed while all workers sleep, and the survivors are watched):", "",
           "| launcher | watched for (s) | survivors' first new worker | survivor agents still running |",
           "|---|---|---|---|"]
    for kind, k in r["torch_kill"].items():
        new = ("none: no reaction" if k["first_new_worker_ms"] is None
               else f"{k['first_new_worker_ms']:.0f} ms")
        md.append(f"| {LABEL[kind]} | {k['watched_s']:.1f} | {new} | {k['survivors_running']} of 2 |")
    return "\n".join(md) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", help="build/bin (required unless --render)")
    ap.add_argument("--quick", action="store_true",
                    help="1 run each, no SIGSTOP, torchrun at monitor interval 0.1 only, 1 s kill window")
    ap.add_argument("--reps", type=int, default=None, help="runs per ddprun figure (default 3)")
    ap.add_argument("--kill-window", type=float, default=None,
                    help="seconds to watch torchrun's survivors after an agent SIGKILL (default 30)")
    ap.add_argument("--out")
    ap.add_argument("--markdown")
    ap.add_argument("--update-doc")
    ap.add_argument("--render", metavar="JSON",
                    help="only re-render the markdown (and --update-doc) from a saved --out JSON")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            text = markdown(json.load(f))
        print(text)
        if args.update_doc:
            write_doc_block(args.update_doc, "elastic-bench", "bench/elastic/run.py", text)
        return
    if not args.bin_dir:
        ap.error("--bin-dir is required (unless --render)")
    t_start = time.time()
    load_before = os.getloadavg()[0]
    reps = args.reps or (1 if args.quick else 3)
    window = args.kill_window or (1.0 if args.quick else 30.0)
    torch_reps = {"torchrun_mi0.1": 1} if args.quick else {"torchrun_mi0.1": 3, "torchrun_mi5": 2}
    have_torch2, torch2_version = torch2.available()
    if have_torch2:
        torch_reps["torchrun2_mi0.1"] = 1 if args.quick else 3
    else:
        print(f"elastic: torchrun 2.6 left out: {torch2_version}", flush=True)
    res = {}
    # quick: SIGSTOP (the same code path, 3 s more) is left out.
    for how in ("SIGKILL",) if args.quick else ("SIGKILL", "SIGSTOP"):
        firsts, lasts = [], []
        for _ in range(reps):
            f, l = one_run(args.bin_dir, how)
            firsts.append(f)
            lasts.append(l)
            print(f"{how}: first {f:.0f} ms, last {l:.0f} ms", flush=True)
        res[how] = {"first_ms": summ(firsts), "last_ms": summ(lasts)}
    restart, torch_kill = {}, {}
    for kind, n in [("ddprun", reps)] + list(torch_reps.items()):
        firsts, lasts = [], []
        for i in range(n):
            # The kill window once per torchrun, on its last run at interval 0.1.
            w = window if kind in ("torchrun_mi0.1", "torchrun2_mi0.1") and i == n - 1 else None
            mi = {"ddprun": None, "torchrun_mi0.1": 0.1, "torchrun_mi5": 5, "torchrun2_mi0.1": 0.1}[kind]
            x = cluster_run(kind.split("_")[0], args.bin_dir, mi, w)
            firsts.append(x["first_ms"])
            lasts.append(x["last_ms"])
            print(f"restart 3 nodes {kind}: first {x['first_ms']:.0f} ms, last {x['last_ms']:.0f} ms",
                  flush=True)
            if "kill" in x:
                torch_kill[kind] = x["kill"]
                print(f"agent SIGKILL {kind}: {x['kill']}", flush=True)
        restart[kind] = {"first_ms": summ(firsts), "last_ms": summ(lasts)}
    torch_version = subprocess.run(
        [TORCH_PY, "-c", "import importlib.metadata as m; print(m.version('torch'))"],  # no `import torch` (1 s)
        capture_output=True, text=True).stdout.strip()
    cpu_model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                      if l.startswith("model name")), platform.machine())
    r = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "command": " ".join(["bench/elastic/run.py"] + sys.argv[1:]),
         "quick": args.quick, "reps": reps,
         "machine": {"cpus": os.cpu_count(), "cpu_model": cpu_model, "kernel": platform.release(),
                     "torch": torch_version, "torch2": torch2_version},
         "node_loss": res, "restart": restart, "torch_kill": torch_kill,
         "load_before": load_before, "load_after": os.getloadavg()[0],
         "whole_run_s": time.time() - t_start}
    text = markdown(r)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.update_doc:
        write_doc_block(args.update_doc, "elastic-bench", "bench/elastic/run.py", text)


if __name__ == "__main__":
    main()
