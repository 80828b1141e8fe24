"""A real torch worker: env:// init over the agent's store (TORCHELASTIC_USE_AGENT_STORE=True, or
rank 0's own with False), one gloo all_reduce, result checked. Optional: fail on attempt 0 (argv[1] == "fail-first")."""
import os
import sys

import torch
import torch.distributed as dist


def main():
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    if len(sys.argv) > 1 and sys.argv[1] == "fail-first" and attempt == 0 and rank == 1:
        sys.exit(13)
    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    world = dist.get_world_size()
    expected = world * (world + 1) / 2
    assert t.item() == expected, (t.item(), expected)
    print(f"allreduce ok rank={rank} attempt={attempt} sum={t.item():.0f} "
          f"agent_store={os.environ['TORCHELASTIC_USE_AGENT_STORE']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
