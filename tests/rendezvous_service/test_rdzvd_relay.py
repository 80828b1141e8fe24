"""Relays as processes: a root ddprun-rdzvd with a token and `ddprun-rdzvd --relay-to ROOT`.

* a torch TCPStore client and raw native frames (independent Python encoder and HMAC) work
  through a relay exactly as against the root: the handshake is end to end, a wrong token is
  refused by the root through the relay;
* two real ddprun agents finish a job through the relay;
* a relay with the wrong token, or against a root without a token, exits 1 naming the root;
* the relay link itself (spoken by Python): RELAY needs a connection authenticated for every
  job; OPEN/DATA/CLOSE carry a connection; a malformed relay frame closes the link and only it;
* relay frames from a connection that is not a link are refused, the root keeps serving;
* TRUSTED frames: a link that asks gets one per relayed connection once it authenticated (at once
  where the root awaits no handshake), none before; one sent by a relay closes the link. At the
  relay's own --max-connections the oldest client without one gives way to a new client, an
  authenticated one never does;
* SIGKILL of a relay drops its clients (EOF), SIGTERM stops it with exit 0;
* a relay outlives its root: when the root is SIGKILLed and started again on the same port, the
  relay links again and a job running through it completes (its agents re-register with the new
  root); a relay whose root stays away past --relink-timeout exits 1 naming the root;
  --relink-timeout without --relay-to is refused (exit 2), and so is each of the root's flags with
  it (--max-member-bytes, --max-members, ...);
* agents given two relays (--rdzv-endpoint A,B) go on through B when A is SIGKILLed under a
  running job: they re-register through B and the job completes;
* a relay started before its root waits for it (and is ready once linked); one whose root
  never comes exits 1 after --relink-timeout, saying how often it tried.

Readiness is each process's `listening on HOST:PORT` line; every read has a deadline.
"""
import hashlib
import hmac
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_rdzvd_native import children, frame, handshake, join_frame, read_frame, recv_exact, start_daemon  # noqa: E402

BIN_DIR = os.environ.get("DDPRUN_BIN_DIR", "")
PYTHON = os.environ.get("PYTHON_EXEC", "/usr/bin/python3")
RDZVD = os.path.join(BIN_DIR, "ddprun-rdzvd")
TOKEN = "relay-test-token"


def relay_frame(op, vid, payload=b""):
    return struct.pack("<BII", op, vid, len(payload)) + payload


def read_relay_frame(sock, timeout=10):
    deadline = time.monotonic() + timeout
    op, vid, n = struct.unpack("<BII", recv_exact(sock, 9, deadline))
    return op, vid, recv_exact(sock, n, deadline)


def start_relay(root_port, token_file):
    p, port = start_daemon(["--relay-to", f"127.0.0.1:{root_port}", "--token-file", token_file])
    return p, port


def expect_closed(sock, what):
    sock.settimeout(10)
    try:
        data = sock.recv(65536)
        while data:
            data = sock.recv(65536)
    except ConnectionResetError:
        pass
    # recv returned b"": closed


def torch_client(port, key):
    code = (
        "import datetime, torch.distributed as d\n"
        f"s = d.TCPStore('127.0.0.1', {port}, 1, False, timeout=datetime.timedelta(seconds=30))\n"
        f"s.set('{key}', 'v1')\n"
        f"assert s.get('{key}') == b'v1'\n"
        f"assert s.add('{key}-n', 5) == 5 and s.add('{key}-n', 2) == 7\n"
        f"s.wait(['{key}'])\n"
        "print('torch-ok')\n")
    r = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "torch-ok" in r.stdout, r.stderr[-3000:]


