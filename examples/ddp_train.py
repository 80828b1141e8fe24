#!/usr/bin/env python3
"""Data-parallel training with torch.distributed (gloo, CPU) launched by ddprun (or torchrun).

    ddprun --nproc-per-node 4 examples/ddp_train.py [--epochs 3]

Trains the classic small MNIST convnet ("BasicNet") with DistributedDataParallel on synthetic
MNIST-shaped data (N x 1 x 28 x 28, 10 classes, fixed seed: every run sees the same data), with
a DistributedSampler splitting it across ranks. Rank 0 prints the mean loss of each epoch.

At the end every rank all_reduces (rank + 1); the sum must be world_size * (world_size + 1) / 2,
otherwise the script exits with 3. Rank 0 prints
    ddp_train: all_reduce check passed: sum=10 expected=10 world_size=4 restart_count=0

The process group is initialised from the environment the launcher sets (env://: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and TORCHELASTIC_USE_AGENT_STORE when the launcher serves
the store).

Fault injection for restart tests: --kill-rank R --kill-at-step S makes rank R SIGKILL itself at
global step S, on the first attempt only (TORCHELASTIC_RESTART_COUNT=0), so a launcher run with
--max-restarts >= 1 must restart the group once and then succeed.
"""
import argparse
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class BasicNet(nn.Module):
    """The PyTorch MNIST example's convnet, narrowed so that 4 ranks train in seconds on 2 CPUs."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(samples, seed):
    """Learnable MNIST-shaped data: each class is a fixed random 28x28 template plus noise."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (samples,), generator=g)
    images = templates[labels] + 0.5 * torch.randn(samples, 1, 28, 28, generator=g)
    return TensorDataset(images, labels)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=512, help="synthetic training samples in total")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--kill-rank", type=int, default=None, help="rank that SIGKILLs itself (attempt 0 only)")
    p.add_argument("--kill-at-step", type=int, default=None, help="global step at which it does so")
    return p.parse_args()


def main():
    args = parse_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A bounded timeout: a broken launcher or peer makes this fail instead of hang for 30 minutes.
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    assert dist.get_rank() == rank and dist.get_world_size() == world_size

    torch.manual_seed(args.seed)  # identical initial weights on every rank (DDP also broadcasts them)
    dataset = synthetic_mnist(args.samples, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = DDP(BasicNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    if rank == 0:
        print(f"ddp_train: world_size={world_size} restart_count={restart_count} "
              f"samples={args.samples} epochs={args.epochs}", flush=True)
    step = 0
    start = time.monotonic()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2)  # sum of losses, number of batches
        for images, labels in loader:
            step += 1
            if args.kill_rank == rank and args.kill_at_step == step and restart_count == 0:
                print(f"ddp_train: rank {rank} SIGKILLs itself at step {step} (attempt {restart_count})",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            loss = F.nll_loss(model(images), labels)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item(), 1.0])
        dist.all_reduce(total)
        if rank == 0:
            print(f"ddp_train: epoch {epoch + 1}/{args.epochs} loss {total[0].item() / total[1].item():.4f} "
                  f"({time.monotonic() - start:.1f}s)", flush=True)

    check = torch.tensor([float(rank + 1)])
    dist.all_reduce(check)
    expected = world_size * (world_size + 1) // 2
    ok = int(check.item()) == expected
    if not ok:
        print(f"ddp_train: rank {rank}: all_reduce check FAILED: sum={check.item()} expected={expected}",
              file=sys.stderr, flush=True)
    elif rank == 0:
        print(f"ddp_train: all_reduce check passed: sum={int(check.item())} expected={expected} "
              f"world_size={world_size} restart_count={restart_count}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
