"""torch 2.x beside 1.13 in the benchmarks: the cached trixie root of scripts/torch2 (torch 2.6).

available() says whether torchrun 2.6 can run here (root, and the root built by
scripts/torch2/build-root) and why not; the wrappers run torchrun / python inside that root, in a
private mount namespace, keeping the pid (so RSS and signals are the launcher's own). Entering the
root (unshare + a few bind mounts + chroot) costs a few milliseconds per command, against the
1 s+ that torchrun 2.6 takes to start.
"""
import os
import subprocess

SRC = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# DDPRUN_TORCHRUN2 and DDPRUN_TORCH2_PYTHON name a torch 2.x installed on the machine itself (a
# GPU box with pip's torch, tests/gpu/device): then no root and no chroot are involved.
INSTALLED = bool(os.environ.get("DDPRUN_TORCHRUN2"))
TORCHRUN2 = os.environ.get("DDPRUN_TORCHRUN2") or os.path.join(SRC, "scripts", "torch2", "torchrun2")
PYTHON2 = os.environ.get("DDPRUN_TORCH2_PYTHON") if INSTALLED else os.path.join(SRC, "scripts", "torch2",
                                                                               "python3-torch2")
FROM = "installed on the machine" if INSTALLED else "Debian trixie, in a chroot"
ROOT = os.environ.get("DDPRUN_TORCH2_ROOT", "/var/cache/ddprun/torch2-trixie")


def available():
    """(True, torch version) or (False, the reason torchrun 2.6 is left out)."""
    if os.environ.get("DDPRUN_BENCH_NO_TORCH2") == "1":
        return False, "DDPRUN_BENCH_NO_TORCH2=1"
    if INSTALLED and not PYTHON2:
        return False, "DDPRUN_TORCHRUN2 is set without DDPRUN_TORCH2_PYTHON"
    if not INSTALLED and os.geteuid() != 0:
        return False, "needs root (chroot into the torch 2.x root)"
    if not INSTALLED and not os.path.exists(os.path.join(ROOT, ".ddprun-torch2-ready")):
        return False, f"no torch 2.x root at {ROOT} (scripts/torch2/build-root)"
    r = subprocess.run([PYTHON2, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return False, f"python3-torch2 failed: {r.stderr.strip()[-300:]}"
    return True, r.stdout.strip()
