"""DDP jobs under ddprun: examples/ddp_train.py with 4 gloo ranks, and a restart after SIGKILL.

Run by ctest with DDPRUN_BIN_DIR, DDPRUN_SOURCE_DIR and PYTHON_EXEC (an interpreter with torch).
Each job runs in its own session and is bounded by JOB_TIMEOUT; on timeout the whole session
is killed. Ports: --master-port 0 / --standalone, never a fixed port.
"""
import os
import re
import signal
import subprocess
import sys
import unittest

BIN = os.path.abspath(os.path.join(os.environ["DDPRUN_BIN_DIR"], "ddprun"))
SOURCE = os.path.abspath(os.environ["DDPRUN_SOURCE_DIR"])
SCRIPT = os.path.join(SOURCE, "examples", "ddp_train.py")
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
JOB_TIMEOUT = 240

PASSED = re.compile(r"^ddp_train: all_reduce check passed: sum=(\d+) expected=(\d+) world_size=(\d+) "
                    r"restart_count=(\d+)$", re.M)


def run_job(ddprun_args, script_args=()):
    env = dict(os.environ)
    env["PYTHON_EXEC"] = PYTHON
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.Popen([BIN] + list(ddprun_args) + [SCRIPT] + list(script_args), env=env, cwd=SOURCE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError("ddprun did not finish within %ds\nstdout:\n%s\nstderr:\n%s" % (JOB_TIMEOUT, out, err))
    sys.stdout.write(out)
    sys.stderr.write(err)
    return proc.returncode, out, err


class Train(unittest.TestCase):
    def test_four_ranks(self):
        rc, out, err = run_job(["--nproc-per-node", "4", "--master-port", "0"])
        self.assertEqual(rc, 0, err)
        passed = PASSED.findall(out)
        self.assertEqual(len(passed), 1, out)
        total, expected, world, restarts = (int(x) for x in passed[0])
        self.assertEqual((total, expected, world, restarts), (10, 10, 4, 0))
        losses = [float(x) for x in re.findall(r"^ddp_train: epoch \d+/\d+ loss ([0-9.]+)", out, re.M)]
        self.assertEqual(len(losses), 3, out)
        self.assertLess(losses[-1], losses[0], "training did not reduce the loss")


class Restart(unittest.TestCase):
    def test_one_restart_after_sigkill(self):
        rc, out, err = run_job(["--nproc-per-node", "4", "--standalone", "--max-restarts", "1"],
                               ["--kill-rank", "1", "--kill-at-step", "3"])
        self.assertEqual(rc, 0, err)
        # Rank 1 killed itself exactly once, on the first attempt.
        self.assertEqual(re.findall(r"^ddp_train: rank (\d+) SIGKILLs itself at step 3 \(attempt (\d+)\)$", out, re.M),
                         [("1", "0")], out)
        # Both attempts started, and the second one finished the job.
        self.assertEqual(re.findall(r"^ddp_train: world_size=4 restart_count=(\d+)", out, re.M), ["0", "1"], out)
        passed = PASSED.findall(out)
        self.assertEqual([tuple(int(x) for x in p) for p in passed], [(10, 10, 4, 1)], out)
        # ddprun reported exactly one restart, caused by the SIGKILL.
        restarts = re.findall(r"restarting worker group \(attempt (\d+) of (\d+)\)", err)
        self.assertEqual(restarts, [("1", "1")], err)
        self.assertIn("SIGKILL", err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
