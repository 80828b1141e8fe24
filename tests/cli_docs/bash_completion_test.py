"""The generated bash completion, run in a real bash: each case sources the script in a fresh
`bash --norc --noprofile`, sets COMP_WORDS/COMP_CWORD as readline would, calls the completion
function registered for the command (read back with `complete -p`), and prints COMPREPLY.
Also with bash-completion's own framework loaded when it is installed.

Run by ctest with DDPRUN_BIN_DIR set; argv[1] is the build tree's share/ directory.
"""
import os
import subprocess
import sys
import tempfile
import unittest

SHARE = os.path.abspath(sys.argv.pop(1))
COMPLETIONS = os.path.join(SHARE, "bash-completion", "completions")
FRAMEWORK = "/usr/share/bash-completion/bash_completion"

sys.path.insert(0, os.path.dirname(__file__))
from man_drift_test import parse_man  # noqa: E402  the flags as the man page lists them


def complete(words, command="ddprun", cwd=None, framework=False, wordbreaks=None):
    """COMPREPLY for the command line `words` (the last word is the one being completed)."""
    script = ""
    if framework:
        script += "source %s\n" % FRAMEWORK
    if wordbreaks is not None:
        script += "COMP_WORDBREAKS=%s\n" % sh_quote(wordbreaks)
    script += "source %s\n" % sh_quote(os.path.join(COMPLETIONS, command))
    script += "COMP_WORDS=(%s)\n" % " ".join(sh_quote(w) for w in words)
    script += "COMP_CWORD=%d\n" % (len(words) - 1)
    script += "COMP_LINE=%s\nCOMP_POINT=${#COMP_LINE}\n" % sh_quote(" ".join(words))
    script += "fn=$(complete -p %s | sed -n 's/.*-F \\([^ ]*\\) .*/\\1/p')\n" % command
    script += "[[ -n $fn ]] || { echo 'no completion function registered' >&2; exit 3; }\n"
    script += "$fn %s %s %s\n" % (command, sh_quote(words[-1]), sh_quote(words[-2] if len(words) > 1 else ""))
    script += "printf '%s\\n' \"${COMPREPLY[@]}\"\n"
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], capture_output=True, text=True, timeout=30,
                       cwd=cwd)
    if r.returncode != 0:
        raise AssertionError("bash failed (%d): %s" % (r.returncode, r.stderr))
    return sorted(line for line in r.stdout.split("\n") if line)


def sh_quote(s):
    return "'" + s.replace("'", "'\\''") + "'"


class Flags(unittest.TestCase):
    def test_prefix_completes_flag(self):
        self.assertEqual(complete(["ddprun", "--rdzv-b"]), ["--rdzv-backend"])
        self.assertEqual(complete(["ddprun", "--rdzv_b"]), ["--rdzv_backend"])
        self.assertEqual(complete(["ddprun", "--nproc"]), ["--nproc-per-node", "--nproc_per_node"])

    def test_every_documented_flag_in_both_spellings(self):
        page = parse_man(os.path.join(SHARE, "man", "man1", "ddprun.1"))["OPTIONS"]
        offered = set(complete(["ddprun", "-"]))
        for entry in page.values():
            for name in entry["names"]:
                self.assertIn(name, offered)
        self.assertIn("--nproc_per_node", offered)
        self.assertNotIn("--node-label", offered)  # hidden

    def test_status_flags(self):
        self.assertEqual(complete(["ddprun", "st"]), ["status"])
        self.assertEqual(complete(["ddprun", "status", "--wa"]), ["--watch", "--watch-count", "--watch_count"])
        self.assertIn("--json", complete(["ddprun", "status", "--rdzv-endpoint", "h:1", "-"]))
        self.assertNotIn("--nproc-per-node", complete(["ddprun", "status", "-"]))


