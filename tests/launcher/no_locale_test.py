"""A launch of bin/ddprun never initialises the C++ locale (launcher/src/lazy_iostream.hpp).

Building the classic locale and the standard streams costs ~0.07 ms of CPU and ~25 page faults
per start (docs/performance.md): a static std::ios_base::Init in any file that includes
<iostream>, a CLI11 app (its first option), or any stream (an istringstream parsing a /proc
file) brings it back. Each launch shape below runs under gdb with a breakpoint on
std::locale::_S_initialize and must exit without reaching it; `--help` (CLI11) must reach it, so
the breakpoint is known to work. Skipped (77) without gdb or without the symbol (a build without
the static runtime).

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
    if "Function \"" + SYMBOL + "\" not defined" in out or "No symbol table" in out:
        raise unittest.SkipTest(f"{DDPRUN} has no {SYMBOL}: not the static runtime")
    return "Breakpoint 1," in out, out


class NoLocaleOnLaunch(unittest.TestCase):
    def setUp(self):
        if shutil.which("gdb") is None:
            raise unittest.SkipTest("gdb is not installed")
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
    result = unittest.main(exit=False).result
    if result.skipped and not result.failures and not result.errors and result.testsRun == len(result.skipped):
        sys.exit(77)
    sys.exit(0 if result.wasSuccessful() else 1)
