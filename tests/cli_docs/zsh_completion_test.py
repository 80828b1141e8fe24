"""The generated zsh completion: `zsh -n` accepts both files, and in a real interactive zsh on a
pty (compinit loading the functions from the build tree's site-functions) TAB completes ddprun's
flags and their fixed value sets and offers no ddprun flags after the program. Readiness is by
output: each step waits (bounded) for the text it expects.

Run by ctest; argv[1] is the build tree's share/ directory. Skipped when zsh is not installed.
"""
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

SHARE = os.path.abspath(sys.argv.pop(1))
FUNCS = os.path.join(SHARE, "zsh", "site-functions")
ZSH = shutil.which("zsh")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]|\r")


@unittest.skipUnless(ZSH, "zsh is not installed")
class Syntax(unittest.TestCase):
    def test_zsh_n(self):
        for name in ("_ddprun", "_ddprun-rdzvd"):
            r = subprocess.run([ZSH, "-n", os.path.join(FUNCS, name)], capture_output=True, text=True, timeout=30)
            self.assertEqual((r.returncode, r.stderr), (0, ""), name)


class Zsh:
    """An interactive `zsh -f` on a pty with compinit run over the generated functions."""

    def __init__(self, home):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.environ.update({"HOME": home, "ZDOTDIR": home, "TERM": "xterm", "COLUMNS": "200", "LINES": "50"})
            os.execv(ZSH, [ZSH, "-f", "-i"])
        self.buf = ""
        self.send("PS1='READY> '; fpath=(%s $fpath); autoload -Uz compinit; compinit -u -D; "
                  "zstyle ':completion:*' list-rows-first true; unsetopt beep; print COMPINIT-$((6*7))\n" % FUNCS)
        self.expect("COMPINIT-42")
        self.expect("READY> ")

    def send(self, text):
        os.write(self.fd, text.encode())

    def expect(self, pattern, timeout=20):
        deadline = time.monotonic() + timeout
        while True:
            text = ANSI.sub("", self.buf)
            m = re.search(pattern, text)
            if m:
                self.buf = text[m.end():]
                return text[:m.end()]
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("zsh did not print %r; got %r" % (pattern, ANSI.sub("", self.buf)))
            r, _, _ = select.select([self.fd], [], [], left)
            if r:
                try:
                    self.buf += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:
                    pass

    def complete(self, line, pattern):
        """Types `line`, presses TAB, waits for `pattern`, then clears the line (Ctrl-U) and
        runs a marker command so the next step starts from a fresh prompt."""
        self.send(line + "\t")
        text = self.expect(pattern)
        self.send("\x15print DONE-$((1+1))\n")  # kill the line, then a marker command
        self.expect("DONE-2")
        self.expect("READY> ")
        return text

    def close(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        os.close(self.fd)


@unittest.skipUnless(ZSH, "zsh is not installed")
class Interactive(unittest.TestCase):
    def setUp(self):
        self.home = tempfile.TemporaryDirectory(prefix="ddprun-zsh-")
        self.zsh = Zsh(self.home.name)

    def tearDown(self):
        self.zsh.close()
        self.home.cleanup()

    def test_unique_flag_is_completed(self):
        self.zsh.complete("ddprun --rdzv-b", r"ddprun --rdzv-backend")

    def test_fixed_value_set_is_listed(self):
        text = self.zsh.complete("ddprun --rdzv-backend ", r"c10d\s+etcd\s+etcd-v2\s+static")
        self.assertIn("static", text)
        self.zsh.complete("ddprun --nproc-per-node ", r"auto\s+cpu\s+gpu")
        self.zsh.complete("ddprun --log-level w", r"--log-level warning")

    def test_status_subcommand(self):
        self.zsh.complete("ddprun status --js", r"ddprun status --json")

    def test_no_ddprun_flags_after_the_program(self):
        # After train.py zsh completes the program's words as files: a temp dir with one file
        # shows that, and no ddprun flag can appear.
        d = tempfile.mkdtemp(dir=self.home.name)
        open(os.path.join(d, "only-file.txt"), "w").close()
        self.zsh.send("cd %s\n" % d)
        self.zsh.expect("READY> ")
        text = self.zsh.complete("ddprun train.py --rdzv-b\t\t\x15ddprun train.py o", r"train\.py only-file\.txt")
        self.assertNotIn("--rdzv-backend", text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