class Values(unittest.TestCase):
    def test_fixed_sets(self):
        self.assertEqual(complete(["ddprun", "--rdzv-backend", ""]), ["c10d", "etcd", "etcd-v2", "static"])
        self.assertEqual(complete(["ddprun", "--rdzv_backend", "s"]), ["static"])
        self.assertEqual(complete(["ddprun", "--nproc-per-node", ""]), ["auto", "cpu", "gpu"])
        self.assertEqual(complete(["ddprun", "--redirects", ""]), ["0", "1", "2", "3"])
        self.assertEqual(complete(["ddprun", "-t", ""]), ["0", "1", "2", "3"])
        self.assertEqual(complete(["ddprun", "--log-level", "w"]), ["warning"])
        self.assertEqual(complete(["ddprun", "--nccl-id", ""]), ["auto", "comm-id", "env", "off"])

    def test_equals_forms(self):
        # Default COMP_WORDBREAKS splits "--rdzv-backend=c" into "--rdzv-backend" "=" "c".
        self.assertEqual(complete(["ddprun", "--rdzv-backend", "=", "c"]), ["c10d"])
        self.assertEqual(complete(["ddprun", "--rdzv-backend", "="]), ["c10d", "etcd", "etcd-v2", "static"])
        # Without '=' in COMP_WORDBREAKS the word stays whole and so do the answers.
        self.assertEqual(complete(["ddprun", "--tee=1"]), ["--tee=1"])
        self.assertEqual(complete(["ddprun", "--rdzv-backend=s"]), ["--rdzv-backend=static"])

    def test_free_values_offer_nothing(self):
        self.assertEqual(complete(["ddprun", "--rdzv-id", ""]), [])

    def test_files_and_directories(self):
        with tempfile.TemporaryDirectory() as d:
            os.mkdir(os.path.join(d, "logs"))
            open(os.path.join(d, "hosts.txt"), "w").close()
            self.assertEqual(complete(["ddprun", "--hostfile", "ho"], cwd=d), ["hosts.txt"])
            self.assertEqual(complete(["ddprun", "--log-dir", ""], cwd=d), ["logs"])
            self.assertEqual(complete(["ddprun", "--env-file", "h"], cwd=d), ["hosts.txt"])
            # The program position: subcommand and files.
            self.assertEqual(complete(["ddprun", ""], cwd=d), ["hosts.txt", "logs", "status"])


class StopsAtProgram(unittest.TestCase):
    def test_nothing_after_the_program(self):
        self.assertEqual(complete(["ddprun", "train.py", "--"]), [])
        self.assertEqual(complete(["ddprun", "--nproc-per-node", "2", "train.py", "--rdzv"]), [])
        self.assertEqual(complete(["ddprun", "--rdzv-backend", "=", "c10d", "train.py", "--"]), [])
        self.assertEqual(complete(["ddprun", "-m", "pkg.mod", "--"]), [])
        self.assertEqual(complete(["ddprun", "--", "train.py", "--"]), [])

    def test_values_are_not_programs(self):
        # "2" is --nproc-per-node's value, so the next word is still a ddprun option.
        self.assertEqual(complete(["ddprun", "--nproc-per-node", "2", "--rdzv-b"]), ["--rdzv-backend"])
        self.assertEqual(complete(["ddprun", "-r", "3", "--te"]), ["--tee"])
        self.assertEqual(complete(["ddprun", "--standalone", "--rdzv-b"]), ["--rdzv-backend"])


@unittest.skipUnless(os.path.exists(FRAMEWORK), "bash-completion is not installed")
class WithFramework(unittest.TestCase):
    def test_same_answers_with_bash_completion_loaded(self):
        self.assertEqual(complete(["ddprun", "--rdzv-b"], framework=True), ["--rdzv-backend"])
        self.assertEqual(complete(["ddprun", "--rdzv-backend", ""], framework=True), ["c10d", "etcd", "etcd-v2", "static"])
        self.assertEqual(complete(["ddprun", "train.py", "--"], framework=True), [])


class Rdzvd(unittest.TestCase):
    def test_daemon_flags(self):
        self.assertEqual(complete(["ddprun-rdzvd", "--log-l"], command="ddprun-rdzvd"), ["--log-level"])
        self.assertEqual(complete(["ddprun-rdzvd", "--log-level", "e"], command="ddprun-rdzvd"), ["error"])
        self.assertNotIn("--port_file", complete(["ddprun-rdzvd", "--po"], command="ddprun-rdzvd"))


if __name__ == "__main__":
    unittest.main(verbosity=2)
