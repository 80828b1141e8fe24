"""torch DDP over NCCL under a launcher, on a real GPU (tests/gpu/device/run.sh).

    ddp_nccl.py MODE    MODE: id (ddprun, --nccl-id auto/env), comm-id (--nccl-id comm-id),
                        plain (torchrun, or ddprun --nccl-id off)

Checks what the launcher exported for the mode, initialises torch.distributed's NCCL backend
(env://), trains a small DDP model for a few steps, all-reduces rank+1 and checks the sum and that
every rank holds the same parameters. Prints one JSON line with "ok": true, or exits 1.
"""
import json
import os
import re
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def fail(msg):
    print(json.dumps({"ok": False, "rank": os.environ.get("RANK"), "error": msg}), flush=True)
    sys.exit(1)


def main():
    mode = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    dev = int(os.environ.get("DDPRUN_CUDA_DEVICE", local))
    uid = os.environ.get("DDPRUN_NCCL_UNIQUE_ID")
    comm_id = os.environ.get("NCCL_COMM_ID")
    if mode == "id" and not (uid and re.fullmatch(r"[0-9a-f]{256}", uid)):
        fail(f"DDPRUN_NCCL_UNIQUE_ID is {uid!r}, not 256 hex digits")
    if mode == "comm-id" and (not comm_id or uid):
        fail(f"comm-id: NCCL_COMM_ID={comm_id!r} DDPRUN_NCCL_UNIQUE_ID={uid!r}")
    if mode == "plain" and (uid or comm_id):
        fail(f"plain: unexpected DDPRUN_NCCL_UNIQUE_ID={uid!r} NCCL_COMM_ID={comm_id!r}")
    torch.cuda.set_device(dev)
    device = torch.device("cuda", dev)
    dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device),
                device_ids=[dev])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)
    for _ in range(5):
        x = torch.randn(32, 64, generator=gen).to(device)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], g) for g in gathered)
    dist.destroy_process_group()
    out = {"ok": t.item() == expected and same, "rank": rank, "world": world, "cuda": dev,
           "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "sum": t.item(), "params_agree": same,
           "mode": mode, "nccl_comm_id": comm_id, "unique_id_prefix": (uid or "")[:32]}
    print(json.dumps(out), flush=True)
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
