"""The generated man pages say what --help says: the same flags, spellings, value placeholders,
help sentences, defaults and PET_* forms, for ddprun, ddprun status and ddprun-rdzvd. Both sides
are parsed into {flag: fields} and compared field by field (formatting is free to differ). The
pages must also render warning-free with groff -ww and through man -l.

Run by ctest with DDPRUN_BIN_DIR set; argv[1] is the build tree's share/ directory.
"""
import os
import re
import shutil
import subprocess
import sys
import unittest

BIN = os.environ["DDPRUN_BIN_DIR"]
SHARE = sys.argv.pop(1) if len(sys.argv) > 1 else os.path.join(BIN, "..", "share")
DDPRUN_MAN = os.path.join(SHARE, "man", "man1", "ddprun.1")
RDZVD_MAN = os.path.join(SHARE, "man", "man8", "ddprun-rdzvd.8")
NCCL_ID_MAN = os.path.join(SHARE, "man", "man1", "ddprun-nccl-id.1")  # written by hand


def run(args):
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise AssertionError("%s exited %d: %s" % (args, r.returncode, r.stderr))
    return r.stdout


def split_help(text):
    """'help. Default: X. [env: PET_X]' -> (help, default, env)."""
    text = " ".join(text.split())
    env = None
    m = re.search(r"\s*\[env: (\S+)\]$", text)
    if m:
        env, text = m.group(1), text[:m.start()]
    default = None
    at = text.rfind("Default: ")
    if at >= 0 and text.endswith("."):
        default, text = text[at + len("Default: "):-1], text[:at].rstrip()
    return text, default, env


def entry(names_and_meta, body):
    head, _, meta = names_and_meta.strip().replace(", -", ",-").partition(" ")
    names = [n.strip() for n in head.replace(", ", ",").split(",") if n.strip()]
    help_text, default, env = split_help(body)
    return {"names": sorted(names), "metavar": meta.strip(), "help": help_text, "default": default, "env": env}


def key(e):
    return next(n for n in e["names"] if n.startswith("--"))


def parse_cli11_help(text):
    """CLI11's --help: '  NAMES META   description' or the description on the next lines."""
    out = {}
    lines = text.split("\n")
    i = lines.index("Options:") + 1
    while i < len(lines) and lines[i].strip():
        line = lines[i]
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        assert m, "unexpected --help line: %r" % line
        body = [m.group(2) or ""]
        i += 1
        while i < len(lines) and lines[i].startswith(" " * 10) and lines[i].strip():
            body.append(lines[i].strip())
            i += 1
        e = entry(m.group(1), " ".join(body))
        e["metavar"] = re.sub(r" \.\.\.$", "", e["metavar"])  # CLI11 marks a repeatable value "OPT ..."
        out[key(e)] = e
    return out


def parse_status_help(text):
    """`ddprun status --help`: '  NAMES META' then the paragraph indented by 8."""
    out = {}
    lines = text.split("\n")
    i = lines.index("Options:") + 1
    while i < len(lines) and lines[i].strip():
        names = lines[i]
        assert names.startswith("  -") and not names.startswith("   "), names
        body = []
        i += 1
        while i < len(lines) and lines[i].startswith(" " * 8):
            body.append(lines[i].strip())
            i += 1
        e = entry(names, " ".join(body))
        out[key(e)] = e
    return out


def unroff(s):
    s = re.sub(r"\\f[BIR]", "", s)
    return s.replace("\\-", "-").replace("\\e", "\\").replace("\\&", "")


def parse_man(path):
    """{section or subsection: {flag: entry}} from the roff source's .TP option lists."""
    with open(path) as f:
        lines = f.read().split("\n")
    sections = {}
    where = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(".SH "):
            where = line[4:].strip('"')
        elif line.startswith(".SS "):
            where = unroff(line[4:].strip('"'))
        elif line == ".TP" and where in ("OPTIONS",) or (line == ".TP" and where and where.startswith("ddprun ")):
            tag, body = unroff(lines[i + 1]), unroff(lines[i + 2])
            m = re.search(r"\s*Environment: (\S+)\.$", body)
            env = None
            if m:
                env, body = m.group(1), body[:m.start()]
            names = re.match(r"^((?:-[^ ,]+(?:, )?)+)(?: (.*))?$", tag)
            e = entry(names.group(1).replace(", ", ",") + " " + (names.group(2) or ""), body)
            e["env"] = env
            sections.setdefault(where, {})[key(e)] = e
            i += 2
        i += 1
    return sections


