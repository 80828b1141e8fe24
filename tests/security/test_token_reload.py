"""SIGHUP makes ddprun-rdzvd re-read --token-file: new connections must prove the new token, a
connection that authenticated with the old one keeps working, and a bad file keeps the old token.
With --previous-token-file the token rotated out still authenticates connections bound to one job,
which may REJOIN but not JOIN (nor be relays or read every job); SIGHUP re-reads it too, and a
removed file ends the overlap.

Readiness comes from the daemon's own log lines (stderr, read with a deadline); the daemon runs
under RLIMIT_AS (skipped for ASan builds) and is stopped on the way out.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import test_auth_attacks as auth  # noqa: E402


def wait_log(p, needle, deadline):
    while True:
        line = harness.read_line(p.stderr.fileno(), deadline)
        if needle in line:
            return line


def authenticates(port, token):
    try:
        s = auth.connect(port, token, "*")
    except (AssertionError, ConnectionError, TimeoutError):
        return False
    s.close()
    return True


def status_ok(sock):
    sock.sendall(auth.frame(0x47, {"run_id": ""}))
    op, _ = auth.read_frame(sock)
    return op == 0x67


def rejoined(sock, i, secret="ab" * 16):
    """REJOIN as node i (a node the daemon does not know has its secret adopted)."""
    sock.sendall(auth.frame(0x41, {"run_id": "job1", "node": auth.node_info(i), "config": auth.CONFIG,
                                   "node_secret": secret}))
    op, msg = auth.read_frame(sock)
    while op == 0x66:  # progress
        op, msg = auth.read_frame(sock)
    return op == 0x6A, (op, msg)


def start(args, env, cap):
    p = subprocess.Popen([harness.RDZVD, "--host", harness.HOST, "--port", "0", "--log-level", "info"] + args,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=harness.limits_preexec(cap))
    port = int(harness.read_line(p.stdout.fileno(), time.monotonic() + 30).strip().rsplit(":", 1)[1])
    return p, port


def previous_token(tmp, env, cap):
    path = os.path.join(tmp, "token2")
    previous = os.path.join(tmp, "previous")
    for name, value in ((path, "new-token"), (previous, "old-token")):
        with open(name, "w") as f:
            f.write(value + "\n")
        os.chmod(name, 0o600)
    # Without a current token from a file the flag is refused.
    r = subprocess.run([harness.RDZVD, "--host", harness.HOST, "--port", "0", "--previous-token-file", previous],
                       capture_output=True, text=True, env=dict(env, DDPRUN_RDZV_TOKEN="new-token"), timeout=30)
    assert r.returncode == 2 and "--previous-token-file needs a current token from --token-file" in r.stderr, \
        (r.returncode, r.stderr)
    # Past the window (0 s here) only nodes the daemon knows re-register with the old token.
    p, port = start(["--token-file", path, "--previous-token-file", previous, "--previous-token-window", "0"],
                    env, cap)
    try:
        with auth.connect(port, "old-token", "job1") as s:
            s.sendall(auth.frame(0x41, {"run_id": "job1", "node": auth.node_info(1), "config": auth.CONFIG,
                                        "node_secret": "ab" * 16}))
            auth.expect_refused(s, "REJOIN of an unknown node with the previous token",
                                "re-registers only nodes this daemon knows")
        with auth.connect(port, "new-token", "job1") as s:
            s.sendall(auth.frame(0x40, {"run_id": "job1", "node": auth.node_info(3), "config": auth.CONFIG}))
            op, msg = auth.read_frame(s)
            assert op == 0x6A, (op, msg)
            secret = msg["node_secret"]
        with auth.connect(port, "old-token", "job1") as s:  # a known node (a reconnect): accepted
            ok, got = rejoined(s, 3, secret)
            assert ok, f"a known node's REJOIN with the previous token was refused: {got}"
        with auth.connect(port, "old-token", "job1") as s:  # with a wrong secret: not
            s.sendall(auth.frame(0x41, {"run_id": "job1", "node": auth.node_info(3), "config": auth.CONFIG,
                                        "node_secret": "cd" * 16}))
            auth.expect_refused(s, "REJOIN with the previous token and a wrong secret", "without its node secret")
    finally:
        harness.stop(p)
    p, port = start(["--token-file", path, "--previous-token-file", previous], env, cap)
    try:
        # The old token binds a connection to one job; within the window after the start (a
        # daemon restart) a node it does not know may REJOIN...
        with auth.connect(port, "old-token", "job1") as s:
            ok, got = rejoined(s, 1)
            assert ok, f"a REJOIN with the previous token was not accepted: {got}"
        with auth.connect(port, "old-token", "job1") as s:  # ... and read its own job, no other
            s.sendall(auth.frame(0x47, {"run_id": "job2"}))
            auth.expect_refused(s, "STATUS of another job with the previous token", "authenticated for rendezvous")
        # ... but not JOIN, and it never binds every job (relays, STATUS of all jobs).
        with auth.connect(port, "old-token", "job1") as s:
            s.sendall(auth.frame(0x40, {"run_id": "job1", "node": auth.node_info(2), "config": auth.CONFIG}))
            auth.expect_refused(s, "JOIN with the previous token", "a JOIN needs the current token")
        assert not authenticates(port, "old-token"), "the previous token authenticated for every job"
        assert not authenticates(port, "other-token")
        with auth.connect(port, "new-token", "job1") as s:
            s.sendall(auth.frame(0x40, {"run_id": "job1", "node": auth.node_info(2), "config": auth.CONFIG}))
            op, msg = auth.read_frame(s)
            assert op == 0x6A, (op, msg)
        # The overlap ends: the file goes, SIGHUP.
        os.unlink(previous)
        p.send_signal(signal.SIGHUP)
        wait_log(p, "no previous token from now on", time.monotonic() + 30)
        try:
            auth.connect(port, "old-token", "job1").close()
            assert False, "the previous token still authenticates after its file was removed"
        except (AssertionError, ConnectionError, TimeoutError) as e:
            assert "still authenticates" not in str(e), e
        assert p.poll() is None, "the daemon died"
    finally:
        harness.stop(p)
    print("previous token: OK")


def main():
    with tempfile.TemporaryDirectory(prefix="ddprun_reload_") as tmp:
        path = os.path.join(tmp, "token")
        with open(path, "w") as f:
            f.write("old-token\n")
        os.chmod(path, 0o600)
        env = {k: v for k, v in os.environ.items() if k != "DDPRUN_RDZV_TOKEN"}
        cap = None if harness.sanitized(harness.RDZVD) else 2 * harness.GiB
        p, port = start(["--token-file", path], env, cap)
        try:
            old_conn = auth.connect(port, "old-token", "*")
            assert status_ok(old_conn)

            with open(path, "w") as f:
                f.write("new-token\n")
            p.send_signal(signal.SIGHUP)
            wait_log(p, "re-read the token", time.monotonic() + 30)
            assert not authenticates(port, "old-token"), "the old token still authenticates after SIGHUP"
            assert authenticates(port, "new-token"), "the new token is refused after SIGHUP"
            assert status_ok(old_conn), "a connection authenticated before SIGHUP was dropped"

            # A broken file keeps the current token.
            with open(path, "w") as f:
                f.write("\n")
            p.send_signal(signal.SIGHUP)
            line = wait_log(p, "SIGHUP", time.monotonic() + 30)
            assert "keeping the old token" in line, line
            assert "new-token" not in line, "the token must never be logged"
            assert authenticates(port, "new-token")
            old_conn.close()
            assert p.poll() is None, "the daemon died"
        finally:
            harness.stop(p)
        previous_token(tmp, env, cap)
    print("token reload: OK")


if __name__ == "__main__":
    main()
