"""Relay links whose other end stops reading (--link-stall-timeout-ms).

* the root closes a link that reads none of the bytes queued for it for the timeout (a link spoken
  by hand whose relayed client pipelines GETs of a 1 MiB value and which never reads): its log
  line names the relay's address, the bytes waiting, how long and the flag, and the connection the
  link carried ends with it. Before, the link and its clients waited for good;
* a link that reads slowly (a few KiB at a time, well within the timeout of each other) is making
  progress and stays, whatever its backlog; one with nothing queued stays however quiet;
* a relay whose root stops reading (a fake root that completes the handshake, then never reads
  again) counts the link lost: its clients are closed and, with --relink-timeout 0, it exits 1
  naming the stall and the flag;
* a relay SIGSTOPped while the root queues replies for it loses its link at the root; resumed
  (SIGCONT), it finds the link gone, links again and carries new clients.

Readiness is each process's `listening on HOST:PORT` line or a log line polled with a deadline.
"""
import hashlib
import hmac
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_rdzvd_native import children, frame, handshake, read_frame, recv_exact  # noqa: E402
from test_rdzvd_relay import gauge, wait_gauge  # noqa: E402

BIN_DIR = os.environ.get("DDPRUN_BIN_DIR", "")
RDZVD = os.path.join(BIN_DIR, "ddprun-rdzvd")
TOKEN = "stall-test-token"
STALL_MS = 300
VALIDATE = bytes.fromhex("00cef7853c")


def relay_frame(op, vid, payload=b""):
    return struct.pack("<BII", op, vid, len(payload)) + payload


def data_frames(vid, payload):
    """DATA frames of at most 64 KiB (under the link's 1 MiB per frame)."""
    return b"".join(relay_frame(0x71, vid, payload[i:i + 65536]) for i in range(0, len(payload), 65536))


def store_set(key, value):
    return bytes([1]) + struct.pack("<Q", len(key)) + key + struct.pack("<Q", len(value)) + value


def store_get(key):
    return bytes([3]) + struct.pack("<Q", len(key)) + key


def store_ping(n):
    return bytes([13]) + struct.pack("<I", n)


def start(args, log):
    """ddprun-rdzvd with stderr in `log`; returns (process, port) at its readiness line."""
    p = subprocess.Popen([RDZVD, "--host", "127.0.0.1", "--port", "0", "--log-level", "info"] + args,
                         stdout=subprocess.PIPE, stderr=open(log, "wb"), start_new_session=True)
    children.append(p)
    line = p.stdout.readline().decode()
    assert line.startswith("listening on 127.0.0.1:"), (line, p.poll(), open(log).read()[-3000:])
    return p, int(line.strip().rsplit(":", 1)[1])


def wait_log(log, text, what, timeout=20):
    deadline = time.monotonic() + timeout
    while True:
        with open(log) as f:
            got = f.read()
        if text in got:
            return got
        assert time.monotonic() < deadline, f"{what}: no {text!r} in the log:\n{got[-3000:]}"
        time.sleep(0.02)


def expect_closed(sock, what):
    """Reads to the end: EOF or a reset, within a deadline."""
    deadline = time.monotonic() + 20
    try:
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            if not sock.recv(1 << 20):
                return
            assert time.monotonic() < deadline, f"{what} was not closed"
    except ConnectionResetError:
        return
    except socket.timeout:
        raise AssertionError(f"{what} was not closed")


def link_by_hand(root_port, rcvbuf=None):
    """A relay link spoken by hand: authenticated for every job, RELAY, RELAY_OK."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window
    s.settimeout(10)
    s.connect(("127.0.0.1", root_port))
    assert handshake(s, TOKEN, "*") is None
    s.sendall(frame(0x4A, {"v": 1}))
    op, _ = read_frame(s)
    assert op == 0x6B, f"expected RELAY_OK, got 0x{op:02x}"
    return s


def start_root(token_file, log):
    """A root daemon with the test's short stall timeout: (process, port, metrics port)."""
    metrics_file = log + ".metrics-port"
    root, root_port = start(["--token-file", token_file, "--allow-unauthenticated-store", "--metrics-port", "0",
                             "--metrics-port-file", metrics_file, "--link-stall-timeout-ms", str(STALL_MS)], log)
    with open(metrics_file) as f:
        return root, root_port, int(f.read())


def flood(link, vid, gets):
    """Relayed connection `vid` on `link`: SET a 1 MiB value, then `gets` GETs of it (about
    `gets` MiB of replies queued for the link)."""
    link.sendall(relay_frame(0x70, vid, b"10.9.8.7:%d" % vid))
    link.sendall(data_frames(vid, VALIDATE + store_set(b"k", b"v" * (1 << 20)) + store_get(b"k") * gets))


