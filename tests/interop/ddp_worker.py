"""A DDP worker as torchrun would start it with an agent-hosted store (1.13 env:// path with
TORCHELASTIC_USE_AGENT_STORE=True: every rank is a TCPStore client of MASTER_ADDR:PORT)."""
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == 4, (rank, world)
    torch.manual_seed(0)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)  # different data per rank
    for _ in range(5):
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # DDP averaged the gradients: the parameters must be identical on every rank.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], t) for t in everyone), "parameters diverged"
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 10.0, t.item()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: ok (loss {loss.item():.4f})", flush=True)


if __name__ == "__main__":
    main()
