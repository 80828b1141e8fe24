"""Process-level tests of the ddprun binary: --version, --help, --dry-run output, exit codes.

Run by ctest (ddprun_add_python_test) with DDPRUN_BIN_DIR, DDPRUN_SOURCE_DIR and PYTHON_EXEC set.
Nothing here starts a worker: --dry-run must not run the program (checked with a marker file).
"""
import os
import re
import subprocess
import sys
import tempfile
import unittest

BIN = os.path.abspath(os.path.join(os.environ["DDPRUN_BIN_DIR"], "ddprun"))
SOURCE = os.environ["DDPRUN_SOURCE_DIR"]
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")


def ddprun(args, cwd=None, env_extra=None, timeout=60):
    env = dict(os.environ)
    env["PYTHON_EXEC"] = PYTHON
    env.update(env_extra or {})
    return subprocess.run([BIN] + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def project_version():
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        m = re.search(r"project\(ddprun VERSION ([0-9.]+)", f.read())
    return m.group(1)


class VersionAndHelp(unittest.TestCase):
    def test_version(self):
        r = ddprun(["--version"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "ddprun %s\n" % project_version())

    def test_print_completion_is_the_installed_script(self):
        # The scripts the build generates into share/ (and the packages install).
        share = os.path.join(os.path.dirname(os.path.dirname(BIN)), "share")
        for shell, path in (("bash", "bash-completion/completions/ddprun"), ("zsh", "zsh/site-functions/_ddprun")):
            r = ddprun(["--print-completion", shell])
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(share, path)) as f:
                self.assertEqual(r.stdout, f.read(), shell)
            self.assertIn("--nproc-per-node", r.stdout)
        r = ddprun(["--print-completion", "tcsh"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("tcsh is not supported yet", r.stderr)

    def test_help_lists_both_spellings_and_pet_forms(self):
        r = ddprun(["--help"])
        self.assertEqual(r.returncode, 0, r.stderr)
        for text in ["--nproc-per-node", "--nproc_per_node", "PET_NPROC_PER_NODE", "--standalone",
                     "--max-restarts", "--local-rank-arg", "--dry-run", "Exit codes"]:
            self.assertIn(text, r.stdout)


class DryRun(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="ddprun-cli-")
        self.dir = self.tmp.name
        self.marker = os.path.join(self.dir, "ran")
        with open(os.path.join(self.dir, "train.py"), "w") as f:
            f.write("open(%r, 'w').write('x')\n" % self.marker)

    def tearDown(self):
        self.tmp.cleanup()

    def sections(self, out):
        """Splits dry-run output into {local_rank: text}."""
        parts = re.split(r"^local rank (\d+):\n", out, flags=re.M)
        return {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}

    def test_every_rank_has_its_env_and_argv(self):
        r = ddprun(["--nproc-per-node", "3", "--dry-run", "--max-restarts", "2", "train.py", "--lr", "0.1",
                    "--nproc-per-node", "9"], cwd=self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        ranks = self.sections(r.stdout)
        self.assertEqual(sorted(ranks), [0, 1, 2], r.stdout)
        for rank, text in ranks.items():
            env = dict(re.findall(r"^    ([A-Z_][A-Z0-9_]*)=(.*)$", text, flags=re.M))
            self.assertEqual(env.get("RANK"), str(rank), text)
            self.assertEqual(env.get("LOCAL_RANK"), str(rank), text)
            self.assertEqual(env.get("WORLD_SIZE"), "3", text)
            self.assertEqual(env.get("LOCAL_WORLD_SIZE"), "3", text)
            self.assertEqual(env.get("TORCHELASTIC_MAX_RESTARTS"), "2", text)
            argv = re.search(r"^  argv: (.*)$", text, flags=re.M).group(1)
            self.assertEqual(argv, "%s -u train.py --lr 0.1 --nproc-per-node 9" % PYTHON)
        self.assertFalse(os.path.exists(self.marker), "--dry-run started the program")

    def test_local_rank_arg(self):
        r = ddprun(["--nproc_per_node=2", "--dry_run", "--local-rank-arg", "underscore", "train.py", "x"],
                   cwd=self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        ranks = self.sections(r.stdout)
        for rank, text in ranks.items():
            self.assertIn("--local_rank=%d" % rank, re.search(r"^  argv: (.*)$", text, flags=re.M).group(1))

    def test_one_node_without_a_port_is_standalone_as_current_torchrun(self):
        # Two such jobs on one machine must not both take 29500: a free port, a new run id.
        r = ddprun(["--nproc-per-node", "2", "--dry-run", "train.py"], cwd=self.dir)
        self.assertEqual(r.returncode, 0, r.stderr)
        env = dict(re.findall(r"^    ([A-Z_][A-Z0-9_]*)=(.*)$", self.sections(r.stdout)[0], flags=re.M))
        self.assertEqual(env.get("MASTER_PORT"), "<chosen at launch>", r.stdout)
        self.assertRegex(env.get("TORCHELASTIC_RUN_ID", ""), r"^[0-9a-f-]{36}$")
        # A port given keeps torchrun 1.13/2.6's static single-node job.
        r = ddprun(["--dry-run", "train.py"], cwd=self.dir, env_extra={"PET_MASTER_PORT": "29500"})
        env = dict(re.findall(r"^    ([A-Z_][A-Z0-9_]*)=(.*)$", self.sections(r.stdout)[0], flags=re.M))
        self.assertEqual(env.get("MASTER_PORT"), "29500", r.stdout)
        self.assertEqual(env.get("TORCHELASTIC_RUN_ID"), "none", r.stdout)

    def test_cpu_counts_the_cpus_this_process_may_use(self):
        # As torch._utils.cpu_count: the affinity mask (taskset, cpusets, Slurm), not the machine.
        allowed = sorted(os.sched_getaffinity(0))
        r = subprocess.run(["taskset", "-c", str(allowed[0]), BIN, "--nproc-per-node", "cpu", "--dry-run",
                            "train.py"], cwd=self.dir, env=dict(os.environ, PYTHON_EXEC=PYTHON),
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(self.sections(r.stdout)), [0], r.stdout)
        r = ddprun(["--nproc-per-node", "cpu", "--dry-run", "train.py"], cwd=self.dir)
        self.assertEqual(len(self.sections(r.stdout)), len(allowed), r.stdout)

    def test_pet_environment(self):
        r = ddprun(["--dry-run", "train.py"], cwd=self.dir, env_extra={"PET_NPROC_PER_NODE": "2"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(self.sections(r.stdout)), [0, 1])


    def test_fanout_dry_run_names_hosts_and_variables_not_values(self):
        secret = "v4lue-that-must-not-print"
        r = ddprun(["--hosts", "n1,admin@n2:3", "--dry-run", "--env", "FOO=" + secret, "train.py", "a b"],
                   cwd=self.dir, env_extra={"NCCL_DEBUG": secret, "CUDA_VISIBLE_DEVICES": "3"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("2 host(s) over ssh", r.stdout)
        self.assertNotIn(secret, r.stdout + r.stderr)
        carried = re.search(r"^environment carried to every host.*:(.*)$", r.stdout, flags=re.M).group(1).split()
        self.assertIn("NCCL_DEBUG", carried)
        self.assertIn("FOO", carried)
        self.assertNotIn("CUDA_VISIBLE_DEVICES", carried)
        hosts = re.findall(r"^host (\S+) \((\d+) worker", r.stdout, flags=re.M)
        self.assertEqual(hosts, [("n1", "1"), ("n2", "3")])
        self.assertIn(" admin@n2 ", r.stdout)
        self.assertIn("BatchMode=yes", r.stdout)
        self.assertFalse(os.path.exists(self.marker), "--dry-run started the program")


    def test_remote_agent_ignores_pet_variables_of_the_remote_login(self):
        # A remote login whose rc file exports PET_HOSTS must not turn the agent into a launcher.
        # The environment block on stdin wins over the login's own variables: PYTHON_EXEC from the
        # block names the interpreter, the login's would not resolve.
        block = ("PYTHON_EXEC=%s\0\0" % PYTHON).encode()
        r = subprocess.run([BIN, "--remote-agent", "--node-label=h0", "--nproc-per-node", "2", "--dry-run",
                            "train.py"], cwd=self.dir, input=block, capture_output=True, timeout=60,
                           env=dict(os.environ, PET_HOSTS="a,b", PET_NPROC_PER_NODE="5",
                                    PYTHON_EXEC="/nonexistent/python"))
        out = r.stdout.decode()
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        self.assertTrue(out.startswith("\nddprun-remote-agent-ready\n"), out[:200])
        ranks = self.sections(out)
        self.assertEqual(sorted(ranks), [0, 1])  # --nproc-per-node 2, not PET's 5, and no fan-out
        self.assertIn("argv: %s -u train.py" % PYTHON, ranks[0])


class ExitCodes(unittest.TestCase):
    def check_usage_error(self, args, text):
        with tempfile.TemporaryDirectory(prefix="ddprun-cli-") as d:
            open(os.path.join(d, "train.py"), "w").close()
            r = ddprun(args, cwd=d)
        self.assertEqual(r.returncode, 2, (args, r.stdout, r.stderr))
        self.assertEqual(r.stdout, "")
        first = r.stderr.splitlines()[0]
        self.assertTrue(first.startswith("ddprun: error: "), r.stderr)
        self.assertIn(text, first)
        self.assertIn("--help", r.stderr)
        self.assertLessEqual(len(r.stderr.splitlines()), 2, r.stderr)

    def test_bad_nnodes(self):
        self.check_usage_error(["--nnodes=2:1", "train.py"], "--nnodes=2:1: MIN must be <= MAX")

    def test_no_program(self):
        self.check_usage_error(["--nproc-per-node", "2"], "no training program")

    def test_unknown_option(self):
        self.check_usage_error(["--nproc-per-nodes", "2", "train.py"], "unknown option --nproc-per-nodes")

    def test_missing_program(self):
        self.check_usage_error(["does_not_exist.py"], "does_not_exist.py")

    def test_missing_value(self):
        self.check_usage_error(["--nnodes"], "--nnodes")

    def test_gpu_without_cvd(self):
        env = dict(os.environ)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        # No NVML and no CUDA driver: nothing to count (tests/gpu covers a fake NVML).
        env["DDPRUN_NVML_LIBRARY"] = "none"
        env["DDPRUN_CUDA_LIBRARY"] = "none"
        r = subprocess.run([BIN, "--nproc-per-node", "gpu", "x.py"], env=env, capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--nproc-per-node=gpu: no GPU found", r.stderr)

    def test_gpu_and_auto_on_a_machine_without_gpus_ignore_a_leaked_cvd(self):
        # CUDA_VISIBLE_DEVICES set where the machine shows no NVIDIA device (a CPU-only container
        # or CI job it leaked into): torch sees no GPU, and torchrun's auto counts the CPUs.
        if os.path.isdir("/proc/driver/nvidia/gpus") or any(
                re.fullmatch(r"nvidia[0-9]+", n) for n in os.listdir("/dev")):
            self.skipTest("this machine shows an NVIDIA device")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1,2", DDPRUN_NVML_LIBRARY="none")
        r = subprocess.run([BIN, "--dry-run", "--nproc-per-node", "auto", "--no-python", "/bin/true"], env=env,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        cpus = len(os.sched_getaffinity(0)) if os.cpu_count() is None else os.cpu_count()
        self.assertEqual(len(re.findall(r"^local rank [0-9]+:", r.stdout, re.M)), cpus, r.stdout)
        self.assertIn("CUDA_VISIBLE_DEVICES='0,1,2' is set, but this machine shows no NVIDIA GPU", r.stderr)
        self.assertNotIn("DDPRUN_CUDA_DEVICE", r.stdout)  # no GPU plan from it either
        self.assertNotIn("GPU(s) selected", r.stdout)
        r = subprocess.run([BIN, "--dry-run", "--nproc-per-node", "gpu", "--no-python", "/bin/true"], env=env,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--nproc-per-node=gpu: CUDA_VISIBLE_DEVICES='0,1,2' is set, but this machine shows no NVIDIA GPU",
                      r.stderr)
        # A number of workers: no GPU plan and no NCCL ID holder from the leaked value either.
        r = subprocess.run([BIN, "--dry-run", "--nproc-per-node", "2", "--no-python", "/bin/true"], env=env,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("DDPRUN_CUDA_DEVICE", r.stdout)
        self.assertNotIn("CUDA_DEVICE_ORDER", r.stdout)
        self.assertIn("no GPU plan, the workers inherit it as it is", r.stderr)
        r = subprocess.run([BIN, "--master-port", "0", "--nproc-per-node", "2", "--no-python", "/bin/sh", "-c",
                            'echo "nccl=${DDPRUN_NCCL_UNIQUE_ID:-none} cvd=$CUDA_VISIBLE_DEVICES"'], env=env,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.count("nccl=none cvd=0,1,2"), 2, r.stdout + r.stderr)

    def test_unknown_rdzv_conf_key_warns(self):
        # As torchrun: an unknown key does not stop the job; it is named in a warning.
        with tempfile.TemporaryDirectory(prefix="ddprun-cli-") as d:
            open(os.path.join(d, "train.py"), "w").close()
            r = ddprun(["--dry-run", "--rdzv-conf", "join_timeot=5", "train.py"], cwd=d)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("[ddprun warning] --rdzv-conf: ignored: unknown key 'join_timeot'", r.stderr)

    def test_bad_rdzv_conf_value(self):
        self.check_usage_error(["--rdzv-conf", "heartbeat_interval=0", "train.py"], "heartbeat_interval")


class Status(unittest.TestCase):
    def test_help(self):
        r = ddprun(["status", "--help"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("ddprun status --rdzv-endpoint", r.stdout)

    def test_usage_errors(self):
        r = ddprun(["status"])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--rdzv-endpoint", r.stderr)
        r = ddprun(["status", "--rdzv-endpoint", "127.0.0.1:1", "--bogus"])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("'--bogus'", r.stderr)

    def test_unreachable_server_is_named(self):
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nothing listens there now
        r = ddprun(["status", "--rdzv-endpoint", "127.0.0.1:%d" % port, "--timeout", "2"])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("127.0.0.1:%d" % port, r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
