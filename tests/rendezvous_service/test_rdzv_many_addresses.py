"""ddprun-rdzvd with its per-address connection cap ON, agents on several 127.0.0.0/8 source
addresses (the shape of the 100,000-agent bench at a size CI bears): 1,200 agents, 400 from each
of three addresses with --max-connections-per-peer 400, each through HELLO / AUTH (token) / JOIN
into one job of min = max = 1,200. Every agent gets one ASSIGNMENT, ranks 0..1,199 once each;
then a 401st connection from a full address is closed by the daemon while one from a fresh
address is served (the cap counts each address on its own and holds under load).

Readiness is the daemon's `listening on HOST:PORT` line; every socket read has a deadline; the
daemon is killed on the way out.
"""
import json
import os
import signal
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_rdzvd_native as native  # noqa: E402

PER_ADDRESS = 400
ADDRESSES = ["127.2.0.1", "127.2.0.2", "127.2.0.3"]
N = PER_ADDRESS * len(ADDRESSES)
RUN_ID = "many-addresses"


def connect_from(source, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def join_frame(i, source):
    node_id = {"addr": source, "pid": 10000 + i, "instance": f"agent-{i}"}
    config = {"min_nodes": N, "max_nodes": N, "max_restarts": 0, "missed_heartbeats": 3,
              "join_timeout_ms": 120000, "last_call_timeout_ms": 120000, "close_timeout_ms": 5000,
              "heartbeat_interval_ms": 600000, "exit_barrier_timeout_ms": 10000, "rebuild_grace_ms": 1000}
    node = {"id": node_id, "addr": source, "local_world_size": 8, "store_host": source, "store_port": 20000 + i}
    return native.frame(0x40, {"run_id": RUN_ID, "node": node, "config": config})


def closed_by_daemon(sock, timeout=10):
    """True when the daemon closes the connection (EOF or reset) before `timeout`."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def main():
    with tempfile.TemporaryDirectory() as d:
        token_file = os.path.join(d, "token")
        with open(token_file, "w") as f:
            f.write("many-addresses-token\n")
        os.chmod(token_file, 0o600)
        p, port = native.start_daemon(["--token-file", token_file, "--max-connections-per-peer", str(PER_ADDRESS)])
        token = "many-addresses-token"
        agents = []
        for i in range(N):
            source = ADDRESSES[i // PER_ADDRESS]
            sock = connect_from(source, port)
            assert native.handshake(sock, token, RUN_ID) is None, f"agent {i} refused in the handshake"
            agents.append((sock, source))
        for i, (sock, source) in enumerate(agents):
            sock.sendall(join_frame(i, source))
            op, msg = native.read_frame(sock)
            assert op == 0x6A, f"agent {i}: expected JOINED, got 0x{op:02x} {msg}"
        ranks = set()
        for i, (sock, _) in enumerate(agents):
            op, msg = native.read_frame(sock, timeout=60)
            while op == 0x66:  # PROGRESS lines precede the assignment
                op, msg = native.read_frame(sock, timeout=60)
            assert op == 0x60, f"agent {i}: expected ASSIGNMENT, got 0x{op:02x} {msg}"
            a = msg["assignment"]
            assert a["group_world_size"] == N and a["world_size"] == 8 * N, a
            assert a["rank_offset"] == 8 * a["group_rank"], a
            ranks.add(a["group_rank"])
        assert ranks == set(range(N)), f"{N - len(ranks)} group ranks missing or repeated"

        # The cap holds per address: the full address's next connection is closed at once,
        # a fresh address is served.
        over = connect_from(ADDRESSES[0], port)
        try:
            over.sendall(native.frame(0x48, {"v": 1, "client_nonce": os.urandom(32).hex()}))
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert closed_by_daemon(over), f"connection {PER_ADDRESS + 1} from {ADDRESSES[0]} was not closed"
        over.close()
        fresh = connect_from("127.2.0.4", port)
        assert native.handshake(fresh, token, RUN_ID) is None, "a connection from a fresh address was refused"
        fresh.close()

        for sock, _ in agents:
            sock.close()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    print(json.dumps({"agents": N, "addresses": len(ADDRESSES), "per_address_cap": PER_ADDRESS}))
    print("OK")


if __name__ == "__main__":
    started = time.monotonic()
    try:
        main()
    finally:
        for c in native.children:
            if c.poll() is None:
                os.killpg(c.pid, signal.SIGKILL)
                c.wait()
    print(f"took {time.monotonic() - started:.1f} s")
