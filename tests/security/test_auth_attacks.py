"""Authentication attacks on ddprun-rdzvd (a token daemon), each with its expected outcome.

Two honest nodes (Python, raw sockets, the handshake computed with Python's hmac module) join a
job; then an attacker without the token, and one with the token but not owning the nodes, tries
every forged frame: STATUS, WORKER_FAILED, SUCCEEDED, LEAVE, HEARTBEAT, CLOSE, JOIN and REJOIN
with another node's id, frames for a job the connection did not authenticate for, and TCPStore
ops (a real torch TCPStore client). Every one must be answered REFUSED and closed, and the job
must be untouched (no push to the honest nodes, still running, no restart charged). Then the
honest node moves to a new connection with its node secret, and --allow-unauthenticated-store
lets the torch client in.

The daemon runs under RLIMIT_AS (a regression fails instead of calling the OOM killer); every
socket read has a deadline; every process is killed on the way out.
"""
import hashlib
import hmac
import json
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

BIN_DIR = os.environ.get("DDPRUN_BIN_DIR", "")
TORCH_PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
TOKEN = "attack-suite-token"
AS_LIMIT = 2 << 30
children = []


def start_daemon(extra=()):
    env = dict(os.environ)
    env["DDPRUN_RDZV_TOKEN"] = TOKEN

    capped = not harness.sanitized(os.path.join(BIN_DIR, "ddprun-rdzvd"))  # ASan reserves terabytes

    def cap():
        if capped:
            resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    p = subprocess.Popen([os.path.join(BIN_DIR, "ddprun-rdzvd"), "--host", "127.0.0.1", "--port", "0",
                          "--log-level", "warning"] + list(extra), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=env, start_new_session=True, preexec_fn=cap)
    children.append(p)
    buf = b""
    deadline = time.monotonic() + 30
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"no readiness line (have {buf!r})"
        r, _, _ = select.select([p.stdout], [], [], left)
        if r:
            chunk = os.read(p.stdout.fileno(), 4096)
            assert chunk, "ddprun-rdzvd exited early"
            buf += chunk
    line = buf.split(b"\n", 1)[0].decode()
    return p, int(line.rsplit(":", 1)[1])


def frame(op, obj):
    body = json.dumps(obj).encode()
    return struct.pack("<BI", op, len(body)) + body


def recv_exact(sock, n, deadline):
    out = b""
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out after {len(out)} of {n} bytes")
        sock.settimeout(left)
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def read_frame(sock, timeout=10):
    deadline = time.monotonic() + timeout
    op, n = struct.unpack("<BI", recv_exact(sock, 5, deadline))
    return op, json.loads(recv_exact(sock, n, deadline))


def mac(label, a, b, run_id, token=TOKEN):
    return hmac.new(token.encode(), label + b"\0" + (a + b + run_id).encode(), hashlib.sha256).hexdigest()


def connect(port, token=None, run_id="victim"):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if token is None:
        return s
    cn = os.urandom(32).hex()
    s.sendall(frame(0x48, {"v": 1, "client_nonce": cn}))
    op, msg = read_frame(s)
    assert op == 0x68 and msg["auth"] is True, (op, msg)
    sn = msg["server_nonce"]
    s.sendall(frame(0x49, {"run_id": run_id, "mac": mac(b"ddprun-rdzv-client-v1", sn, cn, run_id, token)}))
    op, msg = read_frame(s)
    assert op == 0x69, (op, msg)
    assert msg["mac"] == mac(b"ddprun-rdzv-server-v1", cn, sn, run_id, token), "server MAC wrong"
    return s


def node_id(i):
    return {"addr": "127.0.0.1", "pid": 7000 + i, "instance": f"honest-{i}"}


CONFIG = {"min_nodes": 2, "max_nodes": 2, "max_restarts": 3, "missed_heartbeats": 30,
          "join_timeout_ms": 20000, "last_call_timeout_ms": 100, "close_timeout_ms": 5000,
          "heartbeat_interval_ms": 1000, "exit_barrier_timeout_ms": 10000, "rebuild_grace_ms": 1000}


def node_info(i):
    return {"id": node_id(i), "addr": "127.0.0.1", "local_world_size": 1, "store_host": "127.0.0.1",
            "store_port": 41000 + i}


