"""Dead-job attacks on ddprun-rdzvd: abandoned jobs expire, and do not slow the live ones.

An attacker (or many crashed launchers) creates jobs and walks away: one connection pipelines
JOIN + LEAVE for thousands of run ids whose clients chose a 1-hour join timeout, so without
expiry every job would stay for an hour and, with a per-frame scan over all jobs, every frame of
every other job would get slower.

  expiry:  --job-expiry 1: 2,000 abandoned jobs are forgotten (the daemon's debug log says so,
           STATUS then lists only the live job), the live job with a connected member stays, and
           an expired id starts a fresh job at round 0.
  max-jobs: --max-jobs 50: the 51st job is refused with a reason naming the flag; the others
           go on.
  cost:    frames/s of a live node (pipelined HEARTBEATs, then a STATUS of its job) with 0 and
           with 70,000 dead jobs held: the slowdown must stay under 5x (a per-frame scan was
           ~300x). `--measure BINARY` prints both rates for any ddprun-rdzvd (no assertion), for
           docs/daemon.md.

The daemon runs under RLIMIT_AS (harness.py; skipped for ASan builds); every read has a deadline;
the daemon is stopped on the way out.
"""
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

JOIN, LEAVE, HEARTBEAT, STATUS = 0x40, 0x43, 0x42, 0x47
ASSIGNMENT, STATUS_REPLY, REFUSED = 0x60, 0x67, 0x64

CONFIG = {"min_nodes": 1, "max_nodes": 1, "max_restarts": 3, "missed_heartbeats": 30,
          "join_timeout_ms": 3_600_000, "last_call_timeout_ms": 100, "close_timeout_ms": 3_600_000,
          "heartbeat_interval_ms": 60_000, "exit_barrier_timeout_ms": 10000, "rebuild_grace_ms": 1000}


def frame(op, obj):
    body = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack("<BI", op, len(body)) + body


def node(i, tag):
    return {"addr": "127.0.0.1", "pid": 1000 + i, "instance": f"{tag}-{i}"}


def node_info(i, tag):
    return {"id": node(i, tag), "addr": "127.0.0.1", "local_world_size": 1, "store_host": "127.0.0.1",
            "store_port": 40000}


class Reader:
    """Drains one connection on a thread, parsing frames; wait_for(op) blocks (bounded) until a
    frame with that opcode arrived and returns it."""

    def __init__(self, sock):
        self.sock = sock
        self.frames = []
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        buf = b""
        self.sock.settimeout(None)
        try:
            while True:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    break
                buf += chunk
                got = []
                while len(buf) >= 5:
                    op, n = struct.unpack("<BI", buf[:5])
                    if len(buf) < 5 + n:
                        break
                    got.append((op, buf[5:5 + n]))
                    buf = buf[5 + n:]
                if got:
                    with self.cond:
                        self.frames.extend(got)
                        self.cond.notify_all()
        except OSError:
            pass
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def wait_for(self, op, timeout=120):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for i, (o, body) in enumerate(self.frames):
                    if o == op:
                        del self.frames[:i + 1]
                        return json.loads(body)
                    if o == REFUSED:
                        raise AssertionError(f"REFUSED: {body[:300]!r}")
                left = deadline - time.monotonic()
                assert not self.closed, "the daemon closed the connection"
                assert left > 0, f"no frame 0x{op:02x} before the deadline"
                self.cond.wait(left)


def status_barrier(sock, reader, run_id, timeout=300):
    sock.sendall(frame(STATUS, {"run_id": run_id}))
    return reader.wait_for(STATUS_REPLY, timeout)


def live_node(port):
    """One node of job 'live', joined and running; returns (socket, reader)."""
    s = harness.connect(port)
    r = Reader(s)
    s.sendall(frame(JOIN, {"run_id": "live", "node": node_info(0, "live"), "config": CONFIG}))
    r.wait_for(ASSIGNMENT)
    return s, r


def make_dead_jobs(port, count, tag="dead", batch=2000):
    """`count` jobs whose only node joined and left: memberless, each waiting an hour for nodes."""
    s = harness.connect(port)
    r = Reader(s)
    for start in range(0, count, batch):
        out = bytearray()
        for i in range(start, min(count, start + batch)):
            run_id = f"{tag}-{i}"
            out += frame(JOIN, {"run_id": run_id, "node": node_info(i, tag), "config": CONFIG})
            out += frame(LEAVE, {"run_id": run_id, "node": node(i, tag)})
        s.sendall(out)
        status_barrier(s, r, f"{tag}-{start}")  # bounded progress: the daemon caught up
    s.close()


