#!/usr/bin/env python3
"""Worker for the --numa-binding and --nccl-id comm-id process tests (no torch import: fast).

    binding_worker.py OUT_DIR [--fail-rank R]

Writes OUT_DIR/w_<RANK>_a<RESTART_COUNT>_<pid>.json with its distributed variables, NCCL_COMM_ID
and the Cpus_allowed_list of /proc/self/status, then exits 0. With --fail-rank, on attempt 0:
rank R waits until all WORLD_SIZE workers of attempt 0 have written their file and exits 1 (a
restart follows); the other ranks stay alive (at most 60 s) until the restart stops them.
"""
import glob
import json
import os
import sys
import time

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "NCCL_COMM_ID", "DDPRUN_NCCL_UNIQUE_ID"]


def main():
    out = sys.argv[1]
    args = sys.argv[2:]
    fail_rank = int(args[args.index("--fail-rank") + 1]) if "--fail-rank" in args else -1
    env = {k: os.environ.get(k) for k in KEYS}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                env["cpus"] = line.split(":", 1)[1].strip()
    env["pid"] = os.getpid()
    name = "w_%s_a%s_%d.json" % (env["RANK"], env["TORCHELASTIC_RESTART_COUNT"], os.getpid())
    with open(os.path.join(out, "." + name), "w") as f:
        json.dump(env, f)
    os.rename(os.path.join(out, "." + name), os.path.join(out, name))
    if fail_rank < 0 or env["TORCHELASTIC_RESTART_COUNT"] != "0":
        return
    deadline = time.monotonic() + 60
    world = int(env["WORLD_SIZE"])
    while time.monotonic() < deadline:
        if int(env["RANK"]) == fail_rank and len(glob.glob(os.path.join(out, "w_*_a0_*.json"))) >= world:
            sys.exit(1)
        time.sleep(0.02)


if __name__ == "__main__":
    main()