def native_through(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as bad:
        msg = handshake(bad, "wrong", "py-job")
        assert msg is not None and "authentication failed" in msg["reason"], msg
        expect_closed(bad, "a refused AUTH through the relay")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as ok:
        assert handshake(ok, TOKEN, "py-job") is None
        ok.sendall(join_frame(7))
        op, msg = read_frame(ok)
        assert op == 0x6A, f"expected JOINED, got 0x{op:02x} {msg}"
        op, msg = read_frame(ok)
        while op == 0x66:
            op, msg = read_frame(ok)
        assert op == 0x60, f"expected ASSIGNMENT, got 0x{op:02x} {msg}"
        assert msg["assignment"]["world_size"] == 2, msg


def agents_through(port, tmp):
    env = dict(os.environ, DDPRUN_RDZV_TOKEN=TOKEN)
    cmd = [os.path.join(BIN_DIR, "ddprun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "relayed-job", "--master-port", "0", "--no-python",
           "/bin/sh", "-c", 'echo "rank $RANK of $WORLD_SIZE"']
    a = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    children.append(a)
    b = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, start_new_session=True)
    out_a, err_a = a.communicate(timeout=120)
    assert b.returncode == 0, b.stderr[-3000:]
    assert a.returncode == 0, err_a[-3000:]
    ranks = sorted(line for line in (out_a + b.stdout).splitlines() if line.startswith("rank"))
    assert ranks == ["rank 0 of 2", "rank 1 of 2"], (out_a, b.stdout)


def job_state(root_port, run_id):
    with socket.create_connection(("127.0.0.1", root_port), timeout=10) as s:
        assert handshake(s, TOKEN, "*") is None
        s.sendall(frame(0x47, {"run_id": run_id}))
        op, msg = read_frame(s)
        assert op == 0x67, f"expected STATUS_REPLY, got 0x{op:02x}"
        return msg["jobs"][0]["state"] if msg["jobs"] else None


def disrupted_job(endpoint, root_port, run_id, tmp, disrupt, expect=()):
    """Two agents (one worker each) run job `run_id` through `endpoint` (one HOST:PORT or a
    list); once the root at `root_port` reports it running, disrupt() runs, then the workers
    are released. Both agents must complete, having re-registered, with every text of `expect`
    in their stderr."""
    go = os.path.join(tmp, "go-" + run_id)
    env = dict(os.environ, DDPRUN_RDZV_TOKEN=TOKEN)
    cmd = [os.path.join(BIN_DIR, "ddprun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--master-port", "0", "--no-python", "/bin/sh", "-c",
           f"while [ ! -e {go} ]; do sleep 0.05; done"]
    agents = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True) for _ in range(2)]
    children.extend(agents)
    deadline = time.monotonic() + 60
    while job_state(root_port, run_id) != "running":
        assert time.monotonic() < deadline, f"job {run_id} never ran through {endpoint}"
        assert all(a.poll() is None for a in agents), [a.stderr.read() for a in agents]
        time.sleep(0.05)
    disrupt()
    with open(go, "w"):
        pass
    for a in agents:
        _, err = a.communicate(timeout=120)
        assert a.returncode == 0, err[-3000:]
        for text in ("re-registered",) + tuple(expect):
            assert text in err, (text, err[-3000:])


