#!/usr/bin/env python3
"""A real torch DDP job for the ssh fan-out test: gloo process group from the launcher's env
(env:// init), DistributedDataParallel over a tiny Linear for a few SGD steps, then checks that
  * an all_reduce of (rank + 1) gives world * (world + 1) / 2,
  * after training every rank holds the same parameters (DDP averaged the gradients),
and prints `rank R ok world W host <addr>` (addr: what this host's name resolves to).
Exit 3 on a failed check."""
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if t.item() != world * (world + 1) / 2:
        print("rank %d all_reduce gave %s" % (rank, t.item()), file=sys.stderr)
        return 3

    torch.manual_seed(1234)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)  # different data per rank
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(8, 4, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if not all(torch.equal(g, flat) for g in gathered):
        print("rank %d parameters differ across ranks after DDP steps" % rank, file=sys.stderr)
        return 3

    addr = socket.gethostbyname(socket.gethostname())
    # One write call per line: under PYTHONUNBUFFERED, print() writes the text and the newline
    # separately, so lines of ranks sharing a console pipe (no prefixing agent) could interleave.
    sys.stdout.write("rank %d torch %s\n" % (rank, torch.__version__))
    sys.stdout.write("rank %d ok world %d host %s\n" % (rank, world, addr))
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