def root_closes_stalled_link(tmp, token_file):
    log = os.path.join(tmp, "root.log")
    root, root_port, metrics_port = start_root(token_file, log)
    quiet = link_by_hand(root_port)  # nothing queued for it: never stalled, however quiet
    slow = link_by_hand(root_port, rcvbuf=8192)
    stuck = link_by_hand(root_port, rcvbuf=4096)
    stuck_port = stuck.getsockname()[1]
    flood(stuck, 1, 24)
    flood(slow, 2, 24)
    wait_gauge(metrics_port, "ddprun_rdzvd_relayed_connections", 2)
    # The slow link reads a little at a time, each read well within the timeout of the last, for
    # several timeouts: it makes progress, and stays.
    stream = bytearray()
    deadline = time.monotonic() + 5 * STALL_MS / 1000
    while time.monotonic() < deadline:
        slow.settimeout(STALL_MS / 1000)
        chunk = slow.recv(4096)
        assert chunk, f"the root closed a link that reads slowly:\n{open(log).read()[-3000:]}"
        stream += chunk
        time.sleep(STALL_MS / 1000 / 6)  # a slow reader, by design
    text = wait_log(log, f"closing connection from 127.0.0.1:{stuck_port}: relay link stalled", "the stuck link")
    line = next(l for l in text.splitlines() if f"127.0.0.1:{stuck_port}: relay link stalled" in l)
    assert "bytes wait for it" in line and f"(--link-stall-timeout-ms {STALL_MS})" in line, line
    assert "the 1 connection(s) it carries" in line, line
    # The link and the connection it carried are gone; the other two links are open.
    wait_gauge(metrics_port, "ddprun_rdzvd_relay_links", 2)
    wait_gauge(metrics_port, "ddprun_rdzvd_relayed_connections", 1)
    expect_closed(stuck, "the stalled link")
    # The slow link still gets every reply: 24 GETs of 1 MiB, each 8 bytes of length + the value.
    want = 24 * (8 + (1 << 20))
    payload = 0
    end = time.monotonic() + 60
    while payload < want:
        while len(stream) < 9:
            stream += recv_exact(slow, 9 - len(stream), end)
        op, vid, n = struct.unpack("<BII", stream[:9])
        assert (op, vid) == (0x71, 2), (op, vid)
        if len(stream) < 9 + n:
            stream += recv_exact(slow, 9 + n - len(stream), end)
        del stream[:9 + n]
        payload += n
    assert f"127.0.0.1:{slow.getsockname()[1]}: relay link stalled" not in open(log).read()
    # The quiet link carries a PING.
    quiet.sendall(relay_frame(0x70, 3, b"10.9.8.7:3") + data_frames(3, VALIDATE + store_ping(7)))
    op, vid, n = struct.unpack("<BII", recv_exact(quiet, 9, time.monotonic() + 10))
    assert (op, vid) == (0x71, 3) and recv_exact(quiet, n, time.monotonic() + 10) == struct.pack("<I", 7)
    for s in (quiet, slow):
        s.close()
    os.killpg(root.pid, signal.SIGTERM)
    assert root.wait(timeout=30) == 0


def fake_root(listener, token):
    """Accepts one relay on `listener`, completes its handshake (CHALLENGE, AUTH_OK, RELAY_OK),
    closes the listener (the relay's next try to link is refused at once) and returns the link,
    which nobody reads again."""
    listener.settimeout(30)
    link, _ = listener.accept()
    listener.close()
    link.settimeout(10)
    op, hello = read_frame(link)
    assert op == 0x48, f"expected HELLO, got 0x{op:02x}"
    server_nonce = os.urandom(32).hex()
    link.sendall(frame(0x68, {"server_nonce": server_nonce, "auth": True}))
    op, auth = read_frame(link)
    assert op == 0x49, f"expected AUTH, got 0x{op:02x}"
    mac = hmac.new(token.encode(), b"ddprun-rdzv-server-v1\0" +
                   (hello["client_nonce"] + server_nonce + auth["run_id"]).encode(), hashlib.sha256).hexdigest()
    link.sendall(frame(0x69, {"mac": mac}))
    op, _ = read_frame(link)
    assert op == 0x4A, f"expected RELAY, got 0x{op:02x}"
    link.sendall(frame(0x6B, {"trusted": True}))
    return link


