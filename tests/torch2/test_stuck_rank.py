"""Culprit naming with torch 2.6 workers (PYTHON_EXEC=python3-torch2): a 2-rank gloo job where
rank 1 sleeps outside the collective and rank 0 times out in all_reduce. The summary must name
rank 1 and its frame from its faulthandler stacks, which needs ddprun's sitecustomize hook to run
although python3-torch2 puts its own sitecustomize first on PYTHONPATH (it chains to ours).
"""
import os
import subprocess
import sys
import tempfile
import unittest

DDPRUN = os.path.join(os.environ["DDPRUN_BIN_DIR"], "ddprun")
PYTHON = os.environ["PYTHON_EXEC"]

STUCK = r'''import datetime, os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=4))
if dist.get_rank() == 1:
    time.sleep(600)
t = torch.ones(4)
dist.all_reduce(t)
'''


class StuckRankTorch2(unittest.TestCase):
    def test_stuck_rank_is_named_with_its_frame(self):
        with tempfile.TemporaryDirectory(prefix="ddprun-t2-stuck-", dir="/tmp") as d:
            script = os.path.join(d, "stuck.py")
            with open(script, "w") as f:
                f.write(STUCK)
            env = dict(os.environ, PYTHON_EXEC=PYTHON, TMPDIR=d)
            proc = subprocess.run([DDPRUN, "--master-port", "0", "--nproc-per-node", "2", script], cwd=d, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=240)
        err = proc.stderr.decode(errors="replace")
        self.assertNotEqual(proc.returncode, 0, err)
        self.assertIn("culprit    : rank 1 never entered all_reduce: it was in <module> at stuck.py:6 (`time.sleep(600)`)",
                      err)
        self.assertLess(err.index("culprit    : rank 1"), err.index("rank 0 (local 0"))


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
