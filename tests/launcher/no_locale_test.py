"""A launch of bin/ddprun never initialises the C++ locale (launcher/src/lazy_iostream.hpp).

Building the classic locale and the standard streams costs ~0.07 ms of CPU and ~25 page faults
per start (docs/performance.md): a static std::ios_base::Init in any file that includes
<iostream>, a CLI11 app (its first option), or any stream (an istringstream parsing a /proc
file) brings it back. Each launch shape below runs under gdb with a breakpoint on
std::locale::_S_initialize and must exit without reaching it; `--help` (CLI11) must reach it, so
the breakpoint is known to work. Skipped (77) where it cannot run (why_not_here).

Run by ctest (ddprun_add_python_test) with DDPRUN_BIN_DIR set.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

BIN_DIR = os.path.abspath(os.environ["DDPRUN_BIN_DIR"])
DDPRUN = os.path.join(BIN_DIR, "ddprun")
SYMBOL = "std::locale::_S_initialize"


def under_gdb(args, tmp):
    """(reached the breakpoint, gdb's output)."""
    env = dict((k, v) for k, v in os.environ.items() if not k.startswith("PET_"))
    env["TMPDIR"] = tmp
    r = subprocess.run(["gdb", "-nx", "-q", "-batch", "-ex", "set breakpoint pending off", "-ex",
                        "set startup-with-shell off", "-ex", f"break {SYMBOL}", "-ex", "run", "-ex", "bt 6", "-ex",
                        "kill", "--args", DDPRUN, *args], capture_output=True, text=True, timeout=120, env=env,
                       stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    return "Breakpoint 1," in out, out


def why_not_here():
    """Why this check cannot run here (None when it can): it needs gdb, a bin/ddprun with
    libstdc++ 12's streams linked in statically, not sanitized (LeakSanitizer refuses ptrace),
    and a kernel that lets gdb trace it."""
    if shutil.which("gdb") is None:
        return "gdb is not installed"
    symbols = subprocess.run(["readelf", "-sW", DDPRUN], capture_output=True, text=True).stdout
    if "_ZNSt6locale13_S_initializeEv" not in symbols:
        return f"{DDPRUN} has no {SYMBOL} symbol (stripped, or not the static runtime)"
    if "_ZSt21ios_base_library_initv" in symbols:
        return "libstdc++ >= 13 builds the streams before main itself (launcher/src/lazy_iostream.hpp)"
    if "__asan_init" in symbols:
        return "a sanitizer build"
    tmp = tempfile.mkdtemp(prefix="ddprun_locale_")
    try:
        reached, out = under_gdb(["--version"], tmp)  # writes to std::cout: must reach it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not reached:
        return "gdb cannot run bin/ddprun to a breakpoint here (ptrace refused?):\n" + out[-2000:]
    return None


class NoLocaleOnLaunch(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ddprun_locale_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_launches_do_not_initialise_the_locale(self):
        for args in (["--standalone", "--nproc-per-node", "1", "--no-python", "/bin/true"],
                     ["--standalone", "--nproc-per-node", "4", "--max-restarts", "1", "--no-python", "/bin/true"],
                     ["--standalone", "--containment", "proc", "--nproc-per-node", "2", "--no-python", "/bin/true"],
                     ["--nproc_per_node=2", "--standalone", "--no-python", "/bin/sh", "-c", "true"]):
            with self.subTest(args=" ".join(args)):
                reached, out = under_gdb(args, self.tmp)
                self.assertFalse(reached, "the C++ locale was initialised:\n" + out[-3000:])
                self.assertIn("exited normally", out)

    def test_the_breakpoint_works(self):
        # CLI11 reads --help (and builds an app), --version writes to std::cout: both initialise it.
        for args in (["--help"], ["--version"]):
            with self.subTest(args=" ".join(args)):
                reached, out = under_gdb(args, self.tmp)
                self.assertTrue(reached, out[-3000:])


if __name__ == "__main__":
    reason = why_not_here()
    if reason:
        print("skipped:", reason)
        sys.exit(77)
    unittest.main()
