"""Runs one torch 2.x suite, or skips it: `gate.py SCRIPT [ARGS...]`.

The torch 2.x tier needs root (chroot, mount namespaces) and the cached trixie root that
scripts/torch2/build-root makes (scripts/test builds it when run as root). Without either, this
prints "SKIPPED: <reason>" and exits 77, which ctest reports as skipped. Otherwise it checks
that python3-torch2 really is torch 2.x (a stale or broken root fails here, naming the root)
and execs SCRIPT under this interpreter, with PYTHON_EXEC set to python3-torch2 and
DDPRUN_TORCH2_VERSION / DDPRUN_TORCH2_PY_VERSION set to the root's torch and Python versions, so
a reused suite can check that its workers really ran inside the root.
"""
import os
import subprocess
import sys

SRC = os.environ["DDPRUN_SOURCE_DIR"]
WRAPPER = os.path.join(SRC, "scripts", "torch2", "python3-torch2")
ROOT = os.environ.get("DDPRUN_TORCH2_ROOT", "/var/cache/ddprun/torch2-trixie")


def skip(reason):
    print(f"SKIPPED: {reason}", flush=True)
    sys.exit(77)


def main():
    if os.geteuid() != 0:
        skip("the torch 2.x tier needs root (chroot into the trixie root, mount namespaces)")
    if not os.path.exists(os.path.join(ROOT, ".ddprun-torch2-ready")):
        skip(f"no torch 2.x root at {ROOT}: build it with scripts/torch2/build-root "
             "(scripts/test does, as root)")
    r = subprocess.run([WRAPPER, "-c", "import platform, torch; print(torch.__version__, platform.python_version())"],
                       capture_output=True, text=True, timeout=120)
    version, _, py_version = r.stdout.strip().partition(" ")
    if r.returncode != 0 or not version.startswith("2."):
        sys.exit(f"FAIL: {WRAPPER} (root {ROOT}) does not run torch 2.x: exit {r.returncode}, "
                 f"stdout {version!r}, stderr {r.stderr.strip()[-2000:]!r}; rebuild the root "
                 "(see docs/testing.md)")
    print(f"torch2 tier: torch {version} from {ROOT}", flush=True)
    env = dict(os.environ, PYTHON_EXEC=WRAPPER, DDPRUN_TORCH2_PYTHON=WRAPPER,
               DDPRUN_TORCH2_VERSION=version, DDPRUN_TORCH2_PY_VERSION=py_version)
    script = os.path.join(SRC, sys.argv[1])
    os.execve(sys.executable, [sys.executable, script] + sys.argv[2:], env)


if __name__ == "__main__":
    main()
