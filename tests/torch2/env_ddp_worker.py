"""A torch 2.x gloo DDP worker that records its launcher's environment contract.

    env_ddp_worker.py OUT_DIR [fail-first]

Writes OUT_DIR/env_<RANK>_a<RESTART_COUNT>.json (every variable the launcher added: the names in
CONTRACT and anything starting with TORCHELASTIC_, plus torch's version and what
init_process_group(env://) made of them), then trains a small DDP model over gloo for 3 steps
and checks that the parameters agree on every rank and an all_reduce sums 1..WORLD.
With "fail-first", rank 1 exits 13 on attempt 0 (the restart path).
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

CONTRACT = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS"]


def main():
    out = sys.argv[1]
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if len(sys.argv) > 2 and sys.argv[2] == "fail-first" and attempt == 0 and rank == 1:
        sys.exit(13)
    env = {k: v for k, v in os.environ.items() if k in CONTRACT or k.startswith("TORCHELASTIC_")}
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    world = dist.get_world_size()
    env["torch"] = torch.__version__
    env["dist_rank"], env["dist_world"] = dist.get_rank(), world
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(torch.randn(16, 8, generator=gen)),
                                            torch.randn(16, 4, generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    env["params_agree"] = all(torch.equal(everyone[0], t) for t in everyone)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    env["allreduce"] = t.item()
    dist.barrier()
    dist.destroy_process_group()
    name = f"env_{rank}_a{attempt}.json"
    with open(os.path.join(out, "." + name), "w") as f:
        json.dump(env, f)
    os.rename(os.path.join(out, "." + name), os.path.join(out, name))
    print(f"env_ddp_worker: rank {rank} attempt {attempt} ok", flush=True)
    # Leave without the interpreter's and torch's C++ teardown: twice in some hundred runs of the
    # suite, torch 2.6's rank 0 aborted there ("terminate called without an active exception",
    # SIGABRT) after its work was done and reported, a race inside torch at exit (the launcher has
    # sent nothing by then). This worker tests the launcher's contract, not torch's teardown.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
