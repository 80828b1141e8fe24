"""ddprun-rdzvd as a process: the native rendezvous frames of docs/protocol.md §9, written by an
independent (Python) encoder and HMAC (hmac module), the handshake with a token from
DDPRUN_RDZV_TOKEN or --token-file, --token refused, and STATUS.

Readiness is the daemon's `listening on HOST:PORT` line; every socket read has a deadline; the
daemon is killed on the way out.
"""
import hashlib
import hmac
import json
import os
import select
import signal
import socket
import struct
import subprocess
import tempfile
import time

BIN_DIR = os.environ.get("DDPRUN_BIN_DIR", "")
children = []


def start_daemon(args, env_token=None):
    env = dict(os.environ)
    env.pop("DDPRUN_RDZV_TOKEN", None)
    if env_token is not None:
        env["DDPRUN_RDZV_TOKEN"] = env_token
    p = subprocess.Popen([os.path.join(BIN_DIR, "ddprun-rdzvd"), "--host", "127.0.0.1", "--port", "0",
                          "--log-level", "warning"] + args, stdout=subprocess.PIPE, env=env,
                         start_new_session=True)
    children.append(p)
    buf = b""
    deadline = time.monotonic() + 30
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"no readiness line (have {buf!r})"
        r, _, _ = select.select([p.stdout], [], [], left)
        if r:
            chunk = os.read(p.stdout.fileno(), 4096)
            assert chunk, f"ddprun-rdzvd exited early (have {buf!r})"
            buf += chunk
    line = buf.split(b"\n", 1)[0].decode()
    prefix = "listening on 127.0.0.1:"
    assert line.startswith(prefix), line
    return p, int(line[len(prefix):])


def frame(op, obj):
    body = json.dumps(obj).encode()
    return struct.pack("<BI", op, len(body)) + body


def recv_exact(sock, n, deadline):
    out = b""
    while len(out) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out after {len(out)} of {n} bytes"
        sock.settimeout(left)
        chunk = sock.recv(n - len(out))
        assert chunk, f"connection closed after {len(out)} of {n} bytes"
        out += chunk
    return out


def read_frame(sock, timeout=10):
    deadline = time.monotonic() + timeout
    op, n = struct.unpack("<BI", recv_exact(sock, 5, deadline))
    return op, json.loads(recv_exact(sock, n, deadline))


def handshake(sock, token, run_id):
    """HELLO / CHALLENGE / AUTH / AUTH_OK; checks the server's MAC. Returns None or the REFUSED."""
    client_nonce = os.urandom(32).hex()
    sock.sendall(frame(0x48, {"v": 1, "client_nonce": client_nonce}))
    op, msg = read_frame(sock)
    assert op == 0x68, f"expected CHALLENGE, got 0x{op:02x} {msg}"
    assert msg["auth"] is True, msg
    server_nonce = msg["server_nonce"]
    mac = hmac.new(token.encode(), b"ddprun-rdzv-client-v1\0" + (server_nonce + client_nonce + run_id).encode(),
                   hashlib.sha256).hexdigest()
    sock.sendall(frame(0x49, {"run_id": run_id, "mac": mac}))
    op, msg = read_frame(sock)
    if op == 0x64:
        return msg
    assert op == 0x69, f"expected AUTH_OK, got 0x{op:02x} {msg}"
    want = hmac.new(token.encode(), b"ddprun-rdzv-server-v1\0" + (client_nonce + server_nonce + run_id).encode(),
                    hashlib.sha256).hexdigest()
    assert msg["mac"] == want, "the daemon's AUTH_OK MAC is wrong"
    return None


def join_frame(i=1, nccl_ids=0):
    node_id = {"addr": "127.0.0.1", "pid": 4000 + i, "instance": f"py-{i}"}
    config = {"min_nodes": 1, "max_nodes": 1, "max_restarts": 0, "missed_heartbeats": 3,
              "join_timeout_ms": 10000, "last_call_timeout_ms": 100, "close_timeout_ms": 5000,
              "heartbeat_interval_ms": 1000, "exit_barrier_timeout_ms": 10000, "rebuild_grace_ms": 1000}
    node = {"id": node_id, "addr": "127.0.0.1", "local_world_size": 2, "store_host": "127.0.0.1",
            "store_port": 45678}
    if nccl_ids:
        node["nccl_ids"] = "ab" * (128 * nccl_ids)
    return frame(0x40, {"run_id": "py-job", "node": node, "config": config})


