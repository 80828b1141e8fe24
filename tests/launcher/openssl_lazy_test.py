"""bin/ddprun loads OpenSSL on first use (rendezvous/openssl/, DDPRUN_LAZY_OPENSSL).

bin/ddprun has no OpenSSL linked in, a plain launch never maps libssl or libcrypto (read from the agent's /proc/PID/maps by its own
worker); a rendezvous with a token (HMAC-SHA256 handshake against a real ddprun-rdzvd) loads
them and runs the job; with libssl.so.3 unloadable (an empty file bound over it in a private
mount namespace, root only) the same job fails at once with an error that names the feature,
the library and what to install, and leaves nothing running.

Run by ctest (ddprun_add_python_test) with DDPRUN_BIN_DIR set.
"""
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

BIN_DIR = os.path.abspath(os.environ["DDPRUN_BIN_DIR"])
DDPRUN = os.path.join(BIN_DIR, "ddprun")
RDZVD = os.path.join(BIN_DIR, "ddprun-rdzvd")
# The worker: how many of its parent's (the agent's) mappings are OpenSSL's, into a file.
COUNT_OPENSSL = 'grep -cE "/libssl\\.so|/libcrypto\\.so" /proc/$PPID/maps > "$0"; grep -c ddprun /proc/$PPID/maps >> "$0"'


def base_env():
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("PET_") or k == "DDPRUN_RDZV_TOKEN":
            del env[k]
    return env


def system_libssl():
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] == "libssl.so.3" and "x86-64" in line:
            return os.path.realpath(parts[-1])
    return None


class Daemon:
    """ddprun-rdzvd on 127.0.0.1, port 0, with a token; its readiness line gives the port."""

    def __init__(self, token):
        env = base_env()
        env["DDPRUN_RDZV_TOKEN"] = token
        self.p = subprocess.Popen([RDZVD, "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"],
                                  stdout=subprocess.PIPE, env=env, start_new_session=True)
        buf = b""
        deadline = time.monotonic() + 30
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise AssertionError("ddprun-rdzvd gave no readiness line (have %r)" % buf)
            if select.select([self.p.stdout], [], [], left)[0]:
                chunk = os.read(self.p.stdout.fileno(), 4096)
                if not chunk:
                    self.close()
                    raise AssertionError("ddprun-rdzvd exited early (have %r)" % buf)
                buf += chunk
        line = buf.split(b"\n", 1)[0].decode()
        prefix = "listening on 127.0.0.1:"
        assert line.startswith(prefix), line
        self.port = int(line[len(prefix):])

    def close(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=10)
        self.p.stdout.close()


class LazyOpenSSL(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="ddprun-openssl-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def counts(self, path):
        with open(path) as f:
            openssl, ddprun = (int(x) for x in f.read().split())
        self.assertGreater(ddprun, 0, "the worker did not read its agent's maps (wrong parent?)")
        return openssl

    def token_job(self, port, out, run_id, prefix=()):
        env = base_env()
        env["DDPRUN_RDZV_TOKEN"] = "s3cret"
        args = list(prefix) + [DDPRUN, "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", "127.0.0.1:%d" % port, "--rdzv-id", run_id, "--no-python",
                               "sh", "-c", COUNT_OPENSSL, out]
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)

    def test_openssl_is_not_linked_in(self):
        # libcrypto's start-up code reads this variable: present when OpenSSL is linked statically.
        with open(DDPRUN, "rb") as f:
            self.assertNotIn(b"OPENSSL_ia32cap", f.read(), "bin/ddprun has OpenSSL linked in")

    def test_plain_launch_maps_no_openssl(self):
        out = os.path.join(self.dir, "plain")
        r = subprocess.run([DDPRUN, "--master-port", "0", "--nproc-per-node", "1", "--no-python", "sh", "-c",
                            COUNT_OPENSSL, out],
                           env=base_env(), capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.counts(out), 0, "a single-node launch mapped OpenSSL")

    def test_token_handshake_loads_openssl(self):
        d = Daemon("s3cret")
        try:
            out = os.path.join(self.dir, "token")
            r = self.token_job(d.port, out, "lazy-ok")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertGreater(self.counts(out), 0, "the token handshake ran without OpenSSL mapped?")
        finally:
            d.close()

    @unittest.skipUnless(os.geteuid() == 0 and shutil.which("unshare"), "needs root and unshare (mount namespace)")
    def test_unloadable_openssl_is_a_clear_error(self):
        lib = system_libssl()
        if lib is None:
            self.skipTest("no x86-64 libssl.so.3 in ldconfig's cache")
        d = Daemon("s3cret")
        try:
            out = os.path.join(self.dir, "missing")
            hide = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind /dev/null "$0" && exec "$@"', lib]
            r = self.token_job(d.port, out, "lazy-missing", prefix=hide)
            self.assertEqual(r.returncode, 1, r.stderr)
            for text in ["the rendezvous handshake with a token", "needs OpenSSL 3", "libssl.so.3",
                         "apt-get install libssl3"]:
                self.assertIn(text, r.stderr)
            self.assertNotIn("internal error", r.stderr)
            self.assertFalse(os.path.exists(out), "a worker ran although the handshake failed")
            self.assertIsNone(d.p.poll(), "the daemon died")
        finally:
            d.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
