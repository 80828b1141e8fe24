#!/usr/bin/env python3
"""Controllable worker for the multi-node tests (no torch import: starts fast).

    mn_worker.py MARKER --out DIR [--fail-rank R --fail-attempt A --exit N]
                 [--second-fail-rank R2 --second-exit N2]
                 [--fail-when PATH] [--term-ignore-attempt A]
                 [--exit-when-world W] [--wait-file PATH] [--sleep S] [--slow-rank R --slow-sleep S]

At start it writes DIR/env_<RANK>_a<RESTART_COUNT>_w<WORLD_SIZE>_<pid>.json with the
distributed variables and its agent's pid (its parent). Then, in this order:
  * TORCHELASTIC_RESTART_COUNT == --term-ignore-attempt: SIGTERM is ignored from here on (the
    agent's stop then waits for its grace, --shutdown-timeout, and SIGKILLs);
  * RANK == R and TORCHELASTIC_RESTART_COUNT == A: (with R2: once DIR/armed_R2 exists; with
    --fail-when: once PATH exists) write
    $TORCHELASTIC_ERROR_FILE and DIR/failed_R, exit N;
  * RANK == R2 in attempt A: ignore SIGTERM, write DIR/armed_R2, wait for DIR/failed_R and for
    its stacks.txt (beside its error file) to be written, exit N2 by itself (a second failure of
    its own, after the first);
  * WORLD_SIZE == W: exit 0 at once;
  * --wait-file: exit 0 once PATH exists (checked every 20 ms, at most --sleep seconds);
  * sleep --sleep seconds (default 60; RANK == --slow-rank: --slow-sleep) and exit 0.
MARKER is ignored: it makes every process of one test findable in /proc.
"""
import argparse
import json
import os
import platform
import signal
import sys
import time

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "DDPRUN_NCCL_UNIQUE_ID", "DDPRUN_NCCL_UNIQUE_IDS",
        "TORCHELASTIC_ERROR_FILE"]


def wait_for(path, limit=20.0):
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("marker")
    p.add_argument("--out", required=True)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-attempt", type=int, default=0)
    p.add_argument("--exit", type=int, default=1)
    p.add_argument("--raise", dest="raise_", action="store_true",
                   help="the failing rank raises (exit 1) and writes no error file")
    p.add_argument("--fail-when")
    p.add_argument("--term-ignore-attempt", type=int, default=-1)
    p.add_argument("--second-fail-rank", type=int, default=-1)
    p.add_argument("--second-exit", type=int, default=5)
    p.add_argument("--exit-when-world", type=int, default=-1)
    p.add_argument("--wait-file")
    p.add_argument("--sleep", type=float, default=60.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-sleep", type=float, default=30.0)
    a = p.parse_args()
    env = {k: os.environ.get(k) for k in KEYS}
    env["token_seen"] = "DDPRUN_RDZV_TOKEN" in os.environ  # the agent must scrub it
    env["pid"] = os.getpid()
    env["agent_pid"] = os.getppid()
    env["python"] = platform.python_version()
    rank = int(env["RANK"])
    attempt = int(env["TORCHELASTIC_RESTART_COUNT"])
    world = int(env["WORLD_SIZE"])
    name = "env_%d_a%d_w%d_%d.json" % (rank, attempt, world, os.getpid())
    tmp = os.path.join(a.out, "." + name)
    with open(tmp, "w") as f:
        json.dump(env, f)
    os.rename(tmp, os.path.join(a.out, name))
    if attempt == a.term_ignore_attempt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == a.fail_rank and attempt == a.fail_attempt:
        if a.fail_when:
            wait_for(a.fail_when, 60.0)
        if a.second_fail_rank >= 0:  # fail only once the second rank ignores SIGTERM
            wait_for(os.path.join(a.out, "armed_%d" % a.second_fail_rank))
        if a.raise_:
            open(os.path.join(a.out, "failed_%d" % rank), "w").close()
            raise RuntimeError("MnWorkerError: rank %d raised on purpose" % rank)
        # torch's @record format, so the agent can report the message to every node.
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path:
            with open(path, "w") as f:
                json.dump({"message": {"message": "MnWorkerError: rank %d failed on purpose" % rank,
                                       "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}}}, f)
        open(os.path.join(a.out, "failed_%d" % rank), "w").close()
        sys.exit(a.exit)
    if rank == a.second_fail_rank and attempt == a.fail_attempt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join(a.out, "armed_%d" % rank), "w").close()
        wait_for(os.path.join(a.out, "failed_%d" % a.fail_rank))
        # Once the agent has taken its stacks (written beside its error file): its line in the
        # diagnosis printed at the first failure is then amended when it exits.
        stacks = os.path.join(os.path.dirname(os.environ.get("TORCHELASTIC_ERROR_FILE", "")), "stacks.txt")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (os.path.exists(stacks) and os.path.getsize(stacks) > 0):
            time.sleep(0.01)
        sys.exit(a.second_exit)
    if world == a.exit_when_world:
        sys.exit(0)
    deadline = time.monotonic() + (a.slow_sleep if rank == a.slow_rank else a.sleep)
    if a.wait_file:
        while time.monotonic() < deadline:
            if os.path.exists(a.wait_file):
                sys.exit(0)
            time.sleep(0.02)
        sys.exit(4)
    time.sleep(max(0.0, deadline - time.monotonic()))
    sys.exit(0)


if __name__ == "__main__":
    main()
