"""One node, 4 gloo ranks of torch 2.6 under ddprun (PYTHON_EXEC=python3-torch2), beside the
same job under torchrun 2.6 (torchrun2):

  * ddprun's workers meet the environment contract (docs/worker-env.md) and torch 2.6's
    init_process_group(env://) agrees with it; DDP trains and all_reduce sums 1..4;
  * every variable torchrun 2.6 gives its workers, ddprun gives too, with the same value where
    the value is not job-specific (ports, run ids and paths differ by design);
  * a worker failure on attempt 0 restarts the group and attempt 1 re-initialises torch 2.6 over
    the agent's store (2.6 workers use no per-attempt key prefix);
  * with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 both launchers export TORCHELASTIC_USE_AGENT_STORE
    =False and rank 0 of the workers hosts their store, after a restart too;
  * nothing started by the test is left running (a unique marker in every worker's argv).
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
DDPRUN = os.path.join(os.environ["DDPRUN_BIN_DIR"], "ddprun")
SRC = os.environ["DDPRUN_SOURCE_DIR"]
# DDPRUN_TORCHRUN2: a torchrun 2.x installed on the machine (tests/gpu/device) instead of the chroot's.
TORCHRUN2 = os.environ.get("DDPRUN_TORCHRUN2") or os.path.join(SRC, "scripts", "torch2", "torchrun2")
PYTHON = os.environ["PYTHON_EXEC"]
WORKER = os.path.join(HERE, "env_ddp_worker.py")
JOB_TIMEOUT = 200
# Same value under both launchers (the rest: ports, run ids, paths, addresses differ by design).
SAME_VALUE = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
              "OMP_NUM_THREADS",
              # torchrun 2.x sets only the TORCH_ name (2.2+ warns on every rank given the old one)
              "NCCL_ASYNC_ERROR_HANDLING"]
# Exported by torchrun 2.9 and later (2.11 on the GPU machine, tests/gpu/device), not by 2.6.
SINCE_2_9 = ["TORCHELASTIC_SIGNALS_TO_HANDLE"]


def processes_with(marker):
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != "Z":
            found.append((int(d), cmd.replace(b"\0", b" ").decode(errors="replace")))
    return found


class Job:
    def __init__(self, name):
        self.marker = f"ddprun-t2-{name}-{uuid.uuid4().hex[:8]}"
        self.dir = tempfile.mkdtemp(prefix=self.marker + "_")

    def run(self, launcher, extra_worker=(), extra_env=None):
        env = dict(os.environ, PYTHON_EXEC=PYTHON, TMPDIR=self.dir, **(extra_env or {}))
        env.pop("OMP_NUM_THREADS", None)
        proc = subprocess.Popen(launcher + [WORKER, self.dir] + list(extra_worker), env=env, cwd=self.dir,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"{launcher[0]} did not finish within {JOB_TIMEOUT} s\n{out}\n{err[-4000:]}")
        return proc.returncode, out, err

    def envs(self, attempt=0):
        out = {}
        for p in glob.glob(os.path.join(self.dir, f"env_*_a{attempt}.json")):
            with open(p) as f:
                e = json.load(f)
            out[int(e["RANK"])] = e
        return out

    def close(self):
        deadline = time.monotonic() + 5
        left = processes_with(self.dir)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = processes_with(self.dir)
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
        return left


class SingleNode(unittest.TestCase):
    def job(self, name):
        j = Job(name)
        self.addCleanup(lambda: self.assertEqual(j.close(), [], "processes left behind"))
        return j

    def check_contract(self, envs, attempt, agent_store="True"):
        self.assertEqual(sorted(envs), [0, 1, 2, 3], envs)
        masters = {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs.values()}
        self.assertEqual(len(masters), 1, masters)
        for r, e in envs.items():
            where = f"rank {r}: {e}"
            self.assertTrue(e["torch"].startswith("2."), where)
            self.assertEqual((e["dist_rank"], e["dist_world"]), (r, 4), where)
            self.assertEqual((e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]), (str(r), "4", "4"), where)
            self.assertEqual((e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]), ("0", "1"), where)
            self.assertEqual((e["ROLE_NAME"], e["ROLE_RANK"], e["ROLE_WORLD_SIZE"]), ("default", str(r), "4"), where)
            self.assertEqual(e["TORCHELASTIC_RESTART_COUNT"], str(attempt), where)
            self.assertEqual(e["TORCHELASTIC_USE_AGENT_STORE"], agent_store, where)
            self.assertTrue(e["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_{attempt}/{r}/error.json"), where)
            self.assertTrue(e["params_agree"], where)
            self.assertEqual(e["allreduce"], 10.0, where)

    def test_env_contract_beside_torchrun_2(self):
        d = self.job("env")
        rc, out, err = d.run([DDPRUN, "--standalone", "--nproc-per-node", "4"])
        self.assertEqual(rc, 0, f"ddprun exited {rc}\n{out}\n{err[-4000:]}")
        ours = d.envs()
        self.check_contract(ours, 0)

        t = self.job("torchrun2")
        rc, out, err = t.run([TORCHRUN2, "--standalone", "--nproc-per-node", "4"])
        self.assertEqual(rc, 0, f"torchrun 2.6 exited {rc}\n{out}\n{err[-4000:]}")
        theirs = t.envs()
        self.check_contract(theirs, 0)
        for r in range(4):
            missing = sorted(set(theirs[r]) - set(ours[r]))
            self.assertEqual(missing, [], f"rank {r}: torchrun 2.6 exports {missing}, ddprun does not")
            for k in SAME_VALUE + [k for k in SINCE_2_9 if k in theirs[r]]:
                self.assertEqual(ours[r].get(k), theirs[r].get(k), f"rank {r} {k}: ddprun vs torchrun 2.x")
        names = sorted(k for k in theirs[0] if k.isupper())
        print(f"env contract: ddprun and torchrun 2.6 agree on {len(names)} names "
              f"({len(SAME_VALUE)} values compared); ddprun adds "
              f"{sorted(set(ours[0]) - set(theirs[0]))}", flush=True)

    def test_restart_reinitialises_torch_2(self):
        d = self.job("restart")
        rc, out, err = d.run([DDPRUN, "--standalone", "--nproc-per-node", "4", "--max-restarts", "1"],
                             ["fail-first"])
        self.assertEqual(rc, 0, f"ddprun exited {rc}\n{out}\n{err[-4000:]}")
        self.check_contract(d.envs(1), 1)
        self.assertIn("restarting worker group (attempt 1 of 1)", err)

    def test_the_opt_out_of_the_agent_store_beside_torchrun_2(self):
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 of the workers hosts their store on a port
        # of its own (the agent keeps it reserved and does not listen there), for both attempts.
        opt_out = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        d = self.job("optout")
        rc, out, err = d.run([DDPRUN, "--standalone", "--nproc-per-node", "4", "--max-restarts", "1"],
                             ["fail-first"], opt_out)
        self.assertEqual(rc, 0, f"ddprun exited {rc}\n{out}\n{err[-4000:]}")
        self.check_contract(d.envs(1), 1, agent_store="False")
        self.assertIn("restarting worker group (attempt 1 of 1)", err)
        self.assertNotIn("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", err)

        t = self.job("optout-torchrun2")
        rc, out, err = t.run([TORCHRUN2, "--standalone", "--nproc-per-node", "4"], extra_env=opt_out)
        self.assertEqual(rc, 0, f"torchrun 2.6 exited {rc}\n{out}\n{err[-4000:]}")
        self.check_contract(t.envs(), 0, agent_store="False")


if __name__ == "__main__":
    unittest.main(verbosity=2)
