"""The ddprun binary with GPUs (a fake NVML) and NCCL IDs: --dry-run device column per rank,
--nproc-per-node gpu counted through NVML, and --nccl-id env/auto exit codes.

Run by ctest with DDPRUN_BIN_DIR set; argv[1] is the fake NVML library (tests/gpu/fake_nvml.c).
"""
import os
import re
import subprocess
import sys
import tempfile
import unittest

BIN = os.path.abspath(os.path.join(os.environ["DDPRUN_BIN_DIR"], "ddprun"))
FAKE_NVML = sys.argv.pop(1)


def ddprun(args, env_extra=None, timeout=60):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    env["DDPRUN_NVML_LIBRARY"] = FAKE_NVML
    env["DDPRUN_CUDA_LIBRARY"] = "none"
    env.update(env_extra or {})
    return subprocess.run([BIN] + args, env=env, capture_output=True, text=True, timeout=timeout)


def nvidia_device_present():
    """What ddprun's nvidia_device_present() looks for (worker_env/src/gpus.cpp)."""
    gpus = "/proc/driver/nvidia/gpus"
    if os.path.isdir(gpus) and os.listdir(gpus):
        return True
    if any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvhost-ctrl-gpu", "/dev/nvhost-gpu", "/dev/dxg")):
        return True
    return os.path.exists("/dev/nvidiactl") and any(re.fullmatch(r"nvidia[0-9]+", n) for n in os.listdir("/dev"))


def rank_sections(text):
    """{local rank: its dry-run section}"""
    parts = re.split(r"^local rank (\d+):\n", text, flags=re.M)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


class DryRunDevices(unittest.TestCase):
    def test_gpu_isolation_shows_each_ranks_device(self):
        r = ddprun(["--dry-run", "--nproc-per-node", "gpu", "--gpu-isolation", "--no-python", "/bin/true"],
                   {"FAKE_NVML_COUNT": "3"})
        self.assertEqual(r.returncode, 0, r.stderr)
        sections = rank_sections(r.stdout)
        self.assertEqual(sorted(sections), [0, 1, 2], r.stdout)
        for rank, text in sections.items():
            self.assertRegex(text, r"  device: cuda:0 = GPU %d \(GPU-dead%04x" % (rank, rank))
            self.assertIn("    CUDA_VISIBLE_DEVICES=", text)
            self.assertIn("    DDPRUN_CUDA_DEVICE=0\n", text)
            self.assertIn("    CUDA_DEVICE_ORDER=PCI_BUS_ID\n", text)

    def test_gpus_selects_from_the_visible_list(self):
        r = ddprun(["--dry-run", "--nproc-per-node", "2", "--gpus", "1,3", "--no-python", "/bin/true"],
                   {"FAKE_NVML_COUNT": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
        self.assertEqual(r.returncode, 0, r.stderr)
        sections = rank_sections(r.stdout)
        self.assertIn("    CUDA_VISIBLE_DEVICES=1,3\n", sections[0])
        self.assertIn("    DDPRUN_CUDA_DEVICE=1\n", sections[1])
        self.assertRegex(sections[1], r"device: cuda:1 = GPU 3")

    def test_too_many_workers_for_isolation(self):
        r = ddprun(["--dry-run", "--nproc-per-node", "3", "--gpu-isolation", "--no-python", "/bin/true"],
                   {"FAKE_NVML_COUNT": "2"})
        self.assertEqual(r.returncode, 2, r.stdout)
        self.assertIn("--gpu-sharing", r.stderr + r.stdout)
        ok = ddprun(["--dry-run", "--nproc-per-node", "3", "--gpu-isolation", "--gpu-sharing", "--no-python",
                     "/bin/true"], {"FAKE_NVML_COUNT": "2"})
        self.assertEqual(ok.returncode, 0, ok.stderr)

    def test_nproc_gpu_counts_nvml_and_cpu_runs_stay_plain(self):
        r = ddprun(["--dry-run", "--nproc-per-node", "gpu", "--no-python", "/bin/true"], {"FAKE_NVML_COUNT": "5"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(rank_sections(r.stdout)), [0, 1, 2, 3, 4])
        none = ddprun(["--dry-run", "--nproc-per-node", "gpu", "--no-python", "/bin/true"],
                      {"DDPRUN_NVML_LIBRARY": "none"})
        self.assertEqual(none.returncode, 2)
        self.assertIn("no GPU found", none.stderr)
        cpu = ddprun(["--dry-run", "--nproc-per-node", "2", "--no-python", "/bin/true"])
        self.assertEqual(cpu.returncode, 0, cpu.stderr)
        self.assertNotIn("device:", cpu.stdout)
        self.assertNotIn("CUDA_DEVICE_ORDER", cpu.stdout)
        self.assertNotIn("DDPRUN_CUDA_DEVICE", cpu.stdout)


class NcclIdModes(unittest.TestCase):
    def test_env_without_nccl_is_an_error_auto_continues(self):
        with tempfile.TemporaryDirectory() as d:
            missing = {"DDPRUN_NCCL_LIBRARY": os.path.join(d, "no-libnccl.so")}
            r = ddprun(["--standalone", "--nproc-per-node", "1", "--nccl-id", "env", "--no-python", "/bin/true"],
                       missing)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("--nccl-id env", r.stderr)
            # A device named (leaked into this machine if it has none): said at the default level.
            r = ddprun(["--standalone", "--nproc-per-node", "1", "--no-python", "/bin/true"],
                       dict(missing, CUDA_VISIBLE_DEVICES="0"))
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stderr.count("not exporting DDPRUN_NCCL_UNIQUE_ID"), 1, r.stderr)

    @unittest.skipIf(nvidia_device_present(), "a machine with an NVIDIA device")
    def test_cpu_only_machine_says_why_at_debug_level(self):
        # No GPU and no CUDA_VISIBLE_DEVICES: no ID is the expected case, not a line on every launch.
        r = ddprun(["--standalone", "--nproc-per-node", "1", "--no-python", "/bin/true"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("not exporting", r.stderr)
        r = ddprun(["--standalone", "--nproc-per-node", "1", "--log-level", "debug", "--no-python", "/bin/true"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("--nccl-id auto: not exporting DDPRUN_NCCL_UNIQUE_ID: no NVIDIA GPU is visible", r.stderr)

    def test_comm_id_dry_run_and_bad_mode(self):
        r = ddprun(["--dry-run", "--nproc-per-node", "2", "--master-addr", "127.0.0.5", "--master-port", "29500",
                    "--nccl-id", "comm-id",
                    "--no-python", "/bin/true"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.count("    NCCL_COMM_ID=127.0.0.5:<port chosen per attempt>\n"), 2, r.stdout)
        r = ddprun(["--nccl-id", "bogus", "--no-python", "/bin/true"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("comm-id", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
