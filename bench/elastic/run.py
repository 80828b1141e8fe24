#!/usr/bin/env python3
"""Node loss -> survivors restarted: 3 ddprun agents (127.0.0.2/.3/.4, 2 workers each) against a
ddprun-rdzvd on 127.0.0.1, DEFAULT heartbeats (1 s x 3 missed). One agent is SIGKILLed (its
connection closes at once) or SIGSTOPped (it just goes silent, so only the lease expires); the
figure is the time from the kill to the first and to the last worker of the smaller world
(WORLD_SIZE 4) starting on the survivors.

Usage: run.py --bin-dir build/bin [--reps N] [--out results.json] [--markdown out.md]
       [--update-doc docs/performance.md]
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from doc_block import update_doc as write_doc_block  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "elastic_worker.sh")
ADDRS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


def read_starts(path):
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) >= 3 and p[1] == "start":
                kv = dict(x.split("=", 1) for x in p[2:])
                out.append((float(p[0]), int(kv["world"]), int(kv["rank"])))
    return out


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




def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--markdown")
    ap.add_argument("--update-doc")
    args = ap.parse_args()
    res = {}
    for how in ("SIGKILL", "SIGSTOP"):
        firsts, lasts = [], []
        for _ in range(args.reps):
            f, l = one_run(args.bin_dir, how)
            firsts.append(f)
            lasts.append(l)
            print(f"{how}: first {f:.0f} ms, last {l:.0f} ms", flush=True)
        res[how] = {"first_ms": firsts, "last_ms": lasts}

    def fmt(xs):
        return f"{statistics.median(xs):.0f} ({min(xs):.0f}–{max(xs):.0f})"

    md = [f"Measured {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} with "
          f"`bench/elastic/run.py {' '.join(sys.argv[1:])}` on {os.cpu_count()} vCPU, kernel "
          f"{platform.release()}; default heartbeats (1 s × 3 missed); median (min–max) of "
          f"{args.reps} runs.", "",
          "| one of 3 agents … | survivors' first new worker (ms) | all 4 new workers (ms) | goal |",
          "|---|---|---|---|"]
    for how, v in res.items():
        label = "SIGKILLed (connection closes)" if how == "SIGKILL" else "SIGSTOPped (silent: lease expiry)"
        md.append(f"| {label} | {fmt(v['first_ms'])} | {fmt(v['last_ms'])} | ≤ 3000 |")
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.update_doc:
        write_doc_block(args.update_doc, "elastic-bench", "bench/elastic/run.py", text)

if __name__ == "__main__":
    main()
