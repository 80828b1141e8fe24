"""ddprun-rdzvd --metrics-port: scrape a running daemon with urllib, parse every line strictly,
form a job in it with a real ddprun agent whose worker fails once (a restart), and check that
joins, rounds, restarts, the round-close histogram, job states and refused frames move; leave
a two-node job with one node and check the "stuck waiting for nodes" gauges; a second agent of
a full one-node job counts as a spare node until the job ends; then the hostile
HTTP inputs, the bind address (loopback by default, --metrics-host otherwise, checked in
/proc/net/tcp) and refused connections by reason. Readiness: the daemon's `listening on` line
(the metrics port file is written before it)."""
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prom_text  # noqa: E402
from common import BIN_DIR, PYTHON, check_hostile, listen_addresses, read_all, scrape  # noqa: E402
from prom_text import value  # noqa: E402

WORKER = """
import os, sys
sys.exit(3 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 0)
"""


def start_daemon(tmp, *extra):
    port_file = os.path.join(tmp, "metrics.port")
    if os.path.exists(port_file):
        os.remove(port_file)
    p = subprocess.Popen([os.path.join(BIN_DIR, "ddprun-rdzvd"), "--host", "127.0.0.1", "--port", "0",
                          "--metrics-port", "0", "--metrics-port-file", port_file, "--log-level", "warning", *extra],
                         stdout=subprocess.PIPE, start_new_session=True)
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
    assert line.startswith("listening on 127.0.0.1:"), line
    with open(port_file) as f:
        metrics_port = int(f.read())
    return p, int(line.rsplit(":", 1)[1]), metrics_port


def stop(proc):
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def agent_cmd(port, run_id, nnodes, *program):
    return [os.path.join(BIN_DIR, "ddprun"), "--nnodes", str(nnodes), "--nproc-per-node", "1", "--rdzv-backend",
            "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--max-restarts", "1",
            "--master-port", "0", *program]