def relay_gives_up_stalled_root(tmp, token_file):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # inherited by the link
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    root_port = listener.getsockname()[1]
    linked = []
    t = threading.Thread(target=lambda: linked.append(fake_root(listener, TOKEN)), daemon=True)
    t.start()
    log = os.path.join(tmp, "relay.log")
    relay, relay_port = start(["--relay-to", f"127.0.0.1:{root_port}", "--token-file", token_file,
                               "--relink-timeout", "0", "--link-stall-timeout-ms", str(STALL_MS)], log)
    t.join(30)
    assert linked, "the relay never linked to the fake root"
    # A client whose bytes the relay forwards to a root that reads none of them.
    client = socket.create_connection(("127.0.0.1", relay_port), timeout=10)

    def send_lots():
        try:
            client.sendall(b"x" * (32 << 20))
        except OSError:
            pass  # the relay closed it

    sender = threading.Thread(target=send_lots, daemon=True)
    sender.start()
    assert relay.wait(timeout=30) == 1, relay.returncode
    err = open(log).read()
    assert f"lost the link to the daemon at 127.0.0.1:{root_port}: the daemon has read nothing of the link" in err, \
        err[-3000:]
    assert f"(--link-stall-timeout-ms {STALL_MS})" in err, err[-3000:]
    expect_closed(client, "a client of a relay whose root stalled")
    sender.join(30)
    client.close()
    linked[0].close()


def legacy_watch(port, key):
    """A legacy (1.13) TCPStore connection watching `key`: every SET of it queues a watch event
    with the old and the new value for it."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(bytes([7]) + struct.pack("<Q", len(key)) + key)  # legacy WATCH_KEY
    return s


def stopped_relay_links_again(tmp, token_file):
    root_log = os.path.join(tmp, "root2.log")
    relay_log = os.path.join(tmp, "relay2.log")
    root, root_port, metrics_port = start_root(token_file, root_log)
    relay, relay_port = start(["--relay-to", f"127.0.0.1:{root_port}", "--token-file", token_file], relay_log)
    watcher = legacy_watch(relay_port, b"w")
    wait_gauge(metrics_port, "ddprun_rdzvd_relayed_connections", 1)
    # The watch is registered once the root answers a request after it on the same connection.
    watcher.sendall(bytes([6]))  # legacy GETNUMKEYS
    os.kill(relay.pid, signal.SIGSTOP)
    try:
        writer = socket.create_connection(("127.0.0.1", root_port), timeout=10)
        writer.sendall(VALIDATE + store_ping(1))
        assert recv_exact(writer, 4, time.monotonic() + 10) == struct.pack("<I", 1)
        # 24 SETs of 1 MiB, each a 2 MiB watch event queued on the stopped relay's link.
        for i in range(24):
            writer.sendall(store_set(b"w", bytes([65 + i]) * (1 << 20)) + store_ping(2 + i))
            assert recv_exact(writer, 4, time.monotonic() + 10) == struct.pack("<I", 2 + i)
        text = wait_log(root_log, "relay link stalled", "the link of a stopped relay")
        line = next(l for l in text.splitlines() if "relay link stalled" in l)
        assert "closing the link and the 1 connection(s) it carries" in line, line
        wait_gauge(metrics_port, "ddprun_rdzvd_relay_links", 0)
    finally:
        os.kill(relay.pid, signal.SIGCONT)
    # Resumed, the relay finds its link gone, closes its client and links again.
    wait_log(relay_log, f"lost the link to the daemon at 127.0.0.1:{root_port}", "the resumed relay")
    wait_log(relay_log, f"linked to the daemon at 127.0.0.1:{root_port} again", "the resumed relay")
    expect_closed(watcher, "the watcher on the stopped relay")
    with socket.create_connection(("127.0.0.1", relay_port), timeout=10) as fresh:
        fresh.sendall(VALIDATE + store_ping(99))
        assert recv_exact(fresh, 4, time.monotonic() + 10) == struct.pack("<I", 99)
    assert relay.poll() is None
    for s in (watcher, writer):
        s.close()
    for p in (relay, root):
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(timeout=30) == 0


def main():
    with tempfile.TemporaryDirectory(prefix="relay-stall-") as tmp:
        token_file = os.path.join(tmp, "token")
        with open(token_file, "w") as f:
            f.write(TOKEN + "\n")
        os.chmod(token_file, 0o600)
        root_closes_stalled_link(tmp, token_file)
        relay_gives_up_stalled_root(tmp, token_file)
        stopped_relay_links_again(tmp, token_file)
    print("OK")


if __name__ == "__main__":
    try:
        main()
    finally:
        for c in children:
            if c.poll() is None:
                try:
                    os.killpg(c.pid, signal.SIGCONT)
                    os.killpg(c.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                c.wait()
