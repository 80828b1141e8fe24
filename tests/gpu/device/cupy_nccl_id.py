"""The NCCL unique ID ddprun exports, used from Python without torch.distributed: CuPy's NCCL
communicator is built from DDPRUN_NCCL_UNIQUE_ID itself and all-reduces rank+1 on the GPU
(tests/gpu/device/run.sh). Prints one JSON line with "ok": true, or exits 1."""
import json
import os
import sys

import cupy as cp
from cupy.cuda import nccl

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev = int(os.environ.get("DDPRUN_CUDA_DEVICE", os.environ["LOCAL_RANK"]))
uid = bytes.fromhex(os.environ["DDPRUN_NCCL_UNIQUE_ID"])  # CuPy takes the 128 bytes as they are
cp.cuda.Device(dev).use()
comm = nccl.NcclCommunicator(world, uid, rank)
x = cp.array([rank + 1.0], dtype=cp.float64)
comm.allReduce(x.data.ptr, x.data.ptr, 1, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, cp.cuda.Stream.null.ptr)
cp.cuda.Stream.null.synchronize()
ok = float(x[0]) == world * (world + 1) / 2
print(json.dumps({"ok": ok, "rank": rank, "world": world, "sum": float(x[0]), "nccl": nccl.get_version()}),
      flush=True)
comm.destroy()
sys.exit(0 if ok else 1)