def check_token_daemon(args, env_token, good):
    p, port = start_daemon(args, env_token)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as bad:
        msg = handshake(bad, "wrong", "py-job")
        assert msg is not None and "authentication failed" in msg["reason"], msg
        bad.settimeout(10)
        assert bad.recv(1) == b"", "a failed AUTH must close the connection"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as noauth:
        noauth.sendall(join_frame(3))
        op, msg = read_frame(noauth)
        assert op == 0x64 and "authentication required" in msg["reason"], msg
    with socket.create_connection(("127.0.0.1", port), timeout=10) as ok:
        assert handshake(ok, good, "py-job") is None
        ok.sendall(join_frame(2))
        op, msg = read_frame(ok)
        assert op == 0x6A, f"expected JOINED, got 0x{op:02x} {msg}"
        assert len(msg["node_secret"]) == 32, msg
        op, msg = read_frame(ok)
        while op == 0x66:  # PROGRESS lines may precede the assignment
            op, msg = read_frame(ok)
        assert op == 0x60, f"expected ASSIGNMENT, got 0x{op:02x} {msg}"
        a = msg["assignment"]
        assert (a["group_rank"], a["group_world_size"], a["world_size"]) == (0, 1, 2), a
        assert (a["master_addr"], a["master_port"]) == ("127.0.0.1", 45678), a
        # STATUS on another connection, authenticated for every job: the job and its participant.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as st:
            assert handshake(st, good, "*") is None
            st.sendall(frame(0x47, {"run_id": ""}))
            op, msg = read_frame(st)
            assert op == 0x67, f"expected STATUS_REPLY, got 0x{op:02x}"
            jobs = msg["jobs"]
            assert [j["run_id"] for j in jobs] == ["py-job"], jobs
            assert jobs[0]["state"] == "running", jobs[0]
            assert jobs[0]["members"][0]["role"] == "participant", jobs[0]
        # A malformed frame closes only that connection.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as junk:
            junk.sendall(frame(0x42, {"run_id": "py-job"}))
            junk.settimeout(10)
            assert junk.recv(1) == b"", "a bad frame must close the connection"
        ok.sendall(frame(0x45, {"run_id": "py-job", "node": {"addr": "127.0.0.1", "pid": 4002,
                                                              "instance": "py-2"}, "round": 0}))
        op, msg = read_frame(ok)
        assert op == 0x63, f"expected JOB_COMPLETED, got 0x{op:02x} {msg}"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 0


def check_token_flag_refused():
    r = subprocess.run([os.path.join(BIN_DIR, "ddprun-rdzvd"), "--port", "0", "--token", "visible"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r
    assert "--token-file" in r.stderr and "DDPRUN_RDZV_TOKEN" in r.stderr, r.stderr
    assert "visible" not in r.stderr, r.stderr


def check_negative_limits_refused():
    # Before: CLI11 read "-1" into an unsigned limit as its largest value, so `--max-members -1`
    # silently meant no cap at all.
    for flag in ("--max-members", "--max-member-bytes", "--max-jobs", "--max-buffered-bytes", "--max-key-bytes"):
        r = subprocess.run([os.path.join(BIN_DIR, "ddprun-rdzvd"), "--port", "0", flag, "-1"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2, (flag, r)
        assert f"{flag}: '-1' is negative: give a number of 0 or more" in r.stderr, r.stderr


def check_member_bytes_cap():
    # Before: members were capped by count only; each keeps the NCCL IDs its JOIN offered (up to
    # ~512 KiB in a 1 MiB frame), so --max-members alone let the daemon be made to hold ~128 GiB.
    # 64 KiB: room for a plain member (about 1 KiB), not for one offering 2,048 IDs (512 KiB counted).
    p, port = start_daemon(["--max-member-bytes", "65536"], "tok")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as big:
        assert handshake(big, "tok", "py-job") is None
        big.sendall(join_frame(5, nccl_ids=2048))
        op, msg = read_frame(big)
        assert op == 0x64, f"expected REFUSED, got 0x{op:02x} {msg}"
        assert "--max-member-bytes" in msg["reason"] and "2048 NCCL unique IDs" in msg["reason"], msg
    with socket.create_connection(("127.0.0.1", port), timeout=10) as small:
        assert handshake(small, "tok", "py-job") is None
        small.sendall(join_frame(6, nccl_ids=1))
        op, msg = read_frame(small)
        assert op == 0x6A, f"expected JOINED, got 0x{op:02x} {msg}"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 0


def main():
    check_token_flag_refused()
    check_negative_limits_refused()
    check_member_bytes_cap()
    check_token_daemon([], "env-token", "env-token")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "token")
        with open(path, "w") as f:
            f.write("file-token\n")
        os.chmod(path, 0o600)
        check_token_daemon(["--token-file", path], "env-token", "file-token")
    print("OK")


if __name__ == "__main__":
    try:
        main()
    finally:
        for c in children:
            if c.poll() is None:
                os.killpg(c.pid, signal.SIGKILL)
                c.wait()
