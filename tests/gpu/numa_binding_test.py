#!/usr/bin/env python3
"""--numa-binding end to end: ddprun runs workers that report the Cpus_allowed_list of
/proc/self/status, and each must equal the plan. Plans come from the real /sys (computed here
independently) and from fake sysfs trees (DDPRUN_SYSFS_ROOT) combined with a fake NVML whose
GPU 0 (PCI 0000:1a:00.0) sits on NUMA node 1 = CPU 1 only.

Run by ctest with DDPRUN_BIN_DIR/DDPRUN_SOURCE_DIR set; argv[1] is the fake NVML library.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

BIN = os.path.abspath(os.path.join(os.environ["DDPRUN_BIN_DIR"], "ddprun"))
WORKER = os.path.join(os.environ["DDPRUN_SOURCE_DIR"], "tests", "gpu", "binding_worker.py")
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
FAKE_NVML = sys.argv.pop(1)


def cpu_list(text):
    out = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def run(args, env_extra, out_dir, timeout=60):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    env.update({"DDPRUN_NVML_LIBRARY": "none", "DDPRUN_CUDA_LIBRARY": "none", "PYTHON_EXEC": PYTHON})
    env.update(env_extra)
    r = subprocess.run([BIN] + args + [WORKER, out_dir], env=env, capture_output=True, text=True, timeout=timeout)
    reports = {}
    for path in glob.glob(os.path.join(out_dir, "w_*.json")):
        with open(path) as f:
            e = json.load(f)
        reports[int(e["LOCAL_RANK"])] = cpu_list(e["cpus"])
    return r, reports


def fake_sysfs(root, gpu_node):
    """Two CPUs, node0 = CPU 0, node1 = CPU 1; GPU 0000:1a:00.0 on `gpu_node`."""
    def write(rel, text):
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")
    write("devices/system/cpu/online", "0-1")
    write("devices/system/node/node0/cpulist", "0")
    write("devices/system/node/node1/cpulist", "1")
    for c in (0, 1):
        write("devices/system/cpu/cpu%d/topology/core_id" % c, str(c))
        write("devices/system/cpu/cpu%d/topology/physical_package_id" % c, "0")
    write("bus/pci/devices/0000:1a:00.0/numa_node", str(gpu_node))


def own_affinity():
    return sorted(os.sched_getaffinity(0))


class NumaBinding(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="ddprun-numa-")
        self.out = os.path.join(self.dir, "out")
        os.mkdir(self.out)
        self.sys = os.path.join(self.dir, "sys")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def need_cpus(self, *cpus):
        if not set(cpus) <= set(own_affinity()):
            self.skipTest("needs CPUs %s in the test's affinity, has %s" % (cpus, own_affinity()))

    def test_real_sysfs_node_plan(self):
        # No GPU: ranks go round robin over the NUMA nodes with allowed CPUs; each gets its
        # node's CPUs within ddprun's own affinity. Computed here from /sys independently.
        allowed = set(own_affinity())
        nodes = {}
        for d in glob.glob("/sys/devices/system/node/node[0-9]*"):
            with open(os.path.join(d, "cpulist")) as f:
                cpus = set(cpu_list(f.read())) & allowed
            if cpus:
                nodes[int(os.path.basename(d)[4:])] = sorted(cpus)
        if not nodes:
            with open("/sys/devices/system/cpu/online") as f:
                nodes = {0: sorted(set(cpu_list(f.read())) & allowed)}
        order = sorted(nodes)
        r, got = run(["--standalone", "--nproc-per-node", "2", "--numa-binding", "node"], {}, self.out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(got), [0, 1], r.stderr)
        for rank in (0, 1):
            self.assertEqual(got[rank], nodes[order[rank % len(order)]], "local rank %d" % rank)
        self.assertEqual(r.stderr.count("round robin over NUMA node(s)"), 1, r.stderr)

    def test_bound_to_the_gpus_node(self):
        self.need_cpus(0, 1)
        fake_sysfs(self.sys, gpu_node=1)
        r, got = run(["--standalone", "--nproc-per-node", "2", "--numa-binding", "node"],
                     {"DDPRUN_SYSFS_ROOT": self.sys, "DDPRUN_NVML_LIBRARY": FAKE_NVML, "FAKE_NVML_COUNT": "1"},
                     self.out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(got, {0: [1], 1: [1]}, r.stderr)
        # The same tree with the GPU on node 0: CPU 0 only (the tree, not chance, decides).
        fake_sysfs(self.sys, gpu_node=0)
        shutil.rmtree(self.out)
        os.mkdir(self.out)
        r, got = run(["--standalone", "--nproc-per-node", "2", "--numa-binding", "socket"],
                     {"DDPRUN_SYSFS_ROOT": self.sys, "DDPRUN_NVML_LIBRARY": FAKE_NVML, "FAKE_NVML_COUNT": "1"},
                     self.out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(got, {0: [0, 1], 1: [0, 1]}, "socket = both CPUs (one package)\n" + r.stderr)

    def test_no_gpu_spreads_ranks_over_nodes(self):
        self.need_cpus(0, 1)
        fake_sysfs(self.sys, gpu_node=1)
        r, got = run(["--standalone", "--nproc-per-node", "2", "--numa-binding", "exclusive"],
                     {"DDPRUN_SYSFS_ROOT": self.sys}, self.out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(got, {0: [0], 1: [1]}, r.stderr)
        self.assertIn("no GPU bus id known", r.stderr)

    def test_dry_run_shows_each_ranks_cpus(self):
        fake_sysfs(self.sys, gpu_node=1)
        r = subprocess.run([BIN, "--dry-run", "--nproc-per-node", "2", "--numa-binding", "node", "--no-python",
                            "/bin/true"], capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, DDPRUN_SYSFS_ROOT=self.sys, DDPRUN_NVML_LIBRARY=FAKE_NVML,
                                    DDPRUN_CUDA_LIBRARY="none", FAKE_NVML_COUNT="1"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(re.findall(r"^  cpus: (.*)$", r.stdout, flags=re.M), ["1 (--numa-binding node)"] * 2,
                         r.stdout)

    def test_no_allowed_cpu_on_the_gpus_node_is_an_error(self):
        self.need_cpus(0)
        fake_sysfs(self.sys, gpu_node=1)
        env = dict(os.environ, DDPRUN_SYSFS_ROOT=self.sys, DDPRUN_NVML_LIBRARY=FAKE_NVML, DDPRUN_CUDA_LIBRARY="none",
                   FAKE_NVML_COUNT="1")
        r = subprocess.run(["taskset", "-c", "0", BIN, "--standalone", "--nproc-per-node", "1", "--numa-binding",
                            "node", "--no-python", "/bin/true"], capture_output=True, text=True, timeout=30, env=env)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("local rank 0 (NUMA node 1) gets no CPU", r.stderr)

    def test_fanout_forwards_the_flags_to_every_host(self):
        # Each remote agent plans from its own host's sysfs, so the mode travels as given.
        r = subprocess.run([BIN, "--hosts", "h1,h2", "--dry-run", "--numa-binding", "socket", "--nccl-id", "comm-id",
                            "--no-python", "/bin/true"], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.count(" --numa-binding=socket "), 2, r.stdout)
        self.assertEqual(r.stdout.count(" --nccl-id=comm-id "), 2, r.stdout)
        bad = subprocess.run([BIN, "--hosts", "h1,h2", "--dry-run", "--numa-binding", "near", "--no-python",
                              "/bin/true"], capture_output=True, text=True, timeout=30)
        self.assertEqual(bad.returncode, 2, bad.stdout)
        self.assertIn("--numa-binding='near'", bad.stderr)

    def test_bad_mode_is_a_usage_error(self):
        r = subprocess.run([BIN, "--numa-binding", "fast", "--no-python", "/bin/true"], capture_output=True, text=True,
                           timeout=30)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--numa-binding='fast'", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
