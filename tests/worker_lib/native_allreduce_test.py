"""examples/native_allreduce under `ddprun --standalone --nproc-per-node 4`: four native workers
use the worker library's store (add, set/get, barrier) and each checks the sum."""
import os
import re
import subprocess
import sys

bin_dir = os.environ["DDPRUN_BIN_DIR"]
ddprun = os.path.join(bin_dir, "ddprun")
example = os.path.join(bin_dir, "native_allreduce")
for path in (ddprun, example):
    if not os.path.exists(path):
        sys.exit(f"FAIL: {path} is not built")

proc = subprocess.run([ddprun, "--standalone", "--nproc-per-node", "4", example],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
print(proc.stdout)
print(proc.stderr, file=sys.stderr)
if proc.returncode != 0:
    sys.exit(f"FAIL: ddprun exited {proc.returncode}")
ranks = sorted(int(m.group(1)) for m in
               re.finditer(r"^rank (\d+)/4 \(local \d+, restart 0\): sum=10 expected=10 peer \d+ value=\d+ OK$",
                           proc.stdout, re.M))
if ranks != [0, 1, 2, 3]:
    sys.exit(f"FAIL: expected OK lines from ranks 0-3, got {ranks}")
if "WRONG" in proc.stdout:
    sys.exit("FAIL: a rank computed a wrong sum")
print("PASS")
