"""ddprun-rdzvd --metrics-port: scrape a running daemon with urllib, parse every line strictly,
form a job in it with a real ddprun agent whose worker fails once (a restart), and check that
joins, rounds, restarts, the round-close histogram, job states and refused frames move. Then
the hostile HTTP inputs. Readiness: the daemon's `listening on` line (the metrics port file is
written before it)."""
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
from common import BIN_DIR, PYTHON, check_hostile, read_all, scrape  # noqa: E402
from prom_text import value  # noqa: E402

WORKER = """
import os, sys
sys.exit(3 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 0)
"""


def start_daemon(tmp):
    port_file = os.path.join(tmp, "metrics.port")
    p = subprocess.Popen([os.path.join(BIN_DIR, "ddprun-rdzvd"), "--host", "127.0.0.1", "--port", "0",
                          "--metrics-port", "0", "--metrics-port-file", port_file, "--log-level", "warning"],
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


def main():
    prom_text.self_test()
    with tempfile.TemporaryDirectory() as tmp:
        daemon, port, mport = start_daemon(tmp)
        try:
            f = scrape(mport)
            assert value(f, "ddprun_build_info", version=f["ddprun_build_info"]["samples"][0][1]["version"]) == 1
            for state in ("waiting", "running", "completed", "failed"):
                assert value(f, "ddprun_rdzvd_jobs", state=state) == 0
            assert value(f, "ddprun_rdzvd_joins_total") == 0
            assert value(f, "ddprun_rdzvd_round_close_seconds_count") == 0

            worker = os.path.join(tmp, "worker.py")
            with open(worker, "w") as w:
                w.write(WORKER)
            agent = subprocess.run(
                [os.path.join(BIN_DIR, "ddprun"), "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "metrics-job", "--max-restarts", "1",
                 PYTHON, worker], capture_output=True, timeout=120, start_new_session=True)
            assert agent.returncode == 0, agent.stderr.decode()[-3000:]

            f = scrape(mport)
            assert value(f, "ddprun_rdzvd_joins_total") >= 2, f["ddprun_rdzvd_joins_total"]
            assert value(f, "ddprun_rdzvd_rounds_closed_total") >= 2
            assert value(f, "ddprun_rdzvd_restarts_total") == 1
            assert value(f, "ddprun_rdzvd_round_close_seconds_count") >= 2
            assert value(f, "ddprun_rdzvd_round_close_seconds_sum") >= 0
            assert value(f, "ddprun_rdzvd_jobs", state="completed") == 1
            assert value(f, "ddprun_rdzvd_connections_accepted_total") >= 1
            assert value(f, "ddprun_rdzvd_received_bytes_total") > 0
            assert value(f, "ddprun_rdzvd_sent_bytes_total") > 0
            assert value(f, "ddprun_rdzvd_frames_total") > 0
            assert value(f, "ddprun_rdzvd_store_ops_total", op="SET") >= 0

            # A malformed native frame: refused, connection closed for a protocol error.
            before = value(f, "ddprun_rdzvd_connections_refused_total", reason="protocol_error")
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(struct.pack("<BI", 0x40, 3) + b"{{{")
                read_all(s, 10)
            f = scrape(mport)
            assert value(f, "ddprun_rdzvd_refused_frames_total", reason="malformed") == 1
            assert value(f, "ddprun_rdzvd_connections_refused_total", reason="protocol_error") == before + 1

            check_hostile(mport)
            print("ok")
        finally:
            os.killpg(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()


if __name__ == "__main__":
    main()
