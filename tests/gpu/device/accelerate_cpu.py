"""A Hugging Face accelerate training loop on CPU processes (Accelerator(cpu=True): gloo), run
under ddprun and under torchrun with the same flags (tests/gpu/device/run.sh). Checks that
accelerate saw the launcher's world (num_processes = WORLD_SIZE, process_index = RANK), that the
data was sharded and that every rank ends with the same weights. Rank 0 prints one JSON line;
a rank that fails prints its own, with the reason."""
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    t0 = time.monotonic()
    acc = Accelerator(cpu=True)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = x @ torch.arange(16, dtype=torch.float32).unsqueeze(1) + 0.5
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dl = DataLoader(TensorDataset(x, y), batch_size=16)
    model, opt, dl = acc.prepare(model, opt, dl)
    steps = 0
    for _ in range(3):
        for xb, yb in dl:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            steps += 1
    flat = torch.cat([p.detach().reshape(-1) for p in acc.unwrap_model(model).parameters()])
    rows = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(rows, flat)
    checks = {"num_processes": acc.num_processes == world, "process_index": acc.process_index == rank,
              "weights_agree": all(torch.equal(rows[0], r) for r in rows),
              "sharded": steps == 3 * len(dl), "batches": len(dl) == -(-len(x) // (16 * world)),
              "multi_cpu": "MULTI_CPU" in str(acc.distributed_type)}
    ok = all(checks.values())
    if acc.is_main_process or not ok:
        print(json.dumps({"ok": ok, "rank": rank, "checks": checks, "num_processes": acc.num_processes,
                          "distributed_type": str(acc.distributed_type), "steps_per_rank": steps,
                          "final_loss": round(loss.item(), 4), "train_s": round(time.monotonic() - t0, 2)}),
              flush=True)
    dist.barrier()  # accelerate 1.15 passes device_ids=[local rank] here, even with cpu=True
    return ok


if __name__ == "__main__":
    try:
        good = main()
    except Exception:  # noqa: BLE001 - the launcher's log must show why
        print(json.dumps({"ok": False, "rank": os.environ.get("RANK"), "error": traceback.format_exc()[-1500:]}),
              flush=True)
        good = False
    sys.exit(0 if good else 1)