class DdprunPage(unittest.TestCase):
    def test_options_match_help(self):
        page = parse_man(DDPRUN_MAN)["OPTIONS"]
        help_ = parse_cli11_help(run([os.path.join(BIN, "ddprun"), "--help"]))
        help_["--help"]["help"] = help_["--help"]["help"] + "."  # CLI11 writes it without a period
        self.assertGreater(len(help_), 50)
        self.assertEqual(sorted(page), sorted(help_), "flags differ between ddprun.1 and --help")
        for flag in help_:
            for field in ("names", "metavar", "help", "default", "env"):
                self.assertEqual(page[flag][field], help_[flag][field], "%s: %s differs" % (flag, field))

    def test_status_options_match_status_help(self):
        page = parse_man(DDPRUN_MAN)["ddprun status"]
        help_ = parse_status_help(run([os.path.join(BIN, "ddprun"), "status", "--help"]))
        self.assertIn("--watch", help_)
        self.assertEqual(sorted(page), sorted(help_))
        for flag in help_:
            self.assertEqual(page[flag], help_[flag], flag)

    def test_hidden_flag_is_not_documented(self):
        with open(DDPRUN_MAN) as f:
            self.assertNotIn("node\\-label", f.read())


class RdzvdPage(unittest.TestCase):
    def test_options_match_help(self):
        """The daemon's --help is still CLI11's own strings: same flags, sentences and defaults."""
        page = parse_man(RDZVD_MAN)["OPTIONS"]
        text = run([os.path.join(BIN, "ddprun-rdzvd"), "--help"])
        help_ = {}
        for flag, e in parse_cli11_help(text).items():
            h = e["help"]
            default = None
            m = re.search(r"\s*\(default: (.*)\)$", h)
            if m:
                default, h = m.group(1), h[:m.start()]
            m = re.search(r"=(\S+)$", e["metavar"])  # CLI11: "TYPE=DEFAULT"
            if m:
                default = m.group(1)
            help_[flag] = {"names": e["names"], "help": h.rstrip("."), "default": default}
        self.assertEqual(sorted(page), sorted(help_), "flags differ between ddprun-rdzvd.8 and --help")
        for flag, e in help_.items():
            self.assertEqual(page[flag]["names"], e["names"], flag)
            self.assertEqual(page[flag]["help"].rstrip("."), e["help"], flag)
            self.assertEqual(page[flag]["default"], e["default"], flag)


class NcclIdPage(unittest.TestCase):
    def test_page_says_what_help_says(self):
        """The hand-written page: the usage, every flag of it and the exit code for a missing NCCL."""
        usage = run([os.path.join(BIN, "ddprun-nccl-id"), "--help"]).splitlines()[0]
        self.assertTrue(usage.startswith("usage: "), usage)
        r = subprocess.run(["groff", "-man", "-Tascii", "-P-cbou", NCCL_ID_MAN], capture_output=True, text=True,
                           timeout=60)
        text = " ".join(r.stdout.split())
        self.assertIn(usage[len("usage: "):], text)
        for flag in re.findall(r"--[a-z-]+", usage):
            self.assertIn(flag, text)
        self.assertIn("3 when NCCL cannot be loaded", text)


class Rendering(unittest.TestCase):
    def test_groff_is_warning_free(self):
        for page in (DDPRUN_MAN, RDZVD_MAN, NCCL_ID_MAN):
            r = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", page], capture_output=True, text=True,
                               timeout=60)
            self.assertEqual((r.returncode, r.stderr), (0, ""), page)

    @unittest.skipUnless(shutil.which("man"), "man-db is not installed")
    def test_man_renders_every_flag(self):
        env = dict(os.environ, MANWIDTH="100", MAN_KEEP_FORMATTING="0")
        r = subprocess.run(["man", "-l", DDPRUN_MAN], capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stderr, "")
        text = re.sub(".\b", "", r.stdout)  # overstrike bold/underline
        for flag in parse_man(DDPRUN_MAN)["OPTIONS"]:
            self.assertIn(flag, text, "man -l output lacks %s" % flag)
        self.assertIn("DDPRUN(1)", text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
