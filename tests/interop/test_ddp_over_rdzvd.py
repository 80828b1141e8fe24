"""A 4-process gloo DDP job whose workers use ddprun-rdzvd as their store, exactly as under
torchrun with an agent-hosted store (TORCHELASTIC_USE_AGENT_STORE=True). PYTHON_EXEC picks the
workers' torch; tests/torch2 runs it with torch 2.6 (DDPRUN_TORCH2_VERSION set)."""
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import PYTHON, Checker, Driver, _track, main, start_rdzvd  # noqa: E402

WORLD = 4
BOUND_S = 180


def test():
    ck = Checker()
    _, port = start_rdzvd()
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_worker.py")
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ)
        env.update({
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_WORLD_SIZE": str(WORLD),
            "OMP_NUM_THREADS": "1",
        })
        procs.append(_track(subprocess.Popen([PYTHON, worker], env=env, start_new_session=True)))
    deadline = time.monotonic() + BOUND_S
    codes = []
    for rank, p in enumerate(procs):
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(f"still running after {BOUND_S} s")
    for rank, c in enumerate(codes):
        ck.eq(f"rank {rank} exit", c, 0)

    # The job really went through our store: its keys are there, under the 1.13 agent-store
    # prefix (torch >= 2.5 drops the prefix: its agents give each attempt a fresh store), and
    # init/ counted the 4 worker stores.
    d = Driver(port, "modern", prefix="")
    keys = d.call("list_keys")
    ck.eq("init/ counter", d.call("add_raw", "init/", 0), WORLD)
    if os.environ.get("DDPRUN_TORCH2_VERSION", "1.").startswith("1."):
        ck.true(f"worker keys under //worker/attempt_0/ ({keys})",
                any(k.startswith(b"//worker/attempt_0/") for k in keys))
    else:
        ck.true(f"torch 2.x worker keys, without the attempt prefix ({keys})",
                len(keys) >= WORLD and not any(b"attempt_" in k for k in keys))
    d.close()
    ck.finish("DDP over ddprun-rdzvd")


if __name__ == "__main__":
    main(test)