def forged_frames(run_id="victim"):
    a = node_id(1)
    failure = {"round": 0, "node": a, "global_rank": 0, "local_rank": 0, "exit_code": 1, "message": "forged"}
    return {
        "STATUS": frame(0x47, {"run_id": ""}),
        "WORKER_FAILED": frame(0x44, {"run_id": run_id, "failure": failure}),
        "SUCCEEDED": frame(0x45, {"run_id": run_id, "node": a, "round": 0}),
        "LEAVE": frame(0x43, {"run_id": run_id, "node": a}),
        "HEARTBEAT": frame(0x42, {"run_id": run_id, "node": a}),
        "CLOSE": frame(0x46, {"run_id": run_id}),
        "JOIN as another node": frame(0x40, {"run_id": run_id, "node": node_info(1), "config": CONFIG}),
        "REJOIN without the secret": frame(0x41, {"run_id": run_id, "node": node_info(1), "config": CONFIG}),
        "REJOIN with a wrong secret": frame(0x41, {"run_id": run_id, "node": node_info(1), "config": CONFIG,
                                                   "node_secret": "00" * 16}),
    }


def expect_refused(sock, what, needle):
    op, msg = read_frame(sock)
    assert op == 0x64, f"{what}: expected REFUSED, got 0x{op:02x} {msg}"
    assert needle in msg["reason"], f"{what}: reason {msg['reason']!r} lacks {needle!r}"
    sock.settimeout(10)
    try:
        assert sock.recv(1) == b"", f"{what}: the connection must be closed after REFUSED"
    except ConnectionResetError:
        pass


def expect_quiet(sock, what):
    """No push (RESTART, JOB_FAILED, JOB_COMPLETED, ...) reached an honest node."""
    sock.settimeout(0.2)
    try:
        data = sock.recv(4096)
    except socket.timeout:
        return
    assert False, f"{what}: an honest node got {data[:80]!r}"


def status(port):
    with connect(port, TOKEN, "*") as s:
        s.sendall(frame(0x47, {"run_id": "victim"}))
        op, msg = read_frame(s)
        assert op == 0x67, (op, msg)
        return msg["jobs"][0]


