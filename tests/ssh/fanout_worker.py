#!/usr/bin/env python3
"""Controllable worker for the ssh fan-out tests (stdlib only, starts fast).

    fanout_worker.py --out DIR [--lines N] [--fail-rank R --exit N] [--hold FILE] [--max S] [-- ARGS...]

At start it writes DIR/w_<RANK>_<pid>.json (atomically, via rename) with its rank variables,
hostname, the address that hostname resolves to, pid, parent pid, cwd, the full environment and
ARGS (everything after `--`, byte-exact). Then:
  * --lines N: prints N lines `line I of rank R host H`, each written in two flushed halves so a
    relay that does not buffer whole lines shows torn lines;
  * RANK == --fail-rank: exits --exit at once;
  * --hold FILE: waits (20 ms polls, at most --max seconds, default 120) until FILE exists, exit 0;
  * otherwise exits 0.
SIGTERM/SIGINT/SIGHUP: appends `signal N` to DIR/sig_<RANK>_<pid> and exits 128+N.
Nothing is printed while holding, so only the control channel can stop a holding worker.
"""
import json
import os
import signal
import socket
import sys
import time


def parse(argv):
    opts = {"out": None, "lines": 0, "fail_rank": -1, "exit": 1, "hold": None, "max": 120.0}
    extra = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            extra = argv[i + 1:]
            break
        key = a[2:].replace("-", "_")
        if not a.startswith("--") or key not in opts:
            sys.exit("fanout_worker: unknown argument %r" % a)
        opts[key] = type(opts[key])(argv[i + 1]) if opts[key] is not None else argv[i + 1]
        i += 2
    if opts["out"] is None:
        sys.exit("fanout_worker: --out DIR is required")
    return opts, extra


def main():
    opts, extra = parse(sys.argv[1:])
    rank = int(os.environ["RANK"])
    sig_path = os.path.join(opts["out"], "sig_%d_%d" % (rank, os.getpid()))

    def on_signal(signo, _frame):
        with open(sig_path, "a") as f:
            f.write("signal %d\n" % signo)
        os._exit(128 + signo)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)

    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = "?"
    info = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
        "world": int(os.environ.get("WORLD_SIZE", "-1")),
        "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", "-1")),
        "group_rank": int(os.environ.get("GROUP_RANK", "-1")),
        "host": host,
        "addr": addr,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "args": extra,
    }
    name = "w_%d_%d.json" % (rank, os.getpid())
    tmp = os.path.join(opts["out"], "." + name)
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.rename(tmp, os.path.join(opts["out"], name))

    for i in range(opts["lines"]):
        text = "line %d of rank %d host %s" % (i, rank, host)
        half = len(text) // 2
        sys.stdout.write(text[:half])
        sys.stdout.flush()
        time.sleep(0.002)
        sys.stdout.write(text[half:] + "\n")
        sys.stdout.flush()

    if rank == opts["fail_rank"]:
        sys.stderr.write("rank %d failing with exit %d on purpose\n" % (rank, opts["exit"]))
        sys.stderr.flush()
        os._exit(opts["exit"])
    if opts["hold"]:
        deadline = time.monotonic() + opts["max"]
        while not os.path.exists(opts["hold"]) and time.monotonic() < deadline:
            time.sleep(0.02)
    return 0


if __name__ == "__main__":
    sys.exit(main())