def check_waiting_job(tmp, port, mport):
    """A --nnodes 2 job with one node joined is waiting for one node, and the wait grows; the
    second node closes the round and the gauges fall back to 0."""
    ok = os.path.join(tmp, "ok.py")
    with open(ok, "w") as w:
        w.write("pass\n")
    first = subprocess.Popen(agent_cmd(port, "two-nodes", 2, PYTHON, ok), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
    second = None
    try:
        # Readiness: the daemon itself says the job waits (its metrics are the signal).
        deadline = time.monotonic() + 60
        while True:
            f = scrape(mport)
            if value(f, "ddprun_rdzvd_jobs", state="waiting") == 1:
                break
            assert first.poll() is None, first.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the two-node job never showed as waiting"
            time.sleep(0.05)
        assert value(f, "ddprun_rdzvd_waiting_nodes_missing") == 1, f["ddprun_rdzvd_waiting_nodes_missing"]
        waited = value(f, "ddprun_rdzvd_waiting_seconds_max")
        assert waited >= 0
        deadline = time.monotonic() + 10
        while value(f, "ddprun_rdzvd_waiting_seconds_max") <= waited:
            assert time.monotonic() < deadline, "ddprun_rdzvd_waiting_seconds_max does not grow while the job waits"
            time.sleep(0.05)
            f = scrape(mport)
        second = subprocess.run(agent_cmd(port, "two-nodes", 2, PYTHON, ok), capture_output=True, timeout=120,
                                start_new_session=True)
        assert second.returncode == 0, second.stderr.decode()[-3000:]
        _, err = first.communicate(timeout=60)
        assert first.returncode == 0, err.decode()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    f = scrape(mport)
    assert value(f, "ddprun_rdzvd_jobs", state="waiting") == 0
    assert value(f, "ddprun_rdzvd_waiting_nodes_missing") == 0
    assert value(f, "ddprun_rdzvd_waiting_seconds_max") == 0


def check_spare(tmp, port, mport):
    """A full --nnodes 1 job: a second agent waits as a spare (the gauge counts it) until the job
    completes, and exits 0 with it."""
    go = os.path.join(tmp, "go")
    until_go = os.path.join(tmp, "until_go.py")
    with open(until_go, "w") as w:
        w.write("import os, time\nwhile not os.path.exists(%r):\n    time.sleep(0.02)\n" % go)
    agents = [subprocess.Popen(agent_cmd(port, "full", 1, PYTHON, until_go), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, start_new_session=True)]
    try:
        def wait_for(what, pred):
            deadline = time.monotonic() + 60
            while True:
                f = scrape(mport)
                if pred(f):
                    return f
                for a in agents:
                    assert a.poll() is None, a.stderr.read().decode()[-3000:]
                assert time.monotonic() < deadline, what
                time.sleep(0.05)
        wait_for("the one-node job never ran", lambda f: value(f, "ddprun_rdzvd_jobs", state="running") == 1)
        f = scrape(mport)
        assert value(f, "ddprun_rdzvd_spare_nodes") == 0, f["ddprun_rdzvd_spare_nodes"]
        agents.append(subprocess.Popen(agent_cmd(port, "full", 1, PYTHON, until_go), stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, start_new_session=True))
        wait_for("the second agent never showed as a spare", lambda f: value(f, "ddprun_rdzvd_spare_nodes") == 1)
        open(go, "w").close()
        for a in agents:
            _, err = a.communicate(timeout=60)
            assert a.returncode == 0, err.decode()[-3000:]
        assert b"waiting as a spare node" in err, err.decode()[-3000:]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    assert value(scrape(mport), "ddprun_rdzvd_spare_nodes") == 0


def check_bad_flags(tmp):
    exe = os.path.join(BIN_DIR, "ddprun-rdzvd")
    r = subprocess.run([exe, "--port", "0", "--metrics-port", "0", "--metrics-host", "localhost"],
                       capture_output=True, timeout=30)
    assert r.returncode == 2, r
    assert b"--metrics-host 'localhost' is not an IP address" in r.stderr, r.stderr
    r = subprocess.run([exe, "--port", "0", "--metrics-host", "127.0.0.1"], capture_output=True, timeout=30)
    assert r.returncode == 2, r
    assert b"--metrics-host needs --metrics-port" in r.stderr, r.stderr
    # A taken port: exit 1 naming host:port, nothing served.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        r = subprocess.run([exe, "--port", "0", "--metrics-port", str(busy)], capture_output=True, timeout=30)
    assert r.returncode == 1, r
    assert f"cannot listen for metrics on 127.0.0.1:{busy}".encode() in r.stderr, r.stderr


def check_every_address_and_peer_limit(tmp):
    """--metrics-host 0.0.0.0 listens on every address; a connection over
    --max-connections-per-peer is counted under reason="peer_limit"."""
    daemon, port, mport = start_daemon(tmp, "--metrics-host", "0.0.0.0", "--max-connections-per-peer", "1")
    try:
        assert listen_addresses(mport) == ["00000000"], listen_addresses(mport)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as held:
            # Readiness: the daemon counts the first connection before the second is sent.
            deadline = time.monotonic() + 10
            while value(scrape(mport), "ddprun_rdzvd_connections") != 1:
                assert time.monotonic() < deadline, "the held connection was never counted"
                time.sleep(0.02)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                assert read_all(s, 10) == b""
            f = scrape(mport)
            assert value(f, "ddprun_rdzvd_connections_refused_total", reason="peer_limit") == 1
            assert value(f, "ddprun_rdzvd_connections_refused_total", reason="connection_limit") == 0
            assert value(f, "ddprun_rdzvd_connections") == 1
    finally:
        stop(daemon)


def main():
    prom_text.self_test()
    with tempfile.TemporaryDirectory() as tmp:
        check_bad_flags(tmp)
        daemon, port, mport = start_daemon(tmp)
        try:
            # Loopback unless told otherwise.
            assert listen_addresses(mport) == ["0100007F"], listen_addresses(mport)
            f = scrape(mport)
            assert value(f, "ddprun_build_info", version=f["ddprun_build_info"]["samples"][0][1]["version"]) == 1
            for state in ("waiting", "running", "completed", "failed"):
                assert value(f, "ddprun_rdzvd_jobs", state=state) == 0
            assert value(f, "ddprun_rdzvd_joins_total") == 0
            assert value(f, "ddprun_rdzvd_round_close_seconds_count") == 0

            worker = os.path.join(tmp, "worker.py")
            with open(worker, "w") as w:
                w.write(WORKER)
            agent = subprocess.run(agent_cmd(port, "metrics-job", 1, PYTHON, worker), capture_output=True, timeout=120,
                                   start_new_session=True)
            assert agent.returncode == 0, agent.stderr.decode()[-3000:]

            f = scrape(mport)
            assert value(f, "ddprun_rdzvd_joins_total") >= 2, f["ddprun_rdzvd_joins_total"]
            assert value(f, "ddprun_rdzvd_rounds_closed_total") == 2, f["ddprun_rdzvd_rounds_closed_total"]
            assert value(f, "ddprun_rdzvd_restarts_total") == 1
            assert value(f, "ddprun_rdzvd_round_close_seconds_count") == 2
            assert value(f, "ddprun_rdzvd_round_close_seconds_sum") >= 0
            assert value(f, "ddprun_rdzvd_jobs", state="completed") == 1
            assert value(f, "ddprun_rdzvd_connections_accepted_total") >= 1
            assert value(f, "ddprun_rdzvd_received_bytes_total") > 0
            assert value(f, "ddprun_rdzvd_sent_bytes_total") > 0
            assert value(f, "ddprun_rdzvd_frames_total") > 0
            assert value(f, "ddprun_rdzvd_store_ops_total", op="SET") >= 0
            assert value(f, "ddprun_rdzvd_waiting_nodes_missing") == 0
            assert value(f, "ddprun_rdzvd_waiting_seconds_max") == 0

            # A malformed native frame: refused, connection closed for a protocol error.
            before = value(f, "ddprun_rdzvd_connections_refused_total", reason="protocol_error")
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(struct.pack("<BI", 0x40, 3) + b"{{{")
                read_all(s, 10)
            f = scrape(mport)
            assert value(f, "ddprun_rdzvd_refused_frames_total", reason="malformed") == 1
            assert value(f, "ddprun_rdzvd_connections_refused_total", reason="protocol_error") == before + 1

            check_waiting_job(tmp, port, mport)
            check_spare(tmp, port, mport)
            check_hostile(mport)
        finally:
            stop(daemon)
        check_every_address_and_peer_limit(tmp)
        print("ok")


if __name__ == "__main__":
    main()