def heartbeat_rate(sock, reader, frames=20000):
    hb = frame(HEARTBEAT, {"run_id": "live", "node": node(0, "live")})
    t0 = time.monotonic()
    for start in range(0, frames, 1000):
        sock.sendall(hb * min(1000, frames - start))
    st = status_barrier(sock, reader, "live")
    elapsed = time.monotonic() - t0
    assert st["jobs"] and st["jobs"][0]["run_id"] == "live", st
    return (frames + 1) / elapsed


def measure(binary, dead=70000, flags=()):
    with harness.Daemon(["--log-level", "warning", *flags], binary=binary) as d:
        sock, reader = live_node(d.port)
        heartbeat_rate(sock, reader, 2000)  # warm up
        before = heartbeat_rate(sock, reader)
        t0 = time.monotonic()
        make_dead_jobs(d.port, dead)
        made = time.monotonic() - t0
        after = heartbeat_rate(sock, reader)
        assert d.alive(), "the daemon died"
        rss = d.rss()
        sock.close()
    return before, after, made, rss


def count_forgotten(line):
    # "rendezvous: forgot N finished or expired job(s), e.g. 'ID'"
    if "forgot " not in line:
        return 0
    return int(line.split("forgot ", 1)[1].split()[0])


def test_expiry():
    tmp_flags = ["--job-expiry", "1", "--log-level", "debug"]
    p = subprocess.Popen([harness.RDZVD, "--host", harness.HOST, "--port", "0", *tmp_flags],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=harness.limits_preexec(None if harness.sanitized(harness.RDZVD) else 2 * harness.GiB))
    try:
        line = harness.read_line(p.stdout.fileno(), time.monotonic() + 30)
        port = int(line.strip().rsplit(":", 1)[1])
        sock, reader = live_node(port)
        dead = 2000
        make_dead_jobs(port, dead, batch=500)
        # Readiness: the daemon's own log of what it forgot.
        forgotten = 0
        deadline = time.monotonic() + 60
        while forgotten < dead:
            forgotten += count_forgotten(harness.read_line(p.stderr.fileno(), deadline))
        st = status_barrier(sock, reader, "")
        ids = [j["run_id"] for j in st["jobs"]]
        assert ids == ["live"], f"after expiry STATUS lists {ids[:5]} ({len(ids)} jobs)"
        # An expired id is a fresh job.
        s2 = harness.connect(port)
        r2 = Reader(s2)
        s2.sendall(frame(JOIN, {"run_id": "dead-7", "node": node_info(7, "again"), "config": CONFIG}))
        a = r2.wait_for(ASSIGNMENT)
        assert a.get("restart_count", 0) == 0, a
        s2.close()
        sock.close()
        assert p.poll() is None, "the daemon died"
        print(f"expiry: {dead} abandoned jobs forgotten, the live job kept")
    finally:
        harness.stop(p)


def test_max_jobs():
    with harness.Daemon(["--log-level", "warning", "--max-jobs", "50"]) as d:
        make_dead_jobs(d.port, 49, tag="cap")  # plus the refused one's neighbour below = 50
        s = harness.connect(d.port)
        r = Reader(s)
        s.sendall(frame(JOIN, {"run_id": "cap-49", "node": node_info(49, "cap"), "config": CONFIG}))
        r.wait_for(ASSIGNMENT)
        s2 = harness.connect(d.port)
        r2 = Reader(s2)
        s2.sendall(frame(JOIN, {"run_id": "one-too-many", "node": node_info(0, "x"), "config": CONFIG}))
        try:
            r2.wait_for(ASSIGNMENT, 30)
            raise AssertionError("a 51st job was started past --max-jobs 50")
        except AssertionError as e:
            assert "--max-jobs" in str(e), e
        # The jobs that exist are unaffected.
        st = status_barrier(s, r, "cap-49")
        assert st["jobs"][0]["state"] == "running", st
        assert d.alive()
        s.close()
        s2.close()
    print("max-jobs: the 51st job refused, naming --max-jobs")


def test_cost():
    before, after, made, rss = measure(harness.RDZVD)
    print(f"cost: {before:.0f} frames/s with 0 dead jobs, {after:.0f} with 70000 "
          f"(created in {made:.1f} s; daemon RSS {rss / harness.MiB:.0f} MiB)")
    assert after * 5 > before, f"70000 dead jobs slow every frame {before / after:.1f}x"


if __name__ == "__main__":
    harness.raise_own_fd_limit(1024)
    if len(sys.argv) >= 3 and sys.argv[1] == "--measure":
        b, a, m, rss = measure(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 70000)
        print(json.dumps({"binary": sys.argv[2], "frames_per_s_0_dead": round(b), "frames_per_s_dead": round(a),
                          "create_s": round(m, 1), "rss_mib": round(rss / harness.MiB)}))
        sys.exit(0)
    test_expiry()
    test_max_jobs()
    test_cost()
    print("dead-job attacks: OK")
