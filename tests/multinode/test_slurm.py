#!/usr/bin/env python3
"""`srun ddprun ...` inside a Slurm allocation, on one machine: two ddprun processes get only
Slurm's variables (SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST, SLURM_STEP_ID)
and must form one 2-node job on their own: node count, job id and rendezvous endpoint (the first
node of the list, here 127.0.0.1 from the hostlist "127.0.0.[1-2]") come from Slurm, and the
node with SLURM_NODEID=0 hosts the rendezvous. Node 1 starts first, so it has to wait for node 0.
The rendezvous port is a free one (DDPRUN_SLURM_RDZV_PORT), never the fixed 29400.
"""
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid

BIN = os.path.abspath(os.environ["DDPRUN_BIN_DIR"])
WORKER = os.path.join(os.environ["DDPRUN_SOURCE_DIR"], "tests", "multinode", "mn_worker.py")
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def leftovers(marker):
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def main():
    marker = "slurm-test-" + uuid.uuid4().hex[:8]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ddprun-slurm-") as d:
        procs = []
        logs = []
        for node_id, addr in ((1, "127.0.0.2"), (0, "127.0.0.1")):  # node 1 first: it must wait
            env = dict(os.environ, PYTHON_EXEC=PYTHON, TMPDIR=d, SLURM_JOB_ID="4242", SLURM_STEP_ID="0",
                       SLURM_NNODES="2", SLURM_NODEID=str(node_id), SLURM_JOB_NODELIST="127.0.0.[1-2]",
                       DDPRUN_SLURM_RDZV_PORT=str(port))
            log = open(os.path.join(d, "node%d.log" % node_id), "w+")
            logs.append((node_id, log))
            procs.append(subprocess.Popen(
                [os.path.join(BIN, "ddprun"), "--nproc-per-node", "2", "--local-addr", addr, WORKER, marker,
                 "--out", d, "--sleep", "0"], env=env, stdout=log, stderr=subprocess.STDOUT))
        problems = []
        try:
            for p in procs:
                p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            problems.append("the two nodes did not finish within 60 s")
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        text = {}
        for node_id, log in logs:
            log.seek(0)
            text[node_id] = log.read()
            log.close()
        codes = [p.returncode for p in procs]
        if codes != [0, 0]:
            problems.append("exit codes %s" % codes)
        envs = []
        for path in glob.glob(os.path.join(d, "env_*.json")):
            with open(path) as f:
                envs.append(json.load(f))
        if sorted(int(e["RANK"]) for e in envs) != [0, 1, 2, 3]:
            problems.append("ranks %s, want 0..3" % sorted(e["RANK"] for e in envs))
        if {e["WORLD_SIZE"] for e in envs} != {"4"} or {e["GROUP_WORLD_SIZE"] for e in envs} != {"2"}:
            problems.append("world sizes %s" % [(e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) for e in envs])
        if {e["TORCHELASTIC_RUN_ID"] for e in envs} != {"slurm-4242.0"}:
            problems.append("run ids %s" % {e["TORCHELASTIC_RUN_ID"] for e in envs})
        if len({e["MASTER_ADDR"] + ":" + str(e["MASTER_PORT"]) for e in envs}) != 1:
            problems.append("the workers disagree on MASTER_ADDR:PORT")
        endpoint = "127.0.0.1:%d" % port
        for node_id in (0, 1):
            if "Slurm allocation: 2 nodes, this is node %d" % node_id not in text[node_id] or endpoint not in text[node_id]:
                problems.append("node %d did not report the Slurm settings with %s" % (node_id, endpoint))
        if "(hosted here)" not in text[0] or "(hosted here)" in text[1]:
            problems.append("node 0, and only node 0, hosts the rendezvous")
        deadline = time.monotonic() + 10
        while leftovers(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        if leftovers(marker):
            problems.append("processes left: %s" % leftovers(marker))
        if problems:
            for node_id in (0, 1):
                sys.stderr.write("---- node %d ----\n%s\n" % (node_id, text[node_id][-3000:]))
            sys.stderr.write("FAILED:\n  " + "\n  ".join(problems) + "\n")
            return 1
    print("slurm: 2 nodes from Slurm's variables alone, 4 ranks, node 0 hosted the rendezvous")
    return 0


if __name__ == "__main__":
    sys.exit(main())