def start_on(port, args, stderr=None):
    """ddprun-rdzvd on a given port (a restart); ready at its `listening on` line (the same port:
    SO_REUSEADDR lets it bind while the killed process's connections linger in TIME_WAIT)."""
    p = subprocess.Popen([RDZVD] + args + ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
    children.append(p)
    line = p.stdout.readline().decode()
    assert line.strip() == f"listening on 127.0.0.1:{port}", line
    return p


def relay_restarted(root_port, token_file, tmp):
    """Agents running a job through a relay that is SIGKILLed and started again on the same
    port reconnect through it, re-register, and the job completes."""
    relay, port = start_relay(root_port, token_file)
    again = []

    def restart_relay():
        os.killpg(relay.pid, signal.SIGKILL)
        relay.wait(timeout=30)
        again.append(start_on(port, ["--relay-to", f"127.0.0.1:{root_port}", "--token-file", token_file]))

    disrupted_job(f"127.0.0.1:{port}", root_port, "relay-restart", tmp, restart_relay)
    os.killpg(again[0].pid, signal.SIGTERM)
    assert again[0].wait(timeout=30) == 0


def relay_with_stderr(root_port, token_file, *extra):
    """A relay whose stderr the test reads (the relink messages); not waited for."""
    p = subprocess.Popen([RDZVD, "--relay-to", f"127.0.0.1:{root_port}", "--token-file", token_file, "--host",
                          "127.0.0.1", "--port", "0", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    children.append(p)
    return p


def ready_port(relay):
    """The port of a relay's `listening on 127.0.0.1:PORT` line (blocks until it is printed)."""
    line = relay.stdout.readline().decode()
    assert line.startswith("listening on 127.0.0.1:"), (line, relay.poll())
    return int(line.strip().rsplit(":", 1)[1])


def root_restarted(token_file, tmp):
    """A root SIGKILLed under a running two-agent job and started again on the same port: the
    relay keeps its port, links again, and the agents reconnect through it, re-register with the
    new root and complete."""
    root_args = ["--token-file", token_file, "--allow-unauthenticated-store"]
    root, root_port = start_daemon(root_args)
    relay = relay_with_stderr(root_port, token_file, "--log-level", "warning")
    port = ready_port(relay)
    again = []

    def restart_root():
        os.killpg(root.pid, signal.SIGKILL)
        root.wait(timeout=30)
        again.append(start_on(root_port, root_args))

    disrupted_job(f"127.0.0.1:{port}", root_port, "root-restart", tmp, restart_root)
    assert relay.poll() is None, "the relay exited when its root went away"
    torch_client(port, "after-root-restart")  # the relay carries new clients too
    os.killpg(relay.pid, signal.SIGTERM)
    _, relay_err = relay.communicate(timeout=30)
    assert relay.returncode == 0, (relay.returncode, relay_err[-3000:])
    relay_err = relay_err.decode()
    assert f"lost the link to the daemon at 127.0.0.1:{root_port}" in relay_err, relay_err[-3000:]
    assert f"linked to the daemon at 127.0.0.1:{root_port} again" in relay_err, relay_err[-3000:]
    return again[0], root_port


def relay_gives_up(root, root_port, token_file):
    """The root goes away for good: the relay exits 1 once --relink-timeout has passed, naming
    the root and how long it tried."""
    relay = relay_with_stderr(root_port, token_file, "--relink-timeout", "0.5")
    ready_port(relay)
    os.killpg(root.pid, signal.SIGKILL)
    root.wait(timeout=30)
    _, err = relay.communicate(timeout=60)
    err = err.decode()
    assert relay.returncode == 1, (relay.returncode, err[-3000:])
    assert f"127.0.0.1:{root_port}" in err and "not linked again within 0.5 s" in err, err[-3000:]
    # The flag belongs to relays only.
    r = subprocess.run([RDZVD, "--host", "127.0.0.1", "--port", "0", "--relink-timeout", "5"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--relink-timeout applies only to a relay" in r.stderr, (r.returncode, r.stderr)


def failover(root_port, token_file, tmp):
    """--rdzv-endpoint A,B (two relays of one root): relay A SIGKILLed under a running two-agent
    job; the agents reconnect through B, re-register, and the job completes."""
    relay_a, port_a = start_relay(root_port, token_file)
    relay_b, port_b = start_relay(root_port, token_file)

    def kill_a():
        os.killpg(relay_a.pid, signal.SIGKILL)
        relay_a.wait(timeout=30)

    disrupted_job(f"127.0.0.1:{port_a},127.0.0.1:{port_b}", root_port, "failover", tmp, kill_a,
                  expect=[f"trying 127.0.0.1:{port_b} next"])
    # `ddprun status` with the same list answers through the relay that is still there.
    r = subprocess.run([os.path.join(BIN_DIR, "ddprun"), "status", "--rdzv-endpoint",
                        f"127.0.0.1:{port_a},127.0.0.1:{port_b}"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, DDPRUN_RDZV_TOKEN=TOKEN))
    assert r.returncode == 0 and f"rendezvous 127.0.0.1:{port_b}:" in r.stdout, (r.returncode, r.stdout, r.stderr)
    os.killpg(relay_b.pid, signal.SIGTERM)
    assert relay_b.wait(timeout=30) == 0


def free_port():
    """A port nothing listens on (bound and released): the address a relay is told about before
    its root exists; the root then binds it (SO_REUSEADDR)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relay_before_root(token_file):
    """A relay started while nothing listens at --relay-to waits (warning once), links when the
    root comes up on that port, and only then prints its readiness line."""
    port = free_port()
    relay = relay_with_stderr(port, token_file)
    # Its first attempt fails and says so before the root exists.
    deadline = time.monotonic() + 30
    seen = b""
    while b"does not answer yet" not in seen:
        assert time.monotonic() < deadline and relay.poll() is None, seen.decode()
        ready, _, _ = select.select([relay.stderr], [], [], 1)
        if ready:
            seen += os.read(relay.stderr.fileno(), 4096)
    root = start_on(port, ["--token-file", token_file, "--allow-unauthenticated-store"])
    torch_client(ready_port(relay), "relay-before-root")
    for p in (relay, root):
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    # Nothing ever comes: exit 1 once --relink-timeout has passed, naming the root.
    r = subprocess.run([RDZVD, "--relay-to", f"127.0.0.1:{port}", "--token-file", token_file, "--host", "127.0.0.1",
                        "--port", "0", "--relink-timeout", "0.5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert f"cannot connect to the daemon at 127.0.0.1:{port}" in r.stderr and "(--relink-timeout)" in r.stderr, \
        r.stderr


def root_flags_refused(token_file):
    """Every flag of the root's store, registry or metrics is refused on a relay (exit 2, naming
    it) before it connects anywhere, rather than accepted and ignored."""
    for flag, value in (("--max-member-bytes", "1000000"), ("--max-members", "10"), ("--job-expiry", "60"),
                        ("--max-keys", "10"), ("--metrics-port", "0"), ("--reply-stall-timeout-ms", "5000")):
        r = subprocess.run([RDZVD, "--relay-to", "127.0.0.1:9", "--token-file", token_file, "--host", "127.0.0.1",
                            "--port", "0", flag, value], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (flag, r.returncode, r.stderr)
        assert f"{flag} does not apply to a relay" in r.stderr, (flag, r.stderr)


def relay_refused(root_port, token_file, want):
    r = subprocess.run([RDZVD, "--relay-to", f"127.0.0.1:{root_port}", "--host", "127.0.0.1", "--port", "0",
                        "--token-file", token_file], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert f"127.0.0.1:{root_port}" in r.stderr and want in r.stderr, r.stderr


def trusted_by_hand(root_port, awaited):
    """A link that asks for TRUSTED frames. `awaited` (a token root without
    --allow-unauthenticated-store): none before the handshake, one once the client authenticated;
    else one at once (the root awaits no handshake). A TRUSTED from the relay's side closes the link."""
    with socket.create_connection(("127.0.0.1", root_port), timeout=10) as s:
        assert handshake(s, TOKEN, "*") is None
        s.sendall(frame(0x4A, {"v": 1, "trusted": True}))
        op, msg = read_frame(s)
        assert (op, msg) == (0x6B, {"trusted": True}), (op, msg)
        s.sendall(relay_frame(0x70, 9, b"10.9.8.7:4243"))
        if not awaited:
            assert read_relay_frame(s) == (0x73, 9, b""), "no TRUSTED for a connection the root awaits nothing from"
        client_nonce = os.urandom(32).hex()
        s.sendall(relay_frame(0x71, 9, frame(0x48, {"v": 1, "client_nonce": client_nonce})))
        op, vid, payload = read_relay_frame(s)
        assert (op, vid) == (0x71, 9) and payload[:1] == b"\x68", (op, vid, payload[:40])
        server_nonce = json.loads(payload[5:])["server_nonce"]
        mac = hmac.new(TOKEN.encode(), b"ddprun-rdzv-client-v1\0" + (server_nonce + client_nonce + "py-job").encode(),
                       hashlib.sha256).hexdigest()
        s.sendall(relay_frame(0x71, 9, frame(0x49, {"run_id": "py-job", "mac": mac})))
        got = [read_relay_frame(s)[:2] for _ in range(2 if awaited else 1)]
        want = [(0x71, 9), (0x73, 9)] if awaited else [(0x71, 9)]
        assert sorted(got) == want, f"expected {want} (AUTH_OK, TRUSTED), got {got}"
        s.sendall(relay_frame(0x73, 9))
        expect_closed(s, "TRUSTED from a relay")


def link_by_hand(root_port):
    # RELAY on a connection bound to one job is refused.
    with socket.create_connection(("127.0.0.1", root_port), timeout=10) as s:
        assert handshake(s, TOKEN, "py-job") is None
        s.sendall(frame(0x4A, {"v": 1}))
        op, msg = read_frame(s)
        assert op == 0x64 and "every job" in msg["reason"], (op, msg)
        expect_closed(s, "a refused RELAY")
    # Relay frames from a plain connection: refused, the connection closed.
    with socket.create_connection(("127.0.0.1", root_port), timeout=10) as s:
        s.sendall(relay_frame(0x70, 1, b"10.0.0.1:5"))
        expect_closed(s, "relay frames on a plain connection")
    # A link spoken by hand: OPEN, DATA(HELLO) -> DATA(CHALLENGE), CLOSE; then a bad frame.
    with socket.create_connection(("127.0.0.1", root_port), timeout=10) as s:
        assert handshake(s, TOKEN, "*") is None
        s.sendall(frame(0x4A, {"v": 1}))
        op, _ = read_frame(s)
        assert op == 0x6B, f"expected RELAY_OK, got 0x{op:02x}"
        s.sendall(relay_frame(0x70, 5, b"10.9.8.7:4242"))
        s.sendall(relay_frame(0x71, 5, frame(0x48, {"v": 1, "client_nonce": os.urandom(32).hex()})))
        op, vid, payload = read_relay_frame(s)
        assert (op, vid) == (0x71, 5), (op, vid, payload)
        assert payload[0] == 0x68, f"expected CHALLENGE inside DATA, got 0x{payload[0]:02x}"
        # A second HELLO on the same relayed connection is refused: REFUSED in DATA, then CLOSE.
        s.sendall(relay_frame(0x71, 5, frame(0x48, {"v": 1, "client_nonce": os.urandom(32).hex()})))
        op, vid, payload = read_relay_frame(s)
        assert (op, vid) == (0x71, 5) and payload[0] == 0x64, (op, vid, payload[:40])
        op, vid, payload = read_relay_frame(s)
        assert (op, vid) == (0x72, 5), (op, vid, payload)
        # A DATA for a connection that is gone is ignored; an unknown op closes the link.
        s.sendall(relay_frame(0x71, 5, b"x"))
        s.sendall(relay_frame(0x7F, 1, b""))
        expect_closed(s, "a malformed relay frame")
    trusted_by_hand(root_port, awaited=False)
    # An oversized DATA is refused from its header.
    with socket.create_connection(("127.0.0.1", root_port), timeout=10) as s:
        assert handshake(s, TOKEN, "*") is None
        s.sendall(frame(0x4A, {"v": 1}))
        op, _ = read_frame(s)
        assert op == 0x6B
        s.sendall(struct.pack("<BII", 0x71, 1, 1 << 30))
        expect_closed(s, "a 1 GiB DATA header")
    # The root still serves.
    with socket.create_connection(("127.0.0.1", root_port), timeout=10) as s:
        assert handshake(s, TOKEN, "*") is None


def gauge(metrics_port, name):
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not in the root's metrics")


def wait_gauge(metrics_port, name, want):
    deadline = time.monotonic() + 20
    while gauge(metrics_port, name) != want:
        assert time.monotonic() < deadline, f"{name} never became {want} (is {gauge(metrics_port, name)})"
        time.sleep(0.02)


def relay_dies(root_port, token_file, metrics_port):
    relay, port = start_relay(root_port, token_file)
    wait_gauge(metrics_port, "ddprun_rdzvd_relay_links", 2)  # this one and the test's first relay
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        assert handshake(c, TOKEN, "py-job") is None
        assert gauge(metrics_port, "ddprun_rdzvd_relayed_connections") == 1
        os.killpg(relay.pid, signal.SIGKILL)
        relay.wait(timeout=30)
        expect_closed(c, "a client of a killed relay")
    # The root saw the link go and, with it, the connection it carried.
    wait_gauge(metrics_port, "ddprun_rdzvd_relay_links", 1)
    wait_gauge(metrics_port, "ddprun_rdzvd_relayed_connections", 0)
    relay2, _ = start_relay(root_port, token_file)
    os.killpg(relay2.pid, signal.SIGTERM)
    assert relay2.wait(timeout=30) == 0, relay2.returncode


def silent_through_relay(token_file):
    # Connections that never authenticate, carried by a relay, get the root's handshake bounds
    # too: at --max-relayed-connections the oldest gives way to a new one, and each is closed
    # after --handshake-timeout-ms. Before, 5 silent clients locked every agent behind the relay out.
    root, root_port = start_daemon(["--token-file", token_file, "--max-relayed-connections", "5",
                                    "--handshake-timeout-ms", "60000"])
    relay, relay_port = start_relay(root_port, token_file)
    silent = [socket.create_connection(("127.0.0.1", relay_port), timeout=10) for _ in range(5)]
    agents = []
    for attempt in range(2):  # both stay open: each needs a slot of its own
        ok = socket.create_connection(("127.0.0.1", relay_port), timeout=10)
        assert handshake(ok, TOKEN, "py-job-%d" % attempt) is None, "the handshake through the relay failed"
        agents.append(ok)
    for s in silent[:2]:
        expect_closed(s, "the oldest silent relayed connection")
    for s in silent + agents:
        s.close()
    os.killpg(relay.pid, signal.SIGTERM)
    relay.wait(timeout=30)
    os.killpg(root.pid, signal.SIGTERM)
    root.wait(timeout=30)
    root, root_port = start_daemon(["--token-file", token_file, "--handshake-timeout-ms", "200"])
    relay, relay_port = start_relay(root_port, token_file)
    with socket.create_connection(("127.0.0.1", relay_port), timeout=10) as slow:
        slow.settimeout(20)
        assert slow.recv(1) == b"", "a silent relayed connection outlived --handshake-timeout-ms"
    os.killpg(relay.pid, signal.SIGTERM)
    relay.wait(timeout=30)
    os.killpg(root.pid, signal.SIGTERM)
    root.wait(timeout=30)


def relay_limit_makes_room(token_file):
    # At the relay's own --max-connections, the oldest client that has not authenticated gives
    # way to a new one (the root tells the relay which have, in TRUSTED frames); an authenticated
    # one never does. Before, 4 silent clients at a relay of --max-connections 4 locked every agent
    # behind it out until the root's --handshake-timeout-ms closed them, and the next 4 again.
    root, root_port = start_daemon(["--token-file", token_file, "--handshake-timeout-ms", "60000"])
    trusted_by_hand(root_port, awaited=True)
    relay, relay_port = start_daemon(["--relay-to", f"127.0.0.1:{root_port}", "--token-file", token_file,
                                      "--max-connections", "4"])
    # Accepted in order (the listen queue is first in, first out): the silent ones first.
    silent = [socket.create_connection(("127.0.0.1", relay_port), timeout=10) for _ in range(4)]
    agent = socket.create_connection(("127.0.0.1", relay_port), timeout=10)
    assert handshake(agent, TOKEN, "relay-room") is None, "an agent was locked out by silent clients"
    expect_closed(silent[0], "the oldest silent client")
    # The agent is trusted now (TRUSTED precedes its AUTH_OK on the link): four more clients make
    # room from the silent ones and from each other, never from it.
    more = [socket.create_connection(("127.0.0.1", relay_port), timeout=10) for _ in range(4)]
    for s in silent[1:] + more[:1]:
        expect_closed(s, "a silent client that gave way")
    agent.sendall(frame(0x47, {"run_id": "relay-room"}))
    op, _ = read_frame(agent)
    assert op == 0x67, f"the authenticated agent lost its connection: 0x{op:02x}"
    for s in silent + more + [agent]:
        s.close()
    os.killpg(relay.pid, signal.SIGTERM)
    assert relay.wait(timeout=30) == 0
    os.killpg(root.pid, signal.SIGTERM)
    assert root.wait(timeout=30) == 0



def relay_refusals_are_all_counted(token_file):
    # A relay full of authenticated clients refuses new ones, one warning line a second; the ones
    # not shown are counted on the next line or, when no next one comes, on a line of their own
    # (before, a count that no later refusal carried was never logged).
    root, root_port = start_daemon(["--token-file", token_file])
    relay = relay_with_stderr(root_port, token_file, "--max-connections", "2")
    port = ready_port(relay)
    agents = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    for i, a in enumerate(agents):
        assert handshake(a, TOKEN, "relay-count-%d" % i) is None
    refused = 10
    for _ in range(refused):
        expect_closed(socket.create_connection(("127.0.0.1", port), timeout=10), "a client over the limit")
    deadline = time.monotonic() + 20
    seen = b""

    def accounted(text):
        shown = text.count("connection limit of 2 reached (--max-connections)")
        hidden = sum(int(n) for n in re.findall(r"(\d+) more like it not shown over the last", text))
        return shown + hidden

    while accounted(seen.decode(errors="replace")) < refused:
        assert time.monotonic() < deadline and relay.poll() is None, \
            f"refusals accounted for: {accounted(seen.decode(errors='replace'))} of {refused}:\n{seen.decode()[-3000:]}"
        ready, _, _ = select.select([relay.stderr], [], [], 1)
        if ready:
            seen += os.read(relay.stderr.fileno(), 4096)
    text = seen.decode(errors="replace")
    assert accounted(text) == refused, text[-3000:]
    assert "relay: closing connections at its limits: " in text, text[-3000:]
    for a in agents:
        a.close()
    for p in (relay, root):
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(timeout=30) == 0


def vm_rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def still_served(sock, run_id, what):
    sock.sendall(frame(0x47, {"run_id": run_id}))
    op, _ = read_frame(sock)
    assert op == 0x67, f"{what} lost its connection: 0x{op:02x}"


def root_with_metrics(token_file):
    """A root with a token and a metrics endpoint: (process, port, metrics port)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics_file = os.path.join(tmp, "metrics.port")
        root, root_port = start_daemon(["--token-file", token_file, "--metrics-port", "0", "--metrics-port-file",
                                        metrics_file])
        with open(metrics_file) as f:
            return root, root_port, int(f.read())


def pipelining_client(relay_port, run_id, gets):
    """A client authenticated for its own job that SETs a 1 MiB value, then pipelines `gets` GETs
    of it and never reads (a small receive buffer)."""
    a = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.settimeout(10)
    a.connect(("127.0.0.1", relay_port))
    assert handshake(a, TOKEN, run_id) is None
    key = b"k"
    a.sendall(bytes.fromhex("00cef7853c") + bytes([1]) + struct.pack("<Q", len(key)) + key +
              struct.pack("<Q", 1 << 20) + b"v" * (1 << 20))  # VALIDATE, SET k = 1 MiB
    a.sendall(bytes([13]) + struct.pack("<I", 7))  # PING: the SET is done once it answers
    assert recv_exact(a, 4, time.monotonic() + 10) == struct.pack("<I", 7)
    a.sendall((bytes([3]) + struct.pack("<Q", len(key)) + key) * gets)
    return a


def pipelining_client_keeps_the_link(token_file):
    # One client behind a relay pipelines 6,000 GETs of a 1 MiB value and never reads. Before:
    # the root ran them all in one event, its link to the relay passed --max-queued-reply-bytes
    # and the root closed the link, ending every connection the relay carried (other jobs'
    # agents too). Now the relayed connection waits while the link is backed up; the relay's own
    # per-client cap ends the client that does not read, and only it.
    root, root_port, metrics_port = root_with_metrics(token_file)
    relay, relay_port = start_relay(root_port, token_file)
    victim = socket.create_connection(("127.0.0.1", relay_port), timeout=10)
    assert handshake(victim, TOKEN, "victim-job") is None
    still_served(victim, "victim-job", "an agent of another job")
    rss_before = vm_rss_kib(root.pid)
    attacker = pipelining_client(relay_port, "attacker-job", 6000)
    still_served(victim, "victim-job", "an agent of another job on the same relay, during")
    # The relay ends the client that never reads (its per-client cap) and tells the root: one
    # relayed connection is left, the victim's.
    wait_gauge(metrics_port, "ddprun_rdzvd_relayed_connections", 1)
    still_served(victim, "victim-job", "an agent of another job on the same relay")
    grown = vm_rss_kib(root.pid) - rss_before
    assert grown < 96 * 1024, f"the root grew by {grown} KiB for one client's pipelined GETs"
    assert relay.poll() is None and root.poll() is None
    victim.close()
    for p in (relay, root):
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(timeout=30) == 0


def relay_buffers_are_bounded(token_file):
    # Four clients behind a relay of --max-buffered-bytes 48 MiB each pipeline GETs of a 1 MiB
    # value and never read. Before: each could hold --max-queued-reply-bytes (128 MiB) at the
    # relay, four of them half a GiB. Now the relay closes the clients with the most unread once
    # all of them together pass its budget; an agent on the same relay is served throughout.
    root, root_port, metrics_port = root_with_metrics(token_file)
    relay, relay_port = start_daemon(["--relay-to", f"127.0.0.1:{root_port}", "--token-file", token_file,
                                      "--max-buffered-bytes", str(48 << 20)])
    agent = socket.create_connection(("127.0.0.1", relay_port), timeout=10)
    assert handshake(agent, TOKEN, "agent-job") is None
    rss_before = vm_rss_kib(relay.pid)
    hoarders = [pipelining_client(relay_port, f"hoarder-{i}", 200) for i in range(4)]
    # At most one hoarder fits the budget: the relay closes the others and tells the root.
    deadline = time.monotonic() + 30
    while gauge(metrics_port, "ddprun_rdzvd_relayed_connections") > 2:  # the agent and one hoarder
        assert time.monotonic() < deadline, "the relay's budget closed no client that does not read"
        time.sleep(0.02)
    still_served(agent, "agent-job", "an agent on the relay")
    grown = vm_rss_kib(relay.pid) - rss_before
    assert grown < 128 * 1024, f"the relay grew by {grown} KiB for four clients that do not read"
    for s in hoarders + [agent]:
        s.close()
    for p in (relay, root):
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(timeout=30) == 0


def relay_survives_sighup(token_file):
    # `kill -HUP $(pidof ddprun-rdzvd)` (docs/daemon.md, rotating the token) reaches relays too.
    # Before: a relay had no SIGHUP handler and died of it, with every connection it carried.
    root, root_port = start_daemon(["--token-file", token_file])
    relay, relay_port = start_relay(root_port, token_file)
    agent = socket.create_connection(("127.0.0.1", relay_port), timeout=10)
    assert handshake(agent, TOKEN, "hup-job") is None
    os.kill(relay.pid, signal.SIGHUP)
    os.kill(root.pid, signal.SIGHUP)
    still_served(agent, "hup-job", "an agent on the relay after SIGHUP")
    with socket.create_connection(("127.0.0.1", relay_port), timeout=10) as fresh:
        assert handshake(fresh, TOKEN, "hup-job") is None, "a new client was refused after SIGHUP"
    assert relay.poll() is None, f"the relay exited on SIGHUP ({relay.poll()})"
    agent.close()
    for p in (relay, root):
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(timeout=30) == 0


def main():
    with tempfile.TemporaryDirectory() as tmp:
        token_file = os.path.join(tmp, "token")
        with open(token_file, "w") as f:
            f.write(TOKEN + "\n")
        os.chmod(token_file, 0o600)
        wrong_file = os.path.join(tmp, "wrong")
        with open(wrong_file, "w") as f:
            f.write("not-the-token\n")
        os.chmod(wrong_file, 0o600)

        metrics_file = os.path.join(tmp, "metrics.port")
        root, root_port = start_daemon(["--token-file", token_file, "--allow-unauthenticated-store",
                                        "--metrics-port", "0", "--metrics-port-file", metrics_file])
        with open(metrics_file) as f:
            metrics_port = int(f.read())
        relay, relay_port = start_relay(root_port, token_file)
        torch_client(relay_port, 'first')
        native_through(relay_port)
        agents_through(relay_port, tmp)
        relay_refused(root_port, wrong_file, "authentication failed")
        root_flags_refused(token_file)
        link_by_hand(root_port)
        relay_dies(root_port, token_file, metrics_port)
        relay_restarted(root_port, token_file, tmp)
        failover(root_port, token_file, tmp)
        torch_client(relay_port, 'second')  # the first relay is unaffected by the others
        os.killpg(relay.pid, signal.SIGTERM)
        assert relay.wait(timeout=30) == 0
        os.killpg(root.pid, signal.SIGTERM)
        assert root.wait(timeout=30) == 0

        silent_through_relay(token_file)
        relay_limit_makes_room(token_file)
        relay_refusals_are_all_counted(token_file)
        pipelining_client_keeps_the_link(token_file)
        relay_buffers_are_bounded(token_file)
        relay_survives_sighup(token_file)
        relay_before_root(token_file)
        again, again_port = root_restarted(token_file, tmp)
        relay_gives_up(again, again_port, token_file)

        open_root, open_port = start_daemon([])
        relay_refused(open_port, token_file, "has no token")
        os.killpg(open_root.pid, signal.SIGTERM)
        open_root.wait(timeout=30)
    print("OK")


if __name__ == "__main__":
    try:
        main()
    finally:
        for c in children:
            if c.poll() is None:
                os.killpg(c.pid, signal.SIGKILL)
                c.wait()