def torch_store_get(port, expect_ok):
    code = ("import datetime, sys, torch.distributed as d\n"
            "try:\n"
            "  s = d.TCPStore('127.0.0.1', %d, 1, False, timeout=datetime.timedelta(seconds=5))\n"
            "  s.set('k', 'v'); print(s.get('k')); sys.exit(0)\n"
            "except Exception as e:\n"
            "  print('ERR', e); sys.exit(3)\n" % port)
    r = subprocess.run([TORCH_PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    if expect_ok:
        assert r.returncode == 0, f"torch client refused with --allow-unauthenticated-store: {r.stdout}{r.stderr}"
    else:
        assert r.returncode != 0, f"torch client used the store of a token daemon: {r.stdout}"


def main():
    p, port = start_daemon()
    honest = {}
    for i in (1, 2):
        s = connect(port, TOKEN)
        s.sendall(frame(0x40, {"run_id": "victim", "node": node_info(i), "config": CONFIG}))
        honest[i] = s
    secrets = {}
    for i, s in honest.items():
        op, msg = read_frame(s)
        while op == 0x66:
            op, msg = read_frame(s)
        if op == 0x6A:
            secrets[i] = msg["node_secret"]
            op, msg = read_frame(s)
        while op == 0x66:
            op, msg = read_frame(s)
        assert op == 0x60, f"node {i}: expected ASSIGNMENT, got 0x{op:02x} {msg}"
    assert set(secrets) == {1, 2}, secrets

    # 1. No token at all: every frame is refused before it is looked at.
    for what, data in forged_frames().items():
        with connect(port) as s:
            s.sendall(data)
            expect_refused(s, "no token, " + what, "authentication required")
    # A wrong token: AUTH itself fails.
    with connect(port) as s:
        s.sendall(frame(0x48, {"v": 1, "client_nonce": "ab" * 32}))
        op, msg = read_frame(s)
        s.sendall(frame(0x49, {"run_id": "victim", "mac": "00" * 32}))
        expect_refused(s, "wrong MAC", "authentication failed")
    # 2. The token, but not the node: ownership is the connection's.
    for what, data in forged_frames().items():
        if what == "STATUS":
            continue  # an authenticated connection may read the status of its job
        with connect(port, TOKEN) as s:
            s.sendall(data)
            needle = {"CLOSE": "owns one of its members", "JOIN as another node": "already a member",
                      "REJOIN without the secret": "node secret", "REJOIN with a wrong secret": "node secret"}
            expect_refused(s, "token holder, " + what, needle.get(what, "not owned by this connection"))
    # 3. Authenticated for another job: frames for the victim are refused.
    for what, data in forged_frames().items():
        if what == "STATUS":
            data = frame(0x47, {"run_id": "victim"})
        with connect(port, TOKEN, "other-job") as s:
            s.sendall(data)
            expect_refused(s, "other job, " + what, "authenticated for rendezvous 'other-job'")
    # 4. TCPStore ops on a token daemon: closed.
    torch_store_get(port, expect_ok=False)
    # ... at their first byte: a SET announcing a 64 MiB value is not buffered until its end
    # (many such connections held the daemon's whole buffer budget without the token).
    with connect(port) as s:
        s.sendall(b"\x00" + struct.pack("<Q", 1) + b"k" + struct.pack("<Q", 64 << 20) + b"x" * 4096)
        assert harness.closed_by_peer(s, 5), "a store request before the handshake was read on"
    for i, s in honest.items():
        expect_quiet(s, "after the attacks")
    job = status(port)
    assert job["state"] == "running" and job["restarts_used"] == 0, job
    assert sorted(m["id"]["pid"] for m in job["members"]) == [7001, 7002], job

    # 5. The honest node moves to a new connection with its secret; the old one no longer speaks.
    moved = connect(port, TOKEN)
    moved.sendall(frame(0x41, {"run_id": "victim", "node": node_info(1), "config": CONFIG,
                               "node_secret": secrets[1]}))
    op, msg = read_frame(moved)
    assert op == 0x6A and msg["node_secret"] == secrets[1], (op, msg)
    op, msg = read_frame(moved)  # the rejoin's answer: the running assignment
    assert op == 0x60, (op, msg)
    honest[1].sendall(frame(0x42, {"run_id": "victim", "node": node_id(1)}))
    expect_refused(honest[1], "heartbeat from the old connection", "not owned by this connection")
    moved.sendall(frame(0x42, {"run_id": "victim", "node": node_id(1)}))
    expect_quiet(moved, "heartbeat from the new owner")
    assert status(port)["restarts_used"] == 0
    assert p.poll() is None, "the daemon died"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 0

    # 6. The documented opt-in: torch's c10d clients may use the store.
    p2, port2 = start_daemon(["--allow-unauthenticated-store"])
    torch_store_get(port2, expect_ok=True)
    with connect(port2) as s:  # still no native frame without the token
        s.sendall(forged_frames()["STATUS"])
        expect_refused(s, "opt-in daemon, STATUS", "authentication required")
    p2.send_signal(signal.SIGTERM)
    assert p2.wait(timeout=10) == 0

    # 7. Connections that never authenticate cannot hold the slots: at --max-connections the
    # oldest of them gives way to a new connection, and each is closed after
    # --handshake-timeout-ms. Before, 40 silent connections locked every agent out for good.
    p3, port3 = start_daemon(["--max-connections", "40", "--handshake-timeout-ms", "60000"])
    silent = [connect(port3) for _ in range(20)]
    hello_only = []
    for _ in range(20):
        c = connect(port3)
        c.sendall(frame(0x48, {"v": 1, "client_nonce": os.urandom(32).hex()}))
        read_frame(c)  # the server's nonce: it now waits for AUTH
        hello_only.append(c)
    agents = [connect(port3, TOKEN, "late-agent") for _ in range(3)]  # each handshake completes
    assert all(harness.closed_by_peer(c, 20) for c in silent[:3]), "the 3 oldest waiting connections were kept"
    # Each gave way as an agent connected, before its handshake: the others are still open.
    kept = [c for c in silent[3:] + hello_only if not harness.closed_by_peer(c, 0.02)]
    assert len(kept) == 37, f"{37 - len(kept)} more waiting connections were closed than agents came"
    for c in agents:
        c.close()
    p3.send_signal(signal.SIGTERM)
    assert p3.wait(timeout=10) == 0
    for c in silent + hello_only:
        c.close()
    p4, port4 = start_daemon(["--handshake-timeout-ms", "200"])
    slow = connect(port4)
    assert harness.closed_by_peer(slow, 20), "a connection that never authenticated was kept"
    with connect(port4, TOKEN, "victim") as s:  # an authenticated one stays, silent or not
        assert not harness.closed_by_peer(s, 1.0), "an authenticated connection was closed"
    p4.send_signal(signal.SIGTERM)
    assert p4.wait(timeout=10) == 0
    print("OK")


if __name__ == "__main__":
    try:
        main()
    finally:
        for c in children:
            if c.poll() is None:
                os.killpg(c.pid, signal.SIGKILL)
                c.wait()
